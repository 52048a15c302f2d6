#!/usr/bin/env bash
# One short device call between optimisations: the GPU service test (and with GPU_TEST=1 the kernel
# checks of tests/gpu/, with GPU_OPS=1 the single-op timings of bench/gpu_ops.rs incl. the long
# shapes), a per-kernel profile of the 256-token benchmark request (IMAJEV_PROFILE=kernels), and
# our side of bench/gpu_bench.py (no peer, no fidelity) so speed can be compared with the last
# committed run (BENCH=0 skips it, SERVICE=0 the service test); LONG=1,2 adds the long bucket (gpu_bench.py --long) and a kernel profile of its
# longest request. GPU_TEST=1 runs before the service test (FIRST: the kernel checks). Needs .gpu/ as in bench/h200_run.sh (.gpu/gpu-ops for GPU_OPS=1). Writes at
# most 8 files under $OUT.
set -uo pipefail
source bench/device_env.sh
if [ "${GPU_TEST:-0}" = 1 ]; then
  # GPU_TEST_FILTER: a test-name filter (e.g. attention); GPU_TEST_TIMEOUT: seconds (default 420).
  timeout "${GPU_TEST_TIMEOUT:-420}" ./.gpu/gpu-test ${GPU_TEST_FILTER:-} --nocapture --test-threads 1 \
    >"$OUT/gpu-test.log" 2>&1
  echo "gpu-test exit $?" | tee -a "$OUT/gpu-test.log"; grep -E "checks,|FAIL|test result" "$OUT/gpu-test.log" | head -20
fi
if [ -x .gpu/gpu-service ] && [ "${SERVICE:-1}" = 1 ]; then
  timeout 300 ./.gpu/gpu-service --nocapture --test-threads 1 >"$OUT/gpu-service.log" 2>&1
  echo "gpu-service exit $?" | tee -a "$OUT/gpu-service.log"; grep -E "worst|test result" "$OUT/gpu-service.log"
fi
if [ "${GPU_OPS:-0}" = 1 ]; then
  # OPS_ARGS: the gpu-ops arguments (default --long: every group at 2K, 4K and 16K).
  timeout "${OPS_TIMEOUT:-200}" ./.gpu/gpu-ops ${OPS_ARGS:---long} --json "$OUT/ops.json" >"$OUT/ops.log" 2>&1
  echo "gpu-ops exit $?" | tee -a "$OUT/ops.log"; grep -E "attention|delta_net" "$OUT/ops.log"
fi
[ "${BENCH:-1}" = 1 ] || exit 0
W=/tmp/bench; mkdir -p $W
PYTHONUNBUFFERED=1 python3 bench/gpu_bench.py --bin .gpu/imajev-serve --work $W --out "$OUT" --phase ours \
  --sizes "${SIZES:-256,1024,4096,16384}" --images "${IMAGES:-0,1,2}" --repeats "${REPEATS:-8}" --fidelity 2 \
  --long "${LONG:-}" >"$OUT/ours.log" 2>&1
echo "gpu_bench exit $?"
python3 - "$OUT/results.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for x in r.get("requests", []):
    print(f"{x['tokens']:6d} tok {x['images']} img: p50 {x['ours_p50_ms']:7.1f} ms  p95 {x['ours_p95_ms']:7.1f}  prefill {x['ours_prefill_p50_ms']:6.1f}  vision {x['ours_vision_p50_ms']:6.1f}  questions {x['ours_questions_p50_ms']:6.1f}")
PY
# Kernel profiles (IMAJEV_PROFILE=kernels) of the 256-token request and, with LONG set, of the
# longest request, into one file.
profile() { # request line, repeats
  sed -n "$1p" $W/bench.jsonl >$W/one.jsonl
  IMAJEV_PROFILE=kernels NO_COLOR=1 ./.gpu/imajev-serve decide --model $W/model --adapter $W/adapter --device cuda \
    --rotations 4 --contract imajev --quantize fp8 --request $W/one.jsonl --repeat "$2" 2>$W/profile.log >/dev/null
  grep -v "loading weights" $W/profile.log | tail -62
}
profile 1 3 | tee "$OUT/profile.log"
if [ -n "${LONG:-}" ]; then
  echo "== the last (longest) request" >>"$OUT/profile.log"
  profile "$(wc -l <$W/bench.jsonl)" 2 | tee -a "$OUT/profile.log"
fi
