#!/usr/bin/env bash
# Everything the lent H100 runs for a session (after the DSL install of ../shared/gpu/README.md), in two calls
# that each fit the device tool's 10-minute limit:
#   bash benchmarks/gpu_session.sh tests     GPU test tier + host cost per call
#   bash benchmarks/gpu_session.sh bench     GEMM benchmarks (all recipes, both accumulations), end to end, quantizers
# Results and logs go to $OUT (or ./gpu_results), also packed into results-<part>.tar.gz (the device tool
# brings back only a few files per call).
set -uo pipefail
out=${OUT:-gpu_results}; mkdir -p "$out"
export CUTEDSL_GEMM_CACHE_DIR=${CUTEDSL_GEMM_CACHE_DIR:-/tmp/cutedsl_gemm_cache} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
case "${1:-tests}" in
tests)
  python3 -m pytest -m gpu -q -p no:warnings tests 2>&1 | tee "$out/pytest_gpu.log" | tail -n 15
  python3 -m benchmarks.host_cost --calls 1000 2>&1 | tee "$out/host_cost.txt"
  ;;
bench)
  python3 -m benchmarks.bench_gemm --sets square,dsv3,llama70b_decode --recipes tensor,row --out "$out/gemm_promoted.json" > "$out/gemm_promoted.txt" 2>&1
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes tensor,row --fast-accum --out "$out/gemm_fast.json" > "$out/gemm_fast.txt" 2>&1
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes 1x128_128x128,128x128_128x128,1x128_1x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
  python3 -m benchmarks.bench_gemm --e2e --out "$out/e2e.json" > "$out/e2e.txt" 2>&1
  python3 -m benchmarks.bench_quantize --shape 8192x8192 --dtype bf16 --out "$out/quant.json" > "$out/quant.txt" 2>&1
  for f in gemm_promoted gemm_fast gemm_block; do grep -A 12 "^geomeans" "$out/$f.txt"; done
  tail -n 2 "$out/e2e.txt"; tail -n 12 "$out/quant.txt"
  ;;
promoted)
  python3 -m benchmarks.bench_gemm --sets square,dsv3,llama70b_decode,llama70b_layers --recipes tensor,row --out "$out/gemm_promoted.json" > "$out/gemm_promoted.txt" 2>&1
  grep -A 12 "^geomeans" "$out/gemm_promoted.txt"
  ;;
esac
tar -czf "/tmp/results-${1:-tests}.tar.gz" -C "$out" --exclude='*.tar.gz' . && mv "/tmp/results-${1:-tests}.tar.gz" "$out/"
