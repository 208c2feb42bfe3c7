"""Stage 05: the layers of a GPT, each forward beside its hand-written backward (in the spirit of llm.c).

Every function takes numpy or CuPy arrays (`xp` is whichever module they belong to) and does the same
maths on both. Shapes: B batch, N tokens per sequence (this rank's tokens under the ring), C channels
(d_model), H heads, D = C / H head dim, Hkv k / v heads (grouped-query attention), V vocabulary size.

A backward takes the gradient of the loss with respect to the layer's output (dy, "dL/dy") and what the
forward saved, and returns the gradients with respect to the layer's inputs and parameters.

Precision. Parameters are float32 "master" weights (float64 in the finite-difference checks). The
activations that feed matmuls and attention are in the compute dtype `cd`: float64 (checks), float32, or
bfloat16 (mixed precision on the GPU). A matmul on bfloat16 inputs accumulates in float32 and rounds its
result to bfloat16, as a tensor core does; LayerNorm statistics, GELU, the softmax of the loss and every
parameter gradient are computed in float32 (float64 when cd is float64). The residual stream stays in
float32 (the master dtype), so rounding errors do not pile up along the depth of the network.
"""
import math

import numpy as np

from stages.common import array_module, bfloat16, cast

GELU_C = math.sqrt(2.0 / math.pi)  # the tanh approximation of GELU (GPT-2's): sqrt(2/pi)
_NATIVE_BF16 = {}  # does xp.matmul run on bfloat16 directly (CuPy: cuBLAS)? Tried once per module.


