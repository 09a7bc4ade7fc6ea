"""The quantize family: ``quantize_fp8``, ``quantize_mx``, ``quantize_nvfp4`` and ``quantize_int8`` (the FP8
kernels' row and tensor forms with an int8 target; its contract is in its docstring).

Each takes ``backend``: ``"kernel"`` runs the CuTe DSL kernels (CUDA tensors only), ``"reference"`` the torch
reference of :mod:`cutedsl_gemm.numerics.reference` (any device), and ``"auto"`` (the default) the kernel for
CUDA tensors and the reference for every other device. Kernel and reference give the same bits, so ``"auto"``
on a CPU tensor is the same function computed by torch; ask for ``"kernel"`` to make a CPU tensor an error.

``quantize_fp8``: bf16/fp16/fp32 -> E4M3/E5M2 with fp32 scales in the layouts the Hopper GEMMs consume.
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

``quantize_mx`` / ``quantize_nvfp4``: bf16/fp32 (fp16 on the reference only) -> a
:class:`~cutedsl_gemm.numerics.reference.BlockScaledTensor`: packed elements and SWIZZLE_32_4_4 blocked
scales (MX: UE8M0 per 32 elements; NVFP4: E4M3 per 16 and an fp32 global decode scale that stays on the
device), the layouts the Blackwell block-scaled GEMMs and ``F.scaled_mm`` read.

Each quantizer's torch operator (``torch.ops.cutedsl_gemm.quantize_fp8``, ``quantize_int8``, ``quantize_mx``,
``quantize_nvfp4``: schema, implementation, fake implementation and the ``traced_*`` form the function takes under
``torch.compile`` on a kernel path) is defined beside it.
"""

from __future__ import annotations

import contextlib
import tempfile

import torch

from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.codecs import fp32_bits, packed_row_bytes, storage_view
from cutedsl_gemm.numerics.formats import (
    BF16,
    DTYPE_FORMATS,
    E2M1,
    E4M3,
    FLOAT_FORMATS,
    FP8_FORMATS,
    FP32,
    FP32_SCALE_GRANULARITIES,
    INT8,
    RECIPES,
    UE8M0,
    ScaleGranularity,
    ScalingRecipe,
    ceil_div,
    element_format,
    float_format,
    round_up,
)
from cutedsl_gemm.numerics.formats import recipe as as_recipe
from cutedsl_gemm.numerics.scale_layouts import blocked_scale_shape
from cutedsl_gemm.ops.library import EAGER, OPS, define, op_name
from cutedsl_gemm.runtime.device import device_info
from cutedsl_gemm.runtime.jit import KERNEL_CACHE
from cutedsl_gemm.runtime.plans import PREPARED

G = ScaleGranularity
VEC = 16  # the FP8 kernels' vector width in elements: K must be a multiple of it
BACKENDS = ("auto", "kernel", "reference")


