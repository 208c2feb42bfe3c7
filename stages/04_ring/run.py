"""Stage 04: ring attention across MPI ranks (Liu, Zaharia & Abbeel 2023, arXiv 2310.01889), checked then timed.

Each rank keeps its query shard Q_r; the K_j, V_j shards travel round the ring (one step per rank), each block
is computed by a single-device kernel and the partial results are merged by their log-sum-exp. The backward
also rotates the dK_j, dV_j accumulators.

Layouts (--layout):
  contiguous  rank r holds rows [rN/P, (r+1)N/P): simple; under a causal mask rank P-1 does 2P-1 times rank 0's work.
  zigzag      rank r holds chunks r and 2P-1-r of 2P: every rank does the same causal work.
Schemes (--scheme): ring (the default: K, V travel hop by hop behind the compute), allgather (K, V gathered once, as
Llama 3 trains) or alltoall (heads scattered, as DeepSpeed-Ulysses; P must divide the heads); gather.py compares them.
Backends (--backend; auto picks and says why): nccl (a GPU per rank), mpi (CuPy staged through the host: more
ranks than GPUs), numpy (CPU). Blocks (--block): flash (stage 02 forward, stage 03 backward, and stage 06's
FlashAttention-3 where it takes the problem on an sm_90 GPU; the GPU default) or naive (stage 00; the CPU default,
where the stage 02/03 tile mirrors are exact but slow, and the GPU default where the flash kernels cannot take
--kv-heads, --window, --softcap, --alibi or --dropout in the chosen dtype, as float32). On a T4 (sm_75: no
bfloat16) the GPU default is float16. A bad option is one line from rank 0 and exit status 2 (run_options.py).

1. Check: fresh inputs cut into shards, the ring forward and the ring backward (from the fp64 oracle's o and
   lse, as stages.common.check_backward does), gathered to rank 0 and held to the tolerance rule against the
   fp64 oracle on the full sequence, with the same yardsticks as one device (verify_ring.py).
2. Time (only after the check passed): time per rank, compute and exposed communication per ring step, peak
   memory per rank, and one device on the whole sequence (rank 0 alone). Then, in words: the per-GPU efficiency
   (one device's time over P times the ring's, for the same total work: 1.00 means the ring costs nothing) and the
   memory per GPU against one device's and against 1/P.

The default sizes are where the ring pays on GPUs: 16 heads of 128 dims and 16k tokens per GPU (N = 16k P in all).
There each step's attention takes milliseconds, more than the half block it hides takes to cross NVLink. When several
ranks share one GPU (the mpi backend) the run checks the ring and shows its steps, but says nothing about speed or
memory per GPU: every rank computes on the same GPU.

    ./scripts/mpirun -n 4 python stages/04_ring/run.py                   # 4 GPUs (nccl), 1 GPU (mpi backend) or the CPU
    ./scripts/mpirun -n 4 python stages/04_ring/run.py --quick           # small, for scripts/run_all.py
    ./scripts/mpirun -n 2 python stages/04_ring/run.py --backend nccl    # 2 GPUs, one per rank
    ./scripts/mpirun -n 4 python stages/04_ring/run.py --scheme alltoall  # the same check and timing, heads scattered
    mpirun -n 8 --hostfile hosts python stages/04_ring/run.py  # 2 nodes x 4 GPUs, the system's MPI (stage 04's README)
    python stages/04_ring/run.py --help
(./scripts/mpirun is mpirun for this repository from any shell: the venv's Python on every rank, and the flags Open
MPI needs; the system's own mpirun works as well where python is the environment's on every node.)
"""
import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout: `stages` imports with no install

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before numpy loads its BLAS:
    os.environ.setdefault(_var, "1")  # one core per rank on the CPU (P ranks x all cores would thrash)

import numpy as np  # noqa: E402

import stages.hopper  # noqa: E402, F401  this launcher, not the ring, brings in stage 06: importing it registers its
# kernels (stages/common/attention_registry.py), which the ring then runs for its blocks on an sm_90 GPU
from stages import naive  # noqa: E402
from stages import ring as R  # noqa: E402
from stages.common import PeakMemory, attention_flops, bfloat16, cast, device, gpu_name, time_queued_ms  # noqa: E402
from stages.common import verify  # noqa: E402
from stages.common.attention_registry import options_in_use  # noqa: E402
from stages.common.cli import positive_int  # noqa: E402
from stages.ring import comm as comm_mod  # noqa: E402
from stages.ring.run_options import Parser, Usage, settings, usage_exit  # noqa: E402
from stages.ring.verify_ring import check_on_ranks  # noqa: E402

