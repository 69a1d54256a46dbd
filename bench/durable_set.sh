#!/usr/bin/env bash
# Durable SET throughput: kvtierd with durability = "sync" (every SET acknowledged only after
# its data and index are on disk) against redis-server --appendonly yes --appendfsync always,
# the same redis-benchmark run against each (16 clients, no pipelining, SET only), for 1 KB
# and 57 KB values. Both servers run on free loopback ports with data directories under one
# temporary directory on the same file system, and are stopped at the end.
#
# Usage: bench/durable_set.sh [KVTIERD] [REQUESTS=20000] [ROUNDS=3]
#   KVTIERD defaults to build/release/cache_daemon/kvtierd. Each value size is measured
#   ROUNDS times, kvtierd and redis-server alternating; the medians and their ratio
#   (kvtierd / redis-server, goal >= 1.0) are printed, with the SETs per SSD commit kvtierd
#   made, kvtierd's CPU time (utime + stime, /proc/<pid>/stat) and voluntary context switches
#   (all its threads, /proc/<pid>/task/*/status) per SET over its rounds, and redis-server's
#   CPU time per SET over its own.
# Environment: KVTIER_BENCH_DIR (default: a new directory under ${TMPDIR:-/tmp}),
#   KVTIER_IO_THREADS (kvtierd [server] io_threads; unset: kvtierd's own default, 2, as
#   redis-server runs with its own defaults. Rows in docs/performance/storage.md before
#   2026-12-03 were taken with 16, from when a SET held an I/O thread until its commit;
#   KVTIER_IO_THREADS=16 reproduces them. SETs under sync no longer wait on an I/O thread:
#   docs/RESP.md "Durable SETs under sync"; on 2 cores 16 threads cost twice the context
#   switches per SET),
#   KVTIER_COMMIT_DELAY_US (kvtierd [storage] ssd_commit_delay_us; unset: kvtierd's default),
#   KVTIER_MSET_KEYS (N > 0: after the SETs, MSETs of N keys with 1,024-byte values, the same
#   redis-benchmark command against each server, 16 clients, random keys, KVTIER_MSET_REQUESTS
#   MSETs per round, default 500; printed as MSETs/s, their ratio and kvtierd's keys per SSD
#   commit. Unset: no MSET run),
#   KVTIER_SET_SIZES (the SET value sizes; default "1024 57000"; "" runs no SETs).
# Needs redis-server, redis-benchmark, curl and python3. Reports only; asserts nothing.
set -euo pipefail

KVTIERD=${1:-build/release/cache_daemon/kvtierd}
REQUESTS=${2:-20000}
ROUNDS=${3:-3}
IO_THREADS=${KVTIER_IO_THREADS:-}
MSET_KEYS=${KVTIER_MSET_KEYS:-0}
MSET_REQUESTS=${KVTIER_MSET_REQUESTS:-500}
SET_SIZES=${KVTIER_SET_SIZES-1024 57000}
CLIENTS=16
for tool in redis-server redis-benchmark curl python3; do
  command -v "$tool" >/dev/null || { echo "durable_set.sh: $tool not found" >&2; exit 2; }
done
[[ -x $KVTIERD ]] || { echo "durable_set.sh: no kvtierd at $KVTIERD" >&2; exit 2; }

