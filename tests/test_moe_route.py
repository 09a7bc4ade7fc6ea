"""``route_quantize_fp8`` and ``sum_routed_pairs``: a MoE layer's routing in one kernel on each side of its GEMMs.

CPU: the torch reference against the sort-based glue of ``nn.moe`` (``permute``, ``to_masked``, ``pair_weights``)
and the quantizer, plain loops for the rows and sums, ids outside the experts, the errors, the ops' fakes and
opcheck; ``compile``: the kernels' PTX; ``gpu``: the kernels against the reference bit for bit (codes, scales,
rows, groups, weights, sums) on NaN-poisoned outputs, the DeepSeek-V3 and Qwen3 sizes, skew, overflow, CUDA graph
replay with new routings.
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cutedsl_gemm.nn import moe
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.ops import moe_route as M
from cutedsl_gemm.ops.quantize import quantize_fp8

OPS = torch.ops.cutedsl_gemm
U8 = torch.uint8


def _routing(t, k, e, seed, device="cpu", skew=False, dtype=torch.int64, wdtype=torch.float32):
    """(ids (t, k), weights (t, k)): k distinct experts per token; ``skew``: expert 0 in every token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if skew:  # expert 0 first in every token; where it was elsewhere, the token's first expert takes its place
        first = ids[:, :1].clone()
        ids[:, 1:] = torch.where(ids[:, 1:] == 0, first, ids[:, 1:])
        ids[:, 0] = 0
    w = torch.rand(t, k, generator=g) + 0.05
    return ids.to(dtype).to(device), w.to(wdtype).to(device)


def _hidden(t, h, seed, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-6, 6, (t, 1), generator=g).float())
    return x.to(dtype).to(device)


def _loop_rows(ids, e, capacity=None):
    """Each pair's row by a Python loop: contiguous, the pairs of expert 0 in token order, then expert 1's, ...;
    masked, e * C + (its rank within its expert) while that is below C. -1 for an id outside [0, e)."""
    t, k = ids.shape
    flat = ids.reshape(-1).tolist()
    rows, count = [-1] * (t * k), [0] * e
    order = [p for x in range(e) for p, v in enumerate(flat) if v == x]
    for r, p in enumerate(order):
        rank = count[flat[p]]
        count[flat[p]] += 1
        rows[p] = r if capacity is None else (flat[p] * capacity + rank if rank < capacity else -1)
    groups = torch.tensor(count).cumsum(0) if capacity is None else torch.tensor(count).clamp(max=capacity)
    return torch.tensor(rows).view(t, k), groups.to(torch.int32)


SHAPES = [  # (tokens, k, experts, hidden)
    (1, 8, 128, 2048),  # one decode token, Qwen3-30B-A3B
    (16, 8, 256, 7168),  # DeepSeek-V3
    (37, 2, 8, 4096),  # Mixtral
    (64, 4, 16, 272),  # a hidden size past a 128 multiple
]


# ------------------------------------------------------------------------------------------------------------------
# CPU: the reference
# ------------------------------------------------------------------------------------------------------------------


GRANS = ["row", "1x128", "tensor"]


def _as_returned(s, gran):
    """The routing op's scales in quantize_fp8's form (per tensor: its (1,) scale as the 0-d one)."""
    return s.reshape(()) if gran == "tensor" else s


@pytest.mark.parametrize("t, k, e, h", SHAPES)
@pytest.mark.parametrize("gran", GRANS)
def test_reference_is_the_sort_based_glue(t, k, e, h, gran):
    ids, w = _routing(t, k, e, seed=t + e)
    x = _hidden(t, h, seed=t)
    q, s, groups, pos, pw = M.route_quantize_fp8(x, ids, w, e, gran)
    px, offs, order = moe.permute(x, ids, e)
    want_q, want_s = quantize_fp8(px, gran)  # (per tensor: every token routes, so its rows' amax is hidden's)
    s = _as_returned(s, gran)
    assert torch.equal(q.view(U8), want_q.view(U8)) and torch.equal(s, want_s) and s.stride() == want_s.stride()
    assert torch.equal(groups, offs) and torch.equal(pw, moe.pair_weights(w, order))
    rows, loop_groups = _loop_rows(ids, e)
    assert torch.equal(pos.long(), rows) and torch.equal(groups, loop_groups) and pos.dtype == torch.int32


