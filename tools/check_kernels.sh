#!/usr/bin/env bash
# Compiles every kernels/*.cu exactly as the backend does (common.cuh prepended) for sm_90a with
# nvcc/ptxas from pip wheels, no GPU needed, and prints ptxas' register / spill report: catches
# syntax errors and register blow-ups before a device call. Setup once (into any venv):
#   pip install "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" \
#               "nvidia-nvvm==13.0.*" "nvidia-cuda-cccl==13.0.*"
# Usage: CU=<venv>/lib/python3.X/site-packages/nvidia/cu13 bash tools/check_kernels.sh [name...]
# With KEEP=DIR the sources and cubins (DIR/<name>.cu, DIR/<name>.cubin) stay there for a SASS
# look (tools/sass_kloop.sh); else they go to a temporary folder that is removed.
set -euo pipefail
: "${CU:?set CU to the nvidia/cu13 folder of the pip wheels}"
CCCL=${CCCL:-$CU/include/cccl}
out=${KEEP:-$(mktemp -d)}
mkdir -p "$out"
cd "$(dirname "$0")/.."
names=("$@")
# A file kernels/<base>_<part>.cu continues kernels/<base>.cu (src/backend/cuda/launch.rs compiles
# them as one source): it is appended to its base, never compiled alone.
is_part() { local b=${1%_*}; [ "$b" != "$1" ] && [ -f "kernels/$b.cu" ]; }
[ ${#names[@]} -eq 0 ] && names=($(ls kernels/*.cu | xargs -n1 basename | sed 's/\.cu$//'))
for n in "${names[@]}"; do
  is_part "$n" && continue
  {
    cat kernels/common.cuh; echo "#line 1 \"kernels/$n.cu\""; cat "kernels/$n.cu"
    for p in kernels/"$n"_*.cu; do [ -f "$p" ] && { echo "#line 1 \"$p\""; cat "$p"; }; done
  } >"$out/$n.cu"
  echo "== $n"
  "$CU/bin/nvcc" -arch=sm_90a -cubin -std=c++17 -I"$CU/include" -I"$CCCL" -Xptxas -v -o "$out/$n.cubin" "$out/$n.cu" 2>&1 \
    | grep -E "error|warning|Compiling entry|registers|spill|Performance Loss" | sed -E 's/ptxas info *: //' | paste - - - 2>/dev/null || true
done
[ -n "${KEEP:-}" ] || rm -rf "$out"
