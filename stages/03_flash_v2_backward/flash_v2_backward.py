"""Stage 03: FlashAttention-2 backward (arXiv 2307.08691, Algorithm 2): launcher.

    dq, dk, dv = backward(q, k, v, o, lse, do, causal=False, scale=None, version="auto", deterministic=False)
    o, lse = forward(q, k, v, causal=False, scale=None)     # stage 02's forward (stage 01's if 02 is absent)

numpy inputs run the tile mirror (mirror.py), CuPy inputs the CUDA kernels:
    kernels/flash_v2_backward_pre.cu   D_i = rowsum(dO_i * O_i), L_i rescaled; dQ accumulator -> dQ
    kernels/flash_v2_backward_fp32.cu  version "fp32": float32, CUDA cores, head_dim 32, 64, 128
    kernels/flash_v2_backward_fp32x3.cu  version "fp32x3": float32 on TF32 tensor cores (the 3xTF32 split, close
                                       to fp32 accuracy; sm_80 and newer), head_dim 32, 64, 128
    kernels/flash_v2_backward_tc.cu    version "tc": float16 / bfloat16, mma.sync tensor cores, head_dim 64, 128,
                                       256 (d = 256: two blocks per K/V tile, one per half of dK_j, dV_j, dQ_i)
    kernels/flash_v2_backward_dq.cu    version "tc"'s deterministic dQ pass

version "auto": fp32 for float32 (fp32x3 on a GPU with TF32 tensor cores, with deterministic=False and no
variants), tc for float16 / bfloat16.
deterministic: False (default) adds dQ_i += dS_ij K_j into an fp32 buffer with atomicAdd from the block of
every K/V tile: fast, but the order of the additions (so the last bits of dq) changes from run to run.
True: no atomics; a second kernel, parallel over Q tiles, recomputes dS_ij and sums dQ_i in a fixed
order: dq, dk, dv are bit-identical across runs (dk, dv always are), at the cost of recomputing S and dP.
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import (
    bfloat16, cast, check_backward_inputs, check_causal, check_out_dtype, device, empty, fast_path, kernels,
    load_module, resolve_scale, variants, varlen,
)

from . import mirror

VERSIONS = ("fp32", "tc", "fp32x3")
HEAD_DIMS = {"fp32": (32, 64, 128), "tc": (64, 128, 256), "fp32x3": (32, 64, 128)}
DTYPES = {"fp32": (np.dtype(np.float32),), "tc": (np.dtype(np.float16), bfloat16), "fp32x3": (np.dtype(np.float32),)}
PAD = 128  # L_i and D_i are padded to a multiple of 128 rows (>= every Br) so tile loads never run past them

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half", bfloat16: "__nv_bfloat16"}
# kernels/ files of each version: (its main kernels, its deterministic dQ pass)
FILES = {"fp32": ("flash_v2_backward_fp32.cu", "flash_v2_backward_fp32.cu"),
         "tc": ("flash_v2_backward_tc.cu", "flash_v2_backward_dq.cu"),
         "fp32x3": ("flash_v2_backward_fp32x3.cu", None)}  # atomic dQ only: deterministic=True is version fp32's
TC_BR, TC_BC = mirror.TC_BR, mirror.TC_BC  # Br, Bc of the tc kernel per head dim (Bc / 16 warps): the mirror's tiles
# The tc kernel's atomic dQ for Q tile i runs one tile late, at the end of the next tile (one barrier per tile
# instead of two; dS^T double-buffered). False: right after tile i, behind a second barrier (tc_config=
# {"defer_dq": False}; dev/sweep_backward.py compares).
TC_DEFER_DQ = True
# Per head dim: m-tiles (16 rows) of dQ_i per warp in the tc kernel's dQ step (2: 32 x 32 tiles at both head dims),
# and whether each warp keeps its K_j, V_j A fragments in registers (KREG) instead of reloading them from shared
# memory per 64-row Q chunk (d=64 only: at d=128 the 64 extra registers do not fit beside the accumulators).
# d = 256 splits the head dim in two halves, one per block (TC_PARTS): each block's dK_j, dV_j half is 128
# registers a thread, so its S^T, dP^T chunks are 32 query rows.
TC_DQ_MT = {64: 2, 128: 2, 256: 1}
TC_KREG = {64: True, 128: False, 256: False}
TC_CHUNK = {64: 64, 128: 64, 256: 32}  # query rows per chunk (BRC) of a Q tile: S^T, dP^T of one chunk in registers
TC_PARTS = {64: 1, 128: 1, 256: 2}  # blocks per K/V tile, each with HD / parts columns of dK_j, dV_j, dQ_i (grid.z)
# Block order of the tc main kernel. j_fast: K/V tile index fastest, grid (Tc, BH): the blocks in flight are the
# K/V tiles of a few heads, which stream the same Q_i, dO_i and add to the same dQ_i (L2 hits). Otherwise grid
# (BH, Tc), every head's j = 0 block first: under causal those have the most Q tiles, so the long blocks start
# first and the short ones fill the tail. Non-causal blocks are all alike: j_fast. Causal: j_fast up to
# TC_CAUSAL_J_FAST_NK keys per head, the longest blocks first above (results/sweep_block_order_h100.csv compares
# the two orders; tc_config={"j_fast": ...} picks one).
TC_CAUSAL_J_FAST_NK = 2048
# Who writes dQ = scale * dQ_accum in the tc kernel's atomic mode. Fused: each head's last block to finish (a counter
# per head) converts the head's Nq x d accumulator, so the backward is two launches, not three: one launch less of
# host time per call, and no pass over the whole accumulator after the grid. But that block converts alone, on one
# SM: a long head's conversion outlasts the other blocks' work at the end of the grid (most of all under a sliding
# window, which leaves each head little work). Unfused: bwd_convert_dq, a third launch over the whole GPU. Fused up
# to TC_FUSE_DQ_MAX accumulator elements per head, N = 2048 at d = 128 (results/sweep_fuse_dq_h100.csv compares
# the two; tc_config={"fuse_dq": ...} picks one).
TC_FUSE_DQ_MAX = 2048 * 128
TC_CONFIG_KEYS = ("br", "bc", "wq", "defer_dq", "j_fast", "fuse_dq")  # backward's tc_config (tuning runs)


def j_fast_order(causal, nk):
    """Whether the tc kernel's grid runs K/V tiles fastest (see TC_CAUSAL_J_FAST_NK) for nk keys per head."""
    return not causal or nk <= TC_CAUSAL_J_FAST_NK


