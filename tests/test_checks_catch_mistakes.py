"""The checks catch mistakes: every wrong answer of MISTAKES fails the real check_forward / check_backward (the checks
every test, run.py and the ring use) on every case of the case list, in every dtype, at inputs x1, x10 and x100, in
every draw, except where LIMITS says that an input scale does not resolve it. The positive control runs in every draw:
the correct stage (the stage 02 / 03 tile mirrors, which are not the rule's yardstick) and the correct ring (stage 04)
pass the same check.

A wrong stage is a correct one with one mistake: output mistakes change the outputs of the correct stage (or ring);
algorithm mistakes are made inside a copy of stage 00 with an explicit mask (and inside every block of the ring).
A miss fails the test, unless the draw shows that no check could see the mistake:
  (a) unobservable: in every row of every output, the wrong output is no farther from the oracle than a correct
      answer's (the stage's, the ring's, stage 00's, the yardstick's in both orders), or the mistake moves the exact
      answer (wrong and right both computed in float64) by no more than a correct answer's rounding there, half an
      ulp of the output's dtype, or the rule's SLACK. Bit-identical outputs, a swap of equal rows, the zero dq of a
      single key and the shift of a causal diagonal that is not there all fall here.
  (b) VANISHES: the mistake's effect is the weight of a few keys (or, with one key, its score), which a draw may make
      as small as it likes, and in this draw the exact wrong answer is itself within the rule's bound.
LIMITS names what an input scale does not resolve, and why; results/catch_rates.csv (dev/catch_rates.py) measures
how often those mistakes are caught anyway, and how often any check that passes correct kernels could catch them.

Draws: DRAWS per case (fewer on the large cases, FEWER), each from make_inputs(seed=[the run's base seed (pytest
--seed N / ATTN_SEED), case, dtype, scale, draw]); every message carries that seed. The ring runs where Nq, Nk <=
RING_MAX, its mistakes in the first RING_DRAWS draws (layouts x rank counts: every pair). The check's tolerance pieces
are pure functions of the inputs: they are memoised within a draw and shared by its mistakes.
"""

import numpy as np
import pytest

from stages import flash_v2, flash_v2_backward, naive, ring
from stages.common import bfloat16, cast, check_backward, check_forward, make_inputs, resolve_scale, tolerance
from stages.common.verify import backward_start
from tests.conftest import CASES, _base_seed

DRAWS = 6
SCALES = (1.0, 10.0, 100.0)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}
TILE = 64  # Bc of the kernels: the key tile the "last key tile dropped" mistake skips
SHAPES = list(dict.fromkeys(c[:6] for c in CASES))  # (B, H, Nq, Nk, D, causal); the x100 rows are shapes too
# The large cases (one draw costs seconds): (draws, scales). Every mistake and dtype runs there too.
FEWER = {
    (1, 1, 1000, 1000, 64, True): (1, SCALES),
    (1, 1, 1000, 999, 64, False): (1, SCALES),
    (1, 1, 4097, 130, 64, False): (1, SCALES),
    (1, 1, 4097, 4097, 64, True): (1, (1.0,)),
}
RING_MAX = 1000
RING_DRAWS = 6


def _shape_id(s):
    return f"B{s[0]}H{s[1]}-q{s[2]}k{s[3]}-d{s[4]}-{'causal' if s[5] else 'full'}"


# ----------------------------------------------------------------------------- the mistakes
class Mistake:
    """name; direction "forward" or "backward"; either `output` (the wrong outputs from the correct ones and a numpy
    Generator) or the algorithm's parameters: shift (of the causal diagonal), factor (on the scale), drop_tile,
    o_read (the backward reads o times it), lse_add (the backward reads lse plus it)."""

    def __init__(self, name, direction, output=None, shift=0, factor=1.0, drop_tile=False, o_read=None,
                 lse_add=0.0):
        self.name, self.direction, self.output = name, direction, output
        self.shift, self.factor, self.drop_tile, self.o_read, self.lse_add = shift, factor, drop_tile, o_read, lse_add

    def __repr__(self):
        return self.name


def _times(x, f):
    return cast(x.astype(np.float64) * f, x.dtype)


def _swap_rows(x, rng):
    """x with two rows of one (batch, head) swapped: a row at random and the row that differs from it most."""
    x = x.copy()
    B, H, N, _ = x.shape
    b, h, i = (int(rng.integers(n)) for n in (B, H, N))
    j = int(np.argmax(np.abs(x[b, h].astype(np.float64) - x[b, h, i].astype(np.float64)).max(axis=-1)))
    x[b, h, [i, j]] = x[b, h, [j, i]]
    return x


