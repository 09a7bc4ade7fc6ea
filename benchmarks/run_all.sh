#!/usr/bin/env bash
# Everything that runs on a Hopper GPU, from a checkout with the package installed (pip install -e .):
#   bash benchmarks/run_all.sh tests          the GPU test tier (pytest -m gpu)
#   bash benchmarks/run_all.sh bench          every benchmark that writes a result file into benchmarks/results/:
#                                             floor first (the others read it), then the pieces below in turn
#   bash benchmarks/run_all.sh PIECE...       some of the pieces, each well under 10 minutes with a warm kernel cache:
#     floor          measure_floor: this GPU's floors (benchmarks/results/floor.json)                  ~1 min
#     bench-gemm     bench_gemm: FP8 per set and recipe, fast accumulation, quantize + GEMM, INT8       ~5 min
#     bench-ops      quantization, one kernel vs two, weight-only (int4, int8), host cost               ~5 min
#     bench-sweep    the serving-batch sweep (compiles its instances first)                             ~8 min
#     bench-decode   decode GEMMs back to back (and over the sweep's layers), the linear stack          ~5 min
#     bench-models   the 32-layer Llama-3-8B-shaped model, checkpoint load times (needs .[models])       ~9 min
#     bench-moe      mixture of experts: grouped GEMMs over MoE shapes (row-wise, DeepSeek's), the MoE blocks, a
#                    Qwen3-30B-A3B model                                                               ~10 min
#   bash benchmarks/run_all.sh OPTION...      runs that decide kernel options, both ways in one run (no result file):
#     options-routing  the MoE routing kernels against the sort path, the MoE block at decode and prefill ~3 min
#     options-tiles    the grouped GEMM's 64x256 tile against 64x128 at decode (row-wise and per tensor) and
#                      128x192 against 128x128 at prefill (both layouts), each timed twice in turns   ~10 min
#     options-prefill  the grouped GEMM at prefill: the table's picks against its tiles without clusters, with
#                      them everywhere and with the row-wise scales read after the main loop (their GPU tests
#                      first), timed twice in turns                                                  ~7 min
#     options-mid-m    the dense GEMM at M = 96 and 128: every candidate tile over the sweep's layers, twice in
#                      turns (benchmarks.audit_picks scores dispatch's picks from the log)           ~6 min
#   bash benchmarks/run_all.sh                tests, then bench
# Each piece but floor measures the floors first if floor.json is missing or from another GPU. With LOG_DIR set,
# each piece's output also goes to $LOG_DIR/<piece>.log. The times assume compiled kernels in the disk cache: a
# cold cache adds the compiles (cutedsl-gemm precompile fills it ahead).
# Then `python -m benchmarks.render` rewrites BENCHMARKS.md and the README's performance table from the results.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
PIECES="floor bench-gemm bench-ops bench-sweep bench-decode bench-models bench-moe"
OPTIONS="options-routing options-tiles options-prefill options-mid-m"

run_tests() {
  "$py" -m pytest -m gpu -q -rs -p no:cacheprovider tests  # -rs: every skip with its reason
}

floor() {
  "$py" -m benchmarks.measure_floor
}

need_floor() {  # the floors of this GPU, measured unless floor.json holds them already
  "$py" -c "from benchmarks import common; common.measured_floors()" 2>/dev/null || floor
}

bench_gemm() {
  need_floor
  all_recipes=tensor,row,1x128_128x128,128x128_128x128,1x128_1x128
  "$py" -m benchmarks.bench_gemm --sets dsv3 --recipes "$all_recipes"
  "$py" -m benchmarks.bench_gemm --sets decode --recipes tensor,row,1x128_128x128
  "$py" -m benchmarks.bench_gemm --sets square --recipes "$all_recipes"
  "$py" -m benchmarks.bench_gemm --sets dsv3 --recipes tensor,row --fast-accum
  "$py" -m benchmarks.bench_gemm --e2e
  "$py" -m benchmarks.bench_gemm --sets square,dsv3 --recipes int8 --name gemm_int8
  "$py" -m benchmarks.bench_gemm --sets llama70b_decode --recipes int8 --name gemm_int8_decode
}

bench_ops() {
  need_floor
  "$py" -m benchmarks.bench_quantize --shape 8192x8192 --dtype bf16
  "$py" -m benchmarks.bench_quantize_scaled_mm --ms 1,2,4,8,16,32
  "$py" -m benchmarks.bench_weight_only --ms 1,16,128,1024,4096
  "$py" -m benchmarks.bench_weight_only --ms 1,16,128,1024,4096 --bits 8 --group 0 --name weight_only_int8
  "$py" -m benchmarks.host_cost --calls 1000
}

bench_sweep() {
  need_floor
  "$py" -m benchmarks.bench_sweep --precompile-only
  "$py" -m benchmarks.bench_sweep
}

bench_decode() {
  need_floor
  "$py" -m benchmarks.bench_decode_chain --ms 1,16,64,128 --layers 8 --recipes row,tensor
  "$py" -m benchmarks.bench_decode_chain --sweep --recipes tensor,row,1x128_128x128
  "$py" -m benchmarks.bench_linear_stack --layers 8 --recipe row --ms 1,16,4096 --eager-ms 1
}

