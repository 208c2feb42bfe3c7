"""Stage 06's forward with the attention variants real models use (kernels/flash_v3_forward_variants.cu): version
pingpong's main loop with stage 02's hooks (kernels/variants.cuh) in place of plain attention's.

    o, lse = flash_v3.forward(q, k[:, :2], v[:, :2], causal=True)                  # grouped-query k, v
    o, lse = flash_v3.forward(q, k, v, causal=True, window=(1023, 0))              # a sliding window
    o, lse = flash_v3.forward(q, k, v, softcap=30.0)                               # softcap (ALiBi: alibi_slopes)
    o, lse = flash_v3.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)          # a packed batch, one launch

flash_v3.forward and forward_varlen check the inputs and options (stages/common/variants.py) and come here; the
ring's blocks (stage 04) come through flash_v3.merge_into. The kernel's template arguments are the hooks of one of
two levels, as stage 02's (stages/02_flash_v2/tc.py: HOOKS): level 1, WindowMask and PlainScore (grouped-query k, v,
a window, a packed batch: the mask alone changes, and the scale stays in exp2's argument), level 2, WindowMask and
ModScore (softcap or ALiBi change the scores). Dropout is stages 02 and 03's (stages/06_hopper/README.md).
"""
import functools

import numpy as np

from stages.common import LOG2E, fast_path, kernels, variants
from stages.common.params import FwdParams

from .params import HopperVarFwdParams
from .sm90a import CTYPE, function
from .tensor_maps import MappedLaunch, heads_map

FILE = "flash_v3_forward_variants.cu"
HEAD_DIMS = (64, 128, 256)
HOOKS = {1: ("WindowMask", "PlainScore"), 2: ("WindowMask", "ModScore")}  # (Mask, Score) of each level
STAGES = 2
TAKES = "grouped-query k/v, window, softcap and alibi_slopes (and packed batches: forward_varlen)"
DROPOUT = ("dropout runs in stage 02 version 'pipelined' (forward) and stage 03 version 'tc' (backward), which take "
           "every variant")
# The variants' fields of FwdParams that a call writes (the ALiBi slopes, a packed batch's bounds), as byte offsets
# in HopperVarFwdParams: MappedLaunch's tail.
TAIL = tuple(HopperVarFwdParams.var.offset + getattr(FwdParams, f).offset for f in HopperVarFwdParams.VAR_POINTERS)


def level(opts):
    """The hooks' level (HOOKS) for variants.Options: 2 where softcap or ALiBi change the scores, else 1."""
    return 2 if opts.softcap > 0 or opts.alibi_slopes is not None else 1


def tiles(D):
    """(K/V tile keys, dynamic shared memory): version pingpong's tiles on a block per item (flash_v3.config)."""
    bc = 128 if D <= 128 else 64
    return bc, (128 + 2 * STAGES * bc) * D * 2 + 1024


def instantiation(ctype, D, lvl):
    """The kernel's name expression for element type ctype, head dim D and hooks' level lvl."""
    return f"flash_v3_forward_variants<{ctype},{D},{tiles(D)[0]},{','.join(HOOKS[lvl])}>"


def instantiations():
    """[(file, name)]: every instantiation a launch may pick, which CI compiles for sm_90a."""
    return [(FILE, instantiation(c, D, lvl)) for c in CTYPE.values() for D in HEAD_DIMS for lvl in HOOKS]


def check_options(q, k, *, causal, window, softcap, alibi_slopes, dropout_p, seed, where):
    """variants.Options of a forward or backward call, None for plain attention (no option, as many k / v heads as q),
    or a clear error for what stage 06 does not take (dropout)."""
    if (window is None and softcap is None and alibi_slopes is None and not dropout_p
            and k.shape[1] == q.shape[1]):
        return None
    opts = variants.check(q, k, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                          dropout_p=dropout_p, seed=seed, where=where)
    if opts.dropout_p:
        raise ValueError(f"{where}: stage 06 takes {TAKES}, not dropout: {DROPOUT}")
    return None if opts.plain else opts


def plan_options(opts):
    """opts as a launch's key: the ALiBi slopes' presence (True / None), not their values, which come with each call."""
    return opts._replace(alibi_slopes=None if opts.alibi_slopes is None else True, seed=0)


def slopes_array(opts, B, H):
    """The ALiBi slopes as a (B, H) float32 CuPy array (a (H,) array broadcast), or 0: a null pointer."""
    import cupy

    if opts is None or opts.alibi_slopes is None:
        return 0
    return cupy.ascontiguousarray(cupy.broadcast_to(cupy.asarray(opts.alibi_slopes, dtype=cupy.float32), (B, H)))


