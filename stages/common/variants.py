"""The attention variants real models use, defined once: which keys a query sees, what is added to or done with a
score, and which probabilities dropout keeps. Stage 00 computes them naively (the definition and the fp64 oracle);
the tile mirrors and kernels compute the same functions tile by tile.

For query i and key j (0-based), with shift = Nk - Nq (bottom-right alignment, as causal uses):

    visible(i, j)  = (left  < 0 or j >= i + shift - left)       window=(left, right), FlashAttention's convention:
                 and (right < 0 or j <= i + shift + right)       -1 = unbounded; causal=True is right = 0
    S_ij  = scale * q_i . k_j                                     the scores
    S_ij <- c * tanh(S_ij / c)                                    softcap=c (Gemma 2): |S| < c, smooth
    S_ij <- S_ij - slope_h * |i + shift - j|                      alibi_slopes (BLOOM, MPT): a distance penalty
    P     = softmax over the visible j of S_ij;  L_i = logsumexp   (the lse is taken before dropout)
    O     = (P * Z / (1 - p)) V                                   dropout_p=p: Z_ij in {0, 1} kept with probability
                                                                  1 - p, drawn by Philox from (seed, b, h, i, j)
Grouped-query attention (GQA; MQA is Hkv = 1): k and v have Hkv heads, Hkv dividing H; query head h reads kv head
h // (H / Hkv). The backward sums dK and dV over the H / Hkv query heads of each group.

A block of a larger problem (the ring: origin=(q0, k0, shift)): the call's query row i is row q0 + i of the whole
problem and its key j is key k0 + j, in a problem whose own shift is `shift`. ALiBi and dropout then use those
global indices, so every block adds its part of the whole problem's bias and mask:
    S_ij <- S_ij - slope_h * |(q0 + i) + shift - (k0 + j)|,     Z_ij drawn from (seed, b, h, q0 + i, k0 + j)
The call's mask (causal, window) stays its own, around its own bottom-right diagonal (the ring's plan gives each
call the part of the window that falls on it). Default: the call is the whole problem, origin (0, 0, Nk - Nq).
"""
import sys
from typing import NamedTuple

import numpy as np

from .checks import SUPPORTED_FLOAT_DTYPES, real_number


class Options(NamedTuple):
    """The checked options of one call (Options.check builds it; PLAIN is plain attention)."""
    causal: bool = False
    left: int = -1  # keys before the diagonal a query sees (-1: all)
    right: int = -1  # keys after the diagonal a query sees (-1: all; causal: 0)
    softcap: float = 0.0  # 0: off
    alibi_slopes: object = None  # (B, H) float array or None
    dropout_p: float = 0.0
    seed: int = 0
    group: int = 1  # H / Hkv: query heads per kv head
    origin: tuple = None  # (q0, k0, shift): this call is a block of a larger problem (ALiBi, dropout); None: whole

    @property
    def windowed(self):
        """True when some key may be hidden from some query (causal, or a bounded window side)."""
        return self.left >= 0 or self.right >= 0

    @property
    def plain(self):
        """No option beyond causal: what every kernel computes."""
        return (self.alibi_slopes is None and (self.left, self.softcap, self.dropout_p, self.group) == (-1, 0.0, 0.0, 1)
                and self.right == (0 if self.causal else -1))


def _check_slopes(slopes, B, H, where):
    """ALiBi's slopes as an array (numpy, or CuPy as given), once their shape is (H,) or (B, H) and every slope a finite
    real number: a NaN slope makes every score of its head NaN, an infinite one the diagonal's (inf x 0).
    A CuPy array is checked on its device (one small copy of the answer to the host)."""
    on_gpu = type(slopes).__module__.split(".")[0] == "cupy"
    xp = sys.modules["cupy"] if on_gpu else np
    a = slopes if on_gpu else np.asarray(slopes)
    shape = tuple(a.shape)
    if shape not in ((H,), (B, H)):
        raise ValueError(f"{where}: alibi_slopes has shape {shape}; expected (H,) = ({H},) or (B, H) = "
                         f"({B}, {H}), one slope per head")
    if a.dtype.kind not in "iuf" and a.dtype not in SUPPORTED_FLOAT_DTYPES:  # bfloat16's kind is "V"
        raise TypeError(f"{where}: alibi_slopes must hold real numbers (a float array, one slope per head); got "
                        f"dtype {a.dtype}")
    if not bool(xp.isfinite(a.astype(np.float32)).all()):
        host = np.asarray(a.get() if on_gpu else a, np.float32)
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(host))[0])
        raise ValueError(f"{where}: alibi_slopes must be finite, one real slope per head (S -> S - slope |i - j|); "
                         f"got {host[bad]} at index {bad}")
    return a


