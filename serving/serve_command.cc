#include "serving/serve_command.h"

#include <signal.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include "cli/flags.h"
#include "common/host_port.h"
#include "common/logging.h"
#include "common/malloc_tuning.h"
#include "common/open_files.h"
#include "engine/config.h"
#include "engine/dspark.h"
#include "engine/model.h"
#include "engine/session.h"
#include "engine/thread_pool.h"
#include "engine/tokenizer.h"
#include "engine/weights.h"
#include "serving/api_keys.h"
#include "serving/http_server.h"
#include "serving/metrics.h"
#include "serving/openai_server.h"
#include "serving/scheduler.h"

#ifndef KVTIER_SERVE_DEFAULT_MODEL_DIR
#define KVTIER_SERVE_DEFAULT_MODEL_DIR "deploy/models"
#endif

namespace kvtier::serving {
namespace {

int Fail(const Status& s) {
  std::fprintf(stderr, "kvtier-engine serve: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int RunServe(std::span<const std::string_view> args) {
  cli::FlagSet flags(
      "kvtier-engine serve",
      "Serve the model over an OpenAI-compatible HTTP API (POST /v1/chat/completions, POST "
      "/v1/completions, GET /v1/models, GET /metrics), many requests at once, resuming prompts "
      "from kvtierd and reporting exact cache-hit usage. See docs/SERVING.md.");
  const std::string dir = KVTIER_SERVE_DEFAULT_MODEL_DIR;
  std::string model = dir + "/kvmini-trained.safetensors";
  std::string config = dir + "/kvmini-trained.json";
  std::string model_id = "kvmini-trained", listen = "127.0.0.1", port_file, socket, token;
  std::string kvtierd_addr;
  std::string keys_file, guard = "auto", layer_device = "cpu";
  uint64_t port = 8000, threads = 1, replay_tokens = 0;
  bool no_hot = false, speculative = false, step_thread_replays = false;
  std::string draft_path;
  std::optional<uint64_t> draft_len;
  SchedulerOptions so;
  HttpOptions ho;
  ApiLimits al;
  flags.String("model", &model, "FILE", "weights (.safetensors); default: the trained miniature");
  flags.String("config", &config, "FILE", "model config.json");
  flags.String("model-id", &model_id, "NAME", "the model name clients send and /v1/models lists");
  flags.String("listen", &listen, "ADDR",
               "numeric address to listen on; a non-loopback address needs --api-keys");
  flags.Uint("port", &port, "TCP port; 0 = any free port (see --port-file)", false, 0, 65535);
  flags.String("port-file", &port_file, "FILE", "write the bound port here once listening");
  flags.String("socket", &socket, "PATH",
               "kvtierd Unix socket: resume prompts from it and save sessions to it "
               "(default: no cache; every prompt is computed and cached_tokens only counts "
               "sequences still resident in the engine)");
  flags.String("kvtierd", &kvtierd_addr, "HOST:PORT",
               "kvtierd's native TCP front (its server.native_port; [addr]:port for IPv6) "
               "instead of --socket: a kvtierd on another host, or any node of a kvtierd "
               "cluster. A host other than localhost or 127.x / ::1 needs --kvtierd-tls "
               "(kvtierd serves other hosts only over TLS)");
  flags.Bool("kvtierd-tls", &so.daemon.tls,
             "TLS to --kvtierd (kvtierd's [tls] native = true); its certificate chain is always "
             "verified");
  flags.String("kvtierd-ca", &so.daemon.tls_ca_file, "FILE",
               "CA certificates (PEM) that verify kvtierd's certificate (default: the system's "
               "trust store)");
  flags.String("kvtierd-server-name", &so.daemon.tls_server_name, "NAME",
               "the name kvtierd's certificate must carry (default: the --kvtierd host)");
  so.daemon.timeout_ms = 2000;
  flags.Uint("kvtierd-timeout-ms", &so.daemon.timeout_ms,
             "bound on each connect, handshake and call to kvtierd: the calls run on the "
             "server's kvtierd threads (the engine's steps never wait on them), so a stalled "
             "kvtierd holds the requests that restore or save through it for this long once, "
             "then the server serves without the cache until its next attempt",
             false, 10, 600000);
  flags.Uint("kvtierd-threads", &so.kvtierd_threads,
             "threads that make the server's kvtierd calls, one call each at a time: restores "
             "and saves of different requests run at once (each thread has its own kvtierd "
             "connection per tenant; one sequence's saves stay in order)",
             false, 1, serving::kCacheIoThreadsMax);
  flags.Uint("kvtierd-retry-max-ms", &so.daemon_retry_max_ms,
             "after a connect or call to kvtierd fails slowly (half a timeout or more: kvtierd "
             "stalled or cut off), requests are served without the cache (billed as misses, "
             "nothing saved) and kvtierd is tried again 1 s later, then at doubling intervals "
             "up to this; a failure that comes at once (kvtierd not running) is tried again at "
             "the next request",
             false, 100, 3600000);
  flags.String("token", &token, "TOKEN",
               "kvtierd token of the single tenant \"default\" when --api-keys is not given");
  flags.String("api-keys", &keys_file, "FILE",
               "JSON API keys file: key -> tenant, kvtierd token, prices, weight (the tenant's "
               "share of admission and of every step's tokens, 1..1000, default 1; "
               "docs/SERVING.md); without it no key is checked");
  flags.Uint("threads", &threads, "engine CPU threads (results do not depend on it)", false, 1,
             engine::kMaxThreads);
  flags.String("layer-device", &layer_device, "DEVICE",
               "where the engine's passes run every layer's arithmetic: cpu, cuda "
               "(the GPU keeps the step's activations and runs the mixes, norms, attention "
               "projections, the attention over the keys the CPU selects, and MoE; the caches "
               "(copied to the GPU as they grow), the compressor, the top-k and Engram stay on "
               "the CPU; logits within the CUDA math library's expf/log1pf of the CPU's) or "
               "host-twin (the GPU's kernels on the CPU: the CPU's bits, slower; for checks). "
               "If a call to the device fails, that step's requests fail and every later step "
               "runs on the CPU (metric kvtier_serve_layer_device_failed)");
  flags.String("guard", &guard, "MODE",
               "resume guard: auto (fetch or recompute, whichever is estimated cheaper), fetch, "
               "recompute");
  flags.Uint("replay-tokens", &replay_tokens,
             "bounded replay length of a resume without hot state; 0 = 2 sliding windows");
  flags.Bool("no-hot-state", &no_hot, "do not keep SWA hot states in kvtierd at page boundaries");
  flags.Bool("replays-on-step-thread", &step_thread_replays,
             "complete restores (the bounded replay of one without a hot state) on the engine's "
             "step thread, one that replays per step while others run, instead of on the "
             "kvtierd threads (each of which then holds a one-thread CPU engine of its own, "
             "over the same weights); implied by --layer-device cuda");
  flags.Bool("speculative", &speculative,
             "DSpark speculative decoding: the decode rows of every step are verified drafts "
             "(greedy output unchanged; docs/SERVING.md, \"Speculative decoding\")");
  flags.String("draft", &draft_path, "FILE",
               "DSpark draft weights for --speculative (default: the model path with "
               "-dspark.safetensors)");
  flags.OptionalUint("draft-len", &draft_len,
                     "fixed draft tokens verified per sequence with --speculative, "
                     "0..dspark_block_size",
                     "the load-aware draft scheduler chooses each step");
  flags.Uint("queue-depth-max", &so.queue_depth_max, "requests waiting for admission (more: 429)",
             false, 1, 1 << 20);
  flags.Uint("active-sequences-max", &so.active_sequences_max, "sequences generating at once",
             false, 1, 4096);
  flags.Uint("kv-pool-tokens-max", &so.kv_pool_tokens_max,
             "tokens the KV pool holds (active reservations + idle sequences)", false, 2,
             uint64_t{1} << 26);
  flags.Uint("idle-sequences-max", &so.idle_sequences_max,
             "finished sequences kept resident for their next turn; 0 = drop at once", false, 0,
             1 << 20);
  flags.Uint("context-tokens-max", &so.context_tokens_max,
             "prompt + completion tokens of one sequence (at most the KV pool)", false, 2,
             engine::kMaxSessionTokens);
  flags.Uint("step-tokens-max", &so.step_tokens_max,
             "tokens one engine step runs: decode tokens plus prefill chunks", false, 1,
             engine::kMaxTokensPerCall);
  flags.Uint("prefill-chunk-tokens", &so.prefill_chunk_tokens,
             "largest prefill chunk of one prompt in one step", false, 1,
             engine::kMaxTokensPerCall);
  flags.Uint("max-tokens-max", &al.max_tokens_max,
             "largest max_tokens a request may ask for; also what one without max_tokens gets "
             "(or the context left, if less)",
             false, 1, 1 << 20);
  flags.Uint("connections-max", &ho.connections_max, "open HTTP connections", false, 1, 65536);
  flags.Uint("header-bytes-max", &ho.header_bytes_max, "HTTP request header bytes (431 over)",
             false, 1024, 1 << 20);
  flags.Uint("body-bytes-max", &ho.body_bytes_max, "HTTP request body bytes (413 over)", false,
             1024, 64 << 20);
  flags.Uint("idle-timeout-ms", &ho.idle_timeout_ms,
             "close a connection whose next request has not arrived in full this long (bytes "
             "trickling in do not extend it), or whose reply makes no progress this long",
             false, 10, 3600000);
  flags.Uint("send-buffer-bytes", &ho.send_buffer_bytes,
             "kernel send buffer per connection (SO_SNDBUF): what a client that reads nothing "
             "leaves queued; 0 = the kernel's, growing to tcp_wmem's maximum",
             false, 0, kSendBufferBytesMax);
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  engine::LayerDevice device = engine::LayerDevice::kCpu;
  if (!engine::ParseLayerDevice(layer_device, &device)) {
    std::fprintf(stderr, "kvtier-engine serve: --layer-device is cpu, cuda or host-twin\n");
    return 2;
  }
  if (guard == "auto") {
    so.session.guard = engine::GuardMode::kAuto;
  } else if (guard == "fetch") {
    so.session.guard = engine::GuardMode::kAlwaysFetch;
  } else if (guard == "recompute") {
    so.session.guard = engine::GuardMode::kAlwaysRecompute;
  } else {
    std::fprintf(stderr, "kvtier-engine serve: --guard must be auto, fetch or recompute\n");
    return 2;
  }
  if (keys_file.empty() && !IsLoopbackAddress(listen)) {
    std::fprintf(stderr,
                 "kvtier-engine serve: --listen %s is not a loopback address: give --api-keys\n",
                 listen.c_str());
    return 2;
  }
  if (!socket.empty() && !kvtierd_addr.empty()) {
    std::fprintf(stderr, "kvtier-engine serve: give --socket or --kvtierd, not both\n");
    return 2;
  }
  if (kvtierd_addr.empty() &&
      (so.daemon.tls || !so.daemon.tls_ca_file.empty() || !so.daemon.tls_server_name.empty())) {
    std::fprintf(stderr,
                 "kvtier-engine serve: --kvtierd-tls, --kvtierd-ca and --kvtierd-server-name "
                 "need --kvtierd\n");
    return 2;
  }
  if (!kvtierd_addr.empty()) {
    StatusOr<HostPort> hp = ParseHostPort(kvtierd_addr);
    if (!hp.ok()) {
      std::fprintf(stderr, "kvtier-engine serve: --kvtierd: %s\n", hp.status().message().c_str());
      return 2;
    }
    if (!so.daemon.tls && !IsLoopbackAddress(hp->host)) {
      std::fprintf(stderr,
                   "kvtier-engine serve: --kvtierd %s is not a loopback address: give "
                   "--kvtierd-tls (kvtierd serves other hosts only over TLS)\n",
                   kvtierd_addr.c_str());
      return 2;
    }
    if (!so.daemon.tls && (!so.daemon.tls_ca_file.empty() || !so.daemon.tls_server_name.empty())) {
      std::fprintf(stderr,
                   "kvtier-engine serve: --kvtierd-ca and --kvtierd-server-name need "
                   "--kvtierd-tls\n");
      return 2;
    }
    so.daemon.tcp_host = hp->host;
    so.daemon.tcp_port = hp->port;
  }
  so.daemon.socket_path = socket;
  so.session.keep_hot_state = !no_hot;
  so.session.use_hot_state = !no_hot;
  so.session.replay_tokens = replay_tokens;
  ho.listen_host = listen;
  ho.port = static_cast<uint16_t>(port);

  ApiKeys keys = ApiKeys::Open(token);
  if (!keys_file.empty()) {
    auto k = ApiKeys::Load(keys_file);
    if (!k.ok()) return Fail(k.status());
    keys = std::move(k).value();
  }
  auto cfg = engine::LoadEngineConfig(config);
  if (!cfg.ok()) return Fail(cfg.status());
  auto w = engine::LoadWeights(*cfg, model);
  if (!w.ok()) return Fail(w.status());
  auto weights = std::make_shared<const engine::ModelWeights>(std::move(w).value());
  engine::EngineOptions eo;
  eo.threads = static_cast<int>(threads);
  eo.layer_device = device;
  eo.prefill_chunk_tokens = static_cast<int>(so.prefill_chunk_tokens);  // ForwardBatch's span cap
  auto eng = engine::Engine::Create(*cfg, weights, eo);
  if (!eng.ok()) return Fail(eng.status());
  // Restores completed on the kvtierd threads, each on an engine of its own that computes the
  // step engine's bits: the CPU path (the host twin's bits too), one thread. A CUDA engine's
  // are not the CPU's: its restores stay on the step thread (on the GPU).
  if (!step_thread_replays && device != engine::LayerDevice::kCuda) {
    so.replay_engine = [cfg = *cfg, weights, eo] {
      engine::EngineOptions ro = eo;
      ro.threads = 1;
      ro.layer_device = engine::LayerDevice::kCpu;
      ro.device_backend = nullptr;
      return engine::Engine::Create(cfg, weights, ro);
    };
  }
  auto tok = engine::ByteTokenizer::Create(cfg->vocab_size, cfg->engram_pad_token_id,
                                           cfg->dspark_noise_token_id);
  if (!tok.ok()) return Fail(tok.status());
  std::unique_ptr<engine::DSpark> draft;
  if (speculative) {
    if (draft_path.empty()) draft_path = engine::DefaultDraftPath(model);
    auto dc = engine::LoadDSparkConfig(config, *cfg);
    if (!dc.ok()) return Fail(dc.status());
    if (draft_len && *draft_len > static_cast<uint64_t>(dc->block_size)) {
      std::fprintf(stderr, "kvtier-engine serve: --draft-len in [0, %d]\n", dc->block_size);
      return 2;
    }
    auto d = engine::DSpark::Load(*cfg, *dc, weights, draft_path);
    if (!d.ok()) return Fail(d.status());
    draft = std::move(d).value();
    so.draft = draft.get();
    if (draft_len) so.draft_len = static_cast<int>(*draft_len);
  } else if (!draft_path.empty() || draft_len) {
    std::fprintf(stderr, "kvtier-engine serve: --draft and --draft-len need --speculative\n");
    return 2;
  }

  // SIGINT / SIGTERM are taken by sigwait below; block them before any thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  const OpenFilesLimit files_limit = RaiseOpenFilesLimit();
  // Restores receive megabytes per request: keep freed memory for reuse (common/malloc_tuning.h).
  if (!TuneMallocForServer()) {
    KVTIER_LOG(kInfo) << "serve: malloc left as it was (GLIBC_TUNABLES sets malloc tunables, or "
                         "the allocator is a sanitizer's, or mallopt refused)";
  }
  ServingMetrics metrics;
  auto sched = Scheduler::Create(eng->get(), *weights, so, &metrics);
  if (!sched.ok()) return Fail(sched.status());
  OpenAiFrontend front(model_id, *tok, sched->get(), &keys, &metrics, al);
  auto server = HttpServer::Start(
      ho, [&](const HttpRequest& r, HttpResponder* out) { front.Handle(r, out); }, &metrics);
  if (!server.ok()) return Fail(server.status());
  // At the limit the front pauses its accepts (common/accept_backoff.h): say so at start.
  WarnIfOpenFilesShort(files_limit, ho.connections_max, "kvtier_serve_accept_waits_total",
                       "lower --connections-max");
  const std::string cache = !socket.empty()        ? socket
                            : kvtierd_addr.empty() ? std::string("off")
                            : so.daemon.tls        ? "tls://" + kvtierd_addr
                                                   : "tcp://" + kvtierd_addr;
  std::fprintf(stderr,
               "kvtier-engine serve: listening on http://%s:%u model %s (%s), cache %s, "
               "replays on the %s, auth %s, speculative %s, experts %s, projections %s\n",
               listen.c_str(), (*server)->port(), model_id.c_str(), model.c_str(), cache.c_str(),
               so.replay_engine ? "kvtierd threads" : "step thread",
               keys.auth_enabled() ? "on" : "off", speculative ? draft_path.c_str() : "off",
               std::string(engine::ExpertFormatName(cfg->expert_format)).c_str(),
               std::string(engine::WeightFormatName(cfg->weight_format)).c_str());
  if (!port_file.empty()) {
    std::ofstream(port_file + ".tmp") << (*server)->port() << "\n";
    std::rename((port_file + ".tmp").c_str(), port_file.c_str());
  }
  int sig = 0;
  sigwait(&sigs, &sig);
  std::fprintf(stderr, "kvtier-engine serve: signal %d, stopping\n", sig);
  (*sched)->Stop();
  (*server)->Stop();
  return 0;
}

}  // namespace kvtier::serving
