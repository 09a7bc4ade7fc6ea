"""Mixture-of-experts weights for ``from_pretrained``: each transformers experts module of the model
(``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I), see :mod:`cutedsl_gemm.nn.moe`) filled from the checkpoint,
whose tensors are stored either fused under the module's own names or per expert as linear layers, the layout of the
hub's MoE checkpoints that transformers fuses while loading: ``{experts}.{j}.gate_proj / up_proj / down_proj.weight``
(DeepSeek-V3, Qwen3-MoE), Mixtral's ``w1 / w3 / w2`` (its ``block_sparse_moe`` renamed ``mlp`` as transformers
renames it: ``checkpoint_format.renamer``).

* FP8 per-expert weights (the checkpoint's format quantizes them) are adopted bit for bit as a ``QuantizedExperts``
  of the format's recipe where the layout maps exactly: "deepseek" (128x128 blocks: gate and up rows meet at a block
  boundary, I a multiple of 128), "row" (per channel), "tensor" (gate and up of one expert under one scale).
  Otherwise they are dequantized to ``dtype`` and kept, with the reason.
* An unquantized checkpoint's experts are quantized while loading, one module at a time: the same bits as
  ``convert`` on the model loaded whole.
* Experts ``QuantizedExperts`` cannot run (``moe.experts_unsupported``), excluded by ``filter``, or stored in high
  precision in an FP8 checkpoint load in ``dtype``, listed in the report with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .checkpoint_format import FP8_DTYPES, dequantized, kernel_scale, read_scale
from .convert import shared_with
from .moe import EXPERT_ARCHS, QuantizedExperts, _layout, experts_unsupported, is_experts

#: Per-expert projection names in checkpoints: (gate, up, down).
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
BLOCK = 128  # the "deepseek" recipe's weight block


@dataclass
class ExpertsSource:
    """An experts module and where its weights are in the checkpoint: ``fused`` (``{path}.gate_up_proj`` and
    ``{path}.down_proj`` in the module's own layout) or per expert (``weights[j]`` = the (gate, up, down) weight keys
    of expert j); ``fp8``: the per-expert weights are FP8."""

    name: str
    module: torch.nn.Module
    fused: bool
    weights: list
    fp8: bool = False

    @property
    def shape(self) -> tuple:
        """(E, H, I, transposed)"""
        return _layout(self.module)

    def keys(self, scale_key: Optional[str]) -> list:
        """Every checkpoint key this module reads."""
        if self.fused:
            return list(self.weights)
        keys = [k for ws in self.weights for k in ws]
        if self.fp8 and scale_key is not None:
            keys += [_scale_key(k, scale_key) for k in keys]
        return keys


def _scale_key(weight_key: str, scale_key: str) -> str:
    return weight_key[: -len("weight")] + scale_key


def find_experts(model, ckpt) -> list:
    """The ``ExpertsSource`` of every experts module of ``model``; ValueError naming what is missing when the
    checkpoint holds neither layout of a module's weights."""
    found = []
    for name, module in model.named_modules():
        if not is_experts(module):
            continue
        e = module.gate_up_proj.shape[0]
        fused = [f"{name}.gate_up_proj", f"{name}.down_proj"]
        if all(k in ckpt for k in fused):
            found.append(ExpertsSource(name, module, True, fused))
            continue
        source = None
        for names in EXPERT_NAMES:
            weights = [[f"{name}.{j}.{p}.weight" for p in names] for j in range(e)]
            if all(k in ckpt for ws in weights for k in ws):
                fp8 = [ckpt.dtype(k) in FP8_DTYPES for ws in weights for k in ws]
                if any(fp8) and not all(fp8):
                    raise ValueError(f"{name}: some expert weights are FP8 in the checkpoint and others not; "
                                     "expected one dtype")
                source = ExpertsSource(name, module, False, weights, all(fp8))
                break
        if source is None:
            raise ValueError(f"the checkpoint has no weights for the experts module {name} ({type(module).__name__}, "
                             f"{e} experts): expected {fused[0]} and {fused[1]}, or per expert "
                             f"{name}.<j>.gate_proj / up_proj / down_proj.weight (or w1 / w3 / w2)")
        found.append(source)
    return found


def plan(sources: list, ckpt, fmt, r, arch, filter, holders) -> tuple:
    """(sources to convert, skipped: name -> why, names of FP8 experts to dequantize)."""
    take, skipped, dequantize = [], {}, set()
    for src in sources:
        name, module = src.name, src.module
        others = shared_with(module, holders)
        if others:
            why = f"its weights are shared with {', '.join(others)}: quantizing them would untie them"
        elif fmt is not None and not src.fp8:
            why = "stored unquantized in the checkpoint"
        elif filter is not None and not filter(name, module):
            why = "excluded by filter"
        else:
            why = experts_unsupported(module, r)
            if why is None and arch is not None and arch not in EXPERT_ARCHS:
                why = f"the grouped FP8 GEMM runs on {' and '.join(EXPERT_ARCHS)}, not on {arch}"
            if why is None and src.fp8:
                why = _not_adoptable(src, ckpt, fmt)
        if why is None:
            take.append(src)
            continue
        if src.fp8:
            dequantize.add(name)
            why = f"{why}; dequantized from the checkpoint's FP8"
        skipped[name] = why
    return take, skipped, dequantize


