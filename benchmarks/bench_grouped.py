"""Grouped FP8 GEMM benchmark (mixture-of-experts shapes) on a Hopper GPU: ``grouped_scaled_mm`` against
torch's row-wise FP8 grouped GEMM (``torch._scaled_grouped_mm``), torch's bf16 grouped GEMM (``torch._grouped_mm``)
and a loop of this library's dense ``scaled_mm`` over the experts, in the same run, on the same routed tokens.

    python -m benchmarks.bench_grouped                                  (-> results/grouped.json)
    python -m benchmarks.bench_grouped --models dsv3,mixtral --tokens 64,4096 --routing uniform --layouts contiguous
    python -m benchmarks.bench_grouped --tile-m 64 --name grouped_t64      (the table's instances with 64-row tiles)
    python -m benchmarks.bench_grouped --tile-n 64 --check --no-save       (64-column tiles, checked)
    python -m benchmarks.bench_grouped --recipe deepseek --models dsv3     (-> results/grouped_deepseek.json)
    python -m benchmarks.bench_grouped --tile-m 128 --cluster-m 2 --no-save  (W multicast to pairs of m tiles)
    python -m benchmarks.bench_grouped --tile-m 64 --early-row-scales off --no-save
                                        (the row-wise 64-row tiles loading their scales after the main loop)

Per model, both expert GEMMs of its MoE layer: gate_up (N = 2I, K = H) and down (N = H, K = I). ``--tokens`` are
the tokens routed (each to top-k experts, so T * k rows in all); routing "uniform" draws each token's k distinct
experts uniformly, "skewed" from a Zipf-like law (expert i with weight 1 / (i + 1)), so a few experts get most rows.
Layouts: "contiguous" (the rows of all experts back to back with ``offs``) and "masked" ((E, C, K) with C the largest
group, ``counts``, and ``expected_rows`` the T * k rows routed). ``--recipe``: "row" (per-token x per-channel
scales; results/grouped.json), "tensor" or "deepseek" (1x128 x 128x128 blocks; results/grouped_<recipe>.json), bf16
output; torch's FP8 grouped GEMM, row-wise only, runs on the row-wise quantization of the same x and w.

Per row: times (median, L2 emptied before each run: ``common.bench``), our TFLOPS (useful FLOPs: 2 * rows * N * K),
each anchor's time over ours (above 1: ours is faster), and ours as % of the floor: the larger of the FP8 tensor
floor (FLOPs at the measured FP8 rate) and the HBM floor (the touched experts' weights, the rows in and out, at the
measured bandwidth; ``benchmarks.measure_floor``).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import cutedsl_gemm
from cutedsl_gemm.families import sm90_grouped as G
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.ops.grouped import grouped_scaled_mm

from . import common

# (experts, top-k, hidden H, expert width I)
MODELS = {
    "dsv3": (256, 8, 7168, 2048),
    "qwen3_30b": (128, 8, 2048, 768),
    "qwen3_235b": (128, 8, 4096, 1536),
    "mixtral": (8, 2, 4096, 14336),
}
COLUMNS = ["model", "gemm", "layout", "routing", "tokens", "rows", "experts hit", "N", "K", "ours us",
           "torch fp8 us", "torch bf16 us", "dense loop us", "ours TFLOPS", "torch fp8 / ours", "torch bf16 / ours",
           "dense loop / ours", "floor us", "ours % of floor", "rel err"]
DENSE_LOOP_MAX_EXPERTS = 32  # a Python loop over more experts times the host, not the GPU
RECIPES = {"row": "row", "tensor": "tensor", "deepseek": "1x128_128x128"}  # --recipe: the grouped recipe it runs


def route(tokens: int, experts: int, topk: int, routing: str, gen: torch.Generator) -> torch.Tensor:
    """(tokens, topk) distinct expert ids per token."""
    if routing == "uniform":
        weights = torch.ones(experts)
    else:
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    return torch.multinomial(weights.expand(tokens, experts), topk, replacement=False, generator=gen)


def sizes_of(ids: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.bincount(ids.reshape(-1), minlength=experts)


def _weights(experts, n, k, gen):
    w = torch.randn(experts, n, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    q, s = cutedsl_gemm.quantize_fp8(w.reshape(experts * n, k), "row")
    return w, q.view(experts, n, k), s.view(experts, 1, n)


def recipe_operands(recipe: str, x: torch.Tensor, w: torch.Tensor) -> tuple:
    """``(qa, sa, b (E, K, N), sb)`` of ``x`` (T, K) and ``w`` (E, N, K) quantized for the grouped op's ``recipe``
    (not "row": the benchmark's row-wise operands serve it): per tensor one scale for x and one per expert;
    DeepSeek's 1x128 groups of x and each expert's 128x128 blocks, transposed like b."""
    if recipe == "tensor":
        qa, sa = cutedsl_gemm.quantize_fp8(x, "tensor")
        per = [cutedsl_gemm.quantize_fp8(w[e], "tensor") for e in range(w.shape[0])]
        return qa, sa.reshape(1), torch.stack([q for q, _ in per]).transpose(1, 2), torch.stack([s for _, s in per])
    qa, sa = cutedsl_gemm.quantize_fp8(x, "1x128")
    per = [cutedsl_gemm.quantize_fp8(w[e], "128x128") for e in range(w.shape[0])]
    sb = torch.stack([s.t() for _, s in per]).contiguous()
    return qa, sa, torch.stack([q for q, _ in per]).transpose(1, 2), sb


def masked_operands(qa: torch.Tensor, sa: torch.Tensor, recipe: str, sizes: torch.Tensor, cap: int) -> tuple:
    """``qa`` / ``sa`` of the contiguous layout as the masked layout's (E, C, K) rows and their scales (per tensor:
    the one scale)."""
    experts, k = sizes.shape[0], qa.shape[1]
    am = torch.zeros(experts, cap, k, device=qa.device, dtype=torch.float8_e4m3fn)
    sam = None if recipe == "tensor" else torch.ones(experts, cap, sa.shape[1], device=qa.device)
    start = 0
    for e, size in enumerate(sizes.tolist()):
        am[e, :size] = qa[start:start + size]
        if sam is not None:
            sam[e, :size] = sa[start:start + size]
        start += size
    return am, sa if sam is None else sam


def our_call(a, b, sa, sb, offs=None, counts=None, tile=None, expected_rows=None):
    """The call as ``grouped_scaled_mm`` runs it, or with ``tile`` ({"tile_m": rows, "tile_n": columns,
    "early_row_scales": on, "cluster_m": CTAs}, any of them) the table's instance for it built so (a kernel option
    timed against the table's)."""
    if not tile:
        return lambda: grouped_scaled_mm(a, b, sa, sb, offs, counts=counts, expected_rows=expected_rows)
    problem = G.describe(a, b, sa, sb, offs, counts, torch.bfloat16, None, expected_rows)
    plan = G.plan(dataclasses.replace(G.select(problem, G.device_sms(a.device.index)), **tile), a.device.index)
    out = torch.empty(problem.out_shape, dtype=torch.bfloat16, device=a.device)
    groups = offs if counts is None else counts
    return lambda: G.launch(problem, a, b, sa, sb, groups, out, prepared=plan)


