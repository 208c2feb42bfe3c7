"""Stage 06's backward on Hopper: dq, dk, dv of attention for CuPy q, k, v, o, lse, do (B, H, N, D) in float16 or
bfloat16, D = 64, 128 or 256, on an sm_90 GPU.

    o, lse = flash_v3.forward(q, k, v, causal=True)
    dq, dk, dv = flash_v3_backward.backward(q, k, v, o, lse, do, causal=True)

Three launches, the first and last stage 03's (kernels/flash_v2_backward_pre.cu):
  bwd_preprocess     D_i = rowsum(dO_i o O_i), L_i (+inf where nothing is visible and past Nq); the fp32 dQ
                     accumulator (and the per-head block counters, when the main kernel converts) zeroed
  the main kernel    dK_j, dV_j of each K/V tile in the accumulators of the warpgroups that own its keys, the five GEMMs
                     of each Q tile by wgmma; dQ_i added to the accumulator
  bwd_convert_dq     dQ = the accumulator (scale dS K summed) in the inputs' dtype. On short heads version ws does
                     this itself, in the last block of each head to finish (fuse_dq_rule): two launches, not three

Versions, in the order the README teaches them:
  wgmma  (kernels/flash_v3_backward_wgmma.cu) one warpgroup per K/V tile of 64 keys, Q_i and dO_i by TMA into two
         stages (thread 0 issues the copies), dQ_i added by each lane's vector reductions. D = 64, 128, 256.
  ws     (kernels/flash_v3_backward_ws.cu) a producer warpgroup and two consumers on a K/V tile of 128 keys, Q tiles
         of 128 rows at D = 64 (64 at D = 128); dQ_i summed over the block's 128 keys, then added by bulk reductions
         of the copy engine. D = 64, 128.
version "auto" (the default): ws where it takes the head dim, else wgmma. The attention variants (grouped-query k, v;
a window; softcap; ALiBi; packed batches: backward_varlen) run in version ws's loop with stage 02's hooks, D = 64,
128: flash_v3_backward_variants.py.
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import empty, fast_path, kernels, variants, varlen
from stages.common.checks import check_backward_inputs, check_causal, check_out_dtype, resolve_scale

from . import flash_v3_backward_variants as bv
from . import flash_v3_variants
from .backward_steps import (  # the launches and tiles every stage 06 backward shares
    PAD, STAGES, WS_HEAD_DIMS, convert_launch, fuse_dq_rule, pre_launch, q_tile_rows, smem_bytes,
)
from .params import HopperBwdParams
from .sm90a import CTYPE, function, require_hopper
from .tensor_maps import MappedLaunch, heads_map

FILES = {"wgmma": "flash_v3_backward_wgmma.cu", "ws": "flash_v3_backward_ws.cu"}
VERSIONS = tuple(FILES)
DEFAULT = "auto"
HEAD_DIMS = (64, 128, 256)
VERSION_HEAD_DIMS = {"wgmma": HEAD_DIMS, "ws": WS_HEAD_DIMS}
class Config(NamedTuple):
    """A version's K/V tile (bc keys per block) and threads per block."""

    bc: int
    threads: int


CONFIGS = {"wgmma": Config(64, 128), "ws": Config(128, 384)}  # ws: a producer and two consumer warpgroups


def resolve_version(version, D):
    """The version that runs ("auto" or one of VERSIONS, as backward checked it): "auto" is ws where it takes D, else
    wgmma."""
    if version == "auto":
        return "ws" if D in VERSION_HEAD_DIMS["ws"] else "wgmma"
    if D not in VERSION_HEAD_DIMS[version]:
        raise ValueError(f"flash_v3_backward: version {version!r} takes head_dim {VERSION_HEAD_DIMS[version]}, not "
                         f"{D}; version 'wgmma' takes {VERSION_HEAD_DIMS['wgmma']}")
    return version


def parts(D):
    """Blocks per K/V tile: each computes D / parts columns of dK_j, dV_j, dQ_i. Two at D = 256 (version wgmma only),
    where one warpgroup's registers cannot hold 64 x 256 accumulators of both dK_j and dV_j."""
    return 2 if D == 256 else 1


def instantiation(version, ctype, D):
    """The main kernel's template instantiation (its name expression) for element type ctype at head dim D."""
    if version == "wgmma":
        return f"flash_v3_backward_wgmma<{ctype},{D},{D // parts(D)}>"
    return f"flash_v3_backward_ws<{ctype},{D},{STAGES},{q_tile_rows(version, D)}>"


