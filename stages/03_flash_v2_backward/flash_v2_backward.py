"""Stage 03: FlashAttention-2 backward (arXiv 2307.08691, Algorithm 2): launcher.

    dq, dk, dv = backward(q, k, v, o, lse, do, causal=False, scale=None, version="auto", deterministic=False)
    o, lse = forward(q, k, v, causal=False, scale=None)     # stage 02's forward (stage 01's if 02 is absent)

numpy inputs run the tile mirror (mirror.py), CuPy inputs the CUDA kernels:
    kernels/flash_v2_backward_pre.cu   D_i = rowsum(dO_i * O_i), L_i (+inf for a fully masked row); dQ_accum -> dQ
    kernels/flash_v2_backward_fp32.cu  version "fp32": float32, CUDA cores, head_dim 32, 64, 128
    kernels/flash_v2_backward_fp32x3.cu  version "fp32x3": float32 on TF32 tensor cores (the 3xTF32 split, close
                                       to fp32 accuracy; sm_80 and newer), head_dim 32, 64, 128
    kernels/flash_v2_backward_tc.cu    version "tc": float16 / bfloat16, mma.sync tensor cores, head_dim 64, 128,
                                       256 (d = 256: two blocks per K/V tile, one per half of dK_j, dV_j, dQ_i)
    kernels/flash_v2_backward_dq.cu    version "tc"'s deterministic dQ pass
Every kernel takes one BwdParams (kernels/params.cuh, stages/common/params.py); _plan fills it once per problem and
each call writes its arrays into it. The tiles, tuning tables and compile lists are in tiles.py.
version "auto": fp32 for float32 (fp32x3 on a GPU with TF32 tensor cores, with deterministic=False and no
variants), tc for float16 / bfloat16.
deterministic: False (default) adds dQ_i += dS_ij K_j into an fp32 buffer with atomicAdd from the block of
every K/V tile: fast, but the order of the additions (so the last bits of dq) changes from run to run.
True: no atomics; a second kernel, parallel over Q tiles, recomputes dS_ij and sums dQ_i in a fixed
order: dq, dk, dv are bit-identical across runs (dk, dv always are), at the cost of recomputing S and dP.
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import (
    bfloat16, cast, check_backward_inputs, check_causal, check_out_dtype, device, empty, fast_path, kernels,
    load_module, resolve_scale, variants, varlen,
)
from stages.common.params import BwdParams

from . import mirror, tiles
from .tiles import DTYPES, FILES, HEAD_DIMS, PAD, PRE_FILE, PRE_NAMES, VERSIONS, resolve_version

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float16): "__half", bfloat16: "__nv_bfloat16"}


def forward(q, k, v, *, causal=False, scale=None, **kw):
    """The forward this backward pairs with, so the stage has the shared API: stage 02's forward (imported
    lazily, on first call); if stage 02 does not import, stage 01's fp32 forward (float32 inputs only)."""
    try:
        from stages import flash_v2
    except (ImportError, OSError) as e:  # OSError: the folder exists but has no __init__.py yet
        if np.dtype(q.dtype) != np.float32:
            raise NotImplementedError(
                f"flash_v2_backward.forward: stage 02 (stages.flash_v2) does not import ({e}); stage 01's "
                f"forward only takes float32, got {q.dtype}: pass float32 inputs or fix stage 02") from e
        from stages import flash_v1

        return flash_v1.forward(q, k, v, causal=causal, scale=scale)
    return flash_v2.forward(q, k, v, causal=causal, scale=scale, **kw)


