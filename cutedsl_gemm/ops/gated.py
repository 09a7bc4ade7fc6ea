"""``silu_mul_quantize_fp8``: the gated activation of a gate/up projection's output, quantized to FP8 in one kernel.

``h`` (M, 2I) holds the gate columns then the up columns (transformers' ``chunk(2)`` order, and the fused gate_up
weight of a MoE expert); the result is ``quantize_fp8(a, granularity)`` of

    a = RN(SiLU(gate) * w * up)      (M, I) in h's dtype, every product in fp32 (``reference.silu_mul``)

with ``w`` each row's fp32 weight (``weights`` (M,): a MoE pair's routing weight, which can go in before the linear
down projection) or none. One pass over h instead of SiLU, the products, the rounding and the quantizer
reading and writing ``a`` in between: the kernel (``kernels/sm90/quantize_fp8.GatedTileQuant``) computes each
16-element vector of ``a`` in registers and quantizes it as ``quantize_fp8``'s kernel quantizes a stored ``a``.
Its SiLU takes ``e^-g`` from ``ex2.approx`` (2 ulp in fp32), so ``a`` can differ from the torch reference's by one
unit in its last place where the fp32 product lies that close to a rounding boundary; the codes then follow.

Granularities "row" (per token, scales (M, 1); I <= 65536) and "1x128" (DeepSeek-V3 groups, scales (M, ceil(I /
128)) M-major) -- the activation forms of the row-wise and DeepSeek recipes. A per-tensor scale needs the whole
tensor's amax before any code: ``quantize_fp8(reference.silu_mul(h, w), "tensor")`` computes that form.
``backend`` as in ``quantize_fp8`` ("reference": the torch reference, any device). The torch operator
``torch.ops.cutedsl_gemm.silu_mul_quantize_fp8`` (and its fake) is defined here.
"""

from __future__ import annotations

from typing import Optional

import torch

from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import DTYPE_FORMATS, FLOAT_FORMATS, FP8_FORMATS, ScaleGranularity, element_format
from cutedsl_gemm.ops.library import EAGER, OPS, define, op_name
from cutedsl_gemm.ops.quantize import VEC, _allocator, _get, kernel_backend, quantize_fp8
from cutedsl_gemm.runtime.plans import PREPARED

G = ScaleGranularity
GATED_GRANULARITIES = (G.ROW, G.GROUP_1x128)
ROW_MAX_I = 65536  # the row form holds one 1 x I row per CTA (quantize_fp8.row_tile)
GATED = "silu_mul_quantize"  # the prepared-call cache's kind


