"""Mixture-of-experts layers on the grouped FP8 GEMM: the routing glue (``permute``, ``combine``, ``to_masked``,
``combine_masked``) and ``QuantizedExperts``, which replaces a transformers experts module.

transformers 5's experts modules (``MixtralExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts``, ...) hold two 3-D
parameters, ``gate_up_proj`` (E, 2I, H) (rows ``:I`` the gate, ``I:`` the up projection: ``chunk(2, dim=-1)``)
and ``down_proj`` (E, H, I), row-major per expert like ``nn.Linear.weight``, and are called by their MoE block as
``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`` after the router. The class
decorator ``transformers.integrations.moe.use_experts_implementation`` routes that call through
``ALL_EXPERTS_FUNCTIONS[config._experts_implementation]`` ("eager", "grouped_mm", "batched_mm", ...), a function
called with the original module as ``self``, and sets the layout flags ``has_gate``, ``has_bias``,
``is_transposed``, ``is_concatenated`` and ``has_post_expert_norm`` on the instance.

``convert`` replaces the module instead of registering an implementation in that interface: the choice there is
one name per config, all experts modules or none, while each module here is converted or kept (with its reason) on
its own; the module the interface calls would still hold bf16 ``gate_up_proj`` / ``down_proj`` parameters that
transformers' loaders and ``_init_weights`` treat as such, where ``QuantizedExperts`` holds FP8 buffers and their
scales in a saved format of its own (``_extra_state`` tagged like ``QuantizedLinear``'s). The forward signature is
the experts module's, so the MoE blocks (``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``,
``DeepseekV3MoE``) call it unchanged.

The routing glue runs on the device with no host synchronisation (no ``.item()``, ``.tolist()``, ``nonzero`` or
boolean-mask indexing; every shape follows from the inputs' shapes), so a forward can be captured in a CUDA graph,
and it is deterministic: the pairs are ordered by a stable sort, the group boundaries found by ``searchsorted`` and
the outputs summed over the top-k slots by one fp32 reduction (no atomics, no ``index_add_``). ``QuantizedExperts``
applies each pair's routing weight before the down projection (in the gated activation: the projection is linear),
so its combine only adds each token's k rows (``ops.moe_route.sum_routed_pairs`` at ``pair_rows`` or the masked
``slot``: one kernel that gathers them, where weighting after the GEMM takes k + 2). Expert ids must lie in
``[0, num_experts)`` (the routers' ``topk`` gives that; expert-parallel sentinels are not taken).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import ceil_div
from cutedsl_gemm.ops.gated import silu_mul_quantize_fp8
from cutedsl_gemm.ops.library import EAGER
from cutedsl_gemm.ops.moe_route import (
    pair_rows,
    route_pairs,
    route_quantize_fp8,
    routes_by_kernel,
    sort_pairs,
    sum_routed_pairs,
)
from cutedsl_gemm.ops.quantize import quantize_fp8
from cutedsl_gemm.runtime.device import device_info

from .linear import WEIGHT_DTYPES, FormatTagged
from .recipes import linear_recipe

#: The recipes the grouped FP8 GEMM runs (activations x weights): per token x per output channel, per tensor x per
#: expert, DeepSeek-V3's 1x128 groups x 128x128 blocks.
EXPERT_RECIPES = ("row", "tensor", "deepseek")
#: The activations' granularity of each recipe (``quantize_fp8``'s names).
ACTIVATION_GRANULARITY = {"row": "row", "tensor": "tensor", "deepseek": "1x128"}
#: Why a recipe outside ``EXPERT_RECIPES`` has no experts module (one line, after the recipe's name).
_SCALES = ("the grouped FP8 GEMM takes per-tensor, row-wise and DeepSeek-V3 block scales (QuantizedExperts runs "
           + ", ".join(map(repr, EXPERT_RECIPES)) + ")")
#: The GPUs the grouped FP8 GEMM runs on.
EXPERT_ARCHS = ("sm_90a",)
#: The buffers a ``QuantizedExperts`` holds.
EXPERT_BUFFERS = ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale")
FP8 = torch.float8_e4m3fn


# --- routing glue ----------------------------------------------------------------------------------------------


def _check_routing(hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> tuple:
    """(T, k) after the checks on metadata (no values are read: that would synchronise)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (tokens, hidden), got shape {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids must be (tokens, k) = ({hidden.shape[0]}, k), got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64 expert ids, got {topk_ids.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    return tuple(topk_ids.shape)


def permute(hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> tuple:
    """The grouped GEMM's contiguous layout: ``(permuted_hidden (T*k, H), offs (E,) int32, order (T*k,) int64)``.
    Row r of ``permuted_hidden`` is token ``order[r] // k`` (its top-k slot ``order[r] % k``); the rows of expert e
    are ``offs[e-1]:offs[e]`` (cumulative end rows, as ``F.grouped_mm`` takes them; empty groups allowed), in token
    order. ``combine`` takes ``order`` back."""
    _, k = _check_routing(hidden, topk_ids, num_experts)
    sorted_ids, order, experts = sort_pairs(topk_ids, num_experts)
    ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return hidden.index_select(0, order // k), ends, order


# The combine's products in one (T, k, H) fp32 tensor up to this size (decode: few kernels matter most); above it
# slot by slot (prefill: no transient k times the output).
ONE_SHOT_PRODUCT_BYTES = 16 << 20


def _weighted_sum(rows: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_j rows[:, j] * w[:, j] over the top-k slots j = 0, 1, ... in that order, in fp32 -> ``dtype``.

    Each product is rounded to fp32 as the product of the fp32-converted row would be (a bf16 row is promoted
    exactly inside the multiply), the adds go in slot order and the last one rounds into ``dtype`` as it stores:
    the same bits as converting, multiplying and adding slot by slot, in k + 1 kernels (all products at once, up
    to ``ONE_SHOT_PRODUCT_BYTES``) or 2k (slot by slot) instead of 3k + 1."""
    t, k, h = rows.shape
    w = topk_weights.float()
    out = torch.empty(t, h, dtype=dtype, device=rows.device)
    if t * k * h * 4 <= ONE_SHOT_PRODUCT_BYTES:
        products = rows * w.unsqueeze(-1)
        product = lambda j: products[:, j]  # noqa: E731
    else:
        product = lambda j: rows[:, j] * w[:, j:j + 1]  # noqa: E731
    if k == 1:
        return out.copy_(product(0))
    acc = product(0)
    for j in range(1, k - 1):  # a fixed order: the same bits on every run and device
        acc = acc + product(j)
    return torch.add(acc, product(k - 1), out=out)


def _check_combine(topk_weights: torch.Tensor, num_tokens: int, pairs: int) -> None:
    if topk_weights.dim() != 2 or topk_weights.shape[0] != num_tokens:
        raise ValueError(f"topk_weights must be (num_tokens, k) = ({num_tokens}, k), got "
                         f"{tuple(topk_weights.shape)}")
    if topk_weights.numel() != pairs:
        raise ValueError(f"topk_weights holds {topk_weights.numel()} (token, k) pairs and the experts' output "
                         f"{pairs}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")


def combine(expert_out: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int,
            out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(T, H): ``sum_j topk_weights[t, j] * expert_out[row of pair (t, j)]``, ``expert_out`` (T*k, H) in
    ``permute``'s order. The permutation is inverted (a scatter of distinct indices) and the k rows of each token
    summed in slot order in fp32, then rounded to ``out_dtype`` (default: expert_out's)."""
    if expert_out.dim() != 2 or order.dim() != 1 or expert_out.shape[0] != order.shape[0]:
        raise ValueError(f"expert_out (T*k, H) and order (T*k,) must agree, got {tuple(expert_out.shape)} and "
                         f"{tuple(order.shape)}")
    _check_combine(topk_weights, num_tokens, order.shape[0])
    k = topk_weights.shape[1]
    if num_tokens == 0 or k == 0:
        return expert_out.new_zeros((num_tokens, expert_out.shape[1]), dtype=out_dtype or expert_out.dtype)
    rows = _token_major(expert_out, order).view(num_tokens, k, expert_out.shape[1])
    return _weighted_sum(rows, topk_weights, out_dtype or expert_out.dtype)


def _token_major(expert_out: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``expert_out`` (T*k, H) in ``permute``'s order back in token-major pair order: row ``order[r]`` is expert row
    r, one scatter of distinct rows (a permutation, exact). Eager, each row moves as the widest words its bytes and
    its offset divide into (torch's index_copy moves one element per thread: 8-byte words are ~3x faster than bf16
    ones); compiled, the graph's own kernels move it."""
    rows = torch.empty_like(expert_out)
    word = None if torch.compiler.is_compiling() or not expert_out.is_contiguous() else _widest_word(expert_out)
    if word is None:
        return rows.index_copy_(0, order, expert_out)
    rows.view(word).index_copy_(0, order, expert_out.view(word))
    return rows


def _widest_word(t: torch.Tensor) -> Optional[torch.dtype]:
    row_bytes, offset_bytes = t.shape[-1] * t.element_size(), t.storage_offset() * t.element_size()
    return next((w for w in (torch.int64, torch.int32, torch.int16) if row_bytes % w.itemsize == 0
                 and offset_bytes % w.itemsize == 0 and w.itemsize > t.element_size()), None)


def pair_weights(topk_weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(T*k,) fp32: the routing weight of each row of ``permute``'s layout (pair ``order[r]``), for weighting the
    rows before the down projection (``sum_routed_pairs`` then adds them up)."""
    return topk_weights.reshape(-1).float().index_select(0, order)


def to_masked(hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, capacity: int) -> tuple:
    """The grouped GEMM's masked layout (decode: a static shape for every routing): ``(masked (E, C, H),
    counts (E,) int32, slot (T*k,) int64, overflow (0-d bool))``, C = ``capacity`` (a Python int).

    Row c < counts[e] of ``masked[e]`` is the c-th pair routed to expert e, in token order; the other rows are
    zeros. ``slot[t * k + j]`` is the row ``e * C + c`` of ``masked.view(E * C, H)`` that pair (t, j) went to, for
    ``combine_masked``.

    Overflow, checked on the device without synchronising: an expert given more than C pairs keeps its first C
    (``counts`` is clamped to C), the rest get ``slot`` -1, ``overflow`` is true, and ``combine_masked`` makes the
    output of their tokens NaN, so that dropped pairs show rather than vanish (an id outside [0, E) likewise). The
    placement is ``ops.moe_route.route_pairs``'s, the routing kernels' own. Each token picks k distinct experts,
    so C = T never overflows; a smaller C bounds the E x C x H buffer."""
    t, k = _check_routing(hidden, topk_ids, num_experts)
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int (a static shape), got {capacity!r}")
    h, device = hidden.shape[1], hidden.device
    if t * k == 0:
        return (hidden.new_zeros((num_experts, capacity, h)),
                torch.zeros(num_experts, dtype=torch.int32, device=device),
                torch.empty(0, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.bool, device=device))
    pos, counts = route_pairs(topk_ids, num_experts, capacity)  # the routing kernels' placement, by torch
    slot = pos.view(-1).long()
    # each masked row's token and whether a pair holds it (the dropped pairs all land in an extra first row)
    rows = num_experts * capacity + 1
    token = torch.zeros(rows, dtype=torch.int64, device=device)
    token.index_copy_(0, slot + 1, torch.arange(t * k, device=device) // k)
    held = torch.zeros(rows, dtype=torch.bool, device=device).index_fill_(0, slot + 1, True)[1:]
    masked = hidden.index_select(0, token[1:]).masked_fill_(~held[:, None], 0).view(num_experts, capacity, h)
    return masked, counts, slot, (slot < 0).any()


def combine_masked(expert_out: torch.Tensor, slot: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(T, H) from the masked layout's output ``expert_out`` (E, C, H) and ``to_masked``'s ``slot``: the weighted
    sum over each token's k pairs in slot order, in fp32, then ``out_dtype`` (default: expert_out's). A token
    with a pair dropped by overflow (slot -1) gets NaN."""
    if expert_out.dim() != 3 or slot.dim() != 1:
        raise ValueError(f"expert_out must be (E, C, H) and slot (T*k,), got {tuple(expert_out.shape)} and "
                         f"{tuple(slot.shape)}")
    _check_combine(topk_weights, num_tokens, slot.shape[0])
    k = topk_weights.shape[1]
    if num_tokens == 0 or k == 0:
        return expert_out.new_zeros((num_tokens, expert_out.shape[2]), dtype=out_dtype or expert_out.dtype)
    # (bf16 rows are promoted exactly inside _weighted_sum's products: no fp32 copy of them first)
    return _weighted_sum(_masked_rows(expert_out, slot, num_tokens, k), topk_weights, out_dtype or expert_out.dtype)


def _masked_rows(expert_out: torch.Tensor, slot: torch.Tensor, num_tokens: int, k: int) -> torch.Tensor:
    """(T, k, H): each token's k rows of the masked layout's output (E, C, H) by ``to_masked``'s ``slot``, NaN for a
    pair dropped by overflow (slot -1)."""
    e, c, h = expert_out.shape
    rows = expert_out.reshape(e * c, h).index_select(0, slot.clamp(min=0)).view(num_tokens, k, h)
    return rows.masked_fill_((slot < 0).view(num_tokens, k, 1), float("nan"))


def masked_pair_weights(topk_weights: torch.Tensor, slot: torch.Tensor, num_experts: int,
                        capacity: int) -> torch.Tensor:
    """(E, C) fp32: the routing weight of each row of ``to_masked``'s layout, 0 where no pair is (and for a pair
    dropped by overflow), for weighting the rows before the down projection (``sum_routed_pairs`` adds them)."""
    weights = torch.zeros(num_experts * capacity + 1, dtype=torch.float32, device=topk_weights.device)
    # dropped pairs (slot -1) all land in the extra first entry, cut off below
    weights.index_copy_(0, slot + 1, topk_weights.reshape(-1).float())
    return weights[1:].view(num_experts, capacity)


# --- the layer -------------------------------------------------------------------------------------------------


def _check_device(device: torch.device) -> None:
    """The grouped GEMM runs on CUDA only: a call elsewhere is refused before any work (no torch fallback). While
    torch.compile traces, the ops are recorded, not run; the grouped op's own CPU implementation refuses the call
    when the compiled graph runs."""
    if device.type != "cuda" and not torch.compiler.is_compiling():
        raise ValueError(f"QuantizedExperts runs on CUDA tensors (the grouped FP8 GEMM kernels); got an input on "
                         f"{device}: move the model to the GPU (model.cuda())")


def _grouped_scaled_mm():
    """``ops.grouped.grouped_scaled_mm``, imported on first use (importing it loads the kernels' modules)."""
    from cutedsl_gemm.ops.grouped import grouped_scaled_mm

    return grouped_scaled_mm


def _experts_arch(device: torch.device) -> Optional[str]:
    """The GPU a module on ``device`` will run on (its own, or the current one), None without a GPU."""
    if device.type != "cuda" and not torch.cuda.is_available():
        return None
    return device_info(device.index if device.type == "cuda" and device.index is not None
                       else torch.cuda.current_device())[0]


def is_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (3-D ``gate_up_proj`` / ``down_proj``, or the layout
    flags ``use_experts_implementation`` sets) that ``QuantizedExperts.from_experts`` may take."""
    if isinstance(module, QuantizedExperts):
        return False
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    stacked = all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in (gate_up, down))
    return stacked or (hasattr(module, "has_gate") and hasattr(module, "is_transposed"))


def check_experts(module: torch.nn.Module) -> None:
    """Weights ``from_experts`` can read: materialized bf16 / fp16 / fp32 (a TypeError or ValueError otherwise,
    as ``convert`` raises for an ``nn.Linear``)."""
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(module, name, None)
        if isinstance(p, torch.Tensor):
            if p.dtype not in WEIGHT_DTYPES:
                raise TypeError(f"{type(module).__name__}.{name} must be bfloat16, float16 or float32 to quantize, "
                                f"got {p.dtype}")
            if p.device.type == "meta":
                raise ValueError(f"{type(module).__name__}.{name} is on the meta device: load or materialize the "
                                 "weights before converting")


def _is_silu(act) -> bool:
    """Whether ``act`` computes SiLU (checked on values: transformers' ``ACT2FN["silu"]`` is its own class)."""
    if not callable(act):
        return False
    x = torch.linspace(-8, 8, 97)
    try:
        y = act(x)
    except Exception:  # any failure means: not a plain element-wise SiLU
        return False
    return isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y, F.silu(x), rtol=1e-5,
                                                                                 atol=1e-6)


def experts_shape_unsupported(recipe: str, hidden: int, intermediate: int) -> Optional[str]:
    """Why the grouped GEMM cannot run experts of these sizes for ``recipe``, or None: both GEMMs' K (hidden for
    gate_up, intermediate for down) must be a multiple of 16 (16-byte TMA rows; the FP8 quantizers take rows of
    16-element multiples)."""
    multiple = 16
    bad = [f"{name}={v}" for name, v in (("hidden", hidden), ("intermediate", intermediate)) if v % multiple]
    if bad:
        return (f"{', '.join(bad)}: the grouped GEMM of recipe {recipe!r} takes sizes that are multiples of "
                f"{multiple}")
    return None


def _layout(module: torch.nn.Module) -> tuple:
    """(E, H, I, transposed) of an experts module."""
    transposed = bool(getattr(module, "is_transposed", False))
    e, a, b = module.gate_up_proj.shape
    return (e, a, b // 2, True) if transposed else (e, b, a // 2, False)


def experts_unsupported(module: torch.nn.Module, recipe) -> Optional[str]:
    """Why ``module`` cannot become a ``QuantizedExperts`` of ``recipe`` (one line), or None."""
    name = recipe.name if hasattr(recipe, "name") else str(recipe)
    if name not in EXPERT_RECIPES:
        return f"recipe {name!r} has no grouped GEMM for mixture-of-experts weights: {_SCALES}"
    kind = type(module).__name__
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not getattr(module, "has_gate", True) or not isinstance(gate_up, torch.Tensor):
        return f"{kind} has no gated gate_up_proj (an up projection only): QuantizedExperts runs SiLU(gate) * up"
    if not isinstance(down, torch.Tensor) or gate_up.dim() != 3 or down.dim() != 3:
        return f"{kind}: gate_up_proj and down_proj must be 3-D (experts x out x in)"
    flags = {"has_bias": "biases", "has_post_expert_norm": "a norm after each expert",
             "_is_expert_parallel": "expert parallelism (sentinel expert ids)"}
    for flag, what in flags.items():
        if getattr(module, flag, False):
            return f"{kind} has {what}, which QuantizedExperts does not run"
    if not getattr(module, "is_concatenated", True):
        return f"{kind} interleaves the gate and up rows; QuantizedExperts takes them concatenated [gate; up]"
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # no transformers: only a module without its own gate function qualifies
        _default_apply_gate = None
    own_gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    if own_gate is not _default_apply_gate:
        return f"{kind} has its own gating function (_apply_gate); QuantizedExperts runs SiLU(gate) * up"
    if not _is_silu(getattr(module, "act_fn", None)):
        return f"{kind}'s activation is not SiLU; QuantizedExperts runs SiLU(gate) * up"
    e, h, i, transposed = _layout(module)
    want = (e, i, h) if transposed else (e, h, i)
    if gate_up.shape[2 if transposed else 1] != 2 * i or tuple(down.shape) != want:
        return (f"{kind}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not form "
                "(E, 2I, H) and (E, H, I) experts")
    why = experts_shape_unsupported(name, h, i)
    if why is not None:
        return why
    arch = _experts_arch(gate_up.device)
    if arch is not None and arch not in EXPERT_ARCHS:
        return f"the grouped FP8 GEMM runs on {' and '.join(EXPERT_ARCHS)}, not on this GPU ({arch})"
    return None


def _scale_shape(recipe: str, e: int, n: int, k: int) -> tuple:
    """The weight scales of (E, N, K) experts as the grouped GEMM takes them (its ``scale_b``): one per expert, one
    per expert and output channel, or per expert its 128x128 blocks transposed (Kb, Nb)."""
    if recipe == "deepseek":
        return (e, ceil_div(k, 128), ceil_div(n, 128))
    return (e,) if recipe == "tensor" else (e, 1, n)


class QuantizedExperts(FormatTagged, torch.nn.Module):
    """A transformers experts module on the grouped FP8 GEMM: ``forward(hidden (T, H), top_k_index (T, k),
    top_k_weights (T, k)) -> (T, H)`` in hidden's dtype, the experts' ``down(SiLU(gate(x)) * up(x))`` summed with
    the routing weights. Inference only, CUDA only (a CPU input is refused), buffers and no parameters.

    Per call: ``permute`` the (token, k) pairs by expert, quantize them in the recipe's activation form
    (``quantize_fp8``: "row" per token, "tensor" one scale for all rows, "deepseek" per token and 128-deep K group), the
    grouped gate_up GEMM, ``SiLU(gate) * routing weight * up`` (fp32 products rounded once to hidden's dtype) quantized
    for the down GEMM in the same kernel (``silu_mul_quantize_fp8``; per tensor: torch, then ``quantize_fp8``), the
    grouped down GEMM, the sum of each token's rows (``sum_routed_pairs``). With ``capacity`` set, the masked
    layout instead (``to_masked``, C = min(capacity, T); decode): every shape is then fixed by T, and a pair past the
    capacity makes its token's output NaN. Within the routing kernels' limits (``ops.moe_route.routes_by_kernel``)
    they place the pairs and quantize each token's row into its pairs' rows instead (``route_quantize_fp8``: one
    kernel at decode and small batches, three past them; per tensor after the amax kernel) and the sort is not run.

    Saved format (``state_dict``, loadable with ``safetensors``): ``gate_up_proj`` (E, 2I, H) and ``down_proj``
    (E, H, I) float8_e4m3fn, each expert's row-major weight quantized as ``QuantizedLinear`` quantizes a weight
    (the same bits); ``gate_up_proj_scale`` / ``down_proj_scale`` fp32 in the layout the grouped GEMM takes
    (per expert the transpose of the weight's scales, like ``scaled_mm``'s ``scale_b``): "row" (E, 1, N), "tensor"
    (E,), "deepseek" (E, ceil(K / 128), ceil(N / 128)); ``_extra_state`` the format tag
    ``"cutedsl_gemm/<FORMAT_VERSION>/<recipe>"`` (uint8 ASCII), checked on load like QuantizedLinear's.
    ``QuantizedExperts(num_experts, hidden_dim, intermediate_dim, recipe)`` builds an empty module to load into.
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, recipe: str = "row", device=None,
                 capacity: Optional[int] = None):
        super().__init__()
        if recipe not in EXPERT_RECIPES:
            raise ValueError(f"QuantizedExperts runs recipes {', '.join(map(repr, EXPERT_RECIPES))}, not {recipe!r}: "
                             "the grouped FP8 GEMM takes per-tensor, row-wise and DeepSeek-V3 block scales")
        why = experts_shape_unsupported(recipe, hidden_dim, intermediate_dim)
        if why is not None:
            raise ValueError(why)
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be None or a positive int, got {capacity!r}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.recipe, self.capacity = recipe, capacity
        e, h, i = num_experts, hidden_dim, intermediate_dim
        for name, n, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            self.register_buffer(name, torch.empty((e, n, k), dtype=FP8, device=device))
            self.register_buffer(name + "_scale", torch.empty(_scale_shape(recipe, e, n, k), dtype=torch.float32,
                                                              device=device))

    @classmethod
    def from_experts(cls, module: torch.nn.Module, recipe: str = "row",
                     capacity: Optional[int] = None) -> QuantizedExperts:
        """The experts of a transformers experts module quantized for ``recipe``; a module the grouped GEMM cannot
        run is refused with the reason (``experts_unsupported``)."""
        check_experts(module)
        why = experts_unsupported(module, recipe)
        if why is not None:
            raise ValueError(f"this experts module cannot run recipe {recipe!r}: {why}")
        return cls.quantized(module, recipe, capacity)

    @classmethod
    def quantized(cls, module: torch.nn.Module, recipe: str, capacity: Optional[int] = None) -> QuantizedExperts:
        """``from_experts`` without its checks (``convert`` makes them). Each expert's weight is quantized where it
        lives, one expert at a time: by the kernels on a GPU, by their torch reference (the same bits) elsewhere."""
        r = linear_recipe(recipe)
        e, h, i, transposed = _layout(module)
        layer = cls(e, h, i, r.name, device="meta", capacity=capacity)
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                src = getattr(module, name).detach()
                q = s = None
                for x in range(e):
                    w = (src[x].t() if transposed else src[x]).contiguous()
                    qe, se, _, _ = r.quantize_weight(w, EAGER)
                    if q is None:
                        q = torch.empty((e, *qe.shape), dtype=qe.dtype, device=qe.device)
                        s = torch.empty((e, *se.shape), dtype=torch.float32, device=se.device)
                    q[x].copy_(qe)
                    s[x].copy_(se)
                setattr(layer, name, q)
                setattr(layer, name + "_scale", s)
        return layer

    def _quantize(self, x: torch.Tensor) -> tuple:
        """(codes, scales) of activation rows x (rows, K) in the op's layout for the recipe."""
        q, s = quantize_fp8(x, ACTIVATION_GRANULARITY[self.recipe])
        return q, (s.reshape(1) if self.recipe == "tensor" else s)

    def _masked_scales(self, s: torch.Tensor, e: int, c: int) -> torch.Tensor:
        """Activation scales of (E * C) rows as the masked layout takes them: an (E, C, 1) or (E, C, Kb) view, or
        the one per-tensor scale."""
        return s if self.recipe == "tensor" else s.view(e, c, -1)

    def _quantize_gated(self, h: torch.Tensor, weights: torch.Tensor, live: Optional[torch.Tensor] = None) -> tuple:
        """(codes, scales) of ``SiLU(gate) * weight * up`` (``reference.silu_mul``) of the gate_up GEMM's output rows
        h (rows, 2I) with their routing weights (rows,) fp32, for the down GEMM: one kernel
        (``silu_mul_quantize_fp8``) per token or 1x128 group; per tensor the activation first, its rows past the
        masked counts (``live`` False) zeroed so that their garbage cannot move the one scale."""
        if self.recipe != "tensor":
            return silu_mul_quantize_fp8(h, ACTIVATION_GRANULARITY[self.recipe], weights)
        act = R.silu_mul(h, weights)
        return self._quantize(act if live is None else act.masked_fill_(~live.view(-1, 1), 0))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        _check_device(hidden_states.device)
        t, k = _check_routing(hidden_states, top_k_index, self.num_experts)
        if hidden_states.shape[1] != self.hidden_dim:
            raise ValueError(f"hidden_states has {hidden_states.shape[1]} features; these experts take "
                             f"{self.hidden_dim}")
        dtype = hidden_states.dtype
        if t * k == 0:
            return hidden_states.new_zeros((t, self.hidden_dim))
        e = self.num_experts
        c = None if self.capacity is None else min(self.capacity, t)  # an expert takes at most one pair per token
        if routes_by_kernel(t, k, e, self.hidden_dim):
            # the routing kernels (five kernels a call at decode for the row-wise and DeepSeek recipes, seven past
            # ROUTE_MAX_ID_READS; per tensor the amax kernel first)
            qx, sx, groups, pos, weights = route_quantize_fp8(hidden_states, top_k_index.contiguous(),
                                                              top_k_weights.contiguous(), e,
                                                              ACTIVATION_GRANULARITY[self.recipe], capacity=c)
        elif c is None:
            x, groups, order = permute(hidden_states, top_k_index, e)
            qx, sx = self._quantize(x)
            weights, pos = pair_weights(top_k_weights, order), pair_rows(order, t, k)
        else:
            x, groups, slot, _ = to_masked(hidden_states, top_k_index, e, c)
            qx, sx = self._quantize(x.view(e * c, self.hidden_dim))
            weights, pos = masked_pair_weights(top_k_weights, slot, e, c).view(-1), slot.view(t, k).to(torch.int32)
        return sum_routed_pairs(self._experts(qx, sx, groups, weights, c, dtype, t * k), pos)

    def _experts(self, qx, sx, groups, weights, c: Optional[int], dtype, pairs: int) -> torch.Tensor:
        """The grouped gate_up GEMM, the gated activation with each row's routing weight folded in (the down
        projection is linear, so the combine only adds rows up), the grouped down GEMM: the experts' output rows,
        (R, H) contiguous (``c`` None; ``groups`` the end rows) or (E, C, H) masked (``groups`` the counts, which
        add up to at most the T * k ``pairs``: the GEMMs' tiles are chosen for that many rows, not E * C)."""
        grouped, e = _grouped_scaled_mm(), self.num_experts
        gate_up, down = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)  # (E, K, N) views
        if c is None:
            h = grouped(qx, gate_up, sx, self.gate_up_proj_scale, groups, out_dtype=dtype)
            qh, sh = self._quantize_gated(h, weights)
            return grouped(qh, down, sh, self.down_proj_scale, groups, out_dtype=dtype)
        expected = min(pairs, e * c)
        h = grouped(qx.view(e, c, -1), gate_up, self._masked_scales(sx, e, c), self.gate_up_proj_scale,
                    counts=groups, out_dtype=dtype, expected_rows=expected)
        # rows past each count are not written (nor read by the down GEMM, whose rows past the counts are not
        # computed); per tensor they are zeroed before the one scale's amax
        live = torch.arange(c, device=groups.device) < groups[:, None] if self.recipe == "tensor" else None
        qh, sh = self._quantize_gated(h.view(e * c, -1), weights, live)
        return grouped(qh.view(e, c, -1), down, self._masked_scales(sh, e, c), self.down_proj_scale, counts=groups,
                       out_dtype=dtype, expected_rows=expected)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple:
        """(gate_up (E, 2I, H), down (E, H, I)) in ``dtype``: the weights the grouped GEMM multiplies (codes times
        their scales, per expert as ``QuantizedLinear.dequantize`` computes them)."""
        r = linear_recipe(self.recipe)
        out = []
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                q, s = getattr(self, name), getattr(self, name + "_scale")
                out.append(torch.stack([r.dequantize_weight(q[x], s[x], None, None, q.shape[2])
                                        for x in range(q.shape[0])]).to(dtype))
        return tuple(out)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, recipe={self.recipe!r}"
                + (f", capacity={self.capacity}" if self.capacity is not None else ""))

    # --- saved format -------------------------------------------------------------------------------

    saved_what, module_word = "experts", "module"

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self.check_saved_dtypes(state_dict, prefix, self.check_format_tag(state_dict, prefix), EXPERT_BUFFERS)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
