"""Stage 06 on an sm_90 GPU with the attention variants (kernels/flash_v3_forward_variants.cu,
flash_v3_backward_variants.cu): grouped-query and multi-query k, v, sliding windows, softcap, ALiBi and packed
variable-length batches, forward and backward, by the tolerance rule with the options given to the oracle too
(stage 02 / 03's cases: tests/conftest.py), every head dim each direction takes, float16 and bfloat16, inputs x1 and
x100; rows that see nothing; NaN in, NaN out; a packed batch's sequences equal to calls on each alone, bit for bit;
grouped-query heads equal to repeated ones; the ring's blocks with options; the clear refusals (dropout, versions and
head dims that do not take the variants). The CPU twins of what the kernels skip: tests/test_06_hopper_cpu.py."""
import numpy as np
import pytest

from stages.common import bfloat16, check_backward, check_forward, make_inputs, variants
from stages.common.verify import check_varlen
from tests.conftest import VARIANT_CASES, VARLEN_CASES, variant_inputs, varlen_inputs
from tests.test_06_hopper_gpu import DTYPES, _hopper

pytestmark = pytest.mark.gpu

# stage 02 / 03's packed cases without dropout (stages 02 and 03 keep it): "all" with softcap and ALiBi only
PACKED = {name: case[:-1] + ({n: x for n, x in case[-1].items() if n not in ("dropout_p", "seed")},)
          for name, case in VARLEN_CASES.items()}
# the inputs' scale per case: x1 everywhere, x100 (logits in the thousands) at D = 128
SCALES = [(D, 1.0) for D in (64, 128, 256)] + [(128, 100.0)]


def _cupy():
    import cupy

    _hopper()
    return cupy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,x", SCALES)
