"""Turn a benchmark CSV (written by dev/bench.py) into tables and plots. Needs no GPU and no torch.

    python dev/bench_report.py results/bench.csv                  # the README table (N >= 4096), markdown
    python dev/bench_report.py results/bench.csv --text --min-seq 0   # every row, aligned plain text
    python dev/bench_report.py results/bench.csv --plots results/  # bench_forward.png, bench_backward.png

Cells are TFLOP/s (FLOPs 4*B*H*N*N*d, half for causal, backward 2.5x the forward); ratio columns divide
one of our versions by a PyTorch backend measured in the same run on the same GPU (16-bit rows: flash and
cuDNN; fp32 rows: the memory-efficient backend). A row whose status is not "ok" (missing, error, mismatch)
shows its status instead of a number and never enters a ratio.

The committed results are regenerated from the CSVs in results/ (and results/sources.csv, which says where each
CSV comes from) with one command; tests/test_bench.py checks that the committed text is what it generates:

    python dev/bench_report.py --write    # README.md's results section, the GPU table, results/README.md
    python dev/bench_report.py --check    # exit 1 if any of them is stale
"""
import argparse
import csv
import pathlib
import re
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout: `stages` imports with no install

BASE_COLUMNS = ["gpu", "direction", "impl", "version", "dtype", "causal", "head_dim", "seq_len", "batch", "heads",
                "ms", "tflops", "status"]  # what the tables read; a CSV must have these (older CSVs have only these)
# err_over_bound: the worst output's error over its bound, at its worst row, by the tolerance rule
# (stages/common/tolerance.py), on the small check problem; err_output names that output. Then the run's provenance,
# the same on every row.
PROVENANCE = ["git_commit", "driver", "cuda_runtime", "cupy", "torch", "date"]
# ms_synced: the synced timing mode (every call waited on, host time included); host_us: the host's time inside one
# call. CSVs written before bench.py measured them lack them.
TIMING = ["ms_synced", "host_us"]
COLUMNS = BASE_COLUMNS + TIMING + ["err_over_bound", "err_output"] + PROVENANCE  # what bench.py writes
OURS = ("fp32", "fp32_overlap", "fp32x3", "tc", "pipelined", "hopper", "tc-det")  # column order of our versions
# (hopper: stage 06). Forward "fp32" is stage 02's plain loop and "fp32_overlap" its optimised float32 kernel; CSVs
# written before stage 02 split the two named that optimised kernel "fp32": read_csv renames it (_old_fp32_name).
TORCH = ("flash", "cudnn", "efficient")  # column order of PyTorch's backends
REFS = {"16-bit": ("flash", "cudnn"), "fp32": ("efficient",)}  # what our versions are divided by, per group
DTYPE_ORDER = {"bf16": 0, "fp16": 1, "fp32": 2}
TITLES = {"fwd": "forward", "bwd": "backward"}


def _bool(s):
    s = str(s).strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    raise ValueError(f"causal must be True or False, got {s!r}")


def _float(s):
    return float(s) if str(s).strip() not in ("", "nan", "None") else None


def read_csv(path):
    """Rows of a bench CSV as dicts with typed values (causal bool, sizes int, ms/tflops float or None)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in BASE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:  # other columns (provenance, error/bound) are kept as strings and ignored by the tables
            raise ValueError(f"{path}: columns {reader.fieldnames} are not the bench CSV's {BASE_COLUMNS} "
                             f"(missing {missing})")
        rows = []
        for r in reader:
            rows.append(dict(r, causal=_bool(r["causal"]), head_dim=int(r["head_dim"]), seq_len=int(r["seq_len"]),
                             batch=int(r["batch"]), heads=int(r["heads"]), ms=_float(r["ms"]),
                             tflops=_float(r["tflops"]), ms_synced=_float(r.get("ms_synced")),
                             host_us=_float(r.get("host_us"))))
    return _old_fp32_name(rows)


def _old_fp32_name(rows):
    """rows with stage 02's optimised float32 forward named "fp32_overlap" whatever the CSV's age. bench.py times
    version "fp32_overlap" for the float32 forward, so every CSV it writes with float32 forward rows has some; a CSV
    whose forward rows of ours include "fp32" and no "fp32_overlap" was written when "fp32" named that kernel (before
    stage 02 kept the paper's plain loop as "fp32" beside it), and its "fp32" forward rows are renamed. Backward rows
    keep "fp32": stage 03's version of that name is the same kernel before and after."""
    forward = {r["version"] for r in rows if r["direction"] == "fwd" and r["impl"] == "ours"}
    if "fp32" not in forward or "fp32_overlap" in forward:
        return rows
    return [dict(r, version="fp32_overlap") if r["direction"] == "fwd" and r["impl"] == "ours"
            and r["version"] == "fp32" else r for r in rows]


def write_csv(path, rows):
    """Write rows (dicts with the COLUMNS keys) to path."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r[c]) for c in COLUMNS})


def _group(dtype):
    return "fp32" if dtype == "fp32" else "16-bit"


def _ok(r):
    return r is not None and r["status"] == "ok" and r["tflops"] is not None


def _cell(r):
    if r is None:
        return "-"
    if _ok(r):
        return f"{r['tflops']:.1f}" if r["tflops"] >= 1 else f"{r['tflops']:.3g}"
    return r["status"].split(":")[0].strip() or "?"  # missing / error / mismatch


def _tables(rows, min_seq, summary_min_seq):
    """One table per (direction, precision group): (title, header, body, summary lines); the summary takes the
    ratios of rows with N >= summary_min_seq (the targets are stated for N >= 4096)."""
    out = []
    for direction in ("fwd", "bwd"):
        for group in ("16-bit", "fp32"):
            sel = [r for r in rows if r["direction"] == direction and _group(r["dtype"]) == group
                   and r["seq_len"] >= min_seq]
            if not sel:
                continue
            cols = [("ours", v) for v in OURS if any(r["impl"] == "ours" and r["version"] == v for r in sel)]
            cols += [("torch", v) for v in TORCH if any(r["impl"] == "torch" and r["version"] == v for r in sel)]
            refs = [t for t in REFS[group] if ("torch", t) in cols]
            ours = [v for i, v in cols if i == "ours"]
            by_key = {}
            for r in sel:
                key = (DTYPE_ORDER.get(r["dtype"], 9), r["dtype"], r["causal"], r["head_dim"], r["seq_len"])
                by_key.setdefault(key, {})[(r["impl"], r["version"])] = r
            header = ["dtype", "causal", "d", "N", "B x H"] + [f"{i} {v}" for i, v in cols]
            header += [f"{v}/{t}" for t in refs for v in ours]
            body, ratios = [], {}
            for key in sorted(by_key):
                cells = by_key[key]
                any_row = next(iter(cells.values()))
                line = [key[1], "yes" if key[2] else "no", str(key[3]), str(key[4]),
                        f"{any_row['batch']} x {any_row['heads']}"]
                line += [_cell(cells.get(c)) for c in cols]
                for t in refs:
                    for v in ours:
                        a, b = cells.get(("ours", v)), cells.get(("torch", t))
                        if _ok(a) and _ok(b) and b["tflops"] > 0:
                            x = a["tflops"] / b["tflops"]
                            line.append(f"{x:.2f}")
                            if key[4] >= summary_min_seq:
                                ratios.setdefault((v, t), []).append((x, key))
                        else:
                            line.append("-")
                body.append(line)
            summary = []
            for (v, t), xs in ratios.items():
                worst = min(xs)
                k = worst[1]
                summary.append(f"{TITLES[direction]} {v}/{t} at N >= {summary_min_seq}: min {worst[0]:.2f} "
                               f"({k[1]} {'causal' if k[2] else 'non-causal'} d={k[3]} N={k[4]}), "
                               f"median {statistics.median(x for x, _ in xs):.2f} over {len(xs)} configs")
            title = f"{TITLES[direction]}, {'bf16/fp16' if group == '16-bit' else 'fp32'}: TFLOP/s and ratios"
            out.append((title, header, body, summary))
    return out


def gpus(rows):
    return ", ".join(sorted({r["gpu"] for r in rows})) or "unknown GPU"


def _shape_note(rows):
    tokens = sorted({r["batch"] * r["seq_len"] for r in rows})
    heads = sorted({r["heads"] for r in rows})
    return f"B*N = {'/'.join(map(str, tokens))} tokens, H = {'/'.join(map(str, heads))}"


def markdown(rows, *, min_seq=4096, summary_min_seq=None):
    """The results tables (rows with N >= min_seq) as markdown text; summary lines over N >= summary_min_seq
    (default: min_seq)."""
    lines = [f"Measured by `dev/bench.py` on **{gpus(rows)}** ({_shape_note(rows)}; TFLOP/s with FLOPs "
             "4·B·H·N²·d, half when causal, backward 2.5x; ratios are ours / PyTorch in the same run).", ""]
    for title, header, body, summary in _tables(rows, min_seq, summary_min_seq or min_seq):
        lines += [f"**{title}**" + (f" (N >= {min_seq})" if min_seq > 0 else ""), "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        lines += [""] + [f"- {s}" for s in summary] + [""]
    return "\n".join(lines)


def text(rows, *, min_seq=0, summary_min_seq=4096):
    """Every table as aligned plain text, the GPU named: what bench.py prints at the end of a sweep."""
    lines = [f"GPU: {gpus(rows)}   ({_shape_note(rows)})"]
    for title, header, body, summary in _tables(rows, min_seq, max(min_seq, summary_min_seq)):
        widths = [max(len(x) for x in col) for col in zip(header, *body)]
        lines += ["", f"== {title} ({gpus(rows)})"]
        for r in [header] + body:
            lines.append("  ".join(x.rjust(w) if i >= 2 else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths))))
        lines += [f"   {s}" for s in summary]
    return "\n".join(lines)


_STYLE = {"bf16": "-", "fp16": "--", "fp32": ":"}
_COLOR = {("ours", "pipelined"): "C3", ("ours", "tc"): "C1", ("ours", "tc-det"): "C5", ("ours", "fp32"): "C4",
          ("ours", "fp32_overlap"): "C8", ("ours", "fp32x3"): "C6",
          ("torch", "flash"): "C0", ("torch", "cudnn"): "C2", ("torch", "efficient"): "C7"}


def plot(rows, path, direction):
    """TFLOP/s against N, one panel per (causal, head dim), for one direction; returns path or None if no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["direction"] == direction and _ok(r)]
    if not sel:
        return None
    dims = sorted({r["head_dim"] for r in sel})
    causals = sorted({r["causal"] for r in sel})
    fig, axes = plt.subplots(len(causals), len(dims), figsize=(max(7.0, 5.5 * len(dims)), 4.2 * len(causals)),
                             squeeze=False, sharey=True)
    handles = {}
    for a, causal in enumerate(causals):
        for b, d in enumerate(dims):
            ax = axes[a][b]
            series = {}
            for r in sel:
                if r["causal"] == causal and r["head_dim"] == d:
                    series.setdefault((r["impl"], r["version"], r["dtype"]), []).append((r["seq_len"], r["tflops"]))
            for (impl, version, dtype), pts in sorted(series.items()):
                pts.sort()
                (h,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], _STYLE.get(dtype, "-"), marker="o",
                               ms=3, color=_COLOR.get((impl, version)),
                               label=f"{impl} {version}" + (f" {dtype}" if dtype != version else ""))
                handles[h.get_label()] = h
            ax.set_xscale("log", base=2)
            ns = sorted({r["seq_len"] for r in sel})
            ax.set_xticks(ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
            ax.set_title(f"d = {d}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("sequence length N")
            ax.grid(alpha=0.3)
            if b == 0:
                ax.set_ylabel("TFLOP/s")
    fig.suptitle(f"FlashAttention-2 {TITLES[direction]}, TFLOP/s on {gpus(sel)}\n{_shape_note(sel)}; "
                 "bf16 solid, fp16 dashed, fp32 dotted")
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(4, len(handles)), fontsize=8)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(handles) + 3) // 4), 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(rows, out_dir):
    """bench_forward.png and bench_backward.png in out_dir; returns the paths written."""
    import pathlib

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = [plot(rows, out_dir / f"bench_{TITLES[d]}.png", d) for d in ("fwd", "bwd")]
    return [p for p in done if p is not None]


