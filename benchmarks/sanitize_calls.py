"""A short run of every Hopper kernel family through the public API, sized for compute-sanitizer: each call on
fresh random data, NaN-poisoned output, checked against the float64 reference (exit 1 on a wrong result). Shapes
are picked so dispatch reaches each tile family (64-row A-by-TMA, 128x128 in 2x1 / 4x1 clusters, the 128x192
split-N loop, the 64x192 pairs, split-K, the swapped small-M tiles) with partial tiles in M, N and K.

    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    compute-sanitizer --tool memcheck|racecheck|synccheck --report-api-errors no \\
        python3 -m benchmarks.sanitize_calls [--recipes tensor,...] [--max-shapes N] [--moe-only]

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
    p.add_argument("--moe-only", action="store_true", help="only the MoE routing kernels and the pair sum")
    args = p.parse_args(argv)
    require_gpu("sanitize_calls")
    if args.moe_only:
        bad = _moe_routing_calls()
        print(f"{bad} wrong")
        sys.exit(1 if bad else 0)
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
    bad += _moe_routing_calls()
    print(f"{bad} wrong")
    sys.exit(1 if bad else 0)


def _moe_routing_calls() -> int:
    """The MoE routing kernels (one kernel and the blocked form, contiguous and masked) and the pair sum against
    their torch references, on a skewed routing with an id outside the experts; the number wrong."""
    from cutedsl_gemm.ops import moe_route as M

    gen = torch.Generator().manual_seed(0)
    t, k, e, h = 300, 8, 64, 1040  # 5 blocks of the blocked form, a row past a 128 multiple
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[::2, 0] = 3  # a hot expert (where 3 was elsewhere in the row, a repeat: placed after, by slot)
    ids[7, 5] = e  # outside the experts: no row
    ids, w = ids.cuda(), torch.rand(t, k, generator=gen).cuda()
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).cuda()
    bad, saved = 0, M.ROUTE_MAX_ID_READS
    try:
        for form, reads in (("one kernel", 1 << 62), ("blocked", 0)):
            M.ROUTE_MAX_ID_READS = reads
            for gran in ("row", "1x128", "tensor"):
                for capacity in (None, 40):
                    got = M.route_quantize_fp8(x, ids, w, e, gran, capacity=capacity)
                    want = M.route_quantize_fp8(x, ids, w, e, gran, capacity=capacity, backend="reference")
                    torch.cuda.synchronize()
                    rows = got[3][got[3] >= 0].long()
                    scale_rows = slice(None) if gran == "tensor" else rows  # (per tensor: the one scale)
                    ok = (torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
                          and torch.equal(got[0].view(torch.uint8)[rows], want[0].view(torch.uint8)[rows])
                          and torch.equal(got[1][scale_rows], want[1][scale_rows])
                          and torch.equal(got[4][rows], want[4][rows]))
                    bad += not ok
                    print(f"route_quantize_fp8 {form}, {gran}, capacity {capacity}: {'ok' if ok else 'WRONG'}")
    finally:
        M.ROUTE_MAX_ID_READS = saved
    y = torch.randn(t * k, h, generator=gen).to(torch.bfloat16).cuda()
    pos = M.route_pairs(ids, e)[0]
    got = M.sum_routed_pairs(y, pos)
    ok = torch.equal(got.nan_to_num(), M.sum_routed_pairs(y, pos, backend="reference").nan_to_num())
    print(f"sum_routed_pairs {t}x{k} rows of {h}: {'ok' if ok else 'WRONG'}")
    return bad + (not ok)


if __name__ == "__main__":
    main()
