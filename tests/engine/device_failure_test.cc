// A device call that fails (engine/device/fail_stop_backend.h, Engine::DeviceFailure): the call
// fails its pass, nothing reaches the device after it, and the engine goes on with its later
// passes on the CPU path. The device is the host twin behind a backend that fails its k-th call
// on purpose (weight uploads, buffer and mirror allocations, the uploads of residuals and keys,
// kernels, mirror growth copies, downloads): for the first and the last call of each kind in
// each pass of a run, or with KVTIER_DEVICE_FAILURE_EVERY_CALL set for every call of it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/device/fail_stop_backend.h"
#include "engine/model.h"
#include "engine_test_util.h"
#include "tests/engine/faulty_device_backend.h"

namespace kvtier::engine {
namespace {

using testutil::CallLog;
using testutil::FaultyBackend;
using testutil::FaultyEngine;
using testutil::Prompt;

// One pass of a run: its status, its logits rows in order, and the device calls made by the
// end of it (with a CallLog).
struct PassResult {
  Status status;
  std::vector<float> logits;
  int64_t calls_after = 0;
};

// A fixed run on `e`: two sequences prefilled (Forward: single-sequence passes), three batched
// decode steps of both, a verify-sized pass (4 and 2 tokens, every row's logits), and two more
// decode steps. Each pass's result in order; the run stops after a failed pass.
std::vector<PassResult> RunPasses(Engine* e, uint32_t seed, const CallLog* log = nullptr) {
  const int V = e->config().vocab_size;
  std::vector<PassResult> out;
  std::vector<SequenceState> st;
  for (int i = 0; i < 2; ++i) {
    st.push_back(e->NewSequence());
    PassResult r;
    r.status = e->Forward(&st[i], Prompt(i == 0 ? 60 : 9, seed + i), false, &r.logits);
    if (log != nullptr) r.calls_after = log->calls;
    out.push_back(r);
    if (!r.status.ok()) return out;
  }
  std::vector<SequenceState*> ptr = {&st[0], &st[1]};
  std::vector<int32_t> next = {3, 4};
  auto batch = [&](const std::vector<std::vector<int32_t>>& toks, bool all_rows) {
    std::vector<std::span<const int32_t>> spans(toks.begin(), toks.end());
    std::vector<std::vector<float>> last, all;
    PassResult r;
    r.status = e->ForwardBatch(ptr, spans, &last, all_rows ? &all : nullptr);
    if (r.status.ok()) {
      for (size_t i = 0; i < ptr.size(); ++i) {
        const std::vector<float>& rows = all_rows ? all[i] : last[i];
        r.logits.insert(r.logits.end(), rows.begin(), rows.end());
        next[i] = testutil::Argmax(last[i].data(), V);
      }
    }
    if (log != nullptr) r.calls_after = log->calls;
    out.push_back(r);
    return r.status.ok();
  };
  for (int s = 0; s < 3; ++s) {
    if (!batch({{next[0]}, {next[1]}}, false)) return out;
  }
  if (!batch({{next[0], 7, 8, 9}, {next[1], 10}}, true)) return out;
  for (int s = 0; s < 2; ++s) {
    if (!batch({{next[0]}, {next[1]}}, false)) return out;
  }
  return out;
}

// The calls of a run to fail one at a time: in each pass, the first and the last call of each
// kind; with KVTIER_DEVICE_FAILURE_EVERY_CALL set (the slow label's run), every call.
std::vector<int64_t> CallsToFail(const CallLog& log, int64_t first,
                                 const std::vector<PassResult>& passes) {
  std::vector<int64_t> at;
  if (std::getenv("KVTIER_DEVICE_FAILURE_EVERY_CALL") != nullptr) {
    for (int64_t k = first; k < passes.back().calls_after; ++k) at.push_back(k);
  }
  int64_t begin = first;
  for (const PassResult& p : passes) {
    for (char kind : std::string("audckp")) {
      int64_t lo = -1, hi = -1;
      for (int64_t k = begin; k < p.calls_after; ++k) {
        if (log.kinds[k] != kind) continue;
        if (lo < 0) lo = k;
        hi = k;
      }
      if (lo >= 0) at.insert(at.end(), {lo, hi});
    }
    begin = p.calls_after;
  }
  std::sort(at.begin(), at.end());
  at.erase(std::unique(at.begin(), at.end()), at.end());
  return at;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(DeviceFailure, EveryFailedCallStopsTheDeviceAndTheEngineGoesOnOnTheCpu) {
  // The trained miniature's shapes (8 layers, every mechanism) with random weights.
  auto config = LoadEngineConfig(KVTIER_TRAINED_CONFIG);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  const EngineConfig& c = *config;
  auto w = InitWeights(c, 5);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));

  // The CPU path's results, and the calls of an undisturbed run (the host twin's bits).
  EngineOptions cpu_options;
  auto cpu = Engine::Create(c, weights, cpu_options);
  ASSERT_TRUE(cpu.ok());
  const std::vector<PassResult> want = RunPasses(cpu->get(), 100);
  const std::vector<PassResult> want_after = RunPasses(cpu->get(), 200);
  auto clean_log = std::make_shared<CallLog>();
  auto clean = FaultyEngine(c, weights, clean_log);
  ASSERT_TRUE(clean.ok()) << clean.status().ToString();
  const int64_t create_calls = clean_log->calls;
  const std::vector<PassResult> got = RunPasses(clean->get(), 100, clean_log.get());
  const int64_t run_calls = clean_log->calls - create_calls;
  ASSERT_EQ(got.size(), want.size());
  for (size_t p = 0; p < want.size(); ++p) {
    ASSERT_TRUE(got[p].status.ok()) << got[p].status.ToString();
    ASSERT_TRUE(SameBits(got[p].logits, want[p].logits)) << "pass " << p;
  }
  ASSERT_TRUE((*clean)->DeviceFailure().ok());
  ASSERT_GT(create_calls, 0);
  ASSERT_GT(run_calls, 100);

