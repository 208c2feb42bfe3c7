"""Stage 06 on an sm_90 GPU, the backward (both versions, both ways of converting dQ) by the tolerance rule; a repeated
call of forward and backward (the speed layer's kept plans) as the first; stage 06's blocks inside the ring (stage 04)
and the GPT (stage 05). The probes and the forward: test_06_hopper_gpu.py."""
import numpy as np
import pytest

from stages.common import bfloat16
from tests.test_06_hopper_gpu import DTYPES, SHAPES, _hopper

pytestmark = pytest.mark.gpu

# ---------------------------------------------------------------- the backward
BACKWARD = [(v, D) for v in ("wgmma", "ws") for D in (64, 128, 256) if v == "wgmma" or D <= 128]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("version,D", BACKWARD)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_within_the_tolerance_rule(shape, causal, version, D, dtype):
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.hopper import flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(*shape, D, dtype=dtype, xp=cupy, grad=True)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, version=version)


@pytest.mark.parametrize("version,D", BACKWARD)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(3, 50, 150, 200), (3, 50, 200, 70)])
def test_backward_with_more_blocks_than_sms(shape, causal, version, D):
    """150 heads: blocks start as others finish, and their dQ reductions meet in the same rows; with Nq > Nk under
    the causal mask some rows see no key (their dq is 0) and with Nk > Nq some K/V tiles see no row (dk = dv = 0)."""
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.hopper import flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(*shape, D, dtype=bfloat16, xp=cupy, grad=True)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, version=version)


@pytest.mark.parametrize("fuse_dq", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(3, 50, 150, 200), (1, 3, 700, 333)])
def test_backward_ws_converts_dq_in_its_last_block_per_head_or_in_a_launch_of_its_own(shape, causal, D, fuse_dq):
    """Both ways of version ws, whatever fuse_dq_rule picks for the shape: the last block of each head to finish
    converts the head's accumulator only after every block's bulk reductions into it are complete and visible (150
    heads: blocks of many heads finish in every order), or bwd_convert_dq does it after the grid."""
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3_backward as fb

    _hopper()
    q, k, v, do = make_inputs(*shape, D, dtype=bfloat16, xp=cupy, grad=True)

    def backward(q, k, v, o, lse, do, *, causal, scale):
        plan = fb.launches("ws", np.dtype(q.dtype), q.shape, k.shape[2], causal, resolve_scale(scale, D),
                           fuse_dq=fuse_dq)
        assert (plan.convert is None) == fuse_dq
        return plan(q, k, v, o, lse, do)

    check_backward(backward, q, k, v, do, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("version,D", BACKWARD)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_at_inputs_times_100(causal, version, D, dtype):
    """Logits in the thousands: P = exp(scale S - L) must be one rounding of a number near 0, not the difference of
    two large rounded numbers."""
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.hopper import flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(1, 2, 128, 128, D, dtype=dtype, xp=cupy, scale=100.0, grad=True)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, version=version)


@pytest.mark.parametrize("version", ["wgmma", "ws"])
def test_backward_at_large_logits_and_rows_that_see_nothing(version):
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.hopper import flash_v3, flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(1, 2, 130, 70, 128, dtype=bfloat16, xp=cupy, scale=10.0, grad=True)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=True, version=version)  # rows 0..59 see no key
    o, lse = flash_v3.forward(q, k, v, causal=True)
    dq, dk, dv = flash_v3_backward.backward(q, k, v, o, lse, do, causal=True, version=version)
    assert not bool(dq[:, :, :60].any()) and all(bool(cupy.isfinite(x.astype(cupy.float32)).all())
                                                 for x in (dq, dk, dv))


