"""generators/ and the command line: table validity rules, precompile into the JIT cache, the kernel catalog
rendered for one instance per kernel family, the parallel runner (progress, Ctrl-C) and the CLI's arguments and
errors (the AOT export: test_export.py). Compiling tests keep to a few instances."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from table_picks import PAIR, ROW_BF16, SMALL, WEIGHT_ONLY_DECODE, instance

from cutedsl_gemm.generators import catalog as C
from cutedsl_gemm.generators.runner import Interrupted, SelectionError, TaskResult, code_key, pick
from cutedsl_gemm.kernels.sm90.gemm_plan import Sm90GemmPlan
from cutedsl_gemm.selection import instances as M


# ------------------------------------------------------------------------------------------------
# Instance table and selection (no compile)
# ------------------------------------------------------------------------------------------------
def test_validate_rejects_promoted_tile_too_wide_for_registers():
    bad = replace(instance(ROW_BF16), tile_n=256, accum="promoted")
    with pytest.raises(M.InstanceTableError, match=r"promoted accumulation.*tile_n=256 > \d+ does not fit") as e:
        M.validate(bad)
    assert bad.name in str(e.value)


def test_validate_rejects_stages_beyond_shared_memory():
    with pytest.raises(M.InstanceTableError,
                       match=r"12 stages of \d+ B .* need \d+ B of shared memory; the budget is \d+ B"):
        M.validate(replace(instance(ROW_BF16), stages=12))


def test_validate_rejects_a_paired_tile_too_wide_for_its_registers():
    # two CTAs per SM launch at 128 registers per thread: ptxas cannot build 64x208 (C7602), 64x192 builds
    paired = replace(instance(PAIR), accum="fast", tile_n=256)
    with pytest.raises(M.InstanceTableError, match=r"two CTAs per SM .* at most 192 wide, got tile_n=256"):
        M.validate(paired)
    M.validate(replace(paired, tile_n=192))


def test_validate_table_refuses_a_bad_table_row():
    row = M.TileConfig("sm_90a", "gemm", "cooperative", ("row",), 128, 256, accum="promoted")
    with pytest.raises(M.InstanceTableError, match="does not fit"):
        M.validate_table(M.expand([row]))


def test_every_instance_of_the_table_is_valid():
    """The kernels' own rules on every row (import no longer checks them: this does, and compiling does)."""
    assert M.validate_table() == len(M.table()) > 4000


