#include "cluster/router.h"

#include <algorithm>
#include <functional>
#include <future>
#include <map>

#include "cluster/placement.h"

namespace kvtier::cluster {
namespace {

std::string_view KeyView(const PeerKey& k) {
  return std::string_view(reinterpret_cast<const char*>(k.data()), k.size());
}

// Runs every call at once and returns their results in order: all but the last on the pool,
// the last on the calling thread (a single call costs no thread switch). A call the pool
// refuses (its queue is full) is not made: its result is Unavailable (the pool counts it).
template <typename Result>
std::vector<Result> CallAll(PeerCallPool* pool, std::vector<std::function<Result()>> calls) {
  std::vector<Result> results;
  if (calls.empty()) return results;
  const size_t n = calls.size();
  std::vector<std::future<Result>> futures;
  std::vector<bool> accepted(n - 1, false);
  for (size_t i = 0; i + 1 < n; ++i) {
    auto task = std::make_shared<std::packaged_task<Result()>>(std::move(calls[i]));
    futures.push_back(task->get_future());
    accepted[i] = pool->TrySubmit([task] { (*task)(); });
  }
  Result last = calls[n - 1]();
  results.reserve(n);
  for (size_t i = 0; i + 1 < n; ++i) {
    results.push_back(accepted[i] ? futures[i].get()
                                  : Result(Status::Unavailable(
                                        "peer call refused: cluster.peer_call_queue_max reached")));
  }
  results.push_back(std::move(last));
  return results;
}

// Calls call(endpoint, that endpoint's keys) for every entry of by_peer at once (CallAll)
// and returns, per entry, its key indices with the call's result, in by_peer's order. The
// indices point into by_peer.
template <typename Call>
auto FanOut(PeerCallPool* pool, const std::map<std::string, std::vector<size_t>>& by_peer,
            std::span<const PeerKey> keys, Call call) {
  using Result = decltype(call(std::string(), std::vector<PeerKey>()));
  std::vector<std::function<Result()>> calls;
  for (const auto& [ep, idx] : by_peer) {
    std::vector<PeerKey> ks;
    ks.reserve(idx.size());
    for (size_t i : idx) ks.push_back(keys[i]);
    calls.emplace_back([&call, ep = ep, ks = std::move(ks)] { return call(ep, ks); });
  }
  std::vector<Result> done = CallAll(pool, std::move(calls));
  std::vector<std::pair<const std::vector<size_t>*, Result>> results;
  results.reserve(done.size());
  size_t c = 0;
  for (const auto& [ep, idx] : by_peer) results.emplace_back(&idx, std::move(done[c++]));
  return results;
}

}  // namespace

Router::Router(Membership* membership, PeerClient* peers, RouterOptions options,
               TombstoneLog* tombstones)
    : membership_(membership),
      peers_(peers),
      options_(options),
      tombstones_(tombstones),
      pool_(std::make_unique<PeerCallPool>(PeerCallPoolOptions{
          .threads = options.peer_call_threads, .queue_max = options.peer_call_queue_max})) {
  latest_ = membership_->View();
  membership_->AddListener([this](const MemberView& v) { OnViewChange(v); });
}

void Router::OnViewChange(const MemberView& view) {
  std::lock_guard lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (latest_ != nullptr) {
    for (const MemberInfo& m : latest_->members) {
      if (view.Find(m.node_id) >= 0 || m.node_id == self_id()) continue;
      auto it = std::find_if(departed_.begin(), departed_.end(),
                             [&](const auto& d) { return d.first.node_id == m.node_id; });
      if (it == departed_.end()) departed_.emplace_back(m, now);
    }
  }
  const auto memory = std::chrono::seconds(options_.departed_memory_s);
  std::erase_if(departed_, [&](const auto& d) {
    return view.Find(d.first.node_id) >= 0 || now - d.second > memory;
  });
  previous_ = latest_;
  latest_ = std::make_shared<MemberView>(view);
  unowned_epoch_.fetch_add(1);  // units held here may have changed owners
}

bool Router::DepartedOwns(const PeerKey& key, const MemberView& view) {
  std::vector<MemberInfo> with_departed;
  {
    std::lock_guard lock(mu_);
    if (departed_.empty()) return false;  // the common case: no copy of the view per PUT
    with_departed = view.members;
    for (const auto& d : departed_) with_departed.push_back(d.first);
  }
  // Placement is a pure function of (key, members): the departed member owns key again if
  // it comes back to the same membership, which is when its old version would be served.
  for (size_t i : PlaceOwners(KeyView(key), with_departed, options_.replicas)) {
    if (i >= view.members.size()) return true;
  }
  return false;
}

void Router::RecordStaleVersions(const PeerKey& key, const MemberView& view,
                                 const std::vector<std::string>& stale) {
  if (tombstones_ == nullptr) return;
  if (stale.empty() && !DepartedOwns(key, view)) return;
  auto is_stale = [&](const std::string& id) {
    return std::find(stale.begin(), stale.end(), id) != stale.end();
  };
  std::vector<std::string> applied_by;
  for (const MemberInfo& m : view.members) {
    if (!is_stale(m.node_id)) applied_by.push_back(m.node_id);
  }
  if (view.Find(self_id()) < 0 && !is_stale(self_id())) applied_by.push_back(self_id());
  overwrite_tombstones_.fetch_add(1);
  Status s = tombstones_->RecordKeys(std::span<const PeerKey>(&key, 1), applied_by);
  if (!s.ok()) peer_errors_.fetch_add(1);
}

std::vector<size_t> Router::Owners(const PeerKey& key, const MemberView& view) const {
  return PlaceOwners(KeyView(key), view.members, options_.replicas);
}

bool Router::OwnsLocally(const PeerKey& key) const {
  auto view = View();
  if (view->members.empty()) return true;
  for (size_t i : Owners(key, *view)) {
    if (view->members[i].node_id == self_id()) return true;
  }
  return false;
}

void Router::AddPeersFor(const PeerKey& key, const MemberView& view,
                         std::vector<std::string>* out) const {
  std::shared_ptr<const MemberView> previous;
  {
    std::lock_guard lock(mu_);
    previous = previous_;
  }
  auto add = [&](const MemberView& v) {
    for (size_t i : Owners(key, v)) {
      const MemberInfo& m = v.members[i];
      if (m.node_id == self_id()) continue;
      // Only members that are live now can answer.
      int live = view.Find(m.node_id);
      if (live < 0) continue;
      const std::string& ep = view.members[static_cast<size_t>(live)].peer_endpoint;
      if (std::find(out->begin(), out->end(), ep) == out->end()) out->push_back(ep);
    }
  };
  add(view);
  if (previous != nullptr) add(*previous);
}

std::vector<std::pair<std::string, std::string>> Router::OtherMembers() const {
  std::vector<std::pair<std::string, std::string>> out;
  auto view = View();
  for (const auto& m : view->members) {
    if (m.node_id != self_id()) out.emplace_back(m.node_id, m.peer_endpoint);
  }
  return out;
}

void Router::LookupRemote(std::span<const PeerKey> keys, std::vector<uint8_t>* tiers) {
  auto view = View();
  std::map<std::string, std::vector<size_t>> by_peer;  // endpoint -> key indices
  for (size_t i = 0; i < keys.size(); ++i) {
    if ((*tiers)[i] != kPeerTierAbsent) continue;
    std::vector<std::string> peers;
    AddPeersFor(keys[i], *view, &peers);
    for (const auto& ep : peers) by_peer[ep].push_back(i);
  }
  if (by_peer.empty()) return;
  remote_lookups_.fetch_add(1);
  auto results = FanOut(pool_.get(), by_peer, keys,
                        [this](const std::string& ep, const std::vector<PeerKey>& ks) {
                          return peers_->Lookup(ep, ks);
                        });
  for (auto& [idx, r] : results) {
    if (!r.ok()) {
      peer_errors_.fetch_add(1);
      continue;
    }
    for (size_t j = 0; j < idx->size(); ++j) {
      size_t i = (*idx)[j];
      if ((*r)[j] != kPeerTierAbsent && (*tiers)[i] == kPeerTierAbsent) {
        (*tiers)[i] = (*r)[j];
        remote_lookup_hits_.fetch_add(1);
      }
    }
  }
}

void Router::GetRemote(std::span<const PeerKey> keys, const std::vector<bool>& want,
                       std::vector<Status>* statuses, std::vector<std::span<const uint8_t>>* values,
                       std::vector<PeerBytes>* held,
                       std::vector<std::optional<uint64_t>>* ttl_left_ms) {
  auto view = View();
  // Each wanted key goes to its peers in order of preference; a round asks every key's next
  // peer, all peers in parallel, until every key is found or its peers are exhausted.
  std::vector<std::vector<std::string>> candidates(keys.size());
  std::vector<size_t> next(keys.size(), 0);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (want[i]) AddPeersFor(keys[i], *view, &candidates[i]);
  }
  remote_gets_.fetch_add(1);
  for (;;) {
    std::map<std::string, std::vector<size_t>> by_peer;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!want[i] || (*statuses)[i].ok()) continue;
      if (next[i] < candidates[i].size()) by_peer[candidates[i][next[i]++]].push_back(i);
    }
    if (by_peer.empty()) return;
    auto results = FanOut(
        pool_.get(), by_peer, keys, [this](const std::string& ep, const std::vector<PeerKey>& ks) {
          return options_.staged != nullptr ? options_.staged->Get(ep, ks) : peers_->Get(ep, ks);
        });
    for (auto& [idx, r] : results) {
      if (!r.ok()) {
        peer_errors_.fetch_add(1);
        continue;
      }
      held->insert(held->end(), r->held.begin(), r->held.end());
      for (size_t j = 0; j < idx->size(); ++j) {
        size_t i = (*idx)[j];
        if (r->statuses[j].ok()) {
          (*statuses)[i] = Status::Ok();
          (*values)[i] = r->values[j];
          if (ttl_left_ms != nullptr && j < r->ttl_left_ms.size()) {
            (*ttl_left_ms)[i] = r->ttl_left_ms[j];
          }
          remote_get_hits_.fetch_add(1);
          remote_get_bytes_.fetch_add((*values)[i].size());
        } else if (r->statuses[j].IsRetry()) {
          --next[i];  // the peer holds it but its response was full: ask it again
        }
      }
    }
  }
}

