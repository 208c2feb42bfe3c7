"""Plumbing every stage shares: input checks, the tolerance rule, FLOP counts,
timing, peak memory and the CUDA kernel loader. No attention algorithm lives here.
"""
from .checks import (
    array_module, check_attention_inputs, check_backward_inputs, check_causal, check_out_dtype, resolve_scale,
    LOG2E, SUPPORTED_FLOAT_DTYPES,
)
from . import device, fast_path, tolerance
from .tolerance import max_error, tolerance_report
from .measure import (
    attention_flops, code_version, time_ms, time_queued_ms, PeakMemory, gpu_name, gpu_status, has_gpu, run_devices,
)
from .inputs import make_inputs, bfloat16, to_numpy, cast, rng, seed_everything, base_seed
from .kernels import load_module, compile_only, KERNELS_DIR
from . import verify
from .verify import check_forward, check_backward, empty

__all__ = [
    "array_module", "check_attention_inputs", "check_backward_inputs", "check_causal", "check_out_dtype",
    "resolve_scale", "LOG2E",
    "SUPPORTED_FLOAT_DTYPES", "device", "fast_path", "tolerance", "max_error", "tolerance_report",
    "attention_flops", "code_version", "time_ms", "time_queued_ms", "PeakMemory", "gpu_name", "gpu_status", "has_gpu",
    "run_devices",
    "make_inputs",
    "bfloat16",
    "to_numpy", "cast", "rng", "seed_everything", "base_seed", "load_module", "compile_only", "KERNELS_DIR", "verify",
    "check_forward", "check_backward", "empty",
]
