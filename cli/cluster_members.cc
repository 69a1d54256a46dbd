#include "cli/cluster_members.h"

#include <utility>

#include "cli/flags.h"
#include "cluster/membership.h"

namespace kvtier::cli {

StatusOr<MemberList> ReadMembers(cluster::EtcdClient& client, const std::string& prefix) {
  const std::string members_prefix = prefix + "members/";
  auto range = client.RangePrefix(members_prefix, kMembersListedMax + 1);
  if (!range.ok()) return range.status();
  MemberList list;
  list.revision = range->revision;
  list.truncated = range->kvs.size() > static_cast<size_t>(kMembersListedMax);
  if (list.truncated) range->kvs.resize(kMembersListedMax);
  for (const cluster::EtcdKeyValue& kv : range->kvs) {
    MemberRecord r{.key = kv.key, .lease = kv.lease};
    auto info = cluster::DecodeMember(kv.value);
    if (info.ok() && info->node_id != kv.key.substr(members_prefix.size())) {
      info = Status::Corruption("node id does not match its key");
    }
    if (info.ok()) {
      r.info = std::move(*info);
    } else {
      r.decode = info.status();
    }
    list.records.push_back(std::move(r));
  }
  return list;
}

StatusOr<cluster::EtcdOptions> EtcdFlags(const std::string& etcd, const std::string& prefix,
                                         uint64_t timeout_ms) {
  cluster::EtcdOptions options{.endpoints = SplitComma(etcd), .request_timeout_ms = timeout_ms};
  KVTIER_RETURN_IF_ERROR(cluster::ValidateEtcdOptions(options));
  KVTIER_RETURN_IF_ERROR(cluster::ValidateKeyPrefix(prefix));
  return options;
}

}  // namespace kvtier::cli
