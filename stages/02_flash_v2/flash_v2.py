"""Stage 02 launcher: FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1), four versions.

    o, lse = forward(q, k, v, causal=False, scale=None, version="auto")   # numpy -> mirror.py, CuPy -> kernel
    o, lse = forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)          # packed sequences of different lengths

Versions (all runnable, each checked against the one before it):
    fp32       float32, CUDA cores: kernels/flash_v2_forward_fp32.cu, any head_dim 1..128
    tc         float16 / bfloat16, mma.sync tensor cores: kernels/flash_v2_forward_tc.cu (tc.py launches it)
    pipelined  float16 / bfloat16, cp.async double buffering, tuned tiles: kernels/flash_v2_forward_pipelined.cu
    fp32x3     float32, mma.sync TF32 tensor cores with the 3xTF32 split (fp32-level accuracy):
               kernels/flash_v2_forward_fp32x3.cu (fp32x3.py launches it), head dims 32, 64, 96, 128
    auto       pipelined for float16 / bfloat16; for float32 fp32x3 on a GPU with TF32 tensor cores (sm_80 on; plain
               attention at its head dims), fp32 elsewhere (the CPU mirror, older GPUs, other head dims)
numpy inputs run the tile mirror (mirror.py) with the chosen version's tiles and rounding (fp32x3: the TF32
split emulated); CuPy inputs run the kernel. Any Nq and Nk, causal aligned bottom-right, lse float32 (B, H, Nq)
in natural log.

Stage 02 is the FORWARD pass only; the FlashAttention-2 backward is stage 03. `backward` is here only so
that every stage has the same API: it hands over to stage 03.
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import (
    LOG2E, bfloat16, check_attention_inputs, check_causal, check_out_dtype, device, fast_path, kernels, load_module,
    resolve_scale, variants, varlen,
)

from stages.common.params import FwdParams

from . import fp32x3, mirror, tc  # the launchers of the other versions (tc: both tensor-core versions)

VERSIONS = ("fp32", "tc", "pipelined", "fp32x3")
DTYPES = {"fp32": (np.dtype(np.float32),), "tc": (np.dtype(np.float16), bfloat16),
          "pipelined": (np.dtype(np.float16), bfloat16), "fp32x3": (np.dtype(np.float32),)}
ALL_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), bfloat16)  # what some version takes
FP32_VERSIONS = ("fp32", "fp32x3")  # the versions that take float32
FP32_MAX_HEAD_DIM = 128  # a lane keeps head_dim/8 columns of 4 or 8 rows of O_i in registers
FP32_BC = 64  # Bc of the fp32 kernel: 8 column groups x 8 keys per lane (fixed by its thread layout)


class Fp32Config(NamedTuple):
    """Launch configuration of the fp32 kernel: TM rows of Q_i per lane and NWARPS warps (Br = NWARPS * 4 * TM);
    ASYNC_V: V_j by cp.async while S_ij is computed (sm_80+, head_dim % 4 == 0); PREFETCH_K: K_{j+1} read into
    registers during P~_ij V_j; SHARE_KV: V_j loaded into K_j's buffer after S_ij (one buffer less)."""
    tm: int
    nwarps: int
    async_v: bool = True
    prefetch_k: bool = True
    share_kv: bool = False

    @property
    def br(self):
        return self.nwarps * 4 * self.tm

    @property
    def threads(self):
        return 32 * self.nwarps

    def defines(self, D):
        return {"HEAD_DIM": D, "TM": self.tm, "NWARPS": self.nwarps, "ASYNC_V": int(self.async_v),
                "PREFETCH_K": int(self.prefetch_k), "SHARE_KV": int(self.share_kv)}


