// The cluster judge: a randomized, model-checked e2e test of a real etcd and three (then four)
// real kvtierd, R = 2, write_acks = 0 (all live owners), durability "sync", two tenants.
//
// Client threads write (PUT, DELETE) keys of their own, so that the full history of every key
// is known, and read (GET) the keys of every writer of their tenant, each call through a
// random node. One PUT in four has a TTL of 0.3 to 3 s (the peer protocol carries it: owners,
// repair copies and GET copies must all let the unit go with it), and a thread of its own
// deletes a random tenant's every unit (the native client's DeleteAll: the router's fan-out
// to every live member and the tombstone log) through a random node every 4 to 9 s, during
// faults too, but not while the nemesis waits for repair to settle. The two
// tenants' writers use the same chain keys: a read that crosses tenants decodes as the other
// tenant's value. Every value is self-describing (tenant, writer, key, version, length, checksum)
// and rebuilt bit for bit by the judge, so a read is attributed to exactly one PUT ever sent.
// Meanwhile a nemesis, one fault at a time, kills a node (kill -9) and restarts it on its data
// directory after its lease ran out or within it, stops one (SIGSTOP) past its lease and continues
// it, stops one gracefully (it leaves) and starts it again, and starts a fourth node (a join);
// after each fault it waits until every node agrees on the members and its repair is settled. At
// the end every key is read and looked up through every node.
//
// Clients also LOOKUP chains of their tenant's keys through random nodes, each followed by a
// GET of the same chain through the same node, and every LOOKUP's hit count is judged too
// (JudgeLookup). The test runs twice: without GET copies, and with them on every node
// ([cluster] get_copy_bytes_max; docs/CLUSTER.md, "Copies"): n0's small and short-lived, so
// that copies are evicted and expire all the time, the others' large and long-lived, so that
// a node stopped past its lease comes back holding copies of keys overwritten meanwhile.
// The judge's rules for hits apply to a hit on a copy unchanged: the docs allow a copy no
// window of staleness beyond those the rules already allow ("GET copies and watch lag": a
// write during a (re)join does not raise the floor).
//
// The judge's rules (docs/CLUSTER.md) are listed where they are applied, in Judge below.
// Every op is stamped with a global tick taken before it is sent and after its reply arrived;
// the nemesis and the tenant deleter stamp their events with the same ticks. Only the TTL
// rules depend on time: the steady clock (the one the daemons' stores expire units by) read
// before the send and after the reply, with a margin (kTtlMarginMs): a unit is never served
// once its TTL from its PUT's reply has run out, and a miss is a loss only while its TTL from
// its PUT's send can not have run out.
//
// Default run (label e2e): a few faults. KVTIER_CLUSTER_JUDGE_SLOW (label slow): many faults.
// Both with TTL units and tenant deletes (KVTIER_JUDGE_TTL=0 and KVTIER_JUDGE_TENANT_DELETES=0
// leave them out, to tell their failures from others').
// KVTIER_JUDGE_SEED=<n> in the environment runs another seed; a failure prints its seed, the
// history of every key it judged wrong and the nemesis's events, and keeps the nodes' logs.
// KVTIER_JUDGE_PEER_PROBE_MS=<ms> sets [cluster] peer_probe_interval_ms (peer suspicion; 0 turns
// it off; kvtierd's default, 500 ms, otherwise).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "common/checksum.h"
#include "common/key_spec.h"
#include "tests/cluster/cluster_fixture.h"

