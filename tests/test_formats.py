"""The host tables (numerics/formats.py): element formats and the dtype map, scale granularities and their
names, the recipe table and its lookup rule, and the device-side copies that must agree with them."""

import pytest
import torch
import torch.nn.functional as TF

from cutedsl_gemm.numerics import formats as F

G = F.ScaleGranularity


def test_formats_tables():
    assert F.element_format(torch.float8_e4m3fn) is F.E4M3
    assert F.E2M1.max_finite == 6.0 and F.E2M3.max_finite == 7.5 and F.E3M2.max_finite == 28.0
    assert F.recipe("1x128_128x128").k_block == 128 and F.recipe("row").k_block is None
    with pytest.raises(ValueError, match="unknown scaling recipe"):
        F.recipe("nope")


def test_format_derived_numbers():
    # largest finite code and emax, written out from the OCP tables
    assert [(f.name, f.max_code, f.emax) for f in (F.E4M3, F.E5M2, F.E3M2, F.E2M3, F.E2M1)] == [
        ("e4m3", 0x7E, 8), ("e5m2", 0x7B, 15), ("e3m2", 0x1F, 4), ("e2m3", 0x1F, 2), ("e2m1", 0x7, 2)]
    assert F.UE8M0.max_code == 0xFE
    for f in (F.E4M3, F.E5M2, F.BF16, F.FP16):  # the max code is the max value, where torch has the dtype
        code = torch.tensor([f.max_code], dtype=torch.int32).to(torch.uint8 if f.bits == 8 else torch.int16)
        assert code.view(f.torch_dtype).item() == f.max_finite


def test_one_dtype_map():
    """torch dtype <-> short name <-> cutlass type name, for the element and the wide float types."""
    import cutlass

    assert {d: f.name for d, f in F.DTYPE_FORMATS.items() if f in F.FLOAT_FORMATS} == {
        torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    assert {f.torch_dtype: f.name for f in F.FP8_FORMATS} == {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    for f in (*F.ELEMENT_FORMATS.values(), *F.FLOAT_FORMATS):
        assert isinstance(f.cutlass_dtype(), type) and f.cutlass_dtype() is getattr(cutlass, f.cutlass_name)
        if f.torch_dtype is not None:
            assert F.DTYPE_FORMATS[f.torch_dtype] is f
    assert F.float_format(torch.float16) is F.FP16 and F.float_format("bf16") is F.BF16
    with pytest.raises(TypeError, match="torch.bfloat16, torch.float16 or torch.float32"):
        F.float_format(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="low-precision"):
        F.element_format(torch.bfloat16)


def test_ceil_div_and_round_up():
    assert [F.ceil_div(a, 128) for a in (0, 1, 128, 129)] == [0, 1, 1, 2]
    assert F.round_up(5, 4) == 8 and F.round_up(8, 4) == 8


def test_granularity_names():
    for g in G:
        for name in g.names:
            assert G.named(name) is g and G.named(name.upper()) is g
        assert G.named(getattr(TF.ScalingType, g.scaling_type)) is g
    assert G.named("per_tensor") is G.TENSOR and G.named("group") is G.GROUP_1x128
    assert G.named("block") is G.BLOCK_128x128
    assert G.GROUP_1x128.value == (1, 128) and G.ROW.cols is None  # the value stays (rows, cols)
    with pytest.raises(ValueError, match="unknown scale granularity '1x64'.*'1x128'.*BlockWise128x128"):
        G.named("1x64")


def test_recipe_lookup_rule():
    """A granularity names the recipe that uses it on both operands; recipe names and objects pass through."""
    for r in F.RECIPES.values():
        assert F.recipe(r.name) is r and F.recipe(r) is r
        if r.a is r.b:
            for name in (*r.a.names, r.a):
                assert F.recipe(name) is r
    assert F.recipe("1x128") is F.GROUP_1x128_1x128 and F.recipe("128x128") is F.BLOCK_128x128_128x128
    assert F.recipe("tensor") is F.TENSORWISE and F.recipe(TF.ScalingType.BlockWise1x32) is F.MX_1x32
    with pytest.raises(ValueError, match=r"unknown scaling recipe '1x64'; expected a recipe name \(tensor, row, "
                                         r"1x128_128x128.*or a granularity both operands use \(tensor, row, 1x128"):
        F.recipe("1x64")


def test_device_block_recipes_agree_with_the_recipe_table():
    """kernels/sm90/block_scales.BLOCK_RECIPES (device side, cannot import the host table) names the same
    block recipes with the same (A, W) granularities as formats.RECIPES."""
    from cutedsl_gemm.kernels.sm90.block_scales import BLOCK_RECIPES, SCALE_BLOCK

    host = {r.name: (r.a, r.b) for r in F.RECIPES.values() if r.scale_format == "fp32" and r.in_mainloop}
    assert set(BLOCK_RECIPES) == set(host)
    for name, (ga, gw) in BLOCK_RECIPES.items():
        assert (G.named(ga), G.named(gw)) == host[name], name
        assert F.RECIPES[name].k_block == SCALE_BLOCK


def test_device_quantizer_numbers_agree_with_the_formats():
    """The block-scale quantizer kernel gets every format fact from the host as plain numbers."""
    from cutedsl_gemm.numerics import reference as R
    from cutedsl_gemm.ops.quantize import _block_recipe, _element_code

    e4m3 = _element_code(F.E4M3)
    assert e4m3 == (8, 3, 7, 0x43E00000, 0x7E, 8)
    nv = _block_recipe("nvfp4", F.E2M1)
    assert (nv.block, nv.scale_nan, nv.scale, nv.global_denom) == (16, 0x7F, e4m3, 2688.0)
    assert _block_recipe("mx", F.E3M2)[:3] == ("mx", 32, 0xFF)
    assert R.UE8M0_NAN == (1 << F.UE8M0.bits) - 1 and R.E4M3_NAN == F.E4M3.max_code + 1
    with pytest.raises(ValueError, match="NVFP4 elements are e2m1"):
        _block_recipe("nvfp4", F.E4M3)
    with pytest.raises(ValueError, match="'mx' or 'nvfp4'"):
        _block_recipe("fp8", F.E4M3)
