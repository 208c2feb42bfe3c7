"""Stage 04: the fast ring held to the plain one (ring.py's reference), and the candidates held to the default.

CPU: the plain ring (whole blocks, a double buffer, one block call per step) against the one-device rule, then the
fast ring (ring_forward / ring_backward: block calls, halves, fused merges) with the plain ring as the rule's
yardstick, over both layouts, both masks, 1 to 4 ranks, grouped-query heads, float32 with stage 00 blocks and 16 bits
through the stage 02/03 tile mirrors. Each candidate of candidates.py gives the default's result bit for bit. The
merge never reads O where nothing was merged. The plain ring's clear errors.
"""
import numpy as np
import pytest

from stages import ring
from stages.common import bfloat16, make_inputs, tolerance, verify

NAMES = tolerance.NAMES_FORWARD + tolerance.NAMES_BACKWARD


def _run(forward, backward, q, k, v, do, o_in, lse_in, causal, layout, P, **kw):
    """forward then backward (from o_in, lse_in) on P simulated ranks; (o, lse, dq, dk, dv) gathered."""
    n = q.shape[2]

    def body(rg):
        cut = [ring.shard(x, rg.rank, P, layout) for x in (q, k, v, o_in, lse_in, do)]
        return (*forward(*cut[:3], ring=rg, causal=causal, layout=layout, **kw),
                *backward(*cut, ring=rg, causal=causal, layout=layout, **kw))

    outs = ring.simulate(body, P)
    return [ring.unshard([o[i] for o in outs], n, layout) for i in range(5)]


PLAIN_CASES = [  # (B, H, Hkv, N, D, P, dtype, block): N a multiple of 2P (the plain ring takes no padding)
    (1, 2, 2, 96, 32, 1, np.float32, "naive"),
    (2, 2, 2, 96, 32, 2, np.float32, "naive"),
    (1, 3, 3, 96, 16, 3, np.float32, "naive"),
    (1, 4, 2, 96, 32, 4, np.float32, "naive"),
    (1, 4, 1, 64, 64, 4, np.float32, "naive"),
    (1, 2, 2, 64, 64, 2, bfloat16, "flash"),
    (1, 2, 1, 48, 64, 3, np.float16, "flash"),
]


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PLAIN_CASES, ids=[f"P{c[5]}-H{c[1]}-{c[2]}-N{c[3]}-d{c[4]}-{np.dtype(c[6]).name}-"
                                                   f"{c[7]}" for c in PLAIN_CASES])
def test_fast_ring_against_the_plain_ring(case, causal, layout):
    """The plain ring passes the one-device rule; the fast ring passes the rule with the plain ring as its yardstick
    (its error per row within twice the plain ring's, or the rule's rounding terms)."""
    B, H, Hkv, N, D, P, dtype, block = case
    q, k, v, do = make_inputs(B, H, N, N, D, dtype=dtype, grad=True)
    k, v = k[:, :Hkv], v[:, :Hkv]
    refs, bounds, (o_in, lse_in) = verify.rule(q, k, v, do, causal=causal)
    plain = _run(ring.plain_ring_forward, ring.plain_ring_backward, q, k, v, do, o_in, lse_in, causal, layout, P,
                 block=block)
    verify.check_outputs(plain, refs, bounds, what="plain ring: ")
    fast = _run(ring.ring_forward, ring.ring_backward, q, k, v, do, o_in, lse_in, causal, layout, P, block=block)
    terms = (tolerance.forward_s_terms(q, k, v, causal=causal)
             + tolerance.backward_s_terms(q, k, v, o_in, do, causal=causal))
    tolerance.assert_within(NAMES, fast, refs, tolerance.bounds(refs, [plain], terms),
                            what="fast ring against the plain ring: ")


def test_the_plain_ring_says_what_it_takes():
    x = np.zeros((1, 1, 7, 4), np.float32)
    with pytest.raises(ValueError, match=r"plain ring: causal shards must have as many query as key rows \(an even "
                                         r"number for zigzag\).*ring_forward takes any length"):
        ring.simulate(lambda rg: ring.plain_ring_forward(x, x, x, ring=rg, causal=True, layout="zigzag"), 2)
    with pytest.raises(ValueError, match=r"plain ring: layout 'striped' is not known"):
        ring.simulate(lambda rg: ring.plain_ring_forward(x, x, x, ring=rg, layout="striped"), 1)


