#!/usr/bin/env bash
# Build the two FedPAC images from the repository root.
#   deploy/build-images.sh [--base IMAGE] [--tag TAG] [--cpu] [--wheelhouse]
#     --base IMAGE   base image with Python 3.11 (default: python:3.11-slim-bookworm)
#     --tag TAG      image tag (default: latest) -> fedpac-superlink:TAG, fedpac-app:TAG
#     --cpu          the app image for hosts without a GPU, fedpac-app:TAG-cpu (what
#                    docker-compose.cpu.yml runs): PyTorch's CPU build from --torch-index and
#                    no torchvision, about 1 GB instead of 7 GB
#     --torch-index URL
#                    extra index for torch (default with --cpu: https://download.pytorch.org/whl/cpu;
#                    "none": only the host's own pip indexes and find-links)
#     --torch-version VERSION
#                    pin torch (for example 2.13.0+cpu); default: the newest the indexes offer
#     --wheelhouse   first `pip download` every dependency on this host into
#                    deploy/docker/wheels/, then serve that folder to the build over HTTP on
#                    the Docker bridge and install from it alone (for build hosts whose
#                    containers cannot reach the package index; the host's Python must be the
#                    base image's, 3.11 on x86_64)
set -euo pipefail
base="python:3.11-slim-bookworm"
tag="latest"
wheelhouse=0
cpu=0
torch_index=""
torch_version=""
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --wheelhouse) wheelhouse=1; shift ;;
    --cpu) cpu=1; shift ;;
    --torch-index) torch_index="$2"; shift 2 ;;
    --torch-version) torch_version="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
[ "$cpu" = 1 ] && [ -z "$torch_index" ] && torch_index="https://download.pytorch.org/whl/cpu"
[ "$torch_index" = none ] && torch_index=""
build_args=(--build-arg "BASE_IMAGE=$base")
app_args=(--build-arg "TORCH_VARIANT=$([ "$cpu" = 1 ] && echo cpu || echo cuda)"
          --build-arg "TORCH_VERSION=$torch_version" --build-arg "TORCH_INDEX_URL=$torch_index")
app_tag="$tag$([ "$cpu" = 1 ] && echo -cpu)"
# The host's address on Docker's default bridge, where build containers reach the wheelhouse.
# Right after dockerd's first start on a fresh data root, `network inspect` has been seen to
# report no gateway yet: ask again, then read the docker0 interface itself.
bridge_address() {
  local address=""
  for _ in $(seq 20); do
    address="$(docker network inspect bridge --format '{{range .IPAM.Config}}{{.Gateway}}{{end}}' 2>/dev/null)"
    [ -n "$address" ] || address="$(ip -4 -o addr show docker0 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -n1)"
    [[ "$address" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] && { echo "$address"; return 0; }
    sleep 0.5
  done
  echo "build-images.sh: cannot find the host's address on Docker's bridge network (docker network inspect bridge" \
       "gave '$address', and no IPv4 address on docker0): is dockerd running with its default bridge?" >&2
  return 1
}
if [ "$wheelhouse" = 1 ]; then
  python="${PYTHON:-python3}"
  requirements=(deploy/docker/requirements.py pyproject.toml --torch-version "$torch_version")
  [ "$cpu" = 1 ] && requirements+=(--cpu)
  "$python" "${requirements[@]}" > deploy/docker/wheels/requirements.txt
  "$python" -m pip download --quiet --only-binary=:all: --dest deploy/docker/wheels \
    ${torch_index:+--extra-index-url "$torch_index"} -r deploy/docker/wheels/requirements.txt
  # Served, not copied into the build context: a 3 GB COPY layer would stay in the image.
  gateway="$(bridge_address)" || exit 1
  port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')"
  "$python" -m http.server --bind "$gateway" --directory deploy/docker/wheels "$port" >/dev/null 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null' EXIT
  for _ in $(seq 50); do
    "$python" -c "import urllib.request; urllib.request.urlopen('http://$gateway:$port/')" 2>/dev/null && break
    sleep 0.2
  done
  build_args+=(--build-arg "WHEELHOUSE_URL=http://$gateway:$port/")
fi
echo "building fedpac-superlink:$tag (base $base)"
DOCKER_BUILDKIT=0 docker build --quiet "${build_args[@]}" --target superlink \
  --tag "fedpac-superlink:$tag" --file deploy/docker/Dockerfile .
echo "building fedpac-app:$app_tag (base $base${torch_index:+, torch from $torch_index})"
DOCKER_BUILDKIT=0 docker build --quiet "${build_args[@]}" "${app_args[@]}" --target app \
  --tag "fedpac-app:$app_tag" --file deploy/docker/Dockerfile .
