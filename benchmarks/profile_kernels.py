"""Kernel-level views of where time goes on a Hopper GPU, for torch.profiler and Nsight Compute.

    python -m benchmarks.profile_kernels --what moe-rest       the Qwen3-30B-A3B decode step with every experts
                                                               module a no-op (what bounds the MoE model besides
                                                               the experts): its kernels by GPU time, per batch
    ncu --nvtx --nvtx-include "grouped-down-16/" --launch-count 1 --set full \\
        python -m benchmarks.profile_kernels --what grouped     the grouped row-wise GEMMs of Qwen3-30B-A3B at decode
    ncu --nvtx --nvtx-include "weight-only-1/" --launch-count 1 --set full \\
        python -m benchmarks.profile_kernels --what weight-only  the int4 weight-only GEMM at M = 1 and 16
    ncu --nvtx --nvtx-include "grouped-gateup-1024/" --nvtx-include "dense-gateup-1024/" --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters --section InstructionStats \
        python -m benchmarks.profile_kernels --what grouped-vs-dense
                                                               Mixtral's gate_up at 1024 rows per expert: the
                                                               grouped GEMM over the 8 experts and the dense GEMM
                                                               over one, as the dense loop runs it (per clock)
    python -m benchmarks.profile_kernels --what attention      one layer's decode attention of Qwen3-30B-A3B (32
                                                               query heads on 4 kv heads) over 513 positions: SDPA
                                                               after repeat_kv, with enable_gqa, and packed
                                                               (tools.models.packed_gqa_sdpa), per batch

Each profiled call runs warm, alone in an NVTX range named after it (``grouped-<gemm>-<tokens>``,
``grouped-gateup-<rows>`` / ``dense-gateup-<rows>``, ``weight-only-<M>``), so that ncu takes exactly it.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from . import common
from .common import require_gpu

WHATS = ("moe-rest", "grouped", "grouped-vs-dense", "weight-only", "attention")
#: Qwen3-30B-A3B's experts: (experts, top-k, hidden, intermediate)
QWEN3_30B_EXPERTS = (128, 8, 2048, 768)
#: Mixtral-8x7B's: (experts, top-k, hidden, intermediate)
MIXTRAL_EXPERTS = (8, 2, 4096, 14336)


def _ranged(name: str, fn) -> None:
    """``fn`` three times warm, then once alone in the NVTX range ``name``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def grouped(tokens=(16, 128)) -> None:
    """The gate_up and down GEMMs of Qwen3-30B-A3B's experts at ``tokens`` decode tokens (uniform routing)."""
    import cutedsl_gemm

    from .bench_grouped import _weights, route, sizes_of

    gen, cpu = torch.Generator(device="cuda").manual_seed(0), torch.Generator().manual_seed(0)
    e, k, h, i = QWEN3_30B_EXPERTS
    for t in tokens:
        sizes = sizes_of(route(t, e, k, "uniform", cpu), e)
        offs = sizes.cumsum(0).to(torch.int32).cuda()
        for gemm, n, depth in (("gate_up", 2 * i, h), ("down", h, i)):
            _, qw, sw = _weights(e, n, depth, gen)
            x = torch.randn(int(sizes.sum()), depth, device="cuda", generator=gen, dtype=torch.bfloat16)
            qa, sa = cutedsl_gemm.quantize_fp8(x, "row")
            b = qw.transpose(1, 2)
            _ranged(f"grouped-{gemm.replace('_', '')}-{t}",
                    functools.partial(cutedsl_gemm.grouped_scaled_mm, qa, b, sa, sw, offs))


