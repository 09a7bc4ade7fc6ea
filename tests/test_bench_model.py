"""The model benchmarks' pure pieces on the CPU: what the floors count, torch's FP8 linear layer against the float64
reference, the replayable decode step against a full forward, argument parsing and a tiny run; no timing."""

import json

import pytest
import torch

from benchmarks import bench_linear_stack, bench_model, common, render
from cutedsl_gemm import nn as cnn
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import ScaleGranularity
from cutedsl_gemm.tools import anchors, cli
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
    assert bench_model.streamed_bytes(model, 3) == 2 * linears + norms + 2 * v * h + 3 * h * 2 + rotary

    # the same model with torch's FP8 row-wise layers: one byte per weight plus an fp32 scale per output channel
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    M.replace_modules(model, names, lambda lin: anchors.TorchFp8Linear.from_linear(lin, "row"))
    scales = layers * sum(4 * n for n, _ in linear_shapes(config))
    assert bench_model.streamed_bytes(model, 3) == linears + scales + norms + 2 * v * h + 3 * h * 2 + rotary

    tied = M.random_llama(M.llama_config(1, dict(M.TINY_LLAMA, tie_word_embeddings=True)), "cpu", torch.bfloat16)
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    one_layer = sum(n * k for n, k in linear_shapes(config)) * 2 + 3 * h * 2  # linears, 2 norms + the final one
    assert bench_model.streamed_bytes(tied, 3) == one_layer + v * h * 2 + rotary  # the whole shared table, once

    assert bench_model.kv_cache_bytes(config, batch=4, positions=33) == 2 * layers * 4 * 2 * 33 * 64 * 2
    assert bench_model.floor_ms(3_000_000_000) == pytest.approx(1.0)


def test_the_stack_floor_is_the_issues_figure():
    # 8 layers of FP8 weights stream in 0.58 ms at 3.0 TB/s; at M = 4096 the FLOPs bound it instead
    weights = 8 * sum(n * k for n, k in bench_linear_stack.LLAMA3_8B_LINEARS)
    assert weights == 1_744_830_464
    assert bench_linear_stack.stack_floor_ms(1, 8) == pytest.approx(0.582, abs=1e-3)
    flops = 2 * 4096 * weights
    assert bench_linear_stack.stack_floor_ms(4096, 8) == pytest.approx(flops / common.FP8_TFLOPS / 1e9)


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
        qw, sw = anchors.torch_quantize_fp8(lin.weight, "row")
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
    layer = anchors.TorchFp8Linear.from_linear(linear, recipe)
    x = 3 * torch.randn(2, 5, 256, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 5, 384) and y.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == ((1, 384) if recipe == "row" else ())

    # torch's quantization is the library's reference quantizer, bit for bit, on groups that are not all zero
    x2 = x.reshape(-1, 256)
    qx, sx = anchors.torch_quantize_fp8(x2, recipe)
    rq, rs = R.quantize(x2, ScaleGranularity.named(recipe))
    assert torch.equal(qx.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sx, rs)
    qw, sw = anchors.torch_quantize_fp8(linear.weight, recipe)
    exact = R.reference_gemm(qx, sx, qw, sw, recipe, bias=linear.bias)
    assert R.rel_error(y.reshape(-1, 384), exact) < 4e-3  # the bf16 output's rounding
    unquantized = x2.double() @ linear.weight.double().t() + linear.bias.double()
    assert 1e-3 < R.rel_error(y.reshape(-1, 384), unquantized) < 0.06  # FP8's own error


def test_torch_fp8_linear_deepseek_layouts_and_refusals():
    w = torch.randn(256, 384, dtype=torch.bfloat16)
    layer = anchors.TorchFp8Linear(w, None, "1x128_128x128")
    # F.scaled_mm's BlockWise128x128 operand: (N/128, Kb padded to 4) transposed
    assert layer.weight_scale.shape == (4, 2) and layer.weight_scale.stride() == (1, 4)
    _, sw = anchors.torch_quantize_fp8(w, "128x128")
    assert torch.equal(layer.weight_scale[:3], sw.t()) and bool((layer.weight_scale[3:] == 1).all())
    with pytest.raises(ValueError, match="runs the recipes"):
        anchors.TorchFp8Linear(w, None, "mx")
    with pytest.raises(ValueError, match="whole 128x128 groups"):
        anchors.TorchFp8Linear(torch.randn(200, 384), None, "1x128_128x128")
    with pytest.raises(ValueError, match="expects bf16 input"):
        anchors.TorchFp8Linear(w, None, "row")(torch.randn(3, 384))


