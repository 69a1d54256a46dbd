#!/usr/bin/env bash
# Installs every build and test dependency of kvtier from Debian 12 packages.
#
# Idempotent: when every package is already installed it only checks and exits
# (well under a second). Runs as root, or through sudo when not root.
# Set KVTIER_SKIP_DEPS=1 to skip entirely (e.g. in an image that has them).
set -euo pipefail

if [[ "${KVTIER_SKIP_DEPS:-0}" == "1" ]]; then
  exit 0
fi

PACKAGES=(
  # toolchain
  build-essential cmake ninja-build pkg-config clang clang-format git
  # libraries
  libssl-dev librocksdb-dev liburing-dev libibverbs-dev ibverbs-utils
  libboost-dev libzstd-dev libxxhash-dev libtomlplusplus-dev nlohmann-json3-dev
  # tests and benchmarks
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  fio redis-tools redis-server prometheus zstd curl
  # the dashboard page's plotting library (embedded into kvtierd) and its browser test
  libjs-dygraphs chromium chromium-driver python3-selenium
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
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
  $SUDO systemctl disable --now redis-server prometheus >/dev/null 2>&1 || true
fi
echo "install-deps: done" >&2
