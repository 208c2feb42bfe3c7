"""Stage 05: train a small GPT from scratch with our attention (numpy on the CPU, CuPy on a GPU).

    python stages/05_train_gpt/train.py                              # associative recall, naive attention
    python stages/05_train_gpt/train.py --attention flash_v2         # the same run through stages 02 + 03
    python stages/05_train_gpt/train.py --quick                      # tiny config on the CPU: the loss must fall
    python stages/05_train_gpt/train.py --data README.md --steps 500 # any text file, character level
    python stages/05_train_gpt/train.py --device gpu --context 4096 --layers 6 --d-model 384 --heads 6 \\
        --batch 1 --steps 50 --attention flash_v2                    # long context on a GPU, bfloat16 activations
    mpirun -n 4 python stages/05_train_gpt/train.py --attention ring # sequence parallel through the ring
    python stages/05_train_gpt/train.py --attention ring --simulate-ranks 4   # the same, ranks as threads

Sequence parallel (--attention ring): every rank draws the same batch (data.py: batches are a function of
the seed and the step), keeps the tokens of its shard of every sequence (positions of stage 04's layout),
runs the whole model on them (only attention talks to the other ranks: stage 04's ring forward and
backward), then the parameter gradients and the loss are summed over the ranks by the communicator's
allreduce_sum (stage 04, comm.py: one NCCL all-reduce on the GPUs, the gradients never leave them; a
fixed-order sum on the host for the other backends). Every rank receives the same bits, so every rank takes
the same optimizer step and the ranks' parameters stay identical without ever being compared or broadcast.
The result is the single-device run's, up to the order of floating-point sums.

Mixed precision (--dtype bfloat16): float32 master weights and optimizer state, bfloat16 activations into
every matmul and into attention, float32 LayerNorm, GELU, softmax, residual stream and gradients of the
weights (layers.py). The last line of --quick is `SUMMARY 05_train_gpt PASS|FAIL ...` (scripts/run_all.py).
"""
import argparse
import csv
import math
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before numpy loads its BLAS:
    os.environ.setdefault(_var, "1")  # the CPU configs' matrices are too small for BLAS threads to pay

import numpy as np  # noqa: E402

from stages.common import bfloat16, to_numpy  # noqa: E402

from stages import train_gpt as T  # noqa: E402

DTYPES = {"float64": np.float64, "float32": np.float32, "bfloat16": bfloat16}

# ---- the tiny config of --quick (the tutorial's last step, and a test): must learn the recall task on the CPU
QUICK = dict(context=32, n_layer=2, d_model=64, n_head=2, batch=32, steps=300, lr=3e-3, n_values=8)
# ---- the default config: a longer context, more values; head dim 64, which every stage takes in float32 and in
# bfloat16 (stage 03's tensor-core backward does not take 32), so the same command runs on the CPU and on a GPU
DEFAULT = dict(context=64, n_layer=2, d_model=64, n_head=1, batch=32, steps=400, lr=3e-3, n_values=16)


def lr_at(step, lr, warmup):
    """Linear warm-up over the first `warmup` steps, then constant (step counts from 0)."""
    return lr * min(1.0, (step + 1) / max(1, warmup))


