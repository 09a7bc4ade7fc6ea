"""The public ops as torch operators: ``torch.ops.cutedsl_gemm.scaled_mm``, ``quantize_scaled_mm``,
``scaled_mm_fp8_out``, ``mm_weight_only``, ``quantize_fp8``, ``quantize_int8``, ``quantize_mx`` and ``quantize_nvfp4``
(``cutedsl_gemm.nn`` adds ``fp8_linear``), so that
``torch.compile(fullgraph=True)`` traces through them, ``mode="reduce-overhead"`` captures them in CUDA graphs
and ``torch.library.opcheck`` passes.

Each op is defined once in the ``cutedsl_gemm`` namespace (``torch.library.Library``) with a typed schema, a
CUDA and a CPU implementation that call the public function (on the CPU the quantizers run their torch
reference; ``scaled_mm`` refuses CPU tensors with its own error), and a fake implementation (:func:`define`):
output shapes, dtypes and strides from metadata, after the public function's own checks where metadata decides
them (the tensors' addresses never reach it). Functional forms only: an ``out=`` form that mutates its inputs
loses CUDA graphs under Inductor. The quantizers' ops return tuples: ``quantize_mx`` ``(data, scales)``,
``quantize_nvfp4`` ``(data, scales, global_scale)``, the tensors of their ``BlockScaledTensor``.

Eager calls do not cross the dispatcher (a few microseconds per call): the public functions launch their
kernels directly and call these ops only while ``torch.compile`` traces them (the ``traced_*`` functions).
Which GPU the fake implementations check a call against: the fake tensors' device, or :func:`fake_target`.
"""

from __future__ import annotations

import contextlib
import types

import torch

from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.codecs import packed_row_bytes, storage_view
from cutedsl_gemm.numerics.formats import E2M1, E4M3, UE8M0, ScaleGranularity, element_format
from cutedsl_gemm.numerics.scale_layouts import blocked_scale_shape
from cutedsl_gemm.ops import quantize as Q
from cutedsl_gemm.ops import scaled_mm as S
from cutedsl_gemm.ops import weight_only as W
from cutedsl_gemm.runtime.device import device_info

NAMESPACE = "cutedsl_gemm"
LIB = torch.library.Library(NAMESPACE, "DEF")
# The kernels read row-major operands with packed rows: the compiler must hand over the strides eager would.
_STRIDES = getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order)
TAGS = (torch.Tag.pt2_compliant_tag, _STRIDES)


def define(name: str, schema: str, impl, fake, cpu_impl=None) -> None:
    """Define ``torch.ops.cutedsl_gemm.<name>``: ``impl`` for CUDA tensors (and CPU ones unless ``cpu_impl``
    is given), ``fake`` for fake and meta tensors."""
    LIB.define(name + schema, tags=TAGS)
    LIB.impl(name, impl, "CUDA")
    LIB.impl(name, cpu_impl or impl, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=LIB)


# ----------------------------------------------------------------------------------------------------
# which GPU a fake call is checked against
# ----------------------------------------------------------------------------------------------------

_FORCED_TARGETS: list = []


@contextlib.contextmanager
def fake_target(arch: str):
    """Inside, fake implementations check calls as a GPU of ``arch`` ("sm_90a", "sm_100a") runs them, whatever
    the fake tensors' device and whether a GPU is present (``cutedsl_gemm.nn`` checks layers this way)."""
    if arch not in P.ARCHS:
        raise ValueError(f"arch must be one of {', '.join(map(repr, P.ARCHS))}, got {arch!r}")
    _FORCED_TARGETS.append((arch, 0))
    try:
        yield
    finally:
        _FORCED_TARGETS.pop()


def _target(device: torch.device):
    """(arch, SMs) for ``problem.describe_scaled_mm``: ``fake_target``'s, else the GPU of a fake CUDA tensor;
    None (meta tensors, fake CUDA tensors without a GPU): only shapes are computed."""
    if _FORCED_TARGETS:
        return _FORCED_TARGETS[-1]
    if device.type == "cuda" and torch.cuda.is_available():
        return device_info(torch.cuda.current_device() if device.index is None else device.index)
    return None


