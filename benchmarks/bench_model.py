"""A Llama-architecture model end to end: decode and prefill of the bf16 model, of the same model converted by
``cutedsl_gemm.nn.convert`` ("ours") and of the same conversion through torch's own kernels ("torch"), all built
from one set of random weights (Llama-3-8B dimensions, nothing downloaded) and timed in turns, for several recipes
in one process.

    PYTHONUNBUFFERED=1 python -m benchmarks.bench_model --layers 32 --recipes row,deepseek,int8,int4_weight \\
        --lm-head both --split --compile --compile-recipes row --compile-batches 1
    python -m benchmarks.bench_model --layers 8 --recipe row --batches 1,16,64 --context 512 --prefill 4096

The bf16 model is built once. Each recipe of ``--recipes`` then converts sharing copies of it (only the quantized
tensors are new), is measured, and is freed before the next; the bf16 rows (and the no-op steps of ``--split``) are
timed again in each recipe's rounds, as that recipe's anchor. The "torch" variant per recipe is
``model_torch.torch_path``'s (FP8: torch-side quantization + ``torch._scaled_mm`` / ``F.scaled_mm``; "int8":
``torch._int_mm``; "int8_weight" / "int4_weight": ``torch._weight_int8pack_mm`` / ``torch._weight_int4pack_mm``);
other recipes are compared with bf16 only. ``--lm-head``: the LM head stays bf16 (default), is converted too
(``converted``), or both, each recipe's head converted on a copy of the converted model (``both``).

Decode: ``batch`` sequences with ``context`` tokens in a static KV cache take one token; the step is captured in a
CUDA graph (mode "graph"), checked (``DecodeStep.check_replay``: every replay writes the same cache slot and gives
the same logits) and replayed; a converted-head variant decodes over the cache its bf16-head twin prefilled. Prefill:
one sequence of ``--prefill`` tokens, eager, no cache. ``--compile`` adds, for ``--compile-recipes`` (run last) at
``--compile-batches``, the decode step through ``torch.compile`` of the whole model (mode "compiled";
``--compile-mode``: inductor's default mode, or max-autotune-no-cudagraphs, captured in a CUDA graph as above;
reduce-overhead: torch's own graphs) for ``--compile-variants`` (default bf16 and ours, with the first LM head of
``--lm-head``), compile times in the notes. Each row: time per step, tokens/s, ratios to bf16 and to torch of the
same mode and LM head, the relative Frobenius error of the last position's logits against the bf16 model (same
inputs), and for decode the fraction of the weight floor: every parameter and buffer of the model read once (linear
weights and scales, norms, LM head) plus the embedding rows of the step's tokens, at the HBM rate
``benchmarks.measure_floor`` measured on this GPU (``common.measured_floors``).

``--split`` (decode): where the step's time goes (``model_split``): the same step with every converted linear
answered by a no-op ("no-op linears" rows: the rest, i.e. attention, norms, elementwise), and on each row the
linears' time (step - no-op step), their weight floor, its fraction, the rest, and the bound the rest sets on
"x bf16"; bf16 is split with the same layers answered by no-ops.

The run prints its cell count and a rough length first, a line per finished cell with the seconds since the start,
and writes its result file after every phase (a decode batch, the prefill), ``benchmarks/results/
model_llama8b_<layers>l.json`` (``--name``, ``--no-save``), so that a run stopped early keeps what it measured. A
variant that raises is reported in the notes and the others go on. On a GPU the same steps first run on a tiny
config in a child process (``--no-check`` skips it): a variant whose check kills that process (a device-side assert
leaves the CUDA context unusable) is left out of that recipe. ``--tiny`` (a small config, 2 layers unless
``--layers``) and ``--device cpu`` (bf16 and torch, eager, wall clock, no floors) check the steps without a result
file unless ``--name`` is given.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn.stacked import STACKABLE_RECIPES
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.tools import models as M
from cutedsl_gemm.tools.cli import positive_int

from . import common
from . import model_split as S
from .model_torch import TorchInt8Linear as TorchInt8Linear  # noqa: F401  (other benchmarks import it from here)
from .model_torch import torch_path

#: "fused": ours with its layers fused (``--fuse``: ``cnn.fuse_gated_mlps``, one gate_up GEMM and SiLU-and-multiply in
#: the down projection's quantizer; ``cnn.fuse_qkv``, one q/k/v GEMM), for the recipes they take
FUSIONS = ("mlp", "qkv")
VARIANTS = ("bf16", "torch", "ours", "fused")
NOOP = "no-op linears"
HEADS = ("bf16", "converted")
COMPILE_VARIANTS = (*VARIANTS, "noop")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")
#: every recipe of the layer; the GPU it needs is the layer's to check (a variant that raises is reported)
RECIPES = tuple(cnn.LINEAR_RECIPES)
DEFAULT_RECIPES = ("row", "deepseek", "int8", "int4_weight")
COLUMNS = ["phase", "batch", "recipe", "lm head", "mode", "variant", "ms", "tokens/s", "x bf16", "x torch",
           "logit rel err", "% of weight floor", *S.SPLIT_COLUMNS]
ROOT = Path(__file__).resolve().parents[1]


def default_name(layers: int) -> str:
    return f"model_llama8b_{layers}l"


# ---- the variants of one recipe -------------------------------------------------------------------------------
@dataclass(eq=False)
class Variant:
    """One model the run times: ``name`` (bf16, torch, ours or NOOP), its LM head ("bf16" / "converted"), the
    linears it converts (NOOP: answers with no-ops; bf16: the decoder's), and its prepared decode steps
    {(mode, batch): Prepared}, kept across recipes for the models that do not depend on the recipe (``keep``)."""

    name: str
    head: str
    model: torch.nn.Module
    names: list
    keep: bool = False
    steps: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return self.name, self.head

    @property
    def label(self) -> str:
        return self.name if self.name == "bf16" else f"{self.name} (LM head {self.head})"


def lm_heads(args) -> list:
    return list(HEADS) if args.lm_head == "both" else [args.lm_head]


def decoder_linears(model) -> list:
    return [name for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and name != "lm_head"]


class Run:
    """One invocation: its arguments, the bf16 model, the rows so far, what failed, notes, compile times."""

    def __init__(self, args, config, hbm_tbps=None):
        self.args, self.config, self.hbm_tbps = args, config, hbm_tbps
        self.rows, self.failed, self.notes, self.compile_s = [], {}, [], {}
        self.started = time.perf_counter()
        self.base = self.bf16 = None
        self._noops = {}

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.started:7.1f} s] {text}", flush=True)

    def build_base(self):
        self.base = M.random_llama(self.config, self.args.device, torch.bfloat16, seed=self.args.seed)
        common.use_attention(self.base, self.args.attention)  # before the copies: every variant attends the same way
        self.bf16 = Variant("bf16", "bf16", self.base, decoder_linears(self.base), keep=True)

    def noop(self, names: list, head: str) -> Variant:
        """The no-op model of ``names`` (one per set of names: it does not depend on the recipe)."""
        key = tuple(names)
        if key not in self._noops:
            self._noops[key] = Variant(NOOP, head, S.noop_model(self.base, names), list(names), keep=True)
        return self._noops[key]


def _convert_head(model, recipe: str, make=None) -> str | None:
    """Convert ``model``'s LM head (``make``: the torch path's layer, else ``cnn.convert``); why not, or None."""
    if make is not None:
        M.replace_modules(model, ["lm_head"], make)
        return None
    report = cnn.convert(model, recipe=recipe, filter=lambda name, module: name == "lm_head")
    return None if "lm_head" in report.converted else report.skipped.get("lm_head", "not converted")


#: per fusion: its function, the layers it stacks and the stacked layer's name
_FUSED = {"mlp": (cnn.fuse_gated_mlps, ("gate_proj", "up_proj"), "gate_up_proj"),
          "qkv": (cnn.fuse_qkv, ("q_proj", "k_proj", "v_proj"), "qkv_proj")}


def fused_variant(run: Run, recipe: str, ours: Variant) -> Variant:
    """``ours`` with the ``--fuse`` fusions, on a sharing copy (the stacked buffers are new); its linears' names are
    the fused model's (the stacked layer's name in place of the layers it stacks)."""
    model, names = M.sharing_copy(ours.model), list(ours.names)
    for what in run.args.fuse:
        fuse, parts, stacked = _FUSED[what]
        result = fuse(model)
        run.notes += [f"{recipe}: {what} not fused: {name} ({why})" for name, why in result.items() if why is not None]
        done = {name for name, why in result.items() if why is None}
        names = [n for n in names if n.rpartition(".")[0] not in done or n.rpartition(".")[2] not in parts[1:]]
        names = [f"{n.rpartition('.')[0]}.{stacked}" if n.rpartition(".")[0] in done and n.endswith("." + parts[0])
                 else n for n in names]
    return Variant("fused", ours.head, model, names)


def build_recipe(run: Run, recipe: str) -> list:
    """The variants of ``recipe``, in table order: bf16, then per LM head torch, ours and (``--split``) the no-op
    model. Ours converts a sharing copy of the bf16 model; the converted-head variants convert the head on a copy
    of that. A variant whose conversion raises goes to ``run.failed`` and is left out."""
    args, heads, skip = run.args, lm_heads(run.args), getattr(run.args, "skip", {})
    decoder = run.bf16.names
    by_head = {head: [] for head in heads}
    if "ours" in args.variants and (recipe, "ours") not in skip:
        what = f"{recipe}: conversion, ours"
        try:
            model = M.sharing_copy(run.base)
            report = cnn.convert(model, recipe=recipe, filter=lambda name, module: name != "lm_head")
            decoder = list(report.converted)
            run.notes += [f"{recipe}: not converted: {name} ({why})" for name, why in report.skipped.items()
                          if name != "lm_head"]
            if "bf16" in heads:
                by_head["bf16"].append(Variant("ours", "bf16", model, decoder))
            if "converted" in heads:
                what = f"{recipe}: conversion, ours (LM head converted)"
                model = M.sharing_copy(model) if "bf16" in heads else model
                why = _convert_head(model, recipe)
                if why is not None:
                    run.notes.append(f"{recipe}: LM head not converted ({why})")
                else:
                    by_head["converted"].append(Variant("ours", "converted", model, decoder + ["lm_head"]))
            if "fused" in args.variants and recipe in STACKABLE_RECIPES and (recipe, "fused") not in skip:
                what = f"{recipe}: fusing the MLPs"
                for head in heads:
                    by_head[head] += [fused_variant(run, recipe, ours) for ours in by_head[head] if ours.name == "ours"]
        except Exception as e:
            run.failed[what] = one_line(e)
    make, runs = torch_path(recipe)
    if "torch" in args.variants and (recipe, "torch") not in skip:
        if make is None:
            run.notes.append(f"{recipe}: {runs}")
        else:
            try:
                model = M.sharing_copy(run.base)
                M.replace_modules(model, decoder, make)
                for head in heads:
                    if head == "converted":
                        model = M.sharing_copy(model) if "bf16" in heads else model
                        _convert_head(model, recipe, make)
                    names = decoder + ["lm_head"] * (head == "converted")
                    by_head[head].insert(0, Variant("torch", head, model, names))
            except Exception as e:
                run.failed[f"{recipe}: conversion, torch"] = one_line(e)
    variants = [run.bf16] if "bf16" in args.variants and (recipe, "bf16") not in skip else []
    for head in heads:
        variants += by_head[head]
        if args.split:
            variants.append(run.noop(decoder + ["lm_head"] * (head == "converted"), head))
    return variants


def compiled_variants(variants: list, args) -> list:
    """The variants ``--compile-variants`` names, with the first LM head of ``--lm-head`` (bf16 has only its own)."""
    head = lm_heads(args)[0]
    wanted = {NOOP if v == "noop" else v for v in args.compile_variants}
    return [v for v in variants if v.name in wanted and (v.name == "bf16" or v.head == head)]


# ---- measurements -----------------------------------------------------------------------------------------------
class ContextLost(RuntimeError):
    """The CUDA context no longer runs work (a device-side assert): nothing later in the process can be timed."""


def cuda_usable(device: str) -> bool:
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def guarded(what: str, failed: dict, device: str, fn, *args):
    """``fn(*args)``, or None with ``failed[what]`` set if it raises; raises ContextLost if it left the GPU
    unusable."""
    try:
        return fn(*args)
    except Exception as e:
        failed[what] = one_line(e)
        if not cuda_usable(device):
            raise ContextLost(f"{what}: {failed[what]}") from e
        return None


class Prepared(NamedTuple):
    run: object  # () -> logits (or None, the logits then in ``output``)
    step: M.DecodeStep
    output: torch.Tensor | None


def step_runner(run: Run, step, mode: str, what: str):
    """(run, output) for a prefilled decode step: the step itself (CPU), a CUDA graph replay ("graph"), or the
    whole step compiled by torch.compile and then captured in a CUDA graph, or run by torch's own graphs
    (``--compile-mode reduce-overhead``) ("compiled"); the compile's seconds go to ``run.compile_s[what]``."""
    args = run.args
    if args.device == "cpu":
        return step, None
    if mode == "graph":
        graph, output = M.cuda_graph(step)
        return graph.replay, output
    step()  # eager first: the kernels' first calls and the no-op outputs, outside the compiled code
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    compiled = torch.compile(step.forward, mode=args.compile_mode, dynamic=False)
    if args.compile_mode == "reduce-overhead":
        def fn():
            torch.compiler.cudagraph_mark_step_begin()
            return compiled()

        fn()
        torch.cuda.synchronize()
        run.compile_s[what] = round(time.perf_counter() - t0, 1)
        for _ in range(2):  # record the graph, replay it
            fn()
        result = fn, None
    else:
        compiled()
        torch.cuda.synchronize()
        run.compile_s[what] = round(time.perf_counter() - t0, 1)
        graph, output = M.cuda_graph(compiled)
        result = graph.replay, output
    run.say(f"compiled {what} in {run.compile_s[what]:.1f} s")
    return result


