"""The model benchmarks' pure pieces on the CPU: what the floors count, torch's FP8 and integer linear layers against
the float64 reference, the replayable decode step against a full forward, the no-op linears of the split and its
arithmetic, the variants of a recipe, the plan, argument parsing and tiny runs of several recipes; no timing."""

import json
from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from benchmarks import bench_linear_stack, bench_model, common, render
from benchmarks import model_split as S
from benchmarks import model_torch as T
from cutedsl_gemm import nn as cnn
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import ScaleGranularity
from cutedsl_gemm.tools import baselines, cli
from cutedsl_gemm.tools import models as M

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny():
    config = M.llama_config(2, M.TINY_LLAMA)
    return config, M.random_llama(config, "cpu", torch.float32)


def linear_shapes(config):
    """(N, K) of one decoder layer's linears, from the config's dimensions."""
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def test_streamed_bytes_counts_every_weight_once_and_the_steps_embedding_rows():
    config = M.llama_config(2, M.TINY_LLAMA)
    model = M.random_llama(config, "cpu", torch.bfloat16)
    h, v, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    rotary = sum(b.numel() * b.element_size() for b in model.model.rotary_emb.buffers())  # fp32 frequencies
    assert rotary >= config.head_dim // 2 * 4
    norms = (2 * layers + 1) * h * 2
    linears = layers * sum(n * k for n, k in linear_shapes(config))
    assert S.streamed_bytes(model, 3) == 2 * linears + norms + 2 * v * h + 3 * h * 2 + rotary
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert S.linear_bytes(model, names) == 2 * linears and S.linear_bytes(model, ["lm_head"]) == 2 * v * h

    # the same model with torch's FP8 row-wise layers: one byte per weight plus an fp32 scale per output channel
    M.replace_modules(model, names, lambda lin: baselines.TorchFp8Linear.from_linear(lin, "row"))
    scales = layers * sum(4 * n for n, _ in linear_shapes(config))
    assert S.streamed_bytes(model, 3) == linears + scales + norms + 2 * v * h + 3 * h * 2 + rotary
    assert S.linear_bytes(model, names) == linears + scales

    tied = M.random_llama(M.llama_config(1, dict(M.TINY_LLAMA, tie_word_embeddings=True)), "cpu", torch.bfloat16)
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    one_layer = sum(n * k for n, k in linear_shapes(config)) * 2 + 3 * h * 2  # linears, 2 norms + the final one
    assert S.streamed_bytes(tied, 3) == one_layer + v * h * 2 + rotary  # the whole shared table, once

    assert S.floor_ms(3_000_000_000, 3.0) == pytest.approx(1.0) and S.floor_ms(1, None) is None


def test_the_stack_floor_at_given_floors():
    # 8 layers of FP8 weights stream in 0.58 ms at 3.0 TB/s; at M = 4096 the FLOPs bound it instead
    floors = SimpleNamespace(hbm_tbps=3.0, fp8_tflops=1979.0, stream_us=lambda nbytes: nbytes / 3.0e6,
                             mma_us=lambda flops: flops / 1979.0e6)
    weights = 8 * sum(n * k for n, k in bench_linear_stack.LLAMA3_8B_LINEARS)
    assert weights == 1_744_830_464
    assert bench_linear_stack.stack_floor_ms(1, 8, floors=floors) == pytest.approx(0.582, abs=1e-3)
    flops = 2 * 4096 * weights
    assert bench_linear_stack.stack_floor_ms(4096, 8, floors=floors) == pytest.approx(flops / 1979.0 / 1e9)


def test_linear_stacks_share_one_set_of_weights():
    shapes = ((384, 256), (256, 512))
    stacks = bench_linear_stack.build_stacks(2, "row", bench_linear_stack.VARIANTS, "cpu", shapes=shapes)
    # (the row recipe's layers call quantize_fp8 and scaled_mm; the one-kernel variant forces quantize_scaled_mm's)
    assert list(stacks) == ["bf16", "torch FP8", "ours", "ours, 1 kernel"] and all(len(s) == 4 for s in stacks.values())
    assert [one.layer for one in stacks["ours, 1 kernel"]] == stacks["ours"]
    assert not bench_linear_stack.has_one_kernel_rows("tensor")
    bf16, theirs, ours, _ = stacks.values()
    assert [(m.out_features, m.in_features) for m in ours] == [(n, k) for n, k in shapes] * 2
    assert not torch.equal(bf16[0].weight, bf16[2].weight)  # distinct layers
    for lin, t, o in zip(bf16, theirs, ours):  # quantized from the same weights, the same bits
        qw, sw = baselines.torch_quantize_fp8(lin.weight, "row")
        for layer in (t, o):
            assert torch.equal(layer.weight.view(torch.uint8), qw.view(torch.uint8))
            assert torch.equal(layer.weight_scale, sw.reshape(1, -1))
    inputs = {k: torch.randn(3, k, dtype=torch.bfloat16) for k in (256, 512)}
    calls = []
    for lin in theirs:
        lin.register_forward_hook(lambda mod, inp, out: calls.append(tuple(out.shape)))
    bench_linear_stack.forward_fn(theirs, inputs)()
    assert calls == [(3, 384), (3, 256)] * 2


