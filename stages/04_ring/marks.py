"""Stage 04: timing marks of a ring call, taken only when asked.

    ring_forward(..., timeline=tl)      tl receives one dict per step with work: {step, compute_ms, exposed_ms}
                                        (exposed: the compute stream waited for a transfer)
    with marks.tracing() as phases:     every phase of every ring call inside the block, as dicts
        ring_forward(...)               {call, phase, step, half, start_ms, gpu_ms, host_ms} (a measurement aid for
                                        dev/bench_rank.py: allocations, fills, copies, each step's wait and calls,
                                        merges, casts)

A mark is a CUDA event recorded on the compute stream (the host clock on the CPU) and the host's clock: the GPU time
between two marks is what the GPU did between them, the host time what the host spent queueing it. Without a timeline
or a trace no mark is taken, so an untimed call records no event.
"""
import contextlib
import time

import numpy as np

_TRACE = []  # the lists of the open tracing() blocks (the innermost receives)


@contextlib.contextmanager
def tracing():
    """A list that receives every phase of every ring call made inside the `with` block."""
    phases = []
    _TRACE.append(phases)
    try:
        yield phases
    finally:
        _TRACE.remove(phases)


class Marks:
    """The marks of one ring call (`what`: "forward" or "backward")."""

    def __init__(self, xp, timeline=None, what="forward"):
        self.xp, self.timeline, self.what = xp, timeline, what
        self.trace = _TRACE[-1] if _TRACE else None
        self.on = timeline is not None or self.trace is not None
        self.steps, self.phases, self.first = [], [], None
        if xp is np or not self.on:
            self._event, self._ms = time.perf_counter, lambda a, b: (b - a) * 1e3
        else:
            import cupy

            self._event, self._ms = (lambda: cupy.cuda.get_current_stream().record()), cupy.cuda.get_elapsed_time
        self.first = self.mark()

    def mark(self):
        """(event, host clock) now, or None when nothing is asked."""
        return (self._event(), time.perf_counter()) if self.on else None

    def add(self, s, compute, waited=None, half=None):
        """Step s (half h) computed over compute and waited over waited, each (start mark, end mark) or None."""
        if not self.on:
            return
        self.steps.append((s, compute, waited))
        for name, span in (("compute", compute), ("wait", waited)):
            if span:
                self.phase(name, *span, step=s, half=half)

    @contextlib.contextmanager
    def span(self, name, step=None, half=None):
        """The work queued inside the `with` block, as phase `name` (traced calls only)."""
        start = self.mark()
        yield
        self.phase(name, start, self.mark(), step, half)

    def phase(self, name, start, end, step=None, half=None):
        """A named phase between two marks (traced calls only)."""
        if self.trace is not None and start is not None:
            self.phases.append((name, start, end, step, half))

    def record(self):
        """Append the steps to the timeline and the phases to the trace (waits for the GPU first)."""
        if not self.on:
            return
        self.phase("call", self.first, self.mark())
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()
        if self.timeline is not None:
            per_step = {}
            for s, compute, waited in self.steps:
                step = per_step.setdefault(s, {"step": s, "compute_ms": 0.0, "exposed_ms": 0.0})
                step["compute_ms"] += self._ms(compute[0][0], compute[1][0]) if compute else 0.0
                step["exposed_ms"] += self._ms(waited[0][0], waited[1][0]) if waited else 0.0
            self.timeline.extend(per_step.values())
        if self.trace is not None:
            for name, (e0, h0), (e1, h1), step, half in self.phases:
                self.trace.append({"call": self.what, "phase": name, "step": step, "half": half,
                                   "start_ms": self._ms(self.first[0], e0), "gpu_ms": self._ms(e0, e1),
                                   "host_ms": (h1 - h0) * 1e3})


def one_call(xp, timeline, what, fn):
    """fn(): the ring of one rank with one block call over the whole shard (Problem.whole_call), timed as step 0
    when timeline is a list."""
    marks = Marks(xp, timeline, what)
    t0 = marks.mark()
    out = fn()
    marks.add(0, (t0, marks.mark()) if marks.on else None)
    marks.record()
    return out
