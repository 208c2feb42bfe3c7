"""Stage 06: FlashAttention-3 on Hopper. This part runs on a CPU: the shared-memory layouts the copy engine and
wgmma agree on (layouts.py), and the pipeline and ping-pong schedules, simulated (schedules.py)."""
from . import layouts, schedules

__all__ = ["layouts", "schedules"]
