"""Compiling kernels/*.cu: cupy.RawModule on a GPU (cached), or NVRTC compile-only with no GPU.

    fn = function(load_module("flash_v2_forward_tc.cu", name_expressions=(name,)), name, smem)

load_module compiles a kernel file once per (file, defines, template instantiations) and keeps the module; function
looks up one kernel in it. Launching what is compiled is stages/common/launch.py's; what a compiled kernel uses
(registers, shared memory, spills, per architecture: the portability report CI checks) is kernel_resources.py's.

The compile-only path is what CI runs: every kernel configuration a launcher can pick is compiled for each
architecture from sm_75 to sm_90, so a kernel that does not compile or does not fit never lands, even though CI has
no GPU.
"""
import functools
import hashlib
import os
from pathlib import Path

from . import device
from .launch import ForwardLaunch, Launch, row_major, run_forward, scalar_slot  # noqa: F401 (see below)

# Launch, ForwardLaunch, run_forward, row_major and scalar_slot are stages/common/launch.py's; they are reachable
# here too (kernels.Launch, ...) because stages 04 and 06 import them from this module.

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


@functools.lru_cache(maxsize=None)
def function(module, name, smem):
    """module.get_function(name), allowed smem bytes of dynamic shared memory (above 48 KB a kernel must opt in);
    looked up once per (module, name, smem), as the module is compiled once."""
    fn = module.get_function(name)
    if smem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


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
