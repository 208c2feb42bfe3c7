"""Stage 04: how a rank computes its block calls: which kernel, side by side on which streams.

A block call (shards.BlockCall) is rows q_start:q_stop of the query shard against keys k_start:k_stop of the block
the rank holds. Compute runs each call with one of three kinds of kernel:

  * fused, the fast path on a GPU: the kernel adds its result into the ring's float32 accumulators itself (forward:
    O_rj, L_rj merged into O_r, L_r in its epilogue; backward: dQ_r, dK_j, dV_j added with atomics) and reads the
    rows and keys in place. Stage 06's kernels where a later stage registered them and they take the problem
    (stages/common/attention_registry.py; on an sm_90 GPU once `stages.hopper` is imported: grouped-query heads,
    windows, softcap and ALiBi, not dropout), else stages 02/03's tensor-core kernels through their launchers' ring
    entry points: forward, stage 02 version pipelined, launched by merge_into in stages/02_flash_v2/tc.py (the
    tensor-core launchers; the merge itself is merge_row_into_running in kernels/attention_tiles.cuh, called from the
    pipelined kernel's epilogue); backward, stage 03 version tc, launched by accumulate_into in
    stages/03_flash_v2_backward/tc.py. Both take the call's mask and options the same way (_options) and add dK_j,
    dV_j of a group of query heads into its one k / v head.
  * a block function of BLOCKS, elsewhere (numpy, stage 00 blocks, the float32 kernels): the call returns its partial
    result in float32 and merge() / += add it (the same arithmetic).
  * one call over the whole problem (a ring of one rank, or a scheme's single-device call): the kernel writes the
    outputs in the inputs' dtype itself.

A step's fused calls are smaller than one device's whole problem, and a kernel's last wave of thread blocks leaves SMs
idle, so they run side by side on streams of their own wherever they cannot touch the same accumulator values but
through atomics: every call of a backward step, the calls on disjoint query rows of a forward step (lanes()).
"""
import functools

import numpy as np

from stages import flash_v2, flash_v2_backward, naive
from stages.flash_v2 import tc as tc_forward  # stage 02's tensor-core launchers: merge_into, the forward's fused call
from stages.flash_v2_backward import tc as tc_backward  # stage 03's: accumulate_into, the backward's fused call
from stages.common import attention_registry, cast, kernels, variants

from . import candidates

__all__ = ["BLOCKS", "Compute", "default_block", "partial_dtype", "forward_accumulators", "backward_accumulators",
           "merge_kernel", "flash_version", "registered_for", "hopper_takes", "hopper_backward_takes",
           "problem_options", "one_device_forward", "one_device_backward", "lanes"]


def default_block(block, q):
    """block, or for None the block kernels of q's device: "flash" on CuPy arrays, "naive" on numpy arrays (ring.py
    says why)."""
    return block if block is not None else ("naive" if isinstance(q, np.ndarray) else "flash")


