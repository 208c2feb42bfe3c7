"""Stage 03: FlashAttention-2 backward (arXiv 2307.08691, Algorithm 2), three versions. The public functions: they
check the inputs and hand them to the version's launcher (fp32.py, tc.py, fp32x3.py) or, for numpy inputs, to the tile
mirror (mirror.py).

    dq, dk, dv = backward(q, k, v, o, lse, do, causal=False, scale=None, version="auto", deterministic=False)
    o, lse = forward(q, k, v, causal=False, scale=None)     # stage 02's forward (stage 01's if 02 is absent)
    dq, dk, dv = backward_varlen(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k)   # packed sequences of any lengths

Versions (all runnable, each checked against the fp64 oracle and its mirror):
    fp32    float32, CUDA cores, the paper's loop: kernels/flash_v2_backward_fp32.cu, head_dim 32, 64, 128
    tc      float16 / bfloat16, mma.sync tensor cores: kernels/flash_v2_backward_tc.cu, head_dim 64, 128, 256
            (d = 256: two blocks per K/V tile, one per half of dK_j, dV_j, dQ_i)
    fp32x3  float32 on TF32 tensor cores, the 3xTF32 split (close to fp32 accuracy; sm_80 and newer):
            kernels/flash_v2_backward_fp32x3.cu, head_dim 32, 64, 128
    auto    tc for float16 / bfloat16; for float32 fp32x3 on a GPU with TF32 tensor cores (with deterministic=False
            and no variants), else fp32
Each launcher's launches: the preprocess (kernels/flash_v2_backward_pre.cu: D_i = rowsum(dO_i * O_i), L_i, +inf for
a fully masked row), the main kernel, then the dQ conversion or the deterministic dQ pass. Every kernel but the
conversion takes one BwdParams (kernels/params.cuh, stages/common/params.py).
deterministic: False (default) adds dQ_i += dS_ij K_j into an fp32 buffer with atomicAdd from the block of
every K/V tile: fast, but the order of the additions (so the last bits of dq) changes from run to run.
True: no atomics; a second kernel, parallel over Q tiles, recomputes dS_ij and sums dQ_i in a fixed
order: dq, dk, dv are bit-identical across runs (dk, dv always are), at the cost of recomputing S and dP.

`backward` is wrapped by the speed layer (stages/common/fast_path.py), which replays a repeated call's launches; a
reader may skip it (backward.__wrapped__ is the same function without it).
"""
import numpy as np

from stages.common import (
    check_backward_inputs, check_causal, check_out_dtype, device, fast_path, resolve_scale, variants, varlen,
)
from stages.common.launch import row_major

from . import fp32, fp32x3, mirror, tc
from .fp32 import PAD, PRE_NAMES  # noqa: F401 (stage 06 launches the preprocess with them)
from .tc import accumulate_into  # noqa: F401 (the ring's block call)

VERSIONS = ("fp32", "tc", "fp32x3")
HEAD_DIMS = {"fp32": fp32.HEAD_DIMS, "tc": tc.HEAD_DIMS, "fp32x3": fp32x3.HEAD_DIMS}
DTYPES = {"fp32": (np.dtype(np.float32),), "tc": tc.DTYPES, "fp32x3": (np.dtype(np.float32),)}


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


