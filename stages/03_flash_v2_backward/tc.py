"""Stage 03, version "tc" of the FlashAttention-2 backward (arXiv 2307.08691, Algorithm 2): float16 / bfloat16 on
mma.sync tensor cores, head dims 64, 128, 256. Its launcher, called by flash_v2_backward.backward once it has checked
the inputs, and the ring's block call:

    dq, dk, dv = backward_tc(q, k, v, o, lse, do, causal=causal, scale=scale)      # CuPy (B, H, N, D)
    accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, causal=causal, scale=scale)

Launches, in order: the preprocess (kernels/flash_v2_backward_pre.cu, as version fp32's: D_i, L_i; it zeroes the
dQ accumulator and one block counter per head), the main kernel (kernels/flash_v2_backward_tc.cu: dK_j, dV_j, and
dQ_i added atomically; on short heads the head's last block to finish converts dQ itself: fuse_dq_rule), then the
dQ conversion on long heads, or with deterministic=True the dQ pass instead (kernels/flash_v2_backward_dq.cu: dQ_i
summed in a fixed order, no atomics). The variants (window, softcap, ALiBi, dropout, grouped-query k, v, packed
batches) are the forward's hook types (kernels/variants.cuh). The kernel's template takes its tiles as one BwdTiles
type, as the pipelined forward takes FwdTiles. Why these tiles: the stage README's "How the tensor-core kernel is laid
out"; the tables below say what each choice is.
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import bfloat16, device, fast_path, load_module, variants
from stages.common.kernels import function
from stages.common.launch import NULL, BackwardLaunch, Launch, run_backward
from stages.common.params import BwdParams

from .fp32 import PAD, PRE_FILE, PRE_NAMES  # the preprocess and the dQ conversion every version launches
from .mirror import TC_BC, TC_BR  # Br, Bc of the first tiles per head dim (Bc / 16 warps): the mirror's tiles

HEAD_DIMS = (64, 128, 256)
DTYPES = (np.dtype(np.float16), bfloat16)
FILE, DQ_FILE = "flash_v2_backward_tc.cu", "flash_v2_backward_dq.cu"  # the main kernels; the deterministic dQ pass
F32 = np.dtype(np.float32)
CTYPE = {np.dtype(np.float16): "__half", bfloat16: "__nv_bfloat16", F32: "float"}  # float: the ring's float32 gradients

# The atomic dQ for Q tile i runs one tile late, at the end of the next tile (one barrier per tile instead of two;
# dS^T double-buffered). False: right after tile i, behind a second barrier (tc_config={"defer_dq": False};
# dev/sweep_backward.py compares).
TC_DEFER_DQ = True
# Per head dim: m-tiles (16 rows) of dQ_i per warp in the dQ step (2: 32 x 32 tiles at both head dims), and whether
# each warp keeps its K_j, V_j A fragments in registers (KREG) instead of reloading them from shared memory per 64-row
# Q chunk (d=64 only: at d=128 the 64 extra registers do not fit beside the accumulators). d = 256 splits the head dim
# in two halves, one per block (TC_PARTS): each block's dK_j, dV_j half is 128 registers a thread, so its S^T, dP^T
# chunks are 32 query rows.
TC_DQ_MT = {64: 2, 128: 2, 256: 1}
TC_KREG = {64: True, 128: False, 256: False}
TC_CHUNK = {64: 64, 128: 64, 256: 32}  # query rows per chunk (BRC) of a Q tile: S^T, dP^T of one chunk in registers
TC_PARTS = {64: 1, 128: 1, 256: 2}  # blocks per K/V tile, each with HD / parts columns of dK_j, dV_j, dQ_i (grid.z)
# Block order. j_fast: K/V tile index fastest, grid (Tc, BH): the blocks in flight are the K/V tiles of a few heads,
# which stream the same Q_i, dO_i and add to the same dQ_i (L2 hits). Otherwise grid (BH, Tc), every head's j = 0
# block first: under causal those have the most Q tiles, so the long blocks start first and the short ones fill the
# tail. Non-causal blocks are all alike: j_fast. Causal: j_fast up to TC_CAUSAL_J_FAST_NK keys per head, the longest
# blocks first above (results/sweep_block_order_h100.csv compares the two orders; tc_config={"j_fast": ...} picks one).
TC_CAUSAL_J_FAST_NK = 2048
# Who writes dQ = scale * dQ_accum in the atomic mode. Fused: each head's last block to finish (a counter per head)
# converts the head's Nq x d accumulator, so the backward is two launches, not three: one launch less of host time
# per call, and no pass over the whole accumulator after the grid. But that block converts alone, on one SM: a long
# head's conversion outlasts the other blocks' work at the end of the grid (most of all under a sliding window, which
# leaves each head little work). Unfused: bwd_convert_dq, a third launch over the whole GPU. Fused up to
# TC_FUSE_DQ_MAX accumulator elements per head, N = 2048 at d = 128 (results/sweep_fuse_dq_h100.csv compares the two;
# tc_config={"fuse_dq": ...} picks one).
TC_FUSE_DQ_MAX = 2048 * 128
TC_CONFIG_KEYS = ("br", "bc", "wq", "defer_dq", "j_fast", "fuse_dq")  # backward's tc_config (tuning runs)


class TcTiles(NamedTuple):
    """The kernel's tiles: Br query rows per Q tile, Bc key rows per block (Bc / 16 warps), and the warp layout wq.
    wq = 1: each warp owns 16 key rows for all four matmuls of a tile pair; P^T and dS^T stay in registers. wq = 2:
    each pair of warps owns 32 key rows; the two split the queries of S^T, dP^T and then the columns of dK_j, dV_j, so
    P^T and dS^T go through shared memory (Bc x (Br + 8) 16-bit more), and each warp reads half of Q_i and dO_i for
    S^T, dP^T and half of their columns for dK_j, dV_j: fewer shared-memory bytes per mma."""
    br: int
    bc: int
    wq: int


# The tiles per head dim, first choice first (TC_BR[D], TC_BC[D]); the later ones are for GPUs with less shared
# memory (smem_bytes gives each need; device.pick takes the first that fits): the first choices at d = 64 and 128 need
# an sm_90's shared memory, the second ones fit an A100's, Bc = 64 (4 warps) the 99 KB of an RTX 3090 / 4090, and the
# last ones a T4's 64 KB (which has no room for d = 256). Each list is in the order of speed on the H100
# (results/sweep_backward_layout_h100.csv, from dev/sweep_backward.py). The pair layout (wq = 2) comes first only at
# d = 128 with Br = 64: at d = 64 each warp's K_j, V_j fragments already stay in registers (KREG), so S^T reads only
# Q_i and the pairs' round trip of P^T, dS^T costs more than it saves.
TC_CANDIDATES = {64: [TcTiles(128, 128, 1), TcTiles(64, 128, 1), TcTiles(64, 64, 1), TcTiles(32, 64, 1)],
                 128: [TcTiles(64, 128, 2), TcTiles(64, 128, 1), TcTiles(32, 128, 1), TcTiles(32, 64, 1),
                       TcTiles(16, 64, 1)],
                 256: [TcTiles(64, 64, 1), TcTiles(32, 64, 1), TcTiles(16, 32, 1)]}


def smem_bytes(D, br=None, bc=None, wq=1):
    """Dynamic shared memory of (main kernel, deterministic dQ pass), as the kernels' layout comments add it up."""
    br, bc = br or TC_BR[D], bc or TC_BC[D]
    main = 2 * (2 * bc * (D + 8) + 2 * 2 * br * (D + 8) + (3 if wq > 1 else 2) * bc * (br + 8)) + 4 * 2 * 2 * br
    dq_bc = 32 if D > 128 else 64  # the dQ pass's K/V tile (dq_bc in the kernel)
    return main, 2 * (2 * 64 * (D + 8) + 2 * 2 * dq_bc * (D + 8))


