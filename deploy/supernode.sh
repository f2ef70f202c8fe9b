#!/usr/bin/env bash
# Start a FedPAC SuperNode (hosts B, C, ... of a multi-machine federation): TLS to the
# SuperLink and authentication with this node's own key. The ClientApp runs on this host's GPU
# when there is one, in a warm worker that keeps the app and the data loaded for the whole run.
#   deploy/supernode.sh --superlink HOST:9092 --ca ca.crt --key supernode-I \
#       --partition-id I --num-partitions N [--data-path DIR] [--model-dir DIR] [--port 9094]
#     --ca FILE         the CA certificate that signed the SuperLink's (also --root-certificates)
#     --key FILE        this node's private key (keys/supernode-I from deploy/certs.sh create)
#     --data-path DIR   this node's own data (train.npz/test.npz, IDX files or image folders);
#                       without it the node trains on slice I of the run's dataset (demos)
#     --model-dir DIR   where this site keeps its personalized model (default: ./fedpac-model)
#     --privacy-policy "KEY=VALUE ..."
#                       the site's own privacy policy, which no run can lower (docs/CONFIGURATION.md,
#                       Node config): dp-required=true, dp-epsilon-budget=E,
#                       dp-min-noise-multiplier=S, dp-min-statistics-noise-multiplier=S, dp-max-delta=D,
#                       withhold-metrics=true (its evaluations' accuracy and loss stay at the site)
#     --approved-apps "SHA256 ..."
#                       the only app versions this site runs: the SHA-256 digests of their FAB
#                       files (`sha256sum NAME.fab`; of an app's folder as `flwr run` bundles it:
#                       python deploy/warm_executor.py --fab-digest DIR), separated by commas or
#                       spaces (node config approved-apps). The warm executor refuses any other
#                       app before installing it; the cold one cannot check, so it refuses to start
#     --port            local port of the SuperNode's runtime API for its ClientApp (127.0.0.1)
#     --executor KIND   warm (default): deploy/warm_executor.py runs every message of a run in
#                       that run's own long-lived process, never shared with another run and
#                       ended with the run: when a message of another run comes, or after
#                       FEDPAC_WORKER_IDLE_TIMEOUT seconds without one (default 300; 0: never);
#                       `flwr stop` lets a message that is running finish, and its reply is
#                       dropped. The node looks for messages every 0.5 s
#                       (deploy/fast_supernode.py). cold: Flower's own SuperNode and
#                       executor, unchanged (a process per message, 3 s between looks)
#     --restarts K      start flower-supernode again after a failure that can heal, up to K
#                       times (default 18: covers the case below; 0 to fail at once)
#     --restart-delay S seconds between those starts (default 10)
# The node's public key must be registered first: deploy/certs.sh register. The SuperLink
# refuses a key that is not registered, and also, for up to 60 s (two missed heartbeats), a
# node that restarts right after it died; flower-supernode then exits with status 1 ("Failed to
# activate SuperNode", the same for both). A failure that cannot heal (a key or CA that does not
# fit, an address that does not parse) ends the script at once, saying what to fix.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
# A bad argument: one line naming it and what is wrong, status 2.
die() { echo "supernode.sh: $*" >&2; exit 2; }
# The value of option $1, or die when there is none (end of arguments, empty, or another option).
value() { { [ $# -ge 2 ] && [ -n "$2" ] && [[ "$2" != --* ]]; } || die "$1 needs a value"; }
# $1 is option $2's file: it must exist, be a regular file and be readable.
need_file() {
  [ -n "$1" ] || die "$2 is required ($3)"
  [ -e "$1" ] || die "$2 $1: no such file"
  [ -f "$1" ] || die "$2 $1: not a file"
  [ -r "$1" ] || die "$2 $1: not readable"
}

superlink="" ca="" ca_opt="--ca" key="" pid="" num="" data="" data_given="" models="fedpac-model" port="9094" policy=""
approved=""
restarts=18 delay=10 executor="warm"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --superlink) value "$@"; superlink="$2"; shift 2 ;;
    --ca|--root-certificates) value "$@"; ca="$2"; ca_opt="$1"; shift 2 ;;
    --key) value "$@"; key="$2"; shift 2 ;;
    --partition-id) value "$@"; pid="$2"; shift 2 ;;
    --num-partitions) value "$@"; num="$2"; shift 2 ;;
    --data-path) value "$@"; data="$2"; data_given=1; shift 2 ;;
    --model-dir) value "$@"; models="$2"; shift 2 ;;
    --privacy-policy) value "$@"; policy="$2"; shift 2 ;;
    --approved-apps) value "$@"; approved="$2"; shift 2 ;;
    --executor) value "$@"; executor="$2"; shift 2 ;;
    --port) value "$@"; port="$2"; shift 2 ;;
    --restarts) value "$@"; restarts="$2"; shift 2 ;;
    --restart-delay) value "$@"; delay="$2"; shift 2 ;;
    -*) die "$1: unknown option (deploy/supernode.sh --help lists them)" ;;
    *) die "$1: unexpected argument (every value follows its option, see deploy/supernode.sh --help)" ;;
  esac
