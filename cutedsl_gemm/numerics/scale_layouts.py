"""Which scaling recipe a ``scaled_mm`` call uses, and the scale views the Hopper kernels take.

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

Supported operand pairs: TensorWise x TensorWise, RowWise x RowWise, and the block-scaled pairs
1x128 x 128x128 (DeepSeek-V3), 128x128 x 128x128 and 1x128 x 1x128. The kernels read block scales with
run-time strides, so no layout is copied.
"""

from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch

SCALE_K = 128  # K elements per block scale

# Granularity names accepted for scale_recipe_a / scale_recipe_b, and F.ScalingType's member names.
_GRAN_ALIASES = {
    "tensor": "tensor", "tensorwise": "tensor",
    "row": "row", "rowwise": "row",
    "1x128": "1x128", "blockwise1x128": "1x128",
    "128x128": "128x128", "blockwise128x128": "128x128",
}
# (A, B) granularity pair -> kernel recipe name (formats.RECIPES / manifest)
_PAIRS = {
    ("tensor", "tensor"): "tensor",
    ("row", "row"): "row",
    ("1x128", "128x128"): "1x128_128x128",
    ("128x128", "128x128"): "128x128_128x128",
    ("1x128", "1x128"): "1x128_1x128",
}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def granularity_name(g) -> str:
    """'tensor' | 'row' | '1x128' | '128x128' from a string or a torch.nn.functional.ScalingType."""
    name = getattr(g, "name", g)
    if isinstance(name, str) and name.lower() in _GRAN_ALIASES:
        return _GRAN_ALIASES[name.lower()]
    raise ValueError(
        f"unknown scale recipe {g!r}: expected 'tensor', 'row', '1x128', '128x128' or a "
        "torch.nn.functional.ScalingType (TensorWise, RowWise, BlockWise1x128, BlockWise128x128)"
    )


def _expected(gran: str, operand: str, m: int, n: int, kb: int) -> str:
    if gran == "tensor":
        return "one element"
    if gran == "row":
        return f"({m}, 1)" if operand == "a" else f"(1, {n})"
    if gran == "1x128":
        return f"({m}, {kb})" if operand == "a" else f"({kb}, {n})"
    rb = _ceil_div(m if operand == "a" else n, 128)
    return f"({rb}, {kb})" if operand == "a" else f"({kb}, {rb})"


def _matches(gran: str, s: torch.Tensor, operand: str, m: int, n: int, kb: int) -> bool:
    shape = tuple(s.shape)
    if gran == "tensor":
        return s.numel() == 1 and s.dim() <= 2
    if gran == "row":
        return shape == ((m, 1) if operand == "a" else (1, n))
    l4 = _ceil_div(kb, 4) * 4
    if gran == "1x128":
        return shape == ((m, kb) if operand == "a" else (kb, n))
    rb = _ceil_div(m if operand == "a" else n, 128)
    return shape in (((rb, kb), (rb, l4)) if operand == "a" else ((kb, rb), (l4, rb)))


def resolve(
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    m: int,
    n: int,
    k: int,
    scale_recipe_a=None,
    scale_recipe_b=None,
) -> Tuple[str, torch.Tensor, torch.Tensor]:
    """(kernel recipe, scale_a view, scale_b view) for a call, or a ValueError/TypeError saying what was
    expected. Without explicit recipes the scale shapes decide, in torch's order of preference."""
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
        if s.dtype != torch.float32:
            raise TypeError(f"{name} must be torch.float32, got {s.dtype}")
    kb = _ceil_div(k, SCALE_K)
    if (scale_recipe_a is None) != (scale_recipe_b is None):
        raise ValueError("give both scale_recipe_a and scale_recipe_b, or neither (then the scale shapes decide)")
    if scale_recipe_a is not None:
        pair = (granularity_name(scale_recipe_a), granularity_name(scale_recipe_b))
        if pair not in _PAIRS:
            raise ValueError(
                f"scale recipes {pair[0]} x {pair[1]} are not supported; supported (A x B): "
                + ", ".join(f"{a} x {b}" for a, b in _PAIRS)
            )
        for gran, s, op in ((pair[0], scale_a, "a"), (pair[1], scale_b, "b")):
            if not _matches(gran, s, op, m, n, kb):
                raise ValueError(
                    f"scale_{op} for {gran} scaling must have shape {_expected(gran, op, m, n, kb)} "
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
                    f"{a} x {b}: {_expected(a, 'a', m, n, kb)} x {_expected(b, 'b', m, n, kb)}" for a, b in _PAIRS
                )
            )
    recipe = _PAIRS[pair]
    if recipe == "row":
        if m > 1 and scale_a.stride(0) != 1:
            raise ValueError(f"scale_a (M, 1) must be contiguous, got strides {tuple(scale_a.stride())}")
        if n > 1 and scale_b.stride(1) != 1:
            raise ValueError(f"scale_b (1, N) must be contiguous, got strides {tuple(scale_b.stride())}")
    return (recipe,) + kernel_views(recipe, kb, scale_a, scale_b)


# Per-tensor scales: the kernel takes a (1,) tensor, torch's convention is a 0-dim one. Making the view costs
# ~1.5-2.5 us per scale per call on the H100 host (most of the per-tensor recipe's extra host cost), so views
# are kept per scale tensor: keyed by id, checked by a weak reference to the very tensor and by its data
# pointer (a set_() on it makes a new view), and only for scales with a storage of their own size (a view
# kept here holds its storage alive, so never one into a large buffer). Bounded; cleared when full.
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
# ...): a slice and a transpose, ~3 us per call on the H100 host (session 16: the DeepSeek recipe cost 15.1 us
# per call against 9.0 per-tensor). W scales belong to a weight and live as long as it, so their view is kept
# as the per-tensor ones are (weak reference, data pointer, and strides, since an in-place restride keeps the
# pointer), for storages up to 1 MiB (a (Kb, N/128) fp32 scale tensor of a 57344 x 8192 weight is 115 KiB).
# Activation scales are new each call: their view is not kept, and not made when nothing is dropped.
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
    if recipe == "tensor":
        return _one(scale_a), _one(scale_b)
    if recipe == "row":
        return scale_a, scale_b
    return (scale_a if scale_a.shape[1] == kb else scale_a[:, :kb]), _w_blocks(scale_b, kb)
