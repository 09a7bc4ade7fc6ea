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
narrow)
  # The narrow-N DeepSeek-V3 shapes where we trail cuBLAS most: tile / split sweep, then ncu on the dispatched
  # kernel, the same tile unsplit, and cuBLAS (full section set, text in ncu_*.txt).
  python3 -m benchmarks.tune_tiles --ms 1024 --nk 512x7168,1536x7168 --recipes tensor --accums promoted --tiles 128x192c2x1,128x128c2x1,128x128c1x1,64x128c2x1,64x128c1x1,128x64c2x1 --splits 0,1,2,4 > "$out/narrow.txt" 2>&1
  grep -v Warn "$out/narrow.txt" | cut -c1-150
  for s in 0 1; do
    ncu --clock-control none --set full --nvtx --nvtx-include profile/ python3 -m benchmarks.profile_shape --m 1024 --n 512 --k 7168 --recipe tensor --tile 128x192c2x1 --splits $s > "$out/ncu_1024x512_split$s.txt" 2>&1
    grep -E "^  [a-z_0-9]+.*\(|Duration|Elapsed Cycles|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Registers Per|Stall|Issue Slot" "$out/ncu_1024x512_split$s.txt" | head -40
  done
  ;;
narrow2)
  # Small tiles without split (cuBLAS runs M=1024, N=512, K=7168 as 128 64x64 tiles, 1x2 clusters, no split),
  # and which cuBLAS kernel each DeepSeek-V3 / square shape gets.
  python3 -m benchmarks.tune_tiles --ms 1024 --nk 512x7168,1536x7168 --recipes tensor --accums promoted --tiles 64x64c1x1,64x64c2x1,64x64c1x2,128x64c1x2,64x128c1x2,128x128c1x2 --splits 1,2 > "$out/narrow2.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 6144 --nk 512x7168,576x7168 --recipes tensor --accums promoted --tiles 128x192c2x1,128x128c2x1,128x64c1x2,128x64c2x1,64x128c1x2 --splits 1 >> "$out/narrow2.txt" 2>&1
  grep -v Warn "$out/narrow2.txt" | cut -c1-150
  python3 -m benchmarks.cublas_kernels --sets dsv3,square --recipes tensor,row,1x128_128x128 > "$out/cublas_kernels.txt" 2>&1
  cut -c1-140 "$out/cublas_kernels.txt"
  ;;
narrow3)
  # Deeper pipelines for small tiles (the stage cap was 8), tiles that make ~one wave (128x96 at N=1536,
  # 64x96 at N=576), and ncu stall reasons for the 128x128 promoted tile against cuBLAS's 128x128 on 6144x576.
  python3 -m benchmarks.tune_tiles --ms 1024 --nk 512x7168 --recipes tensor --accums promoted --tiles 64x64c1x2,64x64c1x2st13,64x64c1x1st13,128x64c1x2st9,128x64c2x1st9 --splits 1,2 > "$out/narrow3.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 1024 --nk 1536x7168,576x7168 --recipes tensor --accums promoted --tiles 128x96c2x1,128x96c1x2,64x96c1x2,64x96c1x2st12 --splits 1,2 >> "$out/narrow3.txt" 2>&1
  grep -v Warn "$out/narrow3.txt" | cut -c1-150
  ncu --clock-control none --set full --print-details all --nvtx --nvtx-include profile/ python3 -m benchmarks.profile_shape --m 6144 --n 576 --k 7168 --recipe tensor --tile 128x128c2x1 --splits 1 > "$out/ncu_6144x576.txt" 2>&1
  grep -E "^  [a-z_0-9]+.*\(|Duration|SM Active Cycles|Stall|stall|Issue Slots Busy|Registers Per" "$out/ncu_6144x576.txt" | cut -c1-160 | head -60
  ;;
hotspots)
  # Where the warps of our small/medium tiles wait, per SASS instruction (ncu source page), next to cuBLAS.
  ncu --clock-control none --section SourceCounters --section WarpStateStats --nvtx --nvtx-include profile/ -o "$out/rep64" -f python3 -m benchmarks.profile_shape --m 1024 --n 512 --k 7168 --recipe tensor --tile 64x64c1x2 --splits 1 > /dev/null 2>&1
  ncu --clock-control none --section SourceCounters --section WarpStateStats --nvtx --nvtx-include profile/ -o "$out/rep128" -f python3 -m benchmarks.profile_shape --m 6144 --n 576 --k 7168 --recipe tensor --tile 128x128c2x1 --splits 1 > /dev/null 2>&1
  for r in rep64 rep128; do
    ncu --import "$out/$r.ncu-rep" --page source --csv --print-source sass > "$out/$r.csv" 2>&1
    python3 -m benchmarks.ncu_hotspots "$out/$r.csv" --top 22 | cut -c1-140 | tee "$out/$r.hot.txt"
  done
  ;;
tiles)
  # Tile sweep after the register fences (WGMMA no longer serialized for promoted tiles <= 128 wide):
  # narrow-N and one-wave shapes, two-wave 128x128 shapes, squares, decode, block-scaled.
  tt="python3 -m benchmarks.tune_tiles --accums promoted"
  $tt --ms 1024 --nk 512x7168,1536x7168,576x7168 --recipes tensor --tiles 128x192c2x1,128x128c2x1,128x96c2x1,128x64c1x2,64x128c1x2,64x64c1x2 --splits 0,1 > "$out/tiles.txt" 2>&1
  $tt --ms 6144 --nk 512x7168,576x7168,1536x7168 --recipes tensor --tiles 128x192c2x1,128x128c2x1 --splits 1 >> "$out/tiles.txt" 2>&1
  $tt --ms 4096 --nk 4096x4096 --recipes tensor --tiles 128x192c2x1,128x128c2x1 --splits 1 >> "$out/tiles.txt" 2>&1
  $tt --ms 8192 --nk 8192x8192 --recipes tensor,1x128_128x128 --tiles 128x192c2x1,128x128c2x1 --splits 1 >> "$out/tiles.txt" 2>&1
  $tt --ms 1024 --nk 1536x7168 --recipes 1x128_128x128 --tiles 128x192c2x1,128x128c2x1 --splits 0 >> "$out/tiles.txt" 2>&1
  $tt --ms 16,64 --nk 8192x8192 --recipes row --floor --tiles 128x16c1x1s,64x16c1x1s,128x64c1x1s,64x64c1x1s --splits 0 >> "$out/tiles.txt" 2>&1
  grep -v Warn "$out/tiles.txt" | cut -c1-150
  ;;
