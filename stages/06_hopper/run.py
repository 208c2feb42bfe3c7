"""Stage 06, the part that runs anywhere: Hopper's shared-memory swizzle and schedules, shown and checked on the CPU.

1. The 128-byte swizzle: where each 16-byte chunk of 8 rows lands, and how many shared-memory passes reading one
   chunk of the 8 rows takes with and without it; then the passes of the ws backward's 8-byte dQ_i stores into its
   swizzled buffer, in the kernel's lane order and with every lane on one n-block (swizzle.dq_store_offsets).
2. The wgmma matrix descriptor of a K-major tile, and a check that every K step read through it returns the columns
   the copy engine wrote (swizzle.read_operand, for D = 64, 128, 256).
3. The mbarrier pipeline: the time of n tiles with 1 to 4 stages, beside the formula
   load + (n - 1) max(load, compute) + compute.
4. The consumer warpgroups: the tensor cores' busy fraction for one warpgroup, one with GEMM0 issued early, two that
   share the tensor cores, and two in ping-pong (times of one tile from the FlashAttention-3 paper's H100 rates).
5. The backward's tile order (backward_mirror): its gradients against stage 00's, and how many reductions into dQ
   each version's tiles make (wgmma: 64 keys x 64 rows; ws: 128 keys x 128 rows at D = 64, x 64 rows at D = 128).
6. Version fp8's key order (fp8.key_order): P packed lane by lane into the 8-bit A fragment, times V with its
   keys in that order, is P V.

    python stages/06_hopper/run.py
    python stages/06_hopper/run.py --quick      # the same (it takes a second); for the tutorial-wide runner
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout: `stages` imports with no install

import numpy as np

from stages.hopper import backward_mirror as M
from stages.hopper import flash_v3_backward, fp8
from stages.hopper import schedules as S
from stages.hopper import swizzle as L


def show_swizzle():
    print("1. the 128-byte swizzle: physical chunk of logical chunk c in row r (8 rows x 8 chunks of 16 bytes)")
    print("   r \\ c  " + " ".join(f"{c:2d}" for c in range(8)))
    for r in range(8):
        print(f"   {r:5d}  " + " ".join(f"{int(L.swizzle(r * 128 + c * 16)) % 128 // 16:2d}" for c in range(8)))
    ok = True
    for c in range(8):
        swz = L.wavefronts([L.swizzle(r * 128 + c * 16) for r in range(8)])
        plain = L.wavefronts([r * 128 + c * 16 for r in range(8)])
        ok &= swz == 1
    print(f"   one chunk of 8 rows: {swz} pass swizzled, {plain} passes in plain rows of 128 bytes")
    for spread in (True, False):  # the ws backward's float32 dQ_i stores, 8 bytes a lane, served 16 lanes at a time
        passes = max(L.wavefronts(L.dq_store_offsets(nb, spread=spread)[h:h + 16], access_bytes=8)
                     for nb in range(8) for h in (0, 16))
        ok &= passes == (1 if spread else 2)
        print(f"   dQ_i's stores into its swizzled fp32 buffer, half a warp: {passes} "
              f"{'pass' if passes == 1 else 'passes'} "
              + ("in the kernel's lane order (odd rows on n-block nb ^ 2)" if spread else "with every lane on nb"))
    return ok


def show_descriptor():
    base, rows = 2048, 64
    d = L.descriptor(base, sbo=1024)
    print(f"\n2. descriptor of a K-major {rows}-row tile at byte {base}, 128-byte swizzle: {d:#018x} = {L.decode(d)}")
    ok = True
    for D in (64, 128, 256):
        x = np.arange(rows * D, dtype=np.uint16).reshape(rows, D)
        smem = np.zeros(base + x.nbytes, np.uint8)
        smem[base:] = L.store_tile(x)
        for k in range(D // 16):
            panel, within = divmod(k * 32, 128)
            got = L.read_operand(smem, L.descriptor(base + panel * rows * 128 + within, sbo=1024), rows=rows)
            ok &= bool((got == x[:, 16 * k:16 * k + 16]).all())
        verdict = "match" if ok else "MISMATCH"
        print(f"   D = {D:3d}: {D // 16} K steps of 16 read back through the descriptor: {verdict}")
    return ok


def show_pipeline(n=8, t_load=3, t_compute=2):
    print(f"\n3. the pipeline, {n} tiles, load {t_load}, compute {t_compute} (ticks)")
    ok = True
    for stages in (1, 2, 3, 4):
        run = S.simulate_pipeline(n, stages, t_load, t_compute)
        want = n * (t_load + t_compute) if stages == 1 else t_load + (n - 1) * max(t_load, t_compute) + t_compute
        ok &= run.ticks == want
        line = "".join("L" if any(b <= t < e for *_, b, e in run.loads) else "." for t in range(run.ticks))
        comp = "".join("C" if any(b <= t < e for *_, b, e in run.computes) else "." for t in range(run.ticks))
        print(f"   stages {stages}: {run.ticks:3d} ticks (formula {want:3d})   copy {line}")
        print(f"   {'':29s}   math {comp}")
    return ok


def show_warpgroups(n=32):
    print(f"\n4. the tensor cores' busy fraction over {n} tiles per warpgroup")
    for D in (64, 128):
        g, s = S.tile_times(D)
        cells = []
        for policy in ("one", "overlap", "together", "pingpong"):
            _, _, busy = S.schedule_warpgroups(n, g, s, policy)
            cells.append(f"{policy} {busy:.2f}")
        print(f"   D = {D:3d} (softmax / one GEMM = {s / g:.2f}): " + ", ".join(cells))


def show_backward(B=1, H=2, Nq=200, Nk=333, D=64):
    from stages import naive
    from stages.common import make_inputs

    print(f"\n5. the backward's tile order, B={B} H={H} Nq={Nq} Nk={Nk} d={D}, float64, against stage 00")
    ok = True
    for causal in (False, True):
        q, k, v, do = make_inputs(B, H, Nq, Nk, D, dtype=np.float64, grad=True, seed=5)
        o, lse = naive.forward(q, k, v, causal=causal)
        want = naive.backward(q, k, v, o, lse, do, causal=causal)
        for version in flash_v3_backward.VERSIONS:
            if D not in flash_v3_backward.VERSION_HEAD_DIMS[version]:
                continue
            bc, br = flash_v3_backward.CONFIGS[version].bc, flash_v3_backward.q_tile_rows(version, D)
            what = f"{version}, {bc} keys x {br} rows:"
            got = M.backward(q, k, v, o, lse, do, causal=causal, bc=bc, br=br)
            err = max(float(np.abs(a - b).max()) for a, b in zip(got, want))
            ok &= err < 1e-10
            print(f"   causal={causal!s:5s} {what:26s} max |difference| {err:.1e}, "
                  f"{M.dq_reductions(Nq, Nk, causal, bc, br)} reductions into dQ per head")
    return ok


def show_fp8_key_order():
    print("\n6. version fp8: each lane packs its own P into the 8-bit A fragment, V^T's keys in that order")
    order = fp8.key_order(np.arange(16))
    print(f"   position -> key within each 16: {order.tolist()}")
    rng = np.random.default_rng(6)
    p, v = rng.random((16, 32)), rng.standard_normal((32, 8))  # one warp's 16 rows, one K step of 32 keys
    a = fp8.pack_a(p)  # lane t's keys at its positions 4 t .. 4 t + 3 and 16 + 4 t ..
    ok = np.allclose(a @ v[np.concatenate([order, 16 + order])], p @ v)
    print(f"   packed P times the reordered V == P V: {ok}")
    return bool(ok)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="accepted for the tutorial-wide runner (same work)")
    ap.parse_args(argv)
    ok = all([show_swizzle(), show_descriptor(), show_pipeline()])  # the checks; section 4 only shows
    show_warpgroups()
    ok = show_backward() and ok
    ok = show_fp8_key_order() and ok
    print(f"\nSUMMARY 06_hopper {'PASS' if ok else 'FAIL'} (CPU part: the swizzle, schedules, the backward's tile "
          "order, fp8's key order)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
