#include "cluster/etcd_reply.h"

#include <charconv>
#include <nlohmann/json.hpp>

#include "cluster/base64.h"

namespace kvtier::cluster::etcd_reply {
namespace {

using json = nlohmann::json;

Status Mistyped(const char* name, const char* want) {
  return Status::Corruption(std::string("etcd reply: field '") + name + "' is not " + want);
}

// The field, or nullptr when it is absent or null.
const json* Field(const json& object, const char* name) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(name);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

StatusOr<int64_t> Int64Field(const json& object, const char* name) {
  const json* f = Field(object, name);
  if (f == nullptr) return int64_t{0};
  if (f->is_number_integer()) {
    if (f->is_number_unsigned() && f->get<uint64_t>() > uint64_t{INT64_MAX}) {
      return Mistyped(name, "an int64");
    }
    return f->get<int64_t>();
  }
  if (f->is_string()) {
    const std::string& s = f->get_ref<const std::string&>();
    int64_t v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec == std::errc() && p == s.data() + s.size() && !s.empty()) return v;
  }
  return Mistyped(name, "an int64");
}

StatusOr<bool> BoolField(const json& object, const char* name) {
  const json* f = Field(object, name);
  if (f == nullptr) return false;
  if (!f->is_boolean()) return Mistyped(name, "a boolean");
  return f->get<bool>();
}

StatusOr<std::string> BytesField(const json& object, const char* name) {
  const json* f = Field(object, name);
  if (f == nullptr) return std::string();
  if (!f->is_string()) return Mistyped(name, "a string");
  auto bytes = Base64Decode(f->get_ref<const std::string&>());
  if (!bytes.ok()) return Mistyped(name, "base64");
  return bytes;
}

// An object-valued field; an absent one reads as an empty object.
StatusOr<const json*> ObjectField(const json& object, const char* name) {
  static const json kEmpty = json::object();
  const json* f = Field(object, name);
  if (f == nullptr) return &kEmpty;
  if (!f->is_object()) return Mistyped(name, "an object");
  return f;
}

StatusOr<EtcdKeyValue> KeyValue(const json& kv) {
  if (!kv.is_object()) return Status::Corruption("etcd reply: a kv is not an object");
  EtcdKeyValue out;
  KVTIER_ASSIGN_OR_RETURN(out.key, BytesField(kv, "key"));
  KVTIER_ASSIGN_OR_RETURN(out.value, BytesField(kv, "value"));
  KVTIER_ASSIGN_OR_RETURN(out.mod_revision, Int64Field(kv, "mod_revision"));
  KVTIER_ASSIGN_OR_RETURN(out.lease, Int64Field(kv, "lease"));
  return out;
}

StatusOr<std::vector<EtcdKeyValue>> KeyValues(const json& reply) {
  std::vector<EtcdKeyValue> out;
  const json* kvs = Field(reply, "kvs");
  if (kvs == nullptr) return out;
  if (!kvs->is_array()) return Mistyped("kvs", "an array");
  out.reserve(kvs->size());
  for (const json& kv : *kvs) {
    KVTIER_ASSIGN_OR_RETURN(EtcdKeyValue parsed, KeyValue(kv));
    out.push_back(std::move(parsed));
  }
  return out;
}

StatusOr<json> Object(std::string_view text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption("etcd reply is not JSON");
  return j;
}

// etcd's error reply as a Status. Unary calls answer {"error": "...", "code": N, "message":
// "..."}; a stream answers {"error": {"grpc_code": N, "message": "..."}}. gRPC code 5 is
// NOT_FOUND. Fields of unexpected types are passed over: the reply is an error either way.
Status ErrorOf(const json& j) {
  const json* error = Field(j, "error");
  std::string message;
  int64_t code = 0;
  for (const json* holder : {&j, error}) {
    if (holder == nullptr || !holder->is_object()) continue;
    if (const json* m = Field(*holder, "message"); m != nullptr && m->is_string()) {
      message = m->get<std::string>();
    }
    for (const char* name : {"code", "grpc_code"}) {
      if (const json* c = Field(*holder, name); c != nullptr && c->is_number_integer()) {
        code = c->get<int64_t>();
      }
    }
  }
  if (message.empty() && error != nullptr && error->is_string())
    message = error->get<std::string>();
  if (message.empty()) message = "unknown error";
  if (code == 5 || message.find("not found") != std::string::npos) {
    return Status::NotFound("etcd: " + message);
  }
  return Status::IOError("etcd: " + message);
}

StatusOr<EtcdEvent> Event(const json& e) {
  if (!e.is_object()) return Status::Corruption("etcd watch: an event is not an object");
  const json* kv = Field(e, "kv");
  if (kv == nullptr) return Status::Corruption("etcd watch: an event without kv");
  EtcdEvent out;
  // protobuf's JSON mapping writes an enum by name; its number is accepted too.
  if (const json* type = Field(e, "type"); type != nullptr) {
    if (*type == "PUT" || *type == 0) {
      out.type = EtcdEvent::Type::kPut;
    } else if (*type == "DELETE" || *type == 1) {
      out.type = EtcdEvent::Type::kDelete;
    } else {
      return Mistyped("type", "PUT or DELETE");
    }
  }
  KVTIER_ASSIGN_OR_RETURN(out.kv, KeyValue(*kv));
  return out;
}

}  // namespace