def tc_tiles(D, dev=None):
    """TcTiles at head dim D on device dev (None: the first candidate)."""
    cands = TC_CANDIDATES[D]
    return cands[0] if dev is None else device.pick(cands, lambda c: smem_bytes(D, *c)[0], dev,
                                                    what=f"flash_v2_backward version 'tc' d={D}")


def tiles_error(D, br, bc, wq):
    """Why the kernel cannot take tiles (Br, Bc, wq) at head dim D, or None: Br a multiple of 16 dividing PAD, Bc of
    16 wq (a whole number of warp groups), wq 1 or 2, and with wq = 2 each warp's half of a query chunk (min(Br,
    TC_CHUNK[D]) rows) whole 16-row m-tiles."""
    if wq not in (1, 2):
        return f"wq must be 1 or 2, got {wq!r}"
    if br % 16 or not 16 <= br <= PAD or PAD % br or bc % (16 * wq) or bc < 16 * wq:
        return (f"Br must be a multiple of 16 dividing {PAD} (L_i, D_i are read in 16-byte pieces up to the padding) "
                f"and Bc of {16 * wq} (wq={wq}), got Br={br}, Bc={bc}")
    if min(TC_CHUNK[D], br) % (16 * wq):
        return f"wq=2 at d={D} needs min(Br, {TC_CHUNK[D]}) to be a multiple of 32, got Br={br}"
    return None


