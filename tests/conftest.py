"""Shared fixtures: the case list every stage is tested on (docs/DESIGN.md, "The chain of checks"), markers, poisoned
outputs."""
import numpy as np
import pytest

from stages.common import has_gpu, verify

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


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found: CuPy sees no device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every test runs with NaN-poisoned output buffers: an unwritten element fails the check."""
    monkeypatch.setattr(verify, "POISON_OUTPUTS", True)


@pytest.fixture
def rng():
    """Fresh inputs every run (no fixed seed), as the chain of checks requires."""
    return np.random.default_rng()