namespace kvtier::cluster {
namespace {

#ifdef KVTIER_CLUSTER_JUDGE_SLOW
constexpr int kFaults = 24;
#else
constexpr int kFaults = 5;
#endif
constexpr int kWriters = 4;         // writer w is tenant w % 2; writers w and w ^ 1 share keys
constexpr int kKeysPerWriter = 10;  // per writer: small, so that keys are written often
// Keys [kHotKeys, kKeysPerWriter) get one write in 10, and one of their writes in 40 is a
// DELETE: seconds between writes and over a minute between deletes, so that GET copies of
// them are kept (a node keeps no copy of a key deleted there in the last 10 s, "Copies",
// rule 3), served, and then dropped by a write (or a delete now and then). The hot keys'
// copies are mostly refused for their deletes: they race the fence.
constexpr int kHotKeys = 5;
constexpr int kNodesMax = 4;  // the fixture's three and one that joins
constexpr uint32_t kValueBytesMin = 256;
constexpr uint32_t kValueBytesMax = 20000;
constexpr int kViolationsShownMax = 12;
constexpr size_t kHistoryShownMax = 24;
// Any one wait of the nemesis: generous, for a loaded 2-core VM, and for a fault after a tenant
// delete: every node that applied it refuses repair copies of that tenant for 10 s ("Deletes
// and repair", rule 1; the joining node applies every tenant delete in the log when it
// starts), and a sender whose copies were refused rescans at least every 10 s ("Repair"), so
// repair may settle 20 s later than it would otherwise.
constexpr int kWaitMs = 60000;
constexpr int kLookupKeysMax = 5;  // a LOOKUP's chain: 1..5 consecutive keys of one writer
// GET copies (the second run). n0: room for a few values only and the shortest TTL the
// config takes, so that its copies are dropped for room and expire again and again. The
// others: room for every key and a TTL longer than a run, so that copies stay until a write
// drops them, and a node continued after a SIGSTOP past its lease still holds copies of keys
// overwritten meanwhile: only the lease rule ("Copies", rule 4) keeps it from serving them.
constexpr uint64_t kCopyBytesSmallMax = 65536, kCopyBytesLargeMax = 4194304;
constexpr uint64_t kCopyTtlShortMs = 1000, kCopyTtlLongMs = 600000;
// TTL units: one PUT in kTtlPutsOneIn has a TTL of kTtlMinMs..kTtlMaxMs (the hot keys are
// mostly overwritten first, the others expire between their writes, and their GET copies,
// 600 s on n1..n3, must go with them: "Copies", rule 5).
constexpr int kTtlPutsOneIn = 4;
constexpr uint64_t kTtlMinMs = 300, kTtlMaxMs = 3000;
// The TTL rules are the judge's only rules in time: a unit's TTL runs on its owner's store
// clock, the steady clock (CLOCK_MONOTONIC) this test reads too. Its owners write it between
// the PUT's send and its reply, so it expires between send_ms + ttl and ack_ms + ttl. The
// margin covers the rest, all of it small: both clocks read in whole milliseconds (1 ms each
// side), a unit recovered from SSD after a restart keeps its expiry in wall-clock ms and
// converts it back (two clock readings), and a repair copy names the Unix millisecond its
// unit ends, which its owner keeps to by the same machine's clock (docs/CLUSTER.md, "Repair";
// it used to count the TTL from the copy's arrival and outlived its unit by its transit,
// about 300 ms once when both long cases ran beside other suites on 2 cores).
constexpr int64_t kTtlMarginMs = 50;
// Tenant deletes (the native client's delete of every unit of its tenant, through a random
// node): a thread of their own, one every kTenantDeleteGapMinMs..MaxMs, of a random tenant.
// Rare: each wipes a tenant's whole state, and a node refuses repair copies and GET copies of
// a tenant it deleted in the last 10 s ("Deletes and repair", rule 1; "Copies", rule 3).
// Session 32 kept them and TTL units to the long run: the short run timed out waiting for
// repair to settle in about one run in twelve (seeds 401, 419, 501), a move reported for a
// minute, because the repair scan's retries doubled up to its full interval after refused
// copies and its moves gauge kept units deleted meanwhile. Both fixed (session 33: 30 seeds
// with them on settled every time, 401, 419, 501 and 606 among them; the one violation they
// found, seed 646, a stale read through a node continued after a SIGSTOP, is fixed too: the
// pause guard), they run in the short run.
constexpr int kTenantDeleteGapMinMs = 3000, kTenantDeleteGapMaxMs = 9000;
// On unless the environment sets `variable` to 0.
bool OnUnlessOff(const char* variable) {
  const char* e = std::getenv(variable);
  return e == nullptr || std::string(e) != "0";
}
bool TtlUnits() { return OnUnlessOff("KVTIER_JUDGE_TTL"); }
bool TenantDeletes() { return OnUnlessOff("KVTIER_JUDGE_TENANT_DELETES"); }

const char* const kTokens[2] = {"tok-alice", "tok-bob"};

uint64_t Seed() {
  const char* s = std::getenv("KVTIER_JUDGE_SEED");
  return s != nullptr ? std::strtoull(s, nullptr, 10) : 1;
}

// The global clock of the judge: strictly increasing, shared by clients and the nemesis.
std::atomic<uint64_t> g_tick{0};
uint64_t Tick() { return g_tick.fetch_add(1) + 1; }
// The steady clock in ms, for the TTL rules only (kTtlMarginMs).
int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Key WriterKey(int writer, int k) { return ChainKey("judge-w" + std::to_string(writer / 2), k); }

// A value: header (magic, tenant, writer, key, version, length of the whole value) and bytes
// drawn from the header, then an xxh3-64 of all that.
constexpr uint32_t kMagic = 0x4a56544b;  // "KTVJ"
constexpr size_t kHeaderBytes = 32;
struct ValueId {
  uint32_t tenant = 0, writer = 0, key = 0;
  uint64_t version = 0;
  uint32_t length_bytes = 0;
};
std::vector<uint8_t> BuildValue(const ValueId& id) {
  std::vector<uint8_t> v(id.length_bytes);
  auto put32 = [&](size_t at, uint32_t x) { std::memcpy(v.data() + at, &x, 4); };
  put32(0, kMagic);
  put32(4, id.tenant);
  put32(8, id.writer);
  put32(12, id.key);
  std::memcpy(v.data() + 16, &id.version, 8);
  put32(24, id.length_bytes);
  std::mt19937_64 rng(Xxh3_64(v.data(), 28));
  for (size_t i = kHeaderBytes; i + 8 <= v.size(); i += 8) {
    const uint64_t r = rng();
    std::memcpy(v.data() + i, &r, 8);
  }
  const uint64_t sum =
      Xxh3_64(v.data() + kHeaderBytes, v.size() - kHeaderBytes) ^ Xxh3_64(v.data(), 28);
  std::memcpy(v.data() + 28, &sum, 4);
  return v;
}
// The PUT `bytes` came from, if they are exactly the bytes of one (never torn or foreign).
std::optional<ValueId> DecodeValue(std::span<const uint8_t> bytes) {
  if (bytes.size() < kHeaderBytes) return std::nullopt;
  ValueId id;
  uint32_t magic = 0;
  std::memcpy(&magic, bytes.data(), 4);
  std::memcpy(&id.tenant, bytes.data() + 4, 4);
  std::memcpy(&id.writer, bytes.data() + 8, 4);
  std::memcpy(&id.key, bytes.data() + 12, 4);
  std::memcpy(&id.version, bytes.data() + 16, 8);
  std::memcpy(&id.length_bytes, bytes.data() + 24, 4);
  if (magic != kMagic || id.length_bytes != bytes.size() || id.length_bytes < kHeaderBytes ||
      id.length_bytes > kValueBytesMax) {
    return std::nullopt;
  }
  const std::vector<uint8_t> want = BuildValue(id);
  if (!std::equal(want.begin(), want.end(), bytes.begin())) return std::nullopt;
  return id;
}

// One PUT or DELETE of a writer's key; its index in the key's history is a PUT's version.
struct WriteOp {
  bool put = false;
  uint32_t length_bytes = 0;
  uint64_t ttl_ms = 0;              // a PUT's TTL (0: none)
  uint64_t send = 0, ack = 0;       // ticks before sending, after the reply
  int64_t send_ms = 0, ack_ms = 0;  // steady ms before sending, after the reply (TTL rules)
  bool acked = false;
  int node = 0;
  std::string error;
};
// One key's result of a GET.
struct ReadOp {
  int writer = 0, key = 0;  // whose key (the reader's tenant is the writer's)
  uint64_t send = 0, ack = 0;
  int64_t send_ms = 0, ack_ms = 0;
  int node = 0;
  enum Result { kHit, kMiss, kError } result = kMiss;
  std::optional<ValueId> value;  // a hit that decodes; nullopt for a hit that does not
  std::string error;
  bool final_read = false;
};

// A LOOKUP of `count` keys of a writer, [first_key, first_key + count), and the GET of the
// same chain through the same node that followed it (judged as ReadOps, and here against
// the LOOKUP's answer).
struct LookupOp {
  int writer = 0, first_key = 0, count = 0;
  uint64_t send = 0, ack = 0;  // the LOOKUP's
  uint64_t get_ack = 0;        // the GET's reply (0: no GET followed)
  int64_t send_ms = 0, ack_ms = 0, get_ack_ms = 0;
  int node = 0;
  bool ok = false;
  size_t hit_count = 0;
  std::string error;
  std::vector<ReadOp::Result> get;  // the GET's result of each key of the chain
  bool final_read = false;
};

// A delete of every unit of a tenant (Client::DeleteAll) through a node.
struct TenantDeleteOp {
  int tenant = 0;
  uint64_t send = 0, ack = 0;
  int64_t send_ms = 0;
  bool acked = false;
  int node = 0;
  std::string error;
};

// Ticks [from, to] (to = UINT64_MAX while open) for a node (-1: every node).
struct Window {
  uint64_t from = 0, to = UINT64_MAX;
  int node = -1;
  std::string what;
  bool Covers(uint64_t send, uint64_t ack) const { return from < send && ack < to; }
  bool Overlaps(uint64_t send, uint64_t ack) const { return send < to && from < ack; }
};

struct Writer {
  std::vector<WriteOp> history[kKeysPerWriter];
};

// The parameter: whether every node keeps GET copies.
class ClusterJudgeTest : public ClusterE2eTest, public ::testing::WithParamInterface<bool> {
 protected:
  ClusterJudgeTest() { keep_dir_on_failure_ = true; }
  // Room for every size class in DRAM: no unit is evicted, so a miss is a loss (a copy is
  // dropped by get_copy_bytes_max long before DRAM runs short).
  uint64_t DramCapacityBytes(int /*i*/) const override { return 134217728; }
  std::string ExtraClusterConfig(int i) override {
    // KVTIER_JUDGE_PEER_PROBE_MS=<ms>: another probe interval for peer suspicion (0: off).
    std::string config;
    if (const char* probe = std::getenv("KVTIER_JUDGE_PEER_PROBE_MS"); probe != nullptr) {
      char* end = nullptr;
      const unsigned long long ms = std::strtoull(probe, &end, 10);
      if (*probe == '\0' || *end != '\0' || ms > 60000) {
        ADD_FAILURE() << "KVTIER_JUDGE_PEER_PROBE_MS=" << probe << ": 0 or 10..60000 expected";
      }
      config = "peer_probe_interval_ms = " + std::to_string(ms) + "\n";
    }
    if (!GetParam()) return config;
    return config + "get_copy_bytes_max = " +
           std::to_string(i == 0 ? kCopyBytesSmallMax : kCopyBytesLargeMax) +
           "\nget_copy_ttl_ms = " + std::to_string(i == 0 ? kCopyTtlShortMs : kCopyTtlLongMs) +
           "\n";
  }
  // Adds node n's copy counters to copy_stats_ and its suspicion counters to suspicion_stats_
  // (call before its process ends, and at the end).
  void CountNodeStats(int n) {
    const std::string m = Metrics(n);
    suspicion_stats_[0] += std::max(0.0, Metric(m, "kvtier_cluster_peer_suspicions_total"));
    suspicion_stats_[1] += std::max(0.0, Metric(m, "kvtier_cluster_peer_calls_failed_fast_total"));
    if (!GetParam()) return;
    const char* const names[4] = {
        "kvtier_cluster_copy_kept_total", "kvtier_cluster_copy_hits_total",
        "kvtier_cluster_copy_dropped_total", "kvtier_cluster_copy_fenced_total"};
    for (int i = 0; i < 4; ++i) copy_stats_[i] += std::max(0.0, Metric(m, names[i]));
  }

