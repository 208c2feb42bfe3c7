"""Stage 04: the other ways to split a sequence (gather.py), held to the ring's checks.

CPU: scheme "allgather" and "alltoall" simulated in one process over the full case list, both layouts, forward and
backward, against the fp64 oracle by the tolerance rule; the variants (grouped-query, window, softcap, ALiBi,
dropout where the scheme takes it); 16 bits through the stage 02/03 tile mirrors; the bytes each scheme sends; clear
errors for what a scheme cannot take. mpi: run.py with each scheme under `mpirun -n 2` and `-n 4` on the numpy
backend. gpu: the schemes simulated on CuPy with the stage 02/03 kernels, run.py
with 4 ranks on one GPU (mpi backend) and, with two GPUs, over NCCL.
"""
import numpy as np
import pytest

import stages.hopper  # noqa: F401  the caller registers stage 06's kernels: the GPU tests below run them on sm_90
from stages import naive, ring
from stages.common import bfloat16, make_inputs
from tests.conftest import CASE_IDS, CASES, DROPOUT_CASES, VARIANT_CASES, variant_inputs
from tests.test_04_mpirun import _gpu_count, _launch
from tests.test_04_ring import GPU_CASES, RING_GPU_VARIANTS, RING_VARIANTS, _check_ring

OTHER = ("allgather", "alltoall")


def _widen(case, P):
    """A VARIANT_CASES row with P times the heads (and P times the kv heads), so that P ranks of the all-to-all each
    get whole heads; per-head ALiBi slopes repeat."""
    B, H, Hkv, Nq, Nk, causal, opts = case
    opts = dict(opts)
    if opts.get("alibi_slopes") is not None:
        opts["alibi_slopes"] = np.tile(opts["alibi_slopes"], P)
    return B, H * P, Hkv * P, Nq, Nk, causal, opts


@pytest.mark.parametrize("scheme", OTHER)
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_schemes_simulated_cases(case, layout, scheme):
    """Every shape of the case list, 2 to 4 ranks (the all-to-all with P times the case's heads)."""
    B, H, Nq, Nk, D, causal, scale_in = case
    i = CASES.index(case)
    P = 2 + i % 3
    H = H * P if scheme == "alltoall" else H
    q, k, v, do = make_inputs(B, H, Nq, Nk, (16, 32, 64)[i % 3], dtype=np.float32, scale=scale_in, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=P, scheme=scheme)


@pytest.mark.parametrize("scheme", OTHER)
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("name", list(RING_VARIANTS))
def test_schemes_simulated_with_options(name, layout, scheme):
    """The variants through each scheme, float32 with stage 00 blocks: the one-device result, the ALiBi of global
    distances and the dropout mask of the whole problem included. The all-to-all takes no dropout (test below)."""
    if scheme == "alltoall" and name in DROPOUT_CASES:
        pytest.skip("the all-to-all refuses dropout: test_alltoall_refuses_what_it_cannot_split")
    i = list(RING_VARIANTS).index(name)
    P = 2 + i % 3
    case = _widen(RING_VARIANTS[name], P) if scheme == "alltoall" else RING_VARIANTS[name]
    (q, k, v, do), causal, opts = variant_inputs(case, 32, np.float32, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=P, opts=opts, scheme=scheme)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scheme", OTHER)
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_schemes_through_the_tile_mirrors(causal, layout, scheme, dtype):
    """16 bits through the stage 02/03 calls (block="flash", their numpy tile mirrors), 3 ranks, odd lengths."""
    q, k, v, do = make_inputs(1, 3, 77, 90, 64, dtype=dtype, grad=True)
    _check_ring(q, k, v, do, causal, layout=layout, ranks=3, block="flash", scheme=scheme)


@pytest.mark.parametrize("scheme", OTHER)
def test_schemes_with_options_through_the_tile_mirrors(scheme):
    """Grouped-query k, v, a window, softcap and ALiBi in bfloat16 through the stage 02/03 mirrors, 2 ranks."""
    (q, k, v, do), causal, opts = variant_inputs(_widen(VARIANT_CASES["all"], 2), 64, bfloat16, grad=True)
    _check_ring(q, k, v, do, causal, layout="zigzag", ranks=2, block="flash", opts=opts, scheme=scheme)