done

[ -n "$superlink" ] || die "--superlink is required (HOST:PORT of the SuperLink's Fleet API, e.g. fedpac.example.org:9092)"
[[ "$superlink" =~ :[0-9]+$ ]] || die "--superlink $superlink: expected HOST:PORT (the SuperLink's Fleet API, e.g. $superlink:9092)"
need_file "$ca" "$ca_opt" "the CA certificate that signed the SuperLink's, ca.crt from deploy/certs.sh create"
grep -qaF -e '-----BEGIN CERTIFICATE-----' "$ca" ||
  die "$ca_opt $ca: not a PEM certificate (expected ca.crt from deploy/certs.sh create)"
need_file "$key" "--key" "this node's private key, keys/supernode-I from deploy/certs.sh create"
if ! grep -qaF -e '-----BEGIN OPENSSH PRIVATE KEY-----' "$key"; then
  first="$(head -c 40 "$key" | tr -d '\0')" || true
  case "$first" in
    ecdsa-sha2-*|ssh-*|sk-*) die "--key $key: a public key; pass the private key (the same name without .pub)" ;;
  esac
  die "--key $key: not an OpenSSH private key (expected keys/supernode-I from deploy/certs.sh create)"
fi
[ -n "$pid" ] || die "--partition-id is required (this node's partition, a non-negative integer)"
[[ "$pid" =~ ^[0-9]+$ ]] || die "--partition-id $pid: not a non-negative integer"
[ -n "$num" ] || die "--num-partitions is required (the number of partitions, a positive integer)"
[[ "$num" =~ ^[0-9]*[1-9][0-9]*$ ]] || die "--num-partitions $num: not a positive integer"
[ "$executor" = warm ] || [ "$executor" = cold ] || die "--executor $executor: is warm or cold"
# The check of the app's version runs in deploy/warm_executor.py, the site's own code; Flower's
# flwr-clientapp would install and run any app whatever the node config says.
[ -z "$approved" ] || [ "$executor" = warm ] ||
  die "--approved-apps needs --executor warm: the cold executor (Flower's flwr-clientapp) runs any app and cannot refuse one"
{ [[ "$port" =~ ^[0-9]{1,5}$ ]] && [ $((10#$port)) -ge 1 ] && [ $((10#$port)) -le 65535 ]; } ||
  die "--port $port: not a port number (1-65535)"
[[ "$restarts" =~ ^[0-9]+$ ]] || die "--restarts $restarts: not a non-negative integer"
[[ "$delay" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--restart-delay $delay: not a number of seconds"
if [ -n "$data_given" ]; then
  [ -e "$data" ] || die "--data-path $data: no such directory"
  [ -d "$data" ] || die "--data-path $data: not a directory"
  { [ -r "$data" ] && [ -x "$data" ]; } || die "--data-path $data: not readable"
fi
[ ! -e "$models" ] || [ -d "$models" ] || die "--model-dir $models: not a directory"
mkdir -p -- "$models" 2>/dev/null || die "--model-dir $models: cannot be created"
{ [ -w "$models" ] && [ -x "$models" ]; } || die "--model-dir $models: not writable"
command -v flower-supernode >/dev/null ||
  die "flower-supernode is not on PATH: activate the environment FedPAC is installed in"

node_config="partition-id=$pid num-partitions=$num model-dir=\"$(cd "$models" && pwd)\""
read -r -a entries <<< "$policy"
for entry in "${entries[@]}"; do  # only the policy's own keys: the partition and folders have options of their own
  [[ "$entry" != approved-apps=* ]] || die "--privacy-policy: the app versions have an option of their own, --approved-apps \"SHA256 ...\""
  [[ "$entry" =~ ^((dp-required|withhold-metrics)=(true|false)|dp-(epsilon-budget|min-noise-multiplier|min-statistics-noise-multiplier|max-delta)=[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?)$ ]] ||
    die "--privacy-policy: '$entry' is not one of dp-required=true|false, dp-epsilon-budget=E, dp-min-noise-multiplier=S, dp-min-statistics-noise-multiplier=S, dp-max-delta=D, withhold-metrics=true|false"
  node_config+=" $entry"
done
if [ -n "$approved" ]; then
  read -r -a digests <<< "${approved//,/ }"
  [ ${#digests[@]} -gt 0 ] || die "--approved-apps: lists no digest (the SHA-256 of each FAB file this site runs)"
  for digest in "${digests[@]}"; do
    [[ "$digest" =~ ^[0-9a-fA-F]{64}$ ]] ||
      die "--approved-apps: '$digest' is not a SHA-256 digest (64 hex digits, as sha256sum NAME.fab prints)"
  done
  list="${digests[*],,}"  # lower case, as the executor compares them
  node_config+=" approved-apps=\"${list// /,}\""
fi
if [ -n "$data_given" ]; then
  node_config+=" data-path=\"$(cd "$data" && pwd)\""
fi
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_TELEMETRY_ENABLED=0
bin="$(dirname "$(command -v flower-supernode)")"
if [ "$executor" = warm ]; then
  [ -x "$bin/python" ] || die "--executor warm: no python beside flower-supernode ($bin/python)"
  # The secret between this SuperNode and its executor never leaves this host: a fresh one per start.
  secret="$(mktemp)"; chmod 600 "$secret"
  "$bin/python" -c 'import secrets; print(secrets.token_hex(32))' > "$secret"
  isolation=(--isolation process --superexec-auth-secret-file "$secret")
  supernode=("$bin/python" "$(dirname "$0")/fast_supernode.py")  # flower-supernode, shorter waits
else
  isolation=(--isolation subprocess)
  supernode=(flower-supernode)
fi

# Which failures are restarted. Flower (1.39: flwr/supercore/exit/exit_code.py, ExitCode) ends
# flower-supernode through flwr_exit(code), which logs "Exit Code: <code>" and the cause on
# stderr and exits with status 1 (a status cannot hold 302); the node's stderr therefore passes
# through `tee` into a file, and after a status 1 the last Flower code in it decides.
# Permanent, the script stops at once (a restart meets the same files and the same SuperLink):
#   302 SUPERNODE_NODE_AUTH_KEY_INVALID   --key is not an elliptic-curve private key
#   303 SUPERNODE_STARTED_WITHOUT_TLS_BUT_NODE_AUTH_ENABLED
#   304 SUPERNODE_INVALID_TRUSTED_ENTITIES
#   305 SUPERNODE_CONNECTION_ERROR, only when the TLS handshake failed (Flower itself gives up
#       on those at once): --ca did not sign the SuperLink's certificate, the certificate does
#       not name the --superlink host, or it expired
#   401 SUPEREXEC_AUTH_SECRET_LOAD_FAILED
#   600 COMMON_ADDRESS_INVALID; 602-605 COMMON_TLS_* and COMMON_PATH_INVALID (TLS options, files)
#   606 RUNTIME_VERSION_INCOMPATIBLE      this Flower and the SuperLink's do not fit
# Restarted (up to --restarts): any other 305, above all "[code: 2004] Failed to activate
# SuperNode" (the SuperLink still counts the node's previous session as online for up to 60 s;
# an unregistered key reads the same), a crash without a Flower code, a kill by a signal.
# A SuperLink that is not up yet or refuses connections does not end flower-supernode at all:
# it retries those itself.
permanent() {  # $1: Flower's exit code, $2: the node's log; sets cause and fix
  case "$1" in
    302) cause="--key $key is not an elliptic-curve private key Flower can read"
         fix="pass this node's private key from deploy/certs.sh create (keys/supernode-I, not the .pub)" ;;
    303) cause="SuperNode authentication needs TLS"; fix="pass the CA certificate with --ca" ;;
    304) cause="the trusted-entities file is not valid"; fix="check the file given to flower-supernode" ;;
    305) grep -qaiE 'handshake failed|CERTIFICATE_VERIFY_FAILED|not in peer certificate' "$2" || return 1
         local reason
         reason="$(grep -aoE 'CERTIFICATE_VERIFY_FAILED: [^:]*' "$2" | tail -n 1 | sed 's/^[^:]*: //')" || true
         cause="the TLS handshake with the SuperLink at $superlink failed${reason:+ ($reason)}"
         fix="pass with $ca_opt the ca.crt that signed the SuperLink's certificate (from the same deploy/certs.sh create), and reach the SuperLink by a host name or address its certificate covers (deploy/certs.sh create --san HOST)" ;;
    401) cause="the SuperExec secret this script wrote could not be loaded"
         fix="check the temporary folder (TMPDIR=${TMPDIR:-/tmp}): writable, not full" ;;
    600) cause="--superlink $superlink is not an address Flower can parse"; fix="pass HOST:PORT or [IPv6]:PORT" ;;
    602|603|604|605) cause="Flower refused the TLS options or files (--ca $ca)"
         fix="pass an existing, readable ca.crt from deploy/certs.sh create" ;;
    606) cause="this host's Flower version does not fit the SuperLink's"
         fix="install the Flower version the SuperLink runs (pip install -e . as on the SuperLink host)" ;;
    *) return 1 ;;
  esac
}

