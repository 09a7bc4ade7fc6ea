"""Scale layouts: which recipe a ``scaled_mm`` call uses and the views the Hopper kernels take, and the
SWIZZLE_32_4_4 blocked layout of the Blackwell block scales.

Hopper recipes
==============
Conventions follow ``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm`` so either can be swapped for
ours. ``a`` is (M, K); ``b`` is (K, N) (the transpose of an (N, K) weight); ``Kb = ceil(K / 128)``:

================  ==========================  ==================================================
per operand       scale_a                     scale_b
================  ==========================  ==================================================
TensorWise        1 element                   1 element
RowWise           (M, 1)                      (1, N)
BlockWise1x128    (M, Kb), any strides        (Kb, N), any strides
                  (torch: strides (1, M))     (torch: strides (N, 1))
BlockWise128x128  (ceil(M/128), Kb)           (Kb, ceil(N/128))
                  (torch: strides (L4, 1))    (torch: strides (1, L4)), L4 = round_up(Kb, 4)
================  ==========================  ==================================================

For the 128x128 granularity the K-block axis may also be given padded to ``L4`` (cuBLAS's storage, as
``quantize_fp8(..., scale_layout="padded")`` returns it); the padding columns are ignored.

The supported operand pairs are the fp32-scaled recipes of ``formats.RECIPES``: TensorWise x TensorWise,
RowWise x RowWise, and the block-scaled pairs 1x128 x 128x128 (DeepSeek-V3), 128x128 x 128x128 and
1x128 x 1x128. The kernels read block scales with run-time strides, so no layout is copied.

Block-scale layout (``SWIZZLE_32_4_4``)
=======================================
cuBLAS, torch (``F.scaled_mm`` with ``SwizzleType.SWIZZLE_32_4_4``) and the tcgen05 MMA read MX / NVFP4
scales in atoms of 128 rows x 4 scale columns (512 bytes). Plain ``(rows, kb)`` scales are padded to
``(round_up(rows, 128), round_up(kb, 4))`` with zero bytes; atoms are stored row-atom-major
(``atom = (r // 128) * (cols_padded // 4) + c // 4``) and inside an atom entry ``(r, c)`` sits at byte
``(r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4`` (the 32x4x4 interleave). :func:`to_blocked` /
:func:`from_blocked` convert; blocked tensors are returned 2-D with the padded shape, their memory in
blocked order (torch only checks the element count).
"""

from __future__ import annotations

import weakref

import torch

from cutedsl_gemm.numerics.codecs import as_bytes
from cutedsl_gemm.numerics.formats import FP32_SCALE_GRANULARITIES, RECIPES, ScaleGranularity, ceil_div, round_up

G = ScaleGranularity
SCALE_K = G.GROUP_1x128.cols  # K elements per block scale
# (A, W) granularity pair -> recipe name, in RECIPES' order (the order shapes are tried in)
_PAIRS = {(r.a, r.b): r.name for r in RECIPES.values() if r.scale_format == "fp32"}


def granularity(g) -> ScaleGranularity:
    """A granularity from any of its names or a torch.nn.functional.ScalingType (a known granularity that no
    fp32 recipe uses is refused later, with the supported pairs)."""
    try:
        return G.named(g)
    except ValueError:
        grans = FP32_SCALE_GRANULARITIES
        raise ValueError(
            f"unknown scale recipe {g!r}: expected {', '.join(repr(x.label) for x in grans)} or a "
            f"torch.nn.functional.ScalingType ({', '.join(x.scaling_type for x in grans)})"
        ) from None


def _expected(gran: ScaleGranularity, operand: str, m: int, n: int, kb: int) -> str:
    if gran is G.TENSOR:
        return "one element"
    if gran is G.ROW:
        return f"({m}, 1)" if operand == "a" else f"(1, {n})"
    if gran is G.GROUP_1x128:
        return f"({m}, {kb})" if operand == "a" else f"({kb}, {n})"
    rb = ceil_div(m if operand == "a" else n, gran.rows)
    return f"({rb}, {kb})" if operand == "a" else f"({kb}, {rb})"


