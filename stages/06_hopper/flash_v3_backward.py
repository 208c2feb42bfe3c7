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
version "auto" (the default): ws where it takes the head dim, else wgmma.
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import empty, fast_path, kernels, load_module
from stages.common.checks import check_backward_inputs, check_causal, resolve_scale
from stages.common.params import BwdParams
from stages.flash_v2_backward import flash_v2_backward as stage03  # its preprocess, dQ conversion and padding

from .params import HopperBwdParams
from .sm90a import CTYPE, function, require_hopper
from .tensor_maps import MappedLaunch, heads_map

FILES = {"wgmma": "flash_v3_backward_wgmma.cu", "ws": "flash_v3_backward_ws.cu"}
VERSIONS = tuple(FILES)
DEFAULT = "auto"
HEAD_DIMS = (64, 128, 256)
VERSION_HEAD_DIMS = {"wgmma": HEAD_DIMS, "ws": (64, 128)}
# Q/dO stages of version ws: the producer loads Q_{i+1}, dO_{i+1} while the consumers work on Q_i; they meet at
# every tile's barriers, so neither runs more than a tile ahead of the other
STAGES = 2
PRE_FILE = "flash_v2_backward_pre.cu"  # stage 03's preprocess and dQ conversion
PAD = stage03.PAD                      # D_i and L_i are padded to a multiple of PAD rows (>= every Q tile's rows)
# Who converts dQ in version ws. The accumulator is B H Nq D floats; a pass of its own over it (bwd_convert_dq) costs
# the same at every N for the same number of tokens, while the GEMMs' work grows with N, so at short N it is a large
# share of the call. Fused, the last block of each head to finish converts that head while the other blocks still
# compute, reading the accumulator from L2 where the reductions left it. But that block converts alone, on one SM: a
# long head's conversion is a tail after the rest of the grid. Fused up to FUSE_DQ_MAX accumulator values per head
# (results/backward_launches_h200.csv times both ways at every N).
FUSE_DQ_MAX = 2048 * 128


def fuse_dq_rule(version, nq, d):
    """Whether the main kernel converts dQ itself (see FUSE_DQ_MAX): version ws, nq query rows of head dim d."""
    return version == "ws" and nq * d <= FUSE_DQ_MAX


class Config(NamedTuple):
    """A version's K/V tile (bc keys per block) and threads per block."""

    bc: int
    threads: int


CONFIGS = {"wgmma": Config(64, 128), "ws": Config(128, 384)}  # ws: a producer and two consumer warpgroups


def q_tile_rows(version, D):
    """Rows of a Q tile: 64, and 128 for version ws at D = 64, where a consumer's registers hold S^T and dP^T of its
    64 keys x 128 queries beside dK_j and dV_j. The kernel takes it as its template argument BR."""
    return 128 if version == "ws" and D == 64 else 64


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


def smem_bytes(version, D):
    """2 bytes a value; 1024 bytes to align the first tile to the swizzle's period. wgmma: K_j and V_j (64 keys),
    the 64 x 64 dS^T, two stages of Q_i and dO_i. ws: K_j and V_j (128 keys), dS^T (128 x br), dQ_i in float32
    (br x D), STAGES stages of Q_i and dO_i with their L_i and D_i (br floats each); br = q_tile_rows."""
    br = q_tile_rows(version, D)
    if version == "wgmma":
        return 6 * 64 * D * 2 + 64 * br * 2 + 1024
    return 2 * 128 * D * 2 + 128 * br * 2 + br * D * 4 + STAGES * (2 * br * D * 2 + 2 * br * 4) + 1024


def instantiation(version, ctype, D):
    """The main kernel's template instantiation (its name expression) for element type ctype at head dim D."""
    if version == "wgmma":
        return f"flash_v3_backward_wgmma<{ctype},{D},{D // parts(D)}>"
    return f"flash_v3_backward_ws<{ctype},{D},{STAGES},{q_tile_rows(version, D)}>"


