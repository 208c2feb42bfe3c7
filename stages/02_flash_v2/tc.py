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
Head dims 32, 64, 96, 128 (version "pipelined" also 256); any Nq, Nk; causal aligned bottom-right (query i sees
key j iff j <= i + Nk - Nq).
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import LOG2E, bfloat16, device, fast_path, kernels, load_module, variants
from stages.common.params import FwdParams

VERSIONS = ("tc", "pipelined")
VARIANT_VERSIONS = ("pipelined",)  # the kernels that take the variants' window, softcap, ALiBi, dropout (HOOKS)
HEAD_DIMS = {"tc": (32, 64, 96, 128), "pipelined": (32, 64, 96, 128, 256)}
DTYPES = (np.dtype(np.float16), bfloat16)
HEAD_GROUP = 8  # version 3, causal: heads per group in the block order (longest Q tiles first inside a group)

_CTYPE = {np.dtype(np.float16): "__half", bfloat16: "__nv_bfloat16"}
_FILE = {"tc": "flash_v2_forward_tc.cu", "pipelined": "flash_v2_forward_pipelined.cu"}

class Config(NamedTuple):
    """One launch configuration of a tensor-core forward: NWARPS warps, each owning MT m-tiles of 16 rows of Q_i
    (Br = 16 MT NWARPS), K/V tiles of Bc keys computed in slices of SUB keys, MINB blocks per SM the registers must
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


# Why these tiles: version "tc" keeps the simplest layout (4 warps x 16 rows, Bc = 64) and static shared memory
# (at most 48 KB at d = 128: it fits every GPU). Version "pipelined" gives each warp 32 rows (MT = 2, Br = 128,
# FA2's layout) so every K/V fragment read from shared memory feeds two mma; Bc = 64 in one slice (SUB = Bc) keeps
# a warp's S (32 x 64) beside its O_i (32 x d) within one thread's registers even at d = 128, with two blocks per
# SM (MINB = 2) to hide each other's latency. SKIP is on at d >= 128: there the rescale of O_i is d / 2
# multiplies per row and skipping it also frees registers; at smaller head dims the vote that decides it costs
# more than the multiplies it saves. The second candidate halves Br (MT = 1): it is what a GPU with less shared
# memory gets (d = 128 needs 102 KB at Br = 128, 87 KB at Br = 64: an RTX 3090 / 4090, A10 or L4 allows 99 KB),
# and what a problem too small to give every SM a block gets (twice the blocks). At d = 256 O_i alone is 128
# registers a thread per m-tile, so a warp owns one m-tile: 8 warps (Br = 128, 198 KB: an H100, 227 KB) first,
# then 4 warps with Bc = 64 (165 KB) or Bc = 32 (99 KB: an A100 and, exactly, an RTX 3090 / 4090 or L4).
CANDIDATES = {
    "tc": lambda D: [Config(4, 1, 64, 64, 1, False)],
    "pipelined": lambda D: ([Config(8, 1, 64, 64, 1, True), Config(4, 1, 64, 64, 2, True),
                             Config(4, 1, 32, 32, 2, True)] if D == 256 else
                            [Config(4, 2, 64, 64, 2, D == 128), Config(4, 1, 64, 64, 2, D == 128)]),
}
# A GPU with room for none of the above (a T4's 64 KB: d = 96 and 128 need 65 and 87 KB at Br = 64) gets Bc = 32:
# at d = 128, 52 KB. d = 256 does not fit a T4 at all.
SMALL_SMEM_CANDIDATES = {"tc": lambda D: [],
                         "pipelined": lambda D: [Config(4, 1, 32, 32, 2, D == 128)] if D != 256 else []}
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
    cfg = cfg or CANDIDATES[version](D)[0]
    if version == "tc":
        return 2 * (cfg.br + 2 * cfg.bc) * D
    return 2 * (cfg.br + 4 * cfg.bc) * (D + 8)


def config(version, D, dev=None, blocks=None):
    """The configuration of `version` at head dim D on device dev (stages.common.device; None: the first
    candidate, what a GPU with room for it gets). blocks(cfg): the problem's block count under cfg; when the first
    candidate leaves SMs idle (blocks < SM count) a smaller Br that fits is taken instead."""
    _check(version, D)
    cands = CANDIDATES[version](D)
    if dev is None:
        return cands[0]
    fitting = reachable(version, D, dev)
    if not fitting:  # raises UnsupportedDevice with the smallest need and the device's limit
        device.pick(cands + SMALL_SMEM_CANDIDATES[version](D), lambda c: smem_bytes(version, D, c), dev,
                    what=f"flash_v2 version {version!r} d={D}")
    if blocks is not None and blocks(fitting[0]) < dev.sm_count and len(fitting) > 1:
        return fitting[-1]
    return fitting[0]


def tiles(version, D, causal=False):
    """(Br, Bc): the Q_i and K_j/V_j tile heights of the version's first configuration (the mirror's tiles)."""
    cfg = config(version, D)
    return cfg.br, cfg.bc


# The hooks of each variants' level (_var_level) in kernels/variants.cuh: (Mask, Score, Drop).
HOOKS = {0: ("CausalMask", "PlainScore", "NoDropout"), 1: ("WindowMask", "PlainScore", "NoDropout"),
         2: ("WindowMask", "ModScore", "PhiloxDropout")}


def _name(version, ctype, D, cfg, otype=None, var=0):
    """The template instantiation of one (version, input type, head dim, configuration, output type: the input
    type, or float for a block's unrounded partial result; var: the variants' level, 0 plain, 1 a window or a packed
    batch, 2 softcap, ALiBi or dropout too (_var_level), which picks the hooks; every instantiation takes
    grouped-query k/v)."""
    otype = otype or ctype
    if version == "tc":
        return f"flash_v2_forward_tc<{ctype},{otype},{D},{cfg.bc},{cfg.nwarps}>"
    skip = "true" if cfg.skip else "false"
    tiles = f"FwdTiles<{D},{cfg.bc},{cfg.nwarps},{cfg.mt},{cfg.sub},{cfg.minb},{skip}>"
    return f"flash_v2_forward_pipelined<{ctype},{otype},{tiles},{','.join(HOOKS[var])}>"


def reachable(version, D, dev):
    """Every configuration config() can return on dev (for any problem): the candidates that fit, or where none
    does, the small-shared-memory ones that fit."""
    fits = [c for c in CANDIDATES[version](D) if device.fits(dev, smem_bytes(version, D, c))]
    return fits or [c for c in SMALL_SMEM_CANDIDATES[version](D) if device.fits(dev, smem_bytes(version, D, c))]


def input_ctypes(dev):
    """The input types the tensor-core kernels take on dev: fp16 everywhere, bf16 from sm_80."""
    return [c for dt, c in _CTYPE.items() if dt != bfloat16 or dev.arch.bf16]


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
                            out.append(device.KernelPlan(_FILE[ver], {}, _name(ver, c, D, cfg, o, var),
                                                         0 if ver == "tc" else smem, smem if ver == "tc" else 0,
                                                         cfg.threads))
    return out


def kernel_sources():
    """(file, name expressions) of every kernel this module may launch on any architecture."""
    plans = {p for a in device.ARCHS for p in kernel_plans(device.emulate(a))}
    return [(f, sorted({p.name for p in plans if p.file == f})) for f in _FILE.values()]


def _var_level(opts, causal, varlen):
    """The variants' level, the key of HOOKS: 2 when softcap, ALiBi or dropout change the scores or P; else 1 for a
    window other than causal's or a packed batch; else 0, plain (or causal) attention, maybe grouped-query."""
    if opts is not None and (opts.softcap > 0 or opts.alibi_slopes is not None or opts.dropout_p > 0):
        return 2
    window = opts is not None and (opts.left >= 0 or (opts.right >= 0 and not causal))
    return 1 if window or varlen is not None else 0


