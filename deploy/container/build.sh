#!/usr/bin/env bash
# Builds a container image with Debian's podman:
#
#   make build PRESET=nohw && deploy/container/build.sh          # localhost/kvtier/kvtierd:latest
#   make build PRESET=nohw && deploy/container/build.sh serve    # localhost/kvtier/serve:latest
#
# kvtierd's image is deploy/container/Containerfile; the server's (`kvtier-engine serve` with the
# trained miniature) deploy/container/Containerfile.serve.
# No registry needs to be reachable: when the base image localhost/kvtier/debian12-base is
# missing, it is made from a debootstrap root (Debian 12 minbase, from the machine's apt mirror)
# with `podman import`. Set BASE=docker.io/library/debian:12-slim to use a registry instead.
# podman runs with runc and cgroupfs and explicit ulimits: with crun's defaults, setrlimit and
# cgroup setup fail on machines like the project's test VMs.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
base="${BASE:-localhost/kvtier/debian12-base:latest}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
podman=(podman --runtime runc --cgroup-manager=cgroupfs)

case "${1:-kvtierd}" in
  kvtierd) binary=build/nohw/cache_daemon/kvtierd containerfile=Containerfile image=kvtierd ;;
  serve) binary=build/nohw/engine/kvtier-engine containerfile=Containerfile.serve image=serve ;;
  *) echo "usage: build.sh [kvtierd|serve]" >&2; exit 2 ;;
esac
if [[ ! -x "$root/$binary" ]]; then
  echo "build.sh: $binary is missing; run: make build PRESET=nohw" >&2
  exit 2
fi

if [[ "$base" == localhost/kvtier/debian12-base:latest ]] && ! "${podman[@]}" image exists "$base"; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  echo "build.sh: making $base with debootstrap from $mirror" >&2
  debootstrap --variant=minbase bookworm "$tmp/root" "$mirror" >"$tmp/debootstrap.log" 2>&1 ||
    { tail -20 "$tmp/debootstrap.log" >&2; exit 1; }
  tar -C "$tmp/root" -c . | "${podman[@]}" import - "$base" >/dev/null
fi

"${podman[@]}" build --network=host --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 \
  --build-arg "BASE=$base" -f "$root/deploy/container/$containerfile" \
  -t "localhost/kvtier/$image:latest" "$root"
