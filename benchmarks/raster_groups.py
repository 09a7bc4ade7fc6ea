"""Dispatch's kernel for each shape, compiled again with other raster groups (``Sm90GemmConfig.group_m``, in
cluster rows; 0 = the default rule, ``Sm90GemmConfig.raster_group_m``), all in one process and timed
interleaved with cuBLAS (``tune_tiles.interleaved_times``). Every variant's output is checked against the
reference first.

    python3 -m benchmarks.raster_groups                                   # DeepSeek recipe, dsv3 + square sets
    python3 -m benchmarks.raster_groups --groups 0,2 --shapes 1024x1536x7168 --rounds 5

Session 27: no group beats the default rule on the dsv3 geomean (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from cutedsl_gemm.ops import scaled_mm as api
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.runtime.compile import compile_gemm
from .common import SETS, cublas_call, dispatched, geomean, make_operands
from .tune_tiles import interleaved_times, tile_label


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="1x128_128x128")
    p.add_argument("--groups", default="0,1,2,4", help="raster groups in cluster rows; 0 = the default rule")
    p.add_argument("--shapes", default=None, help="MxNxK,... (default: the dsv3 and square sets)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    groups = [int(g) for g in args.groups.split(",")]
    shapes = ([tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes
              else SETS["dsv3"] + SETS["square"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    compiled = {}
    times = {g: {} for g in ["cublas", *groups]}
    print(f"{'M':>5} {'N':>5} {'K':>5} {'tile':24s} sp | cuBLAS | " + " | ".join(f"g{g}" for g in groups))
    for (m, n, k) in shapes:
        qa, qw, sa, sb, plain = make_operands(m, n, k, args.recipe)
        b = qw.t()
        _, sa_k, sb_k = scale_layouts.resolve(sa, sb, m, n, k)
        inst, splits, clusters = dispatched(args.recipe, m, n, k, sms)
        ws = None
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        ref = R.reference_gemm(*plain, args.recipe)
        bias = api._dummy_bias(0)
        calls = [cublas_call(args.recipe, qa, b, sa, sb)]
        for g in groups:
            if (inst, g) not in compiled:
                compiled[(inst, g)] = (compile_gemm(dataclasses.replace(inst.sm90_config(), group_m=g)) if g
                                       else api._compiled(inst))
            fn = compiled[(inst, g)]
            call = lambda fn=fn: fn(qa, b, out, sa_k, sb_k, bias, *ws, splits, clusters)
            out.fill_(float("nan"))
            call()
            err = R.rel_error(out, ref)
            if not err < 3e-3:
                raise SystemExit(f"{m}x{n}x{k} group {g}: relative error {err:.2e}")
            calls.append(call)
        got = interleaved_times(calls, args.rounds)
        for key, (t, _) in zip(["cublas", *groups], got):
            times[key][(m, n, k)] = t
        print(f"{m:5d} {n:5d} {k:5d} {tile_label(inst):24s} {splits:2d} | {got[0][0]:6.1f} | "
              + " | ".join(f"{t:6.1f}{spread}" for t, spread in got[1:]), flush=True)
    dsv3 = [s for s in shapes if s in SETS["dsv3"]]
    for g in groups:
        line = f"g{g}:"
        if dsv3:
            ours, theirs = geomean([times[g][s] for s in dsv3]), geomean([times["cublas"][s] for s in dsv3])
            line += f" dsv3 ({len(dsv3)} shapes) geomean {ours:.2f} us, cuBLAS/ours {theirs / ours:.3f};"
        if (8192, 8192, 8192) in times[g]:
            line += f" 8192^3 {times[g][(8192, 8192, 8192)]:.1f} us"
        print(line)


if __name__ == "__main__":
    main()
