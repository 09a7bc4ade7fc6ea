"""Decode plot (time vs M at N = K = 8192) from bench_gemm result files of one GPU: ours, cuBLAS FP8 and torch BF16
per recipe, and the time the FP8 weight takes to stream at that GPU's measured floor (benchmarks.measure_floor, the
floor.json beside the first file, when it names the same GPU).

    python -m benchmarks.plot_decode benchmarks/results/gemm_decode.json --out docs/decode.png

Needs matplotlib (``pip install -e .[bench]``); it runs wherever the result files are, no GPU needed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import common

STYLES = {"tensor": "tab:blue", "row": "tab:orange", "1x128_128x128": "tab:green"}


def decode_rows(paths, n=8192, k=8192):
    """The rows of bench_gemm result files at this N and K with M <= 128, as dicts keyed by column name; also
    the GPU they were measured on (SystemExit where the files name different GPUs: one plot never mixes them)."""
    rows, gpus = [], {}
    for p in paths:
        with open(p) as f:
            result = json.load(f)
        if "use_fast_accum=True" in result["title"]:
            continue
        gpus.setdefault(result["gpu"], str(p))
        for cells in result["rows"]:
            r = dict(zip(result["columns"], cells))
            if r["N"] == n and r["K"] == k and r["M"] <= 128:
                rows.append(r)
    if len(gpus) > 1:
        raise SystemExit("plot_decode: the files were measured on different GPUs ("
                         + "; ".join(f"{gpu}: {path}" for gpu, path in gpus.items()) + "); plot each GPU's apart")
    return rows, next(iter(gpus), None)


def floor_tbps(paths, gpu):
    """The HBM floor ``benchmarks.measure_floor`` recorded for ``gpu`` in the floor.json beside the first result
    file, or None where there is none for that GPU."""
    try:
        return common.read_floors(Path(paths[0]).parent / f"{common.FLOOR_NAME}.json", gpu).hbm_tbps
    except common.FloorError:
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="bench_gemm result files (benchmarks/results/gemm_*.json)")
    p.add_argument("--out", default="decode.png")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, gpu = decode_rows(args.results)
    if not rows:
        raise SystemExit("no N=K=8192, M<=128 rows in the given files")
    fig, ax = plt.subplots(figsize=(8, 5))
    for recipe, color in STYLES.items():
        sel = sorted((r for r in rows if r["recipe"] == recipe), key=lambda r: r["M"])
        if not sel:
            continue
        ax.plot([r["M"] for r in sel], [r["ours us"] for r in sel], "o-", color=color, label=f"cutedsl_gemm {recipe}")
        cub = [(r["M"], r["cuBLAS us"]) for r in sel if r["cuBLAS us"] is not None]
        if cub:
            ax.plot(*zip(*cub), "s--", color=color, alpha=0.6, label=f"cuBLAS FP8 {recipe}")
    bf16 = sorted({r["M"]: r["BF16 us"] for r in rows if r.get("BF16 us")}.items())
    if bf16:
        ax.plot(*zip(*bf16), "^:", color="gray", label="cuBLAS BF16 (torch.matmul)")
    tbps = floor_tbps(args.results, gpu)
    if tbps:
        ax.axhline(8192 * 8192 / (tbps * 1e6), color="black", linewidth=1,
                   label=f"FP8 weight streamed at {tbps:g} TB/s (measured)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("time per GEMM (us)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Decode GEMM, N = K = 8192, {gpu} (median, L2 emptied by reads before each run)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