Status CheckUnary(int http_status, std::string_view body) {
  KVTIER_ASSIGN_OR_RETURN(json j, Object(body));
  if (http_status != 200 || j.contains("error")) return ErrorOf(j);
  return Status::Ok();
}

StatusOr<EtcdRangeResult> Range(std::string_view body) {
  KVTIER_ASSIGN_OR_RETURN(json j, Object(body));
  const json* header = Field(j, "header");
  if (header == nullptr) return Status::Corruption("etcd range reply without header");
  if (!header->is_object()) return Mistyped("header", "an object");
  EtcdRangeResult out;
  KVTIER_ASSIGN_OR_RETURN(out.revision, Int64Field(*header, "revision"));
  KVTIER_ASSIGN_OR_RETURN(out.kvs, KeyValues(j));
  KVTIER_ASSIGN_OR_RETURN(out.more, BoolField(j, "more"));
  return out;
}

StatusOr<EtcdKeyValue> FirstKeyValue(std::string_view body) {
  KVTIER_ASSIGN_OR_RETURN(json j, Object(body));
  KVTIER_ASSIGN_OR_RETURN(std::vector<EtcdKeyValue> kvs, KeyValues(j));
  if (kvs.empty()) return Status::NotFound("etcd: no such key");
  return std::move(kvs.front());
}

StatusOr<bool> TxnSucceeded(std::string_view body) {
  KVTIER_ASSIGN_OR_RETURN(json j, Object(body));
  return BoolField(j, "succeeded");
}

StatusOr<int64_t> Deleted(std::string_view body) {
  KVTIER_ASSIGN_OR_RETURN(json j, Object(body));
  return Int64Field(j, "deleted");
}

StatusOr<EtcdLease> LeaseGranted(std::string_view body) {
  KVTIER_ASSIGN_OR_RETURN(json j, Object(body));
  EtcdLease lease;
  KVTIER_ASSIGN_OR_RETURN(lease.id, Int64Field(j, "ID"));
  KVTIER_ASSIGN_OR_RETURN(lease.ttl_s, Int64Field(j, "TTL"));
  if (lease.id == 0 || lease.ttl_s <= 0) return Status::Corruption("etcd lease grant: no lease");
  return lease;
}

StatusOr<int64_t> KeepAliveTtl(std::string_view body) {
  // {"result": {"ID": .., "TTL": ..}} and a newline; an expired lease has TTL absent or 0.
  KVTIER_ASSIGN_OR_RETURN(json j, Object(body.substr(0, body.find('\n'))));
  const json* result = Field(j, "result");
  if (result == nullptr || !result->is_object()) {
    return Status::Corruption("etcd keepalive reply without result");
  }
  KVTIER_ASSIGN_OR_RETURN(int64_t ttl, Int64Field(*result, "TTL"));
  return ttl < 0 ? 0 : ttl;
}

StatusOr<int64_t> TimeToLive(std::string_view body) {
  // {"ID": .., "TTL": .., "grantedTTL": ..}; an expired or unknown lease has TTL -1.
  KVTIER_ASSIGN_OR_RETURN(json j, Object(body));
  KVTIER_ASSIGN_OR_RETURN(int64_t ttl, Int64Field(j, "TTL"));
  return ttl < 0 ? -1 : ttl;
}

StatusOr<EtcdWatchMessage> WatchMessage(std::string_view line) {
  KVTIER_ASSIGN_OR_RETURN(json j, Object(line));
  if (j.contains("error")) return ErrorOf(j);
  const json* result = Field(j, "result");
  if (result == nullptr || !result->is_object()) {
    return Status::Corruption("etcd watch message without result");
  }
  KVTIER_ASSIGN_OR_RETURN(int64_t compacted, Int64Field(*result, "compact_revision"));
  if (compacted > 0) {
    return Status::Rejected("etcd watch: revision compacted at " + std::to_string(compacted));
  }
  KVTIER_ASSIGN_OR_RETURN(bool canceled, BoolField(*result, "canceled"));
  if (canceled) return Status::IOError("etcd watch canceled");
  EtcdWatchMessage out;
  KVTIER_ASSIGN_OR_RETURN(const json* header, ObjectField(*result, "header"));
  KVTIER_ASSIGN_OR_RETURN(out.revision, Int64Field(*header, "revision"));
  if (const json* events = Field(*result, "events"); events != nullptr) {
    if (!events->is_array()) return Mistyped("events", "an array");
    out.events.reserve(events->size());
    for (const json& e : *events) {
      KVTIER_ASSIGN_OR_RETURN(EtcdEvent event, Event(e));
      out.events.push_back(std::move(event));
    }
  }
  return out;
}

}  // namespace kvtier::cluster::etcd_reply
