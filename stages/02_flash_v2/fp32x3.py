"""Stage 02, version "fp32x3" of the FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1): its launcher, called by
flash_v2.forward once it has checked the inputs:

    o, lse = forward(q, k, v, causal=causal, scale=scale)   # CuPy float32 (B, H, N, D)

Kernel kernels/flash_v2_forward_fp32x3.cu: float32 in and
out, S = Q K^T and O += P V on the tensor cores (mma.sync m16n8k8 TF32) with the 3xTF32 split (each operand =
big + small TF32 parts, three mma per product, V in three parts: close to fp32 accuracy), each K/V tile split
once per block into shared memory while the next lands by cp.async. Head dims 32, 64, 96, 128; any Nq, Nk; causal
aligned bottom-right (query row r sees key c iff c <= r + Nk - Nq).
"""
from typing import NamedTuple

import numpy as np

from stages.common import LOG2E, device, load_module
from stages.common.kernels import function
from stages.common.launch import Launch, run_forward
from stages.common.params import FwdParams

HEAD_DIMS = (32, 64, 96, 128)
FILE = "flash_v2_forward_fp32x3.cu"


class Config(NamedTuple):
    """One launch configuration: K/V tiles of Bc keys, NWARPS warps of MT m-tiles (16 rows each: Br = 16 MT NWARPS),
    MINB blocks per SM the registers must allow, SU unroll of the S k loop."""
    bc: int
    nwarps: int
    mt: int
    minb: int
    su: int

    @property
    def br(self):
        return 16 * self.mt * self.nwarps

    @property
    def threads(self):
        return 32 * self.nwarps


# Candidates per (head dim, causal), first choice first. At d <= 64 each warp takes two m-tiles (MT = 2), so every
# K/V fragment it loads feeds two mma; from d = 96 on, O_i's accumulators (16 MT x d per warp) leave no registers
# for a second m-tile, so 8 warps take one each. Bc = 32 keeps S_ij's accumulators small beside O_i's, and the
# parts of K_j, V_j (four floats per raw one) in shared memory. The later candidates are for GPUs with less shared
# memory: from d = 96 on, Bc = 16 with 8 warps (an A100), then Br = 64 (4 warps), then both.
_SMALL = [Config(32, 4, 1, 2, 2), Config(16, 4, 1, 2, 2)]
CANDIDATES = {
    (32, False): [Config(32, 4, 2, 2, 2)] + _SMALL, (32, True): [Config(32, 4, 2, 2, 2)] + _SMALL,
    (64, False): [Config(32, 4, 2, 2, 2)] + _SMALL, (64, True): [Config(32, 4, 2, 2, 2)] + _SMALL,
    (96, False): [Config(32, 8, 1, 1, 2), Config(16, 8, 1, 1, 2)] + _SMALL,
    (96, True): [Config(32, 8, 1, 1, 2), Config(16, 8, 1, 1, 2)] + _SMALL,
    (128, False): [Config(32, 8, 1, 1, 2), Config(16, 8, 1, 1, 2)] + _SMALL,
    (128, True): [Config(32, 8, 1, 1, 2), Config(16, 8, 1, 1, 2)] + _SMALL,
}


def _check(D):
    if D not in HEAD_DIMS:
        raise ValueError(f"flash_v2 version 'fp32x3': head_dim {D} is not supported; use one of {HEAD_DIMS}, or "
                         "version='fp32' (any head_dim 1..128)")


def smem_bytes(D, causal=False, cfg=None):
    """Dynamic shared memory per block: Q_i [Br][D+8], raw K_j and V_j [Bc][D+4] each, K_j's TF32 parts [Bc][2D+16],
    V_j's [Bc/2][6D+24] floats."""
    cfg = cfg or config(D, causal)
    return 4 * (cfg.br * (D + 8) + 2 * cfg.bc * (D + 4) + cfg.bc * (2 * D + 16) + cfg.bc // 2 * (6 * D + 24))


def config(D, causal=False, dev=None):
    """The configuration at head dim D on device dev (None: the first candidate), or a ValueError naming the
    supported head dims."""
    _check(D)
    cands = CANDIDATES[(D, bool(causal))]
    if dev is None:
        return cands[0]
    return device.pick(cands, lambda c: smem_bytes(D, causal, c), dev, what=f"flash_v2 version 'fp32x3' d={D}")


def tiles(D, causal=False, cfg=None):
    """(Br, Bc) of the kernel at head dim D."""
    cfg = cfg or config(D, causal)
    return cfg.br, cfg.bc


def name(D, cfg):
    """The template instantiation of one head dim and configuration."""
    return f"flash_v2_forward_fp32x3<{D},{','.join(map(str, cfg))}>"


def kernel_plans(dev):
    """[device.KernelPlan] of every instantiation forward may launch on dev."""
    if not device.tf32_tensor_cores(dev):
        return []
    plans = {(D, config(D, causal, dev)) for D, causal in CANDIDATES}
    return [device.KernelPlan(FILE, {}, name(D, c), smem_bytes(D, False, c), 0, c.threads) for D, c in sorted(plans)]


def kernel_sources():
    """(file, name expressions) of every instantiation forward may launch on any architecture."""
    return [(FILE, sorted({p.name for a in device.ARCHS for p in kernel_plans(device.emulate(a))}))]


def forward(q, k, v, *, causal, scale, cfg=None):
    """Version fp32x3 on CuPy float32 q, k, v checked by flash_v2.forward: o (B, H, Nq, D), lse (B, H, Nq). cfg: a
    Config in place of the device's choice (tuning runs)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dev = device.device()
    device.require(dev, device.TF32_FEATURES, what="flash_v2 version 'fp32x3' (TF32 tensor cores)",
                   instead="On this GPU use version 'fp32' (CUDA cores, float32 accuracy)")
    if B * H > 65535:
        raise ValueError(f"flash_v2 version 'fp32x3': batch * heads = {B * H} is over the grid limit 65535; "
                         "split the batch into several calls")
    cfg = Config(*cfg) if cfg is not None else config(D, causal, dev)  # the named configuration that fits this GPU
    expr = name(D, cfg)
    smem = smem_bytes(D, causal, cfg)
    fn = function(load_module(FILE, name_expressions=(expr,)), expr, smem)  # compiled once per instantiation
    params = FwdParams(Nq=Nq, Nk=Nk, scale=scale, exp2_scale=scale * LOG2E, causal=int(causal))
    grid = (-(-Nq // cfg.br), B * H)  # one block per (Q tile i, head)
    return run_forward(Launch(fn, grid, (cfg.threads,), smem, params), q, k, v, np.float32)  # o, lse; the launch
