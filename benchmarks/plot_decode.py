"""Decode plot (time vs M at N = K = 8192) from bench_gemm JSON results: ours, cuBLAS FP8 and cuBLAS BF16 per
recipe, and the time the FP8 weight takes to stream at the measured and the datasheet HBM bandwidth.

    python -m benchmarks.plot_decode gemm_promoted.json [decode_block.json ...] --out docs/decode.png

Needs matplotlib (``pip install cutedsl_gemm[bench]``); it runs wherever the JSON files are, no GPU needed.
"""

from __future__ import annotations

import argparse
import json

from .common import HBM_TBPS

DATASHEET_TBPS = 3.35
STYLES = {"tensor": "tab:blue", "row": "tab:orange", "1x128_128x128": "tab:green"}


def decode_rows(paths, n=8192, k=8192):
    rows = []
    for p in paths:
        with open(p) as f:
            rows += [r for r in json.load(f) if r["n"] == n and r["k"] == k and r["m"] <= 128 and not r.get("fast_accum")]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("json", nargs="+")
    p.add_argument("--out", default="decode.png")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = decode_rows(args.json)
    if not rows:
        raise SystemExit("no N=K=8192, M<=128 rows in the given files")
    fig, ax = plt.subplots(figsize=(8, 5))
    for recipe, color in STYLES.items():
        sel = sorted((r for r in rows if r["recipe"] == recipe), key=lambda r: r["m"])
        if not sel:
            continue
        ms = [r["m"] for r in sel]
        ax.plot(ms, [r["ours_us"] for r in sel], "o-", color=color, label=f"cutedsl_gemm {recipe}")
        cub = [(r["m"], r["cublas_us"]) for r in sel if r.get("cublas_us") == r.get("cublas_us") and r.get("cublas_us")]
        if cub:
            ax.plot(*zip(*cub), "s--", color=color, alpha=0.6, label=f"cuBLAS FP8 {recipe}")
    bf16 = sorted({r["m"]: r["bf16_us"] for r in rows if r.get("bf16_us")}.items())
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
    ax.set_title("Decode GEMM, N = K = 8192, H100 (median, L2 emptied by reads before each run)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
