// kvtier cluster status: the membership of a kvtier cluster as etcd holds it, and each live
// member's share of ownership under cluster/placement.
//
//   kvtier cluster status --etcd 127.0.0.1:2379[,URL...] [--prefix /kvtier/] [--json]
//   kvtier cluster drain NODE --etcd 127.0.0.1:2379[,URL...] [--prefix /kvtier/] [--undo]
//   (kvtier cluster where: cmd_cluster_where.cc)
//
// Reads <prefix>members/ once (cluster/etcd_client), decodes every record with DecodeMember
// (a record that does not decode is listed as bad, never trusted) and asks etcd how long each
// record's lease has left. Ownership shares are computed, not measured: PlaceOwners over
// kOwnershipSampleKeys synthetic keys (SHA-256 of "kvtier-cluster-status-<i>") with
// --replicas owners each; a member's share is the owner slots it gets divided by all owner
// slots, so shares sum to 1 and follow the capacity weights (MemberInfo::Weight).
//
// Exit codes: 0 printed, 1 etcd unreachable or answered an error, 2 bad flags.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cli/cluster_members.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "cluster/etcd_client.h"
#include "cluster/http_client.h"
#include "cluster/member.h"
#include "cluster/membership.h"
#include "cluster/placement.h"
#include "common/json_text.h"
#include "common/key_spec.h"

