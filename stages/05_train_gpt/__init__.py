"""Stage 05: train a small GPT with our attention (numpy / CuPy), sequence-parallel through the ring.

See model.py (the network), layers.py (each layer's forward and backward), attention.py (any stage as the
attention kernel), data.py (associative recall, or a text file), loop.py (the training loop, the ring's gradient
sum), command.py (the command line; the program is train.py), speed.py (the CPU runs' speed plumbing),
torch_attention.py and torch_gpt.py (PyTorch, optional); the GPU measurements: dev/train_gpt_gpu_runs.py.
"""
from . import layers
from .attention import ATTENTIONS, RingAttention, StageAttention, hopper_ring_text, make_attention, ring_blocks
from .data import RecallTask, TextData
from .layers import AdamW, grad_norm
from .model import GPTConfig, backward, forward, init_params, loss_and_grads, n_params, param_shapes
from .speed import reuse_freed_memory, single_thread_blas
from .loop import learned, lr_at, shard_positions, train  # the training loop
from .command import main as train_main, parse as train_parse  # the command line (the program: train.py)

__all__ = [
    "layers", "ATTENTIONS", "RingAttention", "StageAttention", "make_attention", "ring_blocks", "hopper_ring_text",
    "RecallTask", "TextData", "AdamW", "grad_norm", "GPTConfig", "forward", "backward", "init_params",
    "loss_and_grads", "n_params", "param_shapes", "train", "learned", "lr_at", "shard_positions",
    "single_thread_blas", "reuse_freed_memory", "train_main", "train_parse",
]
