#!/bin/sh
# `kvtier engram build` end to end: weights from kvtier-engine init, 2 shards per table, the
# files and shards.toml it writes, and usage errors.
# Args: <kvtier binary> <kvtier-engine binary> <config> <work dir>.
set -eu
kvtier=$1 engine=$2 config=$3 dir=$4
rm -rf "$dir"
mkdir -p "$dir"
model="$dir/mini.safetensors"
"$engine" init --config "$config" --seed 7 --out "$model" >/dev/null
"$kvtier" engram build --model "$model" --config "$config" --out "$dir/tables" --shards 2 \
  --endpoints 127.0.0.1:7301,127.0.0.1:7302 --json > "$dir/out.json"
for l in 1 6; do
  for s in 0 1; do
    f="$dir/tables/engram.l$l.s$s.engram"
    [ -s "$f" ] || { echo "missing $f"; exit 1; }
    # Header magic.
    [ "$(head -c 8 "$f")" = "KVTENGRM" ] || { echo "bad magic in $f"; exit 1; }
    grep -q "\"engram.l$l.s$s\"" "$dir/out.json" || { echo "engram.l$l.s$s not reported"; exit 1; }
  done
done
[ "$(grep -c '^\[\[engram\.l[16]\.shard\]\]' "$dir/tables/shards.toml")" -eq 4 ] \
  || { echo "shards.toml should list 4 shards"; cat "$dir/tables/shards.toml"; exit 1; }
grep -q 'endpoint = "127.0.0.1:7302"' "$dir/tables/shards.toml" \
  || { echo "second endpoint not used"; exit 1; }
# Bytes on disk = 64-byte header + rows x 33 for every file, as reported.
total_rows=0
for f in "$dir"/tables/*.engram; do
  size=$(wc -c < "$f")
  [ $(( (size - 64) % 33 )) -eq 0 ] || { echo "$f: size $size is not 64 + k*33"; exit 1; }
  total_rows=$(( total_rows + (size - 64) / 33 ))
done
[ "$total_rows" -gt 0 ] || { echo "no rows"; exit 1; }
set +e
"$kvtier" engram build --model "$model" --config "$config" --out "$dir/x" --shards 0 2>/dev/null
[ $? -eq 2 ] || { echo "--shards 0 accepted"; exit 1; }
"$kvtier" engram build --model "$model" --config "$config" 2>/dev/null
[ $? -eq 2 ] || { echo "missing --out accepted"; exit 1; }
"$kvtier" engram build --model /nonexistent --config "$config" --out "$dir/x" 2>/dev/null
[ $? -eq 1 ] || { echo "missing weights not an error"; exit 1; }
set -e
rm -rf "$dir"
echo "1 passed, 0 failed"
