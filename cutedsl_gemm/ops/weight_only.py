"""``mm_weight_only``: bf16 / fp16 activations times packed int4 / int8 weights on Hopper. Describe the call
(problem), select an instance (selection), launch it (runtime); a call signature seen before skips straight to the
launch with the plan kept for it. Its torch operator (``torch.ops.cutedsl_gemm.mm_weight_only``: schema,
implementation, fake implementation and the ``traced_*`` form the function takes under ``torch.compile``) is
defined here too."""

from __future__ import annotations

from typing import Optional

import torch

from cutedsl_gemm import problem as P
from cutedsl_gemm.ops.library import EAGER, OPS, _checked_on_metas, define
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.runtime.plans import PREPARED
from cutedsl_gemm.selection import dispatch

# Call signature -> (launch plan, output shape). As in scaled_mm: what the compiled function checks itself before
# every launch (dtypes, ranks, extents against the M, N, K it bound, strides, alignment) is not hashed again, and a
# call it refuses is re-run through the full validation, which names what was expected.
MM_WEIGHT_ONLY = "mm_weight_only"  # its entries in the one prepared-call cache, runtime.plans.PREPARED


def _signature(x, packed_w, scales, zeros, group, bits, split_k):
    return (x.shape, x.dtype, x.get_device(), packed_w.shape, scales.shape, scales.dtype, zeros is None, group, bits,
            split_k)


def cached_plan(x, packed_w, scales, zeros=None, *, group: int = 128, bits: int = 4, split_k=None):
    """(launch plan, output shape) that a repeated call like this one reuses (``plan.run(x, packed_w, scales, zeros,
    out)``); None before the first such call."""
    return PREPARED.get(MM_WEIGHT_ONLY, _signature(x, packed_w, scales, zeros, group, bits, split_k))


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
        return traced_mm_weight_only(x, packed_w, scales, zeros, group=group, bits=bits, out=out, split_k=split_k)
    sig = None
    if type(x) is torch.Tensor and type(packed_w) is torch.Tensor and type(scales) is torch.Tensor \
            and (zeros is None or type(zeros) is torch.Tensor) and (out is None or type(out) is torch.Tensor):
        sig = _signature(x, packed_w, scales, zeros, group, bits, split_k)
        try:
            hit = PREPARED.get(MM_WEIGHT_ONLY, sig)
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
        PREPARED.keep(MM_WEIGHT_ONLY, sig, (plan, (problem.m, problem.n)))
    return plan.run(x, packed_w, scales, zeros, dst)


# ----------------------------------------------------------------------------------------------------
# the op
# ----------------------------------------------------------------------------------------------------

MM_WEIGHT_ONLY_SCHEMA = (
    "(Tensor x, Tensor packed_w, Tensor scales, Tensor? zeros=None, *, int group=128, int bits=4, int? split_k=None) "
    "-> Tensor"
)


def _mm_weight_only_op(x, packed_w, scales, zeros=None, *, group=128, bits=4, split_k=None):
    """``mm_weight_only`` with the op's arguments (no ``out=``)."""
    return mm_weight_only(x, packed_w, scales, zeros, group=group, bits=bits, split_k=split_k)


def _mm_weight_only_fake(x, packed_w, scales, zeros=None, *, group=128, bits=4, split_k=None):
    def describe(target, *metas):
        P.describe_weight_only(*metas, group, bits, None, split_k, x.device, target=target)

    if not _checked_on_metas(x.device, (x, packed_w, scales, zeros), describe) \
            and (x.dim() != 2 or scales.dim() != 2):
        raise ValueError(f"x and scales must be 2-D, got shapes {tuple(x.shape)} and {tuple(scales.shape)}")
    return x.new_empty((x.shape[0], scales.shape[1]))


define("mm_weight_only", MM_WEIGHT_ONLY_SCHEMA, _mm_weight_only_op, _mm_weight_only_fake)
EAGER.mm_weight_only = _mm_weight_only_op


def traced_mm_weight_only(x, packed_w, scales, zeros, *, group, bits, out, split_k):
    """``mm_weight_only`` under ``torch.compile``: the op (``out=`` is filled from its result)."""
    res = OPS.mm_weight_only(x, packed_w, scales, zeros, group=group, bits=bits, split_k=split_k)
    if out is None:
        return res
    out.copy_(res)
    return out
