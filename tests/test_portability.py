"""Every kernel runs on the GPUs learners have (sm_75 T4 to sm_90 H100), checked without owning them.

For each architecture in stages.common.device.ARCHS, every kernel instantiation a launcher may pick there
(`kernel_plans(dev)` of stages 01-03: the configuration chosen from that architecture's shared memory and, where
the problem decides, every one it can reach) is compiled for that architecture, and ptxas's own report is held to
the architecture's limits: static + dynamic shared memory within the opt-in limit per block, static shared memory
within 48 KB, registers x threads within the 64K registers of a block. NVRTC makes the PTX once per family of
architectures that compile alike (kernel_resources.ptx_families: sm_80, sm_86 and sm_89 take the same side of
every __CUDA_ARCH__ test), and ptxas assembles it for the family's first member, every kernel the family needs
(kernel_resources.resource_usages). The other members share what the checks read from that report: static shared
memory is the PTX's own __shared__ arrays (test_ptxas_reports_what_nvrtcs_own_compile_reports compares the
members), and a member's registers can break the block's 64K only above 256 threads (ptxas gives a thread at most
255 registers, and allocates them per warp in steps of 8: 256 threads x 256 = 65536), so ptxas assembles a
member's kernels itself only where it launches more. On a GPU, the same plans are what the gpu suite runs
(ATTN_ARCH=sm_XX picks another architecture's plans on a newer GPU).

How much each compile optimizes follows from what the check reads (OPTIMIZED_ABOVE_THREADS). A plan whose registers
can break the block's 64K (more than 256 threads) is compiled as a GPU builds it, NVVM and ptxas optimizing, and its
registers are checked. A plan of at most 256 threads cannot break it (ptxas gives a thread at most 255 registers, and
256 x 256 = 65536), so the check reads only that it compiles and its shared memory: those compile with NVRTC's
--Ofast-compile=max and ptxas -O0. Such a compile still runs the front end (every template instantiated, every
static_assert), makes the family's PTX and assembles it for the architecture, whose instructions ptxas checks; its
static shared memory is the kernel's __shared__ arrays, which optimizing can only shrink (an unused one removed), so
the shared-memory check is, if anything, stricter. The optimizers are most of a compile's time and decide nothing the
check reads. test_ptxas_reports_what_nvrtcs_own_compile_reports compares the two builds' shared memory on a module.
"""
import atexit
import json
import pathlib
import subprocess
import sys
import threading
from typing import NamedTuple

import numpy as np
import pytest

from stages import flash_v1, flash_v2, flash_v2_backward
from stages.common import device, kernel_resources, kernels


def _plans(dev):
    return flash_v1.kernel_plans(dev) + flash_v2.kernel_plans(dev) + flash_v2_backward.kernel_plans(dev)


PLANS = {arch: _plans(device.emulate(arch)) for arch in device.ARCHS}
CHUNK = 16  # instantiated kernels per NVRTC compile at most: a module of many template instantiations (version
# pipelined's variants) is compiled in pieces, each instantiating only its own kernels, one test each


OPTIMIZED_ABOVE_THREADS = device.REGISTERS_PER_BLOCK // 256  # 256: above it a block's registers can pass 64K
FAST_BUILD = {"nvrtc_options": ("--Ofast-compile=max",), "ptxas_options": ("-O0",)}  # the build of the other plans


class Job(NamedTuple):
    """One compile: a module (file and -D defines), a PTX family of architectures, and the plans of each member
    that it instantiates."""
    file: str
    defines: tuple
    by_arch: dict  # {arch: [plans]}, the family's members oldest first
    id: str

    @property
    def optimized(self):
        """Whether the job is compiled as a GPU builds it: some plan's registers can break the 64K of a block."""
        return any(p.threads > OPTIMIZED_ABOVE_THREADS for ps in self.by_arch.values() for p in ps)

    @property
    def first(self):
        """The family's first (oldest) member: the PTX is made for it."""
        return next(iter(self.by_arch))

    def assemble(self):
        """{arch: [name expressions]} for ptxas: the family's first member, every kernel of the job (its PTX is the
        family's); another member only where its registers can break the block's 64K (over 256 threads). An empty
        list: every kernel of the module (a file of one kernel, with no template)."""
        names = {a: [p.name for p in ps if "<" in p.name] for a, ps in self.by_arch.items()}
        out = {self.first: sorted({n for ns in names.values() for n in ns})}
        out.update({a: names[a] for a, ps in self.by_arch.items() if a != self.first and any(
            p.threads > OPTIMIZED_ABOVE_THREADS for p in ps)})
        return out

    def cost(self):
        """Kernels compiled, by NVRTC once and by ptxas for each assembled member: what orders the tests, the
        longest first."""
        return len({p.name for ps in self.by_arch.values() for p in ps}) * (1 + len(self.assemble()))


