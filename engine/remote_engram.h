// RemoteEngramRowSource: the engine's EngramRowSource (engine/engram.h) served by Engram row
// servers (rdma/row_server.h) through one rdma::RowFetcher per Engram layer slot.
//
//   RemoteEngramConfig rc;
//   rc.shard_map_toml = ReadFile(".../shards.toml");      // written by `kvtier engram build`
//   rc.layer_ids = config.engram_layer_ids;
//   rc.tenant = "tenant-a";
//   rc.tokens = {{"engram.l1.s0", token}, ...};           // grants, one per region
//   KVTIER_ASSIGN_OR_RETURN(auto rows, RemoteEngramRowSource::ConnectTcp(config.engram_head_dim,
//                                                                       rc, {}));
//   EngineOptions eo;  eo.engram_rows = rows.get();        // rows must outlive the Engine
//
// Row addressing: the engine's row ids are the table rows of that layer (hash id + column
// offset, engine/engram.h); the table files hold exactly those rows (engine/engram_export.h),
// so slot s's row r is global row r of the slot's ShardMap. Request() starts the fetch of a
// batch into a per-slot staging buffer registered once with the transports (rows interleaved
// as in rdma/engram_table.h: row_dim e4m3 codes, then row_dim/32 ue8m0 scales, then padding);
// Wait() waits (a *stall* when rows are late) and splits the rows back into the separate
// codes and scales arrays the engine's local table uses. Duplicate rows of a batch are read
// once and a hot-row cache serves recent rows (rdma::RowFetcher).
//
// Errors: a row that cannot be read after the fetcher's bounded retries fails the request
// with an IOError/PermissionDenied naming the Engram layer; the batch's data and scales are
// then left empty (never zeros), so the engine step stops with that error.
//
// Limits: at most one outstanding request per slot (a second Request before Wait is
// InvalidArgument); a batch of more than
// options.staging_rows_max rows is Rejected (the engine asks n_tokens x columns rows per step,
// 12 per token on the miniature: the default 2^18 rows allow 21845-token chunks).
//
// Thread safety: Request/Wait on distinct slots may run concurrently; one slot is used by
// one engine step at a time (the engine's contract). stats() is safe at any time.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/engram.h"
#include "rdma/row_fetcher.h"
#include "rdma/transport.h"
#include "rdma/wire.h"

namespace kvtier::engine {

struct RemoteEngramOptions {
  // Rows one Request may ask for (per slot staging buffer = this x row stride bytes).
  // Default 2^18 (8.6 MiB per slot at the miniature's 33-byte rows).
  uint64_t staging_rows_max = 1ull << 18;
  // Per slot fetcher options (hot cache, batch size, retries, timeout).
  rdma::RowFetcherOptions fetcher;
  // Per shard transport options (TCP).
  rdma::TransportOptions transport;
};

// What ConnectTcp needs: the shard map TOML (one `[[engram.l<layer>.shard]]` array per Engram
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
  // Builds the fetchers over TcpTransports from a shard map (table path "engram.l<layer>"
  // per layer id) and opens every region with its grant. InvalidArgument for a bad TOML or
  // a region without a token; the transports' errors (IOError, PermissionDenied) otherwise.
  static StatusOr<std::unique_ptr<RemoteEngramRowSource>> ConnectTcp(
      int row_dim, const RemoteEngramConfig& config, RemoteEngramOptions options);
  ~RemoteEngramRowSource() override;

  int row_dim() const override { return row_dim_; }
  Status Request(EngramRowBatch* batch) override;
  Status Wait(EngramRowBatch* batch) override;

  RemoteEngramStats stats() const;
  // The slot's fetcher (its transports' counters, stats); slot in [0, num_slots()).
  rdma::RowFetcher& fetcher(int slot) { return *slots_[slot]->fetcher; }
  int num_slots() const { return static_cast<int>(slots_.size()); }

 private:
  struct Slot {
    std::unique_ptr<rdma::RowFetcher> fetcher;
    std::vector<uint8_t> staging;  // registered with the fetcher's transports once
    std::mutex mu;
    bool pending = false;  // guarded by mu
    const EngramRowBatch* batch = nullptr;
    std::vector<rdma::RowFetcher::FetchHandle> fetches;
    Status start_status;  // a failure of Start() is reported by Wait()
  };
  RemoteEngramRowSource(int row_dim, RemoteEngramOptions options)
      : row_dim_(row_dim), options_(std::move(options)) {}

  int row_dim_;
  RemoteEngramOptions options_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::atomic<uint64_t> requests_{0}, rows_requested_{0}, waits_{0}, stalls_{0}, stall_us_{0},
      failures_{0};
};

}  // namespace kvtier::engine
