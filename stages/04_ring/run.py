"""Stage 04: ring attention across MPI ranks (Liu, Zaharia & Abbeel 2023, arXiv 2310.01889), checked then timed.

Each rank keeps its query shard Q_r; the K_j, V_j shards travel round the ring (one step per rank), each block
is computed by a single-device kernel and the partial results are merged by their log-sum-exp. The backward
also rotates the dK_j, dV_j accumulators.

Versions (the layouts, --layout):
  contiguous  rank r holds rows [rN/P, (r+1)N/P): simple; under a causal mask rank P-1 does 2P-1 times rank 0's work.
  zigzag      rank r holds chunks r and 2P-1-r of 2P: every rank does the same causal work.
Schemes (--scheme): ring (the default: K, V travel hop by hop behind the compute), allgather (K, V gathered once, as
Llama 3 trains) or alltoall (heads scattered, as DeepSpeed-Ulysses; P must divide the heads); gather.py compares them.
Backends (--backend; auto picks and says why): nccl (a GPU per rank), mpi (CuPy staged through the host: more
ranks than GPUs), numpy (CPU). Blocks (--block): flash (stage 02 forward, stage 03 backward; the GPU default)
or naive (stage 00; the CPU default, where the stage 02/03 tile mirrors are exact but slow, and the GPU default where
the flash kernels cannot take --kv-heads, --window, --softcap, --alibi or --dropout in the chosen dtype, as
float32). On a T4 (sm_75: no bfloat16) the GPU default is float16.

1. Check: fresh inputs cut into shards, the ring forward and the ring backward (from the fp64 oracle's o and
   lse, as stages.common.check_backward does), gathered to rank 0 and held to the tolerance rule against the
   fp64 oracle on the full sequence, with the same yardsticks as one device.
2. Time (only after the check passed): time per rank, compute and exposed communication per ring step, peak
   memory per rank, and one device on the whole sequence (rank 0 alone). Then, in words: the per-GPU efficiency
   (one device's time over P times the ring's, for the same total work: 1.00 means the ring costs nothing) and the
   memory per GPU against one device's and against 1/P.

The default sizes are where the ring pays on GPUs: 16 heads of 128 dims and 16k tokens per GPU (N = 16k P in all).
There each step's attention takes milliseconds, more than the half block it hides takes to cross NVLink, and the
ring's fixed costs (the launches of each step) are a small part of it. With far fewer tokens per GPU the transfers and
launches would show. When several ranks share one GPU (the mpi backend) the run checks the ring and shows its steps,
but says nothing about speed or memory per GPU: every rank computes on the same GPU.

    mpirun -n 4 python stages/04_ring/run.py                   # 4 GPUs (nccl), 1 GPU (mpi backend) or the CPU
    mpirun -n 4 python stages/04_ring/run.py --quick           # small, for scripts/run_all.py
    mpirun -n 2 python stages/04_ring/run.py --backend nccl    # 2 GPUs, one per rank
    mpirun -n 4 python stages/04_ring/run.py --scheme alltoall  # the same check and timing, heads scattered
    mpirun -n 8 --hostfile hosts python stages/04_ring/run.py  # 2 nodes x 4 GPUs (see README.md)
    python stages/04_ring/run.py --help
"""
import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout: `stages` imports with no install

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before numpy loads its BLAS:
    os.environ.setdefault(_var, "1")  # one core per rank on the CPU (P ranks x all cores would thrash)

import numpy as np  # noqa: E402

from stages import ring as R  # noqa: E402
from stages.common import PeakMemory, attention_flops, bfloat16, cast, gpu_name, make_inputs  # noqa: E402
from stages.common import time_queued_ms  # noqa: E402
from stages.common import device, to_numpy, verify  # noqa: E402
from stages.common import variants as V  # noqa: E402
from stages.common.cli import positive_int  # noqa: E402
from stages.ring import comm as comm_mod  # noqa: E402

