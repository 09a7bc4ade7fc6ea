"""Host cost per call: M=1 (tiny GPU work), warm, N back-to-back calls, CPU time per call.

    python -m benchmarks.host_cost [--calls 1000]
"""

from __future__ import annotations

import argparse
import time

import torch

import cutedsl_gemm
from .common import cublas_call, make_operands


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=1000)
    args = p.parse_args(argv)
    m, n, k = 1, 512, 256
    print(f"host cost per call, M={m} N={n} K={k}, {args.calls} back-to-back calls (CPU time / call):")
    for recipe in ("tensor", "row", "1x128_128x128"):
        qa, qw, sa, sb, _ = make_operands(m, n, k, recipe)
        b = qw.t()
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        ours = per_call_us(lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out=out), args.calls)
        ours_alloc = per_call_us(lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb), args.calls)
        try:
            theirs = per_call_us(cublas_call(recipe, qa, b, sa, sb), args.calls)
        except (RuntimeError, ValueError):  # cuBLAS blockwise refuses M=1
            theirs = float("nan")
        print(f"  {recipe:13s}: cutedsl_gemm.scaled_mm {ours:6.1f} us (out given) {ours_alloc:6.1f} us (allocating) | "
              f"torch (cuBLAS) {theirs:6.1f} us")


if __name__ == "__main__":
    main()
