"""Tensor parallelism (``cutedsl_gemm.nn.parallel``) on the CPU: every Hopper recipe's shards hold the slices of the
whole layer's weight and scales and join back byte for byte; state dicts shard like the layers; the refusals name
the recipe, the sizes and the sizes that work; and, in 1, 2 and 4 gloo processes, the styles applied to a converted
tiny Llama, ``src_data_rank``, the hooks' collectives and sharded loading. The forward passes need GPUs: the last
tests (and ``tests/multi_gpu_tp.py`` under torchrun) run them."""

import datetime
import functools
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from cutedsl_gemm.nn import LINEAR_RECIPES, QuantizedLinear, convert
from cutedsl_gemm.nn import parallel as TP

HOPPER = [name for name, r in LINEAR_RECIPES.items() if "sm_90a" in r.archs]
N, K = 512, 512  # the round-trip layer: every recipe splits it 2 and 4 ways either way
BF16 = torch.bfloat16


def _linear(seed: int, n: int = N, k: int = K, bias: bool = True) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias, dtype=BF16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


@functools.lru_cache(maxsize=None)
def _layer(recipe: str, seed: int = 0, n: int = N, k: int = K) -> QuantizedLinear:
    return QuantizedLinear.from_linear(_linear(seed, n, k), recipe)


def _same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                                                     b.contiguous().view(-1).view(torch.uint8))


def _same_state(a: dict, b: dict) -> list:
    """The keys where two states differ (names, shapes, dtypes or bytes)."""
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not _same(a[k], b[k])]


# --- one layer, no communication ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["colwise", "rowwise"])
@pytest.mark.parametrize("recipe", HOPPER)
def test_shards_are_slices_of_the_whole_layer_and_join_back(recipe, kind, world):
    full = _layer(recipe)
    w = full.dequantize()
    shards = [TP.shard_layer(full, kind, rank, world) for rank in range(world)]
    for rank, s in enumerate(shards):
        lo, hi = rank * N // world, (rank + 1) * N // world
        assert s.tp_shard == TP.TPShard(kind, rank, world, K, N)
        # the kernel's weight of the shard is the slice of the whole one's (codes and scales together)
        assert torch.equal(s.dequantize(), w[lo:hi] if kind == "colwise" else w[:, lo:hi])
        assert (s.out_features, s.in_features) == ((hi - lo, K) if kind == "colwise" else (N, hi - lo))
        # every buffer in the layout a layer of the local size holds (shape, dtype, contiguous)
        empty = QuantizedLinear(s.in_features, s.out_features, kind == "colwise", recipe, device="meta", dtype=BF16)
        for name, t in empty._buffers.items():
            mine = s._buffers[name]
            assert (t is None) == (mine is None), name
            assert t is None or (mine.shape, mine.dtype, mine.is_contiguous()) == (t.shape, t.dtype, True), name
        if kind == "colwise":
            assert torch.equal(s.bias, full.bias[lo:hi]) and "reduced_bias" not in s._buffers
        else:  # the bias waits for the all-reduce; the saved state calls it "bias"
            assert s.bias is None and torch.equal(s.reduced_bias, full.bias)
            assert "reduced_bias" not in s.state_dict() and torch.equal(s.state_dict()["bias"], full.bias)
    assert _same_state(TP.unshard_layers(shards).state_dict(), full.state_dict()) == []


def test_a_row_parallel_shard_loads_its_saved_state():
    shard = TP.shard_layer(_layer("row"), "rowwise", 1, 2)
    fresh = TP.shard_layer(_layer("row", seed=1), "rowwise", 1, 2)
    assert _same_state(fresh.state_dict(), shard.state_dict()) != []
    fresh.load_state_dict(shard.state_dict())
    assert _same_state(fresh.state_dict(), shard.state_dict()) == []
    assert fresh.bias is None and torch.equal(fresh.reduced_bias, _layer("row").bias)


