"""Whether stage 06's compiled code changed between two trees: every instantiation a stage 06 launcher may launch,
compiled in each tree as its launcher compiles it, compared byte for byte; where a cubin differs, its registers and
SASS instructions side by side. No GPU needed: NVRTC compiles for sm_90a on the CPU.

    git -C /path/to/repo archive <commit> | tar -x -C /tmp/before      # the tree to compare against
    python dev/compare_cubins_hopper.py --before /tmp/before           # this tree against it
    python dev/compare_cubins_hopper.py --before /tmp/before --twice   # first: does each tree compile alike twice?
    python dev/compare_cubins_hopper.py --before /tmp/before --rename 'old<..>=new<..>'   # a kernel renamed

A kernel whose cubin is unchanged needs no new timing (issue 68); one that changed needs a before/after benchmark on
the GPU. Each instantiation is one NVRTC module, as stages/common/kernels.py's _compile makes it for the launchers
(the tree's own _compile, with NVRTC's cache off so that --twice compiles twice). The instantiations of a tree are
what stages.hopper.instantiations() lists, or, in a tree from before that function, what its launchers' kernel_names
list. Kernels are matched by name expression (--rename for one renamed in between). Registers and SASS come from
cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm; found on PATH, or in the folder
given by CUDA_BIN); without them, only the bytes are compared.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- in a tree (a subprocess per tree)
def _listed(hopper):
    """[(file, name expression)] of every stage 06 kernel of the imported tree's stages.hopper."""
    if hasattr(hopper, "instantiations"):
        return [tuple(x) for x in hopper.instantiations()]
    from stages.hopper import blocks, flash_v3, flash_v3_backward, fp8, fp32x3  # the launchers before instantiations()

    out = [(blocks.FILE, n) for n in blocks.kernel_names()]
    out += [(flash_v3.FILES[v], n) for v in flash_v3.VERSIONS for n in flash_v3.kernel_names(v)]
    out += [(flash_v3.FILES["pingpong"], n) for n in fp8.kernel_names()] + [(fp8.FILE, n) for n in fp8.prepass_names()]
    out += [(fp32x3.FILE, n) for n in fp32x3.kernel_names()]
    return out + [(flash_v3_backward.FILES[v], n) for v in flash_v3_backward.VERSIONS
                  for n in flash_v3_backward.kernel_names(v)]


def compile_tree(tree, out_dir):
    """Compile every instantiation of the tree (imported from tree) into out_dir; print [(file, name, cubin path)] as
    JSON."""
    sys.path.insert(0, str(tree))
    os.chdir(tree)
    from cupy_backends.cuda.libs import nvrtc

    import stages.hopper as hopper
    from stages.common import kernels

    real = nvrtc.compileProgram
    nvrtc.compileProgram = lambda prog, opts: real(prog, list(opts) + ["--no-cache"])  # a fresh compile each time
    done = []
    for i, (file, name) in enumerate(_listed(hopper)):
        # as the launchers' compile helper: a template by its name expression, an extern "C" kernel by the file alone
        cubin = kernels._compile(file, "sm_90a", (), [name] if "<" in name else [], verbose=False)[0]
        path = Path(out_dir) / f"{i:03d}.cubin"
        path.write_bytes(cubin)
        done.append((file, name, str(path)))
    print(json.dumps(done))


# ----------------------------------------------------------------------------- comparing
def _compiled(tree, work):
    """{name: (file, cubin bytes)} of a tree, compiled in a subprocess that imports that tree's stages."""
    out = Path(tempfile.mkdtemp(dir=work))
    proc = subprocess.run([sys.executable, __file__, "--compile-tree", str(tree), "--out", str(out)],
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"compiling {tree} failed:\n{proc.stderr[-4000:]}")
    return {name: (file, Path(path).read_bytes()) for file, name, path in json.loads(proc.stdout.splitlines()[-1])}


