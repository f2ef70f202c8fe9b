#!/usr/bin/env bash
# Run FedPAC as a local Flower simulation and fail unless the run completed.
# `flwr run` itself exits 0 even when the run failed, so the run's status is checked.
#   deploy/simulate.sh [--clients N] [--run-config "k=v k=v"] [--ray-address HOST:PORT]
# --ray-address (or RAY_ADDRESS): run the ClientApps on that Ray cluster, whose worker hosts get
# the run's code from Ray (server_app/ray_cluster.py). Without it the simulation starts a Ray of
# its own on this machine, even where `ray start` ran (plain `ray.init()` would join that cluster).
set -euo pipefail
clients=10
run_config=""
ray_address="${RAY_ADDRESS:-local}"
while [ $# -gt 0 ]; do
  case "$1" in
    --clients) clients="$2"; shift 2 ;;
    --run-config) run_config="$2"; shift 2 ;;
    --ray-address) ray_address="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_DISABLE_UPDATE_CHECK=1
app_dir="$(cd "$(dirname "$0")/.." && pwd)"
# `flwr run` hands the run to whichever local SuperLink holds Flower's local ports
# (127.0.0.1:39091/39093): one started from another checkout or by another user would run this
# app with its own interpreter and packages, as its own user. Refuse instead.
superlink="$(command -v flower-superlink || true)"
[ -n "$superlink" ] || { echo "simulate.sh: flower-superlink not found: install the project (make install)" >&2; exit 1; }
# Only those of this network namespace hold the ports `flwr run` talks to here: one in another
# namespace (a container, a test's virtual host) is neither in the way nor this script's to stop.
# A process whose namespace cannot be read (another user's) counts as in this one.
own_netns="$(readlink /proc/$$/ns/net 2>/dev/null || true)"
local_superlinks() {
  # -ww: whole command lines; ps cuts them at the terminal's width (COLUMNS) otherwise, and a
  # SuperLink's path would fall off the end unseen
  ps -ww -eo pid=,user=,args= | grep -E '[f]lower-superlink .*--simulation' | while read -r pid rest; do
    netns="$(readlink "/proc/$pid/ns/net" 2>/dev/null || echo "$own_netns")"
    [ "$netns" != "$own_netns" ] || echo "$pid $rest"
  done || true
}
foreign="$(local_superlinks | grep -vF " $superlink " || true)"
if [ -n "$foreign" ]; then
  echo "simulate.sh: a local SuperLink of another Python environment or user holds Flower's local ports" \
       "and would run this app with its own interpreter:" >&2
  echo "$foreign" | sed 's/^/    /' >&2
  echo "stop it (\`make stop\` in its checkout, or kill its PID) and run again" >&2
  exit 1
fi
# The local SuperLink that `flwr run` starts keeps running after the run; one this script
# started is stopped with it, so that nothing of this checkout stays behind on Flower's ports.
ours() { local_superlinks | grep -F " $superlink " | awk '{print $1}' || true; }
# The SuperLink hands its environment to the simulation, which starts Ray: RAY_ADDRESS decides
# where the ClientApps run, so a SuperLink already running must have been started with the same;
# the hook ships the app to a cluster's workers and speeds up the engine's message hand-over.
export RAY_ADDRESS="$ray_address" RAY_RUNTIME_ENV_HOOK=server_app.ray_cluster.runtime_env_hook
for pid in $(ours); do
  theirs="$(tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | sed -n 's/^RAY_ADDRESS=//p' || true)"
  if [ "$theirs" != "$ray_address" ]; then
    echo "simulate.sh: the local SuperLink (PID $pid) runs its simulations on Ray at '${theirs:-the last \`ray start\`}'," \
         "not at '$ray_address'; stop it (\`make stop\`) and run again" >&2
    exit 1
  fi
done
started_here=0
[ -n "$(ours)" ] || started_here=1
log="$(mktemp)"
cleanup() {
  rm -f "$log"
  if [ "$started_here" = 1 ]; then
    local pids
    pids="$(ours)"
    [ -z "$pids" ] || kill $pids 2>/dev/null || true
    # Return once it is gone (its shutdown takes seconds): a `make run` right after this one
    # would otherwise take the dying SuperLink for one already running, and not stop its own.
    for pid in $pids; do
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
  fi
}
trap cleanup EXIT
flwr run "$app_dir" --stream ${run_config:+--run-config "$run_config"} \
  --federation-config "num-supernodes=$clients client-resources-num-cpus=1" | tee "$log"
run_id="$(grep -oE 'Successfully started run [0-9]+' "$log" | grep -oE '[0-9]+$' || true)"
if [ -z "$run_id" ]; then
  echo "simulate.sh: the run did not start" >&2
  exit 1
fi
status="$(flwr ls --run-id "$run_id" --format json | python3 -c 'import json,sys; print(json.load(sys.stdin)["runs"][0]["status"])')"
echo "run $run_id: $status"
[ "$status" = "finished:completed" ]
