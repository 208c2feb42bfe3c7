"""The checks catch mistakes and pass right answers, on fresh draws, as often as the committed table says.

dev/catch_rates.py measures, per mistake x input scale x dtype, in how many draws the real checks (check_forward,
check_backward) catch a wrong answer and in how many draws the mistake is resolvable at all (some row of the wrong
output farther from the oracle than FACTOR x every correct answer's error in that row, + SLACK): results/
catch_rates.csv. These tests run the same draw (catch_rates.draw: the same shapes, correct stages and mistakes,
every choice in a mistake drawn from the seed) on fresh seeds, DRAWS per shape, and hold the checks to it:

  * every correct stage (the CPU mirrors of stages 01-03, the ring, the plain loop) passes in every draw;
  * a draw where the mistake is not resolvable is skipped: that is the only exemption, measured in the draw;
  * among the resolvable draws, the misses must be as rare as the table measured: the test fails when, were the
    checks' miss rate as high as the table allows (the upper BETA confidence bound of its measured rate), this many
    misses would come less than once in 1 / ALPHA runs. A mistake the table says is always caught fails the test
    after a handful of misses; one the rule catches in part of its resolvable draws (named, with what bounds it, in
    the table) may miss as often as measured, not more.

Seeds: [the run's base seed (pytest --seed N / ATTN_SEED), scale, dtype, shape, draw], in every message.
"""
import csv
import importlib.util
import math
import pathlib

import numpy as np
import pytest

from tests.conftest import _base_seed

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE = ROOT / "results" / "catch_rates.csv"
DRAWS = 5  # per shape, scale and dtype (the table has many more)
ALPHA = 1e-6  # the chance that checks as good as the table fail this test
BETA = 1e-3  # the table's miss rate is taken at its upper 1 - BETA confidence bound


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dev" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


catch = _load("catch_rates")


def _openblas():
    """(set, get) of the OpenBLAS thread count numpy uses, or None where it cannot be found."""
    import ctypes

    try:
        paths = sorted({line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()})
    except OSError:
        return None
    for path in paths:
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
            setter, getter = (getattr(lib, f"{prefix}_{op}_num_threads{suffix}", None) for op in ("set", "get"))
            if setter is not None and getter is not None:
                return setter, getter
    return None


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    """OpenBLAS on one thread: the draws are many small matmuls, which its worker threads would only spin around
    (dev/catch_rates.py sets OPENBLAS_NUM_THREADS=1 before numpy loads; here numpy is loaded already)."""
    blas = _openblas()
    if blas is None:
        yield
        return
    setter, getter = blas
    before = getter()
    setter(1)
    yield
    setter(before)


def _table():
    with open(TABLE, newline="") as f:
        return {(r["kind"], r["direction"], r["name"], r["scale"], r["dtype"]): r for r in csv.DictReader(f)}


def _log_binom_pmf(k, n, p):
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
            + (n - k) * math.log1p(-p))


def binom_sf(m, n, p):
    """P(X >= m) for X ~ Binomial(n, p)."""
    return sum(math.exp(_log_binom_pmf(k, n, p)) for k in range(m, n + 1))


def miss_rate_bound(misses, trials, beta=BETA):
    """The upper 1 - beta confidence bound (Clopper-Pearson) of a rate measured as misses of trials: the p at which
    P(X <= misses) = beta, X ~ Binomial(trials, p)."""
    if trials == 0 or misses >= trials:
        return 1.0
    lo, hi = misses / trials, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1.0 - binom_sf(misses + 1, trials, mid) > beta:
            lo = mid
        else:
            hi = mid
    return hi


def test_binomial_helpers():
    """The statistics the catch test rests on, against values worked by hand."""
    assert binom_sf(0, 5, 0.3) == pytest.approx(1.0)
    assert binom_sf(5, 5, 0.5) == pytest.approx(1 / 32)
    assert binom_sf(2, 3, 0.5) == pytest.approx(0.5)
    assert miss_rate_bound(0, 1000, 1e-3) == pytest.approx(1 - 1e-3 ** (1 / 1000), rel=1e-6)  # (1 - p)^n = beta
    assert miss_rate_bound(5, 10) > 0.5 and miss_rate_bound(10, 10) == 1.0


