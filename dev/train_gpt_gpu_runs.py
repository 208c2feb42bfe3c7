"""Stage 05 on a GPU, in one invocation (sized for a few minutes): every measurement the stage reports.

    python dev/train_gpt_gpu_runs.py                 # all parts
    python dev/train_gpt_gpu_runs.py --parts 1 2     # some of them
    python dev/train_gpt_gpu_runs.py --quick         # fewer steps and lengths (a smoke run)

  1. torch.autograd.Function over stages 02/03 (torch_attention.py) against scaled_dot_product_attention:
     forward and backward, fp16, bf16, fp32, causal and not, by the repository's tolerance rule.
  2. Ours (CuPy, flash_v2 attention) against the PyTorch twin (torch_gpt.py, SDPA), the same initial weights and
     data order, in float32 and in bfloat16 mixed precision, on the recall task and on characters of this
     repository's text; also the twin with our kernels dropped in, and the twin with SDPA's math backend (PyTorch
     against itself: the yardstick for how far two correct runs drift apart).
     -> results/train_gpt_vs_torch.csv and .png (with the max |loss difference| per task and dtype in the summary).
  3. Long context: 6 layers, d_model 384, 6 heads, bf16, batch 1, context 4096 upwards: tokens/s and peak GPU
     memory of a training step with flash_v2 and with naive attention, up to the length where naive runs out
     of memory. -> results/train_gpt_long_context.csv
  4. Sequence-parallel training through the ring on this one GPU (mpirun -n 4, mpi backend, both layouts)
     against the single-device run. -> results/train_gpt_ring_gpu.csv
Each part runs in its own try/except: a failure prints a FAILED line and the other parts still run. Every CSV
row carries its provenance: git commit, GPU, CuPy and torch versions, date.
"""
import argparse
import csv
import datetime
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import stages.hopper  # noqa: E402, F401  registers stage 06's kernels: flash_v2 and the ring's blocks on sm_90
from stages import train_gpt as T  # noqa: E402
from stages.common import PeakMemory, code_version, gpu_name, has_gpu  # noqa: E402

RESULTS = ROOT / "results"


