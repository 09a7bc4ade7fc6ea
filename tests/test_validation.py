"""Bad input gets a clear error (CPU: the checks themselves; GPU tier: through scaled_mm)."""

import pytest
import torch

import cutedsl_gemm
from cutedsl_gemm import problem as V
from cutedsl_gemm.ops import scaled_mm as api


def fp8(*shape):
    return torch.randn(*shape).to(torch.float8_e4m3fn)


def test_cpu_tensors_are_rejected_with_device_named():
    one = torch.ones(())
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        cutedsl_gemm.scaled_mm(fp8(4, 32), fp8(16, 32).t(), one, one)


def test_dtype_checks():
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.float8_e5m2"):
        V.require_fp8("a", torch.randn(4, 4))
    with pytest.raises(TypeError, match="out_dtype must be"):
        V.require_out_dtype(torch.int8)


def test_k_major_and_tma_alignment_checks():
    with pytest.raises(ValueError, match="must be K-major"):
        V.require_k_major("a", fp8(32, 64).t(), 1, "row-major (M, K)")
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        V.require_k_major("a", fp8(8, 40), 1, "row-major (M, K)")
    base = fp8(8, 80)
    with pytest.raises(ValueError, match="16-byte aligned base address"):
        V.require_k_major("a", base[:, 1:65], 1, "row-major (M, K)")
    with pytest.raises(ValueError, match="packed rows .* row stride 80 != K=64"):
        V.require_k_major("a", base[:, :64], 1, "row-major (M, K)")  # aligned, but rows padded to 80
    V.require_k_major("b", fp8(64, 32).t(), 0, "column-major")  # the torch._scaled_mm layout passes


