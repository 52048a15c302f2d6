#!/usr/bin/env bash
# Prepares .gpu/ for a device call on the development machine (no GPU needed): the release build,
# the stripped binaries the bench/h200_*.sh scripts run (.gpu/imajev-serve, gpu-test, gpu-service,
# gpu-ops), and the kernel cache precompiled by NVRTC from pip wheels for the device's tag (so a
# fresh device machine loads the kernels instead of spending ~50 s of device time in NVRTC). The
# binaries are gzipped and the cache tarred, to stay under the device tool's 64 MiB carry;
# bench/device_env.sh (sourced by every device script) unpacks them on the device.
#   bash tools/device_prep.sh            # then: run with carry [".gpu"]
# Env: NVVENV (a venv for the NVRTC wheels; default ../nvvenv beside the checkout, created and
# filled on first use), BASE=<rev> also packs that revision's imajev-serve as .gpu/imajev-serve-base
# (built in a worktree under target/, for bench/h200_ab.sh without *_ENV switches), CC_TARGET
# (compute capability, 9.0: H100 and H200). Prints what .gpu holds and its size.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
NVVENV=${NVVENV:-$ROOT/../nvvenv}
if [ ! -x "$NVVENV/bin/python" ]; then
  python3 -m venv "$NVVENV"
  "$NVVENV/bin/pip" install -q "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*"
fi
CU=$("$NVVENV/bin/python" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))')
[ -f "$CU/lib/libnvrtc.so.13" ] || { echo "no libnvrtc.so.13 under $CU: reinstall $NVVENV" >&2; exit 1; }
nvlib=$(mktemp -d)
trap 'rm -rf "$nvlib"' EXIT
ln -sf "$CU/lib/libnvrtc.so.13" "$nvlib/libnvrtc.so"

# Without nasm, mozjpeg-sys leaves libjpeg-turbo's SIMD decoders out (only a build warning says so):
# the binaries would decode JPEGs slower than the Docker image's and skew the photo requests' timings.
command -v nasm >/dev/null || { echo "nasm not found: install it (apt-get install nasm), then cargo clean -p mozjpeg-sys" >&2; exit 1; }
echo "== build (release, every target)"
cargo build --release --locked --all-targets
# The newest test binary of each name (cargo keeps older ones beside it).
newest() { ls -t target/release/deps/"$1"-* 2>/dev/null | grep -v '\.d$' | head -n 1; }
rm -rf .gpu && mkdir -p .gpu
strip -o .gpu/imajev-serve target/release/imajev-serve
strip -o .gpu/gpu-test "$(newest gpu)"
strip -o .gpu/gpu-service "$(newest gpu_service)"
strip -o .gpu/gpu-ops target/release/examples/bench_gpu_ops
if [ -n "${BASE:-}" ]; then
  echo "== base binary of $BASE"
  wt=target/base-worktree
  git worktree remove --force "$wt" 2>/dev/null || true
  git worktree add --detach "$wt" "$BASE" >/dev/null
  (cd "$wt" && CARGO_TARGET_DIR="$ROOT/target/base" cargo build --release --locked --bin imajev-serve)
  strip -o .gpu/imajev-serve-base target/base/release/imajev-serve
  git worktree remove --force "$wt"
fi

echo "== kernel cache (NVRTC $CU)"
LD_LIBRARY_PATH="$nvlib:$CU/lib" CUDA_HOME=$CU ./.gpu/imajev-serve precompile-kernels \
  --cache .gpu/kcache --compute-capability "${CC_TARGET:-9.0}"
if [ -n "${BASE:-}" ] && ! git diff --quiet "$BASE" HEAD -- kernels/; then
  # The base binary's kernels too (another source: other cache keys, the same folder).
  LD_LIBRARY_PATH="$nvlib:$CU/lib" CUDA_HOME=$CU ./.gpu/imajev-serve-base precompile-kernels \
    --cache .gpu/kcache --compute-capability "${CC_TARGET:-9.0}"
fi
tar czf .gpu/kcache.tgz -C .gpu kcache && rm -rf .gpu/kcache
gzip -9 .gpu/imajev-serve .gpu/gpu-test .gpu/gpu-service .gpu/gpu-ops ${BASE:+.gpu/imajev-serve-base}
ls -la .gpu
total=$(du -cb .gpu/* | tail -n 1 | cut -f1)
echo "== .gpu: $((total / 1048576)) MiB (the carry limit is 64 MiB with everything else carried)"
[ "$total" -lt $((64 << 20)) ] || { echo "too large to carry" >&2; exit 1; }
