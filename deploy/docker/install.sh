#!/bin/sh
# pip install -r $1 into /opt/venv: from the wheelhouse at $WHEELHOUSE_URL alone when the build
# passes one (deploy/build-images.sh --wheelhouse), from the package index otherwise.
set -eu
if [ -n "${WHEELHOUSE_URL:-}" ]; then
  host="$(echo "$WHEELHOUSE_URL" | sed -E 's#^[a-z]+://([^/:]+).*#\1#')"
  set -- --no-index --find-links "$WHEELHOUSE_URL" --trusted-host "$host" -r "$1"
else
  set -- -r "$1"
fi
/opt/venv/bin/pip install --quiet --timeout 120 --retries 5 "$@"
