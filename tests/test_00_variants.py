"""Stage 00's variants (stages/common/variants.py): grouped-query attention, sliding window, softcap, ALiBi, dropout
and packed variable-length batches. Each option is checked against its definition written out directly, its
backward against finite differences, the 16-bit and float32 yardsticks against the float64 oracle by the tolerance
rule, and bad input against a clear error."""
import numpy as np
import pytest

from stages import naive
from stages.common import bfloat16, check_backward, check_forward, make_inputs, variants

# ---------------------------------------------------------------- options, one at a time and together
# (B, H, Hkv, Nq, Nk, D, causal, options) for the option tests below
OPTION_CASES = {
    "gqa4": (2, 4, 1, 9, 9, 8, False, {}),
    "gqa2-causal": (1, 4, 2, 7, 11, 8, True, {}),
    "window": (1, 2, 2, 12, 12, 8, False, {"window": (3, 2)}),
    "window-causal-q<k": (1, 2, 2, 6, 13, 8, True, {"window": (4, -1)}),
    "window-left0-q>k": (1, 2, 2, 13, 6, 8, False, {"window": (0, 1)}),
    "softcap": (1, 2, 2, 9, 10, 8, False, {"softcap": 0.7}),
    "alibi": (1, 3, 3, 9, 10, 8, True, {"alibi_slopes": np.array([0.5, 0.25, 0.125])}),
    "alibi-bh": (2, 2, 2, 5, 8, 8, False, {"alibi_slopes": np.array([[0.3, 0.1], [1.0, 0.0]])}),
    "dropout": (1, 2, 2, 17, 19, 8, False, {"dropout_p": 0.3, "seed": 7}),
    "all": (2, 4, 2, 18, 20, 8, True, {"window": (5, -1), "softcap": 2.0,
                                       "alibi_slopes": np.array([0.2, 0.1, 0.05, 0.025]), "dropout_p": 0.25,
                                       "seed": 2**40 + 3}),
}


def _inputs(case, dtype=np.float64, scale=1.0):
    B, H, Hkv, Nq, Nk, D, causal, opts = case
    q, _, _, do = make_inputs(B, H, Nq, Nk, D, dtype=dtype, grad=True, scale=scale)
    _, k, v = make_inputs(B, Hkv, Nq, Nk, D, dtype=dtype, scale=scale)
    return q, k, v, do, causal, opts


