"""Which of stage 02's compiled kernels differ between this tree and another: NVRTC on the CPU, no GPU needed.

    python dev/compare_cubins.py --before /tmp/before        # a checkout of older code (git worktree / git archive)
    python dev/compare_cubins.py --before /tmp/before --archs sm_90 sm_80 --csv out.csv

Every kernel instantiation stage 02 may launch (flash_v2.kernel_sources(): each file with its -D defines and its
template instantiations, the union over every GPU architecture's configurations) is compiled to a cubin for each
architecture asked, in this tree and in the other one, each tree in a process of its own that imports its own
`stages`. A kernel is then

    identical     its module's cubin is byte for byte the other tree's
    same code     every section of the kernel (.text, .nv.info, .nv.constant0, .nv.shared, relocations) is the other
                  tree's byte for byte; only names differ (a kernel renamed, a module holding other kernels too)
    differs       its machine code or its attributes differ: time it before and after (dev/bench.py)
    new           no counterpart in the other tree

NVRTC is not always deterministic: a few modules compile to one of two cubins from run to run, in either tree. A
kernel that differs is therefore compiled --tries more times on both sides, and is "same code" when some compile of
one tree equals some compile of the other (the row says how many distinct cubins were seen).

Counterparts are found by file, defines and name; where version fp32 of an older tree became two files (fp32: the
paper's loop, fp32_overlap: the loads overlapping the math), split_fp32 maps each new module to the old file's
defines that compiled the same code. A cubin holds no path of the tree it was compiled in (a copy of a tree compiles
to the same cubins); --self-check compiles this tree --tries times, in processes of their own, and lists the modules
whose cubin changes from run to run.
"""
import argparse
import csv
import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The worker: in a process whose `stages` is the tree's, compile each job to a cubin and say where its kernels are.
WORKER = r"""
import json, sys
root, jobs_file, out_dir = sys.argv[1:4]
sys.path.insert(0, root)
from stages.common import kernels
jobs = json.load(open(jobs_file))
index = []
for n, (file, defines, names, arch) in enumerate(jobs):
    code, _, lowered = kernels._compile(file, arch, kernels._define_options(defines), names, verbose=False)
    path = f"{out_dir}/{n}.cubin"
    open(path, "wb").write(code)
    index.append({"cubin": path, "lowered": lowered})
json.dump(index, open(f"{out_dir}/index.json", "w"))
"""

LISTER = r"""
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
from stages import flash_v2
split = os.path.exists(os.path.join(root, "kernels", "flash_v2_forward_fp32_overlap.cu"))
print(json.dumps({"split": split, "sources": [[f, d, list(n)] for f, d, n in flash_v2.kernel_sources()]}))
"""


def list_sources(root):
    """flash_v2.kernel_sources() of the tree at root, and whether its fp32 kernel is split in two files."""
    run = subprocess.run([sys.executable, "-c", LISTER, root], capture_output=True, text=True, cwd=root)
    if run.returncode:
        raise SystemExit(f"{root}: stages.flash_v2 does not import:\n{run.stderr}")
    got = json.loads(run.stdout)
    return got["split"], [(f, {k: int(v) for k, v in d.items()}, tuple(n)) for f, d, n in got["sources"]]


def compile_all(root, jobs):
    """[(cubin bytes, {name expression: lowered name})] of each job (file, defines, names, arch), compiled by the
    tree at root in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="cubins_") as tmp:
        jobs_file = os.path.join(tmp, "jobs.json")
        with open(jobs_file, "w") as f:
            json.dump(jobs, f)
        run = subprocess.run([sys.executable, "-c", WORKER, root, jobs_file, tmp], capture_output=True, text=True,
                             cwd=root)
        if run.returncode:
            raise SystemExit(f"{root}: compiling failed:\n{run.stderr[-4000:]}")
        with open(os.path.join(tmp, "index.json")) as f:
            index = json.load(f)
        out = []
        for entry in index:
            with open(entry["cubin"], "rb") as f:
                out.append((f.read(), entry["lowered"]))
        return out


def sections(cubin):
    """{section name: bytes} of an ELF cubin (NOBITS sections: empty)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = heads[shstrndx][4]
    out = {}
    for name, typ, _, _, off, size, *_ in heads:
        label = cubin[names_at + name:cubin.index(b"\0", names_at + name)].decode()
        out[label] = b"" if typ == 8 else cubin[off:off + size]
    return out


