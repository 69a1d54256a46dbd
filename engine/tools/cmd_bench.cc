// kvtier-engine bench: prefill (CED and full) and decode throughput, the prefill-to-decode cost
// per token, and KV bytes per cached token.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli/flags.h"
#include "common/json_text.h"
#include "engine/model.h"
#include "engine/tools/commands.h"

namespace kvtier::engine::tool {

int RunBench(Args args) {
  cli::FlagSet flags("kvtier-engine bench",
                     "Prefill and decode throughput, and the prefill-to-decode cost per token.");
  std::string model, config, layer_device = "cpu";
  uint64_t prompt_tokens = 256, decode_tokens = 32, threads = 2;
  bool json = false;
  flags.String("model", &model, "FILE", "weights (.safetensors)", true);
  flags.String("config", &config, "FILE", "model config.json", true);
  flags.Uint("prompt-tokens", &prompt_tokens, "prompt length");
  flags.Uint("decode-tokens", &decode_tokens, "tokens to decode");
  flags.Uint("threads", &threads, "CPU threads");
  AddLayerDeviceFlag(&flags, &layer_device);
  flags.Bool("json", &json, "print JSON");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (prompt_tokens == 0 || prompt_tokens > kMaxBenchTokens || decode_tokens == 0 ||
      decode_tokens > kMaxBenchTokens || threads == 0 || threads > kMaxThreads) {
    std::fprintf(stderr, "kvtier-engine bench: token counts in [1,%llu], threads in [1,%d]\n",
                 static_cast<unsigned long long>(kMaxBenchTokens), kMaxThreads);
    return 2;
  }
  LayerDevice device = LayerDevice::kCpu;
  if (!ResolveLayerDevice(layer_device, "bench", &device)) return 2;
  auto engine = Open(config, model, static_cast<int>(threads), nullptr, nullptr, device);
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
    j["layer_device"] = LayerDeviceName(device);
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
    std::printf("%s\n", JsonText(j, 2).c_str());
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

}  // namespace kvtier::engine::tool