def provenance():
    import cupy

    try:
        import torch

        tv = torch.__version__
    except ImportError:
        tv = "absent"
    return {"git_commit": code_version(), "gpu": gpu_name(), "cupy": cupy.__version__, "torch": tv,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def write_csv(path, rows, prov):
    RESULTS.mkdir(exist_ok=True)
    keys = list(rows[0]) + list(prov)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({**r, **prov})
    print(f"wrote {path.relative_to(ROOT)}")


def free_gpu():
    import cupy

    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    try:
        import torch

        torch.cuda.empty_cache()
    except ImportError:
        pass


# --------------------------------------------------------------------------- 1
def part1(args, prov):
    from stages.train_gpt import torch_attention as TA

    ok_all = True
    for dtype in ("float16", "bfloat16", "float32"):
        for causal in (True, False):
            r = TA.check_against_sdpa(dtype, seed=args.seed, causal=causal)
            ok_all &= r["ok"]
            errs = "  ".join(f"{k} {v[0]:.2e} (sdpa {v[1]:.2e}, bound {v[2]:.2e})" for k, v in r.items() if k != "ok")
            print(f"  autograd.Function {dtype:8s} {'causal' if causal else 'full  '}: "
                  f"{'OK' if r['ok'] else 'OUT OF TOLERANCE'}  {errs}")
    return ok_all, "autograd.Function vs SDPA, fp16/bf16/fp32, causal and not: " + ("within" if ok_all else "OUT OF") \
        + " tolerance"


# --------------------------------------------------------------------------- 2
# A config that learns the recall task in a few hundred steps (head dim 64: every kernel version takes it), so the
# two curves are compared while they fall, not while both sit at chance. Recall learns in a jump after a plateau
# (the model must first find the key it is asked about), and when the jump comes depends on rounding: two runs that
# differ only in the order of a sum leave the plateau at different steps. So the same GPT is also trained twice by
# PyTorch itself (SDPA's default backend, and its math backend: same maths, another summation order), whose
# difference is the yardstick for ours; and on characters of the repository's own text, a task without a plateau.
VS_TORCH = dict(context=64, n_layer=2, d_model=128, n_head=2)
VS_TORCH_TASK = dict(n_values=8)
TEXT_FILES = ["README.md", "docs/DESIGN.md", "stages/00_naive/README.md", "stages/02_flash_v2/README.md",
              "stages/04_ring/README.md"]


def _text_data(context, seed):
    """TextData over the repository's own documentation (nothing downloaded), through one temporary file."""
    text = "\n".join((ROOT / f).read_text(encoding="utf-8") for f in TEXT_FILES)
    tmp = pathlib.Path(tempfile.mkdtemp()) / "repository_text.txt"
    tmp.write_text(text, encoding="utf-8")
    return T.TextData(tmp, context, seed=seed)


def part2(args, prov):
    import cupy

    from stages.train_gpt import torch_gpt as TG

    steps = 60 if args.quick else 300
    batch, lr = 32, 3e-3
    tasks = {"recall": T.RecallTask(VS_TORCH["context"], seed=args.seed, **VS_TORCH_TASK),
             "text": _text_data(VS_TORCH["context"], args.seed)}
    rows, summary = [], []
    for task, data in tasks.items():
        cfg = T.GPTConfig(vocab_size=data.vocab_size, **VS_TORCH)
        for dtype in ("float32", "bfloat16"):
            print(f"  {task}, {dtype}: ours (CuPy, flash_v2), torch (SDPA), torch (SDPA math), torch + ours ...",
                  flush=True)
            runs = {"ours": lambda: T.train(cfg, data, attention="flash_v2", steps=steps, batch=batch, lr=lr,
                                            seed=args.seed, dtype=dtype, xp=cupy)}
            for name, att in (("torch", "sdpa"), ("torch_math", "sdpa_math"), ("torch_ours", "ours")):
                runs[name] = (lambda att=att: TG.train(cfg, data, steps=steps, batch=batch, lr=lr, seed=args.seed,
                                                       dtype=dtype, attention=att))
            hist = {}
            for name, fn in runs.items():
                hist[name] = fn()
                free_gpu()
            a, b, m, c = (np.array(hist[n]["loss"]) for n in ("ours", "torch", "torch_math", "torch_ours"))
            for i in range(steps):
                rows.append({"task": task, "dtype": dtype, "step": i, "loss_ours": f"{a[i]:.6f}",
                             "loss_torch_sdpa": f"{b[i]:.6f}", "loss_torch_sdpa_math": f"{m[i]:.6f}",
                             "loss_torch_our_attention": f"{c[i]:.6f}",
                             "abs_diff_ours_vs_torch": f"{abs(a[i] - b[i]):.3e}",
                             "abs_diff_torch_math_vs_torch": f"{abs(m[i] - b[i]):.3e}",
                             "time_s_ours": f"{hist['ours']['time_s'][i]:.3f}",
                             "time_s_torch": f"{hist['torch']['time_s'][i]:.3f}"})
            d, dm, d2 = (float(np.max(np.abs(x - b))) for x in (a, m, c))
            summary.append(f"{task} {dtype}: max |ours - torch| {d:.2e}, max |torch math - torch| {dm:.2e}, "
                           f"max |torch+our attention - torch| {d2:.2e}, final loss ours {a[-1]:.3f} torch {b[-1]:.3f} "
                           f"(chance {data.chance_loss:.2f})")
            print("  " + summary[-1])
    write_csv(RESULTS / "train_gpt_vs_torch.csv", rows, prov)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        for row_axes, (task, data) in zip(axes, tasks.items()):
            for ax, dtype in zip(row_axes, ("float32", "bfloat16")):
                rs = [r for r in rows if r["dtype"] == dtype and r["task"] == task]
                s = [r["step"] for r in rs]
                ax.plot(s, [float(r["loss_torch_sdpa"]) for r in rs], label="PyTorch (SDPA)", lw=3, alpha=0.5)
                ax.plot(s, [float(r["loss_torch_sdpa_math"]) for r in rs], ":", label="PyTorch (SDPA math)", lw=1.5)
                ax.plot(s, [float(r["loss_ours"]) for r in rs], label="ours (CuPy, flash_v2)", lw=1)
                ax.plot(s, [float(r["loss_torch_our_attention"]) for r in rs], "--", label="PyTorch + our attention",
                        lw=1)
                ax.axhline(data.chance_loss, color="gray", ls=":", label="chance")
                ax.set(title=f"{task}, {dtype}: GPT {VS_TORCH['n_layer']}L d{VS_TORCH['d_model']} "
                             f"N{VS_TORCH['context']}", xlabel="step", ylabel="loss")
                ax.legend(fontsize=8)
        fig.suptitle(f"{prov['gpu']}, commit {prov['git_commit']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(RESULTS / "train_gpt_vs_torch.png", dpi=100)
        print(f"wrote {(RESULTS / 'train_gpt_vs_torch.png').relative_to(ROOT)}")
    except Exception as e:  # noqa: BLE001 - the CSV is what counts
        print(f"  (no plot: {type(e).__name__}: {e})")
    return True, "; ".join(summary)


# --------------------------------------------------------------------------- 3
LONG = dict(n_layer=6, d_model=384, n_head=6)


def _is_oom(e):
    text = f"{type(e).__name__}: {e}".lower()
    return "outofmemory" in text.replace(" ", "") or "out of memory" in text or "cublas_status_alloc_failed" in text


def part3(args, prov):
    import cupy

    contexts = [4096, 8192] if args.quick else [4096, 8192, 16384, 32768, 65536]
    steps = 3 if args.quick else 4
    rows, naive_oom_at = [], None
    for n in contexts:
        for attention in ("flash_v2", "naive"):
            row = {"attention": attention, "context": n, "batch": 1, "dtype": "bfloat16", **LONG}
            if attention == "naive" and naive_oom_at is not None:
                rows.append({**row, "status": f"not run (OOM at {naive_oom_at})", "tokens_per_s": "",
                             "peak_mem_gib": "", "step_ms": ""})
                continue
            data = T.RecallTask(n, n_values=16, seed=args.seed)
            cfg = T.GPTConfig(vocab_size=data.vocab_size, context=n, **LONG)
            free_gpu()
            try:
                with PeakMemory(gpu=True) as pm:
                    h = T.train(cfg, data, attention=attention, steps=steps, batch=1, lr=1e-3, seed=args.seed,
                                dtype="bfloat16", xp=cupy)
                t = np.diff([0.0] + h["time_s"])[1:]  # per-step times after the first (compiles, allocations)
                step_s = float(np.median(t))
                row.update(status="ok", tokens_per_s=f"{n / step_s:.0f}", peak_mem_gib=f"{pm.peak / 2**30:.2f}",
                           step_ms=f"{1e3 * step_s:.1f}")
            except Exception as e:  # noqa: BLE001 - OOM is a result here; anything else is reported too
                if not _is_oom(e):
                    row.update(status=f"error: {type(e).__name__}: {str(e)[:80]}", tokens_per_s="", peak_mem_gib="",
                               step_ms="")
                else:
                    row.update(status="OOM", tokens_per_s="", peak_mem_gib="", step_ms="")
                    if attention == "naive":
                        naive_oom_at = n
            finally:
                free_gpu()
            rows.append(row)
            print(f"  context {n:6d} {attention:9s}: {row['status']:>10s}  {row['tokens_per_s']:>9s} tok/s  "
                  f"peak {row['peak_mem_gib']:>7s} GiB  step {row['step_ms']:>8s} ms", flush=True)
    write_csv(RESULTS / "train_gpt_long_context.csv", rows, prov)
    oom = f"naive runs out of memory at context {naive_oom_at}" if naive_oom_at else \
        f"naive did not run out of memory up to {contexts[-1]}"
    return True, f"long context table written; {oom}"


# --------------------------------------------------------------------------- 4
def part4(args, prov):
    from stages.common.mpirun import mpi_env, mpirun_command

    common = ["--steps", "10" if args.quick else "30", "--batch", "8", "--context", "512", "--layers", "2",
              "--d-model", "128", "--heads", "2", "--seed", str(args.seed), "--device", "gpu", "--dtype", "float32",
              "--log-every", "10"]
    rows, ok, notes = [], True, []
    with tempfile.TemporaryDirectory() as tmp:
        one = pathlib.Path(tmp) / "one.csv"
        p = subprocess.run([sys.executable, str(ROOT / "stages/05_train_gpt/train.py"), "--attention", "flash_v2",
                            "--csv", str(one), *common], cwd=ROOT, capture_output=True, text=True, timeout=600)
        if p.returncode:
            raise RuntimeError(f"single-device run failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        one_loss = np.loadtxt(one, delimiter=",", skiprows=1, usecols=1)
        for layout in ("contiguous", "zigzag"):
            out = pathlib.Path(tmp) / f"ring_{layout}.csv"
            cmd = mpirun_command(4) + [sys.executable, str(ROOT / "stages/05_train_gpt/train.py"), "--attention",
                                       "ring", "--backend", "mpi", "--layout", layout, "--csv", str(out), *common]
            p = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=600)
            if p.returncode:
                ok = False
                notes.append(f"{layout}: mpirun failed")
                print(p.stdout[-3000:], p.stderr[-3000:])
                continue
            ring_loss = np.loadtxt(out, delimiter=",", skiprows=1, usecols=1)
            d = float(np.max(np.abs(ring_loss - one_loss)))
            ok &= d < 1e-3
            notes.append(f"{layout}: max |ring - one device| {d:.2e}")
            for i, (a, b) in enumerate(zip(ring_loss, one_loss)):
                rows.append({"layout": layout, "ranks": 4, "backend": "mpi", "dtype": "float32", "step": i,
                             "loss_ring": f"{a:.6f}", "loss_one_device": f"{b:.6f}", "abs_diff": f"{abs(a - b):.3e}"})
            print(f"  ring 4 ranks on one GPU, {layout}: max |loss difference| {d:.2e}")
    if rows:
        write_csv(RESULTS / "train_gpt_ring_gpu.csv", rows, prov)
    return ok, "; ".join(notes)


PARTS = {1: ("autograd.Function vs SDPA", part1), 2: ("ours vs the PyTorch twin", part2),
         3: ("long context vs naive", part3), 4: ("ring on one GPU", part4)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", type=int, nargs="+", default=sorted(PARTS), choices=sorted(PARTS))
    ap.add_argument("--quick", action="store_true", help="fewer steps and lengths: a smoke run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not has_gpu():
        raise SystemExit("gpu_runs.py needs a CUDA GPU (CuPy sees none); the CPU checks are tests/test_05_train_gpt.py")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prov = provenance()
    print(f"stage 05 GPU runs on {prov['gpu']} (commit {prov['git_commit']}, CuPy {prov['cupy']}, "
          f"torch {prov['torch']})")
    results = []
    for k in args.parts:
        name, fn = PARTS[k]
        print(f"\n==== part {k}: {name}", flush=True)
        t0 = time.time()
        try:
            ok, what = fn(args, prov)
            results.append((k, "OK" if ok else "FAILED", what, time.time() - t0))
        except Exception as e:  # noqa: BLE001 - one part failing must not lose the others
            traceback.print_exc()
            results.append((k, "FAILED", f"{type(e).__name__}: {e}", time.time() - t0))
        free_gpu()
    print("\n================ stage 05 GPU summary ================")
    for k, status, what, secs in results:
        print(f"part {k} {status:6s} {secs:6.1f}s  {PARTS[k][0]}: {what}")
    return 0 if all(r[1] == "OK" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
