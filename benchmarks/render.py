"""Render BENCHMARKS.md, the README's performance block and docs/perf.png from benchmark result files.

    python -m benchmarks.render [--results DIR] [--benchmarks FILE] [--readme FILE] [--plot FILE] [--check]

Each maintained benchmark writes one JSON file per run into ``benchmarks/results/<name>.json`` (fields: name,
title, command, gpu, gpu_facts, date, versions, run_s, notes, columns, rows, summary). This module only reads them: it
imports neither torch nor the package, so it runs anywhere. Results of different GPUs are never mixed in one table
or ratio (``one_gpu`` refuses it): BENCHMARKS.md opens with one summary table of headline figures per GPU, then one
section per GPU, the newest first, with a table per result file (``ORDER`` first, others after by name), each
captioned with its command, GPU, power limit, SM clock and date; long tables are folded or left to their file
so that the page stays within ``MAX_LINES``. The README's text between ``PERF_BEGIN`` and ``PERF_END`` gets the
headline figures of ``HEADLINES`` from the GPU with the newest results and, when matplotlib is installed, the plot
of each shape's time ratio to cuBLAS. The serving-batch sweep (``benchmarks.bench_sweep``) gets a summary table per
recipe and two heatmaps beside that plot (ratio to cuBLAS and fraction of the floor, by layer shape and M). Output
is a function of the result files alone, so rendering twice changes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
BENCHMARKS_MD = REPO / "BENCHMARKS.md"
README_MD = REPO / "README.md"
PERF_PNG = REPO / "docs" / "perf.png"

PERF_BEGIN = "<!-- perf:begin -->"
PERF_END = "<!-- perf:end -->"
COMMAND = "python -m benchmarks.render"

# Section order in BENCHMARKS.md; result files with other names follow, sorted by name.
ORDER = ("gemm_dsv3", "sweep", "gemm_square", "gemm_decode", "gemm_dsv3_fast", "gemm_square_fast", "decode_chain",
         "decode_chain_sweep", "linear_stack", "model_llama8b_32l", "model_llama8b", "gemm_e2e", "quantize",
         "host_cost")


@dataclass(frozen=True)
class Headline:
    """A result quoted in the README: its summary, or at most ``max_rows`` rows (those matching ``where``,
    else the first ones) in ``columns`` (all when empty; names the file lacks are left out)."""

    name: str
    summary: bool = False
    where: Tuple[Tuple[str, object], ...] = ()
    columns: Tuple[str, ...] = ()
    max_rows: int = 3


HEADLINES = (
    Headline("gemm_dsv3", summary=True),
    Headline("decode_chain", where=(("M", 1),), columns=("recipe", "M", "N", "K", "ours us", "cuBLAS us", "ratio")),
    Headline("host_cost"),
)
# The plotted result: the first of these that has a ratio column.
PLOTTED = ("gemm_dsv3", "gemm_square", "gemm_decode", "gemm_dsv3_fast", "gemm_square_fast")
RATIO_COLUMN = "ratio"
REQUIRED = {"name": str, "title": str, "command": str, "gpu": str, "date": str, "columns": list, "rows": list}
OPTIONAL = {"versions": dict, "notes": str, "summary": dict, "gpu_facts": dict, "run_s": (int, float)}
#: (gpu_facts key, label, unit) a table's caption names
CAPTION_FACTS = (("power_limit_w", "power limit", "W"), ("max_sm_clock_mhz", "max SM clock", "MHz"))

# BENCHMARKS.md stays short: tables of more rows than FOLD_ROWS are folded, of more than SHOW_ROWS left to their result
# file, and the page refuses to grow past MAX_LINES.
FOLD_ROWS, SHOW_ROWS, MAX_LINES = 12, 90, 800
SHOW_ENTRIES = 48  # summaries of more entries are left to their result file too
# The page's summary: per result at most MAX_FIGURES figures, its summary entries matching HEADLINE_KEYS (a floor
# result's all), else the geomean of the first of HEADLINE_COLUMNS it has.
MAX_FIGURES = 5
HEADLINE_KEYS = re.compile(r"^geomean|geomean ratio$|geomean of floor$|ours x bf16$| x transformers\+convert$")
HEADLINE_COLUMNS = (RATIO_COLUMN, "ours x bf16", "speed-up", "two / one", "torch / ours")
FLOOR_RESULT = "floor"

# How to produce results, for the page that has none (each writes benchmarks/results/<name>.json).
PRODUCERS = (
    ("python -m benchmarks.measure_floor", "floor (run it first on each GPU: the others read it)"),
    ("python -m benchmarks.bench_gemm --sets dsv3 --recipes tensor,row,1x128_128x128", "gemm_dsv3"),
    ("python -m benchmarks.bench_sweep", "sweep"),
    ("python -m benchmarks.bench_gemm --sets decode --recipes tensor,row,1x128_128x128", "gemm_decode"),
    ("python -m benchmarks.bench_decode_chain --ms 1,16,64,128 --layers 8 --recipes row,tensor", "decode_chain"),
    ("python -m benchmarks.bench_linear_stack --layers 8 --recipe row --ms 1,16,4096 --eager-ms 1", "linear_stack"),
    ("python -m benchmarks.bench_model --layers 32 --recipes row,deepseek,int8,int4_weight --lm-head both --split",
     "model_llama8b_32l"),
    ("python -m benchmarks.bench_quantize --shape 8192x8192 --dtype bf16", "quantize"),
    ("python -m benchmarks.host_cost --calls 1000", "host_cost"),
)


class ResultError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------
def check_result(data, path: Path) -> dict:
    """The result file's content, or ResultError naming the file and what is wrong with it."""
    if not isinstance(data, dict):
        raise ResultError(f"{path}: expected a JSON object, got {type(data).__name__}")
    for key, kind in REQUIRED.items():
        if not isinstance(data.get(key), kind):
            raise ResultError(f"{path}: field {key!r} must be a {kind.__name__}, got {data.get(key)!r:.60}")
    for key, kind in OPTIONAL.items():
        if data.get(key) is not None and not isinstance(data[key], kind):
            name = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
            raise ResultError(f"{path}: field {key!r} must be a {name}, got {data[key]!r:.60}")
    if data["name"] != path.stem:
        raise ResultError(f"{path}: field 'name' is {data['name']!r}; it must equal the file stem {path.stem!r}")
    width = len(data["columns"])
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, list) or len(row) != width:
            raise ResultError(f"{path}: row {i} must be a list of {width} values (one per column), got {row!r:.80}")
    return data


