#!/usr/bin/env bash
# One device call on an NVIDIA H200: kernel/engine checks (tests/gpu.rs) and the side-by-side
# benchmark + fidelity run (bench/gpu_bench.py). Needs, in the working tree:
#   .gpu/imajev-serve  (strip -o .gpu/imajev-serve target/release/imajev-serve)
#   .gpu/gpu-test      (cargo test --release --test gpu --no-run; strip the binary it prints)
#   .whl/              (flash-linear-attention 0.6.0 + fla-core 0.6.0 wheels, pure Python)
# Writes everything under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -c "import torch, transformers, peft, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'fla', fla.__version__)" | tee "$OUT/versions.txt"
if [ "${SKIP_GPU_TEST:-0}" != 1 ]; then
  timeout 240 ./.gpu/gpu-test --nocapture --test-threads 1 >"$OUT/gpu-test.log" 2>&1
  echo "gpu-test exit $?" | tee -a "$OUT/gpu-test.log"
fi
PYTHONUNBUFFERED=1 python3 bench/gpu_bench.py --bin .gpu/imajev-serve --work /tmp/bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
