"""What every stage 06 backward shares beside its main kernel, and version ws's tiles: stage 03's preprocess and dQ
conversion (kernels/flash_v2_backward_pre.cu), the rule for who converts dQ, a Q tile's rows and the shared memory
of each version. flash_v3_backward.py (the plain backward) and flash_v3_backward_variants.py (with the variants)
both build their launches from these.
"""
import functools

import numpy as np

from stages.common import kernels, load_module
from stages.common.params import BwdParams
from stages.flash_v2_backward import flash_v2_backward as stage03  # its preprocess, dQ conversion and padding

WS_HEAD_DIMS = (64, 128)  # version ws's (at 256, K_j and V_j of 128 keys and the Q/dO stages do not fit)
# Q/dO stages of version ws: the producer loads Q_{i+1}, dO_{i+1} while the consumers work on Q_i; they meet at
# every tile's barriers, so neither runs more than a tile ahead of the other
STAGES = 2
PRE_FILE = "flash_v2_backward_pre.cu"  # stage 03's preprocess and dQ conversion
PAD = stage03.PAD                      # D_i and L_i are padded to a multiple of PAD rows (>= every Q tile's rows)
# Who converts dQ in version ws. The accumulator is B H Nq D floats; a pass of its own over it (bwd_convert_dq) costs
# the same at every N for the same number of tokens, while the GEMMs' work grows with N, so at short N it is a large
# share of the call. Fused, the last block of each head to finish converts that head while the other blocks still
# compute, reading the accumulator from L2 where the reductions left it. But that block converts alone, on one SM: a
# long head's conversion is a tail after the rest of the grid. Fused up to FUSE_DQ_MAX accumulator values per head
# (results/backward_launches_h200.csv times both ways at every N).
FUSE_DQ_MAX = 2048 * 128


def fuse_dq_rule(version, nq, d):
    """Whether the main kernel converts dQ itself (see FUSE_DQ_MAX): version ws, nq query rows of head dim d."""
    return version == "ws" and nq * d <= FUSE_DQ_MAX


def q_tile_rows(version, D):
    """Rows of a Q tile: 64, and 128 for version ws at D = 64, where a consumer's registers hold S^T and dP^T of its
    64 keys x 128 queries beside dK_j and dV_j. The kernel takes it as its template argument BR."""
    return 128 if version == "ws" and D == 64 else 64


def smem_bytes(version, D):
    """2 bytes a value; 1024 bytes to align the first tile to the swizzle's period. wgmma: K_j and V_j (64 keys),
    the 64 x 64 dS^T, two stages of Q_i and dO_i. ws: K_j and V_j (128 keys), dS^T (128 x br), dQ_i in float32
    (br x D), STAGES stages of Q_i and dO_i with their L_i and D_i (br floats each); br = q_tile_rows."""
    br = q_tile_rows(version, D)
    if version == "wgmma":
        return 6 * 64 * D * 2 + 64 * br * 2 + 1024
    return 2 * 128 * D * 2 + 128 * br * 2 + br * D * 4 + STAGES * (2 * br * D * 2 + 2 * br * 4) + 1024


def pre_launch(ctype, *, Nq, ldq, Nq_pad, D, BH, zero, counters=0):
    """Stage 03's preprocess (Alg.2 L4) of rows 0..Nq-1 of every head, ldq rows a head apart from the pointers to o,
    do, lse it is given: D_i = rowsum(dO_i * O_i) into delta, L_i into lse_pad (+inf for a fully masked row, and for
    the padding up to Nq_pad), and, where zero, the float32 dQ accumulator and the first `counters` block counters
    zeroed (a ring block has no accumulator of its own). Arguments of a call: o, do, lse, delta, lse_pad, the dQ
    accumulator (or 0), the counters (or 0): the leading arrays of stage 03's BwdParams, which the kernel takes."""
    return kernels.Launch(pre_function("bwd_preprocess", ctype), (Nq_pad * D // 2048, BH), (256,), 0,
                          BwdParams(Nq=Nq, ldq=ldq, Nq_pad=Nq_pad, head_dim=D, zero_dq=int(zero), n_done=counters))


@functools.lru_cache(maxsize=None)
def pre_function(kernel, ctype):
    """Stage 03's preprocess or dQ conversion for ctype, from the module stage 03 compiles (one compile for both)."""
    return load_module(PRE_FILE, name_expressions=stage03.PRE_NAMES).get_function(f"{kernel}<{ctype}>")


def convert_launch(ctype, n):
    """Stage 03's dQ conversion of the n = B H Nq D values of the float32 accumulator into dQ in the inputs' type
    (ctype), 4 values a step (n is a multiple: D is), scale 1 (the main kernels add scale dS K). Arguments of a call:
    the accumulator, dq."""
    return kernels.Launch(pre_function("bwd_convert_dq", ctype), (min(-(-n // 1024), 65535),), (256,), 0,
                          (np.float32(1.0), np.int64(n)))