namespace kvtier::cli {
namespace {

constexpr uint64_t kOwnershipSampleKeys = 4096;

// Members queried at once for their health (each query is two short HTTP GETs).
constexpr size_t kHealthQueriesParallelMax = 32;
// A member's /metrics page read at most (hostile input: a member is only as trusted as etcd).
constexpr uint64_t kMetricsPageBytesMax = 4ull << 20;
// Suspect peers, and peers' clock offsets, read from one member's page at most (kvtierd
// exports at most 64 of each).
constexpr size_t kSuspectsPerMemberMax = 64;
constexpr size_t kClocksPerMemberMax = 64;

// What a member's admin front says about it: /readyz and the repair gauges of /metrics.
struct Health {
  bool queried = false;  // it has an admin endpoint and was asked
  bool ready = false;    // /readyz answered 200
  std::string error;     // why it could not be asked ("" when it answered)
  double under_replicated = -1, moves = -1, done = -1, active = -1;  // -1: not exported
  // kvtier_cluster_peer_answers_held: 1 while the member serves no read from its store after
  // a pause of its process, until its tombstone catch-up (-1: not exported).
  double held = -1;
  // Peer endpoints this member suspects (kvtier_cluster_peer_suspect_seconds: a call to the
  // peer timed out and nothing has answered since), at most kSuspectsPerMemberMax.
  std::vector<std::string> suspects;
  // Each peer's clock minus this member's, in seconds, by peer node id
  // (kvtier_cluster_peer_clock_offset_seconds), at most kClocksPerMemberMax.
  std::map<std::string, double> clock_offsets_s;
  // Share of the current repair scan's work done: done / (done + under + moves); 1 when idle.
  double Progress() const {
    double total = std::max(done, 0.0) + std::max(under_replicated, 0.0) + std::max(moves, 0.0);
    return total <= 0 ? 1.0 : std::max(done, 0.0) / total;
  }
};

// The value of an unlabelled sample `name` in a Prometheus text page, -1 when absent.
double MetricValue(const std::string& page, const std::string& name) {
  std::string needle = "\n" + name + " ";
  size_t at = page.find(needle);
  if (at == std::string::npos) return -1;
  const char* begin = page.c_str() + at + needle.size();
  char* end = nullptr;
  double v = std::strtod(begin, &end);
  return end == begin || !(v >= 0) ? -1 : v;
}

// The peer label and value of every `<name>{peer="..."} <value>` sample of a page (label
// escapes \\, \" and \n undone), at most max; a malformed sample (no closing quote, no
// finite value) is skipped.
std::vector<std::pair<std::string, double>> PeerSamples(const std::string& page,
                                                        const std::string& name, size_t max) {
  const std::string needle = "\n" + name + "{peer=\"";
  std::vector<std::pair<std::string, double>> out;
  for (size_t at = page.find(needle); at != std::string::npos && out.size() < max;
       at = page.find(needle, at + 1)) {
    std::string peer;
    size_t i = at + needle.size();
    bool closed = false;
    for (; i < page.size() && page[i] != '\n'; ++i) {
      if (page[i] == '"') {
        closed = true;
        break;
      }
      if (page[i] == '\\' && i + 1 < page.size()) {
        ++i;
        peer += page[i] == 'n' ? '\n' : page[i];
      } else {
        peer += page[i];
      }
    }
    if (!closed || page.compare(i, 3, "\"} ") != 0) continue;
    const char* begin = page.c_str() + i + 3;
    char* end = nullptr;
    const double v = std::strtod(begin, &end);
    if (end == begin || !std::isfinite(v)) continue;
    out.emplace_back(std::move(peer), v);
  }
  return out;
}

Health QueryHealth(const std::string& admin_endpoint, uint64_t timeout_ms) {
  Health h;
  if (admin_endpoint.empty()) {
    h.error = "no admin endpoint in its record";
    return h;
  }
  h.queried = true;
  auto ep = cluster::ParseHttpEndpoint(admin_endpoint);
  if (!ep.ok()) {
    h.error = ep.status().message();
    return h;
  }
  cluster::HttpLimits limits{.timeout_ms = timeout_ms, .body_bytes_max = kMetricsPageBytesMax};
  auto ready = cluster::HttpGet(*ep, "/readyz", limits);
  if (!ready.ok()) {
    h.error = ready.status().ToString();
    return h;
  }
  h.ready = ready->status == 200;
  auto metrics = cluster::HttpGet(*ep, "/metrics", limits);
  if (!metrics.ok() || metrics->status != 200) return h;  // health known, repair state not
  const std::string page = "\n" + metrics->body;
  h.under_replicated = MetricValue(page, "kvtier_cluster_under_replicated_units");
  h.held = MetricValue(page, "kvtier_cluster_peer_answers_held");
  h.moves = MetricValue(page, "kvtier_cluster_moves_in_progress");
  h.done = MetricValue(page, "kvtier_cluster_repair_done_units");
  h.active = MetricValue(page, "kvtier_cluster_repair_active");
  for (auto& [peer, seconds] :
       PeerSamples(page, "kvtier_cluster_peer_suspect_seconds", kSuspectsPerMemberMax)) {
    h.suspects.push_back(std::move(peer));
  }
  for (auto& [peer, seconds] :
       PeerSamples(page, "kvtier_cluster_peer_clock_offset_seconds", kClocksPerMemberMax)) {
    h.clock_offsets_s.emplace(std::move(peer), seconds);
  }
  return h;
}

// "[#####-----]  50%" for a fraction in [0, 1].
std::string ProgressBar(double fraction) {
  constexpr int kWidth = 20;
  fraction = std::clamp(fraction, 0.0, 1.0);
  int filled = static_cast<int>(fraction * kWidth + 0.5);
  char pct[8];
  std::snprintf(pct, sizeof(pct), "%3d%%", static_cast<int>(fraction * 100 + 0.5));
  return "[" + std::string(filled, '#') + std::string(kWidth - filled, '-') + "] " + pct;
}

struct MemberRow : MemberRecord {
  int64_t ttl_left_s = -1;  // -1: unknown (no lease, or the lookup failed)
  uint64_t owner_slots = 0;
  Health health;
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
          "slots over all owner slots, so the shares sum to 1. Each member's health is asked of "
          "the admin endpoint in its record (GET /readyz: ready, NOT-READY or unreachable) and "
          "HELD when it is ready but serves no read from its store after a pause of its process, "
          "until it caught up on deletes it may have missed; "
          "its repair state read from its /metrics: UNDER (units it must copy that an owner "
          "still lacks), MOVES (units it holds but no longer owns) and a progress bar of its "
          "current repair scan. SUSPECTED counts the other members whose last call to this "
          "member's peer endpoint timed out with no answer since (their "
          "kvtier_cluster_peer_suspect_seconds): a member that is ready but suspected does not "
          "answer its peers (a partition between nodes, a hung peer front). CLOCK_S is the "
          "member's clock minus its closest peer's, in seconds, from the clock offsets the other "
          "members export (kvtier_cluster_peer_clock_offset_seconds): a member whose clock is off "
          "shows it there. Exit 1 when etcd cannot be read.");
  std::string etcd, prefix = "/kvtier/";
  uint64_t replicas = 2, timeout_ms = 2000, health_timeout_ms = 500;
  bool json = false, no_health = false;
  flags.String("etcd", &etcd, "URL[,URL]",
               "etcd endpoints, host:port or http://host:port, tried in order", true);
  flags.String("prefix", &prefix, "P", "the cluster's key prefix in etcd ([cluster] key_prefix)");
  flags.Uint("replicas", &replicas,
             "owners per unit used for the share computation (the daemons' [cluster] replicas)",
             false, 1, 16);
  flags.Uint("timeout-ms", &timeout_ms, "deadline of each etcd request", false, 1, 60000);
  flags.Bool("json", &json, "print JSON instead of text");
  flags.Uint("health-timeout-ms", &health_timeout_ms,
             "deadline of each member's /readyz and /metrics query", false, 1, 60000);
  flags.Bool("no-health", &no_health, "do not query the members' admin fronts");
  if (int rc = flags.Parse(args); rc >= 0) return rc;

