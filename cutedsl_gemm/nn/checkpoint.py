"""``from_pretrained``: a causal language model from a local transformers checkpoint (``config.json`` and
``*.safetensors``), its linear layers as ``QuantizedLinear``: an FP8 checkpoint's layers adopted as stored (the FP8
bytes and their scales, no re-quantization), or a bf16 / fp16 / fp32 checkpoint's layers quantized one by one while
loading, so that the high-precision model never sits in memory whole; mixture-of-experts weights likewise, into
``QuantizedExperts`` (:mod:`cutedsl_gemm.nn.checkpoint_experts`). The checkpoint's format and its reading are in
:mod:`cutedsl_gemm.nn.checkpoint_format`.

FP8 formats adopted (``quantization_config`` in ``config.json``):

* transformers' FineGrainedFP8 (``quant_method "fp8"``, ``weight_block_size [128, 128]``; DeepSeek-V3 / R1,
  Qwen3-FP8): ``weight`` e4m3 (N, K), ``weight_scale_inv`` (ceil(N/128), ceil(K/128)), which multiplies the codes
  (W = weight * weight_scale_inv per 128x128 block; fp32, or E8M0 with ``scale_fmt "ue8m0"``) -> recipe "deepseek",
  ``weight_scale`` = its transpose in fp32;
* compressed-tensors FP8 (``quant_method "compressed-tensors"``, 8-bit float weights): ``weight`` e4m3 and
  ``weight_scale`` (N, 1) per channel -> "row" ((1, N)); a per-tensor ``weight_scale`` -> "tensor" where the
  activations are per tensor, "row" (the one scale on every channel) where they are dynamic per token; 128x128
  blocks with per-token groups of 128 -> "deepseek";
* transformers' fbgemm FP8 (``quant_method "fbgemm_fp8"``): ``weight`` e4m3, ``weight_scale`` (N, 1), dynamic
  per-token activations -> "row" (the checkpoint's ``activation_scale_ub`` clamp is not applied).

Static per-tensor activation scales (``input_scale``, ``activation_scale``) load into layers built with
``input_scale=True`` (recipe "tensor"), and are refused for the other recipes.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from typing import Callable, Optional

import torch

from . import checkpoint_experts as X
from .checkpoint_format import (
    FP8_DTYPES,
    OWN_METHOD,
    Checkpoint,
    Fp8Format,
    checkpoint_format,
    dequantized,
    kernel_scale,
    quant_method,
    read_scale,
    renamer,
    unquantized_by_config,
)
from .convert import ConversionReport, _holders, _list_kept
from .linear import FORMAT_VERSION, QuantizedLinear, read_format_tag, target_arch, unsupported
from .moe import QuantizedExperts, _layout, is_experts
from .recipes import STATIC_INPUT_RECIPES, linear_recipe

DEQUANTIZED = "dequantized from the checkpoint's FP8 to {dtype}"


# --- building the model --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta():
    """Build modules with their parameters on the meta device (nothing allocated) and their buffers as their code
    computes them (rotary frequencies and the like, which no checkpoint holds)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _skeleton(config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


# --- filling the layers --------------------------------------------------------------------------------------------


def _local_directory(path) -> str:
    """``path`` if it is a directory, else the local hub cache's snapshot of the model id ``path`` (nothing is
    downloaded)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True, allow_patterns=["*.json", "*.safetensors"])
    except Exception as e:
        raise ValueError(f"{path!r} is no local directory and no model in the local hub cache ({type(e).__name__}): "
                         "from_pretrained reads a directory with config.json and *.safetensors") from None


def _static_input_scale_refused(recipe: str) -> Optional[str]:
    """Why a layer of ``recipe`` cannot hold a static activation scale (``QuantizedLinear(..., input_scale=True)``),
    or None."""
    if recipe not in STATIC_INPUT_RECIPES:
        return (f"a static input scale is taken with recipe {' or '.join(map(repr, STATIC_INPUT_RECIPES))} "
                f"(per-tensor weights and activations), not {recipe!r}, whose activation scales are computed on every "
                "call")
    return None


def _set(model, holders: dict, param, value: torch.Tensor):
    """Put ``value`` in place of ``param`` in every module that holds it (tied parameters stay tied)."""
    new = torch.nn.Parameter(value, requires_grad=False)
    for name, module in holders.get(id(param), ()):
        module._parameters[name.rsplit(".", 1)[-1]] = new


def _replace(model, name: str, module: torch.nn.Module):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def from_pretrained(path, recipe: Optional[str] = None, *, device="cuda", dtype: torch.dtype = torch.bfloat16,
                    filter: Optional[Callable[[str, torch.nn.Module], bool]] = None):
    """A causal language model (``transformers.AutoModelForCausalLM``) from the local checkpoint ``path`` (a
    directory with ``config.json`` and ``*.safetensors``, or a model id in the local hub cache: nothing is
    downloaded), its linear layers ``QuantizedLinear`` on ``device`` (the CPU builds and fills them; they run on GPUs):
    ``(model, report)``, the report a :class:`ConversionReport` (``converted``: the layers adopted or quantized;
    ``skipped`` and ``kept``: everything left in high precision, with the reason).

    An FP8 checkpoint (the module docstring lists the formats) is adopted bit for bit: each quantized layer's FP8
    bytes and scales as stored, the scales mapped once into the kernel's layout; ``recipe`` may be None or the
    format's recipe (another is refused). An unquantized checkpoint is quantized while loading with ``recipe``
    (required), one layer at a time: the same bits as ``convert(model, recipe)`` on the model loaded whole, the
    peak memory about the quantized model plus one layer in high precision. Mixture-of-experts weights (per expert
    or fused in the checkpoint) become ``QuantizedExperts``, adopted from FP8 or quantized on load as
    :mod:`cutedsl_gemm.nn.checkpoint_experts` says, or load in ``dtype`` with the reason. Every other tensor
    (embeddings, norms, the LM head, the layers the checkpoint leaves unquantized) loads as stored, floating point
    cast to ``dtype``; tied weights stay tied; keys are read under the names transformers renames them to.
    ``filter(name, module)`` false leaves a linear layer or experts module in ``dtype`` (an FP8 one dequantized). An
    FP8 layer whose shape the kernels refuse is dequantized to ``dtype``, with a warning and the reason in the
    report; a layout they cannot run (blocks other than 128x128, weight-only FP8, a static activation scale the layer
    cannot hold) or an unknown ``quant_method`` raises ValueError, and so do checkpoint tensors the model has no
    place for.
    """
    from transformers import AutoConfig

    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} and no GPU is visible: pass device='cpu' to build the model on the "
                         "CPU (its QuantizedLinear layers run on GPUs)")
    path = _local_directory(path)
    config = AutoConfig.from_pretrained(path)
    if quant_method(config) == OWN_METHOD:
        return _from_own_checkpoint(path, config, recipe, device, dtype, filter)
    fmt = checkpoint_format(config)
    if fmt is not None and recipe is not None and linear_recipe(recipe).name != fmt.recipe:
        raise ValueError(f"{path}: the checkpoint is {fmt.name}, which runs as recipe {fmt.recipe!r}; pass "
                         f"recipe=None (or {fmt.recipe!r}) to adopt its FP8 weights as they are")
    if fmt is None and recipe is None:
        raise ValueError(f"{path}: the checkpoint is not quantized; pass recipe= (e.g. 'row', 'deepseek') to quantize "
                         "it while loading")
    why = None if fmt is None or fmt.input_scale_key is None else _static_input_scale_refused(fmt.recipe)
    if why is not None:
        raise ValueError(f"{path}: {fmt.name} with static activation scales ({fmt.input_scale_key}): {why}")
    r = linear_recipe(fmt.recipe if fmt is not None else recipe)
    arch = target_arch(r, device)
    ckpt = Checkpoint(path, renamer(config))
    try:
        model = _skeleton(config, dtype)
        report = _load(model, ckpt, fmt, r, arch, device, dtype, filter)
    finally:
        ckpt.close()
    return model, report


# --- this library's own checkpoints ---------------------------------------------------------------------------------


def save_pretrained(model, path, *, max_shard_size="5GB") -> None:
    """Save a transformers model converted by this library (``convert``, ``from_pretrained``) as a checkpoint that
    ``from_pretrained(path)`` loads back as it is: ``config.json`` with ``quantization_config`` ``{"quant_method":
    "cutedsl_gemm", "recipe": ...}`` and the state dict in safetensors (sharded above ``max_shard_size``, with
    ``model.safetensors.index.json``; a tied tensor once, under its first name): the quantized layers' buffers in
    their saved format (format tag in ``_extra_state``), everything else as the model holds it. A model with no
    ``QuantizedLinear`` / ``QuantizedExperts`` is refused, and so is one mixing recipes (a checkpoint holds one)."""
    import json

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from .hf_quantizer import CuteDslGemmConfig

    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        raise ValueError(f"save_pretrained saves a transformers model (with its config); got {type(model).__name__}")
    layers = [m for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedExperts))]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no cutedsl_gemm layers (QuantizedLinear, QuantizedExperts): "
                         "convert it first, or save it with its own save_pretrained")
    recipes = sorted({m.recipe for m in layers})
    if len(recipes) > 1:
        raise ValueError(f"the model's layers run recipes {', '.join(map(repr, recipes))}: a cutedsl_gemm checkpoint "
                         "holds one recipe")
    state, seen, storages = {}, set(), set()
    for name, t in model.state_dict().items():
        ptr = t.untyped_storage().data_ptr()
        ident = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and ident in seen:
            continue  # a tied tensor's second name: loading ties it again
        seen.add(ident)
        # another part of a storage already saved (a fused MLP's gate and up halves): a copy of its own, as
        # safetensors stores each storage once
        state[name] = t.detach().clone() if t.numel() and ptr in storages else t.detach().contiguous()
        storages.add(ptr)
    os.makedirs(path, exist_ok=True)
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size,
                                               filename_pattern="model{suffix}.safetensors")
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, os.path.join(path, filename), metadata={"format": "pt"})
    if split.is_sharded:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=1)
    config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    experts = any(isinstance(m, QuantizedExperts) for m in layers)
    saved["quantization_config"] = CuteDslGemmConfig(recipe=recipes[0], experts=experts).to_dict()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)


def _from_own_checkpoint(path, config, recipe, device, dtype, filter):
    """``from_pretrained`` of a checkpoint ``save_pretrained`` wrote: each saved layer built empty from its format
    tag and filled by its own ``load_state_dict`` (which checks the tag, the dtypes and the shapes)."""
    if filter is not None:
        raise ValueError(f"{path}: a cutedsl_gemm checkpoint loads its layers as saved; filter= applies when "
                         "quantizing or adopting an FP8 checkpoint")
    ckpt = Checkpoint(path)  # the names save_pretrained wrote: the model's own
    try:
        model = _skeleton(config, dtype)
        holders = _holders(model)
        by_module: dict = {}
        for key in ckpt.where:
            by_module.setdefault(key.rpartition(".")[0], []).append(key)
        take, skipped = {}, {}
        for name, module in model.named_modules():
            tag = f"{name}._extra_state"
            if tag not in ckpt:
                if type(module) is torch.nn.Linear or is_experts(module):
                    skipped[name] = "stored unquantized in the checkpoint"
                continue
            version, saved = read_format_tag(bytes(ckpt.get(tag).tolist()), name)
            if version > FORMAT_VERSION:  # (the layer's own load says it too; here before anything is built)
                raise ValueError(f"{name}: the checkpoint holds format version {version} of cutedsl_gemm's layers "
                                 f"and this cutedsl_gemm reads versions up to {FORMAT_VERSION}; upgrade cutedsl_gemm")
            if recipe is not None and linear_recipe(recipe).name != saved:
                raise ValueError(f"{path}: {name} holds recipe {saved!r} layers; pass recipe=None (or {saved!r}) to "
                                 "load them as saved")
            if is_experts(module):
                e, h, i, _ = _layout(module)
                layer = QuantizedExperts(e, h, i, saved, device=device)
            elif type(module) is torch.nn.Linear:
                layer = QuantizedLinear(module.in_features, module.out_features, module.bias is not None, saved,
                                        device=device, dtype=dtype, input_scale=f"{name}.input_scale" in ckpt)
            else:
                raise ValueError(f"{name}: the checkpoint holds a cutedsl_gemm layer where the model has a "
                                 f"{type(module).__name__}")
            take[name] = (module, layer)
        recipes = sorted({layer.recipe for _, layer in take.values()})
        names = list(take)
        experts = [n for n, (_, layer) in take.items() if isinstance(layer, QuantizedExperts)]
        report = ConversionReport(",".join(recipes), converted=names, converted_experts=experts, skipped=skipped)
        _list_kept(model, report, {id(module): None for module, _ in take.values()})
        used = set()
        for name, (_, layer) in take.items():
            keys = by_module.get(name, [])
            layer.load_state_dict({k[len(name) + 1:]: ckpt.get(k) for k in keys}, strict=True)
            _replace(model, name, layer)
            used.update(keys)
        _load_rest(model, ckpt, holders, device, dtype, used)
        model.to(device)
    finally:
        ckpt.close()
    return model, report


def _plan(model, ckpt: Checkpoint, fmt: Optional[Fp8Format], r, arch, dtype, filter, holders) -> tuple:
    """(layers to fill as QuantizedLinear: name -> module, skipped: name -> why, FP8 layers to dequantize)."""
    take, skipped, dequantize, checked = {}, {}, set(), {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        key = f"{name}.weight"
        fp8 = fmt is not None and key in ckpt and ckpt.dtype(key) in FP8_DTYPES
        others = [n for n, holder in holders.get(id(module.weight), ()) if holder is not module]
        if fmt is not None and not fp8:
            if others:
                skipped[name] = f"its weight is tied to {', '.join(others)}, stored unquantized in the checkpoint"
            elif unquantized_by_config(name, fmt.unquantized):
                skipped[name] = f"left unquantized by the checkpoint ({fmt.source})"
            else:
                skipped[name] = f"stored unquantized in the checkpoint ({ckpt.dtype(key) if key in ckpt else 'absent'})"
            continue
        if fp8 and f"{name}.{fmt.scale_key}" not in ckpt:
            raise ValueError(f"{key} is FP8 in the checkpoint and {name}.{fmt.scale_key} is absent")
        why = None
        if type(module) is not torch.nn.Linear:
            why = (f"{type(module).__name__} subclasses nn.Linear and its owner may read .weight: only nn.Linear "
                   "itself is converted")
        elif filter is not None and not filter(name, module):
            why = "excluded by filter"
        elif others:
            why = f"its weight is tied to {', '.join(others)}: quantizing it would untie them"
        if why is None:
            shape = (module.out_features, module.in_features, dtype, module.bias is not None, arch)
            if shape not in checked:
                checked[shape] = unsupported(r, *shape)
            why = checked[shape]
        if why is None:
            take[name] = module
            continue
        if fp8:
            dequantize.add(name)
            why = f"{why}; {DEQUANTIZED.format(dtype=str(dtype).replace('torch.', ''))}"
        skipped[name] = why
    return take, skipped, dequantize


def _load(model, ckpt: Checkpoint, fmt, r, arch, device, dtype, filter) -> ConversionReport:
    holders = _holders(model)
    take, skipped, dequantize = _plan(model, ckpt, fmt, r, arch, dtype, filter, holders)
    experts = X.find_experts(model, ckpt)
    experts_take, experts_skipped, experts_dequantize = X.plan(experts, ckpt, fmt, r, arch, filter, holders)
    skipped.update(experts_skipped)
    names = [src.name for src in experts_take]
    report = ConversionReport(r.name, converted=list(take) + names, converted_experts=names, skipped=skipped)
    _list_kept(model, report, {id(m): None for m in [*take.values(), *(src.module for src in experts_take)]})
    if dequantize or experts_dequantize:
        count = len(dequantize) + len(experts_dequantize)
        warnings.warn(f"{count} FP8 layers or experts modules of the checkpoint are loaded dequantized to {dtype} "
                      "(print the report for why)", UserWarning, stacklevel=3)
    if experts_skipped:
        warnings.warn(f"from_pretrained left the mixture-of-experts weights of {len(experts_skipped)} experts modules "
                      "in high precision: print the ConversionReport for why", UserWarning, stacklevel=3)
    used = set()
    for name, module in take.items():
        _replace(model, name, _fill(ckpt, name, module, fmt, r, device, dtype, used))
    for name in dequantize:
        module = model.get_submodule(name)
        q, s = ckpt.get(f"{name}.weight"), read_scale(ckpt, f"{name}.{fmt.scale_key}", fmt)
        _set(model, holders, module.weight, dequantized(q, s, fmt.recipe, name).to(device, dtype))
        used.update((f"{name}.weight", f"{name}.{fmt.scale_key}"))
    converting = {id(src) for src in experts_take}
    for src in experts:  # one module's weights in memory at a time
        layer = X.fill(ckpt, src, fmt, r, device, dtype, convert=id(src) in converting)
        if layer is not None:
            _replace(model, src.name, layer)
        used.update(k for k in src.keys(fmt.scale_key if fmt is not None else None) if k in ckpt)
    _load_rest(model, ckpt, holders, device, dtype, used)
    model.to(device)  # the buffers the code computed
    return report


def _fill(ckpt: Checkpoint, name: str, module: torch.nn.Linear, fmt, r, device, dtype, used: set) -> QuantizedLinear:
    """The QuantizedLinear of ``module`` from the checkpoint: adopted (FP8) or quantized from its weight."""
    n, k, has_bias = module.out_features, module.in_features, module.bias is not None
    keys = [f"{name}.weight"] + ([f"{name}.bias"] if has_bias else [])
    missing = [key for key in keys if key not in ckpt]
    if missing:
        raise ValueError(f"the checkpoint has no {', '.join(missing)}")
    # the bias in fp32: as stored (FP8 checkpoints), or through dtype as the model loaded whole holds it (convert)
    bias = ckpt.get(f"{name}.bias").to(device, torch.float32 if fmt is not None else dtype) if has_bias else None
    bias = bias.to(torch.float32) if bias is not None else None
    used.update(keys)
    if fmt is None:  # quantize while loading: only this layer's weight in high precision
        with torch.device("meta"):
            linear = torch.nn.Linear(k, n, bias=False)
        linear.weight = torch.nn.Parameter(ckpt.get(keys[0]).to(device, dtype), requires_grad=False)
        layer = QuantizedLinear.quantized(linear, r)
        del linear
        layer.bias = bias
        return layer
    static = fmt.input_scale_key is not None
    layer = QuantizedLinear(k, n, has_bias, r.name, device=device, dtype=dtype, **({"input_scale": True} if static
                                                                                   else {}))
    q, s = ckpt.get(keys[0]), read_scale(ckpt, f"{name}.{fmt.scale_key}", fmt)
    used.add(f"{name}.{fmt.scale_key}")
    if tuple(q.shape) != (n, k):
        raise ValueError(f"{keys[0]}: shape {tuple(q.shape)}, the model's layer is ({n}, {k})")
    if s.dtype not in fmt.scale_dtypes:
        raise ValueError(f"{name}.{fmt.scale_key}: scales in {s.dtype}, expected one of {fmt.scale_dtypes}")
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(kernel_scale(r.name, s, n, k, f"{name}.{fmt.scale_key}"))
        if bias is not None:
            layer.bias.copy_(bias)
        if static:
            key = f"{name}.{fmt.input_scale_key}"
            if key not in ckpt:
                raise ValueError(f"the checkpoint declares static activation scales and has no {key}")
            layer.input_scale.copy_(ckpt.get(key).to(torch.float32).reshape(layer.input_scale.shape))
            used.add(key)
    return layer


def _load_rest(model, ckpt: Checkpoint, holders: dict, device, dtype, used: set):
    """Every other parameter and persistent buffer, as stored (floating point cast to the skeleton's dtype, which
    is ``dtype``); then nothing may be left on the meta device, and no checkpoint tensor unread."""
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    loaded: set = set()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        if id(t) in loaded and name in ckpt:
            used.add(name)  # a tied parameter's second name
        if name in used or id(t) in loaded:
            continue
        if name not in ckpt:
            continue
        value = ckpt.get(name)
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} in the checkpoint, {tuple(t.shape)} in the model")
        if value.element_size() == 1 and value.dtype.is_floating_point and t.dtype != value.dtype:
            raise ValueError(f"{name} is {value.dtype} in the checkpoint and {t.dtype} in the model: FP8 tensors are "
                             "taken only as the weights of the linear layers the checkpoint's format quantizes")
        value = value.to(device, t.dtype if t.dtype.is_floating_point and value.dtype.is_floating_point else None)
        if isinstance(t, torch.nn.Parameter):
            _set(model, holders, t, value)
        else:
            parent, _, buf = name.rpartition(".")
            (model.get_submodule(parent) if parent else model)._buffers[buf] = value
        loaded.add(id(t))
        used.add(name)
    left = sorted(name for name, t in model.named_parameters() if t.device.type == "meta")
    if left:
        raise ValueError(f"the checkpoint has no {', '.join(left[:5])}{' ...' if len(left) > 5 else ''} "
                         f"({len(left)} tensors)")
    extra = sorted(key for key in ckpt.where if key not in used and not any(p.search(key) for p in ignored))
    if extra:
        raise ValueError(f"checkpoint tensors the model has no place for: {', '.join(extra[:5])}"
                         f"{' ...' if len(extra) > 5 else ''} ({len(extra)} tensors)")
