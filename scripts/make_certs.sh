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
# SuperNodes and the `flwr` CLI will dial it.
#
# Existing files are kept (the CA is reused), so re-running with a larger -n adds keys for new
# nodes signed by the same CA. --force regenerates everything (old keys stop working). To add a
# SAN later, delete OUT_DIR/superlink/ and re-run with the full SAN list.
#
# Requires: openssl, and ssh-keygen or python3 with the `cryptography` package (a flwr
# dependency). These credentials are for development and lab use; production deployments
# should use certificates from the organisation's own CA.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

OUT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/docker/certs"
NUM_NODES=2
DAYS=365
FORCE=0
EXTRA_SANS=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    -o|--out) OUT_DIR="$2"; shift 2 ;;
    -n|--nodes) NUM_NODES="$2"; shift 2 ;;
    -d|--days) DAYS="$2"; shift 2 ;;
    -f|--force) FORCE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA_SANS+=("$@"); break ;;
    -*) echo "make_certs.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) EXTRA_SANS+=("$1"); shift ;;
  esac
done

if ! [[ "$NUM_NODES" =~ ^[0-9]+$ ]]; then
  echo "make_certs.sh: -n expects a non-negative integer, got '$NUM_NODES'" >&2; exit 2
fi
if ! [[ "$DAYS" =~ ^[1-9][0-9]*$ ]]; then
  echo "make_certs.sh: -d expects a positive integer, got '$DAYS'" >&2; exit 2
fi
command -v openssl >/dev/null || { echo "make_certs.sh: openssl not found" >&2; exit 1; }

# "10.0.0.5" -> "IP:10.0.0.5", "lab.example.org" -> "DNS:lab.example.org", "IP:x"/"DNS:x" kept.
san_entry() {
  local v="$1"
  case "$v" in
    DNS:*|IP:*) echo "$v" ;;
    *)
      if [[ "$v" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$v" == *:* ]]; then
        echo "IP:$v"
      else
        echo "DNS:$v"
      fi ;;
  esac
}

join_sans() {
  local out="" e
  for e in "$@"; do out+="${out:+,}$(san_entry "$e")"; done
  echo "$out"
}

umask 077
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
if [[ "$FORCE" == 1 ]]; then
  rm -rf "$OUT_DIR/ca.crt" "$OUT_DIR/ca.key" "$OUT_DIR/ca.srl" "$OUT_DIR/superlink" \
         "$OUT_DIR"/supernode-*
fi

# EC P-256 TLS key + CA-signed certificate with the given SANs.
# sign_cert KEY CRT COMMON_NAME SAN_LIST
sign_cert() {
  local key="$1" crt="$2" cn="$3" sans="$4" csr ext
  csr="$(mktemp)"; ext="$(mktemp)"
  openssl ecparam -name prime256v1 -genkey -noout -out "$key" 2>/dev/null
  openssl req -new -key "$key" -subj "/O=feddifrc-dev/CN=$cn" -out "$csr" 2>/dev/null
  cat >"$ext" <<EOF
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
subjectAltName = $sans
EOF
  openssl x509 -req -in "$csr" -CA "$OUT_DIR/ca.crt" -CAkey "$OUT_DIR/ca.key" \
    -CAcreateserial -days "$DAYS" -sha256 -extfile "$ext" -out "$crt" 2>/dev/null
  rm -f "$csr" "$ext"
}

# OpenSSH-format ECDSA P-384 key pair, as `flower-supernode --auth-supernode-private-key`
# and `flwr supernode register` expect.
make_auth_key() {
  local key="$1" comment="$2"
  if command -v ssh-keygen >/dev/null; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "$comment" -f "$key"
  else
    python3 - "$key" "$comment" <<'PY'
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
if [[ ! -f "$OUT_DIR/ca.key" || ! -f "$OUT_DIR/ca.crt" ]]; then
  openssl ecparam -name prime256v1 -genkey -noout -out "$OUT_DIR/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$OUT_DIR/ca.key" -sha256 -days "$DAYS" \
    -subj "/O=feddifrc-dev/CN=feddifrc dev CA" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -addext "subjectKeyIdentifier=hash" \
    -out "$OUT_DIR/ca.crt" 2>/dev/null
  created+=("ca.crt ca.key")
fi

# 2. SuperLink server certificate
SUPERLINK_SANS="$(join_sans localhost 127.0.0.1 ::1 superlink ${EXTRA_SANS[@]+"${EXTRA_SANS[@]}"})"
mkdir -p "$OUT_DIR/superlink"
if [[ ! -f "$OUT_DIR/superlink/server.pem" || ! -f "$OUT_DIR/superlink/server.key" ]]; then
  sign_cert "$OUT_DIR/superlink/server.key" "$OUT_DIR/superlink/server.pem" superlink \
    "$SUPERLINK_SANS"
  created+=("superlink/server.pem superlink/server.key")
fi

# 3. SuperNodes: authentication key pair + Runtime API certificate
for ((i = 1; i <= NUM_NODES; i++)); do
  d="$OUT_DIR/supernode-$i"
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
for d in "$OUT_DIR/superlink" "$OUT_DIR"/supernode-*; do
  if [[ -d "$d" && ! -f "$d/superexec.secret" ]]; then
    openssl rand -hex 32 | tr -d '\n' > "$d/superexec.secret"
    created+=("${d#"$OUT_DIR"/}/superexec.secret")
  fi
done

# 5. Per-machine bundles: each machine gets only its own keys (rebuilt on every run).
rm -rf "$OUT_DIR/bundles"
bundle() {  # bundle NAME PATH... (paths relative to OUT_DIR)
  local name="$1" rel; shift
  for rel in ca.crt "$@"; do
    mkdir -p "$OUT_DIR/bundles/$name/$(dirname "$rel")"
    cp -pR "$OUT_DIR/$rel" "$OUT_DIR/bundles/$name/$rel"
  done
}
bundle server superlink
for ((i = 1; i <= NUM_NODES; i++)); do bundle "supernode-$i" "supernode-$i"; done
pubs=()
for ((i = 1; i <= NUM_NODES; i++)); do pubs+=("supernode-$i/auth.key.pub"); done
bundle workstation ${pubs[@]+"${pubs[@]}"}

# Public material readable by others (containers run as uid 49999); private keys stay 0600.
for root in "$OUT_DIR" "$OUT_DIR"/bundles/*; do
  chmod 755 "$root" "$root/superlink" "$root"/supernode-* 2>/dev/null || true
  chmod 644 "$root/ca.crt" "$root/superlink/server.pem" "$root"/supernode-*/runtime.pem \
    "$root"/supernode-*/auth.key.pub 2>/dev/null || true
done
chmod 755 "$OUT_DIR/bundles"
rm -f "$OUT_DIR/ca.srl"

openssl verify -CAfile "$OUT_DIR/ca.crt" "$OUT_DIR/superlink/server.pem" >/dev/null

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