def test_backward_refuses_what_it_does_not_take():
    import cupy

    from stages.common import make_inputs
    from stages.hopper import flash_v3_backward

    _hopper()
    q, k, v = make_inputs(1, 1, 64, 64, 96, dtype=np.float16, xp=cupy)
    lse = cupy.zeros((1, 1, 64), cupy.float32)
    with pytest.raises(ValueError, match="head_dim 96"):
        flash_v3_backward.backward(q, k, v, q, lse, q)
    q, k, v = make_inputs(1, 1, 64, 64, 64, dtype=np.float32, xp=cupy)
    with pytest.raises(TypeError, match="float16"):
        flash_v3_backward.backward(q, k, v, q, lse, q)
    q, k, v = make_inputs(1, 1, 64, 64, 64, dtype=np.float16, xp=cupy)
    with pytest.raises(TypeError, match="causal"):
        flash_v3_backward.backward(q, k, v, q, lse, q, causal="no")
    with pytest.raises(ValueError, match="version 'fast'"):
        flash_v3_backward.backward(q, k, v, q, lse, q, version="fast")
    q, k, v = make_inputs(1, 1, 64, 64, 256, dtype=np.float16, xp=cupy)
    with pytest.raises(ValueError, match="version 'wgmma' takes"):
        flash_v3_backward.backward(q, k, v, q, lse, q, version="ws")
    with pytest.raises(TypeError, match="CuPy arrays"):
        flash_v3_backward.backward(*(cupy.asnumpy(x) for x in (q, k, v, q, lse, q)))
    with pytest.raises(ValueError, match="lse has shape"):
        flash_v3_backward.backward(q, k, v, q, lse[:, :, :3], q)


@pytest.mark.parametrize("dtype", [bfloat16, np.float32], ids=["bf16", "fp32"])
def test_a_repeated_call_is_checked_and_planned_like_the_first(dtype):
    """forward and backward keep each checked call's plan under fast_path.call_key, its tensor maps described once
    and encoded for each call's arrays. A repeat on the same arrays gives the same o, lse (and dK, dV) bit for bit
    and its outputs from one allocation; new arrays of the same shapes (new addresses: new maps), a strided view (a
    copy, then a map of the copy) and other options are right by the rule; bad input is refused after a good call."""
    import cupy

    from stages.common import check_backward, check_forward, fast_path, make_inputs, to_numpy
    from stages.hopper import flash_v3, flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(1, 2, 200, 150, 64, dtype=dtype, xp=cupy, grad=True)
    o1, lse1 = flash_v3.forward(q, k, v)
    assert flash_v3.forward.plans.get(fast_path.call_key((q, k, v), {})) is not None
    o2, lse2 = flash_v3.forward(q, k, v)
    np.testing.assert_array_equal(to_numpy(o2).view(np.uint8), to_numpy(o1).view(np.uint8))
    np.testing.assert_array_equal(to_numpy(lse2), to_numpy(lse1))
    assert o2.data.mem.ptr == lse2.data.mem.ptr  # the kept plan carves o and lse from one allocation
    for causal, scale in ((True, None), (False, 0.05), (True, 0.3)):
        for _ in range(2):  # the first call plans, the second goes straight to the kept plan
            check_forward(flash_v3.forward, q, k, v, causal=causal, scale=scale)
    q2, k2, v2, do2 = make_inputs(1, 2, 200, 150, 64, dtype=dtype, xp=cupy, grad=True, scale=10.0)
    check_forward(flash_v3.forward, q2, k2, v2)
    wide = make_inputs(1, 2, 400, 150, 64, dtype=dtype, xp=cupy)[0]
    check_forward(flash_v3.forward, wide[:, :, ::2], k2, v2)  # a strided view, the shape (and key) of q
    with pytest.raises(TypeError, match="CuPy array"):
        flash_v3.forward(q, cupy.asnumpy(k), v)
    with pytest.raises(TypeError, match="causal"):
        flash_v3.forward(q, k, v, causal="no")
    if dtype == np.float32:  # the backward takes 16-bit inputs only
        return
    first = flash_v3_backward.backward(q, k, v, o1, lse1, do)
    assert flash_v3_backward.backward.plans.get(fast_path.call_key((q, k, v, o1, lse1, do), {})) is not None
    again = flash_v3_backward.backward(q, k, v, o1, lse1, do)
    for a, b in zip(first[1:], again[1:]):  # dK, dV: each block owns its keys (dQ: reductions in any order)
        np.testing.assert_array_equal(to_numpy(a).view(np.uint8), to_numpy(b).view(np.uint8))
    assert len({x.data.mem.ptr for x in again}) == 1  # dq, dk, dv from one allocation
    for causal, scale in ((True, None), (False, 0.05), (True, 0.3)):
        for _ in range(2):
            check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, scale=scale)
    check_backward(flash_v3_backward.backward, q2, k2, v2, do2)
    check_backward(flash_v3_backward.backward, wide[:, :, ::2], k2, v2, do2)
    with pytest.raises(TypeError, match="CuPy arrays"):
        flash_v3_backward.backward(q, k, v, o1, lse1, cupy.asnumpy(do))
    with pytest.raises(TypeError, match="causal"):
        flash_v3_backward.backward(q, k, v, o1, lse1, do, causal="no")


