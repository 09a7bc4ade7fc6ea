"""Element formats, scale granularities and scaling recipes, as data.

The host tables: validation, dispatch, the quantizers, the reference numerics and the tests read these;
nothing else in ``cutedsl_gemm`` writes down a format's bit layout, a torch dtype's short or cutlass name,
a recipe's scale granularity or a granularity's names. (``kernels/`` cannot import host modules and keeps
its own device-side copies; tests/test_formats.py checks that they agree.)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


# eq=False: each format is one module-level object, compared by identity (a value comparison of eleven fields
# would cost every dtype check on the per-call path a few hundred nanoseconds).
@dataclass(frozen=True, eq=False)
class ElementFormat:
    """An element type: the OCP minifloats, the UE8M0 scale, bf16 / fp16 / fp32, and the signed integers.

    ``name`` is the short name ("e4m3", "bf16"), ``cutlass_name`` the ``cutlass`` numeric type's name.
    ``max_finite`` is the largest finite magnitude; ``bias`` the exponent bias. ``has_inf``/``has_nan``
    follow the OCP definitions (E4M3 "fn" has NaN but no inf, E2M1/E2M3/E3M2 have neither).
    ``bits`` is also the width in global memory (FP4/FP6 are packed).
    An ``integer`` format is two's complement with no exponent (``exp_bits`` 0, ``man_bits`` = bits - 1);
    its ``max_finite`` is the largest value 2**(bits-1) - 1 (127 for int8, 7 for int4), the limit of symmetric
    quantization, and ``max_code`` that value's bit pattern.
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
    torch_dtype: torch.dtype | None = None
    cutlass_name: str = ""
    integer: bool = False

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.man_bits) if self.man_bits else self.min_normal

    @property
    def elements_per_byte(self) -> float:
        return 8 / self.bits

    @property
    def emax(self) -> int:
        """Exponent of the largest normal value (OCP MX ``emax_elem``: E4M3 8, E5M2 15, E3M2 4, E2M3 2, E2M1 2)."""
        return math.floor(math.log2(self.max_finite))

    @property
    def max_code(self) -> int:
        """Bit pattern of the largest finite positive value."""
        mag_bits = self.bits - (1 if self.signed else 0)
        if self.has_inf:  # exponent all ones is inf / NaN
            return ((1 << self.exp_bits) - 2) << self.man_bits | ((1 << self.man_bits) - 1)
        if self.has_nan:  # e4m3fn, ue8m0: the all-ones pattern is NaN
            return (1 << mag_bits) - 2
        return (1 << mag_bits) - 1

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
# torch's dtype for E2M1 is the packed pair float4_e2m1fn_x2 (two elements per byte).
E2M1 = ElementFormat("e2m1", 4, 2, 1, 1, 6.0, False, False, True, _maybe("float4_e2m1fn_x2"), "Float4E2M1FN")
# Unsigned power-of-two scale of the OCP MX formats: value = 2**(code - 127), code 255 = NaN.
UE8M0 = ElementFormat("ue8m0", 8, 8, 0, 127, 2.0**127, False, True, False, _maybe("float8_e8m0fnu"), "Float8E8M0FNU")

# Signed integers (W8A8, weight-only): the two's complement range is [-2**(bits-1), max_finite]; the symmetric
# quantizers (quantize_int8) use [-max_finite, max_finite]. INT4 is packed two per byte (numerics.int_packing
# owns the layout); torch has no packed-pair int4 dtype, so it has no torch_dtype.
INT8 = ElementFormat("int8", 8, 0, 7, 0, 127.0, False, False, True, torch.int8, "Int8", integer=True)
INT4 = ElementFormat("int4", 4, 0, 3, 0, 7.0, False, False, True, None, "Int4", integer=True)

BF16 = ElementFormat("bf16", 16, 8, 7, 127, torch.finfo(torch.bfloat16).max, True, True, True, torch.bfloat16,
                     "BFloat16")
FP16 = ElementFormat("fp16", 16, 5, 10, 15, torch.finfo(torch.float16).max, True, True, True, torch.float16, "Float16")
FP32 = ElementFormat("fp32", 32, 8, 23, 127, torch.finfo(torch.float32).max, True, True, True, torch.float32, "Float32")

#: low-precision element types (GEMM operands, block scales), by short name
ELEMENT_FORMATS = {f.name: f for f in (E4M3, E5M2, E3M2, E2M3, E2M1, UE8M0, INT8, INT4)}
FP8_FORMATS = (E4M3, E5M2)
F8F6F4_FORMATS = (E4M3, E5M2, E3M2, E2M3, E2M1)
#: the wide float types: quantizer inputs, GEMM outputs and biases
FLOAT_FORMATS = (BF16, FP16, FP32)
#: torch dtype -> format, for every format torch has a dtype for
DTYPE_FORMATS = {f.torch_dtype: f for f in (*ELEMENT_FORMATS.values(), *FLOAT_FORMATS) if f.torch_dtype is not None}


def element_format(x) -> ElementFormat:
    """A low-precision element format by name, torch dtype or ElementFormat."""
    if isinstance(x, ElementFormat):
        return x
    if isinstance(x, str):
        try:
            return ELEMENT_FORMATS[x.lower()]
        except KeyError:
            raise ValueError(f"unknown element format {x!r}; expected one of {sorted(ELEMENT_FORMATS)}") from None
    if isinstance(x, torch.dtype):
        f = DTYPE_FORMATS.get(x)
        if f is None or f.name not in ELEMENT_FORMATS:
            raise TypeError(f"torch dtype {x} is not a supported low-precision element type")
        return f
    raise TypeError(f"cannot interpret {x!r} as an element format")


