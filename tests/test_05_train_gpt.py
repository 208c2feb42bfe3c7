"""Stage 05: a GPT trained with our attention.

CPU: every layer's backward against central finite differences in float64, and a deliberately broken attention
backward that the check catches; the whole model's gradient the same way; AdamW against its formula; the recall
task's construction and the text data; the loss curves of naive, flash_v1 and flash_v2 attention agree (float32),
and a kernel with a 10% error in dQ moves the curve far outside that tolerance; mixed precision (bfloat16
activations) follows the float32 curve; the ring run in one process (2 and 4 simulated ranks, both layouts) and
under `mpirun -n 2` (both layouts) gives the single-device curve; the gradient sum over the ranks goes through the
communicator's allreduce_sum once a step and leaves every rank's parameters bit-identical; the ring's block choice
(flash where stages 02/03 take the head dim and dtype, else naive with the reason in the header; an explicit flash
that cannot run is a clear error); the --quick config learns the task, and the same run with attention that only
sees the current token stays at chance; clear errors on bad input; --help shows every default and the docstring's
commands parse; dev/train_scaling.py's search (doubling, bisection, ranks agreeing on an out-of-memory) and its
mpirun smoke run on the numpy backend.
gpu: the float32 curves on CuPy against numpy, the bfloat16 curves of the three kernels by the tolerance rule,
the ring on one GPU (4 ranks, mpi backend, both layouts), the ring on 2 GPUs (nccl: every rank's parameters
bit-identical, float32 and bfloat16), the PyTorch autograd.Function against SDPA.
Every RNG is seeded (the seed is in the failure messages).
"""
import csv
import importlib
import importlib.util
import pathlib
import shlex
import subprocess
import sys

import numpy as np
import pytest

from stages import train_gpt as T
from stages.common.mpirun import mpi_env, mpirun_command

L = T.layers
ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ROOT / "stages" / "05_train_gpt" / "train.py"
SCALING = ROOT / "dev" / "train_scaling.py"
SEED = 1234
from stages.train_gpt.gradcheck import numerical_grad, probe, rel_error  # noqa: E402

T.single_thread_blas()  # tiny matrices: one BLAS thread is faster, and far faster on a loaded 2-core machine
FD_TOL = 1e-6  # float64 central differences agree with a correct backward to ~1e-8 relative


def _rng(offset=0):
    return np.random.default_rng(SEED + offset)


# ---------------------------------------------------------------- each layer against finite differences


def _check_layer(fwd, bwd_inputs, inputs, what, seed):
    """fwd(*inputs) -> y; bwd_inputs(dy) -> the analytic gradients of sum(y * dy) for each input, in order."""
    rng = _rng(seed)
    y = fwd(*inputs)
    dy = rng.standard_normal(y.shape)
    analytic = bwd_inputs(dy)
    for i, (x, g) in enumerate(zip(inputs, analytic)):
        num = numerical_grad(lambda: float((fwd(*inputs) * dy).sum()), x, index=probe(x, 60, rng))
        err = rel_error(g, num)
        assert err < FD_TOL, f"{what}: input {i} gradient off by {err:.2e} (seed {SEED + seed})"


def test_linear_backward_matches_finite_differences():
    rng = _rng(1)
    x, w, b = rng.standard_normal((2, 3, 5)), rng.standard_normal((5, 4)), rng.standard_normal(4)
    _check_layer(L.linear_forward, lambda dy: L.linear_backward(dy, x, w), [x, w, b], "linear", 1)


def test_layernorm_backward_matches_finite_differences():
    rng = _rng(2)
    x, w, b = rng.standard_normal((2, 3, 6)) * 3 + 1, rng.standard_normal(6), rng.standard_normal(6)
    fwd = lambda x, w, b: L.layernorm_forward(x, w, b, np.float64)[0]  # noqa: E731
    bwd = lambda dy: L.layernorm_backward(dy, w, L.layernorm_forward(x, w, b, np.float64)[1])  # noqa: E731
    _check_layer(fwd, bwd, [x, w, b], "layernorm", 2)


def test_gelu_backward_matches_finite_differences():
    x = _rng(3).standard_normal((4, 7)) * 2
    _check_layer(L.gelu_forward, lambda dy: (L.gelu_backward(dy, x),), [x], "gelu", 3)