Status Router::Put(const PeerPut& put, const std::optional<Status>& local) {
  auto view = View();
  std::shared_ptr<const MemberView> previous;
  {
    std::lock_guard lock(mu_);
    previous = previous_;
  }
  std::vector<size_t> owners = Owners(put.key, *view);
  auto owns_now = [&](const std::string& id) {
    return std::any_of(owners.begin(), owners.end(),
                       [&](size_t o) { return view->members[o].node_id == id; });
  };
  std::vector<std::function<Status()>> calls;
  std::vector<const std::string*> called;  // the node of each call
  for (size_t i : owners) {
    const MemberInfo& m = view->members[i];
    if (m.node_id == self_id()) continue;
    forwarded_puts_.fetch_add(1);
    calls.emplace_back([this, ep = m.peer_endpoint, &put] { return peers_->Put(ep, put); });
    called.push_back(&m.node_id);
  }
  const size_t remote_owners = calls.size();
  // Members that owned the key under the previous view and no longer do (a join moved it to
  // the newcomer, or they are draining) may still hold the older version until the repair
  // scan hands it over, and would serve it to a GET through them: they drop it (DROP_OLDER),
  // in the same fan-out as the owners' writes. A GET copy one of them keeps of a value it
  // fetches meanwhile is dropped with the other keepers' copies below, once the owners
  // answered. One that does not answer is stale (a tombstone below). This node's own older
  // version is the caller's (Service::Put deletes it); a member that left the view is
  // DepartedOwns' business.
  std::vector<PeerKey> one_key = {put.key};
  std::vector<const std::string*> previous_owners;
  if (previous != nullptr) {
    for (size_t i : Owners(put.key, *previous)) {
      const std::string& id = previous->members[i].node_id;
      const int live = view->Find(id);
      if (id == self_id() || live < 0 || owns_now(id)) continue;
      const MemberInfo& m = view->members[static_cast<size_t>(live)];
      previous_owner_drops_.fetch_add(1);
      calls.emplace_back(
          [this, ep = m.peer_endpoint, &one_key] { return peers_->DropOlder(ep, one_key); });
      previous_owners.push_back(&m.node_id);
    }
  }
  uint32_t acks = 0;
  Status first_error;
  // Members that may still hold an older version of the key once this PUT returns: owners
  // whose write failed (a timeout, a refused call, a node restarted within its lease) would
  // serve it as a hit, even when enough others acknowledged (write_acks < replicas).
  std::vector<std::string> stale;
  if (local.has_value()) {
    if (local->ok()) {
      ++acks;
    } else {
      first_error = *local;
      stale.push_back(self_id());
    }
  }
  std::vector<Status> done = CallAll(pool_.get(), std::move(calls));
  for (size_t c = 0; c < remote_owners; ++c) {
    if (done[c].ok()) {
      ++acks;
    } else {
      forwarded_put_failures_.fetch_add(1);
      if (first_error.ok()) first_error = done[c];
      stale.push_back(*called[c]);
    }
  }
  for (size_t d = 0; d < previous_owners.size(); ++d) {
    if (done[remote_owners + d].ok()) continue;
    previous_owner_drop_failures_.fetch_add(1);
    peer_errors_.fetch_add(1);
    stale.push_back(*previous_owners[d]);
  }
  // Then members that keep GET copies (and do not own the key) drop theirs, once the owners
  // answered: a keeper's fetch that starts after its drop reads the new value, one that
  // started before is not kept (docs/CLUSTER.md, "Copies").
  std::vector<const MemberInfo*> keepers;
  std::vector<std::function<Status()>> drops;
  for (size_t i = 0; i < view->members.size(); ++i) {
    const MemberInfo& m = view->members[i];
    if (!m.keeps_copies || m.node_id == self_id()) continue;
    if (std::find(owners.begin(), owners.end(), i) != owners.end()) continue;
    keepers.push_back(&m);
    drops.emplace_back(
        [this, ep = m.peer_endpoint, &one_key] { return peers_->DropCopies(ep, one_key); });
  }
  if (!keepers.empty()) {
    const std::vector<Status> dropped = CallAll(pool_.get(), std::move(drops));
    bool missed = false;
    for (size_t k = 0; k < keepers.size(); ++k) {
      copy_invalidations_.fetch_add(1);
      if (dropped[k].ok()) continue;
      copy_invalidation_failures_.fetch_add(1);
      missed = true;
      stale.push_back(keepers[k]->node_id);
    }
    if (missed) peer_errors_.fetch_add(1);
  }
  RecordStaleVersions(put.key, *view, stale);
  uint32_t live_owners = static_cast<uint32_t>(remote_owners) + (local.has_value() ? 1 : 0);
  uint32_t need =
      options_.write_acks == 0 ? live_owners : std::min(options_.write_acks, live_owners);
  need = std::max<uint32_t>(need, 1);
  if (acks >= need) return Status::Ok();
  puts_short_.fetch_add(1);
  return first_error.ok() ? Status::Unavailable("no owner acknowledged the put") : first_error;
}

