"""Stage 02, tensor-core versions of the FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1): launcher.

    o, lse = forward(q, k, v, causal=False, scale=scale, version="tc" | "pipelined")   # CuPy arrays only

Called by flash_v2.forward (which validates the inputs); kernels:
    kernels/flash_v2_forward_tc.cu         version "tc": mma.sync m16n8k16 + ldmatrix, synchronous tile loads,
                                           Br = Bc = 64 (4 warps x 16 rows)
    kernels/flash_v2_forward_pipelined.cu  version "pipelined": cp.async double buffering, padded shared rows,
                                           exp2 with log2(e) folded into the scale, Br = 128 (4 warps x 32 rows),
                                           Bc = 64, masked and plain copies of the tile body, longest causal Q
                                           tiles first
fp16 / bf16 in, fp32 accumulation, o in the inputs' dtype, lse float32 (B, H, Nq), natural log.
Head dims 32, 64, 96, 128; any Nq, Nk; causal aligned bottom-right (query i sees key j iff j <= i + Nk - Nq).
"""
import numpy as np

from stages.common import bfloat16, empty, load_module

VERSIONS = ("tc", "pipelined")
HEAD_DIMS = {"tc": (32, 64, 96, 128), "pipelined": (32, 64, 96, 128)}
DTYPES = (np.dtype(np.float16), bfloat16)
LOG2E = 1.4426950408889634
HEAD_GROUP = 8  # version 3, causal: heads per group in the block order (longest Q tiles first inside a group)

_CTYPE = {np.dtype(np.float16): "__half", bfloat16: "__nv_bfloat16"}
_FILE = {"tc": "flash_v2_forward_tc.cu", "pipelined": "flash_v2_forward_pipelined.cu"}

# Launch configuration per (version, head dim): (NWARPS warps, MT m-tiles of 16 rows per warp, Bc, SUB, MINB),
# plus SKIP for version 3 (skip the rescale of O_i by alpha = 1 when no row of a warp's m-tile changed its max).
# Br = 16 * MT * NWARPS rows of Q_i per block; every warp owns 16 * MT rows of Q_i. Version 3 computes each
# K/V tile in slices of SUB keys and asks the compiler to fit MINB blocks per SM (registers per thread
# <= 65536 / (MINB * 32 * NWARPS)).
# Why these tiles: version 2 keeps the simplest layout (4 warps x 16 rows, Bc = 64). Version 3 gives each warp 32
# rows (MT = 2, Br = 128, FA2's layout) so every K/V fragment read from shared memory feeds two mma; Bc = 64 in
# one slice (SUB = Bc) keeps a warp's S (32 x 64) beside its O_i (32 x d) within one thread's registers even at
# d = 128, with two blocks per SM (MINB = 2) to hide each other's latency; larger Bc or smaller slices timed
# slower. SKIP is on at d = 128 only: there the rescale of O_i is d / 2 multiplies per row and skipping it also
# frees registers; at smaller head dims the vote that decides it costs more than the multiplies it saves.
CONFIG = {
    "tc": {32: (4, 1, 64, 64, 1), 64: (4, 1, 64, 64, 1), 96: (4, 1, 64, 64, 1), 128: (4, 1, 64, 64, 1)},
    "pipelined": {32: (4, 2, 64, 64, 2, 0), 64: (4, 2, 64, 64, 2, 0), 96: (4, 2, 64, 64, 2, 0),
                  128: (4, 2, 64, 64, 2, 1)},
}


def _config(version, D):
    if version not in VERSIONS:
        raise ValueError(f"flash_v2 tensor cores: unknown version {version!r}; choose one of {VERSIONS}")
    if D not in HEAD_DIMS[version]:
        raise ValueError(f"flash_v2 version {version!r}: head_dim {D} is not supported; use one of "
                         f"{HEAD_DIMS[version]}, or version='fp32' with float32 inputs")
    return CONFIG[version][D]


