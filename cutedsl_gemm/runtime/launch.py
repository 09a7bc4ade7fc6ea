"""Launching a compiled instance: the compiled function, the persistent grid, split-K workspaces, dummies.

``launch`` and ``bind`` are the public way to run one instance on tensors already in the kernel's layouts
(tests and benchmarks that bypass dispatch use them); ``plan`` sizes a launch once and its ``run`` method
launches it, which is what ``scaled_mm`` keeps per call signature so that a repeated call costs one
compiled-function call. Each family's plan knows its kernel's argument order: ``LaunchPlan`` (Hopper) and
``Sm100LaunchPlan`` (Blackwell: three storage views per operand, run-time format codes, block scales).
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from cutedsl_gemm.families.keys import GEMM_FP8_OUT, SM100, WEIGHT_ONLY
from cutedsl_gemm.kernels.common.waves import unsplit_cluster_tiles
from cutedsl_gemm.numerics.formats import element_format, float_format
from cutedsl_gemm.runtime.device import device_info, max_active_clusters
from cutedsl_gemm.runtime.jit import KERNEL_CACHE

if TYPE_CHECKING:
    from cutedsl_gemm.selection.instances import KernelInstance  # (the type only: the runtime reads no table)


def compiled(inst: KernelInstance):
    """The compiled function of an instance (compiled at most once per process and cache entry)."""
    from cutedsl_gemm.runtime.compile import compile_instance  # imports the DSL: only when compiling

    return KERNEL_CACHE.get(inst, lambda: compile_instance(inst), arch=inst.arch)


def launch_clusters(index: int, inst: KernelInstance) -> int:
    """The persistent grid's cluster count for ``inst`` on GPU ``index``: the resident clusters of one CTA per
    SM, times the CTAs an instance fits per SM."""
    return max_active_clusters(index, inst.cluster_m * inst.cluster_n) * inst.ctas_per_sm


# ----------------------------------------------------------------------------------------------------
# Persistent per-device buffers (dummies, split-K workspaces): allocated outside any CUDA graph memory pool.
# ----------------------------------------------------------------------------------------------------

_BUFFER_THREAD = None  # one worker thread: graph pools take the allocations of the thread that warms up or captures


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


def _zeros(index: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return persistent_buffer(index, lambda: torch.zeros(n, dtype=dtype, device=torch.device("cuda", index)))


@functools.lru_cache(maxsize=None)
def dummy_bias(index: int) -> torch.Tensor:
    """Stands in for the bias argument of instances built without one; never read."""
    return _zeros(index, 1, torch.float32)


class _SplitKWorkspace:
    """Per-device split-K buffers, grown on demand and reused by every call (no per-call allocation, so
    calls can be captured in CUDA graphs once the buffers are large enough): fp32 partial sums and int32
    per-tile counters, which the kernel leaves at zero after each launch. Outgrown buffers are kept: a CUDA
    graph captured with them still writes them on replay."""

    def __init__(self, index: int):
        self.index = index
        self.partials = _zeros(index, 1, torch.float32)
        self.counters = _zeros(index, 1, torch.int32)
        self.outgrown: list = []

    def get(self, partial_floats: int, tiles: int):
        if self.partials.numel() < partial_floats:
            self.outgrown.append(self.partials)
            self.partials = persistent_buffer(self.index, lambda: torch.empty(
                partial_floats, dtype=torch.float32, device=torch.device("cuda", self.index)))
        if self.counters.numel() < tiles:
            self.outgrown.append(self.counters)
            self.counters = _zeros(self.index, tiles, torch.int32)
        return self.partials, self.counters


@functools.lru_cache(maxsize=None)
def _workspace(index: int) -> _SplitKWorkspace:
    return _SplitKWorkspace(index)


@functools.lru_cache(maxsize=None)
def _idle_workspace(index: int):
    # Stands in for the split-K buffers of unsplit launches (the kernel reads them only when splits > 1).
    return _zeros(index, 1, torch.float32), _zeros(index, 1, torch.int32)


def forget_buffers() -> None:
    """Drop the kept per-device buffers (the next plan allocates them again; plans made before keep theirs)."""
    for cached in (dummy_bias, _workspace, _idle_workspace, _no_zeros, _sm100_stand_ins):
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


def split_k_buffers(plan):
    """(fp32 partials, counters) a Hopper launch plan (``LaunchPlan``, ``WeightOnlyLaunchPlan``) passes: the device's
    split-K workspace, fetched per call since it grows on demand (a later call may have replaced it), or the plan's
    never-read stand-ins when it does not split."""
    return _workspace(plan.device_index).get(*plan.ws_need) if plan.splits > 1 else plan.idle_ws


class LaunchPlan(NamedTuple):
    """Everything a launch of one Hopper instance on one problem size needs besides the tensors."""

    fn: object  # the compiled kernel
    max_clusters: int
    splits: int
    ws_need: tuple  # (fp32 partials, counters) the split-K workspace must hold
    device_index: int
    dummy_bias: torch.Tensor
    idle_ws: tuple  # stand-ins for the split-K buffers when splits == 1 (never read)

    def run(self, a, b, out, scale_a, scale_b, bias, global_a=None, global_b=None) -> torch.Tensor:
        """Launch on the current stream; ``scale_a``/``scale_b`` are the kernel's scale views (no global scales)."""
        partials, counters = split_k_buffers(self)
        self.fn(a, b, out, scale_a, scale_b, self.dummy_bias if bias is None else bias, partials, counters,
                self.splits, self.max_clusters)
        return out

    def run_fp8_out(self, a, b, q, q_scales, scale_a, scale_b, bias):
        """Launch an instance that emits FP8 in 1x128 groups (op GEMM_FP8_OUT, ``Sm90Fp8Gemm.call_fp8_out``) on the
        current stream: ``q`` (M, N) e4m3 and ``q_scales`` (M, N / 128) M-major as ``quantize_fp8`` returns them."""
        partials, counters = split_k_buffers(self)
        self.fn(a, b, q, q_scales, scale_a, scale_b, self.dummy_bias if bias is None else bias, partials, counters,
                self.splits, self.max_clusters)
        return q, q_scales