def _auto_fp32x3(deterministic, opts, D):
    """Whether version="auto" runs fp32x3 for float32 on this GPU (resolve_version's fp32 otherwise): TF32 tensor
    cores (sm_80 on), plain attention at its head dims, the atomic dQ."""
    return (not deterministic and opts is None and D in HEAD_DIMS["fp32x3"]
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


@fast_path.remembered  # the speed layer: a repeated call replays its kept launches (stages/common/fast_path.py)
def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version="auto", deterministic=False, out_dtype=None,
             tc_config=None, profile=None, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0, seed=0,
             origin=None):
    """Gradients (dq, dk, dv) of sum(O * dO), shaped like q, k, v, in their dtype, or in float32 with
    out_dtype=np.float32 (straight from the float32 accumulators: the ring adds such partial gradients).

    For tuning (dev/sweep_backward.py), CuPy arrays only: tc_config, the tc kernel's {"br": Br, "bc": Bc, "wq":
    1 or 2, "defer_dq": bool, "j_fast": bool, "fuse_dq": bool} in place of TC_BR[D], TC_BC[D], wq 1, TC_DEFER_DQ,
    j_fast_order, fuse_dq_rule (tc.py; a missing key: the default; neither br nor bc: the device's TcTiles);
    profile, a list that receives (name, cupy.cuda.Event) before the first launch and after each.
    Variants (stages/common/variants.py): grouped-query k, v (fewer heads), window, alibi_slopes, softcap,
    dropout_p with seed, origin (a block of a larger problem: the ring); the mirror (numpy inputs) takes them all,
    and so does version 'tc' on the GPU with deterministic=False (dropout regenerates the forward's mask from the
    seed: pass the forward's dropout_p, seed and origin)."""
    where = "flash_v2_backward"
    xp, B, H, Nq, Nk, D = check_backward_inputs(q, k, v, o, lse, do, where=where, gqa=True)
    causal = check_causal(causal, where)
    opts = None  # plain attention: no option to check
    if (window is not None or alibi_slopes is not None or softcap is not None or dropout_p or k.shape[1] != H
            or origin is not None):
        opts = variants.check(q, k, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                              dropout_p=dropout_p, seed=seed, origin=origin, where=where)
        opts = None if opts.plain else opts
    if opts is not None and xp is not np and (deterministic or q.dtype == np.float32):
        raise ValueError(f"{where}: on the GPU the variants (dropout included) run in version 'tc' (float16 / "
                         "bfloat16) with deterministic=False; the CPU mirror (numpy inputs) and stage 00 take them "
                         "all")
    out_dtype = check_out_dtype(out_dtype, q.dtype, where)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"{where}: deterministic must be True or False, got {deterministic!r}")
    deterministic = bool(deterministic)
    asked, version = version, resolve_version(version, q.dtype)
    if asked == "auto" and version == "fp32" and xp is not np and _auto_fp32x3(deterministic, opts, D):
        version = "fp32x3"  # fast float32 where it runs
    if D not in HEAD_DIMS[version]:
        others = [v for v in VERSIONS if v != version and D in HEAD_DIMS[v]]
        alt = "".join(f" or version {v!r} ({'/'.join(d.name for d in DTYPES[v])})" for v in others)
        raise ValueError(f"{where}: head_dim {D} is not supported by version {version!r}; "
                         f"use one of {HEAD_DIMS[version]}{alt}")
    if version == "fp32x3" and deterministic:
        raise ValueError(f"{where}: version 'fp32x3' adds dQ with atomics (deterministic=False); "
                         "deterministic=True runs in version 'fp32'")
    scale = resolve_scale(scale, D)
    if tc_config is not None:
        tc.check_tc_config(tc_config, version, xp)
    if profile is not None and xp is np:
        raise ValueError(f"{where}: profile= records CUDA events: CuPy arrays only")
    if xp is np:  # the CPU mirror, with this version's tiles
        return mirror.backward(q, k, v, o, lse, do, causal=causal, scale=scale, version=version,
                               deterministic=deterministic, out_dtype=out_dtype, opts=opts)
    variants.check_kernel_origin(opts, where)
    if version == "fp32":
        return fp32.backward_fp32(q, k, v, o, lse, do, causal=causal, scale=scale, deterministic=deterministic,
                                  profile=profile)
    if version == "fp32x3":
        return fp32x3.backward_fp32x3(q, k, v, o, lse, do, causal=causal, scale=scale, profile=profile)
    return tc.backward_tc(q, k, v, o, lse, do, causal=causal, scale=scale, deterministic=deterministic,
                          out_dtype=out_dtype, config=tc_config, opts=opts, profile=profile)


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
    qb, kb, vb, ob, dob = (row_major(varlen.as_batch(x)) for x in packed)  # (1, H, total, D)
    causal = check_causal(causal, where)
    opts = variants.check(qb, kb, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                          dropout_p=dropout_p, seed=seed, where=where)
    out_dtype = check_out_dtype(out_dtype, q.dtype, where)
    dq, dk, dv = tc.backward_tc(qb, kb, vb, ob, lse[None], dob, causal=causal, scale=resolve_scale(scale, D),
                                out_dtype=out_dtype, opts=opts, varlen=cu + (int(np.diff(ck).max()),))
    return tuple(cupy.ascontiguousarray(x[0].swapaxes(0, 1)) for x in (dq, dk, dv))


def backward_flops(B, H, Nq, Nk, D, causal):
    """The papers' convention: 2.5x the forward's 4 B H Nq Nk D (halved when causal)."""
    return 2.5 * 4.0 * B * H * Nq * Nk * D * (0.5 if causal else 1.0)


def smem_bytes(version, D, br=None, bc=None, wq=1):
    """Dynamic shared memory of (main kernel, deterministic dQ pass) of version fp32 or tc (tiles Br, Bc, wq; None:
    the first ones). Version fp32x3's: fp32x3.fp32x3_smem."""
    return fp32.smem_bytes(D) if version == "fp32" else tc.smem_bytes(D, br, bc, wq)


def kernel_plans(dev):
    """[device.KernelPlan] of every kernel this stage may launch on dev (the tc kernels at dev's tiles; the
    deterministic dQ pass and the fp32 kernels where their shared memory fits)."""
    pre = [device.KernelPlan(fp32.PRE_FILE, {}, n, 0, 0, 256) for n in fp32.PRE_NAMES]
    return pre + fp32.kernel_plans(dev) + fp32x3.kernel_plans(dev) + tc.kernel_plans(dev)


def kernel_sources():
    """(file, name expressions) of every kernel this stage may launch on any architecture (and both orders of the tc
    kernel's atomic dQ at its first tiles, so the sweep's alternative compiles too)."""
    plans = {p for a in device.ARCHS for p in kernel_plans(device.emulate(a))}
    out = {}
    for p in sorted(plans, key=lambda p: (p.file, p.name)):
        out.setdefault(p.file, []).append(p.name)
    out[tc.FILE] += [tc.kernel_names(c, D, defer=False)[0] for D in tc.HEAD_DIMS for c in ("__half", "__nv_bfloat16")]
    return list(out.items())
