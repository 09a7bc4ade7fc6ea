"""``mm_weight_only``: bf16 / fp16 activations times packed int4 / int8 weights on Hopper. Describe the call
(problem), select an instance (selection), launch it (runtime); a call signature seen before skips straight to the
launch with the plan kept for it."""

from __future__ import annotations

from typing import Optional

import torch

from cutedsl_gemm import problem as P
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch

# Call signature -> (launch plan, output shape). As in scaled_mm: what the compiled function checks itself before
# every launch (dtypes, ranks, extents against the M, N, K it bound, strides, alignment) is not hashed again, and a
# call it refuses is re-run through the full validation, which names what was expected.
_PLANS: dict = {}
_MAX_PLANS = 4096


def _signature(x, packed_w, scales, zeros, group, bits, split_k):
    return (x.shape, x.dtype, x.get_device(), packed_w.shape, scales.shape, scales.dtype, zeros is None, group, bits,
            split_k)


def cached_plan(x, packed_w, scales, zeros=None, *, group: int = 128, bits: int = 4, split_k=None):
    """(launch plan, output shape) that a repeated call like this one reuses (``plan.run(x, packed_w, scales, zeros,
    out)``); None before the first such call."""
    return _PLANS.get(_signature(x, packed_w, scales, zeros, group, bits, split_k))


def mm_weight_only(x: torch.Tensor, packed_w: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor] = None,
                   *, group: int = 128, bits: int = 4, out: Optional[torch.Tensor] = None,
                   split_k: Optional[int] = None) -> torch.Tensor:
    """``x @ Wdq.T`` with ``Wdq = (q - z) * s`` dequantized in registers, fp32 accumulation, output in x's dtype.

    ``x`` (M, K) row-major bf16 or fp16. ``packed_w``, ``scales`` and ``zeros`` as
    ``cutedsl_gemm.numerics.int_packing.pack_weights`` returns them (its docstring has the layouts):
    int4 weights with group-wise scales along K (``group`` 32, 64 or 128; ``scales`` (K / group, N) in x's dtype),
    symmetric or with integer zero points (``zeros``, same layout); or int8 / int4 weights with per-channel scales
    (``group=0``, ``scales`` (1, N) fp32, applied to the fp32 accumulator). N is ``scales.shape[1]`` and must be a
    multiple of 8 for group-wise scales; K a multiple of the group (and of 8). ``bits`` (4 or 8) must match the
    packed weights.

    ``split_k`` overrides the number of K splits (``dispatch.select_weight_only`` picks one that fills the SMs).
    ``out``, if given, is a contiguous (M, N) tensor of x's dtype written in place. Under ``torch.compile`` the
    call is the op ``torch.ops.cutedsl_gemm.mm_weight_only``.
    """
    if torch.compiler.is_compiling():  # the op: torch.compile records it instead of tracing into the launch
        from cutedsl_gemm.ops.library import traced_mm_weight_only

        return traced_mm_weight_only(x, packed_w, scales, zeros, group=group, bits=bits, out=out, split_k=split_k)
    sig = None
    if type(x) is torch.Tensor and type(packed_w) is torch.Tensor and type(scales) is torch.Tensor \
            and (zeros is None or type(zeros) is torch.Tensor) and (out is None or type(out) is torch.Tensor):
        sig = _signature(x, packed_w, scales, zeros, group, bits, split_k)
        try:
            hit = _PLANS.get(sig)
        except TypeError:  # an unhashable argument: validate the long way (and say what is wrong)
            sig = hit = None
        if hit is not None:
            plan, out_shape = hit
            dst = x.new_empty(out_shape) if out is None else out
            try:
                return plan.run(x, packed_w, scales, zeros, dst)
            except (TypeError, ValueError):
                pass  # refused before launch: the full validation below says why
    device = P.require_cuda_tensors(x=x, packed_w=packed_w, scales=scales, zeros=zeros, out=out)
    problem = P.describe_weight_only(x, packed_w, scales, zeros, group, bits, out, split_k, device)
    dst = torch.empty((problem.m, problem.n), dtype=x.dtype, device=device) if out is None else out
    if problem.is_empty:
        return dst.zero_() if problem.m and problem.n else dst
    inst, splits = dispatch.select_weight_only(problem)
    plan = launch.plan(inst, problem.m, problem.n, splits, device.index)
    if sig is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[sig] = (plan, (problem.m, problem.n))
    return plan.run(x, packed_w, scales, zeros, dst)