def prepare(run: Run, var: Variant, mode: str, batch: int, prompt, nxt, partner: Prepared | None,
            what: str) -> Prepared:
    """A step at position ``context`` whose runner passed ``check_replay``: prefilled from ``prompt``, or over the
    cache of ``partner`` (the variant with the same layers and a bf16 head)."""
    if partner is not None:
        step = partner.step.with_model(var.model)
    else:
        step = M.DecodeStep(var.model, batch, run.args.context + 1)
        step.prefill(prompt)
        step.feed(nxt)
    fn, output = step_runner(run, step, mode, what)
    step.check_replay(fn, output, times=3, rtol=M.REPLAY_RTOL)
    return Prepared(fn, step, output)


def measure_decode(run: Run, variants: list, batch: int, mode: str, where: str) -> dict:
    """{variant key: (ms per step, logits (batch, vocab))} for one decode step at ``batch``, the variants timed in
    turns."""
    args, failed = run.args, run.failed
    prompt = M.random_tokens(run.config, batch, args.context, seed=args.seed + 1, device=args.device)
    nxt = M.random_tokens(run.config, batch, 1, seed=args.seed + 2, device=args.device)
    prepared = {}
    for var in variants:
        got = var.steps.get((mode, batch))
        if got is None:
            partner = prepared.get((var.name, "bf16")) if var.head == "converted" else None
            what = f"{where} decode batch {batch}, {var.label}"
            got = guarded(what, failed, args.device, prepare, run, var, mode, batch, prompt, nxt, partner, what)
            if got is None:
                continue
            if var.keep:
                var.steps[mode, batch] = got
        prepared[var.key] = got
    runs = {key: p.run for key, p in prepared.items()}
    times = guarded(f"{where} decode batch {batch}", failed, args.device, common.time_interleaved, runs,
                    args.rounds, args.reps, args.device != "cpu") or {}
    measured = {}
    for key in times:  # the logits after the timing, checked once more: the replays left the cache as it was
        p = prepared[key]
        logits = guarded(f"{where} decode batch {batch}, {key}", failed, args.device, p.step.check_replay, p.run,
                         p.output, 1, M.REPLAY_RTOL)
        if logits is not None:
            measured[key] = (times[key], logits)
    return measured


