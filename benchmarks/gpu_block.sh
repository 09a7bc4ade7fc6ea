#!/usr/bin/env bash
# Block-scaled Hopper GEMM on the lent H100 (after the DSL install of ../shared/gpu/README.md):
#   bash benchmarks/gpu_block.sh        tests, benchmark vs F.scaled_mm blockwise, end-to-end; results in $OUT
set -uo pipefail
out=${OUT:-gpu_results}; mkdir -p "$out"
export CUTEDSL_GEMM_CACHE_DIR=${CUTEDSL_GEMM_CACHE_DIR:-/tmp/cutedsl_gemm_cache} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 -m pytest -m gpu -q -p no:warnings -x tests/test_sm90_blockscaled_gpu.py tests/test_sm90_gemm_gpu.py 2>&1 | tee "$out/pytest_block.log" | tail -n 15
python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes 1x128_128x128,128x128_128x128,1x128_1x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
python3 -m benchmarks.bench_gemm --e2e --out "$out/e2e.json" > "$out/e2e.txt" 2>&1
tail -n 12 "$out/gemm_block.txt"; tail -n 4 "$out/e2e.txt"