  auto options = EtcdFlags(etcd, prefix, timeout_ms);
  if (!options.ok()) {
    std::fprintf(stderr, "kvtier cluster status: %s\n", options.status().ToString().c_str());
    return 2;
  }
  cluster::EtcdClient client(*options);
  const std::string members_prefix = prefix + "members/";
  auto list = ReadMembers(client, prefix);
  if (!list.ok()) {
    std::fprintf(stderr, "kvtier cluster status: cannot read %s from etcd (%s): %s\n",
                 members_prefix.c_str(), etcd.c_str(), list.status().ToString().c_str());
    return 1;
  }
  const bool truncated = list->truncated;
  std::vector<MemberRow> rows;
  for (MemberRecord& record : list->records) {
    MemberRow row;
    static_cast<MemberRecord&>(row) = std::move(record);
    if (row.lease != 0) {
      auto ttl = client.LeaseTimeToLive(row.lease);
      if (ttl.ok()) row.ttl_left_s = *ttl;
    }
    rows.push_back(std::move(row));
  }
  ComputeShares(&rows, static_cast<uint32_t>(replicas));
  if (!no_health) {
    for (size_t first = 0; first < rows.size(); first += kHealthQueriesParallelMax) {
      std::vector<std::future<Health>> queries;
      size_t last = std::min(rows.size(), first + kHealthQueriesParallelMax);
      for (size_t i = first; i < last; ++i) {
        queries.push_back(std::async(std::launch::async, QueryHealth,
                                     rows[i].decode.ok() ? rows[i].info.admin_endpoint : "",
                                     health_timeout_ms));
      }
      for (size_t i = first; i < last; ++i) rows[i].health = queries[i - first].get();
    }
  }
  uint64_t slots = 0;
  for (const MemberRow& r : rows) slots += r.owner_slots;
  auto share = [&](const MemberRow& r) {
    return slots == 0 ? 0.0 : static_cast<double>(r.owner_slots) / static_cast<double>(slots);
  };
  // Other members that suspect r's peer endpoint (-1: no other member's page was read), from
  // one pass over every page read: endpoint -> members naming it.
  auto page_read = [](const MemberRow& o) {
    return o.decode.ok() && o.health.queried && o.health.error.empty();
  };
  std::map<std::string, int64_t> suspected_count;
  int64_t pages_read = 0;
  for (const MemberRow& o : rows) {
    if (!page_read(o)) continue;
    ++pages_read;
    // Once per member (a page naming a peer twice counts once), never itself.
    const std::set<std::string> named(o.health.suspects.begin(), o.health.suspects.end());
    for (const std::string& peer : named) {
      if (peer != o.info.peer_endpoint) ++suspected_count[peer];
    }
  }
  auto suspected_by = [&](const MemberRow& r) -> int64_t {
    if (pages_read - (page_read(r) ? 1 : 0) == 0) return -1;
    auto it = suspected_count.find(r.info.peer_endpoint);
    return it == suspected_count.end() ? 0 : it->second;
  };
  // r's clock minus its closest peer's, in seconds: of the offsets other members read for r
  // (their kvtier_cluster_peer_clock_offset_seconds{peer=r}, peer's clock minus theirs), the
  // one nearest 0. A member whose clock is off is off against every other, so its value is
  // large; with two or more members whose clocks agree, theirs stay near 0. nullopt: no other
  // member's page named r.
  auto clock_offset = [&](const MemberRow& r) -> std::optional<double> {
    std::optional<double> best;
    for (const MemberRow& o : rows) {
      if (&o == &r || !page_read(o)) continue;
      auto it = o.health.clock_offsets_s.find(r.info.node_id);
      if (it == o.health.clock_offsets_s.end()) continue;
      if (!best || std::abs(it->second) < std::abs(*best)) best = it->second;
    }
    return best;
  };

