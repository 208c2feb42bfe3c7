"""Does stage 05's default GPT run learn under every seed? train.py's default config (or what the options change) for
seeds 0-7, one after the other in one process (on a GPU the kernels compile once), one CSV row per seed.

    python dev/gpt_seeds.py                                     # CPU, float32, naive: results/gpt_seeds_cpu.csv
    python dev/gpt_seeds.py --device gpu --attention naive flash_v2   # GPU, bfloat16 (sm_80+): gpt_seeds_<gpu>.csv
    python dev/gpt_seeds.py --device gpu --dtype float32 --seeds 0 1 2 3 --out /tmp/seeds.csv
    python dev/gpt_seeds.py --device cpu -- --steps 600         # after --, any train.py option (the same checks)

Several --attention and --dtype values run every pair of them, one after the other, in the same process.

Columns: commit, device, dtype, attention, seed, steps, final_loss, final_accuracy (the last step's batch, what
train.py prints as "final accuracy"), learned (train.py's verdict: the loss clearly fell), seconds (the training
loop's wall time), date. The exit status is 1 when a seed ends below --min-accuracy (0.95), so a script can check it.
"""
import argparse
import csv
import datetime
import importlib
import os
import pathlib
import platform
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before numpy loads its BLAS, as
    os.environ.setdefault(_var, "1")  # train.py sets them: the CPU configs' matrices are too small for BLAS threads

import stages.hopper  # noqa: E402, F401  registers stage 06's kernels: flash_v2 and the ring's blocks on sm_90
from stages.train_gpt import command as train_script  # noqa: E402  (the command line train.py runs)
from stages.common import code_version  # noqa: E402

loop = importlib.import_module("stages.train_gpt.loop")
speed = importlib.import_module("stages.train_gpt.speed")
COLUMNS = ["commit", "device", "dtype", "attention", "seed", "steps", "final_loss", "final_accuracy", "learned",
           "seconds", "date"]


def device_name(xp):
    """The GPU's name, or the CPU's model name and core count ("cpu" in the file name)."""
    if xp.__name__ == "cupy":
        from stages.common import gpu_name

        return gpu_name()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model} ({os.cpu_count()} cores)"


def short_name(device):
    """'cpu', or a GPU's short name for the file: 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    if "(" in device and "cores" in device:
        return "cpu"
    words = [w for w in device.replace("NVIDIA", "").split() if any(c.isdigit() for c in w)]
    return (words[0] if words else device.split()[-1]).lower()


def run_seed(args, seed, xp, log):
    """One seed of the config in args: (final_loss, final_accuracy, learned, seconds)."""
    args.seed = seed
    prep = train_script.prepare(args, None, xp)
    t0 = time.perf_counter()
    hist = loop.train(prep["cfg"], prep["data"], attention=args.attention, steps=args.steps, batch=args.batch,
                      lr=args.lr, seed=seed, dtype=prep["dtype"], xp=xp)
    seconds = time.perf_counter() - t0
    ok = loop.learned(hist["loss"], prep["data"].chance_loss)[0]
    log(f"{args.attention} {prep['dtype']} seed {seed}: final loss {hist['loss'][-1]:.4f}, final accuracy "
        f"{hist['acc'][-1]:.3f}, {'learned' if ok else 'did not learn'}, {seconds:.1f} s")
    return hist["loss"][-1], hist["acc"][-1], ok, seconds, prep["dtype"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("train_options", nargs="*", metavar="-- TRAIN_OPTION",
                    help="after --: train.py's options, checked by train.py's parser")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="default cpu")
    ap.add_argument("--dtype", nargs="+", default=[None], choices=sorted(loop.DTYPES),
                    help="activations (default: train.py's, bfloat16 on an sm_80+ GPU, float32 on the CPU)")
    ap.add_argument("--attention", nargs="+", default=["naive"], choices=("naive", "flash_v1", "flash_v2"),
                    help="default naive")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)), help="default 0 1 2 3 4 5 6 7")
    ap.add_argument("--min-accuracy", type=float, default=0.95,
                    help="exit status 1 if a seed's final accuracy is below this (default 0.95)")
    ap.add_argument("--out", default=None, help="the CSV (default results/gpt_seeds_<device>.csv)")
    args = ap.parse_args(argv)
    runs = [train_script.parse(["--device", args.device, "--attention", attention,
                                *(["--dtype", dtype] if dtype else []), *args.train_options])
            for dtype in args.dtype for attention in args.attention]
    xp = train_script._device_xp(runs[0].device)
    if xp.__name__ == "numpy":
        speed.reuse_freed_memory()  # as train.py's CPU runs do
    device = device_name(xp)
    out = pathlib.Path(args.out or ROOT / "results" / f"gpt_seeds_{short_name(device)}.csv")
    first = runs[0]
    print(f"stage 05 default config ({first.steps} steps, batch {first.batch}, context {first.context}, lr "
          f"{first.lr}), attention {' and '.join(args.attention)}, on {device}, seeds {args.seeds} -> {out}",
          flush=True)
    commit, rows = code_version(), []
    for run_args in runs:
        warm = train_script.prepare(run_args, None, xp)  # two steps first: a GPU's kernels compile outside the timing
        loop.train(warm["cfg"], warm["data"], attention=run_args.attention, steps=2, batch=2, dtype=warm["dtype"],
                   xp=xp)
        for seed in args.seeds:
            loss, acc, ok, seconds, dtype = run_seed(run_args, seed, xp, lambda s: print(s, flush=True))
            rows.append({"commit": commit, "device": device, "dtype": dtype, "attention": run_args.attention,
                         "seed": seed, "steps": run_args.steps, "final_loss": f"{loss:.4f}",
                         "final_accuracy": f"{acc:.4f}", "learned": ok, "seconds": f"{seconds:.3f}",
                         "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")})
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    low = [f"{r['attention']} {r['dtype']} seed {r['seed']}" for r in rows
           if float(r["final_accuracy"]) < args.min_accuracy]
    print(f"wrote {out}; final accuracy {min(float(r['final_accuracy']) for r in rows):.3f} to "
          f"{max(float(r['final_accuracy']) for r in rows):.3f} over {len(rows)} runs; "
          + (f"below {args.min_accuracy}: {', '.join(low)}" if low else f"every run >= {args.min_accuracy}"))
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
