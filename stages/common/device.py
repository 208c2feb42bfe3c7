"""The GPU a kernel launches on, as the launchers see it: its architecture's instructions and its limits.

Every launcher picks its tile configuration from `device()` (compute capability, the shared memory one block may
opt in to, the SM count) and the problem, and refuses a version whose instructions the device lacks before it
launches anything:

    arch    GPUs (examples)                      opt-in shared memory / block   what the kernels use from it
    sm_75   T4, RTX 20xx, Quadro RTX             64 KB                          ldmatrix, mma m16n8k8 (fp16)
    sm_80   A100, A30                            163 KB                         + cp.async, mma m16n8k16 (fp16,
                                                                                   bf16), TF32 mma, bf16
    sm_86   RTX 30xx, A10, A40, A16              99 KB                          as sm_80
    sm_89   RTX 40xx, L4, L40                    99 KB                          as sm_80
    sm_90   H100, H200, GH200                    227 KB                         as sm_80 (the kernels here use no
                                                                                   sm_90-only instruction)

Every architecture has 64K 32-bit registers per SM and at most 64K per block (so a block of T threads gets at most
65536 / T registers per thread, and at most 255).

On sm_75 the 16-bit kernels run in float16: kernels/common.cuh builds each m16n8k16 from two m16n8k8 and makes each
cp.async a load and a store (a T4 has neither); bfloat16 needs sm_80.

ATTN_ARCH=sm_XX makes every launcher pick that architecture's configurations and obey its limits on the GPU it
runs on (a newer one), and stages.common.kernels compiles the kernels for that architecture (PTX for compute_XX,
translated by the driver): the way to run the sm_75 / sm_80 / sm_86 code and configurations on an H100. A kernel
that would need an instruction the emulated architecture lacks is refused exactly as on that GPU.
"""
import os
from typing import NamedTuple

REGISTERS_PER_BLOCK = 65536
MAX_REGISTERS_PER_THREAD = 255
STATIC_SMEM_LIMIT = 48 * 1024  # __shared__ arrays; more must be dynamic and opted in to


class Arch(NamedTuple):
    """One CUDA architecture: its name (sm_XX), compute capability, opt-in shared memory per block (bytes), a
    typical SM count (for the emulation) and example GPUs."""
    name: str
    cc: int
    smem_optin: int
    sm_count: int
    gpus: str

    @property
    def cp_async(self):
        """cp.async (asynchronous global -> shared copies): sm_80 and later."""
        return self.cc >= 80

    @property
    def mma_k16(self):
        """mma.sync m16n8k16 for fp16 and bf16, and TF32 m16n8k8: sm_80 and later (sm_75 has fp16 m16n8k8 only)."""
        return self.cc >= 80

    @property
    def bf16(self):
        """bfloat16 tensor-core math: sm_80 and later."""
        return self.cc >= 80


ARCHS = {
    "sm_75": Arch("sm_75", 75, 64 * 1024, 40, "T4, RTX 20xx"),
    "sm_80": Arch("sm_80", 80, 163 * 1024, 108, "A100, A30"),
    "sm_86": Arch("sm_86", 86, 99 * 1024, 82, "RTX 30xx, A10, A40"),
    "sm_89": Arch("sm_89", 89, 99 * 1024, 58, "RTX 40xx, L4, L40"),
    "sm_90": Arch("sm_90", 90, 227 * 1024, 132, "H100, H200"),
}


class Device(NamedTuple):
    """The device a launcher plans for: arch (an Arch), smem_optin (bytes one block may use), sm_count, name, and
    emulated (True when ATTN_ARCH made a newer GPU stand in for arch)."""
    arch: Arch
    smem_optin: int
    sm_count: int
    name: str
    emulated: bool = False


class KernelPlan(NamedTuple):
    """One kernel instantiation a launcher may run on a device: the source file, its -D defines, its (template)
    name, the dynamic shared memory it launches with, its static shared memory as the launcher computes it (the
    compiled kernel's own count is what CI checks), and threads per block."""
    file: str
    defines: dict
    name: str
    dynamic_smem: int
    static_smem: int
    threads: int

    def __hash__(self):
        return hash((self.file, tuple(sorted(self.defines.items())), self.name, self.dynamic_smem, self.threads))


class UnsupportedDevice(RuntimeError):
    """A version asked for on a GPU that lacks its instructions or its shared memory; the message says what to
    use instead."""