def _one_nan(x, rng):
    x = x.copy()
    x[tuple(int(rng.integers(n)) for n in x.shape)] = np.nan
    return x


def _nan_in_a_grad(g, rng):
    g = list(g)
    n = int(rng.integers(3))
    g[n] = _one_nan(g[n], rng)
    return tuple(g)


MISTAKES = [
    Mistake("o = 0", "forward", output=lambda out, rng: (np.zeros_like(out[0]), out[1])),
    Mistake("o x 0.95", "forward", output=lambda out, rng: (_times(out[0], 0.95), out[1])),
    Mistake("o row swapped", "forward", output=lambda out, rng: (_swap_rows(out[0], rng), out[1])),
    Mistake("lse + 0.01", "forward", output=lambda out, rng: (out[0], out[1] + out[1].dtype.type(0.01))),
    Mistake("one NaN in o", "forward", output=lambda out, rng: (_one_nan(out[0], rng), out[1])),
    Mistake("causal +1", "forward", shift=1),
    Mistake("causal -1", "forward", shift=-1),
    Mistake("scale x 1.05", "forward", factor=1.05),
    Mistake("last key tile dropped", "forward", drop_tile=True),
    Mistake("dq = 0", "backward", output=lambda g, rng: (np.zeros_like(g[0]), g[1], g[2])),
    Mistake("dq x 0.9", "backward", output=lambda g, rng: (_times(g[0], 0.9), g[1], g[2])),
    Mistake("dk x 0.9", "backward", output=lambda g, rng: (g[0], _times(g[1], 0.9), g[2])),
    Mistake("dv x 0.95", "backward", output=lambda g, rng: (g[0], g[1], _times(g[2], 0.95))),
    Mistake("dq row swapped", "backward", output=lambda g, rng: (_swap_rows(g[0], rng), g[1], g[2])),
    Mistake("dk and dv swapped", "backward", output=lambda g, rng: (g[0], g[2], g[1])),
    Mistake("one NaN in a gradient", "backward", output=_nan_in_a_grad),
    Mistake("reads o = 0", "backward", o_read=0.0),
    Mistake("reads o x 1.1", "backward", o_read=1.1),
    Mistake("reads lse + 0.01", "backward", lse_add=0.01),
    Mistake("causal +1", "backward", shift=1),
    Mistake("causal -1", "backward", shift=-1),
    Mistake("scale x 1.05", "backward", factor=1.05),
    Mistake("last key tile dropped", "backward", drop_tile=True),
]

CONDITIONS = {
    "any": lambda Nq, Nk, causal: True,
    "one query": lambda Nq, Nk, causal: Nq == 1,
    "one key": lambda Nq, Nk, causal: Nk == 1,
    "7 keys": lambda Nq, Nk, causal: Nk == 7,
    "more queries than keys": lambda Nq, Nk, causal: Nq > Nk,
}
# (b) (mistake, condition) -> what the effect is proportional to
VANISHES = {
    ("scale x 1.05", "one key"): "with one key P = 1 at any scale: only lse moves, by 0.05 S, and, through P = "
                                 "exp(0.05 S) in the backward, dv, by 0.05 S dO",
    ("reads o x 1.1", "one key"): "with one key dP = D exactly; reading 1.1 o moves dS by 0.1 D, D = dO . v",
    ("reads o = 0", "one key"): "with one key dP = D exactly; reading o = 0 moves dS by D = dO . v",
    ("causal +1", "any"): "the key past the diagonal adds its weight exp(S - L), which a draw may make tiny (at large "
                          "logits, unless it is the row's largest score)",
    ("causal -1", "any"): "the diagonal key takes away its weight exp(S - L), which a draw may make tiny (at large "
                          "logits, unless it is the row's largest score)",
    ("last key tile dropped", "any"): "the keys of the last tile take away their weights exp(S - L), which a draw may "
                                      "make tiny (a tile of one key, or at large logits without the row's largest "
                                      "score)",
}
# (mistake, input scale, case condition) -> why it is not run there. At inputs x100 |S| ~ 1e4: a float32 sum of D =
# 64 products is off by up to sqrt(D) u M ~ 0.02 (M = sum_d |scale Q_id K_jd| ~ 5e4, u = 2^-24), and softmax rows are
# one-hot, so dS = P (dP - D) and the exact dq, dk vanish except on the rare rows whose two largest scores nearly tie.
_SATURATED = "at x100 softmax rows are one-hot: the exact dq, dk are below rounding except on rows whose two " \
             "largest scores nearly tie, which some draws do not have"