@pytest.mark.parametrize("kind", ["colwise", "rowwise"])
def test_a_static_input_scale_is_replicated(kind):
    layer = QuantizedLinear(K, N, True, "tensor", input_scale=True)
    layer.load_state_dict({**_layer("tensor").state_dict(), "input_scale": torch.tensor(0.25)})
    shards = [TP.shard_layer(layer, kind, rank, 2) for rank in range(2)]
    assert all(torch.equal(s.input_scale, torch.tensor(0.25)) and s.weight_scale.shape == () for s in shards)
    assert _same_state(TP.unshard_layers(shards).state_dict(), layer.state_dict()) == []


def test_world_size_one_is_the_plain_layer():
    layer = _layer("row")
    assert TP.shard_layer(layer, "colwise", 0, 1) is layer and TP.shard_layer(layer, "rowwise", 0, 1) is layer
    assert getattr(layer, "tp_shard", None) is None


REFUSALS = [
    # recipe, (N, K), kind, world, what the message must say
    ("deepseek", (384, 256), "colwise", 2, ["'deepseek'", "N=384", "192 each", "a multiple of 128",
                                            "128x128 weight blocks", "sizes that work: 1, 3"]),
    ("deepseek", (256, 384), "rowwise", 2, ["'deepseek'", "K=384", "192 each", "sizes that work: 1, 3"]),
    ("int4_weight", (256, 384), "rowwise", 2, ["'int4_weight'", "K=384", "128-deep K atoms", "sizes that work: 1, 3"]),
    ("int8_weight", (192, 256), "colwise", 2, ["'int8_weight'", "N=192", "96 each", "64-row atoms",
                                               "sizes that work: 1, 3"]),
    ("row", (200, 256), "colwise", 3, ["'row'", "N=200", "66.6667 each", "must be whole", "sizes that work: 1, 5, 25"]),
    ("row", (256, 48), "rowwise", 2, ["'row'", "the local layer cannot run", "K=24", "multiple of 16",
                                      "sizes that work: 1, 3"]),
]


@pytest.mark.parametrize("recipe, shape, kind, world, words", REFUSALS)
def test_a_split_the_recipe_cannot_take_is_refused_with_the_sizes_that_work(recipe, shape, kind, world, words):
    n, k = shape
    layer = QuantizedLinear.from_linear(_linear(0, n, k), recipe)
    with pytest.raises(ValueError) as e:
        TP.shard_layer(layer, kind, 0, world)
    assert [w for w in words if w not in str(e.value)] == [], str(e.value)
    working = [int(s) for s in str(e.value).rsplit(": ", 1)[1].split(", ")]
    assert working == TP.split_sizes(recipe, kind, n, k) and world not in working
    for size in working:  # and each size listed does split it
        assert len({TP.shard_layer(layer, kind, r, size).weight.shape for r in range(size)}) == 1


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_the_sm100_recipes_are_refused(recipe):
    layer = QuantizedLinear(256, 256, True, recipe, device="meta")
    with pytest.raises(ValueError, match=rf"recipe '{recipe}'.*sm_100a.*tensor-parallel sharding takes the Hopper"):
        TP.shard_layer(layer, "colwise", 0, 2)


def test_a_shard_is_not_sharded_again_and_disagreeing_replicas_are_refused():
    shard = TP.shard_layer(_layer("row"), "rowwise", 0, 2)
    with pytest.raises(ValueError, match="already sharded"):
        TP.shard_layer(shard, "rowwise", 0, 2)
    with pytest.raises(ValueError, match="kind must be 'colwise' or 'rowwise'"):
        TP.shard_layer(_layer("row"), "columns", 0, 2)
    other = TP.shard_layer(_layer("row"), "rowwise", 1, 2)
    other.weight_scale = other.weight_scale * 2  # a replicated per-channel scale that no longer agrees
    with pytest.raises(ValueError, match="weight_scale: the shards hold different copies"):
        TP.unshard_layers([shard, other])
    with pytest.raises(ValueError, match="in rank order"):
        TP.unshard_layers([other, shard])


# --- a converted tiny Llama, no communication -----------------------------------------------------------------------

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512)


