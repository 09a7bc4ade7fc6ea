"""The benchmarks' result files (benchmarks/common.write_result) and the maintained tools' command lines, on the
CPU: what a run writes, what it refuses, and that every tool imports and answers --help through public APIs."""

import ast
import dataclasses
import datetime
import importlib
import json
import math
import subprocess
from pathlib import Path

import pytest

from benchmarks import bench_gemm, common, plot_decode

BENCHMARKS = Path(common.__file__).resolve().parent
TOOLS = ["audit_picks", "audit_sweep", "bench_decode_chain", "bench_decode_options", "bench_gemm",
         "bench_linear_stack", "bench_quantize", "bench_quantize_scaled_mm", "bench_sweep", "bench_weight_only",
         "host_cost", "measure_floor", "plot_decode", "profile_kernels", "sanitize_calls", "tune_tiles"]
RESULT_WRITERS = ["bench_decode_chain", "bench_decode_options", "bench_gemm", "bench_linear_stack", "bench_quantize",
                  "bench_quantize_scaled_mm", "bench_sweep", "bench_weight_only", "host_cost", "measure_floor"]
#: an H200's floors, as benchmarks.measure_floor records them
H200 = common.Floors(gpu="NVIDIA H200", hbm_tbps=4.33, fp8_tflops=1346.0, launch_us=3.8, stream_fixed_us=9.3)


@pytest.fixture
def floors(monkeypatch):
    """``common.measured_floors()`` answers ``H200`` (no GPU here)."""
    monkeypatch.setattr(common, "measured_floors", lambda: H200)
    return H200


def test_write_result_fills_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", [str(BENCHMARKS / "bench_gemm.py"), "--sets", "dsv3", "--recipes", "tensor,row"])
    columns = ["recipe", "M", "N", "K", "ours us", "cuBLAS us", "ratio", "TFLOPS", "% of 1979"]
    rows = [["row", 1024, 1536, 7168, 12.3, 14.1, 1.146, 1833.2, 92.6],
            ["128x128_128x128", 1024, 1536, 7168, 13.0, float("nan"), float("nan"), 1734.5, 87.6]]
    path = common.write_result("gemm_dsv3", "FP8 GEMM, DeepSeek-V3 shapes", columns, rows,
                               summary={"geomean ratio row": 1.146}, notes="one line", out_dir=tmp_path)
    assert path == tmp_path / "gemm_dsv3.json"
    got = json.loads(path.read_text())  # strict JSON: NaN would not parse in other readers
    assert list(got) == ["name", "title", "command", "gpu", "gpu_facts", "date", "versions", "run_s", "notes",
                         "columns", "rows", "summary"]
    assert got["name"] == "gemm_dsv3" and got["title"] == "FP8 GEMM, DeepSeek-V3 shapes"
    assert got["command"] == "python -m benchmarks.bench_gemm --sets dsv3 --recipes tensor,row"
    assert got["gpu"] == "no GPU"  # this machine; torch.cuda.get_device_name() on one
    assert got["gpu_facts"] == dict.fromkeys(common.GPU_FACTS)  # nothing known without a GPU, and no crash
    assert isinstance(got["run_s"], int) and got["run_s"] >= 0
    assert got["date"] == datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert set(got["versions"]) == {"torch", "cutlass_dsl", "cuda"}
    assert all(isinstance(v, str) and v for v in got["versions"].values())
    assert got["notes"] == "one line" and got["columns"] == columns
    assert got["rows"][0] == rows[0]
    assert got["rows"][1][5] is None and got["rows"][1][6] is None  # a cuBLAS refusal: null, not NaN
    assert got["summary"] == {"geomean ratio row": 1.146}
    assert "NaN" not in path.read_text()


def test_write_result_overwrites_and_omits_an_empty_summary(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["/somewhere/else/tool", "--x", "a b"])
    common.write_result("quantize", "first", ["a"], [[1]], out_dir=tmp_path)
    path = common.write_result("quantize", "second", ["a", "b"], [[1, True], [2, None]], out_dir=tmp_path)
    got = json.loads(path.read_text())
    assert got["title"] == "second" and got["rows"] == [[1, True], [2, None]] and "summary" not in got
    assert got["command"] == "tool --x 'a b'"  # not a benchmark module: the script as it was called
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantize.json"]


