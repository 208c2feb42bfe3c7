"""Stage 03, version "fp32x3" of the FlashAttention-2 backward (arXiv 2307.08691, Algorithm 2): float32 on TF32 tensor
cores (mma.sync m16n8k8) with the 3xTF32 split of stage 02's fp32x3 forward (kernels/tf32x3.cuh), close to fp32
accuracy; sm_80 and newer, head dims 32, 64, 128. Its launcher, called by flash_v2_backward.backward once it has
checked the inputs:

    dq, dk, dv = backward_fp32x3(q, k, v, o, lse, do, causal=causal, scale=scale)   # CuPy float32 (B, H, N, D)

Three launches, as version fp32's (fp32.py): the preprocess (D_i, L_i), the main kernel
(kernels/flash_v2_backward_fp32x3.cu: one block per (K/V tile j, head), 4 warps of 16 key rows, dQ_i added
atomically), then the dQ conversion. Atomic dQ only: deterministic=True runs in version fp32.
"""
from typing import NamedTuple

import numpy as np

from stages.common import device, load_module
from stages.common.kernels import function
from stages.common.launch import BackwardLaunch, Launch, run_backward
from stages.common.params import BwdParams

from .fp32 import PAD, PRE_FILE, PRE_NAMES

HEAD_DIMS = (32, 64, 128)
FILE = "flash_v2_backward_fp32x3.cu"


class Fp32x3Tiles(NamedTuple):
    """The kernel's configuration: nw warps of 16 key rows each (Bc = 16 nw keys per block), Br query rows per Q tile
    (one buffer of Q_i, dO_i: tile i+1 loads during tile i's dQ step) and minb, the blocks per SM the registers must
    allow."""
    nw: int
    br: int
    minb: int

    @property
    def bc(self):
        return 16 * self.nw

    @property
    def threads(self):
        return 32 * self.nw


# The configurations per head dim, first choice first; the later ones are for GPUs with less shared memory
# (fp32x3_smem gives each need). Four warps with registers for two blocks per SM, and the largest Br two blocks'
# shared memory holds with one buffer of Q_i, dO_i (64 at d <= 64, 32 at d = 128): each split of P^T, dS^T then serves
# Br / 8 k steps of dV_j, dK_j, where a second buffer would halve Br to overlap the copies.
FP32X3_CANDIDATES = {32: [Fp32x3Tiles(4, 64, 2)],
                     64: [Fp32x3Tiles(4, 64, 2), Fp32x3Tiles(4, 32, 2), Fp32x3Tiles(4, 16, 2)],
                     128: [Fp32x3Tiles(4, 32, 2), Fp32x3Tiles(4, 16, 2)]}


def fp32x3_smem(D, cfg):
    """Dynamic shared memory (bytes): K_j, V_j [Bc][D+4], Q_i, dO_i [Br][D+4], dS^T [Bc][Br+4], L_i, D_i [Br] floats,
    as in the kernel's layout comment."""
    rows = 2 * cfg.bc * (D + 4) + 2 * cfg.br * (D + 4)  # K_j, V_j; Q_i, dO_i
    return 4 * (rows + cfg.bc * (cfg.br + 4) + 2 * cfg.br)


def fp32x3_tiles(D, dev=None):
    """Fp32x3Tiles at head dim D on device dev (None: the first candidate)."""
    cands = FP32X3_CANDIDATES[D]
    if dev is None:
        return cands[0]
    return device.pick(cands, lambda c: fp32x3_smem(D, c), dev, what=f"flash_v2_backward version 'fp32x3' d={D}")


def fp32x3_name(D, cfg):
    """The template instantiation at head dim D."""
    return f"flash_bwd_fp32x3<{D},{cfg.nw},{cfg.br},{cfg.minb}>"


def backward_fp32x3(q, k, v, o, lse, do, *, causal, scale, profile=None):
    """Version fp32x3 on CuPy float32 arrays checked by flash_v2_backward.backward: dq, dk, dv float32. profile: a
    list that receives (name, cupy.cuda.Event) around the launches (dev/sweep_backward.py), or None."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    if B * H > 65535:  # the grid's y axis runs over (batch, head)
        raise ValueError(f"flash_v2_backward version 'fp32x3': batch * heads = {B * H} is over the grid limit 65535; "
                         "split the batch into several calls")
    dev = device.device()
    device.require(dev, device.TF32_FEATURES, what="flash_v2_backward version 'fp32x3' (TF32 tensor cores)",
                   instead="On this GPU use version 'fp32' (CUDA cores)")
    cfg = fp32x3_tiles(D, dev)  # the named configuration that fits this GPU
    smem, name = fp32x3_smem(D, cfg), fp32x3_name(D, cfg)
    mod = load_module(FILE, name_expressions=(name,))  # compiled once
    pre_mod = load_module(PRE_FILE, name_expressions=PRE_NAMES)  # the preprocess and the dQ conversion (fp32.py)
    Nq_pad = -(-Nq // PAD) * PAD  # D_i, L_i rows a head
    params = BwdParams(Nq=Nq, Nk=Nk, ldq=Nq, ldk=Nk, Nq_pad=Nq_pad, head_dim=D, scale=scale, causal=int(causal), H=H,
                       zero_dq=1)
    pre = Launch(function(pre_mod, "bwd_preprocess<float>", 0), (Nq_pad * D // 2048, B * H), (256,), 0,
                 params.copy())  # D_i = rowsum(dO_i * O_i), L_i; dQ_accum zeroed
    main = Launch(function(mod, name, smem), (-(-Nk // cfg.bc), B * H), (cfg.threads,), smem,
                  params.copy())  # one block per (K/V tile j, head)
    n = B * H * Nq * D
    convert = Launch(function(pre_mod, "bwd_convert_dq<float>", 0), (min(-(-n // 1024), 65535),), (256,), 0,
                     (np.float32(scale), np.int64(n)))  # dQ = scale dQ_accum
    plan = BackwardLaunch(pre, main, None, convert, rows=B * H * Nq_pad, acc=n, done=0, odtype=np.dtype(np.float32))
    return run_backward(plan, q, k, v, o, lse, do, marks=profile)  # dq, dk, dv; the launches


def kernel_plans(dev):
    """[device.KernelPlan] of the instantiation at each head dim that dev takes (none without TF32 tensor cores)."""
    if not device.tf32_tensor_cores(dev):
        return []
    return [device.KernelPlan(FILE, {}, fp32x3_name(D, cfg), fp32x3_smem(D, cfg), 0, cfg.threads)
            for D in HEAD_DIMS for cfg in [fp32x3_tiles(D, dev)]]
