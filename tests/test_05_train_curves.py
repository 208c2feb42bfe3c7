"""Stage 05: the same loss curve whichever kernel computes attention, in whichever dtype, on however many ranks.

CPU: the loss curves of naive, flash_v1 and flash_v2 attention agree (float32), and a kernel with a 10% error in dQ
moves the curve far outside that tolerance; with grouped-query heads too (flash_v1, flash_v2 and the ring against
naive); mixed precision (bfloat16 activations) follows the float32 curve; the
ring run in one process (2 and 4 simulated ranks, both layouts) and under `mpirun -n 2` (both layouts) gives the
single-device curve; the gradient sum over the ranks goes through the communicator's allreduce_sum once a step and
leaves every rank's parameters bit-identical; the ring's block choice (flash where stages 02/03 take the head dim
and dtype, else naive with the reason in the header; an explicit flash that cannot run is a clear error).
gpu: the float32 curves on CuPy against numpy, the bfloat16 curves of the three kernels by the tolerance rule, the
ring on one GPU (4 ranks, mpi backend, both layouts), the ring on 2 GPUs (nccl: every rank's parameters
bit-identical, float32 and bfloat16); on an sm_90 GPU the grouped-query GPT through stage 06 (flash_v2 and the ring).
"""
import importlib
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from stages import train_gpt as T
from stages.common.mpirun import mpi_env, mpirun_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ROOT / "stages" / "05_train_gpt" / "train.py"
SEED = 1234

T.single_thread_blas()  # tiny matrices: one BLAS thread is faster, and far faster on a loaded 2-core machine
T.reuse_freed_memory()  # each training step reuses the last one's memory instead of faulting in fresh pages


# ---------------------------------------------------------------- same curve across stages

CURVE = dict(context=32, n_layer=2, d_model=64, n_head=2)  # head dim 32: every stage's fp32 kernels take it
CURVE_STEPS, CURVE_BATCH = 12, 8
CURVE_TOL = 1e-5  # float32 curves of two correct kernels differ by rounding only (~1e-7 on a loss of ~4)


def _curve(attention, steps=CURVE_STEPS, dtype="float32", xp=np, n_kv_head=None, **kw):
    data = T.RecallTask(CURVE["context"], n_values=8, seed=SEED)
    cfg = T.GPTConfig(vocab_size=data.vocab_size, n_kv_head=n_kv_head, **CURVE)
    return np.array(T.train(cfg, data, attention=attention, steps=steps, batch=CURVE_BATCH, lr=3e-3, seed=SEED,
                            dtype=dtype, xp=xp, **kw)["loss"])


@pytest.fixture(scope="module")
def naive_curve():
    return _curve("naive")


@pytest.mark.parametrize("attention", ["flash_v1", "flash_v2"])
def test_loss_curve_equals_naive(attention, naive_curve):
    curve = _curve(attention)
    diff = np.max(np.abs(curve - naive_curve))
    assert diff < CURVE_TOL, f"{attention} vs naive: max loss difference {diff:.2e}, {CURVE_STEPS} steps (seed {SEED})"
    assert naive_curve[-1] < naive_curve[0], "the loss must fall over the run"


def test_a_wrong_attention_gives_another_curve(naive_curve, monkeypatch):
    """The curve comparison can fail: a kernel off by a little in dQ changes the curve far beyond the tolerance."""
    from stages.train_gpt import attention as A

    ok = A.StageAttention.backward
    monkeypatch.setattr(A.StageAttention, "backward", lambda self, *a: (lambda g: (0.9 * g[0], g[1], g[2]))(
        ok(self, *a)))
    diff = np.max(np.abs(_curve("naive") - naive_curve))
    assert diff > 10 * CURVE_TOL, f"a broken dQ went unnoticed (max difference {diff:.2e})"


@pytest.fixture(scope="module")
def multi_query_curve():
    return _curve("naive", n_kv_head=1)


