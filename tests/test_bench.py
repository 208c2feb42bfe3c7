"""dev/bench.py and dev/bench_report.py on the CPU: the CSV -> table/markdown/plot path, and a clear
exit when there is no GPU. The CSV here is SYNTHETIC (made-up TFLOP/s, GPU "synthetic-gpu"): it only
exercises the report code and is never a measurement.
"""
import csv
import importlib.util
import pathlib
import subprocess
import sys

import pytest

from stages.common import has_gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    """dev/<name>.py as a module, with dev/ on sys.path as when it runs as a script (bench.py imports bench_report),
    whichever test of this file runs first."""
    if str(ROOT / "dev") not in sys.path:
        sys.path.insert(0, str(ROOT / "dev"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "dev" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = _load("bench_report")

# SYNTHETIC numbers, chosen so the ratios are easy to check by hand.
SYNTHETIC_GPU = "synthetic-gpu (not a measurement)"


def _synthetic_rows():
    rows = []

    def add(direction, impl, version, dtype, causal, d, n, tflops, status="ok"):
        b = 16384 // n
        rows.append(dict(gpu=SYNTHETIC_GPU, direction=direction, impl=impl, version=version, dtype=dtype,
                         causal=causal, head_dim=d, seq_len=n, batch=b, heads=16,
                         ms=None if status != "ok" else 1.0, tflops=None if status != "ok" else tflops,
                         status=status))

    for n in (1024, 4096, 8192):
        add("fwd", "ours", "tc", "bf16", False, 64, n, 200.0)
        add("fwd", "ours", "pipelined", "bf16", False, 64, n, 270.0)
        add("fwd", "torch", "flash", "bf16", False, 64, n, 300.0)
        add("fwd", "torch", "cudnn", "bf16", False, 64, n, 450.0)
        add("bwd", "ours", "tc", "bf16", True, 128, n, 100.0)
        add("bwd", "ours", "tc-det", "bf16", True, 128, n, 80.0, status="mismatch: dq max error 1e-1 > bound 1e-2")
        add("bwd", "torch", "flash", "bf16", True, 128, n, 200.0)
        add("bwd", "torch", "cudnn", "bf16", True, 128, n, 0.0, status="error: RuntimeError: No available kernel")
    add("fwd", "ours", "fp32_overlap", "fp32", False, 64, 4096, 30.0)
    add("fwd", "ours", "fp32x3", "fp32", False, 64, 4096, 50.0)
    add("fwd", "torch", "efficient", "fp32", False, 64, 4096, 25.0)
    add("fwd", "ours", "pipelined", "fp16", True, 64, 4096, 0.0, status="missing: stages.flash_v2 does not import")
    return rows


@pytest.fixture
def csv_path(tmp_path):
    path = tmp_path / "bench.csv"
    report.write_csv(path, _synthetic_rows())
    return path


def test_csv_round_trip(csv_path):
    rows = report.read_csv(csv_path)
    assert csv_path.read_text().splitlines()[0] == ",".join(report.COLUMNS)
    assert len(rows) == len(_synthetic_rows())
    r = rows[0]
    assert r["causal"] is False and r["head_dim"] == 64 and r["seq_len"] == 1024 and r["batch"] == 16
    assert r["tflops"] == 200.0
    missing = [x for x in rows if x["status"].startswith("missing")]
    assert missing and missing[0]["tflops"] is None and missing[0]["ms"] is None


def test_csv_provenance_columns_are_kept_and_older_csvs_read(tmp_path):
    """bench.py writes provenance and error/bound columns; the tables ignore them, and a CSV with only the base
    columns (the committed ones) still reads."""
    rows = [dict(r, git_commit="abc1234", driver="12080", cuda_runtime="12080", cupy="14.0.0", torch="2.11.0",
                 date="2026-01-01T00:00:00+00:00", err_over_bound="0.5", err_output="o") for r in _synthetic_rows()]
    path = tmp_path / "new.csv"
    report.write_csv(path, rows)
    back = report.read_csv(path)
    assert back[0]["git_commit"] == "abc1234" and back[0]["err_over_bound"] == "0.5"
    assert report.markdown(back) == report.markdown(_synthetic_rows())
    old = tmp_path / "old.csv"
    first = next(csv.reader(path.read_text().splitlines()[1:2]))
    old.write_text(",".join(report.BASE_COLUMNS) + "\n" + ",".join(first[:len(report.BASE_COLUMNS)]) + "\n")
    assert len(report.read_csv(old)) == 1


def test_the_old_name_of_the_float32_forward_is_read_as_today_s(tmp_path):
    """Before stage 02 kept the paper's plain loop as version "fp32", "fp32" named its optimised float32 forward,
    which is "fp32_overlap" now (what bench.py times): an old CSV's forward "fp32" rows read as "fp32_overlap"; a CSV
    that has "fp32_overlap" keeps every name as written; backward "fp32" (stage 03's) is never renamed."""
    def row(direction, version, impl="ours"):
        return dict(gpu=SYNTHETIC_GPU, direction=direction, impl=impl, version=version, dtype="fp32", causal=False,
                    head_dim=64, seq_len=1024, batch=16, heads=16, ms=1.0, tflops=10.0, status="ok")

    old = [row("fwd", "fp32"), row("fwd", "fp32x3"), row("bwd", "fp32"), row("fwd", "efficient", "torch")]
    new = [row("fwd", "fp32"), row("fwd", "fp32_overlap"), row("bwd", "fp32")]
    for rows, want in ((old, ["fp32_overlap", "fp32x3", "fp32", "efficient"]), (new, ["fp32", "fp32_overlap", "fp32"])):
        path = tmp_path / "x.csv"
        report.write_csv(path, rows)
        assert [r["version"] for r in report.read_csv(path)] == want


def test_csv_with_wrong_columns_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("gpu,impl,tflops\nx,ours,1\n")
    with pytest.raises(ValueError, match="not the bench CSV"):
        report.read_csv(bad)


def test_timing_modes_table():
    """The queued/synced table: ratios are PyTorch's time over ours in each mode, host time per call is shown, and
    the summary names the worst config of each mode (SYNTHETIC numbers)."""
    rows = []
    for n, ours_synced in ((512, 1.25), (4096, 1.05)):
        for impl, version, ms, synced, host in (("ours", "pipelined", 1.0, ours_synced, 15.0),
                                                ("torch", "flash", 1.1, 1.1, 40.0)):
            rows.append(dict(gpu=SYNTHETIC_GPU, direction="fwd", impl=impl, version=version, dtype="bf16",
                             causal=False, head_dim=64, seq_len=n, batch=16384 // n, heads=16, ms=ms, tflops=1.0,
                             ms_synced=synced, host_us=host, status="ok"))
    md = report.modes_markdown(rows)
    assert "| bf16 | no | 64 | 512 | 1.10 | 0.88 | - | - | 15 / 40 | - |" in md
    assert "| bf16 | no | 64 | 4096 | 1.10 | 1.05 | - | - | 15 / 40 | - |" in md
    assert "forward pipelined/flash, synced: min **0.88** (bf16 non-causal d=64 N=512)" in md
    assert "forward pipelined/flash, queued: min **1.10**" in md
    assert "forward pipelined: host time per call 15 to 15 us (PyTorch flash, same run: 40 to 40 us)" in md
    assert report.modes_markdown([dict(r, ms_synced=None) for r in rows]) == ""  # older CSVs: no table


def test_markdown_ratios_and_exclusions(csv_path):
    md = report.markdown(report.read_csv(csv_path), min_seq=4096)
    lines = md.splitlines()
    assert SYNTHETIC_GPU in md
    fwd = [ln for ln in lines if ln.startswith("| bf16 | no | 64 |")]
    assert [ln.split(" | ")[3] for ln in fwd] == ["4096", "8192"]  # N = 1024 is below --min-seq
    cells = [c.strip() for c in fwd[0].strip("|").split("|")]
    # ours tc, ours pipelined, torch flash, torch cudnn, tc/flash, pipelined/flash, tc/cudnn, pipelined/cudnn
    assert cells[5:] == ["200.0", "270.0", "300.0", "450.0", "0.67", "0.90", "0.44", "0.60"]
    bwd = [ln for ln in lines if ln.startswith("| bf16 | yes | 128 | 4096")][0]
    cells = [c.strip() for c in bwd.strip("|").split("|")]
    # the mismatch and the error show their status and never enter a ratio
    assert cells[5:9] == ["100.0", "mismatch", "200.0", "error"]
    assert cells[9:] == ["0.50", "-", "-", "-"]
    assert "forward pipelined/flash at N >= 4096: min 0.90" in md
    assert "backward tc-det/flash" not in md
    header = [ln for ln in lines if ln.startswith("| dtype") and "efficient" in ln][0]
    assert [c.strip() for c in header.strip("|").split("|")][5:] == [
        "ours fp32_overlap", "ours fp32x3", "torch efficient", "fp32_overlap/efficient", "fp32x3/efficient"]
    fp32 = [ln for ln in lines if ln.startswith("| fp32 | no | 64 | 4096")][0]
    cells = [c.strip() for c in fp32.strip("|").split("|")]
    assert cells[5:] == ["30.0", "50.0", "25.0", "1.20", "2.00"]  # ours / torch efficient = 30 / 25, 50 / 25
    assert "forward fp32x3/efficient at N >= 4096: min 2.00" in md
    assert "| fp16 | yes | 64 | 4096 | 4 x 16 | - | missing |" in md


def test_text_table_names_the_gpu_and_keeps_small_n(csv_path):
    txt = report.text(report.read_csv(csv_path))
    assert txt.splitlines()[0].startswith(f"GPU: {SYNTHETIC_GPU}")
    assert "1024" in txt and "forward, bf16/fp16" in txt and "backward, bf16/fp16" in txt


def test_plots_are_pngs(csv_path, tmp_path):
    paths = report.plots(report.read_csv(csv_path), tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == ["bench_backward.png", "bench_forward.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bench_markdown_mode_needs_no_gpu(csv_path):
    proc = subprocess.run([sys.executable, str(ROOT / "dev/bench.py"), "--markdown", str(csv_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| bf16 | no | 64 | 8192 |" in proc.stdout


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU: the no-GPU exit path does not run here")
def test_bench_without_gpu_exits_with_a_message(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "dev/bench.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "needs a CUDA GPU" in proc.stderr or "PyTorch" in proc.stderr
    assert not (tmp_path / "bench.csv").exists()


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU: the no-GPU exit path does not run here")
@pytest.mark.parametrize("script, says", [("dev/profile_backward.py", "needs a CUDA GPU"),
                                          ("dev/backward_launches.py", "needs an sm_90 GPU"),
                                          ("dev/forward_grids.py", "needs an sm_90 GPU")])
def test_gpu_script_without_gpu_exits_with_a_message(tmp_path, script, says):
    out = tmp_path / "out.csv"
    proc = subprocess.run([sys.executable, str(ROOT / script), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert says in proc.stderr
    assert not out.exists()


def test_profile_backward_reads_ncus_units():
    """ncu's CSV gives each metric's unit (a duration in ns, us or ms; bytes with a prefix, per block): the script
    scales by the part before '/', and an unknown unit is an error, not a number in the wrong unit."""
    sys.path.insert(0, str(ROOT / "dev"))
    import profile_backward as pb

    assert pb._unit("ns", {"ns": 1e-6}) == 1e-6
    assert pb._unit("Kbyte/block", {"Kbyte": 1e3}) == 1e3
    with pytest.raises(SystemExit, match="unit 'furlong'"):
        pb._unit("furlong", {"ns": 1e-6})


def test_warm_up_lasts_a_fixed_time_and_waits_for_every_call():
    """bench.settle calls fn, waiting for the GPU after each call, until settle_ms have passed on its clock, and at
    least min_calls times: a long call settles in min_calls calls, a short one in settle_ms / its time."""
    bench = _load("bench")
    t, log = [0.0], []

    class Cupy:
        class cuda:
            class Device:
                def synchronize(self):
                    log.append("sync")

    def call(ms):
        def fn():
            log.append("call")
            t[0] += ms / 1e3
        return fn

    assert bench.settle(call(0.5), Cupy, settle_ms=200.0, now=lambda: t[0]) == 400
    assert log[:4] == ["call", "sync", "call", "sync"] and len(log) == 800
    assert bench.settle(call(150.0), Cupy, settle_ms=200.0, now=lambda: t[0]) == 2
    assert bench.settle(call(500.0), Cupy, settle_ms=200.0, now=lambda: t[0]) == 2  # min_calls
    assert bench.settle(call(500.0), Cupy, settle_ms=200.0, min_calls=1, now=lambda: t[0]) == 1


def test_rounds_default_to_one_and_must_be_positive(capsys):
    """bench.py --rounds: how many times a config's implementations take turns at being timed (1 unless asked);
    0 or less is refused with a message that names the option."""
    bench = _load("bench")
    assert bench.parse([]).rounds == 1 and bench.parse(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        bench.parse(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_the_report_reads_the_rounds_from_the_runs_command():
    """The tables say how many turns a run took from its sources.csv command (--rounds R), 1 when it has none."""
    report = _load("bench_report")
    assert report.rounds_of({"command": "python3 dev/bench.py --direction bwd --rounds 3 --no-plots"}) == 3
    assert report.rounds_of({"command": "python3 dev/bench.py --rounds 12"}) == 12
    assert report.rounds_of({"command": "python3 dev/bench.py --direction fwd --no-plots"}) == 1


def test_host_time_table_sums_the_backwards_floor(tmp_path):
    """dev/host_time.py's CSV -> the table, and the sum of the pieces a repeated backward cannot leave out
    (counted as BACKWARD_FLOOR says); without one of the pieces there is no sum."""
    steps = {"backward": 30.0, "call_key": 2.0, "pool allocation": 1.0, "array object": 1.5,
             "cuLaunchKernel, GPU idle": 3.0, "cuLaunchKernel, GPU busy": 9.0}
    rows = [dict(step=k, what=f"about {k}", us_median=f"{v:.2f}", us_min=f"{v - 0.5:.2f}", samples="15 x 200",
                 problem="B=1 H=2 N=128 d=128 bf16 causal", git_commit="abc1234") for k, v in steps.items()]

    def table(rows):
        path = tmp_path / "host_time.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        return report.host_time_table(path, {"gpu": "GPU X", "command": "python dev/host_time.py"})

    text = table(rows)
    assert "| cuLaunchKernel, GPU busy | about cuLaunchKernel, GPU busy | 9.0 | 8.5 |" in text
    assert "= **14.5 us** of its 30.0 us" in text  # 2 + 2 x 1 + 3 x 1.5 + 2 x 3
    assert "**" not in table([r for r in rows if r["step"] != "array object"])


# ---- the committed results text is generated from results/*.csv (real measurements, not the synthetic rows above)

def test_generated_results_match_the_committed_text():
    """README.md's results and GPU sections and results/README.md are exactly what the generator makes from
    results/*.csv and the launchers: a number in them that no CSV holds, or a stale table, fails here."""
    stale = [str(p.relative_to(ROOT)) for p in report.stale(ROOT)]
    assert not stale, f"{stale} differ from what `python dev/bench_report.py --write` generates: run it"


def test_every_results_csv_has_a_source():
    """Each CSV in results/ has a row in results/sources.csv (GPU, software, command, code), and each row a file."""
    sources = report.read_sources(ROOT / "results")
    named = {s["file"] for s in sources}
    present = {p.name for p in (ROOT / "results").glob("*.csv")} - {"sources.csv"}
    assert named == present
    for s in sources:
        assert s["gpu"] and s["command"] and s["code"], s


def test_every_results_csv_names_the_commits_and_gpus_of_its_rows():
    """Each sources.csv row names every commit (git_commit / commit column) and every GPU (gpu column) its CSV's rows
    carry (dev/bench_report.py's provenance_problems; --check runs it too)."""
    problems = report.provenance_problems(ROOT / "results")
    assert not problems, "\n".join(problems)


def test_the_provenance_check_catches_a_row_that_names_other_code_or_gpus(tmp_path):
    """A sources.csv row that names another commit or GPU than its rows carry fails; a short hash names a full one;
    a -dirty commit must be said; a row's GPU may add words after the model (an emulated architecture)."""
    def problems(code, gpu, note="", commit="abc1234def5678"):
        (tmp_path / "x.csv").write_text(f"gpu,git_commit,ms\nNVIDIA H200 running the sm_75 configurations (ATTN_ARCH),"
                                        f"{commit},1.0\nNVIDIA H200,{commit},2.0\n")
        with open(tmp_path / "sources.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["file", "what", "gpu", "software", "command", "code", "note"])
            w.writeheader()
            w.writerow(dict(file="x.csv", what="w", gpu=gpu, software="s", command="c", code=code, note=note))
        return report.provenance_problems(tmp_path)

    assert problems("commit abc1234", "NVIDIA H200") == []
    assert problems("commit abc1234", "4 x NVIDIA H200") == []
    assert problems("commit 1111111", "NVIDIA H200") != []  # another commit
    assert problems("commit abc1234", "NVIDIA H100 80GB HBM3") != []  # another GPU
    assert problems("commit abc1234", "NVIDIA H200", commit="abc1234-dirty") != []  # changes not said
    assert problems("commit abc1234", "NVIDIA H200", note="rows read abc1234-dirty: ...", commit="abc1234-dirty") == []


def test_generator_check_mode_catches_a_stale_readme(tmp_path):
    """--check's comparison fails on an edited number inside the generated section."""
    import shutil

    shutil.copytree(ROOT / "results", tmp_path / "results")
    for stage in ("04_ring", "05_train_gpt", "06_hopper"):  # the stage READMEs with generated tables
        (tmp_path / "stages" / stage).mkdir(parents=True)
        shutil.copy(ROOT / "stages" / stage / "README.md", tmp_path / "stages" / stage / "README.md")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "DESIGN.md", tmp_path / "docs" / "DESIGN.md")  # its catch table is generated too
    text = (ROOT / "README.md").read_text()
    begin, end = report.MARKERS["results"]
    inside = text.split(begin, 1)[1].split(end, 1)[0]
    (tmp_path / "README.md").write_text(text.replace(inside, inside.replace("**0.", "**9.", 1)))
    assert [p.name for p in report.stale(tmp_path)] == ["README.md"]
