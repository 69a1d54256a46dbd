// kvtier cluster where: which members of a kvtier cluster hold one unit, and which own it.
//
//   kvtier cluster where (--key HEX | --resp NAME) --etcd URL[,URL] [--tenant NAME] [--token T]
//                        [--prefix /kvtier/] [--json]
//
// Reads the member records from etcd (cluster_members.h), then asks every member's admin
// endpoint for GET /v1/unit (kvtierd's description of the unit from its tiers' metadata: no
// value read, no hit counted, nothing promoted), at most kQueriesParallelMax at once, and
// prints one row per member: whether it owns the unit under its own view, whether it holds it,
// the tier, bytes, TTL left and whether it is a GET copy. A member's answer is hostile input
// (a member is only as trusted as etcd): read within kAnswerBytesMax, every field's type
// checked, a malformed answer shown as that member's error.
//
// Exit codes: 0 printed, 1 etcd unreachable or no member answered, 2 bad flags.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cli/cluster_members.h"
#include "cli/flags.h"
#include "cluster/http_client.h"
#include "common/json_text.h"
#include "common/key_spec.h"
#include "common/url_query.h"

namespace kvtier::cli {
namespace {

// Members asked at once.
constexpr size_t kQueriesParallelMax = 32;
// A member's /v1/unit answer read at most (kvtierd's is a few hundred bytes).
constexpr uint64_t kAnswerBytesMax = 64u << 10;
// Owner ids taken from one answer at most (a unit has [cluster] replicas owners, at most 16).
constexpr size_t kOwnersPerAnswerMax = 16;
// A member's string printed at most (an error message, an owner's id).
constexpr size_t kPrintedBytesMax = 200;

// One member's answer, its fields checked.
struct Answer {
  std::string error;  // why there is no answer ("" when there is one)
  bool held = false;
  std::optional<bool> owned_here;
  std::vector<std::string> owners;  // this member's view of the unit's owners
  std::string tier, kind;
  std::optional<uint64_t> bytes, ttl_left_ms;  // ttl_left_ms: none when held without a TTL
  std::optional<bool> get_copy;
  std::string tenant;
  nlohmann::json raw;  // the answer as parsed (for --json)
};

// The answer of `body`, or why it is not one.
Answer ReadAnswer(const std::string& body) {
  Answer a;
  nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("held") || !j["held"].is_boolean()) {
    a.error = "not a unit description";
    return a;
  }
  a.raw = j;
  a.held = j["held"].get<bool>();
  auto text = [&](const char* f) {
    return j.contains(f) && j[f].is_string() ? j[f].get<std::string>() : std::string();
  };
  auto count = [&](const char* f) -> std::optional<uint64_t> {
    if (j.contains(f) && j[f].is_number_unsigned()) return j[f].get<uint64_t>();
    return std::nullopt;
  };
  auto flag = [&](const char* f) -> std::optional<bool> {
    if (j.contains(f) && j[f].is_boolean()) return j[f].get<bool>();
    return std::nullopt;
  };
  a.tenant = text("tenant");
  a.tier = text("tier");
  a.kind = text("kind");
  a.bytes = count("bytes");
  a.ttl_left_ms = count("ttl_left_ms");
  a.get_copy = flag("get_copy");
  a.owned_here = flag("owned_here");
  if (j.contains("owners") && j["owners"].is_array()) {
    for (const auto& o : j["owners"]) {
      if (a.owners.size() == kOwnersPerAnswerMax) break;
      if (o.is_string()) a.owners.push_back(o.get<std::string>());
    }
  }
  return a;
}

Answer Ask(const std::string& admin_endpoint, const std::string& path, const std::string& token,
           uint64_t timeout_ms) {
  Answer a;
  if (admin_endpoint.empty()) {
    a.error = "no admin endpoint in its record";
    return a;
  }
  auto ep = cluster::ParseHttpEndpoint(admin_endpoint);
  if (!ep.ok()) {
    a.error = ep.status().message();
    return a;
  }
  cluster::HttpLimits limits{.timeout_ms = timeout_ms, .body_bytes_max = kAnswerBytesMax};
  auto r = cluster::HttpGet(*ep, path, limits, token);
  if (!r.ok()) {
    a.error = r.status().ToString();
    return a;
  }
  if (r->status != 200) {
    nlohmann::json j = nlohmann::json::parse(r->body, nullptr, false);
    const bool said = j.is_object() && j.contains("error") && j["error"].is_string();
    a.error = "HTTP " + std::to_string(r->status) +
              (said ? ": " + j["error"].get<std::string>() : std::string());
    return a;
  }
  return ReadAnswer(r->body);
}

std::string Or(const std::string& s) { return s.empty() ? "-" : s; }

// A member's text for a terminal: control bytes as '?' (no escape sequences), at most
// kPrintedBytesMax bytes.
std::string Printable(std::string s) {
  if (s.size() > kPrintedBytesMax) s.resize(kPrintedBytesMax);
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return s;
}

// A view of a unit's owners (node ids) and the members that see it so.
using View = std::pair<std::vector<std::string>, std::vector<std::string>>;

// The owners as the members' views give them (views that agree on one line), and how many
// of them hold the unit.
void PrintOwners(const std::vector<View>& views, size_t owners_holding, size_t owner_rows,
                 size_t others_holding) {
  for (const auto& [owners, by] : views) {
    std::string o, b;
    for (const std::string& s : owners) o += " " + Printable(s);
    for (const std::string& s : by) b += " " + s;
    std::printf("owners%s  (as seen by%s)\n",
                o.empty() ? " (none: not a cluster node?)" : o.c_str(), b.c_str());
  }
  if (views.size() > 1) std::printf("the members' views differ: a membership change in flight\n");
  std::printf("%zu of %zu owner(s) hold it; %zu other member(s) hold it\n", owners_holding,
              owner_rows, others_holding);
}

}  // namespace

