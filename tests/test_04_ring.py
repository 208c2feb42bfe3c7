"""Stage 04: the whole ring, P ranks simulated in one process (threads running the very code an MPI rank runs).

CPU: the full case list, both layouts, forward and backward, against the fp64 oracle by the tolerance rule, with
stage 00 blocks and with the stage 02/03 calls (their numpy tile mirrors), 16 bits, the variants (grouped-query,
window, softcap, ALiBi, dropout), the error against P; agreement faults and a failing rank; clear errors for bad
options and arrays, in the caller's terms. gpu: the same simulation on CuPy with the stage 02/03 kernels.
"""

import numpy as np
import pytest

import stages.hopper  # noqa: F401  the caller registers stage 06's kernels: the GPU tests below run them on sm_90
from stages import naive, ring
from stages.common import bfloat16, check_backward, check_forward, make_inputs
from tests.conftest import CASE_IDS, CASES, DROPOUT_CASES, VARIANT_CASES, variant_inputs

HEAD_DIMS = (16, 32, 64, 128)  # the ring takes any head dim its block kernel takes


# ---------------------------------------------------------------- the whole ring, P ranks in one process


# The ring is held to the one-device rule: its blocks return float32 partial results (O_rj, and the parts of dQ_r,
# dK_j, dV_j) and it merges and adds them in float32, so it rounds once, at the end, as a single kernel does.


def _check_ring(q, k, v, do, causal, *, layout, ranks, **kw):
    """ring.forward and ring.backward (from the oracle's o, lse) by the shared tolerance rule."""
    kw.update(layout=layout, ranks=ranks)
    errs = check_forward(ring.forward, q, k, v, causal=causal, **kw)
    errs.update(check_backward(ring.backward, q, k, v, do, causal=causal, **kw))
    return errs


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_ring_simulated_cases(case, layout):
    B, H, Nq, Nk, D, causal, scale_in = case
    i = CASES.index(case)
    D = HEAD_DIMS[i % len(HEAD_DIMS)]  # vary the head dim over the case list
    P = 2 + i % 3  # 2, 3 or 4 ranks
    q, k, v, do = make_inputs(B, H, Nq, Nk, D, dtype=np.float32, scale=scale_in, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=P)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_backward_rotating_its_halves_in_place(layout, causal, monkeypatch):
    """The backward's low-memory way to move a half (no spare: each half rotates in place, comm.rotate) gives the same
    gradients as the default (a spare half the arriving one lands in)."""
    monkeypatch.setattr(ring.travel.Travel, "SPARE", False)
    q, k, v, do = make_inputs(1, 2, 67, 67, 32, dtype=np.float32, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=4)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_simulated_half_precision(dtype, layout, causal):
    """16 bits through the stage 02/03 tile mirrors in 16 bits (block="flash"): the one-device rule."""
    q, k, v, do = make_inputs(1, 2, 161, 161, 64, dtype=dtype, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=4, block="flash")


@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=["fp32", "bf16"])
def test_ring_error_does_not_grow_with_ranks(dtype):
    """P = 1, 2, 4, 8 simulated ranks on the same inputs: every P passes the one-device rule, and the error at
    P = 8 stays within the rule's bound of the error at P = 1 (float32 merges: one rounding at the end)."""
    q, k, v, do = make_inputs(1, 2, 256, 256, 64, dtype=dtype, grad=True)
    errs = {P: _check_ring(q, k, v, do, True, layout="zigzag", ranks=P) for P in (1, 2, 4, 8)}
    for name in errs[1]:
        assert errs[8][name] <= 2 * errs[1][name] + 1e-5, (name, {P: e[name] for P, e in errs.items()})


@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_with_stage_02_03_tile_mirrors(dtype, layout, causal):
    """block="flash" on numpy: the very calls the GPU ring makes (stage 02 forward, stage 03 backward, their
    version names), run by the stages' numpy tile mirrors. Odd lengths, Nq != Nk."""
    q, k, v, do = make_inputs(1, 2, 77, 90, 64, dtype=dtype, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=3, block="flash")


@pytest.mark.parametrize("causal", [False, True])
def test_ring_at_head_dim_256_through_the_tile_mirrors(causal):
    """Head dim 256 (float16 / bfloat16 only: stage 02's 'pipelined', stage 03's 'tc'), zigzag over 2 ranks."""
    q, k, v, do = make_inputs(1, 1, 50, 70, 256, dtype=bfloat16, grad=True)
    _check_ring(q, k, v, do, causal, layout="zigzag", ranks=2, block="flash")


