#!/usr/bin/env bash
# TLS certificates and SuperNode authentication keys for a FedPAC federation.
#
#   deploy/certs.sh create --out DIR --clients N [--san NAME_OR_IP]... [--owner UID:GID]
#       DIR/ca.crt, ca.key                 a private certificate authority (keep ca.key offline)
#       DIR/superlink.crt, superlink.key   the SuperLink's certificate; its SANs cover the compose
#                                          service name "superlink", localhost, 127.0.0.1 and
#                                          every --san (host names and IP addresses)
#       DIR/keys/supernode-<i>, .pub       one ECDSA P-256 key pair per SuperNode (every request a
#                                          node sends is signed with it: P-256 signs and verifies
#                                          7x faster than P-384; older P-384 keys keep working)
#       DIR/superexec.secret,              shared secrets (HMAC) between the SuperLink and its
#       DIR/keys/supernode-<i>.secret      ServerApp executor, and each SuperNode and its ClientApp
#                                          executor (process isolation, docker compose)
#   deploy/certs.sh site-key --out DIR --name supernode-<i>
#       at a site, on its own machine: its key pair DIR/supernode-<i> (private: it never leaves
#       the machine) and DIR/supernode-<i>.pub (the one file to send to the operator), and the
#       key's fingerprint, for the operator to compare over a second channel before registering
#       it. An existing pair is kept (its fingerprint is printed again).
#   deploy/certs.sh register --name NAME [--keys DIR/keys] KEY.pub FEDERATION
#       registers one public key a site sent with the running SuperLink that FEDERATION names in
#       $FLWR_HOME/config.toml (only registered SuperNodes may connect), under the name the
#       operator gives it: the name decides the site's partition (supernode-<i> serves partition
#       i), so it is never taken from the file, which the site named. --keys DIR also files the
#       key as DIR/NAME.pub. A key the SuperLink knows already is reported and skipped.
#   deploy/certs.sh register --keys DIR/keys FEDERATION [--clients N]
#       registers every supernode-<i>.pub in DIR (or the first N) under its file name, for the
#       key pairs made on this machine (by create, or site-key --out DIR): a .pub whose private
#       key is not beside it is a file a site sent, and is refused here (register it with
#       --name). Keys the SuperLink knows already are reported and skipped, so it can run again.
#   Either form refuses a name that the SuperLink has registered already under another key (not
#   revoked): Flower does not keep names unique, and two keys under one name would make every
#   run refuse both. To replace a site's key, revoke the old one first (flwr supernode
#   unregister NODE_ID FEDERATION). The check reads the SuperLink's nodes with the Python that
#   flwr runs in (PYTHON=... to choose another).
#   deploy/certs.sh connect FEDERATION --address HOST:PORT --ca DIR/ca.crt
#       writes the connection [superlink.FEDERATION] into $FLWR_HOME/config.toml (default
#       ~/.flwr/config.toml): replaced when it is there, added when not; nothing else changes.
#
# Existing files are kept (re-running adds what is missing), so a CA is never replaced by
# accident; ca.key is needed only to sign a server certificate, so with it offline a re-run can
# still add SuperNode keys. superlink.crt is re-issued (a new superlink.key too, signed by ca.key)
# when it is missing, unreadable, expired, not signed by ca.crt or not matching superlink.key, and
# when --san is given and the certificate's SANs differ from the defaults plus every --san (the
# certificate then has exactly those). Without --san an existing certificate keeps its SANs.
# Nothing is half-written: files are made in a temporary folder and moved into place on success.
# Private keys are readable by their owner only: --owner 49999:49999 (as root) hands
# the SuperLink and SuperNode keys to the user the FedPAC images run as, for docker compose.
# Copy each SuperNode only its own key pair and ca.crt.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "certs.sh: $*" >&2; exit 1; }

# openssl, its messages shown (indented) only when it fails
run_openssl() {
  if ! openssl "$@" 2>"$work/openssl.log"; then
    echo "certs.sh: openssl $1 failed:" >&2
    sed 's/^/    /' "$work/openssl.log" >&2
    return 1
  fi
}

