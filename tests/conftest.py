"""Shared fixtures: the case list every stage is tested on (docs/DESIGN.md, "The chain of checks"), markers,
reproducible draws, poisoned outputs.

Draws: every test restarts the shared generator (stages.common.rng) from the run's base seed and the test's
id. The base seed is `pytest --seed N`, else the environment variable ATTN_SEED, else a fresh one; it is
printed in the header, and a failing test's report says how to replay it. A test's draws depend only on the
seed and its id, so they are the same whichever pytest-xdist worker runs it (`-n auto`, as test.sh does).
"""
import os
import time

import numpy as np
import pytest

from stages.common import bfloat16, gpu_status, make_inputs, seed_everything, verify
from stages import naive  # noqa: F401  (stage 00 registers itself as the tolerance rule's reference)

# The case list every stage's tests cover: (B, H, Nq, Nk, D, causal, input scale).
# Sequence lengths that are not tile multiples (1, 7, 100, 1000, 4097), Nq != Nk both ways,
# batch*heads > 1, causal and not, huge logits (inputs x100), fully masked rows (causal with
# Nq > Nk: the first Nq - Nk queries see no key under bottom-right alignment).
CASES = [
    (1, 1, 1, 1, 64, False, 1.0),
    (1, 1, 1, 1, 64, True, 1.0),
    (2, 3, 7, 7, 64, True, 1.0),
    (1, 2, 100, 100, 64, False, 1.0),
    (1, 2, 100, 100, 64, True, 1.0),
    (2, 1, 100, 37, 64, False, 1.0),
    (2, 1, 37, 100, 64, True, 1.0),
    (1, 2, 100, 60, 64, True, 1.0),  # 40 fully masked rows
    (1, 1, 1000, 1000, 64, True, 1.0),
    (1, 1, 1000, 999, 64, False, 1.0),
    (1, 2, 128, 128, 64, False, 100.0),  # large logits
    (1, 2, 128, 128, 64, True, 100.0),
    (1, 1, 4097, 4097, 64, True, 1.0),
    (1, 1, 4097, 130, 64, False, 1.0),
]
CASE_IDS = [f"B{c[0]}H{c[1]}-q{c[2]}k{c[3]}-d{c[4]}-{'causal' if c[5] else 'full'}-x{c[6]:g}" for c in CASES]
LARGE_CASE_IDS = {f"B{c[0]}H{c[1]}-q{c[2]}k{c[3]}-" for c in CASES if c[2] * c[3] > 4096 ** 2}  # tests run them first
DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": bfloat16}


def case_inputs(case, dtype=np.float32, xp=np, D=None, grad=True):
    """(q, k, v[, do]), causal for a CASES row (head dim D if given): q, k, v at the case's input scale, dO at
    unit scale (with dO x100 too, the gradients of the x100 cases pass float16's largest value, 65504)."""
    B, H, Nq, Nk, D0, causal, s = case
    return make_inputs(B, H, Nq, Nk, D or D0, dtype=dtype, xp=xp, scale=s, grad=grad), causal


