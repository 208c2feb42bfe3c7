"""Stage 04: ring attention (Liu, Zaharia & Abbeel 2023, arXiv 2310.01889), the algorithm.

The sequence is split across P ranks. Rank r keeps its query shard Q_r for the whole call and
the key/value shards travel around the ring: at step s it holds the block K_j, V_j of rank
j = (r - s) mod P, computes that block's partial attention with a single-device kernel
(stage 02 forward, stage 03 backward), and passes the block on to rank r + 1.

Forward (per rank, P steps):
    O_r, L_r = 0, -inf
    for s in 0..P-1:                           j = (r - s) mod P
        O_rj, L_rj = attention(Q_r, K_j, V_j)                  the block's own softmax
        O_r, L_r = merge(O_r, L_r, O_rj, L_rj)                 log-sum-exp merge, fp32
        pass K_j, V_j to r+1                                   (in flight while we compute the next block)
Backward: with the final O_r and the global L_r, P_rj = exp(S_rj - L_r) is already the exact
softmax restricted to block j, so each block's backward gives exact partial dQ_r, dK_j, dV_j.
dQ_r stays home; dK_j, dV_j are float32 accumulators that travel WITH K_j, V_j and arrive back
at rank j after the last step.

How a block travels (what makes the ring pay on real GPUs):
  * Forward: whole blocks, double-buffered. The next K_j, V_j lands in a second buffer while the current one is
    computed (one kernel call per step and mask run: long loops over many keys, which is what keeps the kernels fast).
  * Backward: in halves. The block (K_j, V_j and the float32 dK_j, dV_j summed so far) is cut into two halves by
    key rows (layout.halves), each one contiguous slot of bytes. The rank computes with half 0 while half 1 is still
    arriving, then sends half 0 on while it computes with half 1: every transfer hides behind the other half's
    compute, and dK_j, dV_j are added to in place because they arrived before the compute that adds to them. A rank
    holds a block and a half (the half in flight lands in a spare), not the two blocks and two gradient buffers of
    a double-buffered ring: its memory is its shards, its accumulators and 1.5 blocks.
  * Merged where it is computed. On the GPU the kernels add each block into the ring's float32 accumulators
    themselves: version pipelined (or stage 06's forward on an sm_90 GPU, hopper_blocks) merges O_rj, L_rj into
    O_r, L_r in its epilogue, version tc (or stage 06's backward, hopper_backward_blocks) adds dQ, dK, dV with
    atomics; no block leaves a partial result behind. Elsewhere (numpy, stage 00 blocks, the float32 kernels) a block
    returns its partial result and merge() / += add it (the same arithmetic).
  * No copies: a block call reads rows q_start:q_stop of the shard and keys k_start:k_stop of the half in place.
  * Side by side: a step's calls run on side streams at once where they cannot touch the same values but through
    atomics (_Blocks), so that one call's last wave of thread blocks does not leave SMs idle.

Causal across shards, sliding windows, the layouts (contiguous, zigzag), padding to any length, `block_calls`
(which kernel calls cover exactly the visible (query, key) pairs), `halves` and `steps` (the steps at which some rank
has work) live in layout.py. With a window most steps have no work: the loops run over `steps` only, the halves hop
straight to the next such step, and dK_j, dV_j go home in one hop after the last. Grouped-query K, V travel with
their own Hkv heads. ALiBi and dropout see each pair's global indices: every block call is told where it sits in
the whole problem (origin = the global query row and key of its first row and key), so its bias and its dropout
bits are those of the whole problem, and the ring gives the one-device result, mask and all.

Two other ways to split the sequence take the same arguments and give the same result (scheme=): "allgather" (K, V
gathered once, as Llama 3 trains) and "alltoall" (heads scattered, as DeepSpeed-Ulysses); gather.py says how they
move the data and when each wins.

The communication is comm.py's; this file holds the schedule, the merge and the block calls. It runs unchanged on
numpy (CPU) and CuPy (GPU) arrays.
"""
import dataclasses
import functools
import time

import numpy as np

from stages import naive
from stages.common import (
    cast, check_attention_inputs, check_backward_inputs, check_causal, kernels, resolve_scale, variants,
)

from . import gather
from .gather import SCHEMES, check_scheme
from .layout import (
    LAYOUTS, _runs, block_calls, check_layout, check_ranks, halves, positions, shard, shard_len, steps, unshard,
)

__all__ = ["ring_forward", "ring_backward", "merge", "forward", "backward", "BLOCKS", "flash_version", "hopper_blocks",
           "hopper_takes", "hopper_backward_blocks", "hopper_backward_takes", "one_device_forward",
           "one_device_backward", "RingMismatch", "check_same_everywhere", "LAYOUTS", "block_calls",
           "positions", "shard", "shard_len", "unshard", "steps", "schedule", "memory_per_token", "SCHEMES"]


# ----------------------------------------------------------------------------- block kernels
# How one (query shard, key block) call is computed when its kernel does not add into the ring's accumulators
# itself. Each returns the block's partial result in float32 (float64 for float64 inputs): O_rj, and the parts of
# dQ_r, dK_j, dV_j, straight from the kernels' float32 accumulators, never rounded to 16 bits. The ring merges and
# adds them in float32 and rounds once at the end, as a single-device kernel rounds its accumulators once, so the
# ring's error does not grow with P.
#   "flash": stage 02 forward / stage 03 backward: the CUDA kernels on CuPy arrays, their numpy tile mirrors on
#            numpy arrays (exact but slow on the CPU). version: the stage 02/03 version (None: "auto").
#   "naive": stage 00, computed as a kernel computes for the dtype (fast on the CPU, but it materialises the
#            block's score matrix).
def _partial_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# Every block takes the mask of its call (causal, window) and the options of the whole problem (**opts: softcap,
# alibi_slopes, dropout_p, seed, origin). out_dtype: the partial result's dtype (None: the inputs', for a call that
# is the whole problem).
def _flash_forward(q, k, v, *, causal, scale, version=None, out_dtype=None, **opts):
    from stages import flash_v2

    return flash_v2.forward(q, k, v, causal=causal, scale=scale, version=version or "auto", out_dtype=out_dtype,
                            **opts)


def _flash_backward(q, k, v, o, lse, do, *, causal, scale, version=None, out_dtype=None, **opts):
    from stages import flash_v2_backward

    return flash_v2_backward.backward(q, k, v, o, cast(lse, np.float32), do, causal=causal, scale=scale,
                                      version=version or "auto", out_dtype=out_dtype, **opts)


def _naive_forward(q, k, v, *, causal, scale, version=None, out_dtype=None, **opts):
    return naive.forward(q, k, v, causal=causal, scale=scale, out_dtype=out_dtype, **opts)


def _naive_backward(q, k, v, o, lse, do, *, causal, scale, version=None, out_dtype=None, **opts):
    return naive.backward(q, k, v, o, lse, do, causal=causal, scale=scale, out_dtype=out_dtype, **opts)


BLOCKS = {
    "flash": (_flash_forward, _flash_backward),
    "naive": (_naive_forward, _naive_backward),
}


def flash_version(dtype, version=None):
    """The stage 02 forward version the "flash" blocks run for a dtype (what stage 02's "auto" picks)."""
    from stages import flash_v2

    return flash_v2.resolve_version(version or "auto", dtype)


DEFAULT_FORWARD = (None, "auto", "pipelined")  # the forward versions that mean "what stage 02's auto picks"
DEFAULT_BACKWARD = (None, "auto", "tc")  # the backward versions that mean "what stage 03's auto picks"


