"""DeepGEMM's Hopper 1x128 x 128x128 FP8 GEMM (``deep_gemm.fp8_gemm_nt``, its sm90 1D2D kernel) as a second
reference next to ours (``scaled_mm``) and cuBLAS (``F.scaled_mm``): same inputs, same harness
(``common.bench``: read flush, CUDA events, median), rounds interleaved. cuBLAS stays the anchor; DeepGEMM says
what the best public kernel for this recipe does on the same GPU.

DeepGEMM is not a dependency: build it on the device first (``bash benchmarks/deepgemm_build.sh``), then

    PYTHONPATH=/tmp/dg/DeepGEMM:$PYTHONPATH python3 -m benchmarks.deepgemm_ref --warm     # JIT every shape's kernel
    PYTHONPATH=/tmp/dg/DeepGEMM:$PYTHONPATH python3 -m benchmarks.deepgemm_ref [--rounds 2]
    PYTHONPATH=... ncu --nvtx --nvtx-include profile/ python3 -m benchmarks.deepgemm_ref --profile 1024,1536,7168 --tile 128x96c1x1

``--warm`` compiles in one process per shape (DeepGEMM compiles with nvcc at a shape's first call; a crash in one
must not hang the rest). ``--profile`` runs one call of ours (a ``tune_tiles`` tile spec) and of DeepGEMM's inside
an NVTX range ``profile``. DeepGEMM reads A's scales M-major, as F.scaled_mm's BlockWise1x128 layout already is,
and W's as a plain (ceil(N/128), Kb) tensor.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from .common import SETS, torch_block_layout

RECIPE = "1x128_128x128"
SHAPES = SETS["dsv3"] + SETS["square"]


def _dg_call(deep_gemm, qa, sa, qw, sw, d):
    return lambda: deep_gemm.fp8_gemm_nt((qa, sa), (qw, sw), d)


def warm_one(m, n, k):
    import deep_gemm

    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    kb = -(-k // 128)
    sa = torch_block_layout(torch.ones(m, kb, device="cuda"), "1x128")  # M-major, as DeepGEMM takes it
    sw = torch.ones(-(-n // 128), kb, device="cuda")
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    _dg_call(deep_gemm, a, sa, w, sw, d)()
    torch.cuda.synchronize()


def warm_all(shapes, parallel=10):
    procs, todo = [], list(shapes)
    while todo or procs:
        while todo and len(procs) < parallel:
            m, n, k = todo.pop(0)
            code = f"from benchmarks.deepgemm_ref import warm_one; warm_one({m}, {n}, {k})"
            procs.append(((m, n, k), subprocess.Popen([sys.executable, "-c", code])))
        time.sleep(0.5)
        for shape, p in list(procs):
            if p.poll() is not None:
                print("jit", shape, "rc", p.returncode, flush=True)
                procs.remove((shape, p))


def compare(shapes, rounds):
    import deep_gemm
    import cutedsl_gemm
    from cutedsl_gemm.numerics import reference as R
    from .common import bench, cublas_call, geomean, make_operands, tflops

    times = {}
    print(f"{'M':>5} {'N':>5} {'K':>5} | {'ours':>7} {'DeepGEMM':>8} {'cuBLAS':>7} | {'c/ours':>6} {'c/DG':>6} {'DG/ours':>7} | "
          f"{'ours TF':>7} {'DG TF':>6} | {'err ours':>8} {'err DG':>8}")
    for rnd in range(rounds):
        for (m, n, k) in shapes:
            qa, qw, sa, sb, plain = make_operands(m, n, k, RECIPE)
            sw = plain[3].contiguous()
            b = qw.t()
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            ours = lambda: cutedsl_gemm.scaled_mm(qa, b, sa, sb, out_dtype=torch.bfloat16, out=out)
            dg = _dg_call(deep_gemm, qa, sa, qw, sw, d)
            cub = cublas_call(RECIPE, qa, b, sa, sb)
            ours(), dg()
            torch.cuda.synchronize()
            ref = R.reference_gemm(*plain, RECIPE)
            e_o, e_d = R.rel_error(out, ref), R.rel_error(d, ref)
            t_c, t_o, t_d = bench(cub) * 1e3, bench(ours) * 1e3, bench(dg) * 1e3
            times.setdefault(rnd, {})[(m, n, k)] = (t_o, t_d, t_c)
            print(f"{m:5d} {n:5d} {k:5d} | {t_o:7.1f} {t_d:8.1f} {t_c:7.1f} | {t_c / t_o:6.3f} {t_c / t_d:6.3f} {t_d / t_o:7.3f} | "
                  f"{tflops(m, n, k, t_o / 1e3):7.0f} {tflops(m, n, k, t_d / 1e3):6.0f} | {e_o:8.2e} {e_d:8.2e}", flush=True)
        dsv3 = [s for s in shapes if s in SETS["dsv3"]]
        if dsv3:
            t = times[rnd]
            g = [geomean([t[s][i] for s in dsv3]) for i in range(3)]
            best = geomean([t[s][2] / min(t[s][0], t[s][1]) for s in dsv3])
            print(f"round {rnd} geomean over the {len(dsv3)} dsv3 shapes run, us: ours {g[0]:.1f}  DeepGEMM {g[1]:.1f}  cuBLAS {g[2]:.1f}  -> cuBLAS/ours "
                  f"{g[2] / g[0]:.3f}  cuBLAS/DeepGEMM {g[2] / g[1]:.3f}  cuBLAS/(faster of the two per shape) {best:.3f}", flush=True)


def profile(m, n, k, tile):
    import deep_gemm
    from .common import make_operands
    from .profile_shape import forced_tile_call, run_profiled

    qa, qw, sa, sb, plain = make_operands(m, n, k, RECIPE)
    ours, inst, _, _ = forced_tile_call(RECIPE, tile, "promoted", qa, qw.t(), sa, sb, (m, n, k), 1)
    d = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    run_profiled([ours, _dg_call(deep_gemm, qa, sa, qw, plain[3].contiguous(), d)], 4)
    print(inst.name)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--warm", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shapes", default=None, help="MxNxK,... (default: the dsv3 and square sets)")
    p.add_argument("--profile", default=None, help="M,N,K: one profiled call each (with --tile)")
    p.add_argument("--tile", default="128x128c2x1")
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    if args.profile:
        profile(*(int(x) for x in args.profile.split(",")), args.tile)
    elif args.warm:
        warm_all(shapes)
    else:
        compare(shapes, args.rounds)


if __name__ == "__main__":
    main()