@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_forward_with_options_within_the_rule(name, D, x, dtype):
    from stages.hopper import flash_v3

    (q, k, v), causal, opts = variant_inputs(VARIANT_CASES[name], D, dtype, scale=x, xp=_cupy())
    check_forward(flash_v3.forward, q, k, v, causal=causal, opts=opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,x", [s for s in SCALES if s[0] <= 128])
@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_backward_with_options_within_the_rule(name, D, x, dtype):
    """dK, dV of a k / v head summed over its group's query heads inside the kernel; a window's Q tiles only."""
    from stages.hopper import flash_v3_backward

    (q, k, v, do), causal, opts = variant_inputs(VARIANT_CASES[name], D, dtype, scale=x, xp=_cupy(), grad=True)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, opts=opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", list(PACKED))
def test_a_packed_batch_is_each_sequence_by_the_rule(name, D, dtype):
    """One launch for the batch, forward and (D = 64, 128) backward; empty sequences, one-row sequences, lengths off
    tile multiples, Nq != Nk per sequence; each sequence's rows against the rule for that sequence alone."""
    from stages.hopper import flash_v3, flash_v3_backward

    (q, k, v, do), cq, ck, causal, opts = varlen_inputs(PACKED[name], D, dtype, xp=_cupy())
    check_varlen(flash_v3.forward_varlen, flash_v3_backward.backward_varlen if D <= 128 else None, q, k, v, do, cq, ck,
                 causal=causal, opts=opts)


def test_a_packed_batch_equals_calls_on_each_sequence_bit_for_bit():
    """Each sequence's o and lse from the packed launch are the bits of the same kernel on that sequence alone (the
    same tiles, order and hooks): the sequences' offsets and lengths are all the packed launch adds; and dq, dk, dv
    of each sequence are those of the backward on it alone."""
    from stages.hopper import flash_v3, flash_v3_backward, flash_v3_backward_variants, flash_v3_variants

    cp = _cupy()
    (q, k, v, do), cq, ck, causal, opts = varlen_inputs(PACKED["causal-window"], 64, bfloat16, xp=cp)
    o, lse = flash_v3.forward_varlen(q, k, v, cq, ck, causal=causal, **opts)
    grads = flash_v3_backward.backward_varlen(q, k, v, o, lse, do, cq, ck, causal=causal, **opts)
    for s in range(cq.size - 1):
        a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
        qs, ks, vs, os_, dos = (x[lo:hi].swapaxes(0, 1)[None].copy() for x, lo, hi in
                                ((q, a, b), (k, c, d), (v, c, d), (o, a, b), (do, a, b)))
        vo = variants.check(qs, ks, causal=causal, **opts)
        o1, lse1 = flash_v3_variants.forward(qs, ks, vs, causal=causal, scale=64 ** -0.5, opts=vo)
        assert bool((o[a:b].view(cp.uint16) == o1[0].swapaxes(0, 1).view(cp.uint16)).all()), f"sequence {s}: o"
        assert bool((lse[:, a:b] == lse1[0]).all()), f"sequence {s}: lse"
        g1 = flash_v3_backward_variants.backward(qs, ks, vs, os_, lse[None, :, a:b].copy(), dos, causal=causal,
                                                 scale=64 ** -0.5, opts=vo)
        for name, got, lo, hi, one in zip(("dq", "dk", "dv"), grads, (a, c, c), (b, d, d), g1):
            assert bool((got[lo:hi].view(cp.uint16) == one[0].swapaxes(0, 1).view(cp.uint16)).all()), \
                f"sequence {s}: {name}"


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_heads_equal_repeated_heads(causal):
    """k, v of 2 heads for 8 query heads: the forward's o and lse are those of the same kernel on k, v repeated to 8
    heads, bit for bit (only the k / v head a block reads differs); the backward's dk, dv are the repeated heads'
    gradients summed over each group (within their rounding to 16 bits), dq the same bits (two K/V tiles: each row
    of dQ gets two reductions, whose sum does not depend on their order)."""
    from stages.hopper import flash_v3_backward_variants, flash_v3_variants

    cp = _cupy()
    q, _, _, do = make_inputs(2, 8, 300, 256, 128, dtype=bfloat16, xp=cp, grad=True)
    _, k, v = make_inputs(2, 2, 300, 256, 128, dtype=bfloat16, xp=cp)
    kr, vr = cp.repeat(k, 4, axis=1), cp.repeat(v, 4, axis=1)
    grouped, repeated = (variants.check(q, kk, causal=causal, window=(200, -1)) for kk in (k, kr))
    o, lse = flash_v3_variants.forward(q, k, v, causal=causal, scale=0.1, opts=grouped)
    o_r, lse_r = flash_v3_variants.forward(q, kr, vr, causal=causal, scale=0.1, opts=repeated)
    assert bool((o.view(cp.uint16) == o_r.view(cp.uint16)).all()) and bool((lse == lse_r).all())
    dq, dk, dv = flash_v3_backward_variants.backward(q, k, v, o, lse, do, causal=causal, scale=0.1, opts=grouped)
    dq_r, dk_r, dv_r = flash_v3_backward_variants.backward(q, kr, vr, o, lse, do, causal=causal, scale=0.1,
                                                           opts=repeated)
    assert bool((dq.view(cp.uint16) == dq_r.view(cp.uint16)).all())
    for g, r in ((dk, dk_r), (dv, dv_r)):
        want = r.astype(cp.float32).reshape(2, 2, 4, 256, 128).sum(axis=2)
        assert float(cp.abs(g.astype(cp.float32) - want).max()) <= 2 ** -6 * float(cp.abs(want).max())


def test_rows_that_see_no_key_and_nan_in_nan_out():
    """A window (0, 0) with Nq > Nk: the rows whose diagonal falls outside the keys see none (o = 0, lse = -inf,
    dq = 0). A NaN in one key makes exactly the rows whose window holds it NaN; the others stay finite. A NaN in a
    query row makes that row NaN and no other (multi-query k, v and softcap)."""
    from stages.hopper import flash_v3, flash_v3_backward

    cp = _cupy()
    q, k, v, do = make_inputs(1, 2, 150, 90, 64, dtype=bfloat16, xp=cp, grad=True)
    o, lse = flash_v3.forward(q, k, v, window=(0, 0))
    seen = variants.visible(150, 90, variants.check(np.zeros((1, 1, 150, 1)), np.zeros((1, 1, 90, 1)),
                                                    causal=False, window=(0, 0))).any(axis=1)
    unseen = cp.asarray(~seen)
    assert 0 < int(unseen.sum()) < 150
    assert bool(cp.isneginf(lse[:, :, unseen]).all()) and not bool(o[:, :, unseen].any())
    dq, _, _ = flash_v3_backward.backward(q, k, v, o, lse, do, window=(0, 0))
    assert not bool(dq[:, :, unseen].any()) and bool(cp.isfinite(dq).all())
    k_bad = k.copy()
    k_bad[0, 1, 40, 0] = np.nan
    o, lse = flash_v3.forward(q[:, :, :90], k_bad, v, window=(3, 2))  # row r sees keys r - 3 .. r + 2: key 40 is
    rows = cp.zeros(90, bool)                                          # seen by rows 38 .. 43
    rows[38:44] = True
    assert bool(cp.isnan(lse[0, 1, rows]).all()) and bool(cp.isnan(o[0, 1, rows]).all())
    assert bool(cp.isfinite(lse[0, 1, ~rows]).all()) and bool(cp.isfinite(o[0, 1, ~rows]).all())
    assert bool(cp.isfinite(lse[0, 0]).all())
    q_bad = q.copy()
    q_bad[0, 0, 100, 3] = np.nan
    o, lse = flash_v3.forward(q_bad, k[:, :1], v[:, :1], causal=True, softcap=10.0)  # multi-query; rows < 60 see
    assert bool(cp.isnan(lse[0, 0, 100])) and bool(cp.isnan(o[0, 0, 100]).all())     # no key (lse = -inf)
    others = (cp.arange(150) != 100) & (cp.arange(150) >= 60)
    assert bool(cp.isfinite(lse[0, 0, others]).all()) and bool(cp.isfinite(lse[0, 1, 60:]).all())


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_with_options_converts_dq_in_its_last_block_per_group_or_after(dtype, fuse, monkeypatch):
    """dQ of the variants' backward: converted by the last block of each (batch, k / v head), for its group's query
    heads, or by stage 03's conversion after the kernel (FUSE_DQ_MAX 0: every plan has the launch); more blocks than
    SMs (64 k / v heads), and a packed batch."""
    from stages.hopper import backward_steps, flash_v3, flash_v3_backward, flash_v3_backward_variants

    cp = _cupy()
    flash_v3_backward.backward.plans.clear()  # no plan kept from another test: each call plans afresh
    if not fuse:
        monkeypatch.setattr(backward_steps, "FUSE_DQ_MAX", 0)
    made = []
    fresh = flash_v3_backward_variants._plan.__wrapped__
    monkeypatch.setattr(flash_v3_backward_variants, "_plan", lambda *a: made.append(fresh(*a)) or made[-1])
    q, _, _, do = make_inputs(2, 128, 200, 150, 64, dtype=dtype, xp=cp, grad=True)
    _, k, v = make_inputs(2, 64, 200, 150, 64, dtype=dtype, xp=cp)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=True, opts={"window": (60, -1)})
    (q, k, v, do), cq, ck, causal, opts = varlen_inputs(PACKED["mixed"], 64, dtype, xp=cp)
    check_varlen(flash_v3.forward_varlen, flash_v3_backward.backward_varlen, q, k, v, do, cq, ck, causal=causal,
                 opts=opts)
    assert made and all((plan.convert is None) == fuse for plan in made)


