"""Hopper: a mixture-of-experts layer on the grouped FP8 GEMM.

``grouped_scaled_mm`` multiplies every expert's tokens by that expert's weights in one launch, with the group
boundaries (``offs``) on the GPU; ``route_quantize_fp8`` places the (token, expert) pairs by expert and writes
each token's FP8 row into its pairs' rows, ``sum_routed_pairs`` adds each token's rows back up;
``cnn.QuantizedExperts`` (what ``cnn.convert`` puts in place of a transformers experts module) runs them around
the gate/up and down GEMMs.

    python examples/sm90_moe_grouped.py [--experts 128 --topk 8 --hidden 2048 --inter 768 --tokens 4096]

On a Hopper GPU it runs one Qwen3-30B-A3B-sized experts layer (random weights) against the same layer in bf16 and
times the grouped GEMM against torch's FP8 and bf16 grouped GEMMs. Without one it compiles the grouped GEMM for
sm_90a, and the routing kernel, and prints the instructions that make them what they are; nothing is executed
then.
"""

import argparse
import re

import torch

import cutedsl_gemm
from cutedsl_gemm import nn as cnn
from cutedsl_gemm.nn.moe import permute
from cutedsl_gemm.numerics.reference import rel_error
from cutedsl_gemm.ops.moe_route import route_quantize_fp8


def timed(fn) -> float:
    """Median us of ``fn`` (triton's do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median") * 1e3


class BF16Experts(torch.nn.Module):
    """transformers' experts layout: gate_up_proj (E, 2I, H), down_proj (E, H, I), SiLU(gate) * up."""

    def __init__(self, e, h, i):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) / h**0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) / i**0.5)
        self.act_fn = torch.nn.functional.silu

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x, dtype=torch.float32)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                gate, up = (x[token] @ self.gate_up_proj[e].t()).chunk(2, dim=-1)
                y = (self.act_fn(gate) * up) @ self.down_proj[e].t()
                out.index_add_(0, token, y.float() * top_k_weights[token, slot, None])
        return out.to(x.dtype)


def run(experts, topk, hidden, inter, tokens):
    layer = BF16Experts(experts, hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda")
    weights, ids = torch.topk(logits.softmax(-1), topk)
    with torch.no_grad():
        ref = layer(x, ids, weights)
        quantized = cnn.QuantizedExperts.from_experts(layer, "row")
        out = quantized(x, ids, weights)
    err = rel_error(out, ref)
    print(f"{experts} experts, top-{topk}, H={hidden}, I={inter}, {tokens} tokens: QuantizedExperts vs bf16 "
          f"rel error {err:.4f}")
    t_q = timed(lambda: quantized(x, ids, weights))
    print(f"  QuantizedExperts forward (route, quantize, gate/up, SiLU * up, down, combine): {t_q:8.1f} us")
    # the routing: the kernels against a sort, a gather and the quantizer (the same codes)
    qx, sx, offs, _, _ = route_quantize_fp8(x, ids, weights, experts, "row")
    rows, sort_offs, _ = permute(x, ids, experts)
    assert torch.equal(offs, sort_offs) and torch.equal(qx.view(torch.uint8), cutedsl_gemm.quantize_fp8(
        rows, "row")[0].view(torch.uint8))
    t_route = timed(lambda: route_quantize_fp8(x, ids, weights, experts, "row"))
    t_sort = timed(lambda: cutedsl_gemm.quantize_fp8(permute(x, ids, experts)[0], "row"))
    print(f"  routing: route_quantize_fp8 {t_route:7.1f} us, permute + quantize_fp8 {t_sort:7.1f} us")
    # the gate/up GEMM alone, against torch's grouped GEMMs on the same routed rows
    b, sb = quantized.gate_up_proj.transpose(1, 2), quantized.gate_up_proj_scale
    ours = timed(lambda: cutedsl_gemm.grouped_scaled_mm(qx, b, sx, sb, offs))
    fp8 = timed(lambda: torch._scaled_grouped_mm(qx, b, sx.view(-1), sb.view(experts, -1), offs=offs,
                                                 out_dtype=torch.bfloat16))
    w = layer.gate_up_proj.detach().transpose(1, 2)
    bf16 = timed(lambda: torch._grouped_mm(rows, w, offs=offs))
    flops = 2 * rows.shape[0] * b.shape[2] * hidden
    print(f"  gate/up grouped GEMM ({rows.shape[0]} rows): ours {ours:7.1f} us ({flops / ours / 1e6:.0f} TFLOPS), "
          f"torch._scaled_grouped_mm {fp8:7.1f} us, torch._grouped_mm bf16 {bf16:7.1f} us")


def compile_only():
    """No Hopper GPU: the grouped GEMM's instances compiled for sm_90a, and what in their PTX makes them grouped."""
    from cutedsl_gemm.selection import instances as M
    from cutedsl_gemm.tools import ptx_inspect as I

    print("No Hopper GPU here: the grouped GEMM compiled for sm_90a, not executed.")
    facts = {
        "WGMMA e4m3 x e4m3": r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
        "TMA tile loads (A at the group's row, W by expert)": r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global",
        "32-bit global loads (group sizes, row scales)": r"ld\.global(?:\.nc)?\.b32",
        "16-bit stores of the group's rows (not TMA: it would clip at the tensor)": r"st\.global\.b16",
    }
    for layout in ("contiguous", "masked"):
        inst = M.select(op=M.GROUPED_GEMM, schedule=layout, recipe="row", out_dtype="bf16")[0]
        rep = I.inspect_instance(inst)
        print(f"\n{layout}: {rep.summary_lines()[0]}")
        for what, pattern in facts.items():
            first = re.search(rf"(?:{pattern})[^\n]*", rep.ptx)
            example = f", e.g. {' '.join(first.group(0).split())[:96]}" if first else ""
            print(f"    {len(re.findall(pattern, rep.ptx)):4d} x {what}{example}")
    _compile_routing()
    print("\nRunning it against bf16 and torch's grouped GEMMs needs a Hopper GPU (H100, H200 or H800).")


def _compile_routing():
    """The routing kernel (row-wise, 128 experts, top-8, rows of 2048) compiled for sm_90a, and what its PTX holds."""
    from cutedsl_gemm.tools.ptx_fingerprint import kernel_ptx

    ptx = kernel_ptx("sm_90a_moe_route_row_bf16_e4m3_h2048_k8_e128")
    print("\nrouting (route_quantize_fp8: one CTA a token, 128 experts, top-8):")
    facts = {"lanes grouped by expert": r"match\.any\.sync\.b32", "per-expert counts": r"atom\.shared\.cta\.add",
             "e4m3 conversions": r"cvt\.rn\.satfinite\.e4m3x2\.f32",
             "16-byte stores of a row's codes": r"st\.global\.v4"}
    for what, pattern in facts.items():
        print(f"    {len(re.findall(pattern, ptx)):4d} x {what}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    torch.manual_seed(0)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        run(args.experts, args.topk, args.hidden, args.inter, args.tokens)
    else:
        compile_only()


if __name__ == "__main__":
    main()
