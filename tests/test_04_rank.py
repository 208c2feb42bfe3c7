"""Stage 04: one rank alone (the loopback communicator), the rank benchmark and the link table, and where stage 06's
kernels come from.

CPU: a rank on comm.LoopbackRing issues the very block calls of the real ring (rows, keys, masks, options, order),
and, replaying what the real ring delivered, computes the real ring's result bit for bit; its modes and errors.
Stage 04 imports no later stage; stage 06 registers its kernels when imported (stages/common/attention_registry.py).
dev/bench_rank.py's CPU smoke run writes its CSVs; dev/ring_links.py's table from a synthetic CSV against the formula,
and the README section it generates is the committed one.
"""
import csv
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from stages import ring
from stages.common import make_inputs
from stages.ring.compute import Compute

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dev"))


# ---------------------------------------------------------------- the loopback rank
def _logged_calls(monkeypatch):
    """{(rank, direction): [(rows, keys, mask, options, key positions)]}: every block call, in order."""
    log = {}
    for name, direction in (("forward_call", "fwd"), ("backward_call", "bwd")):
        real = getattr(Compute, name)

        def spy(self, *a, real=real, direction=direction):
            c, kpos = a[-2], a[-1]
            options = self.prob.options(self.qpos, kpos, c)
            log.setdefault((self.prob.r, direction), []).append(
                (c, tuple(kpos[c.k_start:c.k_stop].tolist()), tuple(sorted((k, repr(v)) for k, v in options.items()))))
            return real(self, *a)

        monkeypatch.setattr(Compute, name, spy)
    return log


