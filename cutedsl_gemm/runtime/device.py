"""What the runtime needs to know about a GPU: its arch string, SM count, L2 size and how many clusters fit (and so
the persistent grid of an instance: ``launch_clusters``, which dispatch reads too)."""

from __future__ import annotations

import functools
import warnings

import torch


@functools.lru_cache(maxsize=None)
def device_info(index: int):
    """(arch, SMs) of CUDA device ``index``: arch as the DSL names it ("sm_90a", "sm_100a")."""
    props = torch.cuda.get_device_properties(index)
    arch = f"sm_{props.major}{props.minor}a" if props.major >= 9 else f"sm_{props.major}{props.minor}"
    return arch, props.multi_processor_count


@functools.lru_cache(maxsize=None)
def l2_bytes(index: int) -> int:
    """The L2 cache of CUDA device ``index`` in bytes."""
    return torch.cuda.get_device_properties(index).L2_cache_size


@functools.lru_cache(maxsize=None)
def max_active_clusters(index: int, cluster_size: int) -> int:
    """Clusters of this size that can be resident at once (1 CTA per SM, all shared memory): the persistent
    grid must not exceed it, or the clusters that do not fit run as a second wave. On the H100 this can be
    fewer than SMs / cluster_size, because clusters cannot span GPCs."""
    from cutlass.utils import HardwareInfo

    with torch.cuda.device(index):
        # The query goes through the driver API, which needs the device's context current on this thread;
        # torch.cuda.init() does not make it so before the first CUDA call, a synchronize does.
        torch.cuda.synchronize(index)
        try:
            return max(1, HardwareInfo().get_max_active_clusters(cluster_size))
        except Exception as e:  # the query needs the driver API; without it, assume every SM is usable
            fallback = device_info(index)[1] // cluster_size
            warnings.warn(f"cluster occupancy query failed ({e}); assuming {fallback} clusters", stacklevel=2)
            return fallback


def launch_clusters(index: int, inst) -> int:
    """The persistent grid's cluster count for ``inst`` (an instance of the table) on GPU ``index``: the resident
    clusters of one CTA per SM, times the CTAs an instance fits per SM."""
    return max_active_clusters(index, inst.cluster_m * inst.cluster_n) * inst.ctas_per_sm
