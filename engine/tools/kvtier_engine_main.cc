// kvtier-engine: run the miniature DeepSeek-V4.1-Flash engine from the command line.
//
//   kvtier-engine init     --config C --seed S --out M.safetensors
//   kvtier-engine generate --model M --config C --prompt-file F --max-new N
//                          [--temperature T --top-p P --seed S --threads N --full]
//                          [--save-socket S --token T --save-interval N --no-hot-state
//                           --tokens-out F --engram-socket S]
//                          [--speculative --draft D.safetensors --draft-len N]
//   kvtier-engine resume   --model M --config C --socket S (--tokens-file F | --prompt-file F)
//                          [--max-new N --token T --guard auto|fetch|recompute
//                           --no-hot-state --replay-tokens N --json]
//   kvtier-engine bench    --model M --config C [--json --prompt-tokens N --decode-tokens N]
//   kvtier-engine fidelity --model M --config C --prompt-file F [--json --histories LIST
//                          --replay-tokens LIST --eval-tokens N --samples K --bos --threads N]
//
// Exit codes: 0 success, 1 failure, 2 bad usage.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cache_daemon/client.h"
#include "cli/flags.h"
#include "engine/config.h"
#include "engine/dspark.h"
#include "engine/engram_daemon.h"
#include "engine/fidelity.h"
#include "engine/model.h"
#include "engine/remote_engram.h"
#include "engine/sampler.h"
#include "engine/session.h"
#include "engine/speculative.h"
#include "engine/tokenizer.h"
#include "engine/weights.h"
#include "serving/serve_command.h"

