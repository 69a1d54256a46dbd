#!/bin/sh
# kvtier-engine end to end: init, generate twice (same seed -> same output, threads 1 vs 2),
# bench --json, and usage errors. Args: <kvtier-engine binary> <config> <work dir>.
set -eu
bin=$1 config=$2 dir=$3
mkdir -p "$dir"
model="$dir/mini.safetensors"
"$bin" init --config "$config" --seed 5 --out "$model"
printf 'Resume the agent session from the cache.' > "$dir/prompt.txt"
a=$("$bin" generate --model "$model" --config "$config" --prompt-file "$dir/prompt.txt" \
      --max-new 8 --temperature 0.7 --top-p 0.9 --seed 11 --ids --threads 1 | tail -n 1)
b=$("$bin" generate --model "$model" --config "$config" --prompt-file "$dir/prompt.txt" \
      --max-new 8 --temperature 0.7 --top-p 0.9 --seed 11 --ids --threads 2 | tail -n 1)
[ "$a" = "$b" ] || { echo "sampling differs: '$a' vs '$b'"; exit 1; }
[ "$(echo "$a" | wc -w)" -eq 8 ] || { echo "expected 8 ids, got '$a'"; exit 1; }
"$bin" bench --model "$model" --config "$config" --prompt-tokens 32 --decode-tokens 4 --json \
  | grep -q '"decode_tokens_per_s"'
if "$bin" generate --model "$model" --config "$config" 2>/dev/null; then
  echo "missing --prompt-file accepted"; exit 1
fi
if "$bin" init --config /nonexistent --out "$dir/x" 2>/dev/null; then
  echo "bad config accepted"; exit 1
fi
rm -rf "$dir"
echo "1 passed, 0 failed"