def check_tc_config(tc_config, version, xp):
    """backward's tc_config (a dict of TC_CONFIG_KEYS) for version on arrays of module xp: a ValueError naming what
    it takes."""
    if version != "tc" or xp is np or set(tc_config) - set(TC_CONFIG_KEYS):
        raise ValueError(f"flash_v2_backward: tc_config={tc_config!r} takes the keys {', '.join(TC_CONFIG_KEYS)} and "
                         f"applies to version 'tc' on CuPy arrays; got version {version!r} on {xp.__name__} arrays")
    if any(not isinstance(tc_config.get(x, False), (bool, np.bool_)) for x in ("defer_dq", "j_fast", "fuse_dq")):
        raise ValueError(f"flash_v2_backward: tc_config={tc_config!r}: defer_dq, j_fast and fuse_dq must be True or "
                         "False")


def tc_config_tiles(D, dev, tc_config):
    """(Br, Bc, wq) at head dim D on dev: tc_config's (a missing Br or Bc: TC_BR[D], TC_BC[D]; wq: 1) or, with neither
    Br nor Bc in it, the device's TcTiles (wq from tc_config if there). A ValueError names what is wrong with tiles the
    kernel does not take."""
    br, bc, wq = tc_config.get("br"), tc_config.get("bc"), tc_config.get("wq")
    if br is None and bc is None:
        t = tc_tiles(D, dev)
        br, bc, wq = t.br, t.bc, t.wq if wq is None else wq
    br, bc, wq = br or TC_BR[D], bc or TC_BC[D], 1 if wq is None else wq
    if tc_config and (why := tiles_error(D, br, bc, wq)):
        raise ValueError(f"flash_v2_backward: tc_config={tc_config!r} at head_dim {D}: {why}")
    return br, bc, wq


def j_fast_order(causal, nk):
    """Whether the grid runs K/V tiles fastest (see TC_CAUSAL_J_FAST_NK) for nk keys per head."""
    return not causal or nk <= TC_CAUSAL_J_FAST_NK


def fuse_dq_rule(nq, d):
    """Whether the kernel converts dQ itself (see TC_FUSE_DQ_MAX) for nq query rows per head of head dim d."""
    return nq * d <= TC_FUSE_DQ_MAX


