#include "cluster/membership.h"

#include <algorithm>

#include "common/clock.h"
#include "common/logging.h"

namespace kvtier::cluster {
namespace {
// A bad record's key as its warning shows it (a key may be as long as etcd allows).
constexpr size_t kMemberKeyLoggedBytes = 128;
}  // namespace

Status ValidateKeyPrefix(std::string_view prefix) {
  if (prefix.empty() || prefix.size() > kKeyPrefixBytesMax || prefix.back() != '/') {
    return Status::InvalidArgument("cluster key prefix: want 1..256 bytes ending in '/'");
  }
  return Status::Ok();
}

Status ValidateMembershipOptions(const MembershipOptions& o) {
  KVTIER_RETURN_IF_ERROR(ValidateEtcdOptions(o.etcd));
  KVTIER_RETURN_IF_ERROR(ValidateMember(o.self));
  KVTIER_RETURN_IF_ERROR(ValidateKeyPrefix(o.key_prefix));
  if (o.lease_ttl_s < 2 || o.lease_ttl_s > 3600) {
    return Status::InvalidArgument("lease_ttl_s: want 2..3600");
  }
  if (o.retry_ms < 10 || o.retry_ms > 60000) {
    return Status::InvalidArgument("retry_ms: want 10..60000");
  }
  if (o.members_max < 1 || o.members_max > 65536) {
    return Status::InvalidArgument("members_max: want 1..65536");
  }
  return Status::Ok();
}

int MemberView::Find(std::string_view node_id) const {
  auto it =
      std::lower_bound(members.begin(), members.end(), node_id,
                       [](const MemberInfo& m, std::string_view id) { return m.node_id < id; });
  if (it == members.end() || it->node_id != node_id) return -1;
  return static_cast<int>(it - members.begin());
}

StatusOr<std::unique_ptr<Membership>> Membership::Start(MembershipOptions options) {
  KVTIER_RETURN_IF_ERROR(ValidateMembershipOptions(options));
  std::unique_ptr<Membership> m(new Membership(std::move(options)));
  m->session_ = std::thread([p = m.get()] { p->SessionLoop(); });
  m->watcher_ = std::thread([p = m.get()] { p->WatchLoop(); });
  return m;
}

Membership::Membership(MembershipOptions options)
    : options_(std::move(options)),
      members_prefix_(options_.key_prefix + "members/"),
      etcd_(options_.etcd),
      view_(std::make_shared<MemberView>()),
      self_(options_.self) {}

Membership::~Membership() { Stop(/*revoke=*/true); }

void Membership::Stop(bool revoke) {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    stop_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  if (session_.joinable()) session_.join();
  if (watcher_.joinable()) watcher_.join();
  int64_t lease = lease_id_.exchange(0);
  if (revoke && lease != 0) {
    Status s = etcd_.LeaseRevoke(lease);
    if (!s.ok()) {
      KVTIER_LOG(kWarn) << "cluster: lease revoke on shutdown: " << s.message();
    }
  }
  registered_.store(false);
  lease_confirmed_ms_.store(0);
}

bool Membership::SleepFor(uint64_t ms, bool wake_on_update) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, std::chrono::milliseconds(ms), [&] {
    return stop_.load(std::memory_order_acquire) || (wake_on_update && self_dirty_.load());
  });
  return !stop_.load(std::memory_order_acquire);
}

void Membership::NoteError() { errors_.fetch_add(1, std::memory_order_relaxed); }

std::shared_ptr<const MemberView> Membership::View() const {
  std::lock_guard lock(mu_);
  return view_;
}

MembershipStats Membership::Stats() const {
  MembershipStats s;
  s.etcd_reachable = reachable_.load();
  s.registered = registered_.load();
  s.lease_renewals = renewals_.load();
  s.registrations = registrations_.load();
  s.etcd_errors = errors_.load();
  s.bad_records = bad_records_.load();
  s.dropped_over_max = dropped_.load();
  s.registrations_held_back = held_back_.load();
  s.watch_renewals = watch_renewals_.load();
  return s;
}

