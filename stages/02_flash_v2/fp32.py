"""Stage 02, versions "fp32" and "fp32_overlap" of the FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1):
float32 on CUDA cores. Their launchers, called by flash_v2.forward once it has checked the inputs:

    o, lse = forward_fp32(q, k, v, causal=causal, scale=scale)            # CuPy float32 (B, H, N, D)
    o, lse = forward_fp32_overlap(q, k, v, causal=causal, scale=scale)

kernels/flash_v2_forward_fp32.cu is the paper's loop: each step loads K_j and V_j, waits for them, computes.
kernels/flash_v2_forward_fp32_overlap.cu overlaps the loads with the math (K_{j+1} into registers during P~_ij V_j,
V_j by cp.async during S_ij). Both: any head dim 1..128 (one module per head dim and configuration), o float32,
lse float32 (B, H, Nq) in natural log, causal aligned bottom-right.
"""
from typing import NamedTuple

import numpy as np

from stages.common import LOG2E, device, load_module
from stages.common.kernels import function
from stages.common.launch import Launch, run_forward
from stages.common.params import FwdParams

VERSIONS = ("fp32", "fp32_overlap")
FILES = {"fp32": "flash_v2_forward_fp32.cu", "fp32_overlap": "flash_v2_forward_fp32_overlap.cu"}
MAX_HEAD_DIM = 128  # a lane keeps head_dim/8 columns of 4 or 8 rows of O_i in registers
BC = 64  # Bc: 8 column groups x 8 keys per lane (fixed by the kernels' thread layout)