def test_embedding_backward_matches_finite_differences():
    rng = _rng(4)
    wte, wpe = rng.standard_normal((7, 4)), rng.standard_normal((6, 4))
    tokens = np.array([[1, 3, 3, 0], [6, 1, 1, 1]])  # repeated tokens: their rows must add up
    pos = np.array([1, 2, 4, 5])  # a shard's global positions, as under the ring
    fwd = lambda wte, wpe: L.embedding_forward(tokens, pos, wte, wpe)  # noqa: E731
    _check_layer(fwd, lambda dy: L.embedding_backward(dy, tokens, pos, wte.shape, wpe.shape), [wte, wpe],
                 "embedding", 4)


def test_cross_entropy_backward_matches_finite_differences():
    rng = _rng(5)
    logits = rng.standard_normal((2, 5, 6)) * 3
    targets = rng.integers(0, 6, size=(2, 5))
    targets[0, 1] = targets[1, 4] = -1  # no loss at these tokens
    count = int((targets >= 0).sum())
    f = lambda: float(L.cross_entropy_forward(logits, targets)[0]) / count  # noqa: E731
    probs = L.cross_entropy_forward(logits, targets)[2]
    g = L.cross_entropy_backward(probs, targets, count)
    err = rel_error(g, numerical_grad(f, logits))
    assert err < FD_TOL, f"cross-entropy gradient off by {err:.2e} (seed {SEED + 5})"
    assert (g[0, 1] == 0).all() and (g[1, 4] == 0).all()


class _Broken:
    """naive attention whose backward forgets part of dQ: the kind of bug the check must catch."""

    def __init__(self):
        self.ok = T.make_attention("naive", 4, np.float64)

    def forward(self, q, k, v):
        return self.ok.forward(q, k, v)

    def backward(self, *a):
        dq, dk, dv = self.ok.backward(*a)
        return 0.9 * dq, dk, dv


@pytest.mark.parametrize("broken", [False, True], ids=["naive", "broken-dq"])
def test_attention_backward_matches_finite_differences_and_a_broken_one_fails(broken):
    rng = _rng(6)
    H, C = 2, 8
    qkv = rng.standard_normal((2, 5, 3 * C))
    attn = _Broken() if broken else T.make_attention("naive", C // H, np.float64)
    y, cache = L.attention_forward(qkv, H, attn)
    dy = rng.standard_normal(y.shape)
    g = L.attention_backward(dy, cache, attn)
    num = numerical_grad(lambda: float((L.attention_forward(qkv, H, attn)[0] * dy).sum()), qkv)
    err = rel_error(g, num)
    if broken:
        assert err > 1e-2, f"a wrong dQ passed the finite-difference check (error {err:.2e}, seed {SEED + 6})"
    else:
        assert err < FD_TOL, f"attention gradient off by {err:.2e} (seed {SEED + 6})"


def _tiny_cfg(**kw):
    base = dict(vocab_size=11, context=8, n_layer=2, d_model=8, n_head=2)
    base.update(kw)
    return T.GPTConfig(**base)


def test_whole_model_gradient_matches_finite_differences():
    cfg = _tiny_cfg()
    rng = _rng(7)
    params = T.init_params(cfg, SEED, dtype=np.float64)
    for k in params:  # move away from the init (zero biases, unit gains) so that every term is exercised
        params[k] += 0.1 * rng.standard_normal(params[k].shape)
    tokens = rng.integers(0, cfg.vocab_size, size=(2, cfg.context))
    targets = rng.integers(-1, cfg.vocab_size, size=(2, cfg.context))
    pos = np.arange(cfg.context)
    attn = T.make_attention("naive", cfg.head_dim, np.float64)
    loss, grads = T.loss_and_grads(params, cfg, tokens, targets, pos, attn, np.float64)
    f = lambda: T.loss_and_grads(params, cfg, tokens, targets, pos, attn, np.float64)[0]  # noqa: E731
    for name, p in params.items():
        num = numerical_grad(f, p, index=probe(p, 12, rng))
        err = rel_error(grads[name], num)
        assert err < 1e-5, f"dL/d{name} off by {err:.2e} (seed {SEED + 7})"


# ---------------------------------------------------------------- optimizer


def test_adamw_step_by_the_formula():
    p = {"w": np.array([[1.0, -2.0]]), "b": np.array([0.5])}
    g = {"w": np.array([[0.1, 0.3]]), "b": np.array([-0.2])}
    opt = T.AdamW({k: v.copy() for k, v in p.items()}, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    q = {k: v.copy() for k, v in p.items()}
    for _ in range(2):
        opt.step(q, g)
    w, m, v = p["w"].copy(), 0.0, 0.0
    for t in (1, 2):  # by hand: decay, moments, bias correction
        w = w * (1 - 0.01 * 0.1)
        m, v = 0.9 * m + 0.1 * g["w"], 0.95 * v + 0.05 * g["w"] ** 2
        w = w - 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.95 ** t)) + 1e-8)
    np.testing.assert_allclose(q["w"], w, rtol=1e-12)
    # no decay on a bias; for a constant g, m_hat / sqrt(v_hat) = sign(g): each step moves it by lr against g
    np.testing.assert_allclose(q["b"], p["b"] + 2 * 0.01, rtol=1e-6)


