"""The promoted main loops of the Hopper FP8 GEMM (mixed into ``Sm90Fp8Gemm``).

Promoted accumulation runs each 128-deep K tile into a fresh fp32 fragment (the first K block's MMA with
ACCUMULATE off) and adds it into the accumulator -- scaled by the K tile's block scales for the block-scaled
recipes (``block_scales.TileScales``). Which loop a kernel runs is fixed at trace time by its tile:

| loop | tiles | K-tile fragments | what runs on the tensor cores while a warp group promotes |
|---|---|---|---|
| ``_mainloop_promoted`` | up to 144 wide | two, alternating | its next K tile |
| ``_mainloop_split_n`` | 192 wide, DeepSeek recipe | two N halves | the other half, or the next K tile's first half |
| ``_mainloop_serial_ahead`` | 192 wide, other per-block W scales | one | the other warp group's MMAs only |
| ``_mainloop_promoted_serial`` | 192 wide, the rest | one | the other warp group's MMAs only |

All take the mainloop pipeline's read / release states and return them advanced past the tile's K tiles.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..common.register_fence import fence_registers, pin_b32


class PromotedMainloops:
    """Consumer main loops with promoted accumulation; state lives in the caller's registers, so the mixin
    has no fields of its own."""

    @cute.jit
    def _mainloop_promoted(
        self, mmas, acc, temps, tCrA, tCrB, mainloop, read_state, release_state, k_tiles, scales
    ):
        """acc = sum over K tiles of scale_t * (A_tile @ W_tile^T), each K tile in a fresh fragment.

        ``scale_t`` is 1 for the epilogue-scaled recipes and the K tile's block scales otherwise. Two
        fragments alternate so the tensor cores never wait for a promotion: while K tile t runs into one,
        K tile t-1 (already retired: wait_group(1)) is added from the other into ``acc``. The loop is
        unrolled by two because register fragments cannot be indexed at run time.
        """
        num_k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        self._wait_k_tile(mainloop, read_state, scales, 0)
        self._issue_k_tile(mmas, temps[0], tCrA, tCrB, read_state.index, num_k_blocks)
        read_state.advance()
        return self._alternate_slots(self._overlapped_step, self._overlapped_drain, mmas, acc, temps, tCrA, tCrB,
                                     mainloop, read_state, release_state, k_tiles, num_k_blocks, scales)

    @cute.jit
    def _alternate_slots(
        self, step: cutlass.Constexpr, drain: cutlass.Constexpr, mmas, acc, temps, tCrA, tCrB, mainloop,
        read_state, release_state, k_tiles, num_k_blocks: cutlass.Constexpr, scales,
    ):
        """A two-slot promoted loop after its first K tile: ``step`` for each further K tile, alternating
        register slots 1 and 0 (unrolled by two: register fragments cannot be indexed at run time), then
        ``drain`` of the slot the last K tile used."""
        for _ in cutlass.range((k_tiles - 1) // 2, unroll=1):
            read_state, release_state = step(
                mmas, acc, temps, 1, tCrA, tCrB, mainloop, read_state, release_state, num_k_blocks, scales
            )
            read_state, release_state = step(
                mmas, acc, temps, 0, tCrA, tCrB, mainloop, read_state, release_state, num_k_blocks, scales
            )
        if (k_tiles - 1) % 2 == 1:
            read_state, release_state = step(
                mmas, acc, temps, 1, tCrA, tCrB, mainloop, read_state, release_state, num_k_blocks, scales
            )
            release_state = drain(acc, temps, 1, mainloop, release_state, scales)
        else:
            release_state = drain(acc, temps, 0, mainloop, release_state, scales)
        return read_state, release_state

    @cute.jit
    def _overlapped_step(
        self, mmas, acc, temps, slot: cutlass.Constexpr, tCrA, tCrB, mainloop, read_state, release_state,
        num_k_blocks: cutlass.Constexpr, scales,
    ):
        """Issue the next K tile into fragment ``slot``, then retire the previous one from the other."""
        self._wait_k_tile(mainloop, read_state, scales, slot)
        self._issue_k_tile(mmas, temps[slot], tCrA, tCrB, read_state.index, num_k_blocks)
        read_state.advance()
        cute.nvgpu.warpgroup.wait_group(1)
        release_state = self._retire(acc, temps, 1 - slot, mainloop, release_state, scales)
        return read_state, release_state

    @cute.jit
    def _overlapped_drain(self, acc, temps, slot: cutlass.Constexpr, mainloop, release_state, scales):
        """Retire and promote the last K tile (fragment ``slot``)."""
        cute.nvgpu.warpgroup.wait_group(0)
        return self._retire(acc, temps, slot, mainloop, release_state, scales)

    @cute.jit
    def _mainloop_promoted_serial(
        self, mmas, acc, temps, tCrA, tCrB, mainloop, read_state, release_state, k_tiles, scales
    ):
        """As _mainloop_promoted with a single K-tile fragment: each K tile is retired (wait_group(0))
        and promoted before the next is issued; the other warp group's (or CTA's) MMAs fill the gap."""
        num_k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        for _ in cutlass.range(k_tiles, unroll=1):
            self._wait_k_tile(mainloop, read_state, scales, 0)
            self._issue_k_tile(mmas, temps[0], tCrA, tCrB, read_state.index, num_k_blocks)
            read_state.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            release_state = self._retire(acc, temps, 0, mainloop, release_state, scales)
        return read_state, release_state

    @cute.jit
    def _mainloop_serial_ahead(
        self, mmas, acc, temps, tCrA, tCrB, mainloop, read_state, release_state, k_tiles, scales
    ):
        """_mainloop_promoted_serial with each K tile's scales read from its stage while the K tile before it
        runs on the tensor cores, instead of between its full barrier and its MMA issue, where the products
        waiting on the shared-memory loads sit between the WGMMAs. Two register sets alternate, so the loop runs
        two K tiles per trip."""
        num_k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        mainloop.consumer_wait(read_state)
        scales.read_raw(0, read_state.index)
        for pair in cutlass.range(k_tiles // 2, unroll=1):
            read_state, release_state = self._serial_ahead_step(
                mmas, acc, temps, 0, tCrA, tCrB, mainloop, read_state, release_state, num_k_blocks, scales, True
            )
            read_state, release_state = self._serial_ahead_step(
                mmas, acc, temps, 1, tCrA, tCrB, mainloop, read_state, release_state, num_k_blocks, scales,
                2 * pair + 2 < k_tiles,
            )
        if k_tiles % 2 == 1:
            read_state, release_state = self._serial_ahead_step(
                mmas, acc, temps, 0, tCrA, tCrB, mainloop, read_state, release_state, num_k_blocks, scales, False
            )
        return read_state, release_state

    @cute.jit
    def _serial_ahead_step(
        self, mmas, acc, temps, slot: cutlass.Constexpr, tCrA, tCrB, mainloop, read_state, release_state,
        num_k_blocks: cutlass.Constexpr, scales, has_next,
    ):
        """Issue the K tile whose stage was waited for (scales in set ``slot``); if another follows, wait for
        its stage and read its scales into the other set; then retire and promote this K tile."""
        self._issue_k_tile(mmas, temps[0], tCrA, tCrB, read_state.index, num_k_blocks)
        read_state.advance()
        if has_next:
            mainloop.consumer_wait(read_state)
            scales.read_raw(1 - slot, read_state.index)
        cute.nvgpu.warpgroup.wait_group(0)
        return read_state, self._retire(acc, temps, 0, mainloop, release_state, scales, scale_slot=slot)

    @cute.jit
    def _mainloop_split_n(
        self, mmas, acc, temps, tCrA, tCrB, mainloop, read_state, release_state, k_tiles, scales
    ):
        """_mainloop_promoted_serial for tiles with room for one full K-tile fragment (192 wide), without its
        gaps: each K tile is issued as two N halves (two commit groups) into two half fragments; half 0 of K tile
        t-1 is promoted while its half 1 runs, its half 1 while K tile t's half 0 runs, so the warp group always
        has MMAs of its own queued while it promotes (the serial loop leaves the tensor cores to the other warp
        group then). A K tile's scales are read right after its half 0 is issued, never between its stage wait
        and its issue (ptxas places the products of scales read there between the WGMMAs). Two scale
        sets alternate (K tile t-1's are in use until its half 1 is promoted): unrolled by two. Only the DeepSeek
        recipe runs it (``Sm90GemmPlan.split_n_loop``), so ``scales`` always holds raw per-block scales."""
        num_k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        mainloop.consumer_wait(read_state)
        self._issue_k_tile(mmas, temps[0], tCrA, tCrB[0], read_state.index, num_k_blocks)
        self._issue_k_tile(mmas, temps[1], tCrA, tCrB[1], read_state.index, num_k_blocks)
        scales.read_raw(0, read_state.index)
        read_state.advance()
        return self._alternate_slots(self._split_n_step, self._split_n_drain, mmas, acc, temps, tCrA, tCrB,
                                     mainloop, read_state, release_state, k_tiles, num_k_blocks, scales)

    @cute.jit
    def _split_n_step(
        self, mmas, acc, temps, slot: cutlass.Constexpr, tCrA, tCrB, mainloop, read_state, release_state,
        num_k_blocks: cutlass.Constexpr, scales,
    ):
        """Retire and promote the previous K tile (scales in set 1 - slot) half by half, issuing the next K tile's
        halves in between (its scales into set ``slot``); the previous K tile's stage is released after its
        half 1 (the per-column W scales of its promotion are read from the stage)."""
        cute.nvgpu.warpgroup.wait_group(1)  # the previous K tile's half 0
        self._promote_half(acc, temps, 0, scales, 1 - slot, release_state.index)
        mainloop.consumer_wait(read_state)
        self._issue_k_tile(mmas, temps[0], tCrA, tCrB[0], read_state.index, num_k_blocks)
        scales.read_raw(slot, read_state.index)
        cute.nvgpu.warpgroup.wait_group(1)  # the previous K tile's half 1
        self._promote_half(acc, temps, 1, scales, 1 - slot, release_state.index)
        self._release_stage(mainloop, release_state)
        self._issue_k_tile(mmas, temps[1], tCrA, tCrB[1], read_state.index, num_k_blocks)
        read_state.advance()
        return read_state, release_state

    @cute.jit
    def _split_n_drain(self, acc, temps, slot: cutlass.Constexpr, mainloop, release_state, scales):
        """Retire and promote the last K tile (scales in set ``slot``) and release its stage."""
        cute.nvgpu.warpgroup.wait_group(1)
        self._promote_half(acc, temps, 0, scales, slot, release_state.index)
        cute.nvgpu.warpgroup.wait_group(0)
        self._promote_half(acc, temps, 1, scales, slot, release_state.index)
        self._release_stage(mainloop, release_state)
        return release_state

    @cute.jit
    def _promote_half(self, acc, temps, half: cutlass.Constexpr, scales, scale_slot: cutlass.Constexpr, stage):
        """acc[the half's elements] += temps[half], scaled; fenced as _retire fences a whole fragment."""
        frag = temps[half]
        n = cute.size(frag)
        base = half * n
        fence_registers(frag)
        scales.promote(acc, frag, scale_slot, stage, base)
        # The accumulator's half only, unrolled at trace time (fence_registers' run-time-unrolled loop over a
        # range gives the split kernels different PTX).
        words = cute.recast_tensor(acc, Int32)
        for i in cutlass.range_constexpr(n):
            words[base + i] = pin_b32(words[base + i])

    @cute.jit
    def _wait_k_tile(self, mainloop, read_state, scales, slot: cutlass.Constexpr):
        """Wait for the next K tile's stage; block-scaled, read its scales for fragment ``slot`` at once."""
        mainloop.consumer_wait(read_state)
        if cutlass.const_expr(scales is not None):
            scales.read(slot, read_state.index)

    @cute.jit
    def _retire(self, acc, temps, slot: cutlass.Constexpr, mainloop, release_state, scales,
                scale_slot: cutlass.Constexpr = None):
        """Add a finished K tile's fragment into ``acc`` and give its stage back to the producer (its scales
        in set ``scale_slot``, by default the fragment's)."""
        frag = temps[slot]
        # The fences keep the promotion between the wait_group that retired ``frag`` and the next MMA
        # batch; without them the compiler moved it and ptxas serialized every WGMMA (register_fence.py).
        fence_registers(frag)
        # Promote, then release in source order: per-column W scales are read from the stage. (ptxas hoists
        # the release arrive above the promotion's adds where nothing it reads is in the stage.)
        if cutlass.const_expr(scales is not None):
            scales.promote(acc, frag, slot if scale_slot is None else scale_slot, release_state.index)
        else:
            self._promote(acc, frag)
        fence_registers(acc)
        self._release_stage(mainloop, release_state)
        return release_state

    @cute.jit
    def _release_stage(self, mainloop, release_state):
        """Give a K tile's stage back to the producers and advance ``release_state``. Where A's scales may come by
        TMA, each thread first orders its shared-memory reads of the stage's scales before the TMA refill: they are
        generic-proxy reads and the refill an async-proxy write, which the stage's barriers alone do not order
        (without the fence the DeepSeek 64x192 pairs read wrong A scales)."""
        if cutlass.const_expr(self.a_scale_tma):
            cute.arch.fence_proxy("async.shared", space="cta")
        mainloop.consumer_release(release_state)
        release_state.advance()

    @cute.jit
    def _issue_k_tile(self, mmas, frag, tCrA, tCrB, stage, num_k_blocks: cutlass.Constexpr):
        """frag = A_tile @ W^T for one K tile as one commit group, W the tile's (``tCrB``) or, split in N, one
        half's (``tCrB[h]``, the MMAs then 64 x bN/2): the first K block overwrites, the rest accumulate."""
        # The fragment was just read by ordinary instructions (the promotion): fence first.
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(num_k_blocks):
            coord = (None, None, kb, stage)
            cute.gemm(mmas[0] if kb == 0 else mmas[1], frag, tCrA[coord], tCrB[coord], frag)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _promote(self, acc, frag):
        for i in cutlass.range(cute.size(acc), unroll_full=True):
            acc[i] = acc[i] + frag[i]
