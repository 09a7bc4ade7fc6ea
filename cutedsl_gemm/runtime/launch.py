"""Launching a compiled instance: ``launch`` and ``bind`` are the public way to run one instance on tensors already
in the kernel's layouts (tests and benchmarks that bypass dispatch use them); ``plan`` sizes a launch once (the
instance's family's ``launch_plan``: each family's plan knows its kernel's argument order) and its ``run`` method
launches it, which is what ``scaled_mm`` keeps per call signature so that a repeated call costs one
compiled-function call. What plans hold (the compiled function, the persistent per-device buffers) is in
``runtime/resources.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from cutedsl_gemm.families.keys import GEMM_FP8_OUT, SM100
from cutedsl_gemm.families.registry import family
from cutedsl_gemm.numerics.formats import element_format

# (the runtime's names its callers reach through this module)
from cutedsl_gemm.runtime.device import launch_clusters  # noqa: F401
from cutedsl_gemm.runtime.resources import compiled, dummy_bias, forget_buffers, split_tiles  # noqa: F401

if TYPE_CHECKING:
    from cutedsl_gemm.selection.instances import KernelInstance  # (the type only: the runtime reads no table)


def plan(inst: KernelInstance, m: int, n: int, splits: int, device_index: int, *, k: int = 0,
         fmt_a: Optional[str] = None, fmt_b: Optional[str] = None):
    """Compile (once) and size a launch of ``inst`` for an M x N output with ``splits`` K splits: its family's
    ``launch_plan`` (``families/registry.py``). sm_100a instances also take K and the operand formats (their
    kernels read both at run time)."""
    return family(inst).launch_plan(inst, m, n, splits, device_index, k=k, fmt_a=fmt_a, fmt_b=fmt_b)


def run(p, a, b, out, scale_a, scale_b, bias, global_a=None, global_b=None) -> torch.Tensor:
    """Launch plan ``p`` (``p.run``) on the current stream; ``scale_a``/``scale_b`` are the kernel's scale views."""
    return p.run(a, b, out, scale_a, scale_b, bias, global_a, global_b)


def bind(inst: KernelInstance, a, b, scale_a, scale_b, out, *, splits: int = 1, bias: Optional[torch.Tensor] = None,
         fmt_a: Optional[str] = None, fmt_b: Optional[str] = None, global_scale_a: Optional[torch.Tensor] = None,
         global_scale_b: Optional[torch.Tensor] = None):
    """A no-argument callable that launches ``inst`` on these tensors in the kernel's layouts, with ``splits``
    K splits (1 where the instance has no split-K reduction).

    Hopper: ``a`` (M, K) row-major, ``b`` (K, N) column-major, scale views as
    ``numerics.scale_layouts.resolve`` returns them. sm_100a: ``a`` (M, row bytes) and ``b`` (N, row bytes)
    uint8 with K contiguous, ``fmt_a``/``fmt_b`` their formats, (1,) fp32 scales or blocked scale words
    (``numerics.scale_layouts.blocked_scale_words``), an fp32 bias, NVFP4's global scales."""
    if splits > 1 and not inst.can_split_k:
        raise ValueError(f"{inst.name} is built without the split-K reduction; got splits={splits}")
    if inst.op == GEMM_FP8_OUT:
        raise ValueError(f"{inst.name} writes FP8 and its 1x128 scales: launch it with plan(...).run_fp8_out")
    k = 0
    if inst.arch == SM100:
        if fmt_a is None or fmt_b is None:
            raise ValueError(f"{inst.name}: give fmt_a and fmt_b, the operand formats (the kernel reads them at run "
                             "time)")
        k = a.shape[1] * 8 // element_format(fmt_a).bits
    p = plan(inst, out.shape[0], out.shape[1], splits, out.device.index, k=k, fmt_a=fmt_a, fmt_b=fmt_b)
    return lambda: p.run(a, b, out, scale_a, scale_b, bias, global_scale_a, global_scale_b)


def launch(inst: KernelInstance, a, b, scale_a, scale_b, out, *, splits: int = 1,
           bias: Optional[torch.Tensor] = None, **sm100_args) -> torch.Tensor:
    """Run ``inst`` once on these tensors (see ``bind``) and return ``out``."""
    bind(inst, a, b, scale_a, scale_b, out, splits=splits, bias=bias, **sm100_args)()
    return out