DIR=${KVTIER_BENCH_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvtier_durable_set.XXXXXX")}
mkdir -p "$DIR/kvtierd" "$DIR/redis"
KV_PID=""
REDIS_PID=""
cleanup() {
  [[ -n $KV_PID ]] && kill "$KV_PID" 2>/dev/null && wait "$KV_PID" 2>/dev/null
  [[ -n $REDIS_PID ]] && kill "$REDIS_PID" 2>/dev/null && wait "$REDIS_PID" 2>/dev/null
  [[ -z ${KVTIER_BENCH_DIR:-} ]] && rm -rf "$DIR"
  return 0
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
wait_port() {
  for _ in $(seq 1 400); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.025
  done
  echo "durable_set.sh: nothing listens on port $1" >&2
  return 1
}

KV_PORT=$(free_port)
KV_HTTP=$(free_port)
REDIS_PORT=$(free_port)

cat >"$DIR/kvtierd/kvtierd.toml" <<EOF
[server]
${IO_THREADS:+io_threads = $IO_THREADS}
worker_threads = 2
http_port = $KV_HTTP
[storage]
dram_capacity_bytes = 1073741824
ssd_capacity_bytes = 8589934592
ssd_segment_bytes = 268435456
durability = "sync"
${KVTIER_COMMIT_DELAY_US:+ssd_commit_delay_us = $KVTIER_COMMIT_DELAY_US}
EOF
"$KVTIERD" --config "$DIR/kvtierd/kvtierd.toml" --data-dir "$DIR/kvtierd" \
  --socket "$DIR/kvtierd/kvtierd.sock" --listen 127.0.0.1 --resp-port "$KV_PORT" \
  --http-port "$KV_HTTP" >"$DIR/kvtierd.log" 2>&1 &
KV_PID=$!
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly yes \
  --appendfsync always --dir "$DIR/redis" --protected-mode yes >"$DIR/redis.log" 2>&1 &
REDIS_PID=$!
wait_port "$KV_PORT" || { cat "$DIR/kvtierd.log" >&2; exit 1; }
wait_port "$REDIS_PORT" || { cat "$DIR/redis.log" >&2; exit 1; }

# ops/s of one redis-benchmark SET run (random keys out of 100k, so SETs are not one key).
set_ops() {
  redis-benchmark -p "$1" -n "$REQUESTS" -c "$CLIENTS" -P 1 -d "$2" -r 100000 -t set --csv |
    awk -F'"' '$2 == "SET" { print $4 }'
}
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# A process's CPU time so far in microseconds (utime + stime: fields 14 and 15 of its stat).
cpu_us() {
  awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.0f\n", ($12 + $13) * 1e6 / hz }' \
    "/proc/$1/stat"
}
# Voluntary context switches of all kvtierd's threads so far.
vcsw() {
  cat /proc/"$KV_PID"/task/*/status 2>/dev/null |
    awk '$1 == "voluntary_ctxt_switches:" { n += $2 } END { print n + 0 }'
}
metric() {
  curl -fsS "http://127.0.0.1:$KV_HTTP/metrics" | awk -v m="$1" '$1 == m { print $2 }'
}

echo "== durable SET: redis-benchmark -n $REQUESTS -c $CLIENTS -P 1 -r 100000 -t set," \
  "$ROUNDS round(s), medians =="
echo "kvtierd: durability=sync, io_threads=${IO_THREADS:-kvtierd default}; redis-server: appendonly yes, appendfsync always"
echo "data under $DIR ($(df -PT "$DIR" | awk 'NR == 2 { print $2 }'))"
printf '%-8s %14s %14s %8s %14s %14s %12s %16s\n' value "kvtierd ops/s" "redis ops/s" ratio \
  "kv sets/commit" "kv cpu us/set" "kv vcsw/set" "redis cpu us/set"
for bytes in $SET_SIZES; do
  kv=()
  rv=()
  commits0=$(metric kvtier_ssd_commits_total || echo 0)
  cpu=0
  csw=0
  rcpu=0
  for _ in $(seq 1 "$ROUNDS"); do
    c0=$(cpu_us "$KV_PID")
    s0=$(vcsw)
    kv+=("$(set_ops "$KV_PORT" "$bytes")")
    c1=$(cpu_us "$KV_PID")
    s1=$(vcsw)
    cpu=$((cpu + c1 - c0))
    csw=$((csw + s1 - s0))
    c0=$(cpu_us "$REDIS_PID")
    rv+=("$(set_ops "$REDIS_PORT" "$bytes")")
    c1=$(cpu_us "$REDIS_PID")
    rcpu=$((rcpu + c1 - c0))
  done
  commits1=$(metric kvtier_ssd_commits_total || echo 0)
  k=$(printf '%s\n' "${kv[@]}" | median)
  r=$(printf '%s\n' "${rv[@]}" | median)
  awk -v b="$bytes" -v k="$k" -v r="$r" -v n="$((REQUESTS * ROUNDS))" \
    -v c="$((commits1 - commits0))" -v cpu="$cpu" -v csw="$csw" -v rcpu="$rcpu" 'BEGIN {
      printf "%-8s %14.0f %14.0f %8.2f %14.1f %14.0f %12.2f %16.0f\n", b, k, r, (r > 0 ? k / r : 0),
        (c > 0 ? n / c : 0), cpu / n, csw / n, rcpu / n
    }'
done

# MSETs of MSET_KEYS keys (each key out of 100k at random per request, 1,024-byte values).
((MSET_KEYS > 0)) || exit 0
value=$(head -c 1024 /dev/zero | tr '\0' v)
mset_args=()
for i in $(seq 1 "$MSET_KEYS"); do mset_args+=("m$i:__rand_int__" "$value"); done
mset_ops() {
  redis-benchmark -p "$1" -n "$MSET_REQUESTS" -c "$CLIENTS" -P 1 -r 100000 --csv MSET \
    "${mset_args[@]}" | awk -F'"' 'NR == 2 { print $4 }'
}
echo "== durable MSET of $MSET_KEYS keys x 1024 bytes: redis-benchmark -n $MSET_REQUESTS" \
  "-c $CLIENTS -P 1 -r 100000 MSET ..., $ROUNDS round(s), medians =="
printf '%-8s %14s %14s %8s %14s\n' keys "kvtierd mset/s" "redis mset/s" ratio "kv keys/commit"
kv=()
rv=()
commits0=$(metric kvtier_ssd_commits_total || echo 0)
for _ in $(seq 1 "$ROUNDS"); do
  kv+=("$(mset_ops "$KV_PORT")")
  rv+=("$(mset_ops "$REDIS_PORT")")
done
commits1=$(metric kvtier_ssd_commits_total || echo 0)
k=$(printf '%s\n' "${kv[@]}" | median)
r=$(printf '%s\n' "${rv[@]}" | median)
awk -v n="$MSET_KEYS" -v k="$k" -v r="$r" -v keys="$((MSET_REQUESTS * ROUNDS * MSET_KEYS))" \
  -v c="$((commits1 - commits0))" 'BEGIN {
    printf "%-8s %14.0f %14.0f %8.2f %14.1f\n", n, k, r, (r > 0 ? k / r : 0), (c > 0 ? keys / c : 0)
  }'