def _jobs(plans_by_arch):
    """[Job]: the compiles, one per module and PTX family, or per CHUNK of the kernels the family's architectures
    need, the longest first."""
    modules = {}
    for arch, plans in plans_by_arch.items():
        for p in plans:
            modules.setdefault((p.file, tuple(sorted(p.defines.items()))), {}).setdefault(arch, []).append(p)
    jobs = []
    for (file, defines), by_arch in modules.items():
        for family in kernel_resources.ptx_families(file, list(by_arch)):
            names = sorted({p.name for a in family for p in by_arch[a]})
            for i in range(0, len(names), CHUNK):
                chunk = set(names[i:i + CHUNK])
                where = "-".join([file.removesuffix(".cu")] + [f"{k}={v}" for k, v in defines] + ["+".join(family)])
                jobs.append(Job(file, defines, {a: [p for p in by_arch[a] if p.name in chunk] for a in family},
                                f"{where}-{i // CHUNK + 1}of{-(-len(names) // CHUNK)}"))
    return sorted(jobs, key=lambda job: (-job.cost(), job.id))


class FastBuilds:
    """kernel_resources.resource_usages(..., **FAST_BUILD) in a process of its own, started on first use (one per
    test worker).

    NVRTC carries state from one compile to the next within a process: after a compile with --Ofast-compile (or -G),
    a default compile of the same source makes other PTX, with other register counts (NVRTC 12.9;
    test_a_fast_build_leaves_this_processs_compiles_as_they_were). Here the fast builds run in the child, so the
    optimized compiles of the test process (this file's other tests, stage 06's register and spill checks) stay the
    ones a GPU makes."""

    CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from stages.common import kernel_resources
build = json.loads(sys.argv[2])
for line in sys.stdin:
    file, names_by_arch, defines = json.loads(line)
    try:
        answer = {"usage": kernel_resources.resource_usages(file, names_by_arch, defines=defines, **build)}
    except Exception as e:  # a kernel that does not compile: the message goes back to the test
        answer = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(answer), flush=True)
"""
    _proc = None
    _lock = threading.Lock()

    @classmethod
    def _close(cls):
        """End the child (its input closed, it returns) and wait for it, so that its CPU time counts as this
        process's children's."""
        cls._proc.stdin.close()
        try:
            cls._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            cls._proc.kill()
            cls._proc.wait()

    @classmethod
    def usages(cls, file, names_by_arch, defines):
        with cls._lock:
            if cls._proc is None:
                root = str(pathlib.Path(__file__).resolve().parents[1])
                cls._proc = subprocess.Popen([sys.executable, "-c", cls.CHILD, root, json.dumps(FAST_BUILD)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                atexit.register(cls._close)
            cls._proc.stdin.write(json.dumps([file, names_by_arch, defines]) + "\n")
            cls._proc.stdin.flush()
            line = cls._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fast-build process ended (exit code {cls._proc.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["usage"]


def _check(job):
    """[(arch, plan, what is wrong)] after compiling the job's plans."""
    names, defines = job.assemble(), dict(job.defines)
    usage = kernel_resources.resource_usages(job.file, names, defines=defines) if job.optimized else \
        FastBuilds.usages(job.file, names, defines)
    bad = []
    for arch, ps in job.by_arch.items():
        dev = device.emulate(arch)
        report = usage.get(arch, usage[job.first])  # static shared memory: the family's; registers: arch's own
        for p in ps:
            u = report.get(p.name)
            if u is None:
                bad.append((arch, p, f"ptxas reported no kernel {p.name!r} (reported: {sorted(report)})"))
                continue
            smem = u["static_smem"] + p.dynamic_smem
            if smem > dev.smem_optin:
                bad.append((arch, p, f"shared memory {smem} B > {dev.smem_optin} B"))
            if u["static_smem"] > device.STATIC_SMEM_LIMIT:
                bad.append((arch, p, f"static shared memory {u['static_smem']} B > 48 KB"))
            if job.optimized and arch in usage and u["registers"] * p.threads > device.REGISTERS_PER_BLOCK:
                bad.append((arch, p, f"{u['registers']} registers x {p.threads} threads > 65536"))
    return bad


