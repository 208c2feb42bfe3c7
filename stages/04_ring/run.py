"""Stage 04: ring attention across MPI ranks (Liu, Zaharia & Abbeel 2023, arXiv 2310.01889).

Each rank keeps its query shard Q_r; the K_j, V_j shards travel around the ring (one step per rank),
each block is computed with the single-device kernel (stage 02 forward, stage 03 backward) and the
partial results are merged by their log-sum-exp. The backward also rotates the dK_j, dV_j accumulators.

Versions (the layouts, `--layout`):
  contiguous  rank r holds rows [rN/P, (r+1)N/P): simple; causal work is unbalanced (rank P-1 does
              2P-1 times rank 0's work).
  zigzag      rank r holds chunks r and 2P-1-r of 2P: every rank does the same causal work.
Measured: both layouts within tolerance on the CPU (2 cores, numpy, 4 ranks, fp32) and on one H100
(4 ranks, mpi backend, bf16, D=128, N=1001, --quick). Timings on GPUs: not measured yet (README.md).
Backends (`--backend`, auto picks and says why): nccl (a GPU per rank), mpi (CuPy staged through the
host: more ranks than GPUs), numpy (CPU). Blocks (`--block`): flash (stages 02/03; the GPU default) or
naive (stage 00's formula; the CPU default, where the stage 02/03 tile mirrors are exact but slow).

What it does: cuts fresh random inputs into shards, runs the ring forward and backward, gathers the
result and checks it on the full sequence by the tolerance rule against the fp64 oracle, beside the
single-device stage 02/03 (or stage 00) result. Only then it times: time per rank, compute and exposed
communication per ring step, peak memory per rank, and the speedup over one device.

    mpirun -n 4 python stages/04_ring/run.py                   # CPU laptop (numpy) or 1 GPU (mpi backend)
    mpirun -n 4 python stages/04_ring/run.py --quick           # small, for scripts/run_all.py
    mpirun -n 2 python stages/04_ring/run.py --backend nccl    # 2 GPUs, one per rank
    mpirun -n 8 --hostfile hosts python stages/04_ring/run.py  # 2 nodes x 4 GPUs (see README.md)
    python stages/04_ring/run.py --help
"""
import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before numpy loads its BLAS:
    os.environ.setdefault(_var, "1")  # one core per rank on the CPU (P ranks x all cores would thrash)

import numpy as np  # noqa: E402

from stages import naive  # noqa: E402
from stages import ring as R  # noqa: E402
from stages.common import PeakMemory, attention_flops, bfloat16, cast, gpu_name, make_inputs, time_ms  # noqa: E402
from stages.common.tolerance import FACTOR, SLACK, max_error  # noqa: E402
from stages.ring import comm as comm_mod  # noqa: E402