def load_results(results_dir: Path) -> List[dict]:
    """Every ``*.json`` in ``results_dir``, validated, in section order (none if the directory is missing)."""
    results = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ResultError(f"{path}: not valid JSON ({e})") from None
        results.append(check_result(data, path))
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(results, key=lambda r: (rank.get(r["name"], len(ORDER)), r["name"]))


# ------------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------------
def cell(value) -> str:
    """A table cell: integers as is, floats to 6 significant digits, None and NaN as n/a."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.6g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(columns: Sequence[str], rows: Sequence[Sequence]) -> List[str]:
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def versions(r: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((r.get("versions") or {}).items()))


def gpu_label(r: dict) -> str:
    """The GPU with the facts ``common.write_result`` recorded: "NVIDIA H200, power limit 700 W, max SM clock
    1980 MHz"; files written before those facts were recorded say so."""
    facts = r.get("gpu_facts") or {}
    shown = [f"{label} {cell(facts[key])} {unit}" for key, label, unit in CAPTION_FACTS if facts.get(key) is not None]
    return ", ".join([r["gpu"]] + (shown or ["power limit and clocks not recorded"]))


def provenance(r: dict) -> str:
    """"GPU (power limit, max SM clock), date" of one result."""
    return f"{gpu_label(r)}, {r['date']}"


