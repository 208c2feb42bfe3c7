"""Stage 03's kernel configurations: what the launcher (flash_v2_backward.py) picks from and compiles.

    VERSIONS, HEAD_DIMS, DTYPES, FILES    the versions, what each takes, and its kernels/ files
    resolve_version, auto_takes_fp32x3    which version runs a dtype; check_tc_config: a tuning run's tc_config
    TcTiles, TC_CANDIDATES, TC_*          the tc kernel's tiles per head dim and its tuning choices
    Fp32x3Tiles, FP32X3_CANDIDATES        version fp32x3's
    smem_bytes, fp32x3_smem               the shared memory each needs (the kernels' layout comments, added up)
    tc_tiles, fp32x3_tiles, reachable_tc  the first configuration that fits a device
    kernel_names, PRE_NAMES               the template instantiations of a configuration
    kernel_plans, kernel_sources          every instantiation a device may launch (CI compiles them all)

The tc kernel's template (kernels/flash_v2_backward_tc.cu) takes its tiles as one BwdTiles type, as the pipelined
forward takes FwdTiles, and the variants as the forward's hook types (kernels/variants.cuh).
"""
from typing import NamedTuple

import numpy as np

from stages.common import bfloat16, device

from . import mirror

VERSIONS = ("fp32", "tc", "fp32x3")
HEAD_DIMS = {"fp32": (32, 64, 128), "tc": (64, 128, 256), "fp32x3": (32, 64, 128)}
DTYPES = {"fp32": (np.dtype(np.float32),), "tc": (np.dtype(np.float16), bfloat16), "fp32x3": (np.dtype(np.float32),)}
PAD = 128  # L_i and D_i are padded to a multiple of 128 rows (>= every Br) so tile loads never run past them
# kernels/ files of each version: (its main kernels, its deterministic dQ pass)
FILES = {"fp32": ("flash_v2_backward_fp32.cu", "flash_v2_backward_fp32.cu"),
         "tc": ("flash_v2_backward_tc.cu", "flash_v2_backward_dq.cu"),
         "fp32x3": ("flash_v2_backward_fp32x3.cu", None)}  # atomic dQ only: deterministic=True is version fp32's
PRE_FILE = "flash_v2_backward_pre.cu"  # the preprocess and the dQ conversion, shared by every version (and stage 06)

TC_BR, TC_BC = mirror.TC_BR, mirror.TC_BC  # Br, Bc of the tc kernel per head dim (Bc / 16 warps): the mirror's tiles
# The tc kernel's atomic dQ for Q tile i runs one tile late, at the end of the next tile (one barrier per tile
# instead of two; dS^T double-buffered). False: right after tile i, behind a second barrier (tc_config=
# {"defer_dq": False}; dev/sweep_backward.py compares).
TC_DEFER_DQ = True
# Per head dim: m-tiles (16 rows) of dQ_i per warp in the tc kernel's dQ step (2: 32 x 32 tiles at both head dims),
# and whether each warp keeps its K_j, V_j A fragments in registers (KREG) instead of reloading them from shared
# memory per 64-row Q chunk (d=64 only: at d=128 the 64 extra registers do not fit beside the accumulators).
# d = 256 splits the head dim in two halves, one per block (TC_PARTS): each block's dK_j, dV_j half is 128
# registers a thread, so its S^T, dP^T chunks are 32 query rows.
TC_DQ_MT = {64: 2, 128: 2, 256: 1}
TC_KREG = {64: True, 128: False, 256: False}
TC_CHUNK = {64: 64, 128: 64, 256: 32}  # query rows per chunk (BRC) of a Q tile: S^T, dP^T of one chunk in registers
TC_PARTS = {64: 1, 128: 1, 256: 2}  # blocks per K/V tile, each with HD / parts columns of dK_j, dV_j, dQ_i (grid.z)
# Block order of the tc main kernel. j_fast: K/V tile index fastest, grid (Tc, BH): the blocks in flight are the
# K/V tiles of a few heads, which stream the same Q_i, dO_i and add to the same dQ_i (L2 hits). Otherwise grid
# (BH, Tc), every head's j = 0 block first: under causal those have the most Q tiles, so the long blocks start
# first and the short ones fill the tail. Non-causal blocks are all alike: j_fast. Causal: j_fast up to
# TC_CAUSAL_J_FAST_NK keys per head, the longest blocks first above (results/sweep_block_order_h100.csv compares
# the two orders; tc_config={"j_fast": ...} picks one).
TC_CAUSAL_J_FAST_NK = 2048
# Who writes dQ = scale * dQ_accum in the tc kernel's atomic mode. Fused: each head's last block to finish (a counter
# per head) converts the head's Nq x d accumulator, so the backward is two launches, not three: one launch less of
# host time per call, and no pass over the whole accumulator after the grid. But that block converts alone, on one
# SM: a long head's conversion outlasts the other blocks' work at the end of the grid (most of all under a sliding
# window, which leaves each head little work). Unfused: bwd_convert_dq, a third launch over the whole GPU. Fused up
# to TC_FUSE_DQ_MAX accumulator elements per head, N = 2048 at d = 128 (results/sweep_fuse_dq_h100.csv compares
# the two; tc_config={"fuse_dq": ...} picks one).
TC_FUSE_DQ_MAX = 2048 * 128
TC_CONFIG_KEYS = ("br", "bc", "wq", "defer_dq", "j_fast", "fuse_dq")  # backward's tc_config (tuning runs)


