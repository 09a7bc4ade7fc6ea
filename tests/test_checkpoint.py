"""from_pretrained on CPU: FP8 checkpoints (FineGrainedFP8, compressed-tensors, fbgemm) adopted bit for bit, an
unquantized one quantized while loading (the same bits as convert, the peak memory one layer above the quantized
model), and the checkpoints it refuses. Every checkpoint is written here: tiny transformers models, config.json
and safetensors."""

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from cutedsl_gemm import nn as cnn

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
IGNORED = "model.layers.0.self_attn.o_proj"  # a layer each FP8 checkpoint leaves in bf16 (its config says so)


def _config(kind, **over):
    if kind == "llama":
        c = transformers.LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                     tie_word_embeddings=True)
    elif kind == "qwen2":
        c = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                     tie_word_embeddings=False)
    elif kind == "qwen3_moe":
        c = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                        moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=64)
    elif kind == "mixtral":
        c = transformers.MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                       num_experts_per_tok=2)
    else:
        c = transformers.DeepseekV3Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                                          moe_intermediate_size=128, num_hidden_layers=2, first_k_dense_replace=1,
                                          n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                          num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
                                          kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                                          n_group=1, topk_group=1)
    for k, v in over.items():
        setattr(c, k, v)
    return c


def _model(kind, **over):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, **over), dtype=torch.bfloat16)
    with torch.no_grad():  # norms and biases away from their initial ones and zeros
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p))
    return model.eval()


def _state(model) -> dict:
    """The model's tensors as a checkpoint stores them (a tied LM head once, under the embedding's name)."""
    seen, out = set(), {}
    for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                      if n.rsplit(".", 1)[-1] not in
                                                      model.get_submodule(n.rpartition(".")[0])
                                                      ._non_persistent_buffers_set]:
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t.detach().contiguous()
    return out


def _quantize(w, how):
    """(codes, scale) of w (N, K) in a checkpoint's layout: 'block' (ceil(N/128), ceil(K/128)), 'channel' (N, 1),
    'tensor' (1,); the scale multiplies the codes."""
    w = w.float()
    n, k = w.shape
    if how == "block":
        pad = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
        pad[:n, :k] = w
        amax = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).abs().amax(dim=(1, 3))
        s = amax.clamp(min=1e-12) / E4M3_MAX
        full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    elif how == "channel":
        s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        full = s
    else:
        s = (w.abs().amax().clamp(min=1e-12) / E4M3_MAX).reshape(1)
        full = s
    return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def _linears(model):
    return [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]


FORMATS = {  # name -> (quantization_config, how the weights are quantized, the scale's key, recipe)
    "fp8": (dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[128, 128],
                 modules_to_not_convert=["lm_head", IGNORED]), "block", "weight_scale_inv", "deepseek"),
    "ct_channel": (dict(quant_method="compressed-tensors", format="float-quantized", ignore=["lm_head", IGNORED],
                        config_groups={"group_0": dict(
                            targets=["Linear"],
                            weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False),
                            input_activations=dict(num_bits=8, type="float", strategy="token", dynamic=True))}),
                   "channel", "weight_scale", "row"),
    "ct_tensor": (dict(quant_method="compressed-tensors", format="float-quantized", ignore=["lm_head", IGNORED],
                       config_groups={"group_0": dict(
                           targets=["Linear"],
                           weights=dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False),
                           input_activations=dict(num_bits=8, type="float", strategy="tensor", dynamic=True))}),
                  "tensor", "weight_scale", "tensor"),
    "fbgemm": (dict(quant_method="fbgemm_fp8", activation_scale_ub=1200.0, modules_to_not_convert=["lm_head", IGNORED]),
               "channel", "weight_scale", "row"),
}