def _int(v):
    """A size or stride as an int: a symbolic one (``torch.compile``'s dynamic shapes) by its hint, or None."""
    if isinstance(v, torch.SymInt):
        node = v.node
        return node.hint if node.has_hint() else None
    return v


def _meta(t):
    """A meta tensor with ``t``'s shape, strides and dtype (None for None; False where a size has no hint):
    the validation reads metadata and addresses, and a meta tensor's address is 0, not a fake's warning."""
    if t is None:
        return None
    size = [_int(s) for s in t.shape]
    stride = [_int(s) for s in t.stride()]
    if None in size or None in stride:
        return False
    return torch.empty_strided(size, stride, dtype=t.dtype, device="meta")


def _checked_on_metas(device: torch.device, tensors, describe) -> bool:
    """A fake call's validation: ``describe(target, *metas)`` on meta copies of ``tensors`` (None stays None) for
    the GPU the call is checked against (``_target``). False when there is none (the caller checks what it can
    without one); True otherwise, also when a size has no hint (nothing to check it against)."""
    target = _target(device)
    if target is None:
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        metas = [_meta(t) for t in tensors]
        if not any(m is False for m in metas):
            describe(target, *metas)
    return True


# ----------------------------------------------------------------------------------------------------
# scaled_mm
# ----------------------------------------------------------------------------------------------------

SCALED_MM_SCHEMA = (
    "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None, ScalarType? out_dtype=None, "
    "bool use_fast_accum=False, *, str? scale_recipe_a=None, str? scale_recipe_b=None, "
    "Tensor? global_scale_a=None, Tensor? global_scale_b=None, str? swizzle_a=None, str? swizzle_b=None, "
    "str? fmt_a=None, str? fmt_b=None, str? schedule=None, int? split_k=None) -> Tensor"
)


def _with_global(scale, recipe, global_scale):
    """NVFP4's ``[block scales, global scale]`` (and recipes) as ``scaled_mm`` takes them."""
    if global_scale is None:
        return scale, recipe
    return [scale, global_scale], (None if recipe is None else [recipe, ScaleGranularity.TENSOR.scaling_type])


def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False, *, scale_recipe_a=None,
              scale_recipe_b=None, global_scale_a=None, global_scale_b=None, **options):
    """``cutedsl_gemm.scaled_mm`` with the op's arguments: ``out_dtype`` None is bf16, NVFP4's global scales are
    ``global_scale_a`` / ``global_scale_b``; ``options``: swizzle_a/b, fmt_a/b, schedule, split_k."""
    if global_scale_a is not None or global_scale_b is not None:
        scale_a, scale_recipe_a = _with_global(scale_a, scale_recipe_a, global_scale_a)
        scale_b, scale_recipe_b = _with_global(scale_b, scale_recipe_b, global_scale_b)
    return S.scaled_mm(a, b, scale_a, scale_b, bias, None, torch.bfloat16 if out_dtype is None else out_dtype,
                       use_fast_accum, scale_recipe_a=scale_recipe_a, scale_recipe_b=scale_recipe_b, **options)


def _scaled_mm_fake(a, b, scale_a, scale_b, bias=None, out_dtype=None, use_fast_accum=False, *, scale_recipe_a=None,
                    scale_recipe_b=None, global_scale_a=None, global_scale_b=None, swizzle_a=None, swizzle_b=None,
                    fmt_a=None, fmt_b=None, schedule=None, split_k=None):
    out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
    P.require_out_dtype(out_dtype)

    def describe(target, ma, mb, msa, msb, mbias, mga, mgb):
        msa, ra = _with_global(msa, scale_recipe_a, mga)
        msb, rb = _with_global(msb, scale_recipe_b, mgb)
        P.describe_scaled_mm(ma, mb, msa, msb, mbias, out_dtype, None, use_fast_accum, ra, rb, schedule, split_k,
                             a.device, fmt_a, fmt_b, swizzle_a, swizzle_b, target=target)

    if not _checked_on_metas(a.device, (a, b, scale_a, scale_b, bias, global_scale_a, global_scale_b), describe) \
            and (a.dim() != 2 or b.dim() != 2):
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


QUANTIZE_SCALED_MM_SCHEMA = (
    "(Tensor x, Tensor b, Tensor scale_b, Tensor? bias=None, ScalarType? out_dtype=None, *, "
    "str? scale_recipe_b=None, int? split_k=None, bool? in_kernel=None) -> Tensor"
)


