"""Stage 05: the same GPT in PyTorch, the yardstick for ours (optional: only the comparisons import torch).

Same parameters (model.init_params, copied into torch), same layout of every weight (y = x W + b with W stored
(in, out)), same data order (data.py's batches), same AdamW and the same learning-rate schedule and gradient
clipping as loop.py. Attention is torch's scaled_dot_product_attention ("sdpa": the backend torch picks;
"sdpa_math": its plain math backend, a second trusted implementation that sums in another order), or our stage
02/03 kernels through the autograd.Function of torch_attention.py ("ours"): the drop-in of a kernel into a PyTorch
model. Grouped-query heads (cfg.n_kv_head < n_head): SDPA gets each k, v head repeated for the query heads that read
it (repeat_interleave; autograd sums the copies' gradients), and so does "ours" in float32; in 16 bits our kernels
take k, v of n_kv_head heads as they are.
Mixed precision (dtype "bfloat16"): torch.autocast, which keeps float32 weights and runs the matmuls and
attention in bfloat16, LayerNorm and the loss in float32, as our layers do.
"""
import numpy as np

from . import model as M
from .loop import lr_at


def _torch():
    import torch

    return torch


def to_torch_params(params_np, device):
    """{name: float32 nn.Parameter} from model.init_params's numpy arrays (the same numbers)."""
    torch = _torch()
    return {k: torch.nn.Parameter(torch.tensor(np.asarray(v, dtype=np.float32), device=device))
            for k, v in params_np.items()}


def forward(p, cfg, tokens, targets, attention="sdpa", amp=False):
    """Mean cross-entropy over the tokens with a target, as model.forward computes it (amp: under autocast)."""
    torch = _torch()
    F = torch.nn.functional
    B, N = tokens.shape
    C, H, Hkv = cfg.d_model, cfg.n_head, cfg.n_kv_head
    D = C // H
    x = p["wte"][tokens] + p["wpe"][:N][None]  # (B, N, C)
    for i in range(cfg.n_layer):
        w = lambda n: p[f"h{i}.{n}"]  # noqa: E731
        h = F.layer_norm(x, (C,), w("ln1_w"), w("ln1_b"), eps=1e-5)
        qkv = h @ w("qkv_w") + w("qkv_b")  # (B, N, C + 2 Hkv D)
        q, k, v = qkv.split([C, Hkv * D, Hkv * D], dim=-1)  # (B, N, C), (B, N, Hkv D), (B, N, Hkv D)
        q, k, v = q.view(B, N, H, D), k.view(B, N, Hkv, D), v.view(B, N, Hkv, D)  # heads: (B, N, heads, D)
        if Hkv != H and (attention != "ours" or not amp):  # k / v head j for query heads j g .. (j + 1) g - 1
            k, v = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))  # (B, N, H, D)
        if attention in ("sdpa", "sdpa_math"):
            import contextlib

            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.MATH]) if attention == "sdpa_math" else contextlib.nullcontext():
                a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True).transpose(1, 2)  # (B, N, H, D)
        else:
            from .torch_attention import flash_attention

            if amp:  # autocast does not know our Function: give it the bfloat16 inputs SDPA gets under autocast
                q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
            a = flash_attention(q, k, v, causal=True)  # (B, N, H, D)
        x = x + (a.reshape(B, N, C) @ w("proj_w") + w("proj_b"))
        h = F.layer_norm(x, (C,), w("ln2_w"), w("ln2_b"), eps=1e-5)
        f = F.gelu(h @ w("fc_w") + w("fc_b"), approximate="tanh")  # (B, N, 4C)
        x = x + (f @ w("fcproj_w") + w("fcproj_b"))
    logits = F.layer_norm(x, (C,), p["lnf_w"], p["lnf_b"], eps=1e-5) @ p["head_w"]  # (B, N, V)
    return F.cross_entropy(logits.float().view(B * N, -1), targets.reshape(-1).long(), ignore_index=-1)


def train(cfg, data, *, steps, batch, lr, seed, dtype="float32", attention="sdpa", warmup=None, weight_decay=0.1,
          grad_clip=1.0, device="cuda", log=None, log_every=50):
    """The torch twin of train.train: returns {"loss": [...], "time_s": [...]}."""
    import time

    torch = _torch()
    p = to_torch_params(M.init_params(cfg, seed, dtype=np.float32), device)
    decay = [t for t in p.values() if t.ndim == 2]
    no_decay = [t for t in p.values() if t.ndim != 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, steps // 10) if warmup is None else warmup
    amp = dtype == "bfloat16"
    hist = {"loss": [], "time_s": []}
    t0 = time.perf_counter()
    for step in range(steps):
        tokens, targets = data.batch(step, batch)
        tok = torch.as_tensor(tokens, device=device).long()
        tgt = torch.as_tensor(targets, device=device).long()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = forward(p, cfg, tok, tgt, attention=attention, amp=amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(list(p.values()), grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, lr, warmup)
        opt.step()
        hist["loss"].append(float(loss))
        hist["time_s"].append(time.perf_counter() - t0)
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"torch ({attention}) step {step:5d}  loss {hist['loss'][-1]:.4f}")
    return hist