@pytest.mark.parametrize("scale_in", catch.SCALES, ids=[f"x{s:g}" for s in catch.SCALES])
@pytest.mark.parametrize("dtype_name", list(catch.DTYPES))
def test_checks_catch_mistakes(dtype_name, scale_in, request):
    """Every shape of the table, DRAWS fresh draws each: the correct stages pass; the resolvable mistakes are caught
    as often as results/catch_rates.csv measured (see the module docstring)."""
    dtype = catch.DTYPES[dtype_name]
    table = _table()
    col = (f"x{scale_in:g}", dtype_name)
    failures, counts, missed = [], {}, {}
    for s_i, (sname, shape) in enumerate(catch.SHAPES.items()):
        for d in range(DRAWS):
            seed = [_base_seed(request.config), catch.SCALES.index(scale_in), list(catch.DTYPES).index(dtype_name),
                    s_i, d]
            where = f"[{sname} {dtype_name} x{scale_in:g}, seed {seed}]"
            for key, val in catch.draw(shape, dtype, scale_in, seed).items():
                if key[0] == "stage" and not val[0]:
                    failures.append(f"{where} the correct {key[1]} {key[2]!r} fails the check: {val[2]}")
                elif key[0] == "mistake" and val[1]:  # resolvable: counted; else skipped
                    n = counts.setdefault(key[1:], [0, 0])
                    n[0] += 1
                    if not val[0]:
                        n[1] += 1
                        missed.setdefault(key[1:], []).append(f"{where} margin {val[2]:.3g}")
    for (direction, name), (n, misses) in counts.items():
        row = table.get(("mistake", direction, name) + col)
        if row is None:
            failures.append(f"{direction} {name!r} x{scale_in:g} {dtype_name} has no row in {TABLE.name}: run "
                            f"python dev/catch_rates.py --out results/catch_rates.csv")
            continue
        measured = int(row["resolvable"]) - int(row["caught"])
        p = miss_rate_bound(measured, int(row["resolvable"]))
        if misses and binom_sf(misses, n, p) < ALPHA:
            failures.append(f"{direction} {name!r}: missed in {misses} of {n} resolvable draws, where the table "
                            f"measured {row['caught']} caught of {row['resolvable']} (a miss rate up to {p:.3g}); "
                            f"missed: " + "; ".join(missed[(direction, name)]))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)


def test_the_copy_of_stage_00_is_stage_00():
    """The algorithm mistakes are made in a copy of stage 00; without a mistake it is stage 00 bit for bit, in every
    dtype, causal and not (so what a mistake changes is the mistake alone)."""
    from stages import naive
    from stages.common import make_inputs, resolve_scale

    for dtype in catch.DTYPES.values():
        for causal in (False, True):
            q, k, v, do = make_inputs(2, 1, 37, 100, 64, dtype=dtype, grad=True, seed=[5, int(causal)])
            vis = catch.visible(37, 100, causal)
            fwd = naive.forward(q, k, v, causal=causal)
            got = catch.copy_forward(q, k, v, vis, resolve_scale(None, 64))
            assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(got, fwd))
            bwd = naive.backward(q, k, v, *fwd, do, causal=causal)
            got = catch.copy_backward(q, k, v, *fwd, do, vis, resolve_scale(None, 64))
            assert all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(got, bwd))


def test_swapped_rows_are_drawn_not_chosen():
    """Which rows a swap mistake swaps comes from the draw's generator: the same seed swaps the same rows, and over
    seeds the partner of a row is every other row about equally often (not the row most unlike it)."""
    x = np.arange(2 * 3 * 7 * 4, dtype=np.float32).reshape(2, 3, 7, 4)
    a = catch._swap_rows(x, np.random.default_rng([1, 2]))
    b = catch._swap_rows(x, np.random.default_rng([1, 2]))
    assert a.tobytes() == b.tobytes() and a.tobytes() != x.tobytes()
    pairs = []
    for s in range(2000):
        diff = np.argwhere((catch._swap_rows(x, np.random.default_rng([s])) != x).any(axis=-1))
        assert len(diff) == 2 and (diff[0][:2] == diff[1][:2]).all()  # two rows of one (batch, head)
        pairs.append(abs(int(diff[0][2]) - int(diff[1][2])))
    gaps = np.bincount(pairs, minlength=7)[1:]  # |i - j| = 1 .. 6 for 7 rows: 6, 5, 4, 3, 2, 1 pairs each
    expected = 2000 * np.arange(6, 0, -1) / 21
    assert (np.abs(gaps - expected) < 5 * np.sqrt(expected)).all(), gaps


