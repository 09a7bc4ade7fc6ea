"""Fill the on-disk JIT cache ahead of time, in parallel worker processes.

``cutedsl-gemm precompile --arch sm_90a [--filter SUBSTR | --all] [--jobs N]`` compiles the selected
instances (``runner.pick_ahead_of_time``: without a filter, the default set that most callers need; ``--all``
for the whole table) into ``cutedsl_gemm.runtime.jit.KERNEL_CACHE`` under the same key the runtime looks up (see
``cache_key``), so the first ``scaled_mm`` call of a process loads a shared library instead of compiling.
Entries already on disk are found before any worker starts: a second run compiles nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Sequence, Tuple

from cutedsl_gemm.generators.runner import pick_ahead_of_time, run_parallel
from cutedsl_gemm.selection.instances import KernelInstance


class PrecompileError(RuntimeError):
    pass


def cache_key(inst: KernelInstance) -> Tuple[KernelInstance, str]:
    """(key, arch) as ``cutedsl_gemm.runtime.launch.compiled`` passes them to ``KERNEL_CACHE.get`` (a test holds
    them equal)."""
    return inst, inst.arch


def check_c_compiler() -> str:
    """The C compiler the disk cache links its shared libraries with ($CC, else cc: as ``runtime.jit`` runs it);
    PrecompileError in one line when there is none."""
    cc = os.environ.get("CC") or "cc"
    found = shutil.which(cc)
    if found is None:
        raise PrecompileError(f"a C compiler (cc, gcc or clang, or $CC) is required to fill the kernel cache: "
                              f"{'$CC=' + repr(cc) if os.environ.get('CC') else 'cc'} not found")
    return found


def remove_stale_temp_dirs(entries_dir: Path) -> int:
    """Remove the temporary directories that no process is writing an entry through, in one directory of the
    disk cache (``runtime.jit`` links each entry in a ``tmp*`` directory beside it, holding the entry's lock; a
    worker stopped mid-way leaves its directory behind). A directory is stale when no entry lock of the directory
    is held: all of them are taken (without waiting) while the directories listed before are removed, and nothing
    is removed when any is held. Returns how many were removed."""
    try:
        stale = [p for p in entries_dir.iterdir() if p.is_dir() and p.name.startswith("tmp")]
    except OSError:
        return 0
    if not stale:
        return 0
    with contextlib.ExitStack() as held:
        for lock in entries_dir.glob("*.lock"):
            try:
                f = held.enter_context(open(lock, "a"))
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held by a process writing an entry now (or unreadable): leave everything
                return 0
            held.callback(fcntl.flock, f, fcntl.LOCK_UN)
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
    return len(stale)


def precompile_one(inst: KernelInstance) -> dict:
    """Compile one instance into the disk cache unless present (runs in a worker process)."""
    from cutedsl_gemm.runtime.compile import compile_instance
    from cutedsl_gemm.runtime.jit import KERNEL_CACHE

    key, arch = cache_key(inst)
    before = KERNEL_CACHE.stats.compiles
    path = KERNEL_CACHE.get(key, lambda: compile_instance(inst), arch=arch, load=False)
    return {"path": str(path), "compiled": KERNEL_CACHE.stats.compiles > before}


@dataclass
class PrecompileReport:
    selected: int
    already_cached: int
    compiled: int
    failed: List[Tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    cache_dir: str = ""

    def summary(self) -> str:
        return (f"precompile: {self.selected} instance(s): {self.compiled} compiled, {self.already_cached} already "
                f"cached, {len(self.failed)} failed in {self.seconds:.2f} s (cache: {self.cache_dir})")


def precompile(arch: str, filters: Sequence[str] = (), jobs: int | None = None, limit: int | None = None,
               stream=None, everything: bool = False) -> PrecompileReport:
    """Compile the selection into the disk cache. Ctrl-C raises ``runner.Interrupted``; the entries that
    finished are in the cache already."""
    from cutedsl_gemm.runtime.jit import KERNEL_CACHE, cache_dir, disk_cache_enabled

    stream = stream if stream is not None else sys.stderr
    t0 = time.perf_counter()
    if not disk_cache_enabled():
        raise PrecompileError("CUTEDSL_GEMM_DISABLE_DISK_CACHE is set: there is no disk cache to fill")
    selection = pick_ahead_of_time(arch, filters, limit, everything)
    insts = selection.instances
    todo = [i for i in insts if not KERNEL_CACHE.entry_path(*cache_key(i)).exists()]
    print(f"precompile: {len(insts)} instance(s) of {arch} ({selection.scope}): {len(todo)} to compile, "
          f"{len(insts) - len(todo)} already cached", file=stream)
    if todo:
        check_c_compiler()
    entry_dirs = {KERNEL_CACHE.entry_path(*cache_key(i)).parent for i in todo}
    try:
        results = run_parallel(precompile_one, todo, jobs, "precompile", describe=lambda i: i.name, stream=stream)
    finally:  # the workers are stopped by now (Ctrl-C terminates them): what they were linking is left over
        for d in entry_dirs:
            remove_stale_temp_dirs(d)
    report = PrecompileReport(
        selected=len(insts),
        already_cached=len(insts) - len(todo) + sum(1 for r in results if r.ok and not r.value["compiled"]),
        compiled=sum(1 for r in results if r.ok and r.value["compiled"]),
        failed=[(r.item.name, r.error) for r in results if not r.ok],
        cache_dir=str(cache_dir()),
    )
    moved = [r.item.name for r in results
             if r.ok and r.value["path"] != str(KERNEL_CACHE.entry_path(*cache_key(r.item)))]
    if moved:
        # The cache key includes a fingerprint of the kernel sources; an edit during the run re-keys entries.
        print(f"precompile: kernel sources changed while compiling; {len(moved)} entries were keyed by the new "
              f"sources (run again to fill the cache for the current ones)", file=stream)
    report.seconds = time.perf_counter() - t0
    print(report.summary(), file=stream)
    return report