def fuse_dq_rule(nq, d):
    """Whether the tc kernel converts dQ itself (see TC_FUSE_DQ_MAX) for nq query rows per head of head dim d."""
    return nq * d <= TC_FUSE_DQ_MAX


class TcTiles(NamedTuple):
    """The tc kernel's configuration: Br query rows per Q tile, Bc key rows per block (Bc / 16 warps), and the warp
    layout wq. wq = 1: each warp owns 16 key rows for all four matmuls of a tile pair; P^T and dS^T stay in registers.
    wq = 2: each pair of warps owns 32 key rows; the two split the queries of S^T, dP^T and then the columns of dK_j,
    dV_j, so P^T and dS^T go through shared memory (Bc x (Br + 8) 16-bit more), and each warp reads half of Q_i and
    dO_i for S^T, dP^T and half of their columns for dK_j, dV_j: fewer shared-memory bytes per mma."""
    br: int
    bc: int
    wq: int


# The tc kernel's tiles per head dim, first choice first (TC_BR[D], TC_BC[D]); the later ones are for GPUs with less
# shared memory (smem_bytes gives each need; device.pick takes the first that fits): (Br, Bc) = (128, 128) at d = 64
# needs 178 KB and (64, 128) at d = 128 173 KB (191 KB with wq = 2), more than an A100 allows a block (163 KB);
# (64, 128) at d = 64 and (32, 128) at d = 128 fit an A100 (109 and 123 KB), Bc = 64 (4 warps) an RTX 3090 / 4090
# (99 KB), and the last of d = 64 and d = 128 a T4 (47 and 58 KB of its 64 KB). d = 256: (64, 64) needs 217 KB (an
# H100), (32, 64) 143 KB (an A100), (16, 32) 69 KB (99 KB GPUs; a T4 has no room for d = 256). Each list is in the
# order of speed on the H100 (results/sweep_backward_layout_h100.csv, from dev/sweep_backward.py).
# The pair layout (wq = 2) comes first only at d = 128 with Br = 64: at d = 64 each warp's K_j, V_j fragments already
# stay in registers (KREG), so S^T reads only Q_i and the pairs' round trip of P^T, dS^T costs more than it saves.
TC_CANDIDATES = {64: [TcTiles(128, 128, 1), TcTiles(64, 128, 1), TcTiles(64, 64, 1), TcTiles(32, 64, 1)],
                 128: [TcTiles(64, 128, 2), TcTiles(64, 128, 1), TcTiles(32, 128, 1), TcTiles(32, 64, 1),
                       TcTiles(16, 64, 1)],
                 256: [TcTiles(64, 64, 1), TcTiles(32, 64, 1), TcTiles(16, 32, 1)]}


def tiles_error(D, br, bc, wq):
    """Why the tc kernel cannot take tiles (Br, Bc, wq) at head dim D, or None: Br a multiple of 16 up to PAD
    rows, Bc of 16 wq (a whole number of warp groups), wq 1 or 2, and with wq = 2 each warp's half of a query chunk
    (min(Br, TC_CHUNK[D]) rows) whole 16-row m-tiles."""
    if wq not in (1, 2):
        return f"wq must be 1 or 2, got {wq!r}"
    if br % 16 or not 16 <= br <= PAD or bc % (16 * wq) or bc < 16 * wq:
        return f"Br must be a multiple of 16 up to {PAD} and Bc of {16 * wq} (wq={wq}), got Br={br}, Bc={bc}"
    if min(TC_CHUNK[D], br) % (16 * wq):
        return f"wq=2 at d={D} needs min(Br, {TC_CHUNK[D]}) to be a multiple of 32, got Br={br}"
    return None


def tc_tiles(D, dev=None):
    """TcTiles of the tc kernel at head dim D on device dev (None: the first candidate)."""
    cands = TC_CANDIDATES[D]
    if dev is None:
        return cands[0]
    return device.pick(cands, lambda c: smem_bytes("tc", D, *c)[0], dev, what=f"flash_v2_backward version 'tc' d={D}")


def reachable_tc(D, dev):
    """True when some tc tiles at head dim D fit dev's shared memory."""
    return any(device.fits(dev, smem_bytes("tc", D, *c)[0]) for c in TC_CANDIDATES[D])


class Fp32x3Tiles(NamedTuple):
    """Version fp32x3's configuration: nw warps of 16 key rows each (Bc = 16 nw keys per block), Br query rows per
    Q tile (one buffer of Q_i, dO_i: tile i+1 loads during tile i's dQ step) and minb, the blocks per SM the
    registers must allow."""
    nw: int
    br: int
    minb: int

    @property
    def bc(self):
        return 16 * self.nw

    @property
    def threads(self):
        return 32 * self.nw


# Version fp32x3's configurations per head dim, first choice first; the later ones are for GPUs with less shared
# memory (fp32x3_smem gives each need). Four warps with registers for two blocks per SM, and the largest Br two
# blocks' shared memory holds with one buffer of Q_i, dO_i (64 at d <= 64, 32 at d = 128): each split of P^T, dS^T
# then serves Br / 8 k steps of dV_j, dK_j, where a second buffer would halve Br to overlap the copies.
FP32X3_CANDIDATES = {32: [Fp32x3Tiles(4, 64, 2)],
                     64: [Fp32x3Tiles(4, 64, 2), Fp32x3Tiles(4, 32, 2), Fp32x3Tiles(4, 16, 2)],
                     128: [Fp32x3Tiles(4, 32, 2), Fp32x3Tiles(4, 16, 2)]}
