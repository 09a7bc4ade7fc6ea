"""``fuse_gated_mlps``: a converted model's gated MLPs (``down(SiLU(gate(x)) * up(x))``, Llama / Mistral / Qwen) as
``QuantizedGatedMLP``: the gate and up projections one GEMM of 2I outputs, SiLU-and-multiply and the down
projection's quantizer one kernel (``silu_mul_quantize_fp8``), then the down GEMM: four kernels per MLP instead of
eight (two quantizers and two GEMMs for gate and up, SiLU, the product, the down projection's quantizer and GEMM).

The saved format does not change: ``state_dict`` gives ``gate_proj.*`` and ``up_proj.*`` (the fused buffers' two
halves, views of them) and ``down_proj.*`` as ``convert`` alone writes them, and ``load_state_dict`` takes that
form (or the fused one). ``save_pretrained`` copies the halves apart; a plain ``safetensors.save_file`` of the
state dict refuses them, as it refuses any two views of one storage. ``QuantizedGatedMLP.unfused()`` gives back the
three layers.
"""

from __future__ import annotations

import inspect
import re
from typing import Optional

import torch

from cutedsl_gemm.ops.gated import silu_mul_quantize_fp8
from cutedsl_gemm.ops.library import EAGER, OPS

from .linear import QuantizedLinear
from .moe import _is_silu
from .recipes import linear_recipe

#: The recipes whose activations ``silu_mul_quantize_fp8`` quantizes: per token, DeepSeek-V3's 1x128 groups.
GATED_RECIPES = {"row": "row", "deepseek": "1x128"}
#: The forward these MLPs compute (transformers' LlamaMLP, MistralMLP, Qwen2/3MLP, Qwen3MoeMLP, ...), whitespace
#: removed: a module of another forward is not fused, whatever its layers.
GATED_FORWARD = "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj"
_HALVES = ("gate_proj", "up_proj")
_SPLIT = ("weight", "weight_scale")  # the buffers cut in two along N; _extra_state is copied to both halves


def _forward_text(module: torch.nn.Module) -> str:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""
    body = source.split(":", 1)[1] if ":" in source else ""
    return re.sub(r"\s+", "", body)


def gated_mlp_unsupported(module: torch.nn.Module) -> Optional[str]:
    """Why ``module`` is not fused (None: it is): it must compute ``GATED_FORWARD`` with SiLU, and its three layers
    be bias-free ``QuantizedLinear`` of one recipe of ``GATED_RECIPES`` with matching sizes."""
    layers = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, QuantizedLinear) for m in layers):
        return "its gate_proj, up_proj and down_proj are not all QuantizedLinear (convert the model first)"
    gate, up, down = layers
    if _forward_text(module) != GATED_FORWARD:
        return f"{type(module).__name__}.forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    if not _is_silu(getattr(module, "act_fn", None)):
        return "its act_fn is not SiLU"
    recipes = {m.recipe for m in layers}
    if len(recipes) != 1 or gate.recipe not in GATED_RECIPES:
        return (f"its layers run recipe(s) {', '.join(sorted(map(repr, recipes)))}; the fused MLP takes "
                f"{' or '.join(map(repr, GATED_RECIPES))}")
    if any(m.bias is not None for m in layers):
        return "a layer has a bias"
    if any(getattr(m, "tp_shard", None) is not None for m in layers):
        return "its layers are tensor-parallel shards (the down projection's reduction runs in its forward hooks)"
    if any(m._forward_hooks or m._forward_pre_hooks for m in layers):
        return "a layer has forward hooks, which the fused MLP would not run"
    i = gate.out_features
    if (up.out_features, up.in_features, down.in_features) != (i, gate.in_features, i):
        return (f"sizes do not chain: gate {gate.out_features}x{gate.in_features}, up {up.out_features}x"
                f"{up.in_features}, down {down.out_features}x{down.in_features}")
    if gate.recipe == "deepseek" and i % 128:
        return f"intermediate size {i} is not a multiple of 128 (the 128x128 weight blocks of gate and up)"
    return None


