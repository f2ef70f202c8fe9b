#!/bin/sh
# pip install -r $1 into /opt/venv: from the wheelhouse at $WHEELHOUSE_URL alone when the build
# passes one (deploy/build-images.sh --wheelhouse), from the package index otherwise, with
# $TORCH_INDEX_URL as an extra index when set (PyTorch's CPU builds for the CPU image).
set -eu
if [ -n "${WHEELHOUSE_URL:-}" ]; then
  host="$(echo "$WHEELHOUSE_URL" | sed -E 's#^[a-z]+://([^/:]+).*#\1#')"
  set -- --no-index --find-links "$WHEELHOUSE_URL" --trusted-host "$host" -r "$1"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
  set -- --extra-index-url "$TORCH_INDEX_URL" -r "$1"
else
  set -- -r "$1"
fi
/opt/venv/bin/pip install --quiet --timeout 120 --retries 5 "$@"
