"""from_pretrained on a Hopper GPU: each FP8 checkpoint format adopted, then run. The loaded model's logits against
a float64 forward of the model holding the checkpoint's dequantized weights (the same products but for the
activations' FP8 quantization, bf16 activations and the kernels' rounding), and against the original bf16 model;
a bf16 checkpoint quantized while loading against convert on the GPU, bit for bit."""

import pytest
import torch

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.numerics import reference as R

transformers = pytest.importorskip("transformers")
from test_checkpoint import (  # noqa: E402
    FORMATS,
    IGNORED,
    _ckpt_dequantized,
    _experts_names,
    _linears,
    _model,
    _write_fp8,
)

pytestmark = pytest.mark.gpu

# The activations' e4m3 quantization (3 mantissa bits) through two layers of a tiny random model: a few percent of
# the logits; the checkpoint's own weight error is in both sides of the first comparison, so it stays below that.
DEQUANTIZED_TOL = 0.08
ORIGINAL_TOL = 0.15
# One experts block, e4m3 activations (row scales, or 1x128 blocks) against float64 ones: a few percent.
EXPERTS_TOL = 0.05
# Mixture-of-experts logits: the activation error plus the tokens whose top-k flips near a tie of the router.
ROUTED_TOL = 0.12


def _reference(kind):
    """The model in float64 (its bf16 parameters exactly), for a reference forward; experts run eagerly (one
    matmul per expert: grouped_mm takes no float64)."""
    model = _model(kind).to(torch.float64)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model


def _dequantized_twin(kind, state, fmt):
    """The model in float64 with every quantized linear's weight, and each routed expert's, replaced by its
    dequantized checkpoint codes."""
    _, how, scale_key, _ = FORMATS[fmt]

    def dequantized(name):
        return _ckpt_dequantized(state[f"{name}.weight"], state[f"{name}.{scale_key}"], how)

    twin = _reference(kind)
    with torch.no_grad():
        for name in _linears(twin):
            if name not in ("lm_head", IGNORED):
                twin.get_submodule(name).weight.copy_(dequantized(name))
        for name in _experts_names(twin):
            experts = twin.get_submodule(name)
            for j in range(experts.gate_up_proj.shape[0]):
                gate, up, down = (dequantized(f"{name}.{j}.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
                experts.gate_up_proj[j].copy_(torch.cat([gate, up]))
                experts.down_proj[j].copy_(down)
    return twin.cuda()


def _as_reference(t):
    return t.to(torch.float64) if t.is_floating_point() else t


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_adopted_checkpoint_logits(tmp_path, kind, fmt):
    model = _model(kind)
    state = _write_fp8(tmp_path, model, fmt)
    loaded, report = cnn.from_pretrained(str(tmp_path), device="cuda")
    assert report.recipe == FORMATS[fmt][3] and report.converted
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        got = loaded(ids).logits.float()
        twin = _dequantized_twin(kind, state, fmt)(ids).logits.float()
        original = model.cuda()(ids).logits.float()
    assert not torch.isnan(got).any()
    e_twin, e_orig = R.rel_error(got, twin), R.rel_error(got, original)
    assert e_twin < DEQUANTIZED_TOL, f"{kind} {fmt}: {e_twin:.3e} from the dequantized-weight twin"
    assert e_orig < ORIGINAL_TOL, f"{kind} {fmt}: {e_orig:.3e} from the original bf16 model"
    assert e_twin < e_orig or e_twin < 0.02  # the twin shares the checkpoint's weight error


@pytest.mark.parametrize("kind,fmt", [("deepseek_v3", "fp8"), ("qwen3_moe", "fbgemm")])
def test_adopted_moe_checkpoint_logits(tmp_path, kind, fmt):
    """Per-expert FP8 experts adopted into QuantizedExperts (the grouped GEMM), against a float64 forward of the
    model holding every dequantized weight of the checkpoint, dense and experts."""
    model = _model(kind)
    state = _write_fp8(tmp_path, model, fmt)
    loaded, report = cnn.from_pretrained(str(tmp_path), device="cuda")
    assert report.converted_experts == _experts_names(model)
    twin = _dequantized_twin(kind, state, fmt)
    # Each experts block on the inputs and the routing the loaded model gave it: the same products but for the
    # activations' FP8 quantization. End to end, the routers see slightly different hidden states and a token near
    # a tie may pick another expert, so the logits get a looser bound.
    seen = {}

    def keep(name):
        def hook(module, args, kwargs):
            seen.setdefault(name, ([a.clone() for a in args], {k: v.clone() for k, v in kwargs.items()}))
        return hook

    hooks = [loaded.get_submodule(name).register_forward_pre_hook(keep(name), with_kwargs=True)
             for name in _experts_names(model)]
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        got = loaded(ids).logits.float()
        for h in hooks:
            h.remove()
        assert sorted(seen) == sorted(_experts_names(model))
        for name, (args, kwargs) in seen.items():
            mine = loaded.get_submodule(name)(*args, **kwargs).float()
            theirs = twin.get_submodule(name)(*map(_as_reference, args),
                                              **{k: _as_reference(v) for k, v in kwargs.items()})
            e_block = R.rel_error(mine, theirs.float())
            assert e_block < EXPERTS_TOL, f"{kind} {fmt} {name}: {e_block:.3e} from the dequantized experts"
        want = twin(ids).logits.float()
        original = model.cuda()(ids).logits.float()
    assert torch.isfinite(got).all()
    e_twin, e_orig = R.rel_error(got, want), R.rel_error(got, original)
    assert e_twin < ROUTED_TOL, f"{kind} {fmt}: {e_twin:.3e} from the dequantized-weight twin"
    assert e_orig < ORIGINAL_TOL, f"{kind} {fmt}: {e_orig:.3e} from the original bf16 model"


@pytest.mark.parametrize("recipe", ["row", "deepseek", "int8", "int4_weight"])
def test_quantize_on_load_equals_convert_on_the_gpu(tmp_path, recipe):
    model = _model("qwen2")
    model.save_pretrained(tmp_path)
    loaded, _ = cnn.from_pretrained(str(tmp_path), recipe, device="cuda")
    converted = model.cuda()
    cnn.convert(converted, recipe)
    mine, theirs = loaded.state_dict(), converted.state_dict()
    for key in theirs:
        a, b = mine[key], theirs[key]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, converted(ids).logits)
