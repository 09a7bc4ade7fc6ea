"""Run-after-run check of the block-scaled kernels on the GPU: every distinct manifest kernel of the given recipes
(or those whose name contains a filter) launched directly, bypassing dispatch, on a 4000 x 3008 x 384 problem in 3
K splits (one K tile per work unit, several units per CTA), fresh operands each repetition, NaN-poisoned output,
checked against the float64 reference. A race that a single test run can miss shows as a failure count; the
DeepSeek 64x192 pair's stale-scale race (sessions 24-25, 29, 30) failed 2 to 5 of 6-12 runs when A's or W's scales
were written by TMA or a bulk copy.

    python3 -m benchmarks.stress_block_scaled [--reps 12] [--recipes 1x128_128x128,...] [--only t64x192]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--recipes", default="1x128_128x128,128x128_128x128,1x128_1x128")
    p.add_argument("--only", default="", help="kernels whose name contains this")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_sm90_blockscaled_gpu import _check_launched_directly, distinct_kernels

    for inst in distinct_kernels(args.recipes.split(",")):
        if args.only not in inst.name:
            continue
        bad = []
        for rep in range(args.reps):
            torch.manual_seed(100 + rep)
            try:
                _check_launched_directly(inst, 4000, 3008, 384, splits=3 if inst.can_split_k else 1)
            except AssertionError as e:
                bad.append(str(e).split(": ")[-1])
        print(f"{inst.name}: {len(bad)}/{args.reps} failed {bad[:3]}", flush=True)


if __name__ == "__main__":
    main()
