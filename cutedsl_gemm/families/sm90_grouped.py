"""The grouped FP8 GEMM family on Hopper (op ``GROUPED_GEMM``, ``kernels/sm90/grouped_gemm.py``): what a
``grouped_scaled_mm`` call must be, the instance that runs it, the kernel configuration of an instance, its checks,
its compile entry, its shared-memory plan and its launch.

A call is described from metadata alone (shapes, dtypes, strides; never the values of ``offs`` / ``counts``, which
stay on the device), so the same description serves eager calls, the op's fake implementation and CUDA-graph
capture."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from cutedsl_gemm.numerics.formats import DTYPE_FORMATS, ceil_div, element_format, float_format
from cutedsl_gemm.selection import instances as M

BLOCK = 128  # the DeepSeek recipe's K block (A: 1 x 128 groups; W: 128 x 128 blocks)
A_DTYPES = (torch.float8_e4m3fn,)  # the grouped instances' operands
OUT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GroupedProblem:
    """A grouped GEMM call: ``experts`` groups of up to ``rows`` rows (contiguous: T, all groups' rows; masked: the
    capacity C of each group) times per-expert (N, K) weights; masked, ``expected_rows`` the rows the counts are
    expected to add up to (None: unknown, every group taken as full)."""

    layout: str
    recipe: str
    experts: int
    rows: int
    n: int
    k: int
    a_format: str
    b_format: str
    out_format: str
    expected_rows: Optional[int] = None

    @property
    def out_shape(self) -> tuple:
        return (self.rows, self.n) if self.layout == "contiguous" else (self.experts, self.rows, self.n)

    @property
    def rows_per_group(self) -> int:
        """The rows a group is expected to hold, what the instances' M ranges select by: the mean ceil(rows / E) of
        ``total_rows`` (the sizes stay on the device)."""
        return ceil_div(self.total_rows, max(self.experts, 1))

    @property
    def total_rows(self) -> int:
        """The rows expected over all groups: contiguous T; masked ``expected_rows``, or E * C without it."""
        if self.layout == "contiguous":
            return self.rows
        return self.experts * self.rows if self.expected_rows is None else self.expected_rows

    @property
    def is_empty(self) -> bool:
        return self.rows == 0 or self.n == 0 or self.experts == 0


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _scales(problem_layout: str, scale_a, scale_b, experts: int, rows: int, n: int, k: int) -> str:
    """The recipe the scales' shapes give ("tensor", "row" or "1x128_128x128"), after checking them."""
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
        _need(s.dtype == torch.float32, f"{name} must be float32 (decode scales: value = q * scale), got {s.dtype}")
    if scale_a.numel() == 1 and tuple(scale_b.shape) == (experts,):
        return "tensor"
    a_rows = (rows, 1) if problem_layout == "contiguous" else (experts, rows, 1)
    row_a = tuple(scale_a.shape) in (a_rows, a_rows[:-1])
    row_b = tuple(scale_b.shape) in ((experts, 1, n), (experts, n))
    if row_a and row_b:
        _need(scale_a.is_contiguous() and scale_b.is_contiguous(), "row-wise scales must be contiguous")
        return "row"
    kb, nb = ceil_div(k, BLOCK), ceil_div(n, BLOCK)
    a_blocks = (rows, kb) if problem_layout == "contiguous" else (experts, rows, kb)
    if tuple(scale_a.shape) == a_blocks and tuple(scale_b.shape) == (experts, kb, nb):
        return "1x128_128x128"
    raise ValueError(
        f"scales give no grouped recipe: scale_a {tuple(scale_a.shape)}, scale_b {tuple(scale_b.shape)}; expected "
        f"per tensor scale_a (1,) and scale_b ({experts},) (one per expert), row-wise scale_a {a_rows} (one per "
        f"row of a) and scale_b ({experts}, 1, {n}) (one per expert and output column), or DeepSeek-V3's blocks: "
        f"scale_a {a_blocks} (one per row and 128-deep K block, any strides: quantize_fp8(x, '1x128')'s layout) and "
        f"scale_b ({experts}, {kb}, {nb}) (per expert, its 128x128 blocks transposed like b)")


