#!/usr/bin/env bash
# The GPU check: the CUDA tests and the GPU benchmarks in one run, on a machine with an NVIDIA
# GPU (an H200 lent by the device tool), from binaries packed here by deploy/gpu/pack.sh.
#
#   deploy/gpu/check.sh [--allow-no-gpu]          (from the repository root)
#
# Needs build/gpu-pack (carried to the device machine) and the repository's sources and models
# (tests/engine/golden, deploy/models). Writes every log and a summary to $OUT (the device
# tool's folder; ./gpu-check-out when unset) and exits 1 when any test failed.
#
# Tests run with KVTIER_REQUIRE_CUDA=1, so a device the CUDA runtime cannot use is a failure,
# not a skip (tests/cuda_required.h): the engine's CUDA MatMul bit for bit against the CPU and
# a prompt's logits with and without it; every FP4/FP8 codec on the CUDA backend against the
# reference and NVIDIA's vectors; the golden logits of the PyTorch reference with the engine's
# CUDA MatMul on and off; the HBM and DRAM tiers on cudaMalloc / cudaHostAlloc memory.
# Benchmarks (each bounded by a timeout, so one slow step cannot spend the lease): prefill and
# decode tokens/s of mini-v4.1 with KVTIER_ENGINE_CUDA=0 and 1 (1 and all threads); batched
# decode and a 6-token verify pass, whose printed digests must agree with and without CUDA;
# the resume of 16K- and 64K-token sessions against recompute with the CUDA MatMul on.
#
# --allow-no-gpu: run the same steps without a GPU (CUDA tests skip, benchmarks run on the
# CPU), to check this script and the pack on a machine without one.
set -uo pipefail

OUT=${OUT:-$PWD/gpu-check-out}
PACK=$PWD/build/gpu-pack
REQUIRE_GPU=1
[ "${1:-}" = "--allow-no-gpu" ] && REQUIRE_GPU=0
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
failed=0

note() { echo "$*" | tee -a "$SUMMARY"; }
# step NAME TIMEOUT_S COMMAND...: runs the command with its output in $OUT/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "$(printf '%-28s rc %3d  %4d s' "$name" "$rc" $((SECONDS - t0)))"
  return "$rc"
}
# test NAME TIMEOUT_S COMMAND...: a step whose failure fails the check.
test_step() { step "$@" || failed=1; }

[ -f "$PACK/manifest" ] || { echo "gpu check: no $PACK (run deploy/gpu/pack.sh and carry it)" >&2; exit 2; }
note "== kvtier GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
sed 's/^/pack: /' "$PACK/manifest" | tee -a "$SUMMARY"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
    | sed 's/^/gpu: /' | tee -a "$SUMMARY"
elif [ "$REQUIRE_GPU" = 1 ]; then
  note "gpu: nvidia-smi not found"; exit 2
fi
note "cpu: $(nproc) cores"

# The binaries find sources, models and each other by the paths they were built with: restore
# the build tree's layout here and, when this checkout lives elsewhere, link the old root to it.
src_root=$(sed -n 's/^source_root //p' "$PACK/manifest")
cp -a "$PACK/tree/." .
if [ "$src_root" != "$PWD" ]; then
  if [ -e "$src_root" ]; then
    echo "gpu check: $src_root exists and is not this checkout" >&2; exit 2
  fi
  mkdir -p "$(dirname "$src_root")" && ln -s "$PWD" "$src_root"
fi
B=$(sed -n 's/^build_dir //p' "$PACK/manifest")
export LD_LIBRARY_PATH=$PACK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVTIER_SHARED_DIR=$PACK/shared
[ "$REQUIRE_GPU" = 1 ] && export KVTIER_REQUIRE_CUDA=1
threads=$(nproc)

note "-- tests"
test_step engine_cuda_test 120 "$B/tests/engine/kvtier_engine_cuda_test"
test_step kernels_test 120 "$B/tests/kernels/kvtier_kernels_test"
test_step kernels_vectors_test 120 "$B/tests/kernels/kvtier_kernels_vectors_test"
test_step storage_arena_test 60 "$B/tests/storage/kvtier_storage_test" --gtest_filter='MemoryTierArena.*'
test_step golden_test_cuda 180 env KVTIER_ENGINE_CUDA=1 "$B/tests/engine/kvtier_engine_golden_test"
test_step golden_test_cpu 180 env KVTIER_ENGINE_CUDA=0 "$B/tests/engine/kvtier_engine_golden_test"

note "-- benchmarks"
E=$B/engine/kvtier-engine
MINI=/tmp/kvtier-mini-seed1.safetensors
test_step mini_init 60 "$E" init --config deploy/models/mini-v4.1.json --seed 1 --out "$MINI"
for cuda in 0 1; do
  for t in 1 "$threads"; do
    test_step "engine_bench_cuda${cuda}_t${t}" 120 env KVTIER_ENGINE_CUDA=$cuda "$E" bench \
      --model "$MINI" --config deploy/models/mini-v4.1.json --json --threads "$t" \
      --prompt-tokens 1024 --decode-tokens 64
  done
  test_step "forward_batch_cuda${cuda}" 180 env KVTIER_ENGINE_CUDA=$cuda \
    "$B/bench/engine/kvtier_bench_forward_batch" --config deploy/models/mini-v4.1.json \
    --model "$MINI" --threads "1,$threads" --k 1,16 --rounds 3 --steps 4 --history 256 \
    --verify-tokens 6
done
# Batched passes must give the same bits with the CUDA MatMul as without it.
d0=$(sed -n 's/^digest //p' "$OUT/forward_batch_cuda0.log")
d1=$(sed -n 's/^digest //p' "$OUT/forward_batch_cuda1.log")
if [ -n "$d0" ] && [ "$d0" = "$d1" ]; then
  note "forward_batch digests equal   $d0"
else
  note "forward_batch digests DIFFER  cpu '$d0' cuda '$d1'"; failed=1
fi
mkdir -p /tmp/kvtier-gpu-resume
test_step resume_bench_cuda1 300 env KVTIER_ENGINE_CUDA=1 "$B/bench/resume/kvtier_resume_bench" speed \
  --tokens 16384,65472 --threads "$threads" --recompute-runs 1 --restarts 3 --fio-loops 5 \
  --dir /tmp/kvtier-gpu-resume

note "-- figures"
for f in "$OUT"/engine_bench_*.log; do
  note "$(basename "$f" .log): $(tr -d '\n' <"$f" | cut -c1-300)"
done
grep -h -E "^(decode|verify) " "$OUT"/forward_batch_cuda*.log | tee -a "$SUMMARY" >/dev/null
grep -h -E "^== |^recompute \(CED|^1st resume|^2nd resume|^after restart, median|^fetch vs fio" \
  "$OUT/resume_bench_cuda1.log" | tee -a "$SUMMARY" >/dev/null
note "== $([ "$failed" = 0 ] && echo PASSED || echo FAILED)"
exit "$failed"
