"""The linear-layer recipes, one row each: how a layer's weight (once) and its activations (every call) are
quantized and which kernel multiplies them: ``scaled_mm`` with a scale recipe (FP8, MX, NVFP4, INT8 W8A8), or
``mm_weight_only`` (bf16 / fp16 activations x packed int8 / int4 weights). ``linear`` is the layer's function and
``torch.ops.cutedsl_gemm.fp8_linear`` its operator, for every recipe (one node per layer in a traced graph).

Weight-only recipes: "int8_weight" (int8, per output channel) and the int4 ones, named
``int4_weight[_g<group>][_zp]`` (``int4_recipe_name``): scales in groups of 128 along K unless ``_g32`` / ``_g64``
says otherwise, symmetric unless ``_zp`` (integer zero points, as AWQ / HQQ-style checkpoints carry them):
"int4_weight", "int4_weight_g64", "int4_weight_g32", "int4_weight_zp", "int4_weight_g64_zp", "int4_weight_g32_zp".

The scale granularities and formats are the numerics layer's (``numerics.formats.RECIPES``, ``ScaleGranularity``;
``numerics.int_packing`` for the weight-only layouts); which GPU runs which recipe is the instance tables'
(``selection.instances``). Adding a recipe is one row (and, for a new kind of quantizer, one function of the
``*_operand`` shape below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.numerics.codecs import as_bytes, cast_saturate
from cutedsl_gemm.numerics.formats import RECIPES, ScalingRecipe, ceil_div, element_format
from cutedsl_gemm.ops import library
from cutedsl_gemm.ops import quantize as Q
from cutedsl_gemm.ops import scaled_mm as S
from cutedsl_gemm.ops import weight_only as W
from cutedsl_gemm.ops.library import EAGER, OPS
from cutedsl_gemm.selection.instances import WEIGHT_ONLY, table, weight_only_recipe


def _weight_scales(s, operand):
    """W's scales (operand "b") in the layout ``scaled_mm`` takes as ``scale_b``: those of W (N, K) transposed
    like W (B = W.t()), in a contiguous copy; A's as they are."""
    return s.t().clone(memory_format=torch.contiguous_format) if operand == "b" else s


def fp8_operand(t, operand, recipe, ops):
    """``quantize_fp8`` with the recipe's granularity for ``operand``."""
    q, s = ops.quantize_fp8(t, getattr(recipe.scaling, operand).label, fmt=recipe.element)
    return q, _weight_scales(s, operand), None


def int8_operand(t, operand, recipe, ops):
    """``quantize_int8`` with the recipe's granularity for ``operand`` (row: per token / per output channel)."""
    q, s = ops.quantize_int8(t, getattr(recipe.scaling, operand).label)
    return q, _weight_scales(s, operand), None


def mx_operand(t, operand, recipe, ops):
    """``quantize_mx``: the data and its SWIZZLE_32_4_4 UE8M0 scales, the same for both operands."""
    q, s = ops.quantize_mx(t, recipe.element)
    return q, s, None


#: The recipes a layer may run with a static (calibrated, stored) per-tensor activation scale.
STATIC_INPUT_RECIPES = ("tensor",)


def quantize_fp8_static(x: torch.Tensor, input_scale: torch.Tensor, fmt="e4m3") -> torch.Tensor:
    """x (rows, K) in FP8 with a given per-tensor scale (a decode factor, fp32, one element): ``q = RNE(clamp(x /
    input_scale, -fmax, fmax))`` in fp32, the arithmetic of ``quantize_fp8(x, "tensor")`` with the scale fixed
    (+-inf saturate, NaN stays NaN). Computed by torch element-wise ops: the FP8 quantizer kernels compute their
    scale from the input's amax and take none."""
    return cast_saturate(torch.div(x.to(torch.float32), input_scale.reshape(())), fmt)


