"""Which L2 promotion do the CuTe DSL's TMA descriptors carry? The DSL encodes them inline in its host code (a
compiled GEMM's shared library imports no ``cuTensorMapEncode*``) and exposes no setting for it. A one-thread
kernel copies a TMA atom's descriptor (A's, as the GEMM builds it: a 128 x 128 box, 128B swizzle) to global
memory; the host encodes the same tensor map through the driver once per L2 promotion and prints which bytes
differ.

    python3 -m benchmarks.tma_descriptor_probe

Session 27 (H100, driver of the lent image): the driver moves only bits 1-2 of byte 10 with the promotion (0x0
none, 0x2 64B, 0x4 128B, 0x6 256B). The DSL's byte 10 is 0x24: 128B in those bits, as CUTLASS's C++
``make_tma_copy`` sets it. (Its bit 5 and bytes 8, 65 and 73 also differ from the driver's encoding at every
promotion: fields not identified.)
"""

from __future__ import annotations

import ctypes

import torch
import cutlass
import cutlass.cute as cute
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

PROMOTIONS = ("none", "64B", "128B", "256B")  # CUtensorMapL2promotion 0..3


@cute.kernel
def _copy_descriptor(tma_atom: cute.CopyAtom, dst: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        cute.nvgpu.cpasync.copy_tensormap(tma_atom, dst.iterator)


@cute.jit
def _probe(mA: cute.Tensor, dst: cute.Tensor, stream):
    smem = sm90_utils.make_smem_layout_a(LayoutEnum.from_tensor(mA), (128, 128, 128),
                                         cutlass.Float8E4M3FN, 1)
    tma, _ = cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), mA,
                                                    cute.slice_(smem, (None, None, 0)), (128, 128))
    _copy_descriptor(tma, dst).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)


def dsl_descriptor(a: torch.Tensor) -> bytes:
    fake_a = make_fake_compact_tensor(cutlass.Float8E4M3FN, (cute.sym_int(), cute.sym_int(divisibility=16)),
                                      stride_order=(1, 0), assumed_align=16)
    fake_dst = make_fake_compact_tensor(cutlass.Int32, (32,), assumed_align=128)
    fn = cute.compile(_probe, fake_a, fake_dst, make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
    dst = torch.zeros(32, dtype=torch.int32, device=a.device)
    fn(a, dst)
    torch.cuda.synchronize()
    return dst.cpu().numpy().tobytes()


def driver_descriptor(a: torch.Tensor, l2_promotion: int) -> bytes:
    """The driver's encoding of A's tensor map (uint8 elements, dims (K, M), 128 x 128 box, 128B swizzle)."""
    m, k = a.shape
    encode = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    desc = (ctypes.c_uint8 * 128)()
    rc = encode(ctypes.byref(desc), ctypes.c_int(0), ctypes.c_uint(2), ctypes.c_void_p(a.data_ptr()),
                (ctypes.c_uint64 * 2)(k, m), (ctypes.c_uint64 * 1)(k), (ctypes.c_uint32 * 2)(128, 128),
                (ctypes.c_uint32 * 2)(1, 1), ctypes.c_int(0), ctypes.c_int(3), ctypes.c_int(l2_promotion),
                ctypes.c_int(0))
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled returned {rc}")
    return bytes(desc)


def main():
    a = torch.randint(-2, 3, (1024, 7168), device="cuda").to(torch.float8_e4m3fn)
    dsl = dsl_descriptor(a)
    base = driver_descriptor(a, 0)
    for promo, name in enumerate(PROMOTIONS):
        drv = driver_descriptor(a, promo)
        moved = [(i, hex(base[i]), hex(drv[i])) for i in range(128) if drv[i] != base[i]]
        differ = [i for i in range(128) if drv[i] != dsl[i]]
        print(f"driver, L2 promotion {name:4s}: bytes that move against 'none' {moved}; bytes that differ from the "
              f"DSL's {differ}")
    print("byte 10: DSL", hex(dsl[10]), "| driver", [hex(driver_descriptor(a, p)[10]) for p in range(4)])
    print("DSL descriptor:", dsl.hex())


if __name__ == "__main__":
    main()
