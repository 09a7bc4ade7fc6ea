"""Mixture-of-experts layers on a Hopper GPU: tiny Mixtral and Qwen3-MoE models converted with their experts
("row" and "tensor") against the bf16 model and against the same model with only its dense layers quantized; one
``QuantizedExperts`` forward, both layouts, against the float64 reference of its dequantized weights and its
quantized activations (every grouped GEMM call checked, the activation codes bit for bit against the reference
quantizer), with routings that leave experts empty; the masked and contiguous layouts against each other; the MoE
block and the experts module replayed from a CUDA graph for two routings of the same shapes, bit-equal to eager;
bit-identical eager reruns."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn import moe
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import ScaleGranularity as G
from cutedsl_gemm.ops import moe_route

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

RECIPES = ["row", "tensor", "deepseek"]  # the grouped FP8 GEMM's: per-tensor, row-wise and DeepSeek-V3 blocks
GRANULARITY = {"row": G.ROW, "tensor": G.TENSOR, "deepseek": G.GROUP_1x128}  # the activations' scales of each
LAYOUTS = {"contiguous": None, "masked": "tokens"}  # QuantizedExperts.capacity: None, or T (no pair dropped)
# One grouped GEMM call against the float64 product of its own dequantized operands: the kernel accumulates in fp32
# (promoted) and rounds once to bf16, at most 2^-9 of each element (RNE, 8 significant bits), so the relative
# Frobenius error is at most 2^-9 = 1.95e-3 plus the fp32 accumulation's ~1e-6.
GEMM_TOL = 2e-3
# The experts' output against the float64 combine of the down GEMM's float64 reference: two bf16 roundings (the
# down GEMM's output, the combined output), each at most 2^-9 per element.
OUTPUT_TOL = 4e-3
# The FP8 experts against the float64 experts of their bf16 weights: e4m3 (3 mantissa bits) on both operands of
# two GEMMs, ~4% per GEMM on random weights (test_moe's CPU bound, the same numerics).
FP8_TOL = 0.08
# The masked layout against the contiguous one: the same activation codes and scales (per row; per tensor the zero
# rows past the counts do not move the amax), the same products; at most a one-ulp bf16 difference in an element.
LAYOUT_TOL = 1e-3


def _config(kind):
    common = dict(vocab_size=512, hidden_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if kind == "mixtral":  # 8 experts, top-2, intermediate 768
        return transformers.MixtralConfig(**common, intermediate_size=768, num_local_experts=8, num_experts_per_tok=2)
    # 16 experts, top-4, moe_intermediate 256 (every layer sparse: intermediate_size is no layer's)
    return transformers.Qwen3MoeConfig(**common, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
                                       num_experts_per_tok=4, head_dim=128)


MODELS = ["mixtral", "qwen3_moe"]


def _model(kind, seed=0):
    """A tiny random bf16 model on the GPU (built on the CPU from a fixed seed: the same weights every run)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.bfloat16)
    return model.eval().to("cuda")


def _experts_names(model):
    return [n for n, m in model.named_modules() if n.endswith(".experts") and hasattr(m, "gate_up_proj")]


