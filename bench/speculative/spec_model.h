// What the speculative-decoding benchmarks load (kvtier_spec_bench, kvtier_spec_engram_bench,
// kvtier_bench_draft): the backbone's config and weights, its DSpark config and draft, and the
// text their prompts are cut from.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "cli/flags.h"
#include "common/status.h"
#include "engine/config.h"
#include "engine/dspark.h"
#include "engine/weights.h"

namespace kvtier::engine {

// The most text a benchmark reads (the rest of a longer file is ignored).
inline constexpr size_t kSpecTextBytesMax = 64u << 20;

struct SpecModel {
  EngineConfig config;
  DSparkConfig dconfig;
  std::shared_ptr<const ModelWeights> weights;
  std::unique_ptr<DSpark> draft;
};

// Where they are: the model's config.json (its dspark_* keys too), the backbone's weights,
// the DSpark weights, the text.
struct SpecPaths {
  std::string config, model, draft, text;
};
// --config, --model, --draft and --text, all required.
void AddSpecPathFlags(cli::FlagSet* flags, SpecPaths* paths);

// The first error, naming its file.
StatusOr<SpecModel> LoadSpecModel(const SpecPaths& paths);

// The first kSpecTextBytesMax bytes of the file at path.
StatusOr<std::string> ReadSpecText(const std::string& path);

}  // namespace kvtier::engine
