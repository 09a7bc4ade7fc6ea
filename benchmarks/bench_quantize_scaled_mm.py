"""One kernel against two: ``quantize_scaled_mm(..., in_kernel=True)`` (bf16 activations quantized inside the GEMM,
1x128 groups, at decode sizes) against ``quantize_fp8`` followed by ``scaled_mm`` on the same weights, and against
``scaled_mm`` alone on activations quantized beforehand (the GEMM's share of the two), DeepSeek recipe (1x128 x
128x128). ``dispatch.quantizes_in_kernel``'s stage costs come from this table.

    python -m benchmarks.bench_quantize_scaled_mm --ms 1,4,16,32

Each variant is captured in a CUDA graph (one call) and timed by replaying it with the L2 emptied before each run
(``common.bench``). The floor is the weight stream: FP8 weights and their scales at 3.0 TB/s. The table goes to
benchmarks/results/quantize_scaled_mm.json (``--name``, ``--no-save``).
"""

from __future__ import annotations

import argparse

import torch

import cutedsl_gemm
from cutedsl_gemm import problem as P
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.tools import models as M

from . import common
from .bench_model import positive_ints
from .common import HBM_TBPS

#: (N, K): Llama-3-8B's fused QKV, O, fused gate+up and down; DeepSeek-V3's 7168 x 2048 and 4608 x 7168
SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (7168, 2048), (4608, 7168))
COLUMNS = ["M", "N", "K", "tile", "one kernel us", "two kernels us", "GEMM alone us", "two / one", "floor us",
           "one kernel % of floor"]


def weight(n, k):
    w = torch.randn(n, k, device="cuda")
    qw, sw = cutedsl_gemm.quantize_fp8(w, "128x128")
    return qw.t(), sw.t().contiguous()


def two_kernels(x, b, sb):
    qa, sa = cutedsl_gemm.quantize_fp8(x, "1x128")
    return cutedsl_gemm.scaled_mm(qa, b, sa, sb, None, None, torch.bfloat16)


def variants(x, qa, sa, b, sb):
    """{variant: function}: one kernel, quantize_fp8 + scaled_mm, scaled_mm on ``qa`` alone."""
    return {
        "one": lambda: cutedsl_gemm.quantize_scaled_mm(x, b, sb, in_kernel=True),
        "two": lambda: two_kernels(x, b, sb),
        "gemm": lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, None, None, torch.bfloat16),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", type=positive_ints, default=[1, 4, 16, 32], help="rows M (default 1,4,16,32)")
    common.add_result_options(p, "quantize_scaled_mm")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a GPU")
    torch.manual_seed(0)
    rows = []
    print(" ".join(f"{c:>{max(len(c), 8)}s}" for c in COLUMNS))
    for n, k in SHAPES:
        b, sb = weight(n, k)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            qa, sa = cutedsl_gemm.quantize_fp8(x, "1x128")
            problem = P.describe_quantize_scaled_mm(x, b, sb, None, x.dtype, None, None, None, x.device)[0]
            fused = dispatch.has_quantizing_rows(problem)
            inst, splits = dispatch.select(problem) if fused else (None, 0)
            fns = variants(x, qa, sa, b, sb)
            t = {}
            for name, fn in fns.items():
                graph = M.cuda_graph(fn)[0]
                t[name] = common.bench(graph.replay) * 1e3
            floor = (n * k + sb.numel() * 4) / (HBM_TBPS * 1e12) * 1e6
            tile = f"{inst.tile_m}x{inst.tile_n}/{splits}" if fused else "two kernels"
            rows.append([m, n, k, tile, round(t["one"], 2), round(t["two"], 2), round(t["gemm"], 2),
                         round(t["two"] / t["one"], 3), round(floor, 2), round(100 * floor / t["one"], 1)])
            print(" ".join(f"{x!s:>{max(len(c), 8)}s}" for x, c in zip(rows[-1], COLUMNS)))
    notes = ("DeepSeek recipe (1x128 activations x 128x128 weights), bf16 in and out, no bias; each variant one "
             "call captured in a CUDA graph, replayed with the L2 emptied before each run, median; tile: the "
             "one-kernel instance (tile_m x tile_n / K splits); floor: FP8 weights and scales at "
             f"{HBM_TBPS:g} TB/s")
    common.save_result(args, "quantize_scaled_mm", "One kernel (activations quantized in the GEMM) vs quantize_fp8 + "
                       "scaled_mm, decode sizes", COLUMNS, rows, notes=notes)
    return rows


if __name__ == "__main__":
    main()
