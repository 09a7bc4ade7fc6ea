"""Every example runs where it is: on its GPU it runs its kernels; without one it compiles them for its arch and prints
what their PTX holds (the model example converts a tiny model instead), and exits 0. About 50 s for all seven on two
CPU cores."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: What each example prints without a GPU: the kernel it compiled, or what it converted.
WITHOUT_A_GPU = {
    "sm90_fp8_gemm.py": ("sm_90a_gemm_cooperative_row_e4m3xe4m3_bf16", "wgmma.mma_async"),
    "sm90_blockscaled_gemm.py": ("sm_90a_gemm_cooperative_1x128_128x128_e4m3xe4m3_bf16", "wgmma.mma_async"),
    "sm90_fused_quantization.py": ("sm_90a_quant_gemm_small_m_row_bf16xint8", "x int8 rounding, e.g. cvt.rni.s32.f32",
                                   "sm_90a_gemm_fp8_out_cooperative", "x e4m3 conversion, e.g. cvt.rn.satfinite"),
    "sm100_f8f6f4_gemm.py": ("compiled sm_100a_gemm_1sm_tensor_f8f6f4xf8f6f4_bf16", "tcgen05.mma"),
    "sm100_blockscaled_gemm.py": ("mxf4nvf4", "tcgen05.mma"),
    "sm90_moe_grouped.py": ("sm_90a_grouped_gemm_contiguous_row_e4m3xe4m3_bf16", "x WGMMA e4m3 x e4m3",
                            "x 32-bit global loads (group sizes, row scales)", "x lanes grouped by expert",
                            "x per-expert counts"),
    "llama_fp8.py": ("14 linear layers converted", "weight (256, 256) float8_e4m3fn"),
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(WITHOUT_A_GPU)


@pytest.mark.compile
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the examples do without a GPU")
@pytest.mark.parametrize("name", sorted(WITHOUT_A_GPU))
def test_example_runs_without_a_gpu(name, tmp_path):
    run = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for words in WITHOUT_A_GPU[name]:
        assert words in run.stdout, (words, run.stdout[-3000:])
    assert "needs a Hopper GPU" in run.stdout or "sm_100" in run.stdout
    assert not any(tmp_path.iterdir())  # nothing left in the working directory
