"""Shared benchmark plumbing: shape sets, the GPU's measured floors, timing, and the result files.

Operands and the cuBLAS calls they are measured against come from ``cutedsl_gemm.tools.baselines``. Every "% of"
and floor column is measured against ``measured_floors()``: what ``python -m benchmarks.measure_floor`` recorded
on this GPU (``benchmarks/results/floor.json``), never a datasheet figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cutedsl_gemm.runtime import launch
from cutedsl_gemm.selection import dispatch

_STARTED = time.perf_counter()  # write_result records the run's length from here


def cuda_context() -> None:
    """Make the GPU's primary CUDA context current in this thread (a one-element allocation), so that a driver
    query made before the first tensor (the cluster occupancy that ``launch.launch_clusters`` asks for) finds it.
    Nothing without a GPU."""
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")


cuda_context()  # every benchmark imports this module before its first launch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# ---- the floors: measured on this GPU by benchmarks.measure_floor, read from its result file ------------------

FLOOR_NAME = "floor"  # benchmarks/results/floor.json
MEASURE_FLOOR = "python -m benchmarks.measure_floor"
#: Floors field -> the key of floor.json's summary that holds it
FLOOR_KEYS = {
    "hbm_tbps": "HBM TB/s at the margin",
    "fp8_tflops": "FP8 TFLOPS (cuBLAS, per tensor, fast accumulation)",
    "launch_us": "one-element kernel us",
    "stream_fixed_us": "read-only stream fixed cost us per call",
}
#: the summary key of the fixed cost per call of read-only streams back to back in a CUDA graph (the smallest over
#: measure_floor's chains): the floor of a step that runs one kernel per weight; not in files from before it
CHAINED_FIXED_KEY = "read-only streams in a CUDA graph, fixed cost us per call"
#: Floors field -> the measure of floor.json's rows that holds it (files written before the summary held all four)
FLOOR_ROWS = {"hbm_tbps": "read-only stream, at the margin", "launch_us": "one-element kernel",
              "stream_fixed_us": "read-only stream, fixed cost per call"}


class FloorError(SystemExit):
    """The floors cannot be read for this GPU: a benchmark stops with this one-line message (no traceback)."""


@dataclasses.dataclass(frozen=True)
class Floors:
    """What one GPU reaches under ``bench``'s timing method (``benchmarks.measure_floor``): the read-only stream's
    rate at the margin (TB/s), cuBLAS's per-tensor FP8 GEMM rate with fast accumulation (TFLOPS: the power cap, not
    the datasheet), a one-element kernel's time and a stream's fixed cost per call (us)."""

    gpu: str
    hbm_tbps: float
    fp8_tflops: float
    launch_us: float
    stream_fixed_us: float

    @property
    def hbm(self) -> str:
        """The HBM floor as column headers and notes name it: "4.33 TB/s (measured)"."""
        return f"{self.hbm_tbps:g} TB/s (measured)"

    @property
    def fp8(self) -> str:
        """The FP8 floor as column headers and notes name it: "1346 TFLOPS (measured)"."""
        return f"{self.fp8_tflops:g} TFLOPS (measured)"

    def note(self) -> str:
        """The sentence a result's notes carry about the floors it used."""
        return (f"floors measured on this GPU (benchmarks.measure_floor): HBM {self.hbm_tbps:g} TB/s, FP8 "
                f"{self.fp8_tflops:g} TFLOPS")

    def stream_us(self, nbytes: float) -> float:
        """Time to stream ``nbytes`` at the HBM floor's rate, in us (the fixed cost per call not included)."""
        return nbytes / (self.hbm_tbps * 1e6)

    def mma_us(self, flops: float) -> float:
        """Time of ``flops`` at the FP8 floor's rate, in us."""
        return flops / (self.fp8_tflops * 1e6)


def floors_from_record(record: dict, where: str = "floor.json") -> Floors:
    """The ``Floors`` of a ``measure_floor`` result (its summary, else its rows); FloorError naming what is missing."""
    summary = record.get("summary") or {}
    rows = {row[0]: row[-1] for row in record.get("rows") or () if row}
    values = {}
    for field, key in FLOOR_KEYS.items():
        value = summary.get(key, rows.get(FLOOR_ROWS.get(field)))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
            raise FloorError(f"{where}: no positive {key!r} (got {value!r}); run `{MEASURE_FLOOR}` on this GPU again")
        values[field] = float(value)
    if not isinstance(record.get("gpu"), str):
        raise FloorError(f"{where}: no 'gpu' field; run `{MEASURE_FLOOR}` on this GPU again")
    return Floors(gpu=record["gpu"], **values)


def read_floors(path: Path, gpu: str) -> Floors:
    """The floors ``path`` (a ``measure_floor`` result) records for ``gpu``; FloorError when the file is missing,
    unreadable or from another GPU."""
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FloorError(f"{path}: missing; run `{MEASURE_FLOOR}` on this GPU ({gpu}) first") from None
    except (OSError, ValueError) as e:
        raise FloorError(f"{path}: unreadable ({e}); run `{MEASURE_FLOOR}` on this GPU ({gpu}) again") from None
    floors = floors_from_record(record if isinstance(record, dict) else {}, str(path))
    if floors.gpu != gpu:
        raise FloorError(f"{path}: measured on {floors.gpu}, not on this GPU ({gpu}); run `{MEASURE_FLOOR}` on this "
                         "GPU first")
    return floors


