"""FP8 quantization benchmark on a Hopper GPU: CuTe DSL kernels against the torch reference quantizer.

    python -m benchmarks.bench_quantize [--shape 8192x8192[,MxK...]] [--dtype bf16] [--fmt e4m3] [--check cpu|gpu]

One row per recipe: our time, the torch reference's (``quantize_fp8(..., backend="reference")`` on the GPU,
same output layout) and the speed-up, effective bandwidth (bytes read + written, scales included) and its % of
the measured floor (benchmarks.measure_floor), plus whether our output equals the reference bit for bit (NaN
codes compared as NaN; ``--check cpu``, the default, runs that reference on the CPU). A last row times torch's
plain ``x.to(float8)`` (no scaling, same bytes moved) as a bandwidth yardstick. The 1x128 and 128x128 rows aim at
>= 80% of that floor. The table goes to benchmarks/results/quantize.json (``--name``, ``--no-save``:
common.write_result).
"""

from __future__ import annotations

import argparse

import torch

from cutedsl_gemm import quantize_fp8
from cutedsl_gemm.numerics.formats import element_format

from . import common
from .common import bench

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
TARGET_PCT = 80.0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _equal(q, s, qr, sr, fmt):
    nanq = (q.view(torch.uint8) & 0x7F) == 0x7F if fmt.name == "e4m3" else (q.view(torch.uint8) & 0x7F) > 0x7C
    nanr = (qr.view(torch.uint8) & 0x7F) == 0x7F if fmt.name == "e4m3" else (qr.view(torch.uint8) & 0x7F) > 0x7C
    same_q = torch.equal(nanq, nanr) and not ((q.view(torch.uint8) != qr.view(torch.uint8)) & ~nanr).any()
    same_s = s.shape == sr.shape and torch.equal(s.contiguous().view(torch.int32), sr.contiguous().view(torch.int32))
    return bool(same_q and same_s)


def run(m, k, dtype, fmt_name, check="cpu"):
    """Rows [case, rows, K, ours us, torch us, speed-up, GB/s, % of HBM floor, bit-exact], printed as measured."""
    floors = common.measured_floors()
    fmt = element_format(fmt_name)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    # the reference for the bit-exact column: on the CPU (IEEE fp32 division for sure) or on the GPU
    xc = x.cpu() if check == "cpu" else x
    in_bytes = x.element_size() * m * k
    rows = []
    hdr = (f"{'recipe':16s} | {'ours us':>8s} {'torch us':>9s} {'speedup':>7s} | {'GB/s':>7s} {'% floor':>8s} | "
           f"{'bit-exact':>9s}")
    print(f"quantize {m}x{k} {str(dtype).replace('torch.', '')} -> {fmt.name}")
    print(hdr)
    print("-" * len(hdr))
    for label, recipe, block, layout in CASES:
        def quantizer(backend, src=x, recipe=recipe, block=block, layout=layout):
            return lambda: quantize_fp8(src, recipe, fmt=fmt, block=block, scale_layout=layout, backend=backend)

        ours, ref = quantizer("kernel"), quantizer("reference")
        q, s = ours()  # compile + warm
        torch.cuda.synchronize()
        # the torch reference in the same layout, for the bit-exact column
        qr, sr = quantizer("reference", xc)()
        exact = _equal(q.to(xc.device), s.to(xc.device), qr, sr, fmt)
        t_ours = bench(ours) * 1e3
        try:
            t_ref = bench(ref) * 1e3
        except torch.cuda.OutOfMemoryError:
            t_ref = float("nan")
        moved = in_bytes + q.numel() + s.numel() * 4
        gbs = moved / (t_ours * 1e-6) / 1e9
        pct = common.pct_of_hbm(gbs, floors)
        flag = f" <- target {TARGET_PCT:.0f}%" if label in TARGETS else ""
        print(f"{label:16s} | {t_ours:8.1f} {t_ref:9.1f} {t_ref / t_ours:7.2f} | {gbs:7.0f} {pct:7.1f}% | "
              f"{str(exact):>9s}{flag}")
        rows.append([label, m, k, round(t_ours, 2), round(t_ref, 2), round(t_ref / t_ours, 2), round(gbs),
                     round(pct, 1), exact])
    t_cast = bench(lambda: x.to(fmt.torch_dtype)) * 1e3
    gbs = (in_bytes + x.numel()) / (t_cast * 1e-6) / 1e9
    pct = common.pct_of_hbm(gbs, floors)
    print(f"{'torch x.to(fp8)':16s} | {t_cast:8.1f} {'':>9s} {'':>7s} | {gbs:7.0f} {pct:7.1f}% | "
          f"{'n/a':>9s}  (no scaling: bandwidth yardstick)")
    rows.append(["torch x.to(fp8), no scaling", m, k, round(t_cast, 2), None, None, round(gbs), round(pct, 1), None])
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8192x8192", help="ROWSxK, or several separated by commas")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--fmt", default="e4m3", choices=["e4m3", "e5m2"])
    p.add_argument("--check", default="cpu", choices=["cpu", "gpu"], help="where the bit-exact reference runs")
    common.add_result_options(p)
    a = p.parse_args(argv)
    shapes = [tuple(int(v) for v in sh.lower().split("x")) for sh in a.shape.split(",")]
    common.require_gpu("bench_quantize")
    floors = common.measured_floors()
    rows = []
    for m, k in shapes:
        rows += run(m, k, DTYPES[a.dtype], a.fmt, check=a.check)
        print()
    default = "quantize" if (a.dtype, a.fmt) == ("bf16", "e4m3") else f"quantize_{a.dtype}_{a.fmt}"
    columns = ["recipe", "rows", "K", "ours us", "torch us", "speed-up", "GB/s", f"% of {floors.hbm}", "bit-exact"]
    common.save_result(a, default, f"FP8 quantization ({a.dtype} -> {a.fmt})", columns, rows,
                       notes=f"{common.timing_notes()}; torch: the reference quantizer on the GPU, same output "
                             f"layout; GB/s counts input, FP8 output and scales; {floors.note()}")


if __name__ == "__main__":
    main()
