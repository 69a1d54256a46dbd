#!/bin/sh
# kvtier-engine resume against the real kvtierd on the trained miniature.
# A resume of more than kMaxTokensPerCall (65,536) tokens that misses (nothing saved) is a CED
# prefill of every token: it used to exit 1 with "more than kMaxTokensPerCall tokens in one
# call" although resume takes up to kMaxSessionTokens ids (or a 1 MiB prompt). A session saved
# under one config is not restored under another config of the same weights file.
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
# Units and hot states saved under one config are not restored under a config that computes
# other KV from the same weights file (expert_format mxfp4 rounds the routed experts at load):
# the model fingerprint binds the config. The same config still restores them (the control).
sed 's/"swiglu_limit":10.0,/"swiglu_limit":10.0,"expert_format":"mxfp4",/' "$config" \
  > "$dir/mxfp4.json"
grep -q '"expert_format":"mxfp4"' "$dir/mxfp4.json" || { echo "mxfp4 config not made"; exit 1; }
head -c 300 "$config" > "$dir/prompt.txt"
"$engine" generate --model "$model" --config "$config" --prompt-file "$dir/prompt.txt" \
  --max-new 8 --save-socket "$dir/d.sock" --tokens-out "$dir/ids.txt" > /dev/null \
  2> "$dir/save.err" || { echo "generate --save-socket failed"; cat "$dir/save.err"; exit 1; }
resume() {
  "$engine" resume --model "$model" --config "$1" --socket "$dir/d.sock" \
    --tokens-file "$dir/ids.txt" --max-new 4 --json > "$2" 2> "$2.err" \
    || { echo "resume under $1 failed"; cat "$2.err"; exit 1; }
}
resume "$dir/mxfp4.json" "$dir/other.json"
grep -q '"hit_units": 0,' "$dir/other.json" && grep -q '"recomputed": true' "$dir/other.json" \
  && grep -q '"hot_state_restored": false' "$dir/other.json" \
  || { echo "units saved under f32 experts restored under mxfp4"; cat "$dir/other.json"; exit 1; }
resume "$config" "$dir/same.json"
grep -q '"hot_state_restored": true' "$dir/same.json" \
  || { echo "the saving config did not restore its session"; cat "$dir/same.json"; exit 1; }
kill "$pid"
wait "$pid" 2>/dev/null || true
pid=""
rm -rf "$dir"
echo "resume_cli_e2e: ok"
