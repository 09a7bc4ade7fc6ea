"""A Llama-architecture model end to end: decode and prefill of the bf16 model, of the same model converted by
``cutedsl_gemm.nn.convert`` ("ours") and of the same conversion through torch's own kernels ("torch"), all three
built from one set of random weights (Llama-3-8B dimensions, nothing downloaded) and timed in turns.

    python -m benchmarks.bench_model --layers 8 --recipe row --batches 1,16,64 --context 512 --prefill 4096

The "torch" variant per recipe (``TORCH_PATHS``): FP8 recipes: ``anchors.TorchFp8Linear`` (torch-side
quantization + ``torch._scaled_mm``, ``F.scaled_mm`` for block scales); "int8": torch-side per-token int8
quantization + ``torch._int_mm`` + the scale multiply; "int8_weight": ``torch._weight_int8pack_mm``;
"int4_weight": ``torch._weight_int4pack_mm`` (group 128); other recipes are compared with bf16 only.

Decode: ``batch`` sequences with ``context`` tokens in a static KV cache take one token; the step is captured in a
CUDA graph (``--compile``: torch.compile(mode="reduce-overhead")), checked (``DecodeStep.check_replay``: every
replay writes the same cache slot and gives the same logits) and replayed. Prefill: one sequence of ``--prefill``
tokens, eager, no cache. Each row: time per step, tokens/s, ratios to bf16 and to torch, the relative Frobenius
error of the last position's logits against the bf16 model (same inputs), and for decode the fraction of two floors
at 3.0 TB/s: the weights (every parameter and buffer of the model read once, i.e. the linear weights and their
scales, the norms and the LM head, plus the embedding rows of the step's tokens) and the weights plus the KV cache
the attention reads (context + 1 positions). The LM head stays bf16 unless ``--lm-head``.

A variant that raises is reported in the notes and the others go on. On a GPU the same steps first run on a tiny
config in a child process (``--no-check`` skips it): a variant whose check kills that process (a device-side
assert leaves the CUDA context unusable) is left out of the main run. The table goes to
benchmarks/results/model_llama8b.json (``--name``, ``--no-save``). ``--tiny`` (a small config) and ``--device cpu``
(bf16 and torch, eager, wall clock) check the steps without a result file unless ``--name`` is given.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
from pathlib import Path

import torch

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.tools import models as M
from cutedsl_gemm.tools.anchors import TorchFp8Linear, int_mm_call
from cutedsl_gemm.tools.cli import positive_int

from . import common
from .common import HBM_TBPS

VARIANTS = ("bf16", "torch", "ours")
#: every recipe of the layer; the GPU it needs is the layer's to check (a variant that raises is reported)
RECIPES = tuple(cnn.LINEAR_RECIPES)
COLUMNS = ["phase", "batch", "variant", "ms", "tokens/s", "x bf16", "x torch", "logit rel err",
           "% of weight floor", "% of floor with KV"]
DEFAULT_NAME = "model_llama8b"
ROOT = Path(__file__).resolve().parents[1]


# ---- what a decode step reads -----------------------------------------------------------------------------------
def streamed_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes one forward step reads from the model's state: every parameter and buffer once (linear weights and
    their scales, norms, LM head, rotary table), except the input embedding table, of which only the rows of the
    step's ``tokens`` tokens are read (all of it when the LM head shares it)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb
    total = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t is emb and not tied:
            total += min(tokens, emb.shape[0]) * emb.shape[1] * emb.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


def kv_cache_bytes(config, batch: int, positions: int, element_size: int = 2) -> int:
    """Bytes of keys and values of every layer for ``batch`` sequences of ``positions`` positions."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * batch * config.num_key_value_heads * positions * head_dim * element_size


def floor_ms(nbytes: int) -> float:
    return nbytes / (HBM_TBPS * 1e12) * 1e3


