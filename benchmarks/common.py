"""Shared benchmark plumbing: operand generation per recipe, timing, rooflines, table output."""

from __future__ import annotations

import json
import math
import statistics

import torch

from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.numerics import reference as R

FP8_TFLOPS = 1979.0  # H100 SXM dense FP8
HBM_TBPS = 3.0  # achievable (measured 3.0-3.06 TB/s on the lent H100)

SETS = {
    "dsv3": [(m, n, k) for m in (1024, 6144) for (n, k) in (
        (1536, 7168), (3072, 1536), (576, 7168), (7168, 256), (7168, 2048),
        (4608, 7168), (7168, 2304), (512, 7168), (4096, 512))],
    "llama70b_decode": [(m, 8192, 8192) for m in (1, 16, 32, 64, 128)],
    "llama70b_layers": [(m, n, k) for (n, k) in ((10240, 8192), (57344, 8192), (8192, 28672)) for m in (1, 16, 64)],
    "square": [(4096, 4096, 4096), (8192, 8192, 8192)],
    # LLM shapes where dispatch.wave_cost ties 128x192 with 128x128 for the block-W recipes (session 20): eight
    # at K >= dispatch.LONG_K, where 128x192 wins the tie, two at K = 4096 and two at K = 1536, where 128x128
    # keeps it for the 2D recipe (the DeepSeek recipe takes 128x192 at every K since session 25)
    "block_ties": [(768, 8192, 8192), (1024, 4608, 7168), (1024, 6144, 4096), (1536, 8192, 8192), (1536, 4096, 14336),
                   (2048, 6144, 4096), (3072, 8192, 8192), (4096, 1536, 7168), (6144, 8192, 8192), (8192, 4608, 7168),
                   (2048, 3072, 1536), (6144, 3072, 1536)],
}


def make_operands(m, n, k, recipe, device="cuda", fmt_a="e4m3", fmt_b="e4m3"):
    """Random data quantized with the reference quantizer; scales in the layouts torch takes for the recipe
    (torch._scaled_mm for tensor/row, F.scaled_mm's BlockWise1x128 / BlockWise128x128 otherwise)."""
    a = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device)
    qa, sa_plain, qw, sw_plain = R.quantize_operands(a, w, recipe, fmt_a, fmt_b)
    if recipe == "tensor":
        sa, sb = sa_plain.reshape(()), sw_plain.reshape(())
    elif recipe == "row":  # (M, 1) x (1, N)
        sa, sb = sa_plain.reshape(m, 1).contiguous(), sw_plain.reshape(1, n).contiguous()
    else:
        sa, sb = torch_block_layout(sa_plain, recipe.split("_")[0]), torch_block_layout(sw_plain, recipe.split("_")[1]).t()
    return qa, qw, sa, sb, (qa, sa_plain, qw, sw_plain)


def torch_block_layout(s, gran):
    """(rows or row blocks, Kb) scales in F.scaled_mm's layout: 1x128 outer-dim-major, 128x128 with the
    K-block axis padded to a multiple of 4 (the padded tensor is what cuBLAS takes)."""
    if gran == "1x128":
        rows, kb = s.shape  # strides exactly (1, rows), as F.scaled_mm checks them (also for rows == 1)
        return torch.empty_strided((rows, kb), (1, rows), device=s.device).copy_(s)
    kb = s.shape[1]
    padded = torch.ones(s.shape[0], -(-kb // 4) * 4, device=s.device)
    padded[:, :kb] = s
    return padded


SCALING_TYPES = {"1x128": "BlockWise1x128", "128x128": "BlockWise128x128"}


def cublas_call(recipe, qa, b, sa, sb, use_fast_accum=False, bias=None):
    """cuBLAS through torch for the same recipe: torch._scaled_mm, or F.scaled_mm for block scales."""
    if recipe in ("tensor", "row"):
        return lambda: torch._scaled_mm(qa, b, sa, sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)
    import torch.nn.functional as F

    ga, gb = (getattr(F.ScalingType, SCALING_TYPES[g]) for g in recipe.split("_"))
    return lambda: F.scaled_mm(qa, b, sa, ga, sb, gb, bias=bias, output_dtype=torch.bfloat16)


def dispatched(recipe, m, n, k, sms):
    """(instance, K splits, clusters to launch) as ``scaled_mm`` picks them on device 0."""
    inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, "promoted", None, n=n, sms=sms, k=k)
    clusters = launch.launch_clusters(0, inst)
    inst, splits = dispatch.plan_splits(inst, m, n, k, clusters * inst.cluster_m * inst.cluster_n)
    return inst, splits, clusters


FLUSH = "read"  # how bench() empties the L2 before each timed run: "read" | "zero" (see bench)
_flush_buffer = None


def bench(fn, warmup=25, rep=100, flush=None):
    """Median time in ms of ``fn``: warm, CUDA events around each run, the L2 emptied before each run.

    ``flush="read"`` (default) evicts the L2 by reading a 256 MiB buffer, so it holds only clean lines.
    ``flush="zero"`` is triton's ``do_bench``, which evicts it by *writing* 256 MiB: the L2 is then full
    of dirty lines that the timed kernel has to write back to HBM as it streams its inputs in. That costs
    any memory-bound kernel ~15 us (a read-only pass over 64 MiB: 38.7 us after a zero flush, against
    ~22 us at the measured 3.06 TB/s), which is an artefact of the flush, not of the kernel.
    """
    flush = flush or FLUSH
    if flush == "zero":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    evict = lambda: torch.amax(_flush_buffer)
    fn()
    torch.cuda.synchronize()
    # Size the run by time, as do_bench does.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        evict()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    n = max(1, int(rep / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        evict()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def tflops(m, n, k, ms):
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def gbps(m, n, k, ms, out_bytes=2):
    return (m * k + n * k + m * n * out_bytes) / (ms * 1e-3) / 1e9


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def write_json(path, rows):
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