def acc_dtype(dtype):
    """The accumulation dtype for a compute dtype: float64 for float64, float32 otherwise."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def mm(a, b, out_dtype=None):
    """a @ b for float64 / float32 / bfloat16 inputs of one dtype: sums in float32 (float64 for float64),
    the result rounded to out_dtype (default: the inputs' dtype).

    numpy has no bfloat16 matmul: the inputs are widened to float32 (exact), multiplied, and the result
    rounded, which is what a bfloat16 tensor-core matmul with float32 accumulation computes. CuPy is asked
    for a native bfloat16 matmul first (cuBLAS, fp32 accumulation); if it refuses, the same widening runs."""
    xp = array_module(a, b)
    out_dtype = np.dtype(out_dtype or a.dtype)
    if a.dtype == bfloat16:
        if xp is not np and _NATIVE_BF16.get("cupy", True):
            try:
                return cast(xp.matmul(a, b), out_dtype)
            except Exception:  # noqa: BLE001 - CuPy without bfloat16 GEMM: widen (and remember)
                _NATIVE_BF16["cupy"] = False
        return cast(xp.matmul(cast(a, np.float32), cast(b, np.float32)), out_dtype)
    return cast(xp.matmul(a, b), out_dtype)


def _flat(x):
    return x.reshape(-1, x.shape[-1])  # (B, N, C) -> (B*N, C)


# --------------------------------------------------------------------------- token + position embedding
def embedding_forward(tokens, pos, wte, wpe):
    """x[b, t] = wte[tokens[b, t]] + wpe[pos[t]]: a lookup, no arithmetic but one add.

    tokens (B, N) int, pos (N,) the GLOBAL positions of these tokens (0..N-1 on one device; a rank's
    shard of them under the ring), wte (V, C), wpe (Nmax, C). Returns x (B, N, C) in the master dtype."""
    return wte[tokens] + wpe[pos][None]  # (B, N, C) + (1, N, C)


def embedding_backward(dx, tokens, pos, wte_shape, wpe_shape):
    """A lookup's backward scatters: every row of dx is added to the table row it was read from.

        dwte[v] = sum over (b, t) with tokens[b, t] = v of dx[b, t]
        dwpe[p] = sum over b of dx[b, t] where pos[t] = p
    A token that appears twice gets both rows added (np.add.at / cupyx.scatter_add: no lost updates)."""
    xp = array_module(dx)
    dwte = xp.zeros(wte_shape, dtype=dx.dtype)
    dwpe = xp.zeros(wpe_shape, dtype=dx.dtype)
    C = dx.shape[-1]
    _scatter_add(dwte, tokens.reshape(-1), dx.reshape(-1, C))  # (B*N,) rows of (B*N, C)
    _scatter_add(dwpe, xp.asarray(pos), dx.sum(axis=0))  # (N,) rows of (N, C)
    return dwte, dwpe


def _scatter_add(table, index, rows):
    """table[index[i]] += rows[i] for every i, repeated indices included (unbuffered: np.add.at / cupy.add.at)."""
    xp = array_module(table)
    if hasattr(xp.add, "at"):
        xp.add.at(table, index, rows)
    else:  # an older CuPy
        import cupyx

        cupyx.scatter_add(table, index, rows)


# --------------------------------------------------------------------------- LayerNorm
def layernorm_forward(x, w, b, out_dtype, eps=1e-5):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis (the C channels of one token).

    x (B, N, C) in the master dtype; statistics in that dtype; y rounded to out_dtype (it feeds a matmul).
    Saves xhat = (x - mean) * rstd and rstd = 1/sqrt(var + eps) (B, N, 1) for the backward."""
    mean = x.mean(axis=-1, keepdims=True)  # (B, N, 1)
    xc = x - mean
    rstd = 1.0 / ((xc * xc).mean(axis=-1, keepdims=True) + eps) ** 0.5  # (B, N, 1)
    xhat = xc * rstd  # (B, N, C)
    return cast(xhat * w + b, out_dtype), (xhat, rstd)


def layernorm_backward(dy, w, cache):
    """With g = dy * w (the gradient reaching xhat), the backward of xhat = (x - mean) * rstd is

        dx = rstd * (g - mean(g) - xhat * mean(g * xhat))        means over the C channels
    (the two subtracted terms are the paths through the mean and through the variance).
        dw = sum over (b, t) of dy * xhat,   db = sum over (b, t) of dy."""
    xhat, rstd = cache
    dy = cast(dy, xhat.dtype)
    g = dy * w  # (B, N, C)
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dw = (_flat(dy) * _flat(xhat)).sum(axis=0)  # (C,)
    db = _flat(dy).sum(axis=0)  # (C,)
    return dx, dw, db


# --------------------------------------------------------------------------- linear layer
def linear_forward(x, w, b):
    """y = x W + b: x (B, N, Cin) in the compute dtype, W (Cin, Cout) and b (Cout,) master weights (rounded
    to x's dtype for the matmul). Returns y (B, N, Cout) in x's dtype."""
    y = mm(_flat(x), cast(w, x.dtype))  # (B*N, Cout)
    y = cast(cast(y, acc_dtype(x.dtype)) + b, x.dtype)  # bias added in float32, rounded once
    return y.reshape(*x.shape[:-1], w.shape[1])  # (B, N, Cout)


def linear_backward(dy, x, w):
    """y = x W + b  =>  dx = dy W^T,  dW = x^T dy (summed over every token),  db = sum over tokens of dy.

    dy and x in the compute dtype; dW and db come out in the master (accumulation) dtype."""
    acc = acc_dtype(x.dtype)
    dy2 = _flat(cast(dy, x.dtype))  # (B*N, Cout)
    dx = mm(dy2, cast(w, x.dtype).T).reshape(x.shape)  # (B*N, Cin) -> (B, N, Cin)
    dw = mm(_flat(x).T, dy2, out_dtype=acc)  # (Cin, Cout)
    db = cast(dy2, acc).sum(axis=0)  # (Cout,)
    return dx, dw, db


# --------------------------------------------------------------------------- GELU
def gelu_forward(x):
    """GELU, tanh approximation (GPT-2): y = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3).

    Computed in float32 (float64 for float64 inputs), rounded back to x's dtype."""
    xf = cast(x, acc_dtype(x.dtype))
    xp = array_module(x)
    u = GELU_C * (xf + 0.044715 * (xf * xf * xf))  # x^3 as two products: numpy's float power is many times slower
    return cast(0.5 * xf * (1.0 + xp.tanh(u)), x.dtype)


def gelu_backward(dy, x):
    """dy/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx,   du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)."""
    acc = acc_dtype(x.dtype)
    xf = cast(x, acc)
    xp = array_module(x)
    x2 = xf * xf
    t = xp.tanh(GELU_C * (xf + 0.044715 * (x2 * xf)))
    grad = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * x2)
    return cast(cast(dy, acc) * grad, x.dtype)


