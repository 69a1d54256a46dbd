// kvtier-engine resume: resume a saved session from kvtierd and continue decoding greedily.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/flags.h"
#include "common/json_text.h"
#include "engine/config.h"
#include "engine/model.h"
#include "engine/session.h"
#include "engine/tokenizer.h"
#include "engine/tools/commands.h"
#include "engine/weights.h"

namespace kvtier::engine::tool {

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
  std::string layer_device;
  AddLayerDeviceFlag(&flags, &layer_device);
  flags.String("guard", &guard, "MODE", "auto | fetch | recompute");
  flags.Bool("no-hot-state", &no_hot, "ignore a hot state in the DRAM pool (always replay)");
  uint64_t replay_tokens = 0;
  flags.Uint("replay-tokens", &replay_tokens,
             "tokens replayed to rebuild the SWA rings without a hot state, >= the sliding "
             "window W; 0 = the default (kDefaultReplayWindows x W)");
  flags.Bool("json", &json, "print the resume report and stats as JSON");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  LayerDevice device = LayerDevice::kCpu;
  if (!ResolveLayerDevice(layer_device, "resume", &device)) return 2;
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
  auto engine = Open(config, model, static_cast<int>(threads), &weights, nullptr, device);
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
    auto text = ReadFileBounded(prompt_file, kMaxPromptBytes);
    if (!text.ok()) {
      return Fail(text.status().IsInvalidArgument()
                      ? Status::InvalidArgument("prompt too long: " + text.status().message())
                      : text.status());
    }
    tokens = tok->Encode(*text);
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
    std::printf("%s\n", JsonText(j, 2).c_str());
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

}  // namespace kvtier::engine::tool