# ---------------------------------------------------------------- generated text: README.md and results/README.md

MARKERS = {"results": ("<!-- results:begin (generated by dev/bench_report.py --write) -->", "<!-- results:end -->"),
           "gpus": ("<!-- gpus:begin (generated by dev/bench_report.py --write) -->", "<!-- gpus:end -->"),
           "ring_errors": ("<!-- ring-errors:begin (generated by dev/bench_report.py --write) -->",
                           "<!-- ring-errors:end -->"),
           "vs_torch": ("<!-- vs-torch:begin (generated by dev/bench_report.py --write) -->",
                        "<!-- vs-torch:end -->"),
           "ring_scaling": ("<!-- ring-scaling:begin (generated by dev/bench_report.py --write) -->",
                            "<!-- ring-scaling:end -->"),
           "ring_memory": ("<!-- ring-memory:begin (generated by dev/bench_report.py --write) -->",
                           "<!-- ring-memory:end -->"),
           "ring_schemes": ("<!-- ring-schemes:begin (generated by dev/bench_report.py --write) -->",
                            "<!-- ring-schemes:end -->"),
           "hopper_steps": ("<!-- hopper-steps:begin (generated by dev/bench_report.py --write) -->",
                            "<!-- hopper-steps:end -->"),
           "hopper_profile": ("<!-- hopper-profile:begin (generated by dev/bench_report.py --write) -->",
                              "<!-- hopper-profile:end -->"),
           "hopper_backward": ("<!-- hopper-backward:begin (generated by dev/bench_report.py --write) -->",
                               "<!-- hopper-backward:end -->"),
           "hopper_launches": ("<!-- hopper-launches:begin (generated by dev/bench_report.py --write) -->",
                               "<!-- hopper-launches:end -->"),
           "hopper_grids": ("<!-- hopper-grids:begin (generated by dev/bench_report.py --write) -->",
                            "<!-- hopper-grids:end -->"),
           "hopper_fp8": ("<!-- hopper-fp8:begin (generated by dev/bench_report.py --write) -->",
                          "<!-- hopper-fp8:end -->"),
           "hopper_fp8_profile": ("<!-- hopper-fp8-profile:begin (generated by dev/bench_report.py --write) -->",
                                  "<!-- hopper-fp8-profile:end -->"),
           "train_scaling": ("<!-- train-scaling:begin (generated by dev/bench_report.py --write) -->",
                             "<!-- train-scaling:end -->"),
           "catch_summary": ("<!-- catch-rates:begin (generated by dev/bench_report.py --write) -->",
                             "<!-- catch-rates:end -->"),
           "catch_table": ("<!-- catch-table:begin (generated by dev/bench_report.py --write) -->",
                           "<!-- catch-table:end -->")}
SUMMARY_MIN_SEQ = 4096  # the summaries take configs with N >= this (short sequences do not fill the GPU)
RING_FLOATS = ("fwd_efficiency", "bwd_efficiency", "efficiency", "efficiency_synced", "mem_ratio", "peak_mb_per_gpu",
               "fwd_exposed_comm_ms_max_rank", "bwd_exposed_comm_ms_max_rank", "ring_fwd_ms", "ring_bwd_ms",
               "ring_fwd_ms_synced", "ring_bwd_ms_synced", "torch_cp_flash_fwd_ms", "torch_cp_flash_bwd_ms",
               "torch_cp_cudnn_fwd_ms", "torch_cp_cudnn_bwd_ms", "efficiency_target")
RING_CSV = "ring_h200x4_hopper.csv"  # dev/bench_ring.py on 4 GPUs: rings of 1, 2 and 4 beside one GPU and PyTorch's CP
SCALING_CSV = "train_gpt_scaling.csv"  # dev/train_scaling.py: stage 05 on 1, 2 and 4 GPUs
SCHEMES_CSV = "ring_schemes_h200x2.csv"  # dev/bench_ring.py --schemes: ring, all-gather and all-to-all side by side


D256_CSV = "bench_d256_h100.csv"  # head dim 256, stages 02 and 03 beside PyTorch (dev/bench.py --head-dims 256)
FP32_CSV = "bench_fp32_h100.csv"  # float32, N 1024-16384: stages 02 and 03 beside PyTorch's memory-efficient backend
HOPPER_CSV = "bench_fwd_hopper_h100.csv"  # dev/bench.py --direction fwd: stage 06 beside stage 02 and PyTorch
HOPPER_BWD_CSV = "bench_bwd_hopper_h100.csv"  # dev/bench.py --direction bwd: stage 06 beside stage 03 and PyTorch
# The same two sweeps on an H200, N from 512, the implementations of a config taking turns (dev/bench.py --rounds R)
HOPPER_H200_CSVS = {"fwd": "bench_fwd_hopper_h200.csv", "bwd": "bench_bwd_hopper_h200.csv"}
HOPPER_STEPS_CSV = "bench_hopper_h100.csv"  # dev/bench_hopper.py: every stage 06 version, one run
HOPPER_PROFILE_CSV = "profile_hopper_h100.csv"  # dev/profile_hopper.py: ncu counters of every stage 06 version
HOPPER_BWD_PROFILE_CSV = "profile_hopper_bwd_h100.csv"  # dev/profile_hopper.py --backward: the same, backward
LAUNCHES_CSV = "backward_launches_h200.csv"  # dev/backward_launches.py: the backward launch by launch, fused or not
GRIDS_CSV = "forward_grids_h200.csv"  # dev/forward_grids.py: the forward's two grids side by side
FP8_CSV = "fp8_h200.csv"  # dev/bench_fp8.py: version fp8 beside version pingpong and cuDNN
FP8_PROFILE_CSV = "profile_hopper_fp8_h200.csv"  # dev/profile_hopper.py --fp8: fp8's kernel beside pingpong's
HOPPER_STEPS = ("wgmma", "ws", "pingpong")  # stage 06's forward versions, in the README's order


