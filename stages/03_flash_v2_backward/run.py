"""Stage 03: FlashAttention-2 backward (Dao, arXiv 2307.08691, Algorithm 2).

    D_i = rowsum(dO_i * O_i)                              preprocess kernel
    per K/V tile j (one block): for each Q tile i:        P_ij recomputed from the saved L_i
        dV_j += P_ij^T dO_i;  dS_ij = P_ij * (dO_i V_j^T - D_i);  dK_j += dS_ij^T Q_i
        dQ_i += dS_ij K_j  (fp32 atomicAdd; or --deterministic: a separate dQ pass, no atomics)

Versions (all runnable, --version), measured on an H100 80GB HBM3 with this script:
    fp32  float32 on CUDA cores, S in double for the exponent; the readable one. B=1 H=4 N=2048 d=64 causal:
          1.32-1.45 ms, 3.7-4.1 TFLOP/s (deterministic 2.1-2.3 ms); stage 01's backward: 35 ms there.
    tc    float16/bfloat16 on tensor cores (mma.sync, ldmatrix, cp.async double buffers). --bench, B=4 H=16
          N=4096, against PyTorch 2.11's flash backward in the same run: bf16 d=64 193-204 TFLOP/s (0.79-0.81x),
          causal 187-189 (0.89-0.90x); d=128 231-233 (0.83-0.84x), causal 211-215 (0.90x); fp16 0.82-0.94x.
          Deterministic mode (no atomics, bit-identical): 177-197 TFLOP/s, 0.83-0.95x of the atomic mode.

Checks first: every version and dQ mode by the tolerance rule against the fp64 oracle (stage 00), also fed
o and lse from stage 02's forward when it imports (else stage 00's); the fp32 version against stage 01's
backward; the tc version against the fp32 version. Then times. The last line is a SUMMARY for scripts/run_all.py.

    python stages/03_flash_v2_backward/run.py                      # CPU mirror (and GPU kernels if any)
    python stages/03_flash_v2_backward/run.py --quick              # small, for scripts/run_all.py
    python stages/03_flash_v2_backward/run.py --version tc --dtype bf16 --deterministic
    python stages/03_flash_v2_backward/run.py --bench              # GPU: B=4 H=16 N=4096 vs torch SDPA
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from stages import flash_v2_backward as fb  # noqa: E402
from stages.flash_v2_backward import flash_v2_backward as launcher  # noqa: E402
from stages import naive  # noqa: E402
from stages.common import (  # noqa: E402
    assert_within_tolerance, bfloat16, cast, check_backward, gpu_name, run_devices, make_inputs, max_error, time_ms,
    to_numpy, tolerance_report,
)

# ---- configuration (each overridable on the command line)
BATCH = 1  # B
HEADS = 4  # H
HEAD_DIM = 64  # D (fp32: 32, 64, 128; tc: 64, 128)
CPU_SEQ = 300  # N for the CPU mirror (numpy is slow: keep it small)
GPU_SEQ = 2048  # N for the GPU check and timing
CAUSAL = True
BENCH_SHAPE = (4, 16, 4096)  # B, H, N of --bench (the targets in the issue)
BENCH_DIMS = (64, 128)
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": bfloat16}


def get_forward():
    """Stage 02's forward when it imports, else stage 00's naive forward (with a note)."""
    try:
        from stages import flash_v2

        return flash_v2.forward, "stage 02 (flash_v2.forward)"
    except Exception as e:  # not written yet, or broken: the oracle's forward still gives o and lse
        print(f"note: stage 02 forward unavailable ({type(e).__name__}: {e}); using stage 00 naive.forward")
        return naive.forward, "stage 00 (naive.forward)"


def run_forward(forward, q, k, v, causal):
    try:
        return forward(q, k, v, causal=causal)
    except Exception as e:  # e.g. a dtype or head dim stage 02 does not take
        print(f"note: forward failed ({type(e).__name__}: {e}); using stage 00 naive.forward")
        return naive.forward(q, k, v, causal=causal)


def check(xp, version, dtype, B, H, N, D, causal, deterministic, forward):
    """Tolerance rule against the fp64 oracle; then the same backward fed stage 02's o and lse."""
    q, k, v, do = make_inputs(B, H, N, N, D, dtype=dtype, xp=xp, grad=True)
    errs = check_backward(fb.backward, q, k, v, do, causal=causal, version=version, deterministic=deterministic)
    o, lse = run_forward(forward, q, k, v, causal)
    grads = fb.backward(q, k, v, o, lse, do, causal=causal, version=version, deterministic=deterministic)
    o64, lse64 = naive.forward(*(to_numpy(x).astype(np.float64) for x in (q, k, v)), causal=causal)
    ref = naive.backward(*(to_numpy(x).astype(np.float64) for x in (q, k, v)), o64, lse64,
                         to_numpy(do).astype(np.float64), causal=causal)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        rel = np.linalg.norm(to_numpy(g).astype(np.float64) - r) / np.linalg.norm(r)
        bound = 1e-4 if dtype == np.float32 else 3e-2
        if not rel <= bound:
            raise AssertionError(f"{name} from the forward's o, lse: relative error {rel:.1e} > {bound:g}")
    return errs


