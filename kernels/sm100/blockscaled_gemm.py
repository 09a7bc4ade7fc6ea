"""Blackwell (sm_100a) block-scaled GEMM: the scale-factor hooks of the f8f6f4 kernel.

The block-scaled GEMM *is* :class:`~.f8f6f4_gemm.Sm100F8F6F4Gemm` built with ``scaling=BlockScaling(kind)``:
same warps, pipelines, TMA operand loads, epilogue and tile scheduler. This module holds only what block
scaling adds, called by that kernel at four places (its class docstring marks them):

1. shared memory for the SFA / SFB tiles of every ``ab`` stage (:meth:`BlockScaling.allocate_smem`);
2. two more TMA loads per stage on the same ``ab`` barrier, counted in ``expect_tx``
   (:meth:`BlockScaling.make_tma_loads`, :meth:`BlockScaling.partition`, :meth:`BlockScaling.load`);
3. per K tile, ``tcgen05.cp`` of the stage's scales to tensor memory, then
   ``tcgen05.mma.kind::<kind>.block_scale`` instead of ``kind::f8f6f4`` (:meth:`BlockScaling.copy_scales`,
   :meth:`BlockScaling.mma`);
4. tensor-memory columns for the scales after the accumulators (:attr:`ScaleGeometry.tmem_cols`).

=========  ==============================  =========  ======  ===========  ===========================
kind       operands in shared memory       MMA K      scale   per scale    PTX
=========  ==============================  =========  ======  ===========  ===========================
mxf8f6f4   any f8f6f4 pair, 1 byte/elem    32         UE8M0   32 elems     ``.block_scale.block32``
mxf4       e2m1 x e2m1 packed, 2/byte      64         UE8M0   32 elems     ``.block_scale.block32``
mxf4nvf4   e2m1 x e2m1 packed, 2/byte      64         UE4M3   16 elems     ``.block_scale.block16``
=========  ==============================  =========  ======  ===========  ===========================

``block32`` / ``block16`` are the PTX ISA's current names of ``.scale_vec::1X`` (mxf8f6f4) and ``2X`` (mxf4),
and of ``4X`` (mxf4nvf4). Every kind reads 128 bytes of each operand row per K tile, so a K tile is 128
elements for mxf8f6f4 and 256 for the packed FP4 kinds, and the smem descriptors advance 32 bytes per MMA in
both cases.

Scale factors from global memory to the tensor core
====================================================
* Global: torch's SWIZZLE_32_4_4 blocked layout, 512-byte atoms of 128 rows x 4 scale columns; atom
  (row block r, column block c) starts at byte ``(r * col_atoms + c) * 512``; inside, row ``i`` scale ``j``
  is byte ``(i % 32) * 16 + (i // 32) * 4 + j``. The kernel reads it as int32 words, a
  ``(128, col_atoms, row_atoms)`` tensor: 4-byte elements keep every TMA box dimension within 256.
* Shared memory, per stage: the ``row_atoms x k_atoms`` atoms of this CTA tile and K tile, stored
  ``[row atom][k atom][512 B]`` (one TMA box per operand).
* Tensor memory: ``tcgen05.cp.32x128b.warpx4`` moves one atom (32 smem rows of 16 B) to 4 columns of
  all 128 lanes; k atom ``ka`` / row atom ``ra`` land at column ``ka * 4 * row_atoms + ra * 4`` past the
  scale base. The MMA of K step ``kb`` reads scale column ``i = kb * mma_k / sf_vec``: column block
  ``i // 4``, byte ``i % 4``. That byte is the instruction descriptor's scale-factor id (bits 29-30 for A,
  4-5 for B) and also sits in bits 30-31 of the scale TMEM address, the encoding CUTLASS and the DSL's
  own block-scaled kernels pass (the PTX of the DSL's ``dense_blockscaled_gemm_persistent`` example shows
  the same addresses; tests pin both).

2-CTA (``cta_group::2``, MMA 256 x N): each CTA loads the SFA of its own 128 rows and the whole SFB tile
(both CTAs need all N scales); both loads signal the leader CTA's barrier, whose ``expect_tx`` counts the
pair. The leader's ``tcgen05.cp.cta_group::2`` copies each CTA's smem into its own TMEM.

Compile-verified for sm_100a (the compile-tier tests read its PTX); run with ``pytest -m blackwell`` on a B200.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.experimental import primitives as prims

SF_ATOM_ROWS = 128
SF_ATOM_COLS = 4  # scale columns (K blocks) per atom
SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS
SF_ATOM_WORDS = SF_ATOM_BYTES // 4
TILE_K_BYTES = 128  # bytes of each operand row per K tile (one 128B swizzle row), as the dense kernel
MMAS_PER_TILE = 4


@dataclass(frozen=True)
class KindInfo:
    """Static facts of one block-scaled MMA kind (PTX ISA, tcgen05.mma block scaling)."""

    mma_kind: prims.Tcgen05MMAKind
    mma_k: int  # K elements per instruction
    block_scale: object  # PTX .block32 / .block16 selector
    sf_vec: int  # K elements per scale factor
    scale_format: int  # instruction-descriptor scale type: 1 = UE8M0, 0 = UE4M3
    smem_bits: int  # bits per element in shared memory (sub-byte f8f6f4 operands are unpacked to 8)

    @property
    def packed_fp4(self) -> bool:
        return self.smem_bits == 4


KINDS = {
    "mxf8f6f4": KindInfo(prims.Tcgen05MMAKind.MXF8F6F4, 32, prims.Tcgen05MMAScaleVecSize.BLOCK32, 32, 1, 8),
    "mxf4": KindInfo(prims.Tcgen05MMAKind.MXF4, 64, prims.Tcgen05MMAScaleVecSize.BLOCK32, 32, 1, 4),
    "mxf4nvf4": KindInfo(prims.Tcgen05MMAKind.MXF4NVF4, 64, prims.Tcgen05MMAScaleVecSize.BLOCK16, 16, 0, 4),
}


def _kind(kind: str) -> KindInfo:
    if kind not in KINDS:
        raise ValueError(f"block-scaled kind must be one of {sorted(KINDS)}; got {kind!r}")
    return KINDS[kind]


def mx_idesc(kind: str, m: int, n: int) -> int:
    """Compile-time part of the block-scaled instruction descriptor (K-major A and B, scale ids 0).

    mxf8f6f4 leaves ``a_format`` / ``b_format`` (bits 7-9 / 10-12) zero for the run-time codes; the FP4
    kinds fix both to E2M1 (code 1 in their encoding). Bit 12 stays clear: on sm_100 it is reserved for
    these kinds (CUTLASS's ``InstrDescriptorBlockScaled`` and the DSL's own kernels leave it 0; the DSL
    builder's ``sparsity_version`` default of 1 targets later architectures).
    """
    info = _kind(kind)
    if info.packed_fp4:
        d = prims.Tcgen05MxOmmaInstrDesc.build(
            a_dtype=cutlass.Float4E2M1FN, b_dtype=cutlass.Float4E2M1FN, scale_format=info.scale_format,
            n_dim=n, m_dim=m, sparsity_version=0,
        )
    else:
        d = prims.Tcgen05MxInstrDesc.build(
            a_dtype=cutlass.Float8E4M3FN, b_dtype=cutlass.Float8E4M3FN, scale_format=info.scale_format,
            n_dim=n, m_dim=m,
        )
    return int(d)


def scale_slot(kind: str, kb: int) -> tuple:
    """(column block, byte) of the scales MMA K step ``kb`` of a K tile reads (see the module doc)."""
    info = _kind(kind)
    i = kb * (info.mma_k // info.sf_vec)
    return i // SF_ATOM_COLS, i % SF_ATOM_COLS


def _signed32(v: int) -> int:
    return v - (1 << 32) if v >= 1 << 31 else v


@dataclass(frozen=True)
class ScaleGeometry:
    """Sizes that depend only on the configuration: smem per stage, TMA boxes, TMEM columns (CPU-testable)."""

    kind: str
    tile_n: int
    use_2cta: bool

    def __post_init__(self):
        _kind(self.kind)
        if self.tile_n != 128:
            raise ValueError(
                f"the block-scaled GEMM is built with tile_n=128 (one 128-row scale atom of B per tile and "
                f"two accumulators plus scales within 512 TMEM columns); got tile_n={self.tile_n}"
            )

    @property
    def info(self) -> KindInfo:
        return KINDS[self.kind]

    @property
    def tile_k(self) -> int:
        """K elements per K tile: 128 bytes of each operand row."""
        return TILE_K_BYTES * 8 // self.info.smem_bits

    @property
    def k_atoms(self) -> int:
        return self.tile_k // self.info.sf_vec // SF_ATOM_COLS

    rows_a_atoms = 1  # a CTA tile has 128 rows of A in both CTA modes

    @property
    def rows_b_atoms(self) -> int:
        # all tile_n rows of SFB, also in 2-CTA mode where each CTA loads only half of B itself
        return self.tile_n // SF_ATOM_ROWS

    @property
    def sfa_stage_bytes(self) -> int:
        return SF_ATOM_BYTES * self.k_atoms * self.rows_a_atoms

    @property
    def sfb_stage_bytes(self) -> int:
        return SF_ATOM_BYTES * self.k_atoms * self.rows_b_atoms

    @property
    def sfa_tmem_cols(self) -> int:
        return SF_ATOM_COLS * self.k_atoms * self.rows_a_atoms

    @property
    def sfb_tmem_cols(self) -> int:
        return SF_ATOM_COLS * self.k_atoms * self.rows_b_atoms

    def copy_plan(self, rows_atoms: int) -> list:
        """(smem byte offset in the stage, TMEM column offset) of every atom one operand's scales copy:
        smem ``[row atom][k atom]``, TMEM k atom ``ka`` at ``ka * 4 * rows_atoms``, row atom at ``+ 4 ra``."""
        return [((ra * self.k_atoms + ka) * SF_ATOM_BYTES, (ka * rows_atoms + ra) * SF_ATOM_COLS)
                for ra in range(rows_atoms) for ka in range(self.k_atoms)]

    def tmem_cols(self, acc_cols: int) -> int:
        """Columns to allocate: accumulators, then SFA, then SFB, rounded to a power of two (>= 32)."""
        need = acc_cols + self.sfa_tmem_cols + self.sfb_tmem_cols
        cols = 32
        while cols < need:
            cols *= 2
        if cols > 512:
            raise ValueError(f"{need} TMEM columns needed, 512 exist")
        return cols

    def scale_tmem_offsets(self, kb: int) -> tuple:
        """(SFA offset, SFB offset, byte) for MMA step ``kb``: column offsets from each scale base with the
        byte in bits 30-31, as signed 32-bit values (they are added to a TMEM address)."""
        block, byte = scale_slot(self.kind, kb)
        a = block * SF_ATOM_COLS * self.rows_a_atoms + (byte << 30)
        b = block * SF_ATOM_COLS * self.rows_b_atoms + (byte << 30)
        return _signed32(a), _signed32(b), byte

    def sf_id_bits(self, kb: int) -> int:
        """Instruction-descriptor scale-factor ids of MMA step ``kb`` (A at bits 29-30, B at 4-5)."""
        byte = scale_slot(self.kind, kb)[1]
        return (byte << 29) | (byte << 4)


class BlockScaling:
    """Scale-factor hooks for one kind; ``Sm100F8F6F4Gemm(scaling=BlockScaling(kind))`` switches them on.

    Holds only compile-time values; every method is called while the kernel is traced.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.info = _kind(kind)

    def configure(self, tile_n: int, use_2cta: bool, m: int) -> None:
        """Called by the kernel's constructor; one BlockScaling serves one kernel configuration."""
        geom = ScaleGeometry(self.kind, tile_n, use_2cta)
        if getattr(self, "geom", geom) != geom:
            raise ValueError(f"this BlockScaling is already configured for {self.geom}; make one per kernel")
        self.geom = geom
        self.tile_k = self.geom.tile_k
        self.packed_fp4 = self.info.packed_fp4
        self.cta_group = prims.CTAGroup.CTA_2 if use_2cta else prims.CTAGroup.CTA_1
        self.tma_op = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.TWO if use_2cta else tcgen05.CtaGroup.ONE)
        self.idesc_static = mx_idesc(self.kind, m, tile_n)

    @property
    def stage_bytes(self) -> int:
        return self.geom.sfa_stage_bytes + self.geom.sfb_stage_bytes

    # ---------------------------------------------------------------- host (trace) side

    def _box(self, rows_atoms: int):
        return (SF_ATOM_WORDS, self.geom.k_atoms, rows_atoms)

    def _smem_layout(self, rows_atoms: int, stages: int):
        return cute.make_layout((*self._box(rows_atoms), stages))

    @staticmethod
    def _global_view(t: cute.Tensor) -> cute.Tensor:
        """(row_atoms, col_atoms * 128) int32 words -> (128 words, col_atoms, row_atoms)."""
        row_atoms, words = t.shape
        layout = cute.make_layout((SF_ATOM_WORDS, words // SF_ATOM_WORDS, row_atoms),
                                  stride=(1, SF_ATOM_WORDS, t.layout.stride[0]))
        return cute.make_tensor(t.iterator, layout)

    def make_tma_loads(self, sfa: cute.Tensor, sfb: cute.Tensor):
        """Hook 2 (host): ((atom SFA, tensor SFA), (atom SFB, tensor SFB))."""
        out = []
        for t, rows in ((sfa, self.geom.rows_a_atoms), (sfb, self.geom.rows_b_atoms)):
            smem = cute.make_layout(self._box(rows))
            atom, tensor = cpasync.make_tiled_tma_atom(self.tma_op, self._global_view(t), smem, self._box(rows))
            out.append((atom, tensor))
        return out

    # ---------------------------------------------------------------- device side

    def allocate_smem(self, smem, num_stages: int):
        """Hook 1: SFA and SFB buffers for every ``ab`` stage (allocated after the dense kernel's buffers)."""
        s_sfa = smem.allocate_tensor(
            element_type=Int32, layout=self._smem_layout(self.geom.rows_a_atoms, num_stages), byte_alignment=128
        )
        s_sfb = smem.allocate_tensor(
            element_type=Int32, layout=self._smem_layout(self.geom.rows_b_atoms, num_stages), byte_alignment=128
        )
        return s_sfa, s_sfb

    def partition(self, atom_sfa, m_sfa, s_sfa, atom_sfb, m_sfb, s_sfb):
        """Hook 2 (device): TMA views; index the results with ``[(None, stage)]`` and
        ``[(None, 0, k_tile, row_tile)]``."""
        out = []
        for atom, m, s, rows in ((atom_sfa, m_sfa, s_sfa, self.geom.rows_a_atoms),
                                 (atom_sfb, m_sfb, s_sfb, self.geom.rows_b_atoms)):
            g = cute.local_tile(m, self._box(rows), (None, None, None))
            out.append(cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 3),
                                             cute.group_modes(g, 0, 3)))
        return out

    def load(self, atom_sfa, atom_sfb, parts, stage, k_tile, row_tile_a, row_tile_b, barrier):
        """Hook 2 (TMA warp): this stage's SFA (own 128 rows) and SFB (the whole N tile) on the A/B barrier."""
        (s_sfa, g_sfa), (s_sfb, g_sfb) = parts
        cute.copy(atom_sfa, g_sfa[(None, 0, k_tile, row_tile_a)], s_sfa[(None, stage)], tma_bar_ptr=barrier)
        cute.copy(atom_sfb, g_sfb[(None, 0, k_tile, row_tile_b)], s_sfb[(None, stage)], tma_bar_ptr=barrier)

    def _copy_operand_scales(self, smem_stage: Int32, tmem_base: Int32, rows_atoms: int):
        # a plain Python loop: hooks are not preprocessed by the DSL, so it unrolls at trace time
        for smem_off, col in self.geom.copy_plan(rows_atoms):
            dst = cutlass.inttoptr(tmem_base + col, cutlass.AddressSpace.tmem, cutlass.Uint8)
            copy_scales_s2t(dst, smem_stage + smem_off, self.cta_group)

    def copy_scales(self, sfa_smem: Int32, sfb_smem: Int32, stage: Int32, sfa_tmem: Int32, sfb_tmem: Int32):
        """Hook 3a (MMA warp, one thread): the stage's scales smem -> TMEM. The same thread's later
        tcgen05.mma are ordered after these copies, and its tcgen05.commit covers them when the stage
        is released."""
        self._copy_operand_scales(sfa_smem + stage * self.geom.sfa_stage_bytes, sfa_tmem, self.geom.rows_a_atoms)
        self._copy_operand_scales(sfb_smem + stage * self.geom.sfb_stage_bytes, sfb_tmem, self.geom.rows_b_atoms)

    def runtime_idesc(self, fmt_a: Int32, fmt_b: Int32):
        """Descriptor with the run-time operand format codes (only mxf8f6f4 has a choice)."""
        if self.info.packed_fp4:
            return Int32(self.idesc_static)
        return Int32(self.idesc_static) | (fmt_a << 7) | (fmt_b << 10)

    def mma(self, kb: int, acc_tmem, desc_a, desc_b, idesc, accumulate, sfa_tmem: Int32, sfb_tmem: Int32):
        """Hook 3b (MMA warp, one thread): MMA step ``kb`` of the K tile with its scale ids."""
        off_a, off_b, _ = self.geom.scale_tmem_offsets(kb)
        issue_block_scaled_mma(
            self.kind, self.cta_group, acc_tmem, desc_a, desc_b, idesc | self.geom.sf_id_bits(kb), accumulate,
            cutlass.inttoptr(sfa_tmem + off_a, cutlass.AddressSpace.tmem, cutlass.Uint8),
            cutlass.inttoptr(sfb_tmem + off_b, cutlass.AddressSpace.tmem, cutlass.Uint8),
        )


