"""Stage 06, version "fp32x3" of the forward: float32 on Hopper's wgmma (kernels/flash_v3_forward_fp32x3.cu).

    o, lse = flash_v3.forward(q, k, v, causal=True)   # float32 CuPy arrays: this version

Stage 02's fp32x3 (3xTF32: each operand = big + small TF32 parts, V in three; each k step into a fresh accumulator)
with the matmuls on wgmma: the parts of Q_i, K_j and V_j^T lie in shared memory in the 128-byte swizzle, S = Q K^T
reads both from there, O += P V reads P's parts from registers. Two warpgroups (128 rows of Q_i) share one K/V
buffer; the threads split V_j into its parts while S is computed and K_{j+1} while P V_j is. Head dims 64 and 128;
any Nq, Nk; causal aligned bottom-right. On another GPU it says so and names stage 02's version fp32x3.
"""
from typing import NamedTuple

import numpy as np

from stages.common import LOG2E, device, fast_path, kernels
from stages.common.params import FwdParams

from .sm90a import function

FILE = "flash_v3_forward_fp32x3.cu"
HEAD_DIMS = (64, 128)


class Config(NamedTuple):
    """K/V tiles of bc keys, nwg warpgroups of 64 rows of Q_i each."""

    bc: int
    nwg: int

    @property
    def br(self):
        return 64 * self.nwg

    @property
    def threads(self):
        return 128 * self.nwg


# The parts of Q_i (two floats per element) take most of the shared memory: at d = 128 two warpgroups leave room for
# K/V tiles of 32 keys; at d = 64, of 64.
CONFIGS = {64: Config(64, 2), 128: Config(32, 2)}


def smem_bytes(D, cfg=None):
    """Dynamic shared memory: Q_i's big and small parts (Br x D), K_j's (Bc x D), V_j^T's three (D x Bc), 4 bytes a
    value, and 1024 bytes to align the first tile to the swizzle's period."""
    cfg = cfg or CONFIGS[D]
    return 4 * D * (2 * cfg.br + 2 * cfg.bc + 3 * cfg.bc) + 1024


def instantiation(D, cfg=None):
    """The kernel's template instantiation (its name expression) at head dim D."""
    cfg = cfg or CONFIGS[D]
    return f"flash_v3_forward_fp32x3<{D},{cfg.bc},{cfg.nwg}>"


def instantiations():
    """[(file, name)]: the instantiations CI compiles for sm_90a."""
    return [(FILE, instantiation(D)) for D in HEAD_DIMS]


def forward(q, k, v, *, causal, scale):
    """Version fp32x3 on CuPy float32 q, k, v (B, H, N, D) checked by flash_v3.forward (Nq > 0): o (B, H, Nq, D)
    float32, lse (B, H, Nq)."""
    B, H, Nq, D = q.shape
    cfg = CONFIGS[D]  # the named tiles of this head dim
    smem = smem_bytes(D)
    if not device.fits(device.device(), smem):
        raise device.UnsupportedDevice(f"flash_v3.forward version 'fp32x3' needs {smem // 1024} KB of shared memory "
                                       "per block; use stage 02's version fp32x3")
    fn = function(FILE, instantiation(D), smem)  # compiled once
    params = FwdParams(Nq=Nq, Nk=k.shape[2], scale=scale, exp2_scale=scale * LOG2E, causal=int(bool(causal)))
    launch = kernels.Launch(fn, (-(-Nq // cfg.br), B * H), (cfg.threads,), smem, params)  # one block per (Q_i, head)
    return fast_path.launch(kernels.ForwardLaunch(launch, np.dtype(np.float32)), q, k, v)  # o, lse allocated; launch