@fast_path.remembered  # the speed layer: a repeated call replays its kept launches (stages/common/fast_path.py)
def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version=DEFAULT, window=None, softcap=None,
             alibi_slopes=None, dropout_p=0.0, seed=0):
    """(dq, dk, dv), shaped like q, k, v and in their dtype: the gradients of sum(O * dO) from the forward's o and lse.
    Variants (the forward's options, stages/common/variants.py): k, v with fewer heads (dk, dv summed over each
    group), window, softcap, alibi_slopes, at head dims 64 and 128 (version ws); dropout is stage 03's. Raises
    TypeError for numpy arrays and device.UnsupportedDevice without an sm_90 GPU, both naming the stage 02 / 03
    versions that compute the same attention there; TypeError / ValueError for what the kernels do not take."""
    where = "flash_v3_backward"
    if version != "auto" and version not in VERSIONS:
        raise ValueError(f"{where}: version {version!r} is not one of {('auto',) + VERSIONS}")
    require_hopper(q, k, v, o, lse, do, where=where)  # numpy arrays or another GPU: what to use there
    _, B, H, Nq, Nk, D = check_backward_inputs(q, k, v, o, lse, do, where=where, dtypes=tuple(CTYPE),
                                               head_dims=HEAD_DIMS, gqa=True)
    if B * H > 65535:
        raise ValueError(f"{where}: batch * heads = {B * H} is over the grid limit 65535")
    causal = check_causal(causal, where)
    scale = resolve_scale(scale, D)
    opts = flash_v3_variants.check_options(q, k, causal=causal, window=window, softcap=softcap,
                                           alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, where=where)
    if opts is not None:
        if version == "wgmma":
            raise ValueError(f"{where}: {flash_v3_variants.TAKES} run in version 'ws' (or 'auto'), not 'wgmma'")
        bv.check_head_dim(D, where)
        return bv.backward(q, k, v, o, lse, do, causal=causal, scale=scale, opts=opts)
    plan = launches(resolve_version(version, D), np.dtype(q.dtype), q.shape, Nk, causal, scale)
    return fast_path.launch(plan, q, k, v, o, lse, do)  # scratch and outputs allocated; the launches


def backward_varlen(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                    causal=False, scale=None, version=DEFAULT, out_dtype=None, window=None, alibi_slopes=None,
                    softcap=None, dropout_p=0.0, seed=0):
    """The gradients of a packed batch (flash_v3.forward_varlen; the definition: stages/common/varlen.py), as stage
    03's backward_varlen: dq (total_q, H, D), dk and dv (total_k, Hkv, D). One launch of the variants' kernel for the
    whole batch (flash_v3_backward_variants.py): a block per (K/V tile of the longest sequence, sequence, k / v
    head), each finding its rows from cu_seqlens. Head dims 64 and 128; out_dtype only q's."""
    where = "flash_v3_backward.backward_varlen"
    require_hopper(q, k, v, o, lse, do, where=where)
    packed = [varlen.check_packed(x, where, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (do, "do"))]
    qb, kb, vb, ob, dob = (kernels.row_major(varlen.as_batch(x)) for x in packed)  # (1, H, total, D)
    check_backward_inputs(qb, kb, vb, ob, lse[None], dob, where=where, dtypes=tuple(CTYPE), gqa=True)
    if version not in ("auto", "ws"):
        raise ValueError(f"{where}: packed batches run in version 'ws' (or 'auto'), not {version!r}")
    bv.check_head_dim(q.shape[2], where)
    if check_out_dtype(out_dtype, q.dtype, where) != q.dtype:
        raise ValueError(f"{where}: the gradients come in q's dtype here; float32 ones (out_dtype) are stage 03's")
    causal = check_causal(causal, where)
    opts = flash_v3_variants.check_options(qb, kb, causal=causal, window=window, softcap=softcap,
                                           alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, where=where)
    opts = opts or variants.check(qb, kb, causal=causal, where=where)  # a plain batch: its causal mask alone
    cq, ck, cu = varlen.kernel_bounds(q, k, cu_seqlens_q, cu_seqlens_k, where, max_seqlen_q, max_seqlen_k)
    import cupy

    dq, dk, dv = bv.backward_packed(qb, kb, vb, ob, lse[None], dob, cu, (np.diff(cq).max(), np.diff(ck).max()),
                                    causal=causal, scale=resolve_scale(scale, q.shape[2]), opts=opts)
    return tuple(cupy.ascontiguousarray(x[0].swapaxes(0, 1)) for x in (dq, dk, dv))


