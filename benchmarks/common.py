"""Shared benchmark plumbing: operand generation per recipe, timing, rooflines, table output."""

from __future__ import annotations

import json
import math
import statistics

import torch

from cutedsl_gemm import reference as R

FP8_TFLOPS = 1979.0  # H100 SXM dense FP8
HBM_TBPS = 3.0  # achievable (measured 3.0-3.06 TB/s on the lent H100)

SETS = {
    "dsv3": [(m, n, k) for m in (1024, 6144) for (n, k) in (
        (1536, 7168), (3072, 1536), (576, 7168), (7168, 256), (7168, 2048),
        (4608, 7168), (7168, 2304), (512, 7168), (4096, 512))],
    "llama70b_decode": [(m, 8192, 8192) for m in (1, 16, 32, 64, 128)],
    "llama70b_layers": [(m, n, k) for (n, k) in ((10240, 8192), (57344, 8192), (8192, 28672)) for m in (1, 16, 64)],
    "square": [(4096, 4096, 4096), (8192, 8192, 8192)],
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


def bench(fn, warmup=25, rep=100):
    """Median time in ms (triton do_bench: CUDA events, L2 flushed before each run)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


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