def quantize_scaled_mm(x, b, scale_b, bias=None, out_dtype=None, *, scale_recipe_b=None, split_k=None,
                       in_kernel=None):
    """``cutedsl_gemm.quantize_scaled_mm`` with the op's arguments (no ``out=``)."""
    return S.quantize_scaled_mm(x, b, scale_b, bias, out_dtype, scale_recipe_b=scale_recipe_b, split_k=split_k,
                                in_kernel=in_kernel)


def _quantize_scaled_mm_fake(x, b, scale_b, bias=None, out_dtype=None, *, scale_recipe_b=None, split_k=None,
                             in_kernel=None):
    out_dtype = x.dtype if out_dtype is None else out_dtype

    def describe(target, *metas):
        P.describe_quantize_scaled_mm(*metas, out_dtype, None, scale_recipe_b, split_k, x.device, target=target)

    if not _checked_on_metas(x.device, (x, b, scale_b, bias), describe):
        P.require_out_dtype(out_dtype)
        if x.dim() != 2 or b.dim() != 2:
            raise ValueError(f"x and b must be 2-D, got shapes {tuple(x.shape)} and {tuple(b.shape)}")
    return x.new_empty((x.shape[0], b.shape[1]), dtype=out_dtype)


# ----------------------------------------------------------------------------------------------------
# the quantizers
# ----------------------------------------------------------------------------------------------------

QUANTIZE_FP8_SCHEMA = (
    '(Tensor x, str recipe="1x128", *, str fmt="e4m3", int block=128, str? scale_layout=None, str operand="a") '
    "-> (Tensor, Tensor)"
)
QUANTIZE_INT8_SCHEMA = '(Tensor x, str granularity="row") -> (Tensor, Tensor)'
QUANTIZE_MX_SCHEMA = '(Tensor x, str fmt="e4m3") -> (Tensor, Tensor)'
QUANTIZE_NVFP4_SCHEMA = "(Tensor x, Tensor? global_scale=None) -> (Tensor, Tensor, Tensor)"


def quantize_mx(x, fmt="e4m3"):
    """``cutedsl_gemm.quantize_mx`` as the op returns it: (data, scales)."""
    t = Q.quantize_mx(x, fmt)
    return t.data, t.scales


def quantize_nvfp4(x, global_scale=None):
    """``cutedsl_gemm.quantize_nvfp4`` as the op returns it: (data, scales, global scale), the global scale a
    new tensor (an op's output never aliases its input)."""
    t = Q.quantize_nvfp4(x, global_scale)
    return t.data, t.scales, (t.global_scale if global_scale is None else t.global_scale.clone())


