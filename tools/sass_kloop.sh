#!/usr/bin/env bash
# The FP8 GEMM's k-block loop in SASS, without a GPU: compiles kernels/gemm_fp8.cu as the backend
# does (tools/check_kernels.sh, which keeps the cubin here) for sm_90a and prints, per kernel, the instructions of the consumer's
# k-block loop (from the barrier wait before a stage's first FP8 wgmma, `QGMMA ... RZ, !UPT`, to the
# branch back to that wait) and how many of them are R2UR, plus the kernel's totals.
# Why: a change that made the ring's stage counter non-uniform (the consumers reading their unit
# from shared memory) moved the wgmma descriptors to vector registers, one R2UR each, and made the
# projections 11-19% slower on an H100 while every check passed (bench/NOTES.md, twenty-second
# session). Compare a change's numbers with main's before spending device time.
# Usage: CU=<venv>/lib/python3.X/site-packages/nvidia/cu13 bash tools/sass_kloop.sh [kernel...]
# (default: gemm_fp8_192 gemm_fp8_128). Setup of the nvcc wheels: tools/check_kernels.sh.
set -euo pipefail
: "${CU:?set CU to the nvidia/cu13 folder of the pip wheels}"
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
KEEP="$out" bash tools/check_kernels.sh gemm_fp8 >/dev/null
kernels=("$@")
[ ${#kernels[@]} -eq 0 ] && kernels=(gemm_fp8_192 gemm_fp8_128)
for k in "${kernels[@]}"; do
  "$CU/bin/cuobjdump" -sass -fun "$k" "$out/gemm_fp8.cubin" >"$out/$k.sass"
  python3 - "$out/$k.sass" "$k" <<'PY'
import re, sys
ins = []
for line in open(sys.argv[1]):
    m = re.search(r"/\*([0-9a-f]{4,})\*/\s*(.*?);", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
target = lambda t: int(re.search(r"BRA(?:\.\S+)?\s+(0x[0-9a-f]+)", t).group(1), 16)
first = next(i for i, (_, t) in enumerate(ins) if "QGMMA" in t and "RZ, !UPT" in t)
wait = max(i for i in range(first) if "TRYWAIT" in ins[i][1])
back = next(i for i in range(first, len(ins)) if "BRA" in ins[i][1] and target(ins[i][1]) <= ins[wait][0])
loop = [t for _, t in ins[wait : back + 1]]
print(f"{sys.argv[2]}: k-block loop {len(loop)} instructions, {sum('R2UR' in t for t in loop)} R2UR; "
      f"kernel {len(ins)} instructions, {sum('R2UR' in t for _, t in ins)} R2UR")
PY
done
