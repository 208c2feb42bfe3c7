"""Stage 02, version "fp32x3" of the FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1): launcher.

    o, lse = forward(q, k, v, causal=False, scale=scale)   # CuPy float32 arrays only

Called by flash_v2.forward (which validates the inputs); kernel kernels/flash_v2_forward_fp32x3.cu: float32 in and
out, S = Q K^T and O += P V on the tensor cores (mma.sync m16n8k8 TF32) with the 3xTF32 split (each operand =
big + small TF32 parts, three mma per product, V in three parts: close to fp32 accuracy), cp.async double
buffering. Head dims 32, 64, 96, 128; any Nq, Nk; causal aligned bottom-right (query i sees key j iff
j <= i + Nk - Nq).
"""
import numpy as np

from stages.common import empty, load_module

HEAD_DIMS = (32, 64, 96, 128)
LOG2E = 1.4426950408889634
FILE = "flash_v2_forward_fp32x3.cu"

# Launch configuration per (head dim, causal): (Bc, NWARPS warps, MT m-tiles of 16 rows per warp, MINB blocks per
# SM the registers must allow, SU unroll of the S k loop). Br = 16 * MT * NWARPS = 128 everywhere.
# Why these: at d <= 64 each warp takes two m-tiles (MT = 2), so every K/V fragment it splits feeds two mma; from
# d = 96 on, O_i's accumulators (16 * MT x d per warp) leave no registers for a second m-tile, so 8 warps take one
# each. Bc = 32 keeps S_ij's accumulators small beside O_i's; d = 128 non-causal takes 64-key tiles (half the
# barriers per key). Among the configurations that fit, these were the fastest when timed with scripts/bench.py.
# Shared memory 4 (Br (D + 8) + 2 Bc (D + 8) + 2 Bc (D + 4)) bytes: at most 202 KB (d = 128, Bc = 64), more than an
# A100 allows a block (163 KB): that configuration needs sm_90.
CONFIG = {
    (32, False): (32, 4, 2, 2, 2), (32, True): (32, 4, 2, 2, 2),
    (64, False): (32, 4, 2, 2, 2), (64, True): (32, 4, 2, 2, 2),
    (96, False): (32, 8, 1, 1, 2), (96, True): (32, 8, 1, 1, 2),
    (128, False): (64, 8, 1, 1, 2), (128, True): (32, 8, 1, 1, 2),
}


def config(D, causal=False):
    """(Bc, NWARPS, MT, MINB, SU) of the kernel at head dim D, or a ValueError naming the supported head dims."""
    if D not in HEAD_DIMS:
        raise ValueError(f"flash_v2 version 'fp32x3': head_dim {D} is not supported; use one of {HEAD_DIMS}, or "
                         "version='fp32' (any head_dim 1..128)")
    return CONFIG[(D, bool(causal))]


def tiles(D, causal=False, cfg=None):
    """(Br, Bc) of the kernel at head dim D."""
    bc, nwarps, mt = tuple(cfg or config(D, causal))[:3]
    return 16 * mt * nwarps, bc


def smem_bytes(D, causal=False, cfg=None):
    """Dynamic shared memory per block: Q_i [Br][D+8], K_j [2][Bc][D+8], V_j [2][Bc][D+4] floats."""
    br, bc = tiles(D, causal, cfg)
    return 4 * (br * (D + 8) + 2 * bc * (D + 8) + 2 * bc * (D + 4))


def name(D, cfg):
    """The template instantiation of one head dim and configuration."""
    return f"flash_v2_forward_fp32x3<{D},{','.join(map(str, cfg))}>"


def kernel_sources():
    """(file, name expressions) of every instantiation forward launches: CI compiles each for sm_80 and sm_90."""
    return [(FILE, sorted({name(D, cfg) for (D, _), cfg in CONFIG.items()}))]


def forward(q, k, v, *, causal=False, scale, cfg=None):
    """o (B, H, Nq, D) float32 and lse (B, H, Nq) float32 for CuPy float32 q, k, v already validated by
    flash_v2.forward; scale is a float. cfg: (Bc, NWARPS, MT, MINB, SU) to override CONFIG (tuning runs)."""
    import cupy

    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    cfg = tuple(cfg or config(D, causal))
    br, _ = tiles(D, causal, cfg)
    if B * H > 65535:
        raise ValueError(f"flash_v2 version 'fp32x3': batch * heads = {B * H} is over the grid limit 65535; "
                         "split the batch into several calls")
    expr = name(D, cfg)
    kern = load_module(FILE, name_expressions=(expr,)).get_function(expr)  # compiled once per instantiation
    smem = smem_bytes(D, causal, cfg)
    if smem > 48 * 1024:  # more than 48 KB of dynamic shared memory must be asked for
        kern.max_dynamic_shared_size_bytes = smem
    q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))  # (B, H, N, D) row-major
    o = empty(cupy, (B, H, Nq, D), np.float32)  # (B, H, Nq, D), NaN-poisoned under the tests
    lse = empty(cupy, (B, H, Nq), np.float32)  # (B, H, Nq)
    kern((-(-Nq // br), B * H), (32 * cfg[1],),  # grid (Tr, B*H): one block per (Q tile i, head)
         (q, k, v, o, lse, np.int32(Nq), np.int32(Nk), np.float32(scale * LOG2E), np.int32(bool(causal))),
         shared_mem=smem)
    return o, lse