# ---------------------------------------------------------------- stage 06 inside the ring (stage 04) and the GPT (05)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_merge_into_the_running_o_and_lse_of_some_rows(D, dtype, causal):
    """A ring block: rows 40..289 of q against keys 0..149 and then 150..332 (causal: keys 150..332 alone, the mask
    aligned bottom-right inside the block), each merged in the kernel's epilogue into the running float32 O, L of
    those rows; the rows outside stay as they were."""
    import cupy

    from stages.common import cast, check_forward, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3

    _hopper()
    B, H, Lq, Lk = 2, 3, 300, 333
    q, k, v = make_inputs(B, H, Lq, Lk, D, dtype=dtype, xp=cupy)
    rows, blocks_of_keys = (40, 290), ([(150, Lk)] if causal else [(0, 150), (150, Lk)])
    k0 = blocks_of_keys[0][0]
    outside = {}

    def merged(q_rows, k_seen, v_seen, *, causal, scale):
        o_run = cupy.zeros((B, H, Lq, D), cupy.float32)
        lse_run = cupy.full((B, H, Lq), -np.inf, cupy.float32)
        for keys in blocks_of_keys:
            flash_v3.merge_into(q, k, v, o_run, lse_run, rows, keys, causal=causal, scale=resolve_scale(scale, D))
        outside["o"] = bool((o_run[:, :, :rows[0]] == 0).all() and (o_run[:, :, rows[1]:] == 0).all())
        outside["lse"] = bool(cupy.isneginf(lse_run[:, :, :rows[0]]).all()
                              and cupy.isneginf(lse_run[:, :, rows[1]:]).all())
        return cast(o_run[:, :, rows[0]:rows[1]], dtype), lse_run[:, :, rows[0]:rows[1]]

    check_forward(merged, q[:, :, rows[0]:rows[1]], k[:, :, k0:], v[:, :, k0:], causal=causal)
    assert outside == {"o": True, "lse": True}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_accumulate_into_the_ring_gradients_of_some_rows_and_keys(D, dtype, causal):
    """A ring block of the backward: rows 40..289 of q, o, lse, do against keys 0..149 and then 150..332 (causal: keys
    150..332 alone, the mask aligned bottom-right inside the block), added by the kernel into the ring's float32
    dQ (rows 40..289) and dK, dV (those keys); rows and keys outside stay 0."""
    import cupy

    from stages.common import cast, check_backward, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3_backward

    _hopper()
    B, H, Lq, Lk = 2, 3, 300, 333
    q, k, v, do = make_inputs(B, H, Lq, Lk, D, dtype=dtype, xp=cupy, grad=True)
    (a, b), blocks_of_keys = (40, 290), ([(150, Lk)] if causal else [(0, 150), (150, Lk)])
    k0 = blocks_of_keys[0][0]
    outside = {}

    def accumulated(q_rows, k_seen, v_seen, o_rows, lse_rows, do_rows, *, causal, scale):
        o, lse = cupy.zeros_like(q), cupy.zeros((B, H, Lq), cupy.float32)
        o[:, :, a:b], lse[:, :, a:b] = o_rows, lse_rows
        runs = [cupy.zeros((B, H, n, D), cupy.float32) for n in (Lq, Lk, Lk)]
        for keys in blocks_of_keys:
            flash_v3_backward.accumulate_into(q, k, v, o, lse, do, *runs, (a, b), keys, causal=causal,
                                              scale=resolve_scale(scale, D))
        dq, dk, dv = runs
        outside["dq"] = not bool(dq[:, :, :a].any() or dq[:, :, b:].any())
        outside["dk, dv"] = not bool(dk[:, :, :k0].any() or dv[:, :, :k0].any())
        return cast(dq[:, :, a:b], dtype), cast(dk[:, :, k0:], dtype), cast(dv[:, :, k0:], dtype)

    check_backward(accumulated, q[:, :, a:b], k[:, :, k0:], v[:, :, k0:], do[:, :, a:b], causal=causal)
    assert outside == {"dq": True, "dk, dv": True}


