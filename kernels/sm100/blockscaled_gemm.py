"""Blackwell block-scaled GEMM pieces: ``tcgen05.mma.kind::{mxf8f6f4,mxf4,mxf4nvf4}.block_scale``.

STATUS (read this first): the block-scaled GEMM is meant to be the f8f6f4 GEMM
(``f8f6f4_gemm.Sm100F8F6F4Gemm``) plus scale factors, not a fork of it. What lives here today is
everything the block-scaled variant adds, written as hooks that kernel can call:

* :data:`KINDS`: per kind, the MMA K per instruction, scale-vector selector, scale format and how the
  operands sit in shared memory;
* :func:`mx_idesc`: the block-scaled instruction descriptor (a different bit layout from the dense
  one: scale format, scale-factor ids, ``m_dim = M >> 7``); operand formats OR-ed in at run time exactly
  like the dense kernel does;
* :func:`copy_scales_s2t`: ``tcgen05.cp.32x128b.warpx4`` of one 128-row x 16-byte scale chunk from
  shared to tensor memory (the SWIZZLE_32_4_4 atom is precisely this chunk: 32 rows x 16 bytes,
  replicated to the four 32-lane sub-partitions by ``warpx4``);
* :func:`issue_block_scaled_mma`: the MMA itself, scale factors read from TMEM.

:class:`BlockScaledMmaProbe` is a compile-only kernel that strings these hooks together (scales
smem -> TMEM, one block-scaled MMA per K step) so the PTX of every kind can be checked on a machine
without a GPU. It is *not* a GEMM and must never be launched. :func:`launch` raises until the
f8f6f4 skeleton exposes the hooks listed in its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.experimental import primitives as prims

MMA_FORMAT_CODE = {"e4m3": 0, "e5m2": 1, "e2m3": 3, "e3m2": 4, "e2m1": 5}  # same codes as kind::f8f6f4


@dataclass(frozen=True)
class KindInfo:
    """Static facts of one block-scaled MMA kind (PTX ISA, tcgen05.mma block scaling)."""

    mma_kind: prims.Tcgen05MMAKind
    mma_k: int  # K elements per instruction
    block_scale: object  # PTX .block32 / .block16: K elements per scale factor (= .scale_vec::1X/2X and 4X)
    sf_vec: int  # elements per scale factor
    scale_format: int  # MxScaleFormat: 1 = UE8M0, 0 = UE4M3
    smem_bits: int  # bits per element in shared memory (sub-byte f8f6f4 operands are unpacked to 8)
    omma_desc: bool  # NVFP4-capable FP4 descriptor layout (Tcgen05MxOmmaInstrDesc)


KINDS = {
    # any f8f6f4 pair, one UE8M0 per 32 K: K=32 per MMA, one scale byte per row per MMA
    "mxf8f6f4": KindInfo(prims.Tcgen05MMAKind.MXF8F6F4, 32, prims.Tcgen05MMAScaleVecSize.BLOCK32, 32, 1, 8, False),
    # packed E2M1 x E2M1, UE8M0 per 32: K=64 per MMA, two scale bytes per row per MMA
    "mxf4": KindInfo(prims.Tcgen05MMAKind.MXF4, 64, prims.Tcgen05MMAScaleVecSize.BLOCK32, 32, 1, 4, True),
    # packed E2M1 x E2M1, UE4M3 per 16: K=64 per MMA, four scale bytes per row per MMA
    "mxf4nvf4": KindInfo(prims.Tcgen05MMAKind.MXF4NVF4, 64, prims.Tcgen05MMAScaleVecSize.BLOCK16, 16, 0, 4, True),
}


def mx_idesc(kind: str, m: int, n: int) -> int:
    """Compile-time part of the block-scaled instruction descriptor (K-major A and B, formats zero).

    ``a_format`` (bits 7-9) and ``b_format`` (bits 10-12) are OR-ed in at run time for ``mxf8f6f4``
    (see :func:`runtime_idesc`); the FP4 kinds fix both to E2M1.
    """
    info = KINDS[kind]
    if info.omma_desc:
        d = prims.Tcgen05MxOmmaInstrDesc.build(
            a_dtype=cutlass.Float4E2M1FN, b_dtype=cutlass.Float4E2M1FN, scale_format=info.scale_format,
            n_dim=n, m_dim=m,
        )
    else:
        d = prims.Tcgen05MxInstrDesc.build(
            a_dtype=cutlass.Float8E4M3FN, b_dtype=cutlass.Float8E4M3FN, scale_format=info.scale_format,
            n_dim=n, m_dim=m,
        )
    return int(d)


def runtime_idesc(static_idesc: int, kind: str, fmt_a: Int32, fmt_b: Int32):
    """Descriptor with the run-time operand format codes (only mxf8f6f4 has a choice)."""
    if kind == "mxf8f6f4":
        return Int32(static_idesc) | (fmt_a << 7) | (fmt_b << 10)
    return Int32(static_idesc)


def copy_scales_s2t(sf_tmem, sf_smem_addr, cta_group=prims.CTAGroup.CTA_1):
    """SMEM -> TMEM copy of one 128-row x 16-byte scale chunk (one SWIZZLE_32_4_4 atom column group).

    The atom stores 32 rows x 16 bytes (row r%32 holds the bytes of rows r%32 + 32*j, 4 columns each);
    ``.32x128b.warpx4`` copies those 32 x 128 bits to all four 32-lane TMEM sub-partitions, which is the
    scale-factor layout tcgen05.mma reads. No swizzle, the 16-byte rows are contiguous (LBO/SBO 16 B).
    """
    desc = prims.Tcgen05SmemDesc.build(
        start_address=Int32(sf_smem_addr),
        leading_byte_offset=16,
        stride_byte_offset=128,
        layout=prims.Tcgen05SmemSwizzle.NONE,
    )
    prims.tcgen05_cp(
        prims.Tcgen05CpShape.SHAPE_32X128B, sf_tmem, desc, group=cta_group, multicast=prims.Tcgen05CpMulticast.WARPX4
    )


def issue_block_scaled_mma(kind: str, cta_group, acc_tmem, desc_a, desc_b, idesc, accumulate, sfa_tmem, sfb_tmem):
    """One ``tcgen05.mma.cta_group::N.kind::<kind>.block_scale`` (call under ``elect_one``)."""
    info = KINDS[kind]
    prims.tcgen05_mma_block_scale(
        info.mma_kind, cta_group, acc_tmem, desc_a, desc_b, idesc, accumulate, sfa_tmem, sfb_tmem,
        # named explicitly: the wrapper maps the legacy X2/X4 selectors to block16/block32 the other way
        # round from the PTX ISA (mxf4 .scale_vec::2X == .block32, mxf4nvf4 .scale_vec::4X == .block16)
        scale_vec_size=info.block_scale,
    )


def k_major_sw128_desc(addr):
    """K-major 128B-swizzled operand descriptor (8-row core groups 1024 B apart), as the f8f6f4 kernel."""
    return prims.Tcgen05SmemDesc.build(
        start_address=Int32(addr), leading_byte_offset=16, stride_byte_offset=1024,
        layout=prims.Tcgen05SmemSwizzle.SWIZZLE_128B,
    )


class BlockScaledMmaProbe:
    """Compile-only instruction probe for one kind (NOT a GEMM; never launch it).

    ========  ==========================================================================
    warp      work
    ========  ==========================================================================
    0         elect one thread: for each of ``k_steps`` MMA K steps, ``tcgen05.cp`` the A and B
              scale chunks (smem -> TMEM), then one block-scaled ``tcgen05.mma`` into the
              accumulator; ``tcgen05.commit`` to an mbarrier
    ========  ==========================================================================

    No pipelines, no stages: addresses are kernel arguments, so the PTX shows exactly the instruction
    forms the merged GEMM's MMA warp will issue per K tile.
    """

    def __init__(self, kind: str, m: int = 128, n: int = 128, k_steps: int = 4):
        self.kind = kind
        self.info = KINDS[kind]
        self.m, self.n, self.k_steps = m, n, k_steps
        self.idesc_static = mx_idesc(kind, m, n)

    @cute.kernel
    def kernel(self, tmem_acc: Int32, tmem_sfa: Int32, tmem_sfb: Int32, smem_a: Int32, smem_b: Int32,
               smem_sfa: Int32, smem_sfb: Int32, mbar: Int32, fmt_a: Int32, fmt_b: Int32):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        acc = cutlass.inttoptr(tmem_acc, cutlass.AddressSpace.tmem, cutlass.Float32)
        idesc = runtime_idesc(self.idesc_static, self.kind, fmt_a, fmt_b)
        kbytes = self.info.mma_k * self.info.smem_bits // 8  # bytes of one MMA K step along a swizzled row
        if warp == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(self.k_steps):
                    # one 16-byte scale column group per 128 rows covers 4 scale bytes per row, i.e. 128 K
                    # (MX) or 64 K (NVFP4); the chunk index advances once per 4 scale columns
                    sfa = cutlass.inttoptr(tmem_sfa + s * 4, cutlass.AddressSpace.tmem, cutlass.Uint8)
                    sfb = cutlass.inttoptr(tmem_sfb + s * 4, cutlass.AddressSpace.tmem, cutlass.Uint8)
                    copy_scales_s2t(sfa, smem_sfa + s * 512)
                    copy_scales_s2t(sfb, smem_sfb + s * 512)
                    issue_block_scaled_mma(
                        self.kind, prims.CTAGroup.CTA_1, acc, k_major_sw128_desc(smem_a + s * kbytes),
                        k_major_sw128_desc(smem_b + s * kbytes), idesc, s > 0, sfa, sfb,
                    )
                prims.tcgen05_commit(cutlass.inttoptr(mbar, cutlass.AddressSpace.smem, cutlass.Int64))

    @cute.jit
    def __call__(self, tmem_acc: Int32, tmem_sfa: Int32, tmem_sfb: Int32, smem_a: Int32, smem_b: Int32,
                 smem_sfa: Int32, smem_sfb: Int32, mbar: Int32, fmt_a: Int32, fmt_b: Int32,
                 anchor: cute.Tensor, stream):
        # ``anchor`` is a device tensor only so the TVM-FFI entry can find the environment stream
        self.kernel(tmem_acc, tmem_sfa, tmem_sfb, smem_a, smem_b, smem_sfa, smem_sfb, mbar, fmt_a, fmt_b).launch(
            grid=[1, 1, 1], block=[128, 1, 1], stream=stream)


def compile_probe(kind: str, keep_ptx: bool = True):
    """Compile :class:`BlockScaledMmaProbe` (``CUTE_DSL_ARCH=sm_100a`` works without a GPU)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    probe = BlockScaledMmaProbe(kind)
    args = [Int32(0)] * 10 + [make_fake_compact_tensor(Int32, (1,), assumed_align=4)]
    opts = "--enable-tvm-ffi" + (" --keep-ptx" if keep_ptx else "")
    return cute.compile(probe, *args, make_fake_stream(use_tvm_ffi_env_stream=True), options=opts)


