"""FP8 GEMM benchmark on a Hopper GPU against cuBLAS (torch._scaled_mm) for the same recipe and inputs.

    python -m benchmarks.bench_gemm --sets dsv3,square,llama70b_decode --recipes tensor,row [--out results.json]

Prints one row per shape: our time, cuBLAS time, ratio, TFLOPS, % of the 1979 TFLOPS FP8 roofline, GB/s,
and the relative error of both against the float64 reference; then geomeans per set.
"""

from __future__ import annotations

import argparse

import torch

import cutedsl_gemm
from .common import SETS, FP8_TFLOPS, bench, gbps, geomean, make_operands, tflops, write_json
from cutedsl_gemm import reference as R


def run(sets, recipes, out_path=None, check=True, fast_accum=False):
    rows = []
    print(f"{'set':16s} {'recipe':6s} {'M':>5s} {'N':>5s} {'K':>5s} | {'ours us':>8s} {'cuBLAS us':>9s} {'ratio':>6s} | "
          f"{'TFLOPS':>7s} {'%peak':>6s} {'GB/s':>6s} | {'err':>8s} {'cublas err':>10s} | bf16 us")
    for set_name in sets:
        for (m, n, k) in SETS[set_name]:
            for recipe in recipes:
                qa, qw, sa, sb, plain = make_operands(m, n, k, recipe)
                b = qw.t()
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                ours = lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out_dtype=torch.bfloat16, out=out, use_fast_accum=fast_accum)
                cublas = lambda: torch._scaled_mm(qa, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
                ours()
                ref = R.reference_gemm(*plain, recipe) if check else None
                err = R.rel_error(out, ref) if check else float("nan")
                try:
                    c_out = cublas()
                    c_err = R.rel_error(c_out, ref) if check else float("nan")
                    t_c = bench(cublas) * 1e3
                except RuntimeError as e:  # cuBLAS refuses some recipe/shape pairs
                    c_err, t_c = float("nan"), float("nan")
                t_o = bench(ours) * 1e3
                abf, wbf = qa.to(torch.bfloat16), qw.to(torch.bfloat16)
                t_bf = bench(lambda: torch.matmul(abf, wbf.t())) * 1e3
                tf = tflops(m, n, k, t_o / 1e3)
                row = dict(set=set_name, recipe=recipe, fast_accum=fast_accum, m=m, n=n, k=k, ours_us=t_o, cublas_us=t_c, bf16_us=t_bf,
                           ratio=t_c / t_o, tflops=tf, pct_peak=100 * tf / FP8_TFLOPS, gbps=gbps(m, n, k, t_o / 1e3),
                           err=err, cublas_err=c_err)
                rows.append(row)
                print(f"{set_name:16s} {recipe:6s} {m:5d} {n:5d} {k:5d} | {t_o:8.1f} {t_c:9.1f} {row['ratio']:6.3f} | "
                      f"{tf:7.0f} {row['pct_peak']:5.1f}% {row['gbps']:6.0f} | {err:8.2e} {c_err:10.2e} | {t_bf:.1f}")
    print("\ngeomeans (cuBLAS time / our time; >1 means faster than cuBLAS):")
    for set_name in sets:
        for recipe in recipes:
            sel = [r for r in rows if r["set"] == set_name and r["recipe"] == recipe]
            if sel:
                print(f"  {set_name:16s} {recipe:6s} ratio {geomean([r['ratio'] for r in sel]):.3f}  "
                      f"ours {geomean([r['ours_us'] for r in sel]):.1f} us  cuBLAS {geomean([r['cublas_us'] for r in sel]):.1f} us")
    write_json(out_path, rows)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="square,dsv3,llama70b_decode")
    p.add_argument("--recipes", default="tensor,row")
    p.add_argument("--out", default=None)
    p.add_argument("--fast-accum", action="store_true", help="use_fast_accum=True for both us and cuBLAS")
    args = p.parse_args(argv)
    print(f"use_fast_accum={args.fast_accum}")
    run(args.sets.split(","), args.recipes.split(","), args.out, fast_accum=args.fast_accum)


if __name__ == "__main__":
    main()
