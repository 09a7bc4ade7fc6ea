"""What launches hold: the compiled function of an instance and the per-device buffers its launches pass
(dummies for absent arguments, the split-K workspace), allocated outside any CUDA graph memory pool and kept.
The launch plans of the kernel families (``cutedsl_gemm/families/``) are made of these."""

from __future__ import annotations

import concurrent.futures
import functools
from typing import TYPE_CHECKING

import torch

from cutedsl_gemm.kernels.common.waves import unsplit_cluster_tiles
from cutedsl_gemm.runtime.device import launch_clusters
from cutedsl_gemm.runtime.jit import KERNEL_CACHE

if TYPE_CHECKING:
    from cutedsl_gemm.selection.instances import KernelInstance  # (the type only: the runtime reads no table)


def compiled(inst: KernelInstance):
    """The compiled function of an instance (compiled at most once per process and cache entry)."""
    from cutedsl_gemm.runtime.compile import compile_instance  # imports the DSL: only when compiling

    return KERNEL_CACHE.get(inst, lambda: compile_instance(inst), arch=inst.arch)


# ----------------------------------------------------------------------------------------------------
# Persistent per-device buffers (dummies, split-K workspaces): allocated outside any CUDA graph memory pool.
# ----------------------------------------------------------------------------------------------------

_BUFFER_THREAD = None  # one worker thread: graph pools take the allocations of the thread that warms up or captures
_BUFFER_CACHES: list = []  # every buffer_cache function, for forget_buffers


def buffer_cache(fn):
    """``functools.lru_cache`` for a function returning kept per-device buffers (keyed by device index and the
    like), registered so that ``forget_buffers`` drops them; the launch plans of the families use it too."""
    cached = functools.lru_cache(maxsize=None)(fn)
    _BUFFER_CACHES.append(cached)
    return cached


def persistent_buffer(index: int, make):
    """``make()`` (a function allocating tensors on GPU ``index``) run so that what it allocates lives outside
    any CUDA graph memory pool: torch.compile's CUDA graph trees route every allocation of the warming-up thread
    to the graph's private pool, where a tensor kept across calls is refused ("not tracked as outputs") and
    would be overwritten by replays. It runs on a worker thread (no pool takes its allocations), which waits for
    its work to finish. A stream capture in progress is refused: buffers must exist before capturing."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"cutedsl_gemm needs a new persistent buffer on cuda:{index} (first call of this shape or kernel) while a "
            "CUDA graph is being captured: run the call once before capturing (a warm-up, as CUDA graphs need anyway)")
    global _BUFFER_THREAD
    if _BUFFER_THREAD is None:
        _BUFFER_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cutedsl_gemm_buffers")

    def build():
        with torch.cuda.device(index):
            made = make()
            torch.cuda.current_stream().synchronize()  # zero-fills done before another stream reads them
        return made

    return _BUFFER_THREAD.submit(build).result()


def zeros(index: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A kept zero-filled (n,) tensor on GPU ``index``, outside any CUDA graph pool."""
    return persistent_buffer(index, lambda: torch.zeros(n, dtype=dtype, device=torch.device("cuda", index)))


@buffer_cache
def dummy_bias(index: int) -> torch.Tensor:
    """Stands in for the bias argument of instances built without one; never read."""
    return zeros(index, 1, torch.float32)


class _SplitKWorkspace:
    """Per-device split-K buffers, grown on demand and reused by every call (no per-call allocation, so
    calls can be captured in CUDA graphs once the buffers are large enough): fp32 partial sums and int32
    per-tile counters, which the kernel leaves at zero after each launch. Outgrown buffers are kept: a CUDA
    graph captured with them still writes them on replay."""

    def __init__(self, index: int):
        self.index = index
        self.partials = zeros(index, 1, torch.float32)
        self.counters = zeros(index, 1, torch.int32)
        self.outgrown: list = []

    def get(self, partial_floats: int, tiles: int):
        if self.partials.numel() < partial_floats:
            self.outgrown.append(self.partials)
            self.partials = persistent_buffer(self.index, lambda: torch.empty(
                partial_floats, dtype=torch.float32, device=torch.device("cuda", self.index)))
        if self.counters.numel() < tiles:
            self.outgrown.append(self.counters)
            self.counters = zeros(self.index, tiles, torch.int32)
        return self.partials, self.counters


@buffer_cache
def _workspace(index: int) -> _SplitKWorkspace:
    return _SplitKWorkspace(index)


@buffer_cache
def _idle_workspace(index: int):
    # Stands in for the split-K buffers of unsplit launches (the kernel reads them only when splits > 1).
    return zeros(index, 1, torch.float32), zeros(index, 1, torch.int32)


def forget_buffers() -> None:
    """Drop the kept per-device buffers (the next plan allocates them again; plans made before keep theirs)."""
    for cached in _BUFFER_CACHES:
        cached.cache_clear()


def split_tiles(inst: KernelInstance, m: int, n: int, splits: int, max_clusters: int) -> int:
    """CTA tiles whose K a launch with ``splits`` splits (partial sums and counters to hold): every output
    tile, or for a last-wave split instance the cluster tiles past the grid's last full wave
    (kernels/common/last_wave_split.py; ``max_clusters`` caps the grid)."""
    if splits <= 1:
        return 0
    if not inst.split_tail:
        return inst.output_tiles(m, n)
    ctiles = inst.cluster_tiles(m, n)
    grid = min(ctiles * splits, max_clusters)
    return (ctiles - unsplit_cluster_tiles(ctiles, grid)) * inst.cluster_m * inst.cluster_n


def workspace_need(inst: KernelInstance, m: int, n: int, splits: int, max_clusters: int):
    """(fp32 partials, int32 counters) a launch with ``splits`` K splits needs: one partial tile per split
    tile and split, one counter per split tile; (1, 1) when K is not split."""
    tiles = split_tiles(inst, m, n, splits, max_clusters)
    if tiles == 0:
        return 1, 1
    return tiles * splits * inst.tile_m * inst.tile_n, tiles


def split_k_sizing(inst: KernelInstance, m: int, n: int, splits: int, device_index: int) -> tuple:
    """(persistent clusters, workspace need, idle stand-ins) of a Hopper launch plan of ``inst``: the grid, what the
    split-K workspace must hold (grown now, before any capture of the launch) and the buffers unsplit launches pass."""
    clusters = launch_clusters(device_index, inst)
    need = workspace_need(inst, m, n, splits, clusters)
    if splits > 1:
        _workspace(device_index).get(*need)
    return clusters, need, _idle_workspace(device_index)


def split_k_buffers(plan):
    """(fp32 partials, counters) a Hopper launch plan (``families.sm90_gemm.LaunchPlan``,
    ``families.sm90_weight_only.WeightOnlyLaunchPlan``) passes: the device's split-K workspace, fetched per call
    since it grows on demand (a later call may have replaced it), or the plan's never-read stand-ins when it does not
    split."""
    return _workspace(plan.device_index).get(*plan.ws_need) if plan.splits > 1 else plan.idle_ws