def run_gemm(model, gemm, n, k, experts, layouts, sizes, routing, tokens, gen, floors, check, tile=None,
             recipe="row"):
    rows_total = int(sizes.sum())
    w, qw, sw = _weights(experts, n, k, gen)
    b = qw.transpose(1, 2)  # (E, K, N), K contiguous
    x = torch.randn(rows_total, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    qa, sa = cutedsl_gemm.quantize_fp8(x, "row")
    offs = sizes.cumsum(0).to(torch.int32).cuda()
    hit = int((sizes > 0).sum())
    flops = 2.0 * rows_total * n * k
    hbm_bytes = hit * n * k + rows_total * (k + 2 * n)
    floor_us = max(flops / (floors.fp8_tflops * 1e12), hbm_bytes / (floors.hbm_tbps * 1e12)) * 1e6
    torch_fp8 = common.bench(lambda: torch._scaled_grouped_mm(qa, b, sa.view(-1), sw.view(experts, n), offs=offs,
                                                              out_dtype=torch.bfloat16)) * 1e3
    wt = w.transpose(1, 2)
    torch_bf16 = common.bench(lambda: torch._grouped_mm(x, wt, offs=offs)) * 1e3
    dense = float("nan")
    if recipe == "row" and experts <= DENSE_LOOP_MAX_EXPERTS:
        bounds = [0] + offs.tolist()

        def loop():
            for e in range(experts):
                lo, hi = bounds[e], bounds[e + 1]
                if hi > lo:
                    cutedsl_gemm.scaled_mm(qa[lo:hi], b[e], sa[lo:hi], sw[e], out_dtype=torch.bfloat16)

        dense = common.bench(loop) * 1e3
    # ours on the recipe's operands of the same x and w (row-wise: torch's)
    oa, osa, ob, osb = (qa, sa, b, sw) if recipe == "row" else recipe_operands(recipe, x, w)
    out = []
    for layout in layouts:
        if layout == "contiguous":
            ours = our_call(oa, ob, osa, osb, offs, tile=tile)
        else:
            am, sam = masked_operands(oa, osa, recipe, sizes, max(1, int(sizes.max())))
            counts = sizes.to(torch.int32).cuda()
            # C is the largest group; the rows expected over all groups are the routed pairs, as a server knows
            # them (T * top-k)
            ours = our_call(am, ob, sam, osb, counts=counts, tile=tile, expected_rows=rows_total)
        t = common.bench(ours) * 1e3
        err = float("nan")
        if check and layout == "contiguous":
            err = R.rel_error(ours(), R.reference_grouped_mm(oa, ob, osa, osb, offs, recipe=RECIPES[recipe],
                                                             out_dtype=torch.float64))
        row = [model, gemm, layout, routing, tokens, rows_total, hit, n, k, t, torch_fp8, torch_bf16, dense,
               flops / (t * 1e-6) / 1e12, torch_fp8 / t, torch_bf16 / t, dense / t, floor_us, 100 * floor_us / t, err]
        out.append([float(f"{v:.4g}") if isinstance(v, float) else v for v in row])  # as printed: 4 figures
        print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in out[-1]), flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--tokens", default="1,64,512,4096,16384", help="comma-separated routed token counts")
    p.add_argument("--routing", default="uniform,skewed", help="uniform, skewed")
    p.add_argument("--layouts", default="contiguous,masked", help="contiguous, masked")
    p.add_argument("--check", action="store_true", help="also the error against the float64 reference (slow)")
    p.add_argument("--tile-m", type=int, default=None, choices=(64, 128),
                   help="rows a tile of the table's pick (a kernel option; default: the table's)")
    p.add_argument("--tile-n", type=int, default=None, choices=(32, 64, 128, 192, 256),
                   help="columns a tile of the table's pick (a kernel option; default: the table's)")
    p.add_argument("--cluster-m", type=int, default=None, choices=(1, 2),
                   help="CTAs of a cluster along M, each W tile multicast to them (a kernel option of the 128-row "
                        "tiles; default: the table's)")
    p.add_argument("--early-row-scales", choices=("on", "off"), default=None,
                   help="the row-wise scales in hand before each unit's main loop ends (64-row tiles: loaded as it "
                        "starts; 128-row tiles: staged in shared memory by a producer warp), or read after it (a "
                        "kernel option; default: the table's)")
    p.add_argument("--recipe", choices=RECIPES, default="row",
                   help="ours' recipe (default row); torch's FP8 anchor stays row-wise, the only one it has, on the "
                        "same x and w; the dense loop runs for row only")
    common.add_result_options(p, None)
    args = p.parse_args(argv)
    if args.name is None:
        args.name = "grouped" if args.recipe == "row" else f"grouped_{args.recipe}"
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}: choose from {', '.join(MODELS)}")
    common.require_gpu("bench_grouped")
    floors = common.measured_floors()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    early = None if args.early_row_scales is None else args.early_row_scales == "on"
    tile = {k: v for k, v in (("tile_m", args.tile_m), ("tile_n", args.tile_n), ("early_row_scales", early),
                              ("cluster_m", args.cluster_m)) if v is not None}
    print(" | ".join(COLUMNS))
    rows = []
    for model in models:
        experts, topk, hidden, inter = MODELS[model]
        for routing in args.routing.split(","):
            for tokens in (int(v) for v in args.tokens.split(",")):
                sizes = sizes_of(route(tokens, experts, topk, routing, cpu_gen), experts)
                for gemm, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
                    rows += run_gemm(model, gemm, n, k, experts, args.layouts.split(","), sizes, routing, tokens,
                                     gen, floors, args.check, tile, args.recipe)
                    torch.cuda.empty_cache()
    big = [r for r in rows if r[5] >= 1024 * r[6]]  # >= 1024 rows per touched expert
    summary = {"geomean torch fp8 / ours": round(common.geomean([r[14] for r in rows]), 3),
               "geomean torch bf16 / ours": round(common.geomean([r[15] for r in rows]), 3)}
    if big:
        summary["geomean torch fp8 / ours, >= 1024 rows per expert"] = round(common.geomean([r[14] for r in big]), 3)
    title = {"row": "row-wise recipe", "tensor": "per-tensor recipe", "deepseek": "DeepSeek-V3 recipe (1x128 x "
             "128x128)"}[args.recipe]
    common.save_result(args, args.name, f"Grouped FP8 GEMM (MoE expert shapes), {title}, bf16 out", COLUMNS,
                       rows, summary=summary,
                       notes=f"{common.timing_notes()}; masked: C the largest group, expected_rows the rows "
                             f"routed; floor: max(FLOPs at {floors.fp8}, touched weights + rows in and out at "
                             f"{floors.hbm})")


if __name__ == "__main__":
    main()
