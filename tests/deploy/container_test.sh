#!/usr/bin/env bash
# Builds the kvtierd image (deploy/container/build.sh), starts it with podman, checks that it
# serves /readyz and a RESP SET/GET, that `podman stop` (SIGTERM) ends it with exit code 0, and
# that the data written survives a restart on the same volume. Then the server's image
# (build.sh serve) beside it, as deploy/k8s/serve.yaml pairs them: one directory mounted at
# /run/kvtier in both (kvtierd's socket), the API keys file mounted read-only; /health answers
# without a key, a completion needs one, a conversation's second turn reports its first turn's
# whole pages as cached tokens (restored from kvtierd through the socket), and `podman stop`
# ends the server with exit code 0. Needs root, podman, runc, debootstrap and build/nohw (make
# build PRESET=nohw). Run by `make test-container` (not part of `make test`).
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
podman=(podman --runtime runc --cgroup-manager=cgroupfs)
name="kvtier-container-test-$$"
serve_name="kvtier-serve-container-test-$$"
volume="kvtier-container-test-$$"
resp_port=$((20000 + RANDOM % 20000))
http_port=$((resp_port + 1))
serve_port=$((resp_port + 2))
run_dir="$(mktemp -d)"  # /run/kvtier of both containers: kvtierd's socket
keys_dir="$(mktemp -d)" # the server's API keys file

cleanup() {
  "${podman[@]}" rm -f "$serve_name" >/dev/null 2>&1 || true
  "${podman[@]}" rm -f "$name" >/dev/null 2>&1 || true
  "${podman[@]}" volume rm -f "$volume" >/dev/null 2>&1 || true
  rm -rf "$run_dir" "$keys_dir"
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
"$root/deploy/container/build.sh" serve
chown 10001:10001 "$run_dir"  # the images' user
chmod 0700 "$run_dir"

start() {
  # The container's fronts stay on loopback (no tokens file), so it shares the host's network.
  "${podman[@]}" run -d --name "$name" --network=host \
    --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
    -v "$volume:/var/lib/kvtier" -v "$run_dir:/run/kvtier" localhost/kvtier/kvtierd:latest \
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

# The server beside it. kvtierd here has no tokens file (auth off): the one tenant's token is
# not checked.
keys="$keys_dir/keys.json"
printf '{"keys": [{"key": "sk-container", "tenant": "t", "daemon_token": "unused"}]}' >"$keys"
chown 10001:10001 "$keys"
chmod 0400 "$keys"
"${podman[@]}" run -d --name "$serve_name" --network=host \
  --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
  -v "$run_dir:/run/kvtier" -v "$keys:/etc/kvtier/serve/keys.json:ro" \
  localhost/kvtier/serve:latest --socket /run/kvtier/kvtierd.sock \
  --api-keys /etc/kvtier/serve/keys.json --listen 127.0.0.1 --port "$serve_port" >/dev/null
serve_fail() { "${podman[@]}" logs "$serve_name" 2>&1 | tail -20 >&2 || true; fail "$*"; }
for _ in $(seq 1 100); do
  if curl -fsS "http://127.0.0.1:$serve_port/health" >/dev/null 2>&1; then break; fi
  sleep 0.1
done
curl -fsS "http://127.0.0.1:$serve_port/health" >/dev/null || serve_fail "the server never answered /health"
[[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$serve_port/v1/models")" == 401 ]] ||
  serve_fail "a request without an API key was not refused"
[[ "$("${podman[@]}" exec "$serve_name" id -u)" == 10001 ]] || serve_fail "the server does not run as uid 10001"
# Byte tokens: 300 prompt bytes are 4 whole pages of 64 tokens.
prompt="$(python3 -c 'print(("The tiered cache keeps every turn. " * 10)[:300], end="")')"
complete() {  # prompt -> cached_tokens of a 4-token greedy completion
  python3 -c 'import json,sys; print(json.dumps({"model": "kvmini-trained", "prompt": sys.argv[1], "max_tokens": 4, "temperature": 0}))' "$1" |
    curl -fsS -H "Authorization: Bearer sk-container" -H "Content-Type: application/json" \
      --data-binary @- "http://127.0.0.1:$serve_port/v1/completions" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["usage"]["prompt_tokens_details"]["cached_tokens"])'
}
first="$(complete "$prompt")" || serve_fail "the first completion failed"
[[ "$first" == 0 ]] || serve_fail "a first turn reported $first cached tokens"
second="$(complete "$prompt and then some more")" || serve_fail "the second completion failed"
[[ "$second" -ge 256 ]] || serve_fail "the second turn reported $second cached tokens, want >= 256"

"${podman[@]}" stop -t 30 "$serve_name" >/dev/null
code="$("${podman[@]}" inspect -f '{{.State.ExitCode}}' "$serve_name")"
[[ "$code" == 0 ]] || serve_fail "the server exited with $code on SIGTERM"
echo "container_test: ok (images localhost/kvtier/kvtierd:latest, localhost/kvtier/serve:latest;" \
  "second turn $second cached tokens)"
