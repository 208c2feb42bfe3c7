"""Each stage's run.py runs its defaults on every GPU from sm_75 (T4) to sm_90 (H100): what the GPU lacks (bfloat16
and TF32 tensor cores before sm_80, shared memory for a head dim) is left out, with a line that says so, and the
stage still passes.

CPU: stage 02's and 03's run.py with a launcher that refuses bfloat16 and the fp32x3 versions as a T4 does
(device.UnsupportedDevice): the refused runs are skipped, said, left out of the timings and named in the SUMMARY line.
gpu: every stage's run.py --quick on this GPU and, under ATTN_ARCH, on each older architecture it can emulate
(stages.common.device: the older GPU's code, instructions and limits); the ring through ./scripts/mpirun (2 ranks on
this GPU, the mpi backend).
"""
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from stages.common import bfloat16, device

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(stage):
    spec = importlib.util.spec_from_file_location(f"run_{stage}", ROOT / "stages" / stage / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _as_on_a_t4(check):
    """check, refusing what a T4 lacks as the launchers do: bfloat16 inputs and the fp32x3 versions."""

    def refusing(fn, q, *args, version=None, **kwargs):
        if np.dtype(q.dtype) == bfloat16 or version == "fp32x3":
            raise device.UnsupportedDevice(f"version {version!r} ({np.dtype(q.dtype).name}) needs sm_80 or newer")
        return check(fn, q, *args, version=version, **kwargs)

    return refusing


def test_stage_02_skips_what_the_gpu_lacks_and_says_so(monkeypatch, capsys):
    run = _load("02_flash_v2")
    monkeypatch.setattr(run, "check_forward", _as_on_a_t4(run.check_forward))
    assert run.main(["--quick", "--device", "cpu"])
    out = capsys.readouterr().out
    skipped = [line.split()[:2] for line in out.splitlines() if "skipped, not on this GPU" in line]
    assert skipped == [["tc", "bf16:"], ["pipelined", "bf16:"], ["fp32x3", "fp32:"]], out
    timed = {tuple(line.split()[:2]) for line in out.split("timings on the")[1].splitlines() if "|" in line}
    assert timed == {("version", "dtype"), ("fp32", "fp32"), ("fp32_overlap", "fp32"), ("tc", "fp16"),
                     ("pipelined", "fp16")}
    assert "SUMMARY 02_flash_v2 PASS" in out and "not on this GPU: tc bf16, pipelined bf16, fp32x3 fp32" in out


def test_stage_03_skips_what_the_gpu_lacks_and_says_so(monkeypatch, capsys):
    run = _load("03_flash_v2_backward")
    monkeypatch.setattr(run, "check_backward", _as_on_a_t4(run.check_backward))
    assert run.main(["--quick", "--device", "cpu", "--seq", "64"])
    out = capsys.readouterr().out
    skipped = [line.split()[:2] for line in out.splitlines() if "skipped, not on this GPU" in line]
    assert skipped == [["tc", "bfloat16"], ["tc", "bfloat16"], ["fp32x3", "float32"]], out
    timed = [line.split()[:2] for line in out.split("timings on the")[1].splitlines() if "|" in line]
    assert timed == [["ver", "dtype"], ["fp32", "float32"], ["fp32", "float32"]], out  # atomic and deterministic
    assert "SUMMARY 03_flash_v2_backward PASS" in out and "not on this GPU: fp32x3 float32, tc bfloat16" in out


# ---------------------------------------------------------------- on a GPU, as each older GPU
RUNNERS = {  # stage: the command after the interpreter (run.py --quick, on the GPU)
    "00_naive": ["stages/00_naive/run.py", "--quick", "--device", "gpu"],
    "01_flash_v1": ["stages/01_flash_v1/run.py", "--quick", "--device", "gpu"],
    "02_flash_v2": ["stages/02_flash_v2/run.py", "--quick", "--device", "gpu"],
    "03_flash_v2_backward": ["stages/03_flash_v2_backward/run.py", "--quick", "--device", "gpu"],
    "04_ring": None,  # through ./scripts/mpirun: 2 ranks on this GPU
    "05_train_gpt": ["stages/05_train_gpt/run.py", "--quick", "--device", "gpu"],
    "06_hopper": ["stages/06_hopper/run.py", "--quick"],
}
ARCHS = ["sm_75", "sm_80", "sm_86", "sm_89", "this GPU"]


def as_gpu(arch):
    """The environment of a run on this GPU, or under ATTN_ARCH as the older arch; None when this GPU cannot stand
    in for arch (it is older, or has less shared memory)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ATTN_ARCH", None)
    if arch != "this GPU":
        real, old = device.device(), device.emulate(arch)
        if old.arch.cc > real.arch.cc or old.smem_optin > real.smem_optin:
            return None
        env["ATTN_ARCH"] = arch
    return env


def run_at_once(runs, timeout=900):
    """{key: CompletedProcess} for {key: (command, env)}, the commands run side by side, one a core: each compiles
    its kernels for its own architecture (NVRTC: CPU-bound), while the GPU has room for every quick run at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool:
        futures = {key: pool.submit(subprocess.run, cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                    timeout=timeout) for key, (cmd, env) in runs.items()}
        return {key: f.result() for key, f in futures.items()}


@pytest.fixture(scope="module")
def runner_results():
    """Every (stage, arch) run of test_run_py_passes_on_every_gpu, started together on first use."""
    runs = {}
    for arch in ARCHS:
        env = as_gpu(arch)
        if env is None:
            continue
        for stage, cmd in RUNNERS.items():
            if cmd is None:
                cmd = [str(ROOT / "scripts/mpirun"), "-n", "2", "python", "stages/04_ring/run.py", "--quick"]
                stamp = pathlib.Path(sys.prefix) / ".requirements.sha"  # the quick start's environment, else python3
                env = dict(env, ATTN_VENV=sys.prefix if stamp.exists() else "/nonexistent")
            else:
                cmd = [sys.executable, *cmd]
            runs[(stage, arch)] = (cmd, env)
    return run_at_once(runs)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stage", list(RUNNERS))
def test_run_py_passes_on_every_gpu(stage, arch, runner_results):
    """run.py --quick on this GPU, and under ATTN_ARCH as each older one (skipped where this GPU cannot stand in):
    exit 0 and SUMMARY PASS; what the GPU lacks is said (printed here)."""
    if (stage, arch) not in runner_results:
        pytest.skip(f"{device.device().name} cannot stand in for {arch}")
    out = runner_results[(stage, arch)]
    text = out.stdout + out.stderr
    assert out.returncode == 0 and f"SUMMARY {stage} PASS" in out.stdout, text[-4000:]
    print("\n".join(line for line in text.splitlines() if "not on this GPU" in line or "SUMMARY" in line))