  // Every started node alive, agreeing on `live` members, registered, answering its peers
  // (not holding them after a pause: docs/CLUSTER.md, "Tombstones"), its repair settled.
  bool ClusterSettled(const std::vector<int>& live) {
    for (int n : live) {
      if (!nodes_[n]->Alive()) return false;
      const std::string m = Metrics(n);
      if (Metric(m, "kvtier_cluster_members") != static_cast<double>(live.size()) ||
          Metric(m, "kvtier_cluster_registrations_total") < 1 ||
          Metric(m, "kvtier_cluster_peer_answers_held") != 0) {
        return false;
      }
    }
    for (int n : live) {
      if (!RepairSettled(n)) return false;
    }
    return true;
  }
  // What keeps `live` from settling, per node (for a failed wait's message).
  std::string SettleState(const std::vector<int>& live) {
    std::ostringstream out;
    const char* const names[] = {"kvtier_cluster_members",
                                 "kvtier_cluster_registrations_total",
                                 "kvtier_cluster_peer_answers_held",
                                 "kvtier_cluster_repair_active",
                                 "kvtier_cluster_under_replicated_units",
                                 "kvtier_cluster_moves_in_progress",
                                 "kvtier_cluster_repair_scans_total",
                                 "kvtier_cluster_repair_copy_failures_total",
                                 "kvtier_cluster_repair_refused_deleted_total"};
    for (int n : live) {
      out << "\n  n" << n << (nodes_[n]->Alive() ? "" : " (dead)");
      const std::string m = Metrics(n);
      for (const char* name : names) out << " " << (name + 14) << "=" << Metric(m, name);
    }
    return out.str();
  }
  bool MembersAre(const std::vector<int>& at, size_t count) {
    for (int n : at) {
      if (Metric(Metrics(n), "kvtier_cluster_members") != static_cast<double>(count)) return false;
    }
    return true;
  }

  void Event(const std::string& what) {
    std::lock_guard lock(events_mu_);
    events_ << "tick " << Tick() << ": " << what << "\n";
  }

  // One client thread: writer w's ops until stop.
  void ClientLoop(int w, uint64_t seed, std::vector<ReadOp>* reads,
                  std::vector<LookupOp>* lookups) {
    const bool ttl_units = TtlUnits();
    std::mt19937_64 rng(seed);
    const int tenant = w % 2;
    std::unique_ptr<Client> clients[kNodesMax];
    int epochs[kNodesMax] = {};
    auto client = [&](int n) -> Client* {
      // A connection to a node's previous process fails: connect again after a restart.
      const int epoch = node_epoch_[n].load();
      if (epochs[n] != epoch) clients[n].reset();
      epochs[n] = epoch;
      if (clients[n] == nullptr) {
        auto c = Client::Connect(ClientOptions{.socket_path = nodes_[n]->socket(),
                                               .token = kTokens[tenant],
                                               .shm_bytes = 4u << 20,
                                               .timeout_ms = 60000});
        if (c.ok()) clients[n] = std::move(*c);
      }
      return clients[n].get();
    };
    while (!stop_.load()) {
      int n = static_cast<int>(rng() % static_cast<uint64_t>(live_nodes_.load()));
      // Not through a node the nemesis stopped (its calls would wait for its SIGCONT, and
      // soon every client with them): the others keep the traffic going meanwhile.
      if (paused_[n].load()) n = (n + 1) % live_nodes_.load();
      const int dice = static_cast<int>(rng() % 100);
      if (dice < 45) {
        const int k = rng() % 10 != 0
                          ? static_cast<int>(rng() % kHotKeys)
                          : kHotKeys + static_cast<int>(rng() % (kKeysPerWriter - kHotKeys));
        auto& h = writers_[w].history[k];
        WriteOp op;
        op.put = k < kHotKeys ? dice < 35 : rng() % 40 != 0;
        op.node = n;
        const Key key = WriterKey(w, k);
        std::vector<uint8_t> value;
        if (op.put) {
          op.length_bytes =
              kValueBytesMin + static_cast<uint32_t>(rng() % (kValueBytesMax - kValueBytesMin));
          if (ttl_units && rng() % kTtlPutsOneIn == 0)
            op.ttl_ms = kTtlMinMs + rng() % (kTtlMaxMs - kTtlMinMs);
          value = BuildValue(ValueId{.tenant = static_cast<uint32_t>(tenant) + 1,
                                     .writer = static_cast<uint32_t>(w),
                                     .key = static_cast<uint32_t>(k),
                                     .version = h.size(),
                                     .length_bytes = op.length_bytes});
        }
        Client* c = client(n);
        op.send = Tick();
        op.send_ms = SteadyMs();
        if (c == nullptr) {
          op.error = "connect failed";
        } else if (op.put) {
          PutUnit u;
          u.key = key;
          u.value = value;
          auto st = c->Put(std::span<const PutUnit>(&u, 1), {.ttl_ms = op.ttl_ms});
          if (!st.ok()) {
            op.error = st.status().ToString();
          } else if (!(*st)[0].ok()) {
            op.error = (*st)[0].ToString();
          } else {
            op.acked = true;
          }
        } else {
          auto st = c->Delete(std::span<const Key>(&key, 1));
          if (st.ok()) {
            op.acked = true;
          } else {
            op.error = st.status().ToString();
          }
        }
        op.ack_ms = SteadyMs();
        op.ack = Tick();
        if (!op.acked && op.error.find("io_error") != std::string::npos) clients[n].reset();
        h.push_back(std::move(op));
        continue;
      }
      if (dice < 55) {
        // A LOOKUP of a chain of this tenant's keys, then a GET of it through the same node.
        LookupOp l;
        l.writer = tenant + 2 * static_cast<int>(rng() % (kWriters / 2));
        l.first_key = static_cast<int>(rng() % kKeysPerWriter);
        l.count =
            1 + static_cast<int>(rng() % std::min(kLookupKeysMax, kKeysPerWriter - l.first_key));
        l.node = n;
        LookupThenGet(client(n), &l, reads);
        if (l.error.find("io_error") != std::string::npos) clients[n].reset();
        lookups->push_back(std::move(l));
        continue;
      }
      // A GET of 1..4 keys of this tenant's writers (this one included).
      const int count = 1 + static_cast<int>(rng() % 4);
      std::vector<Key> keys;
      std::vector<ReadOp> batch;
      for (int i = 0; i < count; ++i) {
        ReadOp r;
        r.writer = tenant + 2 * static_cast<int>(rng() % (kWriters / 2));
        r.key = static_cast<int>(rng() % kKeysPerWriter);
        r.node = n;
        keys.push_back(WriterKey(r.writer, r.key));
        batch.push_back(r);
      }
      ReadBatch(client(n), keys, &batch);
      if (std::any_of(batch.begin(), batch.end(), [](const ReadOp& r) {
            return r.result == ReadOp::kError && r.error.find("io_error") != std::string::npos;
          })) {
        clients[n].reset();
      }
      reads->insert(reads->end(), batch.begin(), batch.end());
    }
  }

