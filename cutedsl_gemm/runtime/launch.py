"""Launching a compiled instance: the compiled function, the persistent grid, split-K workspaces, dummies.

``launch`` and ``bind`` are the public way to run one instance on tensors already in the kernel's layouts
(tests and benchmarks that bypass dispatch use them); ``plan`` / ``run`` are what ``scaled_mm`` keeps per
call signature so that a repeated call costs one compiled-function call.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from cutedsl_gemm.kernels.common.last_wave_split import unsplit_cluster_tiles
from cutedsl_gemm.runtime.device import max_active_clusters
from cutedsl_gemm.runtime.jit import KERNEL_CACHE
from cutedsl_gemm.selection.instances import KernelInstance


def compiled(inst: KernelInstance):
    """The compiled function of an instance (compiled at most once per process and cache entry)."""
    from cutedsl_gemm.runtime.compile import compile_instance  # imports the DSL: only when compiling

    return KERNEL_CACHE.get(inst, lambda: compile_instance(inst), arch=inst.arch)


def launch_clusters(index: int, inst: KernelInstance) -> int:
    """The persistent grid's cluster count for ``inst`` on GPU ``index``: the resident clusters of one CTA per
    SM, times the CTAs an instance fits per SM."""
    return max_active_clusters(index, inst.cluster_m * inst.cluster_n) * inst.ctas_per_sm


@functools.lru_cache(maxsize=None)
def dummy_bias(index: int) -> torch.Tensor:
    """Stands in for the bias argument of instances built without one; never read."""
    return torch.zeros(1, dtype=torch.float32, device=torch.device("cuda", index))


class _SplitKWorkspace:
    """Per-device split-K buffers, grown on demand and reused by every call (no per-call allocation, so
    calls can be captured in CUDA graphs once the buffers are large enough): fp32 partial sums and int32
    per-tile counters, which the kernel leaves at zero after each launch."""

    def __init__(self, device):
        self.device = device
        self.partials = torch.empty(1, dtype=torch.float32, device=device)
        self.counters = torch.zeros(1, dtype=torch.int32, device=device)

    def get(self, partial_floats: int, tiles: int):
        if self.partials.numel() < partial_floats:
            self.partials = torch.empty(partial_floats, dtype=torch.float32, device=self.device)
        if self.counters.numel() < tiles:
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=self.device)
        return self.partials, self.counters


@functools.lru_cache(maxsize=None)
def _workspace(index: int) -> _SplitKWorkspace:
    return _SplitKWorkspace(torch.device("cuda", index))


@functools.lru_cache(maxsize=None)
def _idle_workspace(index: int):
    # Stands in for the split-K buffers of unsplit launches (the kernel reads them only when splits > 1).
    dev = torch.device("cuda", index)
    return torch.empty(1, dtype=torch.float32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)


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


class LaunchPlan(NamedTuple):
    """Everything a launch of one instance on one problem size needs besides the tensors."""

    fn: object  # the compiled kernel
    max_clusters: int
    splits: int
    ws_need: tuple  # (fp32 partials, counters) the split-K workspace must hold
    device_index: int
    dummy_bias: torch.Tensor
    idle_ws: tuple  # stand-ins for the split-K buffers when splits == 1 (never read)


def plan(inst: KernelInstance, m: int, n: int, splits: int, device_index: int) -> LaunchPlan:
    """Compile (once) and size a launch of ``inst`` for an M x N output with ``splits`` K splits."""
    clusters = launch_clusters(device_index, inst)
    return LaunchPlan(compiled(inst), clusters, splits, workspace_need(inst, m, n, splits, clusters), device_index,
                      dummy_bias(device_index), _idle_workspace(device_index))


def run(p: LaunchPlan, a, b, out, scale_a, scale_b, bias) -> torch.Tensor:
    """Launch a plan on the current stream; ``scale_a``/``scale_b`` are the kernel's scale views."""
    # The split-K buffers grow on demand (a later call may have replaced them): fetch them per call.
    partials, counters = _workspace(p.device_index).get(*p.ws_need) if p.splits > 1 else p.idle_ws
    p.fn(a, b, out, scale_a, scale_b, p.dummy_bias if bias is None else bias, partials, counters, p.splits,
         p.max_clusters)
    return out


def bind(inst: KernelInstance, a, b, scale_a, scale_b, out, *, splits: int = 1, bias: Optional[torch.Tensor] = None):
    """A no-argument callable that launches ``inst`` on these tensors (kernel layouts: ``a`` (M, K) row-major,
    ``b`` (K, N) column-major, scale views as ``numerics.scale_layouts.resolve`` returns them), with ``splits``
    K splits (1 where the instance has no split-K reduction)."""
    if splits > 1 and not inst.can_split_k:
        raise ValueError(f"{inst.name} is built without the split-K reduction; got splits={splits}")
    p = plan(inst, out.shape[0], out.shape[1], splits, out.device.index)
    return lambda: run(p, a, b, out, scale_a, scale_b, bias)


def launch(inst: KernelInstance, a, b, scale_a, scale_b, out, *, splits: int = 1,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run ``inst`` once on these tensors (see ``bind``) and return ``out``."""
    bind(inst, a, b, scale_a, scale_b, out, splits=splits, bias=bias)()
    return out
