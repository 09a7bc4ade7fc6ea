"""``fuse_qkv``: an attention module's q, k and v projections of one input as one GEMM.

transformers' attention modules (Llama, Mistral, Qwen2/3, Qwen3-MoE, ...) call ``self.q_proj(hidden_states)``,
``self.k_proj(hidden_states)`` and ``self.v_proj(hidden_states)`` one after the other. After ``fuse_qkv`` the module
holds ``qkv_proj``, one ``QuantizedLinear`` with the three weights stacked (one activation quantizer and one GEMM
instead of three of each), and its ``q_proj`` / ``k_proj`` / ``v_proj`` are :class:`QKVSlice` stand-ins: the first
call with an input runs ``qkv_proj`` on it and each returns its columns of that output (a view). A call with another
input runs ``qkv_proj`` again, so the result is right whatever the module's forward does; a forward that calls them
in the usual way runs one GEMM.

The saved format does not change: the module's state dict gives ``q_proj.*``, ``k_proj.*`` and ``v_proj.*`` (views
of the stacked buffers' parts) and loads them. Tensor parallelism takes the unfused layers.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from .linear import QuantizedLinear

#: The recipes whose weight scales stack along N: per channel and DeepSeek's 128x128 blocks.
QKV_RECIPES = ("row", "deepseek")
PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_STACKED = ("weight", "weight_scale", "bias")


class _SharedOutput:
    """The last input the slices saw and ``qkv_proj``'s output for it, dropped once each slice has taken its part."""

    __slots__ = ("qkv", "x", "out", "left")

    def __init__(self, qkv: QuantizedLinear):
        self.qkv, self.x, self.out, self.left = qkv, None, None, 0

    def part(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        if self.x is not x or self.left == 0:
            self.x, self.out, self.left = x, self.qkv(x), len(PROJECTIONS)
        out = self.out[..., lo:hi]
        self.left -= 1
        if self.left == 0:
            self.x = self.out = None
        return out


class QKVSlice(torch.nn.Module):
    """One of q / k / v after ``fuse_qkv``: columns ``lo:hi`` of the stacked projection's output for its input (no
    buffers of its own)."""

    def __init__(self, shared: _SharedOutput, lo: int, hi: int, in_features: int):
        super().__init__()
        self.lo, self.hi, self.in_features, self.out_features = lo, hi, in_features, hi - lo
        self._shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared.part(x, self.lo, self.hi)

    def extra_repr(self) -> str:
        return f"columns {self.lo}:{self.hi} of qkv_proj"


def _calls_each_once(module: torch.nn.Module) -> bool:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return all(source.count(f"self.{p}(hidden_states)") == 1 for p in PROJECTIONS)


def qkv_unsupported(module: torch.nn.Module) -> Optional[str]:
    """Why ``module``'s q / k / v are not fused (None: they are)."""
    layers = [getattr(module, p, None) for p in PROJECTIONS]
    if not all(type(m) is QuantizedLinear for m in layers):
        return "its q_proj, k_proj and v_proj are not all QuantizedLinear (convert the model first)"
    if not _calls_each_once(module):
        return f"{type(module).__name__}.forward does not call q_proj, k_proj and v_proj on hidden_states once each"
    recipes = {m.recipe for m in layers}
    if len(recipes) != 1 or layers[0].recipe not in QKV_RECIPES:
        return (f"its projections run recipe(s) {', '.join(sorted(map(repr, recipes)))}; stacking takes "
                f"{' or '.join(map(repr, QKV_RECIPES))}")
    if len({m.in_features for m in layers}) != 1:
        return "the projections take inputs of different sizes"
    if len({m.bias is None for m in layers}) != 1:
        return "some projections have a bias and some not"
    if layers[0].recipe == "deepseek" and any(m.out_features % 128 for m in layers):
        return "an output size is not a multiple of 128 (the 128x128 weight blocks)"
    if any(getattr(m, "tp_shard", None) is not None for m in layers):
        return "its projections are tensor-parallel shards"
    if any(m._forward_hooks or m._forward_pre_hooks for m in layers):
        return "a projection has forward hooks, which the stacked GEMM would not run"
    return None


def _cut(t: torch.Tensor, name: str, lo: int, hi: int, recipe: str) -> torch.Tensor:
    """The part of a stacked buffer for output columns lo:hi (weight rows, bias entries, scale columns)."""
    if name in ("weight", "bias"):
        return t[lo:hi]
    if recipe == "deepseek":
        lo, hi = lo // 128, hi // 128
    return t[..., lo:hi]


def _stack(parts: list, name: str) -> torch.Tensor:
    return torch.cat(parts, dim=0 if name in ("weight", "bias") else parts[0].dim() - 1)


def _bounds(sizes) -> list:
    edges = [0]
    for n in sizes:
        edges.append(edges[-1] + n)
    return list(zip(edges[:-1], edges[1:]))


def _fuse_one(module: torch.nn.Module) -> None:
    layers = [getattr(module, p) for p in PROJECTIONS]
    first = layers[0]
    bounds = _bounds(m.out_features for m in layers)
    qkv = QuantizedLinear(first.in_features, bounds[-1][1], first.bias is not None, first.recipe, device="meta")
    with torch.no_grad():
        for name in _STACKED:
            if getattr(first, name) is not None:
                setattr(qkv, name, _stack([getattr(m, name) for m in layers], name))
    shared = _SharedOutput(qkv)
    module.qkv_proj = qkv
    for p, (lo, hi) in zip(PROJECTIONS, bounds):
        setattr(module, p, QKVSlice(shared, lo, hi, first.in_features))
    module._qkv_bounds = bounds
    module.register_state_dict_post_hook(_split_state)
    module.register_load_state_dict_pre_hook(_join_state)


def _split_state(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: ``qkv_proj.*`` as ``q_proj.*``, ``k_proj.*``, ``v_proj.*`` (views)."""
    fused = prefix + "qkv_proj."
    tag = state_dict.pop(fused + "_extra_state", None)
    recipe = module.qkv_proj.recipe
    for name in _STACKED:
        t = state_dict.pop(fused + name, None)
        if t is None:
            continue
        for p, (lo, hi) in zip(PROJECTIONS, module._qkv_bounds):
            state_dict[f"{prefix}{p}.{name}"] = _cut(t, name, lo, hi, recipe)
    if tag is not None:
        for p in PROJECTIONS:  # a tensor of its own each (one tensor under three names reads as a tied weight)
            state_dict[f"{prefix}{p}._extra_state"] = tag.clone()


def _join_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """load_state_dict pre-hook: ``q_proj.*``, ``k_proj.*``, ``v_proj.*`` stacked into ``qkv_proj.*``."""
    if not all(f"{prefix}{p}.weight" in state_dict for p in PROJECTIONS):
        return
    fused = prefix + "qkv_proj."
    tags = [state_dict.pop(f"{prefix}{p}._extra_state", None) for p in PROJECTIONS]
    for name in _STACKED:
        keys = [f"{prefix}{p}.{name}" for p in PROJECTIONS]
        if all(k in state_dict for k in keys):
            state_dict[fused + name] = _stack([state_dict.pop(k) for k in keys], name)
    if tags[0] is not None:
        state_dict[fused + "_extra_state"] = tags[0]


def fuse_qkv(model: torch.nn.Module) -> dict:
    """Stack, in place, the q / k / v projections of every attention module of a converted ``model`` that
    ``qkv_unsupported`` passes. Returns {name: None if fused, else why not} for every module holding a ``q_proj``
    (already fused ones are left as they are)."""
    result = {name: qkv_unsupported(module) for name, module in model.named_modules()
              if hasattr(module, "q_proj") and not isinstance(module.q_proj, QKVSlice)}
    for name, why in result.items():
        if why is None:
            _fuse_one(model.get_submodule(name))
    return result


def fuse(model: torch.nn.Module) -> dict:
    """``fuse_qkv`` and ``fuse_gated_mlps`` on a converted ``model``: {module name: None if fused, else why not}."""
    from .gated_mlp import fuse_gated_mlps

    return {**fuse_qkv(model), **fuse_gated_mlps(model)}
