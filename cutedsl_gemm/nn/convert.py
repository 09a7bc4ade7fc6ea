"""``convert``: swap a model's ``nn.Linear`` layers for ``QuantizedLinear`` and its transformers experts modules for
``QuantizedExperts`` (unless ``experts=False``) in place, and say what was skipped or kept in high precision, and
why."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .linear import QuantizedLinear, check_linear, target_arch, unsupported
from .moe import EXPERT_RECIPES, QuantizedExperts, check_experts, experts_unsupported, is_experts
from .recipes import linear_recipe


@dataclass
class ConversionReport:
    """What ``convert`` did: ``converted`` module names (linear layers and experts modules; ``converted_experts``
    the experts among them); ``skipped``: nn.Linear or experts module name -> why it was not converted (one line
    each); ``kept``: every parameter left in its high-precision dtype that is not a converted module's, name -> why
    (embedding tables, norms and biases, MoE experts' 3-D weights, routers, skipped modules): nothing the model
    holds goes unmentioned."""

    recipe: str
    converted: list = field(default_factory=list)
    converted_experts: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)
    kept_elements: int = 0
    total_elements: int = 0

    def __str__(self) -> str:
        experts = len(self.converted_experts)
        linear = f"{len(self.converted) - experts} linear layers"
        done = f"{linear} and {experts} experts modules" if experts else linear
        lines = [f"recipe {self.recipe!r}: {done} converted, {len(self.skipped)} skipped"]
        lines += [f"  {name or '(the model)'}: {why}" for name, why in self.skipped.items()]
        if self.kept:
            share = self.kept_elements / max(self.total_elements, 1)
            lines.append(f"{len(self.kept)} parameters kept in high precision ({share:.1%} of the model's parameter "
                         "elements):")
            by_reason: dict = {}
            for name, why in self.kept.items():
                by_reason.setdefault(why, []).append(name)
            for why, names in by_reason.items():
                shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                lines.append(f"  {why}: {shown}")
        return "\n".join(lines)


def _kept_reason(module: torch.nn.Module, name: str, p: torch.Tensor, skipped_why: Optional[str]) -> str:
    """Why a parameter of ``module`` stays in its dtype (it is no converted layer's)."""
    kind = type(module).__name__
    if skipped_why is not None:
        what = "nn.Linear" if isinstance(module, torch.nn.Linear) else f"experts module ({kind})"
        return f"of a skipped {what} ({skipped_why})"
    if isinstance(module, torch.nn.Embedding):
        return "embedding table: looked up by row, not multiplied"
    if "router" in kind.lower() and p.dim() == 2:
        return (f"router weight of {kind} (experts x hidden): FP8 rounding of its logits could change the experts "
                f"a token picks, and its GEMM is small; kept in {str(p.dtype).replace('torch.', '')}")
    if p.dim() <= 1:
        return f"{p.dim()}-D parameter ({kind}: a norm's scale, a bias or a scalar): not a GEMM operand"
    if p.dim() == 3:
        how = " unless convert(..., experts=True)" if is_experts(module) else ""
        return (f"3-D weight of {kind} (experts x out x in): mixture-of-experts weights are not converted{how}; "
                f"they run in {str(p.dtype).replace('torch.', '')}")
    return f"{p.dim()}-D weight of {kind}, which is not an nn.Linear: not converted"


def _holders(model: torch.nn.Module) -> dict:
    """id(parameter) -> [(name, module)] for every module of ``model`` that holds it (two modules: tied)."""
    holders: dict = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((f"{module_name}.{name}" if module_name else name, module))
    return holders


def convert(model: torch.nn.Module, recipe: str = "row",
            filter: Optional[Callable[[str, torch.nn.Module], bool]] = None, *,
            experts: bool = True) -> ConversionReport:
    """Replace, in place, every ``nn.Linear`` of ``model`` for which ``filter(name, module)`` (default: all) is
    true by an :class:`QuantizedLinear` of ``recipe`` ("row", "deepseek", "tensor", "int8", "int8_weight", and the int4
    weight-only "int4_weight[_g32 | _g64][_zp]"; on Blackwell "tensor", "mxfp8", "nvfp4": ``recipes.LINEAR_RECIPES``),
    its weight quantized where it lives (the kernels on a GPU, their torch reference, the same bits, elsewhere).

    Skipped, with the reason in the report: layers whose shapes the kernels cannot take (the ops' own checks:
    e.g. K or N alignment, K not a multiple of an int4 recipe's group), subclasses of ``nn.Linear`` (their owners
    may read ``.weight``), layers whose weight is tied to another module's, and layers ``filter`` excludes.
    Refused: a recipe the GPU does not run (the current GPU, or the layer's), weights that are not bf16 / fp16 /
    fp32 or not materialized.
    ``filter=lambda name, m: name != "lm_head"`` keeps a language model's head in its dtype.

    With ``experts=True`` (the default) every transformers experts module (``gate_up_proj`` (E, 2I, H) and
    ``down_proj`` (E, H, I), see :mod:`cutedsl_gemm.nn.moe`) that ``filter`` passes is replaced by a
    :class:`QuantizedExperts` of ``recipe`` on the grouped FP8 GEMM, which takes per-tensor, row-wise and DeepSeek-V3
    block scales: recipes "row", "tensor" and "deepseek" (``moe.EXPERT_RECIPES``). Skipped, with the reason in
    ``skipped`` and their weights in ``kept``: experts under any other recipe ("int8", the weight-only ones, ...),
    experts whose gating, biases or activation it does not run, sizes the grouped GEMM does not take, weights tied
    to another module and modules ``filter`` excludes. Routers and shared experts are not experts modules: a router
    keeps its weight (a reason in ``kept``), shared experts are ``nn.Linear`` layers converted as such.
    ``experts=False`` keeps every experts module in its dtype, listed in ``kept``. Mixture-of-experts weights left in
    high precision, for whatever reason, raise a UserWarning.
    """
    r = linear_recipe(recipe)
    if type(model) is torch.nn.Linear:
        raise TypeError("convert replaces the layers inside a model; convert one nn.Linear with "
                        "QuantizedLinear.from_linear")
    report = ConversionReport(r.name)
    holders = _holders(model)
    checked: dict = {}  # layer shape and arch -> why it cannot run (or None)
    replacement: dict = {}  # id(nn.Linear) -> its QuantizedLinear
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if type(module) is not torch.nn.Linear:
            report.skipped[name] = (f"{type(module).__name__} subclasses nn.Linear and its owner may read .weight: "
                                    "only nn.Linear itself is converted")
            continue
        if filter is not None and not filter(name, module):
            report.skipped[name] = "excluded by filter"
            continue
        others = [n for n, holder in holders.get(id(module.weight), ()) if holder is not module]
        if others:
            report.skipped[name] = f"its weight is tied to {', '.join(others)}: quantizing it would untie them"
            continue
        check_linear(module)
        key = (module.out_features, module.in_features, module.weight.dtype, module.bias is not None,
               target_arch(r, module.weight.device))
        if key not in checked:
            checked[key] = unsupported(r, *key)
        if checked[key] is not None:
            report.skipped[name] = checked[key]
            continue
        replacement[id(module)] = QuantizedLinear.quantized(module, r)
        report.converted.append(name)
    if experts:
        _convert_experts(model, r, filter, holders, report, replacement)
    kept = _list_kept(model, report, replacement)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in replacement:
                setattr(parent, child_name, replacement[id(child)])
    if any(p.dim() == 3 for p in kept):
        if r.name not in EXPERT_RECIPES:
            hint = f"; the grouped FP8 GEMM quantizes experts with recipe {' or '.join(map(repr, EXPERT_RECIPES))}"
        else:
            hint = "" if experts else "; convert(..., experts=True), the default, quantizes them"
        warnings.warn(f"convert({report.recipe!r}) left mixture-of-experts weights in high precision ("
                      f"{report.kept_elements / max(report.total_elements, 1):.0%} of the model's parameter elements "
                      f"kept): print the ConversionReport for the list{hint}", UserWarning, stacklevel=2)
    return report


def shared_with(module: torch.nn.Module, holders: dict) -> list:
    """The other holders' names of ``module``'s parameters (``_holders``: tied weights), sorted; empty if none."""
    return sorted({n for p in module.parameters() for n, holder in holders.get(id(p), ()) if holder is not module})


def _convert_experts(model, r, filter, holders: dict, report: ConversionReport, replacement: dict) -> None:
    """Quantize the experts modules of ``model`` into ``replacement`` (id -> QuantizedExperts), or say in
    ``report.skipped`` why not."""
    for name, module in model.named_modules():
        if not is_experts(module):
            continue
        if filter is not None and not filter(name, module):
            report.skipped[name] = "excluded by filter"
            continue
        others = shared_with(module, holders)
        if others:
            report.skipped[name] = f"its weights are shared with {', '.join(others)}: quantizing them would untie them"
            continue
        check_experts(module)
        why = experts_unsupported(module, r)
        if why is not None:
            report.skipped[name] = why
            continue
        replacement[id(module)] = QuantizedExperts.quantized(module, r.name)
        report.converted.append(name)
        report.converted_experts.append(name)


def _list_kept(model: torch.nn.Module, report: ConversionReport, replacement: dict) -> list:
    """Fill ``report.kept`` with every parameter no converted layer takes, once each (tied ones under their first
    name), with ``_kept_reason``; those parameters."""
    skipped = {id(m): report.skipped[n] for n, m in model.named_modules() if n in report.skipped}
    seen: set = set()
    kept = []
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            report.total_elements += p.numel()
            if id(module) in replacement:
                continue
            name = f"{module_name}.{pname}" if module_name else pname
            report.kept[name] = _kept_reason(module, pname, p, skipped.get(id(module)))
            report.kept_elements += p.numel()
            kept.append(p)
    return kept
