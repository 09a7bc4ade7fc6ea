"""The linear layers of a Llama-3-8B stack without the rest of the model: per layer 4096->6144 (QKV), 4096->4096
(O), 4096->28672 (gate+up), 14336->4096 (down), distinct weights, bf16 activations in and out; one forward of the
stack runs every linear once on an (M, K) input of its K. Three ways, timed in turns in one process: bf16
(``torch.matmul`` through ``nn.Linear``), torch FP8 (``baselines.TorchFp8Linear``: torch-side quantization +
``torch._scaled_mm``) and ours (``cutedsl_gemm.nn.QuantizedLinear``: the quantizer, then ``scaled_mm``). For the recipes
with one-kernel rows (DeepSeek's, per token), a variant runs the one kernel that quantizes the activations inside
the GEMM at every M it takes (``quantize_scaled_mm(..., in_kernel=True)``; refused above its 32-token tiles).

    python -m benchmarks.bench_linear_stack --layers 8 --recipe row --ms 1,16,4096 --eager-ms 1

Each M runs as one captured CUDA graph per forward; ``--eager-ms`` also runs those M eagerly (host cost included).
The floor is the FP8 stack's: max(bytes / HBM rate, FLOPs / FP8 rate) at the measured floor
(benchmarks.measure_floor), bytes = FP8 weights + their scales + the bf16 inputs read and outputs written. The
table goes to benchmarks/results/linear_stack.json (``--name``, ``--no-save``).
"""

from __future__ import annotations

import argparse

import torch

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.selection.instances import INSTANCES, QUANT_GEMM
from cutedsl_gemm.tools import models as M
from cutedsl_gemm.tools.baselines import TorchFp8Linear
from cutedsl_gemm.tools.cli import positive_int

from . import common
from .bench_model import one_line, positive_ints

#: the recipes of cutedsl_gemm.nn that torch's FP8 path runs too
RECIPES = tuple(name for name, r in cnn.LINEAR_RECIPES.items()
                if r.element == "e4m3" and getattr(r.scaling, "name", None) in TorchFp8Linear.RECIPES)
REFUSALS = (RuntimeError, ValueError, NotImplementedError)  # what torch raises for a shape or recipe it does not run

#: (N, K) of one Llama-3-8B layer's linears: fused QKV, O, fused gate+up, down
LLAMA3_8B_LINEARS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
VARIANTS = ("bf16", "torch FP8", "ours", "ours, 1 kernel")
COLUMNS = ["M", "mode", "bf16 ms", "torch FP8 ms", "ours ms", "ours x bf16", "ours x torch FP8", "floor ms",
           "ours % of floor"]
#: with the forced one-kernel variant
ONE_KERNEL_COLUMNS = ["1 kernel ms", "1 kernel x ours"]


class OneKernelLinear(torch.nn.Module):
    """A ``QuantizedLinear`` run as ``quantize_scaled_mm(..., in_kernel=True)``: its activations quantized inside the
    GEMM
    whatever dispatch would choose (a ValueError above the one-kernel rows' 32-token tiles)."""

    def __init__(self, layer: cnn.QuantizedLinear):
        super().__init__()
        self.in_features, self.layer = layer.in_features, layer
        self.scale_recipe_b = cnn.linear_recipe(layer.recipe).scaling.b.scaling_type

    def forward(self, x):
        import cutedsl_gemm

        return cutedsl_gemm.quantize_scaled_mm(x, self.layer.weight.t(), self.layer.weight_scale, self.layer.bias,
                                               x.dtype, scale_recipe_b=self.scale_recipe_b, in_kernel=True)


def has_one_kernel_rows(recipe: str) -> bool:
    """Whether the instance table has GEMMs that quantize the activations of ``recipe`` (an nn recipe name)."""
    name = cnn.linear_recipe(recipe).scaling.name
    return any(i.op == QUANT_GEMM and i.recipe == name for i in INSTANCES)


def stack_floor_ms(m: int, layers: int, shapes=LLAMA3_8B_LINEARS, scale_bytes: int = 0,
                   floors: common.Floors | None = None) -> float:
    """The FP8 stack's floor at M rows: max(bytes / HBM rate, FLOPs / FP8 rate) at ``floors`` (default this GPU's
    ``common.measured_floors()``), ``scale_bytes`` the weight scales'."""
    floors = floors or common.measured_floors()
    nbytes = layers * sum(n * k + 2 * m * k + 2 * m * n for n, k in shapes) + scale_bytes
    flops = layers * sum(2 * m * n * k for n, k in shapes)
    return max(floors.stream_us(nbytes), floors.mma_us(flops)) / 1e3