rates)
  # Throughput of each promoted tile shape over several waves (the dispatch rate table), per-tensor.
  python3 -m benchmarks.tune_tiles --accums promoted --ms 6144 --nk 512x7168,1536x7168,7168x2048,576x7168 --recipes tensor --tiles 128x192c2x1,128x128c2x1,128x96c2x1,64x128c1x2,64x64c1x2 --splits 0 > "$out/rates.txt" 2>&1
  python3 -m benchmarks.tune_tiles --accums promoted --ms 1024 --nk 7168x2048,4608x7168,3072x1536,4096x512 --recipes tensor --tiles 128x192c2x1,128x128c2x1,128x96c2x1,64x128c1x2,64x64c1x2 --splits 0 >> "$out/rates.txt" 2>&1
  python3 -m benchmarks.tune_tiles --accums promoted --ms 4096 --nk 4096x4096 --recipes tensor --tiles 128x96c2x1,64x128c1x2 --splits 0 >> "$out/rates.txt" 2>&1
  grep -v Warn "$out/rates.txt" | cut -c1-120
  ;;
wide)
  # Tiles whose N divides the narrow DeepSeek-V3 outputs into whole waves (session 6: 80 and 144 wide,
  # 16-column output slices): N=576 as 8 x 80 (64-row: 128 CTAs), N=4608 as 32 x 144, and their rates.
  tt="python3 -m benchmarks.tune_tiles --accums promoted"
  $tt --ms 1024 --nk 576x7168 --recipes tensor,row --tiles 64x64c1x2,64x80c1x2,64x96c1x2,64x128c1x2,128x80c2x1,128x96c2x1 --splits 0,1 > "$out/wide.txt" 2>&1
  $tt --ms 1024 --nk 4608x7168 --recipes tensor --tiles 128x144c2x1,128x192c2x1,128x128c2x1 --splits 0,1 >> "$out/wide.txt" 2>&1
  $tt --ms 6144 --nk 576x7168,512x7168 --recipes tensor --tiles 128x144c2x1,128x96c2x1,128x80c2x1,128x128c2x1,64x128c1x2 --splits 1 >> "$out/wide.txt" 2>&1
  $tt --ms 6144 --nk 1536x7168,7168x2048 --recipes tensor --tiles 128x144c2x1,128x80c2x1,64x80c1x2,64x96c1x2 --splits 0 >> "$out/wide.txt" 2>&1
  grep -v Warn "$out/wide.txt" | cut -c1-150
  python3 -m benchmarks.bench_gemm --sets dsv3 --recipes tensor,row --out "$out/dsv3_before.json" > "$out/dsv3_before.txt" 2>&1
  grep -A 6 "^geomeans" "$out/dsv3_before.txt"; grep -E "576|1536|4608" "$out/dsv3_before.txt" | cut -c1-150
  ;;
persm)
  # Two 64-row CTAs per SM (session 6, tune spec suffix o2): one-wave and few-wave DeepSeek-V3 shapes, the
  # multi-wave rates, 8192^3, and the swapped decode tiles.
  tt="python3 -m benchmarks.tune_tiles --accums promoted"
  $tt --ms 1024 --nk 576x7168,1536x7168 --recipes tensor --tiles 64x96c1x2,64x96c1x2o2,64x64c1x2o2,64x128c1x2o2,64x192c1x2o2,128x96c2x1 --splits 0 > "$out/persm.txt" 2>&1
  $tt --ms 1024 --nk 4608x7168 --recipes tensor --tiles 128x144c2x1,64x144c1x2o2,64x192c1x2o2,64x128c1x2o2 --splits 0 >> "$out/persm.txt" 2>&1
  $tt --ms 6144 --nk 512x7168,576x7168 --recipes tensor --tiles 128x128c2x1,64x96c1x2o2,64x128c1x2o2,64x144c1x2o2,64x192c1x2o2,64x192c1x1so2,64x192c2x1so2 --splits 1 >> "$out/persm.txt" 2>&1
  $tt --ms 6144 --nk 1536x7168,7168x2048 --recipes tensor --tiles 64x96c1x2o2,64x128c1x2o2,64x144c1x2o2,64x192c1x2o2 --splits 1 >> "$out/persm.txt" 2>&1
  $tt --ms 8192 --nk 8192x8192 --recipes tensor,row --tiles 128x192c2x1,64x192c1x2o2,64x192c2x1o2 --splits 1 >> "$out/persm.txt" 2>&1
  $tt --ms 16,64 --nk 8192x8192 --recipes row --floor --tiles 64x16c1x1s,64x16c1x1so2,64x64c1x1s,64x64c1x1so2 --splits 0 >> "$out/persm.txt" 2>&1
  grep -v Warn "$out/persm.txt" | cut -c1-150
  ;;
pairs)
  # Two CTAs per SM with 2x1 clusters (the orientation that worked at M=6144 N=512), swapped and not, on
  # the DeepSeek-V3 shapes still behind cuBLAS, and their rates over several waves.
  tt="python3 -m benchmarks.tune_tiles --accums promoted"
  $tt --ms 1024 --nk 1536x7168 --recipes tensor --tiles 128x96c2x1,64x96c2x1o2,64x96c2x1so2,64x128c2x1so2,64x192c2x1so2,64x128c2x1o2 --splits 1 > "$out/pairs.txt" 2>&1
  $tt --ms 6144 --nk 576x7168 --recipes tensor --tiles 128x128c2x1,64x96c2x1o2,64x144c2x1o2,64x192c2x1o2,64x144c2x1so2,64x96c2x1so2,64x128c2x1so2 --splits 1 >> "$out/pairs.txt" 2>&1
  $tt --ms 1024 --nk 7168x2048 --recipes tensor --tiles 128x128c2x1,64x192c2x1o2,64x192c2x1so2,64x128c2x1o2,64x128c2x1so2 --splits 1 >> "$out/pairs.txt" 2>&1
  $tt --ms 6144 --nk 1536x7168,7168x2048 --recipes tensor --tiles 128x192c2x1,64x192c2x1so2,64x192c2x1o2,64x128c2x1o2,64x128c2x1so2 --splits 1 >> "$out/pairs.txt" 2>&1
  $tt --ms 4096 --nk 4096x4096 --recipes tensor --tiles 128x128c2x1,64x192c2x1o2,64x128c2x1o2,64x192c2x1so2 --splits 1 >> "$out/pairs.txt" 2>&1
  grep -v Warn "$out/pairs.txt" | cut -c1-150
  ;;
