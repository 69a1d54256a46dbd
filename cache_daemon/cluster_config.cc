#include "cache_daemon/cluster_config.h"

#include "cache_daemon/cluster_config_toml.h"
#include "cache_daemon/config.h"
#include "cluster/etcd_client.h"
#include "cluster/http_client.h"
#include "cluster/member.h"
#include "common/toml_integer.h"

namespace kvtier::daemon {
namespace {

Status Bad(const std::string& key, const std::string& why) {
  return Status::InvalidArgument("config key cluster." + key + ": " + why);
}

template <typename T>
Status ReadUint(const toml::node& n, const std::string& key, T* out) {
  std::optional<int64_t> v = TomlInteger(n);
  if (!v || *v < 0 || static_cast<uint64_t>(*v) > std::numeric_limits<T>::max()) {
    return Bad(key, "expected a non-negative integer");
  }
  *out = static_cast<T>(*v);
  return Status::Ok();
}

Status ReadString(const toml::node& n, const std::string& key, std::string* out) {
  std::optional<std::string> v = n.value<std::string>();
  if (!v) return Bad(key, "expected a string");
  *out = *v;
  return Status::Ok();
}

}  // namespace

Status ReadClusterTable(const toml::table& table, ClusterServeOptions* o) {
  for (const auto& [k, v] : table) {
    std::string key(k.str());
    if (key == "enabled") {
      std::optional<bool> b = v.value<bool>();
      if (!b) return Bad(key, "expected true or false");
      o->enabled = *b;
    } else if (key == "etcd_endpoints") {
      const toml::array* a = v.as_array();
      if (a == nullptr) return Bad(key, "expected an array of \"host:port\" strings");
      o->etcd_endpoints.clear();
      for (const auto& e : *a) {
        std::optional<std::string> s = e.value<std::string>();
        if (!s) return Bad(key, "expected an array of \"host:port\" strings");
        o->etcd_endpoints.push_back(*s);
      }
    } else if (key == "key_prefix") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->key_prefix));
    } else if (key == "node_id") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->node_id));
    } else if (key == "peer_listen") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->peer_listen));
    } else if (key == "peer_advertise") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->peer_advertise));
    } else if (key == "failure_domain") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->failure_domain));
    } else if (key == "credential_file") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->credential_file));
    } else if (key == "replicas") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->replicas));
    } else if (key == "write_acks") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->write_acks));
    } else if (key == "lease_ttl_s") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->lease_ttl_s));
    } else if (key == "etcd_timeout_ms") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->etcd_timeout_ms));
    } else if (key == "peer_timeout_ms") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->peer_timeout_ms));
    } else if (key == "peer_probe_interval_ms") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->peer_probe_interval_ms));
    } else if (key == "clock_sample_interval_ms") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->clock_sample_interval_ms));
    } else if (key == "tombstone_ttl_s") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->tombstone_ttl_s));
    } else if (key == "draining") {
      std::optional<bool> b = v.value<bool>();
      if (!b) return Bad(key, "expected true or false");
      o->draining = *b;
    } else if (key == "repair_bytes_per_s") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->repair_bytes_per_s));
    } else if (key == "repair_retry_ms") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->repair_retry_ms));
    } else if (key == "repair_interval_s") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->repair_interval_s));
    } else if (key == "peer_tls" || key == "peer_tls_verify_hostname") {
      std::optional<bool> b = v.value<bool>();
      if (!b) return Bad(key, "expected true or false");
      (key == "peer_tls" ? o->peer_tls : o->peer_tls_verify_hostname) = *b;
    } else if (key == "peer_tls_cert_file") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->peer_tls_cert_file));
    } else if (key == "peer_tls_key_file") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->peer_tls_key_file));
    } else if (key == "peer_tls_ca_file") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->peer_tls_ca_file));
    } else if (key == "peer_call_threads") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->peer_call_threads));
    } else if (key == "peer_call_queue_max") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->peer_call_queue_max));
    } else if (key == "get_copy_bytes_max") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->get_copy_bytes_max));
    } else if (key == "get_copy_ttl_ms") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->get_copy_ttl_ms));
    } else if (key == "peer_data_transport") {
      KVTIER_RETURN_IF_ERROR(ReadString(v, key, &o->peer_data_transport));
    } else if (key == "peer_staging_ring_bytes") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->peer_staging_ring_bytes));
    } else if (key == "peer_staging_grant_ttl_ms") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->peer_staging_grant_ttl_ms));
    } else if (key == "peer_region_port") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->peer_region_port));
    } else if (key == "peer_connections_max") {
      KVTIER_RETURN_IF_ERROR(ReadUint(v, key, &o->peer_connections_max));
    } else {
      return Bad(key, "unknown key");
    }
  }
  return Status::Ok();
}

