#!/bin/sh
# Engram rows from kvtierd, end to end with the real binaries: `kvtier engram build` writes the
# tables of deterministic mini weights, kvtierd serves them ([engram]), `kvtier-engine generate
# --engram-socket` reads its rows through the daemon's row server and prints exactly what the
# same command prints with the weights' own tables; `kvtier engram grant` works against the
# same daemon, and the engine's fetch report shows up on /metrics.
# Args: <kvtier> <kvtier-engine> <kvtierd> <config> <work dir>.
set -eu
kvtier=$1 engine=$2 kvtierd=$3 config=$4 dir=$5
rm -rf "$dir"
mkdir -p "$dir"
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
}
trap cleanup EXIT
# A free loopback port for the row server and one for /metrics (ask the kernel via python3 if
# present, else pick from the pid).
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
    2>/dev/null || echo $(( 20000 + ($$ + $1) % 30000 ))
}
row_port=$(free_port 0)
http_port=$(free_port 7)
model="$dir/mini.safetensors"
"$engine" init --config "$config" --seed 3 --out "$model" >/dev/null
"$kvtier" engram build --model "$model" --config "$config" --out "$dir/tables" --shards 2 \
  --endpoints "127.0.0.1:$row_port" > /dev/null
cat > "$dir/kvtierd.toml" <<TOML
[server]
resp_port = 0
http_port = $http_port
[engram]
enabled = true
listen = "127.0.0.1:$row_port"
dir = "$dir/tables"
TOML
"$kvtierd" --config "$dir/kvtierd.toml" --data-dir "$dir/data" --socket "$dir/d.sock" \
  2> "$dir/kvtierd.log" &
pid=$!
i=0
until [ -S "$dir/d.sock" ]; do
  i=$((i + 1))
  [ $i -lt 200 ] || { echo "kvtierd did not start"; cat "$dir/kvtierd.log"; exit 1; }
  sleep 0.05
done
printf 'The quick brown fox jumps over the lazy dog. ' > "$dir/prompt.txt"
"$engine" generate --model "$model" --config "$config" --prompt-file "$dir/prompt.txt" \
  --max-new 12 --ids > "$dir/local.txt"
"$engine" generate --model "$model" --config "$config" --prompt-file "$dir/prompt.txt" \
  --max-new 12 --ids --engram-socket "$dir/d.sock" > "$dir/remote.txt" 2> "$dir/remote.err"
cmp -s "$dir/local.txt" "$dir/remote.txt" \
  || { echo "remote Engram output differs"; cat "$dir/local.txt" "$dir/remote.txt"; exit 1; }
grep -q '^engram: transport ' "$dir/remote.err" \
  || { echo "no engram stats line"; cat "$dir/remote.err"; exit 1; }
grep -q ' 0 rows read' "$dir/remote.err" && { echo "no rows were read remotely"; exit 1; }
# The grant command against the same daemon: 4 regions (2 layers x 2 shards).
"$kvtier" engram grant --daemon "$dir/d.sock" > "$dir/grant.txt" 2>&1 \
  || { echo "engram grant failed"; cat "$dir/grant.txt"; exit 1; }
[ "$(grep -c 'engram\.l[16]\.s[01]' "$dir/grant.txt")" -ge 4 ] \
  || { echo "grant did not list 4 regions"; cat "$dir/grant.txt"; exit 1; }
# The engine's report is on /metrics under the default tenant.
if command -v curl >/dev/null 2>&1; then
  curl -sf "http://127.0.0.1:$http_port/metrics" > "$dir/metrics.txt"
  grep -q '^kvtier_engram_fetch_rows_read_total{tenant="default",transport="tcp"} [1-9]' \
    "$dir/metrics.txt" || { echo "fetch report not on /metrics"; grep engram "$dir/metrics.txt"; exit 1; }
fi
cleanup
pid=""
trap - EXIT
rm -rf "$dir"
echo "1 passed, 0 failed"