def _direct(q, k, v, causal, opts, scale=None):
    """The definition written out loop by loop in float64: one (b, h, i) row at a time."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(D) if scale is None else scale
    left, right = opts.get("window", (-1, -1))
    right = 0 if causal else right
    slopes = opts.get("alibi_slopes")
    slopes = None if slopes is None else np.broadcast_to(np.asarray(slopes, np.float64), (B, H))
    p_drop = opts.get("dropout_p", 0.0)
    keep = variants.dropout_keep(B, H, Nq, Nk, p_drop, opts.get("seed", 0))
    o = np.zeros(q.shape)
    lse = np.full((B, H, Nq), -np.inf)
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hkv)
            for i in range(Nq):
                c = i + Nk - Nq  # the query's diagonal
                js = [j for j in range(Nk) if (left < 0 or j >= c - left) and (right < 0 or j <= c + right)]
                if not js:
                    continue
                s = np.array([scale * q[b, h, i] @ k[b, hk, j] for j in js])
                if "softcap" in opts:
                    s = opts["softcap"] * np.tanh(s / opts["softcap"])
                if slopes is not None:
                    s = s - slopes[b, h] * np.abs(c - np.array(js))
                e = np.exp(s - s.max())
                lse[b, h, i] = s.max() + np.log(e.sum())
                w = e / e.sum() * keep[b, h, i, js] / (1 - p_drop)
                o[b, h, i] = w @ v[b, hk, js]
    return o, lse


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_forward_matches_the_definition_row_by_row(name):
    q, k, v, _, causal, opts = _inputs(OPTION_CASES[name])
    o, lse = naive.forward(q, k, v, causal=causal, **opts)
    o_ref, lse_ref = _direct(q, k, v, causal, opts)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    # atol as for o: L_i = m_i + log l_i is a sum of terms of order 1, so near L_i = 0 its rounding is absolute
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_ref[np.isfinite(lse_ref)], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_backward_matches_central_finite_differences(name):
    """d/dx sum(O * dO) by central differences in float64, every element of q, k (Hkv heads) and v. The dropout
    mask is a function of the seed and the position, so it stays fixed while the inputs move."""
    B, H, Hkv, Nq, Nk, D, causal, opts = OPTION_CASES[name]
    case = (B, H, Hkv, min(Nq, 7), min(Nk, 7), 4, causal, opts)  # small: 3 (2n) forward calls per element
    q, k, v, do, causal, opts = _inputs(case)
    o, lse = naive.forward(q, k, v, causal=causal, **opts)
    grads = naive.backward(q, k, v, o, lse, do, causal=causal, **opts)
    eps = 1e-6
    for which, g in enumerate(grads):
        args = [q, k, v]
        assert g.shape == args[which].shape
        fd = np.zeros_like(args[which])
        for idx in np.ndindex(*fd.shape):
            f = []
            for sign in (1, -1):
                moved = [a.copy() for a in args]
                moved[which][idx] += sign * eps
                f.append(np.sum(naive.forward(*moved, causal=causal, **opts)[0] * do))
            fd[idx] = (f[0] - f[1]) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg=f"gradient {'qkv'[which]}")


def test_special_cases_reduce_to_plain_attention():
    """window (-1, 0) is causal, (-1, -1) is none; zero ALiBi slopes, dropout 0 and a huge softcap change nothing;
    Hkv = H is plain."""
    q, k, v = make_inputs(2, 4, 10, 12, 8, dtype=np.float64)
    o_c, lse_c = naive.forward(q, k, v, causal=True)
    np.testing.assert_array_equal(naive.forward(q, k, v, window=(-1, 0))[0], o_c)
    np.testing.assert_array_equal(naive.forward(q, k, v, causal=True, window=(-1, -1))[0], o_c)
    o, lse = naive.forward(q, k, v)
    np.testing.assert_array_equal(naive.forward(q, k, v, alibi_slopes=np.zeros(4))[0], o)
    np.testing.assert_array_equal(naive.forward(q, k, v, dropout_p=0.0, seed=5)[0], o)
    np.testing.assert_allclose(naive.forward(q, k, v, softcap=1e6)[0], o, rtol=1e-6, atol=1e-12)


def test_window_of_one_key_returns_that_value():
    """window (0, 0) shows each query only the key on its diagonal (i + Nk - Nq): O_i = V_{i + Nk - Nq}, and rows
    whose diagonal is outside the keys (Nq > Nk) see nothing: 0 and lse -inf."""
    q, k, v = make_inputs(1, 2, 9, 6, 8, dtype=np.float64)
    o, lse = naive.forward(q, k, v, window=(0, 0))
    np.testing.assert_allclose(o[:, :, 3:], v, rtol=1e-13)
    assert (o[:, :, :3] == 0).all() and np.isneginf(lse[:, :, :3]).all()


def test_gqa_is_plain_attention_on_repeated_heads():
    q, k, v, do = make_inputs(2, 6, 9, 11, 8, dtype=np.float64, grad=True)
    k2, v2 = k[:, ::3], v[:, ::3]  # Hkv = 2: query heads 0-2 read kv head 0, 3-5 kv head 1
    o, lse = naive.forward(q, k2, v2, causal=True)
    kr, vr = np.repeat(k2, 3, axis=1), np.repeat(v2, 3, axis=1)
    o_ref, lse_ref = naive.forward(q, kr, vr, causal=True)
    np.testing.assert_array_equal(o, o_ref)
    dq, dk, dv = naive.backward(q, k2, v2, o, lse, do, causal=True)
    dq_r, dk_r, dv_r = naive.backward(q, kr, vr, o_ref, lse_ref, do, causal=True)
    np.testing.assert_array_equal(dq, dq_r)
    np.testing.assert_allclose(dk, dk_r.reshape(2, 2, 3, 11, 8).sum(2), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(dv, dv_r.reshape(2, 2, 3, 11, 8).sum(2), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- dropout's random numbers
def test_philox_known_answers():
    """Philox4x32-10 against the known-answer vectors of Random123 (kat_vectors): counter, key -> output."""
    cases = [((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, 2**64 - 1, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0xA4093822 | (0x299F31D0 << 32),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        assert tuple(int(x) for x in variants.philox4x32(*counter, key)) == want


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_at_the_right_rate_and_independently(p):
    """Over 1.2M draws the kept fraction is within 6 standard deviations of 1 - p; rows, columns and the 2 x 2
    pairs one Philox call draws keep at the same rate (no structure from the counter layout)."""
    B, H, N = 2, 3, 448
    z = variants.dropout_keep(B, H, N, N, p, seed=12345)
    n = z.size
    sd = np.sqrt(p * (1 - p) / n)
    assert abs(z.mean() - (1 - p)) < 6 * sd
    for part in (z[..., 0::2, :], z[..., :, 1::2], z[..., 8:16, 8:16], z[:, 1]):  # subsets of the draws
        assert abs(part.mean() - (1 - p)) < 6 * np.sqrt(p * (1 - p) / part.size)
    both = (z[..., :-1] & z[..., 1:]).mean()  # neighbours kept together as often as independence says
    assert abs(both - (1 - p) ** 2) < 6 * np.sqrt((1 - p) ** 2 * (1 - (1 - p) ** 2) / z[..., 1:].size)


def test_dropout_is_a_function_of_the_seed():
    q, k, v = make_inputs(1, 2, 20, 20, 8, dtype=np.float32)
    a = naive.forward(q, k, v, dropout_p=0.2, seed=11)[0]
    np.testing.assert_array_equal(a, naive.forward(q, k, v, dropout_p=0.2, seed=11)[0])  # bit for bit
    assert not np.array_equal(a, naive.forward(q, k, v, dropout_p=0.2, seed=12)[0])
    z = variants.dropout_keep(1, 2, 20, 20, 0.2, 11)
    np.testing.assert_array_equal(z[:, :, :5, :7], variants.dropout_keep(1, 2, 5, 7, 0.2, 11))  # position only


@pytest.mark.parametrize("causal", [False, True])
def test_a_block_at_its_origin_is_that_block_of_the_whole_problem(causal):
    """origin=(q0, k0, shift): the block of rows q0.., keys k0.. adds the whole problem's ALiBi bias and draws its
    dropout bits (what the ring's block calls rely on). Rows 20:52 x keys 33:70 of a 60 x 75 problem, with ALiBi and
    dropout: o and lse of the block equal the whole problem's restricted to those keys (the block's softmax)."""
    B, H, Nq, Nk = 1, 2, 60, 75
    q, k, v = make_inputs(B, H, Nq, Nk, 8, dtype=np.float64)
    opts = dict(alibi_slopes=np.array([0.3, 0.05]), dropout_p=0.3, seed=17)
    a, b, c, m = 20, 52, 33, 70
    o, lse = naive.forward(q[:, :, a:b], k[:, :, c:m], v[:, :, c:m], origin=(a, c, Nk - Nq), **opts)
    # the whole problem with every key outside c:m hidden: its rows a:b are the block's result
    s = naive.scores(q, k, 1 / np.sqrt(8), variants.check(q, k, causal=False, **opts), np)
    s[..., :c] = s[..., m:] = -np.inf
    s = s[:, :, a:b]
    want_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    z = variants.dropout_keep(B, H, Nq, Nk, 0.3, 17)[:, :, a:b]
    want_o = (np.exp(s - want_lse[..., None]) * z / 0.7) @ v
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-14)  # L near 0: its rounding is absolute
    np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-12)
    # the bias and bits straight from the definitions
    opts_b = variants.check(q[:, :, a:b], k[:, :, c:m], causal=causal, origin=(a, c, Nk - Nq), **opts)
    np.testing.assert_array_equal(variants.dropout_keep(B, H, b - a, m - c, 0.3, 17, variants.dropout_origin(opts_b)),
                                  variants.dropout_keep(B, H, Nq, Nk, 0.3, 17)[:, :, a:b, c:m])
    slopes = variants.slopes_bh(opts_b, B, H, np, np.float64)
    np.testing.assert_array_equal(variants.alibi_bias(slopes, b - a, m - c, shift=variants.alibi_shift(opts_b, b - a,
                                                                                                      m - c)),
                                  variants.alibi_bias(slopes, Nq, Nk)[:, :, a:b, c:m])


def test_alibi_geometric_slopes():
    """The ALiBi paper's slopes: 1/2 ... 1/256 for 8 heads; for 12 heads those of 8, then 2^-0.5, 2^-1.5, ... of 16."""
    np.testing.assert_array_equal(variants.alibi_geometric_slopes(8), 2.0 ** -np.arange(1, 9))
    want12 = np.concatenate([2.0 ** -np.arange(1, 9), 2.0 ** -(np.arange(1, 16, 2) / 2)[:4]])
    np.testing.assert_allclose(variants.alibi_geometric_slopes(12), want12, rtol=1e-7)
    assert variants.alibi_geometric_slopes(1).tolist() == [2.0 ** -8]


