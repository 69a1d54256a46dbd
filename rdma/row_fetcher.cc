#include "rdma/row_fetcher.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <thread>
#include <vector>

#include "common/clock.h"

namespace kvtier::rdma {
namespace {

enum class BatchState : uint8_t { kUnsubmitted, kInFlight, kDone, kFailed };

bool Retryable(const Status& s) { return s.IsIOError() || s.IsRetry(); }

// A blocked Wait() wakes this often to complete arrived replies itself (Transport::Poll).
constexpr int kWaitPollMs = 5;
// A spinning Wait() yields its core at most this often.
constexpr uint64_t kSpinYieldUs = 50;

}  // namespace

struct RowFetcher::Fetch {
  struct Batch {
    size_t shard = 0;
    std::vector<ReadOp> ops;
    std::vector<uint64_t> rows;  // global row of each op (for the hot cache)
    BatchState state = BatchState::kUnsubmitted;
    uint32_t attempts = 0;
    Status last;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Batch> batches;                     // guarded by mu
  size_t unfinished = 0;                          // batches not kDone; guarded by mu
  std::vector<std::pair<size_t, size_t>> copies;  // (target index, source index) duplicates
  uint8_t* out = nullptr;
  uint64_t start_us = 0;
  bool waited = false;
  // Wait() gave up on it (a failed batch, the timeout): nothing of it is submitted any more,
  // though it may still be on the backlog or held by PumpBacklog. Guarded by mu.
  bool abandoned = false;
};

RowFetcher::RowFetcher(ShardMap map, RowFetcherOptions options)
    : map_(std::move(map)), options_(options), cache_(0, 0) {}

RowFetcher::~RowFetcher() {
  for (ShardState& s : shards_) {
    // No one else holds it: no one else can start holding it either.
    if (s.transport.use_count() == 1) s.transport->Close();
  }
  std::unique_lock<std::mutex> lock(callbacks_mu_);
  callbacks_cv_.wait(lock, [&] { return callbacks_outstanding_ == 0; });
}

StatusOr<std::unique_ptr<RowFetcher>> RowFetcher::Create(ShardMap map,
                                                         std::vector<ShardConnection> shards,
                                                         RowFetcherOptions options) {
  if (shards.size() != map.shards().size()) {
    return Status::InvalidArgument("one ShardConnection per shard of the map is needed");
  }
  if (options.batch_ops_max == 0 || options.rows_per_fetch_max == 0) {
    return Status::InvalidArgument("batch_ops_max and rows_per_fetch_max must be positive");
  }
  if (options.wait_spin_us > kRowFetchWaitSpinMaxUs) {
    return Status::InvalidArgument("wait_spin_us over kRowFetchWaitSpinMaxUs");
  }
  std::unique_ptr<RowFetcher> f(new RowFetcher(std::move(map), options));
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].transport == nullptr) return Status::InvalidArgument("null transport");
    const ShardSpec& spec = f->map_.shards()[i];
    StatusOr<RegionInfo> region = shards[i].transport->OpenRegion(shards[i].credentials);
    if (!region.ok()) {
      return region.status().WithContext("opening shard " + std::to_string(i) + " (" +
                                         spec.region_name + ")");
    }
    if (region->row_begin != spec.row_begin ||
        region->row_begin + region->row_count < spec.row_end ||
        region->row_count * uint64_t{region->row_stride_bytes} > region->size_bytes) {
      return Status::InvalidArgument("shard " + std::to_string(i) +
                                     ": the server's table does not hold the mapped row range");
    }
    if (i == 0) f->row_stride_bytes_ = region->row_stride_bytes;
    if (region->row_stride_bytes != f->row_stride_bytes_ || f->row_stride_bytes_ == 0) {
      return Status::InvalidArgument("shards disagree on row_stride_bytes");
    }
    f->shards_.push_back(ShardState{std::move(shards[i].transport), *region});
  }
  f->cache_ = HotRowCache(options.hot_cache_bytes, f->row_stride_bytes_);
  return f;
}

Status RowFetcher::RegisterBuffer(uint8_t* data, size_t size_bytes) {
  std::vector<const Transport*> done;  // shards may share a transport: register once with each
  for (ShardState& s : shards_) {
    if (std::find(done.begin(), done.end(), s.transport.get()) != done.end()) continue;
    done.push_back(s.transport.get());
    StatusOr<LocalBufferId> id = s.transport->RegisterLocalBuffer(data, size_bytes);
    if (!id.ok()) return id.status();
  }
  return Status::Ok();
}

