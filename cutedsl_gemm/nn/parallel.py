"""Tensor parallelism for ``QuantizedLinear`` on torch.distributed's own machinery: ``DeviceMesh``,
``parallelize_module`` and two ``ParallelStyle`` subclasses, ``QuantizedColwiseParallel`` and
``QuantizedRowwiseParallel``.

    mesh = init_device_mesh("cuda", (world_size,))
    parallelize(model, mesh)                                      # model.config.base_model_tp_plan, or plan={...}
    parallelize_module(model, mesh, tp_plan_for(model, {"layers.*.q_proj": ColwiseParallel(), ...}))

Column-parallel: each rank keeps a slice of the output features (the weight's rows with their per-channel or
128-block scales, the bias sliced) and returns its slice of the output. Row-parallel: each rank keeps a slice of the
input features (the weight's columns with their block-scale rows; per-channel and per-tensor scales replicated),
multiplies its slice of the input, and the partial outputs are all-reduced in the output dtype; the bias is added
once, after the reduction (buffer ``reduced_bias``, saved as ``bias``). Shards are equal and respect the recipe's
blocks (128 for "deepseek", 64 / 128 for packed weights); a split they cannot take raises ValueError with the sizes
that work. The sm_100a recipes (MX, NVFP4: swizzled block scales) are refused.

Why subclasses of the stock styles, with plain local tensors in the layer. ``ColwiseParallel`` / ``RowwiseParallel``
turn an ``nn.Linear``'s parameters into DTensors and let DTensor's operator rules run ``F.linear``, and refuse other
modules. A quantized layer's buffers do not shard like an ``nn.Linear``'s (packed 64 x 128 atoms, 128 x 128 block
scales, replicated per-channel scales, a bias that must skip the partial sums): a DTensor sharding rule for the
layer's operator could not express block-aligned splits or the bias after the reduction, and a DTensor input would
take the forward off its kept-launch path (plain CUDA tensors only) through DTensor's dispatch on every call. So the
styles slice the buffers by the recipe's layout once, keep the layer a ``QuantizedLinear`` of the local sizes (the
same forward and kernels, its kept launches included), and do the layout work in forward hooks: DTensor
(``from_local`` / ``redistribute``) where the plan's layouts need it, a plain in-place all-reduce for the default
row-parallel output, nothing for the default column-parallel one. Other modules (``nn.Linear``, ``nn.Embedding``)
get the stock behaviour, so one plan covers a model where some layers stay in high precision; ``tp_plan_for`` turns
a plan of stock styles (or a transformers config's "colwise" / "rowwise") into these. At world size 1 nothing
changes: every layer stays the plain layer.

State: ``shard_state_dict`` / ``unshard_state_dict`` (no communication), ``full_state_dict`` (gathers a parallelized
model's), and ``load_sharded``, which reads each rank's slices only from a safetensors checkpoint of this library's
format (``safe_open(...).get_slice``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from cutedsl_gemm.numerics import int_packing as IP

from .linear import QuantizedLinear, read_format_tag, target_arch, unsupported
from .recipes import LINEAR_RECIPES, QUANTIZED, LinearRecipe, linear_recipe

COLWISE, ROWWISE = "colwise", "rowwise"
REDUCED_BIAS = "reduced_bias"  # a row-parallel layer's bias, added after the all-reduce
MAX_LISTED = 64  # the largest tensor-parallel size an error lists as working
#: transformers' tp-plan strings taken, and the style each becomes
PLAN_STRINGS = {"colwise": (COLWISE, None), "rowwise": (ROWWISE, None), "colwise_rep": (COLWISE, Replicate()),
                "colwise_gather_output": (COLWISE, Replicate())}


@dataclass(frozen=True)
class TPShard:
    """How a sharded ``QuantizedLinear`` (its attribute ``tp_shard``) was split: ``kind`` "colwise" or "rowwise",
    this shard's ``rank`` of ``world_size``, the whole layer's sizes, and the mesh (None for ``shard_layer``)."""

    kind: str
    rank: int
    world_size: int
    in_features: int
    out_features: int
    mesh: object = field(default=None, compare=False, repr=False)

    @property
    def per_shard(self) -> int:
        """The features of the split dimension each shard holds."""
        return (self.out_features if self.kind == COLWISE else self.in_features) // self.world_size


# --- the layouts: which buffer shards along which dimension ---------------------------------------------------------


def _layout(r: LinearRecipe, kind: str) -> tuple:
    """({buffer: (dim, features per index) or None (replicated)}, the shard unit, why that unit) of recipe ``r`` split
    ``kind``-wise. Buffers not named are replicated."""
    if kind not in (COLWISE, ROWWISE):
        raise ValueError(f"kind must be {COLWISE!r} or {ROWWISE!r}, got {kind!r}")
    col = kind == COLWISE
    if r.weight_only:
        rules = {"weight": (0, IP.ATOM_ROWS) if col else (1, IP.ATOM_K)}
        group = (1, 1) if col else (None if r.group == IP.PER_CHANNEL else (0, r.group))
        rules["weight_scale"] = group
        if r.zeros:
            rules["weight_zero"] = group
        why = (f"its packed weight's {IP.ATOM_ROWS}-row atoms" if col else
               f"its packed weight's {IP.ATOM_K}-deep K atoms")
    elif r.scaling.scale_format == "fp32":
        rules = {"weight": (0, 1) if col else (1, 1)}
        label = r.scaling.b.label
        if label == "row":
            rules["weight_scale"] = (1, 1) if col else None
        elif label != "tensor":
            block = r.scaling.k_block
            rules["weight_scale"] = (1, block) if col else (0, block)
        why = f"its {label} weight blocks"  # (unit 1 for "row" and "tensor": any whole number)
    else:
        raise ValueError(f"recipe {r.describe()} runs on sm_100a with swizzled block scales; tensor-parallel sharding "
                         "takes the Hopper recipes ('row', 'deepseek', 'tensor', 'int8' and the weight-only ones)")
    rules["bias"] = (0, 1) if col else None
    unit = math.lcm(*(rule[1] for rule in rules.values() if rule is not None))
    return rules, unit, why


def _fits(r, kind, n, k, size, dtype, bias, arch) -> Optional[str]:
    """Why ``size`` equal shards of an (n, k) layer do not work (block rule or the kernels' checks), or None."""
    feats = n if kind == COLWISE else k
    unit = _layout(r, kind)[1]
    if feats % size or (feats // size) % unit:
        return "block"
    ln, lk = (n // size, k) if kind == COLWISE else (n, k // size)
    return _refused(r.name, ln, lk, dtype, bias and kind == COLWISE, arch)


@functools.lru_cache(maxsize=1024)
def _refused(recipe: str, n: int, k: int, dtype, bias: bool, arch: str) -> Optional[str]:
    # the kernels' checks on fake tensors, once per local shape (every layer of a model asks for the same few)
    return unsupported(linear_recipe(recipe), n, k, dtype, bias, arch)


def split_sizes(recipe, kind: str, out_features: int, in_features: int, *, dtype=torch.bfloat16, bias=False,
                device=None, limit: int = MAX_LISTED) -> list:
    """The tensor-parallel sizes up to ``limit`` that split an (out_features, in_features) layer of ``recipe``
    ``kind``-wise: equal shards on the recipe's blocks that the kernels run."""
    r = linear_recipe(recipe)
    arch = target_arch(r, torch.device(device or "cpu"))
    return [s for s in range(1, limit + 1) if _fits(r, kind, out_features, in_features, s, dtype, bias, arch) is None]


def check_split(recipe, kind: str, out_features: int, in_features: int, world_size: int, *, dtype=torch.bfloat16,
                bias=False, device=None) -> tuple:
    """(local out_features, local in_features) of ``world_size`` equal shards; ValueError naming the recipe, the
    sizes and the tensor-parallel sizes that work where the recipe's blocks or its kernels cannot take them."""
    r = linear_recipe(recipe)
    _, unit, why = _layout(r, kind)
    arch = target_arch(r, torch.device(device or "cpu"))
    n, k = out_features, in_features
    fail = _fits(r, kind, n, k, world_size, dtype, bias, arch)
    if fail is None:
        return (n // world_size, k) if kind == COLWISE else (n, k // world_size)
    name, feats, what = ("N", n, "output") if kind == COLWISE else ("K", k, "input")
    need = f"a multiple of {unit} ({why})" if unit > 1 else "whole"
    reason = (f"{world_size} shards of {name}={feats} {what} features hold {feats / world_size:g} each, which must be "
              f"{need}" if fail == "block" else f"the local layer cannot run: {fail}")
    works = split_sizes(r, kind, n, k, dtype=dtype, bias=bias, device=device)
    raise ValueError(f"recipe {r.name!r}: {kind} sharding of a layer of N={n}, K={k} {world_size} ways: {reason}; "
                     f"tensor-parallel sizes that work: {', '.join(map(str, works)) or 'none'}")


def _act_dtype(layer: QuantizedLinear) -> torch.dtype:
    s = layer.weight_scale
    return s.dtype if s is not None and s.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def _index(rule, per_shard: int, rank: int) -> tuple:
    dim, unit = rule
    return (slice(None),) * dim + (slice(rank * per_shard // unit, (rank + 1) * per_shard // unit),)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN patterns and FP8 compare as their bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# --- layers ---------------------------------------------------------------------------------------------------------


def _local_buffers(layer: QuantizedLinear, kind: str, rank: int, world_size: int) -> tuple:
    """(this rank's buffers, TPShard) of ``layer``: the sliced ones copies (the whole ones can be freed), the
    replicated ones ``layer``'s own tensors."""
    if getattr(layer, "tp_shard", None) is not None:
        raise ValueError(f"this layer is already sharded ({layer.tp_shard}); shard the whole layer")
    r = linear_recipe(layer.recipe)
    rules, _, _ = _layout(r, kind)
    n, k = layer.out_features, layer.in_features
    check_split(r, kind, n, k, world_size, dtype=_act_dtype(layer), bias=layer.bias is not None,
                device=layer.weight.device)
    per = (n if kind == COLWISE else k) // world_size
    out = {}
    for name in (*QUANTIZED, "bias", "input_scale"):
        t, rule = getattr(layer, name), rules.get(name)
        out[name] = t if t is None or rule is None else t[_index(rule, per, rank)].clone(
            memory_format=torch.contiguous_format)
    return out, TPShard(kind, rank, world_size, k, n)


def _install(layer: QuantizedLinear, buffers: dict, shard: TPShard) -> None:
    """Put the local buffers in ``layer`` (setattr: the layer drops its kept launches) and its local sizes."""
    bias = buffers.pop("bias")
    for name, t in buffers.items():
        setattr(layer, name, t)
    if shard.kind == ROWWISE:
        layer.bias = None  # the local GEMM adds none: the bias is added once, after the all-reduce
        if bias is not None:
            layer.register_buffer(REDUCED_BIAS, bias)
            layer.register_state_dict_post_hook(_save_reduced_bias)
            layer.register_load_state_dict_pre_hook(_load_reduced_bias)
    else:
        layer.bias = bias
    layer.out_features = shard.per_shard if shard.kind == COLWISE else shard.out_features
    layer.in_features = shard.per_shard if shard.kind == ROWWISE else shard.in_features
    layer.tp_shard = shard


def _save_reduced_bias(module, state_dict, prefix, local_metadata):
    # the saved format's name: a row-parallel layer's state holds "bias" like the whole layer's
    if prefix + REDUCED_BIAS in state_dict:
        state_dict[prefix + "bias"] = state_dict.pop(prefix + REDUCED_BIAS)


def _load_reduced_bias(module, state_dict, prefix, *args):
    if prefix + "bias" in state_dict and module._buffers.get(REDUCED_BIAS) is not None:
        state_dict[prefix + REDUCED_BIAS] = state_dict.pop(prefix + "bias")


def _empty_like(layer: QuantizedLinear, n: int, k: int, bias: bool) -> QuantizedLinear:
    return QuantizedLinear(k, n, bias, layer.recipe, device="meta", dtype=_act_dtype(layer),
                           input_scale=layer.input_scale is not None)


def shard_layer(layer: QuantizedLinear, kind: str, rank: int, world_size: int) -> QuantizedLinear:
    """Shard ``rank`` of ``world_size`` of ``layer`` split ``kind``-wise ("colwise" / "rowwise"), as a new
    ``QuantizedLinear`` of the local sizes with attribute ``tp_shard`` (no communication, no hooks: the styles add
    those). A row-parallel shard's forward is its partial product; its bias is in ``reduced_bias``. World size 1
    returns ``layer`` itself."""
    if world_size == 1:
        return layer
    buffers, shard = _local_buffers(layer, kind, rank, world_size)
    local = _empty_like(layer, layer.out_features, layer.in_features, layer.bias is not None)
    _install(local, buffers, shard)
    return local


def _layer_bias(layer):
    return layer.bias if layer.bias is not None else layer._buffers.get(REDUCED_BIAS)


def _join(name: str, pieces: list, rule) -> torch.Tensor:
    """The whole buffer from its shards (rank order): concatenated, or a replica every shard holds alike."""
    if rule is not None:
        return torch.cat(pieces, dim=rule[0])
    if any(not _same(p, pieces[0]) for p in pieces[1:]):
        raise ValueError(f"{name}: the shards hold different copies of this replicated tensor")
    return pieces[0]


def unshard_layers(shards: list) -> QuantizedLinear:
    """The whole ``QuantizedLinear`` from its shards (rank order; ``shard_layer`` or a parallelized model's layers):
    the buffers byte for byte as before sharding."""
    info = [s.tp_shard for s in shards]
    first = info[0]
    if [i.rank for i in info] != list(range(first.world_size)) or len({(i.kind, i.world_size) for i in info}) > 1:
        raise ValueError(f"expected the {first.world_size} shards of one layer in rank order, got {info}")
    rules, _, _ = _layout(linear_recipe(shards[0].recipe), first.kind)
    full = _empty_like(shards[0], first.out_features, first.in_features, _layer_bias(shards[0]) is not None)
    for name in (*QUANTIZED, "input_scale"):
        if getattr(shards[0], name) is not None:
            setattr(full, name, _join(name, [getattr(s, name) for s in shards], rules.get(name)))
    if full.bias is not None:
        full.bias = _join("bias", [_layer_bias(s) for s in shards], rules.get("bias"))
    return full


# --- the styles -----------------------------------------------------------------------------------------------------


class _QuantizedStyle:
    """What both styles add to the stock ones: ``QuantizedLinear`` layers, and nothing at all at world size 1."""

    kind: str
    local_input: tuple  # the placement of the input the local layer multiplies

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"tensor parallelism takes a 1-D mesh, got {device_mesh.ndim}-D: pass mesh['tp']")
        if device_mesh.size() == 1:
            return module  # the plain layer: no copies, no hooks
        if not isinstance(module, QuantizedLinear):
            return super()._apply(module, device_mesh)
        rank, world = device_mesh.get_local_rank(), device_mesh.size()
        if getattr(module, "tp_shard", None) is None and self.src_data_rank is not None:
            _broadcast_buffers(module, device_mesh, self.src_data_rank)
        buffers, shard = _local_buffers(module, self.kind, rank, world)
        _install(module, buffers, TPShard(shard.kind, rank, world, shard.in_features, shard.out_features, device_mesh))
        module.register_forward_pre_hook(lambda mod, args: self._prepare_local_input(device_mesh, mod, args))
        module.register_forward_hook(lambda mod, args, y: self._prepare_local_output(device_mesh, mod, args, y))
        return module

    def _prepare_local_input(self, mesh, module, args):
        """The local operand of the layer: the input as the plan lays it out, redistributed to ``local_input``."""
        x = args[0]
        if not isinstance(x, DTensor):
            if tuple(self.input_layouts) == self.local_input:
                return None  # already the local operand: nothing to do
            x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
        return (x.redistribute(placements=self.local_input).to_local(), *args[1:])


def _wire(t: torch.Tensor, mesh) -> torch.Tensor:
    """``t``'s bytes (the backends take no FP8) on the mesh's device type: a view of ``t`` where it is there."""
    wire = t.reshape(-1).view(torch.uint8)
    return wire if wire.device.type == mesh.device_type else wire.to(mesh.device_type)


def _broadcast_buffers(module: QuantizedLinear, mesh, src: int) -> None:
    """Every rank's buffers as the mesh's rank ``src`` holds them (the stock styles' ``src_data_rank``); meta
    buffers have nothing to send."""
    for name, t in list(module._buffers.items()):
        if t is not None and t.device.type != "meta":
            data = t.contiguous()
            wire = _wire(data, mesh)
            dist.broadcast(wire, group=mesh.get_group(), group_src=src)
            data.view(-1).view(torch.uint8).copy_(wire)  # a no-op where the wire is the buffer itself
            setattr(module, name, data)


class QuantizedColwiseParallel(_QuantizedStyle, ColwiseParallel):
    """``ColwiseParallel`` that also shards ``QuantizedLinear``: each rank keeps its slice of the output features
    (weight rows, their per-channel or 128-block scale columns, the bias slice; per-tensor scales replicated). The
    input is replicated (``input_layouts`` says how it arrives); the output is this rank's slice of the last dimension
    unless ``output_layouts`` asks otherwise (``Replicate()``: all-gathered)."""

    kind, local_input = COLWISE, (Replicate(),)

    def _prepare_local_output(self, mesh, module, args, y):
        if tuple(self.output_layouts) == (Shard(-1),) and self.use_local_output:
            return None
        out = DTensor.from_local(y, mesh, (Shard(-1),), run_check=False).redistribute(placements=self.output_layouts)
        return out.to_local() if self.use_local_output else out


class QuantizedRowwiseParallel(_QuantizedStyle, RowwiseParallel):
    """``RowwiseParallel`` that also shards ``QuantizedLinear``: each rank keeps its slice of the input features
    (weight columns, their 128-block scale rows, group-wise scales and zero points; per-channel and per-tensor scales
    replicated) and multiplies its slice of the input (by default the input arrives sharded on its last dimension).
    The partial outputs are all-reduced in the output dtype, then the bias is added once; ``output_layouts=Shard(d)``
    reduce-scatters instead."""

    kind, local_input = ROWWISE, (Shard(-1),)

    def _prepare_local_output(self, mesh, module, args, y):
        bias = module._buffers.get(REDUCED_BIAS)
        if tuple(self.output_layouts) == (Replicate(),) and self.use_local_output:
            dist.all_reduce(y, group=mesh.get_group())  # in place, in y's dtype
            return y if bias is None else y.add_(bias)
        out = DTensor.from_local(y, mesh, (Partial(),), run_check=False).redistribute(placements=self.output_layouts)
        if bias is not None:
            local, place = out.to_local(), out.placements[0]
            if isinstance(place, Shard) and place.dim % y.dim() == y.dim() - 1:
                pieces = torch.chunk(bias, mesh.size())
                rank = mesh.get_local_rank()
                bias = pieces[rank] if rank < len(pieces) else bias[:0]
            local.add_(bias)  # the local tensor is the DTensor's own storage
        return out.to_local() if self.use_local_output else out


# --- plans ----------------------------------------------------------------------------------------------------------


def _quantized_style(pattern: str, style) -> ParallelStyle:
    if isinstance(style, _QuantizedStyle):
        return style
    if isinstance(style, str):
        if style not in PLAN_STRINGS:
            raise ValueError(f"plan entry {pattern!r}: {style!r} is not taken; quantized layers shard as "
                             f"{', '.join(map(repr, PLAN_STRINGS))}")
        kind, output = PLAN_STRINGS[style]
        cls = QuantizedColwiseParallel if kind == COLWISE else QuantizedRowwiseParallel
        return cls(output_layouts=output)
    for stock, cls in ((ColwiseParallel, QuantizedColwiseParallel), (RowwiseParallel, QuantizedRowwiseParallel)):
        if isinstance(style, stock):
            new = cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                      use_local_output=style.use_local_output)
            new.src_data_rank = style.src_data_rank
            return new
    if isinstance(style, ParallelStyle):
        return style  # input / output preparation: no weights to shard
    raise TypeError(f"plan entry {pattern!r}: expected a ParallelStyle or a plan string, got {type(style).__name__}")


def tp_plan_for(model: torch.nn.Module, plan: Optional[dict] = None) -> dict:
    """A plan for ``parallelize_module`` that shards ``model``'s ``QuantizedLinear`` layers: ``plan`` (module-name
    patterns -> ``ColwiseParallel`` / ``RowwiseParallel``, these styles, or "colwise" / "rowwise" / "colwise_rep")
    with the stock styles swapped for ``QuantizedColwiseParallel`` / ``QuantizedRowwiseParallel`` (their layouts
    kept), or without ``plan`` the transformers config's ``base_model_tp_plan`` under the base model's prefix."""
    if plan is None:
        config = getattr(model, "config", None)
        plan = dict(getattr(config, "base_model_tp_plan", None) or {})
        if not plan:
            raise ValueError(f"{type(model).__name__} has no config.base_model_tp_plan (a transformers model's): pass "
                             "plan={module pattern: ColwiseParallel() | RowwiseParallel()}")
        prefix = getattr(model, "base_model_prefix", "")
        if prefix and isinstance(getattr(model, prefix, None), torch.nn.Module):
            plan = {f"{prefix}.{p}": s for p, s in plan.items()}
    return _normalized(plan)


def _normalized(plan: dict) -> dict:
    return {pattern: _quantized_style(pattern, style) for pattern, style in plan.items()}


def _matches(pattern: str, name: str) -> bool:
    """``parallelize_module``'s matching: one ``fnmatch`` pattern per dotted level."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch(p, a) for p, a in zip(parts, atoms))


def _kind_of(name: str, plan: dict) -> Optional[str]:
    """How a normalized ``plan`` splits the module ``name``: "colwise", "rowwise" or None."""
    kinds = [(p, COLWISE if isinstance(s, ColwiseParallel) else ROWWISE) for p, s in plan.items()
             if _matches(p, name) and isinstance(s, (ColwiseParallel, RowwiseParallel))]
    if len(kinds) > 1:
        raise ValueError(f"{name} matches {len(kinds)} plan entries ({', '.join(p for p, _ in kinds)}): one each")
    return kinds[0][1] if kinds else None


def _split_heads(name: str, model, m: QuantizedLinear, world: int) -> Optional[str]:
    """Why a column-parallel projection of an attention module (one with an int ``head_dim``, as transformers'
    have) would cut a head in two, or None."""
    parent = model.get_submodule(name.rpartition(".")[0])
    head = getattr(parent, "head_dim", None)
    if not isinstance(head, int) or head <= 0 or m.out_features % head or (m.out_features // world) % head == 0:
        return None
    heads = m.out_features // head
    works = [s for s in split_sizes(m.recipe, COLWISE, m.out_features, m.in_features, dtype=_act_dtype(m),
                                    bias=m.bias is not None, device=m.weight.device) if heads % s == 0]
    return (f"{world} shards of its N={m.out_features} output features hold {m.out_features / world:g} each, not "
            f"whole heads of {head} (its attention's head_dim); tensor-parallel sizes that split its {heads} heads: "
            f"{', '.join(map(str, works))}")


def parallelize(model: torch.nn.Module, mesh, plan: Optional[dict] = None, *, src_data_rank: Optional[int] = 0):
    """``parallelize_module(model, mesh, tp_plan_for(model, plan))`` after checking every layer the plan shards:
    one ValueError naming each layer that cannot be split ``mesh.size()`` ways and why (the recipe's blocks, the
    kernels, or for an attention module's column-parallel projections its heads). Returns ``model``."""
    plan = tp_plan_for(model, plan)
    from .fused_qkv import QKVSlice
    from .gated_mlp import QuantizedGatedMLP

    fused = [name for name, m in model.named_modules() if isinstance(m, (QuantizedGatedMLP, QKVSlice))]
    if fused and mesh.size() > 1:
        raise ValueError(f"{len(fused)} fused layers ({fused[0]}, ...): tensor parallelism shards the converted "
                         "model's own layers; parallelize it without fuse_gated_mlps / fuse_qkv")
    if mesh.size() > 1:
        errors = []
        for name, m in model.named_modules():
            kind = _kind_of(name, plan) if isinstance(m, QuantizedLinear) else None
            if kind is not None:
                try:
                    check_split(m.recipe, kind, m.out_features, m.in_features, mesh.size(), dtype=_act_dtype(m),
                                bias=m.bias is not None, device=m.weight.device)
                except ValueError as e:
                    errors.append(f"{name}: {e}")
                    continue
                why = _split_heads(name, model, m, mesh.size()) if kind == COLWISE else None
                if why is not None:
                    errors.append(f"{name}: {why}")
        if errors:
            head = f"{len(errors)} of the plan's layers cannot be split {mesh.size()} ways:\n"
            raise ValueError(head + "\n".join(errors))
    return parallelize_module(model, mesh, plan, src_data_rank=src_data_rank)


# --- state dicts and checkpoints ------------------------------------------------------------------------------------


def _quantized_layers(state_dict: dict) -> dict:
    """{layer prefix: recipe} of the ``QuantizedLinear`` entries of a state dict (their ``_extra_state`` tags)."""
    layers = {}
    for key, t in state_dict.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "_extra_state" and isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1:
            _, name = read_format_tag(bytes(t.tolist()), prefix)
            if name in LINEAR_RECIPES:
                layers[prefix] = LINEAR_RECIPES[name]
    return layers


def _planned(state_dict: dict, plan: dict, world_size: int) -> dict:
    """{layer prefix: (rules, features per shard)} of the quantized layers ``plan`` splits, each checked."""
    out = {}
    for prefix, r in _quantized_layers(state_dict).items():
        kind = _kind_of(prefix, plan)
        if kind is None:
            continue
        w, s = state_dict[f"{prefix}.weight"], state_dict[f"{prefix}.weight_scale"]
        # (N, K) from the saved shapes; a packed per-channel weight's K counts whole 128-deep atoms
        n, k = (s.shape[-1], s.shape[0] * r.group if r.group else w.shape[1] * IP.ATOM_K) if r.weight_only else w.shape
        dtype = s.dtype if r.weight_only and r.group else torch.bfloat16
        try:
            check_split(r, kind, n, k, world_size, dtype=dtype, bias=f"{prefix}.bias" in state_dict)
        except ValueError as e:
            raise ValueError(f"{prefix}: {e}") from None
        out[prefix] = (_layout(r, kind)[0], (n if kind == COLWISE else k) // world_size)
    return out


def shard_state_dict(state_dict: dict, plan: dict, rank: int, world_size: int) -> dict:
    """Rank ``rank``'s state of a model saved whole (``state_dict()`` of a converted model), for the model
    ``parallelize`` splits ``world_size`` ways by ``plan`` (the same plan; module-name patterns): each planned
    ``QuantizedLinear``'s entries sliced as the styles slice them; every other entry as it is (those of layers the
    stock styles shard, ``nn.Linear`` / ``nn.Embedding``, are DTensors in the parallelized model: ``load_sharded``
    fills them)."""
    if world_size == 1:
        return dict(state_dict)
    layers = _planned(state_dict, _normalized(plan), world_size)
    out = {}
    for key, t in state_dict.items():
        prefix, _, name = key.rpartition(".")
        rules, per = layers.get(prefix, ({}, 0))
        rule = rules.get(name)
        out[key] = t if rule is None else t[_index(rule, per, rank)].clone(memory_format=torch.contiguous_format)
    return out


def unshard_state_dict(shards: list, plan: dict) -> dict:
    """The whole state from every rank's (``shard_state_dict``'s, or a parallelized model's ``state_dict()`` of
    plain tensors), in rank order: sliced entries concatenated, replicated ones checked to be alike."""
    if any(isinstance(t, DTensor) for s in shards for t in s.values()):
        raise TypeError("the shards hold DTensors (layers the stock styles shard): gather them with full_state_dict")
    if any(s.keys() != shards[0].keys() for s in shards):
        raise ValueError("the shards hold different entries: expected the states of one model's ranks")
    plan = _normalized(plan)
    layers = {} if len(shards) == 1 else {prefix: _layout(r, kind)[0] for prefix, r in
                                          _quantized_layers(shards[0]).items() if (kind := _kind_of(prefix, plan))}
    out = {}
    for key in shards[0]:
        prefix, _, name = key.rpartition(".")
        out[key] = _join(key, [s[key] for s in shards], layers.get(prefix, {}).get(name))
    return out


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole state of a parallelized model on every rank (a collective: every rank calls it), as the model
    before ``parallelize`` saved it: sharded quantized layers gathered and joined, DTensors made whole, on the CPU."""
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in model.state_dict().items()}
    sharded = {name: m.tp_shard for name, m in model.named_modules()
               if isinstance(m, QuantizedLinear) and getattr(m, "tp_shard", None) is not None}
    for key in [k for k in state if k.rpartition(".")[0] in sharded]:
        prefix, _, name = key.rpartition(".")
        shard = sharded[prefix]
        rules, _, _ = _layout(linear_recipe(model.get_submodule(prefix).recipe), shard.kind)
        state[key] = _join(key, _all_gather(state[key], shard.mesh), rules.get(name))
    return state


def _all_gather(t: torch.Tensor, mesh) -> list:
    """Every rank's ``t`` (equal shapes), on the CPU."""
    wire = _wire(t.contiguous(), mesh)
    pieces = [torch.empty_like(wire) for _ in range(mesh.size())]
    dist.all_gather(pieces, wire, group=mesh.get_group())
    return [p.cpu().view(t.dtype).view(t.shape) for p in pieces]


@contextlib.contextmanager
def _opened(path):
    """{tensor name: the safetensors handle holding it} of a file or a directory of them (one file each, or the
    shards of ``model.safetensors.index.json``)."""
    from safetensors import safe_open

    from .checkpoint_format import Checkpoint

    if os.path.isdir(path):
        ckpt = Checkpoint(os.fspath(path))
        try:
            yield {key: f for key, (f, _) in ckpt.where.items()}  # no renames: the stored names
        finally:
            ckpt.close()
    else:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            yield dict.fromkeys(f.keys(), f)


def _dtensor_index(t: DTensor) -> Optional[tuple]:
    """The slice of the whole tensor a 1-D mesh's Shard / Replicate DTensor holds here (torch.chunk's split)."""
    place, mesh = t.placements[0], t.device_mesh
    if isinstance(place, Replicate):
        return None
    if not isinstance(place, Shard) or mesh.ndim != 1:
        raise ValueError(f"a DTensor placed {t.placements} on a {mesh.ndim}-D mesh: load_sharded reads Shard or "
                         "Replicate on one mesh dimension")
    dim, size = place.dim % t.dim(), t.shape[place.dim]
    chunk = -(-size // mesh.size())
    lo = min(mesh.get_local_rank() * chunk, size)
    return (slice(None),) * dim + (slice(lo, min(lo + chunk, size)),)


def load_sharded(model: torch.nn.Module, path, *, device=None) -> None:
    """Fill a parallelized model (``parallelize``; its layers may be empty, on the meta device) from the whole
    model's safetensors checkpoint (this library's format: ``save_file(model.state_dict(), ...)``, one file or a
    directory), each rank reading only its slices (``safe_open(...).get_slice``). ``device``: where the tensors go
    (default: where each of the model's is; required for meta ones). Missing or surplus checkpoint tensors, and
    slices whose shape is not the model's, raise ValueError."""
    want = model.state_dict(keep_vars=True)
    sharded = {name: m for name, m in model.named_modules()
               if isinstance(m, QuantizedLinear) and getattr(m, "tp_shard", None) is not None}
    local = {}
    with _opened(path) as where:
        lacking = {"the checkpoint has no": [k for k in want if k not in where],
                   "the model has no place for": [k for k in where if k not in want]}
        if any(lacking.values()):
            raise ValueError(f"{path}: " + "; ".join(
                f"{what} {', '.join(keys[:5])}{' ...' * (len(keys) > 5)} ({len(keys)} tensors)"
                for what, keys in lacking.items() if keys))
        for key, t in want.items():
            prefix, _, name = key.rpartition(".")
            index = None
            if prefix in sharded:
                s = sharded[prefix].tp_shard
                rule = _layout(linear_recipe(sharded[prefix].recipe), s.kind)[0].get(name)
                index = None if rule is None else _index(rule, s.per_shard, s.rank)
            elif isinstance(t, DTensor):
                index = _dtensor_index(t)
            f = where[key]
            value = f.get_tensor(key) if index is None else f.get_slice(key)[index]
            mine = t.to_local() if isinstance(t, DTensor) else t
            if value.shape != mine.shape:
                raise ValueError(f"{key}: the checkpoint's slice is {tuple(value.shape)}, the model's shard "
                                 f"{tuple(mine.shape)}: a checkpoint of another model, recipe or split")
            target = device if device is not None else mine.device
            if torch.device(target).type == "meta":
                raise ValueError(f"{key} is on the meta device: pass device= to load_sharded")
            value = value.to(target)
            if isinstance(t, DTensor):
                value = DTensor.from_local(value, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                           stride=t.stride())
            local[key] = value
    model.load_state_dict(local, strict=True, assign=any(t.device.type == "meta" for t in want.values()))
