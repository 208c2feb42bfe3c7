"""Sequence-parallel training of stage 05 on 1, 2 and 4 GPUs: tokens/s at one context, and the longest context.

What is measured. The stage 05 GPT (default 4 layers, d_model 512, 4 heads of dim 128, bfloat16 activations with
float32 master weights, batch 1) is trained through stage 04's ring (zigzag layout, one process per GPU, NCCL),
for each ring size P = 1, 2, 4 in one launch: the first P ranks form the ring (a sub-communicator), the others wait.

  1. Speed at a fixed context (default 131072 tokens, the same model and the same total work at every P; long
     enough that each GPU's share of a step outweighs the host's fixed work per step, which does not shrink with P):
     WARMUP untimed training steps, then STEPS timed ones. A step is everything the training loop does: the
     batch, the forward, the backward, the gradient sum over the ranks, the clipping and the AdamW step, ending
     with the one read of the loss that makes the host wait for the GPU. The median step time of the slowest rank
     gives tokens/s = batch * context / step time, and speedup = tokens/s at P / tokens/s at P = 1.
     P = 1 is the same ring code with one rank: each attention is one kernel call and nothing is communicated
     (CSV column one_gpu_attention).
  2. The longest trainable context under a per-GPU memory cap (CuPy's memory pool limit, default 8 GiB, the same
     at every P, so that the search is quick and the P's are compared under the same budget): contexts double from
     SEARCH_START while they fit, then bisection down to 1/8 of the last context that fitted. A context fits when
     TRIAL_STEPS training steps finish on every rank without running out of pool memory. Each rank's outcome is
     gathered over the sub-communicator, so every rank takes the same verdict and the next trial starts together
     (any other error on any rank stops every rank). The ranks of a ring hold arrays of the same shapes and
     allocate them in nearly the same order, so they run out at the same allocation; should one rank run out while
     another already waits for it in a transfer, that trial would never end: a watchdog ends the job after
     TRIAL_TIMEOUT_S, with a message, and the rows of the ring sizes done so far are already in the CSV.
     Contexts are multiples of 2P (zigzag).
     On the numpy backend (a CPU run, which checks this script rather than measuring scaling) the ranks share the
     host's memory, which no pool cap bounds: the context and the search are small (CPU_CONTEXT, CPU_SEARCH_START
     up to CPU_SEARCH_MAX).
     What does not shrink with P: the parameters, their gradients and AdamW's moments, on every rank; the position
     table among them has one row per token of the context.

Why. Splitting the sequence splits the attention and the activations over the GPUs, but every step also sums the
parameter gradients over the ranks (stage 05's loop.py: the ring's allreduce_sum, one NCCL all-reduce on the GPUs), a
cost that does not shrink with P; the speedup says whether the split pays at this context.

    ./scripts/mpirun -n 4 python dev/train_scaling.py --out results/train_gpt_scaling.csv   # 4 GPUs: P = 1, 2, 4
    ./scripts/mpirun -n 2 python dev/train_scaling.py --context 16384 --no-search           # quicker, P = 1, 2
    ./scripts/mpirun -n 2 python dev/train_scaling.py --backend numpy --context 64 --layers 1 --d-model 32 --heads 2 \\
        --steps 2 --no-search                                                               # CPU smoke run (seconds)
Every CSV row names the GPU, the backend, the sizes, the git commit and the CuPy version.
"""
import argparse
import csv
import os
import pathlib
import sys
import threading

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # CPU smoke run: one core per rank
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from stages import train_gpt as T  # noqa: E402
from stages.common import code_version, gpu_name  # noqa: E402
from stages.common.cli import nonnegative_int, positive_int  # noqa: E402
from stages.ring import comm as comm_mod  # noqa: E402
from stages.train_gpt.command import DTYPES, device_facts  # noqa: E402

