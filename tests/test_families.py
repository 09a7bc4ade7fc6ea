"""The kernel families and their registry (``cutedsl_gemm/families/``): every (arch, op) of the instance table has
exactly one family, every row passes its family's check, a family's resources are its kernel object's, and the
registry loads no DSL. Runs on the CPU (the kernels are built, not compiled)."""

import dataclasses
import subprocess
import sys

import pytest

from cutedsl_gemm.families import registry as R
from cutedsl_gemm.selection import instances as M

FAMILY_API = ("entry", "check", "resources")


def _first(**want):
    found = M.select(**want)
    assert found, want
    return found[0]


def test_every_arch_op_of_the_table_has_exactly_one_family():
    keys = {(i.arch, i.op) for i in M.table()}
    # no row without a family, no family key without rows
    assert keys == set(R.FAMILIES)
    for arch, op in keys:
        family = R.family_of(arch, op)
        assert [key for key, f in R.FAMILIES.items() if key == (arch, op)] == [(arch, op)]
        assert all(callable(getattr(family, name, None)) for name in FAMILY_API), family.__name__
    assert R.family_of(M.SM90, M.QUANT_GEMM) is R.family_of(M.SM90, "gemm") is R.family_of(M.SM90, M.GEMM_FP8_OUT)
    assert len({f.__name__ for f in R.FAMILIES.values()}) == 4
    # the GEMM families plan their launches for runtime.launch.plan; the grouped one launches its own calls
    for key, family in R.FAMILIES.items():
        assert callable(getattr(family, "launch_plan" if key[1] != M.GROUPED_GEMM else "launch", None)), key


def test_runtime_launch_dispatches_plans_to_the_families(monkeypatch):
    """runtime.launch.plan hands every argument to the instance's family's launch_plan and returns its plan."""
    from cutedsl_gemm.runtime import launch

    for arch, op in [(M.SM90, "gemm"), (M.SM90, M.WEIGHT_ONLY), (M.SM100, "gemm")]:
        inst, got = _first(arch=arch, op=op), []
        family = R.family_of(arch, op)
        monkeypatch.setattr(family, "launch_plan", lambda *args, got=got, **kw: got.append((args, kw)) or "the plan")
        assert launch.plan(inst, 100, 200, 1, 0, k=256, fmt_a="e4m3", fmt_b="e4m3") == "the plan"
        assert got == [((inst, 100, 200, 1, 0), dict(k=256, fmt_a="e4m3", fmt_b="e4m3"))], (arch, op)


def test_every_row_passes_its_family_check():
    assert M.validate_table() == len(M.table())


def test_an_unknown_arch_op_names_the_registered_ones():
    inst = dataclasses.replace(_first(arch=M.SM90, op="gemm"), op="no_such_op")
    with pytest.raises(R.UnknownFamilyError, match=r"arch=sm_90a op=no_such_op \(registered: sm_90a gemm, "):
        R.family(inst)
    with pytest.raises(M.InstanceTableError, match=r"no kernel family .* \(registered: .*sm_100a gemm\)"):
        M.validate(inst)
    from cutedsl_gemm.tools.ptx_inspect import kernel_resources

    with pytest.raises(ValueError, match="registered"):
        kernel_resources(inst)
    from cutedsl_gemm.runtime.compile import instance_entry

    with pytest.raises(ValueError, match="registered"):
        instance_entry(inst)


def test_family_checks_name_the_broken_rule():
    sm90 = _first(arch=M.SM90, op="gemm", schedule="cooperative")
    with pytest.raises(ValueError, match="multiple of 16"):
        R.family(sm90).check(dataclasses.replace(sm90, tile_n=100))
    wo = _first(op=M.WEIGHT_ONLY)
    with pytest.raises(ValueError, match="fixes"):
        R.family(wo).check(dataclasses.replace(wo, cluster_m=2))
    grouped = _first(op=M.GROUPED_GEMM)
    with pytest.raises(ValueError, match="clustered along M only"):
        R.family(grouped).check(dataclasses.replace(grouped, cluster_n=2))
    with pytest.raises(ValueError, match="2 CTAs along M with 128-row tiles"):
        R.family(grouped).check(dataclasses.replace(grouped, tile_m=64, cluster_m=2))
    sm100 = _first(arch=M.SM100)
    with pytest.raises(ValueError, match="bias is read as fp32"):
        R.family(sm100).check(dataclasses.replace(sm100, bias_dtype="bf16"))