@pytest.mark.parametrize("recipe", ["row", "tensor"])
def test_torch_fp8_linear_against_the_float64_reference(recipe):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 384, bias=True).to(torch.bfloat16).requires_grad_(False)
    layer = baselines.TorchFp8Linear.from_linear(linear, recipe)
    x = 3 * torch.randn(2, 5, 256, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 5, 384) and y.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == ((1, 384) if recipe == "row" else ())

    # torch's quantization is the library's reference quantizer, bit for bit, on groups that are not all zero
    x2 = x.reshape(-1, 256)
    qx, sx = baselines.torch_quantize_fp8(x2, recipe)
    rq, rs = R.quantize(x2, ScaleGranularity.named(recipe))
    assert torch.equal(qx.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sx, rs)
    qw, sw = baselines.torch_quantize_fp8(linear.weight, recipe)
    exact = R.reference_gemm(qx, sx, qw, sw, recipe, bias=linear.bias)
    assert R.rel_error(y.reshape(-1, 384), exact) < 4e-3  # the bf16 output's rounding
    unquantized = x2.double() @ linear.weight.double().t() + linear.bias.double()
    assert 1e-3 < R.rel_error(y.reshape(-1, 384), unquantized) < 0.06  # FP8's own error


def test_torch_fp8_linear_deepseek_layouts_and_refusals():
    w = torch.randn(256, 384, dtype=torch.bfloat16)
    layer = baselines.TorchFp8Linear(w, None, "1x128_128x128")
    # F.scaled_mm's BlockWise128x128 operand: (N/128, Kb padded to 4) transposed
    assert layer.weight_scale.shape == (4, 2) and layer.weight_scale.stride() == (1, 4)
    _, sw = baselines.torch_quantize_fp8(w, "128x128")
    assert torch.equal(layer.weight_scale[:3], sw.t()) and bool((layer.weight_scale[3:] == 1).all())
    with pytest.raises(ValueError, match="runs the recipes"):
        baselines.TorchFp8Linear(w, None, "mx")
    with pytest.raises(ValueError, match="whole 128x128 groups"):
        baselines.TorchFp8Linear(torch.randn(200, 384), None, "1x128_128x128")
    with pytest.raises(ValueError, match="expects bf16 input"):
        baselines.TorchFp8Linear(w, None, "row")(torch.randn(3, 384))


def test_torch_int8_linear_against_the_float64_reference():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 384, bias=True).to(torch.bfloat16).requires_grad_(False)
    layer = T.TorchInt8Linear.from_linear(linear)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (1, 384)
    for rows in (3, 40):  # below torch._int_mm's 17 rows (padded) and above
        x = 3 * torch.randn(rows, 256, dtype=torch.bfloat16)
        y = layer(x.view(1, rows, 256))
        assert y.shape == (1, rows, 384) and y.dtype == torch.bfloat16
        qx, sx = T.torch_quantize_int8(x)
        rq, rs = R.quantize_int8_reference(x, "row")
        assert (qx.int() - rq.int()).abs().max() <= 1 and torch.allclose(sx.reshape(-1), rs.reshape(-1))
        exact = R.reference_int8_mm(qx, layer.weight.t(), sx, layer.weight_scale, linear.bias)
        assert R.rel_error(y.reshape(rows, 384), exact) < 4e-3
        unquantized = x.double() @ linear.weight.double().t() + linear.bias.double()
        assert 1e-3 < R.rel_error(y.reshape(rows, 384), unquantized) < 0.03
    with pytest.raises(ValueError, match="expects bf16 input"):
        layer(torch.randn(2, 256))


@pytest.mark.parametrize("cls,bits,group", [("TorchInt4WeightLinear", 4, 128), ("TorchInt8WeightLinear", 8, 0)])
def test_torch_weight_only_linears_against_the_float64_reference(cls, bits, group):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 384, bias=False).to(torch.bfloat16).requires_grad_(False)
    layer = getattr(T, cls).from_linear(linear)
    x = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 5, 384) and y.dtype == torch.bfloat16
    codes, scales, _ = IP.quantize_weights(linear.weight, bits=bits, group=group)
    w = codes.double() * scales.double().repeat_interleave(group or 256, dim=1)
    exact = x.reshape(-1, 256).double() @ w.t()
    assert R.rel_error(y.reshape(-1, 384), exact) < 8e-3  # bf16 scales and output
    unquantized = x.reshape(-1, 256).double() @ linear.weight.double().t()
    assert R.rel_error(y.reshape(-1, 384), unquantized) > 1e-3


def test_each_recipe_has_a_torch_path_or_a_note():
    make, what = T.torch_path("row")
    assert isinstance(make(torch.nn.Linear(256, 128).to(torch.bfloat16)), baselines.TorchFp8Linear)
    assert "torch._scaled_mm" in what and "F.scaled_mm" in T.torch_path("deepseek")[1]
    assert T.torch_path("int8")[0] == T.TorchInt8Linear.from_linear
    assert bench_model.TorchInt8Linear is T.TorchInt8Linear  # other benchmarks import it from bench_model
    assert "_weight_int4pack_mm" in T.torch_path("int4_weight")[1]
    make, what = T.torch_path("mxfp8")
    assert make is None and "bf16 only" in what
    with pytest.raises(ValueError, match="unknown linear recipe"):
        T.torch_path("fp3")