def test_origin_checks_and_the_kernels_grid():
    q, k, v = _qkv()
    for bad, match in (((1, 2), "origin must be"), ((-1, 0, 0), "must be >= 0"), ((0, 1.5, 0), "integer")):
        with pytest.raises((ValueError, TypeError), match=match):
            naive.forward(q, k, v, alibi_slopes=np.ones(q.shape[1]), origin=bad)
    at = variants.check(q, k, causal=False, dropout_p=0.1, origin=(16, 8, 0))
    with pytest.raises(ValueError, match=r"dropout at origin \(16, 8, 0\): .* multiples of 16"):
        variants.check_kernel_origin(at, "flash_v2.forward")
    variants.check_kernel_origin(at._replace(origin=(32, 16, 0)), "flash_v2.forward")  # on the grid: no error
    # an origin that changes nothing is dropped: the call is the whole problem, or has no ALiBi / dropout
    assert variants.check(q, k, causal=False, dropout_p=0.1, origin=(0, 0, 0)).origin is None
    assert variants.check(q, k, causal=False, softcap=3.0, origin=(16, 8, 0)).origin is None


# ---------------------------------------------------------------- the yardsticks against the oracle, with options
@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("x", [1.0, 100.0], ids=["x1", "x100"])
@pytest.mark.parametrize("name", ["gqa2-causal", "window", "softcap", "alibi", "dropout", "all"])
def test_yardstick_with_options_meets_the_rule(name, x, dtype):
    """Stage 00 in the inputs' dtype is every kernel's yardstick; with each option it must itself meet the rule it
    sets (it does by construction: a consistency check of the options' plumbing through tolerance.py)."""
    q, k, v, do, causal, opts = _inputs(OPTION_CASES[name], dtype=dtype, scale=x)
    check_forward(naive.forward, q, k, v, causal=causal, opts=opts)
    check_backward(naive.backward, q, k, v, do, causal=causal, opts=opts)