@functools.lru_cache(maxsize=fast_path.MAX_PLANS)  # once per problem: the choices below depend on nothing else
def _launch(version, dtype, odtype, B, H, Hkv, Nq, Nk, D, causal, scale, dev, opts=None, varlen=None, ld=None):
    """The launch of one problem on dev: the device check, the configuration, the compiled instantiation, its grid
    and parameters. opts: the variants
    (variants.Options without its ALiBi slopes, which come with each call), None for plain attention. varlen: (number
    of sequences, longest query sequence) of a packed batch (B = 1, Nq and Nk the totals), or None. ld: (ldq, ldk),
    the rows per head of q and of k when the call is a block of larger arrays (version pipelined: merge_into), or
    None: (Nq, Nk)."""
    if dtype not in _CTYPE:
        raise TypeError(f"flash_v2 version {version!r}: dtype {dtype} is not supported; use float16 or bfloat16")
    device.require(dev, ("bf16",) if dtype == bfloat16 else (),
                   what=f"flash_v2 version {version!r} ({dtype})",
                   instead="On this GPU use float16 inputs (the same versions), or float32 with version 'fp32'")
    if B * H > 65535:
        raise ValueError(f"flash_v2 version {version!r}: batch * heads = {B * H} is over the grid limit 65535; "
                         "split the batch into several calls")
    var = _var_level(opts, causal, varlen)
    if var and version not in VARIANT_VERSIONS:
        raise ValueError(f"flash_v2 version {version!r}: grouped-query k/v, window, softcap, alibi_slopes and "
                         f"dropout run in version {' / '.join(VARIANT_VERSIONS)}")
    cfg = config(version, D, dev, blocks=lambda c: B * H * -(-Nq // c.br))
    name = _name(version, _CTYPE[dtype], D, cfg, "float" if odtype == np.float32 else None, var)
    Tr = -(-Nq // cfg.br)
    if varlen is not None:  # grid: the Q tiles of the longest sequence x (sequence, head)
        B, Tr = varlen[0], -(-varlen[1] // cfg.br)
    if version == "tc":  # one block per (Q tile i, head); static shared memory
        fn = kernels.function(load_module(_FILE[version], name_expressions=(name,)), name, 0)
        return kernels.Launch(fn, (Tr, B * H), (cfg.threads,), 0,
                              FwdParams(Nq=Nq, Nk=Nk, scale=scale, causal=int(causal)))
    # causal: a 1-D grid, longest Q tiles first inside groups of heads (see the kernel); a window's Q tiles all
    # have about the same work, so it takes the 2-D grid
    left, right = (opts.left, opts.right) if opts is not None and var else (-1, 0 if causal else -1)
    ordered = causal and left < 0 and varlen is None
    smem = smem_bytes(version, D, cfg)
    fn = kernels.function(load_module(_FILE[version], name_expressions=(name,)), name, smem)
    ldq, ldk = ld or (Nq, Nk)
    params = FwdParams(Nq=Nq, Nk=Nk, ldq=ldq, ldk=ldk, scale=scale, scale_log2=LOG2E if var == 2 else scale * LOG2E,
                       causal=int(causal), head_group=HEAD_GROUP if ordered else 0, H=H, group=H // Hkv,
                       left=left, right=right, softcap=opts.softcap if opts is not None and var == 2 else 0.0,
                       **variants.origin_fields(opts, Nq, Nk), **variants.dropout_fields(opts))
    return kernels.Launch(fn, (B * H * Tr,) if ordered else (Tr, B * H), (cfg.threads,), smem, params)


def plan_forward(q, k, v, *, causal=False, scale, version, out_dtype=None, opts=None, varlen=None):
    """The kernels.ForwardLaunch that gives o (B, H, Nq, D) and lse (B, H, Nq) float32 for CuPy q, k, v checked by
    flash_v2.forward (fp16 / bf16, a supported head dim); scale is a float. o is in q's dtype, or in
    out_dtype=float32. opts: variants.Options (grouped-query k, v; window, softcap, ALiBi, dropout), None for plain
    attention. varlen: (cu_q, cu_k, max_seqlen_q), int32 device arrays of a packed batch: then B = 1 and q, k, v hold
    every sequence's rows head by head ((1, H, total, D)); sequence s is rows cu[s]:cu[s + 1]
    (flash_v2.forward_varlen)."""
    import cupy

    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    odtype = np.dtype(out_dtype or q.dtype)
    slopes = None if opts is None else opts.alibi_slopes
    # the launch depends on whether there are slopes and a seed, not on their values (arrays, given per call)
    plan_opts = None if opts is None else opts._replace(alibi_slopes=None if slopes is None else True, seed=0)
    vl = None if varlen is None else (varlen[0].size - 1, int(varlen[2]))  # (sequences, longest query sequence)
    launch = _launch(version, q.dtype, odtype, B, H, Hkv, Nq, Nk, D, bool(causal), scale, device.device(), plan_opts,
                     vl)
    if opts is not None and opts.dropout_p:  # the launch is made for seed 0: this call's seed
        launch = launch.with_fields(**variants.seed_fields(opts.seed))
    if version == "tc":
        return kernels.ForwardLaunch(launch, odtype)
    cu = (NULL, NULL) if varlen is None else varlen[:2]
    merges = odtype == np.float32  # float o: the kernel merges into (o, lse), which run_forward starts empty
    if slopes is not None:
        slopes = cupy.ascontiguousarray(cupy.broadcast_to(cupy.asarray(slopes, dtype=cupy.float32), (B, H)))
    return kernels.ForwardLaunch(launch, odtype, (NULL if slopes is None else slopes, *cu), merges=merges)


def forward(q, k, v, **kw):
    """o, lse: plan_forward(q, k, v, **kw), run once."""
    return plan_forward(q, k, v, **kw)(q, k, v)


def merge_into(q, k, v, o_run, lse_run, rows, keys, *, causal, scale, opts=None):
    """One block of ring attention (stage 04), merged in place: rows = (q_start, q_stop) of q (B, H, Lq, D) against
    keys = (k_start, k_stop) of k, v (B, Hkv, Lk, D), and the result merged by version pipelined's epilogue into the
    running O, L of those rows (o_run (B, H, Lq, D) float32, lse_run (B, H, Lq) float32; L = -inf where nothing was
    merged yet). No row is copied: the kernel starts at row q_start and key k_start and steps over whole heads by Lq
    and Lk rows. CuPy arrays, checked by the caller (the ring's prologue); opts: variants.Options (its window,
    softcap, ALiBi, dropout, origin) or None."""
    import cupy

    (q_start, q_stop), (k_start, k_stop) = rows, keys
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    slopes = None if opts is None else opts.alibi_slopes
    plan_opts = None if opts is None else opts._replace(alibi_slopes=None if slopes is None else True, seed=0)
    launch = _launch("pipelined", q.dtype, np.dtype(np.float32), B, H, Hkv, q_stop - q_start, k_stop - k_start, D,
                     bool(causal), scale, device.device(), plan_opts, None, (Lq, Lk))
    if opts is not None and opts.dropout_p:  # the launch is made for seed 0: this call's seed
        launch = launch.with_fields(**variants.seed_fields(opts.seed))
    if slopes is not None:
        slopes = cupy.ascontiguousarray(cupy.broadcast_to(cupy.asarray(slopes, dtype=cupy.float32), (B, H)))
    at_q, at_k = q_start * D * q.itemsize, k_start * D * k.itemsize  # byte offsets of the first row and key in a head
    launch(q.data.ptr + at_q, k.data.ptr + at_k, v.data.ptr + at_k, o_run.data.ptr + 4 * q_start * D,
           lse_run.data.ptr + 4 * q_start, NULL if slopes is None else slopes, NULL, NULL)


NULL = np.uint64(0)  # a null pointer argument (no ALiBi slopes)

