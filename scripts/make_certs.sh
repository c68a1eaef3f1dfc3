#!/usr/bin/env bash
# Development credentials for a TLS + SuperNode-authenticated Flower deployment.
#
#   scripts/make_certs.sh [-o OUT_DIR] [-n NUM_SUPERNODES] [-d DAYS] [--force] [SAN ...]
#
# Writes (default OUT_DIR = <repository>/docker/certs, next to the compose files):
#
#   ca.crt                       dev CA certificate. PUBLIC: every SuperNode machine, every
#                                SuperExec and every `flwr` CLI user needs it
#                                (--root-certificates / root-certificates = "...").
#   ca.key                       dev CA private key. Keep it on the admin machine only.
#   superlink/server.pem|.key    SuperLink TLS certificate (Fleet, Control and Runtime APIs,
#                                all on one port). SANs: localhost, 127.0.0.1, ::1,
#                                superlink, plus every SAN given on the command line.
#   supernode-<i>/auth.key       SuperNode i's authentication key pair (ECDSA P-384, OpenSSH
#   supernode-<i>/auth.key.pub   format): the private key stays on that node
#                                (--auth-supernode-private-key); the .pub is registered on the
#                                SuperLink with `flwr supernode register <auth.key.pub> <conn>`.
#   supernode-<i>/runtime.pem|.key
#                                TLS certificate for the node's local Runtime API (the
#                                SuperNode <-> ClientApp SuperExec link). SANs: supernode-<i>,
#                                supernode, localhost, 127.0.0.1, ::1.
#   superlink/superexec.secret   shared secrets of the Runtime API (--superexec-auth-secret-file):
#   supernode-<i>/superexec.secret
#                                the SuperLink and the SuperExec running the ServerApp share the
#                                first; SuperNode i and its ClientApp SuperExec share the second.
#   bundles/<machine>/           what each machine receives, laid out like OUT_DIR (copy a
#                                bundle's contents into that machine's docker/certs/):
#                                server (ca.crt, superlink/), supernode-<i> (ca.crt,
#                                supernode-<i>/), workstation (ca.crt and the public keys to
#                                register). ca.key is in no bundle; no machine gets another's keys.
#
# SAN arguments: "DNS:name", "IP:addr", or a bare value (an IPv4/IPv6 literal becomes IP:,
# anything else DNS:). Use the SuperLink's public host name and/or IP address, exactly as the
# SuperNodes and the `flwr` CLI will dial it. A DNS name is dot-separated labels of letters,
# digits and inner hyphens (a leading "*." allowed); anything else is refused before any file
# is written. -n is 0 to 9999 (0: the CA and the SuperLink only), -d a positive number of days.
#
# Existing files are kept (the CA is reused), so re-running with a larger -n adds keys for new
# nodes signed by the same CA. --force regenerates everything (old keys stop working). To add a
# SAN later, delete OUT_DIR/superlink/ and re-run with the full SAN list. Nothing is
# half-written: the files are made in a temp folder inside OUT_DIR and moved into place when
# all of them exist; a failing openssl command is printed with its own message.
#
# Requires: openssl, and ssh-keygen or python3 with the `cryptography` package (a flwr
# dependency). These credentials are for development and lab use; production deployments
# should use certificates from the organisation's own CA.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "make_certs.sh: $*" >&2; exit 2; }
need_value() { [[ $# -ge 2 ]] || die "$1 needs a value (see --help)"; }

OUT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/docker/certs"
NUM_NODES=2
DAYS=365
FORCE=0
EXTRA_SANS=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    -o|--out) need_value "$@"; OUT_DIR="$2"; shift 2 ;;
    -n|--nodes) need_value "$@"; NUM_NODES="$2"; shift 2 ;;
    -d|--days) need_value "$@"; DAYS="$2"; shift 2 ;;
    -f|--force) FORCE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA_SANS+=("$@"); break ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) EXTRA_SANS+=("$1"); shift ;;
  esac
done

# Plain decimal only: bash arithmetic reads 08 as a bad octal number, and a long one overflows.
[[ "$NUM_NODES" =~ ^(0|[1-9][0-9]{0,3})$ ]] ||
  die "-n expects an integer from 0 to 9999 (no sign, no leading zero), got $(printf %q "$NUM_NODES")"
