"""Element formats and scaling recipes, as data.

Validation, dispatch, the reference numerics and the tests all read these tables; nothing else in the
project hard-codes a format's bit layout or a recipe's scale granularity.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ElementFormat:
    """A (mini)float element type.

    ``max_finite`` is the largest finite magnitude; ``bias`` the exponent bias. ``has_inf``/``has_nan``
    follow the OCP definitions (E4M3 "fn" has NaN but no inf, E2M1/E2M3/E3M2 have neither).
    ``storage_bits`` is the width in global memory (packed for FP4/FP6).
    """

    name: str
    bits: int
    exp_bits: int
    man_bits: int
    bias: int
    max_finite: float
    has_inf: bool
    has_nan: bool
    signed: bool = True
    torch_dtype: Optional[torch.dtype] = None
    cutlass_name: str = ""

    @property
    def storage_bits(self) -> int:
        return self.bits

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.man_bits) if self.man_bits else self.min_normal

    @property
    def elements_per_byte(self) -> float:
        return 8 / self.bits

    def cutlass_dtype(self):
        """The matching ``cutlass`` numeric type (imported lazily: formats are usable without the DSL)."""
        import cutlass

        return getattr(cutlass, self.cutlass_name)


def _maybe(name: str):
    return getattr(torch, name, None)


E4M3 = ElementFormat("e4m3", 8, 4, 3, 7, 448.0, False, True, True, _maybe("float8_e4m3fn"), "Float8E4M3FN")
E5M2 = ElementFormat("e5m2", 8, 5, 2, 15, 57344.0, True, True, True, _maybe("float8_e5m2"), "Float8E5M2")
E3M2 = ElementFormat("e3m2", 6, 3, 2, 3, 28.0, False, False, True, None, "Float6E3M2FN")
E2M3 = ElementFormat("e2m3", 6, 2, 3, 1, 7.5, False, False, True, None, "Float6E2M3FN")
E2M1 = ElementFormat("e2m1", 4, 2, 1, 1, 6.0, False, False, True, _maybe("float4_e2m1fn_x2"), "Float4E2M1FN")
# Unsigned power-of-two scale of the OCP MX formats: value = 2**(code - 127), code 255 = NaN.
UE8M0 = ElementFormat("ue8m0", 8, 8, 0, 127, 2.0**127, False, True, False, _maybe("float8_e8m0fnu"), "Float8E8M0FNU")

ELEMENT_FORMATS = {f.name: f for f in (E4M3, E5M2, E3M2, E2M3, E2M1, UE8M0)}
FP8_FORMATS = (E4M3, E5M2)
F8F6F4_FORMATS = (E4M3, E5M2, E3M2, E2M3, E2M1)


def element_format(x) -> ElementFormat:
    """Look a format up by name, torch dtype or ElementFormat."""
    if isinstance(x, ElementFormat):
        return x
    if isinstance(x, str):
        try:
            return ELEMENT_FORMATS[x.lower()]
        except KeyError:
            raise ValueError(f"unknown element format {x!r}; expected one of {sorted(ELEMENT_FORMATS)}") from None
    if isinstance(x, torch.dtype):
        for f in ELEMENT_FORMATS.values():
            if f.torch_dtype is not None and f.torch_dtype == x:
                return f
        raise TypeError(f"torch dtype {x} is not a supported low-precision element type")
    raise TypeError(f"cannot interpret {x!r} as an element format")


class ScaleGranularity(enum.Enum):
    """How many elements of an operand share one scale: (rows, cols) of the (rows, K) operand.

    ``None`` in a slot means "the whole extent" (per-tensor uses (None, None); per-row (1, None)).
    """

    TENSOR = (None, None)
    ROW = (1, None)
    GROUP_1x128 = (1, 128)
    BLOCK_128x128 = (128, 128)
    MX_1x32 = (1, 32)
    NV_1x16 = (1, 16)

    @property
    def rows(self) -> Optional[int]:
        return self.value[0]

    @property
    def cols(self) -> Optional[int]:
        return self.value[1]


@dataclass(frozen=True)
class ScalingRecipe:
    """A pair of operand scale granularities plus the scale element type.

    ``a`` applies to A (M, K); ``b`` to B seen as W (N, K). ``scale_format`` is the stored scale type
    (fp32 for the Hopper recipes, UE8M0 for MX, E4M3 for NVFP4 with an extra fp32 per-tensor scale).
    ``in_mainloop`` says the scales vary along K and must be applied inside the K loop.
    """

    name: str
    a: ScaleGranularity
    b: ScaleGranularity
    scale_format: str = "fp32"
    global_scale: bool = False

    @property
    def in_mainloop(self) -> bool:
        return self.a.cols is not None or self.b.cols is not None

    @property
    def k_block(self) -> Optional[int]:
        ks = {g.cols for g in (self.a, self.b) if g.cols is not None}
        if len(ks) > 1:
            raise ValueError(f"recipe {self.name}: operands disagree on the K block ({ks})")
        return ks.pop() if ks else None


G = ScaleGranularity
TENSORWISE = ScalingRecipe("tensor", G.TENSOR, G.TENSOR)
ROWWISE = ScalingRecipe("row", G.ROW, G.ROW)
DEEPSEEK_1x128_128x128 = ScalingRecipe("1x128_128x128", G.GROUP_1x128, G.BLOCK_128x128)
BLOCK_128x128_128x128 = ScalingRecipe("128x128_128x128", G.BLOCK_128x128, G.BLOCK_128x128)
GROUP_1x128_1x128 = ScalingRecipe("1x128_1x128", G.GROUP_1x128, G.GROUP_1x128)
MX_1x32 = ScalingRecipe("mx", G.MX_1x32, G.MX_1x32, scale_format="ue8m0")
NVFP4_1x16 = ScalingRecipe("nvfp4", G.NV_1x16, G.NV_1x16, scale_format="e4m3", global_scale=True)

RECIPES = {
    r.name: r
    for r in (TENSORWISE, ROWWISE, DEEPSEEK_1x128_128x128, BLOCK_128x128_128x128, GROUP_1x128_1x128, MX_1x32, NVFP4_1x16)
}


def recipe(x) -> ScalingRecipe:
    if isinstance(x, ScalingRecipe):
        return x
    try:
        return RECIPES[str(x)]
    except KeyError:
        raise ValueError(f"unknown scaling recipe {x!r}; expected one of {sorted(RECIPES)}") from None


OUT_DTYPES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}


def scale_shape(gran: ScaleGranularity, rows: int, k: int) -> tuple:
    """Logical scale tensor shape for an operand of shape (rows, K) with plain (unswizzled) layout."""
    r = 1 if gran.rows is None else -(-rows // gran.rows)
    c = 1 if gran.cols is None else -(-k // gran.cols)
    if gran is ScaleGranularity.TENSOR:
        return ()
    return (r, c)