def _quantize_mx_fake(x, fmt="e4m3"):
    f = element_format(fmt)
    if f not in R.MX_ELEMENT_FORMATS:
        raise ValueError(f"MX element format must be one of {[g.name for g in R.MX_ELEMENT_FORMATS]}; got {f.name}")
    Q._block_backend(x, R.MX_BLOCK, "auto")
    rows, k = x.shape
    data = x.new_empty((rows, packed_row_bytes(k, f)), dtype=torch.uint8)
    scales = x.new_empty(blocked_scale_shape(rows, k // R.MX_BLOCK), dtype=torch.uint8)
    return storage_view(data, f), scales.view(UE8M0.torch_dtype)


def _quantize_nvfp4_fake(x, global_scale=None):
    Q._block_backend(x, R.NVFP4_BLOCK, "auto")
    if global_scale is not None:
        R.check_global_scale(global_scale, x.device)
    rows, k = x.shape
    data = x.new_empty((rows, packed_row_bytes(k, E2M1)), dtype=torch.uint8)
    scales = x.new_empty(blocked_scale_shape(rows, k // R.NVFP4_BLOCK), dtype=torch.uint8)
    return storage_view(data, E2M1), scales.view(E4M3.torch_dtype), x.new_empty((), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------
# the weight-only GEMM
# ----------------------------------------------------------------------------------------------------

MM_WEIGHT_ONLY_SCHEMA = (
    "(Tensor x, Tensor packed_w, Tensor scales, Tensor? zeros=None, *, int group=128, int bits=4, int? split_k=None) "
    "-> Tensor"
)


def mm_weight_only(x, packed_w, scales, zeros=None, *, group=128, bits=4, split_k=None):
    """``cutedsl_gemm.mm_weight_only`` with the op's arguments (no ``out=``)."""
    return W.mm_weight_only(x, packed_w, scales, zeros, group=group, bits=bits, split_k=split_k)


def _mm_weight_only_fake(x, packed_w, scales, zeros=None, *, group=128, bits=4, split_k=None):
    def describe(target, *metas):
        P.describe_weight_only(*metas, group, bits, None, split_k, x.device, target=target)

    if not _checked_on_metas(x.device, (x, packed_w, scales, zeros), describe) \
            and (x.dim() != 2 or scales.dim() != 2):
        raise ValueError(f"x and scales must be 2-D, got shapes {tuple(x.shape)} and {tuple(scales.shape)}")
    return x.new_empty((x.shape[0], scales.shape[1]))


define("scaled_mm", SCALED_MM_SCHEMA, scaled_mm, _scaled_mm_fake)
define("quantize_scaled_mm", QUANTIZE_SCALED_MM_SCHEMA, quantize_scaled_mm, _quantize_scaled_mm_fake)
define("quantize_fp8", QUANTIZE_FP8_SCHEMA, Q.quantize_fp8, Q.quantize_fp8_like)
define("quantize_int8", QUANTIZE_INT8_SCHEMA, Q.quantize_int8, Q.quantize_int8_like)
define("quantize_mx", QUANTIZE_MX_SCHEMA, quantize_mx, _quantize_mx_fake)
define("quantize_nvfp4", QUANTIZE_NVFP4_SCHEMA, quantize_nvfp4, _quantize_nvfp4_fake)
define("mm_weight_only", MM_WEIGHT_ONLY_SCHEMA, mm_weight_only, _mm_weight_only_fake)

#: The ops' implementations, called with the ops' arguments without crossing the dispatcher (eager calls).
EAGER = types.SimpleNamespace(scaled_mm=scaled_mm, quantize_scaled_mm=quantize_scaled_mm,
                              quantize_fp8=Q.quantize_fp8, quantize_int8=Q.quantize_int8, quantize_mx=quantize_mx,
                              quantize_nvfp4=quantize_nvfp4, mm_weight_only=mm_weight_only)
#: The ops themselves (what a traced call records).
OPS = getattr(torch.ops, NAMESPACE)


# ----------------------------------------------------------------------------------------------------
# the public functions while torch.compile traces them
# ----------------------------------------------------------------------------------------------------


def op_name(x):
    """A string argument of the ops from what the public functions take: a string, a ScaleGranularity (its
    label), a torch dtype (its element format), anything else with a ``name`` (ElementFormat, ScalingRecipe,
    ``F.ScalingType``, ``F.SwizzleType``); a list (NVFP4's per-operand pair) by its first entry."""
    if isinstance(x, (list, tuple)):
        x = x[0] if x else None
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, ScaleGranularity):
        return x.label
    if isinstance(x, torch.dtype):
        return element_format(x).name
    name = getattr(x, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"expected a name (a string, a format, a recipe or a torch enum member), got {x!r}")
    return name


def traced_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum, *, scale_recipe_a,
                     scale_recipe_b, swizzle_a, swizzle_b, out, fmt_a, fmt_b, schedule, split_k):
    """``cutedsl_gemm.scaled_mm`` under ``torch.compile``: the op (``out=`` is filled from its result)."""
    if scale_result is not None:
        raise ValueError("scale_result must be None: outputs are bf16, fp16 or fp32")
    global_a = global_b = None
    if isinstance(scale_a, (list, tuple)):
        scale_a, global_a = scale_a if len(scale_a) == 2 else (scale_a[0], None)
    if isinstance(scale_b, (list, tuple)):
        scale_b, global_b = scale_b if len(scale_b) == 2 else (scale_b[0], None)
    res = OPS.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum,
                        scale_recipe_a=op_name(scale_recipe_a), scale_recipe_b=op_name(scale_recipe_b),
                        global_scale_a=global_a, global_scale_b=global_b, swizzle_a=op_name(swizzle_a),
                        swizzle_b=op_name(swizzle_b), fmt_a=op_name(fmt_a), fmt_b=op_name(fmt_b), schedule=schedule,
                        split_k=split_k)
    if out is None:
        return res
    out.copy_(res)
    return out


def traced_quantize_scaled_mm(x, b, scale_b, bias, out_dtype, *, scale_recipe_b, out, split_k, in_kernel):
    """``cutedsl_gemm.quantize_scaled_mm`` under ``torch.compile``: the op (``out=`` is filled from its result)."""
    res = OPS.quantize_scaled_mm(x, b, scale_b, bias, out_dtype, scale_recipe_b=op_name(scale_recipe_b),
                                 split_k=split_k, in_kernel=in_kernel)
    if out is None:
        return res
    out.copy_(res)
    return out


def traced_quantize_fp8(x, granularity, *, fmt, block, scale_layout, operand):
    """``cutedsl_gemm.quantize_fp8`` under ``torch.compile``: the op (whose schema names the granularity
    ``recipe``, passed by position)."""
    return OPS.quantize_fp8(x, op_name(granularity), fmt=op_name(fmt), block=block, scale_layout=scale_layout,
                            operand=operand)


def traced_quantize_int8(x, granularity):
    """``cutedsl_gemm.quantize_int8`` under ``torch.compile``: the op."""
    return OPS.quantize_int8(x, op_name(granularity))


def traced_mm_weight_only(x, packed_w, scales, zeros, *, group, bits, out, split_k):
    """``cutedsl_gemm.mm_weight_only`` under ``torch.compile``: the op (``out=`` is filled from its result)."""
    res = OPS.mm_weight_only(x, packed_w, scales, zeros, group=group, bits=bits, split_k=split_k)
    if out is None:
        return res
    out.copy_(res)
    return out


def traced_quantize_mx(x, fmt) -> R.BlockScaledTensor:
    """``cutedsl_gemm.quantize_mx`` under ``torch.compile``: the op's tensors in a BlockScaledTensor."""
    f = element_format(fmt)
    data, scales = OPS.quantize_mx(x, f.name)
    return R.BlockScaledTensor(data, scales, f, R.MX_BLOCK, (x.shape[0], x.shape[1]))


def traced_quantize_nvfp4(x, global_scale) -> R.BlockScaledTensor:
    """``cutedsl_gemm.quantize_nvfp4`` under ``torch.compile``: the op's tensors in a BlockScaledTensor."""
    data, scales, g = OPS.quantize_nvfp4(x, global_scale)
    return R.BlockScaledTensor(data, scales, E2M1, R.NVFP4_BLOCK, (x.shape[0], x.shape[1]), g)


# ----------------------------------------------------------------------------------------------------
# scaled_mm_fp8_out
# ----------------------------------------------------------------------------------------------------

SCALED_MM_FP8_OUT_SCHEMA = "(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? bias=None) -> (Tensor, Tensor)"


def scaled_mm_fp8_out(a, b, scale_a, scale_b, bias=None):
    """``cutedsl_gemm.scaled_mm_fp8_out`` as the op returns it: (q, scales)."""
    return S.scaled_mm_fp8_out(a, b, scale_a, scale_b, bias)


def _scaled_mm_fp8_out_fake(a, b, scale_a, scale_b, bias=None):
    def describe(target, *metas):
        P.describe_scaled_mm_fp8_out(*metas, a.device, target=target)

    if not _checked_on_metas(a.device, (a, b, scale_a, scale_b, bias), describe):
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
        if _int(b.shape[1]) is not None:
            P.check_fp8_output_columns(_int(b.shape[1]))
    # quantize_fp8's outputs for the bf16 output (its checks of N included)
    return Q.quantize_fp8_like(a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16), "1x128")


define("scaled_mm_fp8_out", SCALED_MM_FP8_OUT_SCHEMA, scaled_mm_fp8_out, _scaled_mm_fp8_out_fake)
EAGER.scaled_mm_fp8_out = scaled_mm_fp8_out


def traced_scaled_mm_fp8_out(a, b, scale_a, scale_b, bias):
    """``cutedsl_gemm.scaled_mm_fp8_out`` under ``torch.compile``: the op."""
    return OPS.scaled_mm_fp8_out(a, b, scale_a, scale_b, bias)