def _per_expert(state: dict, name: str) -> dict:
    """The experts module ``name``'s fused tensors popped from ``state``, as hub checkpoints store them: per expert
    j ``{name}.{j}.gate_proj / up_proj / down_proj.weight`` (gate_up_proj's rows: gate first)."""
    gate_up, down = state.pop(f"{name}.gate_up_proj"), state.pop(f"{name}.down_proj")
    i = gate_up.shape[1] // 2
    out = {}
    for j in range(gate_up.shape[0]):
        for proj, w in (("gate_proj", gate_up[j, :i]), ("up_proj", gate_up[j, i:]), ("down_proj", down[j])):
            out[f"{name}.{j}.{proj}.weight"] = w.contiguous()
    return out


def _experts_names(model):
    return [n for n, m in model.named_modules() if cnn.moe.is_experts(m)]


def _write_fp8(path, model, fmt, scale_dtype=torch.float32, **qc):
    """An FP8 checkpoint of ``model`` in format ``fmt`` (FORMATS): every nn.Linear but the LM head and IGNORED
    quantized, and the routed experts per expert (the hub's layout); -> the checkpoint's tensors."""
    qconfig, how, scale_key, _ = FORMATS[fmt]
    state = _state(model)
    for name in _experts_names(model):
        state.update(_per_expert(state, name))
    expert_linears = [k[: -len(".weight")] for k in state if ".experts." in k and k.endswith("_proj.weight")]
    for name in _linears(model) + expert_linears:
        if name == "lm_head" or name == IGNORED:
            continue
        q, s = _quantize(state[f"{name}.weight"], how)
        state[f"{name}.weight"], state[f"{name}.{scale_key}"] = q, s.to(scale_dtype)
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {**qconfig, **qc}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(state, os.path.join(path, "model.safetensors"))
    return state


def _layer_dequantized(layer):
    """codes x scales in fp32 from a QuantizedLinear's buffers (weight_scale in the kernel's layout)."""
    q, s = layer.weight.float(), layer.weight_scale
    n, k = q.shape
    if layer.recipe == "deepseek":
        s = s.t().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    elif s.dim() == 2:
        s = s.t()
    return q * s


def _ckpt_dequantized(q, s, how):
    n, k = q.shape
    s = s.float()
    if how == "block":
        s = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return q.float() * s


CASES = [(kind, fmt) for kind in ("llama", "qwen2") for fmt in FORMATS] + [("deepseek_v3", "fp8")]


@pytest.mark.parametrize("kind,fmt", CASES)
def test_fp8_checkpoint_adopted_bit_for_bit(tmp_path, kind, fmt):
    model = _model(kind)
    scale_dtype = torch.bfloat16 if fmt == "ct_channel" else torch.float32  # llm-compressor stores bf16 scales
    state = _write_fp8(tmp_path, model, fmt, scale_dtype)
    _, how, scale_key, recipe = FORMATS[fmt]
    loaded, report = cnn.from_pretrained(str(tmp_path), device="cpu")

    quantized = [n for n in _linears(model) if n not in ("lm_head", IGNORED)]
    assert report.recipe == recipe and sorted(report.converted) == sorted(quantized + _experts_names(model))
    assert "left unquantized by the checkpoint" in report.skipped[IGNORED]
    assert "lm_head" in report.skipped
    for name in quantized:
        layer = loaded.get_submodule(name)
        assert isinstance(layer, cnn.QuantizedLinear) and layer.recipe == recipe
        q, s = state[f"{name}.weight"], state[f"{name}.{scale_key}"]
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
        want = s.float().t() if recipe == "deepseek" else s.float().reshape((1, -1) if recipe == "row" else ())
        assert layer.weight_scale.shape == want.shape and torch.equal(layer.weight_scale, want)
        assert torch.equal(_layer_dequantized(layer), _ckpt_dequantized(q, s, how))
        assert torch.equal(layer.dequantize(), _ckpt_dequantized(q, s, how))
        if f"{name}.bias" in state:
            assert layer.bias.dtype == torch.float32 and torch.equal(layer.bias, state[f"{name}.bias"].float())

    params = dict(loaded.named_parameters(remove_duplicate=False))
    for key, t in state.items():
        if key.rpartition(".")[0] in quantized or ".experts." in key:
            continue
        got = params.get(key)
        got = got if got is not None else loaded.get_buffer(key)
        assert got.dtype == t.dtype and torch.equal(got, t), key
    assert all(t.device.type == "cpu" for t in loaded.state_dict().values())
    if model.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert "tied to" in report.skipped["lm_head"]
    torch.testing.assert_close(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq, rtol=0, atol=0)
    if kind == "deepseek_v3":  # the routed experts adopted as stored: [gate; up] codes and block scales joined
        assert report.converted_experts == _experts_names(model) == ["model.layers.1.mlp.experts"]
        layer = loaded.get_submodule("model.layers.1.mlp.experts")
        assert isinstance(layer, cnn.QuantizedExperts) and layer.recipe == "deepseek"
        gate_up, down = layer.dequantize()
        pre = "model.layers.1.mlp.experts"
        for j in range(layer.num_experts):
            (gq, gs), (uq, us), (dq, ds) = ((state[f"{pre}.{j}.{p}.weight"], state[f"{pre}.{j}.{p}.{scale_key}"])
                                            for p in ("gate_proj", "up_proj", "down_proj"))
            assert torch.equal(layer.gate_up_proj[j].view(torch.uint8), torch.cat([gq, uq]).view(torch.uint8))
            assert torch.equal(layer.down_proj[j].view(torch.uint8), dq.view(torch.uint8))
            assert torch.equal(layer.gate_up_proj_scale[j], torch.cat([gs, us]).float().t())
            assert torch.equal(layer.down_proj_scale[j], ds.float().t())
            assert torch.equal(gate_up[j], torch.cat([_ckpt_dequantized(gq, gs, how), _ckpt_dequantized(uq, us, how)]))
            assert torch.equal(down[j], _ckpt_dequantized(dq, ds, how))
        assert not any(".experts." in n for n in report.kept)
        assert "TopkRouter" in report.kept["model.layers.1.mlp.gate.weight"]