# ---- configuration (each overridable on the command line)
LAYERS, D_MODEL, HEADS = 4, 512, 4  # head dim 128: stages 02/03 take it in bfloat16
DTYPE = "bfloat16"  # activations on GPUs (float32 on the numpy backend)
BATCH = 1  # sequences per step
CONTEXT = 131072  # tokens per sequence of the speed runs: the same total work at every P
CPU_CONTEXT = 256  # the same on the numpy backend (a CPU run checks the script, not the scaling)
WARMUP, STEPS = 2, 5  # untimed, then timed training steps (median)
LR = 1e-3
LAYOUT = "zigzag"
SIZES = (1, 2, 4, 8)  # ring sizes, up to the number of ranks
SEARCH_START = 16384  # the first context of the longest-context search
SEARCH_MAX = 1 << 22  # the doubling stops here
CPU_SEARCH_START, CPU_SEARCH_MAX = 256, 2048  # the same on the numpy backend (no memory cap: a bound instead)
RESOLUTION = 8  # the bisection stops when the gap is at most 1/RESOLUTION of the last context that fitted
MEM_CAP_GIB = 8.0  # CuPy memory pool limit per GPU during the search
TRIAL_STEPS = 2  # training steps of one search trial (the second reuses the first's memory)
TRIAL_TIMEOUT_S = 180  # a trial still running after this ends the job (a rank waits for one that has stopped)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=comm_mod.BACKENDS, default="auto",
                    help="default auto: nccl with one GPU per rank; numpy for the CPU smoke run")
    ap.add_argument("--gpus", type=positive_int, nargs="+", default=None,
                    help=f"ring sizes (default: those of {SIZES} up to the number of ranks)")
    ap.add_argument("--layers", type=positive_int, default=LAYERS, help=f"default {LAYERS}")
    ap.add_argument("--d-model", type=positive_int, default=D_MODEL, help=f"default {D_MODEL}")
    ap.add_argument("--heads", type=positive_int, default=HEADS, help=f"default {HEADS}")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help=f"activations (default {DTYPE} on GPUs, float32 on the numpy backend)")
    ap.add_argument("--batch", type=positive_int, default=BATCH, help=f"default {BATCH}")
    ap.add_argument("--context", type=positive_int, default=None,
                    help=f"tokens per sequence of the speed runs, a multiple of 2 x the largest ring "
                         f"(default {CONTEXT} on GPUs, {CPU_CONTEXT} on the numpy backend)")
    ap.add_argument("--warmup", type=nonnegative_int, default=WARMUP, help=f"untimed steps (default {WARMUP})")
    ap.add_argument("--steps", type=positive_int, default=STEPS, help=f"timed steps, median (default {STEPS})")
    ap.add_argument("--no-search", action="store_true", help="skip the longest-context search (default: search)")
    ap.add_argument("--mem-cap-gib", type=float, default=MEM_CAP_GIB,
                    help=f"per-GPU CuPy pool limit during the search (default {MEM_CAP_GIB}; none on the CPU)")
    ap.add_argument("--search-start", type=positive_int, default=None,
                    help=f"first context of the search (default {SEARCH_START}; {CPU_SEARCH_START} on the numpy "
                         "backend)")
    ap.add_argument("--search-max", type=positive_int, default=None,
                    help=f"largest context the search tries (default {SEARCH_MAX}; {CPU_SEARCH_MAX} on the numpy "
                         "backend, whose ranks share the host's memory, which no pool cap bounds)")
    ap.add_argument("--trial-timeout", type=positive_int, default=TRIAL_TIMEOUT_S,
                    help=f"seconds after which a search trial ends the job (default {TRIAL_TIMEOUT_S})")
    ap.add_argument("--out", default=None,
                    help="write the rows to this CSV file, rewritten after each ring size (default: none, print only)")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------- one training run
def model(args, context):
    """(config, data) of the measured GPT at `context` tokens (the recall task: batches drawn on the host)."""
    data = T.RecallTask(context, seed=0)
    return T.GPTConfig(vocab_size=data.vocab_size, context=context, n_layer=args.layers, d_model=args.d_model,
                       n_head=args.heads), data


def train_steps(ring, args, context, steps, xp, dtype, block):
    """`steps` training steps at `context` on this rank; the seconds each step took."""
    cfg, data = model(args, context)
    hist = T.train(cfg, data, attention="ring", steps=steps, batch=args.batch, lr=LR, seed=0, dtype=dtype, xp=xp,
                   ring=ring, layout=LAYOUT, ring_block=block)
    return np.diff([0.0] + hist["time_s"])  # time_s: since the start, after each step's read of the loss


def free_memory(xp):
    if xp is not np:
        xp.cuda.Device().synchronize()
        xp.get_default_memory_pool().free_all_blocks()


def step_seconds(ring, sub, args, xp, dtype, block):
    """Median time of the timed steps, of the slowest rank of the ring."""
    times = train_steps(ring, args, args.context, args.warmup + args.steps, xp, dtype, block)[args.warmup:]
    free_memory(xp)
    return max(sub.allgather(float(np.median(times))))


