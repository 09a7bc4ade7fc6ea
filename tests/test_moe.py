"""cutedsl_gemm.nn.moe on CPU: the routing glue (permute, combine, to_masked, combine_masked) against plain Python
loops and free of host synchronisation; reference_grouped_mm against a per-expert loop of reference_gemm; convert
of tiny Mixtral / Qwen3-MoE / DeepSeek-V3 models (every experts module converted, every parameter accounted for),
their saved format through safetensors; QuantizedExperts' forward with the grouped op replaced by the float64
reference against transformers' bf16 experts and an element-by-element emulation of its numerics."""

import copy
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn import moe
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import RECIPES, ScaleGranularity
from cutedsl_gemm.ops.gated import silu_mul_quantize_fp8
from cutedsl_gemm.ops.moe_route import route_quantize_fp8, sum_routed_pairs
from cutedsl_gemm.ops.quantize import quantize_fp8

transformers = pytest.importorskip("transformers")

G = ScaleGranularity
FP8_RECIPES = ["row", "deepseek", "tensor"]  # reference_grouped_mm's
EXPERT_RECIPES = ["row", "tensor", "deepseek"]  # the grouped FP8 GEMM's: QuantizedExperts'
SCALES_WHY = "the grouped FP8 GEMM takes per-tensor, row-wise and DeepSeek-V3 block scales"
SCALING = {"row": RECIPES["row"], "deepseek": RECIPES["1x128_128x128"], "tensor": RECIPES["tensor"]}
ACT = {"row": G.ROW, "deepseek": G.GROUP_1x128, "tensor": G.TENSOR}
MODELS = ["mixtral", "qwen3_moe", "deepseek_v3"]


@pytest.fixture(autouse=True)
def _as_without_a_gpu(monkeypatch):
    """Conversions are checked as on a machine without a GPU, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ------------------------------------------------------------------------------------------------
# routing glue
# ------------------------------------------------------------------------------------------------


def _routing(t, k, e, seed, experts=None):
    """(topk_ids (t, k) int64, topk_weights (t, k) fp32): k distinct experts per token out of ``experts``
    (default all e), weights summing to 1."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def _pairs_by_expert(ids, e):
    """For each expert, its (token, k) pair indices p = t * k + j in increasing order (a Python loop)."""
    flat = ids.reshape(-1).tolist()
    return [[p for p, x in enumerate(flat) if x == ex] for ex in range(e)]


ROUTINGS = [  # (tokens, top-k, experts, the experts the router may pick)
    (64, 8, 256, None),  # top-8 of 256: most experts get no token
    (37, 1, 256, None),  # top-1
    (20, 1, 8, [3, 5]),  # six experts of eight empty, the first ones included
    (9, 2, 4, None),
]


