"""FP8 GEMM benchmark on a Hopper GPU against cuBLAS (torch._scaled_mm) for the same recipe and inputs.

    python -m benchmarks.bench_gemm --sets dsv3,square,llama70b_decode --recipes tensor,row [--out results.json]
    python -m benchmarks.bench_gemm --sets dsv3,square --recipes 1x128_128x128,128x128_128x128
    python -m benchmarks.bench_gemm --e2e      (bf16 activations in: quantize + GEMM, ours vs torch + cuBLAS)

Prints one row per shape: our time, cuBLAS time, ratio, TFLOPS, % of the 1979 TFLOPS FP8 roofline, GB/s,
and the relative error of both against the float64 reference; then geomeans per set.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import cutedsl_gemm
from . import common
from .common import SETS, FP8_TFLOPS, bench, cublas_call, gbps, geomean, make_operands, tflops, write_json
from cutedsl_gemm.numerics import reference as R


def run(sets, recipes, out_path=None, check=True, fast_accum=False, shapes=None):
    rows = []
    if shapes:
        SETS["custom"] = shapes
        sets = ["custom"]
    print(f"{'set':16s} {'recipe':15s} {'M':>5s} {'N':>5s} {'K':>5s} | {'ours us':>8s} {'cuBLAS us':>9s} {'ratio':>6s} | "
          f"{'TFLOPS':>7s} {'%peak':>6s} {'GB/s':>6s} | {'err':>8s} {'cublas err':>10s} | bf16 us")
    for set_name in sets:
        for (m, n, k) in SETS[set_name]:
            for recipe in recipes:
                qa, qw, sa, sb, plain = make_operands(m, n, k, recipe)
                b = qw.t()
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                ours = lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out_dtype=torch.bfloat16, out=out, use_fast_accum=fast_accum)
                cublas = cublas_call(recipe, qa, b, sa, sb, fast_accum)
                ours()
                ref = R.reference_gemm(*plain, recipe) if check else None
                err = R.rel_error(out, ref) if check else float("nan")
                try:
                    c_out = cublas()
                    c_err = R.rel_error(c_out, ref) if check else float("nan")
                    t_c = bench(cublas) * 1e3
                except (RuntimeError, ValueError):  # cuBLAS refuses some recipe/shape pairs (e.g. 128x128 x 128x128)
                    c_err, t_c = float("nan"), float("nan")
                t_o = bench(ours) * 1e3
                abf, wbf = qa.to(torch.bfloat16), qw.to(torch.bfloat16)
                t_bf = bench(lambda: torch.matmul(abf, wbf.t())) * 1e3
                tf = tflops(m, n, k, t_o / 1e3)
                row = dict(set=set_name, recipe=recipe, fast_accum=fast_accum, m=m, n=n, k=k, ours_us=t_o, cublas_us=t_c, bf16_us=t_bf,
                           ratio=t_c / t_o, tflops=tf, pct_peak=100 * tf / FP8_TFLOPS, gbps=gbps(m, n, k, t_o / 1e3),
                           err=err, cublas_err=c_err)
                rows.append(row)
                print(f"{set_name:16s} {recipe:15s} {m:5d} {n:5d} {k:5d} | {t_o:8.1f} {t_c:9.1f} {row['ratio']:6.3f} | "
                      f"{tf:7.0f} {row['pct_peak']:5.1f}% {row['gbps']:6.0f} | {err:8.2e} {c_err:10.2e} | {t_bf:.1f}")
    print("\ngeomeans (cuBLAS time / our time; >1 means faster than cuBLAS):")
    for set_name in sets:
        for recipe in recipes:
            sel = [r for r in rows if r["set"] == set_name and r["recipe"] == recipe]
            if sel:
                print(f"  {set_name:16s} {recipe:15s} ratio {geomean([r['ratio'] for r in sel]):.3f}  "
                      f"ours {geomean([r['ours_us'] for r in sel]):.1f} us  cuBLAS {geomean([r['cublas_us'] for r in sel]):.1f} us")
    write_json(out_path, rows)
    return rows


def torch_quantize_1x128(x):
    """What a torch user writes today: per-(row, 128-column group) amax, scale, cast (F.scaled_mm layout)."""
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    scale = (g.abs().amax(dim=2) / 448.0).clamp_min(1e-12)
    q = (g / scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)
    return q, scale.t().contiguous().t()


def run_e2e(shapes, out_path=None):
    """bf16 activations in, bf16 out, weights pre-quantized (128x128): quantize_fp8 + scaled_mm against
    torch quantization + F.scaled_mm (cuBLAS), same data."""
    rows = []
    print(f"{'M':>5s} {'N':>5s} {'K':>5s} | {'ours us':>8s} {'torch+cuBLAS us':>15s} {'ratio':>6s} | {'err':>8s} {'torch err':>9s}")
    for (m, n, k) in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        qw, sw = cutedsl_gemm.quantize_fp8(w, "128x128", scale_layout="padded")
        sw_b = sw.t()  # (round_up(Kb, 4), ceil(N/128)): cuBLAS's padded BlockWise128x128 operand

        def _ours():
            qx, sx = cutedsl_gemm.quantize_fp8(x, "1x128")
            return cutedsl_gemm.scaled_mm(qx, qw.t(), sx, sw_b)

        def _theirs():
            qx, sx = torch_quantize_1x128(x)
            return F.scaled_mm(qx, qw.t(), sx, F.ScalingType.BlockWise1x128, sw_b, F.ScalingType.BlockWise128x128,
                               output_dtype=torch.bfloat16)

        ref = x.double() @ w.double().t()
        err, t_err = R.rel_error(_ours(), ref), R.rel_error(_theirs(), ref)
        t_o, t_t = bench(_ours) * 1e3, bench(_theirs) * 1e3
        rows.append(dict(m=m, n=n, k=k, ours_us=t_o, torch_cublas_us=t_t, ratio=t_t / t_o, err=err, torch_err=t_err))
        print(f"{m:5d} {n:5d} {k:5d} | {t_o:8.1f} {t_t:15.1f} {t_t / t_o:6.3f} | {err:8.2e} {t_err:9.2e}")
    print(f"geomean ratio {geomean([r['ratio'] for r in rows]):.3f}")
    write_json(out_path, rows)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", default="square,dsv3,llama70b_decode")
    p.add_argument("--recipes", default="tensor,row")
    p.add_argument("--out", default=None)
    p.add_argument("--fast-accum", action="store_true", help="use_fast_accum=True for both us and cuBLAS")
    p.add_argument("--shapes", default=None, help="MxNxK,... instead of the named sets")
    p.add_argument("--e2e", action="store_true", help="quantize + GEMM end to end (DeepSeek recipe, M >= 1024)")
    p.add_argument("--flush", default=common.FLUSH, choices=("read", "zero"), help="L2 eviction before each run (common.bench)")
    args = p.parse_args(argv)
    common.FLUSH = args.flush
    if args.e2e:
        run_e2e([(m, n, k) for (m, n, k) in SETS["dsv3"] if k % 128 == 0] + [(8192, 8192, 8192)], args.out)
        return
    print(f"use_fast_accum={args.fast_accum}")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else None
    run(args.sets.split(","), args.recipes.split(","), args.out, fast_accum=args.fast_accum, shapes=shapes)


if __name__ == "__main__":
    main()