# ---------------------------------------------------------------------------- the longest context
def trial(ring, args, context, xp, dtype, block):
    """This rank's outcome of TRIAL_STEPS training steps at `context`: "ok", "oom" or "error: ..."."""
    oom = xp.cuda.memory.OutOfMemoryError if xp is not np else MemoryError
    what = f"search trial at context {context} on a ring of {ring.size}"
    watchdog = threading.Timer(args.trial_timeout, comm_mod.abort, args=(TimeoutError(
        f"{what} still running after {args.trial_timeout} s: a rank probably ran out of memory while another waits "
        "for it in a transfer"),))
    watchdog.daemon = True
    watchdog.start()
    try:
        train_steps(ring, args, context, TRIAL_STEPS, xp, dtype, block)
        return "ok"
    except oom:
        return "oom"
    except Exception as e:  # noqa: BLE001 - reported to every rank by agreed()
        return f"error: {type(e).__name__}: {e}"
    finally:
        watchdog.cancel()


def agreed(allgather, outcome):
    """Every rank's trial outcome (allgather: the sub-communicator's) -> True when the context fitted on every rank,
    False when a rank ran out of memory; any other error on any rank is raised on every rank."""
    every = allgather(outcome)
    errors = [(r, o) for r, o in enumerate(every) if o not in ("ok", "oom")]
    if errors:
        raise RuntimeError(f"search trial failed on rank {errors[0][0]}: {errors[0][1]}")
    return "oom" not in every


