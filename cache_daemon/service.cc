#include "cache_daemon/service.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "cache_daemon/cluster_copies.h"
#include "cluster/pause_guard.h"
#include "cluster/router.h"
#include "common/clock.h"
#include "common/endian.h"
#include "common/json_limits.h"
#include "common/json_text.h"
#include "common/key_spec.h"

namespace kvtier::daemon {
namespace {

constexpr std::string_view kRespDomainTag = "kvtier.resp";

void AppendField(uint8_t type, std::string_view value, std::vector<uint8_t>* out) {
  out->push_back(type);
  uint32_t n = static_cast<uint32_t>(value.size());
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<uint8_t>(n >> (8 * i)));
  out->insert(out->end(), value.begin(), value.end());
}

bool IsZero(const wire::Key& k) {
  for (uint8_t b : k) {
    if (b != 0) return false;
  }
  return true;
}

// Per-I/O-thread scratch for SET envelopes, so a SET allocates nothing once warm; a scratch
// grown past this is released after use.
constexpr size_t kEnvelopeScratchKeepBytes = 1u << 20;

// Builds the envelope in *s (replacing its contents): the named form when the name is carried
// (name.size() <= kRespCarriedNameBytesMax), else the unnamed one. Returns whether it carries
// the name.
bool EncodeEnvelope(std::string_view name, std::string_view value, uint64_t expire_at_ms,
                    std::string* s) {
  const bool named = name.size() <= kRespCarriedNameBytesMax;
  const size_t head = named ? kRespNamedEnvelopeBytes + name.size() : kRespEnvelopeBytes;
  s->resize(head + value.size());
  char* p = s->data();
  p[0] = static_cast<char>(named ? kRespNamedEnvelopeTag : kRespEnvelopeTag);
  le::Put64(reinterpret_cast<uint8_t*>(p + 1), expire_at_ms);
  if (named) {
    le::Put32(reinterpret_cast<uint8_t*>(p + 9), static_cast<uint32_t>(name.size()));
    if (!name.empty()) std::memcpy(p + kRespNamedEnvelopeBytes, name.data(), name.size());
  }
  if (!value.empty()) std::memcpy(p + head, value.data(), value.size());
  return named;
}

// Nesting a policy body may have (objects and arrays, the body itself the first level):
// nlohmann parses iteratively but dump() recurses, so ~500K nested arrays in a 1 MiB body
// overflowed the stack of the thread that re-serialized them.
constexpr int kPolicyJsonDepthMax = 16;

bool DecodeEnvelope(const std::vector<uint8_t>& v, uint64_t* expire_at_ms, size_t* payload_at) {
  return DecodeRespEnvelope(v, expire_at_ms, payload_at);
}

}  // namespace

bool DecodeRespEnvelope(std::span<const uint8_t> v, uint64_t* expire_at_ms, size_t* payload_at,
                        std::string_view* name) {
  if (name != nullptr) *name = {};
  if (v.size() < kRespEnvelopeBytes) return false;
  *expire_at_ms = le::Get64(v.data() + 1);
  if (v[0] == kRespEnvelopeTag) {
    *payload_at = kRespEnvelopeBytes;
    return true;
  }
  if (v[0] != kRespNamedEnvelopeTag || v.size() < kRespNamedEnvelopeBytes) return false;
  const uint64_t n = le::Get32(v.data() + 9);
  if (n > v.size() - kRespNamedEnvelopeBytes) return false;
  if (name != nullptr) {
    *name = std::string_view(reinterpret_cast<const char*>(v.data()) + kRespNamedEnvelopeBytes, n);
  }
  *payload_at = kRespNamedEnvelopeBytes + n;
  return true;
}

uint64_t UnixNowMs() { return DefaultSystemClock().NowMs(); }

uint64_t KeyId(const storage::Key& k) {
  uint64_t id = 0;
  for (int i = 0; i < 8; ++i) id |= static_cast<uint64_t>(k[i]) << (8 * i);
  return id;
}

Service::Service(storage::TierManager* store, const TenantRegistry* tenants, DaemonMetrics* metrics,
                 TraceWriter* trace, PolicySettings policy, uint64_t resp_key_index_bytes_max)
    : store_(store),
      tenants_(tenants),
      metrics_(metrics),
      trace_(trace),
      policy_(std::move(policy)),
      resp_index_(kRespTrackedKeysMax, resp_key_index_bytes_max) {}

storage::Key Service::Bind(const Tenant& t, const wire::Key& chain) const {
  return StorageKey(t.salt, chain);
}

size_t RespKeyCache::SlotOf(const Digest& salt, std::string_view key) {
  uint64_t s = 0;
  std::memcpy(&s, salt.data(), sizeof(s));
  return (std::hash<std::string_view>{}(key) ^ s) % kSlots;
}

const storage::Key* RespKeyCache::Find(const Digest& salt, std::string_view key) const {
  if (slots_ == nullptr || key.size() > kKeyBytesMax) return nullptr;
  const Slot& e = slots_[SlotOf(salt, key)];
  if (!e.used || e.salt != salt || e.key != key) return nullptr;
  ++hits_;
  return &e.value;
}

void RespKeyCache::Insert(const Digest& salt, std::string_view key, const storage::Key& value) {
  if (key.size() > kKeyBytesMax) return;
  if (slots_ == nullptr) slots_ = std::make_unique<Slot[]>(kSlots);
  Slot& e = slots_[SlotOf(salt, key)];
  e.used = true;
  e.salt = salt;
  e.key.assign(key);
  e.value = value;
}

