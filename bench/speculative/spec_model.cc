#include "bench/speculative/spec_model.h"

#include <fstream>
#include <utility>

namespace kvtier::engine {

StatusOr<SpecModel> LoadSpecModel(const std::string& config, const std::string& model,
                                  const std::string& draft) {
  SpecModel m;
  KVTIER_ASSIGN_OR_RETURN(m.config, LoadEngineConfig(config));
  KVTIER_ASSIGN_OR_RETURN(m.dconfig, LoadDSparkConfig(config, m.config));
  KVTIER_ASSIGN_OR_RETURN(ModelWeights w, LoadWeights(m.config, model));
  m.weights = std::make_shared<const ModelWeights>(std::move(w));
  KVTIER_ASSIGN_OR_RETURN(m.draft, DSpark::Load(m.config, m.dconfig, m.weights, draft));
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