def caption(r: dict) -> List[str]:
    """The lines under a result's heading: its command, then GPU (power limit, max SM clock), date and versions."""
    return [f"`{r['command']}`", "", f"GPU: {gpu_label(r)}; date: {r['date']}"
            + (f"; {versions(r)}" if versions(r) else "") + "."]


def one_gpu(results: Sequence[dict], what: str) -> Optional[str]:
    """The GPU every one of ``results`` was measured on (None for none); ResultError where they name two: results of
    different GPUs never share a table or a ratio."""
    gpus: Dict[str, str] = {}
    for r in results:
        gpus.setdefault(r["gpu"], r["name"])
    if len(gpus) > 1:
        raise ResultError(f"{what} would combine results of different GPUs ("
                          + "; ".join(f"{name}.json: {gpu}" for gpu, name in gpus.items())
                          + "); results of different GPUs are never mixed in one table or ratio")
    return next(iter(gpus), None)


def by_gpu(results: Sequence[dict]) -> List[Tuple[str, List[dict]]]:
    """(GPU, its results in section order), the GPU with the newest result first (ties by name)."""
    groups: Dict[str, List[dict]] = {}
    for r in results:
        groups.setdefault(r["gpu"], []).append(r)
    ordered = sorted(groups.items())
    return sorted(ordered, key=lambda g: max(r["date"] for r in g[1]), reverse=True)


def folded(summary: str, lines: List[str]) -> List[str]:
    return [f"<details><summary>{summary}</summary>", "", *lines, "", "</details>"]


def result_file(r: dict) -> str:
    return f"[benchmarks/results/{r['name']}.json](benchmarks/results/{r['name']}.json)"


def render_body(r: dict, figures: Optional[Dict[str, str]] = None) -> List[str]:
    """A result's tables: a sweep (``is_sweep``) as ``figures`` ({caption: image path}) and its summary table per
    recipe; others as their rows, folded away above ``FOLD_ROWS`` and left to the result file above ``SHOW_ROWS``,
    then their summary (folded above ``FOLD_ROWS`` entries, left to the result file above ``SHOW_ENTRIES``)."""
    rows, lines = r["rows"], []
    if is_sweep(r):
        for text, path in (figures or {}).items():
            lines += [f"![{text}]({path})", ""]
        lines += table(*sweep_table(r["columns"], rows)) + ["", f"Every shape ({len(rows)} rows): {result_file(r)}."]
    elif len(rows) > SHOW_ROWS:
        lines += [f"{len(rows)} rows, not shown: {result_file(r)}."]
    elif len(rows) > FOLD_ROWS:
        lines += folded(f"{len(rows)} rows", table(r["columns"], rows))
    else:
        lines += table(r["columns"], rows)
    entries = [f"- {key}: {cell(value)}" for key, value in (r.get("summary") or {}).items()]
    if len(entries) > SHOW_ENTRIES and not is_sweep(r):
        lines += ["", f"Summary ({len(entries)} entries), not shown: {result_file(r)}."]
    elif entries and not is_sweep(r):
        lines += [""] + (folded(f"summary ({len(entries)} entries)", entries) if len(entries) > FOLD_ROWS
                         else entries)
    return lines


def render_section(r: dict, figures: Optional[Dict[str, str]] = None, level: int = 3) -> List[str]:
    """One result's section: heading, caption, notes and ``render_body``."""
    lines = ["#" * level + f" {r['title']}", ""] + caption(r)
    if r.get("notes"):
        lines += ["", r["notes"].rstrip(".") + "."]
    return lines + [""] + render_body(r, figures) + [""]