def _matches(gran: ScaleGranularity, s: torch.Tensor, operand: str, m: int, n: int, kb: int) -> bool:
    shape = tuple(s.shape)
    if gran is G.TENSOR:
        return s.numel() == 1 and s.dim() <= 2
    if gran is G.ROW:
        return shape == ((m, 1) if operand == "a" else (1, n))
    if gran is G.GROUP_1x128:
        return shape == ((m, kb) if operand == "a" else (kb, n))
    l4 = round_up(kb, 4)
    rb = ceil_div(m if operand == "a" else n, gran.rows)
    return shape in (((rb, kb), (rb, l4)) if operand == "a" else ((kb, rb), (l4, rb)))


#: The activation scale granularities the quantizers produce at run time: per tensor, per token, per 1x128 group.
ACTIVATION_GRANULARITIES = (G.TENSOR, G.ROW, G.GROUP_1x128)


def activation_granularity(scale_b, m: int, n: int, k: int, scale_recipe_b=None) -> ScaleGranularity:
    """The activations' scale granularity that pairs with the weight's scales ``scale_b`` (or ``scale_recipe_b``) in
    a supported recipe, tried in the order shapes are: per tensor with a per-tensor W, per token with per-channel W
    scales, 1x128 groups with block-scaled W. A TypeError / ValueError saying what W's scales may be otherwise."""
    if scale_recipe_b is not None:
        want = granularity(scale_recipe_b)
        found = next((a for a, b in _PAIRS if a in ACTIVATION_GRANULARITIES and b is want), None)
        if found is None:
            raise ValueError(f"no activation scaling pairs with weight scale recipe {want.label}; supported W recipes: "
                             + ", ".join(b.label for a, b in _PAIRS if a in ACTIVATION_GRANULARITIES))
        return found
    if not isinstance(scale_b, torch.Tensor):
        raise TypeError(f"scale_b must be a torch.Tensor, got {type(scale_b).__name__}")
    kb = ceil_div(k, SCALE_K)
    found = next((a for a, b in _PAIRS if a in ACTIVATION_GRANULARITIES and _matches(b, scale_b, "b", m, n, kb)), None)
    if found is None:
        raise ValueError(f"scale_b shape {tuple(scale_b.shape)} matches no weight scaling for N={n}, K={k}; expected "
                         + "; ".join(f"{b.label}: {_expected(b, 'b', m, n, kb)}"
                                     for a, b in _PAIRS if a in ACTIVATION_GRANULARITIES))
    return found


