"""Inputs and a float64 rounding oracle for the numerics tests: the codec's integer encoder is checked
against a nearest-even table search over the decoded code values, written independently of it."""

import torch

from cutedsl_gemm.numerics import codecs


def bf16_all() -> torch.Tensor:
    """Every bf16 bit pattern, as fp32 (NaNs included)."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def table_round(y: torch.Tensor, fmt) -> torch.Tensor:
    """Nearest representable magnitude by table search in float64, ties to the even code, saturating."""
    mags = codecs.code_values(fmt)[: fmt.max_code + 1].double()
    a = y.double().abs().clamp(max=fmt.max_finite)
    lo = torch.searchsorted(mags, a, right=True) - 1
    hi = (lo + 1).clamp(max=len(mags) - 1)
    dlo, dhi = a - mags[lo], mags[hi] - a
    pick = torch.where(dlo < dhi, lo, torch.where(dhi < dlo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return (pick | (torch.signbit(y).long() << (fmt.bits - 1))).to(torch.uint8)