@pytest.mark.parametrize("attention", ["flash_v1", "flash_v2", "ring"])
def test_grouped_query_curve_equals_naive(attention, multi_query_curve, naive_curve):
    """Grouped-query heads (here multi-query: both query heads read one k, v head): flash_v1 and flash_v2 (k, v
    repeated, the copies' gradients summed: attention.py) and the ring (2 simulated ranks, zigzag; k, v travel with
    their one head) train as naive does, which takes the shared head itself; and it is another model than the
    multi-head one."""
    from stages.ring import simulate

    if attention == "ring":
        curve = simulate(lambda ring: _curve("ring", n_kv_head=1, ring=ring, layout="zigzag"), 2)[0]
    else:
        curve = _curve(attention, n_kv_head=1)
    diff = np.max(np.abs(curve - multi_query_curve))
    assert diff < CURVE_TOL, f"{attention} vs naive, 1 k, v head: max loss difference {diff:.2e} (seed {SEED})"
    assert np.max(np.abs(multi_query_curve - naive_curve)) > 10 * CURVE_TOL, "1 k, v head trained as 2 heads do"


def test_bfloat16_activations_follow_the_float32_curve(naive_curve):
    curve = _curve("naive", dtype="bfloat16")
    diff = np.max(np.abs(curve - naive_curve))
    assert diff < 0.05, f"bf16 vs fp32: max loss difference {diff:.2e} (seed {SEED})"
    assert diff > 0, "bf16 activations gave the float32 curve bit for bit: no rounding happened"


# ---------------------------------------------------------------- sequence parallel: the ring


