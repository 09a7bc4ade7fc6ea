"""benchmarks.bench_moe on the CPU: argument parsing and result names, the blocks' and the model's dimensions against
their parameter counts, the routing the run reads and the bytes its floors count, the experts implementations of
the bf16 block, and tiny runs of both parts with the grouped op and the quantizers on their float64 / torch
references (no GPU kernel is called); no timing is checked."""

import json
from types import SimpleNamespace

import pytest
import torch

import cutedsl_gemm.ops.grouped
from benchmarks import bench_model as BM
from benchmarks import bench_moe as B
from benchmarks import common, render
from benchmarks import model_split as S
from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn import moe
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.ops.quantize import quantize_fp8
from cutedsl_gemm.tools import models as M

pytest.importorskip("transformers")

FLOORS = SimpleNamespace(hbm_tbps=0.001)  # a rate the tiny blocks' weights take milliseconds at
TINY_BLOCK = ["--what", "block", "--device", "cpu", "--tiny", "--batches", "1,3", "--prefill", "24", "--rounds", "1"]
TINY_MODEL = ["--what", "model", "--device", "cpu", "--tiny", "--layers", "1", "--batches", "1,2", "--context", "8",
              "--prefill", "16", "--rounds", "1", "--reps", "1"]


@pytest.fixture
def reference_ops(monkeypatch):
    """The converted layers on the CPU: the grouped op on ``reference_grouped_mm`` (its recipe read from the scales'
    shapes, as the op reads it), the quantizers on their torch reference, QuantizedLinear (DeepSeek's shared expert)
    on its dequantized weight; returns the grouped op's calls."""
    calls = []

    def grouped(a, b, scale_a, scale_b, offs=None, *, counts=None, out_dtype=torch.bfloat16, out=None,
                expected_rows=None):
        assert out is None and a.dtype == b.dtype == torch.float8_e4m3fn and not a.is_cuda
        e, _, n = b.shape
        shape = tuple(scale_b.shape)
        recipe = "tensor" if shape == (e,) else "row" if shape == (e, 1, n) else "deepseek"
        calls.append(recipe)
        return R.reference_grouped_mm(a, b, scale_a, scale_b, offs, counts=counts, recipe=recipe,
                                      out_dtype=out_dtype)

    monkeypatch.setattr(cutedsl_gemm.ops.grouped, "grouped_scaled_mm", grouped)
    monkeypatch.setattr(moe, "_check_device", lambda device: None)
    monkeypatch.setattr(moe, "quantize_fp8", lambda x, gran, **kw: quantize_fp8(x, gran, backend="reference", **kw))
    monkeypatch.setattr(cnn.QuantizedLinear, "forward", lambda self, x: x @ self.dequantize(x.dtype).t())
    return calls


# ---- arguments ------------------------------------------------------------------------------------------------------
def test_arguments_and_result_names():
    args = B.parse_args([])
    assert args.what == ["block", "model"] and args.block_config == ["qwen3"]
    assert args.recipes == ["row", "tensor", "deepseek"]
    assert args.bf16_experts == ["grouped_mm", "eager"] and args.model_recipe == "row"
    assert args.batches == [1, 16, 64] and args.prefill == 4096 and args.context == 512
    assert args.layers == 48 and args.device == "cuda" and args.save
    assert (args.block_name, args.model_name) == ("moe_block", "moe_model_qwen3_30b")
    args = B.parse_args(["--what", "model,block,model", "--layers", "8", "--block-config", "dsv3,mixtral",
                         "--recipes", "tensor", "--bf16-experts", "eager"])
    assert args.what == ["model", "block"] and args.block_config == ["dsv3", "mixtral"] and args.recipes == ["tensor"]
    assert args.bf16_experts == ["eager"] and args.model_name == "moe_model_qwen3_30b_8l"
    args = B.parse_args(["--tiny"])
    assert args.layers == 2 and args.block_name is None and args.model_name is None  # checks keep no file
    args = B.parse_args(["--what", "block", "--device", "cpu", "--name", "mine"])
    assert args.block_name == "mine"