class WeightOnlyLaunchPlan(NamedTuple):
    """A launch of one weight-only instance (``kernels/sm90/weight_only_gemm.py``) on one problem size."""

    fn: object
    max_clusters: int
    splits: int
    ws_need: tuple
    device_index: int
    idle_ws: tuple
    no_zeros: torch.Tensor  # stands in for the zero points of instances built without them (never read)

    def run(self, x, w, scales, zeros, out) -> torch.Tensor:
        """Launch on the current stream: activations, packed weights, scales and zero points in the kernel's
        layouts (``numerics.int_packing``), ``out`` (M, N)."""
        partials, counters = split_k_buffers(self)
        self.fn(x, w, scales, self.no_zeros if zeros is None else zeros, out, partials, counters, self.splits,
                self.max_clusters)
        return out


@functools.lru_cache(maxsize=None)
def _no_zeros(index: int, dtype: torch.dtype) -> torch.Tensor:
    return _zeros(index, 8, dtype)


class Sm100LaunchPlan(NamedTuple):
    """Everything a launch of one sm_100a instance on one problem needs besides the tensors. The operands come
    as (rows, row bytes) uint8 views; each goes into the storage view of its format (8-bit, 6-bit or 4-bit TMA
    unpacking; the packed FP4 kinds load bytes), dummies fill the other two."""

    fn: object
    max_clusters: int
    k: int
    code_a: int  # tcgen05 instruction-descriptor format codes
    code_b: int
    storage_a: int  # which of the three storage views each operand fills
    storage_b: int
    dummy_views: tuple
    dummy_bias: torch.Tensor
    unit: torch.Tensor  # 1.0: the global scales of recipes that have none
    block_scaled: bool

    def run(self, a, b, out, scale_a, scale_b, bias, global_a=None, global_b=None) -> torch.Tensor:
        """Launch on the current stream. ``scale_a``/``scale_b``: (1,) fp32 per-tensor scales, or for the
        block-scaled kinds the blocked scales as (row atoms, col atoms x 128) int32 words; ``global_a``/``global_b``:
        NVFP4's (1,) fp32 per-tensor scales (None: 1)."""
        a_views, b_views = list(self.dummy_views), list(self.dummy_views)
        a_views[self.storage_a] = a
        b_views[self.storage_b] = b
        tail = (self.dummy_bias if bias is None else bias, self.k, self.code_a, self.code_b, self.max_clusters)
        if self.block_scaled:
            self.fn(*a_views, *b_views, scale_a, scale_b, out, self.unit if global_a is None else global_a,
                    self.unit if global_b is None else global_b, *tail)
        else:
            self.fn(*a_views, *b_views, out, scale_a, scale_b, *tail)
        return out


@functools.lru_cache(maxsize=None)
def _sm100_stand_ins(index: int):
    """Valid, aligned operand views for the storage classes an operand does not use (never read), and 1.0."""
    dev = torch.device("cuda", index)
    buf, unit = persistent_buffer(index, lambda: (torch.zeros(128 * 128 + 256, dtype=torch.uint8, device=dev),
                                                  torch.ones(1, dtype=torch.float32, device=dev)))
    off = (-buf.data_ptr()) % 256
    flat = buf[off: off + 128 * 128]
    views = (flat.view(128, 128), flat[: 128 * 96].view(128, 96), flat[: 128 * 64].view(128, 64))
    return views, unit


