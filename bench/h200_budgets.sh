#!/usr/bin/env bash
# One device call: HTTP throughput of the GPU server at several packing budgets (issue 11), the
# same load as bench/h200_throughput.sh (bench/http_load.py, the 256-token 3-question request,
# every answer checked byte for byte against its single-client answer) with `serve
# --batch-sequences S --batch-tokens T` for each S:T of BUDGETS. A larger budget packs more
# requests per forward (fewer, longer engine rounds): more requests/s, longer waits.
#   BUDGETS="64:8192 96:8192 128:12288" CLIENTS=16,64 DURATION=8 bash bench/h200_budgets.sh
# SERVE_ARGS adds `serve` flags to every run (e.g. SERVE_ARGS="--question-tree two-level").
# Writes $OUT/budget-S-T.json per budget, $OUT/load.log and $OUT/summary.txt (at most 8 files:
# up to 6 budgets). Needs .gpu/imajev-serve; python3 with the standard library only.
set -uo pipefail
# shellcheck disable=SC2086  # SERVE_ARGS is a list of words
source bench/device_env.sh
rm -f "$OUT/gpu.txt"
W=${WORK:-/tmp/bench}
port=18790
for b in ${BUDGETS:-64:8192 96:8192 128:12288}; do
  s=${b%%:*} t=${b##*:} t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/http_load.py --bin .gpu/imajev-serve --work "$W" --port $port \
    --duration "${DURATION:-8}" --clients "${CLIENTS:-16,64}" --start-timeout 240 --server-log "$W/server-$s-$t.log" \
    --out "$OUT/budget-$s-$t.json" -- --device cuda --quantize fp8 --rotations 4 --contract imajev \
    --batch-sequences "$s" --batch-tokens "$t" ${SERVE_ARGS:-} >>"$OUT/load.log" 2>&1
  echo "budget $s sequences / $t tokens: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/load.log"
  port=$((port + 1))
done
reports=()
for b in ${BUDGETS:-64:8192 96:8192 128:12288}; do reports+=("$OUT/budget-${b%%:*}-${b##*:}.json"); done
python3 bench/http_load.py --print-report "${reports[@]}" | tee "$OUT/summary.txt"