def test_a_failing_variant_is_noted_and_a_lost_gpu_stops_the_run(monkeypatch):
    failed = {}
    assert bench_model.guarded("x", failed, "cpu", lambda: 1 / 0) is None
    assert failed == {"x": "ZeroDivisionError: division by zero"}
    monkeypatch.setattr(bench_model, "cuda_usable", lambda device: False)
    with pytest.raises(bench_model.ContextLost, match="y: ValueError: bad"):
        bench_model.guarded("y", failed, "cuda", lambda: (_ for _ in ()).throw(ValueError("bad\nmore")))
    assert failed["y"] == "ValueError: bad"


def test_the_tiny_check_runs_in_a_child_and_drops_the_variants_that_crash_it(monkeypatch):
    args = Namespace(recipes=["row", "deepseek"], variants=["bf16", "torch", "ours"], device="cuda", lm_head="both",
                     split=True)
    cmd = bench_model.check_command(args, ["deepseek"], ["ours"])
    assert cmd[1:3] == ["-m", "benchmarks.bench_model"] and "--tiny" in cmd and "--no-check" in cmd
    assert cmd[cmd.index("--recipes") + 1] == "deepseek" and cmd[cmd.index("--variants") + 1] == "ours"
    assert cmd[cmd.index("--lm-head") + 1] == "both" and "--split" in cmd and "--compile" not in cmd
    calls = []

    def child(args, recipes, variants):
        calls.append((recipes, variants))
        return "exit code 1: device-side assert" if "deepseek" in recipes and "ours" in variants else None

    monkeypatch.setattr(bench_model, "_check_run", child)
    assert bench_model.precheck(args) == {("deepseek", "ours"): "exit code 1: device-side assert"}
    assert calls == [(["row", "deepseek"], ["bf16", "torch", "ours"]), (["row"], ["bf16", "torch", "ours"]),
                     (["deepseek"], ["bf16", "torch", "ours"]), (["deepseek"], ["bf16"]), (["deepseek"], ["torch"]),
                     (["deepseek"], ["ours"])]
    monkeypatch.setattr(bench_model, "_check_run", lambda args, recipes, variants: None)
    assert bench_model.precheck(args) == {}


@pytest.mark.parametrize("recipe", ["tensor", "row", "1x128_128x128", "128x128_128x128"])
def test_make_operands_scale_layouts(recipe):
    qa, qw, sa, sb, (_, sa_plain, _, sw_plain) = baselines.make_operands(3, 256, 384, recipe, device="cpu")
    expect = {"tensor": ((), ()), "row": ((3, 1), (1, 256)), "1x128_128x128": ((3, 3), (4, 2)),
              "128x128_128x128": ((1, 4), (4, 2))}[recipe]
    assert (tuple(sa.shape), tuple(sb.shape)) == expect
    if recipe == "1x128_128x128":
        assert sa.stride() == (1, 3) and torch.equal(sa, sa_plain) and torch.equal(sb[:3], sw_plain.t())


def test_decode_step_replays_the_step_a_full_forward_computes(tiny):
    config, model = tiny
    prompt = M.random_tokens(config, 2, 10, device="cpu")
    nxt = torch.tensor([5, 7])
    full = model(torch.cat([prompt, nxt[:, None]], 1)).logits[:, -1]
    step = M.DecodeStep(model, 2, 11)  # exactly one free position: no attention mask
    torch.testing.assert_close(step.prefill(prompt), M.last_logits(model, prompt))
    step.feed(nxt)
    first = step()
    torch.testing.assert_close(first, full, rtol=1e-4, atol=1e-4)
    assert torch.equal(step(), first)  # the same step again: the cache's own write position is put back
    with pytest.raises(ValueError, match="prompt must be"):
        step.prefill(M.random_tokens(config, 2, 11, device="cpu"))


@pytest.mark.parametrize("batch,free", [(1, 1), (3, 1), (2, 4)])
def test_decode_step_replayed_many_times_writes_one_slot(tiny, batch, free):
    # a timing loop replays one step rounds x reps times: each run writes the slot of ``position`` and no other
    config, model = tiny
    prompt = M.random_tokens(config, batch, 9, device="cpu")
    step = M.DecodeStep(model, batch, 9 + free)  # free > 1: the step passes an attention mask
    step.prefill(prompt)
    step.feed(torch.arange(batch) + 3)
    assert step._counters or step._takes_cache_position  # this transformers version's convention is known
    first = step()
    keys = [layer.keys.clone() for layer in getattr(step.cache, "layers", ())]
    for _ in range(50):
        assert torch.equal(step(), first)
    assert step.write_positions() == [10] * len(step._counters)
    for layer, before in zip(getattr(step.cache, "layers", ()), keys):
        assert torch.equal(layer.keys, before)  # the same slot rewritten with the same values
    assert torch.equal(step.check_replay(step, times=20), first)


