"""A mixture-of-experts layer's routing in one kernel on each side of its grouped GEMMs.

``route_quantize_fp8(hidden (T, H), topk_ids (T, k), topk_weights (T, k), E, granularity)`` places the (token,
slot) pairs by expert and writes each token's row, quantized to FP8 (``quantize_fp8``'s codes and scales, bit for
bit: per token for "row", per 1x128 group for "1x128", one scale over all of hidden for "tensor"), into every row
its pairs take:

- contiguous (``capacity`` None): R = T*k rows in the stable sort's order by expert (pairs of one expert in token
  order, as ``nn.moe.permute`` orders them); ``groups`` (E,) int32 the cumulative end rows (``offs``);
- masked (``capacity`` C): R = E*C rows, expert e's c-th pair at row e*C + c; ``groups`` (E,) int32 the counts,
  clamped to C; a pair past the capacity is dropped.

It also returns ``pos`` (T, k) int32, the row of each pair (-1: dropped, or an id outside [0, E)), and
``pair_weights`` (R,) fp32, each row's routing weight (for ``silu_mul_quantize_fp8``, so that the linear down
projection weights its rows). Rows no pair takes are not written: the grouped GEMM reads none of them (contiguous:
past ``groups[-1]``; masked: past each count). Scales (R, 1) for "row", (R, ceil(H / 128)) M-major for "1x128",
(1,) for "tensor": the layouts ``grouped_scaled_mm`` takes (masked: their (E, C, ...) views). (The per-tensor scale
is hidden's: the sort path's over the routed rows is the same where every token routes to at least one expert.)

``sum_routed_pairs(y, pos)``: (T, H) in y's dtype, each token's k rows ``y[pos[t, j]]`` of the experts' output
(R, H) or (E, C, H) added in fp32 in slot order and rounded once; NaN for a token with a pair at -1, so that a
dropped pair shows rather than vanishes.

Both run their kernels (``kernels/sm90/moe_route.py``) on CUDA tensors and their torch reference elsewhere (the same
bits; ``backend`` as in ``quantize_fp8``). Up to ``ROUTE_MAX_ID_READS`` expert ids read in all, one kernel routes
(each of its T CTAs reads all T*k ids: decode, small batches); past it three (prefill): per block of 64 tokens a
count of its pairs per expert, the experts' totals and first rows, then the routing kernel from those counts.
``routes_by_kernel`` is the rule for when the MoE layer routes by these kernels rather than by a sort. Their torch
operators (``torch.ops.cutedsl_gemm.route_quantize_fp8``, ``sum_routed_pairs``) and fakes are defined here.
"""

from __future__ import annotations

from typing import Optional

import torch

from cutedsl_gemm.numerics.formats import (
    DTYPE_FORMATS,
    FLOAT_FORMATS,
    FP8_FORMATS,
    ScaleGranularity,
    ceil_div,
    element_format,
    float_format,
)
from cutedsl_gemm.ops.library import EAGER, OPS, define, op_name
from cutedsl_gemm.ops.quantize import VEC, amax_partials_plan, kernel_backend, quantize_fp8
from cutedsl_gemm.runtime.jit import KERNEL_CACHE
from cutedsl_gemm.runtime.plans import PREPARED

G = ScaleGranularity
ROUTE_GRANULARITIES = (G.ROW, G.GROUP_1x128, G.TENSOR)
# the kernel's limits (kernels/sm90/moe_route.py: MAX_TOP_K, MAX_EXPERTS, MAX_HIDDEN; its module is not imported
# before a kernel is built)
MAX_TOP_K, MAX_EXPERTS, MAX_HIDDEN = 32, 1024, 65536
#: One kernel routes while its T CTAs read at most this many expert ids in all (T * T*k: 512 tokens of top-8, 1024 of
#: top-2); past it, the blocked form (three kernels).
ROUTE_MAX_ID_READS = 512 * 4096
ROUTE_BLOCK_TOKENS = 64  # (kernels/sm90/moe_route.py) tokens per block of the blocked form's count
ID_DTYPES = (torch.int32, torch.int64)
ROUTE, PAIR_SUM = "route_quantize", "sum_routed_pairs"  # the prepared-call cache's kinds