def tiles(version, D, causal=False):
    """(Br, Bc): the Q_i and K_j/V_j tile heights the launcher uses for this version and head dim."""
    nwarps, mt, bc = _config(version, D)[:3]
    return 16 * mt * nwarps, bc


def smem_bytes(version, D):
    """Shared memory per block: version 2 holds Q_i, K_j, V_j unpadded (static); version 3 holds Q_i and two
    buffers each of K_j and V_j, every row padded by 8 elements (16 bytes), 2 bytes per element."""
    nwarps, mt, bc = _config(version, D)[:3]
    br = 16 * mt * nwarps
    if version == "tc":
        return 2 * (br + 2 * bc) * D
    return 2 * (br + 4 * bc) * (D + 8)


def _name(version, ctype, D, otype=None):
    """The template instantiation of one (version, input type, head dim, output type: the input type, or float
    for a block's unrounded partial result)."""
    nwarps, mt, bc, sub, minb = _config(version, D)[:5]
    otype = otype or ctype
    if version == "tc":
        return f"flash_v2_forward_tc<{ctype},{otype},{D},{bc},{nwarps}>"
    skip = "true" if _config(version, D)[5] else "false"
    return f"flash_v2_forward_pipelined<{ctype},{otype},{D},{bc},{nwarps},{mt},{sub},{minb},{skip}>"


def kernel_sources():
    """(file, name expressions) of every kernel this module launches: CI compiles each for sm_80 and sm_90."""
    return [(_FILE[ver], [_name(ver, c, D, o) for c in _CTYPE.values() for o in (c, "float") for D in HEAD_DIMS[ver]])
            for ver in VERSIONS]


def forward(q, k, v, *, causal=False, scale, version, out_dtype=None):
    """o (B, H, Nq, D) and lse (B, H, Nq) float32 for CuPy q, k, v already validated by flash_v2.forward
    (fp16 / bf16, a supported head dim); scale is a float. o is in q's dtype, or in out_dtype=float32."""
    import cupy

    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dtype = np.dtype(q.dtype)
    if dtype not in _CTYPE:
        raise TypeError(f"flash_v2 version {version!r}: dtype {dtype} is not supported; use float16 or bfloat16")
    nwarps, mt, bc = _config(version, D)[:3]
    br = 16 * mt * nwarps
    if B * H > 65535:
        raise ValueError(f"flash_v2 version {version!r}: batch * heads = {B * H} is over the grid limit 65535; "
                         "split the batch into several calls")
    odtype = np.dtype(out_dtype or dtype)
    name = _name(version, _CTYPE[dtype], D, "float" if odtype == np.float32 else None)
    # one module per (version, head dim, dtype, tiles): compiled once, then cached by load_module
    kern = load_module(_FILE[version], name_expressions=(name,)).get_function(name)
    q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))  # (B, H, N, D) row-major
    o = empty(cupy, (B, H, Nq, D), odtype)  # (B, H, Nq, D)
    lse = empty(cupy, (B, H, Nq), np.float32)  # (B, H, Nq)
    Tr = -(-Nq // br)
    args = (q, k, v, o, lse, np.int32(Nq), np.int32(Nk))
    if version == "tc":  # one block per (Q tile i, head)
        kern((Tr, B * H), (32 * nwarps,), args + (np.float32(scale), np.int32(causal)))
    else:  # causal: a 1-D grid, longest Q tiles first inside groups of heads (see the kernel)
        grid = (B * H * Tr,) if causal else (Tr, B * H)
        smem = smem_bytes(version, D)
        if smem > 48 * 1024:  # more than 48 KB of dynamic shared memory must be asked for
            kern.max_dynamic_shared_size_bytes = smem
        kern(grid, (32 * nwarps,), args + (np.float32(scale * LOG2E), np.int32(bool(causal)), np.int32(HEAD_GROUP)),
             shared_mem=smem)
    return o, lse
