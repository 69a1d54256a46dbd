// Reading etcd v3 JSON gateway replies: pure functions of a reply's text, apart from the
// socket, so that every shape a reply can take is tested (tests/cluster/etcd_reply_test.cc) and
// fuzzed (tests/fuzz/etcd_reply_fuzz.cc) without an etcd.
//
// A reply is hostile input: whatever sits at an etcd endpoint (a different service, a
// proxy's error page, a buggy gateway) may answer. Every function returns a Status for every
// input, and never throws:
//   - Corruption (naming the field) for a reply that is not what etcd sends: not a JSON object,
//     a field of the wrong JSON type, an integer that does not parse, bytes that are not base64;
//   - NotFound / IOError for etcd's own error replies (ErrorOf);
//   - for a watch message, Rejected when the watched revision was compacted and IOError when
//     etcd canceled the watch.
// Integer fields may be JSON strings (as the gateway writes int64) or JSON integers; an absent
// or null field is 0 / empty, as in protobuf's JSON mapping.
//
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::cluster {

struct EtcdKeyValue {
  std::string key, value;
  int64_t mod_revision = 0;
  int64_t lease = 0;
  bool operator==(const EtcdKeyValue&) const = default;
};

struct EtcdRangeResult {
  std::vector<EtcdKeyValue> kvs;
  int64_t revision = 0;  // the store revision the range was read at
  bool more = false;     // more keys matched than the request's limit let through
};

struct EtcdLease {
  int64_t id = 0;
  int64_t ttl_s = 0;
};

struct EtcdEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  EtcdKeyValue kv;  // for kDelete, key and mod_revision only
  bool operator==(const EtcdEvent&) const = default;
};

// One message of a /v3/watch stream: its events and the revision it brings the watcher to
// (0 when the message has no header).
struct EtcdWatchMessage {
  std::vector<EtcdEvent> events;
  int64_t revision = 0;
};

namespace etcd_reply {

// Every reply to a unary call: Ok when http_status is 200 and the body is a JSON object without
// an "error" field; ErrorOf's Status when it has one (or the status is not 200); Corruption when
// the body is not a JSON object.
Status CheckUnary(int http_status, std::string_view body);

// /v3/kv/range: the key-values in reply order, the header's revision and "more" (Corruption
// without a header).
StatusOr<EtcdRangeResult> Range(std::string_view body);
// /v3/kv/range for one key: its key-value; NotFound when the reply has none.
StatusOr<EtcdKeyValue> FirstKeyValue(std::string_view body);
// /v3/kv/txn: whether the transaction's compare succeeded (false when the field is absent).
StatusOr<bool> TxnSucceeded(std::string_view body);
// /v3/kv/deleterange: how many keys were deleted.
StatusOr<int64_t> Deleted(std::string_view body);
// /v3/lease/grant: the lease (Corruption when its ID is 0 or its TTL not positive).
StatusOr<EtcdLease> LeaseGranted(std::string_view body);
// /v3/lease/keepalive (a one-message stream: its first line is read): the TTL the lease was
// refreshed to; 0 when etcd no longer knows the lease.
StatusOr<int64_t> KeepAliveTtl(std::string_view body);
// /v3/lease/timetolive: the seconds the lease has left; -1 when etcd does not know it.
StatusOr<int64_t> TimeToLive(std::string_view body);
// One line of a /v3/watch stream.
StatusOr<EtcdWatchMessage> WatchMessage(std::string_view line);

}  // namespace etcd_reply
}  // namespace kvtier::cluster