def longest_context(fits, start, unit, limit):
    """(n, limited_by): the longest context n (a multiple of unit, at most limit) for which fits(n) is True.

    Doubles from start while fits; if even start does not fit, halves until one does. Then bisects between the last
    context that fitted and the first that did not, until the gap is at most 1/RESOLUTION of the one that fitted.
    limited_by: "memory", or "search_max" when every context up to limit fitted (n = 0: not even `unit` fits)."""
    def down(n):  # a multiple of unit, at least unit
        return max(unit, n // unit * unit)

    n, good, bad, limit = down(start), 0, None, down(limit)
    while bad is None:
        if not fits(n):
            bad = n
        elif n >= limit:
            return n, "search_max"
        else:
            good, n = n, min(down(2 * n), limit)
    while good == 0 and n > unit:  # the start did not fit: halve down
        n = down(n // 2)
        if fits(n):
            good = n
        else:
            bad = n
    if good == 0:
        return 0, "memory"
    while bad - good > max(unit, good // RESOLUTION):
        mid = down((good + bad) // 2)
        if mid <= good:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, "memory"


def search(ring, sub, args, xp, dtype, block, say):
    """(longest context, limited_by, trials) of this ring under the memory cap (none on the CPU)."""
    P, tried = ring.size, []
    pool = xp.get_default_memory_pool() if xp is not np else None
    if pool is not None:
        free_memory(xp)
        pool.set_limit(size=int(args.mem_cap_gib * 2**30))

    def fits(n):
        ok = agreed(sub.allgather, trial(ring, args, n, xp, dtype, block))
        free_memory(xp)
        tried.append(n)
        say(f"    P={P} context {n:>8}: {'fits' if ok else 'out of memory'}")
        return ok

    try:
        n, why = longest_context(fits, args.search_start, 2 * P, args.search_max)
    finally:
        if pool is not None:
            pool.set_limit(size=0)  # 0: no limit
    return n, why, len(tried)


# ---------------------------------------------------------------------------- rows, provenance
def provenance():
    """The code this run measured (git commit) and the CuPy version."""
    commit = code_version()
    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = "absent"
    return {"git_commit": commit, "cupy": cupy_version}


def print_table(rows):
    print(f"\n{'GPUs':>4} {'context':>8} {'step ms':>9} {'tokens/s':>10} {'speedup':>8} {'longest context':>16}")
    for r in rows:
        longest = r["longest_context"] if r["longest_context"] != "" else "-"
        print(f"{r['gpus']:>4} {r['context']:>8} {r['step_ms']:>9} {r['tokens_per_s']:>10} {r['speedup']:>8} "
              f"{longest:>16}")


def write_csv(path, rows):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# ---------------------------------------------------------------------------- main
def check(args, sizes, size, dtype, xp):
    """(block, its description, error): the ring's blocks for this model and device, and what is wrong ("" if
    nothing). Every rank finds the same."""
    if max(sizes) > size:
        return None, None, f"--gpus {max(sizes)} needs at least that many ranks; started with {size}"
    if args.context % (2 * max(sizes)):
        return None, None, f"--context {args.context} must be a multiple of {2 * max(sizes)} (2 x the largest ring)"
    try:
        T.GPTConfig(vocab_size=8, d_model=args.d_model, n_head=args.heads)  # d_model splits into the heads
        block, text = T.ring_blocks(None, dtype=DTYPES[dtype], head_dim=args.d_model // args.heads,
                                    **device_facts(xp))
        text += T.hopper_ring_text(block, DTYPES[dtype], args.d_model // args.heads, heads=args.heads,
                                   batch=args.batch, gpu=xp is not np)
    except ValueError as e:
        return None, None, str(e)
    return block, text, ""


def measure(world, P, backend, args, xp, dtype, block, say):
    """On a ring of the first P ranks: (step seconds, (longest context, limited by, trials)), on every rank."""
    rank = world.Get_rank()
    sub = world.Split(0 if rank < P else 1, rank)  # the first P ranks form this ring
    got = None
    if rank < P:
        ring = comm_mod.RINGS[backend](sub)
        step_s = step_seconds(ring, sub, args, xp, dtype, block)
        got = step_s, (("", "", 0) if args.no_search else search(ring, sub, args, xp, dtype, block, say))
    comm_mod.quiet_barrier(world)  # the ranks outside this ring sleep here
    got = world.bcast(got, root=0)  # rank 0 is in every ring
    sub.Free()
    free_memory(xp)
    return got


def make_row(args, name, P, backend, dtype, block, step_s, longest, prov, gpu):
    n_long, why, trials = longest
    return dict(
        gpu=name, gpus=P, backend=backend, dtype=dtype, layers=args.layers, d_model=args.d_model, heads=args.heads,
        head_dim=args.d_model // args.heads, batch=args.batch, context=args.context, layout=LAYOUT, ring_blocks=block,
        one_gpu_attention="ring with 1 rank", warmup_steps=args.warmup, timed_steps=args.steps,
        step_ms=round(1e3 * step_s, 2), tokens_per_s=round(args.batch * args.context / step_s), speedup="",
        longest_context=n_long, longest_limited_by=why, search_trials=trials,
        mem_cap_gib="" if args.no_search else (args.mem_cap_gib if gpu else "none"), **prov)


def main(argv=None):
    args = parse(argv)
    world = comm_mod.world()
    rank, size = world.Get_rank(), world.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    backend, reason = comm_mod.select(args.backend)  # every rank agrees; this rank's GPU is now current
    gpu = backend in ("nccl", "mpi")
    xp = __import__("cupy") if gpu else np
    sizes = args.gpus or [p for p in SIZES if p <= size]
    dtype = args.dtype or (DTYPE if gpu else "float32")
    args.context = args.context or (CONTEXT if gpu else CPU_CONTEXT)  # the sizes of this device
    args.search_start = args.search_start or (SEARCH_START if gpu else CPU_SEARCH_START)
    args.search_max = args.search_max or (SEARCH_MAX if gpu else CPU_SEARCH_MAX)
    block, blocks, error = check(args, sizes, size, dtype, xp)
    if error:
        say(f"train_scaling.py: error: {error}", flush=True)
        return 2
    name, prov = gpu_name() if gpu else "CPU", provenance()
    say(f"== stage 05 training on rings of {sizes} ranks: {name}, backend {backend} ({reason}); GPT {args.layers} "
        f"layers, d_model {args.d_model}, {args.heads} heads, {dtype}, batch {args.batch}, context {args.context}; "
        f"ring blocks {blocks}; commit {prov['git_commit']}", flush=True)
    if backend != "nccl":
        say(f"   ({backend} backend: ranks share {'GPUs' if gpu else 'CPU cores'}, so these numbers show overhead, not "
            "scaling)", flush=True)
    rows = []
    for P in sizes:
        step_s, longest = measure(world, P, backend, args, xp, dtype, block, say)
        rows.append(make_row(args, name, P, backend, dtype, block, step_s, longest, prov, gpu))
        base = next((r for r in rows if r["gpus"] == 1), None)
        if base:
            rows[-1]["speedup"] = round(rows[-1]["tokens_per_s"] / base["tokens_per_s"], 3)
        r = rows[-1]
        say(f"P={P}: step {r['step_ms']} ms, {r['tokens_per_s']} tokens/s, speedup {r['speedup'] or '-'}"
            + (f", longest context {longest[0]} ({longest[1]}, {longest[2]} trials)" if longest[0] != "" else ""),
            flush=True)
        if rank == 0 and args.out:
            write_csv(args.out, rows)  # after each ring size: a later failure keeps these rows
    if rank == 0:
        print_table(rows)
        print(f"wrote {len(rows)} rows to {args.out}" if args.out else "(pass --out FILE.csv to keep these rows)")
    return 0


if __name__ == "__main__":
    comm_mod.run_main(main)  # one rank's error ends every rank (never a hang)
