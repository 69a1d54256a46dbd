#!/usr/bin/env bash
# Makes the TLS material of kvtierd's native front for the manifests in this folder:
#
#   deploy/k8s/kvtierd-tls.sh DIR [NAMESPACE]        # NAMESPACE: default
#
# writes into DIR (created; existing files are never overwritten) a CA of its own (ca.crt,
# ca.key: keep ca.key offline) and kvtierd's certificate and key (tls.crt, tls.key), valid for
# 825 days, naming the client Service `kvtierd` as serve-shared.yaml's servers dial it
# (kvtierd, kvtierd.NAMESPACE.svc, kvtierd.NAMESPACE.svc.cluster.local), then prints the
# kubectl commands that make the Secrets kvtierd-tls (kvtierd.yaml, serve.yaml) and kvtierd-ca
# (serve-shared.yaml) from them. With a CA of your own (cert-manager, a company CA), issue
# tls.crt for the same names instead. kvtier_k8s_manifests_test runs this script and a server
# that verifies kvtierd by it.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || "$1" == -* ]]; then
  echo "usage: $0 DIR [NAMESPACE]" >&2
  exit 2
fi
dir="$1"
ns="${2:-default}"
if [[ ! "$ns" =~ ^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$ ]]; then
  echo "$0: '$ns' is not a Kubernetes namespace name" >&2
  exit 2
fi
mkdir -p "$dir"
for f in ca.crt ca.key tls.crt tls.key; do
  if [[ -e "$dir/$f" ]]; then
    echo "$0: $dir/$f exists; not overwriting it" >&2
    exit 1
  fi
done
umask 077
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 \
  -subj "/CN=kvtier CA" -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -keyout "$work/ca.key" -out "$work/ca.crt" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=kvtierd" \
  -keyout "$work/tls.key" -out "$work/tls.csr" 2>/dev/null
cat >"$work/ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=DNS:kvtierd,DNS:kvtierd.$ns.svc,DNS:kvtierd.$ns.svc.cluster.local
EXT
openssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
  -CAcreateserial -days 825 -extfile "$work/ext" -out "$work/tls.crt" 2>/dev/null
openssl verify -CAfile "$work/ca.crt" -verify_hostname kvtierd "$work/tls.crt" >/dev/null

chmod 0644 "$work/ca.crt" "$work/tls.crt"
mv "$work/ca.key" "$work/tls.key" "$work/ca.crt" "$work/tls.crt" "$dir/"
cat <<MSG
$dir: ca.crt, ca.key (keep it offline), tls.crt, tls.key for kvtierd in namespace $ns.
  kubectl -n $ns create secret tls kvtierd-tls --cert=$dir/tls.crt --key=$dir/tls.key
  kubectl -n $ns create secret generic kvtierd-ca --from-file=ca.crt=$dir/ca.crt
MSG
