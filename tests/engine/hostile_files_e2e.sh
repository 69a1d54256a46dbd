#!/bin/sh
# kvtier-engine against files whose size says nothing about what reading them needs: a 1 TiB
# sparse weights file, a directory as weights or draft, /dev/zero as weights, prompt or config.
# Each exits with a message and its error code (1; 2 for generate's over-long prompt, a usage
# error), and reads no more than the limit: the old whole-file reads died of std::bad_alloc (SIGABRT) or
# read /dev/zero until out of memory. A real weights file extended to 1 TiB by a sparse tail
# still loads: only the header and the config's tensors are read. FP8 NaN codes are refused.
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
# An FP8 byte that means NaN (an Engram table's F8_E8M0 scale 0xff, its F8_E4M3 code 0x7f):
# refused naming the tensor (only F32 tensors were checked for finiteness, and these loaded).
n=$(od -An -t u8 -N 8 "$model" | tr -d ' ')
poison() {  # poison <tensor> <octal byte> <out>: the tensor's first byte replaced
  entry=$(dd if="$model" bs=4096 skip=8 count=$(( (n + 8) / 4096 + 1 )) iflag=skip_bytes \
          2>/dev/null | head -c "$n" | grep -o "\"$1\":{[^}]*}")
  off=$(echo "$entry" | sed 's/.*"data_offsets":\[\([0-9]*\),.*/\1/')
  [ -n "$off" ] || { echo "no offset for $1"; exit 1; }
  cp "$model" "$3"
  printf "\\$2" | dd of="$3" bs=1 seek=$((8 + n + off)) conv=notrunc 2>/dev/null
}
poison layers.1.engram.table_scale 377 "$dir/nan_scale.safetensors"
expect 1 'layers.1.engram.table_scale element 0 is NaN' gen --model "$dir/nan_scale.safetensors"
poison layers.1.engram.table 177 "$dir/nan_code.safetensors"
expect 1 'layers.1.engram.table element 0 is NaN' gen --model "$dir/nan_code.safetensors"
# The real weights with a 1 TiB sparse tail: the same continuation as the file itself.
cp "$model" "$dir/tail.safetensors"
truncate -s 1T "$dir/tail.safetensors"
want=$(gen --model "$model" | tail -n 1)
got=$(gen --model "$dir/tail.safetensors" | tail -n 1)
[ "$want" = "$got" ] || { echo "sparse tail: '$got', want '$want'"; exit 1; }
rm -rf "$dir"
echo "hostile_files_e2e: ok"
