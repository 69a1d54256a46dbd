// GET /v1/cluster (docs/OPERATIONS.md "Cluster on the dashboard"): the cluster as this node
// sees it, for the dashboard and for scripts.
//
// {"clustered": false} without [cluster]; otherwise
// {"clustered": true, "node_id", "etcd_reachable", "registered", "view_revision",
//  "members": [{"node_id", "peer_endpoint", "failure_domain", "dram_bytes", "ssd_bytes",
//               "draining", "self"}],
//  "metrics": {"<name>{<labels>}": {"type": "gauge"|"counter", "value": number}}}
// where "metrics" holds every kvtier_cluster_* sample of the node's /metrics, read from its
// Prometheus text (ClusterNode::RenderPrometheus), so series added there appear here with no
// change. Members are at most MembershipOptions::members_max (1024); samples at most
// kClusterJsonSamplesMax.
//
// Thread safety: as ClusterNode (any thread).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kvtier::daemon {

class ClusterNode;

inline constexpr size_t kClusterJsonSamplesMax = 4096;

// node may be null (not clustered).
std::string ClusterJson(const ClusterNode* node);

// The kvtier_cluster_* samples of a Prometheus text page as the "metrics" object above
// (exposed for tests). Lines that are not samples of a kvtier_cluster_* family are skipped.
std::string ClusterMetricsJson(std::string_view prometheus_text);

}  // namespace kvtier::daemon
