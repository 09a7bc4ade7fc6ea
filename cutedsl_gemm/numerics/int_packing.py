"""Integer weights for the weight-only GEMM: quantization (torch reference), and the packed layout the Hopper
kernel reads (``kernels/sm90/weight_only_gemm.py``), with its inverse.

Weights and codes
=================
A weight ``W`` (N, K) is stored as integers ``q`` (N, K) with scales along K, ``w ~= (q - z) * s``:

* int4, group-wise: one scale (and optionally one integer zero point) per ``group`` consecutive elements of a row
  (group 32, 64 or 128). Symmetric: ``q`` in [-8, 7], no zero points (``z = 0``). Asymmetric (AWQ/GPTQ style):
  ``q`` in [0, 15] and an integer zero point ``z`` in [0, 15] per group.
* int8 or int4, per output channel (``group=0``): ``q`` in [-128, 127] (int8) or [-8, 7] (int4), one scale per
  row, applied to the fp32 accumulator in the kernel's epilogue; no zero points.

Packed layout (``pack_weights``)
================================
The weights are cut into *atoms* of ``ATOM_ROWS`` (64) rows by ``ATOM_K`` (128) K: one WGMMA warp group's A
operand for one 128-deep K tile. ``N`` and ``K`` are padded with ``q = 0`` to whole atoms. The packed tensor is
int32 ``(ceil(N / 64), ceil(K / 128), 256 * bits)``: atom (row block, K block), then the atom's words.

Inside an atom every one of the warp group's 128 threads owns ``2 * bits`` words (64 elements): exactly its
register fragment of the eight m64nNk16 WGMMAs of the K tile, in register order, so a thread converts words into
fragment registers without moving any element. The atom's words are ordered ``[chunk][thread][4]``: thread ``t``'s
words ``4c .. 4c+3`` (16 bytes) sit at ``c * 512 + 4 * t``, so each 128-bit shared-memory read of a warp covers
512 consecutive bytes (no bank conflicts).

The fragment: thread ``t`` (warp ``t // 32``, lane ``l = t % 32``) holds, per 16-deep K block ``kb``, eight
elements ``e = 0..7`` at row ``16 * (t // 32) + l // 4 + 8 * ((e // 2) % 2)`` and K
``16 * kb + 2 * (l % 4) + e % 2 + 8 * (e // 4)`` (the PTX ISA's register fragment of a ``.bf16`` A operand).

* int4: word ``kb`` holds K block ``kb``'s eight elements as unsigned nibbles ``u = q + 8`` (symmetric) or
  ``u = q`` (with zero points), element ``e`` at nibble ``NIBBLE_OF_ELEMENT[e]`` (bits ``4 * nibble``). Each
  ``(x >> 4 * i) & 0x000F000F`` is then elements ``(2i, 2i + 1)`` in the two halves of one register, which one
  ``lop3`` turns into bf16/fp16 "magic numbers" (``0x4300 | u`` is 128 + u).
* int8: words ``2 * kb`` and ``2 * kb + 1`` hold elements 0..3 and 4..7 of K block ``kb`` as two's-complement
  bytes, element ``4h + e`` of word ``2kb + h`` at byte ``BYTE_OF_ELEMENT[e]``: bytes (0, 2) and (1, 3) are the two
  registers' element pairs.

Scales and zero points (the kernel's layout)
============================================
Group-wise: ``(K / group, N)``, N contiguous (the transpose of the natural ``(N, K / group)``), in the activation
dtype (bf16 or fp16): the kernel loads each K tile's ``(128 / group, tile rows)`` box with TMA, which needs the row
stride in 16-byte units (``N`` a multiple of 8). Zero points are stored the same way, as integer values in that
dtype. Per channel: ``(1, N)`` fp32.
"""

from __future__ import annotations

import functools

import torch

from cutedsl_gemm.numerics.formats import ceil_div

ATOM_ROWS = 64  # rows of a packing atom: one WGMMA warp group's M
ATOM_K = 128  # K of a packing atom: one pipeline stage's K tile
ATOM_THREADS = 128  # the warp group's threads, each owning its fragment's words
CHUNK_WORDS = 4  # one 128-bit shared-memory read
GROUPS = (32, 64, 128)  # group-wise scales along K (int4)
PER_CHANNEL = 0  # ``group`` of per-output-channel scales
BITS = (4, 8)

# Nibble (int4) and byte (int8) position of each fragment element within its word (module docstring).
NIBBLE_OF_ELEMENT = (0, 4, 1, 5, 2, 6, 3, 7)
BYTE_OF_ELEMENT = (0, 2, 1, 3)


def words_per_atom(bits: int) -> int:
    return ATOM_ROWS * ATOM_K * bits // 32


def words_per_thread(bits: int) -> int:
    """Words of one thread's fragment of an atom: 8 (int4) or 16 (int8)."""
    return words_per_atom(bits) // ATOM_THREADS