# ---------------------------------------------------------------- the ring's blocks with options
@pytest.mark.parametrize("D", [64, 128])
def test_ring_blocks_with_grouped_heads_a_window_softcap_and_alibi(D):
    """A ring block with options: rows 40..289 of q (8 heads) against keys 150..332 of k, v (2 heads), its own window,
    softcap and ALiBi at its origin in the whole problem; merge_into merges O_i, L_i into the running float32 (O, L) of
    those rows, accumulate_into adds dQ, dK, dV (dK, dV of the k / v heads) into the ring's float32 accumulators. Both
    against the rule for the block as a problem of its own (the oracle at that origin)."""
    from stages.common import cast
    from stages.hopper import flash_v3, flash_v3_backward

    cp = _cupy()
    B, H, Hkv, Lq, Lk = 1, 8, 2, 300, 333
    rows, keys = (40, 290), (150, Lk)
    q, _, _, do = make_inputs(B, H, Lq, Lk, D, dtype=bfloat16, xp=cp, grad=True)
    _, k, v = make_inputs(B, Hkv, Lq, Lk, D, dtype=bfloat16, xp=cp)
    qs, ks, vs, dos = q[:, :, 40:290], k[:, :, 150:], v[:, :, 150:], do[:, :, 40:290]
    opts = {"window": (90, 20), "softcap": 15.0, "alibi_slopes": np.linspace(0.5, 0.05, H).astype(np.float32),
            "origin": (40, 150, Lk - Lq)}

    def merged(q_, k_, v_, *, causal, scale, **kw):
        o_run, lse_run = cp.zeros((B, H, Lq, D), cp.float32), cp.full((B, H, Lq), -np.inf, cp.float32)
        flash_v3.merge_into(q, k, v, o_run, lse_run, rows, keys, causal=causal, scale=scale or D ** -0.5,
                            opts=variants.check(q_, k_, causal=causal, **kw))
        return cast(o_run[:, :, 40:290], bfloat16), lse_run[:, :, 40:290]

    def accumulated(q_, k_, v_, o, lse, do_, *, causal, scale, **kw):
        runs = [cp.zeros((B, H, Lq, D), cp.float32), cp.zeros((B, Hkv, Lk, D), cp.float32),
                cp.zeros((B, Hkv, Lk, D), cp.float32)]
        o_all, lse_all = cp.zeros_like(q), cp.zeros((B, H, Lq), cp.float32)
        o_all[:, :, 40:290], lse_all[:, :, 40:290] = o, lse
        flash_v3_backward.accumulate_into(q, k, v, o_all, lse_all, do, *runs, rows, keys, causal=causal,
                                          scale=scale or D ** -0.5, opts=variants.check(q_, k_, causal=causal, **kw))
        return (cast(runs[0][:, :, 40:290], bfloat16), cast(runs[1][:, :, 150:], bfloat16),
                cast(runs[2][:, :, 150:], bfloat16))

    check_forward(merged, qs, ks, vs, causal=False, opts=opts)
    check_backward(accumulated, qs, ks, vs, dos, causal=False, opts=opts)


