#!/usr/bin/env bash
# Start a FedPAC SuperNode (hosts B, C, ... of a multi-machine federation): TLS to the
# SuperLink and authentication with this node's own key. The ClientApp runs as its subprocess
# on this host's GPU when there is one.
#   deploy/supernode.sh --superlink HOST:9092 --ca ca.crt --key supernode-I \
#       --partition-id I --num-partitions N [--data-path DIR] [--port 9094]
#     --data-path DIR   this node's own data (train.npz/test.npz, IDX files or image folders);
#                       without it the node trains on slice I of the run's dataset (demos)
#     --port            local port of the SuperNode's runtime API for its ClientApp (127.0.0.1)
#     --restarts K      start flower-supernode again after it failed, up to K times, 10 s apart
#                       (default 18: covers the case below; 0 to fail at once)
# The node's public key must be registered first: deploy/certs.sh register. The SuperLink
# refuses a key that is not registered, and also, for up to 60 s (two missed heartbeats), a
# node that restarts right after it died; flower-supernode then exits with status 1.
set -euo pipefail
superlink="" ca="" key="" pid="" num="" data="" port="9094" restarts=18
while [ $# -gt 0 ]; do
  case "$1" in
    --superlink) superlink="$2"; shift 2 ;;
    --ca) ca="$2"; shift 2 ;;
    --key) key="$2"; shift 2 ;;
    --partition-id) pid="$2"; shift 2 ;;
    --num-partitions) num="$2"; shift 2 ;;
    --data-path) data="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --restarts) restarts="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
[ -n "$superlink" ] && [ -f "$ca" ] && [ -f "$key" ] && [[ "$pid" =~ ^[0-9]+$ ]] && [[ "$num" =~ ^[0-9]+$ ]] || {
  sed -n '2,15p' "$0" >&2; exit 2; }
node_config="partition-id=$pid num-partitions=$num"
if [ -n "$data" ]; then
  [ -d "$data" ] || { echo "supernode.sh: data path $data is not a directory" >&2; exit 2; }
  node_config+=" data-path=\"$(cd "$data" && pwd)\""
fi
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0
for ((attempt = 0; ; attempt++)); do
  code=0
  flower-supernode \
    --superlink "$superlink" --root-certificates "$ca" \
    --auth-supernode-private-key "$key" \
    --node-config "$node_config" \
    --port "$port" || code=$?
  if [ "$code" = 0 ] || [ "$attempt" -ge "$restarts" ]; then
    exit "$code"
  fi
  echo "supernode.sh: flower-supernode exited with status $code; restart $((attempt + 1))/$restarts in 10 s" >&2
  sleep 10
done
