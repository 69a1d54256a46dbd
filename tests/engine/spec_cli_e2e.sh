#!/bin/sh
# kvtier-engine generate --speculative end to end on the trained miniature: greedy output
# equals plain greedy's (fixed draft length 5 and the scheduler), the counters line is
# printed, --bos prepends bos, sampling runs, and bad flags are refused.
# Args: <kvtier-engine> <source dir> <work dir>.
set -eu
bin=$1 src=$2 dir=$3
mkdir -p "$dir"
model="$src/deploy/models/kvmini-trained.safetensors"
config="$src/deploy/models/kvmini-trained.json"
printf '    def __init__(self, name, value=None):\n        self.' > "$dir/prompt.txt"
gen() {
  "$bin" generate --model "$model" --config "$config" --prompt-file "$dir/prompt.txt" \
    --max-new 48 --ids --full --threads 1 "$@" 2> "$dir/err.txt" | tail -n 1
}
plain=$(gen)
five=$(gen --speculative --draft-len 5)
grep -q 'speculative: .* accepted' "$dir/err.txt" || { cat "$dir/err.txt"; exit 1; }
sched=$(gen --speculative)
[ "$plain" = "$five" ] || { echo "draft-len 5 differs: '$plain' vs '$five'"; exit 1; }
[ "$plain" = "$sched" ] || { echo "scheduler differs: '$plain' vs '$sched'"; exit 1; }
# --bos puts the bos token before the prompt (as kvtier_spec_bench does): the session's ids
# start with 0 then the prompt's byte ids, the continuation differs from the bos-less one, and
# speculative greedy still equals plain greedy.
bos=$(gen --bos --tokens-out "$dir/bos_ids.txt")
bos5=$(gen --bos --speculative --draft-len 5)
[ "$(cut -d' ' -f1-3 "$dir/bos_ids.txt")" = "0 35 35" ] || {
  echo "--bos session ids start '$(cut -d' ' -f1-3 "$dir/bos_ids.txt")'"; exit 1; }
[ "$bos" != "$plain" ] || { echo "--bos did not change the continuation"; exit 1; }
[ "$bos" = "$bos5" ] || { echo "--bos draft-len 5 differs: '$bos' vs '$bos5'"; exit 1; }
s=$(gen --speculative --draft-len 3 --temperature 0.8 --top-p 0.9 --seed 3)
[ "$(echo "$s" | wc -w)" -eq 48 ] || { echo "sampling: expected 48 ids, got '$s'"; exit 1; }
run() {
  "$bin" generate --model "$model" --config "$config" --prompt-file "$dir/prompt.txt" \
    --max-new 4 "$@" >/dev/null 2>&1
}
if run --speculative --draft-len 6; then echo "--draft-len 6 accepted"; exit 1; fi
if run --speculative --draft "$dir/missing.safetensors"; then echo "missing draft accepted"; exit 1; fi
run --speculative  # and the default draft path (beside the model) works
echo "spec_cli_e2e: ok"