def headline_figures(r: dict) -> List[Tuple[str, object]]:
    """(figure, value) pairs the page's summary quotes for one result, at most ``MAX_FIGURES``: a sweep's geomean
    ratio per recipe; the summary entries of ``HEADLINE_KEYS`` (all of a floor result's); else the geomean of the first
    of ``HEADLINE_COLUMNS`` the result has, per recipe where it has a few."""
    if is_sweep(r):
        figures = [(f"{st['recipe']} geomean ratio", _rounded(st["geomean"])) for st in sweep_stats(r["columns"],
                                                                                                 r["rows"])]
    elif r.get("summary") and (r["name"] == FLOOR_RESULT or any(map(HEADLINE_KEYS.search, r["summary"]))):
        figures = [(k, v) for k, v in r["summary"].items()
                   if v is not None and (r["name"] == FLOOR_RESULT or HEADLINE_KEYS.search(k))]
    else:
        at = {c: i for i, c in enumerate(r["columns"])}
        column = next((c for c in HEADLINE_COLUMNS if c in at), None)
        if column is None:
            return []
        recipes = list(dict.fromkeys(row[at["recipe"]] for row in r["rows"])) if "recipe" in at else []
        groups = [(f" {rec}", [row for row in r["rows"] if row[at["recipe"]] == rec]) for rec in recipes] \
            if 0 < len(recipes) <= MAX_FIGURES else [("", r["rows"])]
        figures = [(f"geomean {column}{label}", _rounded(_geomean(row[at[column]] for row in group)))
                   for label, group in groups]
    return [(k, v) for k, v in figures if v is not None][:MAX_FIGURES]


def summary_table(results: Sequence[dict], anchors: Dict[str, str]) -> List[str]:
    """One GPU's headline figures, a row per result (linked to its section by ``anchors``: name -> anchor)."""
    one_gpu(results, "the summary table")
    rows = [[f"[{r['title']}](#{anchors[r['name']]})", "; ".join(f"{k} {cell(v)}" for k, v in headline_figures(r))
             or "see its section"] for r in results]
    return table(("result", "headline figures"), rows)


class Anchors:
    """GitHub's heading anchors in page order: ``anchor`` of the text, "-1", "-2", ... on repeats."""

    def __init__(self):
        self.seen: Dict[str, int] = {}

    def __call__(self, heading: str) -> str:
        base = anchor(heading)
        n = self.seen.get(base, 0)
        self.seen[base] = n + 1
        return base if n == 0 else f"{base}-{n}"


