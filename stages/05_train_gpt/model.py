"""Stage 05: a small decoder-only transformer (GPT-2's shape), forward and backward by hand.

    x = wte[tokens] + wpe[positions]                           (B, N, C)  token + position embeddings
    for each of the L blocks (pre-LayerNorm):
        x = x + Attn(LN1(x)) W_proj + b_proj                   causal self-attention, H heads (any stage);
                                                               k, v of Hkv heads (grouped-query, Hkv | H)
        x = x + GELU(LN2(x) W_fc + b_fc) W_fcproj + b_fcproj   MLP, hidden width 4C
    logits = LN_f(x) W_head                                    (B, N, V)
    loss = mean over tokens with a target of -log softmax(logits)[target]

`backward` runs the same list in reverse, each layer's backward from layers.py. The residual stream x is
where the gradients of the two branches add: dx = dx_from_above + dx_through_the_branch.

Every token is processed on its own except in attention. That is what makes sequence parallelism cheap:
with the sequence cut into shards over P ranks, a rank runs this very code on its own tokens (their
global positions select the rows of wpe), only attention talks to the other ranks (stage 04's ring), and
the parameter gradients of the P ranks are summed at the end (loop.py).
"""
from dataclasses import asdict, dataclass

import numpy as np

from stages.common import array_module, cast

from . import layers as Lyr