def hopper_takes(dtype, D, *, H, Hkv, B, version=None):
    """Whether the flash forward is stage 06's (FlashAttention-3) for plain attention of this shape: at the default
    version (naming stage 02's "tc" keeps stage 02), on a GPU and a problem stage 06 takes (flash_v3.takes)."""
    if version not in DEFAULT_FORWARD:
        return False
    from stages.hopper import flash_v3

    return flash_v3.takes(dtype, D, heads=H, kv_heads=Hkv, batch=B)


def hopper_blocks(prob, dtype, version):
    """Whether the flash forward blocks of this problem are stage 06's, merged into O_r, L_r in their epilogue as
    stage 02's pipelined blocks are: hopper_takes, for a problem with no window and no option that acts on scores
    (a call whose mask is a band still goes to stage 02)."""
    banded = prob.window not in (None, (-1, -1))  # (-1, -1): the causal mask, no band
    if prob.xp is np or not prob.plain or banded:
        return False
    return hopper_takes(dtype, prob.D, H=prob.H, Hkv=prob.Hkv, B=prob.B, version=version)


def hopper_backward_takes(dtype, D, *, H, Hkv, B, version=None):
    """Whether the flash backward is stage 06's for plain attention of this shape: at the default backward version
    (naming stage 03's "fp32" keeps stage 03), where stage 06's forward is (hopper_takes) and its backward version ws
    takes the head dim (flash_v3_backward.takes_block)."""
    return version in DEFAULT_BACKWARD and hopper_takes(dtype, D, H=H, Hkv=Hkv, B=B) and _ws_takes(dtype, D)


def hopper_backward_blocks(prob, dtype, version):
    """Whether the flash backward blocks of this problem are stage 06's (flash_v3_backward.accumulate_into: dQ, dK, dV
    added into the ring's float32 accumulators by the kernel): as hopper_blocks, with hopper_backward_takes."""
    return version in DEFAULT_BACKWARD and hopper_blocks(prob, dtype, None) and _ws_takes(dtype, prob.D)


def _ws_takes(dtype, D):
    """Whether stage 06's backward version ws takes this dtype and head dim."""
    from stages.hopper import flash_v3_backward

    return flash_v3_backward.takes_block(dtype, D)


def one_device_forward(q, k, v, *, version=None, **kw):
    """The forward one device runs for the ring's flash blocks (the yardstick of the ring's efficiency): stage 06's
    for GPU arrays where hopper_takes and no option but causal and scale is given, else stage 02's forward at that
    version (numpy arrays: its tile mirrors)."""
    from stages import flash_v2

    plain_gpu_call = not isinstance(q, np.ndarray) and not kw.keys() - {"causal", "scale"}
    if plain_gpu_call and hopper_takes(q.dtype, q.shape[3], H=q.shape[1], Hkv=k.shape[1], B=q.shape[0],
                                       version=version):
        from stages.hopper import flash_v3

        return flash_v3.forward(q, k, v, **kw)
    return flash_v2.forward(q, k, v, version=version, **kw)


def one_device_backward(q, k, v, o, lse, do, *, version=None, **kw):
    """The backward one device runs for the ring's flash blocks: stage 06's for GPU arrays where
    hopper_backward_takes and no option but causal and scale is given, else stage 03's at that version."""
    from stages import flash_v2_backward

    plain_gpu_call = not isinstance(q, np.ndarray) and not kw.keys() - {"causal", "scale"}
    if plain_gpu_call and hopper_backward_takes(q.dtype, q.shape[3], H=q.shape[1], Hkv=k.shape[1], B=q.shape[0],
                                                version=version):
        from stages.hopper import flash_v3_backward

        return flash_v3_backward.backward(q, k, v, o, lse, do, **kw)
    return flash_v2_backward.backward(q, k, v, o, lse, do, version=version, **kw)


# ----------------------------------------------------------------------------- the merge
def merge(o_a, lse_a, o_b, lse_b):
    """Combine two partial results over disjoint key sets, in their stable log-sum-exp form.

        L = m + log(exp(L_a - m) + exp(L_b - m)),   m = max(L_a, L_b)
        O = O_a exp(L_a - L) + O_b exp(L_b - L)
    o_a, lse_a are the fp32 accumulators (updated in place and returned); o_b, lse_b the new block.
    A row that saw no key in either part keeps L = -inf and O = 0 (never NaN).
    """
    xp = np if isinstance(o_a, np.ndarray) else __import__("cupy")
    lse_b = lse_b.astype(lse_a.dtype, copy=False)
    m = xp.maximum(lse_a, lse_b)  # (B, H, Nq)
    m = xp.where(xp.isneginf(m), 0.0, m)  # both -inf: any finite m gives exp(-inf) = 0 below
    e_a, e_b = xp.exp(lse_a - m), xp.exp(lse_b - m)  # in [0, 1]: no overflow however large the logits
    total = e_a + e_b  # >= 1 unless the row is empty in both parts
    with np.errstate(divide="ignore"):
        lse_a[...] = m + xp.log(total)  # log(0) = -inf for an empty row
    total = xp.where(total == 0, 1.0, total)
    w_a, w_b = (e_a / total)[..., None], (e_b / total)[..., None]  # exp(L_a - L), exp(L_b - L): (B, H, Nq, 1)
    o_b = cast(o_b, o_a.dtype)
    if xp is np:
        o_a *= w_a
        o_a += o_b * w_b
    else:  # the same two lines fused into one pass over O on the GPU
        _merge_kernel()(w_a, o_b, w_b, o_a)
    return o_a, lse_a


@functools.cache
def _merge_kernel():
    """O_a = O_a * w_a + O_b * w_b as one CuPy elementwise kernel (w broadcast over D)."""
    import cupy

    return cupy.ElementwiseKernel("T w_a, T o_b, T w_b", "T o_a", "o_a = o_a * w_a + o_b * w_b", "ring_merge_o")


def _rows(x, start, stop):
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    return xp.ascontiguousarray(x[:, :, start:stop])  # (B, H, stop - start, ...)


class RingMismatch(ValueError):
    """Ranks called the ring with different shapes/dtype/options, or one rank's inputs are invalid.
    Raised on EVERY rank at once (never a hang in a receive that will not come)."""


def check_same_everywhere(ring, **facts):
    """Every rank must call the ring with the same shapes, dtype and options: a mismatch would make
    the send/recv sizes disagree and hang. Raise on EVERY rank, naming the ranks that differ.
    A rank whose own inputs are invalid sends {"problem": message} instead, and every rank raises that."""
    every = ring.allgather(facts)
    problems = [(r, f["problem"]) for r, f in enumerate(every) if "problem" in f]
    if problems:
        raise RingMismatch("ring attention: " + "; ".join(f"rank {r} cannot run: {msg}" for r, msg in problems))
    bad = [r for r, f in enumerate(every) if f != every[0]]
    if bad:
        keys = sorted({key for r in bad for key in facts if every[r][key] != every[0][key]})
        lines = "\n".join(f"  rank {r}: " + ", ".join(f"{key}={every[r][key]}" for key in keys)
                          for r in range(len(every)))
        raise RingMismatch(f"ring attention: ranks {bad} disagree with rank 0 on {', '.join(keys)} "
                           f"(every rank must pass the same shapes, dtype and options):\n{lines}")


