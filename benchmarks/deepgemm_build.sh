#!/usr/bin/env bash
# Build DeepGEMM on the GPU machine (no network there) for benchmarks/deepgemm_ref.py.
#
#   bash benchmarks/deepgemm_build.sh SRC.tgz     # unpacks into /tmp/dg, builds /tmp/dg/DeepGEMM/deep_gemm/_C*.so
#
# SRC.tgz holds DeepGEMM/ (deepseek-ai/DeepGEMM; session 26 used 54e2261), cutlass/include (NVIDIA/cutlass) and
# fmt/include (fmtlib/fmt), e.g. from local clones:
#   mkdir -p p/DeepGEMM p/cutlass p/fmt && git -C DeepGEMM archive HEAD | tar x -C p/DeepGEMM &&
#   git -C cutlass archive HEAD include | tar x -C p/cutlass && git -C fmt archive HEAD include | tar x -C p/fmt &&
#   tar czf SRC.tgz -C p DeepGEMM cutlass fmt          (~3 MB; carry it to the device)
# Two fixes for the lent machine's toolchain: the extension is built with /usr/bin/g++ (built with the image's
# default /opt/gcc/bin/g++ wrapper, the build succeeds and the first JIT call segfaults in libstdc++'s locale
# code; not looked into further), and DeepGEMM's std::regex include scan is replaced by a plain string scan.
#
#   bash benchmarks/deepgemm_build.sh SRC.tgz 128B   # the same with its TMA descriptors' L2 promotion at 128B (or NONE)
#
# DeepGEMM encodes every TMA descriptor with CU_TENSOR_MAP_L2_PROMOTION_L2_256B; the second argument rewrites that
# before building (session 27: its times did not move with 256B, 128B or NONE).
set -euo pipefail
src=${1:?usage: deepgemm_build.sh SRC.tgz [256B|128B|NONE]}
promo=${2:-256B}
rm -rf /tmp/dg && mkdir -p /tmp/dg && tar xzf "$src" -C /tmp/dg
cd /tmp/dg/DeepGEMM
case $promo in
  256B) ;;
  128B|NONE)
    want=CU_TENSOR_MAP_L2_PROMOTION_$([ "$promo" = NONE ] && echo NONE || echo L2_128B)
    sed -i "s/CU_TENSOR_MAP_L2_PROMOTION_L2_256B/$want/" csrc/jit_kernels/impls/runtime_utils.hpp
    grep -q "$want" csrc/jit_kernels/impls/runtime_utils.hpp || { echo "no L2 promotion to rewrite in runtime_utils.hpp"; exit 1; }
    ;;
  *) echo "L2 promotion must be 256B, 128B or NONE, got $promo"; exit 1 ;;
esac
cp -r ../cutlass/include/cute ../cutlass/include/cutlass deep_gemm/include/
python3 - <<'EOF'
p = "csrc/jit/include_parser.hpp"
s = open(p).read()
a = s.index("        std::vector<std::string> includes;\n        const std::regex")
b = s.index("        return includes;", a)
s = s[:a] + """        std::vector<std::string> includes;
        size_t pos = 0;
        while ((pos = code.find("#include <deep_gemm", pos)) != std::string::npos) {
            const size_t start = pos + 10, end = code.find('>', start);
            if (end == std::string::npos) break;
            includes.push_back(code.substr(start, end - start));
            pos = end;
        }
""" + s[b:]
open(p, "w").write(s)
EOF
export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"
python3 - > /tmp/dg/build.log 2>&1 <<'EOF'
import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension, CUDA_HOME

setup(
    name="deep_gemm",
    ext_modules=[CUDAExtension(
        "deep_gemm._C", ["csrc/python_api.cpp"],
        include_dirs=[f"{CUDA_HOME}/include", f"{CUDA_HOME}/include/cccl", "deep_gemm/include", "../cutlass/include",
                      "../fmt/include"],
        libraries=["cudart", "nvrtc", "cuda"], library_dirs=[f"{CUDA_HOME}/lib64", f"{CUDA_HOME}/lib64/stubs"],
        extra_compile_args=["-std=c++17", "-O1", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations",
                            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"])],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
    script_args=["build_ext", "--inplace"],
)
EOF
ls deep_gemm/_C*.so