def read_rows(path):
    """A CSV's rows as dicts of strings, in file order."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_sources(results_dir):
    """results/sources.csv: one row per CSV (file, what, gpu, software, command, code, note), in file order."""
    return read_rows(pathlib.Path(results_dir) / "sources.csv")


def rounds_of(source):
    """How many times the implementations took turns in a dev/bench.py run: the --rounds of its sources.csv command
    (1 without it)."""
    found = re.search(r"--rounds (\d+)", source["command"])
    return int(found.group(1)) if found else 1


def read_ring_csv(path):
    """Rows of a CSV written by dev/bench_ring.py, with the columns the tables use typed ("" stays None)."""
    with open(path, newline="") as f:
        rows = []
        for r in csv.DictReader(f):
            r = dict(r, gpus=int(r["gpus"]), tokens_per_gpu=int(r["tokens_per_gpu"]), heads=int(r["heads"]),
                     kv_heads=int(r["kv_heads"]), causal=_bool(r["causal"]),
                     scheme=r.get("scheme") or "ring")  # (CSVs from before the other schemes: the ring)
            rows.append(dict(r, **{c: _float(r[c]) if r.get(c, "") != "" else None for c in RING_FLOATS}))
    return rows


def _k(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _ratio_summary(rows, direction, group, ours, ref, ref_impl="torch", min_seq=SUMMARY_MIN_SEQ):
    """(number of configs, ours TFLOP/s min, max, ratio min, median, worst config) over N >= min_seq: our
    version ours against (ref_impl, ref), by default a PyTorch backend."""
    by_key = {}
    for r in rows:
        if r["direction"] == direction and _group(r["dtype"]) == group and r["seq_len"] >= min_seq:
            by_key.setdefault((r["dtype"], r["causal"], r["head_dim"], r["seq_len"]), {})[(r["impl"], r["version"])] = r
    pts = []
    for key, cells in sorted(by_key.items()):
        a, b = cells.get(("ours", ours)), cells.get((ref_impl, ref))
        if _ok(a) and _ok(b) and b["tflops"] > 0:
            pts.append((a["tflops"] / b["tflops"], a["tflops"], key))
    if not pts:
        return None
    worst = min(pts)
    return (len(pts), min(p[1] for p in pts), max(p[1] for p in pts), worst[0],
            statistics.median(p[0] for p in pts), worst[2])


# (direction, precision group, our version, PyTorch backend): the rows of the README's summary
SUMMARY_ROWS = [("fwd", "16-bit", "pipelined", "flash"), ("fwd", "16-bit", "pipelined", "cudnn"),
                ("bwd", "16-bit", "tc", "flash"), ("bwd", "16-bit", "tc-det", "flash"),
                ("bwd", "16-bit", "tc", "cudnn"),
                ("fwd", "fp32", "fp32_overlap", "efficient"), ("fwd", "fp32", "fp32x3", "efficient"),
                ("fwd", "fp32", "hopper", "efficient"),
                ("bwd", "fp32", "fp32", "efficient"), ("bwd", "fp32", "fp32x3", "efficient")]
_VERSION_NOTE = {"tc-det": "tc, deterministic dQ"}


def summary_markdown(rows):
    """The short table of the README: per (direction, version, PyTorch backend), min and median of the ratio."""
    out = ["| direction | dtypes | ours (version) | PyTorch backend | configs | ours, TFLOP/s | ours / PyTorch: "
           "min (worst config), median |", "|---|---|---|---|---:|---:|---|"]
    for direction, group, ours, ref in SUMMARY_ROWS:
        s = _ratio_summary(rows, direction, group, ours, ref)
        if s is None:
            continue
        n, lo, hi, rmin, rmed, (dtype, causal, d, seq) = s
        worst = f"{dtype}, {'causal' if causal else 'full'}, d={d}, N={_k(seq)}"
        out.append(f"| {TITLES[direction]} | {'bf16, fp16' if group == '16-bit' else 'fp32'} | "
                   f"`{_VERSION_NOTE.get(ours, ours)}` | {ref} | {n} | {lo:.3g}-{hi:.3g} | "
                   f"**{rmin:.2f}** ({worst}), **{rmed:.2f}** |")
    return "\n".join(out)


# The comparison of both timing modes: (direction, our version, PyTorch backend) over every 16-bit config.
MODE_PAIRS = [("fwd", "pipelined", "flash"), ("bwd", "tc", "flash")]


def _modes(rows):
    """{(dtype, causal, d, N): {direction: (queued ratio, synced ratio, our host us, torch host us)}} for
    MODE_PAIRS, from rows that have both timings (ratios: PyTorch time / ours, so > 1 means ours is faster)."""
    cells = {}
    for r in rows:
        if _group(r["dtype"]) == "16-bit":
            key = (DTYPE_ORDER.get(r["dtype"], 9), r["dtype"], r["causal"], r["head_dim"], r["seq_len"])
            cells.setdefault(key, {})[(r["direction"], r["impl"], r["version"])] = r
    out = {}
    for key, c in sorted(cells.items()):
        for direction, ours, ref in MODE_PAIRS:
            a, b = c.get((direction, "ours", ours)), c.get((direction, "torch", ref))
            if _ok(a) and _ok(b) and a.get("ms_synced") and b.get("ms_synced"):
                out.setdefault(key[1:], {})[direction] = (b["ms"] / a["ms"], b["ms_synced"] / a["ms_synced"],
                                                          a["host_us"], b["host_us"])
    return out


def modes_markdown(rows):
    """Markdown: per 16-bit config, ours / PyTorch flash in the queued and the synced timing modes (forward
    pipelined, backward tc) and the host time per call of each; then the worst ratio per direction and mode."""
    m = _modes(rows)
    if not m:
        return ""
    head = ["dtype", "causal", "d", "N", "fwd queued", "fwd synced", "bwd queued", "bwd synced",
            "host us fwd: ours / torch", "host us bwd: ours / torch"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|"]
    worst = {}
    for (dtype, causal, d, n), by_dir in m.items():
        line = [dtype, "yes" if causal else "no", str(d), str(n)]
        for direction, *_ in MODE_PAIRS:
            x = by_dir.get(direction)
            line += [f"{x[0]:.2f}", f"{x[1]:.2f}"] if x else ["-", "-"]
            for i, mode in ((0, "queued"), (1, "synced")):
                if x:
                    worst.setdefault((direction, mode), []).append((x[i], (dtype, causal, d, n)))
        for direction, *_ in MODE_PAIRS:
            x = by_dir.get(direction)
            line.append(f"{x[2]:.0f} / {x[3]:.0f}" if x else "-")
        out.append("| " + " | ".join(line) + " |")
    out.append("")
    for direction, ours, ref in MODE_PAIRS:
        for mode in ("queued", "synced"):
            xs = worst.get((direction, mode))
            if xs:
                lo, (dtype, causal, d, n) = min(xs)
                out.append(f"- {TITLES[direction]} {ours}/{ref}, {mode}: min **{lo:.2f}** ({dtype} "
                           f"{'causal' if causal else 'non-causal'} d={d} N={n}), median "
                           f"{statistics.median(x for x, _ in xs):.2f} over {len(xs)} configs")
        hosts = [x[direction][2:] for x in m.values() if direction in x]
        if hosts:
            ours_us, torch_us = zip(*hosts)
            out.append(f"- {TITLES[direction]} {ours}: host time per call {min(ours_us):.0f} to {max(ours_us):.0f} "
                       f"us (PyTorch {ref}, same run: {min(torch_us):.0f} to {max(torch_us):.0f} us)")
    return "\n".join(out)


def _problem(r):
    """A ring config in words: tokens per GPU, heads (/ kv heads), mask and layout."""
    heads = f"H = {r['heads']}" + (f", Hkv = {r['kv_heads']}" if r["kv_heads"] != r["heads"] else "")
    mask = "full" if not r["causal"] else ("zigzag causal" if r["layout"] == "zigzag" else "contiguous causal")
    return f"{_k(r['tokens_per_gpu'])} / GPU, {heads}, {mask}"


def ring_table(rows, *, full=False):
    """Per problem: the per-GPU efficiency (one GPU's time / (P x the ring's), fwd + bwd, calls queued) on 1, 2, 4...
    GPUs, the target, the peak memory per GPU against one GPU's, and, at the largest P, ours against PyTorch's
    context parallel (flash and cuDNN inside; time ratio, synced as PyTorch's are: below 1 = ours is faster).
    full=True adds forward / backward efficiencies and the exposed communication."""
    sizes = sorted({r["gpus"] for r in rows})
    top = sizes[-1]
    head = ["problem"] + [f"efficiency, {p} GPU{'s' if p > 1 else ''}" for p in sizes] + ["target"]
    head += [f"memory / GPU vs one GPU, {p} GPUs" for p in sizes if p > 1]
    head += [f"ours / PyTorch CP {k} time, {top} GPUs: fwd, bwd" for k in ("flash", "cuDNN")]
    if full:
        head += [f"fwd, bwd efficiency, {top} GPUs", f"exposed comm fwd / bwd, {top} GPUs, ms"]
    out = ["| " + " | ".join(head) + " |", "|---|" + "|".join("---:" for _ in head[1:]) + "|"]
    by = {}
    for r in rows:
        by.setdefault(r["config"], {})[r["gpus"]] = r
    for cfg, cells in by.items():
        any_row = next(iter(cells.values()))
        line = [_problem(any_row)]
        line += [f"{cells[p]['efficiency']:.2f}" if p in cells else "-" for p in sizes]
        line.append(next((f"{c['efficiency_target']:.2f}" for c in cells.values() if c["efficiency_target"]), "-"))
        line += [f"{cells[p]['mem_ratio']:.2f}" if p in cells else "-" for p in sizes if p > 1]
        t = cells.get(top, {})
        for kernel in ("flash", "cudnn"):
            tf, tb = t.get(f"torch_cp_{kernel}_fwd_ms"), t.get(f"torch_cp_{kernel}_bwd_ms")
            line.append(f"{t['ring_fwd_ms_synced'] / tf:.2f}, {t['ring_bwd_ms_synced'] / tb:.2f}" if tf and tb else "-")
        if full:
            line.append(f"{t['fwd_efficiency']:.2f}, {t['bwd_efficiency']:.2f}" if t else "-")
            line.append(f"{t['fwd_exposed_comm_ms_max_rank']:.2f} / {t['bwd_exposed_comm_ms_max_rank']:.2f}"
                        if t else "-")
        out.append("| " + " | ".join(line) + " |")
    return "\n".join(out)


def _ring_shape(rows):
    r = rows[0]
    return f"{r['dtype']}, B = {r['batch']}, d = {r['head_dim']}, backend {r['backend']}"


def _rows_of(results_dir, name, reader):
    """reader(results/name)'s rows, or None when that CSV is not there (its section is then left out)."""
    path = pathlib.Path(results_dir) / name
    return reader(path) if path.exists() else None


def ring_section(results_dir):
    """Markdown: the ring's table (ring_table) with its sentence, or "" when the CSV is not there."""
    rows = _rows_of(results_dir, RING_CSV, read_ring_csv)
    if rows is None:
        return ""
    return (f"Ring attention (stage 04) on **{_ring_gpus(rows)}** (`results/{RING_CSV}`; "
            f"{_ring_shape(rows)}): per-GPU efficiency = one GPU's time / (P x the ring's time) for the same total "
            "length, forward + backward, calls queued as a training step queues them (1.00: the ring costs nothing); "
            "memory: one forward + backward's peak per GPU, shards included, over one GPU's at the same length; "
            "PyTorch CP: `torch.distributed.tensor.experimental.context_parallel` on the same GPUs and problem, in "
            "the same run; ours / its time with a wait after every call, as PyTorch's are timed (below 1: ours is "
            "faster).\n\n" + ring_table(rows))


def schemes_table(rows):
    """Per problem, at the largest P of the CSV: each scheme's per-GPU efficiency (fwd + bwd, queued), the time its
    compute waited on transfers (fwd / bwd) and its peak memory per GPU against one GPU's."""
    top = max(r["gpus"] for r in rows)
    head = ["problem", "scheme", "efficiency", "fwd, bwd efficiency", "exposed comm fwd / bwd, ms",
            "memory / GPU vs one GPU"]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "|".join("---:" for _ in head[2:]) + "|"]
    for r in rows:
        if r["gpus"] != top:
            continue
        out.append(f"| {_problem(r)} | {r['scheme']} | {r['efficiency']:.2f} | "
                   f"{r['fwd_efficiency']:.2f}, {r['bwd_efficiency']:.2f} | "
                   f"{r['fwd_exposed_comm_ms_max_rank']:.2f} / {r['bwd_exposed_comm_ms_max_rank']:.2f} | "
                   f"{r['mem_ratio']:.2f} |")
    return "\n".join(out)


def ring_schemes_full(rows):
    """Every row of a schemes CSV: times, efficiencies, exposed communication, memory, PyTorch's CP beside."""
    head = ["GPUs", "problem", "scheme", "fwd / bwd ms", "efficiency", "exposed fwd / bwd ms", "memory vs one GPU",
            "PyTorch CP flash fwd / bwd ms", "PyTorch CP cuDNN fwd / bwd ms"]
    out = ["| " + " | ".join(head) + " |", "|---:|---|---|" + "|".join("---:" for _ in head[3:]) + "|"]
    for r in rows:
        torch = [f"{r[f'torch_cp_{k}_fwd_ms']:.2f} / {r[f'torch_cp_{k}_bwd_ms']:.2f}"
                 if r[f"torch_cp_{k}_fwd_ms"] else "-" for k in ("flash", "cudnn")]
        out.append(f"| {r['gpus']} | {_problem(r)} | {r['scheme']} | {r['ring_fwd_ms']:.2f} / "
                   f"{r['ring_bwd_ms']:.2f} | {r['efficiency']:.2f} | {r['fwd_exposed_comm_ms_max_rank']:.2f} / "
                   f"{r['bwd_exposed_comm_ms_max_rank']:.2f} | {r['mem_ratio']:.2f} | " + " | ".join(torch) + " |")
    return "\n".join(out)


def schemes_section(results_dir):
    """Markdown: the three schemes side by side (schemes_table) with its sentence, or "" without the CSV."""
    rows = _rows_of(results_dir, SCHEMES_CSV, read_ring_csv)
    if rows is None:
        return ""
    return (f"The three schemes on **{_ring_gpus(rows)}** (`results/{SCHEMES_CSV}`; {_ring_shape(rows)}), one run, "
            "efficiency and memory as in the table above:\n\n" + schemes_table(rows))


def _ring_gpus(rows):
    top = max(r["gpus"] for r in rows)
    return f"{top} x {rows[0]['gpu']}"


