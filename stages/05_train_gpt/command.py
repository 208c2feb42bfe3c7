"""Stage 05's command line, as a library: the options (parse), the run they describe (run), its configs (QUICK,
DEFAULT). The program is train.py (`python stages/05_train_gpt/train.py --help`), which calls main here.

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
import os
import pathlib
import sys

import numpy as np

from .attention import ATTENTIONS, hopper_ring_text, make_attention, ring_blocks
from .data import RecallTask, TextData
from .loop import DTYPES, device_facts, learned, loss_window, shard_positions, train
from .model import GPTConfig, n_params
from .speed import reuse_freed_memory

# ---- the tiny config of --quick (the tutorial's last step, and a test under several seeds): must learn the recall
# task on the CPU in a few seconds, whatever the seed; one layer is enough for it (the query reads one pair token)
QUICK = dict(context=32, n_layer=1, d_model=64, n_head=2, batch=32, steps=250, lr=3e-3, n_values=8)
# ---- the default config: a longer context, more values; head dim 64, which every stage takes in float32 and in
# bfloat16 (stage 03's tensor-core backward does not take 32), so the same command runs on the CPU and on a GPU.
# lr, and W_Q, W_K's start (model.QK_GAIN): the README's "Why these defaults" (the plateau before the jump)
DEFAULT = dict(context=64, n_layer=2, d_model=64, n_head=1, batch=32, steps=400, lr=1.5e-3, n_values=16)


# --------------------------------------------------------------------------- command line
def _default(key):
    """'default D' for a config key, with what --quick uses where it differs."""
    d, q = DEFAULT[key], QUICK[key]
    return f"default {d}" + ("" if q == d else f"; {q} with --quick")


class UsageParser(argparse.ArgumentParser):
    """argparse with usage errors in one line: `train.py: error: argument --lr: ...`, exit status 2. Under mpirun
    only rank 0 prints it (every rank parses the same arguments and stops)."""

    def error(self, message):
        rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK") if v in os.environ), "0")
        self.exit(2, f"{self.prog}: error: {message} (--help lists every option)\n" if rank == "0" else None)


def _at_least(minimum):
    """An argparse type: a whole number >= minimum (argparse names the option in the error)."""
    def whole_number(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"takes a whole number >= {minimum}, got {value}")
        return value
    return whole_number


def learning_rate(text):
    """An argparse type: AdamW's peak learning rate, a number in (0, 1] (each step moves a weight by about lr)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"takes a learning rate in (0, 1], such as {DEFAULT['lr']}; got {text!r}")
    return value


def parser():
    ap = UsageParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", default="naive", choices=ATTENTIONS,
                    help=f"the attention stage: one of {', '.join(ATTENTIONS)} (ring: under mpirun or "
                         "--simulate-ranks); default naive")
    ap.add_argument("--data", default=None, help="a text file to learn character by character "
                                                 "(default: none, the associative recall task)")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny config (the defaults below that say 'with --quick'); check that the loss clearly "
                         "falls: the last line is SUMMARY ... PASS or FAIL (default off)")
    ap.add_argument("--steps", type=_at_least(1), default=None, help=f"training steps ({_default('steps')})")
    ap.add_argument("--batch", type=_at_least(1), default=None, help=f"sequences per step ({_default('batch')})")
    ap.add_argument("--context", type=_at_least(1), default=None,
                    help=f"tokens per sequence N ({_default('context')})")
    ap.add_argument("--layers", type=_at_least(1), default=None, help=f"transformer blocks ({_default('n_layer')})")
    ap.add_argument("--d-model", type=_at_least(1), default=None, help=f"channels C ({_default('d_model')})")
    ap.add_argument("--heads", type=_at_least(1), default=None,
                    help=f"attention heads, head dim = d_model / heads ({_default('n_head')})")
    ap.add_argument("--kv-heads", type=_at_least(1), default=None,
                    help="k, v heads, each read by heads / kv-heads query heads (grouped-query attention; 1: "
                         "multi-query); a divisor of --heads (default: --heads, multi-head attention)")
    ap.add_argument("--n-values", type=_at_least(2), default=None,
                    help=f"recall task: number of distinct values ({_default('n_values')})")
    ap.add_argument("--lr", type=learning_rate, default=None,
                    help=f"peak learning rate of AdamW, in (0, 1] ({_default('lr')})")
    ap.add_argument("--seed", type=_at_least(0), default=0, help="initial weights and data order (default 0)")
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
    ap.add_argument("--simulate-ranks", type=_at_least(0), default=0,
                    help="ring: P ranks as threads of this process (default 0: off)")
    ap.add_argument("--csv", default=None, help="write step, loss, accuracy, lr, time to this CSV file (default: none)")
    ap.add_argument("--log-every", type=_at_least(1), default=None,
                    help="print the loss every this many steps (default: steps // 15, about 15 lines)")
    return ap


