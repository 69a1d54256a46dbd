#include "cluster/staged_fetch.h"

#include <condition_variable>
#include <vector>

#include "cluster/http_client.h"
#include "cluster/staging_ring.h"
#include "cluster/staging_server.h"
#include "common/logging.h"

namespace kvtier::cluster {

struct StagedFetcher::Remote {
  std::mutex mu;  // serializes (re)making the transport; reads run outside it
  std::shared_ptr<rdma::Transport> transport;
  rdma::RegionId region = 0;
  rdma::wire::GrantToken token{};
  uint16_t port = 0;
};

namespace {

// Ops of one batch: 16 x 1 MiB stays within a row server's default response_bytes_max.
constexpr uint32_t kBatchOps = 16;

// Submits ops in batches of kBatchOps, all at once (pipelined on the connection), and waits
// for every batch. Returns the first error.
Status ReadAll(rdma::Transport& t, std::span<const rdma::ReadOp> ops) {
  struct Wait {
    std::mutex mu;
    std::condition_variable cv;
    size_t pending = 0;
    Status first;
  };
  auto wait = std::make_shared<Wait>();
  Status submit_error;
  for (size_t first = 0; first < ops.size(); first += kBatchOps) {
    {
      std::lock_guard lock(wait->mu);
      ++wait->pending;
    }
    Status s = t.Submit(ops.subspan(first, std::min<size_t>(kBatchOps, ops.size() - first)),
                        [wait](const Status& done) {
                          std::lock_guard lock(wait->mu);
                          if (!done.ok() && wait->first.ok()) wait->first = done;
                          if (--wait->pending == 0) wait->cv.notify_all();
                        });
    if (!s.ok()) {
      std::lock_guard lock(wait->mu);
      --wait->pending;
      submit_error = s;
      break;
    }
  }
  std::unique_lock lock(wait->mu);
  wait->cv.wait(lock, [&] { return wait->pending == 0; });
  return submit_error.ok() ? wait->first : submit_error;
}

}  // namespace

StagedFetcher::StagedFetcher(PeerClient* peers, StagedFetcherOptions options)
    : peers_(peers), options_(options) {}

StagedFetcher::~StagedFetcher() = default;

StatusOr<std::pair<std::shared_ptr<rdma::Transport>, rdma::RegionId>> StagedFetcher::RegionFor(
    const std::string& endpoint, const StagedReply& reply) {
  std::shared_ptr<Remote> remote;
  {
    std::lock_guard lock(mu_);
    auto& slot = remotes_[endpoint];
    if (slot == nullptr) slot = std::make_shared<Remote>();
    remote = slot;
  }
  std::lock_guard lock(remote->mu);
  if (remote->transport != nullptr && remote->token == reply.token &&
      remote->port == reply.region_port) {
    return std::make_pair(remote->transport, remote->region);
  }
  // A new grant or port: a fresh transport (the old one closes when its last read is done;
  // reopening on the old one would pile up regions on the owner's connection).
  remote->transport.reset();
  StatusOr<HttpEndpoint> peer = ParseHttpEndpoint(endpoint);
  if (!peer.ok()) return peer.status();
  std::string host = peer->host;  // "[v6]" -> "v6" for the transport
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  rdma::TransportOptions to;
  to.read_bytes_max = rdma::wire::kReadBytesMax;
  to.batch_ops_max = kBatchOps;
  to.request_timeout_ms = options_.timeout_ms;
  to.connect_timeout_ms = options_.timeout_ms;
  KVTIER_ASSIGN_OR_RETURN(
      std::unique_ptr<rdma::Transport> transport,
      rdma::MakeTransport(rdma::TcpEndpoint{host, reply.region_port}, to, options_.kind));
  KVTIER_ASSIGN_OR_RETURN(
      rdma::RegionInfo info,
      transport->OpenRegion(rdma::RegionCredentials{
          reply.region_name, kStagingIdentityPrefix + options_.node_id, reply.token}));
  (void)info;
  remote->transport = std::move(transport);
  remote->region = info.id;
  remote->token = reply.token;
  remote->port = reply.region_port;
  return std::make_pair(remote->transport, remote->region);
}

StatusOr<PeerClient::GetResult> StagedFetcher::Get(const std::string& endpoint,
                                                   std::span<const PeerKey> keys) {
  calls_.fetch_add(1);
  PeerClient::GetResult out;
  out.statuses.assign(keys.size(), Status::Unavailable("not fetched"));
  out.values.resize(keys.size());
  out.ttl_left_ms.resize(keys.size());
  std::vector<size_t> fallback;  // indices fetched by plain GET at the end

  StatusOr<StagedReply> reply = peers_->GetStaged(endpoint, keys);
  if (!reply.ok()) {
    refused_.fetch_add(1);
    KVTIER_LOG(kDebug) << "cluster: GET_STAGED to " << endpoint << ": " << reply.status().message();
    fallback_units_.fetch_add(keys.size());
    return peers_->Get(endpoint, keys);
  }

  // The records to read, within bytes_per_call_max; the rest answer Retry.
  std::vector<size_t> to_read;
  uint64_t total = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const StagedUnit& u = reply->units[i];
    if (u.code == StatusCode::kNotFound) {
      out.statuses[i] = Status::NotFound("peer");
    } else if (u.code != StatusCode::kOk) {
      fallback.push_back(i);
    } else if (total + u.length_bytes > options_.bytes_per_call_max) {
      out.statuses[i] = to_read.empty() ? Status::Rejected("unit over bytes_per_call_max")
                                        : Status::Retry("staged read full");
      if (to_read.empty()) fallback.push_back(i);
    } else {
      total += u.length_bytes;
      to_read.push_back(i);
    }
  }