# ---- configuration (each overridable on the command line)
BATCH = 1  # B
HEADS = 4  # H
HEAD_DIM = 64  # D (128 on a GPU)
CHECK_SEQ = 1000  # total N of the correctness check (the fp64 oracle runs on rank 0's CPU)
SEQ_CPU = 1000  # total N timed on the CPU
SEQ_GPU = 16384  # total N timed on GPUs
LAYOUT = "zigzag"  # contiguous | zigzag
CAUSAL = True
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=comm_mod.BACKENDS, default="auto",
                    help="auto: nccl with a GPU per rank, mpi with fewer GPUs than ranks, numpy without a GPU")
    ap.add_argument("--layout", choices=R.LAYOUTS, default=LAYOUT, help="how the sequence is cut into shards")
    ap.add_argument("--block", choices=sorted(R.BLOCKS), default=None,
                    help="per-block kernels: flash (stages 02/03) or naive (stage 00); default flash on GPUs, "
                         "naive on the CPU")
    ap.add_argument("--fwd-version", default=None,
                    help="stage 02 version for forward blocks: fp32 | tc | pipelined (default: fp32 for float32, "
                         "pipelined for fp16/bf16)")
    ap.add_argument("--bwd-version", default="auto", help="stage 03 version for backward blocks: auto | fp32 | tc")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bfloat16 on GPUs, float32 on CPU")
    ap.add_argument("--batch", type=int, default=BATCH, help="batch size B")
    ap.add_argument("--heads", type=int, default=None, help=f"number of heads H (default {HEADS}; 2 with --quick)")
    ap.add_argument("--head-dim", type=int, default=None, help="head dimension D (default 64 CPU, 128 GPU)")
    ap.add_argument("--check-seq", type=int, default=None,
                    help=f"total sequence length of the check (default {CHECK_SEQ}; 256 with --quick; any length)")
    ap.add_argument("--seq", type=int, default=None,
                    help=f"total sequence length timed (default {SEQ_CPU} CPU, {SEQ_GPU} GPU; 256 / 4096 with --quick)")
    ap.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats (median)")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for scripts/run_all.py")
    # test-only fault injection (tests/test_04_ring.py): hidden from --help
    ap.add_argument("--inject-mismatch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inject-error", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    ring, backend, reason = comm_mod.setup(args.backend)
    world, rank, P = comm_mod.world(), ring.rank, ring.size
    gpu = backend in ("nccl", "mpi")
    xp = np
    if gpu:
        import cupy as xp
    block = args.block or ("flash" if gpu else "naive")
    dtype = DTYPES[args.dtype or ("bfloat16" if gpu else "float32")]
    D = args.head_dim or (128 if gpu else HEAD_DIM)
    causal, layout = not args.no_causal, args.layout
    if args.quick:  # small defaults; sizes given on the command line still win
        n_check, n_time, heads = 256, (4096 if gpu else 256), 2
    else:
        n_check, n_time, heads = CHECK_SEQ, (SEQ_GPU if gpu else SEQ_CPU), HEADS
    n_check, n_time, args.heads = args.check_seq or n_check, args.seq or n_time, args.heads or heads
    versions = (R.flash_version(dtype, args.fwd_version), args.bwd_version) if block == "flash" else (None, None)
    where = f"GPU {gpu_name()}" if gpu else "CPU"
    if rank == 0:
        print(f"== stage 04 ring attention: {P} ranks, backend {args.backend} -> {backend} ({reason})")
        print(f"   blocks: {block}, layout {layout}, causal={causal}, dtype {np.dtype(dtype).name}, "
              f"B={args.batch} H={args.heads} D={D}, on {where} (rank 0)"
              + (f"\n   block kernels: stage 02 version {versions[0]}, stage 03 version {versions[1]}"
                 if block == "flash" else ""), flush=True)
    if args.inject_error is not None and rank == args.inject_error:
        _break_second_block(block)
    kw = dict(ring=ring, causal=causal, layout=layout, block=block)
    kw_f, kw_b = dict(kw, version=versions[0]), dict(kw, version=versions[1])  # stage 02 / stage 03 versions

    # 1. check, before any timing: gather the result and hold it to the tolerance rule on the full sequence
    n_mine = n_check + (1 if args.inject_mismatch and rank == 1 else 0)  # test-only: rank 1 disagrees
    seed = world.bcast(int(np.random.default_rng().integers(2**31)) if rank == 0 else None, root=0)
    q, k, v, do = make_inputs(args.batch, args.heads, n_mine, n_mine, D, dtype=dtype, seed=seed, grad=True)
    mine = [xp.asarray(R.shard(x, rank, P, layout)) for x in (q, k, v, do)]  # (B, H, L, D) shards
    o, lse = R.ring_forward(*mine[:3], nq=n_mine, nk=n_mine, **kw_f)
    grads = R.ring_backward(*mine[:3], o, lse, mine[3], nq=n_mine, nk=n_mine, **kw_b)
    parts = world.gather([_host(t) for t in (o, lse, *grads)], root=0)
    ok = True
    if rank == 0:
        ok = _check(parts, q, k, v, do, causal, layout, block, versions, xp)
    ok = world.bcast(ok, root=0)
    if not ok:
        if rank == 0:
            print(f"SUMMARY 04_ring FAIL ring result out of tolerance ({backend}, {P} ranks)")
        return False

    # 2. time: the ring, then one device on the whole sequence (rank 0 alone)
    row = _time_ring(args, kw_f, kw_b, n_time, D, dtype, xp, gpu)
    rows = world.gather(row, root=0)
    single = _time_single(args, n_time, D, dtype, xp, gpu, block, causal, versions) if rank == 0 else None
    comm_mod.quiet_barrier(world)  # the other ranks sleep while rank 0 times one device alone
    if rank == 0:
        _table(rows, single, args, n_time, D, causal, P, where)
        if backend != "nccl" and P > 1:
            print(f"(the {P} ranks share {'the GPU(s)' if gpu else 'the CPU cores'} here: the speedup shows the "
                  "ring's overhead, not its scaling; scaling needs a GPU per rank, --backend nccl)")
        print(f"SUMMARY 04_ring PASS {P} ranks {backend}, {layout}, fwd+bwd within tolerance on the full sequence")
    return True


def _host(x):
    return x if isinstance(x, np.ndarray) else x.get()


def _break_second_block(block):
    """Test-only: this rank's second block call raises, mid-ring, while the others wait on it."""
    fwd, bwd = R.BLOCKS[block]
    calls = []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected failure on this rank (--inject-error)")
        return fwd(*a, **kw)

    R.BLOCKS[block] = (failing, bwd)


def _check(parts, q, k, v, do, causal, layout, block, versions, xp):
    """Rank 0: the gathered ring result against the fp64 oracle, beside the single-device result.

    Bound (the tolerance rule, for a ring): 2x the larger error of naive attention and of the naive ring (the
    same ring with stage 00 blocks, both in the inputs' dtype; see ring.ring_yardstick) + 1e-5."""
    n, P = q.shape[2], len(parts)
    got = [R.unshard([p[i] for p in parts], n, layout) for i in range(5)]  # o, lse, dq, dk, dv: (B, H, n, ...)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    o64, lse64 = naive.forward(q64, k64, v64, causal=causal)  # the fp64 oracle
    refs = [o64, lse64, *naive.backward(q64, k64, v64, o64, lse64, do64, causal=causal)]
    o_in, lse_in = cast(o64, q.dtype), lse64.astype(np.float32)  # what the yardsticks' backward starts from
    lows = [*naive.forward(q, k, v, causal=causal), *naive.backward(q, k, v, o_in, lse_in, do, causal=causal)]
    ring_lows = R.ring_yardstick(q, k, v, o_in, lse_in, do, causal=causal, layout=layout, ranks=P)
    # one device on the full sequence: stage 02 forward, stage 03 backward (stage 00 for --block naive)
    fwd, bwd = R.BLOCKS[block]
    dev = [xp.asarray(x) for x in (q, k, v, do)]
    o1, lse1 = fwd(*dev[:3], causal=causal, scale=None, version=versions[0])
    singles = [o1, lse1, *bwd(*dev[:3], xp.asarray(o_in), xp.asarray(lse_in), dev[3], causal=causal, scale=None,
                              version=versions[1])]
    print(f"check on the full sequence (N={n}), max abs error against the fp64 oracle:")
    print(f"  {'':>4} {'ring':>10} {'one device':>11} {'naive':>10} {'naive ring':>11} {'bound':>10} "
          f"{'|ring-one|':>11}")
    ok = True
    for name, g, ref, low, rlow, one in zip(("o", "lse", "dq", "dk", "dv"), got, refs, lows, ring_lows, singles):
        one = _host(one)
        err, e_low, e_rlow = max_error(g, ref), max_error(low, ref), max_error(rlow, ref)
        bound = FACTOR * max(e_low, e_rlow) + SLACK
        ok &= err <= bound
        print(f"  {name:>4} {err:>10.2e} {max_error(one, ref):>11.2e} {e_low:>10.2e} {e_rlow:>11.2e} {bound:>10.2e} "
              f"{max_error(g, one):>11.2e}  {'ok' if err <= bound else 'FAIL'}")
    print(f"  (bound = {FACTOR:g} x the larger error of naive attention and of the naive ring, both in "
          f"{np.dtype(q.dtype).name}, + {SLACK:g})")
    print("All results match. Timing." if ok else "CHECK FAILED: the ring's result is out of tolerance.")
    return ok


def _inputs(args, L, D, dtype, xp):
    """Fresh random q, k, v, do (B, H, L, D), made on the device directly (no full array on big runs)."""
    rng = xp.random.default_rng() if xp is not np else np.random.default_rng()
    return [cast(rng.standard_normal((args.batch, args.heads, L, D), dtype=np.float32), dtype) for _ in range(4)]


def _time_ring(args, kw_f, kw_b, n, D, dtype, xp, gpu):
    ring = kw_f["ring"]
    P, rank = ring.size, ring.rank
    with PeakMemory(gpu) as mem:  # inputs included: the per-rank activations plus the ring's buffers
        q, k, v, do = _inputs(args, R.shard_len(n, P, kw_f["layout"]), D, dtype, xp)  # this rank's shards
        o, lse = R.ring_forward(q, k, v, nq=n, nk=n, **kw_f)
        R.ring_backward(q, k, v, o, lse, do, nq=n, nk=n, **kw_b)
    t_f = time_ms(lambda: R.ring_forward(q, k, v, nq=n, nk=n, **kw_f), gpu=gpu, warmup=1, repeat=args.repeat)
    t_b = time_ms(lambda: R.ring_backward(q, k, v, o, lse, do, nq=n, nk=n, **kw_b), gpu=gpu, warmup=1,
                  repeat=args.repeat)
    tl_f, tl_b = [], []
    R.ring_forward(q, k, v, nq=n, nk=n, timeline=tl_f, **kw_f)
    R.ring_backward(q, k, v, o, lse, do, nq=n, nk=n, timeline=tl_b, **kw_b)
    return dict(rank=rank, fwd=t_f, bwd=t_b, peak=mem.peak, tl_f=tl_f, tl_b=tl_b)


def _time_single(args, n, D, dtype, xp, gpu, block, causal, versions):
    fwd, bwd = R.BLOCKS[block]
    vf, vb = versions
    with PeakMemory(gpu) as mem:
        q, k, v, do = _inputs(args, n, D, dtype, xp)  # the whole sequence
        o, lse = fwd(q, k, v, causal=causal, scale=None, version=vf)
        bwd(q, k, v, o, lse, do, causal=causal, scale=None, version=vb)
    t_f = time_ms(lambda: fwd(q, k, v, causal=causal, scale=None, version=vf), gpu=gpu, warmup=1, repeat=args.repeat)
    t_b = time_ms(lambda: bwd(q, k, v, o, lse, do, causal=causal, scale=None, version=vb), gpu=gpu, warmup=1,
                  repeat=args.repeat)
    return dict(fwd=t_f, bwd=t_b, peak=mem.peak)


def _table(rows, single, args, n, D, causal, P, where):
    flops = attention_flops(args.batch, args.heads, n, n, D, causal=causal)
    print(f"\ntimed: total N={n} ({R.shard_len(n, P, args.layout)} rows per rank), median of {args.repeat}, "
          f"{where}")
    print(f"{'rank':>4} {'fwd ms':>9} {'bwd ms':>9} {'fwd compute/step':>17} {'fwd exposed/step':>17} "
          f"{'bwd compute/step':>17} {'bwd exposed/step':>17} {'peak MB':>9}")
    for r in rows:
        cf = np.mean([t["compute_ms"] for t in r["tl_f"]])
        ef = np.mean([t["exposed_ms"] for t in r["tl_f"]])
        cb = np.mean([t["compute_ms"] for t in r["tl_b"]])
        eb = np.mean([t["exposed_ms"] for t in r["tl_b"]])
        print(f"{r['rank']:>4} {r['fwd']:>9.2f} {r['bwd']:>9.2f} {cf:>14.2f} ms {ef:>14.2f} ms {cb:>14.2f} ms "
              f"{eb:>14.2f} ms {r['peak'] / 2**20:>9.1f}")
    t_f, t_b = max(r["fwd"] for r in rows), max(r["bwd"] for r in rows)  # the ring is as slow as its slowest rank
    peak = max(r["peak"] for r in rows)
    print(f"one device, whole sequence: fwd {single['fwd']:.2f} ms, bwd {single['bwd']:.2f} ms, "
          f"peak {single['peak'] / 2**20:.1f} MB")
    print(f"speedup over one device: fwd {single['fwd'] / t_f:.2f}x, bwd {single['bwd'] / t_b:.2f}x with {P} ranks; "
          f"per-rank throughput {flops / P / t_f / 1e6:.1f} GFLOP/s fwd ({single['fwd'] / t_f / P:.2f}x one "
          f"device's); peak memory per rank / one device = {peak / max(single['peak'], 1):.2f} (1/P = {1 / P:.2f})")


if __name__ == "__main__":
    try:
        sys.exit(0 if main() else 1)
    except SystemExit:
        raise  # argparse (--help, a bad option) or our own exit: every rank exits the same way
    except R.RingMismatch as e:  # raised on every rank at once: each prints, then the job ends
        comm_mod.world().Barrier()  # every rank has reached this point (and printed) before the abort
        comm_mod.abort(e)
    except BaseException as e:  # an error on one rank: end the whole job now, never leave the others hanging
        import traceback

        comm_mod.abort(e, trace=traceback.format_exc())
    os._exit(1)  # MPI_Abort returned (some MPIs do, while mpirun tears the job down): never exit 0
