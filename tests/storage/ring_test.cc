// io_uring rings under injected faults (RingFaults) and DeviceEnv::Stream: a ring error or a
// failed completion reaches exactly the requests it left without a result, each reported once;
// a stream keeps its bound on requests in flight; and the SSD tier's writer, which streams
// its buffers, drops exactly the units a failed write covered and reports it to the commit.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <vector>

#include "storage/block_device.h"
#include "storage/fault_injection.h"
#include "storage/ssd_tier.h"
#include "tests/storage/test_util.h"

namespace kvtier::storage {
namespace {

using testing::MakeKey;
using testing::MakeValue;
using testing::TempDir;

constexpr size_t kBlock = 4096;

std::unique_ptr<DeviceEnv> UringEnv(const std::string& dir, RingFaults* faults) {
  DirEnvOptions d;
  d.engine = IoEngine::kIoUring;
  d.ring_faults = faults;
  auto env = NewDirEnv(dir, d);
  EXPECT_TRUE(env.ok()) << env.status().ToString();
  return env.ok() ? std::move(env).value() : nullptr;
}

// `files` files of `blocks` blocks each, block b of file f filled with the byte f * 16 + b.
std::vector<std::shared_ptr<BlockDevice>> MakeFiles(DeviceEnv* env, int files, int blocks) {
  std::vector<std::shared_ptr<BlockDevice>> devs;
  AlignedBuffer data = AllocateAligned(kBlock, kBlock);
  for (int f = 0; f < files; ++f) {
    auto dev = env->Open("f" + std::to_string(f), true);
    EXPECT_TRUE(dev.ok());
    if (!dev.ok()) return {};
    for (int b = 0; b < blocks; ++b) {
      std::memset(data.get(), f * 16 + b, kBlock);
      EXPECT_TRUE((*dev)->Write(uint64_t(b) * kBlock, {data.get(), kBlock}).ok());
    }
    devs.push_back(std::move(dev).value());
  }
  return devs;
}

// A stream hands over no more than max_inflight requests not yet reported, reports each
// request once with its data in place, and ends when next has none.
void CheckStreamBoundsAndReports(DeviceEnv* env) {
  constexpr int kFiles = 2, kBlocks = 16;
  auto devs = MakeFiles(env, kFiles, kBlocks);
  ASSERT_EQ(devs.size(), size_t{kFiles});
  AlignedBuffer out = AllocateAligned(kFiles * kBlocks * kBlock, kBlock);
  std::vector<DeviceIo> ios;
  for (int f = 0; f < kFiles; ++f) {
    for (int b = 0; b < kBlocks; ++b) {
      size_t k = ios.size();
      ios.push_back(
          {devs[f].get(),
           {IoRequest::Op::kRead, uint64_t(b) * kBlock, out.get() + k * kBlock, kBlock, {}}});
    }
  }
  constexpr size_t kBound = 3;
  size_t handed = 0, reported = 0, most_outstanding = 0;
  std::vector<int> calls(ios.size(), 0);
  Status st = env->Stream(
      kBound,
      [&]() -> DeviceIo* {
        if (handed == ios.size()) return nullptr;
        most_outstanding = std::max(most_outstanding, handed + 1 - reported);
        return &ios[handed++];
      },
      [&](DeviceIo* d) {
        size_t k = static_cast<size_t>(d - ios.data());
        ASSERT_LT(k, ios.size());
        ++calls[k];
        ++reported;
        ASSERT_TRUE(d->io.result.ok()) << k << " " << d->io.result.ToString();
        uint8_t want = static_cast<uint8_t>((k / kBlocks) * 16 + k % kBlocks);
        for (size_t j = 0; j < kBlock; ++j) {
          ASSERT_EQ(d->io.buffer[j], want) << "request " << k << " reported before its data";
        }
      });
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(handed, ios.size());
  EXPECT_LE(most_outstanding, kBound);
  for (size_t k = 0; k < ios.size(); ++k) EXPECT_EQ(calls[k], 1) << k;
}

TEST(DeviceStreamTest, BoundsRequestsInFlightAndReportsEachOnceOnIoUringFiles) {
  TempDir dir;
  auto env = UringEnv(dir.path(), nullptr);
  ASSERT_NE(env, nullptr);
  CheckStreamBoundsAndReports(env.get());
}

TEST(DeviceStreamTest, BoundsRequestsInFlightAndReportsEachOnceOnTheMemoryEnv) {
  auto env = NewMemEnv();
  CheckStreamBoundsAndReports(env.get());
}

// A batch whose ring fails its submission: every request is reported once, with the error
// (none left OK over a buffer the device may not have filled), and the ring, drained, serves
// the next batch.
TEST(RingFaultTest, AFailedSubmissionGivesEveryRequestOfTheBatchTheError) {
  TempDir dir;
  RingFaults faults;
  auto env = UringEnv(dir.path(), &faults);
  ASSERT_NE(env, nullptr);
  constexpr int kFiles = 2, kBlocks = 8;
  auto devs = MakeFiles(env.get(), kFiles, kBlocks);
  ASSERT_EQ(devs.size(), size_t{kFiles});
  AlignedBuffer out = AllocateAligned(kFiles * kBlocks * kBlock, kBlock);
  std::vector<DeviceIo> ios;
  for (int f = 0; f < kFiles; ++f) {
    for (int b = 0; b < kBlocks; ++b) {
      size_t k = ios.size();
      ios.push_back(
          {devs[f].get(),
           {IoRequest::Op::kRead, uint64_t(b) * kBlock, out.get() + k * kBlock, kBlock, {}}});
    }
  }
  faults.FailNextSubmissions(1);
  std::vector<int> calls(ios.size(), 0);
  Status st = env->SubmitAcross(ios, [&](size_t i) { ++calls[i]; });
  EXPECT_TRUE(st.IsIOError()) << st.ToString();
  EXPECT_EQ(faults.injected(), 1u);
  for (size_t i = 0; i < ios.size(); ++i) {
    EXPECT_EQ(calls[i], 1) << i;
    EXPECT_TRUE(ios[i].io.result.IsIOError()) << i << " " << ios[i].io.result.ToString();
  }
  for (DeviceIo& d : ios) d.io.result = Status::Ok();
  ASSERT_TRUE(env->SubmitAcross(ios).ok());
  for (size_t k = 0; k < ios.size(); ++k) {
    EXPECT_EQ(out.get()[k * kBlock], (k / kBlocks) * 16 + k % kBlocks) << k;
  }
}

// Failed completions fail their own requests only.
TEST(RingFaultTest, FailedCompletionsFailOnlyTheirRequests) {
  TempDir dir;
  RingFaults faults;
  auto env = UringEnv(dir.path(), &faults);
  ASSERT_NE(env, nullptr);
  constexpr int kBlocks = 16;
  auto devs = MakeFiles(env.get(), 1, kBlocks);
  ASSERT_EQ(devs.size(), 1u);
  AlignedBuffer out = AllocateAligned(kBlocks * kBlock, kBlock);
  std::vector<IoRequest> reqs;
  for (int b = 0; b < kBlocks; ++b) {
    reqs.push_back(
        {IoRequest::Op::kRead, uint64_t(b) * kBlock, out.get() + b * kBlock, kBlock, {}});
  }
  faults.FailNextCompletions(3, /*after=*/2);
  Status st = devs[0]->Submit(reqs);
  EXPECT_TRUE(st.IsIOError()) << st.ToString();
  int failed = 0;
  for (int b = 0; b < kBlocks; ++b) {
    if (!reqs[b].result.ok()) {
      EXPECT_TRUE(reqs[b].result.IsIOError()) << b << " " << reqs[b].result.ToString();
      ++failed;
      continue;
    }
    EXPECT_EQ(out.get()[b * kBlock], b) << b;
  }
  EXPECT_EQ(failed, 3);
}

// A ring error ends a stream: every request handed over is reported once (those the error
// left without a result with it), and next is not called again.
TEST(RingFaultTest, AFailedSubmissionEndsAStreamAndReportsWhatItHeld) {
  TempDir dir;
  RingFaults faults;
  auto env = UringEnv(dir.path(), &faults);
  ASSERT_NE(env, nullptr);
  constexpr int kBlocks = 32;
  auto devs = MakeFiles(env.get(), 1, kBlocks);
  ASSERT_EQ(devs.size(), 1u);
  AlignedBuffer out = AllocateAligned(kBlocks * kBlock, kBlock);
  std::vector<DeviceIo> ios;
  for (int b = 0; b < kBlocks; ++b) {
    ios.push_back(
        {devs[0].get(),
         {IoRequest::Op::kRead, uint64_t(b) * kBlock, out.get() + b * kBlock, kBlock, {}}});
  }
  faults.FailNextSubmissions(1, /*after=*/1);  // the stream's second submission fails
  size_t handed = 0;
  std::vector<int> calls(ios.size(), 0);
  Status st = env->Stream(
      4, [&]() -> DeviceIo* { return handed == ios.size() ? nullptr : &ios[handed++]; },
      [&](DeviceIo* d) { ++calls[d - ios.data()]; });
  EXPECT_TRUE(st.IsIOError()) << st.ToString();
  EXPECT_LT(handed, ios.size()) << "the stream went on after its ring failed";
  int failed = 0;
  for (size_t k = 0; k < ios.size(); ++k) {
    EXPECT_EQ(calls[k], k < handed ? 1 : 0) << k;
    if (k < handed && !ios[k].io.result.ok()) {
      EXPECT_TRUE(ios[k].io.result.IsIOError()) << k;
      ++failed;
    }
  }
  EXPECT_GE(failed, 1);
}

// The SSD tier's writer streams its buffers through the ring: a failed chunk write (or a
// ring error in the middle of a stream) drops exactly the units of the buffers it touched
// (never indexed), the commit covering them reports it, and every other unit is served
// exact, before and after a reopen.
void CheckWriterLosesOnlyFailedBuffers(bool fail_submission) {
  TempDir dir;
  RingFaults faults;
  SsdOptions o;
  o.dir = dir.path();
  o.dir_env.engine = IoEngine::kIoUring;
  o.dir_env.ring_faults = &faults;
  o.capacity_bytes = 64ull << 20;
  o.segment_bytes = 8ull << 20;
  o.write_buffer_bytes = 256 << 10;  // two 128 KiB chunks per buffer
  o.write_buffers = 3;
  o.group_commit_ms = 3'600'000;
  o.compression = false;
  constexpr int kUnits = 120;  // 120 x 20 KB: about 10 buffers
  std::vector<bool> served(kUnits, false);
  {
    auto opened = SsdTier::Open(o);
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    SsdTier& ssd = **opened;
    if (fail_submission) {
      faults.FailNextSubmissions(1, /*after=*/3);
    } else {
      faults.FailNextCompletions(1, /*after=*/5);
    }
    for (int i = 0; i < kUnits; ++i) {
      Key k = MakeKey(i);
      ASSERT_TRUE(ssd.Put(k, MakeValue(k, 1, 20'000), {}, nullptr).ok()) << i;
    }
    Status st = ssd.Flush();
    EXPECT_TRUE(st.IsIOError()) << st.ToString();
    EXPECT_EQ(faults.injected(), 1u);
    int lost = 0;
    for (int i = 0; i < kUnits; ++i) {
      Key k = MakeKey(i);
      std::vector<uint8_t> v;
      Status g = ssd.Get(k, &v);
      if (g.ok()) {
        EXPECT_EQ(v, MakeValue(k, 1, 20'000)) << i;
        served[i] = true;
      } else {
        EXPECT_TRUE(g.IsNotFound()) << i << " " << g.ToString();
        ++lost;
      }
    }
    EXPECT_GE(lost, 1);
    EXPECT_LE(lost, kUnits / 2) << "more lost than the failed write covered";
    EXPECT_EQ(ssd.GetStats().checksum_failures, 0u);
  }
  auto reopened = SsdTier::Open(o);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  ASSERT_TRUE((*reopened)->WaitForIndexLoad().ok());
  for (int i = 0; i < kUnits; ++i) {
    Key k = MakeKey(i);
    std::vector<uint8_t> v;
    Status g = (*reopened)->Get(k, &v);
    EXPECT_EQ(g.ok(), served[i]) << i << " " << g.ToString();
    if (g.ok()) {
      EXPECT_EQ(v, MakeValue(k, 1, 20'000)) << i;
    }
  }
  EXPECT_EQ((*reopened)->GetStats().checksum_failures, 0u);
}

TEST(RingFaultTest, AFailedChunkWriteDropsOnlyItsBufferAndFailsTheFlush) {
  CheckWriterLosesOnlyFailedBuffers(/*fail_submission=*/false);
}

TEST(RingFaultTest, ARingErrorInTheWritersStreamDropsOnlyWhatItHeldAndFailsTheFlush) {
  CheckWriterLosesOnlyFailedBuffers(/*fail_submission=*/true);
}

}  // namespace
}  // namespace kvtier::storage