  if (!to_read.empty()) {
    Status read = Status::Ok();
    // The values are views of this buffer, which the result holds.
    auto held = std::make_shared<std::vector<uint8_t>>(total);
    std::vector<uint8_t>& buffer = *held;
    StatusOr<std::pair<std::shared_ptr<rdma::Transport>, rdma::RegionId>> region =
        RegionFor(endpoint, *reply);
    if (!region.ok()) {
      read = region.status();
    } else {
      rdma::Transport& t = *region->first;
      StatusOr<rdma::LocalBufferId> registered =
          t.RegisterLocalBuffer(buffer.data(), buffer.size());
      if (!registered.ok()) {
        read = registered.status();
      } else {
        // Ops of at most kReadBytesMax each, batches of at most batch_ops_max ops.
        std::vector<rdma::ReadOp> ops;
        uint64_t at = 0;
        for (size_t i : to_read) {
          const StagedUnit& u = reply->units[i];
          for (uint64_t done = 0; done < u.length_bytes;) {
            const uint32_t n = static_cast<uint32_t>(
                std::min<uint64_t>(rdma::wire::kReadBytesMax, u.length_bytes - done));
            ops.push_back({region->second, u.offset_bytes + done, n, buffer.data() + at + done});
            done += n;
          }
          at += u.length_bytes;
        }
        read = ReadAll(t, ops);
        (void)t.UnregisterLocalBuffer(*registered);
      }
    }
    if (!read.ok()) {
      transport_errors_.fetch_add(1);
      KVTIER_LOG(kDebug) << "cluster: staged read from " << endpoint << ": " << read.message();
      if (read.IsPermissionDenied() || read.IsInvalidArgument()) {
        // A grant that lapsed or a region that changed: the next call opens afresh.
        std::lock_guard lock(mu_);
        remotes_.erase(endpoint);
      }
      fallback.insert(fallback.end(), to_read.begin(), to_read.end());
    } else {
      uint64_t at = 0;
      for (size_t i : to_read) {
        const StagedUnit& u = reply->units[i];
        auto value =
            StagingRing::Verify(std::span<const uint8_t>(buffer.data() + at, u.length_bytes), u);
        at += u.length_bytes;
        if (!value.ok()) {
          reused_.fetch_add(1);
          fallback.push_back(i);
          continue;
        }
        out.statuses[i] = Status::Ok();
        out.values[i] = *value;
        if (reply->ttl_known) out.ttl_left_ms[i] = u.ttl_left_ms;
        units_.fetch_add(1);
        bytes_.fetch_add(value->size());
      }
      out.held.push_back(std::move(held));
    }
  }

  if (!fallback.empty()) {
    fallback_units_.fetch_add(fallback.size());
    std::vector<PeerKey> again;
    again.reserve(fallback.size());
    for (size_t i : fallback) again.push_back(keys[i]);
    StatusOr<PeerClient::GetResult> plain = peers_->Get(endpoint, again);
    if (plain.ok()) out.held.insert(out.held.end(), plain->held.begin(), plain->held.end());
    for (size_t j = 0; j < fallback.size(); ++j) {
      const size_t i = fallback[j];
      if (!plain.ok()) {
        out.statuses[i] = plain.status();
        continue;
      }
      out.statuses[i] = plain->statuses[j];
      out.values[i] = plain->values[j];
      out.ttl_left_ms[i] = plain->ttl_left_ms[j];
    }
  }
  return out;
}

StagedFetchStats StagedFetcher::stats() const {
  return {calls_.load(),  units_.load(),          bytes_.load(),
          reused_.load(), fallback_units_.load(), transport_errors_.load(),
          refused_.load()};
}

}  // namespace kvtier::cluster
