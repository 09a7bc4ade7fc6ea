"""``QuantizedLinear``: a linear layer whose weight is quantized once and whose activations are quantized on every
call, then multiplied by ``scaled_mm``, for the recipes of :mod:`cutedsl_gemm.nn.recipes`."""

from __future__ import annotations

from typing import Optional

import torch

from cutedsl_gemm.numerics.formats import FLOAT_FORMATS
from cutedsl_gemm.ops import library
from cutedsl_gemm.ops.library import EAGER, OPS
from cutedsl_gemm.runtime.device import device_info

from .recipes import (
    LINEAR_RECIPES,
    QUANTIZED,
    STATIC_INPUT_RECIPES,
    LinearRecipe,
    kept_launch,
    linear_recipe,
    quantized_matmul,
)

WEIGHT_DTYPES = tuple(f.torch_dtype for f in FLOAT_FORMATS)  # what a layer to convert may hold
OPERANDS = (*QUANTIZED, "bias", "input_scale", "recipe")

#: The saved format's version, in ``_extra_state`` as ``"cutedsl_gemm/<version>/<recipe>"``. Version 1 is the
#: recipe's bare name with the same buffers (read as version 2); 2 adds the version to the tag and a static layer's
#: ``input_scale``.
FORMAT_VERSION = 2
FORMAT_TAG = "cutedsl_gemm"


def format_tag(recipe: str) -> str:
    """The ``_extra_state`` text of a layer of ``recipe`` in this format version."""
    return f"{FORMAT_TAG}/{FORMAT_VERSION}/{recipe}"


def read_format_tag(raw: bytes, where: str = "QuantizedLinear") -> tuple:
    """(format version, recipe name) of a saved ``_extra_state``: ``"cutedsl_gemm/<version>/<recipe>"``, or a bare
    recipe name (version 1). Anything else is refused (ValueError)."""
    text = raw.decode("ascii", "replace")
    if not text.startswith(FORMAT_TAG + "/"):
        return 1, text
    version, sep, name = text[len(FORMAT_TAG) + 1:].partition("/")
    if not sep or not version.isdigit() or int(version) < 1:
        raise ValueError(f"{where}: unreadable format tag {text!r} in _extra_state; expected "
                         f"'{FORMAT_TAG}/<version>/<recipe>'")
    return int(version), name


class FormatTagged:
    """What this library's quantized modules share about their buffers: the saved-format tag (``_extra_state`` holds
    ``format_tag(self.recipe)``, uint8 ASCII, checked before anything loads: ``check_format_tag``), the saved
    buffers' dtypes (``check_saved_dtypes``), and casts that move the buffers but keep their dtypes (``_apply``).
    ``saved_what`` names what a checkpoint of the module holds ("weights", "experts"), ``module_word`` the module in
    messages."""

    saved_what = "weights"
    module_word = "layer"

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(list(format_tag(self.recipe).encode("ascii")), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass  # checked before anything loads (check_format_tag)

    def check_format_tag(self, state_dict, prefix: str) -> str:
        """Refuse a saved tag of a newer format version or another recipe; returns the module's name for messages."""
        where = prefix[:-1] or type(self).__name__
        saved = state_dict.get(prefix + "_extra_state")
        if isinstance(saved, torch.Tensor):
            version, name = read_format_tag(bytes(saved.to("cpu", torch.uint8).tolist()), where)
            if version > FORMAT_VERSION:
                raise ValueError(f"{where}: the checkpoint holds format version {version} of cutedsl_gemm's "
                                 f"{type(self).__name__} and this cutedsl_gemm reads versions up to {FORMAT_VERSION}; "
                                 "upgrade cutedsl_gemm, or convert again from the high-precision model")
            if name != self.recipe:
                raise ValueError(f"{where}: the checkpoint holds recipe {name!r} {self.saved_what} and this "
                                 f"{self.module_word} runs recipe {self.recipe!r}; convert with recipe={name!r} before "
                                 "loading")
        return where

    def check_saved_dtypes(self, state_dict, prefix: str, where: str, names) -> None:
        """Refuse a saved buffer of another dtype than the module's (an unconverted checkpoint)."""
        for key in names:
            t, mine = state_dict.get(prefix + key), getattr(self, key)
            if isinstance(t, torch.Tensor) and mine is not None and t.dtype != mine.dtype:
                raise ValueError(f"{where}.{key}: expected {mine.dtype} (recipe {self.recipe!r}), got {t.dtype}; "
                                 "an unconverted checkpoint loads into the unconverted model, which convert quantizes")

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) / .half() would cast the quantized codes and the fp32 scales: only the device follows
        for name, t in self._buffers.items():
            if t is not None:
                moved = fn(t)
                self._buffers[name] = moved if moved.dtype == t.dtype else t.to(moved.device)
        return self