# ----------------------------------------------------------------------------- what every rank agrees on
@functools.lru_cache(maxsize=1024)
def _step_calls(P, r, nq, nk, layout, causal, window, runs, s, h):
    """(calls, key positions) of this rank's queries against half h (None: all) of the block it holds at step s: the
    kernel calls (layout.block_calls) and the global positions of the keys. A pure function of the problem's shape, so
    it is made once per (problem, step, half) and remembered: a repeated ring call splits nothing again."""
    qpos = positions(r, P, nq, layout)
    kpos = positions((r - s) % P, P, nk, layout)
    if h is not None:
        kpos = kpos[halves(shard_len(nk, P, layout), P, layout)[h]]
    return tuple(block_calls(qpos, kpos, nq, nk, causal, window, runs)), kpos


@functools.lru_cache(maxsize=256)
def _gathered(P, r, nq, nk, layout, causal, window, runs):
    """(calls, key positions) of this rank's queries against every key of the sequence, in order (scheme
    "allgather"): one call per run of query rows whose visible keys move the same way, two for causal zigzag."""
    kpos = np.arange(P * shard_len(nk, P, layout))
    return tuple(block_calls(positions(r, P, nq, layout), kpos, nq, nk, causal, window, runs)), kpos


@dataclasses.dataclass(frozen=True)
class Problem:
    """What forward and backward agree on before the ring turns: ranks, this rank, the array module, the shard
    shapes (B, H, Hkv, Lq, Lk, D), the global lengths, the layout, the resolved mask, scale and the options that act
    on scores or probabilities (softcap, ALiBi, dropout), and the steps with work (layout.steps)."""
    P: int
    r: int
    xp: object
    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    nq: int
    nk: int
    layout: str
    causal: bool
    scale: float
    window: object  # (left, right) or None
    softcap: object  # c or None
    alibi_slopes: object  # (H,) or (B, H), or None
    dropout_p: float
    seed: int
    todo: tuple  # the steps at which some rank has work
    scheme: str = "ring"  # SCHEMES: how the ranks share the keys

    @property
    def key_halves(self):
        """The rows of a key block in each half it travels in (layout.halves)."""
        return halves(self.Lk, self.P, self.layout)

    def calls(self, s, h=None):
        """(block calls, key positions) of this rank's queries against half h (None: all) of the block it holds at
        step s."""
        runs = self.alibi_slopes is not None or bool(self.dropout_p)  # each call on consecutive global positions
        return _step_calls(self.P, self.r, self.nq, self.nk, self.layout, self.causal, self.window, runs, s, h)

    def gathered_calls(self):
        """(block calls, key positions) of this rank's queries against the whole sequence of keys (scheme
        "allgather")."""
        runs = self.alibi_slopes is not None or bool(self.dropout_p)
        return _gathered(self.P, self.r, self.nq, self.nk, self.layout, self.causal, self.window, runs)

    def qpos(self):
        return positions(self.r, self.P, self.nq, self.layout)

    def options(self, qpos, kpos, c):
        """The options block call c takes besides its mask (none for plain attention): softcap when set; with ALiBi or
        dropout also where the call sits in the whole problem, origin (global row of its first query, global index
        of its first key, the problem's shift nk - nq)."""
        out = {} if self.softcap is None else {"softcap": self.softcap}
        if self.alibi_slopes is not None or self.dropout_p:
            out.update(alibi_slopes=self.alibi_slopes, dropout_p=self.dropout_p, seed=self.seed,
                       origin=(int(qpos[c.q_start]), int(kpos[c.k_start]), self.nk - self.nq))
        return out

    @property
    def plain(self):
        """No option that acts on scores or probabilities, and one kv head per query head."""
        return self.softcap is None and self.alibi_slopes is None and not self.dropout_p and self.Hkv == self.H

    def whole_call(self):
        """(call, key positions) when this is a ring of one rank with one block call over the whole shard and block
        (plain and causal attention of any length, except odd zigzag lengths), else None. The ring is then one kernel
        call: nothing travels, nothing is merged, and the call writes its result in the inputs' dtype itself."""
        if self.P != 1 or self.todo != (0,):
            return None
        calls, kpos = self.calls(0)
        if len(calls) == 1 and calls[0][:4] == (0, self.Lq, 0, self.Lk):  # q_start, q_stop, k_start, k_stop
            return calls[0], kpos
        return None


def check_block(block, version, where="ring attention"):
    """block must be a key of BLOCKS; version is for the flash blocks only (the naive block has none)."""
    if block not in BLOCKS:
        raise ValueError(f"{where}: block {block!r} is not known; use one of {sorted(BLOCKS)}")
    if block == "naive" and version is not None:
        raise ValueError(f"{where}: block='naive' (stage 00) has no versions, got version={version!r}; "
                         "pass version=None, or block='flash' to run a stage 02/03 version")
    return block


def check_ring_options(q, k, causal, window, softcap, alibi_slopes, dropout_p, seed, where):
    """(window, opts): the window as the ring uses it (None when unbounded) and the checked variants.Options. The ring
    takes every variant of stage 00 but packed variable-length batches: grouped-query k, v, window, softcap, ALiBi
    and dropout."""
    opts = variants.check(q, k, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          dropout_p=dropout_p, seed=seed, where=where)
    window = None if opts.left < 0 and opts.right < 0 else (opts.left, -1 if causal else opts.right)
    return window, opts


def check_dropout_tiles(prob, block, where):
    """Dropout through the CUDA kernels: they draw the mask 16 x 16 blocks at a time, so every block call of this
    rank must start at a global query row and key that are multiples of 16 (variants.check_kernel_origin). That holds
    when the shards are whole 16-row tiles (the backward's halves are cut on the grid too), with a left window side
    only where the band's calls (which start one key apart) still land on the grid.
    A clear error before the ring turns, instead of one in the middle of it."""
    if not prob.dropout_p or block != "flash" or prob.xp is np:
        return
    qpos = prob.qpos()
    call_sets = ([prob.gathered_calls()] if prob.scheme == "allgather" else
                 [prob.calls(s, h) for s in prob.todo  # the forward's whole blocks, the backward's halves
                  for h in [None, *range(len(prob.key_halves))]])
    for calls, kpos in call_sets:
        for c in calls:
            if qpos[c.q_start] % 16 or kpos[c.k_start] % 16:
                raise ValueError(
                    f"{where}: dropout on the GPU: the kernels draw the mask in 16 x 16 blocks of the whole "
                    f"problem, and with {prob.P} ranks, layout {prob.layout}, nq={prob.nq}, nk={prob.nk} and "
                    f"window {prob.window} a block call starts at query {qpos[c.q_start]}, key {kpos[c.k_start]}. "
                    "Use lengths whose shards are whole 16-row tiles (N a multiple of 16 P contiguous, 32 P zigzag) "
                    "and no left window side off that grid (a band's calls start one key apart), or block='naive'")