def _not_adoptable(src: ExpertsSource, ckpt, fmt) -> Optional[str]:
    """Why the FP8 experts cannot be taken as stored, or None."""
    _, _, i, _ = src.shape
    if fmt.input_scale_key is not None:
        return "static activation scales: QuantizedExperts computes its activation scales on every call"
    if fmt.recipe == "deepseek" and i % BLOCK:
        return (f"intermediate={i} is no multiple of {BLOCK}: the gate's and the up projection's 128x128 blocks do "
                "not join into the fused gate_up blocks")
    for j, (gate, up, _) in enumerate(src.weights):
        keys = [_scale_key(k, fmt.scale_key) for k in (gate, up)]
        missing = [k for k in keys if k not in ckpt]
        if missing:
            raise ValueError(f"{gate} is FP8 in the checkpoint and {missing[0]} is absent")
        if fmt.recipe == "tensor" and not torch.equal(*(read_scale(ckpt, k, fmt).float().reshape(-1) for k in keys)):
            return (f"expert {j}'s gate and up weights have different per-tensor scales, and the fused gate_up weight "
                    "takes one")
    return None


def _expert_tensor(ckpt, key: str, fmt, dtype, device, adopt: bool) -> tuple:
    """(codes, kernel-layout scale) of an FP8 weight (``adopt``), or the weight in ``dtype``: as stored, or
    dequantized from FP8 (codes x scales in fp32)."""
    w = ckpt.get(key)
    if ckpt.dtype(key) not in FP8_DTYPES:
        return w.to(device, dtype), None
    skey = _scale_key(key, fmt.scale_key)
    if skey not in ckpt:
        raise ValueError(f"{key} is FP8 in the checkpoint and {skey} is absent")
    s = read_scale(ckpt, skey, fmt)
    if not adopt:
        return dequantized(w, s, fmt.recipe, skey).to(device, dtype), None
    n, k = w.shape
    return w.to(device), kernel_scale(fmt.recipe, s, n, k, skey).to(device)


def _check_shapes(src: ExpertsSource, j: int, gate, up, down) -> None:
    _, h, i, _ = src.shape
    for what, t, want in (("gate", gate, (i, h)), ("up", up, (i, h)), ("down", down, (h, i))):
        if tuple(t.shape) != want:
            raise ValueError(f"{src.name}: expert {j}'s {what} weight is {tuple(t.shape)} in the checkpoint, the "
                             f"model's is {want}")


def _high_precision(ckpt, src: ExpertsSource, fmt, dtype, device) -> tuple:
    """(gate_up_proj, down_proj) in the module's layout and ``dtype``: as stored (fused), or per expert joined as
    transformers joins them ([gate; up] rows), FP8 ones dequantized."""
    e, _, _, transposed = src.shape
    if src.fused:
        out = []
        for key, p in zip(src.weights, (src.module.gate_up_proj, src.module.down_proj)):
            t = ckpt.get(key)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{key}: shape {tuple(t.shape)} in the checkpoint, {tuple(p.shape)} in the model")
            if t.element_size() == 1 and t.dtype.is_floating_point:
                raise ValueError(f"{key} is {t.dtype} in the checkpoint: fused experts are taken in high precision")
            out.append(t.to(device, dtype))
        return tuple(out)
    gate_up = down = None
    for j, keys in enumerate(src.weights):
        gate, up, dn = (_expert_tensor(ckpt, k, fmt, dtype, device, adopt=False)[0] for k in keys)
        _check_shapes(src, j, gate, up, dn)
        gu = torch.cat([gate, up])
        gu, dn = (gu.t(), dn.t()) if transposed else (gu, dn)
        if gate_up is None:
            gate_up = torch.empty((e, *gu.shape), dtype=dtype, device=device)
            down = torch.empty((e, *dn.shape), dtype=dtype, device=device)
        gate_up[j].copy_(gu)
        down[j].copy_(dn)
    return gate_up, down


def _adopted(ckpt, src: ExpertsSource, fmt, device) -> QuantizedExperts:
    """The FP8 experts as stored: [gate; up] codes and their scales joined per expert, in QuantizedExperts' layout
    (``moe._scale_shape``)."""
    e, h, i, _ = src.shape
    layer = QuantizedExperts(e, h, i, fmt.recipe, device=device)
    with torch.no_grad():
        for j, keys in enumerate(src.weights):
            (gq, gs), (uq, us), (dq, ds) = (_expert_tensor(ckpt, k, fmt, None, device, adopt=True) for k in keys)
            _check_shapes(src, j, gq, uq, dq)
            if fmt.recipe == "tensor":  # one scale for both (plan checked they are equal)
                gate_up_scale = gs.reshape(())
            else:  # (1, N) per channel, (Kb, Nb) blocks: joined along N
                gate_up_scale = torch.cat([gs, us], dim=-1)
            layer.gate_up_proj[j].copy_(torch.cat([gq, uq]))
            layer.gate_up_proj_scale[j].copy_(gate_up_scale)
            layer.down_proj[j].copy_(dq)
            layer.down_proj_scale[j].copy_(ds.reshape(layer.down_proj_scale[j].shape))
    return layer


def fill(ckpt, src: ExpertsSource, fmt, r, device, dtype, convert: bool) -> Optional[QuantizedExperts]:
    """A ``QuantizedExperts`` of ``src`` (``convert``): adopted from FP8, or quantized from its high-precision
    weights (only this module's in memory); else None, the module's own parameters filled in ``dtype``."""
    if convert and src.fp8:
        return _adopted(ckpt, src, fmt, device)
    gate_up, down = _high_precision(ckpt, src, fmt, dtype, device)
    module = src.module
    module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    module.down_proj = torch.nn.Parameter(down, requires_grad=False)
    if not convert:
        return None
    layer = QuantizedExperts.quantized(module, r.name)
    module.gate_up_proj = module.down_proj = None  # the high-precision weights go with the replaced module
    return layer