  // The tenant deleter: until stop, every kTenantDeleteGapMinMs..MaxMs, deletes every unit of
  // a random tenant through a random node (not one the nemesis stopped, as the clients do).
  void TenantDeleterLoop(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::unique_ptr<Client> clients[2][kNodesMax];
    int epochs[kNodesMax] = {};
    while (!stop_.load()) {
      const auto until =
          std::chrono::steady_clock::now() +
          std::chrono::milliseconds(kTenantDeleteGapMinMs +
                                    rng() % (kTenantDeleteGapMaxMs - kTenantDeleteGapMinMs));
      // Not while the nemesis waits for repair to settle: each tenant delete refuses the
      // tenant's repair copies for 10 s, and deletes every few seconds would keep a scan
      // refused for as long as they go on (docs/CLUSTER.md, "Not guaranteed": repair waits).
      while (!stop_.load() && (std::chrono::steady_clock::now() < until || settling_.load())) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (stop_.load()) return;
      TenantDeleteOp d;
      d.tenant = static_cast<int>(rng() % 2);
      int n = static_cast<int>(rng() % static_cast<uint64_t>(live_nodes_.load()));
      if (paused_[n].load()) n = (n + 1) % live_nodes_.load();
      d.node = n;
      const int epoch = node_epoch_[n].load();
      if (epochs[n] != epoch) {
        clients[0][n].reset();
        clients[1][n].reset();
      }
      epochs[n] = epoch;
      auto& c = clients[d.tenant][n];
      if (c == nullptr) {
        auto made = Client::Connect(ClientOptions{.socket_path = nodes_[n]->socket(),
                                                  .token = kTokens[d.tenant],
                                                  .shm_bytes = 0,
                                                  .timeout_ms = 60000});
        if (made.ok()) c = std::move(*made);
      }
      d.send = Tick();
      d.send_ms = SteadyMs();
      if (c == nullptr) {
        d.error = "connect failed";
      } else if (Status st = c->DeleteAll(); st.ok()) {
        d.acked = true;
      } else {
        d.error = st.ToString();
        c.reset();
      }
      d.ack = Tick();
      Event("tenant delete of tenant " + std::to_string(d.tenant) + " via n" + std::to_string(n) +
            " ticks " + std::to_string(d.send) + ".." + std::to_string(d.ack) +
            (d.acked ? " acked" : " FAILED " + d.error));
      tenant_deletes_.push_back(std::move(d));
    }
  }

  // LOOKUPs l's chain through c (null: not connected), then, if that answered and reads is
  // not null, GETs it through c; fills in l and appends the GET's ops to reads.
  static void LookupThenGet(Client* c, LookupOp* l, std::vector<ReadOp>* reads) {
    std::vector<Key> keys;
    std::vector<ReadOp> batch;
    for (int k = l->first_key; k < l->first_key + l->count; ++k) {
      keys.push_back(WriterKey(l->writer, k));
      batch.push_back(
          ReadOp{.writer = l->writer, .key = k, .node = l->node, .final_read = l->final_read});
    }
    l->send = Tick();
    l->send_ms = SteadyMs();
    if (c == nullptr) {
      l->error = "connect failed";
    } else {
      auto hit = c->Lookup(keys);
      if (hit.ok()) {
        l->ok = true;
        l->hit_count = hit->hit_count;
      } else {
        l->error = hit.status().ToString();
      }
    }
    l->ack_ms = SteadyMs();
    l->ack = Tick();
    if (!l->ok || reads == nullptr) return;
    ReadBatch(c, keys, &batch);
    l->get_ack = batch.front().ack;
    l->get_ack_ms = batch.front().ack_ms;
    for (const ReadOp& r : batch) {
      l->get.push_back(r.result);
      if (r.result == ReadOp::kError && l->error.empty()) l->error = r.error;
    }
    reads->insert(reads->end(), batch.begin(), batch.end());
  }

  // GETs `keys` through c (null: not connected) and fills in each op's result and ticks.
  static void ReadBatch(Client* c, const std::vector<Key>& keys, std::vector<ReadOp>* batch) {
    const uint64_t send = Tick();
    const int64_t send_ms = SteadyMs();
    Status st = Status::IOError("connect failed");
    if (c != nullptr) {
      st = c->Get(keys, [&](size_t i, const daemon::GetItem& g) {
        ReadOp& r = (*batch)[i];
        if (g.status.ok()) {
          r.result = ReadOp::kHit;
          r.value = DecodeValue(g.value);
        } else if (g.status.IsNotFound()) {
          r.result = ReadOp::kMiss;
        } else {
          r.result = ReadOp::kError;
          r.error = g.status.ToString();
        }
      });
    }
    const int64_t ack_ms = SteadyMs();
    const uint64_t ack = Tick();
    for (auto& r : *batch) {
      r.send = send;
      r.ack = ack;
      r.send_ms = send_ms;
      r.ack_ms = ack_ms;
      if (!st.ok()) {
        r.result = ReadOp::kError;
        r.error = st.ToString();
      }
    }
  }

  // The writes of writer w's key k sent before tick `until` (the last kHistoryShownMax).
  std::string History(int w, int k, uint64_t until) const {
    std::ostringstream out;
    const auto& h = writers_[w].history[k];
    size_t end = 0;
    while (end < h.size() && h[end].send < until) ++end;
    const size_t begin = end > kHistoryShownMax ? end - kHistoryShownMax : 0;
    for (size_t v = begin; v < end; ++v) {
      const WriteOp& op = h[v];
      out << "    v" << v << " " << (op.put ? "PUT" : "DELETE") << " via n" << op.node << " ticks "
          << op.send << ".." << op.ack;
      if (op.ttl_ms != 0) {
        out << " ttl " << op.ttl_ms << " ms (sent at " << op.send_ms - t0_ms_ << " ms, reply at "
            << op.ack_ms - t0_ms_ << " ms)";
      }
      out << (op.acked ? " acked" : " FAILED " + op.error) << "\n";
    }
    // The tenant deletes of its tenant sent from the first write shown on.
    const uint64_t from = begin < end ? h[begin].send : 0;
    for (const TenantDeleteOp& d : tenant_deletes_) {
      if (d.tenant != w % 2 || d.send < from || d.send >= until) continue;
      out << "    TENANT DELETE via n" << d.node << " ticks " << d.send << ".." << d.ack
          << (d.acked ? " acked" : " FAILED " + d.error) << "\n";
    }
    return out.str();
  }

  // A read through `node` between its fault and its registration (its catch-up on the
  // tombstone log before it registers): docs/CLUSTER.md, "Not guaranteed": "local clients of
  // a node that was just continued can read a deleted unit until its first catch-up". The
  // same holds for a node restarted after its lease or a graceful stop (deletes sent while it
  // is out of the views reach it with that catch-up), not for one restarted within its lease
  // (it catches up before it accepts a client), and for overwrites (the overwrite tombstone
  // of "PUT").
  bool Recovering(int node, uint64_t send, uint64_t ack) const {
    for (const Window& w : recovering_) {
      if (w.node == node && w.Overlaps(send, ack)) return true;
    }
    return false;
  }
  bool Settled(uint64_t send, uint64_t ack) const {
    for (const Window& w : settled_) {
      if (w.Covers(send, ack)) return true;
    }
    return false;
  }
  // The floor of a read sent at tick `send`: the index of the last write of h acknowledged
  // before it (-1: none). A write sent while a node (re)joined may have been routed by a view
  // that had not seen it yet ("Not guaranteed": "a newcomer that already holds a hand-over
  // copy of the key then keeps the older value until the key is written again"; "GET copies
  // and watch lag": a PUT does not tell a keeper its view has not seen rejoin, which serves
  // its old copy until the TTL): it does not raise the floor.
  int Floor(const std::vector<WriteOp>& h, uint64_t send) const {
    for (int v = static_cast<int>(h.size()) - 1; v >= 0; --v) {
      const WriteOp& op = h[static_cast<size_t>(v)];
      if (!op.acked || op.ack >= send) continue;
      bool weak = false;
      for (const Window& w : joins_) weak = weak || w.Overlaps(op.send, op.ack);
      if (!weak) return v;
    }
    return -1;
  }
  // Whether a write of h after the floor was sent before tick `ack` (acknowledged or not:
  // a failed write may have reached some nodes); puts_only: PUTs only.
  static bool LaterWrites(const std::vector<WriteOp>& h, int floor, uint64_t ack,
                          bool puts_only = false) {
    for (size_t v = static_cast<size_t>(floor + 1); v < h.size(); ++v) {
      if (h[v].send < ack && (h[v].put || !puts_only)) return true;
    }
    return false;
  }
  // Whether a write of h was in flight at some point of ticks (from, to): sent before `to`
  // and not acknowledged before `from`.
  static bool WriteDuring(const std::vector<WriteOp>& h, uint64_t from, uint64_t to) {
    for (const WriteOp& op : h) {
      if (op.send < to && (!op.acked || op.ack > from)) return true;
    }
    return false;
  }

