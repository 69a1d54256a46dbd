// kvtier-engine fidelity: how closely exact restore and bounded replay continue the
// uninterrupted session on a text (top-1 agreement, KL, bits per byte).
#include <charconv>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "cli/flags.h"
#include "common/json_text.h"
#include "engine/config.h"
#include "engine/fidelity.h"
#include "engine/model.h"
#include "engine/tokenizer.h"
#include "engine/tools/commands.h"
#include "engine/weights.h"

namespace kvtier::engine::tool {
namespace {

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

}  // namespace

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
    std::printf("%s\n", JsonText(j, 2).c_str());
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

}  // namespace kvtier::engine::tool
