#!/usr/bin/env bash
# Everything the lent H100 runs for a session, in one call (after the DSL install of ../shared/gpu/README.md):
#   bash benchmarks/gpu_session.sh            results and logs under $OUT (or ./gpu_results)
set -uo pipefail
out=${OUT:-gpu_results}; mkdir -p "$out"
export CUTEDSL_GEMM_CACHE_DIR=${CUTEDSL_GEMM_CACHE_DIR:-/tmp/cutedsl_gemm_cache} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -m gpu -q -p no:warnings tests 2>&1 | tee "$out/pytest_gpu.log" | tail -n 15
python3 -m benchmarks.host_cost --calls 1000 2>&1 | tee "$out/host_cost.txt"
python3 -m benchmarks.bench_gemm --sets square,dsv3,llama70b_decode --recipes tensor,row --out "$out/gemm_promoted.json" > "$out/gemm_promoted.txt" 2>&1
python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes tensor,row --fast-accum --out "$out/gemm_fast.json" > "$out/gemm_fast.txt" 2>&1
python3 -m benchmarks.bench_quantize --shape 8192x8192 --dtype bf16 --out "$out/quant.json" > "$out/quant.txt" 2>&1
tail -n 8 "$out/gemm_promoted.txt"; tail -n 6 "$out/gemm_fast.txt"; tail -n 12 "$out/quant.txt"
