"""Pure-torch reference numerics: quantize / dequantize for the FP8 scaling recipes and a float64 GEMM.

These run anywhere (CPU or GPU) and define the numerics the kernels must reproduce. The quantizer
contract (shared with the CuTe DSL quantization kernels, which must match it bit for bit):

* a scale is the *dequantization* factor (``x ~= q * scale``), stored as fp32, one per scale group;
* ``amax`` is the largest finite ``|x|`` of the group (NaN and +-inf are ignored for the scale);
* ``scale = amax / fmt.max_finite`` (fp32, IEEE division); an all-zero (or non-finite-only) group gets 1;
* ``q = cast_rne(clamp(x / scale, -max, +max))`` in fp32: finite values and +-inf saturate to the
  largest finite value, NaN stays NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

from cutedsl_gemm.numerics.formats import ElementFormat, ScaleGranularity, ScalingRecipe, element_format, recipe as as_recipe


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _group_view(x: torch.Tensor, gran: ScaleGranularity):
    """Pad x (rows, K) to whole groups and view it as (R, gr, C, gc) so groups reduce over dims 1 and 3."""
    rows, k = x.shape
    gr = rows if gran.rows is None else gran.rows
    gc = k if gran.cols is None else gran.cols
    gr, gc = max(gr, 1), max(gc, 1)
    R, C = _ceil_div(rows, gr), _ceil_div(k, gc)
    pad = torch.zeros(R * gr, C * gc, dtype=x.dtype, device=x.device)
    pad[:rows, :k] = x
    return pad.view(R, gr, C, gc), (R, C, gr, gc)


def group_amax(x: torch.Tensor, gran: ScaleGranularity) -> torch.Tensor:
    """Largest finite |x| per scale group, fp32, shape (R, C) (R = C = 1 for per-tensor)."""
    xf = x.float()
    xf = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros((), dtype=torch.float32, device=x.device))
    v, _ = _group_view(xf, gran)
    return v.amax(dim=(1, 3))


def scales_from_amax(amax: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    one = torch.ones((), dtype=torch.float32, device=amax.device)
    fmax = torch.tensor(fmt.max_finite, dtype=torch.float32, device=amax.device)
    return torch.where(amax > 0, amax / fmax, one)


def expand_scales(scales: torch.Tensor, gran: ScaleGranularity, rows: int, k: int) -> torch.Tensor:
    """Broadcast (R, C) group scales to the (rows, K) element grid."""
    gr = rows if gran.rows is None else gran.rows
    gc = k if gran.cols is None else gran.cols
    s = scales.reshape(_ceil_div(rows, max(gr, 1)), _ceil_div(k, max(gc, 1)))
    s = s.repeat_interleave(max(gr, 1), dim=0).repeat_interleave(max(gc, 1), dim=1)
    return s[:rows, :k]


def cast_saturate(y: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Round-to-nearest-even cast of fp32 ``y`` to an FP8 torch dtype, saturating +-inf and overflow."""
    if fmt.torch_dtype is None or fmt.bits != 8:
        raise ValueError(f"cast_saturate handles the FP8 formats; got {fmt.name}")
    y = y.float().clamp(-fmt.max_finite, fmt.max_finite)  # NaN passes through clamp unchanged
    return y.to(fmt.torch_dtype)


def quantize(x: torch.Tensor, gran: ScaleGranularity, fmt="e4m3"):
    """Quantize a 2-D tensor (rows, K) with one scale per group of ``gran``.

    Returns ``(q, scales)``: q has x's shape in fmt's torch dtype, scales are fp32 with shape (R, C)
    in plain row-major group order ((1, 1) for per-tensor, (rows, 1) for per-row).
    """
    fmt = element_format(fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D (rows, K) tensor, got shape {tuple(x.shape)}")
    rows, k = x.shape
    scales = scales_from_amax(group_amax(x, gran), fmt)
    full = expand_scales(scales, gran, rows, k)
    q = cast_saturate(x.float() / full, fmt)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, gran: ScaleGranularity) -> torch.Tensor:
    """float64 dequantization of (rows, K) data with (R, C) group scales."""
    rows, k = q.shape
    return q.double() * expand_scales(scales.double(), gran, rows, k)


def quantize_operands(a: torch.Tensor, w: torch.Tensor, rec, fmt_a="e4m3", fmt_b="e4m3"):
    """Quantize A (M, K) and W (N, K) for a recipe. Returns (qa, sa, qw, sw) in plain layouts."""
    rec = as_recipe(rec)
    qa, sa = quantize(a, rec.a, fmt_a)
    qw, sw = quantize(w, rec.b, fmt_b)
    return qa, sa, qw, sw


def reference_gemm(
    qa: torch.Tensor,
    sa: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    rec,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float64 ``dequant(A) @ dequant(W).T (+ bias)`` for plain-layout scales; returns (M, N) float64."""
    rec = as_recipe(rec)
    a = dequantize(qa, sa, rec.a)
    w = dequantize(qw, sw, rec.b)
    out = a @ w.t()
    if bias is not None:
        out = out + bias.double()
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    r = ref.double().to(o.device)
    den = torch.linalg.norm(r)
    return float(torch.linalg.norm(o - r) / (den if den > 0 else 1.0))
