"""Stage 04 under mpirun: run.py (the mission's command) and dev/bench_ring.py as a learner starts them.

mpi: `mpirun -n 2` and `-n 4` of run.py on the numpy backend (both layouts, causal and not, lengths that need
padding, bf16 with stage 02/03 blocks, --backend auto), the two faults (ranks that disagree; an error on one rank:
nonzero exit within seconds, with a timeout so that a hang fails instead of blocking CI), dev/bench_ring.py's CPU
smoke run, run.py's block choice. gpu: run.py with 4 ranks on one GPU (mpi backend); the NCCL ring's transfers on
one GPU (a rank sending to itself); with two and four GPUs, run.py on the nccl backend (skipped with the reason
otherwise).
"""
import csv
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from stages import ring
from stages.common import bfloat16
from stages.common.mpirun import mpi_env, mpirun_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / "stages" / "04_ring" / "run.py"


# ---------------------------------------------------------------- mpirun


FAULT_SECONDS = 30  # a fault must end the job within this (start-up included); a hang hits the 60 s timeout


def _launch(n, *args, timeout=60):
    env = mpi_env()
    cmd = mpirun_command(n) + [sys.executable, str(RUN), *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun hung for {timeout} s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")
    _launch.seconds = time.monotonic() - t0
    return p.returncode, p.stdout + p.stderr


def test_mpi_env_puts_this_checkout_first_on_the_ranks_path(monkeypatch):
    """The ranks import the `stages` of this checkout (the one the tests import), installed or not; an existing
    PYTHONPATH stays after it."""
    import stages

    root = str(pathlib.Path(stages.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", ""]))
    assert mpi_env()["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
    monkeypatch.delenv("PYTHONPATH")
    assert mpi_env()["PYTHONPATH"] == root
    assert mpi_env(PYTHONPATH="/only")["PYTHONPATH"] == "/only"  # an explicit value still wins


MPI_RUNS = [  # (ranks, layout, causal, total length): both layouts, both masks, lengths that need padding
    (2, "contiguous", False, 101),
    (2, "zigzag", True, 99),
    (4, "zigzag", True, 257),
    (4, "contiguous", False, 130),
]


@pytest.mark.mpi
@pytest.mark.parametrize("n,layout,causal,seq", MPI_RUNS,
                         ids=[f"n{n}-{lay}-{'causal' if c else 'full'}-N{s}" for n, lay, c, s in MPI_RUNS])
def test_mpirun_numpy_backend(n, layout, causal, seq):
    extra = [] if causal else ["--no-causal"]
    rc, out = _launch(n, "--quick", "--backend", "numpy", "--layout", layout, "--check-seq", str(seq),
                      "--seq", "64", *extra)
    assert rc == 0, out
    assert f"check on the full sequence (N={seq})" in out, out
    assert "backend numpy -> numpy" in out and "All results match" in out
    assert out.rstrip().splitlines()[-1].startswith(f"SUMMARY 04_ring PASS {n} ranks numpy"), out


@pytest.mark.mpi
def test_mpirun_bfloat16_with_stage_02_03_blocks():
    """bf16 shards moved as raw bytes by MPI, blocks computed by the stage 02/03 calls (their tile mirrors)."""
    rc, out = _launch(2, "--quick", "--backend", "numpy", "--block", "flash", "--dtype", "bfloat16",
                      "--check-seq", "301", "--seq", "64")
    assert rc == 0, out
    assert "blocks flash (stage 02 version pipelined, stage 03 version tc)" in out, out
    assert "SUMMARY 04_ring PASS 2 ranks numpy" in out, out


@pytest.mark.mpi
def test_mpirun_with_grouped_query_window_and_softcap():
    """MPI point-to-point with the window's skipped steps (a hop of two ranks, and the dK, dV hop home): 4 ranks,
    zigzag, N = 256 (shards of 64), window (30, -1): steps 0, 1 and 3 have work. One k, v head for 4 query heads."""
    rc, out = _launch(4, "--quick", "--backend", "numpy", "--heads", "4", "--kv-heads", "1", "--window", "30", "-1",
                      "--softcap", "20", "--check-seq", "256", "--seq", "256")
    assert rc == 0, out
    assert "steps with work [0, 1, 3] of 4" in out and "All results match" in out, out
    assert "SUMMARY 04_ring PASS 4 ranks numpy" in out, out


@pytest.mark.mpi
def test_mpirun_auto_backend_says_what_it_picked():
    rc, out = _launch(2, "--quick", "--check-seq", "64", "--seq", "64")
    assert rc == 0, out
    assert "backend auto -> " in out and "SUMMARY 04_ring PASS 2 ranks" in out, out


# Fault injection: run.py itself, under mpirun, with one rank's ring patched before run.py starts (run.py has
# no fault options). argv: fault ("mismatch" or "error"), the faulty rank, then run.py's own options.
FAULT_RUN = """
import runpy, sys
from stages import ring
from stages.ring import comm
fault, bad, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if comm.world().Get_rank() == bad:
    if fault == "mismatch":  # this rank calls the ring with the other mask: the ranks disagree
        from stages.ring import verify_ring  # where run.py's check calls the ring
        ring_forward = verify_ring.ring_forward
        verify_ring.ring_forward = lambda *a, **kw: ring_forward(*a, **dict(kw, causal=not kw["causal"]))
    else:  # this rank's second block call raises, mid-ring, while the others wait on it
        fwd, bwd = ring.BLOCKS["naive"]
        calls = []
        def failing(*a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure on this rank")
            return fwd(*a, **kw)
        ring.BLOCKS["naive"] = (failing, bwd)
sys.argv = [run] + sys.argv[4:]
runpy.run_path(run, run_name="__main__")
"""


def _launch_fault(n, fault, bad, *args, timeout=60):
    cmd = mpirun_command(n) + [sys.executable, "-c", FAULT_RUN, fault, str(bad), str(RUN), *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun hung for {timeout} s: {fault} on rank {bad}\n{e.stdout}\n{e.stderr}")
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


@pytest.mark.mpi
def test_mpirun_ranks_that_disagree_get_an_error_each():
    rc, out, seconds = _launch_fault(2, "mismatch", 1, "--quick", "--backend", "numpy")
    assert rc != 0
    assert seconds < FAULT_SECONDS, f"the job took {seconds:.0f} s to end"
    for r in range(2):
        assert f"[rank {r}] ERROR: RingMismatch: ring attention: ranks [1] disagree with rank 0" in out, out
    assert "SUMMARY" not in out


@pytest.mark.mpi
def test_mpirun_error_on_one_rank_aborts_the_job():
    rc, out, seconds = _launch_fault(4, "error", 2, "--quick", "--backend", "numpy", "--block", "naive")
    assert rc != 0
    assert seconds < FAULT_SECONDS, f"the job took {seconds:.0f} s to end"
    assert "[rank 2] ERROR: RuntimeError: injected failure" in out, out
    assert "SUMMARY" not in out


@pytest.mark.mpi
def test_bench_ring_runs_on_the_cpu_and_writes_its_csv(tmp_path):
    """dev/bench_ring.py is for GPUs; its numpy backend runs the same code on the CPU, so it cannot rot unseen."""
    out = tmp_path / "ring_cpu.csv"
    cmd = mpirun_command(2) + [sys.executable, str(ROOT / "dev" / "bench_ring.py"), "--backend", "numpy",
                               "--configs", "8k-causal", "8k-causal-gqa", "8k-full", "--tokens", "32", "--heads", "2",
                               "--head-dim", "16", "--repeat", "1", "--out", str(out)]
    env = mpi_env()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["gpus"]) for r in rows] == [1, 1, 1, 2, 2, 2]  # rings of 1 and 2 ranks, 3 configs each
    assert [r["config"] for r in rows[:3]] == ["8k-causal", "8k-causal-gqa", "8k-full"]
    for r in rows:
        assert float(r["ring_fwd_ms"]) > 0 and float(r["one_gpu_bwd_ms"]) > 0 and float(r["peak_mb_per_gpu"]) > 0
        assert 0 < float(r["efficiency"]) and r["torch_cp_flash_fwd_ms"] == ""  # no PyTorch CP on the CPU
        assert r["gpu"] == "CPU" and r["backend"] == "numpy"


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_gpu_mpirun_mpi_backend_four_ranks_one_gpu(layout, causal):
    extra = [] if causal else ["--no-causal"]
    rc, out = _launch(4, "--quick", "--backend", "mpi", "--layout", layout, "--check-seq", "1001", "--seq", "2048",
                      *extra, timeout=240)
    assert rc == 0, out
    # the blocks ran stage 02 (stage 06 on an sm_90 GPU) and stage 03
    assert "blocks flash (stage 02 version" in out or "blocks flash (stage 06 (FlashAttention-3" in out, out
    assert "SUMMARY 04_ring PASS 4 ranks mpi" in out, out
    import cupy

    gpus = min(4, cupy.cuda.runtime.getDeviceCount())  # local rank % the GPUs this node has
    assert f"the 4 ranks share {'one GPU' if gpus == 1 else f'{gpus} GPUs'} here" in out, out


def test_gpus_in_use_counts_distinct_gpus_over_every_node(monkeypatch):
    """comm.gpus_in_use: ranks on one GPU count once; the same bus id on two hosts is two GPUs; a rank that sees only
    its own GPU (CUDA_VISIBLE_DEVICES per rank: index 0 everywhere) is counted by its bus id, not its index."""
    from stages.ring import launch

    class Fake:  # the ranks' facts, as allgather would gather them
        def __init__(self, facts):
            self.facts = facts

        def allgather(self, mine):
            return self.facts

    def gpus(facts):
        monkeypatch.setattr(launch, "_host_name", lambda: facts[0][0])
        monkeypatch.setattr(launch, "_my_gpu", lambda lrank: (0, facts[0][1]))
        monkeypatch.setattr(launch, "local_rank", lambda c: (0, len(facts)))
        return launch.gpus_in_use(Fake(facts))

    assert gpus([("a", "0000:01"), ("a", "0000:01"), ("a", "0000:01"), ("a", "0000:01")]) == 1
    assert gpus([("a", "0000:01"), ("a", "0000:02"), ("a", "0000:01"), ("a", "0000:02")]) == 2
    assert gpus([("a", "0000:01"), ("a", "0000:02"), ("b", "0000:01"), ("b", "0000:02")]) == 4
    assert gpus([("a", f"0000:0{i}") for i in range(4)]) == 4


@pytest.mark.gpu
@pytest.mark.mpi
def test_gpu_mpirun_mpi_backend_with_grouped_query_and_window():
    """The mpi backend (CuPy staged through the host) with hops of more than one rank: 4 ranks on one GPU. The blocks
    are stage 02/03's tensor-core versions, which take the grouped-query heads and the window: in bfloat16 on sm_80
    and newer, in float16 (the default there) on a T4."""
    from stages.common import device

    rc, out = _launch(4, "--quick", "--backend", "mpi", "--heads", "8", "--kv-heads", "2", "--window", "300", "-1",
                      "--check-seq", "2048", "--seq", "8192", timeout=240)
    assert rc == 0, out
    assert "steps with work [0, 1, 3] of 4" in out, out
    assert "blocks flash (stage 02 version pipelined, stage 03 version tc)" in out, out
    assert f"causal=True, {'bfloat16' if device.device().arch.bf16 else 'float16'}," in out, out
    assert "SUMMARY 04_ring PASS 4 ranks mpi" in out, out


NCCL_SELF_TEST = """
import sys; sys.path.insert(0, ".")
import cupy, numpy as np
from stages.common import bfloat16, cast
from stages.ring import comm
ring, backend, why = comm.setup("nccl")
ring.MIN_CHUNK = 4096  # several chunks through the staging buffer, as a large block takes
x = cast(cupy.random.default_rng().standard_normal((2, 3, 100, 64), dtype=np.float32), bfloat16)
buf = x.reshape(-1).view(cupy.uint8)
before = buf.copy()
h = ring.rotate(buf, shift=1)  # one rank: its bytes go to itself and come back, chunk by chunk
ring.wait(h)
assert bool((buf == before).all()), "NCCL rotation changed the bytes"
total = ring.allreduce_sum([cupy.arange(5, dtype=np.float32)])[0]
assert bool((total == cupy.arange(5, dtype=np.float32)).all()), "NCCL all-reduce of one rank changed the values"
print("NCCL self transfer OK", backend, why)
"""


@pytest.mark.gpu
@pytest.mark.mpi
def test_gpu_nccl_ring_transfers_on_one_gpu():
    """The nccl backend's own code (NCCL id over MPI, grouped send/recv on its stream, the staging buffer, events) on
    ONE GPU: the one rank's ring rotates a buffer to itself. (Two ranks need two GPUs: NCCL refuses two ranks on one
    GPU.)"""
    env = mpi_env()
    p = subprocess.run(mpirun_command(1) + [sys.executable, "-c", NCCL_SELF_TEST], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "NCCL self transfer OK nccl" in p.stdout, p.stdout + p.stderr


def _gpu_count():
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_gpu_mpirun_nccl_backend_two_gpus(layout, causal, dtype):
    if _gpu_count() < 2:
        pytest.skip(f"the nccl backend needs 2 GPUs (one per rank); this machine has {_gpu_count()}")
    extra = [] if causal else ["--no-causal"]
    rc, out = _launch(2, "--quick", "--backend", "nccl", "--layout", layout, "--dtype", dtype, "--check-seq",
                      "1001", "--seq", "8192", *extra, timeout=240)
    assert rc == 0, out
    assert "blocks flash (stage 02 version" in out or "blocks flash (stage 06 (FlashAttention-3" in out, out
    assert "SUMMARY 04_ring PASS 2 ranks nccl" in out, out


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("extra", [[], ["--no-causal", "--layout", "contiguous"],
                                   ["--heads", "8", "--kv-heads", "2", "--window", "700", "-1", "--softcap", "30"],
                                   ["--alibi", "--dropout", "0.1", "--check-seq", "1024"]],
                         ids=["zigzag-causal", "contiguous-full", "gqa-window-softcap", "alibi-dropout"])
def test_gpu_mpirun_nccl_backend_four_gpus(extra):
    """Four GPUs, one rank each: the halves travel over NCCL (in place, through the staging buffer) while the kernels
    add into the accumulators; with the variants too. Checked against the fp64 oracle on the full sequence."""
    if _gpu_count() < 4:
        pytest.skip(f"needs 4 GPUs (one per rank); this machine has {_gpu_count()}")
    rc, out = _launch(4, "--quick", "--backend", "nccl", "--check-seq", "1001", *extra, timeout=300)
    assert rc == 0, out
    from stages.common import bfloat16
    from stages.hopper import flash_v3

    plain = extra[:1] not in (["--heads"], ["--alibi"])  # no variant: stage 06's blocks on an sm_90 GPU
    hopper = plain and flash_v3.takes(bfloat16, 128)
    fwd = "stage 06 (FlashAttention-3 on sm_90)" if hopper else "stage 02 version pipelined"
    bwd = "stage 06 (FlashAttention-3 on sm_90) backward" if hopper else "stage 03 version tc"
    assert f"blocks flash ({fwd}, {bwd})" in out, out
    assert "SUMMARY 04_ring PASS 4 ranks nccl" in out, out


def _run_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ring_run", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_run_py_blocks_where_the_flash_kernels_cannot_take_the_options():
    """run.py's block choice: on the GPU the flash kernels take --kv-heads/--window/--softcap in version pipelined
    (float16 / bfloat16) only, so with float32 (a T4's default) the default blocks are naive ones, with the reason, and
    an explicit --block flash is one clear error; without options, or on the CPU (mirrors), nothing changes."""
    from stages.ring import run_options as ro

    run = _run_module()
    plain, window = run.parse([]), run.parse(["--window", "300", "-1"])
    assert ro.blocks(plain, True, np.float32, False) == ("flash", "")
    assert ro.blocks(window, True, bfloat16, True) == ("flash", "")
    assert ro.blocks(window, False, np.float32, True) == ("naive", "")
    block, why = ro.blocks(window, True, np.float32, True)
    assert block == "naive" and "pipelined" in why and "float32" in why
    assert ro.versions("naive", np.float32, 64, window, True, True) == (None, None)
    assert ro.versions("flash", bfloat16, 64, window, True, True) == ("pipelined", "tc")
    assert ro.versions("flash", np.float32, 64, window, False, True) == ("fp32_overlap", "fp32")  # CPU: the mirrors
    explicit = run.parse(["--window", "300", "-1", "--block", "flash"])
    assert ro.blocks(explicit, True, np.float32, True) == ("flash", "")
    with pytest.raises(ro.Usage, match="--block naive"):
        ro.versions("flash", np.float32, 64, explicit, True, True)


# Each bad option of run.py is a usage error: one line naming the option and what it takes (the CPU's settings here;
# test_mpirun_a_bad_option_is_one_line_from_one_rank shows the exit under mpirun).
BAD_OPTIONS = [
    (["--window", "-5", "3"], 2, r"^--window -5 3: LEFT and RIGHT are key counts >= 0 .* or -1 for unbounded$"),
    (["--window", "3", "4"], 2, r"^--window 3 4: causal attention sees no key after the diagonal"),
    (["--dropout", "1.5"], 2, r"^--dropout 1.5: takes a probability in \[0, 1\)$"),
    (["--softcap", "0"], 2, r"^--softcap 0.0: takes a finite number > 0"),
    (["--kv-heads", "3", "--heads", "4"], 2, r"^--kv-heads 3: must divide --heads 4"),
    (["--block", "flash", "--dtype", "bfloat16", "--head-dim", "48"], 2,
     r"^--head-dim 48: the flash blocks take head dims 64, 128, 256 in bfloat16 \(stage 02 pipelined: 32, 64, 96, "
     r"128, 256; stage 03 tc: 64, 128, 256\)"),
    (["--fwd-version", "tc"], 2, r"^--fwd-version/--bwd-version choose stage 02/03 versions; .* add --block flash$"),
    (["--block", "flash", "--fwd-version", "nope"], 2, r"^--fwd-version nope with --dtype float32: .*unknown version"),
    (["--scheme", "alltoall", "--heads", "6"], 4,
     r"^--scheme alltoall gives each of the 4 ranks .* must divide --heads 6"),
    (["--scheme", "alltoall", "--dropout", "0.1", "--heads", "4"], 2, r"^--scheme alltoall with --dropout"),
]


@pytest.mark.parametrize("argv,P,match", BAD_OPTIONS, ids=[" ".join(a) for a, _, _ in BAD_OPTIONS])
def test_run_py_bad_options_are_one_line_usage_errors(argv, P, match):
    from stages.ring import run_options as ro

    run = _run_module()
    with pytest.raises(ro.Usage, match=match) as e:
        ro.settings(run.parse(["--quick", *argv]), P, gpu=False, dev="cpu", bf16=False, shared=True,
                    defaults=run.DEFAULTS)
    assert "\n" not in str(e.value)


def test_run_py_says_when_the_alltoall_changes_the_heads():
    """--scheme alltoall on 3 ranks with the default heads: H becomes a multiple of 3, and a note says so."""
    from stages.ring import run_options as ro

    run = _run_module()
    s = ro.settings(run.parse(["--quick", "--scheme", "alltoall"]), 3, gpu=False, dev="cpu", bf16=False, shared=True,
                    defaults=run.DEFAULTS)
    assert s.H == 3 and any("H = 3, not the default 2" in note for note in s.notes), s
    s = ro.settings(run.parse(["--quick", "--scheme", "alltoall", "--heads", "6"]), 3, gpu=False, dev="cpu",
                    bf16=False, shared=True, defaults=run.DEFAULTS)
    assert s.H == 6 and not s.notes


@pytest.mark.mpi
@pytest.mark.parametrize("argv,says", [
    (["--backend", "mpi"], "run.py: error: --backend mpi needs a CUDA GPU on every rank"),  # (on this CPU machine)
    (["--dropout", "1.5"], "run.py: error: --dropout 1.5: takes a probability in [0, 1)"),
    (["--layout", "striped"], "run.py: error: argument --layout: invalid choice: 'striped'"),
])
def test_mpirun_a_bad_option_is_one_line_from_one_rank(argv, says):
    from stages.common import has_gpu

    if argv[1] == "mpi" and has_gpu():
        pytest.skip("--backend mpi runs on a GPU machine; this case is the CPU machine's error")
    rc, out = _launch(2, "--quick", *argv)
    assert rc == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), out  # one line, from one rank


def test_run_py_times_one_device_with_the_forward_the_ring_blocks_use(monkeypatch):
    """Where the ring's forward blocks are the registered kernels (stage 06's on an sm_90 GPU), one device's forward,
    the efficiency's yardstick, is theirs too; otherwise, with an option they do not take, a stage 02 version named,
    or on numpy arrays, stage 02's. run.py and dev/bench_ring.py both time ring.one_device_forward. The call signature
    is the one run.py's _time uses."""
    from stages import flash_v2
    from stages.common import attention_registry

    run = _run_module()
    assert run._one_device("flash") == (ring.one_device_forward, ring.one_device_backward)
    seen = []
    monkeypatch.setattr(flash_v2, "forward", lambda q, k, v, **kw: seen.append(("02", kw)) or ("o", "lse"))

    class GpuArray:  # stands for a CuPy array (not numpy)
        shape, dtype = (1, 2, 8, 64), np.dtype(np.float16)

    takes = {"now": True}
    fake = attention_registry.AttentionKernels(
        name="a later stage (test)", takes=lambda *a, **kw: takes["now"],
        forward=lambda q, k, v, **kw: seen.append(("later", kw)) or ("o", "lse"), merge_into=None,
        takes_backward=lambda *a, **kw: False, backward=None, accumulate_into=None)
    monkeypatch.setattr(attention_registry, "_REGISTERED", {fake.name: fake})
    q, host = GpuArray(), np.zeros((1, 2, 8, 64), np.float16)
    R = ring
    for now in (True, False):
        takes["now"] = now
        assert R.one_device_forward(q, q, q, version="pipelined", causal=True) == ("o", "lse")
    takes["now"] = True
    R.one_device_forward(q, q, q, version="pipelined", causal=True, softcap=30.0)  # an option: stage 02
    R.one_device_forward(q, q, q, version="tc", causal=True)  # stage 02's tc named: stage 02
    R.one_device_forward(host, host, host, version="pipelined", causal=True)  # numpy: stage 02's mirrors
    assert seen == [("later", {"causal": True}), ("02", {"version": "pipelined", "causal": True}),
                    ("02", {"version": "pipelined", "causal": True, "softcap": 30.0}),
                    ("02", {"version": "tc", "causal": True}), ("02", {"version": "pipelined", "causal": True})]
    assert R.hopper_takes(np.float16, 64, H=2, Hkv=2, B=1) and not R.hopper_backward_takes(np.float16, 64, H=2,
                                                                                             Hkv=2, B=1)