@pytest.mark.parametrize("argv, error", [
    (["--what", "blocks"], "expected some of block, model"),
    (["--block-config", "qwen3,llama"], "expected some of qwen3, mixtral, dsv3"),
    (["--recipes", "int8"], "expected some of row, tensor, deepseek"),
    (["--bf16-experts", "batched_mm"], "expected some of grouped_mm, eager"),
    (["--prefill", "-1"], "--prefill must be >= 0"),
    (["--name", "x"], "--name names one result file"),
    (["--batches", "0"], "expected a whole number >= 1"),
])
def test_bad_arguments_are_refused(argv, error, capsys):
    with pytest.raises(SystemExit) as done:
        B.parse_args(argv)
    assert done.value.code == 2 and error in capsys.readouterr().err


def test_help(capsys):
    with pytest.raises(SystemExit) as done:
        B.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and B.__doc__.splitlines()[0] in out and "--no-save" in out and "--name" in out


def test_without_a_gpu_the_run_stops_with_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit) as done:
        B.main(["--what", "block"])
    message = str(done.value.code)
    assert "GPU" in message and "\n" not in message and message.startswith("benchmarks.bench_moe")


# ---- dimensions -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, dims", [
    ("qwen3", B.BlockDims(128, 8, 2048, 768, 0)),
    ("mixtral", B.BlockDims(8, 2, 4096, 14336, 0)),
    ("dsv3", B.BlockDims(256, 8, 7168, 2048, 1)),
])
def test_the_blocks_have_their_models_dimensions_and_parameter_counts(name, dims):
    config = B.block_config(name)
    assert B.block_dims(config) == dims
    block, _ = B.build_block(name, "meta")
    e, k, h, i, shared = dims
    assert type(block).__name__ == B.BLOCKS[name].block
    assert block.experts.gate_up_proj.shape == (e, 2 * i, h) and block.experts.down_proj.shape == (e, h, i)
    # experts: gate, up and down of each; the router: one row per expert; DeepSeek's shared expert: one more MLP
    assert sum(p.numel() for p in block.parameters()) == 3 * e * h * i + e * h + 3 * h * i * shared
    assert block.experts.gate_up_proj.dtype == torch.bfloat16
    if name == "dsv3":  # its router scores in fp32, 8 groups of 32 experts, the best 4 searched
        assert block.gate.weight.dtype == torch.float32 and (config.n_group, config.topk_group) == (8, 4)
        assert block.gate.e_score_correction_bias.shape == (e,)


def test_the_tiny_blocks_keep_their_architectures():
    for name in B.BLOCKS:
        tiny = B.block_dims(B.block_config(name, tiny=True))
        assert tiny.hidden == 256 and tiny.experts < B.block_dims(B.block_config(name)).experts
        assert tiny.hidden % 16 == 0 and tiny.intermediate % 16 == 0  # what the grouped GEMM takes


def _qwen3_moe_parameters(c, layers):
    """Qwen3-MoE's parameters: per layer attention (q, k, v, o and the q / k norms), two norms, the router and the
    experts; the embedding, the final norm and the (untied) LM head."""
    h, hd, e, i = c.hidden_size, c.head_dim, c.num_experts, c.moe_intermediate_size
    attention = h * c.num_attention_heads * hd * 2 + 2 * h * c.num_key_value_heads * hd + 2 * hd
    layer = attention + 2 * h + e * h + 3 * e * h * i
    return layers * layer + 2 * c.vocab_size * h + h


