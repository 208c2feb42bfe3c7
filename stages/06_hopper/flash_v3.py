"""Stage 06's forward on Hopper: o, lse of attention for CuPy q, k, v (B, H, N, D) in float16 or bfloat16,
D = 64, 128 or 256 (version fp8: 128), or in float32 (version fp32x3, D = 64, 128), on an sm_90 GPU.

    o, lse = flash_v3.forward(q, k, v, causal=True)                    # version "pingpong" (float32: "fp32x3")
    o, lse = flash_v3.forward(q, k, v, causal=True, version="wgmma")
    o, lse = flash_v3.forward(q, k, v, causal=True, version="fp8")     # e4m3 multiplies, d = 128
    o, lse = flash_v3.forward(q, k[:, :2], v[:, :2], causal=True, window=(1023, 0), softcap=30.0)   # variants
    o, lse = flash_v3.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)              # packed batch

Versions, in the order the README teaches them:
  wgmma     (kernels/flash_v3_forward_wgmma.cu) stage 02's algorithm with Hopper's data paths: the copy engine (TMA)
            loads the tiles, wgmma multiplies from shared memory (S = Q K^T) and from registers (O += P V); one
            warpgroup per 64-row Q tile, thread 0 issues the copies, two K/V stages.
  ws        (kernels/flash_v3_forward_ws.cu) warp specialisation: a producer warpgroup issues the copies (setmaxnreg
            gives its registers to the consumers), two consumer warpgroups compute a 128-row Q tile, and full / empty
            mbarriers per stage order them; K/V tiles of 128 keys where the registers allow.
  pingpong  (kernels/flash_v3_forward_pingpong.cu) the softmax hidden behind the GEMMs: the two consumer warpgroups
            take turns at the tensor cores (named barriers), and each issues S_j = Q K_j^T with O += P_{j-1} V_{j-1};
            without a mask a persistent grid on short keys (persistent_rule), and K/V tiles of 192 keys on long ones
            at D = 128 (wide_rule).
  fp32x3    (fp32x3.py, kernels/flash_v3_forward_fp32x3.cu) float32: stage 02's 3xTF32 forward on wgmma, the TF32
            parts of Q_i, K_j and V_j^T in shared memory; two warpgroups share each K/V tile.
  fp8       (fp8.py, kernels/flash_v3_forward_fp8.cu) float16 / bfloat16 in and out, multiplied in e4m3: a pre-pass
            scales each head of q, k, v into e4m3 (v transposed), then version pingpong's main loop on the bytes.

The attention variants (grouped-query and multi-query k, v; a sliding window; softcap; ALiBi; packed batches of
sequences of different lengths) run in version pingpong's main loop with stage 02's hooks: flash_v3_variants.py.

forward() checks the inputs and hands them to the version's launcher: forward_16bit here (wgmma, ws, pingpong: the
configuration, compile and parameter struct in launch_rows), fp32x3.forward, fp8.forward,
flash_v3_variants.forward. It is wrapped by the speed layer (stages/common/fast_path.py), which replays a repeated
call's launch; a reader may skip it.
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import LOG2E, device, fast_path, kernels, variants, varlen
from stages.common.checks import check_causal, check_out_dtype, resolve_scale

from . import flash_v3_variants, fp8, fp32x3
from .params import HopperFwdParams
from .sm90a import CTYPE, ELSEWHERE, ELSEWHERE_FP32, function, require_hopper
from .tensor_maps import MappedLaunch, heads_map

FILES = {"wgmma": "flash_v3_forward_wgmma.cu", "ws": "flash_v3_forward_ws.cu",
         "pingpong": "flash_v3_forward_pingpong.cu"}
VERSIONS = tuple(FILES)        # the 16-bit versions, in the order the README teaches them
DEFAULT = "pingpong"            # for float16 / bfloat16
FP32 = "fp32x3"                 # the float32 version (fp32x3.py)
FP8 = "fp8"                     # float16 / bfloat16 computed in e4m3 (fp8.py)
HEAD_DIMS = (64, 128, 256)
STAGES = 2                      # K/V stages of versions ws and pingpong
WHERE = "flash_v3.forward"

# Version pingpong without a mask: items of at most this many keys run on a persistent grid with K/V tiles of 128
# keys, longer ones on a block per item, at D = 128 with tiles of WIDE_BC keys (dev/forward_grids.py measures both).
PERSISTENT_MAX_KEYS = 2048
WIDE_BC = 192


def persistent_rule(version, causal, nk):
    """Whether the forward launches a persistent grid: one block per SM, each striding over the (Q tile, head) items
    (kernels/hopper_scheduler.cuh), for version pingpong without a mask and with at most PERSISTENT_MAX_KEYS keys.
    Under the causal mask the items differ in work and a static stride leaves some blocks much more than others; long
    items spend little of their time in the once-per-item work the persistent grid overlaps (README: version 3)."""
    return version == "pingpong" and not causal and nk <= PERSISTENT_MAX_KEYS


def wide_rule(version, D, causal, persistent):
    """Whether K_j and V_j are tiles of WIDE_BC keys instead of 128: version pingpong at D = 128 without a mask on a
    block per item (long items). Each tile's fixed work (the barriers, the turn at the tensor cores, the row maxima,
    alpha and rescaling O) is spread over 1.5 times the keys; a consumer then holds S_j (96 registers), P_{j-1} (48)
    and O (64) at once, within its 240. Not at D = 256 (O alone is 128 registers) nor D = 64 (the softmax bounds the
    loop), not under the causal mask (the diagonal tiles would mask more keys). README: version 3."""
    return version == "pingpong" and D == 128 and not causal and not persistent


class Config(NamedTuple):
    """A version's tiles at a head dim: Q_i of br rows, K_j / V_j of bc rows, threads a block, and the dynamic shared
    memory: Q_i and STAGES stages of K_j and V_j (wgmma: two stages of 64 x 64), 2 bytes a value, and 1024 bytes to
    align the first tile to the swizzle's period."""

    br: int
    bc: int
    threads: int
    smem: int


