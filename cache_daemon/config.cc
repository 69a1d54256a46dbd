#include "cache_daemon/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>

#include "cache_daemon/cluster_config_toml.h"
#include "common/config.h"
#include "common/toml_integer.h"
#include "policies/policy.h"
#include "rdma/shard_map.h"
#include "rdma/verbs_plan.h"
#include "rdma/wire.h"
#include "storage/ssd_tier.h"

namespace kvtier::daemon {
namespace {

using Setter = std::function<Status(const toml::node&)>;

Status Bad(const std::string& key, const std::string& why) {
  return Status::InvalidArgument("config key " + key + ": " + why);
}

template <typename T>
Setter UintKey(const std::string& key, T* out) {
  return [key, out](const toml::node& n) -> Status {
    std::optional<int64_t> v = TomlInteger(n);
    if (!v || *v < 0 || static_cast<uint64_t>(*v) > std::numeric_limits<T>::max()) {
      return Bad(key, "expected a non-negative integer that fits");
    }
    *out = static_cast<T>(*v);
    return Status::Ok();
  };
}

Setter StringKey(const std::string& key, std::string* out) {
  return [key, out](const toml::node& n) -> Status {
    std::optional<std::string> v = n.value<std::string>();
    if (!v) return Bad(key, "expected a string");
    *out = *v;
    return Status::Ok();
  };
}

// A list of host names (ASCII letters, digits, '-', '.'), lower-cased.
Setter HostNamesKey(const std::string& key, std::vector<std::string>* out) {
  return [key, out](const toml::node& n) -> Status {
    const toml::array* a = n.as_array();
    if (a == nullptr) return Bad(key, "expected an array of host names");
    constexpr size_t kNamesMax = 64, kNameBytesMax = 253;
    if (a->size() > kNamesMax) return Bad(key, "at most 64 names");
    out->clear();
    for (const toml::node& e : *a) {
      std::optional<std::string> v = e.value<std::string>();
      if (!v || v->empty() || v->size() > kNameBytesMax) return Bad(key, "expected host names");
      std::string name;
      for (char c : *v) {
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.') {
          return Bad(key, "'" + *v + "' is not a host name (no port, no scheme)");
        }
        name += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      }
      out->push_back(std::move(name));
    }
    return Status::Ok();
  };
}

Setter BoolKey(const std::string& key, bool* out) {
  return [key, out](const toml::node& n) -> Status {
    std::optional<bool> v = n.value<bool>();
    if (!v) return Bad(key, "expected true or false");
    *out = *v;
    return Status::Ok();
  };
}

// Appends the TOML line of the offending key, so LoadConfig's error reads
// "<file>: config key <k>: <why> (line N)".
Status AtLine(const Status& st, const toml::node& n) {
  if (st.ok() || !n.source().begin) return st;
  return Status(st.code(), std::string(st.message()) + " (line " +
                               std::to_string(n.source().begin.line) + ")");
}

StatusOr<storage::Durability> ParseDurability(std::string_view s) {
  if (s == "none") return storage::Durability::kNone;
  if (s == "batched") return storage::Durability::kBatched;
  if (s == "sync") return storage::Durability::kSync;
  return Status::InvalidArgument("durability must be none, batched or sync");
}

StatusOr<toml::table> ParseToml(std::string_view text) {
  try {
    return toml::parse(text);
  } catch (const toml::parse_error& e) {
    std::ostringstream msg;
    msg << "config: " << e.description() << " at line " << e.source().begin.line;
    return Status::InvalidArgument(msg.str());
  }
}

Status ReadPolicyTable(const toml::table& policy, PolicySettings* out) {
  for (const auto& [k, v] : policy) {
    std::string key(k.str());
    if (key == "eviction" || key == "admission") {
      std::optional<std::string> s = v.value<std::string>();
      if (!s) return Bad("policy." + key, "expected a string");
      (key == "eviction" ? out->eviction : out->admission) = *s;
    } else if (key == "seed") {
      std::optional<int64_t> s = TomlInteger(v);
      if (!s || *s < 0) return Bad("policy.seed", "expected a non-negative integer");
      out->params.seed = static_cast<uint64_t>(*s);
    } else if (key == "params") {
      const toml::table* p = v.as_table();
      if (p == nullptr) return Bad("policy.params", "expected a table");
      out->params.values.clear();
      for (const auto& [pk, pv] : *p) {
        std::string text;
        if (auto s = pv.value<std::string>()) {
          text = *s;
        } else if (auto i = TomlInteger(pv)) {
          text = std::to_string(*i);
        } else if (auto d = pv.value<double>()) {
          std::ostringstream os;
          os << *d;
          text = os.str();
        } else {
          return Bad("policy.params." + std::string(pk.str()), "expected a string or number");
        }
        const std::string name(pk.str());
        if (size_t colon = name.find(':'); colon != std::string::npos) {
          const std::string scope = name.substr(0, colon);
          std::vector<std::string> known = policies::EvictionPolicyNames();
          for (std::string& a : policies::AdmissionPolicyNames()) known.push_back(std::move(a));
          if (std::find(known.begin(), known.end(), scope) == known.end()) {
            return Bad("policy.params." + name, "'" + scope + "' is not a policy");
          }
        }
        out->params.values.emplace_back(name, text);
      }
    } else {
      return Bad("policy." + key, "unknown key");
    }
  }
  return Status::Ok();
}

// The keys of every table but [policy] and [cluster] (read by their own functions), each
// writing into o (durability and eviction_structure: the text, parsed after the file).
std::map<std::string, Setter> KeyTable(DaemonOptions& o, std::string& durability,
                                       std::string& eviction_structure) {
  return {
      {"server.data_dir", StringKey("server.data_dir", &o.data_dir)},
      {"server.socket", StringKey("server.socket", &o.socket_path)},
      {"server.listen", StringKey("server.listen", &o.listen_address)},
      {"server.native_listen", StringKey("server.native_listen", &o.native_listen)},
      {"server.resp_listen", StringKey("server.resp_listen", &o.resp_listen)},
      {"server.http_listen", StringKey("server.http_listen", &o.http_listen)},
      {"server.native_port", UintKey("server.native_port", &o.native_port)},
      {"server.resp_port", UintKey("server.resp_port", &o.resp_port)},
      {"server.http_port", UintKey("server.http_port", &o.http_port)},
      {"server.http_allowed_hosts",
       HostNamesKey("server.http_allowed_hosts", &o.http_allowed_hosts)},
      {"server.io_threads", UintKey("server.io_threads", &o.io_threads)},
      {"server.worker_threads", UintKey("server.worker_threads", &o.worker_threads)},
      {"limits.max_frame_bytes", UintKey("limits.max_frame_bytes", &o.max_frame_bytes)},
      {"limits.max_inflight_per_connection",
       UintKey("limits.max_inflight_per_connection", &o.max_inflight_per_connection)},
      {"limits.max_batch_keys", UintKey("limits.max_batch_keys", &o.max_batch_keys)},
      {"limits.max_connections", UintKey("limits.max_connections", &o.max_connections)},
      {"limits.frame_timeout_ms", UintKey("limits.frame_timeout_ms", &o.frame_timeout_ms)},
      {"limits.shm_max_bytes", UintKey("limits.shm_max_bytes", &o.shm_max_bytes)},
      {"limits.drain_timeout_ms", UintKey("limits.drain_timeout_ms", &o.drain_timeout_ms)},
      {"limits.resp_max_args", UintKey("limits.resp_max_args", &o.resp_max_args)},
      {"limits.http_max_body_bytes", UintKey("limits.http_max_body_bytes", &o.http_max_body_bytes)},
      {"limits.idle_timeout_ms", UintKey("limits.idle_timeout_ms", &o.idle_timeout_ms)},
      {"limits.reply_queue_bytes_max",
       UintKey("limits.reply_queue_bytes_max", &o.reply_queue_bytes_max)},
      {"limits.preauth_frame_bytes_max",
       UintKey("limits.preauth_frame_bytes_max", &o.preauth_frame_bytes_max)},
      {"limits.resp_command_bytes_max",
       UintKey("limits.resp_command_bytes_max", &o.resp_command_bytes_max)},
      {"limits.resp_multi_commands_max",
       UintKey("limits.resp_multi_commands_max", &o.resp_multi_commands_max)},
      {"limits.resp_multi_bytes_max",
       UintKey("limits.resp_multi_bytes_max", &o.resp_multi_bytes_max)},
      {"limits.resp_scan_count_max", UintKey("limits.resp_scan_count_max", &o.resp_scan_count_max)},
      {"limits.resp_keys_reply_bytes_max",
       UintKey("limits.resp_keys_reply_bytes_max", &o.resp_keys_reply_bytes_max)},
      {"limits.resp_key_index_bytes_max",
       UintKey("limits.resp_key_index_bytes_max", &o.resp_key_index_bytes_max)},
      {"limits.connection_memory_bytes_max",
       UintKey("limits.connection_memory_bytes_max", &o.connection_memory_bytes_max)},
      {"limits.reply_buffers_kept_bytes_max",
       UintKey("limits.reply_buffers_kept_bytes_max", &o.reply_buffers_kept_bytes_max)},
      {"limits.malloc_arenas_max", UintKey("limits.malloc_arenas_max", &o.malloc_arenas_max)},
      {"limits.malloc_mmap_threshold_bytes",
       UintKey("limits.malloc_mmap_threshold_bytes", &o.malloc_mmap_threshold_bytes)},
      {"limits.unix_connections_max",
       UintKey("limits.unix_connections_max", &o.unix_connections_max)},
      {"limits.native_tcp_connections_max",
       UintKey("limits.native_tcp_connections_max", &o.native_tcp_connections_max)},
      {"limits.resp_connections_max",
       UintKey("limits.resp_connections_max", &o.resp_connections_max)},
      {"limits.http_connections_max",
       UintKey("limits.http_connections_max", &o.http_connections_max)},
      {"limits.tenant_connections_max",
       UintKey("limits.tenant_connections_max", &o.tenant_connections_max)},
      {"limits.auth_timeout_ms", UintKey("limits.auth_timeout_ms", &o.auth_timeout_ms)},
      {"limits.unauthenticated_connections_max",
       UintKey("limits.unauthenticated_connections_max", &o.unauthenticated_connections_max)},
      {"limits.unauthenticated_connections_per_source_max",
       UintKey("limits.unauthenticated_connections_per_source_max",
               &o.unauthenticated_connections_per_source_max)},
      {"limits.http_connections_per_source_max",
       UintKey("limits.http_connections_per_source_max", &o.http_connections_per_source_max)},
      {"limits.unauthenticated_source_ipv6_prefix_bits",
       UintKey("limits.unauthenticated_source_ipv6_prefix_bits",
               &o.unauthenticated_source_ipv6_prefix_bits)},
      {"auth.tokens_file", StringKey("auth.tokens_file", &o.tokens_file)},
      {"auth.server_secret_file", StringKey("auth.server_secret_file", &o.server_secret_file)},
      {"auth.default_inflight_max", UintKey("auth.default_inflight_max", &o.default_inflight_max)},
      {"storage.hbm_capacity_bytes",
       UintKey("storage.hbm_capacity_bytes", &o.storage.hbm_capacity_bytes)},
      {"storage.dram_capacity_bytes",
       UintKey("storage.dram_capacity_bytes", &o.storage.dram_capacity_bytes)},
      {"storage.ssd_capacity_bytes",
       UintKey("storage.ssd_capacity_bytes", &o.storage.ssd_capacity_bytes)},
      {"storage.hbm_objects_max", UintKey("storage.hbm_objects_max", &o.storage.hbm_objects_max)},
      {"storage.dram_objects_max",
       UintKey("storage.dram_objects_max", &o.storage.dram_objects_max)},
      {"storage.dram_prefault", BoolKey("storage.dram_prefault", &o.storage.dram_prefault)},
      {"storage.ssd_objects_max", UintKey("storage.ssd_objects_max", &o.storage.ssd_objects_max)},
      {"storage.miss_memory_entries",
       UintKey("storage.miss_memory_entries", &o.storage.miss_memory_entries)},
      {"storage.durability", StringKey("storage.durability", &durability)},
      {"storage.eviction_structure", StringKey("storage.eviction_structure", &eviction_structure)},
      {"storage.group_commit_ms", UintKey("storage.group_commit_ms", &o.storage.group_commit_ms)},
      {"storage.max_value_bytes", UintKey("storage.max_value_bytes", &o.storage.max_value_bytes)},
      {"storage.ssd_segment_bytes",
       UintKey("storage.ssd_segment_bytes", &o.storage.ssd_segment_bytes)},
      {"storage.ssd_background_io_bytes_per_s",
       UintKey("storage.ssd_background_io_bytes_per_s", &o.storage.ssd_background_io_bytes_per_s)},
      {"storage.ssd_commit_delay_us",
       UintKey("storage.ssd_commit_delay_us", &o.storage.ssd_commit_delay_us)},
      {"storage.ssd_disk_free_min_bytes",
       UintKey("storage.ssd_disk_free_min_bytes", &o.storage.ssd_disk_free_min_bytes)},
      {"tls.cert_file", StringKey("tls.cert_file", &o.tls.cert_file)},
      {"tls.key_file", StringKey("tls.key_file", &o.tls.key_file)},
      {"tls.native", BoolKey("tls.native", &o.tls.native)},
      {"tls.resp", BoolKey("tls.resp", &o.tls.resp)},
      {"tls.http", BoolKey("tls.http", &o.tls.http)},
      {"tls.handshake_timeout_ms",
       UintKey("tls.handshake_timeout_ms", &o.tls.handshake_timeout_ms)},
      {"tls.handshakes_max", UintKey("tls.handshakes_max", &o.tls.handshakes_max)},
      {"trace.path", StringKey("trace.path", &o.trace_path)},
      {"trace.queue_depth", UintKey("trace.queue_depth", &o.trace_queue_depth)},
      {"trace.whatif_window_records_max",
       UintKey("trace.whatif_window_records_max", &o.trace_whatif_window_records_max)},
      {"trace.whatif_window_bytes_max",
       UintKey("trace.whatif_window_bytes_max", &o.trace_whatif_window_bytes_max)},
      {"trace.whatif_interval_ms",
       UintKey("trace.whatif_interval_ms", &o.trace_whatif_interval_ms)},
      {"engram.enabled", BoolKey("engram.enabled", &o.engram.enabled)},
      {"engram.listen", StringKey("engram.listen", &o.engram.listen)},
      {"engram.advertise", StringKey("engram.advertise", &o.engram.advertise)},
      {"engram.dir", StringKey("engram.dir", &o.engram.dir)},
      {"engram.grant_ttl_ms", UintKey("engram.grant_ttl_ms", &o.engram.grant_ttl_ms)},
      {"engram.grant_ttl_ms_max", UintKey("engram.grant_ttl_ms_max", &o.engram.grant_ttl_ms_max)},
      {"engram.grants_max", UintKey("engram.grants_max", &o.engram.grants_max)},
      {"engram.grants_per_tenant_max",
       UintKey("engram.grants_per_tenant_max", &o.engram.grants_per_tenant_max)},
      {"engram.connections_max", UintKey("engram.connections_max", &o.engram.connections_max)},
      {"engram.attach_timeout_ms",
       UintKey("engram.attach_timeout_ms", &o.engram.attach_timeout_ms)},
      {"engram.body_timeout_ms", UintKey("engram.body_timeout_ms", &o.engram.body_timeout_ms)},
      {"engram.regions_per_connection_max",
       UintKey("engram.regions_per_connection_max", &o.engram.regions_per_connection_max)},
      {"engram.batch_ops_max", UintKey("engram.batch_ops_max", &o.engram.batch_ops_max)},
      {"engram.read_bytes_max", UintKey("engram.read_bytes_max", &o.engram.read_bytes_max)},
      {"engram.response_bytes_max",
       UintKey("engram.response_bytes_max", &o.engram.response_bytes_max)},
      {"engram.verbs_path_mtu_max_bytes",
       UintKey("engram.verbs_path_mtu_max_bytes", &o.engram.verbs_path_mtu_max_bytes)},
      {"engram.verbs_rd_atomic_max",
       UintKey("engram.verbs_rd_atomic_max", &o.engram.verbs_rd_atomic_max)},
      {"engram.verbs_gid_index", UintKey("engram.verbs_gid_index", &o.engram.verbs_gid_index)},
      {"engram.verbs_registrations_max",
       UintKey("engram.verbs_registrations_max", &o.engram.verbs_registrations_max)},
  };
}

}  // namespace