# ---------------------------------------------------------------- what stage 06 does not take: clear errors
def test_what_the_variants_do_not_take_is_a_clear_error():
    from stages.hopper import flash_v3, flash_v3_backward

    cp = _cupy()
    q, k, v, do = make_inputs(1, 4, 64, 64, 64, dtype=np.float16, xp=cp, grad=True)
    o, lse = flash_v3.forward(q, k, v)
    with pytest.raises(ValueError, match="not dropout: dropout runs in stage 02 version 'pipelined'"):
        flash_v3.forward(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="not dropout"):
        flash_v3_backward.backward(q, k, v, o, lse, do, dropout_p=0.1)
    with pytest.raises(ValueError, match="run in version 'pingpong'.*not 'ws'"):
        flash_v3.forward(q, k, v, window=(8, 8), version="ws")
    with pytest.raises(ValueError, match="not 'fp8'"):
        flash_v3.forward(*make_inputs(1, 2, 64, 64, 128, dtype=np.float16, xp=cp), softcap=5.0, version="fp8")
    with pytest.raises(ValueError, match="not 'fp32x3'"):
        flash_v3.forward(q.astype(cp.float32), k.astype(cp.float32), v.astype(cp.float32), window=(8, 8))
    with pytest.raises(ValueError, match="does not divide"):
        flash_v3.forward(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="version 'ws' .or 'auto'., not 'wgmma'"):
        flash_v3_backward.backward(q, k[:, :2], v[:, :2], o, lse, do, version="wgmma")
    q2, k2, v2, do2 = make_inputs(1, 2, 64, 64, 256, dtype=np.float16, xp=cp, grad=True)
    o2, lse2 = flash_v3.forward(q2, k2, v2, window=(8, 8))  # the forward takes D = 256
    with pytest.raises(ValueError, match="head dims .64, 128.*stage 03 version 'tc'"):
        flash_v3_backward.backward(q2, k2, v2, o2, lse2, do2, window=(8, 8))
    packed = [x[0].swapaxes(0, 1).copy() for x in (q, k, v, do)]
    cu = np.array([0, 30, 64], np.int32)
    with pytest.raises(ValueError, match="packed batches run in version 'pingpong'"):
        flash_v3.forward_varlen(*packed[:3], cu, cu, version="wgmma")
    with pytest.raises(ValueError, match="out_dtype"):
        flash_v3.forward_varlen(*packed[:3], cu, cu, out_dtype=np.float32)
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_v3.forward_varlen(*packed[:3], np.array([0, 40, 30, 64], np.int32), np.array([0, 10, 20, 64]))