def kernel_sections(cubin, symbol):
    """The sections of one kernel in a cubin, keyed with its symbol replaced by "K"."""
    return {name.replace(symbol, "K"): data for name, data in sections(cubin).items()
            if name.endswith("." + symbol) or ("." + symbol + ".") in name}


def split_fp32(file, defines):
    """The (file, defines, kernel name) of an older tree's single fp32 kernel that compiled the same code as this
    module of the split tree (fp32: ASYNC_V and PREFETCH_K off; fp32_overlap: PREFETCH_K on, SHARE_KV off)."""
    if file == "flash_v2_forward_fp32.cu":
        return file, {**defines, "ASYNC_V": 0, "PREFETCH_K": 0}, "flash_v2_forward_fp32"
    if file == "flash_v2_forward_fp32_overlap.cu":
        return "flash_v2_forward_fp32.cu", {**defines, "PREFETCH_K": 1, "SHARE_KV": 0}, "flash_v2_forward_fp32"
    return None


def plan(after, before, before_split):
    """[(label, after job (file, defines, names), before job or None, {after kernel symbol/expr: before one})]."""
    old = {(f, tuple(sorted(d.items()))): names for f, d, names in before}
    rows = []
    for f, d, names in after:
        if names:  # template instantiations: each kernel by its name expression
            have = old.get((f, ()), ())
            common = tuple(n for n in names if n in have)
            rows.append((f, (f, d, names), (f, d, common) if common else None, {n: n for n in common}))
            continue
        kernel = f.removesuffix(".cu")  # extern "C": the kernel is named after its file
        ofile, odefs, okernel = (f, d, kernel) if before_split else split_fp32(f, d)
        known = (ofile, tuple(sorted(odefs.items()))) in old
        rows.append((f"{f} {d}", (f, d, ()), (ofile, odefs, ()) if known else None, {kernel: okernel} if known else {}))
    return rows