void Router::NoteLocalDeletes(std::span<const PeerKey> keys) {
  if (options_.recent_deletes != nullptr) options_.recent_deletes->NoteKeys(keys);
}

void Router::NoteLocalTenantDelete(std::string_view tenant) {
  if (options_.recent_deletes != nullptr) options_.recent_deletes->NoteTenant(tenant);
}

void Router::DeleteRemote(std::span<const PeerKey> keys, std::vector<bool>* existed) {
  auto members = OtherMembers();
  std::vector<std::function<StatusOr<std::vector<uint8_t>>()>> calls;
  std::vector<PeerKey> ks(keys.begin(), keys.end());
  for (const auto& m : members) {
    calls.emplace_back([this, ep = m.second, &ks] { return peers_->Delete(ep, ks); });
  }
  std::vector<std::string> applied_by = {self_id()};
  auto results = CallAll(pool_.get(), std::move(calls));
  for (size_t c = 0; c < results.size(); ++c) {
    auto& r = results[c];
    if (!r.ok()) {
      peer_errors_.fetch_add(1);
      continue;
    }
    applied_by.push_back(members[c].first);
    for (size_t i = 0; i < keys.size(); ++i) {
      if ((*r)[i] != 0) (*existed)[i] = true;
    }
  }
  if (tombstones_ != nullptr) {
    Status s = tombstones_->RecordKeys(keys, applied_by);
    if (!s.ok()) peer_errors_.fetch_add(1);
  }
}

