// `kvtier demo`: the agent-resume scenario end to end on the trained miniature.
//
//   1. start kvtierd (the binary next to this one) on a temporary socket and data dir;
//   2. load the trained miniature (--trained-model, deploy/models/kvmini-trained.*); with
//      --trained-model off, deterministic random weights for the embedded mini-v4.1 instead
//      (kvtier-engine init's logic) and no trained-model part;
//   3. run a multi-turn agent session whose context grows past --context-tokens (16K): a CED
//      prefill of the first turn, later turns appended with chunked prefill, a few generated
//      tokens per turn, whole 64-token units saved through the client library as it goes;
//   4. continue the uninterrupted session for --fidelity-tokens steps (reference (a));
//   5. stop kvtierd gracefully and restart it (DRAM and the hot-state pool are gone);
//   6. resume from SSD (LOOKUP, GET, import, bounded replay, suffix prefill) and measure it;
//   7. recompute the same context with a CED prefill (the peer) and measure it;
//   8. print the ratio, bytes per token, units per tier, replay tokens and fidelity;
//      stop kvtierd and remove the temporary directory.
// Exit codes: 0 success, 1 failure, 2 bad usage.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/client.h"
#include "cli/cmd_demo_trained.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "common/json_text.h"
#include "common/shipped_models.h"
#include "common/temp_dir.h"
#include "engine/agent_text.h"
#include "engine/config.h"
#include "engine/fidelity.h"
#include "engine/model.h"
#include "engine/session.h"
#include "engine/weights.h"

extern char** environ;

namespace kvtier::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using engine::Engine;
using engine::SequenceState;