@pytest.mark.parametrize("t, k, e, pool", ROUTINGS)
def test_permute_groups_the_pairs_by_expert_in_token_order(t, k, e, pool):
    ids, _ = _routing(t, k, e, seed=t, experts=pool)
    hidden = torch.randn(t, 48).to(torch.bfloat16)
    permuted, offs, order = moe.permute(hidden, ids, e)
    groups = _pairs_by_expert(ids, e)
    want_order = [p for g in groups for p in g]
    ends, total = [], 0
    for g in groups:
        total += len(g)
        ends.append(total)
    assert order.dtype == torch.int64 and order.tolist() == want_order
    assert offs.dtype == torch.int32 and offs.tolist() == ends
    assert permuted.shape == (t * k, 48)
    for r, p in enumerate(want_order):
        assert torch.equal(permuted[r], hidden[p // k])


@pytest.mark.parametrize("t, k, e, pool", ROUTINGS)
@pytest.mark.parametrize("products", ["at once", "slot by slot"])
def test_combine_is_the_weighted_sum_in_slot_order(t, k, e, pool, products, monkeypatch):
    if products == "slot by slot":
        monkeypatch.setattr(moe, "ONE_SHOT_PRODUCT_BYTES", 0)
    ids, w = _routing(t, k, e, seed=100 + t, experts=pool)
    _, _, order = moe.permute(torch.zeros(t, 8), ids, e)
    out = torch.randn(t * k, 40).to(torch.bfloat16)
    got = moe.combine(out, order, w, t)
    row_of = {p: r for r, p in enumerate(order.tolist())}
    want = torch.empty(t, 40)
    for tok in range(t):
        acc = torch.zeros(40)
        for j in range(k):  # fp32, slot 0 first
            acc = acc + out[row_of[tok * k + j]].float() * w[tok, j]
        want[tok] = acc
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    assert torch.equal(moe.combine(out, order, w, t, out_dtype=torch.float32), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_activation_is_silu_times_up_in_fp32_rounded_once(dtype):
    h = (torch.randn(37, 2 * 96) * 4).to(dtype)
    got = R.silu_mul(h)
    want = (F.silu(h[:, :96].float()) * h[:, 96:].float()).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    w = torch.rand(37)
    got = R.silu_mul(h, w)
    want = (F.silu(h[:, :96].float()) * w[:, None] * h[:, 96:].float()).to(dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize("t, k, e, pool", ROUTINGS)
@pytest.mark.parametrize("width", [40, 38, 37])  # rows of 80, 76 and 74 bytes: moved as 8-, 4- and 2-byte words
def test_pair_rows_invert_the_permutation_and_the_rows_add_up(t, k, e, pool, width):
    ids, w = _routing(t, k, e, seed=200 + t, experts=pool)
    _, _, order = moe.permute(torch.zeros(t, 8), ids, e)
    row_of = {p: r for r, p in enumerate(order.tolist())}
    pw = moe.pair_weights(w, order)
    assert pw.dtype == torch.float32 and pw.tolist() == [w.view(-1)[p].item() for p in order.tolist()]
    rows = moe.pair_rows(order, t, k)
    assert rows.dtype == torch.int32 and rows.view(-1).tolist() == [row_of[p] for p in range(t * k)]
    out = torch.randn(t * k, width).to(torch.bfloat16)
    token_major = moe._token_major(out, order)  # (combine's scatter)
    assert torch.equal(token_major, out[[row_of[p] for p in range(t * k)]])
    shifted = torch.cat([torch.zeros(1).to(torch.bfloat16), out.reshape(-1)])[1:].view(t * k, width)
    assert shifted.storage_offset() == 1  # (2 bytes in: moved as 2-byte words)
    assert torch.equal(moe._token_major(shifted, order), token_major)
    got = sum_routed_pairs(out, rows)
    want = token_major.view(t, k, width).double().sum(1)
    assert got.dtype == torch.bfloat16 and got.shape == (t, width)
    # fp32 accumulation of k bf16 rows, rounded once: within half a bf16 ulp of the exact sum, plus fp32's k ulps
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8 + k * 2 ** -23, atol=1e-30)


def test_pair_rows_refuse_a_mismatched_layout():
    with pytest.raises(ValueError, match=r"T\*k = 4 \* 2"):
        moe.pair_rows(torch.arange(6), 4, 2)


def test_permute_then_combine_gives_the_tokens_back():
    ids, w = _routing(50, 4, 16, seed=3)
    hidden = torch.randn(50, 64)
    permuted, _, order = moe.permute(hidden, ids, 16)
    torch.testing.assert_close(moe.combine(permuted, order, w, 50), hidden, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t, k, e, pool", ROUTINGS)
@pytest.mark.parametrize("capacity", ["tokens", 2])
def test_to_masked_and_combine_masked_against_a_loop(t, k, e, pool, capacity):
    c = t if capacity == "tokens" else capacity
    ids, w = _routing(t, k, e, seed=200 + t, experts=pool)
    hidden = torch.randn(t, 32).to(torch.bfloat16)
    masked, counts, slot, overflow = moe.to_masked(hidden, ids, e, c)
    groups = _pairs_by_expert(ids, e)
    want = torch.zeros(e, c, 32, dtype=torch.bfloat16)
    want_slot = [-1] * (t * k)
    for ex, g in enumerate(groups):
        for rank, p in enumerate(g[:c]):
            want[ex, rank] = hidden[p // k]
            want_slot[p] = ex * c + rank
    assert torch.equal(masked, want)
    assert counts.dtype == torch.int32 and counts.tolist() == [min(len(g), c) for g in groups]
    assert slot.tolist() == want_slot
    assert overflow.dtype == torch.bool and overflow.dim() == 0
    assert bool(overflow) == any(len(g) > c for g in groups)
    if capacity == "tokens":  # k distinct experts per token: T rows per expert always suffice
        assert not overflow

    out = torch.randn(e, c, 24).to(torch.bfloat16)
    got = moe.combine_masked(out, slot, w, t)
    flat = out.reshape(e * c, 24)
    for tok in range(t):
        slots = want_slot[tok * k:(tok + 1) * k]
        if -1 in slots:  # a pair dropped by overflow: the token's output says so
            assert torch.isnan(got[tok]).all()
            continue
        acc = torch.zeros(24)
        for j, s in enumerate(slots):
            acc = acc + flat[s].float() * w[tok, j]
        assert torch.equal(got[tok], acc.to(torch.bfloat16))


@pytest.mark.parametrize("t, k, e, pool", ROUTINGS)
@pytest.mark.parametrize("capacity", ["tokens", 2])
def test_masked_pair_weights_and_sums_against_a_loop(t, k, e, pool, capacity):
    c = t if capacity == "tokens" else capacity
    ids, w = _routing(t, k, e, seed=300 + t, experts=pool)
    _, counts, slot, _ = moe.to_masked(torch.zeros(t, 8), ids, e, c)
    mw = moe.masked_pair_weights(w, slot, e, c)
    want_w = torch.zeros(e * c)
    for p, s in enumerate(slot.tolist()):
        if s >= 0:
            want_w[s] = w.view(-1)[p]
    assert mw.shape == (e, c) and torch.equal(mw.view(-1), want_w)
    out = torch.randn(e, c, 24).to(torch.bfloat16)
    got = sum_routed_pairs(out, slot.view(t, k).to(torch.int32))
    flat = out.reshape(e * c, 24)
    for tok in range(t):
        slots = slot[tok * k:(tok + 1) * k].tolist()
        if -1 in slots:  # a pair dropped by overflow: the token's output says so
            assert torch.isnan(got[tok]).all()
            continue
        want = sum(flat[s].double() for s in slots)
        torch.testing.assert_close(got[tok].double(), want, rtol=2 ** -8 + k * 2 ** -23, atol=1e-30)


def test_the_masked_layout_overflows_visibly():
    ids = torch.tensor([[0], [0], [0], [1]])
    hidden = torch.arange(4 * 16, dtype=torch.float32).view(4, 16)
    masked, counts, slot, overflow = moe.to_masked(hidden, ids, 2, 2)
    assert bool(overflow) and counts.tolist() == [2, 1] and slot.tolist() == [0, 1, -1, 2]
    y = moe.combine_masked(masked, slot, torch.ones(4, 1), 4)
    assert torch.isnan(y[2]).all() and torch.equal(y[[0, 1, 3]], hidden[[0, 1, 3]])


def test_routing_argument_errors():
    h = torch.zeros(4, 16)
    with pytest.raises(ValueError, match=r"topk_ids must be \(tokens, k\) = \(4, k\)"):
        moe.permute(h, torch.zeros(3, 2, dtype=torch.int64), 8)
    with pytest.raises(TypeError, match="int32 or int64 expert ids"):
        moe.permute(h, torch.zeros(4, 2), 8)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        moe.to_masked(h, torch.zeros(4, 2, dtype=torch.int64), 8, 0)
    with pytest.raises(ValueError, match="topk_weights must be"):
        moe.combine(torch.zeros(8, 16), torch.arange(8), torch.ones(3, 2), 4)


class _NoHostSync(TorchDispatchMode):
    """Fails on the aten ops that read device values on the host (``.item()``, ``.tolist()``, ``nonzero``,
    boolean-mask indexing, output sizes from values): on CUDA each synchronises and none can be graph-captured."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "bincount", "unique",
                 "_unique", "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        # a boolean index: the CPU kernel finds its nonzeros inside, a CUDA one synchronises for them
        masks = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name in self.FORBIDDEN or masks:
            raise AssertionError(f"{func} reads device values on the host")
        return func(*args, **(kwargs or {}))


HOST_READS = [lambda x: x.sum().item(), lambda x: x[x > 2], lambda x: x.nonzero(), lambda x: torch.bincount(x),
              lambda x: bool(x.any())]


@pytest.mark.parametrize("read", HOST_READS)
def test_the_no_sync_check_catches_host_reads(read):
    with pytest.raises(AssertionError, match="reads device values on the host"), _NoHostSync():
        read(torch.arange(6))


@pytest.mark.parametrize("read", [*HOST_READS, lambda x: x.tolist()])
def test_meta_tensors_catch_host_reads(read):
    """``.tolist()`` reads CPU memory outside the dispatcher: the glue also runs on meta tensors, which have no
    values to read (nor to size an output by)."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        read(torch.arange(6, device="meta"))


def _glue(hidden, ids, w, e, capacity):
    t = hidden.shape[0]
    permuted, offs, order = moe.permute(hidden, ids, e)
    y = moe.combine(permuted, order, w, t)
    masked, counts, slot, overflow = moe.to_masked(hidden, ids, e, capacity)
    ym = moe.combine_masked(masked, slot, w, t)
    rows = moe.pair_rows(order, t, ids.shape[1])
    return permuted, offs, order, y, masked, counts, slot, overflow, ym, rows


@pytest.mark.parametrize("t, k, e, pool", ROUTINGS)
def test_routing_glue_reads_nothing_on_the_host(t, k, e, pool):
    ids, w = _routing(t, k, e, seed=t, experts=pool)
    hidden = torch.randn(t, 64).to(torch.bfloat16)
    c = max(1, t // 4)
    with _NoHostSync():
        _glue(hidden, ids, w, e, c)
    meta = _glue(hidden.to("meta"), ids.to("meta"), w.to("meta"), e, c)  # shapes from shapes alone
    shapes = [(t * k, 64), (e,), (t * k,), (t, 64), (e, c, 64), (e,), (t * k,), (), (t, 64), (t, k)]
    assert [tuple(m.shape) for m in meta] == shapes


# ------------------------------------------------------------------------------------------------
# reference_grouped_mm
# ------------------------------------------------------------------------------------------------


def _experts_weights(e, n, k, recipe, seed=0):
    """Quantized (E, N, K) expert weights: per expert (codes, plain scales), and (b, scale_b) in the op's layout."""
    g = torch.Generator().manual_seed(seed)
    rec = SCALING[recipe]
    plain = [R.quantize(torch.randn(n, k, generator=g) * 0.05, rec.b) for _ in range(e)]
    b = torch.stack([q for q, _ in plain]).transpose(1, 2)  # (E, K, N): the transpose view of row-major weights
    sb = torch.stack([s.reshape(()) if recipe == "tensor" else s.t() for _, s in plain])
    return plain, b, sb.contiguous()


def _activations(x, recipe):
    """(codes, plain scales) of rows x (rows, K) and the scale_a the op takes."""
    q, s = R.quantize(x, ACT[recipe])
    op_q, op_s = quantize_fp8(x, ACT[recipe].label, backend="reference")
    assert torch.equal(op_q.view(torch.uint8), q.view(torch.uint8))
    return q, s, (op_s.reshape(1) if recipe == "tensor" else op_s)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_reference_grouped_mm_contiguous_is_a_loop_of_reference_gemm(recipe):
    e, k, n = 4, 256, 384
    plain, b, sb = _experts_weights(e, n, k, recipe)
    sizes = [5, 0, 17, 3]  # an empty group; the last 5 rows belong to none
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(30, k)
    qa, sa, op_sa = _activations(x, recipe)
    out = R.reference_grouped_mm(qa, b, op_sa, sb, ends, recipe=recipe, out_dtype=torch.float64)
    assert out.shape == (30, n) and out.dtype == torch.float64
    start = 0
    for i, end in enumerate(ends.tolist()):
        if end == start:  # (reference_gemm takes no empty operand)
            continue
        rows_s = sa if recipe == "tensor" else sa[start:end]
        want = R.reference_gemm(qa[start:end], rows_s, *plain[i], SCALING[recipe])
        torch.testing.assert_close(out[start:end], want, rtol=1e-12, atol=0)
        start = end
    assert torch.isnan(out[25:]).all() and not torch.isnan(out[:25]).any()
    bf16 = R.reference_grouped_mm(qa, b, op_sa, sb, ends, recipe=recipe)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16[:25], out[:25].to(torch.bfloat16))


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_reference_grouped_mm_masked_is_a_loop_of_reference_gemm(recipe):
    e, c, k, n = 4, 6, 256, 256
    plain, b, sb = _experts_weights(e, n, k, recipe, seed=1)
    counts = torch.tensor([6, 0, 3, 1], dtype=torch.int32)
    x = torch.randn(e * c, k)
    qa, sa, op_sa = _activations(x, recipe)
    qa3 = qa.view(e, c, k)
    sa3 = op_sa if recipe == "tensor" else op_sa.view(e, c, -1)
    out = R.reference_grouped_mm(qa3, b, sa3, sb, counts=counts, recipe=recipe, out_dtype=torch.float64)
    assert out.shape == (e, c, n)
    for i, r in enumerate(counts.tolist()):
        assert torch.isnan(out[i, r:]).all()
        if r == 0:
            continue
        rows_s = sa if recipe == "tensor" else sa.view(e, c, -1)[i, :r]
        want = R.reference_gemm(qa3[i, :r], rows_s, *plain[i], SCALING[recipe])
        torch.testing.assert_close(out[i, :r], want, rtol=1e-12, atol=0)


def test_reference_grouped_mm_refuses_what_the_op_refuses():
    plain, b, sb = _experts_weights(2, 128, 128, "row")
    qa, _, sa = _activations(torch.randn(8, 128), "row")
    offs = torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="exactly one of them"):
        R.reference_grouped_mm(qa, b, sa, sb, offs, counts=offs, recipe="row")
    with pytest.raises(ValueError, match=r"scale_b must be float32 of shape \(2, 1, 128\)"):
        R.reference_grouped_mm(qa, b, sa, sb[:, :, :64], offs, recipe="row")
    with pytest.raises(ValueError, match="nondecreasing end rows"):
        R.reference_grouped_mm(qa, b, sa, sb, torch.tensor([5, 3], dtype=torch.int32), recipe="row")
    with pytest.raises(ValueError, match="grouped GEMM's recipes"):
        R.reference_grouped_mm(qa, b, sa, sb, offs, recipe="mx")
    with pytest.raises(ValueError, match=r"counts must hold 2 values in \[0, 4\]"):
        R.reference_grouped_mm(qa.view(2, 4, 128), b, sa.view(2, 4, 1), sb,
                               counts=torch.tensor([5, 0], dtype=torch.int32), recipe="row")


# ------------------------------------------------------------------------------------------------
# convert
# ------------------------------------------------------------------------------------------------


def _config(kind, **over):
    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if kind == "mixtral":
        c = transformers.MixtralConfig(**common, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2)
    elif kind == "qwen3_moe":
        c = transformers.Qwen3MoeConfig(**common, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                                        num_experts_per_tok=2, head_dim=64)
    else:
        c = transformers.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=512,
                                          moe_intermediate_size=128, first_k_dense_replace=1, n_routed_experts=8,
                                          num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=128,
                                          kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                                          n_group=1, topk_group=1)
    for key, v in over.items():
        setattr(c, key, v)
    return c


def _model(kind, seed=0, **over):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_config(kind, **over), dtype=torch.bfloat16).eval()


def _experts_names(model):
    return [n for n, m in model.named_modules() if n.endswith(".experts") and hasattr(m, "gate_up_proj")]


def _convert_quietly(model, recipe, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = cnn.convert(model, recipe, experts=True, **kw)
    moe_warnings = [str(w.message) for w in caught if "mixture-of-experts" in str(w.message)]
    return report, moe_warnings


def _accounted(before: dict, report):
    """Every parameter of the unconverted model (name -> elements) is under a converted module or in ``kept``
    (not both), and the element counts add up."""
    converted = {n for n in before if any(n.startswith(m + ".") for m in report.converted)}
    kept = set(report.kept)
    assert kept <= set(before) and not kept & converted and kept | converted == set(before)
    assert report.kept_elements == sum(before[n] for n in kept)
    assert report.total_elements == sum(before.values())
    assert sum(before[n] for n in converted) + report.kept_elements == report.total_elements
    assert all(isinstance(why, str) and why and "\n" not in why for why in report.kept.values())


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("recipe", EXPERT_RECIPES)
def test_convert_quantizes_every_experts_module(kind, recipe):
    model = _model(kind)
    before = {n: p.numel() for n, p in model.named_parameters()}
    names = _experts_names(model)
    originals = {n: copy.deepcopy(model.get_submodule(n)) for n in names}
    assert names
    report, moe_warnings = _convert_quietly(model, recipe)
    assert not moe_warnings  # no mixture-of-experts weight left in bf16
    assert report.converted_experts == names
    for n in names:
        layer = model.get_submodule(n)
        assert type(layer) is cnn.QuantizedExperts and layer.recipe == recipe
        assert layer.gate_up_proj.dtype == torch.float8_e4m3fn and not list(layer.parameters())
        ref = originals[n]
        assert layer.num_experts == ref.gate_up_proj.shape[0] and layer.hidden_dim == ref.gate_up_proj.shape[2]
        gate_up, down = layer.dequantize()  # per expert within FP8's rounding of the original
        assert R.rel_error(gate_up, ref.gate_up_proj.detach().float()) < 0.05
        assert R.rel_error(down, ref.down_proj.detach().float()) < 0.05
    assert not any(".experts." in n for n in report.kept)
    _accounted(before, report)
    routers = [n for n in report.kept if n.endswith("mlp.gate.weight")]
    assert routers and all("router weight of" in report.kept[n] for n in routers)
    assert "embedding table" in report.kept["model.embed_tokens.weight"]
    assert "1-D parameter" in report.kept["model.norm.weight"]
    if kind == "deepseek_v3":  # the shared experts are nn.Linear layers, converted as such
        assert "model.layers.1.mlp.shared_experts.gate_proj" in report.converted
        assert isinstance(model.model.layers[1].mlp.shared_experts.down_proj, cnn.QuantizedLinear)
    assert f"and {len(names)} experts modules converted" in str(report)


@pytest.mark.parametrize("recipe", ["int4_weight", "int8", "mxfp8"])
def test_a_recipe_without_grouped_kernels_keeps_the_experts_with_the_reason(recipe):
    model = _model("mixtral")
    before = {n: p.numel() for n, p in model.named_parameters()}
    report, moe_warnings = _convert_quietly(model, recipe)
    assert moe_warnings and "left mixture-of-experts weights in high precision" in moe_warnings[0]
    assert "recipe 'row' or 'tensor' or 'deepseek'" in moe_warnings[0]
    for n in _experts_names(model):
        assert type(model.get_submodule(n)) is not cnn.QuantizedExperts
        assert f"recipe {recipe!r} has no grouped GEMM" in report.skipped[n]
        assert SCALES_WHY in report.skipped[n] and "\n" not in report.skipped[n]
        assert "of a skipped experts module (MixtralExperts)" in report.kept[f"{n}.gate_up_proj"]
    assert not report.converted_experts
    _accounted(before, report)


@pytest.mark.parametrize("over, recipe, why", [
    (dict(moe_intermediate_size=200), "tensor", "intermediate=200: the grouped GEMM of recipe 'tensor' takes "
                                                "sizes that are multiples of 16"),
    (dict(moe_intermediate_size=200), "row", "intermediate=200"),
    (dict(hidden_size=264, head_dim=66), "row", "hidden=264: the grouped GEMM of recipe 'row' takes sizes that are "
                                                "multiples of 16"),
    ({}, "int8", f"recipe 'int8' has no grouped GEMM for mixture-of-experts weights: {SCALES_WHY}"),
    (dict(moe_intermediate_size=200), "deepseek", "intermediate=200: the grouped GEMM of recipe 'deepseek' takes "
                                                  "sizes that are multiples of 16"),
    (dict(hidden_act="gelu"), "row", "activation is not SiLU"),
])
def test_experts_the_grouped_gemm_cannot_run_are_kept_with_the_reason(over, recipe, why):
    model = _model("qwen3_moe", **over)
    before = {n: p.numel() for n, p in model.named_parameters()}
    report, moe_warnings = _convert_quietly(model, recipe)
    assert moe_warnings
    names = _experts_names(model)
    assert names and all(why in report.skipped[n] for n in names)
    assert all(type(model.get_submodule(n)) is not cnn.QuantizedExperts for n in names)
    _accounted(before, report)
    with pytest.raises(ValueError, match="cannot run recipe"):
        cnn.QuantizedExperts.from_experts(model.get_submodule(names[0]), recipe)


@pytest.mark.parametrize("recipe", EXPERT_RECIPES)
def test_sizes_past_the_deepseek_blocks_convert(recipe):
    """Experts sizes need only be multiples of 16 (intermediate 192: not whole 128-blocks)."""
    model = _model("qwen3_moe", moe_intermediate_size=192)
    report, moe_warnings = _convert_quietly(model, recipe)
    assert not moe_warnings and report.converted_experts == _experts_names(model)
    assert model.get_submodule(report.converted_experts[0]).intermediate_dim == 192


def test_convert_quantizes_the_experts_by_default():
    model = _model("mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = cnn.convert(model, "row")
    assert report.converted_experts == _experts_names(model)
    assert all(type(model.get_submodule(n)) is cnn.QuantizedExperts for n in report.converted_experts)


def test_with_experts_false_the_experts_stay_and_the_warning_says_how():
    model = _model("mixtral")
    with pytest.warns(UserWarning, match=r"left mixture-of-experts weights in high precision .*experts=True"):
        report = cnn.convert(model, "row", experts=False)
    assert not report.converted_experts and not any(n.endswith(".experts") for n in report.skipped)
    assert "not converted unless convert(..., experts=True)" in \
        report.kept["model.layers.0.mlp.experts.gate_up_proj"]


@pytest.mark.parametrize("recipe", EXPERT_RECIPES)
def test_transposed_experts_quantize_to_the_same_bits(recipe):
    """``is_transposed`` experts hold gate_up_proj (E, H, 2I) and down_proj (E, I, H): the same weights."""
    ref = _model("mixtral").model.layers[0].mlp.experts
    flipped = copy.deepcopy(ref)
    flipped.is_transposed = True
    with torch.no_grad():
        flipped.gate_up_proj = torch.nn.Parameter(ref.gate_up_proj.transpose(1, 2).contiguous())
        flipped.down_proj = torch.nn.Parameter(ref.down_proj.transpose(1, 2).contiguous())
    assert _same_bits(cnn.QuantizedExperts.from_experts(flipped, recipe).state_dict(),
                      cnn.QuantizedExperts.from_experts(ref, recipe).state_dict())


def test_a_filtered_experts_module_is_skipped():
    model = _model("mixtral")
    report, _ = _convert_quietly(model, "row", filter=lambda name, m: "layers.1." not in name)
    assert report.converted_experts == ["model.layers.0.mlp.experts"]
    assert report.skipped["model.layers.1.mlp.experts"] == "excluded by filter"


# ------------------------------------------------------------------------------------------------
# the saved format
# ------------------------------------------------------------------------------------------------


def _same_bits(a: dict, b: dict) -> bool:
    def bits(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t

    return a.keys() == b.keys() and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
                                        for x, y in zip(a.values(), b.values()))


@pytest.mark.parametrize("kind, recipe", [("mixtral", "row"), ("qwen3_moe", "tensor"), ("deepseek_v3", "row"),
                                          ("deepseek_v3", "tensor"), ("deepseek_v3", "deepseek"),
                                          ("qwen3_moe", "deepseek")])
def test_converted_moe_model_round_trips_through_safetensors(kind, recipe, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    model = _model(kind)
    _convert_quietly(model, recipe)
    state = model.state_dict()
    prefix = _experts_names(model)[0]
    assert bytes(state[f"{prefix}._extra_state"].tolist()).decode() == f"cutedsl_gemm/{cnn.FORMAT_VERSION}/{recipe}"
    assert state[f"{prefix}.gate_up_proj"].dtype == torch.float8_e4m3fn
    layer = model.get_submodule(prefix)
    e, h, i = layer.num_experts, layer.hidden_dim, layer.intermediate_dim
    blocks = (e, -(-h // 128), -(-2 * i // 128))  # per expert its 128x128 blocks, transposed like b
    assert tuple(state[f"{prefix}.gate_up_proj_scale"].shape) == \
        {"row": (e, 1, 2 * i), "tensor": (e,), "deepseek": blocks}[recipe]
    st.save_file(state, tmp_path / "model.safetensors")
    fresh = _model(kind, seed=1)
    _convert_quietly(fresh, recipe)
    assert not _same_bits(fresh.state_dict(), state)
    fresh.load_state_dict(st.load_file(tmp_path / "model.safetensors"))
    assert _same_bits(fresh.state_dict(), state)


@pytest.mark.parametrize("recipe", EXPERT_RECIPES)
def test_an_empty_experts_module_has_the_converted_layout(recipe):
    ref = _model("mixtral").model.layers[0].mlp.experts
    converted = cnn.QuantizedExperts.from_experts(ref, recipe)
    empty = cnn.QuantizedExperts(4, 256, 256, recipe)
    assert {k: (v.dtype, v.shape, v.stride()) for k, v in empty.state_dict().items()} == \
        {k: (v.dtype, v.shape, v.stride()) for k, v in converted.state_dict().items()}
    empty.load_state_dict(converted.state_dict())
    assert _same_bits(empty.state_dict(), converted.state_dict())
    assert f"recipe={recipe!r}" in repr(empty)


def test_loading_refuses_another_recipe_or_unconverted_weights():
    ref = _model("mixtral").model.layers[0].mlp.experts
    row = cnn.QuantizedExperts.from_experts(ref, "row")
    tensor = cnn.QuantizedExperts.from_experts(ref, "tensor")
    with pytest.raises(ValueError, match="holds recipe 'row' experts and this module runs recipe 'tensor'"):
        tensor.load_state_dict(row.state_dict())
    with pytest.raises(ValueError, match=r"gate_up_proj: expected torch.float8_e4m3fn \(recipe 'row'\), got "
                                         "torch.bfloat16"):
        row.load_state_dict(ref.state_dict(), strict=False)


@pytest.mark.parametrize("recipe", EXPERT_RECIPES)
def test_casting_keeps_the_quantized_dtypes(recipe):
    layer = cnn.QuantizedExperts.from_experts(_model("mixtral").model.layers[0].mlp.experts, recipe)
    dtypes = {k: v.dtype for k, v in layer.state_dict().items()}
    layer.half()
    layer.to(torch.bfloat16)
    assert {k: v.dtype for k, v in layer.state_dict().items()} == dtypes


# ------------------------------------------------------------------------------------------------
# forward, with the grouped op and the quantizers on their CPU references
# ------------------------------------------------------------------------------------------------


def _reference_op(recipe, calls):
    """The grouped op's float64 reference, checking the operands are in the op's conventions."""

    def grouped_scaled_mm(a, b, scale_a, scale_b, offs=None, *, counts=None, out_dtype=torch.bfloat16, out=None,
                          expected_rows=None):
        assert out is None and a.dtype == b.dtype == torch.float8_e4m3fn
        assert b.transpose(1, 2).is_contiguous()  # the transpose view of row-major (E, N, K) weights
        groups = counts if offs is None else offs
        assert groups.dtype == torch.int32 and groups.shape == (b.shape[0],)
        if offs is None:  # masked: the counts add up to at most the rows expected
            assert type(expected_rows) is int and int(counts.sum()) <= expected_rows <= a.shape[0] * a.shape[1]
        else:
            assert expected_rows is None
        calls.append("masked" if offs is None else "contiguous")
        return R.reference_grouped_mm(a, b, scale_a, scale_b, offs, counts=counts, recipe=recipe,
                                      out_dtype=out_dtype)

    return grouped_scaled_mm


@pytest.fixture
def reference_ops(monkeypatch):
    """``use(recipe)``: the grouped op and the quantizers replaced by their CPU references; returns the list of the
    grouped op's calls and the quantizer calls."""

    def use(recipe):
        grouped_calls, quantizer_calls = [], []
        module = types.ModuleType("cutedsl_gemm.ops.grouped")
        module.grouped_scaled_mm = _reference_op(recipe, grouped_calls)
        monkeypatch.setitem(sys.modules, "cutedsl_gemm.ops.grouped", module)
        monkeypatch.setattr(moe, "_check_device", lambda device: None)

        def quantize(x, granularity, **kw):
            quantizer_calls.append(granularity)
            return quantize_fp8(x, granularity, backend="reference", **kw)

        def quantize_gated(h, granularity, weights=None, **kw):
            quantizer_calls.append("silu_mul " + granularity)
            return silu_mul_quantize_fp8(h, granularity, weights, backend="reference", **kw)

        def route(hidden, ids, weights, e, granularity, **kw):
            quantizer_calls.append("route " + granularity)
            return route_quantize_fp8(hidden, ids, weights, e, granularity, backend="reference", **kw)

        monkeypatch.setattr(moe, "quantize_fp8", quantize)
        monkeypatch.setattr(moe, "silu_mul_quantize_fp8", quantize_gated)
        monkeypatch.setattr(moe, "route_quantize_fp8", route)
        return grouped_calls, quantizer_calls

    return use


def _emulated(layer, x, ids, w):
    """The module's numerics token by token: activations quantized like the recipe (per row, per 1x128 group or
    one scale over all pairs), float64 products of the dequantized weights, bf16 where the module rounds."""
    gate_up, down = (t.double() for t in layer.dequantize(torch.float64))
    gran = ACT[layer.recipe]
    t, k = ids.shape
    qx, sx = R.quantize(x, gran)
    xs = R.dequantize(qx, sx, gran)
    act = torch.empty(t * k, layer.intermediate_dim, dtype=torch.bfloat16)
    for p in range(t * k):  # the routing weight goes in before the (linear) down projection
        h = (gate_up[ids.view(-1)[p]] @ xs[p // k]).to(x.dtype)
        gate, up = h.float().chunk(2)
        act[p] = (F.silu(gate) * w.view(-1)[p].float() * up).to(x.dtype)
    qa, sa = R.quantize(act, gran)
    acts = R.dequantize(qa, sa, gran)
    out = torch.empty_like(x)
    for tok in range(t):
        acc = torch.zeros(x.shape[1])
        for j in range(k):
            acc = acc + (down[ids[tok, j]] @ acts[tok * k + j]).to(x.dtype).float()
        out[tok] = acc.to(x.dtype)
    return out


def _routed(kind, t=48, seed=0):
    model = _model(kind)
    name = _experts_names(model)[-1]
    experts = model.get_submodule(name)
    e = experts.gate_up_proj.shape[0]
    ids, w = _routing(t, model.config.num_experts_per_tok, e, seed=seed)
    x = torch.randn(t, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return model, name, experts, x, ids, w


def _route_by(routing, monkeypatch):
    """Make the experts route their pairs by ``routing``: "one kernel" (route_quantize_fp8, the default at these
    sizes) or "sort" (a sort, a gather and the quantizer: past the routing kernels' limits)."""
    if routing == "sort":
        monkeypatch.setattr(moe, "routes_by_kernel", lambda *args: False)


@pytest.mark.parametrize("routing", ["one kernel", "sort"])
@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("recipe", EXPERT_RECIPES)
def test_forward_matches_the_bf16_experts_and_its_emulation(kind, recipe, routing, reference_ops, monkeypatch):
    grouped_calls, quantizer_calls = reference_ops(recipe)
    _route_by(routing, monkeypatch)
    _, _, experts, x, ids, w = _routed(kind)
    with torch.no_grad():
        want = experts(x, ids, w)
        layer = cnn.QuantizedExperts.from_experts(experts, recipe)
        got = layer(x, ids, w)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert grouped_calls == ["contiguous"] * 2
    gran = moe.ACTIVATION_GRANULARITY[recipe]
    # the down GEMM's activations: SiLU, the weights and the quantizer in one kernel, but per tensor
    first = "route " + gran if routing == "one kernel" else gran
    # per tensor the SiLU runs in torch and its one scale needs the whole activation: the quantizer after it
    assert quantizer_calls == [first, gran if recipe == "tensor" else "silu_mul " + gran]
    # FP8 codes with 3 mantissa bits on both operands of two GEMMs: ~4% per GEMM on random weights
    assert R.rel_error(got, want) < 0.08
    # the glue itself (gate / up halves, per-expert weights, routing weights, combine): all but bf16 ties
    assert R.rel_error(got, _emulated(layer, x, ids, w)) < 1e-4
    with torch.no_grad():  # the masked layout computes the same rows
        layer.capacity = x.shape[0]
        masked = layer(x, ids, w)
    assert grouped_calls[2:] == ["masked"] * 2
    assert R.rel_error(masked, got) < 1e-4


def test_a_swapped_gate_and_up_would_show(reference_ops):
    reference_ops("row")
    _, _, experts, x, ids, w = _routed("mixtral")
    layer = cnn.QuantizedExperts.from_experts(experts, "row")
    i = layer.intermediate_dim
    with torch.no_grad():
        want = experts(x, ids, w)
        layer.gate_up_proj = torch.cat([layer.gate_up_proj[:, i:], layer.gate_up_proj[:, :i]], dim=1)
        layer.gate_up_proj_scale = torch.cat([layer.gate_up_proj_scale[..., i:], layer.gate_up_proj_scale[..., :i]],
                                             dim=-1)
        # near 0 SiLU(g) * u ~ g * u / 2 either way: the swap shows in the second-order term, well above FP8's 4-6%
        assert R.rel_error(layer(x, ids, w), want) > 0.2


@pytest.mark.parametrize("kind", MODELS)
def test_converted_moe_block_runs_in_transformers(kind, reference_ops):
    reference_ops("row")
    model, name, _, x, _, _ = _routed(kind)
    block = model.get_submodule(name.rpartition(".")[0])
    original = copy.deepcopy(block)
    report, _ = _convert_quietly(model, "row", filter=lambda n, m: n.endswith(".experts"))
    assert name in report.converted_experts and isinstance(block.experts, cnn.QuantizedExperts)
    h = x.view(1, *x.shape)
    with torch.no_grad():
        got, want = block(h), original(h)
    if isinstance(got, tuple):  # some blocks also return the router logits
        got, want = got[0], want[0]
    assert got.shape == want.shape and R.rel_error(got, want) < 0.08


def test_masked_forward_marks_the_tokens_past_the_capacity(reference_ops):
    reference_ops("row")
    _, _, experts, x, _, w = _routed("mixtral")
    ids = torch.zeros_like(w, dtype=torch.int64)
    ids[:, 1] = torch.arange(x.shape[0]) % 3 + 1  # expert 0 takes every token, the rest share
    layer = cnn.QuantizedExperts.from_experts(experts, "row", capacity=40)
    with torch.no_grad():
        y = layer(x, ids, w)
    assert torch.isnan(y[40:]).all() and not torch.isnan(y[:40]).any()


def test_forward_on_the_cpu_is_refused():
    layer = cnn.QuantizedExperts.from_experts(_model("mixtral").model.layers[0].mlp.experts, "row")
    ids, w = _routing(4, 2, 4, seed=0)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        layer(torch.randn(4, 256, dtype=torch.bfloat16), ids, w)


def test_empty_experts_module_arguments_are_checked():
    with pytest.raises(ValueError, match="QuantizedExperts runs recipes 'row', 'tensor', 'deepseek', not 'nvfp4'"):
        cnn.QuantizedExperts(4, 256, 256, "nvfp4")
    with pytest.raises(ValueError, match="multiples of 16"):
        cnn.QuantizedExperts(4, 256, 200, "row")
    cnn.QuantizedExperts(4, 256, 192, "tensor")  # no 128-block rule
    with pytest.raises(ValueError, match="capacity must be None or a positive int"):
        cnn.QuantizedExperts(4, 256, 256, "row", capacity=0)



def test_int8_experts_are_refused_with_the_reason():
    """The grouped GEMM is FP8 only: int8 experts are refused whichever way they are asked for, and a conversion
    to int8 keeps them (the dense layers still take the recipe)."""
    refused = f"QuantizedExperts runs recipes 'row', 'tensor', 'deepseek', not 'int8': {SCALES_WHY}"
    with pytest.raises(ValueError, match=refused):
        cnn.QuantizedExperts(4, 256, 256, "int8")
    model = _model("mixtral")
    experts = model.model.layers[0].mlp.experts
    assert moe.experts_unsupported(experts, "int8") == \
        f"recipe 'int8' has no grouped GEMM for mixture-of-experts weights: {SCALES_WHY} (QuantizedExperts runs " \
        "'row', 'tensor', 'deepseek')"
    with pytest.raises(ValueError, match=f"cannot run recipe 'int8': .*{SCALES_WHY}"):
        cnn.QuantizedExperts.from_experts(experts, "int8")
    before = {n: p.numel() for n, p in model.named_parameters()}
    report, moe_warnings = _convert_quietly(model, "int8")
    assert moe_warnings and not report.converted_experts
    assert all(SCALES_WHY in report.skipped[n] for n in _experts_names(model))
    assert isinstance(model.model.layers[0].self_attn.q_proj, cnn.QuantizedLinear)
    assert model.model.layers[0].self_attn.q_proj.recipe == "int8"
    _accounted(before, report)


def test_deepseek_experts_hold_block_scales():
    """DeepSeek-V3's recipe: per expert the 128x128 block scales of each weight, transposed (Kb, Nb) like b, and
    the dequantized weights within FP8's rounding of the original."""
    ref = _model("qwen3_moe", moe_intermediate_size=192).model.layers[0].mlp.experts
    layer = cnn.QuantizedExperts.from_experts(ref, "deepseek")
    e, h, i = layer.num_experts, layer.hidden_dim, layer.intermediate_dim
    assert tuple(layer.gate_up_proj_scale.shape) == (e, -(-h // 128), -(-2 * i // 128))
    assert tuple(layer.down_proj_scale.shape) == (e, -(-i // 128), -(-h // 128))
    w = ref.down_proj.detach()[1].float()  # expert 1's block (0, 0) scale: its amax over e4m3's largest value
    assert torch.allclose(layer.down_proj_scale[1, 0, 0], w[:128, :128].abs().max() / 448.0)
    gate_up, down = layer.dequantize()
    assert R.rel_error(gate_up, ref.gate_up_proj.detach().float()) < 0.05
    assert R.rel_error(down, ref.down_proj.detach().float()) < 0.05


@pytest.mark.parametrize("routing", ["one kernel", "sort"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_torch_compile_traces_the_experts_in_one_graph(layout, routing, monkeypatch):
    """torch.compile(fullgraph=True) traces a converted experts module with no graph break: routing glue as torch
    ops, the quantizer and the grouped GEMM as this library's operators (recorded, not run: the backend only keeps
    the graph)."""
    model = _model("mixtral")
    _convert_quietly(model, "row")
    experts = model.model.layers[0].mlp.experts
    if layout == "masked":
        experts.capacity = 16
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        outputs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        shapes = [(o.meta["example_value"].shape, o.meta["example_value"].dtype) for o in outputs]
        return lambda *args: [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]  # the kernels need a GPU

    _route_by(routing, monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, backend=keep_graph)
    ids, w = _routing(16, 2, experts.num_experts, seed=3)
    compiled(torch.randn(16, experts.hidden_dim, dtype=torch.bfloat16), ids, w)
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("cutedsl_gemm.grouped_scaled_mm" in t for t in targets) == 2, targets  # gate_up and down
    one = routing == "one kernel"
    assert sum("cutedsl_gemm.route_quantize_fp8" in t for t in targets) == one, targets  # the tokens, placed
    assert sum("cutedsl_gemm.quantize_fp8" in t for t in targets) == (not one), targets  # the tokens
    assert sum("cutedsl_gemm.silu_mul_quantize_fp8" in t for t in targets) == 1, targets  # the down GEMM's input
    assert sum("cutedsl_gemm.sum_routed_pairs" in t for t in targets) == 1, targets  # the combine (both routings)
    torch._dynamo.reset()
