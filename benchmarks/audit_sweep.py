"""Dispatch's picks against the fastest instance timed by ``bench_sweep --audit`` (no GPU needed).

    python -m benchmarks.bench_sweep --audit --ms 32,64,128 --recipes tensor --name audit_tensor > audit_tensor.txt
    python -m benchmarks.audit_sweep audit_tensor.txt audit_row.txt [--sweep results/sweep.json] [--sms 132]

An audit's printed output holds every candidate it timed per shape (its result file only the fastest; given a
``.json``, the ``.txt`` beside it is read if there is one). For each audited shape this prints the pick recorded
in the run, the pick of the current ``dispatch`` model (``select_gemm`` and ``plan_splits`` on ``--sms`` SMs), the
fastest instance timed and each pick's time, then the geomean of best us / pick us for both: 1.000 means the
model picks the fastest instance everywhere. A pick the audit never timed (a new row, or a split it did not run)
prints as "untimed" and is left out of the geomean. With ``--sweep``: the sweep's shapes whose pick the current
model changes, and its shapes under ``--below`` x cuBLAS. Last, the ``bench_sweep --audit`` commands that would
time every untimed pick.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path

from cutedsl_gemm.selection import dispatch

from .bench_sweep import ARCH, cpu_slots
from .tune_tiles import tile_label

_SHAPE = re.compile(r"^(\S+)\s+(\d+)\s+(\d+)\s+(\d+) \|\s+(\S+)\s+(\S+)\s+\S+ \| (t\S+ c\S+)\s+split\s+(\d+) \|")
_CANDIDATE = re.compile(r"^    \S+\s+(t\S+ c\S+)\s+split\s+(\d+)\s+([\d.]+) us .*err \S+(\s+ERROR)?")


def _number(text):
    try:
        return float(text)
    except ValueError:
        return math.nan


def parse_audit(path):
    """{(recipe, M, N, K): {"ours": us, "cublas": us, "pick": (label, splits), "timed": {(label, splits): us}}}
    from an audit's printed output (candidates over the error tolerance are left out), or from its result file
    (only the fastest instance) where no printed output lies beside it."""
    path = Path(path)
    if path.suffix == ".json":
        text = path.with_suffix(".txt")
        if text.exists():
            path = text
        else:
            return _parse_result(json.loads(path.read_text()))
    shapes, shape = {}, None
    for line in path.read_text().splitlines():
        if got := _SHAPE.match(line):
            shape = (got[1], int(got[2]), int(got[3]), int(got[4]))
            shapes[shape] = {"ours": _number(got[5]), "cublas": _number(got[6]), "pick": (got[7], int(got[8])),
                             "timed": {}}
        elif (got := _CANDIDATE.match(line)) and shape and not got[4]:
            shapes[shape]["timed"][(got[1], int(got[2]))] = float(got[3])
    if not shapes:
        raise SystemExit(f"{path}: no sweep rows found (expected the printed output of bench_sweep --audit)")
    return shapes


def _parse_result(record):
    col = {c: i for i, c in enumerate(record["columns"])}
    if "best" not in col:
        raise SystemExit(f"result {record.get('name')!r} has no 'best' column: not a bench_sweep --audit result")
    shapes = {}
    for r in record["rows"]:
        pick = (r[col["instance"]], r[col["splits"]])
        timed = {pick: r[col["ours us"]]}
        if r[col["best"]] is not None:
            timed[(r[col["best"]], r[col["best splits"]])] = r[col["best us"]]
        shapes[(r[col["recipe"]], r[col["M"]], r[col["N"]], r[col["K"]])] = {
            "ours": r[col["ours us"]], "cublas": r[col["cuBLAS us"]], "pick": pick, "timed": timed}
    return shapes


def model_pick(recipe, m, n, k, sms):
    """(tile label, K splits) the current model launches for an e4m3 x e4m3 -> bf16 call without bias."""
    inst = dispatch.select_gemm(ARCH, recipe, "e4m3", "e4m3", "bf16", None, m, n=n, sms=sms, k=k)
    inst, splits = dispatch.plan_splits(inst, m, n, k, cpu_slots(sms)(inst))
    return tile_label(inst), splits


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else math.nan


def _label(pick, us):
    return f"{pick[0]:20s}/{pick[1]:<2d} " + (f"{us:7.1f}" if us is not None else "untimed")


def report_audit(shapes, sms):
    """Print the per-shape table and the geomeans; return the shapes whose current pick is untimed."""
    ratios, untimed = defaultdict(lambda: ([], [])), []
    print(f"{'recipe':14s} {'M':>5s} {'N':>6s} {'K':>6s} | {'cuBLAS':>7s} | {'recorded pick':31s} | "
          f"{'model pick':31s} | {'best timed':31s} | best/rec best/model")
    for (recipe, m, n, k), shape in sorted(shapes.items()):
        timed = shape["timed"]
        best = min(timed, key=timed.get)
        old = shape["pick"]
        t_old = timed.get(old, shape["ours"])
        new = model_pick(recipe, m, n, k, sms)
        t_new = timed.get(new)
        if t_new is None:
            untimed.append((recipe, m, n, k, new))
        else:
            ratios[recipe][0].append(timed[best] / t_old)
            ratios[recipe][1].append(timed[best] / t_new)
        print(f"{recipe:14s} {m:5d} {n:6d} {k:6d} | {shape['cublas']:7.1f} | {_label(old, t_old)} | "
              f"{_label(new, t_new)} | {_label(best, timed[best])} | {timed[best] / t_old:8.3f} "
              + (f"{timed[best] / t_new:10.3f}" if t_new is not None else f"{'-':>10s}"))
    both = ([], [])
    for recipe, (olds, news) in ratios.items():
        both[0].extend(olds)
        both[1].extend(news)
        print(f"geomean best us / pick us, {recipe}: recorded picks {geomean(olds):.4f}, model picks "
              f"{geomean(news):.4f} ({len(news)} shapes)")
    print(f"geomean best us / pick us, all: recorded picks {geomean(both[0]):.4f}, model picks {geomean(both[1]):.4f} "
          f"({len(both[1])} shapes; {len(untimed)} left out, their model pick untimed)")
    return untimed


def report_sweep(record, sms, below, audited):
    """Print the sweep's shapes whose pick the model changes and its shapes under ``below`` x cuBLAS; return the
    changed shapes the audits did not time, as (recipe, M, N, K)."""
    col = {c: i for i, c in enumerate(record["columns"])}
    changed, losses = [], []
    for r in record["rows"]:
        shape = tuple(r[col[c]] for c in ("recipe", "M", "N", "K"))
        old, new = (r[col["instance"]], r[col["splits"]]), model_pick(*shape, sms)
        line = (f"{shape[0]:14s} {shape[1]:5d} {shape[2]:6d} {shape[3]:6d} | ours {r[col['ours us']]:7.1f} cuBLAS "
                f"{r[col['cuBLAS us']] or math.nan:7.1f} | {old[0]:20s}/{old[1]:<2d} -> {new[0]:20s}/{new[1]:<2d}")
        if new != old:
            changed.append((shape, line))
        ratio = r[col["ratio"]]
        if ratio is not None and ratio < below:
            losses.append(f"{line} | x{ratio:.3f}" + ("  (pick changes)" if new != old else ""))
    print(f"\nsweep of {record.get('date', '?')}: the model changes {len(changed)} of {len(record['rows'])} picks")
    print("\n".join(line for _, line in changed))
    print(f"\nsweep shapes under {below:g} x cuBLAS: {len(losses)}")
    print("\n".join(losses))
    return [shape for shape, _ in changed if shape not in audited]


def audit_commands(shapes):
    """bench_sweep --audit commands timing every (recipe, M, N, K) given, one per recipe and set of M."""
    by_recipe = defaultdict(lambda: defaultdict(set))
    for recipe, m, n, k, *_ in shapes:
        by_recipe[recipe][(n, k)].add(m)
    out = []
    for recipe, layers in sorted(by_recipe.items()):
        groups = defaultdict(list)
        for nk, ms in layers.items():
            groups[tuple(sorted(ms))].append(nk)
        for ms, nks in sorted(groups.items()):
            out.append(f"python -m benchmarks.bench_sweep --audit --rounds 2 --recipes {recipe} "
                       f"--ms {','.join(map(str, ms))} --nk {','.join(f'{n}x{k}' for n, k in sorted(nks))}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("audits", nargs="+", help="bench_sweep --audit output (.txt), or its result (.json)")
    p.add_argument("--sweep", help="a bench_sweep result (.json): list the picks the model changes and the losses")
    p.add_argument("--sms", type=int, default=132, help="SMs dispatch plans for (H100 and H200 SXM: 132)")
    p.add_argument("--below", type=float, default=0.97, help="--sweep: list shapes under this x cuBLAS")
    args = p.parse_args(argv)
    shapes = {}
    for path in args.audits:
        shapes.update(parse_audit(path))
    untimed = report_audit(shapes, args.sms)
    if args.sweep:
        untimed += report_sweep(json.loads(Path(args.sweep).read_text()), args.sms, args.below, set(shapes))
    if untimed:
        print("\nto time the model's untimed picks (each with every instance of its family):")
        print("\n".join(audit_commands(untimed)))


if __name__ == "__main__":
    main()