def check_stage01(xp, B, H, N, D, causal):
    """fp32 version against stage 01's backward on the same inputs: both by the tolerance rule against the
    fp64 oracle, and their max abs difference (reported)."""
    from stages import flash_v1

    q, k, v, do = make_inputs(B, H, N, N, D, dtype=np.float32, xp=xp, grad=True)
    o, lse = naive.forward(q, k, v, causal=causal)  # (B, H, N, D), (B, H, N) float32
    ours = fb.backward(q, k, v, o, lse, do, causal=causal, version="fp32")
    theirs = flash_v1.backward(q, k, v, o, lse, do, causal=causal)
    o64, lse64 = naive.forward(*(to_numpy(x).astype(np.float64) for x in (q, k, v)), causal=causal)
    ref = naive.backward(*(to_numpy(x).astype(np.float64) for x in (q, k, v)), o64, lse64,
                         to_numpy(do).astype(np.float64), causal=causal)
    low = naive.backward(*(to_numpy(x) for x in (q, k, v, o, lse, do)), causal=causal)
    for name, a, b, r, lo in zip(("dq", "dk", "dv"), ours, theirs, ref, low):
        assert_within_tolerance(f"{name} (stage 03 fp32)", a, r, lo)
        assert_within_tolerance(f"{name} (stage 01)", b, r, lo)
    return max(max_error(a, b) for a, b in zip(ours, theirs))


def check_tc_vs_fp32(xp, dtype, B, H, N, D, causal, deterministic):
    """tc version against the fp32 version run on the same (upcast) inputs, by the tolerance rule with the
    fp32 version as the reference and naive attention in the tc dtype as the yardstick."""
    q, k, v, do = make_inputs(B, H, N, N, D, dtype=dtype, xp=xp, grad=True)
    o64, lse64 = naive.forward(*(to_numpy(x).astype(np.float64) for x in (q, k, v)), causal=causal)
    o, lse = xp.asarray(cast(o64, dtype)), xp.asarray(lse64.astype(np.float32))
    up = [cast(x, np.float32) for x in (q, k, v, o, do)]
    ref = fb.backward(*up[:4], lse, up[4], causal=causal, version="fp32")
    got = fb.backward(q, k, v, o, lse, do, causal=causal, version="tc", deterministic=deterministic)
    low = naive.backward(*(to_numpy(x) for x in (q, k, v, o, lse, do)), causal=causal)
    errs = {}
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        ok, errs[name], bound = tolerance_report(g, r, lo)
        if not ok:
            raise AssertionError(f"{name}: tc vs fp32 version {errs[name]:.2e} > bound {bound:.2e}")
    return errs