std::vector<std::string> ConfigKeyNames() {
  DaemonOptions o;
  std::string durability, eviction_structure;
  std::vector<std::string> names;
  for (const auto& [name, setter] : KeyTable(o, durability, eviction_structure)) {
    names.push_back(name);
  }
  return names;
}

StatusOr<DaemonOptions> ParseConfig(std::string_view text) {
  DaemonOptions o;
  o.storage.ssd_capacity_bytes = 4ull << 30;
  KVTIER_ASSIGN_OR_RETURN(toml::table root, ParseToml(text));
  std::string durability = "batched";
  std::string eviction_structure = "plain";
  const std::map<std::string, Setter> keys = KeyTable(o, durability, eviction_structure);
  for (const auto& [section, node] : root) {
    std::string sec(section.str());
    const toml::table* t = node.as_table();
    if (t == nullptr) return AtLine(Bad(sec, "expected a table ([" + sec + "])"), node);
    if (sec == "policy") {
      PolicySettings p{o.storage.eviction_policy, o.storage.admission_policy,
                       o.storage.policy_params};
      KVTIER_RETURN_IF_ERROR(ReadPolicyTable(*t, &p));
      o.storage.eviction_policy = p.eviction;
      o.storage.admission_policy = p.admission;
      o.storage.policy_params = p.params;
      continue;
    }
    if (sec == "cluster") {
      KVTIER_RETURN_IF_ERROR(AtLine(ReadClusterTable(*t, &o.cluster), node));
      continue;
    }
    for (const auto& [k, v] : *t) {
      std::string full = sec + "." + std::string(k.str());
      auto it = keys.find(full);
      if (it == keys.end()) return AtLine(Bad(full, "unknown key"), v);
      KVTIER_RETURN_IF_ERROR(AtLine(it->second(v), v));
    }
  }
  KVTIER_ASSIGN_OR_RETURN(o.storage.durability, ParseDurability(durability));
  auto structure = policies::ParseStructure(eviction_structure);
  if (!structure.ok()) return Bad("storage.eviction_structure", "expected \"plain\" or \"prefix\"");
  o.storage.eviction_structure = *structure;
  return o;
}

