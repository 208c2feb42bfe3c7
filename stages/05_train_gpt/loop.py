"""Stage 05: the training loop. AdamW steps on batches of the task, the learning-rate schedule, and, for sequence
parallelism through the ring, this rank's token positions and the sum of the gradients over the ranks.

    hist = train(cfg, data, attention="naive", steps=400, batch=32, lr=1.5e-3, seed=0)   # train.py's default

train.py is the command line around it (the configs, the options and their checks, the log).
"""
import math
import time

import numpy as np

from stages.common import bfloat16, to_numpy

from . import attention as A
from . import layers as Lyr
from . import model as M

DTYPES = {"float64": np.float64, "float32": np.float32, "bfloat16": bfloat16}


def lr_at(step, lr, warmup):
    """Linear warm-up over the first `warmup` steps, then constant (step counts from 0)."""
    return lr * min(1.0, (step + 1) / max(1, warmup))


# --------------------------------------------------------------------------- sequence parallel plumbing
def shard_positions(n, ring, layout):
    """Global positions of this rank's tokens (all of 0..n-1 on one device), or a clear error if n does not split."""
    if ring is None:
        return np.arange(n)
    from stages import ring as R

    P = ring.size
    unit = P if layout == "contiguous" else 2 * P
    if n % unit:
        raise ValueError(f"--context {n} does not split over {P} ranks with layout {layout}: it must be a multiple "
                         f"of {unit} ({'P' if layout == 'contiguous' else '2P'})")
    return R.positions(ring.rank, P, n, layout)


# --------------------------------------------------------------------------- training
def device_facts(xp):
    """What the ring's block choice needs to know about the device: {"gpu": bool, "sm80": bool}."""
    if xp is np:
        return {"gpu": False, "sm80": False}
    from stages.common import device

    return {"gpu": True, "sm80": device.device().arch.bf16}


def train(cfg, data, *, attention="naive", steps=100, batch=16, lr=3e-3, warmup=None, seed=0, dtype="float32",
          xp=np, ring=None, layout="zigzag", ring_block=None, weight_decay=0.1, grad_clip=1.0, log=None,
          log_every=10, params=None, attn=None):
    """Train from init_params(cfg, seed) for `steps` AdamW steps; return a dict with the per-step mean loss,
    accuracy on the predicted tokens, gradient norm, the time since the start after each step, and the final
    parameters.

    ring: a stage 04 communicator for --attention ring (None: one device); ring_block: None (ring_blocks()
    chooses), "naive" or "flash". The loss and accuracy returned are over the whole batch (every rank's tokens),
    the same on every rank.

    The loop waits for the GPU once a step: at its end, to read the loss, the accuracy and the gradient norm (one
    small copy to the host). Everything else it does, the gradient sum over the ranks and the clipping included, is
    queued on the GPU (the mpi backend's rotations go through the host on their own)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not known; use one of {sorted(DTYPES)}")
    cd = np.dtype(DTYPES[dtype])
    master = np.float64 if cd == np.float64 else np.float32
    if attn is None:
        if attention == "ring":
            if ring is None:
                raise ValueError("--attention ring needs a communicator: run under mpirun, or --simulate-ranks P")
            block, _ = A.ring_blocks(ring_block, dtype=cd, head_dim=cfg.head_dim,
                                     grouped=cfg.n_kv_head != cfg.n_head, **device_facts(xp))
            attn = A.RingAttention(ring, cfg.context, layout, block, cd)
        else:
            if ring is not None and ring.size > 1:
                raise ValueError(f"--attention {attention} is single-device; under mpirun use --attention ring")
            attn = A.make_attention(attention, cfg.head_dim, cd, heads=cfg.n_head, kv_heads=cfg.n_kv_head,
                                    batch=batch)
    if data.context != cfg.context:
        raise ValueError(f"data context {data.context} != model context {cfg.context}")
    pos = shard_positions(cfg.context, ring, layout)  # (N_local,) host: this rank's global positions
    params = params if params is not None else M.init_params(cfg, seed, dtype=master, xp=xp)
    opt = Lyr.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, steps // 10) if warmup is None else warmup
    hist = {"loss": [], "acc": [], "lr": [], "grad_norm": [], "time_s": []}
    t_start = time.perf_counter()
    for step in range(steps):
        tokens, targets = data.batch(step, batch)  # (B, N) the whole sequences: the same on every rank
        count = int((targets >= 0).sum())  # tokens with a target in the whole batch (host arrays: no GPU wait)
        tok = xp.asarray(tokens[:, pos])  # (B, N_local) this rank's shard
        tgt = xp.asarray(targets[:, pos])
        loss_sum, _, cache = M.forward(params, cfg, tok, tgt, pos, attn, cd)
        probs = cache[6]  # (B, N_local, V)
        correct = ((probs.argmax(axis=-1) == tgt) & (tgt >= 0)).sum()  # 0-d, on the device
        grads = M.backward(params, cfg, cache, attn, count)
        del cache, probs
        names = list(grads)
        stats = xp.stack([xp.asarray(loss_sum, dtype=master), xp.asarray(correct, dtype=master)])  # (2,) this rank's
        if ring is not None:  # sum over the ranks: NCCL all-reduce on the GPUs, a fixed-order host sum otherwise;
            summed = ring.allreduce_sum([grads[n] for n in names] + [stats])  # every rank gets the same bits...
            grads, stats = dict(zip(names, summed[:-1])), summed[-1]  # ...so every rank's AdamW step is the same
        norm = Lyr.grad_norm(grads)  # 0-d, on the device
        if grad_clip:  # clip the global norm, as torch.nn.utils.clip_grad_norm_ does: multiply by min(1, clip / norm)
            scale = xp.minimum(1.0, grad_clip / (norm + 1e-6))  # exactly 1 when the norm is below the clip
            for g in grads.values():
                g *= scale.astype(g.dtype)
        lr_now = lr_at(step, lr, warmup)
        opt.step(params, grads, lr=lr_now)
        loss_sum, correct, norm = (float(x) for x in to_numpy(xp.stack([stats[0], stats[1], norm.astype(master)])))
        hist["time_s"].append(time.perf_counter() - t_start)  # the read above waited for the whole step
        loss = loss_sum / count
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}: lower --lr or check the attention kernel")
        hist["loss"].append(loss)
        hist["acc"].append(correct / count)
        hist["lr"].append(lr_now)
        hist["grad_norm"].append(norm)
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"step {step:5d}  loss {loss:.4f}  acc {correct / count:.3f}  lr {lr_now:.2e}  |g| {norm:.3f}  "
                f"{hist['time_s'][-1]:.1f} s")
    hist["params"] = params
    hist["tokens_per_step"] = batch * cfg.context
    return hist


def loss_window(n_steps, window=20):
    """How many steps the first and last mean losses of learned() average: `window`, or a quarter of a short run."""
    return min(window, max(1, n_steps // 4))


def learned(losses, chance, *, window=20, factor=0.5):
    """Did the loss clearly fall? The mean of the last `window` steps must be below `factor` x the chance loss
    (recall: ln n_values, what a model that does not look back can reach) and below the first steps' mean."""
    w = loss_window(len(losses), window)
    start, end = float(np.mean(losses[:w])), float(np.mean(losses[-w:]))
    return end < factor * chance and end < start, start, end
