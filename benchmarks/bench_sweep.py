"""The serving-batch sweep on a Hopper GPU: every recipe against its cuBLAS over LLM layer shapes (N, K) at
M = 1..4096, the data behind the heatmaps of BENCHMARKS.md.

    python -m benchmarks.bench_sweep --precompile-only --jobs 16   (compile what the sweep and --audit launch)
    python -m benchmarks.bench_sweep                               (-> results/sweep.json)
    python -m benchmarks.bench_sweep --audit --ms 32,64,128,256 --recipes tensor   (-> results/sweep_audit.json)
    python -m benchmarks.render              (BENCHMARKS.md and its heatmaps docs/sweep_ratio.png, sweep_floor.png)

Per shape: our ``scaled_mm`` (into a NaN-poisoned ``out``) and cuBLAS for the same recipe (``tools.baselines``) on
the same data, timed in ``--rounds`` interleaved rounds (ours, cuBLAS, ours, cuBLAS; ``common.bench``: L2
emptied before each run); the ratio is cuBLAS us / ours us (above 1: faster than cuBLAS). Each row names the
instance and K splits dispatch picked, its TFLOPS and GB/s, and its fraction of the shape's floor: the longer of
the minimum traffic (A and W read once, the output written once) at ``--hbm-rate`` and the MMAs at
``--tc-rate``, by default the measured floor (benchmarks.measure_floor) of this GPU (``common.measured_floors``).
Our result's relative error against cuBLAS's (against the float64 reference where cuBLAS refuses the shape) is
checked too: a row over ``--tol`` is reported and counted. cuBLAS's refusals (F.scaled_mm's blockwise
recipe at M = 1) leave the ratio empty.

``--audit`` also times every instance of the recipe's table family on each shape (whatever its M range),
unsplit and with dispatch's split (``--audit-splits``), and records the fastest: where it beats the pick,
dispatch's model is wrong for that shape.
"""

from __future__ import annotations

import argparse
import time

import torch

import cutedsl_gemm
from cutedsl_gemm import problem as P
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch, instances
from cutedsl_gemm.tools.baselines import cublas_call, make_operands

from . import common, render
from .tune_tiles import direct_call, interleaved_times, tile_label

# (model, N, K) of the layers swept: Llama-3-8B and -70B (qkv, o, gate+up, down) and DeepSeek-V3's dense GEMMs.
LAYERS = (
    ("Llama-3-8B", 6144, 4096), ("Llama-3-8B", 4096, 4096), ("Llama-3-8B", 28672, 4096), ("Llama-3-8B", 4096, 14336),
    ("Llama-3-70B", 10240, 8192), ("Llama-3-70B", 8192, 8192), ("Llama-3-70B", 57344, 8192),
    ("Llama-3-70B", 8192, 28672),
    ("DeepSeek-V3", 4608, 7168), ("DeepSeek-V3", 7168, 2048), ("DeepSeek-V3", 1536, 7168), ("DeepSeek-V3", 576, 7168),
    ("DeepSeek-V3", 3072, 1536),
)
MS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
RECIPES = ("tensor", "row", "1x128_128x128")
ARCH = "sm_90a"
TOL = 1e-2  # relative error against cuBLAS's result: both are ~2e-3 from the float64 reference (bf16 output)

COLUMNS = ["recipe", "layer", "M", "N", "K", "ours us", "cuBLAS us", "ratio", "instance", "splits", "TFLOPS",
           "GB/s", "floor us", "bound", "of floor", "error"]
AUDIT_COLUMNS = ["best", "best splits", "best us", "best ratio"]


def floor_us(m, n, k, tc_tflops, hbm_tbps):
    """(us, bound) of an M x N x K FP8 GEMM with a bf16 output: the longer of its minimum traffic (A and W read
    once, the output written once) at ``hbm_tbps`` ("HBM") and its MMAs at ``tc_tflops`` ("MMA")."""
    memory = (m * k + n * k + 2 * m * n) / (hbm_tbps * 1e12) * 1e6
    mma = 2.0 * m * n * k / (tc_tflops * 1e12) * 1e6
    return (memory, "HBM") if memory >= mma else (mma, "MMA")


def floor_rates(tc_rate=None, hbm_rate=None):
    """(TFLOPS, TB/s, where from) of the floor: the rates given, the others this GPU's ``common.measured_floors()``
    (read only where a rate is not given)."""
    given = [f"{what} from {option}" for what, option, rate in (("TFLOPS", "--tc-rate", tc_rate),
                                                               ("TB/s", "--hbm-rate", hbm_rate)) if rate]
    if len(given) == 2:
        return tc_rate, hbm_rate, ", ".join(given)
    floors = common.measured_floors()
    where = ", ".join(given + [("the other " if given else "") + "measured on this GPU (benchmarks.measure_floor)"])
    return tc_rate or floors.fp8_tflops, hbm_rate or floors.hbm_tbps, where


