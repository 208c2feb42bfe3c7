"""Stage 06, version "fp8" of the forward: version pingpong's main loop with Q, K and V in e4m3 (FlashAttention-3,
Sec. 3.3).

    o, lse = flash_v3.forward(q, k, v, causal=True, version="fp8")   # float16 / bfloat16 in and out, D = 128

The 8-bit wgmma multiplies twice the values per cycle of the 16-bit one. Before the kernel (flash_v3_fp8_quantize.cu)
each head of q, k and v is scaled into e4m3's range and rounded, x' = e4m3(x 448 / amax_x), amax_x = max |x| over the
head; the kernel (flash_v3_forward_fp8.cu: version pingpong's main loop on e4m3) takes the factors back:
S = (amax_q amax_k / 448^2) Q' K'^T, O = (amax_v / 448) P V'. Two things differ from the 16-bit kernel:
  * V enters as V^T: the 8-bit wgmma reads its shared-memory operands only K-major, and the K of O += P V is the keys.
    The pre-pass writes v'^T with each 16 keys in the order the lanes pack P (key_order), so P goes from
    the accumulator of S to A fragments inside each lane.
  * P is computed 2^8 times larger (P in [0, 256], l_i too): e4m3's smallest normal is 2^-6, and P's small values
    keep their bits; O_i / l_i is unchanged and L_i takes off 8 ln 2.
The errors are e4m3's: 3 mantissa bits in Q', K', V' and P, about 2^-5 relative each. reference() is the same
computation in numpy, the yardstick of the tolerance rule for this version.

forward() is the launcher: launches() configures and compiles the pre-pass's three kernels and the attention kernel,
and Fp8Launches runs them on a call's arrays.
"""
from typing import NamedTuple

import numpy as np

from stages.common import LOG2E, cast, fast_path, kernels, verify
from stages.common.checks import resolve_scale

from .params import HopperFwdParams
from .sm90a import CTYPE, function
from .tensor_maps import MappedLaunch, heads_map

FILE = "flash_v3_fp8_quantize.cu"  # the pre-pass
ATTENTION_FILE = "flash_v3_forward_fp8.cu"
HEAD_DIMS = (128,)
E4M3_MAX = 448.0
LIFT = 8           # P's 2^LIFT (kernels/hopper_tiles.cuh: softmax_tile)
BC = 128           # keys a K/V tile
GROUP = 16         # the period of the key order of V'^T (key_order)
THREADS = 256      # a pre-pass block's threads
PREPASS = ("fp8_amax", "fp8_scale_qk", "fp8_scale_vt")  # the pre-pass kernels, in the order they run


def instantiations():
    """[(file, name)]: the attention kernel (one per output type) and the pre-pass kernels (one per input type),
    which CI compiles for sm_90a."""
    return ([(ATTENTION_FILE, attention_instantiation(c)) for c in CTYPE.values()]
            + [(FILE, f"{k}<{c}>") for c in CTYPE.values() for k in PREPASS])


def attention_instantiation(ctype):
    return f"flash_v3_forward_fp8<{ctype}>"


def smem_bytes():
    """Q_i (128 rows) and two stages of K_j and V_j^T, 128 x 128 bytes each, one byte a value; 1024 for the swizzle's
    alignment."""
    return (128 + 2 * 2 * BC) * 128 + 1024


