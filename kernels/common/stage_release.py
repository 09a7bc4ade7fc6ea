"""Consumers giving mainloop stages back to the producer CTA(s), with the per-thread part worked out once.

``PipelineTmaAsync.consumer_release`` decides per call which lane signals which CTA of the cluster (from the
thread index) and maps the stage's empty barrier into that CTA's shared window (``mapa``). The compiler
rematerializes all of it inside the K loop: ~8 SASS instructions per K tile on the consumer warps, whose
instruction issue is what paces the promoted main loops. Here the signalling lane and the mapped address of
stage 0's empty barrier are computed once, per thread, and pinned (so they are not sunk back into the loop);
a release is then one add and one predicated arrive.

The signalling rule is the pipeline's: lane ``l`` of each consumer warp arrives on the CTA of cluster rank
``l`` when that CTA multicast into this one (same cluster row for A, same column for W), so every producer
sees one arrival per consumer warp per CTA that shares its tiles -- the count the pipeline was created with.
"""

from __future__ import annotations

from dataclasses import dataclass

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .register_fence import pin_b32


@dsl_user_op
def _mapa_shared_cluster(addr: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
            "mapa.shared::cluster.u32 $0, $1, $2;",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def _arrive_if(addr: Int32, signals: Int32, remote: bool, *, loc=None, ip=None) -> None:
    space = "shared::cluster" if remote else "shared"
    llvm.inline_asm(
        None,
        [Int32(addr).ir_value(loc=loc, ip=ip), Int32(signals).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, $1, 0;\n"
        f"@p mbarrier.arrive.{space}.b64 _, [$0];\n}}",
        "r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dataclass(frozen=True)
class StageRelease:
    """Built once per consumer thread from a ``PipelineTmaAsync`` (see the module docstring). Frozen: the
    DSL lets immutable objects into run-time loops without carrying them."""

    empty0: Int32  # stage 0's empty barrier, mapped into the signalled CTA's window when clustered
    signals: Int32  # 1 on the lanes that arrive
    remote: bool

    @staticmethod
    def create(mainloop) -> "StageRelease":
        empty0 = mainloop.sync_object_empty.get_barrier(0).toint()
        dst_rank = mainloop.consumer_mask  # None for a one-CTA cluster
        remote = dst_rank is not None
        addr = _mapa_shared_cluster(empty0, dst_rank) if remote else Int32(empty0)
        return StageRelease(pin_b32(addr), pin_b32(Int32(mainloop.is_signaling_thread)), remote)

    def release(self, index):
        """Arrive on the empty barrier of stage ``index`` (8 bytes per barrier)."""
        _arrive_if(self.empty0 + index * 8, self.signals, self.remote)


@dataclass(frozen=True)
class ConsumerMainloop:
    """The consumer's view of a ``PipelineTmaAsync``: its waits, with releases through a ``StageRelease``."""

    pipeline: object
    stage_release: StageRelease

    @staticmethod
    def create(mainloop) -> "ConsumerMainloop":
        return ConsumerMainloop(mainloop, StageRelease.create(mainloop))

    def consumer_wait(self, state):
        self.pipeline.consumer_wait(state)

    def consumer_release(self, state):
        self.stage_release.release(state.index)
