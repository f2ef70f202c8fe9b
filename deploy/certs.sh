#!/usr/bin/env bash
# TLS certificates and SuperNode authentication keys for a FedPAC federation.
#
#   deploy/certs.sh create --out DIR --clients N [--san NAME_OR_IP]... [--owner UID:GID]
#       DIR/ca.crt, ca.key                 a private certificate authority (keep ca.key offline)
#       DIR/superlink.crt, superlink.key   the SuperLink's certificate; its SANs cover the compose
#                                          service name "superlink", localhost, 127.0.0.1 and
#                                          every --san (host names and IP addresses)
#       DIR/keys/supernode-<i>, .pub       one ECDSA P-384 key pair per SuperNode
#       DIR/superexec.secret,              shared secrets (HMAC) between the SuperLink and its
#       DIR/keys/supernode-<i>.secret      ServerApp executor, and each SuperNode and its ClientApp
#                                          executor (process isolation, docker compose)
#   deploy/certs.sh register --keys DIR/keys FEDERATION [--clients N]
#       registers every supernode-<i>.pub (or the first N) with the running SuperLink that
#       FEDERATION names in $FLWR_HOME/config.toml: only registered SuperNodes may connect.
#
# Existing files are kept (re-running adds what is missing), so a CA is never replaced by
# accident. Private keys are readable by their owner only: --owner 49999:49999 (as root) hands
# the SuperLink and SuperNode keys to the user the FedPAC images run as, for docker compose.
# Copy each SuperNode only its own key pair and ca.crt.
set -euo pipefail

usage() { sed -n '2,16p' "$0" >&2; exit 2; }

create() {
  local out="" clients="" owner="" sans=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --out) out="$2"; shift 2 ;;
      --clients) clients="$2"; shift 2 ;;
      --san) sans+=("$2"); shift 2 ;;
      --owner) owner="$2"; shift 2 ;;
      *) usage ;;
    esac
  done
  [ -n "$out" ] && [[ "$clients" =~ ^[0-9]+$ ]] || usage
  mkdir -p "$out/keys"
  umask 077
  if [ ! -f "$out/ca.crt" ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes -days 3650 \
      -subj "/CN=FedPAC federation CA" -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
  fi
  if [ ! -f "$out/superlink.crt" ]; then
    local alt="DNS:superlink,DNS:localhost,IP:127.0.0.1" san
    for san in "${sans[@]+"${sans[@]}"}"; do
      if [[ "$san" =~ ^[0-9.]+$ || "$san" == *:* ]]; then alt+=",IP:$san"; else alt+=",DNS:$san"; fi
    done
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes -subj "/CN=superlink" \
      -keyout "$out/superlink.key" -out "$out/superlink.csr" 2>/dev/null
    openssl x509 -req -in "$out/superlink.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
      -CAcreateserial -days 825 -out "$out/superlink.crt" \
      -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$alt") 2>/dev/null
    rm -f "$out/superlink.csr" "$out/ca.srl"
    echo "superlink certificate: $alt"
  fi
  chmod 644 "$out/ca.crt" "$out/superlink.crt"
  chmod 755 "$out" "$out/keys"
  local i
  for ((i = 0; i < clients; i++)); do
    if [ ! -f "$out/keys/supernode-$i" ]; then
      ssh-keygen -q -t ecdsa -b 384 -N "" -C "supernode-$i" -f "$out/keys/supernode-$i"
    fi
    chmod 644 "$out/keys/supernode-$i.pub"
    [ -f "$out/keys/supernode-$i.secret" ] || openssl rand -hex 32 > "$out/keys/supernode-$i.secret"
  done
  [ -f "$out/superexec.secret" ] || openssl rand -hex 32 > "$out/superexec.secret"
  if [ -n "$owner" ]; then
    chown "$owner" "$out/superlink.key" "$out/superexec.secret" "$out"/keys/supernode-*[0-9] \
      "$out"/keys/supernode-*.secret
  fi
  echo "created in $out: ca.crt, superlink.crt/.key, keys/supernode-0..$((clients - 1))"
}

register() {
  local keys="" federation="" clients=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --keys) keys="$2"; shift 2 ;;
      --clients) clients="$2"; shift 2 ;;
      -*) usage ;;
      *) federation="$1"; shift ;;
    esac
  done
  [ -d "$keys" ] && [ -n "$federation" ] || usage
  local pub i=0
  for pub in $(ls "$keys"/supernode-*.pub | sort -V); do
    if [ -n "$clients" ] && [ "$i" -ge "$clients" ]; then break; fi
    flwr supernode register "$pub" "$federation" --name "$(basename "$pub" .pub)" >/dev/null
    echo "registered $(basename "$pub")"
    i=$((i + 1))
  done
}

case "${1:-}" in
  create) shift; create "$@" ;;
  register) shift; register "$@" ;;
  *) usage ;;
esac
