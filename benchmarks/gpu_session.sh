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
  python3 -m benchmarks.bench_gemm --sets square,dsv3,llama70b_decode,llama70b_layers --recipes tensor,row --out "$out/gemm_promoted.json" > "$out/gemm_promoted.txt" 2>&1
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes tensor,row --fast-accum --out "$out/gemm_fast.json" > "$out/gemm_fast.txt" 2>&1
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes 1x128_128x128,128x128_128x128,1x128_1x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
  python3 -m benchmarks.bench_gemm --e2e --out "$out/e2e.json" > "$out/e2e.txt" 2>&1
  python3 -m benchmarks.bench_quantize --shape 8192x8192 --dtype bf16 --out "$out/quant.json" > "$out/quant.txt" 2>&1
  for f in gemm_promoted gemm_fast gemm_block; do grep -A 12 "^geomeans" "$out/$f.txt"; done
  tail -n 2 "$out/e2e.txt"; tail -n 12 "$out/quant.txt"
  ;;
decode)
  # Decode tile/split sweep (128- and 64-row swap-AB tiles), L2 emptied by reads, plus the bandwidth floor.
  t=128x16c1x1s,64x16c1x1s,64x16c1x1sst16,128x32c1x1s,64x32c1x1s,128x64c1x1s,64x64c1x1s
  python3 -m benchmarks.tune_tiles --ms 1,16,32,64,128 --nk 8192x8192 --recipes row --accums promoted --floor --tiles $t --splits 0,1 > "$out/decode_row.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 64,128 --nk 8192x8192 --recipes row --accums fast --tiles 128x64c1x1sk256,64x64c1x1sk256,64x32c1x1sk256 --splits 0 > "$out/decode_fast.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 1,16,64 --nk 10240x8192,57344x8192,8192x28672 --recipes row --accums promoted --floor --tiles 128x16c1x1s,64x16c1x1s,128x64c1x1s,64x64c1x1s --splits 0 > "$out/decode_layers.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 16,64 --nk 8192x8192 --recipes 1x128_128x128,tensor --accums promoted --floor --tiles 128x16c1x1s,64x16c1x1s,128x64c1x1s,64x64c1x1s --splits 0 > "$out/decode_block.txt" 2>&1
  grep -v Warn "$out"/decode_*.txt | grep -v "^\s*$" | cut -c1-150
  ;;
decode_bench)
  # The decode sets through scaled_mm (dispatch picks the swapped small-M kernels) for what `bench` leaves
  # out: fast accumulation and the block-scaled recipes.
  python3 -m benchmarks.bench_gemm --sets llama70b_decode,llama70b_layers --recipes tensor,row --fast-accum --out "$out/decode_fast.json" > "$out/decode_fast.txt" 2>&1
  python3 -m benchmarks.bench_gemm --sets llama70b_decode,llama70b_layers --recipes 1x128_128x128,128x128_128x128,1x128_1x128 --out "$out/decode_block.json" > "$out/decode_block.txt" 2>&1
  python3 -m benchmarks.bench_decode_chain --ms 1,16,64,128 --layers 8 --recipes row,tensor > "$out/decode_chain.txt" 2>&1
  for f in decode_fast decode_block; do grep -A 12 "^geomeans" "$out/$f.txt"; done
  grep -v Warn "$out/decode_chain.txt"
  ;;
splits)
  # Split-K beyond one wave of tiles on the DeepSeek-V3 shapes where we trail cuBLAS most (narrow N, long K).
  python3 -m benchmarks.tune_tiles --ms 1024,6144 --nk 512x7168,576x7168,1536x7168,4608x7168,7168x2048,4096x512 --recipes tensor --accums promoted --tiles 128x192c2x1,128x128c2x1,128x96c2x1 --splits 0,1,2,3,4,6 > "$out/splits.txt" 2>&1
  grep -v Warn "$out/splits.txt" | cut -c1-150
  ;;
splits_small)
  # The split-K cases alone (fewer output tiles than SMs): the last split's read-back of the partials.
  python3 -m benchmarks.tune_tiles --ms 1024 --nk 512x7168,576x7168,1536x7168 --recipes tensor --accums promoted --tiles 128x192c2x1,128x128c2x1 --splits 0,1,2,4 > "$out/splits_small.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 16 --nk 4096x8192,2048x8192 --recipes row --accums promoted --tiles 128x16c1x1s,64x16c1x1s --splits 0,1,2,4 >> "$out/splits_small.txt" 2>&1
  grep -v Warn "$out/splits_small.txt" | cut -c1-150
  ;;
promoted)
  python3 -m benchmarks.bench_gemm --sets square,dsv3,llama70b_decode,llama70b_layers --recipes tensor,row --out "$out/gemm_promoted.json" > "$out/gemm_promoted.txt" 2>&1
  grep -A 12 "^geomeans" "$out/gemm_promoted.txt"
  ;;
esac
tar -czf "/tmp/results-${1:-tests}.tar.gz" -C "$out" --exclude='*.tar.gz' . && mv "/tmp/results-${1:-tests}.tar.gz" "$out/"
