"""Does the input data move the clock, and so the TFLOPS? (session 26)

    python3 -m benchmarks.power_data [MxNxK ...]        (8192^3 always; $OUT gets smi.csv and power.json)

For each (recipe, data) pair: ours through scaled_mm and cuBLAS for the same recipe, timed with
benchmarks.common.bench (read flush), then 3 s of back-to-back runs while nvidia-smi samples the SM clock and
power. Data: "randn" = torch.randn quantized with the reference quantizer (what every benchmark here uses);
"int2" = integers in [-2, 2] with all scales 1 (what cutlass.torch.matrix gives the CUTLASS examples, and so
the anchor's 'plain CuTe DSL GEMM 1465 TFLOPS').
"""
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import cutedsl_gemm
from .common import bench, cublas_call, make_operands, torch_block_layout, tflops



def int2_operands(m, n, k, recipe):
    qa = torch.randint(-2, 3, (m, k), device="cuda").to(torch.float8_e4m3fn)
    qw = torch.randint(-2, 3, (n, k), device="cuda").to(torch.float8_e4m3fn)
    if recipe == "tensor":
        sa = sb = torch.ones((), device="cuda")
    else:
        kb = -(-k // 128)
        sa = torch_block_layout(torch.ones(m, kb, device="cuda"), "1x128")
        sb = torch_block_layout(torch.ones(-(-n // 128), kb, device="cuda"), "128x128").t()
    return qa, qw, sa, sb


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    shapes = [(8192, 8192, 8192)] + [tuple(int(x) for x in s.split("x")) for s in sys.argv[1:]]
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=open(f"{out_dir}/smi.csv", "w"))
    time.sleep(1.0)
    windows, rows = [], []
    for (m, n, k) in shapes:
        for recipe in ("tensor", "1x128_128x128"):
            for data in ("randn", "int2", "randn"):
                if data == "randn":
                    qa, qw, sa, sb, _ = make_operands(m, n, k, recipe)
                else:
                    qa, qw, sa, sb = int2_operands(m, n, k, recipe)
                b = qw.t()
                out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                ours = lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out_dtype=torch.bfloat16, out=out)
                theirs = cublas_call(recipe, qa, b, sa, sb)
                for who, fn in (("ours", ours), ("cublas", theirs)):
                    t = bench(fn) * 1e3
                    fn(); torch.cuda.synchronize()
                    t0 = time.time()
                    while time.time() - t0 < 3.0:
                        for _ in range(20):
                            fn()
                        torch.cuda.synchronize()
                    t1 = time.time()
                    windows.append((m, n, k, recipe, data, who, t, t0 + 0.5, t1))
                    time.sleep(0.5)
    smi.terminate(); smi.wait()

    samples = []
    for line in open(f"{out_dir}/smi.csv"):
        p = [x.strip() for x in line.split(",")]
        try:
            ts = time.mktime(time.strptime(p[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + p[0].split(".")[1])
            samples.append((ts, float(p[1]), float(p[2]), float(p[3])))
        except (ValueError, IndexError):
            pass
    # nvidia-smi stamps local time, as time.mktime reads it
    print(f"{'M':>5} {'N':>5} {'K':>5} {'recipe':14} {'data':6} {'who':6} | {'us':>7} {'TFLOPS':>7} | {'SM MHz':>7} {'W':>6} {'C':>4} n")
    for (m, n, k, recipe, data, who, t, a, b_) in windows:
        sel = [s for s in samples if a <= s[0] <= b_]
        mhz = statistics.median(s[1] for s in sel) if sel else float("nan")
        w = statistics.median(s[2] for s in sel) if sel else float("nan")
        c = statistics.median(s[3] for s in sel) if sel else float("nan")
        rows.append(dict(m=m, n=n, k=k, recipe=recipe, data=data, who=who, us=t, tflops=tflops(m, n, k, t / 1e3), mhz=mhz, watts=w))
        print(f"{m:5d} {n:5d} {k:5d} {recipe:14} {data:6} {who:6} | {t:7.1f} {tflops(m, n, k, t / 1e3):7.0f} | {mhz:7.0f} {w:6.0f} {c:4.0f} {len(sel)}")
    json.dump(rows, open(f"{out_dir}/power.json", "w"), indent=1)


if __name__ == "__main__":
    main()
