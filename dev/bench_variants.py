"""Time the variants of stage 02's forward (version 'pipelined') beside PyTorch on one GPU, in one run; with
--hopper, stage 06's (FlashAttention-3 on an sm_90 GPU) against the references issue 69 names.

    python dev/bench_variants.py [--out results] [--seq 16384] [--heads 16] [--head-dim 128]
    python dev/bench_variants.py --hopper --out results      # results/bench_variants_hopper_<gpu>.csv

Rows (bf16, B = 1, causal unless named):
    plain            ours against SDPA's flash backend
    window W         sliding window: query i sees keys i - W + 1 .. i (window=(W - 1, 0), causal), against
                     FlexAttention (torch.compile'd) with the same mask; time should grow with W, not with N
    softcap c        S -> c tanh(S / c), non-causal, against FlexAttention with the same score_mod; also as a ratio
                     to our own plain non-causal forward
    gqa H/Hkv        grouped-query k and v (H = 2 x heads, Hkv = H / 4), against our plain forward with H heads of
                     k and v (the same FLOPs; GQA reads a quarter of the K/V bytes)
    dropout p        causal, dropout_p = p, against SDPA's flash backend with the same dropout_p (its own Philox
                     mask, so no output difference is reported) and against our plain causal forward
    varlen S         a packed batch of S causal sequences of different lengths (total about N), one launch, against
                     our plain forward on the same sequences padded to the longest (B = S): the work padding wastes
Backward rows (bwd): ours (stage 03, version 'tc') against FlexAttention's backward (the same mask / score_mod),
grouped-query against our plain backward, dropout against SDPA flash's backward with dropout and our plain one.
Before timing, each variant of ours is checked by the tolerance rule against the fp64 oracle on a small problem with
the same options (N = 1024, 2 heads). At full size the CSV reports the max difference from PyTorch's output, and for
the windows the max difference of ours and of FlexAttention from stage 00 in float32 on the GPU (one head).
Writes <out>/bench_variants.csv (one run, provenance columns) and prints the table. Every row says its direction
(forward or backward); ratio = the reference's ms / ours (above 1: ours is faster).

--hopper (stage 06's variant kernels: kernels/flash_v3_forward_variants.cu, flash_v3_backward_variants.cu), bf16,
B = 1, forward and backward each:
    gqa 32/8         H = 2 x heads query heads on H / 4 k / v heads, causal, against stage 06's plain attention on k, v
                     repeated to H heads ("stage 06 plain"; the same FLOPs)
    window W         causal sliding window window=(W - 1, 0), W = --windows, against FlexAttention compiled
    softcap c        non-causal, against FlexAttention compiled with the same score_mod
    varlen 8         8 causal sequences of different lengths (total about N), one launch, against stage 06's plain
                     attention on them padded to the longest (B = 8): ratio = the padded batch's ms / ours, its speed
                     counted on the real tokens
Each is checked by the tolerance rule at N = 1024 before timing. Writes <out>/bench_variants_hopper_<gpu>.csv.
"""
import argparse
import csv
import os
import sys

import numpy as np


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))

import bench  # noqa: E402  (timing, provenance, DLPack helpers)

from stages import flash_v2, flash_v2_backward, naive  # noqa: E402  (naive: stage 00, also the tolerance rule's reference)
from stages.common import bfloat16, check_backward, check_forward, make_inputs  # noqa: E402