def _dq_mt(D, br, bc):
    """TC_DQ_MT[D] where the Bc / 16 warps can split dQ_i (Br x D) into tiles of 16 MT rows and a multiple of 16
    columns (tc_config may set other Br, Bc); 1 otherwise."""
    mt, nw = TC_DQ_MT[D], bc // 16
    rg = br // (16 * mt)
    ok = rg >= 1 and br % (16 * mt) == 0 and nw % rg == 0 and (D // TC_PARTS[D] // (nw // rg)) % 16 == 0
    return mt if ok else 1


def _cpp(flag):
    return "true" if flag else "false"


def kernel_names(ctype, D, defer=None, otype=None, br=None, bc=None, wq=None, var=False, drop=False):
    """The template instantiations of one (input type, head dim, output type), compiled together, once: [atomic main
    kernel, deterministic main kernel, deterministic dQ pass]. otype: the gradients' type (the input type, or float
    for a ring block's unrounded partial gradients). var (atomic only): [the main kernel with the variants' hooks (a
    window, packed batches, grouped-query k, v, softcap and ALiBi)]: its dK, dV are float (summed over a kv group,
    then cast), dQ is otype; drop (with var): dropout's hook too. The template: flash_v2_backward_tc<T, TO (dK, dV),
    TQ (dQ), BwdTiles<HD, Br, Bc, BRC, WQ, KREG, DQ_MT, DEFER_DQ>, DQ_ATOMIC, Mask, Score, Drop>."""
    wq = wq or (tc_tiles(D).wq if br is None and bc is None else 1)
    br, bc = br or TC_BR[D], bc or TC_BC[D]
    defer = TC_DEFER_DQ if defer is None else defer
    tiles = f"BwdTiles<{D},{br},{bc},{min(TC_CHUNK[D], br)},{wq},{_cpp(TC_KREG[D])},{_dq_mt(D, br, bc)},{_cpp(defer)}>"
    ot = otype or ctype  # dQ's type; dK, dV's too, but float with var
    if var:
        return [f"flash_v2_backward_tc<{ctype},float,{ot},{tiles},true,WindowMask,ModScore,"
                f"{'PhiloxDropout' if drop else 'NoDropout'}>"]
    plain = "CausalMask,PlainScore,NoDropout"
    return [f"flash_v2_backward_tc<{ctype},{ot},{ot},{tiles},true,{plain}>",
            f"flash_v2_backward_tc<{ctype},{ot},{ot},{tiles},false,{plain}>",
            f"flash_v2_backward_dq_tc<{ctype},{ot},{D}>"]


def backward_tc(q, k, v, o, lse, do, *, causal, scale, deterministic=False, out_dtype=None, config=None, opts=None,
                varlen=None, profile=None):
    """Version tc on CuPy float16 / bfloat16 arrays checked by flash_v2_backward.backward: dq, dk, dv in out_dtype
    (None: q's dtype; float32: straight from the float32 accumulators). config: backward's tc_config (tuning runs),
    or None; opts: variants.Options, or None for plain attention; varlen: (cu_q, cu_k, longest key sequence) of a
    packed batch laid out head by head ((1, H, total, D)), or None; profile: a list that receives (name,
    cupy.cuda.Event) around the launches (dev/sweep_backward.py), or None."""
    B, H, Nq, D = q.shape
    packed = None if varlen is None else (varlen[0].size - 1, int(varlen[2]))  # (sequences, longest key sequence)
    plan = launches(q.dtype, np.dtype(out_dtype or q.dtype), B, H, Nq, k.shape[2], D, causal, scale, device.device(),
                    deterministic=deterministic, config=config, opts=opts, packed=packed)
    extra = () if opts is None else (_slopes(opts, B, H), *((NULL, NULL) if varlen is None else varlen[:2]))
    return run_backward(plan, q, k, v, o, lse, do, *extra, marks=profile)  # dq, dk, dv; the launches


def launches(dtype, odtype, B, H, Nq, Nk, D, causal, scale, dev, *, deterministic=False, config=None, opts=None,
             packed=None, ld=None):
    """The BackwardLaunch of version tc on one problem, everything but its arrays: tiles, compiled kernels, BwdParams,
    grids. packed: (sequences, longest key sequence) of a packed batch (B = 1, Nq and Nk the totals), or None; ld:
    (ldq, ldk), the rows per head of q and of k when the problem is a block of larger arrays (accumulate_into: float32
    gradients added into the ring's accumulators, no dQ accumulator or conversion of its own), or None."""
    device.require(dev, ("bf16",) if dtype == bfloat16 else (), what=f"flash_v2_backward version 'tc' ({dtype})",
                   instead="On this GPU use float16 inputs (version 'tc'), or float32 (version 'fp32')")
    config, var, ctype, otype = config or {}, opts is not None, CTYPE[dtype], CTYPE[odtype]
    br, bc, wq = tc_config_tiles(D, dev, config)  # the named tiles that fit dev (TC_CANDIDATES), or a tuning run's
    smem, smem_dq = smem_bytes(D, br, bc, wq)
    device.require_smem(dev, smem, what=f"flash_v2_backward version 'tc' d={D}", instead="use head_dim 64 or less, "
                        "or stage 00")
    if deterministic:
        device.require_smem(dev, smem_dq, what=f"flash_v2_backward version 'tc' d={D} with deterministic=True (its dQ "
                            "pass)", instead="use deterministic=False")
    names = kernel_names(ctype, D, defer=config.get("defer_dq"), otype=otype, br=br, bc=bc, wq=wq, var=var,
                         drop=var and opts.dropout_p > 0)
    mod = load_module(FILE, name_expressions=names[:2])  # the main kernels, compiled once
    pre_mod = load_module(PRE_FILE, name_expressions=PRE_NAMES)  # the preprocess and the dQ conversion
    # grid: (K/V tile, row of heads) or (row of heads, K/V tile) x TC_PARTS[D]; a packed batch: (sequence, head) x
    # the K/V tiles of its longest sequence (at least one: a sequence without keys still has its dQ = 0 written)
    heads, Tc = (B * H, -(-Nk // bc)) if packed is None else (packed[0] * H, max(1, -(-packed[1] // bc)))
    j_fast = config.get("j_fast", j_fast_order(causal, Nk if packed is None else packed[1])) and heads <= 65535
    own_acc = not deterministic and ld is None  # a dQ accumulator of its own (a ring block adds into the ring's)
    fuse = own_acc and config.get("fuse_dq", fuse_dq_rule(Nq, D))  # the kernel converts dQ (its counters: done)
    Nq_pad = -(-Nq // PAD) * PAD  # D_i, L_i rows a head
    ldq, ldk = ld or (Nq, Nk)
    params = BwdParams(Nq=Nq, Nk=Nk, ldq=ldq, ldk=ldk, Nq_pad=Nq_pad, head_dim=D, scale=scale, causal=int(causal),
                       j_fast=int(j_fast), H=H, zero_dq=int(own_acc), n_done=heads if fuse else 0)
    if var:  # the fields of the variants' hooks (kernels/variants.cuh); plain attention's hooks read none
        _variant_fields(params, opts, Nq, Nk)
    pre = Launch(function(pre_mod, f"bwd_preprocess<{ctype}>", 0), (Nq_pad * D // 2048, B * H), (256,), 0,
                 params.copy())  # D_i = rowsum(dO_i * O_i), L_i; dQ_accum and the counters zeroed
    grid = (Tc, heads, TC_PARTS[D]) if j_fast else (heads, Tc, TC_PARTS[D])
    main = Launch(function(mod, names[1] if deterministic else names[0], smem), grid, (2 * bc,), smem, params.copy())
    dq_pass = convert = None
    if deterministic:  # dQ_i = scale sum_j dS_ij K_j in order, no atomics: one block per (head, 64 rows of Q)
        fn = function(load_module(DQ_FILE, name_expressions=names[2:]), names[2], smem_dq)
        dq_pass = Launch(fn, (B * H, -(-Nq // 64)), (128,), smem_dq, params.copy())
    elif own_acc and not fuse:  # dQ = dQ_accum in the gradients' dtype over the whole GPU (the kernel adds scale dS K)
        n = B * H * Nq * D  # a multiple of 4: the kernel converts 4 values per step
        convert = Launch(function(pre_mod, f"bwd_convert_dq<{otype}>", 0), (min(-(-n // 1024), 65535),), (256,), 0,
                         (np.float32(1.0), np.int64(n)))
    return BackwardLaunch(pre, main, dq_pass, convert, rows=B * H * Nq_pad, acc=B * H * Nq * D if own_acc else 1,
                          done=heads if fuse else 0, odtype=odtype, zero_dkv=odtype == F32 and not deterministic,
                          float_dkv=var)


def _variant_fields(params, opts, Nq, Nk):
    """The hooks' fields: grouped-query heads, the window (WindowMask), softcap, ALiBi's diagonal offset and dropout
    (ModScore, PhiloxDropout)."""
    params.group, params.left, params.right, params.softcap = opts.group, opts.left, opts.right, opts.softcap
    for field, value in {**variants.origin_fields(opts, Nq, Nk), **variants.dropout_fields(opts)}.items():
        setattr(params, field, value)


def _slopes(opts, B, H):
    """ALiBi's slopes as the kernel reads them, one float32 per (batch, head), (B, H) contiguous; NULL without."""
    if opts.alibi_slopes is None:
        return NULL
    import cupy

    return cupy.ascontiguousarray(cupy.broadcast_to(cupy.asarray(opts.alibi_slopes, dtype=cupy.float32), (B, H)))


# The ring (stage 04) calls accumulate_into for the same blocks at every step, so their launches are kept per block
# problem (the speed layer's idea, stages/common/fast_path.py; ALiBi's slopes and dropout's seed come with each call).
_block_launches = functools.lru_cache(maxsize=fast_path.MAX_PLANS)(launches)


def accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, *, causal, scale, opts=None):
    """One block of the ring backward (stage 04), added in place: the gradients of rows a:b of q, o, lse, do
    (B, H, Lq, ...) against keys c:e of k, v (B, Hkv, Lk, D), added into the ring's float32 accumulators: dQ into rows
    a:b of dq_run (B, H, Lq, D) (atomically, as every K/V tile adds to dQ_i), dK, dV into keys c:e of dk_run, dv_run
    (B, Hkv, Lk, D) (red.add in the epilogue). No row is copied: the kernels start at row a and key c and step over
    whole heads by Lq and Lk rows. Two launches: the preprocess (D_i, L_i of rows a:b, in a scratch buffer) and the
    main kernel. CuPy arrays, checked by the caller (the ring's prologue); opts: variants.Options or None."""
    import cupy

    (a, b), (c, e) = rows, keys  # rows a:b of q, keys c:e of k
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    # the launches depend on whether there are slopes and a seed, not on their values (given per call)
    kept_opts = None if opts is None else opts._replace(alibi_slopes=opts.alibi_slopes is not None, seed=0)
    plan = _block_launches(q.dtype, F32, B, H, b - a, e - c, D, bool(causal), scale, device.device(), opts=kept_opts,
                           ld=(Lq, Lk))
    main = plan.main
    if opts is not None and opts.dropout_p:  # the kept launch is made for seed 0: this call's seed
        main = main.with_fields(**variants.seed_fields(opts.seed))
    scratch = cupy.cuda.alloc(4 * 2 * plan.rows)  # D_i and L_i of rows a:b, (B H, Nq_pad) each
    D_i, L_i = scratch.ptr, scratch.ptr + 4 * plan.rows  # D_i = rowsum(dO_i * O_i) (D alone is the head dim)
    at_q, at_k = a * D * q.itemsize, c * D * k.itemsize  # byte offsets of row a, key c in every head
    kv = 4 * c * D  # byte offset of key c in every head of the float32 accumulators
    # BwdParams.ARRAYS: no dQ of its own and no block counters (dQ stays in the ring's accumulator, dq_run)
    arrays = (o.data.ptr + at_q, do.data.ptr + at_q, lse.data.ptr + 4 * a, D_i, L_i, dq_run.data.ptr + 4 * a * D,
              NULL, q.data.ptr + at_q, k.data.ptr + at_k, v.data.ptr + at_k, NULL, dk_run.data.ptr + kv,
              dv_run.data.ptr + kv)
    plan.pre(*arrays)
    main(*arrays, *(() if opts is None else (_slopes(opts, B, H), NULL, NULL)))


def kernel_plans(dev):
    """[device.KernelPlan] of every instantiation this version may launch on dev: dev's tiles, in both output types
    (the inputs', and float: a ring block's), the deterministic dQ pass where it fits, and the variants' main
    kernels (without and with dropout)."""
    out = []
    for D in HEAD_DIMS:
        if not any(device.fits(dev, smem_bytes(D, *c)[0]) for c in TC_CANDIDATES[D]):
            continue
        br, bc, wq = tc_tiles(D, dev)
        main, dq = smem_bytes(D, br, bc, wq)
        for ctype in ("__half", "__nv_bfloat16") if dev.arch.bf16 else ("__half",):
            for otype in (ctype, "float"):
                names = kernel_names(ctype, D, otype=otype, br=br, bc=bc, wq=wq)
                out += [device.KernelPlan(f, {}, n, sm, 0, th) for f, n, sm, th in
                        zip((FILE, FILE, DQ_FILE), names, (main, main, dq), (2 * bc, 2 * bc, 128))
                        if device.fits(dev, sm)]
            if device.fits(dev, main):
                out += [device.KernelPlan(FILE, {}, kernel_names(ctype, D, br=br, bc=bc, wq=wq, var=True, drop=d)[0],
                                          main, 0, 2 * bc) for d in (False, True)]
    return out
