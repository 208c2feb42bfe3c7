"""Stage 06's CPU part: the swizzle and the wgmma descriptor (swizzle.py), the mbarrier pipeline and the warpgroup
schedules (schedules.py), the backward's tile order (backward_mirror.py) and version fp8's key order and numerics
(fp8.py). Each property is also shown to fail on a wrong layout or protocol. The launchers and the compiles:
tests/test_06_hopper_launch.py."""
import numpy as np
import pytest

from stages.common import variants
from stages.hopper import backward_mirror, fp8
from stages.hopper import schedules as S
from stages.hopper import swizzle as L

MODES = (128, 64, 32)


@pytest.mark.parametrize("mode", MODES)
def test_swizzle_permutes_chunks_inside_each_pattern(mode):
    addr = np.arange(8 * 8 * mode)  # eight patterns of 8 lines
    out = L.swizzle(addr, mode)
    assert sorted(out) == list(addr)  # a bijection
    assert (out // (8 * mode) == addr // (8 * mode)).all()  # that stays inside its pattern
    assert (out % 16 == addr % 16).all()  # and moves whole 16-byte chunks
    assert (out[: 128] == addr[: 128]).all()  # line 0 is not moved


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,cols", [(64, 64), (128, 128), (64, 256), (8, 64)])
def test_a_tile_fills_its_bytes_once(mode, rows, cols):
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = L.tile_offset(r, c, rows=rows, cols=cols, mode=mode)
    assert sorted(off.ravel() // 2) == list(range(rows * cols))


@pytest.mark.parametrize("mode", MODES)
def test_a_core_matrix_is_read_in_one_pass_only_when_swizzled(mode):
    cols = mode // 2  # one panel
    for chunk in range(mode // 16):
        for r0 in (0, 8, 24):
            rows8 = [L.tile_offset(r, chunk * 8, rows=64, cols=cols, mode=mode) for r in range(r0, r0 + 8)]
            assert L.wavefronts(rows8) == 1
            plain = [r * mode + chunk * 16 for r in range(r0, r0 + 8)]  # the same rows, not swizzled
            assert L.wavefronts(plain) == mode // 16  # 128 / mode rows per line: 8, 4, 2 passes

def test_a_wrong_swizzle_conflicts():
    wrong = [r * 128 + ((3 ^ (r % 4)) * 16) for r in range(8)]  # XOR with r mod 4: rows r and r + 4 collide
    assert L.wavefronts(wrong) == 2


def test_dq_stores_cover_the_buffer_once_and_take_one_pass_per_half_warp_only_in_the_kernels_order():
    for spread in (True, False):
        offsets = [o for nb in range(8) for upper in (False, True)
                   for o in L.dq_store_offsets(nb, upper=upper, spread=spread)]
        assert len(set(offsets)) == 512 and all(o % 8 == 0 for o in offsets)  # 16 rows x 32 pairs, each once
        logical = sorted(set(r * 128 + c * 8 + p * 8192 for r in range(16) for c in range(16) for p in (0, 1)))
        assert sorted(offsets) == sorted(L.swizzle(np.array(logical), 128).tolist())
        for nb in range(8):
            for upper in (False, True):
                off = L.dq_store_offsets(nb, upper=upper, spread=spread)
                passes = [L.wavefronts(off[h:h + 16], access_bytes=8) for h in (0, 16)]
                assert passes == ([1, 1] if spread else [2, 2])


def test_descriptor_fields():
    d = L.descriptor(1024, sbo=1024)
    assert d == 0x4000004000010040
    assert L.decode(d) == {"start": 1024, "lbo": 16, "sbo": 1024, "base_offset": 0, "mode": 128}
    assert L.decode(L.descriptor(2048 + 96, sbo=512, mode=64))["start"] == 2048 + 96


@pytest.mark.parametrize("start,kw,msg", [
    (1032, {}, "multiple of 16"), (1 << 18, {}, "256 KiB"), (1024 + 512, {}, "1024-byte boundary"),
    (1024, {"mode": 16}, "swizzle mode"), (1024, {"sbo": 1000}, "sbo"),
])
def test_descriptor_refuses_what_it_cannot_hold(start, kw, msg):
    with pytest.raises(ValueError, match=msg):
        L.descriptor(start, **{"sbo": 1024, **kw})


def _smem_with(tile, at, mode=128):
    smem = np.zeros(at + tile.nbytes, np.uint8)
    smem[at:] = L.store_tile(tile, mode=mode)
    return smem


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("rows", [64, 128])
def test_wgmma_reads_back_what_the_copy_engine_wrote(D, rows):
    """K-major operand, 128-byte swizzle: K step k (16 values, 32 bytes) of panel p is the descriptor of the panel's
    start, moved 32 bytes per step inside the 128-byte line."""
    x = np.arange(rows * D, dtype=np.uint16).reshape(rows, D)
    base = 3 * 1024
    smem = _smem_with(x, base)
    for k in range(D // 16):
        panel, within = divmod(k * 32, 128)
        desc = L.descriptor(base + panel * rows * 128 + within, sbo=1024)
        assert (L.read_operand(smem, desc, rows=rows) == x[:, 16 * k: 16 * k + 16]).all()


def test_a_wrong_descriptor_reads_other_values():
    x = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64)
    smem = _smem_with(x, 1024)
    right = x[:, 16:32]
    assert not (L.read_operand(smem, L.descriptor(1024 + 32, sbo=512), rows=64) == right).all()  # SBO: 8 rows apart
    assert not (L.read_operand(smem, L.descriptor(1024 + 32, sbo=1024, mode=0), rows=64) == right).all()  # no swizzle


@pytest.mark.parametrize("D", [64, 128, 256])
def test_an_mn_major_read_of_the_same_tile_gives_its_key_rows(D):
    """V's tile, written as K's is, read as wgmma's MN-major B: K step s (16 keys) starts 2048 bytes further, panels
    of 64 columns are LBO apart."""
    v = np.arange(64 * D, dtype=np.uint16).reshape(64, D)
    smem = _smem_with(v, 2048)
    for s in range(4):
        got = L.read_operand_mn(smem, L.descriptor(2048 + 2048 * s, sbo=1024, lbo=64 * 128), n=D)
        assert (got == v[16 * s:16 * s + 16]).all()
    if D > 64:  # a wrong panel offset reads other columns
        assert not (L.read_operand_mn(smem, L.descriptor(2048, sbo=1024, lbo=1024), n=D) == v[:16]).all()


# ---------------------------------------------------------------- the pipeline
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("t_load,t_compute", [(3, 2), (2, 3), (2, 2), (1, 5)])
def test_pipeline_time(stages, t_load, t_compute):
    n = 9
    run = S.simulate_pipeline(n, stages, t_load, t_compute)
    if stages == 1:
        assert run.ticks == n * (t_load + t_compute)  # nothing overlaps
    else:  # the first load, then one tile per max(load, compute), then the last compute
        assert run.ticks == t_load + (n - 1) * max(t_load, t_compute) + t_compute
    assert [c[0] for c in run.computes] == list(range(n))


def test_pipeline_mistakes_are_caught():
    with pytest.raises(S.RaceError, match="holds nothing"):  # the consumer's parity inverted: it does not wait
        S.simulate_pipeline(6, 2, 3, 2, consumer_parity=lambda n: (n & 1) ^ 1)
    with pytest.raises(S.RaceError, match="while tile"):  # the producer does not wait for empty stages
        S.simulate_pipeline(6, 2, 1, 3, producer_waits=False)
    with pytest.raises(RuntimeError, match="deadlock"):  # the producer waits for a release before the first use
        S.simulate_pipeline(6, 2, 1, 3, producer_parity=lambda n: n & 1)


def test_one_bit_of_phase_suffices_but_not_zero():
    b = S.MBarrier()
    assert b.try_wait_parity(1) and not b.try_wait_parity(0)  # phase 0 running: parity 1 "completed" (the start)
    b.arrive()
    assert b.try_wait_parity(0) and not b.try_wait_parity(1)


# ---------------------------------------------------------------- the warpgroups
@pytest.mark.parametrize("D", [64, 128])
def test_pingpong_keeps_the_tensor_cores_busy(D):
    g, s = S.tile_times(D)
    n = 64
    _, _, one = S.schedule_warpgroups(n, g, s, "one")
    _, _, together = S.schedule_warpgroups(n, g, s, "together")
    _, _, pingpong = S.schedule_warpgroups(n, g, s, "pingpong")
    _, _, overlap = S.schedule_warpgroups(n, g, s, "overlap")
    assert one == pytest.approx(2 * g / (2 * g + s))
    assert together == pytest.approx(4 * g / (4 * g + s))
    assert s <= 2 * g and pingpong > 0.99  # the softmax hides under the other warpgroup's two GEMMs
    assert overlap > one and pingpong > together


@pytest.mark.parametrize("g,s", [(1.0, 0.5), (1.0, 1.0), (1.0, 2.5)])
def test_overlap_hides_the_softmax_under_one_gemm(g, s):
    """Within one warpgroup a tile after the first costs one GEMM plus the longer of the softmax and the other GEMM
    (GEMM1 of the tile before, issued with GEMM0): the tensor cores are busy 2 g / (g + max(g, s)) in the long run."""
    n = 200
    iv, T, busy = S.schedule_warpgroups(n, g, s, "overlap")
    assert T == pytest.approx(g + s + (n - 1) * (g + max(g, s)) + g)
    assert busy == pytest.approx(2 * n * g / T)
    softmax = {label: (b, e) for u, label, b, e in iv if u == "wg0"}
    gemm1 = {label: (b, e) for u, label, b, e in iv if u == "tc" and label.startswith("G1")}
    b, _ = softmax["softmax 5"]
    assert gemm1["G1 4"][0] == pytest.approx(b)  # the softmax of tile 5 starts with GEMM1 of tile 4


def test_pingpong_is_bounded_by_the_softmax_when_it_is_longer():
    g, s = 1.0, 3.0  # a softmax longer than the other warpgroup's two GEMMs cannot hide
    _, T, u = S.schedule_warpgroups(64, g, s, "pingpong")
    assert u < 0.9 and T >= 64 * (g + s)


def test_schedules_refuse_bad_input():
    with pytest.raises(ValueError, match="policy"):
        S.schedule_warpgroups(4, 1.0, 1.0, "fast")
    with pytest.raises(ValueError):
        S.simulate_pipeline(0, 2, 1, 1)


# ---------------------------------------------------------------- the backward's tile order, mirrored in numpy
@pytest.mark.parametrize("bc,br", [(64, 64), (128, 64), (128, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 130, 200), (2, 1, 200, 77), (1, 1, 1, 65), (1, 2, 150, 150)])
def test_backward_mirror_gives_stage_00s_gradients(shape, causal, bc, br):
    """The kernel's tile order (transposed GEMMs per consumer; one dQ reduction per block and Q tile) sums to the
    same gradients as stage 00's backward, in float64; with Nq > Nk under the causal mask some rows see no key."""
    from stages import naive
    from stages.common import make_inputs
    from stages.hopper import backward_mirror

    q, k, v, do = make_inputs(*shape, 64, dtype=np.float64, grad=True)
    o, lse = naive.forward(q, k, v, causal=causal)
    want = naive.backward(q, k, v, o, lse, do, causal=causal)
    got = backward_mirror.backward(q, k, v, o, lse, do, causal=causal, bc=bc, br=br)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert np.allclose(a, b, rtol=1e-10, atol=1e-12), name


def test_backward_mirror_reduces_into_dq_once_per_block_and_q_tile():
    """Blocks of 128 keys (version ws) make half the reductions of blocks of 64 (version wgmma) when nothing is
    masked, Q tiles of 128 rows (version ws at D = 64) half again, and a causal block skips the Q tiles above its
    first key's diagonal."""
    from stages.common import make_inputs
    from stages.hopper import backward_mirror as M

    assert M.dq_reductions(4096, 4096, False, 64) == 2 * M.dq_reductions(4096, 4096, False, 128) == 64 * 64
    assert M.dq_reductions(4096, 4096, True, 128) == sum(64 - 2 * j for j in range(32))
    # Q tiles of 128 rows (version ws at D = 64): half the reductions again, and a causal block's first tile may
    # start above its first key's diagonal
    assert M.dq_reductions(4096, 4096, False, 128, 128) == 32 * 32
    assert M.dq_reductions(4096, 4096, True, 128, 128) == sum(32 - j for j in range(32))
    q, k, v, do = make_inputs(1, 1, 256, 256, 64, dtype=np.float64, grad=True)
    trace = []
    M.backward(q, k, v, q, np.zeros((1, 1, 256)), do, causal=True, trace=trace)
    assert trace == [(0, 0), (0, 64), (0, 128), (0, 192), (128, 128), (128, 192)]
    assert len(trace) == M.dq_reductions(256, 256, True, 128)
    trace = []
    M.backward(q, k, v, q, np.zeros((1, 1, 256)), do, causal=True, br=128, trace=trace)
    assert trace == [(0, 0), (0, 128), (128, 128)] and len(trace) == M.dq_reductions(256, 256, True, 128, 128)


# ---------------------------------------------------------------- the variants: what the kernels visit and skip
WINDOWS = [(-1, -1), (-1, 0), (70, 30), (0, 0), (200, -1), (-1, 5), (300, 0), (1023, 0)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("Nq,Nk,bc", [(300, 300, 128), (150, 400, 128), (400, 150, 128), (700, 1300, 64),
                                       (1, 65, 128), (129, 2000, 128)])
def test_forward_items_visit_exactly_the_band_of_tiles_their_rows_see(Nq, Nk, bc, window):
    """The VariantScheduler's items (schedules.variant_items, the kernel's arithmetic): every row in one item, every
    (row, key) a row sees inside its item's band of K/V tiles, and every tile of a band holding a key one of the item's
    rows sees: a window's other tiles are never loaded. Heaviest first without a left bound; an item past the rows (a
    packed batch's shorter sequence) visits nothing."""
    left, right = window
    opts = variants.Options(left=left, right=right)
    vis = variants.visible(Nq, Nk, opts)
    items = S.variant_items(Nq, Nk, left, right, bc, n_blocks=-(-Nq // 128) + 2)
    rows = sorted(r for _, row0, _, _ in items if row0 < Nq for r in range(row0, min(row0 + 128, Nq)))
    assert rows == list(range(Nq))
    for rank, row0, j0, n in items:
        if row0 >= Nq:
            assert n == 0
            continue
        seen = vis[row0:row0 + 128]
        band = np.zeros(Nk, bool)
        band[j0 * bc:(j0 + n) * bc] = True
        assert not (seen & ~band).any(), f"item {rank}: a key it sees lies outside its band"
        for j in range(j0, j0 + n):
            assert seen[:, j * bc:(j + 1) * bc].any(), f"item {rank}: tile {j} holds no key its rows see"
    if right >= 0 and left < 0:  # rank 0 is the last Q tile, the one that sees the most keys
        assert items[0][1] == 128 * (-(-Nq // 128) - 1)


@pytest.mark.parametrize("window", WINDOWS)
def test_a_part_left_unmasked_is_seen_whole(window):
    """part_masked (WindowMask's, the kernels' test before they apply the mask): False only where every (row, key) of
    the part is seen; rows past Nq are masked; over random parts, both answers come up."""
    left, right = window
    Nq, Nk = 333, 300
    vis = variants.visible(Nq, Nk, variants.Options(left=left, right=right))
    rng = np.random.default_rng(7)
    answers = set()
    for _ in range(400):
        r0, c0 = int(rng.integers(0, Nq + 20)), int(rng.integers(0, Nk + 20))
        r1, c1 = r0 + int(rng.integers(0, 128)), c0 + int(rng.integers(0, 128))
        masked = S.part_masked(r0, r1, c0, c1, Nq, Nk, left, right)
        answers.add(masked)
        if not masked:
            assert r1 < Nq and c1 < Nk and vis[r0:r1 + 1, c0:c1 + 1].all()
    assert answers == {True, False} or window == (0, 0)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("Nq,Nk", [(300, 300), (200, 333), (192, 192), (100, 130)])
def test_the_ragged_last_tile_keeps_every_key_its_rows_see(Nq, Nk, window):
    """At D = 128 a warpgroup computes its item's last K/V tile only as wide as its rows need (last_tile_width): no key
    one of its 64 rows sees lies past that width, and a narrower tile is taken somewhere (the diagonal)."""
    left, right = window
    vis = variants.visible(Nq, Nk, variants.Options(left=left, right=right))
    widths = set()
    for _, row0, j0, n in S.variant_items(Nq, Nk, left, right, 128):
        if n == 0:
            continue
        j_last = j0 + n - 1
        for first in (row0, row0 + 64):
            w = S.last_tile_width(first, Nq, Nk, right, j_last, 128)
            widths.add(w)
            assert not vis[first:first + 64, 128 * j_last + w:128 * (j_last + 1)].any()
    assert widths


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("Nq,Nk,br", [(300, 300, 64), (150, 400, 128), (400, 150, 64), (1, 65, 64)])
def test_a_key_block_walks_exactly_the_q_tiles_that_see_its_keys(Nq, Nk, br, window):
    """The backward's block of 128 keys visits the Q tiles from the first to the last holding a row that sees one of
    its keys (backward_mirror.q_tiles, KeyBlock's arithmetic): none missed, none outside that span."""
    left, right = window
    vis = variants.visible(Nq, Nk, variants.Options(left=left, right=right))
    for key0 in range(0, Nk, 128):
        rows = np.flatnonzero(vis[:, key0:key0 + 128].any(axis=1))
        want = range(rows[0] // br * br, rows[-1] + 1, br) if rows.size else range(0)
        got = backward_mirror.q_tiles(Nq, Nk, key0, 128, br, left, right)
        assert [r // br for r in got] == [r // br for r in want], (key0, got, want)


@pytest.mark.parametrize("br", [64, 128])
@pytest.mark.parametrize("case", ["gqa", "mqa-window", "softcap-alibi", "window-empty-rows"])
def test_backward_mirror_with_the_variants_gives_stage_00s_gradients(case, br):
    """The variants' kernel's order (a block per K/V tile and k / v head walking its group's query heads; a window's Q
    tiles only; softcap's derivative and ALiBi on S^T) sums to stage 00's gradients in float64: dK, dV of a k / v
    head are its group's sums."""
    from stages import naive
    from stages.common import make_inputs

    H, Hkv, Nq, Nk, causal, kw = {
        "gqa": (4, 2, 130, 200, True, {}),
        "mqa-window": (4, 1, 257, 200, False, {"window": (64, 10)}),
        "softcap-alibi": (2, 2, 100, 150, True, {"softcap": 5.0, "alibi_slopes": np.array([0.5, 0.25])}),
        "window-empty-rows": (2, 1, 150, 90, False, {"window": (0, 0), "softcap": 20.0}),
    }[case]
    q, _, _, do = make_inputs(2, H, Nq, Nk, 32, dtype=np.float64, grad=True)
    _, k, v = make_inputs(2, Hkv, Nq, Nk, 32, dtype=np.float64)
    o, lse = naive.forward(q, k, v, causal=causal, **kw)
    want = naive.backward(q, k, v, o, lse, do, causal=causal, **kw)
    opts = variants.check(q, k, causal=causal, **kw)
    got = backward_mirror.backward(q, k, v, o, lse, do, causal=causal, br=br, opts=opts)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and np.allclose(a, b, rtol=1e-10, atol=1e-12), name
    summed = backward_mirror.backward(q, k.repeat(H // Hkv, 1), v.repeat(H // Hkv, 1), o, lse, do, causal=causal,
                                      br=br, opts=opts._replace(group=1))
    assert np.allclose(got[1], summed[1].reshape(2, Hkv, H // Hkv, Nk, 32).sum(2))  # dK: the group's sum


# ---------------------------------------------------------------- version fp8: its key order and numerics
def test_fp8_key_order_lets_each_lane_pack_its_own_p():
    """The 8-bit A fragment wants lane t's columns 4 t .. 4 t + 3 (and 16 on); the accumulator of S gave it keys 2 t,
    2 t + 1, 8 + 2 t, 9 + 2 t (and 16 on). With V^T's keys in fp8.key_order, the product over the fragment's
    positions is P V: simulated here for a warp's 16 rows and one K step of 32 keys."""
    order = fp8.key_order(np.arange(16))
    assert sorted(order.tolist()) == list(range(16))
    for t in range(4):  # what lane t packs is what the order puts at its positions
        keys = fp8.p_fragment_keys(t)
        assert keys.tolist() == [16 * (j // 4) + int(order[4 * t + j % 4]) for j in range(8)]
    rng = np.random.default_rng(0)
    p, v = rng.random((16, 32)), rng.standard_normal((32, 8))
    a = fp8.pack_a(p)  # the A operand as the lanes fill it: row r, position 4 t + j (+ 16)
    vt = v[np.concatenate([order, 16 + order])].T  # V^T's columns in the key order (the pre-pass)
    assert np.allclose(a @ vt.T, p @ v)
    assert not np.allclose(a @ v, p @ v)  # without the order the sum pairs the wrong keys


def test_fp8_reference_has_e4m3s_error_and_no_more():
    """fp8.reference (the yardstick of version fp8) against the float64 oracle: its error is e4m3's (3 mantissa bits
    in q, k, v and P, about 2^-5 relative each), well above bfloat16's and below 2^-3 of the values' size."""
    from stages.common import make_inputs, tolerance

    q, k, v = make_inputs(2, 3, 300, 200, 128, dtype=np.float32, seed=3)
    for causal in (False, True):
        o, lse = fp8.reference(q, k, v, causal=causal)
        o_ref, lse_ref = tolerance.oracle(q, k, v, causal=causal)
        err = np.abs(o - o_ref).max() / np.abs(v).max()
        assert 2.0 ** -9 < err < 2.0 ** -3, err
        seen = np.isfinite(lse_ref)  # rows that see no key: -inf in both
        assert (lse[~seen] == -np.inf).all() and np.abs(lse[seen] - lse_ref[seen]).max() < 2.0 ** -3
    x8, amax = fp8.quantize(v)
    assert np.abs(x8).max() <= fp8.E4M3_MAX and (np.abs(x8).max(axis=(2, 3)) == fp8.E4M3_MAX).all()
    assert np.allclose(x8 * amax / fp8.E4M3_MAX, v, rtol=2.0 ** -4, atol=1e-3 * np.abs(v).max())