def test_the_model_has_qwen3_30b_a3b_dimensions_and_parameter_count():
    config = B.model_config(B.parse_args(["--layers", "2"]))
    assert (config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        2048, 128, 8, 768)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size) == (
        32, 4, 128, 151936)
    assert config.norm_topk_prob and not config.tie_word_embeddings and config.mlp_only_layers == []
    model = M.random_causal_lm(config, "meta")
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == _qwen3_moe_parameters(config, 2) == 1_868_573_184
    # at its 48 layers the model holds ~30.5 B parameters: ~61 GB in bf16
    assert 30.4e9 < _qwen3_moe_parameters(config, M.QWEN3_30B_A3B_LAYERS) < 30.6e9
    assert B.parse_args([]).layers == M.QWEN3_30B_A3B_LAYERS == 48


# ---- routing, bytes, implementations --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(B.BLOCKS))
def test_experts_hit_is_what_the_router_picked(name):
    block, config = B.build_block(name, "cpu", tiny=True)
    B.set_experts_implementation(block, "grouped_mm")
    for tokens in (1, 3, 64):
        x = B.block_input(config, tokens, seed=tokens, device="cpu")
        picked = block.gate(x.view(-1, config.hidden_size))[2]
        assert B.experts_hit(block, lambda x=x: block(x)) == {"experts": int(torch.unique(picked).numel())}
    assert B.experts_hit(block, lambda: block(B.block_input(config, 1, 0, "cpu")))["experts"] == \
        config.num_experts_per_tok  # one token: top-k distinct experts
    assert not block.experts._forward_pre_hooks  # the counting hooks are gone


def test_touched_bytes_count_only_the_experts_hit():
    block, config = B.build_block("dsv3", "cpu", tiny=True)
    d = B.block_dims(config)
    experts = S.linear_bytes(block, ["experts"])
    assert experts == 3 * d.experts * d.hidden * d.intermediate * 2  # bf16
    whole = B.module_bytes(block)
    assert whole == experts + d.experts * d.hidden * 4 + d.experts * 4 + 3 * d.hidden * d.intermediate * 2
    assert B.touched_bytes(block, {"experts": d.experts}, whole) == whole
    assert B.touched_bytes(block, {"experts": 4}, whole) == whole - experts + experts * 4 // d.experts
    row = B.BlockVariant("row", B.OURS, M.sharing_copy(block))
    cnn.convert(row.module, "row")
    fp8 = S.linear_bytes(row.module, ["experts"])  # one byte a weight and an fp32 scale per output channel
    assert fp8 == 3 * d.experts * d.hidden * d.intermediate + 4 * d.experts * (2 * d.intermediate + d.hidden)
    assert B.touched_bytes(row.module, {"experts": 1}, B.module_bytes(row.module)) == \
        B.module_bytes(row.module) - fp8 + fp8 // d.experts


def test_each_bf16_variant_runs_its_own_experts_implementation():
    block, config = B.build_block("qwen3", "cpu", tiny=True)
    args = B.parse_args(TINY_BLOCK + ["--recipes", "row"])
    run = BM.Run(args, None)
    variants = B.block_variants(run, "qwen3", block)
    assert [v.label for v in variants] == ["bf16 (grouped_mm)", "bf16 (eager)", "ours row"] and not run.failed
    grouped, eager, ours = (v.module for v in variants)
    assert grouped is block and grouped.experts.config._experts_implementation == "grouped_mm"
    assert eager.experts.config._experts_implementation == "eager"
    assert eager.experts.gate_up_proj is block.experts.gate_up_proj  # shared, not copied
    assert isinstance(ours.experts, cnn.QuantizedExperts) and ours.gate.weight is block.gate.weight
    x = B.block_input(config, 16, 0, "cpu")
    # the two implementations compute the same sums in other orders: bf16 ties apart
    assert R.rel_error(eager(x), grouped(x)) < 1e-2
    with pytest.raises(ValueError, match="no transformers experts module"):
        B.set_experts_implementation(torch.nn.Linear(4, 4), "eager")