logs="$(mktemp -d)"  # the current attempt's stderr, read back for Flower's exit code
children=()
stop() {  # never fails (set -e): the children may have been signalled with this script
  if [ ${#children[@]} -gt 0 ]; then kill "${children[@]}" 2>/dev/null || true; fi
  wait || true
  rm -rf "${secret:-}" "$logs"
}
trap 'stop; exit 143' TERM INT
trap stop EXIT
for ((attempt = 0; ; attempt++)); do
  code=0
  rm -f "$logs"/*
  log="$logs/attempt-$attempt"
  # tee ignores TERM and INT: it ends when the node (and anything it started) closed stderr, so
  # the node's last words still reach the log while it shuts down.
  exec {err}> >(trap '' TERM INT; exec tee "$log" >&2)
  teepid=$!
  "${supernode[@]}" \
    --superlink "$superlink" --root-certificates "$ca" \
    --auth-supernode-private-key "$key" \
    --node-config "$node_config" \
    --port "$port" "${isolation[@]}" 2>&"$err" {err}>&- &
  node=$!
  exec {err}>&-
  children=("$node")
  if [ "$executor" = warm ]; then
    "$bin/python" "$(dirname "$0")/warm_executor.py" --runtime-api-address "127.0.0.1:$port" --insecure \
      --superexec-auth-secret-file "$secret" --parent-pid "$node" &
    children+=("$!")
  fi
  wait "$node" || code=$?
  if [ ${#children[@]} -gt 1 ]; then  # the executor may have ended already: it watches the node
    kill "${children[1]}" 2>/dev/null || true; wait "${children[1]}" 2>/dev/null || true
  fi
  children=()
  if [ "$code" = 0 ]; then
    # This script's own TERM/INT end it through its trap; a node that ends with status 0 by
    # itself was turned away: Flower's SuperNode stops itself when the SuperLink refuses its key.
    echo "supernode.sh: flower-supernode ended by itself (status 0), which Flower does when the SuperLink no longer accepts this node's key: ask the federation's operator whether it was unregistered (flwr supernode ls); not restarting" >&2
    exit 0
  fi
  # tee has the node's last lines within milliseconds; a process the node left behind may keep
  # the pipe open, so wait a few seconds at most.
  for ((i = 0; i < 50; i++)); do kill -0 "$teepid" 2>/dev/null || break; sleep 0.1; done
  flower=""
  [ "$code" = 1 ] && flower="$(sed -n 's/.*Exit Code: \([0-9][0-9]*\).*/\1/p' "$log" | tail -n 1)"
  status="status $code${flower:+ (Flower exit code $flower)}"
  # uvicorn's words when the runtime API cannot bind: another process holds the port, and
  # restarting on the same port meets it again (two nodes of one host given the same --port).
  if grep -qaE 'while attempting to bind on address .*address already in use' "$log"; then
    echo "supernode.sh: flower-supernode exited with $status, not restarting: port $port on 127.0.0.1 (the runtime API its ClientApp connects to) is taken by another process. Fix: pass a free port with --port; every SuperNode on a host needs its own" >&2
    exit "$code"
  fi
  if [ -n "$flower" ] && permanent "$flower" "$log"; then
    echo "supernode.sh: flower-supernode exited with $status, not restarting: $cause. Fix: $fix" >&2
    exit "$code"
  fi
  if [ "$attempt" -ge "$restarts" ]; then
    hint=""
    grep -qaF 'Failed to activate SuperNode' "$log" && hint=": the SuperLink refused to activate this node; is its public key registered (deploy/certs.sh register)?"
    echo "supernode.sh: flower-supernode exited with $status, no restarts left (--restarts $restarts)$hint" >&2
    exit "$code"
  fi
  echo "supernode.sh: flower-supernode exited with $status; restart $((attempt + 1))/$restarts in $delay s" >&2
  sleep "$delay"
done