# ---- torch's integer linear layers ------------------------------------------------------------------------------
def torch_quantize_int8(x: torch.Tensor):
    """Per-row symmetric int8 quantization as written in plain torch: ``scale = max(amax, 1e-12) / 127``,
    ``q = round(x / scale)`` clamped to [-127, 127]. x (rows, K) -> (q int8, scales (rows, 1) fp32)."""
    scales = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
    return (x.float() / scales).round_().clamp_(-127, 127).to(torch.int8), scales


class _TorchLinear(torch.nn.Module):
    """The shape checks and reshapes of the torch-path layers: bf16 (..., K) -> (..., N) bf16."""

    def __init__(self, weight, bias):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x):
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects bf16 input (..., {self.in_features}), got {x.dtype} "
                             f"{tuple(x.shape)}")
        y = self.matmul(x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_linear(cls, linear):
        return cls(linear.weight, linear.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}"


class TorchInt8Linear(_TorchLinear):
    """W8A8 as a torch user writes it: the weight quantized per output channel once, the activations per token on
    every call (:func:`torch_quantize_int8`), ``torch._int_mm`` and the scale multiply in torch
    (``anchors.int_mm_call``). ``torch._int_mm`` refuses M <= 16: smaller inputs are padded to 32 rows."""

    MIN_ROWS = 32

    def __init__(self, weight, bias=None):
        super().__init__(weight, bias)
        qw, sw = torch_quantize_int8(weight.detach())
        self.register_buffer("weight", qw)
        self.register_buffer("weight_scale", sw.reshape(1, -1))

    def matmul(self, x2):
        qx, sx = torch_quantize_int8(x2)
        m = qx.shape[0]
        if m < self.MIN_ROWS:
            qx = torch.nn.functional.pad(qx, (0, 0, 0, self.MIN_ROWS - m))
            sx = torch.nn.functional.pad(sx, (0, 0, 0, self.MIN_ROWS - m), value=1.0)
        return int_mm_call(qx, self.weight.t(), sx, self.weight_scale, self.bias)()[:m]


class TorchInt8WeightLinear(_TorchLinear):
    """Weight-only int8 through ``torch._weight_int8pack_mm``: the weight quantized per output channel once
    (``int_packing.quantize_weights``), bf16 activations, bf16 scales as the op takes them."""

    def __init__(self, weight, bias=None):
        super().__init__(weight, bias)
        q, s, _ = IP.quantize_weights(weight.detach(), bits=8, group=IP.PER_CHANNEL)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", s.reshape(-1).to(torch.bfloat16))

    def matmul(self, x2):
        y = torch._weight_int8pack_mm(x2, self.weight, self.weight_scale)
        return y if self.bias is None else y + self.bias


class TorchInt4WeightLinear(_TorchLinear):
    """Weight-only int4 through ``torch._weight_int4pack_mm`` (``_for_cpu`` on the CPU), group 128: the weight
    quantized symmetrically once (``int_packing.quantize_weights``: codes c in [-8, 7], one fp32 scale per group),
    stored as torch's unsigned codes c + 8 with (K / group, N, 2) bf16 (scale, zero = 0), since torch dequantizes
    ``(u - 8) * scale + zero``. On CUDA torch packs two codes a byte, the even K index in the high nibble."""

    GROUP = 128
    INNER_K_TILES = 8

    def __init__(self, weight, bias=None):
        super().__init__(weight, bias)
        codes, scales, _ = IP.quantize_weights(weight.detach(), bits=4, group=self.GROUP)
        u = codes.to(torch.int32) + 8
        if weight.is_cuda:
            packed = torch._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8),
                                                       self.INNER_K_TILES)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(u, self.INNER_K_TILES)
        self.register_buffer("weight", packed)
        sz = torch.stack([scales, torch.zeros_like(scales)], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))

    def matmul(self, x2):
        mm = torch._weight_int4pack_mm if x2.is_cuda else torch._weight_int4pack_mm_for_cpu
        y = mm(x2, self.weight, self.GROUP, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias


#: the torch-only layer of each recipe name: (recipe -> (make(linear) or None, what it runs))
TORCH_PATHS = {
    "int8": (TorchInt8Linear.from_linear, "torch-side per-token int8 quantization + torch._int_mm + scale multiply"),
    "int8_weight": (TorchInt8WeightLinear.from_linear, "torch._weight_int8pack_mm (per-channel int8 weights)"),
    "int4_weight": (TorchInt4WeightLinear.from_linear, "torch._weight_int4pack_mm (int4 weights, group 128)"),
}


def torch_path(recipe: str):
    """(make(linear) -> torch-only layer, or None; what it runs) for a recipe of ``cnn.LINEAR_RECIPES``."""
    if recipe in TORCH_PATHS:
        return TORCH_PATHS[recipe]
    r = cnn.linear_recipe(recipe)
    scaling = r.scaling
    if r.element == "e4m3" and getattr(scaling, "name", None) in TorchFp8Linear.RECIPES:
        call = "torch._scaled_mm" if scaling.name in ("tensor", "row") else "F.scaled_mm"
        return (lambda linear: TorchFp8Linear.from_linear(linear, scaling),
                f"torch-side FP8 quantization + {call} ({scaling.name})")
    return None, f"no torch path for {recipe!r}: ours is compared with bf16 only"


# ---- the three variants ---------------------------------------------------------------------------------------
def linear_filter(lm_head: bool):
    """The layers to convert: every linear, the LM head only if asked (quantized deployments keep it in bf16)."""
    return lambda name, module: lm_head or name != "lm_head"


def build_variants(config, args, failed=None):
    """({variant: model}, names of the converted linears, notes) from one random bf16 model. A variant whose
    conversion raises goes to ``failed`` ({what: why}) and is left out."""
    failed = {} if failed is None else failed
    base = M.random_llama(config, args.device, torch.bfloat16, seed=args.seed)
    keep = linear_filter(args.lm_head)
    models, notes = {}, []
    converted = [name for name, mod in base.named_modules() if isinstance(mod, torch.nn.Linear) and keep(name, mod)]
    if "ours" in args.variants:
        ours = M.sharing_copy(base)
        try:
            report = cnn.convert(ours, recipe=args.recipe, filter=keep)
            converted = list(report.converted)
            notes += [f"not converted: {name} ({why})" for name, why in report.skipped.items() if keep(name, None)]
            models["ours"] = ours
        except Exception as e:
            failed["conversion, ours"] = one_line(e)
    make, what = torch_path(args.recipe)
    if "torch" in args.variants:
        if make is None:
            notes.append(what)
        else:
            theirs = M.sharing_copy(base)
            try:
                M.replace_modules(theirs, converted, make)
                models["torch"] = theirs
            except Exception as e:
                failed["conversion, torch"] = one_line(e)
    if "bf16" in args.variants:
        models["bf16"] = base
    return {v: models[v] for v in VARIANTS if v in models}, converted, notes


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




def _step_runner(step, args):
    """(run, output) for a prefilled decode step: a CUDA graph replay, a torch.compile'd call, or (CPU) the step."""
    if args.device == "cpu":
        return step, None
    if args.compile:
        compiled = torch.compile(step.forward, mode="reduce-overhead")

        def run():
            torch.compiler.cudagraph_mark_step_begin()
            return compiled()

        for _ in range(3):  # compile, record the CUDA graph, replay it
            run()
        return run, None
    graph, output = M.cuda_graph(step)
    return graph.replay, output


def _prepared_step(model, batch, prompt, nxt, args):
    """(run, step, output): a prefilled step at position ``context`` whose runner passed ``check_replay``."""
    step = M.DecodeStep(model, batch, args.context + 1)
    step.prefill(prompt)
    step.feed(nxt)
    run, output = _step_runner(step, args)
    step.check_replay(run, output, times=3, rtol=M.REPLAY_RTOL)
    return run, step, output


def measure_decode(models, config, batch, args, failed):
    """{variant: (ms per step, logits (batch, vocab))} for one decode step at ``batch``."""
    prompt = M.random_tokens(config, batch, args.context, seed=args.seed + 1, device=args.device)
    nxt = M.random_tokens(config, batch, 1, seed=args.seed + 2, device=args.device)
    prepared = {}
    for name, model in models.items():
        got = guarded(f"decode batch {batch}, {name}", failed, args.device, _prepared_step, model, batch, prompt, nxt,
                      args)
        if got is not None:
            prepared[name] = got
    runs = {name: run for name, (run, _, _) in prepared.items()}
    times = guarded(f"decode batch {batch}", failed, args.device, common.time_interleaved, runs, args.rounds,
                    args.reps, args.device != "cpu") or {}
    measured = {}
    for name in times:  # the logits after the timing, checked once more: the replays left the cache as it was
        run, step, output = prepared[name]
        logits = guarded(f"decode batch {batch}, {name}", failed, args.device, step.check_replay, run, output, 1,
                         M.REPLAY_RTOL)
        if logits is not None:
            measured[name] = (times[name], logits)
    return measured


def measure_prefill(models, config, args, failed):
    """{variant: (ms, last logits (1, vocab))} for a cache-free forward over ``--prefill`` tokens."""
    prompt = M.random_tokens(config, 1, args.prefill, seed=args.seed + 3, device=args.device)
    runs = {}
    for name, model in models.items():
        if guarded(f"prefill, {name}", failed, args.device, M.last_logits, model, prompt) is not None:
            runs[name] = lambda model=model: M.last_logits(model, prompt)
    times = guarded("prefill", failed, args.device, common.time_interleaved, runs, max(1, args.rounds // 2), 1,
                    args.device != "cpu") or {}
    return {name: (times[name], runs[name]()) for name in times}


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def table_rows(phase, batch, tokens, measured, floors=None):
    """Rows of one phase: every variant's time, rate, ratios and error; ``floors`` {variant: (weights ms, with
    KV ms)} for decode."""
    t_bf16 = measured.get("bf16", (None,))[0]
    t_torch = measured.get("torch", (None,))[0]
    ref = measured.get("bf16", (None, None))[1]
    rows = []
    for name, (ms, logits) in measured.items():
        err = R.rel_error(logits, ref) if ref is not None and name != "bf16" else None
        floor_w, floor_kv = floors[name] if floors else (None, None)
        rows.append([phase, batch, name, round(ms, 4), round(tokens / ms * 1e3, 1),
                     round(t_bf16 / ms, 3) if t_bf16 else None, round(t_torch / ms, 3) if t_torch else None,
                     None if err is None else float(f"{err:.3g}"),
                     round(100 * floor_w / ms, 1) if floor_w else None,
                     round(100 * floor_kv / ms, 1) if floor_kv else None])
    return rows


def summarize(rows) -> dict:
    """Ours against bf16 and torch per phase, the logit errors at the first decode batch, and per decode batch the
    ratio ours could reach against bf16 if both streamed their weights at the floor (bf16's weight floor over ours:
    the bound on "ours x bf16" while the rest of the step costs the same in both)."""
    out = {}
    cells = [dict(zip(COLUMNS, row)) for row in rows]
    floor = {(c["batch"], c["variant"]): c["ms"] * c["% of weight floor"] / 100 for c in cells
             if c["phase"] == "decode" and c["ms"] and c["% of weight floor"]}
    for c in cells:
        where = f"decode batch {c['batch']}" if c["phase"] == "decode" else "prefill"
        if c["variant"] == "ours":
            out[f"{where}: ours x bf16"] = c["x bf16"]
            out[f"{where}: ours x torch"] = c["x torch"]
            if (c["batch"], "bf16") in floor and (c["batch"], "ours") in floor and c["phase"] == "decode":
                out[f"{where}: x bf16 at the weight floors"] = round(
                    floor[c["batch"], "bf16"] / floor[c["batch"], "ours"], 3)
        if c["phase"] == "decode" and c["batch"] == cells[0]["batch"] and c["logit rel err"] is not None:
            out[f"{where}: logit rel err {c['variant']}"] = c["logit rel err"]
    return out


# ---- the check on a tiny config in a child process ------------------------------------------------------------
CHECK_ARGS = ["--tiny", "--layers", "1", "--batches", "2", "--context", "16", "--prefill", "32", "--rounds", "2",
              "--reps", "20", "--no-save", "--no-check"]
CHECK_TIMEOUT_S = 300


def check_command(args, variants) -> list:
    """The child process that runs ``variants`` through the same steps on the tiny config."""
    cmd = [sys.executable, "-m", "benchmarks.bench_model", *CHECK_ARGS, "--recipe", args.recipe, "--variants",
           ",".join(variants), "--device", args.device]
    return cmd + ["--compile"] * args.compile + ["--lm-head"] * args.lm_head


def _check_run(args, variants):
    """None if the child exits 0, else the last line it wrote (or why it did not finish)."""
    try:
        done = subprocess.run(check_command(args, variants), cwd=ROOT, capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the check did not finish in {CHECK_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    lines = [x for x in (done.stderr + done.stdout).splitlines() if x.strip()]
    return f"exit code {done.returncode}: {lines[-1].strip()[:200] if lines else 'no output'}"


def precheck(args) -> dict:
    """{variant: why} for each variant whose tiny-config run kills its process: all variants in one child, then,
    if that one fails, each in its own child."""
    if _check_run(args, args.variants) is None:
        return {}
    return {v: why for v in args.variants if (why := _check_run(args, [v])) is not None}


# ---- command line -----------------------------------------------------------------------------------------------
def positive_ints(text: str) -> list:
    return [positive_int(x) for x in text.split(",")]


def variant_list(text: str) -> list:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(VARIANTS)}, got {text!r}")
    return names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=8, metavar="N",
                   help="decoder layers (default 8; 32 is the whole Llama-3-8B)")
    p.add_argument("--recipe", choices=RECIPES, default="row",
                   help="cutedsl_gemm.nn recipe of the quantized variants (default row)")
    p.add_argument("--batches", type=positive_ints, default=[1, 16, 64], metavar="B,...",
                   help="decode batch sizes (default 1,16,64)")
    p.add_argument("--context", type=positive_int, default=512,
                   help="tokens already in the KV cache at decode (default 512)")
    p.add_argument("--prefill", type=int, default=4096, help="prefill length, batch 1; 0 skips it (default 4096)")
    p.add_argument("--variants", type=variant_list, default=None, metavar="V,...",
                   help="some of bf16,torch,ours (default all three; bf16 and torch with --device cpu)")
    p.add_argument("--lm-head", action="store_true", help="convert the LM head too (default: it stays bf16)")
    p.add_argument("--compile", action="store_true",
                   help="decode through torch.compile(mode='reduce-overhead') instead of a captured CUDA graph")
    p.add_argument("--rounds", type=positive_int, default=10, help="timing rounds, variants in turns (default 10)")
    p.add_argument("--reps", type=positive_int, default=10, help="decode steps back to back per round (default 10)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small config of the same architecture (a check)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the tiny-config run in a child process that a GPU run starts with")
    p.add_argument("--seed", type=int, default=0)
    common.add_result_options(p)
    args = p.parse_args(argv)
    if args.prefill < 0:
        p.error("--prefill must be >= 0")
    if args.variants is None:
        args.variants = ["bf16", "torch"] if args.device == "cpu" else list(VARIANTS)
    if args.device == "cpu" and ("ours" in args.variants or args.compile):
        p.error("the library's kernels and --compile need a GPU; --device cpu runs --variants bf16,torch eagerly")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no GPU here: --device cpu --tiny runs the steps on the CPU")
    if args.name is None and not (args.tiny or args.device == "cpu"):
        args.name = DEFAULT_NAME
    return args


LOST = "the rest of the run"


def run_all(models, config, args, failed) -> list:
    """Every decode batch then the prefill; stops at a ContextLost (noted in ``failed``) with the rows so far."""
    rows = []
    try:
        for batch in args.batches:
            measured = measure_decode(models, config, batch, args, failed)
            floors = {}
            for name, model in models.items():
                weights = streamed_bytes(model, batch)
                kv = kv_cache_bytes(config, batch, args.context + 1)
                floors[name] = (floor_ms(weights), floor_ms(weights + kv))
            rows += table_rows("decode", batch, batch, measured, floors)
            if args.device == "cuda":
                torch.cuda.empty_cache()
        if args.prefill:
            rows += table_rows("prefill", 1, args.prefill, measure_prefill(models, config, args, failed))
    except ContextLost as e:
        failed[LOST] = f"the GPU is unusable after {e}"
    return rows


def main(argv=None):
    args = parse_args(argv)
    failed, notes = {}, []
    if args.check and args.device == "cuda" and not args.tiny:
        for variant, why in precheck(args).items():
            failed[f"{variant} (its tiny-config check crashed)"] = why
            args.variants.remove(variant)
    config = M.llama_config(args.layers, M.TINY_LLAMA if args.tiny else M.LLAMA3_8B)
    if args.compile:  # one compiled step per variant and batch: raise dynamo's per-function recompile limit
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    4 * len(args.variants) * len(args.batches))
    models, converted, built_notes = build_variants(config, args, failed)
    notes += built_notes
    print(f"{args.layers} layers, recipe {args.recipe}: {len(converted)} linears converted; variants "
          f"{', '.join(models)}")
    rows = run_all(models, config, args, failed)
    widths = [8, 5, 8, 9, 10, 7, 8, 13, 17, 18]
    print(" ".join(f"{c:>{w}s}" for c, w in zip(COLUMNS, widths)))
    for row in rows:
        print(" ".join(f"{'-' if x is None else x!s:>{w}s}" for x, w in zip(row, widths)))
    for what, why in failed.items():
        print(f"not measured: {what}: {why}")
    for note in notes:
        print(note)
    mode = "eager" if args.device == "cpu" else "torch.compile" if args.compile else "CUDA graph"
    head = "LM head converted" if args.lm_head else "LM head bf16"
    torch_what = torch_path(args.recipe)[1]
    line = (f"{args.layers} Llama-3-8B-shaped layers{' (tiny config)' if args.tiny else ''}, random weights; "
            f"{len(converted)} linears converted ({head}); torch: {torch_what}; decode: {args.context} tokens in a "
            f"static KV cache, the step run by {mode}, median of {args.rounds} rounds of {args.reps}, variants in "
            f"turns; prefill eager, no cache; weight floor: every parameter and buffer once plus the step's "
            f"embedding rows at {HBM_TBPS:g} TB/s, 'with KV' adds the KV cache read; logit rel err: last position "
            f"against bf16")
    line += "".join(f"; not measured: {what} ({why})" for what, why in failed.items())
    line += "".join(f"; {note}" for note in notes if note != torch_what)
    title = (f"Llama-3-8B-shaped model, {args.layers} layers: decode and prefill, bf16 vs torch vs ours "
             f"({args.recipe})")
    if args.save and args.name:
        common.write_result(args.name, title, COLUMNS, rows, summary=summarize(rows), notes=line)
    elif args.save:
        print("no result file (--tiny / --device cpu runs are checks; --name keeps one)")
    if LOST in failed:  # a nonzero exit: what tells the check's parent process this variant cannot run
        raise SystemExit(f"stopped: {failed[LOST]}")
    return rows


if __name__ == "__main__":
    main()
