"""``quantize_fp8``: bf16/fp16/fp32 -> E4M3/E5M2 with scales in the layouts the GEMMs consume.

Numerics are the contract of :mod:`cutedsl_gemm.numerics.reference` (the CuTe DSL kernels reproduce it bit for
bit): per scale group, ``amax`` = largest finite ``|x|`` (NaN and +-inf ignored), ``scale = amax / fmax``
in fp32 (1 for an all-zero or non-finite-only group), ``q = RNE(clamp(x / scale, -fmax, fmax))``.
Consequences for special inputs: a finite value never overflows (it saturates to +-fmax), +-inf becomes
+-fmax, NaN stays NaN (the NaN's sign/payload bits are not part of the contract; kernels write 0x7F).

Scale layouts (all fp32; ``Kb = ceil(K / group_cols)``):

=================  =====================  ==========================================================
granularity        ``scale_layout``       returned scales
=================  =====================  ==========================================================
tensor             (ignored)              shape ``()``
row                (ignored)              shape ``(M, 1)``, contiguous
1x128              ``"mn_major"`` (dflt)  shape ``(M, Kb)``, strides ``(1, M)``: torch._scaled_mm's
                                          BlockWise1x128 operand (A, or W for 1x128 x 1x128)
1x128              ``"row_major"``        shape ``(M, Kb)``, strides ``(Kb, 1)``
BxB (B=128, 256)   ``"row_major"`` (dflt) shape ``(ceil(M/B), Kb)``, strides ``(Kb, 1)``
BxB                ``"padded"``           shape ``(ceil(M/B), L4)``, strides ``(L4, 1)``,
                                          ``L4 = round_up(Kb, 4)``; columns ``Kb..L4-1`` hold 1.0
                                          (empty groups). ``scales.t()`` (shape ``(L4, ceil(M/B))``,
                                          strides ``(1, L4)``) is the BlockWise128x128 operand that
                                          torch._scaled_mm / cuBLAS take; ``scales[:, :Kb]`` is the
                                          logical (ceil(M/B), Kb) scale grid.
=================  =====================  ==========================================================

The data ``q`` always has x's shape (M, K), row-major, in the FP8 torch dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import FP8_FORMATS, ScaleGranularity, ScalingRecipe, element_format, recipe as as_recipe
from cutedsl_gemm.runtime.jit import KERNEL_CACHE

G = ScaleGranularity
VEC = 16  # the kernels' vector width in elements: K must be a multiple of it

_IN_DTYPES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}
_GRAN_NAMES = {
    "tensor": G.TENSOR,
    "per_tensor": G.TENSOR,
    "row": G.ROW,
    "per_row": G.ROW,
    "1x128": G.GROUP_1x128,
    "group": G.GROUP_1x128,
    "128x128": G.BLOCK_128x128,
    "block": G.BLOCK_128x128,
}
_LAYOUTS = {G.GROUP_1x128: ("mn_major", "row_major"), G.BLOCK_128x128: ("row_major", "padded")}


@dataclass(frozen=True)
class _Blocks:
    """A BxB granularity for the reference (which only reads ``rows``/``cols``)."""

    rows: int
    cols: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def resolve_granularity(recipe, operand: str = "a") -> ScaleGranularity:
    """A ScaleGranularity from a granularity, a name ("tensor", "row", "1x128", "128x128", "256x256",
    or a recipe name such as "1x128_128x128") or a ScalingRecipe (then ``operand`` picks "a" or "b")."""
    if isinstance(recipe, str) and recipe.lower() in _GRAN_NAMES:
        return _GRAN_NAMES[recipe.lower()]
    if isinstance(recipe, str) and recipe.lower() == "256x256":
        return G.BLOCK_128x128  # the 2-D block family; block=256 selects the size
    if isinstance(recipe, ScaleGranularity):
        gran = recipe
    elif isinstance(recipe, (str, ScalingRecipe)):
        rec = as_recipe(recipe)  # raises ValueError naming the known recipes
        if operand not in ("a", "b"):
            raise ValueError(f"operand must be 'a' or 'b', got {operand!r}")
        gran = getattr(rec, operand)
    else:
        raise TypeError(
            f"recipe must be a ScaleGranularity, a ScalingRecipe or a name ({sorted(_GRAN_NAMES)} or a "
            f"recipe name), got {type(recipe).__name__}"
        )
    if gran not in (G.TENSOR, G.ROW, G.GROUP_1x128, G.BLOCK_128x128):
        raise ValueError(
            f"quantize_fp8 handles tensor, row, 1x128 and 128x128/256x256 granularities; got {gran.name} "
            "(MX/NVFP4 use cutedsl_gemm.numerics.microscaling)"
        )
    return gran


def _validate(x, gran, fmt, block, scale_layout, backend):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, K), got shape {tuple(x.shape)}")
    fmt = element_format(fmt)
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt.name!r}")
    if fmt.torch_dtype is None:
        raise TypeError(f"this torch build has no dtype for {fmt.name}")
    if gran is G.BLOCK_128x128:
        if block not in (128, 256):
            raise ValueError(f"block must be 128 or 256 for 2-D block scaling, got {block!r}")
    elif block != 128:
        raise ValueError(f"block={block!r} only applies to 2-D block scaling; {gran.name} uses 128")
    allowed = _LAYOUTS.get(gran)
    if allowed is None:
        if scale_layout is not None:
            raise ValueError(f"scale_layout does not apply to {gran.name} scaling (got {scale_layout!r})")
        scale_layout = None
    else:
        scale_layout = allowed[0] if scale_layout is None else scale_layout
        if scale_layout not in allowed:
            raise ValueError(f"scale_layout for {gran.name} must be one of {allowed}, got {scale_layout!r}")
    if backend not in ("auto", "kernel", "reference"):
        raise ValueError(f"backend must be 'auto', 'kernel' or 'reference', got {backend!r}")
    use_kernel = backend == "kernel" or (backend == "auto" and x.is_cuda)
    if use_kernel:
        rows, k = x.shape
        if k % VEC:
            raise ValueError(f"K (x.shape[1]) must be a multiple of {VEC} for the FP8 kernels, got {k}")
        if x.stride(1) != 1 or (rows > 1 and x.stride(0) != k):
            raise ValueError(f"x must be row-major contiguous (strides ({k}, 1)), got {x.stride()}; call .contiguous()")
        if x.data_ptr() % 16:
            raise ValueError("x's data pointer must be 16-byte aligned (a sliced view may not be); call .clone()")
        if not x.is_cuda:
            raise ValueError(f"backend='kernel' needs a CUDA tensor, got device {x.device}")
        tile_cols = block if gran is G.BLOCK_128x128 else 128  # the tile kernels' grid.y = ceil(K / tile)
        if gran is not G.ROW and _ceil_div(k, tile_cols) > 65535:
            raise ValueError(f"at most {65535 * tile_cols} columns (K) are supported by the kernels, got {k}")
    return fmt, scale_layout, use_kernel


def _group_shape(gran, block):
    if gran is G.GROUP_1x128:
        return 1, 128
    if gran is G.BLOCK_128x128:
        return block, block
    return gran.value


def _layout_scales(plain: torch.Tensor, gran, scale_layout) -> torch.Tensor:
    """Plain row-major (R, C) group scales -> the requested layout (see the module docstring)."""
    if gran is G.TENSOR:
        return plain.reshape(())
    if gran is G.ROW:
        return plain.reshape(-1, 1).contiguous()
    r, c = plain.shape
    if scale_layout == "mn_major":
        out = torch.empty((c, r), dtype=torch.float32, device=plain.device).t()
        out.copy_(plain)
        return out
    if scale_layout == "padded":
        out = torch.ones((r, _ceil_div(c, 4) * 4), dtype=torch.float32, device=plain.device)
        out[:, :c] = plain
        return out
    return plain.contiguous()


def quantize_fp8(
    x: torch.Tensor,
    recipe="1x128",
    *,
    fmt="e4m3",
    block: int = 128,
    scale_layout: Optional[str] = None,
    operand: str = "a",
    backend: str = "auto",
):
    """Quantize a 2-D tensor (rows, K) to FP8. Returns ``(q, scales)`` (see the module docstring).

    ``recipe``: "tensor", "row", "1x128", "128x128", "256x256", a ScaleGranularity, or a ScalingRecipe /
    recipe name together with ``operand`` ("a" for A (M, K), "b" for W (N, K)). ``block``: 128 or 256
    for 2-D blocks. ``backend``: "kernel" (CuTe DSL, CUDA tensors), "reference" (torch, any device) or
    "auto" (kernel on CUDA, reference elsewhere). The kernels need ``K % 16 == 0`` and a row-major x.
    """
    gran = resolve_granularity(recipe, operand)
    if isinstance(recipe, str) and recipe.lower() == "256x256" and block == 128:
        block = 256
    fmt, scale_layout, use_kernel = _validate(x, gran, fmt, block, scale_layout, backend)
    rows, k = x.shape
    if x.numel() == 0 or not use_kernel:
        return _reference(x, gran, fmt, block, scale_layout)
    return _kernel(x, gran, fmt, block, scale_layout)


def _reference(x, gran, fmt, block, scale_layout):
    rows, k = x.shape
    gr, gc = _group_shape(gran, block)
    if x.numel() == 0:  # no elements: every group is empty -> scale 1
        r = 1 if gr is None else _ceil_div(rows, gr)
        c = 1 if gc is None else _ceil_div(k, gc)
        plain = torch.ones((r, c), dtype=torch.float32, device=x.device)
        return torch.empty((rows, k), dtype=fmt.torch_dtype, device=x.device), _layout_scales(plain, gran, scale_layout)
    g = _Blocks(block, block) if (gran is G.BLOCK_128x128 and block != 128) else gran
    q, plain = R.quantize(x, g, fmt)
    return q, _layout_scales(plain, gran, scale_layout)


# ----------------------------------------------------------------------------------------------------
# kernel path
# ----------------------------------------------------------------------------------------------------


def _cutlass_types(x, fmt):
    import cutlass

    return getattr(cutlass, _IN_DTYPES[x.dtype]), fmt.cutlass_dtype()


# Kernel tuning overrides per kind ("group", "block", "row_block", "row", "tensor_amax", "tensor_cast"):
# keyword arguments of the kernels' compile functions. Empty = the kernels' defaults; benchmarks set it
# to compare variants (the values are part of the compile-cache key).
TUNING = {}
AMAX_CTAS_PER_SM = 4  # per-tensor pass 1: resident CTAs per SM of its grid-stride grid


def _get(kind, x, fmt, *cfg):
    from cutedsl_gemm.kernels.sm90 import quantize_fp8 as K

    tune = dict(TUNING.get(kind, {}))
    key = ("quantize_fp8", kind, _IN_DTYPES[x.dtype], fmt.name) + tuple(cfg) + tuple(sorted(tune.items()))

    def build():
        ti, to = _cutlass_types(x, fmt)
        if kind == "group":
            return K.compile_group(ti, to, fmt.max_finite, cfg[0], scale_mn_major=cfg[1] == "mn_major", **tune)
        if kind == "block":
            return K.compile_block(ti, to, fmt.max_finite, cfg[0], **tune)
        if kind == "row_block":
            return K.compile_row_block(ti, to, fmt.max_finite, cfg[1], threads=cfg[0], **tune)
        if kind == "row":
            return K.compile_row(ti, to, fmt.max_finite, **tune)
        if kind == "tensor_amax":
            return K.compile_tensor_amax(ti, **tune)
        if kind == "tensor_cast":
            return K.compile_tensor_cast(ti, to, fmt.max_finite, **tune)
        raise AssertionError(kind)

    return KERNEL_CACHE.get(key, build)


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernel(x, gran, fmt, block, scale_layout):
    rows, k = x.shape
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    q = torch.empty((rows, k), dtype=fmt.torch_dtype, device=dev)
    if gran is G.GROUP_1x128:
        kb = _ceil_div(k, 128)
        s = torch.empty((kb, rows), **f32).t() if scale_layout == "mn_major" else torch.empty((rows, kb), **f32)
        _get("group", x, fmt, 128, scale_layout)(x, q, s, s)
        return q, s
    if gran is G.BLOCK_128x128:
        kb = _ceil_div(k, block)
        width = _ceil_div(kb, 4) * 4 if scale_layout == "padded" else kb
        s = torch.empty((_ceil_div(rows, block), width), **f32)
        _get("block", x, fmt, block)(x, q, s, s)
        return q, s
    if gran is G.ROW:
        from cutedsl_gemm.kernels.sm90.quantize_fp8 import row_tile

        s = torch.empty((rows, 1), **f32)
        tile = row_tile(k, x.element_size() * 8)
        if tile is not None:  # one CTA per row (a 1 x 2^n block), read once where it fits in registers
            _get("row_block", x, fmt, *tile)(x, q, s, s)
        else:  # rows longer than 65536: one warp per row, two passes
            _get("row", x, fmt)(x, q, s)
        return q, s
    # per-tensor: partial maxima (grid-stride CTAs, no atomics), then the cast kernel folds them
    ntiles = _ceil_div(rows, 128) * _ceil_div(k, 128)
    part = torch.empty((max(1, min(ntiles, AMAX_CTAS_PER_SM * _num_sms(dev))),), **f32)
    s = torch.empty((1,), **f32)
    _get("tensor_amax", x, fmt)(x, part)
    _get("tensor_cast", x, fmt)(x, q, s, part)
    return q, s.reshape(())