# ---- configuration (each overridable on the command line)
BATCH = 1  # B
# Per device (DEVICES says each in words): gpu an sm_80+ GPU, gpu_sm75 a T4, cpu the CPU (numpy backend); shared:
# several ranks on one GPU (the mpi backend), which sets only the tokens timed.
DEVICES = {"cpu": "on the CPU", "gpu": "on sm_80+ GPUs", "gpu_sm75": "on a T4 (sm_75)",
           "shared": "when ranks share a GPU (mpi backend)"}
HEADS = {"cpu": 4, "gpu": 16, "gpu_sm75": 16}  # H (2 with --quick)
HEAD_DIM = {"cpu": 64, "gpu": 128, "gpu_sm75": 64}  # D (gpu_sm75: a T4, whose 64 KB take larger tiles at d = 64)
CHECK_SEQ = 1000  # total N of the check (the fp64 oracle runs on rank 0's CPU; 256 with --quick)
# tokens per rank timed (N = P times this); --quick: 1024 per rank on GPUs, 64 on the CPU
TOKENS_PER_RANK = {"gpu": 16384, "gpu_sm75": 16384, "shared": 2048, "cpu": 250}
LAYOUT = "zigzag"  # contiguous | zigzag
REPEAT = 3  # timed calls, queued back to back
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}
DEFAULTS = dict(heads=HEADS, head_dim=HEAD_DIM, check_seq=CHECK_SEQ, tokens=TOKENS_PER_RANK, dtypes=DTYPES)


def _in_words(per_device):
    """{"cpu": 4, "gpu": 16, ...} in words, devices of one value together: "4 on the CPU, 16 on sm_80+ GPUs or ..."."""
    by_value = {}
    for dev, value in per_device.items():
        by_value.setdefault(value, []).append(DEVICES[dev])
    return ", ".join(f"{value} {' or '.join(where)}" for value, where in by_value.items())


