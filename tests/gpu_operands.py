"""Operands for the GPU tests: quantized with the reference quantizer, with a random magnitude per scale
block (2^-4 .. 2^2) so that a scale applied to the wrong row, column or K block shows as a large error."""

import torch

import cutedsl_gemm
from cutedsl_gemm.numerics import reference as R
from cutedsl_gemm.numerics.formats import FLOAT_FORMATS

TORCH_DTYPES = {f.name: f.torch_dtype for f in FLOAT_FORMATS}  # "bf16" -> torch.bfloat16, ...
# Relative Frobenius error allowed against the float64 reference, by output dtype (promoted accumulation).
OUT_TOL = {torch.bfloat16: 2e-3, torch.float16: 5e-4, torch.float32: 2e-4}


def block_magnitudes(rows, k, rb, device):
    """A random power of two per (rb rows x 128 K) block, expanded to (rows, k) (rb None: all rows)."""
    rb = rb or max(rows, 1)
    g = torch.randint(-4, 3, (-(-rows // rb), -(-k // 128)), device=device).float().exp2()
    return g.repeat_interleave(rb, 0)[:rows].repeat_interleave(128, 1)[:, :k]


def block_scaled_operands(m, n, k, fa, fb, recipe):
    rec = cutedsl_gemm.recipe(recipe)
    a = torch.randn(m, k, device="cuda") * block_magnitudes(m, k, rec.a.rows, "cuda")
    w = torch.randn(n, k, device="cuda") * block_magnitudes(n, k, rec.b.rows, "cuda")
    return R.quantize_operands(a, w, recipe, fa, fb)  # qa, sa, qw, sw in plain (rows or blocks, Kb) layout


def torch_scale_layout(s, gran_rows):
    """The same scales in F.scaled_mm's layout for the operand: 1x128 outer-dim-major; 128x128 with the
    K-block axis padded to a multiple of 4 (cuBLAS's storage, passed whole)."""
    rows, kb = s.shape
    if gran_rows == 1:
        return s.t().contiguous().t()
    l4 = -(-kb // 4) * 4
    out = torch.ones(rows, l4, device=s.device)
    out[:, :kb] = s
    return out


def distinct_kernels(recipes, operands="e4m3"):
    """One instance per distinct kernel among the Hopper table rows of ``recipes`` (``operands`` x ``operands``:
    E4M3 or INT8; bf16 out, no bias): rows that differ only in their dispatch M range share code
    (``runner.code_key``)."""
    from cutedsl_gemm.generators.runner import code_key
    from cutedsl_gemm.selection.instances import select

    seen = {}
    for recipe in recipes:
        for i in select(arch="sm_90a", op="gemm", recipe=recipe, a_dtype=operands, b_dtype=operands,
                        out_dtype="bf16", bias_dtype=None):
            seen.setdefault(code_key(i), i)
    return list(seen.values())


def launch_directly(inst, qa, b, scale_a, scale_b, mnk, splits=3, bias=None):
    """Run ``inst``'s compiled kernel bypassing dispatch (kernel scale views), K split ``splits`` ways where
    it can, into a NaN-poisoned output of the instance's dtype (with ``bias`` where it has one), and return
    the output."""
    from cutedsl_gemm.runtime import launch
    from cutedsl_gemm.selection import dispatch

    m, n, k = mnk
    out = torch.full((m, n), float("nan"), dtype=TORCH_DTYPES[inst.out_dtype], device="cuda")
    splits = splits if inst.can_split_k else 1
    slots = launch.launch_clusters(0, inst) * inst.cluster_m * inst.cluster_n  # CTAs resident at once
    used = dispatch.splits_for(inst, m, n, k, slots, splits)
    call = launch.bind(inst, qa, b, scale_a, scale_b, out, splits=used, bias=bias)
    call()
    torch.cuda.synchronize()
    assert used == splits, f"{inst.name}: ran {used} K splits, meant {splits}"
    return out
