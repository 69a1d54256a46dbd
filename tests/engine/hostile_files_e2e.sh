#!/bin/sh
# kvtier-engine against files whose size says nothing about what reading them needs: a 1 TiB
# sparse weights file, a directory as weights or draft, /dev/zero as weights, prompt or config.
# Each exits with a message and its error code (1; 2 for generate's over-long prompt, a usage
# error), and reads no more than the limit: the old whole-file reads died of std::bad_alloc (SIGABRT) or
# read /dev/zero until out of memory. A real weights file extended to 1 TiB by a sparse tail
# still loads: only the header and the config's tensors are read.
# Args: <kvtier-engine> <source dir> <work dir>.
set -eu
bin=$1 src=$2 dir=$3
rm -rf "$dir"
mkdir -p "$dir"
model="$src/deploy/models/kvmini-trained.safetensors"
config="$src/deploy/models/kvmini-trained.json"
printf 'The cache ' > "$dir/prompt.txt"
# Every run under a 60 s timeout (the old reads of /dev/zero did not end).
eng() { timeout 60 "$bin" "$@"; }
# expect <rc> <message pattern> <command...>
expect() {
  want=$1 pattern=$2
  shift 2
  set +e
  msg=$("$@" 2>&1 >/dev/null)
  rc=$?
  set -e
  [ "$rc" -eq "$want" ] || { echo "$*: exit $rc, want $want: $msg"; exit 1; }
  echo "$msg" | grep -q "$pattern" || { echo "$*: message '$msg' lacks '$pattern'"; exit 1; }
}
gen() {
  eng generate --config "$config" --prompt-file "$dir/prompt.txt" --max-new 4 --ids --threads 1 \
    "$@"
}
truncate -s 1T "$dir/sparse.safetensors"
expect 1 'bad header' gen --model "$dir/sparse.safetensors"
mkdir "$dir/dir.safetensors"
expect 1 'not a regular file' gen --model "$dir/dir.safetensors"
expect 1 'not a regular file' gen --model /dev/zero
expect 2 'the prompt must have' eng generate --model "$model" --config "$config" \
  --prompt-file /dev/zero --max-new 4
expect 1 'prompt too long' eng resume --model "$model" --config "$config" \
  --socket "$dir/no.sock" --prompt-file /dev/zero
expect 1 'kEngineConfigBytesMax' eng generate --model "$model" --config /dev/zero \
  --prompt-file "$dir/prompt.txt"
expect 1 'not a regular file' gen --model "$model" --speculative --draft "$dir/dir.safetensors"
# The real weights with a 1 TiB sparse tail: the same continuation as the file itself.
cp "$model" "$dir/tail.safetensors"
truncate -s 1T "$dir/tail.safetensors"
want=$(gen --model "$model" | tail -n 1)
got=$(gen --model "$dir/tail.safetensors" | tail -n 1)
[ "$want" = "$got" ] || { echo "sparse tail: '$got', want '$want'"; exit 1; }
rm -rf "$dir"
echo "hostile_files_e2e: ok"
