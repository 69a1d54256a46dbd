#include "bench/speculative/spec_model.h"

#include <fstream>
#include <utility>

namespace kvtier::engine {

void AddSpecPathFlags(cli::FlagSet* flags, SpecPaths* paths) {
  flags->String("config", &paths->config, "FILE", "model config.json", true);
  flags->String("model", &paths->model, "FILE", "backbone weights", true);
  flags->String("draft", &paths->draft, "FILE", "DSpark weights", true);
  flags->String("text", &paths->text, "FILE",
                "text to cut prompts from (e.g. build/corpus/val.txt)", true);
}

StatusOr<SpecModel> LoadSpecModel(const SpecPaths& paths) {
  SpecModel m;
  KVTIER_ASSIGN_OR_RETURN(m.config, LoadEngineConfig(paths.config));
  KVTIER_ASSIGN_OR_RETURN(m.dconfig, LoadDSparkConfig(paths.config, m.config));
  KVTIER_ASSIGN_OR_RETURN(ModelWeights w, LoadWeights(m.config, paths.model));
  m.weights = std::make_shared<const ModelWeights>(std::move(w));
  KVTIER_ASSIGN_OR_RETURN(m.draft, DSpark::Load(m.config, m.dconfig, m.weights, paths.draft));
  return m;
}

StatusOr<std::string> ReadSpecText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError("cannot open " + path);
  std::string text(kSpecTextBytesMax, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return Status::IOError("cannot read " + path);
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

}  // namespace kvtier::engine
