#!/bin/sh
# kvtier-engine end to end: init, generate twice (same seed -> same output, threads 1 vs 2), and
# on the host twin's layers, bench --json, and usage errors. Args: <kvtier-engine binary> <config> <work dir>.
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
# The layers on the host twin (the GPU's kernels on the CPU): the same sampled ids; an
# unknown device is a usage error.
c=$("$bin" generate --model "$model" --config "$config" --prompt-file "$dir/prompt.txt" \
      --max-new 8 --temperature 0.7 --top-p 0.9 --seed 11 --ids --layer-device host-twin | tail -n 1)
[ "$a" = "$c" ] || { echo "host twin differs: '$a' vs '$c'"; exit 1; }
set +e
"$bin" generate --model "$model" --config "$config" --prompt-file "$dir/prompt.txt" \
  --layer-device gpu 2>/dev/null
rc=$?
set -e
[ "$rc" -eq 2 ] || { echo "--layer-device gpu: exit $rc, not 2"; exit 1; }
"$bin" bench --model "$model" --config "$config" --prompt-tokens 32 --decode-tokens 4 --json \
  | grep -q '"decode_tokens_per_s"'
if "$bin" generate --model "$model" --config "$config" 2>/dev/null; then
  echo "missing --prompt-file accepted"; exit 1
fi
if "$bin" init --config /nonexistent --out "$dir/x" 2>/dev/null; then
  echo "bad config accepted"; exit 1
fi
# A config within every per-field limit whose weights would take terabytes: refused, naming
# the bound, before anything is allocated or written.
sed -e 's/"hidden_size":[0-9]*/"hidden_size":65536/' -e 's/"vocab_size":[0-9]*/"vocab_size":4194304/' \
  "$config" > "$dir/huge.json"
set +e
msg=$("$bin" init --config "$dir/huge.json" --out "$dir/huge.safetensors" 2>&1)
rc=$?
set -e
[ "$rc" -eq 1 ] && echo "$msg" | grep -q kInitWeightsBytesMax && [ ! -e "$dir/huge.safetensors" ] \
  || { echo "oversize init: rc $rc, '$msg'"; exit 1; }
# fidelity: exact restore agrees 1.0 with KL 0 and a replay of the whole history too (JSON);
# bad arguments exit 2 with a message before the weights load.
head -c 200 "$config" > "$dir/text.txt"
"$bin" fidelity --model "$model" --config "$config" --prompt-file "$dir/text.txt" \
  --histories 64,128 --replay-tokens W,128 --eval-tokens 8 --json > "$dir/fid.json"
grep -q '"samples": 1' "$dir/fid.json" || { echo "fidelity JSON: no samples key"; exit 1; }
[ "$(grep -c '"top1_agreement": 1.0' "$dir/fid.json")" -ge 3 ] || {
  echo "fidelity: exact restore or full replay below 1.0"; cat "$dir/fid.json"; exit 1; }
"$bin" fidelity --model "$model" --config "$config" --prompt-file "$dir/text.txt" \
  --histories 64 --replay-tokens 2W --eval-tokens 4 | grep -q '(b) exact'
for bad in "--replay-tokens 8" "--replay-tokens 0W" "--replay-tokens x" "--histories 100" \
           "--histories 256" "--eval-tokens 0" "--samples 3"; do
  set +e
  # shellcheck disable=SC2086
  msg=$("$bin" fidelity --model /nonexistent --config "$config" --prompt-file "$dir/text.txt" \
        --histories 64 --eval-tokens 8 $bad 2>&1 >/dev/null)
  rc=$?
  set -e
  [ "$rc" -eq 2 ] || { echo "fidelity $bad: exit $rc, want 2"; exit 1; }
  [ -n "$msg" ] || { echo "fidelity $bad: no message"; exit 1; }
done
rm -rf "$dir"
echo "1 passed, 0 failed"
