"""Decode GEMMs back to back, as a model runs them layer after layer: L GEMMs with distinct weights (so
nothing stays in L2), timed as one sequence after the L2 is emptied; the figure is the time per GEMM.

Isolated calls (bench_gemm) pay each kernel's launch latency and pipeline ramp in full; in a sequence the
decode kernels' programmatic dependent launch lets each one start while the previous one finishes. The
same kernels built without it, and cuBLAS (torch._scaled_mm), run the same sequence.

    python -m benchmarks.bench_decode_chain --ms 1,16,64,128 --nk 8192x8192 --layers 8 --recipes row,tensor
    python -m benchmarks.bench_decode_chain --sweep --recipes row,tensor,1x128_128x128

The table goes to benchmarks/results/decode_chain.json (``--name``, ``--no-save``: common.write_result).
``--sweep`` runs the layer shapes of ``benchmarks.bench_sweep`` at its M values up to 128 instead, without the
no-PDL comparison, and reports each layer's fraction of the weight-streaming floor (``bench_sweep.floor_us``)
into decode_chain_sweep.json. Bandwidths and floors are against the measured floor (benchmarks.measure_floor).
"""

from __future__ import annotations

import argparse
import math

import torch

import cutedsl_gemm
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.selection.instances import kernel_variant
from cutedsl_gemm.tools.baselines import cublas_call, make_operands

from . import bench_sweep, common
from .common import bench


def chain_one(recipe, m, n, k, layers, sms, without_pdl=True):
    """Time per GEMM (us) of one sequence of ``layers`` GEMMs: ours (PDL), the same kernels without PDL (nan
    unless ``without_pdl``), cuBLAS (nan where it refuses the shape)."""
    operands = [make_operands(m, n, k, recipe) for _ in range(layers)]
    qa = operands[0][0]
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in operands]

    def ours():
        for (_, qw, sa, sb, _), out in zip(operands, outs):
            cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out=out)

    cublas_calls = [cublas_call(recipe, qa, qw.t(), sa, sb) for _, qw, sa, sb, _ in operands]

    def theirs():
        for call in cublas_calls:
            call()

    try:
        theirs()
    except (RuntimeError, ValueError):  # cuBLAS refuses some recipe/shape pairs (blockwise at M = 1)
        theirs = None
    if not without_pdl:
        return bench(ours) * 1e3 / layers, math.nan, bench(theirs) * 1e3 / layers if theirs else math.nan

    # the instance scaled_mm dispatches to (it passes K too)
    inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=sms, k=k)
    plain = kernel_variant(inst, pdl=False)  # the same decode kernel built without PDL
    clusters = launch.launch_clusters(0, plain)
    splits = dispatch.choose_splits(plain, m, n, k, clusters * plain.cluster_m * plain.cluster_n)
    views = [scale_layouts.resolve(sa, sb, m, n, k)[1:] for (_, _, sa, sb, _) in operands]
    plain_calls = [launch.bind(plain, qa, qw.t(), sa_k, sb_k, out, splits=splits)
                   for (_, qw, _, _, _), (sa_k, sb_k), out in zip(operands, views, outs)]

    def ours_nopdl():
        for call in plain_calls:
            call()

    return tuple(bench(f) * 1e3 / layers if f else math.nan for f in (ours, ours_nopdl, theirs))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default=None, help="default: 1,16,64,128; with --sweep, bench_sweep's M values <= 128")
    p.add_argument("--nk", default=None, help="default: 8192x8192; with --sweep, bench_sweep's layer shapes")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--recipes", default="row,tensor")
    p.add_argument("--sweep", action="store_true",
                   help="bench_sweep's layer shapes at M <= 128, with the fraction of the weight-streaming floor")
    common.add_result_options(p)
    args = p.parse_args(argv)
    common.require_gpu("bench_decode_chain")
    floors = common.measured_floors()
    if args.sweep:
        return run_sweep(args, floors)
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'recipe':7s} {'M':>4s} {'N':>6s} {'K':>6s} | per GEMM us: ours (PDL) | ours, no PDL | cuBLAS | "
          f"GB/s ours | x cuBLAS   ({args.layers} GEMMs per sequence, distinct weights)")
    for recipe in args.recipes.split(","):
        for nk in (args.nk or "8192x8192").split(","):
            n, k = map(int, nk.split("x"))
            for m in map(int, (args.ms or "1,16,64,128").split(",")):
                t_pdl, t_plain, t_cub = chain_one(recipe, m, n, k, args.layers, sms)
                gbs = (n * k + m * k + 2 * m * n) / t_pdl / 1e3
                print(f"{recipe:7s} {m:4d} {n:6d} {k:6d} | {t_pdl:24.1f} | {t_plain:12.1f} | {t_cub:6.1f} | "
                      f"{gbs:6.0f} ({common.pct_of_hbm(gbs, floors):.0f}%) | {t_cub / t_pdl:5.2f}")
                rows.append([recipe, m, n, k, round(t_pdl, 2), round(t_plain, 2), round(t_cub, 2),
                             round(t_cub / t_pdl, 3), round(gbs), round(common.pct_of_hbm(gbs, floors), 1)])
    columns = ["recipe", "M", "N", "K", "ours us", "ours without PDL us", "cuBLAS us", "ratio", "GB/s",
               f"% of {floors.hbm}"]
    common.save_result(args, "decode_chain", f"Decode GEMMs back to back ({args.layers} per sequence), time per GEMM",
                       columns, rows, notes=f"{common.timing_notes()}, once per sequence of {args.layers} GEMMs with "
                       f"distinct weights; cuBLAS timed in the same run; ratio = cuBLAS us / ours us; {floors.note()}")