def test_traffic_says_what_each_scheme_sends():
    """The ring and the all-gather send (P - 1) shards of K, V and of the float32 dK, dV (the ring's gradients make one
    hop more, home); the all-to-all sends about the same whatever P, so it sends less from P = 3 on with as many kv
    heads as heads; the ring's count agrees with schedule()'s hops."""
    L, H, D = 1024, 8, 64
    for P in (2, 4, 8):
        sched = ring.schedule(P, P * L, P * L, layout="zigzag", causal=True, kv_shape=(1, H, L, D), dtype=bfloat16)
        f, b = ring.traffic("ring", P, L, H, H, D, bfloat16)
        assert f == sched["kv_hops"] * sched["kv_bytes_per_hop"]
        assert b == sched["kv_hops"] * sched["kv_bytes_per_hop"] + sched["dkv_hops"] * sched["dkv_bytes_per_hop"]
        kv = 2 * L * H * D
        assert ring.traffic("allgather", P, L, H, H, D, bfloat16) == (f, b - kv * 4)
        a_f, a_b = ring.traffic("alltoall", P, L, H, H, D, bfloat16)
        assert (a_f < f) == (P >= 3) and a_b < b
        assert a_f == (P - 1) * L * (4 * H * D * 2 + H * 4) // P


@pytest.mark.parametrize("api", ["forward", "backward"])
def test_alltoall_refuses_what_it_cannot_split(api):
    """The all-to-all gives each rank whole heads (P must divide H and Hkv) and refuses dropout (its bits follow a
    head's index in the call); an unknown scheme names the known ones. The errors come before any shard is cut."""
    q, k, v, do = make_inputs(1, 4, 16, 16, 8, dtype=np.float32, grad=True)
    o, lse = naive.forward(q, k, v)
    args = (q, k, v) if api == "forward" else (q, k, v, o, lse, do)
    fn = getattr(ring, api)
    with pytest.raises(ValueError, match=r"scheme 'alltoall' gives each of the 3 ranks H/P query heads .* 3 must "
                                         r"divide H = 4 and Hkv = 4"):
        fn(*args, ranks=3, scheme="alltoall")
    with pytest.raises(ValueError, match=r"4 must divide H = 4 and Hkv = 2"):
        fn(q, k[:, :2], v[:, :2], *args[3:], ranks=4, scheme="alltoall")
    with pytest.raises(ValueError, match=r"scheme 'alltoall' .* dropout"):
        fn(*args, ranks=2, scheme="alltoall", dropout_p=0.1)
    with pytest.raises(ValueError, match=r"scheme 'striped' is not known; use one of \('ring', 'allgather', "
                                         r"'alltoall'\)"):
        fn(*args, ranks=2, scheme="striped")


def test_a_scheme_error_on_the_ranks_is_an_error_on_every_rank():
    """Per rank (what mpirun runs): the same refusal on every rank, before anything travels."""
    x = np.zeros((1, 2, 8, 4), np.float32)
    with pytest.raises(ring.RingMismatch, match=r"rank \d cannot run: ValueError: .*3 must divide H = 2"):
        ring.simulate(lambda comm: ring.ring_forward(x, x, x, ring=comm, block="naive", scheme="alltoall"), 3)


def test_scheme_timelines_split_compute_and_communication():
    """A scheme's timeline: one entry, its compute and the time its compute stream waited on the transfers."""
    q, k, v = make_inputs(1, 2, 64, 64, 8, dtype=np.float32)
    for scheme in OTHER:
        lines = []

        def body(comm):
            tl = []
            ring.ring_forward(*(ring.shard(x, comm.rank, 2, "zigzag") for x in (q, k, v)), ring=comm, causal=True,
                              layout="zigzag", block="naive", timeline=tl, scheme=scheme)
            lines.append(tl)

        ring.simulate(body, 2)
        assert all(len(tl) == 1 and tl[0]["compute_ms"] > 0 and tl[0]["exposed_ms"] >= 0 for tl in lines), lines


# ---------------------------------------------------------------- mpirun
MPI_SCHEMES = [(2, "allgather", "contiguous", False, 101), (4, "allgather", "zigzag", True, 257),
               (2, "alltoall", "zigzag", True, 99), (4, "alltoall", "contiguous", False, 130)]


@pytest.mark.mpi
@pytest.mark.parametrize("n,scheme,layout,causal,seq", MPI_SCHEMES,
                         ids=[f"n{n}-{s}-{lay}-{'causal' if c else 'full'}-N{q}" for n, s, lay, c, q in MPI_SCHEMES])
