"""Mixture of experts end to end: one MoE block, and a whole Qwen3-30B-A3B-shaped model, in bf16 (transformers' own
experts) against the same weights converted by ``cutedsl_gemm.nn.convert`` (``QuantizedExperts`` on the grouped FP8
GEMM), all from random weights (nothing downloaded), timed in turns in one process.

    python -m benchmarks.bench_moe                      (both parts: results/moe_block.json, moe_model_qwen3_30b.json)
    python -m benchmarks.bench_moe --what block --block-config qwen3,mixtral,dsv3
    python -m benchmarks.bench_moe --what model --layers 8 --batches 1,16 --prefill 1024  (-> moe_model_qwen3_30b_8l)
    python -m benchmarks.bench_moe --device cpu --tiny  (the steps on small configs on the CPU: a check, no file)

Block (``--what block``, ``results/moe_block.json``): transformers' MoE block, router to combine, for each
``--block-config``: ``qwen3`` (Qwen3MoeSparseMoeBlock, Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, expert width
768), ``mixtral`` (MixtralSparseMoeBlock, Mixtral-8x7B: 4096, 8 experts, top-2, 14336) and ``dsv3`` (DeepseekV3MoE,
DeepSeek-V3: 7168, 256 experts in 8 groups of which a token's 4 best are searched, top-8, 2048, and one shared
expert). Every parameter is drawn from N(0, initializer_range), the router's included (so that tokens spread over
the experts), the input from N(0, 1) in bf16 (what a norm hands the block). Variants: bf16 with each experts
implementation of ``--bf16-experts`` (``config._experts_implementation``: "grouped_mm", torch's grouped GEMM and
transformers' default for a model; "eager", a loop over the experts hit), the first being the anchor of
"x bf16" and "rel err"; and per recipe of ``--recipes`` a copy sharing the bf16 block's tensors converted by
``cnn.convert`` (the experts a QuantizedExperts, DeepSeek's shared expert's linears QuantizedLinear layers, the
router kept). Phases: decode, ``--batches`` tokens, the call captured in a CUDA graph and replayed (mode "graph"),
except under the "eager" implementation, whose forward reads the experts hit on the host (``nonzero`` and a Python
loop over them), which no graph holds: it runs eagerly (mode "eager"); and ``--prefill`` tokens at once, eager.
Each call is timed by ``common.bench`` (the L2 emptied before each run: in a model the other layers evict a
block's experts between its calls), the variants in turns over ``--rounds`` rounds, median of the rounds. Each row:
us per call, tokens/s, x bf16 (the anchor's time over the row's), rel err (relative Frobenius error of the output
against the anchor's, same input), experts hit (distinct experts the call's routing picked, counted on the call),
and for decode the % of weight floor: the block's parameters and buffers (of the experts only those hit) read once
at the HBM rate ``benchmarks.measure_floor`` measured on this GPU.

Model (``--what model``, ``results/moe_model_qwen3_30b.json``; ``_<layers>l`` added with ``--layers``):
Qwen3MoeForCausalLM with Qwen3-30B-A3B's dimensions (48 layers, 32 heads / 4 KV heads of 128, vocabulary 151936)
and transformers' random initialisation, bf16 (about 61 GB), and a copy sharing its tensors converted with
``--model-recipe`` (LM head kept bf16; only the quantized tensors are new, about 31 GB): attention's linears become
QuantizedLinear layers, every layer's experts a QuantizedExperts; routers, norms and embeddings stay bf16. The
steps are ``benchmarks.bench_model``'s: decode, ``batch`` sequences with ``--context`` tokens in a static KV cache
take one token, the step captured in a CUDA graph, checked (``DecodeStep.check_replay``) and replayed, the two models
in turns (``common.time_interleaved``, ``--rounds`` x ``--reps``); prefill, one sequence of ``--prefill`` tokens,
eager, no cache. Each row: ms, tokens/s, x bf16, the relative Frobenius error of the last position's logits against
bf16 (same inputs), experts hit per layer (mean over the layers of the distinct experts the step routed to) and for
decode the % of weight floor: every parameter and buffer read once, but of the input embedding only the step's
rows and of each layer's experts only those hit, at the measured HBM rate.

Each part writes its result file after every phase, so that a run stopped early keeps what it measured; a variant
that raises is reported in the notes and the others go on; a GPU left unusable (a device-side assert) ends the run
with what was measured. Without a GPU the run stops with one line. ``--device cpu`` runs the steps eagerly with
wall-clock times and no floors (``--tiny``: small configs of the same architectures, 2 model layers unless
``--layers``), without a result file unless ``--name``; QuantizedExperts runs on CUDA only, so there the converted
variants are reported as not measured.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn import moe
from cutedsl_gemm.nn.moe import EXPERT_RECIPES, is_experts
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.tools import models as M
from cutedsl_gemm.tools.cli import positive_int

from . import bench_model as BM
from . import common
from . import model_split as S

WHATS = ("block", "model")
#: transformers' experts implementations the bf16 block runs: torch's grouped GEMM, and the loop over the experts hit
#: ("batched_mm" gathers one weight matrix per (token, expert) pair: 200 GB at 4096 tokens of Qwen3-30B-A3B)
BF16_EXPERTS = ("grouped_mm", "eager")
#: the implementations whose forward reads the routing on the host, which a CUDA graph cannot hold
HOST_SYNCED = ("eager",)
OURS = "QuantizedExperts"
SORT_ROUTED = OURS + ", sort routing"  # (--sort-routing) ours with the pairs routed by the sort at every size
BLOCK_NAME = "moe_block"
MODEL_NAME = "moe_model_qwen3_30b"
BLOCK_COLUMNS = ["block", "phase", "tokens", "recipe", "experts implementation", "mode", "us", "tokens/s", "x bf16",
                 "rel err", "experts hit", "% of weight floor"]
#: (``--split``) the decode step with every experts module a no-op: experts ms = step - that step, experts floor ms =
#: the experts' weights hit / HBM rate, rest ms = the no-op step, bound x bf16 = bf16 ms / (rest ms + experts floor)
SPLIT_COLUMNS = ["experts ms", "experts floor ms", "experts % of floor", "rest ms", "bound x bf16"]
MODEL_COLUMNS = ["phase", "batch", "tokens", "recipe", "experts implementation", "mode", "ms", "tokens/s", "x bf16",
                 "logit rel err", "experts hit per layer", "% of weight floor", *SPLIT_COLUMNS]
NOOP_EXPERTS = "no-op experts"  # ours with every experts module a no-op
NOOP_BF16 = "no-op experts (bf16 model)"  # the bf16 model's no-op step: its rest, beside ours

#: DeepSeek-V3's MoE block (its config.json): 256 routed experts in 8 groups, a token's experts searched in its 4
#: best groups, one shared expert of the same width
DSV3_MOE = dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True)
TINY_DSV3_MOE = dict(DSV3_MOE, hidden_size=256, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4,
                     n_group=4, topk_group=2)


@dataclass(frozen=True)
class BlockSpec:
    """A MoE block of transformers: its model's name, config class, modeling module and block class, its
    dimensions and those of ``--tiny``."""

    title: str
    config: str
    module: str
    block: str
    dims: dict
    tiny: dict


BLOCKS = {
    "qwen3": BlockSpec("Qwen3-30B-A3B", "Qwen3MoeConfig", "transformers.models.qwen3_moe.modeling_qwen3_moe",
                       "Qwen3MoeSparseMoeBlock", M.QWEN3_30B_A3B, M.TINY_QWEN3_MOE),
    "mixtral": BlockSpec("Mixtral-8x7B", "MixtralConfig", "transformers.models.mixtral.modeling_mixtral",
                         "MixtralSparseMoeBlock", M.MIXTRAL_8X7B, M.TINY_MIXTRAL),
    "dsv3": BlockSpec("DeepSeek-V3", "DeepseekV3Config", "transformers.models.deepseek_v3.modeling_deepseek_v3",
                      "DeepseekV3MoE", DSV3_MOE, TINY_DSV3_MOE),
}


class BlockDims(NamedTuple):
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    shared: int  # shared experts of the expert width (DeepSeek)


def block_config(name: str, tiny: bool = False):
    """The transformers config of block ``name`` (one layer: the block reads no layer count)."""
    import transformers

    spec = BLOCKS[name]
    return getattr(transformers, spec.config)(num_hidden_layers=1, **(spec.tiny if tiny else spec.dims))


def block_dims(config) -> BlockDims:
    """The MoE dimensions of a Qwen3-MoE, Mixtral or DeepSeek-V3 config."""
    intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return BlockDims(config.num_local_experts, config.num_experts_per_tok, config.hidden_size, intermediate,
                     getattr(config, "n_shared_experts", None) or 0)


def build_block(name: str, device, tiny: bool = False, seed: int = 0):
    """(block, config): block ``name`` built on ``device`` in bf16 (what its class keeps in fp32, DeepSeek's router,
    stays fp32), every parameter drawn from N(0, initializer_range), in eval mode."""
    config = block_config(name, tiny)
    cls = getattr(importlib.import_module(BLOCKS[name].module), BLOCKS[name].block)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            block = cls(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in block.parameters():  # the classes leave them empty or zero (a zero router ties every expert)
            p.normal_(0.0, config.initializer_range)
    return block.eval().requires_grad_(False), config


def set_experts_implementation(module: torch.nn.Module, name: str) -> None:
    """Make every transformers experts module under ``module`` run implementation ``name``: the class decorator reads
    its config's ``_experts_implementation`` on each call, so the configs must be ``module``'s own (a sharing copy
    has its own)."""
    configs = {id(m.config): m.config for m in module.modules() if is_experts(m) and hasattr(m, "config")}
    if not configs:
        raise ValueError(f"{type(module).__name__} holds no transformers experts module with a config")
    for config in configs.values():
        config._experts_implementation = name


# ---- what a call routes to, and the bytes it reads ----------------------------------------------------------------
def experts_modules(root: torch.nn.Module) -> dict:
    """{name: module} of the experts modules under ``root``: transformers' and QuantizedExperts."""
    return {name: m for name, m in root.named_modules() if is_experts(m) or isinstance(m, cnn.QuantizedExperts)}


