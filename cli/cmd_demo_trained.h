// `kvtier demo`'s trained miniature (cmd_demo_trained.cc): loading it, and the demo's last part.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "engine/config.h"
#include "engine/weights.h"

namespace kvtier::cli {

// A model config and its weights, shared by the engines made from them.
struct DemoModel {
  engine::EngineConfig config;
  std::shared_ptr<const engine::ModelWeights> weights;
};

// Reads `<prefix>.json` (at most 1 MiB) and `<prefix>.safetensors` (checked against the config's
// tensor specs by engine::LoadWeights). Errors name the file that failed.
StatusOr<DemoModel> LoadDemoModel(const std::string& prefix);

// The demo's last part on `model` (loaded from `prefix`, which the output names): a few lines of
// sampled text from a fixed prompt, and the fidelity line (exact restore and bounded replay at the
// default replay length vs the uninterrupted session, teacher-forced on a fixed text).
Status RunTrainedModelDemo(const DemoModel& model, const std::string& prefix, int threads);

}  // namespace kvtier::cli