def test_mpirun_numpy_backend_schemes(n, scheme, layout, causal, seq):
    """MPI point-to-point with every shift (numpy backend): run.py's check on the full sequence, then its timing."""
    extra = [] if causal else ["--no-causal"]
    rc, out = _launch(n, "--quick", "--backend", "numpy", "--scheme", scheme, "--layout", layout, "--check-seq",
                      str(seq), "--seq", "64", *extra)
    assert rc == 0, out
    assert f"scheme {scheme}, layout {layout}" in out and "All results match" in out, out
    assert f"{scheme} at N=" in out and "MB per forward" in out, out
    assert out.rstrip().splitlines()[-1].startswith(f"SUMMARY 04_ring PASS {n} ranks numpy"), out


@pytest.mark.mpi
def test_mpirun_alltoall_with_heads_it_cannot_split_is_one_clear_error():
    rc, out = _launch(4, "--quick", "--backend", "numpy", "--scheme", "alltoall", "--heads", "6")
    assert rc == 2, out
    assert out.count("--scheme alltoall gives each of the 4 ranks") == 1, out  # printed once, by rank 0


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", OTHER)
@pytest.mark.parametrize("case", GPU_CASES, ids=[CASE_IDS[CASES.index(c)] for c in GPU_CASES])
def test_gpu_schemes_simulated_with_flash_blocks(case, scheme, dtype):
    import cupy

    B, H, Nq, Nk, D, causal, scale_in = case
    i = CASES.index(case)
    P = 2 + i % 3
    H = H * P if scheme == "alltoall" else H
    q, k, v, do = make_inputs(B, H, Nq, Nk, (64, 128)[i % 2], dtype=dtype, xp=cupy, scale=scale_in, grad=True)
    _check_ring(q, k, v, do, causal, layout=ring.LAYOUTS[i % 2], ranks=P, block="flash", scheme=scheme)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", OTHER)
@pytest.mark.parametrize("name", list(RING_GPU_VARIANTS))
def test_gpu_schemes_with_options_and_flash_blocks(name, scheme):
    """The variants through the stage 02/03 kernels (bfloat16, d = 64 and 128 alternating), 2 to 4 simulated ranks."""
    import cupy

    if scheme == "alltoall" and name in DROPOUT_CASES:
        pytest.skip("the all-to-all refuses dropout: test_alltoall_refuses_what_it_cannot_split")
    i = list(RING_GPU_VARIANTS).index(name)
    P = 2 + i % 3
    case = _widen(RING_GPU_VARIANTS[name], P) if scheme == "alltoall" else RING_GPU_VARIANTS[name]
    (q, k, v, do), causal, opts = variant_inputs(case, (64, 128)[i % 2], bfloat16, xp=cupy, grad=True)
    _check_ring(q, k, v, do, causal, layout=ring.LAYOUTS[i % 2], ranks=P, block="flash", opts=opts, scheme=scheme)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("scheme", OTHER)
def test_gpu_mpirun_mpi_backend_schemes_four_ranks_one_gpu(scheme):
    """CuPy staged through the host (the mpi backend), shifts of 1 to 3 ranks, 4 ranks on one GPU."""
    rc, out = _launch(4, "--quick", "--backend", "mpi", "--scheme", scheme, "--heads", "8", "--kv-heads", "4",
                      "--check-seq", "1001", "--seq", "2048", timeout=240)
    assert rc == 0, out
    assert "SUMMARY 04_ring PASS 4 ranks mpi" in out, out


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("scheme", OTHER)
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_gpu_mpirun_nccl_backend_schemes_two_gpus(layout, causal, scheme):
    """NCCL send/recv on its stream, one GPU per rank, checked on the full sequence."""
    if _gpu_count() < 2:
        pytest.skip(f"the nccl backend needs 2 GPUs (one per rank); this machine has {_gpu_count()}")
    extra = [] if causal else ["--no-causal"]
    rc, out = _launch(2, "--quick", "--backend", "nccl", "--scheme", scheme, "--layout", layout, "--check-seq", "1001",
                      "--seq", "8192", *extra, timeout=240)
    assert rc == 0, out
    assert "SUMMARY 04_ring PASS 2 ranks nccl" in out, out