[[ "$DAYS" =~ ^[1-9][0-9]{0,5}$ ]] ||
  die "-d expects a positive integer up to 999999 (no leading zero), got $(printf %q "$DAYS")"
[[ -n "$OUT_DIR" ]] || die "-o expects a folder path, got an empty string"
command -v openssl >/dev/null || { echo "make_certs.sh: openssl not found" >&2; exit 1; }

is_dns() {  # an RFC 1123 host name, or "*." and one: never a newline, comma, space or "="
  local v="${1#\*.}" label re='^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$'
  [[ "$v" =~ ^[A-Za-z0-9.-]+$ && ${#1} -le 253 && "$v" != .* && "$v" != *. && "$v" != *..* ]] ||
    return 1
  local IFS=.
  for label in $v; do [[ "$label" =~ $re ]] || return 1; done  # no glob characters left to expand
}
is_ipv4() {
  local re='^(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})$' i
  [[ "$1" =~ $re ]] || return 1
  for i in 1 2 3 4; do ((BASH_REMATCH[i] <= 255)) || return 1; done
}
is_ipv6() {  # its characters and shape; openssl checks the groups (and is printed if it refuses)
  [[ "$1" =~ ^[0-9A-Fa-f:.]+$ && "$1" == *:*:* && "$1" != *:::* ]]
}

# "10.0.0.5" -> "IP:10.0.0.5", "lab.example.org" -> "DNS:lab.example.org", "IP:x"/"DNS:x" kept.
# Anything else is refused: the list is written into openssl's extension file, where a newline
# would add an extension of its own (e.g. keyUsage = keyCertSign: a certificate that signs).
san_entry() {
  local v="$1" q
  q="$(printf %q "$v")"
  case "$v" in
    "") die "an empty SAN argument; pass a DNS name or an IP address (e.g. lab.example.org 10.0.0.5)" ;;
    DNS:*) is_dns "${v#DNS:}" || die "SAN $q is not a DNS name (letters, digits, inner hyphens, dots)" ;;
    IP:*) is_ipv4 "${v#IP:}" || is_ipv6 "${v#IP:}" || die "SAN $q is not an IPv4 or IPv6 address" ;;
    *:*) is_ipv6 "$v" || die "SAN $q is not an IPv6 address (a DNS name has no ':')"; v="IP:$v" ;;
    *)
      if is_ipv4 "$v"; then
        v="IP:$v"
      elif is_dns "$v"; then
        v="DNS:$v"
      else
        die "SAN $q is neither a DNS name (letters, digits, inner hyphens, dots) nor an IP address"
      fi ;;
  esac
  echo "$v"
}

join_sans() {
  local out="" e entry
  for e in "$@"; do entry="$(san_entry "$e")" || exit 2; out+="${out:+,}$entry"; done
  echo "$out"
}

# Every SAN is checked before anything is written.
SUPERLINK_SANS="$(join_sans localhost 127.0.0.1 ::1 superlink ${EXTRA_SANS[@]+"${EXTRA_SANS[@]}"})"

# run WHAT COMMAND...: quiet, but a failure stops here with the command's own output.
run() {
  local what="$1" out; shift
  if ! out="$("$@" 2>&1)"; then
    echo "make_certs.sh: $what failed ($1 $2 exited non-zero): ${out:-no output}" >&2
    exit 1
  fi
}

umask 077
MADE_OUT=0
[[ -d "$OUT_DIR" ]] || MADE_OUT=1
if ! err="$(mkdir -p "$OUT_DIR" 2>&1)"; then
  echo "make_certs.sh: -o $OUT_DIR: cannot create the folder (${err##*: })" >&2; exit 1
fi
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
if ! STAGE="$(mktemp -d "$OUT_DIR/.make_certs.XXXXXX" 2>/dev/null)"; then
  echo "make_certs.sh: -o $OUT_DIR: cannot write into the folder" >&2; exit 1