def arch_for(cc):
    """The Arch of compute capability cc (e.g. 86): the table's entry, or the newest one below it."""
    known = [a for a in ARCHS.values() if a.cc <= cc]
    if not known:
        raise UnsupportedDevice(f"compute capability {cc // 10}.{cc % 10}: the kernels need sm_75 (T4) or newer; "
                                "run the numpy mirrors on the CPU (numpy inputs) instead")
    return max(known, key=lambda a: a.cc)


def emulate(name):
    """The Device of architecture `name` (e.g. "sm_86") with that architecture's own limits."""
    if name not in ARCHS:
        raise ValueError(f"ATTN_ARCH={name!r}: choose one of {', '.join(ARCHS)}")
    a = ARCHS[name]
    return Device(a, a.smem_optin, a.sm_count, f"{a.gpus} (emulated)", True)


_CACHE = {}


# os.environ keeps its values in a dict of encoded names (CPython's os module: bytes on POSIX, upper-case str on
# Windows); os.environ.get of an unset name costs about a microsecond there (a KeyError raised and caught), which
# every launch pays through call_key. Reading that dict is a dict lookup, and it sees every os.environ change.
_ENV_DATA = getattr(os.environ, "_data", None)
_ARCH_KEY = os.environ.encodekey("ATTN_ARCH") if _ENV_DATA is not None and hasattr(os.environ, "encodekey") else None


def _arch_env():
    """ATTN_ARCH, or None when unset or empty."""
    if _ARCH_KEY is None:
        return os.environ.get("ATTN_ARCH") or None
    raw = _ENV_DATA.get(_ARCH_KEY)
    return os.environ.decodevalue(raw) if raw else None


def device():
    """The current CuPy device as the launchers see it, or the architecture ATTN_ARCH names (cached per device
    id and ATTN_ARCH)."""
    import cupy

    dev_id = cupy.cuda.runtime.getDevice()
    env = _arch_env()
    key = (dev_id, env)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    props = cupy.cuda.runtime.getDeviceProperties(dev_id)
    cc = 10 * props["major"] + props["minor"]
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    real = Device(arch_for(cc), props["sharedMemPerBlockOptin"], props["multiProcessorCount"], name)
    if env is None:
        dev = real
    else:
        dev = emulate(env)
        if dev.arch.cc > real.arch.cc or dev.smem_optin > real.smem_optin:
            raise UnsupportedDevice(f"ATTN_ARCH={env} emulates a GPU newer than this one ({real.name}, "
                                    f"{real.arch.name}): an emulated architecture must be at most the real one")
    _CACHE[key] = dev
    return dev


FEATURES = {"cp_async": "cp.async", "mma_k16": "mma.sync m16n8k16 / TF32", "bf16": "bfloat16 tensor cores"}


def require(dev, features, *, what, instead=""):
    """Raise UnsupportedDevice unless dev's architecture has every feature named (keys of FEATURES). what: the
    version, for the message; instead: what to use on such a GPU."""
    missing = [FEATURES[f] for f in features if not getattr(dev.arch, f)]
    if missing:
        raise UnsupportedDevice(f"{what} needs sm_80 or newer ({', '.join(missing)}); this GPU is {dev.name} "
                                f"({dev.arch.name}){'. ' + instead if instead else ''}")


TF32_FEATURES = ("mma_k16", "cp_async")  # the fp32x3 versions: TF32 mma.sync m16n8k8 and cp.async, sm_80 on


def tf32_tensor_cores(dev):
    """Whether dev runs the fp32x3 versions of stages 02 and 03 (TF32_FEATURES: sm_80 and newer)."""
    return all(getattr(dev.arch, f) for f in TF32_FEATURES)


def fits(dev, smem_bytes):
    """True when a block using smem_bytes of shared memory may launch on dev."""
    return smem_bytes <= dev.smem_optin


def require_smem(dev, smem_bytes, *, what, instead):
    """UnsupportedDevice where a block of smem_bytes of shared memory does not fit dev, naming the need, the device's
    limit and what to use instead."""
    if not fits(dev, smem_bytes):
        raise UnsupportedDevice(f"{what} needs {smem_bytes // 1024} KB of shared memory per block; {dev.name} "
                                f"({dev.arch.name}) allows {dev.smem_optin // 1024} KB; {instead}")


def pick(candidates, smem, dev, *, what):
    """The first configuration in candidates whose shared memory smem(config) fits dev, or UnsupportedDevice that
    names the smallest need and the device's limit."""
    for cfg in candidates:
        if fits(dev, smem(cfg)):
            return cfg
    need = min(smem(c) for c in candidates)
    raise UnsupportedDevice(f"{what}: the smallest configuration needs {need // 1024} KB of shared memory per "
                            f"block; {dev.name} ({dev.arch.name}) allows {dev.smem_optin // 1024} KB")
