"""Reading a local safetensors checkpoint for ``from_pretrained``: the FP8 format its config declares
(``checkpoint_format``; the formats are listed in :mod:`cutedsl_gemm.nn.checkpoint`), its tensors one at a time
(``Checkpoint``), and an FP8 weight's scales in the layout the kernels take (``kernel_scale``) or applied
(``dequantized``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Callable, Optional

import torch

from .recipes import linear_recipe

FP8_DTYPES = ("F8_E4M3",)  # safetensors names of the FP8 weights adopted
BLOCK = 128  # the "deepseek" recipe's weight block (128 x 128)


# --- the checkpoint's format ---------------------------------------------------------------------------------------


class Fp8Format:
    """An FP8 checkpoint format: the recipe its layers run, the name of the weight's scale tensor, of a static
    activation scale (None: dynamic), the module names the config leaves unquantized (patterns) and why."""

    def __init__(self, name: str, recipe: str, scale_key: str, input_scale_key: Optional[str], unquantized: list,
                 source: str, scale_dtypes=(torch.float32, torch.bfloat16, torch.float16)):
        self.name, self.recipe, self.scale_key, self.input_scale_key = name, recipe, scale_key, input_scale_key
        self.unquantized, self.source, self.scale_dtypes = list(unquantized or ()), source, scale_dtypes
        self.e8m0_bytes = False


def _fine_grained_fp8(q: dict) -> Fp8Format:
    block = q.get("weight_block_size")
    if block is None or list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"FineGrainedFP8 checkpoint with weight_block_size {block}: the kernels run 128x128 weight "
                         "blocks (recipe 'deepseek') only")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise ValueError(f"FineGrainedFP8 checkpoint with expert_dtype {q['expert_dtype']!r}: only FP8 is taken")
    scheme = str(q.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"FineGrainedFP8 activation_scheme {scheme!r}: expected 'dynamic' or 'static'")
    skip = q.get("modules_to_not_convert", q.get("ignored_layers"))
    fmt = Fp8Format("FineGrainedFP8 (128x128 blocks)", "deepseek", "weight_scale_inv",
                    "activation_scale" if scheme == "static" else None, skip,
                    "quantization_config.modules_to_not_convert",
                    scale_dtypes=(torch.float32, torch.bfloat16, torch.float8_e8m0fnu))
    fmt.e8m0_bytes = q.get("scale_fmt", "float") == "ue8m0"  # power-of-two scales, saved as their exponent bytes
    return fmt


def _fbgemm_fp8(q: dict) -> Fp8Format:
    return Fp8Format("fbgemm FP8 (per-channel weights, per-token activations)", "row", "weight_scale", None,
                     q.get("modules_to_not_convert"), "quantization_config.modules_to_not_convert")


def _ct_recipe(group: str, scheme: dict) -> tuple:
    """(recipe, static) for one compressed-tensors config group: FP8 weights and dynamic or static activations."""
    w, a = scheme.get("weights") or {}, scheme.get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors group {group!r} quantizes weights to {w.get('num_bits')}-bit "
                         f"{w.get('type')}: only FP8 weights (type 'float', num_bits 8) are adopted")
    if a is None:
        raise ValueError(f"compressed-tensors group {group!r} leaves the activations unquantized (FP8 weight-only): "
                         "the kernels quantize the activations, which would change the checkpoint's numerics")
    if a.get("type") != "float" or a.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors group {group!r}: activations {a.get('num_bits')}-bit {a.get('type')}, "
                         "expected FP8")
    ws, as_, dynamic = w.get("strategy"), a.get("strategy"), bool(a.get("dynamic"))
    if ws == "block":
        if list(w.get("block_structure") or ()) != [BLOCK, BLOCK] or as_ != "group" or a.get("group_size") != BLOCK \
                or not dynamic:
            raise ValueError(f"compressed-tensors group {group!r}: block weights {w.get('block_structure')} with "
                             f"{as_} activations; the kernels run 128x128 blocks with dynamic groups of 128")
        return "deepseek", False
    if ws not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors group {group!r}: weight strategy {ws!r}; expected 'channel', 'tensor' "
                         "or 'block'")
    if as_ == "token" and dynamic:
        return "row", False
    if as_ == "tensor":
        return ("tensor" if ws == "tensor" else "row"), not dynamic
    raise ValueError(f"compressed-tensors group {group!r}: {'dynamic' if dynamic else 'static'} {as_!r} activations; "
                     "expected dynamic per-token or per-tensor activations")


def _compressed_tensors(q: dict) -> Fp8Format:
    fmt = q.get("format", "dense")
    if fmt not in ("float-quantized", "naive-quantized", "dense"):
        raise ValueError(f"compressed-tensors format {fmt!r}: only FP8 weights stored as they are "
                         "('float-quantized', 'naive-quantized') are adopted")
    groups = q.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors checkpoint with no config_groups")
    found = {name: _ct_recipe(name, scheme) for name, scheme in groups.items()}
    if len(set(found.values())) > 1:
        raise ValueError(f"compressed-tensors groups of different schemes ({found}): one recipe per model is taken")
    recipe, static = next(iter(found.values()))
    return Fp8Format(f"compressed-tensors FP8 ({recipe!r})", recipe, "weight_scale", "input_scale" if static else None,
                     q.get("ignore"), "quantization_config.ignore")


FORMATS = {"fp8": _fine_grained_fp8, "fbgemm_fp8": _fbgemm_fp8, "compressed-tensors": _compressed_tensors}


#: ``quant_method`` of the checkpoints this library saves (``save_pretrained``): its own layers' buffers as stored.
OWN_METHOD = "cutedsl_gemm"


def _quantization_config(config) -> tuple:
    """(``config``'s ``quantization_config`` as a dict, its ``quant_method``), (None, None) if unquantized."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None, None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method", "")
    return q, str(getattr(method, "value", method))


def quant_method(config) -> Optional[str]:
    """``config``'s ``quantization_config.quant_method``, None for an unquantized checkpoint."""
    return _quantization_config(config)[1]


def checkpoint_format(config) -> Optional[Fp8Format]:
    """The FP8 format ``config``'s ``quantization_config`` declares, None for an unquantized checkpoint; a format
    or layout the kernels cannot run raises ValueError."""
    q, method = _quantization_config(config)
    if q is None:
        return None
    if method not in FORMATS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not adopted; FP8 checkpoints of "
                         f"quant_method {', '.join(map(repr, FORMATS))} are, and unquantized ones are quantized while "
                         "loading")
    return FORMATS[method](q)


