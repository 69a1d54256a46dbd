#include "cluster/etcd_client.h"

#include <charconv>
#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>

#include "cluster/base64.h"

namespace kvtier::cluster {
namespace {

using json = nlohmann::json;

// The gateway writes int64 fields as JSON strings; accept numbers too. Absent -> 0.
StatusOr<int64_t> Int64Field(const json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return int64_t{0};
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    int64_t v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec == std::errc() && p == s.data() + s.size()) return v;
  }
  return Status::Corruption(std::string("etcd reply: field '") + name + "' is not an integer");
}

StatusOr<std::string> BytesField(const json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return std::string();
  if (!it->is_string()) {
    return Status::Corruption(std::string("etcd reply: field '") + name + "' is not a string");
  }
  return Base64Decode(it->get_ref<const std::string&>());
}

StatusOr<EtcdKeyValue> ParseKeyValue(const json& kv) {
  if (!kv.is_object()) return Status::Corruption("etcd reply: kv is not an object");
  EtcdKeyValue out;
  KVTIER_ASSIGN_OR_RETURN(out.key, BytesField(kv, "key"));
  KVTIER_ASSIGN_OR_RETURN(out.value, BytesField(kv, "value"));
  KVTIER_ASSIGN_OR_RETURN(out.mod_revision, Int64Field(kv, "mod_revision"));
  KVTIER_ASSIGN_OR_RETURN(out.lease, Int64Field(kv, "lease"));
  return out;
}

StatusOr<json> ParseJson(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption("etcd reply is not JSON");
  return j;
}

// An {"error": ..., "code": N, "message": ...} reply as a Status (gRPC code 5 = NOT_FOUND).
Status ErrorReply(const json& j) {
  std::string message = j.value("message", j.value("error", std::string("unknown error")));
  int code = j.value("code", 0);
  if (code == 5 || message.find("not found") != std::string::npos) {
    return Status::NotFound("etcd: " + message);
  }
  return Status::IOError("etcd: " + message);
}

}  // namespace

Status ValidateEtcdOptions(const EtcdOptions& options) {
  if (options.endpoints.empty()) return Status::InvalidArgument("no etcd endpoint");
  for (const auto& e : options.endpoints) KVTIER_RETURN_IF_ERROR(ParseHttpEndpoint(e).status());
  if (options.request_timeout_ms < 10 || options.request_timeout_ms > 600000) {
    return Status::InvalidArgument("etcd request_timeout_ms: want 10..600000");
  }
  if (options.response_bytes_max < 4096) {
    return Status::InvalidArgument("etcd response_bytes_max: want at least 4096");
  }
  return Status::Ok();
}

std::string PrefixRangeEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<uint8_t>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<uint8_t>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {
  for (const auto& e : options_.endpoints) {
    auto ep = ParseHttpEndpoint(e);
    if (ep.ok()) endpoints_.push_back(*ep);
  }
}

StatusOr<std::string> EtcdClient::Call(std::string_view path, const std::string& body) {
  HttpLimits limits;
  limits.timeout_ms = options_.request_timeout_ms;
  limits.body_bytes_max = options_.response_bytes_max;
  limits.chunk_bytes_max = options_.response_bytes_max;
  Status last = Status::Unavailable("no etcd endpoint configured");
  for (const auto& ep : endpoints_) {
    auto r = HttpPost(ep, path, body, limits);
    if (!r.ok()) {
      last = Status::Unavailable("etcd " + ep.ToString() + ": " + r.status().message());
      continue;
    }
    KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(r->body));
    if (r->status != 200 || j.contains("error")) return ErrorReply(j);
    return std::move(r->body);
  }
  return last;
}