def partial_dtype(dtype):
    """The dtype of a block's partial result and of the ring's accumulators: float32 (float64 for float64 inputs), so
    the ring merges and adds in float32 and rounds once at the end, as one device's kernel does."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# The block functions: one (query rows, key block) call returning its partial result. They take the mask of the call
# (causal, window) and the options of the whole problem (softcap, alibi_slopes, dropout_p, seed, origin); out_dtype:
# the partial result's dtype (None: the inputs', for a call that is the whole problem).
#   "flash": stage 02 forward / stage 03 backward: the CUDA kernels on CuPy arrays, their numpy tile mirrors on numpy
#            arrays (exact but slow on the CPU). version: the stage 02/03 version (None: "auto").
#   "naive": stage 00, computed as a kernel computes for the dtype (fast on the CPU; it materialises S).
def _flash_forward(q, k, v, *, causal, scale, version=None, out_dtype=None, **opts):
    return flash_v2.forward(q, k, v, causal=causal, scale=scale, version=version or "auto", out_dtype=out_dtype,
                            **opts)


def _flash_backward(q, k, v, o, lse, do, *, causal, scale, version=None, out_dtype=None, **opts):
    return flash_v2_backward.backward(q, k, v, o, cast(lse, np.float32), do, causal=causal, scale=scale,
                                      version=version or "auto", out_dtype=out_dtype, **opts)


def _naive_forward(q, k, v, *, causal, scale, version=None, out_dtype=None, **opts):
    return naive.forward(q, k, v, causal=causal, scale=scale, out_dtype=out_dtype, **opts)


def _naive_backward(q, k, v, o, lse, do, *, causal, scale, version=None, out_dtype=None, **opts):
    return naive.backward(q, k, v, o, lse, do, causal=causal, scale=scale, out_dtype=out_dtype, **opts)


BLOCKS = {"flash": (_flash_forward, _flash_backward), "naive": (_naive_forward, _naive_backward)}


def forward_accumulators(prob, dtype):
    """The forward's O_r = 0 and L_r = -inf (float32: nothing merged yet)."""
    xp, acc, shape = prob.xp, partial_dtype(dtype), (prob.B, prob.H, prob.Tq, prob.D)
    lse_run = xp.full(shape[:3], -np.inf, dtype=acc)
    if candidates.on("fold"):  # measurement hook (candidates.py, off by default): O_r left unfilled where a block
        return candidates.o_unfilled(prob, shape, acc), lse_run  # writes it first
    return xp.zeros(shape, dtype=acc), lse_run


def backward_accumulators(prob, o, lse, do):
    """(o, lse, do, dQ_r): the forward's result as the kernels read it (row-major, L in float32) with dO = 0 on the
    padding rows (a padded query row then sends no gradient: dS = 0 there), and the float32 dQ_r = 0."""
    acc = partial_dtype(do.dtype)
    o, lse, do = kernels.row_major(o), kernels.row_major(lse, dtype=acc), kernels.row_major(prob.without_padding(do))
    return o, lse, do, prob.xp.zeros((prob.B, prob.H, prob.Tq, prob.D), dtype=acc)


@functools.cache
def merge_kernel():
    """ring.merge's last line on the GPU, one pass over O: O_a = O_a w_a + O_b w_b, O_a not read where w_a = 0 (w
    broadcast over D)."""
    import cupy

    return cupy.ElementwiseKernel("T w_a, T o_b, T w_b", "T o_a", "o_a = (w_a != 0 ? o_a * w_a : (T)0) + o_b * w_b",
                                  "ring_merge_o")


def flash_version(dtype, version=None):
    """The stage 02 forward version the "flash" blocks run for a dtype (what stage 02's "auto" picks)."""
    return flash_v2.resolve_version(version or "auto", dtype)


DEFAULT_FORWARD = (None, "auto", "pipelined")  # the forward versions that mean "what stage 02's auto picks"
DEFAULT_BACKWARD = (None, "auto", "tc")  # the backward versions that mean "what stage 03's auto picks"


def registered_for(dtype, D, *, H, Hkv, B, version=None, options=(), backward=False):
    """The registered kernels (attention_registry.find) that take this problem on this GPU at the default stage 02
    version (backward: stage 03's), or None. options: the names of the variant options in use (window, softcap,
    alibi_slopes, dropout_p); grouped-query heads are Hkv < H. Naming a stage 02/03 version keeps stages 02/03."""
    if version not in (DEFAULT_BACKWARD if backward else DEFAULT_FORWARD):
        return None
    return attention_registry.find(dtype, D, heads=H, kv_heads=Hkv, batch=B, options=options, backward=backward)


def hopper_takes(dtype, D, *, H, Hkv, B, version=None, options=()):
    """Whether the flash forward runs registered kernels for this problem (so far only stage 06 registers: on an
    sm_90 GPU, once `stages.hopper` is imported; hence the name)."""
    return registered_for(dtype, D, H=H, Hkv=Hkv, B=B, version=version, options=options) is not None


