"""stages/common/fast_path.py on a CPU: which calls share a key, which plans a @remembered function keeps (the run
step's keep), and what launch.run_forward hands it.

The GPU side (a replay gives the plain launcher's bits, bad input after a good call is still refused) is in the
stages' gpu tests: test_02_flash_v2.py (test_gpu_fast_path_replays_the_plain_launch_bit_for_bit) and
test_03_flash_v2_backward.py, test_gpu_a_repeated_call_is_checked_and_planned_....
"""
import sys
import types

import numpy as np
import pytest

from stages.common import device, fast_path, launch


class FakeArray:  # stands in for cupy.ndarray on a machine without a GPU
    def __init__(self, shape, dtype=np.float32):
        self.shape, self.dtype = shape, np.dtype(dtype)


@pytest.fixture
def fake_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=FakeArray))
    monkeypatch.setattr(device, "device", lambda: "gpu 0")


SHAPE = (1, 2, 8, 64)


def _key(*arrays, **kw):
    arrays = arrays or (FakeArray(SHAPE),) * 3
    return fast_path.call_key(arrays, kw)


def test_call_key_tells_apart_every_argument_the_checks_look_at(fake_cupy, monkeypatch):
    """Two calls get one key only when every array's type, shape and dtype, every other argument with its name and
    type, and the device agree."""
    base = _key(causal=False)
    assert base is not None and _key(causal=False) == base
    a = FakeArray(SHAPE)
    others = [_key(FakeArray((1, 2, 9, 64)), a, a), _key(a, FakeArray((1, 1, 8, 64)), a),
              _key(a, a, FakeArray(SHAPE, "f2")), _key(causal=True), _key(causal=0),  # 0 == False, but not the same
              _key(softcap=False),  # the same value under another name
              _key(causal=False, scale=0.1), _key(causal=False, version="tc"), _key()]
    assert len({base, *others}) == len(others) + 1
    monkeypatch.setattr(device, "device", lambda: "gpu 1")
    assert _key(causal=False) != base


def test_calls_that_cannot_be_keyed_are_always_checked(fake_cupy):
    assert fast_path.call_key((np.zeros(SHAPE),) * 3, {}) is None  # numpy inputs run the mirror
    assert _key(alibi_slopes=[0.1]) is None  # an unhashable argument
    assert fast_path.call_key((FakeArray(SHAPE), [1, 2], FakeArray(SHAPE)), {}) is None  # not an array
    assert fast_path.call_key((), {"q": 1}) is None  # arrays given by name


class Plan:
    """A stand-in for kernels.ForwardLaunch: records its calls; with_joint_outputs marks the kept copy."""
    def __init__(self, log, joint=False):
        self.log, self.joint = log, joint

    def with_joint_outputs(self, *arrays):
        return Plan(self.log, joint=True)

    def __call__(self, *arrays):
        self.log.append(("run", self.joint))
        return "result"


def test_remembered_keeps_the_plan_of_a_plain_call_and_replays_it(fake_cupy):
    log = []

    @fast_path.remembered
    def forward(q, k, v, *, causal=False, variant=False):
        log.append(("checked", causal))
        if variant:  # a path that never hands its plan to fast_path.launch: never kept
            return Plan(log)(q, k, v)
        return fast_path.launch(Plan(log), q, k, v)

    a = FakeArray(SHAPE)
    assert forward(a, a, a) == "result" and forward(a, a, a) == "result"
    assert log == [("checked", False), ("run", True), ("run", True)]  # the second call skipped the checks
    log.clear()
    forward(a, a, a, causal=True)
    forward(a, a, a, causal=True)
    forward(a, a, a, variant=True)
    forward(a, a, a, variant=True)
    assert log == [("checked", True), ("run", True), ("run", True),
                   ("checked", False), ("run", False), ("checked", False), ("run", False)]
    assert len(forward.plans) == 2


def test_a_remembered_function_inside_another_keeps_only_its_own_plan(fake_cupy):
    log = []

    @fast_path.remembered
    def inner(q):
        return fast_path.launch(Plan(log), q)

    @fast_path.remembered
    def outer(q, *, twice=False):
        inner(q)
        return fast_path.launch(Plan(log), q)

    a = FakeArray(SHAPE)
    outer(a)
    assert len(inner.plans) == 1 and len(outer.plans) == 1


