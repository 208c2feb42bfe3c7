"""Stage 02: FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1), five versions. The public functions: they
check the inputs and hand them to the version's launcher (fp32.py, tc.py, fp32x3.py) or, for numpy inputs, to the
tile mirror (mirror.py).

    o, lse = forward(q, k, v, causal=False, scale=None, version="auto")   # numpy -> mirror.py, CuPy -> kernel
    o, lse = forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)          # packed sequences of different lengths

Versions (all runnable, each checked against the one before it):
    fp32          float32, CUDA cores, the paper's loop: kernels/flash_v2_forward_fp32.cu, any head_dim 1..128
    fp32_overlap  fp32 with its loads overlapping its math (K_{j+1} prefetched, V_j by cp.async):
                  kernels/flash_v2_forward_fp32_overlap.cu, any head_dim 1..128
    tc            float16 / bfloat16, mma.sync tensor cores: kernels/flash_v2_forward_tc.cu
    pipelined     float16 / bfloat16, cp.async double buffering, tuned tiles: kernels/flash_v2_forward_pipelined.cu
    fp32x3        float32, mma.sync TF32 tensor cores with the 3xTF32 split (fp32-level accuracy):
                  kernels/flash_v2_forward_fp32x3.cu, head dims 32, 64, 96, 128
    auto          pipelined for float16 / bfloat16; for float32 fp32x3 on a GPU with TF32 tensor cores (sm_80 on;
                  plain attention at its head dims), else fp32_overlap, or fp32 where its tiles do not fit the GPU
numpy inputs run the tile mirror (mirror.py) with the chosen version's tiles and rounding (fp32x3: the TF32
split emulated); CuPy inputs run the kernel. Any Nq and Nk, causal aligned bottom-right, lse float32 (B, H, Nq)
in natural log.

Stage 02 is the FORWARD pass only; the FlashAttention-2 backward is stage 03 (stages/03_flash_v2_backward).
`forward` is wrapped by the speed layer (stages/common/fast_path.py), which replays a repeated call's launch; a
reader may skip it (forward.__wrapped__ is the same function without it).
"""
import numpy as np

from stages.common import (
    bfloat16, check_attention_inputs, check_causal, check_out_dtype, device, fast_path, resolve_scale, variants,
    varlen,
)
from stages.common.launch import row_major

from . import fp32, fp32x3, mirror, tc

VERSIONS = ("fp32", "fp32_overlap", "tc", "pipelined", "fp32x3")
F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
DTYPES = {"fp32": (F32,), "fp32_overlap": (F32,), "tc": (F16, bfloat16), "pipelined": (F16, bfloat16),
          "fp32x3": (F32,)}
ALL_DTYPES = (F32, F16, bfloat16)  # what some version takes
FP32_VERSIONS = ("fp32", "fp32_overlap", "fp32x3")  # the versions that take float32
VARIANT_VERSIONS = tc.VARIANT_VERSIONS  # the kernels that take the variant options (every version's mirror does)


def tiles(version, D, causal=False):
    """(Br, Bc) of a version at head dim D: the kernel's tiles, which the mirror uses too."""
    if version in fp32.VERSIONS:
        return fp32.config(version, D).br, fp32.BC
    if version == "fp32x3":
        return fp32x3.tiles(D, causal)
    return tc.tiles(version, D, causal)


def head_dims(version):
    """The head dims a version supports."""
    if version in fp32.VERSIONS:
        return tuple(range(1, fp32.MAX_HEAD_DIM + 1))
    return tuple(fp32x3.HEAD_DIMS) if version == "fp32x3" else tuple(tc.HEAD_DIMS[version])


def resolve_version(version, dtype):
    """The version a name asks for with this dtype, or a clear error. "auto": pipelined for 16-bit, fp32_overlap for
    float32 (forward then takes fp32x3 where it runs, and fp32 where fp32_overlap's tiles do not fit the GPU)."""
    dtype = np.dtype(dtype)
    if version == "auto":
        version = "fp32_overlap" if dtype == np.float32 else "pipelined"
    if version not in VERSIONS:
        raise ValueError(f"flash_v2.forward: unknown version {version!r}; choose one of {VERSIONS} or 'auto'")
    if dtype not in DTYPES[version]:
        fix = ("use version='tc' or 'pipelined' for float16/bfloat16" if version in FP32_VERSIONS else
               "use version='fp32', 'fp32_overlap' or 'fp32x3' for float32, or cast the inputs to float16/bfloat16")
        raise TypeError(f"flash_v2.forward: version {version!r} takes "
                        f"{'/'.join(d.name for d in DTYPES[version])}, got {dtype}; {fix}")
    return version


