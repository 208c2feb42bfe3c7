"""Stage 02 with the variants (stages/common/variants.py): grouped-query k and v, sliding window, softcap, ALiBi and
dropout.

CPU (CI): every version's tile mirror against the fp64 oracle by the tolerance rule with each option, and the
window's tile skipping (only the band of tiles that holds a visible key is visited). GPU (marker gpu): version
'pipelined' with grouped-query k/v, window, softcap, ALiBi and dropout over a case list in float16 and bfloat16,
inputs x1 and x100, every head dim; dropout's mask read back from the kernel equal to the numpy definition bit for
bit, and a function of the seed only; the plain path unchanged by the options' plumbing; what the GPU does not take
(other versions) is a clear error."""
import numpy as np
import pytest

from stages import flash_v2
from stages.common import bfloat16, cast, check_forward, make_inputs, variants
from stages.common.verify import check_varlen
from tests.conftest import DROPOUT_CASES, VARIANT_CASES, VARLEN_CASES, variant_inputs, varlen_inputs

LOW = {"fp16": np.dtype(np.float16), "bf16": bfloat16}
MIRROR_RUNS = [("fp32", np.dtype(np.float32)), ("pipelined", bfloat16), ("tc", np.dtype(np.float16)),
               ("fp32x3", np.dtype(np.float32))]


def _inputs(case, D, dtype, scale=1.0, xp=np):
    (q, k, v), causal, opts = variant_inputs(case, D, dtype, scale=scale, xp=xp)
    return q, k, v, causal, opts

@pytest.mark.parametrize("version,dtype", MIRROR_RUNS, ids=[v for v, _ in MIRROR_RUNS])
@pytest.mark.parametrize("name", list(VARIANT_CASES) + list(DROPOUT_CASES))
def test_mirror_with_options_against_oracle(name, version, dtype):
    q, k, v, causal, opts = _inputs({**VARIANT_CASES, **DROPOUT_CASES}[name], 64, dtype)
    check_forward(flash_v2.forward, q, k, v, causal=causal, opts=opts, version=version)


@pytest.mark.parametrize("window,causal", [((70, 30), False), ((0, 0), False), ((200, -1), True), ((-1, 5), False),
                                          ((10, 10), False)])
