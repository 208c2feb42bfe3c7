"""Stage 06: FlashAttention-3 on Hopper. The CPU part: the shared-memory layouts the copy engine and wgmma agree on
(layouts.py), the pipeline and ping-pong schedules, simulated (schedules.py), and the backward's tile order in numpy
(backward_mirror.py). On an sm_90 GPU: the building blocks checked one by one (blocks.py), the forward in three
versions (flash_v3.py: wgmma, ws, pingpong) and the backward in two (flash_v3_backward.py: wgmma, ws), which the ring
(stage 04) and the GPT (stage 05) use on Hopper; a float32 forward (fp32x3.py: stage 02's 3xTF32 on wgmma) and a
forward in e4m3 (fp8.py)."""
from . import backward_mirror, blocks, flash_v3, flash_v3_backward, fp8, fp32x3, layouts, schedules
from stages.common import attention_registry

# Offer the ring (stage 04) these kernels for its blocks on sm_90: it may not import this later stage itself.
attention_registry.register(attention_registry.AttentionKernels(
    name="stage 06 (FlashAttention-3 on sm_90)", takes=flash_v3.takes, forward=flash_v3.forward,
    merge_into=flash_v3.merge_into, takes_backward=flash_v3_backward.takes_block, backward=flash_v3_backward.backward,
    accumulate_into=flash_v3_backward.accumulate_into))

__all__ = ["layouts", "schedules", "backward_mirror", "blocks", "flash_v3", "flash_v3_backward", "fp8", "fp32x3"]