def _problems(plans_by_arch):
    """[(arch, plan, what is wrong)] after compiling every plan of {arch: [plans]} for its architecture."""
    return [b for job in _jobs(plans_by_arch) for b in _check(job)]


JOBS = _jobs(PLANS)


@pytest.mark.slow  # minutes on two cores in all: started first (conftest.py), the longest first
@pytest.mark.parametrize("job", JOBS, ids=[job.id for job in JOBS])
def test_every_plan_compiles_within_the_architectures_limits(job):
    problems = _check(job)
    assert not problems, "\n".join(f"{arch} {p.file} {p.name} {p.defines}: {why}" for arch, p, why in problems)


def test_the_compile_jobs_cover_every_plan_once():
    """Each plan of each architecture is in exactly one job, under its own architecture."""
    covered = [(a, p) for job in JOBS for a, ps in job.by_arch.items() for p in ps]
    assert sorted(map(repr, covered)) == sorted(repr((a, p)) for a, ps in PLANS.items() for p in ps)
    assert len({job.id for job in JOBS}) == len(JOBS)


def test_every_architecture_has_plans():
    assert all(PLANS.values()) and set(PLANS) == set(device.ARCHS)


def test_each_job_is_built_as_its_plans_threads_need():
    """A job with a plan of more than 256 threads (registers that can break 64K) is the optimized build, and its
    registers are checked; a job of smaller plans is the fast build. One thread more is enough."""
    plan = next(p for p in PLANS["sm_80"] if p.file == "flash_v2_forward_tc.cu")
    small = _jobs({"sm_80": [plan]})
    big = _jobs({"sm_80": [plan._replace(threads=OPTIMIZED_ABOVE_THREADS + 1)]})
    assert [job.optimized for job in small + big] == [False, True]


def test_the_limit_check_fails_on_a_plan_over_the_limit():
    """The check above is not vacuous: a pipelined d=128 plan at Br = 128 (102 KB) is refused on sm_86 (99 KB)."""
    big = flash_v2.tc.Config(4, 2, 64, 64, 2, True)
    name = flash_v2.tc.instantiation("pipelined", "__half", "__half", 128, big)
    plan = device.KernelPlan("flash_v2_forward_pipelined.cu", {}, name, flash_v2.tc.smem_bytes("pipelined", 128, big),
                             0, big.threads)
    problems = _problems({"sm_86": [plan]})
    assert problems and "shared memory" in problems[0][2]


def test_the_register_check_reads_each_architectures_own_report_above_256_threads():
    """Registers x threads is checked against each member's own ptxas report where it can bind: the same kernel
    (over 128 registers a thread) claimed at 512 threads breaks the 64K registers of a block on sm_80 and on sm_86,
    which shares sm_80's PTX; at 128 threads it is within them on both."""
    name = "flash_v2_forward_tc<__half,__half,128,64,4>"
    plans = {a: [device.KernelPlan("flash_v2_forward_tc.cu", {}, name, 0, 0, threads)]
             for a, threads in (("sm_80", 128), ("sm_86", 512))}
    assert [(arch, "registers" in why) for arch, _, why in _problems(plans)] == [("sm_86", True)]
    plans["sm_80"] = [plans["sm_80"][0]._replace(threads=512)]
    assert sorted(arch for arch, _, why in _problems(plans) if "registers" in why) == ["sm_80", "sm_86"]


def test_architectures_of_one_ptx_family_get_the_same_ptx():
    """What sharing the PTX rests on. The families split where the sources and the CUDA headers test __CUDA_ARCH__
    (sm_75 | sm_80, sm_86, sm_89 | sm_90: cuda_bf16.hpp tests sm_90), and NVRTC's PTX for the members of a family is
    the same but for its .target line: here for a module of stage 02."""
    assert kernel_resources.ptx_families("flash_v2_forward_tc.cu", list(device.ARCHS)) == [
        ["sm_75"], ["sm_80", "sm_86", "sm_89"], ["sm_90"]]
    assert (">=", 800) in kernel_resources.arch_tests("flash_v2_forward_tc.cu")
    name = ["flash_v2_forward_tc<__half,__half,64,64,4>"]
    ptx = {a: kernels._compile("flash_v2_forward_tc.cu", a, (), name, verbose=False)[0]
           for a in ("compute_80", "compute_86", "compute_89")}
    bodies = {a: [line for line in (p if isinstance(p, bytes) else p.encode()).splitlines()
                  if not line.startswith((b".target", b"//"))] for a, p in ptx.items()}
    assert bodies["compute_80"] == bodies["compute_86"] == bodies["compute_89"]


