// RowFetcher: the Engram row-fetch client. Turns global row numbers (the Engram hash ids of
// upcoming tokens, already offset into the concatenated table) into batched one-sided reads
// on the shards' Transports, with deduplication, a hot-row cache and bounded retry.
//
//   KVTIER_ASSIGN_OR_RETURN(auto fetcher, RowFetcher::Create(std::move(map), std::move(shards),
//                                                            RowFetcherOptions{}));
//   KVTIER_RETURN_IF_ERROR(fetcher->RegisterBuffer(rows_buf, rows_buf_bytes));
//   KVTIER_ASSIGN_OR_RETURN(auto fetch, fetcher->Start(row_ids, rows_buf));  // prefetch
//   ... earlier layers compute ...
//   KVTIER_RETURN_IF_ERROR(fetcher->Wait(fetch));   // stalls only if rows are late
//
// Row i of the request lands at out + i * row_stride_bytes(). A row that cannot be read
// after retries_max retries fails the whole fetch with that error (never zeros): IOError
// for a lost server, PermissionDenied for a grant problem (not retried), InvalidArgument
// for a row outside the table (checked by Start()).
//
// Thread safety: all methods are thread-safe; distinct fetches may run concurrently. The
// caller owns `out` and must keep it registered and alive until Wait() returns.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "common/status.h"
#include "rdma/hot_row_cache.h"
#include "rdma/shard_map.h"
#include "rdma/transport.h"

namespace kvtier::rdma {

// Upper bound on RowFetcherOptions::wait_spin_us.
inline constexpr uint32_t kRowFetchWaitSpinMaxUs = 100000;

struct RowFetcherOptions {
  // Hot-row LRU cache size; 0 disables it.
  uint64_t hot_cache_bytes = 8ull << 20;
  // Rows per transport batch (must not exceed the transports' batch_ops_max).
  uint32_t batch_ops_max = 256;
  // Extra attempts of a batch that failed with IOError or Retry (the transport reconnects).
  uint32_t retries_max = 3;
  // Sleep before each retry round.
  uint32_t retry_backoff_ms = 20;
  // Rows in one Start() call.
  uint32_t rows_per_fetch_max = 1u << 16;
  // Wait() gives up (IOError) after this long in total, however the retries go.
  uint32_t fetch_timeout_ms = 30000;
  // Wait() on rows not yet arrived first spins this long, completing replies on its own
  // thread (Transport::Poll), before it blocks: a blocked waiter costs two thread wake-ups per
  // batch (tens of microseconds each on a loaded or virtualised host). At most
  // kRowFetchWaitSpinMaxUs; 0 blocks at once.
  uint32_t wait_spin_us = 200;
};

// The fetcher's metrics (monotonic counters except reads_in_flight). For /metrics.
struct RowFetchStats {
  uint64_t rows_requested = 0;     // rows asked for, duplicates included
  uint64_t rows_deduplicated = 0;  // rows served from another position of the same fetch
  uint64_t hot_cache_hits = 0;     // rows served from the hot-row cache
  uint64_t rows_read = 0;          // rows read from row servers
  uint64_t bytes_read = 0;         // bytes read from row servers
  uint64_t reads_in_flight = 0;    // rows submitted and not completed (current)
  uint64_t late_rows = 0;          // rows not yet arrived when Wait() was called
  uint64_t stalls = 0;             // Wait() calls that had to block
  uint64_t stall_us = 0;           // total time blocked (or spinning) in Wait()
  uint64_t retries = 0;            // batch attempts after a failure
  uint64_t fetches_failed = 0;     // fetches that ended with an error
};

// One shard's connection: a transport to its server and the grant to open its region. Several
// fetchers may share one transport (one connection per row server: RemoteEngramRowSource).
struct ShardConnection {
  std::shared_ptr<Transport> transport;
  RegionCredentials credentials;
};

class RowFetcher {
 public:
  struct Fetch;  // the state of one Start(); opaque
  using FetchHandle = std::shared_ptr<Fetch>;