storage::Key Service::BindResp(const Tenant& t, std::string_view key, RespKeyCache* cache) const {
  if (cache != nullptr) {
    if (const storage::Key* hit = cache->Find(t.salt, key)) return *hit;
  }
  std::vector<uint8_t> pre;
  pre.reserve(key.size() + 32);
  AppendField(0x01, kRespDomainTag, &pre);
  AppendField(0x05, key, &pre);
  storage::Key k = StorageKey(t.salt, Sha256(pre));
  if (cache != nullptr) cache->Insert(t.salt, key, k);
  return k;
}

void Service::Trace(const char* op, const Tenant& t, std::span<const storage::Key> keys,
                    uint64_t bytes, uint32_t unit_tokens, uint64_t request) {
  if (trace_ == nullptr) return;
  TraceRecord r;
  r.op = op;
  r.tenant = static_cast<uint32_t>(t.id);
  r.ids.reserve(keys.size());
  for (const storage::Key& k : keys) r.ids.push_back(KeyId(k));
  r.bytes = bytes;
  r.unit_tokens = unit_tokens;
  r.request = request;
  uint64_t before = trace_->dropped();
  trace_->Record(std::move(r));
  if (trace_->dropped() != before) metrics_->trace_records_dropped.fetch_add(1);
}

bool Service::LocalStoreHeld() const {
  return router_ != nullptr && pause_guard_ != nullptr && !pause_guard_->Current();
}

wire::LookupReply Service::Lookup(const Tenant& t, std::span<const wire::Key> chain,
                                  uint32_t unit_tokens, const storage::RequestTag& request) {
  std::vector<storage::Key> keys(chain.size());
  for (size_t i = 0; i < chain.size(); ++i) keys[i] = Bind(t, chain[i]);
  // Held after a pause: nothing counted from the local store, every key asked of its peers.
  const bool held = LocalStoreHeld();
  storage::LookupResult r = held ? storage::LookupResult{} : store_->Lookup(keys);
  const uint64_t local_hits = std::min(r.hit_count, keys.size()), local_bytes = r.hit_bytes;
  if (router_ != nullptr && r.hit_count < keys.size()) {
    // The longest prefix held anywhere: keys past the local prefix are asked of their owners.
    std::vector<uint8_t> tiers(keys.size(), cluster::kPeerTierAbsent);
    for (size_t i = 0; i < r.hit_count && i < r.tiers.size(); ++i) {
      tiers[i] = static_cast<uint8_t>(r.tiers[i]);
    }
    for (size_t i = r.hit_count; i < keys.size() && !held; ++i) {
      storage::LookupResult one = store_->Probe(std::span<const storage::Key>(&keys[i], 1));
      if (one.hit_count == 1) tiers[i] = static_cast<uint8_t>(one.tiers[0]);
    }
    router_->LookupRemote(keys, &tiers);
    size_t hits = 0;
    while (hits < keys.size() && tiers[hits] != cluster::kPeerTierAbsent) ++hits;
    if (hits > r.hit_count) {
      r.tiers.resize(hits);
      for (size_t i = r.hit_count; i < hits; ++i) r.tiers[i] = static_cast<storage::Tier>(tiers[i]);
      r.hit_count = hits;
      r.first_miss =
          hits < keys.size() ? storage::MissReason::kNeverStored : storage::MissReason::kNone;
    }
  }
  // The bytes the units would have (docs/format/trace.md): the local hits' own, and their mean
  // for each other unit (0 when nothing hit here: the sizes are unknown until the PUT).
  const uint64_t bytes =
      local_hits == 0 ? 0 : local_bytes + (keys.size() - local_hits) * (local_bytes / local_hits);
  Trace("lookup", t, keys, bytes, unit_tokens, request.id);
  wire::LookupReply reply;
  reply.hit_count = static_cast<uint32_t>(std::min(r.hit_count, chain.size()));
  for (uint32_t i = 0; i < reply.hit_count; ++i) {
    reply.tiers.push_back(i < r.tiers.size() ? static_cast<uint8_t>(r.tiers[i]) : 255);
  }
  reply.first_miss = static_cast<uint8_t>(r.first_miss);
  return reply;
}