def config(version, D, wide=False):
    """wgmma: one warpgroup, 64 x 64 tiles. ws, pingpong: a producer and two consumer warpgroups (384 threads) on a
    128-row Q_i; K_j of 128 keys while a consumer's registers hold S (64 x bc) and O (64 x D) (D <= 128), else 64;
    wide (wide_rule): K_j of WIDE_BC keys."""
    if wide and not (version == "pingpong" and D == 128):
        raise ValueError(f"tiles of {WIDE_BC} keys are version pingpong's at D = 128, not {version!r} at D = {D}")
    br, bc, threads = (64, 64, 128) if version == "wgmma" else (128, WIDE_BC if wide else 128 if D <= 128 else 64, 384)
    return Config(br, bc, threads, (br + 2 * STAGES * bc) * D * 2 + 1024)


def instantiation(version, ctype, D, bc, persistent=False):
    """The kernel's template instantiation (its name expression) for element type ctype at head dim D, K/V tiles of
    bc keys (config) and, for version pingpong, the grid (persistent_rule)."""
    if version == "wgmma":
        return f"flash_v3_forward_wgmma<{ctype},{D}>"
    if version == "pingpong":
        return f"flash_v3_forward_pingpong<{ctype},{D},{bc},{STAGES},{str(persistent).lower()}>"
    return f"flash_v3_forward_{version}<{ctype},{D},{bc},{STAGES}>"


