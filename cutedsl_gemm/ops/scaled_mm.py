"""``scaled_mm``: the public GEMM. Describe the call (problem), select an instance (selection), launch it
(runtime). A call signature seen before skips straight to the launch with the plan kept for it."""

from __future__ import annotations

from typing import Optional

import torch

from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.runtime.device import device_info
from cutedsl_gemm.selection import dispatch

# Call signature -> (launch plan, recipe, K blocks, output shape). The signature holds what *chooses* the plan: problem
# shape, operand dtypes, device, scale shapes and strides (they pick the recipe and its views) and the
# arguments. What the compiled function checks itself before every launch (TVM-FFI: dtype, rank, every
# extent against the M, N, K it bound, strides, 16-byte base alignment, one device) is not hashed again:
# a repeated signature whose tensors that check refuses (a misaligned or transposed view, a wrong out=) is
# re-run through the full validation, which names what was expected.
_PLANS: dict = {}
_MAX_PLANS = 4096  # many distinct shapes (e.g. every batch size): start over


def call_signature(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, scale_recipe_a, scale_recipe_b,
                   schedule, split_k):
    return (
        a.shape, b.shape, a.dtype, b.dtype, a.get_device(),
        scale_a.shape, scale_a.stride(), scale_b.shape, scale_b.stride(),
        None if bias is None else bias.dtype,
        out_dtype, use_fast_accum, scale_recipe_a, scale_recipe_b, schedule, split_k,
    )


def cached_plan(sig):
    """(launch plan, recipe, K blocks, output shape) that a repeated call with signature ``sig``
    (``call_signature``) reuses; None before the first such call."""
    return _PLANS.get(sig)


def _empty_result(problem: P.GemmProblem, ops: P.GemmOperands, out: torch.Tensor) -> torch.Tensor:
    """M, N or K zero: nothing to launch; K = 0 leaves the bias (or zeros)."""
    if problem.m and problem.n:
        out.zero_() if ops.bias is None else out.copy_(ops.bias.to(out.dtype).expand(problem.m, problem.n))
    return out


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
    fmt_a=None,
    fmt_b=None,
    scale_recipe_a=None,
    scale_recipe_b=None,
    schedule: Optional[str] = None,
    split_k: Optional[int] = None,
) -> torch.Tensor:
    """FP8 GEMM with torch._scaled_mm's argument conventions.

    ``out = (a * scale_a) @ (b * scale_b) + bias`` computed with fp32 accumulation, where ``a`` is (M, K)
    row-major, ``b`` is (K, N) column-major (``w.t()`` of a row-major (N, K) weight), both E4M3 or E5M2.
    Scales are fp32 dequantization factors, in torch's shapes (see ``cutedsl_gemm.numerics.scale_layouts``):
    tensor-wise (one element each), row-wise (``scale_a`` (M, 1), ``scale_b`` (1, N)), or block-scaled per
    128-deep K block: 1x128 x 128x128 (DeepSeek-V3: ``scale_a`` (M, Kb), ``scale_b`` (Kb, ceil(N/128))),
    128x128 x 128x128 and 1x128 x 1x128. The shapes pick the recipe; ``scale_recipe_a``/``scale_recipe_b``
    (strings or ``torch.nn.functional.ScalingType``, as in ``F.scaled_mm``) name it explicitly.

    ``schedule`` overrides the manifest's choice by M ("small_m" for M <= 128, else "cooperative");
    ``split_k`` overrides the K-split heuristic (``dispatch.choose_splits``: split K when there are fewer
    output tiles than SMs; ``dispatch.last_wave_splits``: split the last, partial wave of a long-K problem
    with a little more than whole waves, in the instance's last-wave variant).
    ``bias`` is (N,) in ``out_dtype`` or fp32.

    ``use_fast_accum`` as in torch: False (default) adds every 128-deep K tile into an fp32 accumulator
    outside the tensor cores (accurate at large K); True lets the tensor cores accumulate all of K (faster,
    larger error at large K). Block-scaled recipes always scale and add each K block outside the tensor
    cores, so the flag does not apply to them.

    On Blackwell (sm_100) the call goes to the tcgen05 f8f6f4 kernel, which also takes packed FP6/FP4
    operands; ``fmt_a``/``fmt_b`` name their formats where the torch dtype cannot ("e2m3", "e3m2", "e2m1").
    """
    sig = None
    if fmt_a is None and fmt_b is None and type(a) is torch.Tensor and type(b) is torch.Tensor \
            and type(scale_a) is torch.Tensor and type(scale_b) is torch.Tensor \
            and (bias is None or type(bias) is torch.Tensor) and (out is None or type(out) is torch.Tensor):
        sig = call_signature(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, scale_recipe_a,
                             scale_recipe_b, schedule, split_k)
        try:
            hit = _PLANS.get(sig)
        except TypeError:  # an unhashable argument: validate the long way (and say what is wrong)
            sig = hit = None
        if hit is not None:
            plan, recipe, k_blocks, out_shape = hit
            # (new_empty: ~1 us less per call than torch.empty(..., device=a.device))
            dst = a.new_empty(out_shape, dtype=out_dtype) if out is None else out
            sa, sb = scale_layouts.kernel_views(recipe, k_blocks, scale_a, scale_b)
            try:
                return launch.run(plan, a, b, dst, sa, sb, bias)
            except (TypeError, ValueError):
                pass  # refused before launch: the full validation below says why (or re-plans for it)
    device = P.require_cuda_tensors(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out=out)
    if device_info(device.index)[0].startswith("sm_100"):
        if out is not None:
            raise ValueError("out= is not supported by the sm_100 f8f6f4 path yet; omit it")
        from cutedsl_gemm.sm100 import sm100_f8f6f4_mm

        return sm100_f8f6f4_mm(a, b, fmt_a=fmt_a, fmt_b=fmt_b, scale_a=scale_a, scale_b=scale_b, bias=bias,
                               out_dtype=out_dtype)
    if fmt_a is not None or fmt_b is not None:
        raise ValueError("fmt_a/fmt_b select FP6/FP4 operand formats, which need a Blackwell (sm_100) GPU; "
                         "on Hopper pass float8_e4m3fn / float8_e5m2 tensors")
    problem, ops = P.describe_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, out, use_fast_accum,
                                        scale_recipe_a, scale_recipe_b, schedule, split_k, device)
    dst = torch.empty((problem.m, problem.n), dtype=out_dtype, device=device) if out is None else out
    if problem.is_empty:
        return _empty_result(problem, ops, dst)
    inst, splits = dispatch.select(problem)
    plan = launch.plan(inst, problem.m, problem.n, splits, device.index)
    if sig is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[sig] = (plan, problem.recipe, ops.k_blocks, (problem.m, problem.n))
    return launch.run(plan, a, b, dst, ops.scale_a, ops.scale_b, bias)
