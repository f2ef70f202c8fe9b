#!/usr/bin/env bash
# Build the two FedPAC images from the repository root.
#   deploy/build-images.sh [--base IMAGE] [--tag TAG] [--wheelhouse]
#     --base IMAGE   base image with Python 3.11 (default: python:3.11-slim-bookworm)
#     --tag TAG      image tag (default: latest) -> fedpac-superlink:TAG, fedpac-app:TAG
#     --wheelhouse   first `pip download` every dependency on this host into
#                    deploy/docker/wheels/ and install from there inside the build (for build
#                    hosts whose containers cannot reach the package index; the host's Python
#                    must be the base image's, 3.11 on x86_64)
set -euo pipefail
base="python:3.11-slim-bookworm"
tag="latest"
wheelhouse=0
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --wheelhouse) wheelhouse=1; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if [ "$wheelhouse" = 1 ]; then
  python="${PYTHON:-python3}"
  "$python" deploy/docker/requirements.py pyproject.toml > deploy/docker/wheels/requirements.txt
  "$python" -m pip download --quiet --only-binary=:all: --dest deploy/docker/wheels \
    -r deploy/docker/wheels/requirements.txt
fi
for target in superlink app; do
  echo "building fedpac-$target:$tag (base $base)"
  DOCKER_BUILDKIT=0 docker build --quiet --build-arg "BASE_IMAGE=$base" --target "$target" \
    --tag "fedpac-$target:$tag" --file deploy/docker/Dockerfile .
done
