"""Stage 06's backward with the attention variants (kernels/flash_v3_backward_variants.cu): version ws's main loop
(kernels/hopper_bwd_ws.cuh) with stage 02's hooks and a block per (K/V tile, k / v head).

    dq, dk, dv = flash_v3_backward.backward(q, k[:, :2], v[:, :2], o, lse, do, causal=True, window=(1023, 0))
    dq, dk, dv = flash_v3_backward.backward_varlen(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, causal=True)

flash_v3_backward.backward and backward_varlen check the inputs and options and come here; the ring's blocks
through accumulate_into. Three launches, as the plain backward's: stage 03's preprocess (D_i, L_i; the dQ
accumulator and the block counters zeroed), the kernel, stage 03's dQ conversion unless the kernel converts dQ
itself (fuse_dq_rule, by the rows a block converts: its group's query heads). Grouped-query k, v: each block walks
every query head of its group (kernels/hopper_variants.cuh: KeyBlock), so dK, dV come out summed over the group,
written once in the inputs' dtype (or added once into the ring's accumulators). Head dims 64 and 128 (version ws's);
at 256 the variants' backward is stage 03's version tc.
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import empty, fast_path, kernels, variants
from stages.common.params import FwdParams

from . import backward_steps as steps  # stage 03's preprocess and dQ conversion; version ws's tiles
from .flash_v3_variants import HOOKS, level, plan_options, slopes_array
from .params import HopperVarBwdParams
from .sm90a import CTYPE, function
from .tensor_maps import MappedLaunch, heads_map, rows_map

FILE = "flash_v3_backward_variants.cu"
HEAD_DIMS = steps.WS_HEAD_DIMS
TAIL = tuple(HopperVarBwdParams.var.offset + getattr(FwdParams, f).offset for f in HopperVarBwdParams.VAR_POINTERS)
ELSEWHERE = "stage 03 version 'tc' takes the variants at head dims 64, 128 and 256"


def instantiation(ctype, D, lvl):
    """The kernel's name expression: element type, head dim, Q tile rows (steps.q_tile_rows), hooks of level lvl."""
    return f"flash_v3_backward_variants<{ctype},{D},{steps.q_tile_rows('ws', D)},{','.join(HOOKS[lvl])}>"


def instantiations():
    """[(file, name)]: every instantiation a launch may pick, which CI compiles for sm_90a."""
    return [(FILE, instantiation(c, D, lvl)) for c in CTYPE.values() for D in HEAD_DIMS for lvl in HOOKS]


def check_head_dim(D, where):
    if D not in HEAD_DIMS:
        raise ValueError(f"{where}: the variants' backward takes head dims {HEAD_DIMS} (version ws's), not {D}; "
                         f"{ELSEWHERE}")