def _check(q, k, v, version):
    """The version that runs, after every check of forward's inputs (its docstring)."""
    if version is not None and version not in VERSIONS + (FP32, FP8):
        raise ValueError(f"{WHERE}: version {version!r} is not one of {VERSIONS + (FP32, FP8)}")
    fp32 = getattr(q, "dtype", None) == np.float32
    require_hopper(q, k, v, instead=ELSEWHERE_FP32 if fp32 else ELSEWHERE, where=WHERE)  # numpy, another GPU
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{WHERE}: {name} has shape {x.shape}; expected (B, H, N, D)")
    fp32 = q.dtype == k.dtype == v.dtype == np.float32
    if not (fp32 or np.dtype(q.dtype) in CTYPE and q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{WHERE}: q, k, v must share one dtype, float16, bfloat16 or float32 (got {q.dtype}, "
                        f"{k.dtype}, {v.dtype})")
    version = version or (FP32 if fp32 else DEFAULT)
    if fp32 != (version == FP32):
        raise TypeError(f"{WHERE}: version {version!r} takes {'float32' if version == FP32 else 'float16 or bfloat16'}"
                        f", got {q.dtype}; float32 runs in version {FP32!r}, float16 and bfloat16 in "
                        f"{', '.join(VERSIONS)} and {FP8!r}")
    B, H, Nq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"{WHERE}: k and v must be (B, Hkv, Nk, D) = ({B}, Hkv, Nk, {D}) with Hkv dividing H = {H}; "
                         f"got {k.shape}, {v.shape}")
    dims = fp32x3.HEAD_DIMS if fp32 else fp8.HEAD_DIMS if version == FP8 else HEAD_DIMS
    if D not in dims:
        raise ValueError(f"{WHERE}: head dim {D} is not supported{' in float32' if fp32 else ''}"
                         f"{' in version fp8' if version == FP8 else ''}; use one of {dims} (stage 02 takes any)")
    if B * H > 65535:
        raise ValueError(f"{WHERE}: batch * heads = {B * H} is over the grid limit 65535")
    return version


@fast_path.remembered  # the speed layer: a repeated call replays its kept launch (stages/common/fast_path.py)
def forward(q, k, v, *, causal=False, scale=None, version=None, window=None, softcap=None, alibi_slopes=None,
            dropout_p=0.0, seed=0):
    """(o, lse): o (B, H, Nq, D) in q's dtype, lse (B, H, Nq) float32. version None: DEFAULT for float16 / bfloat16,
    fp32x3 for float32. Variants (stages/common/variants.py), version pingpong in float16 / bfloat16: k, v with fewer
    heads (grouped-query; Hkv dividing H), window=(left, right), softcap, alibi_slopes; dropout is stage 02's. Raises
    TypeError for numpy arrays and device.UnsupportedDevice without an sm_90 GPU, both naming the stage 02 / 03
    versions that compute the same attention there; TypeError / ValueError for what the kernels do not take."""
    import cupy

    version = _check(q, k, v, version)
    causal = check_causal(causal, WHERE)
    opts = flash_v3_variants.check_options(q, k, causal=causal, window=window, softcap=softcap,
                                           alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, where=WHERE)
    if opts is not None and version != DEFAULT:
        raise ValueError(f"{WHERE}: {flash_v3_variants.TAKES} run in version {DEFAULT!r} (float16 / bfloat16), not "
                         f"{version!r}; stage 02 version 'pipelined' takes them too, and version 'fp32' in float32")
    B, H, Nq, D = q.shape
    scale = resolve_scale(scale, D)
    if Nq == 0 or (k.shape[2] == 0 and version != FP32):  # no rows, or no key for any row: O = 0, L = -inf (a
        # tensor map has no empty dimension)
        return cupy.zeros_like(q), cupy.full((B, H, Nq), -np.inf, cupy.float32)
    if opts is not None:
        return flash_v3_variants.forward(q, k, v, causal=causal, scale=scale, opts=opts)
    if version == FP32:
        return fp32x3.forward(q, k, v, causal=causal, scale=scale)
    if version == FP8:
        return fp8.forward(q, k, v, causal=causal, scale=scale)
    return forward_16bit(q, k, v, causal=causal, scale=scale, version=version)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                   scale=None, version=None, out_dtype=None, window=None, alibi_slopes=None, softcap=None,
                   dropout_p=0.0, seed=0):
    """Attention over a packed batch of sequences of different lengths, none attending across sequences (the
    definition: stages/common/varlen.py), as stage 02's forward_varlen: q (total_q, H, D), k and v (total_k, Hkv, D),
    cu_seqlens_q and cu_seqlens_k (sequences + 1,) integers; returns o (total_q, H, D) and lse (H, total_q). One
    launch of version pingpong with the variants' hooks (flash_v3_variants.py) for the whole batch: each block finds
    its sequence's rows from cu_seqlens, so no padding is computed. Takes forward's options; out_dtype only q's."""
    where = "flash_v3.forward_varlen"
    require_hopper(q, k, v, where=where)
    for name, x in (("q", q), ("k", k), ("v", v)):
        varlen.check_packed(x, where, name)
    qb, kb, vb = (kernels.row_major(varlen.as_batch(x)) for x in (q, k, v))  # (1, H, total, D)
    version = _check(qb, kb, vb, version)
    if version != DEFAULT:
        raise ValueError(f"{where}: packed batches run in version {DEFAULT!r} (float16 / bfloat16), not {version!r}; "
                         "stage 02's forward_varlen takes every version")
    if check_out_dtype(out_dtype, q.dtype, where) != q.dtype:
        raise ValueError(f"{where}: o comes in q's dtype here; a float32 o (out_dtype) is stage 02's forward_varlen")
    causal = check_causal(causal, where)
    opts = flash_v3_variants.check_options(qb, kb, causal=causal, window=window, softcap=softcap,
                                           alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, where=where)
    opts = opts or variants.check(qb, kb, causal=causal, where=where)  # a plain batch: its causal mask alone
    cq, _, cu = varlen.kernel_bounds(q, k, cu_seqlens_q, cu_seqlens_k, where, max_seqlen_q, max_seqlen_k)
    import cupy

    H, D = q.shape[1], q.shape[2]
    if q.shape[0] == 0 or k.shape[0] == 0:  # no rows, or no key at all: O = 0, L = -inf
        return cupy.zeros_like(q), cupy.full((H, q.shape[0]), -np.inf, cupy.float32)
    o, lse = flash_v3_variants.forward_packed(qb, kb, vb, cu, int(np.diff(cq).max()), causal=causal,
                                              scale=resolve_scale(scale, D), opts=opts)
    return cupy.ascontiguousarray(o[0].swapaxes(0, 1)), lse[0]


