"""One kernel against two: ``quantize_scaled_mm(..., in_kernel=True)`` (bf16 activations quantized inside the GEMM at
decode sizes) against the library's quantizer followed by ``scaled_mm`` on the same weights, against ``scaled_mm``
alone on activations quantized beforehand (the GEMM's share of the two), and against the same layer written in
torch (torch-side quantization, then ``torch._scaled_mm`` / ``F.scaled_mm``, or ``torch._int_mm`` and the scale
multiply), per activation recipe:

=========  =====================================  ==================================
recipe     weight                                 activations
=========  =====================================  ==================================
deepseek   e4m3, 128x128 blocks                   e4m3, 1x128 groups
row        e4m3, per channel                      e4m3, per token
int8       int8, per channel                      int8, per token (W8A8)
=========  =====================================  ==================================

    python -m benchmarks.bench_quantize_scaled_mm --ms 1,4,16,32 --recipes deepseek,row,int8

Dispatch picks the two kernels (``in_kernel=None``); these rows say where the one kernel would pay. Each variant is
captured in a CUDA graph (one call) and timed by replaying it with the L2 emptied before each run (``common.bench``).
The floor is the weight stream: the weights and their scales at the measured floor (benchmarks.measure_floor). The
torch column is nan where torch refuses the call (blockwise ``F.scaled_mm`` at some M). The table goes to
benchmarks/results/quantize_scaled_mm.json (``--name``, ``--no-save``).
"""

from __future__ import annotations

import argparse
import math

import torch

import cutedsl_gemm
from cutedsl_gemm import problem as P
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.tools import models as M
from cutedsl_gemm.tools.baselines import TorchFp8Linear

from . import common
from .bench_model import TorchInt8Linear, positive_ints

#: (N, K): Llama-3-8B's fused QKV, O, fused gate+up and down; DeepSeek-V3's 7168 x 2048 and 4608 x 7168
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (7168, 2048), (4608, 7168))
#: recipe -> (weight quantizer, its granularity, the torch layer's FP8 recipe or None for int8)
RECIPES = {
    "deepseek": (cutedsl_gemm.quantize_fp8, "128x128", "1x128_128x128"),
    "row": (cutedsl_gemm.quantize_fp8, "row", "row"),
    "int8": (cutedsl_gemm.quantize_int8, "row", None),
}
COLUMNS = ["recipe", "M", "N", "K", "tile", "one kernel us", "two kernels us", "GEMM alone us", "torch us",
           "two / one", "torch / one", "floor us", "one kernel % of floor"]


def weight(recipe, n, k):
    """(W (N, K) in bf16, b = quantized W.t(), scale_b as scaled_mm takes it)."""
    quantize, gran, _ = RECIPES[recipe]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qw, sw = quantize(w, gran)
    return w, qw.t(), sw.t().contiguous()


def quantize_activations(recipe, x):
    fmt, gran = P.activation_quantization("row" if recipe != "deepseek" else "1x128_128x128",
                                          "int8" if recipe == "int8" else "e4m3")
    return cutedsl_gemm.quantize_int8(x, gran) if fmt == "int8" else cutedsl_gemm.quantize_fp8(x, gran, fmt=fmt)


def torch_layer(recipe, w):
    torch_recipe = RECIPES[recipe][2]
    return TorchInt8Linear(w) if torch_recipe is None else TorchFp8Linear(w, recipe=torch_recipe)


def variants(recipe, x, qa, sa, b, sb, layer):
    """{variant: function}: the one kernel, quantizer + scaled_mm, scaled_mm on ``qa`` alone, the torch layer."""
    return {
        "one": lambda: cutedsl_gemm.quantize_scaled_mm(x, b, sb, in_kernel=True),
        "two": lambda: cutedsl_gemm.quantize_scaled_mm(x, b, sb, in_kernel=False),
        "gemm": lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, None, None, torch.bfloat16),
        "torch": lambda: layer(x),
    }


def time_graph(fn) -> float:
    """us per replay of ``fn`` captured in a CUDA graph; nan where the call (or its capture) is refused."""
    if fn is None:
        return math.nan
    try:
        graph = M.cuda_graph(fn)[0]
    except (RuntimeError, ValueError):
        return math.nan
    return common.bench(graph.replay) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", type=positive_ints, default=[1, 4, 16, 32], help="rows M (default 1,4,16,32)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="default: %(default)s")
    common.add_result_options(p, "quantize_scaled_mm")
    args = p.parse_args(argv)
    recipes = args.recipes.split(",")
    if unknown := [r for r in recipes if r not in RECIPES]:
        p.error(f"unknown recipes {unknown}; expected some of {', '.join(RECIPES)}")
    common.require_gpu("bench_quantize_scaled_mm")
    floors = common.measured_floors()
    torch.manual_seed(0)
    rows = []
    print(" ".join(f"{c:>{max(len(c), 8)}s}" for c in COLUMNS))
    for recipe in recipes:
        for n, k in SHAPES:
            w, b, sb = weight(recipe, n, k)
            layer = torch_layer(recipe, w)
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                qa, sa = quantize_activations(recipe, x)
                problem = P.describe_quantize_scaled_mm(x, b, sb, None, x.dtype, None, None, None, x.device)[0]
                fused = dispatch.has_quantizing_rows(problem)
                inst, splits = dispatch.select(problem) if fused else (None, 0)
                t = {name: time_graph(fn) for name, fn in variants(recipe, x, qa, sa, b, sb, layer).items()}
                floor = floors.stream_us(n * k * b.element_size() + sb.numel() * 4)
                tile = f"{inst.tile_m}x{inst.tile_n}/{splits}" if fused else "two kernels"
                rows.append([recipe, m, n, k, tile, round(t["one"], 2), round(t["two"], 2), round(t["gemm"], 2),
                             round(t["torch"], 2), round(t["two"] / t["one"], 3), round(t["torch"] / t["one"], 3),
                             round(floor, 2), round(100 * floor / t["one"], 1)])
                print(" ".join(f"{v!s:>{max(len(c), 8)}s}" for v, c in zip(rows[-1], COLUMNS)), flush=True)
    notes = ("bf16 in and out, no bias; deepseek: 1x128 activations x 128x128 weights; row: per-token e4m3 x "
             "per-channel e4m3; int8: per-token x per-channel int8 (W8A8); two kernels: "
             "quantize_scaled_mm(in_kernel=False); torch: torch-side quantization + torch._scaled_mm / "
             "F.scaled_mm (int8: torch._int_mm, M padded to 32, and the scale multiply); each variant one call "
             "captured in a CUDA graph, replayed with the L2 emptied before each run, median; tile: the one-kernel "
             f"instance (tile_m x tile_n / K splits); floor: weights and scales at {floors.hbm}")
    common.save_result(args, "quantize_scaled_mm", "One kernel (activations quantized in the GEMM) vs quantizer + "
                       "scaled_mm and torch, decode sizes", COLUMNS, rows, notes=notes)
    return rows


if __name__ == "__main__":
    main()
