"""The "torch" variant of the model benchmarks: for each recipe of ``cutedsl_gemm.nn``, the linear layer a torch
user writes with torch's own kernels (``TORCH_PATHS``, ``torch_path``): FP8 recipes through
``baselines.TorchFp8Linear`` (torch-side quantization + ``torch._scaled_mm``, ``F.scaled_mm`` for block scales);
"int8": torch-side per-token int8 quantization + ``torch._int_mm`` + the scale multiply; "int8_weight":
``torch._weight_int8pack_mm``; "int4_weight": ``torch._weight_int4pack_mm`` (group 128). Other recipes have none.
"""

from __future__ import annotations

import torch

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.tools.baselines import TorchFp8Linear, int_mm_call


# ---- torch's integer linear layers ------------------------------------------------------------------------------
def torch_quantize_int8(x: torch.Tensor):
    """Per-row symmetric int8 quantization as written in plain torch: ``scale = max(amax, 1e-12) / 127``,
    ``q = round(x / scale)`` clamped to [-127, 127]. x (rows, K) -> (q int8, scales (rows, 1) fp32)."""
    scales = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    return (x.float() / scales).round_().clamp_(-127, 127).to(torch.int8), scales


class _TorchLinear(torch.nn.Module):
    """The shape checks and reshapes of the torch-path layers: bf16 (..., K) -> (..., N) bf16."""

    def __init__(self, weight, bias):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x):
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects bf16 input (..., {self.in_features}), got {x.dtype} "
                             f"{tuple(x.shape)}")
        y = self.matmul(x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_linear(cls, linear):
        return cls(linear.weight, linear.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}"


class TorchInt8Linear(_TorchLinear):
    """W8A8 as a torch user writes it: the weight quantized per output channel once, the activations per token on
    every call (:func:`torch_quantize_int8`), ``torch._int_mm`` and the scale multiply in torch
    (``baselines.int_mm_call``). ``torch._int_mm`` refuses M <= 16: smaller inputs are padded to 32 rows."""

    MIN_ROWS = 32

    def __init__(self, weight, bias=None):
        super().__init__(weight, bias)
        qw, sw = torch_quantize_int8(weight.detach())
        self.register_buffer("weight", qw)
        self.register_buffer("weight_scale", sw.reshape(1, -1))

    def matmul(self, x2):
        qx, sx = torch_quantize_int8(x2)
        m = qx.shape[0]
        if m < self.MIN_ROWS:
            qx = torch.nn.functional.pad(qx, (0, 0, 0, self.MIN_ROWS - m))
            sx = torch.nn.functional.pad(sx, (0, 0, 0, self.MIN_ROWS - m), value=1.0)
        return int_mm_call(qx, self.weight.t(), sx, self.weight_scale, self.bias)()[:m]


class TorchInt8WeightLinear(_TorchLinear):
    """Weight-only int8 through ``torch._weight_int8pack_mm``: the weight quantized per output channel once
    (``int_packing.quantize_weights``), bf16 activations, bf16 scales as the op takes them."""

    def __init__(self, weight, bias=None):
        super().__init__(weight, bias)
        q, s, _ = IP.quantize_weights(weight.detach(), bits=8, group=IP.PER_CHANNEL)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", s.reshape(-1).to(torch.bfloat16))

    def matmul(self, x2):
        y = torch._weight_int8pack_mm(x2, self.weight, self.weight_scale)
        return y if self.bias is None else y + self.bias


class TorchInt4WeightLinear(_TorchLinear):
    """Weight-only int4 through ``torch._weight_int4pack_mm`` (``_for_cpu`` on the CPU), group 128: the weight
    quantized symmetrically once (``int_packing.quantize_weights``: codes c in [-8, 7], one fp32 scale per group),
    stored as torch's unsigned codes c + 8 with (K / group, N, 2) bf16 (scale, zero = 0), since torch dequantizes
    ``(u - 8) * scale + zero``. On CUDA torch packs two codes a byte, the even K index in the high nibble."""

    GROUP = 128
    INNER_K_TILES = 8

    def __init__(self, weight, bias=None):
        super().__init__(weight, bias)
        codes, scales, _ = IP.quantize_weights(weight.detach(), bits=4, group=self.GROUP)
        u = codes.to(torch.int32) + 8
        if weight.is_cuda:
            packed = torch._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8),
                                                       self.INNER_K_TILES)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(u, self.INNER_K_TILES)
        self.register_buffer("weight", packed)
        sz = torch.stack([scales, torch.zeros_like(scales)], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))

    def matmul(self, x2):
        mm = torch._weight_int4pack_mm if x2.is_cuda else torch._weight_int4pack_mm_for_cpu
        y = mm(x2, self.weight, self.GROUP, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


#: the torch-only layer of each recipe name: (recipe -> (make(linear) or None, what it runs))
TORCH_PATHS = {
    "int8": (TorchInt8Linear.from_linear, "torch-side per-token int8 quantization + torch._int_mm + scale multiply"),
    "int8_weight": (TorchInt8WeightLinear.from_linear, "torch._weight_int8pack_mm (per-channel int8 weights)"),
    "int4_weight": (TorchInt4WeightLinear.from_linear, "torch._weight_int4pack_mm (int4 weights, group 128)"),
}


def torch_path(recipe: str):
    """(make(linear) -> torch-only layer, or None; what it runs) for a recipe of ``cnn.LINEAR_RECIPES``."""
    if recipe in TORCH_PATHS:
        return TORCH_PATHS[recipe]
    r = cnn.linear_recipe(recipe)
    scaling = r.scaling
    if r.element == "e4m3" and getattr(scaling, "name", None) in TorchFp8Linear.RECIPES:
        call = "torch._scaled_mm" if scaling.name in ("tensor", "row") else "F.scaled_mm"
        return (lambda linear: TorchFp8Linear.from_linear(linear, scaling),
                f"torch-side FP8 quantization + {call} ({scaling.name})")
    return None, f"no torch path for {recipe!r}: ours is compared with bf16 only"
