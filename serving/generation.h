// A request in flight as its HTTP connection and the engine's scheduler share it, and the tenant
// it is served for (docs/SERVING.md).
//
// Thread safety: Generation's methods may be called from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>

#include "serving/openai_api.h"
#include "serving/usage.h"

namespace kvtier::serving {

// A customer: an API key maps to one (docs/SERVING.md, "API keys").
struct Tenant {
  std::string name;          // appears in logs and metric labels
  std::string daemon_token;  // kvtierd token: the daemon keeps each tenant's units apart
  Prices prices;
  // Share of admission and of every step's tokens against the other tenants with work
  // (1..kTenantWeightMax; fair_share.h).
  uint32_t weight = 1;
};

struct GenerationEvent {
  enum class Kind { kText, kDone, kError };
  Kind kind = Kind::kText;
  std::string text;           // kText: the next piece of output
  std::string finish_reason;  // kDone: stop | length
  uint64_t step = 0;          // the scheduler step that produced it (kText, kDone)
  Usage usage;                // kDone
  double cost = 0;            // kDone: at the tenant's prices
  ApiError error;             // kError
};

// One request in flight, shared by its HTTP connection and the scheduler.
class Generation {
 public:
  // Waits up to timeout_ms for the next event; false on timeout. After kDone or kError no
  // further event comes.
  bool Next(GenerationEvent* event, int timeout_ms);
  // The client went away: the scheduler drops the request at its next step.
  void Cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  // The scheduler step at whose start the request was admitted; 0 before admission.
  uint64_t admitted_step() const { return admitted_step_.load(); }

 private:
  friend class Scheduler;
  friend class CacheIo;  // pushes a finished request's last event once its turn is saved
  void Push(GenerationEvent event);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenerationEvent> events_;
  std::atomic<bool> cancelled_{false};
  std::atomic<uint64_t> admitted_step_{0};
};

}  // namespace kvtier::serving
