"""``cutedsl-gemm`` command line: demo, info, bench."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def cmd_info(args) -> int:
    import cutlass

    from cutedsl_gemm.jit import cache_dir

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        print(f"GPU:        {torch.cuda.get_device_name()} (sm_{major}{minor}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs)")
    else:
        print("GPU:        none (kernels compile for a target arch; run with a Hopper GPU to execute them)")
    print(f"CuTe DSL:   {cutlass.__version__}")
    print(f"torch:      {torch.__version__}")
    print(f"cache dir:  {cache_dir()}")
    return 0


DEMO_SHAPES = [(1, 7168, 2048), (128, 4608, 7168), (1024, 7168, 2048), (4096, 4096, 4096), (6144, 4608, 7168)]


def _demo_gpu() -> int:
    import cutedsl_gemm
    from cutedsl_gemm import reference as R

    from triton.testing import do_bench

    print(f"{'recipe':6s} {'M':>5s} {'N':>5s} {'K':>5s} | {'rel err':>8s} | {'ours TFLOPS':>11s} {'cuBLAS TFLOPS':>13s} {'ratio':>6s}")
    worst = 0.0
    for recipe in ("tensor", "row"):
        for m, n, k in DEMO_SHAPES:
            a, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
            qa, sa, qw, sw = R.quantize_operands(a, w, recipe)
            scale_a = sa.reshape(()) if recipe == "tensor" else sa.reshape(m, 1).contiguous()
            scale_b = sw.reshape(()) if recipe == "tensor" else sw.reshape(1, n).contiguous()
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            run = lambda: cutedsl_gemm.scaled_mm(qa, qw.t(), scale_a, scale_b, out=out)
            run()
            err = R.rel_error(out, R.reference_gemm(qa, sa, qw, sw, recipe))
            worst = max(worst, err)
            t_ours = do_bench(run, return_mode="median")
            t_ref = do_bench(lambda: torch._scaled_mm(qa, qw.t(), scale_a, scale_b, out_dtype=torch.bfloat16), return_mode="median")
            tf = lambda t: 2 * m * n * k / (t * 1e-3) / 1e12
            print(f"{recipe:6s} {m:5d} {n:5d} {k:5d} | {err:8.2e} | {tf(t_ours):11.0f} {tf(t_ref):13.0f} {t_ref / t_ours:6.3f}")
    ok = worst <= 2e-3
    print(f"\n{'PASS' if ok else 'FAIL'}: worst relative error {worst:.2e} (limit 2e-3)")
    return 0 if ok else 1


def _demo_cpu() -> int:
    from cutedsl_gemm import dispatch, reference as R
    from cutedsl_gemm.inspect import inspect_instance

    print("No Hopper GPU here: compiling the FP8 GEMM instances for sm_90a and inspecting them.\n")
    expect = {"wgmma.mma_async": "tensor-core MMA", "cp.async.bulk.tensor": "TMA", "setmaxnreg": "register reallocation"}
    ok = True
    for accum in ("promoted", "fast"):
        for recipe, a, b in (("row", "e4m3", "e4m3"), ("tensor", "e5m2", "e4m3")):
            inst = dispatch.select_gemm("sm_90a", recipe, a, b, "bf16", None, 4096, accum)
            t0 = time.time()
            rep = inspect_instance(inst)
            print("\n".join(rep.summary_lines()) + f"\n    (compiled in {time.time() - t0:.1f} s)")
            for ins, what in expect.items():
                if not any(k.startswith(ins) for k in rep.instructions):
                    print(f"    MISSING {ins} ({what})")
                    ok = False
    print("\nReference numerics (CPU, float64 on dequantized operands):")
    torch.manual_seed(0)
    for recipe in ("tensor", "row", "1x128_128x128", "128x128_128x128"):
        a, w = torch.randn(256, 512), torch.randn(384, 512)
        qa, sa, qw, sw = R.quantize_operands(a, w, recipe)
        err = R.rel_error(R.reference_gemm(qa, sa, qw, sw, recipe), a.double() @ w.double().t())
        print(f"    {recipe:16s} quantization error of the GEMM vs full precision: {err:.2e}")
        ok &= err < 0.1
    print(f"\n{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def cmd_demo(args) -> int:
    return _demo_gpu() if _hopper_available() else _demo_cpu()


def cmd_bench(args) -> int:
    if not _hopper_available():
        print("cutedsl-gemm bench needs a Hopper GPU", file=sys.stderr)
        return 2
    from cutedsl_gemm.benchmarks import bench_gemm

    return bench_gemm.main(args.rest) or 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="cutedsl-gemm", description="FP8/FP6/FP4 GEMM kernels in the CuTe DSL")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="GPU: run and check against cuBLAS; CPU: compile for sm_90a and inspect").set_defaults(fn=cmd_demo)
    sub.add_parser("info", help="GPU, arch, DSL version, cache directory").set_defaults(fn=cmd_info)
    b = sub.add_parser("bench", help="benchmark against cuBLAS (Hopper GPU); arguments go to benchmarks.bench_gemm")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    return args.fn(args)
