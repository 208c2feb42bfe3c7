"""Stage 03 with the variants (stages/common/variants.py): grouped-query k and v, sliding window, softcap, ALiBi and
dropout. CPU: the tile mirror against the fp64 oracle by the tolerance rule (the oracle gets the same options), the
window's Q-tile range per K/V tile, and wrong variant backwards caught. GPU: version 'tc' with every option,
dropout included, float16 and bfloat16, d = 64 and 128, inputs x1 and x100; the backward's regenerated dropout mask
equal to the definition bit for bit; what it does not take is a clear error."""
import numpy as np
import pytest

from stages import flash_v2_backward as fb
from stages.common import bfloat16, check_backward, make_inputs, variants
from stages.common.verify import check_varlen
from tests.conftest import DROPOUT_CASES, VARIANT_CASES, VARLEN_CASES, variant_inputs, varlen_inputs

OPTIONS = {**VARIANT_CASES, **DROPOUT_CASES}
RUNS = [("fp32", np.dtype(np.float32)), ("tc", np.dtype(np.float16)), ("tc", bfloat16)]


def _inputs(case, D, dtype, scale=1.0, xp=np):
    (q, k, v, do), causal, opts = variant_inputs(case, D, dtype, scale=scale, xp=xp, grad=True)
    return q, k, v, do, causal, opts

