"""What the library is measured against: cuBLAS through torch for each recipe, on operands quantized by the
reference quantizer in the scale layouts torch takes. Used by ``cutedsl-gemm demo`` and the benchmarks."""

from __future__ import annotations

import torch

from cutedsl_gemm.numerics import reference as R

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
    if recipe == "tensor":
        sa, sb = sa_plain.reshape(()), sw_plain.reshape(())
    elif recipe == "row":  # (M, 1) x (1, N)
        sa, sb = sa_plain.reshape(m, 1).contiguous(), sw_plain.reshape(1, n).contiguous()
    else:
        gran_a, gran_b = recipe.split("_")
        sa, sb = torch_block_layout(sa_plain, gran_a), torch_block_layout(sw_plain, gran_b).t()
    return qa, qw, sa, sb, (qa, sa_plain, qw, sw_plain)


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