def _prologue(q, k, v, ring, nq, nk, causal, scale, layout, block, version, extra, window, softcap, alibi_slopes,
              dropout_p, seed, scheme):
    """Checks shared by forward and backward, agreed by every rank; returns a Problem.

    The local checks run first and their error (if any) is shared with the agreement check, so a bad input on
    one rank is an error on every rank."""
    P, r = ring.size, ring.rank
    where = "ring attention backward" if extra else "ring attention"
    prob = None
    try:
        xp, B, H, Lq, Lk, D = (check_backward_inputs(q, k, v, *extra, where=where, gqa=True) if extra
                               else check_attention_inputs(q, k, v, where=where, gqa=True))
        check_block(block, version, where)
        check_layout(layout, where)
        causal = check_causal(causal, where)
        window, opts = check_ring_options(q, k, causal, window, softcap, alibi_slopes, dropout_p, seed, where)
        softcap = opts.softcap or None
        nq, nk = nq or P * Lq, nk or P * Lk
        if Lq != shard_len(nq, P, layout) or Lk != shard_len(nk, P, layout):
            raise ValueError(f"{where}: shards have {Lq} query / {Lk} key rows; with {P} ranks, layout {layout}, "
                             f"nq={nq} and nk={nk} they must have {shard_len(nq, P, layout)} / "
                             f"{shard_len(nk, P, layout)} (cut them with ring.shard)")
        scale = resolve_scale(scale, D)
        check_scheme(scheme, P, H, k.shape[1], opts.dropout_p, where)
        prob = Problem(P, r, xp, B, H, k.shape[1], Lq, Lk, D, nq, nk, layout, causal, scale, window, softcap,
                       opts.alibi_slopes, opts.dropout_p, opts.seed, tuple(steps(P, nq, nk, layout, causal, window)),
                       scheme)
        check_dropout_tiles(prob, block, where)
        facts = _facts(q, k, v, nq=nq, nk=nk, causal=causal, scale=scale, layout=layout, extra=extra,
                       window=window, softcap=softcap, alibi_slopes=opts.alibi_slopes, dropout_p=opts.dropout_p,
                       seed=opts.seed, scheme=scheme)
    except (TypeError, ValueError) as e:
        facts = {"problem": f"{type(e).__name__}: {e}"}
    check_same_everywhere(ring, **facts)
    return prob


def _facts(q, k, v, *, nq, nk, causal, scale, layout, extra=(), window=None, softcap=None, alibi_slopes=None,
           dropout_p=0.0, seed=0, scheme="ring"):
    slopes = None if alibi_slopes is None else tuple(cast(alibi_slopes, np.float64).ravel().tolist())
    return dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), dtype=str(q.dtype),
                device=type(q).__module__.split(".")[0], nq=nq, nk=nk, causal=bool(causal), scale=float(scale),
                layout=layout, window=window, softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p, seed=seed,
                scheme=scheme,
                **{f"arg{i}": (tuple(t.shape), str(t.dtype)) for i, t in enumerate(extra)})


def schedule(P, nq, nk, *, layout="zigzag", causal=False, window=None, kv_shape=None, dtype=None):
    """What the ring will do, as a dict: the steps with work (layout.steps) out of P, the hops K, V make (forward
    and backward) and the hops the dK, dV accumulators make (backward; the last one takes them home), and, given
    one rank's K shard shape (B, Hkv, Lk, D) and dtype, the bytes of one hop: K and V, dK and dV (float32).
    Grouped-query k, v travel with their Hkv heads: H / Hkv times fewer bytes than H heads."""
    todo = steps(P, nq, nk, layout, causal, window)
    out = {"steps": todo, "of": P,
           "kv_hops": len(todo) - 1 + (1 if todo and todo[0] > 0 else 0) if todo else 0,
           "dkv_hops": len(todo) - 1 + (1 if todo and todo[-1] > 0 else 0) if todo else 0}
    if kv_shape is not None:
        n = int(np.prod(kv_shape))
        out["kv_bytes_per_hop"] = 2 * n * np.dtype(dtype).itemsize
        out["dkv_bytes_per_hop"] = 2 * n * _partial_dtype(dtype).itemsize
    return out


