// [cluster]: kvtierd as one node of a cluster coordinated through etcd (docs/CLUSTER.md).
// Absent or enabled = false: the daemon is a single node, exactly as without this section.
//
// Thread safety: plain values; the functions are not thread-safe on one object.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvtier::daemon {

struct ClusterServeOptions {
  bool enabled = false;
  std::vector<std::string> etcd_endpoints;     // "host:port" / "http://host:port", 1..16
  std::string key_prefix = "/kvtier/";         // one cluster's keys in etcd; ends in '/'
  std::string node_id;                         // unique in the cluster, [A-Za-z0-9._-]{1,64}
  std::string peer_listen = "127.0.0.1:7400";  // the peer front, numeric "host:port"
  std::string peer_advertise;                  // what peers dial; "" -> peer_listen
  std::string failure_domain;                  // rack / zone label; "" = a domain of its own
  uint32_t replicas = 2;                       // owners per unit (R), 1..16
  uint32_t write_acks = 0;          // owners that must acknowledge a PUT; 0: all live owners
  std::string credential_file;      // shared secret of the cluster (>= 32 bytes), mode 0600
  uint32_t lease_ttl_s = 10;        // a silent node is gone after this long, 2..3600
  uint64_t etcd_timeout_ms = 2000;  // one etcd request
  uint64_t peer_timeout_ms = 2000;  // one peer request, connect included
  // A peer whose call timed out is probed this often; meanwhile calls to it fail at once
  // (cluster/peer_health.h). 0: off (every call waits peer_timeout_ms). 0 or 10..60000.
  uint64_t peer_probe_interval_ms = 500;
  // Every member's clock is asked for this often, and its offset from ours shown on /metrics
  // (cluster/peer_clocks.h). 0: off. 0 or 1000..3600000.
  uint64_t clock_sample_interval_ms = 10000;
  uint32_t peer_connections_max = 64;  // inbound peer connections at once
  uint32_t peer_call_threads = 16;     // outbound peer calls in flight at once, 1..1024
  uint32_t peer_call_queue_max = 256;  // more waiting for a thread; past it refused, 0..65536
  uint32_t tombstone_ttl_s = 86400;    // deletes are kept for nodes that missed them, 60..2^31
  uint64_t repair_bytes_per_s = 64ull << 20;  // re-replication / move copy budget, 1 KiB/s..
  uint64_t repair_retry_ms = 1000;            // rescan after a repair scan that left work
  uint32_t repair_interval_s = 300;           // full repair scan period, 1..86400
  // Copies of units this node fetched from their owners for a GET, kept in its own DRAM
  // tier and served locally (docs/CLUSTER.md, "Copies"). 0: none (the default). At most
  // 2^40 bytes; each copy expires get_copy_ttl_ms after it was fetched (1000..3600000).
  uint64_t get_copy_bytes_max = 0;
  uint64_t get_copy_ttl_ms = 60000;
  bool draining = false;  // join owning nothing (routing-only; `kvtier cluster drain --undo`)
  // Mutual TLS on peer traffic (both the peer front and this node's calls to peers). Every
  // node presents peer_tls_cert_file (leaf first; for both serverAuth and clientAuth) and
  // accepts only peers whose certificate chains to peer_tls_ca_file; the cluster credential
  // is still required inside TLS. Every node of a cluster must agree on peer_tls.
  bool peer_tls = false;
  std::string peer_tls_cert_file, peer_tls_key_file, peer_tls_ca_file;  // PEM, all required
  bool peer_tls_verify_hostname = true;  // the peer's certificate must name its endpoint's host
  // How a GET moves a remote unit's bytes (docs/CLUSTER.md, "Bulk data over the region
  // transport"): "peer" (the default: in the GET reply), "tcp_region" (the owner stages it
  // in its staging region, read with rdma::TcpTransport) or "verbs" (read by RDMA READ;
  // refused at start without an RDMA device). With "tcp_region" or "verbs" this node also
  // exports its own staging region: peer_staging_ring_bytes of memory, served on
  // peer_host:peer_region_port (0: any free port; peers learn it in each reply), with grants
  // to peer nodes that expire after peer_staging_grant_ttl_ms. Not with peer_tls (the
  // region transport is not encrypted).
  std::string peer_data_transport = "peer";
  uint64_t peer_staging_ring_bytes = 64ull << 20;  // 64 KiB..64 GiB, a multiple of 4096
  uint64_t peer_staging_grant_ttl_ms = 60000;      // 1000..86400000
  uint16_t peer_region_port = 0;

  // Filled by FinalizeCluster.
  std::string peer_host;
  uint16_t peer_port = 0;
};

// Checks ranges and requirements when enabled (etcd_endpoints, node_id, credential_file are
// required; peer_listen numeric; replicas 1..16; write_acks <= replicas; the three peer_tls
// files with peer_tls; ...) and fills the
// derived fields. auth_enabled: with auth off the peer front must be on loopback
// (PermissionDenied otherwise), like every other front.
Status FinalizeCluster(ClusterServeOptions* o, bool auth_enabled);

}  // namespace kvtier::daemon
