// RemoteEngramRowSource: the engine's EngramRowSource (engine/engram.h) served by Engram row
// servers (rdma/row_server.h) through one rdma::RowFetcher per Engram layer slot.
//
//   RemoteEngramConfig rc;
//   rc.shard_map_toml = ReadFile(".../shards.toml");      // written by `kvtier engram build`
//   rc.layer_ids = config.engram_layer_ids;
//   rc.tenant = "tenant-a";
//   rc.tokens = {{"engram.l1.s0", token}, ...};           // grants, one per region
//   KVTIER_ASSIGN_OR_RETURN(auto rows, RemoteEngramRowSource::Connect(config.engram_head_dim,
//                                                                       rc, {}));
//   EngineOptions eo;  eo.engram_rows = rows.get();        // rows must outlive the Engine
//
// Row addressing: the engine's row ids are the table rows of that layer (hash id + column
// offset, engine/engram.h); the table files hold exactly those rows (engine/engram_export.h),
// so slot s's row r is global row r of the slot's ShardMap. Each slot has one staging ring of
// staging_rows_max rows registered once with the transports (rows interleaved as in
// rdma/engram_table.h: row_dim e4m3 codes, then row_dim/32 ue8m0 scales, then padding);
// Request() takes a contiguous slice of the ring and starts the fetch into it, so several
// requests per slot may be in flight (the engine's lookahead and hints); Wait() waits (a *stall*
// when rows are late), splits the slice's rows back into the separate codes and scales arrays
// the engine's local table uses and frees the slice. Duplicate rows of a batch are read once
// and a hot-row cache serves recent rows (rdma::RowFetcher).
//
// Errors: a row that cannot be read after the fetcher's bounded retries fails the request
// with an IOError/PermissionDenied naming the Engram slot; the batch's data and scales are
// then left empty (never zeros), so the engine step stops with that error.
//
// Limits: at most options.requests_per_slot_max requests outstanding per slot, and their rows
// together at most options.staging_rows_max (the ring); a Request over either bound is
// Rejected at once (never a wait): wait for an earlier request and ask again. A batch of more
// than staging_rows_max rows is always Rejected (the engine asks n_tokens x columns rows per
// step, 12 per token on the miniature: the default 2^18 rows hold 21845 tokens in flight).
// The same batch may not be outstanding twice (InvalidArgument). Waits may come in any order
// (a slice freed out of order is reused once the slices before it are free).
//
// Thread safety: all methods are thread-safe; one batch is waited by one thread. The fetch
// itself runs without the slot's lock held. stats() is safe at any time.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/engram.h"
#include "rdma/row_fetcher.h"
#include "rdma/transport.h"
#include "rdma/transport_factory.h"
#include "rdma/wire.h"

