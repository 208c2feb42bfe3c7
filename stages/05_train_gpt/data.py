"""Stage 05: training data. Nothing is downloaded.

RecallTask (the default): associative recall, a task that cannot be solved without attention.
    A sequence is a context of key-value pairs scattered among filler tokens, then queries:
        . . (k3:v7) . . . (k1:v2) . (k5:v5) . . . | k1? k5? k3? ...
                                                     ^ predict v2: written only once, far back
    Each pair is one token `(k:v)` (n_keys x n_values of them), each query a token `k?`; the targets are
    value tokens `v`. The loss counts only the queries (target -1 everywhere else). A value is drawn at
    random per pair, so without looking back at the pair the best a model can do is to guess among the
    n_values values: loss ln(n_values), the "chance" line. A model whose attention is broken stays there;
    one that learns to attend from `k?` to the pair token with key k and read its value goes towards 0,
    which one attention layer can do. The longer the context, the farther back the pairs lie.
    (With key and value as two tokens `k v`, the model would first have to learn an induction circuit
    over two layers first: slower to get going than a short CPU run allows.)
TextData (--data FILE): any text file, character level; the loss counts every next character.

Batches are a pure function of (seed, step): every rank of a sequence-parallel run and the PyTorch twin
draw the very same batches, in the same order, without talking to each other.
"""
import pathlib

import numpy as np

FILLER = 4  # filler tokens 0..FILLER-1 between the pairs


class RecallTask:
    """Associative recall over `context` tokens: n_pairs pair tokens in the context part, n_queries queries at
    the end (one token each).

    Vocabulary: filler 0..3, pair tokens (k:v), query tokens k?, value tokens v."""

    def __init__(self, context, *, n_keys=None, n_values=16, n_pairs=None, n_queries=None, seed=0):
        if context < 4:
            raise ValueError(f"recall task: context {context} is too short (at least 4 tokens: pairs and queries)")
        self.context, self.seed = int(context), int(seed)
        self.n_queries = int(n_queries or max(2, min(64, context // 6)))
        self.n_pairs = int(n_pairs or self.n_queries)
        self.n_keys = int(n_keys or max(8, self.n_pairs))
        self.n_values = int(n_values)
        if self.n_queries > self.n_pairs:
            raise ValueError(f"recall task: {self.n_queries} queries need at least as many pairs, got {self.n_pairs}")
        if self.n_pairs > self.n_keys:
            raise ValueError(f"recall task: {self.n_pairs} pairs need {self.n_pairs} distinct keys, "
                             f"got n_keys={self.n_keys}")
        if self.n_pairs + self.n_queries > self.context:
            raise ValueError(f"recall task: {self.n_pairs} pairs and {self.n_queries} queries do not fit in a "
                             f"context of {context} tokens (need pairs + queries <= context)")
        self.pair0 = FILLER  # token of pair (k:v) = pair0 + k * n_values + v
        self.query0 = self.pair0 + self.n_keys * self.n_values  # token of query k? = query0 + k
        self.value0 = self.query0 + self.n_keys  # token of value v = value0 + v
        self.vocab_size = self.value0 + self.n_values
        self.chance_loss = float(np.log(self.n_values))

    def batch(self, step, batch_size):
        """tokens, targets (batch_size, context) int32 for training step `step` (a pure function of seed, step)."""
        rng = np.random.default_rng([self.seed, int(step)])
        B, N, M, Q = batch_size, self.context, self.n_pairs, self.n_queries
        ctx = N - Q  # tokens of the context part
        tokens = rng.integers(0, FILLER, size=(B, N))  # filler everywhere to start with
        targets = np.full((B, N), -1)
        rows = np.arange(B)[:, None]
        keys = np.argsort(rng.random((B, self.n_keys)), axis=1)[:, :M]  # (B, M) distinct keys
        values = rng.integers(0, self.n_values, size=(B, M))  # (B, M)
        where = np.argsort(rng.random((B, ctx)), axis=1)[:, :M]  # (B, M) distinct positions in the context part
        tokens[rows, where] = self.pair0 + keys * self.n_values + values
        which = np.argsort(rng.random((B, M)), axis=1)[:, :Q]  # (B, Q) the pairs asked for, in random order
        qpos = ctx + np.arange(Q)[None]  # (1, Q) query positions
        tokens[rows, qpos] = self.query0 + np.take_along_axis(keys, which, axis=1)
        targets[rows, qpos] = self.value0 + np.take_along_axis(values, which, axis=1)
        return tokens.astype(np.int32), targets.astype(np.int32)

    def describe(self):
        return (f"associative recall: {self.n_pairs} key-value pairs in {self.context} tokens, {self.n_queries} "
                f"queries, {self.n_keys} keys, {self.n_values} values (chance loss ln {self.n_values} = "
                f"{self.chance_loss:.3f})")


class TextData:
    """Character-level language modelling on one text file: random windows of context + 1 characters."""

    def __init__(self, path, context, *, seed=0):
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--data {path}: no such file")
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) < context + 2:
            raise ValueError(f"--data {path}: {len(text)} characters, fewer than context + 2 = {context + 2}; "
                             "use a longer file or a shorter --context")
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        lookup = {c: i for i, c in enumerate(self.chars)}
        self.ids = np.array([lookup[c] for c in text], dtype=np.int32)
        self.context, self.seed, self.path = int(context), int(seed), path
        self.chance_loss = float(np.log(self.vocab_size))  # a uniform guess over the characters

    def batch(self, step, batch_size):
        rng = np.random.default_rng([self.seed, int(step)])
        starts = rng.integers(0, len(self.ids) - self.context - 1, size=batch_size)
        idx = starts[:, None] + np.arange(self.context + 1)[None]  # (B, N+1)
        window = self.ids[idx]
        return window[:, :-1].copy(), window[:, 1:].copy()  # inputs, next characters

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in ids)

    def describe(self):
        return f"characters of {self.path.name}: {len(self.ids)} characters, vocabulary {self.vocab_size}"