std::vector<StatusCode> Service::Put(const Tenant& t, const wire::PutRequest& args,
                                     std::span<const PutItem> items, uint32_t unit_tokens,
                                     const storage::RequestTag& given) {
  std::vector<StatusCode> codes;
  codes.reserve(items.size());
  std::vector<storage::Key> keys;
  uint64_t bytes = 0;
  // A native batch PUT is one request for the eviction policies (storage::RequestTag): its
  // turn's, or its own.
  const storage::RequestTag request = given.id != 0 ? given : store_->BeginRequest();
  for (const PutItem& it : items) {
    storage::PutOptions po;
    po.tenant = t.id;
    po.request = request;
    po.kind = static_cast<policies::ObjectKind>(args.kind);
    if (!IsZero(it.parent_chain)) po.parent = Bind(t, it.parent_chain);
    po.recompute_tokens = args.recompute_tokens;
    po.ttl_ms = args.ttl_ms;
    po.highest_tier = static_cast<storage::Tier>(args.highest_tier);
    po.allow_ssd = args.allow_ssd != 0;
    storage::Key k = Bind(t, it.chain);
    Status st;
    if (router_ == nullptr) {
      st = store_->Put(k, it.value, po);
    } else {
      // Written to the unit's owners; this node stores it only when it is one of them.
      std::optional<Status> local;
      const bool owner = router_->OwnsLocally(k);
      if (owner) {
        // The owner's unit now, not a copy: forgotten before the put (a repair copy meanwhile
        // never takes this write for a GET copy and drops it) and after it (a GET copy kept
        // in between, overwritten by this put).
        if (copies_ != nullptr) copies_->Forget(k);
        local = store_->Put(k, it.value, po);
        if (copies_ != nullptr) copies_->Forget(k);
        // A view change since OwnsLocally may have taken the key from this node, and a repair
        // scan under the new view that listed the store before this write landed may have
        // reported no unit here that it does not own: this one would then stay unnoticed (a
        // newer PUT through here would not delete it, a GET here would serve it without asking
        // its owners). Checked after the write: a scan that starts later lists it.
        if (!router_->OwnsLocally(k)) router_->NoteUnownedWrite();
      }
      cluster::PeerPut put;
      put.kind = args.kind;
      put.highest_tier = args.highest_tier;
      put.allow_ssd = args.allow_ssd;
      put.recompute_tokens = args.recompute_tokens;
      put.ttl_ms = args.ttl_ms;
      put.tenant = t.name;
      put.key = k;
      put.parent = po.parent;
      put.value = it.value;
      st = router_->Put(put, local);
      if (!owner) {
        // Replaced: this node's copy is never served again (dropped once the owners answered,
        // so a fetch that starts later reads the new value; cluster_copies.h), nor its replica
        // of a key it owned before a membership change and has not handed over yet: the PUT
        // went to the current owners only (docs/CLUSTER.md, "Versions").
        if (copies_ != nullptr) copies_->Drop(std::span<const storage::Key>(&k, 1));
        // Such a replica exists only while MayHoldUnowned (copies are dropped just above).
        if (router_->MayHoldUnowned()) (void)store_->Delete(k);  // NotFound: nothing held
      }
    }
    codes.push_back(st.code());
    if (st.ok()) {
      keys.push_back(k);
      bytes += it.value.size();
    }
  }
  if (!keys.empty())
    Trace("put", t, keys, bytes, unit_tokens ? unit_tokens : args.recompute_tokens, request.id);
  return codes;
}

void Service::Get(const Tenant& t, std::span<const wire::Key> chain, uint32_t unit_tokens,
                  const storage::RequestTag& given,
                  const std::function<void(size_t, const Status&, storage::Tier,
                                           std::span<const uint8_t>)>& visit,
                  const std::function<void()>& visited) {
  std::vector<storage::Key> keys(chain.size());
  for (size_t i = 0; i < chain.size(); ++i) keys[i] = Bind(t, chain[i]);
  // One batch read per kMaxBatch keys: the SSD reads of a batch are in flight together.
  std::vector<std::vector<uint8_t>> values;
  std::vector<storage::Tier> tiers;
  std::vector<Status> results;
  uint64_t bytes = 0;
  // One request for the policies however many batches it takes: the turn's, or its own.
  const storage::RequestTag request = given.id != 0 ? given : store_->BeginRequest();
  bool visited_called = false;
  // Traced before the reply (with `visited`), so that the trace has the GET before the
  // client's next call: the replay then touches the policies in the order the tiers did.
  bool traced = false;
  const std::function<void()> reply = [&]() {
    if (!traced) Trace("get", t, keys, bytes, unit_tokens, request.id);
    traced = true;
    if (visited) visited();
  };
  for (size_t first = 0; first < keys.size(); first += storage::kMaxBatch) {
    size_t n = std::min(storage::kMaxBatch, keys.size() - first);
    if (router_ == nullptr) {
      // One node: each value is visited where the store read it (an SSD unit in its batch's
      // read region), so the visitor's copy is its only one. The last batch calls `visited`
      // before its promotions.
      const bool last = first + n >= keys.size();
      store_->GetBatchVisit(
          std::span<const storage::Key>(keys).subspan(first, n),
          [&](size_t j, const Status& st, storage::Tier tier, std::span<const uint8_t> v) {
            if (st.ok()) bytes += v.size();
            visit(first + j, st, tier, v);
          },
          request, last ? reply : nullptr);
      if (last) visited_called = true;
      continue;
    }
    const auto batch = std::span<const storage::Key>(keys).subspan(first, n);
    if (LocalStoreHeld()) {
      // Held after a pause: the local store may hold units deleted meanwhile (SetPauseGuard).
      // It is not read (nor its policies touched): every key is a miss here, read from its
      // other owners (a miss if none has it).
      values.assign(n, {});
      tiers.assign(n, storage::Tier::kNone);
      results.assign(n, Status::NotFound("held after a pause: read from the other owners"));
    } else {
      store_->GetBatch(batch, &values, &tiers, &results, request);
      // A copy that may not be served now (cluster_copies.h) is a miss, fetched again.
      if (copies_ != nullptr) copies_->CheckHits(batch, &results);
    }
    // A unit held here that this node does not own (not a copy: a replica not handed over yet
    // after a membership change) may be older than its owners': a PUT goes to the current
    // owners. While the router says such units may be here, their owners are asked first and
    // the local unit is served only when none of them has the key (docs/CLUSTER.md,
    // "Versions"). Otherwise no per-key cost.
    std::vector<bool> set_aside(n, false);
    std::vector<std::pair<std::vector<uint8_t>, storage::Tier>> aside;  // in index order
    if (router_->MayHoldUnowned()) {
      for (size_t j = 0; j < n; ++j) {
        if (!results[j].ok() || (copies_ != nullptr && copies_->IsCopy(batch[j])) ||
            router_->OwnsLocally(batch[j])) {
          continue;
        }
        set_aside[j] = true;
        aside.emplace_back(std::move(values[j]), tiers[j]);
        results[j] = Status::NotFound("held here, not owned: its owners are asked first");
      }
    }
    // Units this node does not hold are fetched from the peers that do: views of their
    // replies, which `held` keeps until the batch is visited.
    std::vector<bool> want(n, false);
    bool any = false;
    for (size_t j = 0; j < n; ++j) {
      want[j] = results[j].IsNotFound();
      any = any || want[j];
    }
    std::vector<std::span<const uint8_t>> fetched(n);
    std::vector<bool> remote(n, false);
    std::vector<cluster::PeerBytes> held;
    if (any) {
      const uint64_t fetch_started = copies_ != nullptr ? ClusterCopies::BeginFetch() : 0;
      std::vector<std::optional<uint64_t>> ttl_left_ms(n);
      router_->GetRemote(batch, want, &results, &fetched, &held, &ttl_left_ms);
      for (size_t j = 0; j < n; ++j) {
        if (!want[j] || !results[j].ok()) continue;
        remote[j] = true;
        tiers[j] = storage::Tier::kSsd;  // beyond this node
        // Copies only on a non-owner: an owner that lacks a unit gets its replica from repair,
        // and its own store takes PUTs of the key, which a copy of the older value fetched
        // before such a PUT must never replace (docs/CLUSTER.md, "Versions").
        if (copies_ != nullptr && !set_aside[j] && !router_->OwnsLocally(batch[j])) {
          copies_->Keep(t.id, t.name, batch[j], fetched[j], fetch_started, ttl_left_ms[j]);
        }
      }
    }
    for (size_t j = 0, a = 0; j < n; ++j) {
      if (!set_aside[j]) continue;
      auto& [value, tier] = aside[a++];
      if (results[j].ok()) continue;  // an owner's
      results[j] = Status::Ok();      // no owner has it yet: the hand-over is still to come
      values[j] = std::move(value);
      tiers[j] = tier;
    }
    for (size_t j = 0; j < n; ++j) {
      const Status& st = results[j];
      const std::span<const uint8_t> value = !st.ok()    ? std::span<const uint8_t>()
                                             : remote[j] ? fetched[j]
                                                         : std::span<const uint8_t>(values[j]);
      bytes += value.size();
      visit(first + j, st, tiers[j], value);
    }
  }
  if (!visited_called) reply();  // no keys, or the cluster path
}

