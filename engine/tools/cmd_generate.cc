// kvtier-engine generate: text from a prompt file (CED or full prefill, then decode; greedy or
// top-p), optionally saved to kvtierd, with Engram rows from a daemon's row server, or with
// DSpark speculative decoding.
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "cli/flags.h"
#include "engine/config.h"
#include "engine/dspark.h"
#include "engine/engram_daemon.h"
#include "engine/model.h"
#include "engine/remote_engram.h"
#include "engine/sampler.h"
#include "engine/session.h"
#include "engine/speculative.h"
#include "engine/tokenizer.h"
#include "engine/tools/commands.h"
#include "engine/weights.h"

namespace kvtier::engine::tool {

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
  std::string layer_device;
  AddLayerDeviceFlag(&flags, &layer_device);
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
  LayerDevice device = LayerDevice::kCpu;
  if (!ResolveLayerDevice(layer_device, "generate", &device)) return 2;
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
  auto read = ReadFileBounded(prompt_file, kMaxPromptBytes);
  if (!read.ok() && !read.status().IsInvalidArgument()) return Fail(read.status());
  if (!read.ok() || read->empty()) {  // InvalidArgument: over kMaxPromptBytes
    std::fprintf(stderr, "kvtier-engine generate: the prompt must have 1..%llu bytes\n",
                 static_cast<unsigned long long>(kMaxPromptBytes));
    return 2;
  }
  const std::string text = std::move(*read);
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
  auto engine = Open(config, model, static_cast<int>(threads), &weights, engram_rows.get(), device);
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

}  // namespace kvtier::engine::tool
