"""Weight-only GEMM benchmark on a Hopper GPU: ours (``mm_weight_only``) against torch's int4 kernel
(``torch._weight_int4pack_mm`` on ``torch._convert_weight_to_int4pack`` weights; int8: ``torch._weight_int8pack_mm``)
and the bf16 product (``torch.matmul``), same shapes, bf16 activations.

    python -m benchmarks.bench_weight_only                        (int4 group 128, -> results/weight_only.json)
    python -m benchmarks.bench_weight_only --bits 8 --group 0 --name weight_only_int8
    python -m benchmarks.bench_weight_only --nk 8192x8192,28672x8192 --ms 1,16,128 --zeros --group 64
    python -m benchmarks.bench_weight_only --ms 1,16 --tile-m 64 --split-k 1 --name weight_only_t64

Each product runs on its own copies of the weights, taken in turn, enough of them that every call reads its weights
from HBM (past the 50 MB L2); the calls are timed back to back (``common.time_interleaved``). Per row: the three
times, the floor (the weight bytes, scales and zero points included, at the measured floor, benchmarks.measure_floor),
ours as % of the floor, torch's
and bf16's time over ours (above 1: ours is faster), our TFLOPS, and the relative error of our output against the
float64 product of the dequantized weights (M <= 128).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import torch

from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics import int_packing as IP
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.ops.weight_only import mm_weight_only
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch

from . import common

L2_BYTES = 50 << 20
COLUMNS = ["M", "N", "K", "ours us", "torch us", "bf16 us", "floor us", "ours % of floor", "torch / ours",
           "bf16 / ours", "ours TFLOPS", "rel err"]
CHECK_MAX_M = 128  # the float64 reference of larger M takes too long to be worth it


def copies_past_l2(nbytes: int) -> int:
    """Copies of an operand of ``nbytes`` so that cycling through them reads each one from HBM."""
    return max(2, math.ceil(3 * L2_BYTES / max(nbytes, 1)))


class Rotation:
    """Calls ``fn(i)`` with i = 0, 1, .. copies - 1, 0, ..: each call on the next copy of the weights."""

    def __init__(self, fn, copies: int):
        self.fn, self.copies, self.i = fn, copies, 0

    def __call__(self):
        self.i = (self.i + 1) % self.copies
        return self.fn(self.i)


def our_weights(n, k, bits, group, zeros, gen):
    """Random codes, scales (and zero points) packed for the kernel, on the GPU: (packed, scales, zeros, q, s, z)
    with ``q, s, z`` as the kernel reads them (for the reference)."""
    lo, hi = IP.code_range(bits, zeros)
    q = torch.randint(lo, hi + 1, (n, k), device="cuda", generator=gen, dtype=torch.int8)
    cols = 1 if group == 0 else k // group
    s = torch.rand(n, cols, device="cuda", generator=gen) * 0.02 + 0.01
    z = torch.randint(0, 1 << bits, (n, cols), device="cuda", generator=gen, dtype=torch.int32) if zeros else None
    packed, ks, kz = IP.pack_weights(q, s, z, group, bits=bits)
    return packed, ks, kz, q, ks.float().t() if group else s, z


def torch_weights(n, k, bits, group, gen):
    """torch's packed int4 weights with (K / group, N, 2) bf16 scales and zeros, or int8 (N, K) with (N,) scales;
    None where this torch build has no CUDA kernel for them."""
    try:
        if bits == 4:
            nibbles = torch.randint(0, 256, (n, k // 2), device="cuda", generator=gen, dtype=torch.uint8)
            packed = torch._convert_weight_to_int4pack(nibbles, 8)
            sz = torch.rand(k // group, n, 2, device="cuda", generator=gen).to(torch.bfloat16)
            call = functools.partial(_int4_mm, w=packed, group=group, sz=sz)
        else:
            w = torch.randint(-127, 128, (n, k), device="cuda", generator=gen, dtype=torch.int8)
            s = torch.rand(n, device="cuda", generator=gen).to(torch.bfloat16)
            call = functools.partial(_int8_mm, w=w, s=s)
        call(torch.zeros(1, k, dtype=torch.bfloat16, device="cuda"))
        return call
    except (RuntimeError, NotImplementedError):
        return None


def _int4_mm(x, *, w, group, sz):
    return torch._weight_int4pack_mm(x, w, group, sz)


def _int8_mm(x, *, w, s):
    return torch._weight_int8pack_mm(x, w, s)


def our_call(x, ours, group, bits, split_k=None, tile_m=None):
    """fn(i, out): ours on copy i of the weights -- ``mm_weight_only`` with ``split_k`` K splits (None: dispatch's
    choice), or with ``tile_m`` the launch plan of dispatch's pick built with that many weight rows a tile (64: one
    consumer warp group, twice the tiles), a kernel option timed against the table's."""
    if tile_m is None:
        return lambda i, out: mm_weight_only(x, ours[i][0], ours[i][1], ours[i][2], group=group, bits=bits, out=out,
                                             split_k=split_k)
    packed, scales, zeros = ours[0][:3]
    problem = P.describe_weight_only(x, packed, scales, zeros, group, bits, None, split_k, x.device)
    inst, splits = dispatch.select_weight_only(problem)
    plan = launch.plan(dataclasses.replace(inst, tile_m=tile_m), problem.m, problem.n, splits, x.device.index)
    return lambda i, out: plan.run(x, ours[i][0], ours[i][1], ours[i][2], out)


