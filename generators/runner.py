"""Shared plumbing of export, precompile and catalog: picking instances and compiling them in parallel.

Compilation runs in worker processes started with ``spawn``: the CuTe DSL keeps MLIR contexts and
threads once imported, and a forked copy of such a process is not safe to use, so every worker starts
from a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Callable, Iterable, List, Optional, Sequence, TextIO, Tuple

from cutedsl_gemm.selection.instances import (
    GEMM_FP8_OUT,
    INSTANCES,
    QUANT_GEMM,
    WEIGHT_ONLY,
    KernelInstance,
    operand_dtypes,
)


class SelectionError(ValueError):
    """The arch/filter/limit given selects no kernel instance."""


def code_key(inst: KernelInstance) -> str:
    """Identifies generated code: instances differing only in their dispatch M range share it.

    The instance name leaves out ``stages``; a pinned stage count changes the code, so it is appended.
    """
    return inst.name + (f"_s{inst.stages}" if inst.stages else "")


def pick(arch: str, filters: Sequence[str] = (), limit: Optional[int] = None,
         instances: Sequence[KernelInstance] = None) -> Tuple[KernelInstance, ...]:
    """Instances of ``arch`` whose name contains any of ``filters`` (all when none), table order.

    Raises SelectionError naming what exists when nothing matches, so a typo never passes as success.
    """
    rows = INSTANCES if instances is None else tuple(instances)
    archs = sorted({i.arch for i in rows})
    # Rows of the table can expand to the same instance (fp32 output: bias "out" == bias "fp32"); dispatch
    # takes the first, so the copies are dropped here.
    sel = list(dict.fromkeys(i for i in rows if i.arch == arch))
    if not sel:
        raise SelectionError(f"the table has no {arch} instances (archs with instances: {', '.join(archs) or 'none'})")
    if filters:
        sel = [i for i in sel if any(f in i.name for f in filters)]
        if not sel:
            raise SelectionError(f"no {arch} instance name contains any of {list(filters)}; "
                                 f"names look like {rows[0].name if rows else '?'}")
    if limit is not None:
        if limit < 1:
            raise SelectionError(f"--limit must be >= 1, got {limit}")
        sel = sel[:limit]
    return tuple(sel)


#: The weight-only kernels (activations, weights, recipe) of the default set: int4 in groups of 128 along K and int8
#: per channel, under bf16 activations, the common checkpoints.
DEFAULT_WEIGHT_ONLY = (("bf16", "int4", "group128"), ("bf16", "int8", "channel"))


def in_default_set(inst: KernelInstance) -> bool:
    """What most callers need ahead of time: the GEMMs that run e4m3 x e4m3 operands (on sm_100a, the f8f6f4
    kernels) or int8 x int8 (W8A8), bf16 output, no bias or a bf16 one, every tile, schedule and recipe; the
    weight-only GEMMs of ``DEFAULT_WEIGHT_ONLY``, every tile; and those of ``DEFAULT_QUANT_GEMM`` and
    ``DEFAULT_FP8_OUT_RECIPES``."""
    if inst.op == WEIGHT_ONLY:
        return (inst.a_dtype, inst.b_dtype, inst.recipe) in DEFAULT_WEIGHT_ONLY
    if inst.op == QUANT_GEMM:
        return (inst.a_dtype, inst.b_dtype, inst.bias_dtype) in DEFAULT_QUANT_GEMM
    if inst.op == GEMM_FP8_OUT:
        return inst.recipe in DEFAULT_FP8_OUT_RECIPES
    operands = (inst.a_dtype, inst.b_dtype)
    return ((operands == operand_dtypes(inst.arch, inst.recipe, "e4m3", "e4m3") or operands == ("int8", "int8"))
            and inst.out_dtype == "bf16" and inst.bias_dtype in (None, "bf16"))


#: The GEMMs quantizing their activations of the default set: bf16 activations, e4m3 or int8 weights, with the fp32
#: bias of cutedsl_gemm.nn's layers or none.
DEFAULT_QUANT_GEMM = tuple(("bf16", w, bias) for w in ("e4m3", "int8") for bias in (None, "fp32"))
#: The GEMMs emitting FP8 in 1x128 groups of the default set: the DeepSeek recipe's (whose next layer takes them), every
#: tile, without bias or with an fp32 one.
DEFAULT_FP8_OUT_RECIPES = ("1x128_128x128",)


DEFAULT_SET = ("e4m3 x e4m3 or int8 x int8 operands, bf16 output, without bias or with a bf16 bias, every tile, "
               "schedule and recipe; weight-only bf16 x int4 group 128 and bf16 x int8 per channel, every tile; "
               "bf16 activations quantized in the GEMM for e4m3 and int8 weights, without bias or with an fp32 one; "
               "the DeepSeek recipe's GEMMs emitting FP8 in 1x128 groups")


@dataclass(frozen=True)
class Selection:
    instances: Tuple[KernelInstance, ...]
    scope: str  # how they were chosen, for the line printed before compiling


def pick_ahead_of_time(arch: str, filters: Sequence[str] = (), limit: Optional[int] = None,
                       everything: bool = False) -> Selection:
    """What precompile and export build: the instances named by ``filters`` (over the whole table), the whole
    table with ``everything``, else the default set (``in_default_set``): an unfiltered run never compiles
    thousands of kernels unasked."""
    if filters:
        return Selection(pick(arch, filters, limit), f"names containing any of {list(filters)}")
    table = pick(arch)
    if everything:
        return Selection(table[:limit] if limit else table, "the whole table")
    default = [i for i in table if in_default_set(i)]
    if not default:
        raise SelectionError(f"no {arch} instance is in the default set ({DEFAULT_SET}); pass --all or --filter")
    return Selection(pick(arch, limit=limit, instances=default),
                     f"the default set: {DEFAULT_SET}; --all for all {len(table)}")


@dataclass
class TaskResult:
    item: Any
    ok: bool
    value: Any = None
    error: str = ""
    seconds: float = 0.0


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during ``run_parallel``: the workers are stopped; ``results`` holds the tasks that finished."""

    def __init__(self, results: List[TaskResult], total: int):
        super().__init__(f"interrupted: {len(results)} of {total} done")
        self.results, self.total = results, total


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def condense_error(e: BaseException, limit: int = 400) -> str:
    """One line for a progress log: DSL errors span many coloured lines around one ``error:`` line."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(e)).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    text = " | ".join(errors or lines) or repr(e)
    text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _timed(fn, item):
    t0 = time.perf_counter()
    try:
        return True, fn(item), "", time.perf_counter() - t0
    except Exception as e:  # reported per item; one broken instance must not hide the others
        return False, None, condense_error(e), time.perf_counter() - t0


def _ignore_sigint():
    # Ctrl-C reaches every process of the terminal's group; the parent alone decides (it stops the workers),
    # so a worker neither dies mid-task with a traceback nor survives the parent's shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored in this process for the block (where it can be set: the main thread only).

    Workers are started inside it: an ignored signal stays ignored across exec and Python then installs no
    KeyboardInterrupt handler, so a Ctrl-C while a worker is still importing (before its initializer) is
    ignored there too instead of printing a traceback."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals cannot be set here
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else (
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s")


class Progress:
    """A progress line on stderr: redrawn in place on a terminal, one line per item otherwise (CI logs).
    Each line has done/total, the time so far and the time left at the rate so far."""

    def __init__(self, total: int, label: str, stream: TextIO = None):
        self.total, self.label, self.done = total, label, 0
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def step(self, what: str, ok: bool, seconds: float):
        self.done += 1
        width = 24
        fill = width * self.done // max(self.total, 1)
        bar = "#" * fill + "." * (width - fill)
        status = "ok " if ok else "ERR"
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        line = (f"{self.label} [{bar}] {self.done}/{self.total} {duration(elapsed)} ETA {duration(eta)} "
                f"{status} {what} ({seconds:.1f}s)")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if self.done == self.total or not ok else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def end_line(self):
        if self.tty and 0 < self.done < self.total:
            self.stream.write("\n")  # leave the redrawn line before whatever is printed next
            self.stream.flush()


def _stop_pool(pool: ProcessPoolExecutor, futures) -> None:
    """Cancel what has not started and terminate the workers now (not after their current task)."""
    for fut in futures:
        fut.cancel()
    workers = list((getattr(pool, "_processes", None) or {}).values())
    for proc in workers:
        if proc.is_alive():
            proc.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


#: Peak memory of one compile worker: the DSL takes about 330 MB once imported, and a worker's resident set was
#: measured at 440 MB after its first kernel, 510 MB after 12 precompiled GEMMs and 620 MB after 46 kernels.
WORKER_BYTES = 600 * 2**20
JOBS_HELP = ("parallel compile processes (default and upper bound: the CPU count, and one per "
             f"{WORKER_BYTES / 2**30:.1f} GB of available memory)")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def available_memory() -> Optional[int]:
    """Bytes of memory available to new processes (MemAvailable of /proc/meminfo), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def worker_limit() -> Tuple[int, str]:
    """(most worker processes worth starting, why): one per CPU, and no more than available memory holds at
    ``WORKER_BYTES`` each (more workers than CPUs only contend; more than memory holds swap or get killed)."""
    cpus, memory = usable_cpus(), available_memory()
    limit, why = cpus, f"{cpus} CPU{'s' * (cpus != 1)}"
    if memory is not None:
        limit = min(limit, max(1, memory // WORKER_BYTES))
        why += f", {memory / 2**30:.1f} GB available at {WORKER_BYTES / 2**30:.1f} GB a worker"
    return limit, why


def capped_jobs(jobs: Optional[int], label: str, stream: TextIO = None, tasks: Optional[int] = None) -> int:
    """Worker processes to start for ``jobs`` (None: one per CPU) and ``tasks`` tasks: no more than the tasks and
    ``worker_limit``; one line on ``stream`` when that limit lowers the number asked for."""
    limit, why = worker_limit()
    asked = usable_cpus() if jobs is None else jobs
    if tasks is not None:
        asked = min(asked, tasks)
    if asked <= limit:
        return asked
    stream = stream if stream is not None else sys.stderr
    what = f"--jobs {jobs}" if jobs is not None else f"{asked} workers (one per CPU)"
    print(f"{label}: {what} capped at {limit} ({why})", file=stream)
    return limit


def run_parallel(fn: Callable[[Any], Any], items: Iterable[Any], jobs: Optional[int], label: str,
                 describe: Callable[[Any], str] = str, stream: TextIO = None) -> List[TaskResult]:
    """``fn(item)`` for every item in ``jobs`` spawned worker processes; results in input order.

    ``fn`` must be a module-level function (it is pickled by reference). ``jobs=0`` runs in this process
    (used where the caller already paid for the DSL import and has a single item); other values are capped by
    ``capped_jobs`` (CPUs and memory). Ctrl-C stops the workers at once and raises ``Interrupted`` holding the
    results of the tasks that finished.
    """
    items = list(items)
    if not items:
        return []
    if jobs is not None and jobs < 0:
        raise ValueError(f"jobs must be >= 0, got {jobs}")
    if jobs != 0:
        jobs = capped_jobs(jobs, label, stream, len(items))
    progress = Progress(len(items), label, stream)
    results: List[Optional[TaskResult]] = [None] * len(items)

    def finished():
        return [r for r in results if r is not None]

    if jobs == 0:
        try:
            for idx, item in enumerate(items):
                ok, value, err, secs = _timed(fn, item)
                results[idx] = TaskResult(item, ok, value, err, secs)
                progress.step(describe(item) + ("" if ok else f": {err}"), ok, secs)
        except KeyboardInterrupt:
            progress.end_line()
            raise Interrupted(finished(), len(items)) from None
        return results  # type: ignore[return-value]
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"),
                               initializer=_ignore_sigint)
    futures = {}
    try:
        with _sigint_ignored():  # submit starts the worker processes
            futures = {pool.submit(_timed, fn, item): idx for idx, item in enumerate(items)}
        for fut in as_completed(futures):
            idx = futures[fut]
            try:
                ok, value, err, secs = fut.result()
            except Exception as e:  # the worker process itself died (e.g. killed for memory)
                ok, value, err, secs = False, None, f"worker failed: {type(e).__name__}: {e}", 0.0
            results[idx] = TaskResult(items[idx], ok, value, err, secs)
            progress.step(describe(items[idx]) + ("" if ok else f": {err}"), ok, secs)
    except KeyboardInterrupt:
        with _sigint_ignored():  # a second Ctrl-C while the workers are being stopped must not leave them running
            _stop_pool(pool, futures)
            progress.end_line()
        raise Interrupted(finished(), len(items)) from None
    pool.shutdown(wait=True)
    return results  # type: ignore[return-value]