@functools.lru_cache(maxsize=fast_path.MAX_PLANS)  # once per problem: the choices below depend on nothing else
def launch_rows(dtype, q_shape, k_shape, rows, keys, causal, scale, opts, *, merge, varlen=None):
    """The launch of rows (start, stop) of every query head of a q of q_shape (B, H, Lq, D) against keys (start, stop)
    of k, v of k_shape (B, Hkv, Lk, D): a MappedLaunch on (q, k, v, o, lse, slopes, cu_q, cu_k) (the last three
    arrays or 0). o, lse: the whole outputs, written (merge=False) or merged into (merge=True: a ring block's running
    float32 O, L). opts: plan_options of the call's variants.Options. varlen: (sequences, longest query sequence) of
    a packed batch (B = 1, q, k, v (1, H, total, D), rows and keys all of them), or None."""
    (q0, q1), (k0, k1) = rows, keys
    B, H, Lq, D = q_shape
    Nq, Nk, lvl = q1 - q0, k1 - k0, level(opts)
    bc, smem = tiles(D)
    fn = function(FILE, instantiation(CTYPE[dtype], D, lvl), smem)  # compiled once
    var = FwdParams(Nq=Nq, Nk=Nk, scale=scale, causal=int(causal), H=H, group=H // k_shape[1], left=opts.left,
                    right=opts.right, softcap=opts.softcap if lvl == 2 else 0.0, **variants.origin_fields(opts, Nq, Nk))
    # level 2: ModScore applies the scale to S, and exp2's factor is log2 e alone (as stage 02's)
    params = HopperVarFwdParams(Nq=Nq, Nk=Nk, scale_log2=LOG2E if lvl == 2 else scale * LOG2E, causal=int(causal),
                                o_rows=Lq, merge=int(merge), heads=B * H, var=var)
    grid = (-(-Nq // 128), B * H) if varlen is None else (-(-varlen[1] // 128), varlen[0] * H)
    if grid[1] > 65535:
        raise ValueError(f"flash_v3.forward: {'sequences' if varlen else 'batch'} * heads = {grid[1]} is over the grid "
                         "limit 65535; split the batch")
    return MappedLaunch.of(kernels.Launch(fn, (max(grid[0], 1), grid[1]), (384,), smem, params), tail=TAIL,
                           map_q=heads_map(q_shape, dtype, rows=rows),
                           map_k=heads_map(k_shape, dtype, box_rows=bc, rows=keys),
                           map_v=heads_map(k_shape, dtype, box_rows=bc, rows=keys))


def forward(q, k, v, *, causal, scale, opts):
    """o, lse of CuPy q (B, H, Nq, D), k, v (B, Hkv, Nk, D) checked by flash_v3.forward, with variants.Options opts."""
    B, H, Nq, _ = q.shape
    launch = launch_rows(np.dtype(q.dtype), q.shape, k.shape, (0, Nq), (0, k.shape[2]), bool(causal), scale,
                         plan_options(opts), merge=False)
    plan = kernels.ForwardLaunch(launch, np.dtype(q.dtype), (slopes_array(opts, B, H), 0, 0))
    return fast_path.launch(plan, q, k, v)  # kept for the next such call unless the slopes are an array


def forward_packed(q, k, v, cu, longest, *, causal, scale, opts):
    """o, lse of a packed batch laid out head by head: q (1, H, total_q, D), k, v (1, Hkv, total_k, D), cu = (cu_q,
    cu_k) int32 device arrays, longest: the longest query sequence."""
    launch = launch_rows(np.dtype(q.dtype), q.shape, k.shape, (0, q.shape[2]), (0, k.shape[2]), bool(causal), scale,
                         plan_options(opts), merge=False, varlen=(cu[0].size - 1, int(longest)))
    return kernels.ForwardLaunch(launch, np.dtype(q.dtype), (slopes_array(opts, 1, q.shape[1]), *cu))(q, k, v)


def merge_into(q, k, v, o_run, lse_run, rows, keys, *, causal, scale, opts):
    """One ring block with variants (flash_v3.merge_into says what it does)."""
    launch = launch_rows(np.dtype(q.dtype), q.shape, k.shape, rows, keys, bool(causal), scale, plan_options(opts),
                         merge=True)
    D, q0 = q.shape[3], rows[0]
    launch(q, k, v, o_run.data.ptr + q0 * D * o_run.itemsize, lse_run.data.ptr + 4 * q0,
           slopes_array(opts, *q.shape[:2]), 0, 0)
