// Crash driver for the real kvtierd binary: writer threads on the native protocol (Unix socket
// with shared memory, and TCP) and on RESP (SET/MSET/DEL/GET/MGET/FLUSHDB) overwrite, delete
// and re-put their keys while the daemon is killed with SIGKILL at random moments and
// restarted on the same data directory; after every restart every key is read back and judged
// by the durability rule of the configured [storage] durability (tests/crash/crash_model.h).
// Values are self-describing (tests/crash/crash_value.h), so a torn, foreign or never-written
// value is always caught. A run ends with a graceful restart (SIGTERM flushes everything: no
// loss allowed in any mode).
//
// The seed is printed; the environment changes the run (tests/crash/README.md):
//   KVTIER_CRASH_SEED, KVTIER_CRASH_KILLS (kills per mode), KVTIER_CRASH_FRONTS
//   ("unix,tcp,resp"), KVTIER_CRASH_THREADS (writers per front), KVTIER_CRASH_LOAD_MS
//   ("min-max" writing time before each kill), KVTIER_CRASH_MARGIN_MS (batched: scheduling
//   margin added to group_commit_ms).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <thread>

#include "cache_daemon/client.h"
#include "common/key_spec.h"
#include "tests/crash/crash_model.h"
#include "tests/crash/crash_value.h"
#include "tests/crash/resp_client.h"
#include "tests/e2e/kvtierd_process.h"

namespace kvtier::crash {
namespace {

namespace kt = kvtier::testing;
using daemon::Client;
using daemon::ClientOptions;
namespace wire = daemon::wire;

enum class Front : uint8_t { kUnix = 1, kTcp = 2, kResp = 3 };

const char* FrontName(Front f) {
  switch (f) {
    case Front::kUnix:
      return "native-unix";
    case Front::kTcp:
      return "native-tcp";
    case Front::kResp:
      return "resp";
  }
  return "?";
}

constexpr char kNativeToken[] = "crash-native-token";
constexpr char kRespToken[] = "crash-resp-token";
// Largest value body of a native unit / a RESP value (bytes).
constexpr uint32_t kNativeBodyBytesMax = 24 << 10;
constexpr uint32_t kRespBodyBytesMax = 8 << 10;
constexpr int kClientTimeoutMs = 20000;
constexpr size_t kVerifyBatchKeys = 128;

struct DriverOptions {
  Mode mode = Mode::kSync;
  uint64_t seed = 0;
  int kills = 4;
  std::vector<Front> fronts = {Front::kUnix, Front::kTcp, Front::kResp};
  int threads_per_front = 2;
  int keys_per_thread = 40;
  int load_ms_min = 700;
  int load_ms_max = 1500;
  uint64_t group_commit_ms = 10;
  // batched: an acknowledgement older than group_commit_ms + margin_ms at the kill must
  // survive. The margin covers the commit itself (buffer write, fdatasync, index write) and
  // scheduling on a loaded machine.
  uint64_t margin_ms = 500;
  // Percentage of load phases in which RESP thread 0 sends one FLUSHDB, at a random moment
  // (by time, not by operation count: the RESP rate differs 30-fold between modes).
  int flushdb_load_pct = 40;
  // One in this many native keys is put at highest_tier = dram (the others at ssd). The
  // durability mode covers them too: under batched and sync a memory-tier put is written
  // through to SSD (storage/tier_manager.h).
  int dram_tier_one_in = 4;
  int printed_violations_max = 40;
};

uint64_t EnvU64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

DriverOptions OptionsFromEnv(Mode mode) {
  DriverOptions o;
  o.mode = mode;
  o.seed = EnvU64("KVTIER_CRASH_SEED", std::random_device{}());
  o.kills = static_cast<int>(EnvU64("KVTIER_CRASH_KILLS", o.kills));
  o.threads_per_front = static_cast<int>(EnvU64("KVTIER_CRASH_THREADS", o.threads_per_front));
  o.margin_ms = EnvU64("KVTIER_CRASH_MARGIN_MS", o.margin_ms);
  if (const char* f = std::getenv("KVTIER_CRASH_FRONTS"); f != nullptr && *f != '\0') {
    o.fronts.clear();
    std::string s = f;
    if (s.find("unix") != std::string::npos) o.fronts.push_back(Front::kUnix);
    if (s.find("tcp") != std::string::npos) o.fronts.push_back(Front::kTcp);
    if (s.find("resp") != std::string::npos) o.fronts.push_back(Front::kResp);
  }
  if (const char* l = std::getenv("KVTIER_CRASH_LOAD_MS"); l != nullptr && *l != '\0') {
    int lo = 0, hi = 0;
    if (std::sscanf(l, "%d-%d", &lo, &hi) == 2 && lo > 0 && hi >= lo) {
      o.load_ms_min = lo;
      o.load_ms_max = hi;
    }
  }
  return o;
}

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct KeyInfo {
  Front front;
  uint32_t id = 0;         // unique over the run; written into every value
  int thread = 0;          // the writer thread (of its front) that owns the key
  bool dram_tier = false;  // a native unit put at highest_tier = dram
  wire::Key native_key{};
  std::string resp_key;
  KeyHistory h;
  bool poisoned = false;  // a wrong value was read back: excluded from the rest of the run
};

struct Summary {
  int kills = 0;
  uint64_t acked_writes = 0;  // acknowledged puts and deletes, per key (FLUSHDB: not counted)
  std::map<std::string, uint64_t> acked_by_front;
  uint64_t flushdbs = 0;      // acknowledged FLUSHDB commands
  uint64_t verified = 0;      // keys read back exactly (or an in-flight write applied)
  uint64_t lost_allowed = 0;  // keys read back at an older state the mode allows
  uint64_t live_reads = 0;
  uint64_t violations = 0;
  uint64_t errors = 0;                      // error replies (not connection failures)
  std::map<std::string, uint64_t> by_kind;  // "<front>/<verdict>" -> count
};

class CrashDriver {
 public:
  CrashDriver(DriverOptions o, std::filesystem::path dir) : o_(std::move(o)), dir_(std::move(dir)) {
    std::filesystem::remove_all(dir_);
    d_ = std::make_unique<kt::KvtierdProcess>(dir_);
    native_port_ = kt::FreePort();
    std::mt19937_64 rng(o_.seed);
    uint32_t id = 0;
    for (Front f : o_.fronts) {
      for (int t = 0; t < o_.threads_per_front; ++t) {
        for (int k = 0; k < o_.keys_per_thread; ++k) {
          auto key = std::make_unique<KeyInfo>();
          key->front = f;
          key->id = ++id;
          key->thread = t;
          key->dram_tier = f != Front::kResp && o_.dram_tier_one_in > 0 &&
                           rng() % static_cast<uint64_t>(o_.dram_tier_one_in) == 0;
          uint64_t s = o_.seed ^ (uint64_t{id} << 20);
          for (size_t i = 0; i < 32; i += 8) {
            uint64_t r = SplitMix64(&s);
            std::memcpy(key->native_key.data() + i, &r, 8);
          }
          key->resp_key = "crash:" + std::to_string(id);
          key->h.Reset(KeyState{}, NowUs());
          keys_.push_back(std::move(key));
        }
      }
    }
  }