def launches(version, dtype, q_shape, Nk, causal, scale, fuse_dq=None):
    """The launches of one problem, configured and compiled: the BackwardPlan of q, o, do of q_shape (B, H, Nq, D)
    against Nk keys. fuse_dq: whether the main kernel converts dQ (version ws only); None: fuse_dq_rule decides (True
    / False: to time both, dev/backward_launches.py)."""
    B, H, Nq, D = q_shape
    BH, Nq_pad, ctype = B * H, -(-Nq // PAD) * PAD, CTYPE[dtype]
    acc_shape = (B, H, Nq, D)
    fused = fuse_dq_rule(version, Nq, D) if fuse_dq is None else bool(fuse_dq)
    if fused and version != "ws":
        raise ValueError(f"flash_v3_backward: version {version!r} does not convert dQ itself (version 'ws' does)")
    # stage 03's preprocess: D_i, L_i; the dQ accumulator (and the block counters) zeroed
    pre = pre_launch(ctype, Nq=Nq, ldq=Nq, Nq_pad=Nq_pad, D=D, BH=BH, zero=True, counters=BH if fused else 0)
    # the main kernel: dK_j, dV_j; dQ_i into the float32 accumulator (a tensor map of it)
    main = _main_launch(version, dtype, q_shape, (B, H, Nk, D), (0, Nq), (0, Nk), causal, scale, accumulate=False,
                        dq_map=heads_map(acc_shape, np.float32))
    convert = None if fused else convert_launch(ctype, BH * Nq * D)  # stage 03's, unless the main kernel converts
    scratch = fast_path.out_layout([((BH * Nq_pad,), np.float32), ((BH * Nq_pad,), np.float32),
                                    (acc_shape, np.float32)] + [((BH,), np.int32)] * fused)
    return BackwardPlan(pre, main, convert, scratch)


class BackwardPlan(NamedTuple):
    """The launches of one backward problem: the preprocess, the main kernel, the dQ conversion (None where the main
    kernel converts: fuse_dq_rule); scratch, the layout of D_i, L_i (Nq_pad rows a head), the float32 dQ accumulator
    (B, H, Nq, D) and, with no conversion launch, the B H block counters, in one allocation; outs: dq, dk, dv carved
    from one allocation (fast_path keeps the plan so), or None. plan(q, k, v, o, lse, do) -> (dq, dk, dv)."""
    pre: kernels.Launch
    main: MappedLaunch
    convert: kernels.Launch | None
    scratch: tuple
    outs: tuple | None = None

    def __call__(self, q, k, v, o, lse, do):
        import cupy

        asc = kernels.row_major  # (B, H, N, D) row-major: a copy only for another layout
        q, k, v, o, do, lse = asc(q), asc(k), asc(v), asc(o), asc(do), asc(lse, dtype=cupy.float32)
        delta, lse_pad, dq_acc, *counters = fast_path.empties(*self.scratch)
        done = counters[0] if counters else 0
        self.pre(o, do, lse, delta, lse_pad, dq_acc, done)
        if self.outs is not None:
            dq, dk, dv = fast_path.empties(*self.outs)
        else:
            dq, dk, dv = (empty(cupy, x.shape, x.dtype) for x in (q, k, v))
        self.main(q, k, v, do, dq_acc, dq_acc, dk, dv, lse_pad, delta, dq if counters else 0, done)
        if self.convert is not None:
            self.convert(dq_acc, dq)
        return dq, dk, dv

    def with_joint_outputs(self, q, k, v, *arrays):
        """This plan with dq, dk, dv from one allocation (a training step uses all three together)."""
        return self._replace(outs=fast_path.out_layout([(x.shape, x.dtype) for x in (q, k, v)]))


def _main_launch(version, dtype, q_shape, k_shape, rows, keys, causal, scale, accumulate, dq_map):
    """The main kernel on rows (a, b) of every head of q, do (q_shape) against keys (c, m) of k, v (k_shape): a
    MappedLaunch of (q, k, v, do, the dQ array dq_map describes; then the pointers dq_acc, dk, dv, lse_pad, delta,
    dq, done: dq and the block counters where the kernel converts dQ itself, else 0, 0).
    accumulate: add dK, dV into float32 accumulators (the ring's) instead of writing them."""
    (a, b), (c, m) = rows, keys
    B, H, _, D = q_shape
    params = HopperBwdParams(Nq=b - a, Nk=m - c, Nq_pad=-(-(b - a) // PAD) * PAD, scale=scale, causal=int(causal),
                             kv_rows=k_shape[2], accumulate=int(accumulate))
    cfg = CONFIGS[version]
    grid = (-(-(m - c) // cfg.bc), B * H, parts(D))  # one block per (K/V tile j, head, column part)
    smem = smem_bytes(version, D)
    fn = function(FILES[version], instantiation(version, CTYPE[dtype], D), smem)  # compiled once
    return MappedLaunch.of(kernels.Launch(fn, grid, (cfg.threads,), smem, params),
                           map_q=heads_map(q_shape, dtype, rows=rows), map_k=heads_map(k_shape, dtype, rows=keys),
                           map_v=heads_map(k_shape, dtype, rows=keys), map_do=heads_map(q_shape, dtype, rows=rows),
                           map_dq=dq_map)


# ----------------------------------------------------------------------------- the ring's blocks (stage 04)
def takes_block(dtype, head_dim, *, heads=1, kv_heads=1):
    """Whether accumulate_into computes a ring block of this dtype, head dim and heads (version ws's head dims; k / v
    heads dividing the query heads, with or without options); the ring asks flash_v3.takes for the GPU first."""
    return (np.dtype(dtype) in CTYPE and head_dim in VERSION_HEAD_DIMS["ws"] and kv_heads >= 1
            and heads % kv_heads == 0)


@functools.lru_cache(maxsize=fast_path.MAX_PLANS)  # the speed layer: the ring repeats its blocks every step
def _block_plan(dtype, q_shape, k_shape, rows, keys, causal, scale):
    """(preprocess, main kernel, scratch layout of D_i and L_i) of one ring block (accumulate_into)."""
    (a, b), B, H, Lq, D = rows, *q_shape
    BH, Nq_pad = B * H, -(-(b - a) // PAD) * PAD
    pre = pre_launch(CTYPE[dtype], Nq=b - a, ldq=Lq, Nq_pad=Nq_pad, D=D, BH=BH, zero=False)
    main = _main_launch("ws", dtype, q_shape, k_shape, rows, keys, causal, scale, accumulate=True,
                        dq_map=heads_map(q_shape, np.float32, rows=rows))
    return pre, main, fast_path.out_layout([((BH * Nq_pad,), np.float32)] * 2)


def accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, *, causal, scale, opts=None):
    """One block of the ring backward (stage 04), added in place, as stage 03's accumulate_into: the gradients of
    rows (a, b) of q, o, lse, do (B, H, Lq, ...) against keys (c, m) of k, v (B, Hkv, Lk, D), version ws, added into the
    ring's float32 accumulators: scale dQ into rows a:b of dq_run by the copy engine's reductions (a tensor map of
    those rows), dK, dV into keys c:m of dk_run, dv_run (B, Hkv, Lk, D) by the epilogue's reductions. No row is copied:
    the maps start at row a and key c. Two launches: stage 03's preprocess (D_i, L_i of rows a:b) and the main
    kernel. Causal: bottom-right aligned within the block. opts: variants.Options of the block (window, softcap,
    ALiBi, origin; dropout is stage 03's) or None; fewer k / v heads than q or any option run the variants' kernel
    (flash_v3_backward_variants.py). CuPy arrays, checked by the caller (takes_block)."""
    if opts is None:  # plain attention, or grouped-query as the heads say
        opts = variants.check(q, k, causal=causal, where="flash_v3_backward.accumulate_into")
    if opts.dropout_p:
        raise ValueError(f"flash_v3_backward.accumulate_into: {flash_v3_variants.DROPOUT}")
    if not opts.plain:
        return bv.accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, causal=causal,
                                  scale=scale, opts=opts)
    pre, main, scratch = _block_plan(np.dtype(q.dtype), q.shape, k.shape, rows, keys, bool(causal), scale)
    delta, lse_pad = fast_path.empties(*scratch)
    a, c, D = rows[0], keys[0], q.shape[3]
    at = a * D * q.itemsize  # byte offset of row a in every head of o and do
    pre(o.data.ptr + at, do.data.ptr + at, lse.data.ptr + 4 * a, delta, lse_pad, 0, 0)
    kv = 4 * c * D  # byte offset of key c in every head of the float32 accumulators
    main(q, k, v, do, dq_run, 0, dk_run.data.ptr + kv, dv_run.data.ptr + kv, lse_pad, delta, 0, 0)


def instantiations(version):
    """[(file, name)]: the instantiations of a version that CI compiles for sm_90a (version ws's with the variants:
    flash_v3_backward_variants.instantiations)."""
    return [(FILES[version], instantiation(version, c, D)) for c in CTYPE.values() for D in VERSION_HEAD_DIMS[version]]