def comm_backends():
    from stages.ring import BACKENDS

    return BACKENDS


def parse(argv=None):
    """The parsed options with the config's defaults filled in, or a usage error (one line, exit status 2) naming the
    option and what it takes: each number's range above, and what the options take together below."""
    ap = parser()
    args = ap.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    for key, name in (("context", "context"), ("n_layer", "layers"), ("d_model", "d_model"), ("n_head", "heads"),
                      ("batch", "batch"), ("steps", "steps"), ("lr", "lr"), ("n_values", "n_values")):
        if getattr(args, name) is None:
            setattr(args, name, base[key])
    if args.d_model % args.heads:
        ap.error(f"argument --heads: takes a divisor of --d-model {args.d_model} (head dim = d_model / heads), "
                 f"got {args.heads}")
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        ap.error(f"argument --kv-heads: takes a divisor of --heads {args.heads} (each k, v head serves heads / "
                 f"kv-heads query heads), got {args.kv_heads}")
    if args.data is not None and not pathlib.Path(args.data).is_file():
        ap.error(f"argument --data: takes a text file, and {args.data!r} is not one")
    if args.data is None:
        try:
            RecallTask(args.context, n_values=args.n_values)
        except ValueError as e:
            ap.error(f"argument --context: {e}")
    if args.csv is not None and not pathlib.Path(args.csv).resolve().parent.is_dir():
        ap.error(f"argument --csv: takes a file in an existing directory, got {args.csv!r}")
    if args.simulate_ranks and args.attention != "ring":
        ap.error("argument --simulate-ranks: takes effect with --attention ring only")
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
        data = TextData(args.data, args.context, seed=args.seed)
    else:
        data = RecallTask(args.context, n_values=args.n_values, seed=args.seed)
    cfg = GPTConfig(vocab_size=data.vocab_size, context=args.context, n_layer=args.layers, d_model=args.d_model,
                      n_head=args.heads, n_kv_head=args.kv_heads)
    dtype = args.dtype or ("bfloat16" if xp is not np and device_facts(xp)["sm80"] else "float32")
    out = {"cfg": cfg, "data": data, "dtype": dtype, "block": None, "block_text": None, "kernels": None}
    if args.attention == "ring":
        if ring is None:
            raise ValueError("--attention ring needs a communicator: run under mpirun, or --simulate-ranks P")
        shard_positions(cfg.context, ring, args.layout)  # the context splits over the ranks
        out["block"], out["block_text"] = ring_blocks(args.ring_block, dtype=DTYPES[dtype], head_dim=cfg.head_dim,
                                                        grouped=cfg.n_kv_head != cfg.n_head, **device_facts(xp))
        out["block_text"] += hopper_ring_text(out["block"], DTYPES[dtype], cfg.head_dim, heads=cfg.n_head,
                                                kv_heads=cfg.n_kv_head, batch=args.batch, gpu=xp is not np)
    else:  # the head dim and dtype are taken; kernels: what runs in the stage's place on this device, if anything
        out["kernels"] = make_attention(args.attention, cfg.head_dim, DTYPES[dtype], heads=cfg.n_head,
                                          kv_heads=cfg.n_kv_head, batch=args.batch).kernels
    return out


def run(args, ring=None, xp=None, prepared=None):
    """One training run from parsed arguments; prints the log (rank 0) and returns the history."""
    rank0 = ring is None or ring.rank == 0
    say = print if rank0 else (lambda *a, **k: None)
    xp = xp or _device_xp(args.device)
    if xp is np:
        reuse_freed_memory()  # speed.py: the CPU step's arrays reuse the last step's memory (same results)
    prep = prepared or prepare(args, ring, xp)
    cfg, data, dtype = prep["cfg"], prep["data"], prep["dtype"]
    where = "CPU (numpy)" if xp is np else "GPU (CuPy)"
    P = 1 if ring is None else ring.size
    kv = "" if cfg.n_kv_head == cfg.n_head else f" and {cfg.n_kv_head} k, v heads (grouped-query)"
    say(f"stage 05: GPT {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads{kv} (head dim "
        f"{cfg.head_dim}), context {cfg.context}, vocab {cfg.vocab_size}, {n_params(cfg)} parameters")
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



__all__ = ["run", "prepare", "parser", "main", "parse", "QUICK", "DEFAULT"]