# The decode summary's least fraction of the floor counts the layers whose FP8 weights stream for long enough to
# reach it.
TARGET_MAX_M, TARGET_MIN_WEIGHT_MB = 64, 32


def run_sweep(args, floors):
    """``--sweep``: per recipe, layer and M <= 128 of ``bench_sweep``, the time per GEMM of a sequence, ours
    and cuBLAS's, and the fraction of the floor (W, A and the output streamed once per GEMM) ours reaches."""
    nks = bench_sweep.parse_nk(args.nk) if args.nk else [(n, k) for _, n, k in bench_sweep.LAYERS]
    ms = [int(m) for m in args.ms.split(",")] if args.ms else [m for m in bench_sweep.MS if m <= 128]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(f"{'recipe':14s} {'layer':12s} {'M':>4s} {'N':>6s} {'K':>6s} {'W MB':>6s} | ours us | cuBLAS us | ratio | "
          f"of floor   ({args.layers} GEMMs per sequence, distinct weights)")
    for recipe in args.recipes.split(","):
        for n, k in nks:
            for m in ms:
                t_ours, _, t_cub = chain_one(recipe, m, n, k, args.layers, sms, without_pdl=False)
                floor, _ = bench_sweep.floor_us(m, n, k, floors.fp8_tflops, floors.hbm_tbps)
                weight_mb = n * k / 1e6
                print(f"{recipe:14s} {bench_sweep.layer_name(n, k):12s} {m:4d} {n:6d} {k:6d} {weight_mb:6.1f} | "
                      f"{t_ours:7.1f} | {t_cub:9.1f} | {t_cub / t_ours:5.2f} | {floor / t_ours:5.2f}", flush=True)
                rows.append([recipe, bench_sweep.layer_name(n, k), m, n, k, round(weight_mb, 1), round(t_ours, 2),
                             round(t_cub, 2), round(t_cub / t_ours, 3),
                             round(common.gbps(m, n, k, t_ours / 1e3)), round(floor / t_ours, 3)])
    summary = {}
    for recipe in args.recipes.split(","):
        mine = [r for r in rows if r[0] == recipe]
        target = [r[-1] for r in mine if r[2] <= TARGET_MAX_M and r[5] >= TARGET_MIN_WEIGHT_MB]
        summary[f"{recipe} geomean of floor"] = round(common.geomean([r[-1] for r in mine]), 3)
        if target:
            summary[f"{recipe} least of floor, M <= {TARGET_MAX_M}, W >= {TARGET_MIN_WEIGHT_MB} MB"] = min(target)
        summary[f"{recipe} geomean ratio"] = round(common.geomean([r[8] for r in mine]), 3)
    for key, value in summary.items():
        print(f"  {key}: {value}")
    columns = ["recipe", "layer", "M", "N", "K", "W MB", "ours us", "cuBLAS us", "ratio", "GB/s", "of floor"]
    common.save_result(args, "decode_chain_sweep",
                       f"Decode GEMMs back to back ({args.layers} per sequence) over the sweep's layer shapes",
                       columns, rows, summary=summary,
                       notes=f"{common.timing_notes()}, once per sequence of {args.layers} GEMMs with distinct "
                             f"weights; cuBLAS timed in the same run; ratio = cuBLAS us / ours us; of floor: A, W and "
                             f"the output streamed once per GEMM at {floors.hbm}, or the MMAs at {floors.fp8}, "
                             f"over ours; {floors.note()}")
    return rows


if __name__ == "__main__":
    main()
