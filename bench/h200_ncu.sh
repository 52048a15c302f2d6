#!/usr/bin/env bash
# Nsight Compute profiles of single kernels (hardware counters: they exist on the device's
# Firecracker runtime only; on gVisor ncu fails to initialise and this says so and exits 0).
# Runs bench/gpu_ops.rs under ncu on the groups and lengths given, profiling COUNT launches of
# each kernel matched by KERNELS after skipping SKIP of them (the warm-up), with the sections that
# say where a latency-bound kernel waits (warp states, scheduler, occupancy, memory). Clocks are
# left alone (--clock-control none, as the device's METHOD.md asks). Needs .gpu/gpu-ops.
#   KERNELS='regex:...' ONLY=deltanet LENGTHS=16384 bash bench/h200_ncu.sh   -> $OUT/ncu.txt
# NAME=<file stem> (default ncu) names the report, so one call can write several; extra
# environment (e.g. IMAJEV_GDN_SCAN=split) passes through to gpu-ops.
set -uo pipefail
source bench/device_env.sh
KERNELS=${KERNELS:-'regex:^(gdn_chunk_scan_tf32_pipelined_128|gdn_chunk_scan_tc_pipelined_128|attn_fwd_ws_256|attn_fwd_wgmma_256)$'}
if ! command -v ncu >/dev/null; then
  echo "ncu is not on this machine's PATH" | tee "$OUT/${NAME:-ncu}.txt"
  exit 0
fi
timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --kernel-name "$KERNELS" \
  --launch-skip "${SKIP:-2}" --launch-count "${COUNT:-4}" \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  ./.gpu/gpu-ops --only "${ONLY:-attention,deltanet}" --lengths "${LENGTHS:-16384}" >"$OUT/${NAME:-ncu}.txt" 2>&1
echo "ncu exit $?" | tee -a "$OUT/${NAME:-ncu}.txt"
python3 bench/ncu_summary.py "$OUT/${NAME:-ncu}.txt"