def test_resources_are_the_kernel_objects():
    from cutedsl_gemm.kernels.sm90.fp8_gemm import Sm90Fp8Gemm
    from cutedsl_gemm.kernels.sm90.grouped_gemm import grouped_kernel, max_stages, stage_bytes
    from cutedsl_gemm.kernels.sm90.weight_only_gemm import Sm90WeightOnlyGemm, WeightOnlyPlan
    from cutedsl_gemm.tools.ptx_inspect import kernel_resources

    for inst in (_first(arch=M.SM90, op="gemm", schedule="small_m"), _first(arch=M.SM90, op="gemm", tile_n=192),
                 _first(op=M.QUANT_GEMM), _first(op=M.GEMM_FP8_OUT)):
        kernel = Sm90Fp8Gemm(inst.sm90_config())
        assert R.family(inst).resources(inst) == kernel_resources(inst) == (kernel.smem_bytes, kernel.ab_stages)
    for inst in (_first(op=M.WEIGHT_ONLY, tile_n=16), _first(op=M.WEIGHT_ONLY, tile_n=128)):
        cfg = M.weight_only_config(inst)
        kernel = Sm90WeightOnlyGemm(cfg)
        stages = WeightOnlyPlan.max_stages(cfg)
        assert kernel_resources(inst) == (kernel.smem_bytes, kernel.stages) == (WeightOnlyPlan.smem_usage(cfg, stages),
                                                                                stages)
    for inst in (_first(op=M.GROUPED_GEMM, recipe="row"), _first(op=M.GROUPED_GEMM, recipe="1x128_128x128"),
                 _first(op=M.GROUPED_GEMM, early_row_scales=True)):
        cfg = M.grouped_config(inst)
        kernel = grouped_kernel(cfg)
        assert kernel_resources(inst) == (kernel.smem_bytes, kernel.stages) == (
            1024 + max_stages(cfg) * stage_bytes(cfg), max_stages(cfg))


def test_sm100_resources_are_the_kernel_objects():
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import describe_resources
    from cutedsl_gemm.runtime.compile import targeting
    from cutedsl_gemm.tools.ptx_inspect import kernel_resources

    with targeting(M.SM100):
        dense = _first(arch=M.SM100, recipe="tensor", out_dtype="bf16", bias_dtype=None, schedule="1sm")
        res = describe_resources(dense.sm100_kernel())
        assert kernel_resources(dense) == (res["smem_bytes"], res["num_ab_stage"])
        assert res["num_ab_stage"] == 6  # 128x128 A + B stages (test_sm100_f8f6f4)
        scaled = _first(arch=M.SM100, recipe="nvfp4", schedule="2sm")
        res = describe_resources(scaled.sm100_kernel())
        assert kernel_resources(scaled) == (res["smem_bytes"], res["num_ab_stage"])


def test_entries_are_the_kernels_with_their_fake_arguments():
    """Each family's entry, as the runtime traces it (built, not compiled): the kernel entry the family names and
    its fake arguments, the TVM-FFI environment stream last."""
    from cutedsl_gemm.runtime.compile import instance_entry, targeting

    cases = ((_first(arch=M.SM90, op="gemm"), "Sm90Fp8Gemm", "__call__"),
             (_first(op=M.QUANT_GEMM), "Sm90Fp8Gemm", "__call__"),
             (_first(op=M.GEMM_FP8_OUT), "Sm90Fp8Gemm", "call_fp8_out"),
             (_first(op=M.WEIGHT_ONLY), "Sm90WeightOnlyGemm", "__call__"),
             (_first(op=M.GROUPED_GEMM, early_row_scales=False), "Sm90GroupedFp8Gemm", "__call__"),
             (_first(op=M.GROUPED_GEMM, early_row_scales=True), "Sm90GroupedFp8GemmEarlyRowScales", "__call__"),
             (_first(arch=M.SM100, recipe="tensor"), "Sm100F8F6F4Gemm", "__call__"),
             (_first(arch=M.SM100, recipe="mx"), "Sm100F8F6F4Gemm", "call_block_scaled"))
    for inst, cls, method in cases:
        with targeting(inst.arch):
            entry, args = instance_entry(inst)
        kernel = getattr(entry, "__self__", entry)
        assert (type(kernel).__name__, getattr(entry, "__name__", "__call__")) == (cls, method), inst.name
        assert type(args) is tuple and "Stream" in type(args[-1]).__name__, inst.name


def test_the_registry_imports_no_dsl():
    code = ("import sys\nimport cutedsl_gemm.families.registry as R\n"
            "assert R.FAMILIES\nassert 'cutlass' not in sys.modules, 'the registry imported the DSL'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
