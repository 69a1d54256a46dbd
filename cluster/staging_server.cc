#include "cluster/staging_server.h"

namespace kvtier::cluster {

StatusOr<std::unique_ptr<StagingServer>> StagingServer::Start(StagingServerOptions options) {
  if (options.grant_ttl_ms < 1000) {
    return Status::InvalidArgument("staging server: grant_ttl_ms below 1000");
  }
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<StagingRing> ring,
                          StagingRing::Create(options.ring_bytes));
  rdma::RowServerOptions ro;
  ro.bind_address = options.listen_host;
  ro.port = options.listen_port;
  ro.connections_max = options.connections_max;
  ro.regions_per_connection_max = 4;
  ro.read_bytes_max = rdma::wire::kReadBytesMax;
  ro.grant_ttl_ms_max = options.grant_ttl_ms;
  ro.clock = options.clock;
  ro.verbs_enabled = options.verbs;
  auto server = std::make_unique<rdma::RowServer>(ro);
  KVTIER_RETURN_IF_ERROR(server->RegisterMemory(
      kStagingRegionName, ring->memory(), kStagingAlignBytes, ring->owner(),
      [r = ring.get()](const std::function<void()>& copy) { r->WithWriteLock(copy); }));
  KVTIER_RETURN_IF_ERROR(server->Start());
  return std::unique_ptr<StagingServer>(
      new StagingServer(std::move(options), std::move(ring), std::move(server)));
}

StagingServer::StagingServer(StagingServerOptions options, std::unique_ptr<StagingRing> ring,
                             std::unique_ptr<rdma::RowServer> server)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : &DefaultSteadyClock()),
      ring_(std::move(ring)),
      server_(std::move(server)) {}

StagingServer::~StagingServer() { Stop(); }

void StagingServer::Stop() { server_->Stop(); }

StatusOr<rdma::wire::GrantToken> StagingServer::GrantFor(const std::string& reader_node) {
  // mu_ is held.
  const uint64_t now_us = clock_->NowUs();
  const uint64_t ttl_us = options_.grant_ttl_ms * 1000;
  std::vector<Grant>& held = grants_[reader_node];
  std::erase_if(held, [&](const Grant& g) { return g.expiry_us <= now_us; });
  if (!held.empty() && held.back().expiry_us - now_us > ttl_us / 2) return held.back().token;
  KVTIER_ASSIGN_OR_RETURN(
      rdma::wire::GrantToken token,
      server_->IssueGrant(kStagingRegionName, kStagingIdentityPrefix + reader_node,
                          options_.grant_ttl_ms));
  grants_issued_.fetch_add(1);
  held.push_back(Grant{token, now_us + ttl_us});
  return token;
}

StatusOr<StagedReply> StagingServer::Stage(const std::string& reader_node,
                                           std::span<const PeerKey> keys, const GetFn& get) {
  StagedReply reply;
  {
    std::lock_guard lock(mu_);
    if (members_.count(reader_node) == 0) {
      refused_.fetch_add(1);
      return Status::PermissionDenied("staging: node " + reader_node +
                                      " is not in this node's membership view");
    }
    KVTIER_ASSIGN_OR_RETURN(reply.token, GrantFor(reader_node));
  }
  requests_.fetch_add(1);
  reply.region_port = server_->port();
  reply.region_name = kStagingRegionName;
  reply.units.resize(keys.size());
  std::vector<uint8_t> value;
  for (size_t i = 0; i < keys.size(); ++i) {
    StagedUnit& u = reply.units[i];
    uint64_t ttl_left_ms = 0;
    Status s = get(keys[i], &value, &ttl_left_ms);
    if (!s.ok()) {
      u.code = s.code();
      continue;
    }
    StatusOr<StagedUnit> staged = ring_->Stage(value);
    u = staged.ok() ? *staged : StagedUnit{.code = staged.status().code()};
    if (staged.ok()) u.ttl_left_ms = ttl_left_ms;
  }
  return reply;
}

void StagingServer::SetMembers(const std::vector<std::string>& node_ids) {
  std::lock_guard lock(mu_);
  members_ = std::set<std::string>(node_ids.begin(), node_ids.end());
  for (auto it = grants_.begin(); it != grants_.end();) {
    if (members_.count(it->first) != 0) {
      ++it;
      continue;
    }
    for (const Grant& g : it->second) {
      (void)server_->RevokeGrant(g.token);  // NotFound: it had expired and was dropped
      grants_revoked_.fetch_add(1);
    }
    it = grants_.erase(it);
  }
}

StagingServerStats StagingServer::stats() const {
  return {requests_.load(),       refused_.load(),   grants_issued_.load(),
          grants_revoked_.load(), ring_->counters(), server_->counters()};
}

}  // namespace kvtier::cluster
