"""Stage 04: the ring checked on the full sequence, as one device is checked (stages/common/verify.py).

    errs = check_on_ranks(comm, ring, B=1, H=4, n=1000, D=64, dtype=np.float32, causal=True, layout="zigzag",
                          block="naive", versions=(None, None), xp=np)

Every rank runs its part of the forward and of the backward on fresh inputs; rank 0 gathers the shards and holds the
whole o, lse, dq, dk, dv to the tolerance rule against the fp64 oracle. run.py and the benchmarks in dev/ call it
before they time anything.
"""
import numpy as np

from stages.common import make_inputs, to_numpy, verify

from .shards import shard, unshard
from .ring import ring_backward, ring_forward


def check_on_ranks(comm, ring, *, B, H, n, D, dtype, causal, layout, block, versions, xp, Hkv=None, opts=None,
                   scheme="ring"):
    """Every rank of `comm`: the ring forward, and the ring backward from the oracle's o and lse, at total length
    n on fresh inputs (k, v with Hkv heads; opts: window, softcap, alibi_slopes, dropout_p); gathered to rank 0 and
    checked there exactly as stages.common.verify checks one device (stages.common.verify.rule and check_outputs).
    Returns {name: (error, bound)} on rank 0, None elsewhere; raises AssertionError on rank 0 when a result is out
    of tolerance."""
    rank, P = comm.Get_rank(), comm.Get_size()
    seed = comm.bcast(int(np.random.default_rng().integers(2**31)) if rank == 0 else None, root=0)
    q, k, v, do = make_inputs(B, H, n, n, D, dtype=dtype, seed=seed, grad=True)  # the same on every rank
    k, v = k[:, :Hkv], v[:, :Hkv]  # grouped-query: Hkv heads
    opts = opts or {}
    rule = verify.rule(q, k, v, do, causal=causal, opts=opts) if rank == 0 else None  # oracle, bounds, start
    o_in, lse_in = comm.bcast(rule[2] if rank == 0 else None, root=0)
    kw = dict(ring=ring, nq=n, nk=n, causal=causal, layout=layout, block=block, scheme=scheme, **opts)
    mine = [xp.asarray(shard(x, rank, P, layout)) for x in (q, k, v, do, o_in, lse_in)]  # (B, H, L, ...)
    o, lse = ring_forward(*mine[:3], version=versions[0], **kw)
    grads = ring_backward(*mine[:3], mine[4], mine[5], mine[3], version=versions[1], **kw)
    parts = comm.gather([to_numpy(t) for t in (o, lse, *grads)], root=0)
    if rank != 0:
        return None
    got = [unshard([p[i] for p in parts], n, layout) for i in range(5)]  # o, lse, dq, dk, dv: (B, H, n, ...)
    for name, x, like in zip(("o", "lse", "dq", "dk", "dv"), got, (q, lse_in, q, k, v)):
        if x.shape != like.shape or x.dtype != like.dtype:
            raise AssertionError(f"{name}: got {x.shape} {x.dtype}, expected {like.shape} {like.dtype}")
    return verify.check_outputs(got, rule[0], rule[1])
