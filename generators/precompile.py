"""Fill the on-disk JIT cache ahead of time, in parallel worker processes.

``cutedsl-gemm precompile --arch sm_90a [--filter SUBSTR | --all] [--jobs N]`` compiles the selected
instances (``runner.pick_ahead_of_time``: without a filter, the default set that most callers need; ``--all``
for the whole table) into ``cutedsl_gemm.runtime.jit.KERNEL_CACHE`` under the same key the runtime looks up (see
``cache_key``), so the first ``scaled_mm`` call of a process loads a shared library instead of compiling.
Entries already on disk are found before any worker starts: a second run compiles nothing.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

from cutedsl_gemm.generators.runner import pick_ahead_of_time, run_parallel
from cutedsl_gemm.selection.instances import KernelInstance


class PrecompileError(RuntimeError):
    pass


def cache_key(inst: KernelInstance) -> Tuple[KernelInstance, str]:
    """(key, arch) as ``cutedsl_gemm.runtime.launch.compiled`` passes them to ``KERNEL_CACHE.get`` (a test holds
    them equal)."""
    return inst, inst.arch


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
    results = run_parallel(precompile_one, todo, jobs, "precompile", describe=lambda i: i.name, stream=stream)
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