# The variants' case list (stages/common/variants.py): (B, H, Hkv, Nq, Nk, causal, options). Shapes that are not tile
# multiples, Nq != Nk both ways, grouped-query k/v, windows narrower and wider than a tile, rows with no visible key
# (window (0, 0) with Nq > Nk), softcap, ALiBi, all at once. DROPOUT_CASES: dropout alone and with all the rest.
VARIANT_CASES = {
    "gqa": (2, 4, 1, 100, 77, True, {}),
    "window": (1, 2, 2, 300, 300, False, {"window": (70, 30)}),
    "window-causal": (1, 2, 2, 200, 333, True, {"window": (100, -1)}),
    "window-empty-rows": (1, 2, 2, 150, 90, False, {"window": (0, 0)}),
    "softcap": (1, 2, 2, 130, 129, True, {"softcap": 5.0}),
    "alibi": (2, 2, 2, 100, 150, False, {"alibi_slopes": np.array([0.25, 0.0625], np.float32)}),
    "all": (1, 4, 2, 257, 200, True, {"window": (64, -1), "softcap": 20.0,
                                      "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], np.float32)}),
}
DROPOUT_CASES = {
    "dropout": (1, 2, 2, 100, 90, False, {"dropout_p": 0.2, "seed": 99}),
    "all-dropout": VARIANT_CASES["all"][:-1] + ({**VARIANT_CASES["all"][-1], "dropout_p": 0.1, "seed": 5},),
}


# Packed variable-length batches (stages/common/varlen.py): (query lengths, key lengths, H, Hkv, causal, options).
# Empty sequences on either side, one-row sequences, lengths on and off tile multiples, Nq != Nk per sequence.
VARLEN_CASES = {
    "mixed": ((0, 1, 70, 130, 5), (3, 0, 90, 129, 64), 4, 2, False, {}),
    "causal-window": ((100, 17, 64), (100, 40, 200), 2, 2, True, {"window": (30, -1)}),
    "all": ((65, 130), (64, 130), 4, 1, True, {"softcap": 10.0, "dropout_p": 0.1, "seed": 5,
                                               "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625], np.float32)}),
}


def varlen_inputs(case, D, dtype, *, scale=1.0, xp=np):
    """(q, k, v, do) packed ((total, heads, D)), cu_seqlens_q, cu_seqlens_k (int32 numpy), causal, options."""
    lq, lk, H, Hkv, causal, opts = case
    cq, ck = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lq, lk))
    q, _, _, do = make_inputs(1, H, int(cq[-1]), int(ck[-1]), D, dtype=dtype, xp=xp, scale=scale, grad=True)
    _, k, v = make_inputs(1, Hkv, int(cq[-1]), int(ck[-1]), D, dtype=dtype, xp=xp, scale=scale)
    packed = [xp.ascontiguousarray(x[0].swapaxes(0, 1)) for x in (q, k, v, do)]
    return packed, cq, ck, causal, opts


def variant_inputs(case, D, dtype, *, scale=1.0, xp=np, grad=False):
    """(q, k, v[, do]), causal, options for a VARIANT_CASES row at head dim D: k, v with Hkv heads."""
    B, H, Hkv, Nq, Nk, causal, opts = case
    q, _, _, do = make_inputs(B, H, Nq, Nk, D, dtype=dtype, xp=xp, scale=scale, grad=True)
    _, k, v = make_inputs(B, Hkv, Nq, Nk, D, dtype=dtype, xp=xp, scale=scale)
    return ((q, k, v, do) if grad else (q, k, v)), causal, opts


def with_head_dim(cases, ids, dims):
    """[(case with head dim D, id)] for every case and every D in dims."""
    return [((B, H, Nq, Nk, D, c, s), cid.replace("-d64-", f"-d{D}-"))
            for (B, H, Nq, Nk, _, c, s), cid in zip(cases, ids) for D in dims]


# ---------------------------------------------------------------- seeds
def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help="base seed of every random draw (default: $ATTN_SEED, else a fresh one); printed in the "
                          "header, and a failing test's report says how to replay it")


def _base_seed(config):
    if not hasattr(config, "_attn_seed"):
        seed = getattr(config, "workerinput", {}).get("attn_seed")  # a pytest-xdist worker: the controller's seed
        seed = config.getoption("--seed") if seed is None else seed
        if seed is None:
            env = os.environ.get("ATTN_SEED")
            seed = int(env) if env else int(np.random.SeedSequence().entropy % 2**32)
        config._attn_seed = seed
    return config._attn_seed


class _SeedToWorkers:
    """pytest-xdist (test.sh runs the tests on every core): each worker is its own process, so the controller hands
    its base seed to every worker and the whole run replays from the one seed printed in the header."""

    def pytest_configure_node(self, node):
        node.workerinput["attn_seed"] = _base_seed(node.config)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # not a pytest-xdist worker: this process prints
        config.pluginmanager.register(_Progress(config))
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_SeedToWorkers())
        config.pluginmanager.register(_GpuNotRunFromWorkers())


def pytest_report_header(config):
    status = _gpu(config)
    return [f"attention tutorial: base seed {_base_seed(config)} (replay: pytest --seed {_base_seed(config)}); "
            f"GPU: {status[1]}"]


@pytest.fixture(autouse=True)
def _seeded(request):
    """Restart the shared generator from the base seed and this test's id: each test replays on its own."""
    seed_everything(_base_seed(request.config), request.node.nodeid)


def _lesser_gpu():
    """True when the GPU the tests run on lacks something the kernels can use: an architecture below sm_90, or an
    emulated one (ATTN_ARCH). Only there may a launcher refuse a version (device.UnsupportedDevice); on an sm_90
    GPU a refusal is a failure."""
    from stages.common import device

    dev = device.device()
    return dev.emulated or dev.arch.cc < 90


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    exc = call.excinfo
    if report.when == "call" and exc is not None and type(exc.value).__name__ == "UnsupportedDevice" and \
            _lesser_gpu():  # what this GPU cannot run is a skip that says why, not a failure
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: not on this GPU: {exc.value}")
        return
    if report.failed:
        seed = _base_seed(item.config)
        report.sections.append(("replay", f"random draws from base seed {seed}: replay with\n"
                                          f"  python -m pytest --seed {seed} '{item.nodeid}'"))


# ---------------------------------------------------------------- GPU presence
def _gpu(config):
    """gpu_status() once per run. A broken GPU setup (a driver, but CuPy fails) is an error, not a skip."""
    if not hasattr(config, "_attn_gpu"):
        try:
            config._attn_gpu = gpu_status()
        except RuntimeError as e:
            config._attn_gpu = (None, str(e))
    return config._attn_gpu


