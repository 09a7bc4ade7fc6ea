"""What the timing method itself costs a memory-bound kernel (not a GEMM benchmark).

    python -m benchmarks.measure_floor

Times, with ``common.bench`` (CUDA events, L2 emptied by a read before each run): a one-element kernel
(launch and event overhead), and torch's read-only ``amax`` over buffers of growing size. A straight-line
fit over the sizes gives the streaming rate at the margin and the intercept, the fixed cost per call that
no kernel streaming a weight of that size in one launch can avoid under this method.
"""

from __future__ import annotations

import argparse

import torch

from .common import bench


def read_once_us(mib):
    """``common.bench`` of a read-only ``amax`` over a fresh ``mib`` MiB buffer, in us."""
    words = torch.randint(0, 1 << 30, (mib << 18,), dtype=torch.int32, device="cuda")
    return bench(lambda: torch.amax(words)) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", default="16,32,64,128,256,448")
    args = p.parse_args(argv)
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
    print(f"fit: {1e-6 / slope:.2f} TB/s at the margin, intercept {my - slope * mx:.1f} us per call; "
          f"64 MiB at that rate alone: {slope * 64 * 2**20:.1f} us")


if __name__ == "__main__":
    main()