def timed_calls(x, ours, theirs, bf16, group, bits, split_k=None, tile_m=None):
    """{name: no-argument call} of the three products of ``x``, each on the next copy of its weights (ours as
    ``our_call`` makes it)."""
    outs = [torch.empty(x.shape[0], o[1].shape[1], dtype=x.dtype, device=x.device) for o in ours]
    ours_fn = our_call(x, ours, group, bits, split_k, tile_m)
    fns = {
        "ours": Rotation(lambda i: ours_fn(i, outs[i]), len(ours)),
        "bf16": Rotation(lambda i: torch.matmul(x, bf16[i].t()), len(bf16)),
    }
    if theirs:
        fns["torch"] = Rotation(lambda i: theirs[i](x), len(theirs))
    return fns


def weight_bytes(n, k, bits, group, zeros):
    scale_count = n if group == 0 else n * (k // group)
    return n * k * bits // 8 + scale_count * (4 if group == 0 else 2) * (2 if zeros else 1)


def run_shape(n, k, ms, bits, group, zeros, gen, split_k=None, tile_m=None, floors=None):
    """The rows of one weight shape at each M of ``ms``, its floor at ``floors`` (default ``measured_floors()``)."""
    floors = floors or common.measured_floors()
    nbytes = weight_bytes(n, k, bits, group, zeros)
    ours = [our_weights(n, k, bits, group, zeros, gen) for _ in range(copies_past_l2(nbytes))]
    theirs = [torch_weights(n, k, bits, group or 128, gen) for _ in range(copies_past_l2(nbytes))] \
        if bits == 8 or group else []
    theirs = [t for t in theirs if t is not None]
    bf16 = [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(copies_past_l2(n * k * 2))]
    floor_us = floors.stream_us(nbytes)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        fns = timed_calls(x, ours, theirs, bf16, group, bits, split_k, tile_m)
        times = {name: ms_ * 1e3 for name, ms_ in common.time_interleaved(fns).items()}
        err = float("nan")
        if m <= CHECK_MAX_M:
            q, s, z = ours[0][3:]
            out = our_call(x, ours, group, bits, split_k, tile_m)(0, torch.empty(m, n, dtype=x.dtype, device=x.device))
            err = R.rel_error(out, R.reference_weight_only_mm(x, q, s, z, group))
        ours_us, torch_us, bf16_us = times["ours"], times.get("torch", float("nan")), times["bf16"]
        rows.append([m, n, k, ours_us, torch_us, bf16_us, floor_us, 100 * floor_us / ours_us, torch_us / ours_us,
                     bf16_us / ours_us, 2 * m * n * k / (ours_us * 1e-6) / 1e12, err])
        print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nk", default="8192x8192", help="comma-separated NxK weight shapes (default 8192x8192)")
    p.add_argument("--ms", default="1,16,128,1024,4096", help="comma-separated M (tokens)")
    p.add_argument("--bits", type=int, default=4, choices=IP.BITS)
    p.add_argument("--group", type=int, default=128, help="32, 64, 128, or 0 (per channel)")
    p.add_argument("--zeros", action="store_true", help="int4 with integer zero points")
    p.add_argument("--split-k", type=int, default=None, help="force this many K splits (default: dispatch's)")
    p.add_argument("--tile-m", type=int, default=None, choices=(64, 128),
                   help="weight rows a tile of dispatch's pick (a kernel option; default: the table's)")
    common.add_result_options(p, "weight_only")
    args = p.parse_args(argv)
    IP.check_format(args.bits, args.group, args.zeros)
    common.require_gpu("bench_weight_only")
    floors = common.measured_floors()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ms = [int(v) for v in args.ms.split(",")]
    print(" | ".join(COLUMNS))
    rows = []
    for shape in args.nk.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        rows += run_shape(n, k, ms, args.bits, args.group, args.zeros, gen, args.split_k, args.tile_m, floors)
    fmt = f"int{args.bits} " + (f"group {args.group}" if args.group else "per channel") + \
        (" with zero points" if args.zeros else "")
    torch_kernel = "torch._weight_int4pack_mm (group 128 where ours is per channel)" if args.bits == 4 \
        else "torch._weight_int8pack_mm"
    common.save_result(
        args, "weight_only", f"Weight-only GEMM, {fmt}, bf16 activations", COLUMNS, rows,
        summary={"geomean torch / ours": round(common.geomean([r[8] for r in rows]), 3),
                 "geomean bf16 / ours": round(common.geomean([r[9] for r in rows]), 3)},
        notes=f"torch: {torch_kernel}; weights rotated past the L2, calls back to back (time_interleaved); "
              f"floor: weight, scale and zero-point bytes at {floors.hbm}")


if __name__ == "__main__":
    main()