Status EtcdClient::Put(std::string_view key, std::string_view value, int64_t lease_id) {
  json req = {{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease_id != 0) req["lease"] = std::to_string(lease_id);
  return Call("/v3/kv/put", req.dump()).status();
}

StatusOr<EtcdRangeResult> EtcdClient::RangePrefix(std::string_view prefix, int64_t limit,
                                                  int64_t min_mod_revision) {
  json req = {{"key", Base64Encode(prefix)}, {"range_end", Base64Encode(PrefixRangeEnd(prefix))}};
  if (limit > 0) req["limit"] = std::to_string(limit);
  if (min_mod_revision > 0) req["min_mod_revision"] = std::to_string(min_mod_revision);
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/kv/range", req.dump()));
  KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(text));
  EtcdRangeResult out;
  if (!j.contains("header")) return Status::Corruption("etcd range reply without header");
  KVTIER_ASSIGN_OR_RETURN(out.revision, Int64Field(j["header"], "revision"));
  if (j.contains("kvs")) {
    if (!j["kvs"].is_array()) return Status::Corruption("etcd range reply: kvs not an array");
    for (const auto& kv : j["kvs"]) {
      KVTIER_ASSIGN_OR_RETURN(EtcdKeyValue parsed, ParseKeyValue(kv));
      out.kvs.push_back(std::move(parsed));
    }
  }
  return out;
}

Status EtcdClient::PutMany(const std::vector<std::pair<std::string, std::string>>& kvs,
                           int64_t lease_id) {
  if (kvs.empty()) return Status::Ok();
  if (kvs.size() > kTxnOpsMax) return Status::InvalidArgument("etcd txn over kTxnOpsMax puts");
  json ops = json::array();
  for (const auto& [k, v] : kvs) {
    json put = {{"key", Base64Encode(k)}, {"value", Base64Encode(v)}};
    if (lease_id != 0) put["lease"] = std::to_string(lease_id);
    ops.push_back({{"request_put", put}});
  }
  return Call("/v3/kv/txn", json{{"success", ops}}.dump()).status();
}

StatusOr<bool> EtcdClient::ReplaceIfUnchanged(std::string_view key, std::string_view value,
                                              int64_t mod_revision) {
  json compare = {{"key", Base64Encode(key)},
                  {"target", "MOD"},
                  {"result", "EQUAL"},
                  {"mod_revision", std::to_string(mod_revision)}};
  json put = {{"key", Base64Encode(key)}, {"value", Base64Encode(value)}, {"ignore_lease", true}};
  json req = {{"compare", json::array({compare})},
              {"success", json::array({{{"request_put", put}}})}};
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/kv/txn", req.dump()));
  KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(text));
  auto it = j.find("succeeded");
  return it != j.end() && it->is_boolean() && it->get<bool>();
}

StatusOr<EtcdKeyValue> EtcdClient::Get(std::string_view key) {
  json req = {{"key", Base64Encode(key)}};
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/kv/range", req.dump()));
  KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(text));
  if (!j.contains("kvs") || !j["kvs"].is_array() || j["kvs"].empty()) {
    return Status::NotFound("etcd: no key " + std::string(key));
  }
  return ParseKeyValue(j["kvs"][0]);
}

StatusOr<int64_t> EtcdClient::Delete(std::string_view key, std::string_view range_end) {
  json req = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) req["range_end"] = Base64Encode(range_end);
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/kv/deleterange", req.dump()));
  KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(text));
  return Int64Field(j, "deleted");
}

StatusOr<EtcdLease> EtcdClient::LeaseGrant(int64_t ttl_s) {
  json req = {{"TTL", std::to_string(ttl_s)}};
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/lease/grant", req.dump()));
  KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(text));
  EtcdLease lease;
  KVTIER_ASSIGN_OR_RETURN(lease.id, Int64Field(j, "ID"));
  KVTIER_ASSIGN_OR_RETURN(lease.ttl_s, Int64Field(j, "TTL"));
  if (lease.id == 0 || lease.ttl_s <= 0) return Status::Corruption("etcd lease grant: no lease");
  return lease;
}

StatusOr<int64_t> EtcdClient::LeaseKeepAlive(int64_t lease_id) {
  // The gateway answers a one-message stream: {"result": {"ID": .., "TTL": ..}}; an expired
  // lease comes back with TTL absent or 0.
  json req = {{"ID", std::to_string(lease_id)}};
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/lease/keepalive", req.dump()));
  size_t eol = text.find('\n');
  KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(std::string_view(text).substr(0, eol)));
  if (!j.contains("result") || !j["result"].is_object()) {
    return Status::Corruption("etcd keepalive reply without result");
  }
  KVTIER_ASSIGN_OR_RETURN(int64_t ttl, Int64Field(j["result"], "TTL"));
  if (ttl <= 0) return Status::NotFound("etcd lease " + std::to_string(lease_id) + " expired");
  return ttl;
}

