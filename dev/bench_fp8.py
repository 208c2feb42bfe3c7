"""Version fp8 of stage 06's forward beside the 16-bit pingpong and cuDNN (bf16, d = 128, B N = 16384, H = 16): end to
end, its attention kernel alone and its pre-pass alone, the implementations taking turns 3 times.

    python dev/bench_fp8.py OUT.csv
"""
import csv
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import bench  # noqa: E402


def main(out):
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stages.common import bfloat16, kernels, make_inputs
    from stages.hopper import flash_v3, fp8

    rows = []
    for N in (2048, 4096, 8192, 16384):
        for causal in (False, True):
            B, H = max(1, 16384 // N), 16
            q, k, v = make_inputs(B, H, N, N, 128, dtype=bfloat16, xp=cupy)
            tq, tk, tv = (bench._to_torch(x, torch) for x in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            amax_l, scale_qk, scale_vt, attention = fp8._plan(np.dtype(q.dtype), q.shape, N, causal,
                                                              1 / np.sqrt(128))
            amax = cupy.zeros((B * H, 3), cupy.float32)
            q8, k8 = cupy.empty(q.shape, cupy.uint8), cupy.empty(k.shape, cupy.uint8)
            vt8 = cupy.empty((B, H, 128, fp8.row_keys(N)), cupy.uint8)

            def prepass():
                amax.fill(0)
                amax_l(q, k, v, amax)
                scale_qk(q, k, amax, q8, k8)
                scale_vt(v, amax, vt8)

            prepass()
            fns = {"fp8": lambda: flash_v3.forward(q, k, v, causal=causal, version="fp8"),
                   "fp8_kernel": lambda: kernels.run_forward(attention, q8, k8, vt8, np.dtype(q.dtype), amax),
                   "fp8_prepass": prepass,
                   "bf16": lambda: flash_v3.forward(q, k, v, causal=causal), "cudnn": cudnn}
            t = bench.take_turns_us(fns, 3, 10, torch)
            flops = 4 * B * H * N * N * 128 * (0.5 if causal else 1)
            row = {"N": N, "causal": causal, **{f"{n}_us": round(u, 1) for n, u in t.items()},
                   **{f"{n}_tflops": round(flops / u / 1e6, 1) for n, u in t.items() if n != "fp8_prepass"}}
            print(row, flush=True)
            rows.append(row)
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1])