def test_write_result_defaults_to_benchmarks_results(tmp_path, monkeypatch):
    assert common.RESULTS_DIR == BENCHMARKS / "results" and BENCHMARKS.name == "benchmarks"
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")  # created on the first write
    path = common.write_result("host_cost", "t", ["a"], [[1.5]])
    assert path == tmp_path / "results" / "host_cost.json" and json.loads(path.read_text())["rows"] == [[1.5]]


@pytest.mark.parametrize("name", ["", "../up", "a/b", "has space", None])
def test_write_result_refuses_a_bad_name(tmp_path, name):
    with pytest.raises(ValueError, match="result name"):
        common.write_result(name, "t", ["a"], [[1]], out_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_write_result_refuses_a_row_of_the_wrong_width_or_cell_type(tmp_path):
    with pytest.raises(ValueError, match=r"row 1 .* has 1 cells, expected 2"):
        common.write_result("x", "t", ["a", "b"], [[1, 2], [3]], out_dir=tmp_path)
    with pytest.raises(TypeError, match="result cell"):
        common.write_result("x", "t", ["a"], [[object()]], out_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_save_and_name_options(tmp_path, monkeypatch):
    import argparse

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    p = argparse.ArgumentParser()
    common.add_result_options(p, "decode_chain")
    args = p.parse_args(["--no-save"])
    assert args.save is False and common.save_result(args, "decode_chain", "t", ["a"], [[1]]) is None
    args = p.parse_args(["--name", "chain_b"])
    assert args.save is True
    assert common.save_result(args, "decode_chain", "t", ["a"], [[1]]) == tmp_path / "chain_b.json"
    assert [p.name for p in tmp_path.iterdir()] == ["chain_b.json"]


def _gemm_row(set_name, recipe, m, n, k, ours_us, cublas_us, floors=H200):
    tf = common.tflops(m, n, k, ours_us / 1e3)
    gbs = common.gbps(m, n, k, ours_us / 1e3)
    return dict(set=set_name, recipe=recipe, m=m, n=n, k=k, ours_us=ours_us, cublas_us=cublas_us, bf16_us=2 * ours_us,
                ratio=cublas_us / ours_us, tflops=tf, pct_peak=common.pct_of_fp8_peak(tf, floors), gbps=gbs,
                pct_hbm=common.pct_of_hbm(gbs, floors))


def test_gemm_table_reports_tflops_or_bandwidth_against_the_measured_floors():
    big = _gemm_row("dsv3", "row", 6144, 7168, 2048, 100.0, 110.0)
    columns, rows = bench_gemm.result_table([big], ["dsv3"], H200)
    assert columns == ["recipe", "M", "N", "K", "ours us", "cuBLAS us", "ratio", "TFLOPS",
                       "% of 1346 TFLOPS (measured)", "BF16 us"]
    tf = 2 * 6144 * 7168 * 2048 / 100e-6 / 1e12
    assert rows == [["row", 6144, 7168, 2048, 100.0, 110.0, 1.1, round(tf, 1), round(100 * tf / 1346, 1), 200.0]]
    assert bench_gemm.result_table([big], ["dsv3"])[0][8] == "% of FP8 floor"  # no floors given: none named

    small = _gemm_row("decode", "tensor", 16, 8192, 8192, 25.0, 30.0)
    columns, rows = bench_gemm.result_table([small], ["decode"], H200)
    assert columns[-3:] == ["GB/s", "% of 4.33 TB/s (measured)", "BF16 us"]
    gbs = (16 * 8192 + 8192 * 8192 + 2 * 16 * 8192) / 25e-6 / 1e9
    assert rows[0][-3:] == [round(gbs), round(100 * gbs / 4330, 1), 50.0]

    columns, rows = bench_gemm.result_table([big, small], ["dsv3", "decode"])  # mixed: one set column, TFLOPS
    assert columns[0] == "set" and "TFLOPS" in columns and [r[0] for r in rows] == ["dsv3", "decode"]
    assert bench_gemm.default_name(["dsv3"], False) == "gemm_dsv3"
    assert bench_gemm.default_name(["decode"], True) == "gemm_decode_fast"
    assert common.SETS["decode"] == common.SETS["llama70b_decode"] + common.SETS["llama70b_layers"]
    assert all(m <= bench_gemm.DECODE_MAX_M for m, _, _ in common.SETS["decode"])


@pytest.mark.parametrize("argv, name, rate", [
    (["--sets", "dsv3", "--recipes", "tensor,1x128_128x128"], "gemm_dsv3", "TFLOPS"),
    (["--sets", "decode", "--recipes", "row"], "gemm_decode", "GB/s"),
    (["--sets", "square", "--recipes", "row", "--fast-accum", "--name", "fast_sq"], "fast_sq", "TFLOPS"),
])
def test_bench_gemm_run_writes_one_file_named_for_its_sets(tmp_path, monkeypatch, floors, argv, name, rate):
    """bench_gemm's main with the GPU measurement replaced: the run's rows, summary and file name."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr("sys.argv", [str(BENCHMARKS / "bench_gemm.py"), *argv])
    monkeypatch.setattr(bench_gemm, "measure_one", lambda s, m, n, k, recipe, check, fast: dict(
        _gemm_row(s, recipe, m, n, k, 10.0, 12.0), err=1e-3, cublas_err=1e-3, fast_accum=fast))
    bench_gemm.main(argv)
    got = json.loads((tmp_path / f"{name}.json").read_text())
    recipes = argv[3].split(",")
    assert [p.name for p in tmp_path.iterdir()] == [f"{name}.json"]
    assert len(got["rows"]) == len(common.SETS[argv[1]]) * len(recipes) and rate in got["columns"]
    assert got["summary"] == {f"geomean ratio {r}": 1.2 for r in recipes}
    assert got["command"] == "python -m benchmarks.bench_gemm " + " ".join(argv)
    assert "cuBLAS timed in the same run" in got["notes"]
    assert "floors measured on this GPU (benchmarks.measure_floor): HBM 4.33 TB/s, FP8 1346 TFLOPS" in got["notes"]
    assert any(c.startswith("% of ") and c.endswith(" (measured)") for c in got["columns"])
    assert ("use_fast_accum=True" in got["title"]) == ("--fast-accum" in argv)
    with pytest.raises(SystemExit):
        bench_gemm.main(["--sets", "nosuchset"])


def test_plot_decode_reads_bench_gemm_results(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", [str(BENCHMARKS / "bench_gemm.py")])
    rows = [_gemm_row("decode", "row", m, 8192, 8192, 20.0 + m, 25.0) for m in (1, 16, 128)]
    rows.append(_gemm_row("decode", "row", 16, 57344, 8192, 150.0, 160.0))  # another N: not in the plot
    columns, table = bench_gemm.result_table(rows, ["decode"])
    path = common.write_result("gemm_decode", bench_gemm.title(["decode"], False), columns, table, out_dir=tmp_path)
    got, gpu = plot_decode.decode_rows([path])
    assert gpu == "no GPU" and [r["M"] for r in got] == [1, 16, 128]
    assert [r["ours us"] for r in got] == [21.0, 36.0, 148.0] and all(r["cuBLAS us"] == 25.0 for r in got)
    fast = common.write_result("gemm_decode_fast", bench_gemm.title(["decode"], True), columns, table,
                               out_dir=tmp_path)
    assert plot_decode.decode_rows([fast]) == ([], None)  # fast accumulation is left out of the plot
    assert plot_decode.floor_tbps([path], "no GPU") is None  # no floor.json beside the file
    (tmp_path / "floor.json").write_text(json.dumps({**FLOOR_RECORD, "gpu": "no GPU"}))
    assert plot_decode.floor_tbps([path], "no GPU") == 4.33 and plot_decode.floor_tbps([path], "NVIDIA H200") is None
    other = tmp_path / "gemm_decode_h200.json"
    other.write_text(json.dumps({**json.loads(path.read_text()), "name": other.stem, "gpu": "NVIDIA H200"}))
    with pytest.raises(SystemExit, match="measured on different GPUs"):  # one plot never mixes GPUs
        plot_decode.decode_rows([path, other])


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_answers_help(tool, capsys):
    module = importlib.import_module(f"benchmarks.{tool}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and module.__doc__.splitlines()[0] in out
    if tool in RESULT_WRITERS:
        assert "--no-save" in out and "--name" in out


def _imports(tree):
    """(module, name) for every import in a module's AST, and the local names bound to cutedsl_gemm modules."""
    pairs, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                pairs.append((a.name, None))
                if a.name.startswith("cutedsl_gemm"):
                    bound.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                pairs.append((node.module, a.name))
                if node.module.startswith("cutedsl_gemm") and a.name[:1].islower():
                    bound.add(a.asname or a.name)
    return pairs, bound


def test_benchmarks_use_public_names_only():
    """No benchmark imports from tests/ or reaches a private (leading underscore) name of cutedsl_gemm."""
    files = sorted(BENCHMARKS.glob("*.py"))
    assert {f.stem for f in files} >= set(TOOLS) | {"common"}
    bad = []
    for f in files:
        tree = ast.parse(f.read_text())
        pairs, bound = _imports(tree)
        for module, name in pairs:
            if module.split(".")[0] in ("tests", "conftest") or module.split(".")[-1].startswith("test_"):
                bad.append(f"{f.name}: imports {module}")
            if module.startswith("cutedsl_gemm") and (
                    any(part.startswith("_") for part in module.split(".")) or (name or "").startswith("_")):
                bad.append(f"{f.name}: imports {module}.{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                bad.append(f"{f.name}:{node.lineno}: sys.path (imports from outside the package and benchmarks/)")
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{f.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert bad == []


FLOOR_RECORD = {
    "name": "floor", "gpu": "NVIDIA H200", "columns": ["measure", "unit", "value"],
    "rows": [["one-element kernel", "us", 3.8], ["read-only stream, at the margin", "TB/s", 4.33],
             ["read-only stream, fixed cost per call", "us", 9.3]],
    "summary": {"HBM TB/s at the margin": 4.33, "FP8 TFLOPS (cuBLAS, per tensor, fast accumulation)": 1346.0,
                "one-element kernel us": 3.8, "read-only stream fixed cost us per call": 9.3},
}


def test_floors_come_from_floor_json_of_this_gpu(tmp_path):
    path = tmp_path / "floor.json"
    with pytest.raises(common.FloorError, match=r"floor.json: missing; run `python -m benchmarks.measure_floor` on "
                                                r"this GPU \(NVIDIA H200\) first"):
        common.read_floors(path, "NVIDIA H200")
    path.write_text(json.dumps(FLOOR_RECORD))
    assert common.read_floors(path, "NVIDIA H200") == H200
    with pytest.raises(common.FloorError, match=r"measured on NVIDIA H200, not on this GPU \(NVIDIA H100 80GB HBM3\); "
                                                r"run `python -m benchmarks.measure_floor` on this GPU first") as e:
        common.read_floors(path, "NVIDIA H100 80GB HBM3")
    assert "\n" not in str(e.value)  # one line
    # a file written before the summary held all four floors: the rest come from its rows
    old = {**FLOOR_RECORD, "summary": {k: v for k, v in FLOOR_RECORD["summary"].items() if "TB/s" in k or "FP8" in k}}
    path.write_text(json.dumps(old))
    assert common.read_floors(path, "NVIDIA H200") == H200
    path.write_text(json.dumps({**FLOOR_RECORD, "summary": {}, "rows": []}))
    with pytest.raises(common.FloorError, match="no positive 'HBM TB/s at the margin'"):
        common.read_floors(path, "NVIDIA H200")
    path.write_text("{not json")
    with pytest.raises(common.FloorError, match="unreadable"):
        common.read_floors(path, "NVIDIA H200")


def test_the_repository_floor_file_reads_as_its_gpus():
    record = json.loads((common.RESULTS_DIR / "floor.json").read_text())
    floors = common.read_floors(common.RESULTS_DIR / "floor.json", record["gpu"])
    assert floors.gpu == record["gpu"] and all(x > 0 for x in dataclasses.astuple(floors)[1:])


def test_measured_floors_need_a_gpu_and_are_read_once(tmp_path, monkeypatch):
    common.measured_floors.cache_clear()
    with pytest.raises(common.FloorError, match="no CUDA GPU"):  # this machine
        common.measured_floors()
    with pytest.raises(SystemExit):  # a benchmark stops with the message, no traceback
        common.measured_floors()
    (tmp_path / "floor.json").write_text(json.dumps(FLOOR_RECORD))
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common, "gpu_name", lambda: "NVIDIA H200")
    assert common.measured_floors() == H200
    (tmp_path / "floor.json").unlink()
    assert common.measured_floors() is common.measured_floors()  # cached: the file is not read again
    common.measured_floors.cache_clear()
    with pytest.raises(common.FloorError, match="missing"):
        common.measured_floors()
    common.measured_floors.cache_clear()


def test_floors_name_themselves_and_convert(floors):
    assert (floors.hbm, floors.fp8) == ("4.33 TB/s (measured)", "1346 TFLOPS (measured)")
    assert floors.stream_us(4.33e6) == pytest.approx(1.0) and floors.mma_us(1346e6) == pytest.approx(1.0)
    assert math.isclose(common.pct_of_fp8_peak(673.0), 50.0) and math.isclose(common.pct_of_hbm(2165.0), 50.0)
    assert not hasattr(common, "FP8_TFLOPS") and not hasattr(common, "HBM_TBPS")  # no constant floors


def test_gpu_facts_from_nvidia_smi(monkeypatch):
    props = type("Props", (), {"multi_processor_count": 132, "uuid": "1234-abcd"})()
    monkeypatch.setattr(common.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(common.torch.cuda, "get_device_properties", lambda i: props)
    calls = []

    def smi(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "1980, 1980, 3201, 700.00, 580.159.04\n", "")

    monkeypatch.setattr(common.subprocess, "run", smi)
    assert common.gpu_facts() == {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "mem_clock_mhz": 3201,
                                  "power_limit_w": 700, "driver": "580.159.04", "sms": 132}
    assert calls[0][-2:] == ["-i", "GPU-1234-abcd"] and "--format=csv,noheader,nounits" in calls[0]

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(common.subprocess, "run", missing)
    assert common.gpu_facts() == {**dict.fromkeys(common.GPU_FACTS), "sms": 132}
    monkeypatch.setattr(common.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, "[N/A], 1980, [N/A], [N/A], 580.159.04\n", ""))
    assert common.gpu_facts()["max_sm_clock_mhz"] == 1980 and common.gpu_facts()["power_limit_w"] is None


@pytest.mark.parametrize("tool, argv", [
    ("measure_floor", []), ("bench_quantize", []), ("bench_linear_stack", []), ("bench_weight_only", []),
    ("bench_quantize_scaled_mm", []), ("bench_decode_chain", []), ("bench_decode_options", ["--what", "splits"]),
    ("bench_gemm", ["--e2e"]), ("bench_gemm", ["--shapes", "16x256x256"]), ("bench_sweep", ["--ms", "1"]),
    ("host_cost", []), ("tune_tiles", []), ("sanitize_calls", []), ("profile_kernels", ["--what", "grouped"]),
])
def test_without_a_gpu_a_benchmark_stops_with_one_line(tool, argv, capsys):
    if common.torch.cuda.is_available():
        pytest.skip("a GPU is here")
    module = importlib.import_module(f"benchmarks.{tool}")
    common.measured_floors.cache_clear()
    with pytest.raises(SystemExit) as done:
        module.main(argv)
    message = str(done.value.code)
    assert "GPU" in message and "\n" not in message, message


def _run_all(tmp_path, *argv, env=None):
    """benchmarks/run_all.sh with python and nvidia-smi replaced by scripts that print their arguments (and no
    floors recorded): (exit status, the benchmark commands it ran, its output)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "py").write_text('#!/bin/sh\necho "py $*"\n[ "$1" != "-c" ]\n')
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200, 700.00 W, 1980 MHz, 1980 MHz, 30'\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "PYTHON": "py", **(env or {})}
    done = subprocess.run(["bash", str(BENCHMARKS / "run_all.sh"), *argv], capture_output=True, text=True, env=env)
    commands = [line[len("py -m "):] for line in done.stdout.splitlines() if line.startswith("py -m benchmarks.")]
    return done.returncode, commands, done.stdout + done.stderr


def test_run_all_measures_the_floor_first_and_runs_every_result_writer(tmp_path):
    rc, commands, out = _run_all(tmp_path, "bench")
    assert rc == 0, out
    assert commands[0] == "benchmarks.measure_floor"
    modules = {c.split()[0].removeprefix("benchmarks.") for c in commands}
    recorded = {json.loads(p.read_text())["command"].split()[2].removeprefix("benchmarks.")
                for p in common.RESULTS_DIR.glob("*.json")}
    assert recorded <= modules, recorded - modules
    for name in ("gemm_int8", "gemm_int8_decode"):  # as their result files were produced
        command = json.loads((common.RESULTS_DIR / f"{name}.json").read_text())["command"]
        assert command.removeprefix("python -m ") in commands
    assert "benchmarks.bench_quantize_scaled_mm --ms 1,2,4,8,16,32" in commands


def test_run_all_runs_pieces_and_logs_each(tmp_path):
    rc, commands, out = _run_all(tmp_path, "bench-sweep", env={"LOG_DIR": str(tmp_path / "logs")})
    assert rc == 0, out
    # no floors recorded: the piece measures them first
    assert commands == ["benchmarks.measure_floor", "benchmarks.bench_sweep --precompile-only",
                        "benchmarks.bench_sweep"]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["bench-sweep.log"]
    assert (tmp_path / "logs" / "bench-sweep.log").read_text().startswith("== bench-sweep: NVIDIA H200, 700.00 W")
    rc, commands, out = _run_all(tmp_path, "nosuch")
    assert rc == 2 and commands == []
    assert "pieces: floor bench-gemm bench-ops bench-sweep bench-decode bench-models bench-moe" in out


def test_run_all_option_runs_time_both_ways_and_save_nothing(tmp_path):
    rc, commands, out = _run_all(tmp_path, "options-routing", "options-tiles")
    assert rc == 0, out
    commands = [c for c in commands if c != "benchmarks.measure_floor"]  # (no floors recorded: each measures them)
    assert all("--no-save" in c for c in commands)
    assert sum("--sort-routing" in c for c in commands) == 1
    grouped = [c for c in commands if c.startswith("benchmarks.bench_grouped")]
    # each wide tile against the narrow one, named in full, twice in turns: row-wise and per tensor at decode,
    # then 128x192 against 128x128 at prefill without clusters
    tiles = [(c.split("--tile-m ")[1].split()[0], c.split("--tile-n ")[1].split()[0]) for c in grouped]
    assert tiles == [("64", "128"), ("64", "256")] * 4 + [("128", "128"), ("128", "192")] * 2
    assert [c.count("--recipe tensor") for c in grouped[:8]] == [0] * 4 + [1] * 4
    assert all("--cluster-m 1" in c for c in grouped[8:])
    _, commands, out = _run_all(tmp_path, "bench")
    assert not any("--no-save" in c for c in commands)  # options are no part of bench


def test_run_all_prefill_options_test_the_options_then_time_each_against_the_table(tmp_path):
    rc, commands, out = _run_all(tmp_path, "options-prefill")
    assert rc == 0, out
    lines = out.splitlines()
    tests = [i for i, line in enumerate(lines) if line.startswith("py -m pytest -m gpu")]
    assert len(tests) == 1 and "tests/test_grouped_gpu.py -k clusters or staged" in lines[tests[0]]
    assert tests[0] < min(i for i, line in enumerate(lines) if line.startswith("py -m benchmarks.bench_grouped"))
    grouped = [c for c in commands if c.startswith("benchmarks.bench_grouped")]
    options = [c.split("--layouts contiguous")[1].replace("--no-save", "").strip() for c in grouped]
    assert options == ["", "--cluster-m 1", "--cluster-m 2", "--early-row-scales off"] * 2
    assert all("--no-save" in c and "--tokens 4096,8192,16384" in c for c in grouped)


def test_run_all_mid_m_option_times_every_candidate_and_dispatchs_picks(tmp_path):
    """options-mid-m: one tune_tiles run at M = 96 and 128 over the sweep's layers whose tiles hold every tile
    dispatch picks there (else audit_picks scores a pick it has no time for as nan)."""
    from benchmarks.bench_sweep import LAYERS
    from benchmarks.tune_tiles import candidates, tile_label
    from cutedsl_gemm.selection import dispatch

    rc, commands, out = _run_all(tmp_path, "options-mid-m")
    assert rc == 0, out
    tunes = [c for c in commands if c.startswith("benchmarks.tune_tiles")]
    assert len(tunes) == 1 and "--nk sweep" in tunes[0] and "--ms 96,128" in tunes[0]
    assert "--rounds 2" in tunes[0] and "--recipes tensor,row" in tunes[0]
    tiles = tunes[0].split("--tiles ")[1].split()[0].split(",")
    for recipe in ("tensor", "row"):
        timed = {tile_label(i) for i in candidates(recipe, tiles, ["promoted"])}
        for m in (96, 128):
            for _, n, k in LAYERS:
                pick = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=132, k=k)
                assert tile_label(pick) in timed, (recipe, m, n, k, tile_label(pick))