void Membership::AddListener(std::function<void(const MemberView&)> listener) {
  std::lock_guard lock(mu_);
  listeners_.push_back(std::move(listener));
}

Status Membership::UpdateSelf(const MemberInfo& self) {
  KVTIER_RETURN_IF_ERROR(ValidateMember(self));
  if (self.node_id != options_.self.node_id) {
    return Status::InvalidArgument("UpdateSelf cannot change the node id");
  }
  {
    std::lock_guard lock(mu_);
    self_ = self;
    self_dirty_.store(true);
  }
  cv_.notify_all();
  return Status::Ok();
}

void Membership::SessionLoop() {
  const std::string key = members_prefix_ + options_.self.node_id;
  const uint64_t renew_ms = options_.lease_ttl_s * 1000ull / 3;
  // The last keepalive failed: the next one goes after retry_ms, not a renewal period later.
  bool retry_keepalive = false;
  uint32_t hook_failures = 0;  // before_register failures in a row
  while (!stop_.load(std::memory_order_acquire)) {
    int64_t lease = lease_id_.load();
    if (lease == 0) {
      // Before the lease, so that a long hook (a big tombstone backlog) does not eat its TTL.
      if (options_.before_register) {
        Status hook = options_.before_register();
        if (!hook.ok()) {
          held_back_.fetch_add(1);
          reachable_.store(!hook.IsUnavailable());
          const uint64_t wait_ms =
              std::min(options_.retry_ms << std::min<uint32_t>(hook_failures, 16),
                       std::max(options_.retry_ms, kRegisterRetryMsMax));
          ++hook_failures;
          uint64_t held = 0;
          if (held_back_log_.Allow(DefaultSteadyClock().NowMs(), &held)) {
            KVTIER_LOG(kWarn) << "cluster: not registering " << options_.self.node_id << ": "
                              << hook.message() << "; trying again in " << wait_ms << " ms ("
                              << held << " more failures since the last such line)";
          }
          if (!SleepFor(wait_ms)) return;
          continue;
        }
        hook_failures = 0;
      }
      auto granted = etcd_.LeaseGrant(options_.lease_ttl_s);
      if (!granted.ok()) {
        NoteError();
        reachable_.store(!granted.status().IsUnavailable());
        if (!SleepFor(options_.retry_ms)) return;
        continue;
      }
      lease = granted->id;
      lease_id_.store(lease);
      self_dirty_.store(true);
      registrations_.fetch_add(1);
    }
    if (self_dirty_.exchange(false)) {
      MemberInfo self;
      {
        std::lock_guard lock(mu_);
        self = self_;
      }
      const uint64_t sent_ms = DefaultSteadyClock().NowMs();
      Status put = etcd_.Put(key, EncodeMember(self), lease);
      if (!put.ok()) {
        NoteError();
        self_dirty_.store(true);
        if (put.IsNotFound()) lease_id_.store(0);  // the lease expired meanwhile
        reachable_.store(!put.IsUnavailable());
        registered_.store(false);
        lease_confirmed_ms_.store(0);
        if (!SleepFor(options_.retry_ms)) return;
        continue;
      }
      reachable_.store(true);
      registered_.store(true);
      lease_confirmed_ms_.store(std::max<uint64_t>(sent_ms, 1));
    }
    if (!retry_keepalive && !SleepFor(renew_ms, /*wake_on_update=*/true)) return;
    retry_keepalive = false;
    if (self_dirty_.load()) continue;
    const uint64_t sent_ms = DefaultSteadyClock().NowMs();
    auto ttl = etcd_.LeaseKeepAlive(lease);
    if (ttl.ok()) {
      renewals_.fetch_add(1);
      if (registered_.load()) lease_confirmed_ms_.store(std::max<uint64_t>(sent_ms, 1));
      reachable_.store(true);
      continue;
    }
    NoteError();
    if (ttl.status().IsNotFound()) {
      KVTIER_LOG(kWarn) << "cluster: lease of " << options_.self.node_id
                        << " expired; registering again";
      lease_id_.store(0);
      registered_.store(false);
      lease_confirmed_ms_.store(0);
      reachable_.store(true);
      continue;
    }
    reachable_.store(false);
    // Retry sooner than a renewal period so a short outage does not cost the lease (nor the
    // GET copies, which are served only while a keepalive was sent within 2/3 of the TTL).
    if (!SleepFor(options_.retry_ms)) return;
    retry_keepalive = true;
  }
}