Status Service::Prefetch(const Tenant& t, std::span<const wire::Key> chain) {
  std::vector<storage::Key> keys(chain.size());
  for (size_t i = 0; i < chain.size(); ++i) keys[i] = Bind(t, chain[i]);
  return store_->Prefetch(keys);
}

Status Service::Pin(const Tenant& t, std::span<const wire::Key> chain, uint64_t lease_ms) {
  std::vector<storage::Key> keys(chain.size());
  for (size_t i = 0; i < chain.size(); ++i) keys[i] = Bind(t, chain[i]);
  return store_->Pin(keys, lease_ms);
}

Status Service::Unpin(const Tenant& t, std::span<const wire::Key> chain) {
  std::vector<storage::Key> keys(chain.size());
  for (size_t i = 0; i < chain.size(); ++i) keys[i] = Bind(t, chain[i]);
  return store_->Unpin(keys);
}

uint32_t Service::Delete(const Tenant& t, std::span<const wire::Key> chain, uint32_t unit_tokens,
                         Status* error) {
  std::vector<storage::Key> keys(chain.size());
  std::vector<bool> existed(chain.size(), false);
  for (size_t i = 0; i < chain.size(); ++i) keys[i] = Bind(t, chain[i]);
  if (router_ != nullptr) router_->NoteLocalDeletes(keys);  // before the delete (repair fence)
  for (size_t i = 0; i < chain.size(); ++i) {
    Status st = store_->Delete(keys[i]);
    if (st.ok()) {
      existed[i] = true;
    } else if (!st.IsNotFound() && error != nullptr && error->ok()) {
      *error = st;
    }
  }
  if (copies_ != nullptr) copies_->Drop(keys);
  // Cluster: every live member too (a unit may also sit on a previous owner).
  if (router_ != nullptr) router_->DeleteRemote(keys, &existed);
  uint32_t deleted = static_cast<uint32_t>(std::count(existed.begin(), existed.end(), true));
  Trace("delete", t, keys, 0, unit_tokens);
  return deleted;
}

Status Service::DeleteTenant(const Tenant& t) {
  if (router_ != nullptr) router_->NoteLocalTenantDelete(t.name);  // before (repair fence)
  Status local = DeleteTenantLocal(t);
  if (router_ == nullptr) return local;
  Status remote = router_->DeleteTenantRemote(t.name);
  return local.ok() ? remote : local;
}

Status Service::DeleteTenantLocal(const Tenant& t) {
  resp_index_.RemoveTenant(t.id);
  Status s = store_->DeleteTenant(t.id);
  if (copies_ != nullptr) copies_->DropTenant(t.id, t.name);
  return s;
}