def test_a_conversion_that_keeps_the_experts_gives_no_ours_row(monkeypatch):
    real = cnn.convert
    monkeypatch.setattr(B.cnn, "convert", lambda module, recipe, **kw: real(module, recipe, experts=False, **kw))
    block, _ = B.build_block("mixtral", "cpu", tiny=True)
    run = BM.Run(B.parse_args(TINY_BLOCK + ["--recipes", "tensor"]), None)
    with pytest.warns(UserWarning, match="mixture-of-experts weights in high precision"):
        variants = B.block_variants(run, "mixtral", block)
    assert [v.recipe for v in variants] == ["bf16", "bf16"]
    assert run.failed["mixtral: conversion, tensor"].startswith("RuntimeError: the experts were not converted")


# ---- tiny runs ------------------------------------------------------------------------------------------------------
def test_sort_routing_times_each_recipe_both_ways(tmp_path, monkeypatch, reference_ops):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    routed, sorted_ = [], []
    real_route, real_permute, real_rule = moe.route_quantize_fp8, moe.permute, moe.routes_by_kernel
    monkeypatch.setattr(moe, "route_quantize_fp8", lambda *a, **k: routed.append(1) or real_route(*a, **k))
    monkeypatch.setattr(moe, "permute", lambda *a, **k: sorted_.append(1) or real_permute(*a, **k))
    argv = TINY_BLOCK + ["--batches", "2", "--prefill", "0", "--recipes", "row,tensor", "--sort-routing",
                         "--bf16-experts", "grouped_mm", "--name", "moe_sorted_tiny"]
    rows = B.main(argv, floors=FLOORS)["block"]
    cells = [dict(zip(B.BLOCK_COLUMNS, row)) for row in rows]
    assert [(c["recipe"], c["experts implementation"]) for c in cells] == [
        ("bf16", "grouped_mm"), ("row", B.OURS), ("row", B.SORT_ROUTED), ("tensor", B.OURS), ("tensor", B.SORT_ROUTED)]
    assert routed and sorted_  # each form ran
    assert B.moe.routes_by_kernel is real_rule  # restored after each call
    ours, by_sort = cells[1], cells[2]
    assert ours["rel err"] == pytest.approx(by_sort["rel err"], rel=1e-3)  # the same numerics