def fp32_candidates(D, dev=None):
    """The fp32 kernel's configurations at head dim D, first choice first. d <= 64: TM = 8 with 4 warps (each lane's
    TM x 8 block of S_ij reuses every value it reads 8 times); d > 64: TM = 4 with 8 warps (O_i's TM x d/8 block per
    lane grows with d, and TM = 8 would not fit in the registers). Then smaller Q tiles for GPUs with less shared
    memory (Br = 64, Br = 32) and, last, Br = 32 with V_j in K_j's buffer (a T4 at d > 64). ASYNC_V where the
    architecture has cp.async (dev None: assumed) and rows are 16-byte aligned. `python dev/sweep_flash_v2.py`
    times the alternatives."""
    async_v = D % 4 == 0 and (dev is None or dev.arch.cp_async)
    first = Fp32Config(8, 4, async_v) if D <= 64 else Fp32Config(4, 8, async_v)
    return [first, Fp32Config(4, 4, async_v), Fp32Config(4, 2, async_v), Fp32Config(4, 2, False, False, True)]


def fp32_smem_bytes(D, config=None):
    """Shared memory of the fp32 kernel: Q_i^T, K_j^T, V_j (head dim padded to 32; V_j in K_j's buffer with
    SHARE_KV) and P~_ij^T (rows + 4)."""
    cfg = _fp32_cfg(D, config)
    dp = -(-D // 32) * 32
    return 4 * (dp * cfg.br + (1 if cfg.share_kv else 2) * dp * FP32_BC + FP32_BC * (cfg.br + 4))


def _fp32_cfg(D, config):
    """config as an Fp32Config: None -> the first candidate; a tuple (TM, NWARPS[, ASYNC_V[, PREFETCH_K[,
    SHARE_KV]]]) -> with the kernel's defaults for the missing fields."""
    if config is None:
        return fp32_candidates(D)[0]
    return config if isinstance(config, Fp32Config) else Fp32Config(*config)


def fp32_config(D, dev=None, blocks=None):
    """The fp32 kernel's configuration at head dim D on device dev (None: the first candidate). blocks(cfg): the
    problem's block count; when the choice leaves SMs idle (blocks < SM count), the next smaller Q tile that fits
    is taken (twice the blocks)."""
    cands = fp32_candidates(D, dev)
    if dev is None:
        return cands[0]
    cfg = device.pick(cands, lambda c: fp32_smem_bytes(D, c), dev, what=f"flash_v2 version 'fp32' d={D}")
    n = cands.index(cfg)
    if blocks is not None and blocks(cfg) < dev.sm_count and n + 1 < len(cands) - 1:
        cfg = cands[n + 1]  # never the SHARE_KV fallback: it is for shared memory, not for SM count
    return cfg


def fp32_reachable(D, dev):
    """Every configuration fp32_config can return on dev."""
    cands = fp32_candidates(D, dev)
    first = cands.index(device.pick(cands, lambda c: fp32_smem_bytes(D, c), dev, what=""))
    return cands[first:first + 2] if first + 1 < len(cands) - 1 else cands[first:first + 1]


def tiles(version, D, causal=False):
    """(Br, Bc) of a version at head dim D: the kernel's tiles, which the mirror uses too."""
    if version == "fp32":
        return fp32_config(D).br, FP32_BC
    if version == "fp32x3":
        return fp32x3.tiles(D, causal)
    return tc.tiles(version, D, causal)


def head_dims(version):
    """The head dims a version supports."""
    if version == "fp32":
        return tuple(range(1, FP32_MAX_HEAD_DIM + 1))
    return tuple(fp32x3.HEAD_DIMS) if version == "fp32x3" else tuple(tc.HEAD_DIMS[version])


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


def _fp32x3_runs(xp, opts, config, D):
    """Whether version="auto" runs fp32x3 for float32 (resolve_version's fp32 otherwise): on a GPU with TF32 tensor
    cores (sm_80 on; not the CPU mirror), for plain attention at its head dims, with no fp32 config asked for."""
    return (xp is not np and opts is None and config is None and D in fp32x3.HEAD_DIMS
            and device.tf32_tensor_cores(device.device()))


def _elsewhere(D):
    """'; version 'pipelined' takes head_dim D with float16/bfloat16' where a tensor-core version takes D, else ''."""
    takers = [v for v in ("tc", "pipelined") if D in tc.HEAD_DIMS[v]]
    return (f"; version {' / '.join(repr(v) for v in takers)} takes head_dim {D} with float16/bfloat16 inputs"
            if takers else "")


def _check_head_dim(version, D):
    if version == "fp32":
        if D > FP32_MAX_HEAD_DIM:
            raise ValueError(f"flash_v2.forward: head_dim {D} is not supported by the fp32 kernel: it takes any "
                             f"head_dim from 1 to {FP32_MAX_HEAD_DIM}{_elsewhere(D)}")
        return
    if version == "fp32x3":
        dims = fp32x3.HEAD_DIMS
        if D not in dims:
            raise ValueError(f"flash_v2.forward: head_dim {D} is not supported by the fp32x3 kernel: use "
                             f"{', '.join(map(str, dims))}, or version='fp32' (any head_dim 1 to {FP32_MAX_HEAD_DIM})"
                             f"{_elsewhere(D)}")
        return
    dims = tc.HEAD_DIMS[version]
    if D not in dims:
        raise ValueError(f"flash_v2.forward: head_dim {D} is not supported by the tensor-core kernel "
                         f"(version {version!r}): use {', '.join(map(str, dims))}, or version='fp32' with float32"
                         f"{_elsewhere(D)}")


VARIANT_VERSIONS = tc.VARIANT_VERSIONS  # the kernels that take the variant options (every version's mirror does)


@fast_path.remembered  # a plain GPU call seen before goes straight to its planned launch (stages/common/fast_path.py)
def forward(q, k, v, *, causal=False, scale=None, version="auto", out_dtype=None, config=None, window=None,
            alibi_slopes=None, softcap=None, dropout_p=0.0, seed=0, origin=None):
    """FlashAttention-2 forward. Returns o (B, H, Nq, D) and lse (B, H, Nq) float32.

    o is in the inputs' dtype, or in float32 with out_dtype=np.float32: O_i = diag(l_i)^-1 O_i straight from
    the float32 accumulators, not rounded to 16 bits (the ring merges such partial results).
    config: the fp32 CUDA kernel only, an Fp32Config or (TM, NWARPS[, ASYNC_V[, PREFETCH_K[, SHARE_KV]]]) instead
    of the device's choice (dev/sweep_flash_v2.py times several); None: the device's choice.
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
    if asked == "auto" and version == "fp32" and _fp32x3_runs(xp, opts, config, D):  # fast float32 where it runs
        version = "fp32x3"
    _check_head_dim(version, D)
    scale = resolve_scale(scale, D)
    if config is not None and (version != "fp32" or xp is np):
        raise ValueError(f"flash_v2.forward: config= sets the fp32 CUDA kernel's tiles (version 'fp32' on CuPy "
                         f"arrays); got version {version!r} on {xp.__name__} arrays")
    if xp is np:  # the CPU mirror, with this version's tiles
        br, bc = tiles(version, D, causal)
        return mirror.forward(q, k, v, causal=causal, scale=scale, br=br, bc=bc, tf32x3=version == "fp32x3",
                              out_dtype=out_dtype, opts=opts)
    if opts is not None:
        if version not in VARIANT_VERSIONS:
            raise ValueError(f"{where}: on the GPU, grouped-query k/v, window, softcap, alibi_slopes and dropout run "
                             f"in version {' / '.join(VARIANT_VERSIONS)} (float16 / bfloat16); every version's CPU "
                             f"mirror (numpy inputs) takes them all. Got version {version!r}")
        variants.check_kernel_origin(opts, where)
        return tc.forward(q, k, v, causal=causal, scale=scale, version=version, out_dtype=out_dtype, opts=opts)
    if version == "fp32x3":
        plan = fp32x3.plan_forward(q, k, v, causal=causal, scale=scale)
    elif version != "fp32":
        plan = tc.plan_forward(q, k, v, causal=causal, scale=scale, version=version, out_dtype=out_dtype)
    else:
        plan = fp32_plan_forward(q, k, v, causal=causal, scale=scale, config=config)
    return fast_path.launch(plan, q, k, v)


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
    qb, kb, vb = (kernels.row_major(varlen.as_batch(x)) for x in (q, k, v))  # (1, H, total, D)
    D = q.shape[2]
    _check_head_dim(version, D)
    causal = check_causal(causal, where)
    opts = variants.check(qb, kb, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                          dropout_p=dropout_p, seed=seed, where=where)
    out_dtype = check_out_dtype(out_dtype, q.dtype, where)
    o, lse = tc.forward(qb, kb, vb, causal=causal, scale=resolve_scale(scale, D), version=version,
                           out_dtype=out_dtype, opts=opts, varlen=cu + (int(np.diff(cq).max()),))
    return cupy.ascontiguousarray(o[0].swapaxes(0, 1)), lse[0]


def fp32_plan_forward(q, k, v, *, causal, scale, config=None):
    """The kernels.ForwardLaunch of the fp32 kernel for CuPy float32 q, k, v checked by forward. config: a tuple
    overriding the device's choice (tuning runs), or None."""
    B, H, Nq, D = q.shape
    launch = _fp32_launch(B, H, Nq, k.shape[2], D, bool(causal), scale, None if config is None else tuple(config),
                          device.device())
    return kernels.ForwardLaunch(launch, np.dtype(np.float32))


@functools.lru_cache(maxsize=fast_path.MAX_PLANS)  # once per problem: the choices below depend on nothing else
def _fp32_launch(B, H, Nq, Nk, D, causal, scale, config, dev):
    """The fp32 kernel's launch for one problem on dev: configuration, compiled kernel, grid, parameters."""
    cfg = (_fp32_cfg(D, config) if config is not None else
           fp32_config(D, dev, blocks=lambda c: B * H * -(-Nq // c.br)))
    if cfg.async_v and not dev.arch.cp_async:
        raise device.UnsupportedDevice(f"flash_v2 fp32: ASYNC_V needs cp.async (sm_80+); {dev.name} is "
                                       f"{dev.arch.name}")
    smem = fp32_smem_bytes(D, cfg)
    # one NVRTC module per (head dim, configuration), compiled once and cached
    fn = kernels.function(load_module("flash_v2_forward_fp32.cu", defines=cfg.defines(D)), "flash_v2_forward_fp32",
                          smem)
    return kernels.Launch(fn, (-(-Nq // cfg.br), B * H), (cfg.threads,), smem,  # one block per (Q tile i, head)
                          FwdParams(Nq=Nq, Nk=Nk, scale=scale, scale_log2=scale * LOG2E, causal=int(causal)))


# Head dims CI compiles the fp32 kernel at: each candidate configuration's range, odd dims, non-multiples of 4.
FP32_COMPILE_DIMS = (1, 7, 16, 32, 64, 80, 100, 128)


def kernel_plans(dev):
    """[device.KernelPlan] of every kernel stage 02 may launch on dev (the fp32 kernel at FP32_COMPILE_DIMS)."""
    out = [device.KernelPlan("flash_v2_forward_fp32.cu", cfg.defines(D), "flash_v2_forward_fp32",
                             fp32_smem_bytes(D, cfg), 0, cfg.threads)
           for D in FP32_COMPILE_DIMS for cfg in fp32_reachable(D, dev)]
    return out + tc.kernel_plans(dev) + fp32x3.kernel_plans(dev)


def kernel_sources():
    """(file, defines, name expressions) of every kernel stage 02 may launch on any architecture, for the NVRTC
    compile tests."""
    plans = {p for a in device.ARCHS for p in kernel_plans(device.emulate(a))}
    out = sorted({(p.file, tuple(sorted(p.defines.items()))) for p in plans if p.file.endswith("fp32.cu")})
    out = [(f, dict(d), ()) for f, d in out]
    out += [(f, {}, tuple(names)) for f, names in tc.kernel_sources()]
    out += [(f, {}, tuple(names)) for f, names in fp32x3.kernel_sources()]
    return out


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version="auto"):
    """Not part of stage 02 (forward only): the FlashAttention-2 backward lives in stage 03."""
    try:
        from stages import flash_v2_backward
    except ImportError as e:
        raise NotImplementedError("stage 02 is the forward pass only; the backward is stage 03 "
                                  f"(stages/03_flash_v2_backward), which does not import here: {e}") from e
    return flash_v2_backward.backward(q, k, v, o, lse, do, causal=causal, scale=scale, version=version)
