#!/usr/bin/env bash
# One device call that checks a change and measures it against the commit before it, side by side
# on the same machine (machines are noisy: compare as ratios in one run):
#   1. the kernel checks of tests/gpu/ named by GPU_TEST_FILTER (skipped when empty);
#   2. the GPU service test (SERVICE=0 skips it);
#   3. our side of bench/gpu_bench.py for the base binary (.gpu/imajev-serve-base) and the new one
#      (.gpu/imajev-serve) on the same requests (SIZES, IMAGES, LONG, REPEATS as in h200_quick.sh;
#      LONG unset runs the long bucket's 1 and 2 images, LONG= (empty) skips it);
#      with BASE_ENV="NAME=value ..." the base side is the new binary run with those variables
#      (an option that switches the change off, e.g. BASE_ENV=IMAJEV_ATTENTION=wgmma), and
#      NEW_ENV likewise for the new side (an option that switches something on); FIDELITY=0 skips
#      gpu_bench's fidelity requests (a second weight load per side, ~20 s); VARIANTS="ENV; ENV; ..."
#      (instead of NEW_ENV) runs the new binary once per entry (sides v1, v2, ...: several options
#      against one base in one call, each entry's variables separated by spaces);
#   4. with STAGES=1, IMAJEV_PROFILE=1 stage timings (the device synchronised at every stage) of
#      the longest request with the new binary (STAGES_PROFILE=kernels: the kernel profile instead);
# and prints a table of both binaries' p50s with their ratio (each variant's). Writes at most 8
# files under $OUT: gpu-test.log, gpu-service.log, base/results.json, new/results.json (or
# v1/results.json ...: with more than two VARIANTS, leave out GPU_TEST_FILTER, SERVICE and STAGES),
# bench.log, stages.log, summary.txt.
set -uo pipefail
source bench/device_env.sh
if [ -n "${GPU_TEST_FILTER:-}" ]; then
  timeout "${GPU_TEST_TIMEOUT:-200}" ./.gpu/gpu-test $GPU_TEST_FILTER --nocapture --test-threads 1 \
    >"$OUT/gpu-test.log" 2>&1
  echo "gpu-test exit $?" | tee -a "$OUT/gpu-test.log"; grep -E "checks,|FAIL|test result" "$OUT/gpu-test.log" | head -20
fi
if [ "${SERVICE:-1}" = 1 ]; then
  timeout "${SERVICE_TIMEOUT:-150}" ./.gpu/gpu-service --nocapture --test-threads 1 >"$OUT/gpu-service.log" 2>&1
  echo "gpu-service exit $?" | tee -a "$OUT/gpu-service.log"; grep -E "worst|test result" "$OUT/gpu-service.log"
fi
W=/tmp/bench; mkdir -p $W
sides=(base new)
if [ -n "${VARIANTS:-}" ]; then
  IFS=';' read -ra variants <<<"$VARIANTS"
  sides=(base)
  for i in "${!variants[@]}"; do sides+=("v$((i + 1))"); done
fi
for side in "${sides[@]}"; do
  bin=.gpu/imajev-serve; env=()
  if [ $side = base ]; then
    if [ -n "${BASE_ENV:-}" ]; then read -ra env <<<"$BASE_ENV"; else bin=.gpu/imajev-serve-base; fi
  elif [ $side != new ]; then
    read -ra env <<<"${variants[${side#v} - 1]}"
    echo "$side: ${variants[${side#v} - 1]}"
  elif [ -n "${NEW_ENV:-}" ]; then
    read -ra env <<<"$NEW_ENV"
  fi
  env "${env[@]}" PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-150}" python3 bench/gpu_bench.py --bin $bin --work $W \
    --out "$OUT/$side" --phase ours --sizes "${SIZES:-256}" --images "${IMAGES:-0}" --repeats "${REPEATS:-3}" \
    --fidelity "${FIDELITY:-2}" --long "${LONG-1,2}" >>"$OUT/bench.log" 2>&1
  echo "gpu_bench $side exit $?"
done
if [ "${STAGES:-0}" = 1 ]; then
  tail -n 1 $W/bench.jsonl >$W/one.jsonl
  env ${NEW_ENV:-} IMAJEV_PROFILE="${STAGES_PROFILE:-1}" NO_COLOR=1 timeout "${STAGES_TIMEOUT:-90}" ./.gpu/imajev-serve decide --model $W/model --adapter $W/adapter \
    --device cuda --rotations 4 --contract imajev --quantize fp8 --request $W/one.jsonl --repeat 2 \
    2>&1 >/dev/null | grep -v "loading weights" | tail -"${STAGES_LINES:-40}" >"$OUT/stages.log"
fi
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def rows(side):
    p = out / side / "results.json"
    return json.loads(p.read_text()).get("requests", []) if p.exists() else []
base = rows("base")
sides = [d.name for d in sorted(out.iterdir()) if d.is_dir() and d.name != "base" and (d / "results.json").exists()]
sides.sort(key=lambda n: (n != "new", int(n[1:]) if n[1:].isdigit() else 0))
for side in sides:
    new = rows(side)
    print(f"{'tokens':>7} {'img':>3} {'base p50 ms':>12} {side + ' p50 ms':>11} {side + '/base':>9}   {side}: vision / prefill / questions ms")
    for b, n in zip(base, new):
        print(f"{n['tokens']:7d} {n['images']:3d} {b['ours_p50_ms']:12.1f} {n['ours_p50_ms']:11.1f} "
              f"{n['ours_p50_ms'] / b['ours_p50_ms']:9.3f}   {n['ours_vision_p50_ms']:.1f} / "
              f"{n['ours_prefill_p50_ms']:.1f} / {n['ours_questions_p50_ms']:.1f}")
PY