def test_an_unknown_architecture_test_gives_each_architecture_its_own_ptx(tmp_path, monkeypatch):
    """A __CUDA_ARCH__ compared with anything but a number (a macro, say) leaves the families unknown: one each."""
    (tmp_path / "odd.cu").write_text('#include "odd.cuh"\n')
    (tmp_path / "odd.cuh").write_text("#define NEW 1000\n#if __CUDA_ARCH__ >= NEW\n#endif\n")
    monkeypatch.setattr(kernels, "KERNELS_DIR", tmp_path)
    kernel_resources.arch_tests.cache_clear()
    try:
        assert kernel_resources.arch_tests("odd.cu") is None
        assert kernel_resources.ptx_families("odd.cu", ["sm_86", "sm_80"]) == [["sm_80"], ["sm_86"]]
        (tmp_path / "odd.cuh").write_text('// __CUDA_ARCH__ in a comment\nconst char* s = "__CUDA_ARCH__";\n'
                                          "#if __CUDA_ARCH__ >= 860\n#endif\n")
        kernel_resources.arch_tests.cache_clear()
        assert kernel_resources.arch_tests("odd.cu") == ((">=", 860),)
        assert kernel_resources.ptx_families("odd.cu", ["sm_89", "sm_80", "sm_86"]) == [["sm_80"], ["sm_86", "sm_89"]]
        monkeypatch.setattr(kernels, "_cuda_include_dirs", lambda: [])  # the CUDA headers' tests unread: unknown
        kernel_resources.arch_tests.cache_clear()
        assert kernel_resources.arch_tests("odd.cu") is None
    finally:
        kernel_resources.arch_tests.cache_clear()


@pytest.mark.slow  # eight compiles
def test_ptxas_reports_what_nvrtcs_own_compile_reports(monkeypatch):
    """resource_usages through ptxas (one PTX for sm_80, sm_86, sm_89) and without it (an NVRTC compile each) give
    resource_usage's report for every architecture, kernel by kernel; the members' static shared memory is the
    same, and so is the fast build's (FAST_BUILD), which the limit check reads for plans of at most 256 threads."""
    names = ["flash_v2_forward_tc<__half,__half,64,64,4>", "flash_v2_forward_tc<__half,float,128,64,4>"]
    archs = ("sm_80", "sm_86", "sm_89")
    want = {a: kernel_resources.resource_usage("flash_v2_forward_tc.cu", arch=a, name_expressions=names)
            for a in archs}
    for n in names:  # what the members of a family share (the limit check reads it from the first member's report)
        assert want["sm_80"][n]["static_smem"] > 0
        assert want["sm_86"][n]["static_smem"] == want["sm_89"][n]["static_smem"] == want["sm_80"][n]["static_smem"]
    assert kernel_resources.ptxas() is not None, ("no ptxas of NVRTC's release (requirements.txt: "
                                                  "nvidia-cuda-nvcc-cu12)")
    assert kernel_resources.resource_usages("flash_v2_forward_tc.cu", {a: names for a in archs}) == want
    assert kernel_resources.resource_usages("flash_v2_forward_tc.cu", {"sm_86": names[:1]}) == {
        "sm_86": {names[0]: want["sm_86"][names[0]]}}  # --entry: only the kernels asked for
    fast = FastBuilds.usages("flash_v2_forward_tc.cu", {"sm_80": names}, {})["sm_80"]
    assert {n: fast[n]["static_smem"] for n in names} == {n: want["sm_80"][n]["static_smem"] for n in names}
    monkeypatch.setattr(kernel_resources, "ptxas", lambda: None)
    assert kernel_resources.resource_usages("flash_v2_forward_tc.cu", {"sm_86": names}) == {"sm_86": want["sm_86"]}


