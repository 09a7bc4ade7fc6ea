"""Layers of one input stacked into one ``QuantizedLinear`` along N (``nn.fuse``: attention's q / k / v, a gated MLP's
gate and up): when they can be (``stacking_unsupported``), the stacked layer (``stack``), each layer's part of a
stacked buffer (``part``), and the state-dict hooks that keep the layers' own saved format (``keep_saved_parts``):
``state_dict`` gives each layer's buffers (views of the stacked ones' parts, each its own copy of the format tag) and
``load_state_dict`` stacks them back (a stacked state dict loads as it is)."""

from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch

from .linear import QuantizedLinear

#: The recipes whose weight scales stack along N: per channel and DeepSeek's 128x128 blocks.
STACKABLE_RECIPES = ("row", "deepseek")
_BUFFERS = ("weight", "weight_scale", "bias")  # stacked along N; _extra_state (the format tag) is each layer's copy


def forward_source(module: torch.nn.Module) -> str:
    """The source of ``type(module).forward`` ("" where it cannot be read)."""
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def stacking_unsupported(stacked: Sequence[QuantizedLinear], others: Sequence[QuantizedLinear] = ()) -> Optional[str]:
    """Why the layers ``stacked`` cannot become one GEMM beside the layers ``others`` that the same fused module runs
    (None: they can): one recipe of ``STACKABLE_RECIPES`` for all, no tensor-parallel shards, no forward hooks (the
    fused module does not call the layers); the stacked ones of one input size, all with a bias or none, and for
    DeepSeek's blocks whole 128-row blocks each."""
    layers = [*stacked, *others]
    recipes = {m.recipe for m in layers}
    if len(recipes) != 1 or layers[0].recipe not in STACKABLE_RECIPES:
        return (f"its layers run recipe(s) {', '.join(sorted(map(repr, recipes)))}; stacking takes "
                f"{' or '.join(map(repr, STACKABLE_RECIPES))}")
    if any(getattr(m, "tp_shard", None) is not None for m in layers):
        return "its layers are tensor-parallel shards"
    if any(m._forward_hooks or m._forward_pre_hooks for m in layers):
        return "a layer has forward hooks, which the stacked GEMM would not run"
    if len({m.in_features for m in stacked}) != 1:
        return "the layers to stack take inputs of different sizes"
    if len({m.bias is None for m in stacked}) != 1:
        return "some layers to stack have a bias and some not"
    if stacked[0].recipe == "deepseek" and any(m.out_features % 128 for m in stacked):
        return "an output size is not a multiple of 128 (the 128x128 weight blocks)"
    return None


def bounds(layers: Sequence[QuantizedLinear]) -> list:
    """[(lo, hi)]: each layer's output columns in the stacked layer."""
    edges = [0]
    for m in layers:
        edges.append(edges[-1] + m.out_features)
    return list(zip(edges[:-1], edges[1:]))


def _cat(parts: list, name: str) -> torch.Tensor:
    return torch.cat(parts, dim=0 if name in ("weight", "bias") else parts[0].dim() - 1)


def stack(layers: Sequence[QuantizedLinear]) -> QuantizedLinear:
    """One ``QuantizedLinear`` of the layers' weights, scales and biases stacked along N (new buffers)."""
    first = layers[0]
    out = QuantizedLinear(first.in_features, bounds(layers)[-1][1], first.bias is not None, first.recipe,
                          device="meta")
    with torch.no_grad():
        for name in _BUFFERS:
            if getattr(first, name) is not None:
                setattr(out, name, _cat([getattr(m, name) for m in layers], name))
    return out


def part(t: torch.Tensor, name: str, lo: int, hi: int, recipe: str) -> torch.Tensor:
    """The part of stacked buffer ``name`` for output columns lo:hi: weight rows, bias entries, scale columns (per
    channel one each; DeepSeek's 128x128 blocks one per 128)."""
    if name in ("weight", "bias"):
        return t[lo:hi]
    if recipe == "deepseek":
        lo, hi = lo // 128, hi // 128
    return t[..., lo:hi]


def keep_saved_parts(module: torch.nn.Module, stacked: str, names: Sequence[str], columns: list) -> None:
    """Hooks on ``module`` so that its stacked child ``stacked`` saves and loads as its layers ``names`` (output
    columns ``columns``, as ``bounds`` gives them)."""

    def split(module, state_dict, prefix, local_metadata) -> None:
        fused = f"{prefix}{stacked}."
        tag = state_dict.pop(fused + "_extra_state", None)
        recipe = getattr(module, stacked).recipe
        for name in _BUFFERS:
            t = state_dict.pop(fused + name, None)
            if t is None:
                continue
            for layer, (lo, hi) in zip(names, columns):
                state_dict[f"{prefix}{layer}.{name}"] = part(t, name, lo, hi, recipe)
        if tag is not None:
            for layer in names:  # a tensor of its own each (one tensor under two names reads as a tied weight)
                state_dict[f"{prefix}{layer}._extra_state"] = tag.clone()

    def join(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        if not all(f"{prefix}{layer}.weight" in state_dict for layer in names):
            return
        fused = f"{prefix}{stacked}."
        tags = [state_dict.pop(f"{prefix}{layer}._extra_state", None) for layer in names]
        for name in _BUFFERS:
            keys = [f"{prefix}{layer}.{name}" for layer in names]
            if all(k in state_dict for k in keys):
                state_dict[fused + name] = _cat([state_dict.pop(k) for k in keys], name)
        if tags[0] is not None:
            state_dict[fused + "_extra_state"] = tags[0]

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(join)