def _sm100_plan(inst: KernelInstance, k: int, fmt_a: str, fmt_b: str, device_index: int) -> Sm100LaunchPlan:
    from cutedsl_gemm.kernels.sm100.f8f6f4_gemm import MMA_FORMAT_CODE, STORAGE_8BIT, STORAGE_OF_CODE

    try:
        code_a, code_b = MMA_FORMAT_CODE[fmt_a], MMA_FORMAT_CODE[fmt_b]
    except KeyError:
        raise ValueError(f"{inst.name} takes operand formats {', '.join(MMA_FORMAT_CODE)}; got {fmt_a} x {fmt_b}") \
            from None
    packed = inst.a_dtype == "e2m1"  # the packed FP4 kinds read their operands' bytes through the 8-bit view
    storage_a = STORAGE_8BIT if packed else STORAGE_OF_CODE[code_a]
    storage_b = STORAGE_8BIT if packed else STORAGE_OF_CODE[code_b]
    views, unit = _sm100_stand_ins(device_index)
    clusters = device_info(device_index)[1] // inst.cluster_m  # a persistent grid of one CTA per SM
    return Sm100LaunchPlan(compiled(inst), clusters, k, code_a, code_b, storage_a, storage_b, views,
                           dummy_bias(device_index), unit, inst.mma_kind != "f8f6f4")


def plan(inst: KernelInstance, m: int, n: int, splits: int, device_index: int, *, k: int = 0,
         fmt_a: Optional[str] = None, fmt_b: Optional[str] = None):
    """Compile (once) and size a launch of ``inst`` for an M x N output with ``splits`` K splits. sm_100a
    instances also take K and the operand formats (their kernels read both at run time)."""
    if inst.arch == SM100:
        if splits != 1:
            raise ValueError(f"{inst.name} is built without the split-K reduction; got splits={splits}")
        return _sm100_plan(inst, k, fmt_a, fmt_b, device_index)
    clusters = launch_clusters(device_index, inst)
    need = workspace_need(inst, m, n, splits, clusters)
    if splits > 1:
        _workspace(device_index).get(*need)  # grown now, before any capture of the launch
    if inst.op == WEIGHT_ONLY:
        no_zeros = _no_zeros(device_index, float_format(inst.a_dtype).torch_dtype)
        return WeightOnlyLaunchPlan(compiled(inst), clusters, splits, need, device_index, _idle_workspace(device_index),
                                    no_zeros)
    bias = dummy_bias(device_index)
    return LaunchPlan(compiled(inst), clusters, splits, need, device_index, bias, _idle_workspace(device_index))


def run(p, a, b, out, scale_a, scale_b, bias, global_a=None, global_b=None) -> torch.Tensor:
    """Launch plan ``p`` (``p.run``) on the current stream; ``scale_a``/``scale_b`` are the kernel's scale views."""
    return p.run(a, b, out, scale_a, scale_b, bias, global_a, global_b)


def bind(inst: KernelInstance, a, b, scale_a, scale_b, out, *, splits: int = 1, bias: Optional[torch.Tensor] = None,
         fmt_a: Optional[str] = None, fmt_b: Optional[str] = None, global_scale_a: Optional[torch.Tensor] = None,
         global_scale_b: Optional[torch.Tensor] = None):
    """A no-argument callable that launches ``inst`` on these tensors in the kernel's layouts, with ``splits``
    K splits (1 where the instance has no split-K reduction).

    Hopper: ``a`` (M, K) row-major, ``b`` (K, N) column-major, scale views as
    ``numerics.scale_layouts.resolve`` returns them. sm_100a: ``a`` (M, row bytes) and ``b`` (N, row bytes)
    uint8 with K contiguous, ``fmt_a``/``fmt_b`` their formats, (1,) fp32 scales or blocked scale words
    (``numerics.scale_layouts.blocked_scale_words``), an fp32 bias, NVFP4's global scales."""
    if splits > 1 and not inst.can_split_k:
        raise ValueError(f"{inst.name} is built without the split-K reduction; got splits={splits}")
    if inst.op == GEMM_FP8_OUT:
        raise ValueError(f"{inst.name} writes FP8 and its 1x128 scales: launch it with plan(...).run_fp8_out")
    k = 0
    if inst.arch == SM100:
        if fmt_a is None or fmt_b is None:
            raise ValueError(f"{inst.name}: give fmt_a and fmt_b, the operand formats (the kernel reads them at run "
                             "time)")
        k = a.shape[1] * 8 // element_format(fmt_a).bits
    p = plan(inst, out.shape[0], out.shape[1], splits, out.device.index, k=k, fmt_a=fmt_a, fmt_b=fmt_b)
    return lambda: p.run(a, b, out, scale_a, scale_b, bias, global_scale_a, global_scale_b)


def launch(inst: KernelInstance, a, b, scale_a, scale_b, out, *, splits: int = 1,
           bias: Optional[torch.Tensor] = None, **sm100_args) -> torch.Tensor:
    """Run ``inst`` once on these tensors (see ``bind``) and return ``out``."""
    bind(inst, a, b, scale_a, scale_b, out, splits=splits, bias=bias, **sm100_args)()
    return out