def resolve_version(version, dtype):
    """'auto' -> 'fp32' for float32, 'tc' for float16/bfloat16; otherwise check the name and dtype."""
    dtype = np.dtype(dtype)
    if version == "auto":
        for name, dts in DTYPES.items():
            if dtype in dts:
                return name
        raise TypeError(f"flash_v2_backward: dtype {dtype} is not supported; use float32 (version fp32) or "
                        "float16/bfloat16 (version tc); stage 00 (naive) handles float64")
    if version not in VERSIONS:
        raise ValueError(f"flash_v2_backward: unknown version {version!r}; choose one of {VERSIONS} or 'auto'")
    if dtype not in DTYPES[version]:
        names = ", ".join(d.name for d in DTYPES[version])
        raise TypeError(f"flash_v2_backward: version {version!r} takes {names}, got {dtype}; "
                        "version='auto' picks fp32 for float32 and tc for float16/bfloat16")
    return version


def auto_takes_fp32x3(on_gpu, deterministic, opts, D):
    """Whether version="auto" runs fp32x3 for float32 (resolve_version's fp32 otherwise): on a GPU with TF32 tensor
    cores (sm_80 on; not the CPU mirror), for plain attention at its head dims with the atomic dQ."""
    return (on_gpu and not deterministic and opts is None and D in HEAD_DIMS["fp32x3"]
            and device.tf32_tensor_cores(device.device()))


def check_tc_config(tc_config, version, xp):
    """backward's tc_config (None, or a dict of TC_CONFIG_KEYS) for version on arrays of module xp: a ValueError
    naming what it takes."""
    if tc_config is None:
        return
    if version != "tc" or xp is np or set(tc_config) - set(TC_CONFIG_KEYS):
        raise ValueError(f"flash_v2_backward: tc_config={tc_config!r} takes the keys {', '.join(TC_CONFIG_KEYS)} and "
                         f"applies to version 'tc' on CuPy arrays; got version {version!r} on {xp.__name__} arrays")
    if any(not isinstance(tc_config.get(x, False), (bool, np.bool_)) for x in ("defer_dq", "j_fast", "fuse_dq")):
        raise ValueError(f"flash_v2_backward: tc_config={tc_config!r}: defer_dq, j_fast and fuse_dq must be True or "
                         "False")


def j_fast_order(causal, nk):
    """Whether the tc kernel's grid runs K/V tiles fastest (see TC_CAUSAL_J_FAST_NK) for nk keys per head."""
    return not causal or nk <= TC_CAUSAL_J_FAST_NK


def fuse_dq_rule(nq, d):
    """Whether the tc kernel converts dQ itself (see TC_FUSE_DQ_MAX) for nq query rows per head of head dim d."""
    return nq * d <= TC_FUSE_DQ_MAX


class TcTiles(NamedTuple):
    """The tc kernel's configuration: Br query rows per Q tile, Bc key rows per block (Bc / 16 warps), and the warp
    layout wq. wq = 1: each warp owns 16 key rows for all four matmuls of a tile pair; P^T and dS^T stay in registers.
    wq = 2: each pair of warps owns 32 key rows; the two split the queries of S^T, dP^T and then the columns of dK_j,
    dV_j, so P^T and dS^T go through shared memory (Bc x (Br + 8) 16-bit more), and each warp reads half of Q_i and
    dO_i for S^T, dP^T and half of their columns for dK_j, dV_j: fewer shared-memory bytes per mma."""
    br: int
    bc: int
    wq: int