@pytest.mark.parametrize("x", [1.0, 100.0], ids=["x1", "x100"])
@pytest.mark.parametrize("version,dtype", RUNS, ids=["fp32", "tc-fp16", "tc-bf16"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_mirror_with_options_against_oracle(name, version, dtype, x):
    q, k, v, do, causal, opts = _inputs(OPTIONS[name], 64, dtype, scale=x)
    check_backward(fb.backward, q, k, v, do, causal=causal, opts=opts, version=version)


@pytest.mark.parametrize("window,causal", [((70, 30), False), ((0, 0), False), ((200, -1), True), ((-1, 5), False)])
@pytest.mark.parametrize("Nq,Nk", [(300, 300), (150, 400), (400, 150)])
def test_window_q_tile_range_covers_exactly_the_visible_rows(Nq, Nk, window, causal):
    """For each K/V tile j the mirror visits the Q tiles from the first to the last holding a row that sees a key
    of K_j: none missed, and none outside that span."""
    q = np.zeros((1, 1, Nq, 8))
    k = np.zeros((1, 1, Nk, 8))
    opts = variants.check(q, k, causal=causal, window=window)
    vis = variants.visible(Nq, Nk, opts)
    br, bc = fb.mirror.tiles("tc", 64)
    for j in range(-(-Nk // bc)):
        rows = np.flatnonzero(vis[:, j * bc:(j + 1) * bc].any(axis=1))
        want = range(rows[0] // br, rows[-1] // br + 1) if rows.size else range(0)
        assert fb.mirror._tile_range(j, bc, br, Nq, Nk, causal, opts) == want


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(np.float32)], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_mirror_varlen_backward_is_each_sequence_by_the_rule(name, dtype):
    (q, k, v, do), cq, ck, causal, opts = varlen_inputs(VARLEN_CASES[name], 64, dtype)
    check_varlen(fb.forward_varlen, fb.backward_varlen, q, k, v, do, cq, ck, causal=causal, opts=opts)


@pytest.mark.gpu
@pytest.mark.parametrize("x", [1.0, 100.0], ids=["x1", "x100"])
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_gpu_varlen_backward_is_each_sequence_by_the_rule(name, D, dt, x):
    """One backward launch for the packed batch (version 'tc'); each sequence's dq, dk, dv against its own rule."""
    import cupy as cp

    (q, k, v, do), cq, ck, causal, opts = varlen_inputs(VARLEN_CASES[name], D, {"fp16": np.float16,
                                                                                "bf16": bfloat16}[dt], scale=x, xp=cp)
    check_varlen(fb.forward_varlen, fb.backward_varlen, q, k, v, do, cq, ck, causal=causal, opts=opts)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_gpu_variants_with_dq_converted_by_a_launch_of_its_own(dt, monkeypatch):
    """Above TC_FUSE_DQ_MAX accumulator elements per head, the variants' and packed batches' dQ is converted by
    bwd_convert_dq after the tc kernel (which gets null dQ and counters). A limit of 0 sends these small problems
    that way: every plan has the third launch, and the rule still holds (a sequence without keys included)."""
    import cupy as cp

    monkeypatch.setattr(fb.tc, "TC_FUSE_DQ_MAX", 0)  # fb.tc: version tc's launcher and its tables
    made = []  # the launches this test's calls plan, recorded
    fresh = fb.tc.launches
    monkeypatch.setattr(fb.tc, "launches", lambda *args, **kw: made.append(fresh(*args, **kw)) or made[-1])
    fb.backward.plans.clear()  # no plan kept by another test: every call below plans its launches afresh
    dtype = {"fp16": np.float16, "bf16": bfloat16}[dt]
    for name in ("gqa", "window-empty-rows", "all", "all-dropout"):
        q, k, v, do, causal, opts = _inputs(OPTIONS[name], 64, dtype, xp=cp)
        check_backward(fb.backward, q, k, v, do, causal=causal, opts=opts, version="tc")
    for name in VARLEN_CASES:
        (q, k, v, do), cq, ck, causal, opts = varlen_inputs(VARLEN_CASES[name], 64, dtype, xp=cp)
        check_varlen(fb.forward_varlen, fb.backward_varlen, q, k, v, do, cq, ck, causal=causal, opts=opts)
    assert made and all(plan.convert is not None and plan.done == 0 for plan in made)
    fb.backward.plans.clear()  # the plans kept above converted dQ under this test's limit


@pytest.mark.gpu
@pytest.mark.parametrize("x", [1.0, 100.0], ids=["x1", "x100"])
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_gpu_tc_backward_with_options_against_oracle(name, D, dt, x):
    import cupy as cp

    q, k, v, do, causal, opts = _inputs(OPTIONS[name], D, {"fp16": np.float16, "bf16": bfloat16}[dt], scale=x,
                                        xp=cp)
    check_backward(fb.backward, q, k, v, do, causal=causal, opts=opts, version="tc")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_backward_regenerates_the_definitions_dropout_bits(causal):
    """q = k = 0 (P uniform over the visible keys) and dO = I (Nq = D = 128): dV = (P Z)^T dO / (1 - p) puts
    Z_ij / ((1 - p) n_i) in dV_ji, so the mask the backward regenerated is read back from dV and equals
    variants.dropout_keep at every visible (i, j), for two seeds."""
    import cupy as cp

    from stages.common import cast

    B, H, Nk, D, p = 2, 3, 200, 128, 0.25
    q = cp.zeros((B, H, D, D), bfloat16)
    k = cp.zeros((B, H, Nk, D), bfloat16)
    v = cast(cp.asarray(make_inputs(B, H, D, Nk, D, dtype=np.float32)[2]), bfloat16)
    do = cast(cp.broadcast_to(cp.eye(D, dtype=cp.float32), (B, H, D, D)), bfloat16)
    vis = variants.visible(D, Nk, variants.check(np.zeros((1, 1, D, 1)), np.zeros((1, 1, Nk, 1)), causal=causal))
    n_vis = np.maximum(vis.sum(axis=1), 1)
    for seed in (7, 3 * 2**32 + 11):
        o, lse = fb.forward(q, k, v, causal=causal, dropout_p=p, seed=seed)
        _, _, dv = fb.backward(q, k, v, o, lse, do, causal=causal, dropout_p=p, seed=seed)
        z = np.swapaxes(cast(dv, np.float32).get(), -1, -2) * (1 - p) * n_vis[None, None, :, None]  # (B, H, D, Nk)
        assert np.all((np.abs(z) < 1e-3) | (np.abs(z - 1) < 1e-2)), "dV is not a 0/1 mask times 1 / ((1 - p) n)"
        want = variants.dropout_keep(B, H, D, Nk, p, seed)
        got = z > 0.5
        assert np.array_equal(got & vis, want & vis), f"seed {seed}: {int(((got ^ want) & vis).sum())} bits differ"


@pytest.mark.gpu
def test_gpu_backward_variants_it_does_not_take_are_a_clear_error():
    import cupy as cp

    q, k, v, do = make_inputs(1, 2, 64, 64, 64, dtype=np.float16, xp=cp, grad=True)
    o, lse = cp.zeros_like(q), cp.zeros((1, 2, 64), cp.float32)
    with pytest.raises(ValueError, match="deterministic=False"):
        fb.backward(q, k, v, o, lse, do, window=(8, 8), deterministic=True)
    with pytest.raises(ValueError, match="deterministic=False"):
        fb.backward(q, k, v, o, lse, do, dropout_p=0.1, deterministic=True)
    q32, k32, v32, o32, do32 = (x.astype(cp.float32) for x in (q, k, v, o, do))
    with pytest.raises(ValueError, match="version 'tc'"):
        fb.backward(q32, k32[:, :1], v32[:, :1], o32, lse, do32)

@pytest.mark.parametrize("mistake", ["softcap ignored", "kv group not summed", "dropout rescale dropped",
                                     "window off by one"])
def test_rule_catches_a_wrong_variant_backward(mistake):
    """The check above fails a backward that applies an option wrongly."""
    q, k, v, do, causal, opts = _inputs(OPTIONS["all-dropout"], 64, np.float32)

    def wrong(q, k, v, o, lse, do, **kw):
        if mistake == "softcap ignored":  # the backward of the uncapped scores, from the capped forward's o, lse
            vo = variants.check(q, k, causal=kw["causal"], **{n: kw[n] for n in ("window", "alibi_slopes",
                                                                                  "softcap", "dropout_p", "seed")})
            return fb.mirror.backward(q, k, v, o, lse, do, causal=kw["causal"], scale=64 ** -0.5, version="fp32",
                                      deterministic=False, opts=vo._replace(softcap=0.0))
        if mistake == "kv group not summed":
            dq, dk, dv = fb.backward(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), o, lse, do, **kw)
            return dq, dk[:, ::2], dv[:, ::2]
        if mistake == "dropout rescale dropped":
            dq, dk, dv = fb.backward(q, k, v, o, lse, do, **kw)
            return dq, dk, dv * (1 - kw["dropout_p"])
        return fb.backward(q, k, v, o, lse, do, **{**kw, "window": (65, -1)})

    with pytest.raises(AssertionError, match="exceeds the bound"):
        check_backward(wrong, q, k, v, do, causal=causal, opts=opts, version="fp32")