std::string Service::StatsJson(const Tenant* t) const {
  storage::Stats s = store_->GetStats();
  nlohmann::json j;
  auto tier = [](const storage::TierStats& ts) {
    return nlohmann::json{{"capacity_bytes", ts.capacity_bytes},
                          {"used_bytes", ts.used_bytes},
                          {"objects", ts.objects},
                          {"hits", ts.hits},
                          {"evictions", ts.evictions},
                          {"bytes_read", ts.bytes_read},
                          {"bytes_written", ts.bytes_written}};
  };
  j["tiers"] = {{"hbm", tier(s.hbm)}, {"dram", tier(s.dram)}, {"ssd", tier(s.ssd)}};
  j["misses"] = {{"io_error", s.misses_io_error},
                 {"never_stored", s.misses_never_stored},
                 {"evicted", s.misses_evicted},
                 {"expired", s.misses_expired},
                 {"checksum_failure", s.misses_checksum}};
  j["admissions"] = s.admissions;
  j["admission_rejections"] = s.admission_rejections;
  j["checksum_failures"] = s.checksum_failures;
  j["io_errors"] = s.io_errors;
  j["segments_cleaned"] = s.segments_cleaned;
  j["ssd_relocated_bytes"] = s.ssd_relocated_bytes;
  j["ssd_disk_full_shrinks"] = s.ssd_disk_full_shrinks;
  j["ssd_disk_free_shrinks"] = s.ssd_disk_free_shrinks;
  j["ssd_disk_full_open_drops"] = s.ssd_disk_full_open_drops;
  if (s.ssd_disk_free_bytes != UINT64_MAX) j["ssd_disk_free_bytes"] = s.ssd_disk_free_bytes;
  j["ssd_queue_depth"] = s.ssd_queue_depth;
  j["ssd_commits"] = s.ssd_commits;
  j["ssd_syncs"] = s.ssd_syncs;
  j["ssd_commit_failures"] = s.ssd_commit_failures;
  j["ssd_last_failed_stage"] = storage::CommitStageName(s.ssd_last_failed_stage);
  j["ssd_index_load_failed"] = s.ssd_index_load_failed;
  nlohmann::json tb = nlohmann::json::object();
  for (const auto& [id, bytes] : s.tenant_bytes) {
    const Tenant* owner = tenants_->FindById(id);
    if (t != nullptr && !t->admin && id != t->id) continue;
    tb[owner != nullptr ? owner->name : "id-" + std::to_string(id)] = bytes;
  }
  j["tenant_bytes"] = tb;
  PolicySettings p = policy();
  j["policy"] = {{"eviction", p.eviction}, {"admission", p.admission}};
  if (t != nullptr) j["tenant"] = t->name;
  return j.dump();
}

namespace {

// UnitJson's and RespUnitJson's description of one storage key (their JSON's common fields);
// `routed`: the cluster places the key (native units; RESP keys stay on the node they were
// written to, so they have no owners).
void DescribeUnit(storage::TierManager& store, const ClusterCopies* copies,
                  const cluster::Router* router, const storage::Key& key, bool routed,
                  nlohmann::json* out) {
  nlohmann::json& j = *out;
  storage::UnitInfo u;
  const bool held = store.Describe(key, &u);
  j["held"] = held;
  if (held) {
    j["tier"] = storage::TierName(u.tier);
    j["bytes"] = u.bytes;
    j["kind"] = u.kind == policies::ObjectKind::kGlobalKv ? "global_kv"
                : u.kind == policies::ObjectKind::kSwa    ? "swa"
                                                          : "blob";
    j["recompute_tokens"] = u.recompute_tokens;
    j["ttl_left_ms"] = u.ttl_left_ms == 0 ? nlohmann::json(nullptr) : nlohmann::json(u.ttl_left_ms);
    j["allow_ssd"] = u.allow_ssd;
    j["get_copy"] = copies != nullptr && copies->IsCopy(key);
  }
  if (router != nullptr) j["node"] = router->self_id();
  if (router != nullptr && routed) {
    auto view = router->View();
    nlohmann::json owners = nlohmann::json::array();
    for (size_t i : router->Owners(key, *view)) owners.push_back(view->members[i].node_id);
    j["owners"] = owners;
    j["owned_here"] = router->OwnsLocally(key);
  }
}

}  // namespace

std::string Service::UnitJson(const Tenant& t, const wire::Key& chain) const {
  nlohmann::json j;
  j["tenant"] = t.name;
  j["key"] = ToHex(chain);
  DescribeUnit(*store_, copies_, router_, Bind(t, chain), /*routed=*/true, &j);
  return JsonText(j);
}

std::string Service::RespUnitJson(const Tenant& t, std::string_view name) const {
  nlohmann::json j;
  j["tenant"] = t.name;
  j["resp_key"] = std::string(name);
  DescribeUnit(*store_, copies_, router_, BindResp(t, name), /*routed=*/false, &j);
  return JsonText(j);
}

PolicySettings Service::policy() const {
  std::lock_guard<std::mutex> lock(policy_mu_);
  return policy_;
}

std::string Service::PolicyJson() const {
  PolicySettings p = policy();
  nlohmann::json params = nlohmann::json::object();
  for (const auto& [k, v] : p.params.values) params[k] = v;
  return nlohmann::json{{"eviction", p.eviction},
                        {"admission", p.admission},
                        {"params", params},
                        {"seed", p.params.seed}}
      .dump();
}

Status Service::SetPolicy(const PolicySettings& p) {
  std::lock_guard<std::mutex> lock(policy_mu_);
  KVTIER_RETURN_IF_ERROR(store_->SetPolicy(p.eviction, p.admission, p.params));
  policy_ = p;
  return Status::Ok();
}

