"""Stage 02 launcher: FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1), four versions.

    o, lse = forward(q, k, v, causal=False, scale=None, version="auto")   # numpy -> mirror.py, CuPy -> kernel

Versions (all runnable, each checked against the one before it):
    fp32       float32, CUDA cores: kernels/flash_v2_forward_fp32.cu, any head_dim 1..128
    tc         float16 / bfloat16, mma.sync tensor cores: kernels/flash_v2_forward_tc.cu (tc.py launches it)
    pipelined  float16 / bfloat16, cp.async double buffering, tuned tiles: kernels/flash_v2_forward_pipelined.cu
    fp32x3     float32, mma.sync TF32 tensor cores with the 3xTF32 split (fp32-level accuracy):
               kernels/flash_v2_forward_fp32x3.cu (fp32x3.py launches it), head dims 32, 64, 96, 128
    auto       fp32 for float32 inputs, pipelined for float16 / bfloat16
numpy inputs run the tile mirror (mirror.py) with the chosen version's tiles and rounding (fp32x3: the TF32
split emulated); CuPy inputs run the kernel. Any Nq and Nk, causal aligned bottom-right, lse float32 (B, H, Nq)
in natural log.

Stage 02 is the FORWARD pass only; the FlashAttention-2 backward is stage 03. `backward` is here only so
that every stage has the same API: it hands over to stage 03.
"""
import numpy as np

from stages.common import (
    bfloat16, check_attention_inputs, check_causal, check_out_dtype, empty, load_module, resolve_scale,
)

from . import mirror

VERSIONS = ("fp32", "tc", "pipelined", "fp32x3")
DTYPES = {"fp32": (np.dtype(np.float32),), "tc": (np.dtype(np.float16), bfloat16),
          "pipelined": (np.dtype(np.float16), bfloat16), "fp32x3": (np.dtype(np.float32),)}
FP32_VERSIONS = ("fp32", "fp32x3")  # the versions that take float32
FP32_MAX_HEAD_DIM = 128  # a lane keeps head_dim/8 columns of 4 or 8 rows of O_i in registers
FP32_BC = 64  # Bc of the fp32 kernel: 8 column groups x 8 keys per lane (fixed by its thread layout)
LOG2E = mirror.LOG2E


def _tc():
    from . import tc  # the tensor-core launcher (imported when a tensor-core version is asked for)

    return tc


def _fp32x3():
    from . import fp32x3  # the 3xTF32 launcher

    return fp32x3


def fp32_config(D):
    """(TM, NWARPS) of the fp32 kernel: TM rows of Q_i per lane, Br = NWARPS * 4 * TM = 128 rows of Q_i.
    d <= 64: TM = 8 with 4 warps (each lane's TM x 8 block of S_ij reuses every value it reads 8 times);
    d > 64: TM = 4 with 8 warps (O_i's TM x d/8 block per lane grows with d, and TM = 8 would not fit in the
    registers). `python scripts/sweep_flash_v2.py` times the alternatives."""
    return (8, 4) if D <= 64 else (4, 8)