# The subjectAltName entries of a certificate (x509) or request (req), sorted, one a line, in
# openssl's own spelling (so that 2001:db8::1 and 2001:DB8:0:0:0:0:0:1 compare equal).
sans_of() {
  openssl "$1" -in "$2" -noout -text 2>/dev/null |
    awk '/X509v3 Subject Alternative Name/ { getline; print; exit }' |
    tr ',' '\n' | sed 's/^ *//; s/ *$//' | sed '/^$/d' | sort -u
}

# keys/NAME for each NAME, shortened to the first and last of a long list; nothing for none
listed() {
  if [ $# -gt 4 ]; then echo "keys/$1 ... keys/${!#} ($# files)"; elif [ $# -gt 0 ]; then printf 'keys/%s ' "$@" | sed 's/ $//'; fi
}

# Why DIR/superlink.crt needs (re-)issuing, or nothing when it is good for ca.crt and superlink.key.
server_cert_problem() {
  local out="$1"
  if [ ! -f "$out/superlink.crt" ]; then echo "superlink.crt is missing"; return; fi
  if ! openssl x509 -in "$out/superlink.crt" -noout 2>/dev/null; then
    echo "superlink.crt is not a readable certificate (empty or damaged, left by a failed run?)"
    return
  fi
  if ! openssl verify -CAfile "$out/ca.crt" "$out/superlink.crt" >/dev/null 2>&1; then
    echo "superlink.crt is expired or not signed by ca.crt"
    return
  fi
  if [ ! -f "$out/superlink.key" ]; then echo "superlink.key is missing"; return; fi
  if [ "$(openssl x509 -in "$out/superlink.crt" -noout -pubkey 2>/dev/null)" != \
       "$(openssl pkey -in "$out/superlink.key" -pubout 2>/dev/null)" ]; then
    echo "superlink.key does not match superlink.crt"
  fi
}

create() {
  local out="" clients="" owner="" sans=() san_given=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --out) out="${2:-}"; shift 2 || usage ;;
      --clients) clients="${2:-}"; shift 2 || usage ;;
      --san) sans+=("${2:-}"); san_given=1; shift 2 || usage ;;
      --owner) owner="${2:-}"; shift 2 || usage ;;
      *) usage ;;
    esac
  done
  [ -n "$out" ] || { echo "certs.sh create: --out DIR is required" >&2; usage; }
  [[ "$clients" =~ ^[0-9]+$ ]] || { echo "certs.sh create: --clients N (a number) is required" >&2; usage; }
  command -v openssl >/dev/null || die "openssl not found: install it (e.g. apt-get install openssl)"
  command -v ssh-keygen >/dev/null || die "ssh-keygen not found: install it (e.g. apt-get install openssh-client)"
  mkdir -p "$out/keys"
  umask 077
  # every new file is made here first (same file system: moving it into place is a rename)
  work="$(mktemp -d "$out/.certs.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  local created=() kept=()

  # ---- the certificate authority
  if [ -f "$out/ca.crt" ]; then
    openssl x509 -in "$out/ca.crt" -noout 2>/dev/null ||
      die "$out/ca.crt is not a readable certificate: restore it from a copy (every SuperNode has one)." \
          "To start a new CA instead, remove ca.crt, ca.key and superlink.crt/.key from $out; every" \
          "SuperNode then needs the new ca.crt."
    kept+=(ca.crt)
  elif [ -f "$out/ca.key" ]; then
    die "$out/ca.key exists but ca.crt is missing: restore ca.crt (every SuperNode has a copy)," \
        "or remove ca.key to start a new CA."
  elif [ -f "$out/superlink.crt" ]; then
    die "ca.crt is missing in $out but superlink.crt exists (signed by that CA): restore ca.crt" \
        "(and ca.key to sign certificates), or remove superlink.crt and superlink.key to start a" \
        "new CA (every SuperNode then needs the new ca.crt)."
  else
    run_openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes -days 3650 \
      -subj "/CN=FedPAC federation CA" -keyout "$work/ca.key" -out "$work/ca.crt" ||
      die "could not create the CA in $out (nothing was written)"
    chmod 644 "$work/ca.crt"
    mv "$work/ca.key" "$out/ca.key"
    mv "$work/ca.crt" "$out/ca.crt"  # last: ca.crt present means the CA is complete
    created+=(ca.crt ca.key)
  fi

  # ---- the SuperLink's certificate
  local alt="DNS:superlink,DNS:localhost,IP:127.0.0.1" san
  for san in "${sans[@]+"${sans[@]}"}"; do
    [ -n "$san" ] || die "--san needs a host name or an IP address"
    if [[ "$san" =~ ^[0-9.]+$ || "$san" == *:* ]]; then alt+=",IP:$san"; else alt+=",DNS:$san"; fi
  done
  local problem
  problem="$(server_cert_problem "$out")"
  # the request (and its key) is made in any case: openssl spells its SANs as in the certificate
  if [ -n "$problem" ] || [ "$san_given" = 1 ]; then
    run_openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-384 -nodes -subj "/CN=superlink" \
      -addext "subjectAltName=$alt" -keyout "$work/superlink.key" -out "$work/superlink.csr" ||
      die "could not make the SuperLink's key and certificate request (check every --san;" \
          "nothing was written)"
  fi
  if [ -z "$problem" ] && [ "$san_given" = 1 ]; then
    local have want
    have="$(sans_of x509 "$out/superlink.crt" | paste -sd ' ')"
    want="$(sans_of req "$work/superlink.csr" | paste -sd ' ')"
    [ "$have" = "$want" ] || problem="superlink.crt's SANs ($have) differ from the requested ($want)"
  fi
  if [ -n "$problem" ]; then
    if [ ! -f "$out/ca.key" ]; then
      local fix="or copy the superlink.crt and superlink.key issued earlier into $out"
      [[ "$problem" == *SANs* ]] && fix="or run without --san to keep the current certificate"
      die "ca.key not found in $out, and a new server certificate needs it: $problem." \
          "Put the CA key back (as $out/ca.key; move it offline again afterwards) to sign a new" \
          "superlink.crt, $fix. Nothing was written."
    fi
    local reissue=0
    [ -e "$out/superlink.crt" ] && reissue=1
    run_openssl x509 -req -in "$work/superlink.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
      -set_serial "0x$(openssl rand -hex 16)" -days 825 -out "$work/superlink.crt" \
      -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$alt") ||
      die "could not sign superlink.crt with $out/ca.key (is it the key of ca.crt?); nothing was written"
    openssl verify -CAfile "$out/ca.crt" "$work/superlink.crt" >/dev/null 2>&1 ||
      die "the new superlink.crt does not verify against $out/ca.crt (is ca.key the key of" \
          "ca.crt?); nothing was written"
    chmod 644 "$work/superlink.crt"
    mv "$work/superlink.key" "$out/superlink.key"
    mv "$work/superlink.crt" "$out/superlink.crt"
    if [ "$reissue" = 1 ]; then
      echo "re-issued superlink.crt and superlink.key: $problem" >&2
    fi
    echo "superlink certificate: $alt"
    created+=(superlink.crt superlink.key)
  else
    kept+=(superlink.crt superlink.key)
  fi
  chmod 644 "$out/ca.crt" "$out/superlink.crt"
  chmod 755 "$out" "$out/keys"

  # ---- SuperNode key pairs and shared secrets
  local i new_keys=() new_secrets=() name
  for ((i = 0; i < clients; i++)); do
    name="supernode-$i"
    if [ -f "$out/keys/$name" ]; then
      if [ ! -f "$out/keys/$name.pub" ]; then
        ssh-keygen -y -f "$out/keys/$name" > "$work/$name.pub" ||
          die "$out/keys/$name is not a readable private key: remove it (and $name.pub) to make a new pair"
        mv "$work/$name.pub" "$out/keys/$name.pub"
        new_keys+=("$name.pub")
      fi
    elif [ -f "$out/keys/$name.pub" ]; then
      : # the private key was handed to its SuperNode: the pair stays as registered
    else
      ssh-keygen -q -t ecdsa -b 256 -N "" -C "$name" -f "$work/$name" </dev/null ||
        die "ssh-keygen could not make $name (nothing was written)"
      mv "$work/$name.pub" "$out/keys/$name.pub"
      mv "$work/$name" "$out/keys/$name"
      new_keys+=("$name")
    fi
    chmod 644 "$out/keys/$name.pub"
    if [ ! -f "$out/keys/$name.secret" ]; then
      openssl rand -hex 32 > "$work/$name.secret" || die "openssl rand failed"
      mv "$work/$name.secret" "$out/keys/$name.secret"
      new_secrets+=("$name.secret")
    fi
  done
  if [ ! -f "$out/superexec.secret" ]; then
    openssl rand -hex 32 > "$work/superexec.secret" || die "openssl rand failed"
    mv "$work/superexec.secret" "$out/superexec.secret"
    created+=(superexec.secret)
  fi
  if [ -n "$owner" ]; then
    local owned=("$out/superlink.key" "$out/superexec.secret") file
    for file in "$out"/keys/supernode-*; do
      case "$file" in *.pub) ;; *) [ -f "$file" ] && owned+=("$file") ;; esac
    done
    chown "$owner" "${owned[@]}"
  fi
  created+=("$(listed "${new_keys[@]+"${new_keys[@]}"}")" "$(listed "${new_secrets[@]+"${new_secrets[@]}"}")")
  mapfile -t created < <(printf '%s\n' "${created[@]}" | sed '/^$/d')
  if [ ${#created[@]} -eq 0 ]; then
    [ "$clients" -eq 0 ] || kept+=("keys/supernode-0..$((clients - 1))")
    echo "nothing to create in $out: every file was already there (kept: ${kept[*]})"
  else
    echo "created in $out: ${created[*]}"
    [ ${#kept[@]} -eq 0 ] || echo "kept: ${kept[*]}"
  fi
}

# The Python the flwr CLI runs in (it has flwr's Control API client), or $PYTHON
flwr_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  local flwr first
  flwr="$(command -v flwr)" || die "flwr not found: install the project's server extra (pip install '.[server]')"
  first="$(head -n 1 "$flwr")"
  if [[ "$first" == '#!'* ]] && [ -x "${first#\#!}" ]; then echo "${first#\#!}"; else echo python3; fi
}

# Every node the SuperLink of federation $1 has registered, one a line: node id, status, name
# ("-" for none), its key's fingerprint as ssh-keygen -lf prints it. `flwr supernode ls` shows
# neither names nor keys, so this asks the Control API through flwr's own client.
registered_nodes() {
  "$(flwr_python)" - "$1" <<'PY'
import base64
import hashlib
import sys

try:
    from cryptography.hazmat.primitives import serialization
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.utils import init_http_client_from_connection
    from flwr.proto.control_pb2 import ListNodesRequest  # pylint: disable=no-name-in-module
except ImportError as err:
    sys.exit(f"certs.sh: cannot import flwr's CLI ({err}): set PYTHON to the Python flwr is installed in")


def fingerprint(pem: bytes) -> str:
    try:
        key = serialization.load_pem_public_key(pem)
        wire = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).split()[1]
    except (ValueError, TypeError):
        return "-"
    return "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(wire)).digest()).decode().rstrip("=")


try:
    client = init_http_client_from_connection(read_superlink_connection(sys.argv[1]))
    try:
        nodes = client.ListNodes(ListNodesRequest()).nodes_info
    finally:
        client.close()
except Exception as err:  # pylint: disable=broad-except
    sys.exit(f"certs.sh: cannot list the SuperLink's registered nodes: {err}")
for node in nodes:
    name = " ".join(node.name.split()) or "-"
    print(node.node_id, node.status, name, fingerprint(node.public_key), sep="\t")
PY
}

# The fingerprint of public key file $1 (as ssh-keygen -lf prints it), or die
key_fingerprint() {
  local printed
  printed="$(ssh-keygen -lf "$1" 2>/dev/null)" || die "$1 is not a public key file (ssh-keygen -lf cannot read it)"
  awk '{print $2}' <<<"$printed"
}

# Register public key file $1 under name $2 with federation $3, whose registered nodes are in
# the file $4 (a line is added for the new node). Prints what it did; returns 1 (after saying
# why) when the name belongs to another key. A key the SuperLink knows is reported and skipped.
register_key() {
  local pub="$1" name="$2" federation="$3" nodes="$4" label="${5:-$(basename "$1")}"
  local fp known holder said id status known_name held
  fp="$(key_fingerprint "$pub")"
  known="$(awk -F '\t' -v fp="$fp" '$4 == fp { print; exit }' "$nodes")"
  if [ -n "$known" ]; then
    IFS=$'\t' read -r id status known_name _ <<<"$known"
    local note="registered as '$known_name', node $id"
    [ "$known_name" = "$name" ] || note="$note; not registered again as '$name'"
    [ "$status" = unregistered ] && note="revoked: a revoked key stays refused; that site makes a new pair"
    echo "$label: already known to the SuperLink ($note)"
    return 0
  fi
  holder="$(awk -F '\t' -v name="$name" '$3 == name && $2 != "unregistered" { print; exit }' "$nodes")"
  if [ -n "$holder" ]; then
    IFS=$'\t' read -r id _ _ held <<<"$holder"
    echo "certs.sh: refused to register $pub ($fp) as '$name': that name is registered already," \
         "under another key ($held, node $id). Two keys under one name would make every run refuse" \
         "both. If this key replaces the old one, revoke that first (flwr supernode unregister $id" \
         "$federation); otherwise give this site another name." >&2
    return 1
  fi
  if said="$(flwr supernode register "$pub" "$federation" --name "$name" --format json 2>&1)"; then
    id="$(grep -o '"node-id": *[0-9]*' <<<"$said" | grep -o '[0-9]*$' || true)"
    printf '%s\t%s\t%s\t%s\n' "${id:-0}" registered "$name" "$fp" >> "$nodes"
    echo "registered $label as '$name'"
  elif [[ "$said" == *"already in use"* ]]; then  # registered since the list was read
    echo "$label: already known to the SuperLink (registered, or revoked: a revoked key stays" \
         "refused; that site makes a new pair)"
  else
    die "flwr supernode register $pub failed: $said"
  fi
}

register() {
  local keys="" clients="" name="" args=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --keys) keys="${2:-}"; shift 2 || usage ;;
      --clients) clients="${2:-}"; shift 2 || usage ;;
      --name) name="${2:-}"; shift 2 || usage ;;
      -*) usage ;;
      *) args+=("$1"); shift ;;
    esac
  done
  command -v ssh-keygen >/dev/null || die "ssh-keygen not found: install it (e.g. apt-get install openssh-client)"
  case ${#args[@]} in
    2) [ -n "$name" ] || die "register ${args[0]}: a key a site sent is registered under the name you give it," \
                            "not its file's: certs.sh register --name supernode-<i> ${args[0]} ${args[1]}"
       [ -z "$clients" ] || die "register: --clients is for --keys DIR without a key file"
       register_sent "${args[0]}" "$name" "${args[1]}" "$keys" ;;
    1) [ -z "$name" ] || die "register --name $name: name the key file too: certs.sh register --name $name KEY.pub ${args[0]}"
       [ -d "$keys" ] || die "register: --keys DIR (the key pairs made on this machine), or --name NAME KEY.pub"
       [ -z "$clients" ] || [[ "$clients" =~ ^[0-9]+$ ]] || die "register: --clients N takes a number"
       register_made_here "$keys" "${args[0]}" "$clients" ;;
    *) usage ;;
  esac
}