# The variants through the ring: grouped-query k, v (they travel with their Hkv heads), a sliding window (steps with
# no visible key skipped), softcap, ALiBi and dropout (each block call at its origin in the whole problem: the oracle
# is the one-device result with the same seed, so the ring must draw the very same mask).
RING_VARIANTS = {name: VARIANT_CASES[name] for name in ("gqa", "window", "window-causal", "window-empty-rows",
                                                           "softcap", "alibi", "all")}
RING_VARIANTS.update(DROPOUT_CASES)
RING_VARIANTS["gqa-window-softcap"] = (1, 4, 2, 300, 300, True, {"window": (40, -1), "softcap": 10.0})


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("name", list(RING_VARIANTS))
def test_ring_simulated_with_options(name, layout):
    """float32 with stage 00 blocks, 2 to 4 ranks, against the fp64 oracle with the same options."""
    i = list(RING_VARIANTS).index(name)
    (q, k, v, do), causal, opts = variant_inputs(RING_VARIANTS[name], 32, np.float32, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=2 + i % 3, opts=opts)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("name", ["gqa", "window-causal", "gqa-window-softcap", "alibi", "all-dropout"])
def test_ring_with_options_through_the_tile_mirrors(name, layout, dtype):
    """16 bits through the stage 02/03 mirrors (block="flash"), 3 ranks: the one-device rule with the options."""
    (q, k, v, do), causal, opts = variant_inputs(RING_VARIANTS[name], 64, dtype, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=3, block="flash", opts=opts)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_dropout_grid_check_on_the_block_calls(layout):
    """The check the GPU ring makes before dropout (its kernels draw the mask 16 x 16 blocks at a time), run here on
    the block calls: 384 tokens put every call of every rank on the grid for 2, 3 and 4 ranks, causal, full, or with a
    right window side; 100 tokens on 3 ranks do not, nor does a left side off the 16 grid (a band's calls start one key
    apart), and the error names the call."""
    from stages.ring.problem import Problem, check_dropout_tiles

    def problem(n, P, r, causal, window):
        L = ring.shard_len(n, P, layout)
        return Problem(P, r, object(), 1, 2, 2, L, L, 64, n, n, layout, causal, 0.125, window, None, None, 0.1, 0,
                       tuple(ring.steps(P, n, n, layout, causal, window)))

    def check(n, P, causal, window):
        for r in range(P):
            check_dropout_tiles(problem(n, P, r, causal, window), "flash", "test")

    for P in (2, 3, 4):
        for causal, window in ((True, None), (False, None), (False, (-1, 16))):
            check(384, P, causal, window)  # no error
    for n, causal, window in ((100, True, None), (384, True, (60, -1))):
        with pytest.raises(ValueError, match=r"test: dropout on the GPU: .* a block call starts at query \d+, "
                                             r"key \d+"):
            check(n, 3, causal, window)


@pytest.mark.parametrize("api", ["forward", "backward"])
@pytest.mark.parametrize("bad,match", [
    (dict(alibi_slopes=np.ones(3, np.float32)), r"alibi_slopes has shape \(3,\); expected \(H,\) = \(2,\)"),
    (dict(dropout_p=1.0), r"dropout_p must be in \[0, 1\), got 1.0"),
    (dict(window=(-2, 0)), r"window \(-2, 0\): each side must be >= 0, or -1"),
    (dict(softcap=0.0), r"softcap must be a finite number > 0"),
])
def test_bad_ring_options_are_clear_errors(api, bad, match):
    q, k, v, do = make_inputs(1, 2, 10, 10, 8, dtype=np.float32, grad=True)
    o, lse = naive.forward(q, k, v)
    args = (q, k, v) if api == "forward" else (q, k, v, o, lse, do)
    with pytest.raises(ValueError, match=match):
        getattr(ring, api)(*args, **bad)
    _, k3, v3 = make_inputs(1, 3, 10, 10, 8, dtype=np.float32)
    q4 = make_inputs(1, 4, 10, 10, 8, dtype=np.float32)[0]
    with pytest.raises(ValueError, match=r"k and v have 3 heads, which does not divide q's 4 heads"):
        ring.forward(q4, k3, v3)


def test_one_rank_is_plain_attention():
    q, k, v, do = make_inputs(1, 2, 50, 50, 16, dtype=np.float32, grad=True)
    check_forward(ring.forward, q, k, v, causal=True, ranks=1)
    check_backward(ring.backward, q, k, v, do, causal=True, ranks=1)