def test_import_loads_neither_the_dsl_nor_a_kernel_module():
    """``import cutedsl_gemm`` reads the kernels' plain-data facts (no DSL) and nothing else of kernels/."""
    code = ("import sys, cutedsl_gemm\n"
            "from cutedsl_gemm.selection import instances\n"
            "facts = {'cutedsl_gemm.kernels', 'cutedsl_gemm.kernels.sm90', 'cutedsl_gemm.kernels.common',\n"
            "         'cutedsl_gemm.kernels.sm90.scale_recipes', 'cutedsl_gemm.kernels.common.waves'}\n"
            "bad = sorted(m for m in sys.modules if m == 'cutlass' or m.startswith('cutlass.')\n"
            "             or m.startswith('cutedsl_gemm.kernels') and m not in facts)\n"
            "assert not bad, bad\n"
            "assert instances.table.cache_info().currsize == 0, 'the table was expanded at import'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_pick_selects_filters_and_explains_empty_selections():
    sel = pick("sm_90a", [ROW_BF16])
    assert [i.name for i in sel] == [ROW_BF16]
    assert len(pick("sm_90a", ["_bf16_"], limit=3)) == 3
    assert len(set(pick("sm_90a"))) == len(pick("sm_90a"))  # identical expanded rows appear once
    with pytest.raises(SelectionError, match=r"no sm_80 instances \(archs with instances: (sm_\w+, )*sm_90a"):
        pick("sm_80")
    with pytest.raises(SelectionError, match="no sm_90a instance name contains"):
        pick("sm_90a", ["no-such-kernel"])


def test_cli_export_of_an_arch_without_instances_is_an_error(tmp_path, capsys):
    from cutedsl_gemm.tools.cli import main

    assert main(["export", "--arch", "sm_80", "--out", str(tmp_path)]) == 2
    assert "no sm_80 instances" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_cli_export_of_an_arch_without_an_exporter_is_an_error(tmp_path, capsys, monkeypatch):
    from cutedsl_gemm.generators import export as E
    from cutedsl_gemm.tools.cli import main

    arch = next((i.arch for i in M.INSTANCES if i.arch != "sm_90a"), None)
    if arch is None:
        pytest.skip("the table holds only sm_90a instances")
    # Every family of the table has an exporter: stand for a new one that has none yet.
    monkeypatch.setattr(E, "exportable", lambda inst: inst.arch == "sm_90a")
    assert main(["export", "--arch", arch, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cutedsl-gemm export: no AOT exporter for {arch} gemm instances") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------
# Precompile into the JIT cache
# ------------------------------------------------------------------------------------------------
def test_precompile_uses_the_runtime_cache_key(monkeypatch):
    """precompile must fill exactly the entry scaled_mm looks up."""
    from cutedsl_gemm.generators.precompile import cache_key
    from cutedsl_gemm.runtime import launch, resources

    seen = []

    class Recorder:
        def get(self, key, build, *, arch=None, load=True):
            seen.append((key, arch))
            return "compiled"

    monkeypatch.setattr(resources, "KERNEL_CACHE", Recorder())
    insts = [instance(ROW_BF16), instance(WEIGHT_ONLY_DECODE)]
    for inst in insts:
        launch.compiled(inst)
    assert seen == [cache_key(i) for i in insts]


@pytest.mark.compile
def test_precompile_fills_the_cache_once(tmp_path, monkeypatch):
    from cutedsl_gemm.generators.precompile import precompile
    from cutedsl_gemm.runtime.jit import KERNEL_CACHE

    monkeypatch.setenv("CUTEDSL_GEMM_CACHE_DIR", str(tmp_path))
    names = [ROW_BF16, WEIGHT_ONLY_DECODE]  # a GEMM and a weight-only GEMM
    first = precompile("sm_90a", names, jobs=1)  # one spawned worker process
    assert (first.selected, first.compiled, first.failed) == (2, 2, [])
    for name in names:
        assert KERNEL_CACHE.entry_path(instance(name), "sm_90a").stat().st_size > 0
    t0 = time.perf_counter()
    second = precompile("sm_90a", names, jobs=1)
    took = time.perf_counter() - t0
    assert (second.compiled, second.already_cached) == (0, 2)
    assert took < 0.5, f"a precompile with everything cached took {took:.2f} s"
    print(f"precompile no-op: {took * 1e3:.1f} ms")


# ------------------------------------------------------------------------------------------------
# Catalog
# ------------------------------------------------------------------------------------------------
def test_catalog_sample_is_one_instance_per_kernel_family():
    sample = C.sample(M.INSTANCES)
    families = {C.family_key(i) for i in M.INSTANCES}
    assert sorted(map(C.family_key, sample)) == sorted(families)  # every family, once
    assert C.select(sampled=True) == sample
    hopper = C.select("sm_90a", sampled=True)
    assert 8 <= len(hopper) <= 29 and set(hopper) <= set(sample)
    for arch in {i.arch for i in M.INSTANCES}:  # every recipe and type of each arch's GEMMs
        mine, table = ([i for i in rows if i.arch == arch and i.op == "gemm"] for rows in (sample, M.INSTANCES))
        for axis in C.SAMPLE_AXES:
            assert {getattr(i, axis) for i in mine} == {getattr(i, axis) for i in table}, (arch, axis)
    # the weight-only GEMMs: a family per weight format and kind of scales (a group size is a parameter), with
    # every activation type
    weight_only = [i for i in sample if i.op == M.WEIGHT_ONLY]
    assert sorted((i.b_dtype, C.family_key(i)[3]) for i in weight_only) == [
        ("int4", "group-wise"), ("int4", "group-wise with zero points"), ("int4", "per-channel"),
        ("int8", "per-channel")]
    assert {i.a_dtype for i in weight_only} == {"bf16", "fp16"}
    # the Hopper family key separates the code paths: schedules, block scales, swapped, paired, last-wave split,
    # accumulation
    assert {i.schedule for i in hopper if i.op != M.GROUPED_GEMM} == {"small_m", "cooperative"}
    assert {i.schedule for i in hopper if i.op == M.GROUPED_GEMM} == {"contiguous", "masked"}  # the grouped layouts
    assert {(i.swap_ab, i.ctas_per_sm, i.split_tail, i.accum) for i in hopper} >= {
        (True, 1, False, "promoted"), (False, 1, False, "fast"), (False, 2, False, "promoted"),
        (True, 2, False, "promoted"), (False, 1, True, "promoted")}


def _expected_mma(inst) -> str:
    """The MMA instruction an instance's PTX must hold, from its configuration."""
    if inst.op == M.WEIGHT_ONLY:  # the converted weights (register-sourced A) x the activations, both in their dtype
        act = {"bf16": "bf16", "fp16": "f16"}[inst.a_dtype]
        return rf"wgmma\.mma_async\.sync\.aligned\.m64n{inst.tile_n}k16\.f32\.{act}\.{act}"
    if inst.op == M.GROUPED_GEMM:  # each consumer warp group's share of the tile's columns
        from cutedsl_gemm.families import sm90_grouped
        from cutedsl_gemm.kernels.sm90.grouped_gemm import grouped_kernel

        n = inst.tile_n // grouped_kernel(sm90_grouped.config(inst)).warp_groups_n
        return rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.{inst.a_dtype}\.{inst.b_dtype}"
    if inst.arch == "sm_90a":  # the swapped kernels run W on WGMMA's A side; the operands are the kernel's (a kernel
        # that quantizes its activations multiplies them in its a_dtype)
        cfg = inst.sm90_config()
        first, second = (cfg.b_dtype, cfg.a_dtype) if inst.swap_ab else (cfg.a_dtype, cfg.b_dtype)
        n = Sm90GemmPlan.wgmma_n(cfg)
        if cfg.a_dtype == "int8":
            return rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.satfinite\.s32\.s8\.s8"
        return rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.{first}\.{second}"
    return rf"tcgen05\.mma\.cta_group::{inst.cluster_m}\.kind::{inst.mma_kind}\.[\w.:]+"


@pytest.mark.compile
def test_catalog_renders_the_sample_with_its_facts(tmp_path, monkeypatch):
    sample = C.select(sampled=True)
    rep = C.write_catalog(tmp_path, sample, jobs=2, scope="sample", stream=io.StringIO())
    assert (rep.selected, rep.compiled, rep.failed) == (len(sample), len(sample), [])
    data = json.loads((tmp_path / C.FACTS_NAME).read_text())
    doc = (tmp_path / C.DOC_NAME).read_text()
    for inst in sample:
        key = code_key(inst)
        facts = data["entries"][key]
        assert data["instances"][inst.name] == key
        assert facts["registers"] > 0 and facts["smem_bytes"] > 0 and facts["stages"] >= 2, key
        (mma, count), = facts["mma"].items()
        assert re.fullmatch(_expected_mma(inst), mma) and count > 0, (key, facts["mma"])
        assert f"`{key}`" in doc and f"`{mma}`" in doc
    # A second run into the same directory reuses every fact
    monkeypatch.setattr(C, "collect_facts", lambda i: pytest.fail("must not compile again"))
    again = C.write_catalog(tmp_path, sample, jobs=0, stream=io.StringIO())
    assert (again.compiled, again.reused) == (0, len(sample))
    doc = (tmp_path / C.DOC_NAME).read_text()
    assert "not compiled" not in doc and all(f"`{code_key(i)}`" in doc for i in sample)


def _fake_facts(inst):
    return {"fingerprint": C.facts_fingerprint(), "config": C.code_config(inst), "registers": 1, "frame_bytes": 0,
            "smem_bytes": 1, "stages": 2, "mma": {"wgmma.fake": 1}}


def test_interrupted_catalog_keeps_what_finished_and_resumes(tmp_path, monkeypatch):
    insts = pick("sm_90a", limit=4)
    done = []

    def interrupt_third(inst):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(inst)
        return _fake_facts(inst)

    monkeypatch.setattr(C, "collect_facts", interrupt_third)
    with pytest.raises(Interrupted) as e:
        C.write_catalog(tmp_path, insts, jobs=0, stream=io.StringIO())
    assert (len(e.value.results), e.value.total) == (2, 4)
    kept = json.loads((tmp_path / C.FACTS_NAME).read_text())["entries"]
    assert sorted(kept) == sorted(code_key(i) for i in insts[:2])
    doc = (tmp_path / C.DOC_NAME).read_text()
    assert doc.count("not compiled: interrupted") == 2 and f"`{code_key(insts[3])}`" in doc
    compiled = []
    monkeypatch.setattr(C, "collect_facts", lambda i: compiled.append(i) or _fake_facts(i))
    rep = C.write_catalog(tmp_path, insts, jobs=0, stream=io.StringIO())
    assert compiled == list(insts[2:]) and (rep.compiled, rep.reused) == (2, 2)
    assert "interrupted" not in (tmp_path / C.DOC_NAME).read_text()


def test_catalog_output_must_be_a_directory(tmp_path, capsys):
    from cutedsl_gemm.tools.cli import main

    path = tmp_path / "taken"
    path.write_text("x")
    assert main(["catalog", "--out", str(path), "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"cutedsl-gemm catalog: --out {path} is a file, not a directory"


# ------------------------------------------------------------------------------------------------
# Ahead-of-time selections
# ------------------------------------------------------------------------------------------------
def test_unfiltered_ahead_of_time_builds_take_the_default_set():
    from cutedsl_gemm.generators.runner import in_default_set, pick_ahead_of_time

    table = pick("sm_90a")
    default = pick_ahead_of_time("sm_90a")
    assert default.instances == tuple(i for i in table if in_default_set(i))
    assert 0 < len(default.instances) < len(table) / 10 and f"--all for all {len(table)}" in default.scope
    gemms = [i for i in default.instances if i.op == "gemm"]
    assert {(i.a_dtype, i.b_dtype, i.out_dtype) for i in gemms} == {("e4m3", "e4m3", "bf16"), ("int8", "int8", "bf16")}
    assert {i.bias_dtype for i in gemms} == {None, "bf16"}
    # every tile, schedule and recipe of the GEMMs is in it
    def shape(i):
        return (i.schedule, i.recipe, i.tile_m, i.tile_n, i.cluster_m, i.cluster_n, i.accum, i.swap_ab, i.split_tail,
                i.ctas_per_sm, i.stages)

    assert {shape(i) for i in gemms} == {shape(i) for i in table if i.op == "gemm"}
    # and the common weight-only kernels, every tile (M range) of each
    weight_only = [i for i in default.instances if i.op == M.WEIGHT_ONLY]
    assert {(i.a_dtype, i.b_dtype, i.recipe) for i in weight_only} == {("bf16", "int4", "group128"),
                                                                      ("bf16", "int8", "channel")}
    assert len(weight_only) == 8 and {i.tile_n for i in weight_only} == {16, 32, 64, 128}
    assert pick_ahead_of_time("sm_90a", everything=True).instances == table
    assert len(pick_ahead_of_time("sm_90a", limit=3).instances) == 3
    # a filter selects from the whole table
    fp32 = pick_ahead_of_time("sm_90a", ["_fp32_"]).instances
    assert fp32 and not any(in_default_set(i) for i in fp32)


def test_precompile_says_how_many_kernels_it_will_compile(monkeypatch):
    from cutedsl_gemm.generators import precompile as P
    from cutedsl_gemm.generators.runner import in_default_set

    seen = []
    monkeypatch.setattr(P, "run_parallel", lambda fn, items, *a, **k: seen.append(list(items)) or [])
    out = io.StringIO()
    rep = P.precompile("sm_90a", stream=out)
    n = sum(map(in_default_set, pick("sm_90a")))
    assert rep.selected == n and len(seen[0]) == n  # nothing cached in the tests' cache directory
    first = out.getvalue().splitlines()[0]
    assert first.startswith(f"precompile: {n} instance(s) of sm_90a (the default set: e4m3 x e4m3")
    assert first.endswith(f": {n} to compile, 0 already cached")


# ------------------------------------------------------------------------------------------------
# Parallel runner: progress and Ctrl-C
# ------------------------------------------------------------------------------------------------
def test_progress_lines_count_and_estimate_the_time_left():
    from cutedsl_gemm.generators.runner import Progress, duration

    out = io.StringIO()
    progress = Progress(3, "precompile", out)
    progress.step("first", True, 1.0)
    progress.step("second", False, 2.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and " 1/3 " in lines[0] and " 2/3 " in lines[1]
    assert re.search(r" ETA \d+s ok  first \(1\.0s\)$", lines[0]) and " ERR second" in lines[1]
    assert [duration(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]


def test_an_interrupt_in_process_returns_what_finished():
    from cutedsl_gemm.generators.runner import run_parallel

    ran = []

    def task(x):
        if x == 2:
            raise KeyboardInterrupt
        ran.append(x)
        return x * 10

    with pytest.raises(Interrupted) as e:
        run_parallel(task, range(5), 0, "test", stream=io.StringIO())
    assert [r.value for r in e.value.results] == [0, 10] and e.value.total == 5
    assert ran == [0, 1]  # nothing after the interrupt ran


INTERRUPTED_SCRIPT = """
import sys, time
from cutedsl_gemm.generators.runner import Interrupted, run_parallel

def task(x):
    if x >= 2:
        time.sleep(600)
    return x * 10

if __name__ == "__main__":
    try:
        run_parallel(task, range(6), 2, "test")
    except Interrupted as e:
        print("kept", [r.value for r in e.results], "of", e.total, flush=True)
        sys.exit(130)
    sys.exit(1)
"""


def test_ctrl_c_stops_the_worker_processes_and_keeps_what_finished(tmp_path):
    script = tmp_path / "interrupted_run.py"
    script.write_text(textwrap.dedent(INTERRUPTED_SCRIPT))
    # in a process group of its own, which Ctrl-C reaches as a terminal's would
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stderr:  # wait for the two quick tasks; the others sleep
            if " 2/6 " in line:
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert out.strip() == "kept [0, 10] of 6"
    assert "Traceback" not in err
    deadline = time.time() + 10  # the workers are gone (their parent waited for them)
    while time.time() < deadline and _group_alive(proc.pid):
        time.sleep(0.1)
    assert not _group_alive(proc.pid)


def test_workers_start_with_ctrl_c_ignored_before_their_initializer_runs():
    # a worker still importing when Ctrl-C comes must not print a traceback: it starts with SIGINT ignored
    from cutedsl_gemm.generators.runner import _sigint_ignored

    probe = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"]
    with _sigint_ignored():
        inside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    after = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    assert (inside, after) == ("True", "False")
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


def _group_alive(pgid) -> bool:
    """Whether a live (not zombie) process is left in the process group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["precompile", "export", "catalog"])
@pytest.mark.parametrize("jobs", ["-3", "0", "two"])
def test_cli_refuses_a_bad_job_count_in_one_line(cmd, jobs, tmp_path, capsys):
    from cutedsl_gemm.tools.cli import main

    extra = ["--out", str(tmp_path)] if cmd != "precompile" else []
    with pytest.raises(SystemExit) as e:
        main([cmd, "--jobs", jobs, *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"cutedsl-gemm {cmd}: error: argument --jobs: expected a whole number >= 1, got " in err
    assert "Traceback" not in err


def test_cli_reports_an_interrupt_in_one_line(monkeypatch, capsys):
    from cutedsl_gemm.generators import precompile as P
    from cutedsl_gemm.tools.cli import main

    def interrupted(*a, **k):
        raise Interrupted([TaskResult(None, True)] * 2, 5)

    monkeypatch.setattr(P, "precompile", interrupted)
    assert main(["precompile"]) == 130
    assert capsys.readouterr().err == "interrupted: 2 of 5 done, kept\n"


def test_export_skips_ops_the_registry_has_no_form_for(tmp_path, capsys, monkeypatch):
    from cutedsl_gemm.generators import c_export as CE
    from cutedsl_gemm.generators import export as E
    from cutedsl_gemm.generators.runner import Selection
    from cutedsl_gemm.tools.cli import main

    assert CE.skip_reason(instance(WEIGHT_ONLY_DECODE)) is None and CE.skip_reason(instance(ROW_BF16)) is None
    # an op the exporter does not know (a new family of the table) is skipped by name, never compiled
    new_op = [replace(instance(n), op="fused_quant") for n in (ROW_BF16, SMALL)]
    monkeypatch.setattr(E, "pick_ahead_of_time", lambda *a, **k: Selection(tuple(new_op), "a test selection"))
    assert main(["export", "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    why = "the C registry has no form for op 'fused_quant' (it describes gemm, weight_only, quant_gemm kernels)"
    assert lines == [f"export: skipping 2 fused_quant instance(s) (e.g. {new_op[0].name}): {why}",
                     f"cutedsl-gemm export: nothing to export: the 2 selected instance(s) are fused_quant kernels, "
                     f"which the C export skips: {why}"]
    assert not any(tmp_path.iterdir())
    with pytest.raises(E.ExportError, match=f"no AOT exporter for arch=sm_90a op=fused_quant: {re.escape(why)}"):
        E.export_one((new_op[0], str(tmp_path)))
    # an op listed in NOT_EXPORTED is skipped with the reason given there
    monkeypatch.setitem(CE.NOT_EXPORTED, M.WEIGHT_ONLY, "no C form yet")
    assert CE.skip_reason(instance(WEIGHT_ONLY_DECODE)) == "no C form yet"
    with pytest.raises(E.ExportError, match="op=weight_only: no C form yet"):
        E.export_one((instance(WEIGHT_ONLY_DECODE), str(tmp_path)))


def test_cli_export_into_a_file_is_a_one_line_error(tmp_path, capsys):
    from cutedsl_gemm.tools.cli import main

    path = tmp_path / "registry.c"
    path.write_text("int x;\n")
    assert main(["export", "--out", str(path), "--filter", ROW_BF16]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"cutedsl-gemm export: --out {path}: {path} is a file, not a directory"
    assert path.read_text() == "int x;\n"


def test_a_failed_reexport_leaves_the_previous_export_as_it_was(tmp_path, monkeypatch):
    from cutedsl_gemm.generators import export as E

    out = tmp_path / "export"
    kernels = out / "kernels"
    kernels.mkdir(parents=True)
    old = ["cutedsl_gemm_registry.c", "CMakeLists.txt", "kernels/old_kernel.o", "kernels/old_kernel.h"]
    for rel in old:
        (out / rel).write_text("old")
    (out / "notes.txt").write_text("mine")
    record = json.dumps({"files": [*old, E.EXPORT_RECORD], "complete": True})
    (out / E.EXPORT_RECORD).write_text(record)
    before = {p: p.read_text() for p in out.rglob("*") if p.is_file()}
    # the new export fails to compile, then another is interrupted: the old files stay, nothing is left beside them
    monkeypatch.setattr(E, "run_parallel", lambda fn, jobs, *a, **k: [TaskResult(j, False, error="boom") for j in jobs])
    with pytest.raises(E.ExportError, match="1 of 1 instances failed to export"):
        E.export("sm_90a", out, [ROW_BF16], stream=io.StringIO())

    def interrupted(fn, jobs, *a, **k):
        assert Path(jobs[0][1]).parent.name.startswith(".export.partial-")  # built beside --out
        raise Interrupted([], len(jobs))

    monkeypatch.setattr(E, "run_parallel", interrupted)
    with pytest.raises(Interrupted):
        E.export("sm_90a", out, [ROW_BF16], stream=io.StringIO())
    assert {p: p.read_text() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_cli_help_describes_every_command(capsys):
    from cutedsl_gemm.tools.cli import main

    for cmd, words in (("demo", "With a Hopper GPU: run scaled_mm"), ("info", "Print the GPU (if any), the arch"),
                       ("catalog", "kernels.md"), ("precompile", "--all"), ("export", "--all")):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert words in " ".join(capsys.readouterr().out.split()), cmd


def test_cli_bench_help_shows_the_benchmarks_options(capsys, monkeypatch, tmp_path):
    from cutedsl_gemm.tools.cli import main

    monkeypatch.chdir(tmp_path)  # no checkout here: the description alone, and where the options come from
    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Runs the GEMM benchmark of a source checkout" in out and "No benchmarks/bench_gemm.py" in out
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the repository root
    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Runs the GEMM benchmark of a source checkout, benchmarks/bench_gemm.py" in out
    for option in ("--sets", "--recipes", "--shapes", "--fast-accum"):
        assert option in out
    assert "usage: cutedsl-gemm bench [-h] [--sets SETS]" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_cli_bench_passes_its_options_on_and_needs_a_gpu(capsys):
    from cutedsl_gemm.tools.cli import main

    assert main(["bench", "--sets", "dsv3", "--recipes", "row"]) == 2
    assert capsys.readouterr().err == "cutedsl-gemm bench: needs a Hopper GPU\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_cli_info_prints_an_arch_line_without_a_gpu(capsys, monkeypatch):
    from cutedsl_gemm.tools.cli import main

    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "arch:       none (no GPU and CUTE_DSL_ARCH unset; CUTE_DSL_ARCH=sm_90a compiles for Hopper)" in lines
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert main(["info"]) == 0
    assert "arch:       sm_100a (from CUTE_DSL_ARCH)" in capsys.readouterr().out.splitlines()
