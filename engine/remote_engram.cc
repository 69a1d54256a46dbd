#include "engine/remote_engram.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "rdma/engram_table.h"
#include "rdma/shard_map.h"
#include "rdma/tcp_transport.h"
#include "rdma/transport_factory.h"

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
  if (options.requests_per_slot_max == 0 ||
      options.requests_per_slot_max > kMaxEngramRequestsPerSlot)
    return Status::InvalidArgument("remote engram: requests_per_slot_max out of range");
  std::unique_ptr<RemoteEngramRowSource> src(new RemoteEngramRowSource(row_dim, options));
  for (auto& f : fetchers) {
    if (f == nullptr) return Status::InvalidArgument("remote engram: null fetcher");
    if (f->row_stride_bytes() < rdma::EngramRowBytes(static_cast<uint32_t>(row_dim)))
      return Status::InvalidArgument("remote engram: table row stride shorter than a row");
    auto slot = std::make_unique<Slot>();
    slot->staging.resize(options.staging_rows_max * f->row_stride_bytes());
    KVTIER_RETURN_IF_ERROR(f->RegisterBuffer(slot->staging.data(), slot->staging.size()));
    slot->fetcher = std::move(f);
    for (size_t i = 0; i < slot->fetcher->num_shards(); ++i) {
      rdma::Transport* t = &slot->fetcher->transport(i);
      if (std::find(src->transports_.begin(), src->transports_.end(), t) == src->transports_.end())
        src->transports_.push_back(t);
    }
    src->slots_.push_back(std::move(slot));
  }
  return src;
}

StatusOr<std::unique_ptr<RemoteEngramRowSource>> RemoteEngramRowSource::Connect(
    int row_dim, const RemoteEngramConfig& config, RemoteEngramOptions options) {
  if (config.layer_ids.empty()) return Status::InvalidArgument("remote engram: no layers");
  std::vector<std::unique_ptr<rdma::RowFetcher>> fetchers;
  std::map<std::pair<std::string, uint16_t>, std::shared_ptr<rdma::Transport>> by_endpoint;
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
      std::shared_ptr<rdma::Transport>& shared = by_endpoint[{spec.host, spec.port}];
      std::shared_ptr<rdma::Transport> transport = options.share_connections ? shared : nullptr;
      if (transport == nullptr) {
        KVTIER_ASSIGN_OR_RETURN(transport,
                                rdma::MakeTransport(rdma::TcpEndpoint{spec.host, spec.port},
                                                    options.transport, options.transport_kind));
        if (options.share_connections) shared = transport;
      }
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
  // Fetches still in flight write into the staging rings: finish them first.
  for (auto& slot : slots_) {
    std::lock_guard<std::mutex> lock(slot->mu);
    for (Pending& p : slot->pending) {
      for (auto& f : p.fetches) (void)slot->fetcher->Wait(f);
      p.fetches.clear();
    }
    slot->pending.clear();
  }
}

bool RemoteEngramRowSource::AllocateRing(const Slot& slot, uint64_t rows,
                                         uint64_t* ring_row) const {
  const uint64_t cap = options_.staging_rows_max;
  if (rows > cap) return false;
  // The live slices, oldest first, occupy [head, tail) of the ring (modulo wrap-around);
  // slices freed out of order are reused once every older one is free.
  const Pending* first = nullptr;
  const Pending* last = nullptr;
  for (const Pending& p : slot.pending) {
    if (p.rows == 0) continue;
    if (first == nullptr) first = &p;
    last = &p;
  }
  if (first == nullptr) {
    *ring_row = 0;
    return true;
  }
  const uint64_t head = first->ring_row, tail = last->ring_row + last->rows;
  if (tail > head) {  // not wrapped: free space at [tail, cap) and [0, head)
    if (tail + rows <= cap) {
      *ring_row = tail;
      return true;
    }
    if (rows <= head) {
      *ring_row = 0;
      return true;
    }
    return false;
  }
  if (tail + rows <= head) {  // wrapped: free space at [tail, head)
    *ring_row = tail;
    return true;
  }
  return false;
}