StatusOr<DaemonOptions> LoadConfig(const std::string& path) {
  if (path.empty()) return ParseConfig("");
  auto text = ReadFileBounded(path, kConfigFileBytesLimit);
  if (!text.ok()) return text.status().WithContext("config file");
  StatusOr<DaemonOptions> o = ParseConfig(*text);
  if (!o.ok()) return o.status().WithContext(path);
  o->config_path = path;
  return o;
}

StatusOr<PolicySettings> ParsePolicySettings(std::string_view text) {
  KVTIER_ASSIGN_OR_RETURN(toml::table root, ParseToml(text));
  PolicySettings p{"lru", "admit-all", {}};
  if (const toml::table* t = root["policy"].as_table(); t != nullptr) {
    KVTIER_RETURN_IF_ERROR(ReadPolicyTable(*t, &p));
  }
  return p;
}

Status Finalize(DaemonOptions* o) {
  if (o->data_dir.empty()) o->data_dir = DefaultDataDir();
  if (o->socket_path.empty()) o->socket_path = o->data_dir + "/kvtierd.sock";
  if (o->socket_path == "off") o->socket_path.clear();
  if (o->server_secret_file.empty()) o->server_secret_file = o->data_dir + "/server_secret";
  o->storage.data_dir = o->data_dir + "/store";
  if (o->io_threads == 0 || o->io_threads > 256) return Bad("server.io_threads", "1..256");
  if (o->worker_threads == 0 || o->worker_threads > 1024) {
    return Bad("server.worker_threads", "1..1024");
  }
  if (o->max_frame_bytes < 4096) return Bad("limits.max_frame_bytes", "at least 4096");
  if (o->max_frame_bytes > (1ull << 32)) return Bad("limits.max_frame_bytes", "at most 4 GiB");
  if (o->max_inflight_per_connection == 0) {
    return Bad("limits.max_inflight_per_connection", "at least 1");
  }
  if (o->max_batch_keys == 0 || o->max_batch_keys > 4096) {
    return Bad("limits.max_batch_keys", "1..4096");
  }
  if (o->idle_timeout_ms < 100) return Bad("limits.idle_timeout_ms", "at least 100");
  if (o->storage.miss_memory_entries == 0 || o->storage.miss_memory_entries > (64u << 20)) {
    return Bad("storage.miss_memory_entries", "1..67108864");
  }
  if (o->storage.ssd_commit_delay_us > storage::SsdOptions::kMaxCommitDelayUs) {
    return Bad("storage.ssd_commit_delay_us", "0..1000000 (1 s)");
  }
  if (o->trace_whatif_window_records_max > 10000000) {
    return Bad("trace.whatif_window_records_max", "0..10000000");
  }
  if (o->trace_whatif_window_bytes_max < 4096 || o->trace_whatif_window_bytes_max > (1ull << 30)) {
    return Bad("trace.whatif_window_bytes_max", "4096..1073741824 (1 GiB)");
  }
  if (o->trace_whatif_interval_ms < 100 || o->trace_whatif_interval_ms > 86400000) {
    return Bad("trace.whatif_interval_ms", "100..86400000 (one day)");
  }
  if (o->reply_queue_bytes_max < 4096) return Bad("limits.reply_queue_bytes_max", "at least 4096");
  if (o->preauth_frame_bytes_max < 4096) {
    return Bad("limits.preauth_frame_bytes_max", "at least 4096");
  }
  if (o->resp_command_bytes_max < 4096)
    return Bad("limits.resp_command_bytes_max", "at least 4096");
  if (o->resp_multi_commands_max == 0) return Bad("limits.resp_multi_commands_max", "at least 1");
  if (o->resp_multi_bytes_max < 4096) return Bad("limits.resp_multi_bytes_max", "at least 4096");
  if (o->resp_scan_count_max == 0) return Bad("limits.resp_scan_count_max", "at least 1");
  if (o->resp_keys_reply_bytes_max < 4096) {
    return Bad("limits.resp_keys_reply_bytes_max", "at least 4096");
  }
  if (o->connection_memory_bytes_max < (1u << 20)) {
    return Bad("limits.connection_memory_bytes_max", "at least 1 MiB");
  }
  if (o->malloc_arenas_max > 1024) return Bad("limits.malloc_arenas_max", "0..1024");
  if (o->malloc_mmap_threshold_bytes != 0 &&
      (o->malloc_mmap_threshold_bytes < 4096 || o->malloc_mmap_threshold_bytes > (32u << 20))) {
    return Bad("limits.malloc_mmap_threshold_bytes", "0, or 4096..33554432");
  }
  for (auto [key, v] :
       {std::pair{"limits.unix_connections_max", o->unix_connections_max},
        std::pair{"limits.native_tcp_connections_max", o->native_tcp_connections_max},
        std::pair{"limits.resp_connections_max", o->resp_connections_max},
        std::pair{"limits.http_connections_max", o->http_connections_max},
        std::pair{"limits.tenant_connections_max", o->tenant_connections_max}}) {
    if (v == 0) return Bad(key, "at least 1");
  }
  if (o->auth_timeout_ms < 100 || o->auth_timeout_ms > 3600000) {
    return Bad("limits.auth_timeout_ms", "100..3600000 (one hour)");
  }
  if (o->unauthenticated_connections_max == 0 || o->unauthenticated_connections_max > 65536) {
    return Bad("limits.unauthenticated_connections_max", "1..65536");
  }
  if (o->unauthenticated_connections_per_source_max == 0) {
    o->unauthenticated_connections_per_source_max = std::min(
        DaemonOptions::kUnauthenticatedPerSourceDefault, o->unauthenticated_connections_max);
  }
  if (o->unauthenticated_connections_per_source_max > o->unauthenticated_connections_max) {
    return Bad("limits.unauthenticated_connections_per_source_max",
               "1..limits.unauthenticated_connections_max (" +
                   std::to_string(o->unauthenticated_connections_max) +
                   "): one source may hold at most every unauthenticated place of a front");
  }
  if (o->http_connections_per_source_max == 0) {
    o->http_connections_per_source_max =
        std::min(DaemonOptions::kHttpPerSourceDefault, o->http_connections_max);
  }
  if (o->http_connections_per_source_max > o->http_connections_max) {
    return Bad("limits.http_connections_per_source_max",
               "1..limits.http_connections_max (" + std::to_string(o->http_connections_max) +
                   "): one source may hold at most every place of the front");
  }
  if (o->unauthenticated_source_ipv6_prefix_bits < 16 ||
      o->unauthenticated_source_ipv6_prefix_bits > 128) {
    return Bad("limits.unauthenticated_source_ipv6_prefix_bits", "16..128");
  }
  if (o->socket_path.size() >= 108) {
    return Bad("server.socket", "path longer than 107 bytes (sun_path limit)");
  }
  KVTIER_RETURN_IF_ERROR(FinalizeFronts(o));
  KVTIER_RETURN_IF_ERROR(FinalizeCluster(&o->cluster, !o->tokens_file.empty()));
  return FinalizeEngram(o);
}

