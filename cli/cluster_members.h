// What the `kvtier cluster` subcommands share: the member records as etcd holds them, and the
// subcommands' entry points (dispatched by RunCluster in cmd_cluster.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cluster/etcd_client.h"
#include "cluster/member.h"
#include "common/status.h"

namespace kvtier::cli {

// Records read (and lease lookups made) at most; the daemons' [cluster] members_max default.
inline constexpr int64_t kMembersListedMax = 1024;

struct MemberRecord {
  std::string key;  // etcd key
  cluster::MemberInfo info;
  Status decode = Status::Ok();  // why the record is not trusted (info then unset)
  int64_t lease = 0;
};

struct MemberList {
  std::vector<MemberRecord> records;
  int64_t revision = 0;    // etcd's revision of the read
  bool truncated = false;  // more than kMembersListedMax records: the first ones kept
};

// Reads <prefix>members/ once and decodes every record with DecodeMember: a record that does
// not decode, or whose node id is not its key's, keeps its error in `decode` (listed as bad,
// never trusted). Errors: etcd's, as EtcdClient::RangePrefix gives them.
StatusOr<MemberList> ReadMembers(cluster::EtcdClient& client, const std::string& prefix);

// The --etcd / --prefix / --timeout-ms flags as one EtcdOptions, checked as a daemon checks its
// [cluster] section (InvalidArgument).
StatusOr<cluster::EtcdOptions> EtcdFlags(const std::string& etcd, const std::string& prefix,
                                         uint64_t timeout_ms);

int RunClusterWhere(Args args);  // cmd_cluster_where.cc: `cluster where`

}  // namespace kvtier::cli
