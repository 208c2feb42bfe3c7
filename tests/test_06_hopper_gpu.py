"""Stage 06's building blocks on an sm_90 GPU (kernels/hopper_blocks.cu through stages/06_hopper/blocks.py), each
against the CPU arithmetic of layouts.py: the bytes the copy engine writes are layouts.store_tile's, and wgmma through
the descriptors of layouts.descriptor multiplies the tiles it was given. On another GPU the blocks refuse with an
error that names the stage 02/03 versions to use."""
import numpy as np
import pytest

from stages.common import bfloat16, device
from stages.hopper import layouts

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, bfloat16]


def _hopper():
    from stages.hopper import blocks

    try:
        blocks.require_hopper()
    except device.UnsupportedDevice as e:
        pytest.skip(f"not an sm_90 GPU: {e}")
    return blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(64, 64), (128, 192), (8, 64)])
def test_copy_engine_writes_the_128_byte_swizzle(rows, cols, dtype):
    import cupy

    blocks = _hopper()
    x = np.arange(rows * cols, dtype=np.uint16).reshape(rows, cols).view(dtype)  # every element its own bits
    got = blocks.tile_bytes(cupy.asarray(x))
    want = layouts.store_tile(np.ascontiguousarray(x[:, :64]).view(np.uint16))
    assert got.shape == want.shape and (got == want).all()


