"""Tile/cluster sweep for small M (decode) on a Hopper GPU: which instance streams W fastest.

    python -m benchmarks.tune_small_m [--ms 1,16,64,128] [--nk 8192x8192,10240x8192]

Compiles candidate configurations that need not be in the manifest (the manifest's small-M rows are chosen
from this table), runs each on the same data, and prints time, GB/s and % of 3.0 TB/s next to cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from cutedsl_gemm import api, reference as R
from cutedsl_gemm.generators.manifest import KernelInstance
from .common import HBM_TBPS, bench, cublas_call, make_operands


def candidates(recipe):
    accs = ("promoted",) if "x128" in recipe else ("promoted", "fast")
    for tile_n, (cm, cn), accum in itertools.product((64, 128), ((1, 1), (1, 2), (2, 1)), accs):
        yield KernelInstance("sm_90a", "gemm", "tune", recipe, "e4m3", "e4m3", "bf16", None, 128, tile_n, cm, cn, 0, accum)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,16,64,128")
    p.add_argument("--nk", default="8192x8192")
    p.add_argument("--recipes", default="row,1x128_128x128")
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for recipe in args.recipes.split(","):
        for nk in args.nk.split(","):
            n, k = map(int, nk.split("x"))
            for m in map(int, args.ms.split(",")):
                qa, qw, sa, sb, plain = make_operands(m, n, k, recipe)
                b = qw.t()
                _, sa_k, sb_k = api.scale_layouts.resolve(sa, sb, m, n, k)
                ref = R.reference_gemm(*plain, recipe)
                bytes_moved = m * k + n * k + m * n * 2
                try:
                    t_c = bench(cublas_call(recipe, qa, b, sa, sb)) * 1e3
                except (RuntimeError, ValueError):  # e.g. cuBLAS blockwise refuses M=1
                    t_c = float("nan")
                print(f"{recipe} M={m} N={n} K={k}: cuBLAS {t_c:.1f} us ({bytes_moved / t_c / 1e3:.0f} GB/s)")
                for inst in candidates(recipe):
                    fn = api._compiled(inst)
                    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    clusters = sms // (inst.cluster_m * inst.cluster_n)
                    call = lambda: fn(qa, b, out, sa_k, sb_k, api._dummy_bias(0), clusters)
                    call()
                    err = R.rel_error(out, ref)
                    t = bench(call) * 1e3
                    gbs = bytes_moved / t / 1e3
                    print(f"   t{inst.tile_m}x{inst.tile_n} c{inst.cluster_m}x{inst.cluster_n} {inst.accum:8s} {t:7.1f} us "
                          f"{gbs:6.0f} GB/s {100 * gbs / (HBM_TBPS * 1e3):5.1f}% x{t_c / t:5.2f} err {err:.1e}")


if __name__ == "__main__":
    main()