def test_a_call_that_raises_keeps_nothing(fake_cupy):
    @fast_path.remembered
    def forward(q, *, bad=False):
        if bad:
            raise ValueError("refused")
        return fast_path.launch(Plan([]), q)

    a = FakeArray(SHAPE)
    for _ in range(2):
        with pytest.raises(ValueError, match="refused"):
            forward(a, bad=True)
    assert forward.plans == {}
    fast_path.launch(Plan([]), a)  # outside any remembered call: runs, keeps nothing
    assert forward.plans == {}


def test_joint_outputs_layout_aligns_each_array_to_256_bytes():
    layout, nbytes = fast_path.out_layout([((3, 5), np.float16), ((7,), np.float32)])
    assert layout == (((3, 5), np.dtype(np.float16), 0), ((7,), np.dtype(np.float32), 256)) and nbytes == 512


def test_keep_keeps_the_plan_of_the_calls_own_arrays_only(fake_cupy):
    """The run step's keep(plan, *arrays) keeps plan for the call's key when the arrays are the call's own objects,
    in order (q is k is v included: positions, not values); a run step on other arrays (a copy, a reshaped input,
    the order changed) keeps nothing, and neither does a second run step of the same call."""
    log = []

    @fast_path.remembered
    def forward(q, k, v, *, mode="own"):
        log.append("checked")
        if mode == "copy":
            q = FakeArray(q.shape)  # what a launcher that copies or reshapes an input hands on
        if mode == "swap":
            q, k = k, q
        out = fast_path.keep(Plan(log), q, k, v)(q, k, v)
        if mode == "twice":
            fast_path.keep(Plan(log), q, k, v)  # the first run step of a call decides
        return out

    a, b, c = FakeArray(SHAPE), FakeArray(SHAPE), FakeArray(SHAPE)
    for mode in ("copy", "swap"):
        forward(a, b, c, mode=mode)
        forward(a, b, c, mode=mode)
    assert forward.plans == {} and log.count("checked") == 4
    forward(a, a, a)  # one array three times: kept, by position
    forward(a, b, c, mode="twice")
    assert len(forward.plans) == 2
    log.clear()
    forward(c, b, a)
    forward(b, c, a, mode="twice")
    assert log == [("run", True), ("run", True)]  # both replayed: the same keys, new arrays


def test_run_forward_hands_keep_its_plan_with_joint_outputs(fake_cupy, monkeypatch):
    """launch.run_forward, the last step of every forward launcher, keeps a ForwardLaunch of its launch, the outputs'
    dtype, the arrays after lse and whether the kernel merges, with o (B, H, Nq, D) and lse (B, H, Nq) float32 laid
    out in one allocation; a replay runs that plan without the launcher."""
    runs = []
    monkeypatch.setattr(launch.ForwardLaunch, "__call__", lambda self, q, k, v: runs.append(self) or ("o", "lse"))
    calls = []

    @fast_path.remembered
    def forward(q, k, v, *, causal=False):
        calls.append(causal)
        return launch.run_forward("the launch", q, k, v, np.float16, "slopes", launch.NULL, merges=causal)

    q, k = FakeArray((2, 3, 100, 64), np.float16), FakeArray((2, 3, 70, 64), np.float16)
    assert forward(q, k, k, causal=True) == ("o", "lse") and forward(q, k, k, causal=True) == ("o", "lse")
    assert calls == [True] and runs[0] is runs[1]  # the second call ran the kept plan, without the launcher
    plan = runs[0]
    assert (plan.launch, plan.odtype, plan.extra, plan.merges) == ("the launch", np.float16, ("slopes", launch.NULL),
                                                                   True)
    (o_shape, o_dtype, o_at), (l_shape, l_dtype, l_at) = plan.outs[0]
    assert (o_shape, o_dtype, l_shape, l_dtype) == ((2, 3, 100, 64), np.float16, (2, 3, 100), np.float32)
    assert o_at == 0 and l_at == 2 * 3 * 100 * 64 * 2 and plan.outs[1] == l_at + 2560  # 2400 bytes of lse, to 256
    launch.run_forward("the launch", q, k, k, np.float16)  # outside a remembered call: runs, keeps nothing
    assert runs[-1].outs is None and len(forward.plans) == 1
