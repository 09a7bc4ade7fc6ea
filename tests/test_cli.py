"""The command line's errors and its ahead-of-time plumbing: usage errors, the target arch from CUTE_DSL_ARCH, the
worker count, the export's swap into --out, the kernel cache's leftovers and the C compiler (no compile)."""

import fcntl
import io
import json
from concurrent.futures import Future

import pytest
from table_picks import ROW_BF16

from cutedsl_gemm.generators import export as E
from cutedsl_gemm.generators import precompile as P
from cutedsl_gemm.generators import runner
from cutedsl_gemm.generators.runner import Interrupted
from cutedsl_gemm.runtime import jit
from cutedsl_gemm.tools.cli import main


# ------------------------------------------------------------------------------------------------
# Usage errors
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, error", [(["--nonsense"], "unrecognized arguments: --nonsense"),
                                         ([], "no command given")])
def test_an_unknown_option_or_no_command_shows_the_commands_and_one_error_line(argv, error, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cutedsl-gemm")
    for cmd in ("demo", "info", "bench", "export", "precompile", "catalog"):
        assert f"\n  {cmd} " in err, cmd
    assert err.rstrip().splitlines()[-1] == f"cutedsl-gemm: error: {error}"
    assert "required: cmd" not in err


def test_an_unknown_option_of_a_command_is_that_commands_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["info", "--nonsense"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["usage: cutedsl-gemm info [-h]",
                                                    "cutedsl-gemm info: error: unrecognized arguments: --nonsense"]


# ------------------------------------------------------------------------------------------------
# CUTE_DSL_ARCH
# ------------------------------------------------------------------------------------------------
def test_a_bogus_cute_dsl_arch_is_refused_naming_the_accepted_ones(monkeypatch, capsys):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_42")
    with pytest.raises(jit.ArchError, match="CUTE_DSL_ARCH='sm_42' .* use sm_90a or sm_100a"):
        jit.target_arch()
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("cutedsl-gemm: CUTE_DSL_ARCH='sm_42'")
    for arch in jit.ARCHS:
        monkeypatch.setenv("CUTE_DSL_ARCH", arch)
        assert jit.target_arch() == arch


# ------------------------------------------------------------------------------------------------
# Worker count
# ------------------------------------------------------------------------------------------------
def test_jobs_are_capped_by_the_cpus_and_the_memory(monkeypatch):
    monkeypatch.setattr(runner, "usable_cpus", lambda: 2)
    monkeypatch.setattr(runner, "available_memory", lambda: 24 * 2**30)
    out = io.StringIO()
    assert runner.capped_jobs(12, "export", out) == 2
    assert out.getvalue() == (f"export: --jobs 12 capped at 2 (2 CPUs, 24.0 GB available at "
                              f"{runner.WORKER_BYTES / 2**30:.1f} GB a worker)\n")
    quiet = io.StringIO()
    assert runner.capped_jobs(None, "export", quiet) == 2 and runner.capped_jobs(1, "export", quiet) == 1
    assert runner.capped_jobs(12, "export", quiet, tasks=2) == 2 and quiet.getvalue() == ""
    monkeypatch.setattr(runner, "usable_cpus", lambda: 16)
    monkeypatch.setattr(runner, "available_memory", lambda: int(2.5 * runner.WORKER_BYTES))
    assert runner.capped_jobs(None, "precompile", out) == 2  # the default too: memory for two workers
    assert out.getvalue().splitlines()[-1].startswith("precompile: 16 workers (one per CPU) capped at 2 (16 CPUs")
    monkeypatch.setattr(runner, "available_memory", lambda: None)  # unknown: the CPUs alone
    assert runner.capped_jobs(20, "precompile", io.StringIO()) == 16


def test_run_parallel_starts_no_more_workers_than_the_cap(monkeypatch):
    started = []

    class Pool:  # runs each task at once, in this process
        def __init__(self, max_workers, **kwargs):
            started.append(max_workers)

        def submit(self, fn, *args):
            fut = Future()
            fut.set_result(fn(*args))
            return fut

        def shutdown(self, **kwargs):
            pass

    monkeypatch.setattr(runner, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(runner, "usable_cpus", lambda: 2)
    monkeypatch.setattr(runner, "available_memory", lambda: 2**40)
    out = io.StringIO()
    results = runner.run_parallel(abs, [-1, -2, -3, -4, -5], 12, "test", stream=out)
    assert started == [2] and [r.value for r in results] == [1, 2, 3, 4, 5]
    assert out.getvalue().startswith("test: --jobs 12 capped at 2 (2 CPUs")


def test_every_jobs_option_says_it_is_capped(capsys):
    for cmd in ("precompile", "export", "catalog"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "upper bound: the CPU count, and one per" in " ".join(capsys.readouterr().out.split()), cmd


# ------------------------------------------------------------------------------------------------
# Export: built beside --out, swapped in when complete
# ------------------------------------------------------------------------------------------------
def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _export_dir(path, files, listed=None):
    (path / "kernels").mkdir(parents=True)
    for rel, text in files.items():
        (path / rel).write_text(text)
    record = {"files": sorted(files if listed is None else listed) + [E.EXPORT_RECORD]}
    (path / E.EXPORT_RECORD).write_text(json.dumps(record))


def test_a_complete_export_replaces_the_previous_one_and_keeps_other_files(tmp_path):
    new = {"CMakeLists.txt": "new", "kernels/b.o": "new"}
    build, out = tmp_path / ".out.partial-1", tmp_path / "out"
    _export_dir(build, new)
    E.swap_in(build, out)  # nothing there yet
    assert _tree(out) == {**new, E.EXPORT_RECORD: (out / E.EXPORT_RECORD).read_text()} and not build.exists()
    # only an earlier export in --out: replaced whole
    _export_dir(build, {"CMakeLists.txt": "newer", "kernels/c.o": "newer"})
    E.swap_in(build, out)
    assert set(_tree(out)) == {"CMakeLists.txt", "kernels/c.o", E.EXPORT_RECORD} and not build.exists()
    # other files beside it (the user's): they stay, the earlier export's files go
    (out / "notes.txt").write_text("mine")
    _export_dir(build, {"CMakeLists.txt": "newest", "kernels/d.o": "newest"})
    E.swap_in(build, out)
    tree = _tree(out)
    assert {k: tree[k] for k in ("CMakeLists.txt", "kernels/d.o", "notes.txt")} == {
        "CMakeLists.txt": "newest", "kernels/d.o": "newest", "notes.txt": "mine"}
    assert "kernels/c.o" not in tree and not build.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_what_a_killed_export_left_beside_out_is_tidied(tmp_path):
    out = tmp_path / "out"
    dead = 2**22 + 12345  # above Linux's default pid_max: no such process
    _export_dir(tmp_path / f".out.previous-{dead}", {"CMakeLists.txt": "previous"})
    _export_dir(tmp_path / f".out.partial-{dead}", {"CMakeLists.txt": "partial"})
    E.recover_abandoned(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "CMakeLists.txt").read_text() == "previous"


# ------------------------------------------------------------------------------------------------
# Precompile: the kernel cache's temporary directories
# ------------------------------------------------------------------------------------------------
def test_leftover_temp_dirs_are_removed_unless_an_entry_is_being_written(tmp_path):
    (tmp_path / "tmpabc").mkdir()
    (tmp_path / "tmpdef").mkdir()
    (tmp_path / "tmpdef" / "k.o").write_text("half")
    (tmp_path / "entry.so").write_text("done")
    for name in ("entry.so.lock", "other.so.lock"):
        (tmp_path / name).write_text("")
    with open(tmp_path / "other.so.lock") as held:  # a process linking an entry now
        fcntl.flock(held, fcntl.LOCK_EX)
        assert P.remove_stale_temp_dirs(tmp_path) == 0
        assert (tmp_path / "tmpabc").is_dir()
    assert P.remove_stale_temp_dirs(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry.so", "entry.so.lock", "other.so.lock"]


def test_an_interrupted_precompile_leaves_no_temp_dir_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTEDSL_GEMM_CACHE_DIR", str(tmp_path))

    def interrupted(fn, todo, *a, **k):
        entry = jit.KERNEL_CACHE.entry_path(*P.cache_key(todo[0]))
        (entry.parent / "tmpk2x9").mkdir(parents=True)  # as a worker stopped while linking leaves it
        (entry.parent / (entry.name + ".lock")).write_text("")
        raise Interrupted([], len(todo))

    monkeypatch.setattr(P, "run_parallel", interrupted)
    with pytest.raises(Interrupted):
        P.precompile("sm_90a", [ROW_BF16], stream=io.StringIO())
    assert not [p for p in tmp_path.rglob("tmp*")]


# ------------------------------------------------------------------------------------------------
# A C compiler
# ------------------------------------------------------------------------------------------------
def test_a_missing_c_compiler_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(E.ExportError, match=r"a C compiler \(cc, gcc or clang, or \$CC\) is required") as e:
        E.build_shared(tmp_path)
    assert "\n" not in str(e.value) and "no-such-cc" in str(e.value)
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang on it
    with pytest.raises(E.ExportError, match="none of cc, gcc, clang is on PATH"):
        E.c_compiler()
    # precompile links the cache's entries with one: refused before any worker starts
    monkeypatch.setenv("CUTEDSL_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(P, "run_parallel", lambda *a, **k: pytest.fail("compiled without a C compiler"))
    assert main(["precompile", "--filter", ROW_BF16]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("cutedsl-gemm precompile: a C compiler (cc, gcc or clang, or $CC) is required to fill the "
                       "kernel cache: cc not found")


# ------------------------------------------------------------------------------------------------
# Demo: the mixture-of-experts section
# ------------------------------------------------------------------------------------------------
@pytest.mark.compile
def test_demo_moe_without_a_gpu_compiles_the_grouped_gemm_and_converts_a_tiny_mixtral(monkeypatch, capsys):
    pytest.importorskip("transformers")
    from cutedsl_gemm.tools import cli

    monkeypatch.setattr(cli, "_hopper_available", lambda: False)
    assert cli._demo_moe() is True
    out = capsys.readouterr().out
    assert "sm_90a_grouped_gemm_contiguous_row_e4m3xe4m3_bf16" in out
    assert " x WGMMA e4m3 x e4m3: wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3\n" in out
    assert " x TMA load: cp.async.bulk.tensor.2d.shared::cta.global.tile." in out and "MISSING" not in out
    assert ("tiny Mixtral (2 layers, 4 experts, top-2): recipe 'row': 8 linear layers and 2 experts modules "
            "converted, 1 skipped\n") in out
    assert " x lanes grouped by expert: match.any.sync.b32" in out and " x e4m3 conversion: cvt.rn.satfinite" in out
    assert out.rstrip().splitlines()[-1] == ("PASS: grouped GEMM PTX (WGMMA e4m3, TMA loads), routing PTX and the MoE "
                                             "conversion")


def _two_experts_converted():
    from cutedsl_gemm import nn as cnn

    report = cnn.ConversionReport("row")
    report.converted_experts.extend(["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"])
    return report


def test_demo_moe_fails_without_tma_loads_or_converted_experts(monkeypatch, capsys):
    from cutedsl_gemm import nn as cnn
    from cutedsl_gemm.tools import cli, ptx_inspect

    wgmma = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%f1}, %rd1, %rd2;\n"
    tma = "cp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r1], [%rd3, {%r2, %r3}];\n"
    monkeypatch.setattr(cli, "_hopper_available", lambda: False)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)  # (a GPU would excuse kept experts)
    monkeypatch.setattr(cli, "_no_transformers", lambda: False)
    monkeypatch.setattr(cli, "_tiny_mixtral", lambda device: (None, None, cnn.ConversionReport("row")))
    monkeypatch.setattr(ptx_inspect, "inspect_instance", lambda inst: ptx_inspect.KernelReport(inst.name, ptx=wgmma))
    assert cli._demo_moe() is False
    out = capsys.readouterr().out
    assert "    MISSING TMA load\n" in out and "MISSING WGMMA" not in out
    assert out.rstrip().splitlines()[-1].startswith("FAIL: grouped GEMM PTX")
    # every instruction there, but the experts kept in bf16: still a failure
    monkeypatch.setattr(ptx_inspect, "inspect_instance",
                        lambda inst: ptx_inspect.KernelReport(inst.name, ptx=wgmma + tma))
    assert cli._demo_moe() is False
    out = capsys.readouterr().out
    assert "MISSING" not in out and "recipe 'row': 0 linear layers converted, 0 skipped" in out
    assert "    experts kept: no reason given\n" in out
    assert out.rstrip().splitlines()[-1].startswith("FAIL")
    # the routing kernel without its per-expert counts: a failure too
    monkeypatch.setattr(cli, "_tiny_mixtral", lambda device: (None, None, _two_experts_converted()))
    monkeypatch.setattr(cli, "_route_ptx", lambda: "cvt.rn.satfinite.e4m3x2.f32 %rs1, %f1, %f2;\n")
    assert cli._demo_moe() is False
    out = capsys.readouterr().out
    assert "    MISSING lanes grouped by expert\n" in out and "    MISSING per-expert count\n" in out
    assert out.rstrip().splitlines()[-1].startswith("FAIL")


@pytest.mark.parametrize("moe, rc", [(True, 0), (False, 1)])
def test_demo_fails_when_its_moe_section_fails(monkeypatch, moe, rc):
    from cutedsl_gemm.tools import cli

    monkeypatch.setattr(cli, "_hopper_available", lambda: False)
    monkeypatch.setattr(cli, "_demo_cpu", lambda: 0)
    monkeypatch.setattr(cli, "_demo_moe", lambda: moe)
    monkeypatch.setattr(cli, "_demo_model", lambda: True)
    assert cli.cmd_demo(None) == rc
