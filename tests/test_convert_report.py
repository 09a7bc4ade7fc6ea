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
        report = cnn.convert(model, "row")
    experts = [n for n in report.kept if n.endswith(("gate_up_proj", "down_proj")) and ".experts." in n]
    assert len(experts) == 4 and all("mixture-of-experts weights are not converted" in report.kept[n]
                                     for n in experts)
    assert "embedding table" in report.kept["model.embed_tokens.weight"]
    assert "MixtralTopKRouter" in report.kept["model.layers.0.mlp.gate.weight"]
    assert report.kept_elements / report.total_elements > 0.5
    text = str(report)
    assert "kept in high precision" in text and "3-D weight of MixtralExperts" in text
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