def _tiny_llama(recipe: str, seed: int = 0, lm_head: bool = True):
    """(a tiny Llama converted with ``recipe``, its state dict); ``lm_head=False`` leaves the head in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).to(BF16).eval()
    report = convert(model, recipe, filter=None if lm_head else (lambda name, m: name != "lm_head"))
    assert len(report.converted) == 14 + lm_head and set(report.skipped) == (set() if lm_head else {"lm_head"})
    return model, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("recipe, world", [("row", 2), ("row", 4), ("int4_weight_g32_zp", 2), ("int8", 4)])
def test_a_sharded_state_dict_is_the_state_of_the_sharded_layers(recipe, world):
    model, full = _tiny_llama(recipe)
    plan = TP.tp_plan_for(model)
    shards = [TP.shard_state_dict(full, plan, rank, world) for rank in range(world)]
    for rank, state in enumerate(shards):
        expected = dict(full)
        for name, m in model.named_modules():
            if name.endswith("_proj"):  # every linear of the decoder layers; the head stays whole
                kind = "rowwise" if name.endswith(("o_proj", "down_proj")) else "colwise"
                expected.update({f"{name}.{k}": v for k, v in
                                 TP.shard_layer(m, kind, rank, world).state_dict().items()})
        assert _same_state(state, expected) == []
    down, head = "model.layers.1.mlp.down_proj.weight", "lm_head.weight"
    assert shards[0][down].numel() * world == full[down].numel() and _same(shards[0][head], full[head])
    assert _same_state(TP.unshard_state_dict(shards, plan), full) == []
    assert _same_state(TP.shard_state_dict(full, plan, 0, 1), full) == []


def test_sharding_a_state_dict_names_the_layer_that_cannot_be_split():
    _, full = _tiny_llama("deepseek")
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.k_proj: recipe 'deepseek': colwise .* N=128"):
        TP.shard_state_dict(full, {"model.layers.*.self_attn.k_proj": "colwise"}, 0, 2)


def test_tp_plan_for_a_transformers_model_and_for_the_stock_styles():
    model, _ = _tiny_llama("row")
    plan = TP.tp_plan_for(model)
    assert sorted(plan) == sorted(f"model.{p}" for p in model.config.base_model_tp_plan)
    assert type(plan["model.layers.*.self_attn.q_proj"]) is TP.QuantizedColwiseParallel
    assert type(plan["model.layers.*.mlp.down_proj"]) is TP.QuantizedRowwiseParallel
    stock = {"a": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False),
             "b": RowwiseParallel(output_layouts=Shard(1)), "c": "colwise_rep"}
    ours = TP.tp_plan_for(model, stock)
    assert type(ours["a"]) is TP.QuantizedColwiseParallel and type(ours["b"]) is TP.QuantizedRowwiseParallel
    assert (ours["a"].input_layouts, ours["a"].output_layouts, ours["a"].use_local_output) == (
        (Shard(1),), (Replicate(),), False)
    assert ours["b"].output_layouts == (Shard(1),) and ours["c"].output_layouts == (Replicate(),)
    with pytest.raises(ValueError, match="'packed_colwise' is not taken"):
        TP.tp_plan_for(model, {"x": "packed_colwise"})
    with pytest.raises(ValueError, match="has no config.base_model_tp_plan"):
        TP.tp_plan_for(torch.nn.Sequential(_layer("row")))


# --- several processes (gloo) ---------------------------------------------------------------------------------------

CHECKS = {}


def _check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _container(**layers) -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict(layers)


def _plan(model, world: int) -> dict:
    """The config's plan; 4 ways, without k_proj and v_proj (2 key-value heads: replicated)."""
    plan = TP.tp_plan_for(model)
    return {p: s for p, s in plan.items() if world < 4 or not p.endswith(("k_proj", "v_proj"))}