def _int(x, name, where):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{where}: {name} must be an integer, got {x!r}")
    return int(x)


def check(q, k, *, causal, window=None, alibi_slopes=None, softcap=None, dropout_p=0.0, seed=0, origin=None,
          where="attention"):
    """Options for q (B, H, Nq, D) and k (B, Hkv, Nk, D), or a clear error that says what is supported."""
    B, H = q.shape[0], q.shape[1]
    Hkv = k.shape[1]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"{where}: k and v have {Hkv} heads, which does not divide q's {H} heads; grouped-query "
                         "attention needs H % Hkv == 0 (Hkv = H: plain, Hkv = 1: multi-query)")
    left = right = -1
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"{where}: window must be a pair (left, right) of integers, -1 for unbounded; got "
                            f"{window!r}")
        left, right = (_int(w, "window", where) for w in window)
        if left < -1 or right < -1:
            raise ValueError(f"{where}: window {tuple(window)}: each side must be >= 0, or -1 for unbounded")
    if causal:
        if right > 0:
            raise ValueError(f"{where}: causal=True sees no key after the diagonal (right = 0); window {window} "
                             "asks for right > 0: drop causal, or set right to 0 or -1")
        right = 0
    cap = 0.0
    if softcap is not None:
        what = "a finite number > 0 (S -> c tanh(S / c)), or None for off"
        cap = real_number(softcap, "softcap", where, what)
        if not np.isfinite(cap) or cap <= 0:
            raise ValueError(f"{where}: softcap must be {what}; got {softcap!r}")
    slopes = None if alibi_slopes is None else _check_slopes(alibi_slopes, B, H, where)
    p = real_number(dropout_p, "dropout_p", where, "a number in [0, 1), the probability of dropping P_ij")
    if not (0.0 <= p < 1.0):
        raise ValueError(f"{where}: dropout_p must be in [0, 1), got {dropout_p!r}")
    seed = _int(seed, "seed", where)
    if not 0 <= seed < 2**64:
        raise ValueError(f"{where}: seed must be in [0, 2**64), got {seed}")
    if origin is not None:
        if not isinstance(origin, (tuple, list)) or len(origin) != 3:
            raise TypeError(f"{where}: origin must be (q0, k0, shift), the call's first query row and first key in "
                            f"the whole problem and that problem's Nk - Nq; got {origin!r}")
        origin = tuple(_int(x, "origin", where) for x in origin)
        if origin[0] < 0 or origin[1] < 0:
            raise ValueError(f"{where}: origin {origin}: the first query row q0 and first key k0 must be >= 0")
        if origin == (0, 0, k.shape[2] - q.shape[2]):
            origin = None  # the whole problem
        elif slopes is None and not p:
            origin = None  # only ALiBi and dropout see global indices
    return Options(bool(causal), left, right, cap, slopes, p, seed, H // Hkv, origin)


def visible(Nq, Nk, opts, xp=np, rows=None, cols=None):
    """(len(rows), len(cols)) boolean, True where query i may see key j (all rows/cols by default)."""
    diag = (xp.arange(Nq) if rows is None else xp.asarray(rows))[:, None] + (Nk - Nq)  # query i's diagonal key
    j = (xp.arange(Nk) if cols is None else xp.asarray(cols))[None, :]
    ok = xp.ones((diag.shape[0], j.shape[1]), bool)
    if opts.left >= 0:
        ok &= j >= diag - opts.left
    if opts.right >= 0:
        ok &= j <= diag + opts.right
    return ok


def alibi_geometric_slopes(H):
    """ALiBi's slopes for H heads (Press et al. 2022): 2^(-8 (h + 1) / H) when H is a power of two; otherwise those
    of the largest power of two n <= H, then every other slope of 2n heads for the remaining H - n heads."""
    n = 1 << (H.bit_length() - 1)  # the largest power of two <= H
    own = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    extra = [2.0 ** (-8.0 * (h + 1) / (2 * n)) for h in range(0, 2 * n, 2)][:H - n]
    return np.array(own + extra, np.float32)


def slopes_bh(opts, B, H, xp=np, dtype=np.float32):
    """The ALiBi slopes as a (B, H) array of xp (or None)."""
    if opts.alibi_slopes is None:
        return None
    s = xp.asarray(opts.alibi_slopes, dtype=dtype)
    return xp.broadcast_to(s, (B, H))


def alibi_shift(opts, Nq, Nk):
    """ALiBi's diagonal in the call's own indices: query row i is at distance 0 from key i + alibi_shift.
    Nk - Nq for a whole problem; q0 + shift - k0 for a block at origin (q0, k0, shift)."""
    if opts is None or opts.origin is None:
        return Nk - Nq
    q0, k0, shift = opts.origin
    return q0 + shift - k0


def dropout_origin(opts):
    """(q0, k0): the global indices of the call's first query row and first key, from which dropout draws."""
    return (0, 0) if opts is None or opts.origin is None else opts.origin[:2]


def alibi_bias(slopes, Nq, Nk, xp=np, rows=None, cols=None, shift=None):
    """(B, H, rows, cols): -slope_bh |i + shift - j| for slopes (B, H); shift: Nk - Nq unless given (alibi_shift)."""
    i = (xp.arange(Nq) if rows is None else xp.asarray(rows))[:, None]
    j = (xp.arange(Nk) if cols is None else xp.asarray(cols))[None, :]
    dist = xp.abs(i + (Nk - Nq if shift is None else shift) - j).astype(slopes.dtype)
    return -slopes[:, :, None, None] * dist


def keep_rate_threshold(p):
    """A 32-bit Philox draw u keeps its probability when u < threshold = round((1 - p) 2^32) (p > 0)."""
    return min(int(round((1.0 - p) * 2.0**32)), 2**32 - 1)


def seed_fields(seed):
    """The 64-bit dropout seed as the kernels' two uint32 fields (Philox's key: low word, high word)."""
    return {"seed_lo": seed & 0xFFFFFFFF, "seed_hi": seed >> 32}


def seed_scalars(seed):
    """The 64-bit dropout seed as two uint32 kernel arguments (seed_fields)."""
    f = seed_fields(seed)
    return np.uint32(f["seed_lo"]), np.uint32(f["seed_hi"])


def check_kernel_origin(opts, where):
    """The CUDA kernels draw dropout's bits 16 x 16 blocks at a time (dropout_keep): a block at an origin must start on
    that grid, q0 and k0 multiples of 16 (the mirrors and stage 00 take any origin)."""
    if opts is not None and opts.dropout_p and opts.origin is not None and (opts.origin[0] % 16 or opts.origin[1] % 16):
        raise ValueError(f"{where}: dropout at origin {opts.origin}: the CUDA kernels draw the mask in 16 x 16 blocks "
                         "of the whole problem, so the first query row q0 and first key k0 must be multiples of 16 "
                         "(the CPU mirrors and stage 00 take any origin)")


def origin_fields(opts, Nq, Nk):
    """{a_off, q_off, k_off} of a block at an origin (all 0 for a whole problem): ALiBi measures
    |i + (Nk - Nq) + a_off - j|, and dropout draws from (q_off + i, k_off + j)."""
    q_off, k_off = dropout_origin(opts)
    return {"a_off": alibi_shift(opts, Nq, Nk) - (Nk - Nq), "q_off": q_off, "k_off": k_off}


def origin_scalars(opts, Nq, Nk):
    """origin_fields as the kernels' int32 arguments (a_off, q_off, k_off)."""
    return tuple(np.int32(x) for x in origin_fields(opts, Nq, Nk).values())


def dropout_fields(opts):
    """{keep, rp, seed_lo, seed_hi}: the kernels' dropout (kernels/dropout.cuh). keep = 0 is off; a draw u keeps P_ij
    when u < keep = round((1 - p) 2^32); rp = 1 / (1 - p)."""
    p = 0.0 if opts is None else opts.dropout_p
    if not p:
        return {"keep": 0, "rp": 1.0, **seed_fields(0)}
    keep = keep_rate_threshold(p)
    if keep == 0:
        raise ValueError(f"dropout_p = {p!r} keeps no probability at 32-bit resolution: the kernels take p with "
                         "round((1 - p) 2^32) >= 1")
    return {"keep": keep, "rp": 1.0 / (1.0 - p), **seed_fields(opts.seed)}


def dropout_scalars(opts):
    """dropout_fields as the kernels' arguments (keep uint32, rp float32, seed_lo, seed_hi uint32)."""
    f = dropout_fields(opts)
    return np.uint32(f["keep"]), np.float32(f["rp"]), np.uint32(f["seed_lo"]), np.uint32(f["seed_hi"])


# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a counter-based generator,
# so the backward regenerates exactly the forward's mask from (seed, position) with nothing stored.
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def philox4x32(c0, c1, c2, c3, seed):
    """Philox4x32-10 of counter (c0, c1, c2, c3) (uint32 arrays of one shape) under the 64-bit key seed: four
    uint32 arrays."""
    m32 = np.uint64(0xFFFFFFFF)
    c = [np.asarray(x, dtype=np.uint64) & m32 for x in (c0, c1, c2, c3)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        p0 = np.uint64(_M0) * c[0]  # < 2^64: exact in uint64
        p1 = np.uint64(_M1) * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & m32, p1 & m32, ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & m32, p0 & m32]
        k0, k1 = (k0 + np.uint64(_W0)) & m32, (k1 + np.uint64(_W1)) & m32
    return [x.astype(np.uint32) for x in c]


def dropout_keep(B, H, Nq, Nk, p, seed, origin=(0, 0)):
    """Z (B, H, Nq, Nk) bool: True where dropout keeps P_ij (numpy; the kernels draw the same bits). origin (q0, k0):
    the rows and keys are global indices q0.., k0.. (a block of a larger problem: dropout_origin).

    One Philox call draws the four bits of queries {i, i + 8} x keys {j, j + 8} inside a 16 x 16 block (i % 16 < 8,
    j % 16 < 8): counter (16-block row index * 8 + i % 8, same for j, b * H + h, 0), outputs in the order (i, j),
    (i, j + 8), (i + 8, j), (i + 8, j + 8). A tensor-core thread holds exactly such pairs (rows g, g + 8 and
    columns 2t, 2t + 8 of its mma fragments, in S and in the backward's S^T), so it draws its own bits."""
    if p == 0.0:
        return np.ones((B, H, Nq, Nk), bool)
    i = origin[0] + np.arange(Nq)
    j = origin[1] + np.arange(Nk)
    ci = (i // 16) * 8 + i % 8  # (Nq,)
    cj = (j // 16) * 8 + j % 8  # (Nk,)
    oi = (i % 16) // 8  # which of the pair
    oj = (j % 16) // 8
    bh = np.arange(B * H, dtype=np.uint64).reshape(B, H)[:, :, None, None]
    outs = philox4x32(ci[None, None, :, None], cj[None, None, None, :], bh, 0, seed)
    stack = np.stack(np.broadcast_arrays(*outs), axis=0)  # (4, B, H, Nq, Nk)
    idx = (2 * oi[:, None] + oj[None, :])[None, None, None]  # (1, 1, 1, Nq, Nk)
    u = np.take_along_axis(stack, np.broadcast_to(idx, (1,) + stack.shape[1:]), axis=0)[0]
    return u < np.uint32(keep_rate_threshold(p))
