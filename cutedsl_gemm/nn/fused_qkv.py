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

from typing import Optional

import torch

from .linear import QuantizedLinear
from .stacked import bounds, forward_source, keep_saved_parts, stack, stacking_unsupported

PROJECTIONS = ("q_proj", "k_proj", "v_proj")


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


def qkv_unsupported(module: torch.nn.Module) -> Optional[str]:
    """Why ``module``'s q / k / v are not fused (None: they are)."""
    layers = [getattr(module, p, None) for p in PROJECTIONS]
    if not all(type(m) is QuantizedLinear for m in layers):
        return "its q_proj, k_proj and v_proj are not all QuantizedLinear (convert the model first)"
    source = forward_source(module)
    if not all(source.count(f"self.{p}(hidden_states)") == 1 for p in PROJECTIONS):
        return f"{type(module).__name__}.forward does not call q_proj, k_proj and v_proj on hidden_states once each"
    return stacking_unsupported(layers)


def _fuse_one(module: torch.nn.Module) -> None:
    layers = [getattr(module, p) for p in PROJECTIONS]
    columns = bounds(layers)
    module.qkv_proj = stack(layers)
    shared = _SharedOutput(module.qkv_proj)
    for p, (lo, hi) in zip(PROJECTIONS, columns):
        setattr(module, p, QKVSlice(shared, lo, hi, layers[0].in_features))
    keep_saved_parts(module, "qkv_proj", PROJECTIONS, columns)


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