def test_tiny_block_run_on_the_cpu(tmp_path, monkeypatch, reference_ops):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    writes, real_write = [], common.write_result
    monkeypatch.setattr(common, "write_result", lambda *a, **k: (writes.append(len(a[3])), real_write(*a, **k))[1])
    rows = B.main(TINY_BLOCK + ["--block-config", "qwen3,mixtral,dsv3", "--name", "moe_tiny"], floors=FLOORS)["block"]
    cells = [dict(zip(B.BLOCK_COLUMNS, row)) for row in rows]
    variants = [("bf16", "grouped_mm"), ("bf16", "eager"), ("row", B.OURS), ("tensor", B.OURS), ("deepseek", B.OURS)]
    phases = [("decode", 1), ("decode", 3), ("prefill", 24)]
    assert [(c["block"], c["phase"], c["tokens"], c["recipe"], c["experts implementation"]) for c in cells] == [
        (b, p, t, *v) for b in ("qwen3", "mixtral", "dsv3") for p, t in phases for v in variants]
    assert writes == [5 * n for n in range(1, 10)] + [45]  # the file after each phase, and at the end
    assert {"row", "tensor", "deepseek"} <= set(reference_ops)
    blocks = {}  # (block, recipe) -> the module as the run held it: bf16, or its experts converted
    for name in B.BLOCKS:
        blocks[name, "bf16"], _ = B.build_block(name, "cpu", tiny=True)
        for recipe in ("row", "tensor", "deepseek"):
            blocks[name, recipe] = M.sharing_copy(blocks[name, "bf16"])
            cnn.convert(blocks[name, recipe], recipe)
    d = B.block_dims(B.block_config("qwen3", tiny=True))
    fp8 = S.linear_bytes(blocks["qwen3", "row"], ["experts"])  # one byte a weight, an fp32 scale per channel
    assert fp8 == 3 * d.experts * d.hidden * d.intermediate + 4 * d.experts * (2 * d.intermediate + d.hidden)
    assert S.linear_bytes(blocks["qwen3", "bf16"], ["experts"]) == 3 * d.experts * d.hidden * d.intermediate * 2
    for c in cells:
        config = B.block_config(c["block"], tiny=True)
        d = B.block_dims(config)
        assert c["mode"] == "eager" and c["us"] > 0
        assert c["tokens/s"] == pytest.approx(c["tokens"] / c["us"] * 1e6, rel=1e-3, abs=0.1)
        assert min(d.experts, c["tokens"] * d.top_k) >= c["experts hit"] >= d.top_k
        if c["tokens"] == 1:
            assert c["experts hit"] == d.top_k
        if (c["recipe"], c["experts implementation"]) == ("bf16", "grouped_mm"):
            assert c["x bf16"] == 1.0 and c["rel err"] is None
        elif c["recipe"] == "bf16":
            assert c["rel err"] < 1e-2  # another order of the same bf16 sums
        else:  # FP8 codes with 3 mantissa bits on both operands of both GEMMs
            assert 1e-3 < c["rel err"] < 0.1
        if c["phase"] == "prefill":
            assert c["% of weight floor"] is None
            continue
        block = blocks[c["block"], c["recipe"]]
        experts = S.linear_bytes(block, ["experts"])
        nbytes = B.module_bytes(block) - experts + experts * c["experts hit"] // d.experts
        assert c["% of weight floor"] == pytest.approx(100 * nbytes / 1e9 * 1e3 / (c["us"] / 1e3), rel=2e-2, abs=0.1)
    got = json.loads((tmp_path / "moe_tiny.json").read_text())
    assert got["columns"] == B.BLOCK_COLUMNS and len(got["rows"]) == 45 and "0.001 TB/s" in got["notes"]
    assert "anchor grouped_mm" in got["notes"] and "not measured" not in got["notes"]
    assert set(got["summary"]) == {f"{b} {r}: {p} {t} tokens: {m}" for b in ("qwen3", "mixtral", "dsv3")
                                   for r in ("row", "tensor", "deepseek") for p, t in phases
                                   for m in (("ours x bf16", "rel err") if p == "prefill" else ("ours x bf16",))}
    results = render.load_results(tmp_path)  # renders as any result file does
    assert "MoE blocks" in render.render_benchmarks(results)


def test_without_the_references_the_converted_block_is_reported_not_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    rows = B.main(TINY_BLOCK + ["--batches", "2", "--prefill", "0", "--name", "moe_tiny"])["block"]
    assert [(r[3], r[4]) for r in rows] == [("bf16", "grouped_mm"), ("bf16", "eager")]
    notes = json.loads((tmp_path / "moe_tiny.json").read_text())["notes"]
    assert "not measured: qwen3 decode 2 tokens, ours row (ValueError: QuantizedExperts runs on CUDA tensors" in notes