def grouped_vs_dense(rows=1024) -> None:
    """Mixtral's gate_up GEMM (N = 28672, K = 4096) at ``rows`` rows per expert, row-wise: the grouped GEMM over
    its 8 experts, and the dense GEMM over the first expert's rows, the call the dense loop repeats per expert."""
    import cutedsl_gemm

    from .bench_grouped import _weights

    gen = torch.Generator(device="cuda").manual_seed(0)
    e, _, h, i = MIXTRAL_EXPERTS
    _, qw, sw = _weights(e, 2 * i, h, gen)
    x = torch.randn(e * rows, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    qa, sa = cutedsl_gemm.quantize_fp8(x, "row")
    b = qw.transpose(1, 2)
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * rows
    _ranged(f"grouped-gateup-{rows}", functools.partial(cutedsl_gemm.grouped_scaled_mm, qa, b, sa, sw, offs))
    _ranged(f"dense-gateup-{rows}", functools.partial(cutedsl_gemm.scaled_mm, qa[:rows], b[0], sa[:rows], sw[0],
                                                        out_dtype=torch.bfloat16))


def weight_only(ms=(1, 16), n=8192, k=8192) -> None:
    """The int4 (group 128) weight-only GEMM at each M of ``ms`` on an N x K weight."""
    from cutedsl_gemm.ops.weight_only import mm_weight_only

    from .bench_weight_only import our_weights

    packed, scales, zeros, *_ = our_weights(n, k, 4, 128, False, torch.Generator(device="cuda").manual_seed(0))
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        _ranged(f"weight-only-{m}", functools.partial(mm_weight_only, x, packed, scales, zeros, group=128, bits=4))


def moe_rest(attention: str, batches=(1, 16, 64), layers=4, context=512, top=25) -> None:
    """The kernels of a decode step of the Qwen3-30B-A3B-shaped bf16 model (``layers`` layers, ``--attention``)
    with every experts module a no-op, at each batch: GPU time per step by kernel, the top ``top``."""
    from torch.profiler import ProfilerActivity, profile

    from cutedsl_gemm.tools import models as M

    from .bench_moe import noop_experts_model

    model = M.random_causal_lm(M.moe_config("qwen3_moe", layers, M.QWEN3_30B_A3B), device="cuda")
    common.use_attention(model, attention)
    noop = noop_experts_model(model)
    print(f"attention: {model.config._attn_implementation}; {layers} layers, {context} tokens of context")
    for batch in batches:
        step = M.DecodeStep(noop, batch, context + 1)
        with torch.no_grad():
            step.prefill(M.random_tokens(model.config, batch, context))
            for _ in range(3):
                step.forward()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step.forward()
                torch.cuda.synchronize()
        events = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events) / 5
        print(f"batch {batch}: {total:.0f} us of kernels a step, {sum(e.count for e in events) // 5} kernels")
        for e in events[:top]:
            print(f"  {e.device_time_total / 5:9.1f} us  x{e.count // 5:4d}  {e.key[:110]}")
        sys.stdout.flush()


def attention_ways(q, k, v, mask) -> dict:
    """One decode step's SDPA of query heads ``q`` (B, H, 1, D) over grouped kv heads ``k`` / ``v`` (B, Hkv, L, D)
    and ``mask`` (B, 1, 1, L): name -> call. "repeat_kv": each kv head copied for its query heads first (what
    transformers 5.17 does with a mask); "enable_gqa": SDPA's own grouping; "packed": ``packed_gqa_sdpa``."""
    import torch.nn.functional as F

    from cutedsl_gemm.tools import models as M

    batch, heads, _, dim = q.shape
    groups, positions = heads // k.shape[1], k.shape[2]
    layer = torch.nn.Module()
    layer.num_key_value_groups = groups

    def repeat(x):
        return x[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, heads, positions, dim)

    return {"repeat_kv": lambda: F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask),
            "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            "packed": lambda: M.packed_gqa_sdpa(layer, q, k, v, mask)[0].transpose(1, 2),
            "float64": lambda: F.scaled_dot_product_attention(q.double(), repeat(k).double(), repeat(v).double(),
                                                              attn_mask=mask)}


def attention(batches=(1, 16, 64), positions=513, heads=32, kv_heads=4, head_dim=128) -> None:
    """One layer's SDPA at decode (one query token, a boolean mask over the static cache, as transformers passes
    under graph capture), three ways, timed L2-cold (``common.bench``), each against the float64 product."""
    from cutedsl_gemm.numerics import reference as R

    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in batches:
        q = torch.randn(batch, heads, 1, head_dim, device="cuda", generator=gen).bfloat16()
        k, v = (torch.randn(batch, kv_heads, positions, head_dim, device="cuda", generator=gen).bfloat16()
                for _ in range(2))
        ways = attention_ways(q, k, v, torch.ones(batch, 1, 1, positions, dtype=torch.bool, device="cuda"))
        want = ways.pop("float64")()
        for name, fn in ways.items():
            err = R.rel_error(fn(), want)
            print(f"batch {batch}, {name}: {common.bench(fn) * 1e3:.1f} us, rel err {err:.1e}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=WHATS, required=True)
    common.add_attention_option(p)
    args = p.parse_args(argv)
    require_gpu("profile_kernels")
    if args.what == "moe-rest":
        moe_rest(args.attention)
    else:
        {"grouped": grouped, "grouped-vs-dense": grouped_vs_dense, "weight-only": weight_only,
         "attention": attention}[args.what]()


if __name__ == "__main__":
    main()