def _rank_fn(q, k, v, do, layout, P, opts):
    n = q.shape[2]
    o_in, lse_in = ring.forward(q, k, v, causal=True, layout=layout, ranks=P, **opts)

    def body(rg):
        cut = [ring.shard(x, rg.rank, P, layout) for x in (q, k, v, o_in, lse_in, do)]
        kw = dict(ring=rg, nq=n, nk=n, causal=True, layout=layout, block="naive", **opts)
        return (*ring.ring_forward(*cut[:3], **kw), *ring.ring_backward(*cut, **kw))

    return body


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_the_loopback_rank_issues_the_real_rings_block_calls(layout, monkeypatch):
    """Grouped-query heads, a window (steps skipped, hops of two) and ALiBi (each call's origin): every rank alone, on
    a loopback of each mode, makes the calls it makes in the real ring, with the same arguments, in the same order."""
    P = 4
    q, k, v, do = make_inputs(1, 4, 256, 256, 16, dtype=np.float32, grad=True)
    k, v = k[:, :2], v[:, :2]
    opts = {"window": (40, -1), "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])}
    body = _rank_fn(q, k, v, do, layout, P, opts)
    log = _logged_calls(monkeypatch)
    ring.simulate(body, P)
    real = dict(log)
    assert real and all(real.get((r, d)) for r in range(P) for d in ("fwd", "bwd"))
    for mode in ("copy", "none"):
        log.clear()
        with np.errstate(all="ignore"):  # (mode none: the blocks that "arrive" are whatever their buffers held)
            for r in range(P):
                body(ring.LoopbackRing(r, P, mode))
        assert log == real, f"mode {mode}: a loopback rank's calls differ from the real ring's"


@pytest.mark.parametrize("causal", [False, True])
def test_a_loopback_replaying_the_ring_computes_the_rings_result(causal):
    """recorded() keeps what each simulated rank received; a rank alone on a replaying loopback then computes exactly
    the ring's outputs (both halves of the backward travelling, the gradients' hop home included)."""
    P, layout = 3, "zigzag"
    q, k, v, do = make_inputs(1, 2, 96, 96, 16, dtype=np.float32, grad=True)
    o_in, lse_in = ring.forward(q, k, v, causal=causal, ranks=P)

    def body(rg):
        cut = [ring.shard(x, rg.rank, P, layout) for x in (q, k, v, o_in, lse_in, do)]
        return (*ring.ring_forward(*cut[:3], ring=rg, causal=causal), *ring.ring_backward(*cut, ring=rg, causal=causal))

    real, received = ring.recorded(body, P)
    assert all(received)
    for r in range(P):
        alone = body(ring.LoopbackRing(r, P, "replay", received[r]))
        assert all(np.array_equal(a, b) for a, b in zip(real[r], alone)), f"rank {r}"


def test_loopback_modes():
    """copy: the sends land in the receives; none: nothing moves; the agreement answers as every rank; bad use is a
    clear error."""
    x, y = np.arange(6, dtype=np.float32), np.zeros(6, np.float32)
    copy = ring.LoopbackRing(1, 3, "copy")
    copy.wait(copy.exchange([x], [y]))
    assert np.array_equal(x, y)
    z = np.zeros(6, np.float32)
    ring.LoopbackRing(0, 2, "none").exchange([x], [z])
    assert not z.any()
    lb = ring.LoopbackRing(2, 4)
    assert lb.allgather({"a": 1}) == [{"a": 1}] * 4 and np.array_equal(lb.allreduce_sum([x])[0], 4 * x)
    with pytest.raises(ValueError, match=r"mode 'loud' is not one of \('copy', 'none', 'replay'\)"):
        ring.LoopbackRing(0, 2, "loud")
    with pytest.raises(ValueError, match=r"rank 2 is not a rank of a ring of 2"):
        ring.LoopbackRing(2, 2)
    with pytest.raises(ValueError, match=r"mode 'replay' takes the arrays to replay"):
        ring.LoopbackRing(0, 2, "replay")


# ---------------------------------------------------------------- stage 06 comes in through the registry
def test_stage_04_imports_no_later_stage_and_stage_06_registers_itself():
    """Importing the ring (and running it) loads no later stage; importing stage 06 registers its kernels, which the
    ring then asks for."""
    code = ("import sys, numpy as np\n"
            "from stages import ring\n"
            "from stages.common import attention_registry\n"
            "ring.forward(*[np.ones((1, 1, 8, 4), np.float32)] * 3, ranks=2)\n"
            "later = sorted(m for m in sys.modules if m.startswith(('stages.hopper', 'stages.train_gpt')))\n"
            "assert not later and not attention_registry.registered(), (later, attention_registry.registered())\n"
            "import stages.hopper\n"
            "from stages.hopper import flash_v3, flash_v3_backward\n"
            "(k,) = attention_registry.registered()\n"
            "assert (k.forward, k.merge_into, k.accumulate_into) == (flash_v3.forward, flash_v3.merge_into, "
            "flash_v3_backward.accumulate_into), k\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


# ---------------------------------------------------------------- the rank benchmark and the link table
def test_bench_rank_runs_on_the_cpu_and_writes_its_csvs(tmp_path):
    """dev/bench_rank.py is for a GPU; its --cpu mode runs the same code on numpy (the check first), so it cannot rot
    unseen. One row per (problem, P, variant), with the columns dev/ring_links.py reads."""
    import bench_rank

    out, timeline = tmp_path / "rank.csv", tmp_path / "timeline.csv"
    assert bench_rank.main(["--quick", "--cpu", "--variants", "base", "fold+serial-fwd", "--out", str(out),
                            "--timeline", str(timeline)])
    rows = list(csv.DictReader(open(out)))
    assert [(r["config"], r["gpus"], r["variant"]) for r in rows] == [
        (c, P, v) for c in ("8k-causal", "8k-full") for P in ("1", "2") for v in ("base", "fold+serial-fwd")]
    for r in rows:
        assert r["gpu"] == "CPU" and float(r["fwd_efficiency"]) > 0 and float(r["bwd_efficiency"]) > 0
        assert float(r["fwd_step_ms"]) > 0 and int(r["fwd_steps"]) == int(r["gpus"]) and r["commit"]
    phases = {(t["call"], t["phase"]) for t in csv.DictReader(open(timeline))}
    assert {("forward", "fill"), ("forward", "compute"), ("backward", "copy-in"), ("backward", "cast")} <= phases


def test_bench_rank_check_fails_on_a_rank_that_is_not_the_rings(monkeypatch):
    """The check before timing fails when a loopback rank does not compute the ring's result: here every array it
    replays is shifted by four elements (the right bytes in the wrong places)."""
    import bench_rank

    dev = bench_rank.Device(np, False, np.float32, "naive", "CPU")
    todo, sizes, _ = bench_rank.problems(bench_rank.parse(["--cpu", "--configs", "8k-causal"]))
    assert bench_rank.check(todo, sizes, [("base", ())], 16, dev) is None
    real_init = ring.LoopbackRing.__init__

    def shifted(self, rank, size, mode="copy", received=None):
        real_init(self, rank, size, mode, received)
        if received:
            self.replay = iter([np.roll(x, 4) for x in received])

    monkeypatch.setattr(ring.LoopbackRing, "__init__", shifted)
    failed = bench_rank.check(todo, sizes, [("base", ())], 16, dev)
    assert failed and failed.startswith("base, P=2, zigzag, causal=True, H/Hkv=1: ") and "exceeds the bound" in failed


def _synthetic_rows(path, a_fwd, a_bwd):
    """A rank-benchmark CSV whose step times are a T^2 (seconds) at T = 4k and 16k, for two problems."""
    cols = ["gpu", "gpus", "tokens_per_gpu", "heads", "kv_heads", "head_dim", "causal", "dtype", "variant",
            "fwd_step_ms", "bwd_step_ms"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for T in (4096, 16384):
            for h, hkv, d, causal in ((32, 8, 128, True), (16, 16, 64, False)):
                for P in (2, 4):
                    w.writerow(["Test GPU", P, T, h, hkv, d, causal, "bfloat16", "base", a_fwd * T * T * 1e3,
                                a_bwd * T * T * 1e3])
                w.writerow(["Test GPU", 1, T, h, hkv, d, causal, "bfloat16", "base", 1.0, 1.0])  # P = 1: not used
                w.writerow(["Test GPU", 2, T, h, hkv, d, causal, "bfloat16", "fold", 1.0, 1.0])  # another variant


def test_ring_links_from_a_synthetic_csv(tmp_path):
    """Step times a T^2 give T* = bytes per token / rate / a exactly (fit exponent 2), for each link, forward (a
    whole K, V block beside a step) and backward (a half block with float32 dK, dV beside half a step)."""
    import ring_links

    path = tmp_path / "ring_rank_test.csv"
    a_f, a_b = 2e-12, 5e-12
    _synthetic_rows(path, a_f, a_b)
    groups = ring_links.problems(ring_links.read([path]))
    assert list(groups) == [(True, 128, 32, 8, "bfloat16"), (False, 64, 16, 16, "bfloat16")]
    for key, g in groups.items():
        assert g["tokens"] == [4096, 16384]
        for (a, p), want in zip((g["fwd"], g["bwd"]), (a_f, a_b / 2)):
            assert p == pytest.approx(2.0) and a == pytest.approx(want)
        _, d, _, hkv, _ = key
        fwd_bytes, bwd_bytes = ring_links.per_token_bytes(key)
        assert (fwd_bytes, bwd_bytes) == (2 * hkv * d * 2, hkv * d * (2 + 4))
        for rate in ring_links.LINKS.values():
            assert ring_links.hiding_tokens(fwd_bytes / rate, *g["fwd"]) == pytest.approx(fwd_bytes / rate / a_f)
            assert ring_links.hiding_tokens(bwd_bytes / rate, *g["bwd"]) == pytest.approx(bwd_bytes / rate / (a_b / 2))
    t_nvlink = 2 * 8 * 128 * 2 / ring_links.LINKS["NVLink 4 (H100 SXM, 900 GB/s both ways)"] / a_f
    text = ring_links.table(groups, ring_links.LINKS, "Test GPU")
    assert f"| causal, d = 128, H = 32, Hkv = 8 | 4.0k, 16.0k | {ring_links._tokens(t_nvlink)}" in text, text


def test_ring_links_writes_the_readme_section_and_plot(tmp_path):
    import ring_links

    path = tmp_path / "ring_rank_test.csv"
    _synthetic_rows(path, 2e-12, 5e-12)
    readme = tmp_path / "README.md"
    begin, end = ring_links.MARKERS
    readme.write_text(f"# ring\n\nbefore\n{begin}\nold\n{end}\nafter\n")
    assert ring_links.main([str(path), "--write", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# ring\n\nbefore\n") and text.endswith(f"{end}\nafter\n") and "old" not in text
    assert "**Test GPU**" in text and "| causal, d = 128, H = 32, Hkv = 8 |" in text
    assert (tmp_path / "ring_links_test.png").stat().st_size > 0


def test_the_committed_link_section_is_what_the_generator_writes():
    """The stage 04 README's link section is generated from results/ring_rank_*.csv (or says none exists yet)."""
    import ring_links

    paths = [str(p) for p in sorted((ROOT / "results").glob("ring_rank_*.csv")) if "timeline" not in p.name]
    text = ring_links.README.read_text()
    assert ring_links.splice(text, ring_links.section(paths, ring_links.LINKS)) == text, \
        "stages/04_ring/README.md's ring-links section is stale: python dev/ring_links.py --write"


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_gpu_candidates_and_the_loopback_rank(layout, causal):
    """On the GPU (stage 06's blocks on sm_90, else stages 02/03, bfloat16): the ring under every candidate passes the
    one-device rule; a rank alone on a replaying loopback gives the ring's result (the rule again: the kernels add
    with atomics, so not bit for bit); the copy and none modes run the same schedule with device copies or none."""
    import cupy

    import stages.hopper  # noqa: F401  the caller registers stage 06's kernels
    from stages.common import bfloat16, verify

    P, n = 2, 512
    q, k, v, do = make_inputs(1, 2, n, n, 128, dtype=bfloat16, xp=cupy, grad=True)
    refs, bounds, (o_in, lse_in) = verify.rule(q, k, v, do, causal=causal)

    def body(rg):
        cut = [ring.shard(x, rg.rank, P, layout) for x in (q, k, v, o_in, lse_in, do)]
        kw = dict(ring=rg, causal=causal, layout=layout, block="flash")
        return (*ring.ring_forward(*cut[:3], **kw), *ring.ring_backward(*cut, **kw))

    def gathered(outs):
        return [ring.unshard([cupy.asnumpy(o[i]) for o in outs], n, layout) for i in range(5)]

    for names in [()] + [(name,) for name in ring.candidates.CANDIDATES]:
        with ring.candidates.trying(*names):
            real, received = ring.recorded(body, P)
            verify.check_outputs(gathered(real), refs, bounds, what=f"candidates {names}: ")
            alone = [body(ring.LoopbackRing(r, P, "replay", received[r])) for r in range(P)]
            verify.check_outputs(gathered(alone), refs, bounds, what=f"loopback replay, candidates {names}: ")
    for mode in ("copy", "none"):
        outs = [body(ring.LoopbackRing(r, P, mode)) for r in range(P)]
        cupy.cuda.get_current_stream().synchronize()
        assert all(o[0].shape == (1, 2, n // P, 128) for o in outs)
