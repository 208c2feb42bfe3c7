"""What the checks catch, what they could, and that they pass right answers: results/catch_rates.csv.

    python dev/catch_rates.py --out results/catch_rates.csv          # the committed table (long: not for CI)
    python dev/catch_rates.py --draws 3 --scales 100 --dtypes float32  # a quick look, printed

Each draw (q, k, v and dO from make_inputs(seed=[base seed, scale, dtype, shape, draw]): q, k, v at inputs x1, x10
or x100, dO at unit scale) goes through the real checks (stages.common.verify.check_forward / check_backward, the
checks every test, run.py and the ring use) with

  right answers, the correct stages: the CPU tile mirrors of stage 02 (fp32 and fp32x3 for float32; tc and
    pipelined for 16 bits), of stage 03 (fp32 or tc, atomic and deterministic dQ; fp32x3 for float32) and of stage
    01 (float32); the ring (stage 04, numpy); and a plain loop: stage 00 with every sum over the head dim (S_ij,
    dP_ij, D_i) taken one product at a time with one rounding each (FMA), as the CUDA-core kernels loop (stage 01's):
    an order no BLAS takes, and the largest rounding a correct kernel makes in those sums;
  wrong answers, MISTAKES: each a correct answer with one mistake. An output mistake changes the outputs of stage
    02's / 03's mirror in the dtype's version; an algorithm mistake is made inside a copy of stage 00 (its line for
    line, with an explicit mask). Every choice in a mistake (which rows) is drawn from the draw's seed.

Counted per (mistake, scale, dtype) over the shapes and draws where the mistake exists (the causal ones on causal
shapes):
  caught      the check raises;
  resolvable  some row of the wrong output is farther from the float64 oracle than FACTOR x the largest error of
              every correct answer in that row (the stages above, stage 00 in the dtype, the yardstick in both
              orders), + SLACK: the rule's own margin. No check that passes those right answers row by row catches a
              draw that is not resolvable.
and per correct stage: passed, and its largest error / bound (ratio) with the draw's seed.
A draw's margin for a mistake is the largest, over the rows of the outputs it changes, of error / bound (caught iff
above 1). Where fewer than 95 % of the resolvable draws are caught, shrink_for_95 is the factor those outputs' bounds
would need (the 95th-percentile margin, from the top) and limit_* the correct stage with the largest error / bound on
those outputs at that scale and dtype, and its draw: a bound x shrink_for_95 fails it where limit_ratio is larger.
Every figure replays from its seed (base-scale-dtype-shape-draw).
"""
import argparse
import csv
import math
import os
import pathlib
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # many small matmuls: BLAS threads would only spin

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stages import flash_v1, flash_v2, flash_v2_backward, naive, ring  # noqa: E402
from stages.common import bfloat16, cast, code_version, make_inputs, resolve_scale, rounding, tolerance, verify  # noqa: E402

SCALES = (1.0, 10.0, 100.0)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}
# (B, H, Nq, Nk, D, causal): a saturated tiny problem, square full and causal, Nq < Nk and Nq > Nk (rows that see no
# key) off tile multiples, one query, a longer causal one at d = 128.
SHAPES = {
    "B2H3-q7k7-d64-causal": (2, 3, 7, 7, 64, True),
    "B1H2-q100k100-d64-full": (1, 2, 100, 100, 64, False),
    "B1H2-q128k128-d64-causal": (1, 2, 128, 128, 64, True),
    "B2H1-q37k100-d64-causal": (2, 1, 37, 100, 64, True),
    "B1H2-q100k60-d64-causal": (1, 2, 100, 60, 64, True),
    "B1H2-q1k130-d64-full": (1, 2, 1, 130, 64, False),
    "B1H1-q256k256-d128-causal": (1, 1, 256, 256, 128, True),
}
TILE = 64  # Bc: the key tile the "last K/V tile dropped" mistake skips
TARGET = 0.95  # caught / resolvable the rule aims at
NAMES = {"forward": tolerance.NAMES_FORWARD, "backward": tolerance.NAMES_BACKWARD}


def _low(dtype):
    return np.dtype(dtype).itemsize == 2


def _times(x, f):
    return cast(x.astype(np.float64) * f, x.dtype)