void Membership::ApplyRecord(std::map<std::string, MemberInfo>* members, const EtcdKeyValue& kv) {
  std::string_view id = std::string_view(kv.key).substr(members_prefix_.size());
  auto decoded = DecodeMember(kv.value);
  if (!decoded.ok() || decoded->node_id != id) {
    bad_records_.fetch_add(1);
    uint64_t held = 0;
    if (bad_record_log_.Allow(DefaultSteadyClock().NowMs(), &held)) {
      KVTIER_LOG(kWarn) << "cluster: ignoring member record "
                        << std::string_view(kv.key).substr(0, kMemberKeyLoggedBytes) << ": "
                        << (decoded.ok() ? "node id differs from its key"
                                         : decoded.status().message())
                        << " (" << held << " more since the last such line)";
    }
    return;
  }
  if (id == options_.self.node_id) {
    // `kvtier cluster drain` flips draining in our record in etcd: adopt it, so that a
    // re-registration (after a lost lease) keeps it.
    std::lock_guard lock(mu_);
    self_.draining = decoded->draining;
  }
  if (members->size() >= options_.members_max && !members->contains(std::string(id))) {
    dropped_.fetch_add(1);
    return;
  }
  (*members)[std::string(id)] = std::move(*decoded);
}

void Membership::Publish(std::map<std::string, MemberInfo> members, int64_t revision) {
  auto view = std::make_shared<MemberView>();
  view->members.reserve(members.size());
  for (auto& [id, m] : members) view->members.push_back(std::move(m));
  view->revision = revision;
  std::vector<std::function<void(const MemberView&)>> listeners;
  {
    std::lock_guard lock(mu_);
    if (view_->members == view->members) {
      // Same membership: keep the sequence, note the newer revision only.
      auto same = std::make_shared<MemberView>(*view_);
      same->revision = revision;
      view_ = std::move(same);
      return;
    }
    view->sequence = view_->sequence + 1;
    view_ = view;
    listeners = listeners_;
  }
  for (auto& l : listeners) l(*view);
}

void Membership::WatchLoop() {
  while (!stop_.load(std::memory_order_acquire)) {
    auto range = etcd_.RangePrefix(members_prefix_);
    if (!range.ok()) {
      NoteError();
      if (range.status().IsUnavailable()) reachable_.store(false);
      if (!SleepFor(options_.retry_ms)) return;
      continue;
    }
    std::map<std::string, MemberInfo> members;
    for (const auto& kv : range->kvs) ApplyRecord(&members, kv);
    Publish(members, range->revision);
    Status s = etcd_.Watch(
        members_prefix_, range->revision + 1,
        [&](const std::vector<EtcdEvent>& events, int64_t revision) {
          for (const auto& e : events) {
            if (e.type == EtcdEvent::Type::kDelete) {
              members.erase(e.kv.key.substr(members_prefix_.size()));
            } else {
              ApplyRecord(&members, e.kv);
            }
          }
          if (!events.empty()) Publish(members, revision);
        },
        &stop_);
    if (stop_.load(std::memory_order_acquire)) return;
    if (s.IsRetry()) {  // a silent watch: re-read (a few records) and watch again; not an error
      watch_renewals_.fetch_add(1);
      continue;
    }
    NoteError();
    uint64_t held = 0;
    if (watch_ended_log_.Allow(DefaultSteadyClock().NowMs(), &held)) {
      KVTIER_LOG(kWarn) << "cluster: membership watch ended: " << s.message() << "; re-reading ("
                        << held << " more since the last such line)";
    }
    if (!SleepFor(options_.retry_ms)) return;
  }
}

}  // namespace kvtier::cluster