def unquantized_by_config(name: str, patterns: list) -> bool:
    """transformers' module matching (``should_convert_module``): a prefix at a module boundary, a regex (a
    compressed-tensors ``re:`` pattern) or a suffix."""
    for p in patterns:
        p = p[3:] if p.startswith("re:") else p
        if re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", name) or name.endswith(p):
            return True
    return False


# --- reading the checkpoint ----------------------------------------------------------------------------------------


class Checkpoint:
    """The tensors of a local safetensors checkpoint (one file or shards with ``model.safetensors.index.json``),
    read one at a time, under the names the model gives them: ``rename(stored key) -> key`` (``renamer``)."""

    def __init__(self, path: str, rename: Optional[Callable[[str], str]] = None):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors files")
        self._stack = contextlib.ExitStack()
        self.where: dict = {}  # key -> (open file, stored key)
        for name in files:
            f = self._stack.enter_context(safe_open(os.path.join(path, name), framework="pt", device="cpu"))
            for stored in f.keys():
                key = rename(stored) if rename is not None else stored
                if key in self.where:
                    raise ValueError(f"{path}: {stored} and {self.where[key][1]} are both {key} for the model")
                self.where[key] = (f, stored)

    def __contains__(self, key) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        f, stored = self.where[key]
        return f.get_tensor(stored)

    def dtype(self, key: str) -> str:
        """The stored dtype's safetensors name ("F8_E4M3", "BF16", ...)."""
        f, stored = self.where[key]
        return f.get_slice(stored).get_dtype()

    def close(self):
        self._stack.close()


def renamer(config) -> Optional[Callable[[str], str]]:
    """The renamings transformers applies to this model type's checkpoint keys while loading (Mixtral's
    ``block_sparse_moe`` -> ``mlp``, ...), as a function of the stored key; None where there are none. Merges of
    several tensors into one (per-expert weights into 3-D ones) are not renamings: ``checkpoint_experts`` reads
    those."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:  # a transformers without checkpoint conversions renames nothing
        return None
    renamings = [m for m in (get_checkpoint_conversion_mapping(config.model_type) or [])
                 if isinstance(m, WeightRenaming)]
    return (lambda key: apply_renamings(key, renamings)) if renamings else None


def kernel_scale(recipe: str, scale: torch.Tensor, n: int, k: int, where: str) -> torch.Tensor:
    """A checkpoint's FP8 weight scale (multiplying the codes) in the layout ``QuantizedLinear.weight_scale`` holds
    for ``recipe``: "deepseek" (ceil(N/128), ceil(K/128)) -> its transpose; "row" (N, 1), (1, N), (N,) or one
    scale -> (1, N); "tensor" one scale -> (). fp32, exactly the checkpoint's values."""
    s = scale.to(torch.float32)
    if recipe == "deepseek":
        want = (-(-n // BLOCK), -(-k // BLOCK))
        if tuple(s.shape) != want:
            raise ValueError(f"{where}: block scales of shape {tuple(s.shape)}, expected {want} for a ({n}, {k}) "
                             "weight in 128x128 blocks")
        return s.t().contiguous()
    if recipe == "row" and s.numel() in (n, 1) and (s.numel() == 1 or max(s.shape, default=1) == n):
        return s.reshape(1, -1).expand(1, n).contiguous()
    if recipe == "tensor" and s.numel() == 1:
        return s.reshape(())
    raise ValueError(f"{where}: a scale of shape {tuple(s.shape)} is not recipe {recipe!r}'s for a ({n}, {k}) weight")


def dequantized(q: torch.Tensor, scale: torch.Tensor, recipe: str, where: str) -> torch.Tensor:
    """W = codes x scales in fp32, ``scale`` in the checkpoint's layout (``kernel_scale``'s input): the layer's own
    dequantization (``LinearRecipe.dequantize_weight``) of the buffers the checkpoint would fill."""
    n, k = q.shape
    return linear_recipe(recipe).dequantize_weight(q, kernel_scale(recipe, scale, n, k, where), None, None, k)


def read_scale(ckpt: Checkpoint, key: str, fmt: Fp8Format) -> torch.Tensor:
    """The scale tensor ``key`` as stored (E8M0 bytes viewed as ``float8_e8m0fnu``)."""
    s = ckpt.get(key)
    return s.view(torch.float8_e8m0fnu) if s.dtype == torch.uint8 and fmt.e8m0_bytes else s