def memory_per_token(H, Hkv, D, dtype):
    """What a rank of a ring of P >= 2 holds per token of its shard at its busiest moment (the backward's steps), in
    bytes, by buffer: [(buffer, bytes per token)]. The same for every P: a rank's memory follows its shard. One device
    holds per token of the whole sequence its inputs, o, a float32 dQ accumulator and the gradients, (4 H + 4 Hkv) D e
    + 4 H D bytes (e: the dtype's size), so a rank holds about sum(memory_per_token) / (P x that) of one device's
    peak: more than 1/P, because of the float32 accumulators and the block in flight (stage 04's README). A ring of
    one rank is one stages 02/03 call: one device's memory."""
    e, f = np.dtype(dtype).itemsize, _partial_dtype(dtype).itemsize
    kv = 2 * Hkv * D  # K and V, or dK and dV, per token
    return [("q, k, v, dO shards (the caller's)", (2 * H * D + kv) * e),
            ("o, lse (the forward's result, kept for the backward)", H * D * e + 4 * H),
            ("dQ_r accumulator, float32", H * D * f),
            ("the block in halves: K, V and dK, dV (float32); two halves and a spare", 3 * kv * (e + f) // 2)]


# ----------------------------------------------------------------------------- the travelling block
class _Travel:
    """The backward's key block on this rank, in halves (layout.halves): each half one contiguous slot of bytes holding
    the half's dK, dV accumulators (float32) then its K, V rows. arrive(h) waits for half h; depart(h, hop)
    sends it to rank r + hop while rank r - hop's half h arrives (the gradients only, on the way home). With one rank
    the block is the caller's own k, v and nothing travels.

    Two ways to move a half (SPARE): exchange it with a spare half-sized buffer that the arriving half lands in (the
    slot and the spare then swap buffers: one transfer, no copy, half a block more memory), or rotate it in place
    (comm.rotate: the bytes go through a staging buffer of 1/8 of them, chunk by chunk, and are copied back: the
    least memory, but a rotation is a chain of small transfers and copies, and on a GPU busy with the other half's
    kernels each of them waits for a free SM, so it can outlast that half's compute). The spare is the default."""
    SPARE = True

    def __init__(self, ring, prob, k, v):
        xp, self.ring = prob.xp, ring
        self.xp, self.rows = xp, prob.key_halves
        self.acc, self.dtype = _partial_dtype(k.dtype), k.dtype
        self.shapes = [(prob.B, prob.Hkv, len(rows), prob.D) for rows in prob.key_halves]  # (B, Hkv, L_h, D)
        self.nbytes = max(self._sizes(shape)[-1] for shape in self.shapes)  # every slot the same size: they swap
        self.spare = xp.empty(self.nbytes, np.uint8) if self.SPARE and prob.P > 1 else None
        self.slots, self.pending = [], []
        for rows, shape in zip(prob.key_halves, self.shapes):
            slot = self._slot(xp.empty(self.nbytes, np.uint8), shape)  # [dK_h | dV_h | K_h | V_h]
            slot["dk"][...] = 0
            slot["dv"][...] = 0
            if prob.P > 1:  # the rank's own rows of this half, copied into the slot that will travel
                for a, b, at in _row_runs(rows):
                    slot["k"][:, :, at:at + b - a] = k[:, :, a:b]
                    slot["v"][:, :, at:at + b - a] = v[:, :, a:b]
            else:  # one rank: the caller's arrays, never sent
                slot["k"], slot["v"] = k, v
            self.slots.append(slot)
            self.pending.append(None)

    def _sizes(self, shape):
        """Byte offsets in a slot: [0, end of dK, end of dV, end of K, end of V]."""
        n = int(np.prod(shape))
        return [0] + np.cumsum([n * self.acc.itemsize] * 2 + [n * self.dtype.itemsize] * 2).tolist()

    def _slot(self, buf, shape):
        """The views of one slot's bytes: dk, dv, k, v, each (B, Hkv, L_h, D)."""
        at = self._sizes(shape)
        dts = [self.acc, self.acc, self.dtype, self.dtype]
        slot = {name: buf[at[i]:at[i + 1]].view(dt).reshape(shape) for i, (name, dt) in enumerate(zip(
            ("dk", "dv", "k", "v"), dts))}
        slot.update(bytes=buf, grad_bytes=at[2], size=at[-1])
        return slot

    def gradients(self, k, v):
        """dK_r, dV_r in k's dtype, from the halves (home after the last hop) back into the shard's row order."""
        dk, dv = self.xp.empty(k.shape, k.dtype), self.xp.empty(v.shape, v.dtype)
        for rows, slot in zip(self.rows, self.slots):
            for a, b, at in _row_runs(rows):
                dk[:, :, a:b] = cast(slot["dk"][:, :, at:at + b - a], k.dtype)
                dv[:, :, a:b] = cast(slot["dv"][:, :, at:at + b - a], v.dtype)
        return dk, dv

    def arrive(self, h):
        """Half h has landed here (GPU: the compute stream waits for it; the host does not)."""
        if self.pending[h] is not None:
            self.ring.wait(self.pending[h])
            self.pending[h] = None

    def depart(self, h, hop, grads_only=False):
        """Send half h on to rank r + hop (and receive rank r - hop's half h in its place), after the work queued on
        it so far."""
        slot = self.slots[h]
        n = slot["grad_bytes"] if grads_only else slot["size"]
        if not (hop and n):
            return
        if self.spare is None:
            self.pending[h] = self.ring.rotate(slot["bytes"][:n], hop)
            return
        arriving = self.spare  # the spare receives; the slot's own buffer is the spare once its bytes have left
        self.pending[h] = self.ring.exchange([slot["bytes"][:n]], [arriving[:n]], hop)
        self.spare = slot["bytes"]
        self.slots[h] = self._slot(arriving, self.shapes[h])


def _row_runs(rows):
    """[(a, b, at)]: a half's rows are rows a:b of the shard at position at of the half, run by run (layout's runs of
    consecutive rows: one per chunk), so halves are filled and emptied with slice copies."""
    return [(int(rows[e0]), int(rows[e0]) + e1 - e0, e0) for e0, e1 in _runs(rows) if e1 > e0]


def _hop(todo, idx, P, home):
    """Ranks the block moves after step todo[idx]: to the next step with work, or (home=True, the gradients after
    the last step) back to the block's own rank; 0 = stays."""
    s = todo[idx]
    if idx + 1 < len(todo):
        return todo[idx + 1] - s
    return (P - s) % P if home else 0


# ----------------------------------------------------------------------------- one block call
def _call_options(prob, q, k, qpos, kpos, c):
    """variants.Options of block call c (rows q_start:q_stop of q against keys k_start:k_stop of k) for the kernels
    that add into the ring's accumulators (its mask, and the problem's softcap, ALiBi, dropout, grouped-query), or None
    for plain or causal attention."""
    mask = c.mask()
    if prob.plain and "window" not in mask:
        return mask["causal"], None
    opts = variants.check(q[:, :, c.q_start:c.q_stop], k[:, :, c.k_start:c.k_stop], causal=mask["causal"],
                          window=mask.get("window"),
                          **prob.options(qpos, kpos, c))
    return mask["causal"], None if opts.plain else opts


def _lanes(calls, by_rows):
    """The calls of one step in lanes that may run at the same time, each lane in order: a lane per call, or (by_rows)
    calls whose query rows overlap in one lane. A call that overlaps several lanes joins them into one, so no two
    lanes share a row."""
    if not by_rows:
        return [[c] for c in calls]
    lanes = []  # [(first row, stop row, [calls])]: the rows each lane spans, disjoint from every other lane's
    for c in calls:
        hit = [lane for lane in lanes if c.q_start < lane[1] and lane[0] < c.q_stop]
        joined = [x for lane in hit for x in lane[2]] + [c]
        lanes = [lane for lane in lanes if lane not in hit]
        lanes.append((min([c.q_start] + [lane[0] for lane in hit]), max([c.q_stop] + [lane[1] for lane in hit]),
                      joined))
    return [lane[2] for lane in lanes]


@functools.cache
def _side_streams(device, n=4):
    """n CUDA streams of this device for a step's concurrent calls (made once)."""
    import cupy

    return [cupy.cuda.Stream(non_blocking=True) for _ in range(n)]


class _Blocks:
    """The block calls of one ring call: `fused` where the GPU kernels add into the ring's accumulators themselves
    (stage 02 version pipelined, stage 03 version tc), else the block functions of BLOCKS and merge() / +=.

    A step's calls are smaller than one device's whole problem (a shard's chunks against a block, or half of one), and
    a kernel's last wave of thread blocks leaves SMs idle. So the fused calls of a step run side by side on streams of
    their own, where they cannot touch the same accumulator values but through atomics: in the backward every call
    (dQ, dK, dV are added with atomics), in the forward the calls on disjoint query rows (each merge rewrites its rows
    of O_r, L_r). The compute stream waits for all of them before the step's transfers."""

    def __init__(self, prob, block, version, dtype, backward):
        self.prob, self.version = prob, version
        self.fwd, self.bwd = BLOCKS[block]
        self.hopper = block == "flash" and (hopper_backward_blocks(prob, dtype, version) if backward
                                            else hopper_blocks(prob, dtype, version))
        self.fused = self.hopper
        if block == "flash" and prob.xp is not np and not self.hopper:
            try:
                if backward:
                    from stages import flash_v2_backward

                    self.fused = flash_v2_backward.resolve_version(version or "auto", dtype) == "tc"
                else:
                    self.fused = flash_version(dtype, version) == "pipelined"
            except (TypeError, ValueError):  # a dtype or version the kernels refuse: the block call says so
                self.fused = False
        self.qpos = prob.qpos()

    def forward_whole(self, q, k, v, c, kpos):
        """One rank's whole problem as one call c: the kernel writes (o, lse) in the inputs' dtype itself."""
        prob = self.prob
        if self.hopper and "window" not in c.mask():
            from stages.hopper import flash_v3

            return flash_v3.forward(q, k, v, scale=prob.scale, **c.mask())
        return self.fwd(q, k, v, scale=prob.scale, version=self.version, **c.mask(), **prob.options(self.qpos, kpos, c))

    def backward_whole(self, q, k, v, o, lse, do, c, kpos):
        """One rank's whole problem as one call c: the kernel writes (dq, dk, dv) in the inputs' dtype itself."""
        prob = self.prob
        if self.hopper:
            from stages.hopper import flash_v3_backward

            return flash_v3_backward.backward(q, k, v, o, cast(lse, np.float32), do, scale=prob.scale, **c.mask())
        return self.bwd(q, k, v, o, lse, do, scale=prob.scale, version=self.version, **c.mask(),
                        **prob.options(self.qpos, kpos, c))

    def forward_all(self, q, k, v, o_run, lse_run, calls, kpos):
        """Every call of one step (forward), merged into O_r, L_r."""
        self._run(_lanes(calls, by_rows=True), lambda c: self.forward(q, k, v, o_run, lse_run, c, kpos))

    def backward_all(self, q, k, v, o, lse, do, dq_run, dk_run, dv_run, calls, kpos):
        """Every call of one step (backward), added into dQ_r, dK_j, dV_j."""
        self._run(_lanes(calls, by_rows=False),
                  lambda c: self.backward(q, k, v, o, lse, do, dq_run, dk_run, dv_run, c, kpos))

    def _run(self, lanes, call):
        """call(c) for every call of the lanes: lane after lane on the compute stream, or, fused on the GPU, each lane
        on a side stream that starts after the work queued so far, with the compute stream waiting for them all."""
        if not self.fused or len(lanes) < 2:
            for lane in lanes:
                for c in lane:
                    call(c)
            return
        import cupy

        main = cupy.cuda.get_current_stream()
        ready, done = main.record(), []
        sides = _side_streams(cupy.cuda.Device().id)
        for i, lane in enumerate(lanes):
            side = sides[i % len(sides)]
            side.wait_event(ready)
            with side:
                for c in lane:
                    call(c)
            done.append(side.record())
        for event in done:
            main.wait_event(event)

    def forward(self, q, k, v, o_run, lse_run, c, kpos):
        """Rows q_start:q_stop of q against keys k_start:k_stop of k, v (a half block), merged into those rows of
        o_run, lse_run."""
        prob = self.prob
        if self.hopper and "window" not in c.mask():
            from stages.hopper import flash_v3

            flash_v3.merge_into(q, k, v, o_run, lse_run, (c.q_start, c.q_stop), (c.k_start, c.k_stop),
                                causal=c.mask()["causal"], scale=prob.scale)
            return
        if self.fused:
            from stages.flash_v2 import tc

            causal, opts = _call_options(prob, q, k, self.qpos, kpos, c)
            tc.merge_into(q, k, v, o_run, lse_run, (c.q_start, c.q_stop), (c.k_start, c.k_stop), causal=causal,
                          scale=prob.scale, opts=opts)
            return
        q0, q1, k0, k1 = c.q_start, c.q_stop, c.k_start, c.k_stop  # rows q0:q1 of q, keys k0:k1 of k, v
        o_b, lse_b = self.fwd(_rows(q, q0, q1), _rows(k, k0, k1), _rows(v, k0, k1), scale=prob.scale,
                              version=self.version, out_dtype=_partial_dtype(q.dtype), **c.mask(),
                              **prob.options(self.qpos, kpos, c))  # O_rj, L_rj: (B, H, q1 - q0, [D])
        merge(o_run[:, :, q0:q1], lse_run[:, :, q0:q1], o_b, lse_b)  # in place on rows q0:q1 of O_r, L_r

    def backward(self, q, k, v, o, lse, do, dq_run, dk_run, dv_run, c, kpos):
        """The gradients of block call c, added into rows q_start:q_stop of dq_run and keys k_start:k_stop of dk_run,
        dv_run."""
        prob = self.prob
        if self.hopper:  # stage 06 on an sm_90 GPU: the kernel adds into the accumulators
            from stages.hopper import flash_v3_backward

            flash_v3_backward.accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, (c.q_start, c.q_stop),
                                              (c.k_start, c.k_stop), causal=c.mask()["causal"], scale=prob.scale)
            return
        if self.fused:
            from stages import flash_v2_backward

            causal, opts = _call_options(prob, q, k, self.qpos, kpos, c)
            flash_v2_backward.accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, (c.q_start, c.q_stop),
                                              (c.k_start, c.k_stop), causal=causal, scale=prob.scale, opts=opts)
            return
        q0, q1, k0, k1 = c.q_start, c.q_stop, c.k_start, c.k_stop  # rows q0:q1 of q, keys k0:k1 of k, v
        dq_b, dk_b, dv_b = self.bwd(_rows(q, q0, q1), _rows(k, k0, k1), _rows(v, k0, k1), _rows(o, q0, q1),
                                    _rows(lse, q0, q1), _rows(do, q0, q1), scale=prob.scale, version=self.version,
                                    out_dtype=_partial_dtype(q.dtype), **c.mask(), **prob.options(self.qpos, kpos, c))
        xp = prob.xp
        xp.add(dq_run[:, :, q0:q1], dq_b, out=dq_run[:, :, q0:q1])  # dQ_r += dS_rj K_j   (scale included)
        xp.add(dk_run[:, :, k0:k1], dk_b, out=dk_run[:, :, k0:k1])  # dK_j += dS_rj^T Q_r
        xp.add(dv_run[:, :, k0:k1], dv_b, out=dv_run[:, :, k0:k1])  # dV_j += P_rj^T dO_r


