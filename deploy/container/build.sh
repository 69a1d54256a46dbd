#!/usr/bin/env bash
# Builds the kvtierd container image (localhost/kvtier/kvtierd:latest) with Debian's podman.
#
#   make build PRESET=nohw && deploy/container/build.sh
#
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

if [[ ! -x "$root/build/nohw/cache_daemon/kvtierd" ]]; then
  echo "build.sh: build/nohw/cache_daemon/kvtierd is missing; run: make build PRESET=nohw" >&2
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
  --build-arg "BASE=$base" -f "$root/deploy/container/Containerfile" \
  -t localhost/kvtier/kvtierd:latest "$root"
