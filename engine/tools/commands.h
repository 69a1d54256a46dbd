// Private to the kvtier-engine binary (engine/tools/): its subcommands, one cmd_<name>.cc each
// (kvtier_engine_main.cc dispatches to them), and what they share (commands_common.cc). Each
// Run* takes the arguments after the subcommand name and returns the process exit code:
// 0 success, 1 failure, 2 bad usage.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cache_daemon/client.h"
#include "cli/flags.h"
#include "common/config.h"
#include "common/status.h"
#include "engine/engram.h"
#include "engine/model.h"
#include "engine/session.h"
#include "engine/weights.h"

namespace kvtier::engine::tool {

using Args = std::span<const std::string_view>;

// Limits on what the command line may ask for.
constexpr uint64_t kMaxNewTokensLimit = 1 << 16;
constexpr uint64_t kMaxPromptBytes = 1 << 20;
constexpr uint64_t kMaxBenchTokens = 1 << 14;

int RunInit(Args args);      // cmd_init.cc
int RunGenerate(Args args);  // cmd_generate.cc
int RunResume(Args args);    // cmd_resume.cc
int RunBench(Args args);     // cmd_bench.cc
int RunFidelity(Args args);  // cmd_fidelity.cc

// ---- Shared by the subcommands (commands_common.cc) ----

// --layer-device DEVICE (EngineOptions::layer_device) into *value ("cpu" by default).
void AddLayerDeviceFlag(cli::FlagSet* flags, std::string* value);
// *device from a --layer-device value; false (after a message naming `command` on stderr) for
// anything but cpu, cuda or host-twin.
bool ResolveLayerDevice(const std::string& value, const char* command, LayerDevice* device);

// Prints "kvtier-engine: <s>" to stderr; returns 1 (the failure exit code).
int Fail(const Status& s);

// Seconds from a to b.
double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b);

// An engine over the model config at config_path and the weights at model_path, on `threads`
// CPU threads; *weights_out (when given) shares the loaded weights; engram_rows (when given)
// serves the Engram rows instead of the weights' own tables; layer_device: where its passes'
// layers run (EngineOptions::layer_device).
StatusOr<std::unique_ptr<Engine>> Open(const std::string& config_path,
                                       const std::string& model_path, int threads,
                                       std::shared_ptr<const ModelWeights>* weights_out = nullptr,
                                       EngramRowSource* engram_rows = nullptr,
                                       LayerDevice layer_device = LayerDevice::kCpu);

// A session store over a kvtierd Unix socket (the engine talks to the daemon only through
// the client library).
struct Saver {
  std::unique_ptr<daemon::Client> client;
  std::unique_ptr<SessionStore> store;
};

// Connects to kvtierd at the Unix socket `socket` (auth token `token`) and opens a session
// store there for `engine` with these weights.
StatusOr<Saver> ConnectStore(Engine* engine, const ModelWeights& weights, const std::string& socket,
                             const std::string& token, const SessionOptions& options);

// A token id file (generate --tokens-out, resume --tokens-file): ids separated by spaces.
Status WriteIds(const std::string& path, std::span<const int32_t> ids);
StatusOr<std::vector<int32_t>> ReadIds(const std::string& path);

}  // namespace kvtier::engine::tool