Status Service::SetPolicyJson(std::string_view text) {
  // Checked before the tree is built (common/json_limits.h).
  if (JsonWithinLimits<nlohmann::json>(text, kPolicyJsonDepthMax,
                                       std::numeric_limits<uint64_t>::max()) !=
      JsonLimitBreach::kNone) {
    return Status::InvalidArgument("policy body nests deeper than " +
                                   std::to_string(kPolicyJsonDepthMax) + " levels");
  }
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument("policy body must be a JSON object");
  }
  PolicySettings p = policy();
  for (const auto& [k, v] : j.items()) {
    if (k == "eviction" || k == "admission") {
      if (!v.is_string()) return Status::InvalidArgument(k + " must be a string");
      (k == "eviction" ? p.eviction : p.admission) = v.get<std::string>();
    } else if (k == "seed") {
      if (!v.is_number_unsigned()) return Status::InvalidArgument("seed must be unsigned");
      p.params.seed = v.get<uint64_t>();
    } else if (k == "params") {
      if (!v.is_object()) return Status::InvalidArgument("params must be an object");
      p.params.values.clear();
      for (const auto& [pk, pv] : v.items()) {
        std::string text_value = pv.is_string() ? pv.get<std::string>() : pv.dump();
        p.params.values.emplace_back(pk, text_value);
      }
    } else {
      return Status::InvalidArgument("unknown policy field '" + k + "'");
    }
  }
  return SetPolicy(p);
}

std::mutex& Service::KeyLock(const storage::Key& k) {
  return resp_key_mu_[KeyId(k) % resp_key_mu_.size()];
}

// Placement of RESP writes: DRAM first (highest_tier kDram, allow_ssd); durability comes from
// the store's contract (tier_manager.h): with an SSD tier and durability batched or sync the
// put is written through to SSD (under sync before SET is acknowledged).
Status Service::RespSet(const Tenant& t, std::string_view key, std::string_view value,
                        uint64_t ttl_ms, RespKeyCache* cache) {
  return RespSetImpl(t, key, value, ttl_ms, cache, /*held=*/nullptr);
}

Status Service::RespSetImpl(const Tenant& t, std::string_view key, std::string_view value,
                            uint64_t ttl_ms, RespKeyCache* cache,
                            std::unique_lock<std::mutex>* held) {
  thread_local RespSetJob job;
  Status st = RespSetStage(t, key, value, ttl_ms, cache, &job);
  if (st.ok()) st = resp_index_.WaitDurable(job.name_seq);
  if (st.ok()) st = held != nullptr ? RespSetPutLocked(&job) : RespSetPut(&job);
  if (held != nullptr) held->unlock();  // before the commit wait (CompletePut's contract)
  if (st.ok()) st = RespSetComplete(&job);
  if (job.envelope.capacity() > kEnvelopeScratchKeepBytes) std::string().swap(job.envelope);
  return st;
}

Status Service::RespSetStage(const Tenant& t, std::string_view key, std::string_view value,
                             uint64_t ttl_ms, RespKeyCache* cache, RespSetJob* job) {
  job->tenant = &t;
  job->key = BindResp(t, key, cache);
  job->name.assign(key);
  job->ttl_ms = ttl_ms;
  job->value_bytes = value.size();
  job->renamed_seq = 0;
  job->commit = storage::DeferredCommit{};
  // The name first (durable, when the index is persisted, before the unit can be): a unit that
  // survives a restart is listed after it (docs/RESP.md "Names across restarts").
  job->indexed = false;
  if (resp_index_.AtLimit(t.id, job->key, key.size())) PruneRespNames(t, job->key, key.size());
  KVTIER_RETURN_IF_ERROR(resp_index_.Add(t.id, job->key, key, &job->indexed, &job->name_seq));
  // A name the unit carries is durable with it (one sync for both): the put need not wait
  // for the log's sync. The log still got it first (its checkpoints rely on that).
  uint64_t expire_at = 0;
  if (ttl_ms != 0) {
    const uint64_t now = UnixNowMs();
    expire_at = now + std::min(ttl_ms, std::numeric_limits<uint64_t>::max() - now);
  }
  if (EncodeEnvelope(key, value, expire_at, &job->envelope)) {
    job->name_seq = 0;
  }
  return Status::Ok();
}

Status Service::RespSetPut(RespSetJob* job) {
  std::lock_guard<std::mutex> lock(KeyLock(job->key));
  return RespSetPutLocked(job);
}

Status Service::RespSetPutLocked(RespSetJob* job) {
  storage::PutOptions po;
  po.tenant = job->tenant->id;
  po.kind = policies::ObjectKind::kBlob;
  po.ttl_ms = job->ttl_ms;
  po.defer_commit = &job->commit;
  const std::string& env = job->envelope;
  Status st = store_->Put(
      job->key, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(env.data()), env.size()),
      po);
  if (st.ok() && job->indexed && !resp_index_.Contains(job->tenant->id, job->key)) {
    // A SCAN pruned the name while the put was in flight (RespScan): log it again.
    st = resp_index_.Add(job->tenant->id, job->key, job->name, nullptr, &job->renamed_seq);
  }
  return st;
}

Status Service::RespSetComplete(RespSetJob* job) {
  Status st = store_->CompletePut(job->commit);
  if (st.ok()) st = resp_index_.WaitDurable(job->renamed_seq);
  if (st.ok())
    Trace("put", *job->tenant, std::span<const storage::Key>(&job->key, 1), job->value_bytes, 0);
  return st;
}

