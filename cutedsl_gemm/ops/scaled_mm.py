"""Public GEMM entry points on torch tensors."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from cutedsl_gemm.selection import dispatch
from cutedsl_gemm.numerics import scale_layouts
from cutedsl_gemm import problem as V
from cutedsl_gemm.runtime.jit import KERNEL_CACHE


@functools.lru_cache(maxsize=None)
def _device_info(index: int):
    props = torch.cuda.get_device_properties(index)
    return f"sm_{props.major}{props.minor}a" if props.major >= 9 else f"sm_{props.major}{props.minor}", props.multi_processor_count


@functools.lru_cache(maxsize=None)
def _max_active_clusters(index: int, cluster_size: int) -> int:
    """Clusters of this size that can be resident at once (1 CTA per SM, all shared memory): the persistent
    grid must not exceed it, or the clusters that do not fit run as a second wave. On the H100 this can be
    fewer than SMs / cluster_size, because clusters cannot span GPCs."""
    from cutlass.utils import HardwareInfo

    with torch.cuda.device(index):
        torch.cuda.init()
        try:
            return max(1, HardwareInfo().get_max_active_clusters(cluster_size))
        except Exception as e:  # the query needs the driver API; without it, assume every SM is usable
            import warnings

            warnings.warn(f"cluster occupancy query failed ({e}); assuming {_device_info(index)[1] // cluster_size} clusters")
            return _device_info(index)[1] // cluster_size


def _launch_clusters(index: int, inst) -> int:
    """The persistent grid's cluster count for ``inst`` on this GPU: the resident clusters of one CTA per
    SM, times the CTAs an instance fits per SM."""
    return _max_active_clusters(index, inst.cluster_m * inst.cluster_n) * inst.ctas_per_sm


@functools.lru_cache(maxsize=None)
def _dummy_bias(index: int) -> torch.Tensor:
    # Stands in for the bias argument of instances built without one; never read.
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


def _workspace_need(inst, m: int, n: int, splits: int, max_clusters: int):
    """(fp32 partials, int32 counters) a launch with ``splits`` K splits needs: one partial tile per split
    tile (``dispatch.split_tiles``) and split, one counter per split tile; (1, 1) when K is not split."""
    tiles = dispatch.split_tiles(inst, m, n, splits, max_clusters)
    if tiles == 0:
        return 1, 1
    return tiles * splits * inst.tile_m * inst.tile_n, tiles


def _split_buffers(inst, m: int, n: int, splits: int, index: int):
    """The split-K buffers to pass a kernel of ``inst`` launched directly (benchmarks, with this device's
    cluster limit as the grid): the device's workspace, grown to fit, or the stand-ins when K is not split."""
    if splits <= 1:
        return _idle_workspace(index)
    clusters = _launch_clusters(index, inst)
    return _workspace(index).get(*_workspace_need(inst, m, n, splits, clusters))


@functools.lru_cache(maxsize=None)
def _idle_workspace(index: int):
    # Stands in for the split-K buffers of unsplit launches (the kernel reads them only when splits > 1).
    dev = torch.device("cuda", index)
    return torch.empty(1, dtype=torch.float32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)


# manifest instance -> (compiled function, clusters to launch on this GPU)
_LAUNCH_CACHE: dict = {}

# Call signature -> everything the launch needs. The signature holds what *chooses* the plan: problem
# shape, operand dtypes, device, scale shapes and strides (they pick the recipe and its views) and the
# arguments. What the compiled function checks itself before every launch (TVM-FFI: dtype, rank, every
# extent against the M, N, K it bound, strides, 16-byte base alignment, one device) is not hashed again:
# a repeated signature whose tensors that check refuses (a misaligned or transposed view, a wrong out=) is
# re-run through the full validation, which names what was expected.
_SIGNATURES: dict = {}


def _signature(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, scale_recipe_a, scale_recipe_b, schedule, split_k):
    return (
        a.shape, b.shape, a.dtype, b.dtype, a.get_device(),
        scale_a.shape, scale_a.stride(), scale_b.shape, scale_b.stride(),
        None if bias is None else bias.dtype,
        out_dtype, use_fast_accum, scale_recipe_a, scale_recipe_b, schedule, split_k,
    )


class _Plan(NamedTuple):
    """What a validated call signature launches with (``_SIGNATURES``' values)."""

    fn: object  # the compiled kernel
    max_clusters: int
    recipe: str
    kb: int  # K blocks of 128 (block-scaled recipes' scale views)
    dummy_bias: torch.Tensor
    out_shape: tuple
    splits: int
    ws_need: tuple  # (fp32 partials, counters) the split-K workspace must hold
    device_index: int
    idle_ws: tuple  # stand-ins for the split-K buffers when splits == 1 (never read)