Status FinalizeCluster(ClusterServeOptions* o, bool auth_enabled) {
  if (!o->enabled) return Status::Ok();
  if (o->etcd_endpoints.empty() || o->etcd_endpoints.size() > 16) {
    return Bad("etcd_endpoints", "1..16 endpoints required when cluster.enabled");
  }
  for (const auto& e : o->etcd_endpoints) {
    Status s = cluster::ParseHttpEndpoint(e).status();
    if (!s.ok()) return Bad("etcd_endpoints", s.message());
  }
  if (o->key_prefix.empty() || o->key_prefix.size() > 256 || o->key_prefix.back() != '/') {
    return Bad("key_prefix", "1..256 bytes ending in '/'");
  }
  if (Status s = cluster::ValidateNodeId(o->node_id); !s.ok()) {
    return Bad("node_id", s.message() + " (required when cluster.enabled)");
  }
  auto listen = cluster::ParseHttpEndpoint(o->peer_listen);
  if (!listen.ok() || !IsIpAddressOrLocalhost(listen->host)) {
    return Bad("peer_listen", "expected a numeric host:port");
  }
  o->peer_host = listen->host;
  o->peer_port = listen->port;
  if (!auth_enabled && !IsLoopbackAddress(o->peer_host)) {
    return Status::PermissionDenied(
        "cluster.peer_listen " + o->peer_listen +
        " is not loopback while auth is off: set auth.tokens_file (docs/CLUSTER.md)");
  }
  if (o->peer_advertise.empty()) o->peer_advertise = o->peer_listen;
  auto adv = cluster::ParseHttpEndpoint(o->peer_advertise);
  if (!adv.ok() || o->peer_advertise.size() > cluster::kPeerEndpointBytesMax) {
    return Bad("peer_advertise", "expected host:port (at most 256 bytes)");
  }
  if (Status s = cluster::ValidateMember(cluster::MemberInfo{.node_id = o->node_id,
                                                             .peer_endpoint = o->peer_advertise,
                                                             .failure_domain = o->failure_domain});
      !s.ok()) {
    return Bad("failure_domain", s.message());
  }
  if (o->replicas < 1 || o->replicas > 16) return Bad("replicas", "1..16");
  if (o->write_acks > o->replicas) return Bad("write_acks", "0 (all live owners)..replicas");
  if (o->credential_file.empty()) {
    return Bad("credential_file", "required when cluster.enabled (a file of >= 32 secret bytes)");
  }
  if (o->lease_ttl_s < 2 || o->lease_ttl_s > 3600) return Bad("lease_ttl_s", "2..3600");
  if (o->etcd_timeout_ms < 10 || o->etcd_timeout_ms > 600000) {
    return Bad("etcd_timeout_ms", "10..600000");
  }
  if (o->peer_timeout_ms < 10 || o->peer_timeout_ms > 600000) {
    return Bad("peer_timeout_ms", "10..600000");
  }
  if (o->peer_probe_interval_ms != 0 &&
      (o->peer_probe_interval_ms < 10 || o->peer_probe_interval_ms > 60000)) {
    return Bad("peer_probe_interval_ms", "0 (off) or 10..60000");
  }
  if (o->clock_sample_interval_ms != 0 &&
      (o->clock_sample_interval_ms < 1000 || o->clock_sample_interval_ms > 3600000)) {
    return Bad("clock_sample_interval_ms", "0 (off) or 1000..3600000");
  }
  if (o->tombstone_ttl_s < 60 || o->tombstone_ttl_s > (1u << 31)) {
    return Bad("tombstone_ttl_s", "60..2147483648");
  }
  if (o->repair_bytes_per_s < 1024 || o->repair_bytes_per_s > (1ull << 40)) {
    return Bad("repair_bytes_per_s", "1024..1099511627776");
  }
  if (o->repair_retry_ms < 10 || o->repair_retry_ms > 3600000) {
    return Bad("repair_retry_ms", "10..3600000");
  }
  if (o->repair_interval_s < 1 || o->repair_interval_s > 86400) {
    return Bad("repair_interval_s", "1..86400");
  }
  if (o->peer_connections_max < 1 || o->peer_connections_max > 65536) {
    return Bad("peer_connections_max", "1..65536");
  }
  if (o->peer_call_threads < 1 || o->peer_call_threads > 1024) {
    return Bad("peer_call_threads", "1..1024");
  }
  if (o->peer_call_queue_max > 65536) return Bad("peer_call_queue_max", "0..65536");
  if (o->get_copy_bytes_max > (1ull << 40)) return Bad("get_copy_bytes_max", "0..1099511627776");
  if (o->get_copy_ttl_ms < 1000 || o->get_copy_ttl_ms > 3600000) {
    return Bad("get_copy_ttl_ms", "1000..3600000");
  }
  if (o->peer_data_transport != "peer" && o->peer_data_transport != "tcp_region" &&
      o->peer_data_transport != "verbs") {
    return Bad("peer_data_transport", "\"peer\", \"tcp_region\" or \"verbs\"");
  }
  if (o->peer_staging_ring_bytes < (64u << 10) || o->peer_staging_ring_bytes > (1ull << 36) ||
      o->peer_staging_ring_bytes % 4096 != 0) {
    return Bad("peer_staging_ring_bytes", "a multiple of 4096 in 65536..68719476736");
  }
  if (o->peer_staging_grant_ttl_ms < 1000 || o->peer_staging_grant_ttl_ms > 86400000) {
    return Bad("peer_staging_grant_ttl_ms", "1000..86400000");
  }
  if (o->peer_tls && o->peer_data_transport != "peer") {
    return Bad("peer_data_transport",
               "must be \"peer\" with cluster.peer_tls (the region transport is not encrypted)");
  }
  if (o->peer_tls) {
    for (const auto& [key, path] : {std::pair{"peer_tls_cert_file", &o->peer_tls_cert_file},
                                    std::pair{"peer_tls_key_file", &o->peer_tls_key_file},
                                    std::pair{"peer_tls_ca_file", &o->peer_tls_ca_file}}) {
      if (path->empty()) return Bad(key, "required when cluster.peer_tls is true");
    }
  }
  return Status::Ok();
}

}  // namespace kvtier::daemon
