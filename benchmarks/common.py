"""Shared benchmark plumbing: shape sets, the roofline constants, timing, and the result files.

Operands and the cuBLAS calls they are measured against come from ``cutedsl_gemm.tools.anchors``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch

# The floors every table's "% of" column is measured against, on an H100 SXM.
FP8_TFLOPS = 1979.0  # dense FP8 tensor-core peak
HBM_TBPS = 3.0  # HBM3 bandwidth a read-only stream reaches (benchmarks.measure_floor); the datasheet says 3.35

RESULTS_DIR = Path(__file__).resolve().parent / "results"

SETS = {
    "dsv3": [(m, n, k) for m in (1024, 6144) for (n, k) in (
        (1536, 7168), (3072, 1536), (576, 7168), (7168, 256), (7168, 2048),
        (4608, 7168), (7168, 2304), (512, 7168), (4096, 512))],
    "llama70b_decode": [(m, 8192, 8192) for m in (1, 16, 32, 64, 128)],
    "llama70b_layers": [(m, n, k) for (n, k) in ((10240, 8192), (57344, 8192), (8192, 28672)) for m in (1, 16, 64)],
    "square": [(4096, 4096, 4096), (8192, 8192, 8192)],
    # LLM shapes where dispatch.wave_cost ties 128x192 with 128x128 for the block-W recipes: eight at
    # K >= dispatch.LONG_K, where 128x192 wins the tie, and four at K = 4096 / 1536.
    "block_ties": [(768, 8192, 8192), (1024, 4608, 7168), (1024, 6144, 4096), (1536, 8192, 8192), (1536, 4096, 14336),
                   (2048, 6144, 4096), (3072, 8192, 8192), (4096, 1536, 7168), (6144, 8192, 8192), (8192, 4608, 7168),
                   (2048, 3072, 1536), (6144, 3072, 1536)],
}
SETS["decode"] = SETS["llama70b_decode"] + SETS["llama70b_layers"]

SET_TITLES = {
    "dsv3": "DeepSeek-V3 shapes",
    "decode": "decode shapes (Llama-70B, M <= 128)",
    "llama70b_decode": "Llama-70B decode, N = K = 8192",
    "llama70b_layers": "Llama-70B layers at decode batch sizes",
    "square": "square shapes",
    "block_ties": "shapes where dispatch ties 128x192 and 128x128",
}


def dispatched(recipe, m, n, k, sms):
    """(instance, K splits, clusters to launch) as ``scaled_mm`` picks them on device 0."""
    inst = dispatch.select_gemm("sm_90a", recipe, "e4m3", "e4m3", "bf16", None, m, "promoted", None, n=n, sms=sms, k=k)
    clusters = launch.launch_clusters(0, inst)
    inst, splits = dispatch.plan_splits(inst, m, n, k, clusters * inst.cluster_m * inst.cluster_n)
    return inst, splits, clusters


FLUSH = "read"  # how bench() empties the L2 before each timed run: "read" | "zero" (see bench)
_flush_buffer = None


def bench(fn, warmup=25, rep=100, flush=None):
    """Median time in ms of ``fn``: warm, CUDA events around each run, the L2 emptied before each run.

    ``flush="read"`` (default) evicts the L2 by reading a 256 MiB buffer, so it holds only clean lines.
    ``flush="zero"`` is triton's ``do_bench``, which evicts it by *writing* 256 MiB: the L2 is then full
    of dirty lines that the timed kernel has to write back to HBM as it streams its inputs in. That costs
    any memory-bound kernel ~15 us (a read-only pass over 64 MiB: 38.7 us after a zero flush, against
    ~22 us at 3.06 TB/s), which is an artefact of the flush, not of the kernel.
    """
    flush = flush or FLUSH
    if flush == "zero":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.ones(64 << 20, dtype=torch.int32, device="cuda")

    def evict():
        torch.amax(_flush_buffer)

    fn()
    torch.cuda.synchronize()
    # Size the run by time, as do_bench does.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        evict()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup / estimate))):
        fn()
    n = max(1, int(rep / estimate))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        evict()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_interleaved(fns, rounds=10, reps=10, cuda=True):
    """Median ms per call of each function of ``fns`` ({name: fn}), the functions taking turns: each round runs
    every one ``reps`` times back to back between two CUDA events (``cuda=False``: the wall clock), so a drift of
    clocks or temperature reaches all of them alike. No L2 flush: for work that streams more than the L2 holds
    (a model's weights, a stack of distinct layers)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / reps)
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e3 / reps)
    return {name: statistics.median(t) for name, t in times.items()}


