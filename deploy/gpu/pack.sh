#!/usr/bin/env bash
# Packs what the GPU check (deploy/gpu/check.sh) runs, for a machine that has a GPU but not
# this project's build dependencies (the device machines lent to a session: CUDA, CMake and a
# compiler, but no RocksDB, Boost, liburing or GoogleTest, and no package registry).
#
#   deploy/gpu/pack.sh [BUILD_DIR]      (from the repository root; BUILD_DIR: build/release)
#
# Builds the CUDA tests and the benchmarks in BUILD_DIR (CUDA must be on there: nvcc found or
# KVTIER_WITH_CUDA=ON), then writes build/gpu-pack/ (git-ignored, at most 46 MiB):
#   tree/<BUILD_DIR>/...  the binaries, stripped, at their paths in the build tree (tests and
#                         benches find each other and the sources by compiled-in paths);
#   lib/                  every shared library they load except the C runtime's own
#                         (glibc, libstdc++, libgcc_s) and the GPU driver's (libcuda);
#   shared/vectors/       the reference vectors the tests read (../shared is not carried);
#   manifest              the source root the binaries were built in, the commit, nvcc.
# The device machine then needs only: deploy/gpu/check.sh, run from the repository root with
# build/gpu-pack carried.
set -euo pipefail

BUILD_DIR=${1:-build/release}
PACK=build/gpu-pack
SHARED=${KVTIER_SHARED_DIR:-../shared}
# Binaries the check runs (paths relative to BUILD_DIR).
BINARIES=(
  tests/engine/kvtier_engine_cuda_test
  tests/engine/kvtier_engine_device_test
  tests/engine/kvtier_engine_golden_test
  tests/kernels/kvtier_kernels_test
  tests/kernels/kvtier_kernels_vectors_test
  tests/storage/kvtier_storage_test
  engine/kvtier-engine
  bench/engine/kvtier_bench_forward_batch
  bench/engine/kvtier_bench_cuda_matmul
  bench/resume/kvtier_resume_bench
  bench/speculative/kvtier_spec_bench
  bench/speculative/kvtier_spec_engram_bench
  cache_daemon/kvtierd
)
# The device tool carries 64 MiB in all, the checkout included (its tracked files: about 14.1 MiB
# in session 42), so 46 MiB leaves about 4 MiB for the checkout to grow. The binaries link the
# engine statically, so each engine change grows the pack about tenfold (session 42's device
# attention and KV mirror: about 1.5 MB).
PACK_BYTES_MAX=$((46 << 20))

die() { echo "gpu pack: $*" >&2; exit 1; }

{ [ -f CMakePresets.json ] && [ -d engine ]; } || die "run from the repository root"
[ -f "$BUILD_DIR/CMakeCache.txt" ] || die "$BUILD_DIR is not configured (make build)"
grep -q 'KVTIER_WITH_CUDA=1' "$BUILD_DIR/compile_commands.json" 2>/dev/null ||
  die "$BUILD_DIR was configured without CUDA (nvcc not found? KVTIER_WITH_CUDA=ON fails loudly)"
for v in fp4_e2m1.json engram_hash.json; do
  [ -f "$SHARED/vectors/$v" ] || die "missing $SHARED/vectors/$v (set KVTIER_SHARED_DIR)"
done

targets=()
for b in "${BINARIES[@]}"; do targets+=("$(basename "$b")"); done
cmake --build "$BUILD_DIR" -j "$(nproc)" --target "${targets[@]}"

rm -rf "$PACK"
mkdir -p "$PACK/lib" "$PACK/shared/vectors"
for b in "${BINARIES[@]}"; do
  [ -x "$BUILD_DIR/$b" ] || die "$BUILD_DIR/$b was not built"
  mkdir -p "$PACK/tree/$BUILD_DIR/$(dirname "$b")"
  strip -o "$PACK/tree/$BUILD_DIR/$b" "$BUILD_DIR/$b"
  # Each library the binary loads, minus the C runtime and the driver (the device's own).
  ldd "$BUILD_DIR/$b" | awk '/=> \// { print $3 }' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so.* | libm.so.* | libdl.so.* | librt.so.* | libpthread.so.* | ld-linux* | \
        libstdc++.so.* | libgcc_s.so.* | libcuda.so.*) ;;
      *) [ -f "$PACK/lib/$(basename "$lib")" ] || strip -o "$PACK/lib/$(basename "$lib")" "$lib" ;;
    esac
  done
done
cp "$SHARED/vectors/fp4_e2m1.json" "$SHARED/vectors/engram_hash.json" "$PACK/shared/vectors/"
{
  echo "source_root $(pwd)"
  echo "build_dir $BUILD_DIR"
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo +dirty)"
  echo "nvcc $(nvcc --version 2>/dev/null | tail -1 || echo unknown)"
  echo "cuda_architectures $(sed -n 's/^KVTIER_CUDA_ARCHITECTURES:STRING=//p' "$BUILD_DIR/CMakeCache.txt")"
  echo "packed $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$PACK/manifest"

bytes=$(du -sb "$PACK" | cut -f1)
[ "$bytes" -le "$PACK_BYTES_MAX" ] ||
  die "$PACK is $((bytes >> 20)) MiB, over $((PACK_BYTES_MAX >> 20)) MiB"
echo "gpu pack: $PACK, $((bytes >> 20)) MiB ($(ls "$PACK/lib" | wc -l) libraries)"
cat "$PACK/manifest"