@pytest.mark.parametrize("kind,fmt,over,why", [
    ("qwen3_moe", "fbgemm", {}, None),  # per channel: adopted as recipe "row"
    ("qwen3_moe", "ct_tensor", {}, "different per-tensor scales"),
    ("deepseek_v3", "fp8", dict(moe_intermediate_size=192), "intermediate=192 is no multiple of 128"),
])
def test_fp8_experts_adopted_or_dequantized_with_the_reason(tmp_path, kind, fmt, over, why):
    """Per-expert FP8 weights join into QuantizedExperts as stored where the layout maps exactly; where it does not
    (gate and up under different per-tensor scales, blocks that do not meet at the gate / up boundary) they load
    dequantized to bf16, with a warning and the reason."""
    model = _model(kind, **over)
    state = _write_fp8(tmp_path, model, fmt)
    _, how, scale_key, recipe = FORMATS[fmt]
    name = _experts_names(model)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, report = cnn.from_pretrained(str(tmp_path), device="cpu")
    layer = loaded.get_submodule(name)
    ckpt = {j: [(state[f"{name}.{j}.{p}.weight"], state[f"{name}.{j}.{p}.{scale_key}"])
                for p in ("gate_proj", "up_proj", "down_proj")] for j in range(4)}
    if why is None:
        assert isinstance(layer, cnn.QuantizedExperts) and layer.recipe == recipe and name in report.converted_experts
        gate_up, down = layer.dequantize()
        for j, ((gq, gs), (uq, us), (dq, ds)) in ckpt.items():
            assert torch.equal(layer.gate_up_proj[j].view(torch.uint8), torch.cat([gq, uq]).view(torch.uint8))
            assert torch.equal(layer.gate_up_proj_scale[j], torch.cat([gs, us]).float().t())
            assert torch.equal(gate_up[j], torch.cat([_ckpt_dequantized(gq, gs, how), _ckpt_dequantized(uq, us, how)]))
            assert torch.equal(down[j], _ckpt_dequantized(dq, ds, how))
        assert not any("dequantized" in str(w.message) for w in caught)
        return
    assert type(layer) is not cnn.QuantizedExperts and name not in report.converted_experts
    assert why in report.skipped[name] and "dequantized from the checkpoint's FP8" in report.skipped[name]
    assert any("loaded dequantized to torch.bfloat16" in str(w.message) for w in caught)
    assert any(re.search(r"mixture-of-experts weights of \d+ experts modules in high precision", str(w.message))
               for w in caught)
    for j, ((gq, gs), (uq, us), (dq, ds)) in ckpt.items():
        want = torch.cat([_ckpt_dequantized(gq, gs, how), _ckpt_dequantized(uq, us, how)]).to(torch.bfloat16)
        assert torch.equal(layer.gate_up_proj[j], want)
        assert torch.equal(layer.down_proj[j], _ckpt_dequantized(dq, ds, how).to(torch.bfloat16))
    assert f"{name}.gate_up_proj" in report.kept and why in report.kept[f"{name}.gate_up_proj"]