# ----------------------------------------------------------------------------- timing marks
class _Timeline:
    """Marks on the compute stream (events on the GPU, the host clock on the CPU): add(s, compute, waited) records a
    step's compute interval and the interval its compute stream waited for a transfer, each (start mark, end mark);
    record(timeline) appends {step, compute_ms, exposed_ms} per step, summed over its halves."""

    def __init__(self, xp):
        self.xp, self.steps = xp, []
        if xp is np:
            self.mark, self.ms = time.perf_counter, lambda a, b: (b - a) * 1e3
        else:
            import cupy

            self.mark, self.ms = (lambda: cupy.cuda.get_current_stream().record()), cupy.cuda.get_elapsed_time

    def add(self, s, compute, waited=None):
        """Step s computed over compute and waited over waited, each (start mark, end mark) or None."""
        self.steps.append((s, compute, waited))

    def record(self, timeline):
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()
        per_step = {}
        for s, compute, waited in self.steps:
            step = per_step.setdefault(s, {"step": s, "compute_ms": 0.0, "exposed_ms": 0.0})
            step["compute_ms"] += self.ms(*compute) if compute else 0.0
            step["exposed_ms"] += self.ms(*waited) if waited else 0.0
        timeline.extend(per_step.values())


def _one_call(xp, timeline, fn):
    """fn(): the ring of one rank with one block call over the whole shard (Problem.whole_call), timed as step 0
    when timeline is a list."""
    marks = _Timeline(xp)
    t0 = marks.mark()
    out = fn()
    if timeline is not None:
        marks.add(0, (t0, marks.mark()))
        marks.record(timeline)
    return out


# ----------------------------------------------------------------------------- forward
def ring_forward(q, k, v, *, ring, nq=None, nk=None, causal=False, scale=None, layout="contiguous",
                 block="flash", version=None, timeline=None, window=None, softcap=None, alibi_slopes=None,
                 dropout_p=0.0, seed=0, scheme="ring"):
    """This rank's part of ring attention: (o, lse) for its query shard.

    q (B, H, Lq, D), k and v (B, Hkv, Lk, D): this rank's shards in `layout` (see shard()); Hkv divides H
    (grouped-query attention: the ring sends the Hkv heads). nq, nk: the global unpadded lengths (default P*Lq,
    P*Lk). window=(left, right), softcap, alibi_slopes, dropout_p and seed as in stage 00 (variants.py): the result
    is the one-device result, the same dropout mask included. ring: a communicator from comm.py.
    timeline: a list that receives one dict per step with work {step, compute_ms, exposed_ms} (exposed = time
    waiting on the ring). scheme: "ring" (this file), "allgather" or "alltoall" (gather.py), the same result.
    """
    prob = _prologue(q, k, v, ring, nq, nk, causal, scale, layout, block, version, (), window, softcap,
                     alibi_slopes, dropout_p, seed, scheme)
    xp, blocks = prob.xp, _Blocks(prob, block, version, q.dtype, backward=False)
    q, k, v = (kernels.row_major(x) for x in (q, k, v))  # row-major: the kernels read rows in place
    whole = prob.whole_call()
    if whole is not None:  # one rank, one call: the kernel writes the result in the inputs' dtype itself
        return _one_call(xp, timeline, lambda: blocks.forward_whole(q, k, v, *whole))
    marks = _Timeline(xp)
    if prob.scheme == "alltoall":
        o, lse = _alltoall_forward(ring, prob, blocks, version, q, k, v, marks)
    else:
        acc = _partial_dtype(q.dtype)
        o_run = xp.zeros((prob.B, prob.H, prob.Lq, prob.D), dtype=acc)  # O_r: normalised over the keys merged so far
        lse_run = xp.full((prob.B, prob.H, prob.Lq), -np.inf, dtype=acc)  # L_r
        turn = _turn_forward if prob.scheme == "ring" else _gathered_forward
        turn(ring, prob, blocks, q, k, v, o_run, lse_run, marks)
        o, lse = cast(o_run, q.dtype), lse_run  # lse: float32 by the API (float64 for float64 inputs)
    if timeline is not None:
        marks.record(timeline)
    return o, lse


