"""Stage 06 on an sm_90 GPU, the forward: the probes of the data paths (kernels/hopper_probes.cu through
stages/06_hopper/probes.py), each against the CPU arithmetic of swizzle.py (the bytes the copy engine writes are
swizzle.store_tile's, and wgmma through the descriptors of swizzle.descriptor multiplies the tiles it was given); then
every version of the forward by the tolerance rule. On another GPU stage 06 refuses with an error that names the
stage 02/03 versions to use. The backward, the repeated calls and the ring's blocks: test_06_hopper_gpu_backward.py."""
import numpy as np
import pytest

from stages.common import bfloat16, device
from stages.hopper import swizzle

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, bfloat16]


def _hopper():
    from stages.hopper import probes, sm90a

    try:
        sm90a.require_hopper()
    except device.UnsupportedDevice as e:
        pytest.skip(f"not an sm_90 GPU: {e}")
    return probes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(64, 64), (128, 192), (8, 64)])
def test_copy_engine_writes_the_128_byte_swizzle(rows, cols, dtype):
    import cupy

    probes = _hopper()
    x = np.arange(rows * cols, dtype=np.uint16).reshape(rows, cols).view(dtype)  # every element its own bits
    got = probes.tile_bytes(cupy.asarray(x))
    want = swizzle.store_tile(np.ascontiguousarray(x[:, :64]).view(np.uint16))
    assert got.shape == want.shape and (got == want).all()


def test_a_tensor_map_is_encoded_once_per_address_shape_and_box():
    """A CUtensorMap depends on the address, sizes, strides and box alone, so tensor_maps keeps the maps it encoded:
    the same array gives the driver's bytes again from the cache, another array or other rows of it a map of their
    own."""
    import cupy

    from stages.hopper import tensor_maps

    _hopper()
    x = cupy.zeros((1, 2, 256, 64), bfloat16)

    def encoded(x, **kw):  # what a launcher's MappedLaunch writes into its parameter struct for x
        return tensor_maps.heads_map(x.shape, x.dtype, **kw).encode(x)

    tensor_maps._encode.cache_clear()
    first, again = encoded(x), encoded(x)
    info = tensor_maps._encode.cache_info()
    assert (info.misses, info.hits) == (1, 1) and first == again and len(first) == 128
    assert encoded(cupy.zeros_like(x)) != first  # another address
    assert encoded(x, rows=(64, 256)) != first  # another start and size
    assert encoded(x, box_rows=128) != first  # another box
    tensor_maps._encode.cache_clear()
    assert encoded(x) == first  # what the cache gave is what the driver encodes
    with pytest.raises(ValueError, match="C-contiguous"):
        tensor_maps.heads_map((1, 2, 128, 64), x.dtype).encode(x[:, :, ::2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_wgmma_computes_q_k_transposed(D, dtype):
    """Small integers: every product and partial sum is exact in float32, so S must equal q k^T exactly; then
    random values, within float32 rounding of the exact product."""
    import cupy

    probes = _hopper()
    rng = np.random.default_rng(D)
    q = rng.integers(-4, 5, (64, D)).astype(dtype)
    k = rng.integers(-4, 5, (64, D)).astype(dtype)
    s = cupy.asnumpy(probes.qk_scores(cupy.asarray(q), cupy.asarray(k)))
    assert (s == q.astype(np.float64) @ k.astype(np.float64).T).all()
    q = rng.standard_normal((64, D)).astype(dtype)
    k = rng.standard_normal((64, D)).astype(dtype)
    s = cupy.asnumpy(probes.qk_scores(cupy.asarray(q), cupy.asarray(k)))
    exact = q.astype(np.float64) @ k.astype(np.float64).T
    bound = D * 2.0 ** -23 * (np.abs(q.astype(np.float64)) @ np.abs(k.astype(np.float64)).T)  # D roundings of fp32
    assert (np.abs(s - exact) <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
def test_wgmma_computes_p_v_from_registers(D, dtype):
    import cupy

    probes = _hopper()
    rng = np.random.default_rng(D + 1)
    p = rng.integers(-4, 5, (64, 64)).astype(dtype)
    v = rng.integers(-4, 5, (64, D)).astype(dtype)
    o = cupy.asnumpy(probes.pv_product(cupy.asarray(p), cupy.asarray(v)))
    assert (o == p.astype(np.float64) @ v.astype(np.float64)).all()


def test_stage_06_refuses_other_gpus(monkeypatch):
    """Under ATTN_ARCH=sm_80 (an emulated older GPU) the probes, the forward and the backward say what to use
    instead."""
    import cupy

    from stages.hopper import flash_v3, flash_v3_backward, probes

    _hopper()
    monkeypatch.setenv("ATTN_ARCH", "sm_80")
    q, lse = cupy.zeros((1, 1, 64, 64), cupy.float16), cupy.zeros((1, 1, 64), cupy.float32)
    with pytest.raises(device.UnsupportedDevice, match="stage 02 version 'pipelined'"):
        flash_v3.forward(q, q, q)
    with pytest.raises(device.UnsupportedDevice, match="stage 03 version 'tc'"):
        flash_v3_backward.backward(q, q, q, q, lse, q)
    with pytest.raises(device.UnsupportedDevice, match="stage 02 version 'pipelined'"):
        probes.qk_scores(cupy.zeros((64, 64), cupy.float16), cupy.zeros((64, 64), cupy.float16))


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
        plans[persistent] = flash_v3.launch_rows("pingpong", np.dtype(q.dtype), q.shape, Nk, (0, Nq), (0, Nk), False,
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
    assert plans[None].launch.smem == flash_v3.config("pingpong", D, wide).smem
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
    plan = flash_v3.launch_rows("pingpong", np.dtype(q.dtype), q.shape, Nk, (0, Nq), (0, Nk), False,
                                resolve_scale(None, 128), merge=False, persistent=False, wide=True)
    assert plan.launch.smem == flash_v3.config("pingpong", 128, wide=True).smem
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
    fp8.key_order would make them) are out of bounds."""
    import cupy

    from stages.common import make_inputs, tolerance
    from stages.hopper import flash_v3, fp8

    _hopper()
    q, k, v = make_inputs(1, 2, 300, 320, 128, dtype=bfloat16, xp=cupy)
    errs = fp8.check(q, k, v)
    o16, _ = flash_v3.forward(q, k, v)
    ref = tolerance.oracle(*(cupy.asnumpy(x) for x in (q, k, v)))[0]
    assert errs["o"][0] > 4 * tolerance.max_error(cupy.asnumpy(o16), ref)
    order = (16 * (np.arange(320) // 16) + fp8.key_order(np.arange(320) % 16)).tolist()
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