def hopper_backward_takes(dtype, D, *, H, Hkv, B, version=None, options=()):
    """Whether the flash backward runs registered kernels: at the default stage 03 version, where some registered
    kernels take the problem forward and backward."""
    return registered_for(dtype, D, H=H, Hkv=Hkv, B=B, version=version, options=options, backward=True) is not None


def problem_options(prob):
    """The names of the variant options a ring problem uses (attention_registry.OPTIONS): what the registered kernels
    must take besides its shapes."""
    return attention_registry.options_in_use(window=prob.window, softcap=prob.softcap, alibi_slopes=prob.alibi_slopes,
                                             dropout_p=prob.dropout_p)


def on_gpu(prob):
    """Whether the problem's arrays are GPU (CuPy) arrays, the only ones registered kernels are handed."""
    return prob.xp is not np


def _registered_blocks(prob, dtype, version, backward):
    """The registered kernels that compute this problem's fused block calls on a GPU at the default versions (any
    grouped-query heads, window, softcap and ALiBi they take; dropout: stages 02/03), or None."""
    if not on_gpu(prob):
        return None
    return registered_for(dtype, prob.D, H=prob.H, Hkv=prob.Hkv, B=prob.B, version=version,
                          options=problem_options(prob), backward=backward)


def _registered_call(q, k, version, kw, backward):
    """(kernels, keywords) for one device's whole call on GPU arrays with keyword options kw, when registered kernels
    take it (every keyword but causal and scale a variant option they take); else (None, None)."""
    if isinstance(q, np.ndarray) or kw.keys() - {"causal", "scale", "seed"} - attention_registry.OPTIONS:
        return None, None
    options = attention_registry.options_in_use(**kw)
    kernels = registered_for(q.dtype, q.shape[3], H=q.shape[1], Hkv=k.shape[1], B=q.shape[0], version=version,
                             options=options, backward=backward)
    if kernels is None:
        return None, None
    return kernels, {key: val for key, val in kw.items() if key in ("causal", "scale") or key in options}


def one_device_forward(q, k, v, *, version="auto", **kw):
    """The forward one device runs for the ring's flash blocks (the yardstick of the ring's efficiency): the registered
    kernels for GPU arrays where they take the problem and its options (window, softcap, ALiBi: stage 06; not
    dropout), else stage 02's forward at that version (numpy arrays: its tile mirrors)."""
    kernels, options = _registered_call(q, k, version, kw, backward=False)
    if kernels is not None:
        return kernels.forward(q, k, v, **options)
    return flash_v2.forward(q, k, v, version=version or "auto", **kw)


def one_device_backward(q, k, v, o, lse, do, *, version="auto", **kw):
    """The backward one device runs for the ring's flash blocks: the registered kernels for GPU arrays where they take
    the problem and its options backward (hopper_backward_takes), else stage 03's at that version."""
    kernels, options = _registered_call(q, k, version, kw, backward=True)
    if kernels is not None:
        return kernels.backward(q, k, v, o, lse, do, **options)
    return flash_v2_backward.backward(q, k, v, o, lse, do, version=version or "auto", **kw)


def lanes(calls, by_rows):
    """The calls of one step in lanes that may run at the same time, each lane in order: a lane per call, or (by_rows)
    calls whose query rows overlap in one lane. A call that overlaps several lanes joins them into one, so no two
    lanes share a row."""
    if not by_rows:
        return [[c] for c in calls]
    out = []  # [(first row, stop row, [calls])]: the rows each lane spans, disjoint from every other lane's
    for c in calls:
        hit = [lane for lane in out if c.q_start < lane[1] and lane[0] < c.q_stop]
        joined = [x for lane in hit for x in lane[2]] + [c]
        out = [lane for lane in out if lane not in hit]
        out.append((min([c.q_start] + [lane[0] for lane in hit]), max([c.q_stop] + [lane[1] for lane in hit]), joined))
    return [lane[2] for lane in out]


