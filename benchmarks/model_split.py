"""Where a decode step's time goes: its linear layers against their weight floor, and the rest.

The split times the same decode step twice: as it is, and on a copy of the model whose linears (the converted ones
of the variant, or for bf16 the same layers left in bf16) are each replaced by a :class:`NoopLinear`, which returns a
preallocated tensor of the layer's output shape and dtype. The copy shares every other tensor of the model and is
made before the step is captured, so the no-op step runs the same attention, norms, rotary embedding and elementwise
work, in the same CUDA graph form. Then

    linears ms        = step ms - no-op step ms                (the rest: the no-op step)
    linears floor ms  = bytes of the linears' weights, scales and zero points / HBM rate
    linears % of floor = 100 * linears floor / linears ms
    bound x bf16      = bf16 step ms / (rest ms + linears floor ms)

the last being what "x bf16" would reach if the linears streamed their weights at the floor and the rest cost what
it costs now. Also the weights a whole step reads (``streamed_bytes``) for the "% of weight floor" column.
"""

from __future__ import annotations

import itertools

import torch

from cutedsl_gemm.tools import models as M


class NoopLinear(torch.nn.Module):
    """A linear layer's stand-in that computes nothing: ``forward(x)`` returns a zero tensor of shape
    ``(*x.shape[:-1], out_features)`` in x's dtype, allocated at the first call of that shape and returned again
    by every later call (held in ``pool``, which the stand-ins of one model share: layers of the same output shape
    return the same tensor, which the model only reads). Inputs of more than ``MAX_POOLED_ROWS`` rows (a prefill)
    get a fresh tensor each call, so that the pool holds only decode-sized outputs."""

    MAX_POOLED_ROWS = 4096

    def __init__(self, in_features: int, out_features: int, pool: dict):
        super().__init__()
        self.in_features, self.out_features, self.pool = in_features, out_features, pool

    @classmethod
    def from_linear(cls, linear: torch.nn.Module, pool: dict) -> NoopLinear:
        return cls(linear.in_features, linear.out_features, pool)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        key = (shape, x.dtype, x.device)
        out = self.pool.get(key)
        if out is None:
            out = x.new_zeros(shape)
            if out.numel() <= self.MAX_POOLED_ROWS * self.out_features and not torch.compiler.is_compiling():
                self.pool[key] = out
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (no-op)"


def noop_model(model: torch.nn.Module, names) -> torch.nn.Module:
    """A copy of ``model`` sharing its tensors (``models.sharing_copy``) whose submodules named in ``names`` are
    :class:`NoopLinear` stand-ins of one shared pool."""
    pool: dict = {}
    copy = M.sharing_copy(model)
    M.replace_modules(copy, names, lambda linear: NoopLinear.from_linear(linear, pool))
    return copy


def linear_bytes(model: torch.nn.Module, names) -> int:
    """Bytes of the parameters and buffers of ``model``'s submodules named in ``names``: a linear's weight, its
    scales, zero points and bias, in whatever form the layer holds them."""
    seen, total = set(), 0
    for name in names:
        module = model.get_submodule(name)
        for t in itertools.chain(module.parameters(), module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def streamed_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes one forward step reads from the model's state: every parameter and buffer once (linear weights and
    their scales, norms, LM head, rotary table), except the input embedding table, of which only the rows of the
    step's ``tokens`` tokens are read (all of it when the LM head shares it)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb
    total = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t is emb and not tied:
            total += min(tokens, emb.shape[0]) * emb.shape[1] * emb.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


def floor_ms(nbytes: int, hbm_tbps: float | None) -> float | None:
    """Time to stream ``nbytes`` at ``hbm_tbps`` TB/s, in ms (None without a rate)."""
    return None if not hbm_tbps else nbytes / (hbm_tbps * 1e12) * 1e3


SPLIT_COLUMNS = ["linears ms", "linears floor ms", "linears % of floor", "rest ms", "bound x bf16"]


def split_cells(ms: float, rest_ms: float, nbytes: int, hbm_tbps: float | None, bf16_ms: float | None) -> list:
    """The ``SPLIT_COLUMNS`` cells of a step of ``ms`` whose no-op step took ``rest_ms``, its linears holding
    ``nbytes``: linears ms, their floor at ``hbm_tbps`` (None without a rate), linears % of floor (None unless
    the difference is positive), rest ms, and the bound on "x bf16" (None without ``bf16_ms``, the bf16 step's)."""
    linears = ms - rest_ms
    floor = floor_ms(nbytes, hbm_tbps)
    pct = 100 * floor / linears if floor is not None and linears > 0 else None
    bound = bf16_ms / (rest_ms + floor) if floor is not None and bf16_ms else None
    return [round(linears, 4), None if floor is None else round(floor, 4), None if pct is None else round(pct, 1),
            round(rest_ms, 4), None if bound is None else round(bound, 3)]