  // A failure while the weights are uploaded fails Create.
  for (int64_t k : {int64_t{0}, create_calls / 2, create_calls - 1}) {
    auto log = std::make_shared<CallLog>();
    log->fail_at = k;
    auto e = FaultyEngine(c, weights, log);
    ASSERT_FALSE(e.ok()) << "call " << k;
    EXPECT_EQ(e.status().code(), StatusCode::kInternal);
    EXPECT_EQ(log->after_failure, 0);
  }

  // A failure at every call of the run: the pass that made the call fails with its error and
  // every earlier pass is the CPU path's; no call reaches the device after it; the engine's
  // later passes, over new sequences, are the CPU path's bit for bit, with no device left.
  const std::vector<int64_t> calls = CallsToFail(*clean_log, create_calls, got);
  ASSERT_EQ(clean_log->kinds.size(), static_cast<size_t>(create_calls + run_calls));
  for (char kind : std::string("audck"))  // each kind of call is failed at least once
    EXPECT_TRUE(std::any_of(calls.begin(), calls.end(), [&](int64_t k) {
      return clean_log->kinds[k] == kind;
    })) << kind;
  // The figures docs/ENGINE.md quotes ("A failing device").
  std::printf("device calls: %lld to create the engine, %lld in the run; failing %zu of them\n",
              static_cast<long long>(create_calls), static_cast<long long>(run_calls),
              calls.size());
  for (int64_t k : calls) {
    SCOPED_TRACE("failing call " + std::to_string(k));
    auto log = std::make_shared<CallLog>();
    log->fail_at = k;
    auto e = FaultyEngine(c, weights, log);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    const std::vector<PassResult> failed = RunPasses(e->get(), 100);
    ASSERT_FALSE(failed.empty());
    for (size_t p = 0; p + 1 < failed.size(); ++p) {
      ASSERT_TRUE(failed[p].status.ok()) << "pass " << p << ": " << failed[p].status.ToString();
      ASSERT_TRUE(SameBits(failed[p].logits, want[p].logits)) << "pass " << p;
    }
    const Status& last = failed.back().status;
    ASSERT_EQ(last.code(), StatusCode::kInternal) << last.ToString();
    EXPECT_NE(last.message().find("injected device failure at call " + std::to_string(k)),
              std::string::npos)
        << last.ToString();
    EXPECT_EQ((*e)->DeviceFailure().code(), StatusCode::kInternal);
    EXPECT_EQ((*e)->DeviceFailure().message(), last.message());
    EXPECT_EQ((*e)->DeviceWeightBytes(), 0u);
    EXPECT_EQ((*e)->TakeDeviceProfile().status().code(), StatusCode::kInvalidArgument);

    const std::vector<PassResult> after = RunPasses(e->get(), 200);
    ASSERT_EQ(after.size(), want_after.size());
    for (size_t p = 0; p < after.size(); ++p) {
      ASSERT_TRUE(after[p].status.ok()) << "pass " << p << ": " << after[p].status.ToString();
      ASSERT_TRUE(SameBits(after[p].logits, want_after[p].logits)) << "pass " << p;
    }
    EXPECT_EQ(log->after_failure, 0);
  }
}

// The backend itself: the first failure is returned as it is, then every call but Free,
// kind and SetProfiling is refused (Unavailable, naming it) without reaching the backend.
TEST(DeviceFailure, FailStopBackendRefusesEveryCallAfterItsFirstFailure) {
  auto log = std::make_shared<CallLog>();
  log->fail_at = 2;
  device::FailStopBackend b(std::make_unique<FaultyBackend>(log));
  auto p = b.Alloc(64);
  ASSERT_TRUE(p.ok());
  std::vector<uint8_t> host(64, 7);
  ASSERT_TRUE(b.ToDevice(*p, host.data(), host.size()).ok());
  EXPECT_TRUE(b.failure().ok());
  const Status first = b.ToHost(host.data(), *p, host.size());
  EXPECT_EQ(first.code(), StatusCode::kInternal);
  EXPECT_EQ(b.failure().message(), first.message());
  const int64_t calls = log->calls;
  std::vector<Status> refused = {b.ToDevice(*p, host.data(), host.size()),
                                 b.ToHost(host.data(), *p, host.size()),
                                 b.DeviceCopy(*p, *p, 8),
                                 b.Alloc(8).status(),
                                 b.TakeProfile().status(),
                                 b.Run(device::RowRsqrtKernel{nullptr, 1, 1e-6, nullptr, 0})};
  for (const Status& s : refused) {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
    EXPECT_NE(s.message().find("injected device failure at call 2"), std::string::npos)
        << s.ToString();
  }
  EXPECT_EQ(log->calls, calls);
  EXPECT_EQ(b.kind(), device::DeviceKind::kHost);
  b.SetProfiling(true);
  b.Free(*p);  // still given back (ASan would see the leak otherwise)
}

}  // namespace
}  // namespace kvtier::engine