def test_fused_experts_checkpoint_and_missing_experts(tmp_path):
    """Experts stored fused under the module's own names (gate_up_proj, down_proj) quantize on load as convert
    quantizes them; a checkpoint without an experts module's weights is refused, naming what it expected."""
    model = _model("qwen3_moe")
    state = _state(model)
    model.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded, report = cnn.from_pretrained(str(tmp_path), "row", device="cpu")
    want = copy.deepcopy(model)
    cnn.convert(want, "row")
    names = _experts_names(model)
    assert report.converted_experts == names
    for name in names:
        mine, theirs = loaded.get_submodule(name).state_dict(), want.get_submodule(name).state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k].reshape(-1).view(torch.uint8), theirs[k].reshape(-1).view(torch.uint8))
                   for k in mine)
    del state[f"{names[0]}.down_proj"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"no weights for the experts module {re.escape(names[0])} "
                                         r"\(Qwen3MoeExperts, 4 experts\): expected .*gate_up_proj"):
        cnn.from_pretrained(str(tmp_path), "row", device="cpu")


def test_fp8_layer_the_kernels_refuse_is_dequantized_and_reported(tmp_path):
    model = _model("llama", intermediate_size=200)  # down_proj K = 200: not a multiple of 16
    state = _write_fp8(tmp_path, model, "fbgemm")
    with pytest.warns(UserWarning, match="dequantized"):
        loaded, report = cnn.from_pretrained(str(tmp_path), device="cpu")
    name = "model.layers.1.mlp.down_proj"
    assert "must be a multiple of 16" in report.skipped[name] and "dequantized" in report.skipped[name]
    assert "dequantized" in report.kept[f"{name}.weight"]
    layer = loaded.get_submodule(name)
    assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.bfloat16
    want = _ckpt_dequantized(state[f"{name}.weight"], state[f"{name}.weight_scale"], "channel").bfloat16()
    assert torch.equal(layer.weight, want)
    assert isinstance(loaded.get_submodule("model.layers.1.mlp.up_proj"), cnn.QuantizedLinear)