def activation_format(weight) -> ElementFormat:
    """What activations are quantized to for a GEMM with weights of ``weight`` (a format, its name or torch dtype):
    int8 for int8 weights (the s8 x s8 MMA), e4m3 otherwise (the GEMM's own checks refuse weights it cannot take)."""
    return INT8 if weight in (INT8, INT8.name, INT8.torch_dtype) else E4M3


def float_format(x) -> ElementFormat:
    """bf16 / fp16 / fp32 by torch dtype, short name or ElementFormat."""
    if isinstance(x, torch.dtype):
        f = DTYPE_FORMATS.get(x)
    elif isinstance(x, str):
        f = next((g for g in FLOAT_FORMATS if g.name == x.lower()), None)
    else:
        f = x
    if f not in FLOAT_FORMATS:
        raise TypeError(f"expected torch.bfloat16, torch.float16 or torch.float32 (bf16, fp16, fp32), got {x}")
    return f


class ScaleGranularity(enum.Enum):
    """How many elements of an operand share one scale: (rows, cols) of the (rows, K) operand.

    ``None`` in a slot means "the whole extent" (per-tensor uses (None, None); per-row (1, None)).
    Each granularity has a short name (``label``), the name of its ``torch.nn.functional.ScalingType``
    member, and any other names the entry points accept; :meth:`named` looks any of them up.
    """

    TENSOR = (None, None), "tensor", "TensorWise", ("per_tensor",)
    ROW = (1, None), "row", "RowWise", ("per_row",)
    GROUP_1x128 = (1, 128), "1x128", "BlockWise1x128", ("group",)
    BLOCK_128x128 = (128, 128), "128x128", "BlockWise128x128", ("block",)
    MX_1x32 = (1, 32), "1x32", "BlockWise1x32", ()
    NV_1x16 = (1, 16), "1x16", "BlockWise1x16", ()

    def __new__(cls, extent, label, scaling_type, aliases):
        obj = object.__new__(cls)
        obj._value_ = extent
        obj.label = label
        obj.scaling_type = scaling_type
        obj.aliases = aliases
        return obj

    @property
    def rows(self) -> int | None:
        return self.value[0]

    @property
    def cols(self) -> int | None:
        return self.value[1]

    @property
    def names(self) -> tuple:
        return (self.label, self.scaling_type, *self.aliases)

    @classmethod
    def named(cls, x) -> ScaleGranularity:
        """A granularity from itself, any of its names (case-insensitive) or a ``F.ScalingType`` member."""
        if isinstance(x, cls):
            return x
        name = getattr(x, "name", x)
        if isinstance(name, str):
            for g in cls:
                if name.lower() in (n.lower() for n in g.names):
                    return g
        raise ValueError(
            f"unknown scale granularity {x!r}; expected one of {', '.join(repr(g.label) for g in cls)} or a "
            f"torch.nn.functional.ScalingType ({', '.join(g.scaling_type for g in cls)})"
        )


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
    def k_block(self) -> int | None:
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

# In torch's order of preference: scale_layouts.resolve tries the fp32 recipes in this order when the scale
# shapes alone must decide (for M = 1 a 128x128 grid of A is also a valid 1x128 grid).
RECIPES = {
    r.name: r
    for r in (
        TENSORWISE, ROWWISE, DEEPSEEK_1x128_128x128, BLOCK_128x128_128x128, GROUP_1x128_1x128, MX_1x32, NVFP4_1x16
    )
}
#: granularity -> the recipe that scales both operands with it
_SHARED = {r.a: r for r in RECIPES.values() if r.a is r.b}
#: the granularities of the fp32-scaled (FP8) recipes, in ScaleGranularity order
FP32_SCALE_GRANULARITIES = tuple(
    g for g in ScaleGranularity if any(g in (r.a, r.b) for r in RECIPES.values() if r.scale_format == "fp32")
)


def recipe(x) -> ScalingRecipe:
    """A recipe from a ScalingRecipe, a recipe name, or one granularity that both operands use.

    The rule: a granularity (any name :meth:`ScaleGranularity.named` takes) names the recipe with that
    granularity on A and on W, so "tensor" and "row" are the per-tensor and per-row recipes, "1x128" is
    "1x128_1x128", "128x128" is "128x128_128x128", "1x32" is "mx", "BlockWise1x16" is "nvfp4".
    """
    if isinstance(x, ScalingRecipe):
        return x
    if isinstance(x, str) and x in RECIPES:
        return RECIPES[x]
    try:
        return _SHARED[ScaleGranularity.named(x)]
    except (ValueError, KeyError):
        raise ValueError(
            f"unknown scaling recipe {x!r}; expected a recipe name ({', '.join(RECIPES)}) or a granularity both "
            f"operands use ({', '.join(g.label for g in ScaleGranularity if g in _SHARED)})"
        ) from None


def scale_shape(gran: ScaleGranularity, rows: int, k: int) -> tuple:
    """Logical scale tensor shape for an operand of shape (rows, K) with plain (unswizzled) layout."""
    if gran is ScaleGranularity.TENSOR:
        return ()
    r = 1 if gran.rows is None else ceil_div(rows, gran.rows)
    c = 1 if gran.cols is None else ceil_div(k, gran.cols)
    return (r, c)