def timing_notes(flush=None):
    """The one-line description of ``bench``'s method that result files carry."""
    if (flush or FLUSH) == "zero":
        return "L2 emptied by a 256 MiB write (triton do_bench) before each run; median"
    return "L2 emptied by a 256 MiB read before each run; median of the runs in ~100 ms"


def tflops(m, n, k, ms):
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def gbps(m, n, k, ms, out_bytes=2):
    """Effective bandwidth of a GEMM: FP8 A and W read once, the output written once."""
    return (m * k + n * k + m * n * out_bytes) / (ms * 1e-3) / 1e9


def pct_of_hbm(gb_per_s):
    return 100.0 * gb_per_s / (HBM_TBPS * 1e3)


def pct_of_fp8_peak(tf):
    return 100.0 * tf / FP8_TFLOPS


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


# ---- result files: one JSON table per run, which benchmarks/render.py turns into BENCHMARKS.md ---------------

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def add_result_options(parser: argparse.ArgumentParser, default_name: str | None = None) -> None:
    """``--save/--no-save`` and ``--name``: whether and under which name the run writes its result file."""
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=True,
                        help=f"write the table to {RESULTS_DIR.name}/<name>.json (default: on)")
    parser.add_argument("--name", default=default_name,
                        help="result file stem" + (f" (default: {default_name})" if default_name else ""))


def command_line(argv=None) -> str:
    """How this run was started, as ``python -m benchmarks.<module> <args>`` when it is a benchmark module."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]) if argv and argv[0] else Path("python")
    if script.parent.name == "benchmarks" and script.suffix == ".py":
        head = ["python", "-m", f"benchmarks.{script.stem}"]
    else:
        head = [script.name]
    return shlex.join(head + argv[1:])


def versions() -> dict:
    try:
        dsl = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        dsl = "not installed"
    return {"torch": torch.__version__, "cutlass_dsl": dsl, "cuda": torch.version.cuda or "none"}


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


def _cell(x):
    """A JSON value for a table cell: NaN / inf (a cuBLAS refusal, a failed run) become null."""
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    raise TypeError(f"a result cell must be a number, string, bool or None; got {type(x).__name__}: {x!r}")


def write_result(name, title, columns, rows, *, summary=None, notes="", out_dir=None) -> Path:
    """Write one benchmark run as ``<out_dir or benchmarks/results>/<name>.json`` (overwriting) and return
    its path. ``command``, ``gpu``, ``date`` (UTC) and ``versions`` are filled in here."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"result name must be a file stem of letters, digits, '_', '.', '-'; got {name!r}")
    columns = [str(c) for c in columns]
    table = []
    for i, row in enumerate(rows):
        row = list(row)
        if len(row) != len(columns):
            raise ValueError(f"row {i} of {name!r} has {len(row)} cells, expected {len(columns)} ({columns})")
        table.append([_cell(x) for x in row])
    record = {
        "name": name,
        "title": str(title),
        "command": command_line(),
        "gpu": gpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "versions": versions(),
        "notes": str(notes),
        "columns": columns,
        "rows": table,
    }
    if summary:
        record["summary"] = {str(k): _cell(v) for k, v in summary.items()}
    path = Path(out_dir) if out_dir is not None else RESULTS_DIR
    path.mkdir(parents=True, exist_ok=True)
    path = path / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    print(f"wrote {path}")
    return path


def save_result(args, name, title, columns, rows, **kw):
    """``write_result`` unless the run was given ``--no-save``; ``--name`` overrides ``name``."""
    if args.save:
        return write_result(args.name or name, title, columns, rows, **kw)
    return None
