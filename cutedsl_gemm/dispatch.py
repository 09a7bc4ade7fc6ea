"""Choosing a kernel instance for a call: reads the one manifest (``generators/manifest.py``)."""

from __future__ import annotations

import functools

from cutedsl_gemm.generators.manifest import INSTANCES, KernelInstance


class NoKernelError(ValueError):
    pass


@functools.lru_cache(maxsize=None)
def _candidates(arch, op, recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum, schedule):
    rows = [
        i
        for i in INSTANCES
        if (i.arch, i.op, i.recipe, i.a_dtype, i.b_dtype, i.out_dtype, i.bias_dtype, i.accum)
        == (arch, op, recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum)
        and (schedule is None or i.schedule == schedule)
    ]
    return tuple(rows)


def select_gemm(
    arch: str,
    recipe: str,
    a_dtype: str,
    b_dtype: str,
    out_dtype: str,
    bias_dtype,
    m: int,
    accum: str = "promoted",
    schedule: str = None,
) -> KernelInstance:
    """The instance for a GEMM call: the first manifest row whose M range holds ``m``.

    ``schedule`` forces a schedule (e.g. "small_m"); otherwise the M ranges of the table decide.
    """
    rows = _candidates(arch, "gemm", recipe, a_dtype, b_dtype, out_dtype, bias_dtype, accum, schedule)
    for inst in rows:
        if inst.m_min <= m <= inst.m_max:
            return inst
    raise NoKernelError(
        f"no kernel instance in the manifest for arch={arch} recipe={recipe} A={a_dtype} B={b_dtype} "
 f"out={out_dtype} bias={bias_dtype} accum={accum} M={m}" + (f" schedule={schedule}" if schedule else "")
    )