  if (json) {
    nlohmann::ordered_json j;
    j["etcd"] = etcd;
    j["prefix"] = prefix;
    j["revision"] = list->revision;
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
      m["admin_endpoint"] = r.info.admin_endpoint;
      if (!no_health) {
        const Health& h = r.health;
        auto num = [](double v) {
          return v >= 0 ? nlohmann::ordered_json(static_cast<uint64_t>(v))
                        : nlohmann::ordered_json();
        };
        nlohmann::ordered_json health;
        health["ready"] =
            h.error.empty() ? nlohmann::ordered_json(h.ready) : nlohmann::ordered_json();
        health["answers_held"] =
            h.held >= 0 ? nlohmann::ordered_json(h.held > 0) : nlohmann::ordered_json();
        health["error"] =
            h.error.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(h.error);
        health["under_replicated_units"] = num(h.under_replicated);
        health["moves_in_progress"] = num(h.moves);
        health["repair_done_units"] = num(h.done);
        health["repair_active"] =
            h.active >= 0 ? nlohmann::ordered_json(h.active > 0) : nlohmann::ordered_json();
        health["repair_progress"] = h.Progress();
        health["suspects"] = h.suspects;
        const int64_t by = suspected_by(r);
        health["suspected_by"] = by >= 0 ? nlohmann::ordered_json(by) : nlohmann::ordered_json();
        const std::optional<double> clock = clock_offset(r);
        health["clock_offset_s"] =
            clock ? nlohmann::ordered_json(*clock) : nlohmann::ordered_json();
        health["peer_clock_offsets_s"] = nlohmann::ordered_json(h.clock_offsets_s);
        m["health"] = std::move(health);
      }
      j["members"].push_back(std::move(m));
    }
    // Key bytes are hostile: JsonText replaces invalid UTF-8 rather than throwing.
    std::printf("%s\n", JsonText(j, 2).c_str());
    return 0;
  }
  std::printf("etcd %s  prefix %s  revision %lld  replicas %llu\n", etcd.c_str(), prefix.c_str(),
              static_cast<long long>(list->revision), static_cast<unsigned long long>(replicas));
  std::printf("%-20s %-22s %-12s %12s %14s %-8s %9s %7s %-11s %9s %9s %7s %7s %s\n", "NODE", "PEER",
              "DOMAIN", "DRAM_BYTES", "SSD_BYTES", "DRAINING", "LEASE_S", "SHARE", "HEALTH",
              "SUSPECTED", "CLOCK_S", "UNDER", "MOVES", "REPAIR");
  uint64_t total_under = 0, total_moves = 0;
  size_t good = 0;
  for (const MemberRow& r : rows) {
    if (!r.decode.ok()) continue;
    ++good;
    std::string ttl = r.ttl_left_s >= 0 ? std::to_string(r.ttl_left_s) : "-";
    const Health& h = r.health;
    std::string health = no_health || !h.queried ? "-"
                         : !h.error.empty()      ? "unreachable"
                         : !h.ready              ? "NOT-READY"
                         : h.held > 0            ? "HELD"
                                                 : "ready";
    auto count = [](double v) { return v >= 0 ? std::to_string(static_cast<uint64_t>(v)) : "-"; };
    std::string bar = h.under_replicated >= 0 || h.moves >= 0 ? ProgressBar(h.Progress()) : "-";
    if (h.active > 0) bar += " scanning";
    if (h.under_replicated > 0) total_under += static_cast<uint64_t>(h.under_replicated);
    if (h.moves > 0) total_moves += static_cast<uint64_t>(h.moves);
    const int64_t by = no_health ? -1 : suspected_by(r);
    const std::string suspected = by >= 0 ? std::to_string(by) : "-";
    const std::optional<double> offset = no_health ? std::nullopt : clock_offset(r);
    char clock[32] = "-";
    if (offset) std::snprintf(clock, sizeof clock, "%+.3f", *offset);
    std::printf("%-20s %-22s %-12s %12llu %14llu %-8s %9s %7.4f %-11s %9s %9s %7s %7s %s\n",
                r.info.node_id.c_str(), r.info.peer_endpoint.c_str(),
                r.info.failure_domain.empty() ? "-" : r.info.failure_domain.c_str(),
                static_cast<unsigned long long>(r.info.dram_bytes),
                static_cast<unsigned long long>(r.info.ssd_bytes), r.info.draining ? "yes" : "no",
                ttl.c_str(), share(r), health.c_str(), suspected.c_str(), clock,
                count(h.under_replicated).c_str(), count(h.moves).c_str(), bar.c_str());
  }
  if (truncated) {
    std::printf("more than %lld records: the first %lld (in key order) shown\n",
                static_cast<long long>(kMembersListedMax),
                static_cast<long long>(kMembersListedMax));
  }
  std::printf("%zu member(s); shares over %llu synthetic keys\n", good,
              static_cast<unsigned long long>(kOwnershipSampleKeys));
  if (!no_health) {
    std::printf("repair: %llu under-replicated unit(s), %llu move(s) in progress\n",
                static_cast<unsigned long long>(total_under),
                static_cast<unsigned long long>(total_moves));
  }
  for (const MemberRow& r : rows) {
    if (r.decode.ok()) continue;
    std::printf("bad record (ignored by every node): %s\n", r.decode.ToString().c_str());
  }
  return 0;
}

