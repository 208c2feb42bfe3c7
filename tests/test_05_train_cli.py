"""Stage 05's command line and dev scripts.

CPU: --help shows every default and the docstring's commands parse; every option is checked as a usage error (one
line naming the option and what it takes, exit status 2, no traceback); dev/train_scaling.py's search (doubling,
bisection, ranks agreeing on an out-of-memory) and its mpirun smoke run on the numpy backend; dev/gpt_seeds.py writes
its table.
gpu: the run's header names the kernels that run.
"""
import ast
import csv
import importlib
import importlib.util
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from stages import train_gpt as T
from stages.common.mpirun import mpi_env, mpirun_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ROOT / "stages" / "05_train_gpt" / "train.py"
SCALING = ROOT / "dev" / "train_scaling.py"


def test_help_shows_every_default_and_the_docstring_commands_parse():
    train_module = importlib.import_module("stages.train_gpt.command")  # the command line (train.py is the program)

    ap = train_module.parser()
    for action in ap._actions:
        if action.dest != "help":
            assert "default" in (action.help or "").lower(), f"{action.option_strings}: no default in its help"
    doc = ast.get_docstring(ast.parse(TRAIN.read_text()), clean=False).replace("\\\n", " ")  # the program's
    commands = [line.split("#")[0].split() for line in doc.splitlines() if "stages/05_train_gpt/train.py" in line]
    assert len(commands) >= 6
    for words in commands:
        args = words[words.index("stages/05_train_gpt/train.py") + 1:]
        train_module.parse(args)  # SystemExit on an unknown option or a bad value


def _scaling_module():
    spec = importlib.util.spec_from_file_location("train_scaling", SCALING)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("threshold,start", [(1000, 64), (50, 64), (10**6, 64)])
