"""One decode GEMM of ours and cuBLAS's, a few calls each, for a profiler (ncu) to look at.

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python -m benchmarks.profile_decode --m 16 --n 8192 --k 8192
"""

import argparse

import torch

import cutedsl_gemm
from .common import make_operands


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--recipe", default="row")
    p.add_argument("--split-k", type=int, default=None)
    args = p.parse_args()
    qa, qw, sa, sb, _ = make_operands(args.m, args.n, args.k, args.recipe)
    for _ in range(3):
        cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, split_k=args.split_k)
        torch._scaled_mm(qa, qw.t(), sa, sb, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
