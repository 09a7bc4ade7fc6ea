"""What the library is measured against: cuBLAS through torch for each recipe, on operands quantized by the
reference quantizer in the scale layouts torch takes; and ``TorchFp8Linear``, the FP8 linear layer a torch user
writes without this library. Used by ``cutedsl-gemm demo`` and the benchmarks."""

from __future__ import annotations

import torch

from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import E4M3, ScaleGranularity
from cutedsl_gemm.numerics.formats import recipe as as_recipe

# F.scaled_mm's scaling type per operand granularity of the block recipes
SCALING_TYPES = {"1x128": "BlockWise1x128", "128x128": "BlockWise128x128"}


def make_operands(m, n, k, recipe, device="cuda", fmt_a="e4m3", fmt_b="e4m3"):
    """Random data quantized with the reference quantizer; scales in the layouts torch takes for the recipe
    (torch._scaled_mm for tensor/row, F.scaled_mm's BlockWise1x128 / BlockWise128x128 otherwise).

    Returns (A, W, scale_a, scale_b, (A, plain scale_a, W, plain scale_w)); the last is what
    ``reference.reference_gemm`` takes.
    """
    a = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device)
    qa, sa_plain, qw, sw_plain = R.quantize_operands(a, w, recipe, fmt_a, fmt_b)
    rec = as_recipe(recipe)
    sa, sb = torch_scales(sa_plain, rec.a, "a"), torch_scales(sw_plain, rec.b, "b")
    return qa, qw, sa, sb, (qa, sa_plain, qw, sw_plain)


def torch_scales(s, gran, operand):
    """Plain (R, C) scales of operand "a" (A, (M, K)) or "b" (W, (N, K)) in the layout torch takes: () per tensor,
    (M, 1) / (1, N) per row (torch._scaled_mm), F.scaled_mm's block layouts otherwise (W's transposed)."""
    gran = ScaleGranularity.named(gran)
    if gran is ScaleGranularity.TENSOR:
        return s.reshape(())
    if gran is ScaleGranularity.ROW:
        return s.reshape(-1, 1).contiguous() if operand == "a" else s.reshape(1, -1).contiguous()
    blocks = torch_block_layout(s, gran.label)
    return blocks if operand == "a" else blocks.t()


def torch_block_layout(s, gran):
    """(rows or row blocks, Kb) scales in F.scaled_mm's layout: 1x128 outer-dim-major, 128x128 with the
    K-block axis padded to a multiple of 4 (the padded tensor is what cuBLAS takes)."""
    if gran == "1x128":
        rows, kb = s.shape  # strides exactly (1, rows), as F.scaled_mm checks them (also for rows == 1)
        return torch.empty_strided((rows, kb), (1, rows), device=s.device).copy_(s)
    kb = s.shape[1]
    padded = torch.ones(s.shape[0], -(-kb // 4) * 4, device=s.device)
    padded[:, :kb] = s
    return padded


def cublas_call(recipe, qa, b, sa, sb, use_fast_accum=False, bias=None):
    """cuBLAS through torch for the same recipe: torch._scaled_mm, or F.scaled_mm for block scales."""
    if recipe in ("tensor", "row"):
        return lambda: torch._scaled_mm(qa, b, sa, sb, bias=bias, out_dtype=torch.bfloat16,
                                        use_fast_accum=use_fast_accum)
    import torch.nn.functional as F

    ga, gb = (getattr(F.ScalingType, SCALING_TYPES[g]) for g in recipe.split("_"))
    return lambda: F.scaled_mm(qa, b, sa, ga, sb, gb, bias=bias, output_dtype=torch.bfloat16)


def int_mm_call(qa, b, sa, sb, bias=None):
    """The int8 (W8A8) GEMM as a torch user runs it: ``torch._int_mm`` (cuBLAS, int32 out; it refuses M <= 16)
    followed by the scale multiply (and bias) in torch, to bf16 -- the int32 product goes through memory. ``qa``
    (M, K) and ``b`` (K, N) int8, scales one element each or (M, 1) and (1, N) as ``scaled_mm`` takes them."""
    if bias is None:
        return lambda: torch._int_mm(qa, b).mul(sa).mul_(sb).to(torch.bfloat16)
    return lambda: torch._int_mm(qa, b).mul(sa).mul_(sb).add_(bias).to(torch.bfloat16)


# ---- the FP8 linear layer written with torch alone ------------------------------------------------------------


def torch_quantize_fp8(x, gran):
    """FP8 (E4M3) quantization as written in plain torch: per group of ``gran`` (tensor, row, 1x128, 128x128),
    ``scale = max(amax, 1e-12) / 448`` and ``q = clamp(x / scale, -448, 448)`` cast to E4M3. Returns
    ``(q, scales)`` with scales (R, C) fp32 in plain group order; x (rows, K) must hold whole groups."""
    gran = ScaleGranularity.named(gran)
    if x.dim() != 2:
        raise ValueError(f"torch_quantize_fp8 expects a 2-D (rows, K) tensor, got shape {tuple(x.shape)}")
    rows, k = x.shape
    gr, gc = gran.rows or rows, gran.cols or k
    if rows % gr or k % gc:
        raise ValueError(f"torch_quantize_fp8: a {tuple(x.shape)} tensor does not split into whole {gran.label} "
                         f"groups ({gr} x {gc})")
    groups = x.float().view(rows // gr, gr, k // gc, gc)
    scales = groups.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3.max_finite
    q = (groups / scales[:, None, :, None]).clamp(-E4M3.max_finite, E4M3.max_finite).to(E4M3.torch_dtype)
    return q.view(rows, k), scales


class TorchFp8Linear(torch.nn.Module):
    """An FP8 linear layer as a torch user writes it without this library: the weight quantized once by
    :func:`torch_quantize_fp8`, the activations quantized by it on every call, then ``torch._scaled_mm``
    (``F.scaled_mm`` for block scales), for the fp32-scaled recipes torch runs ("tensor", "row",
    "1x128_128x128"). bf16 activations (..., K) -> (..., N) bf16."""

    RECIPES = ("tensor", "row", "1x128_128x128")

    def __init__(self, weight, bias=None, recipe="row"):
        super().__init__()
        self.recipe = as_recipe(recipe)
        if self.recipe.name not in self.RECIPES:
            raise ValueError(f"TorchFp8Linear runs the recipes {', '.join(map(repr, self.RECIPES))}, got "
                             f"{self.recipe.name!r}")
        self.out_features, self.in_features = weight.shape
        qw, sw = torch_quantize_fp8(weight.detach(), self.recipe.b)
        self.register_buffer("weight", qw)
        self.register_buffer("weight_scale", torch_scales(sw, self.recipe.b, "b"))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear, recipe="row"):
        return cls(linear.weight, linear.bias, recipe)

    def forward(self, x):
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features:
            raise ValueError(f"TorchFp8Linear expects bf16 input (..., {self.in_features}), got {x.dtype} "
                             f"{tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features)
        qx, sx = torch_quantize_fp8(x2, self.recipe.a)
        call = cublas_call(self.recipe.name, qx, self.weight.t(), torch_scales(sx, self.recipe.a, "a"),
                           self.weight_scale, bias=self.bias)
        return call().reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe.name}"