Status EtcdClient::LeaseRevoke(int64_t lease_id) {
  json req = {{"ID", std::to_string(lease_id)}};
  return Call("/v3/lease/revoke", req.dump()).status();
}

StatusOr<int64_t> EtcdClient::LeaseTimeToLive(int64_t lease_id) {
  // {"ID": .., "TTL": .., "grantedTTL": ..}; an expired or unknown lease has TTL -1.
  json req = {{"ID", std::to_string(lease_id)}};
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/lease/timetolive", req.dump()));
  KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(text));
  KVTIER_ASSIGN_OR_RETURN(int64_t ttl, Int64Field(j, "TTL"));
  if (ttl < 0) return Status::NotFound("etcd lease " + std::to_string(lease_id) + " expired");
  return ttl;
}

Status EtcdClient::Watch(std::string_view prefix, int64_t start_revision,
                         const EventSink& on_events, const std::atomic<bool>* stop,
                         uint64_t poll_ms) {
  json create = {{"key", Base64Encode(prefix)},
                 {"range_end", Base64Encode(PrefixRangeEnd(prefix))}};
  if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
  std::string body = json{{"create_request", create}}.dump();
  HttpLimits limits;
  limits.timeout_ms = options_.request_timeout_ms;
  limits.chunk_bytes_max = options_.response_bytes_max;

  std::unique_ptr<HttpStream> stream;
  Status opened = Status::Unavailable("no etcd endpoint configured");
  for (const auto& ep : endpoints_) {
    stream = std::make_unique<HttpStream>();
    opened = stream->Open(ep, "/v3/watch", body, limits);
    if (opened.ok()) break;
    opened = Status::Unavailable("etcd watch " + ep.ToString() + ": " + opened.message());
  }
  if (!opened.ok()) return opened;
  if (stream->status() != 200) {
    return Status::IOError("etcd watch: HTTP status " + std::to_string(stream->status()));
  }

  std::string pending;
  while (!stop->load(std::memory_order_acquire)) {
    Status s = stream->Read(poll_ms, &pending);
    if (s.IsRetry()) continue;
    if (s.IsNotFound()) return Status::IOError("etcd watch stream ended");
    if (!s.ok()) return s;
    if (pending.size() > options_.response_bytes_max) {
      return Status::Rejected("etcd watch message over response_bytes_max");
    }
    size_t eol;
    while ((eol = pending.find('\n')) != std::string::npos) {
      std::string line = pending.substr(0, eol);
      pending.erase(0, eol + 1);
      if (line.empty() || line == "\r") continue;
      KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(line));
      if (j.contains("error")) return ErrorReply(j);
      if (!j.contains("result") || !j["result"].is_object()) {
        return Status::Corruption("etcd watch message without result");
      }
      const json& r = j["result"];
      KVTIER_ASSIGN_OR_RETURN(int64_t compacted, Int64Field(r, "compact_revision"));
      if (compacted > 0) {
        return Status::Rejected("etcd watch: revision compacted at " + std::to_string(compacted));
      }
      if (r.value("canceled", false)) return Status::IOError("etcd watch canceled");
      int64_t revision = 0;
      if (r.contains("header")) {
        KVTIER_ASSIGN_OR_RETURN(revision, Int64Field(r["header"], "revision"));
      }
      std::vector<EtcdEvent> events;
      if (r.contains("events")) {
        if (!r["events"].is_array()) return Status::Corruption("etcd watch: events not an array");
        for (const auto& e : r["events"]) {
          if (!e.is_object() || !e.contains("kv")) {
            return Status::Corruption("etcd watch: event without kv");
          }
          EtcdEvent ev;
          ev.type = e.value("type", std::string("PUT")) == "DELETE" ? EtcdEvent::Type::kDelete
                                                                    : EtcdEvent::Type::kPut;
          KVTIER_ASSIGN_OR_RETURN(ev.kv, ParseKeyValue(e["kv"]));
          events.push_back(std::move(ev));
        }
      }
      if (!events.empty() || revision > 0) on_events(events, revision);
    }
  }
  return Status::Ok();
}

}  // namespace kvtier::cluster
