"""The floors of this GPU under the timing method: what it costs a memory-bound kernel, and the FP8 rate.

    python -m benchmarks.measure_floor                  (-> results/floor.json)

Times, with ``common.bench`` (CUDA events, L2 emptied by a read before each run): a one-element kernel
(launch and event overhead), and torch's read-only ``amax`` over buffers of growing size. A straight-line
fit over the sizes gives the streaming rate at the margin and the intercept, the fixed cost per call that
no kernel streaming a weight of that size in one launch can avoid under this method. The same reads back to back
in one CUDA graph (``--chains``: calls x MiB, each call its own buffer, as a decode step's linears each read their
weight) give the fixed cost per call a chain of launches pays beyond the bytes at that rate: the floor of a step
that runs one kernel per weight, whatever each kernel does. Then the FP8 tensor-core
rate this GPU sustains (its power cap, not the datasheet): the fastest of cuBLAS's per-tensor FP8 GEMMs with
fast accumulation at ``--gemms``.

The other benchmarks read the result (``common.measured_floors()``: its summary holds the four floors) for their
"% of" and floor columns, and refuse to run on a GPU other than the one it names: run this first on each GPU.
"""

from __future__ import annotations

import argparse

import torch

from . import common
from .common import bench

RESULT_NAME = common.FLOOR_NAME
TC_KEY = common.FLOOR_KEYS["fp8_tflops"]


def read_once_us(mib):
    """``common.bench`` of a read-only ``amax`` over a fresh ``mib`` MiB buffer, in us."""
    words = torch.randint(0, 1 << 30, (mib << 18,), dtype=torch.int32, device="cuda")
    return bench(lambda: torch.amax(words)) * 1e3


def chained_reads_us(calls, mib):
    """``common.bench`` of one CUDA graph replaying ``calls`` read-only ``amax`` kernels back to back, each over a
    fresh ``mib`` MiB buffer of its own, in us."""
    bufs = [torch.randint(0, 1 << 30, (mib << 18,), dtype=torch.int32, device="cuda") for _ in range(calls)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up off the capture, as torch's graph capture asks)
        for b in bufs:
            torch.amax(b)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b in bufs:
            torch.amax(b)
    return bench(graph.replay) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", default="16,32,64,128,256,448")
    p.add_argument("--chains", default="64x16,32x56",
                   help="CALLSxMIB,... of the reads back to back in a CUDA graph (default: %(default)s)")
    p.add_argument("--gemms", default="8192x8192x8192,16384x8192x8192",
                   help="MxNxK,... of the FP8 rate measurement (default: %(default)s)")
    common.add_result_options(p, RESULT_NAME)
    args = p.parse_args(argv)
    common.require_gpu("measure_floor")
    tiny = torch.zeros(1, device="cuda")
    t_tiny = bench(lambda: tiny.add_(1)) * 1e3
    print(f"one-element kernel: {t_tiny:.1f} us")
    sizes, times = [], []
    for mib in map(int, args.mib.split(",")):
        t = read_once_us(mib)
        sizes.append(mib * 2**20)
        times.append(t)
        print(f"read-only amax over {mib:4d} MiB: {t:7.1f} us  {sizes[-1] / t / 1e6:5.2f} TB/s")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sum((x - mx) ** 2 for x in sizes)
    intercept = my - slope * mx
    print(f"fit: {1e-6 / slope:.2f} TB/s at the margin, intercept {intercept:.1f} us per call; "
          f"64 MiB at that rate alone: {slope * 64 * 2**20:.1f} us")
    rows = [["one-element kernel", "us", round(t_tiny, 2)], ["read-only stream, at the margin", "TB/s",
                                                             round(1e-6 / slope, 3)],
            ["read-only stream, fixed cost per call", "us", round(intercept, 2)]]
    chained = []
    for chain in args.chains.split(","):
        calls, mib = map(int, chain.split("x"))
        t = chained_reads_us(calls, mib)
        chained.append((t - calls * slope * mib * 2**20) / calls)
        print(f"{calls} reads of {mib} MiB back to back in a CUDA graph: {t:7.1f} us, {chained[-1]:.2f} us per call "
              f"beyond the bytes at the margin rate")
        rows.append([f"{calls} read-only streams of {mib} MiB in a CUDA graph, fixed cost per call", "us",
                     round(chained[-1], 2)])
    rates = []
    for shape in args.gemms.split(","):
        m, n, k = map(int, shape.split("x"))
        rates.append(fp8_tflops(m, n, k))
        print(f"FP8 GEMM {shape} (cuBLAS, per tensor, fast accumulation): {rates[-1]:.0f} TFLOPS")
        rows.append([f"FP8 GEMM {shape} (cuBLAS, per tensor, fast accumulation)", "TFLOPS", round(rates[-1], 1)])
    keys = common.FLOOR_KEYS
    summary = {keys["hbm_tbps"]: round(1e-6 / slope, 3), keys["fp8_tflops"]: round(max(rates), 1),
               keys["launch_us"]: round(t_tiny, 2), keys["stream_fixed_us"]: round(intercept, 2),
               common.CHAINED_FIXED_KEY: round(min(chained), 2)}
    common.save_result(args, RESULT_NAME, "Floors of the GPU under the timing method", ["measure", "unit", "value"],
                       rows, summary=summary, notes=common.timing_notes())
    common.measured_floors.cache_clear()  # a later read in this process sees the new file


def fp8_tflops(m, n, k):
    """TFLOPS of cuBLAS's per-tensor FP8 GEMM (torch._scaled_mm, fast accumulation, bf16 out) at M x N x K."""
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    t = bench(lambda: torch._scaled_mm(a, w.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True))
    return common.tflops(m, n, k, t)


if __name__ == "__main__":
    main()
