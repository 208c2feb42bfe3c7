"""Stage 01 launcher: FlashAttention v1 (arXiv 2205.14135, Algorithm 1 forward, Algorithm 4 backward), fp32.

    o, lse = forward(q, k, v, causal=False, scale=None)            # numpy -> mirror.py, CuPy -> the kernel
    dq, dk, dv = backward(q, k, v, o, lse, do, causal=False, scale=None)

numpy inputs run the tile mirror (mirror.py: the same algorithm, tiles and loop order in numpy);
CuPy inputs launch kernels/flash_v1_forward.cu and kernels/flash_v1_backward.cu, one thread block
per (batch, head). Supported: float32, any head_dim from 1 to 128, any Nq and Nk, causal or not.
"""
import numpy as np

from stages.common import check_attention_inputs, check_backward_inputs, empty, load_module, resolve_scale

from . import mirror

VERSIONS = ("paper",)  # one version: the paper's loop order, one block per (batch, head)
BR, BC = mirror.BR, mirror.BC  # Br x Bc tiles: the kernels are compiled with the mirror's sizes
NTHREADS = 128  # 4 warps; the kernels' thread layouts assume 4 * Br threads
MAX_HEAD_DIM = 128  # a lane holds head_dim / 32 columns of a row in registers: at most 4
DTYPES = (np.float32,)


def _check_common(D, version, where):
    if version not in VERSIONS:
        raise ValueError(f"{where}: unknown version {version!r}; stage 01 has {VERSIONS}")
    if D > MAX_HEAD_DIM:
        raise ValueError(
            f"{where}: head_dim {D} is not supported: the fp32 FlashAttention v1 kernels take any head_dim "
            f"from 1 to {MAX_HEAD_DIM} (a lane keeps head_dim/32 columns of a row in registers)"
        )


def forward_smem_bytes(D):
    """Shared memory of the forward kernel: Q_i, K_j, V_j (padded rows), P~_ij, and m, l, a, b per row."""
    return 4 * (BR * (D + 1) + 2 * BC * (D + 1) + BR * (BC + 1) + 4 * BR)


def backward_smem_bytes(D):
    """Shared memory of the backward kernel: Q_i, dO_i, K_j, V_j (padded rows), P_ij, dS_ij, L_i, D_i."""
    return 4 * (2 * BR * (D + 1) + 2 * BC * (D + 1) + 2 * BR * (BC + 1) + 2 * BR)


def _kernel(which, D, smem):
    """The compiled kernel `flash_v1_<which>` for head dim D (one NVRTC module per (file, D), cached)."""
    mod = load_module(f"flash_v1_{which}.cu", defines={"HEAD_DIM": D, "BR": BR, "BC": BC})
    kern = mod.get_function(f"flash_v1_{which}")
    if smem > 48 * 1024:  # above 48 KB a block must opt in to more dynamic shared memory
        kern.max_dynamic_shared_size_bytes = smem
    return kern


def forward(q, k, v, *, causal=False, scale=None, version="paper"):
    """FlashAttention v1 forward. Returns o (B, H, Nq, D) and lse (B, H, Nq), both float32."""
    xp, B, H, Nq, Nk, D = check_attention_inputs(q, k, v, dtypes=DTYPES, where="flash_v1.forward")
    _check_common(D, version, "flash_v1.forward")
    scale = resolve_scale(scale, D)
    if xp is np:
        return mirror.forward(q, k, v, causal=causal, scale=scale)
    q, k, v = (xp.ascontiguousarray(t) for t in (q, k, v))
    o = empty(xp, (B, H, Nq, D), np.float32)  # (B, H, Nq, D)
    lse = empty(xp, (B, H, Nq), np.float32)  # (B, H, Nq)
    l = xp.empty((B, H, Nq), np.float32)  # the paper's l and m: scratch in HBM, initialised by the kernel
    m = xp.empty((B, H, Nq), np.float32)
    smem = forward_smem_bytes(D)
    _kernel("forward", D, smem)(
        (B * H,), (NTHREADS,),
        (q, k, v, o, l, m, lse, np.int32(Nq), np.int32(Nk), np.float32(scale), np.int32(bool(causal))),
        shared_mem=smem,
    )
    return o, lse


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version="paper"):
    """FlashAttention v1 backward from the saved lse. Returns dq, dk, dv (float32, like q, k, v)."""
    xp, B, H, Nq, Nk, D = check_backward_inputs(q, k, v, o, lse, do, dtypes=DTYPES, where="flash_v1.backward")
    _check_common(D, version, "flash_v1.backward")
    scale = resolve_scale(scale, D)
    lse = lse.astype(np.float32, copy=False)  # (B, H, Nq)
    if xp is np:
        return mirror.backward(q, k, v, o, lse, do, causal=causal, scale=scale)
    q, k, v, o, lse, do = (xp.ascontiguousarray(t) for t in (q, k, v, o, lse, do))
    dq = empty(xp, (B, H, Nq, D), np.float32)  # (B, H, Nq, D), zeroed by the kernel (Alg.4 L6)
    dk = empty(xp, (B, H, Nk, D), np.float32)  # (B, H, Nk, D)
    dv = empty(xp, (B, H, Nk, D), np.float32)
    smem = backward_smem_bytes(D)
    _kernel("backward", D, smem)(
        (B * H,), (NTHREADS,),
        (q, k, v, o, lse, do, dq, dk, dv, np.int32(Nq), np.int32(Nk), np.float32(scale), np.int32(bool(causal))),
        shared_mem=smem,
    )
    return dq, dk, dv