def describe(a, b, scale_a, scale_b, offs, counts, out_dtype, out, expected_rows=None) -> GroupedProblem:
    """Check a ``grouped_scaled_mm`` call's arguments (metadata only) and describe it."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _need(t.dtype in A_DTYPES, f"{name} must be float8_e4m3fn, got {t.dtype}")
    _need(b.dim() == 3, f"b must be (E, K, N) -- per expert the transpose of an (N, K) weight -- got {b.dim()}-D "
          f"{tuple(b.shape)}")
    experts, k, n = b.shape
    _need(b.stride(1) == 1 and b.stride(2) == k and b.stride(0) == n * k,
          f"b must be (E, K, N) with K contiguous, the view w.transpose(1, 2) of contiguous (E, N, K) weights; got "
          f"strides {b.stride()}")
    _need(k % 16 == 0, f"K = {k} must be a multiple of 16 (16-byte rows for TMA)")
    if a.dim() == 2:
        _need(counts is None, "counts is for the masked layout (a (E, C, K)); a 2-D a takes offs")
        _need(offs is not None, "a 2-D a (T, K), the tokens of all experts back to back, needs offs: (E,) int32, the "
              "cumulative end row of each expert's group")
        layout, rows = "contiguous", a.shape[0]
        groups, what = offs, "offs"
        _need(a.shape[1] == k, f"a is {tuple(a.shape)}, b {tuple(b.shape)}: a's K must be b's ({k})")
        _need(a.stride(1) == 1 and (a.shape[0] <= 1 or a.stride(0) == k), f"a must be contiguous, got strides "
              f"{a.stride()}")
    elif a.dim() == 3:
        _need(offs is None, "offs is for the contiguous layout (a (T, K)); a 3-D a (E, C, K) takes counts")
        _need(counts is not None, "a 3-D a (E, C, K) needs counts: (E,) int32, the rows of each expert to compute")
        layout, rows = "masked", a.shape[1]
        groups, what = counts, "counts"
        _need(a.shape[0] == experts and a.shape[2] == k, f"a is {tuple(a.shape)}, b {tuple(b.shape)}: expected "
              f"({experts}, C, {k})")
        _need(a.is_contiguous(), f"a must be contiguous, got strides {a.stride()}")
    else:
        raise ValueError(f"a must be (T, K) with offs or (E, C, K) with counts, got {a.dim()}-D {tuple(a.shape)}")
    if not isinstance(groups, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(groups).__name__}")
    _need(groups.dtype == torch.int32 and tuple(groups.shape) == (experts,) and groups.is_contiguous(),
          f"{what} must be a contiguous ({experts},) int32 tensor (one per expert), got {groups.dtype} "
          f"{tuple(groups.shape)}")
    for name, t in (("b", b), ("scale_a", scale_a), ("scale_b", scale_b), (what, groups)):
        if isinstance(t, torch.Tensor) and t.device != a.device:
            raise ValueError(f"all tensors must be on one device: {name} is on {t.device}, a on {a.device}")
    recipe = _scales(layout, scale_a, scale_b, experts, rows, n, k)
    _need(out_dtype in OUT_DTYPES, f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    a_format, b_format, out_format = (DTYPE_FORMATS[d].name for d in (a.dtype, b.dtype, out_dtype))
    if expected_rows is not None:
        _need(layout == "masked", "expected_rows is for the masked layout (a (E, C, K) with counts); the contiguous "
              "layout's rows are a's T")
        _need(type(expected_rows) is int and 0 <= expected_rows <= experts * rows,
              f"expected_rows must be None or an int from 0 to E * C = {experts * rows} (the rows the counts are "
              f"expected to add up to), got {expected_rows!r}")
    problem = GroupedProblem(layout, recipe, experts, rows, n, k, a_format, b_format, out_format, expected_rows)
    if out is not None:
        _need(isinstance(out, torch.Tensor) and tuple(out.shape) == problem.out_shape and out.dtype == out_dtype
              and out.is_contiguous() and out.device == a.device,
              f"out must be a contiguous {out_dtype} tensor of shape {problem.out_shape} on {a.device}")
    _need(k > 0 or problem.is_empty, "K = 0 is not a GEMM")
    return problem


def kernel_scales(problem: GroupedProblem, scale_a, scale_b):
    """The scale views the kernel takes: per tensor (1,) and (E,); row-wise (rows, groups of a) -- (T, 1) or
    (C, E) -- and (N, E); DeepSeek's blocks (rows, Kb, groups of a) -- (T, Kb, 1) or (C, Kb, E) -- and
    (Nb, Kb, E), any strides (views, no copies)."""
    e, rows, n = problem.experts, problem.rows, problem.n
    if problem.recipe == "tensor":
        return scale_a.reshape(1), scale_b.reshape(e)
    if problem.recipe == "1x128_128x128":
        sa = scale_a.unsqueeze(-1) if problem.layout == "contiguous" else scale_a.permute(1, 2, 0)
        return sa, scale_b.permute(2, 1, 0)
    sa = scale_a.reshape(rows, 1) if problem.layout == "contiguous" else scale_a.reshape(e, rows).t()
    return sa, scale_b.reshape(e, n).t()


def select(problem: GroupedProblem, sms: int) -> M.KernelInstance:
    """The table's instance for the call on a GPU of ``sms`` SMs (op GROUPED_GEMM, schedule = layout): the first
    whose M range holds the problem's rows per group, a 64-row tile wider than 128 only where ``wide_tiles_pay``,
    a clustered one only where ``clusters_pay``."""
    rows = max(problem.rows_per_group, 1)
    for inst in _instances(problem.layout, problem.recipe, problem.a_format, problem.b_format, problem.out_format):
        if inst.m_min <= rows <= inst.m_max and (inst.tile_m != 64 or inst.tile_n <= 128
                                                  or wide_tiles_pay(problem, sms)) and \
                (inst.cluster_m == 1 or clusters_pay(problem)):
            return inst
    raise ValueError(f"no grouped GEMM instance for {problem.layout} {problem.recipe} {problem.a_format} x "
                     f"{problem.b_format} -> {problem.out_format} at {rows} rows per group")


def wide_tiles_pay(problem: GroupedProblem, sms: int) -> bool:
    """Whether 64x256 tiles beat 64x128 ones: where the 64x128 tiles of the groups expected to hold rows fill more
    than one wave. Below that the wider tile halves the CTAs streaming W and each reads twice the bytes (0.85-0.9x
    on Qwen3-30B at one token); above it, it halves the units and reads each A tile once per 256 columns (1.02-1.3x).
    The groups holding rows: contiguous, at most one per row (the T rows are known, their split is not); masked,
    every group when C > 1 and no ``expected_rows`` is given, while at C = 1 (at most E pairs of a decode batch) how
    many are hit is unknown and the narrow tile stays; with ``expected_rows``, at most one per expected row.
    Measured on the H200: ``run_all.sh options-tiles``."""
    if problem.layout == "masked" and problem.expected_rows is None and problem.rows <= 1:
        return False
    groups = min(problem.experts, problem.total_rows)
    return groups * ceil_div(problem.n, 128) > sms


#: Shortest K at which the 2x1 clusters pay (measured at K = 14336: 1.08x; at K <= 7168: 0.8-0.95x).
CLUSTER_MIN_K = 8192


def clusters_pay(problem: GroupedProblem) -> bool:
    """Whether 2x1 clusters (each W tile multicast to a pair of m tiles) beat lone CTAs: at long K, where a unit's
    main loop is long against the pair's start and end (the two CTAs wait for each other's stage releases) and W's
    L2 traffic, halved, is what the main loop waits on. Their M range (the table's) asks for many rows per group,
    so that the pair's second tile is rarely past its group. Measured on the H200: ``run_all.sh options-prefill``."""
    return problem.k >= CLUSTER_MIN_K


@functools.lru_cache(maxsize=None)
def _instances(layout: str, recipe: str, a_format: str, b_format: str, out_format: str) -> tuple:
    # (a scan of the whole table costs milliseconds: once per kind of call)
    return M.select(op=M.GROUPED_GEMM, schedule=layout, recipe=recipe, a_dtype=a_format, b_dtype=b_format,
                    out_dtype=out_format)


# ------------------------------------------------------------------------------------------------
# configuration, checks, compile entry, resources and launch
# ------------------------------------------------------------------------------------------------
def config(inst: M.KernelInstance):
    """The grouped GEMM's configuration of an instance of op GROUPED_GEMM (its schedule is the layout;
    ``selection.instances.grouped_config``)."""
    from cutedsl_gemm.kernels.sm90.grouped_gemm import Sm90GroupedGemmConfig

    if inst.split_tail or inst.swap_ab or inst.cluster_n != 1 or inst.bias_dtype or \
            inst.accum != "promoted" or inst.tile_k != 128 or inst.ctas_per_sm != 1:
        raise ValueError("grouped GEMM rows are unswapped, promoted, 128-deep K tiles without bias, one CTA an SM, "
                         "clustered along M only")
    return Sm90GroupedGemmConfig(layout=inst.schedule, recipe=inst.recipe, a_dtype=inst.a_dtype,
                                 b_dtype=inst.b_dtype, out_dtype=inst.out_dtype, tile_m=inst.tile_m,
                                 tile_n=inst.tile_n, stages=inst.stages, early_row_scales=inst.early_row_scales,
                                 cluster_m=inst.cluster_m)


def check(inst: M.KernelInstance) -> None:
    """Raise ValueError with the reason if the grouped kernel cannot build ``inst`` (the fields it fixes, then
    ``Sm90GroupedGemmConfig.check``)."""
    config(inst).check()


def resources(inst: M.KernelInstance) -> tuple[int, int]:
    """(dynamic shared memory bytes, mainloop stages) of the instance's kernel, as its plan sets them."""
    from cutedsl_gemm.kernels.sm90.grouped_gemm import grouped_kernel

    kernel = grouped_kernel(config(inst))
    return kernel.smem_bytes, kernel.stages


def entry(inst: M.KernelInstance):
    """(kernel object, fake arguments) of a grouped instance: one compilation serves every T / C, E, N and K."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    from cutedsl_gemm.kernels.sm90.gemm_plan import cutlass_dtype
    from cutedsl_gemm.kernels.sm90.grouped_gemm import grouped_kernel

    cfg = config(inst)
    e, rows, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=16)
    a_t, d_t = cutlass_dtype(cfg.a_dtype), cutlass_dtype(cfg.out_dtype)
    if cfg.layout == "contiguous":
        a = make_fake_compact_tensor(a_t, (rows, k), stride_order=(1, 0), assumed_align=16)
        d = make_fake_compact_tensor(d_t, (rows, n), stride_order=(1, 0), assumed_align=4)
        sa_rows = (rows, 1)
    else:
        a = make_fake_compact_tensor(a_t, (e, rows, k), stride_order=(2, 1, 0), assumed_align=16)
        d = make_fake_compact_tensor(d_t, (e, rows, n), stride_order=(2, 1, 0), assumed_align=4)
        sa_rows = (rows, e)
    b = make_fake_compact_tensor(cutlass_dtype(cfg.b_dtype), (e, k, n), stride_order=(2, 0, 1), assumed_align=16)
    if cfg.recipe == "tensor":
        sa = make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4)
        sb = make_fake_compact_tensor(cutlass.Float32, (e,), assumed_align=4)
    elif cfg.recipe == "1x128_128x128":  # (rows, Kb, groups of a) and (Nb, Kb, E) with run-time strides
        kb = cute.sym_int()
        strides = lambda: (cute.sym_int(), cute.sym_int(), cute.sym_int())  # noqa: E731
        sa = make_fake_tensor(cutlass.Float32, (rows, kb, 1 if cfg.layout == "contiguous" else e), strides(),
                              assumed_align=4)
        sb = make_fake_tensor(cutlass.Float32, (cute.sym_int(), kb, e), strides(), assumed_align=4)
    else:  # column-major views: (T, 1) / (C, E) rows of a, (N, E) columns of W
        sa = make_fake_compact_tensor(cutlass.Float32, sa_rows, stride_order=(0, 1), assumed_align=4)
        sb = make_fake_compact_tensor(cutlass.Float32, (n, e), stride_order=(0, 1), assumed_align=4)
    groups = make_fake_compact_tensor(cutlass.Int32, (e,), assumed_align=4)
    return grouped_kernel(cfg), (a, b, d, sa, sb, groups, cutlass.Int32(1), cutlass.Int32(1),
                                     make_fake_stream(use_tvm_ffi_env_stream=True))


@functools.lru_cache(maxsize=None)  # per call on the launch path: a lookup, not the format and kernel imports
def band_m(n: int, k: int, b_format: str, l2_bytes: int) -> int:
    """m tiles of a group the kernel walks before moving along N: N fastest (1) while one expert's W (N x K) fits
    in L2, where the rows of a wave re-read it along N from there; past it bands of ``RASTER_GROUP_M``, so that a
    wave shares each W tile among a band's rows. Measured on the H200 (50 MB of L2; ``bench_grouped``, the tree
    before this rule against bands everywhere): bands made Mixtral's gate_up (117 MB per expert) 12-28% faster and
    the DeepSeek-V3 and Qwen3 GEMMs (3-29 MB per expert) 2-7% slower."""
    from cutedsl_gemm.kernels.sm90.grouped_gemm import RASTER_GROUP_M

    w_bytes = n * k * element_format(b_format).bits // 8
    return RASTER_GROUP_M if w_bytes > l2_bytes else 1


class GroupedPlan(NamedTuple):
    """A grouped instance compiled and sized for one GPU."""

    fn: object
    max_ctas: int
    l2_bytes: int

    def run(self, a, b, out, scale_a, scale_b, groups, band: int) -> torch.Tensor:
        """Launch on the current stream; the scales as ``kernel_scales`` returns them, ``band`` as ``band_m``."""
        self.fn(a, b, out, scale_a, scale_b, groups, self.max_ctas, band)
        return out


@functools.lru_cache(maxsize=None)
def plan(inst: M.KernelInstance, device_index: int) -> GroupedPlan:
    """Compile (once) and size the persistent grid of ``inst`` on GPU ``device_index``: as many CTAs as the GPU
    holds at once (one per SM), as the dense plans size theirs."""
    from cutedsl_gemm.runtime.device import l2_bytes, launch_clusters
    from cutedsl_gemm.runtime.resources import compiled

    return GroupedPlan(compiled(inst), launch_clusters(device_index, inst), l2_bytes(device_index))


def device_sms(device_index: int) -> int:
    """The SMs of GPU ``device_index``, what ``select`` sizes a wave by."""
    from cutedsl_gemm.runtime.device import device_info

    return device_info(device_index)[1]


def launch(problem: GroupedProblem, a, b, scale_a, scale_b, groups, out: Optional[torch.Tensor],
           prepared: Optional[GroupedPlan] = None) -> torch.Tensor:
    """Run the call ``problem`` describes (``describe``'s arguments) on the current stream, with ``prepared`` (the
    plan of ``problem``'s instance, kept by the op for repeated calls) or the plan looked up now."""
    dst = a.new_empty(problem.out_shape, dtype=float_format(problem.out_format).torch_dtype) if out is None else out
    if problem.is_empty:
        return dst
    sa, sb = kernel_scales(problem, scale_a, scale_b)
    ready = prepared or plan(select(problem, device_sms(a.device.index)), a.device.index)
    band = band_m(problem.n, problem.k, problem.b_format, ready.l2_bytes)
    return ready.run(a, b, dst, sa, sb, groups, band)
