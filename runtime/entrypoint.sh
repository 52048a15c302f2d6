#!/bin/sh
# Start of the imajev-serve container (ENTRYPOINT), also runnable outside it:
#   1. export the released flags of serve.env that the caller has not set (not for `--demo`);
#   2. for `serve`: when a hash lock exists ($IMAJEV_LOCK, default ../adapter/release.lock.json
#      beside this folder), run `imajev-serve verify` and refuse to serve a release that fails it;
#   3. exec imajev-serve with the arguments (`serve` when there are none), so it is PID 1 and gets
#      SIGTERM from `docker stop` directly.
# A missing or empty model folder is reported by imajev-serve itself, with the download commands.
set -eu

here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd)
bin=${IMAJEV_BIN:-imajev-serve}

[ "$#" -gt 0 ] || set -- serve

demo=false
for arg in "$@"; do
  [ "$arg" = "--demo" ] && demo=true
done

if ! $demo; then
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in '' | '#'*) continue ;; esac
    name=${line%%=*}
    case $name in
      IMAJEV_*) ;;
      *) echo "entrypoint: $here/serve.env: '$line' does not set an IMAJEV_ variable" >&2; exit 2 ;;
    esac
    case $name in *[!A-Z0-9_]*)
      echo "entrypoint: $here/serve.env: '$name' is not a variable name" >&2; exit 2 ;;
    esac
    eval "is_set=\${$name+set}"
    [ -n "$is_set" ] || export "${line?}"
  done <"$here/serve.env"
fi

if [ "$1" = "serve" ] && ! $demo; then
  lock=${IMAJEV_LOCK:-$here/../adapter/release.lock.json}
  if [ -f "$lock" ]; then
    echo "entrypoint: checking the release against the lock $lock" >&2
    if ! "$bin" verify --lock "$lock"; then
      echo "entrypoint: the release does not match $lock (table above); not serving it" >&2
      exit 1
    fi
  else
    echo "entrypoint: no lock at $lock, so file hashes are not checked (imajev-serve verify --pin writes one)" >&2
  fi
fi

exec "$bin" "$@"