def routes_by_kernel(tokens: int, top_k: int, num_experts: int, hidden: int) -> bool:
    """Whether the MoE layer routes ``tokens`` x ``top_k`` pairs with ``route_quantize_fp8`` rather than a sort, a
    gather and the quantizer: within the kernels' limits."""
    return (0 < tokens * top_k and top_k <= MAX_TOP_K and num_experts <= MAX_EXPERTS and hidden <= MAX_HIDDEN
            and hidden % VEC == 0)


def routes_in_one_kernel(tokens: int, top_k: int) -> bool:
    """Whether ``route_quantize_fp8`` routes ``tokens`` x ``top_k`` pairs in one kernel (else the blocked form)."""
    return tokens * tokens * top_k <= ROUTE_MAX_ID_READS


# --- the order of the pairs (shared with nn.moe's sort-based routing) -----------------------------------------


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple:
    """(expert ids sorted, order, the expert ids 0 .. E-1): the (token, k) pairs, flattened token-major, ordered by
    expert with a stable sort, so that within an expert they stay in token order; ``searchsorted`` of the expert
    ids in the sorted ones gives each expert's first row (left) and end row (right)."""
    # the narrowest integer that holds the ids: the radix sort makes a pass per 4 bits of its key (int64 ids cost
    # 4x the int16 sort)
    key = torch.int16 if num_experts < 1 << 15 else torch.int32  # (route_pairs sorts invalid ids as E)
    flat = topk_ids.reshape(-1).to(key)
    sorted_ids, order = torch.sort(flat, stable=True)
    return sorted_ids, order, torch.arange(num_experts, device=flat.device, dtype=flat.dtype)


def pair_rows(order: torch.Tensor, num_tokens: int, k: int) -> torch.Tensor:
    """(T, k) int32: the row of the sorted layout (``sort_pairs``' ``order``, ``nn.moe.permute``'s) that each
    (token, slot) pair took -- the permutation inverted -- as ``sum_routed_pairs`` reads them."""
    if order.dim() != 1 or order.shape[0] != num_tokens * k:
        raise ValueError(f"order must be (T*k,) with T*k = {num_tokens} * {k}, got {tuple(order.shape)}")
    rows = torch.empty(order.shape[0], dtype=torch.int32, device=order.device)
    rows.scatter_(0, order, torch.arange(order.shape[0], dtype=torch.int32, device=order.device))
    return rows.view(num_tokens, k)


def route_pairs(topk_ids: torch.Tensor, num_experts: int, capacity: Optional[int] = None) -> tuple:
    """(pos (T, k) int32, groups (E,) int32) by torch: the rows ``route_quantize_fp8`` gives the pairs and its
    groups. An id outside [0, E) sorts past every expert (its pair takes no row: -1)."""
    t, k = topk_ids.shape
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    ids = torch.where(valid, topk_ids, num_experts)  # (sorted last, in no group)
    sorted_ids, order, experts = sort_pairs(ids, num_experts)
    ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    rows = pair_rows(order, t, k)
    if capacity is None:
        return torch.where(valid, rows, -1), ends
    starts = torch.cat([ends.new_zeros(1), ends[:-1]]).long()
    rank = rows - starts[ids.clamp(max=num_experts - 1)]
    pos = torch.where(valid & (rank < capacity), ids * capacity + rank, -1)
    return pos.to(torch.int32), (ends - starts).clamp(max=capacity).to(torch.int32)


# --- route_quantize_fp8 ------------------------------------------------------------------------------------------