def target_arch(recipe: LinearRecipe, device: torch.device) -> str:
    """The arch a layer on ``device`` is checked for: its GPU's, or the current GPU's for a layer on the CPU,
    or without a GPU the first arch that runs the recipe. A GPU that does not run the recipe is an error."""
    if device.type != "cuda" and not torch.cuda.is_available():
        return recipe.archs[0]
    arch = device_info(device.index if device.type == "cuda" and device.index is not None
                       else torch.cuda.current_device())[0]
    if arch not in recipe.archs:
        others = [r.name for r in LINEAR_RECIPES.values() if arch in r.archs]
        runs = f"recipes for {arch}: {', '.join(map(repr, others))}" if others else "it has no kernels for this GPU"
        raise ValueError(f"recipe {recipe.describe()} runs on {' and '.join(recipe.archs)}, not on this GPU ({arch}); "
                         f"{runs}")
    return arch


def unsupported(recipe: LinearRecipe, out_features: int, in_features: int, dtype: torch.dtype, bias: bool,
                arch: str) -> Optional[str]:
    """Why the kernels of ``arch`` cannot run this layer (the ops' own checks, run on fake tensors: the
    ValueError they raise), or None. A dtype the recipe's kernels do not take raises (TypeError)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with library.fake_target(arch), FakeTensorMode():
        w = torch.empty(out_features, in_features, dtype=dtype, device="cuda")
        x = torch.empty(2, in_features, dtype=dtype, device="cuda")  # 2 rows: the checks of strided rows apply
        b = torch.empty(out_features, dtype=torch.float32, device="cuda") if bias else None
        try:
            qw, sw, gw, zw = recipe.quantize_weight(w, OPS)
            OPS.fp8_linear(x, qw, sw, gw, b, recipe.name, zw)
        except ValueError as e:
            return f"K={in_features}, N={out_features}: {e}"
    return None


def check_linear(linear) -> None:
    """A layer ``convert`` / ``from_linear`` can quantize: an ``nn.Linear`` with materialized float weights."""
    if not isinstance(linear, torch.nn.Linear):
        raise TypeError(f"expected a torch.nn.Linear, got {type(linear).__name__}")
    w = linear.weight
    if w.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"the weight to quantize must be bfloat16, float16 or float32, got {w.dtype}")
    if w.device.type == "meta":
        raise ValueError("the weight is on the meta device: load or materialize the weights before converting")


class QuantizedLinear(FormatTagged, torch.nn.Module):
    """``y = x @ W.T + bias`` with W quantized once (:meth:`from_linear`, ``cutedsl_gemm.nn.convert``) and x
    quantized on every call by the recipe (``recipes.LINEAR_RECIPES``), multiplied by ``scaled_mm``.

    ``x``: (..., K) bf16 or fp16 (fp32 where the recipe's quantizer takes it), any leading dimensions, on a GPU
    that runs the recipe -> (..., N) in x's dtype. A CPU input is refused (no torch fallback). Inference only:
    the layer holds buffers, no parameters, and no gradient flows through it.

    Saved format (``state_dict``, loadable with ``safetensors``): ``weight`` the quantized (N, K) weight (NVFP4:
    (N, K/2) ``float4_e2m1fn_x2``; "int8": int8; weight-only recipes: the int32 words of
    ``numerics.int_packing.pack_weights``); ``weight_scale`` its scales in the layout the kernel takes
    (``scaled_mm``'s ``scale_b``, fp32: () per tensor, (1, N) per channel, (ceil(K/128), ceil(N/128)) per
    128x128 block; MX / NVFP4: SWIZZLE_32_4_4 block scales; weight-only: (1, N) fp32 per channel or
    (K / group, N) in the activations' dtype); ``weight_global_scale`` (NVFP4's fp32 decode scale);
    ``weight_zero`` (the "_zp" int4 recipes' integer zero points, (K / group, N) in the activations' dtype, as
    ``pack_weights`` returns them); ``bias`` (N,) fp32; and ``_extra_state`` the format version and the recipe,
    ``"cutedsl_gemm/<FORMAT_VERSION>/<recipe>"`` (uint8 ASCII), checked on load: weights load only into a layer of
    the same recipe, a bare recipe name (format version 1, the same buffers) loads, and a newer version than this
    code reads is refused. A layer built with ``input_scale=True`` also saves ``input_scale``, its activations'
    static per-tensor decode scale (fp32, shape ()). Casting the model (``.to(torch.float16)``,
    ``.half()``) leaves these dtypes alone.

    ``QuantizedLinear(in_features, out_features, bias, recipe, dtype=...)`` builds an empty layer to load a checkpoint
    into (``dtype``: the activations', which the group-wise weight-only scales and zero points are stored in;
    default bf16). Buffers a recipe has none of are None and absent from the saved format.

    ``input_scale=True`` (recipe "tensor" only; others are refused): the layer holds a static activation scale, the
    buffer ``input_scale`` (fp32, shape (); e.g. a checkpoint's calibrated per-tensor FP8 activation scale), and
    forward quantizes x with it (``recipes.quantize_fp8_static``: x / input_scale saturated to E4M3 and rounded to
    nearest even, by torch element-wise ops) and passes it to ``scaled_mm`` as ``scale_a``, instead of computing the
    activations' amax on every call.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "row", device=None,
                 dtype: Optional[torch.dtype] = None, input_scale: bool = False):
        super().__init__()
        r = linear_recipe(recipe)
        if input_scale and r.name not in STATIC_INPUT_RECIPES:
            raise ValueError(f"input_scale=True (a static activation scale) works with recipe "
                             f"{' or '.join(map(repr, STATIC_INPUT_RECIPES))} (per-tensor FP8 activations), not "
                             f"{r.name!r}, whose activation scales are computed on every call")
        self.in_features, self.out_features, self.recipe = in_features, out_features, r.name
        # the buffers' shapes and dtypes: the recipe's weight quantizer run on a meta weight (the ops' meta kernels)
        w = torch.empty(out_features, in_features, dtype=dtype or torch.bfloat16, device="meta")
        for name, t in zip(QUANTIZED, r.quantize_weight(w, OPS)):
            self.register_buffer(name, None if t is None else torch.empty(t.shape, dtype=t.dtype, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32, device=device) if bias else None)
        self.register_buffer("input_scale", torch.empty((), dtype=torch.float32, device=device) if input_scale
                             else None)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: str = "row") -> QuantizedLinear:
        """The quantized copy of ``linear`` (on its device; the bias kept in fp32). A layer the kernels cannot
        run (its shape, or a recipe the GPU does not run) is refused with the reason."""
        check_linear(linear)
        r = linear_recipe(recipe)
        arch = target_arch(r, linear.weight.device)
        why = unsupported(r, linear.out_features, linear.in_features, linear.weight.dtype, linear.bias is not None,
                          arch)
        if why is not None:
            raise ValueError(f"this layer cannot run recipe {r.name!r} on {arch}: {why}")
        return cls.quantized(linear, r)

    @classmethod
    def quantized(cls, linear: torch.nn.Linear, recipe: LinearRecipe) -> QuantizedLinear:
        """``from_linear`` without its checks (``convert`` makes them once per layer shape). The weight is
        quantized where it lives: by the kernels on a GPU, by their torch reference (the same bits) elsewhere."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe.name, device="meta",
                    dtype=linear.weight.dtype)
        with torch.no_grad():
            quantized = recipe.quantize_weight(linear.weight.detach().contiguous(), EAGER)
            for name, t in zip(QUANTIZED, quantized):
                setattr(layer, name, t)
            if linear.bias is not None:
                layer.bias = linear.bias.detach().to(torch.float32, copy=True)
        return layer

    # The eager call's operands (kernel weight, weight_scale, weight_global_scale, weight_zero, bias, recipe), and
    # per input (shape, dtype, device) the kept launches of a call (recipes.kept_launch), so that a repeated call
    # costs the kernels' own launches: reading buffers through Module.__getattr__, the ops' argument handling and
    # their plan lookups cost microseconds per call. Dropped when any operand is reassigned or the layer moves.
    _eager = None
    _launches = None
    _MAX_LAUNCHES = 64  # distinct input shapes kept per layer (e.g. every prompt length): start over

    def _eager_operands(self) -> tuple:
        r = linear_recipe(self.recipe)
        self._eager = (r.kernel_weight(self.weight), self.weight_scale, self.weight_global_scale, self.weight_zero,
                       self.bias, r)
        return self._eager

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in OPERANDS:
            self._forget_launches()

    def _forget_launches(self):
        self.__dict__.pop("_eager", None)
        self.__dict__.pop("_launches", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling():
            launches = self._launches
            if launches is not None and x.is_contiguous():
                run = launches.get((x.shape, x.dtype, x.get_device()))
                if run is not None:
                    try:
                        return run(x)
                    except (TypeError, ValueError):  # refused before launch: the ops' full checks say why
                        return quantized_matmul(x, *(self._eager or self._eager_operands()))
            return self._first_call(x)
        # traced, fake, meta or CPU tensors: the op (which refuses the CPU)
        args = (x, self.weight, self.weight_scale, self.weight_global_scale, self.bias, self.recipe, self.weight_zero)
        input_scale = self.input_scale
        return OPS.fp8_linear(*args) if input_scale is None else OPS.fp8_linear(*args, input_scale)

    def _first_call(self, x: torch.Tensor) -> torch.Tensor:
        b, scale, global_scale, zero, bias, r = self._eager or self._eager_operands()
        input_scale = self._buffers.get("input_scale")
        if input_scale is not None:  # a static scale: torch quantizes x, then the GEMM (no kept launch)
            return quantized_matmul(x, b, scale, global_scale, zero, bias, r, input_scale=input_scale)
        if not x.is_contiguous() or not r.keeps_launch or x.numel() == 0:
            return quantized_matmul(x, b, scale, global_scale, zero, bias, r)
        try:
            y, run = kept_launch(x, b, scale, zero, bias, r)
        except (TypeError, ValueError):  # a kept quantizer launch refused x: the ops' full checks say why
            return quantized_matmul(x, b, scale, global_scale, zero, bias, r)
        if run is not None:
            launches = self.__dict__.get("_launches")
            if launches is None or len(launches) >= self._MAX_LAUNCHES:
                launches = self.__dict__["_launches"] = {}
            launches[(x.shape, x.dtype, x.get_device())] = run
        return y

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight W (out_features, in_features) the kernels multiply, in ``dtype``, on the layer's device: the
        quantized codes times their scales (per tensor, per channel, per 128x128 block with ragged edges; MX / NVFP4
        block scales times NVFP4's global scale; int8 per channel; int4 ``(q - z) * s`` per group) in fp32 (the fp32
        products' bits: ``LinearRecipe.dequantize_weight``), then cast. ``y ~= x @ layer.dequantize().T + bias`` up
        to the activations' quantization.

        The group-wise int4 kernels round ``(q - z) * s`` to the activations' dtype in registers before the MMA:
        ``dequantize(dtype)`` with the layer's activation dtype (its scales' dtype) is those values bit for bit."""
        r = linear_recipe(self.recipe)
        with torch.no_grad():
            w = r.dequantize_weight(self.weight, self.weight_scale, self.weight_global_scale, self.weight_zero,
                                    self.in_features)
        return w.to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe!r}" + (", input_scale=True" if self.input_scale is not None else ""))

    # --- saved format -------------------------------------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        where = self.check_format_tag(state_dict, prefix)
        if strict and (prefix + "weight") in state_dict:
            saved, mine = (prefix + "input_scale") in state_dict, self.input_scale is not None
            if saved and not mine:
                raise ValueError(f"{where}: the checkpoint has a static input_scale (the activations' per-tensor "
                                 f"scale): build the layer with QuantizedLinear(..., recipe={self.recipe!r}, "
                                 "input_scale=True)")
            if mine and not saved:
                raise ValueError(f"{where}: this layer takes a static input_scale and the checkpoint has none: "
                                 "build it with input_scale=False (the activations' scale computed on every call)")
        self.check_saved_dtypes(state_dict, prefix, where, QUANTIZED)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # (FormatTagged: the buffers keep their dtypes)
        self._forget_launches()
        return self


#: The layer's earlier name, kept for one release.
Fp8Linear = QuantizedLinear
