"""Top SASS instructions by sampled warp stalls, from `ncu --page source --csv --print-source sass` output
(one CSV block per profiled kernel), with the instructions around each: where a kernel's warps wait.

    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    python -m benchmarks.ncu_hotspots src.csv --top 25
"""

import argparse
import csv
import io


def blocks(text):
    """Split the export into per-kernel CSV blocks (each starts with its own header row)."""
    cur = []
    for line in text.splitlines():
        if line.startswith('"#') or line.startswith('"Address"') or line.startswith('"Source"'):
            if cur:
                yield cur
            cur = [line]
        elif cur:
            cur.append(line)
        else:
            print(line[:160])
    if cur:
        yield cur


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    for block in blocks(open(args.csv, errors="replace").read()):
        rows = list(csv.reader(io.StringIO("\n".join(block))))
        head, body = rows[0], rows[1:]
        src = next((i for i, h in enumerate(head) if h in ("Source", "# Source")), 1)
        samp = next((i for i, h in enumerate(head) if "Sampling (All" in h), None)
        if samp is None:
            print("columns:", head[:12])
            continue
        def val(r):
            try:
                return float(r[samp].replace(",", ""))
            except (ValueError, IndexError):
                return 0.0
        total = sum(val(r) for r in body) or 1.0
        print(f"--- kernel block: {len(body)} instructions, {total:.0f} samples")
        order = sorted(range(len(body)), key=lambda i: -val(body[i]))[: args.top]
        for i in sorted(order):
            r = body[i]
            print(f"{100 * val(r) / total:5.1f}%  {i:5d}  {r[src][:110]}")


if __name__ == "__main__":
    main()