# The tc kernel's tiles per head dim, first choice first (TC_BR[D], TC_BC[D]); the later ones are for GPUs with less
# shared memory (smem_bytes gives each need; device.pick takes the first that fits): the first choices at d = 64 and
# 128 need an sm_90's shared memory, the second ones fit an A100's, Bc = 64 (4 warps) the 99 KB of an RTX 3090 / 4090,
# and the last ones a T4's 64 KB (which has no room for d = 256). Each list is in the order of speed on the H100
# (results/sweep_backward_layout_h100.csv, from dev/sweep_backward.py). The pair layout (wq = 2) comes first only at
# d = 128 with Br = 64: at d = 64 each warp's K_j, V_j fragments already stay in registers (KREG), so S^T reads only
# Q_i and the pairs' round trip of P^T, dS^T costs more than it saves.
TC_CANDIDATES = {64: [TcTiles(128, 128, 1), TcTiles(64, 128, 1), TcTiles(64, 64, 1), TcTiles(32, 64, 1)],
                 128: [TcTiles(64, 128, 2), TcTiles(64, 128, 1), TcTiles(32, 128, 1), TcTiles(32, 64, 1),
                       TcTiles(16, 64, 1)],
                 256: [TcTiles(64, 64, 1), TcTiles(32, 64, 1), TcTiles(16, 32, 1)]}


def tiles_error(D, br, bc, wq):
    """Why the tc kernel cannot take tiles (Br, Bc, wq) at head dim D, or None: Br a multiple of 16 up to PAD
    rows, Bc of 16 wq (a whole number of warp groups), wq 1 or 2, and with wq = 2 each warp's half of a query chunk
    (min(Br, TC_CHUNK[D]) rows) whole 16-row m-tiles."""
    if wq not in (1, 2):
        return f"wq must be 1 or 2, got {wq!r}"
    if br % 16 or not 16 <= br <= PAD or bc % (16 * wq) or bc < 16 * wq:
        return f"Br must be a multiple of 16 up to {PAD} and Bc of {16 * wq} (wq={wq}), got Br={br}, Bc={bc}"
    if min(TC_CHUNK[D], br) % (16 * wq):
        return f"wq=2 at d={D} needs min(Br, {TC_CHUNK[D]}) to be a multiple of 32, got Br={br}"
    return None


def tc_config_tiles(D, dev, tc_config):
    """(Br, Bc, wq) of the tc kernel at head dim D on dev: tc_config's (a dict of TC_CONFIG_KEYS; a missing Br or Bc:
    TC_BR[D], TC_BC[D]; wq: 1) or, with neither Br nor Bc in it, the device's TcTiles (wq from tc_config if there).
    A ValueError names what is wrong with tiles the kernel does not take."""
    br, bc, wq = tc_config.get("br"), tc_config.get("bc"), tc_config.get("wq")
    if br is None and bc is None:
        t = tc_tiles(D, dev)
        br, bc, wq = t.br, t.bc, t.wq if wq is None else wq
    br, bc, wq = br or TC_BR[D], bc or TC_BC[D], 1 if wq is None else wq
    if tc_config and (why := tiles_error(D, br, bc, wq)):
        raise ValueError(f"flash_v2_backward: tc_config={tc_config!r} at head_dim {D}: {why}")
    return br, bc, wq


def check_fits(dev, version, D, smem_main, smem_dq):
    """device.UnsupportedDevice, with what to use instead, where the main kernel's shared memory (smem_main bytes) or
    the deterministic dQ pass's (smem_dq; 0 without it) is more than dev gives a block."""
    for what, need in (("", smem_main), (" with deterministic=True (its dQ pass)", smem_dq)):
        if not device.fits(dev, need):
            raise device.UnsupportedDevice(
                f"flash_v2_backward version {version!r} d={D}{what} needs {need // 1024} KB of shared memory per "
                f"block; {dev.name} ({dev.arch.name}) allows {dev.smem_optin // 1024} KB"
                + ("; use deterministic=False" if what else "; use head_dim 64 or less, or stage 00"))


def tc_tiles(D, dev=None):
    """TcTiles of the tc kernel at head dim D on device dev (None: the first candidate)."""
    cands = TC_CANDIDATES[D]
    if dev is None:
        return cands[0]
    return device.pick(cands, lambda c: smem_bytes("tc", D, *c)[0], dev, what=f"flash_v2_backward version 'tc' d={D}")


def reachable_tc(D, dev):
    """True when some tc tiles at head dim D fit dev's shared memory."""
    return any(device.fits(dev, smem_bytes("tc", D, *c)[0]) for c in TC_CANDIDATES[D])