def fp32x3_smem(D, cfg):
    """Version fp32x3's dynamic shared memory (bytes): K_j, V_j [Bc][D+4], Q_i, dO_i [Br][D+4], dS^T [Bc][Br+4],
    L_i, D_i [Br] floats, as in the kernel's layout comment."""
    rows = 2 * cfg.bc * (D + 4) + 2 * cfg.br * (D + 4)  # K_j, V_j; Q_i, dO_i
    return 4 * (rows + cfg.bc * (cfg.br + 4) + 2 * cfg.br)


def fp32x3_tiles(D, dev=None):
    """Fp32x3Tiles at head dim D on device dev (None: the first candidate)."""
    cands = FP32X3_CANDIDATES[D]
    if dev is None:
        return cands[0]
    return device.pick(cands, lambda c: fp32x3_smem(D, c), dev, what=f"flash_v2_backward version 'fp32x3' d={D}")


def fp32x3_name(D, cfg):
    """The template instantiation of version fp32x3 at head dim D."""
    return f"flash_bwd_fp32x3<{D},{cfg.nw},{cfg.br},{cfg.minb}>"


def resolve_version(version, dtype):
    """'auto' -> 'fp32' for float32, 'tc' for float16/bfloat16; otherwise check the name and dtype."""
    dtype = np.dtype(dtype)
    if version == "auto":
        for name, dts in DTYPES.items():
            if dtype in dts:
                return name
        raise TypeError(f"flash_v2_backward: dtype {dtype} is not supported; use float32 (version fp32) or "
                        "float16/bfloat16 (version tc); stage 00 (naive) handles float64")
    if version not in VERSIONS:
        raise ValueError(f"flash_v2_backward: unknown version {version!r}; choose one of {VERSIONS} or 'auto'")
    if dtype not in DTYPES[version]:
        names = ", ".join(d.name for d in DTYPES[version])
        raise TypeError(f"flash_v2_backward: version {version!r} takes {names}, got {dtype}; "
                        "version='auto' picks fp32 for float32 and tc for float16/bfloat16")
    return version


def _fp32x3_runs(xp, deterministic, opts, D):
    """Whether version="auto" runs fp32x3 for float32 (resolve_version's fp32 otherwise): on a GPU with TF32 tensor
    cores (sm_80 on; not the CPU mirror), for plain attention at its head dims with the atomic dQ."""
    return (xp is not np and not deterministic and opts is None and D in HEAD_DIMS["fp32x3"]
            and device.tf32_tensor_cores(device.device()))


def forward(q, k, v, *, causal=False, scale=None, **kw):
    """The forward this backward pairs with, so the stage has the shared API: stage 02's forward (imported
    lazily, on first call); if stage 02 does not import, stage 01's fp32 forward (float32 inputs only)."""
    try:
        from stages import flash_v2
    except (ImportError, OSError) as e:  # OSError: the folder exists but has no __init__.py yet
        if np.dtype(q.dtype) != np.float32:
            raise NotImplementedError(
                f"flash_v2_backward.forward: stage 02 (stages.flash_v2) does not import ({e}); stage 01's "
                f"forward only takes float32, got {q.dtype}: pass float32 inputs or fix stage 02") from e
        from stages import flash_v1

        return flash_v1.forward(q, k, v, causal=causal, scale=scale)
    return flash_v2.forward(q, k, v, causal=causal, scale=scale, **kw)


@fast_path.remembered  # a plain GPU call seen before goes straight to its planned launches (stages/common/fast_path.py)
def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version="auto", deterministic=False, out_dtype=None,
             tc_config=None, profile=None, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0, seed=0,
             origin=None):
    """Gradients (dq, dk, dv) of sum(O * dO), shaped like q, k, v, in their dtype, or in float32 with
    out_dtype=np.float32 (straight from the float32 accumulators: the ring adds such partial gradients).

    For tuning (dev/sweep_backward.py), CuPy arrays only: tc_config, the tc kernel's {"br": Br, "bc": Bc, "wq":
    1 or 2, "defer_dq": bool, "j_fast": bool, "fuse_dq": bool} in place of TC_BR[D], TC_BC[D], wq 1, TC_DEFER_DQ,
    j_fast_order, fuse_dq_rule (None or a missing key: the default; neither br nor bc: the device's TcTiles);
    profile, a list that receives (name, cupy.cuda.Event) after each launch.
    Variants (stages/common/variants.py): grouped-query k, v (fewer heads), window, alibi_slopes, softcap,
    dropout_p with seed, origin (a block of a larger problem: the ring); the mirror (numpy inputs) takes them all,
    and so does version 'tc' on the GPU with deterministic=False (dropout regenerates the forward's mask from the
    seed: pass the forward's dropout_p, seed and origin)."""
    where = "flash_v2_backward"
    xp, B, H, Nq, Nk, D = check_backward_inputs(q, k, v, o, lse, do, where=where, gqa=True)
    causal = check_causal(causal, where)
    opts = None
    if (window is not None or alibi_slopes is not None or softcap is not None or dropout_p or k.shape[1] != H
            or origin is not None):
        opts = variants.check(q, k, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                              dropout_p=dropout_p, seed=seed, origin=origin, where=where)
        opts = None if opts.plain else opts
    if opts is not None and xp is not np and (deterministic or q.dtype == np.float32):
        raise ValueError(f"{where}: on the GPU the variants (dropout included) run in version 'tc' (float16 / "
                         "bfloat16) with deterministic=False; the CPU mirror (numpy inputs) and stage 00 take them "
                         "all")
    out_dtype = check_out_dtype(out_dtype, q.dtype, "flash_v2_backward")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"flash_v2_backward: deterministic must be True or False, got {deterministic!r}")
    asked, version = version, resolve_version(version, q.dtype)
    if asked == "auto" and version == "fp32" and _fp32x3_runs(xp, deterministic, opts, D):  # fast float32 where it runs
        version = "fp32x3"
    if D not in HEAD_DIMS[version]:
        others = [v for v in VERSIONS if v != version and D in HEAD_DIMS[v]]
        alt = "".join(f" or version {v!r} ({'/'.join(d.name for d in DTYPES[v])})" for v in others)
        raise ValueError(f"flash_v2_backward: head_dim {D} is not supported by version {version!r}; "
                         f"use one of {HEAD_DIMS[version]}{alt}")
    if version == "fp32x3" and deterministic:
        raise ValueError("flash_v2_backward: version 'fp32x3' adds dQ with atomics (deterministic=False); "
                         "deterministic=True runs in version 'fp32'")
    scale = resolve_scale(scale, D)
    if tc_config is not None and (version != "tc" or xp is np or set(tc_config) - set(TC_CONFIG_KEYS)):
        raise ValueError(f"flash_v2_backward: tc_config={tc_config!r} takes the keys {', '.join(TC_CONFIG_KEYS)} and "
                         f"applies to version 'tc' on CuPy arrays; got version {version!r} on {xp.__name__} arrays")
    if tc_config is not None and any(not isinstance(tc_config.get(x, False), (bool, np.bool_))
                                      for x in ("defer_dq", "j_fast", "fuse_dq")):
        raise ValueError(f"flash_v2_backward: tc_config={tc_config!r}: defer_dq, j_fast and fuse_dq must be True or "
                         "False")
    if profile is not None and xp is np:
        raise ValueError("flash_v2_backward: profile= records CUDA events: CuPy arrays only")
    if xp is np:
        return mirror.backward(q, k, v, o, lse, do, causal=causal, scale=scale, version=version,
                               deterministic=bool(deterministic), out_dtype=out_dtype, opts=opts)
    variants.check_kernel_origin(opts, where)
    deterministic = bool(deterministic)
    if opts is None and tc_config is None and profile is None:  # plain attention (grouped-query k, v has opts)
        return fast_path.launch(plan_backward(q, k, causal, scale, version, deterministic, out_dtype),
                                q, k, v, o, lse, do)
    return _gpu_backward(q, k, v, o, lse, do, causal, scale, version, deterministic, out_dtype, tc_config or {},
                         profile, opts)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """Stage 02's forward_varlen, the packed-batch forward this backward_varlen pairs with."""
    from stages import flash_v2

    return flash_v2.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)


