"""Host cost per call: M=1 (tiny GPU work), warm, N back-to-back calls, CPU time per call.

    python -m benchmarks.host_cost [--calls 1000]

One row per recipe: ``cutedsl_gemm.scaled_mm`` with ``out=`` given and allocating its output, and torch's
call into cuBLAS for the same recipe; then where the time of one call goes (the bare compiled call with a
kept launch plan, the call signature, the scale views, the whole ``scaled_mm``), listed under the table.
The table goes to benchmarks/results/host_cost.json (``--name``, ``--no-save``: common.write_result).
"""

from __future__ import annotations

import argparse
import time

import torch

import cutedsl_gemm
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.ops import scaled_mm as api
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.tools.anchors import cublas_call, make_operands

from . import common

SHAPE = (1, 512, 256)
RECIPES = ("tensor", "row", "1x128_128x128")


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


def signature(qa, b, sa, sb):
    """The call signature ``scaled_mm`` keys its plans by, for a call with default arguments."""
    return api.call_signature(qa, b, sa, sb, None, torch.bfloat16, False, None, None, None, None)


def repeated_call(m, n, k, recipe, out):
    """Operands of one recipe and what scaled_mm kept for their call signature: (launch plan, recipe,
    K blocks, output shape)."""
    qa, qw, sa, sb, _ = make_operands(m, n, k, recipe)
    b = qw.t()
    cutedsl_gemm.scaled_mm(qa, b, sa, sb, out=out)  # validates, compiles, records the plan
    kept = api.cached_plan(signature(qa, b, sa, sb))
    if kept is None:
        raise RuntimeError(f"scaled_mm kept no plan for a repeated {recipe} call")
    return (qa, b, sa, sb), kept


def timed(label, fns, calls):
    """{f"{label}: {name}": us per call}, printed."""
    print(label)
    width = max(map(len, fns))
    out = {}
    for name, fn in fns.items():
        us = per_call_us(fn, calls)
        print(f"  {name:{width}s} {us:6.2f} us")
        out[f"{label}: {name}"] = round(us, 2)
    return out


def breakdown(m, n, k, calls):
    """Where the time of one call goes, per step; {step: us per call}."""
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    (qa, b, sa, sb), (lp, recipe, kb, _) = repeated_call(m, n, k, "row", out)
    steps = timed("row, out given", {
        "launch only (kept plan)": lambda: launch.run(lp, qa, b, out, sa, sb, None),
        "signature": lambda: signature(qa, b, sa, sb),
        "scale views": lambda: scale_layouts.kernel_views(recipe, kb, sa, sb),
        "scaled_mm": lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out=out),
    }, calls)

    # What allocating the output costs (scaled_mm without out=), by the ways torch offers.
    dev = qa.device
    steps.update(timed(f"allocating a {tuple(out.shape)} bf16 output", {
        "torch.empty(shape, dtype, device=a.device)": lambda: torch.empty((m, n), dtype=torch.bfloat16,
                                                                          device=qa.device),
        "torch.empty(shape, dtype, device=kept device)": lambda: torch.empty((m, n), dtype=torch.bfloat16, device=dev),
        "a.new_empty(shape, dtype)": lambda: qa.new_empty((m, n), dtype=torch.bfloat16),
    }, calls))

    # Per-tensor: the kernel takes (1,) scale views of torch's 0-dim scales. Does handing TVM-FFI a view
    # made in the call cost more than one kept from an earlier call?
    (qa, b, sa, sb), (lp, recipe, kb, _) = repeated_call(m, n, k, "tensor", out)
    sa1, sb1 = scale_layouts.kernel_views(recipe, kb, sa, sb)
    fn, dummy, idle, splits, clusters = lp.fn, lp.dummy_bias, lp.idle_ws, lp.splits, lp.max_clusters
    steps.update(timed("tensor, out given", {
        "compiled call, kept (1,) views": lambda: fn(qa, b, out, sa1, sb1, dummy, *idle, splits, clusters),
        "compiled call, views made per call": lambda: fn(qa, b, out, sa[None], sb[None], dummy, *idle, splits,
                                                         clusters),
        "signature": lambda: signature(qa, b, sa, sb),
        "scale views": lambda: scale_layouts.kernel_views(recipe, kb, sa, sb),
        "scaled_mm": lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out=out),
    }, calls))
    return steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=1000)
    common.add_result_options(p, "host_cost")
    args = p.parse_args(argv)
    m, n, k = SHAPE
    print(f"host cost per call, M={m} N={n} K={k}, {args.calls} back-to-back calls (CPU time / call):")
    steps = breakdown(m, n, k, args.calls)
    rows = []
    for recipe in RECIPES:
        qa, qw, sa, sb, _ = make_operands(m, n, k, recipe)
        b = qw.t()
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        ours = per_call_us(lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out=out), args.calls)  # noqa: B023
        ours_alloc = per_call_us(lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb), args.calls)  # noqa: B023
        try:
            theirs = per_call_us(cublas_call(recipe, qa, b, sa, sb), args.calls)
        except (RuntimeError, ValueError):  # cuBLAS blockwise refuses M=1
            theirs = float("nan")
        print(f"  {recipe:13s}: cutedsl_gemm.scaled_mm {ours:6.1f} us (out given) {ours_alloc:6.1f} us (allocating) | "
              f"torch (cuBLAS) {theirs:6.1f} us")
        rows.append([recipe, round(ours, 2), round(ours_alloc, 2), round(theirs, 2), round(theirs / ours, 2)])
    columns = ["recipe", "scaled_mm us (out given)", "scaled_mm us (allocating)", "torch (cuBLAS) us", "ratio"]
    common.save_result(args, "host_cost", f"Host cost per call (CPU time), M={m} N={n} K={k}", columns, rows,
                       summary=steps,
                       notes=f"warm; {args.calls} back-to-back calls timed with time.perf_counter; "
                             "torch (cuBLAS): torch._scaled_mm / F.scaled_mm, empty where cuBLAS refuses M=1; "
                             "ratio = torch us / scaled_mm us (out given)")


if __name__ == "__main__":
    main()