def _launch(plan: _Plan, a, b, out, sa, sb, bias) -> torch.Tensor:
    """Run a validated call, ``sa``/``sb`` being the kernel's scale views."""
    fn, max_clusters, _, _, dummy_bias, _, splits, ws_need, device_index, idle_ws = plan
    # The split-K buffers grow on demand (a later call may have replaced them): fetch them per call.
    partials, counters = _workspace(device_index).get(*ws_need) if splits > 1 else idle_ws
    fn(a, b, out, sa, sb, bias if bias is not None else dummy_bias, partials, counters, splits, max_clusters)
    return out


def _launchable(inst, device_index: int):
    """(compiled function, clusters to launch on this GPU) for a manifest instance, kept per instance."""
    hit = _LAUNCH_CACHE.get(inst)
    if hit is None:
        hit = _LAUNCH_CACHE[inst] = (_compiled(inst), _launch_clusters(device_index, inst))
    return hit


def _compiled(inst):
    """Compiled function for a manifest instance (compiled at most once per process and cache entry)."""
    from cutedsl_gemm.runtime.compile import compile_gemm

    return KERNEL_CACHE.get(inst, lambda: compile_gemm(inst.sm90_config(), inst.arch), arch=inst.arch)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: Optional[torch.Tensor] = None,
    use_fast_accum: bool = False,
    fmt_a=None,
    fmt_b=None,
    scale_recipe_a=None,
    scale_recipe_b=None,
    schedule: Optional[str] = None,
    split_k: Optional[int] = None,
) -> torch.Tensor:
    """FP8 GEMM with torch._scaled_mm's argument conventions.

    ``out = (a * scale_a) @ (b * scale_b) + bias`` computed with fp32 accumulation, where ``a`` is (M, K)
    row-major, ``b`` is (K, N) column-major (``w.t()`` of a row-major (N, K) weight), both E4M3 or E5M2.
    Scales are fp32 dequantization factors, in torch's shapes (see ``cutedsl_gemm.numerics.scale_layouts``):
    tensor-wise (one element each), row-wise (``scale_a`` (M, 1), ``scale_b`` (1, N)), or block-scaled per
    128-deep K block: 1x128 x 128x128 (DeepSeek-V3: ``scale_a`` (M, Kb), ``scale_b`` (Kb, ceil(N/128))),
    128x128 x 128x128 and 1x128 x 1x128. The shapes pick the recipe; ``scale_recipe_a``/``scale_recipe_b``
    (strings or ``torch.nn.functional.ScalingType``, as in ``F.scaled_mm``) name it explicitly.

    ``schedule`` overrides the manifest's choice by M ("small_m" for M <= 128, else "cooperative");
    ``split_k`` overrides the K-split heuristic (``dispatch.choose_splits``: split K when there are fewer
    output tiles than SMs; ``dispatch.last_wave_splits``: split the last, partial wave of a long-K problem
    with a little more than whole waves, in the instance's last-wave variant).
    ``bias`` is (N,) in ``out_dtype`` or fp32.

    ``use_fast_accum`` as in torch: False (default) adds every 128-deep K tile into an fp32 accumulator
    outside the tensor cores (accurate at large K); True lets the tensor cores accumulate all of K (faster,
    larger error at large K). Block-scaled recipes always scale and add each K block outside the tensor
    cores, so the flag does not apply to them.

    On Blackwell (sm_100) the call goes to the tcgen05 f8f6f4 kernel, which also takes packed FP6/FP4
    operands; ``fmt_a``/``fmt_b`` name their formats where the torch dtype cannot ("e2m3", "e3m2", "e2m1").
    """
    sig = None
    if fmt_a is None and fmt_b is None and type(a) is torch.Tensor and type(b) is torch.Tensor \
            and type(scale_a) is torch.Tensor and type(scale_b) is torch.Tensor \
            and (bias is None or type(bias) is torch.Tensor) and (out is None or type(out) is torch.Tensor):
        sig = _signature(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, scale_recipe_a, scale_recipe_b,
                         schedule, split_k)
        try:
            hit = _SIGNATURES.get(sig)
        except TypeError:  # an unhashable argument: validate the long way (and say what is wrong)
            sig = hit = None
        if hit is not None:
            _, _, recipe, kb, _, out_shape, _, _, _, _ = hit
            # (new_empty: ~1 us less per call than torch.empty(..., device=a.device) on the H100's host)
            dst = a.new_empty(out_shape, dtype=out_dtype) if out is None else out
            sa, sb = scale_layouts.kernel_views(recipe, kb, scale_a, scale_b)
            try:
                return _launch(hit, a, b, dst, sa, sb, bias)
            except (TypeError, ValueError):
                pass  # refused before launch: the full validation below says why (or re-plans for it)
    device = V.require_cuda_tensors(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out=out)
    arch, _ = _device_info(device.index)
    if arch.startswith("sm_100"):
        if out is not None:
            raise ValueError("out= is not supported by the sm_100 f8f6f4 path yet; omit it")
        from cutedsl_gemm.sm100 import sm100_f8f6f4_mm

        return sm100_f8f6f4_mm(a, b, fmt_a=fmt_a, fmt_b=fmt_b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    if fmt_a is not None or fmt_b is not None:
        raise ValueError("fmt_a/fmt_b select FP6/FP4 operand formats, which need a Blackwell (sm_100) GPU; "
                         "on Hopper pass float8_e4m3fn / float8_e5m2 tensors")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (expected b (K={k}, N))")
    a_name = V.require_fp8("a", a)
    b_name = V.require_fp8("b", b)
    out_name = V.require_out_dtype(out_dtype)
    recipe, sa, sb = scale_layouts.resolve(scale_a, scale_b, m, n, k, scale_recipe_a, scale_recipe_b)
    kb = -(-k // scale_layouts.SCALE_K)
    bias_name = None
    if bias is not None:
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape (N,) = ({n},), got {tuple(bias.shape)}")
        if bias.dtype not in (out_dtype, torch.float32):
            raise TypeError(f"bias must be {out_dtype} (the output dtype) or torch.float32, got {bias.dtype}")
        if bias.stride(0) != 1 and n > 1:
            raise ValueError("bias must be contiguous")
        bias_name = V.OUT_NAMES[bias.dtype]
    if out is not None:
        if tuple(out.shape) != (m, n) or out.dtype != out_dtype:
            raise ValueError(f"out must be a ({m}, {n}) {out_dtype} tensor, got {tuple(out.shape)} {out.dtype}")
        if n > 1 and out.stride(1) != 1 or m > 1 and (out.stride(0) * out.element_size()) % V.TMA_ALIGN:
            raise ValueError(f"out must be row-major with 16-byte aligned rows, got strides {tuple(out.stride())}")
        if out.data_ptr() % V.TMA_ALIGN:
            raise ValueError("out must have a 16-byte aligned base address (TMA store)")
    else:
        out = torch.empty((m, n), dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_() if bias is None else out.copy_(bias.to(out_dtype).expand(m, n))
        return out
    V.require_k_major("a", a, 1, "row-major (M, K)")
    V.require_k_major("b", b, 0, "column-major (K, N), i.e. w.t() of a row-major (N, K) weight")
    if (n * out.element_size()) % V.TMA_ALIGN:
        raise ValueError(f"N={n}: the TMA store needs output rows of a multiple of 16 bytes (N % {V.TMA_ALIGN // out.element_size()} == 0)")

    if not arch.startswith("sm_90"):
        V.require_hopper(device)
    accum = "fast" if use_fast_accum and recipe in ("tensor", "row") else "promoted"
    if schedule is not None and schedule not in ("cooperative", "small_m"):
        raise ValueError(f"schedule must be None, 'cooperative' or 'small_m', got {schedule!r}")
    inst = dispatch.select_gemm(arch, recipe, a_name, b_name, out_name, bias_name, m, accum, schedule,
                                n=n, sms=_device_info(device.index)[1], k=k)
    fn, max_clusters = _launchable(inst, device.index)
    if split_k is not None:
        if not inst.can_split_k:
            raise ValueError(f"split_k: {inst.name} is built without the split-K reduction (use_fast_accum=False "
                             "or schedule='small_m' select instances that have it)")
        if not isinstance(split_k, int) or not 1 <= split_k <= dispatch.MAX_SPLITS:
            raise ValueError(f"split_k must be an int in 1..{dispatch.MAX_SPLITS}, got {split_k!r}")
        splits = dispatch.normalize_splits(split_k, inst.k_tiles(k))
    else:
        # A wave is as many CTAs as can be resident at once.
        picked = inst
        inst, splits = dispatch.plan_splits(inst, m, n, k, max_clusters * inst.cluster_m * inst.cluster_n)
        if inst is not picked:  # its last-wave split variant: same tiles and clusters, same max_clusters
            fn, _ = _launchable(inst, device.index)
    ws_need = _workspace_need(inst, m, n, splits, max_clusters)
    plan = _Plan(fn, max_clusters, recipe, kb, _dummy_bias(device.index), (m, n), splits, ws_need, device.index,
                 _idle_workspace(device.index))
    if sig is not None:
        if len(_SIGNATURES) >= 4096:  # many distinct shapes (e.g. every batch size): start over
            _SIGNATURES.clear()
        _SIGNATURES[sig] = plan
    return _launch(plan, a, b, out, sa, sb, bias)