def backward_varlen(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                    causal=False, scale=None, version="auto", out_dtype=None, window=None, alibi_slopes=None,
                    softcap=None, dropout_p=0.0, seed=0):
    """The gradients of a packed batch (flash_v2.forward_varlen; the definition: stages/common/varlen.py):
    dq (total_q, H, D), dk and dv (total_k, Hkv, D).

    numpy: the mirror on each sequence. CuPy: version 'tc' once for the whole batch (deterministic=False): the
    inputs laid out head by head ((H, total, D)), one block per (sequence, head, K/V tile of the longest sequence),
    each finding its rows from cu_seqlens; dK, dV float per query head, summed over each kv group, then rounded."""
    where = "flash_v2_backward.backward_varlen"
    packed = [varlen.check_packed(x, where, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (do, "do"))]
    xp = check_backward_inputs(*(varlen.as_batch(x) for x in packed[:4]), lse[None], varlen.as_batch(do),
                               where=where, gqa=True)[0]
    kw = dict(causal=causal, scale=scale, version=version, out_dtype=out_dtype, window=window,
              alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed)
    if xp is np:
        return varlen.per_sequence_backward(backward, q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, where=where, **kw)
    import cupy

    cq, ck, cu = varlen.kernel_bounds(q, k, cu_seqlens_q, cu_seqlens_k, where, max_seqlen_q, max_seqlen_k)
    version = resolve_version(version, q.dtype)
    if version != "tc":
        raise ValueError(f"{where}: on the GPU packed batches run in version 'tc' (float16 / bfloat16); got version "
                         f"{version!r} ({q.dtype}). The CPU mirror (numpy inputs) takes every version")
    D = q.shape[2]
    if D not in HEAD_DIMS[version]:
        raise ValueError(f"{where}: head_dim {D} is not supported by version 'tc'; use one of {HEAD_DIMS['tc']}")
    qb, kb, vb, ob, dob = (kernels.row_major(varlen.as_batch(x)) for x in packed)  # (1, H, total, D)
    causal = check_causal(causal, where)
    opts = variants.check(qb, kb, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                          dropout_p=dropout_p, seed=seed, where=where)
    out_dtype = check_out_dtype(out_dtype, q.dtype, where)
    dq, dk, dv = _gpu_backward(qb, kb, vb, ob, lse[None], dob, causal, resolve_scale(scale, D), version, False,
                               out_dtype, {}, None, opts, varlen=cu + (int(np.diff(ck).max()),))
    return tuple(cupy.ascontiguousarray(x[0].swapaxes(0, 1)) for x in (dq, dk, dv))


