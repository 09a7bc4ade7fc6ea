#!/usr/bin/env bash
# Time whole sets of Hopper kernel files against each other in one device call (an A/B without a branch: the
# device copy's git history does not follow local commits, so each variant is a directory of kernels/sm90 files).
#
#   bash benchmarks/kernel_variants.sh VARIANTS_DIR "base vA base vB" "<benchmarks.tune_tiles arguments>"
#
# For each name in turn, VARIANTS_DIR/<name>/*.py replace their namesakes in kernels/sm90 ("base": the checkout's
# own files, unchanged), then tune_tiles runs with --accums promoted --splits 1 and the given arguments in a JIT
# cache of that name's own (a variant named twice reuses it, so interleaved repeats do not recompile). The
# checkout's files are put back at the end. Output lines carry the variant's name; the raw lines go to
# $OUT/variants.txt when $OUT is set. Session 30's sets (W scales by TMA and its split-N variants) were
# exp_sass/s30/{vA,vC,v3,v5,v6}, from exp_sass/s30/w_scales_by_tma.patch.
set -u
dir=$1; names=$2; args=$3
keep=$(mktemp -d)
cp kernels/sm90/*.py "$keep"/
log=${OUT:-/tmp}/variants.txt
for v in $names; do
  cp "$keep"/*.py kernels/sm90/
  [ "$v" = base ] || cp "$dir/$v"/*.py kernels/sm90/
  CUTEDSL_GEMM_CACHE_DIR=/tmp/cutedsl_variant_$v python3 -m benchmarks.tune_tiles --accums promoted --splits 1 $args 2>&1 \
    | grep -E "M=| tune|rror" | sed "s/^/$v /" | tee -a "$log"
done
cp "$keep"/*.py kernels/sm90/
rm -rf "$keep"