# ---------------------------------------------------------------- data


def test_recall_task_targets_are_the_values_of_earlier_pairs():
    task = T.RecallTask(64, n_values=8, seed=SEED)
    tokens, targets = task.batch(3, 5)
    again = task.batch(3, 5)
    assert (tokens == again[0]).all() and (targets == again[1]).all(), "a batch must be a function of (seed, step)"
    assert not (tokens == task.batch(4, 5)[0]).all()
    assert tokens.max() < task.vocab_size and tokens.min() >= 0
    ctx = task.context - task.n_queries
    for b in range(5):
        where = np.flatnonzero(targets[b] >= 0)
        np.testing.assert_array_equal(where, np.arange(ctx, task.context))  # one target per query, at the end
        pairs = tokens[b, :ctx][(tokens[b, :ctx] >= task.pair0) & (tokens[b, :ctx] < task.query0)] - task.pair0
        assert len(pairs) == task.n_pairs and len(set(pairs // task.n_values)) == task.n_pairs, "distinct keys"
        value_of = dict(zip(pairs // task.n_values, pairs % task.n_values))
        for t in where:
            key = tokens[b, t] - task.query0
            assert 0 <= key < task.n_keys, "a query token"
            assert targets[b, t] - task.value0 == value_of[key], f"target is not the key's value (seed {SEED})"


def test_text_data_is_next_character(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world, hello attention. " * 5)
    d = T.TextData(f, 16, seed=SEED)
    x, y = d.batch(0, 3)
    assert x.shape == y.shape == (3, 16)
    assert (x[:, 1:] == y[:, :-1]).all()
    assert d.decode(x[0]) in f.read_text()
    with pytest.raises(ValueError, match="fewer than context"):
        T.TextData(f, 10_000)
    with pytest.raises(FileNotFoundError, match="no such file"):
        T.TextData(tmp_path / "missing.txt", 16)


# ---------------------------------------------------------------- same curve across stages

CURVE = dict(context=32, n_layer=2, d_model=64, n_head=2)  # head dim 32: every stage's fp32 kernels take it
CURVE_STEPS, CURVE_BATCH = 12, 8
CURVE_TOL = 1e-5  # float32 curves of two correct kernels differ by rounding only (~1e-7 on a loss of ~4)


def _curve(attention, steps=CURVE_STEPS, dtype="float32", xp=np, **kw):
    data = T.RecallTask(CURVE["context"], n_values=8, seed=SEED)
    cfg = T.GPTConfig(vocab_size=data.vocab_size, **CURVE)
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


def test_ring_fallback_is_said_in_the_header_and_explicit_flash_is_a_clear_error(monkeypatch, capsys):
    """The run as a GPU would see it (the device facts say GPU; the arrays stay numpy): bf16 at head dim 32 falls back
    to naive blocks and the header says why; --ring-block flash stops before any step, with a message."""
    train_module = importlib.import_module("stages.train_gpt.train")  # the module (T.train is the function)

    monkeypatch.setattr(train_module, "device_facts", lambda xp: {"gpu": True, "sm80": True})
    args = ["--attention", "ring", "--simulate-ranks", "2", "--dtype", "bfloat16", "--context", "32", "--layers", "1",
            "--d-model", "64", "--heads", "2", "--batch", "4", "--steps", "2"]  # head dim 32
    assert T.train_main(args) == 0
    assert RING_FALLBACK in capsys.readouterr().out
    assert T.train_main(args + ["--ring-block", "flash"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py: error: --ring-block flash cannot run here: head dim 32") and "Traceback" not in err


def test_help_shows_every_default_and_the_docstring_commands_parse():
    train_module = importlib.import_module("stages.train_gpt.train")  # the module (T.train is the function)

    ap = train_module.parser()
    for action in ap._actions:
        if action.dest != "help":
            assert "default" in (action.help or "").lower(), f"{action.option_strings}: no default in its help"
    doc = train_module.__doc__.replace("\\\n", " ")
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


# ---------------------------------------------------------------- it learns


def test_quick_config_learns_the_task(capsys):
    rc = T.train_main(["--quick", "--device", "cpu"])
    out = capsys.readouterr().out
    last = out.rstrip().splitlines()[-1]
    assert rc == 0 and last.startswith("SUMMARY 05_train_gpt PASS"), out


def test_attention_that_cannot_look_back_stays_at_chance():
    """The task needs attention: the --quick run (same config, seed and steps, which learns: the test above)
    with a kernel that lets each token see only itself (o = v) stays at ln(n_values)."""
    from stages.train_gpt.train import QUICK

    class SelfOnly:  # softmax over one key is 1: o = v, and nothing flows back to q and k
        def forward(self, q, k, v):
            return v.copy(), (q * k).sum(-1) / np.sqrt(q.shape[-1])

        def backward(self, q, k, v, o, lse, do):
            return np.zeros_like(q), np.zeros_like(k), do.copy()

    task = T.RecallTask(QUICK["context"], n_values=QUICK["n_values"], seed=0)
    cfg = T.GPTConfig(vocab_size=task.vocab_size, context=QUICK["context"], n_layer=QUICK["n_layer"],
                      d_model=QUICK["d_model"], n_head=QUICK["n_head"])
    loss = T.train(cfg, task, attn=SelfOnly(), steps=QUICK["steps"], batch=QUICK["batch"], lr=QUICK["lr"],
                   seed=0)["loss"]
    ok, start, end = T.learned(loss, task.chance_loss)
    assert not ok and end > 0.9 * task.chance_loss, f"a model that cannot look back beat chance: {start} -> {end}"


# ---------------------------------------------------------------- bad input


def test_bad_inputs_give_clear_errors(tmp_path):
    from stages.ring import simulate

    with pytest.raises(SystemExit):
        T.train_parse(["--attention", "flash_v9"])
    with pytest.raises(ValueError, match="not known"):
        T.make_attention("flash_v9", 32, np.float32)
    with pytest.raises(ValueError, match="head dim 16 is not supported"):
        T.make_attention("flash_v2", 16, np.float32)
    with pytest.raises(TypeError, match="not float64"):
        T.make_attention("flash_v1", 32, np.float64)
    with pytest.raises(ValueError, match="not divisible"):
        T.GPTConfig(vocab_size=10, d_model=10, n_head=3)
    with pytest.raises(ValueError, match="do not fit"):
        T.RecallTask(16, n_pairs=12, n_queries=8)
    with pytest.raises(ValueError, match="does not split over 2 ranks"):
        simulate(lambda ring: T.shard_positions(30, ring, "zigzag"), 2)
    cfg = _tiny_cfg()
    params = T.init_params(cfg, SEED)
    with pytest.raises(ValueError, match="does not fit the context"):
        T.forward(params, cfg, np.zeros((1, 9), np.int32), np.zeros((1, 9), np.int32), np.arange(9),
                  T.make_attention("naive", 4, np.float32), np.float32)
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


def _torch_cuda():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_torch_autograd_function_matches_sdpa(dtype):
    torch = _torch_cuda()
    if torch is None:
        pytest.skip("torch with CUDA is not importable here")
    from stages.train_gpt import torch_attention as TA

    err = TA.check_against_sdpa(dtype, seed=SEED)
    assert err["ok"], f"autograd.Function vs SDPA ({dtype}): {err}"


@pytest.mark.gpu
def test_gpu_run_header_names_the_kernels_that_run():
    """On an sm_90 GPU, stage 06 runs in place of flash_v2 (single device) and of the ring's flash blocks in 16 bits:
    the run's header says so there, and only there (float32 keeps stages 02/03)."""
    from stages.common import bfloat16
    from stages.hopper import flash_v3

    sm90 = flash_v3.takes(bfloat16, 64)
    assert (T.StageAttention("flash_v2", 64, bfloat16).kernels is not None) == sm90
    assert T.StageAttention("flash_v2", 64, np.float32).kernels is None
    text = T.hopper_ring_text("flash", bfloat16, 64, heads=1, batch=32, gpu=True)
    assert ("stage 06's forward and backward blocks" in text) == sm90, text
    assert T.hopper_ring_text("flash", np.float32, 64, heads=1, batch=32, gpu=True) == ""
