#!/usr/bin/env bash
# Start a FedPAC SuperNode (hosts B, C, ... of a multi-machine federation): TLS to the
# SuperLink and authentication with this node's own key. The ClientApp runs on this host's GPU
# when there is one, in a warm worker that keeps the app and the data loaded for the whole run.
#   deploy/supernode.sh --superlink HOST:9092 --ca ca.crt --key supernode-I \
#       --partition-id I --num-partitions N [--data-path DIR] [--model-dir DIR] [--port 9094]
#     --data-path DIR   this node's own data (train.npz/test.npz, IDX files or image folders);
#                       without it the node trains on slice I of the run's dataset (demos)
#     --model-dir DIR   where this site keeps its personalized model (default: ./fedpac-model)
#     --port            local port of the SuperNode's runtime API for its ClientApp (127.0.0.1)
#     --executor KIND   warm (default): deploy/warm_executor.py runs every message in one
#                       long-lived process per run, and the node looks for messages every
#                       0.5 s (deploy/fast_supernode.py); cold: Flower's own SuperNode and
#                       executor, unchanged (a process per message, 3 s between looks)
#     --restarts K      start flower-supernode again after it failed, up to K times, 10 s apart
#                       (default 18: covers the case below; 0 to fail at once)
# The node's public key must be registered first: deploy/certs.sh register. The SuperLink
# refuses a key that is not registered, and also, for up to 60 s (two missed heartbeats), a
# node that restarts right after it died; flower-supernode then exits with status 1.
set -euo pipefail
superlink="" ca="" key="" pid="" num="" data="" models="fedpac-model" port="9094" restarts=18 executor="warm"
while [ $# -gt 0 ]; do
  case "$1" in
    --superlink) superlink="$2"; shift 2 ;;
    --ca) ca="$2"; shift 2 ;;
    --key) key="$2"; shift 2 ;;
    --partition-id) pid="$2"; shift 2 ;;
    --num-partitions) num="$2"; shift 2 ;;
    --data-path) data="$2"; shift 2 ;;
    --model-dir) models="$2"; shift 2 ;;
    --executor) executor="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --restarts) restarts="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
[ -n "$superlink" ] && [ -f "$ca" ] && [ -f "$key" ] && [[ "$pid" =~ ^[0-9]+$ ]] && [[ "$num" =~ ^[0-9]+$ ]] || {
  sed -n '2,18p' "$0" >&2; exit 2; }
[ "$executor" = warm ] || [ "$executor" = cold ] || { echo "supernode.sh: --executor is warm or cold, got '$executor'" >&2; exit 2; }
mkdir -p "$models"
node_config="partition-id=$pid num-partitions=$num model-dir=\"$(cd "$models" && pwd)\""
if [ -n "$data" ]; then
  [ -d "$data" ] || { echo "supernode.sh: data path $data is not a directory" >&2; exit 2; }
  node_config+=" data-path=\"$(cd "$data" && pwd)\""
fi
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0
bin="$(dirname "$(command -v flower-supernode)")"
if [ "$executor" = warm ]; then
  # The secret between this SuperNode and its executor never leaves this host: a fresh one per start.
  secret="$(mktemp)"; chmod 600 "$secret"
  "$bin/python" -c 'import secrets; print(secrets.token_hex(32))' > "$secret"
  isolation=(--isolation process --superexec-auth-secret-file "$secret")
  supernode=("$bin/python" "$(dirname "$0")/fast_supernode.py")  # flower-supernode, shorter waits
else
  isolation=(--isolation subprocess)
  supernode=(flower-supernode)
fi
children=()
stop() { [ ${#children[@]} -gt 0 ] && kill "${children[@]}" 2>/dev/null; wait; [ -n "${secret:-}" ] && rm -f "$secret"; }
trap 'stop; exit 143' TERM INT
trap stop EXIT
for ((attempt = 0; ; attempt++)); do
  code=0
  "${supernode[@]}" \
    --superlink "$superlink" --root-certificates "$ca" \
    --auth-supernode-private-key "$key" \
    --node-config "$node_config" \
    --port "$port" "${isolation[@]}" &
  node=$!
  children=("$node")
  if [ "$executor" = warm ]; then
    "$bin/python" "$(dirname "$0")/warm_executor.py" --runtime-api-address "127.0.0.1:$port" --insecure \
      --superexec-auth-secret-file "$secret" --parent-pid "$node" &
    children+=("$!")
  fi
  wait "$node" || code=$?
  [ ${#children[@]} -gt 1 ] && { kill "${children[1]}" 2>/dev/null; wait "${children[1]}" 2>/dev/null || true; }
  children=()
  if [ "$code" = 0 ] || [ "$attempt" -ge "$restarts" ]; then
    exit "$code"
  fi
  echo "supernode.sh: flower-supernode exited with status $code; restart $((attempt + 1))/$restarts in 10 s" >&2
  sleep 10
done