  // Tenant deletes ("Guaranteed (tested)": "A DELETE or tenant DELETE through any node removes
  // the units from every live node"; Router: applied locally, sent to every live member, then
  // recorded in the tombstone log; "Copies", rule 1: every path drops the tenant's copies).
  // A tenant delete surely removed PUT p when p was acknowledged before the delete was sent;
  // a PUT in flight meanwhile may land before or after it. Why a read sent at tick `send`
  // may not see p ("" when it may): a tenant delete acknowledged before it was sent surely
  // removed p. A tenant delete sent while a node (re)joined does not count, as a write then
  // does not raise the floor (Floor): a fan-out by a view that has not seen the newcomer
  // misses it, which applies the tombstone only at its next catch-up.
  std::string WipedBefore(int tenant, const WriteOp& p, uint64_t send) const {
    for (const TenantDeleteOp& d : tenant_deletes_) {
      if (d.tenant != tenant || !d.acked || d.ack >= send || !p.acked || p.ack >= d.send) {
        continue;
      }
      bool weak = false;
      for (const Window& w : joins_) weak = weak || w.Overlaps(d.send, d.ack);
      if (weak) continue;
      return "removed by the tenant delete of ticks " + std::to_string(d.send) + ".." +
             std::to_string(d.ack);
    }
    return "";
  }
  // Whether a tenant delete may have removed PUT f before tick `ack`: sent before it and not
  // acknowledged before f was sent (a delete that failed may have reached any node, when).
  bool TenantDeleteAfter(int tenant, const WriteOp& f, uint64_t ack) const {
    for (const TenantDeleteOp& d : tenant_deletes_) {
      if (d.tenant == tenant && d.send < ack && (!d.acked || d.ack > f.send)) return true;
    }
    return false;
  }
  // Whether a tenant delete was in flight at some point of ticks (from, to).
  bool TenantDeleteDuring(int tenant, uint64_t from, uint64_t to) const {
    for (const TenantDeleteOp& d : tenant_deletes_) {
      if (d.tenant == tenant && d.send < to && (!d.acked || d.ack > from)) return true;
    }
    return false;
  }
  // TTL units (kTtlMarginMs): p surely expired on every node by steady ms `at` (its owners
  // wrote it before p.ack_ms; a copy of it never outlives it: "Copies", rule 5; a repair copy
  // carries the TTL left and the Unix millisecond its unit ends), or may have expired
  // somewhere by then (written after p.send_ms).
  static bool SurelyExpired(const WriteOp& p, int64_t at) {
    return p.ttl_ms != 0 && at > p.ack_ms + static_cast<int64_t>(p.ttl_ms) + kTtlMarginMs;
  }
  static bool MayHaveExpired(const WriteOp& p, int64_t at) {
    return p.ttl_ms != 0 && at + kTtlMarginMs >= p.send_ms + static_cast<int64_t>(p.ttl_ms);
  }

  // Returns the reason `r` breaks a rule, or "" when the docs allow it.
  std::string Judge(const ReadOp& r) const {
    const auto& h = writers_[r.writer].history[r.key];
    const int tenant = r.writer % 2;
    const bool recovering = Recovering(r.node, r.send, r.ack);
    const bool settled = r.final_read || Settled(r.send, r.ack);
    // The floor: the last write acknowledged before the GET was sent, and whether writes sent
    // after it may have happened before the reply.
    const int floor = Floor(h, r.send);
    const bool later_writes = LaterWrites(h, floor, r.ack);
    if (r.result == ReadOp::kError) {
      // "Failure model": a call to a node being killed or stopped fails; a GET through a live
      // node tries the next owner. Outside a fault, an error is a defect.
      return settled ? "GET error outside any fault: " + r.error : "";
    }
    if (r.result == ReadOp::kMiss) {
      // A cache may miss, except what "Guaranteed (tested)" promises: with one node down at
      // a time and R restored after each fault, every acknowledged unit is read through every
      // node (kill -9 under writes, R = 2, write_acks = 0, sync; a stopped node "still serves
      // the rest"). Judged only while the cluster is settled. Not a unit a tenant delete may
      // have removed before the reply, nor one whose TTL may have run out by then.
      if (settled && !recovering && floor >= 0 && h[static_cast<size_t>(floor)].put &&
          !later_writes && !TenantDeleteAfter(tenant, h[static_cast<size_t>(floor)], r.ack) &&
          !MayHaveExpired(h[static_cast<size_t>(floor)], r.ack_ms)) {
        return "miss of v" + std::to_string(floor) + ", acknowledged before the GET was sent";
      }
      return "";
    }
    if (!r.value.has_value()) return "a hit whose bytes are no PUT's (torn or foreign)";
    const ValueId& id = *r.value;
    if (id.tenant != static_cast<uint32_t>(tenant) + 1) {
      return "a hit with tenant " + std::to_string(id.tenant) + "'s value";
    }
    if (id.writer != static_cast<uint32_t>(r.writer) || id.key != static_cast<uint32_t>(r.key)) {
      return "a hit with another key's value (writer " + std::to_string(id.writer) + " key " +
             std::to_string(id.key) + ")";
    }
    if (id.version >= h.size() || !h[id.version].put ||
        h[id.version].length_bytes != id.length_bytes || h[id.version].send > r.ack) {
      return "a hit with v" + std::to_string(id.version) + ", never put before the reply";
    }
    // A TTL unit is served only while its TTL can not have run out (kTtlMarginMs), wherever it
    // is held (its owners, a repair copy, a GET copy: "Copies", rule 5), and a recovering node
    // is no exception: expiry is each store's own.
    if (const WriteOp& p = h[id.version]; SurelyExpired(p, r.send_ms)) {
      return "a hit with v" + std::to_string(id.version) + ", whose TTL of " +
             std::to_string(p.ttl_ms) + " ms ran out " +
             std::to_string(r.send_ms - p.ack_ms - static_cast<int64_t>(p.ttl_ms)) +
             " ms before the GET was sent (at " + std::to_string(r.send_ms - t0_ms_) + " ms)";
    }
    if (recovering) return "";
    // Not older than the floor ("Versions": an older value never replaces or is served after a
    // newer acknowledged PUT), and nothing after an acknowledged DELETE ("a DELETE ... removes
    // the units from every live node"): the floor's own value, or a write sent after it.
    if (floor >= 0 && static_cast<int>(id.version) < floor) {
      return "a hit with v" + std::to_string(id.version) + ", older than v" +
             std::to_string(floor) + (h[static_cast<size_t>(floor)].put ? " (PUT)" : " (DELETE)") +
             " acknowledged before the GET was sent";
    }
    if (floor >= 0 && static_cast<int>(id.version) == floor && !h[id.version].put) {
      return "impossible";  // a DELETE has no value
    }
    // Nothing a tenant delete acknowledged before the GET was sent removed.
    if (const std::string why = WipedBefore(tenant, h[id.version], r.send); !why.empty()) {
      return "a hit with v" + std::to_string(id.version) + ", " + why;
    }
    return "";
  }

