// EtcdClient: the few etcd v3 calls kvtier's cluster mode needs, spoken through etcd's JSON
// gateway (POST /v3/kv/range, /v3/kv/put, /v3/kv/deleterange, /v3/lease/grant,
// /v3/lease/keepalive, /v3/lease/revoke,
// /v3/lease/timetolive, /v3/watch) over plain HTTP. Keys and values are raw
// bytes here; the client base64-encodes them on the wire. Tested against etcd 3.4
// (tests/cluster/etcd_membership_test.cc starts a real one).
//
// Each call opens one connection to the first endpoint that answers as etcd does (endpoints are
// tried in order; one that cannot be reached, answers malformed HTTP or a reply over a limit, or
// answers with a body that is not a JSON object, is passed over), with a bounded deadline
// (EtcdOptions::request_timeout_ms). Errors: Unavailable when no endpoint answered as etcd does,
// NotFound for an expired / unknown lease, Corruption for a JSON reply of the wrong shape (a
// field of another type, a key outside the prefix asked for), IOError for any other etcd error
// (its message included); Watch as it says. Replies are read by cluster/etcd_reply.h.
//
// Thread safety: every method may be called concurrently (no shared mutable state).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "cluster/etcd_reply.h"
#include "cluster/http_client.h"
#include "common/status.h"

namespace kvtier::cluster {

struct EtcdOptions {
  std::vector<std::string> endpoints;         // "host:port" or "http://host:port", at least one
  uint64_t request_timeout_ms = 2000;         // one unary call to one endpoint
  uint64_t response_bytes_max = 16ull << 20;  // one unary reply / one watch message
  // A watch stream that brings no byte for this long is ended (Retry), so that a connection
  // that died without a close (the etcd host lost, a NAT or firewall dropping the idle flow)
  // cannot leave a watcher waiting for ever; the caller re-reads and watches again. etcd
  // sends nothing on an idle watch (its progress notifications come every 10 minutes by
  // default), so an idle cluster renews its watch this often. 0: never.
  uint64_t watch_silence_ms_max = 30000;
};
// InvalidArgument naming the bad endpoint or value.
Status ValidateEtcdOptions(const EtcdOptions& options);

// The smallest key greater than every key starting with prefix ("\0" when none: all keys).
std::string PrefixRangeEnd(std::string_view prefix);

class EtcdClient {
 public:
  // options must pass ValidateEtcdOptions (endpoints that do not parse are skipped).
  explicit EtcdClient(EtcdOptions options);

  // Writes key = value, attached to lease_id when it is not 0 (NotFound: lease expired).
  Status Put(std::string_view key, std::string_view value, int64_t lease_id = 0);
  // Every key starting with prefix, in key order, limited to limit keys (0: no limit), and
  // to keys last modified at min_mod_revision or later (0: any). A reply with a key that does
  // not start with prefix is Corruption (so callers may strip the prefix off every key).
  StatusOr<EtcdRangeResult> RangePrefix(std::string_view prefix, int64_t limit = 0,
                                        int64_t min_mod_revision = 0);
  // The same keys, read page_keys at a time (one request each, so no reply holds more than
  // one page: a whole prefix may not fit response_bytes_max) as etcd's own clients page: each
  // next page starts after the last key of the one before, and every page is read at the
  // revision of the first (or at `revision` when it is not 0), so the pages are one
  // consistent snapshot. on_page gets each non-empty page's key-values in key order; an error
  // it returns ends the read. Returns the revision read at. A failed page (or that revision
  // compacted between pages: etcd's error) fails the read, after on_page saw the pages
  // before it.
  using PageSink = std::function<Status(const std::vector<EtcdKeyValue>& page)>;
  StatusOr<int64_t> RangePrefixPaged(std::string_view prefix, int64_t page_keys,
                                     int64_t min_mod_revision, int64_t revision,
                                     const PageSink& on_page);
  // Writes every (key, value) in one transaction (at most kTxnOpsMax), attached to lease_id
  // when it is not 0.
  static constexpr size_t kTxnOpsMax = 128;  // etcd's default --max-txn-ops
  Status PutMany(const std::vector<std::pair<std::string, std::string>>& kvs, int64_t lease_id = 0);
  // One key; NotFound when absent (Corruption when the reply names another key).
  StatusOr<EtcdKeyValue> Get(std::string_view key);
  // Replaces the value of an existing key, keeping its lease, only if the key was last
  // modified at mod_revision (a transaction). Returns false when the key changed or is gone.
  StatusOr<bool> ReplaceIfUnchanged(std::string_view key, std::string_view value,
                                    int64_t mod_revision);
  // Deletes one key (range_end empty) or [key, range_end); returns how many were deleted.
  StatusOr<int64_t> Delete(std::string_view key, std::string_view range_end = {});

  StatusOr<EtcdLease> LeaseGrant(int64_t ttl_s);
  // Refreshes the lease once; returns its new TTL. NotFound when it has expired.
  StatusOr<int64_t> LeaseKeepAlive(int64_t lease_id);
  Status LeaseRevoke(int64_t lease_id);
  // Seconds the lease has left without a refresh (read-only: does not refresh it). NotFound
  // when it has expired or never existed.
  StatusOr<int64_t> LeaseTimeToLive(int64_t lease_id);

  // Watches every key starting with prefix from start_revision (0: from now), calling
  // on_events with each batch of events and the revision it brings the watcher to (an event
  // for a key outside prefix ends the watch: Corruption). Blocks until
  // *stop is true (checked at least every poll_ms; returns OK), the stream fails (IOError /
  // Unavailable), the revision was compacted (Rejected: re-read with RangePrefix and watch
  // again) or no byte came for watch_silence_ms_max (Retry: watch again, from the revision
  // last delivered + 1 or after a fresh RangePrefix, as Membership does). Messages are
  // limited to response_bytes_max.
  using EventSink = std::function<void(const std::vector<EtcdEvent>& events, int64_t revision)>;
  Status Watch(std::string_view prefix, int64_t start_revision, const EventSink& on_events,
               const std::atomic<bool>* stop, uint64_t poll_ms = 200);

  const EtcdOptions& options() const { return options_; }

 private:
  // POSTs a JSON body to path on the first endpoint that answers; returns the JSON reply text.
  StatusOr<std::string> Call(std::string_view path, const std::string& body);
  // One range request over [key, range_end) under prefix (every key checked to start with it).
  StatusOr<EtcdRangeResult> Range(std::string_view prefix, std::string_view key,
                                  std::string_view range_end, int64_t limit,
                                  int64_t min_mod_revision, int64_t revision);
  EtcdOptions options_;
  std::vector<HttpEndpoint> endpoints_;
};

}  // namespace kvtier::cluster