# --------------------------------------------------------------------------- causal self-attention
def attention_forward(qkv, n_heads, attn, n_kv_heads=None):
    """Multi-head causal self-attention around any stage's kernel, with grouped-query heads.

    qkv (B, N, C + 2 Hkv D) = LayerNorm(x) W_qkv + b_qkv: the queries of every head, then the keys and the values of
    the Hkv = n_kv_heads k / v heads (None: n_heads, multi-head attention, qkv (B, N, 3C)), side by side.
    attn: an attention kernel (attention.py) with forward(q, k, v) -> (o, lse), q (B, H, N, D), k, v (B, Hkv, N, D);
    query head h reads k / v head h // (H / Hkv).
        q, k, v = split(qkv)              q (B, H, N, D), k and v (B, Hkv, N, D): heads moved in front of the tokens
        o, lse  = attn.forward(q, k, v)   o = softmax(q k^T / sqrt(D) + causal mask) v
        y       = merge heads of o        (B, N, C)
    Returns y and the cache (q, k, v, o, lse) the backward needs (lse lets it recompute P)."""
    B, N, _ = qkv.shape
    Hkv = n_kv_heads or n_heads
    D = qkv.shape[2] // (n_heads + 2 * Hkv)
    C, KV = n_heads * D, Hkv * D  # the widths of the queries, and of the keys (or the values)
    xp = array_module(qkv)

    def heads(cols, h):  # columns of qkv -> (B, h, N, D), row-major as the kernels want
        return xp.ascontiguousarray(qkv[:, :, cols].reshape(B, N, h, D).transpose(0, 2, 1, 3))

    q, k, v = heads(slice(0, C), n_heads), heads(slice(C, C + KV), Hkv), heads(slice(C + KV, C + 2 * KV), Hkv)
    o, lse = attn.forward(q, k, v)  # (B, H, N, D), (B, H, N)
    y = o.transpose(0, 2, 1, 3).reshape(B, N, C)  # (B, H, N, D) -> (B, N, H, D) -> (B, N, C)
    return y, (q, k, v, o, lse)


def attention_backward(dy, cache, attn):
    """The kernel's backward (stage 00/01/03, or the ring's) between the two reshapes:

        do = split heads of dy                      (B, H, N, D)
        dq, dk, dv = attn.backward(q, k, v, o, lse, do)
        dqkv = the three put back side by side       (B, N, C + 2 Hkv D).
    With grouped-query heads a k / v head was read by H / Hkv query heads, so its gradient is the sum of what each of
    them sends back: dk, dv come from the kernel with Hkv heads, summed over each group (attention.py says where)."""
    q, k, v, o, lse = cache
    B, H, N, D = q.shape
    xp = array_module(dy)
    do = xp.ascontiguousarray(cast(dy, q.dtype).reshape(B, N, H, D).transpose(0, 2, 1, 3))  # (B, H, N, D)
    dq, dk, dv = attn.backward(q, k, v, o, lse, do)  # (B, H, N, D), (B, Hkv, N, D), (B, Hkv, N, D)
    cols = [g.transpose(0, 2, 1, 3).reshape(B, N, -1) for g in (dq, dk, dv)]  # (B, N, H D), (B, N, Hkv D) x 2
    return xp.concatenate(cols, axis=-1)  # (B, N, C + 2 Hkv D), in qkv's column order


