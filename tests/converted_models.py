"""Small converted Llama-shaped models for the tests of the fused layers (``nn.fuse``)."""

from __future__ import annotations

import torch

from cutedsl_gemm import nn as cnn
from cutedsl_gemm.tools import models as M

DIMS = dict(M.TINY_LLAMA, intermediate_size=384)  # I = 3 * 128 (the DeepSeek blocks of gate and up)


def converted(recipe, device="cpu", layers=2, seed=0):
    """A random Llama of ``DIMS`` converted with ``recipe`` (the LM head left bf16)."""
    model = M.random_llama(M.llama_config(layers, DIMS), device, torch.bfloat16, seed=seed)
    cnn.convert(model, recipe, filter=lambda name, m: name != "lm_head")
    return model


def bits(t):
    """FP8 codes as bytes (NaN codes compare equal), anything else as it is."""
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t


def assert_round_trips(recipe, fuse, before: dict, after: dict) -> None:
    """``after`` (a fused model's state dict) holds ``before``'s keys and bits (the unfused model's), and each loads
    into the other kind of model with the same bits."""
    assert set(after) == set(before)
    for key, t in before.items():
        assert after[key].shape == t.shape and after[key].dtype == t.dtype, key
        assert torch.equal(bits(after[key]), bits(t)), key
    fused = converted(recipe, seed=1)
    fuse(fused)
    fused.load_state_dict(before)
    assert all(torch.equal(bits(fused.state_dict()[k]), bits(v)) for k, v in before.items())
    plain = converted(recipe, seed=2)
    plain.load_state_dict(after)
    assert all(torch.equal(bits(plain.state_dict()[k]), bits(v)) for k, v in before.items())
