"""``grouped_scaled_mm``: the FP8 GEMM of a mixture-of-experts layer, every expert's tokens times that expert's
weights in one launch, following ``torch.nn.functional.scaled_grouped_mm``'s conventions; its torch operator
(``torch.ops.cutedsl_gemm.grouped_scaled_mm``) and fake implementation are defined here too."""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from cutedsl_gemm.families import sm90_grouped as G
from cutedsl_gemm.ops.library import define
from cutedsl_gemm.runtime.plans import PREPARED

SCHEMA = ("(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? offs=None, *, Tensor? counts=None, "
          "ScalarType out_dtype=bfloat16, int? expected_rows=None) -> Tensor")


def grouped_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: Optional[torch.Tensor] = None, *, counts: Optional[torch.Tensor] = None,
                      out_dtype: torch.dtype = torch.bfloat16, out: Optional[torch.Tensor] = None,
                      expected_rows: Optional[int] = None) -> torch.Tensor:
    """Per expert ``e``: ``out[rows of e] = (a[rows of e] * scale_a) @ (b[e] * scale_b[e])``, in fp32 with promoted
    accumulation, rounded to ``out_dtype`` (bf16 or fp16). Hopper (sm_90a) GPUs.

    Layouts:

    * contiguous -- ``a`` (T, K) float8_e4m3fn holds the tokens of all experts back to back, ``offs`` (E,) int32 on
      the device the cumulative end row of each expert's group (as ``F.scaled_grouped_mm``): expert ``e`` owns rows
      ``offs[e-1] .. offs[e]``. Any group size, 0 included, no padding. Returns (T, N); rows past ``offs[-1]`` are
      not written.
    * masked -- ``a`` (E, C, K) holds up to C rows per expert and ``counts`` (E,) int32 on the device how many to
      compute; returns (E, C, N) whose rows at or past ``counts[e]`` are not written (pass ``out`` to keep what
      they hold). ``expected_rows``: the rows the counts are expected to add up to (a decode batch's T * top-k),
      what the tile is chosen by, as the contiguous layout's T is (default E * C: every group full). Any value
      gives the same product; a capacity set far above the typical count takes tiles sized for full groups
      without it.

    ``b`` is (E, K, N) float8_e4m3fn with K contiguous: ``w.transpose(1, 2)`` of per-expert (N, K) row-major
    weights. Scales (float32 decode scales, value = q * scale): per tensor ``scale_a`` (1,) and ``scale_b`` (E,);
    row-wise ``scale_a`` one per row of ``a`` ((T, 1), masked (E, C, 1)) and ``scale_b`` (E, 1, N); DeepSeek-V3's
    blocks ``scale_a`` one per row and 128-deep K block ((T, K/128), masked (E, C, K/128), any strides:
    ``quantize_fp8(x, "1x128")``'s layout as it comes) and ``scale_b`` (E, K/128, N/128), per expert its 128x128
    blocks transposed like ``b`` (``quantize_fp8(w_e, "128x128")[1].t()``), applied per K tile in the main loop.

    The group sizes stay on the device: the call never synchronises with the host and can be captured in a CUDA
    graph with sizes that change between replays. Their values are not checked (that would need them on the host):
    a group whose end precedes its start is empty, offsets and counts past the rows are clamped to them, so that no
    value reads or writes outside the tensors."""
    # Traced (torch.compile, make_fx) or on meta tensors: the op, which records the call or gives its shape
    if torch.compiler.is_compiling() or a.device.type == "meta" or is_fake(a):
        if out is not None:
            raise ValueError("grouped_scaled_mm(out=...) is eager only; under torch.compile use the returned tensor")
        return torch.ops.cutedsl_gemm.grouped_scaled_mm(a, b, scale_a, scale_b, offs, counts=counts,
                                                        out_dtype=out_dtype, expected_rows=expected_rows)
    groups = offs if counts is None else counts
    sig = call_signature(a, b, scale_a, scale_b, groups, counts is not None, out_dtype, expected_rows)
    if sig is not None:
        hit = PREPARED.get(GROUPED, sig)
        if hit is not None:
            try:
                return G.launch(hit[0], a, b, scale_a, scale_b, groups, out, hit[1])
            except (TypeError, ValueError):
                pass  # refused before launch (e.g. a wrong out=): the full validation below says why
    problem = G.describe(a, b, scale_a, scale_b, offs, counts, out_dtype, out, expected_rows)
    if a.device.type != "cuda":
        raise ValueError(f"grouped_scaled_mm runs on Hopper (sm_90a) CUDA tensors; got tensors on {a.device} "
                         "(numerics.reference.reference_grouped_mm computes the product on any device)")
    if problem.is_empty:
        return G.launch(problem, a, b, scale_a, scale_b, groups, out)
    prepared = G.plan(G.select(problem, G.device_sms(a.device.index)), a.device.index)
    if sig is not None:
        PREPARED.keep(GROUPED, sig, (problem, prepared))
    return G.launch(problem, a, b, scale_a, scale_b, groups, out, prepared)


GROUPED = "grouped_scaled_mm"  # its entries in the one prepared-call cache (runtime.plans.PREPARED)


def call_signature(a, b, scale_a, scale_b, groups, masked: bool, out_dtype, expected_rows=None):
    """What chooses a call's plan and kernel views, from metadata (None for arguments that are not plain tensors:
    those go the long way). What the compiled kernel checks before every launch (dtypes, extents against the ones
    it bound, strides, alignment) is not hashed again: a call it refuses is validated the long way."""
    ts = (a, b, scale_a, scale_b, groups)
    if any(type(t) is not torch.Tensor for t in ts):
        return None
    if expected_rows is not None and type(expected_rows) is not int:
        return None
    return (masked, out_dtype, expected_rows, a.get_device(), *((t.shape, t.stride(), t.dtype) for t in ts))


def _op(a, b, scale_a, scale_b, offs=None, *, counts=None, out_dtype=torch.bfloat16, expected_rows=None):
    return grouped_scaled_mm(a, b, scale_a, scale_b, offs, counts=counts, out_dtype=out_dtype,
                             expected_rows=expected_rows)


def _fake(a, b, scale_a, scale_b, offs=None, *, counts=None, out_dtype=torch.bfloat16, expected_rows=None):
    problem = G.describe(a, b, scale_a, scale_b, offs, counts, out_dtype, None, expected_rows)
    return a.new_empty(problem.out_shape, dtype=out_dtype)


define("grouped_scaled_mm", SCHEMA, _op, _fake)