@functools.cache
def _side_streams(device, n=4):
    """n CUDA streams of this device for a step's concurrent calls (made once)."""
    import cupy

    return [cupy.cuda.Stream(non_blocking=True) for _ in range(n)]


def _rows(x, start, stop):
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    return xp.ascontiguousarray(x[:, :, start:stop])  # (B, H, stop - start, ...)


class Compute:
    """The block calls of one ring call (one direction): fused kernels, or the block functions of BLOCKS with merge()
    (handed in by ring.py, which holds it) and +=."""

    def __init__(self, prob, block, version, dtype, *, backward, merge=None):
        self.prob, self.version, self.merge, self.backward = prob, version, merge, backward
        self.fwd, self.bwd = BLOCKS[block]
        self.registered = _registered_blocks(prob, dtype, version, backward) if block == "flash" else None
        self.fused = self.registered is not None
        if block == "flash" and prob.xp is not np and not self.fused:
            try:
                self.fused = (flash_v2_backward.resolve_version(version or "auto", dtype) == "tc" if backward
                              else flash_version(dtype, version) == "pipelined")
            except (TypeError, ValueError):  # a dtype or version the kernels refuse: the block call says so
                self.fused = False
        self.qpos = prob.qpos()

    def kernel_name(self):
        """What computes the block calls, in words (run.py's header)."""
        return self.registered.name if self.registered else "stages 02/03"

    # ------------------------------------------------------------------ one call over the whole problem
    def whole_forward(self, q, k, v, c, kpos):
        """One rank's whole problem as one call c: the kernel writes (o, lse) in the inputs' dtype itself."""
        prob, options = self.prob, self.prob.options(self.qpos, kpos, c)
        if self.registered:
            return self.registered.forward(q, k, v, scale=prob.scale, **c.mask(), **self._theirs(options))
        return self.fwd(q, k, v, scale=prob.scale, version=self.version, **c.mask(), **options)

    def whole_backward(self, q, k, v, o, lse, do, c, kpos):
        """One rank's whole problem as one call c: the kernel writes (dq, dk, dv) in the inputs' dtype itself."""
        prob, options = self.prob, self.prob.options(self.qpos, kpos, c)
        if self.registered:
            return self.registered.backward(q, k, v, o, cast(lse, np.float32), do, scale=prob.scale, **c.mask(),
                                            **self._theirs(options))
        return self.bwd(q, k, v, o, lse, do, scale=prob.scale, version=self.version, **c.mask(), **options)

    def _theirs(self, options):
        """The problem's options (Problem.options of a whole call) as the registered kernels take them: those of
        theirs (softcap, alibi_slopes); the rest are off (dropout) or say the call is the whole problem (origin)."""
        return {key: val for key, val in options.items() if key in self.registered.options}

    # ------------------------------------------------------------------ the calls of one step
    def forward_step(self, q, k, v, o_run, lse_run, calls, kpos):
        """Every call of one forward step, merged into O_r, L_r."""
        self._run(lanes(calls, by_rows=True), lambda c: self.forward_call(q, k, v, o_run, lse_run, c, kpos))

    def backward_step(self, q, k, v, o, lse, do, dq_run, dk_run, dv_run, calls, kpos):
        """Every call of one backward step, added into dQ_r, dK_j, dV_j."""
        self._run(lanes(calls, by_rows=False),
                  lambda c: self.backward_call(q, k, v, o, lse, do, dq_run, dk_run, dv_run, c, kpos))

    def _run(self, step_lanes, call):
        """call(c) for every call of the lanes: lane after lane on the compute stream, or, fused on the GPU, each lane
        on a side stream that starts after the work queued so far, with the compute stream waiting for them all."""
        serial = candidates.on("serial-bwd" if self.backward else "serial-fwd")
        if not self.fused or len(step_lanes) < 2 or serial:
            for lane in step_lanes:
                for c in lane:
                    call(c)
            return
        import cupy

        main = cupy.cuda.get_current_stream()
        ready, done = main.record(), []
        sides = _side_streams(cupy.cuda.Device().id)
        for i, lane in enumerate(step_lanes):
            side = sides[i % len(sides)]
            side.wait_event(ready)
            with side:
                for c in lane:
                    call(c)
            done.append(side.record())
        for event in done:
            main.wait_event(event)

    def _options(self, q, k, kpos, c):
        """(causal, variants.Options or None) of call c for the fused kernels (registered or stage 02/03): its mask,
        and the problem's softcap, ALiBi, dropout, grouped-query heads; None for plain or causal attention."""
        mask = c.mask()
        if self.prob.plain and "window" not in mask:
            return mask["causal"], None
        opts = variants.check(q[:, :, c.q_start:c.q_stop], k[:, :, c.k_start:c.k_stop], causal=mask["causal"],
                              window=mask.get("window"), **self.prob.options(self.qpos, kpos, c))
        return mask["causal"], None if opts.plain else opts

    def forward_call(self, q, k, v, o_run, lse_run, c, kpos):
        """Rows q_start:q_stop of q against keys k_start:k_stop of k, v, merged into those rows of o_run, lse_run."""
        prob, rows, keys = self.prob, (c.q_start, c.q_stop), (c.k_start, c.k_stop)
        if self.fused:  # the kernel merges into the accumulators: the registered kernels' or stage 02's
            causal, opts = self._options(q, k, kpos, c)
            merge_into = self.registered.merge_into if self.registered else tc_forward.merge_into
            merge_into(q, k, v, o_run, lse_run, rows, keys, causal=causal, scale=prob.scale, opts=opts)
        else:
            (q0, q1), (k0, k1) = rows, keys
            o_b, lse_b = self.fwd(_rows(q, q0, q1), _rows(k, k0, k1), _rows(v, k0, k1), scale=prob.scale,
                                  version=self.version, out_dtype=partial_dtype(q.dtype), **c.mask(),
                                  **prob.options(self.qpos, kpos, c))  # O_rj, L_rj: (B, H, q1 - q0, [D])
            self.merge(o_run[:, :, q0:q1], lse_run[:, :, q0:q1], o_b, lse_b)  # in place on rows q0:q1 of O_r, L_r

    def backward_call(self, q, k, v, o, lse, do, dq_run, dk_run, dv_run, c, kpos):
        """The gradients of block call c, added into rows q_start:q_stop of dq_run and keys k_start:k_stop of dk_run,
        dv_run."""
        prob, rows, keys = self.prob, (c.q_start, c.q_stop), (c.k_start, c.k_stop)
        if self.fused:  # the kernels add into the accumulators: the registered kernels' or stage 03's
            causal, opts = self._options(q, k, kpos, c)
            accumulate_into = self.registered.accumulate_into if self.registered else tc_backward.accumulate_into
            accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, causal=causal, scale=prob.scale,
                            opts=opts)  # dk_run, dv_run: (B, Hkv, Tk, D), each group's sum added once
        else:
            (q0, q1), (k0, k1) = rows, keys
            dq_b, dk_b, dv_b = self.bwd(_rows(q, q0, q1), _rows(k, k0, k1), _rows(v, k0, k1), _rows(o, q0, q1),
                                        _rows(lse, q0, q1), _rows(do, q0, q1), scale=prob.scale, version=self.version,
                                        out_dtype=partial_dtype(q.dtype), **c.mask(),
                                        **prob.options(self.qpos, kpos, c))
            xp = prob.xp
            xp.add(dq_run[:, :, q0:q1], dq_b, out=dq_run[:, :, q0:q1])  # dQ_r += dS_rj K_j   (scale included)
            xp.add(dk_run[:, :, k0:k1], dk_b, out=dk_run[:, :, k0:k1])  # dK_j += dS_rj^T Q_r
            xp.add(dv_run[:, :, k0:k1], dv_b, out=dv_run[:, :, k0:k1])  # dV_j += P_rj^T dO_r
