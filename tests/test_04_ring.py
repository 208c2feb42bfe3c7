"""Stage 04: ring attention.

CPU: the ring's pieces (merge, plan, layouts, padding) against direct formulas; the whole ring simulated in
one process (P ranks as threads, the very code an MPI rank runs) over the full case list, both layouts,
forward and backward, against the fp64 oracle by the tolerance rule, with stage 00 blocks and with the
stage 02/03 calls (their numpy tile mirrors); agreement faults and a failing rank, in-process.
mpi: `mpirun -n 2` and `-n 4` of run.py on the numpy backend (both layouts, causal and not, lengths that
need padding, bf16 with stage 02/03 blocks, --backend auto), the two faults (ranks that disagree; an
error on one rank: nonzero exit within seconds, with a timeout so that a hang fails instead of blocking
CI), and dev/bench_ring.py's CPU smoke run. gpu: the simulation on CuPy with the stage 02/03 kernels; run.py
with 4 ranks on one GPU (mpi backend); the NCCL ring's transfers on one GPU (a rank sending to itself);
and, with two GPUs, run.py on the nccl backend (skipped with the reason otherwise).
"""
import csv
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from stages import naive, ring
from stages.common import bfloat16, check_backward, check_forward, make_inputs, variants
from stages.common.launch import mpi_env, mpirun_command
from tests.conftest import CASE_IDS, CASES, DROPOUT_CASES, VARIANT_CASES, variant_inputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / "stages" / "04_ring" / "run.py"
HEAD_DIMS = (16, 32, 64, 128)  # the ring takes any head dim its block kernel takes


# ---------------------------------------------------------------- the merge


def test_merge_of_two_halves_is_attention_of_the_whole():
    q, k, v = make_inputs(2, 3, 9, 20, 8, dtype=np.float64)
    o, lse = naive.forward(q, k, v)
    o_a, lse_a = naive.forward(q, k[:, :, :7], v[:, :, :7])
    o_b, lse_b = naive.forward(q, k[:, :, 7:], v[:, :, 7:])
    o_m, lse_m = ring.merge(o_a.copy(), lse_a.copy(), o_b, lse_b)
    np.testing.assert_allclose(o_m, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse_m, lse, rtol=1e-12)


def test_merge_is_stable_and_handles_empty_rows():
    o_a = np.ones((1, 1, 3, 4), np.float32)
    o_b = 2 * np.ones((1, 1, 3, 4), np.float32)
    lse_a = np.array([[[-np.inf, 1e4, -np.inf]]], np.float32)  # empty, huge, empty
    lse_b = np.array([[[-np.inf, 1e4, 5.0]]], np.float32)  # empty, huge, finite
    o_a[0, 0, [0, 2]] = 0  # an empty partial result is O = 0
    o_b[0, 0, 0] = 0
    o, lse = ring.merge(o_a, lse_a, o_b, lse_b)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert np.isneginf(lse[0, 0, 0]) and (o[0, 0, 0] == 0).all()  # both empty: stays empty
    np.testing.assert_allclose(lse[0, 0, 1], 1e4 + np.log(2), rtol=1e-6)  # no overflow at 1e4
    np.testing.assert_allclose(o[0, 0, 1], 1.5)
    assert lse[0, 0, 2] == 5.0 and (o[0, 0, 2] == 2).all()  # one side empty: the other side unchanged


# ---------------------------------------------------------------- layouts and the plan


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("n,P", [(1, 4), (7, 2), (16, 4), (100, 3), (1001, 4)])
def test_shard_unshard_round_trip_pads_with_zeros(n, P, layout):
    x = np.random.default_rng().standard_normal((2, 3, n, 5))
    shards = [ring.shard(x, r, P, layout) for r in range(P)]
    assert all(s.shape == (2, 3, ring.shard_len(n, P, layout), 5) for s in shards)
    np.testing.assert_array_equal(ring.unshard(shards, n, layout), x)
    pos = np.concatenate([ring.positions(r, P, n, layout) for r in range(P)])
    assert sorted(pos) == list(range(len(pos)))  # every position exactly once
    for r, s in enumerate(shards):
        assert (s[:, :, ring.positions(r, P, n, layout) >= n] == 0).all()  # padding rows are zero


def test_zigzag_holds_chunks_r_and_2p_minus_1_minus_r():
    assert ring.positions(0, 2, 8, "zigzag").tolist() == [0, 1, 6, 7]
    assert ring.positions(1, 2, 8, "zigzag").tolist() == [2, 3, 4, 5]
    assert ring.positions(1, 2, 8, "contiguous").tolist() == [4, 5, 6, 7]