# ----------------------------------------------------------------------------- stage 00, line for line, with mistakes
def _cd(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def _round(x, dtype):
    return cast(cast(x, dtype), x.dtype)


def visible(Nq, Nk, causal, shift=0, drop_tile=False):
    """(Nq, Nk) bool: which keys each query sees (bottom-right causal), the diagonal moved by shift, and without the
    last key tile of TILE keys when drop_tile."""
    i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    vis = (j <= i + (Nk - Nq) + shift) if causal else np.ones((Nq, Nk), dtype=bool)
    if drop_tile:
        vis = vis & (j < TILE * ((Nk - 1) // TILE))
    return vis


def _scores(q, k, vis, scale):
    cd = _cd(q.dtype)
    return np.where(vis, np.matmul(cast(q, cd), cast(k, cd).swapaxes(-1, -2)) * scale, -np.inf)


def copy_forward(q, k, v, vis, scale, out_dtype=None):
    """naive.forward, line for line, with the mask vis in place of the causal mask."""
    cd = _cd(q.dtype)
    s = _scores(q, k, vis, scale)  # (B, H, Nq, Nk)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = np.matmul(_round(p, q.dtype), cast(v, cd)) / np.where(l == 0, 1.0, l)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    return cast(o, out_dtype or q.dtype), lse.astype(cd)


def copy_backward(q, k, v, o, lse, do, vis, scale, *, drop_d=False, unnormalised_dv=False, out_dtype=None):
    """naive.backward, line for line, with the mask vis; drop_d: dS = P dP (D_i left out); unnormalised_dv: dV from
    exp(S - m_i), m_i the row max, instead of P = exp(S - L_i)."""
    cd = _cd(q.dtype)
    s = _scores(q, k, vis, scale)
    lse = cast(lse, cd)[..., None]
    with np.errstate(over="ignore"):
        p = np.exp(s - np.where(np.isneginf(lse), np.inf, lse))
    do_c, o_c = cast(do, cd), cast(o, cd)
    p_dv = p
    if unnormalised_dv:
        m = s.max(axis=-1, keepdims=True)
        p_dv = np.exp(s - np.where(np.isinf(m), 0.0, m))
    dv = np.matmul(_round(p_dv, q.dtype).swapaxes(-1, -2), do_c)
    d_i = 0.0 if drop_d else (do_c * o_c).sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        ds = _round(p * (np.matmul(do_c, cast(v, cd).swapaxes(-1, -2)) - d_i), q.dtype)
    dq = scale * np.matmul(ds, cast(k, cd))
    dk = scale * np.matmul(ds.swapaxes(-1, -2), cast(q, cd))
    return tuple(cast(x, out_dtype or q.dtype) for x in (dq, dk, dv))


# ----------------------------------------------------------------------------- the plain loop: a correct stage
def loop_dot(a, b):
    """a b^T over the head dim, (..., M, D) x (..., N, D) -> (..., M, N) float32, summed d = 0, 1, ..., D - 1 with one
    rounding per product (an FMA: a_d b_d + acc exact in float64, then rounded once), as a CUDA-core kernel's loop."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    acc = np.zeros(a.shape[:-1] + (b.shape[-2],), np.float32)
    for d in range(a.shape[-1]):
        acc = (acc + a64[..., :, d, None] * b64[..., None, :, d]).astype(np.float32)
    return acc


def loop_forward(q, k, v, *, causal=False, scale=None, **_):
    """Stage 00 in float32 (16-bit: P rounded before P V, as the kernels) with S_ij = scale (Q_i K_j^T) by loop_dot."""
    scale = resolve_scale(scale, q.shape[-1])
    vis = visible(q.shape[2], k.shape[2], causal)
    s = np.where(vis, loop_dot(q, k) * np.float32(scale), -np.inf).astype(np.float32)  # (B, H, Nq, Nk)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isinf(m), np.float32(0), m)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = np.matmul(_round(p, q.dtype), cast(v, np.float32)) / np.where(l == 0, np.float32(1), l)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    return cast(o, q.dtype), lse.astype(np.float32)


def loop_backward(q, k, v, o, lse, do, *, causal=False, scale=None, **_):
    """Stage 00's backward in float32 with S_ij, dP_ij = dO_i . V_j and D_i = dO_i . O_i by loop_dot."""
    scale = np.float32(resolve_scale(scale, q.shape[-1]))
    vis = visible(q.shape[2], k.shape[2], causal)
    s = np.where(vis, loop_dot(q, k) * scale, -np.inf)
    L = lse.astype(np.float32)[..., None]
    with np.errstate(over="ignore"):
        p = np.exp(s - np.where(np.isneginf(L), np.float32(np.inf), L)).astype(np.float32)
    do32, q32, k32 = (cast(x, np.float32) for x in (do, q, k))
    dv = np.matmul(_round(p, q.dtype).swapaxes(-1, -2), do32)
    d_i = loop_dot(do32[..., None, :], cast(o, np.float32)[..., None, :])[..., 0]  # (B, H, Nq, 1)
    ds = _round(p * (loop_dot(do32, cast(v, np.float32)) - d_i), q.dtype)
    return tuple(cast(x, q.dtype) for x in (scale * np.matmul(ds, k32), scale * np.matmul(ds.swapaxes(-1, -2), q32),
                                            dv))


def correct_stages(direction, dtype):
    """{name: the stage's forward or backward}: every correct CPU stage of this direction for this dtype."""
    fwd, bwd = flash_v2.forward, flash_v2_backward.backward
    if direction == "forward":
        out = {f"02 {ver}": (lambda *a, _v=ver, **kw: fwd(*a, version=_v, **kw))
               for ver in (("tc", "pipelined") if _low(dtype) else ("fp32", "fp32x3"))}
        if not _low(dtype):
            out["01"] = flash_v1.forward
        out["04 ring"] = lambda *a, **kw: ring.forward(*a, ranks=3, **kw)
        out["plain loop"] = loop_forward
        return out
    ver = "tc" if _low(dtype) else "fp32"
    out = {f"03 {ver}{' deterministic' if det else ''}": (lambda *a, _d=det, **kw: bwd(*a, version=ver,
                                                                                        deterministic=_d, **kw))
           for det in (False, True)}
    if not _low(dtype):
        out["03 fp32x3"] = lambda *a, **kw: bwd(*a, version="fp32x3", **kw)
        out["01"] = flash_v1.backward
    out["04 ring"] = lambda *a, **kw: ring.backward(*a, ranks=3, **kw)
    out["plain loop"] = loop_backward
    return out


BASE = {"forward": "02 ", "backward": "03 "}  # output mistakes change stage 02's / 03's mirror in the dtype's version


# ----------------------------------------------------------------------------- the mistakes
def _swap_rows(x, rng):
    """x with two rows of one (batch, head) swapped, all three drawn from rng (the same x where there is one row)."""
    x = x.copy()
    B, H, N, _ = x.shape
    if N < 2:
        return x
    b, h, i = (int(rng.integers(n)) for n in (B, H, N))
    j = (i + 1 + int(rng.integers(N - 1))) % N  # any other row
    x[b, h, [i, j]] = x[b, h, [j, i]]
    return x


class Mistake:
    """name, direction, outputs (the ones it changes); either output(right outputs, rng) -> wrong outputs, or the
    algorithm's changes to stage 00: shift (of the causal diagonal), scale_power (2: the scale applied twice),
    drop_tile, drop_d, unnormalised_dv. causal_only: the mistake exists only under a causal mask."""

    def __init__(self, name, direction, outputs, output=None, shift=0, scale_power=1, drop_tile=False, drop_d=False,
                 unnormalised_dv=False):
        self.name, self.direction, self.outputs, self.output = name, direction, outputs, output
        self.shift, self.scale_power, self.drop_tile = shift, scale_power, drop_tile
        self.drop_d, self.unnormalised_dv = drop_d, unnormalised_dv
        self.causal_only = shift != 0

    def __repr__(self):
        return f"{self.name} ({self.direction})"

    def answer(self, q, k, v, do, start, right, rng, causal):
        """The wrong outputs for these inputs (start: the backward's (o, lse); right: the base stage's outputs)."""
        if self.output is not None:
            return self.output(right, rng)
        vis = visible(q.shape[2], k.shape[2], causal, self.shift, self.drop_tile)
        scale = resolve_scale(None, q.shape[-1]) ** self.scale_power
        if self.direction == "forward":
            return copy_forward(q, k, v, vis, scale)
        return copy_backward(q, k, v, *start, do, vis, scale, drop_d=self.drop_d,
                             unnormalised_dv=self.unnormalised_dv)


def _o(f):
    return lambda out, rng: (f(out[0], rng), out[1])


def _grad(n, f):
    return lambda g, rng: tuple(f(x, rng) if i == n else x for i, x in enumerate(g))


FWD, BWD = ("o", "lse"), ("dq", "dk", "dv")
MISTAKES = [
    Mistake("o x0.95", "forward", ("o",), _o(lambda o, rng: _times(o, 0.95))),
    Mistake("lse + 0.01", "forward", ("lse",), lambda out, rng: (out[0], out[1] + out[1].dtype.type(0.01))),
    Mistake("o rows swapped", "forward", ("o",), _o(_swap_rows)),
    Mistake("last K/V tile dropped", "forward", FWD, drop_tile=True),
    Mistake("causal +1", "forward", FWD, shift=1),
    Mistake("causal -1", "forward", FWD, shift=-1),
    Mistake("scale applied twice", "forward", FWD, scale_power=2),
    Mistake("dq x0.9", "backward", ("dq",), _grad(0, lambda x, rng: _times(x, 0.9))),
    Mistake("dq = 0", "backward", ("dq",), _grad(0, lambda x, rng: np.zeros_like(x))),
    Mistake("dq rows swapped", "backward", ("dq",), _grad(0, _swap_rows)),
    Mistake("dk x0.9", "backward", ("dk",), _grad(1, lambda x, rng: _times(x, 0.9))),
    Mistake("dv x0.95", "backward", ("dv",), _grad(2, lambda x, rng: _times(x, 0.95))),
    Mistake("dv from an unnormalised P", "backward", ("dv",), unnormalised_dv=True),
    Mistake("D_i left out", "backward", ("dq", "dk"), drop_d=True),
    Mistake("last K/V tile dropped", "backward", BWD, drop_tile=True),
    Mistake("causal +1", "backward", BWD, shift=1),
    Mistake("causal -1", "backward", BWD, shift=-1),
    Mistake("scale applied twice", "backward", BWD, scale_power=2),
]


# ----------------------------------------------------------------------------- one draw
def _ratios(outs, refs, bounds):
    """Per output: the largest row error / bound (0 / 0 = 0; NaN or a wrong infinity: inf)."""
    out = []
    for x, ref, bound in zip(outs, refs, bounds):
        err, b, _ = tolerance.worst_row(x, ref, bound)
        out.append(0.0 if err == 0 else err / b if b else math.inf)
    return out


def _run_check(direction, fn, q, k, v, do, causal):
    """(caught, message, outputs): the real check on fn's answer."""
    seen = []

    def recorded(*a, **kw):
        seen.append(fn(*a, **kw))
        return seen[-1]
    try:
        if direction == "forward":
            verify.check_forward(recorded, q, k, v, causal=causal)
        else:
            verify.check_backward(recorded, q, k, v, do, causal=causal)
    except AssertionError as e:
        return True, str(e), seen[-1]
    return False, "", seen[-1]


def draw(shape, dtype, scale_in, seed, mistakes=MISTAKES):
    """One draw: {("stage", direction, name): (passed, ratio, message), ("mistake", direction, name): (caught,
    resolvable, margin, message)}, where ratio is a correct stage's largest error / bound over its outputs and margin
    a mistake's over the outputs it changes; and for each direction the ratio per output of every correct stage
    (key ("ratios", direction): {stage: [ratio per output]})."""
    B, H, Nq, Nk, D, causal = shape
    q, k, v, do = make_inputs(B, H, Nq, Nk, D, dtype=dtype, scale=scale_in, grad=True, seed=seed)
    result = {}
    for direction in ("forward", "backward"):
        names = NAMES[direction]
        if direction == "forward":
            refs, bounds = verify.forward_rule(q, k, v, causal, None, {})
            start = ()
            ys = tolerance.forward_yardsticks(q, k, v, causal=causal)
            copy = naive.forward(q, k, v, causal=causal)
        else:
            refs, bounds, start = verify.backward_rule(q, k, v, do, causal, None, {})
            ys = tolerance.backward_yardsticks(q, k, v, *start, do, causal=causal)
            copy = naive.backward(q, k, v, *start, do, causal=causal)
        corrects, ratios, outs = [copy, *ys], {}, {}
        for name, fn in correct_stages(direction, dtype).items():
            caught, said, outs[name] = _run_check(direction, fn, q, k, v, do, causal)
            corrects.append(outs[name])
            ratios[name] = _ratios(outs[name], refs, bounds)
            result[("stage", direction, name)] = (not caught, max(ratios[name]), said)
        result[("ratios", direction)] = ratios
        # the largest error of every correct answer, row by row: the rule's margin above it is the most any check
        # that passes them all could resolve
        ceiling = [tolerance.FACTOR * np.max([tolerance.row_errors(c[n], ref) for c in corrects], axis=0)
                   + tolerance.SLACK for n, ref in enumerate(refs)]
        right = outs[BASE[direction] + ("tc" if _low(dtype) else "fp32")]  # what the output mistakes change
        for n_m, m in enumerate(mistakes):
            if m.direction != direction or (m.causal_only and not causal):
                continue
            rng = np.random.default_rng(list(seed) + [n_m])
            with np.errstate(all="ignore"):  # a wrong answer may overflow: that is its own business
                wrong = m.answer(q, k, v, do, start, right, rng, causal)
            caught, said, seen = _run_check(direction, lambda *a, _w=wrong, **kw: _w, q, k, v, do, causal)
            which = [names.index(o) for o in m.outputs]
            resolvable = any((tolerance.row_errors(seen[n], refs[n]) > ceiling[n]).any() for n in which)
            margin = max(_ratios([seen[n] for n in which], [refs[n] for n in which], [bounds[n] for n in which]))
            result[("mistake", direction, m.name)] = (caught, resolvable, margin, said)
    return result


# ----------------------------------------------------------------------------- the rounding the rule grants a sum
def rounding_tail(n, sums, seed, chunk=50_000):
    """(largest |e| / (u sqrt(W)), the sum's index): e the error of a plain loop's float32 sum (loop_dot's order, one
    rounding per product) of n products of random-sign terms, W its spread (rounding.spread), over `sums` sums.
    The rule grants FACTOR LAMBDA u sqrt(W): this measures how much of it a plain loop, the order with the largest
    partial sums a kernel takes, uses."""
    rng = np.random.default_rng(seed)
    worst, at = 0.0, 0
    for start in range(0, sums, chunk):
        m = min(chunk, sums - start)
        t = (rng.standard_normal((m, n)).astype(np.float32).astype(np.float64)
             * rng.standard_normal((m, n)).astype(np.float32).astype(np.float64))  # exact products of float32s
        exact = t.sum(axis=-1)
        s = np.zeros(m, np.float32)
        for d in range(n):
            s = (s + t[:, d]).astype(np.float32)
        w = rounding.spread((t * t).sum(axis=-1), exact.copy(), n)
        z = np.abs(s - exact) / (2.0 ** -24 * np.sqrt(w))
        i = int(np.argmax(z))
        if z[i] > worst:
            worst, at = float(z[i]), start + i
    return worst, at


# ----------------------------------------------------------------------------- the table
def _seed_text(seed):
    return "-".join(str(x) for x in seed)


def run(shapes, dtypes, scales, draws, base_seed, rounding_sums=0, head_dims=(64, 128, 256), log=None):
    """The rows of results/catch_rates.csv: one per (scale, dtype, mistake or correct stage), then one per head dim
    for the plain loop's rounding over rounding_sums sums (rounding_tail; its ratio: the share of the rule's grant)."""
    commit = code_version()
    rows = []
    for c_i, scale_in in enumerate(scales):
        for t_i, (dname, dtype) in enumerate(dtypes.items()):
            t0 = time.perf_counter()
            acc = {}  # (kind, direction, name) -> lists
            limits = {}  # (direction, output) -> (ratio, stage, seed)
            for s_i, (sname, shape) in enumerate(shapes.items()):
                for d in range(draws):
                    seed = [base_seed, SCALES.index(scale_in), list(DTYPES).index(dname),
                            list(SHAPES).index(sname) if sname in SHAPES else s_i, d]
                    res = draw(shape, dtype, scale_in, seed)
                    for key, val in res.items():
                        if key[0] == "ratios":
                            for stage, per_output in val.items():
                                for name, r in zip(NAMES[key[1]], per_output):
                                    if r > limits.get((key[1], name), (-1.0,))[0]:
                                        limits[(key[1], name)] = (r, stage, _seed_text(seed))
                            continue
                        acc.setdefault(key, []).append((val, _seed_text(seed)))
            for (kind, direction, name), vals in acc.items():
                row = {"scale": f"x{scale_in:g}", "dtype": dname, "kind": kind, "name": name, "direction": direction,
                       "draws": len(vals), "resolvable": "", "caught": "", "passed": "", "ratio": "",
                       "ratio_seed": "", "shrink_for_95": "", "limit_stage": "", "limit_ratio": "", "limit_seed": "",
                       "base_seed": base_seed, "git_commit": commit}
                if kind == "stage":
                    worst = max(vals, key=lambda x: x[0][1])
                    row.update(passed=sum(v[0][0] for v in vals), ratio=f"{worst[0][1]:.3g}", ratio_seed=worst[1])
                else:
                    margins = sorted((v[0][2] for v in vals if v[0][1]), reverse=True)
                    caught = sum(v[0][0] and v[0][1] for v in vals)  # of the resolvable draws
                    row.update(resolvable=len(margins), caught=caught)
                    if margins and caught < TARGET * len(margins):
                        m = next(x for x in MISTAKES if (x.name, x.direction) == (name, direction))
                        limit = max(limits[(direction, o)] for o in m.outputs)
                        row.update(shrink_for_95=f"{margins[math.ceil(TARGET * len(margins)) - 1]:.3g}",
                                   limit_stage=limit[1], limit_ratio=f"{limit[0]:.3g}", limit_seed=limit[2])
                rows.append(row)
            if log:
                log(f"[{time.perf_counter() - t0:.0f} s] x{scale_in:g} {dname}: {len(shapes)} shapes x {draws} draws")
    for n in head_dims if rounding_sums else ():
        worst, at = rounding_tail(n, rounding_sums, [base_seed, n])
        share = worst / (tolerance.FACTOR * rounding.LAMBDA)
        rows.append({**{k: "" for k in rows[0]}, "kind": "rounding", "name": f"plain loop sum of {n} products",
                     "dtype": "float32", "draws": rounding_sums, "passed": int(share < 1), "ratio": f"{share:.3g}",
                     "ratio_seed": f"{base_seed}-{n}-{at}", "base_seed": base_seed, "git_commit": commit})
    return rows


def print_table(rows):
    """caught / resolvable / draws per mistake, and passed / draws per correct stage, one column per scale x dtype;
    then the plain loop's largest rounding, as a share of what the rule grants a sum."""
    for r in rows:
        if r["kind"] == "rounding":
            print(f"{r['name']}: the largest rounding of {r['draws']} sums is {r['ratio']} of the rule's grant")
    rows = [r for r in rows if r["kind"] != "rounding"]
    cols = list(dict.fromkeys((r["scale"], r["dtype"]) for r in rows))
    at = {(r["kind"], r["direction"], r["name"], r["scale"], r["dtype"]): r for r in rows}
    lines = list(dict.fromkeys((r["kind"], r["direction"], r["name"]) for r in rows))
    width = max(len(f"{d[:3]} {n}") for _, d, n in lines) + 1
    print(" " * width + "".join(f"{s + ' ' + t:>17}" for s, t in cols))
    for kind, direction, name in lines:
        cells = []
        for c in cols:
            r = at.get((kind, direction, name) + c)
            if r is None:
                cells.append("-")
            elif kind == "stage":
                cells.append(f"{r['passed']}/{r['draws']} {float(r['ratio']):.2f}")
            else:
                cells.append(f"{r['caught']}/{r['resolvable']}/{r['draws']}")
        print(f"{direction[:3] + ' ' + name:<{width}}" + "".join(f"{x:>17}" for x in cells))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=60, help="draws per shape, scale and dtype (default 60)")
    ap.add_argument("--seed", type=int, default=0, help="base seed of every draw")
    ap.add_argument("--scales", type=float, nargs="+", default=list(SCALES), choices=SCALES)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounding-sums", type=int, default=2_000_000,
                    help="sums per head dim for the plain loop's rounding (rounding_tail; 0: none)")
    ap.add_argument("--out", default=None, help="CSV to write (results/catch_rates.csv for the committed table)")
    args = ap.parse_args(argv)
    rows = run({n: SHAPES[n] for n in args.shapes}, {n: DTYPES[n] for n in args.dtypes}, args.scales, args.draws,
               args.seed, rounding_sums=args.rounding_sums, log=lambda s: print(s, file=sys.stderr, flush=True))
    print_table(rows)
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