def _auto_fp32(opts, config, D):
    """The float32 version "auto" runs on this GPU: fp32x3 on a GPU with TF32 tensor cores (sm_80 on) for plain
    attention at its head dims with no config asked for, else fp32_overlap, or fp32 (its SHARE_KV tiles) where
    fp32_overlap does not fit the GPU's shared memory."""
    dev = device.device()
    if opts is None and config is None and D in fp32x3.HEAD_DIMS and device.tf32_tensor_cores(dev):
        return "fp32x3"
    return "fp32_overlap" if config is not None or fp32.overlap_fits(D, dev) else "fp32"


def _elsewhere(D):
    """'; version 'pipelined' takes head_dim D with float16/bfloat16' where a tensor-core version takes D, else ''."""
    takers = [v for v in ("tc", "pipelined") if D in tc.HEAD_DIMS[v]]
    return (f"; version {' / '.join(repr(v) for v in takers)} takes head_dim {D} with float16/bfloat16 inputs"
            if takers else "")


def _check_head_dim(version, D):
    if version in fp32.VERSIONS:
        if D > fp32.MAX_HEAD_DIM:
            raise ValueError(f"flash_v2.forward: head_dim {D} is not supported by the {version} kernel: it takes any "
                             f"head_dim from 1 to {fp32.MAX_HEAD_DIM}{_elsewhere(D)}")
        return
    if version == "fp32x3":
        dims = fp32x3.HEAD_DIMS
        if D not in dims:
            raise ValueError(f"flash_v2.forward: head_dim {D} is not supported by the fp32x3 kernel: use "
                             f"{', '.join(map(str, dims))}, or version='fp32' (any head_dim 1 to {fp32.MAX_HEAD_DIM})"
                             f"{_elsewhere(D)}")
        return
    dims = tc.HEAD_DIMS[version]
    if D not in dims:
        raise ValueError(f"flash_v2.forward: head_dim {D} is not supported by the tensor-core kernel "
                         f"(version {version!r}): use {', '.join(map(str, dims))}, or version='fp32' with float32"
                         f"{_elsewhere(D)}")


