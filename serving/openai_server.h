// OpenAiFrontend: the routes of `kvtier-engine serve` (docs/SERVING.md, "API").
//
//   POST /v1/chat/completions, POST /v1/completions   generation (stream or not)
//   GET  /v1/models                                    the one model served
//   GET  /metrics                                      Prometheus text (no key needed)
//   GET  /health                                       "ok"
// Every /v1 route needs a known API key when keys are configured (401 otherwise). A
// streamed response is server-sent events: chunks, then (stream_options.include_usage) a
// chunk with the usage and empty choices, then "data: [DONE]". A client that goes away
// cancels its request (the scheduler frees its sequence at the next step).
//
// Thread safety: Handle runs on many connection threads at once.
#pragma once

#include <atomic>
#include <string>

#include "engine/tokenizer.h"
#include "serving/api_keys.h"
#include "serving/http_server.h"
#include "serving/metrics.h"
#include "serving/openai_api.h"
#include "serving/scheduler.h"

namespace kvtier::serving {

class OpenAiFrontend {
 public:
  // Not owned: scheduler, keys, metrics; they outlive the frontend.
  OpenAiFrontend(std::string model_id, engine::ByteTokenizer tokenizer, Scheduler* scheduler,
                 const ApiKeys* keys, ServingMetrics* metrics, ApiLimits limits);
  void Handle(const HttpRequest& request, HttpResponder* out);

 private:
  void Generate(const HttpRequest& request, bool chat, const Tenant* tenant, HttpResponder* out);
  std::string NewId(bool chat);

  std::string model_id_;
  engine::ByteTokenizer tokenizer_;
  Scheduler* scheduler_;
  const ApiKeys* keys_;
  ServingMetrics* metrics_;
  ApiLimits limits_;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> seed_counter_{0x5eed};
};

}  // namespace kvtier::serving