def render_benchmarks(results: Sequence[dict], figures: Optional[Dict[str, Dict[str, str]]] = None) -> str:
    """The page; ``figures``: {result name: {caption: image path relative to the page}}. One section per GPU, the
    newest first, after a summary of every GPU's headline figures; ResultError above ``MAX_LINES`` lines."""
    lines = [
        "# Benchmarks",
        "",
        f"<!-- Generated by `{COMMAND}` from benchmarks/results/*.json: edit those, not this file. -->",
        "",
        "Current results only, one section per GPU and one table per result file; earlier results are in the history "
        "of `benchmarks/results/`. Each table gives the command that produced it, the GPU with its power limit and "
        "SM clock, the date and the versions it ran with. Results of different GPUs are never combined in one table "
        "or ratio; \"% of\" and floor columns are against the floors `python -m benchmarks.measure_floor` measured on "
        "that GPU (files from before it say which figures they used in their notes and headers).",
        "",
    ]
    if not results:
        width = max(len(cmd) for cmd, _ in PRODUCERS)
        lines += [
            "No results are recorded yet. Run the benchmarks on a GPU; each writes "
            "`benchmarks/results/<name>.json` (`--no-save` skips it, `--name` renames it):",
            "",
            "```",
            *(f"{cmd:<{width}}  # {name}" for cmd, name in PRODUCERS),
            "```",
            "",
            f"then `{COMMAND}` to rewrite this file, the README's performance section and `docs/perf.png`.",
            "",
        ]
        return "\n".join(lines)
    groups = by_gpu(results)
    anchors, sections = Anchors(), []
    for heading in ["Benchmarks", "Summary"] + [gpu for gpu, _ in groups]:
        anchors(heading)
    linked: Dict[str, str] = {}
    for gpu, group in groups:
        sections += [f"## Results on {gpu}", ""]
        anchors(f"Results on {gpu}")
        for r in group:
            linked[r["name"]] = anchors(r["title"])
            sections += render_section(r, (figures or {}).get(r["name"]))
    lines += ["## Summary", ""]
    for gpu, group in groups:
        lines += [f"### {gpu}", ""] + summary_table(group, linked) + [""]
    page = "\n".join(lines + sections)
    count = page.count("\n") + 1
    if count > MAX_LINES:
        raise ResultError(f"BENCHMARKS.md would have {count} lines, over its cap of {MAX_LINES}: fold more of its "
                          f"tables (render.FOLD_ROWS, SHOW_ROWS) or quote fewer results")
    return page


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def headline(r: dict, h: Headline) -> List[str]:
    lines = [f"**{r['title']}** ({provenance(r)}; `{r['command']}`)", ""]
    if h.summary and r.get("summary"):
        return lines + table(("measure", "value"), list(r["summary"].items())) + [""]
    at = {c: i for i, c in enumerate(r["columns"])}
    picked = [row for row in r["rows"] if all(c in at and row[at[c]] == v for c, v in h.where)] or r["rows"]
    keep = [at[c] for c in h.columns if c in at] or list(range(len(r["columns"])))
    rows = [[row[i] for i in keep] for row in picked[: h.max_rows]]
    return lines + table([r["columns"][i] for i in keep], rows) + [""]


def render_perf_block(results: Sequence[dict], plot: Optional[str]) -> str:
    """The README's text between the markers (markers excluded): the ``HEADLINES`` of ``results`` (one GPU's: the
    newest, as ``render`` passes them; ResultError if they name two). ``plot``: the image's path relative to the
    README, or None."""
    by_name = {r["name"]: r for r in results}
    quoted = [(by_name[h.name], h) for h in HEADLINES if h.name in by_name]
    if not quoted:
        return f"No benchmark results are recorded yet: run the benchmarks on a GPU, then `{COMMAND}`."
    one_gpu([r for r, _ in quoted], "the README's performance block")
    lines = []
    for r, h in quoted:
        lines += headline(r, h)
    if plot:
        lines += [f"![time ratio to cuBLAS per shape]({plot})", ""]
    lines.append(f"All tables, with their commands: [BENCHMARKS.md](BENCHMARKS.md) (rendered by `{COMMAND}`).")
    return "\n".join(lines)


def replace_block(text: str, block: str, where: str = "README") -> str:
    begin, end = text.find(PERF_BEGIN), text.find(PERF_END)
    if begin < 0 or end < begin:
        raise ResultError(f"{where} has no {PERF_BEGIN} ... {PERF_END} block to fill")
    return text[: begin + len(PERF_BEGIN)] + "\n" + block + "\n" + text[end:]


# ------------------------------------------------------------------------------------------------
# The serving-batch sweep (benchmarks.bench_sweep): summary and heatmap grids
# ------------------------------------------------------------------------------------------------
SWEEP = "sweep"  # the result drawn as heatmaps; results named sweep* with SWEEP_COLUMNS render as sweeps
SWEEP_COLUMNS = ("recipe", "M", "N", "K", RATIO_COLUMN)
FLOOR_COLUMN = "of floor"
# (caption, image beside the perf plot, column drawn, colour bar label)
SWEEP_FIGURES = (
    ("ratio to cuBLAS by layer shape and M", "sweep_ratio.png", RATIO_COLUMN, "cuBLAS us / ours us (> 1: faster)"),
    ("fraction of the floor by layer shape and M", "sweep_floor.png", FLOOR_COLUMN, "floor us / ours us"),
)
UNDER = (1.0, 0.95)  # the summary counts shapes under these ratios


