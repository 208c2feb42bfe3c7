"""Stage 02, versions "tc" and "pipelined" of the FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1): float16 /
bfloat16 on mma.sync tensor cores. Their launchers, called by flash_v2.forward once it has checked the inputs:

    o, lse = forward_tc(q, k, v, causal=causal, scale=scale)                      # CuPy (B, H, N, D)
    o, lse = forward_pipelined(q, k, v, causal=causal, scale=scale, opts=opts)    # opts: the variants, or None
    merge_into(q, k, v, o_run, lse_run, rows, keys, causal=causal, scale=scale)   # one block of ring attention

Kernels:
    kernels/flash_v2_forward_tc.cu         version "tc": mma.sync m16n8k16 + ldmatrix, synchronous tile loads,
                                           Br = Bc = 64 (4 warps x 16 rows)
    kernels/flash_v2_forward_pipelined.cu  version "pipelined": cp.async double buffering, padded shared rows,
                                           exp2 with log2(e) folded into the scale, Br = 128 (d <= 128: 4 warps x
                                           32 rows; d = 256: 8 warps x 16) where it fits and fills the GPU, else
                                           Br = 64 (CANDIDATES), Bc = 64 (32 on small shared memory), masked and
                                           plain copies of the tile body, longest causal Q tiles first; the
                                           variants as hooks (kernels/variants.cuh); its tile bookkeeping in
                                           kernels/attention_tiles.cuh
fp16 / bf16 in, fp32 accumulation, o in the inputs' dtype (or float32), lse float32 (B, H, Nq), natural log.
Head dims 32, 64, 96, 128 (version "pipelined" also 256); any Nq, Nk; causal aligned bottom-right (query row r sees
key c iff c <= r + Nk - Nq). Why these tiles: the stage README's "Kernel design notes".
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import LOG2E, bfloat16, device, fast_path, load_module, variants
from stages.common.kernels import function
from stages.common.launch import NULL, Launch, run_forward
from stages.common.params import FwdParams

VERSIONS = ("tc", "pipelined")
VARIANT_VERSIONS = ("pipelined",)  # the kernels that take the variants' window, softcap, ALiBi, dropout (HOOKS)
HEAD_DIMS = {"tc": (32, 64, 96, 128), "pipelined": (32, 64, 96, 128, 256)}
DTYPES = (np.dtype(np.float16), bfloat16)
HEAD_GROUP = 8  # version pipelined, causal: heads per group in the block order (longest Q tiles first in a group)

CTYPE = {np.dtype(np.float16): "__half", bfloat16: "__nv_bfloat16", np.dtype(np.float32): "float"}
FILES = {"tc": "flash_v2_forward_tc.cu", "pipelined": "flash_v2_forward_pipelined.cu"}


class Config(NamedTuple):
    """One launch configuration of a tensor-core forward: NWARPS warps, each owning MT m-tiles of 16 rows of Q_i
    (Br = 16 MT NWARPS), K/V tiles of Bc keys computed in slices of SUB keys (SUB = Bc in every configuration
    today; the kernel can take less where registers ask for it), MINB blocks per SM the registers must
    allow (registers per thread <= 65536 / (MINB * 32 * NWARPS)), SKIP (version "pipelined": skip the rescale of
    O_i by alpha = 1 when no row of a warp's m-tile changed its max)."""
    nwarps: int
    mt: int
    bc: int
    sub: int
    minb: int
    skip: bool

    @property
    def br(self):
        return 16 * self.mt * self.nwarps

    @property
    def threads(self):
        return 32 * self.nwarps


# The configurations of (version, head dim), first choice first; a GPU takes the first that fits its shared memory,
# and a problem too small to give every SM a block takes the next (twice the blocks). SMALL_SMEM: what a GPU with
# room for none of them gets (a T4's 64 KB at d = 96 and 128: Br x Bc = 64 x 32); d = 256 does not fit a T4 at all.
_PIPELINED = [Config(4, 2, 64, 64, 2, False), Config(4, 1, 64, 64, 2, False)]  # d = 32, 64, 96
_PIPELINED_128 = [Config(4, 2, 64, 64, 2, True), Config(4, 1, 64, 64, 2, True)]
CANDIDATES = {
    **{("tc", D): [Config(4, 1, 64, 64, 1, False)] for D in HEAD_DIMS["tc"]},
    **{("pipelined", D): _PIPELINED for D in (32, 64, 96)}, ("pipelined", 128): _PIPELINED_128,
    ("pipelined", 256): [Config(8, 1, 64, 64, 1, True), Config(4, 1, 64, 64, 2, True), Config(4, 1, 32, 32, 2, True)],
}
SMALL_SMEM = {**{("tc", D): [] for D in HEAD_DIMS["tc"]},
              **{("pipelined", D): [Config(4, 1, 32, 32, 2, D == 128)] for D in (32, 64, 96, 128)},
              ("pipelined", 256): []}
# Both versions run on every supported GPU (sm_75: fp16 mma.sync m16n8k8, which common.cuh pairs into m16n8k16, and
# ldmatrix; without cp.async the copies are synchronous); bfloat16 inputs need sm_80 (stages/common/device.py).


def _check(version, D):
    if version not in VERSIONS:
        raise ValueError(f"flash_v2 tensor cores: unknown version {version!r}; choose one of {VERSIONS}")
    if D not in HEAD_DIMS[version]:
        raise ValueError(f"flash_v2 version {version!r}: head_dim {D} is not supported; use one of "
                         f"{HEAD_DIMS[version]}, or version='fp32' with float32 inputs")


def smem_bytes(version, D, cfg=None):
    """Shared memory per block: version "tc" holds Q_i, K_j, V_j unpadded (static); version "pipelined" holds Q_i
    and two buffers each of K_j and V_j, every row padded by 8 elements (16 bytes), 2 bytes per element."""
    cfg = cfg or CANDIDATES[version, D][0]
    if version == "tc":
        return 2 * (cfg.br + 2 * cfg.bc) * D
    return 2 * (cfg.br + 4 * cfg.bc) * (D + 8)


def config(version, D, dev=None, blocks=None):
    """The configuration of `version` at head dim D on device dev (stages.common.device; None: the first
    candidate, what a GPU with room for it gets). blocks(cfg): the problem's block count under cfg; when the first
    candidate leaves SMs idle (blocks < SM count) a smaller Br that fits is taken instead."""
    _check(version, D)
    cands = CANDIDATES[version, D]
    if dev is None:
        return cands[0]
    fitting = reachable(version, D, dev)
    if not fitting:  # raises UnsupportedDevice with the smallest need and the device's limit
        device.pick(cands + SMALL_SMEM[version, D], lambda c: smem_bytes(version, D, c), dev,
                    what=f"flash_v2 version {version!r} d={D}")
    if blocks is not None and blocks(fitting[0]) < dev.sm_count and len(fitting) > 1:
        return fitting[-1]
    return fitting[0]


def reachable(version, D, dev):
    """Every configuration config() can return on dev (for any problem): the candidates that fit, or where none
    does, the small-shared-memory ones that fit."""
    fits = [c for c in CANDIDATES[version, D] if device.fits(dev, smem_bytes(version, D, c))]
    return fits or [c for c in SMALL_SMEM[version, D] if device.fits(dev, smem_bytes(version, D, c))]


def tiles(version, D, causal=False):
    """(Br, Bc): the Q_i and K_j/V_j tile heights of the version's first configuration (the mirror's tiles)."""
    cfg = config(version, D)
    return cfg.br, cfg.bc


# The hooks of each variants' level (_var_level) in kernels/variants.cuh: (Mask, Score, Drop).
HOOKS = {0: ("CausalMask", "PlainScore", "NoDropout"), 1: ("WindowMask", "PlainScore", "NoDropout"),
         2: ("WindowMask", "ModScore", "PhiloxDropout")}


def instantiation(version, ctype, otype, D, cfg, var=0):
    """The kernel template instantiation of one (version, input type, output type: the input type, or float for a
    block's unrounded partial result; head dim, configuration; var: the variants' level, 0 plain, 1 a window or a
    packed batch, 2 softcap, ALiBi or dropout too (_var_level), which picks the hooks; every instantiation of
    pipelined takes grouped-query k/v)."""
    if version == "tc":
        return f"flash_v2_forward_tc<{ctype},{otype},{D},{cfg.bc},{cfg.nwarps}>"
    skip = "true" if cfg.skip else "false"
    tiles = f"FwdTiles<{D},{cfg.bc},{cfg.nwarps},{cfg.mt},{cfg.sub},{cfg.minb},{skip}>"
    return f"flash_v2_forward_pipelined<{ctype},{otype},{tiles},{','.join(HOOKS[var])}>"


def _var_level(opts, causal, packed):
    """The variants' level, the key of HOOKS: 2 when softcap, ALiBi or dropout change the scores or P; else 1 for a
    window other than causal's or a packed batch; else 0, plain (or causal) attention, maybe grouped-query."""
    if opts is not None and (opts.softcap > 0 or opts.alibi_slopes is not None or opts.dropout_p > 0):
        return 2
    window = opts is not None and (opts.left >= 0 or (opts.right >= 0 and not causal))
    return 1 if window or packed is not None else 0


def _check_device(version, dtype, dev, BH):
    """What the GPU and the grid must allow: bfloat16 needs sm_80; B * H is the grid's y (at most 65535)."""
    device.require(dev, ("bf16",) if dtype == bfloat16 else (), what=f"flash_v2 version {version!r} ({dtype})",
                   instead="On this GPU use float16 inputs (the same versions), or float32 with version 'fp32'")
    if BH > 65535:
        raise ValueError(f"flash_v2 version {version!r}: batch * heads = {BH} is over the grid limit 65535; "
                         "split the batch into several calls")


def forward_tc(q, k, v, *, causal, scale, out_dtype=None):
    """Version tc on CuPy q, k, v (B, H, N, D) float16 / bfloat16 checked by flash_v2.forward: o (B, H, Nq, D) in
    out_dtype (None: q's dtype), lse (B, H, Nq) float32."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    odtype = np.dtype(out_dtype or q.dtype)
    dev = device.device()
    _check_device("tc", q.dtype, dev, B * H)
    cfg = config("tc", D, dev)  # one configuration: 4 warps x 16 rows of Q_i, Bc = 64
    name = instantiation("tc", CTYPE[q.dtype], CTYPE[odtype], D, cfg)
    fn = function(load_module(FILES["tc"], name_expressions=(name,)), name, 0)  # compiled once; static shared memory
    params = FwdParams(Nq=Nq, Nk=Nk, scale=scale, causal=int(causal))  # tc takes natural exp: no exp2_scale
    grid = (-(-Nq // cfg.br), B * H)  # one block per (Q tile i, head)
    return run_forward(Launch(fn, grid, (cfg.threads,), 0, params), q, k, v, odtype)  # o, lse; the launch


def forward_pipelined(q, k, v, *, causal, scale, out_dtype=None, opts=None, varlen=None):
    """Version pipelined on CuPy q (B, H, Nq, D), k, v (B, Hkv, Nk, D) float16 / bfloat16 checked by
    flash_v2.forward: o (B, H, Nq, D) in out_dtype (None: q's dtype; float32: the kernel merges its result into an o,
    lse that start empty, lse = -inf), lse (B, H, Nq) float32. opts: variants.Options (window, softcap, ALiBi,
    dropout, origin), None for plain attention. varlen: (cu_q, cu_k, longest query sequence) of a packed batch
    (flash_v2.forward_varlen): then B = 1 and q, k, v hold every sequence's rows head by head."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    odtype = np.dtype(out_dtype or q.dtype)
    packed = None if varlen is None else (varlen[0].size - 1, int(varlen[2]))  # (sequences, longest query sequence)
    launch = pipelined_launch(q.dtype, odtype, B, H, Hkv, Nq, Nk, D, causal, scale, device.device(), opts, packed)
    slopes = NULL if opts is None or opts.alibi_slopes is None else _slopes(opts.alibi_slopes, B, H)
    cu_q, cu_k = (NULL, NULL) if varlen is None else varlen[:2]
    return run_forward(launch, q, k, v, odtype, slopes, cu_q, cu_k, merges=odtype == np.float32)  # o, lse; launch


def pipelined_launch(dtype, odtype, B, H, Hkv, Nq, Nk, D, causal, scale, dev, opts=None, packed=None, ld=None):
    """The Launch of version pipelined on one problem, everything but its arrays: configuration, instantiation,
    compiled kernel, parameters, grid. packed: (sequences, longest query sequence) of a packed batch, or None; ld:
    (ldq, ldk), the rows per head of q and of k when the problem is a block of larger arrays (merge_into), or None:
    (Nq, Nk)."""
    _check_device("pipelined", dtype, dev, B * H)
    var = _var_level(opts, causal, packed)
    cfg = config("pipelined", D, dev, blocks=lambda c: B * H * -(-Nq // c.br))  # the named configuration
    name = instantiation("pipelined", CTYPE[dtype], CTYPE[odtype], D, cfg, var)
    smem = smem_bytes("pipelined", D, cfg)
    fn = function(load_module(FILES["pipelined"], name_expressions=(name,)), name, smem)  # compiled once
    ldq, ldk = ld or (Nq, Nk)
    params = FwdParams(Nq=Nq, Nk=Nk, ldq=ldq, ldk=ldk, scale=scale, exp2_scale=scale * LOG2E, causal=int(causal),
                       H=H, group=H // Hkv)
    if var:  # the fields of the variants' hooks (kernels/variants.cuh); plain attention's hooks read none
        _variant_fields(params, opts, Nq, Nk, var)
    Tr = -(-Nq // cfg.br)
    if packed is not None:  # the Q tiles of the longest sequence x (sequence, head)
        return Launch(fn, (-(-packed[1] // cfg.br), packed[0] * H), (cfg.threads,), smem, params)
    # causal: a 1-D grid, longest Q tiles first inside groups of heads (kernels/attention_tiles.cuh, tile_and_head)
    if causal and params.left < 0:
        params.head_group = HEAD_GROUP
        return Launch(fn, (B * H * Tr,), (cfg.threads,), smem, params)
    return Launch(fn, (Tr, B * H), (cfg.threads,), smem, params)  # one block per (Q tile i, head)


def _variant_fields(params, opts, Nq, Nk, var):
    """The window (WindowMask) and, at level 2, the softcap, ALiBi's diagonal offset and dropout (ModScore,
    PhiloxDropout). ModScore scales the scores itself (natural units): the loop's exp2_scale is then log2(e)."""
    if opts is not None:
        params.left, params.right = opts.left, opts.right
    else:  # a packed batch with no option: causal's window
        params.right = 0 if params.causal else -1
    if var == 2:
        params.exp2_scale = LOG2E
        params.softcap = opts.softcap
        for field, value in {**variants.origin_fields(opts, Nq, Nk), **variants.dropout_fields(opts)}.items():
            setattr(params, field, value)


def _slopes(slopes, B, H):
    """ALiBi's slopes as the kernel reads them: one float32 per (batch, head), (B, H) contiguous."""
    import cupy

    return cupy.ascontiguousarray(cupy.broadcast_to(cupy.asarray(slopes, dtype=cupy.float32), (B, H)))


# The ring (stage 04) calls merge_into for the same blocks at every step, so their launches are kept per block
# problem (the speed layer's idea, stages/common/fast_path.py; ALiBi's slopes and dropout's seed come with each call).
_block_launch = functools.lru_cache(maxsize=fast_path.MAX_PLANS)(pipelined_launch)


def merge_into(q, k, v, o_run, lse_run, rows, keys, *, causal, scale, opts=None):
    """One block of ring attention (stage 04), merged in place: rows = (q_start, q_stop) of q (B, H, Lq, D) against
    keys = (k_start, k_stop) of k, v (B, Hkv, Lk, D), and the result merged by version pipelined's epilogue into the
    running O, L of those rows (o_run (B, H, Lq, D) float32, lse_run (B, H, Lq) float32; L = -inf where nothing was
    merged yet). No row is copied: the kernel starts at row q_start and key k_start and steps over whole heads by Lq
    and Lk rows. CuPy arrays, checked by the caller (the ring's prologue); opts: variants.Options (its window,
    softcap, ALiBi, dropout, origin) or None."""
    (q_start, q_stop), (k_start, k_stop) = rows, keys
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    slopes = None if opts is None else opts.alibi_slopes
    # the launch depends on whether there are slopes and a seed, not on their values (given per call)
    kept_opts = None if opts is None else opts._replace(alibi_slopes=None if slopes is None else True, seed=0)
    launch = _block_launch(q.dtype, np.dtype(np.float32), B, H, Hkv, q_stop - q_start, k_stop - k_start, D,
                           bool(causal), scale, device.device(), kept_opts, None, (Lq, Lk))
    if opts is not None and opts.dropout_p:  # the kept launch is made for seed 0: this call's seed
        launch = launch.with_fields(**variants.seed_fields(opts.seed))
    at_q, at_k = q_start * D * q.itemsize, k_start * D * k.itemsize  # byte offsets of the first row and key in a head
    # o_run, lse_run are float32 (4 bytes a value): row q_start is 4 q_start D bytes into o_run, 4 q_start into lse_run
    launch(q.data.ptr + at_q, k.data.ptr + at_k, v.data.ptr + at_k, o_run.data.ptr + 4 * q_start * D,
           lse_run.data.ptr + 4 * q_start, NULL if slopes is None else _slopes(slopes, B, H), NULL, NULL)


def input_ctypes(dev):
    """The input types the tensor-core kernels take on dev: fp16 everywhere, bf16 from sm_80."""
    return [CTYPE[dt] for dt in DTYPES if dt != bfloat16 or dev.arch.bf16]


def kernel_plans(dev):
    """[device.KernelPlan] of every instantiation this module may launch on dev (CI compiles each for dev's
    architecture and checks it against dev's limits)."""
    out = []
    for ver in VERSIONS:
        for D in HEAD_DIMS[ver]:
            for var in (0, 1, 2) if ver in VARIANT_VERSIONS else (0,):  # every level takes every candidate
                for cfg in reachable(ver, D, dev):
                    smem = smem_bytes(ver, D, cfg)
                    for c in input_ctypes(dev):
                        for o in (c, "float"):  # float O: a ring block's unrounded partial result
                            out.append(device.KernelPlan(FILES[ver], {}, instantiation(ver, c, o, D, cfg, var),
                                                         0 if ver == "tc" else smem, smem if ver == "tc" else 0,
                                                         cfg.threads))
    return out


def kernel_sources():
    """(file, name expressions) of every kernel this module may launch on any architecture."""
    plans = {p for a in device.ARCHS for p in kernel_plans(device.emulate(a))}
    return [(f, sorted({p.name for p in plans if p.file == f})) for f in FILES.values()]