  Summary Run() {
    std::printf(
        "crash run: mode=%s seed=%llu kills=%d fronts=%s threads/front=%d margin_ms=%llu "
        "dir=%s\n",
        ModeName(o_.mode), static_cast<unsigned long long>(o_.seed), o_.kills, FrontsText().c_str(),
        o_.threads_per_front, static_cast<unsigned long long>(o_.margin_ms), dir_.c_str());
    std::mt19937_64 rng(o_.seed * 0x9e3779b97f4a7c15ull + 1);
    rng_ = &rng;
    if (!Start("initial start")) return s_;
    for (int kill = 1; kill <= o_.kills; ++kill) {
      int load_ms =
          o_.load_ms_min +
          static_cast<int>(rng() % static_cast<uint64_t>(o_.load_ms_max - o_.load_ms_min + 1));
      uint64_t load_dram_bytes = dram_bytes_;
      Summary before = s_;  // the kill's line counts its load phase's live violations too
      int64_t kill_us = Load(load_ms, rng(), /*graceful=*/false);
      ++s_.kills;
      if (!Start("restart after kill " + std::to_string(kill))) return s_;
      CheckContext c;
      c.mode = o_.mode;
      c.kill_us = kill_us;
      c.window_us = static_cast<int64_t>((o_.group_commit_ms + o_.margin_ms) * 1000);
      Verify("kill " + std::to_string(kill) + " (dram " + std::to_string(load_dram_bytes >> 10) +
                 " KiB)",
             c);
      PrintKill(kill, load_ms, load_dram_bytes, before);
    }
    // A graceful restart flushes everything acknowledged, memory-tier units included.
    int64_t stop_us = Load(o_.load_ms_min, rng(), /*graceful=*/true);
    if (!Start("restart after SIGTERM")) return s_;
    CheckContext c;
    c.mode = Mode::kSync;
    c.kill_us = stop_us;
    Verify("graceful", c);
    int rc = d_->Stop(SIGTERM);
    if (rc != 0) AddViolation("final SIGTERM: kvtierd exited with " + std::to_string(rc));
    std::printf(
        "crash-summary mode=%s fronts=%s seed=%llu kills=%d acked_writes=%llu (%s) flushdb=%llu "
        "verified=%llu lost_allowed=%llu live_reads=%llu errors=%llu violations=%llu%s\n",
        ModeName(o_.mode), FrontsText().c_str(), static_cast<unsigned long long>(o_.seed), s_.kills,
        static_cast<unsigned long long>(s_.acked_writes), AckedText().c_str(),
        static_cast<unsigned long long>(s_.flushdbs), static_cast<unsigned long long>(s_.verified),
        static_cast<unsigned long long>(s_.lost_allowed),
        static_cast<unsigned long long>(s_.live_reads), static_cast<unsigned long long>(s_.errors),
        static_cast<unsigned long long>(s_.violations), KindsText().c_str());
    std::fflush(stdout);
    return s_;
  }

  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::string FrontsText() const {
    std::string s;
    for (Front f : o_.fronts) s += std::string(s.empty() ? "" : ",") + FrontName(f);
    return s;
  }
  // One line per kill: what this kill's verification found.
  void PrintKill(int kill, int load_ms, uint64_t dram_bytes, const Summary& before) {
    std::string kinds;
    for (const auto& [k, n] : s_.by_kind) {
      auto it = before.by_kind.find(k);
      uint64_t d = n - (it == before.by_kind.end() ? 0 : it->second);
      if (d > 0) kinds += " " + k + "=" + std::to_string(d);
    }
    std::printf(
        "kill %d: mode=%s load_ms=%d dram_kib=%llu verified=%llu lost_allowed=%llu "
        "violations=%llu%s\n",
        kill, ModeName(o_.mode), load_ms, static_cast<unsigned long long>(dram_bytes >> 10),
        static_cast<unsigned long long>(s_.verified - before.verified),
        static_cast<unsigned long long>(s_.lost_allowed - before.lost_allowed),
        static_cast<unsigned long long>(s_.violations - before.violations), kinds.c_str());
    std::fflush(stdout);
  }

