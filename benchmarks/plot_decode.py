"""Decode plot (time vs M at N = K = 8192) from bench_gemm result files: ours, cuBLAS FP8 and torch BF16 per
recipe, and the time the FP8 weight takes to stream at the measured and the datasheet HBM bandwidth.

    python -m benchmarks.plot_decode benchmarks/results/gemm_decode.json --out docs/decode.png

Needs matplotlib (``pip install -e .[bench]``); it runs wherever the result files are, no GPU needed.
"""

from __future__ import annotations

import argparse
import json

from .common import HBM_TBPS

DATASHEET_TBPS = 3.35
STYLES = {"tensor": "tab:blue", "row": "tab:orange", "1x128_128x128": "tab:green"}


def decode_rows(paths, n=8192, k=8192):
    """The rows of bench_gemm result files at this N and K with M <= 128, as dicts keyed by column name;
    also the GPU named by the first file."""
    rows, gpu = [], None
    for p in paths:
        with open(p) as f:
            result = json.load(f)
        if "use_fast_accum=True" in result["title"]:
            continue
        gpu = gpu or result["gpu"]
        for cells in result["rows"]:
            r = dict(zip(result["columns"], cells))
            if r["N"] == n and r["K"] == k and r["M"] <= 128:
                rows.append(r)
    return rows, gpu


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
    weight_bytes = 8192 * 8192
    for tbps, style in ((HBM_TBPS, "-"), (DATASHEET_TBPS, "--")):
        ax.axhline(weight_bytes / (tbps * 1e6), color="black", linestyle=style, linewidth=1,
                   label=f"FP8 weight streamed at {tbps} TB/s")
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