@pytest.mark.parametrize("P,layout", [(2, "contiguous"), (2, "zigzag"), (4, "zigzag"), (4, "contiguous")])
def test_ring_training_in_one_process_equals_single_device(P, layout, naive_curve):
    from stages.ring import simulate

    curves = simulate(lambda ring: _curve("ring", ring=ring, layout=layout), P)
    for r, c in enumerate(curves):
        assert (c == curves[0]).all(), f"rank {r} saw another loss than rank 0"
    diff = np.max(np.abs(curves[0] - naive_curve))
    assert diff < CURVE_TOL, f"ring ({P} ranks, {layout}) vs one device: max loss difference {diff:.2e} (seed {SEED})"


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_mpirun_two_ranks_ring_training_matches_one_device(layout, tmp_path):
    args = ["--steps", "12", "--batch", "8", "--context", "32", "--layers", "2", "--d-model", "64", "--heads", "2",
            "--n-values", "8", "--seed", str(SEED), "--device", "cpu", "--log-every", "4"]
    ring_csv, one_csv = tmp_path / "ring.csv", tmp_path / "one.csv"
    cmd = mpirun_command(2) + [sys.executable, str(TRAIN), "--attention", "ring", "--backend", "numpy",
                               "--layout", layout, "--csv", str(ring_csv), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ring: 2 ranks, backend numpy" in p.stdout
    assert T.train_main(["--attention", "naive", "--csv", str(one_csv), *args]) == 0
    ring_loss = np.loadtxt(ring_csv, delimiter=",", skiprows=1, usecols=1)
    one_loss = np.loadtxt(one_csv, delimiter=",", skiprows=1, usecols=1)
    assert len(ring_loss) == len(one_loss) == 12
    diff = np.max(np.abs(ring_loss - one_loss))
    assert diff < CURVE_TOL, f"mpirun ring ({layout}) vs one device: max loss difference {diff:.2e} (seed {SEED})"


class _CountingRing:
    """A communicator that counts its allreduce_sum calls (everything else goes to the wrapped ring)."""

    def __init__(self, ring):
        self.ring, self.sums = ring, 0

    def __getattr__(self, name):
        return getattr(self.ring, name)

    def allreduce_sum(self, arrays):
        self.sums += 1
        return self.ring.allreduce_sum(arrays)


def test_ring_gradient_sum_keeps_every_rank_identical():
    """Each rank's gradients are those of its own tokens; after the sum (the communicator's allreduce_sum, once a
    step) every rank holds the same bits, takes the same AdamW step, and its parameters stay bit-identical."""
    from stages.ring import simulate

    data = T.RecallTask(CURVE["context"], n_values=8, seed=SEED)
    cfg = T.GPTConfig(vocab_size=data.vocab_size, **CURVE)
    init = T.init_params(cfg, SEED)
    steps = 4

    def rank(ring):
        counting = _CountingRing(ring)
        hist = T.train(cfg, data, attention="ring", steps=steps, batch=4, lr=3e-3, seed=SEED, ring=counting)
        return hist, counting.sums

    (h0, sums0), (h1, sums1) = simulate(rank, 2)
    assert sums0 == sums1 == steps, f"allreduce_sum called {sums0}, {sums1} times in {steps} steps"
    assert h0["loss"] == h1["loss"] and h0["grad_norm"] == h1["grad_norm"]
    for name, p in h0["params"].items():
        assert np.array_equal(p, h1["params"][name]), f"{name} differs between the ranks after {steps} steps"
    moved = [n for n, p in h0["params"].items() if not np.array_equal(p, init[n])]
    assert len(moved) == len(init), f"parameters that did not move: {set(init) - set(moved)}"


RING_FALLBACK = ("ring blocks naive (stage 00): head dim 32 is not taken by stage 03 version tc, which takes 64, 128, "
                 "256")


def test_ring_blocks_choose_flash_only_where_stages_02_03_take_the_head_dim_and_dtype():
    from stages.common import bfloat16

    gpu = dict(gpu=True, sm80=True)
    assert T.ring_blocks(None, dtype=bfloat16, head_dim=128, **gpu) == (
        "flash", "flash (stage 02 version pipelined, stage 03 version tc)")
    assert T.ring_blocks(None, dtype=np.float32, head_dim=32, **gpu)[0] == "flash"  # fp32 / fp32 take 32
    # float32: "auto" runs the TF32 tensor-core versions on sm_80 and newer at their head dims, the CUDA-core ones
    # elsewhere (stage 02: fp32_overlap)
    assert T.ring_blocks(None, dtype=np.float32, head_dim=64, **gpu)[1] == (
        "flash (stage 02 version fp32x3, stage 03 version fp32x3)")
    assert T.ring_blocks(None, dtype=np.float32, head_dim=64, gpu=True, sm80=False)[1] == (
        "flash (stage 02 version fp32_overlap, stage 03 version fp32)")
    block, text = T.ring_blocks(None, dtype=bfloat16, head_dim=32, **gpu)
    assert (block, f"ring blocks {text}") == ("naive", RING_FALLBACK)
    block, text = T.ring_blocks(None, dtype=bfloat16, head_dim=64, gpu=True, sm80=False)  # a T4
    assert block == "naive" and "need an sm_80 or newer GPU" in text, text
    assert T.ring_blocks(None, dtype=np.float16, head_dim=64, gpu=True, sm80=False)[0] == "flash"  # a T4's fp16
    block, text = T.ring_blocks(None, dtype=np.float64, head_dim=64, **gpu)
    assert block == "naive" and "dtype float64 is not taken" in text, text
    assert T.ring_blocks(None, dtype=bfloat16, head_dim=128, gpu=False)[0] == "naive"  # the CPU default
    assert T.ring_blocks("naive", dtype=bfloat16, head_dim=128, **gpu)[0] == "naive"
    assert T.ring_blocks("flash", dtype=bfloat16, head_dim=64, gpu=False)[0] == "flash"  # the tile mirrors
    with pytest.raises(ValueError, match="--ring-block flash cannot run here: head dim 32 is not taken by stage 03 "
                                         "version tc, which takes 64, 128, 256; use --ring-block naive"):
        T.ring_blocks("flash", dtype=bfloat16, head_dim=32, **gpu)
    with pytest.raises(ValueError, match="sm_80"):
        T.ring_blocks("flash", dtype=bfloat16, head_dim=64, gpu=True, sm80=False)
    # grouped-query k, v: on the GPU the flash blocks take them in 16 bits (stage 02 pipelined), the mirrors in any
    block, text = T.ring_blocks(None, dtype=np.float32, head_dim=64, grouped=True, **gpu)
    assert block == "naive" and "grouped-query k, v (--kv-heads) run on the GPU in stage 02 version pipelined" in text
    assert T.ring_blocks(None, dtype=bfloat16, head_dim=64, grouped=True, **gpu)[0] == "flash"
    assert T.ring_blocks("flash", dtype=np.float32, head_dim=64, grouped=True, gpu=False)[0] == "flash"
    with pytest.raises(ValueError, match="grouped-query .* use --ring-block naive .*, or --dtype bfloat16"):
        T.ring_blocks("flash", dtype=np.float32, head_dim=64, grouped=True, **gpu)


def test_ring_fallback_is_said_in_the_header_and_explicit_flash_is_a_clear_error(monkeypatch, capsys):
    """The run as a GPU would see it (the device facts say GPU; the arrays stay numpy): bf16 at head dim 32 falls back
    to naive blocks and the header says why; --ring-block flash stops before any step, with a message."""
    train_module = importlib.import_module("stages.train_gpt.command")  # the command line (train.py is the program)

    monkeypatch.setattr(train_module, "device_facts", lambda xp: {"gpu": True, "sm80": True})
    args = ["--attention", "ring", "--simulate-ranks", "2", "--dtype", "bfloat16", "--context", "32", "--layers", "1",
            "--d-model", "64", "--heads", "2", "--batch", "4", "--steps", "2"]  # head dim 32
    assert T.train_main(args) == 0
    assert RING_FALLBACK in capsys.readouterr().out
    assert T.train_main(args + ["--ring-block", "flash"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: --ring-block flash cannot run here: head dim 32") and "Traceback" not in err


def test_ring_attention_needs_a_communicator():
    with pytest.raises(ValueError, match="needs a communicator"):
        _curve("ring", steps=1)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["naive", "flash_v1", "flash_v2"])
def test_gpu_float32_curve_equals_cpu(attention, naive_curve):
    import cupy

    curve = _curve(attention, xp=cupy)
    diff = np.max(np.abs(curve - naive_curve))
    assert diff < 1e-3, f"{attention} on the GPU (fp32) vs numpy naive: max loss difference {diff:.2e}"


GPU_BF16 = dict(context=256, n_layer=2, d_model=128, n_head=2)  # head dim 64: the tensor-core kernels take it


@pytest.mark.gpu
def test_gpu_bfloat16_curves_agree_across_stages():
    import cupy

    data = T.RecallTask(GPU_BF16["context"], n_values=16, seed=SEED)
    cfg = T.GPTConfig(vocab_size=data.vocab_size, **GPU_BF16)
    curves = {a: np.array(T.train(cfg, data, attention=a, steps=30, batch=16, lr=3e-3, seed=SEED, dtype="bfloat16",
                                  xp=cupy)["loss"]) for a in ("naive", "flash_v1", "flash_v2")}
    fp32 = np.array(T.train(cfg, data, attention="naive", steps=30, batch=16, lr=3e-3, seed=SEED, dtype="float32",
                            xp=cupy)["loss"])
    # the tolerance rule, applied to curves: what bf16 costs naive attention's curve, times 2, plus a slack
    yardstick = np.max(np.abs(curves["naive"] - fp32))
    for a in ("flash_v1", "flash_v2"):
        diff = np.max(np.abs(curves[a] - fp32))
        assert diff <= 2 * yardstick + 1e-2, (f"{a} in bf16 vs naive in fp32: max loss difference {diff:.3f}; naive in "
                                              f"bf16 is off by {yardstick:.3f} (seed {SEED})")
    assert fp32[-1] < fp32[0]


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_gpu_mpirun_ring_training_on_one_gpu_matches(layout, tmp_path):
    args = ["--steps", "20", "--batch", "8", "--context", "256", "--layers", "2", "--d-model", "128", "--heads", "2",
            "--seed", str(SEED), "--device", "gpu", "--dtype", "float32", "--log-every", "5"]
    ring_csv, one_csv = tmp_path / "ring.csv", tmp_path / "one.csv"
    cmd = mpirun_command(4) + [sys.executable, str(TRAIN), "--attention", "ring", "--backend", "mpi",
                               "--layout", layout, "--csv", str(ring_csv), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    p1 = subprocess.run([sys.executable, str(TRAIN), "--attention", "flash_v2", "--csv", str(one_csv), *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p1.returncode == 0, p1.stdout + p1.stderr
    ring_loss = np.loadtxt(ring_csv, delimiter=",", skiprows=1, usecols=1)
    one_loss = np.loadtxt(one_csv, delimiter=",", skiprows=1, usecols=1)
    diff = np.max(np.abs(ring_loss - one_loss))
    assert diff < 1e-3, f"ring (4 ranks, one GPU, {layout}) vs one device: max loss difference {diff:.2e}"


NCCL_RANKS_SAME = r"""
import hashlib, sys
import cupy
from stages import train_gpt as T
from stages.ring import comm
ring, backend, _ = comm.setup("nccl")
data = T.RecallTask(256, n_values=16, seed=1)
cfg = T.GPTConfig(vocab_size=data.vocab_size, context=256, n_layer=2, d_model=128, n_head=2)  # head dim 64
hist = T.train(cfg, data, attention="ring", steps=6, batch=4, dtype=sys.argv[1], xp=cupy, ring=ring)
digest = hashlib.sha256(b"".join(cupy.asnumpy(p).tobytes() for p in hist["params"].values())).hexdigest()
every = ring.allgather(digest)
if ring.rank == 0:
    print("SAME" if len(set(every)) == 1 else f"DIFFERENT {every}", hist["loss"][-1], flush=True)
"""


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_nccl_ring_training_keeps_every_rank_identical(dtype):
    """Two GPUs, one rank each: the gradients summed by the NCCL all-reduce leave every rank's parameters bit-identical
    (bfloat16: the flash blocks run in the ring)."""
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs (the nccl backend: one GPU per rank)")
    cmd = mpirun_command(2) + [sys.executable, "-c", NCCL_RANKS_SAME, dtype]
    p = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "SAME" in p.stdout, p.stdout + p.stderr


GPU_GQA = dict(context=256, n_layer=2, d_model=256, n_head=4, n_kv_head=2)  # head dim 64, 2 query heads a k, v head


@pytest.mark.gpu
def test_gpu_grouped_query_gpt_trains_on_stage_06_on_hopper(monkeypatch):
    """On an sm_90 GPU, once a program imported stage 06 (here the test), the GPT with grouped-query heads trains in
    bfloat16 through stage 06's registered kernels: flash_v2 attention runs their forward and backward, and the ring
    (2 simulated ranks, flash blocks) their merge_into and accumulate_into, each handed k, v of 2 heads. Both curves
    are held to naive's float32 curve by the rule of test_gpu_bfloat16_curves_agree_across_stages."""
    import cupy

    import stages.hopper  # noqa: F401  the program's part: stage 06 registers its kernels
    from stages.common import attention_registry, device
    from stages.hopper import flash_v3, sm90a
    from stages.ring import simulate

    try:
        sm90a.require_hopper()
    except device.UnsupportedDevice as e:
        pytest.skip(f"not an sm_90 GPU: {e}")
    kernels = next(k for k in attention_registry.registered() if k.forward is flash_v3.forward)
    calls = {}

    def spied(name, real):
        def call(q, k, *a, **kw):
            calls.setdefault(name, set()).add((q.shape[1], k.shape[1]))
            return real(q, k, *a, **kw)
        return call

    names = ("forward", "backward", "merge_into", "accumulate_into")
    monkeypatch.setitem(attention_registry._REGISTERED, kernels.name,
                        kernels._replace(**{n: spied(n, getattr(kernels, n)) for n in names}))
    data = T.RecallTask(GPU_GQA["context"], n_values=16, seed=SEED)
    cfg = T.GPTConfig(vocab_size=data.vocab_size, **GPU_GQA)
    run = dict(steps=30, batch=16, lr=3e-3, seed=SEED, xp=cupy)
    curves = {a: np.array(T.train(cfg, data, attention=a, dtype="bfloat16", **run)["loss"])
              for a in ("naive", "flash_v2")}
    assert calls == {"forward": {(4, 2)}, "backward": {(4, 2)}}, calls
    curves["ring"] = np.array(simulate(lambda ring: T.train(cfg, data, attention="ring", dtype="bfloat16", ring=ring,
                                                            ring_block="flash", **run)["loss"], 2)[0])
    assert calls["merge_into"] == calls["accumulate_into"] == {(4, 2)}, calls
    fp32 = np.array(T.train(cfg, data, attention="naive", dtype="float32", **run)["loss"])
    yardstick = np.max(np.abs(curves["naive"] - fp32))  # what bf16 costs naive attention's curve
    for a in ("flash_v2", "ring"):
        diff = np.max(np.abs(curves[a] - fp32))
        assert diff <= 2 * yardstick + 1e-2, (f"{a} (stage 06) in bf16 vs naive in fp32: max loss difference "
                                              f"{diff:.3f}; naive in bf16 is off by {yardstick:.3f} (seed {SEED})")
    assert fp32[-1] < fp32[0]