@fast_path.remembered  # the speed layer: a repeated call replays its kept launches (stages/common/fast_path.py)
def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version=DEFAULT):
    """(dq, dk, dv), shaped like q, k, v and in their dtype: the gradients of sum(O * dO) from the forward's o and lse.
    Raises TypeError for numpy arrays and device.UnsupportedDevice without an sm_90 GPU, both naming the stage 02 / 03
    versions that compute the same attention there; TypeError / ValueError for what the kernels do not take."""
    where = "flash_v3_backward"
    if version != "auto" and version not in VERSIONS:
        raise ValueError(f"{where}: version {version!r} is not one of {('auto',) + VERSIONS}")
    require_hopper(q, k, v, o, lse, do, where=where)  # numpy arrays or another GPU: what to use there
    _, B, H, Nq, Nk, D = check_backward_inputs(q, k, v, o, lse, do, where=where, dtypes=tuple(CTYPE),
                                               head_dims=HEAD_DIMS)
    if B * H > 65535:
        raise ValueError(f"{where}: batch * heads = {B * H} is over the grid limit 65535")
    causal = check_causal(causal, where)
    scale = resolve_scale(scale, D)
    plan = launches(resolve_version(version, D), np.dtype(q.dtype), q.shape, Nk, causal, scale)
    return fast_path.launch(plan, q, k, v, o, lse, do)  # scratch and outputs allocated; the launches


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
    pre = _pre_launch(ctype, Nq=Nq, ldq=Nq, Nq_pad=Nq_pad, D=D, BH=BH, zero=True, counters=BH if fused else 0)
    # the main kernel: dK_j, dV_j; dQ_i into the float32 accumulator (a tensor map of it)
    main = _main_launch(version, dtype, q_shape, (B, H, Nk, D), (0, Nq), (0, Nk), causal, scale, accumulate=False,
                        dq_map=heads_map(acc_shape, np.float32))
    n = BH * Nq * D  # stage 03's dQ conversion, unless the main kernel converts: 4 values a step (n is a multiple)
    convert = None if fused else kernels.Launch(_pre_function("bwd_convert_dq", ctype), (min(-(-n // 1024), 65535),),
                                                (256,), 0, (np.float32(1.0), np.int64(n)))
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


def _pre_launch(ctype, *, Nq, ldq, Nq_pad, D, BH, zero, counters=0):
    """Stage 03's preprocess (Alg.2 L4) of rows 0..Nq-1 of every head, ldq rows a head apart from the pointers to o,
    do, lse it is given: D_i = rowsum(dO_i * O_i) into delta, L_i into lse_pad (+inf for a fully masked row, and for
    the padding up to Nq_pad), and, where zero, the float32 dQ accumulator and the first `counters` block counters
    zeroed (a ring block has no accumulator of its own). Arguments of a call: o, do, lse, delta, lse_pad, the dQ
    accumulator (or 0), the counters (or 0): the leading arrays of stage 03's BwdParams, which the kernel takes."""
    return kernels.Launch(_pre_function("bwd_preprocess", ctype), (Nq_pad * D // 2048, BH), (256,), 0,
                          BwdParams(Nq=Nq, ldq=ldq, Nq_pad=Nq_pad, head_dim=D, zero_dq=int(zero), n_done=counters))


@functools.lru_cache(maxsize=None)
def _pre_function(kernel, ctype):
    """Stage 03's preprocess or dQ conversion for ctype, from the module stage 03 compiles (one compile for both)."""
    return load_module(PRE_FILE, name_expressions=stage03.PRE_NAMES).get_function(f"{kernel}<{ctype}>")


# ----------------------------------------------------------------------------- the ring's blocks (stage 04)
def takes_block(dtype, head_dim):
    """Whether accumulate_into computes a ring block of this dtype and head dim (version ws's head dims); the ring
    asks flash_v3.takes for the GPU and the heads first."""
    return np.dtype(dtype) in CTYPE and head_dim in VERSION_HEAD_DIMS["ws"]


@functools.lru_cache(maxsize=fast_path.MAX_PLANS)  # the speed layer: the ring repeats its blocks every step
def _block_plan(dtype, q_shape, k_shape, rows, keys, causal, scale):
    """(preprocess, main kernel, scratch layout of D_i and L_i) of one ring block (accumulate_into)."""
    (a, b), B, H, Lq, D = rows, *q_shape
    BH, Nq_pad = B * H, -(-(b - a) // PAD) * PAD
    pre = _pre_launch(CTYPE[dtype], Nq=b - a, ldq=Lq, Nq_pad=Nq_pad, D=D, BH=BH, zero=False)
    main = _main_launch("ws", dtype, q_shape, k_shape, rows, keys, causal, scale, accumulate=True,
                        dq_map=heads_map(q_shape, np.float32, rows=rows))
    return pre, main, fast_path.out_layout([((BH * Nq_pad,), np.float32)] * 2)


def accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, *, causal, scale):
    """One block of the ring backward (stage 04), added in place, as stage 03's accumulate_into: the gradients of
    rows (a, b) of q, o, lse, do (B, H, Lq, ...) against keys (c, m) of k, v (B, H, Lk, D), version ws, added into the
    ring's float32 accumulators: scale dQ into rows a:b of dq_run by the copy engine's reductions (a tensor map of
    those rows), dK, dV into keys c:m of dk_run, dv_run (B, H, Lk, D) by the epilogue's reductions. No row is copied:
    the maps start at row a and key c. Two launches: stage 03's preprocess (D_i, L_i of rows a:b) and the main
    kernel. Causal: bottom-right aligned within the block. CuPy arrays, checked by the caller (takes_block)."""
    pre, main, scratch = _block_plan(np.dtype(q.dtype), q.shape, k.shape, rows, keys, bool(causal), scale)
    delta, lse_pad = fast_path.empties(*scratch)
    a, c, D = rows[0], keys[0], q.shape[3]
    at = a * D * q.itemsize  # byte offset of row a in every head of o and do
    pre(o.data.ptr + at, do.data.ptr + at, lse.data.ptr + 4 * a, delta, lse_pad, 0, 0)
    kv = 4 * c * D  # byte offset of key c in every head of the float32 accumulators
    main(q, k, v, do, dq_run, 0, dk_run.data.ptr + kv, dv_run.data.ptr + kv, lse_pad, delta, 0, 0)


def instantiations(version):
    """[(file, name)]: the instantiations of a version that CI compiles for sm_90a."""
    return [(FILES[version], instantiation(version, c, D)) for c in CTYPE.values() for D in VERSION_HEAD_DIMS[version]]