def _flex(torch):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention), create_block_mask


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--windows", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--target-ms", type=float, default=300.0)
    ap.add_argument("--hopper", action="store_true", help="stage 06's variants (an sm_90 GPU), not stage 02/03's")
    args = ap.parse_args(argv)
    if args.hopper:
        return hopper(args)
    cupy, torch = bench._environment()
    flex, create_block_mask = _flex(torch)
    N, H, D = args.seq, args.heads, args.head_dim
    scale = D ** -0.5
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    prov = bench.provenance(cupy, torch, gpu)
    clock_c, clock_t = bench._Clock("cupy", cupy), bench._Clock("torch", cupy)
    rows = []

    def tensors(h, hkv, n=N):
        q = make_inputs(1, h, n, n, D, dtype=bfloat16, xp=cupy)[0]
        _, k, v = make_inputs(1, hkv, n, n, D, dtype=bfloat16, xp=cupy)
        return q, k, v

    def gate(opts, causal, h=2, hkv=2):
        q, k, v = tensors(h, hkv, 1024)
        check_forward(flash_v2.forward, q, k, v, causal=causal, opts=opts, version="pipelined")
        do = make_inputs(1, h, 1024, 1024, D, dtype=bfloat16, xp=cupy)[0]
        check_backward(flash_v2_backward.backward, q, k, v, do, causal=causal, opts=opts, version="tc")

    def ours_bwd(q, k, v, causal, **opts):
        o, lse = flash_v2.forward(q, k, v, causal=causal, scale=scale, version="pipelined", **opts)
        do = make_inputs(*q.shape[:2], q.shape[2], q.shape[2], D, dtype=bfloat16, xp=cupy)[0]
        return lambda: flash_v2_backward.backward(q, k, v, o, lse, do, causal=causal, scale=scale, version="tc",
                                                  **opts)

    def torch_bwd(run):
        """The backward of a torch attention call: run() once with grad, then backward(dO) timed alone."""
        for t in (tq, tk, tv):
            t.requires_grad_(True)
        out = run()
        do = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (tq, tk, tv), do, retain_graph=True)

    def ours(q, k, v, causal, **opts):
        return lambda: flash_v2.forward(q, k, v, causal=causal, scale=scale, version="pipelined", **opts)[0]

    def timed(fn, clock):
        return bench.time_call(fn, clock, cupy, target_ms=args.target_ms)[0]

    def add(name, ms_ours, ref_name, ms_ref, diff=""):
        rows.append(dict(variant=name, direction="backward" if name.endswith(" bwd") else "forward", seq=N, heads=H,
                         head_dim=D, ms_ours=f"{ms_ours:.4f}", reference=ref_name, ms_reference=f"{ms_ref:.4f}",
                         ratio=f"{ms_ref / ms_ours:.3f}", max_diff=diff, **prov))
        print(f"{name:>16}: ours {ms_ours:8.3f} ms   {ref_name:>22} {ms_ref:8.3f} ms   ratio {ms_ref / ms_ours:5.2f}"
              f"   {diff}")

    def diff(a, b):
        b = bench._to_cupy(b, cupy, torch)
        return f"{float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max()):.3e}"

    # plain, causal, against SDPA flash
    q, k, v = tensors(H, H)
    tq, tk, tv = (bench._to_torch(x, torch) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(causal):
        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=scale)
        return run

    plain_causal = timed(ours(q, k, v, True), clock_c)
    add("plain causal", plain_causal, "sdpa flash", timed(sdpa(True), clock_t),
        diff(ours(q, k, v, True)(), sdpa(True)()))
    plain_full = timed(ours(q, k, v, False), clock_c)
    add("plain", plain_full, "sdpa flash", timed(sdpa(False), clock_t), diff(ours(q, k, v, False)(), sdpa(False)()))

    # sliding windows, against FlexAttention
    for W in args.windows:
        gate({"window": (W // 8 - 1, 0)}, True)  # the same option at N = 1024 (a window of N / 8)
        torch._dynamo.reset()  # a fresh compile per mask: a cached graph must not keep another window's mask_mod

        def mask_mod(b, h, qi, ki, W=W):
            return (qi >= ki) & (qi - ki < W)

        bm = create_block_mask(mask_mod, 1, 1, N, N, device="cuda")
        run_flex = lambda bm=bm: flex(tq, tk, tv, block_mask=bm, scale=scale)  # noqa: E731
        f = ours(q, k, v, True, window=(W - 1, 0))
        ref = naive.forward(*(x[:, :1].astype(cupy.float32) for x in (q, k, v)), window=(W - 1, 0))[0]
        o_ours, o_flex = f()[:, :1].astype(cupy.float32), bench._to_cupy(run_flex(), cupy, torch)[:, :1]
        vs_naive = (f"ours-naive32 {float(cupy.abs(o_ours - ref).max()):.3e}; "
                    f"flex-naive32 {float(cupy.abs(o_flex.astype(cupy.float32) - ref).max()):.3e}")
        del ref
        add(f"window {W}", timed(f, clock_c), "flex_attention", timed(run_flex, clock_t),
            f"{diff(f(), run_flex())}; {vs_naive}")
        add(f"window {W} bwd", timed(ours_bwd(q, k, v, True, window=(W - 1, 0)), clock_c), "flex_attention bwd",
            timed(torch_bwd(run_flex), clock_t))
        for t in (tq, tk, tv):
            t.requires_grad_(False)

    # softcap, against FlexAttention and our plain non-causal forward
    c = args.softcap
    gate({"softcap": c / 10}, False)

    def cap(score, b, h, qi, ki):
        return c * torch.tanh(score / c)

    run_cap = lambda: flex(tq, tk, tv, score_mod=cap, scale=scale)  # noqa: E731
    f = ours(q, k, v, False, softcap=c)
    ms_cap = timed(f, clock_c)
    add(f"softcap {c:g}", ms_cap, "flex_attention", timed(run_cap, clock_t), diff(f(), run_cap()))
    add(f"softcap {c:g}", ms_cap, "ours plain (no cap)", plain_full)
    ms_cap_b = timed(ours_bwd(q, k, v, False, softcap=c), clock_c)
    add(f"softcap {c:g} bwd", ms_cap_b, "flex_attention bwd", timed(torch_bwd(run_cap), clock_t))
    for t in (tq, tk, tv):
        t.requires_grad_(False)
    add(f"softcap {c:g} bwd", ms_cap_b, "ours plain bwd (no cap)", timed(ours_bwd(q, k, v, False), clock_c))

    # GQA: H = 2 heads-worth of queries, Hkv = H / 4, against our plain forward with as many k/v heads as q
    Hq = 2 * H
    gate({}, True, h=8, hkv=2)
    q2, k2, v2 = tensors(Hq, Hq // 4)
    kr, vr = cupy.repeat(k2, 4, axis=1), cupy.repeat(v2, 4, axis=1)
    f = ours(q2, k2, v2, True)
    add(f"gqa {Hq}/{Hq // 4}", timed(f, clock_c), f"ours plain H={Hq}", timed(ours(q2, kr, vr, True), clock_c),
        f"{float(cupy.abs(f().astype(cupy.float32) - ours(q2, kr, vr, True)().astype(cupy.float32)).max()):.3e}")
    add(f"gqa {Hq}/{Hq // 4} bwd", timed(ours_bwd(q2, k2, v2, True), clock_c), f"ours plain bwd H={Hq}",
        timed(ours_bwd(q2, kr, vr, True), clock_c))

    # dropout, causal: against SDPA flash with the same dropout_p, and against our plain causal forward / backward
    p = args.dropout
    gate({"dropout_p": p, "seed": 3}, True)

    def sdpa_drop():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=scale,
                                                                    dropout_p=p)

    f = ours(q, k, v, True, dropout_p=p, seed=3)
    ms_drop = timed(f, clock_c)
    add(f"dropout {p:g}", ms_drop, "sdpa flash dropout", timed(sdpa_drop, clock_t))
    add(f"dropout {p:g}", ms_drop, "ours plain causal", plain_causal)
    ms_drop_b = timed(ours_bwd(q, k, v, True, dropout_p=p, seed=3), clock_c)
    add(f"dropout {p:g} bwd", ms_drop_b, "sdpa flash dropout bwd", timed(torch_bwd(sdpa_drop), clock_t))
    for t in (tq, tk, tv):
        t.requires_grad_(False)
    add(f"dropout {p:g} bwd", ms_drop_b, "ours plain causal bwd", timed(ours_bwd(q, k, v, True), clock_c))

    # varlen: a packed batch against the same sequences padded to the longest
    lens = [N // 4, N // 8, N // 16, N // 32, 3 * N // 16, 5 * N // 32, N // 8, N // 16]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # checked by the gpu tests, not gated here
    qp, kp, vp = (x[0].swapaxes(0, 1).copy() for x in tensors(H, H, int(cu[-1])))  # packed (total, H, D)
    qpad, kpad, vpad = tensors(H, H, max(lens))
    qpad, kpad, vpad = (cupy.concatenate([x] * len(lens)) for x in (qpad, kpad, vpad))  # (S, H, max, D)
    f = lambda: flash_v2.forward_varlen(qp, kp, vp, cu, cu, causal=True, scale=scale)[0]  # noqa: E731
    add(f"varlen {len(lens)}", timed(f, clock_c), f"ours padded B={len(lens)}", timed(ours(qpad, kpad, vpad, True),
                                                                                       clock_c))
    o, lse = flash_v2.forward_varlen(qp, kp, vp, cu, cu, causal=True, scale=scale)
    dop = cupy.ones_like(qp)
    fb = lambda: flash_v2_backward.backward_varlen(qp, kp, vp, o, lse, dop, cu, cu, causal=True, scale=scale)  # noqa
    add(f"varlen {len(lens)} bwd", timed(fb, clock_c), f"ours padded bwd B={len(lens)}",
        timed(ours_bwd(qpad, kpad, vpad, True), clock_c))

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_variants.csv")
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")


def hopper(args):
    """Stage 06's variants against issue 69's references (the module docstring's --hopper rows)."""
    import re

    from stages.common import gpu_name
    from stages.hopper import flash_v3, flash_v3_backward

    cupy, torch, prov = bench.hopper_session("dev/bench_variants.py --hopper")
    flex, create_block_mask = _flex(torch)
    N, H, D = args.seq, args.heads, args.head_dim
    scale = D ** -0.5
    clock_c, clock_t = bench._Clock("cupy", cupy), bench._Clock("torch", cupy)
    rows = []

    def inputs(b, h, hkv, n, grad=False):
        q, _, _, do = make_inputs(b, h, n, n, D, dtype=bfloat16, xp=cupy, grad=True)
        _, k, v = make_inputs(b, hkv, n, n, D, dtype=bfloat16, xp=cupy)
        return (q, k, v, do) if grad else (q, k, v)

    def gate(opts, causal, h=2, hkv=2):  # the rule at N = 1024 before any timing of this variant
        q, k, v, do = inputs(1, h, hkv, 1024, grad=True)
        check_forward(flash_v3.forward, q, k, v, causal=causal, opts=opts)
        check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, opts=opts)

    def forward(q, k, v, **kw):
        return lambda: flash_v3.forward(q, k, v, scale=scale, **kw)[0]

    def backward(q, k, v, do, **kw):
        o, lse = flash_v3.forward(q, k, v, scale=scale, **kw)
        return lambda: flash_v3_backward.backward(q, k, v, o, lse, do, scale=scale, **kw)

    def timed(fn, clock):
        return bench.time_call(fn, clock, cupy, target_ms=args.target_ms)[0]

    def add(name, direction, ms_ours, ref_name, ms_ref, heads=H):
        rows.append(dict(variant=name, direction=direction, seq=N, heads=heads, head_dim=D, ms_ours=f"{ms_ours:.4f}",
                         reference=ref_name, ms_reference=f"{ms_ref:.4f}", ratio=f"{ms_ref / ms_ours:.3f}", **prov))
        print(f"{name:>12} {direction:>8}: ours {ms_ours:8.3f} ms   {ref_name:>16} {ms_ref:8.3f} ms   "
              f"ratio {ms_ref / ms_ours:5.2f}")

    def torch_backward(run, tq, tk, tv):
        """The backward of a torch attention call: run() once with grad, then backward(dO) timed alone."""
        for t in (tq, tk, tv):
            t.requires_grad_(True)
        out = run()
        do = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (tq, tk, tv), do, retain_graph=True)

    # grouped-query 32 / 8 against stage 06's plain attention at 32 heads (k, v repeated)
    Hq, Hkv = 2 * H, H // 2
    gate({}, True, h=8, hkv=2)
    q, k, v, do = inputs(1, Hq, Hkv, N, grad=True)
    kr, vr = cupy.repeat(k, Hq // Hkv, axis=1), cupy.repeat(v, Hq // Hkv, axis=1)
    name = f"gqa {Hq}/{Hkv}"
    add(name, "forward", timed(forward(q, k, v, causal=True), clock_c), "stage 06 plain",
        timed(forward(q, kr, vr, causal=True), clock_c), Hq)
    add(name, "backward", timed(backward(q, k, v, do, causal=True), clock_c), "stage 06 plain",
        timed(backward(q, kr, vr, do, causal=True), clock_c), Hq)
    del q, k, v, do, kr, vr

    # sliding windows and softcap against FlexAttention (compiled)
    q, k, v, do = inputs(1, H, H, N, grad=True)
    tq, tk, tv = (bench._to_torch(x, torch) for x in (q, k, v))
    for W in args.windows:
        gate({"window": (W // 8 - 1, 0)}, True)  # the same option at N = 1024 (a window of N / 8)
        torch._dynamo.reset()  # a fresh compile per mask

        def mask_mod(b, h, qi, ki, W=W):
            return (qi >= ki) & (qi - ki < W)

        bm = create_block_mask(mask_mod, 1, 1, N, N, device="cuda")
        run_flex = lambda bm=bm: flex(tq, tk, tv, block_mask=bm, scale=scale)  # noqa: E731
        add(f"window {W}", "forward", timed(forward(q, k, v, causal=True, window=(W - 1, 0)), clock_c),
            "flex_attention", timed(run_flex, clock_t))
        add(f"window {W}", "backward", timed(backward(q, k, v, do, causal=True, window=(W - 1, 0)), clock_c),
            "flex_attention", timed(torch_backward(run_flex, tq, tk, tv), clock_t))
        for t in (tq, tk, tv):
            t.requires_grad_(False)
    c = args.softcap
    gate({"softcap": c / 10}, False)
    torch._dynamo.reset()

    def cap(score, b, h, qi, ki):
        return c * torch.tanh(score / c)

    run_cap = lambda: flex(tq, tk, tv, score_mod=cap, scale=scale)  # noqa: E731
    add(f"softcap {c:g}", "forward", timed(forward(q, k, v, causal=False, softcap=c), clock_c), "flex_attention",
        timed(run_cap, clock_t))
    add(f"softcap {c:g}", "backward", timed(backward(q, k, v, do, causal=False, softcap=c), clock_c),
        "flex_attention", timed(torch_backward(run_cap, tq, tk, tv), clock_t))
    del q, k, v, do

    # a packed batch of 8 causal sequences against the same sequences padded to the longest
    lens = [N // 4, N // 8, N // 16, N // 32, 3 * N // 16, 5 * N // 32, N // 8, N // 16]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # checked by the gpu tests, not gated here
    qp, kp, vp, dop = (x[0].swapaxes(0, 1).copy() for x in inputs(1, H, H, int(cu[-1]), grad=True))
    qpad, kpad, vpad, dopad = inputs(len(lens), H, H, max(lens), grad=True)
    o, lse = flash_v3.forward_varlen(qp, kp, vp, cu, cu, causal=True, scale=scale)
    name = f"varlen {len(lens)}"
    add(name, "forward", timed(lambda: flash_v3.forward_varlen(qp, kp, vp, cu, cu, causal=True, scale=scale)[0],
                               clock_c), "padded", timed(forward(qpad, kpad, vpad, causal=True), clock_c))
    add(name, "backward", timed(lambda: flash_v3_backward.backward_varlen(qp, kp, vp, o, lse, dop, cu, cu, causal=True,
                                                                           scale=scale), clock_c),
        "padded", timed(backward(qpad, kpad, vpad, dopad, causal=True), clock_c))

    os.makedirs(args.out, exist_ok=True)
    tag = (re.search(r"[A-Z]\d{2,4}", gpu_name()) or re.search(r"\w+", gpu_name())).group(0).lower()
    bench.write_rows(os.path.join(args.out, f"bench_variants_hopper_{tag}.csv"), list(rows[0]), rows)


if __name__ == "__main__":
    main()