def resolve(
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    m: int,
    n: int,
    k: int,
    scale_recipe_a=None,
    scale_recipe_b=None,
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(kernel recipe, scale_a view, scale_b view) for a call, or a ValueError/TypeError saying what was
    expected. Without explicit recipes the scale shapes decide, in torch's order of preference."""
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
        if s.dtype != torch.float32:
            raise TypeError(f"{name} must be torch.float32, got {s.dtype}")
    kb = ceil_div(k, SCALE_K)
    if (scale_recipe_a is None) != (scale_recipe_b is None):
        raise ValueError("give both scale_recipe_a and scale_recipe_b, or neither (then the scale shapes decide)")
    if scale_recipe_a is not None:
        pair = (granularity(scale_recipe_a), granularity(scale_recipe_b))
        if pair not in _PAIRS:
            raise ValueError(
                f"scale recipes {pair[0].label} x {pair[1].label} are not supported; supported (A x B): "
                + ", ".join(f"{a.label} x {b.label}" for a, b in _PAIRS)
            )
        for gran, s, op in ((pair[0], scale_a, "a"), (pair[1], scale_b, "b")):
            if not _matches(gran, s, op, m, n, kb):
                raise ValueError(
                    f"scale_{op} for {gran.label} scaling must have shape {_expected(gran, op, m, n, kb)} "
                    f"(M={m}, N={n}, K={k}), got {tuple(s.shape)}"
                )
    else:
        pair = next(
            (p for p in _PAIRS if _matches(p[0], scale_a, "a", m, n, kb) and _matches(p[1], scale_b, "b", m, n, kb)),
            None,
        )
        if pair is None:
            raise ValueError(
                f"scale shapes {tuple(scale_a.shape)} and {tuple(scale_b.shape)} match no supported recipe for "
                f"M={m}, N={n}, K={k}; expected (scale_a x scale_b): "
                + "; ".join(
                    f"{a.label} x {b.label}: {_expected(a, 'a', m, n, kb)} x {_expected(b, 'b', m, n, kb)}"
                    for a, b in _PAIRS
                )
            )
    recipe = _PAIRS[pair]
    if recipe == "row":
        if m > 1 and scale_a.stride(0) != 1:
            raise ValueError(f"scale_a (M, 1) must be contiguous, got strides {tuple(scale_a.stride())}")
        if n > 1 and scale_b.stride(1) != 1:
            raise ValueError(f"scale_b (1, N) must be contiguous, got strides {tuple(scale_b.stride())}")
    return (recipe,) + kernel_views(recipe, kb, scale_a, scale_b)


# Per-tensor scales: the kernel takes a (1,) tensor, torch's convention is a 0-dim one. Making the view is most
# of the per-tensor recipe's extra host cost per call, so views are kept per scale tensor: keyed by id, checked
# by a weak reference to the very tensor and by its data pointer (a set_() on it makes a new view), and only for
# scales with a storage of their own size (a view kept here holds its storage alive, so never one into a large
# buffer). Bounded; cleared when full.
_SCALAR_VIEWS: dict = {}
_SCALAR_VIEWS_MAX = 256


def _one(s: torch.Tensor) -> torch.Tensor:
    d = s.dim()
    if d == 1:
        return s
    hit = _SCALAR_VIEWS.get(id(s))
    if hit is not None and hit[0]() is s and hit[1].data_ptr() == s.data_ptr():
        return hit[1]
    v = s.reshape(1)
    if s.untyped_storage().nbytes() <= 16:
        if len(_SCALAR_VIEWS) >= _SCALAR_VIEWS_MAX:
            _SCALAR_VIEWS.clear()
        _SCALAR_VIEWS[id(s)] = (weakref.ref(s), v)
    return v


# Block-scaled W scales: the kernel takes (columns or column blocks, Kb), torch's layout is (Kb padded to 4,
# ...): a slice and a transpose, a few microseconds of host time per call. W scales belong to a weight and live
# as long as it, so their view is kept as the per-tensor ones are (weak reference, data pointer, and strides,
# since an in-place restride keeps the pointer), for storages up to 1 MiB (a (Kb, N/128) fp32 scale tensor of a
# 57344 x 8192 weight is 115 KiB). Activation scales are new each call: their view is not kept, and not made
# when nothing is dropped.
_W_BLOCK_VIEWS: dict = {}
_W_BLOCK_VIEWS_MAX = 256
_W_BLOCK_VIEW_MAX_BYTES = 1 << 20


def _w_blocks(s: torch.Tensor, kb: int) -> torch.Tensor:
    hit = _W_BLOCK_VIEWS.get(id(s))
    if hit is not None and hit[0]() is s and hit[1] == kb and hit[2].data_ptr() == s.data_ptr() \
            and hit[3] == s.stride():
        return hit[2]
    v = s[:kb].t()
    if s.untyped_storage().nbytes() <= _W_BLOCK_VIEW_MAX_BYTES:
        if len(_W_BLOCK_VIEWS) >= _W_BLOCK_VIEWS_MAX:
            _W_BLOCK_VIEWS.clear()
        _W_BLOCK_VIEWS[id(s)] = (weakref.ref(s), kb, v, s.stride())
    return v


def kernel_views(recipe: str, kb: int, scale_a: torch.Tensor, scale_b: torch.Tensor):
    """The views the Hopper kernels take: (1,) x (1,) per tensor, (M, 1) x (1, N) per row, and
    (rows or row blocks, Kb) for both operands when block-scaled (padding columns dropped)."""
    if recipe == "tensor":  # A's scale is usually new per call (activations): a kept view would pin its memory
        return (scale_a if scale_a.dim() == 1 else scale_a.reshape(1)), _one(scale_b)
    if recipe == "row":
        return scale_a, scale_b
    return (scale_a if scale_a.shape[1] == kb else scale_a[:, :kb]), _w_blocks(scale_b, kb)


def w_kernel_view(recipe: str, kb: int, scale_b: torch.Tensor) -> torch.Tensor:
    """W's view of ``kernel_views`` alone (for calls whose A scales the kernel computes)."""
    if recipe == "tensor":
        return _one(scale_b)
    return scale_b if recipe == "row" else _w_blocks(scale_b, kb)


# ---------------------------------------------------------------------------------------------------
# SWIZZLE_32_4_4 blocked layout of the MX / NVFP4 block scales
# ---------------------------------------------------------------------------------------------------

SF_ATOM_ROWS = 128
SF_ATOM_COLS = 4
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS


def blocked_scale_shape(rows: int, k_blocks: int) -> tuple[int, int]:
    """Padded (rows, scale columns) of the SWIZZLE_32_4_4 layout for ``rows x k_blocks`` scales."""
    return round_up(rows, SF_ATOM_ROWS), round_up(k_blocks, SF_ATOM_COLS)


def blocked_offset(r, c, k_blocks: int):
    """Byte offset of plain scale ``(r, c)`` inside the blocked layout (ints or integer tensors)."""
    atom = (r // SF_ATOM_ROWS) * ceil_div(k_blocks, SF_ATOM_COLS) + c // SF_ATOM_COLS
    return atom * SF_ATOM_BYTES + (r % 32) * 16 + ((r % SF_ATOM_ROWS) // 32) * 4 + c % SF_ATOM_COLS


def blocked_scale_words(blocked: torch.Tensor, rows: int, k_blocks: int) -> torch.Tensor:
    """The blocked scales as the GEMM's scale TMA reads them: int32 words of shape
    ``(row atoms, col atoms * 128)``, row ``ra`` holding the 512-byte atoms of rows ``128 ra ..`` one
    after another (word ``ca * 128 + w`` is bytes ``4w .. 4w + 3`` of atom ``(ra, ca)``). A view, no copy.
    """
    pr, pc = blocked_scale_shape(rows, k_blocks)
    if blocked.element_size() != 1 or blocked.numel() != pr * pc:
        raise ValueError(
            f"expected {pr * pc} one-byte blocked scales for {rows} x {k_blocks}; "
            f"got {blocked.numel()} x {blocked.dtype}"
        )
    flat = as_bytes(blocked).reshape(-1)
    if flat.storage_offset() % 4:
        raise ValueError("blocked scales must start on a 4-byte boundary to be read as words")
    return flat.view(torch.int32).view(pr // SF_ATOM_ROWS, (pc // SF_ATOM_COLS) * (SF_ATOM_BYTES // 4))


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Plain ``(rows, kb)`` scales -> SWIZZLE_32_4_4 blocked tensor of shape ``blocked_scale_shape``.

    Any one-byte dtype (uint8, ``float8_e8m0fnu``, ``float8_e4m3fn``) is kept; padding is zero bytes.
    """
    if scales.dim() != 2:
        raise ValueError(f"to_blocked expects 2-D (rows, K/block) scales, got shape {tuple(scales.shape)}")
    if scales.element_size() != 1:
        raise TypeError(f"scale factors are one-byte types (UE8M0/E4M3/uint8); got {scales.dtype}")
    rows, kb = scales.shape
    pr, pc = blocked_scale_shape(rows, kb)
    b = torch.zeros(pr, pc, dtype=torch.uint8, device=scales.device)
    b[:rows, :kb] = as_bytes(scales)
    # (row_atom, 4 sub-rows of 32, 32, col_atom, 4) -> (row_atom, col_atom, 32, 4 sub-rows, 4 cols)
    b = b.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4).contiguous().view(pr, pc)
    return b if scales.dtype == torch.uint8 else b.view(scales.dtype)


def from_blocked(blocked: torch.Tensor, rows: int, k_blocks: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked`: blocked scales (any shape, padded element count) -> ``(rows, kb)``."""
    pr, pc = blocked_scale_shape(rows, k_blocks)
    if blocked.element_size() != 1:
        raise TypeError(f"scale factors are one-byte types (UE8M0/E4M3/uint8); got {blocked.dtype}")
    if blocked.numel() != pr * pc:
        raise ValueError(
            f"blocked scales for {rows}x{k_blocks} need {pr}*{pc}={pr * pc} elements "
            f"(rows padded to 128, scale columns to 4); got {blocked.numel()}"
        )
    b = as_bytes(blocked.contiguous()).reshape(pr // 128, pc // 4, 32, 4, 4)
    b = b.permute(0, 3, 2, 1, 4).reshape(pr, pc)[:rows, :k_blocks].contiguous()
    return b if blocked.dtype == torch.uint8 else b.view(blocked.dtype)