cluster_dirs)
  # Which operand to multicast: 2x1 clusters share W tiles, 1x2 share A tiles (and 1x1 none), on the
  # one- and two-wave DeepSeek-V3 shapes.
  tt="python3 -m benchmarks.tune_tiles --accums promoted"
  $tt --ms 1024 --nk 1536x7168 --recipes tensor --tiles 128x96c2x1,128x96c1x2,128x96c1x1 --splits 1 > "$out/cluster_dirs.txt" 2>&1
  $tt --ms 1024 --nk 4608x7168 --recipes tensor --tiles 128x144c2x1,128x144c1x2,128x144c1x1 --splits 1 >> "$out/cluster_dirs.txt" 2>&1
  $tt --ms 1024 --nk 7168x2048 --recipes tensor --tiles 128x128c2x1,128x128c1x2,128x128c1x1 --splits 1 >> "$out/cluster_dirs.txt" 2>&1
  $tt --ms 6144 --nk 576x7168 --recipes tensor --tiles 128x128c2x1,128x128c1x2,128x128c1x1 --splits 1 >> "$out/cluster_dirs.txt" 2>&1
  $tt --ms 1024 --nk 576x7168,512x7168 --recipes tensor --tiles 64x96c1x2,64x96c2x1,64x96c1x1,64x64c1x2,64x64c2x1,64x64c1x1 --splits 1 >> "$out/cluster_dirs.txt" 2>&1
  grep -v Warn "$out/cluster_dirs.txt" | cut -c1-150
  ;;
hotspots_block)
  # Where the DeepSeek recipe's warps wait against the per-tensor kernel on the same 128x192 tiles (4096^3).
  for r in 1x128_128x128 tensor; do
    ncu --clock-control none --section SourceCounters --section WarpStateStats --nvtx --nvtx-include profile/ -o "$out/rep_$r" -f python3 -m benchmarks.profile_shape --m 4096 --n 4096 --k 4096 --recipe $r --tile 128x192c2x1 --splits 1 > /dev/null 2>&1
    ncu --import "$out/rep_$r.ncu-rep" --page source --csv --print-source sass > "$out/rep_$r.csv" 2>&1
    python3 -m benchmarks.ncu_hotspots "$out/rep_$r.csv" --top 16 | cut -c1-140 | tee "$out/rep_$r.hot.txt"
  done
  ;;
promo_profile)
  # Session 11: where the block-scaled main loop loses against per-tensor on the same 128x128 c2x1 tile
  # (4096^3): ncu warp states and per-SASS-instruction stall samples; the CSVs come back for reading.
  for r in 128x128_128x128 1x128_128x128 tensor; do
    ncu --clock-control none --section SourceCounters --section WarpStateStats --section SpeedOfLight --nvtx --nvtx-include profile/ -o "$out/p_$r" -f python3 -m benchmarks.profile_shape --m 4096 --n 4096 --k 4096 --recipe $r --tile 128x128c2x1 --splits 1 > /dev/null 2>&1
    ncu --import "$out/p_$r.ncu-rep" --page source --csv --print-source sass > "$out/p_$r.csv" 2>&1
    ncu --import "$out/p_$r.ncu-rep" --page details > "$out/p_$r.details.txt" 2>&1
    rm -f "$out/p_$r.ncu-rep"
    python3 -m benchmarks.ncu_hotspots "$out/p_$r.csv" --top 12 | cut -c1-140 > "$out/p_$r.hot.txt"
    grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Warp Cycles Per Issued|Issued Warp" "$out/p_$r.details.txt" | head -8
  done
  ;;
block)
  # Block-scaled recipes after a main-loop change: their GPU tests, the 128x192 / 128x128 tiles at 4096^3 and
  # 4096x8192x8192 next to per-tensor, and the square / DeepSeek-V3 sets through scaled_mm.
  python3 -m pytest -m gpu -q -p no:warnings tests/test_sm90_blockscaled_gpu.py tests/test_sm90_small_m_gpu.py 2>&1 | tail -n 3
  python3 -m benchmarks.tune_tiles --accums promoted --ms 4096 --nk 4096x4096,8192x8192 --recipes 1x128_128x128,128x128_128x128,tensor --tiles 128x192c2x1,128x128c2x1 --splits 1 2>&1 | grep -v Warn | cut -c1-130
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes 1x128_128x128,128x128_128x128,1x128_1x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_block.txt"
  ;;
lastwave)
  # 128x192 with its last wave split in K (the lw variant, split as dispatch would) against the tiles dispatch
  # picks without modelling that split.
  tt="python3 -m benchmarks.tune_tiles --accums promoted"
  $tt --ms 6144 --nk 576x7168,512x7168 --recipes tensor,row --tiles 128x128c2x1,128x192c2x1,128x192c2x1lw,128x144c2x1 --splits 0 > "$out/lastwave.txt" 2>&1
  $tt --ms 1024 --nk 4608x7168 --recipes tensor --tiles 128x144c2x1,128x192c2x1,128x192c2x1lw --splits 0 >> "$out/lastwave.txt" 2>&1
  $tt --ms 6144 --nk 1536x7168,4608x7168 --recipes tensor --tiles 128x192c2x1,128x192c2x1lw --splits 0 >> "$out/lastwave.txt" 2>&1
  grep -v Warn "$out/lastwave.txt" | cut -c1-150
  ;;
fast)
  # Fast accumulation (use_fast_accum=True) had one cooperative tile (128x256): its tiles over the DeepSeek-V3
  # shapes (split as dispatch would), their rates over several waves, the squares, and the set through scaled_mm.
  tt="python3 -m benchmarks.tune_tiles --accums fast --recipes tensor --splits 0"
  ft=128x256c2x1,128x192c2x1,128x144c2x1,128x128c2x1,128x96c2x1,64x256c1x2,64x192c1x2,64x128c1x2,64x96c1x2,64x64c1x2
  $tt --ms 1024 --nk 1536x7168,3072x1536,576x7168,7168x256,7168x2048,4608x7168,7168x2304,512x7168,4096x512 --tiles $ft > "$out/fast_1024.txt" 2>&1
  $tt --ms 6144 --nk 1536x7168,3072x1536,576x7168,7168x256,7168x2048,4608x7168,7168x2304,512x7168,4096x512 --tiles $ft > "$out/fast_6144.txt" 2>&1
  $tt --ms 4096,8192 --nk 4096x4096,8192x8192 --tiles 128x256c2x1,128x192c2x1,128x128c2x1,64x256c1x2 > "$out/fast_square.txt" 2>&1
  grep -v Warn "$out"/fast_*.txt | cut -c1-150
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes tensor,row --fast-accum --out "$out/gemm_fast.json" > "$out/gemm_fast.txt" 2>&1
  grep -A 6 "^geomeans" "$out/gemm_fast.txt"
  ;;
