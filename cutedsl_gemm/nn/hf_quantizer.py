"""transformers' own loading route: ``AutoModel*.from_pretrained(path, quantization_config=CuteDslGemmConfig(...))``.

    from transformers import AutoModelForCausalLM
    from cutedsl_gemm.nn.hf_quantizer import CuteDslGemmConfig   # registers the method with transformers

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                 quantization_config=CuteDslGemmConfig(recipe="row"))
    print(model.cutedsl_gemm_report)                             # what was converted, skipped and kept

The checkpoint loads as transformers loads it (any dtype, sharded or not, ``device_map``), then ``convert`` quantizes
the model in place with the config's recipe: the same layers, bits and ``ConversionReport`` as
``cnn.convert(model, recipe)`` on the model loaded whole. ``modules_to_not_convert`` (module names or
``fnmatch`` patterns, e.g. ``["lm_head"]``) stay in the checkpoint's dtype, each listed with its reason;
``experts=False`` keeps mixture-of-experts experts in high precision. For the FP8 checkpoints this library adopts
as stored (FineGrainedFP8, compressed-tensors, fbgemm FP8) and a lower peak memory while quantizing, use
``cnn.from_pretrained``, which loads one layer at a time. A model quantized this way is saved with
``cnn.save_pretrained(model, path)`` and loaded back with ``cnn.from_pretrained(path)`` (transformers' own
``save_pretrained`` refuses it: its FP8 buffers have no transformers loader).
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Optional

from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .convert import convert
from .recipes import linear_recipe

QUANT_METHOD = "cutedsl_gemm"


class CuteDslGemmConfig(QuantizationConfigMixin):
    """``quantization_config`` of ``from_pretrained``: quantize the loaded model with ``cnn.convert``.

    ``recipe``: a ``cnn.LINEAR_RECIPES`` name ("row", "deepseek", "tensor", "int8", "int4_weight", ...; checked
    here). ``modules_to_not_convert``: names or ``fnmatch`` patterns of modules kept in high precision.
    ``experts``: also quantize mixture-of-experts experts modules (``convert``'s ``experts``)."""

    def __init__(self, recipe: str = "row", modules_to_not_convert: Optional[list] = None, experts: bool = True,
                 **kwargs):
        self.quant_method = QUANT_METHOD
        self.recipe = linear_recipe(recipe).name  # a bad name fails here, before anything loads
        if modules_to_not_convert is not None and (isinstance(modules_to_not_convert, str) or not all(
                isinstance(m, str) for m in modules_to_not_convert)):
            raise TypeError(f"modules_to_not_convert must be a list of module names or patterns, got "
                            f"{modules_to_not_convert!r}")
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        if not isinstance(experts, bool):
            raise TypeError(f"experts must be True or False, got {experts!r}")
        self.experts = experts
        if kwargs:
            raise TypeError(f"CuteDslGemmConfig takes recipe, modules_to_not_convert and experts; got "
                            f"{', '.join(sorted(kwargs))}")

    def to_dict(self) -> dict:
        return {"quant_method": self.quant_method, "recipe": self.recipe,
                "modules_to_not_convert": list(self.modules_to_not_convert), "experts": self.experts}

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        d = {k: v for k, v in dict(config_dict).items() if k != "quant_method"}
        config = cls(**d)
        return (config, kwargs) if return_unused_kwargs else config


class CuteDslGemmHfQuantizer(HfQuantizer):
    """Loads the checkpoint unchanged, then ``convert``s the model (``_process_model_after_weight_loading``) and
    keeps the ``ConversionReport`` as ``model.cutedsl_gemm_report``."""

    requires_calibration = False

    def __init__(self, quantization_config: CuteDslGemmConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        if self.pre_quantized:
            raise ValueError("this checkpoint's config.json names quant_method 'cutedsl_gemm' (saved by "
                             "cutedsl_gemm.nn.save_pretrained): load it with cutedsl_gemm.nn.from_pretrained(path), "
                             "which takes its layers as saved, not through transformers' loader")

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False  # every tensor loads as stored; convert quantizes after loading

    def _process_model_after_weight_loading(self, model, **kwargs):
        cfg = self.quantization_config
        skip = cfg.modules_to_not_convert

        def wanted(name, module):
            return not any(name == pattern or fnmatch(name, pattern) for pattern in skip)

        model.cutedsl_gemm_report = convert(model, cfg.recipe, filter=wanted if skip else None,
                                            experts=cfg.experts)
        return model

    def is_serializable(self, safe_serialization=None):
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Make ``quant_method="cutedsl_gemm"`` known to transformers (done on import of this module; idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(CuteDslGemmConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(CuteDslGemmHfQuantizer)


register()