Status Router::DeleteTenantRemote(std::string_view tenant) {
  auto members = OtherMembers();
  std::vector<std::function<Status()>> calls;
  std::string name(tenant);
  for (const auto& m : members) {
    calls.emplace_back([this, ep = m.second, &name] { return peers_->DeleteTenant(ep, name); });
  }
  Status first;
  std::vector<std::string> applied_by = {self_id()};
  auto results = CallAll(pool_.get(), std::move(calls));
  for (size_t c = 0; c < results.size(); ++c) {
    const Status& s = results[c];
    if (s.ok()) {
      applied_by.push_back(members[c].first);
    } else {
      peer_errors_.fetch_add(1);
      if (first.ok()) first = s;
    }
  }
  if (tombstones_ == nullptr) return first;
  // A member that missed the delete applies the tombstone when it returns.
  return tombstones_->RecordTenant(tenant, applied_by);
}

RouterStats Router::stats() const {
  RouterStats s;
  s.remote_lookups = remote_lookups_.load();
  s.remote_lookup_hits = remote_lookup_hits_.load();
  s.remote_gets = remote_gets_.load();
  s.remote_get_hits = remote_get_hits_.load();
  s.remote_get_bytes = remote_get_bytes_.load();
  s.forwarded_puts = forwarded_puts_.load();
  s.forwarded_put_failures = forwarded_put_failures_.load();
  s.puts_short_of_acks = puts_short_.load();
  s.peer_errors = peer_errors_.load();
  s.copy_invalidations = copy_invalidations_.load();
  s.copy_invalidation_failures = copy_invalidation_failures_.load();
  s.peer_calls_refused = pool_->refused();
  s.peer_calls_queued = pool_->queued();
  s.overwrite_tombstones = overwrite_tombstones_.load();
  s.previous_owner_drops = previous_owner_drops_.load();
  s.previous_owner_drop_failures = previous_owner_drop_failures_.load();
  return s;
}

}  // namespace kvtier::cluster