namespace kvtier::engine {

// Upper bound on RemoteEngramOptions::requests_per_slot_max.
inline constexpr uint32_t kMaxEngramRequestsPerSlot = 256;

struct RemoteEngramOptions {
  // Rows in flight per slot, over all its outstanding requests (the slot's staging ring =
  // this x row stride bytes, registered once). Default 2^18 (8.6 MiB per slot at the
  // miniature's 33-byte rows).
  uint64_t staging_rows_max = 1ull << 18;
  // Requests outstanding per slot, in [1, kMaxEngramRequestsPerSlot]. Default 16 (the engine's
  // lookahead is at most 8 chunks, plus hints).
  uint32_t requests_per_slot_max = 16;
  // Per slot fetcher options (hot cache, batch size, retries, timeout).
  rdma::RowFetcherOptions fetcher;
  // Per shard transport options.
  rdma::TransportOptions transport;
  // Which transport Connect() opens per shard (rdma/transport_factory.h): kAuto takes verbs
  // when this build has them, the host has an RDMA device and the row server accepts, else
  // TCP. Every shard decides on its own.
  rdma::TransportKind transport_kind = rdma::TransportKind::kAuto;
  // Connect(): shards of different slots at one endpoint (host:port) share one transport (one
  // connection per row server), so that HoldRequests can send a step's batches of all slots
  // in one message and one receive can take their replies. false: one transport per shard.
  bool share_connections = true;
  // HoldRequests() holds the transports' writes, so that a step's batches of all slots leave
  // in one send (one syscall less per step on the engine thread; the first slot's request
  // leaves a few microseconds later, so a little more often late). Off: HoldRequests has no
  // effect. On by default: measured with the engine on one thread, the remote arm's overhead
  // fell from 0.14 to 0.11 (fixed draft 5), 0.17 to 0.10 (3) and 0.41 to 0.28 (plain) in
  // wall time, medians of six alternations (docs/performance/speculative.md, "One send per
  // step"), while rows were late a little more often, for milliseconds in all.
  bool hold_step_requests = true;
};

// What Connect needs: the shard map TOML (one `[[engram.l<layer>.shard]]` array per Engram
// layer, the file engine/engram_export.h writes) and the grant for every region.
struct RemoteEngramConfig {
  std::string shard_map_toml;
  std::vector<int> layer_ids;                            // the config's engram_layer_ids, in order
  std::string tenant;                                    // the grants' tenant
  std::map<std::string, rdma::wire::GrantToken> tokens;  // region name -> grant token
};

// Counters over all slots (monotonic). The fetchers' own stats are summed in `fetch`.
struct RemoteEngramStats {
  uint64_t requests = 0;        // Request() calls that started a fetch
  uint64_t rows_requested = 0;  // rows asked for (duplicates included)
  uint64_t waits = 0;           // Wait() calls
  uint64_t stalls = 0;          // Wait() calls that found rows late and blocked
  uint64_t stall_us = 0;        // time blocked in those waits
  uint64_t failures = 0;        // requests that ended with an error
  uint64_t rejected = 0;        // Request() calls over requests_per_slot_max or the ring
  uint64_t in_flight = 0;       // requests outstanding now, all slots (current)
  uint64_t in_flight_max = 0;   // the most outstanding at once on one slot (high-water mark)
  rdma::RowFetchStats fetch;    // summed over the slots' fetchers
};

class RemoteEngramRowSource final : public EngramRowSource {
 public:
  // One fetcher per Engram layer slot (index = slot). InvalidArgument for no fetchers, a
  // null one, a row_dim not a positive multiple of 32, or a fetcher whose row stride is
  // shorter than a row of row_dim.
  static StatusOr<std::unique_ptr<RemoteEngramRowSource>> Create(
      int row_dim, std::vector<std::unique_ptr<rdma::RowFetcher>> fetchers,
      RemoteEngramOptions options);
  // Builds the fetchers over one transport per shard (options.transport_kind) from a shard map
  // (table path "engram.l<layer>" per layer id) and opens every region with its grant.
  // InvalidArgument for a bad TOML or a region without a token; the transports' errors (IOError,
  // PermissionDenied) otherwise.
  static StatusOr<std::unique_ptr<RemoteEngramRowSource>> Connect(int row_dim,
                                                                  const RemoteEngramConfig& config,
                                                                  RemoteEngramOptions options);
  ~RemoteEngramRowSource() override;

  int row_dim() const override { return row_dim_; }
  Status Request(EngramRowBatch* batch) override;
  Status Wait(EngramRowBatch* batch) override;
  // With options.hold_step_requests: holds the writes of every shard transport
  // (rdma::Transport::HoldWrites) while the engine requests a step's batches of all slots;
  // released, they leave together (one send per row server when the slots share its
  // connection). Otherwise no effect.
  void HoldRequests(bool hold) override;

  RemoteEngramStats stats() const;
  // The slot's fetcher (its transports' counters, stats); slot in [0, num_slots()).
  rdma::RowFetcher& fetcher(int slot) { return *slots_[slot]->fetcher; }
  // The name() of slot 0's first shard transport ("tcp" or "verbs"): the metrics label.
  const char* transport_name() { return slots_[0]->fetcher->transport(0).name(); }
  int num_slots() const { return static_cast<int>(slots_.size()); }

 private:
  // One outstanding request: its slice of the ring and its fetches.
  struct Pending {
    const EngramRowBatch* batch = nullptr;
    uint64_t ring_row = 0;  // first row of its slice
    uint64_t rows = 0;      // rows of its slice
    bool waiting = false;   // a Wait() has taken the fetches
    std::vector<rdma::RowFetcher::FetchHandle> fetches;
    Status start_status;  // a failure of Start() is reported by Wait()
  };
  struct Slot {
    std::unique_ptr<rdma::RowFetcher> fetcher;
    std::vector<uint8_t> staging;  // the ring, registered with the fetcher's transports once
    std::mutex mu;
    std::deque<Pending> pending;  // guarded by mu; in request order
  };
  // Where `rows` rows fit in the slot's ring after the outstanding slices (FIFO allocation);
  // false when they do not fit now. Requires slot.mu.
  bool AllocateRing(const Slot& slot, uint64_t rows, uint64_t* ring_row) const;

  RemoteEngramRowSource(int row_dim, RemoteEngramOptions options)
      : row_dim_(row_dim), options_(std::move(options)) {}

  int row_dim_;
  RemoteEngramOptions options_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<rdma::Transport*> transports_;  // every distinct shard transport (HoldRequests)
  std::atomic<bool> held_{false};             // inside HoldRequests(true) .. (false)
  std::atomic<uint64_t> requests_{0}, rows_requested_{0}, waits_{0}, stalls_{0}, stall_us_{0},
      failures_{0}, rejected_{0}, in_flight_{0}, in_flight_max_{0};
};

}  // namespace kvtier::engine