def experts_hit(root: torch.nn.Module, run) -> dict:
    """{experts module name: distinct experts routed to} in one eager ``run()`` (a forward of ``root``), read from
    the expert ids each experts module is called with (it synchronises: never inside a graph capture)."""
    hit, handles = {}, []
    for name, module in experts_modules(root).items():
        def count(mod, args, kwargs, name=name):
            ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
            hit[name] = int(torch.unique(ids).numel())

        handles.append(module.register_forward_pre_hook(count, with_kwargs=True))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return hit


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module``, each once."""
    seen = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def touched_bytes(root: torch.nn.Module, hit: dict, every_expert: int) -> int:
    """``every_expert`` (the bytes a call reads if it reads every expert) less the experts not hit: each experts
    module named in ``hit`` counts its share ``hit / E`` of its weights and scales."""
    total = every_expert
    for name, n in hit.items():
        module = root.get_submodule(name)
        nbytes = S.linear_bytes(root, [name])
        total -= nbytes - nbytes * n // module.gate_up_proj.shape[0]
    return total


def pct_of_floor(nbytes: int, ms: float, hbm_tbps) -> float | None:
    floor = S.floor_ms(nbytes, hbm_tbps)
    return None if floor is None else round(100 * floor / ms, 1)


def ratio(anchor_ms, ms) -> float | None:
    return None if not anchor_ms else round(anchor_ms / ms, 3)


def error_cell(err) -> float | None:
    return None if err is None else float(f"{err:.3g}")


# ---- the block ----------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class BlockVariant:
    """A block the run times: its recipe ("bf16" or one of ``EXPERT_RECIPES``) and experts implementation."""

    recipe: str
    experts: str
    module: torch.nn.Module

    @property
    def key(self) -> tuple:
        return self.recipe, self.experts

    @property
    def label(self) -> str:
        if self.recipe == "bf16":
            return f"bf16 ({self.experts})"
        return f"ours {self.recipe}" + (" (sort routing)" if self.experts == SORT_ROUTED else "")


class SortRouted(torch.nn.Module):
    """A converted block whose experts route their pairs by the sort, the gather and the quantizer
    (``nn.moe.routes_by_kernel`` false while it runs, a CUDA graph's capture included): what the routing kernels
    replace."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        saved, moe.routes_by_kernel = moe.routes_by_kernel, lambda *args: False
        try:
            return self.block(*args, **kwargs)
        finally:
            moe.routes_by_kernel = saved


def block_variants(run, name: str, block) -> list:
    """bf16 with each of ``--bf16-experts`` (the first the block itself, the others sharing copies), then per recipe
    a sharing copy converted by ``cnn.convert``; a conversion that raises or keeps the experts in bf16 goes to
    ``run.failed``."""
    args, variants = run.args, []
    for i, impl in enumerate(args.bf16_experts):
        module = block if i == 0 else M.sharing_copy(block)
        set_experts_implementation(module, impl)
        variants.append(BlockVariant("bf16", impl, module))
    for recipe in args.recipes:
        try:
            module = M.sharing_copy(block)
            report = cnn.convert(module, recipe)
            if not report.converted_experts:  # an "ours" row must not time bf16 experts
                raise RuntimeError("the experts were not converted: " + "; ".join(
                    f"{n}: {why}" for n, why in report.skipped.items()))
            run.notes += [f"{name} {recipe}: not converted: {n} ({why})" for n, why in report.skipped.items()]
            variants.append(BlockVariant(recipe, OURS, module))
            if args.sort_routing:
                variants.append(BlockVariant(recipe, SORT_ROUTED, SortRouted(module)))
        except Exception as e:
            run.failed[f"{name}: conversion, {recipe}"] = BM.one_line(e)
    return variants


def block_input(config, tokens: int, seed: int, device) -> torch.Tensor:
    """(1, tokens, hidden) bf16 from N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, config.hidden_size, generator=gen).to(device, torch.bfloat16)


def _output(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result  # some blocks also return the router logits


def block_runner(module, x: torch.Tensor, graph: bool) -> tuple:
    """(run, output): ``run()`` computes the block's output for ``x`` into ``output``, as a CUDA graph's replay
    (``graph``, checked against the eager call) or as the eager call itself."""
    def call():
        return _output(module(x))

    want = call()
    if not graph:
        return call, want
    captured, output = M.cuda_graph(call)
    captured.replay()
    diff = R.rel_error(output, want)
    if diff > M.REPLAY_RTOL:
        raise RuntimeError(f"the CUDA graph's replay differs from the eager call by {diff:.3g} (relative)")
    return captured.replay, output


def time_calls(fns: dict, args) -> dict:
    """{key: median ms} of each function: on a GPU ``common.bench`` of each in turns over ``--rounds`` rounds (the
    median of the rounds), on the CPU the wall clock (``common.time_interleaved``)."""
    if args.device == "cpu":
        return common.time_interleaved(fns, args.rounds, 1, cuda=False)
    times = {key: [] for key in fns}
    for _ in range(args.rounds):
        for key, fn in fns.items():
            times[key].append(common.bench(fn))
    return {key: statistics.median(t) for key, t in times.items()}


def block_phase(run, name: str, config, variants: list, phase: str, tokens: int) -> list:
    """The rows of one phase ("decode" / "prefill") of block ``name`` at ``tokens`` tokens."""
    args = run.args
    x = block_input(config, tokens, args.seed + tokens, args.device)
    prepared, modes, hits = {}, {}, {}
    for var in variants:
        graph = phase == "decode" and args.device == "cuda" and var.experts not in HOST_SYNCED
        what = f"{name} {phase} {tokens} tokens, {var.label}"
        hit = BM.guarded(what, run.failed, args.device, experts_hit, var.module, lambda m=var.module: m(x))
        got = None if hit is None else BM.guarded(what, run.failed, args.device, block_runner, var.module, x, graph)
        if got is not None:
            prepared[var.key], modes[var.key], hits[var.key] = got, "graph" if graph else "eager", hit
    times = BM.guarded(f"{name} {phase} {tokens} tokens", run.failed, args.device, time_calls,
                       {key: p[0] for key, p in prepared.items()}, args) or {}
    anchor = variants[0].key if variants and variants[0].recipe == "bf16" else None
    t_ref = times.get(anchor)
    ref = prepared[anchor][1] if t_ref is not None else None
    by_key, rows = {v.key: v for v in variants}, []
    for key, ms in times.items():
        var = by_key[key]
        err = R.rel_error(prepared[key][1], ref) if ref is not None and key != anchor else None
        nbytes = touched_bytes(var.module, hits[key], module_bytes(var.module))
        rows.append([name, phase, tokens, var.recipe, var.experts, modes[key], round(ms * 1e3, 2),
                     round(tokens / ms * 1e3, 1), ratio(t_ref, ms), error_cell(err), sum(hits[key].values()),
                     pct_of_floor(nbytes, ms, run.hbm_tbps) if phase == "decode" else None])
    return rows


def run_blocks(run) -> None:
    """Every block of ``--block-config``, one after the other (each freed before the next); the rows go to
    ``run.rows`` and the result file after each phase."""
    args = run.args
    phases = [("decode", b) for b in args.batches] + [("prefill", args.prefill)] * bool(args.prefill)
    for name in args.block_config:
        run.say(f"{name}: building the {BLOCKS[name].title} block{' (tiny)' if args.tiny else ''}")
        block, config = build_block(name, args.device, args.tiny, args.seed)
        d = block_dims(config)
        variants = block_variants(run, name, block)
        run.say(f"{name}: hidden {d.hidden}, {d.experts} experts, top-{d.top_k}, width {d.intermediate}; variants "
                f"{', '.join(v.label for v in variants)}")
        for phase, tokens in phases:
            rows = block_phase(run, name, config, variants, phase, tokens)
            for row in rows:
                cell = dict(zip(BLOCK_COLUMNS, row))
                label = BlockVariant(cell["recipe"], cell["experts implementation"], block).label
                x_bf16 = "" if cell["x bf16"] is None else f", x bf16 {cell['x bf16']}"
                run.say(f"{name} {phase} {tokens} tokens, {label} ({cell['mode']}): {cell['us']} us{x_bf16}")
            run.rows.extend(rows)
            save_blocks(run)
            BM.free_memory(args.device)
        del block, variants
        BM.free_memory(args.device)


def block_summary(rows) -> dict:
    """ours x bf16 per block and recipe at each decode batch and at the prefill, and the error at the prefill."""
    out = {}
    for c in (dict(zip(BLOCK_COLUMNS, row)) for row in rows):
        if c["recipe"] == "bf16":
            continue
        where = f"{c['block']} {c['recipe']}: {c['phase']} {c['tokens']} tokens"
        out[f"{where}: ours x bf16"] = c["x bf16"]
        if c["phase"] == "prefill":
            out[f"{where}: rel err"] = c["rel err"]
    return out


def _floor_text(run) -> str:
    return f"{run.hbm_tbps:g} TB/s (measured)" if run.hbm_tbps else "no HBM rate (floors not measured here)"


def _failures_and_notes(run) -> str:
    """The notes' tail: the variants not measured, with why, then the run's notes once each."""
    return "".join(f"; not measured: {what} ({why})" for what, why in run.failed.items()) + "".join(
        f"; {note}" for note in dict.fromkeys(run.notes))


def block_notes(run) -> str:
    args = run.args
    floor = _floor_text(run)
    timing = ("wall clock (CPU)" if args.device == "cpu" else "common.bench (L2 emptied by a 256 MiB read before each "
              "run), the variants in turns")
    line = (f"blocks {', '.join(args.block_config)}{' (tiny configs)' if args.tiny else ''}, random weights "
            f"(N(0, initializer_range)), input N(0, 1) bf16; bf16 experts {', '.join(args.bf16_experts)} (anchor "
            f"{args.bf16_experts[0]}), ours: cnn.convert recipes {', '.join(args.recipes)}; decode: a CUDA graph "
            f"(the eager implementation reads the routing on the host: eager); prefill eager; {timing}, median of "
            f"{args.rounds} rounds; rel err: the output against the anchor's; weight floor: the block's parameters "
            f"and buffers, of the experts only those hit, at {floor}")
    return line + _failures_and_notes(run)


def save_blocks(run) -> None:
    args = run.args
    if args.save and run.name:
        common.write_result(run.name, f"MoE blocks ({', '.join(BLOCKS[b].title for b in args.block_config)}): bf16 "
                            f"vs QuantizedExperts ({', '.join(args.recipes)})", BLOCK_COLUMNS, run.rows,
                            summary=block_summary(run.rows), notes=block_notes(run))


# ---- the model ----------------------------------------------------------------------------------------------------
def model_config(args):
    return M.moe_config("qwen3_moe", args.layers, M.TINY_QWEN3_MOE if args.tiny else M.QWEN3_30B_A3B)


def model_variants(run, base) -> list:
    """bf16 and ours: a sharing copy of ``base`` converted with ``--model-recipe``, its LM head kept bf16 (a
    conversion that raises or keeps the experts in bf16 goes to ``run.failed``). Both keep their prepared steps
    (``BM.Variant.keep``) so that the step's routing can be read after the timing."""
    recipe, variants = run.args.model_recipe, [BM.Variant("bf16", "bf16", base, [], keep=True)]
    try:
        model = M.sharing_copy(base)
        report = cnn.convert(model, recipe=recipe, filter=lambda name, module: name != "lm_head")
        if not report.converted_experts:
            raise RuntimeError("the experts were not converted: " + "; ".join(
                f"{n}: {why}" for n, why in report.skipped.items()))
        run.notes += [f"{recipe}: not converted: {n} ({why})" for n, why in report.skipped.items() if n != "lm_head"]
        run.say(f"converted: {str(report).splitlines()[0]}")
        if run.args.fuse:
            fused = cnn.fuse(model)
            run.notes += [f"{recipe}: not fused: {n} ({why})" for n, why in fused.items() if why is not None]
            run.say(f"fused: {sum(why is None for why in fused.values())} modules")
        variants.append(BM.Variant("ours", "bf16", model, list(report.converted), keep=True))
        if run.args.split:
            variants.append(BM.Variant(NOOP_EXPERTS, "bf16", noop_experts_model(model), [], keep=True))
            variants.append(BM.Variant(NOOP_BF16, "bf16", noop_experts_model(base), [], keep=True))
    except Exception as e:
        run.failed[f"conversion, {recipe}"] = BM.one_line(e)
    return variants


class NoopExperts(torch.nn.Module):
    """An experts module's stand-in that computes nothing: ``forward(hidden (T, H), ids, weights)`` returns a zero
    (T, H) tensor, one per shape shared by the stand-ins of a model (``S.NoopLinear``'s pool rule)."""

    def __init__(self, hidden_dim: int, pool: dict):
        super().__init__()
        self.noop = S.NoopLinear(hidden_dim, hidden_dim, pool)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.noop(hidden_states)


def noop_experts_model(model: torch.nn.Module) -> torch.nn.Module:
    """A sharing copy of ``model`` whose experts modules are ``NoopExperts``."""
    pool: dict = {}
    copy = M.sharing_copy(model)
    M.replace_modules(copy, list(experts_modules(copy)), lambda m: NoopExperts(m.hidden_dim, pool))
    return copy


def experts_floor_ms(model: torch.nn.Module, hit: dict, hbm_tbps) -> float | None:
    """The weight floor of the experts a step hit (``hit``: module name -> distinct experts)."""
    nbytes = sum(S.linear_bytes(model, [name]) * n // model.get_submodule(name).gate_up_proj.shape[0]
                 for name, n in hit.items())
    return S.floor_ms(nbytes, hbm_tbps)


def model_rows(run, phase: str, batch: int, tokens: int, measured: dict, hits: dict, variants: list,
               mode: str) -> list:
    args = run.args
    by_key = {v.key: v for v in variants}
    t_bf16, ref = measured.get(("bf16", "bf16"), (None, None))
    rests = {"ours": measured.get((NOOP_EXPERTS, "bf16"), (None,))[0],
             "bf16": measured.get((NOOP_BF16, "bf16"), (None,))[0]}
    rows = []
    for key, (ms, logits) in measured.items():
        var, hit = by_key[key], hits.get(key)
        noop = var.name in (NOOP_EXPERTS, NOOP_BF16)
        bf16 = var.name in ("bf16", NOOP_BF16)
        rest = rests.get(var.name)
        err = R.rel_error(logits, ref) if ref is not None and not (bf16 or noop) else None
        pct = None
        if phase == "decode" and hit:
            pct = pct_of_floor(touched_bytes(var.model, hit, S.streamed_bytes(var.model, tokens)), ms, run.hbm_tbps)
        split = [None] * len(SPLIT_COLUMNS)
        if rest is not None and hit:  # ours and bf16 against their own no-op steps; the bound is ours'
            floor, experts = experts_floor_ms(var.model, hit, run.hbm_tbps), ms - rest
            split = [round(experts, 4), None if floor is None else round(floor, 4),
                     round(100 * floor / experts, 1) if floor is not None and experts > 0 else None, round(rest, 4),
                     round(t_bf16 / (rest + floor), 3) if floor is not None and t_bf16 and not bf16 else None]
        impl = NOOP_EXPERTS if noop else var.model.config._experts_implementation if bf16 else OURS
        rows.append([phase, batch, tokens, "bf16" if bf16 else args.model_recipe, impl, mode, round(ms, 4),
                     round(tokens / ms * 1e3, 1), None if noop else ratio(t_bf16, ms), error_cell(err),
                     round(sum(hit.values()) / len(hit), 1) if hit else None, None if noop else pct, *split])
    return rows


def run_model(run) -> None:
    """The bf16 model, its converted copy, decode at each batch and the prefill; rows to ``run.rows`` and the
    result file after each phase (BM.ContextLost propagates)."""
    args = run.args
    run.say(f"building the bf16 model: {args.layers} Qwen3-30B-A3B-shaped layers{' (tiny)' if args.tiny else ''}")
    base = M.random_causal_lm(run.config, args.device, torch.bfloat16, seed=args.seed)
    common.use_attention(base, args.attention)  # before the copies: every variant attends the same way
    run.say(f"bf16 model built ({module_bytes(base) / 1e9:.1f} GB), experts implementation "
            f"{base.config._experts_implementation}")
    variants = model_variants(run, base)
    mode = "eager" if args.device == "cpu" else "graph"  # on the CPU the steps run as they are

    def phase(name: str, batch: int, tokens: int, measured: dict, hits: dict) -> None:
        rows = model_rows(run, name, batch, tokens, measured, hits, variants, mode)
        for row in rows:
            cell = dict(zip(MODEL_COLUMNS, row))
            x_bf16 = "" if cell["x bf16"] is None else f", x bf16 {cell['x bf16']}"
            what = cell["recipe"] + (f" ({NOOP_EXPERTS})" if cell["experts implementation"] == NOOP_EXPERTS else "")
            run.say(f"{name} batch {batch}, {what}: {cell['ms']} ms, {cell['tokens/s']} tokens/s{x_bf16}")
        run.rows.extend(rows)
        save_model(run)
        BM.free_memory(args.device)

    for batch in args.batches:
        measured = BM.measure_decode(run, variants, batch, mode, "model")
        hits = {}
        for var in variants:
            prepared = var.steps.pop((mode, batch), None)  # its cache and graph go once the routing is read
            if prepared is not None and var.key in measured:
                hits[var.key] = BM.guarded(f"model decode batch {batch}, {var.label}: routing", run.failed,
                                           args.device, experts_hit, var.model, prepared.step)
            del prepared
        phase("decode", batch, batch, measured, hits)
    if args.prefill:
        measured = BM.measure_prefill(run, [v for v in variants if v.name not in (NOOP_EXPERTS, NOOP_BF16)],
                                      "model")
        prompt = M.random_tokens(run.config, 1, args.prefill, seed=args.seed + 3, device=args.device)
        hits = {var.key: BM.guarded(f"model prefill, {var.label}: routing", run.failed, args.device, experts_hit,
                                    var.model, lambda m=var.model: M.last_logits(m, prompt))
                for var in variants if var.key in measured}
        phase("prefill", 1, args.prefill, measured, hits)


def model_summary(rows) -> dict:
    out = {}
    for c in (dict(zip(MODEL_COLUMNS, row)) for row in rows):
        if c["recipe"] == "bf16" or c["experts implementation"] == NOOP_EXPERTS:
            continue
        where = f"{c['recipe']}: {c['phase']}" + (f" batch {c['batch']}" if c["phase"] == "decode" else "")
        out[f"{where}: ours x bf16"] = c["x bf16"]
        out[f"{where}: logit rel err"] = c["logit rel err"]
        if c["bound x bf16"] is not None:
            out[f"{where}: experts % of floor"] = c["experts % of floor"]
            out[f"{where}: bound x bf16"] = c["bound x bf16"]
    return out


def model_notes(run) -> str:
    args = run.args
    floor = _floor_text(run)
    how = "eager" if args.device == "cpu" else "a CUDA graph"
    fused = " and cnn.fuse" if args.fuse else ""
    line = (f"{args.layers} Qwen3-30B-A3B-shaped layers{' (tiny config)' if args.tiny else ''}, random weights; ours: "
            f"cnn.convert recipe {args.model_recipe}{fused}, LM head bf16; attention: "
            f"{common.ATTENTION_NOTES[args.attention]}; decode: {args.context} tokens in a static KV cache, the step "
            f"run by {how}, median of {args.rounds} rounds of {args.reps}, the models in turns; "
            f"prefill eager, no cache; logit rel err: last position against bf16; weight floor: every parameter and "
            f"buffer once, the step's embedding rows and of each layer's experts those hit, at {floor}")
    if args.split:
        line += ("; split: experts ms = step - the same model's step with every experts module a no-op (rest ms), "
                 "experts floor = the experts' weights hit / HBM rate, bound x bf16 = bf16 ms / (ours' rest ms + "
                 "experts floor ms)")
    return line + _failures_and_notes(run)


def save_model(run) -> None:
    args = run.args
    if args.save and run.name:
        common.write_result(run.name, f"Qwen3-30B-A3B-shaped model, {args.layers} layers: decode and prefill, bf16 "
                            f"vs ours ({args.model_recipe})", MODEL_COLUMNS, run.rows,
                            summary=model_summary(run.rows), notes=model_notes(run))


# ---- command line ---------------------------------------------------------------------------------------------------
def what_list(text: str) -> list:
    return BM.name_list(text, WHATS, "parts")


def block_list(text: str) -> list:
    return BM.name_list(text, BLOCKS, "blocks")


def recipe_list(text: str) -> list:
    return BM.name_list(text, EXPERT_RECIPES, "the grouped FP8 GEMM's recipes")


def experts_list(text: str) -> list:
    return BM.name_list(text, BF16_EXPERTS, "transformers' experts implementations")


def model_name(layers: int) -> str:
    return MODEL_NAME if layers == M.QWEN3_30B_A3B_LAYERS else f"{MODEL_NAME}_{layers}l"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", type=what_list, default=list(WHATS), metavar="PART,...",
                   help="block, model or both (default both, block first)")
    p.add_argument("--block-config", type=block_list, default=["qwen3"], metavar="B,...",
                   help=f"the blocks, some of {','.join(BLOCKS)} (default qwen3)")
    p.add_argument("--recipes", type=recipe_list, default=list(EXPERT_RECIPES), metavar="R,...",
                   help=f"the blocks' converted variants (default {','.join(EXPERT_RECIPES)})")
    p.add_argument("--bf16-experts", type=experts_list, default=list(BF16_EXPERTS), metavar="I,...",
                   help="transformers' experts implementations of the bf16 block, the first the anchor (default "
                        f"{','.join(BF16_EXPERTS)})")
    p.add_argument("--sort-routing", action="store_true",
                   help="the block: also time each recipe with its pairs routed by the sort at every size")
    p.add_argument("--model-recipe", choices=EXPERT_RECIPES, default="row", help="the model's conversion (default row)")
    p.add_argument("--layers", type=positive_int, default=None, metavar="N",
                   help=f"the model's decoder layers (default {M.QWEN3_30B_A3B_LAYERS}; 2 with --tiny)")
    p.add_argument("--batches", type=BM.positive_ints, default=[1, 16, 64], metavar="B,...",
                   help="decode batch sizes: tokens per block call, sequences per model step (default 1,16,64)")
    p.add_argument("--prefill", type=int, default=4096,
                   help="tokens of the prefill phase (a block call, one sequence of the model); 0 skips it "
                        "(default 4096)")
    p.add_argument("--context", type=positive_int, default=512,
                   help="tokens already in the model's KV cache at decode (default 512)")
    p.add_argument("--split", action="store_true",
                   help="model decode: also time the step with every experts module a no-op (experts vs the rest)")
    p.add_argument("--fuse", action="store_true",
                   help="the model: ours after cnn.fuse (each attention's q/k/v as one GEMM)")
    common.add_attention_option(p)
    p.add_argument("--rounds", type=positive_int, default=5, help="timing rounds, variants in turns (default 5)")
    p.add_argument("--reps", type=positive_int, default=5, help="model decode steps back to back per round (default 5)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="small configs of the same architectures (a check)")
    p.add_argument("--seed", type=int, default=0)
    common.add_result_options(p)
    args = p.parse_args(argv)
    if args.prefill < 0:
        p.error("--prefill must be >= 0")
    if args.name and len(args.what) > 1:
        p.error("--name names one result file: give it with --what block or --what model")
    args.layers = args.layers or (2 if args.tiny else M.QWEN3_30B_A3B_LAYERS)
    check = args.tiny or args.device == "cpu"  # checks keep no file unless named
    args.block_name = args.name or (None if check else BLOCK_NAME)
    args.model_name = args.name or (None if check else model_name(args.layers))
    return args


def start_part(what: str, args, config, hbm_tbps, name: str | None):
    """The ``BM.Run`` of one part (its rows, failures and notes), writing result file ``name`` (None: none)."""
    run = BM.Run(args, config, hbm_tbps)
    run.name = name
    run.say(f"{what}: starting{'' if name is None else f', result file {name}.json'}")
    return run


def main(argv=None, floors=None):
    """Both parts (``--what``); {part: its rows}. ``floors`` (anything with ``hbm_tbps``) stands in for
    ``common.measured_floors()``, which a GPU run of the full configs reads and --tiny / --device cpu go without."""
    args = parse_args(argv)
    if args.device == "cuda":
        common.require_gpu("benchmarks.bench_moe")
        if floors is None and not args.tiny:
            floors = common.measured_floors()
    hbm = getattr(floors, "hbm_tbps", None)
    parts = [("block", run_blocks, save_blocks, None, args.block_name),
             ("model", run_model, save_model, model_config(args) if "model" in args.what else None, args.model_name)]
    results, lost = {}, None
    for what, body, save, config, name in parts:
        if what not in args.what:
            continue
        run = start_part(what, args, config, hbm, name)
        try:
            body(run)
        except BM.ContextLost as e:
            lost = run.failed[BM.LOST] = f"the GPU is unusable after {e}"
        for failed, why in run.failed.items():
            print(f"not measured: {what}: {failed}: {why}")
        save(run)
        results[what] = run.rows
        run.say(f"{what}: done, {len(run.rows)} rows")
        if lost:
            break
    if args.save and not (args.block_name or args.model_name):
        print("no result file (--tiny / --device cpu runs are checks; --name keeps one)")
    if lost:
        raise SystemExit(f"stopped: {lost}")
    return results


if __name__ == "__main__":
    main()
