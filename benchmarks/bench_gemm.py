"""FP8 GEMM benchmark on a Hopper GPU against cuBLAS (torch._scaled_mm / F.scaled_mm), same recipe and inputs.

    python -m benchmarks.bench_gemm --sets dsv3 --recipes tensor,row,1x128_128x128     (-> results/gemm_dsv3.json)
    python -m benchmarks.bench_gemm --sets decode --recipes tensor,row,1x128_128x128   (-> results/gemm_decode.json)
    python -m benchmarks.bench_gemm --sets square --recipes tensor,row --fast-accum    (-> gemm_square_fast.json)
    python -m benchmarks.bench_gemm --e2e      (bf16 activations in: quantize + GEMM, ours vs torch + cuBLAS)
    python -m benchmarks.bench_gemm --sets square,dsv3 --recipes int8 --name gemm_int8   (W8A8, see below)

Prints one row per shape: our time, cuBLAS's in the same run, their ratio (cuBLAS / ours: above 1 is faster
than cuBLAS), TFLOPS and GB/s, each as % of the measured floor (benchmarks.measure_floor), the time of the same
product in BF16 (torch.matmul), and the relative error of both FP8 results against the float64 reference;
then geomeans per set and recipe. The run's table goes to benchmarks/results/<name>.json (see common.write_result):
decode shapes (M <= 128) report bandwidth, the others TFLOPS.

Recipe ``int8`` (W8A8: int8 operands, per-token x per-channel scales) times our int8 scaled_mm against
``torch._int_mm`` followed by the scale multiply in torch (in the cuBLAS columns; it refuses M <= 16), and adds
our per-tensor FP8 GEMM with fast accumulation on the same shapes (the kernel the int8 one shares, at the same
tensor-core rate) as the "FP8 us" column.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.tools.baselines import cublas_call, int_mm_call, make_operands

from . import common
from .common import SET_TITLES, SETS, bench, gbps, geomean, tflops

DECODE_MAX_M = 128  # up to here a GEMM is bound by streaming W: its table reports bandwidth
INT8 = "int8"  # the W8A8 rows: int8 operands with row-wise scales, against torch._int_mm + the scale multiply


def measure_one(set_name, m, n, k, recipe, check=True, fast_accum=False):
    """Ours, cuBLAS and BF16 on the same data for one shape and recipe, with both low-precision results' errors
    (and for ``int8``, our per-tensor FP8 GEMM's time); rates as % of this GPU's ``common.measured_floors()``."""
    floors = common.measured_floors()
    int8 = recipe == INT8
    scales = "row" if int8 else recipe
    qa, qw, sa, sb, plain = make_operands(m, n, k, scales, fmt_a="int8" if int8 else "e4m3",
                                          fmt_b="int8" if int8 else "e4m3")
    b = qw.t()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")

    def ours():
        cutedsl_gemm.scaled_mm(qa, b, sa, sb, out_dtype=torch.bfloat16, out=out, use_fast_accum=fast_accum)

    cublas = int_mm_call(qa, b, sa, sb) if int8 else cublas_call(recipe, qa, b, sa, sb, fast_accum)
    ours()
    ref = R.reference_gemm(*plain, scales) if check else None
    err = R.rel_error(out, ref) if check else float("nan")
    try:
        c_out = cublas()
        c_err = R.rel_error(c_out, ref) if check else float("nan")
        t_c = bench(cublas) * 1e3
    except (RuntimeError, ValueError):  # cuBLAS refuses some recipe/shape pairs (e.g. 128x128 x 128x128)
        c_err, t_c = float("nan"), float("nan")
    t_o = bench(ours) * 1e3
    abf, wbf = qa.to(torch.bfloat16), qw.to(torch.bfloat16)
    t_bf = bench(lambda: torch.matmul(abf, wbf.t())) * 1e3
    tf = tflops(m, n, k, t_o / 1e3)
    row = dict(set=set_name, recipe=recipe, fast_accum=fast_accum, m=m, n=n, k=k, ours_us=t_o, cublas_us=t_c,
               bf16_us=t_bf, ratio=t_c / t_o, tflops=tf, pct_peak=common.pct_of_fp8_peak(tf, floors),
               gbps=gbps(m, n, k, t_o / 1e3), err=err, cublas_err=c_err)
    row["pct_hbm"] = common.pct_of_hbm(row["gbps"], floors)
    if int8:
        row["fp8_us"] = fp8_tensor_us(m, n, k)
    return row


def fp8_tensor_us(m, n, k):
    """Our per-tensor FP8 GEMM with fast accumulation (the int8 kernels' FP8 twin) on an M x N x K shape, in us."""
    qa, qw, sa, sb, _ = make_operands(m, n, k, "tensor")
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    return bench(lambda: cutedsl_gemm.scaled_mm(qa, qw.t(), sa, sb, out=out, use_fast_accum=True)) * 1e3


def measure(sets, recipes, check=True, fast_accum=False):
    """One dict per (set, shape, recipe), printed as it is measured."""
    rows = []
    print(f"{'set':16s} {'recipe':15s} {'M':>5s} {'N':>5s} {'K':>5s} | {'ours us':>8s} {'cuBLAS us':>9s} "
          f"{'ratio':>6s} | {'TFLOPS':>7s} {'%peak':>6s} {'GB/s':>6s} | {'err':>8s} {'cublas err':>10s} | bf16 us")
    for set_name in sets:
        for (m, n, k) in SETS[set_name]:
            for recipe in recipes:
                r = measure_one(set_name, m, n, k, recipe, check, fast_accum)
                rows.append(r)
                fp8 = f" | FP8 us {r['fp8_us']:.1f}" if "fp8_us" in r else ""
                print(f"{set_name:16s} {recipe:15s} {m:5d} {n:5d} {k:5d} | {r['ours_us']:8.1f} {r['cublas_us']:9.1f} "
                      f"{r['ratio']:6.3f} | {r['tflops']:7.0f} {r['pct_peak']:5.1f}% {r['gbps']:6.0f} | "
                      f"{r['err']:8.2e} {r['cublas_err']:10.2e} | {r['bf16_us']:.1f}{fp8}")
    return rows


def geomeans(rows, sets, recipes):
    """{(set, recipe): (ratio, ours us, cuBLAS us)} geomeans, printed."""
    out = {}
    print("\ngeomeans (cuBLAS time / our time; >1 means faster than cuBLAS):")
    for set_name in sets:
        for recipe in recipes:
            sel = [r for r in rows if r["set"] == set_name and r["recipe"] == recipe]
            if sel:
                g = tuple(geomean([r[c] for r in sel]) for c in ("ratio", "ours_us", "cublas_us"))
                out[(set_name, recipe)] = g
                print(f"  {set_name:16s} {recipe:15s} ratio {g[0]:.3f}  ours {g[1]:.1f} us  cuBLAS {g[2]:.1f} us")
                if recipe == INT8:  # int8 beside the per-tensor FP8 GEMM: FP8 us / int8 us (1: the same time)
                    print(f"  {set_name:16s} {recipe:15s} FP8 us / int8 us "
                          f"{geomean([r['fp8_us'] / r['ours_us'] for r in sel]):.3f}")
    return out


def result_table(rows, sets, floors=None):
    """(columns, rows) of the result file: bandwidth columns where every shape is a decode shape, else TFLOPS, each
    with its % of the floor the rows were measured against (``floors``, a ``common.Floors``, names it in the
    header; without it the header says "floor")."""
    memory_bound = all(r["m"] <= DECODE_MAX_M for r in rows)
    head = ["set"] if len(sets) > 1 else []
    if memory_bound:
        rate = ["GB/s", f"% of {floors.hbm if floors else 'HBM floor'}"]
    else:
        rate = ["TFLOPS", f"% of {floors.fp8 if floors else 'FP8 floor'}"]
    fp8 = any("fp8_us" in r for r in rows)  # int8 rows: our per-tensor FP8 GEMM on the same shape
    columns = head + ["recipe", "M", "N", "K", "ours us", "cuBLAS us", "ratio", *rate, "BF16 us"] + ["FP8 us"] * fp8
    table = []
    for r in rows:
        rates = ([round(r["gbps"]), round(r["pct_hbm"], 1)] if memory_bound
                 else [round(r["tflops"], 1), round(r["pct_peak"], 1)])
        table.append(([r["set"]] if head else []) + [r["recipe"], r["m"], r["n"], r["k"], round(r["ours_us"], 2),
                                                     round(r["cublas_us"], 2), round(r["ratio"], 3), *rates,
                                                     round(r["bf16_us"], 2)]
                     + [round(r.get("fp8_us", float("nan")), 2)] * fp8)
    return columns, table


def default_name(sets, fast_accum):
    return "gemm_" + "_".join(sets) + ("_fast" if fast_accum else "")


def title(sets, fast_accum, recipes=()):
    where = ", ".join(SET_TITLES.get(s, s) for s in sets)
    kind = "INT8 (W8A8) GEMM" if list(recipes) == [INT8] else "FP8 GEMM"
    return f"{kind}, {where}" + (" (use_fast_accum=True)" if fast_accum else "")


def run(sets, recipes, args=None, check=True, fast_accum=False):
    rows = measure(sets, recipes, check, fast_accum)
    means = geomeans(rows, sets, recipes)
    if args is not None:
        floors = common.measured_floors()
        columns, table = result_table(rows, sets, floors)
        summary = {f"geomean ratio {s + ' ' if len(sets) > 1 else ''}{rec}": round(g[0], 3)
                   for (s, rec), g in means.items()}
        notes = f"{common.timing_notes()}; cuBLAS timed in the same run; ratio = cuBLAS us / ours us; {floors.note()}"
        if INT8 in recipes:
            notes += "; int8: cuBLAS column = torch._int_mm + the scale multiply in torch; FP8 us = our per-tensor " \
                     "FP8 GEMM with use_fast_accum=True"
            summary.update({f"geomean FP8/int8 {s}": round(geomean([r["fp8_us"] / r["ours_us"] for r in rows
                                                                    if r["set"] == s and r["recipe"] == INT8]), 3)
                            for s in sets})
        common.save_result(args, default_name(sets, fast_accum), title(sets, fast_accum, recipes), columns, table,
                           summary=summary, notes=notes)
    return rows


def torch_quantize_1x128(x):
    """What a torch user writes today: per-(row, 128-column group) amax, scale, cast (F.scaled_mm layout)."""
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    scale = (g.abs().amax(dim=2) / 448.0).clamp_min(1e-12)
    q = (g / scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)
    return q, scale.t().contiguous().t()


def e2e_one(m, n, k):
    """bf16 activations in, bf16 out, weights pre-quantized (128x128): quantize_fp8 + scaled_mm against
    torch quantization + F.scaled_mm (cuBLAS), same data. (ours us, theirs us, our error, theirs)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qw, sw = cutedsl_gemm.quantize_fp8(w, "128x128", scale_layout="padded")
    sw_b = sw.t()  # (round_up(Kb, 4), ceil(N/128)): cuBLAS's padded BlockWise128x128 operand

    def ours():
        qx, sx = cutedsl_gemm.quantize_fp8(x, "1x128")
        return cutedsl_gemm.scaled_mm(qx, qw.t(), sx, sw_b)

    def theirs():
        qx, sx = torch_quantize_1x128(x)
        return F.scaled_mm(qx, qw.t(), sx, F.ScalingType.BlockWise1x128, sw_b, F.ScalingType.BlockWise128x128,
                           output_dtype=torch.bfloat16)

    ref = x.double() @ w.double().t()
    err, t_err = R.rel_error(ours(), ref), R.rel_error(theirs(), ref)
    return bench(ours) * 1e3, bench(theirs) * 1e3, err, t_err


def run_e2e(shapes, args=None):
    """``e2e_one`` per shape, printed, and the result file ``gemm_e2e``."""
    rows = []
    print(f"{'M':>5s} {'N':>5s} {'K':>5s} | {'ours us':>8s} {'torch+cuBLAS us':>15s} {'ratio':>6s} | "
          f"{'err':>8s} {'torch err':>9s}")
    for (m, n, k) in shapes:
        t_o, t_t, err, t_err = e2e_one(m, n, k)
        rows.append([m, n, k, round(t_o, 2), round(t_t, 2), round(t_t / t_o, 3), float(f"{err:.2e}"),
                     float(f"{t_err:.2e}")])
        print(f"{m:5d} {n:5d} {k:5d} | {t_o:8.1f} {t_t:15.1f} {t_t / t_o:6.3f} | {err:8.2e} {t_err:9.2e}")
    ratio = geomean([r[5] for r in rows])
    print(f"geomean ratio {ratio:.3f}")
    if args is not None:
        columns = ["M", "N", "K", "ours us", "torch + cuBLAS us", "ratio", "error", "torch error"]
        common.save_result(args, "gemm_e2e", "Quantize + GEMM from bf16 activations, DeepSeek recipe", columns, rows,
                           summary={"geomean ratio": round(ratio, 3)},
                           notes=f"{common.timing_notes()}; ours: quantize_fp8 + scaled_mm; theirs: torch "
                                 "quantization + F.scaled_mm (cuBLAS); errors against float64")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="dsv3", help=f"comma-separated, of: {', '.join(SETS)}")
    p.add_argument("--recipes", default="tensor,row,1x128_128x128")
    p.add_argument("--fast-accum", action="store_true", help="use_fast_accum=True for both us and cuBLAS")
    p.add_argument("--shapes", default=None, help="MxNxK,... instead of the named sets (result name: gemm_custom)")
    p.add_argument("--e2e", action="store_true", help="quantize + GEMM end to end (DeepSeek recipe, M >= 1024)")
    p.add_argument("--flush", default=common.FLUSH, choices=("read", "zero"),
                   help="L2 eviction before each run (common.bench)")
    common.add_result_options(p)
    args = p.parse_args(argv)
    common.FLUSH = args.flush
    if args.e2e:
        common.require_gpu("bench_gemm")
        run_e2e([(m, n, k) for (m, n, k) in SETS["dsv3"] if k % 128 == 0] + [(8192, 8192, 8192)], args)
        return
    sets = args.sets.split(",")
    if args.shapes:
        SETS["custom"] = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
        sets = ["custom"]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        p.error(f"unknown set(s) {', '.join(unknown)}; expected some of: {', '.join(SETS)}")
    print(f"use_fast_accum={args.fast_accum}")
    run(sets, args.recipes.split(","), args, fast_accum=args.fast_accum)


if __name__ == "__main__":
    main()