def _turn_forward(ring, prob, blocks, q, k, v, o_run, lse_run, marks):
    """The ring: the blocks travel, each merged into O_r, L_r at the step it is here."""
    xp = prob.xp
    k_cur, v_cur, spare = k, v, None  # double buffers: the block in use and the one arriving

    def receive(hop):  # post the transfer of the block in use to rank r + hop (ours comes from r - hop)
        nxt = spare if spare is not None else (xp.empty_like(k), xp.empty_like(v))
        return nxt, ring.exchange([k_cur, v_cur], list(nxt), shift=hop)

    todo = prob.todo
    if todo and todo[0] > 0:  # the first step with work is not our own block's: fetch that block first
        nxt, handle = receive(todo[0])
        ring.wait(handle)
        k_cur, v_cur = nxt
    for idx, s in enumerate(todo):  # Alg.: at step s rank r holds the block of rank r - s
        hop = _hop(todo, idx, prob.P, home=False)
        if hop:  # post the next block's transfer before computing on this one (steps without work skipped)
            nxt, handle = receive(hop)
        t0 = marks.mark()
        calls, kpos = prob.calls(s)
        blocks.forward_all(q, k_cur, v_cur, o_run, lse_run, calls, kpos)
        t1 = marks.mark()
        if hop:
            ring.wait(handle)  # the next block has arrived (GPU: the compute stream waits, not the host)
            spare = (k_cur, v_cur) if k_cur is not k else None  # the caller's k, v are never overwritten
            k_cur, v_cur = nxt
        marks.add(s, (t0, t1), (t1, marks.mark()))  # computed, then waited for the next block


def _gathered_forward(ring, prob, blocks, q, k, v, o_run, lse_run, marks):
    """scheme "allgather": K, V of the whole sequence gathered in order, then this rank's queries against all of them
    in a few long calls, merged into O_r, L_r as the ring merges its blocks."""
    t0 = marks.mark()
    k_all, v_all = gather.gather_sequence(ring, [k, v], prob.nk, prob.layout, prob.xp)  # (B, Hkv, P Lk, D)
    t1 = marks.mark()
    calls, kpos = prob.gathered_calls()
    blocks.forward_all(q, k_all, v_all, o_run, lse_run, calls, kpos)
    marks.add(0, (t1, marks.mark()), (t0, t1))  # computed, after waiting for the gather


def _head_options(prob):
    """The options of scheme "alltoall"'s one call: the whole problem's mask and options, for this rank's heads."""
    out = {"causal": prob.causal}
    if prob.window is not None:
        out["window"] = prob.window
    if prob.softcap is not None:
        out["softcap"] = prob.softcap
    if prob.alibi_slopes is not None:
        h = prob.H // prob.P
        out["alibi_slopes"] = prob.alibi_slopes[..., prob.r * h:(prob.r + 1) * h]  # (H,) or (B, H): our heads
    return out


def _alltoall_forward(ring, prob, blocks, version, q, k, v, marks):
    """scheme "alltoall": this rank's H/P heads over the whole sequence (heads_to_sequence), one single-device call,
    and O, L back to the token shards."""
    xp, layout = prob.xp, prob.layout
    t0 = marks.mark()
    q_h, = gather.heads_to_sequence(ring, [q], prob.nq, layout, xp)  # (B, H/P, nq, D)
    k_h, v_h = gather.heads_to_sequence(ring, [k, v], prob.nk, layout, xp)  # (B, Hkv/P, nk, D)
    t1 = marks.mark()
    o_h, lse_h = blocks.fwd(q_h, k_h, v_h, scale=prob.scale, version=version, **_head_options(prob))
    del q_h, k_h, v_h  # (memory back to the pool before the way back)
    t2 = marks.mark()
    o, lse = gather.sequence_to_heads(ring, [o_h, lse_h], prob.nq, layout, xp)  # (B, H, Lq, D), (B, H, Lq)
    marks.add(0, (t1, t2), (t0, t1))
    marks.add(0, None, (t2, marks.mark()))  # the transfer back: no compute beside it
    return o, lse


# ----------------------------------------------------------------------------- backward
def ring_backward(q, k, v, o, lse, do, *, ring, nq=None, nk=None, causal=False, scale=None,
                  layout="contiguous", block="flash", version=None, timeline=None, window=None, softcap=None,
                  alibi_slopes=None, dropout_p=0.0, seed=0, scheme="ring"):
    """This rank's part of the ring backward: (dq, dk, dv) for its own shards.

    o, lse: this rank's shard of the FINAL forward output (ring_forward's result). K, V rotate as in the forward,
    and the dK, dV accumulators of each block travel with them, in the same slots: each rank adds its part, and after
    the last step with work s_last they go home to the block's rank (a hop of P - s_last). With grouped-query k, v the
    accumulators have Hkv heads: each block's backward has already summed its group's H / Hkv query heads.
    scheme: as ring_forward's.
    """
    prob = _prologue(q, k, v, ring, nq, nk, causal, scale, layout, block, version, (o, lse, do), window, softcap,
                     alibi_slopes, dropout_p, seed, scheme)
    xp, blocks = prob.xp, _Blocks(prob, block, version, q.dtype, backward=True)
    q, k, v = (kernels.row_major(x) for x in (q, k, v))
    whole = prob.whole_call()
    if whole is not None:  # one rank, one call: the kernels write the gradients in the inputs' dtype themselves
        return _one_call(xp, timeline, lambda: blocks.backward_whole(q, k, v, o, lse, do, *whole))
    marks = _Timeline(xp)
    if prob.scheme == "alltoall":
        grads = _alltoall_backward(ring, prob, blocks, version, q, k, v, o, lse, do, marks)
    else:
        acc = _partial_dtype(q.dtype)
        valid = int((blocks.qpos < prob.nq).sum())  # padding rows are a suffix of the shard
        if valid < prob.Lq:  # padded query rows must send no gradient anywhere: dO = 0 there gives dS = 0
            do = do.copy()
            do.view(f"u{do.itemsize}")[:, :, valid:] = 0  # bit pattern 0 is +0.0 in every float dtype
        o, lse, do = kernels.row_major(o), kernels.row_major(lse, dtype=acc), kernels.row_major(do)
        dq_run = xp.zeros((prob.B, prob.H, prob.Lq, prob.D), dtype=acc)  # dQ_r stays home
        turn = _turn_backward if prob.scheme == "ring" else _gathered_backward
        dkv = turn(ring, prob, blocks, q, k, v, o, lse, do, dq_run, marks)  # () -> dK_r, dV_r in k's dtype
        dq = cast(dq_run, q.dtype)
        del dq_run  # (memory back to the pool before dK, dV are made)
        grads = (dq, *dkv())
    if timeline is not None:
        marks.record(timeline)
    return grads


