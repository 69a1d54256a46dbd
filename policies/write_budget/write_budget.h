// write-budget admission (CacheLib Navy's bytes/day write-rate limit, made deterministic):
// admits while the bytes admitted in the current window stay within `bytes_per_day`, and
// refuses beyond it. The budget refills in full at each window boundary (window index =
// now_us / window_ms; default window 24 h). Protects SSD endurance: the device writes at most
// bytes_per_day per day whatever the miss rate. Admit() charges size_bytes when it says yes.
// Bytes carried over from a policy it replaced (CarryOver) may exceed bytes_per_day: nothing
// more is admitted until the next window.
//
// Parameters: bytes_per_day (default 1 TiB), window_ms (86400000).
// Thread safety: none (see policy.h).
#pragma once

#include "policies/policy.h"

namespace kvtier::policies {

struct WriteBudgetOptions {
  uint64_t bytes_per_day = 1ull << 40;
  uint64_t window_ms = 24ull * 3600 * 1000;
};

class WriteBudgetPolicy final : public AdmissionPolicy {
 public:
  explicit WriteBudgetPolicy(const WriteBudgetOptions& options = {}) : options_(options) {}
  static StatusOr<std::unique_ptr<AdmissionPolicy>> Make(const PolicyParams& params);

  std::string_view Name() const override { return "write-budget"; }
  bool Admit(const ObjectInfo& info, uint64_t now_us) override;
  std::optional<ByteBudget> Budget(uint64_t now_us) const override;
  // Takes over the bytes `previous` spent in its current window (when it has a budget), as
  // spent in this policy's current window: a new cap or window does not refill the budget.
  void CarryOver(const AdmissionPolicy& previous, uint64_t now_us) override;

  // Bytes admitted so far in the current window.
  uint64_t SpentBytes() const { return spent_bytes_; }

 private:
  WriteBudgetOptions options_;
  uint64_t window_ = 0;
  uint64_t spent_bytes_ = 0;
};

}  // namespace kvtier::policies
