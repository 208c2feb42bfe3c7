"""Stage 05: the attention kernel inside the GPT is any stage: `--attention naive | flash_v1 | flash_v2 | ring`.

Each kernel object has the stage API restricted to what a decoder needs (causal, scale 1/sqrt(D)):
    o, lse = attn.forward(q, k, v)                    q, k, v, o: (B, H, N, D); lse: (B, H, N)
    dq, dk, dv = attn.backward(q, k, v, o, lse, do)
A stage that does not take the model's compute dtype gets its inputs cast to one it takes (flash_v1 only
takes float32: bfloat16 activations are widened for it, and its results rounded back).
"""
import numpy as np

from stages.common import cast

ATTENTIONS = ("naive", "flash_v1", "flash_v2", "ring")


def _stage(name):
    import importlib

    return importlib.import_module(f"stages.{name}")


class StageAttention:
    """Causal attention by one single-device stage (00 naive, 01 flash_v1, 02 + 03 flash_v2)."""

    def __init__(self, name, head_dim, dtype):
        dtype = np.dtype(dtype)
        if name not in ATTENTIONS or name == "ring":
            raise ValueError(f"attention {name!r} is not a single-device stage; use one of "
                             f"{[a for a in ATTENTIONS if a != 'ring']} (ring: see RingAttention)")
        self.name, self.dtype = name, dtype
        self.kernel_dtype = dtype
        if name == "flash_v1":
            if dtype == np.float64:
                raise TypeError("attention flash_v1 takes float32 (and bfloat16, widened to float32), not float64; "
                                "the float64 finite-difference checks use attention naive")
            self.kernel_dtype = np.dtype(np.float32)
            if not 1 <= head_dim <= 128:
                raise ValueError(f"attention flash_v1: head dim {head_dim} is not supported (1..128); "
                                 "change d_model / n_heads")
        elif name == "flash_v2":
            if dtype == np.float64:
                raise TypeError("attention flash_v2 takes float32 or bfloat16, not float64; "
                                "the float64 finite-difference checks use attention naive")
            bwd = _stage("flash_v2_backward")
            version = "fp32" if dtype == np.float32 else "tc"
            dims = sorted(set(bwd.HEAD_DIMS[version]) & set(_stage("flash_v2").head_dims(
                "fp32" if dtype == np.float32 else "pipelined")))
            if head_dim not in dims:
                raise ValueError(f"attention flash_v2 in {dtype.name}: head dim {head_dim} is not supported by "
                                 f"stages 02 + 03; use one of {dims} (head dim = d_model / n_heads)")
        self.mod = _stage(name)

    def forward(self, q, k, v):
        kd = self.kernel_dtype
        o, lse = self.mod.forward(cast(q, kd), cast(k, kd), cast(v, kd), causal=True)
        return cast(o, self.dtype), lse

    def backward(self, q, k, v, o, lse, do):
        kd = self.kernel_dtype
        grads = self.mod.backward(*(cast(t, kd) for t in (q, k, v, o)), lse, cast(do, kd), causal=True)
        return tuple(cast(g, self.dtype) for g in grads)


class RingAttention:
    """Causal attention over the whole sequence when this rank holds only a shard of it (stage 04).

    q, k, v are this rank's rows (global positions ring.positions(rank, P, n, layout)); the K/V shards of
    the other ranks come around the ring. block: how each (query shard, key block) pair is computed,
    "naive" (stage 00, the CPU default) or "flash" (stages 02/03, the GPU default)."""

    def __init__(self, ring, n_global, layout, block, dtype):
        R = _stage("ring")
        if layout not in R.LAYOUTS:
            raise ValueError(f"ring layout {layout!r} is not known; use one of {R.LAYOUTS}")
        if block not in ("naive", "flash"):
            raise ValueError(f"ring block {block!r} is not known; use naive or flash")
        self.R, self.ring, self.n, self.layout, self.block = R, ring, n_global, layout, block
        self.dtype = np.dtype(dtype)

    def forward(self, q, k, v):
        o, lse = self.R.ring_forward(q, k, v, ring=self.ring, nq=self.n, nk=self.n, causal=True,
                                     layout=self.layout, block=self.block)
        return cast(o, self.dtype), lse

    def backward(self, q, k, v, o, lse, do):
        return self.R.ring_backward(q, k, v, o, lse, do, ring=self.ring, nq=self.n, nk=self.n, causal=True,
                                    layout=self.layout, block=self.block)


def make_attention(name, head_dim, dtype):
    """The single-device kernel object for --attention `name` (ring: build RingAttention with a communicator)."""
    if name not in ATTENTIONS:
        raise ValueError(f"--attention {name!r} is not known; choose one of {ATTENTIONS}")
    return StageAttention(name, head_dim, dtype)


__all__ = ["ATTENTIONS", "StageAttention", "RingAttention", "make_attention"]
