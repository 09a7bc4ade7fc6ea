"""Markdown tables from the JSON that bench_gemm writes (so BENCHMARKS.md is generated, not transcribed).

    python -m benchmarks.report gemm_promoted.json gemm_fast.json gemm_block.json [--e2e e2e.json]
"""

from __future__ import annotations

import argparse
import json

from .common import geomean


def _f(x, fmt):
    return "n/a" if x is None or x != x else format(x, fmt)


def geomean_table(files):
    print("| set | recipe | use_fast_accum | geomean cuBLAS / ours | ours geomean us | cuBLAS geomean us |")
    print("|---|---|---|---|---|---|")
    for path in files:
        rows = json.load(open(path))
        for key in dict.fromkeys((r["set"], r["recipe"], r["fast_accum"]) for r in rows):
            sel = [r for r in rows if (r["set"], r["recipe"], r["fast_accum"]) == key]
            ratio = geomean([r["ratio"] for r in sel if r["ratio"] == r["ratio"]])
            print(f"| {key[0]} | {key[1]} | {key[2]} | {_f(ratio, '.3f')} | {geomean([r['ours_us'] for r in sel]):.1f} | "
                  f"{_f(geomean([r['cublas_us'] for r in sel if r['cublas_us'] == r['cublas_us']]), '.1f')} |")


def shape_table(path):
    rows = json.load(open(path))
    print("| set | recipe | M | N | K | ours us | cuBLAS us | ratio | TFLOPS | % of 1979 | GB/s | rel err (ours / cuBLAS) | bf16 us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['recipe']} | {r['m']} | {r['n']} | {r['k']} | {r['ours_us']:.1f} | {_f(r['cublas_us'], '.1f')} | "
              f"{_f(r['ratio'], '.3f')} | {r['tflops']:.0f} | {r['pct_peak']:.1f}% | {r['gbps']:.0f} | "
              f"{r['err']:.2e} / {_f(r['cublas_err'], '.2e')} | {r['bf16_us']:.1f} |")


def e2e_table(path):
    rows = json.load(open(path))
    print("| M | N | K | quantize_fp8 + scaled_mm us | torch quantize + F.scaled_mm us | speedup | err ours / torch |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['m']} | {r['n']} | {r['k']} | {r['ours_us']:.1f} | {r['torch_cublas_us']:.1f} | {r['ratio']:.2f} | "
              f"{r['err']:.2e} / {r['torch_err']:.2e} |")
    print(f"\ngeomean speedup {geomean([r['ratio'] for r in rows]):.2f}")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("gemm", nargs="*")
    p.add_argument("--e2e", default=None)
    p.add_argument("--shapes", action="store_true", help="also the per-shape tables")
    args = p.parse_args(argv)
    if args.gemm:
        geomean_table(args.gemm)
        if args.shapes:
            for path in args.gemm:
                print(f"\n#### {path}\n")
                shape_table(path)
    if args.e2e:
        print()
        e2e_table(args.e2e)


if __name__ == "__main__":
    main()