def _convert(model, recipe, **kw):
    """convert, and the mixture-of-experts warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = cnn.convert(model, recipe, **kw)
    return report, [str(w.message) for w in caught if "mixture-of-experts" in str(w.message)]


def _routing(t, k, e, seed, empty=True):
    """(ids (t, k) int64, weights (t, k) fp32) on the GPU: k distinct experts per token, weights summing to 1. With
    ``empty``, experts 0, 5, 10, ... and the last one get no token and the first of the others takes every second
    token (a skewed load)."""
    g = torch.Generator().manual_seed(seed)
    pool = [x for x in range(e) if not (empty and (x % 5 == 0 or x == e - 1))]
    rows = []
    for tok in range(t):
        pick = [pool[i] for i in torch.randperm(len(pool), generator=g).tolist()]
        if empty and tok % 2 == 0:
            pick = [pool[0]] + [x for x in pick if x != pool[0]]
        rows.append(pick[:k])
    w = torch.rand(t, k, generator=g) + 0.1
    return torch.tensor(rows).cuda(), (w / w.sum(-1, keepdim=True)).cuda()


def _hidden(t, h, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()


def _experts(kind, recipe, capacity=None):
    """(bf16 experts module of layer 0, its QuantizedExperts, the model config)."""
    model = _model(kind)
    experts = model.model.layers[0].mlp.experts
    return experts, cnn.QuantizedExperts.from_experts(experts, recipe, capacity=capacity), model.config


#: How QuantizedExperts routes its pairs: by the routing kernels, one (the form at these sizes) or the blocked three
#: (prefill's), or by a sort, a gather and the quantizer (past the routing kernels' limits).
ROUTINGS = ["one kernel", "blocked", "sort"]


def _route_by(routing, monkeypatch):
    if routing == "sort":
        monkeypatch.setattr(moe, "routes_by_kernel", lambda *args: False)
    elif routing == "blocked":
        monkeypatch.setattr(moe_route, "ROUTE_MAX_ID_READS", 0)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16),
                                                                     b.contiguous().view(torch.int16))


# ------------------------------------------------------------------------------------------------
# (a) converted models against the bf16 model
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", MODELS)
def test_converted_model_logits(kind, recipe):
    """The experts' FP8 error adds to the dense layers': the logits of the model converted whole stay within twice
    those of the model with only its dense layers quantized (a float64 emulation of these models measured the ratio
    at 1.0 - 1.1: dense-only 0.14 / 0.08 (Mixtral / Qwen3-MoE), the attention GEMMs' ~4% compounding over two layers
    and the head; the experts alone 0.08 / 0.01)."""
    base = _model(kind)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        want = base(ids, use_cache=False).logits
    dense = copy.deepcopy(base)
    dense_report, dense_warnings = _convert(dense, recipe, experts=False)
    assert dense_warnings and not dense_report.converted_experts
    full = copy.deepcopy(base)
    report, full_warnings = _convert(full, recipe)
    assert not full_warnings  # no mixture-of-experts weight left in bf16
    names = _experts_names(base)
    assert report.converted_experts == names
    assert all(type(full.get_submodule(n)) is cnn.QuantizedExperts for n in names)
    assert not any(p.dim() == 3 for n, p in full.named_parameters())
    with torch.no_grad():
        got_dense = dense(ids, use_cache=False).logits
        got = full(ids, use_cache=False).logits
    assert torch.isfinite(got).all() and torch.isfinite(got_dense).all()
    assert not torch.equal(got, got_dense)  # the experts ran on the grouped GEMM
    err_dense, err = R.rel_error(got_dense, want), R.rel_error(got, want)
    assert err_dense < 0.25, f"dense layers only: rel error {err_dense:.3e}"
    assert err <= 2 * err_dense, f"experts converted: rel error {err:.3e}, dense layers only {err_dense:.3e}"


# ------------------------------------------------------------------------------------------------
# (b) one forward against the float64 reference
# ------------------------------------------------------------------------------------------------


def _recording(monkeypatch):
    """Route QuantizedExperts' grouped GEMM through a wrapper of the real op that keeps every call's operands and
    output: [(a, scale_a, b, scale_b, groups, masked, out)]."""
    real = moe._grouped_scaled_mm()
    calls = []

    def grouped(a, b, scale_a, scale_b, offs=None, *, counts=None, out_dtype=torch.bfloat16, **options):
        out = real(a, b, scale_a, scale_b, offs, counts=counts, out_dtype=out_dtype, **options)
        groups = offs if counts is None else counts
        calls.append((a.clone(), scale_a.clone(), b, scale_b, groups.clone(), counts is not None, out.clone()))
        return out

    monkeypatch.setattr(moe, "_grouped_scaled_mm", lambda: grouped)
    return calls


def _pairs_by_expert(ids, e):
    """The (token, k) pairs p = t * k + j of each expert, in token order (host)."""
    flat = ids.reshape(-1).tolist()
    return [[p for p, x in enumerate(flat) if x == ex] for ex in range(e)]


def _groups(t, groups, masked):
    """[(expert, its rows of t)] from a call's offs (contiguous) or counts (masked)."""
    sizes, out, start = groups.tolist(), [], 0
    for ex, v in enumerate(sizes):
        out.append((ex, t[ex, :v] if masked else t[start:v]))
        start = v
    return out