l2)
  # Session 8: is the tensor pipe starved by L2 -> SM operand traffic at full load? SM clock, L2 and tensor-pipe
  # throughput of ours (cluster shapes, tile sizes) next to cuBLAS, one ncu pass of the SOL/memory/compute sections each.
  for spec in "8192 8192 8192 128x192c2x1 promoted" "8192 8192 8192 128x192c2x2 promoted" "8192 8192 8192 128x256c2x1 fast" \
              "6144 576 7168 128x128c2x1 promoted" "6144 1536 7168 128x192c2x1 promoted"; do
    read -r m n k tile acc <<< "$spec"
    f="$out/ncu_l2_${m}x${n}x${k}_${tile}_${acc}.txt"
    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --metrics sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum.per_second,lts__t_sectors_op_read.sum \
        --print-details all --nvtx --nvtx-include profile/ python3 -m benchmarks.profile_shape --m $m --n $n --k $k \
        --recipe tensor --tile $tile --accum $acc --splits 1 --calls 2 > "$f" 2>&1
    echo "== $spec"
    # per kernel (ours, then cuBLAS): the columns of BENCHMARKS.md's session-8 table; the full report stays in $f
    grep -E "^  (kernel_|nvjet)|Duration  |SM Frequency|L2 Cache Throughput|lts__t_bytes.sum.per_second|SM: Pipe Tensor Cycles Active" "$f" \
      | sed -E 's/^  kernel_cutlass.*/  ours/' | cut -c1-120
  done
  ;;
clusters4)
  # Session 10: 128x128 in 4x1 clusters (W multicast to four CTAs) against the 2x1 tiles, narrow N over M,
  # the shapes dispatch moves to 4x1, and the multi-wave shapes where 4x1 costs a wave (30 slots, not 33).
  python3 -m benchmarks.tune_tiles --ms 1024,2048,3072,4096,6144,8192 --nk 576x7168 --recipes tensor,row --accums promoted --splits 0 \
      --tiles 128x128c2x1,128x128c4x1,128x144c2x1,128x96c2x1 > "$out/c4_narrow.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 1024 --nk 7168x2048,7168x2304,4096x512,3072x1536 --recipes tensor --accums promoted,fast --splits 0 \
      --tiles 128x128c2x1,128x128c4x1,128x192c2x1 > "$out/c4_m1024.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 4096,6144 --nk 4096x4096,576x7168 --recipes tensor --accums fast --splits 0 \
      --tiles 128x128c2x1,128x128c4x1,128x192c2x1 > "$out/c4_fast.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 1024,6144 --nk 576x7168,7168x2048 --recipes 1x128_128x128 --accums promoted --splits 0 \
      --tiles 128x128c2x1,128x128c4x1,128x192c2x1 > "$out/c4_block.txt" 2>&1
  grep -v Warn "$out"/c4_*.txt | grep -v "^\s*$" | cut -c1-160
  ;;
onewave)
  # Session 10: the one-wave M=1024 shapes where cuBLAS runs the same tiles faster (128x96 at N=1536, 128x144
  # at N=4608), and what a 2-way K split of 128x192 tiles costs: ncu SOL/memory/compute/warp-state sections.
  for spec in "1024 1536 7168 128x96c2x1 1" "1024 1536 7168 128x192c2x1 2" "1024 1536 7168 128x192c2x1 1" \
              "1024 4608 7168 128x144c2x1 1"; do
    read -r m n k tile splits <<< "$spec"
    f="$out/ncu_onewave_${m}x${n}x${k}_${tile}_s${splits}.txt"
    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section LaunchStats --metrics sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum.per_second,dram__bytes_read.sum \
        --print-details all --nvtx --nvtx-include profile/ python3 -m benchmarks.profile_shape --m $m --n $n --k $k \
        --recipe tensor --tile $tile --accum promoted --splits $splits --calls 2 > "$f" 2>&1
    echo "== $spec"
    grep -E "^  (kernel_|nvjet)|Duration  |SM Frequency|L2 Cache Throughput|dram__bytes_read.sum|SM: Pipe Tensor Cycles Active|Stall" "$f" \
      | sed -E 's/^  kernel_cutlass.*/  ours/' | cut -c1-120
  done
  ;;
widths)
  # Session 10: tile widths cuBLAS uses and the manifest lacks (128x160, 128x112) on the shapes whose waves
  # they would fill better than 128x128 / 128x192.
  python3 -m benchmarks.tune_tiles --ms 1024 --nk 7168x2048,7168x2304 --recipes tensor,row --accums promoted --splits 0 \
      --tiles 128x128c2x1,128x128c4x1,128x160c2x1,128x112c2x1,128x176c2x1 > "$out/w_m1024.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 6144 --nk 7168x2048,7168x2304,4608x7168 --recipes tensor --accums promoted --splits 0 \
      --tiles 128x192c2x1,128x160c2x1,128x144c2x1 > "$out/w_m6144.txt" 2>&1
  python3 -m benchmarks.tune_tiles --ms 1024,6144 --nk 7168x2048,4608x7168 --recipes tensor --accums fast --splits 0 \
      --tiles 128x256c2x1,128x192c2x1,128x160c2x1,128x128c4x1 > "$out/w_fast.txt" 2>&1
  grep -v Warn "$out"/w_*.txt | grep -v "^\s*$" | cut -c1-150
  ;;
