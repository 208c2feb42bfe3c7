"""What every stage 06 launcher needs of its GPU: an sm_90 (H100, H200), and its kernels compiled for sm_90a.

    require_hopper(q)                     raises device.UnsupportedDevice (or TypeError for numpy arrays) naming the
                                          stage 02 / 03 versions that run the same attention elsewhere
    function(file, name, smem)            kernel `name` of kernels/<file> compiled by NVRTC for sm_90a, once

wgmma and setmaxnreg exist only in the arch-specific target sm_90a: its code runs on an sm_90 GPU and nowhere else,
so stage 06 refuses every other GPU (and the ATTN_ARCH emulation of one) up front, with what to use instead.
"""
import functools

import numpy as np

from stages.common import bfloat16, device, kernels, load_module

ARCH = "sm_90a"
CTYPE = {np.dtype(np.float16): "__half", np.dtype(bfloat16): "__nv_bfloat16"}  # the 16-bit kernels' type names
ELSEWHERE = "Use stage 02 version 'pipelined' (forward) and stage 03 version 'tc' (backward) instead"
ELSEWHERE_FP32 = "For float32 use stage 02 version 'fp32x3' (sm_80 and newer) or 'fp32' instead"


def require_hopper(*arrays, dev=None, instead=ELSEWHERE, where="stage 06"):
    """The sm_90 device the kernels run on, for CuPy arrays (or no arrays: the current device); raises TypeError for
    numpy arrays and device.UnsupportedDevice with no CUDA GPU or another one, each naming (instead) the versions of
    stages 02 and 03 that compute the same attention there. dev: the device to check (tests: device.emulate)."""
    kinds = [type(x) for x in arrays if type(x).__module__.split(".")[0] != "cupy"]
    if kinds:
        raise TypeError(f"{where}: stage 06 runs on an sm_90 GPU, on CuPy arrays; got {kinds[0].__name__}. {instead} "
                        "(their CPU mirrors take numpy arrays)")
    if dev is None:
        try:
            dev = device.device()
        except device.UnsupportedDevice:
            raise
        except Exception as e:  # no CuPy, no CUDA driver, no visible device
            raise device.UnsupportedDevice(f"stage 06 needs an sm_90 GPU (H100, H200); CuPy sees no CUDA GPU "
                                           f"({type(e).__name__}). {instead}") from None
    if dev.arch.cc != 90 or dev.emulated:
        raise device.UnsupportedDevice(f"stage 06 needs an sm_90 GPU (H100, H200); {dev.name} is {dev.arch.name}. "
                                       f"{instead}")
    return dev


@functools.lru_cache(maxsize=None)
def function(file, name, smem):
    """Kernel `name` of kernels/<file> (a template instantiation, or an extern "C" kernel's own name), compiled by
    NVRTC for sm_90a, allowed smem bytes of dynamic shared memory: what every stage 06 launcher launches."""
    module = load_module(file, name_expressions=(name,) if "<" in name else None, target=ARCH)
    return kernels.function(module, name, smem)