def _route_arguments(hidden, topk_ids, topk_weights, num_experts, granularity, capacity, fmt, backend,
                     pointers=True):
    """(granularity, fmt, rows R, whether the kernel runs) of a call, after every check on its arguments."""
    if not isinstance(hidden, torch.Tensor) or DTYPE_FORMATS.get(hidden.dtype) not in FLOAT_FORMATS:
        raise TypeError(f"hidden must be a bfloat16, float16 or float32 tensor, got "
                        f"{getattr(hidden, 'dtype', type(hidden).__name__)}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (tokens, hidden), got shape {tuple(hidden.shape)}")
    t, h = hidden.shape
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids must be (tokens, k) = ({t}, k), got shape "
                         f"{tuple(getattr(topk_ids, 'shape', ()))}")
    if topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"topk_ids must be int32 or int64 expert ids, got {topk_ids.dtype}")
    k = topk_ids.shape[1]
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (t, k):
        raise ValueError(f"topk_weights must be (tokens, k) = ({t}, {k}), got shape "
                         f"{tuple(getattr(topk_weights, 'shape', ()))}")
    if DTYPE_FORMATS.get(topk_weights.dtype) not in FLOAT_FORMATS:
        raise TypeError(f"topk_weights must be bfloat16, float16 or float32, got {topk_weights.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"capacity must be None (contiguous) or a positive int (masked), got {capacity!r}")
    try:
        gran = G.named(granularity) if isinstance(granularity, (str, ScaleGranularity)) else None
    except ValueError:
        gran = None
    if gran not in ROUTE_GRANULARITIES:
        raise ValueError(f"route_quantize_fp8 takes granularity 'row', '1x128' or 'tensor' (the activations of the "
                         f"row-wise, DeepSeek and per-tensor recipes), got {granularity!r}")
    fmt = element_format(fmt)
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt.name!r}")
    for name, x in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if x.device != hidden.device:
            raise ValueError(f"{name} is on {x.device}, hidden on {hidden.device}")
    use_kernel = kernel_backend(hidden, backend)
    if use_kernel:
        if h % VEC or h > MAX_HIDDEN:
            raise ValueError(f"the routing kernel takes a hidden size that is a multiple of {VEC} up to "
                             f"{MAX_HIDDEN}, got {h}")
        if k > MAX_TOP_K or num_experts > MAX_EXPERTS:
            raise ValueError(f"the routing kernel takes k <= {MAX_TOP_K} and at most {MAX_EXPERTS} experts, got "
                             f"k = {k}, {num_experts} experts")
        for name, x in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not x.is_contiguous():
                raise ValueError(f"{name} must be contiguous (row-major), got strides {x.stride()}")
        if pointers and hidden.data_ptr() % 16:
            raise ValueError("hidden's data pointer must be 16-byte aligned (a sliced view may not be); call .clone()")
    rows = t * k if capacity is None else num_experts * capacity
    return gran, fmt, rows, use_kernel


def _route_outputs(hidden, gran, fmt, rows: int, num_experts: int, k: int):
    """Empty (q, scales, groups, pos, pair_weights) of a call with R = ``rows``."""
    h, dev = hidden.shape[1], hidden.device
    if gran is G.TENSOR:
        s = torch.empty(1, dtype=torch.float32, device=dev)
    elif gran is G.ROW:
        s = torch.empty((rows, 1), dtype=torch.float32, device=dev)
    else:
        s = torch.empty((ceil_div(h, 128), rows), dtype=torch.float32, device=dev).t()
    return (torch.empty((rows, h), dtype=fmt.torch_dtype, device=dev), s,
            torch.empty(num_experts, dtype=torch.int32, device=dev),
            torch.empty((hidden.shape[0], k), dtype=torch.int32, device=dev),
            torch.empty(rows, dtype=torch.float32, device=dev))