# ---- configuration (each overridable on the command line)
BATCH = 1  # B
HEADS = {"cpu": 4, "gpu": 16, "gpu_sm75": 16}  # H (2 with --quick)
HEAD_DIM = {"cpu": 64, "gpu": 128, "gpu_sm75": 64}  # D (gpu_sm75: a T4, whose 64 KB take larger tiles at d = 64)
CHECK_SEQ = 1000  # total N of the check (the fp64 oracle runs on rank 0's CPU; 256 with --quick)
# tokens per rank timed (N = P times this): a GPU per rank; ranks sharing a GPU (mpi backend); the CPU. --quick:
# 1024 per rank on GPUs, 64 on the CPU.
TOKENS_PER_RANK = {"gpu": 16384, "gpu_sm75": 16384, "shared": 2048, "cpu": 250}
LAYOUT = "zigzag"  # contiguous | zigzag
REPEAT = 3  # timed calls, queued back to back
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=comm_mod.BACKENDS, default="auto",
                    help="auto: nccl with a GPU per rank, mpi with fewer GPUs than ranks, numpy without a GPU")
    ap.add_argument("--layout", choices=R.LAYOUTS, default=LAYOUT, help="how the sequence is cut into shards")
    ap.add_argument("--scheme", choices=R.SCHEMES, default="ring",
                    help="how the ranks share the keys: ring (hop by hop), allgather (K, V gathered once) or alltoall "
                         "(heads scattered; the number of ranks must divide --heads and --kv-heads)")
    ap.add_argument("--block", choices=sorted(R.BLOCKS), default=None,
                    help="per-block kernels: flash (stages 02/03) or naive (stage 00); default flash on GPUs, "
                         "naive on the CPU and where the GPU's flash kernels cannot take --kv-heads, --window, "
                         "--softcap, --alibi or --dropout in the chosen dtype")
    ap.add_argument("--fwd-version", default=None, help="flash blocks: stage 02 version (default: its auto)")
    ap.add_argument("--bwd-version", default=None, help="flash blocks: stage 03 version (default: its auto)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default bfloat16 on sm_80+ GPUs, float16 on a T4 (sm_75), float32 on the CPU")
    ap.add_argument("--batch", type=positive_int, default=BATCH, help="batch size B")
    ap.add_argument("--heads", type=positive_int, default=None, help=f"heads H (default {HEADS}; 2 with --quick)")
    ap.add_argument("--head-dim", type=positive_int, default=None, help=f"head dimension D (default {HEAD_DIM})")
    ap.add_argument("--check-seq", type=positive_int, default=None,
                    help=f"total sequence length of the check (default {CHECK_SEQ}; 256 with --quick)")
    ap.add_argument("--seq", type=positive_int, default=None,
                    help=f"total sequence length timed (default P x {TOKENS_PER_RANK} tokens per rank; --quick: "
                         "P x 1024 on GPUs, P x 64 on the CPU)")
    ap.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    ap.add_argument("--kv-heads", type=positive_int, default=None,
                    help="k, v heads Hkv (grouped-query attention; must divide --heads; default: the same as q)")
    ap.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=None,
                    help="sliding window (left, right) around the diagonal, -1 unbounded: the ring skips the steps "
                         "whose block no query sees")
    ap.add_argument("--softcap", type=float, default=None, help="S -> c tanh(S / c)")
    ap.add_argument("--alibi", action="store_true",
                    help="ALiBi with the paper's geometric slopes (S -> S - slope_h |i - j|, global distances)")
    ap.add_argument("--dropout", type=float, default=None, metavar="P",
                    help="dropout probability (seed 0): the ring draws the one-device mask (on the GPU: lengths of "
                         "whole 16-row tiles per shard chunk, no left window side off that grid)")
    ap.add_argument("--repeat", type=positive_int, default=REPEAT, help="timed calls, queued back to back")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for scripts/run_all.py")
    return ap.parse_args(argv)