# ---------------------------------------------------------------- the candidates change nothing
CANDIDATE_CASES = [  # (H, Hkv, Nq, Nk, D, P, layout, causal, opts, dtype, block)
    (2, 2, 99, 99, 16, 4, "zigzag", True, {}, np.float32, "naive"),  # padding rows: rows no block covers
    (2, 2, 80, 50, 16, 3, "contiguous", True, {}, np.float32, "naive"),  # Nq > Nk causal: rows that see no key
    (4, 2, 96, 96, 16, 3, "zigzag", True, {"window": (20, -1), "softcap": 5.0}, np.float32, "naive"),
    (2, 2, 64, 64, 64, 2, "zigzag", False, {}, bfloat16, "flash"),
]


@pytest.mark.parametrize("scheme", ["ring", "allgather"])
@pytest.mark.parametrize("case", CANDIDATE_CASES, ids=[f"{c[6]}-{'causal' if c[7] else 'full'}-N{c[2]}x{c[3]}-P{c[5]}"
                                                       f"-{np.dtype(c[9]).name}" for c in CANDIDATE_CASES])
def test_every_candidate_gives_the_default_result_bit_for_bit(case, scheme):
    H, Hkv, Nq, Nk, D, P, layout, causal, opts, dtype, block = case
    q, _, _, do = make_inputs(1, H, Nq, Nk, D, dtype=dtype, grad=True)
    _, k, v = make_inputs(1, Hkv, Nq, Nk, D, dtype=dtype)
    o_in, lse_in = verify.rule(q, k, v, do, causal=causal, opts=opts)[2]
    kw = dict(causal=causal, layout=layout, block=block, scheme=scheme, **opts)

    def body(rg):
        cut = [ring.shard(x, rg.rank, P, layout) for x in (q, k, v, o_in, lse_in, do)]
        return (*ring.ring_forward(*cut[:3], ring=rg, nq=Nq, nk=Nk, **kw),
                *ring.ring_backward(*cut, ring=rg, nq=Nq, nk=Nk, **kw))

    base = ring.simulate(body, P)
    for names in [(name,) for name in ring.candidates.CANDIDATES] + [tuple(ring.candidates.CANDIDATES)]:
        with ring.candidates.trying(*names):
            got = ring.simulate(body, P)
        for r, (a, b) in enumerate(zip(base, got)):
            for name, x, y in zip(NAMES, a, b):
                assert np.array_equal(x, y), f"candidate {names} changes {name} on rank {r}"


def test_candidates_are_checked_and_restored():
    with pytest.raises(ValueError, match=r"unknown ring candidate\(s\) \['fast'\]; the candidates are"):
        with ring.candidates.trying("fast"):
            pass
    with ring.candidates.trying("base", "fold"):
        assert ring.candidates.on("fold") and not ring.candidates.on("serial-fwd")
    assert not ring.candidates.on("fold")


def test_merge_never_reads_o_where_nothing_was_merged():
    """O_a is uninitialised where L_a = -inf (candidate fold leaves it so): the merge writes O_b there, bit for bit,
    as the kernels' epilogue does, and merges elsewhere."""
    o_b = np.random.default_rng().standard_normal((1, 2, 5, 8)).astype(np.float32)
    lse_b = np.random.default_rng().standard_normal((1, 2, 5)).astype(np.float32)
    o_a = np.full_like(o_b, np.nan)  # never written: any bits
    lse_a = np.full_like(lse_b, -np.inf)
    lse_a[0, 0, 1], o_a[0, 0, 1] = 0.5, 1.0  # one row that holds a merged block
    o, lse = ring.merge(o_a, lse_a, o_b, lse_b)
    fresh = np.ones(lse_b.shape, bool)  # the rows where nothing was merged
    fresh[0, 0, 1] = False
    assert np.array_equal(o[fresh], o_b[fresh]) and np.array_equal(lse[fresh], lse_b[fresh])
    assert not np.isnan(o).any()
    m = max(0.5, lse_b[0, 0, 1])
    total = np.exp(0.5 - m) + np.exp(lse_b[0, 0, 1] - m)
    np.testing.assert_allclose(o[0, 0, 1], (np.exp(0.5 - m) * 1.0 + np.exp(lse_b[0, 0, 1] - m) * o_b[0, 0, 1])
                               / total, rtol=1e-6)