def _visible_from_plan(calls, Lq, Lk):
    """How often each (row, key) of the block is computed by the calls, each under its own kernel mask."""
    seen = np.zeros((Lq, Lk), int)
    for c in calls:
        opts = variants.Options(left=c.left, right=c.right)  # the kernel's mask: bottom-right on its sub-problem
        seen[c.a:c.b, c.c:c.m] += variants.visible(c.b - c.a, c.m - c.c, opts)
    return seen


WINDOWS = [None, (3, -1), (0, 0), (2, 5), (-1, 4), (40, -1)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,P", [(16, 16, 4), (13, 13, 2), (37, 100, 3), (100, 60, 4), (5, 1, 2), (1, 1, 3)])
def test_plan_covers_exactly_the_visible_keys(nq, nk, P, causal, layout, window):
    """Over all P blocks, the calls cover each (real query, real key) pair once iff the mask allows it (causal and
    a sliding window, each call under its own kernel mask), padded keys never; the steps with work are exactly the
    steps at which some call exists."""
    if causal and window is not None and window[1] > 0:
        window = (window[0], 0)
    opts = variants.Options(causal, *(window or (-1, -1)))
    full = variants.visible(nq, nk, opts._replace(right=0) if causal else opts)
    busy = set()
    for r in range(P):
        qpos = ring.positions(r, P, nq, layout)
        for src in range(P):
            kpos = ring.positions(src, P, nk, layout)
            calls = ring.plan(qpos, kpos, nq, nk, causal, window)
            seen = _visible_from_plan(calls, len(qpos), len(kpos))
            real_q, real_k = qpos < nq, kpos < nk
            want = full[np.ix_(qpos[real_q], kpos[real_k])].astype(int)
            np.testing.assert_array_equal(seen[np.ix_(real_q, real_k)], want)
            assert (seen[:, ~real_k] == 0).all()  # padded keys are never computed with
            if calls:
                busy.add((r - src) % P)
    assert ring.steps(P, nq, nk, layout, causal, window) == sorted(busy)


def test_contiguous_causal_is_full_diagonal_or_skipped():
    P, n = 4, 64
    q2 = ring.positions(2, P, n, "contiguous")
    full, diag = ring.BlockCall(0, 16, 0, 16, -1, -1), ring.BlockCall(0, 16, 0, 16, -1, 0)
    assert ring.plan(q2, ring.positions(0, P, n, "contiguous"), n, n, True) == [full]  # before: full
    assert ring.plan(q2, ring.positions(2, P, n, "contiguous"), n, n, True) == [diag]  # same: diagonal
    assert ring.plan(q2, ring.positions(3, P, n, "contiguous"), n, n, True) == []  # after: skipped
    assert diag.mask() == {"causal": True} and full.mask() == {"causal": False}


def test_a_window_is_a_band_of_calls_and_skips_far_blocks():
    """Contiguous, causal, window (5, -1): the block before sees a lower triangle (a window call), the own block a
    band, every other block nothing."""
    P, n = 4, 64
    q2 = ring.positions(2, P, n, "contiguous")
    before = ring.plan(q2, ring.positions(1, P, n, "contiguous"), n, n, True, (5, -1))
    own = ring.plan(q2, ring.positions(2, P, n, "contiguous"), n, n, True, (5, -1))
    assert before == [ring.BlockCall(0, 5, 11, 16, 0, -1)]  # row i sees keys 11+i..15 of block 1
    assert own == [ring.BlockCall(0, 6, 0, 6, -1, 0), ring.BlockCall(6, 16, 1, 16, 5, 0)]  # a causal corner, a band
    assert own[1].mask() == {"causal": False, "window": (5, 0)}
    assert ring.plan(q2, ring.positions(0, P, n, "contiguous"), n, n, True, (5, -1)) == []


@pytest.mark.parametrize("layout,window,causal,want", [
    ("contiguous", None, True, [0, 1, 2, 3]),
    ("contiguous", (100, -1), True, [0, 1]),  # a window shorter than a shard: the own block and the one before
    ("contiguous", (100, 100), False, [0, 1, 3]),  # and the one after: rank r + 1 holds it, step P - 1
    ("contiguous", (300, -1), True, [0, 1, 2]),
    ("zigzag", (100, -1), True, [0, 1, 3]),  # chunk r needs chunk r - 1, chunk 2P-1-r needs chunk 2P-2-r (rank r+1)
    ("zigzag", None, False, [0, 1, 2, 3]),
])
def test_the_ring_visits_only_the_steps_with_work(layout, window, causal, want):
    """schedule(): the steps with work, the hops K, V and the dK, dV accumulators make, and the timeline shows
    that only those steps ran (N = 1024, P = 4: shards of 256 rows)."""
    P, n = 4, 1024
    sched = ring.schedule(P, n, n, layout=layout, causal=causal, window=window)
    assert sched["steps"] == want
    assert sched["kv_hops"] == len(want) - 1 and sched["dkv_hops"] == len(want) - (want[-1] == 0)
    q, k, v = make_inputs(1, 1, n, n, 8, dtype=np.float32)
    lines = []

    def body(comm):
        tl = []
        ring.ring_forward(*(ring.shard(x, comm.rank, P, layout) for x in (q, k, v)), ring=comm, causal=causal,
                          layout=layout, block="naive", timeline=tl, window=window)
        lines.append([t["step"] for t in tl])

    ring.simulate(body, P)
    assert lines == [want] * P


def test_grouped_query_kv_travel_with_their_own_heads():
    """The bytes of one hop: K and V with Hkv heads (H / Hkv times fewer than H heads), dK and dV in float32."""
    B, H, Hkv, L, D = 2, 32, 8, 512, 128
    plain = ring.schedule(4, 4 * L, 4 * L, kv_shape=(B, H, L, D), dtype=bfloat16)
    gqa = ring.schedule(4, 4 * L, 4 * L, kv_shape=(B, Hkv, L, D), dtype=bfloat16)
    assert gqa["kv_bytes_per_hop"] == 2 * B * Hkv * L * D * 2 == plain["kv_bytes_per_hop"] // (H // Hkv)
    assert gqa["dkv_bytes_per_hop"] == 2 * B * Hkv * L * D * 4


def test_zigzag_balances_causal_work():
    """Every rank computes the same number of (query, key) pairs under zigzag; contiguous does not."""
    P, n = 4, 256

    def work(layout, r):
        qpos = ring.positions(r, P, n, layout)
        return sum(c.pairs() for src in range(P) for c in ring.plan(qpos, ring.positions(src, P, n, layout), n, n,
                                                                     True))

    zig = [work("zigzag", r) for r in range(P)]
    con = [work("contiguous", r) for r in range(P)]
    assert sum(zig) == sum(con) == n * (n + 1) // 2
    assert max(zig) == min(zig)
    assert max(con) > 3 * min(con)


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
    monkeypatch.setattr(ring.ring._Travel, "SPARE", False)
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
def test_dropout_grid_check_on_the_plans(layout):
    """The check the GPU ring makes before dropout (its kernels draw the mask 16 x 16 blocks at a time), run here on
    the plans: 384 tokens put every call of every rank on the grid for 2, 3 and 4 ranks, causal, full, or with a
    right window side; 100 tokens on 3 ranks do not, nor does a left side off the 16 grid (a band's calls start one key
    apart), and the error names the call."""
    from stages.ring.ring import Problem, check_dropout_tiles

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
        L = 8 if comm.rank != 1 else 9  # rank 1 has a different shard
        x = np.zeros((1, 1, L, 4), np.float32)
        try:
            ring.ring_forward(x, x, x, ring=comm, block="naive")
        except ring.RingMismatch as e:
            seen.append((comm.rank, str(e)))
            raise

    with pytest.raises(ring.RingMismatch, match=r"ranks \[1\] disagree with rank 0"):
        ring.simulate(body, 3)
    assert sorted(r for r, _ in seen) == [0, 1, 2]  # every rank got the error, not just the odd one
    assert all("rank 1: k=(1, 1, 9, 4)" in msg for _, msg in seen)


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


# ---------------------------------------------------------------- mpirun


FAULT_SECONDS = 30  # a fault must end the job within this (start-up included); a hang hits the 60 s timeout


def _launch(n, *args, timeout=60):
    env = mpi_env()
    cmd = mpirun_command(n) + [sys.executable, str(RUN), *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun hung for {timeout} s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")
    _launch.seconds = time.monotonic() - t0
    return p.returncode, p.stdout + p.stderr


def test_mpi_env_puts_this_checkout_first_on_the_ranks_path(monkeypatch):
    """The ranks import the `stages` of this checkout (the one the tests import), installed or not; an existing
    PYTHONPATH stays after it."""
    import stages

    root = str(pathlib.Path(stages.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", ""]))
    assert mpi_env()["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
    monkeypatch.delenv("PYTHONPATH")
    assert mpi_env()["PYTHONPATH"] == root
    assert mpi_env(PYTHONPATH="/only")["PYTHONPATH"] == "/only"  # an explicit value still wins


MPI_RUNS = [  # (ranks, layout, causal, total length): both layouts, both masks, lengths that need padding
    (2, "contiguous", False, 101),
    (2, "zigzag", True, 99),
    (4, "zigzag", True, 257),
    (4, "contiguous", False, 130),
]


@pytest.mark.mpi
@pytest.mark.parametrize("n,layout,causal,seq", MPI_RUNS,
                         ids=[f"n{n}-{lay}-{'causal' if c else 'full'}-N{s}" for n, lay, c, s in MPI_RUNS])
def test_mpirun_numpy_backend(n, layout, causal, seq):
    extra = [] if causal else ["--no-causal"]
    rc, out = _launch(n, "--quick", "--backend", "numpy", "--layout", layout, "--check-seq", str(seq),
                      "--seq", "64", *extra)
    assert rc == 0, out
    assert f"check on the full sequence (N={seq})" in out, out
    assert "backend numpy -> numpy" in out and "All results match" in out
    assert out.rstrip().splitlines()[-1].startswith(f"SUMMARY 04_ring PASS {n} ranks numpy"), out


@pytest.mark.mpi
def test_mpirun_bfloat16_with_stage_02_03_blocks():
    """bf16 shards moved as raw bytes by MPI, blocks computed by the stage 02/03 calls (their tile mirrors)."""
    rc, out = _launch(2, "--quick", "--backend", "numpy", "--block", "flash", "--dtype", "bfloat16",
                      "--check-seq", "301", "--seq", "64")
    assert rc == 0, out
    assert "blocks flash (stage 02 version pipelined, stage 03 version tc)" in out, out
    assert "SUMMARY 04_ring PASS 2 ranks numpy" in out, out


@pytest.mark.mpi
def test_mpirun_with_grouped_query_window_and_softcap():
    """MPI point-to-point with the window's skipped steps (a hop of two ranks, and the dK, dV hop home): 4 ranks,
    zigzag, N = 256 (shards of 64), window (30, -1): steps 0, 1 and 3 have work. One k, v head for 4 query heads."""
    rc, out = _launch(4, "--quick", "--backend", "numpy", "--heads", "4", "--kv-heads", "1", "--window", "30", "-1",
                      "--softcap", "20", "--check-seq", "256", "--seq", "256")
    assert rc == 0, out
    assert "steps with work [0, 1, 3] of 4" in out and "All results match" in out, out
    assert "SUMMARY 04_ring PASS 4 ranks numpy" in out, out


@pytest.mark.mpi
def test_mpirun_auto_backend_says_what_it_picked():
    rc, out = _launch(2, "--quick", "--check-seq", "64", "--seq", "64")
    assert rc == 0, out
    assert "backend auto -> " in out and "SUMMARY 04_ring PASS 2 ranks" in out, out


# Fault injection: run.py itself, under mpirun, with one rank's ring patched before run.py starts (run.py has
# no fault options). argv: fault ("mismatch" or "error"), the faulty rank, then run.py's own options.
FAULT_RUN = """
import runpy, sys
from stages import ring
from stages.ring import comm
fault, bad, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if comm.world().Get_rank() == bad:
    if fault == "mismatch":  # this rank calls the ring with the other mask: the ranks disagree
        ring_forward = ring.ring_forward
        ring.ring_forward = lambda *a, **kw: ring_forward(*a, **dict(kw, causal=not kw["causal"]))
    else:  # this rank's second block call raises, mid-ring, while the others wait on it
        fwd, bwd = ring.BLOCKS["naive"]
        calls = []
        def failing(*a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure on this rank")
            return fwd(*a, **kw)
        ring.BLOCKS["naive"] = (failing, bwd)
sys.argv = [run] + sys.argv[4:]
runpy.run_path(run, run_name="__main__")
"""


def _launch_fault(n, fault, bad, *args, timeout=60):
    cmd = mpirun_command(n) + [sys.executable, "-c", FAULT_RUN, fault, str(bad), str(RUN), *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun hung for {timeout} s: {fault} on rank {bad}\n{e.stdout}\n{e.stderr}")
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


@pytest.mark.mpi
def test_mpirun_ranks_that_disagree_get_an_error_each():
    rc, out, seconds = _launch_fault(2, "mismatch", 1, "--quick", "--backend", "numpy")
    assert rc != 0
    assert seconds < FAULT_SECONDS, f"the job took {seconds:.0f} s to end"
    for r in range(2):
        assert f"[rank {r}] ERROR: RingMismatch: ring attention: ranks [1] disagree with rank 0" in out, out
    assert "SUMMARY" not in out


@pytest.mark.mpi
def test_mpirun_error_on_one_rank_aborts_the_job():
    rc, out, seconds = _launch_fault(4, "error", 2, "--quick", "--backend", "numpy", "--block", "naive")
    assert rc != 0
    assert seconds < FAULT_SECONDS, f"the job took {seconds:.0f} s to end"
    assert "[rank 2] ERROR: RuntimeError: injected failure" in out, out
    assert "SUMMARY" not in out


@pytest.mark.mpi
def test_bench_ring_runs_on_the_cpu_and_writes_its_csv(tmp_path):
    """dev/bench_ring.py is for GPUs; its numpy backend runs the same code on the CPU, so it cannot rot unseen."""
    out = tmp_path / "ring_cpu.csv"
    cmd = mpirun_command(2) + [sys.executable, str(ROOT / "dev" / "bench_ring.py"), "--backend", "numpy",
                               "--configs", "8k-causal", "8k-causal-gqa", "8k-full", "--tokens", "32", "--heads", "2",
                               "--head-dim", "16", "--repeat", "1", "--out", str(out)]
    env = mpi_env()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["gpus"]) for r in rows] == [1, 1, 1, 2, 2, 2]  # rings of 1 and 2 ranks, 3 configs each
    assert [r["config"] for r in rows[:3]] == ["8k-causal", "8k-causal-gqa", "8k-full"]
    for r in rows:
        assert float(r["ring_fwd_ms"]) > 0 and float(r["one_gpu_bwd_ms"]) > 0 and float(r["peak_mb_per_gpu"]) > 0
        assert 0 < float(r["efficiency"]) and r["torch_cp_flash_fwd_ms"] == ""  # no PyTorch CP on the CPU
        assert r["gpu"] == "CPU" and r["backend"] == "numpy"


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
    """Grouped-query k, v, window, softcap, ALiBi and dropout through the stage 02/03 kernels (float32 partial
    results), 2 to 4 simulated ranks, inputs x1 and x10 alternating: the one-device result, dropout mask included."""
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


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_gpu_mpirun_mpi_backend_four_ranks_one_gpu(layout, causal):
    extra = [] if causal else ["--no-causal"]
    rc, out = _launch(4, "--quick", "--backend", "mpi", "--layout", layout, "--check-seq", "1001", "--seq", "2048",
                      *extra, timeout=240)
    assert rc == 0, out
    assert "blocks flash (stage 02 version" in out, out  # the blocks ran stages 02/03
    assert "SUMMARY 04_ring PASS 4 ranks mpi" in out, out


@pytest.mark.gpu
@pytest.mark.mpi
def test_gpu_mpirun_mpi_backend_with_grouped_query_and_window():
    """The mpi backend (CuPy staged through the host) with hops of more than one rank: 4 ranks on one GPU. The blocks
    are stage 02/03 (bfloat16) on sm_80 and newer; a T4 (float32 by default) runs stage 00 blocks on the GPU and says
    why."""
    from stages.common import device

    rc, out = _launch(4, "--quick", "--backend", "mpi", "--heads", "8", "--kv-heads", "2", "--window", "300", "-1",
                      "--check-seq", "2048", "--seq", "8192", timeout=240)
    assert rc == 0, out
    assert "steps with work [0, 1, 3] of 4" in out, out
    if device.device().arch.bf16:
        assert "blocks flash (stage 02 version pipelined, stage 03 version tc)" in out, out
    else:
        assert "blocks naive (stage 00; on the GPU the flash blocks take" in out, out
    assert "SUMMARY 04_ring PASS 4 ranks mpi" in out, out


NCCL_SELF_TEST = """
import sys; sys.path.insert(0, ".")
import cupy, numpy as np
from stages.common import bfloat16, cast
from stages.ring import comm
ring, backend, why = comm.setup("nccl")
ring.MIN_CHUNK = 4096  # several chunks through the staging buffer, as a large block takes
x = cast(cupy.random.default_rng().standard_normal((2, 3, 100, 64), dtype=np.float32), bfloat16)
buf = x.reshape(-1).view(cupy.uint8)
before = buf.copy()
h = ring.rotate(buf, shift=1)  # one rank: its bytes go to itself and come back, chunk by chunk
ring.wait(h)
assert bool((buf == before).all()), "NCCL rotation changed the bytes"
total = ring.allreduce_sum([cupy.arange(5, dtype=np.float32)])[0]
assert bool((total == cupy.arange(5, dtype=np.float32)).all()), "NCCL all-reduce of one rank changed the values"
print("NCCL self transfer OK", backend, why)
"""


@pytest.mark.gpu
@pytest.mark.mpi
def test_gpu_nccl_ring_transfers_on_one_gpu():
    """The nccl backend's own code (NCCL id over MPI, grouped send/recv on its stream, the staging buffer, events) on
    ONE GPU: the one rank's ring rotates a buffer to itself. (Two ranks need two GPUs: NCCL refuses two ranks on one
    GPU.)"""
    env = mpi_env()
    p = subprocess.run(mpirun_command(1) + [sys.executable, "-c", NCCL_SELF_TEST], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "NCCL self transfer OK nccl" in p.stdout, p.stdout + p.stderr


def _gpu_count():
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_gpu_mpirun_nccl_backend_two_gpus(layout, causal, dtype):
    if _gpu_count() < 2:
        pytest.skip(f"the nccl backend needs 2 GPUs (one per rank); this machine has {_gpu_count()}")
    extra = [] if causal else ["--no-causal"]
    rc, out = _launch(2, "--quick", "--backend", "nccl", "--layout", layout, "--dtype", dtype, "--check-seq",
                      "1001", "--seq", "8192", *extra, timeout=240)
    assert rc == 0, out
    assert "blocks flash (stage 02 version" in out, out
    assert "SUMMARY 04_ring PASS 2 ranks nccl" in out, out


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("extra", [[], ["--no-causal", "--layout", "contiguous"],
                                   ["--heads", "8", "--kv-heads", "2", "--window", "700", "-1", "--softcap", "30"],
                                   ["--alibi", "--dropout", "0.1", "--check-seq", "1024"]],
                         ids=["zigzag-causal", "contiguous-full", "gqa-window-softcap", "alibi-dropout"])
def test_gpu_mpirun_nccl_backend_four_gpus(extra):
    """Four GPUs, one rank each: the halves travel over NCCL (in place, through the staging buffer) while the kernels
    add into the accumulators; with the variants too. Checked against the fp64 oracle on the full sequence."""
    if _gpu_count() < 4:
        pytest.skip(f"needs 4 GPUs (one per rank); this machine has {_gpu_count()}")
    rc, out = _launch(4, "--quick", "--backend", "nccl", "--check-seq", "1001", *extra, timeout=300)
    assert rc == 0, out
    assert "blocks flash (stage 02 version pipelined, stage 03 version tc)" in out, out
    assert "SUMMARY 04_ring PASS 4 ranks nccl" in out, out


def _run_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ring_run", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_run_py_blocks_where_the_flash_kernels_cannot_take_the_options(capsys):
    """run.py's block choice: on the GPU the flash kernels take --kv-heads/--window/--softcap in version pipelined
    (float16 / bfloat16) only, so with float32 (a T4's default) the default blocks are naive ones, with the reason, and
    an explicit --block flash is one clear error; without options, or on the CPU (mirrors), nothing changes."""
    run = _run_module()
    plain, window = run.parse([]), run.parse(["--window", "300", "-1"])
    assert run._blocks(plain, True, np.float32, False) == ("flash", "")
    assert run._blocks(window, True, bfloat16, True) == ("flash", "")
    assert run._blocks(window, False, np.float32, True) == ("naive", "")
    block, why = run._blocks(window, True, np.float32, True)
    assert block == "naive" and "pipelined" in why and "float32" in why
    assert run._versions("naive", np.float32, 64, window, 0, True, True) == (None, None)
    assert run._versions("flash", bfloat16, 64, window, 0, True, True) == ("pipelined", "tc")
    assert run._versions("flash", np.float32, 64, window, 0, False, True) == ("fp32", "fp32")  # CPU: the mirrors
    explicit = run.parse(["--window", "300", "-1", "--block", "flash"])
    assert run._blocks(explicit, True, np.float32, True) == ("flash", "")
    with pytest.raises(SystemExit):
        run._versions("flash", np.float32, 64, explicit, 0, True, True)
    assert "--block naive" in capsys.readouterr().err
