"""What a compiled kernel uses, per architecture: registers, shared memory and spills (ptxas's report), and which
architectures compile alike. CI's portability report (tests/test_portability.py) checks every kernel configuration
a launcher can pick against each architecture's limits with these, on a machine with no GPU.

resource_usage reports one compile; resource_usages makes one PTX with NVRTC for the architectures that compile
alike (ptx_families) and assembles it with ptxas for each.
"""
import functools
import operator
import os
import re
from pathlib import Path

from . import kernels

def resource_usage(filename, *, arch, defines=None, name_expressions=()):
    """Compile like compile_only, with ptxas reporting; return {kernel: {"registers", "static_smem", "spill",
    "wgmma_serialized"}} for every kernel of the module (spill: bytes of spill stores; wgmma_serialized: ptxas warned
    that it serializes the kernel's wgmma instructions, each waiting for the one before), keyed by the name expression
    (extern "C" kernels: by their own name)."""
    _, log, lowered = kernels._compile(filename, arch, kernels._define_options(defines), name_expressions, verbose=True)
    return _ptxas_report(log, lowered)


def _ptxas_report(log, lowered):
    """resource_usage's answer from ptxas's -v report (log) and {name expression: lowered name}."""
    names = {v: k for k, v in lowered.items()}
    out, cur, serialized = {}, None, set()
    for line in log.splitlines():
        # ptxas may report the serialization before it names the function it compiles, so the warning's own name
        if m := re.search(r"wgmma\.mma_async instructions are serialized .* in the function '([\w$]+)'", line):
            serialized.add(names.get(m.group(1), m.group(1)))
            continue
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line)
        if m:
            cur = names.get(m.group(1), m.group(1))
            out.setdefault(cur, {"registers": 0, "static_smem": 0, "spill": 0})
        if cur is None:
            continue
        if m := re.search(r"Used (\d+) registers", line):
            out[cur]["registers"] = int(m.group(1))
        if m := re.search(r"(\d+) bytes smem", line):
            out[cur]["static_smem"] = int(m.group(1))
        if m := re.search(r"(\d+) bytes spill stores", line):
            out[cur]["spill"] = max(out[cur]["spill"], int(m.group(1)))
    for name in out:
        out[name]["wgmma_serialized"] = name in serialized
    return out


# What the preprocessor may test about the architecture it compiles for: __CUDA_ARCH__ against a number, and libcu++'s
# NV_PROVIDES_SM_XX (__CUDA_ARCH__ >= XX0) and NV_IS_EXACTLY_SM_XX (== XX0), which cuda_bf16.hpp uses.
_ARCH_TEST = re.compile(r"__CUDA_ARCH__\s*(>=|<=|==|!=|>|<)\s*(\d+)|NV_(PROVIDES|IS_EXACTLY)_SM_(\d+)")
_ARCH_SEEN = re.compile(r"__CUDA_ARCH__(?!_)|NV_(?:PROVIDES|IS_EXACTLY)_SM_")
_ARCH_DEFINED = re.compile(r"defined\s*\(?\s*__CUDA_ARCH__|#\s*if(?:n)?def\s+__CUDA_ARCH__")
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.M)
_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.S)
_COMPARE = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt,
            "<": operator.lt}


@functools.lru_cache(maxsize=None)
def arch_tests(filename):
    """The tests on the architecture in kernels/<filename> and every header it includes from kernels/ and the CUDA
    include folder (NVRTC's built-in headers, such as <nv/target>, are not files to read): ((op, N), ...) for each
    `__CUDA_ARCH__ op N`, NV_PROVIDES_SM_XX as (">=", XX0), NV_IS_EXACTLY_SM_XX as ("==", XX0). None where
    __CUDA_ARCH__ is used otherwise than in such a test or in `defined(__CUDA_ARCH__)` (compared with a macro, say),
    or where no CUDA include folder is found (cuda_bf16.hpp's tests could not be read): then which architectures
    compile alike is not known from the text."""
    cuda_dirs = kernels._cuda_include_dirs()
    if not cuda_dirs:
        return None
    search = [kernels.KERNELS_DIR, Path(cuda_dirs[0])]
    tests, seen, todo = set(), set(), [kernels.KERNELS_DIR / filename]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        found, known, includes = _arch_scan(path.read_text(errors="replace"))
        if not known:
            return None
        tests.update(found)
        for name in includes:
            for folder in [path.parent] + search:
                if (folder / name).is_file():
                    todo.append((folder / name).resolve())
                    break
    return tuple(sorted(tests))