def check_format(bits: int, group: int, has_zeros: bool) -> None:
    """The (bits, group, zero points) combinations the kernel runs; ValueError naming what is expected."""
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group != PER_CHANNEL and group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS} (scales along K) or 0 (per output channel), got {group}")
    if bits == 8 and group != PER_CHANNEL:
        raise ValueError(f"int8 weights take per-channel scales (group=0), got group={group}")
    if has_zeros and group == PER_CHANNEL:
        raise ValueError("zero points come with group-wise int4 scales (group 32, 64 or 128), not per channel")


def code_range(bits: int, has_zeros: bool) -> tuple:
    """(lowest, highest) integer value of ``q``: signed, or unsigned with zero points."""
    return (0, (1 << bits) - 1) if has_zeros else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)


@functools.lru_cache(maxsize=None)
def atom_element_index(bits: int) -> torch.Tensor:
    """int64 (words_per_atom, 32 // bits): for every word of an atom (in storage order) and every element slot of
    the word (nibble or byte, least significant first), the element's flat index ``row * ATOM_K + k`` in the
    64 x 128 atom. Every element appears once (the layout is a permutation)."""
    per_word = 32 // bits
    out = torch.empty(words_per_atom(bits), per_word, dtype=torch.int64)
    for t in range(ATOM_THREADS):
        warp, lane = divmod(t, 32)
        for w in range(words_per_thread(bits)):
            if bits == 4:
                kb, first, slot_of = w, 0, NIBBLE_OF_ELEMENT
            else:
                kb, h = divmod(w, 2)
                first, slot_of = 4 * h, BYTE_OF_ELEMENT
            word = (w // CHUNK_WORDS) * CHUNK_WORDS * ATOM_THREADS + CHUNK_WORDS * t + w % CHUNK_WORDS
            for i, slot in enumerate(slot_of):
                e = first + i
                row = 16 * warp + lane // 4 + 8 * ((e // 2) % 2)
                k = 16 * kb + 2 * (lane % 4) + e % 2 + 8 * (e // 4)
                out[word, slot] = row * ATOM_K + k
    return out


def _padded_atoms(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes -> (N atoms, K atoms, 64 * 128) codes, zero-padded to whole atoms, each atom row-major."""
    n, k = codes.shape
    na, ka = ceil_div(n, ATOM_ROWS), ceil_div(k, ATOM_K)
    padded = codes.new_zeros(na * ATOM_ROWS, ka * ATOM_K)
    padded[:n, :k] = codes
    return padded.view(na, ATOM_ROWS, ka, ATOM_K).permute(0, 2, 1, 3).reshape(na, ka, ATOM_ROWS * ATOM_K)


def _check_codes(w_int: torch.Tensor, bits: int, has_zeros: bool) -> None:
    if w_int.dim() != 2:
        raise ValueError(f"w_int must be 2-D (N, K), got shape {tuple(w_int.shape)}")
    if w_int.dtype.is_floating_point or w_int.dtype.is_complex or w_int.dtype == torch.bool:
        raise TypeError(f"w_int must be an integer tensor, got {w_int.dtype}")
    lo, hi = code_range(bits, has_zeros)
    if w_int.numel() and (int(w_int.min()) < lo or int(w_int.max()) > hi):
        kind = "with zero points (unsigned)" if has_zeros else "symmetric (signed)"
        raise ValueError(f"int{bits} codes {kind} must lie in [{lo}, {hi}]; got values in "
                         f"[{int(w_int.min())}, {int(w_int.max())}]")


def _check_group_tensor(name: str, t: torch.Tensor, n: int, k: int, group: int) -> None:
    want = (n, 1) if group == PER_CHANNEL else (n, k // group)
    if t.dim() != 2 or tuple(t.shape) != want:
        raise ValueError(f"{name} must be (N, {'1' if group == PER_CHANNEL else 'K / group'}) = {want} for "
                         f"N={n}, K={k}, group={group}; got shape {tuple(t.shape)}")


def pack_weights(w_int: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None, group: int = 128, *,
                 bits: int = 4, dtype: torch.dtype = torch.bfloat16):
    """Integer weights and their scales in the kernel's layouts (module docstring).

    ``w_int`` (N, K) integers (``code_range``), ``scales`` (N, K / group) (or (N, 1) with ``group=0``), ``zeros``
    (N, K / group) integer zero points or None. ``dtype`` is the activations' dtype (bf16 or fp16), which the
    kernel computes the dequantized weights in: group-wise scales and zero points are stored in it.

    Returns ``(packed, scales, zeros)``: int32 ``(ceil(N / 64), ceil(K / 128), 256 * bits)``, ``(K / group, N)``
    in ``dtype`` (per channel: ``(1, N)`` fp32) and ``(K / group, N)`` in ``dtype`` or None. Runs on the tensors'
    device."""
    check_format(bits, group, zeros is not None)
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype (the activations') must be torch.bfloat16 or torch.float16, got {dtype}")
    _check_codes(w_int, bits, zeros is not None)
    n, k = w_int.shape
    if group != PER_CHANNEL and k % group:
        raise ValueError(f"K must be a multiple of the group size: K={k}, group={group}")
    if n % 8:
        raise ValueError(f"N must be a multiple of 8 (the kernel loads scale rows of N values with TMA), got N={n}")
    if not scales.dtype.is_floating_point:
        raise TypeError(f"scales must be a float tensor, got {scales.dtype}")
    _check_group_tensor("scales", scales, n, k, group)
    if zeros is not None:
        _check_group_tensor("zeros", zeros, n, k, group)
        z = zeros.to(torch.float64)
        lo, hi = code_range(bits, True)
        if z.numel() and (bool((z != z.round()).any()) or float(z.min()) < lo or float(z.max()) > hi):
            raise ValueError(f"zeros must be integer zero points in [{lo}, {hi}]")

    atoms = _padded_atoms(w_int.to(torch.int64))  # padded with q = 0
    atoms = atoms & ((1 << bits) - 1) if zeros is not None or bits == 8 else atoms + 8  # nibble u or byte
    per_word = 32 // bits
    order = atom_element_index(bits).flatten().to(atoms.device)
    gathered = atoms[:, :, order].view(*atoms.shape[:2], words_per_atom(bits), per_word)
    shifts = torch.arange(per_word, device=atoms.device, dtype=torch.int64) * bits
    words = (gathered << shifts).sum(-1)
    packed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

    if group == PER_CHANNEL:
        return packed, scales.reshape(1, n).to(torch.float32).contiguous(), None
    kernel_scales = scales.t().to(dtype).contiguous()
    kernel_zeros = None if zeros is None else zeros.t().to(dtype).contiguous()
    return packed, kernel_scales, kernel_zeros


def unpack_weights(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None, *, k: int,
                   group: int = 128, bits: int = 4):
    """``pack_weights``' inverse: ``(w_int, scales, zeros)`` as int8 (N, K), (N, K / group) or (N, 1) and
    (N, K / group) or None, in the dtypes the kernel read them in (the scales as rounded to it)."""
    check_format(bits, group, zeros is not None)
    n = scales.shape[1]
    na, ka = ceil_div(n, ATOM_ROWS), ceil_div(k, ATOM_K)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (na, ka, words_per_atom(bits)):
        raise ValueError(f"packed int{bits} weights of N={n}, K={k} are int32 {(na, ka, words_per_atom(bits))}, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    per_word = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int64) * bits
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (na, ka, words, per_word)
    atoms = torch.empty(na, ka, ATOM_ROWS * ATOM_K, dtype=torch.int64, device=packed.device)
    atoms[:, :, atom_element_index(bits).flatten().to(packed.device)] = fields.reshape(na, ka, ATOM_ROWS * ATOM_K)
    codes = atoms.view(na, ka, ATOM_ROWS, ATOM_K).permute(0, 2, 1, 3).reshape(na * ATOM_ROWS, ka * ATOM_K)[:n, :k]
    if zeros is None:
        half = 1 << (bits - 1)
        codes = codes - 8 if bits == 4 else torch.where(codes >= half, codes - (1 << bits), codes)
    w_int = codes.to(torch.int8)
    if group == PER_CHANNEL:
        return w_int, scales.reshape(n, 1), None
    return w_int, scales.t(), None if zeros is None else zeros.t()


def quantize_weights(w: torch.Tensor, bits: int = 4, group: int = 128, symmetric: bool = True):
    """Round-to-nearest quantization of a float weight (N, K) (reference, torch): ``(w_int, scales, zeros)``.

    Symmetric: ``s = amax / qmax`` per group (``qmax`` 7 or 127; 1 for an all-zero group),
    ``q = clamp(round(w / s), -qmax - 1, qmax)``, zeros None. Asymmetric (int4 only):
    ``s = (max - min) / 15`` (1 where max == min), ``z = clamp(round(-min / s), 0, 15)``,
    ``q = clamp(round(w / s) + z, 0, 15)``. ``group=0``: one scale per row. Scales are fp32, zeros int32;
    ``w_int`` is int8."""
    check_format(bits, group, not symmetric)
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"w must be a 2-D float tensor (N, K), got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    g = k if group == PER_CHANNEL else group
    if k % g:
        raise ValueError(f"K must be a multiple of the group size: K={k}, group={group}")
    blocks = w.to(torch.float32).reshape(n, k // g, g)
    if symmetric:
        qmax = (1 << (bits - 1)) - 1
        amax = blocks.abs().amax(-1)
        scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        q = torch.clamp(torch.round(blocks / scales.unsqueeze(-1)), -qmax - 1, qmax)
        zeros = None
    else:
        qmax = (1 << bits) - 1
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        scales = torch.where(hi > lo, (hi - lo) / qmax, torch.ones_like(hi))
        zeros = torch.clamp(torch.round(-lo / scales), 0, qmax)
        q = torch.clamp(torch.round(blocks / scales.unsqueeze(-1)) + zeros.unsqueeze(-1), 0, qmax)
        zeros = zeros.to(torch.int32)
    return q.reshape(n, k).to(torch.int8), scales, zeros