c4check)
  # Session 10: shapes outside the measured set where the 4x1 row now wins dispatch (benchmarks/gpu_session.sh
  # clusters4 measured the rest), against what dispatch picked before (a last-wave split where it would).
  t="python3 -m benchmarks.tune_tiles --recipes tensor --splits 0"
  $t --ms 512 --nk 7168x4096,14336x2048 --accums promoted --tiles 128x128c4x1,128x128c2x1 > "$out/c4c_a.txt" 2>&1
  $t --ms 1024,1408 --nk 5120x4096 --accums promoted,fast --tiles 128x128c4x1,128x128c2x1,128x192c2x1 > "$out/c4c_b.txt" 2>&1
  $t --ms 1408 --nk 7168x7168,7168x2048 --accums promoted --tiles 128x128c4x1,128x192c2x1,128x192c2x1lw > "$out/c4c_c.txt" 2>&1
  $t --ms 6144 --nk 576x2048 --accums promoted --tiles 128x128c4x1,128x128c2x1 > "$out/c4c_d.txt" 2>&1
  grep -v Warn "$out"/c4c_*.txt | grep -v "^\s*$" | cut -c1-150
  ;;
overlap144)
  # Session 10: 144-wide promoted tiles with the two-fragment (overlapped) promotion, 240 consumer registers;
  # the same commands as the clusters4 / widths baselines for 128x144 c2x1.
  python3 -m pytest -m gpu -q -p no:warnings tests/test_sm90_gemm_gpu.py -k "every_manifest_tile" 2>&1 | tail -n 3
  t="python3 -m benchmarks.tune_tiles --accums promoted --splits 0"
  $t --ms 1024,2048,3072,4096,6144,8192 --nk 576x7168 --recipes tensor,row --tiles 128x144c2x1 > "$out/o144_narrow.txt" 2>&1
  $t --ms 1024 --nk 4608x7168 --recipes tensor,row --tiles 128x144c2x1,128x192c2x1,128x96c2x1 > "$out/o144_4608.txt" 2>&1
  $t --ms 6144 --nk 7168x2048,7168x2304,4608x7168 --recipes tensor --tiles 128x144c2x1,128x192c2x1 > "$out/o144_m6144.txt" 2>&1
  $t --ms 1024,6144 --nk 4608x7168,1536x7168 --recipes 1x128_128x128 --tiles 128x144c2x1,128x128c2x1,128x192c2x1 > "$out/o144_block.txt" 2>&1
  grep -v Warn "$out"/o144_*.txt | grep -v "^\s*$" | cut -c1-150
  ;;
rate144)
  # Session 10: 128x144 (now with overlapped promotion) against 128x192 over several waves, for its rate.
  t="python3 -m benchmarks.tune_tiles --accums promoted --splits 0 --tiles 128x144c2x1,128x192c2x1"
  $t --ms 8192,4096 --nk 8192x8192,4096x4096 --recipes tensor > "$out/r144_square.txt" 2>&1
  $t --ms 6144 --nk 1536x7168,3072x1536,7168x2304 --recipes tensor,row > "$out/r144_dsv3.txt" 2>&1
  $t --ms 4096,8192 --nk 8192x8192,4096x4096 --recipes row > "$out/r144_row.txt" 2>&1
  grep -v Warn "$out"/r144_*.txt | grep -v "^\s*$" | cut -c1-150
  ;;
s10)
  # Session 10 through scaled_mm (4x1 clusters, overlapped 144-wide promotion): the last-wave test, then the
  # square and DeepSeek-V3 sets, promoted and fast accumulation, next to cuBLAS.
  python3 -m pytest -m gpu -q -p no:warnings tests/test_sm90_small_m_gpu.py -k "last_wave" 2>&1 | tail -n 2
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes tensor,row --out "$out/gemm_promoted.json" > "$out/gemm_promoted.txt" 2>&1
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes tensor,row --fast-accum --out "$out/gemm_fast.json" > "$out/gemm_fast.txt" 2>&1
  for f in gemm_promoted gemm_fast; do grep -A 12 "^geomeans" "$out/$f.txt"; done
  ;;
c144)
  # Session 10: 144-wide tiles (overlapped promotion) in 4-CTA clusters on the narrow M=6144 / 3072 outputs.
  python3 -m benchmarks.tune_tiles --ms 6144,3072 --nk 576x7168 --recipes tensor,row --accums promoted,fast --splits 0 \
      --tiles 128x144c2x2,128x144c4x1,128x144c2x1,128x128c4x1,128x128c2x2 > "$out/c144.txt" 2>&1
  grep -v Warn "$out"/c144.txt | grep -v "^\s*$" | cut -c1-150
  ;;
c144check)
  # Session 10: shapes where the 128x144 rate 920 -> 970 moved dispatch to 128x144, against the old pick.
  t="python3 -m benchmarks.tune_tiles --recipes tensor --accums promoted --splits 0"
  $t --ms 1408 --nk 4608x4096 --tiles 128x144c2x1,64x192c2x1o2 > "$out/c144c_a.txt" 2>&1
  $t --ms 1408 --nk 7168x4096 --tiles 128x144c2x1,128x128c4x1 > "$out/c144c_b.txt" 2>&1
  $t --ms 1664 --nk 6144x4096 --tiles 128x144c2x1,128x192c2x1 > "$out/c144c_c.txt" 2>&1
  $t --ms 2048,4096 --nk 8192x4096,8192x1024 --tiles 128x144c2x1,128x128c2x1 > "$out/c144c_d.txt" 2>&1
  $t --ms 3072 --nk 4608x4096 --tiles 128x144c2x1,128x128c2x1 > "$out/c144c_e.txt" 2>&1
  grep -v Warn "$out"/c144c_*.txt | grep -v "^\s*$" | cut -c1-150
  ;;
s11)
  # Session 11: block-scaled tile rates (dispatch.BLOCK_TILE_RATES) and the 64x128 block row. GPU tests of the
  # block-scaled recipes (every block tile launched directly), the picks the new rates changed next to the
  # alternatives (last-wave splits as dispatch would), then the sets through scaled_mm.
  python3 -m pytest -m gpu -q -p no:warnings tests/test_sm90_blockscaled_gpu.py tests/test_sm90_small_m_gpu.py 2>&1 | tail -n 3
  tt="python3 -m benchmarks.tune_tiles --accums promoted --recipes 1x128_128x128 --splits 0"
  $tt --ms 8192 --nk 8192x8192 --tiles 128x192c2x1lw,128x128c2x1lw,128x192c2x1,128x128c2x1 2>&1 | grep -v Warn | cut -c1-112
  $tt --ms 1024 --nk 4608x7168 --tiles 128x128c2x1lw,128x192c2x1lw,64x192c2x1o2 2>&1 | grep -v Warn | cut -c1-112
  $tt --ms 6144 --nk 512x7168 --tiles 128x128c2x1lw,64x128c1x2 2>&1 | grep -v Warn | cut -c1-112
  $tt --ms 1024 --nk 576x7168,512x7168 --tiles 64x128c1x2,128x128c2x1 2>&1 | grep -v Warn | cut -c1-112
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes 1x128_128x128,128x128_128x128,1x128_1x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_block.txt"
  ;;