def _dq_mt(D, br, bc):
    """TC_DQ_MT[D] where the Bc / 16 warps can split dQ_i (Br x D) into tiles of 16 MT rows and a multiple of 16
    columns (tc_config may set other Br, Bc); 1 otherwise."""
    mt, nw = TC_DQ_MT[D], bc // 16
    rg = br // (16 * mt)
    ok = rg >= 1 and br % (16 * mt) == 0 and nw % rg == 0 and (D // TC_PARTS[D] // (nw // rg)) % 16 == 0
    return mt if ok else 1


def _names(version, ctype, D, defer=None, otype=None, br=None, bc=None, wq=None, var=False, drop=False):
    """Template instantiations of one (version, input type, head dim, output type): compiled together, once.
    [atomic main kernel, deterministic main kernel, deterministic dQ pass]. otype: the gradients' type (the
    input type, or float for a ring block's unrounded partial gradients). var (tc, atomic only): the variants'
    window, softcap and ALiBi; their dK, dV are float (summed over a kv group, then cast), dQ is otype; drop (with
    var): dropout too."""
    if version == "fp32":
        return [f"flash_bwd_fp32<{D},true>", f"flash_bwd_fp32<{D},false>", f"flash_bwd_dq_fp32<{D}>"]
    wq = wq or (tc_tiles(D).wq if br is None and bc is None else 1)
    br, bc = br or TC_BR[D], bc or TC_BC[D]
    defer = "true" if (TC_DEFER_DQ if defer is None else defer) else "false"
    extra = f"{_dq_mt(D, br, bc)},{'true' if TC_KREG[D] else 'false'},{min(TC_CHUNK[D], br)},{wq}"
    ot = otype or ctype  # dQ's type; dK, dV's too, but float with var
    if var:
        return [f"flash_v2_backward_tc<{ctype},float,{ot},{D},{br},{bc},true,{defer},{extra},true,"
                f"{'true' if drop else 'false'}>"]
    return [f"flash_v2_backward_tc<{ctype},{ot},{ot},{D},{br},{bc},true,{defer},{extra}>",
            f"flash_v2_backward_tc<{ctype},{ot},{ot},{D},{br},{bc},false,false,{extra}>",
            f"flash_v2_backward_dq_tc<{ctype},{ot},{D}>"]


PRE_NAMES = [f"{k}<{c}>" for k in ("bwd_preprocess", "bwd_convert_dq") for c in ("float", "__half", "__nv_bfloat16")]


def smem_bytes(version, D, br=None, bc=None, wq=1):
    """Dynamic shared memory of (main kernel, dQ kernel): the same sums as the kernels' layout comments."""
    if version == "fp32":
        br = bc = 32
        main = 2 * bc * (D + 1) + 2 * br * (D + 1) + 2 * bc * (br + 1) + 2 * br
        dq = 2 * bc * (D + 1) + 2 * br * (D + 1) + br * (bc + 1) + 2 * br
        return 4 * main, 4 * dq
    br, bc = br or TC_BR[D], bc or TC_BC[D]
    main = 2 * (2 * bc * (D + 8) + 2 * 2 * br * (D + 8) + (3 if wq > 1 else 2) * bc * (br + 8)) + 4 * 2 * 2 * br
    dq_bc = 32 if D > 128 else 64  # the dQ pass's K/V tile (dq_bc in the kernel)
    dq = 2 * (2 * 64 * (D + 8) + 2 * 2 * dq_bc * (D + 8))
    return main, dq


def _mark(profile, name):
    """Record an event after a launch when profile is a list (per-kernel times for dev/sweep_backward.py)."""
    if profile is not None:
        import cupy

        ev = cupy.cuda.Event()
        ev.record()
        profile.append((name, ev))


class BackwardPlan(NamedTuple):
    """The launches of one backward problem: the preprocess, the main kernel, then the deterministic dQ pass or the
    dQ conversion (last; None where the tc kernel converts dQ itself: fuse_dq_rule); rows, the length of D_i and of
    L_i over every (batch, head) (Nq padded to Nq_pad each); acc, the elements of the fp32 dQ accumulator; done,
    the tc kernel's block counters (one per grid row of heads, 0 without fused conversion); tc, whether the main
    kernel is version tc's, which takes dQ and the counters after dK, dV; odtype, deterministic: the gradients'
    dtype and the mode. outs: dq, dk, dv carved from one allocation (fast_path.out_layout), or None.
    plan(q, k, v, o, lse, do) runs a plain backward (no variants) and returns (dq, dk, dv)."""
    pre: kernels.Launch
    main: kernels.Launch
    last: kernels.Launch | None
    rows: int
    acc: int
    done: int
    tc: bool
    odtype: np.dtype = None
    deterministic: bool = False
    outs: tuple | None = None

    def __call__(self, q, k, v, o, lse, do):
        return _launch(self, q, k, v, o, lse, do, self.odtype, self.deterministic, ())

    def with_joint_outputs(self, q, k, *arrays):
        """This plan with dq, dk, dv from one allocation (one trip to the memory pool; a training step uses all
        three together)."""
        B, H, Nq, D = q.shape
        Nk = k.shape[2]
        return self._replace(outs=fast_path.out_layout([((B, H, Nq, D), self.odtype), ((B, H, Nk, D), self.odtype),
                                                         ((B, H, Nk, D), self.odtype)]))


@functools.lru_cache(maxsize=fast_path.MAX_PLANS)  # once per problem: the choices below depend on nothing else
def _plan(version, dtype, odtype, B, H, Nq, Nk, D, causal, scale, deterministic, tc_config, dev, opts=None,
          varlen=None, ld=None):
    """The device check, tiles, compiled kernels, grids and scalar arguments of one problem on dev. tc_config:
    sorted (key, value) pairs of backward's tc_config. opts: the variants (variants.Options, slopes given per call)
    or None.
    varlen: (number of sequences, longest key sequence) of a packed batch (B = 1, Nq and Nk the totals), or None.
    ld: (ldq, ldk) for a ring block of larger arrays (accumulate_into: version tc, float32 gradients added to the
    ring's accumulators, no dQ accumulator or conversion of its own), or None: a whole problem."""
    BH = B * H
    if version != "tc" and BH > 65535:  # the grid's y axis runs over (batch, head)
        raise ValueError(f"flash_v2_backward version {version!r}: batch * heads = {BH} is over the grid limit 65535; "
                         "split the batch into several calls")
    ctype = _CTYPE[dtype]
    device.require(dev, ("bf16",) if dtype == bfloat16 else (),  # tc: fp16 from sm_75 (stage 02's tc.py), bf16 sm_80
                   what=f"flash_v2_backward version {version!r} ({dtype})",
                   instead="On this GPU use float16 inputs (version 'tc'), or float32 (version 'fp32')")
    i32, f32 = np.int32, np.float32
    Nq_pad = -(-Nq // PAD) * PAD  # D_i, L_i (times log2 e for the exp2 kernel) padded to Nq_pad rows
    pre_mod = load_module("flash_v2_backward_pre.cu", name_expressions=PRE_NAMES)
    tc_config = dict(tc_config)
    br, bc, wq = tc_config.get("br"), tc_config.get("bc"), tc_config.get("wq")
    if version == "tc" and br is None and bc is None:
        tiles = tc_tiles(D, dev)
        br, bc = tiles.br, tiles.bc
        wq = tiles.wq if wq is None else wq
    wq = 1 if wq is None else wq
    if version == "tc" and tc_config:
        why = tiles_error(D, br or TC_BR[D], bc or TC_BC[D], wq)
        if why:
            raise ValueError(f"flash_v2_backward: tc_config={tc_config!r} at head_dim {D}: {why}")
    var = opts is not None
    x3 = None  # version fp32x3's Fp32x3Tiles
    if version == "fp32x3":
        device.require(dev, device.TF32_FEATURES, what="flash_v2_backward version 'fp32x3' (TF32 tensor cores)",
                       instead="On this GPU use version 'fp32' (CUDA cores)")
        x3 = fp32x3_tiles(D, dev)
        names = [fp32x3_name(D, x3)]
    else:
        names = _names(version, ctype, D, defer=tc_config.get("defer_dq"), otype=_CTYPE[odtype], br=br, bc=bc, wq=wq,
                       var=var, drop=var and opts.dropout_p > 0)
    main_file, dq_file = FILES[version]  # tc's dQ pass is a file of its own, compiled only for deterministic mode
    mod = load_module(main_file, name_expressions=names if dq_file == main_file else names[:2])
    smem_main, smem_dq = smem_bytes(version, D, br, bc, wq) if x3 is None else (fp32x3_smem(D, x3), 0)
    for what, need in (("", smem_main), (" with deterministic=True (its dQ pass)", smem_dq if deterministic else 0)):
        if not device.fits(dev, need):
            raise device.UnsupportedDevice(
                f"flash_v2_backward version {version!r} d={D}{what} needs {need // 1024} KB of shared memory per "
                f"block; {dev.name} ({dev.arch.name}) allows {dev.smem_optin // 1024} KB"
                + ("; use deterministic=False" if what else "; use head_dim 64 or less, or stage 00"))
    fn = kernels.function(mod, names[0] if not deterministic else names[1], smem_main)
    # whether the tc kernel converts dQ itself (a packed batch: by its total rows, a bound on its longest sequence)
    fuse = tc_config.get("fuse_dq")
    fuse = version == "tc" and not deterministic and (fuse_dq_rule(Nq, D) if fuse is None else bool(fuse))
    fuse = fuse and ld is None  # a ring block leaves dQ in the ring's accumulator
    ldq, ldk = ld or (Nq, Nk)
    args = (i32(Nq), i32(Nk), i32(Nq_pad), f32(scale), i32(causal))
    if version == "fp32":
        main = kernels.Launch(fn, (-(-Nk // 32), BH), (256,), smem_main, args)
    elif x3 is not None:  # one block per (K/V tile j, head)
        main = kernels.Launch(fn, (-(-Nk // x3.bc), BH), (x3.threads,), smem_main, args)
    else:
        # varlen: the grid runs over (sequence, head) x the K/V tiles of the longest sequence (at least one: a
        # sequence without keys still has its dQ = 0 written, by its j = 0 block)
        bc = bc or TC_BC[D]
        blocks, Tc = (BH, -(-Nk // bc)) if varlen is None else (varlen[0] * H, max(1, -(-varlen[1] // bc)))
        j_fast = tc_config.get("j_fast")
        if j_fast is None:
            j_fast = j_fast_order(causal, Nk if varlen is None else varlen[1])
        j_fast = bool(j_fast) and blocks <= 65535  # gridDim.y <= 65535
        left, right = (opts.left, opts.right) if opts is not None else (-1, -1)
        group = opts.group if opts is not None else 1  # grouped-query: query head h reads kv head h // group
        parts = TC_PARTS[D]  # grid.z: the head dim's column parts
        # Every call passes dQ and the counters (null where the kernel leaves dQ in dQ_accum). Without variants the
        # pointers after them are the same on every call and go with the scalars, written once: null ALiBi slopes
        # and cu_q, cu_k. The variants' kernel gets those per call (_var_tail).
        fixed = () if var else (NULL, NULL, NULL)
        main = kernels.Launch(fn, (Tc, blocks, parts) if j_fast else (blocks, Tc, parts), (2 * bc,), smem_main,
                              fixed + (i32(Nq), i32(Nk), i32(ldq), i32(ldk), i32(Nq_pad), f32(scale), i32(causal),
                                       i32(j_fast), i32(left), i32(right), f32(opts.softcap if var else 0.0),
                                              i32(H), i32(group)) + variants.origin_scalars(opts, Nq, Nk)
                              + variants.dropout_scalars(opts))
    done = 0  # the tc kernel's counters, one per row of heads of its grid: the last block of a head converts dQ
    if deterministic:  # the separate dQ pass, no atomics
        dq_mod = mod if dq_file == main_file else load_module(dq_file, name_expressions=names[2:])
        fn = kernels.function(dq_mod, names[2], smem_dq)
        grid, block = ((-(-Nq // 32), BH), (256,)) if version == "fp32" else ((BH, -(-Nq // 64)), (128,))
        last = kernels.Launch(fn, grid, block, smem_dq, args)
    elif ld is not None:  # a ring block: dQ stays in the ring's accumulator
        last = None
    elif not fuse:  # dQ = dQ_accum cast to the output dtype (fp32: scale dQ_accum), tc on long heads and fp32
        n = BH * Nq * D  # a multiple of 4: the kernel converts 4 values per step
        last = kernels.Launch(pre_mod.get_function(f"bwd_convert_dq<{_CTYPE[odtype]}>"),
                              (min(-(-n // 1024), 65535),), (256,), 0,
                              (f32(1.0 if version == "tc" else scale), np.int64(n)))
    else:
        last, done = None, blocks
    # the preprocess also zeroes the fp32 dQ accumulator the atomics add to, and the counters (deterministic mode
    # has neither)
    own_acc = not deterministic and ld is None  # a dQ accumulator of its own, zeroed by the preprocess
    pre = kernels.Launch(pre_mod.get_function(f"bwd_preprocess<{ctype}>"), (Nq_pad * D // 2048, BH), (256,), 0,
                         (i32(Nq), i32(ldq), i32(Nq_pad), i32(D), f32(1.0), i32(own_acc), i32(done)))
    return BackwardPlan(pre, main, last, BH * Nq_pad, BH * Nq * D if own_acc else 1, done, version == "tc", odtype,
                        deterministic)


def plan_backward(q, k, causal, scale, version, deterministic, odtype, tc_config=None, opts=None, varlen=None):
    """The BackwardPlan of one problem on the current device. opts: the variants or None; varlen:
    backward_varlen's (cu_q, cu_k, max_seqlen_k) or None."""
    B, H, Nq, D = q.shape
    plan_opts = None if opts is None else opts._replace(alibi_slopes=opts.alibi_slopes is not None, seed=0)
    vl = None if varlen is None else (varlen[0].size - 1, int(varlen[2]))  # (sequences, longest key sequence)
    return _plan(version, q.dtype, odtype, B, H, Nq, k.shape[2], D, bool(causal), scale, deterministic,
                 tuple(sorted((tc_config or {}).items())), device.device(), plan_opts, vl)


def _var_tail(slopes=None, cu=None):
    """The variants' tc kernel's arguments after dQ and the counters: the ALiBi slopes (B, H) and a packed batch's
    cu_q, cu_k, each a null pointer when absent."""
    return (NULL if slopes is None else slopes,) + ((NULL, NULL) if cu is None else tuple(cu))


def _gpu_backward(q, k, v, o, lse, do, causal, scale, version, deterministic, odtype, tc_config, profile,
                  opts=None, varlen=None):
    """One backward with variants, tuning options or a packed batch, on CuPy arrays (checked by backward or
    backward_varlen). varlen: (cu_q, cu_k, max_seqlen_k), int32 device arrays of a packed batch laid out head by
    head ((1, H, total, D)), or None."""
    import cupy

    plan = plan_backward(q, k, causal, scale, version, deterministic, odtype, tc_config, opts, varlen)
    slopes = None
    if opts is not None and opts.alibi_slopes is not None:
        slopes = cupy.ascontiguousarray(cupy.broadcast_to(cupy.asarray(opts.alibi_slopes, dtype=cupy.float32),
                                                          q.shape[:2]))
    tail = () if opts is None else _var_tail(slopes, None if varlen is None else varlen[:2])
    return _launch(plan, q, k, v, o, lse, do, odtype, deterministic, tail, opts, profile)


def _launch(plan, q, k, v, o, lse, do, odtype, deterministic, tail, opts=None, profile=None):
    """The allocations and launches of one backward: the preprocess (D_i, L_i; the dQ accumulator and the block
    counters zeroed), the main kernel (dK_j, dV_j; dQ_i added atomically, and in version tc on short heads
    converted to dQ by each head's last block), then the deterministic dQ pass or the dQ conversion."""
    import cupy

    asc = kernels.row_major  # (B, H, N, D) row-major: a copy only for another layout
    q, k, v, o, do, lse = asc(q), asc(k), asc(v), asc(o), asc(do), asc(lse, dtype=_F32)
    # The scratch, one float32 buffer from CuPy's memory pool: D_i = rowsum(dO_i * O_i) and L_i, (B H, Nq_pad)
    # each, the fp32 dQ accumulator (1 element in deterministic mode), then the tc kernel's block counters; the
    # kernels get device addresses. The pool is stream-ordered: once scratch is released, its memory goes to later
    # work on this stream, which runs after these launches.
    scratch = cupy.cuda.alloc(4 * (2 * plan.rows + plan.acc + plan.done))
    Dvec = scratch.ptr
    Lvec = Dvec + 4 * plan.rows
    dq_acc = Lvec + 4 * plan.rows
    done = dq_acc + 4 * plan.acc
    _mark(profile, "start")
    plan.pre(o, do, lse, Dvec, Lvec, dq_acc, done)
    _mark(profile, "preprocess+zero")
    if opts is not None:  # the variants' dK, dV: float, k's shape; each kv group's query heads add into them
        dq, dk, dv = empty(cupy, q.shape, odtype), cupy.zeros(k.shape, _F32), cupy.zeros(k.shape, _F32)
    else:
        if plan.outs is not None:  # kept by fast_path: one allocation
            dq, dk, dv = fast_path.empties(*plan.outs)
        else:
            dq, dk, dv = (empty(cupy, x.shape, odtype) for x in (q, k, v))
        if plan.tc and odtype == _F32 and not deterministic:  # version tc adds float dK, dV into what they hold
            dk.fill(0)
            dv.fill(0)
    main = plan.main
    if opts is not None and opts.dropout_p:  # the plan is made for seed 0: this call's seed in its last two scalars
        main = main.with_scalars(main.scalars[:-2] + variants.seed_scalars(opts.seed))
    # version tc's dQ and counters: the kernel's own when it converts dQ (no last launch), null when it leaves dQ
    # in dQ_accum (for the conversion launch) or never adds to it (deterministic mode); fp32's kernel has neither
    dq_args = () if not plan.tc else (dq, done) if plan.last is None else (NULL, NULL)
    main(q, k, v, do, Lvec, Dvec, dq_acc, dk, dv, *dq_args, *tail)
    if plan.last is not None:
        _mark(profile, "main")
        if deterministic:
            plan.last(q, k, v, do, Lvec, Dvec, dq)
        else:
            plan.last(dq_acc, dq)
    _mark(profile, "main+dq" if plan.last is None else "dq pass" if deterministic else "convert")
    if opts is not None:
        dk, dv = (x.astype(odtype) if odtype != bfloat16 else cast(x, odtype) for x in (dk, dv))
    return dq, dk, dv


def accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, *, causal, scale, opts=None):
    """One block of the ring backward (stage 04), added in place: the gradients of rows a:b of q, o, lse, do
    (B, H, Lq, ...) against keys c:m of k, v (B, Hkv, Lk, D), added by version tc into the ring's float32
    accumulators: dQ into rows a:b of dq_run (B, H, Lq, D) (atomically, as every K/V tile adds to dQ_i), dK, dV into
    keys c:m of dk_run, dv_run (B, Hkv, Lk, D) (red.add in the epilogue). No row is copied: the kernels start at row a
    and key c and step over whole heads by Lq and Lk rows. Two launches: the preprocess (D_i, L_i of rows a:b, in a
    scratch buffer) and the main kernel. CuPy arrays, checked by the caller (the ring's prologue); opts:
    variants.Options or None."""
    import cupy

    (a, b), (c, m) = rows, keys
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    var = opts is not None
    plan_opts = None if not var else opts._replace(alibi_slopes=opts.alibi_slopes is not None, seed=0)
    plan = _plan("tc", q.dtype, _F32, B, H, b - a, m - c, D, bool(causal), scale, False, (), device.device(), plan_opts,
                 None, (Lq, Lk))
    scratch = cupy.cuda.alloc(4 * 2 * plan.rows)  # D_i and L_i of rows a:b, (B H, Nq_pad) each
    Dvec, Lvec = scratch.ptr, scratch.ptr + 4 * plan.rows
    at_q, at_k = a * D * q.itemsize, c * D * k.itemsize  # byte offsets of row a, key c in every head
    q_a, o_a, do_a = (x.data.ptr + at_q for x in (q, o, do))
    plan.pre(o_a, do_a, lse.data.ptr + 4 * a, Dvec, Lvec, NULL, NULL)
    main = plan.main
    tail = ()
    if var:
        if opts.dropout_p:  # the plan is made for seed 0: this call's seed in its last two scalars
            main = main.with_scalars(main.scalars[:-2] + variants.seed_scalars(opts.seed))
        slopes = None
        if opts.alibi_slopes is not None:
            slopes = cupy.ascontiguousarray(cupy.broadcast_to(cupy.asarray(opts.alibi_slopes, dtype=cupy.float32),
                                                              (B, H)))
        tail = _var_tail(slopes)
    kv = 4 * c * D  # byte offset of key c in every head of the float32 accumulators
    main(q_a, k.data.ptr + at_k, v.data.ptr + at_k, do_a, Lvec, Dvec, dq_run.data.ptr + 4 * a * D,
         dk_run.data.ptr + kv, dv_run.data.ptr + kv, NULL, NULL, *tail)


_F32 = np.dtype(np.float32)
NULL = np.uint64(0)  # a null pointer argument (no ALiBi slopes)


def backward_flops(B, H, Nq, Nk, D, causal):
    """The papers' convention: 2.5x the forward's 4 B H Nq Nk D (halved when causal)."""
    return 2.5 * 4.0 * B * H * Nq * Nk * D * (0.5 if causal else 1.0)


def kernel_plans(dev):
    """[device.KernelPlan] of every kernel this stage may launch on dev (the tc kernels at dev's (Br, Bc); the
    deterministic dQ pass and the fp32 kernels where their shared memory fits)."""
    out = [device.KernelPlan("flash_v2_backward_pre.cu", {}, n, 0, 0, 256) for n in PRE_NAMES]
    for D in HEAD_DIMS["fp32"]:
        main, dq = smem_bytes("fp32", D)
        names = _names("fp32", "float", D)
        out += [device.KernelPlan("flash_v2_backward_fp32.cu", {}, n, sm, 0, 256)
                for n, sm in zip(names, (main, main, dq)) if device.fits(dev, sm)]
    if device.tf32_tensor_cores(dev):  # version fp32x3
        for D in HEAD_DIMS["fp32x3"]:
            cfg = fp32x3_tiles(D, dev)
            out.append(device.KernelPlan(FILES["fp32x3"][0], {}, fp32x3_name(D, cfg), fp32x3_smem(D, cfg), 0,
                                         cfg.threads))
    for D in HEAD_DIMS["tc"]:
        if not reachable_tc(D, dev):
            continue
        br, bc, wq = tc_tiles(D, dev)
        main, dq = smem_bytes("tc", D, br, bc, wq)
        for ctype in ("__half", "__nv_bfloat16") if dev.arch.bf16 else ("__half",):
            for otype in (ctype, "float"):
                names = _names("tc", ctype, D, otype=otype, br=br, bc=bc, wq=wq)
                files = (FILES["tc"][0], FILES["tc"][0], FILES["tc"][1])  # the main kernels', the dQ pass's
                out += [device.KernelPlan(f, {}, n, sm, 0, th) for f, n, sm, th in
                        zip(files, names, (main, main, dq), (2 * bc, 2 * bc, 128)) if device.fits(dev, sm)]
            if device.fits(dev, main):  # the variants' atomic main kernels (float dK, dV), without and with dropout
                var_names = [_names("tc", ctype, D, br=br, bc=bc, wq=wq, var=True, drop=drop)[0] for drop in (0, 1)]
                out += [device.KernelPlan("flash_v2_backward_tc.cu", {}, n, main, 0, 2 * bc) for n in var_names]
    return out


def kernel_sources():
    """(file, name expressions) of every kernel this stage may launch on any architecture (both orders of the
    atomic dQ for the first configurations, so the sweep's alternative compiles too)."""
    plans = {p for a in device.ARCHS for p in kernel_plans(device.emulate(a))}
    out = {}
    for p in sorted(plans, key=lambda p: (p.file, p.name)):
        out.setdefault(p.file, []).append(p.name)
    for D in HEAD_DIMS["tc"]:
        for ctype in ("__half", "__nv_bfloat16"):
            out["flash_v2_backward_tc.cu"].append(_names("tc", ctype, D, defer=False)[0])
    return list(out.items())