def _route_reference(hidden, topk_ids, topk_weights, num_experts, gran, capacity, fmt, rows):
    """The routing by torch: ``route_pairs``, then each token's quantized row copied into its pairs' rows (the rows
    no pair takes zero)."""
    t, k = topk_ids.shape
    q, s, groups, pos, weights = _route_outputs(hidden, gran, fmt, rows, num_experts, k)
    pos_, groups_ = route_pairs(topk_ids, num_experts, capacity)
    qt, st = quantize_fp8(hidden, gran, fmt=fmt, backend="reference")
    taken = pos_.view(-1) >= 0
    dst = pos_.view(-1)[taken].long()
    token = torch.arange(t, device=hidden.device).repeat_interleave(k)[taken]
    q.view(torch.uint8).zero_().index_copy_(0, dst, qt.view(torch.uint8).index_select(0, token))
    if gran is G.TENSOR:
        s.copy_(st.reshape(1))
    else:
        s.zero_().index_copy_(0, dst, st.index_select(0, token))
    weights.zero_().index_copy_(0, dst, topk_weights.reshape(-1).float()[taken])
    groups.copy_(groups_)
    pos.copy_(pos_)
    return q, s, groups, pos, weights


def _id_dtype(topk_ids):
    import cutlass

    return cutlass.Int64 if topk_ids.dtype == torch.int64 else cutlass.Int32


def _route_kernels(hidden, topk_ids, topk_weights, num_experts, gran, fmt, capacity, blocked: bool):
    """The compiled routing kernels for this call's shapes and dtypes (compiled once per signature): the routing
    quantizer, and for the blocked form its count and totals kernels before it."""
    from cutedsl_gemm.runtime.compile import compile_entry  # (imports the DSL: only when compiling)

    src, k, masked = float_format(hidden.dtype), topk_ids.shape[1], capacity is not None
    key = ("moe_route", src.cutlass_name, fmt.name, gran.label, hidden.shape[1], k, num_experts, masked,
           str(topk_ids.dtype), str(topk_weights.dtype), blocked)

    def route():
        from cutedsl_gemm.kernels.sm90 import moe_route as K

        w = float_format(topk_weights.dtype).cutlass_dtype()
        return compile_entry(*K.route_entry(src.cutlass_dtype(), fmt.cutlass_dtype(), fmt.max_finite, gran.label,
                                            hidden=hidden.shape[1], top_k=k, experts=num_experts, masked=masked,
                                            id_dtype=_id_dtype(topk_ids), weight_dtype=w, blocked=blocked))

    fns = [KERNEL_CACHE.get(key, route)]
    if blocked:
        from cutedsl_gemm.kernels.sm90 import moe_route as K

        fns.append(KERNEL_CACHE.get(("moe_route_count", k, num_experts, str(topk_ids.dtype)),
                                    lambda: compile_entry(*K.count_entry(k, num_experts, _id_dtype(topk_ids)))))
        fns.append(KERNEL_CACHE.get(("moe_route_totals", num_experts, masked),
                                    lambda: compile_entry(*K.totals_entry(num_experts, masked))))
    return fns


def _route_plan(hidden, topk_ids, topk_weights, num_experts, gran, fmt, capacity, rows):
    t, k = topk_ids.shape
    blocked = not routes_in_one_kernel(t, k)
    fns = _route_kernels(hidden, topk_ids, topk_weights, num_experts, gran, fmt, capacity, blocked)
    cap, dev = capacity or 1, hidden.device
    blocks = ceil_div(t, ROUTE_BLOCK_TOKENS) if blocked else 1
    amax = amax_partials_plan(hidden, fmt) if gran is G.TENSOR else None  # (the one scale: quantize_fp8's pass 1)
    # arguments the kernel does not read, one tensor each: the block counts and first rows (one kernel), the partial
    # maxima (but per tensor)
    unread_counts = None if blocked else (torch.empty((1, num_experts), dtype=torch.int32, device=dev),
                                          torch.empty(num_experts, dtype=torch.int32, device=dev))
    unread_part = None if amax else torch.empty(1, dtype=torch.float32, device=dev)

    def run(hidden, topk_ids, topk_weights):
        q, s, groups, pos, weights = _route_outputs(hidden, gran, fmt, rows, num_experts, k)
        ids = topk_ids.view(-1)
        if blocked:
            hist = torch.empty((blocks, num_experts), dtype=torch.int32, device=hidden.device)
            start = torch.empty(num_experts, dtype=torch.int32, device=hidden.device)
            fns[1](ids, hist)
            fns[2](hist, start, groups, cap)
        else:
            hist, start = unread_counts
        part = unread_part if amax is None else amax(hidden)
        fns[0](hidden, ids, topk_weights.view(-1), q, s, weights, pos.view(-1), groups, cap, hist, start, part)
        return q, s, groups, pos, weights
    return run


