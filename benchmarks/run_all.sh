#!/usr/bin/env bash
# Everything that runs on a Hopper GPU, from a checkout with the package installed (pip install -e .):
#   bash benchmarks/run_all.sh tests    the GPU test tier (pytest -m gpu)
#   bash benchmarks/run_all.sh bench    every benchmark that writes a result file into benchmarks/results/
#   bash benchmarks/run_all.sh          both
# Then `python -m benchmarks.render` rewrites BENCHMARKS.md and the README's performance table from the results.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader

run_tests() {
  "$py" -m pytest -m gpu -q -p no:cacheprovider tests
}

run_bench() {
  all_recipes=tensor,row,1x128_128x128,128x128_128x128,1x128_1x128
  "$py" -m benchmarks.bench_gemm --sets dsv3 --recipes "$all_recipes"
  "$py" -m benchmarks.bench_gemm --sets decode --recipes tensor,row,1x128_128x128
  "$py" -m benchmarks.bench_gemm --sets square --recipes "$all_recipes"
  "$py" -m benchmarks.bench_gemm --sets dsv3 --recipes tensor,row --fast-accum
  "$py" -m benchmarks.bench_gemm --e2e
  "$py" -m benchmarks.bench_decode_chain --ms 1,16,64,128 --layers 8 --recipes row,tensor
  "$py" -m benchmarks.measure_floor
  "$py" -m benchmarks.bench_sweep --precompile-only
  "$py" -m benchmarks.bench_sweep
  "$py" -m benchmarks.bench_decode_chain --sweep --recipes tensor,row,1x128_128x128
  "$py" -m benchmarks.bench_linear_stack --layers 8 --recipe row --ms 1,16,4096 --eager-ms 1
  "$py" -m benchmarks.bench_model --layers 8 --recipe row --batches 1,16,64 --context 512  # needs .[models]
  "$py" -m benchmarks.bench_quantize --shape 8192x8192 --dtype bf16
  "$py" -m benchmarks.host_cost --calls 1000
}

case "${1:-all}" in
  tests) run_tests ;;
  bench) run_bench ;;
  all) run_tests; run_bench ;;
  *) echo "usage: bash benchmarks/run_all.sh [tests|bench|all]" >&2; exit 2 ;;
esac
