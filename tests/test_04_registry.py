"""Stage 04: which kernels compute the ring's blocks where a later stage registered its own (attention_registry).

CPU: a fake set of registered kernels stands for stage 06 on an sm_90 GPU. It computes each block with stage 00 in
float32 and records its calls, so the routing is checked and the ring's result still held to the tolerance rule:
grouped-query heads, windows, softcap and ALiBi go to the registered kernels, with the heads, the call's mask and the
options handed over as stage 02/03 get them; dropout (an option they do not take) and a named stage 02/03 version
keep stages 02/03; one device's yardstick takes the same route; run.py's header says which ran. The registry's own
rules: options named, options it does not know refused. gpu: tests/test_06_hopper_gpu_backward.py runs the ring with
grouped-query heads and a window on stage 06's blocks.
"""
import numpy as np
import pytest

import stages.hopper  # noqa: F401  registered here, at collection, not inside a test that swaps the registry
from stages import naive, ring
from stages.common import attention_registry, check_backward, check_forward, make_inputs
from stages.ring import candidates, compute

B, H, HKV, N, D = 1, 4, 2, 48, 32  # 2 query heads a k / v head
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)  # ALiBi's geometric slopes for H = 4


def _naive_keywords(causal, opts):
    """variants.Options of a block call (or None) as stage 00's keywords: the same block."""
    if opts is None:
        return {"causal": causal}
    return {"causal": causal, "window": (opts.left, opts.right), "softcap": opts.softcap or None,
            "alibi_slopes": opts.alibi_slopes, "origin": opts.origin}


class FakeLaterStage:
    """Registered kernels that record every call and compute it with stage 00 (float32 blocks, as the GPU kernels
    add into the ring's float32 accumulators)."""

    def __init__(self, options=("window", "softcap", "alibi_slopes")):
        self.calls = []
        self.kernels = attention_registry.AttentionKernels(
            name="a later stage (test)", takes=self.takes, forward=self.forward, merge_into=self.merge_into,
            takes_backward=self.takes_backward, backward=self.backward, accumulate_into=self.accumulate_into,
            options=frozenset(options))

    def names(self):
        return [c[0] for c in self.calls]

    def takes(self, dtype, head_dim, *, heads, kv_heads, batch):
        self.calls.append(("takes", heads, kv_heads, batch))
        return True

    def takes_backward(self, dtype, head_dim, *, heads, kv_heads):
        self.calls.append(("takes_backward", heads, kv_heads))
        return True

    def forward(self, q, k, v, **kw):
        self.calls.append(("forward", q.shape[1], k.shape[1], kw))
        return naive.forward(q, k, v, **kw)

    def backward(self, q, k, v, o, lse, do, **kw):
        self.calls.append(("backward", q.shape[1], k.shape[1], kw))
        return naive.backward(q, k, v, o, lse, do, **kw)

    def merge_into(self, q, k, v, o_run, lse_run, rows, keys, *, causal, scale, opts):
        self.calls.append(("merge_into", q.shape[1], k.shape[1], opts))
        (q0, q1), (k0, k1) = rows, keys
        o_b, lse_b = naive.forward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], scale=scale, out_dtype=np.float32,
                                   **_naive_keywords(causal, opts))
        ring.merge(o_run[:, :, q0:q1], lse_run[:, :, q0:q1], o_b, lse_b)  # in place on rows q0:q1

    def accumulate_into(self, q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, *, causal, scale, opts):
        self.calls.append(("accumulate_into", q.shape[1], k.shape[1], dk_run.shape[1], opts))
        (q0, q1), (k0, k1) = rows, keys
        dq, dk, dv = naive.backward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], o[:, :, q0:q1], lse[:, :, q0:q1],
                                    do[:, :, q0:q1], scale=scale, out_dtype=np.float32, **_naive_keywords(causal, opts))
        dq_run[:, :, q0:q1] += dq
        dk_run[:, :, k0:k1] += dk  # (B, Hkv, ...): the group's sum, as the kernels add it
        dv_run[:, :, k0:k1] += dv


@pytest.fixture
def later(monkeypatch):
    """The fake registered alone, the ring told its numpy arrays are on a GPU (where registered kernels run), and
    a step's calls one after another (the side streams are CuPy's)."""
    fake = FakeLaterStage()
    monkeypatch.setattr(attention_registry, "_REGISTERED", {})
    attention_registry.register(fake.kernels)
    monkeypatch.setattr(compute, "on_gpu", lambda prob: True)
    with candidates.trying("serial-fwd", "serial-bwd"):
        yield fake


