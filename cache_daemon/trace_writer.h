// Records the request stream in the trace format that `kvtier sim` replays
// (docs/format/trace.md): zstd-compressed JSON Lines, one request per line:
//   {"ts_ms":<u64 ms since trace start>,"op":"lookup"|"get"|"put"|"delete","tenant":<u32>,
//    "ids":[<u64>...],"bytes":<u64>,"unit_tokens":<u32>[,"request":<u64>]}
// "request" (when not 0): the storage request (storage::RequestTag id) the call belonged to;
// an engine turn's LOOKUP, GET and PUT share it, so the simulator replays them as one.
// ids are storage-key ids in prefix order (first 8 bytes of the storage key, little-endian),
// so traces carry no key material beyond that policy id.
//
// Record() never blocks the request path: it enqueues into a bounded queue and drops (and
// counts) records when the queue is full. A writer thread compresses with libzstd streaming.
// With a window (trace_window.h), the writer thread also appends each line it writes there,
// for the what-if curves (whatif.h).
//
// Thread safety: Record() and dropped() from any thread; Close() once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/trace_window.h"
#include "common/status.h"

namespace kvtier::daemon {

struct TraceRecord {
  uint64_t ts_ms = 0;
  const char* op = "get";  // a static string
  uint32_t tenant = 0;
  std::vector<uint64_t> ids;
  uint64_t bytes = 0;
  uint32_t unit_tokens = 0;
  uint64_t request = 0;  // storage::RequestTag id; 0: none (written only when not 0)
};

class TraceWriter {
 public:
  // Creates (truncates) path. IOError when it cannot be opened. window.records_max == 0:
  // no window.
  static StatusOr<std::unique_ptr<TraceWriter>> Open(const std::string& path, uint32_t queue_depth,
                                                     TraceWindowLimits window = {0, 0});
  ~TraceWriter();

  // ts_ms is filled here (ms since Open).
  void Record(TraceRecord record);
  // Drains the queue, ends the zstd frame, closes the file. Idempotent.
  Status Close();
  uint64_t dropped() const { return dropped_.load(); }
  uint64_t written() const { return written_.load(); }
  // The newest lines written; nullptr without a window. Lives as long as this writer.
  const TraceWindow* window() const { return window_.get(); }

  // The JSON line for a record (no newline); exposed for tests.
  static std::string FormatLine(const TraceRecord& r);

 private:
  TraceWriter() = default;
  void Run();

  FILE* file_ = nullptr;
  void* zstd_ = nullptr;  // ZSTD_CCtx*
  uint32_t queue_depth_ = 0;
  uint64_t start_us_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TraceRecord> queue_;        // protected by mu_
  bool closing_ = false;                 // protected by mu_
  std::unique_ptr<TraceWindow> window_;  // null: no window
  std::thread thread_;
  std::atomic<uint64_t> dropped_{0}, written_{0};
  Status status_;
  bool closed_ = false;
};

}  // namespace kvtier::daemon
