#include "cluster/etcd_client.h"

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>

#include "cluster/base64.h"
#include "cluster/etcd_reply.h"

namespace kvtier::cluster {

using json = nlohmann::json;

namespace {

// A key etcd returned for a prefix range starts with the prefix; one that does not is a reply
// etcd does not send (and callers strip the prefix off).
Status UnderPrefix(std::string_view key, std::string_view prefix) {
  if (key.starts_with(prefix)) return Status::Ok();
  return Status::Corruption("etcd reply: a key outside the prefix asked for");
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
    Status reply = etcd_reply::CheckUnary(r->status, r->body);
    if (reply.IsCorruption()) {  // not etcd speaking (a proxy's page, another service): next
      last = Status::Unavailable("etcd " + ep.ToString() + ": " + reply.message());
      continue;
    }
    KVTIER_RETURN_IF_ERROR(reply);
    return std::move(r->body);
  }
  return last;
}

Status EtcdClient::Put(std::string_view key, std::string_view value, int64_t lease_id) {
  json req = {{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease_id != 0) req["lease"] = std::to_string(lease_id);
  return Call("/v3/kv/put", req.dump()).status();
}

StatusOr<EtcdRangeResult> EtcdClient::Range(std::string_view prefix, std::string_view key,
                                            std::string_view range_end, int64_t limit,
                                            int64_t min_mod_revision, int64_t revision) {
  json req = {{"key", Base64Encode(key)}, {"range_end", Base64Encode(range_end)}};
  if (limit > 0) req["limit"] = std::to_string(limit);
  if (min_mod_revision > 0) req["min_mod_revision"] = std::to_string(min_mod_revision);
  if (revision > 0) req["revision"] = std::to_string(revision);
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/kv/range", req.dump()));
  KVTIER_ASSIGN_OR_RETURN(EtcdRangeResult range, etcd_reply::Range(text));
  for (const EtcdKeyValue& kv : range.kvs) KVTIER_RETURN_IF_ERROR(UnderPrefix(kv.key, prefix));
  return range;
}

StatusOr<EtcdRangeResult> EtcdClient::RangePrefix(std::string_view prefix, int64_t limit,
                                                  int64_t min_mod_revision) {
  return Range(prefix, prefix, PrefixRangeEnd(prefix), limit, min_mod_revision, 0);
}

StatusOr<int64_t> EtcdClient::RangePrefixPaged(std::string_view prefix, int64_t page_keys,
                                               int64_t min_mod_revision, int64_t revision,
                                               const PageSink& on_page) {
  if (page_keys <= 0) return Status::InvalidArgument("etcd paged range: page_keys must be > 0");
  const std::string end = PrefixRangeEnd(prefix);
  std::string from(prefix);
  for (;;) {
    KVTIER_ASSIGN_OR_RETURN(EtcdRangeResult page,
                            Range(prefix, from, end, page_keys, min_mod_revision, revision));
    if (revision == 0) revision = page.revision;  // the snapshot every later page reads
    if (!page.kvs.empty()) KVTIER_RETURN_IF_ERROR(on_page(page.kvs));
    // "more" without a key to continue after would loop forever: a reply etcd does not send.
    if (!page.more) return revision;
    if (page.kvs.empty()) return Status::Corruption("etcd range reply: more, but no key");
    if (page.kvs.back().key < from) {
      return Status::Corruption("etcd range reply: a key before the page asked for");
    }
    // The next page starts just after this one's last key (keys come in key order).
    from = page.kvs.back().key;
    from.push_back('\0');
  }
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
  return etcd_reply::TxnSucceeded(text);
}

StatusOr<EtcdKeyValue> EtcdClient::Get(std::string_view key) {
  json req = {{"key", Base64Encode(key)}};
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/kv/range", req.dump()));
  auto kv = etcd_reply::FirstKeyValue(text);
  if (kv.status().IsNotFound()) return Status::NotFound("etcd: no key " + std::string(key));
  if (kv.ok() && kv->key != key) return Status::Corruption("etcd range reply: another key");
  return kv;
}

StatusOr<int64_t> EtcdClient::Delete(std::string_view key, std::string_view range_end) {
  json req = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) req["range_end"] = Base64Encode(range_end);
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/kv/deleterange", req.dump()));
  return etcd_reply::Deleted(text);
}

StatusOr<EtcdLease> EtcdClient::LeaseGrant(int64_t ttl_s) {
  json req = {{"TTL", std::to_string(ttl_s)}};
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/lease/grant", req.dump()));
  return etcd_reply::LeaseGranted(text);
}

StatusOr<int64_t> EtcdClient::LeaseKeepAlive(int64_t lease_id) {
  json req = {{"ID", std::to_string(lease_id)}};
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/lease/keepalive", req.dump()));
  KVTIER_ASSIGN_OR_RETURN(int64_t ttl, etcd_reply::KeepAliveTtl(text));
  if (ttl <= 0) return Status::NotFound("etcd lease " + std::to_string(lease_id) + " expired");
  return ttl;
}

Status EtcdClient::LeaseRevoke(int64_t lease_id) {
  json req = {{"ID", std::to_string(lease_id)}};
  return Call("/v3/lease/revoke", req.dump()).status();
}

StatusOr<int64_t> EtcdClient::LeaseTimeToLive(int64_t lease_id) {
  json req = {{"ID", std::to_string(lease_id)}};
  KVTIER_ASSIGN_OR_RETURN(std::string text, Call("/v3/lease/timetolive", req.dump()));
  KVTIER_ASSIGN_OR_RETURN(int64_t ttl, etcd_reply::TimeToLive(text));
  if (ttl < 0) return Status::NotFound("etcd lease " + std::to_string(lease_id) + " expired");
  return ttl;
}

Status EtcdClient::Watch(std::string_view prefix, int64_t start_revision,
                         const EventSink& on_events, const std::atomic<bool>* stop,
                         uint64_t poll_ms) {
  json create = {{"key", Base64Encode(prefix)},
                 {"range_end", Base64Encode(PrefixRangeEnd(prefix))}};
  if (start_revision > 0) create["start_revision"] = std::to_string(start_revision);
  create["progress_notify"] = true;  // an etcd configured to send them keeps the watch alive
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
  auto last_byte = std::chrono::steady_clock::now();
  while (!stop->load(std::memory_order_acquire)) {
    const size_t before = pending.size();
    Status s = stream->Read(poll_ms, &pending);
    const auto now = std::chrono::steady_clock::now();
    if (pending.size() > before) last_byte = now;
    if (options_.watch_silence_ms_max > 0 &&
        now - last_byte > std::chrono::milliseconds(options_.watch_silence_ms_max)) {
      return Status::Retry("etcd watch: no message for " +
                           std::to_string(options_.watch_silence_ms_max) + " ms");
    }
    if (s.IsRetry()) continue;
    if (s.IsNotFound()) return Status::IOError("etcd watch stream ended");
    if (!s.ok()) return s;
    if (pending.size() > options_.response_bytes_max) {
      return Status::Rejected("etcd watch message over response_bytes_max");
    }
    // Every complete line, then what is left of the last one (one erase: a stream of many
    // short lines costs linear time).
    size_t begin = 0, eol;
    while ((eol = pending.find('\n', begin)) != std::string::npos) {
      std::string_view line(pending.data() + begin, eol - begin);
      begin = eol + 1;
      if (line.empty() || line == "\r") continue;
      KVTIER_ASSIGN_OR_RETURN(EtcdWatchMessage message, etcd_reply::WatchMessage(line));
      for (const EtcdEvent& e : message.events) {
        KVTIER_RETURN_IF_ERROR(UnderPrefix(e.kv.key, prefix));
      }
      if (!message.events.empty() || message.revision > 0) {
        on_events(message.events, message.revision);
      }
    }
    pending.erase(0, begin);
  }
  return Status::Ok();
}

}  // namespace kvtier::cluster
