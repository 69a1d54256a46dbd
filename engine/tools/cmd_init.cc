// kvtier-engine init: deterministic weights for a model config, written as safetensors.
#include <cstdio>
#include <string>

#include "cli/flags.h"
#include "engine/config.h"
#include "engine/tools/commands.h"
#include "engine/weights.h"

namespace kvtier::engine::tool {

int RunInit(Args args) {
  cli::FlagSet flags(
      "kvtier-engine init",
      "Make deterministic weights for a model config and write them as safetensors\n"
      "(at most 4 GiB of them: kInitWeightsBytesMax, engine/weights.h).");
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

}  // namespace kvtier::engine::tool