_FEW = "at x10 the scores of 7 keys lie ~100 apart: every row is saturated, and the exact dq, dk are below the " \
       "rounding the rule grants dP - D (sqrt(D) u times the sums of |dO V| and |dO O|, ~1e-3 here)"
LIMITS = {
    ("lse + 0.01", 100.0, "any"): "at x100 a correct kernel's lse is off by up to sqrt(D) u M ~ 0.02 (the rounding "
                                  "of S): 0.01 is within it",
    ("reads lse + 0.01", 100.0, "any"): "at x100 P = exp(S - lse) off by 1% is what an S rounded by 0.01 gives",
    ("dq = 0", 100.0, "any"): _SATURATED,
    ("dq x 0.9", 100.0, "any"): _SATURATED,
    ("dk x 0.9", 100.0, "any"): _SATURATED,
    ("dq row swapped", 100.0, "any"): _SATURATED,
    **{(name, 10.0, "7 keys"): _FEW for name in ("dq = 0", "dq x 0.9", "dk x 0.9", "dq row swapped")},
    ("dv x 0.95", 100.0, "more queries than keys"): "at x100 each key's dv adds the dO of the queries whose largest "
                                                    "score it is; with several per key |dv| falls well below their "
                                                    "magnitude sum, of which the rule grants 2 sqrt(D) u M ~ 5%",
    ("dv x 0.95", 100.0, "one query"): "at x100 the rule holds P = exp(S - L) to 2 sqrt(D) u M ~ 5% (its factor times "
                                       "the rounding of S), the size of this mistake: it is seen through the keys "
                                       "whose M is smaller, and with one query there is one",
}


