#!/usr/bin/env bash
# Start a FedPAC SuperLink (host A of a multi-machine federation): TLS and SuperNode
# authentication on. The ServerApp runs as its subprocess, so this host needs the app's
# dependencies (pip install -e . or the fedpac-app image).
#   deploy/superlink.sh --certs DIR [--state DIR] [--fleet-address ADDR] [--control-address ADDR]
#     --certs DIR        ca.crt, superlink.crt, superlink.key from deploy/certs.sh create
#     --state DIR        state database and, for a relative output-dir, the run outputs
#                        (default: ./superlink-state)
#     --fleet-address    where SuperNodes connect, gRPC (default: 0.0.0.0:9092)
#     --control-address  where `flwr run`/`flwr ls` connect (default: 127.0.0.1:9093, this host
#                        only). Whoever reaches the Control API can run code on this host and
#                        at every site, and Flower has no accounts there: reach it through an
#                        SSH tunnel (docs/SECURITY.md), not an open port
#     --database KIND    file (default: DIR/state.db, survives a restart) or memory (faster on
#                        a crowded host; runs, node registrations and messages end with the process)
# Open the Fleet API port (9092) to the sites' SuperNodes, and nothing else.
set -euo pipefail
certs="" state="superlink-state" fleet="0.0.0.0:9092" control="127.0.0.1:9093" database="file"
while [ $# -gt 0 ]; do
  case "$1" in
    --certs) certs="$2"; shift 2 ;;
    --state) state="$2"; shift 2 ;;
    --fleet-address) fleet="$2"; shift 2 ;;
    --control-address) control="$2"; shift 2 ;;
    --database) database="$2"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
for file in ca.crt superlink.crt superlink.key; do
  [ -f "$certs/$file" ] || { echo "superlink.sh: $certs/$file missing (deploy/certs.sh create)" >&2; exit 2; }
done
case "$database" in
  file) database="state.db" ;;
  memory) database=":flwr-in-memory:" ;;
  *) echo "superlink.sh: --database is file or memory, got '$database'" >&2; exit 2 ;;
esac
certs="$(cd "$certs" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$state"
cd "$state"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0
# flower-superlink, its state database waiting up to a minute for a lock (deploy/patient_superlink.py)
bin="$(dirname "$(command -v flower-superlink)")"
exec "$bin/python" "$here/patient_superlink.py" \
  --ssl-ca-certfile "$certs/ca.crt" --ssl-certfile "$certs/superlink.crt" --ssl-keyfile "$certs/superlink.key" \
  --enable-supernode-auth \
  --database "$database" \
  --fleet-api-address "$fleet" \
  --host "${control%:*}" --port "${control##*:}"