  std::string AckedText() const {
    std::string s;
    for (const auto& [f, n] : s_.acked_by_front)
      s += std::string(s.empty() ? "" : " ") + f + "=" + std::to_string(n);
    return s;
  }
  std::string KindsText() const {
    std::string s;
    for (const auto& [k, n] : s_.by_kind) s += " " + k + "=" + std::to_string(n);
    return s.empty() ? "" : " (" + s.substr(1) + ")";
  }

  // DRAM sizes a start picks from. The DRAM tier hands whole 4 MiB slab pages (at most the
  // capacity) to one size class each, so 256 KiB and 4 MiB hold only one or two size classes
  // and demote almost every value to SSD at once; 256 MiB holds every RESP value and
  // DRAM-tier unit (nothing demoted; the arena is mapped lazily).
  static constexpr uint64_t kDramBytesChoices[] = {256u << 10, 4u << 20, 256u << 20};

  void WriteConfig(uint64_t dram_bytes) {
    auto hash = [](std::string_view t) {
      return ToHex(
          Sha256(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(t.data()), t.size())));
    };
    std::ofstream(dir_ / "tokens.toml")
        << "[[tenant]]\nname = \"native\"\nid = 1\ntoken_sha256 = [\"" << hash(kNativeToken)
        << "\"]\n[[tenant]]\nname = \"resp\"\nid = 2\ntoken_sha256 = [\"" << hash(kRespToken)
        << "\"]\n";
    // A small DRAM so that RESP values and DRAM-tier units are demoted to SSD under the load
    // (or not, at 256 MiB); an SSD large enough that nothing live is ever evicted (a few MB).
    d_->WriteConfig("[auth]\ntokens_file = \"" + (dir_ / "tokens.toml").string() +
                    "\"\n[storage]\ndram_capacity_bytes = " + std::to_string(dram_bytes) +
                    "\n"
                    "ssd_capacity_bytes = 134217728\nssd_segment_bytes = 4194304\n"
                    "durability = \"" +
                    ModeName(o_.mode) + "\"\ngroup_commit_ms = " +
                    std::to_string(o_.group_commit_ms) + "\n[limits]\nframe_timeout_ms = 5000\n");
  }

  bool Start(const std::string& what) {
    dram_bytes_ = kDramBytesChoices[(*rng_)() % std::size(kDramBytesChoices)];
    WriteConfig(dram_bytes_);
    std::vector<std::string> extra;
    if (HasFront(Front::kTcp)) extra = {"--native-port", std::to_string(native_port_)};
    if (d_->Start(extra)) return true;
    AddViolation(what + ": kvtierd did not start; log " + (dir_ / "kvtierd.log").string() + ":\n" +
                 Tail(d_->Log(), 3000));
    return false;
  }

