"""Loading kernels/*.cu: cupy.RawModule on a GPU (cached), or NVRTC compile-only with no GPU.

The compile-only path is what CI runs: every kernel configuration a launcher can pick is compiled for each
architecture from sm_75 to sm_90 (resource_usage reports its registers and shared memory; resource_usages makes one
PTX with NVRTC for the architectures that compile alike and assembles it with ptxas for each), so a kernel that does
not compile or does not fit never lands, even though CI has no GPU.
"""
import ctypes
import functools
import hashlib
import operator
import os
import re
import struct
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import device
from .fast_path import empties, out_layout
from .verify import empty

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
# -default-device: functions without __device__ are device functions, as NVRTC compiles device code only; it lets a
# kernel use generic lambdas ([&](auto w) { .. }), whose call operators are templates without an execution space.
BASE_OPTIONS = ("-std=c++17", "-default-device")


def _headers_digest(kernels_dir):
    """sha256 (16 hex digits) of every header in kernels_dir: name and contents, in name order."""
    h = hashlib.sha256()
    for p in sorted(Path(kernels_dir).glob("*.cuh")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _source(filename, kernels_dir=None):
    """The text compiled for kernels/<filename>: the file, then a comment with the digest of the headers.

    CuPy keeps compiled modules on disk keyed by the source text and the options, and the text of a .cu file does not
    change when a header it includes does. The digest line makes every header edit a new key, so a learner who edits
    common.cuh gets a fresh compile instead of a cached module built from the old header."""
    kernels_dir = Path(kernels_dir or KERNELS_DIR)
    path = kernels_dir / filename
    if not path.exists():
        raise FileNotFoundError(f"no kernel source {path}")
    return path.read_text() + f"\n// headers kernels/*.cuh: sha256 {_headers_digest(kernels_dir)}\n"


def _define_options(defines):
    return tuple(f"-D{k}={v}" for k, v in sorted(dict(defines or {}).items()))


@functools.lru_cache(maxsize=None)
def _load(filename, defines, name_expressions, target=None):
    import cupy

    if target is not None:
        return _TargetModule(filename, defines, name_expressions or (), target)
    return cupy.RawModule(
        code=_source(filename),
        options=BASE_OPTIONS + (f"-I{KERNELS_DIR}",) + defines,
        name_expressions=name_expressions,
        backend="nvrtc",
    )


def load_module(filename, *, defines=None, name_expressions=None, target=None):
    """cupy.RawModule for kernels/<filename>, compiled once per (file, defines) and cached.

    defines: {"NAME": value} passed as -DNAME=value. name_expressions: template instantiations
    to look up later with module.get_function(expr). Under ATTN_ARCH=sm_XX the module is compiled for that
    architecture (_TargetModule), so the GPU runs the code an sm_XX GPU would run. target: an NVRTC architecture to
    compile for instead of the GPU's own (e.g. "sm_90a", the arch-specific target whose wgmma stage 06 needs).
    """
    if target is None and (cc := _emulated_cc()) is not None:
        target = f"compute_{cc}"
    return _load(filename, _define_options(defines), tuple(name_expressions) if name_expressions else None, target)


def _emulated_cc():
    """The compute capability ATTN_ARCH emulates (e.g. 75), or None when it is unset."""
    if device._arch_env() is None:
        return None
    return device.device().arch.cc


class _TargetModule:
    """kernels/<filename> compiled by NVRTC for another target than the GPU's own, and loaded from that code.
    target compute_XX (ATTN_ARCH=sm_XX, an older architecture than the GPU's): PTX, which the driver translates for
    the GPU it runs on; the code is what an sm_XX GPU runs, with __CUDA_ARCH__ = XX0 (sm_75's paths in
    kernels/common.cuh: m16n8k8 pairs, synchronous copies), on a newer GPU. target sm_XXa (an arch-specific target,
    stage 06's sm_90a): a cubin for exactly that architecture. get_function takes the same names as
    cupy.RawModule's (template instantiations by their name expressions)."""

    _dir = None  # a temporary folder for the compiled files, removed when the process ends

    def __init__(self, filename, defines, name_expressions, target):
        import tempfile

        import cupy

        code, _, self._lowered = _compile(filename, target, defines, name_expressions, verbose=False)
        if _TargetModule._dir is None:
            _TargetModule._dir = tempfile.TemporaryDirectory(prefix="attn_modules_")
        ptx = target.startswith("compute_")
        fd, path = tempfile.mkstemp(suffix=".ptx" if ptx else ".cubin", dir=_TargetModule._dir.name)
        with os.fdopen(fd, "wb") as f:
            f.write(code.rstrip(b"\0") if ptx else code)
        self._module = cupy.RawModule(path=path)

    def get_function(self, name):
        return self._module.get_function(self._lowered.get(name, name))


def function(module, name, smem):
    """module.get_function(name), allowed smem bytes of dynamic shared memory (above 48 KB a kernel must opt in)."""
    fn = module.get_function(name)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def scalar_slot(x):
    """The 8-byte kernel-parameter slot of a numpy scalar argument (int32, uint32, float32, int64, uint64, ...): its
    bytes, little-endian, zero-padded to 8. The driver reads as many bytes from the slot as the kernel's parameter
    has (4 for int and float, 8 for a pointer or long long), so one 8-byte slot holds any of them."""
    if not isinstance(x, np.generic) or x.dtype.itemsize > 8:
        raise TypeError(f"a kernel's scalar argument must be a numpy scalar of at most 8 bytes (np.int32(n), "
                        f"np.float32(x), ...), got {type(x).__name__}")
    return int.from_bytes(x.tobytes().ljust(8, b"\0"), "little")


class Launch:
    """One kernel launch as a launcher plans it: the compiled function, grid, block, dynamic shared memory, and the
    kernel's arguments. launch(*arrays) runs it on the current stream; an array is a CuPy array or a device address
    (an int, np.uint64(0) for a null pointer).

    The arguments are either a parameter struct (stages/common/params.py: the kernel takes one `FwdParams p`), whose
    leading pointer fields the arrays of each call fill in order, or a tuple of numpy scalars that follow the arrays
    (a kernel that takes its arguments one by one).

    How a launch reaches the GPU: cuLaunchKernel takes kernelParams, an array of one pointer per kernel parameter,
    each pointing at that parameter's value. A plan's scalars are the same on every call, so they are written once:
    into the struct, or into 8-byte slots after the arrays' slots (scalar_slot). A call writes only the arrays' device
    addresses and launches: a few microseconds of host time, where a general launcher (cupy.RawKernel) converts every
    argument again on every call. The lock keeps two threads from writing one plan's values at once; the driver
    copies them when the launch is queued, so they are free again as soon as cuLaunchKernel returns."""

    def __init__(self, fn, grid, block, smem, args):
        self.fn, self.smem = fn, int(smem)
        self.params = args if isinstance(args, ctypes.Structure) else None
        self.scalars = () if self.params is not None else tuple(args)
        self.grid, self.block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        self.dims = (*self.grid, *self.block, self.smem)  # cuLaunchKernel's grid, block and shared-memory arguments
        self._slots = {}  # number of arrays -> _slots_for(number)
        self._lock = threading.Lock()

    def with_scalars(self, scalars):
        """The same launch with other scalar arguments (a call's dropout seed)."""
        return Launch(self.fn, self.grid, self.block, self.smem, scalars)

    def with_fields(self, **fields):
        """The same launch with some fields of its parameter struct changed (a call's dropout seed)."""
        params = type(self.params).from_buffer_copy(self.params)
        for name, value in fields.items():
            setattr(params, name, value)
        return Launch(self.fn, self.grid, self.block, self.smem, params)

    def _slots_for(self, n):
        """(values, pointer array, its address, a packer of the n array addresses into values) for a call with n
        arrays. Struct: values is the struct, the pointer array has its one address, and the packer writes the
        addresses into its first n (pointer) fields. Scalars: values holds n + len(scalars) slots, the pointer array
        one address per slot."""
        hit = self._slots.get(n)
        if hit is None:
            if self.params is not None:
                values = self.params
                pointers = np.array([ctypes.addressof(values)], np.uint64)
            else:
                values = np.zeros(n + len(self.scalars), np.uint64)
                values[n:] = [scalar_slot(x) for x in self.scalars]
                pointers = values.ctypes.data + 8 * np.arange(values.size, dtype=np.uint64)
            hit = self._slots[n] = (values, pointers, int(pointers.ctypes.data), struct.Struct(f"<{n}Q").pack_into)
        return hit

    def __call__(self, *arrays, fields=()):
        """fields: (byte offset, bytes) pairs written into the parameter struct with the arrays' addresses, for what
        changes with the arrays beside their addresses (stage 06's tensor maps)."""
        ndarray, driver, current_stream = _cuda()
        values, _, params, pack = self._slots.get(len(arrays)) or self._slots_for(len(arrays))
        ptrs = [a.data.ptr if isinstance(a, ndarray) else int(a) for a in arrays]
        if fields and self.params is None:
            raise TypeError("Launch: fields go into a parameter struct; this launch takes its arguments one by one")
        for attempt in (0, 1):
            with self._lock:
                pack(values, 0, *ptrs)
                for offset, data in fields:
                    ctypes.memmove(ctypes.addressof(values) + offset, data, len(data))
                try:
                    # fn is a cupy.RawKernel; fn.kernel, its compiled function on the current device
                    driver.launchKernel(self.fn.kernel.ptr, *self.dims, current_stream().ptr, params, 0)
                    return
                except driver.CUDADriverError as e:
                    if e.status != _CUDA_ERROR_INVALID_CONTEXT or attempt:
                        raise
            # a host thread whose CUDA context was never made current: the runtime makes the device's (once per thread)
            import cupy

            cupy.cuda.runtime.setDevice(cupy.cuda.runtime.getDevice())


@functools.cache
def _cuda():
    """(cupy.ndarray, CuPy's CUDA driver module, cupy.cuda.get_current_stream), imported on the first launch."""
    import cupy
    from cupy_backends.cuda.api import driver

    return cupy.ndarray, driver, cupy.cuda.get_current_stream


_CUDA_ERROR_INVALID_CONTEXT = 201


class ForwardLaunch(NamedTuple):
    """A forward as its launcher planned it: plan(q, k, v) returns o (in odtype) and lse (float32) through
    run_forward, with the extra arrays after lse (ALiBi slopes, a packed batch's bounds). merges: the kernel merges its
    result into the (o, lse) it is given (version pipelined with float32 o: lse starts at -inf, "nothing merged
    yet"). outs: o and lse carved from one allocation (fast_path.out_layout), or None: two allocations."""
    launch: Launch
    odtype: np.dtype
    extra: tuple = ()
    merges: bool = False
    outs: tuple | None = None

    def __call__(self, q, k, v):
        return run_forward(self.launch, q, k, v, self.odtype, *self.extra, outs=self.outs, merges=self.merges)

    def with_joint_outputs(self, q, k, v):
        """This plan with o and lse from one allocation for inputs shaped like q (fast_path keeps it so): the pair is
        what a forward saves for its backward, so the two live as long as each other anyway."""
        B, H, Nq, D = q.shape
        return self._replace(outs=out_layout([((B, H, Nq, D), self.odtype), ((B, H, Nq), np.float32)]))


def row_major(x, dtype=None):
    """x as the kernels read it: C-contiguous, and (CuPy) starting on a 16-byte boundary, since their vector loads,
    cp.async copies and tensor maps move 16 bytes at a time from the start of a row; a view that starts inside an
    allocation (flat[1:].reshape(...)) may not. x itself when it already is so, otherwise a copy. numpy arrays (the CPU
    mirrors): C-contiguous only."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x, dtype=dtype)
    y = sys.modules["cupy"].ascontiguousarray(x, dtype=dtype)  # x is a CuPy array: cupy is imported
    return y if y.data.ptr % 16 == 0 else y.copy()  # a fresh allocation starts on a 256-byte boundary


def run_forward(launch, q, k, v, odtype, *extra, outs=None, merges=False):
    """o, lse of a forward launch: q, k, v made row-major (B, H, N, D) (row_major: a copy only for other layouts),
    o (B, H, Nq, D) in odtype and lse (B, H, Nq) float32 allocated (NaN-poisoned under the tests, so an element the
    kernel does not write fails the check), from one allocation when outs is given, and the launch on the current
    stream with arguments (q, k, v, o, lse, *extra)."""
    import cupy

    q, k, v = row_major(q), row_major(k), row_major(v)  # each x itself when it is already row-major
    if outs is not None:
        o, lse = empties(*outs)
    else:
        B, H, Nq, D = q.shape
        o = empty(cupy, (B, H, Nq, D), odtype)
        lse = empty(cupy, (B, H, Nq), np.float32)
    if merges:
        lse.fill(-np.inf)
    launch(q, k, v, o, lse, *extra)
    return o, lse


def _cuda_include_dirs():
    """Header folders for NVRTC without a CUDA toolkit: the pip wheel nvidia-cuda-runtime-cu12."""
    dirs = []
    try:
        import nvidia.cuda_runtime as rt

        for p in rt.__path__:
            if os.path.isdir(os.path.join(p, "include")):
                dirs.append(os.path.join(p, "include"))
    except ImportError:
        pass
    for p in (os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if p and os.path.isdir(os.path.join(p, "include")):
            dirs.append(os.path.join(p, "include"))
    return dirs


def compile_only(filename, *, arch="sm_90", defines=None, name_expressions=()):
    """Compile kernels/<filename> with NVRTC for `arch` with no GPU; return the cubin bytes.

    Raises RuntimeError with NVRTC's log when the source does not compile.
    """
    return _compile(filename, arch, _define_options(defines), name_expressions, verbose=False)[0]


def resource_usage(filename, *, arch, defines=None, name_expressions=()):
    """Compile like compile_only, with ptxas reporting; return {kernel: {"registers", "static_smem", "spill",
    "wgmma_serialized"}} for every kernel of the module (spill: bytes of spill stores; wgmma_serialized: ptxas warned
    that it serializes the kernel's wgmma instructions, each waiting for the one before), keyed by the name expression
    (extern "C" kernels: by their own name)."""
    _, log, lowered = _compile(filename, arch, _define_options(defines), name_expressions, verbose=True)
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
    cuda_dirs = _cuda_include_dirs()
    if not cuda_dirs:
        return None
    search = [KERNELS_DIR, Path(cuda_dirs[0])]
    tests, seen, todo = set(), set(), [KERNELS_DIR / filename]
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

    tool, options = ptxas(), _define_options(defines) + tuple(nvrtc_options)
    if tool is None:
        return {a: _ptxas_report(*_compile(filename, a, options + tuple(f"--ptxas-options={o}" for o in ptxas_options),
                                           names, verbose=True)[1:])
                for a, names in names_by_arch.items()}
    out = {}
    for family in ptx_families(filename, list(names_by_arch)):
        names = sorted({n for a in family for n in names_by_arch[a]})
        ptx, _, lowered = _compile(filename, "compute_" + _arch_digits(family[0]), options, names, verbose=False)
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


def _whole_elf(cubin):
    """The cubin with the bytes CuPy's getCUBIN leaves off restored. getCUBIN returns the buffer as it returns PTX,
    without its last byte (PTX's terminating NUL); a cubin is an ELF file whose headers at the end then fall one byte
    short. The ELF header says where its program and section header tables end; the missing bytes are zeros (the
    high bytes of the last header's alignment field)."""
    import struct as _struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:  # not a 64-bit ELF: leave it
        return cubin
    phoff, shoff = _struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = _struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + b"\0" * max(0, end - len(cubin))


def _compile(filename, arch, define_options, name_expressions, verbose):
    """(cubin, log, {name expression: lowered name}) of one NVRTC compile; arch compute_XX: PTX instead of a
    cubin."""
    from cupy_backends.cuda.libs import nvrtc

    opts = list(BASE_OPTIONS) + [f"--gpu-architecture={arch}", f"-I{KERNELS_DIR}"]
    opts += [f"-I{d}" for d in _cuda_include_dirs()[:1]] + list(define_options)
    if verbose:  # ptxas's report; NVRTC 12.9+ may answer a repeated compile from its cache, which reports nothing
        opts += ["--ptxas-options=-v"] + (["--no-cache"] if nvrtc.getVersion() >= (12, 9) else [])
    prog = nvrtc.createProgram(_source(filename), filename, [], [])
    try:
        for expr in name_expressions:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{filename} does not compile for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        lowered = {e: nvrtc.getLoweredName(prog, e) for e in name_expressions}
        code = nvrtc.getPTX(prog) if arch.startswith("compute_") else _whole_elf(nvrtc.getCUBIN(prog))
        return code, nvrtc.getProgramLog(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)