// Limits on the scenario's size.
constexpr uint64_t kMaxContextTokens = 1 << 20;
constexpr uint64_t kMaxGenPerTurn = 256;
constexpr uint64_t kMaxFidelityTokens = 1024;
// How long kvtierd may take to accept connections / to exit after SIGTERM.
constexpr int kDaemonStartTimeoutMs = 30000;
constexpr int kDaemonStopTimeoutMs = 60000;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// kvtierd next to the running kvtier: the same directory (an install) or the build tree's
// ../cache_daemon/kvtierd.
std::string FindKvtierd() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  for (const fs::path& p : {self.parent_path() / "kvtierd",
                            self.parent_path().parent_path() / "cache_daemon" / "kvtierd"}) {
    if (fs::exists(p, ec) && ::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return "";
}

// One kvtierd child process on a private socket, RESP and HTTP off.
class Daemon {
 public:
  Daemon(std::string binary, fs::path dir) : binary_(std::move(binary)), dir_(std::move(dir)) {}
  ~Daemon() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  std::string socket() const { return (dir_ / "kvtierd.sock").string(); }

  Status Start() {
    const std::string config = (dir_ / "kvtierd.toml").string();
    std::ofstream(config) << "[server]\nresp_port = 0\nhttp_port = 0\n"
                          << "[storage]\ndram_capacity_bytes = 268435456\n"
                          << "ssd_capacity_bytes = 1073741824\nssd_segment_bytes = 67108864\n"
                          << "durability = \"batched\"\n";
    std::vector<std::string> args = {
        binary_, "--config", config, "--data-dir", (dir_ / "data").string(), "--socket", socket()};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const std::string log = (dir_ / "kvtierd.log").string();
    posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    const int rc = posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      pid_ = -1;
      return Status::IOError("cannot start " + binary_);
    }
    for (int waited = 0; waited < kDaemonStartTimeoutMs; waited += 50) {
      daemon::ClientOptions co;
      co.socket_path = socket();
      co.shm_bytes = 0;
      co.timeout_ms = 2000;
      if (daemon::Client::Connect(co).ok()) return Status::Ok();
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return Status::Unavailable("kvtierd exited at start; see " + log);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return Status::Unavailable("kvtierd did not accept connections; see " + log);
  }

  // SIGTERM: kvtierd drains, flushes the store and exits 0.
  Status Stop() {
    if (pid_ <= 0) return Status::Ok();
    ::kill(pid_, SIGTERM);
    for (int waited = 0; waited < kDaemonStopTimeoutMs; waited += 10) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return Status::Ok();
        return Status::Internal("kvtierd did not exit cleanly");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return Status::Unavailable("kvtierd did not stop in time");
  }

 private:
  std::string binary_;
  fs::path dir_;
  pid_t pid_ = -1;
};

// Removes the temporary directory however the scenario ends.
int32_t Argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

struct Fidelity {
  double top1 = 0, kl_mean = 0, kl_max = 0;
  bool bit_exact = true;
};

// Teacher-forces `tokens` through `st` (starting from `logits`) and compares each step's
// distribution with the reference rows.
StatusOr<Fidelity> Compare(Engine* e, SequenceState* st, std::vector<float> logits,
                           const std::vector<std::vector<float>>& ref,
                           const std::vector<int32_t>& forced) {
  Fidelity f;
  size_t agree = 0;
  for (size_t k = 0; k < ref.size(); ++k) {
    agree += Argmax(logits) == Argmax(ref[k]);
    const double kl = engine::KlDivergence(ref[k], logits);
    f.kl_mean += kl / static_cast<double>(ref.size());
    f.kl_max = std::max(f.kl_max, kl);
    f.bit_exact = f.bit_exact && logits == ref[k];
    if (k + 1 < ref.size()) KVTIER_RETURN_IF_ERROR(e->Decode(st, forced[k], &logits));
  }
  f.top1 = ref.empty() ? 1.0 : static_cast<double>(agree) / static_cast<double>(ref.size());
  return f;
}

// The embedded mini-v4.1 with deterministic random weights (seed 1).
StatusOr<DemoModel> RandomMiniModel() {
  const ShippedModel* mini = FindShippedModel("mini-v4.1");
  if (mini == nullptr) return Status::Internal("mini-v4.1 is not embedded");
  KVTIER_ASSIGN_OR_RETURN(engine::EngineConfig cfg, engine::ParseEngineConfig(mini->config_json));
  KVTIER_ASSIGN_OR_RETURN(engine::ModelWeights w, engine::InitWeights(cfg, 1));
  return DemoModel{std::move(cfg), std::make_shared<const engine::ModelWeights>(std::move(w))};
}

Status RunScenario(const std::string& kvtierd, const DemoModel& model,
                   const std::string& model_name, uint64_t context_tokens, uint64_t first_turn,
                   uint64_t turn_tokens, uint64_t gen_per_turn, uint64_t fidelity_tokens,
                   int threads, bool json) {
  auto say = [&](const char* fmt, auto... a) {
    if (!json) {
      std::printf(fmt, a...);
      std::fflush(stdout);
    }
  };
  const auto t_all = Clock::now();
  TempDir tmp("kvtier-demo-");
  if (!tmp.ok()) return tmp.status();
  Daemon daemon(kvtierd, tmp.path());
  KVTIER_RETURN_IF_ERROR(daemon.Start());
  say("kvtierd started (%s), data dir %s\n", kvtierd.c_str(), tmp.File("data").c_str());

  const engine::EngineConfig& cfg = model.config;
  const std::shared_ptr<const engine::ModelWeights>& weights = model.weights;
  engine::EngineOptions eo;
  eo.threads = threads;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(cfg, weights, eo));
  engine::SessionOptions so;
  so.save_interval_tokens = 1024;
  KVTIER_ASSIGN_OR_RETURN(Digest fp, engine::EngineModelFingerprint(cfg, *weights, so.unit_tokens));

  auto connect = [&]() {
    daemon::ClientOptions co;
    co.socket_path = daemon.socket();
    co.unit_tokens = so.unit_tokens;
    return daemon::Client::Connect(co);
  };
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<daemon::Client> client, connect());
  KVTIER_ASSIGN_OR_RETURN(auto store, engine::SessionStore::Create(e.get(), client.get(), fp, so));

  // 3. The agent session.
  const auto t_session = Clock::now();
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  engine::SaveCursor cursor;
  uint64_t turn = 0;
  std::vector<int32_t> first = engine::AgentText(turn++, std::min(first_turn, context_tokens));
  KVTIER_RETURN_IF_ERROR(store->Prefill(&st, first, &logits));
  KVTIER_RETURN_IF_ERROR(store->Save(st, logits, &cursor));
  say("turn 0: CED prefill of %zu tokens (%.1f tokens/s)\n", first.size(),
      1.0 / store->cost_model()->ced_s_per_token());
  while (st.tokens.size() < context_tokens) {
    for (uint64_t g = 0; g < gen_per_turn; ++g) {  // the assistant answers a few tokens
      KVTIER_RETURN_IF_ERROR(e->Decode(&st, Argmax(logits), &logits));
      KVTIER_RETURN_IF_ERROR(store->MaybeSave(st, logits, &cursor));
    }
    const uint64_t n = std::min<uint64_t>(
        turn_tokens, context_tokens - std::min<uint64_t>(context_tokens, st.tokens.size()));
    if (n == 0) break;
    const std::vector<int32_t> t = engine::AgentText(turn++, n);  // the tool output / user turn
    KVTIER_RETURN_IF_ERROR(store->Extend(&st, t, &logits));
    KVTIER_RETURN_IF_ERROR(store->MaybeSave(st, logits, &cursor));
    say("turn %llu: +%llu tokens by chunked prefill, context %zu, %lld units saved\n",
        static_cast<unsigned long long>(turn - 1), static_cast<unsigned long long>(n),
        st.tokens.size(), static_cast<long long>(cursor.units_saved));
  }
  KVTIER_RETURN_IF_ERROR(store->Save(st, logits, &cursor));
  const double session_s = Since(t_session);
  const std::vector<int32_t> tokens = st.tokens;

  // 4. Reference (a): the uninterrupted session continues greedily.
  std::vector<std::vector<float>> ref;
  std::vector<int32_t> forced;
  {
    SequenceState a = st;
    std::vector<float> l = logits;
    for (uint64_t k = 0; k < fidelity_tokens; ++k) {
      ref.push_back(l);
      forced.push_back(Argmax(l));
      if (k + 1 < fidelity_tokens) KVTIER_RETURN_IF_ERROR(e->Decode(&a, forced.back(), &l));
    }
  }
  st = SequenceState();  // the session leaves memory

  // 5. Graceful restart of the daemon.
  client.reset();
  const auto t_restart = Clock::now();
  KVTIER_RETURN_IF_ERROR(daemon.Stop());
  KVTIER_RETURN_IF_ERROR(daemon.Start());
  const double restart_s = Since(t_restart);
  say("kvtierd stopped (graceful) and restarted in %.2f s\n", restart_s);
  KVTIER_ASSIGN_OR_RETURN(client, connect());
  // The engine process keeps its measured speeds; only the daemon restarted.
  KVTIER_ASSIGN_OR_RETURN(auto resumer,
                          engine::SessionStore::Create(e.get(), client.get(), fp, so));
  *resumer->cost_model() = *store->cost_model();

  // 6. Resume from SSD.
  SequenceState r;
  std::vector<float> rl;
  KVTIER_ASSIGN_OR_RETURN(engine::ResumeReport rep, resumer->Resume(tokens, &r, &rl));
  say("resume: %s\n", rep.decision.c_str());
  KVTIER_ASSIGN_OR_RETURN(Fidelity fid, Compare(e.get(), &r, rl, ref, forced));

  // 7. The peer: recompute the whole context with a CED prefill.
  SequenceState c = e->NewSequence();
  std::vector<float> cl;
  const auto t_rc = Clock::now();
  KVTIER_RETURN_IF_ERROR(e->PrefillCed(&c, tokens, &cl));
  const double recompute_s = Since(t_rc);
  KVTIER_ASSIGN_OR_RETURN(Fidelity rfid, Compare(e.get(), &c, cl, ref, forced));

  client.reset();
  KVTIER_RETURN_IF_ERROR(daemon.Stop());
  const double speedup = rep.total_s > 0 ? recompute_s / rep.total_s : 0;
  const auto& ss = store->stats();
  const double bytes_per_token = ss.units_put
                                     ? static_cast<double>(ss.unit_bytes_put) /
                                           static_cast<double>(ss.units_put * so.unit_tokens)
                                     : 0;
  const double payload_per_token = static_cast<double>(store->payload_layout().payload_bytes) /
                                   static_cast<double>(so.unit_tokens);
  if (json) {
    nlohmann::ordered_json j;
    j["model"] = model_name;
    j["context_tokens"] = tokens.size();
    j["turns"] = turn;
    j["units_saved"] = ss.units_put;
    j["bytes_per_token"] = bytes_per_token;
    j["payload_bytes_per_token"] = payload_per_token;
    j["session_build_s"] = session_s;
    j["daemon_restart_s"] = restart_s;
    j["resume_s"] = rep.total_s;
    j["recompute_s"] = recompute_s;
    j["resume_vs_recompute_speedup"] = speedup;
    j["units_hit_dram"] = rep.units_by_tier[1];
    j["units_hit_ssd"] = rep.units_by_tier[2];
    j["corrupt_units"] = rep.corrupt_units;
    j["replay_tokens"] = rep.replay_tokens;
    j["suffix_tokens"] = rep.suffix_tokens;
    j["hot_state_restored"] = rep.hot_state_restored;
    j["guard_decision"] = rep.decision;
    j["fidelity_tokens"] = fidelity_tokens;
    j["fidelity_top1"] = fid.top1;
    j["fidelity_kl_mean"] = fid.kl_mean;
    j["fidelity_kl_max"] = fid.kl_max;
    j["recompute_top1"] = rfid.top1;
    j["recompute_kl_mean"] = rfid.kl_mean;
    j["resume_stats"] = nlohmann::ordered_json::parse(resumer->StatsJson());
    j["total_s"] = Since(t_all);
    std::printf("%s\n", JsonText(j, 2).c_str());
  } else {
    std::printf("\n== agent resume on %s (%zu tokens, %llu turns) ==\n", model_name.c_str(),
                tokens.size(), static_cast<unsigned long long>(turn));
    std::printf(
        "stored: %llu units, %.1f B/token (payload %.1f B/token, FP4 global KV; SWA never "
        "on SSD)\n",
        static_cast<unsigned long long>(ss.units_put), bytes_per_token, payload_per_token);
    std::printf(
        "resume from SSD : %8.3f s  (units hit: ssd %lld, dram %lld; SWA replay %lld "
        "tokens; suffix %lld tokens)\n",
        rep.total_s, static_cast<long long>(rep.units_by_tier[2]),
        static_cast<long long>(rep.units_by_tier[1]), static_cast<long long>(rep.replay_tokens),
        static_cast<long long>(rep.suffix_tokens));
    std::printf("recompute (CED) : %8.3f s  (peer)\n", recompute_s);
    std::printf("resume vs recompute: %.1fx faster\n", speedup);
    std::printf(
        "fidelity over %llu tokens vs the uninterrupted session: top-1 %.3f, KL mean "
        "%.2e nats (max %.2e)\n",
        static_cast<unsigned long long>(fidelity_tokens), fid.top1, fid.kl_mean, fid.kl_max);
    std::printf("  (recompute by CED vs uninterrupted: top-1 %.3f, KL mean %.2e)\n", rfid.top1,
                rfid.kl_mean);
    std::printf("total %.1f s; kvtierd stopped, %s removed\n", Since(t_all), tmp.path().c_str());
  }
  return Status::Ok();
}

}  // namespace

