#include "engine/remote_engram.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "rdma/engram_table.h"
#include "rdma/shard_map.h"
#include "rdma/tcp_transport.h"

namespace kvtier::engine {

namespace {

Status Annotate(const Status& s, int slot) {
  if (s.ok()) return s;
  return Status(s.code(), "engram slot " + std::to_string(slot) +
                              ": rows could not be read from the row servers (no zeros "
                              "substituted): " +
                              s.message());
}

}  // namespace

StatusOr<std::unique_ptr<RemoteEngramRowSource>> RemoteEngramRowSource::Create(
    int row_dim, std::vector<std::unique_ptr<rdma::RowFetcher>> fetchers,
    RemoteEngramOptions options) {
  if (row_dim <= 0 || row_dim % 32 != 0)
    return Status::InvalidArgument("remote engram: row_dim must be a positive multiple of 32");
  if (fetchers.empty()) return Status::InvalidArgument("remote engram: no fetchers");
  if (options.staging_rows_max == 0 || options.staging_rows_max > kMaxEngramRowsPerBatch)
    return Status::InvalidArgument("remote engram: staging_rows_max out of range");
  std::unique_ptr<RemoteEngramRowSource> src(new RemoteEngramRowSource(row_dim, options));
  for (auto& f : fetchers) {
    if (f == nullptr) return Status::InvalidArgument("remote engram: null fetcher");
    if (f->row_stride_bytes() < rdma::EngramRowBytes(static_cast<uint32_t>(row_dim)))
      return Status::InvalidArgument("remote engram: table row stride shorter than a row");
    auto slot = std::make_unique<Slot>();
    slot->staging.resize(options.staging_rows_max * f->row_stride_bytes());
    KVTIER_RETURN_IF_ERROR(f->RegisterBuffer(slot->staging.data(), slot->staging.size()));
    slot->fetcher = std::move(f);
    src->slots_.push_back(std::move(slot));
  }
  return src;
}

StatusOr<std::unique_ptr<RemoteEngramRowSource>> RemoteEngramRowSource::ConnectTcp(
    int row_dim, const RemoteEngramConfig& config, RemoteEngramOptions options) {
  if (config.layer_ids.empty()) return Status::InvalidArgument("remote engram: no layers");
  std::vector<std::unique_ptr<rdma::RowFetcher>> fetchers;
  for (int layer : config.layer_ids) {
    const std::string table = "engram.l" + std::to_string(layer);
    KVTIER_ASSIGN_OR_RETURN(rdma::ShardMap map,
                            rdma::ShardMap::FromToml(config.shard_map_toml, table));
    std::vector<rdma::ShardConnection> conns;
    for (const rdma::ShardSpec& spec : map.shards()) {
      auto tok = config.tokens.find(spec.region_name);
      if (tok == config.tokens.end())
        return Status::InvalidArgument("remote engram: no grant token for region " +
                                       spec.region_name);
      KVTIER_ASSIGN_OR_RETURN(
          auto transport,
          rdma::TcpTransport::Create(rdma::TcpEndpoint{spec.host, spec.port}, options.transport));
      conns.push_back(rdma::ShardConnection{
          std::move(transport),
          rdma::RegionCredentials{spec.region_name, config.tenant, tok->second}});
    }
    KVTIER_ASSIGN_OR_RETURN(
        auto fetcher, rdma::RowFetcher::Create(std::move(map), std::move(conns), options.fetcher));
    fetchers.push_back(std::move(fetcher));
  }
  return Create(row_dim, std::move(fetchers), std::move(options));
}

RemoteEngramRowSource::~RemoteEngramRowSource() {
  // Fetches still in flight write into the staging buffers: finish them first.
  for (auto& slot : slots_) {
    std::lock_guard<std::mutex> lock(slot->mu);
    for (auto& f : slot->fetches) (void)slot->fetcher->Wait(f);
    slot->fetches.clear();
  }
}

Status RemoteEngramRowSource::Request(EngramRowBatch* batch) {
  if (batch == nullptr || batch->slot < 0 || batch->slot >= num_slots())
    return Status::InvalidArgument("remote engram: bad slot");
  const size_t n = batch->row_ids.size();
  if (n > kMaxEngramRowsPerBatch || n > options_.staging_rows_max)
    return Status::Rejected("remote engram: batch of " + std::to_string(n) +
                            " rows exceeds staging_rows_max");
  Slot& slot = *slots_[batch->slot];
  std::lock_guard<std::mutex> lock(slot.mu);
  if (slot.pending)
    return Status::InvalidArgument("remote engram: slot already has a request in flight");
  const uint64_t table_rows = slot.fetcher->row_count();
  std::vector<uint64_t> rows(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = batch->row_ids[i];
    if (r < 0 || static_cast<uint64_t>(r) >= table_rows)
      return Status::InvalidArgument("remote engram: row id outside the table");
    rows[i] = static_cast<uint64_t>(r);
  }
  slot.batch = batch;
  slot.fetches.clear();
  slot.start_status = Status::Ok();
  slot.pending = true;
  requests_.fetch_add(1, std::memory_order_relaxed);
  rows_requested_.fetch_add(n, std::memory_order_relaxed);
  const size_t chunk = std::max<size_t>(1, options_.fetcher.rows_per_fetch_max);
  const uint32_t stride = slot.fetcher->row_stride_bytes();
  for (size_t off = 0; off < n; off += chunk) {
    const size_t len = std::min(chunk, n - off);
    StatusOr<rdma::RowFetcher::FetchHandle> h = slot.fetcher->Start(
        std::span<const uint64_t>(rows.data() + off, len), slot.staging.data() + off * stride);
    if (!h.ok()) {
      // Reported by Wait() after the chunks already started have finished.
      slot.start_status = h.status();
      break;
    }
    slot.fetches.push_back(std::move(*h));
  }
  return Status::Ok();
}

Status RemoteEngramRowSource::Wait(EngramRowBatch* batch) {
  if (batch == nullptr || batch->slot < 0 || batch->slot >= num_slots())
    return Status::InvalidArgument("remote engram: bad slot");
  Slot& slot = *slots_[batch->slot];
  std::lock_guard<std::mutex> lock(slot.mu);
  if (!slot.pending || slot.batch != batch)
    return Status::InvalidArgument("remote engram: Wait without a matching Request");
  waits_.fetch_add(1, std::memory_order_relaxed);
  const rdma::RowFetchStats before = slot.fetcher->stats();
  Status status = slot.start_status;
  for (auto& f : slot.fetches) {
    Status s = slot.fetcher->Wait(f);
    if (status.ok() && !s.ok()) status = s;
  }
  const rdma::RowFetchStats after = slot.fetcher->stats();
  if (after.stalls > before.stalls) {
    stalls_.fetch_add(1, std::memory_order_relaxed);
    stall_us_.fetch_add(after.stall_us - before.stall_us, std::memory_order_relaxed);
  }
  slot.fetches.clear();
  slot.pending = false;
  slot.batch = nullptr;
  batch->data.clear();
  batch->scales.clear();
  if (!status.ok()) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    return Annotate(status, batch->slot);
  }
  const size_t n = batch->row_ids.size();
  const size_t rd = static_cast<size_t>(row_dim_), sd = rd / 32;
  const uint32_t stride = slot.fetcher->row_stride_bytes();
  batch->data.resize(n * rd);
  batch->scales.resize(n * sd);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* src = slot.staging.data() + i * stride;
    std::memcpy(batch->data.data() + i * rd, src, rd);
    std::memcpy(batch->scales.data() + i * sd, src + rd, sd);
  }
  return Status::Ok();
}

RemoteEngramStats RemoteEngramRowSource::stats() const {
  RemoteEngramStats s;
  s.requests = requests_.load();
  s.rows_requested = rows_requested_.load();
  s.waits = waits_.load();
  s.stalls = stalls_.load();
  s.stall_us = stall_us_.load();
  s.failures = failures_.load();
  for (const auto& slot : slots_) {
    const rdma::RowFetchStats f = slot->fetcher->stats();
    s.fetch.rows_requested += f.rows_requested;
    s.fetch.rows_deduplicated += f.rows_deduplicated;
    s.fetch.hot_cache_hits += f.hot_cache_hits;
    s.fetch.rows_read += f.rows_read;
    s.fetch.bytes_read += f.bytes_read;
    s.fetch.reads_in_flight += f.reads_in_flight;
    s.fetch.late_rows += f.late_rows;
    s.fetch.stalls += f.stalls;
    s.fetch.stall_us += f.stall_us;
    s.fetch.retries += f.retries;
    s.fetch.fetches_failed += f.fetches_failed;
  }
  return s;
}

}  // namespace kvtier::engine