def kernel_backend(x: torch.Tensor, backend: str) -> bool:
    """Whether ``backend`` runs the kernels on ``x`` ("auto": where it is on CUDA); a bad name, or "kernel" off
    CUDA, is refused."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'kernel' or 'reference', got {backend!r}")
    use_kernel = backend == "kernel" or (backend == "auto" and x.is_cuda)
    if use_kernel and not x.is_cuda:
        raise ValueError(f"backend='kernel' needs a CUDA tensor, got device {x.device}")
    return use_kernel
_LAYOUTS = {G.GROUP_1x128: ("mn_major", "row_major"), G.BLOCK_128x128: ("row_major", "padded")}
BLOCK_QUANTIZER_INPUTS = (BF16, FP32)  # what the MX / NVFP4 kernels read


def _fp8_choices() -> str:
    grans = ", ".join(repr(g.label) for g in FP32_SCALE_GRANULARITIES)
    return (
        f"a granularity ({grans}, '256x256' or a ScaleGranularity), or a GEMM recipe "
        f"({', '.join(repr(r.name) for r in RECIPES.values() if r.scale_format == 'fp32')} or a ScalingRecipe) with "
        "operand='a' or 'b'"
    )


def resolve_granularity(gran, operand: str = "a") -> ScaleGranularity:
    """The granularity quantize_fp8 applies: ``gran`` itself (a ScaleGranularity, any of its names, a
    ``F.ScalingType``), "256x256" (the 2-D block family with block=256), or operand "a" / "b" of a
    recipe (a ScalingRecipe or a recipe name; :func:`~cutedsl_gemm.numerics.formats.recipe`'s rule)."""
    if isinstance(gran, str) and gran.lower() == "256x256":
        return G.BLOCK_128x128  # the 2-D block family; block=256 selects the size
    if not isinstance(gran, (str, ScalingRecipe, ScaleGranularity)) and not isinstance(getattr(gran, "name", 0), str):
        raise TypeError(f"granularity must be {_fp8_choices()}; got {type(gran).__name__}")
    if operand not in ("a", "b"):
        raise ValueError(f"operand must be 'a' or 'b', got {operand!r}")
    try:
        g = G.named(gran)
    except ValueError:
        try:
            g = getattr(as_recipe(gran), operand)
        except ValueError:
            raise ValueError(f"quantize_fp8 got an unknown recipe {gran!r}; expected {_fp8_choices()}") from None
    if g not in FP32_SCALE_GRANULARITIES:
        grans = ", ".join(x.label for x in FP32_SCALE_GRANULARITIES)
        raise ValueError(
            f"quantize_fp8 handles the {grans} (and 256x256) granularities; got {g.label} "
            "(MX and NVFP4 scales come from quantize_mx and quantize_nvfp4)"
        )
    return g


def _validate(x, gran, fmt, block, scale_layout, backend, pointers=True):
    """(fmt, scale layout, whether the kernel runs) after every check on the arguments; ``pointers=False``
    leaves out x's address (fake tensors have none)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if DTYPE_FORMATS.get(x.dtype) not in FLOAT_FORMATS:
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
        raise ValueError(f"block={block!r} only applies to 2-D block scaling; {gran.label} uses 128")
    allowed = _LAYOUTS.get(gran)
    if allowed is None:
        if scale_layout is not None:
            raise ValueError(f"scale_layout does not apply to {gran.label} scaling (got {scale_layout!r})")
        scale_layout = None
    else:
        scale_layout = allowed[0] if scale_layout is None else scale_layout
        if scale_layout not in allowed:
            raise ValueError(f"scale_layout for {gran.label} must be one of {allowed}, got {scale_layout!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'kernel' or 'reference', got {backend!r}")
    use_kernel = backend == "kernel" or (backend == "auto" and x.is_cuda)
    if use_kernel:
        rows, k = x.shape
        if k % VEC:
            raise ValueError(f"K (x.shape[1]) must be a multiple of {VEC} for the FP8 kernels, got {k}")
        if x.stride(1) != 1 or (rows > 1 and x.stride(0) != k):
            raise ValueError(f"x must be row-major contiguous (strides ({k}, 1)), got {x.stride()}; call .contiguous()")
        if pointers and x.data_ptr() % 16:
            raise ValueError("x's data pointer must be 16-byte aligned (a sliced view may not be); call .clone()")
        if not x.is_cuda:
            raise ValueError(f"backend='kernel' needs a CUDA tensor, got device {x.device}")
        tile_cols = block if gran is G.BLOCK_128x128 else 128  # the tile kernels' grid.y = ceil(K / tile)
        if gran is not G.ROW and ceil_div(k, tile_cols) > 65535:
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
        out = torch.ones((r, round_up(c, 4)), dtype=torch.float32, device=plain.device)
        out[:, :c] = plain
        return out
    return plain.contiguous()


def quantize_fp8(
    x: torch.Tensor,
    granularity="1x128",
    *,
    fmt="e4m3",
    block: int = 128,
    scale_layout: str | None = None,
    operand: str = "a",
    backend: str = "auto",
    recipe=None,
):
    """Quantize a 2-D tensor (rows, K) to FP8. Returns ``(q, scales)`` (see the module docstring).

    ``granularity`` (positional or keyword; default ``"1x128"``): "tensor", "row", "1x128", "128x128", "256x256", a
    ScaleGranularity or a ``F.ScalingType``, or a ScalingRecipe / recipe name together with ``operand`` ("a" for A
    (M, K), "b" for W (N, K)); see :func:`resolve_granularity`. ``recipe=`` is the former name of ``granularity``:
    it still works, with a DeprecationWarning, and goes away in the next release. ``fmt``: "e4m3" (default) or
    "e5m2". ``block``: 128 (default) or 256 for 2-D blocks. ``scale_layout``: see the module docstring (default: the
    first listed for the granularity). ``backend``: "kernel" (CuTe DSL, CUDA tensors), "reference" (torch, any
    device) or "auto" (default: kernel on CUDA, reference elsewhere). The kernels need ``K % 16 == 0`` and a
    row-major x. Under ``torch.compile`` the kernel path is the op ``torch.ops.cutedsl_gemm.quantize_fp8``.
    """
    if recipe is not None:
        granularity = _renamed_recipe(granularity, recipe)
    if _traced(x, backend):
        return traced_quantize_fp8(x, granularity, fmt=fmt, block=block, scale_layout=scale_layout, operand=operand)
    sig = (x.shape, x.dtype, x.get_device(), granularity, fmt, block, scale_layout, operand, backend) \
        if type(x) is torch.Tensor else None
    sig, out = _run_kept(sig, x)
    if out is not None:
        return out
    gran, fmt, block, scale_layout, use_kernel = _fp8_arguments(x, granularity, fmt, block, scale_layout, operand,
                                                                backend)
    if x.numel() == 0 or not use_kernel:
        return _reference(x, gran, fmt, block, scale_layout)
    run = _plan(x, gran, fmt, block, scale_layout)
    _keep(sig, run)
    return run(x)


def _renamed_recipe(granularity, recipe):
    """quantize_fp8's granularity from its former keyword ``recipe=`` (a DeprecationWarning)."""
    import warnings

    if granularity != "1x128":
        raise TypeError("quantize_fp8 got both granularity and recipe (its former name): pass granularity only")
    warnings.warn("quantize_fp8(recipe=...) is now quantize_fp8(granularity=...) (or positional); recipe= goes away "
                  "in the next release", DeprecationWarning, stacklevel=3)
    return recipe


# Call signature (x's shape, dtype and device, the arguments) -> the launch of a kernel-path call (``_plan``):
# a repeated call allocates and launches. What the compiled kernels check before every launch (TVM-FFI: dtype,
# extents, compact strides, 16-byte alignment) is not checked again; a call they refuse takes the long way.
# (kept in the one prepared-call cache, ``runtime.plans.PREPARED``)
QUANTIZE = "quantize"


def _traced(x, backend: str) -> bool:
    """Whether this call is being traced by torch.compile onto a kernel path: it then becomes the op (recorded, not
    traced into the launch); the reference backend stays torch code the compiler traces."""
    return torch.compiler.is_compiling() and (backend == "auto" or backend == "kernel" and x.is_cuda)


def _run_kept(sig, x):
    """(sig, output) of the launch kept for call signature ``sig``: output None where there is none, or where the
    compiled kernel refused ``x`` before launching (the caller's checks then say why); sig None where an argument
    is unhashable (the caller validates the long way and keeps nothing)."""
    if sig is None:
        return None, None
    try:
        run = PREPARED.get(QUANTIZE, sig)
    except TypeError:
        return None, None
    if run is not None:
        try:
            return sig, run(x)
        except (TypeError, ValueError):
            pass
    return sig, None


def _keep(sig, run) -> None:
    """Keep ``run`` for repeated calls with signature ``sig`` (None: nothing to keep)."""
    if sig is not None:
        PREPARED.keep(QUANTIZE, sig, run)


def kernel_launch(x: torch.Tensor, granularity, *, fmt="e4m3"):
    """The kernel launch of ``quantize_fp8(x, granularity, fmt=fmt)`` (``fmt`` "int8": ``quantize_int8(x,
    granularity)``) on CUDA tensors of x's shape, dtype and device: a function x -> (q, scales), checked and kept
    once (what a layer calls on every forward). Its kernels refuse a strided or misaligned x (TypeError /
    ValueError)."""
    if fmt == "int8":
        sig = ("int8", x.shape, x.dtype, x.get_device(), granularity, "kernel")
        run = PREPARED.get(QUANTIZE, sig)
        if run is None:
            gran, _ = _int8_arguments(x, granularity, "kernel")
            run = _plan(x, gran, INT8, 128, None)
            PREPARED.keep(QUANTIZE, sig, run)
        return run
    sig = (x.shape, x.dtype, x.get_device(), granularity, fmt, 128, None, "a", "kernel")
    run = PREPARED.get(QUANTIZE, sig)
    if run is None:
        gran, fmt_, block, layout, _ = _fp8_arguments(x, granularity, fmt, 128, None, "a", "kernel")
        run = _plan(x, gran, fmt_, block, layout)
        PREPARED.keep(QUANTIZE, sig, run)
    return run


def _fp8_arguments(x, granularity, fmt, block, scale_layout, operand, backend, pointers=True):
    """(granularity, fmt, block, scale layout, whether the kernel runs) of a quantize_fp8 call, checked."""
    gran = resolve_granularity(granularity, operand)
    if isinstance(granularity, str) and granularity.lower() == "256x256" and block == 128:
        block = 256
    fmt, scale_layout, use_kernel = _validate(x, gran, fmt, block, scale_layout, backend, pointers)
    return gran, fmt, block, scale_layout, use_kernel


def quantize_fp8_like(x, granularity="1x128", *, fmt="e4m3", block=128, scale_layout=None, operand="a"):
    """Empty ``(q, scales)`` with the shapes, dtypes and strides ``quantize_fp8(x, ...)`` returns, after its
    checks on the arguments but x's address: the op's fake implementation (x a fake or meta tensor)."""
    gran, fmt, block, scale_layout, _ = _fp8_arguments(x, granularity, fmt, block, scale_layout, operand, "auto",
                                                       False)
    q, _, scales = _allocator(gran, fmt, block, scale_layout, *x.shape)(x)
    return q, scales


# ----------------------------------------------------------------------------------------------------
# quantize_fp8's op
# ----------------------------------------------------------------------------------------------------

QUANTIZE_FP8_SCHEMA = (
    '(Tensor x, str recipe="1x128", *, str fmt="e4m3", int block=128, str? scale_layout=None, str operand="a") '
    "-> (Tensor, Tensor)"
)

define("quantize_fp8", QUANTIZE_FP8_SCHEMA, quantize_fp8, quantize_fp8_like)
EAGER.quantize_fp8 = quantize_fp8


def traced_quantize_fp8(x, granularity, *, fmt, block, scale_layout, operand):
    """``quantize_fp8`` under ``torch.compile``: the op (whose schema names the granularity ``recipe``, passed by
    position)."""
    return OPS.quantize_fp8(x, op_name(granularity), fmt=op_name(fmt), block=block, scale_layout=scale_layout,
                            operand=operand)


def _reference(x, gran, fmt, block, scale_layout):
    rows, k = x.shape
    gr, gc = _group_shape(gran, block)
    if x.numel() == 0:  # no elements: every group is empty -> scale 1
        r = 1 if gr is None else ceil_div(rows, gr)
        c = 1 if gc is None else ceil_div(k, gc)
        plain = torch.ones((r, c), dtype=torch.float32, device=x.device)
        return torch.empty((rows, k), dtype=fmt.torch_dtype, device=x.device), _layout_scales(plain, gran, scale_layout)
    g = (block, block) if (gran is G.BLOCK_128x128 and block != 128) else gran
    q, plain = R.quantize(x, g, fmt)
    return q, _layout_scales(plain, gran, scale_layout)


# ----------------------------------------------------------------------------------------------------
# kernel path
# ----------------------------------------------------------------------------------------------------


# Kernel tuning overrides per kind ("group", "block", "row_block", "row", "tensor_amax", "tensor_cast"):
# keyword arguments of the kernels' compile functions. Empty = the kernels' defaults; benchmarks set it
# to compare variants (the values are part of the compile-cache key). A call signature's kernels are picked
# once (``runtime.plans.PREPARED``): clear it after changing TUNING.
TUNING = {}
AMAX_CTAS_PER_SM = 4  # per-tensor pass 1: resident CTAs per SM of its grid-stride grid


def fp8_quantizer_entry(kind, src, fmt, *cfg, **tune):
    """(entry, fake arguments) of the FP8 / INT8 quantizer kernel ``kind`` from input format ``src`` to ``fmt``, with
    the kind's configuration ``cfg`` as ``_plan`` passes it ("group": group columns and scale layout; "block": the
    block; "row_block": threads and block columns) and ``tune`` (``TUNING``). Imports the DSL."""
    from cutedsl_gemm.kernels.sm90 import quantize_fp8 as K

    ti, to = src.cutlass_dtype(), fmt.cutlass_dtype()
    if kind == "group":
        return K.group_entry(ti, to, fmt.max_finite, cfg[0], scale_mn_major=cfg[1] == "mn_major", **tune)
    if kind == "block":
        return K.block_entry(ti, to, fmt.max_finite, cfg[0], **tune)
    if kind == "row_block":
        return K.row_block_entry(ti, to, fmt.max_finite, cfg[1], threads=cfg[0], **tune)
    if kind == "row":
        return K.row_entry(ti, to, fmt.max_finite, **tune)
    if kind == "gated":  # ops/gated.py: granularity label, row block columns (or 128), weighted
        return K.gated_entry(ti, to, fmt.max_finite, *cfg, **tune)
    if kind == "tensor_amax":
        return K.tensor_amax_entry(ti, **tune)
    if kind == "tensor_cast":
        return K.tensor_cast_entry(ti, to, fmt.max_finite, **tune)
    raise ValueError(f"no FP8 quantizer kernel {kind!r}")


def _get(kind, x, fmt, *cfg):
    tune = dict(TUNING.get(kind, {}))
    src = float_format(x.dtype)
    key = ("quantize_fp8", kind, src.cutlass_name, fmt.name) + tuple(cfg) + tuple(sorted(tune.items()))

    def build():
        from cutedsl_gemm.runtime.compile import compile_entry  # imports the DSL: only when compiling

        return compile_entry(*fp8_quantizer_entry(kind, src, fmt, *cfg, **tune))

    return KERNEL_CACHE.get(key, build)


def amax_partials_plan(x, fmt):
    """The per-tensor scale's first pass for ``x``'s shape, dtype and device: a function x -> the partial maxima
    (G,) fp32 of its amax kernel (grid-stride CTAs, no atomics), which the kernel after it folds."""
    rows, k = x.shape
    parts = max(1, min(ceil_div(rows, 128) * ceil_div(k, 128), AMAX_CTAS_PER_SM * device_info(x.device.index)[1]))
    amax = _get("tensor_amax", x, fmt)

    def run(x):
        part = x.new_empty((parts,), dtype=torch.float32)
        amax(x, part)
        return part
    return run


def _allocator(gran, fmt, block, scale_layout, rows, k):
    """x -> (q, the scales the kernel writes, the scales returned) for a (rows, K) input: the layouts of the
    module docstring (per tensor the kernel writes a (1,) tensor, returned as its 0-d view)."""
    qd, f32 = fmt.torch_dtype, torch.float32
    if gran is G.TENSOR:
        def alloc(x):
            s = x.new_empty((1,), dtype=f32)
            return x.new_empty((rows, k), dtype=qd), s, s.view(())
        return alloc
    if gran is G.GROUP_1x128:
        kb = ceil_div(k, 128)
        if scale_layout == "mn_major":
            def alloc(x):
                s = x.new_empty((kb, rows), dtype=f32).t()
                return x.new_empty((rows, k), dtype=qd), s, s
            return alloc
        shape = (rows, kb)
    elif gran is G.BLOCK_128x128:
        kb = ceil_div(k, block)
        shape = (ceil_div(rows, block), round_up(kb, 4) if scale_layout == "padded" else kb)
    else:
        shape = (rows, 1)

    def alloc(x):
        s = x.new_empty(shape, dtype=f32)
        return x.new_empty((rows, k), dtype=qd), s, s
    return alloc


def _plan(x, gran, fmt, block, scale_layout):
    """The kernel launch of a call on ``x``: a function of x (that shape, dtype and device) -> (q, scales)."""
    rows, k = x.shape
    alloc = _allocator(gran, fmt, block, scale_layout, rows, k)
    if gran is G.TENSOR:
        # partial maxima (grid-stride CTAs, no atomics), then the cast kernel folds them
        amax, cast = amax_partials_plan(x, fmt), _get("tensor_cast", x, fmt)

        def run(x):
            q, s, out = alloc(x)
            part = amax(x)
            cast(x, q, s, part)
            return q, out
        return run
    if gran is G.GROUP_1x128:
        fn = _get("group", x, fmt, 128, scale_layout)
    elif gran is G.BLOCK_128x128:
        fn = _get("block", x, fmt, block)
    else:
        from cutedsl_gemm.kernels.sm90.quantize_fp8 import row_tile

        tile = row_tile(k, x.element_size() * 8)
        if tile is None:  # rows longer than 65536: one warp per row, two passes
            row = _get("row", x, fmt)

            def run(x):
                q, s, out = alloc(x)
                row(x, q, s)
                return q, out
            return run
        fn = _get("row_block", x, fmt, *tile)  # one CTA per row (a 1 x 2^n block), read once in registers

    def run(x):
        q, s, out = alloc(x)
        fn(x, q, s, s)
        return q, out
    return run


# ----------------------------------------------------------------------------------------------------
# MX and NVFP4
# ----------------------------------------------------------------------------------------------------


def _element_code(fmt):
    """The plain numbers the quantizer kernel's encoder takes for ``fmt``."""
    from cutedsl_gemm.kernels.sm100.quantize_mx import ElementCode

    return ElementCode(fmt.bits, fmt.man_bits, fmt.bias, fp32_bits(fmt.max_finite), fmt.max_code, fmt.emax)


def _block_recipe(name: str, fmt):
    """The quantizer kernel's recipe numbers for "mx" / "nvfp4" with elements ``fmt`` (checked)."""
    from cutedsl_gemm.kernels.sm100.quantize_mx import BlockRecipe

    if name == "mx":
        if fmt not in R.MX_ELEMENT_FORMATS:
            names = [f.name for f in R.MX_ELEMENT_FORMATS]
            raise ValueError(f"MX element format must be one of {names}; got {fmt.name}")
        return BlockRecipe("mx", R.MX_BLOCK, R.UE8M0_NAN)
    if name == "nvfp4":
        if fmt is not E2M1:
            raise ValueError(f"NVFP4 elements are e2m1; got {fmt.name}")
        return BlockRecipe("nvfp4", R.NVFP4_BLOCK, R.E4M3_NAN, _element_code(E4M3), R.NVFP4_GLOBAL_DENOM)
    raise ValueError(f"recipe must be 'mx' or 'nvfp4'; got {name!r}")


def compile_quantizer(recipe: str, fmt, in_dtype: torch.dtype = torch.bfloat16, compute_global: bool = False,
                      keep_ptx: bool = False, arch: str | None = None):
    """``cute.compile`` the MX / NVFP4 quantizer kernel (no GPU needed) for ``arch``, by default the DSL's
    target arch (``CUTE_DSL_ARCH``, else the current GPU's).

    Call signature of the result: ``fn(x, q_bytes, scale_bytes, global_scale, amax_scratch)`` on the
    current stream. ``keep_ptx`` keeps the PTX text on the result (``.__ptx__``); what the DSL dumps on
    the way goes to a temporary directory that is removed.
    """
    from cutedsl_gemm.kernels.sm100.quantize_mx import block_scale_entry
    from cutedsl_gemm.runtime.compile import compile_entry, targeting  # import the DSL: only when compiling

    fmt = element_format(fmt)
    rec = _block_recipe(recipe, fmt)
    src = DTYPE_FORMATS.get(in_dtype)
    if src not in BLOCK_QUANTIZER_INPUTS:
        raise TypeError(f"quantizer input must be bfloat16 or float32; got {in_dtype}")
    with contextlib.ExitStack() as stack:
        if arch is not None:
            stack.enter_context(targeting(arch))
        dump_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="cutedsl_gemm_ptx_")) if keep_ptx else None
        entry = block_scale_entry(rec, _element_code(fmt), src.cutlass_dtype(), compute_global)
        return compile_entry(*entry, arch=arch, ptx_dump_dir=dump_dir)


