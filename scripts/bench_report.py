"""Turn a benchmark CSV (written by scripts/bench.py) into tables and plots. Needs no GPU and no torch.

    python scripts/bench_report.py results/bench.csv                  # the README table (N >= 4096), markdown
    python scripts/bench_report.py results/bench.csv --text --min-seq 0   # every row, aligned plain text
    python scripts/bench_report.py results/bench.csv --plots results/  # bench_forward.png, bench_backward.png

Cells are TFLOP/s (FLOPs 4*B*H*N*N*d, half for causal, backward 2.5x the forward); ratio columns divide
one of our versions by a PyTorch backend measured in the same run on the same GPU (16-bit rows: flash and
cuDNN; fp32 rows: the memory-efficient backend). A row whose status is not "ok" (missing, error, mismatch)
shows its status instead of a number and never enters a ratio.
"""
import argparse
import csv
import statistics
import sys

COLUMNS = ["gpu", "direction", "impl", "version", "dtype", "causal", "head_dim", "seq_len", "batch", "heads",
           "ms", "tflops", "status"]
OURS = ("fp32", "fp32x3", "tc", "pipelined", "tc-det")  # column order of our versions
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
        if reader.fieldnames != COLUMNS:
            raise ValueError(f"{path}: columns {reader.fieldnames} are not the bench CSV's {COLUMNS}")
        rows = []
        for r in reader:
            rows.append(dict(r, causal=_bool(r["causal"]), head_dim=int(r["head_dim"]), seq_len=int(r["seq_len"]),
                             batch=int(r["batch"]), heads=int(r["heads"]), ms=_float(r["ms"]),
                             tflops=_float(r["tflops"])))
    return rows


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


def markdown(rows, *, min_seq=4096):
    """The README's results tables (rows with N >= min_seq) as markdown text."""
    lines = [f"Measured by `scripts/bench.py` on **{gpus(rows)}** ({_shape_note(rows)}; TFLOP/s with FLOPs "
             "4·B·H·N²·d, half when causal, backward 2.5x; ratios are ours / PyTorch in the same run).", ""]
    for title, header, body, summary in _tables(rows, min_seq, min_seq):
        lines += [f"**{title}** (N >= {min_seq})", "", "| " + " | ".join(header) + " |",
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
          ("ours", "fp32x3"): "C6",
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="a CSV written by scripts/bench.py")
    ap.add_argument("--min-seq", type=int, default=4096, help="rows with N below this are left out of the tables")
    ap.add_argument("--text", action="store_true", help="aligned plain text instead of markdown")
    ap.add_argument("--plots", metavar="DIR", default=None, help="also write bench_forward/backward.png in DIR")
    args = ap.parse_args(argv)
    rows = read_csv(args.csv)
    print(text(rows, min_seq=args.min_seq) if args.text else markdown(rows, min_seq=args.min_seq))
    if args.plots:
        for p in plots(rows, args.plots):
            print(f"wrote {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
