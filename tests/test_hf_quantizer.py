"""transformers' loading route (``from_pretrained(..., quantization_config=CuteDslGemmConfig(...))``) on CPU: the
model loads as stored, then ``convert`` quantizes it: the same bits and report as ``convert`` on the model loaded
whole, modules kept by name or pattern, experts, and clear errors for bad configs."""

import warnings

import pytest
import torch
import transformers

import cutedsl_gemm.nn as cnn
from cutedsl_gemm.nn.hf_quantizer import QUANT_METHOD, CuteDslGemmConfig, register


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def _load(path, **config):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                             quantization_config=CuteDslGemmConfig(**config))


@pytest.mark.parametrize("recipe", ["row", "deepseek", "int8"])
def test_loads_then_converts_with_the_same_bits_as_convert(llama_dir, recipe):
    model = _load(llama_dir, recipe=recipe)
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
    report = cnn.convert(ref, recipe)
    assert model.cutedsl_gemm_report.converted == report.converted and len(report.converted) == 15
    assert isinstance(model.model.layers[1].mlp.down_proj, cnn.QuantizedLinear)
    mine, theirs = model.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    for key, t in theirs.items():
        assert t.dtype == mine[key].dtype and torch.equal(t.view(torch.uint8), mine[key].view(torch.uint8)), key
    assert model.config.quantization_config.recipe == linear_recipe_name(recipe)


def linear_recipe_name(recipe):
    return cnn.linear_recipe(recipe).name


def test_modules_to_not_convert_by_name_and_pattern(llama_dir):
    model = _load(llama_dir, recipe="row", modules_to_not_convert=["lm_head", "model.layers.0.*"])
    report = model.cutedsl_gemm_report
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[1].self_attn.q_proj, cnn.QuantizedLinear)
    assert report.skipped["lm_head"] == "excluded by filter" and len(report.converted) == 7
    assert "of a skipped nn.Linear" in report.kept["model.layers.0.self_attn.o_proj.weight"]


def test_mixture_of_experts_through_the_route(tmp_path):
    cfg = transformers.MixtralConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                     num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(1)
    transformers.MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    model = _load(tmp_path, recipe="row")
    assert isinstance(model.model.layers[0].mlp.experts, cnn.QuantizedExperts)
    assert model.cutedsl_gemm_report.converted_experts == ["model.layers.0.mlp.experts"]
    with pytest.warns(UserWarning, match="mixture-of-experts weights in high precision"):
        kept = _load(tmp_path, recipe="row", experts=False)
    assert not isinstance(kept.model.layers[0].mlp.experts, cnn.QuantizedExperts)


def test_config_checks_and_round_trip():
    with pytest.raises(ValueError, match="nvfp8"):
        CuteDslGemmConfig(recipe="nvfp8")
    with pytest.raises(TypeError, match="list of module names"):
        CuteDslGemmConfig(modules_to_not_convert="lm_head")
    with pytest.raises(TypeError, match="takes recipe, modules_to_not_convert and experts; got group"):
        CuteDslGemmConfig(group=64)
    cfg = CuteDslGemmConfig(recipe="deepseek", modules_to_not_convert=["lm_head"], experts=False)
    d = cfg.to_dict()
    assert d == {"quant_method": QUANT_METHOD, "recipe": "deepseek", "modules_to_not_convert": ["lm_head"],
                 "experts": False}
    assert CuteDslGemmConfig.from_dict(d).to_dict() == d
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register()  # again: no error, no second registration
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    assert AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD] is CuteDslGemmConfig


def test_a_quantized_checkpoint_is_refused_with_the_way_to_load_it(llama_dir, tmp_path):
    import json
    import shutil

    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = CuteDslGemmConfig(recipe="row").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"load it with cutedsl_gemm.nn.from_pretrained\(path\)"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
