// TuneMallocForServer keeps freed memory for reuse: receiving a 1.5 MiB reply again and again
// (a buffer grown chunk by chunk, its body copied out, both freed) costs no page faults once
// tuned, where with glibc's defaults every reply maps and faults its pages in again (the
// growing buffer's sizes pass the adaptive mmap threshold, and the heap's top is trimmed after
// the frees). Counted with getrusage's minor faults, in a fresh process for the untuned case
// (the tuning is global).
#include "common/malloc_tuning.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/sanitizers.h"

namespace kvtier {
namespace {

constexpr size_t kChunkBytes = size_t{256} << 10;
constexpr int kChunks = 6;  // a 1.5 MiB frame, as a kvtierd reply of 256 units over TCP
constexpr int kRounds = 20;

// Minor page faults while kRounds "replies" are received and read: a buffer grown by 256 KiB
// chunks (as a socket reader appends), its body copied out and read, both freed (after one
// such round first, so that each state is measured at its steady state).
int64_t FaultsOfTransientBuffers() {
  auto round = [] {
    const std::vector<uint8_t> chunk(kChunkBytes, 1);
    std::vector<uint8_t> buffer;
    for (int i = 0; i < kChunks; ++i) buffer.insert(buffer.end(), chunk.begin(), chunk.end());
    const std::vector<uint8_t> body(buffer.begin() + 16, buffer.end());
    volatile uint8_t sum = 0;
    for (size_t i = 0; i < body.size(); i += 4096) sum = sum + body[i];
  };
  round();
  rusage before{}, after{};
  ::getrusage(RUSAGE_SELF, &before);
  for (int i = 0; i < kRounds; ++i) round();
  ::getrusage(RUSAGE_SELF, &after);
  return after.ru_minflt - before.ru_minflt;
}

// Run as a child of the test (KVTIER_MALLOC_TUNING_CHILD set), this binary prints the faults
// of glibc's defaults and exits before any test runs: a fresh process, whatever the parent has
// tuned (a fork would inherit it, so --gtest_repeat would measure the tuned allocator).
const bool kChildMeasured = [] {
  if (std::getenv("KVTIER_MALLOC_TUNING_CHILD") == nullptr) return false;
  std::printf("%lld\n", static_cast<long long>(FaultsOfTransientBuffers()));
  std::fflush(stdout);
  ::_exit(0);
}();

TEST(MallocTuning, FreedBuffersAreReusedWithoutPageFaults) {
  if (kSanitizerAllocator) GTEST_SKIP() << "a sanitizer's allocator takes no mallopt settings";
  ::unsetenv("GLIBC_TUNABLES");
  char self[4096] = {};
  ASSERT_GT(::readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  FILE* child = ::popen(("KVTIER_MALLOC_TUNING_CHILD=1 '" + std::string(self) + "'").c_str(), "r");
  ASSERT_NE(child, nullptr);
  long long untuned = -1;
  EXPECT_EQ(std::fscanf(child, "%lld", &untuned), 1);
  EXPECT_EQ(::pclose(child), 0);

  ASSERT_TRUE(TuneMallocForServer());
  const int64_t tuned = FaultsOfTransientBuffers();
  // The figures docs/performance/serving.md quotes.
  std::printf("minor page faults over %d replies: glibc's defaults %lld, tuned %lld\n", kRounds,
              untuned, static_cast<long long>(tuned));
  // Untuned: hundreds of faults per round (a round touches about 900 pages). Tuned: none
  // once warm.
  EXPECT_GT(untuned, kRounds * 100)
      << "glibc's defaults reused the buffers: the test shows nothing";
  EXPECT_LT(tuned, 64) << "untuned: " << untuned;
}

// An operator's GLIBC_TUNABLES for malloc stands: nothing is changed.
TEST(MallocTuning, AnOperatorsMallocTunablesAreLeftAlone) {
  if (kSanitizerAllocator) GTEST_SKIP() << "a sanitizer's allocator takes no mallopt settings";
  ASSERT_EQ(::setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1048576", 1), 0);
  EXPECT_FALSE(TuneMallocForServer());
  ASSERT_EQ(::setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F", 1), 0);
  EXPECT_TRUE(TuneMallocForServer());
  ::unsetenv("GLIBC_TUNABLES");
}

}  // namespace
}  // namespace kvtier