  bool HasFront(Front f) const {
    return std::find(o_.fronts.begin(), o_.fronts.end(), f) != o_.fronts.end();
  }

  static std::string Tail(const std::string& s, size_t n) {
    return s.size() > n ? s.substr(s.size() - n) : s;
  }

  void AddViolation(const std::string& text) {
    std::lock_guard lock(mu_);
    ++s_.violations;
    if (s_.violations <= static_cast<uint64_t>(o_.printed_violations_max)) {
      std::printf("VIOLATION mode=%s %s\n", ModeName(o_.mode), text.c_str());
      std::fflush(stdout);
    } else if (s_.violations == static_cast<uint64_t>(o_.printed_violations_max) + 1) {
      std::printf("(further violations are counted, not printed)\n");
    }
  }

  // Judges one read-back of key k; returns false on a violation.
  bool Judge(KeyInfo& k, const std::string& phase, const Observation& got, const CheckContext& c) {
    CheckResult r = Check(k.h, got, c);
    if (r.verdict == Verdict::kExact || r.verdict == Verdict::kInFlight) {
      if (phase != "live") {
        std::lock_guard lock(mu_);
        ++s_.verified;
      }
      return true;
    }
    if (r.verdict == Verdict::kLostAllowed) {
      std::lock_guard lock(mu_);
      ++s_.lost_allowed;
      return true;
    }
    {
      std::lock_guard lock(mu_);
      ++s_.by_kind[std::string(FrontName(k.front)) + "/" + VerdictName(r.verdict)];
    }
    AddViolation("phase=" + phase + " front=" + FrontName(k.front) +
                 " key=" + (k.front == Front::kResp ? k.resp_key : "unit#" + std::to_string(k.id)) +
                 " thread=" + std::to_string(k.thread) + (k.dram_tier ? " tier=dram" : "") +
                 " check=" + VerdictName(r.verdict) + ": " + r.detail);
    return false;
  }

  Observation Observe(const KeyInfo& k, const uint8_t* p, size_t n) {
    Observation o;
    DecodedValue d = DecodeValue(p, n);
    if (!d.ok) {
      o.wrong = true;
      o.wrong_why = "undecodable value of " + std::to_string(n) + " bytes: " + d.error;
    } else if (d.front != static_cast<uint8_t>(k.front) || d.key_id != k.id) {
      o.wrong = true;
      o.wrong_why = "a value of another key (front " + std::to_string(d.front) + " key " +
                    std::to_string(d.key_id) + " v" + std::to_string(d.version) + ")";
    } else {
      o.state = KeyState{true, d.version};
    }
    return o;
  }