@pytest.mark.parametrize("fmt", ["ct_tensor", "ct_channel"])
def test_static_input_scales(tmp_path, fmt):
    """Per-tensor static activation scales load into layers holding one (recipe "tensor",
    QuantizedLinear(..., input_scale=True)), and are refused for per-channel weights: never dropped."""
    model = _model("qwen2")
    state = _write_fp8(tmp_path, model, fmt)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    acts = config["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    acts.update(dynamic=False, strategy="tensor")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    for name in _linears(model):
        if f"{name}.weight_scale" in state:
            state[f"{name}.input_scale"] = torch.rand(1) + 0.5
    save_file(state, str(tmp_path / "model.safetensors"))
    if fmt == "ct_channel":  # per-channel weights: the static per-tensor activation scale has no recipe
        with pytest.raises(ValueError, match="static input scale is taken with recipe 'tensor'.*not 'row'"):
            cnn.from_pretrained(str(tmp_path), device="cpu")
        return
    loaded, report = cnn.from_pretrained(str(tmp_path), device="cpu")
    assert report.recipe == "tensor" and report.converted
    for name in report.converted:
        layer = loaded.get_submodule(name)
        assert layer.input_scale.shape == () and torch.equal(layer.input_scale.reshape(1), state[f"{name}.input_scale"])


@pytest.mark.parametrize("as_bytes", [False, True])
def test_power_of_two_block_scales(tmp_path, as_bytes):
    """FineGrainedFP8 with scale_fmt "ue8m0": E8M0 block scales (or their exponent bytes) adopted as fp32, exactly."""
    model = _model("llama")
    state = _write_fp8(tmp_path, model, "fp8", scale_fmt="ue8m0")
    for key in [k for k in state if k.endswith("weight_scale_inv")]:
        e8m0 = torch.exp2(torch.ceil(torch.log2(state[key]))).to(torch.float8_e8m0fnu)
        state[key] = e8m0.view(torch.uint8) if as_bytes else e8m0
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded, report = cnn.from_pretrained(str(tmp_path), device="cpu")
    assert report.converted
    for name in report.converted:
        s = state[f"{name}.weight_scale_inv"]
        s = s.view(torch.float8_e8m0fnu) if as_bytes else s
        assert torch.equal(loaded.get_submodule(name).weight_scale, s.float().t())


@pytest.mark.parametrize("qc,match", [
    (dict(weight_block_size=[64, 64]), "128x128"),
    (dict(quant_method="gptq"), "quant_method 'gptq' is not adopted"),
])
def test_layouts_and_methods_refused(tmp_path, qc, match):
    _write_fp8(tmp_path, _model("llama"), "fp8", **qc)
    with pytest.raises(ValueError, match=match):
        cnn.from_pretrained(str(tmp_path), device="cpu")


def test_compressed_tensors_schemes_refused(tmp_path):
    model = _model("llama")
    _write_fp8(tmp_path, model, "ct_channel")
    path = tmp_path / "config.json"
    base = json.loads(path.read_text())
    for change, match in [(lambda g: g.update(input_activations=None), "leaves the activations unquantized"),
                          (lambda g: g["weights"].update(type="int", num_bits=4), "only FP8 weights")]:
        config = json.loads(json.dumps(base))
        change(config["quantization_config"]["config_groups"]["group_0"])
        path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            cnn.from_pretrained(str(tmp_path), device="cpu")


def test_fp8_tensor_outside_the_format_refused(tmp_path):
    """An FP8 tensor the format does not adopt (here an embedding table) is refused, not cast without its scale."""
    state = _write_fp8(tmp_path, _model("llama"), "fbgemm")
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].to(torch.float8_e5m2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.embed_tokens.weight is torch.float8_e5m2 in the checkpoint"):
        cnn.from_pretrained(str(tmp_path), device="cpu")


def test_conflicting_recipe_refused(tmp_path):
    _write_fp8(tmp_path, _model("llama"), "fp8")
    with pytest.raises(ValueError, match="runs as recipe 'deepseek'"):
        cnn.from_pretrained(str(tmp_path), "row", device="cpu")
    _, report = cnn.from_pretrained(str(tmp_path), "deepseek", device="cpu")  # the format's own recipe
    assert report.converted


def test_missing_directory_and_missing_gpu_refused(tmp_path):
    with pytest.raises(ValueError, match="no local directory"):
        cnn.from_pretrained(str(tmp_path / "absent"), "row", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU is visible: pass device='cpu'"):
            cnn.from_pretrained(str(tmp_path), "row")


def test_unquantized_checkpoint_needs_a_recipe(tmp_path):
    _model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not quantized; pass recipe="):
        cnn.from_pretrained(str(tmp_path), device="cpu")


@pytest.mark.parametrize("kind,recipe,stored", [
    ("llama", "row", torch.bfloat16), ("qwen2", "deepseek", torch.bfloat16), ("qwen2", "row", torch.float32),
    ("qwen3_moe", "deepseek", torch.bfloat16), ("mixtral", "tensor", torch.bfloat16),
    ("deepseek_v3", "row", torch.float32), ("qwen3_moe", "int8", torch.bfloat16)])
def test_quantize_on_load_equals_convert(tmp_path, kind, recipe, stored):
    """Sharded checkpoints (model.safetensors.index.json); an fp32 one is read through bf16, as the model loaded
    whole holds it (Qwen2's biases included). Mixture-of-experts models as save_pretrained stores them, per expert
    (Mixtral's w1 / w3 / w2 under block_sparse_moe), quantized into QuantizedExperts; under int8, which has no
    grouped GEMM, their weights load in bf16, listed as convert lists them."""
    model = _model(kind).to(stored)
    if stored == torch.float32:
        with torch.no_grad():  # values bf16 cannot hold
            for p in model.parameters():
                p.mul_(1 + 1e-3 * torch.rand_like(p))
    model.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    skip_down = lambda name, m: not name.endswith("layers.1.mlp.down_proj")  # noqa: E731
    experts = _experts_names(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, report = cnn.from_pretrained(str(tmp_path), recipe, device="cpu", filter=skip_down)
        whole = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
        want = cnn.convert(whole, recipe, filter=skip_down)
    kept_experts = [str(w.message) for w in caught if "mixture-of-experts weights" in str(w.message)]
    assert report.converted_experts == want.converted_experts == (experts if recipe != "int8" else [])
    assert len(kept_experts) == (2 if experts and recipe == "int8" else 0)  # from_pretrained's and convert's
    assert report.converted == want.converted and report.skipped == want.skipped and report.kept == want.kept
    assert (report.kept_elements, report.total_elements) == (want.kept_elements, want.total_elements)
    mine, theirs = loaded.state_dict(), whole.state_dict()
    assert mine.keys() == theirs.keys()
    for key, t in theirs.items():
        bits = lambda x: x.reshape(-1).view(torch.uint8)  # noqa: E731
        assert mine[key].dtype == t.dtype and torch.equal(bits(mine[key]), bits(t)), key
    assert dict(loaded.named_buffers()).keys() == dict(whole.named_buffers()).keys()
    if whole.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


PEAK = textwrap.dedent("""
    import sys, threading, time
    import torch, transformers
    from cutedsl_gemm import nn as cnn

    def anon():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) * 1024

    def whole(path):  # the model loaded whole by transformers, then converted
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        cnn.convert(model, "row")
        return model

    load = whole if sys.argv[3] == "whole" else lambda path: cnn.from_pretrained(path, "row", device="cpu")[0]
    warm = load(sys.argv[2])  # the imports and first calls, done once
    del warm
    peak, done = [anon()], []
    def sample():
        while not done:
            peak[0] = max(peak[0], anon())
            time.sleep(0.0005)
    base = peak[0]
    t = threading.Thread(target=sample)
    t.start()
    model = load(sys.argv[1])
    done.append(1)
    t.join()
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(peak[0] - base, anon() - base, held)
""")


def test_quantize_on_load_peak_memory(tmp_path):
    """An fp32 checkpoint loaded in bf16 (~90 MiB of bf16 weights, the largest layer 2 MiB): the load's peak
    (anonymous memory above the process's before it; large blocks handed back to the system when freed; the
    safetensors files are mapped, not counted) stays near the quantized model (~47 MiB) plus the scratch of
    quantizing one layer, well below the bf16 model, which loading it whole with transformers then converting
    holds at once."""
    config = _config("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_key_value_heads=4,
                     num_attention_heads=8)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "big")
    _model("llama").save_pretrained(tmp_path / "tiny")
    with safe_open(str(tmp_path / "big" / "model.safetensors"), "pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
    total = sum(torch.Size(s).numel() * 2 for s in sizes)  # in bf16
    largest = max(torch.Size(s).numel() * 2 for s in sizes if len(s) == 2 and s[0] != config.vocab_size)
    assert total > 15 * largest
    runs = {}
    for how in ("stream", "whole"):
        out = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "big"), str(tmp_path / "tiny"), how],
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        assert out.returncode == 0, out.stderr
        runs[how] = [int(v) for v in out.stdout.split()[-3:]]
    (peak, after, held), whole = runs["stream"], runs["whole"][0]
    print(f"bf16 weights {total / 2**20:.1f} MiB, largest layer {largest / 2**20:.1f} MiB, quantized model "
          f"{held / 2**20:.1f} MiB; load peak {peak / 2**20:.1f} MiB ({after / 2**20:.1f} MiB after); loaded whole "
          f"then converted: {whole / 2**20:.1f} MiB")
    assert peak < held + 8 * largest and peak < 0.75 * total
    assert whole > total  # the measure sees a whole bf16 model


# ------------------------------------------------------------------------------------------------
# this library's own checkpoints: save_pretrained, then from_pretrained as saved
# ------------------------------------------------------------------------------------------------


def _same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key, t in b.items():
        bits = lambda x: x.reshape(-1).view(torch.uint8)  # noqa: E731
        assert a[key].dtype == t.dtype and torch.equal(bits(a[key]), bits(t)), key


@pytest.mark.parametrize("kind,recipe", [("llama", "row"), ("qwen2", "int4_weight"), ("qwen3_moe", "deepseek"),
                                         ("deepseek_v3", "tensor")])
def test_save_pretrained_then_from_pretrained_gives_the_same_model(tmp_path, kind, recipe):
    """The converted model (experts included) saved, sharded, and loaded back: the same buffers bit for bit, the
    same layers converted, tied weights tied again; nothing quantized twice."""
    model = _model(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the routers and embeddings kept: convert's report says so)
        want = cnn.convert(model, recipe, filter=lambda name, m: name != "lm_head")
    cnn.save_pretrained(model, tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "cutedsl_gemm"
    assert config["quantization_config"]["recipe"] == recipe
    loaded, report = cnn.from_pretrained(str(tmp_path), device="cpu")
    assert sorted(report.converted) == sorted(want.converted)
    assert report.converted_experts == want.converted_experts
    assert report.recipe == recipe and "lm_head" in report.skipped
    _same_state(loaded.state_dict(), model.state_dict())
    if model.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    again, _ = cnn.from_pretrained(str(tmp_path), recipe, device="cpu")  # naming the saved recipe is the same
    _same_state(again.state_dict(), model.state_dict())


def test_own_checkpoints_refuse_what_they_cannot_be(tmp_path):
    model = _model("llama")
    with pytest.raises(ValueError, match="has no cutedsl_gemm layers .*convert it first"):
        cnn.save_pretrained(model, tmp_path)
    cnn.convert(model, "row", filter=lambda name, m: "layers.0." not in name)
    cnn.convert(model, "deepseek")  # the rest: a second recipe
    with pytest.raises(ValueError, match="recipes 'deepseek', 'row': a cutedsl_gemm checkpoint holds one recipe"):
        cnn.save_pretrained(model, tmp_path)
    model = _model("llama")
    cnn.convert(model, "row")
    cnn.save_pretrained(model, tmp_path)
    with pytest.raises(ValueError, match="holds recipe 'row' layers; pass recipe=None"):
        cnn.from_pretrained(str(tmp_path), "deepseek", device="cpu")
    with pytest.raises(ValueError, match="loads its layers as saved; filter= applies"):
        cnn.from_pretrained(str(tmp_path), device="cpu", filter=lambda name, m: True)
    with pytest.raises(ValueError, match=r"load it with cutedsl_gemm.nn.from_pretrained\(path\)"):
        import cutedsl_gemm.nn.hf_quantizer  # noqa: F401  (registers quant_method "cutedsl_gemm")

        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    state = dict(safe_open_all(tmp_path))
    name = "model.layers.0.self_attn.q_proj._extra_state"
    state[name] = torch.tensor(list(b"cutedsl_gemm/99/row"), dtype=torch.uint8)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="format version 99 .* reads versions up to"):
        cnn.from_pretrained(str(tmp_path), device="cpu")


def safe_open_all(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return [(k, f.get_tensor(k)) for k in f.keys()]