def launch(problem, *, bias=None, out_dtype=None):
    """The block-scaled GEMM launch. Not available yet: see the module docstring.

    It needs these hooks in ``f8f6f4_gemm.Sm100F8F6F4Gemm`` (owned by the f8f6f4 GEMM):
    (1) extra shared-memory buffers per ``ab`` stage for the SFA/SFB tiles and their TMA bytes in the
    stage's ``expected_tx``; (2) a TMA-warp hook issuing the two scale-tile loads next to A/B;
    (3) an MMA-warp hook replacing the dense ``tcgen05_mma`` call (scale copies + block-scaled MMA,
    i.e. :func:`copy_scales_s2t` + :func:`issue_block_scaled_mma`) and the MMA K per kind (64 for FP4
    kinds, whose operands stay packed in smem); (4) TMEM columns for the scale factors next to the
    accumulators; the epilogue's ``alpha = scale_a[0] * scale_b[0]`` already takes NVFP4's device
    global scales unchanged.
    """
    raise NotImplementedError(
        f"the sm_100 block-scaled GEMM ({problem.config.kind}) is not assembled yet: it extends the f8f6f4 "
        "GEMM skeleton, which does not expose the scale-factor hooks it needs (see "
        "cutedsl_gemm.kernels.sm100.blockscaled_gemm.launch). Use "
        "cutedsl_gemm.sm100_blockscaled.reference_blockscaled_mm for a result."
    )