def single_thread_blas():
    """Ask the BLAS numpy already loaded for one thread (what OMP_NUM_THREADS=1 does before numpy is imported).

    The tiny CPU configs multiply 64 x 64 matrices: a second BLAS thread only adds synchronisation, and on a
    loaded 2-core machine it can make a step ten times slower. Best effort: nothing happens if no OpenBLAS is
    found (the result is the same either way; only the time changes)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return False
    for lib in libs:
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                    "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(handle, sym, None)
            if fn is not None:
                fn(ctypes.c_int(1))
                return True
    return False


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
            block, _ = T.ring_blocks(ring_block, dtype=cd, head_dim=cfg.head_dim, **device_facts(xp))
            attn = T.RingAttention(ring, cfg.context, layout, block, cd)
        else:
            if ring is not None and ring.size > 1:
                raise ValueError(f"--attention {attention} is single-device; under mpirun use --attention ring")
            attn = T.make_attention(attention, cfg.head_dim, cd)
    if data.context != cfg.context:
        raise ValueError(f"data context {data.context} != model context {cfg.context}")
    pos = shard_positions(cfg.context, ring, layout)  # (N_local,) host: this rank's global positions
    params = params if params is not None else T.init_params(cfg, seed, dtype=master, xp=xp)
    opt = T.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, steps // 10) if warmup is None else warmup
    hist = {"loss": [], "acc": [], "lr": [], "grad_norm": [], "time_s": []}
    t_start = time.perf_counter()
    for step in range(steps):
        tokens, targets = data.batch(step, batch)  # (B, N) the whole sequences: the same on every rank
        count = int((targets >= 0).sum())  # tokens with a target in the whole batch (host arrays: no GPU wait)
        tok = xp.asarray(tokens[:, pos])  # (B, N_local) this rank's shard
        tgt = xp.asarray(targets[:, pos])
        loss_sum, _, cache = T.forward(params, cfg, tok, tgt, pos, attn, cd)
        probs = cache[6]  # (B, N_local, V)
        correct = ((probs.argmax(axis=-1) == tgt) & (tgt >= 0)).sum()  # 0-d, on the device
        grads = T.backward(params, cfg, cache, attn, count)
        del cache, probs
        names = list(grads)
        stats = xp.stack([xp.asarray(loss_sum, dtype=master), xp.asarray(correct, dtype=master)])  # (2,) this rank's
        if ring is not None:  # sum over the ranks: NCCL all-reduce on the GPUs, a fixed-order host sum otherwise;
            summed = ring.allreduce_sum([grads[n] for n in names] + [stats])  # every rank gets the same bits...
            grads, stats = dict(zip(names, summed[:-1])), summed[-1]  # ...so every rank's AdamW step is the same
        norm = T.grad_norm(grads)  # 0-d, on the device
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


# --------------------------------------------------------------------------- command line
def _default(key):
    """'default D' for a config key, with what --quick uses where it differs."""
    d, q = DEFAULT[key], QUICK[key]
    return f"default {d}" + ("" if q == d else f"; {q} with --quick")


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", default="naive",
                    help=f"the attention stage: one of {', '.join(T.ATTENTIONS)} (ring: under mpirun or "
                         "--simulate-ranks); default naive")
    ap.add_argument("--data", default=None, help="a text file to learn character by character "
                                                 "(default: none, the associative recall task)")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny config (the defaults below that say 'with --quick'); check that the loss clearly "
                         "falls: the last line is SUMMARY ... PASS or FAIL (default off)")
    ap.add_argument("--steps", type=int, default=None, help=f"training steps ({_default('steps')})")
    ap.add_argument("--batch", type=int, default=None, help=f"sequences per step ({_default('batch')})")
    ap.add_argument("--context", type=int, default=None, help=f"tokens per sequence N ({_default('context')})")
    ap.add_argument("--layers", type=int, default=None, help=f"transformer blocks ({_default('n_layer')})")
    ap.add_argument("--d-model", type=int, default=None, help=f"channels C ({_default('d_model')})")
    ap.add_argument("--heads", type=int, default=None,
                    help=f"attention heads, head dim = d_model / heads ({_default('n_head')})")
    ap.add_argument("--n-values", type=int, default=None,
                    help=f"recall task: number of distinct values ({_default('n_values')})")
    ap.add_argument("--lr", type=float, default=None, help=f"peak learning rate of AdamW ({_default('lr')})")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order (default 0)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="activations (default bfloat16 on an sm_80+ GPU, else float32; float32 master weights)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"),
                    help="default auto: the GPU if CuPy sees one; the CPU with --quick (the same short run everywhere) "
                         "and with --simulate-ranks (threads of one process); under mpirun the ring's backend decides")
    ap.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag"),
                    help="ring: the shard layout (default zigzag)")
    ap.add_argument("--ring-block", default=None, choices=("naive", "flash"),
                    help="ring: how a block is computed, stage 00 (naive) or stages 02/03 (flash). Default: naive on "
                         "the CPU; on a GPU flash where stages 02/03 take the head dim and dtype, else naive (the "
                         "header says why)")
    ap.add_argument("--backend", default="auto", choices=comm_backends(),
                    help="ring under mpirun: the stage 04 communicator (default auto: nccl with one GPU per rank, mpi "
                         "with fewer GPUs than ranks, numpy without a GPU)")
    ap.add_argument("--simulate-ranks", type=int, default=0,
                    help="ring: P ranks as threads of this process (default 0: off)")
    ap.add_argument("--csv", default=None, help="write step, loss, accuracy, lr, time to this CSV file (default: none)")
    ap.add_argument("--log-every", type=int, default=None,
                    help="print the loss every this many steps (default: steps // 15, about 15 lines)")
    return ap


def comm_backends():
    from stages.ring import BACKENDS

    return BACKENDS


def parse(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if args.attention not in T.ATTENTIONS:
        ap.error(f"--attention {args.attention!r} is not known; choose one of {', '.join(T.ATTENTIONS)}")
    base = QUICK if args.quick else DEFAULT
    for key, name in (("context", "context"), ("n_layer", "layers"), ("d_model", "d_model"), ("n_head", "heads"),
                      ("batch", "batch"), ("steps", "steps"), ("lr", "lr"), ("n_values", "n_values")):
        if getattr(args, name) is None:
            setattr(args, name, base[key])
    for name in ("context", "layers", "d_model", "heads", "batch", "steps", "n_values"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.simulate_ranks and args.attention != "ring":
        ap.error("--simulate-ranks needs --attention ring")
    if args.device == "auto" and (args.quick or args.simulate_ranks):
        args.device = "cpu"
    return args


def _device_xp(choice):
    from stages.common import has_gpu

    if choice == "gpu" and not has_gpu():
        raise SystemExit("--device gpu: no CUDA GPU found (CuPy sees no device); use --device cpu")
    if choice == "gpu" or (choice == "auto" and has_gpu()):
        import cupy

        return cupy
    return np


def prepare(args, ring=None, xp=np):
    """Everything a run needs that can be wrong, checked before the first step and without talking to other ranks
    (so every rank of a bad configuration stops with the same message): config, data, dtype, the ring's blocks.
    Returns a dict with cfg, data, dtype, block and block_text (None for single-device attention), and kernels (what
    runs in a single-device stage's place on this device, StageAttention.kernels; None when the stage itself runs)."""
    if args.data:
        data = T.TextData(args.data, args.context, seed=args.seed)
    else:
        data = T.RecallTask(args.context, n_values=args.n_values, seed=args.seed)
    cfg = T.GPTConfig(vocab_size=data.vocab_size, context=args.context, n_layer=args.layers, d_model=args.d_model,
                      n_head=args.heads)
    dtype = args.dtype or ("bfloat16" if xp is not np and device_facts(xp)["sm80"] else "float32")
    out = {"cfg": cfg, "data": data, "dtype": dtype, "block": None, "block_text": None, "kernels": None}
    if args.attention == "ring":
        if ring is None:
            raise ValueError("--attention ring needs a communicator: run under mpirun, or --simulate-ranks P")
        shard_positions(cfg.context, ring, args.layout)  # the context splits over the ranks
        out["block"], out["block_text"] = T.ring_blocks(args.ring_block, dtype=DTYPES[dtype], head_dim=cfg.head_dim,
                                                        **device_facts(xp))
        out["block_text"] += T.hopper_ring_text(out["block"], DTYPES[dtype], cfg.head_dim, heads=cfg.n_head,
                                                batch=args.batch, gpu=xp is not np)
    else:  # the head dim and dtype are taken; kernels: what runs in the stage's place on this device, if anything
        out["kernels"] = T.make_attention(args.attention, cfg.head_dim, DTYPES[dtype]).kernels
    return out


def run(args, ring=None, xp=None, prepared=None):
    """One training run from parsed arguments; prints the log (rank 0) and returns the history."""
    rank0 = ring is None or ring.rank == 0
    say = print if rank0 else (lambda *a, **k: None)
    xp = xp or _device_xp(args.device)
    prep = prepared or prepare(args, ring, xp)
    cfg, data, dtype = prep["cfg"], prep["data"], prep["dtype"]
    where = "CPU (numpy)" if xp is np else "GPU (CuPy)"
    P = 1 if ring is None else ring.size
    say(f"stage 05: GPT {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads (head dim {cfg.head_dim}), "
        f"context {cfg.context}, vocab {cfg.vocab_size}, {T.n_params(cfg)} parameters")
    say(f"data: {data.describe()}")
    say(f"attention {args.attention}" + (f" ({P} ranks, layout {args.layout})" if args.attention == "ring" else "")
        + f", {dtype} activations, on the {where}, {args.steps} steps of batch {args.batch}, lr {args.lr}, "
        f"seed {args.seed}")
    if prep["block"]:
        say(f"ring blocks {prep['block_text']}")
    if prep.get("kernels"):
        say(f"kernels {prep['kernels']}")
    hist = train(cfg, data, attention=args.attention, steps=args.steps, batch=args.batch, lr=args.lr,
                 seed=args.seed, dtype=dtype, xp=xp, ring=ring, layout=args.layout, ring_block=prep["block"],
                 log=say, log_every=args.log_every or max(1, args.steps // 15))
    hist["chance"] = data.chance_loss
    if args.csv and rank0:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "loss", "accuracy", "lr", "time_s"])
            for i, (loss, acc, lr, t) in enumerate(zip(hist["loss"], hist["acc"], hist["lr"], hist["time_s"])):
                w.writerow([i, f"{loss:.6f}", f"{acc:.4f}", f"{lr:.3e}", f"{t:.3f}"])
        say(f"wrote {args.csv}")
    ok, start, end = learned(hist["loss"], data.chance_loss)
    w = loss_window(len(hist["loss"]))
    tps = hist["tokens_per_step"] * len(hist["loss"]) / hist["time_s"][-1]
    say(f"mean loss over the first {w} steps {start:.3f} -> over the last {w} steps {end:.3f} (chance "
        f"{data.chance_loss:.3f}), final accuracy {hist['acc'][-1]:.3f}, {hist['time_s'][-1]:.1f} s, "
        f"{tps:.0f} tokens/s")
    what = (f"{args.attention}, mean loss first {w} steps {start:.2f} -> last {w} steps {end:.2f} (chance "
            f"{data.chance_loss:.2f}) in {args.steps} steps, {hist['time_s'][-1]:.0f} s")
    if args.quick:
        say(f"SUMMARY 05_train_gpt {'PASS' if ok else 'FAIL'} {what}" + ("" if ok else ": the loss did not clearly "
                                                                          "fall below half the chance loss"))
    hist["learned"] = ok
    return hist


def main(argv=None):
    """The command line; a bad configuration ends with its message (no traceback), exit status 2."""
    args = parse(argv)
    try:
        return _main(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2


def _status(hist, args):
    return 0 if (hist["learned"] or not args.quick) else 1


def _main(args):
    if args.attention == "ring" and args.simulate_ranks:
        from stages.ring import simulate

        xp = _device_xp(args.device)
        out = simulate(lambda ring: run(args, ring=ring, xp=xp), args.simulate_ranks)
        return _status(out[0], args)
    if args.attention == "ring":
        return _main_mpi(args)
    return _status(run(args), args)


def _main_mpi(args):
    """Every rank of an mpirun: a bad configuration stops every rank with one message (exit status 2); an error
    during training ends the whole job (the other ranks could be waiting for this one in a transfer)."""
    from stages.ring import comm as comm_mod

    ring, backend, reason = comm_mod.setup(args.backend)
    xp = np if backend == "numpy" else __import__("cupy")
    if ring.rank == 0:
        print(f"ring: {ring.size} ranks, backend {backend} ({reason})")
    try:
        prepared, error = prepare(args, ring, xp), None
    except (ValueError, TypeError, FileNotFoundError) as e:
        prepared, error = None, str(e)
    errors = [e for e in ring.allgather(error) if e]  # every rank learns whether any rank's check failed
    if errors:
        if ring.rank == 0:
            print(f"train.py: error: {errors[0]}", file=sys.stderr, flush=True)
        return 2
    try:
        hist = run(args, ring=ring, xp=xp, prepared=prepared)
    except Exception as e:  # noqa: BLE001 - end every rank, not just this one (the others would hang)
        import traceback

        comm_mod.abort(e, trace=traceback.format_exc())
        return 1  # MPI_Abort returned (some MPIs do while mpirun ends the job): never report success
    return _status(hist, args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["train", "run", "prepare", "parser", "single_thread_blas", "main", "parse", "shard_positions", "learned",
           "loss_window", "lr_at", "device_facts", "QUICK", "DEFAULT"]