int RunDemo(Args args) {
  FlagSet flags("kvtier demo",
                "Agent session resume end to end: kvtierd, a 16K-token multi-turn session on "
                "the trained miniature, daemon restart, resume from SSD vs recompute, then the "
                "trained model's text and fidelity line.");
  uint64_t context = 16500, first_turn = 12288, turn_tokens = 1024, gen = 4, fidelity = 32;
  uint64_t threads = 2;
  std::string kvtierd;
  bool json = false;
  flags.Uint("context-tokens", &context, "grow the session to at least this many tokens");
  flags.Uint("first-turn-tokens", &first_turn, "tokens of the first turn (CED prefill)");
  flags.Uint("turn-tokens", &turn_tokens, "tokens appended per later turn (chunked prefill)");
  flags.Uint("gen-per-turn", &gen, "tokens generated per turn");
  flags.Uint("fidelity-tokens", &fidelity, "continuation steps compared for fidelity");
  flags.Uint("threads", &threads, "engine CPU threads");
  flags.String("kvtierd", &kvtierd, "PATH", "kvtierd binary (default: next to kvtier)");
  std::string trained = "deploy/models/kvmini-trained";
  flags.String("trained-model", &trained, "PREFIX",
               "trained checkpoint (PREFIX.json, PREFIX.safetensors) for the resume scenario "
               "and the text and fidelity part; 'off': the embedded mini-v4.1 with random "
               "weights, no text part");
  flags.Bool("json", &json, "print the summary as JSON");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (context < 64 || context > kMaxContextTokens || first_turn == 0 || turn_tokens == 0 ||
      gen > kMaxGenPerTurn || fidelity == 0 || fidelity > kMaxFidelityTokens || threads == 0 ||
      threads > 256) {
    std::fprintf(stderr,
                 "kvtier demo: --context-tokens in [64,%llu], turns > 0, "
                 "--gen-per-turn <= %llu, --fidelity-tokens in [1,%llu]\n",
                 static_cast<unsigned long long>(kMaxContextTokens),
                 static_cast<unsigned long long>(kMaxGenPerTurn),
                 static_cast<unsigned long long>(kMaxFidelityTokens));
    return 2;
  }
  if (kvtierd.empty()) kvtierd = FindKvtierd();
  if (kvtierd.empty()) {
    std::fprintf(stderr,
                 "kvtier demo: kvtierd not found next to kvtier (same directory or "
                 "../cache_daemon/kvtierd); build it (`cmake --build <dir> --target kvtierd`) or "
                 "pass --kvtierd PATH\n");
    return 1;
  }
  StatusOr<DemoModel> model = trained == "off" ? RandomMiniModel() : LoadDemoModel(trained);
  if (!model.ok()) {
    std::fprintf(stderr, "kvtier demo: %s: %s\n", trained == "off" ? "model" : "trained model",
                 model.status().ToString().c_str());
    return 1;
  }
  const std::string name =
      trained == "off" ? "mini-v4.1 (random weights)" : "the trained miniature";
  Status s = RunScenario(kvtierd, *model, name, context, first_turn, turn_tokens, gen, fidelity,
                         static_cast<int>(threads), json);
  if (!s.ok()) {
    std::fprintf(stderr, "kvtier demo: %s\n", s.ToString().c_str());
    return 1;
  }
  if (!json && trained != "off") {
    s = RunTrainedModelDemo(*model, trained, static_cast<int>(threads));
    if (!s.ok()) {
      std::fprintf(stderr, "kvtier demo: trained model: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace kvtier::cli
