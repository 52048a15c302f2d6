#!/bin/bash
# HEALTHCHECK of the image: healthy when GET /healthz answers 200, i.e. the model is loaded and
# the engine runs (while it loads /healthz answers 503; /livez would answer 200). Bash's
# /dev/tcp instead of curl, so the image needs no HTTP client.
set -u
exec 3<>"/dev/tcp/127.0.0.1/${IMAJEV_PORT:-8765}" || exit 1
printf 'GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
IFS=' ' read -r -t 5 _ status _ <&3 || exit 1
[ "$status" = "200" ]