def forward_16bit(q, k, v, *, causal, scale, version):
    """Versions wgmma, ws and pingpong on CuPy q, k, v checked by forward(): o (B, H, Nq, D) in q's dtype, lse."""
    Nq, Nk = q.shape[2], k.shape[2]
    launch = launch_rows(version, np.dtype(q.dtype), q.shape, Nk, (0, Nq), (0, Nk), causal, scale, merge=False)
    return fast_path.launch(kernels.ForwardLaunch(launch, np.dtype(q.dtype)), q, k, v)  # o, lse allocated; launch


def launch_rows(version, dtype, q_shape, Lk, rows, keys, causal, scale, *, merge, persistent=None, wide=None):
    """The launch of rows (start, stop) of every head of a q of q_shape (B, H, Lq, D) against keys (start, stop) of
    k, v of Lk rows a head: a MappedLaunch on (q, k, v, then o and lse at those rows). o, lse: the whole outputs
    (heads of Lq rows), written (merge=False) or merged into (merge=True, float32: a ring block). persistent: the
    grid, by persistent_rule when None (True or False to compare the two; only version pingpong walks items); wide:
    K/V tiles of WIDE_BC keys, by wide_rule when None."""
    (q0, q1), (k0, k1) = rows, keys
    B, H, Lq, D = q_shape
    if persistent is None:  # the configuration: the grid and the K/V tiles by the rules, or as asked
        persistent = persistent_rule(version, causal, k1 - k0)
    elif persistent and version != "pingpong":
        raise ValueError(f"only version pingpong launches a persistent grid, not {version!r}")
    if wide is None:
        wide = wide_rule(version, D, causal, persistent)
    cfg = config(version, D, wide)
    fn = function(FILES[version], instantiation(version, CTYPE[dtype], D, cfg.bc, persistent), cfg.smem)  # compiled
    params = HopperFwdParams(Nq=q1 - q0, Nk=k1 - k0, scale_log2=scale * LOG2E, causal=int(bool(causal)),
                             o_rows=Lq, merge=int(merge), heads=B * H)
    grid = (-(-(q1 - q0) // cfg.br), B * H)  # one block per (Q tile i, head)
    if persistent:  # one block per SM, each striding over the items
        grid = (min(grid[0] * grid[1], device.device().sm_count), 1)
    kv_shape = (B, H, Lk, D)  # the tensor maps: boxes of Q_i's rows and of K_j's, V_j's bc keys, one head each
    return MappedLaunch.of(kernels.Launch(fn, grid, (cfg.threads,), cfg.smem, params),
                           map_q=heads_map(q_shape, dtype, rows=rows),
                           map_k=heads_map(kv_shape, dtype, box_rows=cfg.bc, rows=keys),
                           map_v=heads_map(kv_shape, dtype, box_rows=cfg.bc, rows=keys))


def takes(dtype, head_dim, *, heads=1, kv_heads=1, batch=1):
    """Whether stage 06 computes such a problem on this GPU: an sm_90 GPU, float16 or bfloat16, a head dim of
    HEAD_DIMS, kv_heads dividing heads (grouped-query attention), B H within the grid. The ring (stage 04) and the GPT
    (stage 05) ask before they pick stage 06 over stage 02; merge_into takes a window, softcap and ALiBi too."""
    try:
        require_hopper()
    except device.UnsupportedDevice:  # not an sm_90 GPU, or none
        return False
    return (np.dtype(dtype) in CTYPE and head_dim in HEAD_DIMS and kv_heads >= 1 and heads % kv_heads == 0
            and batch * heads <= 65535)


# The speed layer's part for the ring: its blocks repeat every step, so their launches are kept per block problem.
_block_launch = functools.lru_cache(maxsize=fast_path.MAX_PLANS)(launch_rows)


def merge_into(q, k, v, o_run, lse_run, rows, keys, *, causal, scale, version=DEFAULT, opts=None):
    """One block of ring attention (stage 04), merged in place, as stage 02's tc.merge_into: rows = (q_start, q_stop)
    of q (B, H, Lq, D) against keys = (k_start, k_stop) of k, v (B, Hkv, Lk, D); the block's O_i, L_i merge in the
    kernel's epilogue into the running float32 O, L of those rows (o_run (B, H, Lq, D), lse_run (B, H, Lq); L = -inf
    where nothing was merged yet). No row is copied: the tensor maps start at the rows' first and step over whole
    heads. Causal: bottom-right aligned within the block. opts: variants.Options of the block (its window, softcap,
    ALiBi and origin; dropout is stage 02's), or None; k, v with fewer heads than q (grouped-query) or any option run
    the variants' kernel (flash_v3_variants.py). The caller checks the arrays (takes())."""
    if opts is None:  # plain attention, or grouped-query as the heads say
        opts = variants.check(q, k, causal=causal, where="flash_v3.merge_into")
    if opts.dropout_p:
        raise ValueError(f"flash_v3.merge_into: {flash_v3_variants.DROPOUT}")
    if not opts.plain:
        return flash_v3_variants.merge_into(q, k, v, o_run, lse_run, rows, keys, causal=causal, scale=scale,
                                            opts=opts)
    launch = _block_launch(version, np.dtype(q.dtype), q.shape, k.shape[2], rows, keys, bool(causal), scale,
                           merge=True)
    D, q0 = q.shape[3], rows[0]
    launch(q, k, v, o_run.data.ptr + q0 * D * o_run.itemsize, lse_run.data.ptr + 4 * q0)  # o, L from row q0 on


def launch_choices(version):
    """[(D, persistent, wide)]: every kernel of a version a launch may pick (the grid of persistent_rule, the tiles
    of wide_rule), per 16-bit type."""
    grids = (False, True) if version == "pingpong" else (False,)
    return [(D, p, w) for D in HEAD_DIMS for p in grids for w in (False, True)
            if not w or wide_rule(version, D, False, p)]


def instantiations(version):
    """[(file, name)]: the instantiations of a version that CI compiles for sm_90a (version pingpong's with the
    variants: flash_v3_variants.instantiations)."""
    return [(FILES[version], instantiation(version, c, D, config(version, D, w).bc, p)) for c in CTYPE.values()
            for D, p, w in launch_choices(version)]