class Fp32x3Tiles(NamedTuple):
    """Version fp32x3's configuration: nw warps of 16 key rows each (Bc = 16 nw keys per block), Br query rows per
    Q tile (one buffer of Q_i, dO_i: tile i+1 loads during tile i's dQ step) and minb, the blocks per SM the
    registers must allow."""
    nw: int
    br: int
    minb: int

    @property
    def bc(self):
        return 16 * self.nw

    @property
    def threads(self):
        return 32 * self.nw


# Version fp32x3's configurations per head dim, first choice first; the later ones are for GPUs with less shared
# memory (fp32x3_smem gives each need). Four warps with registers for two blocks per SM, and the largest Br two
# blocks' shared memory holds with one buffer of Q_i, dO_i (64 at d <= 64, 32 at d = 128): each split of P^T, dS^T
# then serves Br / 8 k steps of dV_j, dK_j, where a second buffer would halve Br to overlap the copies.
FP32X3_CANDIDATES = {32: [Fp32x3Tiles(4, 64, 2)],
                     64: [Fp32x3Tiles(4, 64, 2), Fp32x3Tiles(4, 32, 2), Fp32x3Tiles(4, 16, 2)],
                     128: [Fp32x3Tiles(4, 32, 2), Fp32x3Tiles(4, 16, 2)]}


def fp32x3_smem(D, cfg):
    """Version fp32x3's dynamic shared memory (bytes): K_j, V_j [Bc][D+4], Q_i, dO_i [Br][D+4], dS^T [Bc][Br+4],
    L_i, D_i [Br] floats, as in the kernel's layout comment."""
    rows = 2 * cfg.bc * (D + 4) + 2 * cfg.br * (D + 4)  # K_j, V_j; Q_i, dO_i
    return 4 * (rows + cfg.bc * (cfg.br + 4) + 2 * cfg.br)


def fp32x3_tiles(D, dev=None):
    """Fp32x3Tiles at head dim D on device dev (None: the first candidate)."""
    cands = FP32X3_CANDIDATES[D]
    if dev is None:
        return cands[0]
    return device.pick(cands, lambda c: fp32x3_smem(D, c), dev, what=f"flash_v2_backward version 'fp32x3' d={D}")


def fp32x3_name(D, cfg):
    """The template instantiation of version fp32x3 at head dim D."""
    return f"flash_bwd_fp32x3<{D},{cfg.nw},{cfg.br},{cfg.minb}>"