def measure_prefill(run: Run, variants: list, where: str) -> dict:
    """{variant key: (ms, last logits (1, vocab))} for a cache-free forward over ``--prefill`` tokens."""
    args, failed = run.args, run.failed
    prompt = M.random_tokens(run.config, 1, args.prefill, seed=args.seed + 3, device=args.device)
    runs = {}
    for var in variants:
        if var.name != NOOP and guarded(f"{where} prefill, {var.label}", failed, args.device, M.last_logits,
                                        var.model, prompt) is not None:
            runs[var.key] = lambda model=var.model: M.last_logits(model, prompt)
    times = guarded(f"{where} prefill", failed, args.device, common.time_interleaved, runs,
                    max(1, args.rounds // 2), 1, args.device != "cpu") or {}
    return {key: (times[key], runs[key]()) for key in times}


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def _round(x, digits):
    return None if x is None else round(x, digits)


def table_rows(run: Run, recipe: str, mode: str, phase: str, batch: int, tokens: int, measured: dict,
               variants: list) -> list:
    """Rows of one phase: every variant's time, rate, ratios (to bf16, to torch of the same LM head), logit error,
    fraction of the weight floor and, where a no-op step was timed beside it, the split of its time."""
    by_key = {v.key: v for v in variants}
    t_bf16, ref = measured.get(("bf16", "bf16"), (None, None))
    rows = []
    for key, (ms, logits) in measured.items():
        var = by_key[key]
        noop = var.name == NOOP
        t_torch = measured.get(("torch", var.head), (None,))[0]
        err = R.rel_error(logits, ref) if ref is not None and var.name not in ("bf16", NOOP) else None
        floor = S.floor_ms(S.streamed_bytes(var.model, tokens), run.hbm_tbps) if phase == "decode" else None
        split = [None] * len(S.SPLIT_COLUMNS)
        rest = [by_key[k] for k in ((NOOP, var.head), *((NOOP, h) for h in HEADS)) if k in measured]
        if phase == "decode" and rest and not noop:  # bf16 (head "bf16") takes the no-op model it has
            split = S.split_cells(ms, measured[rest[0].key][0], S.linear_bytes(var.model, var.names),
                                  run.hbm_tbps, t_bf16 if var.name != "bf16" else None)
        rows.append([phase, batch, recipe, var.head, mode, var.name, round(ms, 4), round(tokens / ms * 1e3, 1),
                     None if noop or not t_bf16 else round(t_bf16 / ms, 3),
                     None if noop or not t_torch else round(t_torch / ms, 3),
                     None if err is None else float(f"{err:.3g}"),
                     None if noop or floor is None else round(100 * floor / ms, 1), *split])
    return rows


def run_recipe(run: Run, recipe: str) -> list:
    """Every measurement of one recipe: decode at each batch and the prefill as graphs, then the compiled decode.
    Each phase's rows go to ``run.rows`` and the result file as they come; returns the recipe's rows (ContextLost
    propagates)."""
    args, rows = run.args, []
    run.say(f"{recipe}: converting")
    variants = build_recipe(run, recipe)
    run.say(f"{recipe}: variants {', '.join(v.label for v in variants)}")

    def phase(mode, batch, chosen):
        run.say(f"{recipe} {mode} {'prefill' if batch is None else f'decode batch {batch}'}: "
                f"{len([v for v in chosen if batch is not None or v.name != NOOP])} variants")
        if batch is None:
            got = table_rows(run, recipe, mode, "prefill", 1, args.prefill, measure_prefill(run, chosen, recipe),
                             chosen)
        else:
            got = table_rows(run, recipe, mode, "decode", batch, batch,
                             measure_decode(run, chosen, batch, mode, f"{recipe} {mode}"), chosen)
        for row in got:
            cell = dict(zip(COLUMNS, row))
            what = cell["variant"] if cell["variant"] == "bf16" else f"{cell['variant']} (LM head {cell['lm head']})"
            ratio = "" if cell["x bf16"] is None else f", x bf16 {cell['x bf16']}"
            run.say(f"{recipe} {mode} {cell['phase']} batch {cell['batch']}, {what}: {cell['ms']} ms{ratio}")
        rows.extend(got)
        run.rows.extend(got)
        save(run)
        if args.device == "cuda":
            torch.cuda.empty_cache()

    graph = "eager" if args.device == "cpu" else "graph"  # on the CPU the steps run as they are
    for batch in args.batches:
        phase(graph, batch, variants)
    if args.prefill:
        phase(graph, None, variants)
    if args.compile and recipe in args.compile_recipes:
        chosen = compiled_variants(variants, args)
        for batch in args.compile_batches:
            phase("compiled", batch, chosen)
    return rows


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- the plan: cells and a rough length ---------------------------------------------------------------------------
#: rough costs on an H200 for the estimate printed before a GPU run (not measurements of this run): a decode step
#: per layer (eager modules in a CUDA graph) = STEP_LAYER_MS + STEP_ROW_MS * batch, an eager forward per token and
#: layer, an eager decode step's host cost per layer, a whole-model compile per layer, a recipe's conversion and
#: kernel compiles, the start (imports, the bf16 model) and the tiny-config check
STEP_LAYER_MS, STEP_ROW_MS = 0.21, 0.011
FORWARD_TOKEN_LAYER_S = 0.8e-6
EAGER_STEP_LAYER_S = 1.2e-3
COMPILE_LAYER_S = 2.0
RECIPE_S, START_S, CHECK_S, CHECK_RECIPE_S = 15.0, 20.0, 20.0, 8.0


def variant_counts(args, recipe: str) -> dict:
    """{name: count} of the variants ``build_recipe`` makes for ``recipe`` (before any failure)."""
    heads = len(lm_heads(args))
    has_torch = "torch" in args.variants and torch_path(recipe)[0] is not None
    return {"bf16": int("bf16" in args.variants), "torch": heads * has_torch,
            "ours": heads * ("ours" in args.variants),
            "fused": heads * ("ours" in args.variants and "fused" in args.variants and recipe in STACKABLE_RECIPES),
            NOOP: heads * bool(args.split)}


def plan(args) -> list:
    """The (recipe, mode, phase, batch, variant, LM heads of that variant) cells of the run, in order."""
    cells = []
    for recipe in args.recipes:
        counts = variant_counts(args, recipe)
        for batch in args.batches:
            cells += [(recipe, "graph", "decode", batch, name, n) for name, n in counts.items() if n]
        if args.prefill:
            cells += [(recipe, "graph", "prefill", 1, name, n) for name, n in counts.items() if n and name != NOOP]
        if args.compile and recipe in args.compile_recipes:
            wanted = {NOOP if v == "noop" else v for v in args.compile_variants}
            for batch in args.compile_batches:
                cells += [(recipe, "compiled", "decode", batch, name, min(n, 1)) for name, n in counts.items()
                          if n and name in wanted]
    return cells


def estimate_s(args, cells) -> float:
    """A rough length of the run in seconds on an H200 (the constants above): start, check, recipes, cells."""
    layers = args.layers
    total = START_S + (CHECK_S + CHECK_RECIPE_S * len(args.recipes)) * args.check + RECIPE_S * len(args.recipes)
    compiled_anchor = set()
    for recipe, mode, phase, batch, name, n in cells:
        step_s = (layers * (STEP_LAYER_MS + STEP_ROW_MS * batch) + 0.3) / 1e3
        if phase == "prefill":
            total += n * (max(1, args.rounds // 2) + 3) * args.prefill * layers * FORWARD_TOKEN_LAYER_S
            continue
        total += n * (args.rounds * args.reps + 6) * step_s  # timing, warm-up and checks
        total += n * 3 * layers * EAGER_STEP_LAYER_S  # eager calls: prefill's, warm-up, capture
        if name != NOOP and (name != "bf16" or recipe == args.recipes[0] or mode == "compiled"):
            total += batch * args.context * layers * FORWARD_TOKEN_LAYER_S  # the cache's prefill (one per head)
        if mode == "compiled" and (name, batch) not in compiled_anchor:
            total += n * layers * COMPILE_LAYER_S
            if name in ("bf16", NOOP):  # kept across recipes: compiled once
                compiled_anchor.add((name, batch))
    return total


# ---- the table, the summary, the result file --------------------------------------------------------------------
def print_rows(rows) -> None:
    """The rows, without the columns that no row fills."""
    if not rows:
        return
    keep = [i for i, c in enumerate(COLUMNS) if any(row[i] is not None for row in rows)]
    cells = [[COLUMNS[i] for i in keep]] + [["-" if row[i] is None else str(row[i]) for i in keep] for row in rows]
    widths = [max(len(line[j]) for line in cells) for j in range(len(keep))]
    for line in cells:
        print(" ".join(f"{x:>{w}s}" for x, w in zip(line, widths)), flush=True)


def summarize(rows, first_batch=None) -> dict:
    """The headline figures per recipe, LM head and mode: ours x bf16 at each decode batch and at prefill; at the
    first decode batch ours x torch, the logit error, "x bf16 at the weight floors" (bf16's weight floor over
    ours': the bound while the rest of the step costs the same in both) and, with the split, the linears' % of
    their floor (ours and bf16) and the bound the rest sets on ours x bf16."""
    out = {}
    cells = [dict(zip(COLUMNS, row)) for row in rows]
    decode = [c for c in cells if c["phase"] == "decode"]
    first = first_batch if first_batch is not None else (decode[0]["batch"] if decode else None)
    by = {(c["recipe"], c["mode"], c["phase"], c["batch"], c["lm head"], c["variant"]): c for c in cells}
    for c in cells:
        if c["variant"] == "fused":
            at = f"{c['recipe']}, LM head {c['lm head']}, {c['mode']}"
            phase = "prefill" if c["phase"] == "prefill" else f"decode batch {c['batch']}"
            out[f"{at}: {phase}: fused x bf16"] = c["x bf16"]
        if c["variant"] != "ours":
            continue
        at = f"{c['recipe']}, LM head {c['lm head']}, {c['mode']}"
        if c["phase"] == "prefill":
            out[f"{at}: prefill: ours x bf16"] = c["x bf16"]
            continue
        where = f"{at}: decode batch {c['batch']}"
        out[f"{where}: ours x bf16"] = c["x bf16"]
        if c["batch"] != first:
            continue
        bf16 = by.get((c["recipe"], c["mode"], "decode", c["batch"], "bf16", "bf16"))
        out[f"{where}: ours x torch"] = c["x torch"]
        out[f"{where}: logit rel err ours"] = c["logit rel err"]
        if bf16 and bf16["% of weight floor"] and c["% of weight floor"]:
            out[f"{where}: x bf16 at the weight floors"] = round(
                bf16["ms"] * bf16["% of weight floor"] / (c["ms"] * c["% of weight floor"]), 3)
        if c["linears % of floor"] is not None:
            out[f"{where}: linears % of floor, ours"] = c["linears % of floor"]
            if bf16 and bf16["linears % of floor"] is not None:
                out[f"{where}: linears % of floor, bf16"] = bf16["linears % of floor"]
        if c["bound x bf16"] is not None:
            out[f"{where}: bound x bf16"] = c["bound x bf16"]
    return out


def notes_line(run: Run) -> str:
    args = run.args
    mode = "eager" if args.device == "cpu" else "a CUDA graph"
    floor = f"{run.hbm_tbps:g} TB/s (measured)" if run.hbm_tbps else "no HBM rate (floors not measured here)"
    line = (f"{args.layers} Llama-3-8B-shaped layers{' (tiny config)' if args.tiny else ''}, random weights; recipes "
            f"{', '.join(args.recipes)}, LM head {args.lm_head}; torch: each recipe's torch path; attention: "
            f"{common.ATTENTION_NOTES[args.attention]}; decode: "
            f"{args.context} tokens in a static KV cache, the step run by {mode}, median of {args.rounds} rounds of "
            f"{args.reps}, variants in turns; prefill eager, no cache; weight floor: every parameter and buffer once "
            f"plus the step's embedding rows at {floor}; logit rel err: last position against bf16")
    if "fused" in args.variants:
        what = {"mlp": "cnn.fuse_gated_mlps", "qkv": "cnn.fuse_qkv"}
        line += f"; fused: ours after {' and '.join(what[f] for f in args.fuse)} (recipes row, deepseek)"
    if args.split:
        line += ("; split: linears ms = step - the step with every converted linear a no-op (bf16: the same layers),"
                 " rest ms = that no-op step, bound x bf16 = bf16 ms / (rest ms + linears floor ms)")
    if args.compile:
        line += (f"; compiled: torch.compile(mode={args.compile_mode!r}) of the whole step"
                 f"{'' if args.compile_mode == 'reduce-overhead' else ' captured in a CUDA graph'}, recipes "
                 f"{', '.join(args.compile_recipes)}, batches {', '.join(map(str, args.compile_batches))}")
        line += "".join(f"; compile {what}: {s:g} s" for what, s in run.compile_s.items())
    line += "".join(f"; not measured: {what} ({why})" for what, why in run.failed.items())
    line += "".join(f"; {note}" for note in dict.fromkeys(run.notes))
    return line


def save(run: Run) -> None:
    """Write the result file with the rows so far (after each phase, and at the run's end)."""
    args = run.args
    if not (args.save and args.name):
        return
    title = (f"Llama-3-8B-shaped model, {args.layers} layers: decode and prefill, bf16 vs torch vs ours "
             f"({', '.join(args.recipes)})")
    common.write_result(args.name, title, COLUMNS, run.rows, summary=summarize(run.rows, args.batches[0]),
                        notes=notes_line(run))


# ---- the check on a tiny config in a child process ------------------------------------------------------------
CHECK_ARGS = ["--tiny", "--layers", "1", "--batches", "2", "--context", "16", "--prefill", "32", "--rounds", "2",
              "--reps", "5", "--no-save", "--no-check"]
CHECK_TIMEOUT_S = 300


def check_command(args, recipes, variants) -> list:
    """The child process that runs ``variants`` of ``recipes`` through the same graph-mode steps on the tiny
    config."""
    cmd = [sys.executable, "-m", "benchmarks.bench_model", *CHECK_ARGS, "--recipes", ",".join(recipes),
           "--variants", ",".join(variants), "--device", args.device, "--lm-head", args.lm_head]
    return cmd + ["--split"] * args.split


def _check_run(args, recipes, variants):
    """None if the child exits 0, else the last line it wrote (or why it did not finish)."""
    try:
        done = subprocess.run(check_command(args, recipes, variants), cwd=ROOT, capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the check did not finish in {CHECK_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    lines = [x for x in (done.stderr + done.stdout).splitlines() if x.strip()]
    return f"exit code {done.returncode}: {lines[-1].strip()[:200] if lines else 'no output'}"


def precheck(args) -> dict:
    """{(recipe, variant): why} for each variant whose tiny-config run kills its process: everything in one child;
    if that fails, each recipe in its own; for a recipe that fails, each of its variants alone."""
    if _check_run(args, args.recipes, args.variants) is None:
        return {}
    bad = {}
    for recipe in args.recipes:
        if len(args.recipes) > 1 and _check_run(args, [recipe], args.variants) is None:
            continue
        bad.update({(recipe, v): why for v in args.variants if (why := _check_run(args, [recipe], [v])) is not None})
    return bad


# ---- command line -----------------------------------------------------------------------------------------------
def positive_ints(text: str) -> list:
    return [positive_int(x) for x in text.split(",")]


def name_list(text: str, allowed, what: str) -> list:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)} ({what}), got {text!r}")
    return list(dict.fromkeys(names))


def variant_list(text: str) -> list:
    return name_list(text, VARIANTS, "variants")


def fusion_list(text: str) -> list:
    return name_list(text, FUSIONS, "fusions")


def recipe_list(text: str) -> list:
    return name_list(text, RECIPES, "recipes")


def compile_variant_list(text: str) -> list:
    return name_list(text, COMPILE_VARIANTS, "variants; noop: the split's no-op step")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=None, metavar="N",
                   help="decoder layers (default 32, the whole Llama-3-8B; 2 with --tiny)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--recipes", type=recipe_list, default=None, metavar="R,...",
                       help=f"cutedsl_gemm.nn recipes, one after the other (default {','.join(DEFAULT_RECIPES)})")
    which.add_argument("--recipe", choices=RECIPES, default=None, help="one recipe: the same as --recipes R")
    p.add_argument("--batches", type=positive_ints, default=[1, 16, 64], metavar="B,...",
                   help="decode batch sizes (default 1,16,64)")
    p.add_argument("--context", type=positive_int, default=512,
                   help="tokens already in the KV cache at decode (default 512)")
    p.add_argument("--prefill", type=int, default=4096, help="prefill length, batch 1; 0 skips it (default 4096)")
    p.add_argument("--variants", type=variant_list, default=None, metavar="V,...",
                   help="some of bf16,torch,ours,fused (default all; bf16 and torch with --device cpu; fused: ours "
                        "with its MLPs fused, recipes row and deepseek)")
    p.add_argument("--fuse", type=fusion_list, default=list(FUSIONS), metavar="F,...",
                   help="what the fused variant fuses: mlp (gate and up as one GEMM, SiLU in the quantizer), qkv "
                        "(q, k and v as one GEMM); default both")
    p.add_argument("--lm-head", nargs="?", const="converted", default="bf16", choices=(*HEADS, "both"),
                   help="the LM head: bf16 (default), converted (also: --lm-head alone), or both, side by side")
    p.add_argument("--split", action="store_true",
                   help="decode: also time the step with every converted linear a no-op (linears vs the rest)")
    p.add_argument("--compile", action="store_true",
                   help="also run the decode step through torch.compile of the whole model (mode 'compiled')")
    p.add_argument("--compile-recipes", type=recipe_list, default=None, metavar="R,...",
                   help="the recipes --compile runs (default all of --recipes)")
    p.add_argument("--compile-batches", type=positive_ints, default=None, metavar="B,...",
                   help="the decode batches --compile runs (default --batches)")
    p.add_argument("--compile-variants", type=compile_variant_list, default=["bf16", "ours"], metavar="V,...",
                   help="the variants --compile runs: some of bf16,torch,ours,noop (default bf16,ours)")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile's mode; reduce-overhead uses torch's graphs, the others are captured in one "
                        "(default: default)")
    common.add_attention_option(p)
    p.add_argument("--rounds", type=positive_int, default=6, help="timing rounds, variants in turns (default 6)")
    p.add_argument("--reps", type=positive_int, default=5, help="decode steps back to back per round (default 5)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small config of the same architecture (a check)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the tiny-config run in a child process that a GPU run starts with")
    p.add_argument("--seed", type=int, default=0)
    common.add_result_options(p)
    args = p.parse_args(argv)
    if args.prefill < 0:
        p.error("--prefill must be >= 0")
    args.layers = args.layers or (2 if args.tiny else 32)
    args.recipes = [args.recipe] if args.recipe else args.recipes or list(DEFAULT_RECIPES)
    if args.variants is None:
        args.variants = ["bf16", "torch"] if args.device == "cpu" else list(VARIANTS)
    if args.device == "cpu" and ({"ours", "fused"} & set(args.variants) or args.compile):
        p.error("the library's kernels and --compile need a GPU; --device cpu runs --variants bf16,torch eagerly")
    if not args.compile and (args.compile_recipes or args.compile_batches):
        p.error("--compile-recipes / --compile-batches go with --compile")
    args.compile_recipes = args.compile_recipes or list(args.recipes)
    if args.compile:  # the recipes with compiled rows last: a run stopped during a compile keeps the others
        args.recipes.sort(key=lambda r: r in args.compile_recipes)
    args.compile_batches = args.compile_batches or list(args.batches)
    if not set(args.compile_recipes) <= set(args.recipes):
        p.error(f"--compile-recipes must be some of --recipes ({','.join(args.recipes)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no GPU here: --device cpu --tiny runs the steps on the CPU")
    if args.name is None and not (args.tiny or args.device == "cpu"):
        args.name = default_name(args.layers)
    args.skip = {}
    return args


LOST = "the rest of the run"


def _raise_recompile_limits(compiles: int) -> None:
    """One compiled step per variant and batch, each a new DecodeStep: room for all of them in dynamo's caches."""
    config = torch._dynamo.config
    for names in (("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit",
                                                            "accumulated_cache_size_limit")):
        name = next((n for n in names if hasattr(config, n)), None)  # the first: the other is an older alias
        if name is not None:
            setattr(config, name, max(getattr(config, name), compiles + 8))


def main(argv=None, floors=None):
    """The run; ``floors`` (anything with ``hbm_tbps``) stands in for ``common.measured_floors()``, which a GPU run
    of the full config reads and --tiny / --device cpu runs go without."""
    args = parse_args(argv)
    if floors is None and args.device == "cuda" and not args.tiny:
        floors = common.measured_floors()
    cells = plan(args)
    gpu_run = args.device == "cuda" and not args.tiny
    print(f"{sum(c[-1] for c in cells)} cells (variant, phase, batch) over {len(args.recipes)} recipe(s), "
          f"{args.layers} layers"
          + (f"; roughly {estimate_s(args, cells) / 60:.1f} min on an H200" if gpu_run else ""), flush=True)
    config = M.llama_config(args.layers, M.TINY_LLAMA if args.tiny else M.LLAMA3_8B)
    run = Run(args, config, getattr(floors, "hbm_tbps", None))
    if args.check and args.device == "cuda" and not args.tiny:
        run.say("checking the steps on the tiny config in a child process")
        for (recipe, variant), why in precheck(args).items():
            run.failed[f"{recipe}: {variant} (its tiny-config check crashed)"] = why
            args.skip[recipe, variant] = why
    if args.compile:
        _raise_recompile_limits(sum(1 for c in cells if c[1] == "compiled") * 2)
    run.build_base()
    run.say(f"bf16 model built: {args.layers} layers, {len(run.bf16.names)} linears below the LM head")
    try:
        for recipe in args.recipes:
            rows = run_recipe(run, recipe)
            free_memory(args.device)
            print_rows(rows)
    except ContextLost as e:
        run.failed[LOST] = f"the GPU is unusable after {e}"
    for what, why in run.failed.items():
        print(f"not measured: {what}: {why}")
    for note in dict.fromkeys(run.notes):
        print(note)
    save(run)
    if args.save and not args.name:
        print("no result file (--tiny / --device cpu runs are checks; --name keeps one)")
    run.say("done")
    if LOST in run.failed:  # a nonzero exit: what tells the check's parent process this variant cannot run
        raise SystemExit(f"stopped: {run.failed[LOST]}")
    return run.rows


if __name__ == "__main__":
    main()