namespace {

// The first index of each distinct row of one request: an open-addressing table of 2^k >= 2n
// slots, reset per request without freeing (Start keeps one per thread).
class FirstIndex {
 public:
  void Reset(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    mask_ = cap - 1;
    rows_.resize(cap);
    index_plus1_.assign(cap, 0);
  }
  // The index `row` was first inserted with, or `i` after inserting it now.
  size_t FindOrInsert(uint64_t row, size_t i) {
    for (size_t h = ((row * 0x9e3779b97f4a7c15ull) >> 32) & mask_;; h = (h + 1) & mask_) {
      if (index_plus1_[h] == 0) {
        rows_[h] = row;
        index_plus1_[h] = i + 1;
        return i;
      }
      if (rows_[h] == row) return index_plus1_[h] - 1;
    }
  }

 private:
  size_t mask_ = 0;
  std::vector<uint64_t> rows_;
  std::vector<size_t> index_plus1_;  // 0: empty slot
};

}  // namespace

StatusOr<RowFetcher::FetchHandle> RowFetcher::Start(std::span<const uint64_t> rows, uint8_t* out) {
  if (rows.empty() || rows.size() > options_.rows_per_fetch_max || out == nullptr) {
    return Status::InvalidArgument("fetch needs 1..rows_per_fetch_max rows and an output");
  }
  auto f = std::make_shared<Fetch>();
  f->out = out;
  f->start_us = DefaultSteadyClock().NowUs();
  const uint32_t stride = row_stride_bytes_;
  // Per-thread scratch, reused from call to call: a request of a few dozen rows (an engine
  // step's) allocated a hash node per row here, about as much time as the rest of Start.
  thread_local FirstIndex first_index;
  thread_local std::vector<std::vector<std::pair<uint64_t, size_t>>> misses;
  first_index.Reset(rows.size());
  misses.resize(shards_.size());
  for (auto& m : misses) m.clear();
  uint64_t hits = 0;
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    for (size_t i = 0; i < rows.size(); ++i) {
      const size_t first = first_index.FindOrInsert(rows[i], i);
      if (first != i) {
        f->copies.emplace_back(i, first);
        continue;
      }
      StatusOr<size_t> shard = map_.ShardOf(rows[i]);
      if (!shard.ok()) {
        return Status::InvalidArgument("row " + std::to_string(rows[i]) + " outside the table (" +
                                       std::to_string(map_.row_count()) + " rows)");
      }
      if (cache_.Lookup(rows[i], out + i * stride)) {
        ++hits;
      } else {
        misses[*shard].emplace_back(rows[i], i);
      }
    }
  }
  rows_requested_.fetch_add(rows.size());
  rows_deduplicated_.fetch_add(f->copies.size());
  hot_cache_hits_.fetch_add(hits);
  for (size_t s = 0; s < misses.size(); ++s) {
    const uint64_t begin = map_.shards()[s].row_begin;
    for (size_t k = 0; k < misses[s].size(); k += options_.batch_ops_max) {
      Fetch::Batch batch;
      batch.shard = s;
      const size_t end = std::min(misses[s].size(), k + options_.batch_ops_max);
      batch.ops.reserve(end - k);
      batch.rows.reserve(end - k);
      for (size_t j = k; j < end; ++j) {
        const auto [row, index] = misses[s][j];
        batch.ops.push_back(
            ReadOp{shards_[s].region.id, (row - begin) * stride, stride, out + index * stride});
        batch.rows.push_back(row);
      }
      f->batches.push_back(std::move(batch));
    }
  }
  f->unfinished = f->batches.size();
  SubmitPending(f);
  return f;
}