def test_tiny_model_run_on_the_cpu(tmp_path, monkeypatch, reference_ops):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    rows = B.main(TINY_MODEL + ["--name", "moe_model_tiny"], floors=FLOORS)["model"]
    cells = [dict(zip(B.MODEL_COLUMNS, row)) for row in rows]
    assert [(c["phase"], c["batch"], c["tokens"], c["recipe"], c["experts implementation"]) for c in cells] == [
        (phase, batch, tokens, *v) for phase, batch, tokens in (("decode", 1, 1), ("decode", 2, 2), ("prefill", 1, 16))
        for v in (("bf16", "grouped_mm"), ("row", B.OURS))]
    config = M.moe_config("qwen3_moe", 1, M.TINY_QWEN3_MOE)
    bf16 = M.random_causal_lm(config, "cpu")
    ours = M.sharing_copy(bf16)
    cnn.convert(ours, "row", filter=lambda name, module: name != "lm_head")
    for c in cells:
        assert c["mode"] == "eager" and c["ms"] > 0 and c["x bf16"] > 0
        assert config.num_experts >= c["experts hit per layer"] >= config.num_experts_per_tok
        assert (c["logit rel err"] is None) == (c["recipe"] == "bf16")
        if c["recipe"] == "row":
            assert 1e-4 < c["logit rel err"] < 0.5
        if c["phase"] == "prefill":
            assert c["% of weight floor"] is None
            continue
        if c["batch"] == 1:  # one token: top-k experts of each layer
            model = bf16 if c["recipe"] == "bf16" else ours
            experts = S.linear_bytes(model, ["model.layers.0.mlp.experts"])
            nbytes = S.streamed_bytes(model, 1) - experts + experts * 2 // config.num_experts
            assert c["experts hit per layer"] == 2
            assert c["% of weight floor"] == pytest.approx(100 * nbytes / 1e9 * 1e3 / c["ms"], rel=2e-2, abs=0.1)
    got = json.loads((tmp_path / "moe_model_tiny.json").read_text())
    assert got["columns"] == B.MODEL_COLUMNS and len(got["rows"]) == 6 and "static KV cache" in got["notes"]
    assert got["summary"]["row: decode batch 1: logit rel err"] == cells[1]["logit rel err"]
    assert "row: prefill: ours x bf16" in got["summary"]


@pytest.mark.parametrize("context, batch", [(20, 2), (23, 1)])  # a mask over the cache, and none (all of it)
def test_packed_gqa_attention_is_transformers_attention(context, batch, monkeypatch):
    """At decode the packed-GQA attention gives the logits of transformers' eager attention (which repeats each kv
    head), in float32; a prompt's forward goes to transformers' SDPA."""
    calls = []
    packed = M.packed_gqa_sdpa
    monkeypatch.setattr(M, "packed_gqa_sdpa", lambda *a, **kw: calls.append(a[1].shape[2]) or packed(*a, **kw))
    config = M.moe_config("qwen3_moe", 2, M.TINY_QWEN3_MOE)
    assert config.num_attention_heads > config.num_key_value_heads > 1
    eager = M.random_causal_lm(config, "cpu", torch.float32)
    eager.set_attn_implementation("eager")
    ours = M.sharing_copy(eager)
    M.use_packed_gqa_attention(ours)
    assert ours.config._attn_implementation == M.PACKED_GQA_SDPA and eager.config._attn_implementation == "eager"
    prompt = M.random_tokens(config, batch, 20, device="cpu")
    logits = {}
    for name, model in (("eager", eager), ("ours", ours)):
        step = M.DecodeStep(model, batch, context + 1 if context == 20 else context)
        with torch.no_grad():
            step.prefill(prompt)
            step.feed(torch.arange(batch).view(batch, 1) + 7)
            logits[name] = step.forward()
    assert calls[:2] == [20, 20] and calls[2:] == [1, 1]  # two layers: the prompt, then one token
    err = (logits["ours"] - logits["eager"]).norm() / logits["eager"].norm()
    assert err < 1e-5, err


def test_a_lost_gpu_ends_the_run_with_what_was_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    real, models = B.block_phase, []

    def lost(run, name, config, variants, phase, tokens):
        if tokens == 3:
            raise BM.ContextLost("qwen3 decode 3 tokens: AcceleratorError: device-side assert triggered")
        return real(run, name, config, variants, phase, tokens)

    monkeypatch.setattr(B, "block_phase", lost)
    monkeypatch.setattr(B, "run_model", lambda run: models.append(run))
    argv = ["--device", "cpu", "--tiny", "--batches", "1,3", "--prefill", "0", "--rounds", "1",
            "--bf16-experts", "grouped_mm", "--recipes", "row"]
    with pytest.raises(SystemExit, match="stopped: the GPU is unusable after qwen3 decode 3 tokens"):
        B.main(argv)
    assert models == []  # the model part never started
    with pytest.raises(SystemExit, match="stopped: the GPU is unusable"):
        B.main(argv + ["--what", "block", "--name", "moe_tiny"])
    got = json.loads((tmp_path / "moe_tiny.json").read_text())
    assert [(r[1], r[2]) for r in got["rows"]] == [("decode", 1)]
    assert "not measured: the rest of the run" in got["notes"]


