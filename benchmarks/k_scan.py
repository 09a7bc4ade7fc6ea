"""Time against K at one M x N, to split each kernel's time into a fixed part (launch, prologue, epilogue, the
timing floor) and a per-K-block part (the main loop's steady state): ours with given tiles (``tune_tiles``
specs, no K split), ours as dispatched, DeepGEMM and cuBLAS, DeepSeek recipe, rounds interleaved, medians, then a
least-squares line through (K blocks, us) per kernel. Needs DeepGEMM built as for ``benchmarks.deepgemm_ref``:

    PYTHONPATH=/tmp/dg/DeepGEMM:$PWD:$PYTHONPATH python3 -m benchmarks.k_scan --mn 1024x1536 --tiles 128x96c1x1
"""

from __future__ import annotations

import argparse

import torch

RECIPE = "1x128_128x128"


def line_fit(xs, ys):
    """(intercept, slope) of the least-squares line through the points."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mn", default="1024x1536", help="MxN")
    p.add_argument("--ks", default="128,256,512,1024,2048,4096,7168")
    p.add_argument("--tiles", default="128x96c1x1,128x128c2x1", help="our tiles to force (tune_tiles specs)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    import deep_gemm
    import cutedsl_gemm
    from .common import cublas_call, make_operands
    from .deepgemm_ref import _dg_call, warm_all
    from .profile_shape import forced_tile_call
    from .tune_tiles import interleaved_times

    m, n = map(int, args.mn.split("x"))
    ks = [int(k) for k in args.ks.split(",")]
    warm_all([(m, n, k) for k in ks])
    calls = {}
    for k in ks:
        qa, qw, sa, sb, plain = make_operands(m, n, k, RECIPE)
        b = qw.t()
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        calls[k] = {f"ours {t}": forced_tile_call(RECIPE, t, "promoted", qa, b, sa, sb, (m, n, k), 1)[0]
                    for t in args.tiles.split(",") if t}
        calls[k]["dispatch"] = lambda qa=qa, b=b, sa=sa, sb=sb, out=out: cutedsl_gemm.scaled_mm(
            qa, b, sa, sb, out_dtype=torch.bfloat16, out=out)
        calls[k]["DeepGEMM"] = _dg_call(deep_gemm, qa, sa, qw, plain[3].contiguous(), d)
        calls[k]["cuBLAS"] = cublas_call(RECIPE, qa, b, sa, sb)
        for f in calls[k].values():
            f()
    torch.cuda.synchronize()
    names = list(calls[ks[0]])
    keys = [(k, name) for k in ks for name in names]
    medians = {key: t for key, (t, _) in zip(keys, interleaved_times([calls[k][name] for k, name in keys], args.rounds))}
    print(f"M={m} N={n}, us (medians of {args.rounds} interleaved rounds)")
    print("    K " + "".join(f"{name:>20s}" for name in names))
    for k in ks:
        print(f"{k:5d} " + "".join(f"{medians[(k, name)]:20.2f}" for name in names))
    for name in names:
        fixed, per_block = line_fit([-(-k // 128) for k in ks], [medians[(k, name)] for k in ks])
        print(f"{name:20s} {fixed:6.2f} us fixed + {per_block * 1e3:6.1f} ns per 128-deep K block")


if __name__ == "__main__":
    main()