def is_sweep(r: dict) -> bool:
    return r["name"].startswith(SWEEP) and set(SWEEP_COLUMNS) <= set(r["columns"])


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _geomean(xs) -> Optional[float]:
    xs = [x for x in xs if _number(x) and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def sweep_stats(columns: Sequence[str], rows: Sequence[Sequence]) -> List[dict]:
    """Per recipe, in row order: its shapes with a ratio, their geomean, the worst ratio and where, how many are
    under each of ``UNDER``, the geomean at each M, and the geomean fraction of the floor (if recorded)."""
    at = {c: i for i, c in enumerate(columns)}
    by_recipe: Dict[str, list] = {}
    for row in rows:
        by_recipe.setdefault(row[at["recipe"]], []).append(row)
    stats = []
    for recipe, group in by_recipe.items():
        rated = [row for row in group if _number(row[at[RATIO_COLUMN]]) and row[at[RATIO_COLUMN]] > 0]
        ratios = [row[at[RATIO_COLUMN]] for row in rated]
        worst = min(rated, key=lambda row: row[at[RATIO_COLUMN]], default=None)
        stats.append({
            "recipe": recipe, "shapes": len(rated), "geomean": _geomean(ratios),
            "worst": worst[at[RATIO_COLUMN]] if worst else None,
            "worst at": " ".join(f"{c}={worst[at[c]]}" for c in ("M", "N", "K")) if worst else None,
            "under": {u: sum(x < u for x in ratios) for u in UNDER},
            "by M": {m: _geomean(row[at[RATIO_COLUMN]] for row in rated if row[at["M"]] == m)
                     for m in sorted({row[at["M"]] for row in group})},
            "of floor": _geomean(row[at[FLOOR_COLUMN]] for row in group) if FLOOR_COLUMN in at else None,
        })
    return stats


def _rounded(x, digits=3):
    return round(x, digits) if _number(x) else None


def sweep_summary(columns: Sequence[str], rows: Sequence[Sequence]) -> Dict[str, object]:
    """``sweep_stats`` as a result file's summary: "<recipe> <measure>" -> value."""
    out: Dict[str, object] = {}
    for st in sweep_stats(columns, rows):
        rec = st["recipe"]
        out[f"{rec} geomean ratio"] = _rounded(st["geomean"])
        out[f"{rec} worst ratio"] = _rounded(st["worst"])
        out[f"{rec} worst at"] = st["worst at"]
        for u, count in st["under"].items():
            out[f"{rec} under {u}"] = f"{count} of {st['shapes']}"
        for m, g in st["by M"].items():
            out[f"{rec} geomean ratio M={m}"] = _rounded(g)
        if st["of floor"] is not None:
            out[f"{rec} geomean of floor"] = _rounded(st["of floor"])
    return out


def sweep_table(columns: Sequence[str], rows: Sequence[Sequence]) -> Tuple[List[str], List[list]]:
    """(columns, rows) of the summary table BENCHMARKS.md shows for a sweep: one row per recipe."""
    stats = sweep_stats(columns, rows)
    ms = sorted({m for st in stats for m in st["by M"]})
    floor = any(st["of floor"] is not None for st in stats)
    head = ["recipe", "shapes", "geomean", "worst", "worst at", *(f"under {u}" for u in UNDER),
            *(f"M={m}" for m in ms)] + (["of floor"] if floor else [])
    body = [[st["recipe"], st["shapes"], _rounded(st["geomean"]), _rounded(st["worst"]), st["worst at"],
             *(st["under"][u] for u in UNDER), *(_rounded(st["by M"].get(m)) for m in ms)]
            + ([_rounded(st["of floor"])] if floor else []) for st in stats]
    return head, body


def sweep_grid(r: dict, column: str):
    """(recipes, layer labels, Ms, {recipe: [[value or None per M] per layer]}) of one column of a sweep, in
    row order; a layer is "<model> NxK" where the result names the model."""
    at = {c: i for i, c in enumerate(r["columns"])}
    recipes, layers, ms, cells = {}, {}, set(), {}
    for row in r["rows"]:
        layer = " ".join(([str(row[at["layer"]])] if "layer" in at and row[at["layer"]] != "-" else [])
                         + [f"{row[at['N']]}x{row[at['K']]}"])
        recipes[row[at["recipe"]]] = layers[layer] = None
        ms.add(row[at["M"]])
        value = row[at[column]]
        cells[(row[at["recipe"]], layer, row[at["M"]])] = float(value) if _number(value) else None
    ms = sorted(ms)
    grids = {rec: [[cells.get((rec, layer, m)) for m in ms] for layer in layers] for rec in recipes}
    return list(recipes), list(layers), ms, grids


# ------------------------------------------------------------------------------------------------
# Plot
# ------------------------------------------------------------------------------------------------
def plotted_result(results: Sequence[dict]) -> Optional[dict]:
    by_name = {r["name"]: r for r in results}
    return next((by_name[n] for n in PLOTTED if n in by_name and RATIO_COLUMN in by_name[n]["columns"]), None)


def ratio_series(r: dict) -> Dict[str, List[tuple]]:
    """{series (recipe, or the title): [(shape label, ratio)]} in row order; rows without a ratio are left out."""
    cols = r["columns"]
    at = {c: i for i, c in enumerate(cols)}
    series: Dict[str, List[tuple]] = {}
    for row in r["rows"]:
        ratio = row[at[RATIO_COLUMN]]
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or math.isnan(ratio):
            continue
        shape = "x".join(cell(row[at[c]]) for c in ("M", "N", "K") if c in at) or str(len(series))
        key = cell(row[at["recipe"]]) if "recipe" in at else r["title"]
        series.setdefault(key, []).append((shape, float(ratio)))
    return series


def draw_plot(r: dict, path: Path) -> bool:
    """Bar chart of each shape's ratio to cuBLAS, one bar group per shape; False if matplotlib is missing or
    the result has no ratios (the old image, if any, is left as it is)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series = ratio_series(r)
    if not series:
        return False
    shapes = list(dict.fromkeys(s for points in series.values() for s, _ in points))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.0 + 0.4 * len(shapes)), 4.0))
    for i, (name, points) in enumerate(series.items()):
        got = dict(points)
        xs = [j + (i - (len(series) - 1) / 2) * width for j, s in enumerate(shapes) if s in got]
        ax.bar(xs, [got[s] for s in shapes if s in got], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("cuBLAS time / ours (> 1: faster)")
    ax.set_title(f"{r['title']} ({r['gpu']}, {r['date']})", fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return True


def draw_sweep(r: dict, directory: Path) -> List[Path]:
    """``SWEEP_FIGURES`` of a sweep into ``directory``: per figure one heatmap panel per recipe, layer shapes
    down, M across, every cell annotated; the ratio on a diverging scale centred at 1.0. Returns the images
    drawn (none without matplotlib: the old ones, if any, are left as they are)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        from matplotlib.colors import Normalize, TwoSlopeNorm
    except ImportError:
        return []
    drawn = []
    for caption, filename, column, label in SWEEP_FIGURES:
        if column not in r["columns"]:
            continue
        recipes, layers, ms, grids = sweep_grid(r, column)
        values = [v for grid in grids.values() for line in grid for v in line if v is not None]
        if not values:
            continue
        if column == RATIO_COLUMN:
            norm, cmap = TwoSlopeNorm(1.0, min(min(values), 0.8), max(max(values), 1.25)), plt.get_cmap("RdBu")
        else:
            norm, cmap = Normalize(0.0, max(1.0, max(values))), plt.get_cmap("viridis")
        cmap = cmap.with_extremes(bad="0.85")
        fig, axes = plt.subplots(1, len(recipes), squeeze=False, sharey=True, constrained_layout=True,
                                 figsize=(2.0 + 0.5 * len(ms) * len(recipes), 1.2 + 0.3 * len(layers)))
        for ax, recipe in zip(axes[0], recipes):
            grid = np.array([[np.nan if v is None else v for v in line] for line in grids[recipe]])
            image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    red, green, blue, _ = cmap(norm(v))
                    dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6,
                            color="white" if dark else "black")
            ax.set_xticks(range(len(ms)))
            ax.set_xticklabels([str(m) for m in ms], fontsize=7, rotation=45)
            ax.set_xlabel("M", fontsize=8)
            ax.set_yticks(range(len(layers)))
            ax.set_yticklabels(layers, fontsize=7)
            ax.set_title(recipe, fontsize=9)
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8).set_label(label, fontsize=8)
        fig.suptitle(f"{r['title']}: {caption} ({r['gpu']}, {r['date']})", fontsize=9)
        path = directory / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(fig)
        drawn.append(path)
    return drawn


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------
def relative_to(path: Path, start: Path) -> str:
    try:
        return path.resolve().relative_to(start.resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def render(results_dir: Path = RESULTS_DIR, benchmarks_md: Path = BENCHMARKS_MD, readme: Path = README_MD,
           plot: Path = PERF_PNG, check: bool = False) -> List[Path]:
    """Rewrite the outputs from the result files; return the text files that changed (with ``check``: that
    would change, writing nothing and drawing no plot). The README quotes the GPU with the newest results."""
    results = load_results(results_dir)
    newest = by_gpu(results)[0][1] if results else []
    drawn = plotted_result(newest)
    if drawn is not None and not check:
        draw_plot(drawn, plot)
    plot_ref = relative_to(plot, readme.parent) if drawn is not None and plot.exists() else None
    # The sweep's heatmaps go beside the plot.
    sweep = next((r for r in results if r["name"] == SWEEP and is_sweep(r)), None)
    if sweep is not None and not check:
        draw_sweep(sweep, plot.parent)
    figures = {} if sweep is None else {SWEEP: {
        text: relative_to(plot.parent / filename, benchmarks_md.parent)
        for text, filename, column, _ in SWEEP_FIGURES
        if column in sweep["columns"] and (plot.parent / filename).exists()}}
    outputs = {
        benchmarks_md: render_benchmarks(results, figures),
        readme: replace_block(readme.read_text(), render_perf_block(newest, plot_ref), str(readme)),
    }
    changed = [p for p, text in outputs.items() if not p.exists() or p.read_text() != text]
    if not check:
        for p in changed:
            p.write_text(outputs[p])
    return changed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Render BENCHMARKS.md, the README's performance block, the perf plot "
                                             "and the sweep's heatmaps from benchmarks/results/*.json.")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="result files directory (default: %(default)s)")
    ap.add_argument("--benchmarks", type=Path, default=BENCHMARKS_MD, help="page to write (default: %(default)s)")
    ap.add_argument("--readme", type=Path, default=README_MD, help="README with the perf block (default: %(default)s)")
    ap.add_argument("--plot", type=Path, default=PERF_PNG,
                    help="plot to draw, with matplotlib; the sweep's heatmaps go beside it (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = ap.parse_args(argv)
    try:
        changed = render(args.results, args.benchmarks, args.readme, args.plot, check=args.check)
    except (ResultError, OSError) as e:
        print(f"render: {e}", file=sys.stderr)
        return 2
    if args.check and changed:
        print("out of date: " + ", ".join(str(p) for p in changed) + f"; run `{COMMAND}`", file=sys.stderr)
        return 1
    print(("updated: " + ", ".join(str(p) for p in changed)) if changed else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
