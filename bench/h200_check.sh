#!/usr/bin/env bash
# One device call: the GPU service test (decisions on CUDA vs the CPU reference), optionally the
# kernel checks, then the FP8 fidelity ablation (bench/fidelity_ablation.py) with a kernel profile
# of the 256-token request. Needs .gpu/{imajev-serve,gpu-service[,gpu-test]} and .whl/ (see
# bench/h200_run.sh). Writes everything under $OUT.
set -uo pipefail
source bench/device_env.sh
timeout 300 ./.gpu/gpu-service --nocapture --test-threads 1 >"$OUT/gpu-service.log" 2>&1
echo "gpu-service exit $?" | tee -a "$OUT/gpu-service.log"
tail -5 "$OUT/gpu-service.log"
if [ "${GPU_TEST:-0}" = 1 ]; then
  timeout 240 ./.gpu/gpu-test --nocapture --test-threads 1 >"$OUT/gpu-test.log" 2>&1
  echo "gpu-test exit $?" | tee -a "$OUT/gpu-test.log"
fi
PYTHONUNBUFFERED=1 python3 bench/fidelity_ablation.py --bin .gpu/imajev-serve --work /tmp/bench --out "$OUT" "$@" 2>&1 \
  | tail -c 200000 >"$OUT/ablation.log"
tail -60 "$OUT/ablation.log"