def copy_scales_s2t(sf_tmem, sf_smem_addr, cta_group=prims.CTAGroup.CTA_1):
    """``tcgen05.cp.32x128b.warpx4`` of one 512-byte scale atom (32 rows x 16 B) to 4 TMEM columns.

    No swizzle; 8-row groups of 16-byte rows are 128 B apart (SBO). One 16-byte core matrix spans the
    copied width, so the leading offset is not used; it is 16 B, the value the DSL's own block-scaled
    kernels put in this descriptor (LBO field 1, SBO field 8, version 1).
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


def describe_scale_tma(kind: str, use_2cta: bool = False, tile_n: int = 128) -> dict:
    """Trace only the scale TMA setup; per operand ("sfa", "sfb") the atom's IR type, which names the
    data format, the box's bits and its basis over the (words, column atoms, row atoms) view."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    scaling = BlockScaling(kind)
    scaling.configure(tile_n, use_2cta, 256 if use_2cta else 128)
    found = {}

    @cute.jit
    def probe(sfa: cute.Tensor, sfb: cute.Tensor):
        for name, (atom, _) in zip(("sfa", "sfb"), scaling.make_tma_loads(sfa, sfb)):
            found[name] = str(atom._trait.value.type)

    def words():
        shape = (cute.sym_int(), cute.sym_int(divisibility=SF_ATOM_WORDS))
        return make_fake_compact_tensor(Int32, shape, stride_order=(1, 0), assumed_align=16)

    cute.compile(probe, words(), words())
    return found