def parse(argv):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=comm_mod.BACKENDS, default="auto",
                    help="auto: nccl with a GPU per rank, mpi with fewer GPUs than ranks, numpy without a GPU")
    ap.add_argument("--layout", choices=R.LAYOUTS, default=LAYOUT, help="how the sequence is cut into shards")
    ap.add_argument("--scheme", choices=R.SCHEMES, default="ring",
                    help="how the ranks share the keys: ring (hop by hop), allgather (K, V gathered once) or alltoall "
                         "(heads scattered; the number of ranks must divide --heads and --kv-heads)")
    ap.add_argument("--block", choices=sorted(R.BLOCKS), default=None,
                    help="per-block kernels: flash (stages 02/03, stage 06 on sm_90) or naive (stage 00); default "
                         "flash on GPUs, naive on the CPU and where the GPU's flash kernels cannot take --kv-heads, "
                         "--window, --softcap, --alibi or --dropout in the chosen dtype")
    ap.add_argument("--fwd-version", default=None, help="flash blocks: stage 02 version (default: its auto)")
    ap.add_argument("--bwd-version", default=None, help="flash blocks: stage 03 version (default: its auto)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default bfloat16 on sm_80+ GPUs, float16 on a T4 (sm_75), float32 on the CPU")
    ap.add_argument("--batch", type=positive_int, default=BATCH, help="batch size B")
    ap.add_argument("--heads", type=positive_int, default=None,
                    help=f"heads H (default {_in_words(HEADS)}; 2 with --quick)")
    ap.add_argument("--head-dim", type=positive_int, default=None,
                    help=f"head dimension D (default {_in_words(HEAD_DIM)})")
    ap.add_argument("--check-seq", type=positive_int, default=None,
                    help=f"total sequence length of the check (default {CHECK_SEQ}; 256 with --quick)")
    ap.add_argument("--seq", type=positive_int, default=None,
                    help=f"total sequence length timed (default P x the tokens per rank: {_in_words(TOKENS_PER_RANK)}; "
                         "--quick: P x 1024 on GPUs, P x 64 on the CPU)")
    ap.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    ap.add_argument("--kv-heads", type=positive_int, default=None,
                    help="k, v heads Hkv (grouped-query attention; must divide --heads; default: the same as q)")
    ap.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=None,
                    help="sliding window (left, right) around the diagonal, each >= 0 or -1 unbounded: the ring "
                         "skips the steps whose block no query sees")
    ap.add_argument("--softcap", type=float, default=None, help="S -> c tanh(S / c), c > 0")
    ap.add_argument("--alibi", action="store_true",
                    help="ALiBi with the paper's geometric slopes (S -> S - slope_h |i - j|, global distances)")
    ap.add_argument("--dropout", type=float, default=None, metavar="PROB",
                    help="dropout probability in [0, 1) (seed 0): the ring draws the one-device mask (on the GPU: "
                         "lengths of whole 16-row tiles per shard chunk, no left window side off that grid)")
    ap.add_argument("--repeat", type=positive_int, default=REPEAT, help="timed calls, queued back to back")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for scripts/run_all.py")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    world = comm_mod.world()
    try:
        ring, backend, reason = comm_mod.setup(args.backend)  # every rank decides the same
    except comm_mod.BackendError as e:
        usage_exit(str(e), world.Get_rank())
    rank, P = ring.rank, ring.size
    gpu = backend in ("nccl", "mpi")
    xp = __import__("cupy") if gpu else np
    bf16 = gpu and device.device().arch.bf16
    dev = "cpu" if not gpu else "gpu" if bf16 else "gpu_sm75"  # gpu_sm75: a T4, fp16 tensor cores, no bf16
    shared = backend != "nccl" and P > 1  # ranks share a device: the run shows the ring's steps, not its scaling
    try:
        s = settings(args, P, gpu=gpu, dev=dev, bf16=bf16, shared=shared, defaults=DEFAULTS)
    except Usage as e:
        usage_exit(str(e), rank)
    gpus = comm_mod.gpus_in_use(world) if gpu else 0  # the GPUs the P ranks compute on, over every node
    causal, layout, where = not args.no_causal, args.layout, f"GPU {gpu_name()}" if gpu else "CPU"
    if rank == 0:
        print(f"== stage 04 ring attention: {P} ranks, backend {args.backend} -> {backend} ({reason})")
        print(f"   blocks {s.block} ({_blocks_text(s, args.batch)}), scheme {args.scheme}, layout {layout}, "
              f"causal={causal}, {np.dtype(s.dtype).name}, B={args.batch} H={s.H} Hkv={s.Hkv} D={s.D}"
              + "".join(f", {key}={val}" for key, val in s.opts.items()) + f", on {where} (rank 0)")
        print("".join(f"   note: {note}\n" for note in s.notes), end="", flush=True)

    # 1. check, before any timing
    try:
        errs = check_on_ranks(world, ring, B=args.batch, H=s.H, n=s.n_check, D=s.D, dtype=s.dtype, causal=causal,
                              layout=layout, block=s.block, versions=s.versions, xp=xp, Hkv=s.Hkv, opts=s.opts,
                              scheme=args.scheme)
        ok = True
        if rank == 0:
            print(f"check on the full sequence (N={s.n_check}) against the fp64 oracle (tolerance rule): "
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
    n = s.n_time
    kw_f = dict(ring=ring, nq=n, nk=n, causal=causal, layout=layout, block=s.block, version=s.versions[0],
                scheme=args.scheme, **s.opts)
    kw_b = dict(kw_f, version=s.versions[1])
    shape = (args.batch, s.H, R.shard_len(n, P, layout), s.D)
    if rank == 0 and args.scheme == "ring":
        sched = R.schedule(P, n, n, layout=layout, causal=causal, window=s.opts.get("window"),
                           kv_shape=(args.batch, s.Hkv) + shape[2:], dtype=s.dtype)  # the ring's steps and hops
        print(f"ring schedule at N={n}: steps with work {sched['steps']} of {P}; K, V hops "
              f"{sched['kv_hops']} x {sched['kv_bytes_per_hop'] / 2**20:.2f} MB (Hkv={s.Hkv} heads), forward and "
              f"backward; in the backward dK, dV travel with K, V, then home: {sched['dkv_hops']} hops x "
              f"{sched['dkv_bytes_per_hop'] / 2**20:.2f} MB (float32)", flush=True)
    elif rank == 0:
        sent = [args.batch * x / 2**20 for x in R.traffic(args.scheme, P, shape[2], s.H, s.Hkv, s.D, s.dtype)]
        print(f"{args.scheme} at N={n}: a rank sends {sent[0]:.2f} MB per forward, {sent[1]:.2f} MB per backward, "
              "before (and after) its compute", flush=True)
    rows = world.gather(_time(R.ring_forward, R.ring_backward, shape, s.dtype, xp, gpu, args.repeat, kw_f, kw_b,
                              s.Hkv), root=0)
    if rank == 0:
        fwd, bwd = _one_device(s.block)
        vf, vb = ({"version": v} if s.block == "flash" else {} for v in s.versions)
        single = _time(fwd, bwd, (args.batch, s.H, n, s.D), s.dtype, xp, gpu, args.repeat,
                       dict(vf, causal=causal, **s.opts), dict(vb, causal=causal, **s.opts), s.Hkv)
    comm_mod.quiet_barrier(world)  # the other ranks sleep while rank 0 times one device alone
    if rank == 0:
        flops = attention_flops(args.batch, s.H, n, n, s.D, causal=causal)  # (the window's skipped pairs too)
        print(f"\ntimed on {where}: total N={n} ({shape[2]} rows per rank), {args.repeat} calls back to back")
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


def _blocks_text(s, batch):
    """What computes the blocks, forward and backward: stage 00, stages 02/03 or the registered stage 06."""
    if s.block == "naive":
        return "stage 00"
    shape = dict(H=s.H, Hkv=s.Hkv, B=batch, options=options_in_use(**s.opts))  # as compute.py asks for the blocks
    fwd = R.compute.registered_for(s.dtype, s.D, version=s.versions[0], **shape)
    bwd = R.compute.registered_for(s.dtype, s.D, version=s.versions[1], backward=True, **shape)
    return (f"{fwd.name if fwd else f'stage 02 version {s.versions[0]}'}, "
            f"{bwd.name + ' backward' if bwd else f'stage 03 version {s.versions[1]}'}")


HOLDS = {  # why a rank holds more than 1/P, by scheme (stage 04's README and gather.py say what each costs)
    "ring": "a rank also holds its accumulators and the block in flight; stages/04_ring/README.md, Memory per GPU, "
            "says what each buffer costs",
    "allgather": "a rank also holds K, V of the whole sequence, and in the backward their float32 gradients",
    "alltoall": "a rank also holds its heads over the whole sequence, about its shards' size again",
}


def report(P, single, t_f, t_b, peak, *, shared, gpu, scheme="ring", gpus=1):
    """What the timing says, in words: per-GPU efficiency and memory per GPU against one device (and 1/P). gpus: how
    many GPUs the P ranks run on (shared: fewer than P, and then neither figure means anything: the note says so
    first and only the times and sizes follow)."""
    ratio = (t_f + t_b) / (single["fwd"] + single["bwd"])  # the ring's time over one device's, same total work
    mb = f"{peak / 2**20:.1f} MB", f"{single['peak'] / 2**20:.1f} MB"  # a rank's peak, one device's (as the table)
    if shared:
        where = ("one GPU" if gpus <= 1 else f"{gpus} GPUs") if gpu else "the CPU cores"
        return "\n".join([
            f"(the {P} ranks share {where} here: this run checks the ring and shows its steps, not its speed or its "
            "memory per GPU, since ranks compute on a shared device; run one rank per GPU, --backend nccl, to see "
            "those)",
            f"so no per-GPU efficiency here: the {P} ranks took {ratio:.2f}x one device's time for the same work; "
            f"memory per rank {mb[0]}, one device {mb[1]}"])
    eff = (single["fwd"] + single["bwd"]) / (P * (t_f + t_b))
    mem = peak / max(single["peak"], 1)
    e_f, e_b = single["fwd"] / (P * t_f), single["bwd"] / (P * t_b)
    why = f": {HOLDS[scheme]}" if mem > 1 / P else ""  # the reason only where the figure is above 1/P
    return "\n".join([
        f"per-GPU efficiency {eff:.2f} (fwd {e_f:.2f}, bwd {e_b:.2f}): the {P} ranks took {ratio:.2f}x one device's "
        f"time for the same work, so together they ran {eff * P:.2f}x as fast as one (1.00 per GPU = the ring costs "
        "nothing)",
        f"memory per rank {mb[0]} = {mem:.2f} of one device's {mb[1]} (1/P = {1 / P:.2f}{why})"])


def _one_device(block):
    """forward, backward of one device for a block kind: flash, the attention the ring's blocks run
    (ring.one_device_forward, ring.one_device_backward: stage 06's on an sm_90 GPU where it takes the problem, else
    stages 02 and 03); naive, stage 00."""
    if block == "flash":
        return R.one_device_forward, R.one_device_backward
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