def check_input_scale(input_scale, recipe) -> None:
    """A static activation scale: a one-element fp32 tensor, for a recipe of ``STATIC_INPUT_RECIPES``."""
    if recipe.name not in STATIC_INPUT_RECIPES:
        raise ValueError(f"a static input_scale works with recipe {' or '.join(map(repr, STATIC_INPUT_RECIPES))} "
                         f"(per-tensor FP8 activations), not {recipe.name!r}, whose activation scales are computed "
                         "on every call")
    if not isinstance(input_scale, torch.Tensor) or input_scale.dtype != torch.float32 or input_scale.numel() != 1:
        raise TypeError("input_scale must be a one-element float32 tensor (the activations' per-tensor decode "
                        f"scale), got {getattr(input_scale, 'dtype', type(input_scale).__name__)}")


def nvfp4_operand(t, operand, recipe, ops):
    """``quantize_nvfp4`` with the global scale computed on the device (per call for activations)."""
    return ops.quantize_nvfp4(t)


def _has_data(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return t.device.type != "meta" and not isinstance(t, FakeTensor)


def packed_operand(w, operand, recipe, ops):
    """The weight (N, K) of a weight-only recipe, quantized (``int_packing.quantize_weights``, round to nearest,
    symmetric or with zero points as ``recipe.zeros`` says) and packed (``pack_weights``) in the kernel's layouts:
    (int32 packed words, scales, zero points or None). Group-wise scales and zero points are stored in the
    activations' dtype, w's (bf16 for an fp32 w). A meta or fake w gets empty tensors of those shapes (the kernel's
    checks run on them)."""
    if operand != "b":
        raise ValueError(f"recipe {recipe.name!r} leaves the activations unquantized")
    act = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if _has_data(w):
        w_int, scales, zeros = IP.quantize_weights(w, recipe.bits, recipe.group, symmetric=not recipe.zeros)
        return IP.pack_weights(w_int, scales, zeros, recipe.group, bits=recipe.bits, dtype=act)
    n, k = w.shape
    packed = w.new_empty((ceil_div(n, IP.ATOM_ROWS), ceil_div(k, IP.ATOM_K), IP.words_per_atom(recipe.bits)),
                         dtype=torch.int32)
    if recipe.group == IP.PER_CHANNEL:
        return packed, w.new_empty((1, n), dtype=torch.float32), None
    group_wise = (k // recipe.group, n)
    return packed, w.new_empty(group_wise, dtype=act), w.new_empty(group_wise, dtype=act) if recipe.zeros else None


#: The layer's quantized weight, as ``LinearRecipe.quantize_weight`` returns it and ``QuantizedLinear`` stores it (the
#: buffers whose dtypes the recipe fixes).
QUANTIZED = ("weight", "weight_scale", "weight_global_scale", "weight_zero")


INT4_DEFAULT_GROUP = 128  # the group an int4 recipe's name leaves out


def int4_recipe_name(group: int, zeros: bool) -> str:
    """The int4 weight-only recipe of scale ``group`` along K, with integer zero points or symmetric:
    ``int4_weight[_g<group>][_zp]`` ("int4_weight" is group 128, symmetric)."""
    return "int4_weight" + ("" if group == INT4_DEFAULT_GROUP else f"_g{group}") + ("_zp" if zeros else "")


@dataclass(frozen=True)
class LinearRecipe:
    """One way to run a linear layer. ``scaling``: the ``numerics.formats.RECIPES`` entry (A = activations, W =
    weights) that ``scaled_mm`` runs, or None for a weight-only recipe (``mm_weight_only``: activations as they
    are, ``group`` the weights' scale group along K, 0 per output channel, ``zeros`` whether the weights carry
    integer zero points); ``quantize(t, operand, recipe, ops)``: quantizes ``t`` (rows, K) as operand "a" or "b"
    -> (data, scales as the kernel takes them, a third tensor or None: NVFP4's global scale, a weight-only
    recipe's zero points), through ``ops`` (``library.EAGER`` or ``library.OPS``); ``element``: the element
    format."""

    name: str
    scaling: Optional[ScalingRecipe]
    quantize: Callable
    element: str = "e4m3"
    group: int = 0
    zeros: bool = False

    def __post_init__(self):
        if self.weight_only:
            IP.check_format(self.bits, self.group, self.zeros)
        elif self.zeros or self.group:
            raise ValueError(f"recipe {self.name!r}: group and zeros belong to weight-only recipes (scaling=None); "
                             "the scales of scaled_mm recipes are their scaling's")

    @property
    def weight_only(self) -> bool:
        return self.scaling is None

    @property
    def bits(self) -> int:
        return element_format(self.element).bits

    @property
    def archs(self) -> tuple:
        """The GPU archs that run it (the instance table's)."""
        if self.weight_only:
            want = weight_only_recipe(self.group, self.zeros)
            rows = [i.arch for i in table() if i.op == WEIGHT_ONLY and i.b_dtype == self.element
                    and i.recipe == want]
        elif self.element == "int8":
            rows = [i.arch for i in table() if i.a_dtype == "int8" and i.recipe == self.scaling.name]
        else:
            rows = [a for a in P.ARCHS if self.scaling.name in P.ARCH_RECIPES[a]]
        return tuple(a for a in P.ARCHS if a in rows)

    @property
    def keeps_launch(self) -> bool:
        """Whether ``kept_launch`` runs it: the weight-only and the fp32-scaled Hopper recipes."""
        return self.weight_only or self.quantize is fp8_operand or self.quantize is int8_operand

    def quantize_weight(self, w: torch.Tensor, ops) -> tuple:
        """The weight W (N, K) quantized once, as the layer's buffers ``QUANTIZED``: (weight, weight_scale,
        weight_global_scale, weight_zero), None for those the recipe has none of."""
        data, scales, third = self.quantize(w, "b", self, ops)
        return (data, scales, None, third) if self.weight_only else (data, scales, third, None)

    def dequantize_weight(self, weight, weight_scale, weight_global_scale, weight_zero, k: int) -> torch.Tensor:
        """W (N, K) in fp32 from the buffers of ``quantize_weight`` (K: the layer's in_features): the codes times
        their scales, by the references of :mod:`cutedsl_gemm.numerics.reference` (per tensor, per channel or per
        128x128 block; MX / NVFP4 block scales, NVFP4's global scale; ``int_packing.unpack_weights`` and
        ``(q - z) * s`` for the weight-only recipes). They compute in float64, where every such product is exact
        (at most 30 significant bits), so the one rounding to fp32 is the fp32 product's."""
        if self.weight_only:
            unpacked = IP.unpack_weights(weight, weight_scale, weight_zero, k=k, group=self.group, bits=self.bits)
            return R.dequantize_weights(*unpacked, self.group).float()
        if self.scaling.scale_format == "fp32":  # FP8 and int8: the plain (R, C) group scales, transposed here
            gran = self.scaling.b
            plain = weight_scale.reshape(1, 1) if weight_scale.dim() == 0 else weight_scale.t()
            return R.dequantize(weight, plain, gran).float()
        data = as_bytes(weight)
        blocks = R.BlockScaledTensor(data, weight_scale, element_format(self.element), self.scaling.k_block,
                                     (data.shape[0], k), weight_global_scale)
        return blocks.dequantize().float()

    def kernel_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The stored weight as the kernel takes it: ``scaled_mm``'s B = W.t(), or the packed weight itself."""
        return weight if self.weight_only else weight.t()

    def describe(self) -> str:
        if self.weight_only:
            scales = "per-channel scales" if self.group == IP.PER_CHANNEL else f"group-{self.group} scales"
            scales += " and zero points" if self.zeros else ""
            return f"{self.name!r} ({self.element} weights, {scales}; bf16 / fp16 activations)"
        a, b = self.scaling.a, self.scaling.b
        return f"{self.name!r} ({self.element}, activations {a.label} x weights {b.label} scales)"


LINEAR_RECIPES = {
    r.name: r
    for r in (
        LinearRecipe("row", RECIPES["row"], fp8_operand),  # per token x per output channel
        LinearRecipe("deepseek", RECIPES["1x128_128x128"], fp8_operand),  # DeepSeek-V3: 1x128 x 128x128 blocks
        LinearRecipe("tensor", RECIPES["tensor"], fp8_operand),  # the activation scale computed every call
        LinearRecipe("mxfp8", RECIPES["mx"], mx_operand),
        LinearRecipe("nvfp4", RECIPES["nvfp4"], nvfp4_operand, "e2m1"),
        LinearRecipe("int8", RECIPES["row"], int8_operand, "int8"),  # W8A8: per token x per output channel
        LinearRecipe("int8_weight", None, packed_operand, "int8", IP.PER_CHANNEL),
        *(LinearRecipe(int4_recipe_name(group, zeros), None, packed_operand, "int4", group, zeros)
          for zeros in (False, True) for group in sorted(IP.GROUPS, reverse=True)),
    )
}


def linear_recipe(name) -> LinearRecipe:
    """A recipe by name (or the LinearRecipe itself)."""
    if isinstance(name, LinearRecipe):
        return name
    r = LINEAR_RECIPES.get(name) if isinstance(name, str) else None
    if r is None:
        raise ValueError(f"unknown linear recipe {name!r}; expected one of {', '.join(map(repr, LINEAR_RECIPES))}")
    return r


def linear(x, weight, weight_scale, weight_global_scale, bias, recipe: str, weight_zero=None, input_scale=None, *,
           ops=EAGER):
    """``x @ W.T + bias`` for the quantized weight W of ``recipe`` (its name): the op's function."""
    r = LINEAR_RECIPES.get(recipe) or linear_recipe(recipe)
    return quantized_matmul(x, r.kernel_weight(weight), weight_scale, weight_global_scale, weight_zero, bias, r, ops,
                            input_scale=input_scale)


def quantized_matmul(x, b, weight_scale, weight_global_scale, weight_zero, bias, recipe: LinearRecipe, ops=EAGER, *,
                     input_scale=None):
    """``x @ W.T + bias`` for ``b`` = ``recipe.kernel_weight(W)``, W the quantized weight of ``recipe`` (its
    ``quantize_weight`` buffers): x (..., K) quantized by the recipe (with ``input_scale``, a static per-tensor
    scale: ``quantize_fp8_static``), then ``scaled_mm`` (out in x's dtype), or ``mm_weight_only`` -> (..., N).
    ``ops``: EAGER launches, OPS records (traced, fake tensors)."""
    if input_scale is not None:
        check_input_scale(input_scale, recipe)
    if (weight_zero is not None) != recipe.zeros:  # the kernel would read the codes as the other format
        raise ValueError(f"recipe {recipe.name!r} " + ("takes zero points: weight_zero must be given" if recipe.zeros
                                                       else "has no zero points: weight_zero must be None"))
    if x.is_contiguous():
        x2 = x if x.dim() == 2 else x.view(-1, x.shape[-1])
    else:  # the kernels read packed rows
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if recipe.scaling is None:
        y = ops.mm_weight_only(x2, b, weight_scale, weight_zero, group=recipe.group, bits=recipe.bits)
        if bias is not None:
            y = y.add_(bias)
    else:
        if input_scale is None:
            qa, sa, ga = recipe.quantize(x2, "a", recipe, ops)
        else:
            qa, sa, ga = quantize_fp8_static(x2, input_scale, recipe.element), input_scale.reshape(()), None
        y = ops.scaled_mm(qa, b, sa, weight_scale, bias, x.dtype, scale_recipe_a=recipe.scaling.a.scaling_type,
                          scale_recipe_b=recipe.scaling.b.scaling_type, global_scale_a=ga,
                          global_scale_b=weight_global_scale)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[1])


def kept_launch(x, b, weight_scale, weight_zero, bias, recipe: LinearRecipe):
    """``quantized_matmul`` on a contiguous CUDA x, and the function that repeats it for inputs of x's shape, dtype
    and device with no checks beyond the compiled kernels' own: ``(y, run)``, ``run(x) -> y`` holding the kept
    quantizer launch and GEMM plan (None where ``scaled_mm`` keeps no plan: sm_100a). ``recipe.keeps_launch``
    must hold. A call ``run`` refuses (the kernels' TypeError / ValueError, before any launch) belongs to
    ``quantized_matmul``, which says why."""
    k, flat, dtype = x.shape[-1], x.dim() == 2, x.dtype
    x2 = x if flat else x.view(-1, k)
    rows, lead = x2.shape[0], tuple(x.shape[:-1])  # (views from plain ints: the cheapest per call)
    if recipe.weight_only:
        opts = dict(group=recipe.group, bits=recipe.bits)
        y = W.mm_weight_only(x2, b, weight_scale, weight_zero, **opts)
        if bias is not None:
            y.add_(bias)
        hit = W.cached_plan(x2, b, weight_scale, weight_zero, **opts)
        if hit is None:
            return (y if flat else y.view(*lead, y.shape[1])), None
        launch, out_shape = hit[0].run, hit[1]
        n = out_shape[1]

        def run(x):
            y = launch(x if flat else x.view(rows, k), b, weight_scale, weight_zero, x.new_empty(out_shape))
            if bias is not None:
                y.add_(bias)
            return y if flat else y.view(*lead, n)
    else:
        if not recipe.keeps_launch:
            raise ValueError(f"recipe {recipe.name!r} has no kept launch (its GEMMs run on sm_100a)")
        ra, rb = recipe.scaling.a.scaling_type, recipe.scaling.b.scaling_type
        quantize = Q.kernel_launch(x2, recipe.scaling.a.label, fmt=recipe.element)
        qa, sa = quantize(x2)
        y = S.scaled_mm(qa, b, sa, weight_scale, bias, None, dtype, scale_recipe_a=ra, scale_recipe_b=rb)
        hit = S.cached_plan(S.call_signature(qa, b, sa, weight_scale, bias, dtype, False, ra, rb, None, None))
        if hit is None:
            return (y if flat else y.view(*lead, y.shape[1])), None
        launch, name, kb, out_shape = hit
        launch, views, n = launch.run, scale_layouts.kernel_views, out_shape[1]

        def run(x):
            qa, sa = quantize(x if flat else x.view(rows, k))
            va, vb = views(name, kb, sa, weight_scale)
            y = launch(qa, b, x.new_empty(out_shape, dtype=dtype), va, vb, bias)
            return y if flat else y.view(*lead, n)
    return (y if flat else y.view(*lead, y.shape[1])), run


FP8_LINEAR_SCHEMA = (
    "(Tensor x, Tensor weight, Tensor weight_scale, Tensor? weight_global_scale, Tensor? bias, str recipe, "
    "Tensor? weight_zero=None, Tensor? input_scale=None) -> Tensor"
)


def _fp8_linear_cpu(x, weight, weight_scale, weight_global_scale, bias, recipe, weight_zero=None, input_scale=None):
    raise ValueError("QuantizedLinear runs on CUDA tensors (the "
                     f"{' and '.join(map(P.GPU_NAMES.get, P.ARCHS))} kernels); "
                     f"got an input on {x.device}: move the model to the GPU (model.cuda())")


def _fp8_linear_fake(x, weight, weight_scale, weight_global_scale, bias, recipe, weight_zero=None, input_scale=None):
    return linear(x, weight, weight_scale, weight_global_scale, bias, recipe, weight_zero, input_scale, ops=OPS)


library.define("fp8_linear", FP8_LINEAR_SCHEMA, linear, _fp8_linear_fake, cpu_impl=_fp8_linear_cpu)
