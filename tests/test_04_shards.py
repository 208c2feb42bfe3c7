"""Stage 04: the ring's pieces against direct formulas, on the CPU.

The merge (against attention over the whole key set; stability; empty rows); the layouts (shard/unshard round trip,
padding, zigzag's chunks and balance); block_calls, pair by pair against the full mask (causal and sliding windows, odd
lengths, Nq != Nk); the steps a window leaves (schedule, and the timeline shows only they ran); the bytes of a
grouped-query hop.
"""

import numpy as np
import pytest

from stages import naive, ring
from stages.common import bfloat16, make_inputs, variants

# ---------------------------------------------------------------- the merge


def test_merge_of_two_halves_is_attention_of_the_whole():
    q, k, v = make_inputs(2, 3, 9, 20, 8, dtype=np.float64)
    o, lse = naive.forward(q, k, v)
    o_a, lse_a = naive.forward(q, k[:, :, :7], v[:, :, :7])
    o_b, lse_b = naive.forward(q, k[:, :, 7:], v[:, :, 7:])
    o_m, lse_m = ring.merge(o_a.copy(), lse_a.copy(), o_b, lse_b)
    np.testing.assert_allclose(o_m, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse_m, lse, rtol=1e-12, atol=1e-14)  # L near 0: its rounding is absolute


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


# ---------------------------------------------------------------- layouts and the block calls


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


def _visible_from_calls(calls, Lq, Lk):
    """How often each (row, key) of the block is computed by the calls, each under its own kernel mask."""
    seen = np.zeros((Lq, Lk), int)
    for c in calls:
        opts = variants.Options(left=c.left, right=c.right)  # the kernel's mask: bottom-right on its sub-problem
        seen[c.q_start:c.q_stop, c.k_start:c.k_stop] += variants.visible(c.q_stop - c.q_start, c.k_stop - c.k_start,
                                                                         opts)
    return seen


WINDOWS = [None, (3, -1), (0, 0), (2, 5), (-1, 4), (40, -1)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,P", [(16, 16, 4), (13, 13, 2), (37, 100, 3), (100, 60, 4), (5, 1, 2), (1, 1, 3)])
def test_block_calls_cover_exactly_the_visible_keys(nq, nk, P, causal, layout, window):
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
            calls = ring.block_calls(qpos, kpos, nq, nk, causal, window)
            seen = _visible_from_calls(calls, len(qpos), len(kpos))
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
    assert ring.block_calls(q2, ring.positions(0, P, n, "contiguous"), n, n, True) == [full]  # before: full
    assert ring.block_calls(q2, ring.positions(2, P, n, "contiguous"), n, n, True) == [diag]  # same: diagonal
    assert ring.block_calls(q2, ring.positions(3, P, n, "contiguous"), n, n, True) == []  # after: skipped
    assert diag.mask() == {"causal": True} and full.mask() == {"causal": False}


def test_a_window_is_a_band_of_calls_and_skips_far_blocks():
    """Contiguous, causal, window (5, -1): the block before sees a lower triangle (a window call), the own block a
    band, every other block nothing."""
    P, n = 4, 64
    q2 = ring.positions(2, P, n, "contiguous")
    before = ring.block_calls(q2, ring.positions(1, P, n, "contiguous"), n, n, True, (5, -1))
    own = ring.block_calls(q2, ring.positions(2, P, n, "contiguous"), n, n, True, (5, -1))
    assert before == [ring.BlockCall(0, 5, 11, 16, 0, -1)]  # row i sees keys 11+i..15 of block 1
    assert own == [ring.BlockCall(0, 6, 0, 6, -1, 0), ring.BlockCall(6, 16, 1, 16, 5, 0)]  # a causal corner, a band
    assert own[1].mask() == {"causal": False, "window": (5, 0)}
    assert ring.block_calls(q2, ring.positions(0, P, n, "contiguous"), n, n, True, (5, -1)) == []


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
        return sum(c.pairs() for src in range(P)
                   for c in ring.block_calls(qpos, ring.positions(src, P, n, layout), n, n, True))

    zig = [work("zigzag", r) for r in range(P)]
    con = [work("contiguous", r) for r in range(P)]
    assert sum(zig) == sum(con) == n * (n + 1) // 2
    assert max(zig) == min(zig)
    assert max(con) > 3 * min(con)