def read_scaling_csv(path):
    return [dict(r, gpus=int(r["gpus"]), context=int(r["context"]), step_ms=float(r["step_ms"]),
                 tokens_per_s=float(r["tokens_per_s"]), speedup=float(r["speedup"]),
                 longest_context=int(r["longest_context"])) for r in read_rows(path)]


def scaling_table(rows):
    """Markdown: stage 05's sequence-parallel training on 1, 2, 4... GPUs (dev/train_scaling.py)."""
    one = next(r for r in rows if r["gpus"] == 1)
    out = ["| GPUs | context | step, ms | tokens / s | speedup | longest context that trained | vs 1 GPU |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        longest = r["longest_context"] / one["longest_context"]
        out.append(f"| {r['gpus']} | {_k(r['context'])} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | "
                   f"{r['speedup']:.2f} | {r['longest_context']} | {longest:.2f} |")
    return "\n".join(out)


def scaling_section(results_dir):
    """Markdown: the training scaling table with its sentence, or "" when the CSV is not there."""
    rows = _rows_of(results_dir, SCALING_CSV, read_scaling_csv)
    if rows is None:
        return ""
    r = rows[0]
    return (f"Sequence-parallel training (stage 05 through the ring) on **{max(x['gpus'] for x in rows)} x "
            f"{r['gpu']}** (`results/{SCALING_CSV}`): {r['layers']} layers, d_model "
            f"{r['d_model']}, {r['heads']} heads, {r['dtype']}, batch {r['batch']}; tokens/s at the same context on "
            f"every ring size, and the longest context whose training steps fit a {float(r['mem_cap_gib']):g} GiB "
            "memory pool per GPU (found by search):\n\n" + scaling_table(rows))


def ring_memory_table(results_dir):
    """Markdown: what a rank holds per token of its shard, buffer by buffer (stages.ring.memory_per_token), against
    one device, and the ratio that predicts beside the measured one (results/RING_CSV)."""
    from stages import ring
    from stages.common import bfloat16

    if bfloat16 is None:  # np.dtype(None) is float64: the table would count 8 bytes a value
        raise SystemExit("dev/bench_report.py needs ml_dtypes (requirements.txt) for bfloat16: run it in the .venv")
    H, D = 32, 128
    out = ["| buffer (bfloat16, d = 128, H = 32) | bytes per token, Hkv = 32 | bytes per token, Hkv = 8 |",
           "|---|---:|---:|"]
    parts = {hkv: ring.memory_per_token(H, hkv, D, bfloat16) for hkv in (32, 8)}
    for (name, a), (_, b) in zip(parts[32], parts[8]):
        out.append(f"| {name} | {a} | {b} |")
    totals = {hkv: sum(b for _, b in p) for hkv, p in parts.items()}
    one = {hkv: (4 * H + 4 * hkv) * D * 2 + 4 * H * D for hkv in (32, 8)}  # one device, per token of the sequence
    out.append(f"| **a rank, in all** | **{totals[32]}** | **{totals[8]}** |")
    out.append(f"| one device, per token of the whole sequence (inputs, o, dQ accumulator, gradients) | {one[32]} | "
               f"{one[8]} |")
    rows = read_ring_csv(pathlib.Path(results_dir) / RING_CSV) if (pathlib.Path(results_dir) / RING_CSV).exists() \
        else []
    for P in (2, 4):
        got = {r["kv_heads"]: r["mem_ratio"] for r in rows if r["gpus"] == P and r["tokens_per_gpu"] == 8192
               and r["heads"] == H and r["causal"] and r["layout"] == "zigzag"}
        cells = [f"{totals[hkv] / (P * one[hkv]):.2f}" + (f" (measured {got[hkv]:.2f})" if hkv in got else "")
                 for hkv in (32, 8)]
        out.append(f"| a rank / one device, P = {P} (1/P = {1 / P:.2f}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ring_plot(results_dir, out_path):
    """PNG: per-GPU efficiency and memory per GPU against the number of GPUs, one line per problem."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_ring_csv(pathlib.Path(results_dir) / RING_CSV)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = sorted({r["gpus"] for r in rows})
    for cfg in dict.fromkeys(r["config"] for r in rows):
        rs = sorted((r for r in rows if r["config"] == cfg), key=lambda r: r["gpus"])
        ax1.plot([r["gpus"] for r in rs], [r["efficiency"] for r in rs], "o-", label=_problem(rs[0]))
        ax2.plot([r["gpus"] for r in rs], [r["mem_ratio"] for r in rs], "o-", label=_problem(rs[0]))
    ax2.plot(sizes, [1 / p for p in sizes], "k--", label="1/P")
    ax1.set(xlabel="GPUs in the ring", ylabel="per-GPU efficiency (fwd + bwd)", ylim=(0, 1.1), xticks=sizes,
            title="time of one GPU / (P x time of the ring)")
    ax2.set(xlabel="GPUs in the ring", ylabel="peak memory per GPU / one GPU's", ylim=(0, 1.1), xticks=sizes,
            title="memory per GPU, same total length")
    ax1.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"Ring attention (stage 04), {_ring_gpus(rows)}, {rows[0]['dtype']}, d = {rows[0]['head_dim']}")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def hopper_summary(results_dir, direction="fwd", csv_name=None, how=""):
    """One sentence: stage 06's forward or backward (dev/bench.py's "hopper" column) against cuDNN and flash (and
    the backward against stage 03's tc), from csv_name (default: the H100's sweep), or "" without the CSV. how: how
    the run timed them, said after the CSV's name."""
    csv_name = csv_name or (HOPPER_CSV if direction == "fwd" else HOPPER_BWD_CSV)
    rows = _rows_of(results_dir, csv_name, read_csv)
    if rows is None:
        return ""
    parts = []
    for impl, ref in [("torch", "cudnn"), ("torch", "flash")] + ([("ours", "tc")] if direction == "bwd" else []):
        got = _ratio_summary(rows, direction, "16-bit", "hopper", ref, ref_impl=impl)
        if got is not None:
            n, _, _, rmin, rmed, (dtype, causal, d, seq) = got
            name = f"{ref}'s" if impl == "torch" else f"stage 03 `{ref}`'s"
            parts.append(f"over {name}: min **{rmin:.2f}** ({dtype}, {'causal' if causal else 'full'}, d={d}, "
                         f"N={_k(seq)}), median **{rmed:.2f}** over {n} configs")
    what = "forward (FlashAttention-3 on Hopper, version `pingpong`)" if direction == "fwd" else \
        "backward (version `ws`)"
    return (f"Stage 06's {what} on one **{gpus(rows)}** (`results/{csv_name}`{how}, N >= {SUMMARY_MIN_SEQ}, "
            f"bf16 and fp16, d = 64/128, causal and not), its TFLOP/s " + "; ".join(parts) + ".")


def hopper_steps_table(results_dir):
    """Markdown: TFLOP/s of each stage 06 forward version beside stage 02's pipelined forward and SDPA flash and
    cuDNN (dev/bench_hopper.py's CSV, one run), and the last version over cuDNN; "" without the CSV."""
    rows = _rows_of(results_dir, HOPPER_STEPS_CSV, read_rows)
    if rows is None:
        return ""
    impls = [f"ours {v} (stage 06)" for v in HOPPER_STEPS] + ["ours pipelined (stage 02)", "sdpa flash", "sdpa cudnn"]
    heads = [f"{i + 1}. `{v}`" for i, v in enumerate(HOPPER_STEPS)] + ["stage 02 `pipelined`", "SDPA flash",
                                                                          "SDPA cuDNN"]
    cells = {}
    for r in rows:
        key = (int(r["head_dim"]), r["causal"] == "True", int(r["seq_len"]))
        cells.setdefault(key, {})[r["impl"]] = float(r["tflops"]) if r["tflops"] else None
    r0 = rows[0]
    out = [f"TFLOP/s on one {r0['gpu']} (`results/{HOPPER_STEPS_CSV}`, `dev/bench_hopper.py`, one run; "
           f"{r0['dtype']}, B x N = {int(r0['batch']) * int(r0['seq_len'])} tokens, H = {r0['heads']}):", "",
           "| d | causal | N | " + " | ".join(heads) + f" | `{HOPPER_STEPS[-1]}` / cuDNN |",
           "|---:|---|---:|" + "---:|" * (len(heads) + 1)]
    for (d, causal, n), c in sorted(cells.items()):
        vals = [c.get(i) for i in impls]
        last, cudnn = c.get(impls[len(HOPPER_STEPS) - 1]), c.get("sdpa cudnn")
        ratio = f"{last / cudnn:.2f}" if last and cudnn else "-"
        out.append(f"| {d} | {'yes' if causal else 'no'} | {n} | "
                   + " | ".join(f"{x:.0f}" if x else "-" for x in vals) + f" | {ratio} |")
    return "\n".join(out)


def hopper_backward_table(results_dir):
    """Markdown: TFLOP/s of stage 06's backward beside stage 03's tc and SDPA flash and cuDNN (dev/bench.py
    --direction bwd, one run), and stage 06 over cuDNN, per configuration; "" without the CSV."""
    rows = _rows_of(results_dir, HOPPER_BWD_CSV, read_csv)
    if rows is None:
        return ""
    impls = [("ours", "hopper"), ("ours", "tc"), ("torch", "flash"), ("torch", "cudnn")]
    cells = {}
    for r in rows:
        if r["direction"] == "bwd" and _ok(r):
            key = (r["dtype"], r["head_dim"], r["causal"], r["seq_len"])
            cells.setdefault(key, {})[(r["impl"], r["version"])] = r["tflops"]
    out = [f"TFLOP/s of the backward on one {gpus(rows)} (`results/{HOPPER_BWD_CSV}`, `dev/bench.py --direction bwd`, "
           "one run; B x N = 16384 tokens, H = 16):", "",
           "| dtype | d | causal | N | stage 06 `ws` | stage 03 `tc` | SDPA flash | SDPA cuDNN | stage 06 / cuDNN |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for (dtype, d, causal, n), c in sorted(cells.items()):
        vals = [c.get(i) for i in impls]
        ours, cudnn = vals[0], vals[3]
        ratio = f"{ours / cudnn:.2f}" if ours and cudnn else "-"
        out.append(f"| {dtype} | {d} | {'yes' if causal else 'no'} | {n} | "
                   + " | ".join(f"{x:.0f}" if x else "-" for x in vals) + f" | {ratio} |")
    return "\n".join(out)


def _turns_caption(r0, csv_name, script, before="", setting="", after=""):
    """The caption of a table from a dev script that times stage 06 beside cuDNN in turns (bench.take_turns_us), from
    its CSV's first row r0: the GPU, the file, the dtype, the tokens and heads, the turns."""
    return (f"Microseconds per call on one {r0['gpu']} ({before}`results/{csv_name}`, `{script}`, one run; "
            f"{r0['dtype']}, {setting}B x N = {int(r0['batch']) * int(r0['seq_len'])} tokens, H = {r0['heads']}; "
            f"each column the median of {r0['rounds']} turns; cuDNN / x: cuDNN's time over x's, above 1 where x is "
            f"faster{after}):")


def backward_launches_table(results_dir):
    """Markdown: dev/backward_launches.py's CSV, microseconds per call of stage 06's backward: each of its three
    launches alone, the three together, the two with the dQ conversion in the main kernel, backward() as it runs (one
    of the two: fuse_dq_rule) and cuDNN's backward, with the share of the two memory passes in the three launches
    and cuDNN's time over the main kernel's and over backward()'s; "" without the CSV."""
    rows = _rows_of(results_dir, LAUNCHES_CSV, read_rows)
    if rows is None:
        return ""
    r0 = rows[0]
    out = [_turns_caption(r0, LAUNCHES_CSV, "dev/backward_launches.py",
                          after="; backward() runs the two launches where the rule says fused"), "",
           "| d | causal | N | B | preprocess | main kernel | dQ conversion | three launches | two, conversion fused "
           "| fused by the rule | backward() | SDPA cuDNN | preprocess + conversion, % of three launches "
           "| cuDNN / main kernel | cuDNN / backward() |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (int(r["head_dim"]), r["causal"] == "True", int(r["seq_len"]))):
        pre, main, conv, three, two, whole, cudnn = (float(r[f"{p}_us"]) for p in
                                                     ("pre", "main", "convert", "unfused", "fused", "whole", "cudnn"))
        out.append(f"| {r['head_dim']} | {'yes' if r['causal'] == 'True' else 'no'} | {r['seq_len']} | {r['batch']} | "
                   f"{pre:.0f} | {main:.0f} | {conv:.0f} | {three:.0f} | {two:.0f} | "
                   f"{'yes' if r['fused_by_rule'] == 'True' else 'no'} | {whole:.0f} | {cudnn:.0f} | "
                   f"{100 * (pre + conv) / three:.0f} | {cudnn / main:.2f} | {cudnn / whole:.2f} |")
    return "\n".join(out)


def forward_grids_table(results_dir):
    """Markdown: dev/forward_grids.py's CSV, microseconds per call of stage 06's forward (version pingpong, no mask)
    with one block per item and with the persistent grid (both with K/V tiles of 128 keys, 64 at d = 256), forward()
    as it runs (one of the two grids: persistent_rule; its tiles: wide_rule) and cuDNN's forward, with cuDNN's time
    over each; "" without the CSV."""
    rows = _rows_of(results_dir, GRIDS_CSV, read_rows)
    if rows is None:
        return ""
    r0 = rows[0]
    out = [_turns_caption(r0, GRIDS_CSV, "dev/forward_grids.py", before=f"{r0['sms']} SMs; ", setting="no mask, "),
           "",
           "| d | N | B | items | one block per item | persistent | persistent by the rule | forward()'s K/V tile "
           "| forward() | SDPA cuDNN | cuDNN / one per item | cuDNN / persistent | cuDNN / forward() |",
           "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (int(r["head_dim"]), int(r["seq_len"]))):
        one, pers, whole, cudnn = (float(r[f"{p}_us"]) for p in ("per_item", "persistent", "whole", "cudnn"))
        out.append(f"| {r['head_dim']} | {r['seq_len']} | {r['batch']} | {r['items']} | {one:.0f} | {pers:.0f} | "
                   f"{'yes' if r['persistent_by_rule'] == 'True' else 'no'} | {r['forward_bc']} | {whole:.0f} | "
                   f"{cudnn:.0f} | {cudnn / one:.2f} | {cudnn / pers:.2f} | {cudnn / whole:.2f} |")
    return "\n".join(out)


def fp8_table(results_dir):
    """Markdown: dev/bench_fp8.py's CSV, microseconds per call of version fp8 end to end, its attention kernel and its
    pre-pass, beside version pingpong (16-bit) and cuDNN's forward on the same inputs, with pingpong's time over
    fp8's and over its kernel's; "" without the CSV."""
    rows = _rows_of(results_dir, FP8_CSV, read_rows)
    if rows is None:
        return ""
    r0 = rows[0]
    out = [f"Microseconds per call, TFLOP/s of the attention in brackets, on one {r0['gpu']} (`results/{FP8_CSV}`, "
           f"`dev/bench_fp8.py`, one run; {r0['dtype']} inputs, d = {r0['head_dim']}, B x N = "
           f"{int(r0['batch']) * int(r0['seq_len'])} tokens, H = {r0['heads']}; each column the median of "
           f"{r0['rounds']} turns; pingpong / x and cuDNN / x: their time over x's, above 1 where x is faster):",
           "", "| causal | N | B | fp8 | fp8's kernel | fp8's pre-pass | pingpong | SDPA cuDNN | pingpong / fp8 | "
           "pingpong / fp8's kernel | cuDNN / fp8 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["causal"], int(r["seq_len"]))):
        us = {p: float(r[f"{p}_us"]) for p in ("fp8", "fp8_kernel", "fp8_prepass", "pingpong", "cudnn")}
        cell = {p: f"{us[p]:.0f} ({float(r[p + '_tflops']):.0f})" for p in us if p != "fp8_prepass"}
        out.append(f"| {'yes' if r['causal'] == 'True' else 'no'} | {r['seq_len']} | {r['batch']} | {cell['fp8']} | "
                   f"{cell['fp8_kernel']} | {us['fp8_prepass']:.0f} | {cell['pingpong']} | {cell['cudnn']} | "
                   f"{us['pingpong'] / us['fp8']:.2f} | {us['pingpong'] / us['fp8_kernel']:.2f} | "
                   f"{us['cudnn'] / us['fp8']:.2f} |")
    return "\n".join(out)


def hopper_profile_table(results_dir, csv_name=HOPPER_PROFILE_CSV):
    """Markdown: dev/profile_hopper.py's counters per stage 06 version (the columns every row has), of the forward,
    or (csv_name HOPPER_BWD_PROFILE_CSV) the backward, or (FP8_PROFILE_CSV) versions pingpong and fp8; "" without the
    CSV."""
    rows = _rows_of(results_dir, csv_name, read_rows)
    if rows is None:
        return ""
    cols = [("duration_ms", "ms under ncu"), ("warp_instructions", "warp instructions"), ("sm_busy_pct", "SM busy, %"),
            ("tensor_pct", "tensor pipe active, %"), ("xu_pct", "XU pipe, %"), ("alu_pct", "ALU pipe, %"),
            ("fma_pct", "FMA pipe, %"), ("smem_bank_conflicts", "shared-memory bank conflicts"),
            ("stall_barrier", "stalled at bar.sync"), ("stall_wait", "stalled at fixed waits (wgmma.wait)"),
            ("stall_long_scoreboard", "stalled on loads"), ("stall_mio_throttle", "stalled on the MIO queue")]
    cols = [(c, h) for c, h in cols if all(r.get(c) for r in rows)]
    r0 = rows[0]
    command = "dev/profile_hopper.py" + {HOPPER_BWD_PROFILE_CSV: " --backward", FP8_PROFILE_CSV: " --fp8"}.get(
        csv_name, "")
    out = [f"Nsight Compute on one {r0['gpu']} (`results/{csv_name}`, `{command}`; "
           f"{r0['dtype']}, d = {r0['head_dim']}, N = {r0['seq_len']}, B = {r0['batch']}, H = {r0['heads']}; "
           "stalls: the average cycles a warp spent stalled for that reason over the kernel):", "",
           "| causal | version | " + " | ".join(h for _, h in cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for r in rows:
        out.append(f"| {'yes' if r['causal'] == 'True' else 'no'} | `{r['version']}` | "
                   + " | ".join(f"{float(r[c]):.3g}" for c, _ in cols) + " |")
    return "\n".join(out)


def readme_results(results_dir=None):
    """The README's results section (between the results markers): short, the GPUs named, links to the rest."""
    results_dir = pathlib.Path(results_dir or ROOT / "results")
    sources = {s["file"]: s for s in read_sources(results_dir)}
    rows = read_csv(results_dir / "bench.csv")
    src = sources["bench.csv"]
    lines = [f"Kernels (stages 02 and 03) on one **{gpus(rows)}**, beside PyTorch's `scaled_dot_product_attention` "
             f"({src['software'].split(',')[0]}) timed in the same run (`results/bench.csv`); configs with "
             f"N >= {SUMMARY_MIN_SEQ}, {_shape_note(rows)}, bf16/fp16 at d = "
             f"{'/'.join(str(d) for d in sorted({r['head_dim'] for r in rows}))}, causal and not:", "",
             summary_markdown(rows), ""]
    modes = [line for line in modes_markdown(rows).splitlines() if line.startswith("- ")]
    if modes:
        lines += [f"Every N from {min(r['seq_len'] for r in rows)} (bf16/fp16), in both timing modes: queued (the host "
                  "runs ahead) and synced (a wait after every call, so host time adds to GPU time); per-config table "
                  "in [`results/README.md`](results/README.md):", ""] + modes + [""]
    d256 = results_dir / D256_CSV
    if d256.exists():
        r256 = read_csv(d256)
        parts = []
        for direction, ours in (("fwd", "pipelined"), ("bwd", "tc")):
            got = _ratio_summary(r256, direction, "16-bit", ours, "flash")
            if got is not None:
                parts.append(f"{TITLES[direction]} `{ours}` / flash min **{got[3]:.2f}**, median **{got[4]:.2f}**")
        lines += [f"Head dim 256 on **{gpus(r256)}** (`results/{D256_CSV}`, N >= {SUMMARY_MIN_SEQ}): "
                  + "; ".join(parts) + ". The variants (sliding window, softcap, grouped-query, dropout, packed "
                  "batches) beside FlexAttention, SDPA and our plain pass: `results/bench_variants.csv`. Tables of "
                  "both in [`results/README.md`](results/README.md).", ""]
    fp32 = results_dir / FP32_CSV
    if fp32.exists():
        r32 = read_csv(fp32)
        parts = []
        for direction in ("fwd", "bwd"):
            for ours in ("fp32_overlap" if direction == "fwd" else "fp32", "fp32x3", "hopper"):
                got = _ratio_summary(r32, direction, "fp32", ours, "efficient", min_seq=0)
                if got is not None:
                    parts.append(f"{TITLES[direction]} `{ours}` / efficient min **{got[3]:.2f}**, median "
                                 f"**{got[4]:.2f}**")
        n = sorted({r["seq_len"] for r in r32})
        lines += [f"Float32 on **{gpus(r32)}** (`results/{FP32_CSV}`, every N from {n[0]} to {n[-1]}): "
                  + "; ".join(parts) + ". Table in [`results/README.md`](results/README.md).", ""]
    h200 = [hopper_summary(results_dir, d, name, f", the implementations taking turns {rounds_of(sources[name])} times")
            for d, name in HOPPER_H200_CSVS.items() if name in sources]
    hopper = " ".join(x for x in [hopper_summary(results_dir), hopper_summary(results_dir, "bwd")] + h200 if x)
    if hopper:
        hopper += (" The versions step by step: [`stages/06_hopper/README.md`](stages/06_hopper/README.md).")
    for section in (hopper, ring_section(results_dir), scaling_section(results_dir)):
        if section:
            lines += [section, ""]
    lines += ["Every table, the plots, and where each CSV comes from (GPU, software, command, code): "
              "[`results/README.md`](results/README.md)."]
    return "\n".join(lines)


def results_readme(results_dir=None):
    """The whole of results/README.md."""
    results_dir = pathlib.Path(results_dir or ROOT / "results")
    sources = read_sources(results_dir)
    lines = ["# Results", "",
             "Generated by `python dev/bench_report.py --write` from the CSVs in this folder (edit the CSVs or "
             "the generator, not this file; `tests/test_bench.py` checks it is up to date). Every number below is "
             "a measurement on the GPU named, by the command named.", "",
             "## Where each file comes from", "",
             "| file | what | GPU | software | command | code |", "|---|---|---|---|---|---|"]
    for s in sources:
        lines.append(f"| [`{s['file']}`]({s['file']}) | {s['what']} | {s['gpu']} | {s['software']} | "
                     f"`{s['command']}` | {s['code']} |")
    notes = [s for s in sources if s["note"]]
    lines += [""] + [f"* `{s['file']}`: {s['note']}." for s in notes] + ([""] if notes else [])
    rows = read_csv(results_dir / "bench.csv")
    lines += ["## Kernels beside PyTorch (`bench.csv`)", "",
              "TFLOP/s count 4·B·H·N²·d FLOPs for the forward (half when causal) and 2.5x that for the backward. "
              "Every row was checked against a higher-precision reference by the tolerance rule before it was "
              "timed. Ratio columns divide one of our versions by a PyTorch backend timed in the same run; the "
              f"summary lines take the configs with N >= {SUMMARY_MIN_SEQ}.", "",
              "![forward](bench_forward.png)", "", "![backward](bench_backward.png)", "",
              markdown(rows, min_seq=0, summary_min_seq=SUMMARY_MIN_SEQ).rstrip(), ""]
    modes = modes_markdown(rows)
    if modes:
        lines += ["## Both timing modes, every N (`bench.csv`)", "",
                  "Queued: CUDA events around each call while the host runs ahead, so launch overhead hides behind "
                  "the GPU's work. Synced: the host's clock around the call and a wait for the GPU, each call "
                  "starting on an idle GPU (a training loop that reads its loss every step), so the host's time "
                  "per call adds to the GPU's. Ratios are PyTorch's time over ours (above 1: ours is faster), "
                  "for the forward (`pipelined` / flash) and the backward (`tc` / flash); host us is the median "
                  "host time inside one call (input checks, configuration, allocation, launches) over the queued "
                  "mode's first 32 calls, before the launch queue fills. Each implementation is timed after "
                  "a warm-up of a fixed time (the GPU's clock recovers gradually after a power-hungry kernel, "
                  "so a warm-up of a few calls would time the next implementation at the previous one's "
                  "clock).", "",
                  modes, ""]
    for title, name, prose, summary_min_seq in (
            ("Head dim 256", D256_CSV,
             "The forward at d = 256 gives each of 8 warps one m-tile of 16 rows (O_i alone is 128 registers a "
             "thread); the backward splits the head dim between two blocks per K/V tile (a warp's 16 rows of "
             "dK_j and dV_j over 256 columns would be 256 registers a thread), so it computes S and dP twice: "
             "1.4x the FLOPs the TFLOP/s column counts.", SUMMARY_MIN_SEQ),
            ("Float32", FP32_CSV,
             "Float32 beside PyTorch's memory-efficient backend (CUTLASS; with float32 inputs its matmuls are "
             "the 3xTF32 split too): stage 02's `fp32_overlap` (CUDA cores, loads overlapping the math) and "
             "`fp32x3` (TF32 tensor cores) forward, "
             "on an sm_90 GPU stage 06's float32 forward (`hopper`: version fp32x3 on wgmma), "
             "stage 03's `fp32` and `fp32x3` backward, every N. Why the float32 backward costs what it costs: "
             "[`stages/03_flash_v2_backward/README.md`](../stages/03_flash_v2_backward/README.md) and "
             "`profile_backward_fp32_h200.csv` (Nsight Compute counters of both backward kernels).", 0)):
        if (results_dir / name).exists():
            lines += [f"## {title} (`{name}`)", "", prose, "",
                      markdown(read_csv(results_dir / name), min_seq=0, summary_min_seq=summary_min_seq).rstrip(), ""]
    hopper = _rows_of(results_dir, HOPPER_CSV, read_csv)
    if hopper is not None:
        lines += [f"## Stage 06 on Hopper (`{HOPPER_CSV}`, `{HOPPER_STEPS_CSV}`)", "",
                  "The forward of stage 06 (version `pingpong`, column `hopper`) beside stage 02 and PyTorch, "
                  "by `dev/bench.py` as above:", "",
                  markdown(hopper, min_seq=0, summary_min_seq=SUMMARY_MIN_SEQ).rstrip(), "",
                  "Every stage 06 version, one step at a time:", "", hopper_steps_table(results_dir), ""]
    by_file = {s["file"]: s for s in sources}
    for direction, name in HOPPER_H200_CSVS.items():
        rows = _rows_of(results_dir, name, read_csv)
        if rows is not None:
            n = rounds_of(by_file[name])
            lines += [f"## Stage 06 on {gpus(rows)}, {TITLES[direction]} (`{name}`)", "",
                      f"Every N from {min(r['seq_len'] for r in rows)}; the implementations of a configuration took "
                      f"turns {n} times (`dev/bench.py --rounds {n}`) and each column is the median of their "
                      f"{n} timings:", "",
                      markdown(rows, min_seq=0, summary_min_seq=SUMMARY_MIN_SEQ).rstrip(), ""]
    for s in sources:
        if s["file"].startswith("bench_variants"):
            lines += [f"## The variants (`{s['file']}`)", "", variants_table(results_dir / s["file"], s), ""]
    for s in sources:
        if s["file"].startswith("host_time"):
            lines += [f"## Host time per call, piece by piece (`{s['file']}`)", "",
                      host_time_table(results_dir / s["file"], s), ""]
    if (results_dir / RING_CSV).exists():
        rows = read_ring_csv(results_dir / RING_CSV)
        lines += ["## Ring attention", "",
                  "`dev/bench_ring.py` times the ring's forward and backward (the slowest rank) on P GPUs at total "
                  "length N = P x tokens per GPU, stages 02/03 on one GPU at the same N, and PyTorch's context "
                  "parallel on the same P GPUs. Efficiency: one GPU's time / (P x the ring's), calls queued. Exposed "
                  "communication: the time a rank's compute stream waited on a transfer, summed over the ring's steps "
                  "(largest over ranks). Memory: the CuPy pool's peak inside one forward + backward per GPU, the "
                  "shards included, over one GPU's at the same N. Plot: [`ring_scaling.png`](ring_scaling.png).", "",
                  f"**`{RING_CSV}`**: {_ring_gpus(rows)}; {_ring_shape(rows)}.", "", ring_table(rows, full=True), ""]
    if (results_dir / SCHEMES_CSV).exists():
        rows = read_ring_csv(results_dir / SCHEMES_CSV)
        lines += ["## Ring, all-gather and all-to-all", "",
                  "`dev/bench_ring.py --schemes ring allgather alltoall`: the same problems split three ways (stage "
                  "04's gather.py) on the same GPUs, in one run; columns as in the ring's table.", "",
                  f"**`{SCHEMES_CSV}`**: {_ring_gpus(rows)}; {_ring_shape(rows)}.", "",
                  ring_schemes_full(rows), ""]
    if (results_dir / SCALING_CSV).exists():
        lines += ["## Sequence-parallel training", "", scaling_section(results_dir), ""]
    return "\n".join(lines).rstrip() + "\n"


def variants_table(path, source):
    """Markdown: each variant's time beside its reference (dev/bench_variants.py's CSV); ratio = reference time /
    ours (above 1: ours is faster)."""
    rows = read_rows(path)
    r0 = rows[0]
    out = [f"{source['gpu']}, `{source['command']}`; bf16, N = {r0['seq']}, H = "
           f"{r0['heads']}, d = {r0['head_dim']}, B = 1 (the packed batch: 8 causal sequences). Ratio: the "
           "reference's time over ours (above 1: ours is faster).", "",
           "| variant | direction | ours, ms | reference | reference, ms | ratio |", "|---|---|---:|---|---:|---:|"]
    for r in rows:  # CSVs from before the direction column: a backward row's name ends in "bwd"
        direction = r.get("direction") or ("backward" if r["variant"].endswith(" bwd") else "forward")
        out.append(f"| {r['variant']} | {direction} | {float(r['ms_ours']):.3f} | {r['reference']} | "
                   f"{float(r['ms_reference']):.3f} | {float(r['ratio']):.2f} |")
    return "\n".join(out)


# The pieces every repeated plain backward call pays in this design, and how many of each (host_time_table)
BACKWARD_FLOOR = (("call_key", 1), ("pool allocation", 2), ("array object", 3), ("cuLaunchKernel, GPU idle", 2))


def host_time_table(path, source):
    """Markdown: dev/host_time.py's rows (whole calls, ours and PyTorch's, then their pieces), and the sum of the
    pieces a repeated plain backward cannot leave out (BACKWARD_FLOOR) beside the whole call."""
    rows = read_rows(path)
    r0 = rows[0]
    by = {r["step"]: r for r in rows}
    out = [f"{source['gpu']}, `{source['command']}`; {r0['problem']}: a problem small "
           "enough that the GPU never holds the host up. Median and min over the samples (a whole call and most "
           "pieces: rounds of calls back to back; cuLaunchKernel: one launch at a time, after a wait for the GPU "
           "or behind queued work).", "",
           "| step | what | median us | min us |", "|---|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['step']} | {r['what']} | {float(r['us_median']):.1f} | {float(r['us_min']):.1f} |")
    if all(step in by for step, _ in BACKWARD_FLOOR) and "backward" in by:
        parts = " + ".join(f"{n} x {step} ({float(by[step]['us_median']):.1f})" for step, n in BACKWARD_FLOOR)
        floor = sum(n * float(by[step]["us_median"]) for step, n in BACKWARD_FLOOR)
        out += ["", f"What a repeated plain backward cannot leave out in this design (two launches, three outputs, "
                f"the scratch, the key): {parts} = **{floor:.1f} us** of its {float(by['backward']['us_median']):.1f} "
                "us; the rest is the Python that packs each launch's arguments and joins the pieces. A launch while "
                "the GPU works costs the driver more (the busy row), and dev/bench.py times its host_us in its "
                "queued mode, with the GPU working."]
    return "\n".join(out)


# ---------------------------------------------------------------- which GPUs can run which version

HEAD_DIMS = (32, 64, 96, 128, 256)


def _versions():
    """(stage, version, dtypes, tiles(dev, D) -> "Br x Bc" text) for every kernel version, from the launchers' own
    configuration choices (stages/common/device.py); tiles raises device.UnsupportedDevice where the version cannot
    run."""
    import importlib

    device = importlib.import_module("stages.common.device")
    v1 = importlib.import_module("stages.flash_v1")
    v2 = importlib.import_module("stages.flash_v2")
    tc, x3 = v2.tc, v2.fp32x3
    bw = importlib.import_module("stages.flash_v2_backward")

    def need80(dev):
        device.require(dev, ("mma_k16", "cp_async"), what="")

    def v1_tiles(dev, D):
        if D > v1.MAX_HEAD_DIM:
            return "-"
        return f"{v1.BR}x{min(v1.kv_tile('forward', D, dev), v1.kv_tile('backward', D, dev))}"

    def fp32_tiles(version):
        def f(dev, D):
            if D not in v2.head_dims(version):
                return "-"
            c = v2.fp32.config(version, D, dev)
            return f"{c.br}x{v2.fp32.BC}" + ("s" if getattr(c, "share_kv", False) else "")
        return f

    def tc_tiles(version):
        def f(dev, D):
            if D not in tc.HEAD_DIMS[version]:
                return "-"
            c = tc.config(version, D, dev)
            return f"{c.br}x{c.bc}"
        return f

    def x3_tiles(dev, D):
        if D not in x3.HEAD_DIMS:
            return "-"
        need80(dev)
        c = x3.config(D, False, dev)
        return f"{c.br}x{c.bc}"

    def bw_fp32(dev, D):
        if D not in bw.HEAD_DIMS["fp32"]:
            return "-"
        if not device.fits(dev, max(bw.smem_bytes("fp32", D))):
            raise device.UnsupportedDevice("shared memory")
        return "32x32"

    def bw_x3(dev, D):
        if D not in bw.HEAD_DIMS["fp32x3"]:
            return "-"
        need80(dev)
        t = bw.fp32x3_tiles(D, dev)
        return f"{t.br}x{t.bc}"

    def bw_tc(dev, D):
        if D not in bw.HEAD_DIMS["tc"]:
            return "-"
        t = bw.tc_tiles(D, dev)
        return f"{t.br}x{t.bc}" + ("p" if t.wq > 1 else "")

    v3 = importlib.import_module("stages.hopper.flash_v3")
    v3b = importlib.import_module("stages.hopper.flash_v3_backward")

    def hopper_tiles(version):
        def f(dev, D):
            if dev.arch.cc != 90:
                raise device.UnsupportedDevice("stage 06 needs sm_90")
            if version == "fp32x3":  # float32: its own launcher and head dims
                return f"{v3.fp32x3.CONFIGS[D].br}x{v3.fp32x3.CONFIGS[D].bc}" if D in v3.fp32x3.HEAD_DIMS else "-"
            if D not in v3.HEAD_DIMS:
                return "-"
            c = v3.config(version, D)
            wide = v3.wide_rule(version, D, False, False)  # long items without a mask: K/V tiles of WIDE_BC keys
            return f"{c.br}x{c.bc}" + (f" (w: {c.br}x{v3.config(version, D, wide).bc})" if wide else "")
        return f

    def hopper_bwd_tiles(version):  # Q tiles of q_tile_rows x K/V tiles of bc keys
        def f(dev, D):
            if dev.arch.cc != 90:
                raise device.UnsupportedDevice("stage 06 needs sm_90")
            if D not in v3b.VERSION_HEAD_DIMS[version]:
                return "-"
            return f"{v3b.q_tile_rows(version, D)}x{v3b.CONFIGS[version].bc}"
        return f

    return [("01", "`paper` (fwd + bwd)", "fp32", v1_tiles), ("02", "`fp32`", "fp32", fp32_tiles("fp32")),
            ("02", "`fp32_overlap`", "fp32", fp32_tiles("fp32_overlap")),
            ("02", "`tc`", BOTH16, tc_tiles("tc")), ("02", "`pipelined`", BOTH16, tc_tiles("pipelined")),
            ("02", "`fp32x3`", "fp32", x3_tiles), ("03", "`fp32`", "fp32", bw_fp32),
            ("03", "`tc`", BOTH16, bw_tc), ("03", "`fp32x3`", "fp32", bw_x3)] + [
            ("06", f"`{v}` (fwd)", "fp16, bf16", hopper_tiles(v)) for v in v3.VERSIONS] + [
            ("06", "`fp32x3` (fwd)", "fp32", hopper_tiles("fp32x3"))] + [
            ("06", f"`{v}` (bwd)", "fp16, bf16", hopper_bwd_tiles(v)) for v in v3b.VERSIONS]


BOTH16 = "fp16, bf16 (bf16 from sm_80)"


def gpu_table():
    """Markdown: per kernel version and architecture, the tiles (Br x Bc) its launcher picks at d = 32/64/96/128/256
    (s: V_j shares K_j's buffer; p: the backward's warps in pairs, TcTiles.wq = 2; w: stage 06's wide K/V tiles on
    long items without a mask, wide_rule; -: the version does not take that head dim), "no" where it cannot run."""
    import importlib

    device = importlib.import_module("stages.common.device")
    archs = [device.emulate(a) for a in device.ARCHS]
    head = ["stage", "version", "dtypes"] + [f"{d.arch.name} ({d.arch.gpus}; {d.smem_optin // 1024} KB)"
                                             for d in archs]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for stage, version, dtypes, tiles in _versions():
        cells = []
        for dev in archs:
            got = []
            for D in HEAD_DIMS:
                try:
                    got.append(tiles(dev, D))
                except device.UnsupportedDevice as e:
                    got.append("no" if "shared memory" in str(e) else "sm_90" if "sm_90" in str(e) else "sm_80")
            need = next((a for a in ("sm_80", "sm_90") if set(got) <= {a, "-"}), None)
            cells.append(f"needs {need}" if need else " / ".join(got))
        out.append("| " + " | ".join([stage, version, dtypes] + cells) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------- what the checks catch (dev/catch_rates.py)
CATCH_CSV = "catch_rates.csv"
CATCH_TARGET = 0.95  # caught / resolvable the rule aims at (dev/catch_rates.py's TARGET)


def _catch(results_dir):
    """(mistake rows, correct-stage rows, scales, dtypes, commit) of results/catch_rates.csv."""
    rows = read_rows(pathlib.Path(results_dir) / CATCH_CSV)
    mistakes = [r for r in rows if r["kind"] == "mistake"]
    stages = [r for r in rows if r["kind"] == "stage"]
    scales = list(dict.fromkeys(r["scale"] for r in mistakes + stages))
    dtypes = list(dict.fromkeys(r["dtype"] for r in mistakes + stages))
    commits = sorted({r["git_commit"] for r in rows})
    return mistakes, stages, scales, dtypes, ", ".join(commits)


def _mistake_name(r):
    return f"`{r['name']}` ({r['direction']})"


def _shortfall_table(mistakes):
    """Markdown: every mistake caught in fewer than CATCH_TARGET of its resolvable draws, the factor the bound of what
    it changes would need to reach CATCH_TARGET, and the correct stage with the largest error / bound there."""
    short = _shortfalls(mistakes)
    if not short:
        return []
    lines = [f"Caught in fewer than {CATCH_TARGET:.0%} of the resolvable draws, and what bounds each: the bound of the "
             f"outputs the mistake changes would need the factor shown; the correct stage named reaches that share "
             f"of the bound in the draw named (where it is below the factor, no stage measured here stops it).", "",
             "| mistake | inputs | caught / resolvable | bound x | correct stage at | error / bound | draw |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {_mistake_name(r)} | {r['scale']} {r['dtype']} | {r['caught']} / {r['resolvable']} | "
              f"{r['shrink_for_95']} | {r['limit_stage']} | {r['limit_ratio']} | {r['limit_seed']} |" for r in short]
    return lines


def _shortfalls(mistakes):
    return [r for r in mistakes if int(r["resolvable"]) and int(r["caught"]) < CATCH_TARGET * int(r["resolvable"])]


def _stages_line(stages):
    worst = max(stages, key=lambda r: float(r["ratio"]))
    names = "; ".join(", ".join(dict.fromkeys(r["name"] for r in stages if r["direction"] == d)) + f" ({d})"
                      for d in dict.fromkeys(r["direction"] for r in stages))
    fewest = min(int(r["draws"]) for r in stages)
    failed = sum(int(r["draws"]) - int(r["passed"]) for r in stages)
    return (f"Correct stages ({names}): {'every one passes every draw' if not failed else f'{failed} failed draws'}, "
            f"at least {fewest} draws each per scale and dtype; the largest error / bound is {worst['ratio']} "
            f"({worst['name']} {worst['direction']}, {worst['scale']} {worst['dtype']}, draw {worst['ratio_seed']}).")


def catch_summary(results_dir):
    """Markdown for README.md: caught / resolvable draws per mistake and input scale (the dtypes summed), the correct
    stages' passes, and every mistake caught in fewer than CATCH_TARGET of its resolvable draws."""
    mistakes, stages, scales, dtypes, commit = _catch(results_dir)
    lines = [f"Caught / resolvable draws, {', '.join(dtypes)} together (`results/{CATCH_CSV}`, `python "
             f"dev/catch_rates.py`, commit {commit}):", "",
             "| mistake | " + " | ".join(f"inputs {s}" for s in scales) + " |", "|---|" + "---|" * len(scales)]
    for key in dict.fromkeys((r["direction"], r["name"]) for r in mistakes):
        cells = []
        for s in scales:
            rs = [r for r in mistakes if (r["direction"], r["name"], r["scale"]) == key + (s,)]
            cells.append(f"{sum(int(r['caught']) for r in rs)} / {sum(int(r['resolvable']) for r in rs)}")
        lines.append(f"| `{key[1]}` ({key[0]}) | " + " | ".join(cells) + " |")
    lines += ["", _stages_line(stages)]
    short = _shortfall_table(mistakes)
    return "\n".join(lines + ([""] + short if short else []))


def catch_table(results_dir):
    """Markdown for docs/DESIGN.md: caught / resolvable / draws per mistake, scale and dtype; passes / draws and the
    largest error / bound per correct stage; the mistakes below CATCH_TARGET, each with what bounds it."""
    mistakes, stages, scales, dtypes, commit = _catch(results_dir)
    cols = [(s, t) for s in scales for t in dtypes]
    head = ["| | " + " | ".join(f"{s} {t}" for s, t in cols) + " |", "|---|" + "---|" * len(cols)]
    at = {(r["kind"], r["direction"], r["name"], r["scale"], r["dtype"]): r for r in mistakes + stages}
    lines = [f"Mistakes: caught / resolvable / draws (`results/{CATCH_CSV}`, commit {commit}).", ""] + head
    for key in dict.fromkeys((r["direction"], r["name"]) for r in mistakes):
        cells = [at.get(("mistake",) + key + c) for c in cols]
        lines.append(f"| `{key[1]}` ({key[0]}) | " + " | ".join(
            "-" if r is None else f"{r['caught']} / {r['resolvable']} / {r['draws']}" for r in cells) + " |")
    lines += ["", "Correct stages: passed / draws, largest error / bound.", ""] + head
    for key in dict.fromkeys((r["direction"], r["name"]) for r in stages):
        cells = [at.get(("stage",) + key + c) for c in cols]
        lines.append(f"| {key[1]} ({key[0]}) | " + " | ".join(
            "-" if r is None else f"{r['passed']} / {r['draws']}, {r['ratio']}" for r in cells) + " |")
    short = _shortfall_table(mistakes)
    rounding = [r for r in read_rows(pathlib.Path(results_dir) / CATCH_CSV) if r["kind"] == "rounding"]
    if rounding:
        lines += ["", "The rule's margin for the sums it has not seen, measured: a plain loop's float32 sum of `d` "
                  "random-sign products (one rounding per product, `dev/catch_rates.py`'s `rounding_tail`) lands at "
                  "most this share of what the rule grants a sum (`2 lambda u sqrt(W)`): "
                  + "; ".join(f"{r['name']}, {r['draws']} sums: {r['ratio']} (sum {r['ratio_seed']})"
                              for r in rounding) + "."]
    return "\n".join(lines + ([""] + short if short else []))


# ---------------------------------------------------------------- provenance: sources.csv names what the rows carry
COMMIT_COLUMNS = ("git_commit", "commit")  # the columns a CSV records its code in
GPU_COLUMN = "gpu"  # the GPU a row ran on (the ring's `gpus` is a count)


def _named_gpus(field):
    """The GPU models a sources.csv gpu field names: "4 x NVIDIA H200" -> ["NVIDIA H200"]."""
    return [re.sub(r"^\d+ x ", "", part.strip()) for part in re.split(r" \+ |; ", field)]


def provenance_problems(results_dir=None):
    """[what is wrong]: for each CSV in results/, every commit its rows carry (git_commit or commit column) must be
    named in its sources.csv row (code or note; a short hash names the full one, and a row's -dirty must be said),
    and every GPU its rows carry (gpu column) must be one its row names (a row's GPU may add words after the model,
    as an emulated architecture does)."""
    results_dir = pathlib.Path(results_dir or ROOT / "results")
    problems = []
    for s in read_sources(results_dir):
        path = results_dir / s["file"]
        if not path.exists():
            continue
        rows = read_rows(path)
        named = f"{s['code']} {s['note']}"
        hashes = re.findall(r"\b[0-9a-f]{7,40}\b", named)
        for column in COMMIT_COLUMNS:
            for commit in sorted({r[column] for r in rows if r.get(column)}):
                head = commit.split("-")[0]
                if not any(head.startswith(h) or h.startswith(head) for h in hashes):
                    problems.append(f"{s['file']}: its rows carry commit {commit}, which its sources.csv row does not "
                                    f"name (code: {s['code']!r})")
                elif commit.endswith("-dirty") and "dirty" not in named:
                    problems.append(f"{s['file']}: its rows carry {commit} (uncommitted changes), which its "
                                    f"sources.csv row does not say")
        models = _named_gpus(s["gpu"])
        for gpu in sorted({r[GPU_COLUMN] for r in rows if r.get(GPU_COLUMN)}):
            if not any(gpu == m or gpu.startswith(m + " ") for m in models):
                problems.append(f"{s['file']}: its rows ran on {gpu!r}, which its sources.csv row does not name "
                                f"(gpu: {s['gpu']!r})")
    return problems


# ---------------------------------------------------------------- --write / --check

def _splice(text, name, body):
    begin, end = MARKERS[name]
    if begin not in text or end not in text:
        raise ValueError(f"README.md has no {name} markers ({begin} ... {end})")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def ring_error_table(results_dir):
    """Markdown: the ring's error / bound per output, at its worst row, against the number of ranks
    (ring_error_vs_ranks.csv)."""
    path = pathlib.Path(results_dir) / "ring_error_vs_ranks.csv"
    rows = read_rows(path)
    names = ("o", "lse", "dq", "dk", "dv")
    r0 = rows[0]
    out = [f"B = {r0['B']}, H = {r0['H']}, N = {r0['N']}, d = {r0['D']}, {r0['layout']}, causal, block "
           f"{r0['block']}; error against the float64 oracle and its bound under the tolerance rule, at each output's "
           f"worst row "
           f"(`{path.name}`, `python dev/ring_errors.py`).", "",
           "| dtype | ranks P | " + " | ".join(f"{n} error / bound" for n in names) + " |",
           "|---|---:|" + "---:|" * len(names)]
    for r in rows:
        out.append(f"| {r['dtype']} | {r['ranks']} | "
                   + " | ".join(f"{float(r['err_' + n]):.2e} / {float(r['bound_' + n]):.2e}" for n in names) + " |")
    return "\n".join(out)


def vs_torch_table(results_dir):
    """Markdown: per task and dtype, the largest loss difference over the run between PyTorch's SDPA twin and ours,
    PyTorch's own math backend, and PyTorch with our attention (train_gpt_vs_torch.csv)."""
    path = pathlib.Path(results_dir) / "train_gpt_vs_torch.csv"
    rows = read_rows(path)
    r0 = rows[0]
    out = [f"`{path.name}`: {r0['gpu']}, `python dev/train_gpt_gpu_runs.py --parts 2`;"
           f" {len({r['step'] for r in rows})} steps. Max over the run of |loss - PyTorch SDPA's loss|, and the final "
           "losses:", "",
           "| task | dtype | ours (CuPy, flash_v2) | PyTorch, SDPA math | PyTorch + our attention | final loss: ours / "
           "PyTorch |", "|---|---|---:|---:|---:|---|"]
    for key in dict.fromkeys((r["task"], r["dtype"]) for r in rows):
        rs = [r for r in rows if (r["task"], r["dtype"]) == key]
        ref = [float(r["loss_torch_sdpa"]) for r in rs]
        diff = [max(abs(float(r[col]) - x) for r, x in zip(rs, ref))
                for col in ("loss_ours", "loss_torch_sdpa_math", "loss_torch_our_attention")]
        out.append(f"| {key[0]} | {key[1]} | " + " | ".join(f"{d:.1e}" for d in diff)
                   + f" | {float(rs[-1]['loss_ours']):.3f} / {ref[-1]:.3f} |")
    return "\n".join(out)


def generated(root=None):
    """{path: the text it should have}: README.md with its generated sections, results/README.md, the stage 04
    README's table of the ring's error against P and the stage 05 README's table of the loss curves against
    PyTorch."""
    root = pathlib.Path(root or ROOT)
    readme = (root / "README.md").read_text()
    readme = _splice(readme, "results", readme_results(root / "results"))
    readme = _splice(readme, "gpus", gpu_table())
    readme = _splice(readme, "catch_summary", catch_summary(root / "results"))
    design = root / "docs" / "DESIGN.md"
    design_text = _splice(design.read_text(), "catch_table", catch_table(root / "results"))
    ring_readme = root / "stages" / "04_ring" / "README.md"
    gpt_readme = root / "stages" / "05_train_gpt" / "README.md"
    ring_text = _splice(ring_readme.read_text(), "ring_errors", ring_error_table(root / "results"))
    ring_text = _splice(ring_text, "ring_scaling", ring_section(root / "results"))
    ring_text = _splice(ring_text, "ring_memory", ring_memory_table(root / "results"))
    ring_text = _splice(ring_text, "ring_schemes", schemes_section(root / "results"))
    hopper_readme = root / "stages" / "06_hopper" / "README.md"
    hopper_text = _splice(hopper_readme.read_text(), "hopper_steps", hopper_steps_table(root / "results"))
    hopper_text = _splice(hopper_text, "hopper_profile", hopper_profile_table(root / "results"))
    hopper_text = _splice(hopper_text, "hopper_backward", hopper_backward_table(root / "results") + "\n\n"
                          + hopper_profile_table(root / "results", HOPPER_BWD_PROFILE_CSV))
    hopper_text = _splice(hopper_text, "hopper_launches", backward_launches_table(root / "results"))
    hopper_text = _splice(hopper_text, "hopper_grids", forward_grids_table(root / "results"))
    hopper_text = _splice(hopper_text, "hopper_fp8", fp8_table(root / "results"))
    hopper_text = _splice(hopper_text, "hopper_fp8_profile", hopper_profile_table(root / "results", FP8_PROFILE_CSV))
    gpt_text = _splice(gpt_readme.read_text(), "vs_torch", vs_torch_table(root / "results"))
    gpt_text = _splice(gpt_text, "train_scaling", scaling_section(root / "results"))
    return {root / "README.md": readme, root / "results" / "README.md": results_readme(root / "results"),
            ring_readme: ring_text, gpt_readme: gpt_text, hopper_readme: hopper_text, design: design_text}


def stale(root=None):
    """The generated files whose committed text differs from what the generator makes now."""
    return [p for p, text in generated(root).items() if not p.exists() or p.read_text() != text]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?", help="a CSV written by dev/bench.py: print its tables")
    ap.add_argument("--min-seq", type=int, default=4096, help="rows with N below this are left out of the tables")
    ap.add_argument("--text", action="store_true", help="aligned plain text instead of markdown")
    ap.add_argument("--plots", metavar="DIR", default=None, help="also write bench_forward/backward.png in DIR")
    ap.add_argument("--write", action="store_true",
                    help="regenerate README.md's results and GPU sections and results/README.md from results/*.csv")
    ap.add_argument("--check", action="store_true", help="exit 1 if those generated files are stale")
    ap.add_argument("--gpus", action="store_true", help="print the table of which GPU runs which version")
    ap.add_argument("--ring-plot", action="store_true",
                    help=f"write results/ring_scaling.png from results/{RING_CSV} (the ring's scaling plot)")
    args = ap.parse_args(argv)
    if args.write or args.check:
        todo = stale()
        for p in todo:
            if args.write:
                p.write_text(generated()[p])
            print(f"{'wrote' if args.write else 'stale'}: {p.relative_to(ROOT)}", file=sys.stderr)
        if not todo:
            print("generated files are up to date", file=sys.stderr)
        problems = provenance_problems()
        for problem in problems:
            print(f"provenance: {problem}", file=sys.stderr)
        return 1 if (todo or problems) and args.check else 0
    if args.gpus:
        print(gpu_table())
        return 0
    if args.ring_plot:
        print(f"wrote {ring_plot(ROOT / 'results', ROOT / 'results' / 'ring_scaling.png')}", file=sys.stderr)
        return 0
    if not args.csv:
        ap.error("give a CSV, or --write / --check / --gpus")
    rows = read_csv(args.csv)
    print(text(rows, min_seq=args.min_seq) if args.text else markdown(rows, min_seq=args.min_seq))
    if args.plots:
        for p in plots(rows, args.plots):
            print(f"wrote {p}", file=sys.stderr)
    return 0

if __name__ == "__main__":
    sys.exit(main())
