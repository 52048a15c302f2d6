#!/usr/bin/env bash
# One device call on an NVIDIA H200: kernel/engine checks (tests/gpu/), the side-by-side
# benchmark + fidelity run (bench/gpu_bench.py), then the GPU service test and a per-kernel profile
# of the 256-token request. Needs, in the working tree:
#   .gpu/imajev-serve  (strip -o .gpu/imajev-serve target/release/imajev-serve)
#   .gpu/gpu-test      (cargo test --release --test gpu --no-run; strip the binary it prints)
#   .gpu/gpu-service   (cargo test --release --test gpu_service --no-run; likewise; optional)
#   .gpu/gpu-ops       (cargo build --release --example bench_gpu_ops; strip; for h200_quick.sh)
#   .whl/              (flash-linear-attention 0.6.0 + fla-core 0.6.0 wheels, pure Python)
# The peer runs the short rows, then the fidelity comparison, then the long rows (--long: ~40-60 s
# per request for transformers); everything with --long 1,2 does not fit one 600 s device call
# (2026-12-04: the call ended in the 47.7K peer request): give the long rows their own call.
# Writes everything under $OUT (8 files: the most a device call returns). If the DeltaNet kernel
# checks fail with the tensor-core scan, the benchmark runs with the CUDA-core scan
# (IMAJEV_GDN_FFMA=1) and says so in $OUT/scan.txt.
set -uo pipefail
source bench/device_env.sh
python3 -c "import torch, transformers, peft, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'fla', fla.__version__)" | tee "$OUT/versions.txt"
if [ "${IMAJEV_GDN_TF32:-1}" = 0 ]; then products=3xTF32; else products=TF32; fi
echo "tensor cores ($products products)" >"$OUT/scan.txt"
if [ "${SKIP_GPU_TEST:-0}" != 1 ]; then
  timeout 240 ./.gpu/gpu-test --nocapture --test-threads 1 >"$OUT/gpu-test.log" 2>&1
  rc=$?
  echo "gpu-test exit $rc" | tee -a "$OUT/gpu-test.log"; grep -E "checks,|  FAIL| fail" "$OUT/gpu-test.log" | head -20
  if [ $rc != 0 ] && grep -qE "gated_delta_net.*FAIL" "$OUT/gpu-test.log"; then
    export IMAJEV_GDN_FFMA=1
    echo "CUDA cores (the tensor-core scan failed the kernel checks)" >"$OUT/scan.txt"
  fi
fi
PYTHONUNBUFFERED=1 python3 bench/gpu_bench.py --bin .gpu/imajev-serve --work /tmp/bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -E "^tokens|ours|top_agreement|median"
if [ -x .gpu/gpu-service ] && [ "${SKIP_SERVICE:-0}" != 1 ]; then
  timeout 120 ./.gpu/gpu-service --nocapture --test-threads 1 >"$OUT/gpu-service.log" 2>&1
  echo "gpu-service exit $?" | tee -a "$OUT/gpu-service.log"; grep -E "worst|test result" "$OUT/gpu-service.log"
fi
W=/tmp/bench
if [ -f $W/bench.jsonl ]; then
  head -1 $W/bench.jsonl >$W/one256.jsonl
  IMAJEV_PROFILE=kernels NO_COLOR=1 timeout 90 ./.gpu/imajev-serve decide --model $W/model --adapter $W/adapter --device cuda \
    --rotations 4 --contract imajev --quantize fp8 --request $W/one256.jsonl --repeat 3 2>$W/profile-256.log >/dev/null
  grep -v "loading weights" $W/profile-256.log | tail -50 >"$OUT/profile-256-tail.log"
fi
cat "$OUT/scan.txt"