Status RemoteEngramRowSource::Request(EngramRowBatch* batch) {
  if (batch == nullptr || batch->slot < 0 || batch->slot >= num_slots())
    return Status::InvalidArgument("remote engram: bad slot");
  const size_t n = batch->row_ids.size();
  if (n > kMaxEngramRowsPerBatch || n > options_.staging_rows_max) {
    rejected_.fetch_add(1, std::memory_order_relaxed);
    return Status::Rejected("remote engram: batch of " + std::to_string(n) +
                            " rows exceeds staging_rows_max");
  }
  Slot& slot = *slots_[batch->slot];
  const uint64_t table_rows = slot.fetcher->row_count();
  std::vector<uint64_t> rows(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = batch->row_ids[i];
    if (r < 0 || static_cast<uint64_t>(r) >= table_rows)
      return Status::InvalidArgument("remote engram: row id outside the table");
    rows[i] = static_cast<uint64_t>(r);
  }
  std::lock_guard<std::mutex> lock(slot.mu);
  for (const Pending& p : slot.pending) {
    if (p.batch == batch)
      return Status::InvalidArgument("remote engram: batch already has a request in flight");
  }
  if (slot.pending.size() >= options_.requests_per_slot_max) {
    rejected_.fetch_add(1, std::memory_order_relaxed);
    return Status::Rejected("remote engram: slot " + std::to_string(batch->slot) + " has " +
                            std::to_string(slot.pending.size()) +
                            " requests outstanding (requests_per_slot_max)");
  }
  uint64_t ring_row = 0;
  if (!AllocateRing(slot, n, &ring_row)) {
    rejected_.fetch_add(1, std::memory_order_relaxed);
    return Status::Rejected("remote engram: slot " + std::to_string(batch->slot) +
                            " staging ring has no room for " + std::to_string(n) +
                            " more rows (staging_rows_max)");
  }
  Pending& p = slot.pending.emplace_back();
  p.batch = batch;
  p.ring_row = ring_row;
  p.rows = n;
  requests_.fetch_add(1, std::memory_order_relaxed);
  rows_requested_.fetch_add(n, std::memory_order_relaxed);
  in_flight_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t depth = slot.pending.size();
  uint64_t seen = in_flight_max_.load(std::memory_order_relaxed);
  while (depth > seen && !in_flight_max_.compare_exchange_weak(seen, depth)) {
  }
  const size_t chunk = std::max<size_t>(1, options_.fetcher.rows_per_fetch_max);
  const uint32_t stride = slot.fetcher->row_stride_bytes();
  uint8_t* out = slot.staging.data() + ring_row * stride;
  for (size_t off = 0; off < n; off += chunk) {
    const size_t len = std::min(chunk, n - off);
    StatusOr<rdma::RowFetcher::FetchHandle> h =
        slot.fetcher->Start(std::span<const uint64_t>(rows.data() + off, len), out + off * stride);
    if (!h.ok()) {
      // Reported by Wait() after the chunks already started have finished.
      p.start_status = h.status();
      break;
    }
    p.fetches.push_back(std::move(*h));
  }
  return Status::Ok();
}

Status RemoteEngramRowSource::Wait(EngramRowBatch* batch) {
  if (batch == nullptr || batch->slot < 0 || batch->slot >= num_slots())
    return Status::InvalidArgument("remote engram: bad slot");
  HoldRequests(false);  // a request kept back would never arrive
  Slot& slot = *slots_[batch->slot];
  std::vector<rdma::RowFetcher::FetchHandle> fetches;
  Status status;
  uint64_t ring_row = 0;
  {
    std::lock_guard<std::mutex> lock(slot.mu);
    auto it = std::find_if(slot.pending.begin(), slot.pending.end(),
                           [&](const Pending& p) { return p.batch == batch; });
    if (it == slot.pending.end() || it->waiting)
      return Status::InvalidArgument("remote engram: Wait without a matching Request");
    it->waiting = true;
    fetches = std::move(it->fetches);
    it->fetches.clear();
    status = it->start_status;
    ring_row = it->ring_row;
  }
  waits_.fetch_add(1, std::memory_order_relaxed);
  // The slice stays reserved (its Pending entry) until the rows are copied out below.
  const rdma::RowFetchStats before = slot.fetcher->stats();
  for (auto& f : fetches) {
    Status s = slot.fetcher->Wait(f);
    if (status.ok() && !s.ok()) status = s;
  }
  const rdma::RowFetchStats after = slot.fetcher->stats();
  batch->stalled = after.stalls > before.stalls;
  if (batch->stalled) {
    stalls_.fetch_add(1, std::memory_order_relaxed);
    stall_us_.fetch_add(after.stall_us - before.stall_us, std::memory_order_relaxed);
  }
  batch->data.clear();
  batch->scales.clear();
  if (status.ok()) {
    const size_t n = batch->row_ids.size();
    const size_t rd = static_cast<size_t>(row_dim_), sd = rd / 32;
    const uint32_t stride = slot.fetcher->row_stride_bytes();
    const uint8_t* base = slot.staging.data() + ring_row * stride;
    batch->data.resize(n * rd);
    batch->scales.resize(n * sd);
    for (size_t i = 0; i < n; ++i) {
      const uint8_t* src = base + i * stride;
      std::memcpy(batch->data.data() + i * rd, src, rd);
      std::memcpy(batch->scales.data() + i * sd, src + rd, sd);
    }
  }
  {
    std::lock_guard<std::mutex> lock(slot.mu);
    auto it = std::find_if(slot.pending.begin(), slot.pending.end(),
                           [&](const Pending& p) { return p.batch == batch; });
    if (it != slot.pending.end()) slot.pending.erase(it);
  }
  in_flight_.fetch_sub(1, std::memory_order_relaxed);
  if (!status.ok()) {
    failures_.fetch_add(1, std::memory_order_relaxed);
    return Annotate(status, batch->slot);
  }
  return Status::Ok();
}

void RemoteEngramRowSource::HoldRequests(bool hold) {
  if (!options_.hold_step_requests) return;
  if (held_.exchange(hold) == hold) return;  // already so (a Wait ended the bracket)
  for (rdma::Transport* t : transports_) {
    if (hold) {
      t->HoldWrites();
    } else {
      t->ReleaseWrites();
    }
  }
}

RemoteEngramStats RemoteEngramRowSource::stats() const {
  RemoteEngramStats s;
  s.requests = requests_.load();
  s.rows_requested = rows_requested_.load();
  s.waits = waits_.load();
  s.stalls = stalls_.load();
  s.stall_us = stall_us_.load();
  s.failures = failures_.load();
  s.rejected = rejected_.load();
  s.in_flight = in_flight_.load();
  s.in_flight_max = in_flight_max_.load();
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