def check_on_ranks(comm, ring, *, B, H, n, D, dtype, causal, layout, block, versions, xp, Hkv=None, opts=None,
                   scheme="ring"):
    """Every rank of `comm`: the ring forward, and the ring backward from the oracle's o and lse, at total length
    n on fresh inputs (k, v with Hkv heads; opts: window, softcap, alibi_slopes, dropout_p); gathered to rank 0 and
    checked there exactly as stages.common.verify checks one device (stages.common.verify.rule and check_outputs).
    Returns {name: (error, bound)} on rank 0, None elsewhere; raises AssertionError on rank 0 when a result is out
    of tolerance."""
    rank, P = comm.Get_rank(), comm.Get_size()
    seed = comm.bcast(int(np.random.default_rng().integers(2**31)) if rank == 0 else None, root=0)
    q, k, v, do = make_inputs(B, H, n, n, D, dtype=dtype, seed=seed, grad=True)  # the same on every rank
    k, v = k[:, :Hkv], v[:, :Hkv]  # grouped-query: Hkv heads
    opts = opts or {}
    rule = verify.rule(q, k, v, do, causal=causal, opts=opts) if rank == 0 else None  # oracle, bounds, start
    start = rule[2] if rank == 0 else None
    o_in, lse_in = comm.bcast(start, root=0)
    kw = dict(ring=ring, nq=n, nk=n, causal=causal, layout=layout, block=block, scheme=scheme, **opts)
    mine = [xp.asarray(R.shard(x, rank, P, layout)) for x in (q, k, v, do, o_in, lse_in)]  # (B, H, L, ...)
    o, lse = R.ring_forward(*mine[:3], version=versions[0], **kw)
    grads = R.ring_backward(*mine[:3], mine[4], mine[5], mine[3], version=versions[1], **kw)
    parts = comm.gather([to_numpy(t) for t in (o, lse, *grads)], root=0)
    if rank != 0:
        return None
    got = [R.unshard([p[i] for p in parts], n, layout) for i in range(5)]  # o, lse, dq, dk, dv: (B, H, n, ...)
    for name, x, like in zip(("o", "lse", "dq", "dk", "dv"), got, (q, lse_in, q, k, v)):
        if x.shape != like.shape or x.dtype != like.dtype:
            raise AssertionError(f"{name}: got {x.shape} {x.dtype}, expected {like.shape} {like.dtype}")
    res = verify.check_outputs(got, rule[0], rule[1])
    return res


def _options_missed(args, gpu, dtype, variants):
    """Why the flash blocks cannot take the variant options here, or "" when they can.

    On the GPU the flash kernels take grouped-query k/v, window, softcap, ALiBi and dropout in stage 02 version
    pipelined only (float16 / bfloat16 tensor cores, sm_80 or newer); every version's CPU mirror takes them."""
    if not (gpu and variants):
        return ""
    from stages import flash_v2

    vf = R.flash_version(dtype, args.fwd_version)
    if vf in flash_v2.VARIANT_VERSIONS:
        return ""
    return (f"on the GPU the flash blocks take --kv-heads, --window, --softcap, --alibi and --dropout in stage 02 "
            f"version {' / '.join(flash_v2.VARIANT_VERSIONS)} (float16, or bfloat16 on sm_80 or newer), not {vf} "
            f"({np.dtype(dtype).name})")


def _blocks(args, gpu, dtype, variants):
    """The per-block kernels and why: args.block, else flash (stages 02/03) on GPUs and naive (stage 00) on the CPU,
    and naive on the GPU where the flash blocks cannot take the variant options (float32); an
    explicit --block flash there is an error (_versions)."""
    why = "" if args.block else _options_missed(args, gpu, dtype, variants)
    if why:
        return "naive", why
    return args.block or ("flash" if gpu else "naive"), ""