def test_the_plain_loop_sums_one_product_at_a_time():
    """The plain loop (a correct stage of the table) sums d = 0, 1, ... with one float32 rounding per product."""
    a = np.array([[1.0, 2.0 ** -24, 2.0 ** -24, -1.0]], np.float32)
    b = np.ones((1, 4), np.float32)
    # in order: 1 + u rounds to 1 (ties to even) twice, then - 1 = 0; the exact sum is 2u
    assert catch.loop_dot(a, b)[0, 0] == 0.0 and float(a.astype(np.float64).sum()) == 2.0 ** -23


def test_a_16_bit_output_may_round_to_the_far_side():
    """A correct kernel's value a little off the oracle's may round to the far side of it: the rule grants every
    entry its output's rounding (half an ulp), so the far neighbour passes where the yardstick rounded to the near
    one exactly, and two ulps off does not."""
    from stages.common import tolerance

    x = np.array([[[[2.47023, 3.1, -1.7]]]])  # (B, H, N, D): one row, float64 oracle
    near = x.astype(np.float16)  # the yardstick: the oracle rounded to nearest, nothing else
    ulp = np.spacing(np.abs(near)).astype(np.float64)
    far = (near.astype(np.float64) + np.where(near > x, -ulp, ulp)).astype(np.float16)  # the other neighbour
    terms = (tolerance.Terms(np.zeros_like(x), np.abs(x)),)
    (bound,) = tolerance.bounds((x,), [(near,)], terms)
    err = tolerance.row_errors(far, x)
    assert (err > 2 * tolerance.row_errors(near, x)).all() and (err <= bound).all()  # far side passes
    two = (near.astype(np.float64) + np.where(near > x, 2, -2) * ulp).astype(np.float16)
    assert (tolerance.row_errors(two, x) > bound).all()


def test_the_table_covers_every_mistake_and_stage():
    """results/catch_rates.csv has a row for every mistake and correct stage at every scale and dtype; every correct
    stage passed every one of at least 200 draws; every mistake caught in fewer than 95 % of its resolvable draws
    says what bounds it (the shrink the bound would need, the correct stage and draw that shrink would fail)."""
    table = _table()
    for scale_in in catch.SCALES:
        for dname, dtype in catch.DTYPES.items():
            col = (f"x{scale_in:g}", dname)
            for m in catch.MISTAKES:
                row = table[("mistake", m.direction, m.name) + col]
                caught, resolvable = int(row["caught"]), int(row["resolvable"])
                assert caught <= resolvable <= int(row["draws"]), row
                if caught < catch.TARGET * resolvable:
                    assert row["shrink_for_95"] and row["limit_stage"] and row["limit_seed"], row
            for direction in ("forward", "backward"):
                for name in catch.correct_stages(direction, dtype):
                    row = table[("stage", direction, name) + col]
                    assert int(row["passed"]) == int(row["draws"]) >= 200, row
    rounding = [r for r in table.values() if r["kind"] == "rounding"]
    assert rounding and all(float(r["ratio"]) < 1 for r in rounding), rounding  # the rule's grant covers a plain loop
    assert all(r["git_commit"] for r in table.values())


def test_check_margins_runs_on_the_mirrors():
    """dev/check_margins.py (the GPU kernels' largest error / bound) runs end to end on the CPU mirrors (--cpu): every
    stage 01-03 version it lists runs in its dtypes, and passes."""
    margins = _load("check_margins")
    rows = margins.run(1, [100.0], [64], 0, cpu=True, log=lambda s: None)
    kernels = {(r["stage"], r["kernel"]) for r in rows}
    assert {("01", "forward"), ("02", "pipelined"), ("03", "tc deterministic"), ("03", "fp32x3")} <= kernels
    assert all(r["status"] == "ok" and int(r["checks"]) == 2 and float(r["worst_err_over_bound"]) < 1 for r in rows)