fi
cleanup() {
  local rc=$?
  rm -rf "$STAGE"
  if [[ $rc -ne 0 && "$MADE_OUT" == 1 ]]; then rmdir "$OUT_DIR" 2>/dev/null || true; fi
}
trap cleanup EXIT
# W is the new OUT_DIR, built aside from what exists (the CA is reused) unless --force.
W="$STAGE/out"
mkdir "$W"
MANAGED=(ca.crt ca.key superlink)
for d in "$OUT_DIR"/supernode-*; do
  if [[ -e "$d" ]]; then MANAGED+=("${d##*/}"); fi
done
if [[ "$FORCE" == 0 ]]; then
  for e in "${MANAGED[@]}"; do
    if [[ -e "$OUT_DIR/$e" ]]; then cp -pR "$OUT_DIR/$e" "$W/$e"; fi
  done
fi

# EC P-256 TLS key + CA-signed certificate with the given SANs.
# sign_cert KEY CRT COMMON_NAME SAN_LIST
sign_cert() {
  local key="$1" crt="$2" cn="$3" sans="$4" csr="$STAGE/req.csr" ext="$STAGE/req.ext"
  run "the key of $cn" openssl ecparam -name prime256v1 -genkey -noout -out "$key"
  run "the certificate request of $cn" openssl req -new -key "$key" -subj "/O=feddifrc-dev/CN=$cn" \
    -out "$csr"
  cat >"$ext" <<EOF
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
subjectAltName = $sans
EOF
  run "signing the certificate of $cn (SANs $sans)" openssl x509 -req -in "$csr" -CA "$W/ca.crt" \
    -CAkey "$W/ca.key" -CAcreateserial -days "$DAYS" -sha256 -extfile "$ext" -out "$crt"
  rm -f "$csr" "$ext"
}

# OpenSSH-format ECDSA P-384 key pair, as `flower-supernode --auth-supernode-private-key`
# and `flwr supernode register` expect.
make_auth_key() {
  local key="$1" comment="$2"
  if command -v ssh-keygen >/dev/null; then
    run "the authentication key of $comment" ssh-keygen -q -t ecdsa -b 384 -N "" -C "$comment" -f "$key"
  else
    run "the authentication key of $comment" python3 - "$key" "$comment" <<'PY'
import sys
from pathlib import Path
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

path, comment = Path(sys.argv[1]), sys.argv[2]
key = ec.generate_private_key(ec.SECP384R1())
path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()))
pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                    serialization.PublicFormat.OpenSSH)
Path(str(path) + ".pub").write_bytes(pub + b" " + comment.encode() + b"\n")
PY
  fi
}

created=()

# 1. CA
if [[ ! -f "$W/ca.key" || ! -f "$W/ca.crt" ]]; then
  run "the CA key" openssl ecparam -name prime256v1 -genkey -noout -out "$W/ca.key"
  run "the CA certificate" openssl req -x509 -new -key "$W/ca.key" -sha256 -days "$DAYS" \
    -subj "/O=feddifrc-dev/CN=feddifrc dev CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -addext "subjectKeyIdentifier=hash" \
    -out "$W/ca.crt"
  created+=("ca.crt ca.key")
fi

# 2. SuperLink server certificate
mkdir -p "$W/superlink"
if [[ ! -f "$W/superlink/server.pem" || ! -f "$W/superlink/server.key" ]]; then
  sign_cert "$W/superlink/server.key" "$W/superlink/server.pem" superlink "$SUPERLINK_SANS"
  created+=("superlink/server.pem superlink/server.key")
fi

# 3. SuperNodes: authentication key pair + Runtime API certificate
for ((i = 1; i <= NUM_NODES; i++)); do
  d="$W/supernode-$i"
  mkdir -p "$d"
  if [[ ! -f "$d/auth.key" || ! -f "$d/auth.key.pub" ]]; then
    rm -f "$d/auth.key" "$d/auth.key.pub"
    make_auth_key "$d/auth.key" "supernode-$i"
    created+=("supernode-$i/auth.key supernode-$i/auth.key.pub")
  fi
  if [[ ! -f "$d/runtime.pem" || ! -f "$d/runtime.key" ]]; then
    sign_cert "$d/runtime.key" "$d/runtime.pem" "supernode-$i" \
      "$(join_sans "supernode-$i" supernode localhost 127.0.0.1 ::1)"
    created+=("supernode-$i/runtime.pem supernode-$i/runtime.key")
  fi
done