s12)
  # Session 12: A/W descriptors from the warp group's uniform slice. The block-scaled sets and the per-tensor /
  # row-wise sets through scaled_mm (each with cuBLAS in the same process).
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes 1x128_128x128,128x128_128x128,1x128_1x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_block.txt"
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes tensor,row --out "$out/gemm_promoted.json" > "$out/gemm_promoted.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_promoted.txt"
  ;;
s12tiles)
  # Session 12: with the shorter block-scaled main loop, 128x128 (two fragments, overlapped) against 128x192
  # (one fragment, serial) where dispatch picks 128x192 or the two are close; two rounds.
  tt="python3 -m benchmarks.tune_tiles --accums promoted --recipes 1x128_128x128 --splits 0"
  for round in 1 2; do
    $tt --ms 8192 --nk 8192x8192 --tiles 128x192c2x1lw,128x128c2x1lw,128x192c2x1,128x128c2x1 2>&1 | grep -v Warn | cut -c1-112
    $tt --ms 6144 --nk 4608x7168,1536x7168,7168x2304 --tiles 128x192c2x1,128x128c2x1 2>&1 | grep -v Warn | cut -c1-112
    $tt --ms 1024 --nk 4608x7168,1536x7168 --tiles 128x192c2x1lw,128x128c2x1lw,128x192c2x1,128x128c2x1 2>&1 | grep -v Warn | cut -c1-112
  done
  ;;
s12c4)
  # Session 12: 4x1 clusters for the block-scaled recipes where per-tensor takes them (narrow N), now that the
  # block main loop is no longer bound by its own instruction issue; two rounds.
  tt="python3 -m benchmarks.tune_tiles --accums promoted --recipes 1x128_128x128,128x128_128x128 --splits 0"
  for round in 1 2; do
    $tt --ms 6144,3072 --nk 576x7168,512x7168 --tiles 128x128c4x1,128x128c2x1,64x128c1x2 2>&1 | grep -v Warn | cut -c1-112
    $tt --ms 1408 --nk 5120x4096 --tiles 128x128c4x1,128x128c2x1,128x192c2x1 2>&1 | grep -v Warn | cut -c1-112
  done
  ;;
s12c4picks)
  # Session 12: the DeepSeek-recipe shapes a block-scaled 128x128 4x1 row takes over in dispatch, against
  # the 2x1 tile they had (and its last-wave split variant, as dispatch would split); two rounds.
  tt="python3 -m benchmarks.tune_tiles --accums promoted --recipes 1x128_128x128 --splits 0 --tiles 128x128c4x1,128x128c2x1,128x128c2x1lw"
  for round in 1 2; do
    $tt --ms 1024 --nk 1536x7168,7168x2048,4608x7168,7168x2304,5120x4096 2>&1 | grep -v Warn | cut -c1-112
    $tt --ms 512 --nk 7168x4096 2>&1 | grep -v Warn | cut -c1-112
    $tt --ms 1408 --nk 7168x4096 2>&1 | grep -v Warn | cut -c1-112
    $tt --ms 6144 --nk 512x7168 2>&1 | grep -v Warn | cut -c1-112
    $tt --ms 8192 --nk 576x7168 2>&1 | grep -v Warn | cut -c1-112
  done
  ;;
sass)
  # SASS of the K loop (instructions, static stall cycles, mix per loop trip): cuobjdump is on this machine.
  python3 -m benchmarks.sass_loop --recipes tensor,1x128_128x128,128x128_128x128 --shape 4096x4096x4096 2>&1 | grep -v Warn
  ;;
s12final)
  # Session 12, final: the block-scaled GPU tests (every block manifest row launched directly, the new 4x1 row
  # included), then the sets through scaled_mm.
  python3 -m pytest -m gpu -q -p no:warnings tests/test_sm90_blockscaled_gpu.py 2>&1 | tail -n 3
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes 1x128_128x128,128x128_128x128,1x128_1x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_block.txt"
  ;;
s12other)
  # Session 12: the paths the consumer changes touched besides the promoted cooperative loop: decode (swapped
  # small-M kernels) and fast accumulation, through scaled_mm with cuBLAS in the same process.
  python3 -m benchmarks.bench_gemm --sets llama70b_decode,llama70b_layers --recipes tensor,row --out "$out/decode.json" > "$out/decode.txt" 2>&1
  grep -A 6 "^geomeans" "$out/decode.txt"
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes tensor,row --fast-accum --out "$out/fast.json" > "$out/fast.txt" 2>&1
  grep -A 6 "^geomeans" "$out/fast.txt"
  ;;
s12lw)
  # Session 12: picks a last-wave-split-aware wave_cost would change (the current pick against the one with a
  # split last wave, split as dispatch would), two rounds.
  tt="python3 -m benchmarks.tune_tiles --accums promoted --splits 0"
  for round in 1 2; do
    $tt --recipes tensor --ms 1408 --nk 7168x7168 --tiles 128x128c4x1,128x192c2x1lw 2>&1 | grep -v Warn | cut -c1-112
    $tt --recipes tensor --ms 4096 --nk 8192x7168 --tiles 128x128c2x1,128x192c2x1lw 2>&1 | grep -v Warn | cut -c1-112
    $tt --recipes tensor --ms 8192 --nk 5120x7168 --tiles 128x128c2x1,128x192c2x1lw 2>&1 | grep -v Warn | cut -c1-112
    $tt --recipes 1x128_128x128 --ms 1408 --nk 3072x7168,7168x7168 --tiles 128x128c4x1,128x128c2x1lw 2>&1 | grep -v Warn | cut -c1-112
    $tt --recipes 1x128_128x128 --ms 3072 --nk 1536x7168 --tiles 128x128c4x1,128x128c2x1lw 2>&1 | grep -v Warn | cut -c1-112
    $tt --recipes 1x128_128x128 --ms 3072,6144 --nk 7168x7168,4608x7168 --tiles 128x192c2x1,128x128c2x1lw 2>&1 | grep -v Warn | cut -c1-112
    $tt --recipes 1x128_128x128 --ms 8192 --nk 576x7168 --tiles 128x128c4x1,128x192c2x1lw 2>&1 | grep -v Warn | cut -c1-112
  done
  ;;