def fp32_smem_bytes(D, config=None):
    """Shared memory of the fp32 kernel: Q_i^T, K_j^T, V_j (head dim padded to 32) and P~_ij^T (rows + 4)."""
    tm, nwarps = tuple(config or fp32_config(D))[:2]
    br, dp = nwarps * 4 * tm, -(-D // 32) * 32
    return 4 * (dp * br + 2 * dp * FP32_BC + FP32_BC * (br + 4))


def tiles(version, D, causal=False):
    """(Br, Bc) of a version at head dim D: the kernel's tiles, which the mirror uses too."""
    if version == "fp32":
        tm, nwarps = fp32_config(D)
        return nwarps * 4 * tm, FP32_BC
    if version == "fp32x3":
        return _fp32x3().tiles(D, causal)
    return _tc().tiles(version, D, causal)


def head_dims(version):
    """The head dims a version supports."""
    if version == "fp32":
        return tuple(range(1, FP32_MAX_HEAD_DIM + 1))
    return tuple(_fp32x3().HEAD_DIMS) if version == "fp32x3" else tuple(_tc().HEAD_DIMS[version])


def resolve_version(version, dtype):
    """The version to run for this dtype ("auto": fp32 for float32, pipelined for 16-bit), or a clear error."""
    dtype = np.dtype(dtype)
    if version == "auto":
        version = "fp32" if dtype == np.float32 else "pipelined"
    if version not in VERSIONS:
        raise ValueError(f"flash_v2.forward: unknown version {version!r}; choose one of {VERSIONS} or 'auto'")
    if dtype not in DTYPES[version]:
        fix = ("use version='tc' or 'pipelined' for float16/bfloat16" if version in FP32_VERSIONS else
               "use version='fp32' or 'fp32x3' for float32, or cast the inputs to float16/bfloat16")
        raise TypeError(f"flash_v2.forward: version {version!r} takes "
                        f"{'/'.join(d.name for d in DTYPES[version])}, got {dtype}; {fix}")
    return version


def _check_head_dim(version, D):
    if version == "fp32":
        if D > FP32_MAX_HEAD_DIM:
            raise ValueError(f"flash_v2.forward: head_dim {D} is not supported by the fp32 kernel: it takes any "
                             f"head_dim from 1 to {FP32_MAX_HEAD_DIM}")
        return
    if version == "fp32x3":
        dims = _fp32x3().HEAD_DIMS
        if D not in dims:
            raise ValueError(f"flash_v2.forward: head_dim {D} is not supported by the fp32x3 kernel: use "
                             f"{', '.join(map(str, dims))}, or version='fp32' (any head_dim 1 to {FP32_MAX_HEAD_DIM})")
        return
    dims = _tc().HEAD_DIMS[version]
    if D not in dims:
        raise ValueError(f"flash_v2.forward: head_dim {D} is not supported by the tensor-core kernel "
                         f"(version {version!r}): use {', '.join(map(str, dims))}, or version='fp32' with float32")


def forward(q, k, v, *, causal=False, scale=None, version="auto", out_dtype=None, config=None):
    """FlashAttention-2 forward. Returns o (B, H, Nq, D) and lse (B, H, Nq) float32.

    o is in the inputs' dtype, or in float32 with out_dtype=np.float32: O_i = diag(l_i)^-1 O_i straight from
    the float32 accumulators, not rounded to 16 bits (the ring merges such partial results).
    config: the fp32 CUDA kernel only, (TM, NWARPS[, ASYNC_V[, PREFETCH_K]]) instead of fp32_config(D)
    (scripts/sweep_flash_v2.py times several); None: the default."""
    all_dtypes = sorted({d for ds in DTYPES.values() for d in ds}, key=str)
    xp, B, H, Nq, Nk, D = check_attention_inputs(q, k, v, dtypes=all_dtypes, where="flash_v2.forward")
    causal = check_causal(causal, "flash_v2.forward")
    out_dtype = check_out_dtype(out_dtype, q.dtype, "flash_v2.forward")
    version = resolve_version(version, q.dtype)
    _check_head_dim(version, D)
    scale = resolve_scale(scale, D)
    if config is not None and (version != "fp32" or xp is np):
        raise ValueError(f"flash_v2.forward: config= sets the fp32 CUDA kernel's tiles (version 'fp32' on CuPy "
                         f"arrays); got version {version!r} on {xp.__name__} arrays")
    if xp is np:
        br, bc = tiles(version, D, causal)
        return mirror.forward(q, k, v, causal=causal, scale=scale, br=br, bc=bc, tf32x3=version == "fp32x3",
                              out_dtype=out_dtype)
    if version == "fp32x3":
        return _fp32x3().forward(q, k, v, causal=causal, scale=scale)
    if version != "fp32":
        return _tc().forward(q, k, v, causal=causal, scale=scale, version=version, out_dtype=out_dtype)
    return _fp32_forward(q, k, v, causal=causal, scale=scale, config=config)


def _fp32_kernel(D, config=None):
    """The compiled fp32 kernel for head dim D (one NVRTC module per configuration, cached) and its smem.
    config: (TM, NWARPS[, ASYNC_V[, PREFETCH_K]]); the kernel's defaults: ASYNC_V (V_j by cp.async) when
    HEAD_DIM % 4 == 0, PREFETCH_K (K_{j+1} fetched into registers during P~_ij V_j) on."""
    config = tuple(config or fp32_config(D))
    tm, nwarps = config[:2]
    defines = {"HEAD_DIM": D, "TM": tm, "NWARPS": nwarps}
    defines.update({name: int(x) for name, x in zip(("ASYNC_V", "PREFETCH_K"), config[2:])})
    mod = load_module("flash_v2_forward_fp32.cu", defines=defines)
    kern = mod.get_function("flash_v2_forward_fp32")
    smem = fp32_smem_bytes(D, (tm, nwarps))
    if smem > 48 * 1024:  # above 48 KB a block must opt in to more dynamic shared memory
        kern.max_dynamic_shared_size_bytes = smem
    return kern, smem


def _fp32_forward(q, k, v, *, causal, scale, config=None):
    """Launch kernels/flash_v2_forward_fp32.cu on CuPy float32 arrays (already checked).
    config: (TM, NWARPS[, ASYNC_V[, PREFETCH_K]]) to override fp32_config (scripts/sweep_flash_v2.py)."""
    import cupy

    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    config = tuple(config or fp32_config(D))
    tm, nwarps = config[:2]
    q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))  # (B, H, N, D) row-major
    o = empty(cupy, (B, H, Nq, D), np.float32)  # (B, H, Nq, D), NaN-poisoned under the tests
    lse = empty(cupy, (B, H, Nq), np.float32)  # (B, H, Nq)
    kern, smem = _fp32_kernel(D, config)
    br = nwarps * 4 * tm
    kern((-(-Nq // br), B * H), (32 * nwarps,),  # grid (Tr, B*H): one block per (Q tile i, head)
         (q, k, v, o, lse, np.int32(Nq), np.int32(Nk), np.float32(scale * LOG2E), np.int32(causal)),
         shared_mem=smem)
    return o, lse


def kernel_sources():
    """(file, defines, name expressions) of every kernel stage 02 launches, for the NVRTC compile tests:
    the fp32 kernel at a spread of head dims (each config it uses, odd dims, and non-multiples of 4), and
    every tensor-core template instantiation tc.py and fp32x3.py launch."""
    out = [("flash_v2_forward_fp32.cu", {"HEAD_DIM": D, "TM": tm, "NWARPS": nw}, ())
           for D in (1, 7, 16, 32, 64, 80, 100, 128) for tm, nw in [fp32_config(D)]]
    out += [("flash_v2_forward_fp32.cu", {"HEAD_DIM": D, "TM": tm, "NWARPS": nw, "PREFETCH_K": 0, "ASYNC_V": 0}, ())
            for D in (64, 128) for tm, nw in [fp32_config(D)]]  # simpler variants (scripts/sweep_flash_v2.py)
    out += [(f, {}, tuple(names)) for f, names in _tc().kernel_sources()]
    out += [(f, {}, tuple(names)) for f, names in _fp32x3().kernel_sources()]
    return out


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version="auto"):
    """Not part of stage 02 (forward only): the FlashAttention-2 backward lives in stage 03."""
    try:
        from stages import flash_v2_backward
    except ImportError as e:
        raise NotImplementedError("stage 02 is the forward pass only; the backward is stage 03 "
                                  f"(stages/03_flash_v2_backward), which does not import here: {e}") from e
    return flash_v2_backward.backward(q, k, v, o, lse, do, causal=causal, scale=scale, version=version)