def test_a_fast_build_leaves_this_processs_compiles_as_they_were():
    """The fast builds run in FastBuilds' process: this process's optimized PTX of a kernel (one whose PTX and registers
    change after an in-process fast compile, with NVRTC 12.9) is the same after a fast build as before it."""
    name = ["flash_v2_forward_tc<__half,__half,64,64,4>"]
    before = kernels._compile("flash_v2_forward_tc.cu", "compute_86", (), name, verbose=False)[0]
    assert FastBuilds.usages("flash_v2_forward_tc.cu", {"sm_86": name}, {})["sm_86"][name[0]]["static_smem"] > 0
    assert kernels._compile("flash_v2_forward_tc.cu", "compute_86", (), name, verbose=False)[0] == before


def test_resource_usage_reports_a_repeated_compile():
    """The limit checks read ptxas's report. NVRTC 12.9 and later may answer a compile it has already done from its
    cache, and a cached answer carries no report: the same check run twice in one process (or a second test run on
    the same machine) would find no kernel. resource_usage asks NVRTC for a fresh compile, so both calls report."""
    first = kernel_resources.resource_usage("hopper_probes.cu", arch="sm_90a")
    assert first and all(u["registers"] > 0 for u in first.values())
    assert kernel_resources.resource_usage("hopper_probes.cu", arch="sm_90a") == first


@pytest.mark.parametrize("arch", list(device.ARCHS))
def test_each_architecture_gets_plans_that_fit_it(arch):
    """The launchers' choices (no compile): every version that exists on arch has a plan there at every head dim;
    versions whose instructions arch lacks have none."""
    dev = device.emulate(arch)
    for D in flash_v2.head_dims("fp32"):
        cfg = flash_v2.fp32.config("fp32", D, dev)
        assert device.fits(dev, cfg.smem_bytes(D))
        assert flash_v2.fp32.overlap_fits(D, dev) or cfg.share_kv  # "auto": fp32_overlap, else fp32's SHARE_KV tiles
    assert all(flash_v2.fp32.overlap_fits(D, dev) for D in (1, 64, 128)) == (arch != "sm_75")  # a T4 at d = 128
    # the 16-bit tensor-core versions run on every architecture (fp16 from sm_75, bf16 from sm_80); only a T4's
    # 64 KB leaves out d = 256
    small = dev.smem_optin < 99 * 1024
    for version in ("tc", "pipelined"):
        for D in flash_v2.head_dims(version):
            assert bool(flash_v2.tc.reachable(version, D, dev)) == (not small or D < 256)
    assert ("__nv_bfloat16" in flash_v2.tc.input_ctypes(dev)) == dev.arch.bf16
    for D in flash_v2_backward.HEAD_DIMS["tc"]:
        if not small or D < 256:
            tiles = flash_v2_backward.tc_tiles(D, dev)
            assert device.fits(dev, flash_v2_backward.smem_bytes("tc", D, *tiles)[0])
        else:
            with pytest.raises(device.UnsupportedDevice, match="shared memory"):
                flash_v2_backward.tc_tiles(D, dev)
    # the 3xTF32 backward: every head dim where TF32 mma exists (sm_80 on), none before
    x3 = [p for p in flash_v2_backward.kernel_plans(dev) if p.file == "flash_v2_backward_fp32x3.cu"]
    assert len(x3) == (len(flash_v2_backward.HEAD_DIMS["fp32x3"]) if dev.arch.cc >= 80 else 0)
    assert all(device.fits(dev, p.dynamic_smem) for p in x3)


def test_emulated_architectures_and_clear_errors(monkeypatch):
    assert device.emulate("sm_86").smem_optin == 99 * 1024
    with pytest.raises(ValueError, match="choose one of"):
        device.emulate("sm_61")
    t4 = device.emulate("sm_75")
    with pytest.raises(device.UnsupportedDevice, match="sm_80 or newer.*bfloat16.*instead"):
        device.require(t4, ("mma_k16", "bf16"), what="x", instead="instead, use y")
    with pytest.raises(device.UnsupportedDevice, match="64 KB"):
        device.pick([1, 2], lambda c: 100 * 1024, t4, what="x")
    assert device.arch_for(87).name == "sm_86" and device.arch_for(120).name == "sm_90"
    with pytest.raises(device.UnsupportedDevice, match="sm_75"):
        device.arch_for(70)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_86"])
