#!/usr/bin/env bash
# One device call: HTTP throughput of the GPU server under concurrent clients (issue 11), with
# bench/http_load.py against `serve` on the synthetic Qwen3.5-4B (real shapes, random weights) that
# bench/gpu_bench.py builds, served as the benchmark serves it (--device cuda --quantize fp8
# --rotations 4 --contract imajev):
#   1. cross-request packing on (the default budget): clients 1, 4, 16, 64 → $OUT/throughput.json,
#      rows for bench/results/h200.json's "throughput";
#   2. the same at 16 clients with packing off: --batch-sequences = one request's sequences (its
#      prefix and passes, one-level tree), so each forward holds one request's whole tree, as
#      before issue 11 → $OUT/throughput-unpacked.json.
# Each run checks every answer under load against the same request's answer alone, byte for byte;
# the summary also says whether both servers gave the same answers and how many requests each
# engine round answered (1.0 in run 2 proves packing was off).
# Needs .gpu/imajev-serve (strip -o .gpu/imajev-serve target/release/imajev-serve); python3 with
# the standard library only. Takes about 3 minutes (synth of the model, two server loads, 4 × 10 s
# + 10 s measured); writes 7 files under $OUT. Env: DURATION (seconds per client count, 10),
# CLIENTS (1,4,16,64), SERVE_ARGS (more `serve` flags for both runs, e.g. --question-tree two-level;
# the packing-off budget assumes the one-level tree). Then, on the development machine:
#   python3 bench/http_load.py --merge-into bench/results/h200.json \
#     --merge-report OUT/throughput.json --merge-report OUT/throughput-unpacked.json
set -uo pipefail
source bench/device_env.sh
W=${WORK:-/tmp/bench}
DURATION=${DURATION:-10}
# shellcheck disable=SC2206  # SERVE_ARGS is a list of words
SERVE=(--device cuda --quantize fp8 --rotations 4 --contract imajev ${SERVE_ARGS:-})
load() { # label, port, http_load.py arguments...
  local label=$1 port=$2 t0=$SECONDS rc; shift 2
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/http_load.py --bin .gpu/imajev-serve --work "$W" --port "$port" \
    --duration "$DURATION" --start-timeout 240 --server-log "$W/server-$label.log" "$@" >>"$OUT/load.log" 2>&1
  rc=$?
  { head -n 40 "$W/server-$label.log"; echo "[...]"; tail -n 20 "$W/server-$label.log"; } >"$OUT/server-$label.log"
  echo "$label: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/load.log"
}
load packed 18777 --clients "${CLIENTS:-1,4,16,64}" --out "$OUT/throughput.json" -- "${SERVE[@]}"
passes=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["request"]["passes"])' \
  "$OUT/throughput.json") || { echo "no packed report: see load.log"; exit 1; }
load unpacked 18778 --clients 16 --out "$OUT/throughput-unpacked.json" \
  -- "${SERVE[@]}" --batch-sequences $((passes + 1))
{
  python3 bench/http_load.py --print-report "$OUT/throughput.json" "$OUT/throughput-unpacked.json"
  python3 - "$OUT/throughput.json" "$OUT/throughput-unpacked.json" <<'PY'
import json, sys
from pathlib import Path
reports = [json.loads(Path(p).read_text()) if Path(p).exists() else None for p in sys.argv[1:]]
if all(reports):
    same = reports[0]["reference_sha256"] == reports[1]["reference_sha256"]
    print(f"single-client answers of the two servers (packing on, off) identical: {same}")
PY
} | tee "$OUT/summary.txt"
