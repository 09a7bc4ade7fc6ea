"""One GEMM shape, ours (as dispatched, or a forced tile / split count) and cuBLAS's, a few calls each,
for a profiler (ncu) to look at. The last round of calls runs inside an NVTX range named ``profile``
(``ncu --nvtx --nvtx-include profile/`` profiles just those).

    ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum python -m benchmarks.profile_shape --m 16 --n 8192 --k 8192
    ncu --set full --nvtx --nvtx-include profile/ python -m benchmarks.profile_shape \
        --m 1024 --n 512 --k 7168 --recipe tensor --tile 128x192c2x1 --splits 4
"""

import argparse

import torch

import cutedsl_gemm
from cutedsl_gemm.ops import scaled_mm as api
from .common import cublas_call, make_operands
from .tune_tiles import candidates, direct_call


def forced_tile_call(recipe, tile, accum, qa, b, sa, sb, mnk, splits):
    """Our kernel for ``tile`` (a ``tune_tiles`` spec) launched directly on these operands, bypassing dispatch:
    (call, instance, K splits, grid clusters at most). ``splits`` 0: as dispatch would split."""
    m, n, k = mnk
    inst = next(candidates(recipe, [tile], [accum]))
    _, sa_k, sb_k = scale_layouts.resolve(sa, sb, m, n, k)
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    call, splits, clusters = direct_call(inst, qa, b, sa_k, sb_k, out, mnk, splits)
    return call, inst, splits, clusters


def run_profiled(fns, calls):
    """``calls`` rounds of ``fns``, the last round inside the NVTX range ``profile``."""
    for i in range(calls):
        if i == calls - 1:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profile")
        for fn in fns:
            fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--recipe", default="row")
    p.add_argument("--tile", default=None, help="force a tile (benchmarks.tune_tiles spec, e.g. 128x192c2x1)")
    p.add_argument("--accum", default="promoted")
    p.add_argument("--splits", type=int, default=None, help="K splits (default: the dispatch heuristic)")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    m, n, k = args.m, args.n, args.k
    qa, qw, sa, sb, _ = make_operands(m, n, k, args.recipe)
    b = qw.t()
    if args.tile is None:
        ours = lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, split_k=args.splits)
    else:
        ours, inst, splits, clusters = forced_tile_call(args.recipe, args.tile, args.accum, qa, b, sa, sb, (m, n, k),
                                                        args.splits or 0)
        print(f"{inst.name}: {splits} splits, grid of {clusters} clusters at most")
    run_profiled([ours, cublas_call(args.recipe, qa, b, sa, sb)], args.calls)


if __name__ == "__main__":
    main()