def _spy(monkeypatch, module, name):
    """Replace module.name by a wrapper that records each call in the returned list, then calls the original."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


def _spy_registered(monkeypatch, name):
    """_spy for the ring: it calls stage 06 through the kernels stage 06 registered (stages/common/attention_registry),
    so the spy wraps the registered function."""
    from stages.common import attention_registry
    from stages.hopper import flash_v3

    kernels = next(k for k in attention_registry.registered() if k.forward is flash_v3.forward)
    calls, real = [], getattr(kernels, name)
    spied = kernels._replace(**{name: lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]})
    monkeypatch.setitem(attention_registry._REGISTERED, kernels.name, spied)
    return calls


def test_ring_and_gpt_take_stage_06_on_hopper(monkeypatch):
    """On an sm_90 GPU the ring's blocks at the default versions are stage 06's merge_into and accumulate_into (stage
    02 version tc when named; a ring of one rank: stage 06's backward), and the GPT's flash_v2 attention in bfloat16
    runs stage 06's forward and backward."""
    import cupy

    from stages import ring
    from stages.common import check_backward, check_forward, make_inputs
    from stages.hopper import flash_v3, flash_v3_backward
    from stages.train_gpt import attention

    _hopper()
    # the GPT asks the registry (before the spies below stand in for the registered kernels)
    assert attention.StageAttention("flash_v2", 64, bfloat16).fwd is flash_v3.forward
    assert attention.StageAttention("flash_v2", 64, bfloat16).bwd is flash_v3_backward.backward
    assert attention.StageAttention("flash_v2", 64, np.float32).fwd is not flash_v3.forward
    assert attention.StageAttention("flash_v2", 64, np.float32).bwd is not flash_v3_backward.backward
    calls = _spy_registered(monkeypatch, "merge_into")
    q, k, v = make_inputs(1, 2, 512, 512, 128, dtype=bfloat16, xp=cupy)
    check_forward(ring.forward, q, k, v, causal=True, layout="zigzag", ranks=4, block="flash")
    assert calls, "the ring's forward blocks did not go through stage 06"
    calls.clear()
    check_forward(ring.forward, q, k, v, causal=True, layout="zigzag", ranks=4, block="flash", version="tc")
    assert not calls, "version 'tc' named: the ring must keep stage 02"
    bwd_calls = _spy_registered(monkeypatch, "accumulate_into")
    q, k, v, do = make_inputs(1, 2, 512, 512, 128, dtype=bfloat16, xp=cupy, grad=True)
    check_backward(ring.backward, q, k, v, do, causal=True, layout="zigzag", ranks=4, block="flash")
    assert bwd_calls, "the ring's backward blocks did not go through stage 06"
    whole = _spy_registered(monkeypatch, "backward")  # a ring of one rank: stage 06's backward itself
    for causal in (False, True):
        whole.clear()
        check_backward(ring.backward, q, k, v, do, causal=causal, layout="contiguous", ranks=1, block="flash")
        assert whole, f"a ring of one rank (causal={causal}) did not run stage 06's backward"