def route_quantize_fp8(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                       granularity="row", *, capacity: Optional[int] = None, fmt="e4m3", backend: str = "auto"):
    """``(q (R, H), scales, groups (E,) int32, pos (T, k) int32, pair_weights (R,) fp32)``: the pairs placed by
    expert, contiguous or (``capacity``) masked, and each token's row quantized into its pairs' rows (see the
    module docstring). Under ``torch.compile`` the kernel path is the op
    ``torch.ops.cutedsl_gemm.route_quantize_fp8``."""
    if torch.compiler.is_compiling() and (backend == "auto" or backend == "kernel" and hidden.is_cuda):
        return OPS.route_quantize_fp8(hidden, topk_ids, topk_weights, num_experts, op_name(granularity),
                                      capacity=capacity, fmt=op_name(fmt))
    sig = None
    if all(type(x) is torch.Tensor for x in (hidden, topk_ids, topk_weights)):
        sig = (hidden.shape, hidden.dtype, hidden.get_device(), topk_ids.shape, topk_ids.dtype, topk_weights.dtype,
               topk_weights.get_device(), topk_ids.get_device(), num_experts, granularity, capacity, fmt, backend,
               routes_in_one_kernel(*topk_ids.shape))
        try:
            run = PREPARED.get(ROUTE, sig)
        except TypeError:
            sig = run = None
        if run is not None and hidden.is_contiguous() and topk_ids.is_contiguous() and \
                topk_weights.is_contiguous() and hidden.data_ptr() % 16 == 0:
            return run(hidden, topk_ids, topk_weights)
    gran, fmt_, rows, use_kernel = _route_arguments(hidden, topk_ids, topk_weights, num_experts, granularity,
                                                    capacity, fmt, backend)
    if hidden.shape[0] == 0 or not use_kernel:
        return _route_reference(hidden, topk_ids, topk_weights, num_experts, gran, capacity, fmt_, rows)
    run = _route_plan(hidden, topk_ids, topk_weights, num_experts, gran, fmt_, capacity, rows)
    if sig is not None:
        PREPARED.keep(ROUTE, sig, run)
    return run(hidden, topk_ids, topk_weights)


def route_quantize_fp8_like(hidden, topk_ids, topk_weights, num_experts, granularity="row", *, capacity=None,
                            fmt="e4m3"):
    """Empty outputs as ``route_quantize_fp8`` returns them, after its checks but the addresses: the op's fake."""
    gran, fmt_, rows, _ = _route_arguments(hidden, topk_ids, topk_weights, num_experts, granularity, capacity, fmt,
                                           "auto", pointers=False)
    return _route_outputs(hidden, gran, fmt_, rows, num_experts, topk_ids.shape[1])


define("route_quantize_fp8",
       '(Tensor hidden, Tensor topk_ids, Tensor topk_weights, int num_experts, str granularity="row", *, '
       'int? capacity=None, str fmt="e4m3") -> (Tensor, Tensor, Tensor, Tensor, Tensor)',
       route_quantize_fp8, route_quantize_fp8_like)
EAGER.route_quantize_fp8 = route_quantize_fp8


# --- sum_routed_pairs --------------------------------------------------------------------------------------------