@pytest.mark.gpu
def test_gpu_bad_inputs():
    dev = "cuda"
    a = torch.randn(64, 256, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(128, 256, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        cutedsl_gemm.scaled_mm(a, w[:, :128].t(), one, one)
    with pytest.raises(ValueError, match="must be K-major"):
        cutedsl_gemm.scaled_mm(a, w.t().contiguous(), one, one)
    with pytest.raises(TypeError, match="float8"):
        cutedsl_gemm.scaled_mm(a.float(), w.t(), one, one)
    with pytest.raises(ValueError, match="on one device|must be a CUDA tensor"):
        cutedsl_gemm.scaled_mm(a, w.t(), torch.ones(()), one)
    with pytest.raises(ValueError, match="bias must have shape"):
        cutedsl_gemm.scaled_mm(a, w.t(), one, one, bias=torch.ones(3, device=dev, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        cutedsl_gemm.scaled_mm(a, w.t(), one, one, out=torch.empty(64, 64, device=dev, dtype=torch.bfloat16))
    a2 = torch.randn(64, 264, device=dev).to(torch.float8_e4m3fn)[:, :260]
    w2 = torch.randn(128, 260, device=dev).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16"):
        cutedsl_gemm.scaled_mm(a2, w2.t(), one, one)


# ------------------------------------------------------------------------------------------------
# scaled_mm's arguments, routed on CPU tensors as if on a GPU (everything up to the launch)
# ------------------------------------------------------------------------------------------------

from torch.nn.functional import ScalingType, SwizzleType  # noqa: E402

from cutedsl_gemm.numerics import codecs  # noqa: E402
from cutedsl_gemm.numerics import reference as R  # noqa: E402
from cutedsl_gemm.runtime import launch  # noqa: E402
from cutedsl_gemm.selection import dispatch  # noqa: E402


class Launched(Exception):
    """Raised where scaled_mm would plan the launch: carries what it chose."""


@pytest.fixture
def route(monkeypatch):
    """``route(arch, sms, *args, **kwargs)``: call ``cutedsl_gemm.scaled_mm(*args, **kwargs)`` with CPU tensors as
    if they were on a GPU of ``arch`` with ``sms`` SMs; returns (problem, operands, instance, K splits) it would
    launch."""
    described = []
    describe_scaled_mm = V.describe_scaled_mm

    def describe(*args, **kwargs):
        described.append(describe_scaled_mm(*args, **kwargs))
        return described[-1]

    def fake_plan(inst, m, n, splits, device_index, **kw):
        raise Launched(inst, splits)

    def run(arch, sms, *args, **kwargs):
        monkeypatch.setattr(V, "require_cuda_tensors", lambda **tensors: torch.device("cpu"))
        monkeypatch.setattr(V, "device_info", lambda index: (arch, sms))
        monkeypatch.setattr(api.P, "describe_scaled_mm", describe)
        monkeypatch.setattr(dispatch, "launch_clusters", lambda index, inst: sms // (inst.cluster_m * inst.cluster_n))
        monkeypatch.setattr(launch, "plan", fake_plan)
        with pytest.raises(Launched) as launched:
            cutedsl_gemm.scaled_mm(*args, **kwargs)
        inst, splits = launched.value.args
        return (*described[-1], inst, splits)

    return run


H100 = ("sm_90a", 132)
B200 = ("sm_100a", 148)


def test_positional_arguments_follow_torch_scaled_mm(route):
    """torch._scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum): the same positions."""
    a, w = fp8(256, 512), fp8(384, 512)
    one = torch.ones(())
    bias = torch.zeros(384)
    p, ops, inst, _ = route(*H100, a, w.t(), one, one, bias, None, torch.float32, True)
    assert (p.out_name, p.bias_name, p.accum, p.recipe) == ("fp32", "fp32", "fast", "tensor")
    assert ops.bias is bias and (inst.out_dtype, inst.bias_dtype, inst.accum) == ("fp32", "fp32", "fast")
    p, _, inst, _ = route(*H100, a, w.t(), one, one, bias.bfloat16())  # defaults: bf16 out, promoted
    assert (p.out_name, p.bias_name, p.accum) == ("bf16", "bf16", "promoted") and inst.bias_dtype == "bf16"
    with pytest.raises(ValueError, match="scale_result .* must be None.*out_dtype by keyword"):
        cutedsl_gemm.scaled_mm(a, w.t(), one, one, None, torch.float32)  # out_dtype in scale_result's place


def test_recipes_and_lists_route_to_the_blackwell_kernels(route):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 256, generator=g), torch.randn(64, 256, generator=g)
    # FP6 x FP4 with per-tensor scales: the dense kernel, 2-CTA above M = 128, the bias read as fp32
    a6 = codecs.quantize_operand(x, "e2m3")
    w4 = codecs.quantize_operand(w, "e2m1", as_float4_x2=True)
    one = torch.ones(1)
    p, ops, inst, splits = route(*B200, a6, w4.t(), one, one, torch.ones(64, dtype=torch.float16),
                                 out_dtype=torch.float16, fmt_a="e2m3")
    assert (p.a_format, p.b_format, p.k, inst.mma_kind, inst.schedule, inst.bias_dtype, splits) == \
        ("e2m3", "e2m1", 256, "f8f6f4", "2sm", "fp32", 1)
    assert ops.a.dtype == torch.uint8 and ops.a.shape == (300, 192) and ops.bias.dtype == torch.float32
    # NVFP4 as F.scaled_mm passes it: [block scales, global scale] with [BlockWise1x16, TensorWise]
    qa, qw = R.quantize_nvfp4_reference(x[:100]), R.quantize_nvfp4_reference(w)
    rec = [ScalingType.BlockWise1x16, ScalingType.TensorWise]
    p, ops, inst, _ = route(*B200, qa.data, qw.data.t(), [qa.scales, qa.global_scale], [qw.scales, qw.global_scale],
                            scale_recipe_a=rec, scale_recipe_b=rec, swizzle_a=SwizzleType.SWIZZLE_32_4_4)
    assert (p.recipe, inst.mma_kind, inst.schedule) == ("nvfp4", "mxf4nvf4", "1sm")
    assert float(ops.global_a) == float(qa.global_scale) and ops.scale_a.dtype == torch.int32
    # MX: the e8m0 scales name the recipe; mixed formats go to mxf8f6f4
    qa, qw = R.quantize_mx_reference(x, "e4m3"), R.quantize_mx_reference(w, "e2m1")
    p, _, inst, _ = route(*B200, qa.data, qw.data.t(), qa.scales, qw.scales, schedule="1sm")
    assert (p.recipe, inst.mma_kind, inst.schedule) == ("mx", "mxf8f6f4", "1sm")


def test_what_an_arch_does_not_run_is_refused_with_what_it_runs(route):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(128, 256, generator=g), torch.randn(64, 256, generator=g)
    mx_a, mx_w = R.quantize_mx_reference(x, "e4m3"), R.quantize_mx_reference(w, "e4m3")
    hopper_runs = "sm_90a runs e4m3 / e5m2 / int8 operands with TensorWise, RowWise"
    with pytest.raises(ValueError, match=f"BlockWise1x32 \\(mx\\) block scales run on Blackwell.*{hopper_runs}"):
        route(*H100, mx_a.data, mx_w.data.t(), mx_a.scales, mx_w.scales)
    with pytest.raises(ValueError, match="BlockWise1x16 \\(nvfp4\\) block scales run on Blackwell"):
        route(*H100, fp8(128, 256), fp8(64, 256).t(), torch.ones(()), torch.ones(()),
              scale_recipe_a="BlockWise1x16", scale_recipe_b="BlockWise1x16")
    a6 = codecs.quantize_operand(x, "e2m3")
    with pytest.raises(ValueError, match=f"e2m3 operands in torch.uint8 run on Blackwell.*{hopper_runs}"):
        route(*H100, a6, fp8(64, 256).t(), torch.ones(()), torch.ones(()), fmt_a="e2m3")
    with pytest.raises(TypeError, match="packed FP4 / FP6 operands run on Blackwell"):
        route(*H100, codecs.quantize_operand(x, "e2m1", as_float4_x2=True), fp8(64, 128).t(), torch.ones(()),
              torch.ones(()))
    with pytest.raises(ValueError, match="lists of scales .* NVFP4's"):
        route(*H100, fp8(128, 256), fp8(64, 256).t(), [torch.ones(()), torch.ones(())], torch.ones(()))
    with pytest.raises(ValueError, match="SWIZZLE_32_4_4 scales are the MX / NVFP4"):
        route(*H100, fp8(128, 256), fp8(64, 256).t(), torch.ones(()), torch.ones(()),
              swizzle_a=SwizzleType.SWIZZLE_32_4_4)
    blackwell_runs = "sm_100a runs e4m3 / e5m2 / e3m2 / e2m3 / e2m1 operands with TensorWise, BlockWise1x32 scales"
    with pytest.raises(ValueError, match=f"RowWise scales do not run on sm_100a; {blackwell_runs}"):
        route(*B200, fp8(128, 256), fp8(64, 256).t(), torch.ones(128, 1), torch.ones(1, 64),
              scale_recipe_a="rowwise", scale_recipe_b=ScalingType.RowWise)
    with pytest.raises(ValueError, match="TensorWise x BlockWise1x32 do not run on sm_100a"):
        route(*B200, mx_a.data, mx_w.data.t(), torch.ones(1), mx_w.scales)
    with pytest.raises(RuntimeError, match="kernels for Hopper \\(sm_90a\\) and Blackwell \\(sm_100a\\) GPUs; "
                                           "sm_120a is neither"):
        V.describe_scaled_mm(fp8(8, 32), fp8(16, 32).t(), torch.ones(()), torch.ones(()), None, torch.bfloat16,
                             None, False, None, None, None, None, torch.device("cpu"), target=("sm_120a", 84))