bool RowFetcher::SubmitPending(const FetchHandle& f) {
  for (size_t i = 0;; ++i) {
    Transport* transport = nullptr;
    std::span<const ReadOp> ops;
    {
      std::lock_guard<std::mutex> lock(f->mu);
      if (f->abandoned) return true;
      while (i < f->batches.size() && f->batches[i].state != BatchState::kUnsubmitted) ++i;
      if (i == f->batches.size()) return true;
      Fetch::Batch& b = f->batches[i];
      b.state = BatchState::kInFlight;  // before Submit: the callback may run at once
      ++b.attempts;
      transport = shards_[b.shard].transport.get();
      ops = b.ops;  // stable: batches are never resized after Start
    }
    const uint64_t n = ops.size();
    reads_in_flight_.fetch_add(n);
    {
      std::lock_guard<std::mutex> lock(callbacks_mu_);
      ++callbacks_outstanding_;
    }
    // Ends a callback (or a Submit that will not call it): the last use of this fetcher on
    // that path. Notifies under the lock, so the destructor cannot return in between.
    auto callback_done = [this] {
      std::lock_guard<std::mutex> lock(callbacks_mu_);
      if (--callbacks_outstanding_ == 0) callbacks_cv_.notify_all();
    };
    // Submit outside f->mu: reconnecting waits for the I/O thread, whose callbacks take it.
    Status st = transport->Submit(ops, [this, f, i, n, callback_done](const Status& result) {
      reads_in_flight_.fetch_sub(n);
      {
        std::lock_guard<std::mutex> lock(f->mu);
        Fetch::Batch& b = f->batches[i];
        if (result.ok()) {
          b.state = BatchState::kDone;
          --f->unfinished;
          rows_read_.fetch_add(n);
          bytes_read_.fetch_add(n * row_stride_bytes_);
        } else {
          b.state = BatchState::kFailed;
          b.last = result;
        }
        f->cv.notify_all();
      }
      // Room was made on a transport: push batches that were refused for flow control.
      if (result.ok()) PumpBacklog();
      callback_done();
    });
    if (!st.ok()) {
      callback_done();
      reads_in_flight_.fetch_sub(n);
      std::lock_guard<std::mutex> lock(f->mu);
      Fetch::Batch& b = f->batches[i];
      if (st.IsRejected()) {
        // Flow control, not a failure: resubmitted when reads complete (PumpBacklog, or the
        // fetch's own Wait()).
        b.state = BatchState::kUnsubmitted;
        --b.attempts;
        std::lock_guard<std::mutex> backlog_lock(backlog_mu_);
        backlog_.push_back(f);
        return false;
      }
      b.state = BatchState::kFailed;
      b.last = st;
    }
  }
}

void RowFetcher::PumpBacklog() {
  // One pumper at a time; a completion that finds another pumping leaves it the work (and
  // every Wait() still submits its own fetch's batches, so nothing depends on this).
  if (pumping_.exchange(true)) return;
  while (true) {
    FetchHandle f;
    {
      std::lock_guard<std::mutex> lock(backlog_mu_);
      while (!backlog_.empty() && f == nullptr) {
        f = backlog_.front().lock();
        backlog_.pop_front();
      }
    }
    if (f == nullptr) break;
    // Refused again (f is back on the backlog): the transport is full, wait for completions.
    if (!SubmitPending(f)) break;
  }
  pumping_.store(false);
}