def pytest_collection_modifyitems(config, items):
    # `slow` tests first (a stable sort keeps every other order): pytest-xdist hands tests out in collection order
    # (one at a time with --maxschedchunk=1, as scripts/test.sh runs it), so the long ones start at once, spread over
    # the workers, and the many short ones fill the cores at the end, instead of the long ones running alone last.
    # The largest cases (4097 x 4097: an oracle and yardsticks of seconds each) are among them wherever a test runs one.
    for item in items:
        if any(case in item.nodeid for case in LARGE_CASE_IDS):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    ok, why = _gpu(config)
    if ok:
        return
    if ok is None:  # a GPU that CuPy cannot use: every gpu test fails with the error
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.usefixtures("_broken_gpu"))
        return
    # No GPU: the gpu tests are left out of the run (deselected), and the summary says how many per file and why,
    # in one line, instead of a skip mark and a SKIPPED line for each.
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if "gpu" not in item.keywords]
    per_file = {}
    for item in gpu:
        per_file[item.nodeid.split("::")[0]] = per_file.get(item.nodeid.split("::")[0], 0) + 1
    config._attn_gpu_not_run = per_file
    if hasattr(config, "workeroutput"):  # a pytest-xdist worker: the controller prints the summary
        config.workeroutput["attn_gpu_not_run"] = per_file


@pytest.fixture
def _broken_gpu(request):
    pytest.fail(_gpu(request.config)[1], pytrace=False)


class _GpuNotRunFromWorkers:
    """pytest-xdist: the workers collect and deselect; the controller takes their count of gpu tests left out (every
    worker collects the same tests: one worker's count is the run's)."""

    def pytest_testnodedown(self, node, error):
        per_file = getattr(node, "workeroutput", {}).get("attn_gpu_not_run")
        if per_file is not None:
            node.config._attn_gpu_not_run = per_file


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say how many gpu tests ran and, without a GPU, how many were left out, file by file, in one line: a run that
    left them all out must not read as a GPU pass."""
    ran = skipped = 0
    for key in ("passed", "failed", "error", "skipped"):
        for rep in terminalreporter.stats.get(key, []):
            if "gpu" in getattr(rep, "keywords", {}) and rep.when in ("call", "setup"):
                if key == "skipped":
                    skipped += 1
                elif rep.when == "call" or key == "error":
                    ran += 1
    not_run = getattr(config, "_attn_gpu_not_run", {})
    left_out = f", {sum(not_run.values())} not run here" if not_run else ""
    terminalreporter.write_line(f"gpu tests: {ran} ran, {skipped} skipped{left_out} ({_gpu(config)[1]}); "
                                f"base seed {_base_seed(config)}")
    if not_run:
        terminalreporter.write_line("  not run, per file: " + ", ".join(
            f"{path.removeprefix('tests/')} {n}" for path, n in sorted(not_run.items())))


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every test runs with NaN-poisoned output buffers: an unwritten element fails the check."""
    monkeypatch.setattr(verify, "POISON_OUTPUTS", True)


# ---------------------------------------------------------------- what the run is doing
# The slow groups that run first (the `slow` tests, started first on every core), each announced when the run starts
# and reported at half and at its end, so that a learner watching a quiet terminal knows what it is waiting for.
PHASES = [
    ("kernel compiles", "every kernel configuration compiled and held to its GPU's limits, sm_75 to sm_90",
     ("tests/test_portability.py::test_every_plan_compiles",
      "tests/test_06_hopper_cpu.py::test_every_stage_06_kernel_compiles")),
    ("notebooks", "every notebook executed on the CPU", ("tests/test_notebooks.py::test_notebook_runs",)),
]


class _Progress:
    """Prints the phases in the process that owns the terminal (pytest-xdist's controller, or the only process)."""

    def __init__(self, config):
        self.config, self.total, self.done = config, None, {}
        self.started = time.monotonic()

    @staticmethod
    def phase(nodeid):
        return next((name for name, _, prefixes in PHASES if nodeid.startswith(prefixes)), None)

    def write(self, line):
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)

    def announce(self, nodeids):
        if self.total is not None:
            return
        self.total = {name: sum(self.phase(i) == name for i in nodeids) for name, _, _ in PHASES}
        self.done = dict.fromkeys(self.total, 0)
        first = "; ".join(f"{what} ({self.total[name]} tests)" for name, what, _ in PHASES if self.total[name])
        if first:
            self.write(f"[test] first, on every core: {first}; then every stage's CPU tests")

    def pytest_xdist_node_collection_finished(self, node, ids):
        self.announce(ids)

    def pytest_collection_finish(self, session):
        if not getattr(self.config.option, "numprocesses", None):  # without pytest-xdist: this process collected
            self.announce([item.nodeid for item in session.items])

    def pytest_runtest_logreport(self, report):
        name = self.phase(report.nodeid)
        if name is None or self.total is None or report.when != "teardown":
            return
        self.done[name] += 1
        if self.done[name] in (self.total[name] // 2, self.total[name]) and self.total[name] >= 4:
            self.write(f"[test] {name}: {self.done[name]} of {self.total[name]} done, "
                       f"{time.monotonic() - self.started:.0f} s into the run")