def _tools():
    """(cuobjdump, environment with NVDISASM_PATH) or None."""
    folders = [os.environ.get("CUDA_BIN")] + os.environ.get("PATH", "").split(os.pathsep)
    found = {t: next((str(Path(f) / t) for f in folders if f and (Path(f) / t).is_file()), None)
             for t in ("cuobjdump", "nvdisasm")}
    if not all(found.values()):
        return None
    return found["cuobjdump"], dict(os.environ, NVDISASM_PATH=str(Path(found["nvdisasm"]).parent))


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def inspect(cubin, tools, work):
    """(registers, SASS instructions without addresses) of the cubin's one kernel, by cuobjdump."""
    cuobjdump, env = tools
    path = Path(tempfile.mkstemp(suffix=".cubin", dir=work)[1])
    path.write_bytes(cubin)
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True, env=env)
    sass = subprocess.run([cuobjdump, "--dump-sass", str(path)], capture_output=True, text=True, env=env)
    regs = [int(r) for r in re.findall(r"REG:(\d+)", usage.stdout)]
    return (max(regs) if regs else None), _INSTRUCTION.findall(sass.stdout)


def compare(before, after, renames, tools, work):
    """Rows of the comparison: name (after), file, identical, and where a cubin differs registers and SASS
    instruction counts before / after, and whether the SASS is the same instructions (a renamed kernel)."""
    rows, seen = [], set()
    for old, (old_file, old_cubin) in before.items():
        name = renames.get(old, old)
        if name not in after:
            rows.append({"name": old, "file": old_file, "verdict": "only before"})
            continue
        seen.add(name)
        file, cubin = after[name]
        row = {"name": name, "file": file, "bytes": f"{len(old_cubin)} / {len(cubin)}",
               "verdict": "identical" if cubin == old_cubin else "changed"}
        if old != name:
            row["was"] = old
        if cubin != old_cubin and tools:
            (r0, s0), (r1, s1) = inspect(old_cubin, tools, work), inspect(cubin, tools, work)
            row.update(registers=f"{r0} / {r1}", sass=f"{len(s0)} / {len(s1)}",
                       verdict="same SASS" if s0 == s1 and r0 == r1 else "changed")
        rows.append(row)
    rows += [{"name": n, "file": f, "verdict": "only after"} for n, (f, _) in after.items() if n not in seen]
    return rows


def markdown(rows):
    cols = ["name", "file", "verdict", "bytes", "registers", "sass", "was"]
    cols = [c for c in cols if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")).replace("|", "\\|") for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="the tree to compare this one (or --after) against")
    ap.add_argument("--after", type=Path, default=ROOT, help="the tree compared (default: this checkout)")
    ap.add_argument("--twice", action="store_true", help="first compile each tree twice and compare it with itself")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="a kernel's name expression before and after (repeatable)")
    ap.add_argument("--compile-tree", type=Path, help=argparse.SUPPRESS)  # the subprocess's mode
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_tree:
        compile_tree(args.compile_tree.resolve(), args.out)
        return 0
    if args.before is None:
        ap.error("--before TREE is required (a tree to compare against, e.g. from git archive)")
    renames = dict(r.split("=", 1) for r in args.rename)
    tools = _tools()
    if tools is None:
        print("cuobjdump / nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, then PATH or "
              "CUDA_BIN): comparing bytes only")
    work = tempfile.mkdtemp(prefix="cubins_")
    try:
        ok = True
        trees = {"before": args.before.resolve(), "after": args.after.resolve()}
        compiled = {}
        for what, tree in trees.items():
            compiled[what] = _compiled(tree, work)
            if args.twice:
                again = _compiled(tree, work)
                same = [n for n in again if again[n][1] == compiled[what][n][1]]
                ok &= len(same) == len(again)
                print(f"{what} ({tree}) compiled twice: {len(same)} of {len(again)} cubins identical")
        rows = compare(compiled["before"], compiled["after"], renames, tools, work)
        print(markdown(rows))
        counts = {}
        for r in rows:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        print("\n" + ", ".join(f"{n} {v}" for v, n in counts.items()))
        digest = hashlib.sha256(b"".join(c for _, c in compiled["after"].values())).hexdigest()[:16]
        print(f"after: {len(compiled['after'])} instantiations, sha256 of all cubins {digest}")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