def _versions(block, dtype, D, args, rank, gpu=False, variants=False):
    """(stage 02 version, stage 03 version) of the flash blocks, checked against dtype, head dim and, on the GPU, the
    variant options; (None, None) for naive blocks. A bad choice ends every rank with the same message (printed
    once)."""
    try:
        if block == "naive":
            if args.fwd_version or args.bwd_version:
                raise ValueError("--fwd-version/--bwd-version choose stage 02/03 versions; the naive block "
                                 "(stage 00, the CPU default) has none: add --block flash")
            return None, None
        from stages import flash_v2, flash_v2_backward

        vf = R.flash_version(dtype, args.fwd_version)
        vb = flash_v2_backward.resolve_version(args.bwd_version or "auto", dtype)
        for opt, v, dims in (("--fwd-version", vf, flash_v2.head_dims(vf)),
                             ("--bwd-version", vb, flash_v2_backward.HEAD_DIMS[vb])):
            if D not in dims:
                raise ValueError(f"--head-dim {D}: {opt} {v} takes head dims {dims[0]}..{dims[-1]}" if len(dims) > 4
                                 else f"--head-dim {D}: {opt} {v} takes head dims {', '.join(map(str, dims))}")
        if why := _options_missed(args, gpu, dtype, variants):
            raise ValueError(f"--block flash: {why}. Use --dtype float16 (or bfloat16 on an sm_80+ GPU), or --block "
                             "naive (stage 00 on the same GPU)")
        return vf, vb
    except (TypeError, ValueError) as e:
        if rank == 0:
            print(f"run.py: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def main(argv=None):
    args = parse(argv)
    ring, backend, reason = comm_mod.setup(args.backend)
    world, rank, P = comm_mod.world(), ring.rank, ring.size
    gpu = backend in ("nccl", "mpi")
    dev = "gpu" if gpu else "cpu"
    xp = __import__("cupy") if gpu else np
    if gpu and not device.device().arch.bf16:  # a T4: fp16 tensor cores, no bf16
        dev = "gpu_sm75"
    dtype = DTYPES[args.dtype or {"gpu": "bfloat16", "gpu_sm75": "float16", "cpu": "float32"}[dev]]
    D = args.head_dim if args.head_dim is not None else HEAD_DIM[dev]
    quick_heads = max(2, P) if args.scheme == "alltoall" else 2  # the all-to-all needs P | H
    H = args.heads if args.heads is not None else (quick_heads if args.quick else HEADS[dev])
    n_check = args.check_seq if args.check_seq is not None else (256 if args.quick else CHECK_SEQ)
    shared = backend != "nccl" and P > 1  # ranks share a device: the run shows the ring's steps, not its scaling
    gpus = comm_mod.gpus_in_use(world) if gpu else 0  # the GPUs the P ranks compute on, over every node
    per_rank = (1024 if gpu else 64) if args.quick else TOKENS_PER_RANK["cpu" if not gpu else "shared" if shared
                                                                        else dev]
    n_time = args.seq if args.seq is not None else P * per_rank
    causal, layout = not args.no_causal, args.layout
    Hkv = args.kv_heads or H
    bad = (f"--kv-heads {Hkv} must divide --heads {H} (grouped-query attention: each k, v head serves H / Hkv query "
           "heads)" if H % Hkv else
           f"--scheme alltoall gives each of the {P} ranks H/P query heads and Hkv/P kv heads: {P} ranks must divide "
           f"--heads {H} and --kv-heads {Hkv} (use --scheme ring or allgather, or other head counts)"
           if args.scheme == "alltoall" and (H % P or Hkv % P) else
           "--scheme alltoall with --dropout: each rank's heads are a problem of their own, so the dropout mask would "
           "not be one device's; use --scheme ring or allgather" if args.scheme == "alltoall" and args.dropout else "")
    if bad:
        if rank == 0:
            print(f"run.py: error: {bad}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    opts = {key: val for key, val in (("window", tuple(args.window) if args.window else None),
                                      ("softcap", args.softcap), ("dropout_p", args.dropout),
                                      ("alibi_slopes", V.alibi_geometric_slopes(H) if args.alibi else None))
            if val is not None}
    variants = bool(opts) or Hkv != H
    block, why = _blocks(args, gpu, dtype, variants)
    versions = _versions(block, dtype, D, args, rank, gpu, variants)
    where = f"GPU {gpu_name()}" if gpu else "CPU"
    # on an sm_90 GPU the blocks are stage 06's (ring.hopper_blocks, ring.hopper_backward_blocks), and so is one
    # device's attention (ring.one_device_forward, ring.one_device_backward)
    plain = block == "flash" and gpu and not variants
    hopper = plain and R.hopper_takes(dtype, D, H=H, Hkv=Hkv, B=args.batch, version=versions[0])
    hopper_bwd = plain and R.hopper_backward_takes(dtype, D, H=H, Hkv=Hkv, B=args.batch, version=versions[1])
    if rank == 0:
        print(f"== stage 04 ring attention: {P} ranks, backend {args.backend} -> {backend} ({reason})")
        fwd_blocks = "stage 06 (FlashAttention-3 on sm_90)" if hopper else f"stage 02 version {versions[0]}"
        bwd_blocks = "stage 06 backward version ws" if hopper_bwd else f"stage 03 version {versions[1]}"
        print(f"   blocks {block}" + (f" ({fwd_blocks}, {bwd_blocks})"
                                      if block == "flash" else f" (stage 00{'; ' + why if why else ''})")
              + f", scheme {args.scheme}, layout {layout}, causal={causal}, {np.dtype(dtype).name}, "
              + f"B={args.batch} H={H} Hkv={Hkv} D={D}"
              + "".join(f", {key}={val}" for key, val in opts.items()) + f", on {where} (rank 0)", flush=True)

    # 1. check, before any timing
    try:
        errs = check_on_ranks(world, ring, B=args.batch, H=H, n=n_check, D=D, dtype=dtype, causal=causal,
                              layout=layout, block=block, versions=versions, xp=xp, Hkv=Hkv, opts=opts,
                              scheme=args.scheme)
        ok = True
        if rank == 0:
            print(f"check on the full sequence (N={n_check}) against the fp64 oracle (tolerance rule): "
                  + verify.errors_and_bounds(errs))
    except AssertionError as e:
        print(f"CHECK FAILED: {e}")
        ok = False
    if not world.bcast(ok, root=0):
        if rank == 0:
            print(f"SUMMARY 04_ring FAIL ring result out of tolerance ({backend}, {P} ranks, {layout})")
        return False
    if rank == 0:
        print("All results match. Timing.", flush=True)

    # 2. time: the ring on every rank, then one device on the whole sequence (rank 0 alone)
    kw_f = dict(ring=ring, nq=n_time, nk=n_time, causal=causal, layout=layout, block=block, version=versions[0],
                scheme=args.scheme, **opts)
    kw_b = dict(kw_f, version=versions[1])
    shape = (args.batch, H, R.shard_len(n_time, P, layout), D)
    if rank == 0 and args.scheme == "ring":
        sched = R.schedule(P, n_time, n_time, layout=layout, causal=causal, window=opts.get("window"),
                           kv_shape=(args.batch, Hkv) + shape[2:], dtype=dtype)  # the ring's steps and hops
        print(f"ring schedule at N={n_time}: steps with work {sched['steps']} of {P}; K, V hops "
              f"{sched['kv_hops']} x {sched['kv_bytes_per_hop'] / 2**20:.2f} MB (Hkv={Hkv} heads); "
              f"backward dK, dV hops {sched['dkv_hops']} x {sched['dkv_bytes_per_hop'] / 2**20:.2f} MB (float32)",
              flush=True)
    elif rank == 0:
        sent = [args.batch * x / 2**20 for x in R.traffic(args.scheme, P, shape[2], H, Hkv, D, dtype)]
        print(f"{args.scheme} at N={n_time}: a rank sends {sent[0]:.2f} MB per forward, {sent[1]:.2f} MB per backward, "
              "before (and after) its compute", flush=True)
    rows = world.gather(_time(R.ring_forward, R.ring_backward, shape, dtype, xp, gpu, args.repeat, kw_f, kw_b, Hkv),
                        root=0)
    if rank == 0:
        fwd, bwd = _one_device(block)
        vf, vb = ({"version": v} if block == "flash" else {} for v in versions)
        single = _time(fwd, bwd, (args.batch, H, n_time, D), dtype, xp, gpu, args.repeat,
                       dict(vf, causal=causal, **opts), dict(vb, causal=causal, **opts), Hkv)
    comm_mod.quiet_barrier(world)  # the other ranks sleep while rank 0 times one device alone
    if rank == 0:
        flops = attention_flops(args.batch, H, n_time, n_time, D, causal=causal)  # (the window's skipped pairs too)
        print(f"\ntimed on {where}: total N={n_time} ({shape[2]} rows per rank), {args.repeat} calls back to back")
        print(f"{'rank':>4} {'fwd ms':>9} {'bwd ms':>9} {'fwd compute/step':>17} {'fwd exposed/step':>17} "
              f"{'bwd compute/step':>17} {'bwd exposed/step':>17} {'peak MB':>9}")
        for r, row in enumerate(rows):
            steps = [np.mean([t[key] for t in row[tl]] or [0.0]) for tl in ("tl_f", "tl_b")
                     for key in ("compute_ms", "exposed_ms")]
            print(f"{r:>4} {row['fwd']:>9.2f} {row['bwd']:>9.2f} " + " ".join(f"{x:>14.2f} ms" for x in steps)
                  + f" {row['peak'] / 2**20:>9.1f}")
        t_f, t_b = max(r["fwd"] for r in rows), max(r["bwd"] for r in rows)  # the slowest rank sets the pace
        peak = max(r["peak"] for r in rows)
        rate = f"{flops / P / t_f / 1e9:.1f} TFLOP/s per GPU" if gpu else f"{flops / P / t_f / 1e6:.2f} GFLOP/s a rank"
        print(f"one device, whole sequence: fwd {single['fwd']:.2f} ms, bwd {single['bwd']:.2f} ms, "
              f"peak {single['peak'] / 2**20:.1f} MB; ring fwd {rate}")
        print(report(P, single, t_f, t_b, peak, shared=shared, gpu=gpu, scheme=args.scheme, gpus=gpus))
        print(f"SUMMARY 04_ring PASS {P} ranks {backend}, {layout}, fwd+bwd within tolerance on the full sequence")
    return True