class Fp32Config(NamedTuple):
    """A launch configuration of version fp32: TM rows of Q_i per lane, NWARPS warps (Br = 4 TM NWARPS); SHARE_KV:
    V_j loaded into K_j's buffer once S_ij is done (one buffer less, for GPUs with little shared memory)."""
    tm: int
    nwarps: int
    share_kv: bool = False

    @property
    def br(self):
        return self.nwarps * 4 * self.tm

    @property
    def threads(self):
        return 32 * self.nwarps

    def defines(self, D):
        return {"HEAD_DIM": D, "TM": self.tm, "NWARPS": self.nwarps, "SHARE_KV": int(self.share_kv)}

    def smem_bytes(self, D):
        """Q_i^T, K_j^T, V_j (head dim padded to 32; V_j in K_j's buffer with SHARE_KV) and P~_ij^T (rows + 4)."""
        dp = -(-D // 32) * 32
        return 4 * (dp * self.br + (1 if self.share_kv else 2) * dp * BC + BC * (self.br + 4))


class OverlapConfig(NamedTuple):
    """A launch configuration of version fp32_overlap: TM and NWARPS as Fp32Config's; ASYNC_V: V_j by cp.async
    (a GPU with cp.async, sm_80 on, and rows 16-byte aligned: head_dim % 4 == 0)."""
    tm: int
    nwarps: int
    async_v: bool = True

    @property
    def br(self):
        return self.nwarps * 4 * self.tm

    @property
    def threads(self):
        return 32 * self.nwarps

    def defines(self, D):
        return {"HEAD_DIM": D, "TM": self.tm, "NWARPS": self.nwarps, "ASYNC_V": int(self.async_v)}

    def smem_bytes(self, D):
        """Q_i^T, K_j^T, V_j (head dim padded to 32) and P~_ij^T (rows + 4)."""
        dp = -(-D // 32) * 32
        return 4 * (dp * self.br + 2 * dp * BC + BC * (self.br + 4))


def candidates(version, D, dev=None):
    """A version's configurations at head dim D, first choice first. d <= 64: TM = 8 with 4 warps (each lane's TM x 8
    block of S_ij reuses every value it reads 8 times); d > 64: TM = 4 with 8 warps (O_i's TM x d/8 block per lane
    grows with d, and TM = 8 would not fit in the registers). Then smaller Q tiles, for GPUs with less shared memory
    (Br = 64, Br = 32) and for problems too small to give every SM a block; version fp32 last takes Br = 32 with
    SHARE_KV (a T4 at d > 64). fp32_overlap takes ASYNC_V where dev has cp.async (dev None: assumed) and rows are
    16-byte aligned. `python dev/sweep_flash_v2.py` times the alternatives."""
    tiles = [(8, 4) if D <= 64 else (4, 8), (4, 4), (4, 2)]
    if version == "fp32":
        return [Fp32Config(tm, nw) for tm, nw in tiles] + [Fp32Config(4, 2, True)]
    async_v = D % 4 == 0 and (dev is None or dev.arch.cp_async)
    return [OverlapConfig(tm, nw, async_v) for tm, nw in tiles]


def config(version, D, dev=None, blocks=None):
    """The configuration of `version` at head dim D on device dev (None: the first candidate), or UnsupportedDevice.
    blocks(cfg): the problem's block count; when the choice leaves SMs idle (blocks < SM count), the next smaller
    Q tile is taken (twice the blocks), never the SHARE_KV one (it is for shared memory, not for SM count)."""
    cands = candidates(version, D, dev)
    if dev is None:
        return cands[0]
    cfg = device.pick(cands, lambda c: c.smem_bytes(D), dev, what=f"flash_v2 version {version!r} d={D}")
    smaller = cands[cands.index(cfg) + 1:][:1]
    if blocks is not None and blocks(cfg) < dev.sm_count and smaller and not getattr(smaller[0], "share_kv", False):
        return smaller[0]
    return cfg


def reachable(version, D, dev):
    """Every configuration config() can return on dev ([] where none fits)."""
    try:
        return list(dict.fromkeys([config(version, D, dev), config(version, D, dev, blocks=lambda c: 0)]))
    except device.UnsupportedDevice:
        return []


def overlap_fits(D, dev):
    """Whether version fp32_overlap fits dev at head dim D ("auto" takes version fp32 where it does not: its
    SHARE_KV tiles need the least shared memory)."""
    return any(device.fits(dev, c.smem_bytes(D)) for c in candidates("fp32_overlap", D, dev))


def forward_fp32(q, k, v, *, causal, scale, config=None):
    """Version fp32 on CuPy float32 q, k, v checked by flash_v2.forward: o (B, H, Nq, D), lse (B, H, Nq). config: an
    Fp32Config (or its tuple) in place of the device's choice (tuning runs)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cfg = Fp32Config(*config) if config is not None else _config("fp32", D, B * H, Nq)
    smem = cfg.smem_bytes(D)
    fn = function(load_module(FILES["fp32"], defines=cfg.defines(D)), "flash_v2_forward_fp32", smem)  # compiled once
    params = FwdParams(Nq=Nq, Nk=Nk, scale=scale, exp2_scale=scale * LOG2E, causal=int(causal))
    grid = (-(-Nq // cfg.br), B * H)  # one block per (Q tile i, head)
    return run_forward(Launch(fn, grid, (cfg.threads,), smem, params), q, k, v, np.float32)  # o, lse; the launch


def forward_fp32_overlap(q, k, v, *, causal, scale, config=None):
    """Version fp32_overlap on CuPy float32 q, k, v checked by flash_v2.forward: o (B, H, Nq, D), lse (B, H, Nq).
    config: an OverlapConfig (or its tuple) in place of the device's choice (tuning runs)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cfg = OverlapConfig(*config) if config is not None else _config("fp32_overlap", D, B * H, Nq)
    dev = device.device()
    if cfg.async_v and not dev.arch.cp_async:
        raise device.UnsupportedDevice(f"flash_v2 version 'fp32_overlap': ASYNC_V needs cp.async (sm_80 on); "
                                       f"{dev.name} is {dev.arch.name}")
    smem = cfg.smem_bytes(D)
    fn = function(load_module(FILES["fp32_overlap"], defines=cfg.defines(D)), "flash_v2_forward_fp32_overlap", smem)
    params = FwdParams(Nq=Nq, Nk=Nk, scale=scale, exp2_scale=scale * LOG2E, causal=int(causal))
    grid = (-(-Nq // cfg.br), B * H)  # one block per (Q tile i, head)
    return run_forward(Launch(fn, grid, (cfg.threads,), smem, params), q, k, v, np.float32)  # o, lse; the launch


def _config(version, D, BH, Nq):
    """config() on this GPU for a problem of BH heads of Nq rows."""
    return config(version, D, device.device(), blocks=lambda c: BH * -(-Nq // c.br))


# Head dims CI compiles the kernels at: each candidate configuration's range, odd dims, non-multiples of 4. Version
# fp32 (the same loads and math, not overlapped) at fewer: odd dims, TM = 8 tiles, TM = 4 tiles with and without
# SHARE_KV.
COMPILE_DIMS = {"fp32": (1, 7, 64, 128), "fp32_overlap": (1, 7, 16, 32, 64, 80, 100, 128)}


def kernel_plans(dev):
    """[device.KernelPlan] of every kernel these versions may launch on dev, at COMPILE_DIMS."""
    return [device.KernelPlan(FILES[ver], cfg.defines(D), "flash_v2_forward_" + ver, cfg.smem_bytes(D), 0, cfg.threads)
            for ver in VERSIONS for D in COMPILE_DIMS[ver] for cfg in reachable(ver, D, dev)]