@fast_path.remembered  # a plain GPU call seen before goes straight to its planned launches (stages/common/fast_path.py)
def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version="auto", deterministic=False, out_dtype=None,
             tc_config=None, profile=None, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0, seed=0,
             origin=None):
    """Gradients (dq, dk, dv) of sum(O * dO), shaped like q, k, v, in their dtype, or in float32 with
    out_dtype=np.float32 (straight from the float32 accumulators: the ring adds such partial gradients).

    For tuning (dev/sweep_backward.py), CuPy arrays only: tc_config, the tc kernel's {"br": Br, "bc": Bc, "wq":
    1 or 2, "defer_dq": bool, "j_fast": bool, "fuse_dq": bool} in place of TC_BR[D], TC_BC[D], wq 1, TC_DEFER_DQ,
    j_fast_order, fuse_dq_rule (None or a missing key: the default; neither br nor bc: the device's TcTiles);
    profile, a list that receives (name, cupy.cuda.Event) after each launch.
    Variants (stages/common/variants.py): grouped-query k, v (fewer heads), window, alibi_slopes, softcap,
    dropout_p with seed, origin (a block of a larger problem: the ring); the mirror (numpy inputs) takes them all,
    and so does version 'tc' on the GPU with deterministic=False (dropout regenerates the forward's mask from the
    seed: pass the forward's dropout_p, seed and origin)."""
    where = "flash_v2_backward"
    xp, B, H, Nq, Nk, D = check_backward_inputs(q, k, v, o, lse, do, where=where, gqa=True)
    causal = check_causal(causal, where)
    opts = None
    if (window is not None or alibi_slopes is not None or softcap is not None or dropout_p or k.shape[1] != H
            or origin is not None):
        opts = variants.check(q, k, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                              dropout_p=dropout_p, seed=seed, origin=origin, where=where)
        opts = None if opts.plain else opts
    if opts is not None and xp is not np and (deterministic or q.dtype == np.float32):
        raise ValueError(f"{where}: on the GPU the variants (dropout included) run in version 'tc' (float16 / "
                         "bfloat16) with deterministic=False; the CPU mirror (numpy inputs) and stage 00 take them "
                         "all")
    out_dtype = check_out_dtype(out_dtype, q.dtype, "flash_v2_backward")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"flash_v2_backward: deterministic must be True or False, got {deterministic!r}")
    asked, version = version, resolve_version(version, q.dtype)
    if asked == "auto" and version == "fp32" and tiles.auto_takes_fp32x3(xp is not np, deterministic, opts, D):
        version = "fp32x3"  # fast float32 where it runs
    if D not in HEAD_DIMS[version]:
        others = [v for v in VERSIONS if v != version and D in HEAD_DIMS[v]]
        alt = "".join(f" or version {v!r} ({'/'.join(d.name for d in DTYPES[v])})" for v in others)
        raise ValueError(f"flash_v2_backward: head_dim {D} is not supported by version {version!r}; "
                         f"use one of {HEAD_DIMS[version]}{alt}")
    if version == "fp32x3" and deterministic:
        raise ValueError("flash_v2_backward: version 'fp32x3' adds dQ with atomics (deterministic=False); "
                         "deterministic=True runs in version 'fp32'")
    scale = resolve_scale(scale, D)
    tiles.check_tc_config(tc_config, version, xp)
    if profile is not None and xp is np:
        raise ValueError("flash_v2_backward: profile= records CUDA events: CuPy arrays only")
    if xp is np:
        return mirror.backward(q, k, v, o, lse, do, causal=causal, scale=scale, version=version,
                               deterministic=bool(deterministic), out_dtype=out_dtype, opts=opts)
    variants.check_kernel_origin(opts, where)
    deterministic = bool(deterministic)
    if opts is None and tc_config is None and profile is None:  # plain attention (grouped-query k, v has opts)
        return fast_path.launch(plan_backward(q, k, causal, scale, version, deterministic, out_dtype),
                                q, k, v, o, lse, do)
    return _gpu_backward(q, k, v, o, lse, do, causal, scale, version, deterministic, out_dtype, tc_config or {},
                         profile, opts)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """Stage 02's forward_varlen, the packed-batch forward this backward_varlen pairs with."""
    from stages import flash_v2

    return flash_v2.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)