Status FinalizeFronts(DaemonOptions* o) {
  // listen itself, even with every TCP port off (the rule predates per-front addresses).
  if (o->tokens_file.empty() && !IsLoopbackAddress(o->listen_address)) {
    return Status::PermissionDenied(
        "refusing to listen on non-loopback address '" + o->listen_address +
        "' without authentication: set [auth] tokens_file (see docs/CONFIG.md), or listen on "
        "127.0.0.1 and use the Unix socket");
  }
  if (o->native_listen.empty()) o->native_listen = o->listen_address;
  if (o->resp_listen.empty()) o->resp_listen = o->listen_address;
  TlsServeOptions& tls = o->tls;
  if (tls.any() && tls.cert_file.empty()) {
    return Bad("tls.cert_file", "required when a front uses TLS (tls.native/resp/http)");
  }
  if (tls.any() && tls.key_file.empty()) {
    return Bad("tls.key_file", "required when a front uses TLS (tls.native/resp/http)");
  }
  if (tls.handshake_timeout_ms == 0 || tls.handshake_timeout_ms > 600000) {
    return Bad("tls.handshake_timeout_ms", "1..600000");
  }
  if (tls.handshakes_max == 0) return Bad("tls.handshakes_max", "at least 1");
  const struct {
    const char* front;
    const char* key;
    const std::string& address;
    uint16_t port;
    bool tls;
  } fronts[] = {
      {"native", "server.native_listen", o->native_listen, o->native_port, tls.native},
      {"resp", "server.resp_listen", o->resp_listen, o->resp_port, tls.resp},
      {"http", "server.http_listen", o->http_listen, o->http_port, tls.http},
  };
  for (const auto& f : fronts) {
    if (!IsIpAddressOrLocalhost(f.address)) {
      return Bad(f.key, "'" + f.address + "' is not a numeric IPv4/IPv6 address or localhost");
    }
    if (f.port == 0 || IsLoopbackAddress(f.address)) continue;
    const std::string where =
        std::string(f.front) + " front on non-loopback address '" + f.address + "' (" + f.key + ")";
    if (o->tokens_file.empty()) {
      return Status::PermissionDenied(
          "refusing to serve the " + where +
          " without authentication: set [auth] tokens_file (see docs/CONFIG.md), or listen on "
          "127.0.0.1 and use the Unix socket");
    }
    if (!f.tls) {
      return Status::PermissionDenied("refusing to serve the " + where +
                                      " without TLS: set [tls] cert_file, key_file and " + f.front +
                                      " = true (see docs/CONFIG.md), or listen on "
                                      "127.0.0.1");
    }
  }
  return Status::Ok();
}