# --------------------------------------------------------------------------- softmax + cross-entropy
def cross_entropy_forward(logits, targets):
    """Per-token loss -log softmax(logits)[target], summed over the tokens that have a target.

    logits (B, N, V), targets (B, N) int with -1 where there is nothing to predict (the loss ignores it).
    Stable softmax: subtract the row max before exp. Returns (loss_sum, count, probs); the mean loss is
    loss_sum / count over every token of the batch (summed over ranks under the ring). loss_sum and count are 0-d
    arrays on the logits' device (float() / int() read them): the forward never waits for the GPU."""
    xp = array_module(logits)
    B, N, V = logits.shape
    z = cast(logits, acc_dtype(logits.dtype))
    z = z - z.max(axis=-1, keepdims=True)  # (B, N, V), row max 0: exp never overflows
    ez = xp.exp(z)
    sumexp = ez.sum(axis=-1, keepdims=True)  # (B, N, 1)
    probs = ez / sumexp
    mask = targets >= 0  # (B, N)
    t = xp.where(mask, targets, 0).reshape(-1)  # (B*N,) an index that is valid everywhere
    z_t = z.reshape(B * N, V)[xp.arange(B * N), t].reshape(B, N)  # (B, N) the target's logit
    logp_t = z_t - xp.log(sumexp[..., 0])  # (B, N) log softmax at the target
    loss_sum = -(logp_t * mask).sum()
    return loss_sum, mask.sum(), probs


def cross_entropy_backward(probs, targets, count):
    """d(mean loss)/d logits = (softmax(logits) - onehot(target)) / count on a token with a target, 0 elsewhere.

    count: the number of tokens with a target in the WHOLE batch (every rank), so each rank's part of the
    gradient is already scaled for the global mean."""
    xp = array_module(probs)
    B, N, V = probs.shape
    mask = targets >= 0
    t = xp.where(mask, targets, 0).reshape(-1)  # (B*N,)
    dlogits = probs.reshape(B * N, V).copy()  # (B*N, V) softmax
    dlogits[xp.arange(B * N), t] -= 1.0  # minus the one-hot target
    return dlogits.reshape(B, N, V) * (mask[..., None] / count)


# --------------------------------------------------------------------------- AdamW
class AdamW:
    """AdamW (Loshchilov & Hutter), as torch.optim.AdamW computes it, on a dict of master weights:

        p -= lr * wd * p                                   decoupled weight decay (matrices only)
        m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2    moment estimates
        p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        xp = array_module(*params.values())
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, betas[0], betas[1], eps, weight_decay
        self.m = {k: xp.zeros_like(p) for k, p in params.items()}
        self.v = {k: xp.zeros_like(p) for k, p in params.items()}
        self.t = 0

    @staticmethod
    def decays(name, p):
        """Weight decay on the weight matrices (ndim 2), not on biases, LayerNorm gains or ... (ndim 1)."""
        return p.ndim == 2

    def step(self, params, grads, lr=None):
        lr = self.lr if lr is None else lr
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for k, p in params.items():
            g = grads[k]
            if self.decays(k, p):
                p *= 1 - lr * self.wd
            m, v = self.m[k], self.v[k]
            m *= self.b1
            m += (1 - self.b1) * g
            v *= self.b2
            v += (1 - self.b2) * g * g
            p -= lr * (m / c1) / ((v / c2) ** 0.5 + self.eps)


def grad_norm(grads):
    """The global L2 norm of every gradient together (for clipping): sqrt(sum of squares), summed in float64.

    A 0-d array on the gradients' device (float() reads it): computing it does not make the host wait for the GPU."""
    xp = array_module(*grads.values())
    return xp.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values()))