@pytest.mark.parametrize("mistake", ["window off by one", "softcap ignored", "alibi sign", "wrong kv head",
                                     "other dropout seed"])
def test_rule_catches_a_wrong_option(mistake):
    """The rule, with the options given to the oracle, fails a forward that applies an option wrongly."""
    q, k, v, _, causal, opts = _inputs(OPTION_CASES["all"], dtype=np.float32)

    def wrong(q, k, v, *, causal, scale, **o):
        o = dict(o)
        if mistake == "window off by one":
            o["window"] = (o["window"][0] + 1, o["window"][1])
        elif mistake == "softcap ignored":
            o.pop("softcap")
        elif mistake == "alibi sign":
            o["alibi_slopes"] = -o["alibi_slopes"]
        elif mistake == "wrong kv head":
            k, v = k[:, ::-1], v[:, ::-1]
        else:
            o["seed"] += 1
        return naive.forward(q, k, v, causal=causal, scale=scale, **o)

    with pytest.raises(AssertionError, match="exceeds the bound"):
        check_forward(wrong, q, k, v, causal=causal, opts=opts)


# ---------------------------------------------------------------- variable-length packed batches
def test_varlen_is_each_sequence_on_its_own():
    """Packed (total, H, D) with cu_seqlens: each sequence attends only to itself, exactly as a separate call."""
    H, Hkv, D = 4, 2, 8
    lq, lk = [3, 1, 7], [5, 2, 7]
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    q, _, _, do = make_inputs(1, H, cq[-1], ck[-1], D, dtype=np.float64, grad=True)
    _, k, v = make_inputs(1, Hkv, cq[-1], ck[-1], D, dtype=np.float64)
    packed = [x[0].transpose(1, 0, 2) for x in (q, k, v, do)]  # (total, H, D)
    opts = {"causal": True, "window": (3, -1), "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4])}
    o, lse = naive.forward_varlen(*packed[:3], cq, ck, **opts)
    grads = naive.backward_varlen(*packed[:3], o, lse, packed[3], cq, ck, **opts)
    assert o.shape == packed[0].shape and lse.shape == (H, cq[-1])
    for s in range(3):
        qs, ks, vs, dos = (x[:, :, a:b] for x, a, b in zip((q, k, v, do), (cq[s], ck[s], ck[s], cq[s]),
                                                        (cq[s + 1], ck[s + 1], ck[s + 1], cq[s + 1])))
        o_s, lse_s = naive.forward(qs, ks, vs, **opts)
        np.testing.assert_array_equal(o[cq[s]:cq[s + 1]], o_s[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[:, cq[s]:cq[s + 1]], lse_s[0])
        for g, g_s, (a, b) in zip(grads, naive.backward(qs, ks, vs, o_s, lse_s, dos, **opts),
                                  ((cq[s], cq[s + 1]), (ck[s], ck[s + 1]), (ck[s], ck[s + 1]))):
            np.testing.assert_array_equal(g[a:b], g_s[0].transpose(1, 0, 2))


# ---------------------------------------------------------------- bad input
def _qkv(H=4, Hkv=4):
    q = make_inputs(1, H, 5, 5, 8)[0]
    _, k, v = make_inputs(1, Hkv, 5, 5, 8)
    return q, k, v


@pytest.mark.parametrize("make,kw,match", [
    (lambda: _qkv(4, 3), {}, "does not divide"),
    (_qkv, {"window": (-2, 0)}, "-1 for unbounded"),
    (_qkv, {"window": (1, 2, 3)}, "pair"),
    (_qkv, {"window": (1.5, 0)}, "integer"),
    (_qkv, {"window": (3, 2), "causal": True}, "right = 0"),
    (_qkv, {"alibi_slopes": np.ones(3)}, "one slope per head"),
    (_qkv, {"softcap": 0.0}, "softcap must be"),
    (_qkv, {"softcap": -1.0}, "softcap must be"),
    (_qkv, {"dropout_p": 1.0}, r"\[0, 1\)"),
    (_qkv, {"dropout_p": -0.1}, r"\[0, 1\)"),
    (_qkv, {"dropout_p": 0.1, "seed": -1}, "seed must be"),
    (_qkv, {"dropout_p": 0.1, "seed": 1.5}, "integer"),
], ids=["hkv", "window<-1", "window-triple", "window-float", "causal-right", "slopes", "softcap0", "softcap<0",
        "p1", "p<0", "seed<0", "seed-float"])
def test_bad_options_raise_clear_errors(make, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        naive.forward(*make(), **kw)


@pytest.mark.parametrize("cq,ck,match", [
    ([0, 3, 2], [0, 3, 5], "non-decreasing"),
    ([1, 3, 5], [0, 3, 5], "start at 0"),
    ([0, 3, 6], [0, 3, 5], "rows"),
    ([0, 5], [0, 3, 5], "same number"),
    ([0, 3.5, 5], [0, 3, 5], "integers"),
], ids=["decreasing", "start", "overflow", "count", "float"])
def test_bad_cu_seqlens_raise_clear_errors(cq, ck, match):
    q = np.zeros((5, 2, 8), np.float32)
    with pytest.raises((ValueError, TypeError), match=match):
        naive.forward_varlen(q, q, q, np.array(cq), np.array(ck))