HOLDS = {  # what a rank holds besides its shards, by scheme (README.md and gather.py say what each costs)
    "ring": "a rank also holds its accumulators and the block in flight; README.md says what each buffer costs",
    "allgather": "a rank also holds K, V of the whole sequence, and in the backward their float32 gradients",
    "alltoall": "a rank also holds its heads over the whole sequence, about its shards' size again",
}


def report(P, single, t_f, t_b, peak, *, shared, gpu, scheme="ring", gpus=1):
    """What the timing says, in words: per-GPU efficiency and memory per GPU against one device (and 1/P). gpus: how
    many GPUs the P ranks run on (shared: fewer than P)."""
    eff = (single["fwd"] + single["bwd"]) / (P * (t_f + t_b))
    mem = peak / max(single["peak"], 1)
    e_f, e_b = single["fwd"] / (P * t_f), single["bwd"] / (P * t_b)
    lines = [f"per-GPU efficiency {eff:.2f} (fwd {e_f:.2f}, bwd {e_b:.2f}): "
             f"the {P} ranks took {(t_f + t_b) / (single['fwd'] + single['bwd']):.2f}x one device's time for the same "
             f"work, so together they ran {eff * P:.2f}x as fast as one (1.00 per GPU = the ring costs nothing)",
             f"memory per rank {peak / 2**20:.0f} MB = {mem:.2f} of one device's {single['peak'] / 2**20:.0f} MB "
             f"(1/P = {1 / P:.2f}: {HOLDS[scheme]})"]
    if shared:
        where = ("one GPU" if gpus <= 1 else f"{gpus} GPUs") if gpu else "the CPU cores"
        lines.append(f"(the {P} ranks share {where} here: this run checks the ring and shows its steps, not its speed "
                     "or its memory per GPU, since ranks compute on a shared device; run one rank per GPU, "
                     "--backend nccl, to see those)")
    return "\n".join(lines)


