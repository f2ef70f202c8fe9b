#!/bin/sh
# pip install -r $1 into /opt/venv: from /wheels alone when the build brought an offline
# wheelhouse (deploy/build-images.sh --wheelhouse), from the package index otherwise.
set -eu
if ls /wheels/*.whl >/dev/null 2>&1; then
  set -- --no-index --find-links /wheels -r "$1"
else
  set -- -r "$1"
fi
/opt/venv/bin/pip install --quiet "$@"