# register --name NAME [--keys DIR] KEY.pub FEDERATION
register_sent() {
  local pub="$1" name="$2" federation="$3" keys="$4" nodes filed=""
  [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || die "--name $name: use letters, digits, '-' and '_' (e.g. supernode-3)"
  [ -f "$pub" ] || die "$pub: no such file"
  if [ -n "$keys" ]; then
    [ -d "$keys" ] || die "--keys $keys: no such folder"
    filed="$keys/$name.pub"
    if [ -f "$filed" ] && [ "$(key_fingerprint "$filed")" != "$(key_fingerprint "$pub")" ]; then
      die "$filed holds another key ($(key_fingerprint "$filed")) than $pub: nothing was registered"
    fi
  fi
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  nodes="$work/nodes"
  registered_nodes "$federation" > "$nodes" || exit 1
  register_key "$pub" "$name" "$federation" "$nodes" "$pub" || exit 1
  if [ -n "$filed" ] && [ ! -f "$filed" ]; then
    cp "$pub" "$filed" && chmod 644 "$filed" && echo "filed as $filed"
  fi
}

# register --keys DIR FEDERATION [--clients N]: the pairs made on this machine, by file name
register_made_here() {
  local keys="$1" federation="$2" clients="$3" nodes pub i=0 refused=0 pubs
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  nodes="$work/nodes"
  registered_nodes "$federation" > "$nodes" || exit 1
  mapfile -t pubs < <(find "$keys" -maxdepth 1 -name 'supernode-*.pub' -printf '%f\n' | sort -V)
  [ ${#pubs[@]} -gt 0 ] || die "no supernode-<i>.pub in $keys"
  for pub in "${pubs[@]}"; do
    if [ -n "$clients" ] && [ "$i" -ge "$clients" ]; then break; fi
    i=$((i + 1))
    pub="$keys/$pub"
    if [ ! -f "${pub%.pub}" ] && ! awk -F '\t' -v fp="$(key_fingerprint "$pub")" '$4 == fp { found = 1 } END { exit !found }' "$nodes"; then
      echo "certs.sh: $(basename "$pub") has no private key beside it: it is a file a site sent, and its" \
           "name is the site's word. Register it under the name you give it: certs.sh register" \
           "--name NAME $pub $federation" >&2
      refused=1
      continue
    fi
    register_key "$pub" "$(basename "$pub" .pub)" "$federation" "$nodes" || refused=1
  done
  [ "$refused" = 0 ] || die "some keys were not registered (above)"
}

site_key() {
  local out="" name=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --out) out="${2:-}"; shift 2 || usage ;;
      --name) name="${2:-}"; shift 2 || usage ;;
      *) usage ;;
    esac
  done
  [ -n "$out" ] && [ -n "$name" ] || { echo "certs.sh site-key: --out DIR and --name NAME are required" >&2; usage; }
  [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || die "--name $name: use letters, digits, '-' and '_' (e.g. supernode-3)"
  command -v ssh-keygen >/dev/null || die "ssh-keygen not found: install it (e.g. apt-get install openssh-client)"
  mkdir -p "$out"
  umask 077
  if [ -f "$out/$name" ]; then
    [ -f "$out/$name.pub" ] || ssh-keygen -y -f "$out/$name" > "$out/$name.pub" ||
      die "$out/$name is not a readable private key: move it away to make a new pair"
    echo "kept the key pair in $out (not replaced: the operator registered this one)"
  elif [ -f "$out/$name.pub" ]; then
    die "$out/$name.pub exists without its private key: move it away to make a new pair"
  else
    work="$(mktemp -d "$out/.site-key.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    # ECDSA P-256: every request a node sends is signed with it (7x faster than P-384)
    ssh-keygen -q -t ecdsa -b 256 -N "" -C "$name" -f "$work/$name" </dev/null ||
      die "ssh-keygen could not make the key pair (nothing was written)"
    mv "$work/$name.pub" "$out/$name.pub"
    mv "$work/$name" "$out/$name"
    echo "created the key pair $out/$name (private: keep it on this machine)"
  fi
  chmod 600 "$out/$name"
  chmod 644 "$out/$name.pub"
  echo "send to the operator: $out/$name.pub"
  echo "fingerprint (tell it to the operator over another channel): $(ssh-keygen -lf "$out/$name.pub" | awk '{print $2}')"
}

connect() {
  local federation="" address="" ca=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --address) address="${2:-}"; shift 2 || usage ;;
      --ca) ca="${2:-}"; shift 2 || usage ;;
      -*) usage ;;
      *) federation="$1"; shift ;;
    esac
  done
  [ -n "$federation" ] && [ -n "$address" ] && [ -n "$ca" ] || usage
  "${PYTHON:-python3}" "$(dirname "$0")/flwr_connection.py" "${FLWR_HOME:-$HOME/.flwr}/config.toml" \
    "$federation" --address "$address" --root-certificates "$ca"
}

work=""
case "${1:-}" in
  create) shift; create "$@" ;;
  site-key) shift; site_key "$@" ;;
  register) shift; register "$@" ;;
  connect) shift; connect "$@" ;;
  *) usage ;;
esac
