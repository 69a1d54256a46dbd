#!/usr/bin/env bash
# Builds the kvtierd image (deploy/container/build.sh), starts it with podman, checks that it
# serves /readyz and a RESP SET/GET, that `podman stop` (SIGTERM) ends it with exit code 0, and
# that the data written survives a restart on the same volume. Needs root, podman, runc,
# debootstrap and build/nohw (make build PRESET=nohw). Run by `make test-container`
# (ctest label `container`, not part of `make test`).
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
podman=(podman --runtime runc --cgroup-manager=cgroupfs)
name="kvtier-container-test-$$"
volume="kvtier-container-test-$$"
resp_port=$((20000 + RANDOM % 20000))
http_port=$((resp_port + 1))

cleanup() {
  "${podman[@]}" rm -f "$name" >/dev/null 2>&1 || true
  "${podman[@]}" volume rm -f "$volume" >/dev/null 2>&1 || true
}
trap cleanup EXIT

fail() { echo "container_test: $*" >&2; "${podman[@]}" logs "$name" 2>&1 | tail -20 >&2 || true; exit 1; }

# The container tools are Debian packages that only this test needs.
missing=()
for p in podman runc debootstrap redis-tools curl; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  [[ $(id -u) == 0 ]] || { echo "container_test: needs root to install ${missing[*]}" >&2; exit 2; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

"$root/deploy/container/build.sh"

start() {
  # The container's fronts stay on loopback (no tokens file), so it shares the host's network.
  "${podman[@]}" run -d --name "$name" --network=host \
    --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
    -v "$volume:/var/lib/kvtier" localhost/kvtier/kvtierd:latest \
    --resp-port "$resp_port" --http-port "$http_port" >/dev/null
  for _ in $(seq 1 100); do
    if curl -fsS "http://127.0.0.1:$http_port/readyz" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  fail "kvtierd in the container never became ready"
}

start
[[ "$(redis-cli -p "$resp_port" SET container-key container-value)" == OK ]] || fail "SET failed"
[[ "$(redis-cli -p "$resp_port" GET container-key)" == container-value ]] || fail "GET failed"
[[ "$("${podman[@]}" exec "$name" id -u)" == 10001 ]] || fail "kvtierd does not run as uid 10001"

"${podman[@]}" stop -t 120 "$name" >/dev/null
code="$("${podman[@]}" inspect -f '{{.State.ExitCode}}' "$name")"
[[ "$code" == 0 ]] || fail "kvtierd exited with $code on SIGTERM"
"${podman[@]}" rm "$name" >/dev/null

start
[[ "$(redis-cli -p "$resp_port" GET container-key)" == container-value ]] ||
  fail "the value did not survive a restart on the same volume"
echo "container_test: ok (image localhost/kvtier/kvtierd:latest)"
