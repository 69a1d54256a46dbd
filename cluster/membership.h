// Membership: this node's registration in etcd and its view of every live member.
//
// Layout in etcd (all under MembershipOptions::key_prefix, default "/kvtier/"):
//   <prefix>members/<node_id> = EncodeMember(self), attached to a lease of lease_ttl_s.
// A node whose lease expires (crash, partition, SIGSTOP past the TTL) disappears from every
// view: that is the only failure detector.
//
// Two threads:
//   - session: runs before_register, grants the lease, writes the record, refreshes the lease
//     every ttl/3; when the lease is found expired it registers again under a new lease (a
//     node that was stopped rejoins by itself); while before_register fails it does not
//     register at all;
//   - watcher: reads <prefix>members/ and then watches it from the next revision, so the
//     view follows every join and leave; on a broken stream it re-reads and watches again.
// While etcd is unreachable both retry every retry_ms and the last view is kept (a node keeps
// serving what it holds); etcd_reachable() says so.
//
// Thread safety: every method may be called concurrently. Listeners run on the watcher thread
// and must not call Stop.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cluster/etcd_client.h"
#include "cluster/member.h"
#include "common/logging.h"
#include "common/status.h"

namespace kvtier::cluster {

// The longest wait between two failed before_register hooks (retry_ms when that is longer).
inline constexpr uint64_t kRegisterRetryMsMax = 10'000;

struct MembershipOptions {
  EtcdOptions etcd;
  std::string key_prefix = "/kvtier/";  // shared by every node of one cluster
  MemberInfo self;
  uint32_t lease_ttl_s = 10;    // 2..3600; a silent node is gone after this long
  uint64_t retry_ms = 500;      // etcd unreachable: try again after this long
  uint32_t members_max = 1024;  // records beyond it are ignored (and counted)
  // Called on the session thread before every (re)registration, before the lease is granted,
  // e.g. to apply the deletes this node missed while it was gone (cluster/tombstones.h). An
  // error holds the registration back: the node stays out of the view (peers do not route to
  // it) and the hook is called again after retry_ms, doubling up to
  // kRegisterRetryMsMax, until it succeeds. May be empty.
  std::function<Status()> before_register;
};
Status ValidateMembershipOptions(const MembershipOptions& options);
// Longest etcd key prefix of a cluster (MembershipOptions::key_prefix).
inline constexpr size_t kKeyPrefixBytesMax = 256;
// The key prefix alone (1..kKeyPrefixBytesMax bytes ending in '/'): InvalidArgument otherwise.
Status ValidateKeyPrefix(std::string_view prefix);

// The live members as last seen, sorted by node id. Immutable once published.
struct MemberView {
  std::vector<MemberInfo> members;
  int64_t revision = 0;   // etcd revision the view reflects
  uint64_t sequence = 0;  // bumps on every change this process saw
  // The index of node_id in members, or -1.
  int Find(std::string_view node_id) const;
};

struct MembershipStats {
  bool etcd_reachable = false;
  bool registered = false;  // our record is in etcd under a live lease
  uint64_t lease_renewals = 0;
  uint64_t registrations = 0;  // 1 + re-registrations after a lost lease
  uint64_t etcd_errors = 0;
  uint64_t bad_records = 0;              // member records that failed DecodeMember
  uint64_t dropped_over_max = 0;         // records beyond members_max
  uint64_t registrations_held_back = 0;  // before_register failures (no registration then)
  uint64_t watch_renewals = 0;           // watches ended for silence and started again (not errors)
};

class Membership {
 public:
  // Starts both threads; never fails on etcd being down (it keeps trying).
  static StatusOr<std::unique_ptr<Membership>> Start(MembershipOptions options);
  // Stop(/*revoke=*/true).
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Stops both threads. revoke: revoke the lease so peers see the node leave at once
  // (graceful shutdown); false leaves the record to expire (what a crash looks like).
  void Stop(bool revoke);

  std::shared_ptr<const MemberView> View() const;
  MembershipStats Stats() const;
  bool etcd_reachable() const { return reachable_.load(std::memory_order_acquire); }
  // Steady-clock ms (common/clock) at which the last successful lease write or keepalive was
  // *sent*: etcd's lease cannot expire before this + lease_ttl_s. 0 while not registered.
  // With Stats().registrations it fences what may only be served under a live lease.
  uint64_t lease_confirmed_ms() const { return lease_confirmed_ms_.load(); }
  const MembershipOptions& options() const { return options_; }

  // Called (on the watcher thread) after every change of the view.
  void AddListener(std::function<void(const MemberView&)> listener);

  // Republishes self (e.g. draining = true); takes effect at the next write of the record.
  // The draining flag of our own record as read from etcd (set there by `kvtier cluster
  // drain`) is adopted into self, so it survives a re-registration (not a restart).
  Status UpdateSelf(const MemberInfo& self);

 private:
  explicit Membership(MembershipOptions options);
  void SessionLoop();
  void WatchLoop();
  bool SleepFor(uint64_t ms, bool wake_on_update = false);  // false when stopping
  void Publish(std::map<std::string, MemberInfo> members, int64_t revision);
  void ApplyRecord(std::map<std::string, MemberInfo>* members, const EtcdKeyValue& kv);
  void NoteError();

  MembershipOptions options_;
  std::string members_prefix_;
  EtcdClient etcd_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> reachable_{false};
  std::atomic<bool> registered_{false};
  std::atomic<bool> self_dirty_{false};
  std::atomic<uint64_t> renewals_{0}, registrations_{0}, errors_{0}, bad_records_{0}, dropped_{0},
      held_back_{0}, watch_renewals_{0};
  std::atomic<int64_t> lease_id_{0};
  std::atomic<uint64_t> lease_confirmed_ms_{0};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<const MemberView> view_;
  MemberInfo self_;  // guarded by mu_
  std::vector<std::function<void(const MemberView&)>> listeners_;
  std::thread session_, watcher_;
  // The watcher's warnings (bad records, a broken watch): one line per kWarnIntervalMs, the
  // rest counted, so that an etcd that keeps sending bad records cannot flood the log.
  static constexpr uint64_t kWarnIntervalMs = 10'000;
  LogThrottle bad_record_log_{kWarnIntervalMs}, watch_ended_log_{kWarnIntervalMs};
  LogThrottle held_back_log_{kWarnIntervalMs};  // the session thread's
  bool stopped_ = false;
};

}  // namespace kvtier::cluster