@functools.lru_cache(maxsize=None)
def _arch_scan(text):
    """arch_tests' reading of one file's text: (its tests, whether __CUDA_ARCH__ appears only in such tests and in
    defined(__CUDA_ARCH__), the names it includes). Kept per text: every kernel includes the same CUDA headers."""
    code = _COMMENT_OR_STRING.sub(lambda m: m[0] if m[0][0] == '"' else " ", text)  # without comments
    bare = _COMMENT_OR_STRING.sub(lambda m: '""' if m[0][0] == '"' else " ", text)  # and without strings
    found = _ARCH_TEST.findall(bare)
    known = len(found) + len(_ARCH_DEFINED.findall(bare)) == len(_ARCH_SEEN.findall(bare))
    tests = {(op, int(n)) if op else (">=" if nv == "PROVIDES" else "==", int(sm) * 10) for op, n, nv, sm in found}
    return frozenset(tests), known, tuple(_INCLUDE.findall(code))


def ptx_families(filename, archs):
    """archs (sm_XX) grouped by the PTX NVRTC makes for them from kernels/<filename>: [[arch, ...]] in order, the
    members of a group taking the same side of every test in arch_tests(filename). NVRTC's PTX depends on the
    architecture through those tests, so a group's members share one PTX, the one made for its first (oldest)
    member (tests/test_portability.py checks this on a module). Each architecture alone where arch_tests is None."""
    tests = arch_tests(filename)
    order = sorted(archs, key=_arch_number)
    if tests is None:
        return [[a] for a in order]
    groups = {}
    for a in order:
        groups.setdefault(tuple(_COMPARE[op](_arch_number(a), n) for op, n in tests), []).append(a)
    return list(groups.values())


def _arch_digits(arch):
    """What names an architecture's number: "86" of sm_86, "90a" of sm_90a (its virtual architecture: compute_86,
    compute_90a)."""
    return arch.split("_", 1)[1]


def _arch_number(arch):
    """__CUDA_ARCH__ for sm_XX (and its arch-specific sm_XXa): XX0."""
    return int(_arch_digits(arch).rstrip("af")) * 10


@functools.lru_cache(maxsize=None)
def ptxas():
    """The path of a ptxas of NVRTC's own release, or None: the nvidia-cuda-nvcc wheel's (requirements.txt), else a CUDA
    toolkit's. The report of one is the report NVRTC's compile gives."""
    import subprocess

    from cupy_backends.cuda.libs import nvrtc

    release = "release {}.{},".format(*nvrtc.getVersion())
    candidates = []
    try:
        import nvidia.cuda_nvcc as wheel

        candidates += [os.path.join(p, "bin", "ptxas") for p in wheel.__path__]
    except ImportError:
        pass
    candidates += [os.path.join(p, "bin", "ptxas") for p in (os.environ.get("CUDA_PATH"), "/usr/local/cuda") if p]
    for path in candidates:
        if os.access(path, os.X_OK):
            if release in subprocess.run([path, "--version"], capture_output=True, text=True).stdout:
                return path
    return None


def resource_usages(filename, names_by_arch, *, defines=None, nvrtc_options=(), ptxas_options=()):
    """resource_usage for several architectures: {arch: {kernel: usage}} for names_by_arch {arch: [name expression,
    ...]} (an empty list: every kernel of the module). The front end of a compile (parsing, template instantiation,
    NVVM's optimizer: about half its time) is the same for the architectures of one PTX family (ptx_families): NVRTC
    makes the family's PTX once, with every member's kernels, and ptxas compiles it for each member, that member's
    kernels only (--entry). Without a ptxas of NVRTC's release: one NVRTC compile per architecture. nvrtc_options and
    ptxas_options are added to each compiler's command line (the default: the optimized build a GPU runs)."""
    import subprocess
    import tempfile

    tool, options = ptxas(), kernels._define_options(defines) + tuple(nvrtc_options)
    if tool is None:
        return {a: _ptxas_report(*kernels._compile(filename, a, options + tuple(f"--ptxas-options={o}"
                                                                                for o in ptxas_options),
                                                   names, verbose=True)[1:])
                for a, names in names_by_arch.items()}
    out = {}
    for family in ptx_families(filename, list(names_by_arch)):
        names = sorted({n for a in family for n in names_by_arch[a]})
        virtual = "compute_" + _arch_digits(family[0])
        ptx, _, lowered = kernels._compile(filename, virtual, options, names, verbose=False)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "module.ptx")
            with open(src, "wb") as fh:
                fh.write(ptx if isinstance(ptx, bytes) else ptx.encode())
            for arch in family:
                entries = [lowered[n] for n in names_by_arch[arch]]
                cubin = os.path.join(tmp, f"{arch}.cubin")
                run = subprocess.run([tool, "-v", *ptxas_options, f"-arch={arch}", "-o", cubin, src]
                                     + (["--entry", ",".join(entries)] if entries else []),
                                     capture_output=True, text=True)
                if run.returncode:
                    raise RuntimeError(f"{filename} does not compile for {arch} (ptxas):\n{run.stdout}{run.stderr}")
                out[arch] = _ptxas_report(run.stdout + run.stderr, {n: lowered[n] for n in names_by_arch[arch]})
    return out
