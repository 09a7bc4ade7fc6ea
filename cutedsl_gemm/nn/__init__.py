"""Models: ``QuantizedLinear`` (a linear layer on the low-precision kernels: FP8, MX, NVFP4, INT8 W8A8, int8 / int4
weight-only), ``QuantizedExperts`` (transformers' mixture-of-experts experts on the grouped FP8 GEMM), ``convert``
(swap a model's ``nn.Linear`` layers and its experts modules in place) and the recipes they
run (``LINEAR_RECIPES``).

    from cutedsl_gemm import nn as cnn
    report = cnn.convert(model, recipe="row")      # report.converted, report.skipped (name -> why)
    layer = cnn.QuantizedLinear.from_linear(linear, recipe="deepseek")
    cnn.convert(moe_model, recipe="row")          # the experts modules too: cnn.QuantizedExperts
    cnn.fuse(model)                                # q/k/v as one GEMM; gate/up as one, SiLU in the quantizer
    torch.compile(model, fullgraph=True)           # one torch.ops.cutedsl_gemm.fp8_linear per layer
    cnn.save_pretrained(model, path); model, report = cnn.from_pretrained(path)   # saved and loaded as they are
"""

from .checkpoint import from_pretrained, save_pretrained
from .convert import ConversionReport, convert
from .fused_qkv import fuse, fuse_qkv
from .gated_mlp import QuantizedGatedMLP, fuse_gated_mlps
from .linear import FORMAT_VERSION, Fp8Linear, QuantizedLinear
from .moe import QuantizedExperts
from .recipes import LINEAR_RECIPES, LinearRecipe, linear_recipe

__all__ = ["QuantizedLinear", "QuantizedExperts", "Fp8Linear", "convert", "ConversionReport", "from_pretrained",
           "save_pretrained", "LINEAR_RECIPES", "LinearRecipe", "linear_recipe", "FORMAT_VERSION", "QuantizedGatedMLP",
           "fuse_gated_mlps", "fuse_qkv", "fuse"]