def backward_varlen(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                    causal=False, scale=None, version="auto", out_dtype=None, window=None, alibi_slopes=None,
                    softcap=None, dropout_p=0.0, seed=0):
    """The gradients of a packed batch (flash_v2.forward_varlen; the definition: stages/common/varlen.py):
    dq (total_q, H, D), dk and dv (total_k, Hkv, D).

    numpy: the mirror on each sequence. CuPy: version 'tc' once for the whole batch (deterministic=False): the
    inputs laid out head by head ((H, total, D)), one block per (sequence, head, K/V tile of the longest sequence),
    each finding its rows from cu_seqlens; dK, dV float per query head, summed over each kv group, then rounded."""
    where = "flash_v2_backward.backward_varlen"
    packed = [varlen.check_packed(x, where, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (o, "o"), (do, "do"))]
    xp = check_backward_inputs(*(varlen.as_batch(x) for x in packed[:4]), lse[None], varlen.as_batch(do),
                               where=where, gqa=True)[0]
    kw = dict(causal=causal, scale=scale, version=version, out_dtype=out_dtype, window=window,
              alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, seed=seed)
    if xp is np:
        return varlen.per_sequence_backward(backward, q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, where=where, **kw)
    import cupy

    cq, ck, cu = varlen.kernel_bounds(q, k, cu_seqlens_q, cu_seqlens_k, where, max_seqlen_q, max_seqlen_k)
    version = resolve_version(version, q.dtype)
    if version != "tc":
        raise ValueError(f"{where}: on the GPU packed batches run in version 'tc' (float16 / bfloat16); got version "
                         f"{version!r} ({q.dtype}). The CPU mirror (numpy inputs) takes every version")
    D = q.shape[2]
    if D not in HEAD_DIMS[version]:
        raise ValueError(f"{where}: head_dim {D} is not supported by version 'tc'; use one of {HEAD_DIMS['tc']}")
    qb, kb, vb, ob, dob = (kernels.row_major(varlen.as_batch(x)) for x in packed)  # (1, H, total, D)
    causal = check_causal(causal, where)
    opts = variants.check(qb, kb, causal=causal, window=window, alibi_slopes=alibi_slopes, softcap=softcap,
                          dropout_p=dropout_p, seed=seed, where=where)
    out_dtype = check_out_dtype(out_dtype, q.dtype, where)
    dq, dk, dv = _gpu_backward(qb, kb, vb, ob, lse[None], dob, causal, resolve_scale(scale, D), version, False,
                               out_dtype, {}, None, opts, varlen=cu + (int(np.diff(ck).max()),))
    return tuple(cupy.ascontiguousarray(x[0].swapaxes(0, 1)) for x in (dq, dk, dv))


def _mark(profile, name):
    """Record an event after a launch when profile is a list (per-kernel times for dev/sweep_backward.py)."""
    if profile is not None:
        import cupy

        ev = cupy.cuda.Event()
        ev.record()
        profile.append((name, ev))


class BackwardPlan(NamedTuple):
    """The launches of one backward problem: the preprocess, the main kernel, then the deterministic dQ pass or the
    dQ conversion (last; None where the tc kernel converts dQ itself: fuse_dq_rule); rows, the length of D_i and of
    L_i over every (batch, head) (Nq padded to Nq_pad each); acc, the elements of the fp32 dQ accumulator; done,
    the tc kernel's block counters (one per grid row of heads, 0 without fused conversion); tc, whether the main
    kernel is version tc's (which adds float dK, dV into what they hold); odtype, deterministic: the gradients'
    dtype and the mode. outs: dq, dk, dv carved from one allocation (fast_path.out_layout), or None.
    plan(q, k, v, o, lse, do) runs a plain backward (no variants) and returns (dq, dk, dv)."""
    pre: kernels.Launch
    main: kernels.Launch
    last: kernels.Launch | None
    rows: int
    acc: int
    done: int
    tc: bool
    odtype: np.dtype = None
    deterministic: bool = False
    outs: tuple | None = None

    def __call__(self, q, k, v, o, lse, do):
        return _launch(self, q, k, v, o, lse, do, self.odtype, self.deterministic, ())

    def with_joint_outputs(self, q, k, *arrays):
        """This plan with dq, dk, dv from one allocation (one trip to the memory pool; a training step uses all
        three together)."""
        B, H, Nq, D = q.shape
        Nk = k.shape[2]
        return self._replace(outs=fast_path.out_layout([((B, H, Nq, D), self.odtype), ((B, H, Nk, D), self.odtype),
                                                         ((B, H, Nk, D), self.odtype)]))