int RunClusterWhere(Args args) {
  FlagSet flags(
      "kvtier cluster where",
      "Say which members of a kvtier cluster hold one unit and which own it. Asks every member "
      "in etcd's member list for GET /v1/unit on its admin endpoint (metadata only: no value "
      "read, no hit counted, nothing promoted, so it is safe on a live cluster) and prints one "
      "row per member: OWNER (the member owns the unit under its own view of the members), HELD, "
      "TIER, BYTES, TTL_LEFT_S (- for none), COPY (a GET copy, not a replica) and KIND, or why "
      "the member could not say. Then the owners as the members see them (views that differ are "
      "listed apart: a membership change in flight) and whether every owner holds the unit. "
      "The unit is the caller's own, by --token's tenant (kvtierd's [auth] tokens): a native "
      "unit by its chain key as the client sent it, or a RESP key by name (a RESP key stays on "
      "the node it was written to: no owners, only where it is held); an admin token may name "
      "another tenant with --tenant. Exit 1 when etcd cannot be read or no member "
      "answered.");
  std::string etcd, prefix = "/kvtier/", tenant, token;
  std::optional<std::string> key_hex, resp;
  uint64_t timeout_ms = 2000, query_timeout_ms = 1000;
  bool json = false;
  flags.String("etcd", &etcd, "URL[,URL]",
               "etcd endpoints, host:port or http://host:port, tried in order", true);
  flags.String("prefix", &prefix, "P", "the cluster's key prefix in etcd ([cluster] key_prefix)");
  flags.OptionalString("key", &key_hex, "HEX", "a native unit's chain key, 64 hex digits");
  flags.OptionalString("resp", &resp, "NAME", "a RESP key's name (--resp '' names the empty key)");
  flags.String("tenant", &tenant, "NAME", "another tenant's unit (needs an admin token)");
  flags.String("token", &token, "TOKEN",
               "bearer token of the tenant whose unit it is (default: $KVTIER_TOKEN; none "
               "with kvtierd's auth off)");
  flags.Uint("timeout-ms", &timeout_ms, "deadline of each etcd request", false, 1, 60000);
  flags.Uint("query-timeout-ms", &query_timeout_ms, "deadline of each member's /v1/unit query",
             false, 1, 60000);
  flags.Bool("json", &json, "print JSON instead of text");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (key_hex.has_value() == resp.has_value()) {
    std::fprintf(stderr, "kvtier cluster where: want one of --key and --resp\n");
    return 2;
  }
  if (key_hex.has_value() && !DigestFromHex(*key_hex).ok()) {
    std::fprintf(stderr, "kvtier cluster where: --key: want 64 hex digits\n");
    return 2;
  }
  if (token.empty()) {
    if (const char* t = std::getenv("KVTIER_TOKEN")) token = t;
  }
  if (Status st = cluster::CheckBearerToken(token); !st.ok()) {
    std::fprintf(stderr, "kvtier cluster where: --token: %s\n", st.ToString().c_str());
    return 2;
  }
  auto options = EtcdFlags(etcd, prefix, timeout_ms);
  if (!options.ok()) {
    std::fprintf(stderr, "kvtier cluster where: %s\n", options.status().ToString().c_str());
    return 2;
  }
  cluster::EtcdClient client(*options);
  auto list = ReadMembers(client, prefix);
  if (!list.ok()) {
    std::fprintf(stderr, "kvtier cluster where: cannot read %smembers/ from etcd (%s): %s\n",
                 prefix.c_str(), etcd.c_str(), list.status().ToString().c_str());
    return 1;
  }
  const std::string path =
      "/v1/unit?" + (key_hex.has_value() ? "key=" + *key_hex : "resp=" + PercentEncode(*resp)) +
      (tenant.empty() ? "" : "&tenant=" + PercentEncode(tenant));
  const std::vector<MemberRecord>& members = list->records;
  std::vector<Answer> answers(members.size());
  for (size_t first = 0; first < members.size(); first += kQueriesParallelMax) {
    std::vector<std::future<Answer>> queries;
    const size_t last = std::min(members.size(), first + kQueriesParallelMax);
    for (size_t i = first; i < last; ++i) {
      queries.push_back(std::async(std::launch::async, Ask,
                                   members[i].decode.ok() ? members[i].info.admin_endpoint : "",
                                   path, token, query_timeout_ms));
    }
    for (size_t i = first; i < last; ++i) answers[i] = queries[i - first].get();
  }

  // The owners as each answering member sees them, views that agree together.
  std::vector<View> views;
  size_t answered = 0, owners_holding = 0, owner_rows = 0, others_holding = 0;
  std::string tenant_seen;
  for (size_t i = 0; i < members.size(); ++i) {
    const Answer& a = answers[i];
    if (!members[i].decode.ok() || !a.error.empty()) continue;
    ++answered;
    if (tenant_seen.empty()) tenant_seen = a.tenant;
    auto v = std::find_if(views.begin(), views.end(),
                          [&](const auto& e) { return e.first == a.owners; });
    if (v == views.end()) {
      views.push_back({a.owners, {}});
      v = views.end() - 1;
    }
    v->second.push_back(members[i].info.node_id);
    const bool owner = a.owned_here.value_or(false);
    owner_rows += owner ? 1 : 0;
    if (a.held) (owner ? owners_holding : others_holding) += 1;
  }

  if (json) {
    nlohmann::ordered_json j;
    j["etcd"] = etcd;
    j["prefix"] = prefix;
    j["revision"] = list->revision;
    j["truncated"] = list->truncated;
    if (!key_hex.has_value()) {
      j["resp_key"] = *resp;
    } else {
      j["key"] = *key_hex;
    }
    j["tenant"] =
        tenant_seen.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(tenant_seen);
    j["members"] = nlohmann::ordered_json::array();
    for (size_t i = 0; i < members.size(); ++i) {
      nlohmann::ordered_json m;
      if (!members[i].decode.ok()) {
        const size_t shown = (prefix + "members/").size() + cluster::kNodeIdBytesMax;
        m["key"] = members[i].key.substr(0, shown);  // etcd keys may be long
        m["error"] = "bad member record: " + members[i].decode.ToString();
        j["members"].push_back(std::move(m));
        continue;
      }
      m["node_id"] = members[i].info.node_id;
      m["admin_endpoint"] = members[i].info.admin_endpoint;
      m["error"] = answers[i].error.empty() ? nlohmann::ordered_json()
                                            : nlohmann::ordered_json(answers[i].error);
      m["unit"] = answers[i].error.empty() ? nlohmann::ordered_json(answers[i].raw)
                                           : nlohmann::ordered_json();
      j["members"].push_back(std::move(m));
    }
    j["views_agree"] = views.size() <= 1;
    j["owners_holding"] = owners_holding;
    j["owners_answering"] = owner_rows;
    j["non_owners_holding"] = others_holding;
    std::printf("%s\n", JsonText(j, 2).c_str());
    return answered == 0 ? 1 : 0;
  }

  const std::string what =
      key_hex.has_value() ? "key " + *key_hex : "resp key " + JsonText(nlohmann::json(*resp));
  std::printf("%s  tenant %s  (etcd revision %lld)\n", what.c_str(),
              Printable(Or(tenant_seen)).c_str(), static_cast<long long>(list->revision));
  std::printf("%-20s %-5s %-4s %-5s %12s %11s %-4s %s\n", "NODE", "OWNER", "HELD", "TIER", "BYTES",
              "TTL_LEFT_S", "COPY", "KIND");
  for (size_t i = 0; i < members.size(); ++i) {
    if (!members[i].decode.ok()) {
      std::printf("%-20s bad member record: %s\n", "?", members[i].decode.ToString().c_str());
      continue;
    }
    const Answer& a = answers[i];
    const std::string& node = members[i].info.node_id;
    if (!a.error.empty()) {
      std::printf("%-20s %s\n", node.c_str(), Printable(a.error).c_str());
      continue;
    }
    auto yes = [](std::optional<bool> b) { return b ? (*b ? "yes" : "no") : "-"; };
    char ttl[32] = "-";
    if (a.held && a.ttl_left_ms) std::snprintf(ttl, sizeof(ttl), "%.1f", *a.ttl_left_ms / 1000.0);
    std::printf("%-20s %-5s %-4s %-5s %12s %11s %-4s %s\n", node.c_str(), yes(a.owned_here),
                a.held ? "yes" : "no", a.held ? Printable(Or(a.tier)).c_str() : "-",
                a.held && a.bytes ? std::to_string(*a.bytes).c_str() : "-", ttl,
                a.held ? yes(a.get_copy) : "-", a.held ? Printable(Or(a.kind)).c_str() : "-");
  }
  if (key_hex.has_value()) PrintOwners(views, owners_holding, owner_rows, others_holding);
  std::printf(
      "%zu member(s) hold it; %zu of %zu member(s) answered%s\n", owners_holding + others_holding,
      answered, members.size(),
      !key_hex.has_value() ? " (a RESP key stays on the node it was written to: no owners)" : "");
  return answered == 0 ? 1 : 0;
}

}  // namespace kvtier::cli
