"""Tile/cluster sweep on a Hopper GPU: candidate configurations (not necessarily in the manifest) on the
same data, next to cuBLAS for the same recipe. The manifest's rows are chosen from what this prints.

    python -m benchmarks.tune_tiles --ms 1,16,64,128 --nk 8192x8192          (decode: GB/s matters)
    python -m benchmarks.tune_tiles --ms 8192 --nk 8192x8192 --tiles 128x128c2x1,128x192c2x1 --accums promoted
"""

from __future__ import annotations

import argparse
import itertools

import torch

from cutedsl_gemm import api, reference as R
from cutedsl_gemm.generators.manifest import KernelInstance
from .common import HBM_TBPS, bench, cublas_call, make_operands


DEFAULT_TILES = "128x64c1x1,128x64c1x2,128x64c2x1,128x128c1x1,128x128c1x2,128x128c2x1"


class _NoSplit(KernelInstance):
    """A candidate compiled without the split-K reduction (to measure what carrying it costs)."""

    @property
    def can_split_k(self):
        return False


def candidates(recipe, tiles, accums, split_variants=(True,)):
    accs = [a for a in accums if a == "promoted" or "x128" not in recipe]
    for tile, accum, split in itertools.product(tiles, accs, split_variants):
        t, c = tile.split("c")
        (tile_m, tile_n), (cm, cn) = map(int, t.split("x")), map(int, c.split("x"))
        cls = KernelInstance if split else _NoSplit
        yield cls("sm_90a", "gemm", "tune" if split else "tune_nosplit", recipe, "e4m3", "e4m3", "bf16", None,
                  tile_m, tile_n, cm, cn, 0, accum)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,16,64,128")
    p.add_argument("--nk", default="8192x8192")
    p.add_argument("--recipes", default="row,1x128_128x128")
    p.add_argument("--tiles", default=DEFAULT_TILES, help="TMxTNcCMxCN,...")
    p.add_argument("--accums", default="promoted,fast")
    p.add_argument("--split-variants", action="store_true", help="also build each candidate without split-K")
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
                tflops = lambda t: 2 * m * n * k / t / 1e6
                print(f"{recipe} M={m} N={n} K={k}: cuBLAS {t_c:.1f} us ({bytes_moved / t_c / 1e3:.0f} GB/s, {tflops(t_c):.0f} TFLOPS)")
                variants = (True, False) if args.split_variants else (True,)
                for inst in candidates(recipe, args.tiles.split(","), args.accums.split(","), variants):
                    fn = api._compiled(inst)
                    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    clusters = sms // (inst.cluster_m * inst.cluster_n)
                    dummy = api._workspace(0).get(1, 1)
                    call = lambda: fn(qa, b, out, sa_k, sb_k, api._dummy_bias(0), *dummy, 1, clusters)
                    call()
                    err = R.rel_error(out, ref)
                    t = bench(call) * 1e3
                    gbs = bytes_moved / t / 1e3
                    print(f"   {inst.schedule:13s} t{inst.tile_m}x{inst.tile_n} c{inst.cluster_m}x{inst.cluster_n} {inst.accum:8s} {t:7.1f} us "
                          f"{gbs:6.0f} GB/s {100 * gbs / (HBM_TBPS * 1e3):5.1f}% {tflops(t):6.0f} TFLOPS x{t_c / t:5.2f} err {err:.1e}")


if __name__ == "__main__":
    main()
