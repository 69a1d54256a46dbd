// StagingServer: the owner's side of the cluster's bulk data path (docs/CLUSTER.md, "Bulk
// data over the region transport"). One per node: a StagingRing exported as the single
// region kStagingRegionName of an rdma::RowServer of its own, plus the grants on it.
//
// A GET_STAGED from a peer (cluster/peer_server.h) comes here with the node id the peer gave
// in HELLO (it holds the cluster credential). Stage() refuses a node that is not in the
// current membership (PermissionDenied: the caller falls back to GET), copies each held unit
// into the ring and answers the records with a grant on the region for that node. Grants are
// issued to the identity kStagingIdentityPrefix + node id, never to a tenant; one per node,
// reissued when less than half of grant_ttl_ms is left (the old one expires on its own).
// SetMembers() revokes at once the grants of nodes no longer in the membership. The region
// server serves no other region: a peer can read staging records and nothing else of this
// node's memory (no tenant's units, no table).
//
// Thread safety: every method may be called concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "cluster/peer_wire.h"
#include "cluster/staging_ring.h"
#include "common/clock.h"
#include "common/status.h"
#include "rdma/row_server.h"

namespace kvtier::cluster {

inline constexpr const char* kStagingRegionName = "kvtier.cluster.staging";
inline constexpr const char* kStagingIdentityPrefix = "kvtier.cluster.node:";

struct StagingServerOptions {
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;  // 0: any free port (port() tells; answered in every reply)
  uint64_t ring_bytes = 64ull << 20;
  uint64_t grant_ttl_ms = 60000;
  bool verbs = false;  // serve the verbs side channel (a device must exist)
  uint32_t connections_max = 256;
  const Clock* clock = nullptr;  // grant expiry; nullptr: DefaultSteadyClock()
};

struct StagingServerStats {
  uint64_t requests = 0;  // Stage() calls answered
  uint64_t refused = 0;   // Stage() calls from a node not in the membership
  uint64_t grants_issued = 0;
  uint64_t grants_revoked = 0;  // grants of nodes that left the membership
  StagingRingCounters ring;
  rdma::RowServerCounters region;
};

class StagingServer {
 public:
  // Creates the ring, registers it and starts the region server on its own thread.
  // InvalidArgument for a bad ring size; IOError when the address cannot be bound.
  static StatusOr<std::unique_ptr<StagingServer>> Start(StagingServerOptions options);
  ~StagingServer();  // Stop()
  void Stop();

  // How a unit is read from the local store (NotFound: absent), with its remaining TTL (0:
  // none), which the reply's unit carries (StagedUnit::ttl_left_ms).
  using GetFn = std::function<Status(const PeerKey&, std::vector<uint8_t>*, uint64_t*)>;
  // Stages every key `get` finds; code NotFound for absent keys, the error (not staged) for
  // other failures, Rejected for a unit larger than the ring.
  StatusOr<StagedReply> Stage(const std::string& reader_node, std::span<const PeerKey> keys,
                              const GetFn& get);
  // The current membership's node ids: grants of nodes not in it are revoked.
  void SetMembers(const std::vector<std::string>& node_ids);

  uint16_t port() const { return server_->port(); }
  StagingServerStats stats() const;
  StagingRing* TEST_ring() { return ring_.get(); }

 private:
  StagingServer(StagingServerOptions options, std::unique_ptr<StagingRing> ring,
                std::unique_ptr<rdma::RowServer> server);
  // The reader's grant, issued or renewed when needed.
  StatusOr<rdma::wire::GrantToken> GrantFor(const std::string& reader_node);

  struct Grant {
    rdma::wire::GrantToken token{};
    uint64_t expiry_us = 0;
  };
  const StagingServerOptions options_;
  const Clock* clock_;
  std::unique_ptr<StagingRing> ring_;
  std::unique_ptr<rdma::RowServer> server_;
  std::mutex mu_;
  std::set<std::string> members_;  // guarded by mu_
  // Unexpired grants by reader node id, newest last (an older one stays valid until it
  // expires, so all are revoked when the node leaves); guarded by mu_.
  std::map<std::string, std::vector<Grant>> grants_;
  std::atomic<uint64_t> requests_{0}, refused_{0}, grants_issued_{0}, grants_revoked_{0};
};

}  // namespace kvtier::cluster