  // Returns the reason LOOKUP `l` (and the GET that followed it) breaks a rule, or "".
  std::string JudgeLookup(const LookupOp& l) const {
    const bool settled = l.final_read || Settled(l.send, l.ack);
    const bool recovering = Recovering(l.node, l.send, l.ack);
    if (!l.ok) {
      // "Failure model", as for a GET: outside a fault an error is a defect.
      return settled ? "LOOKUP error outside any fault: " + l.error : "";
    }
    if (l.hit_count > static_cast<size_t>(l.count)) return "a hit count past the chain";
    // A LOOKUP's hit count is the number of leading units of the chain held by this node or
    // by their owners under the current or previous view (Router: "the answer is the longest
    // prefix held anywhere"); a GET copy counts ("The next GET (or LOOKUP) of the unit is a
    // local hit"). So each unit counted must have been there at some moment of the call:
    // put before the reply, and not deleted by a DELETE acknowledged before the LOOKUP was
    // sent unless a PUT was sent after it ("a DELETE ... removes the units from every live
    // node"; Copies, rule 1: every path drops the copies). The exceptions are those of the
    // GET: a node's local clients before its first catch-up (Recovering) and writes during a
    // join (Floor). "LOOKUP and copies" allows a LOOKUP to count a copy without the lease
    // check, which is still a copy of a unit not deleted (rule 1 drops it on every path).
    // Likewise a unit a tenant delete acknowledged before the LOOKUP was sent surely removed
    // (WipedBefore) is not counted, and a TTL unit is counted only while its TTL can not have
    // run out: some PUT of the key sent before the reply, not older than the floor, neither
    // removed by a tenant delete nor expired, must be there to count.
    const int tenant = l.writer % 2;
    for (size_t i = 0; i < l.hit_count; ++i) {
      const int k = l.first_key + static_cast<int>(i);
      const auto& h = writers_[l.writer].history[k];
      if (!std::any_of(h.begin(), h.end(),
                       [&](const WriteOp& op) { return op.put && op.send < l.ack; })) {
        return "counted key " + std::to_string(k) + ", never put before the reply";
      }
      const int floor = recovering ? -1 : Floor(h, l.send);
      if (floor >= 0 && !h[static_cast<size_t>(floor)].put &&
          !LaterWrites(h, floor, l.ack, /*puts_only=*/true)) {
        return "counted key " + std::to_string(k) + ", deleted (v" + std::to_string(floor) +
               ") before the LOOKUP was sent";
      }
      std::string why;  // why the last version that could count does not
      bool held = false;
      for (size_t v = static_cast<size_t>(std::max(floor, 0)); v < h.size() && !held; ++v) {
        if (!h[v].put || h[v].send >= l.ack) continue;
        if (SurelyExpired(h[v], l.send_ms)) {
          why = "v" + std::to_string(v) + "'s TTL of " + std::to_string(h[v].ttl_ms) +
                " ms ran out before the LOOKUP was sent (at " + std::to_string(l.send_ms - t0_ms_) +
                " ms)";
        } else if (std::string wiped = recovering ? "" : WipedBefore(tenant, h[v], l.send);
                   !wiped.empty()) {
          why = "v" + std::to_string(v) + " " + wiped;
        } else {
          held = true;
        }
      }
      if (!held) return "counted key " + std::to_string(k) + ", but " + why;
    }
    if (!settled || recovering) return "";
    // Not lower than the acknowledged, undeleted prefix ("Guaranteed (tested)": "A unit put
    // through any node is found by LOOKUP ... through every node"; with one fault at a time
    // and R restored, "while the cluster is settled no acknowledged unit is missed"): the
    // leading keys whose last write acknowledged before the LOOKUP was sent is a PUT, with no
    // write sent after it before the reply.
    // Nor one a tenant delete may have removed, or whose TTL may have run out, before the reply.
    size_t present = 0;
    for (int k = l.first_key; k < l.first_key + l.count; ++k) {
      const auto& h = writers_[l.writer].history[k];
      const int floor = Floor(h, l.send);
      if (floor < 0 || !h[static_cast<size_t>(floor)].put || LaterWrites(h, floor, l.ack) ||
          TenantDeleteAfter(tenant, h[static_cast<size_t>(floor)], l.ack) ||
          MayHaveExpired(h[static_cast<size_t>(floor)], l.ack_ms)) {
        break;
      }
      ++present;
    }
    if (l.hit_count < present) {
      return "hit count " + std::to_string(l.hit_count) + ", below the " + std::to_string(present) +
             " leading keys acknowledged and not deleted";
    }
    // What the LOOKUP counted, the GET that followed serves, when no write of the key was in
    // flight from the LOOKUP to the GET's reply and the cluster stayed settled: each unit
    // counted was held by this node or an owner, the GET asks the same (Router: GET), no DRAM
    // eviction here, and "LOOKUP and copies" lets the GET miss a counted copy only when its
    // owners "no longer have it", which takes a write.
    if (l.get_ack == 0 || !(l.final_read || Settled(l.send, l.get_ack)) ||
        Recovering(l.node, l.send, l.get_ack)) {
      return "";
    }
    // Nor a tenant delete in between, nor a TTL that may run out before the GET's reply.
    if (TenantDeleteDuring(tenant, l.send, l.get_ack)) return "";
    for (size_t i = 0; i < l.hit_count && i < l.get.size(); ++i) {
      const int k = l.first_key + static_cast<int>(i);
      const auto& h = writers_[l.writer].history[k];
      if (WriteDuring(h, l.send, l.get_ack)) continue;
      const int floor = Floor(h, l.send);
      bool may_expire = false;
      for (size_t v = static_cast<size_t>(std::max(floor, 0)); v < h.size(); ++v) {
        may_expire = may_expire || (h[v].put && MayHaveExpired(h[v], l.get_ack_ms));
      }
      if (may_expire) continue;
      if (l.get[i] == ReadOp::kMiss) {
        return "counted key " + std::to_string(k) + ", which the GET that followed missed";
      }
    }
    return "";
  }

