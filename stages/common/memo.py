"""last_call: a function that remembers its last call, keyed on its arguments' values.

The tolerance rule's pieces are pure functions of the inputs: a check of the forward and one of the backward on the
same inputs (verify.check_forward, then check_backward; verify.rule) share the oracle's forward and S's roundings
instead of computing them twice, and checks of several answers on the same inputs share the whole rule
(verify.forward_rule, backward_rule).
"""
import functools
import hashlib

import numpy as np

from .inputs import to_numpy


def _contents(x):
    """A key for x by value: an array (numpy or CuPy) by its shape, dtype and a hash of its bytes; a dict, tuple or
    list by its items; anything else as it is."""
    if isinstance(x, dict):
        return tuple(sorted((name, _contents(v)) for name, v in x.items()))
    if isinstance(x, (tuple, list)):
        return tuple(_contents(v) for v in x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        a = np.ascontiguousarray(to_numpy(x))
        return a.shape, str(a.dtype), hashlib.blake2b(a.tobytes(), digest_size=16).digest()
    return type(x).__name__, x


def last_call(f):
    """f remembering its last call, keyed on its arguments' values (_contents). The arrays it returns are read-only,
    since every caller of those arguments gets the same ones."""
    last = {}

    @functools.wraps(f)
    def remembered(*args, **kw):
        key = _contents((args, kw))
        if last.get("key") != key:
            out = f(*args, **kw)
            for x in out:
                if isinstance(x, np.ndarray):
                    x.flags.writeable = False
            last.update(key=key, out=out)
        return last["out"]
    return remembered