def _valid(t, groups, masked):
    """The rows of t the call computes, expert after expert: in both layouts the pairs in expert, then token
    order."""
    return torch.cat([rows for _, rows in _groups(t, groups, masked)])


def _check_codes(a, scale_a, groups, masked, rows, recipe):
    """The call's activation codes and scales are the reference quantizer's of ``rows`` (on the CPU), bit for
    bit."""
    q, s = R.quantize(rows.cpu(), GRANULARITY[recipe])
    got_q = _valid(a.view(torch.uint8), groups, masked).cpu()  # (compared as bytes)
    assert torch.equal(got_q, q.view(torch.uint8)), "activation codes differ from the reference"
    got_s = scale_a.reshape(1) if recipe == "tensor" else _valid(scale_a, groups, masked)
    assert torch.equal(got_s.cpu().reshape(-1), s.reshape(-1)), "activation scales differ from the reference"


def _check_gemm(call, weights, what):
    """A grouped call's output against float64 dequant(a) @ W_e.T per expert (W_e of ``dequantize()``); the
    float64 product of the computed rows, expert after expert."""
    a, scale_a, _, _, groups, masked, out = call
    sa = scale_a.double()
    if sa.dim() > 1 and sa.shape[-1] > 1:  # DeepSeek's (rows, Kb) / (E, C, Kb): each scale over 128 of K
        sa = sa.repeat_interleave(128, dim=-1)[..., :a.shape[-1]]
    a64 = a.double() * sa  # (rows, K) x (rows, 1 or K) or (1,); masked (E, C, K) x (E, C, 1 or K) or (1,)
    refs = []
    for (ex, rows), (_, got) in zip(_groups(a64, groups, masked), _groups(out, groups, masked)):
        if rows.shape[0] == 0:
            continue
        ref = rows @ weights[ex].t()
        err = R.rel_error(got, ref)
        assert err < GEMM_TOL, f"{what}, expert {ex} ({rows.shape[0]} rows): rel error {err:.3e}"
        refs.append(ref)
    return torch.cat(refs)