namespace kvtier::engine {
namespace {

using Args = std::span<const std::string_view>;

// Limits on what the command line may ask for.
constexpr uint64_t kMaxNewTokensLimit = 1 << 16;
constexpr uint64_t kMaxPromptBytes = 1 << 20;
constexpr uint64_t kMaxBenchTokens = 1 << 14;

int Fail(const Status& s) {
  std::fprintf(stderr, "kvtier-engine: %s\n", s.ToString().c_str());
  return 1;
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

StatusOr<std::unique_ptr<Engine>> Open(const std::string& config_path,
                                       const std::string& model_path, int threads,
                                       std::shared_ptr<const ModelWeights>* weights_out = nullptr,
                                       EngramRowSource* engram_rows = nullptr) {
  KVTIER_ASSIGN_OR_RETURN(EngineConfig cfg, LoadEngineConfig(config_path));
  KVTIER_ASSIGN_OR_RETURN(ModelWeights w, LoadWeights(cfg, model_path));
  EngineOptions o;
  o.threads = threads;
  o.engram_rows = engram_rows;
  auto shared = std::make_shared<const ModelWeights>(std::move(w));
  if (weights_out != nullptr) *weights_out = shared;
  return Engine::Create(cfg, shared, o);
}

// A session store over a kvtierd Unix socket (the engine talks to the daemon only through
// the client library).
struct Saver {
  std::unique_ptr<daemon::Client> client;
  std::unique_ptr<SessionStore> store;
};

StatusOr<Saver> ConnectStore(Engine* engine, const ModelWeights& weights, const std::string& socket,
                             const std::string& token, const SessionOptions& options) {
  Saver s;
  daemon::ClientOptions co;
  co.socket_path = socket;
  co.token = token;
  co.unit_tokens = options.unit_tokens;
  KVTIER_ASSIGN_OR_RETURN(s.client, daemon::Client::Connect(co));
  KVTIER_ASSIGN_OR_RETURN(Digest fp,
                          EngineModelFingerprint(engine->config(), weights, options.unit_tokens));
  KVTIER_ASSIGN_OR_RETURN(s.store, SessionStore::Create(engine, s.client.get(), fp, options));
  return s;
}

Status WriteIds(const std::string& path, std::span<const int32_t> ids) {
  std::ofstream out(path);
  if (!out) return Status::IOError("cannot write " + path);
  for (size_t i = 0; i < ids.size(); ++i) out << (i ? " " : "") << ids[i];
  out << "\n";
  return out ? Status::Ok() : Status::IOError("cannot write " + path);
}

StatusOr<std::vector<int32_t>> ReadIds(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::IOError("cannot open " + path);
  std::vector<int32_t> ids;
  long long v;
  while (in >> v) {
    if (v < 0 || v > INT32_MAX || ids.size() >= kMaxSessionTokens)
      return Status::InvalidArgument("bad token id list in " + path);
    ids.push_back(static_cast<int32_t>(v));
  }
  if (!in.eof()) return Status::InvalidArgument("bad token id list in " + path);
  return ids;
}

int RunInit(Args args) {
  cli::FlagSet flags(
      "kvtier-engine init",
      "Make deterministic weights for a model config and write them as safetensors.");
  std::string config, out;
  uint64_t seed = 0;
  flags.String("config", &config, "FILE", "model config.json (HF text_config keys)", true);
  flags.Uint("seed", &seed, "weight seed");
  flags.String("out", &out, "FILE", "output .safetensors path", true);
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  auto cfg = LoadEngineConfig(config);
  if (!cfg.ok()) return Fail(cfg.status());
  auto w = InitWeights(*cfg, seed);
  if (!w.ok()) return Fail(w.status());
  Status s = WriteSafetensors(out, w->file);
  if (!s.ok()) return Fail(s);
  size_t params = 0;
  for (const auto& [name, t] : w->file.tensors) params += static_cast<size_t>(t.NumElements());
  std::printf("wrote %s: %zu tensors, %zu parameters (seed %llu)\n", out.c_str(),
              w->file.tensors.size(), params, static_cast<unsigned long long>(seed));
  return 0;
}

int RunGenerate(Args args) {
  cli::FlagSet flags("kvtier-engine generate",
                     "Generate text: CED prefill of the prompt, then one decode step per token.");
  std::string model, config, prompt_file;
  uint64_t max_new = 32, seed = 0, threads = 2;
  double temperature = 0.0, top_p = 1.0;
  bool full = false, ids = false, no_hot = false;
  std::string save_socket, token, tokens_out;
  uint64_t save_interval = 1024;
  flags.String("model", &model, "FILE", "weights (.safetensors)", true);
  flags.String("config", &config, "FILE", "model config.json", true);
  flags.String("prompt-file", &prompt_file, "FILE", "prompt text (bytes)", true);
  flags.Uint("max-new", &max_new, "tokens to generate");
  flags.Double("temperature", &temperature, "sampling temperature; 0 = greedy");
  flags.Double("top-p", &top_p, "nucleus sampling mass in (0,1]");
  flags.Uint("seed", &seed, "sampling seed");
  flags.Uint("threads", &threads, "CPU threads (results do not depend on it)");
  flags.Bool("full", &full, "prefill with the full forward instead of CED");
  flags.Bool("ids", &ids, "also print the generated token ids");
  bool bos = false;
  flags.Bool("bos", &bos,
             "prepend the bos token to the prompt (as kvtier_spec_bench and the training "
             "windows do)");
  flags.String("save-socket", &save_socket, "PATH",
               "kvtierd Unix socket: save the session's units there (default: no save)");
  flags.String("token", &token, "TOKEN", "kvtierd auth token");
  flags.Uint("save-interval", &save_interval, "tokens of new whole units between saves");
  flags.Bool("no-hot-state", &no_hot, "do not keep SWA rings in the daemon's DRAM pool");
  flags.String("tokens-out", &tokens_out, "FILE", "write the session's token ids (for resume)");
  std::string engram_socket;
  flags.String("engram-socket", &engram_socket, "PATH",
               "kvtierd Unix socket serving [engram]: read Engram rows from its row server "
               "(grants via ENGRAM_GRANT, --token), report fetch counters back at the end "
               "(default: the weights' own tables)");
  bool speculative = false;
  std::string draft_path;
  std::optional<uint64_t> draft_len;  // unset: the load-aware scheduler chooses each round
  flags.Bool("speculative", &speculative,
             "DSpark speculative decoding (docs/ENGINE.md, DSpark): full-forward prefill, "
             "draft + one verify pass per round; greedy output equals plain greedy's");
  flags.String("draft", &draft_path, "FILE",
               "DSpark weights (default: the model path with -dspark.safetensors)");
  flags.OptionalUint("draft-len", &draft_len,
                     "draft tokens verified per round, 0..dspark_block_size",
                     "the load-aware scheduler chooses each round");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (speculative && !save_socket.empty()) {
    std::fprintf(stderr,
                 "kvtier-engine generate: --speculative and --save-socket do not combine\n");
    return 2;
  }
  if (full && !save_socket.empty()) {
    std::fprintf(stderr, "kvtier-engine generate: --full and --save-socket do not combine\n");
    return 2;
  }
  if (max_new > kMaxNewTokensLimit || threads == 0 || threads > kMaxThreads ||
      !(top_p > 0 && top_p <= 1) || temperature < 0) {
    std::fprintf(stderr,
                 "kvtier-engine generate: --max-new <= %llu, --threads in [1,%d], "
                 "--top-p in (0,1], --temperature >= 0\n",
                 static_cast<unsigned long long>(kMaxNewTokensLimit), kMaxThreads);
    return 2;
  }
  std::ifstream in(prompt_file, std::ios::binary);
  if (!in) return Fail(Status::IOError("cannot open " + prompt_file));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (text.empty() || text.size() > kMaxPromptBytes) {
    std::fprintf(stderr, "kvtier-engine generate: the prompt must have 1..%llu bytes\n",
                 static_cast<unsigned long long>(kMaxPromptBytes));
    return 2;
  }
  // Remote Engram rows (declared before the engine: they must outlive it).
  std::unique_ptr<daemon::Client> engram_daemon;
  std::unique_ptr<RemoteEngramRowSource> engram_rows;
  if (!engram_socket.empty()) {
    auto cfg = LoadEngineConfig(config);
    if (!cfg.ok()) return Fail(cfg.status());
    daemon::ClientOptions co;
    co.socket_path = engram_socket;
    co.token = token;
    co.shm_bytes = 0;  // grants and reports only
    auto c = daemon::Client::Connect(co);
    if (!c.ok()) return Fail(c.status().WithContext("engram daemon " + engram_socket));
    engram_daemon = std::move(*c);
    daemon::Client* daemons[] = {engram_daemon.get()};
    auto rows = ConnectEngramViaDaemons(daemons, *cfg, RemoteEngramOptions{});
    if (!rows.ok()) return Fail(rows.status());
    engram_rows = std::move(*rows);
  }
  std::shared_ptr<const ModelWeights> weights;
  auto engine = Open(config, model, static_cast<int>(threads), &weights, engram_rows.get());
  if (!engine.ok()) return Fail(engine.status());
  Engine& e = **engine;
  auto tok = ByteTokenizer::Create(e.config().vocab_size, e.config().engram_pad_token_id,
                                   e.config().dspark_noise_token_id);
  if (!tok.ok()) return Fail(tok.status());
  std::vector<int32_t> prompt = tok->Encode(text);
  if (bos) prompt.insert(prompt.begin(), ByteTokenizer::kBos);
  SessionOptions so;
  so.save_interval_tokens = save_interval;
  so.keep_hot_state = !no_hot;
  Saver saver;
  if (!save_socket.empty()) {
    auto sv = ConnectStore(&e, *weights, save_socket, token, so);
    if (!sv.ok()) return Fail(sv.status());
    saver = std::move(*sv);
  }
  if (speculative) {
    if (draft_path.empty()) draft_path = DefaultDraftPath(model);
    auto dc = LoadDSparkConfig(config, e.config());
    if (!dc.ok()) return Fail(dc.status());
    if (draft_len && *draft_len > static_cast<uint64_t>(dc->block_size)) {
      std::fprintf(stderr, "kvtier-engine generate: --draft-len in [0, %d]\n", dc->block_size);
      return 2;
    }
    auto draft = DSpark::Load(e.config(), *dc, weights, draft_path);
    if (!draft.ok()) return Fail(draft.status());
    Sampler sampler(temperature, top_p, seed);
    SpeculativeOptions so2;
    so2.scheduler = !draft_len.has_value();
    so2.draft_len = so2.scheduler ? 0 : static_cast<int>(*draft_len);
    DraftScheduler scheduler(dc->block_size + 1, CpuCostClock(e));
    SpeculativeDecoder dec(&e, draft->get(), weights.get(), &scheduler, so2, &sampler);
    SequenceState st = e.NewSequence();
    std::vector<int32_t> out;
    int32_t first = -1;
    Status s = dec.Start(&st, prompt, &first);
    if (!s.ok()) return Fail(s);
    out.push_back(first);
    if (so2.scheduler) {
      s = MeasureSps(&e, st, 3, &scheduler);
      if (!s.ok()) return Fail(s);
    }
    const auto t0 = std::chrono::steady_clock::now();
    while (out.size() < max_new) {
      s = dec.Round(&st, &out);
      if (!s.ok()) return Fail(s);
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.resize(max_new);
    const SpeculativeStats& ss2 = dec.stats();
    std::string chosen;
    for (size_t b = 0; b < ss2.chosen_b.size(); ++b)
      chosen += (b ? "," : "") + std::to_string(ss2.chosen_b[b]);
    std::fprintf(stderr,
                 "speculative: %llu rounds, %llu drafted, %llu accepted (%.2f per verification, "
                 "%.2f tokens per verification), %llu rejections, %llu rolled back, B chosen "
                 "[%s], decode %.1f tokens/s\n",
                 static_cast<unsigned long long>(ss2.rounds),
                 static_cast<unsigned long long>(ss2.drafted),
                 static_cast<unsigned long long>(ss2.accepted),
                 ss2.rounds ? static_cast<double>(ss2.accepted) / ss2.rounds : 0.0,
                 ss2.rounds ? static_cast<double>(ss2.emitted) / ss2.rounds : 0.0,
                 static_cast<unsigned long long>(ss2.rejections),
                 static_cast<unsigned long long>(ss2.rolled_back), chosen.c_str(),
                 secs > 0 ? static_cast<double>(ss2.emitted) / secs : 0.0);
    if (!tokens_out.empty()) {
      s = WriteIds(tokens_out, st.tokens);
      if (!s.ok()) return Fail(s);
    }
    std::printf("%s\n", tok->Decode(out).c_str());
    if (ids) {
      for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? " " : "", out[i]);
      std::printf("\n");
    }
    return 0;
  }
  SaveCursor cursor;
  SequenceState st = e.NewSequence();
  std::vector<float> logits;
  Status s = full ? e.Forward(&st, prompt, false, &logits) : e.PrefillCed(&st, prompt, &logits);
  if (!s.ok()) return Fail(s);
  if (saver.store) {  // after the prefill: every whole unit of the prompt
    s = saver.store->Save(st, logits, &cursor);
    if (!s.ok()) return Fail(s);
  }
  Sampler sampler(temperature, top_p, seed);
  std::vector<int32_t> out;
  for (uint64_t i = 0; i < max_new; ++i) {
    const int32_t next = sampler.Sample(logits);
    out.push_back(next);
    if (i + 1 < max_new) {
      s = e.Decode(&st, next, &logits);
      if (!s.ok()) return Fail(s);
      if (saver.store) {
        s = saver.store->MaybeSave(st, logits, &cursor);
        if (!s.ok()) return Fail(s);
      }
    }
  }
  if (saver.store) {  // the rest of the whole units at the end of the generation
    s = saver.store->Save(st, logits, &cursor);
    if (!s.ok()) return Fail(s);
    std::fprintf(stderr, "saved %lld units of %zu tokens: %s\n",
                 static_cast<long long>(cursor.units_saved), st.tokens.size(),
                 saver.store->StatsJson().c_str());
  }
  if (!tokens_out.empty()) {
    s = WriteIds(tokens_out, st.tokens);
    if (!s.ok()) return Fail(s);
  }
  if (engram_rows != nullptr) {
    const EngineStats es = e.stats();
    const RemoteEngramStats rs = engram_rows->stats();
    std::fprintf(stderr,
                 "engram: transport %s, %llu rows requested, %llu read, %llu hot-cache hits, "
                 "%llu deduplicated, %llu stalls (%.1f ms) in %llu waits\n",
                 engram_rows->transport_name(),
                 static_cast<unsigned long long>(rs.fetch.rows_requested),
                 static_cast<unsigned long long>(rs.fetch.rows_read),
                 static_cast<unsigned long long>(rs.fetch.hot_cache_hits),
                 static_cast<unsigned long long>(rs.fetch.rows_deduplicated),
                 static_cast<unsigned long long>(es.engram_stalls),
                 static_cast<double>(es.engram_stall_us) / 1e3,
                 static_cast<unsigned long long>(es.engram_waits));
    EngramStatsReporter reporter;
    s = reporter.Report(*engram_daemon, *engram_rows);
    if (!s.ok()) return Fail(s.WithContext("engram report"));
  }
  std::printf("%s\n", tok->Decode(out).c_str());
  if (ids) {
    for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? " " : "", out[i]);
    std::printf("\n");
  }
  return 0;
}

int RunResume(Args args) {
  cli::FlagSet flags("kvtier-engine resume",
                     "Resume a saved session from kvtierd (LOOKUP, GET, import, bounded replay or "
                     "hot state, prefill of the uncached suffix) and continue decoding greedily.");
  std::string model, config, socket, token, tokens_file, prompt_file, guard = "auto";
  uint64_t max_new = 32, threads = 2;
  bool json = false, no_hot = false;
  flags.String("model", &model, "FILE", "weights (.safetensors)", true);
  flags.String("config", &config, "FILE", "model config.json", true);
  flags.String("socket", &socket, "PATH", "kvtierd Unix socket", true);
  flags.String("token", &token, "TOKEN", "kvtierd auth token");
  flags.String("tokens-file", &tokens_file, "FILE",
               "the session's token ids (generate --tokens-out)");
  flags.String("prompt-file", &prompt_file, "FILE", "or: the session's text (bytes)");
  flags.Uint("max-new", &max_new, "tokens to generate after the resume");
  flags.Uint("threads", &threads, "CPU threads");
  flags.String("guard", &guard, "MODE", "auto | fetch | recompute");
  flags.Bool("no-hot-state", &no_hot, "ignore a hot state in the DRAM pool (always replay)");
  uint64_t replay_tokens = 0;
  flags.Uint("replay-tokens", &replay_tokens,
             "tokens replayed to rebuild the SWA rings without a hot state, >= the sliding "
             "window W; 0 = the default (kDefaultReplayWindows x W)");
  flags.Bool("json", &json, "print the resume report and stats as JSON");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  SessionOptions so;
  so.use_hot_state = !no_hot;
  so.replay_tokens = replay_tokens;
  if (guard == "auto") {
    so.guard = GuardMode::kAuto;
  } else if (guard == "fetch") {
    so.guard = GuardMode::kAlwaysFetch;
  } else if (guard == "recompute") {
    so.guard = GuardMode::kAlwaysRecompute;
  } else {
    std::fprintf(stderr, "kvtier-engine resume: --guard auto|fetch|recompute\n");
    return 2;
  }
  if (max_new == 0 || max_new > kMaxNewTokensLimit || threads == 0 || threads > kMaxThreads ||
      tokens_file.empty() == prompt_file.empty()) {
    std::fprintf(stderr,
                 "kvtier-engine resume: exactly one of --tokens-file/--prompt-file, --max-new "
                 "in [1,%llu], --threads in [1,%d]\n",
                 static_cast<unsigned long long>(kMaxNewTokensLimit), kMaxThreads);
    return 2;
  }
  if (auto cfg = LoadEngineConfig(config); !cfg.ok()) {
    return Fail(cfg.status());
  } else if (auto r = ResolveReplayTokens(*cfg, replay_tokens); !r.ok()) {
    std::fprintf(stderr, "kvtier-engine resume: --replay-tokens: %s\n",
                 r.status().ToString().c_str());
    return 2;
  }
  std::shared_ptr<const ModelWeights> weights;
  auto engine = Open(config, model, static_cast<int>(threads), &weights);
  if (!engine.ok()) return Fail(engine.status());
  Engine& e = **engine;
  auto tok = ByteTokenizer::Create(e.config().vocab_size, e.config().engram_pad_token_id,
                                   e.config().dspark_noise_token_id);
  if (!tok.ok()) return Fail(tok.status());
  std::vector<int32_t> tokens;
  if (!tokens_file.empty()) {
    auto ids = ReadIds(tokens_file);
    if (!ids.ok()) return Fail(ids.status());
    tokens = std::move(*ids);
  } else {
    std::ifstream in(prompt_file, std::ios::binary);
    if (!in) return Fail(Status::IOError("cannot open " + prompt_file));
    std::stringstream ss;
    ss << in.rdbuf();
    if (ss.str().size() > kMaxPromptBytes) return Fail(Status::InvalidArgument("prompt too long"));
    tokens = tok->Encode(ss.str());
  }
  auto saver = ConnectStore(&e, *weights, socket, token, so);
  if (!saver.ok()) return Fail(saver.status());
  SequenceState st;
  std::vector<float> logits;
  auto rep = saver->store->Resume(tokens, &st, &logits);
  if (!rep.ok()) return Fail(rep.status());
  std::vector<int32_t> out;
  for (uint64_t i = 0; i < max_new; ++i) {
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(next);
    if (i + 1 < max_new) {
      Status s = e.Decode(&st, next, &logits);
      if (!s.ok()) return Fail(s);
    }
  }
  if (json) {
    nlohmann::ordered_json j;
    j["tokens"] = rep->tokens;
    j["hit_units"] = rep->hit_units;
    j["units_used"] = rep->units_used;
    j["units_hit_dram"] = rep->units_by_tier[1];
    j["units_hit_ssd"] = rep->units_by_tier[2];
    j["corrupt_units"] = rep->corrupt_units;
    j["hot_state_restored"] = rep->hot_state_restored;
    j["replay_tokens"] = rep->replay_tokens;
    j["suffix_tokens"] = rep->suffix_tokens;
    j["recomputed"] = rep->recomputed;
    j["decision"] = rep->decision;
    j["resume_s"] = rep->total_s;
    j["generated_ids"] = out;
    j["generated_text"] = tok->Decode(out);
    j["stats"] = nlohmann::ordered_json::parse(saver->store->StatsJson());
    // Generated bytes need not be UTF-8: replace invalid sequences instead of throwing.
    std::printf("%s\n",
                j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
  } else {
    std::printf("%s\n", tok->Decode(out).c_str());
    std::fprintf(stderr,
                 "resumed %lld tokens in %.3f s: %s; %lld/%lld units used (dram %lld, ssd %lld), "
                 "replay %lld, suffix %lld%s\n",
                 static_cast<long long>(rep->tokens), rep->total_s, rep->decision.c_str(),
                 static_cast<long long>(rep->units_used), static_cast<long long>(rep->hit_units),
                 static_cast<long long>(rep->units_by_tier[1]),
                 static_cast<long long>(rep->units_by_tier[2]),
                 static_cast<long long>(rep->replay_tokens),
                 static_cast<long long>(rep->suffix_tokens),
                 rep->hot_state_restored ? ", exact restore from the hot state" : "");
  }
  return 0;
}

int RunBench(Args args) {
  cli::FlagSet flags("kvtier-engine bench",
                     "Prefill and decode throughput, and the prefill-to-decode cost per token.");
  std::string model, config;
  uint64_t prompt_tokens = 256, decode_tokens = 32, threads = 2;
  bool json = false;
  flags.String("model", &model, "FILE", "weights (.safetensors)", true);
  flags.String("config", &config, "FILE", "model config.json", true);
  flags.Uint("prompt-tokens", &prompt_tokens, "prompt length");
  flags.Uint("decode-tokens", &decode_tokens, "tokens to decode");
  flags.Uint("threads", &threads, "CPU threads");
  flags.Bool("json", &json, "print JSON");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (prompt_tokens == 0 || prompt_tokens > kMaxBenchTokens || decode_tokens == 0 ||
      decode_tokens > kMaxBenchTokens || threads == 0 || threads > kMaxThreads) {
    std::fprintf(stderr, "kvtier-engine bench: token counts in [1,%llu], threads in [1,%d]\n",
                 static_cast<unsigned long long>(kMaxBenchTokens), kMaxThreads);
    return 2;
  }
  auto engine = Open(config, model, static_cast<int>(threads));
  if (!engine.ok()) return Fail(engine.status());
  Engine& e = **engine;
  std::vector<int32_t> prompt(prompt_tokens);
  for (size_t i = 0; i < prompt.size(); ++i)
    prompt[i] = 3 + 'a' + static_cast<int32_t>((i * 7) % 26);
  using Clock = std::chrono::steady_clock;
  std::vector<float> logits;
  // CED prefill (the serving path).
  SequenceState ced = e.NewSequence();
  auto t0 = Clock::now();
  Status s = e.PrefillCed(&ced, prompt, &logits);
  auto t1 = Clock::now();
  if (!s.ok()) return Fail(s);
  // Peer: the full forward over the same prompt.
  SequenceState full = e.NewSequence();
  std::vector<float> full_logits;
  auto t2 = Clock::now();
  s = e.Forward(&full, prompt, false, &full_logits);
  auto t3 = Clock::now();
  if (!s.ok()) return Fail(s);
  // Decode from the CED state.
  const int64_t dispatches0 = e.pool_dispatches();
  auto t4 = Clock::now();
  for (uint64_t i = 0; i < decode_tokens; ++i) {
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    s = e.Decode(&ced, next, &logits);
    if (!s.ok()) return Fail(s);
  }
  auto t5 = Clock::now();
  const double dispatches_per_token =
      static_cast<double>(e.pool_dispatches() - dispatches0) / static_cast<double>(decode_tokens);
  const double ced_s = Seconds(t0, t1), full_s = Seconds(t2, t3), dec_s = Seconds(t4, t5);
  const double ced_tps = prompt_tokens / ced_s, full_tps = prompt_tokens / full_s;
  const double dec_tps = decode_tokens / dec_s;
  const double ced_ratio = (ced_s / prompt_tokens) / (dec_s / decode_tokens);
  // Memory per cached token of the decoded sequence against the bytes units store for it.
  const KvMemory mem = KvCacheBytes(ced);
  const double cached = static_cast<double>(ced.tokens.size());
  const double kv_per_token = mem.global_kv_bytes / cached,
               stored_per_token = mem.stored_bytes / cached;
  const double full_ratio = (full_s / prompt_tokens) / (dec_s / decode_tokens);
  if (json) {
    nlohmann::ordered_json j;
    j["prompt_tokens"] = prompt_tokens;
    j["decode_tokens"] = decode_tokens;
    j["threads"] = e.threads();
    j["ced_prefill_tokens_per_s"] = ced_tps;
    j["full_prefill_tokens_per_s"] = full_tps;
    j["decode_tokens_per_s"] = dec_tps;
    j["decode_pool_dispatches_per_token"] = dispatches_per_token;
    j["ced_prefill_to_decode_cost_per_token"] = ced_ratio;
    j["full_prefill_to_decode_cost_per_token"] = full_ratio;
    j["ced_vs_full_prefill_speedup"] = full_s / ced_s;
    j["global_kv_bytes_per_token"] = kv_per_token;
    j["stored_bytes_per_token"] = stored_per_token;
    j["fixed_state_bytes"] = mem.fixed_bytes;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("threads %d, prompt %llu tokens, decode %llu tokens\n", e.threads(),
                static_cast<unsigned long long>(prompt_tokens),
                static_cast<unsigned long long>(decode_tokens));
    std::printf("CED prefill   %10.1f tokens/s\n", ced_tps);
    std::printf("full prefill  %10.1f tokens/s   (peer: every layer over every token)\n", full_tps);
    std::printf("decode        %10.1f tokens/s   (%.1f parallel sections per token)\n", dec_tps,
                dispatches_per_token);
    std::printf(
        "prefill/decode cost per token: CED %.3f, full %.3f (CED is %.2fx the full "
        "forward)\n",
        ced_ratio, full_ratio, full_s / ced_s);
    std::printf(
        "memory: global KV %.1f B per cached token, stored %.1f B per token (%.2fx), plus %zu B "
        "of SWA rings and partial groups\n",
        kv_per_token, stored_per_token, kv_per_token / stored_per_token, mem.fixed_bytes);
  }
  return 0;
}

// Parses "a,b,c" of positive integers; an entry "kW" (or "W") is k times `window` when
// window > 0. False for an empty list, a malformed or zero entry, or a value above `max`.
bool ParseLengths(const std::string& text, int64_t window, int64_t max, std::vector<int64_t>* out) {
  out->clear();
  for (const std::string& part : cli::SplitComma(text)) {
    std::string_view digits = part;
    int64_t unit = 1;
    if (window > 0 && !digits.empty() && (digits.back() == 'W' || digits.back() == 'w')) {
      digits.remove_suffix(1);
      unit = window;
    }
    int64_t v = 1;  // "W" alone is one window
    if (!digits.empty()) {
      auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
      if (ec != std::errc() || end != digits.data() + digits.size() || v <= 0 || v > max)
        return false;
    }
    if (v > max / unit) return false;
    out->push_back(v * unit);
  }
  return !out->empty();
}

int RunFidelity(Args args) {
  cli::FlagSet flags(
      "kvtier-engine fidelity",
      "How closely a restored session continues the uninterrupted one, on a text (byte "
      "tokens), teacher-forced: for each history h, the next-token distributions predicting "
      "the N tokens after h of (a) the uninterrupted full forward, (b) exact restore (units + "
      "hot SWA state exported at h and imported, as a resume with the hot state) and (c) "
      "bounded replay (the same units imported, SWA rings rebuilt by replaying the last R "
      "tokens). Prints top-1 agreement of (b) and (c) with (a), KL(a||b) and KL(a||c) in nats "
      "(mean and max over the positions) and each path's bits per byte. With --samples K the "
      "text is cut into K consecutive sessions of max(h) + N bytes and the scores are pooled "
      "over K x N positions. Reads only the first K x (max(h) + N) bytes of the file.");
  std::string model, config, prompt_file, histories_text = "128,512,2048,8192";
  std::string replay_text = "W,2W,4W";
  uint64_t eval_tokens = 64, threads = 2, samples = 1;
  bool json = false, bos = false;
  flags.String("model", &model, "FILE", "weights (.safetensors; F32, F16 or BF16)", true);
  flags.String("config", &config, "FILE", "model config.json", true);
  flags.String("prompt-file", &prompt_file, "FILE", "the text (bytes)", true);
  flags.String("histories", &histories_text, "LIST",
               "history lengths in tokens, comma-separated, each a multiple of 64 (the unit)");
  flags.String("replay-tokens", &replay_text, "LIST",
               "replay lengths R for (c), comma-separated: tokens or multiples of the sliding "
               "window W written kW (e.g. 16,2W); each >= W");
  flags.Uint("eval-tokens", &eval_tokens, "N: positions compared after each history", false, 1,
             static_cast<uint64_t>(kMaxFidelityEvalTokens));
  flags.Uint("samples", &samples, "K: independent sessions cut from the text, scores pooled", false,
             1, static_cast<uint64_t>(kMaxFidelitySamples));
  flags.Uint("threads", &threads, "CPU threads (results do not depend on it)", false, 1,
             static_cast<uint64_t>(kMaxThreads));
  flags.Bool("bos", &bos,
             "start every sample with the bos token (as the trainer's windows do); histories "
             "count it");
  flags.Bool("json", &json, "print JSON (keys in docs/RESUME.md) instead of a table");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  auto cfg = LoadEngineConfig(config);
  if (!cfg.ok()) return Fail(cfg.status());
  FidelityOptions fo;
  fo.eval_tokens = static_cast<int64_t>(eval_tokens);
  fo.samples = static_cast<int64_t>(samples);
  if (!ParseLengths(histories_text, 0, kMaxFidelityHistoryTokens, &fo.histories) ||
      fo.histories.size() > kMaxFidelityHistories) {
    std::fprintf(stderr,
                 "kvtier-engine fidelity: --histories: 1..%zu comma-separated token counts, "
                 "each a multiple of %u up to %lld\n",
                 kMaxFidelityHistories, fo.unit_tokens,
                 static_cast<long long>(kMaxFidelityHistoryTokens));
    return 2;
  }
  if (!ParseLengths(replay_text, cfg->sliding_window, static_cast<int64_t>(kMaxTokensPerCall),
                    &fo.replay_tokens) ||
      fo.replay_tokens.size() > kMaxFidelityReplayLengths) {
    std::fprintf(stderr,
                 "kvtier-engine fidelity: --replay-tokens: 1..%zu comma-separated lengths "
                 "(tokens or kW)\n",
                 kMaxFidelityReplayLengths);
    return 2;
  }
  // Read only what the measurement uses: K x (max(h) + N) tokens, one byte each (one less per
  // sample with --bos).
  const int64_t sample_bytes = FidelitySampleTokens(fo) - (bos ? 1 : 0);
  const int64_t need = sample_bytes * fo.samples;
  std::ifstream in(prompt_file, std::ios::binary);
  if (!in) return Fail(Status::IOError("cannot open " + prompt_file));
  std::string text(static_cast<size_t>(need), '\0');
  in.read(text.data(), static_cast<std::streamsize>(need));
  if (in.bad()) return Fail(Status::IOError("cannot read " + prompt_file));
  text.resize(static_cast<size_t>(in.gcount()));
  auto tok =
      ByteTokenizer::Create(cfg->vocab_size, cfg->engram_pad_token_id, cfg->dspark_noise_token_id);
  if (!tok.ok()) return Fail(tok.status());
  std::vector<int32_t> tokens;
  for (int64_t at = 0; at < static_cast<int64_t>(text.size()); at += sample_bytes) {
    if (bos) tokens.push_back(ByteTokenizer::kBos);
    const std::vector<int32_t> ids = tok->Encode(
        std::string_view(text).substr(static_cast<size_t>(at), static_cast<size_t>(sample_bytes)));
    tokens.insert(tokens.end(), ids.begin(), ids.end());
  }
  // The options against the text and the config, before the weights load (usage errors).
  if (Status s = CheckFidelityOptions(*cfg, tokens.size(), fo); !s.ok()) {
    std::fprintf(stderr, "kvtier-engine %s (%s)\n", s.message().c_str(), prompt_file.c_str());
    return 2;
  }
  std::shared_ptr<const ModelWeights> weights;
  auto engine = Open(config, model, static_cast<int>(threads), &weights);
  if (!engine.ok()) return Fail(engine.status());
  const auto t0 = std::chrono::steady_clock::now();
  auto rep = MeasureFidelity(engine->get(), *weights, tokens, fo);
  if (!rep.ok()) return Fail(rep.status());
  const double seconds = Seconds(t0, std::chrono::steady_clock::now());
  if (json) {
    auto score = [](const FidelityScore& s) {
      nlohmann::ordered_json j;
      if (s.replay_tokens > 0) j["replay_tokens"] = s.replay_tokens;
      j["top1_agreement"] = s.top1_agreement;
      j["kl_mean"] = s.kl_mean;
      j["kl_max"] = s.kl_max;
      j["bits_per_byte"] = s.bits_per_byte;
      return j;
    };
    nlohmann::ordered_json j;
    j["model"] = model;
    j["prompt_file"] = prompt_file;
    j["tokens"] = rep->tokens;
    j["sliding_window"] = rep->sliding_window;
    j["unit_tokens"] = rep->unit_tokens;
    j["eval_tokens"] = rep->eval_tokens;
    j["samples"] = rep->samples;
    j["bos"] = bos;
    j["histories"] = nlohmann::ordered_json::array();
    for (const FidelityHistory& h : rep->histories) {
      nlohmann::ordered_json e;
      e["history"] = h.history;
      e["positions"] = h.positions;
      e["uninterrupted_bits_per_byte"] = h.uninterrupted_bits_per_byte;
      e["exact"] = score(h.exact);
      e["replay"] = nlohmann::ordered_json::array();
      for (const FidelityScore& s : h.replay) e["replay"].push_back(score(s));
      j["histories"].push_back(e);
    }
    j["units_imported"] = rep->units_imported;
    j["hot_states_imported"] = rep->hot_states_imported;
    j["replayed_tokens"] = rep->replayed_tokens;
    j["seconds"] = seconds;
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "%s on %s: W = %d; %lld sample(s) x %lld positions after each history (teacher-forced); "
      "KL in nats\n",
      model.c_str(), prompt_file.c_str(), rep->sliding_window, static_cast<long long>(rep->samples),
      static_cast<long long>(rep->eval_tokens));
  std::printf("%8s  %-15s %7s  %8s  %10s  %10s  %9s\n", "history", "path", "replay", "top-1",
              "KL mean", "KL max", "bits/byte");
  for (const FidelityHistory& h : rep->histories) {
    std::printf("%8lld  %-15s %7s  %8s  %10s  %10s  %9.3f\n", static_cast<long long>(h.history),
                "(a) uninterr.", "-", "-", "-", "-", h.uninterrupted_bits_per_byte);
    auto row = [&](const char* path, const FidelityScore& s) {
      const std::string r = s.replay_tokens > 0 ? std::to_string(s.replay_tokens) : "-";
      std::printf("%8lld  %-15s %7s  %8.4f  %10.3g  %10.3g  %9.3f\n",
                  static_cast<long long>(h.history), path, r.c_str(), s.top1_agreement, s.kl_mean,
                  s.kl_max, s.bits_per_byte);
    };
    row("(b) exact", h.exact);
    for (const FidelityScore& s : h.replay) row("(c) replay", s);
  }
  std::printf("%.1f s\n", seconds);
  return 0;
}

void PrintHelp(FILE* out) {
  std::fprintf(out,
               "usage: kvtier-engine <command> [flags]   (kvtier-engine <command> --help)\n\n"
               "  init       make deterministic weights for a config (safetensors)\n"
               "  generate   generate text from a prompt file (greedy or top-p sampling);\n"
               "             --save-socket saves the session's units to kvtierd\n"
               "  resume     resume a saved session from kvtierd and continue decoding\n"
               "  bench      prefill and decode tokens/s, prefill-to-decode cost ratio\n"
               "  fidelity   top-1 agreement and KL of exact restore and bounded replay vs\n"
               "             the uninterrupted session, on a text\n"
               "  serve      OpenAI-compatible HTTP server (docs/SERVING.md)\n");
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) {
  using namespace kvtier::engine;
  if (argc < 2) {
    PrintHelp(stderr);
    return 2;
  }
  std::string_view cmd = argv[1];
  std::vector<std::string_view> args(argv + 2, argv + argc);
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    PrintHelp(stdout);
    return 0;
  }
  if (cmd == "init") return RunInit(args);
  if (cmd == "generate") return RunGenerate(args);
  if (cmd == "resume") return RunResume(args);
  if (cmd == "bench") return RunBench(args);
  if (cmd == "fidelity") return RunFidelity(args);
  if (cmd == "serve") return kvtier::serving::RunServe(args);
  std::fprintf(stderr, "kvtier-engine: unknown command '%.*s'\n\n", static_cast<int>(cmd.size()),
               cmd.data());
  PrintHelp(stderr);
  return 2;
}
