#include "cache_daemon/engram_serving.h"

#include <toml++/toml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/logging.h"
#include "rdma/engram_table.h"
#include "rdma/shard_map.h"

namespace kvtier::daemon {
namespace {

// Region names become file names (<dir>/<region>.engram): no separators, no leading dot.
bool SafeRegionName(const std::string& name) {
  if (name.empty() || name.size() > wire::kEngramNameBytesMax || name[0] == '.') return false;
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

Status Bad(const std::string& what) { return Status::InvalidArgument("engram: " + what); }

}  // namespace

EngramServing::EngramServing(const EngramServeOptions& options, const Clock* clock)
    : options_(options), clock_(clock != nullptr ? clock : &DefaultSteadyClock()) {
  rdma::RowServerOptions ro;
  ro.bind_address = options_.listen_host == "localhost" ? "127.0.0.1" : options_.listen_host;
  ro.port = options_.listen_port;
  ro.connections_max = options_.connections_max;
  ro.attach_timeout_ms = options_.attach_timeout_ms;
  ro.body_timeout_ms = options_.body_timeout_ms;
  ro.regions_per_connection_max = options_.regions_per_connection_max;
  ro.batch_ops_max = options_.batch_ops_max;
  ro.read_bytes_max = options_.read_bytes_max;
  ro.response_bytes_max = options_.response_bytes_max;
  ro.grants_max = options_.grants_max;
  ro.grant_ttl_ms_max = options_.grant_ttl_ms_max;
  ro.verbs.path_mtu_max_bytes = options_.verbs_path_mtu_max_bytes;
  ro.verbs.rd_atomic_max = options_.verbs_rd_atomic_max;
  ro.verbs.gid_index = static_cast<uint8_t>(options_.verbs_gid_index);  // <= 255 (Finalize)
  ro.verbs_registrations_max = options_.verbs_registrations_max;
  ro.clock = clock_;
  server_ = std::make_unique<rdma::RowServer>(ro);
}

EngramServing::~EngramServing() { Stop(); }

StatusOr<std::unique_ptr<EngramServing>> EngramServing::Open(const EngramServeOptions& options,
                                                             const Clock* clock) {
  if (!options.enabled) return Bad("not enabled");
  std::unique_ptr<EngramServing> s(new EngramServing(options, clock));
  KVTIER_RETURN_IF_ERROR(s->Load());
  return s;
}

Status EngramServing::Load() {
  const std::string dir = options_.dir;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return Status::NotFound("engram.dir " + dir + " is not a directory");
  }
  const std::string map_path = dir + "/shards.toml";
  std::ifstream in(map_path, std::ios::binary);
  if (!in) return Status::NotFound("engram: cannot open " + map_path);
  std::stringstream ss;
  ss << in.rdbuf();
  shards_toml_ = ss.str();
  if (shards_toml_.size() > wire::kEngramShardsTomlBytesMax) {
    return Bad(map_path + " is larger than 1 MiB");
  }
  toml::table root;
  try {
    root = toml::parse(shards_toml_);
  } catch (const toml::parse_error& e) {
    return Bad(map_path + ":" + std::to_string(e.source().begin.line) + ": " +
               std::string(e.description()));
  }
  const toml::table* engram = root["engram"].as_table();
  if (engram == nullptr || root.size() != 1) {
    return Bad(map_path + ": expected only [[engram.<table>.shard]] arrays");
  }
  std::string adv_host;
  uint16_t adv_port = 0;
  KVTIER_RETURN_IF_ERROR(rdma::ShardMap::ParseEndpoint(options_.advertise, &adv_host, &adv_port));
  std::set<std::string> all_regions;
  size_t tables = 0;
  for (const auto& [key, node] : *engram) {
    std::string table_path = "engram." + std::string(key.str());
    int line = node.source().begin ? static_cast<int>(node.source().begin.line) : 0;
    StatusOr<rdma::ShardMap> map = rdma::ShardMap::FromToml(shards_toml_, table_path);
    if (!map.ok()) {
      return Bad(map_path + ":" + std::to_string(line) + ": [" + table_path +
                 "]: " + std::string(map.status().message()));
    }
    ++tables;
    for (const rdma::ShardSpec& spec : map->shards()) {
      if (!SafeRegionName(spec.region_name)) {
        return Bad(map_path + ": [" + table_path + "]: region name '" + spec.region_name +
                   "' must be 1..256 of [A-Za-z0-9._-], not starting with '.'");
      }
      if (!all_regions.insert(spec.region_name).second) {
        return Bad(map_path + ": region '" + spec.region_name + "' appears twice");
      }
      if (spec.host != adv_host || spec.port != adv_port) continue;
      if (regions_.size() >= kEngramServedRegionsMax) {
        return Bad(map_path + ": more than 4096 regions assigned to " + options_.advertise);
      }
      const std::string file = dir + "/" + spec.region_name + ".engram";
      StatusOr<std::shared_ptr<const rdma::MappedTable>> table = rdma::MappedTable::Open(file);
      if (!table.ok()) return table.status().WithContext("engram table " + file);
      const rdma::EngramTableHeader& h = (*table)->header();
      if (h.row_begin != spec.row_begin || h.row_count != spec.row_end - spec.row_begin) {
        return Bad("table " + file + " holds rows [" + std::to_string(h.row_begin) + ", " +
                   std::to_string(h.row_begin + h.row_count) + ") but shards.toml assigns [" +
                   std::to_string(spec.row_begin) + ", " + std::to_string(spec.row_end) + ")");
      }
      Status st = server_->RegisterTable(spec.region_name, file);
      if (!st.ok()) return st.WithContext("engram table " + file);
      regions_.push_back(spec.region_name);
    }
  }
  if (tables == 0) return Bad(map_path + " has no [[engram.<table>.shard]] arrays");
  if (regions_.empty()) {
    return Bad("no shard in " + map_path + " has endpoint " + options_.advertise +
               " (engram.advertise, default engram.listen)");
  }
  std::sort(regions_.begin(), regions_.end());
  return Status::Ok();
}

Status EngramServing::Start(boost::asio::io_context& io) {
  Status st = server_->Start(io);
  if (!st.ok()) return st.WithContext("engram.listen " + options_.listen);
  KVTIER_LOG(kInfo) << "engram: serving " << regions_.size() << " regions from " << options_.dir
                    << " on " << options_.listen << " (advertised as " << options_.advertise << ")";
  return Status::Ok();
}

void EngramServing::Stop() { server_->Stop(); }

StatusOr<wire::EngramGrantResponse> EngramServing::Grant(const std::string& tenant,
                                                         std::span<const std::string> regions,
                                                         uint64_t ttl_ms) {
  if (ttl_ms == 0) ttl_ms = options_.grant_ttl_ms;
  if (ttl_ms > options_.grant_ttl_ms_max) {
    return Status::InvalidArgument("engram grant ttl_ms " + std::to_string(ttl_ms) +
                                   " exceeds engram.grant_ttl_ms_max " +
                                   std::to_string(options_.grant_ttl_ms_max));
  }
  if (regions.size() > wire::kEngramRegionsMax) {
    return Status::InvalidArgument("too many regions in one engram grant");
  }
  std::vector<std::string> names(regions.begin(), regions.end());
  if (names.empty()) names = regions_;
  std::set<std::string> seen;
  for (const std::string& n : names) {
    if (!std::binary_search(regions_.begin(), regions_.end(), n)) {
      return Status::NotFound("engram region '" + n + "' is not served by this daemon");
    }
    if (!seen.insert(n).second) {
      return Status::InvalidArgument("engram region '" + n + "' named twice");
    }
  }
  const uint64_t now_ms = clock_->NowMs();
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint64_t>& live = live_[tenant];
    std::erase_if(live, [&](uint64_t expiry) { return expiry <= now_ms; });
    if (live.size() + names.size() > options_.grants_per_tenant_max) {
      return Status::Rejected("tenant has " + std::to_string(live.size()) +
                              " live engram grants; engram.grants_per_tenant_max is " +
                              std::to_string(options_.grants_per_tenant_max));
    }
    // Reserve the slots now so concurrent grants of one tenant cannot overshoot.
    live.insert(live.end(), names.size(), now_ms + ttl_ms);
  }
  wire::EngramGrantResponse resp;
  resp.endpoint = options_.advertise;
  resp.tenant = tenant;
  resp.ttl_ms = ttl_ms;
  const uint64_t expires_unix_ms = DefaultSystemClock().NowMs() + ttl_ms;
  Status failure;
  for (const std::string& n : names) {
    StatusOr<rdma::wire::GrantToken> tok = server_->IssueGrant(n, tenant, ttl_ms);
    if (!tok.ok()) {
      failure = tok.status();
      break;
    }
    wire::EngramGrantedRegion g;
    g.name = n;
    std::copy(tok->begin(), tok->end(), g.token.begin());
    g.expires_unix_ms = expires_unix_ms;
    resp.regions.push_back(std::move(g));
  }
  if (!failure.ok()) {
    // All or nothing: take back what was issued and release the reserved slots.
    for (const auto& g : resp.regions) {
      rdma::wire::GrantToken t;
      std::copy(g.token.begin(), g.token.end(), t.begin());
      (void)server_->RevokeGrant(t);
    }
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint64_t>& live = live_[tenant];
    for (size_t i = 0; i < names.size(); ++i) {
      auto it = std::find(live.begin(), live.end(), now_ms + ttl_ms);
      if (it != live.end()) live.erase(it);
    }
    return failure;
  }
  std::lock_guard<std::mutex> lock(mu_);
  grants_issued_ += resp.regions.size();
  return resp;
}

void EngramServing::Revoke(const std::string& tenant,
                           std::span<const wire::EngramGrantedRegion> grants) {
  for (const auto& g : grants) {
    rdma::wire::GrantToken t;
    std::copy(g.token.begin(), g.token.end(), t.begin());
    (void)server_->RevokeGrant(t);
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t>& live = live_[tenant];
  size_t n = std::min(live.size(), grants.size());
  // The latest-expiring entries belong to the newest grants.
  std::sort(live.begin(), live.end());
  live.resize(live.size() - n);
}

uint64_t EngramServing::grants_issued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return grants_issued_;
}

}  // namespace kvtier::daemon