def bench(args):
    """B=4 H=16 N=4096, d=64 and 128, causal and not, bf16 and fp16: ours (atomic, deterministic) beside
    torch SDPA's flash and cuDNN backward, timed in one run on this GPU. Prints a table (and --csv)."""
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, N = args.bench_shape
    rows = []

    def rel_err(ours, ref):  # max over dq, dk, dv of ||ours - torch|| / ||torch||
        out = 0.0
        for a, b in zip(ours, ref):
            b = cupy.from_dlpack(b.float().contiguous())
            out = max(out, float(cupy.linalg.norm(cast(a, np.float32) - b) / cupy.linalg.norm(b)))
        return out
    print(f"\n== bench on {gpu_name()}: B={B} H={H} N={N}, FLOPs = 2.5 x forward (causal halved)")
    print(f"{'dtype':>5} {'D':>4} {'causal':>6} {'ours ms':>8} {'TFLOP/s':>8} {'det ms':>8} {'TFLOP/s':>8} "
          f"{'flash ms':>8} {'TFLOP/s':>8} {'cudnn ms':>8} {'TFLOP/s':>8} {'ours/flash':>10} {'max rel':>8}")
    for dname in args.bench_dtypes:
        dtype = DTYPES[dname]
        tdt = torch.bfloat16 if dname == "bf16" else torch.float16
        for D in args.bench_dims:
            for causal in (False, True):
                q, k, v, do = make_inputs(B, H, N, N, D, dtype=dtype, xp=cupy, grad=True)
                o, lse = naive.forward(q, k, v, causal=causal)  # (B, H, N, D), (B, H, N)
                flops = fb.backward_flops(B, H, N, N, D, causal)

                def to_torch(x):  # same bytes, viewed by torch (int16 carries the 16-bit payload)
                    return torch.from_dlpack(x.view(np.int16)).view(tdt)

                qt, kt, vt, dot = (to_torch(x).requires_grad_(x is not do) for x in (q, k, v, do))
                # check before timing: ours against torch's flash backward on the same inputs
                ours = fb.backward(q, k, v, o, lse, do, causal=causal)
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    ref = torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True)
                rel = rel_err(ours, ref)
                if not rel < 3e-2:
                    raise AssertionError(f"bench check: ours vs torch flash relative error {rel:.2e}")
                t_ours = time_ms(lambda: fb.backward(q, k, v, o, lse, do, causal=causal), gpu=True, repeat=20)
                for det in (False, True):  # where the time goes: one run with an event after each launch
                    launcher.PROFILE = []
                    fb.backward(q, k, v, o, lse, do, causal=causal, deterministic=det)
                    launcher.PROFILE[-1][1].synchronize()
                    ev = launcher.PROFILE
                    launcher.PROFILE = None
                    print("    " + ("deterministic" if det else "atomic") + ": " + ", ".join(
                        f"{b[0]} {cupy.cuda.get_elapsed_time(a[1], b[1]):.3f}" for a, b in zip(ev, ev[1:])) + " ms")
                # variants of the tc kernel (other Br, the other order of the atomic dQ), each checked then timed
                variants = [(f"Br={br} Bc={bc}", [(launcher.TC_BR, D, br), (launcher.TC_BC, D, bc)])
                            for d, br, bc in args.tc_tile_variants if d == D]
                if args.compare_dq_order:
                    variants.append((f"TC_DEFER_DQ={not launcher.TC_DEFER_DQ}",
                                     [(vars(launcher), "TC_DEFER_DQ", not launcher.TC_DEFER_DQ)]))
                for label, settings in variants:
                    keep = [(table, key, table[key]) for table, key, _ in settings]
                    for table, key, value in settings:
                        table[key] = value
                    try:
                        vrel = rel_err(fb.backward(q, k, v, o, lse, do, causal=causal), ref)
                        if not vrel < 3e-2:
                            raise AssertionError(f"variant {label}: relative error vs torch flash {vrel:.2e}")
                        t_var = time_ms(lambda: fb.backward(q, k, v, o, lse, do, causal=causal), gpu=True, repeat=20)
                        print(f"    variant {label}: {t_var:.3f} ms {flops / t_var / 1e9:.1f} TFLOP/s "
                              f"(default: {t_ours:.3f} ms), rel err vs torch {vrel:.1e}")
                    finally:
                        for table, key, value in keep:
                            table[key] = value
                t_det = time_ms(lambda: fb.backward(q, k, v, o, lse, do, causal=causal, deterministic=True),
                                gpu=True, repeat=10)
                times = {}
                for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(backend):
                            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        times[name] = time_ms(
                            lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True), gpu=True,
                            repeat=20)
                    except Exception as e:  # a backend this torch build lacks
                        print(f"note: torch {name} backward unavailable: {type(e).__name__}: {e}")
                        times[name] = float("nan")
                tf = {n: flops / t / 1e9 for n, t in (("ours", t_ours), ("det", t_det), ("flash", times["flash"]),
                                                    ("cudnn", times["cudnn"]))}
                ratio = times["flash"] / t_ours
                print(f"{dname:>5} {D:>4} {str(causal):>6} {t_ours:>8.3f} {tf['ours']:>8.1f} {t_det:>8.3f} "
                      f"{tf['det']:>8.1f} {times['flash']:>8.3f} {tf['flash']:>8.1f} {times['cudnn']:>8.3f} "
                      f"{tf['cudnn']:>8.1f} {ratio:>10.2f} {rel:>8.1e}")
                rows.append((dname, D, causal, t_ours, tf["ours"], t_det, tf["det"], times["flash"], tf["flash"],
                             times["cudnn"], tf["cudnn"], ratio, rel))
    if args.csv:  # the shared results format (results/bench.csv): one row per (implementation, config)
        gpu = gpu_name()
        with open(args.csv, "w") as f:
            f.write("gpu,direction,impl,version,dtype,causal,head_dim,seq_len,batch,heads,ms,tflops,status\n")
            for (dname, D, causal, t_ours, _, t_det, _, t_fl, _, t_cu, _, _, _) in rows:
                flops = fb.backward_flops(B, H, N, N, D, causal)
                for impl, version, t in (("ours", "tc", t_ours), ("ours", "tc-det", t_det),  # scripts/bench.py's names
                                         ("torch", "flash", t_fl), ("torch", "cudnn", t_cu)):
                    ok = t == t  # NaN: that torch backend is unavailable
                    f.write(f"{gpu},bwd,{impl},{version},{dname},{causal},{D},{N},{B},{H},"
                            f"{t:.4f},{flops / t / 1e9 if ok else float('nan'):.1f},{'ok' if ok else 'unavailable'}\n")
        print(f"wrote {args.csv}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", choices=["all", *fb.VERSIONS], default="all",
                    help="which kernel version: fp32 (float32) or tc (fp16/bf16); all: both")
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="bf16", help="dtype of the tc version")
    ap.add_argument("--deterministic", action="store_true",
                    help="no atomics: dQ from a separate pass, bit-identical across runs (default: both modes)")
    ap.add_argument("--batch", type=int, default=BATCH, help="batch size B")
    ap.add_argument("--heads", type=int, default=HEADS, help="number of heads H")
    ap.add_argument("--head-dim", type=int, default=HEAD_DIM, help="head dimension D")
    ap.add_argument("--seq", type=int, default=None, help=f"sequence length (default {CPU_SEQ} CPU, {GPU_SEQ} GPU)")
    ap.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                    help="auto: the CPU mirror, and the GPU kernels too when CuPy sees a GPU")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for scripts/run_all.py")
    ap.add_argument("--bench", action="store_true",
                    help="GPU only: time against torch SDPA flash/cuDNN backward at --bench-shape")
    ap.add_argument("--bench-shape", type=int, nargs=3, default=BENCH_SHAPE, metavar=("B", "H", "N"),
                    help="B H N of --bench")
    ap.add_argument("--bench-dims", type=int, nargs="+", default=BENCH_DIMS, help="head dims of --bench")
    ap.add_argument("--bench-dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"],
                    help="dtypes of --bench")
    ap.add_argument("--csv", default=None, help="--bench: also write the table to this CSV file")
    ap.add_argument("--tc-tile-variants", nargs="*", default=[], metavar="D:BR:BC",
                    help="--bench: also time the tc kernel with these (Br, Bc) per head dim, e.g. 64:64:64 128:32:128")
    ap.add_argument("--compare-dq-order", action="store_true",
                    help="--bench: also time the tc kernel with the other order of its atomic dQ (TC_DEFER_DQ)")
    args = ap.parse_args(argv)
    args.tc_tile_variants = [tuple(int(x) for x in v.split(":")) for v in args.tc_tile_variants]
    causal = not args.no_causal
    devices = run_devices(args.device)
    if args.bench and "gpu" not in devices:
        sys.exit("--bench: no CUDA GPU found (CuPy sees no device); it times the kernels")
    versions = fb.VERSIONS if args.version == "all" else (args.version,)
    modes = (args.deterministic,) if args.deterministic else (False, True)
    forward, fwd_name = get_forward()

    ok = True
    for dev in devices:
        gpu = dev == "gpu"
        xp = np
        if gpu:
            import cupy as xp
        n = args.seq or (128 if args.quick else GPU_SEQ if gpu else CPU_SEQ)
        B, H, D = args.batch, (2 if args.quick else args.heads), args.head_dim
        where = f"GPU ({gpu_name()})" if gpu else "CPU (numpy tile mirror)"
        print(f"\n== stage 03 FlashAttention-2 backward on the {where}: B={B} H={H} N={n} D={D} causal={causal}; "
              f"o, lse from {fwd_name}")
        # 1. checks, before any timing
        try:
            for version in versions:
                dtype = np.float32 if version == "fp32" else DTYPES[args.dtype]
                for det in modes:
                    errs = check(xp, version, dtype, B, H, n, D, causal, det, forward)
                    print(f"{version:>4} {np.dtype(dtype).name:>8} {'deterministic' if det else 'atomic dQ':>13}: "
                          "max abs error vs fp64 oracle " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items()))
            if "fp32" in versions:
                diff = check_stage01(xp, B, H, min(n, 256), D, causal)
                print(f"fp32 version vs stage 01 backward (N={min(n, 256)}): both within tolerance, "
                      f"max abs difference {diff:.1e}")
            if "tc" in versions:
                for det in modes:
                    errs = check_tc_vs_fp32(xp, DTYPES[args.dtype], B, H, min(n, 1024), D, causal, det)
                    print(f"tc version vs fp32 version (N={min(n, 1024)}, {'deterministic' if det else 'atomic'}):"
                          " max abs error " + ", ".join(f"{k} {e:.1e}" for k, e in errs.items()))
        except AssertionError as e:
            print(f"CHECK FAILED: {e}")
            ok = False
            continue
        print("All results match. Timing.")
        # 2. time each version and mode at this size
        for version in versions:
            dtype = np.float32 if version == "fp32" else DTYPES[args.dtype]
            q, k, v, do = make_inputs(B, H, n, n, D, dtype=dtype, xp=xp, grad=True)
            o, lse = naive.forward(q, k, v, causal=causal)
            flops = fb.backward_flops(B, H, n, n, D, causal)
            for det in modes:
                t = time_ms(lambda: fb.backward(q, k, v, o, lse, do, causal=causal, version=version,
                                                deterministic=det), gpu=gpu, warmup=1, repeat=3 if not gpu else 10)
                rate = f"{flops / t / 1e9:8.1f} TFLOP/s" if gpu else f"{flops / t / 1e6:8.2f} GFLOP/s"
                print(f"{version:>4} {np.dtype(dtype).name:>8} {'deterministic' if det else 'atomic dQ':>13}: "
                      f"{t:9.3f} ms  {rate}  ({where})")
    if ok and args.bench:
        bench(args)
    print(f"SUMMARY 03_flash_v2_backward {'PASS' if ok else 'FAIL'} "
          f"{'+'.join(versions)} dq/dk/dv vs fp64 oracle, atomic+deterministic, on {', '.join(devices)}")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