@pytest.mark.parametrize("Nq,Nk", [(300, 300), (150, 400), (400, 150)])
def test_window_visits_only_its_band_of_tiles(Nq, Nk, window, causal):
    """A tile is visited iff some (row, key) in it is visible, and masked where some is not: the work grows with
    the window, not with Nk."""
    q, k, v = make_inputs(1, 1, Nq, Nk, 64, dtype=np.float16)
    opts = variants.check(q, k, causal=causal, window=window)
    br, bc = flash_v2.tiles("pipelined", 64)
    trace = []
    flash_v2.mirror.forward(q, k, v, causal=causal, scale=0.125, br=br, bc=bc, trace=trace, opts=opts)
    vis = variants.visible(Nq, Nk, opts)
    expected = []
    for i in range(-(-Nq // br)):
        for j in range(-(-Nk // bc)):
            tile = vis[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            if tile.any():
                expected.append((i, j, not tile.all() or tile.shape[1] < bc))
    assert [(i, j) for i, j, _ in trace] == [(i, j) for i, j, _ in expected]
    for (_, _, masked), (_, _, needed) in zip(trace, expected):
        assert masked or not needed


@pytest.mark.parametrize("version,dtype", [("pipelined", bfloat16), ("fp32", np.dtype(np.float32))],
                         ids=["pipelined-bf16", "fp32"])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_mirror_varlen_is_each_sequence_by_the_rule(name, version, dtype):
    (q, k, v, do), cq, ck, causal, opts = varlen_inputs(VARLEN_CASES[name], 64, dtype)
    check_varlen(flash_v2.forward_varlen, None, q, k, v, do, cq, ck, causal=causal, opts=opts, version=version)


@pytest.mark.parametrize("mistake", ["attends across sequences", "last sequence's keys dropped"])
def test_varlen_check_catches_a_wrong_packed_forward(mistake):
    """The per-sequence rule fails a forward_varlen that lets sequences see each other's keys, or drops a key."""
    (q, k, v, do), cq, ck, causal, opts = varlen_inputs(VARLEN_CASES["causal-window"], 64, bfloat16)

    def wrong(q, k, v, cu_q, cu_k, **kw):
        if mistake == "attends across sequences":
            o, lse = flash_v2.forward(q.swapaxes(0, 1)[None], k.swapaxes(0, 1)[None], v.swapaxes(0, 1)[None], **kw)
            return np.ascontiguousarray(o[0].swapaxes(0, 1)), lse[0]
        cu_k = cu_k.copy()
        cu_k[-2] += 1  # the last sequence starts one key late
        return flash_v2.forward_varlen(q, k, v, cu_q, cu_k, **kw)

    with pytest.raises(AssertionError, match="varlen sequence"):
        check_varlen(wrong, None, q, k, v, do, cq, ck, causal=causal, opts=opts)


def test_kernel_variant_level():
    """The level of the pipelined kernel's VAR instantiation each call gets: 0 plain or causal (grouped-query too),
    1 a window or a packed batch (masks only, the plain path's score units), 2 softcap, ALiBi or dropout (the scores
    or P change: a call that got level 1 would silently drop them)."""
    from stages.flash_v2 import tc

    O = variants.Options
    assert tc._var_level(None, False, None) == 0
    assert tc._var_level(O(causal=True, right=0, group=4), True, None) == 0  # causal is the plain kernel's mask
    assert tc._var_level(O(left=100, right=0, causal=True), True, None) == 1
    assert tc._var_level(O(right=0), False, None) == 1  # a right bound without causal is a window
    assert tc._var_level(None, True, (3, 100)) == 1
    for opt in ({"softcap": 5.0}, {"alibi_slopes": np.ones(2, np.float32)}, {"dropout_p": 0.1}):
        assert tc._var_level(O(**opt), False, None) == 2
        assert tc._var_level(O(left=10, **opt), True, (3, 100)) == 2


# ---------------------------------------------------------------- GPU
def _cupy():
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("x", [1.0, 100.0], ids=["x1", "x100"])
@pytest.mark.parametrize("dt", list(LOW))
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_gpu_pipelined_with_options_against_oracle(name, D, dt, x):
    q, k, v, causal, opts = _inputs(VARIANT_CASES[name], D, LOW[dt], scale=x, xp=_cupy())
    check_forward(flash_v2.forward, q, k, v, causal=causal, opts=opts, version="pipelined")


@pytest.mark.gpu
@pytest.mark.parametrize("x", [1.0, 100.0], ids=["x1", "x100"])
@pytest.mark.parametrize("dt", list(LOW))
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", list(DROPOUT_CASES))
def test_gpu_pipelined_with_dropout_against_oracle(name, D, dt, x):
    q, k, v, causal, opts = _inputs(DROPOUT_CASES[name], D, LOW[dt], scale=x, xp=_cupy())
    check_forward(flash_v2.forward, q, k, v, causal=causal, opts=opts, version="pipelined")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_dropout_draws_the_definitions_bits(causal):
    """q = k = 0 makes P uniform over the visible keys and V = I (Nk = D = 128) puts P~_ij Z_ij / (1 - p) in o_ij:
    the kernel's mask, read back from o, equals variants.dropout_keep at every visible (i, j) of several heads,
    Q tiles and K/V tiles, for two seeds (one above 2^32: both key words)."""
    cp = _cupy()
    B, H, Nq, D, p = 2, 3, 200, 128, 0.25
    q = cp.zeros((B, H, Nq, D), bfloat16)
    k = cp.zeros((B, H, D, D), bfloat16)
    v = cast(cp.broadcast_to(cp.eye(D, dtype=cp.float32), (B, H, D, D)), bfloat16)
    for seed in (7, 3 * 2**32 + 11):
        o, _ = flash_v2.forward(q, k, v, causal=causal, version="pipelined", dropout_p=p, seed=seed)
        o = cast(o, np.float32).get()
        vis = variants.visible(Nq, D, variants.check(np.zeros((1, 1, Nq, 1)), np.zeros((1, 1, D, 1)), causal=causal))
        n_vis = vis.sum(axis=1)[None, None, :, None]  # keys each row sees: P = 1 / n_vis
        z = o * (1 - p) * np.maximum(n_vis, 1)
        assert np.all((np.abs(z) < 1e-3) | (np.abs(z - 1) < 1e-2)), "o is not a 0/1 mask times 1 / ((1 - p) n)"
        want = variants.dropout_keep(B, H, Nq, D, p, seed)
        got = z > 0.5
        assert np.array_equal(got & vis, want & vis), f"seed {seed}: {int(((got ^ want) & vis).sum())} bits differ"
        assert not got[..., ~vis].any()  # masked keys stay 0


@pytest.mark.gpu
@pytest.mark.parametrize("x", [1.0, 100.0], ids=["x1", "x100"])
@pytest.mark.parametrize("dt", list(LOW))
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_gpu_varlen_is_each_sequence_by_the_rule(name, D, dt, x):
    """One launch for the packed batch; each sequence's rows checked against the rule for that sequence alone."""
    (q, k, v, do), cq, ck, causal, opts = varlen_inputs(VARLEN_CASES[name], D, LOW[dt], scale=x, xp=_cupy())
    check_varlen(flash_v2.forward_varlen, None, q, k, v, do, cq, ck, causal=causal, opts=opts)


@pytest.mark.gpu
def test_gpu_varlen_equals_separate_calls_bit_for_bit():
    """Each sequence's o and lse from the packed launch are the bits of a call on that sequence alone (the same
    kernel, tiles and summation order)."""
    cp = _cupy()
    (q, k, v, _), cq, ck, causal, opts = varlen_inputs(VARLEN_CASES["causal-window"], 64, bfloat16, xp=cp)
    o, lse = flash_v2.forward_varlen(q, k, v, cq, ck, causal=causal, **opts)
    for s in range(cq.size - 1):
        a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
        os_, ls = flash_v2.forward(*(x[lo:hi].swapaxes(0, 1)[None] for x, lo, hi in ((q, a, b), (k, c, d),
                                                                                      (v, c, d))),
                                   causal=causal, version="pipelined", **opts)
        assert bool((o[a:b].view(cp.uint16) == os_[0].swapaxes(0, 1).view(cp.uint16)).all())
        assert bool((lse[:, a:b] == ls[0]).all())


@pytest.mark.gpu
def test_gpu_varlen_clear_errors():
    cp = _cupy()
    (q, k, v, _), cq, ck, _, _ = varlen_inputs(VARLEN_CASES["mixed"], 64, np.float16, xp=cp)
    bad = cq.copy()
    bad[2], bad[3] = bad[3], bad[2]  # a negative length
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_v2.forward_varlen(q, k, v, bad, ck)
    with pytest.raises(ValueError, match="ends at"):
        flash_v2.forward_varlen(q, k, v, cq[:-1], ck[:-1])
    with pytest.raises(ValueError, match="longer than max_seqlen"):
        flash_v2.forward_varlen(q, k, v, cq, ck, max_seqlen_q=2)
    with pytest.raises(ValueError, match="pipelined"):
        flash_v2.forward_varlen(q, k, v, cq, ck, version="tc")
    with pytest.raises(ValueError, match="packed"):
        flash_v2.forward_varlen(q[None], k, v, cq, ck)


@pytest.mark.gpu
def test_gpu_dropout_is_a_function_of_the_seed():
    """Same seed, same o bit for bit (also after other seeds went through the same launch plan); another seed, another
    o; p = 0 is plain attention bit for bit."""
    cp = _cupy()
    q, k, v = make_inputs(1, 4, 300, 300, 64, dtype=bfloat16, xp=cp)

    def run(**kw):
        return flash_v2.forward(q, k, v, causal=True, version="pipelined", **kw)[0].view(cp.uint16)

    a = run(dropout_p=0.1, seed=1)
    b = run(dropout_p=0.1, seed=2)
    assert not bool((a == b).all())
    assert bool((run(dropout_p=0.1, seed=1) == a).all())
    assert bool((run(dropout_p=0.0, seed=1) == run()).all())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_options_that_change_nothing_give_the_same_bits(causal):
    """window (-1, -1), Hkv = H by repeated heads, zero ALiBi slopes: the same o as plain attention, bit for bit
    where the same kernel path runs (GQA, the plain window), and within the rule where the variant path runs."""
    cp = _cupy()
    q, k, v = make_inputs(2, 4, 300, 300, 64, dtype=bfloat16, xp=cp)
    o, lse = flash_v2.forward(q, k, v, causal=causal, version="pipelined")
    o2, lse2 = flash_v2.forward(q, k, v, causal=causal, version="pipelined", window=(-1, -1))
    assert bool((o2.view(cp.uint16) == o.view(cp.uint16)).all()) and bool((lse2 == lse).all())
    kg, vg = k[:, :2], v[:, :2]
    og, _ = flash_v2.forward(q, kg, vg, causal=causal, version="pipelined")
    orep, _ = flash_v2.forward(q, cp.repeat(kg, 2, axis=1), cp.repeat(vg, 2, axis=1), causal=causal,
                               version="pipelined")
    assert bool((og.view(cp.uint16) == orep.view(cp.uint16)).all())
    check_forward(flash_v2.forward, q, k, v, causal=causal, opts={"alibi_slopes": np.zeros(4, np.float32)},
                  version="pipelined")


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(LOW))
def test_gpu_float_output_with_options_is_the_unrounded_result(dt):
    """out_dtype=float32 (a ring block's partial result) with window, softcap and ALiBi: the same float32 O the
    16-bit output is rounded from (bit for bit once rounded), and the same lse."""
    cp = _cupy()
    (q, k, v), causal, opts = variant_inputs(VARIANT_CASES["all"], 64, LOW[dt], xp=cp)
    o16, lse16 = flash_v2.forward(q, k, v, causal=causal, version="pipelined", **opts)
    o32, lse32 = flash_v2.forward(q, k, v, causal=causal, version="pipelined", out_dtype=np.float32, **opts)
    assert o32.dtype == np.float32 and o16.dtype == LOW[dt]
    assert bool((cast(o32, LOW[dt]).view(cp.uint16) == o16.view(cp.uint16)).all())
    assert bool((lse32 == lse16).all())


@pytest.mark.gpu
def test_gpu_options_the_kernels_do_not_take_are_clear_errors():
    cp = _cupy()
    q, k, v = make_inputs(1, 2, 64, 64, 64, dtype=np.float16, xp=cp)
    with pytest.raises(ValueError, match="pipelined"):
        flash_v2.forward(q, k, v, version="tc", window=(8, 8))
    with pytest.raises(ValueError, match="pipelined"):
        flash_v2.forward(q, k, v, version="tc", dropout_p=0.1)
    with pytest.raises(ValueError, match="keeps no probability"):
        flash_v2.forward(q, k, v, version="pipelined", dropout_p=1 - 2.0**-40)
    o32, _ = flash_v2.forward(q, k[:, :1], v[:, :1], version="pipelined", out_dtype=np.float32)  # GQA: allowed
    assert o32.dtype == np.float32
    q32, k32, v32 = (x.astype(cp.float32) for x in (q, k, v))
    with pytest.raises(ValueError, match="pipelined"):
        flash_v2.forward(q32, k32[:, :1], v32[:, :1], version="fp32")