@pytest.mark.parametrize("capacity", [1, 3, 64])
# (per tensor left out: where pairs drop, the masked rows' amax is not hidden's, which the routing takes)
@pytest.mark.parametrize("gran", ["row", "1x128"])
def test_masked_reference_is_to_masked(capacity, gran):
    t, k, e, h = 40, 4, 12, 256
    ids, w = _routing(t, k, e, seed=capacity, skew=True)
    x = _hidden(t, h, seed=5)
    q, s, counts, pos, pw = M.route_quantize_fp8(x, ids, w, e, gran, capacity=capacity)
    masked, want_counts, slot, overflow = moe.to_masked(x, ids, e, capacity)
    assert torch.equal(counts, want_counts) and torch.equal(pos.view(-1).long(), slot)
    assert bool(overflow) == (capacity < t)  # expert 0 takes every token
    assert torch.equal(pos.long(), _loop_rows(ids, e, capacity)[0])
    live = (torch.arange(capacity) < counts[:, None]).view(-1)
    want_q, want_s = quantize_fp8(masked.view(e * capacity, h), gran)
    assert torch.equal(q.view(U8)[live], want_q.view(U8)[live]) and torch.equal(s[live], want_s[live])
    assert torch.equal(pw.view(e, capacity), moe.masked_pair_weights(w, slot, e, capacity))
    assert q.shape == (e * capacity, h) and s.shape[0] == e * capacity


