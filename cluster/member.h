// MemberInfo: what one kvtierd publishes about itself in etcd (the value of its membership
// key), and its JSON encoding. A member's record is hostile input to every other node: Decode
// checks every field and its length.
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvtier::cluster {

inline constexpr size_t kNodeIdBytesMax = 64;          // [A-Za-z0-9._-], not empty
inline constexpr size_t kFailureDomainBytesMax = 64;   // same charset; "" = its own domain
inline constexpr size_t kPeerEndpointBytesMax = 256;   // "host:port"
inline constexpr size_t kMemberRecordBytesMax = 4096;  // one encoded record

struct MemberInfo {
  std::string node_id;         // unique in the cluster
  std::string peer_endpoint;   // "host:port" where peers reach its native peer front
  std::string failure_domain;  // rack / zone label; owners of a unit avoid sharing one
  // "host:port" of its HTTP admin front (/readyz, /metrics) for `kvtier cluster status`;
  // "" when it has none, and in records written before the field existed.
  std::string admin_endpoint;
  uint64_t dram_bytes = 0;  // per-tier capacity, the placement weight
  uint64_t ssd_bytes = 0;
  bool draining = false;  // `kvtier cluster drain`: owns nothing new, still serves
  // Keeps copies of units it fetched for a GET ([cluster] get_copy_bytes_max > 0): a PUT
  // through any node tells it to drop its copy of the key (docs/CLUSTER.md, "Copies"). Optional in
  // the record (false when absent).
  bool keeps_copies = false;
  // Placement weight: the capacity in GiB (at least 1/1024 so a tiny node is still placed);
  // 0 while draining.
  double Weight() const;
  bool operator==(const MemberInfo&) const = default;
};

// InvalidArgument naming the bad field.
Status ValidateNodeId(std::string_view node_id);
Status ValidateMember(const MemberInfo& member);
std::string EncodeMember(const MemberInfo& member);
// Corruption for a record that is not JSON of the expected shape, over
// kMemberRecordBytesMax, or that fails ValidateMember.
StatusOr<MemberInfo> DecodeMember(std::string_view text);

}  // namespace kvtier::cluster