s12narrow)
  # Session 12: narrow, long-K outputs (the weakest DeepSeek-V3 shapes) on 128x192 tiles with a split last wave
  # (split as dispatch would) against dispatch's picks; two rounds.
  tt="python3 -m benchmarks.tune_tiles --accums promoted --splits 0"
  for round in 1 2; do
    $tt --recipes tensor,1x128_128x128 --ms 6144,4096,3072 --nk 576x7168 --tiles 128x192c2x1lw,128x128c4x1,128x144c2x1 2>&1 | grep -v Warn | cut -c1-112
    $tt --recipes tensor,1x128_128x128 --ms 6144 --nk 512x7168 --tiles 128x192c2x1lw,128x128c4x1,128x128c2x1lw,64x192c2x1so2 2>&1 | grep -v Warn | cut -c1-112
  done
  ;;
s13)
  # Session 13: 4x1 clusters walk 4 cluster rows per raster group (gemm_plan.raster_group_m). The sets through
  # scaled_mm, each with cuBLAS in the same process: block-scaled, per-tensor / row-wise, fast accumulation.
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes 1x128_128x128,128x128_128x128,1x128_1x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_block.txt"
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes tensor,row --out "$out/gemm_promoted.json" > "$out/gemm_promoted.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_promoted.txt"
  python3 -m benchmarks.bench_gemm --sets dsv3 --recipes tensor,row --fast-accum --out "$out/gemm_fast.json" > "$out/gemm_fast.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_fast.txt"
  ;;
s13audit)
  # Session 13: every promoted tile on every DeepSeek-V3 shape (splits as dispatch would give them), to
  # audit dispatch's picks against the best tile measured; per-tensor twice, DeepSeek recipe once.
  dsv3=1536x7168,3072x1536,576x7168,7168x256,7168x2048,4608x7168,7168x2304,512x7168,4096x512
  tt="python3 -m benchmarks.tune_tiles --accums promoted --splits 0 --ms 1024,6144 --nk $dsv3"
  t=128x192c2x1,128x144c2x1,128x128c2x1,128x128c4x1,128x96c2x1,128x96c1x2,128x128c1x2,64x192c2x1o2,64x192c2x1so2,64x128c1x2,64x96c2x2,64x64c1x2,128x192c2x1lw
  for round in 1 2; do $tt --recipes tensor --tiles $t 2>&1 | grep -v Warn > "$out/audit_tensor_$round.txt"; done
  tb=128x192c2x1,128x128c2x1,128x128c4x1,128x128c1x2,64x128c1x2,64x192c2x1o2,128x192c2x1lw,128x128c2x1lw
  $tt --recipes 1x128_128x128 --tiles $tb 2>&1 | grep -v Warn > "$out/audit_block.txt"
  python3 -m benchmarks.audit_picks "$out"/audit_tensor_*.txt | tail -n 1
  python3 -m benchmarks.audit_picks "$out/audit_block.txt" | tail -n 1
  ;;
s14c22)
  # Session 14: 2x2 clusters (both operands multicast) against dispatch's tiles on the narrow / long-K
  # DeepSeek-V3 shapes, per-tensor twice and DeepSeek recipe once (splits as dispatch would give them).
  t=128x96c2x1,128x112c2x2,128x128c2x2,128x96c2x2,128x64c2x2,128x144c2x2,128x192c2x2,128x128c4x1,64x96c2x2,128x112c2x1
  tt="python3 -m benchmarks.tune_tiles --accums promoted --splits 0"
  for round in 1 2; do
    $tt --ms 1024 --nk 1536x7168,576x7168,512x7168,4608x7168,7168x2048,7168x2304 --recipes tensor --tiles $t 2>&1 | grep -v Warn > "$out/c22_1024_$round.txt"
    $tt --ms 6144 --nk 576x7168,512x7168,1536x7168 --recipes tensor --tiles $t 2>&1 | grep -v Warn > "$out/c22_6144_$round.txt"
  done
  $tt --ms 1024,6144 --nk 1536x7168,576x7168,4608x7168,7168x2304 --recipes 1x128_128x128 \
      --tiles 128x128c2x1,128x128c2x2,128x112c2x2,128x192c2x1,128x192c2x2,128x128c4x1,128x96c2x2 2>&1 | grep -v Warn > "$out/c22_block.txt"
  cut -c1-112 "$out"/c22_1024_1.txt "$out"/c22_6144_1.txt
  ;;
s15final)
  # Session 15: the block-scaled GPU tests and compile tier on the read-ahead loop, then the block-scaled sets
  # through scaled_mm. (The A/B of the read-ahead and the variants dropped, run from uncommitted switches,
  # is in BENCHMARKS.md with the tune_tiles commands it ran.)
  python3 -m pytest -m gpu -q -p no:warnings tests/test_sm90_blockscaled_gpu.py tests/test_sm90_compile.py 2>&1 | tail -n 2
  python3 -m benchmarks.bench_gemm --sets square,dsv3 --recipes 1x128_128x128,128x128_128x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_block.txt"
  ;;
s16final)
  # Session 16: the block-scaled GPU tests (the dispatch change moves M=768-3072 N=3072 K=1536 to 128x192), then
  # the DeepSeek-V3 set through scaled_mm for the block-scaled and epilogue-scaled recipes. (The variants measured
  # and dropped ran from uncommitted switches; BENCHMARKS.md gives the tune_tiles commands.)
  python3 -m pytest -m gpu -q -p no:warnings tests/test_sm90_blockscaled_gpu.py 2>&1 | tail -n 2
  python3 -m benchmarks.bench_gemm --sets dsv3 --recipes 1x128_128x128,128x128_128x128,tensor,row --out "$out/gemm_dsv3.json" > "$out/gemm_dsv3.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_dsv3.txt"
  ;;