  // Runs the writers for load_ms, then kills kvtierd (SIGKILL, or SIGTERM when graceful)
  // and returns the time the signal was sent.
  int64_t Load(int load_ms, uint64_t seed, bool graceful) {
    stop_ = false;
    early_failures_ = 0;
    kill_us_ = INT64_MAX;
    std::vector<std::thread> threads;
    uint64_t n = 0;
    std::mt19937_64 rng(seed);
    load_start_us_ = NowUs();
    load_ms_ = load_ms;
    flush_at_us_ =
        static_cast<int>(rng() % 100) < o_.flushdb_load_pct
            ? NowUs() + static_cast<int64_t>(rng() % static_cast<uint64_t>(load_ms)) * 1000
            : INT64_MAX;
    for (Front f : o_.fronts) {
      for (int t = 0; t < o_.threads_per_front; ++t) {
        uint64_t ts = seed + 0x1000193ull * ++n;
        threads.emplace_back([this, f, t, ts] {
          if (f == Front::kResp)
            RespWriter(t, ts);
          else
            NativeWriter(f, t, ts);
        });
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(load_ms));
    int probe = kt::ConnectUnix(d_->socket());
    if (probe < 0) {
      AddViolation("kvtierd stopped accepting before the kill; log tail:\n" +
                   Tail(d_->Log(), 3000));
    } else {
      ::close(probe);
    }
    int64_t kill_us = NowUs();
    kill_us_ = kill_us;
    int rc = d_->Stop(graceful ? SIGTERM : SIGKILL, 30000);
    // The process is reaped: nothing sent from now on can have reached it.
    int64_t dead_us = NowUs();
    stop_ = true;
    for (auto& th : threads) th.join();
    if (graceful && rc != 0) AddViolation("SIGTERM: kvtierd exited with " + std::to_string(rc));
    if (early_failures_ > 0) {
      AddViolation(std::to_string(early_failures_.load()) +
                   " writer connection(s) failed before the kill; log tail:\n" +
                   Tail(d_->Log(), 3000));
    }
    for (auto& k : keys_) k->h.DropPendingSentAfter(dead_us);
    return kill_us;
  }

  // A connection failure: expected once the kill was sent, a violation before it.
  void ConnectionFailed(const Status& st, const char* front) {
    if (NowUs() < kill_us_.load()) {
      ++early_failures_;
      std::printf("writer (%s) failed before the kill: %s\n", front, st.ToString().c_str());
    }
  }

  std::vector<KeyInfo*> Owned(Front f, int thread) {
    std::vector<KeyInfo*> v;
    for (auto& k : keys_) {
      if (k->front == f && k->thread == thread) v.push_back(k.get());
    }
    return v;
  }

  // Up to n distinct usable keys out of owned (shuffled per load phase). The working set
  // narrows over the phase: at time t of a load of L ms only the first N * (1 - t / L) keys
  // (at least one) are touched, so that most keys are quiet for a while before the kill and
  // their last acknowledged state must survive in batched mode too.
  std::vector<KeyInfo*> Pick(const std::vector<KeyInfo*>& owned, size_t n,
                             std::mt19937_64* rng) const {
    double elapsed = static_cast<double>(NowUs() - load_start_us_) / (load_ms_ * 1000.0);
    double want = static_cast<double>(owned.size()) * (1.0 - elapsed);
    size_t active = want < 1.0 ? 1 : std::min(owned.size(), static_cast<size_t>(want));
    std::vector<KeyInfo*> out;
    for (size_t tries = 0; out.size() < n && tries < 4 * n; ++tries) {
      KeyInfo* k = owned[(*rng)() % active];
      if (!k->poisoned && std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
    }
    return out;
  }

  void Acked(KeyInfo* k, size_t op, int64_t at) {
    k->h.Ack(op, at);
    std::lock_guard lock(mu_);
    ++s_.acked_writes;
    ++s_.acked_by_front[FrontName(k->front)];
  }
  void Failed(KeyInfo* k, size_t op, const std::string& why) {
    k->h.Fail(op);
    std::lock_guard lock(mu_);
    if (++s_.errors <= 5) std::printf("error reply (%s): %s\n", FrontName(k->front), why.c_str());
  }

  void LiveCheck(KeyInfo* k, const Observation& got) {
    CheckContext c;
    c.mode = Mode::kSync;
    c.kill_us = NowUs();
    c.moment = "the read";
    {
      std::lock_guard lock(mu_);
      ++s_.live_reads;
    }
    Judge(*k, "live", got, c);
  }

  StatusOr<std::unique_ptr<Client>> ConnectNative(Front f) {
    ClientOptions co;
    co.token = kNativeToken;
    co.timeout_ms = kClientTimeoutMs;
    if (f == Front::kTcp) {
      co.tcp_port = native_port_;
    } else {
      co.socket_path = d_->socket();
      co.shm_bytes = 8u << 20;
    }
    return Client::Connect(co);
  }

  void NativeWriter(Front f, int thread, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<KeyInfo*> owned = Owned(f, thread);
    std::shuffle(owned.begin(), owned.end(), rng);
    auto conn = ConnectNative(f);
    for (int i = 0; !conn.ok() && i < 100 && !stop_; ++i) {  // the TCP port may bind later
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      conn = ConnectNative(f);
    }
    if (!conn.ok()) return ConnectionFailed(conn.status(), FrontName(f));
    Client* c = conn->get();
    if (f == Front::kUnix && !c->shm_attached()) {
      AddViolation("native-unix: shared memory was not attached");
    }
    while (!stop_) {
      int r = static_cast<int>(rng() % 100);
      if (r < 55) {  // PUT of 1..3 units
        std::vector<KeyInfo*> ks = Pick(owned, 1 + rng() % 3, &rng);
        if (ks.empty()) continue;
        // One batch has one highest_tier: DRAM-tier and SSD-tier units go separately.
        std::erase_if(ks, [&](KeyInfo* k) { return k->dram_tier != ks[0]->dram_tier; });
        std::vector<std::vector<uint8_t>> values;
        std::vector<daemon::PutUnit> units;
        std::vector<size_t> ops;
        int64_t send = NowUs();
        for (KeyInfo* k : ks) {
          uint64_t v = k->h.NextVersion();
          values.push_back(MakeValue(static_cast<uint8_t>(f), k->id, v,
                                     256 + static_cast<uint32_t>(rng() % kNativeBodyBytesMax)));
          ops.push_back(k->h.Begin(KeyState{true, v}, "put", send));
        }
        for (size_t i = 0; i < ks.size(); ++i) units.push_back({ks[i]->native_key, {}, values[i]});
        daemon::PutOptions po;
        po.kind = rng() % 2 ? 0 : 2;  // global KV (never compressed) or blob
        po.highest_tier = ks[0]->dram_tier ? 1 : 2;
        auto res = c->Put(units, po);
        int64_t ack = NowUs();
        if (!res.ok()) {
          if (res.status().code() == StatusCode::kIOError)
            return ConnectionFailed(res.status(), FrontName(f));
          for (size_t i = 0; i < ks.size(); ++i) Failed(ks[i], ops[i], res.status().ToString());
          continue;
        }
        for (size_t i = 0; i < ks.size(); ++i) {
          if ((*res)[i].ok())
            Acked(ks[i], ops[i], ack);
          else
            Failed(ks[i], ops[i], (*res)[i].ToString());
        }
      } else if (r < 70) {  // DELETE of 1..2 units
        std::vector<KeyInfo*> ks = Pick(owned, 1 + rng() % 2, &rng);
        if (ks.empty()) continue;
        std::vector<wire::Key> wk;
        std::vector<size_t> ops;
        int64_t send = NowUs();
        for (KeyInfo* k : ks) {
          wk.push_back(k->native_key);
          ops.push_back(k->h.Begin(KeyState{}, "del", send));
        }
        auto res = c->Delete(wk);
        int64_t ack = NowUs();
        if (!res.ok()) {
          if (res.status().code() == StatusCode::kIOError)
            return ConnectionFailed(res.status(), FrontName(f));
          for (size_t i = 0; i < ks.size(); ++i) Failed(ks[i], ops[i], res.status().ToString());
          continue;
        }
        for (size_t i = 0; i < ks.size(); ++i) Acked(ks[i], ops[i], ack);
      } else {  // GET of 1..4 units: read-your-writes while the daemon runs
        std::vector<KeyInfo*> ks = Pick(owned, 1 + rng() % 4, &rng);
        if (ks.empty()) continue;
        std::vector<wire::Key> wk;
        for (KeyInfo* k : ks) wk.push_back(k->native_key);
        std::vector<Observation> got(ks.size());
        std::vector<bool> answered(ks.size(), false);
        Status st = c->Get(wk, [&](size_t i, const daemon::GetItem& g) {
          if (g.status.ok()) {
            got[i] = Observe(*ks[i], g.value.data(), g.value.size());
            answered[i] = true;
          } else if (g.status.IsNotFound()) {
            answered[i] = true;
          }
        });
        if (!st.ok()) {
          if (st.code() == StatusCode::kIOError) return ConnectionFailed(st, FrontName(f));
          continue;
        }
        for (size_t i = 0; i < ks.size(); ++i) {
          if (answered[i]) LiveCheck(ks[i], got[i]);
        }
      }
    }
  }

  StatusOr<std::unique_ptr<RespClient>> ConnectResp() {
    auto rc = RespClient::Connect(d_->resp_port(), kClientTimeoutMs);
    for (int i = 0; !rc.ok() && i < 100 && !stop_; ++i) {  // the port may bind after the socket
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      rc = RespClient::Connect(d_->resp_port(), kClientTimeoutMs);
    }
    if (!rc.ok()) return rc.status();
    auto auth = (*rc)->Call({"AUTH", kRespToken});
    if (!auth.ok()) return auth.status();
    if (auth->type != RespReply::Type::kSimple) return Status::PermissionDenied(auth->str);
    return rc;
  }

  void RespWriter(int thread, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<KeyInfo*> owned = Owned(Front::kResp, thread);
    std::shuffle(owned.begin(), owned.end(), rng);
    auto conn = ConnectResp();
    if (!conn.ok()) return ConnectionFailed(conn.status(), "resp");
    RespClient* c = conn->get();
    auto value = [&](KeyInfo* k, uint64_t v) {
      std::vector<uint8_t> b = MakeValue(static_cast<uint8_t>(Front::kResp), k->id, v,
                                         static_cast<uint32_t>(rng() % kRespBodyBytesMax));
      return std::string(b.begin(), b.end());
    };
    bool flushed = false;
    while (!stop_) {
      if (thread == 0 && !flushed && NowUs() >= flush_at_us_) {
        flushed = true;
        // FLUSHDB runs alone on the RESP front, so its order against every key is known.
        std::unique_lock gate(resp_gate_);
        std::vector<std::pair<KeyInfo*, size_t>> ops;
        int64_t send = NowUs();
        for (auto& k : keys_) {
          if (k->front == Front::kResp && !k->poisoned)
            ops.emplace_back(k.get(), k->h.Begin(KeyState{}, "flushdb", send));
        }
        auto rep = c->Call({"FLUSHDB"});
        int64_t ack = NowUs();
        if (!rep.ok()) return ConnectionFailed(rep.status(), "resp");
        for (auto& [k, op] : ops) {
          if (rep->type == RespReply::Type::kSimple)
            k->h.Ack(op, ack);
          else
            Failed(k, op, rep->str);
        }
        if (rep->type == RespReply::Type::kSimple) {
          std::lock_guard lock(mu_);
          ++s_.flushdbs;
        }
        continue;
      }
      std::shared_lock gate(resp_gate_);
      int r = static_cast<int>(rng() % 100);
      if (r < 55) {  // SET, or MSET of 2..3 keys
        std::vector<KeyInfo*> ks = Pick(owned, r < 45 ? 1 : 2 + rng() % 2, &rng);
        if (ks.empty()) continue;
        const char* what = ks.size() == 1 ? "set" : "mset";
        std::vector<uint64_t> versions;
        std::vector<std::string> vals;
        for (KeyInfo* k : ks) {
          versions.push_back(k->h.NextVersion());
          vals.push_back(value(k, versions.back()));
        }
        std::vector<std::string_view> args = {ks.size() == 1 ? "SET" : "MSET"};
        std::vector<size_t> ops;
        int64_t send = NowUs();
        for (size_t i = 0; i < ks.size(); ++i) {
          ops.push_back(ks[i]->h.Begin(KeyState{true, versions[i]}, what, send));
          args.push_back(ks[i]->resp_key);
          args.push_back(vals[i]);
        }
        auto rep = c->Call(args);
        int64_t ack = NowUs();
        if (!rep.ok()) return ConnectionFailed(rep.status(), "resp");
        for (size_t i = 0; i < ks.size(); ++i) {
          if (rep->type == RespReply::Type::kSimple)
            Acked(ks[i], ops[i], ack);
          else
            Failed(ks[i], ops[i], rep->str);
        }
      } else if (r < 70) {  // DEL of 1..2 keys
        std::vector<KeyInfo*> ks = Pick(owned, 1 + rng() % 2, &rng);
        if (ks.empty()) continue;
        std::vector<std::string_view> args = {"DEL"};
        std::vector<size_t> ops;
        int64_t send = NowUs();
        for (KeyInfo* k : ks) {
          ops.push_back(k->h.Begin(KeyState{}, "del", send));
          args.push_back(k->resp_key);
        }
        auto rep = c->Call(args);
        int64_t ack = NowUs();
        if (!rep.ok()) return ConnectionFailed(rep.status(), "resp");
        for (size_t i = 0; i < ks.size(); ++i) {
          if (rep->type == RespReply::Type::kInteger)
            Acked(ks[i], ops[i], ack);
          else
            Failed(ks[i], ops[i], rep->str);
        }
      } else {  // MGET of 1..3 keys: read-your-writes while the daemon runs
        std::vector<KeyInfo*> ks = Pick(owned, 1 + rng() % 3, &rng);
        if (ks.empty()) continue;
        std::vector<std::string_view> args = {"MGET"};
        for (KeyInfo* k : ks) args.push_back(k->resp_key);
        auto rep = c->Call(args);
        if (!rep.ok()) return ConnectionFailed(rep.status(), "resp");
        if (rep->type != RespReply::Type::kArray || rep->elems.size() != ks.size()) {
          AddViolation("resp: MGET answered something else than " + std::to_string(ks.size()) +
                       " values: " + rep->str);
          continue;
        }
        for (size_t i = 0; i < ks.size(); ++i) {
          const RespReply& e = rep->elems[i];
          Observation got;
          if (e.type == RespReply::Type::kBulk) {
            got = Observe(*ks[i], reinterpret_cast<const uint8_t*>(e.str.data()), e.str.size());
          }
          LiveCheck(ks[i], got);
        }
      }
    }
  }

  // Reads every key back after a restart and judges it; the state read becomes the key's new
  // starting point.
  void Verify(const std::string& phase, const CheckContext& base) {
    auto nc = ConnectNative(Front::kUnix);
    for (int i = 0; !nc.ok() && i < 100; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      nc = ConnectNative(Front::kUnix);
    }
    std::unique_ptr<RespClient> rc;
    if (HasFront(Front::kResp)) {
      auto r = ConnectResp();
      if (!r.ok()) {
        AddViolation(phase + ": RESP connect after restart failed: " + r.status().ToString());
        return;
      }
      rc = std::move(r).value();
    }
    if (!nc.ok()) {
      AddViolation(phase + ": native connect after restart failed: " + nc.status().ToString());
      return;
    }
    std::vector<KeyInfo*> native, resp;
    for (auto& k : keys_) {
      if (k->poisoned) continue;
      (k->front == Front::kResp ? resp : native).push_back(k.get());
    }
    auto judge = [&](KeyInfo* k, const Observation& got, int64_t at) {
      Judge(*k, phase, got, base);
      if (got.wrong) {
        k->poisoned = true;
      } else {
        k->h.Reset(got.state, at);
      }
    };
    for (size_t b = 0; b < native.size(); b += kVerifyBatchKeys) {
      size_t n = std::min(kVerifyBatchKeys, native.size() - b);
      std::vector<wire::Key> wk;
      for (size_t i = 0; i < n; ++i) wk.push_back(native[b + i]->native_key);
      std::vector<Observation> got(n);
      std::vector<bool> answered(n, false);
      Status st = (*nc)->Get(wk, [&](size_t i, const daemon::GetItem& g) {
        if (g.status.ok()) got[i] = Observe(*native[b + i], g.value.data(), g.value.size());
        answered[i] = g.status.ok() || g.status.IsNotFound();
        if (!answered[i]) {
          AddViolation(phase + ": GET of unit#" + std::to_string(native[b + i]->id) + " answered " +
                       g.status.ToString());
        }
      });
      int64_t at = NowUs();
      if (!st.ok()) {
        AddViolation(phase + ": native GET after restart failed: " + st.ToString());
        return;
      }
      for (size_t i = 0; i < n; ++i) {
        if (answered[i]) judge(native[b + i], got[i], at);
      }
    }
    for (size_t b = 0; b < resp.size(); b += kVerifyBatchKeys) {
      size_t n = std::min(kVerifyBatchKeys, resp.size() - b);
      std::vector<std::string_view> args = {"MGET"};
      for (size_t i = 0; i < n; ++i) args.push_back(resp[b + i]->resp_key);
      auto rep = rc->Call(args);
      int64_t at = NowUs();
      if (!rep.ok() || rep->type != RespReply::Type::kArray || rep->elems.size() != n) {
        AddViolation(phase + ": RESP MGET after restart failed: " +
                     (rep.ok() ? rep->str : rep.status().ToString()));
        return;
      }
      for (size_t i = 0; i < n; ++i) {
        const RespReply& e = rep->elems[i];
        Observation got;
        if (e.type == RespReply::Type::kBulk)
          got = Observe(*resp[b + i], reinterpret_cast<const uint8_t*>(e.str.data()), e.str.size());
        judge(resp[b + i], got, at);
      }
    }
  }

  DriverOptions o_;
  std::filesystem::path dir_;
  std::unique_ptr<kt::KvtierdProcess> d_;
  uint16_t native_port_ = 0;
  std::mt19937_64* rng_ = nullptr;  // the run's generator (main thread only)
  uint64_t dram_bytes_ = 0;         // DRAM capacity of the current start
  std::vector<std::unique_ptr<KeyInfo>> keys_;
  std::shared_mutex resp_gate_;  // FLUSHDB holds it exclusively, other RESP commands shared
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> kill_us_{INT64_MAX};
  std::atomic<int> early_failures_{0};
  int64_t flush_at_us_ = INT64_MAX;  // when RESP thread 0 sends FLUSHDB in this load phase
  int64_t load_start_us_ = 0;        // start of the current load phase
  int load_ms_ = 1;                  // its planned length
  std::mutex mu_;                    // guards s_ and the printing
  Summary s_;
};

void RunMode(Mode mode) {
  DriverOptions o = OptionsFromEnv(mode);
  std::filesystem::path dir = std::filesystem::temp_directory_path() /
                              ("kvtier_crash_" + std::to_string(::getpid()) + "_" + ModeName(mode));
  CrashDriver d(o, dir);
  Summary s = d.Run();
  EXPECT_EQ(s.violations, 0u) << "seed " << o.seed << " (replay: KVTIER_CRASH_SEED=" << o.seed
                              << "); data and log kept in " << dir;
  EXPECT_EQ(s.kills, o.kills);
  EXPECT_GT(s.acked_writes, 0u);
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
}

TEST(KvtierdCrashTest, Sync) { RunMode(Mode::kSync); }
TEST(KvtierdCrashTest, Batched) { RunMode(Mode::kBatched); }
TEST(KvtierdCrashTest, None) { RunMode(Mode::kNone); }

}  // namespace
}  // namespace kvtier::crash
