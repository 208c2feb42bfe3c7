"""Stage 06: FlashAttention-3 on Hopper.

    from stages import hopper
    o, lse = hopper.forward(q, k, v, causal=True)                      # flash_v3.forward
    dq, dk, dv = hopper.backward(q, k, v, o, lse, do, causal=True)     # flash_v3_backward.backward
    o, lse = hopper.forward(q, k[:, :2], v[:, :2], window=(255, 0))    # the variants: flash_v3_variants.py

The CPU part: the shared-memory swizzle and the wgmma descriptor that reads it (swizzle.py), the pipeline and
ping-pong schedules, simulated (schedules.py), and the backward's tile order in numpy (backward_mirror.py). On an
sm_90 GPU: probes of the data paths checked one by one (probes.py), the forward in three versions (flash_v3.py:
wgmma, ws, pingpong) and the backward in two (flash_v3_backward.py: wgmma, ws), which the ring (stage 04) and the GPT
(stage 05) use on Hopper; the attention variants (grouped-query heads, packed batches, windows, softcap, ALiBi) in
version pingpong's and version ws's loops through stage 02's hooks (flash_v3_variants.py,
flash_v3_backward_variants.py); a float32 forward (fp32x3.py: stage 02's 3xTF32 on wgmma) and a forward in e4m3
(fp8.py).
Their plumbing: the sm_90 check and the sm_90a compile (sm90a.py), tensor maps (tensor_maps.py), the kernels'
parameter structs (params.py), the backward's preprocess and dQ conversion (backward_steps.py). Elsewhere (numpy
arrays, another GPU, none) forward and backward raise an error that names the stage 02 / 03 versions computing the
same attention there.
"""
from . import (
    backward_mirror, backward_steps, flash_v3, flash_v3_backward, flash_v3_backward_variants, flash_v3_variants, fp8,
    fp32x3, params, probes, schedules, sm90a, swizzle, tensor_maps,
)
from .flash_v3 import forward, forward_varlen
from .flash_v3_backward import backward, backward_varlen
from stages.common import attention_registry

# Offer the ring (stage 04) and the GPT (stage 05) these kernels on sm_90: they may not import this later stage
# themselves. They take grouped-query heads and every variant but dropout (stages 02/03's).
attention_registry.register(attention_registry.AttentionKernels(
    name="stage 06 (FlashAttention-3 on sm_90)", takes=flash_v3.takes, forward=flash_v3.forward,
    merge_into=flash_v3.merge_into, takes_backward=flash_v3_backward.takes_block, backward=flash_v3_backward.backward,
    accumulate_into=flash_v3_backward.accumulate_into, options={"window", "softcap", "alibi_slopes"}))

__all__ = ["forward", "forward_varlen", "backward", "backward_varlen", "swizzle", "schedules", "backward_mirror",
           "probes", "flash_v3", "flash_v3_backward", "flash_v3_variants", "flash_v3_backward_variants",
           "backward_steps", "fp8", "fp32x3", "sm90a", "tensor_maps", "params", "instantiations"]


def instantiations():
    """[(file, name)]: every kernel instantiation a stage 06 launcher may launch, which CI compiles for sm_90a
    (dev/compare_cubins_hopper.py compiles them to compare two trees)."""
    return (probes.instantiations() + [x for v in flash_v3.VERSIONS for x in flash_v3.instantiations(v)]
            + flash_v3_variants.instantiations() + fp8.instantiations() + fp32x3.instantiations()
            + [x for v in flash_v3_backward.VERSIONS for x in flash_v3_backward.instantiations(v)]
            + flash_v3_backward_variants.instantiations())