def test_tiny_model_split_on_the_cpu(tmp_path, monkeypatch, reference_ops):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    rows = B.main(TINY_MODEL + ["--prefill", "0", "--split", "--name", "moe_split_tiny"], floors=FLOORS)["model"]
    cells = [dict(zip(B.MODEL_COLUMNS, row)) for row in rows]
    assert [(c["batch"], c["recipe"], c["experts implementation"]) for c in cells] == [
        (batch, *v) for batch in (1, 2)
        for v in (("bf16", "grouped_mm"), ("row", B.OURS), ("row", B.NOOP_EXPERTS), ("bf16", B.NOOP_EXPERTS))]
    for batch in (1, 2):
        bf16, ours, noop, noop_bf16 = (c for c in cells if c["batch"] == batch)
        for n in (noop, noop_bf16):
            assert n["x bf16"] is None and n["logit rel err"] is None and n["experts ms"] is None
        assert ours["rest ms"] == noop["ms"] and ours["experts ms"] == pytest.approx(ours["ms"] - noop["ms"], abs=1e-3)
        assert bf16["rest ms"] == noop_bf16["ms"] and bf16["bound x bf16"] is None and bf16["experts floor ms"] > 0
        floor = ours["experts floor ms"]  # the weights of the experts hit, at the given 1 GB/s
        # the cell is rounded to 3 decimals, so half a unit of that rounding is allowed besides 1%
        bound = bf16["ms"] / (noop["ms"] + floor)
        assert floor > 0 and ours["bound x bf16"] == pytest.approx(bound, rel=1e-2, abs=6e-4)
    got = json.loads((tmp_path / "moe_split_tiny.json").read_text())
    assert "row: decode batch 2: bound x bf16" in got["summary"] and "split: experts ms" in got["notes"]


def test_tiny_model_fused_on_the_cpu(tmp_path, monkeypatch, reference_ops):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    built = []
    real = cnn.fuse
    monkeypatch.setattr(cnn, "fuse", lambda model: built.append(model) or real(model))
    rows = B.main(TINY_MODEL + ["--prefill", "0", "--batches", "1", "--fuse", "--name", "moe_fused_tiny"],
                  floors=FLOORS)["model"]
    assert len(built) == 1 and isinstance(built[0].model.layers[0].self_attn.qkv_proj, cnn.QuantizedLinear)
    cells = [dict(zip(B.MODEL_COLUMNS, row)) for row in rows]
    assert [c["recipe"] for c in cells] == ["bf16", "row"] and 1e-4 < cells[1]["logit rel err"] < 0.5
    assert "cnn.convert recipe row and cnn.fuse" in json.loads((tmp_path / "moe_fused_tiny.json").read_text())["notes"]


def test_the_profiled_attention_ways_give_the_float64_product():
    """profile_kernels --what attention times three ways of one decode step's attention: each gives the float64
    product, with a mask that hides part of one sequence's cache."""
    from benchmarks import profile_kernels as P

    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 32, 1, 16, generator=g)
    k, v = torch.randn(3, 4, 20, 16, generator=g), torch.randn(3, 4, 20, 16, generator=g)
    mask = torch.ones(3, 1, 1, 20, dtype=torch.bool)
    mask[1, ..., 5:] = False
    ways = P.attention_ways(q, k, v, mask)
    want = ways.pop("float64")()
    assert sorted(ways) == ["enable_gqa", "packed", "repeat_kv"]
    for name, fn in ways.items():
        assert R.rel_error(fn(), want) < 1e-6, name
    masked_out = P.attention_ways(q, k, v, torch.ones_like(mask))["packed"]()
    assert R.rel_error(masked_out[1], want[1]) > 1e-2  # the mask is applied