def _main(dtype, q_shape, k_shape, rows, keys, causal, scale, opts, *, accumulate, dq_map, varlen=None):
    """The variants' kernel on rows (a, b) of every query head of q, do (q_shape) against keys (c, m) of k, v (k_shape):
    a MappedLaunch of (q, k, v, do, the dQ array dq_map describes, L_i, D_i (the preprocess's padded rows); then the
    pointers dq_acc, dk, dv, lse_pad, delta, dq, done; then slopes, cu_q, cu_k). varlen: (sequences, longest key
    sequence) of a packed batch laid out head by head, or None."""
    (a, b), (c, m) = rows, keys
    B, H, _, D = q_shape
    Hkv, Nq, Nk, Nq_pad, lvl = k_shape[1], b - a, m - c, -(-(b - a) // steps.PAD) * steps.PAD, level(opts)
    var = FwdParams(Nq=Nq, Nk=Nk, scale=scale, causal=int(causal), H=H, group=H // Hkv, left=opts.left,
                    right=opts.right, softcap=opts.softcap if lvl == 2 else 0.0, **variants.origin_fields(opts, Nq, Nk))
    params = HopperVarBwdParams(Nq=Nq, Nk=Nk, Nq_pad=Nq_pad, scale=scale, causal=int(causal), kv_rows=k_shape[2],
                                accumulate=int(accumulate), var=var)
    smem, br = steps.smem_bytes("ws", D), steps.q_tile_rows("ws", D)
    fn = function(FILE, instantiation(CTYPE[dtype], D, lvl), smem)  # compiled once
    blocks = B * Hkv if varlen is None else varlen[0] * Hkv  # (batch or sequence, k / v head)
    grid = (max(1, -(-(Nk if varlen is None else varlen[1]) // 128)), blocks)
    if blocks > 65535:
        raise ValueError(f"flash_v3_backward: {blocks} (batch or sequence, k / v head) pairs are over the grid limit "
                         "65535; split the batch")
    return MappedLaunch.of(kernels.Launch(fn, grid, (384,), smem, params), tail=TAIL,
                           map_q=heads_map(q_shape, dtype, rows=rows), map_k=heads_map(k_shape, dtype, rows=keys),
                           map_v=heads_map(k_shape, dtype, rows=keys), map_do=heads_map(q_shape, dtype, rows=rows),
                           map_dq=dq_map, map_lse=rows_map(B * H, Nq_pad, br), map_delta=rows_map(B * H, Nq_pad, br))


class VariantPlan(NamedTuple):
    """The launches of one backward with variants: pre, main, convert (None where the kernel converts dQ), the
    scratch layout (D_i, L_i, the dQ accumulator, the block counters), and the ALiBi slopes and packed bounds the
    kernel reads (tail: three arrays or 0). plan(q, k, v, o, lse, do) -> (dq, dk, dv), dk and dv shaped like k."""
    pre: kernels.Launch
    main: MappedLaunch
    convert: kernels.Launch | None
    scratch: tuple
    tail: tuple = (0, 0, 0)
    outs: tuple | None = None

    def __call__(self, q, k, v, o, lse, do):
        import cupy

        asc = kernels.row_major
        q, k, v, o, do, lse = asc(q), asc(k), asc(v), asc(o), asc(do), asc(lse, dtype=cupy.float32)
        delta, lse_pad, dq_acc, *counters = fast_path.empties(*self.scratch)
        done = counters[0] if counters else 0
        self.pre(o, do, lse, delta, lse_pad, dq_acc, done)
        if self.outs is not None:
            dq, dk, dv = fast_path.empties(*self.outs)
        else:
            dq, dk, dv = (empty(cupy, x.shape, x.dtype) for x in (q, k, v))
        self.main(q, k, v, do, dq_acc, lse_pad, delta, dq_acc, dk, dv, lse_pad, delta, dq if counters else 0, done,
                  *self.tail)
        if self.convert is not None:
            self.convert(dq_acc, dq)
        return dq, dk, dv

    def with_joint_outputs(self, q, k, v, *arrays):
        """This plan with dq, dk, dv from one allocation (fast_path keeps it so)."""
        return self._replace(outs=fast_path.out_layout([(x.shape, x.dtype) for x in (q, k, v)]))


@functools.lru_cache(maxsize=fast_path.MAX_PLANS)  # once per problem: the choices below depend on nothing else
def _plan(dtype, q_shape, k_shape, causal, scale, opts, varlen=None):
    """The VariantPlan of a whole problem (opts: plan_options; varlen: (sequences, longest query sequence, longest key
    sequence) of a packed batch, or None), without its per-call tail."""
    B, H, Nq, D = q_shape
    BH, Nq_pad, ctype = B * H, -(-Nq // steps.PAD) * steps.PAD, CTYPE[dtype]
    longest_q = Nq if varlen is None else varlen[1]
    fused = steps.fuse_dq_rule("ws", longest_q * opts.group, D)  # a block converts its group's query heads
    main = _main(dtype, q_shape, k_shape, (0, Nq), (0, k_shape[2]), causal, scale, opts, accumulate=False,
                 dq_map=heads_map(q_shape, np.float32), varlen=None if varlen is None else (varlen[0], varlen[2]))
    counters = main.launch.grid[1] if fused else 0  # one per (batch or sequence, k / v head)
    pre = steps.pre_launch(ctype, Nq=Nq, ldq=Nq, Nq_pad=Nq_pad, D=D, BH=BH, zero=True, counters=counters)
    convert = None if fused else steps.convert_launch(ctype, BH * Nq * D)
    scratch = fast_path.out_layout([((BH * Nq_pad,), np.float32), ((BH * Nq_pad,), np.float32),
                                    (q_shape, np.float32)] + [((counters,), np.int32)] * fused)
    return VariantPlan(pre, main, convert, scratch)


def backward(q, k, v, o, lse, do, *, causal, scale, opts):
    """dq, dk, dv of CuPy arrays checked by flash_v3_backward.backward, with variants.Options opts."""
    plan = _plan(np.dtype(q.dtype), q.shape, k.shape, bool(causal), scale, plan_options(opts))
    plan = plan._replace(tail=(slopes_array(opts, *q.shape[:2]), 0, 0))
    return fast_path.launch(plan, q, k, v, o, lse, do)  # kept for the next such call unless the slopes are an array


def backward_packed(q, k, v, o, lse, do, cu, longest, *, causal, scale, opts):
    """dq, dk, dv of a packed batch laid out head by head ((1, H, total, D); lse (1, H, total_q)); cu = (cu_q, cu_k)
    int32 device arrays; longest = (longest query sequence, longest key sequence)."""
    plan = _plan(np.dtype(q.dtype), q.shape, k.shape, bool(causal), scale, plan_options(opts),
                 (cu[0].size - 1, *map(int, longest)))
    return plan._replace(tail=(slopes_array(opts, 1, q.shape[1]), *cu))(q, k, v, o, lse, do)


@functools.lru_cache(maxsize=fast_path.MAX_PLANS)  # the speed layer: the ring repeats its blocks every step
def _block_plan(dtype, q_shape, k_shape, rows, keys, causal, scale, opts):
    """(preprocess, main kernel, scratch layout of D_i and L_i) of one ring block (accumulate_into)."""
    (a, b), B, H, Lq, D = rows, *q_shape
    BH, Nq_pad = B * H, -(-(b - a) // steps.PAD) * steps.PAD
    pre = steps.pre_launch(CTYPE[dtype], Nq=b - a, ldq=Lq, Nq_pad=Nq_pad, D=D, BH=BH, zero=False)
    main = _main(dtype, q_shape, k_shape, rows, keys, causal, scale, opts, accumulate=True,
                 dq_map=heads_map(q_shape, np.float32, rows=rows))
    return pre, main, fast_path.out_layout([((BH * Nq_pad,), np.float32)] * 2)


def accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, *, causal, scale, opts):
    """One ring block with variants (flash_v3_backward.accumulate_into says what it does); dk_run, dv_run have k's
    heads: each block adds its group's sum once."""
    pre, main, scratch = _block_plan(np.dtype(q.dtype), q.shape, k.shape, rows, keys, bool(causal), scale,
                                     plan_options(opts))
    delta, lse_pad = fast_path.empties(*scratch)
    a, c, D = rows[0], keys[0], q.shape[3]
    at = a * D * q.itemsize  # byte offset of row a in every head of o and do
    pre(o.data.ptr + at, do.data.ptr + at, lse.data.ptr + 4 * a, delta, lse_pad, 0, 0)
    kv = 4 * c * D  # byte offset of key c in every head of the float32 accumulators
    main(q, k, v, do, dq_run, lse_pad, delta, 0, dk_run.data.ptr + kv, dv_run.data.ptr + kv, lse_pad, delta, 0, 0,
         slopes_array(opts, *q.shape[:2]), 0, 0)