s17final)
  # Session 17: the per-tensor scales read once per CTA. The epilogue-scaled sets through scaled_mm (two rounds),
  # the per-tensor decode set and layer chain (the decode kernels now wait for the previous grid in their
  # consumers too). Run after `tests`. (The variants measured and dropped ran from uncommitted switches.)
  for r in 1 2; do
    python3 -m benchmarks.bench_gemm --sets dsv3,square --recipes tensor,row --out "$out/gemm_dsv3_$r.json" > "$out/gemm_dsv3_$r.txt" 2>&1
    grep -A 5 "geomeans" "$out/gemm_dsv3_$r.txt"
  done
  python3 -m benchmarks.bench_gemm --sets llama70b_decode --recipes tensor --out "$out/decode.json" > "$out/decode.txt" 2>&1
  grep -A 2 "geomeans" "$out/decode.txt"
  python3 -m benchmarks.bench_decode_chain --ms 1,16,64,128 --layers 8 --recipes tensor 2>&1 | tail -n 8
  ;;
s18)
  # Session 18 (no GPU was lent; prepared for the next session): the new several-tiles-per-CTA test for every
  # block-scaled row on the committed kernels. (The scale-staging experiments prepared the same session are on
  # the local branches exp/scale-ring -- exp/ring.sh, exp/land_ab.sh -- and land/lag1; not on main.)
  python3 -m pytest -m gpu -q -p no:warnings tests/test_sm90_blockscaled_gpu.py -k several_tiles 2>&1 | tail -n 3
  ;;
s14pow)
  # Session 14: per-tensor against the DeepSeek recipe on the same tiles (and cuBLAS's kernels): SM clock,
  # tensor-pipe activity, issue-slot use (ncu, one profiled call each after a warm one).
  for spec in "6144 1536 7168 tensor 128x192c2x1" "6144 1536 7168 1x128_128x128 128x192c2x1" \
              "6144 1536 7168 1x128_128x128 128x128c2x1" "6144 1536 7168 tensor 128x128c2x1" \
              "8192 8192 8192 tensor 128x192c2x1" "8192 8192 8192 1x128_128x128 128x192c2x1"; do
    read -r m n k r tile <<< "$spec"
    f="$out/ncu_${m}x${n}x${k}_${r}_${tile}.txt"
    ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --metrics sm__cycles_elapsed.avg.per_second --print-details all --nvtx --nvtx-include profile/ \
        python3 -m benchmarks.profile_shape --m $m --n $n --k $k --recipe $r --tile $tile --splits 1 --calls 2 > "$f" 2>&1
    echo "== $spec"
    grep -E "^  (kernel_|nvjet)|Duration  |SM Frequency|SM: Pipe Tensor Cycles Active|Issue Slots Busy" "$f" \
      | sed -E 's/^  kernel_cutlass.*/  ours/' | cut -c1-120
  done
  ;;
s20ties)
  # Session 20: 128x192 against 128x128 (c2x1, with and without their last-wave splits where dispatch splits) on
  # shapes where dispatch.wave_cost ties them for the block-W recipes (ROUND=1|2 names the output files).
  t2=128x192c2x1,128x128c2x1; t4=$t2,128x192c2x1lw,128x128c2x1lw
  for rec in ${RECIPES:-1x128_128x128 128x128_128x128}; do
    f="$out/ties_${rec}_${ROUND:-1}.txt"; : > "$f"
    tt="python3 -m benchmarks.tune_tiles --accums promoted --splits 0 --recipes $rec"
    for spec in "768 7168x2048,8192x8192 $t2" "1024 4608x7168,6144x4096 $t4" "1536 4096x4096,8192x8192 $t2" \
                "2048 3072x1536,6144x4096 $t2" "3072 8192x8192,4096x14336 $t2" "4096 1536x7168,3072x1536 $t2" \
                "6144 7168x2048,3072x1536,8192x8192,6144x4096 $t4" "8192 4608x7168 $t4" "16384 3072x1536 $t2" \
                "512 10240x8192 $t4" "1024 24576x1536 $t2" "1536 4096x14336 $t2" "6144 10240x8192 $t4" "16384 8192x8192 $t4"; do
      read -r m nk tiles <<< "$spec"
      $tt --ms $m --nk $nk --tiles $tiles 2>&1 | grep -v Warn >> "$f"
    done
    python3 -m benchmarks.audit_picks "$f" | tail -n 1
  done
  ;;
s20prof)
  # Session 20: where the DeepSeek recipe's 128x128 main loop loses its ~6% to per-tensor on the same tile: ncu
  # warp-state sampling per SASS instruction (SourceCounters), one launch of each, exported as CSV for reading.
  for r in tensor 1x128_128x128; do
    ncu --clock-control none --section WarpStateStats --section SourceCounters --kernel-name regex:kernel_cutlass \
        --launch-count 1 --nvtx --nvtx-include profile/ -f -o "$out/prof_$r" \
        python3 -m benchmarks.profile_shape --m 6144 --n 7168 --k 2304 --recipe $r --tile 128x128c2x1 --splits 1 --calls 2 \
        > "$out/prof_$r.log" 2>&1
    ncu --import "$out/prof_$r.ncu-rep" --page source --csv --print-source sass > "$out/prof_${r}_sass.csv" 2>&1
    ncu --import "$out/prof_$r.ncu-rep" --page details --print-details all > "$out/prof_${r}_details.txt" 2>&1
    echo "== $r"; grep -E "Duration|Warp Cycles Per Issued|Stall" "$out/prof_${r}_details.txt" | head -n 12
  done
  ;;
s20final)
  # Session 20: the block-scaled GPU tests and the AOT registry's, then the DeepSeek recipe through scaled_mm on
  # the DeepSeek-V3, square and block_ties sets (dispatch's long-K rate moves ties at K >= dispatch.LONG_K to 128x192).
  python3 -m pytest -m gpu -q -p no:warnings tests/test_sm90_blockscaled_gpu.py tests/test_generators.py 2>&1 | tail -n 3
  python3 -m benchmarks.bench_gemm --sets dsv3,square,block_ties --recipes 1x128_128x128 --out "$out/gemm_block.json" > "$out/gemm_block.txt" 2>&1
  grep -A 8 "^geomeans" "$out/gemm_block.txt"
  ;;
promoted)
  python3 -m benchmarks.bench_gemm --sets square,dsv3,llama70b_decode,llama70b_layers --recipes tensor,row --out "$out/gemm_promoted.json" > "$out/gemm_promoted.txt" 2>&1
  grep -A 12 "^geomeans" "$out/gemm_promoted.txt"
  ;;
esac
tar -czf "/tmp/results-${1:-tests}.tar.gz" -C "$out" --exclude='*.tar.gz' . && mv "/tmp/results-${1:-tests}.tar.gz" "$out/"