@functools.lru_cache(maxsize=fast_path.MAX_PLANS)  # once per problem: the choices below depend on nothing else
def _plan(version, dtype, odtype, B, H, Nq, Nk, D, causal, scale, deterministic, tc_config, dev, opts=None,
          varlen=None, ld=None):
    """The device check, tiles, compiled kernels, grids and BwdParams of one problem on dev. tc_config: sorted
    (key, value) pairs of backward's tc_config. opts: the variants (variants.Options, slopes given per call) or None.
    varlen: (number of sequences, longest key sequence) of a packed batch (B = 1, Nq and Nk the totals), or None.
    ld: (ldq, ldk) for a ring block of larger arrays (accumulate_into: version tc, float32 gradients added to the
    ring's accumulators, no dQ accumulator or conversion of its own), or None: a whole problem."""
    BH = B * H
    if version != "tc" and BH > 65535:  # the grid's y axis runs over (batch, head)
        raise ValueError(f"flash_v2_backward version {version!r}: batch * heads = {BH} is over the grid limit 65535; "
                         "split the batch into several calls")
    ctype = _CTYPE[dtype]
    device.require(dev, ("bf16",) if dtype == bfloat16 else (),  # tc: fp16 from sm_75 (stage 02's tc.py), bf16 sm_80
                   what=f"flash_v2_backward version {version!r} ({dtype})",
                   instead="On this GPU use float16 inputs (version 'tc'), or float32 (version 'fp32')")
    Nq_pad = -(-Nq // PAD) * PAD  # D_i, L_i padded to Nq_pad rows
    pre_mod = load_module(PRE_FILE, name_expressions=PRE_NAMES)
    tc_config = dict(tc_config)
    br, bc, wq = tiles.tc_config_tiles(D, dev, tc_config) if version == "tc" else (None, None, 1)
    var = opts is not None
    x3 = None  # version fp32x3's Fp32x3Tiles
    if version == "fp32x3":
        device.require(dev, device.TF32_FEATURES, what="flash_v2_backward version 'fp32x3' (TF32 tensor cores)",
                       instead="On this GPU use version 'fp32' (CUDA cores)")
        x3 = tiles.fp32x3_tiles(D, dev)
        names = [tiles.fp32x3_name(D, x3)]
    else:
        names = tiles.kernel_names(version, ctype, D, defer=tc_config.get("defer_dq"), otype=_CTYPE[odtype], br=br,
                                   bc=bc, wq=wq, var=var, drop=var and opts.dropout_p > 0)
    main_file, dq_file = FILES[version]  # tc's dQ pass is a file of its own, compiled only for deterministic mode
    mod = load_module(main_file, name_expressions=names if dq_file == main_file else names[:2])
    smem_main, smem_dq = tiles.smem_bytes(version, D, br, bc, wq) if x3 is None else (tiles.fp32x3_smem(D, x3), 0)
    tiles.check_fits(dev, version, D, smem_main, smem_dq if deterministic else 0)
    fn = kernels.function(mod, names[0] if not deterministic else names[1], smem_main)
    # whether the tc kernel converts dQ itself (a packed batch: by its total rows, a bound on its longest sequence)
    fuse = tc_config.get("fuse_dq")
    fuse = version == "tc" and not deterministic and (tiles.fuse_dq_rule(Nq, D) if fuse is None else bool(fuse))
    fuse = fuse and ld is None  # a ring block leaves dQ in the ring's accumulator
    ldq, ldk = ld or (Nq, Nk)
    own_acc = not deterministic and ld is None  # a dQ accumulator of its own, zeroed by the preprocess
    blocks, Tc, j_fast = BH, 0, False  # the tc grid's rows of heads, K/V tiles and block order
    if version == "tc":  # varlen: (sequence, head) x the K/V tiles of the longest sequence (at least one: a
        # sequence without keys still has its dQ = 0 written, by its j = 0 block)
        blocks, Tc = (BH, -(-Nk // bc)) if varlen is None else (varlen[0] * H, max(1, -(-varlen[1] // bc)))
        j_fast = tc_config.get("j_fast")
        j_fast = tiles.j_fast_order(causal, Nk if varlen is None else varlen[1]) if j_fast is None else j_fast
        j_fast = bool(j_fast) and blocks <= 65535  # gridDim.y <= 65535
    done = blocks if fuse else 0  # the tc kernel's counters, one per row of heads of its grid
    params = BwdParams(Nq=Nq, Nk=Nk, ldq=ldq, ldk=ldk, Nq_pad=Nq_pad, head_dim=D, scale=scale, causal=int(causal),
                       j_fast=int(j_fast), H=H, group=opts.group if var else 1, left=opts.left if var else -1,
                       right=opts.right if var else -1, softcap=opts.softcap if var else 0.0,
                       **variants.origin_fields(opts, Nq, Nk), **variants.dropout_fields(opts),
                       zero_dq=int(own_acc), n_done=done)

    def launch(fn, grid, block, smem):  # each launch its own copy of params: a call writes its arrays into it
        return kernels.Launch(fn, grid, block, smem, BwdParams.from_buffer_copy(params))

    if version == "fp32":
        main = launch(fn, (-(-Nk // 32), BH), (256,), smem_main)
    elif x3 is not None:  # one block per (K/V tile j, head)
        main = launch(fn, (-(-Nk // x3.bc), BH), (x3.threads,), smem_main)
    else:  # times TC_PARTS[D] column parts of the head dim (grid.z)
        main = launch(fn, (Tc, blocks, tiles.TC_PARTS[D]) if j_fast else (blocks, Tc, tiles.TC_PARTS[D]), (2 * bc,),
                      smem_main)
    if deterministic:  # the separate dQ pass, no atomics
        dq_mod = mod if dq_file == main_file else load_module(dq_file, name_expressions=names[2:])
        grid, block = ((-(-Nq // 32), BH), (256,)) if version == "fp32" else ((BH, -(-Nq // 64)), (128,))
        last = launch(kernels.function(dq_mod, names[2], smem_dq), grid, block, smem_dq)
    elif ld is not None or fuse:  # a ring block: dQ stays in the ring's accumulator; fused: the tc kernel converts
        last = None
    else:  # dQ = dQ_accum cast to the output dtype (fp32: scale dQ_accum), tc on long heads and fp32
        n = BH * Nq * D  # a multiple of 4: the kernel converts 4 values per step
        last = kernels.Launch(pre_mod.get_function(f"bwd_convert_dq<{_CTYPE[odtype]}>"),
                              (min(-(-n // 1024), 65535),), (256,), 0,
                              (np.float32(1.0 if version == "tc" else scale), np.int64(n)))
    # the preprocess also zeroes the fp32 dQ accumulator the atomics add to, and the counters (deterministic mode
    # has neither)
    pre = launch(pre_mod.get_function(f"bwd_preprocess<{ctype}>"), (Nq_pad * D // 2048, BH), (256,), 0)
    return BackwardPlan(pre, main, last, BH * Nq_pad, BH * Nq * D if own_acc else 1, done, version == "tc", odtype,
                        deterministic)


def plan_backward(q, k, causal, scale, version, deterministic, odtype, tc_config=None, opts=None, varlen=None):
    """The BackwardPlan of one problem on the current device. opts: the variants or None; varlen:
    backward_varlen's (cu_q, cu_k, max_seqlen_k) or None."""
    B, H, Nq, D = q.shape
    plan_opts = None if opts is None else opts._replace(alibi_slopes=opts.alibi_slopes is not None, seed=0)
    vl = None if varlen is None else (varlen[0].size - 1, int(varlen[2]))  # (sequences, longest key sequence)
    return _plan(version, q.dtype, odtype, B, H, Nq, k.shape[2], D, bool(causal), scale, deterministic,
                 tuple(sorted((tc_config or {}).items())), device.device(), plan_opts, vl)


def _var_tail(opts, heads, cu=None):
    """The variants' arrays after dV (BwdParams.ARRAYS): the ALiBi slopes as (B, H) = heads float32, and a packed
    batch's cu_q, cu_k, each a null pointer when absent; none without variants (opts None)."""
    if opts is None:
        return ()
    slopes = NULL
    if opts.alibi_slopes is not None:
        import cupy

        slopes = cupy.ascontiguousarray(cupy.broadcast_to(cupy.asarray(opts.alibi_slopes, dtype=cupy.float32), heads))
    return (slopes,) + ((NULL, NULL) if cu is None else tuple(cu))


def _seeded(main, opts):
    """The main launch with this call's dropout seed (a plan is made for seed 0, so that it serves every seed)."""
    return main.with_fields(**variants.seed_fields(opts.seed)) if opts is not None and opts.dropout_p else main


def _gpu_backward(q, k, v, o, lse, do, causal, scale, version, deterministic, odtype, tc_config, profile,
                  opts=None, varlen=None):
    """One backward with variants, tuning options or a packed batch, on CuPy arrays (checked by backward or
    backward_varlen). varlen: (cu_q, cu_k, max_seqlen_k), int32 device arrays of a packed batch laid out head by
    head ((1, H, total, D)), or None."""
    plan = plan_backward(q, k, causal, scale, version, deterministic, odtype, tc_config, opts, varlen)
    tail = _var_tail(opts, q.shape[:2], None if varlen is None else varlen[:2])
    return _launch(plan, q, k, v, o, lse, do, odtype, deterministic, tail, opts, profile)


def _launch(plan, q, k, v, o, lse, do, odtype, deterministic, tail, opts=None, profile=None):
    """The allocations and launches of one backward: the preprocess (D_i, L_i; the dQ accumulator and the block
    counters zeroed), the main kernel (dK_j, dV_j; dQ_i added atomically, and in version tc on short heads
    converted to dQ by each head's last block), then the deterministic dQ pass or the dQ conversion. Every BwdParams
    launch gets the same arrays, in BwdParams.ARRAYS order (tail: the variants' slopes, cu_q, cu_k)."""
    import cupy

    asc = kernels.row_major  # (B, H, N, D) row-major: a copy only for another layout
    q, k, v, o, do, lse = asc(q), asc(k), asc(v), asc(o), asc(do), asc(lse, dtype=_F32)
    # The scratch, one float32 buffer from CuPy's memory pool: D_i = rowsum(dO_i * O_i) and L_i, (B H, Nq_pad)
    # each, the fp32 dQ accumulator (1 element in deterministic mode), then the tc kernel's block counters; the
    # kernels get device addresses. The pool is stream-ordered: once scratch is released, its memory goes to later
    # work on this stream, which runs after these launches.
    scratch = cupy.cuda.alloc(4 * (2 * plan.rows + plan.acc + plan.done))
    Dvec = scratch.ptr
    Lvec = Dvec + 4 * plan.rows
    dq_acc = Lvec + 4 * plan.rows
    done = dq_acc + 4 * plan.acc if plan.done else NULL  # null: the tc kernel leaves dQ in dQ_accum, or has none
    if opts is not None:  # the variants' dK, dV: float, k's shape; each kv group's query heads add into them
        dq, dk, dv = empty(cupy, q.shape, odtype), cupy.zeros(k.shape, _F32), cupy.zeros(k.shape, _F32)
    else:
        if plan.outs is not None:  # kept by fast_path: one allocation
            dq, dk, dv = fast_path.empties(*plan.outs)
        else:
            dq, dk, dv = (empty(cupy, x.shape, odtype) for x in (q, k, v))
        if plan.tc and odtype == _F32 and not deterministic:  # version tc adds float dK, dV into what they hold
            dk.fill(0)
            dv.fill(0)
    arrays = (o, do, lse, Dvec, Lvec, dq_acc, done, q, k, v, dq, dk, dv)  # BwdParams.ARRAYS
    _mark(profile, "start")
    plan.pre(*arrays)
    _mark(profile, "preprocess+zero")
    _seeded(plan.main, opts)(*arrays, *tail)
    if plan.last is not None:
        _mark(profile, "main")
        if deterministic:
            plan.last(*arrays)
        else:
            plan.last(dq_acc, dq)
    _mark(profile, "main+dq" if plan.last is None else "dq pass" if deterministic else "convert")
    if opts is not None:
        dk, dv = (x.astype(odtype) if odtype != bfloat16 else cast(x, odtype) for x in (dk, dv))
    return dq, dk, dv


def accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, *, causal, scale, opts=None):
    """One block of the ring backward (stage 04), added in place: the gradients of rows a:b of q, o, lse, do
    (B, H, Lq, ...) against keys c:m of k, v (B, Hkv, Lk, D), added by version tc into the ring's float32
    accumulators: dQ into rows a:b of dq_run (B, H, Lq, D) (atomically, as every K/V tile adds to dQ_i), dK, dV into
    keys c:m of dk_run, dv_run (B, Hkv, Lk, D) (red.add in the epilogue). No row is copied: the kernels start at row a
    and key c and step over whole heads by Lq and Lk rows. Two launches: the preprocess (D_i, L_i of rows a:b, in a
    scratch buffer) and the main kernel. CuPy arrays, checked by the caller (the ring's prologue); opts:
    variants.Options or None."""
    import cupy

    (a, b), (c, m) = rows, keys
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    plan_opts = None if opts is None else opts._replace(alibi_slopes=opts.alibi_slopes is not None, seed=0)
    plan = _plan("tc", q.dtype, _F32, B, H, b - a, m - c, D, bool(causal), scale, False, (), device.device(), plan_opts,
                 None, (Lq, Lk))
    scratch = cupy.cuda.alloc(4 * 2 * plan.rows)  # D_i and L_i of rows a:b, (B H, Nq_pad) each
    Dvec, Lvec = scratch.ptr, scratch.ptr + 4 * plan.rows
    at_q, at_k = a * D * q.itemsize, c * D * k.itemsize  # byte offsets of row a, key c in every head
    kv = 4 * c * D  # byte offset of key c in every head of the float32 accumulators
    # BwdParams.ARRAYS: no dQ of its own and no block counters (dQ stays in the ring's accumulator, dq_run)
    arrays = (o.data.ptr + at_q, do.data.ptr + at_q, lse.data.ptr + 4 * a, Dvec, Lvec, dq_run.data.ptr + 4 * a * D,
              NULL, q.data.ptr + at_q, k.data.ptr + at_k, v.data.ptr + at_k, NULL, dk_run.data.ptr + kv,
              dv_run.data.ptr + kv)
    plan.pre(*arrays)
    _seeded(plan.main, opts)(*arrays, *_var_tail(opts, (B, H)))


_F32 = np.dtype(np.float32)
NULL = np.uint64(0)  # a null pointer argument (no ALiBi slopes)


def backward_flops(B, H, Nq, Nk, D, causal):
    """The papers' convention: 2.5x the forward's 4 B H Nq Nk D (halved when causal)."""
    return 2.5 * 4.0 * B * H * Nq * Nk * D * (0.5 if causal else 1.0)
