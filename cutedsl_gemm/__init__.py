"""cutedsl_gemm: low-precision GEMM kernels for Hopper and Blackwell in the CuTe DSL, called from PyTorch."""

from cutedsl_gemm import nn  # (importing it registers the torch.ops.cutedsl_gemm operators)
from cutedsl_gemm.numerics.formats import ELEMENT_FORMATS, RECIPES, ElementFormat, ScalingRecipe, element_format, recipe
from cutedsl_gemm.ops.gated import silu_mul_quantize_fp8
from cutedsl_gemm.ops.grouped import grouped_scaled_mm
from cutedsl_gemm.ops.moe_route import route_quantize_fp8, sum_routed_pairs
from cutedsl_gemm.ops.quantize import quantize_fp8, quantize_int8, quantize_mx, quantize_nvfp4
from cutedsl_gemm.ops.scaled_mm import quantize_scaled_mm, scaled_mm, scaled_mm_fp8_out
from cutedsl_gemm.ops.weight_only import mm_weight_only

__version__ = "0.1.0"

__all__ = [
    "scaled_mm", "quantize_scaled_mm", "grouped_scaled_mm", "scaled_mm_fp8_out", "mm_weight_only", "quantize_fp8",
    "quantize_int8", "quantize_mx", "quantize_nvfp4", "silu_mul_quantize_fp8", "route_quantize_fp8", "sum_routed_pairs",
    "ELEMENT_FORMATS", "RECIPES", "ElementFormat", "ScalingRecipe", "element_format", "recipe", "nn",
]