def _inputs():
    q, _, _, do = make_inputs(B, H, N, N, D, dtype=np.float32, grad=True)
    _, k, v = make_inputs(B, HKV, N, N, D, dtype=np.float32)
    return q, k, v, do


@pytest.mark.parametrize("opts", [dict(window=(9, 0)), dict(window=(9, 0), softcap=5.0),
                                  dict(alibi_slopes=SLOPES)],
                         ids=["gqa-window", "gqa-window-softcap", "gqa-alibi"])
def test_grouped_query_and_window_blocks_go_to_the_registered_kernels(later, opts):
    """The ring's forward and backward blocks with grouped-query heads and a window (softcap, ALiBi) are the
    registered kernels' merge_into and accumulate_into, asked with H and Hkv, handed the block's Options and k, v,
    dK, dV of Hkv heads; the result is still the one-device result by the tolerance rule."""
    q, k, v, do = _inputs()
    kw = dict(causal=True, layout="zigzag", ranks=2, block="flash", opts=opts)
    check_forward(ring.forward, q, k, v, **kw)
    assert ("takes", H, HKV, B) in later.calls, later.calls
    merges = [c for c in later.calls if c[0] == "merge_into"]
    assert merges and all(c[1:3] == (H, HKV) for c in merges), merges
    if "window" in opts:  # some call of the band carries the window: its left side, bottom-right
        assert any(o is not None and o.left >= 0 for *_, o in merges), merges
    if "softcap" in opts:
        assert all(o.softcap == opts["softcap"] for *_, o in merges), merges
    if "alibi_slopes" in opts:  # ALiBi needs where the call sits in the whole problem (None: at its start)
        assert all(o.alibi_slopes is not None for *_, o in merges), merges
        assert any(o.origin is not None for *_, o in merges), merges
    assert all(o is None or o.group == H // HKV for *_, o in merges), merges
    later.calls.clear()
    check_backward(ring.backward, q, k, v, do, **kw)
    assert ("takes_backward", H, HKV) in later.calls, later.calls
    adds = [c for c in later.calls if c[0] == "accumulate_into"]
    assert adds and all(c[1:4] == (H, HKV, HKV) for c in adds), adds  # dK_j, dV_j keep Hkv heads


def test_a_ring_of_one_rank_hands_its_options_to_the_registered_whole_calls(later):
    """One rank, one call over the whole problem: the registered forward and backward, with softcap and ALiBi as
    keywords, none they do not take (dropout_p, seed) and no origin (the call is the whole problem)."""
    q, k, v, do = _inputs()
    kw = dict(causal=True, layout="contiguous", ranks=1, block="flash", opts=dict(softcap=5.0, alibi_slopes=SLOPES))
    check_forward(ring.forward, q, k, v, **kw)
    check_backward(ring.backward, q, k, v, do, **kw)
    whole = [c for c in later.calls if c[0] in ("forward", "backward")]
    assert [c[0] for c in whole] == ["forward", "backward"] and "merge_into" not in later.names(), later.calls
    for _, heads, kv_heads, keywords in whole:
        assert (heads, kv_heads) == (H, HKV)
        assert sorted(keywords) == ["alibi_slopes", "causal", "scale", "softcap"], keywords
        assert keywords["softcap"] == 5.0 and keywords["alibi_slopes"] is SLOPES and keywords["causal"], keywords


def test_dropout_and_a_named_version_keep_stages_02_03(later):
    """Dropout is an option the registered kernels do not take, and naming a stage 02/03 version asks for stages
    02/03: neither goes to them (stage 02's mirrors compute, and the ring is still right)."""
    q, k, v, do = _inputs()
    check_forward(ring.forward, q, k, v, causal=True, ranks=2, block="flash", opts=dict(dropout_p=0.2, seed=3))
    assert later.calls == [], later.calls
    check_forward(ring.forward, q, k, v, causal=True, ranks=2, block="flash", version="fp32")
    check_backward(ring.backward, q, k, v, do, causal=True, ranks=2, block="flash", version="fp32")
    assert "merge_into" not in later.names() and "accumulate_into" not in later.names(), later.calls
    check_forward(ring.forward, q, k, v, causal=True, ranks=2, block="naive")  # stage 00 asked for: not them either
    assert "merge_into" not in later.names(), later.calls


def test_registered_kernels_without_options_take_only_plain_and_grouped_query_problems(monkeypatch):
    """A later stage that names no option is asked only for problems without one (grouped-query heads included)."""
    fake = FakeLaterStage(options=())
    monkeypatch.setattr(attention_registry, "_REGISTERED", {})
    attention_registry.register(fake.kernels)
    shape = dict(H=H, Hkv=HKV, B=B)
    assert ring.hopper_takes(np.float16, 64, **shape) and ring.hopper_backward_takes(np.float16, 64, **shape)
    assert not ring.hopper_takes(np.float16, 64, options={"window"}, **shape)
    assert not ring.hopper_backward_takes(np.float16, 64, version="fp32", **shape)  # a named stage 03 version
    assert ("takes", H, HKV, B) in fake.calls and ("takes_backward", H, HKV) in fake.calls


class GpuArray:  # stands for a CuPy array (not numpy): one device's yardstick asks the registry only for those
    def __init__(self, heads):
        self.shape, self.dtype = (B, heads, 64, 64), np.dtype(np.float16)


def test_one_device_yardstick_takes_the_options_the_ring_blocks_take(later, monkeypatch):
    """ring.one_device_forward / one_device_backward (run.py's and dev/bench_ring.py's yardstick) run the registered
    kernels with a window, softcap and ALiBi as keywords, and stage 02/03 with dropout or a named version."""
    from stages import flash_v2, flash_v2_backward

    seen = []
    monkeypatch.setattr(flash_v2, "forward", lambda q, k, v, **kw: seen.append(("02", kw)) or ("o", "lse"))
    monkeypatch.setattr(flash_v2_backward, "backward", lambda *a, **kw: seen.append(("03", kw)) or ("dq", "dk", "dv"))
    monkeypatch.setattr(FakeLaterStage, "forward", lambda self, q, k, v, **kw: seen.append(("later", kw)) or "o")
    monkeypatch.setattr(FakeLaterStage, "backward", lambda self, *a, **kw: seen.append(("later bwd", kw)) or "g")
    later.kernels = later.kernels._replace(forward=later.forward, backward=later.backward)
    attention_registry.register(later.kernels)
    q, kv = GpuArray(H), GpuArray(HKV)
    ring.one_device_forward(q, kv, kv, causal=True, window=(63, 0), softcap=30.0, dropout_p=0.0, seed=0)
    ring.one_device_backward(q, kv, kv, q, q, q, causal=True, window=(63, 0))
    ring.one_device_forward(q, kv, kv, causal=True, dropout_p=0.1)  # dropout: not theirs
    ring.one_device_forward(q, kv, kv, version="tc", causal=True)  # stage 02's tc named
    ring.one_device_forward(q, kv, kv, causal=True, out_dtype=np.float32)  # a keyword that is not an option
    assert seen == [("later", {"causal": True, "window": (63, 0), "softcap": 30.0}),
                    ("later bwd", {"causal": True, "window": (63, 0)}),
                    ("02", {"version": "auto", "causal": True, "dropout_p": 0.1}),
                    ("02", {"version": "tc", "causal": True}),
                    ("02", {"version": "auto", "causal": True, "out_dtype": np.float32})], seen
    assert ("takes", H, HKV, B) in later.calls


def test_run_py_header_names_the_registered_blocks_for_grouped_query_and_window(later):
    """run.py's header decides as compute.py does: the registered kernels for grouped-query heads and a window, stages
    02/03 with dropout."""
    import importlib.util
    import pathlib
    import types

    spec = importlib.util.spec_from_file_location("ring_run", pathlib.Path(ring.__file__).with_name("run.py"))
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    s = types.SimpleNamespace(block="flash", H=H, Hkv=HKV, D=64, dtype=np.dtype(np.float16),
                              versions=("pipelined", "tc"), opts={"window": (255, 0)})
    name = later.kernels.name
    assert run._blocks_text(s, 1) == f"{name}, {name} backward"
    s.opts = {"window": (255, 0), "dropout_p": 0.1}
    assert run._blocks_text(s, 1) == "stage 02 version pipelined, stage 03 version tc"


def test_the_registry_names_options_and_refuses_unknown_ones():
    assert attention_registry.options_in_use(causal=True, scale=0.5, window=(-1, -1), softcap=None, dropout_p=0.0,
                                             seed=4, origin=(0, 1, 2)) == frozenset()
    assert attention_registry.options_in_use(window=(3, 0), softcap=30.0, alibi_slopes=np.ones(2),
                                             dropout_p=0.1) == {"window", "softcap", "alibi_slopes", "dropout_p"}
    fake = FakeLaterStage(options=("window", "rope"))
    with pytest.raises(ValueError, match=r"options \['rope'\] are not attention options"):
        attention_registry.register(fake.kernels)
    with pytest.raises(TypeError, match="register takes an AttentionKernels"):
        attention_registry.register(object())


# ---------------------------------------------------------------- gpu: stage 06's blocks on an sm_90 GPU
def _spy_stage_06(monkeypatch):
    """Stage 06's registered kernels with every call recorded (name, q heads, k heads): {name: [...]}; skips the
    test where they take nothing (not an sm_90 GPU)."""
    from stages.common import bfloat16, device
    from stages.hopper import flash_v3, sm90a

    try:
        sm90a.require_hopper()
    except device.UnsupportedDevice as e:
        pytest.skip(f"not an sm_90 GPU: {e}")
    kernels = next(k for k in attention_registry.registered() if k.forward is flash_v3.forward)
    assert kernels.takes(bfloat16, 128, heads=H, kv_heads=HKV, batch=B)
    calls = {}

    def spied(name, real):
        def call(q, k, *a, **kw):
            calls.setdefault(name, []).append((q.shape[1], k.shape[1]))
            return real(q, k, *a, **kw)
        return call

    names = ("forward", "merge_into", "backward", "accumulate_into")
    monkeypatch.setitem(attention_registry._REGISTERED, kernels.name,
                        kernels._replace(**{n: spied(n, getattr(kernels, n)) for n in names}))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("layout,ranks,opts", [("zigzag", 4, dict(window=(255, 0))),
                                               ("contiguous", 2, dict(window=(100, 0), softcap=30.0)),
                                               ("zigzag", 2, dict(alibi_slopes=SLOPES))],
                         ids=["gqa-window", "gqa-window-softcap", "gqa-alibi"])
def test_gpu_ring_runs_grouped_query_and_window_blocks_on_stage_06(monkeypatch, layout, ranks, opts):
    """On an sm_90 GPU the ring's blocks with grouped-query heads (4 query heads, 2 k, v heads) and a window (softcap,
    ALiBi) are stage 06's merge_into and accumulate_into, handed k, v and dK, dV of 2 heads, and the ring's result
    is within the tolerance rule of the fp64 oracle, forward and backward (bfloat16, d = 128)."""
    import cupy

    from stages.common import bfloat16

    calls = _spy_stage_06(monkeypatch)
    q, _, _, do = make_inputs(B, H, 512, 512, 128, dtype=bfloat16, xp=cupy, grad=True)
    _, k, v = make_inputs(B, HKV, 512, 512, 128, dtype=bfloat16, xp=cupy)
    kw = dict(causal=True, layout=layout, ranks=ranks, block="flash", opts=opts)
    check_forward(ring.forward, q, k, v, **kw)
    check_backward(ring.backward, q, k, v, do, **kw)
    assert calls.get("merge_into") and set(calls["merge_into"]) == {(H, HKV)}, calls
    assert calls.get("accumulate_into") and set(calls["accumulate_into"]) == {(H, HKV)}, calls


@pytest.mark.gpu
def test_gpu_ring_keeps_dropout_on_stages_02_03_and_runs_a_whole_grouped_query_call_on_stage_06(monkeypatch):
    """Dropout is not stage 06's: the ring's dropout blocks stay stage 02/03's (and right); a ring of one rank with
    grouped-query heads and softcap is one call of stage 06's forward and backward; one device's yardstick too."""
    import cupy

    from stages.common import bfloat16

    calls = _spy_stage_06(monkeypatch)
    q, _, _, do = make_inputs(B, H, 512, 512, 128, dtype=bfloat16, xp=cupy, grad=True)
    _, k, v = make_inputs(B, HKV, 512, 512, 128, dtype=bfloat16, xp=cupy)
    check_forward(ring.forward, q, k, v, causal=True, ranks=2, block="flash", opts=dict(dropout_p=0.1, seed=7))
    assert not calls, calls
    kw = dict(causal=True, layout="contiguous", ranks=1, block="flash", opts=dict(softcap=30.0))
    check_forward(ring.forward, q, k, v, **kw)
    check_backward(ring.backward, q, k, v, do, **kw)
    assert calls == {"forward": [(H, HKV)], "backward": [(H, HKV)]}, calls
    calls.clear()
    o, lse = ring.one_device_forward(q, k, v, causal=True, window=(255, 0))
    ring.one_device_backward(q, k, v, o, lse, do, causal=True, window=(255, 0))
    assert calls == {"forward": [(H, HKV)], "backward": [(H, HKV)]}, calls
