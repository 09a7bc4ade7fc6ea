"""``cutedsl-gemm`` command line: demo, info, bench, export, precompile, catalog (the last three only parse
arguments; the work is in ``cutedsl_gemm.generators``)."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _hopper_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def cmd_info(args) -> int:
    import cutlass

    from cutedsl_gemm.runtime.jit import cache_dir

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
    from cutedsl_gemm.numerics import reference as R

    from triton.testing import do_bench

    print(f"{'recipe':13s} {'M':>5s} {'N':>5s} {'K':>5s} | {'rel err':>8s} | {'ours TFLOPS':>11s} {'cuBLAS TFLOPS':>13s} {'ratio':>6s}")
    from cutedsl_gemm.benchmarks.common import cublas_call, make_operands

    worst = 0.0
    for recipe in ("tensor", "row", "1x128_128x128"):
        for m, n, k in DEMO_SHAPES:
            qa, qw, scale_a, scale_b, plain = make_operands(m, n, k, recipe)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            run = lambda: cutedsl_gemm.scaled_mm(qa, qw.t(), scale_a, scale_b, out=out)
            run()
            err = R.rel_error(out, R.reference_gemm(*plain, recipe))
            worst = max(worst, err)
            t_ours = do_bench(run, return_mode="median")
            try:
                t_ref = do_bench(cublas_call(recipe, qa, qw.t(), scale_a, scale_b), return_mode="median")
            except (RuntimeError, ValueError):  # cuBLAS refuses some recipe/shape pairs (blockwise at M=1)
                t_ref = float("nan")
            tf = lambda t: 2 * m * n * k / (t * 1e-3) / 1e12
            print(f"{recipe:13s} {m:5d} {n:5d} {k:5d} | {err:8.2e} | {tf(t_ours):11.0f} {tf(t_ref):13.0f} {t_ref / t_ours:6.3f}")
    ok = worst <= 2e-3
    print(f"\n{'PASS' if ok else 'FAIL'}: worst relative error {worst:.2e} (limit 2e-3)")
    return 0 if ok else 1


def _demo_cpu() -> int:
    from cutedsl_gemm.selection import dispatch
    from cutedsl_gemm.numerics import reference as R
    from cutedsl_gemm.tools.ptx_inspect import inspect_instance

    print("No Hopper GPU here: compiling the FP8 GEMM instances for sm_90a and inspecting them.\n")
    expect = {"wgmma.mma_async": "tensor-core MMA", "cp.async.bulk.tensor": "TMA", "setmaxnreg": "register reallocation"}
    ok = True
    cases = [(recipe, a, b, accum, 4096) for accum in ("promoted", "fast")
             for recipe, a, b in (("row", "e4m3", "e4m3"), ("tensor", "e5m2", "e4m3"))]
    cases += [("1x128_128x128", "e4m3", "e4m3", "promoted", 4096), ("row", "e4m3", "e4m3", "promoted", 16)]
    for recipe, a, b, accum, m in cases:
        inst = dispatch.select_gemm("sm_90a", recipe, a, b, "bf16", None, m, accum)
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


def cmd_export(args) -> int:
    from cutedsl_gemm.generators import export as E
    from cutedsl_gemm.generators.runner import SelectionError

    try:
        res = E.export(args.arch, args.out, args.filter or (), args.limit, args.jobs)
        print(f"exported {len(res.instances)} instance(s) ({len(res.kernels)} kernels) for {args.arch} to {res.out_dir}; "
              f"build: cmake -S {res.out_dir} -B build && cmake --build build")
        if args.shared:
            print(f"linked {E.build_shared(res.out_dir)}")
    except (SelectionError, E.ExportError) as e:
        print(f"cutedsl-gemm export: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_precompile(args) -> int:
    from cutedsl_gemm.generators.precompile import PrecompileError, precompile
    from cutedsl_gemm.generators.runner import SelectionError

    try:
        rep = precompile(args.arch, args.filter or (), args.jobs, args.limit)
    except (SelectionError, PrecompileError) as e:
        print(f"cutedsl-gemm precompile: {e}", file=sys.stderr)
        return 2
    for name, err in rep.failed:
        print(f"  FAILED {name}: {err}", file=sys.stderr)
    return 1 if rep.failed else 0


def cmd_catalog(args) -> int:
    from cutedsl_gemm.generators import catalog as C

    docs = args.docs or C.DOCS_DIR
    if args.check:
        problems = C.check(docs)
        for kind in ("manifest", "sources"):
            mine = [p for p in problems if p.kind == kind]
            for p in mine[:10]:
                print(f"  {kind}: {p.text}", file=sys.stderr)
            if len(mine) > 10:
                print(f"  {kind}: ... and {len(mine) - 10} more", file=sys.stderr)
        print(f"catalog: {'stale, run `' + C.REGENERATE + '`' if problems else 'up to date'} ({docs})", file=sys.stderr)
        return 1 if problems else 0
    try:
        rep = C.refresh(docs, args.jobs)
    except FileNotFoundError as e:
        print(f"cutedsl-gemm catalog: {e}", file=sys.stderr)
        return 2
    for name, err in rep.failed:
        print(f"  FAILED {name}: {err}", file=sys.stderr)
    return 1 if rep.failed else 0


def _add_selection(p, what: str):
    p.add_argument("--arch", default="sm_90a", help="target arch of the instances (default sm_90a)")
    p.add_argument("--filter", action="append", metavar="SUBSTR",
                   help=f"{what} only instances whose name contains SUBSTR (repeatable: any of them)")
    p.add_argument("--limit", type=int, help="at most N instances (manifest order)")
    p.add_argument("--jobs", type=int, help="parallel compile processes (default: CPU count)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="cutedsl-gemm", description="FP8/FP6/FP4 GEMM kernels in the CuTe DSL")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="GPU: run and check against cuBLAS; CPU: compile for sm_90a and inspect").set_defaults(fn=cmd_demo)
    sub.add_parser("info", help="GPU, arch, DSL version, cache directory").set_defaults(fn=cmd_info)
    b = sub.add_parser("bench", help="benchmark against cuBLAS (Hopper GPU); arguments go to benchmarks.bench_gemm")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    e = sub.add_parser("export", help="AOT: C objects + headers, registry, CMake fragment for manifest instances (no GPU)")
    _add_selection(e, "export")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument("--shared", action="store_true", help="also link lib<...>.so with the system C compiler")
    e.set_defaults(fn=cmd_export)
    pc = sub.add_parser("precompile", help="fill the on-disk JIT cache for manifest instances, in parallel")
    _add_selection(pc, "compile")
    pc.set_defaults(fn=cmd_precompile)
    c = sub.add_parser("catalog", help="render docs/kernels.md (compiles only new or changed instances)")
    c.add_argument("--check", action="store_true", help="exit 1 if the catalog is stale; compiles nothing")
    c.add_argument("--docs", help="docs directory (default: the repository's docs/)")
    c.add_argument("--jobs", type=int, help="parallel compile processes (default: CPU count)")
    c.set_defaults(fn=cmd_catalog)
    args = p.parse_args(argv)
    return args.fn(args)