class QuantizedGatedMLP(torch.nn.Module):
    """``down(SiLU(gate(x)) * up(x))`` of three ``QuantizedLinear`` of recipe "row" or "deepseek": ``gate_up_proj``
    (the two weights stacked, 2I outputs), ``silu_mul_quantize_fp8`` of its output (the activation rounded once to
    x's dtype, as the unfused MLP rounds ``act_fn(gate) * up``), ``scaled_mm`` with ``down_proj``'s weight. x (...,
    H) -> (..., H') in x's dtype, on a GPU (a CPU input is refused by the kernels). Built by ``fused`` /
    ``fuse_gated_mlps``; the state dict keeps the unfused keys (module docstring)."""

    def __init__(self, gate_up_proj: QuantizedLinear, down_proj: QuantizedLinear, intermediate_size: int):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.intermediate_size = gate_up_proj, down_proj, intermediate_size
        self.recipe = down_proj.recipe
        self._granularity = GATED_RECIPES[self.recipe]
        self.register_state_dict_post_hook(_split_state)
        self.register_load_state_dict_pre_hook(_join_state)

    @classmethod
    def fused(cls, module: torch.nn.Module) -> QuantizedGatedMLP:
        """The fused MLP of a converted gated MLP (``gated_mlp_unsupported`` says why not: ValueError). Its gate and
        up buffers are stacked into new ones (the module's own are left to the caller to drop)."""
        why = gated_mlp_unsupported(module)
        if why is not None:
            raise ValueError(f"this MLP cannot be fused: {why}")
        gate, up = module.gate_proj, module.up_proj
        i = gate.out_features
        gate_up = QuantizedLinear(gate.in_features, 2 * i, False, gate.recipe, device="meta")
        with torch.no_grad():
            for name in _SPLIT:
                a, b = getattr(gate, name), getattr(up, name)
                setattr(gate_up, name, torch.cat((a, b), dim=0 if name == "weight" else a.dim() - 1))
        return cls(gate_up, module.down_proj, i)

    def unfused(self) -> tuple:
        """(gate_proj, up_proj, down_proj): ``QuantizedLinear`` layers of the stacked buffers' halves (copies)."""
        out = []
        for half in range(2):
            layer = QuantizedLinear(self.gate_up_proj.in_features, self.intermediate_size, False, self.recipe,
                                    device="meta")
            for name in _SPLIT:
                setattr(layer, name, _half(getattr(self.gate_up_proj, name), name, half, self.intermediate_size,
                                           self.recipe).clone())
            out.append(layer)
        return (*out, self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, h = x.shape[:-1], self.gate_up_proj(x.reshape(-1, x.shape[-1]))
        q, s = silu_mul_quantize_fp8(h, self._granularity)
        down = self.down_proj
        r = linear_recipe(self.recipe)
        ops = OPS if torch.compiler.is_compiling() or not x.is_cuda else EAGER
        y = ops.scaled_mm(q, r.kernel_weight(down.weight), s, down.weight_scale, None, x.dtype,
                          scale_recipe_a=r.scaling.a.scaling_type, scale_recipe_b=r.scaling.b.scaling_type,
                          global_scale_a=None, global_scale_b=None)
        return y.view(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}, intermediate_size={self.intermediate_size}"


def _half(t: torch.Tensor, name: str, half: int, i: int, recipe: str) -> torch.Tensor:
    """Gate's (half 0) or up's (half 1) part of a stacked buffer: weight rows, or scale columns (per channel: I of
    them; DeepSeek's 128x128 blocks: I / 128)."""
    if name == "weight":
        return t[half * i:(half + 1) * i]
    cols = i if recipe == "row" else i // 128
    return t[..., half * cols:(half + 1) * cols]


def _split_state(module: QuantizedGatedMLP, state_dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: the stacked ``gate_up_proj.*`` as ``gate_proj.*`` and ``up_proj.*`` (views)."""
    fused = prefix + "gate_up_proj."
    tag = state_dict.pop(fused + "_extra_state", None)
    for name in _SPLIT:
        t = state_dict.pop(fused + name)
        for half, layer in enumerate(_HALVES):
            state_dict[f"{prefix}{layer}.{name}"] = _half(t, name, half, module.intermediate_size, module.recipe)
    for layer in _HALVES:
        if tag is not None:  # a tensor of its own each (one tensor under two names reads as a tied weight)
            state_dict[f"{prefix}{layer}._extra_state"] = tag.clone()


def _join_state(module: QuantizedGatedMLP, state_dict, prefix, local_metadata, strict, missing_keys,
                unexpected_keys, error_msgs):
    """load_state_dict pre-hook: ``gate_proj.*`` and ``up_proj.*`` stacked into ``gate_up_proj.*`` (a fused state
    dict loads as it is)."""
    keys = [f"{prefix}{layer}.{name}" for layer in _HALVES for name in _SPLIT]
    if not all(k in state_dict for k in keys):
        return
    fused = prefix + "gate_up_proj."
    tags = [state_dict.pop(f"{prefix}{layer}._extra_state", None) for layer in _HALVES]
    for name in _SPLIT:
        a, b = (state_dict.pop(f"{prefix}{layer}.{name}") for layer in _HALVES)
        state_dict[fused + name] = torch.cat((a, b), dim=0 if name == "weight" else a.dim() - 1)
    if tags[0] is not None:
        state_dict[fused + "_extra_state"] = tags[0]


def fuse_gated_mlps(model: torch.nn.Module) -> dict:
    """Replace, in place, every gated MLP of a converted ``model`` that ``gated_mlp_unsupported`` passes by its
    ``QuantizedGatedMLP``. Returns {name: None if fused, else why not} for every module holding a ``gate_proj``."""
    result, swaps = {}, []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedGatedMLP) or not hasattr(module, "gate_proj"):
            continue
        why = gated_mlp_unsupported(module)
        result[name] = why
        if why is None:
            swaps.append((name, QuantizedGatedMLP.fused(module)))
    for name, fused in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, fused)
    return result