Status Service::RespMset(const Tenant& t, std::span<const std::string_view> kv,
                         RespKeyCache* cache) {
  std::vector<RespSetJob> jobs(kv.size() / 2);
  uint64_t name_seq = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    KVTIER_RETURN_IF_ERROR(RespSetStage(t, kv[2 * i], kv[2 * i + 1], 0, cache, &jobs[i]));
    name_seq = std::max(name_seq, jobs[i].name_seq);
  }
  KVTIER_RETURN_IF_ERROR(resp_index_.WaitDurable(name_seq));
  Status st;
  size_t put = 0;
  while (put < jobs.size() && st.ok()) {
    st = RespSetPut(&jobs[put]);
    if (st.ok()) ++put;
  }
  // Every put that succeeded is completed, also after a failure: the reply waits for them.
  for (size_t i = 0; i < put; ++i) {
    Status done = RespSetComplete(&jobs[i]);
    if (st.ok()) st = done;
  }
  return st;
}

Status Service::RespGetRaw(const Tenant& t, std::string_view key, std::vector<uint8_t>* raw,
                           std::span<const uint8_t>* value, RespKeyCache* cache) {
  storage::Key k = BindResp(t, key, cache);
  KVTIER_RETURN_IF_ERROR(store_->Get(k, raw));
  uint64_t expire_at = 0;
  size_t at = 0;
  if (!DecodeEnvelope(*raw, &expire_at, &at)) return Status::NotFound("not a RESP value");
  if (expire_at != 0 && expire_at <= UnixNowMs()) return Status::NotFound("expired");
  *value = std::span<const uint8_t>(*raw).subspan(at);
  Trace("get", t, std::span<const storage::Key>(&k, 1), value->size(), 0);
  return Status::Ok();
}

Status Service::RespGet(const Tenant& t, std::string_view key, std::string* value) {
  std::vector<uint8_t> raw;
  std::span<const uint8_t> v;
  KVTIER_RETURN_IF_ERROR(RespGetRaw(t, key, &raw, &v));
  value->assign(reinterpret_cast<const char*>(v.data()), v.size());
  return Status::Ok();
}

// An internal check (SCAN's name pruning), not a client's reference: Probe.
static bool RespExistsImpl(storage::TierManager* store, const storage::Key& k) {
  storage::LookupResult r = store->Probe(std::span<const storage::Key>(&k, 1));
  return r.hit_count == 1;
}

bool Service::RespExists(const Tenant& t, std::string_view key) {
  std::vector<uint8_t> raw;
  std::span<const uint8_t> v;
  return RespGetRaw(t, key, &raw, &v).ok();
}

Status Service::RespDel(const Tenant& t, std::string_view key) {
  storage::Key k = BindResp(t, key);
  resp_index_.Remove(t.id, k);
  std::lock_guard<std::mutex> lock(KeyLock(k));  // not between a conditional's read and write
  return store_->Delete(k);
}

Status Service::RespDelMany(const Tenant& t, std::span<const std::string_view> keys,
                            int64_t* deleted) {
  std::vector<storage::DeferredCommit> commits;
  Status st = RespDelStage(t, keys, deleted, &commits);
  Status done = RespDelComplete(commits);  // also after a failed removal: the others wait
  return st.ok() ? done : st;
}

Status Service::RespDelStage(const Tenant& t, std::span<const std::string_view> keys,
                             int64_t* deleted, std::vector<storage::DeferredCommit>* commits) {
  *deleted = 0;
  commits->assign(keys.size(), storage::DeferredCommit{});
  Status st;
  for (size_t i = 0; i < keys.size(); ++i) {
    storage::Key k = BindResp(t, keys[i]);
    resp_index_.Remove(t.id, k);
    Status removed;
    {
      std::lock_guard<std::mutex> lock(KeyLock(k));  // as RespDel's
      removed = store_->DeleteDeferred(k, &(*commits)[i]);
    }
    if (removed.ok()) ++*deleted;
    if (!removed.ok() && !removed.IsNotFound() && st.ok()) st = removed;
  }
  return st;
}

Status Service::RespDelComplete(std::span<const storage::DeferredCommit> commits) {
  Status st;
  for (const storage::DeferredCommit& c : commits) {
    Status done = store_->CompletePut(c);
    if (st.ok()) st = done;
  }
  return st;
}

Status Service::RespExpire(const Tenant& t, std::string_view key, uint64_t ttl_ms) {
  std::unique_lock<std::mutex> lock(KeyLock(BindResp(t, key)));
  std::string v;
  KVTIER_RETURN_IF_ERROR(RespGet(t, key, &v));
  return RespSetImpl(t, key, v, ttl_ms, nullptr, &lock);
}

int64_t Service::RespTtlMs(const Tenant& t, std::string_view key) {
  storage::Key k = BindResp(t, key);
  std::vector<uint8_t> raw;
  uint64_t expire_at = 0;
  size_t at = 0;
  if (!store_->Get(k, &raw).ok() || !DecodeEnvelope(raw, &expire_at, &at)) return -2;
  if (expire_at == 0) return -1;
  uint64_t now = UnixNowMs();
  if (expire_at <= now) return -2;
  return static_cast<int64_t>(
      std::min<uint64_t>(expire_at - now, std::numeric_limits<int64_t>::max()));
}

uint64_t Service::RespDbSize(const Tenant& t) {
  uint64_t present = 0, cursor = 0;
  std::vector<std::string> names;
  do {
    cursor = RespScan(t, cursor, 1024, nullptr, &names);
    present += names.size();
  } while (cursor != 0);
  return present;
}