Status RowFetcher::Wait(const FetchHandle& f) {
  if (f == nullptr) return Status::InvalidArgument("null fetch");
  const uint64_t t0 = DefaultSteadyClock().NowUs();
  const uint64_t deadline_us = f->start_us + uint64_t{options_.fetch_timeout_ms} * 1000;
  bool stalled = false;
  Status result;
  // The shards this fetch reads from (a fetch touches few; batches are in shard order).
  std::vector<size_t> shards;
  {
    std::lock_guard<std::mutex> lock(f->mu);
    if (f->waited) return Status::InvalidArgument("Wait() called twice on one fetch");
    f->waited = true;
    for (const Fetch::Batch& b : f->batches) {
      if (shards.empty() || shards.back() != b.shard) shards.push_back(b.shard);
    }
  }
  // Replies already in the sockets are complete rows: take them on this thread (the lock is
  // not held: callbacks take it).
  auto poll = [&] {
    for (size_t s : shards) shards_[s].transport->Poll();
  };
  auto unfinished = [&] {
    std::lock_guard<std::mutex> lock(f->mu);
    return f->unfinished;
  };
  poll();
  {
    std::lock_guard<std::mutex> lock(f->mu);
    uint64_t late = 0;
    for (const Fetch::Batch& b : f->batches) {
      if (b.state != BatchState::kDone) late += b.ops.size();
    }
    late_rows_.fetch_add(late);
    stalled = late > 0;
  }
  if (stalled && options_.wait_spin_us > 0) {
    // Spin a moment, reading replies here, before blocking (a blocked waiter is woken by the
    // transport's thread, which itself had to be woken: two hand-offs).
    const uint64_t spin_end_us = t0 + options_.wait_spin_us;
    uint64_t yielded_us = t0;
    for (uint64_t now_us = t0; unfinished() > 0 && now_us < spin_end_us;
         now_us = DefaultSteadyClock().NowUs()) {
      poll();
      if (now_us - yielded_us >= kSpinYieldUs) {
        // A thread of equal real-time priority on this core (the row server's, the
        // transport's) may be what the rows wait for.
        std::this_thread::yield();
        yielded_us = now_us;
      }
    }
  }
  while (true) {
    bool retry_round = false, any_unsubmitted = false;
    {
      std::unique_lock<std::mutex> lock(f->mu);
      if (f->unfinished == 0) break;
      for (Fetch::Batch& b : f->batches) {
        if (b.state != BatchState::kFailed) {
          any_unsubmitted |= b.state == BatchState::kUnsubmitted;
          continue;
        }
        if (!Retryable(b.last) || b.attempts > options_.retries_max) {
          result = b.last.WithContext("engram row read failed after " + std::to_string(b.attempts) +
                                      " attempt(s)");
          break;
        }
        b.state = BatchState::kUnsubmitted;
        retry_round = true;
      }
      if (!result.ok()) break;
      if (DefaultSteadyClock().NowUs() > deadline_us) {
        result = Status::IOError("engram row fetch timed out (fetch_timeout_ms)");
        break;
      }
      if (!retry_round && !any_unsubmitted) {
        f->cv.wait_for(lock, std::chrono::milliseconds(kWaitPollMs));
        if (f->unfinished == 0) break;
        // Then read what arrived here too: a transport thread starved of a core (real-time
        // threads hold them all) must not hold this wait up by more than kWaitPollMs.
        lock.unlock();
        poll();
        continue;
      }
    }
    if (retry_round) {
      std::this_thread::sleep_for(std::chrono::milliseconds(options_.retry_backoff_ms));
    }
    if (retry_round) retries_.fetch_add(1);
    SubmitPending(f);
    if (any_unsubmitted && !retry_round) {
      // Flow control: wait for a completion before pushing more.
      std::unique_lock<std::mutex> lock(f->mu);
      f->cv.wait_for(lock, std::chrono::milliseconds(5));
    }
  }
  if (stalled) {
    stalls_.fetch_add(1);
    stall_us_.fetch_add(DefaultSteadyClock().NowUs() - t0);
  }
  if (!result.ok()) {
    {
      std::unique_lock<std::mutex> lock(f->mu);
      // The caller may reuse `out` once this returns (another request's slice of a staging
      // ring): no batch of this fetch may be submitted from now on. A batch left unsubmitted
      // (refused for flow control, or marked for a retry) used to stay on the backlog, and the
      // next completion's PumpBacklog submitted it into that reused memory, whose new owner
      // then put the stray row into the hot-row cache under its own row id.
      f->abandoned = true;
      for (Fetch::Batch& b : f->batches) {
        if (b.state == BatchState::kUnsubmitted) {
          b.state = BatchState::kFailed;
          b.last = result;
        }
      }
      // Let batches still in flight finish before the caller may reuse `out`.
      f->cv.wait_for(lock, std::chrono::milliseconds(options_.fetch_timeout_ms), [&] {
        for (const Fetch::Batch& b : f->batches) {
          if (b.state == BatchState::kInFlight) return false;
        }
        return true;
      });
    }
    {
      std::lock_guard<std::mutex> lock(backlog_mu_);
      std::erase_if(backlog_, [&](const std::weak_ptr<Fetch>& w) {
        const FetchHandle held = w.lock();
        return held == nullptr || held == f;
      });
    }
    fetches_failed_.fetch_add(1);
    return result;
  }
  Finish(f);
  return Status::Ok();
}

void RowFetcher::Finish(const FetchHandle& f) {
  const uint32_t stride = row_stride_bytes_;
  for (const auto& [target, source] : f->copies) {
    std::memcpy(f->out + target * stride, f->out + source * stride, stride);
  }
  std::lock_guard<std::mutex> lock(cache_mu_);
  for (const Fetch::Batch& b : f->batches) {
    for (size_t j = 0; j < b.ops.size(); ++j) cache_.Insert(b.rows[j], b.ops[j].dest);
  }
}

Status RowFetcher::FetchRows(std::span<const uint64_t> rows, uint8_t* out) {
  KVTIER_ASSIGN_OR_RETURN(FetchHandle f, Start(rows, out));
  return Wait(f);
}

RowFetchStats RowFetcher::stats() const {
  return RowFetchStats{
      rows_requested_.load(), rows_deduplicated_.load(), hot_cache_hits_.load(), rows_read_.load(),
      bytes_read_.load(),     reads_in_flight_.load(),   late_rows_.load(),      stalls_.load(),
      stall_us_.load(),       retries_.load(),           fetches_failed_.load()};
}

}  // namespace kvtier::rdma
