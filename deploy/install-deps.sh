#!/usr/bin/env bash
# Installs every build and test dependency of kvtier from Debian 12 packages.
#
# Idempotent: when every package is already installed it only checks and exits
# (well under a second). Runs as root, or through sudo when not root.
# Set KVTIER_SKIP_DEPS=1 to skip entirely (e.g. in an image that has them).
#
# Usage: install-deps.sh [--with-torch] [--with-train]
#   --with-torch  also the optional Python packages of reference/ (the PyTorch reference model,
#                 its golden vectors and training): python3-torch for /usr/bin/python3 and the
#                 OpenBLAS it should call (torch uses whichever libblas.so.3 is installed; the
#                 reference BLAS is ~8x slower). `make test` never needs them; `make
#                 test-reference` installs them this way.
#   --with-train  --with-torch plus what `make train` reads: the Debian packages whose text is
#                 the training corpus (train/corpus-packages.txt), man-db and groff-base to
#                 render its man pages, xz-utils and zstd for the bits-per-byte comparison.
set -euo pipefail

WITH_TORCH=0
WITH_TRAIN=0
for arg in "$@"; do
  case "$arg" in
    --with-torch) WITH_TORCH=1 ;;
    --with-train) WITH_TORCH=1; WITH_TRAIN=1 ;;
    *) echo "install-deps: unknown argument $arg (usage: install-deps.sh [--with-torch] [--with-train])" >&2; exit 2 ;;
  esac
done

if [[ "${KVTIER_SKIP_DEPS:-0}" == "1" ]]; then
  exit 0
fi

PACKAGES=(
  # toolchain
  build-essential cmake ninja-build pkg-config clang clang-format git
  # lld links the sanitizer presets (asan, tsan): faster than ld.bfd on their
  # debug-info-heavy test binaries
  lld
  # libraries
  libssl-dev librocksdb-dev liburing-dev libibverbs-dev ibverbs-utils
  libboost-dev libzstd-dev libxxhash-dev libtomlplusplus-dev nlohmann-json3-dev
  # tests and benchmarks
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  fio redis-tools redis-server prometheus zstd curl
  # the RESP e2e test drives kvtierd with redis-py (the client LMCache's Redis connector uses)
  python3-redis
  # deploy files: systemd-analyze verify, the k8s manifests parsed with python3-yaml
  systemd python3-yaml
  # the dashboard page's plotting library (embedded into kvtierd) and its browser test
  libjs-dygraphs chromium chromium-driver python3-selenium
  # the cluster's coordinator: tests start their own etcd on loopback ports
  etcd-server etcd-client
  # the engine's matmul benchmark runs OpenBLAS sgemm beside it
  libopenblas-dev
)
# The serving tests drive the server with the official OpenAI SDK (Node.js). Debian 12's nodejs
# and npm do; a node that brings its own npm (e.g. a NodeSource build) is kept as it is.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  PACKAGES+=(nodejs npm)
fi
# The OpenAI SDK test's pinned packages (tests/serving/node/package-lock.json): `npm ci` when
# node_modules is missing; run last, since node and npm may be installed below.
serving_npm_ci() {
  local dir
  dir="$(dirname "$0")/../tests/serving/node"
  if [[ -f "$dir/package-lock.json" && ! -d "$dir/node_modules" ]] && command -v npm >/dev/null 2>&1; then
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null) ||
      echo "install-deps: npm ci in tests/serving/node failed (the OpenAI SDK test will skip)" >&2
  fi
}
TORCH_PACKAGES=(python3-torch python3-numpy libopenblas0-pthread)
if [[ $WITH_TORCH -eq 1 ]]; then
  PACKAGES+=("${TORCH_PACKAGES[@]}")
fi
if [[ $WITH_TRAIN -eq 1 ]]; then
  PACKAGES+=(man-db groff-base xz-utils zstd)
  while read -r p; do
    [[ -z "$p" || "$p" == \#* ]] || PACKAGES+=("$p")
  done <"$(dirname "$0")/../train/corpus-packages.txt"
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  serving_npm_ci
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "install-deps: missing packages (${missing[*]}) and not root; no sudo found" >&2
    exit 1
  fi
fi

echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends keeps the prometheus server's extras out.
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The Debian redis-server and prometheus packages start system services on
# install; kvtier's benchmarks start their own instances on free ports.
if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
  $SUDO systemctl disable --now redis-server prometheus etcd >/dev/null 2>&1 || true
fi
serving_npm_ci
echo "install-deps: done" >&2