def _one_device(block):
    """forward, backward of one device for a block kind: flash, the attention the ring's blocks run
    (ring.one_device_forward, ring.one_device_backward: stage 06's on an sm_90 GPU where it takes the problem, else
    stages 02 and 03); naive, stage 00."""
    if block == "flash":
        return R.one_device_forward, R.one_device_backward
    from stages import naive

    return naive.forward, naive.backward


def _time(fwd, bwd, shape, dtype, xp, gpu, repeat, kw_f, kw_b, Hkv):
    """Peak memory and median times of fwd and bwd on fresh (B, H, L, D) inputs made on the device (k, v with Hkv
    heads); with a ring (kw_f has "ring"), also the per-step timeline."""
    rng = xp.random.default_rng()
    kv_shape = (shape[0], Hkv) + tuple(shape[2:])
    with PeakMemory(gpu) as mem:  # inputs included: the activations plus the kernels' (or ring's) buffers
        q, do = (cast(rng.standard_normal(shape, dtype=np.float32), dtype) for _ in range(2))
        k, v = (cast(rng.standard_normal(kv_shape, dtype=np.float32), dtype) for _ in range(2))
        o, lse = fwd(q, k, v, **kw_f)
        bwd(q, k, v, o, lse, do, **kw_b)
    # queued: calls back to back, as a training step queues them (the host prepares one call while the GPU runs
    # the one before)
    out = dict(fwd=time_queued_ms(lambda: fwd(q, k, v, **kw_f), gpu=gpu, warmup=1, repeat=repeat),
               bwd=time_queued_ms(lambda: bwd(q, k, v, o, lse, do, **kw_b), gpu=gpu, warmup=1, repeat=repeat),
               peak=mem.peak)
    if "ring" in kw_f:
        out["tl_f"], out["tl_b"] = [], []
        fwd(q, k, v, timeline=out["tl_f"], **kw_f)
        bwd(q, k, v, o, lse, do, timeline=out["tl_b"], **kw_b)
    return out


if __name__ == "__main__":
    comm_mod.run_main(lambda: 0 if main() else 1, everywhere=R.RingMismatch)  # one rank's error ends every rank