def test_ranks_that_disagree_fail_on_every_rank():
    seen = []

    def body(comm):
        L = 8 if comm.rank != 1 else 10  # rank 1 has a different shard (each a valid zigzag shard on its own)
        x = np.zeros((1, 1, L, 4), np.float32)
        try:
            ring.ring_forward(x, x, x, ring=comm, block="naive")
        except ring.RingMismatch as e:
            seen.append((comm.rank, str(e)))
            raise

    with pytest.raises(ring.RingMismatch, match=r"ranks \[1\] disagree with rank 0"):
        ring.simulate(body, 3)
    assert sorted(r for r, _ in seen) == [0, 1, 2]  # every rank got the error, not just the odd one
    assert all("rank 1: k=(1, 1, 10, 4)" in msg for _, msg in seen)


def test_a_bad_input_on_one_rank_is_an_error_on_every_rank():
    seen = []

    def body(comm):
        x = np.zeros((1, 1, 8, 4), np.float32)
        q = x[0] if comm.rank == 2 else x  # rank 2 passes a rank-3 q
        try:
            ring.ring_forward(q, x, x, ring=comm, block="naive")
        except ring.RingMismatch as e:
            seen.append(str(e))
            raise

    with pytest.raises(ring.RingMismatch, match=r"rank 2 cannot run: ValueError: ring attention: q has shape"):
        ring.simulate(body, 3)
    assert len(seen) == 3 and len(set(seen)) == 1  # the same message on every rank


def test_an_error_on_one_rank_ends_every_rank():
    def body(comm):
        x = np.ones((1, 1, 8, 4), np.float32)
        if comm.rank == 2:
            raise RuntimeError("rank 2 broke")
        return ring.ring_forward(x, x, x, ring=comm, block="naive")  # the others wait on rank 2's blocks

    with pytest.raises(RuntimeError, match="rank 2 broke"):
        ring.simulate(body, 4)


def test_lanes_never_share_a_row():
    """The forward's calls run side by side on the GPU only in lanes whose query rows are disjoint (each merge rewrites
    its rows of O_r, L_r); a call that overlaps two lanes joins them. Every call is in one lane, in its order."""
    from stages.ring.compute import lanes as _lanes

    C = ring.BlockCall
    calls = [C(0, 10, 0, 5), C(10, 20, 0, 5), C(30, 40, 0, 5), C(5, 15, 5, 9), C(35, 38, 5, 9)]
    lanes = _lanes(calls, by_rows=True)
    assert sorted(map(tuple, lanes)) == sorted([(calls[0], calls[1], calls[3]), (calls[2], calls[4])])
    for i, x in enumerate(lanes):
        for y in lanes[i + 1:]:
            assert not any(c.q_start < d.q_stop and d.q_start < c.q_stop for c in x for d in y)
    assert _lanes(calls, by_rows=False) == [[c] for c in calls]  # atomics: every call a lane


def test_timeline_reports_every_step():
    q, k, v = make_inputs(1, 1, 64, 64, 8, dtype=np.float32)
    lines = []

    def body(comm):
        tl = []
        ring.ring_forward(*(ring.shard(x, comm.rank, 4, "zigzag") for x in (q, k, v)), ring=comm, causal=True,
                          layout="zigzag", block="naive", timeline=tl)
        lines.append(tl)

    ring.simulate(body, 4)
    assert len(lines) == 4 and all(len(tl) == 4 for tl in lines)
    assert all(t["compute_ms"] >= 0 and t["exposed_ms"] >= 0 for tl in lines for t in tl)


# ---------------------------------------------------------------- input errors, in the caller's terms


@pytest.mark.parametrize("api", ["forward", "backward"])
@pytest.mark.parametrize("bad,error,match", [
    (dict(ranks=0), ValueError, r"ring\.\w+: ranks must be a whole number >= 1, got 0"),
    (dict(ranks=2.5), ValueError, r"ranks must be a whole number >= 1"),
    (dict(causal="no"), TypeError, r"causal must be True or False, got 'no'"),
    (dict(layout="striped"), ValueError, r"layout 'striped' is not known"),
    (dict(block="fast"), ValueError, r"block 'fast' is not known"),
    (dict(block="naive", version="tc"), ValueError, r"block='naive' \(stage 00\) has no versions"),
    (dict(scale=-1.0), ValueError, r"scale must be a finite positive number"),
])
def test_bad_options_are_clear_errors(api, bad, error, match):
    q, k, v, do = make_inputs(1, 1, 10, 10, 8, dtype=np.float32, grad=True)
    o, lse = naive.forward(q, k, v)
    args = (q, k, v) if api == "forward" else (q, k, v, o, lse, do)
    with pytest.raises(error, match=match):
        getattr(ring, api)(*args, **bad)