def test_a_tensor_map_is_encoded_once_per_address_shape_and_box():
    """A CUtensorMap depends on the address, sizes, strides and box alone, so blocks keeps the maps it encoded: the
    same array gives the driver's bytes again from the cache, another array or other rows of it a map of their own."""
    import cupy

    blocks = _hopper()
    x = cupy.zeros((1, 2, 256, 64), bfloat16)

    def encoded(x, **kw):  # what a launcher's MappedLaunch writes into its parameter struct for x
        return blocks.heads_map(x.shape, x.dtype, **kw).encode(x)

    blocks._encode.cache_clear()
    first, again = encoded(x), encoded(x)
    info = blocks._encode.cache_info()
    assert (info.misses, info.hits) == (1, 1) and first == again and len(first) == 128
    assert encoded(cupy.zeros_like(x)) != first  # another address
    assert encoded(x, rows=(64, 256)) != first  # another start and size
    assert encoded(x, box_rows=128) != first  # another box
    blocks._encode.cache_clear()
    assert encoded(x) == first  # what the cache gave is what the driver encodes
    with pytest.raises(ValueError, match="C-contiguous"):
        blocks.heads_map((1, 2, 128, 64), x.dtype).encode(x[:, :, ::2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_wgmma_computes_q_k_transposed(D, dtype):
    """Small integers: every product and partial sum is exact in float32, so S must equal q k^T exactly; then
    random values, within float32 rounding of the exact product."""
    import cupy

    blocks = _hopper()
    rng = np.random.default_rng(D)
    q = rng.integers(-4, 5, (64, D)).astype(dtype)
    k = rng.integers(-4, 5, (64, D)).astype(dtype)
    s = cupy.asnumpy(blocks.qk_scores(cupy.asarray(q), cupy.asarray(k)))
    assert (s == q.astype(np.float64) @ k.astype(np.float64).T).all()
    q = rng.standard_normal((64, D)).astype(dtype)
    k = rng.standard_normal((64, D)).astype(dtype)
    s = cupy.asnumpy(blocks.qk_scores(cupy.asarray(q), cupy.asarray(k)))
    exact = q.astype(np.float64) @ k.astype(np.float64).T
    bound = D * 2.0 ** -23 * (np.abs(q.astype(np.float64)) @ np.abs(k.astype(np.float64)).T)  # D roundings of fp32
    assert (np.abs(s - exact) <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
def test_wgmma_computes_p_v_from_registers(D, dtype):
    import cupy

    blocks = _hopper()
    rng = np.random.default_rng(D + 1)
    p = rng.integers(-4, 5, (64, 64)).astype(dtype)
    v = rng.integers(-4, 5, (64, D)).astype(dtype)
    o = cupy.asnumpy(blocks.pv_product(cupy.asarray(p), cupy.asarray(v)))
    assert (o == p.astype(np.float64) @ v.astype(np.float64)).all()


def test_blocks_refuse_other_gpus(monkeypatch):
    """Under ATTN_ARCH=sm_80 (an emulated older GPU) the blocks say what to use instead."""
    import cupy

    from stages.hopper import blocks

    monkeypatch.setenv("ATTN_ARCH", "sm_80")
    with pytest.raises(device.UnsupportedDevice, match="stage 02 version 'pipelined'"):
        blocks.qk_scores(cupy.zeros((64, 64), cupy.float16), cupy.zeros((64, 64), cupy.float16))


# ---------------------------------------------------------------- version 1: the forward with TMA and wgmma
SHAPES = [  # (B, H, Nq, Nk): whole tiles, tails of both, Nq != Nk both ways, one row, one key, enough K/V tiles
    # that every stage's barriers go round several phases, and last K/V tiles of 64 keys or fewer, which version
    # pingpong computes 64 keys wide (128-key tiles: Nk = 130, 1, 192; under the causal mask also rows 128 .. 191
    # of Nq = Nk = 192, whose diagonal ends 64 keys into their second tile, and the first 64 rows of each 128-row
    # tile where Nq = Nk, whose diagonal ends 64 keys before the next 64 rows'; at (100, 130) the last tile holds no
    # key for the first 64 rows)
    (1, 2, 128, 128), (2, 3, 100, 130), (1, 2, 200, 77), (1, 1, 1, 65), (1, 1, 65, 1), (2, 2, 333, 333),
    (1, 2, 260, 1100), (1, 2, 192, 192),
]


@pytest.mark.parametrize("version", ["wgmma", "ws", "pingpong"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_within_the_tolerance_rule(shape, causal, D, dtype, version):
    import cupy

    from stages.common import check_forward, make_inputs
    from stages.hopper import flash_v3

    _hopper()
    q, k, v = make_inputs(*shape, D, dtype=dtype, xp=cupy)
    check_forward(flash_v3.forward, q, k, v, causal=causal, version=version)


@pytest.mark.parametrize("version", ["wgmma", "ws", "pingpong"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(3, 50, 200, 333), (3, 50, 333, 100)])
def test_forward_with_more_blocks_than_sms(shape, causal, D, version):
    """150 heads: more blocks than an H100 has SMs, so blocks start as others finish; with Nq > Nk under the causal
    mask some Q tiles see no key at all."""
    import cupy

    from stages.common import check_forward, make_inputs
    from stages.hopper import flash_v3

    _hopper()
    q, k, v = make_inputs(*shape, D, dtype=bfloat16, xp=cupy)
    check_forward(flash_v3.forward, q, k, v, causal=causal, version=version)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("shape", [(3, 50, 200, 333), (1, 1, 1, 65), (2, 3, 1000, 130), (1, 2, 4100, 300),
                                   (1, 3, 300, 4200)])
def test_forward_persistent_grid_computes_what_a_block_per_item_computes(shape, D):
    """Version pingpong without a mask: a persistent grid (a block per SM striding over the (Q tile, head) items,
    carrying its barriers' phases from item to item) writes the same bits as a block per item, with more items than
    SMs (300), fewer (1, 48, 6) and the last Q tile of each head short, both with K/V tiles of 128 keys; and it meets
    the tolerance rule. The launcher picks the grid persistent_rule names and the tiles wide_rule names (Nk = 4200:
    one block per item, at D = 128 with tiles of WIDE_BC keys)."""
    import cupy

    from stages.common import check_forward, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3

    _hopper()
    q, k, v = make_inputs(*shape, D, dtype=bfloat16, xp=cupy)
    B, H, Nq, Nk = shape
    plans, outs = {}, {}
    for persistent in (True, False, None):  # None: the launcher's choice
        plans[persistent] = flash_v3._plan("pingpong", np.dtype(q.dtype), q.shape, Nk, (0, Nq), (0, Nk), False,
                                           resolve_scale(None, D), merge=False, persistent=persistent,
                                           wide=None if persistent is None else False)
    for persistent in (True, False):
        items = -(-Nq // 128) * B * H
        grid = (min(items, device.device().sm_count), 1) if persistent else (-(-Nq // 128), B * H)
        assert plans[persistent].launch.grid[:2] == grid
        o, lse = cupy.empty_like(q), cupy.empty((B, H, Nq), cupy.float32)
        plans[persistent](q, k, v, o, lse)
        outs[persistent] = (o, lse)
    by_rule = flash_v3.persistent_rule("pingpong", False, Nk)
    chosen = plans[by_rule].launch
    assert plans[None].launch.grid == chosen.grid
    wide = flash_v3.wide_rule("pingpong", D, False, by_rule)
    assert (plans[None].launch.fn is chosen.fn) == (not wide)
    assert plans[None].launch.smem == flash_v3.smem_bytes("pingpong", D, wide)
    for a, b, bits in zip(outs[True], outs[False], (cupy.uint16, cupy.uint32)):
        assert bool((a.view(bits) == b.view(bits)).all())
    check_forward(lambda q, k, v, **kw: outs[True], q, k, v, causal=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 50, 200, 333), (1, 1, 1, 65), (1, 2, 300, 2049), (2, 3, 1000, 4200),
                                   (1, 1, 130, 192), (1, 4, 2000, 2500), (1, 2, 300, 4096), (2, 2, 257, 320),
                                   (1, 3, 129, 40)])
def test_forward_with_wide_key_tiles_within_the_tolerance_rule(shape, dtype):
    """Version pingpong at D = 128 on a block per item with K/V tiles of WIDE_BC keys, forced at any Nk: more blocks
    than SMs, a single key, Nk one past a tile, Nk a whole tile, Nq != Nk; forward() takes them past
    PERSISTENT_MAX_KEYS keys (Nk = 2049, 4200, 2500, 4096), where it must meet the tolerance rule too. The last tile
    at each of its widths: 192 keys wide (Nk = 333, 2049, 4200, 192), 128 (65 keys: one tile; 320: two) and 64
    (2500, 4096: 4 and 64 keys after whole tiles; 40: one tile)."""
    import cupy

    from stages.common import check_forward, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3

    _hopper()
    q, k, v = make_inputs(*shape, 128, dtype=dtype, xp=cupy)
    B, H, Nq, Nk = shape
    plan = flash_v3._plan("pingpong", np.dtype(q.dtype), q.shape, Nk, (0, Nq), (0, Nk), False,
                          resolve_scale(None, 128), merge=False, persistent=False, wide=True)
    assert plan.launch.smem == flash_v3.smem_bytes("pingpong", 128, wide=True)
    o, lse = cupy.empty_like(q), cupy.empty((B, H, Nq), cupy.float32)
    plan(q, k, v, o, lse)
    check_forward(lambda q, k, v, **kw: (o, lse), q, k, v, causal=False)
    if Nk > flash_v3.PERSISTENT_MAX_KEYS:
        check_forward(flash_v3.forward, q, k, v, causal=False)


@pytest.mark.parametrize("version", ["wgmma", "ws", "pingpong"])
def test_forward_at_large_logits_and_a_row_that_sees_nothing(version):
    import cupy

    from stages.common import check_forward, make_inputs
    from stages.hopper import flash_v3

    _hopper()
    q, k, v = make_inputs(1, 2, 130, 70, 128, dtype=bfloat16, xp=cupy, scale=10.0)
    check_forward(flash_v3.forward, q, k, v, causal=True, version=version)  # the first 60 rows see no key
    o, lse = flash_v3.forward(q, k, v, causal=True, version=version)
    assert bool(cupy.isneginf(lse[:, :, :60]).all()) and not bool(o[:, :, :60].any())


@pytest.mark.parametrize("scale", [1.0, 100.0])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES + [(3, 50, 200, 333), (3, 50, 333, 100)])
def test_forward_fp32x3_within_the_tolerance_rule(shape, causal, D, scale):
    """Float32 (version fp32x3, the default for float32) by the float32 rule, at inputs x1 and x100 (huge logits,
    one-hot rows of P: V's rows exactly); 150 heads give more blocks than SMs, and Nq > Nk under the causal mask some
    Q tiles that see no key."""
    import cupy

    from stages.common import check_forward, make_inputs
    from stages.hopper import flash_v3

    _hopper()
    q, k, v = make_inputs(*shape, D, dtype=np.float32, xp=cupy, scale=scale)
    check_forward(flash_v3.forward, q, k, v, causal=causal)


def test_forward_fp32x3_rows_that_see_nothing():
    import cupy

    from stages.common import check_forward, make_inputs
    from stages.hopper import flash_v3

    _hopper()
    q, k, v = make_inputs(1, 2, 130, 70, 128, dtype=np.float32, xp=cupy, scale=10.0)
    check_forward(flash_v3.forward, q, k, v, causal=True, version="fp32x3")  # the first 60 rows see no key
    o, lse = flash_v3.forward(q, k, v, causal=True)
    assert bool(cupy.isneginf(lse[:, :, :60]).all()) and not bool(o[:, :, :60].any())


def test_forward_refuses_what_it_does_not_take():
    import cupy

    from stages.common import make_inputs
    from stages.hopper import flash_v3

    _hopper()
    q, k, v = make_inputs(1, 1, 64, 64, 96, dtype=np.float16, xp=cupy)
    with pytest.raises(ValueError, match="head dim 96"):
        flash_v3.forward(q, k, v)
    q, k, v = make_inputs(1, 1, 64, 64, 64, dtype=np.float32, xp=cupy)
    with pytest.raises(TypeError, match="version 'ws' takes float16 or bfloat16, got float32.*'fp32x3'"):
        flash_v3.forward(q, k, v, version="ws")
    with pytest.raises(ValueError, match=r"head dim 256 is not supported in float32; use one of \(64, 128\)"):
        flash_v3.forward(*make_inputs(1, 1, 64, 64, 256, dtype=np.float32, xp=cupy))
    with pytest.raises(TypeError, match="version 'fp32x3' takes float32, got float16"):
        flash_v3.forward(*make_inputs(1, 1, 64, 64, 64, dtype=np.float16, xp=cupy), version="fp32x3")
    q, k, v = make_inputs(1, 1, 64, 64, 64, dtype=np.float16, xp=cupy)
    with pytest.raises(TypeError, match="causal"):
        flash_v3.forward(q, k, v, causal="no")
    with pytest.raises(ValueError, match="version 'fast'"):
        flash_v3.forward(q, k, v, version="fast")


# ---------------------------------------------------------------- version fp8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES + [(2, 3, 1000, 1000), (1, 2, 2049, 4100)])
def test_forward_fp8_within_the_tolerance_rule(shape, causal, dtype):
    import cupy

    from stages.common import make_inputs
    from stages.hopper import fp8

    _hopper()
    q, k, v = make_inputs(*shape, 128, dtype=dtype, xp=cupy)
    fp8.check(q, k, v, causal=causal)


def test_forward_fp8_is_not_the_16_bit_forward():
    """The rule is not loose for this version: its error is e4m3's, above the 16-bit kernel's, and V's keys met in
    another order inside each 16 (the lanes' P values multiplying the wrong rows of V, as a pre-pass without
    layouts.fp8_key_order would make them) are out of bounds."""
    import cupy

    from stages.common import make_inputs, tolerance
    from stages.hopper import flash_v3, fp8, layouts

    _hopper()
    q, k, v = make_inputs(1, 2, 300, 320, 128, dtype=bfloat16, xp=cupy)
    errs = fp8.check(q, k, v)
    o16, _ = flash_v3.forward(q, k, v)
    ref = tolerance.oracle(*(cupy.asnumpy(x) for x in (q, k, v)))[0]
    assert errs["o"][0] > 4 * tolerance.max_error(cupy.asnumpy(o16), ref)
    order = (16 * (np.arange(320) // 16) + layouts.fp8_key_order(np.arange(320) % 16)).tolist()
    o_wrong, _ = flash_v3.forward(q, k, v[:, :, order].copy(), version="fp8")
    with pytest.raises(AssertionError, match="out of bounds"):
        fp8.check(q, k, v, o=o_wrong)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_forward_fp8_nan_in_a_head_is_nan_out_of_it(which):
    """A NaN anywhere in a head of q, k or v makes that head's factor NaN (the pre-pass's maximum keeps NaN), so
    every o of the head is NaN; the other heads are computed as without it."""
    import cupy

    from stages.common import make_inputs
    from stages.hopper import flash_v3

    _hopper()
    x = list(make_inputs(1, 2, 100, 90, 128, dtype=np.float16, xp=cupy))
    o_clean, _ = flash_v3.forward(*x, version="fp8")
    x[which] = x[which].copy()
    x[which][0, 0, 7, 11] = np.nan
    o, _ = flash_v3.forward(*x, version="fp8")
    assert bool(cupy.isnan(o[0, 0]).all()) and bool((o[0, 1] == o_clean[0, 1]).all())


def test_forward_fp8_refuses_what_it_does_not_take():
    import cupy

    from stages.common import make_inputs
    from stages.hopper import flash_v3

    _hopper()
    with pytest.raises(ValueError, match=r"head dim 64 is not supported in version fp8; use one of \(128,\)"):
        flash_v3.forward(*make_inputs(1, 1, 64, 64, 64, dtype=np.float16, xp=cupy), version="fp8")
    with pytest.raises(TypeError, match="version 'fp8' takes float16 or bfloat16, got float32"):
        flash_v3.forward(*make_inputs(1, 1, 64, 64, 128, dtype=np.float32, xp=cupy), version="fp8")


# ---------------------------------------------------------------- the backward
BACKWARD = [(v, D) for v in ("wgmma", "ws") for D in (64, 128, 256) if v == "wgmma" or D <= 128]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("version,D", BACKWARD)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_within_the_tolerance_rule(shape, causal, version, D, dtype):
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.hopper import flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(*shape, D, dtype=dtype, xp=cupy, grad=True)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, version=version)


@pytest.mark.parametrize("version,D", BACKWARD)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(3, 50, 150, 200), (3, 50, 200, 70)])
def test_backward_with_more_blocks_than_sms(shape, causal, version, D):
    """150 heads: blocks start as others finish, and their dQ reductions meet in the same rows; with Nq > Nk under
    the causal mask some rows see no key (their dq is 0) and with Nk > Nq some K/V tiles see no row (dk = dv = 0)."""
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.hopper import flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(*shape, D, dtype=bfloat16, xp=cupy, grad=True)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, version=version)


@pytest.mark.parametrize("fuse_dq", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(3, 50, 150, 200), (1, 3, 700, 333)])
def test_backward_ws_converts_dq_in_its_last_block_per_head_or_in_a_launch_of_its_own(shape, causal, D, fuse_dq):
    """Both ways of version ws, whatever fuse_dq_rule picks for the shape: the last block of each head to finish
    converts the head's accumulator only after every block's bulk reductions into it are complete and visible (150
    heads: blocks of many heads finish in every order), or bwd_convert_dq does it after the grid."""
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3_backward as fb

    _hopper()
    q, k, v, do = make_inputs(*shape, D, dtype=bfloat16, xp=cupy, grad=True)

    def backward(q, k, v, o, lse, do, *, causal, scale):
        plan = fb._plan("ws", np.dtype(q.dtype), q.shape, k.shape[2], causal, resolve_scale(scale, D), fuse_dq=fuse_dq)
        assert (plan.convert is None) == fuse_dq
        return plan(q, k, v, o, lse, do)

    check_backward(backward, q, k, v, do, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("version,D", BACKWARD)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_at_inputs_times_100(causal, version, D, dtype):
    """Logits in the thousands: P = exp(scale S - L) must be one rounding of a number near 0, not the difference of
    two large rounded numbers."""
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.hopper import flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(1, 2, 128, 128, D, dtype=dtype, xp=cupy, scale=100.0, grad=True)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, version=version)


@pytest.mark.parametrize("version", ["wgmma", "ws"])
def test_backward_at_large_logits_and_rows_that_see_nothing(version):
    import cupy

    from stages.common import check_backward, make_inputs
    from stages.hopper import flash_v3, flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(1, 2, 130, 70, 128, dtype=bfloat16, xp=cupy, scale=10.0, grad=True)
    check_backward(flash_v3_backward.backward, q, k, v, do, causal=True, version=version)  # rows 0..59 see no key
    o, lse = flash_v3.forward(q, k, v, causal=True)
    dq, dk, dv = flash_v3_backward.backward(q, k, v, o, lse, do, causal=True, version=version)
    assert not bool(dq[:, :, :60].any()) and all(bool(cupy.isfinite(x.astype(cupy.float32)).all())
                                                 for x in (dq, dk, dv))


def test_backward_refuses_what_it_does_not_take():
    import cupy

    from stages.common import make_inputs
    from stages.hopper import flash_v3_backward

    _hopper()
    q, k, v = make_inputs(1, 1, 64, 64, 96, dtype=np.float16, xp=cupy)
    lse = cupy.zeros((1, 1, 64), cupy.float32)
    with pytest.raises(ValueError, match="head_dim 96"):
        flash_v3_backward.backward(q, k, v, q, lse, q)
    q, k, v = make_inputs(1, 1, 64, 64, 64, dtype=np.float32, xp=cupy)
    with pytest.raises(TypeError, match="float16"):
        flash_v3_backward.backward(q, k, v, q, lse, q)
    q, k, v = make_inputs(1, 1, 64, 64, 64, dtype=np.float16, xp=cupy)
    with pytest.raises(TypeError, match="causal"):
        flash_v3_backward.backward(q, k, v, q, lse, q, causal="no")
    with pytest.raises(ValueError, match="version 'fast'"):
        flash_v3_backward.backward(q, k, v, q, lse, q, version="fast")
    q, k, v = make_inputs(1, 1, 64, 64, 256, dtype=np.float16, xp=cupy)
    with pytest.raises(ValueError, match="version 'wgmma' takes"):
        flash_v3_backward.backward(q, k, v, q, lse, q, version="ws")
    with pytest.raises(TypeError, match="CuPy arrays"):
        flash_v3_backward.backward(*(cupy.asnumpy(x) for x in (q, k, v, q, lse, q)))
    with pytest.raises(ValueError, match="lse has shape"):
        flash_v3_backward.backward(q, k, v, q, lse[:, :, :3], q)


@pytest.mark.parametrize("dtype", [bfloat16, np.float32], ids=["bf16", "fp32"])
def test_a_repeated_call_is_checked_and_planned_like_the_first(dtype):
    """forward and backward keep each checked call's plan under fast_path.call_key, its tensor maps described once
    and encoded for each call's arrays. A repeat on the same arrays gives the same o, lse (and dK, dV) bit for bit
    and its outputs from one allocation; new arrays of the same shapes (new addresses: new maps), a strided view (a
    copy, then a map of the copy) and other options are right by the rule; bad input is refused after a good call."""
    import cupy

    from stages.common import check_backward, check_forward, fast_path, make_inputs, to_numpy
    from stages.hopper import flash_v3, flash_v3_backward

    _hopper()
    q, k, v, do = make_inputs(1, 2, 200, 150, 64, dtype=dtype, xp=cupy, grad=True)
    o1, lse1 = flash_v3.forward(q, k, v)
    assert flash_v3.forward.plans.get(fast_path.call_key((q, k, v), {})) is not None
    o2, lse2 = flash_v3.forward(q, k, v)
    np.testing.assert_array_equal(to_numpy(o2).view(np.uint8), to_numpy(o1).view(np.uint8))
    np.testing.assert_array_equal(to_numpy(lse2), to_numpy(lse1))
    assert o2.data.mem.ptr == lse2.data.mem.ptr  # the kept plan carves o and lse from one allocation
    for causal, scale in ((True, None), (False, 0.05), (True, 0.3)):
        for _ in range(2):  # the first call plans, the second goes straight to the kept plan
            check_forward(flash_v3.forward, q, k, v, causal=causal, scale=scale)
    q2, k2, v2, do2 = make_inputs(1, 2, 200, 150, 64, dtype=dtype, xp=cupy, grad=True, scale=10.0)
    check_forward(flash_v3.forward, q2, k2, v2)
    wide = make_inputs(1, 2, 400, 150, 64, dtype=dtype, xp=cupy)[0]
    check_forward(flash_v3.forward, wide[:, :, ::2], k2, v2)  # a strided view, the shape (and key) of q
    with pytest.raises(TypeError, match="CuPy array"):
        flash_v3.forward(q, cupy.asnumpy(k), v)
    with pytest.raises(TypeError, match="causal"):
        flash_v3.forward(q, k, v, causal="no")
    if dtype == np.float32:  # the backward takes 16-bit inputs only
        return
    first = flash_v3_backward.backward(q, k, v, o1, lse1, do)
    assert flash_v3_backward.backward.plans.get(fast_path.call_key((q, k, v, o1, lse1, do), {})) is not None
    again = flash_v3_backward.backward(q, k, v, o1, lse1, do)
    for a, b in zip(first[1:], again[1:]):  # dK, dV: each block owns its keys (dQ: reductions in any order)
        np.testing.assert_array_equal(to_numpy(a).view(np.uint8), to_numpy(b).view(np.uint8))
    assert len({x.data.mem.ptr for x in again}) == 1  # dq, dk, dv from one allocation
    for causal, scale in ((True, None), (False, 0.05), (True, 0.3)):
        for _ in range(2):
            check_backward(flash_v3_backward.backward, q, k, v, do, causal=causal, scale=scale)
    check_backward(flash_v3_backward.backward, q2, k2, v2, do2)
    check_backward(flash_v3_backward.backward, wide[:, :, ::2], k2, v2, do2)
    with pytest.raises(TypeError, match="CuPy arrays"):
        flash_v3_backward.backward(q, k, v, o1, lse1, cupy.asnumpy(do))
    with pytest.raises(TypeError, match="causal"):
        flash_v3_backward.backward(q, k, v, o1, lse1, do, causal="no")


# ---------------------------------------------------------------- stage 06 inside the ring (stage 04) and the GPT (05)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_merge_into_the_running_o_and_lse_of_some_rows(D, dtype, causal):
    """A ring block: rows 40..289 of q against keys 0..149 and then 150..332 (causal: keys 150..332 alone, the mask
    aligned bottom-right inside the block), each merged in the kernel's epilogue into the running float32 O, L of
    those rows; the rows outside stay as they were."""
    import cupy

    from stages.common import cast, check_forward, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3

    _hopper()
    B, H, Lq, Lk = 2, 3, 300, 333
    q, k, v = make_inputs(B, H, Lq, Lk, D, dtype=dtype, xp=cupy)
    rows, blocks_of_keys = (40, 290), ([(150, Lk)] if causal else [(0, 150), (150, Lk)])
    k0 = blocks_of_keys[0][0]
    outside = {}

    def merged(q_rows, k_seen, v_seen, *, causal, scale):
        o_run = cupy.zeros((B, H, Lq, D), cupy.float32)
        lse_run = cupy.full((B, H, Lq), -np.inf, cupy.float32)
        for keys in blocks_of_keys:
            flash_v3.merge_into(q, k, v, o_run, lse_run, rows, keys, causal=causal, scale=resolve_scale(scale, D))
        outside["o"] = bool((o_run[:, :, :rows[0]] == 0).all() and (o_run[:, :, rows[1]:] == 0).all())
        outside["lse"] = bool(cupy.isneginf(lse_run[:, :, :rows[0]]).all()
                              and cupy.isneginf(lse_run[:, :, rows[1]:]).all())
        return cast(o_run[:, :, rows[0]:rows[1]], dtype), lse_run[:, :, rows[0]:rows[1]]

    check_forward(merged, q[:, :, rows[0]:rows[1]], k[:, :, k0:], v[:, :, k0:], causal=causal)
    assert outside == {"o": True, "lse": True}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_accumulate_into_the_ring_gradients_of_some_rows_and_keys(D, dtype, causal):
    """A ring block of the backward: rows 40..289 of q, o, lse, do against keys 0..149 and then 150..332 (causal: keys
    150..332 alone, the mask aligned bottom-right inside the block), added by the kernel into the ring's float32
    dQ (rows 40..289) and dK, dV (those keys); rows and keys outside stay 0."""
    import cupy

    from stages.common import cast, check_backward, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3_backward

    _hopper()
    B, H, Lq, Lk = 2, 3, 300, 333
    q, k, v, do = make_inputs(B, H, Lq, Lk, D, dtype=dtype, xp=cupy, grad=True)
    (a, b), blocks_of_keys = (40, 290), ([(150, Lk)] if causal else [(0, 150), (150, Lk)])
    k0 = blocks_of_keys[0][0]
    outside = {}

    def accumulated(q_rows, k_seen, v_seen, o_rows, lse_rows, do_rows, *, causal, scale):
        o, lse = cupy.zeros_like(q), cupy.zeros((B, H, Lq), cupy.float32)
        o[:, :, a:b], lse[:, :, a:b] = o_rows, lse_rows
        runs = [cupy.zeros((B, H, n, D), cupy.float32) for n in (Lq, Lk, Lk)]
        for keys in blocks_of_keys:
            flash_v3_backward.accumulate_into(q, k, v, o, lse, do, *runs, (a, b), keys, causal=causal,
                                              scale=resolve_scale(scale, D))
        dq, dk, dv = runs
        outside["dq"] = not bool(dq[:, :, :a].any() or dq[:, :, b:].any())
        outside["dk, dv"] = not bool(dk[:, :, :k0].any() or dv[:, :, :k0].any())
        return cast(dq[:, :, a:b], dtype), cast(dk[:, :, k0:], dtype), cast(dv[:, :, k0:], dtype)

    check_backward(accumulated, q[:, :, a:b], k[:, :, k0:], v[:, :, k0:], do[:, :, a:b], causal=causal)
    assert outside == {"dq": True, "dk, dv": True}


def _spy(monkeypatch, module, name):
    """Replace module.name by a wrapper that records each call in the returned list, then calls the original."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


def _spy_registered(monkeypatch, name):
    """_spy for the ring: it calls stage 06 through the kernels stage 06 registered (stages/common/attention_registry),
    so the spy wraps the registered function."""
    from stages.common import attention_registry
    from stages.hopper import flash_v3

    kernels = next(k for k in attention_registry.registered() if k.forward is flash_v3.forward)
    calls, real = [], getattr(kernels, name)
    spied = kernels._replace(**{name: lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]})
    monkeypatch.setitem(attention_registry._REGISTERED, kernels.name, spied)
    return calls


def test_ring_and_gpt_take_stage_06_on_hopper(monkeypatch):
    """On an sm_90 GPU the ring's blocks at the default versions are stage 06's merge_into and accumulate_into (stage
    02 version tc when named; a ring of one rank: stage 06's backward), and the GPT's flash_v2 attention in bfloat16
    runs stage 06's forward and backward."""
    import cupy

    from stages import ring
    from stages.common import check_backward, check_forward, make_inputs
    from stages.hopper import flash_v3, flash_v3_backward
    from stages.train_gpt import attention

    _hopper()
    calls = _spy_registered(monkeypatch, "merge_into")
    q, k, v = make_inputs(1, 2, 512, 512, 128, dtype=bfloat16, xp=cupy)
    check_forward(ring.forward, q, k, v, causal=True, layout="zigzag", ranks=4, block="flash")
    assert calls, "the ring's forward blocks did not go through stage 06"
    calls.clear()
    check_forward(ring.forward, q, k, v, causal=True, layout="zigzag", ranks=4, block="flash", version="tc")
    assert not calls, "version 'tc' named: the ring must keep stage 02"
    bwd_calls = _spy_registered(monkeypatch, "accumulate_into")
    q, k, v, do = make_inputs(1, 2, 512, 512, 128, dtype=bfloat16, xp=cupy, grad=True)
    check_backward(ring.backward, q, k, v, do, causal=True, layout="zigzag", ranks=4, block="flash")
    assert bwd_calls, "the ring's backward blocks did not go through stage 06"
    whole = _spy_registered(monkeypatch, "backward")  # a ring of one rank: stage 06's backward itself
    for causal in (False, True):
        whole.clear()
        check_backward(ring.backward, q, k, v, do, causal=causal, layout="contiguous", ranks=1, block="flash")
        assert whole, f"a ring of one rank (causal={causal}) did not run stage 06's backward"
    assert attention.StageAttention("flash_v2", 64, bfloat16).fwd is flash_v3.forward
    assert attention.StageAttention("flash_v2", 64, bfloat16).bwd is flash_v3_backward.backward
    assert attention.StageAttention("flash_v2", 64, np.float32).fwd is not flash_v3.forward
    assert attention.StageAttention("flash_v2", 64, np.float32).bwd is not flash_v3_backward.backward