Status Service::RespSetIf(const Tenant& t, std::string_view key, std::string_view value,
                          const resp::SetOptions& o, bool* written,
                          std::optional<std::string>* old) {
  storage::Key k = BindResp(t, key);
  std::unique_lock<std::mutex> lock(KeyLock(k));
  std::vector<uint8_t> raw;
  uint64_t expire_at = 0;
  size_t at = 0;
  Status got = store_->Get(k, &raw);
  if (!got.ok() && !got.IsNotFound()) return got;
  bool present = got.ok() && DecodeEnvelope(raw, &expire_at, &at) &&
                 (expire_at == 0 || expire_at > UnixNowMs());
  if (old != nullptr) {
    old->reset();
    if (present) old->emplace(reinterpret_cast<const char*>(raw.data()) + at, raw.size() - at);
  }
  *written = false;
  if ((o.cond == resp::SetOptions::Cond::kIfAbsent && present) ||
      (o.cond == resp::SetOptions::Cond::kIfPresent && !present)) {
    return Status::Ok();
  }
  uint64_t ttl_ms = o.ttl_ms;
  if (o.keep_ttl && present && expire_at != 0) {
    uint64_t now = UnixNowMs();
    ttl_ms = expire_at > now ? expire_at - now : 1;
  }
  KVTIER_RETURN_IF_ERROR(RespSetImpl(t, key, value, ttl_ms, nullptr, &lock));
  *written = true;
  return Status::Ok();
}

uint64_t Service::RespScan(const Tenant& t, uint64_t cursor, size_t count,
                           const std::function<bool(std::string_view)>& want,
                           std::vector<std::string>* names, uint64_t names_bytes_max) {
  names->clear();
  std::vector<RespKeyIndex::Entry> entries;
  uint64_t next = resp_index_.Scan(t.id, cursor, count, &entries, names_bytes_max);
  for (RespKeyIndex::Entry& e : entries) {
    if (want && !want(e.name)) continue;
    if (!DropNameIfGone(t.id, e)) names->push_back(std::move(e.name));
  }
  return next;
}

bool Service::DropNameIfGone(uint64_t tenant, const RespKeyIndex::Entry& e) {
  if (RespExistsImpl(store_, e.key)) return false;
  resp_index_.Remove(tenant, e.key);
  // A SET racing with this removal may have found the entry still there: look again, so a
  // key the store holds is never left out of the index by this pruning.
  if (!RespExistsImpl(store_, e.key)) return true;
  (void)resp_index_.Add(tenant, e.key, e.name);
  return false;
}

void Service::PruneRespNames(const Tenant& t, const storage::Key& k, size_t name_bytes) {
  const uint64_t now_ms = DefaultSteadyClock().NowMs();
  if (now_ms < resp_prune_quiet_until_ms_.load(std::memory_order_relaxed)) return;
  size_t dropped = PruneRespNamesOf(t.id);
  if (resp_index_.AtLimit(t.id, k, name_bytes)) {
    // Still no room: the byte limit all tenants share, filled by another's gone names perhaps.
    if (auto other = resp_index_.LargestTenantBesides(t.id)) dropped += PruneRespNamesOf(*other);
  }
  if (dropped == 0) {
    resp_prune_quiet_until_ms_.store(now_ms + kRespPruneQuietMs, std::memory_order_relaxed);
  }
}

size_t Service::PruneRespNamesOf(uint64_t tenant) {
  // A random start (positions are 1..2^63, RespKeyIndex): over many prunes every name is met.
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const uint64_t cursor = rng() / 2 + 1;
  std::vector<RespKeyIndex::Entry> entries;
  (void)resp_index_.Scan(tenant, cursor, kRespPruneEntries, &entries);
  if (entries.size() < kRespPruneEntries) {
    std::vector<RespKeyIndex::Entry> wrapped;  // past the last name: go on from the first
    (void)resp_index_.Scan(tenant, 0, kRespPruneEntries - entries.size(), &wrapped);
    for (auto& e : wrapped) entries.push_back(std::move(e));
  }
  size_t dropped = 0;
  for (const RespKeyIndex::Entry& e : entries) dropped += DropNameIfGone(tenant, e) ? 1 : 0;
  return dropped;
}

Status Service::RespFlush(const Tenant& t) { return DeleteTenant(t); }

Status Service::PersistRespNames(const std::string& path, bool sync_adds,
                                 uint64_t sync_interval_ms) {
  RespKeyIndex::LogSource source;
  source.end = [this] { return store_->SsdLogEnd(); };
  source.replay =
      [this](const storage::LogPosition& from,
             const std::function<void(uint64_t, const storage::Key&, std::string_view)>& add) {
        const Tenant* tenant = nullptr;
        return store_->ReplaySsdLog(
            from, [&](uint64_t id, const storage::Key& k, std::span<const uint8_t> value) {
              uint64_t expire_at = 0;
              size_t at = 0;
              std::string_view name;
              if (!DecodeRespEnvelope(value, &expire_at, &at, &name) || name.empty()) return;
              if (tenant == nullptr || tenant->id != id) tenant = tenants_->FindById(id);
              // Only a name that binds to the record's key is one this tenant SET (a native
              // unit that merely looks like an envelope names nothing).
              if (tenant == nullptr || BindResp(*tenant, name) != k) return;
              add(id, k, name);
            });
      };
  return resp_index_.Persist(path, sync_adds, sync_interval_ms, std::move(source));
}

}  // namespace kvtier::daemon
