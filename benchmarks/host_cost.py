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


def _repeated_call(m, n, k, recipe, out):
    """Operands of one recipe and the plan scaled_mm recorded for their call signature."""
    from cutedsl_gemm.ops import scaled_mm as api

    qa, qw, sa, sb, _ = make_operands(m, n, k, recipe)
    b = qw.t()
    cutedsl_gemm.scaled_mm(qa, b, sa, sb, out=out)  # validates, compiles, records the plan
    sig = api.call_signature(qa, b, sa, sb, None, torch.bfloat16, False, None, None, None, None)
    return (qa, b, sa, sb), api.cached_plan(sig)


def _print_rows(title, rows, calls):
    print(title)
    width = max(map(len, rows))
    for name, fn in rows.items():
        print(f"  {name:{width}s} {per_call_us(fn, calls):6.2f} us")


def breakdown(m, n, k, calls):
    """Where the time of one call goes: the bare compiled call (TVM-FFI, prebuilt arguments), the call
    signature, the scale views, and the whole scaled_mm."""
    from cutedsl_gemm.numerics import scale_layouts
    from cutedsl_gemm.ops import scaled_mm as api
    from cutedsl_gemm.runtime import launch

    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    sig_of = lambda qa, b, sa, sb: api.call_signature(qa, b, sa, sb, None, torch.bfloat16, False, None, None, None,
                                                      None)

    (qa, b, sa, sb), plan = _repeated_call(m, n, k, "row", out)
    plan, recipe, kb, _ = plan
    _print_rows("breakdown (row recipe, out given):", {
        "launch only (kept plan)": lambda: launch.run(plan, qa, b, out, sa, sb, None),
        "signature": lambda: sig_of(qa, b, sa, sb),
        "scale views": lambda: scale_layouts.kernel_views(recipe, kb, sa, sb),
        "scaled_mm": lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out=out),
    }, calls)

    # What allocating the output costs (scaled_mm without out=), by the ways torch offers.
    dev = qa.device
    _print_rows("allocating a (1, 512) bf16 output:", {
        "torch.empty(shape, dtype, device=a.device)": lambda: torch.empty((m, n), dtype=torch.bfloat16, device=qa.device),
        "torch.empty(shape, dtype, device=kept device)": lambda: torch.empty((m, n), dtype=torch.bfloat16, device=dev),
        "a.new_empty(shape, dtype)": lambda: qa.new_empty((m, n), dtype=torch.bfloat16),
    }, calls)

    # Per-tensor: the kernel takes (1,) scale views of torch's 0-dim scales. Does handing TVM-FFI a view
    # made in the call cost more than one kept from an earlier call?
    (qa, b, sa, sb), plan = _repeated_call(m, n, k, "tensor", out)
    fn, clusters, recipe, kb, dummy, _, splits, need, _, idle = plan
    sa1, sb1 = scale_layouts.kernel_views(recipe, kb, sa, sb)
    _print_rows("breakdown (per-tensor recipe, out given):", {
        "compiled call, kept (1,) views": lambda: fn(qa, b, out, sa1, sb1, dummy, *idle, splits, clusters),
        "compiled call, views made per call": lambda: fn(qa, b, out, sa[None], sb[None], dummy, *idle, splits, clusters),
        "signature": lambda: sig_of(qa, b, sa, sb),
        "scale views": lambda: scale_layouts.kernel_views(recipe, kb, sa, sb),
        "scaled_mm": lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out=out),
    }, calls)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=1000)
    args = p.parse_args(argv)
    m, n, k = 1, 512, 256
    print(f"host cost per call, M={m} N={n} K={k}, {args.calls} back-to-back calls (CPU time / call):")
    breakdown(m, n, k, args.calls)
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
