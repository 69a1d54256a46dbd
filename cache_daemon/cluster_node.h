// ClusterNode: what [cluster] adds to a kvtierd (docs/CLUSTER.md): the peer front serving
// this node's store to its peers, the membership session in etcd, the peer client pool and
// the router the Service sends its native operations through.
//
// Start order: the staging region (with peer_data_transport "tcp_region" or "verbs"), peer front
// (so peers can reach us once we are listed), then membership, then the router is handed to the
// Service, then the repair scan (cluster_repair.h) starts; it runs again on every membership
// change; then the checksum-failure refetch (cluster_refetch.h) is attached to the store, then the
// peer clock sampler (cluster/peer_clocks.h) starts. Stop: end the clock sampler, detach and end
// the refetch, end the repair scan, leave etcd (lease revoked), then close the peer front. etcd
// unreachable at start is not an error: the node serves what it holds and keeps trying
// (etcd_reachable() false, shown on /readyz and /metrics).
//
// Thread safety: Start/Stop from one thread; the rest from any.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cache_daemon/cluster_copies.h"
#include "cache_daemon/cluster_refetch.h"
#include "cache_daemon/cluster_repair.h"
#include "cache_daemon/config.h"
#include "cache_daemon/service.h"
#include "cache_daemon/tenants.h"
#include "cluster/membership.h"
#include "cluster/pause_guard.h"
#include "cluster/peer_client.h"
#include "cluster/peer_clocks.h"
#include "cluster/peer_server.h"
#include "cluster/recent_deletes.h"
#include "cluster/router.h"
#include "cluster/staged_fetch.h"
#include "cluster/staging_server.h"
#include "cluster/tombstones.h"

namespace kvtier::daemon {

namespace internal {
class ReplyBuffers;
}  // namespace internal

class ClusterNode {
 public:
  // options must be Finalize()d with options.cluster.enabled. Reads the credential file
  // (InvalidArgument when shorter than 32 bytes, IOError when unreadable), binds the peer
  // front (IOError), starts membership and installs the router in service. reply_buffers
  // (may be null; must outlive the node): the daemon's kept reply buffers, which the peer
  // front builds its GET replies in and the peer client reads GET replies into.
  static StatusOr<std::unique_ptr<ClusterNode>> Start(const DaemonOptions& options,
                                                      Service* service,
                                                      const TenantRegistry* tenants,
                                                      internal::ReplyBuffers* reply_buffers);
  ~ClusterNode();
  void Stop();

  bool etcd_reachable() const { return membership_->etcd_reachable(); }
  // One line for /readyz.
  std::string ReadyText() const;
  // Prometheus text: kvtier_cluster_* gauges and counters.
  std::string RenderPrometheus() const;
  uint16_t peer_port() const { return server_->port(); }
  const std::string& node_id() const { return node_id_; }
  std::shared_ptr<const cluster::MemberView> view() const { return membership_->View(); }
  cluster::MembershipStats membership_stats() const { return membership_->Stats(); }

 private:
  ClusterNode() = default;
  class StoreHandler;
  std::string node_id_;
  std::unique_ptr<cluster::RecentDeletes> recent_deletes_;  // the handler and router note here
  std::unique_ptr<StoreHandler> handler_;
  // [cluster] peer_data_transport "tcp_region" / "verbs": this node's staging region (started
  // before the peer front, which hands it GET_STAGED) and the reader side the router uses.
  std::unique_ptr<cluster::StagingServer> staging_;
  std::unique_ptr<cluster::StagedFetcher> staged_fetcher_;
  std::unique_ptr<cluster::PeerServer> server_;
  std::unique_ptr<cluster::PeerClient> client_;
  std::unique_ptr<cluster::EtcdClient> etcd_;  // for the tombstone log
  std::unique_ptr<cluster::TombstoneLog> tombstones_;
  std::unique_ptr<cluster::PauseGuard> pause_guard_;  // catches up on tombstones_
  std::unique_ptr<cluster::Membership> membership_;
  std::unique_ptr<cluster::Router> router_;
  std::unique_ptr<ClusterCopies> copies_;  // [cluster] get_copy_bytes_max > 0
  std::unique_ptr<ClusterRepair> repair_;  // started after the router, stopped first
  // Rewrites units quarantined here for a checksum failure from another owner; fed by the
  // store's listener, which Stop removes first.
  std::unique_ptr<ClusterRefetch> refetch_;
  // Asks every member for its clock ([cluster] clock_sample_interval_ms), for /metrics.
  std::unique_ptr<cluster::PeerClocks> clocks_;
  Service* service_ = nullptr;
  bool stopped_ = false;
};

// "host:port" of this node's HTTP admin front as peers and `kvtier cluster status` dial it
// (server.http_listen, or peer_advertise's host when that listens on every address); "" when
// the admin front is off.
std::string AdminEndpoint(const DaemonOptions& options);

// Reads a cluster credential file: its bytes, trailing newline(s) stripped; at least
// cluster::kCredentialBytesMin, at most kCredentialBytesMax.
StatusOr<std::vector<uint8_t>> ReadCredentialFile(const std::string& path);

}  // namespace kvtier::daemon