// kvtier cluster drain NODE: sets (or, with --undo, clears) draining in NODE's member record.
int RunClusterDrain(Args args) {
  FlagSet flags(
      "kvtier cluster drain",
      "Mark a member as draining in etcd (its member record keeps its lease): placement gives "
      "it weight 0, so it owns nothing, and every node's repair scan moves its units to their "
      "new owners; the node keeps serving what it holds until each unit is handed over, then "
      "drops it. Watch the progress with `kvtier cluster status` (MOVES) and remove the node "
      "when it holds nothing. --undo clears the flag. The flag lasts as long as the node's "
      "registration: a restarted node registers undrained. Exit 1 when etcd cannot be read or "
      "written or the node is not a live member.");
  std::string etcd, prefix = "/kvtier/";
  uint64_t timeout_ms = 2000;
  bool undo = false;
  flags.String("etcd", &etcd, "URL[,URL]",
               "etcd endpoints, host:port or http://host:port, tried in order", true);
  flags.String("prefix", &prefix, "P", "the cluster's key prefix in etcd ([cluster] key_prefix)");
  flags.Uint("timeout-ms", &timeout_ms, "deadline of each etcd request", false, 1, 60000);
  flags.Bool("undo", &undo, "clear the draining flag instead of setting it");
  std::vector<std::string_view> rest(args.begin(), args.end());
  std::string node;
  if (!rest.empty() && !rest[0].starts_with("-")) {
    node = std::string(rest[0]);
    rest.erase(rest.begin());
  }
  if (int rc = flags.Parse(std::span<const std::string_view>(rest)); rc >= 0) return rc;
  if (Status st = cluster::ValidateNodeId(node); !st.ok()) {
    std::fprintf(stderr, "kvtier cluster drain: want a node id first: %s\n", st.ToString().c_str());
    return 2;
  }
  cluster::EtcdOptions options{.endpoints = SplitComma(etcd), .request_timeout_ms = timeout_ms};
  if (Status st = cluster::ValidateEtcdOptions(options); !st.ok()) {
    std::fprintf(stderr, "kvtier cluster drain: %s\n", st.ToString().c_str());
    return 2;
  }
  cluster::EtcdClient client(options);
  const std::string key = prefix + "members/" + node;
  // A record rewritten by its node between our read and write: read again (bounded).
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto kv = client.Get(key);
    if (!kv.ok()) {
      std::fprintf(
          stderr, "kvtier cluster drain: %s: %s\n", key.c_str(),
          kv.status().IsNotFound() ? "no such live member" : kv.status().ToString().c_str());
      return 1;
    }
    auto info = cluster::DecodeMember(kv->value);
    if (!info.ok()) {
      std::fprintf(stderr, "kvtier cluster drain: %s: %s\n", key.c_str(),
                   info.status().ToString().c_str());
      return 1;
    }
    if (info->draining == !undo) {
      std::printf("%s is %s\n", node.c_str(), undo ? "not draining" : "already draining");
      return 0;
    }
    info->draining = !undo;
    auto replaced = client.ReplaceIfUnchanged(key, cluster::EncodeMember(*info), kv->mod_revision);
    if (!replaced.ok()) {
      std::fprintf(stderr, "kvtier cluster drain: writing %s: %s\n", key.c_str(),
                   replaced.status().ToString().c_str());
      return 1;
    }
    if (*replaced) {
      std::printf("%s %s\n", node.c_str(), undo ? "no longer draining" : "draining");
      return 0;
    }
  }
  std::fprintf(stderr, "kvtier cluster drain: %s kept changing; try again\n", key.c_str());
  return 1;
}

}  // namespace

int RunCluster(Args args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::FILE* out = args.empty() ? stderr : stdout;
    std::fprintf(out,
                 "usage: kvtier cluster status --etcd URL[,URL] [flags]   "
                 "(kvtier cluster status --help)\n"
                 "       kvtier cluster drain NODE --etcd URL[,URL] [--undo]   "
                 "(kvtier cluster drain --help)\n"
                 "       kvtier cluster where --key HEX|--resp NAME --etcd URL[,URL] [flags]   "
                 "(kvtier cluster where --help)\n");
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "status") return RunStatus(args.subspan(1));
  if (args[0] == "drain") return RunClusterDrain(args.subspan(1));
  if (args[0] == "where") return RunClusterWhere(args.subspan(1));
  std::fprintf(stderr, "kvtier cluster: unknown subcommand '%.*s' (want: status, drain, where)\n",
               static_cast<int>(args[0].size()), args[0].data());
  return 2;
}

}  // namespace kvtier::cli