def test_torch_int8_linear_against_the_float64_reference():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 384, bias=True).to(torch.bfloat16).requires_grad_(False)
    layer = bench_model.TorchInt8Linear.from_linear(linear)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (1, 384)
    for rows in (3, 40):  # below torch._int_mm's 17 rows (padded) and above
        x = 3 * torch.randn(rows, 256, dtype=torch.bfloat16)
        y = layer(x.view(1, rows, 256))
        assert y.shape == (1, rows, 384) and y.dtype == torch.bfloat16
        qx, sx = bench_model.torch_quantize_int8(x)
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
    layer = getattr(bench_model, cls).from_linear(linear)
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
    make, what = bench_model.torch_path("row")
    assert isinstance(make(torch.nn.Linear(256, 128).to(torch.bfloat16)), anchors.TorchFp8Linear)
    assert "torch._scaled_mm" in what and "F.scaled_mm" in bench_model.torch_path("deepseek")[1]
    assert bench_model.torch_path("int8")[0] == bench_model.TorchInt8Linear.from_linear
    assert "_weight_int4pack_mm" in bench_model.torch_path("int4_weight")[1]
    make, what = bench_model.torch_path("mxfp8")
    assert make is None and "bf16 only" in what
    with pytest.raises(ValueError, match="unknown linear recipe"):
        bench_model.torch_path("fp3")


def test_a_failing_variant_is_noted_and_a_lost_gpu_stops_the_run(monkeypatch):
    failed = {}
    assert bench_model.guarded("x", failed, "cpu", lambda: 1 / 0) is None
    assert failed == {"x": "ZeroDivisionError: division by zero"}
    monkeypatch.setattr(bench_model, "cuda_usable", lambda device: False)
    with pytest.raises(bench_model.ContextLost, match="y: ValueError: bad"):
        bench_model.guarded("y", failed, "cuda", lambda: (_ for _ in ()).throw(ValueError("bad\nmore")))
    assert failed["y"] == "ValueError: bad"


def test_the_tiny_check_runs_in_a_child_and_drops_the_variants_that_crash_it(monkeypatch):
    from argparse import Namespace

    args = Namespace(recipe="deepseek", variants=["bf16", "torch", "ours"], device="cuda", compile=True, lm_head=False)
    cmd = bench_model.check_command(args, ["ours"])
    assert cmd[1:3] == ["-m", "benchmarks.bench_model"] and "--tiny" in cmd and "--no-check" in cmd
    assert cmd[cmd.index("--recipe") + 1] == "deepseek" and cmd[cmd.index("--variants") + 1] == "ours"
    assert "--compile" in cmd and "--lm-head" not in cmd
    calls = []

    def child(args, variants):
        calls.append(variants)
        return "exit code 1: device-side assert" if "ours" in variants else None

    monkeypatch.setattr(bench_model, "_check_run", child)
    assert bench_model.precheck(args) == {"ours": "exit code 1: device-side assert"}
    assert calls == [["bf16", "torch", "ours"], ["bf16"], ["torch"], ["ours"]]
    monkeypatch.setattr(bench_model, "_check_run", lambda args, variants: None)
    assert bench_model.precheck(args) == {}


@pytest.mark.parametrize("recipe", ["tensor", "row", "1x128_128x128", "128x128_128x128"])
def test_make_operands_scale_layouts(recipe):
    qa, qw, sa, sb, (_, sa_plain, _, sw_plain) = anchors.make_operands(3, 256, 384, recipe, device="cpu")
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


@pytest.mark.parametrize("lm_head", [False, True])
def test_the_fp8_variants_convert_the_same_layers_of_one_model(lm_head):
    from argparse import Namespace

    config = M.llama_config(1, M.TINY_LLAMA)
    args = Namespace(device="cpu", seed=0, lm_head=lm_head, recipe="row", variants=list(bench_model.VARIANTS))
    failed = {}
    models, converted, notes = bench_model.build_variants(config, args, failed)  # ours: converted, not run, on CPU
    assert list(models) == ["bf16", "torch", "ours"] and notes == [] and failed == {}
    assert len(converted) == 7 + lm_head and ("lm_head" in converted) == lm_head
    bf16, theirs, ours = models.values()
    for name in converted:
        assert type(bf16.get_submodule(name)) is torch.nn.Linear
        assert isinstance(theirs.get_submodule(name), anchors.TorchFp8Linear)
        assert isinstance(ours.get_submodule(name), cnn.Fp8Linear)
    assert theirs.model.embed_tokens.weight is bf16.model.embed_tokens.weight is ours.model.embed_tokens.weight
    assert bench_model.streamed_bytes(ours, 1) == bench_model.streamed_bytes(theirs, 1)  # FP8 + fp32 per channel


