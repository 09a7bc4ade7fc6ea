"""A compiler fence on register fragments (what CUTLASS C++ calls warpgroup_fence_operand).

WGMMA results are ordinary SSA values to LLVM, which does not know they are only valid after the
``wgmma.wait_group`` that retires them: it may move (sink or hoist) plain arithmetic on a fragment across
the wait and the next MMA batch, keeping old values alive in copies. ptxas then finds non-WGMMA
instructions touching the accumulators of in-flight MMAs and serializes every ``wgmma.mma_async`` of the
function (its C7514 "Potential Performance Loss" note), which makes promoted tiles far slower per K tile.
Passing each register through an empty, side-effecting inline asm pins its value at that point in program
order: the asm emits no instruction.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def pin_b32(x: Int32, *, loc=None, ip=None) -> Int32:
    """``x`` pinned at this point in program order: the compiler can neither sink its computation below it
    nor rematerialize it later (stage_release.py keeps per-thread constants out of the K loop with it)."""
    # "=r,0": the output is tied to the input register; side effects keep it ordered with the WGMMA ops.
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(x).ir_value(loc=loc, ip=ip)],
            "",
            "=r,0",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def fence_registers(frag: cute.Tensor):
    """Pin every 32-bit register of ``frag`` here: no access to it moves across this point."""
    words = cute.recast_tensor(frag, Int32)
    for i in cutlass.range(cute.size(words), unroll_full=True):
        words[i] = pin_b32(words[i])