def _arguments(h, granularity, weights, fmt, backend, pointers=True):
    """(granularity, fmt, whether the kernel runs) of a call, after every check on the arguments."""
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    if DTYPE_FORMATS.get(h.dtype) not in FLOAT_FORMATS:
        raise TypeError(f"h must be bfloat16, float16 or float32, got {h.dtype}")
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be 2-D (M, 2I), gate columns then up columns, got shape {tuple(h.shape)}")
    try:
        gran = G.named(granularity) if isinstance(granularity, (str, ScaleGranularity)) else None
    except ValueError:
        gran = None
    if gran not in GATED_GRANULARITIES:
        raise ValueError(f"silu_mul_quantize_fp8 takes granularity 'row' or '1x128', got {granularity!r} (a per-tensor "
                         "scale needs the whole activation first: quantize_fp8(reference.silu_mul(h), 'tensor'))")
    fmt = element_format(fmt)
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt.name!r}")
    rows, i = h.shape[0], h.shape[1] // 2
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 or weights.shape != (rows,):
            raise ValueError(f"weights must be a float32 tensor of shape ({rows},) (one per row of h), got "
                             f"{getattr(weights, 'dtype', type(weights).__name__)} "
                             f"{tuple(getattr(weights, 'shape', ()))}")
        if weights.device != h.device:
            raise ValueError(f"weights is on {weights.device}, h on {h.device}")
    use_kernel = kernel_backend(h, backend)
    if use_kernel:
        if i % VEC:
            raise ValueError(f"I (h.shape[1] / 2) must be a multiple of {VEC} for the kernel, got {i}")
        if gran is G.ROW and i > ROW_MAX_I:
            raise ValueError(f"the row form takes I <= {ROW_MAX_I}, got {i}")
        if gran is G.GROUP_1x128 and -(-i // 128) > 65535:
            raise ValueError(f"at most {65535 * 128} columns (I) in 1x128 groups, got {i}")
        if h.stride(1) != 1 or (rows > 1 and h.stride(0) != 2 * i):
            raise ValueError(f"h must be row-major contiguous (strides ({2 * i}, 1)), got {h.stride()}")
        if weights is not None and weights.stride(0) != 1 and rows > 1:
            raise ValueError(f"weights must be contiguous, got stride {weights.stride()}")
        if pointers and h.data_ptr() % 16:
            raise ValueError("h's data pointer must be 16-byte aligned (a sliced view may not be); call .clone()")
    return gran, fmt, use_kernel


def _reference(h, gran, weights, fmt):
    return quantize_fp8(R.silu_mul(h, weights), gran, fmt=fmt, backend="reference")


def _plan(h, gran, fmt, weighted: bool):
    """The kernel launch for h's shape, dtype and device: a function (h, weights) -> (q, scales)."""
    from cutedsl_gemm.kernels.sm90.quantize_fp8 import row_tile

    rows, i = h.shape[0], h.shape[1] // 2
    cols = row_tile(i, h.element_size() * 8)[1] if gran is G.ROW else 128
    fn = _get("gated", h, fmt, gran.label, cols, weighted)
    alloc = _allocator(gran, fmt, 128, "mn_major" if gran is G.GROUP_1x128 else None, rows, i)

    def run(h, weights):
        q, s, out = alloc(h)
        fn(h, q, s, s if weights is None else weights)
        return q, out
    return run


def silu_mul_quantize_fp8(h: torch.Tensor, granularity="row", weights: Optional[torch.Tensor] = None, *,
                          fmt="e4m3", backend: str = "auto"):
    """``quantize_fp8(RN(SiLU(gate) * weights * up), granularity)`` of h (M, 2I) = [gate | up] in one kernel: ``(q
    (M, I), scales)`` in ``quantize_fp8``'s layouts (see the module docstring). ``weights``: None or (M,) fp32.
    Under ``torch.compile`` the kernel path is the op ``torch.ops.cutedsl_gemm.silu_mul_quantize_fp8``."""
    if torch.compiler.is_compiling() and (backend == "auto" or backend == "kernel" and h.is_cuda):
        return OPS.silu_mul_quantize_fp8(h, op_name(granularity), weights, fmt=op_name(fmt))
    sig = None
    if type(h) is torch.Tensor and (weights is None or type(weights) is torch.Tensor):
        sig = (h.shape, h.dtype, h.get_device(), granularity, fmt, weights is None, backend)
        try:
            run = PREPARED.get(GATED, sig)
        except TypeError:
            sig = run = None
        if run is not None and (weights is None or (weights.shape == (h.shape[0],) and weights.dtype == torch.float32
                                                    and weights.device == h.device)):
            try:
                return run(h, weights)
            except (TypeError, ValueError):
                pass  # refused before launch: the checks below say why
    gran, fmt_, use_kernel = _arguments(h, granularity, weights, fmt, backend)
    if h.numel() == 0 or not use_kernel:
        return _reference(h, gran, weights, fmt_)
    run = _plan(h, gran, fmt_, weights is not None)
    if sig is not None:
        PREPARED.keep(GATED, sig, run)
    return run(h, weights)


def silu_mul_quantize_fp8_like(h, granularity="row", weights=None, *, fmt="e4m3"):
    """Empty ``(q, scales)`` as ``silu_mul_quantize_fp8`` returns them, after its checks but h's address: the op's
    fake implementation."""
    gran, fmt_, _ = _arguments(h, granularity, weights, fmt, "auto", pointers=False)
    rows, i = h.shape[0], h.shape[1] // 2
    q, _, s = _allocator(gran, fmt_, 128, "mn_major" if gran is G.GROUP_1x128 else None, rows, i)(h)
    return q, s


define("silu_mul_quantize_fp8",
       '(Tensor h, str granularity="row", Tensor? weights=None, *, str fmt="e4m3") -> (Tensor, Tensor)',
       silu_mul_quantize_fp8, silu_mul_quantize_fp8_like)
EAGER.silu_mul_quantize_fp8 = silu_mul_quantize_fp8
