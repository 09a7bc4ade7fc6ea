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

import re
from typing import Optional

import torch

from cutedsl_gemm.ops.gated import silu_mul_quantize_fp8
from cutedsl_gemm.ops.library import EAGER, OPS

from .linear import QuantizedLinear
from .moe import _is_silu
from .recipes import linear_recipe
from .stacked import forward_source, keep_saved_parts, part, stack, stacking_unsupported

#: The activations' granularity ``silu_mul_quantize_fp8`` quantizes for each recipe whose gate and up stack
#: (``stacked.STACKABLE_RECIPES``): per token, DeepSeek-V3's 1x128 groups.
GATED_RECIPES = {"row": "row", "deepseek": "1x128"}
#: The forward these MLPs compute (transformers' LlamaMLP, MistralMLP, Qwen2/3MLP, Qwen3MoeMLP, ...), whitespace
#: removed: a module of another forward is not fused, whatever its layers.
GATED_FORWARD = "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj"
_HALVES = ("gate_proj", "up_proj")


def gated_mlp_unsupported(module: torch.nn.Module) -> Optional[str]:
    """Why ``module`` is not fused (None: it is): it must compute ``GATED_FORWARD`` with SiLU, and its three layers
    be bias-free ``QuantizedLinear`` with matching sizes whose gate and up stack (``stacked.stacking_unsupported``)."""
    layers = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, QuantizedLinear) for m in layers):
        return "its gate_proj, up_proj and down_proj are not all QuantizedLinear (convert the model first)"
    gate, up, down = layers
    source = forward_source(module)
    body = source.split(":", 1)[1] if ":" in source else ""
    if re.sub(r"\s+", "", body) != GATED_FORWARD:
        return f"{type(module).__name__}.forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    if not _is_silu(getattr(module, "act_fn", None)):
        return "its act_fn is not SiLU"
    if any(m.bias is not None for m in layers):
        return "a layer has a bias"
    i = gate.out_features
    if (up.out_features, up.in_features, down.in_features) != (i, gate.in_features, i):
        return (f"sizes do not chain: gate {gate.out_features}x{gate.in_features}, up {up.out_features}x"
                f"{up.in_features}, down {down.out_features}x{down.in_features}")
    return stacking_unsupported([gate, up], [down])


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
        keep_saved_parts(self, "gate_up_proj", _HALVES, [(0, intermediate_size), (intermediate_size,
                                                                              2 * intermediate_size)])

    @classmethod
    def fused(cls, module: torch.nn.Module) -> QuantizedGatedMLP:
        """The fused MLP of a converted gated MLP (``gated_mlp_unsupported`` says why not: ValueError). Its gate and
        up buffers are stacked into new ones (the module's own are left to the caller to drop)."""
        why = gated_mlp_unsupported(module)
        if why is not None:
            raise ValueError(f"this MLP cannot be fused: {why}")
        return cls(stack([module.gate_proj, module.up_proj]), module.down_proj, module.gate_proj.out_features)

    def unfused(self) -> tuple:
        """(gate_proj, up_proj, down_proj): ``QuantizedLinear`` layers of the stacked buffers' halves (copies)."""
        out = []
        for half in range(2):
            layer = QuantizedLinear(self.gate_up_proj.in_features, self.intermediate_size, False, self.recipe,
                                    device="meta")
            lo, hi = half * self.intermediate_size, (half + 1) * self.intermediate_size
            for name in ("weight", "weight_scale"):
                setattr(layer, name, part(getattr(self.gate_up_proj, name), name, lo, hi, self.recipe).clone())
            out.append(layer)
        return (*out, self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, h = x.shape[:-1], self.gate_up_proj(x.reshape(-1, x.shape[-1]))
        q, s = silu_mul_quantize_fp8(h, self._granularity)
        down = self.down_proj
        if torch.compiler.is_compiling() or not x.is_cuda:
            ops, r = OPS, linear_recipe(self.recipe)
            b, sb = r.kernel_weight(down.weight), down.weight_scale
        else:  # the down layer's kept eager operands (dropped when its buffers change)
            ops, (b, sb, _, _, _, r) = EAGER, down._eager or down._eager_operands()
        y = ops.scaled_mm(q, b, s, sb, None, x.dtype, scale_recipe_a=r.scaling.a.scaling_type,
                          scale_recipe_b=r.scaling.b.scaling_type, global_scale_a=None, global_scale_b=None)
        return y.view(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}, intermediate_size={self.intermediate_size}"


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
