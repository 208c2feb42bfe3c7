"""Stage 01 launcher: FlashAttention v1 (arXiv 2205.14135, Algorithm 1 forward, Algorithm 4 backward), fp32.

    o, lse = forward(q, k, v, causal=False, scale=None)            # numpy -> mirror.py, CuPy -> the kernel
    dq, dk, dv = backward(q, k, v, o, lse, do, causal=False, scale=None)

numpy inputs run the tile mirror (mirror.py: the same algorithm, tiles and loop order in numpy);
CuPy inputs launch kernels/flash_v1_forward.cu and kernels/flash_v1_backward.cu, one thread block
per (batch, head). Supported: float32, any head_dim from 1 to 128, any Nq and Nk, causal or not.
"""
import numpy as np

from stages.common import (
    check_attention_inputs, check_backward_inputs, check_causal, device, empty, load_module, resolve_scale,
)

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


def forward_smem_bytes(D, bc=BC):
    """Shared memory of the forward kernel: Q_i, K_j, V_j (padded rows), P~_ij, and m, l, a, b per row."""
    return 4 * (BR * (D + 1) + 2 * bc * (D + 1) + BR * (bc + 1) + 4 * BR)


def backward_smem_bytes(D, bc=BC):
    """Shared memory of the backward kernel: Q_i, dO_i, K_j, V_j (padded rows), P_ij, dS_ij, L_i, D_i."""
    return 4 * (2 * BR * (D + 1) + 2 * bc * (D + 1) + 2 * BR * (bc + 1) + 2 * BR)


BC_CANDIDATES = (BC, BC // 2)  # Bc = 16 halves the K/V tiles for a T4 at head dims above ~100 (64 KB per block)


def kv_tile(which, D, dev=None):
    """Bc of the kernel `which` ("forward" / "backward") at head dim D on device dev: the paper sets the tiles
    from the on-chip memory M (Bc = ceil(M / 4d)); here the first of BC_CANDIDATES that fits dev (None: BC)."""
    if dev is None:
        return BC
    smem = forward_smem_bytes if which == "forward" else backward_smem_bytes
    return device.pick(BC_CANDIDATES, lambda bc: smem(D, bc), dev, what=f"flash_v1.{which} d={D}")


def _kernel(which, D, bc, smem):
    """The compiled kernel `flash_v1_<which>` for head dim D and Bc (one NVRTC module per (file, D, Bc), cached)."""
    mod = load_module(f"flash_v1_{which}.cu", defines={"HEAD_DIM": D, "BR": BR, "BC": bc})
    kern = mod.get_function(f"flash_v1_{which}")
    if smem > 48 * 1024:  # above 48 KB a block must opt in to more dynamic shared memory
        kern.max_dynamic_shared_size_bytes = smem
    return kern


# Head dims CI compiles the kernels at.
COMPILE_DIMS = (1, 7, 32, 64, 80, 128)


def kernel_plans(dev):
    """[device.KernelPlan] of every kernel stage 01 may launch on dev."""
    return [device.KernelPlan(f"flash_v1_{w}.cu", {"HEAD_DIM": D, "BR": BR, "BC": bc}, f"flash_v1_{w}",
                              (forward_smem_bytes if w == "forward" else backward_smem_bytes)(D, bc), 0, NTHREADS)
            for w in ("forward", "backward") for D in COMPILE_DIMS for bc in [kv_tile(w, D, dev)]]


def forward(q, k, v, *, causal=False, scale=None, version="paper"):
    """FlashAttention v1 forward. Returns o (B, H, Nq, D) and lse (B, H, Nq), both float32."""
    xp, B, H, Nq, Nk, D = check_attention_inputs(q, k, v, dtypes=DTYPES, where="flash_v1.forward")
    causal = check_causal(causal, "flash_v1.forward")
    _check_common(D, version, "flash_v1.forward")
    scale = resolve_scale(scale, D, "flash_v1.forward")
    if xp is np:
        return mirror.forward(q, k, v, causal=causal, scale=scale)
    q, k, v = (xp.ascontiguousarray(t) for t in (q, k, v))
    o = empty(xp, (B, H, Nq, D), np.float32)  # (B, H, Nq, D)
    lse = empty(xp, (B, H, Nq), np.float32)  # (B, H, Nq)
    l = xp.empty((B, H, Nq), np.float32)  # the paper's l and m: scratch in HBM, initialised by the kernel
    m = xp.empty((B, H, Nq), np.float32)
    bc = kv_tile("forward", D, device.device())
    smem = forward_smem_bytes(D, bc)
    _kernel("forward", D, bc, smem)(
        (B * H,), (NTHREADS,),
        (q, k, v, o, l, m, lse, np.int32(Nq), np.int32(Nk), np.float32(scale), np.int32(bool(causal))),
        shared_mem=smem,
    )
    return o, lse


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version="paper"):
    """FlashAttention v1 backward from the saved lse. Returns dq, dk, dv (float32, like q, k, v)."""
    xp, B, H, Nq, Nk, D = check_backward_inputs(q, k, v, o, lse, do, dtypes=DTYPES, where="flash_v1.backward")
    causal = check_causal(causal, "flash_v1.backward")
    _check_common(D, version, "flash_v1.backward")
    scale = resolve_scale(scale, D, "flash_v1.backward")
    lse = lse.astype(np.float32, copy=False)  # (B, H, Nq)
    if xp is np:
        return mirror.backward(q, k, v, o, lse, do, causal=causal, scale=scale)
    q, k, v, o, lse, do = (xp.ascontiguousarray(t) for t in (q, k, v, o, lse, do))
    dq = empty(xp, (B, H, Nq, D), np.float32)  # (B, H, Nq, D), zeroed by the kernel (Alg.4 L6)
    dk = empty(xp, (B, H, Nk, D), np.float32)  # (B, H, Nk, D)
    dv = empty(xp, (B, H, Nk, D), np.float32)
    bc = kv_tile("backward", D, device.device())
    smem = backward_smem_bytes(D, bc)
    _kernel("backward", D, bc, smem)(
        (B * H,), (NTHREADS,),
        (q, k, v, o, lse, do, dq, dk, dv, np.int32(Nq), np.int32(Nk), np.float32(scale), np.int32(bool(causal))),
        shared_mem=smem,
    )
    return dq, dk, dv
