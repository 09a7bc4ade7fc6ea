"""FP8 quantization benchmark on a Hopper GPU: CuTe DSL kernels against the torch reference quantizer.

    python -m benchmarks.bench_quantize [--shape 8192x8192[,MxK...]] [--dtype bf16] [--fmt e4m3]
                                        [--check cpu|gpu] [--out quant.json]

One row per recipe: our time, the torch reference (cutedsl_gemm.numerics.reference.quantize on the GPU) time and
the speed-up, effective bandwidth (bytes read + written, scales included) and % of the 3.0 TB/s HBM
bandwidth measured on the lent H100, plus whether our output equals the reference bit for bit (NaN codes
compared as NaN; ``--check cpu``, the default, runs that reference on the CPU). A last row times torch's
plain ``x.to(float8)`` (no scaling, same bytes moved) as a bandwidth yardstick.
Target (issue 3): >= 80% of 3.0 TB/s for 1x128 and 128x128 on 8192x8192 bf16.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import HBM_TBPS, write_json
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import element_format
from cutedsl_gemm.ops.quantize import _Blocks, quantize_fp8, resolve_granularity

# (label, recipe, block, scale_layout)
CASES = [
    ("tensor", "tensor", 128, None),
    ("row", "row", 128, None),
    ("1x128", "1x128", 128, "mn_major"),
    ("1x128 row-major", "1x128", 128, "row_major"),
    ("128x128", "128x128", 128, "row_major"),
    ("128x128 padded", "128x128", 128, "padded"),
    ("256x256", "256x256", 256, "row_major"),
]
TARGETS = {"1x128", "128x128"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench(fn, warmup=25, rep=100):
    """Median ms: benchmarks.common.bench (L2 emptied by reads before each run) where available, else CUDA events + flush."""
    try:
        from benchmarks.common import bench as do_bench

        return do_bench(fn, warmup=warmup, rep=rep)
    except ImportError:
        pass
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _equal(q, s, qr, sr, fmt):
    nanq = (q.view(torch.uint8) & 0x7F) == 0x7F if fmt.name == "e4m3" else (q.view(torch.uint8) & 0x7F) > 0x7C
    nanr = (qr.view(torch.uint8) & 0x7F) == 0x7F if fmt.name == "e4m3" else (qr.view(torch.uint8) & 0x7F) > 0x7C
    same_q = torch.equal(nanq, nanr) and not ((q.view(torch.uint8) != qr.view(torch.uint8)) & ~nanr).any()
    same_s = s.shape == sr.shape and torch.equal(s.contiguous().view(torch.int32), sr.contiguous().view(torch.int32))
    return bool(same_q and same_s)


def run(m, k, dtype, fmt_name, check="cpu"):
    fmt = element_format(fmt_name)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    # the reference for the bit-exact column: on the CPU (IEEE fp32 division for sure) or on the GPU
    xc = x.cpu() if check == "cpu" else x
    in_bytes = x.element_size() * m * k
    rows = []
    hdr = (f"{'recipe':16s} | {'ours us':>8s} {'torch us':>9s} {'speedup':>7s} | {'GB/s':>7s} {'%3.0TB/s':>8s} | "
           f"{'bit-exact':>9s}")
    print(f"quantize {m}x{k} {str(dtype).replace('torch.', '')} -> {fmt.name}")
    print(hdr)
    print("-" * len(hdr))
    for label, recipe, block, layout in CASES:
        ours = lambda: quantize_fp8(x, recipe, fmt=fmt, block=block, scale_layout=layout, backend="kernel")
        q, s = ours()  # compile + warm
        torch.cuda.synchronize()
        gran = resolve_granularity(recipe)
        g = _Blocks(block, block) if block != 128 else gran
        ref = lambda: R.quantize(x, g, fmt)
        # the torch reference in the same layout, for the bit-exact column
        qr, sr = quantize_fp8(xc, recipe, fmt=fmt, block=block, scale_layout=layout, backend="reference")
        exact = _equal(q.to(xc.device), s.to(xc.device), qr, sr, fmt)
        t_ours = bench(ours) * 1e3
        try:
            t_ref = bench(ref) * 1e3
        except torch.cuda.OutOfMemoryError:
            t_ref = float("nan")
        moved = in_bytes + q.numel() + s.numel() * 4
        gbs = moved / (t_ours * 1e-6) / 1e9
        pct = 100.0 * gbs / (HBM_TBPS * 1e3)
        flag = " <- target 80%" if label in TARGETS else ""
        print(f"{label:16s} | {t_ours:8.1f} {t_ref:9.1f} {t_ref / t_ours:7.2f} | {gbs:7.0f} {pct:7.1f}% | "
              f"{str(exact):>9s}{flag}")
        rows.append(dict(recipe=label, m=m, k=k, dtype=str(dtype), fmt=fmt.name, block=block, scale_layout=layout,
                         ours_us=t_ours, torch_us=t_ref, speedup=t_ref / t_ours if t_ours else math.nan,
                         bytes=moved, gbps=gbs, pct_of_3tbps=pct, bit_exact=exact,
                         meets_target=(pct >= 80.0) if label in TARGETS else None))
    t_cast = bench(lambda: x.to(fmt.torch_dtype)) * 1e3
    gbs = (in_bytes + x.numel()) / (t_cast * 1e-6) / 1e9
    pct = 100.0 * gbs / (HBM_TBPS * 1e3)
    print(f"{'torch x.to(fp8)':16s} | {t_cast:8.1f} {'':>9s} {'':>7s} | {gbs:7.0f} {pct:7.1f}% | "
          f"{'n/a':>9s}  (no scaling: bandwidth yardstick)")
    rows.append(dict(recipe="torch x.to(fp8) (no scaling)", m=m, k=k, dtype=str(dtype), fmt=fmt.name, ours_us=t_cast,
                     bytes=in_bytes + x.numel(), gbps=gbs, pct_of_3tbps=pct))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8192x8192", help="ROWSxK, or several separated by commas")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--fmt", default="e4m3", choices=["e4m3", "e5m2"])
    p.add_argument("--check", default="cpu", choices=["cpu", "gpu"], help="where the bit-exact reference runs")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    shapes = [tuple(int(v) for v in sh.lower().split("x")) for sh in a.shape.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("bench_quantize needs a CUDA GPU")
    rows = []
    for m, k in shapes:
        rows += run(m, k, DTYPES[a.dtype], a.fmt, check=a.check)
        print()
    write_json(a.out, rows)


if __name__ == "__main__":
    main()