def compare(after_root, before_root, archs, csv_path=None, tries=4, files=None):
    split_a, after = list_sources(after_root)
    split_b, before = list_sources(before_root)
    after = [s for s in after if not files or s[0] in files]
    rows = plan(after, before, split_b or not split_a)
    jobs_a = [[f, d, list(n), a] for _, (f, d, n), _, _ in rows for a in archs]
    jobs_b = [[f, d, list(n), a] for _, _, job, _ in rows if job for f, d, n in [job] for a in archs]
    print(f"compiling {len(jobs_a)} modules in {after_root} and {len(jobs_b)} in {before_root} ...", flush=True)
    got_a, got_b = compile_all(after_root, jobs_a), compile_all(before_root, jobs_b)
    results, again, ia, ib = [], [], iter(got_a), iter(got_b)
    for label, (f, d, names), job, counterpart in rows:
        for arch in archs:
            cubin_a, low_a = next(ia)
            cubin_b, low_b = next(ib) if job else (None, {})
            for kern in list(names) or [f.removesuffix(".cu")]:
                if kern not in counterpart:
                    status = "new"
                elif cubin_a == cubin_b:
                    status = "identical"
                elif _code(cubin_a, low_a, kern) == _code(cubin_b, low_b, counterpart[kern]):
                    status = "same code"
                else:
                    status = "differs"
                    again.append((len(results), [f, d, list(names), arch], [*job[:2], list(job[2]), arch], kern,
                                  counterpart[kern]))
                results.append(dict(file=f, defines=json.dumps(d, sort_keys=True), kernel=kern, arch=arch,
                                    status=status))
    if again:  # the compiler is not always deterministic: compile both sides a few more times before saying so
        print(f"{len(again)} kernels differ; compiling each side {tries} more times", flush=True)
        more_a = compile_all(after_root, [j for _, j, _, _, _ in again for _ in range(tries)])
        more_b = compile_all(before_root, [j for _, _, j, _, _ in again for _ in range(tries)])
        for n, (row, _, _, kern, okern) in enumerate(again):
            codes_a = [_code(c, low, kern) for c, low in more_a[n * tries:(n + 1) * tries]]
            codes_b = [_code(c, low, okern) for c, low in more_b[n * tries:(n + 1) * tries]]
            variants = len({_frozen(c) for c in codes_a}) + len({_frozen(c) for c in codes_b})
            if any(a == b for a in codes_a for b in codes_b):
                results[row]["status"] = f"same code (one of {variants} cubins the compiler makes, both trees)"
    summary = {}
    for r in results:
        counts = summary.setdefault((r["file"], r["arch"]), {})
        status = "same code" if r["status"].startswith("same code") else r["status"]
        counts[status] = counts.get(status, 0) + 1
    print(f"\n{'file':<36} {'arch':<6} {'kernels':>7}  identical / same code / differs / new")
    for (f, arch), counts in sorted(summary.items()):
        n = sum(counts.values())
        print(f"{f:<36} {arch:<6} {n:>7}  {counts.get('identical', 0)} / {counts.get('same code', 0)} / "
              f"{counts.get('differs', 0)} / {counts.get('new', 0)}")
    for r in results:
        if r["status"] not in ("identical", "same code", "new"):
            print(f"  {r['status']}: {r['file']} {r['defines']} {r['kernel']} {r['arch']}")
    if csv_path:
        with open(csv_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(results[0]))
            w.writeheader()
            w.writerows(results)
        print(f"wrote {csv_path}")
    return results


def _code(cubin, lowered, kernel):
    """kernel_sections of one kernel (a name expression or an extern "C" name) of a cubin."""
    return kernel_sections(cubin, lowered.get(kernel, kernel))


def _frozen(sections):
    return tuple(sorted(sections.items()))


def self_check(root, archs, tries=3):
    """Compile every module of the tree `tries` times, each time in a process of its own: how many give the same
    cubin every time (the compiler's output does not depend on the path of the tree, nor, mostly, on the run)."""
    _, sources = list_sources(root)
    jobs = [[f, d, list(n), a] for f, d, n in sources for a in archs]
    runs = [compile_all(root, jobs) for _ in range(tries)]
    unstable = [j for n, j in enumerate(jobs) if len({run[n][0] for run in runs}) > 1]
    print(f"self-check: {len(jobs) - len(unstable)} of {len(jobs)} modules compile to the same cubin {tries} times")
    for f, d, _, arch in unstable:
        print(f"  not deterministic: {f} {d} {arch}")
    return not unstable


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="the other tree (its root folder, holding stages/ and kernels/)")
    ap.add_argument("--after", default=ROOT, help="this tree (default: the checkout this script is in)")
    ap.add_argument("--archs", nargs="+", default=["sm_90", "sm_80"])
    ap.add_argument("--csv", help="write every kernel's row to this CSV")
    ap.add_argument("--files", nargs="+", help="only these kernel files of this tree (default: every one)")
    ap.add_argument("--self-check", action="store_true", help="compile --after --tries times (determinism)")
    ap.add_argument("--tries", type=int, default=4, help="compiles per side of a kernel that differs (default 4)")
    args = ap.parse_args(argv)
    if args.self_check:
        return 0 if self_check(os.path.abspath(args.after), args.archs, args.tries) else 1
    if not args.before:
        ap.error("--before PATH is needed (or --self-check)")
    results = compare(os.path.abspath(args.after), os.path.abspath(args.before), args.archs, args.csv, args.tries,
                      args.files)
    return 1 if any(r["status"] == "differs" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
