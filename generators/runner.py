"""Shared plumbing of export, precompile and catalog: picking instances and compiling them in parallel.

Compilation runs in worker processes started with ``spawn``: the CuTe DSL keeps MLIR contexts and
threads once imported, and a forked copy of such a process is not safe to use, so every worker starts
from a fresh interpreter.
"""

from __future__ import annotations

import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Callable, Iterable, List, Optional, Sequence, TextIO, Tuple

from cutedsl_gemm.selection.instances import INSTANCES, KernelInstance


class SelectionError(ValueError):
    """The arch/filter/limit given selects no kernel instance."""


def code_key(inst: KernelInstance) -> str:
    """Identifies generated code: instances differing only in their dispatch M range share it.

    The instance name leaves out ``stages``; a pinned stage count changes the code, so it is appended.
    """
    return inst.name + (f"_s{inst.stages}" if inst.stages else "")


def pick(arch: str, filters: Sequence[str] = (), limit: Optional[int] = None,
         instances: Sequence[KernelInstance] = None) -> Tuple[KernelInstance, ...]:
    """Instances of ``arch`` whose name contains any of ``filters`` (all when none), manifest order.

    Raises SelectionError naming what exists when nothing matches, so a typo never passes as success.
    """
    rows = INSTANCES if instances is None else tuple(instances)
    archs = sorted({i.arch for i in rows})
    # Rows of the table can expand to the same instance (fp32 output: bias "out" == bias "fp32"); dispatch
    # takes the first, so the copies are dropped here.
    sel = list(dict.fromkeys(i for i in rows if i.arch == arch))
    if not sel:
        raise SelectionError(f"the manifest has no {arch} instances (archs with instances: {', '.join(archs) or 'none'})")
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


@dataclass
class TaskResult:
    item: Any
    ok: bool
    value: Any = None
    error: str = ""
    seconds: float = 0.0


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


class Progress:
    """A progress line on stderr: redrawn in place on a terminal, one line per item otherwise (CI logs)."""

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
        line = (f"{self.label} [{bar}] {self.done}/{self.total} {time.perf_counter() - self.t0:6.1f}s "
                f"{status} {what} ({seconds:.1f}s)")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if self.done == self.total or not ok else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def run_parallel(fn: Callable[[Any], Any], items: Iterable[Any], jobs: Optional[int], label: str,
                 describe: Callable[[Any], str] = str, stream: TextIO = None) -> List[TaskResult]:
    """``fn(item)`` for every item in ``jobs`` spawned worker processes; results in input order.

    ``fn`` must be a module-level function (it is pickled by reference). ``jobs=0`` runs in this process
    (used where the caller already paid for the DSL import and has a single item).
    """
    items = list(items)
    if not items:
        return []
    jobs = (os.cpu_count() or 1) if jobs is None else jobs
    if jobs < 0:
        raise ValueError(f"--jobs must be >= 0, got {jobs}")
    progress = Progress(len(items), label, stream)
    results: List[Optional[TaskResult]] = [None] * len(items)
    if jobs == 0:
        for idx, item in enumerate(items):
            ok, value, err, secs = _timed(fn, item)
            results[idx] = TaskResult(item, ok, value, err, secs)
            progress.step(describe(item) + ("" if ok else f": {err}"), ok, secs)
        return results  # type: ignore[return-value]
    with ProcessPoolExecutor(max_workers=min(jobs, len(items)), mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(_timed, fn, item): idx for idx, item in enumerate(items)}
        for fut in as_completed(futures):
            idx = futures[fut]
            try:
                ok, value, err, secs = fut.result()
            except Exception as e:  # the worker process itself died (e.g. killed for memory)
                ok, value, err, secs = False, None, f"worker failed: {type(e).__name__}: {e}", 0.0
            results[idx] = TaskResult(items[idx], ok, value, err, secs)
            progress.step(describe(items[idx]) + ("" if ok else f": {err}"), ok, secs)
    return results  # type: ignore[return-value]
