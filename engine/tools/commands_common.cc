// What the kvtier-engine subcommands share (commands.h): the failure message, opening the
// engine, the session store over kvtierd, token id files.
#include <chrono>
#include <climits>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cache_daemon/client.h"
#include "engine/config.h"
#include "engine/model.h"
#include "engine/session.h"
#include "engine/tools/commands.h"
#include "engine/weights.h"

namespace kvtier::engine::tool {

void AddLayerDeviceFlag(cli::FlagSet* flags, std::string* value) {
  *value = "cpu";
  flags->String("layer-device", value, "DEVICE",
                "where the passes' layers run: cpu, cuda (the GPU keeps each pass's "
                "activations and runs the mixes, norms, attention projections, the attention "
                "over the keys the CPU selects, and MoE; the caches (copied to the GPU as they "
                "grow), the compressor, the top-k and Engram stay on the CPU) or host-twin (the "
                "GPU's kernels on the CPU: the CPU's bits, slower); docs/ENGINE.md, \"Device "
                "layers\"");
}

bool ResolveLayerDevice(const std::string& value, const char* command, LayerDevice* device) {
  if (ParseLayerDevice(value, device)) return true;
  std::fprintf(stderr, "kvtier-engine %s: --layer-device is cpu, cuda or host-twin, not '%s'\n",
               command, value.c_str());
  return false;
}

int Fail(const Status& s) {
  std::fprintf(stderr, "kvtier-engine: %s\n", s.ToString().c_str());
  return 1;
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

StatusOr<std::unique_ptr<Engine>> Open(const std::string& config_path,
                                       const std::string& model_path, int threads,
                                       std::shared_ptr<const ModelWeights>* weights_out,
                                       EngramRowSource* engram_rows, LayerDevice layer_device) {
  KVTIER_ASSIGN_OR_RETURN(EngineConfig cfg, LoadEngineConfig(config_path));
  KVTIER_ASSIGN_OR_RETURN(ModelWeights w, LoadWeights(cfg, model_path));
  EngineOptions o;
  o.threads = threads;
  o.engram_rows = engram_rows;
  o.layer_device = layer_device;
  auto shared = std::make_shared<const ModelWeights>(std::move(w));
  if (weights_out != nullptr) *weights_out = shared;
  return Engine::Create(cfg, shared, o);
}

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

}  // namespace kvtier::engine::tool
