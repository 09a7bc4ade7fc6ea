"""benchmarks.bench_sweep on the CPU: the floor, the candidates --audit times, and the result file a run writes
(the GPU measurement replaced)."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks import bench_decode_chain, bench_sweep, common, measure_floor, render
from cutedsl_gemm.selection import dispatch

BENCHMARKS = Path(common.__file__).resolve().parent
H200 = common.Floors(gpu="NVIDIA H200", hbm_tbps=4.33, fp8_tflops=1346.0, launch_us=3.8, stream_fixed_us=9.3)


@pytest.fixture
def floors(monkeypatch):
    """``common.measured_floors()`` answers ``H200`` (no GPU here)."""
    monkeypatch.setattr(common, "measured_floors", lambda: H200)
    return H200


def test_floor_is_the_longer_of_streaming_and_mma():
    # M = 128, N = 57344, K = 8192: 470 MB of W stream in ~109 us at 4.33 TB/s; the MMAs take 89 us at 1346
    us, bound = bench_sweep.floor_us(128, 57344, 8192, 1346.0, 4.33)
    assert bound == "HBM" and us == pytest.approx((128 * 8192 + 57344 * 8192 + 2 * 128 * 57344) / 4.33e12 * 1e6)
    us, bound = bench_sweep.floor_us(4096, 8192, 8192, 1000.0, 4.33)
    assert bound == "MMA" and us == pytest.approx(2 * 4096 * 8192 * 8192 / 1e15 * 1e6)
    assert bench_sweep.floor_us(4096, 8192, 8192, 1000.0, hbm_tbps=0.1)[1] == "HBM"


def test_floor_rates_are_the_measured_floors_unless_given(floors, monkeypatch):
    assert bench_sweep.floor_rates() == (1346.0, 4.33, "measured on this GPU (benchmarks.measure_floor)")
    assert bench_sweep.floor_rates(1300.0) == (
        1300.0, 4.33, "TFLOPS from --tc-rate, the other measured on this GPU (benchmarks.measure_floor)")
    monkeypatch.setattr(common, "measured_floors", lambda: pytest.fail("both rates given: no floors read"))
    assert bench_sweep.floor_rates(1300.0, 3.0) == (1300.0, 3.0, "TFLOPS from --tc-rate, TB/s from --hbm-rate")
    assert measure_floor.TC_KEY == common.FLOOR_KEYS["fp8_tflops"] and measure_floor.RESULT_NAME == "floor"


def test_layers_are_the_issue_shapes():
    assert len(bench_sweep.LAYERS) == 13 and len(set(bench_sweep.LAYERS)) == 13
    assert bench_sweep.layer_name(57344, 8192) == "Llama-3-70B" and bench_sweep.layer_name(1, 2) == "-"
    assert bench_sweep.MS[0] == 1 and bench_sweep.MS[-1] == 4096 and len(bench_sweep.MS) == 10


def test_family_is_what_dispatch_chooses_among():
    tensor = bench_sweep.family("tensor")
    assert all(i.recipe == "tensor" and i.accum == "promoted" and i.bias_dtype is None for i in tensor)
    assert {i.schedule for i in tensor} == {"small_m", "cooperative"} and any(i.split_tail for i in tensor)
    for m in bench_sweep.MS:
        pick = dispatch.select_gemm("sm_90a", "tensor", "e4m3", "e4m3", "bf16", None, m, n=8192, sms=132, k=8192)
        assert pick in tensor
    assert bench_sweep.family("nosuchrecipe") == ()


def test_audit_runs_every_instance_unsplit_and_as_dispatch_splits():
    slots_of = bench_sweep.cpu_slots(132)
    runs = bench_sweep.audit_runs("tensor", 32, 4096, 4096, slots_of)
    plain = [i for i in bench_sweep.family("tensor") if not i.split_tail]
    assert {i for i, _ in runs} == set(plain)  # no last-wave variant: one wave of tiles
    for inst in plain:
        got = sorted(s for i, s in runs if i == inst)
        want = dispatch.splits_for(inst, 32, 4096, 4096, slots_of(inst))
        assert got == sorted({1, want})
    # Forcing splits: each normalized to the K tiles, no duplicates.
    forced = bench_sweep.audit_runs("tensor", 32, 4096, 4096, slots_of, (1, 2, 64))
    assert len(forced) == len(set(forced)) and {s for _, s in forced} <= {1, 2, 16, 32}


def test_audit_runs_last_wave_variant_only_split():
    slots_of = bench_sweep.cpu_slots(132)
    runs = bench_sweep.audit_runs("tensor", 6144, 512, 7168, slots_of)
    tails = [(i, s) for i, s in runs if i.split_tail]
    assert tails and all(s > 1 for _, s in tails)


def _fake_row(recipe, m, n, k, args, tc_rate, hbm_rate):
    fl, bound = bench_sweep.floor_us(m, n, k, tc_rate, hbm_rate)
    t_c = None if (recipe, m) == ("1x128_128x128", 1) else 12.0
    return [recipe, bench_sweep.layer_name(n, k), m, n, k, 10.0, t_c, t_c and t_c / 10.0, "t128x64sk128 c1x1", 1,
            1.0, 1, round(fl, 2), bound, round(fl / 10.0, 3), 2e-3] + (
        ["t128x32sk128 c1x1", 2, 9.0, 1.333] if args.audit else [])


@pytest.mark.parametrize("argv, name", [
    (["--ms", "1,64", "--nk", "8192x8192,576x7168", "--recipes", "tensor,1x128_128x128"], "sweep"),
    (["--ms", "64", "--nk", "8192x8192", "--recipes", "row", "--audit", "--tc-rate", "1300"], "sweep_audit"),
])
def test_sweep_run_writes_its_result(tmp_path, monkeypatch, floors, argv, name):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr("sys.argv", [str(BENCHMARKS / "bench_sweep.py"), *argv])
    monkeypatch.setattr(bench_sweep, "measure_shape", _fake_row)
    rows = bench_sweep.main(argv)
    got = json.loads((tmp_path / f"{name}.json").read_text())
    assert [p.name for p in tmp_path.iterdir()] == [f"{name}.json"]
    assert got["columns"] == bench_sweep.COLUMNS + (bench_sweep.AUDIT_COLUMNS if "--audit" in argv else [])
    assert len(got["rows"]) == len(rows) == len(argv[1].split(",")) * len(argv[3].split(",")) * len(
        argv[5].split(","))
    assert got["summary"] == render.sweep_summary(got["columns"], got["rows"])
    assert render.is_sweep(got)
    assert ("1300 TFLOPS (TFLOPS from --tc-rate, the other measured" in got["notes"]) == ("--tc-rate" in argv)
    assert "at 4.33 TB/s" in got["notes"] and ("1346 TFLOPS (measured on this GPU" in got["notes"]) != (
        "--tc-rate" in argv)
    assert "0 over 0.01" in got["notes"]
    if name == "sweep":
        assert got["summary"]["1x128_128x128 under 1.0"] == "0 of 2"  # cuBLAS refused M = 1 twice
        assert got["summary"]["tensor geomean ratio"] == 1.2


def test_sweep_refuses_unknown_recipes_and_bad_shapes(capsys):
    with pytest.raises(SystemExit):
        bench_sweep.main(["--recipes", "tensor,nosuch"])
    assert "no sm_90a instances for recipe(s) nosuch" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--nk: expected NxK"):
        bench_sweep.parse_nk("8192,8192")


@pytest.mark.parametrize("module", [bench_sweep, bench_decode_chain, measure_floor])
def test_help(module, capsys):
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert module.__doc__.splitlines()[0] in out and "--no-save" in out


def test_decode_options_cover_the_large_layers_and_the_unfused_projections():
    from benchmarks import bench_decode_options as O

    shapes = O.shapes()
    assert (1024, 4096) in shapes and (14336, 4096) in shapes and (28672, 4096) in shapes
    assert all(n * k >= O.MIN_WEIGHT_BYTES for n, k in shapes if (n, k) not in O.UNFUSED)
    assert len(shapes) == len(set(shapes))
    pick = dispatch.select_gemm("sm_90a", "row", "e4m3", "e4m3", "bf16", None, 1)
    rows = O.swapped_rows(pick, "row", 1)
    assert {(i.tile_m, i.tile_n) for i in rows} == {(128, pick.tile_n), (64, pick.tile_n)}
    assert all(i.swap_ab and i.accum == pick.accum and i.bias_dtype is None for i in rows)
    unswapped = next(i for i in O.INSTANCES if i.op == "gemm" and i.arch == "sm_90a" and i.recipe == "row"
                     and not i.swap_ab and i.accum == "promoted")
    assert {i.tile_n for i in O.swapped_rows(unswapped, "row", 128)} == {64}  # the width M needs
    with pytest.raises(SystemExit):  # (no GPU here, or a missing --what)
        O.main(["--what", "splits"] if not torch.cuda.is_available() else [])