@_check
def plan_shards_a_converted_tiny_llama(mesh, tmp):
    rank, world = mesh.get_local_rank(), mesh.size()
    for recipe in {1: ["deepseek"], 2: ["row", "int4_weight"], 4: ["tensor"]}[world]:
        model, full = _tiny_llama(recipe)
        before = {name: dict(m._buffers) for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        plan = _plan(model, world)
        assert TP.parallelize(model, mesh, plan) is model
        q = model.model.layers[1].self_attn.q_proj
        if world == 1:  # the plain layer: the same tensors, no hooks, no shard record
            assert all(all(m._buffers[k] is v for k, v in before[name].items()) for name, m in model.named_modules()
                       if isinstance(m, QuantizedLinear))
            assert not q._forward_hooks and not q._forward_pre_hooks and getattr(q, "tp_shard", None) is None
        else:
            assert (q.out_features, q.in_features, q.tp_shard.kind) == (256 // world, 256, "colwise")
            assert len(q._forward_hooks) == len(q._forward_pre_hooks) == 1
            assert model.model.layers[0].mlp.down_proj.in_features == 512 // world
            assert getattr(model.lm_head, "tp_shard", None) is None  # not in the config's plan: whole
        assert _same_state(model.state_dict(), TP.shard_state_dict(full, plan, rank, world)) == [], recipe
        assert _same_state(TP.full_state_dict(model), full) == [], recipe


@_check
def the_layers_that_cannot_be_split_are_named(mesh, tmp):
    world = mesh.size()
    model, _ = _tiny_llama("deepseek")
    if world == 1:
        assert TP.parallelize(model, mesh) is model
        return
    with pytest.raises(ValueError) as e:
        TP.parallelize(model, mesh)
    message = str(e.value)
    names = [line.split(":")[0] for line in message.splitlines()[1:]]
    # 128-row blocks: k_proj and v_proj (N=128) split 1 way, q_proj (N=256) and o_proj (K=256) 2 ways
    shown = {2: ("k_proj", "v_proj"), 4: ("q_proj", "k_proj", "v_proj", "o_proj")}[world]
    assert sorted({n.rsplit(".", 1)[1] for n in names}) == sorted(shown) and len(names) == 2 * len(shown), message
    assert "model.layers.0.self_attn.k_proj: recipe 'deepseek'" in message and "a multiple of 128" in message
    assert getattr(model.model.layers[0].self_attn.q_proj, "tp_shard", None) is None  # nothing was changed
    if world == 4:  # "row" splits any whole number of rows; 2 key-value heads of 64 do not split 4 ways
        model, _ = _tiny_llama("row")
        with pytest.raises(ValueError) as e:
            TP.parallelize(model, mesh)
        lines = str(e.value).splitlines()
        assert lines[0] == "4 of the plan's layers cannot be split 4 ways:" and all(
            n.split(":")[0].endswith(("k_proj", "v_proj")) for n in lines[1:]), str(e.value)
        assert ("4 shards of its N=128 output features hold 32 each, not whole heads of 64 (its attention's "
                "head_dim); tensor-parallel sizes that split its 2 heads: 1, 2") in lines[1]
    # the stock styles refuse the layer outright: why the plan takes the quantized styles
    with pytest.raises(NotImplementedError, match="only support nn.Linear and nn.Embedding"):
        parallelize_module(model, mesh, {"model.layers.*.self_attn.q_proj": ColwiseParallel()})


@_check
def src_data_rank_sends_rank_0s_weights(mesh, tmp):
    rank, world = mesh.get_local_rank(), mesh.size()
    for src, seed in ((0, 0), (None, rank)):
        own = QuantizedLinear.from_linear(_linear(rank, 512, 256), "deepseek")
        box = _container(lin=own)
        parallelize_module(box, mesh, {"lin": TP.QuantizedColwiseParallel()}, src_data_rank=src)
        expected = TP.shard_layer(_layer("deepseek", seed, 512, 256), "colwise", rank, world)
        assert _same_state(box.lin.state_dict(), expected.state_dict()) == [], src
        if world > 1 and rank > 0:  # the two expectations differ, so the check tells them apart
            other = TP.shard_layer(_layer("deepseek", 0 if src is None else rank, 512, 256), "colwise", rank, world)
            assert _same_state(box.lin.state_dict(), other.state_dict()) != []


@_check
def row_parallel_outputs_are_all_reduced_then_biased_once(mesh, tmp):
    rank, world = mesh.get_local_rank(), mesh.size()
    full = _layer("row", 0, 64, 256)
    total = world * (world + 1) // 2
    for style in (TP.QuantizedRowwiseParallel(), TP.QuantizedRowwiseParallel(use_local_output=False),
                  TP.QuantizedRowwiseParallel(output_layouts=Shard(0))):
        box = _container(lin=QuantizedLinear.from_linear(_linear(0, 64, 256), "row"))
        parallelize_module(box, mesh, {"lin": style})
        if world == 1:
            assert box.lin.bias is not None and "reduced_bias" not in box.lin._buffers and not box.lin._forward_hooks
            continue
        partial = torch.full((4, 64), float(rank + 1), dtype=BF16)  # what each rank's GEMM would return
        out = style._prepare_local_output(mesh, box.lin, (None,), partial)
        expected = (torch.full((4, 64), float(total)) + full.bias).to(BF16)  # one rounding after the fp32 add
        if style.output_layouts == (Shard(0),):
            expected = expected[rank * 4 // world:(rank + 1) * 4 // world]
        if style.use_local_output:
            assert type(out) is torch.Tensor and torch.equal(out, expected)
        else:
            assert isinstance(out, DTensor) and out.placements == (Replicate(),)
            assert torch.equal(out.to_local(), expected)


@_check
def the_hooks_redistribute_the_plans_layouts(mesh, tmp):
    rank, world = mesh.get_local_rank(), mesh.size()
    x = torch.arange(4 * 256, dtype=BF16).view(4, 256)
    col, row = TP.QuantizedColwiseParallel(), TP.QuantizedRowwiseParallel(input_layouts=Replicate())
    gathered = TP.QuantizedColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())
    box = _container(**{k: QuantizedLinear.from_linear(_linear(i, 256, 256), "row") for i, k in enumerate("abc")})
    parallelize_module(box, mesh, {"a": col, "b": row, "c": gathered})
    if world == 1:
        assert all(not m._forward_pre_hooks for m in box.values())
        return
    part = slice(rank * 256 // world, (rank + 1) * 256 // world)
    assert col._prepare_local_input(mesh, box.a, (x,)) is None  # replicated in, as the layer takes it
    assert col._prepare_local_output(mesh, box.a, (x,), x[:, part]) is None  # its slice out
    assert torch.equal(row._prepare_local_input(mesh, box.b, (x,))[0], x[:, part])  # replicated -> this slice
    assert torch.equal(gathered._prepare_local_input(mesh, box.c, (x[:, part],))[0], x)  # all-gathered
    assert torch.equal(gathered._prepare_local_output(mesh, box.c, (x,), x[:, part]), x)
    given = DTensor.from_local(x[:, part], mesh, (Shard(1),), run_check=False)  # a DTensor from the layer before
    assert torch.equal(col._prepare_local_input(mesh, box.a, (given,))[0], x)


@_check
def each_rank_loads_its_slices_of_a_checkpoint(mesh, tmp):
    from safetensors.torch import save_file

    rank, world = mesh.get_local_rank(), mesh.size()
    model, full = _tiny_llama("int8", lm_head=False)
    path = Path(tmp) / "llama"
    if rank == 0:
        path.mkdir()
        save_file(full, str(path / "model.safetensors"))
    dist.barrier()
    plan = {**_plan(model, world), "lm_head": ColwiseParallel(output_layouts=Replicate())}  # bf16: stock style
    other, _ = _tiny_llama("int8", seed=1, lm_head=False)
    TP.parallelize(other, mesh, plan, src_data_rank=None)
    expected = TP.shard_state_dict(full, plan, rank, world)
    whole = expected.pop("lm_head.weight")  # the bf16 head: a DTensor, compared on its own
    assert _same_state({k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}, expected) != []
    TP.load_sharded(other, path)
    state = other.state_dict()
    head = state.pop("lm_head.weight")
    if world > 1:
        assert isinstance(head, DTensor) and torch.equal(head.to_local(), whole.chunk(world)[rank])
    assert _same_state(state, expected) == []
    assert _same_state(TP.full_state_dict(other), full) == []
    # layers built empty on the meta device, filled from a single file
    layers = {"a": _layer("deepseek", 0, 512, 256), "b": QuantizedLinear.from_linear(_linear(1, 256, 512),
                                                                                     "int4_weight_zp")}
    file = Path(tmp) / "layers.safetensors"
    if rank == 0:
        save_file(_container(**layers).state_dict(), str(file))
    dist.barrier()
    empty = _container(a=QuantizedLinear(256, 512, True, "deepseek", device="meta"),
                       b=QuantizedLinear(512, 256, True, "int4_weight_zp", device="meta"))
    parallelize_module(empty, mesh, {"a": TP.QuantizedColwiseParallel(), "b": TP.QuantizedRowwiseParallel()})
    with pytest.raises(ValueError, match="meta device: pass device="):
        TP.load_sharded(empty, file)
    TP.load_sharded(empty, file, device="cpu")
    for name, kind in (("a", "colwise"), ("b", "rowwise")):
        expected = TP.shard_layer(layers[name], kind, rank, world).state_dict()
        assert _same_state(empty[name].state_dict(), expected) == [], name
    with pytest.raises(ValueError, match=r"the model has no place for a\."):
        TP.load_sharded(_container(b=empty.b), file)


def _reference_forward(self, x):
    """x @ W.T + bias in fp32 from the layer's dequantized weight: a CPU stand-in for the kernels, so that the
    hooks run end to end in a model (the activations stay unquantized)."""
    y = x.float() @ self.dequantize().T
    return (y if self.bias is None else y + self.bias).to(x.dtype)


@_check
def a_sharded_model_runs_through_the_hooks(mesh, tmp):
    world = mesh.size()
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    kept = QuantizedLinear.forward
    QuantizedLinear.forward = _reference_forward
    try:
        for recipe in {1: ["row"], 2: ["int4_weight_zp", "row"], 4: ["int8"]}[world]:  # int4: 1 or 2 ways
            model, _ = _tiny_llama(recipe)
            # 4 ways: the MLPs, and o_proj from its whole input (the 2 key-value heads do not split 4 ways)
            mlp = {p: s for p, s in TP.tp_plan_for(model).items() if ".mlp." in p}
            plan = {**mlp, "model.layers.*.self_attn.o_proj": RowwiseParallel(input_layouts=Replicate())}
            with torch.no_grad():
                whole = model(ids).logits.float()
                TP.parallelize(model, mesh, plan if world == 4 else None)
                sharded = model(ids).logits.float()
            err = ((sharded - whole).norm() / whole.norm()).item()
            assert err < 2e-2 and (world == 1) == (err == 0), (recipe, err)
    finally:
        QuantizedLinear.forward = kept


def _worker(rank: int, world: int, tmp: str):
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(mesh, tmp)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


_RUNS: dict = {}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("check", list(CHECKS))
def test_in_processes(check, world, tmp_path_factory):
    """Every check runs once per world size in ``world`` gloo processes (one spawn for all of them)."""
    if world not in _RUNS:
        tmp = tmp_path_factory.mktemp(f"tp{world}")
        mp.spawn(_worker, args=(world, str(tmp)), nprocs=world, join=True)
        _RUNS[world] = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
    failed = [f"rank {r}:\n{run.get(check, 'not run')}" for r, run in enumerate(_RUNS[world]) if
              run.get(check, "not run") is not None]
    assert not failed, "\n".join(failed)


# --- GPUs -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_tp1_on_a_gpu_is_the_plain_layer_bit_for_bit(tmp_path):
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        for recipe in HOPPER:
            layer = QuantizedLinear.from_linear(_linear(0).cuda(), recipe)
            x = torch.randn(16, K, device="cuda", dtype=BF16)
            before = layer(x)
            box = _container(lin=layer)
            TP.parallelize(box, mesh, {"lin": "colwise"})
            assert box.lin is layer and not layer._forward_hooks
            assert torch.equal(box.lin(x), before), recipe
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_under_torchrun():
    script = Path(__file__).with_name("multi_gpu_tp.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    assert "all tensor-parallel checks passed" in done.stdout