def _sum_arguments(y, pos, backend, pointers=True):
    """(y as (R, H), whether the kernel runs) after every check on the arguments."""
    if not isinstance(y, torch.Tensor) or DTYPE_FORMATS.get(y.dtype) not in FLOAT_FORMATS:
        raise TypeError(f"y must be a bfloat16, float16 or float32 tensor, got {getattr(y, 'dtype', type(y).__name__)}")
    if y.dim() not in (2, 3):
        raise ValueError(f"y must be the experts' output (R, H) or (E, C, H), got shape {tuple(y.shape)}")
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int32 or pos.dim() != 2:
        raise ValueError(f"pos must be route_quantize_fp8's (tokens, k) int32 rows, got "
                         f"{getattr(pos, 'dtype', type(pos).__name__)} {tuple(getattr(pos, 'shape', ()))}")
    if pos.device != y.device:
        raise ValueError(f"pos is on {pos.device}, y on {y.device}")
    if pos.shape[1] < 1:
        raise ValueError("pos must have at least one slot per token (k >= 1)")
    rows = y.reshape(-1, y.shape[-1]) if y.is_contiguous() else None
    use_kernel = kernel_backend(y, backend)
    if use_kernel:
        vec = 16 // y.element_size()
        if rows is None or not pos.is_contiguous():
            raise ValueError("y and pos must be contiguous for the kernel")
        if y.shape[-1] % vec:
            raise ValueError(f"the kernel takes rows of a multiple of 16 bytes ({vec} elements), got {y.shape[-1]}")
        if pos.shape[1] > MAX_TOP_K:
            raise ValueError(f"the kernel takes k <= {MAX_TOP_K}, got {pos.shape[1]}")
        if pointers and y.data_ptr() % 16:
            raise ValueError("y's data pointer must be 16-byte aligned (a sliced view may not be); call .clone()")
    return (rows if rows is not None else y.reshape(-1, y.shape[-1])), use_kernel


def _sum_reference(rows, pos):
    """Each token's k rows added in fp32 in slot order, rounded once; NaN where a slot is -1."""
    t, k = pos.shape
    picked = rows.index_select(0, pos.clamp(min=0).reshape(-1).long()).view(t, k, rows.shape[1])
    acc = picked[:, 0].float()
    for j in range(1, k):  # a fixed order: the kernel's
        acc = acc + picked[:, j].float()
    return acc.masked_fill_((pos < 0).any(1, keepdim=True), float("nan")).to(rows.dtype)


def _sum_kernel(rows, k):
    key = ("moe_pair_sum", str(rows.dtype), k)

    def build():
        from cutedsl_gemm.kernels.sm90 import moe_route as K
        from cutedsl_gemm.runtime.compile import compile_entry

        return compile_entry(*K.pair_sum_entry(float_format(rows.dtype).cutlass_dtype(), k))

    return KERNEL_CACHE.get(key, build)


def sum_routed_pairs(y: torch.Tensor, pos: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """(T, H) in y's dtype: ``sum_j y[pos[t, j]]`` over the experts' output y (R, H) or (E, C, H), in fp32 in slot
    order, NaN for a token with a slot at -1 (see the module docstring). Under ``torch.compile`` the kernel path is
    the op ``torch.ops.cutedsl_gemm.sum_routed_pairs``."""
    if torch.compiler.is_compiling() and (backend == "auto" or backend == "kernel" and y.is_cuda):
        return OPS.sum_routed_pairs(y, pos)
    rows, use_kernel = _sum_arguments(y, pos, backend)
    t, h = pos.shape[0], rows.shape[1]
    if t == 0 or not use_kernel:
        return _sum_reference(rows, pos)
    fn = _sum_kernel(rows, pos.shape[1])
    out = rows.new_empty((t, h))
    fn(rows, pos.view(-1), out)
    return out


def sum_routed_pairs_like(y, pos):
    """An empty (T, H) output after ``sum_routed_pairs``' checks but the addresses: the op's fake."""
    rows, _ = _sum_arguments(y, pos, "auto", pointers=False)
    return rows.new_empty((pos.shape[0], rows.shape[1]))


define("sum_routed_pairs", "(Tensor y, Tensor pos) -> Tensor", sum_routed_pairs, sum_routed_pairs_like)
EAGER.sum_routed_pairs = sum_routed_pairs
