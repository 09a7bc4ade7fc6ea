"""Which cuBLAS kernel torch runs for each shape of a set (name carries its tile, stages and cluster), and its
device time under the profiler: what our dispatch competes with.

    python -m benchmarks.cublas_kernels --sets dsv3,square --recipes tensor,1x128_128x128
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from .common import SETS, cublas_call, make_operands


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sets", default="dsv3,square")
    p.add_argument("--recipes", default="tensor")
    args = p.parse_args()
    for recipe in args.recipes.split(","):
        for set_name in args.sets.split(","):
            for m, n, k in SETS[set_name]:
                qa, qw, sa, sb, _ = make_operands(m, n, k, recipe)
                try:
                    call = cublas_call(recipe, qa, qw.t(), sa, sb)
                    call()
                except (RuntimeError, ValueError) as e:
                    print(f"{recipe:14s} {m:5d} {n:5d} {k:5d}  refused: {str(e).splitlines()[0][:60]}")
                    continue
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        call()
                    torch.cuda.synchronize()
                kernels = {}
                for ev in prof.events():
                    if ev.device_type == torch.autograd.DeviceType.CUDA:
                        kernels.setdefault(ev.name, []).append(ev.device_time)
                for name, times in kernels.items():
                    times.sort()
                    print(f"{recipe:14s} {m:5d} {n:5d} {k:5d} {times[len(times) // 2]:8.1f} us  {name[:90]}")


if __name__ == "__main__":
    main()