def test_arguments(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = bench_model.parse_args(["--device", "cpu"])
    assert args.variants == ["bf16", "torch"] and args.name is None and args.layers == 8 and args.check
    assert args.batches == [1, 16, 64] and args.context == 512 and args.prefill == 4096 and args.recipe == "row"
    assert bench_model.RECIPES == tuple(cnn.LINEAR_RECIPES)
    assert {"row", "deepseek", "tensor", "int8", "int8_weight", "int4_weight"} <= set(bench_model.RECIPES)
    assert bench_linear_stack.RECIPES == ("row", "deepseek", "tensor")  # the FP8 recipes torch runs
    args = bench_model.parse_args(["--device", "cpu", "--variants", "torch,bf16", "--batches", "2,4", "--name", "x",
                                   "--no-check"])
    assert args.variants == ["torch", "bf16"] and args.batches == [2, 4] and args.name == "x" and not args.check
    for bad in (["--device", "cpu", "--variants", "ours"], ["--device", "cpu", "--compile"], [],
                ["--device", "cpu", "--batches", "1,0"], ["--device", "cpu", "--layers", "0"],
                ["--device", "cpu", "--recipe", "mx"], ["--device", "cpu", "--variants", "fp8"],
                ["--device", "cpu", "--prefill", "-1"]):
        with pytest.raises(SystemExit):
            bench_model.parse_args(bad)


@pytest.mark.parametrize("module", [bench_model, bench_linear_stack])
def test_tools_answer_help(module, capsys):
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert module.__doc__.splitlines()[0] in out and "--no-save" in out and "--name" in out


def test_tiny_run_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    argv = ["--device", "cpu", "--tiny", "--layers", "1", "--batches", "1,2", "--context", "8", "--prefill", "16",
            "--rounds", "1", "--reps", "1"]
    rows = bench_model.main(argv)
    assert "no result file" in capsys.readouterr().out and not any(tmp_path.iterdir())
    cells = [dict(zip(bench_model.COLUMNS, row)) for row in rows]
    assert [(c["phase"], c["batch"], c["variant"]) for c in cells] == [
        ("decode", 1, "bf16"), ("decode", 1, "torch"), ("decode", 2, "bf16"), ("decode", 2, "torch"),
        ("prefill", 1, "bf16"), ("prefill", 1, "torch")]
    for c in cells:
        assert c["ms"] > 0 and c["tokens/s"] > 0
        assert (c["logit rel err"] is None) == (c["variant"] == "bf16") and c["x bf16"] > 0
        assert (c["% of weight floor"] is None) == (c["phase"] == "prefill")
        if c["variant"] == "torch":
            assert 1e-3 < c["logit rel err"] < 0.5
    rows2 = bench_model.main(argv + ["--name", "model_tiny"])
    got = json.loads((tmp_path / "model_tiny.json").read_text())
    assert got["columns"] == bench_model.COLUMNS and len(got["rows"]) == len(rows2) == 6
    assert "static KV cache" in got["notes"] and "ours" not in " ".join(map(str, got["rows"]))


def test_a_lost_gpu_ends_the_run_with_what_was_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)

    def lost(*args):
        raise bench_model.ContextLost("prefill, torch: AcceleratorError: device-side assert triggered")

    monkeypatch.setattr(bench_model, "measure_prefill", lost)
    argv = ["--device", "cpu", "--tiny", "--layers", "1", "--batches", "1", "--context", "8", "--prefill", "16",
            "--rounds", "1", "--reps", "1", "--name", "model_tiny"]
    with pytest.raises(SystemExit, match="stopped: the GPU is unusable after prefill, torch"):
        bench_model.main(argv)
    got = json.loads((tmp_path / "model_tiny.json").read_text())
    assert len(got["rows"]) == 2 and "not measured: the rest of the run" in got["notes"]


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
    on_cpu = getattr(bench_model, cls).from_linear(linear)(x)
    try:
        on_gpu = getattr(bench_model, cls).from_linear(linear.cuda())(x.cuda())
    except NotImplementedError as e:  # e.g. a torch build without the CUDA kernel of _weight_int8pack_mm
        pytest.skip(f"torch has no CUDA kernel here: {str(e).splitlines()[0]}")
    assert R.rel_error(on_gpu.cpu(), on_cpu) < 1e-2  # the same quantized weights, torch's CUDA kernels


def test_demo_model_section_is_skipped_without_a_hopper_gpu(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_hopper_available", lambda: False)
    assert cli._demo_model() is True
    assert "Model: skipped (needs a Hopper GPU)" in capsys.readouterr().out


def test_render_orders_the_new_results():
    assert {"model_llama8b", "linear_stack"} <= set(render.ORDER)
    assert {"model_llama8b", "linear_stack"} <= {name for _, name in render.PRODUCERS}


def test_summary_bounds_the_decode_ratio_by_the_weight_floors():
    """bf16's weight floor over ours: what "ours x bf16" could reach if both streamed their weights at the floor."""
    row = dict.fromkeys(bench_model.COLUMNS)

    def cells(phase, batch, variant, ms, pct, x_bf16=None):
        return [{**row, "phase": phase, "batch": batch, "variant": variant, "ms": ms, "% of weight floor": pct,
                 "x bf16": x_bf16}[c] for c in bench_model.COLUMNS]

    rows = [cells("decode", 1, "bf16", 2.0, 50.0), cells("decode", 1, "ours", 1.5, 40.0, 1.333),
            cells("prefill", 1, "bf16", 30.0, None), cells("prefill", 1, "ours", 25.0, None, 1.2)]
    summary = bench_model.summarize(rows)
    assert summary["decode batch 1: x bf16 at the weight floors"] == pytest.approx(1.0 / 0.6, abs=1e-3)
    assert summary["decode batch 1: ours x bf16"] == 1.333 and summary["prefill: ours x bf16"] == 1.2
    assert "prefill: x bf16 at the weight floors" not in summary