def test_scaling_search_doubles_then_bisects_to_an_eighth(threshold, start):
    S = _scaling_module()
    unit, limit, tried = 4, 4096, []

    def fits(n):
        assert n % unit == 0 and unit <= n <= limit, n
        tried.append(n)
        return n <= threshold

    n, why = S.longest_context(fits, start, unit, limit)
    if threshold >= limit:
        assert (n, why) == (limit, "search_max")
    else:
        assert why == "memory" and n % unit == 0 and n <= threshold < n + max(unit, n // S.RESOLUTION), (n, tried)
    assert len(tried) <= 2 * np.log2(limit), tried


def test_scaling_trial_verdict_is_agreed_by_every_rank():
    """One rank out of memory: every rank learns that the context does not fit; an error on one rank is raised on
    every rank (the ranks never wait for one that has stopped)."""
    from stages.ring import simulate

    S = _scaling_module()
    assert simulate(lambda ring: S.agreed(ring.allgather, "oom" if ring.rank == 1 else "ok"), 2) == [False, False]
    assert simulate(lambda ring: S.agreed(ring.allgather, "ok"), 2) == [True, True]
    with pytest.raises(RuntimeError, match="failed on rank 0: error: boom"):
        simulate(lambda ring: S.agreed(ring.allgather, "error: boom" if ring.rank == 0 else "ok"), 2)


@pytest.mark.mpi
def test_mpirun_train_scaling_smoke_writes_its_csv(tmp_path):
    out = tmp_path / "scaling.csv"
    cmd = mpirun_command(2) + [sys.executable, str(SCALING), *shlex.split(
        "--backend numpy --context 64 --layers 1 --d-model 32 --heads 2 --steps 2 --search-start 16 --search-max 64"),
        "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = list(csv.DictReader(open(out)))
    assert [r["gpus"] for r in rows] == ["1", "2"], rows
    assert rows[0]["speedup"] == "1.0" and float(rows[1]["tokens_per_s"]) > 0
    assert all(r["longest_context"] == "64" and r["longest_limited_by"] == "search_max" for r in rows), rows
    assert all(r["backend"] == "numpy" and r["one_gpu_attention"] and r["git_commit"] for r in rows), rows


@pytest.mark.gpu
def test_gpu_run_header_names_the_kernels_that_run():
    """On an sm_90 GPU, stage 06 runs in place of flash_v2 (single device) and of the ring's flash blocks in 16 bits,
    grouped-query heads included: the run's header says so there, and only there (float32 keeps stages 02/03)."""
    from stages.common import bfloat16
    from stages.hopper import flash_v3

    sm90 = flash_v3.takes(bfloat16, 64)
    assert (T.StageAttention("flash_v2", 64, bfloat16).kernels is not None) == sm90
    assert T.StageAttention("flash_v2", 64, np.float32).kernels is None
    text = T.hopper_ring_text("flash", bfloat16, 64, heads=1, batch=32, gpu=True)
    assert ("stage 06's forward and backward blocks" in text) == sm90, text
    assert (T.StageAttention("flash_v2", 64, bfloat16, heads=4, kv_heads=2).kernels is not None) == sm90
    text = T.hopper_ring_text("flash", bfloat16, 64, heads=4, kv_heads=2, batch=32, gpu=True)  # grouped-query
    assert ("stage 06's forward and backward blocks" in text) == sm90, text
    assert T.hopper_ring_text("flash", np.float32, 64, heads=1, batch=32, gpu=True) == ""


def test_kv_heads_trains_a_grouped_query_model_and_says_so(capsys):
    """--kv-heads 1: a multi-query GPT (k, v projections of one head), named in the header, with fewer parameters."""
    args = ["--device", "cpu", "--context", "32", "--layers", "1", "--d-model", "64", "--heads", "2", "--batch", "2",
            "--steps", "2", "--n-values", "8"]
    assert T.train_main(args + ["--kv-heads", "1"]) == 0
    out = capsys.readouterr().out
    cfg = T.GPTConfig(vocab_size=T.RecallTask(32, n_values=8).vocab_size, context=32, n_layer=1, d_model=64,
                      n_head=2, n_kv_head=1)
    assert f"2 heads and 1 k, v heads (grouped-query) (head dim 32), context 32, vocab {cfg.vocab_size}, " \
           f"{T.n_params(cfg)} parameters" in out, out
    assert T.n_params(cfg) == T.n_params(T.GPTConfig(**{**cfg.as_dict(), "n_kv_head": 2})) - 2 * 64 * 32 - 2 * 32
    assert T.train_main(args) == 0 and "k, v heads" not in capsys.readouterr().out  # multi-head: as before


# ---------------------------------------------------------------- usage errors
USAGE_ERRORS = [
    (["--lr", "-1"], r"argument --lr: takes a learning rate in \(0, 1\], such as 0.0015; got '-1'"),
    (["--lr", "nan"], r"argument --lr: takes a learning rate in \(0, 1\]"),
    (["--lr", "2"], r"argument --lr: takes a learning rate in \(0, 1\]"),
    (["--steps", "0"], r"argument --steps: takes a whole number >= 1, got 0"),
    (["--steps", "1.5"], r"argument --steps: takes a whole number >= 1, got '1.5'"),
    (["--batch", "-4"], r"argument --batch: takes a whole number >= 1"),
    (["--context", "0"], r"argument --context: takes a whole number >= 1"),
    (["--context", "3"], r"argument --context: recall task: context 3 is too short"),
    (["--layers", "0"], r"argument --layers: takes a whole number >= 1"),
    (["--d-model", "0"], r"argument --d-model: takes a whole number >= 1"),
    (["--heads", "3"], r"argument --heads: takes a divisor of --d-model 64 \(head dim = d_model / heads\), got 3"),
    (["--kv-heads", "0"], r"argument --kv-heads: takes a whole number >= 1, got 0"),
    (["--heads", "4", "--kv-heads", "3"], r"argument --kv-heads: takes a divisor of --heads 4 \(each k, v head serves "
                                          r"heads / kv-heads query heads\), got 3"),
    (["--n-values", "1"], r"argument --n-values: takes a whole number >= 2"),
    (["--seed", "-1"], r"argument --seed: takes a whole number >= 0"),
    (["--log-every", "0"], r"argument --log-every: takes a whole number >= 1"),
    (["--simulate-ranks", "-2"], r"argument --simulate-ranks: takes a whole number >= 0"),
    (["--simulate-ranks", "2"], r"argument --simulate-ranks: takes effect with --attention ring only"),
    (["--attention", "flash_v9"], r"argument --attention: invalid choice: 'flash_v9' \(choose from 'naive', "),
    (["--dtype", "float8"], r"argument --dtype: invalid choice: 'float8'"),
    (["--device", "tpu"], r"argument --device: invalid choice: 'tpu'"),
    (["--layout", "striped"], r"argument --layout: invalid choice: 'striped'"),
    (["--ring-block", "fast"], r"argument --ring-block: invalid choice: 'fast'"),
    (["--backend", "gloo"], r"argument --backend: invalid choice: 'gloo'"),
    (["--data", "no/such/file.txt"], r"argument --data: takes a text file, and 'no/such/file.txt' is not one"),
    (["--csv", "no/such/dir/log.csv"], r"argument --csv: takes a file in an existing directory"),
]


@pytest.mark.parametrize("args,message", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_every_option_is_checked_as_a_usage_error(args, message, capsys):
    """A bad value stops before any step: one line on stderr that names the option and what it takes, exit status 2
    (today's `--lr -1` trained, the loss climbing far above chance)."""
    with pytest.raises(SystemExit) as stop:
        T.train_main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(rf": error: {message}", err), err


def test_a_usage_error_from_the_script_is_one_line_and_exit_status_2():
    p = subprocess.run([sys.executable, str(TRAIN), "--lr", "-1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.splitlines() == ["train.py: error: argument --lr: takes a learning rate in (0, 1], such as 0.0015; "
                                     "got '-1' (--help lists every option)"], p.stderr


def test_under_mpirun_only_rank_0_prints_a_usage_error(monkeypatch, capsys):
    """Every rank parses the same arguments and stops with exit status 2; one line in all, from rank 0."""
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("PMI_RANK", rank)
        with pytest.raises(SystemExit) as stop:
            T.train_main(["--steps", "0"])
        assert stop.value.code == 2 and len(capsys.readouterr().err.splitlines()) == lines


# ---------------------------------------------------------------- dev/gpt_seeds.py
def test_gpt_seeds_writes_one_row_per_seed_with_its_provenance(tmp_path):
    """The seeds table: one row per seed with the commit, device, dtype and attention; a seed below --min-accuracy
    (two steps cannot learn) makes the exit status 1. Tiny config: the default's 400 steps run on the lead's machine."""
    out = tmp_path / "seeds.csv"
    cmd = [sys.executable, str(ROOT / "dev" / "gpt_seeds.py"), "--seeds", "0", "3", "--out", str(out), "--",
           "--steps", "2", "--context", "16", "--layers", "1", "--batch", "4"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "below 0.95: naive float32 seed 0, naive float32 seed 3" in p.stdout, p.stdout
    rows = list(csv.DictReader(open(out)))
    assert [r["seed"] for r in rows] == ["0", "3"] and all(r["steps"] == "2" for r in rows), rows
    assert all(r["commit"] and "cores" in r["device"] and r["dtype"] == "float32" and r["attention"] == "naive"
               and 0 <= float(r["final_accuracy"]) <= 1 and float(r["seconds"]) > 0 for r in rows), rows