@functools.lru_cache(maxsize=None)
def measured_floors() -> Floors:
    """This GPU's floors, from ``benchmarks/results/floor.json`` (read once per process); FloorError (a one-line
    exit) without a GPU, or when the file is missing or was measured on another GPU."""
    if not torch.cuda.is_available():
        raise FloorError(f"no CUDA GPU: the floors are measured per GPU (`{MEASURE_FLOOR}` on one)")
    return read_floors(RESULTS_DIR / f"{FLOOR_NAME}.json", gpu_name())


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


def pct_of_hbm(gb_per_s, floors: Floors | None = None):
    """``gb_per_s`` as % of the HBM floor (``floors``, default this GPU's ``measured_floors()``)."""
    return 100.0 * gb_per_s / ((floors or measured_floors()).hbm_tbps * 1e3)


def pct_of_fp8_peak(tf, floors: Floors | None = None):
    """``tf`` TFLOPS as % of the FP8 floor (``floors``, default this GPU's ``measured_floors()``)."""
    return 100.0 * tf / (floors or measured_floors()).fp8_tflops


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


def require_gpu(what: str) -> None:
    """Stop ``what`` (a benchmark's name) with a one-line message where no CUDA GPU is visible."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{what} needs a CUDA GPU; none is visible here")


#: result-file key -> nvidia-smi --query-gpu field
SMI_FACTS = {"sm_clock_mhz": "clocks.sm", "max_sm_clock_mhz": "clocks.max.sm", "mem_clock_mhz": "clocks.mem",
             "power_limit_w": "power.limit", "driver": "driver_version"}
GPU_FACTS = (*SMI_FACTS, "sms")


def _smi_value(text: str):
    text = text.strip()
    if not text or "N/A" in text or "Not Supported" in text:
        return None
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() else number


def _smi_query(device: str):
    """One line of ``nvidia-smi --query-gpu`` values for ``device`` (an index or a UUID), or None."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(SMI_FACTS.values()), "--format=csv,noheader,"
                               "nounits", "-i", device], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].split(",") if done.returncode == 0 and lines else None


def gpu_facts() -> dict:
    """The current GPU's clocks (SM now and at most, memory now, MHz), power limit (W), driver and SM count, as
    ``nvidia-smi`` and torch report them at the time of the call; each None where unknown (no GPU, no nvidia-smi)."""
    facts = dict.fromkeys(GPU_FACTS)
    if not torch.cuda.is_available():
        return facts
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    facts["sms"] = props.multi_processor_count
    uuid = str(getattr(props, "uuid", "") or "")
    devices = ([uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"] if uuid else []) + [str(index)]
    values = next(filter(None, map(_smi_query, devices)), None) or ()
    facts.update({key: _smi_value(v) for key, v in zip(SMI_FACTS, values)})
    return facts


def _cell(x):
    """A JSON value for a table cell: NaN / inf (a cuBLAS refusal, a failed run) become null."""
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    raise TypeError(f"a result cell must be a number, string, bool or None; got {type(x).__name__}: {x!r}")


def write_result(name, title, columns, rows, *, summary=None, notes="", out_dir=None) -> Path:
    """Write one benchmark run as ``<out_dir or benchmarks/results>/<name>.json`` (overwriting) and return
    its path. ``command``, ``gpu``, ``gpu_facts`` (``gpu_facts()``: clocks, power limit, driver, SMs), ``date`` (UTC),
    ``versions`` and ``run_s`` (seconds since this module was imported: the run's length) are filled in here."""
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
        "gpu_facts": gpu_facts(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "versions": versions(),
        "run_s": round(time.perf_counter() - _STARTED),
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


# ---- the model benchmarks' attention ----------------------------------------------------------------------------
ATTENTIONS = ("packed-gqa", "transformers")
ATTENTION_NOTES = {"packed-gqa": "SDPA reading the KV cache once per step (each kv head's query heads packed as "
                                 "query positions at decode, tools.models.packed_gqa_sdpa), in every variant",
                   "transformers": "SDPA as the installed transformers calls it, in every variant"}


def add_attention_option(p) -> None:
    p.add_argument("--attention", choices=ATTENTIONS, default="packed-gqa",
                   help="the models' attention, the same in every variant: packed-gqa (default), SDPA over the cache "
                        "once with each kv head's query heads packed as query positions at decode "
                        "(tools.models.packed_gqa_sdpa); transformers, SDPA as the installed transformers calls it")


def use_attention(model, attention: str) -> None:
    """``model`` (and the copies made of it after) attending as ``--attention`` says."""
    if attention == "packed-gqa":
        from cutedsl_gemm.tools.models import use_packed_gqa_attention

        use_packed_gqa_attention(model)
