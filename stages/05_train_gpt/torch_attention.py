"""Stage 05: our FlashAttention-2 (stage 02 forward, stage 03 backward) as a PyTorch autograd.Function.

    from stages.train_gpt.torch_attention import flash_attention
    o = flash_attention(q, k, v, causal=True)        # q, k, v: (B, N, H, D) CUDA tensors, fp16 / bf16 / fp32
    o.sum().backward()                               # q.grad, k.grad, v.grad through stage 03's kernels

Dropping it into a PyTorch model: where the model calls
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    y = y.transpose(1, 2)                            # (B, N, H, D)
write `y = flash_attention(q, k, v, causal=True)` (torch_gpt.py does exactly this with attention="ours").

How the tensors cross over, without copies where the kernels allow:
  * DLPack: torch.from_dlpack / cupy.from_dlpack share the GPU memory, nothing is copied. 16-bit tensors cross
    as int16 (the bits) and are viewed as float16 / bfloat16 on the other side, so no DLPack dtype code for
    bfloat16 is needed on either side.
  * Layout: a (B, N, H, D) tensor is viewed as (B, H, N, D) by a transpose (strides only). The kernels address
    rows of a (B, H, N, D) row-major array, so that view is made contiguous once, by a copy, when its storage is
    (B, N, H, D) (the usual case: q, k, v cut from one qkv projection). A tensor whose storage already is
    (B, H, N, D), e.g. x.view(B, H, N, D).transpose(1, 2), goes in without a copy. Outputs come back as
    (B, H, N, D) storage and are handed to torch as a (B, N, H, D) view: no copy.
  * Streams: every CuPy kernel is launched on torch's current CUDA stream (cupy.cuda.ExternalStream), so it is
    ordered with torch's own kernels exactly as a torch op would be; nothing synchronises the host.
torch is optional in this repository: nothing imports this file but the PyTorch comparisons.
"""
import contextlib

import numpy as np

from stages.common import bfloat16

_TORCH_TO_NP = {"torch.float16": np.float16, "torch.bfloat16": bfloat16, "torch.float32": np.float32}


def _torch():
    import torch

    return torch


@contextlib.contextmanager
def _torch_stream(device):
    """CuPy on torch's current stream and device: kernels queue behind torch's, in order."""
    import cupy

    torch = _torch()
    with cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:
            yield


def to_cupy(t):
    """A CuPy array sharing t's memory (DLPack), with t's dtype and strides; 16-bit types cross as their bits."""
    import cupy

    torch = _torch()
    name = str(t.dtype)
    if name not in _TORCH_TO_NP:
        raise TypeError(f"flash_attention: dtype {t.dtype} is not supported; use float16, bfloat16 or float32")
    if t.dtype in (torch.float16, torch.bfloat16):
        return cupy.from_dlpack(t.detach().view(torch.int16)).view(_TORCH_TO_NP[name])
    return cupy.from_dlpack(t.detach())


def to_torch(a):
    """A torch tensor sharing the CuPy array's memory (DLPack)."""
    torch = _torch()
    dt = np.dtype(a.dtype)
    if dt == np.float16 or dt == bfloat16:
        return torch.from_dlpack(a.view(np.int16)).view(torch.float16 if dt == np.float16 else torch.bfloat16)
    return torch.from_dlpack(a)


def _bhnd(t):
    return to_cupy(t.transpose(1, 2))  # (B, N, H, D) -> (B, H, N, D): a strided view, no copy yet


def _check(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} has shape {tuple(t.shape)}; expected (B, N, H, D)")
        if not t.is_cuda:
            raise ValueError(f"flash_attention: {name} is on {t.device}; the kernels run on a CUDA device")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _make_function():
    torch = _torch()

    class FlashAttentionFunction(torch.autograd.Function):
        """o = softmax(scale q k^T + mask) v by stage 02; its backward by stage 03 (from the saved lse)."""

        @staticmethod
        def forward(ctx, q, k, v, causal, scale):  # q, k, v: (B, N, H, D)
            from stages import flash_v2

            _check(q, k, v)
            with _torch_stream(q.device):
                o, lse = flash_v2.forward(_bhnd(q), _bhnd(k), _bhnd(v), causal=causal, scale=scale)  # (B, H, N, D)
                o_t, lse_t = to_torch(o), to_torch(lse)  # (B, H, N, D), (B, H, N) float32
            ctx.save_for_backward(q, k, v, o_t, lse_t)
            ctx.causal, ctx.scale = causal, scale
            return o_t.transpose(1, 2)  # (B, N, H, D) view

        @staticmethod
        def backward(ctx, do):  # do: (B, N, H, D)
            from stages import flash_v2_backward

            q, k, v, o_t, lse_t = ctx.saved_tensors
            with _torch_stream(q.device):
                dq, dk, dv = flash_v2_backward.backward(_bhnd(q), _bhnd(k), _bhnd(v), to_cupy(o_t), to_cupy(lse_t),
                                                        _bhnd(do), causal=ctx.causal, scale=ctx.scale)
                grads = [to_torch(g).transpose(1, 2) for g in (dq, dk, dv)]  # (B, N, H, D) views
            return grads[0], grads[1], grads[2], None, None

    return FlashAttentionFunction


_FN = []


def flash_attention(q, k, v, causal=False, scale=None):
    """Our FlashAttention-2 on torch tensors (B, N, H, D); differentiable in q, k, v."""
    if not _FN:
        _FN.append(_make_function())
    return _FN[0].apply(q, k, v, bool(causal), scale)


def check_against_sdpa(dtype, *, seed=0, B=2, N=257, H=4, D=64, causal=True):
    """Forward and backward of flash_attention against torch's scaled_dot_product_attention, on the GPU.

    The repository's tolerance rule: our error against a float64 reference must be at most 2x the error of
    SDPA in the same dtype, plus 1e-5, for o, dq, dk, dv. Returns {name: (ours, sdpa, bound)} and "ok"."""
    torch = _torch()
    F = torch.nn.functional
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = [torch.randn(B, N, H, D, device="cuda", generator=g, dtype=torch.float64) for _ in range(4)]
    q64, k64, v64, do64 = base

    def run(fn, dtype_):
        q, k, v = (t.detach().clone().to(dtype_).requires_grad_() for t in (q64, k64, v64))  # fresh leaves
        o = fn(q, k, v)
        o.backward(do64.to(dtype_))
        return [t.double() for t in (o, q.grad, k.grad, v.grad)]

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)

    ref = run(sdpa, torch.float64)
    ours = run(lambda q, k, v: flash_attention(q, k, v, causal=causal), dt)
    theirs = run(sdpa, dt)
    out, ok = {}, True
    for name, r, a, b in zip(("o", "dq", "dk", "dv"), ref, ours, theirs):
        e_ours, e_sdpa = float((a - r).abs().max()), float((b - r).abs().max())
        bound = 2 * e_sdpa + 1e-5
        out[name] = (e_ours, e_sdpa, bound)
        ok = ok and np.isfinite(e_ours) and e_ours <= bound
    out["ok"] = ok
    return out