def build_stacks(layers: int, recipe: str, variants, device="cuda", seed: int = 0, shapes=LLAMA3_8B_LINEARS):
    """{variant: [layer modules]}: ``layers`` x the linears of ``shapes`` ((N, K) each), distinct random bf16
    weights, the FP8 variants quantized from the same weights."""
    torch.manual_seed(seed)
    bf16 = [torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
            for _ in range(layers) for n, k in shapes]
    stacks = {"bf16": bf16}
    if "torch FP8" in variants:
        stacks["torch FP8"] = [TorchFp8Linear.from_linear(lin, cnn.linear_recipe(recipe).scaling) for lin in bf16]
    if "ours" in variants:
        stacks["ours"] = [cnn.QuantizedLinear.from_linear(lin, recipe=recipe) for lin in bf16]
        if "ours, 1 kernel" in variants and has_one_kernel_rows(recipe):
            stacks["ours, 1 kernel"] = [OneKernelLinear(layer) for layer in stacks["ours"]]
    return {v: stacks[v] for v in VARIANTS if v in variants and v in stacks}


def forward_fn(stack, inputs):
    """One forward of the stack: every linear on the input of its K (outputs dropped)."""

    def forward():
        for lin in stack:
            lin(inputs[lin.in_features])

    return forward


def _round(x, digits):
    return None if x is None else round(x, digits)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=8, help="layers of four linears (default 8)")
    p.add_argument("--recipe", choices=RECIPES, default="row", help="FP8 recipe (default row)")
    p.add_argument("--ms", type=positive_ints, default=[1, 16, 4096], help="rows M, CUDA graph (default 1,16,4096)")
    p.add_argument("--eager-ms", type=positive_ints, default=[1], help="rows M run eagerly too (default 1)")
    p.add_argument("--rounds", type=positive_int, default=10, help="timing rounds, variants in turns (default 10)")
    p.add_argument("--reps", type=positive_int, default=10, help="forwards back to back per round (default 10)")
    common.add_result_options(p, "linear_stack")
    args = p.parse_args(argv)
    common.require_gpu("bench_linear_stack")
    floors = common.measured_floors()
    stacks = build_stacks(args.layers, args.recipe, VARIANTS)
    one = "ours, 1 kernel" in stacks
    columns = COLUMNS + (ONE_KERNEL_COLUMNS if one else [])
    scale_bytes = sum(t.numel() * t.element_size() for lin in stacks["ours"] for name, t in lin.named_buffers()
                      if name != "weight")
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    print(f"{args.layers} layers, {4 * args.layers} linears, recipe {args.recipe}; ms per forward of the stack")
    print(" ".join(f"{c:>{max(len(c), 10)}s}" for c in columns))
    failed = {}
    for m, mode in [(m, "CUDA graph") for m in args.ms] + [(m, "eager") for m in args.eager_ms]:
        inputs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for k in {k for _, k in LLAMA3_8B_LINEARS}}
        runs = {}
        for name, stack in stacks.items():
            fn = forward_fn(stack, inputs)
            try:
                if mode == "eager":
                    fn()
                runs[name] = fn if mode == "eager" else M.cuda_graph(fn)[0].replay
            except REFUSALS as e:  # torch's blockwise path refuses some M
                failed[f"M={m} {mode}, {name}"] = one_line(e)
        t = common.time_interleaved(runs, args.rounds, args.reps)
        bf16, theirs, ours, fused = (t.get(name) for name in VARIANTS)
        floor = stack_floor_ms(m, args.layers, scale_bytes=scale_bytes, floors=floors)
        rows.append([m, mode, _round(bf16, 4), _round(theirs, 4), _round(ours, 4),
                     _round(ours and bf16 and bf16 / ours, 3), _round(ours and theirs and theirs / ours, 3),
                     round(floor, 4), _round(ours and 100 * floor / ours, 1)])
        if one:
            rows[-1] += [_round(fused, 4), _round(ours and fused and ours / fused, 3)]
        print(" ".join(f"{'-' if x is None else x!s:>{max(len(c), 10)}s}" for x, c in zip(rows[-1], columns)))
        del runs
        torch.cuda.empty_cache()
    for what, why in failed.items():
        print(f"not measured: {what}: {why}")
    notes = (f"{args.layers} layers x (4096->6144, 4096->4096, 4096->28672, 14336->4096), distinct weights, bf16 in "
             f"and out, recipe {args.recipe}; ms per forward of the stack, median of {args.rounds} rounds of "
             f"{args.reps} forwards, variants in turns, no L2 flush (the weights exceed it); floor: FP8 weights + "
             f"scales + activations at {floors.hbm} or FLOPs at {floors.fp8}, whichever is longer")
    notes += "".join(f"; not measured: {what} ({why})" for what, why in failed.items())
    common.save_result(args, "linear_stack", f"Llama-3-8B linear stack ({args.layers} layers): bf16 vs torch FP8 vs "
                       f"ours ({args.recipe})", columns, rows, notes=notes)
    return rows


if __name__ == "__main__":
    main()
