// kvtier cluster status: the membership of a kvtier cluster as etcd holds it, and each live
// member's share of ownership under cluster/placement.
//
//   kvtier cluster status --etcd 127.0.0.1:2379[,URL...] [--prefix /kvtier/] [--json]
//
// Reads <prefix>members/ once (cluster/etcd_client), decodes every record with DecodeMember
// (a record that does not decode is listed as bad, never trusted) and asks etcd how long each
// record's lease has left. Ownership shares are computed, not measured: PlaceOwners over
// kOwnershipSampleKeys synthetic keys (SHA-256 of "kvtier-cluster-status-<i>") with
// --replicas owners each; a member's share is the owner slots it gets divided by all owner
// slots, so shares sum to 1 and follow the capacity weights (MemberInfo::Weight).
//
// Exit codes: 0 printed, 1 etcd unreachable or answered an error, 2 bad flags.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "cli/flags.h"
#include "cluster/etcd_client.h"
#include "cluster/member.h"
#include "cluster/membership.h"
#include "cluster/placement.h"
#include "common/key_spec.h"

namespace kvtier::cli {
namespace {

constexpr uint64_t kOwnershipSampleKeys = 4096;
// Records read (and lease lookups made) at most; the daemons' [cluster] members_max default.
constexpr int64_t kMembersListedMax = 1024;

struct MemberRow {
  std::string key;  // etcd key
  cluster::MemberInfo info;
  Status decode = Status::Ok();
  int64_t lease = 0;
  int64_t ttl_left_s = -1;  // -1: unknown (no lease, or the lookup failed)
  uint64_t owner_slots = 0;
};

// Owner slots per decoded member (rows with decode.ok()), over the fixed synthetic sample.
void ComputeShares(std::vector<MemberRow>* rows, uint32_t replicas) {
  std::vector<cluster::MemberInfo> members;
  std::vector<size_t> row_of;
  for (size_t i = 0; i < rows->size(); ++i) {
    if ((*rows)[i].decode.ok()) {
      members.push_back((*rows)[i].info);
      row_of.push_back(i);
    }
  }
  for (uint64_t k = 0; k < kOwnershipSampleKeys; ++k) {
    std::string seed = "kvtier-cluster-status-" + std::to_string(k);
    Digest key = Sha256(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(seed.data()), seed.size()));
    std::string_view key_view(reinterpret_cast<const char*>(key.data()), key.size());
    for (size_t owner : cluster::PlaceOwners(key_view, members, replicas)) {
      ++(*rows)[row_of[owner]].owner_slots;
    }
  }
}

int RunStatus(Args args) {
  FlagSet flags(
      "kvtier cluster status",
      "Print the members of a kvtier cluster as registered in etcd (node id, peer endpoint, "
      "failure domain, DRAM and SSD capacity, draining, seconds left on the member's etcd "
      "lease) and each member's share of ownership. The share is computed, not measured: "
      "cluster placement (weighted rendezvous hashing, weight = capacity) over " +
          std::to_string(kOwnershipSampleKeys) +
          " fixed synthetic keys with --replicas owners each; a member's share is its owner "
          "slots over all owner slots, so the shares sum to 1. Exit 1 when etcd cannot be "
          "read.");
  std::string etcd, prefix = "/kvtier/";
  uint64_t replicas = 2, timeout_ms = 2000;
  bool json = false;
  flags.String("etcd", &etcd, "URL[,URL]",
               "etcd endpoints, host:port or http://host:port, tried in order", true);
  flags.String("prefix", &prefix, "P", "the cluster's key prefix in etcd ([cluster] key_prefix)");
  flags.Uint("replicas", &replicas,
             "owners per unit used for the share computation (the daemons' [cluster] replicas)",
             false, 1, 16);
  flags.Uint("timeout-ms", &timeout_ms, "deadline of each etcd request", false, 1, 60000);
  flags.Bool("json", &json, "print JSON instead of text");
  if (int rc = flags.Parse(args); rc >= 0) return rc;

  cluster::EtcdOptions options{.endpoints = SplitComma(etcd), .request_timeout_ms = timeout_ms};
  cluster::MembershipOptions check;
  check.etcd = options;
  check.key_prefix = prefix;
  check.self.node_id = "status";
  check.self.peer_endpoint = "127.0.0.1:1";
  if (Status st = cluster::ValidateMembershipOptions(check); !st.ok()) {
    std::fprintf(stderr, "kvtier cluster status: %s\n", st.ToString().c_str());
    return 2;
  }
  cluster::EtcdClient client(options);
  const std::string members_prefix = prefix + "members/";
  auto range = client.RangePrefix(members_prefix, kMembersListedMax + 1);
  if (!range.ok()) {
    std::fprintf(stderr, "kvtier cluster status: cannot read %s from etcd (%s): %s\n",
                 members_prefix.c_str(), etcd.c_str(), range.status().ToString().c_str());
    return 1;
  }
  const bool truncated = range->kvs.size() > static_cast<size_t>(kMembersListedMax);
  if (truncated) range->kvs.resize(kMembersListedMax);
  std::vector<MemberRow> rows;
  for (const cluster::EtcdKeyValue& kv : range->kvs) {
    MemberRow row{.key = kv.key, .lease = kv.lease};
    auto info = cluster::DecodeMember(kv.value);
    if (info.ok() && info->node_id != kv.key.substr(members_prefix.size())) {
      info = Status::Corruption("node id does not match its key");
    }
    if (info.ok()) {
      row.info = *info;
    } else {
      row.decode = info.status();
    }
    if (kv.lease != 0) {
      auto ttl = client.LeaseTimeToLive(kv.lease);
      if (ttl.ok()) row.ttl_left_s = *ttl;
    }
    rows.push_back(std::move(row));
  }
  ComputeShares(&rows, static_cast<uint32_t>(replicas));
  uint64_t slots = 0;
  for (const MemberRow& r : rows) slots += r.owner_slots;
  auto share = [&](const MemberRow& r) {
    return slots == 0 ? 0.0 : static_cast<double>(r.owner_slots) / static_cast<double>(slots);
  };

  if (json) {
    nlohmann::ordered_json j;
    j["etcd"] = etcd;
    j["prefix"] = prefix;
    j["revision"] = range->revision;
    j["replicas"] = replicas;
    j["sample_keys"] = kOwnershipSampleKeys;
    j["truncated"] = truncated;  // more than kMembersListedMax records: the first ones shown
    j["members"] = nlohmann::ordered_json::array();
    j["bad_records"] = nlohmann::ordered_json::array();
    for (const MemberRow& r : rows) {
      if (!r.decode.ok()) {
        j["bad_records"].push_back(
            {{"key", r.key.substr(0, members_prefix.size() + cluster::kNodeIdBytesMax)},
             {"error", r.decode.ToString()}});
        continue;
      }
      nlohmann::ordered_json m;
      m["node_id"] = r.info.node_id;
      m["peer_endpoint"] = r.info.peer_endpoint;
      m["failure_domain"] = r.info.failure_domain;
      m["dram_bytes"] = r.info.dram_bytes;
      m["ssd_bytes"] = r.info.ssd_bytes;
      m["draining"] = r.info.draining;
      m["weight"] = r.info.Weight();
      m["lease_ttl_left_s"] =
          r.ttl_left_s >= 0 ? nlohmann::ordered_json(r.ttl_left_s) : nlohmann::ordered_json();
      m["owner_slots"] = r.owner_slots;
      m["ownership_share"] = share(r);
      j["members"].push_back(std::move(m));
    }
    // Key bytes are hostile: dump with invalid UTF-8 replaced, never thrown on.
    std::printf("%s\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  std::printf("etcd %s  prefix %s  revision %lld  replicas %llu\n", etcd.c_str(), prefix.c_str(),
              static_cast<long long>(range->revision), static_cast<unsigned long long>(replicas));
  std::printf("%-20s %-22s %-12s %12s %14s %-8s %9s %7s\n", "NODE", "PEER", "DOMAIN", "DRAM_BYTES",
              "SSD_BYTES", "DRAINING", "LEASE_S", "SHARE");
  size_t good = 0;
  for (const MemberRow& r : rows) {
    if (!r.decode.ok()) continue;
    ++good;
    std::string ttl = r.ttl_left_s >= 0 ? std::to_string(r.ttl_left_s) : "-";
    std::printf("%-20s %-22s %-12s %12llu %14llu %-8s %9s %7.4f\n", r.info.node_id.c_str(),
                r.info.peer_endpoint.c_str(),
                r.info.failure_domain.empty() ? "-" : r.info.failure_domain.c_str(),
                static_cast<unsigned long long>(r.info.dram_bytes),
                static_cast<unsigned long long>(r.info.ssd_bytes), r.info.draining ? "yes" : "no",
                ttl.c_str(), share(r));
  }
  if (truncated) {
    std::printf("more than %lld records: the first %lld (in key order) shown\n",
                static_cast<long long>(kMembersListedMax),
                static_cast<long long>(kMembersListedMax));
  }
  std::printf("%zu member(s); shares over %llu synthetic keys\n", good,
              static_cast<unsigned long long>(kOwnershipSampleKeys));
  for (const MemberRow& r : rows) {
    if (r.decode.ok()) continue;
    std::printf("bad record (ignored by every node): %s\n", r.decode.ToString().c_str());
  }
  return 0;
}

}  // namespace

int RunCluster(Args args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::FILE* out = args.empty() ? stderr : stdout;
    std::fprintf(out,
                 "usage: kvtier cluster status --etcd URL[,URL] [flags]   "
                 "(kvtier cluster status --help)\n");
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "status") return RunStatus(args.subspan(1));
  std::fprintf(stderr, "kvtier cluster: unknown subcommand '%.*s' (want: status)\n",
               static_cast<int>(args[0].size()), args[0].data());
  return 2;
}

}  // namespace kvtier::cli
