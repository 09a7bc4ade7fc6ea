"""A short run of every Hopper kernel family through the public API, sized for compute-sanitizer: each call on
fresh random data, NaN-poisoned output, checked against the float64 reference (exit 1 on a wrong result). Shapes
are picked so dispatch reaches each tile family (64-row A-by-TMA, 128x128 in 2x1 / 4x1 clusters, the 128x192
split-N loop, the 64x192 pairs, split-K, the swapped small-M tiles) with partial tiles in M, N and K.

    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    compute-sanitizer --tool memcheck|racecheck|synccheck --report-api-errors no \\
        python3 -m benchmarks.sanitize_calls [--recipes tensor,...] [--max-shapes N]

(Without the caching allocator memcheck sees each tensor's own bounds; racecheck is slow: use --max-shapes.)
"""

from __future__ import annotations

import argparse
import sys

import torch

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.tools.baselines import make_operands

from .common import dispatched, require_gpu

SHAPES = [  # (DeepSeek recipe's dispatch on 132 SMs)
    (1, 576, 7056),        # small-M swapped tiles in K splits, partial K block
    (256, 4096, 512),      # 64x128, A's scales by TMA
    (256, 576, 1536),      # 64x128 in 6 K splits
    (1000, 576, 7056),     # 64x128, partial M / N / K
    (1024, 1536, 2048),    # 128x128 c2x1
    (1536, 576, 1536),     # 128x128 c4x1 in 2 K splits, partial N
    (1000, 2304, 1536),    # 128x192, split-N loop
    (1000, 4608, 7056),    # 128x192, last wave split in K, partial K
    (2000, 7168, 256),     # 64x192 pairs (short K), partial M
]
RECIPES = ["1x128_128x128", "128x128_128x128", "1x128_1x128", "tensor", "row"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--max-shapes", type=int, default=len(SHAPES), help="the first N shapes only (racecheck is slow)")
    args = p.parse_args(argv)
    require_gpu("sanitize_calls")
    recipes = args.recipes.split(",")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bad = 0
    for recipe in recipes:
        for m, n, k in SHAPES[: args.max_shapes]:
            qa, qw, sa, sb, plain = make_operands(m, n, k, recipe)
            inst, splits, _ = dispatched(recipe, m, n, k, sms)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            try:
                cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out_dtype=torch.bfloat16, out=out)
            except (ValueError, RuntimeError) as e:  # cuBLAS-style refusals are not expected here
                print(f"{recipe:16s} {m}x{n}x{k}: refused: {e}")
                bad += 1
                continue
            torch.cuda.synchronize()
            err = R.rel_error(out, R.reference_gemm(*plain, recipe))
            ok = err < 2e-3
            bad += not ok
            print(f"{recipe:16s} {m}x{n}x{k}: {inst.name} splits {splits}: err {err:.2e} {'ok' if ok else 'WRONG'}")
    for recipe in ("1x128", "128x128"):
        x = torch.randn(1000, 7056, device="cuda", dtype=torch.bfloat16)
        q, s = cutedsl_gemm.quantize_fp8(x, recipe)
        torch.cuda.synchronize()
        print(f"quantize_fp8 {recipe} 1000x7056: data {tuple(q.shape)}, scales {tuple(s.shape)}, finite "
              f"{bool(torch.isfinite(s).all())}")
        bad += not bool(torch.isfinite(s).all())
    print(f"{bad} wrong")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