def layer_name(n, k):
    """The model a swept (N, K) belongs to, or "-" for shapes given by ``--nk``."""
    return next((name for name, ln, lk in LAYERS if (ln, lk) == (n, k)), "-")


def family(recipe, accum="promoted"):
    """The table's instances that can run ``recipe`` on e4m3 operands into bf16 without bias, whatever their
    M range, last-wave split variants included: what dispatch chooses among, and what ``--audit`` times."""
    rows = instances.select(arch=ARCH, op="gemm", recipe=recipe, a_dtype="e4m3", b_dtype="e4m3",
                            out_dtype="bf16", bias_dtype=None, accum=accum)
    return tuple(dict.fromkeys(rows))


def audit_runs(recipe, m, n, k, slots_of, want_splits=(0, 1)):
    """(instance, K splits) pairs ``--audit`` times for one shape: every ``family`` instance with each split of
    ``want_splits`` (0: dispatch's choice) it can run, last-wave variants only with the split dispatch would
    give them. ``slots_of(inst)``: CTAs resident at once."""
    runs = []
    for inst in family(recipe):
        slots = slots_of(inst)
        if inst.split_tail:
            splits = {dispatch.splits_for(inst, m, n, k, slots)} - {1}  # unsplit, it is its sibling, slower
        else:
            splits = {dispatch.splits_for(inst, m, n, k, slots, want) for want in want_splits}
        runs += [(inst, s) for s in sorted(splits)]
    return runs


def cpu_slots(sms):
    """``slots_of`` for planning without a GPU: CTAs resident at once by ``dispatch.cluster_slots``."""
    def slots_of(inst):
        size = inst.cluster_m * inst.cluster_n
        return dispatch.cluster_slots(sms, size) * size * inst.ctas_per_sm
    return slots_of


def gpu_slots(inst):
    """CTAs resident at once on GPU 0, as ``scaled_mm`` counts them."""
    return launch.launch_clusters(0, inst) * inst.cluster_m * inst.cluster_n


def parse_nk(text):
    """[(N, K), ...] from "NxK,..."."""
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--nk: expected NxK,... (e.g. 8192x8192,57344x8192), got {text!r}")
    return shapes


def measure_shape(recipe, m, n, k, args, tc_rate, hbm_rate):
    """One sweep row (a list of ``COLUMNS``, plus ``AUDIT_COLUMNS`` with ``--audit``) for one shape."""
    qa, qw, sa, sb, plain = make_operands(m, n, k, recipe)
    b = qw.t()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")

    def ours():
        cutedsl_gemm.scaled_mm(qa, b, sa, sb, out_dtype=torch.bfloat16, out=out)

    problem, _ = P.describe_scaled_mm(qa, b, sa, sb, None, torch.bfloat16, out, False, None, None, None, None,
                                      qa.device)
    inst, splits = dispatch.select(problem)
    cublas = cublas_call(recipe, qa, b, sa, sb)
    try:
        want = cublas().clone()
    except (RuntimeError, ValueError):  # cuBLAS refuses some recipe/shape pairs (blockwise at M = 1)
        cublas, want = None, R.reference_gemm(*plain, recipe)
    ours()
    err = R.rel_error(out, want)
    (t_o, _), (t_c, _) = interleaved_times([ours, cublas], args.rounds)
    fl, bound = floor_us(m, n, k, tc_rate, hbm_rate)
    row = [recipe, layer_name(n, k), m, n, k, round(t_o, 2), round(t_c, 2), round(t_c / t_o, 3), tile_label(inst),
           splits, round(common.tflops(m, n, k, t_o / 1e3), 1), round(common.gbps(m, n, k, t_o / 1e3)),
           round(fl, 2), bound, round(fl / t_o, 3), float(f"{err:.2e}")]
    flag = "  ERROR over tolerance" if not err <= args.tol else ""
    print(f"{recipe:14s} {m:5d} {n:6d} {k:6d} | {t_o:8.1f} {t_c:9.1f} {t_c / t_o:6.3f} | {tile_label(inst):22s} "
          f"split {splits:2d} | {fl / t_o:5.2f} of {bound} floor | err {err:.1e}{flag}", flush=True)
    if args.audit:
        row += audit_shape(recipe, (m, n, k), (qa, b, sa, sb), want, t_c, args)
    return row


