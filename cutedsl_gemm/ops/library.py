"""The machinery shared by the public ops' torch operators (``torch.ops.cutedsl_gemm.<name>``), so that
``torch.compile(fullgraph=True)`` traces through them, ``mode="reduce-overhead"`` captures them in CUDA graphs
and ``torch.library.opcheck`` passes.

Each op is defined once, beside its public function, with :func:`define`: ``ops/scaled_mm.py`` (``scaled_mm``,
``quantize_scaled_mm``, ``scaled_mm_fp8_out``), ``ops/quantize.py`` (``quantize_fp8``, ``quantize_int8``,
``quantize_mx``, ``quantize_nvfp4``), ``ops/gated.py`` (``silu_mul_quantize_fp8``), ``ops/weight_only.py``
(``mm_weight_only``), ``ops/grouped.py`` (``grouped_scaled_mm``), ``ops/moe_route.py`` (``route_quantize_fp8``,
``sum_routed_pairs``) and ``nn/recipes.py`` (``fp8_linear``). Every
definition runs on ``import cutedsl_gemm``.
This module imports none of them.

A definition is a typed schema in the ``cutedsl_gemm`` namespace (``torch.library.Library``), a CUDA and a CPU
implementation that call the public function (on the CPU the quantizers run their torch reference;
``scaled_mm`` refuses CPU tensors with its own error), and a fake implementation: output shapes, dtypes and
strides from metadata, after the public function's own checks where metadata decides them (the tensors'
addresses never reach it: :func:`_checked_on_metas`). Functional forms only: an ``out=`` form that mutates its
inputs loses CUDA graphs under Inductor. The quantizers' ops return tuples: ``quantize_mx`` ``(data, scales)``,
``quantize_nvfp4`` ``(data, scales, global_scale)``, the tensors of their ``BlockScaledTensor``.

Eager calls do not cross the dispatcher (a few microseconds per call): the public functions launch their
kernels directly and call their ops only while ``torch.compile`` traces them (the ``traced_*`` function beside
each op, which passes its string arguments through :func:`op_name`). ``EAGER`` holds the ops' implementations
(each op module adds its own) and ``OPS`` the ops. Which GPU the fake implementations check a call against:
the fake tensors' device, or :func:`fake_target`.
"""

from __future__ import annotations

import contextlib
import types

import torch

from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics.formats import ScaleGranularity, element_format
from cutedsl_gemm.runtime.device import device_info

NAMESPACE = "cutedsl_gemm"
LIB = torch.library.Library(NAMESPACE, "DEF")
# The kernels read row-major operands with packed rows: the compiler must hand over the strides eager would.
_STRIDES = getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order)
TAGS = (torch.Tag.pt2_compliant_tag, _STRIDES)

#: The ops' implementations, called with the ops' arguments without crossing the dispatcher (eager calls); each op
#: module adds its ops' (``EAGER.<name> = <implementation>``).
EAGER = types.SimpleNamespace()
#: The ops themselves (what a traced call records).
OPS = getattr(torch.ops, NAMESPACE)


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
# the ops' string arguments while torch.compile traces the public functions
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