def test_ids_outside_the_experts_take_no_row():
    ids, w = _routing(6, 2, 4, seed=1)
    ids[1, 0], ids[4, 1] = -1, 4
    x = _hidden(6, 64, seed=2)
    q, s, groups, pos, pw = M.route_quantize_fp8(x, ids, w, 4, "row")
    assert pos[1, 0] == -1 and pos[4, 1] == -1 and (pos.view(-1) >= 0).sum() == 10
    assert groups[-1] == 10 and sorted(pos[pos >= 0].tolist()) == list(range(10))
    y = torch.randn(12, 64).to(torch.bfloat16)
    out = M.sum_routed_pairs(y, pos)
    assert torch.isnan(out[[1, 4]]).all() and not torch.isnan(out[[0, 2, 3, 5]]).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_is_each_tokens_rows_in_fp32_rounded_once(dtype):
    t, k, rows_, h = 9, 3, 40, 48
    g = torch.Generator().manual_seed(3)
    y = torch.randn(rows_, h, generator=g).to(dtype)
    pos = torch.stack([torch.randperm(rows_, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    got = M.sum_routed_pairs(y, pos)
    want = torch.zeros(t, h, dtype=torch.float32)
    for tok in range(t):
        for j in range(k):  # slot order, fp32
            want[tok] = want[tok] + y[pos[tok, j]].float()
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    assert R.rel_error(got, y.double()[pos.long()].sum(1)) < (1e-2 if dtype != torch.float32 else 1e-6)
    # the masked layout's (E, C, H) output reads as its E * C rows
    assert torch.equal(M.sum_routed_pairs(y.view(4, 10, h), pos), got)


def test_the_layer_routes_by_kernel_within_the_kernels_limits():
    assert M.routes_by_kernel(1, 8, 128, 2048) and M.routes_by_kernel(16384, 8, 256, 7168)
    assert not M.routes_by_kernel(4, 8, M.MAX_EXPERTS + 1, 2048)
    assert not M.routes_by_kernel(4, M.MAX_TOP_K + 1, 64, 2048)
    assert not M.routes_by_kernel(4, 2, 8, 2056)  # not a multiple of 16
    assert not M.routes_by_kernel(0, 8, 8, 2048)


def test_one_kernel_routes_up_to_the_id_reads_then_the_blocked_form():
    assert M.routes_in_one_kernel(1, 8) and M.routes_in_one_kernel(512, 8)
    assert not M.routes_in_one_kernel(513, 8)  # past ROUTE_MAX_ID_READS
    assert M.routes_in_one_kernel(1024, 2) and not M.routes_in_one_kernel(1025, 2)  # top-2


def test_the_limits_are_the_kernels():
    from cutedsl_gemm.kernels.sm90 import moe_route as K

    assert (M.MAX_TOP_K, M.MAX_EXPERTS, M.MAX_HIDDEN) == (K.MAX_TOP_K, K.MAX_EXPERTS, K.MAX_HIDDEN)
    assert M.ROUTE_BLOCK_TOKENS == K.ROUTE_BLOCK_TOKENS


_X, _IDS, _W = torch.randn(4, 64).to(torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)


@pytest.mark.parametrize("args, kwargs, exc, text", [
    ((_X.int(), _IDS, _W, 4), {}, TypeError, "bfloat16, float16 or float32"),
    ((_X[0], _IDS, _W, 4), {}, ValueError, "(tokens, hidden)"),
    ((_X, _IDS[:3], _W, 4), {}, ValueError, "(tokens, k) = (4, k)"),
    ((_X, _IDS.float(), _W, 4), {}, TypeError, "int32 or int64"),
    ((_X, _IDS, _W[:, :1], 4), {}, ValueError, "(tokens, k) = (4, 2)"),
    ((_X, _IDS, _W.int(), 4), {}, TypeError, "topk_weights must be bfloat16"),
    ((_X, _IDS, _W, 0), {}, ValueError, "positive int"),
    ((_X, _IDS, _W, 4, "128x128"), {}, ValueError, "'row', '1x128' or 'tensor'"),
    ((_X, _IDS, _W, 4), {"capacity": 0}, ValueError, "capacity must be None"),
    ((_X, _IDS, _W, 4), {"fmt": "int8"}, ValueError, "'e4m3' or 'e5m2'"),
    ((_X, _IDS, _W, 4), {"backend": "kernel"}, ValueError, "needs a CUDA tensor"),
    ((_X, _IDS, _W, 4), {"backend": "gpu"}, ValueError, "backend must be"),
])
def test_route_errors_say_what_was_expected(args, kwargs, exc, text):
    with pytest.raises(exc, match=re.escape(text)):
        M.route_quantize_fp8(*args, **kwargs)


@pytest.mark.parametrize("args, kwargs, text", [
    ((torch.randn(4),  torch.zeros(2, 2, dtype=torch.int32)), {}, "(R, H) or (E, C, H)"),
    ((torch.randn(4, 8), torch.zeros(2, 2, dtype=torch.int64)), {}, "(tokens, k) int32"),
    ((torch.randn(4, 8), torch.zeros(2, 0, dtype=torch.int32)), {}, "at least one slot"),
    ((torch.randn(4, 8), torch.zeros(2, 2, dtype=torch.int32)), {"backend": "kernel"}, "needs a CUDA tensor"),
])
def test_sum_errors_say_what_was_expected(args, kwargs, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        M.sum_routed_pairs(*args, **kwargs)


@pytest.mark.parametrize("capacity", [None, 5])
@pytest.mark.parametrize("gran", GRANS)
def test_fakes_match_the_real_outputs(gran, capacity):
    ids, w = _routing(12, 4, 8, seed=4)
    x = _hidden(12, 384, seed=4)
    real = M.route_quantize_fp8(x, ids, w, 8, gran, capacity=capacity)
    y = real[0].float()
    with FakeTensorMode() as mode:
        fake = OPS.route_quantize_fp8(mode.from_tensor(x), mode.from_tensor(ids), mode.from_tensor(w), 8, gran,
                                      capacity=capacity)
        fake_sum = OPS.sum_routed_pairs(mode.from_tensor(y), mode.from_tensor(real[3]))
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    assert fake_sum.shape == (12, 384) and fake_sum.dtype == torch.float32
    assert M.sum_routed_pairs(y, real[3]).shape == fake_sum.shape


def test_opcheck_on_cpu():
    ids, w = _routing(10, 2, 6, seed=8)
    x = _hidden(10, 128, seed=8)
    torch.library.opcheck(OPS.route_quantize_fp8.default, (x, ids, w, 6, "1x128"))
    torch.library.opcheck(OPS.route_quantize_fp8.default, (x, ids.int(), w.bfloat16(), 6), {"capacity": 4})
    pos = M.route_quantize_fp8(x, ids, w, 6)[3]
    torch.library.opcheck(OPS.sum_routed_pairs.default, (torch.randn(20, 128).bfloat16(), pos))


# ------------------------------------------------------------------------------------------------------------------
# compile: the kernels' PTX
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blocked_ptx():
    import cutlass

    from cutedsl_gemm.kernels.sm90 import moe_route as K
    from cutedsl_gemm.runtime.compile import compile_entry

    out = {}
    entries = {"route": K.route_entry(cutlass.BFloat16, cutlass.Float8E4M3FN, 448.0, "row", hidden=2048, top_k=8,
                                      experts=128, masked=False, id_dtype=cutlass.Int64,
                                      weight_dtype=cutlass.BFloat16, blocked=True),
               "count": K.count_entry(8, 128, cutlass.Int64), "totals": K.totals_entry(128, False)}
    for name, entry in entries.items():
        with tempfile.TemporaryDirectory() as d:
            out[name] = compile_entry(*entry, "sm_90a", ptx_dump_dir=d).__ptx__
    return out


@pytest.mark.compile
def test_blocked_form_counts_by_block_and_reads_no_other_ids(blocked_ptx):
    route, count, totals = blocked_ptx["route"], blocked_ptx["count"], blocked_ptx["totals"]
    assert len(_lines(count, "match.any.sync.b32")) == 4 and len(_lines(count, "atom.shared.cta.add.u32")) == 4
    assert "match.any" not in route  # the blocked routing kernel does not count every id
    assert len(_lines(route, "shfl.sync.bfly")) >= 5 * 8  # a warp reduction per slot
    assert len(_lines(totals, "shfl.sync.up")) == 5 * 128 // 32  # the scan over the experts
    for t in blocked_ptx.values():
        assert ".local" not in t and "atom.global" not in t


@pytest.fixture(scope="module")
def route_ptx():
    import cutlass

    from cutedsl_gemm.kernels.sm90 import moe_route as K
    from cutedsl_gemm.runtime.compile import compile_entry

    out = {}
    for name, gran, h, masked in (("row", "row", 2048, False), ("group_masked", "1x128", 7168, True),
                                  ("tensor", "tensor", 4096, False)):
        with tempfile.TemporaryDirectory() as d:
            entry = K.route_entry(cutlass.BFloat16, cutlass.Float8E4M3FN, 448.0, gran, hidden=h, top_k=8, experts=256,
                                  masked=masked, id_dtype=cutlass.Int64, weight_dtype=cutlass.BFloat16)
            out[name] = compile_entry(*entry, "sm_90a", ptx_dump_dir=d).__ptx__
    with tempfile.TemporaryDirectory() as d:
        out["sum"] = compile_entry(*K.pair_sum_entry(cutlass.BFloat16, 8), "sm_90a", ptx_dump_dir=d).__ptx__
    return out


def _lines(text, needle):
    return [n for n, line in enumerate(text.splitlines()) if needle in line]


@pytest.mark.compile
def test_route_ptx_counts_in_shared_memory_after_issuing_the_row(route_ptx):
    for name in ("row", "group_masked"):
        t = route_ptx[name]
        atoms = _lines(t, "atom.shared.cta.add.u32")
        assert len(atoms) == 2 * 4, name  # total and before, for each of the 4 ids a thread loads at once
        assert len(_lines(t, "match.any.sync.b32")) == 4, name  # one atomic per expert and warp
        row_loads = _lines(t, "ld.global.v4.b32")
        assert row_loads and max(row_loads) < min(atoms), name  # the row's loads are in flight while counting
        assert ".local" not in t and "atom.global" not in t and "red.global" not in t, name  # no spills, no globals
        assert len(_lines(t, "griddepcontrol.launch_dependents")) == 1, name  # the gate_up GEMM may launch early
        assert len(_lines(t, "cvt.rn.satfinite.e4m3x2.f32")) > 0, name
    # 8 rows of the token's k pairs: one 16-byte store of codes per vector and row
    assert len(_lines(route_ptx["row"], "st.global.v4.b32")) == 8
    assert len(_lines(route_ptx["row"], "shfl.sync.up")) == 5 * 256 // 32  # the scan over 256 experts
    assert len(_lines(route_ptx["group_masked"], "shfl.sync.up")) == 0  # masked: no scan


@pytest.mark.compile
def test_tensor_route_ptx_folds_the_amax_partials_and_stores_one_scale(route_ptx):
    t = route_ptx["tensor"]
    assert len(_lines(t, "match.any.sync.b32")) == 4 and ".local" not in t
    assert len(_lines(t, "max.f32")) >= 1 and len(_lines(t, "st.global.v4.b32")) == 8 * 2  # 2 vectors, 8 rows
    # one scale store (CTA 0, thread 0), against the row form's one per row it writes
    assert len(_lines(t, "st.global.f32")) + len(_lines(t, "st.global.b32")) <= len(
        _lines(route_ptx["row"], "st.global.f32")) + len(_lines(route_ptx["row"], "st.global.b32")) - 7


@pytest.mark.compile
def test_sum_ptx_issues_every_load_before_the_first_add(route_ptx):
    t = route_ptx["sum"]
    loads = _lines(t, "ld.global.v4.b32")
    adds = _lines(t, "add.f32") + _lines(t, "add.rn.f32")
    assert len(loads) == 8 and max(loads) < min(adds)
    assert len(_lines(t, "st.global.v4.b32")) == 1 and ".local" not in t


# ------------------------------------------------------------------------------------------------------------------
# GPU: the kernels against the reference
# ------------------------------------------------------------------------------------------------------------------


def _poisoned(outs):
    """The kernel's outputs refilled with NaN / -7 before a run, so that anything it fails to write shows."""
    q, s, groups, pos, pw = outs
    q.view(U8).fill_(0x7F)
    s.fill_(float("nan"))
    groups.fill_(-7)
    pos.fill_(-7)
    pw.fill_(float("nan"))


def _assert_same_routing(got, want, capacity):
    q, s, groups, pos, pw = got
    wq, ws, wgroups, wpos, wpw = want
    assert torch.equal(groups, wgroups) and torch.equal(pos, wpos)
    taken = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
    taken[pos[pos >= 0].long()] = True  # the rows the kernel must write (the others: not read by the GEMM)
    assert torch.equal(q.view(U8)[taken], wq.view(U8)[taken]), "codes differ"
    if s.shape == (1,):  # per tensor: the one scale
        assert torch.equal(s, ws), "the scale differs"
    else:
        assert torch.equal(s[taken], ws[taken]), "scales differ"
    assert torch.equal(pw[taken], wpw[taken]), "pair weights differ"


def _run_poisoned(x, ids, w, e, gran, capacity):
    """The kernel's outputs after one run on outputs poisoned by a run before (same shapes)."""
    first = M.route_quantize_fp8(x, ids, w, e, gran, capacity=capacity)
    _poisoned(first)
    del first  # the caching allocator hands the poisoned blocks to the next call
    return M.route_quantize_fp8(x, ids, w, e, gran, capacity=capacity)


FORMS = ["one kernel", "blocked"]


def _form(form, monkeypatch):
    """Route in one kernel at any size, or always in the blocked form (count, totals, routing kernel)."""
    monkeypatch.setattr(M, "ROUTE_MAX_ID_READS", 1 << 62 if form == "one kernel" else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("capacity", [None, "tokens", 2])
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("t, k, e, h", SHAPES + [(512, 8, 256, 7168), (300, 1, 4, 16), (1000, 2, 8, 4096)])
def test_route_kernel_matches_the_reference(t, k, e, h, gran, capacity, form, monkeypatch):
    _form(form, monkeypatch)
    cap = min(t, 128) if capacity == "tokens" else capacity  # (past 128 tokens: some pairs dropped)
    ids, w = _routing(t, k, e, seed=3 * t + k, device="cuda", skew=cap == 2 and k < e)
    x = _hidden(t, h, seed=t + h, device="cuda")
    got = _run_poisoned(x, ids, w, e, gran, cap)
    torch.cuda.synchronize()
    _assert_same_routing(got, M.route_quantize_fp8(x, ids, w, e, gran, capacity=cap, backend="reference"), cap)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_route_kernel_takes_every_dtype(id_dtype, wdtype, xdtype, form, monkeypatch):
    _form(form, monkeypatch)
    ids, w = _routing(150, 4, 32, seed=9, device="cuda", dtype=id_dtype, wdtype=wdtype)
    x = _hidden(150, 512, seed=9, device="cuda", dtype=xdtype)
    got = _run_poisoned(x, ids, w, 32, "1x128", None)
    _assert_same_routing(got, M.route_quantize_fp8(x, ids, w, 32, "1x128", backend="reference"), None)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_route_kernel_special_values_and_bad_ids(form, monkeypatch):
    _form(form, monkeypatch)
    ids, w = _routing(8, 2, 8, seed=2, device="cuda")
    ids[3, 1], ids[6, 0] = -1, 8  # outside the experts: no row
    x = _hidden(8, 256, seed=2, device="cuda")
    x[0, 3], x[1, 5], x[2, 7] = float("inf"), float("-inf"), float("nan")
    x[5] = 0  # scale 1
    got = _run_poisoned(x, ids, w, 8, "row", None)
    want = M.route_quantize_fp8(x, ids, w, 8, "row", backend="reference")
    assert torch.equal(got[3], want[3]) and (got[3] == -1).sum() == 2 and torch.equal(got[2], want[2])
    taken = got[3][got[3] >= 0].long()
    assert torch.equal(torch.isnan(got[0].float())[taken], torch.isnan(want[0].float())[taken])
    assert torch.equal(got[1][taken], want[1][taken])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t, k, rows, h", [(1, 8, 8, 2048), (64, 8, 512, 7168), (33, 2, 300, 4104)])
def test_sum_kernel_matches_the_reference(t, k, rows, h, dtype):
    g = torch.Generator().manual_seed(t)
    y = torch.randn(rows, h, generator=g).to(dtype).cuda()
    pos = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(t)]).to(torch.int32).cuda()
    pos[t // 2, k - 1] = -1  # a dropped pair: NaN
    first = M.sum_routed_pairs(y, pos)
    first.fill_(float("nan"))
    del first
    got = M.sum_routed_pairs(y, pos)
    want = M.sum_routed_pairs(y, pos, backend="reference")
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[t // 2]).all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("capacity", [None, 64])
def test_graph_replay_follows_new_routings(capacity, form, monkeypatch):
    _form(form, monkeypatch)
    t, k, e, h = 200, 8, 128, 2048
    ids, w = _routing(t, k, e, seed=1, device="cuda")
    x = _hidden(t, h, seed=1, device="cuda")
    M.route_quantize_fp8(x, ids, w, e, "row", capacity=capacity)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = M.route_quantize_fp8(x, ids, w, e, "row", capacity=capacity)
        total = M.sum_routed_pairs(outs[0].view(-1, h)[:, :h].float(), outs[3])
    for seed in (2, 3):
        nids, nw = _routing(t, k, e, seed=seed, device="cuda", skew=seed == 3)
        ids.copy_(nids)
        w.copy_(nw)
        x.copy_(_hidden(t, h, seed=seed, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = M.route_quantize_fp8(x, ids, w, e, "row", capacity=capacity, backend="reference")
        _assert_same_routing(outs, want, capacity)
        want_total = M.sum_routed_pairs(want[0].float(), want[3], backend="reference")
        # (a token with a pair over capacity sums to NaN in both: compared as equal)
        torch.testing.assert_close(total, want_total, rtol=0, atol=0, equal_nan=True)