def row_keys(Nk):
    """The length of a row of v'^T: Nk rounded up to the key order's period."""
    return -(-Nk // GROUP) * GROUP


def forward(q, k, v, *, causal, scale):
    """Version fp8 on CuPy q, k, v (B, H, N, 128) in float16 or bfloat16 checked by flash_v3.forward (Nq, Nk > 0):
    the pre-pass, then the e4m3 kernel. o in q's dtype, lse float32."""
    plan = launches(np.dtype(q.dtype), q.shape, k.shape[2], causal, scale)
    return fast_path.launch(plan, q, k, v)  # the pre-pass's buffers, o and lse allocated; the four launches


def launches(dtype, q_shape, Nk, causal, scale):
    """The four launches of one problem, compiled and configured: an Fp8Launches."""
    B, H, Nq, D = q_shape
    ctype = CTYPE[dtype]
    # the pre-pass (kernels/flash_v3_fp8_quantize.cu): amax of each head, then q' and k', then v'^T
    row, vt_smem = row_keys(Nk), 64 * (D + 1) * 4  # fp8_scale_vt: 64 keys x D floats (+1 a row) a block
    fns = [function(FILE, f"{name}<{ctype}>", vt_smem if name == "fp8_scale_vt" else 0) for name in PREPASS]
    n_q, n_k = Nq * D, Nk * D
    chunks = max(1, min(1024, -(-max(n_q, n_k) // (16 * THREADS))))  # blocks a head: about 16 values a thread
    amax = kernels.Launch(fns[0], (chunks, B * H, 3), (THREADS,), 0, (np.int64(n_q), np.int64(n_k)))
    scale_qk = kernels.Launch(fns[1], (chunks, B * H, 2), (THREADS,), 0, (np.int64(n_q), np.int64(n_k)))
    scale_vt = kernels.Launch(fns[2], (-(-row // 64), B * H), (THREADS,), vt_smem,
                              (np.int32(Nk), np.int32(D), np.int32(row)))
    # the attention kernel (kernels/flash_v3_forward_fp8.cu) on the bytes: one block per (Q tile i, head)
    params = HopperFwdParams(Nq=Nq, Nk=Nk, scale_log2=scale * LOG2E, causal=int(bool(causal)), o_rows=Nq, merge=0,
                             heads=B * H)
    fn = function(ATTENTION_FILE, attention_instantiation(ctype), smem_bytes())  # compiled once
    attention = MappedLaunch.of(
        kernels.Launch(fn, (-(-Nq // 128), B * H), (384,), smem_bytes(), params),
        map_q=heads_map(q_shape, np.uint8), map_k=heads_map((B, H, Nk, D), np.uint8, box_rows=BC),
        map_v=heads_map((B, H, D, row), np.uint8, box_rows=64))  # v'^T: D rows of `row` keys, 64 rows a box
    return Fp8Launches(amax, scale_qk, scale_vt, attention, dtype)


class Fp8Launches(NamedTuple):
    """The launches of one problem: the pre-pass's amax, q' and k', v'^T, then attention (a MappedLaunch of q', k',
    v'^T, then o, lse, amax); odtype: o's. plan(q, k, v) -> (o, lse). outs: o and lse carved from one allocation
    (fast_path.out_layout), or None."""
    amax: kernels.Launch
    scale_qk: kernels.Launch
    scale_vt: kernels.Launch
    attention: MappedLaunch
    odtype: np.dtype
    outs: tuple | None = None

    @staticmethod
    def buffers(q_shape, Nk):
        """(amax, q', k', v'^T): the pre-pass's outputs for q of q_shape (B, H, Nq, D) and k, v of Nk rows a head."""
        import cupy

        B, H, Nq, D = q_shape
        return (cupy.empty((B * H, 3), cupy.float32), cupy.empty(q_shape, cupy.uint8),
                cupy.empty((B, H, Nk, D), cupy.uint8), cupy.empty((B, H, D, row_keys(Nk)), cupy.uint8))

    def prepass(self, q, k, v, buffers):
        """The pre-pass on row-major q, k, v into buffers (Fp8Launches.buffers): amax from 0, then q', k', v'^T."""
        amax, q8, k8, vt8 = buffers
        amax.fill(0)
        self.amax(q, k, v, amax)
        self.scale_qk(q, k, amax, q8, k8)
        self.scale_vt(v, amax, vt8)

    def __call__(self, q, k, v):
        q, k, v = (kernels.row_major(x) for x in (q, k, v))
        amax, q8, k8, vt8 = buffers = self.buffers(q.shape, k.shape[2])
        self.prepass(q, k, v, buffers)
        return kernels.run_forward(self.attention, q8, k8, vt8, self.odtype, amax, outs=self.outs)

    def with_joint_outputs(self, q, k, v):
        """These launches with o and lse from one allocation (fast_path keeps them so)."""
        B, H, Nq, D = q.shape
        return self._replace(outs=fast_path.out_layout([((B, H, Nq, D), self.odtype), ((B, H, Nq), np.float32)]))


# ----------------------------------------------------------------------------- the same in numpy
def e4m3(x):
    """x (float32) rounded to e4m3 as cvt.rn.satfinite does (to nearest even, saturating at +-448), as float64."""
    import ml_dtypes

    x = np.asarray(x, np.float32)
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def quantize(x):
    """(x', amax) of the pre-pass for x (B, H, N, D): per head amax = max |x| (float32), x' = e4m3(x 448 / amax) in
    float32 arithmetic (x' = e4m3(x) where amax = 0)."""
    x32 = np.asarray(x, np.float32)
    amax = np.abs(x32).max(axis=(2, 3), keepdims=True) if x32.size else np.zeros(x32.shape[:2] + (1, 1), np.float32)
    inv = np.where(amax > 0, np.float32(E4M3_MAX) / np.where(amax > 0, amax, 1), np.float32(1)).astype(np.float32)
    return e4m3(x32 * inv), amax


def reference(q, k, v, *, causal=False, scale=None):
    """Version fp8 computed in numpy (float64 but for e4m3's roundings): the pre-pass's q', k', v', S = f_q f_k
    Q' K'^T, the online softmax over tiles of BC keys as the kernel runs it with P rounded to e4m3 at 2^LIFT, O =
    f_v P V' / l. o (float64), lse (float64). The rule's yardstick for this version (tests/test_06_hopper_gpu.py)."""
    q, k, v = (np.asarray(x) for x in (q, k, v))
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    scale = resolve_scale(scale, D)
    (q8, aq), (k8, ak), (v8, av) = quantize(q), quantize(k), quantize(v)
    f = lambda a: a.astype(np.float64) / E4M3_MAX  # noqa: E731  (the kernel's factor, amax / 448)
    s = np.matmul(q8, k8.swapaxes(-1, -2)) * (f(aq) * f(ak)) * scale * LOG2E  # base 2
    if causal:
        s = np.where(np.arange(Nk)[None, :] <= np.arange(Nq)[:, None] + (Nk - Nq), s, -np.inf)
    m = np.full((B, H, Nq, 1), -np.inf)
    l = np.zeros((B, H, Nq, 1))
    o = np.zeros((B, H, Nq, D))
    for j0 in range(0, Nk, BC):
        sj = s[..., j0:j0 + BC]
        m_new = np.maximum(m, sj.max(axis=-1, keepdims=True))
        m_use = np.where(np.isneginf(m_new), 0.0, m_new)
        alpha = np.exp2(m - m_use)
        p = np.exp2(sj - m_use + LIFT)
        l = l * alpha + p.sum(axis=-1, keepdims=True)
        o = o * alpha + np.matmul(e4m3(p), v8[..., j0:j0 + BC, :])
        m = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(l > 0, o * f(av) / np.where(l > 0, l, 1), 0.0)
        lse = np.where(l > 0, (m - LIFT) * np.log(2) + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0]
    return o, lse


def yardstick(q, k, v, *, causal=False, scale=None):
    """reference() rounded as the kernel's outputs are (o in the inputs' dtype, lse float32): the tolerance rule's
    yardstick for this version (tolerance.forward_yardsticks evaluates it in both orders of the head dim)."""
    o, lse = reference(q, k, v, causal=causal, scale=scale)
    return cast(o, np.asarray(q).dtype), lse.astype(np.float32)


def key_order(L):
    """The key of a 16-key group that position L (0 .. 15, ints or an array) of V_j^T holds: the order in which the
    pre-pass writes v'^T.

    The 8-bit wgmma takes P from registers as A fragments of 32 keys: lane 4 g + t holds columns 4 t .. 4 t + 3 and
    16 + 4 t .. 16 + 4 t + 3 of rows g and g + 8. The accumulator of S = Q K^T leaves lane 4 g + t columns 2 t, 2 t + 1
    of every 8 (the mma C layout). Rather than move values between lanes, each lane packs its own four values of two
    8-column blocks, columns 2 t, 2 t + 1, 8 + 2 t, 9 + 2 t, into positions 4 t .. 4 t + 3: position L = 4 t + j holds
    key 8 (j // 2) + 2 t + j % 2. P V sums over keys in any order, so V_j^T's columns are laid out in the same order
    (kernels/flash_v3_fp8_quantize.cu) and the product is unchanged."""
    L = np.asarray(L)
    return 8 * ((L % 4) // 2) + 2 * (L // 4) + L % 2


def p_fragment_keys(t):
    """The keys, in A-fragment order, that lane t of a quad packs into one K step (32 keys) of P:
    registers a[0] / a[1] (rows g / g + 8) take columns 2 t, 2 t + 1, 8 + 2 t, 9 + 2 t of S, a[2] / a[3] the same 16
    keys on (kernels/hopper_tiles.cuh: p_fragments)."""
    first = [2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t]
    return np.array(first + [16 + c for c in first])


def pack_a(p):
    """The A operand of one 8-bit K step (rows x 32 positions) as the lanes of a quad fill it from P (rows x 32 keys,
    S's columns): lane t puts keys p_fragment_keys(t) at positions 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3,
    each row as the others (kernels/hopper_tiles.cuh: p_fragments, one register per row and 16 positions)."""
    p = np.asarray(p)
    a = np.zeros_like(p)
    for t in range(4):
        for j, key in enumerate(p_fragment_keys(t)):
            a[..., 16 * (j // 4) + 4 * t + j % 4] = p[..., key]
    return a


def check(q, k, v, *, causal=False, o=None):
    """Version fp8's launcher on CuPy q, k, v (or o, its output on other inputs, with its own lse) against the float64
    oracle by the tolerance rule (stages/common/verify.py), the yardstick being yardstick() in place of stage 00's.
    Raises AssertionError with the worst row when a row is out of bounds; returns {name: (error, bound)} at each
    output's worst row."""
    def run(q, k, v, *, causal, scale):
        got = forward(q, k, v, causal=causal, scale=resolve_scale(scale, q.shape[3]))
        return got if o is None else (o, got[1])

    return verify.check_forward(run, q, k, v, causal=causal, with_bounds=True, yardstick=yardstick,
                                what="version fp8: ")
