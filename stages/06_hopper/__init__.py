"""Stage 06: FlashAttention-3 on Hopper. The CPU part: the shared-memory layouts the copy engine and wgmma agree on
(layouts.py), the pipeline and ping-pong schedules, simulated (schedules.py). On an sm_90 GPU: the building blocks
checked one by one (blocks.py) and version 1 of the forward (flash_v3.py)."""
from . import blocks, flash_v3, layouts, schedules

__all__ = ["layouts", "schedules", "blocks", "flash_v3"]