def _turn_backward(ring, prob, blocks, q, k, v, o, lse, do, dq_run, marks):
    """The ring: the key blocks travel in halves with their dK, dV accumulators (_Travel); returns a function that
    makes dK_r, dV_r once they are home."""
    travel = _Travel(ring, prob, k, v)  # K_j, V_j and their dK_j, dV_j accumulators
    todo = prob.todo
    if todo and todo[0] > 0:
        for h in range(len(travel.slots)):
            travel.depart(h, todo[0])
    for idx, s in enumerate(todo):
        for h, slot in enumerate(travel.slots):
            t0 = marks.mark()
            travel.arrive(h)  # half h of K_j, V_j and of the dK_j, dV_j summed so far is here
            t1 = marks.mark()
            calls, kpos = prob.calls(s, h)
            blocks.backward_all(q, slot["k"], slot["v"], o, lse, do, dq_run, slot["dk"], slot["dv"], calls, kpos)
            last = idx == len(todo) - 1
            travel.depart(h, _hop(todo, idx, prob.P, home=True), grads_only=last)  # the last hop: dK, dV go home
            marks.add(s, (t1, marks.mark()), (t0, t1))  # waited for the half, then computed
    for h in range(len(travel.slots)):
        travel.arrive(h)  # our own dK_r, dV_r are home
    travel.spare = None  # (memory back to the pool before the outputs are made)
    return lambda: travel.gradients(k, v)


def _gathered_backward(ring, prob, blocks, q, k, v, o, lse, do, dq_run, marks):
    """scheme "allgather": K, V gathered again, dK, dV of every key added into float32 accumulators of the whole
    sequence, then reduce-scattered (gather.scatter_sum); returns a function that makes dK_r, dV_r."""
    xp = prob.xp
    t0 = marks.mark()
    k_all, v_all = gather.gather_sequence(ring, [k, v], prob.nk, prob.layout, xp)
    t1 = marks.mark()
    dk_all, dv_all = (xp.zeros(k_all.shape, _partial_dtype(k.dtype)) for _ in range(2))
    calls, kpos = prob.gathered_calls()
    blocks.backward_all(q, k_all, v_all, o, lse, do, dq_run, dk_all, dv_all, calls, kpos)
    t2 = marks.mark()
    del k_all, v_all
    dk, dv = gather.scatter_sum(ring, [dk_all, dv_all], prob.nk, prob.layout, xp)  # this rank's keys, summed
    marks.add(0, (t1, t2), (t0, t1))
    marks.add(0, None, (t2, marks.mark()))  # the reduce-scatter
    return lambda: (cast(dk, k.dtype), cast(dv, v.dtype))


def _alltoall_backward(ring, prob, blocks, version, q, k, v, o, lse, do, marks):
    """scheme "alltoall": q, k, v, o, L, dO of this rank's heads over the whole sequence, one single-device backward,
    and dQ, dK, dV back to the token shards."""
    xp, layout = prob.xp, prob.layout
    t0 = marks.mark()
    q_h, o_h, do_h, lse_h = gather.heads_to_sequence(ring, [q, o, do, lse], prob.nq, layout, xp)
    k_h, v_h = gather.heads_to_sequence(ring, [k, v], prob.nk, layout, xp)
    t1 = marks.mark()
    dq_h, dk_h, dv_h = blocks.bwd(q_h, k_h, v_h, o_h, lse_h, do_h, scale=prob.scale, version=version,
                                  **_head_options(prob))
    del q_h, k_h, v_h, o_h, lse_h, do_h
    t2 = marks.mark()
    dq, = gather.sequence_to_heads(ring, [dq_h], prob.nq, layout, xp)
    dk, dv = gather.sequence_to_heads(ring, [dk_h, dv_h], prob.nk, layout, xp)
    marks.add(0, (t1, t2), (t0, t1))
    marks.add(0, None, (t2, marks.mark()))  # the transfer back
    return dq, dk, dv


# ----------------------------------------------------------------------------- P ranks in one process
def _check_api(q, k, causal, scale, D, layout, ranks, block, version, where, window, softcap, alibi_slopes,
               dropout_p, seed, scheme):
    """The options of the one-process API, checked before any shard is cut."""
    check_causal(causal, where)
    resolve_scale(scale, D)
    check_layout(layout, where)
    check_ranks(ranks, where)
    check_block(block, version, where)
    _, opts = check_ring_options(q, k, causal, window, softcap, alibi_slopes, dropout_p, seed, where)
    check_scheme(scheme, ranks, q.shape[1], k.shape[1], opts.dropout_p, where)


def forward(q, k, v, *, causal=False, scale=None, layout="zigzag", ranks=4, block="naive", version=None,
            window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=0, scheme="ring"):
    """The one API: ring attention of full (B, H, N, D) arrays with `ranks` simulated ranks (threads).

    layout: "contiguous" or "zigzag"; block: "naive" (stage 00) or "flash" (stages 02/03); version: the block
    kernel's version (stage 02/03 `version=`; None picks the fastest for the dtype). k, v may have Hkv heads
    (grouped-query); window, softcap, alibi_slopes, dropout_p and seed as in stage 00. scheme: "ring", "allgather"
    or "alltoall" (gather.py). Each thread runs ring_forward on its shard, exactly as an MPI rank would; the shards
    are gathered. Inputs are checked here first, so an error quotes the caller's arrays, not a shard.
    """
    from .comm import simulate

    _, _, _, nq, nk, D = check_attention_inputs(q, k, v, where="ring.forward", gqa=True)
    _check_api(q, k, causal, scale, D, layout, ranks, block, version, "ring.forward", window, softcap, alibi_slopes,
               dropout_p, seed, scheme)

    def rank_fn(ring):
        r, P = ring.rank, ring.size
        return ring_forward(shard(q, r, P, layout), shard(k, r, P, layout), shard(v, r, P, layout), ring=ring,
                            nq=nq, nk=nk, causal=causal, scale=scale, layout=layout, block=block,
                            version=version, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                            dropout_p=dropout_p, seed=seed, scheme=scheme)

    outs = simulate(rank_fn, ranks)
    return unshard([o for o, _ in outs], nq, layout), unshard([lse for _, lse in outs], nq, layout)


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, layout="zigzag", ranks=4, block="naive",
             version=None, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=0, scheme="ring"):
    """The one API's backward: ring_backward on `ranks` simulated ranks; returns full (dq, dk, dv).
    Inputs are checked here first, so an error quotes the caller's arrays, not a shard."""
    from .comm import simulate

    _, _, _, nq, nk, D = check_backward_inputs(q, k, v, o, lse, do, where="ring.backward", gqa=True)
    _check_api(q, k, causal, scale, D, layout, ranks, block, version, "ring.backward", window, softcap,
               alibi_slopes, dropout_p, seed, scheme)

    def rank_fn(ring):
        r, P = ring.rank, ring.size
        cut = [shard(x, r, P, layout) for x in (q, k, v, o, lse, do)]
        return ring_backward(*cut, ring=ring, nq=nq, nk=nk, causal=causal, scale=scale, layout=layout,
                             block=block, version=version, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                             dropout_p=dropout_p, seed=seed, scheme=scheme)

    outs = simulate(rank_fn, ranks)
    return tuple(unshard([g[i] for g in outs], n, layout) for i, n in enumerate((nq, nk, nk)))