def test_emulated_architecture_runs_its_own_code(arch, monkeypatch):
    """On a GPU, under ATTN_ARCH: the kernels are compiled for the emulated architecture (PTX for compute_XX, which
    the driver translates for this GPU), so sm_75's paths run: fp16 on tensor cores through m16n8k8 pairs and
    synchronous copies, forward (tc, pipelined) and backward, within the tolerance rule. bf16 is refused there with
    an error that names sm_80 and float16, before any launch; elsewhere it runs."""
    import cupy

    from stages.common import bfloat16, check_backward, check_forward, kernels, make_inputs

    monkeypatch.setenv("ATTN_ARCH", arch)
    assert kernels._emulated_cc() == device.emulate(arch).arch.cc
    name = "flash_v2_forward_tc<__half,__half,64,64,4>"
    module = kernels.load_module("flash_v2_forward_tc.cu", name_expressions=(name,))
    assert isinstance(module, kernels._TargetModule)
    q, k, v = make_inputs(1, 2, 64, 64, 64, dtype=bfloat16, xp=cupy)
    if arch == "sm_75":
        with pytest.raises(device.UnsupportedDevice, match="sm_80.*float16"):
            flash_v2.forward(q, k, v)
        with pytest.raises(device.UnsupportedDevice, match="sm_80.*float16"):
            flash_v2_backward.backward(q, k, v, q, cupy.zeros((1, 2, 64), np.float32), q)
    else:
        o, _ = flash_v2.forward(q, k, v)
        assert bool(cupy.isfinite(o.astype(np.float32)).all())
    q, k, v, do = make_inputs(1, 2, 200, 136, 64, dtype=np.float16, xp=cupy, grad=True)
    for version in ("tc", "pipelined"):
        check_forward(flash_v2.forward, q, k, v, causal=True, version=version)
    check_backward(flash_v2_backward.backward, q, k, v, do, causal=True, version="tc")


def test_a_header_edit_changes_the_compiled_source(tmp_path):
    """CuPy caches compiled modules by source text: the text of a .cu file must change when a header it includes
    does (kernels._source appends the headers' digest), or an edited header would run from a stale cached module."""
    import shutil

    work = tmp_path / "kernels"
    shutil.copytree(kernels.KERNELS_DIR, work)
    before = kernels._source("flash_v2_forward_pipelined.cu", work)
    assert before.startswith((work / "flash_v2_forward_pipelined.cu").read_text())
    assert kernels._source("flash_v2_forward_pipelined.cu", work) == before
    header = work / "common.cuh"
    header.write_text(header.read_text() + "\n// an edit\n")
    assert kernels._source("flash_v2_forward_pipelined.cu", work) != before


def test_a_launch_writes_each_scalar_into_the_low_bytes_of_its_slot():
    """kernels.Launch hands cuLaunchKernel one 8-byte slot per argument, and the driver reads as many bytes from a
    slot as the parameter has: a 4-byte int or float must sit in the low bytes (little-endian), bit for bit."""
    assert kernels.scalar_slot(np.int32(-5)) == 0xFFFFFFFB
    assert kernels.scalar_slot(np.uint32(7)) == 7
    assert kernels.scalar_slot(np.float32(1.5)) == 0x3FC00000  # the float's bits, not int(1.5)
    assert kernels.scalar_slot(np.int64(-1)) == 2**64 - 1
    assert kernels.scalar_slot(np.uint64(2**40 + 3)) == 2**40 + 3
    for bad in (5, 1.5, np.complex128(1)):  # Python numbers carry no C type; 16 bytes fit no slot
        with pytest.raises(TypeError, match="numpy scalar of at most 8 bytes"):
            kernels.scalar_slot(bad)


def test_a_launch_plan_lays_out_array_slots_then_scalar_slots():
    """The slots of a launch with 3 arrays and 2 scalars: 3 array slots (written per call), then the scalars (written
    once), and the parameter array holds each slot's address, in order."""
    launch = kernels.Launch(None, (4, 2), (128,), 0, (np.int32(9), np.float32(-2.0)))
    assert launch.grid == (4, 2, 1) and launch.block == (128, 1, 1)
    values, pointers, params, _ = launch._slots_for(3)
    assert values.dtype == np.uint64 and values.size == 5
    assert values[3] == 9 and values[4] == kernels.scalar_slot(np.float32(-2.0))
    assert list(pointers) == [values.ctypes.data + 8 * i for i in range(5)]
    assert params == pointers.ctypes.data
    assert launch._slots_for(3)[0] is values  # made once per number of arrays
    seeded = launch.with_scalars((np.int32(1), np.float32(0.5)))
    assert seeded._slots_for(3)[0][3] == 1 and launch._slots_for(3)[0][3] == 9