  const int64_t t0_ms_ = SteadyMs();  // the test's start, to show steady ms in messages
  std::atomic<bool> stop_{false};
  std::atomic<int> node_epoch_[kNodesMax] = {};  // bumped by every (re)start of a node
  std::atomic<int> live_nodes_{kNodes};          // clients use nodes [0, live_nodes_)
  std::atomic<bool> paused_[kNodesMax] = {};
  std::atomic<bool> settling_{false};  // the nemesis waits for the cluster to settle     //
                                       // SIGSTOPped: clients go elsewhere
  Writer writers_[kWriters];
  std::vector<TenantDeleteOp> tenant_deletes_;  // the tenant deleter's (read once it ended)
  std::vector<Window> recovering_, joins_, settled_;
  std::vector<Window> faults_;
  std::mutex events_mu_;
  std::ostringstream events_;
  double copy_stats_[4] = {};       // copies kept, GET hits on copies, dropped, fenced (all nodes)
  double suspicion_stats_[2] = {};  // peers suspected, calls failed at once (all nodes)
};

TEST_P(ClusterJudgeTest, RandomTrafficAndFaultsServeOnlyWhatTheDocsAllow) {
  const uint64_t seed = Seed();
  SCOPED_TRACE("KVTIER_JUDGE_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // The fourth node exists from the start (its object: the clients read its socket path),
  // and starts when the nemesis decides that it joins.
  nodes_.push_back(std::make_unique<kt::KvtierdProcess>(dir_ / "n3"));
  nodes_.back()->set_own_process_group(true);
  peer_ports_.push_back(kt::FreePort());
  std::vector<int> live = {0, 1, 2};
  settled_.push_back(Window{.from = 0});

  std::vector<std::vector<ReadOp>> reads(kWriters);
  std::vector<std::vector<LookupOp>> lookups(kWriters);
  std::vector<std::thread> clients;
  for (int w = 0; w < kWriters; ++w) {
    clients.emplace_back(
        [&, w] { ClientLoop(w, seed * 1000 + static_cast<uint64_t>(w), &reads[w], &lookups[w]); });
  }
  if (TenantDeletes()) clients.emplace_back([&] { TenantDeleterLoop(seed * 1000 + kWriters); });
  struct Joiner {
    std::atomic<bool>* stop;
    std::vector<std::thread>* threads;
    ~Joiner() {
      stop->store(true);
      for (auto& t : *threads) {
        if (t.joinable()) t.join();
      }
    }
  } joiner{&stop_, &clients};

  // The first five faults are every kind once, in an order of the seed; the rest are random.
  enum Fault { kJoin, kKillLate, kKillFast, kStopCont, kLeave };
  std::vector<Fault> faults = {kJoin, kKillLate, kKillFast, kStopCont, kLeave};
  std::shuffle(faults.begin(), faults.end(), rng);
  while (faults.size() < static_cast<size_t>(kFaults)) {
    faults.push_back(static_cast<Fault>(1 + rng() % 4));
  }
  auto settle = [&](const std::string& after) {
    settling_.store(true);
    struct Done {
      std::atomic<bool>* b;
      ~Done() { b->store(false); }
    } done{&settling_};
    ASSERT_TRUE(kt::WaitFor([&] { return ClusterSettled(live); }, kWaitMs))
        << "not settled after " << after << SettleState(live);
    settled_.push_back(Window{.from = Tick()});
    Event("settled after " + after);
  };
  auto others = [&](int t) {
    std::vector<int> o;
    for (int n : live) {
      if (n != t) o.push_back(n);
    }
    return o;
  };
  // The nemesis; a failed wait ends it, and what the clients saw until then is still judged.
  auto nemesis = [&] {
    for (const Fault fault : faults) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 800));
      settled_.back().to = Tick();
      if (fault == kJoin) {
        const int n = static_cast<int>(live.size());
        Window join{.from = Tick(), .what = "join n" + std::to_string(n)};
        Event("start n" + std::to_string(n) + " (join)");
        ASSERT_TRUE(StartNode(n)) << nodes_[n]->Log();
        live.push_back(n);
        live_nodes_.store(static_cast<int>(live.size()));
        ASSERT_TRUE(kt::WaitFor([&] { return MembersAre(live, live.size()); }, kWaitMs));
        join.to = Tick();
        joins_.push_back(join);
        ASSERT_NO_FATAL_FAILURE(settle("join"));
        continue;
      }
      const int t = live[rng() % live.size()];
      const std::string name = "n" + std::to_string(t);
      Window rec{.from = Tick(), .node = t};
      Window join{.node = t};
      if (fault == kKillLate || fault == kKillFast) {
        // kill -9; restart on the data directory after the lease ran out (0) or at once (1).
        CountNodeStats(t);
        Event("kill -9 " + name);
        nodes_[t]->Stop(SIGKILL);
        if (fault == kKillLate) {
          ASSERT_TRUE(kt::WaitFor([&] { return MembersAre(others(t), live.size() - 1); }, kWaitMs));
          Event(name + " left the view");
          ASSERT_TRUE(kt::WaitFor([&] { return ClusterSettled(others(t)); }, kWaitMs))
              << SettleState(others(t));
          Event("survivors settled");
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 500));
        }
        join.from = Tick();
        Event("restart " + name);
        ASSERT_TRUE(StartNode(t)) << nodes_[t]->Log();
        node_epoch_[t].fetch_add(1);
      } else if (fault == kStopCont) {
        // SIGSTOP past the lease, then SIGCONT.
        const double regs = Metric(Metrics(t), "kvtier_cluster_registrations_total");
        Event("SIGSTOP " + name);
        paused_[t].store(true);
        nodes_[t]->Signal(SIGSTOP);
        ASSERT_TRUE(kt::WaitFor([&] { return MembersAre(others(t), live.size() - 1); }, kWaitMs));
        Event(name + " left the view");
        // With copies, out of the views a second longer, with traffic through the others:
        // writes it is not told about (its copies then hold older values: "Copies", rule 4).
        std::this_thread::sleep_for(
            std::chrono::milliseconds((GetParam() ? 1000 : 0) + rng() % 1000));
        join.from = Tick();
        Event("SIGCONT " + name);
        nodes_[t]->Signal(SIGCONT);
        paused_[t].store(false);
        ASSERT_TRUE(kt::WaitFor(
            [&] { return Metric(Metrics(t), "kvtier_cluster_registrations_total") > regs; },
            kWaitMs));
      } else {
        // A graceful stop (the node leaves at once), then a start: a rejoin with its data.
        CountNodeStats(t);
        Event("SIGTERM " + name);
        ASSERT_EQ(nodes_[t]->Stop(SIGTERM), 0) << nodes_[t]->Log();
        ASSERT_TRUE(kt::WaitFor([&] { return MembersAre(others(t), live.size() - 1); }, kWaitMs));
        Event(name + " left the view");
        ASSERT_TRUE(kt::WaitFor([&] { return ClusterSettled(others(t)); }, kWaitMs))
            << SettleState(others(t));
        Event("survivors settled");
        join.from = Tick();
        Event("start " + name);
        ASSERT_TRUE(StartNode(t)) << nodes_[t]->Log();
        node_epoch_[t].fetch_add(1);
      }
      ASSERT_TRUE(kt::WaitFor(
          [&] {
            return Metric(Metrics(t), "kvtier_cluster_registrations_total") >= 1 &&
                   MembersAre(live, live.size());
          },
          kWaitMs));
      rec.to = join.to = Tick();
      Event(name + " registered, every node sees " + std::to_string(live.size()) + " members");
      // A node restarted within its lease applied what it missed before it accepted a client
      // (ClusterNode::Start's catch-up; while etcd answers): no window to allow. After the lease
      // or a graceful stop, deletes sent while it is out of the views reach it only with the
      // membership's catch-up before it registers.
      if (fault != kKillFast) recovering_.push_back(rec);
      joins_.push_back(join);
      ASSERT_NO_FATAL_FAILURE(settle(name));
    }
  };
  nemesis();
  stop_.store(true);
  for (auto& t : clients) t.join();
  // Closes the last settled window, unless a fault that the nemesis gave up on (a failed wait)
  // closed it: what the clients saw after that is not judged as settled.
  if (settled_.back().to == UINT64_MAX) settled_.back().to = Tick();

  // Every node up and settled; every key read through every node.
  auto final_settled = [&] {
    ASSERT_TRUE(kt::WaitFor([&] { return ClusterSettled(live); }, kWaitMs)) << "final settle";
  };
  if (!HasFatalFailure()) final_settled();
  std::vector<ReadOp> final_reads;
  std::vector<LookupOp> final_lookups;
  for (int n : live) {
    if (HasFatalFailure()) break;
    for (int w = 0; w < kWriters; ++w) {
      auto c = Client::Connect(
          ClientOptions{.socket_path = nodes_[n]->socket(), .token = kTokens[w % 2]});
      if (!c.ok()) {
        ADD_FAILURE() << "n" << n << ": " << c.status().ToString();
        continue;
      }
      // The whole chain (LOOKUP, then GET), then each key alone (LOOKUP only).
      LookupOp whole{.writer = w, .count = kKeysPerWriter, .node = n, .final_read = true};
      LookupThenGet(c->get(), &whole, &final_reads);
      if (!whole.ok) ADD_FAILURE() << "final LOOKUP via n" << n << ": " << whole.error;
      final_lookups.push_back(std::move(whole));
      for (int k = 0; k < kKeysPerWriter; ++k) {
        LookupOp one{.writer = w, .first_key = k, .count = 1, .node = n, .final_read = true};
        LookupThenGet(c->get(), &one, nullptr);
        if (!one.ok) ADD_FAILURE() << "final LOOKUP via n" << n << ": " << one.error;
        final_lookups.push_back(std::move(one));
      }
    }
    CountNodeStats(n);
  }
  for (int n : live) EXPECT_TRUE(nodes_[n]->Alive()) << "n" << n << " died";

  // The judge.
  int puts = 0, puts_acked = 0, deletes = 0, deletes_acked = 0, write_errors_settled = 0;
  for (int w = 0; w < kWriters; ++w) {
    for (int k = 0; k < kKeysPerWriter; ++k) {
      for (const WriteOp& op : writers_[w].history[k]) {
        (op.put ? puts : deletes)++;
        if (op.acked) (op.put ? puts_acked : deletes_acked)++;
        bool settled = false;
        for (const Window& s : settled_) settled = settled || s.Covers(op.send, op.ack);
        // "Failure model": with write_acks = 0 a PUT fails while an owner is down and still
        // listed; outside a fault every write is acknowledged.
        if (!op.acked && settled && ++write_errors_settled <= kViolationsShownMax) {
          ADD_FAILURE() << "writer " << w << " key " << k
                        << ": a write failed outside any fault: " << op.error << "\n"
                        << History(w, k, op.ack + 1);
        }
      }
    }
  }
  int tenant_deletes_acked = 0, ttl_puts = 0;
  for (const TenantDeleteOp& d : tenant_deletes_) {
    tenant_deletes_acked += d.acked;
    bool settled = false;
    for (const Window& s : settled_) settled = settled || s.Covers(d.send, d.ack);
    // "Failure model": a tenant delete is recorded for the members it did not reach; outside
    // a fault it reaches every one of them.
    if (!d.acked && settled && ++write_errors_settled <= kViolationsShownMax) {
      ADD_FAILURE() << "a tenant delete of tenant " << d.tenant << " via n" << d.node
                    << " failed outside any fault: " << d.error;
    }
  }
  for (const Writer& wr : writers_) {
    for (const auto& h : wr.history) {
      for (const WriteOp& op : h) ttl_puts += op.ttl_ms != 0;
    }
  }
  int hits = 0, misses = 0, errors = 0, violations = 0;
  std::vector<const ReadOp*> all;
  for (const auto& v : reads) {
    for (const auto& r : v) all.push_back(&r);
  }
  for (const auto& r : final_reads) all.push_back(&r);
  // What each node holds of a key now, at the end of the run (GET /v1/unit with its writer's
  // token): the holder of a unit served past its TTL, or of an older version, if it still
  // holds it. Once per key.
  std::set<std::pair<int, int>> described;
  auto holders_now = [&](int writer, int key) {
    if (!described.emplace(writer, key).second) return std::string();
    std::ostringstream out;
    out << "  held now (end of run):\n";
    const std::string auth = std::string("Authorization: Bearer ") + kTokens[writer % 2] + "\r\n";
    for (size_t n = 0; n < nodes_.size(); ++n) {
      if (!nodes_[n]->Alive()) {
        out << "    n" << n << ": not running\n";
        continue;
      }
      const std::string r = kt::HttpRequest(
          nodes_[n]->http_port(), "GET", "/v1/unit?key=" + ToHex(WriterKey(writer, key)), "", auth);
      const size_t at = r.find("\r\n\r\n");
      out << "    n" << n << ": " << (at == std::string::npos ? r : r.substr(at + 4)) << "\n";
    }
    return out.str();
  };
  for (const ReadOp* r : all) {
    hits += r->result == ReadOp::kHit;
    misses += r->result == ReadOp::kMiss;
    errors += r->result == ReadOp::kError;
    const std::string why = Judge(*r);
    if (why.empty()) continue;
    if (++violations > kViolationsShownMax) continue;
    ADD_FAILURE() << (r->final_read ? "final " : "") << "GET of writer " << r->writer << " key "
                  << r->key << " via n" << r->node << " ticks " << r->send << ".." << r->ack << " ("
                  << r->send_ms - t0_ms_ << ".." << r->ack_ms - t0_ms_ << " ms): " << why << "\n"
                  << History(r->writer, r->key, r->ack) << holders_now(r->writer, r->key);
  }
  int lookup_count = 0, lookup_units = 0, lookup_hits = 0, lookup_violations = 0;
  std::vector<const LookupOp*> all_lookups;
  for (const auto& v : lookups) {
    for (const auto& l : v) all_lookups.push_back(&l);
  }
  for (const auto& l : final_lookups) all_lookups.push_back(&l);
  for (const LookupOp* l : all_lookups) {
    ++lookup_count;
    lookup_units += l->count;
    lookup_hits += static_cast<int>(l->hit_count);
    const std::string why = JudgeLookup(*l);
    if (why.empty()) continue;
    if (++lookup_violations > kViolationsShownMax) continue;
    std::ostringstream histories;
    for (int k = l->first_key; k < l->first_key + l->count; ++k) {
      histories << "  key " << k << ":\n" << History(l->writer, k, std::max(l->ack, l->get_ack));
    }
    ADD_FAILURE() << (l->final_read ? "final " : "") << "LOOKUP of writer " << l->writer << " keys "
                  << l->first_key << ".." << l->first_key + l->count - 1 << " via n" << l->node
                  << " ticks " << l->send << ".." << l->ack << " (" << l->send_ms - t0_ms_ << ".."
                  << l->ack_ms - t0_ms_ << " ms; GET reply " << l->get_ack << "): hit count "
                  << l->hit_count << ": " << why << "\n"
                  << histories.str();
  }
  std::printf(
      "judge seed %lu copies %s: %d PUTs (%d acked, %d with a TTL), %d DELETEs (%d acked), %zu "
      "tenant deletes (%d acked), %zu GETs of a key: %d hits, %d misses, %d errors; %d LOOKUPs "
      "of %d keys counted %d; copies kept %.0f, hit %.0f, dropped %.0f, fenced %.0f; peers "
      "suspected %.0f, calls failed at once %.0f; %d GET and %d LOOKUP violations\n",
      static_cast<unsigned long>(seed), GetParam() ? "on" : "off", puts, puts_acked, ttl_puts,
      deletes, deletes_acked, tenant_deletes_.size(), tenant_deletes_acked, all.size(), hits,
      misses, errors, lookup_count, lookup_units, lookup_hits, copy_stats_[0], copy_stats_[1],
      copy_stats_[2], copy_stats_[3], suspicion_stats_[0], suspicion_stats_[1], violations,
      lookup_violations);
  if (HasFailure()) {
    std::lock_guard lock(events_mu_);
    std::fprintf(stderr, "nemesis (KVTIER_JUDGE_SEED=%lu):\n%s", static_cast<unsigned long>(seed),
                 events_.str().c_str());
  }
  EXPECT_EQ(violations, 0);
  EXPECT_EQ(lookup_violations, 0);
  EXPECT_EQ(write_errors_settled, 0);
  if (GetParam() && !HasFatalFailure()) {
    // The run exercised copies: kept, served, and dropped (for room, by TTL or a write).
    EXPECT_GT(copy_stats_[0], 0) << "no copy kept";
    EXPECT_GT(copy_stats_[1], 0) << "no GET served from a copy";
    EXPECT_GT(copy_stats_[2], 0) << "no copy dropped";
  }
}

INSTANTIATE_TEST_SUITE_P(Copies, ClusterJudgeTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? std::string("GetCopies") : std::string("NoCopies");
                         });

}  // namespace
}  // namespace kvtier::cluster