@dataclass
class GPTConfig:
    vocab_size: int
    context: int = 64  # N: tokens per sequence (the position table has this many rows)
    n_layer: int = 2  # L
    d_model: int = 64  # C
    n_head: int = 2  # H (head dim D = C / H)
    n_kv_head: int = None  # Hkv: k, v heads, each read by H / Hkv query heads (None: H, multi-head attention)

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("vocab_size", "context", "n_layer", "d_model", "n_head", "n_kv_head"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GPT config: {name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPT config: d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GPT config: n_kv_head {self.n_kv_head} does not divide n_head {self.n_head} "
                             "(grouped-query attention: each k, v head serves n_head / n_kv_head query heads)")

    @property
    def head_dim(self):
        return self.d_model // self.n_head

    @property
    def qkv_width(self):
        """Columns of the fused projection W_qkv: C for the queries, then Hkv D for the keys and Hkv D for the values
        (3C with as many k, v heads as query heads)."""
        return self.d_model + 2 * self.n_kv_head * self.head_dim

    def as_dict(self):
        return asdict(self)


QK_GAIN = 2.0  # W_Q and W_K start at N(0, (QK_GAIN * 0.02)^2): init_params says why


def param_shapes(cfg):
    """Every parameter's name and shape, in a fixed order (the same order the PyTorch twin uses)."""
    C, V, W = cfg.d_model, cfg.vocab_size, cfg.qkv_width  # W = C + 2 Hkv D: W_Q, W_K, W_V side by side
    shapes = {"wte": (V, C), "wpe": (cfg.context, C)}
    for i in range(cfg.n_layer):
        shapes.update({f"h{i}.ln1_w": (C,), f"h{i}.ln1_b": (C,), f"h{i}.qkv_w": (C, W), f"h{i}.qkv_b": (W,),
                       f"h{i}.proj_w": (C, C), f"h{i}.proj_b": (C,), f"h{i}.ln2_w": (C,), f"h{i}.ln2_b": (C,),
                       f"h{i}.fc_w": (C, 4 * C), f"h{i}.fc_b": (4 * C,), f"h{i}.fcproj_w": (4 * C, C),
                       f"h{i}.fcproj_b": (C,)})
    shapes.update({"lnf_w": (C,), "lnf_b": (C,), "head_w": (C, V)})
    return shapes


def init_params(cfg, seed, dtype=np.float32, xp=np):
    """GPT-2's initialisation, drawn in float64 on the host from `seed` (the same numbers on every device and
    every rank): weights N(0, 0.02), the two projections into the residual stream N(0, 0.02 / sqrt(2L)) so
    the stream's variance does not grow with depth, biases 0, LayerNorm gains 1.

    One change from GPT-2: the query and key projections W_Q, W_K (the first C + Hkv D columns of qkv_w) start QK_GAIN
    times larger. A score S_ij = q_i . k_j is a product of the two, and the gradient of each is proportional to the
    other, so from two small matrices the scores stay nearly flat for long: the plateau before the recall task's
    jump (README, "Why these defaults"), which then comes late, or not within a short run."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        leaf = name.split(".")[-1]
        if leaf.startswith("ln") and leaf.endswith("_w"):  # ln1_w, ln2_w, lnf_w
            a = np.ones(shape)
        elif leaf.endswith("_b"):
            a = np.zeros(shape)
        else:
            std = 0.02 / np.sqrt(2 * cfg.n_layer) if leaf in ("proj_w", "fcproj_w") else 0.02
            a = rng.standard_normal(shape) * std
            if leaf == "qkv_w":  # (C, C + 2 Hkv D): the columns of W_Q and W_K; W_V keeps 0.02
                a[:, :cfg.d_model + cfg.n_kv_head * cfg.head_dim] *= QK_GAIN
        params[name] = xp.asarray(a.astype(dtype))
    return params


def n_params(cfg):
    return sum(int(np.prod(s)) for s in param_shapes(cfg).values())


def forward(params, cfg, tokens, targets, pos, attn, cd):
    """Loss of one batch. tokens, targets (B, N) int (target -1: no loss there); pos (N,) global positions of
    these tokens, a numpy array (checked on the host, then copied to the parameters' device); attn: the attention
    kernel; cd: compute dtype of the activations (layers.py).

    Returns (loss_sum, count, cache): the summed loss over the tokens with a target and how many there were (0-d
    arrays on the device: nothing here waits for the GPU), and everything the backward needs."""
    last = int(np.max(pos))  # the farthest global position among these tokens
    if tokens.shape[1] > cfg.context or last >= cfg.context:
        raise ValueError(f"sequence of {tokens.shape[1]} tokens (positions up to {last}) does not fit the context "
                         f"of {cfg.context}")
    p, H, Hkv = params, cfg.n_head, cfg.n_kv_head
    pos = array_module(p["wpe"]).asarray(pos)  # (N,) on the parameters' device
    x = Lyr.embedding_forward(tokens, pos, p["wte"], p["wpe"])  # (B, N, C), master dtype
    blocks = []
    for i in range(cfg.n_layer):
        w = lambda n: p[f"h{i}.{n}"]  # noqa: E731 - this block's parameters
        h1, ln1 = Lyr.layernorm_forward(x, w("ln1_w"), w("ln1_b"), cd)  # (B, N, C) in cd
        qkv = Lyr.linear_forward(h1, w("qkv_w"), w("qkv_b"))  # (B, N, C + 2 Hkv D)
        a, att = Lyr.attention_forward(qkv, H, attn, n_kv_heads=Hkv)  # (B, N, C)
        y = Lyr.linear_forward(a, w("proj_w"), w("proj_b"))  # (B, N, C)
        x = x + cast(y, x.dtype)  # residual
        h2, ln2 = Lyr.layernorm_forward(x, w("ln2_w"), w("ln2_b"), cd)
        f = Lyr.linear_forward(h2, w("fc_w"), w("fc_b"))  # (B, N, 4C)
        g = Lyr.gelu_forward(f)  # (B, N, 4C)
        m = Lyr.linear_forward(g, w("fcproj_w"), w("fcproj_b"))  # (B, N, C)
        x = x + cast(m, x.dtype)  # residual
        blocks.append((h1, ln1, att, a, h2, ln2, f, g))
    hf, lnf = Lyr.layernorm_forward(x, p["lnf_w"], p["lnf_b"], cd)  # (B, N, C)
    B, N, C = hf.shape
    logits = Lyr.mm(hf.reshape(B * N, C), cast(p["head_w"], cd), out_dtype=Lyr.acc_dtype(cd))  # (B*N, V)
    logits = logits.reshape(B, N, cfg.vocab_size)  # (B, N, V)
    loss_sum, count, probs = Lyr.cross_entropy_forward(logits, targets)
    return loss_sum, count, (tokens, targets, pos, blocks, hf, lnf, probs, x.dtype)


def backward(params, cfg, cache, attn, count):
    """Gradients of (loss_sum of every rank) / count with respect to every parameter, in the master dtype.

    count: tokens with a target in the whole batch (all ranks), so that the gradients are those of the mean."""
    tokens, targets, pos, blocks, hf, lnf, probs, master = cache
    p = params
    cd = hf.dtype
    B, N, C = hf.shape
    grads = {}
    dlogits = Lyr.cross_entropy_backward(probs, targets, count)  # (B, N, V), float32
    dl2 = cast(dlogits.reshape(B * N, -1), cd)  # (B*N, V) in the compute dtype
    grads["head_w"] = Lyr.mm(hf.reshape(B * N, C).T, dl2, out_dtype=master)  # (C, V) = hf^T dlogits
    dhf = Lyr.mm(dl2, cast(p["head_w"], cd).T).reshape(B, N, C)  # (B, N, C) = dlogits W_head^T
    dx, grads["lnf_w"], grads["lnf_b"] = Lyr.layernorm_backward(dhf, p["lnf_w"], lnf)  # (B, N, C), master
    for i in reversed(range(cfg.n_layer)):
        h1, ln1, att, a, h2, ln2, f, g = blocks[i]
        w = lambda n: p[f"h{i}.{n}"]  # noqa: E731
        k = f"h{i}."
        # MLP branch: x = x + m, so dm = dx, and the branch's input gradient adds onto dx
        dg, grads[k + "fcproj_w"], grads[k + "fcproj_b"] = Lyr.linear_backward(cast(dx, cd), g, w("fcproj_w"))
        df = Lyr.gelu_backward(dg, f)  # (B, N, 4C)
        dh2, grads[k + "fc_w"], grads[k + "fc_b"] = Lyr.linear_backward(df, h2, w("fc_w"))
        dx2, grads[k + "ln2_w"], grads[k + "ln2_b"] = Lyr.layernorm_backward(dh2, w("ln2_w"), ln2)
        dx = dx + dx2
        # attention branch
        da, grads[k + "proj_w"], grads[k + "proj_b"] = Lyr.linear_backward(cast(dx, cd), a, w("proj_w"))
        dqkv = Lyr.attention_backward(da, att, attn)  # (B, N, C + 2 Hkv D)
        dh1, grads[k + "qkv_w"], grads[k + "qkv_b"] = Lyr.linear_backward(dqkv, h1, w("qkv_w"))
        dx1, grads[k + "ln1_w"], grads[k + "ln1_b"] = Lyr.layernorm_backward(dh1, w("ln1_w"), ln1)
        dx = dx + dx1
    grads["wte"], grads["wpe"] = Lyr.embedding_backward(dx, tokens, pos, p["wte"].shape, p["wpe"].shape)
    return {name: cast(grads[name], master) for name in params}  # in the parameters' order


def loss_and_grads(params, cfg, tokens, targets, pos, attn, cd, count=None):
    """forward + backward on one device: (mean loss, grads)."""
    loss_sum, n, cache = forward(params, cfg, tokens, targets, pos, attn, cd)
    count = count or int(n)
    return float(loss_sum) / count, backward(params, cfg, cache, attn, count)
