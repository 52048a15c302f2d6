#!/usr/bin/env bash
# One device call: HTTP throughput of the GPU server at several packing budgets (issue 11), the
# same load as bench/h200_throughput.sh (bench/http_load.py, the 256-token 3-question request,
# every answer checked byte for byte against its single-client answer) with `serve
# --batch-sequences S --batch-tokens T` for each S:T of BUDGETS. A larger budget packs more
# requests per forward (fewer, longer engine rounds): more requests/s, longer waits. An entry
# S:T:TREE also passes `--question-tree TREE` (one-level, two-level), so both trees can be
# compared in one call; S:T:TREE:ENV also sets the environment variables ENV (VAR=VALUE, several
# joined by `,`; a comma splits only before an upper-case VAR=, so a value may hold commas and
# colons, e.g. an IMAJEV_GEMM_PINS entry) for that server, e.g. 96:8192:one-level:IMAJEV_MLP_LORA_FUSED=1.
#   BUDGETS="64:8192 96:8192 128:12288" CLIENTS=16,64 DURATION=8 bash bench/h200_budgets.sh
#   BUDGETS="96:8192 96:8192:two-level 120:8192:two-level" CLIENTS=16,64 DURATION=6 bash bench/h200_budgets.sh
#   BUDGETS="96:8192 96:8192:one-level:IMAJEV_MLP_LORA_FUSED=1" CLIENTS=16 bash bench/h200_budgets.sh
#   B=96:8192:one-level:IMAJEV_OVERLAP_ROUNDS; BUDGETS="$B=0 $B=1 $B=0 $B=1" CLIENTS=16,64 DURATION=6 bash bench/h200_budgets.sh
# SERVE_ARGS adds `serve` flags to every run. Writes $OUT/budget-S-T[-TREE].json per entry,
# $OUT/load.log and $OUT/summary.txt, and $OUT/profile-NAME.log for an entry whose ENV has
# IMAJEV_PROFILE=kernels (its round's kernel profile; at most 8 files in all). Needs
# .gpu/imajev-serve; python3 with the standard library only.
set -uo pipefail
source bench/device_env.sh
rm -f "$OUT/gpu.txt"
W=${WORK:-/tmp/bench}
port=18790
reports=()
for b in ${BUDGETS:-64:8192 96:8192 128:12288}; do
  IFS=: read -r s t tree envs <<<"$b"
  name="$s-$t${tree:+-$tree}${envs:+-$(echo "$envs" | tr -c 'A-Za-z0-9_=\n' '_' | tr '=' '-')}" t0=$SECONDS
  # The same entry twice (an A/B repeated in one call) keeps both reports.
  [[ -e "$OUT/budget-$name.json" ]] && name="$name-$port"
  env_words=$(sed -E 's/,([A-Z_][A-Z0-9_]*=)/ \1/g' <<<"$envs")
  # shellcheck disable=SC2086  # SERVE_ARGS and env_words are lists of words (VAR=VALUE for env)
  PYTHONUNBUFFERED=1 timeout 300 env $env_words python3 bench/http_load.py --bin .gpu/imajev-serve --work "$W" --port $port \
    --duration "${DURATION:-8}" --clients "${CLIENTS:-16,64}" --start-timeout 240 --server-log "$W/server-$name.log" \
    --out "$OUT/budget-$name.json" -- --device cuda --quantize fp8 --rotations 4 --contract imajev \
    --batch-sequences "$s" --batch-tokens "$t" ${tree:+--question-tree "$tree"} ${SERVE_ARGS:-} >>"$OUT/load.log" 2>&1
  echo "budget $s sequences / $t tokens${tree:+ / $tree tree}${envs:+ / $envs}: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/load.log"
  # An entry with IMAJEV_PROFILE=kernels: its server's last kernel profiles (the log itself stays in
  # $WORK, which a warm machine keeps from earlier calls) -> $OUT/profile-NAME.log.
  if [[ "$envs" == *IMAJEV_PROFILE=kernels* ]]; then
    grep -v -e "loading weights" -e "request status" "$W/server-$name.log" | grep -A 40 "kernels of forward" |
      tail -n 120 >"$OUT/profile-$name.log"
  fi
  reports+=("$OUT/budget-$name.json")
  port=$((port + 1))
done
python3 bench/http_load.py --print-report "${reports[@]}" | tee "$OUT/summary.txt"