def _bf16_experts(experts, x, ids, w):
    """float64 experts of the module's bf16 weights: sum_j w_j down_e(SiLU(gate_e(x)) * up_e(x))."""
    assert not getattr(experts, "is_transposed", False)  # gate_up_proj (E, 2I, H), down_proj (E, H, I)
    gate_up, down = experts.gate_up_proj.detach().double(), experts.down_proj.detach().double()
    i = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for j in range(ids.shape[1]):
        h = torch.einsum("th,tnh->tn", x.double(), gate_up[ids[:, j]])
        act = F.silu(h[:, :i]) * h[:, i:]
        out += w[:, j:j + 1].double() * torch.einsum("ti,thi->th", act, down[ids[:, j]])
    return out


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", MODELS)
def test_forward_matches_the_float64_reference(kind, recipe, layout, routing, monkeypatch):
    t = 96
    _route_by(routing, monkeypatch)
    experts, layer, config = _experts(kind, recipe)
    e, k, i = layer.num_experts, config.num_experts_per_tok, layer.intermediate_dim
    layer.capacity = t if LAYOUTS[layout] == "tokens" else None
    ids, w = _routing(t, k, e, seed=11)
    x = _hidden(t, layer.hidden_dim, seed=12)
    pairs = _pairs_by_expert(ids.cpu(), e)
    assert sum(not g for g in pairs) >= 3  # some experts get no token
    order = [p for g in pairs for p in g]
    calls = _recording(monkeypatch)
    with torch.no_grad():
        got = layer(x, ids, w)
    assert got.shape == x.shape and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert len(calls) == 2 and all(c[5] == (layout == "masked") for c in calls)
    sizes = [len(g) for g in pairs]
    for call, buf in zip(calls, (layer.gate_up_proj, layer.down_proj)):
        b, groups = call[2], call[4]
        view = buf.transpose(1, 2)  # the weights' (E, K, N) view
        assert (b.data_ptr(), b.shape, b.stride()) == (view.data_ptr(), view.shape, view.stride())
        want = sizes if layout == "masked" else torch.tensor(sizes).cumsum(0).tolist()
        assert groups.dtype == torch.int32 and groups.tolist() == want
    gate_up, down = layer.dequantize(torch.float64)
    # gate_up: the pairs' hidden states, quantized as the reference quantizer does, times the dequantized weights
    _check_codes(*calls[0][:2], calls[0][4], calls[0][5], x[torch.tensor(order, device="cuda") // k], recipe)
    _check_gemm(calls[0], gate_up, "gate_up")
    # down: SiLU(gate) times the pair's routing weight times up of gate_up's bf16 output, in fp32 rounded to bf16,
    # quantized, times the dequantized weights
    h = _valid(calls[0][6], calls[0][4], calls[0][5])
    pair_w = w.reshape(-1).float()[torch.tensor(order, device="cuda")]
    act = (F.silu(h[:, :i].float()) * pair_w[:, None] * h[:, i:].float()).to(torch.bfloat16)
    _check_codes(*calls[1][:2], calls[1][4], calls[1][5], act, recipe)
    y_ref = _check_gemm(calls[1], down, "down")
    # the combine: each token's k weighted rows added up (the glue's own function, then float64)
    y = calls[1][6]
    # (both routings place the pairs as the stable sort does and add them with the same kernel)
    pos = moe_route.route_pairs(ids, e, t if layout == "masked" else None)[0]
    glue = moe_route.sum_routed_pairs(y, pos, backend="reference")
    assert _same_bits(got, glue)
    by_pair = torch.empty(t * k, layer.hidden_dim, dtype=torch.float64, device="cuda")
    by_pair[torch.tensor(order, device="cuda")] = y_ref
    ref = by_pair.view(t, k, -1).sum(1)
    err = R.rel_error(got, ref)
    assert err < OUTPUT_TOL, f"output: rel error {err:.3e} from the float64 reference"
    err = R.rel_error(got, _bf16_experts(experts, x, ids, w))
    assert err < FP8_TOL, f"output: rel error {err:.3e} from the bf16 experts"


# ------------------------------------------------------------------------------------------------
# (c) the masked layout against the contiguous one
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", MODELS)
def test_masked_and_contiguous_layouts_agree(kind, recipe):
    t = 80
    _, layer, config = _experts(kind, recipe)
    e = layer.num_experts
    ids, w = _routing(t, config.num_experts_per_tok, e, seed=21)
    x = _hidden(t, layer.hidden_dim, seed=22)
    busiest = max(len(g) for g in _pairs_by_expert(ids.cpu(), e))
    assert busiest < t
    with torch.no_grad():
        contiguous = layer(x, ids, w)
        assert torch.isfinite(contiguous).all()
        for capacity in (t, busiest):  # every token; exactly the busiest expert's pairs (nothing dropped)
            layer.capacity = capacity
            masked = layer(x, ids, w)
            assert torch.isfinite(masked).all()
            err = R.rel_error(masked, contiguous)
            assert err < LAYOUT_TOL, f"capacity {capacity}: rel error {err:.3e} from the contiguous layout"


# ------------------------------------------------------------------------------------------------
# (d) CUDA graphs, (e) determinism
# ------------------------------------------------------------------------------------------------


def _replays_like_eager(call, static, draws):
    """Capture ``call(*static)`` after an eager warm-up; for each draw (tensors like ``static``), copy it into the
    captured inputs, poison the output, replay, and compare with eager calls on the same inputs (two of them:
    bit-identical too). Returns the replayed outputs."""
    with torch.no_grad():
        for s, d in zip(static, draws[0]):
            s.copy_(d)
        call(*static)  # compiles the kernels and keeps their launches outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(*static)
        replayed = []
        for n, draw in enumerate(draws):
            for s, d in zip(static, draw):
                s.copy_(d)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.isfinite(out).all(), f"draw {n}: the replay left output rows unwritten"
            eager = call(*static)
            again = call(*static)
            assert _same_bits(eager, again), f"draw {n}: two eager runs differ"
            assert _same_bits(out, eager), f"draw {n}: the replay differs from eager"
            replayed.append(out.clone())
    return replayed


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", MODELS)
def test_moe_block_replays_from_a_cuda_graph(kind, recipe, layout):
    """The converted MoE block (router in bf16, QuantizedExperts) captured once: new hidden states written into the
    captured input give a new routing, and the replay gives eager's bits."""
    t = 64
    model = _model(kind)
    _convert(model, recipe)
    block = model.model.layers[0].mlp
    assert isinstance(block.experts, cnn.QuantizedExperts)
    block.experts.capacity = t if LAYOUTS[layout] == "tokens" else None
    h = block.experts.hidden_dim
    draws = [(_hidden(t, h, seed=31 + n).view(1, t, h),) for n in range(2)]
    with torch.no_grad():
        routed = [block.gate(d[0].view(t, h))[2] for d in draws]
    assert not torch.equal(routed[0], routed[1])  # two routings of the same shapes
    static = (torch.empty(1, t, h, dtype=torch.bfloat16, device="cuda"),)
    out = _replays_like_eager(block, static, draws)
    assert not torch.equal(out[0], out[1])


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_experts_replay_from_a_cuda_graph_with_new_routings(recipe, layout, routing, monkeypatch):
    """QuantizedExperts captured once: new hidden states and routing (ids and weights) written into the captured
    inputs, with empty experts in one routing and every expert used in the other, replay to eager's bits."""
    t = 72
    _route_by(routing, monkeypatch)
    _, layer, config = _experts("qwen3_moe", recipe, capacity=t if LAYOUTS[layout] == "tokens" else None)
    e, k, h = layer.num_experts, config.num_experts_per_tok, layer.hidden_dim
    draws = [(_hidden(t, h, seed=41), *_routing(t, k, e, seed=42, empty=True)),
             (_hidden(t, h, seed=43), *_routing(t, k, e, seed=44, empty=False))]
    sizes = [[len(g) for g in _pairs_by_expert(d[1].cpu(), e)] for d in draws]
    assert 0 in sizes[0] and 0 not in sizes[1]
    static = tuple(torch.empty_like(d) for d in draws[0])
    _replays_like_eager(layer, static, draws)


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_eager_runs_are_bit_identical(recipe, layout, routing, monkeypatch):
    t = 128
    _route_by(routing, monkeypatch)
    _, layer, config = _experts("mixtral", recipe, capacity=t if LAYOUTS[layout] == "tokens" else None)
    ids, w = _routing(t, config.num_experts_per_tok, layer.num_experts, seed=51)
    x = _hidden(t, layer.hidden_dim, seed=52)
    with torch.no_grad():
        first = layer(x, ids, w)
        second = layer(x.clone(), ids.clone(), w.clone())
    assert torch.isfinite(first).all() and _same_bits(first, second)
