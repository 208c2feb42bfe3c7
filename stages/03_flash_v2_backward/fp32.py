"""Stage 03, version "fp32" of the FlashAttention-2 backward (arXiv 2307.08691, Algorithm 2): float32 on CUDA cores,
the paper's loop as written, head dims 32, 64, 128. Its launcher, called by flash_v2_backward.backward once it has
checked the inputs:

    dq, dk, dv = backward_fp32(q, k, v, o, lse, do, causal=causal, scale=scale)   # CuPy float32 (B, H, N, D)

Three launches, in order:
    kernels/flash_v2_backward_pre.cu   bwd_preprocess: D_i = rowsum(dO_i * O_i) and L_i (Alg.2 L4); it zeroes the
                                       float32 dQ accumulator
    kernels/flash_v2_backward_fp32.cu  flash_bwd_fp32: one block per (K/V tile j, head), Br = Bc = 32, 256 threads:
                                       dK_j, dV_j, and dQ_i += dS_ij K_j by atomicAdd (Alg.2 L5-L19)
    kernels/flash_v2_backward_pre.cu   bwd_convert_dq: dQ = scale dQ_accum (the kernel adds dS K), in float32
deterministic=True: the main kernel leaves dQ out, and its third launch is flash_bwd_dq_fp32, one block per (Q tile i,
head), which recomputes dS_ij and sums dQ_i over the K/V tiles in a fixed order (no accumulator, no conversion).

The preprocess and the dQ conversion serve every version (tc.py and fp32x3.py launch them too, and stage 06): their
file, their instantiations and the padding of D_i, L_i are named here.
"""
import numpy as np

from stages.common import device, load_module
from stages.common.kernels import function
from stages.common.launch import BackwardLaunch, Launch, run_backward
from stages.common.params import BwdParams

HEAD_DIMS = (32, 64, 128)
FILE = "flash_v2_backward_fp32.cu"
BR = BC = 32  # rows of Q_i and of K_j, V_j in the main kernel and in the dQ pass (256 threads)
PRE_FILE = "flash_v2_backward_pre.cu"  # the preprocess and the dQ conversion, one module in every type
PRE_NAMES = [f"{k}<{c}>" for k in ("bwd_preprocess", "bwd_convert_dq") for c in ("float", "__half", "__nv_bfloat16")]
PAD = 128  # L_i and D_i are padded to a multiple of 128 rows (>= every Br) so tile loads never run past them


def smem_bytes(D):
    """Dynamic shared memory of (main kernel, dQ pass), as the kernel's layout comments add it up: K_j, V_j, Q_i,
    dO_i [32][D+1], P_ij and dS_ij (main) or dS_ij alone (dQ pass) [32][33], L_i and D_i [32] floats."""
    main = 2 * BC * (D + 1) + 2 * BR * (D + 1) + 2 * BC * (BR + 1) + 2 * BR
    dq = 2 * BC * (D + 1) + 2 * BR * (D + 1) + BR * (BC + 1) + 2 * BR
    return 4 * main, 4 * dq


def kernel_names(D):
    """[atomic main kernel, deterministic main kernel, dQ pass] at head dim D, compiled together, once."""
    return [f"flash_bwd_fp32<{D},true>", f"flash_bwd_fp32<{D},false>", f"flash_bwd_dq_fp32<{D}>"]


def backward_fp32(q, k, v, o, lse, do, *, causal, scale, deterministic=False, profile=None):
    """Version fp32 on CuPy float32 arrays checked by flash_v2_backward.backward: dq, dk, dv float32. profile: a
    list that receives (name, cupy.cuda.Event) around the launches (dev/sweep_backward.py), or None."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if B * H > 65535:  # the grid's y axis runs over (batch, head)
        raise ValueError(f"flash_v2_backward version 'fp32': batch * heads = {B * H} is over the grid limit 65535; "
                         "split the batch into several calls")
    dev = device.device()
    smem, smem_dq = smem_bytes(D)
    device.require_smem(dev, smem, what=f"flash_v2_backward version 'fp32' d={D}",
                        instead="use head_dim 64 or less, or stage 00")
    if deterministic:
        device.require_smem(dev, smem_dq, what=f"flash_v2_backward version 'fp32' d={D} with deterministic=True (its "
                            "dQ pass)", instead="use deterministic=False")
    atomic, ordered, dq_pass = kernel_names(D)
    mod = load_module(FILE, name_expressions=(atomic, ordered, dq_pass))  # compiled once
    pre_mod = load_module(PRE_FILE, name_expressions=PRE_NAMES)
    Nq_pad = -(-Nq // PAD) * PAD  # D_i, L_i rows a head
    params = BwdParams(Nq=Nq, Nk=Nk, ldq=Nq, ldk=Nk, Nq_pad=Nq_pad, head_dim=D, scale=scale, causal=int(causal), H=H,
                       zero_dq=int(not deterministic))
    pre = Launch(function(pre_mod, "bwd_preprocess<float>", 0), (Nq_pad * D // 2048, B * H), (256,), 0,
                 params.copy())  # D_i = rowsum(dO_i * O_i), L_i; dQ_accum zeroed
    main = Launch(function(mod, ordered if deterministic else atomic, smem), (-(-Nk // BC), B * H), (256,), smem,
                  params.copy())  # one block per (K/V tile j, head)
    rows, n = B * H * Nq_pad, B * H * Nq * D
    if deterministic:  # dQ_i summed over the K/V tiles in order: one block per (Q tile i, head)
        last = Launch(function(mod, dq_pass, smem_dq), (-(-Nq // BR), B * H), (256,), smem_dq, params.copy())
        plan = BackwardLaunch(pre, main, last, None, rows=rows, acc=1, done=0, odtype=np.dtype(np.float32))
    else:  # dQ = scale dQ_accum
        last = Launch(function(pre_mod, "bwd_convert_dq<float>", 0), (min(-(-n // 1024), 65535),), (256,), 0,
                      (np.float32(scale), np.int64(n)))
        plan = BackwardLaunch(pre, main, None, last, rows=rows, acc=n, done=0, odtype=np.dtype(np.float32))
    return run_backward(plan, q, k, v, o, lse, do, marks=profile)  # dq, dk, dv; the launches


def kernel_plans(dev):
    """[device.KernelPlan] of every kernel this version may launch on dev (those whose shared memory fits)."""
    out = []
    for D in HEAD_DIMS:
        main, dq = smem_bytes(D)
        out += [device.KernelPlan(FILE, {}, n, sm, 0, 256) for n, sm in zip(kernel_names(D), (main, main, dq))
                if device.fits(dev, sm)]
    return out
