"""(arch, op) -> kernel family: the one place that maps an instance of the table to the module that owns its kernel.

A family is a module of ``cutedsl_gemm.families`` with, for its instances:

- ``entry(inst)`` -> (kernel entry, fake arguments): what ``runtime.compile.compile_instance`` traces (call inside
  ``runtime.compile.targeting(inst.arch)``: kernel constructors may check the arch);
- ``check(inst)``: raise ValueError / TypeError with the reason if the instance cannot be built
  (``selection.instances.validate``);
- ``resources(inst)`` -> (dynamic shared memory bytes, mainloop stages), as the kernel's plan sets them
  (``tools.ptx_inspect.kernel_resources``);
- the GEMM families (``scaled_mm``'s and ``mm_weight_only``'s): ``launch_plan(inst, m, n, splits, device_index, *,
  k, fmt_a, fmt_b)`` -> a plan whose ``run`` launches the compiled kernel in its argument order
  (``runtime.launch.plan``); the grouped family plans its calls itself (``sm90_grouped.launch``).

The runtime's compile and launch paths, the table's validation and the PTX inspection look the family up here;
none of them switches on (arch, op). Importing this module loads no DSL and no kernel module (the families import
them inside their functions).
"""

from __future__ import annotations

from types import ModuleType
from typing import Dict, Tuple

from cutedsl_gemm.families import sm90_gemm, sm90_grouped, sm90_weight_only, sm100_gemm
from cutedsl_gemm.families.keys import GEMM_FP8_OUT, GROUPED_GEMM, QUANT_GEMM, SM90, SM100, WEIGHT_ONLY

FAMILIES: Dict[Tuple[str, str], ModuleType] = {
    (SM90, "gemm"): sm90_gemm,
    (SM90, QUANT_GEMM): sm90_gemm,
    (SM90, GEMM_FP8_OUT): sm90_gemm,
    (SM90, WEIGHT_ONLY): sm90_weight_only,
    (SM90, GROUPED_GEMM): sm90_grouped,
    (SM100, "gemm"): sm100_gemm,
}


class UnknownFamilyError(ValueError):
    """No family is registered for an (arch, op)."""


def registered() -> str:
    """The registered (arch, op) pairs, for messages."""
    return ", ".join(f"{arch} {op}" for arch, op in FAMILIES)


def family_of(arch: str, op: str) -> ModuleType:
    """The family module of (arch, op); UnknownFamilyError (a ValueError) naming the registered pairs if none."""
    try:
        return FAMILIES[(arch, op)]
    except KeyError:
        raise UnknownFamilyError(f"no kernel family for arch={arch} op={op} (registered: {registered()})") from None


def family(inst) -> ModuleType:
    """The family module of an instance of the table."""
    return family_of(inst.arch, inst.op)