# ----------------------------------------------------------------------------- stage 00 with an explicit mask
def _cd(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def _round(x, dtype):
    return cast(cast(x, dtype), x.dtype)


def _visible(Nq, Nk, causal, shift=0, drop_tile=False):
    """(Nq, Nk) bool: which keys each query sees, with the diagonal shifted and/or the last key tile dropped."""
    i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    vis = (j <= i + (Nk - Nq) + shift) if causal else np.ones((Nq, Nk), dtype=bool)
    if drop_tile:
        vis = vis & (j < TILE * ((Nk - 1) // TILE))
    return vis


def _scores(q, k, vis, scale):
    cd = _cd(q.dtype)
    return np.where(vis, np.matmul(cast(q, cd), cast(k, cd).swapaxes(-1, -2)) * scale, -np.inf)


def _forward(q, k, v, vis, scale, out_dtype):
    """naive.forward, line for line, with the mask `vis` in place of the causal mask."""
    cd = _cd(q.dtype)
    s = _scores(q, k, vis, scale)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = np.matmul(_round(p, q.dtype), cast(v, cd)) / np.where(l == 0, 1.0, l)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    return cast(o, out_dtype), lse.astype(cd)


def _backward(q, k, v, o, lse, do, vis, scale, out_dtype):
    """naive.backward, line for line, with the mask `vis` in place of the causal mask."""
    cd = _cd(q.dtype)
    s = _scores(q, k, vis, scale)
    lse = cast(lse, cd)[..., None]
    with np.errstate(over="ignore"):
        p = np.exp(s - np.where(np.isneginf(lse), np.inf, lse))
    do_c, o_c = cast(do, cd), cast(o, cd)
    dv = np.matmul(_round(p, q.dtype).swapaxes(-1, -2), do_c)
    with np.errstate(invalid="ignore"):
        ds = _round(p * (np.matmul(do_c, cast(v, cd).swapaxes(-1, -2)) - (do_c * o_c).sum(axis=-1, keepdims=True)),
                    q.dtype)
    dq = scale * np.matmul(ds, cast(k, cd))
    dk = scale * np.matmul(ds.swapaxes(-1, -2), cast(q, cd))
    return cast(dq, out_dtype), cast(dk, out_dtype), cast(dv, out_dtype)


def _alg(m, out_dtype=None):
    """A forward or backward (the stage API, or a ring block: out_dtype) that makes algorithm mistake m."""
    def fwd(q, k, v, *, causal=False, scale=None, version=None, **kw):
        vis = _visible(q.shape[2], k.shape[2], causal, m.shift, m.drop_tile)
        return _forward(q, k, v, vis, resolve_scale(scale, q.shape[-1]) * m.factor,
                        kw.get("out_dtype") or out_dtype or q.dtype)

    def bwd(q, k, v, o, lse, do, *, causal=False, scale=None, version=None, **kw):
        vis = _visible(q.shape[2], k.shape[2], causal, m.shift, m.drop_tile)
        o = o if m.o_read is None else _times(o, m.o_read)
        lse = lse + lse.dtype.type(m.lse_add) if m.lse_add else lse
        return _backward(q, k, v, o, lse, do, vis, resolve_scale(scale, q.shape[-1]) * m.factor,
                         kw.get("out_dtype") or out_dtype or q.dtype)
    return fwd if m.direction == "forward" else bwd


def _ring_with(m, q, k, v, causal, ring_kw, *rest):
    """The ring with every block making algorithm mistake m (rest: o, lse, do for the backward)."""
    saved = ring.BLOCKS["naive"]
    pd = _cd(q.dtype)
    ring.BLOCKS["naive"] = (_alg(Mistake(m.name, "forward", shift=m.shift, factor=m.factor, drop_tile=m.drop_tile),
                                 pd), _alg(Mistake(m.name, "backward", shift=m.shift, factor=m.factor,
                                                   drop_tile=m.drop_tile, o_read=m.o_read, lse_add=m.lse_add), pd))
    try:
        fn = ring.forward if m.direction == "forward" else ring.backward
        return fn(q, k, v, *rest, causal=causal, block="naive", **ring_kw)
    finally:
        ring.BLOCKS["naive"] = saved


# ----------------------------------------------------------------------------- the correct stages
def _stage(direction, dtype):
    """The correct stage: stage 02's forward / stage 03's backward tile mirror in the dtype's version."""
    version = "fp32" if np.dtype(dtype) == np.float32 else "tc"
    if direction == "forward":
        return lambda q, k, v, **kw: flash_v2.forward(q, k, v, version=version, **kw)
    return lambda *a, **kw: flash_v2_backward.backward(*a, version=version, **kw)


# ----------------------------------------------------------------------------- the exemptions (a) and (b)
def _exact(m, who, q, k, v, do, causal, ring_kw, rng_seed):
    """(right, wrong): the correct answer and the wrong one of `who` (stage or ring), both computed in float64 from
    the same inputs (the backward from the oracle's o, lse; a backward that reads o x 1.1 reads it rounded to the
    inputs' dtype, as a kernel would)."""
    dtype, q_in = q.dtype, q
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    if m.direction == "forward":
        rest, right = (), naive.forward(q, k, v, causal=causal)
    else:
        o, lse = (x.astype(np.float64) for x in backward_start(q_in, *tolerance.oracle(q, k, v, causal=causal)))
        rest, right = (o, lse, do), naive.backward(q, k, v, o, lse, do, causal=causal)
    if m.output is not None:
        return right, m.output(right, np.random.default_rng(rng_seed))
    if m.o_read is not None:
        rest = (cast(_times(cast(rest[0], dtype), m.o_read), np.float64),) + rest[1:]
        m = Mistake(m.name, m.direction, shift=m.shift, factor=m.factor, drop_tile=m.drop_tile, lse_add=m.lse_add)
    if who == "ring":
        return right, _ring_with(m, q, k, v, causal, ring_kw, *rest)
    return right, _alg(m)(q, k, v, *rest, causal=causal)


def _within_rule(wrong, direction, q, k, v, do, causal):
    """True when the exact wrong answer passes the rule on these inputs (the draw's memoised pieces)."""
    kw = dict(causal=causal, scale=None)
    if direction == "forward":
        names, refs = tolerance.NAMES_FORWARD, tolerance.oracle(q, k, v, **kw)
        bounds = tolerance.bounds(refs, tolerance.forward_yardsticks(q, k, v, **kw),
                                  tolerance.forward_s_terms(q, k, v, **kw))
    else:
        start = backward_start(q, *tolerance.oracle(q, k, v, **kw))
        names, refs = tolerance.NAMES_BACKWARD, tolerance.backward_oracle(q, k, v, *start, do, **kw)
        bounds = tolerance.bounds(refs, tolerance.backward_yardsticks(q, k, v, *start, do, **kw),
                                  tolerance.backward_s_terms(q, k, v, start[0], do, **kw))
    try:
        tolerance.assert_within(names, wrong, refs, bounds)
    except AssertionError:
        return False
    return True


def _unobservable(wrong, wrong64, right64, corrects, refs):
    """True when every row of every output is unobservable: the wrong output is no farther from the oracle there than
    a correct answer is, or the mistake moves the exact answer (wrong64 - right64, both in float64) there by no more
    than one of: a correct answer's rounding (its error against the oracle), half an ulp of the output's dtype at the
    row's largest exact entry (the output's own precision), the rule's SLACK (its absolute resolution). Then no check
    that passes correct answers, row by row, can tell the mistake from rounding."""
    for n, ref in enumerate(refs):
        allowed = np.max([tolerance.row_errors(c[n], ref) for c in corrects], axis=0)
        top = tolerance.rows(np.abs(np.where(np.isfinite(ref), ref, 0.0)))
        allowed = np.maximum(allowed, np.maximum(_unit(wrong[n].dtype) * top, tolerance.SLACK))
        close = tolerance.row_errors(wrong[n], ref) <= allowed
        small = tolerance.row_errors(wrong64[n], right64[n]) <= allowed
        if not (close | small).all():
            return False
    return True


def _unit(dtype):
    """u = 2^-p of a p-bit significand: half an ulp of x is at most u |x|."""
    import ml_dtypes

    return float((ml_dtypes.finfo if np.dtype(dtype) == bfloat16 else np.finfo)(dtype).eps) / 2


def _named(table, m, Nq, Nk, causal):
    return [cond for name, cond in table if name == m.name and CONDITIONS[cond](Nq, Nk, causal)]


# ----------------------------------------------------------------------------- memoised tolerance pieces
class _Memo:
    """Memoises the check's tolerance pieces (pure functions of q, k, v, do, causal, scale) within one draw: keyed on
    the identities of q, k, v (and do); the o, lse a backward starts from are made from the memoised oracle."""

    NAMES = ("oracle", "backward_oracle", "forward_yardsticks", "forward_s_terms", "backward_yardsticks",
             "backward_s_terms", "bounds")

    def __init__(self, monkeypatch):
        self.store = {}
        for name in self.NAMES:
            monkeypatch.setattr(tolerance, name, self._wrap(name, getattr(tolerance, name)))

    def _wrap(self, name, f):
        def g(*args, **kw):
            if name == "bounds":  # keyed on the (memoised) arrays it is given
                keyed = (args[0], [tuple(y) for y in args[1]], args[2] if len(args) > 2 else kw.get("terms"))
                key = (name, id(args[0][0]), id(args[1][0][0]))
            else:
                keyed = args[:3] + (args[-1],) if len(args) > 3 else args
                key = (name, tuple(id(a) for a in keyed), bool(kw.get("causal")), kw.get("scale"))
            if key not in self.store:
                self.store[key] = (f(*args, **kw), keyed)  # keep the arrays alive: their ids stay theirs
            return self.store[key][0]
        return g

    def clear(self):
        self.store.clear()


# ----------------------------------------------------------------------------- the test
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
    """OpenBLAS on one thread: its worker threads spin, and next to the ring's rank threads on a small CPU they make
    the many small matmuls here several times slower. Every output and every bound is computed under it."""
    blas = _openblas()
    if blas is None:
        yield
        return
    setter, getter = blas
    before = getter()
    setter(1)
    yield
    setter(before)


def _caught(check, fn, args, causal, kw):
    """(caught, what the check said, the outputs it checked)."""
    seen = []

    def recorded(*a, **kw_):
        seen.append(fn(*a, **kw_))
        return seen[-1]
    try:
        errs = check(recorded, *args, causal=causal, **kw)
    except AssertionError as e:
        return True, str(e), seen[-1] if seen else None
    return False, f"passed with errors {errs}", seen[-1] if seen else None


def _same_bytes(a, b):
    a, b = tuple(np.asarray(x) for x in a), tuple(np.asarray(x) for x in b)
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(a, b))


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("scale_in", SCALES, ids=[f"x{s:g}" for s in SCALES])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=[_shape_id(s) for s in SHAPES])
def test_checks_catch_mistakes(shape, dtype_name, scale_in, direction, monkeypatch, request):
    B, H, Nq, Nk, D, causal = shape
    draws, scales = FEWER.get(shape, (DRAWS, SCALES))
    if scale_in not in scales:
        pytest.skip(f"{_shape_id(shape)} runs at inputs {', '.join(f'x{s:g}' for s in scales)} (FEWER)")
    dtype = DTYPES[dtype_name]
    memo = _Memo(monkeypatch)
    check = check_forward if direction == "forward" else check_backward
    mistakes = [m for m in MISTAKES if m.direction == direction and not any(
        (name, scale) == (m.name, scale_in) and CONDITIONS[cond](Nq, Nk, causal) for name, scale, cond in LIMITS)]
    failures = []
    for d in range(draws):
        memo.clear()
        seed = [_base_seed(request.config), SHAPES.index(shape), list(DTYPES).index(dtype_name),
                SCALES.index(scale_in), d]
        where = f"[{_shape_id(shape)} {dtype_name} x{scale_in:g} {direction}, seed {seed}]"
        q, k, v, do = make_inputs(B, H, Nq, Nk, D, dtype=dtype, scale=scale_in, grad=True, seed=seed)
        args = (q, k, v) if direction == "forward" else (q, k, v, do)
        whos = {"stage": (_stage(direction, dtype), {})}
        if Nq <= RING_MAX and Nk <= RING_MAX:
            whos["ring"] = (ring.forward if direction == "forward" else ring.backward,
                            dict(layout=ring.LAYOUTS[d % 2], ranks=2 + d % 3))
        good = {}
        for who, (fn, kw) in whos.items():  # the positive control: the correct stage and ring pass
            caught, said, good[who] = _caught(check, fn, args, causal, kw)
            if caught:
                failures.append(f"{where} control: the correct {who} {kw or ''} fails the check: {said}")
        start = () if direction == "forward" else backward_start(q, *tolerance.oracle(q, k, v, causal=causal))
        copy = _alg(Mistake("none", direction))(*args[:3], *start, *args[3:], causal=causal)
        if not _same_bytes(copy, getattr(naive, direction)(*args[:3], *start, *args[3:], causal=causal)):
            failures.append(f"{where} the test's copy of stage 00 is not stage 00 bit for bit")
        if direction == "forward":
            refs = tolerance.oracle(q, k, v, causal=causal, scale=None)
            ys = tolerance.forward_yardsticks(q, k, v, causal=causal, scale=None)
        else:
            refs = tolerance.backward_oracle(q, k, v, *start, do, causal=causal, scale=None)
            ys = tolerance.backward_yardsticks(q, k, v, *start, do, causal=causal, scale=None)
        corrects = [*good.values(), copy, *ys]  # correct answers: the stage, the ring, stage 00, the yardsticks
        for n_m, m in enumerate(mistakes):
            rng_seed = seed + [1, n_m]
            for who, (fn, kw) in whos.items():
                if who == "ring" and d >= RING_DRAWS:
                    continue
                if m.output is not None:  # the correct outputs, with the mistake
                    right_out = good[who]

                    def wrong(*a, _o=m.output(right_out, np.random.default_rng(rng_seed)), **kw_):
                        return _o
                elif who == "ring":  # every block makes the mistake
                    right_out = good[who]

                    def wrong(q_, k_, v_, *rest, causal, scale=None, _m=m, **kw_):
                        return _ring_with(_m, q_, k_, v_, causal, kw_, *rest)
                else:  # the copy of stage 00 makes it
                    right_out, wrong = copy, _alg(m)
                caught, said, seen = _caught(check, wrong, args, causal, kw)
                if caught:
                    continue
                right, wrong64 = _exact(m, who, q, k, v, do, causal, kw, rng_seed)
                if seen is not None and _unobservable(seen, wrong64, right, corrects, refs):
                    continue  # (a)
                if _named(VANISHES, m, Nq, Nk, causal) and _within_rule(wrong64, direction, q, k, v, do, causal):
                    continue  # (b) this draw made the effect smaller than the rule's bound
                names = tolerance.NAMES_FORWARD if direction == "forward" else tolerance.NAMES_BACKWARD
                effect = {n: float(f"{tolerance.max_error(x, r):.3g}") for n, x, r in zip(names, wrong64, right)}
                failures.append(f"{where} {who} {kw or ''}: mistake {m.name!r} NOT caught: {said}; its effect in "
                                f"float64 {effect}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)


def test_tables_name_real_mistakes():
    """Every table names a mistake of MISTAKES, a known case condition and a scale of SCALES (a typo would exempt
    nothing, and leave a reason that never applies)."""
    names = {m.name for m in MISTAKES}
    for name, cond in VANISHES:
        assert name in names and cond in CONDITIONS, (name, cond)
    for name, scale, cond in LIMITS:
        assert name in names and scale in SCALES and cond in CONDITIONS, (name, scale, cond)
