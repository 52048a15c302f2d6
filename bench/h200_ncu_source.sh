#!/usr/bin/env bash
# Nsight Compute source-level (SASS) profile of one kernel launch: where its warps stall, per
# instruction. Runs bench/gpu_ops.rs under ncu like h200_ncu.sh, with the SourceCounters section,
# then prints the report's source page as CSV (one row per SASS instruction: executed count,
# stall samples by reason) gzipped to $OUT/$NAME-sass.csv.gz; bench/ncu_source_summary.py reads it
# here (the hottest instructions with their stall reasons, and totals by reason).
#   KERNELS='regex:^gdn_chunk_scan_tf32_pipelined_128$' ONLY=deltanet LENGTHS=16384 NAME=scan \
#     bash bench/h200_ncu_source.sh
set -uo pipefail
source bench/device_env.sh
NAME=${NAME:-source}
if ! command -v ncu >/dev/null; then
  echo "ncu is not on this machine's PATH" | tee "$OUT/$NAME.txt"
  exit 0
fi
rep=/tmp/$NAME
timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none --kernel-name "$KERNELS" \
  --launch-skip "${SKIP:-2}" --launch-count 1 --import-source no \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy \
  -f -o "$rep" ./.gpu/gpu-ops --only "$ONLY" --lengths "${LENGTHS:-16384}" >"$OUT/$NAME.txt" 2>&1
echo "ncu exit $?" | tee -a "$OUT/$NAME.txt"
ncu --import "$rep.ncu-rep" --page details >>"$OUT/$NAME.txt" 2>&1
ncu --import "$rep.ncu-rep" --page source --csv --print-source sass 2>>"$OUT/$NAME.txt" | gzip -9 >"$OUT/$NAME-sass.csv.gz"
ls -la "$OUT"
