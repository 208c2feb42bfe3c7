"""stages/common/fast_path.py on a CPU: which calls share a key, and which plans a @remembered function keeps.

The GPU side (a repeat gives the same bits, bad input after a good call is still refused) is in the stages' gpu
tests: test_02_flash_v2.py and test_03_flash_v2_backward.py, test_gpu_a_repeated_call_is_checked_and_planned_....
"""
import sys
import types

import numpy as np
import pytest

from stages.common import device, fast_path


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