def _quantizer(recipe: str, fmt, in_dtype: torch.dtype, compute_global: bool):
    key = ("quantize_blockscaled", recipe, fmt.name, str(in_dtype), bool(compute_global))
    return KERNEL_CACHE.get(key, lambda: compile_quantizer(recipe, fmt, in_dtype, compute_global))


def _block_backend(x: torch.Tensor, block: int, backend: str) -> bool:
    """Check ``x`` and ``backend``; True when the kernel runs."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'kernel' or 'reference', got {backend!r}")
    R.check_quantizer_input(x, block)
    if x.numel() == 0 or (backend == "auto" and not x.is_cuda) or backend == "reference":
        return False
    if not x.is_cuda:
        raise ValueError(f"backend='kernel' needs a CUDA tensor, got device {x.device} (the reference runs anywhere)")
    if DTYPE_FORMATS[x.dtype] not in BLOCK_QUANTIZER_INPUTS:
        raise TypeError(f"the quantizer kernels take bfloat16 or float32 input; got {x.dtype} (backend='reference' "
                        "takes float16)")
    return True


def quantize_mx(x: torch.Tensor, fmt="e4m3", *, backend: str = "auto") -> R.BlockScaledTensor:
    """OCP MX quantization of a (rows, K) tensor with 32-element blocks and UE8M0 scales (``fmt``: e4m3,
    e5m2, e3m2, e2m3 or e2m1). Bit for bit :func:`~cutedsl_gemm.numerics.reference.quantize_mx_reference`;
    ``backend`` as in the module doc."""
    fmt = element_format(fmt)
    if _traced(x, backend):
        return traced_quantize_mx(x, fmt)
    if not _block_backend(x, R.MX_BLOCK, backend):
        return R.quantize_mx_reference(x, fmt)
    x = x.contiguous()
    rows, k = x.shape
    fn = _quantizer("mx", fmt, x.dtype, False)
    q = torch.empty(rows, packed_row_bytes(k, fmt), dtype=torch.uint8, device=x.device)
    s = torch.empty(blocked_scale_shape(rows, k // R.MX_BLOCK), dtype=torch.uint8, device=x.device)
    unused_g = torch.ones(1, dtype=torch.float32, device=x.device)
    unused_amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    fn(x, q, s.view(-1), unused_g, unused_amax)
    return R.BlockScaledTensor(storage_view(q, fmt), s.view(UE8M0.torch_dtype), fmt, R.MX_BLOCK, (rows, k))


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None, *,
                   backend: str = "auto") -> R.BlockScaledTensor:
    """NVFP4 quantization of a (rows, K) tensor: E2M1 elements, an E4M3 scale per 16 and an fp32 per-tensor
    decode scale (``global_scale``, a one-element fp32 tensor, or computed on the device: no host
    synchronisation). Bit for bit :func:`~cutedsl_gemm.numerics.reference.quantize_nvfp4_reference`;
    ``backend`` as in the module doc."""
    if _traced(x, backend):
        return traced_quantize_nvfp4(x, global_scale)
    if not _block_backend(x, R.NVFP4_BLOCK, backend):
        return R.quantize_nvfp4_reference(x, global_scale)
    x = x.contiguous()
    rows, k = x.shape
    fn = _quantizer("nvfp4", E2M1, x.dtype, global_scale is None)
    q = torch.empty(rows, packed_row_bytes(k, E2M1), dtype=torch.uint8, device=x.device)
    s = torch.empty(blocked_scale_shape(rows, k // R.NVFP4_BLOCK), dtype=torch.uint8, device=x.device)
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    if global_scale is None:
        g = torch.empty(1, dtype=torch.float32, device=x.device)
    else:
        g = R.check_global_scale(global_scale, x.device).reshape(1).contiguous()
    fn(x, q, s.view(-1), g, amax)
    return R.BlockScaledTensor(storage_view(q, E2M1), s.view(E4M3.torch_dtype), E2M1, R.NVFP4_BLOCK, (rows, k),
                               g.reshape(()))


# ----------------------------------------------------------------------------------------------------
# the MX and NVFP4 ops
# ----------------------------------------------------------------------------------------------------

QUANTIZE_MX_SCHEMA = '(Tensor x, str fmt="e4m3") -> (Tensor, Tensor)'
QUANTIZE_NVFP4_SCHEMA = "(Tensor x, Tensor? global_scale=None) -> (Tensor, Tensor, Tensor)"


def _quantize_mx_op(x, fmt="e4m3"):
    """``quantize_mx`` as the op returns it: (data, scales)."""
    t = quantize_mx(x, fmt)
    return t.data, t.scales


def _quantize_nvfp4_op(x, global_scale=None):
    """``quantize_nvfp4`` as the op returns it: (data, scales, global scale), the global scale a new tensor (an
    op's output never aliases its input)."""
    t = quantize_nvfp4(x, global_scale)
    return t.data, t.scales, (t.global_scale if global_scale is None else t.global_scale.clone())


def _quantize_mx_fake(x, fmt="e4m3"):
    f = element_format(fmt)
    if f not in R.MX_ELEMENT_FORMATS:
        raise ValueError(f"MX element format must be one of {[g.name for g in R.MX_ELEMENT_FORMATS]}; got {f.name}")
    _block_backend(x, R.MX_BLOCK, "auto")
    rows, k = x.shape
    data = x.new_empty((rows, packed_row_bytes(k, f)), dtype=torch.uint8)
    scales = x.new_empty(blocked_scale_shape(rows, k // R.MX_BLOCK), dtype=torch.uint8)
    return storage_view(data, f), scales.view(UE8M0.torch_dtype)


def _quantize_nvfp4_fake(x, global_scale=None):
    _block_backend(x, R.NVFP4_BLOCK, "auto")
    if global_scale is not None:
        R.check_global_scale(global_scale, x.device)
    rows, k = x.shape
    data = x.new_empty((rows, packed_row_bytes(k, E2M1)), dtype=torch.uint8)
    scales = x.new_empty(blocked_scale_shape(rows, k // R.NVFP4_BLOCK), dtype=torch.uint8)
    return storage_view(data, E2M1), scales.view(E4M3.torch_dtype), x.new_empty((), dtype=torch.float32)


define("quantize_mx", QUANTIZE_MX_SCHEMA, _quantize_mx_op, _quantize_mx_fake)
define("quantize_nvfp4", QUANTIZE_NVFP4_SCHEMA, _quantize_nvfp4_op, _quantize_nvfp4_fake)
EAGER.quantize_mx = _quantize_mx_op
EAGER.quantize_nvfp4 = _quantize_nvfp4_op


def traced_quantize_mx(x, fmt) -> R.BlockScaledTensor:
    """``quantize_mx`` under ``torch.compile``: the op's tensors in a BlockScaledTensor."""
    f = element_format(fmt)
    data, scales = OPS.quantize_mx(x, f.name)
    return R.BlockScaledTensor(data, scales, f, R.MX_BLOCK, (x.shape[0], x.shape[1]))


def traced_quantize_nvfp4(x, global_scale) -> R.BlockScaledTensor:
    """``quantize_nvfp4`` under ``torch.compile``: the op's tensors in a BlockScaledTensor."""
    data, scales, g = OPS.quantize_nvfp4(x, global_scale)
    return R.BlockScaledTensor(data, scales, E2M1, R.NVFP4_BLOCK, (x.shape[0], x.shape[1]), g)


# ----------------------------------------------------------------------------------------------------
# INT8
# ----------------------------------------------------------------------------------------------------


def quantize_int8(x: torch.Tensor, granularity="row", *, backend: str = "auto"):
    """Symmetric INT8 quantization of a 2-D (rows, K) bf16/fp16/fp32 tensor for the int8 ``scaled_mm``:
    ``(q, scales)``, q torch.int8 (rows, K) row-major, scales fp32 (rows, 1) contiguous (``granularity`` "row", the
    default: per token or per output channel) or shape () ("tensor"); ``granularity`` positional or keyword, as
    quantize_fp8's.

    Numerics (:func:`~cutedsl_gemm.numerics.reference.quantize_int8_reference`, which the kernels match bit for
    bit): ``scale = amax / 127`` over the finite ``|x|`` of the row or tensor (1 where there is none or all are
    zero), ``q = RNE(clamp(x / scale, -127, 127))`` with the fp32 quotient correctly rounded (the FP8
    quantizers' division), +-inf -> +-127, NaN -> 0. ``backend`` as in the module doc; the kernels need
    ``K % 16 == 0`` and a row-major x (they are the FP8 row / tensor kernels with an integer target).
    W8A8: ``qx, sx = quantize_int8(x)``, ``qw, sw = quantize_int8(w)`` (W (N, K)), then
    ``scaled_mm(qx, qw.t(), sx, sw.t())``.
    """
    if _traced(x, backend):
        return traced_quantize_int8(x, granularity)
    sig = ("int8", x.shape, x.dtype, x.get_device(), granularity, backend) if type(x) is torch.Tensor else None
    sig, out = _run_kept(sig, x)
    if out is not None:
        return out
    gran, use_kernel = _int8_arguments(x, granularity, backend)
    if x.numel() == 0 or not use_kernel:
        return _reference(x, gran, INT8, 128, None)
    run = _plan(x, gran, INT8, 128, None)
    _keep(sig, run)
    return run(x)


def _int8_arguments(x, granularity, backend, pointers=True):
    """(granularity, whether the kernel runs) of a quantize_int8 call, checked (the FP8 kernels' input rules)."""
    gran = G.named(granularity)
    if gran not in (G.ROW, G.TENSOR):
        raise ValueError(f"quantize_int8 scales per row or per tensor ('row', 'tensor'); got {gran.label!r}")
    _, _, use_kernel = _validate(x, gran, E4M3, 128, None, backend, pointers)
    return gran, use_kernel


def quantize_int8_like(x, granularity="row"):
    """Empty ``(q, scales)`` with the shapes, dtypes and strides ``quantize_int8(x, granularity)`` returns, after
    its checks on the arguments but x's address: the op's fake implementation (x a fake or meta tensor)."""
    gran, _ = _int8_arguments(x, granularity, "auto", False)
    q, _, scales = _allocator(gran, INT8, 128, None, *x.shape)(x)
    return q, scales


# ----------------------------------------------------------------------------------------------------
# quantize_int8's op
# ----------------------------------------------------------------------------------------------------

QUANTIZE_INT8_SCHEMA = '(Tensor x, str granularity="row") -> (Tensor, Tensor)'

define("quantize_int8", QUANTIZE_INT8_SCHEMA, quantize_int8, quantize_int8_like)
EAGER.quantize_int8 = quantize_int8


def traced_quantize_int8(x, granularity):
    """``quantize_int8`` under ``torch.compile``: the op."""
    return OPS.quantize_int8(x, op_name(granularity))