Status FinalizeEngram(DaemonOptions* o) {
  EngramServeOptions& e = o->engram;
  if (!e.enabled) return Status::Ok();
  if (e.dir.empty()) {
    return Bad("engram.dir", "required when engram.enabled (a `kvtier engram build` output dir)");
  }
  Status st = rdma::ShardMap::ParseEndpoint(e.listen, &e.listen_host, &e.listen_port);
  if (!st.ok()) return Bad("engram.listen", "expected host:port: " + std::string(st.message()));
  if (e.listen_port == 0) return Bad("engram.listen", "port must be 1..65535");
  if (e.advertise.empty()) e.advertise = e.listen;
  std::string adv_host;
  uint16_t adv_port = 0;
  st = rdma::ShardMap::ParseEndpoint(e.advertise, &adv_host, &adv_port);
  if (!st.ok() || adv_port == 0 || e.advertise.size() > 256) {
    return Bad("engram.advertise", "expected host:port (at most 256 bytes)");
  }
  if (e.grant_ttl_ms_max == 0 || e.grant_ttl_ms_max > 24ull * 3600 * 1000) {
    return Bad("engram.grant_ttl_ms_max", "1..86400000 (24 h)");
  }
  if (e.grant_ttl_ms == 0 || e.grant_ttl_ms > e.grant_ttl_ms_max) {
    return Bad("engram.grant_ttl_ms", "1..grant_ttl_ms_max");
  }
  if (e.grants_max == 0) return Bad("engram.grants_max", "at least 1");
  if (e.grants_per_tenant_max == 0 || e.grants_per_tenant_max > e.grants_max) {
    return Bad("engram.grants_per_tenant_max", "1..grants_max");
  }
  if (e.connections_max == 0) return Bad("engram.connections_max", "at least 1");
  if (e.attach_timeout_ms > 3600000) return Bad("engram.attach_timeout_ms", "at most 3600000");
  if (e.body_timeout_ms > 3600000) return Bad("engram.body_timeout_ms", "at most 3600000");
  if (e.regions_per_connection_max == 0) {
    return Bad("engram.regions_per_connection_max", "at least 1");
  }
  if (e.batch_ops_max == 0 || e.batch_ops_max > rdma::wire::kBatchOpsMax) {
    return Bad("engram.batch_ops_max", "1..4096");
  }
  if (e.read_bytes_max == 0 || e.read_bytes_max > rdma::wire::kReadBytesMax) {
    return Bad("engram.read_bytes_max", "1..1048576");
  }
  if (e.response_bytes_max < e.read_bytes_max ||
      e.response_bytes_max > rdma::wire::kResponseDataBytesMax) {
    return Bad("engram.response_bytes_max", "read_bytes_max..67108864");
  }
  if (rdma::verbs::MtuCode(e.verbs_path_mtu_max_bytes) == 0) {
    return Bad("engram.verbs_path_mtu_max_bytes", "256, 512, 1024, 2048 or 4096");
  }
  if (e.verbs_rd_atomic_max == 0 || e.verbs_rd_atomic_max > 255) {
    return Bad("engram.verbs_rd_atomic_max", "1..255");
  }
  if (e.verbs_gid_index > 255) return Bad("engram.verbs_gid_index", "0..255");
  if (e.verbs_registrations_max == 0) {
    return Bad("engram.verbs_registrations_max", "at least 1");
  }
  std::string host = e.listen_host == "localhost" ? "127.0.0.1" : e.listen_host;
  if (o->tokens_file.empty() && !IsLoopbackAddress(host)) {
    return Status::PermissionDenied(
        "refusing to serve Engram tables on non-loopback address '" + e.listen +
        "' without authentication: set [auth] tokens_file (see docs/CONFIG.md), or keep "
        "engram.listen on 127.0.0.1");
  }
  return Status::Ok();
}

}  // namespace kvtier::daemon
