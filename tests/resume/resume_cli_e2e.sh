#!/bin/sh
# kvtier-engine resume against the real kvtierd on the trained miniature.
# A resume of more than kMaxTokensPerCall (65,536) tokens that misses (nothing saved) is a CED
# prefill of every token: it used to exit 1 with "more than kMaxTokensPerCall tokens in one
# call" although resume takes up to kMaxSessionTokens ids (or a 1 MiB prompt).
# Args: <kvtier-engine> <kvtierd> <source dir> <work dir>.
set -eu
engine=$1 kvtierd=$2 src=$3 dir=$4
rm -rf "$dir"
mkdir -p "$dir"
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
}
trap cleanup EXIT
model="$src/deploy/models/kvmini-trained.safetensors"
config="$src/deploy/models/kvmini-trained.json"
cat > "$dir/kvtierd.toml" <<TOML
[server]
resp_port = 0
http_port = 0
[storage]
dram_capacity_bytes = 33554432
ssd_capacity_bytes = 268435456
ssd_segment_bytes = 16777216
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
# 65,600 ids: one engine call cannot take them.
awk 'BEGIN { for (i = 0; i < 65600; i++) printf "%d ", 3 + (i * 7919) % 256; print "" }' \
  > "$dir/long_ids.txt"
"$engine" resume --model "$model" --config "$config" --socket "$dir/d.sock" \
  --tokens-file "$dir/long_ids.txt" --max-new 2 --json > "$dir/long.json" 2> "$dir/long.err" \
  || { echo "resume of 65,600 tokens failed"; cat "$dir/long.err"; exit 1; }
grep -q '"tokens": 65600' "$dir/long.json" && grep -q '"recomputed": true' "$dir/long.json" \
  || { echo "resume of 65,600 tokens: unexpected report"; cat "$dir/long.json"; exit 1; }
kill "$pid"
wait "$pid" 2>/dev/null || true
pid=""
rm -rf "$dir"
echo "resume_cli_e2e: ok"