def _dq_mt(D, br, bc):
    """TC_DQ_MT[D] where the Bc / 16 warps can split dQ_i (Br x D) into tiles of 16 MT rows and a multiple of 16
    columns (tc_config may set other Br, Bc); 1 otherwise."""
    mt, nw = TC_DQ_MT[D], bc // 16
    rg = br // (16 * mt)
    ok = rg >= 1 and br % (16 * mt) == 0 and nw % rg == 0 and (D // TC_PARTS[D] // (nw // rg)) % 16 == 0
    return mt if ok else 1


def _cpp(flag):
    return "true" if flag else "false"


def kernel_names(version, ctype, D, defer=None, otype=None, br=None, bc=None, wq=None, var=False, drop=False):
    """Template instantiations of one (version, input type, head dim, output type): compiled together, once.
    [atomic main kernel, deterministic main kernel, deterministic dQ pass]. otype: the gradients' type (the
    input type, or float for a ring block's unrounded partial gradients). var (tc, atomic only): the variants'
    hooks (a window, packed batches, grouped-query k, v, softcap and ALiBi); their dK, dV are float (summed over a kv
    group, then cast), dQ is otype; drop (with var): dropout's hook too. The tc kernel's template:
    flash_v2_backward_tc<T, TO (dK, dV), TQ (dQ), BwdTiles<HD, Br, Bc, BRC, WQ, KREG, DQ_MT, DEFER_DQ>, DQ_ATOMIC,
    Mask, Score, Drop>."""
    if version == "fp32":
        return [f"flash_bwd_fp32<{D},true>", f"flash_bwd_fp32<{D},false>", f"flash_bwd_dq_fp32<{D}>"]
    wq = wq or (tc_tiles(D).wq if br is None and bc is None else 1)
    br, bc = br or TC_BR[D], bc or TC_BC[D]
    defer = TC_DEFER_DQ if defer is None else defer
    tiles = (f"BwdTiles<{D},{br},{bc},{min(TC_CHUNK[D], br)},{wq},{_cpp(TC_KREG[D])},{_dq_mt(D, br, bc)},"
             f"{_cpp(defer)}>")
    ot = otype or ctype  # dQ's type; dK, dV's too, but float with var
    if var:
        hooks = f"WindowMask,ModScore,{'PhiloxDropout' if drop else 'NoDropout'}"
        return [f"flash_v2_backward_tc<{ctype},float,{ot},{tiles},true,{hooks}>"]
    plain = "CausalMask,PlainScore,NoDropout"
    return [f"flash_v2_backward_tc<{ctype},{ot},{ot},{tiles},true,{plain}>",
            f"flash_v2_backward_tc<{ctype},{ot},{ot},{tiles},false,{plain}>",
            f"flash_v2_backward_dq_tc<{ctype},{ot},{D}>"]


PRE_NAMES = [f"{k}<{c}>" for k in ("bwd_preprocess", "bwd_convert_dq") for c in ("float", "__half", "__nv_bfloat16")]


def smem_bytes(version, D, br=None, bc=None, wq=1):
    """Dynamic shared memory of (main kernel, dQ kernel): the same sums as the kernels' layout comments."""
    if version == "fp32":
        br = bc = 32
        main = 2 * bc * (D + 1) + 2 * br * (D + 1) + 2 * bc * (br + 1) + 2 * br
        dq = 2 * bc * (D + 1) + 2 * br * (D + 1) + br * (bc + 1) + 2 * br
        return 4 * main, 4 * dq
    br, bc = br or TC_BR[D], bc or TC_BC[D]
    main = 2 * (2 * bc * (D + 8) + 2 * 2 * br * (D + 8) + (3 if wq > 1 else 2) * bc * (br + 8)) + 4 * 2 * 2 * br
    dq_bc = 32 if D > 128 else 64  # the dQ pass's K/V tile (dq_bc in the kernel)
    dq = 2 * (2 * 64 * (D + 8) + 2 * 2 * dq_bc * (D + 8))
    return main, dq


def kernel_plans(dev):
    """[device.KernelPlan] of every kernel this stage may launch on dev (the tc kernels at dev's (Br, Bc); the
    deterministic dQ pass and the fp32 kernels where their shared memory fits)."""
    out = [device.KernelPlan(PRE_FILE, {}, n, 0, 0, 256) for n in PRE_NAMES]
    for D in HEAD_DIMS["fp32"]:
        main, dq = smem_bytes("fp32", D)
        names = kernel_names("fp32", "float", D)
        out += [device.KernelPlan(FILES["fp32"][0], {}, n, sm, 0, 256)
                for n, sm in zip(names, (main, main, dq)) if device.fits(dev, sm)]
    if device.tf32_tensor_cores(dev):  # version fp32x3
        for D in HEAD_DIMS["fp32x3"]:
            cfg = fp32x3_tiles(D, dev)
            out.append(device.KernelPlan(FILES["fp32x3"][0], {}, fp32x3_name(D, cfg), fp32x3_smem(D, cfg), 0,
                                         cfg.threads))
    for D in HEAD_DIMS["tc"]:
        if not reachable_tc(D, dev):
            continue
        br, bc, wq = tc_tiles(D, dev)
        main, dq = smem_bytes("tc", D, br, bc, wq)
        for ctype in ("__half", "__nv_bfloat16") if dev.arch.bf16 else ("__half",):
            for otype in (ctype, "float"):
                names = kernel_names("tc", ctype, D, otype=otype, br=br, bc=bc, wq=wq)
                files = (FILES["tc"][0], FILES["tc"][0], FILES["tc"][1])  # the main kernels', the dQ pass's
                out += [device.KernelPlan(f, {}, n, sm, 0, th) for f, n, sm, th in
                        zip(files, names, (main, main, dq), (2 * bc, 2 * bc, 128)) if device.fits(dev, sm)]
            if device.fits(dev, main):  # the variants' atomic main kernels (float dK, dV), without and with dropout
                var_names = [kernel_names("tc", ctype, D, br=br, bc=bc, wq=wq, var=True, drop=drop)[0]
                             for drop in (0, 1)]
                out += [device.KernelPlan(FILES["tc"][0], {}, n, main, 0, 2 * bc) for n in var_names]
    return out


def kernel_sources():
    """(file, name expressions) of every kernel this stage may launch on any architecture (both orders of the
    atomic dQ for the first configurations, so the sweep's alternative compiles too)."""
    plans = {p for a in device.ARCHS for p in kernel_plans(device.emulate(a))}
    out = {}
    for p in sorted(plans, key=lambda p: (p.file, p.name)):
        out.setdefault(p.file, []).append(p.name)
    for D in HEAD_DIMS["tc"]:
        for ctype in ("__half", "__nv_bfloat16"):
            out[FILES["tc"][0]].append(kernel_names("tc", ctype, D, defer=False)[0])
    return list(out.items())