  // Opens every shard's region and checks it against the map: same row range, one row
  // stride for all shards. `shards[i]` serves `map.shards()[i]`.
  static StatusOr<std::unique_ptr<RowFetcher>> Create(ShardMap map,
                                                      std::vector<ShardConnection> shards,
                                                      RowFetcherOptions options);
  // Returns once no transport callback of this fetcher's batches is running or to come: the
  // transports only this fetcher holds are closed first (their batches in flight fail at once);
  // batches in flight on a transport another fetcher shares are waited for (at most its
  // request_timeout_ms). Fetches not waited for are abandoned (their `out` must stay alive
  // until then, as always).
  ~RowFetcher();

  uint32_t row_stride_bytes() const { return row_stride_bytes_; }
  uint64_t row_count() const { return map_.row_count(); }

  // Registers a destination buffer with every shard's transport (once with a shared one).
  Status RegisterBuffer(uint8_t* data, size_t size_bytes);

  // Starts fetching `rows` into out[i * row_stride_bytes()]. Rows already in the hot cache
  // or repeated in `rows` are not read. InvalidArgument for an empty or oversized request
  // or a row outside the table. Does not block on the network (except to reconnect).
  StatusOr<FetchHandle> Start(std::span<const uint64_t> rows, uint8_t* out);
  // Waits for a started fetch; retries failed batches. Call once per handle. On an error
  // (a batch failed for good, or fetch_timeout_ms passed) the fetch is abandoned: no more of
  // its batches is submitted, those in flight are waited for (up to fetch_timeout_ms more),
  // and `out` is the caller's again when this returns, even while the handle is still held.
  // Replies already received are completed on the calling thread first (Transport::Poll): a
  // fetch whose rows are all in the sockets is not a stall. Rows still on their way: spins up to
  // wait_spin_us polling the shards' transports, then blocks (waking every 5 ms to poll again, so a
  // transport thread starved of a core does not hold it up).
  Status Wait(const FetchHandle& fetch);
  // Start + Wait.
  Status FetchRows(std::span<const uint64_t> rows, uint8_t* out);

  RowFetchStats stats() const;
  // The shard transports (e.g. for their counters); index = shard.
  Transport& transport(size_t shard) { return *shards_[shard].transport; }
  size_t num_shards() const { return shards_.size(); }

 private:
  RowFetcher(ShardMap map, RowFetcherOptions options);
  // Submits every unsubmitted batch of `f`; at the first Rejected (the transport's bound on
  // reads in flight) it stops, puts `f` on the backlog and returns false.
  bool SubmitPending(const FetchHandle& f);
  // Called after a batch completes: submits backlogged batches (oldest fetch first) until a
  // transport refuses again. Without it a fetch larger than the transports' bound would only
  // progress inside its own Wait(), so rows requested ahead of time would arrive late.
  void PumpBacklog();
  void Finish(const FetchHandle& f);

  struct ShardState {
    std::shared_ptr<Transport> transport;
    RegionInfo region;
  };

  ShardMap map_;
  RowFetcherOptions options_;
  // Batches submitted whose callbacks have not returned yet. A callback goes on using this
  // fetcher after it has woken the batch's Wait() (it pumps the backlog), so the destructor
  // waits for none to be left (closing first the transports no other fetcher shares, which
  // fails their batches in flight at once).
  std::mutex callbacks_mu_;
  std::condition_variable callbacks_cv_;
  uint64_t callbacks_outstanding_ = 0;  // guarded by callbacks_mu_
  // Fetches with flow-controlled (Rejected) batches, oldest first.
  std::mutex backlog_mu_;
  std::deque<std::weak_ptr<Fetch>> backlog_;  // guarded by backlog_mu_
  std::atomic<bool> pumping_{false};
  std::vector<ShardState> shards_;
  uint32_t row_stride_bytes_ = 0;

  std::mutex cache_mu_;
  HotRowCache cache_;  // guarded by cache_mu_

  std::atomic<uint64_t> rows_requested_{0}, rows_deduplicated_{0}, hot_cache_hits_{0},
      rows_read_{0}, bytes_read_{0}, reads_in_flight_{0}, late_rows_{0}, stalls_{0}, stall_us_{0},
      retries_{0}, fetches_failed_{0};
};

}  // namespace kvtier::rdma