def test_bad_arrays_are_errors_quoting_the_callers_shapes():
    q, k, v = make_inputs(1, 2, 10, 12, 8, dtype=np.float32)
    with pytest.raises(TypeError, match="expected numpy or CuPy arrays, got builtins.list"):
        ring.forward([q], k, v)
    with pytest.raises(ValueError, match=r"ring\.forward: q has shape \(2, 10, 8\) \(rank 3\)"):
        ring.forward(q[0], k, v)
    with pytest.raises(ValueError, match=r"ring\.forward: q \(1, 2, 10, 8\) and k \(1, 2, 12, 4\)"):
        ring.forward(q, k[..., :4], v[..., :4])
    o, lse = naive.forward(q, k, v)
    with pytest.raises(ValueError, match=r"ring\.backward: lse has shape \(1, 2, 9\)"):
        ring.backward(q, k, v, o, lse[:, :, :9], q)


def test_ring_forward_rejects_a_version_the_naive_block_ignores():
    x = np.zeros((1, 1, 8, 4), np.float32)
    with pytest.raises(ring.RingMismatch, match=r"rank \d cannot run: ValueError: .*block='naive' \(stage 00\) "
                                                r"has no versions, got version='fp32'"):
        ring.simulate(lambda comm: ring.ring_forward(x, x, x, ring=comm, block="naive", version="fp32"), 2)


def test_layout_helpers_check_their_arguments():
    with pytest.raises(ValueError, match="layout 'striped' is not known"):
        ring.shard_len(10, 2, "striped")
    with pytest.raises(ValueError, match="ranks must be a whole number >= 1, got 0"):
        ring.shard_len(10, 0, "zigzag")


# ---------------------------------------------------------------- GPU
# A subset of the case list (the whole list runs on the CPU above): one query, B*H > 1, Nq < Nk and Nq > Nk,
# fully masked rows, odd lengths, large logits, 4097 tokens.
GPU_CASES = [CASES[i] for i in (1, 2, 5, 6, 7, 9, 11, 12)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("case", GPU_CASES, ids=[CASE_IDS[CASES.index(c)] for c in GPU_CASES])
def test_gpu_ring_simulated_with_flash_blocks(case, layout, dtype):
    import cupy

    B, H, Nq, Nk, D, causal, scale_in = case
    i = CASES.index(case)
    D = (64, 128)[i % 2]
    q, k, v, do = make_inputs(B, H, Nq, Nk, D, dtype=dtype, xp=cupy, scale=scale_in, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=2 + i % 3, block="flash")


# The kernels draw dropout's mask 16 x 16 blocks at a time, so on the GPU every block call must start on that grid:
# 384 tokens make whole 16-row chunks for 2, 3 and 4 ranks in both layouts (and no window: a band's calls start one
# key apart).
RING_GPU_VARIANTS = {name: case for name, case in RING_VARIANTS.items() if name not in DROPOUT_CASES}
RING_GPU_VARIANTS["dropout"] = (1, 2, 2, 384, 384, False, {"dropout_p": 0.2, "seed": 99})
RING_GPU_VARIANTS["all-dropout"] = (1, 4, 2, 384, 384, True, {"softcap": 20.0, "dropout_p": 0.1, "seed": 5,
                                                              "alibi_slopes": VARIANT_CASES["all"][-1]["alibi_slopes"]})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("name", list(RING_GPU_VARIANTS))
def test_gpu_ring_with_options_and_flash_blocks(name, layout, D, dtype):
    """Grouped-query k, v, window, softcap, ALiBi and dropout through the flash kernels that add into the ring's
    float32 accumulators (stages 02/03; on an sm_90 GPU stage 06's for all but dropout), 2 to 4 simulated ranks,
    inputs x1 and x10 alternating: the one-device result, dropout mask included."""
    import cupy

    i = list(RING_GPU_VARIANTS).index(name)
    (q, k, v, do), causal, opts = variant_inputs(RING_GPU_VARIANTS[name], D, dtype, xp=cupy,
                                                 scale=(1.0, 10.0)[i % 2], grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=2 + i % 3, block="flash", opts=opts)


@pytest.mark.gpu
@pytest.mark.parametrize("api", ["forward", "backward"])
def test_gpu_ring_dropout_off_the_16_grid_is_a_clear_error(api):
    """100 tokens on 3 ranks: block calls start at rows that are not multiples of 16, which the kernels' dropout
    cannot draw; every rank says so before the ring turns."""
    import cupy

    q, k, v, do = make_inputs(1, 2, 100, 100, 64, dtype=bfloat16, xp=cupy, grad=True)
    o, lse = naive.forward(q, k, v, dropout_p=0.1)
    args = (q, k, v) if api == "forward" else (q, k, v, o, lse, do)
    with pytest.raises(ring.RingMismatch, match=r"dropout on the GPU: the kernels draw the mask in 16 x 16 blocks"):
        getattr(ring, api)(*args, ranks=3, block="flash", dropout_p=0.1)