def audit_shape(recipe, mnk, operands, want, t_c, args):
    """[best instance, its splits, its us, cuBLAS us / its us] over ``audit_runs``, each checked against ``want``
    and timed interleaved with the others; the candidates are printed."""
    m, n, k = mnk
    qa, b, sa, sb = operands
    _, sa_k, sb_k = scale_layouts.resolve(sa, sb, m, n, k)
    calls = []
    for inst, splits in audit_runs(recipe, m, n, k, gpu_slots, args.audit_splits):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        call, splits, _ = direct_call(inst, qa, b, sa_k, sb_k, out, mnk, splits)
        call()
        calls.append((inst, splits, call, R.rel_error(out, want)))
    times = interleaved_times([c[2] for c in calls], args.rounds)
    best = None
    for (inst, splits, _, err), (t, _) in zip(calls, times):
        ok = err <= args.tol
        print(f"    {inst.schedule:12s} {tile_label(inst):22s} split {splits:2d} {t:8.1f} us x{t_c / t:5.2f} "
              f"err {err:.1e}{'' if ok else '  ERROR over tolerance'}")
        if ok and (best is None or t < best[2]):
            best = (tile_label(inst), splits, t)
    if best is None:
        return [None, None, None, None]
    return [best[0], best[1], round(best[2], 2), round(t_c / best[2], 3)]


def precompile(recipes, jobs):
    """Compile every ``family`` instance of ``recipes`` into the disk cache (``cutedsl-gemm precompile`` on
    their exact names)."""
    from cutedsl_gemm.generators.precompile import precompile as fill

    names = [i.name for recipe in recipes for i in family(recipe)]
    report = fill(ARCH, names, jobs)
    if report.failed:
        raise SystemExit("failed: " + ", ".join(name for name, _ in report.failed))
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default=",".join(map(str, MS)), help="M values (default: %(default)s)")
    p.add_argument("--nk", default=",".join(f"{n}x{k}" for _, n, k in LAYERS),
                   help="layer shapes NxK,... (default: the 13 layers of LAYERS)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="default: %(default)s")
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds per shape (default: 2)")
    p.add_argument("--tc-rate", type=float, default=None,
                   help="FP8 tensor-core TFLOPS of the floor (default: the measured floor, benchmarks.measure_floor)")
    p.add_argument("--hbm-rate", type=float, default=None,
                   help="HBM TB/s of the floor (default: the measured floor, benchmarks.measure_floor)")
    p.add_argument("--tol", type=float, default=TOL, help="relative error a row may have (default: %(default)s)")
    p.add_argument("--audit", action="store_true", help="also time every instance of each recipe's family")
    p.add_argument("--audit-splits", default="0,1",
                   help="K splits --audit runs each instance with; 0 = dispatch's choice (default: %(default)s)")
    p.add_argument("--precompile-only", action="store_true",
                   help="compile the instances of --recipes' families into the disk cache and stop (no GPU needed)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles of --precompile-only (default: CPUs)")
    p.add_argument("--flush", default=common.FLUSH, choices=("read", "zero"),
                   help="L2 eviction before each run (common.bench)")
    common.add_result_options(p)
    args = p.parse_args(argv)
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if not family(r)]
    if unknown:
        p.error(f"no {ARCH} instances for recipe(s) {', '.join(unknown)}; expected some of: {', '.join(RECIPES)}")
    if args.precompile_only:
        return precompile(recipes, args.jobs)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    args.audit_splits = [int(s) for s in args.audit_splits.split(",")]
    try:
        ms = [int(m) for m in args.ms.split(",")]
    except ValueError:
        p.error(f"--ms: expected M,... (e.g. 1,16,128), got {args.ms!r}")
    nks = parse_nk(args.nk)
    common.FLUSH = args.flush
    tc_rate, hbm_rate, rates_from = floor_rates(args.tc_rate, args.hbm_rate)
    print(f"floor: {hbm_rate:g} TB/s, {tc_rate:g} TFLOPS ({rates_from}); ratio = cuBLAS us / ours us")
    start, rows = time.perf_counter(), []
    for recipe in recipes:
        for n, k in nks:
            for m in ms:
                rows.append(measure_shape(recipe, m, n, k, args, tc_rate, hbm_rate))
    columns = COLUMNS + (AUDIT_COLUMNS if args.audit else [])
    summary = render.sweep_summary(columns, rows)
    for key, value in summary.items():
        print(f"  {key}: {value}")
    print(f"{len(rows)} shapes in {time.perf_counter() - start:.0f} s")
    bad = sum(1 for r in rows if not r[COLUMNS.index("error")] <= args.tol)
    notes = (f"{common.timing_notes()}; {args.rounds} interleaved rounds of ours and cuBLAS; ratio = cuBLAS us / "
             f"ours us; floor: the longer of A, W and the output at {hbm_rate:g} TB/s and the MMAs at "
             f"{tc_rate:g} TFLOPS ({rates_from}); error: relative to cuBLAS's result (to the float64 reference where "
             f"cuBLAS refuses the shape), {bad} over {args.tol:g}")
    if args.audit:
        notes += "; best: the fastest instance of the recipe's family on the shape, any M range, unsplit or split"
    name = "sweep_audit" if args.audit else "sweep"
    title = "FP8 GEMM sweep, LLM layer shapes at M = 1..4096" + (", every instance timed" if args.audit else "")
    common.save_result(args, name, title, columns, rows, summary=summary, notes=notes)
    return rows


if __name__ == "__main__":
    main()