# 4. Shared secrets of the Runtime APIs (raw bytes; both ends read the same file).
for d in "$W/superlink" "$W"/supernode-*; do
  if [[ -d "$d" && ! -f "$d/superexec.secret" ]]; then
    run "the secret of ${d##*/}" openssl rand -hex -out "$d/superexec.secret.hex" 32
    tr -d '\n' <"$d/superexec.secret.hex" >"$d/superexec.secret"
    rm -f "$d/superexec.secret.hex"
    created+=("${d#"$W"/}/superexec.secret")
  fi
done

# 5. Per-machine bundles: each machine gets only its own keys (rebuilt on every run).
bundle() {  # bundle NAME PATH... (paths relative to W)
  local name="$1" rel; shift
  for rel in ca.crt "$@"; do
    mkdir -p "$W/bundles/$name/$(dirname "$rel")"
    cp -pR "$W/$rel" "$W/bundles/$name/$rel"
  done
}
bundle server superlink
for ((i = 1; i <= NUM_NODES; i++)); do bundle "supernode-$i" "supernode-$i"; done
pubs=()
for ((i = 1; i <= NUM_NODES; i++)); do pubs+=("supernode-$i/auth.key.pub"); done
bundle workstation ${pubs[@]+"${pubs[@]}"}

# Public material readable by others (containers run as uid 49999); private keys stay 0600.
for root in "$W" "$W"/bundles/*; do
  chmod 755 "$root" "$root/superlink" "$root"/supernode-* 2>/dev/null || true
  chmod 644 "$root/ca.crt" "$root/superlink/server.pem" "$root"/supernode-*/runtime.pem \
    "$root"/supernode-*/auth.key.pub 2>/dev/null || true
done
chmod 755 "$W/bundles"
rm -f "$W/ca.srl"
run "checking the SuperLink certificate against the CA" \
  openssl verify -CAfile "$W/ca.crt" "$W/superlink/server.pem"

# 6. Everything was made: move it into place (--force drops the old node folders too).
if [[ "$FORCE" == 1 ]]; then
  for e in "${MANAGED[@]}"; do rm -rf "${OUT_DIR:?}/$e"; done
fi
for e in "$W"/*; do
  rm -rf "${OUT_DIR:?}/${e##*/}"
  mv "$e" "$OUT_DIR/"
done
chmod 755 "$OUT_DIR"

echo "Credentials in $OUT_DIR"
if [[ ${#created[@]} -gt 0 ]]; then
  printf '  created: %s\n' "${created[@]}"
else
  echo "  (all files already existed; nothing created - use --force to regenerate)"
fi
echo "  SuperLink certificate SANs: $(openssl x509 -in "$OUT_DIR/superlink/server.pem" -noout \
  -ext subjectAltName 2>/dev/null | tail -n +2 | sed 's/^ *//')"
cat <<EOF

Per-machine bundles in $OUT_DIR/bundles: copy bundles/server/ to the server's docker/certs/,
bundles/supernode-<i>/ to GPU machine i's, bundles/workstation/ to the workstation.

Next steps (see docs/deploy.md):
  1. SuperLink: flower-superlink --enable-supernode-auth \\
       --ssl-ca-certfile $OUT_DIR/ca.crt \\
       --ssl-certfile $OUT_DIR/superlink/server.pem --ssl-keyfile $OUT_DIR/superlink/server.key
  2. Add a connection to \$FLWR_HOME/config.toml (\`flwr config list\` shows the file):
       [superlink.lab]
       address = "<superlink-host>:8000"
       root-certificates = "$OUT_DIR/ca.crt"
  3. Register every SuperNode's public key:
       flwr supernode register $OUT_DIR/supernode-1/auth.key.pub lab
  4. SuperNode i: the SuperLink address, the CA and its own private key:
       flower-supernode --superlink <superlink-host>:8000 --root-certificates $OUT_DIR/ca.crt \\
         --auth-supernode-private-key $OUT_DIR/supernode-1/auth.key \\
         --node-config "partition-id=0 num-partitions=$NUM_NODES"
  Docker: the containers run as uid 49999, so on each machine make its private keys readable:
       sudo chown 49999:49999 <the .key and superexec.secret files that machine holds>
EOF