@fast_path.remembered  # the speed layer: a repeated call replays its kept launch (stages/common/fast_path.py)
def forward(q, k, v, *, causal=False, scale=None, version="auto", out_dtype=None, config=None, window=None,
            alibi_slopes=None, softcap=None, dropout_p=0.0, seed=0, origin=None):
    """FlashAttention-2 forward. Returns o (B, H, Nq, D) and lse (B, H, Nq) float32.

    o is in the inputs' dtype, or in float32 with out_dtype=np.float32: O_i = diag(l_i)^-1 O_i straight from
    the float32 accumulators, not rounded to 16 bits (the ring merges such partial results).
    config: the CUDA-core kernels' tiles instead of the device's choice (dev/sweep_flash_v2.py times several): for
    version fp32 an fp32.Fp32Config or (TM, NWARPS[, SHARE_KV]), for fp32_overlap an fp32.OverlapConfig or (TM,
    NWARPS[, ASYNC_V]); None: the device's choice.
    Variants (stages/common/variants.py): k, v with fewer heads (grouped-query), window=(left, right),
    alibi_slopes, softcap, dropout_p with seed, and origin (a block of a larger problem: the ring). The mirrors take
    them all; on the GPU version 'pipelined' takes them all too (dropout draws the same bits as the mirrors: same
    seed, same o, bit for bit)."""
    where = "flash_v2.forward"
    xp, B, H, Nq, Nk, D = check_attention_inputs(q, k, v, dtypes=ALL_DTYPES, where=where, gqa=True)
    causal = check_causal(causal, where)
    opts = None  # plain attention: no option to check
    if (window is not None or alibi_slopes is not None or softcap is not None or dropout_p or k.shape[1] != H
            or origin is not None):
        opts = variants.check(q, k, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                              dropout_p=dropout_p, seed=seed, origin=origin, where=where)
        opts = None if opts.plain else opts
    out_dtype = check_out_dtype(out_dtype, q.dtype, where)
    asked, version = version, resolve_version(version, q.dtype)
    if asked == "auto" and version == "fp32_overlap" and xp is not np:
        version = _auto_fp32(opts, config, D)
    _check_head_dim(version, D)
    scale = resolve_scale(scale, D)
    if config is not None and (version not in fp32.VERSIONS or xp is np):
        raise ValueError(f"{where}: config= sets the CUDA-core kernels' tiles (version 'fp32' or 'fp32_overlap' on "
                         f"CuPy arrays); got version {version!r} on {xp.__name__} arrays")
    if xp is np:  # the CPU mirror, with this version's tiles
        br, bc = tiles(version, D, causal)
        return mirror.forward(q, k, v, causal=causal, scale=scale, br=br, bc=bc, tf32x3=version == "fp32x3",
                              out_dtype=out_dtype, opts=opts)
    if opts is not None:  # the variants: version pipelined's hooks
        if version not in VARIANT_VERSIONS:
            raise ValueError(f"{where}: on the GPU, grouped-query k/v, window, softcap, alibi_slopes and dropout run "
                             f"in version {' / '.join(VARIANT_VERSIONS)} (float16 / bfloat16); every version's CPU "
                             f"mirror (numpy inputs) takes them all. Got version {version!r}")
        variants.check_kernel_origin(opts, where)
        return tc.forward_pipelined(q, k, v, causal=causal, scale=scale, out_dtype=out_dtype, opts=opts)
    if version == "fp32":
        return fp32.forward_fp32(q, k, v, causal=causal, scale=scale, config=config)
    if version == "fp32_overlap":
        return fp32.forward_fp32_overlap(q, k, v, causal=causal, scale=scale, config=config)
    if version == "fp32x3":
        return fp32x3.forward(q, k, v, causal=causal, scale=scale)
    if version == "tc":
        return tc.forward_tc(q, k, v, causal=causal, scale=scale, out_dtype=out_dtype)
    return tc.forward_pipelined(q, k, v, causal=causal, scale=scale, out_dtype=out_dtype)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                   scale=None, version="auto", out_dtype=None, window=None, alibi_slopes=None, softcap=None,
                   dropout_p=0.0, seed=0):
    """Attention over a packed batch of sequences of different lengths, none attending across sequences (the
    definition: stages/common/varlen.py, stage 00's naive.forward_varlen). q (total_q, H, D), k and v (total_k, Hkv,
    D), cu_seqlens_q and cu_seqlens_k (sequences + 1,) integers; returns o (total_q, H, D) and lse (H, total_q).

    numpy: the mirror on each sequence. CuPy: version 'pipelined' once for the whole batch: q, k, v are laid out
    head by head ((H, total, D): each sequence's rows of a head are contiguous), and each block finds its sequence's
    rows from cu_seqlens (one int32 load each), so no padding is computed and one launch covers every length. Takes
    every option of forward."""
    where = "flash_v2.forward_varlen"
    xp = check_attention_inputs(*(varlen.as_batch(varlen.check_packed(x, where, n)) for x, n in
                                  ((q, "q"), (k, "k"), (v, "v"))), dtypes=ALL_DTYPES, where=where, gqa=True)[0]
    opts = dict(causal=causal, scale=scale, version=version, out_dtype=out_dtype, window=window,
                alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed)
    if xp is np:
        return varlen.per_sequence_forward(forward, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                           max_seqlen_k=max_seqlen_k, where=where, **opts)
    import cupy

    cq, ck, cu = varlen.kernel_bounds(q, k, cu_seqlens_q, cu_seqlens_k, where, max_seqlen_q, max_seqlen_k)
    version = resolve_version(version, q.dtype)
    if version not in VARIANT_VERSIONS:
        raise ValueError(f"{where}: on the GPU packed batches run in version {' / '.join(VARIANT_VERSIONS)} "
                         f"(float16 / bfloat16); got version {version!r} ({q.dtype}). The CPU mirror (numpy inputs) "
                         "takes every version")
    qb, kb, vb = (row_major(varlen.as_batch(x)) for x in (q, k, v))  # (1, H, total, D)
    D = q.shape[2]
    _check_head_dim(version, D)
    causal = check_causal(causal, where)
    opts = variants.check(qb, kb, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                          dropout_p=dropout_p, seed=seed, where=where)
    out_dtype = check_out_dtype(out_dtype, q.dtype, where)
    o, lse = tc.forward_pipelined(qb, kb, vb, causal=causal, scale=resolve_scale(scale, D), out_dtype=out_dtype,
                                  opts=opts, varlen=cu + (int(np.diff(cq).max()),))
    return cupy.ascontiguousarray(o[0].swapaxes(0, 1)), lse[0]  # (total_q, H, D), (H, total_q)


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version="auto"):
    """Not in stage 02: stage 02 is the forward pass only, and the FlashAttention-2 backward is stage 03. The name is
    here so that a caller going through every stage's API gets this answer instead of an AttributeError."""
    raise NotImplementedError("flash_v2.backward: stage 02 is the FlashAttention-2 forward only; its backward is "
                              "stage 03: from stages import flash_v2_backward; "
                              "flash_v2_backward.backward(q, k, v, o, lse, do, causal=..., scale=...)")


def kernel_plans(dev):
    """[device.KernelPlan] of every kernel stage 02 may launch on dev (the CUDA-core kernels at fp32.COMPILE_DIMS)."""
    return fp32.kernel_plans(dev) + tc.kernel_plans(dev) + fp32x3.kernel_plans(dev)


def kernel_sources():
    """(file, defines, name expressions) of every kernel stage 02 may launch on any architecture, for the NVRTC
    compile tests."""
    plans = {p for a in device.ARCHS for p in fp32.kernel_plans(device.emulate(a))}
    out = sorted({(p.file, tuple(sorted(p.defines.items()))) for p in plans})
    out = [(f, dict(d), ()) for f, d in out]
    out += [(f, {}, tuple(names)) for f, names in tc.kernel_sources()]
    out += [(f, {}, tuple(names)) for f, names in fp32x3.kernel_sources()]
    return out
