"""Host cost per call: M=1 (tiny GPU work), warm, N back-to-back calls, CPU time per call.

    python -m benchmarks.host_cost [--calls 1000] [--issue-calls 100]

One row per recipe: ``cutedsl_gemm.scaled_mm`` with ``out=`` given and allocating its output, and torch's
call into cuBLAS for the same recipe; then where the time of one call goes (the bare compiled call with a
kept launch plan, the call signature, the scale views, the whole ``scaled_mm``), listed under the table.

Then the FP8 linear path at M=1, N=K=4096 (bf16 activations), each way of calling it measured twice (the
"issue" and "GPU" entries of the summary): the host time to *issue* one call (``--issue-calls`` back-to-back calls
timed without waiting for the GPU, after it drained, so that the launch queue never fills and the GPU never
paces the loop; median of 20 such loops), and the GPU time of one call (one call captured in a CUDA graph and
replayed, timed with CUDA events). A path whose issue time exceeds its GPU time is host-bound in eager mode.
The table goes to benchmarks/results/host_cost.json (``--name``, ``--no-save``: common.write_result).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import cutedsl_gemm
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.ops import scaled_mm as api
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.tools.baselines import cublas_call, make_operands

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


LINEAR_SHAPE = (1, 4096, 4096)


def issue_us(fn, calls, loops=20):
    """Host time to issue one call: ``calls`` back-to-back calls per loop, the GPU drained before each loop and not
    waited on inside it (median over ``loops``)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / calls * 1e6


def gpu_us(fn, replays=200):
    """GPU time of one call: the call captured in a CUDA graph (after a warm-up) and replayed."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def linear_paths(m, n, k):
    """{name: a call} for the ways of running an FP8 linear (and bf16 F.linear) on an (m, k) bf16 input."""
    from cutedsl_gemm import nn as cnn

    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    x3 = x.view(1, m, k)
    layers = {r: cnn.QuantizedLinear.from_linear(linear, r)
              for r in ("row", "tensor", "deepseek", "int8", "int4_weight")}
    row = layers["row"]
    b, sb = row.weight.t(), row.weight_scale
    qa, sa = cutedsl_gemm.quantize_fp8(x, "row")
    op = torch.ops.cutedsl_gemm.fp8_linear
    w = linear.weight.detach()

    def by_hand():
        q, s = cutedsl_gemm.quantize_fp8(x, "row")
        return cutedsl_gemm.scaled_mm(q, b, s, sb)

    paths = {
        "quantize_fp8 row": lambda: cutedsl_gemm.quantize_fp8(x, "row"),
        "scaled_mm row": lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb),
        "quantize_fp8 + scaled_mm by hand": by_hand,
        "QuantizedLinear row 2-D": lambda: row(x),
        "QuantizedLinear row 3-D": lambda: row(x3),
        "torch.ops.cutedsl_gemm.fp8_linear row": lambda: op(x, row.weight, sb, None, None, "row"),
    }
    for r in ("tensor", "deepseek", "int8", "int4_weight"):
        paths[f"QuantizedLinear {r} 2-D"] = lambda layer=layers[r]: layer(x)
    paths["bf16 F.linear"] = lambda: torch.nn.functional.linear(x, w)
    return paths


def linear_costs(issue_calls):
    """{f"{what} {name}": us} for every path of ``linear_paths``, printed."""
    m, n, k = LINEAR_SHAPE
    print(f"FP8 linear at M={m} N={n} K={k}: host time to issue one call | GPU time of one call (CUDA graph)")
    out = {}
    with torch.no_grad():
        paths = linear_paths(m, n, k)
        width = max(map(len, paths))
        for name, fn in paths.items():
            host, gpu = issue_us(fn, issue_calls), gpu_us(fn)
            print(f"  {name:{width}s} {host:6.1f} us | {gpu:6.1f} us")
            out[f"M={m} N=K={k} issue: {name}"] = round(host, 2)
            out[f"M={m} N=K={k} GPU: {name}"] = round(gpu, 2)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--issue-calls", type=int, default=100,
                   help="calls per timed loop of the issue-time measurement (few enough not to fill the launch queue)")
    common.add_result_options(p, "host_cost")
    args = p.parse_args(argv)
    common.require_gpu("host_cost")
    m, n, k = SHAPE
    print(f"host cost per call, M={m} N={n} K={k}, {args.calls} back-to-back calls (CPU time / call):")
    steps = breakdown(m, n, k, args.calls)
    steps.update(linear_costs(args.issue_calls))
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
                       notes=f"warm; {args.calls} back-to-back calls timed with time.perf_counter; summary 'issue': "
                             f"host time to issue one call ({args.issue_calls} calls per loop, GPU drained before "
                             "each loop, median of 20), 'GPU': one call captured in a CUDA graph and replayed; "
                             "torch (cuBLAS): torch._scaled_mm / F.scaled_mm, empty where cuBLAS refuses M=1; "
                             "ratio = torch us / scaled_mm us (out given)")


if __name__ == "__main__":
    main()