def test_check_replay_stops_a_run_that_would_walk_past_the_cache(tiny):
    config, model = tiny
    step = M.DecodeStep(model, 2, 11)
    step.prefill(M.random_tokens(config, 2, 10, device="cpu"))
    if not step._counters:
        pytest.skip("this transformers version takes the write position from the caller")

    def stale():  # the model without the step's reset: the cache's own position advances on every run
        return model(**step._inputs(step.tokens, step.position, step.mask)).logits[:, -1]

    with pytest.raises(RuntimeError, match="walk past the cache"):
        step.check_replay(stale)  # a second run would write slot 11 of 11 (an IndexError, a device assert on a GPU)
    outputs = iter([torch.zeros(2, 5), torch.ones(2, 5)])
    with pytest.raises(RuntimeError, match="different logits"):
        step.check_replay(lambda: (step(), next(outputs))[1], times=2)
    assert step.check_replay(step, times=2).shape == (2, config.vocab_size)


def test_greedy_generate_matches_full_forwards(tiny):
    config, model = tiny
    prompt = M.random_tokens(config, 2, 7, device="cpu")
    tokens, seconds = M.greedy_generate(model, prompt, 5, graph=False)
    seq = prompt
    for _ in range(5):
        seq = torch.cat([seq, M.last_logits(model, seq).argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, seq[:, 7:]) and seconds > 0
    with pytest.raises(ValueError, match="new_tokens"):
        M.greedy_generate(model, prompt, 1, graph=False)


def test_sharing_copy_shares_tensors_not_modules(tiny):
    config, model = tiny
    copy = M.sharing_copy(model)
    assert copy.lm_head is not model.lm_head and copy.lm_head.weight is model.lm_head.weight
    M.replace_modules(copy, ["model.layers.0.mlp.down_proj"], lambda lin: torch.nn.Identity())
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert isinstance(copy.model.layers[0].mlp.down_proj, torch.nn.Identity)


def tiny_run(lm_head="both", split=True, recipes=("row",), layers=1, variants=("bf16", "torch", "ours")):
    args = Namespace(device="cpu", seed=0, lm_head=lm_head, recipes=list(recipes), variants=list(variants),
                     split=split, skip={}, attention="packed-gqa")
    run = bench_model.Run(args, M.llama_config(layers, M.TINY_LLAMA))
    run.build_base()
    return run


@pytest.mark.parametrize("lm_head", ["bf16", "converted", "both"])
def test_the_variants_of_a_recipe_convert_the_same_layers_of_one_model(lm_head):
    run = tiny_run(lm_head)
    variants = bench_model.build_recipe(run, "row")  # ours: converted, not run, on the CPU
    heads = bench_model.lm_heads(run.args)
    assert [v.key for v in variants] == [("bf16", "bf16")] + [
        (name, head) for head in heads for name in ("torch", "ours", bench_model.NOOP)]
    assert run.notes == [] and run.failed == {}
    bf16 = run.base
    decoder = run.bf16.names
    assert len(decoder) == 7 and "lm_head" not in decoder
    by = {v.key: v for v in variants}
    for head in heads:
        theirs, ours, noop = (by[name, head] for name in ("torch", "ours", bench_model.NOOP))
        assert theirs.names == ours.names == noop.names == decoder + ["lm_head"] * (head == "converted")
        for name in decoder:
            assert type(bf16.get_submodule(name)) is torch.nn.Linear
            assert isinstance(theirs.model.get_submodule(name), baselines.TorchFp8Linear)
            assert isinstance(ours.model.get_submodule(name), cnn.QuantizedLinear)
            assert isinstance(noop.model.get_submodule(name), S.NoopLinear)
        kinds = ((baselines.TorchFp8Linear, cnn.QuantizedLinear, S.NoopLinear) if head == "converted"
                 else (torch.nn.Linear,) * 3)
        for v, kind in zip((theirs, ours, noop), kinds):
            assert type(v.model.lm_head) is kind
            assert v.model.model.embed_tokens.weight is bf16.model.embed_tokens.weight
        assert S.streamed_bytes(ours.model, 1) == S.streamed_bytes(theirs.model, 1)  # FP8 + fp32 per channel
    assert type(bf16.lm_head) is torch.nn.Linear
    if lm_head == "both":  # the converted head on a copy of the converted model: the decoder's tensors are shared
        for name in ("torch", "ours"):
            one, two = by[name, "bf16"].model, by[name, "converted"].model
            down = [m.model.layers[0].mlp.down_proj for m in (one, two)]
            assert one is not two and down[0] is not down[1] and down[0].weight is down[1].weight
    # the no-op models do not depend on the recipe: the next recipe gets the same ones, with their kept steps
    again = bench_model.build_recipe(run, "int8")
    assert [v for v in again if v.name in ("bf16", bench_model.NOOP)] == [v for v in variants
                                                                         if v.name in ("bf16", bench_model.NOOP)]
    assert isinstance(again[1].model.model.layers[0].mlp.down_proj, T.TorchInt8Linear)


def test_a_failing_conversion_is_noted_and_the_others_go_on(monkeypatch):
    run = tiny_run("bf16", split=False)
    monkeypatch.setattr(cnn, "convert", lambda *a, **k: (_ for _ in ()).throw(ValueError("no kernels\nmore")))
    variants = bench_model.build_recipe(run, "row")
    assert [v.key for v in variants] == [("bf16", "bf16"), ("torch", "bf16")]
    assert run.failed == {"row: conversion, ours": "ValueError: no kernels"}
    run.args.skip = {("row", "torch"): "crashed"}
    assert [v.key for v in bench_model.build_recipe(run, "row")] == [("bf16", "bf16")]
    assert [v.key for v in bench_model.build_recipe(run, "mxfp8")] == [("bf16", "bf16")]
    assert "mxfp8: no torch path for 'mxfp8': ours is compared with bf16 only" in run.notes


def test_arguments(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = bench_model.parse_args(["--device", "cpu"])
    assert args.variants == ["bf16", "torch"] and args.name is None and args.layers == 32 and args.check
    assert args.batches == [1, 16, 64] and args.context == 512 and args.prefill == 4096
    assert args.recipes == ["row", "deepseek", "int8", "int4_weight"] and args.lm_head == "bf16" and not args.split
    assert (args.rounds, args.reps) == (6, 5) and not args.compile and args.compile_variants == ["bf16", "ours"]
    assert bench_model.parse_args(["--device", "cpu", "--tiny"]).layers == 2
    assert args.attention == "packed-gqa"
    assert bench_model.parse_args(["--device", "cpu", "--attention", "transformers"]).attention == "transformers"
    assert bench_model.parse_args(["--device", "cpu", "--recipe", "int8"]).recipes == ["int8"]
    assert bench_model.parse_args(["--device", "cpu", "--lm-head"]).lm_head == "converted"
    assert bench_model.parse_args(["--device", "cpu", "--lm-head", "both"]).lm_head == "both"
    assert bench_model.default_name(32) == "model_llama8b_32l"
    assert bench_model.RECIPES == tuple(cnn.LINEAR_RECIPES)
    assert {"row", "deepseek", "tensor", "int8", "int8_weight", "int4_weight"} <= set(bench_model.RECIPES)
    assert bench_linear_stack.RECIPES == ("row", "deepseek", "tensor")  # the FP8 recipes torch runs
    args = bench_model.parse_args(["--device", "cpu", "--variants", "torch,bf16", "--batches", "2,4", "--name", "x",
                                   "--no-check", "--recipes", "int8,row,int8"])
    assert args.variants == ["torch", "bf16"] and args.batches == [2, 4] and args.name == "x" and not args.check
    assert args.recipes == args.compile_recipes == ["int8", "row"] and args.compile_batches == [2, 4]
    for bad in (["--device", "cpu", "--variants", "ours"], ["--device", "cpu", "--compile"], [],
                ["--device", "cpu", "--batches", "1,0"], ["--device", "cpu", "--layers", "0"],
                ["--device", "cpu", "--recipe", "mx"], ["--device", "cpu", "--recipes", "row,mx"],
                ["--device", "cpu", "--recipe", "row", "--recipes", "int8"], ["--device", "cpu", "--variants", "fp8"],
                ["--device", "cpu", "--prefill", "-1"], ["--device", "cpu", "--compile-recipes", "row"],
                ["--device", "cpu", "--lm-head", "fp8"]):
        with pytest.raises(SystemExit):
            bench_model.parse_args(bad)


def gpu_args(monkeypatch, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return bench_model.parse_args(argv)


def test_compile_arguments_and_the_plan(monkeypatch):
    argv = ["--recipes", "row,deepseek,int8,int4_weight", "--lm-head", "both", "--split", "--compile",
            "--compile-recipes", "row", "--compile-batches", "1"]
    args = gpu_args(monkeypatch, argv)
    assert args.name == "model_llama8b_32l" and args.compile_mode == "default"
    with pytest.raises(SystemExit):
        gpu_args(monkeypatch, argv[:-3] + ["int8", "--recipes", "row"])  # a compile recipe that the run does not run
    with pytest.raises(SystemExit):
        gpu_args(monkeypatch, ["--compile", "--compile-variants", "fp8"])
    cells = bench_model.plan(args)
    per_recipe = 3 * 7 + 5  # decode: bf16 + (torch, ours, no-op) x 2 LM heads at 3 batches; prefill: no no-op
    fused = 3 * 2 + 2  # row and deepseek: ours with its MLPs fused, both LM heads, decode and prefill
    assert sum(n for *_, n in cells) == 4 * per_recipe + 2 * fused + 2  # compiled: bf16, ours (LM head bf16), batch 1
    assert [c for c in cells if c[1] == "compiled"] == [("row", "compiled", "decode", 1, "bf16", 1),
                                                        ("row", "compiled", "decode", 1, "ours", 1)]
    assert 3 * 60 < bench_model.estimate_s(args, cells) < 8 * 60  # the constants' rough length, under 8 minutes
    args.compile_variants = ["bf16", "ours", "noop"]
    assert len(bench_model.plan(args)) == len(cells) + 1
    one = gpu_args(monkeypatch, ["--recipe", "mxfp8", "--batches", "1", "--prefill", "0"])
    assert bench_model.plan(one) == [("mxfp8", "graph", "decode", 1, "bf16", 1), ("mxfp8", "graph", "decode", 1,
                                                                                  "ours", 1)]  # no torch path


@pytest.mark.parametrize("module", [bench_model, bench_linear_stack])
def test_tools_answer_help(module, capsys):
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert module.__doc__.splitlines()[0] in out and "--no-save" in out and "--name" in out


TINY_ARGV = ["--device", "cpu", "--tiny", "--layers", "1", "--batches", "1,2", "--context", "8", "--prefill", "16",
             "--rounds", "1", "--reps", "1"]


def test_tiny_run_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    rows = bench_model.main(TINY_ARGV + ["--recipe", "row"])
    out = capsys.readouterr().out
    assert "no result file" in out and not any(tmp_path.iterdir())
    assert "6 cells (variant, phase, batch) over 1 recipe(s)" in out and "row eager decode batch 2, torch" in out
    cells = [dict(zip(bench_model.COLUMNS, row)) for row in rows]
    assert [(c["phase"], c["batch"], c["variant"]) for c in cells] == [
        ("decode", 1, "bf16"), ("decode", 1, "torch"), ("decode", 2, "bf16"), ("decode", 2, "torch"),
        ("prefill", 1, "bf16"), ("prefill", 1, "torch")]
    for c in cells:
        assert c["ms"] > 0 and c["tokens/s"] > 0 and c["recipe"] == "row" and c["lm head"] == "bf16"
        assert c["mode"] == "eager" and (c["logit rel err"] is None) == (c["variant"] == "bf16") and c["x bf16"] > 0
        assert c["% of weight floor"] is None and c["linears ms"] is None  # no floors on the CPU, no split
        if c["variant"] == "torch":
            assert 1e-3 < c["logit rel err"] < 0.5
    rows2 = bench_model.main(TINY_ARGV + ["--recipe", "row", "--name", "model_tiny"])
    got = json.loads((tmp_path / "model_tiny.json").read_text())
    assert got["columns"] == bench_model.COLUMNS and len(got["rows"]) == len(rows2) == 6
    assert "static KV cache" in got["notes"] and "ours" not in " ".join(map(str, got["rows"]))
    assert "attention: SDPA reading the KV cache once" in got["notes"]


def test_several_recipes_both_heads_and_the_split_in_one_run(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    prefills, writes = [], []
    real_prefill, real_write = M.DecodeStep.prefill, common.write_result
    monkeypatch.setattr(M.DecodeStep, "prefill", lambda self, prompt: (prefills.append(
        type(self.model.model.layers[0].mlp.down_proj).__name__), real_prefill(self, prompt))[1])
    monkeypatch.setattr(common, "write_result", lambda *a, **k: (writes.append(len(a[3])), real_write(*a, **k))[1])
    floors = SimpleNamespace(hbm_tbps=0.001)  # a rate the tiny model's weights take milliseconds at
    rows = bench_model.main(TINY_ARGV + ["--recipes", "row,int8", "--lm-head", "both", "--split", "--name", "m"],
                            floors=floors)
    cells = [dict(zip(bench_model.COLUMNS, row)) for row in rows]
    decode = [(c["recipe"], c["batch"], c["lm head"], c["variant"]) for c in cells if c["phase"] == "decode"]
    noop = bench_model.NOOP
    assert decode == [(recipe, batch, head, variant) for recipe in ("row", "int8") for batch in (1, 2)
                      for head, variant in (("bf16", "bf16"), ("bf16", "torch"), ("bf16", noop),
                                            ("converted", "torch"), ("converted", noop))]
    assert [(c["recipe"], c["lm head"], c["variant"]) for c in cells if c["phase"] == "prefill"] == [
        (recipe, head, variant) for recipe in ("row", "int8")
        for head, variant in (("bf16", "bf16"), ("bf16", "torch"), ("converted", "torch"))]
    # the caches prefilled: bf16 and the no-op model once per batch for the whole run, torch once per recipe and
    # batch; the converted-head variants decode over their bf16-head partner's cache
    assert sorted(prefills) == ["Linear"] * 2 + ["NoopLinear"] * 2 + ["TorchFp8Linear"] * 2 + ["TorchInt8Linear"] * 2
    assert writes == [5, 10, 13, 18, 23, 26, 26]  # the file after each phase, and at the end
    by = {(c["recipe"], c["phase"], c["batch"], c["lm head"], c["variant"]): c for c in cells}
    for (recipe, phase, batch, head, variant), c in by.items():
        if phase == "prefill" or variant == noop:
            assert c["linears ms"] is None and c["% of weight floor"] is None
            continue
        rest = by[recipe, phase, batch, head, noop]["ms"]
        assert c["rest ms"] == pytest.approx(rest, abs=1e-4)
        assert c["linears ms"] == pytest.approx(c["ms"] - rest, abs=2e-4)
        assert c["linears floor ms"] > 0 and c["% of weight floor"] > 0
        bf16 = by[recipe, phase, batch, "bf16", "bf16"]["ms"]
        if variant == "bf16":
            assert c["bound x bf16"] is None and c["x bf16"] == 1.0
        else:
            assert c["bound x bf16"] == pytest.approx(bf16 / (rest + c["linears floor ms"]), rel=2e-3, abs=1e-3)
            assert c["x torch"] == 1.0 and 1e-3 < c["logit rel err"] < 0.5
    got = json.loads((tmp_path / "m.json").read_text())
    assert len(got["rows"]) == 26 and "split: linears ms = step" in got["notes"] and "0.001 TB/s" in got["notes"]
    assert "int8: no torch path" not in got["notes"]
    assert "row, LM head bf16, eager: decode batch 1: ours x bf16" not in got.get("summary", {})  # no ours on the CPU


def test_a_lost_gpu_ends_the_run_with_what_was_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    real = bench_model.measure_prefill

    def lost(run, variants, where):
        if where == "int8":
            raise bench_model.ContextLost("prefill, torch: AcceleratorError: device-side assert triggered")
        return real(run, variants, where)

    monkeypatch.setattr(bench_model, "measure_prefill", lost)
    argv = TINY_ARGV[:5] + ["--batches", "1", "--context", "8", "--prefill", "16", "--rounds", "1", "--reps", "1",
                            "--name", "model_tiny", "--recipes", "row,int8,int4_weight"]
    with pytest.raises(SystemExit, match="stopped: the GPU is unusable after prefill, torch"):
        bench_model.main(argv)
    got = json.loads((tmp_path / "model_tiny.json").read_text())
    # row: decode and prefill; int8: its decode rows, then nothing: int4_weight never started
    assert [(r[0], r[2]) for r in got["rows"]] == [("decode", "row")] * 2 + [("prefill", "row")] * 2 + [
        ("decode", "int8")] * 2
    assert "not measured: the rest of the run" in got["notes"]


@pytest.mark.gpu
def test_decode_step_graph_replays_on_the_gpu():
    config = M.llama_config(2, M.TINY_LLAMA)
    model = M.random_llama(config, "cuda")
    step = M.DecodeStep(model, 2, 17)
    step.prefill(M.random_tokens(config, 2, 16))
    graph, output = M.cuda_graph(step)
    first = step.check_replay(graph.replay, output, times=3)
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(step.check_replay(graph.replay, output, times=1), first)
    assert step.write_positions() == [17] * len(step._counters)


@pytest.mark.gpu
@pytest.mark.parametrize("cls", ["TorchInt8Linear", "TorchInt8WeightLinear", "TorchInt4WeightLinear"])
def test_torch_integer_linears_on_the_gpu_match_the_cpu(cls):
    torch.manual_seed(0)
    linear = torch.nn.Linear(4096, 1024, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(5, 4096, dtype=torch.bfloat16)
    on_cpu = getattr(T, cls).from_linear(linear)(x)
    try:
        on_gpu = getattr(T, cls).from_linear(linear.cuda())(x.cuda())
    except NotImplementedError as e:  # e.g. a torch build without the CUDA kernel of _weight_int8pack_mm
        pytest.skip(f"torch has no CUDA kernel here: {str(e).splitlines()[0]}")
    assert R.rel_error(on_gpu.cpu(), on_cpu) < 1e-2  # the same quantized weights, torch's CUDA kernels


def test_demo_model_section_is_skipped_without_a_hopper_gpu(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_hopper_available", lambda: False)
    assert cli._demo_model() is True
    assert "Model: skipped (needs a Hopper GPU)" in capsys.readouterr().out


def test_render_orders_the_new_results():
    assert {"model_llama8b_32l", "model_llama8b", "linear_stack"} <= set(render.ORDER)
    assert {"model_llama8b_32l", "linear_stack"} <= {name for _, name in render.PRODUCERS}


def test_summary_gives_the_headline_figures_per_recipe_head_and_mode():
    """ours x bf16 at every decode batch and at prefill; at the first batch ours x torch, the logit error, bf16's
    weight floor over ours (what "ours x bf16" could reach if both streamed their weights at the floor), and with
    the split the linears' % of their floor and the bound the rest sets."""
    row = dict.fromkeys(bench_model.COLUMNS)

    def cells(phase, batch, variant, ms, pct, x_bf16=None, head="bf16", mode="graph", **more):
        more = {k.replace("_pct_", " % ").replace("_", " "): v for k, v in more.items()}
        assert set(more) <= set(bench_model.COLUMNS)
        return [{**row, "phase": phase, "batch": batch, "recipe": "row", "lm head": head, "mode": mode,
                 "variant": variant, "ms": ms, "% of weight floor": pct, "x bf16": x_bf16, **more}[c]
                for c in bench_model.COLUMNS]

    rows = [cells("decode", 1, "bf16", 2.0, 50.0, 1.0, linears_pct_of_floor=60.0),
            cells("decode", 1, "ours", 1.5, 40.0, 1.333, x_torch=1.5, linears_pct_of_floor=45.0, bound_x_bf16=1.6),
            cells("decode", 16, "ours", 3.0, 20.0, 1.1),
            cells("decode", 1, "ours", 1.4, 40.0, 1.43, head="converted"),
            cells("decode", 1, "ours", 1.2, 40.0, 1.5, mode="compiled"),
            cells("prefill", 1, "bf16", 30.0, None), cells("prefill", 1, "ours", 25.0, None, 1.2)]
    summary = bench_model.summarize(rows, first_batch=1)
    at = "row, LM head bf16, graph: decode batch 1"
    assert summary[f"{at}: x bf16 at the weight floors"] == pytest.approx(1.0 / 0.6, abs=1e-3)
    assert summary[f"{at}: ours x bf16"] == 1.333 and summary[f"{at}: ours x torch"] == 1.5
    assert summary[f"{at}: linears % of floor, ours"] == 45.0 and summary[f"{at}: linears % of floor, bf16"] == 60.0
    assert summary[f"{at}: bound x bf16"] == 1.6
    assert summary["row, LM head bf16, graph: decode batch 16: ours x bf16"] == 1.1
    assert "row, LM head bf16, graph: decode batch 16: ours x torch" not in summary
    assert summary["row, LM head converted, graph: decode batch 1: ours x bf16"] == 1.43
    assert summary["row, LM head bf16, compiled: decode batch 1: ours x bf16"] == 1.5
    assert summary["row, LM head bf16, graph: prefill: ours x bf16"] == 1.2
    assert not any("prefill" in key and "floor" in key for key in summary)


def test_split_arithmetic():
    # a step of 10 ms whose no-op step takes 4 ms: linears 6 ms; 9 GB of linears at 3 TB/s: 3 ms, 50 % of floor;
    # bf16 at 12 ms could reach 12 / (4 + 3) = 1.714 x
    assert S.split_cells(10.0, 4.0, 9_000_000_000, 3.0, 12.0) == [6.0, 3.0, 50.0, 4.0, 1.714]
    assert S.split_cells(10.0, 4.0, 9_000_000_000, None, 12.0) == [6.0, None, None, 4.0, None]
    assert S.split_cells(3.9, 4.0, 9_000_000_000, 3.0, None) == [-0.1, 3.0, None, 4.0, None]  # noise: no %
    assert S.SPLIT_COLUMNS == bench_model.COLUMNS[-5:]


def test_noop_linears_answer_with_one_preallocated_tensor_per_shape(tiny):
    config, model = tiny
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    noop = S.noop_model(model, names)
    assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in names)  # the original as it was
    assert noop.model.embed_tokens.weight is model.model.embed_tokens.weight
    q, o = noop.model.layers[0].self_attn.q_proj, noop.model.layers[0].self_attn.o_proj
    assert q.pool is o.pool and "no-op" in repr(q)
    x = torch.randn(2, 1, config.hidden_size)
    y = q(x)
    assert y.shape == (2, 1, config.num_attention_heads * config.head_dim) and y.dtype == x.dtype
    assert q(x) is y and o(torch.randn(2, 1, config.hidden_size)) is y and not y.any()  # one tensor per shape
    big = torch.randn(1, S.NoopLinear.MAX_POOLED_ROWS + 1, config.hidden_size)
    assert q(big) is not q(big)  # a prefill's outputs are not kept


@pytest.mark.parametrize("head", [False, True])
def test_the_noop_step_has_the_real_steps_shapes_and_runs(tiny, head):
    config, model = tiny
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and (head or n != "lm_head")]
    noop = S.noop_model(model, names)
    prompt = M.random_tokens(config, 2, 6, device="cpu")
    outputs = {}
    for name, m in (("real", model), ("noop", noop)):
        step = M.DecodeStep(m, 2, 7)
        step.prefill(prompt)
        step.feed(torch.tensor([3, 4]))
        outputs[name] = (step.check_replay(step, times=2), [(layer.keys.shape, layer.keys.dtype)
                                                            for layer in getattr(step.cache, "layers", ())])
    (real, real_cache), (fake, fake_cache) = outputs["real"], outputs["noop"]
    assert fake.shape == real.shape and fake.dtype == real.dtype and fake_cache == real_cache
    assert torch.isfinite(fake).all() and not torch.allclose(fake, real)
    if head:
        assert not fake.any()  # the LM head's answer too


def test_a_step_over_another_models_cache(tiny):
    """The converted-head variants decode over the cache their bf16-head partner's prefill wrote."""
    config, model = tiny
    other = M.sharing_copy(model)
    M.replace_modules(other, ["lm_head"], lambda lin: torch.nn.Linear(lin.in_features, lin.out_features, bias=False))
    prompt = M.random_tokens(config, 2, 9, device="cpu")
    nxt = torch.tensor([5, 7])
    step = M.DecodeStep(model, 2, 10)
    step.prefill(prompt)
    step.feed(nxt)
    mine = step()
    theirs = step.with_model(other)
    assert theirs.cache is step.cache and theirs.tokens is step.tokens and theirs.model is other
    full = other(torch.cat([prompt, nxt[:, None]], 1)).logits[:, -1]
    torch.testing.assert_close(theirs.check_replay(theirs, times=2), full, rtol=1e-4, atol=1e-4)
    assert torch.equal(step(), mine)  # the two take turns over one cache
    with pytest.raises(ValueError, match="same class and config"):
        step.with_model(M.random_llama(M.llama_config(1, M.TINY_LLAMA), "cpu", torch.float32))


def test_fused_variant_names_its_stacked_layers():
    model = M.random_llama(M.llama_config(1, M.TINY_LLAMA), "cpu", torch.bfloat16)
    report = cnn.convert(model, "row", filter=lambda name, m: name != "lm_head")
    ours = bench_model.Variant("ours", "bf16", model, list(report.converted))
    run = SimpleNamespace(args=SimpleNamespace(fuse=["mlp", "qkv"]), notes=[])
    fused = bench_model.fused_variant(run, "row", ours)
    layer = "model.layers.0."
    assert fused.names == [layer + n for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                               "mlp.down_proj")]
    assert S.linear_bytes(fused.model, fused.names) == S.linear_bytes(model, ours.names)  # the same bytes, stacked
    assert isinstance(model.model.layers[0].mlp.gate_proj, cnn.QuantizedLinear)  # ours itself is left as it was
