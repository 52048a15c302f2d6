# Sourced by the bench/h200_*.sh device scripts: $OUT, the GPU line, the carried
# flash-linear-attention wheels (.whl/) on PYTHONPATH for the transformers peer, the carried
# binaries unpacked (tools/device_prep.sh gzips them), and the carried kernel cache .gpu/kcache
# when there is one (filled here, no GPU needed, by
# `.gpu/imajev-serve precompile-kernels --cache .gpu/kcache` with NVRTC 13.0 and its headers:
# the device then loads the kernels instead of spending ~50 s of device time in NVRTC).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
# What tools/device_prep.sh packed to fit the carry: gzipped binaries and the tarred cache
# (unpacked once: a warm machine keeps them between calls).
for z in .gpu/*.gz; do
  [ -e "$z" ] && gunzip -f "$z" && chmod +x "${z%.gz}"
done
if [ -f .gpu/kcache.tgz ] && [ ! -d .gpu/kcache ]; then
  tar xzf .gpu/kcache.tgz -C .gpu
fi
if [ -d .gpu/kcache ]; then
  export IMAJEV_KERNEL_CACHE="$PWD/.gpu/kcache"
fi