bench_models() {
  need_floor
  # needs .[models]; the full-depth model, every Hopper recipe, the LM head bf16 and converted, the step split
  "$py" -m benchmarks.bench_model --layers 32 --recipes row,deepseek,int8,int4_weight --lm-head both --split \
    --compile --compile-recipes row --compile-batches 1
  "$py" -m benchmarks.bench_load --layers 8  # from_pretrained (bf16 -> row, FP8) vs transformers + convert
}

bench_moe() {
  need_floor
  # needs .[models]; the grouped GEMMs against torch's, then the MoE blocks and the full-depth Qwen3-30B-A3B model
  "$py" -m benchmarks.bench_grouped --tokens 128,4096,16384 --routing uniform,skewed --layouts contiguous,masked
  "$py" -m benchmarks.bench_grouped --recipe deepseek --models dsv3,qwen3_235b --tokens 128,4096,16384 \
    --routing uniform --layouts contiguous,masked
  "$py" -m benchmarks.bench_moe --what block
  "$py" -m benchmarks.bench_moe --what model --split --fuse
}

options_routing() {
  need_floor
  "$py" -m benchmarks.bench_moe --what block --recipes row,deepseek --sort-routing --bf16-experts grouped_mm \
    --batches 1,16,64,256,512 --prefill 4096 --no-save
}

options_tiles() {
  need_floor
  # each tile named in full (a field left out keeps the table's pick, which already holds the wide tiles)
  local decode="--models qwen3_30b,dsv3,qwen3_235b --tokens 1,16,64,128 --routing uniform --layouts contiguous,masked"
  local prefill="--models mixtral,dsv3,qwen3_235b --tokens 4096,16384 --routing uniform --layouts contiguous,masked"
  for recipe in row tensor; do
    for round in 1 2; do
      "$py" -m benchmarks.bench_grouped $decode --recipe $recipe --tile-m 64 --tile-n 128 --no-save
      "$py" -m benchmarks.bench_grouped $decode --recipe $recipe --tile-m 64 --tile-n 256 --no-save
    done
  done
  for round in 1 2; do
    "$py" -m benchmarks.bench_grouped $prefill --tile-m 128 --tile-n 128 --cluster-m 1 --no-save
    "$py" -m benchmarks.bench_grouped $prefill --tile-m 128 --tile-n 192 --cluster-m 1 --no-save
  done
}

options_prefill() {
  need_floor
  # at prefill, the table's picks (row-wise scales staged in shared memory on the 128-row tiles; 2x1 clusters, W
  # multicast to pairs of m tiles, where sm90_grouped.clusters_pay) against the same tiles without clusters, with
  # them everywhere, and with the scales read after the main loop
  local prefill="--models mixtral,dsv3,qwen3_235b,qwen3_30b --tokens 4096,8192,16384 --routing uniform --layouts contiguous"
  timeout 300 "$py" -m pytest -m gpu -q -p no:cacheprovider tests/test_grouped_gpu.py \
    -k "clusters or staged"  # correct before timed
  for round in 1 2; do
    "$py" -m benchmarks.bench_grouped $prefill --no-save
    "$py" -m benchmarks.bench_grouped $prefill --cluster-m 1 --no-save
    "$py" -m benchmarks.bench_grouped $prefill --cluster-m 2 --no-save
    "$py" -m benchmarks.bench_grouped $prefill --early-row-scales off --no-save
  done
}

options_mid_m() {
  need_floor
  # the dense GEMM from M = 65 to 128 rows: every candidate tile, dispatch's among them, over the sweep's 13 layers,
  # twice in turns; benchmarks.audit_picks reads the log back (no GPU) and scores dispatch's picks against the
  # best tile of each shape
  local tiles="64x64c1x1s,64x64c1x1,64x96c2x2,64x128c1x1,64x128c2x1,128x64c1x1,128x96c1x1,128x128c1x1,128x128c2x1"
  "$py" -m benchmarks.tune_tiles --splits 0 --rounds 2 --recipes tensor,row --accums promoted --ms 96,128 \
    --nk sweep --tiles "$tiles"
}

piece() {  # one piece: bench-gemm runs the function bench_gemm, after a line naming the GPU and its clocks
  echo "== $1: $(nvidia-smi --query-gpu=name,power.limit,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader)"
  "${1//-/_}"
}

run_piece() {  # a piece, its output also in $LOG_DIR/<piece>.log when LOG_DIR is set
  if [ -n "${LOG_DIR:-}" ]; then
    mkdir -p "$LOG_DIR"
    piece "$1" 2>&1 | tee "$LOG_DIR/$1.log"
  else
    piece "$1"
  fi
}

usage() {
  echo "usage: bash benchmarks/run_all.sh [tests|bench|all|PIECE...|OPTION...]; pieces: $PIECES; options: $OPTIONS" >&2
  exit 2
}

[ $# -gt 0 ] || set -- all
for what in "$@"; do
  case " $PIECES $OPTIONS " in *" $what "*) continue ;; esac
  case "$what" in tests|bench|all) ;; *) usage ;; esac
done
for what in "$@"; do
  case "$what" in
    tests) run_tests ;;
    bench) for piece in $PIECES; do run_piece "$piece"; done ;;
    all) run_tests; for piece in $PIECES; do run_piece "$piece"; done ;;
    *) run_piece "$what" ;;
  esac
done
