"""convert's report names every parameter it leaves in high precision, with the reason (CPU: the reference
quantizers convert the layers; transformers builds tiny models)."""

import warnings

import pytest
import torch

from cutedsl_gemm import nn as cnn

transformers = pytest.importorskip("transformers")


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=512)
    return MixtralForCausalLM(config).to(torch.bfloat16)


def _llama(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _accounted(model, report):
    """Every parameter is a converted layer's or listed in ``kept`` (once), and the element counts add up."""
    converted = {id(p) for name in report.converted for p in model.get_submodule(name).parameters()}
    named = dict(model.named_parameters())
    assert set(report.kept) <= set(named)
    kept = {id(named[n]) for n in report.kept}
    everything = {id(p) for p in model.parameters()}
    assert kept | converted >= everything and not kept & converted
    assert report.kept_elements == sum(named[n].numel() for n in report.kept)


def test_moe_experts_are_listed_and_warned_about():
    model = _mixtral()
    with pytest.warns(UserWarning, match="left mixture-of-experts weights in high precision"):
        report = cnn.convert(model, "row", experts=False)
    experts = [n for n in report.kept if n.endswith(("gate_up_proj", "down_proj")) and ".experts." in n]
    assert len(experts) == 4 and all("mixture-of-experts weights are not converted" in report.kept[n]
                                     for n in experts)
    assert "embedding table" in report.kept["model.embed_tokens.weight"]
    assert "MixtralTopKRouter" in report.kept["model.layers.0.mlp.gate.weight"]
    assert report.kept_elements / report.total_elements > 0.5
    text = str(report)
    assert "kept in high precision" in text and "3-D weight of MixtralExperts" in text
    _accounted(model, report)


def test_moe_experts_are_converted_by_default():
    model = _mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every MoE weight quantized: no warning
        report = cnn.convert(model, "row")
    named = dict(model.named_parameters())
    assert report.converted_experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(isinstance(model.get_submodule(n), cnn.QuantizedExperts) for n in report.converted_experts)
    assert not any(named[n].dim() == 3 for n in report.kept if n in named)
    assert not any(".experts." in n for n in report.kept)
    assert "MixtralTopKRouter" in report.kept["model.layers.0.mlp.gate.weight"]
    assert report.kept_elements / report.total_elements < 0.5
    assert "and 2 experts modules converted" in str(report)


@pytest.mark.parametrize("recipe", ["int8", "int4_weight", "mxfp8"])
def test_experts_a_recipe_cannot_take_are_skipped_listed_and_warned_about(recipe):
    model = _mixtral()
    with pytest.warns(UserWarning, match="left mixture-of-experts weights in high precision"):
        report = cnn.convert(model, recipe)
    assert not report.converted_experts
    for n in ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"):
        why = report.skipped[n]
        assert f"recipe {recipe!r} has no grouped GEMM" in why
        assert "per-tensor, row-wise and DeepSeek-V3 block scales" in why
        assert "\n" not in why and type(model.get_submodule(n)).__name__ == "MixtralExperts"
        for p in ("gate_up_proj", "down_proj"):
            assert report.kept[f"{n}.{p}"] == f"of a skipped experts module (MixtralExperts) ({why})"
    _accounted(model, report)


@pytest.mark.parametrize("tied", [False, True])
def test_dense_model_lists_embeddings_norms_and_skipped_layers(tied):
    model = _llama(tied)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no MoE weights: no warning
        report = cnn.convert(model, "row")
    assert "model.norm.weight" in report.kept and "1-D parameter" in report.kept["model.norm.weight"]
    assert ("lm_head" in report.skipped) == tied
    assert ("lm_head.weight" in report.kept) == (not tied) is False or not tied  # converted when untied
    if not tied:
        assert "lm_head" in report.converted and "lm_head.weight" not in report.kept
    _accounted(model, report)


def test_a_filtered_layer_is_kept_with_the_reason():
    model = _llama(False)
    report = cnn.convert(model, "row", filter=lambda name, m: name != "lm_head")
    assert report.skipped["lm_head"] == "excluded by filter"
    assert report.kept["lm_head.weight"] == "of a skipped nn.Linear (excluded by filter)"
    _accounted(model, report)
