// Token sampling for generation: greedy (temperature 0) or temperature + top-p (nucleus)
// with a seeded, platform-independent RNG (splitmix64), so a fixed seed gives the same
// tokens on every machine and thread count.
// Thread safety: a Sampler is used by one thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kvtier::engine {

class Sampler {
 public:
  // temperature <= 0: greedy (argmax, ties to the lowest id). top_p in (0, 1].
  Sampler(double temperature, double top_p, uint64_t seed)
      : temperature_(temperature), top_p_(top_p), state_(seed) {}
  int32_t Sample(std::span<const float> logits);
  // The distribution Sample draws from (speculative verification, engine/speculative.h):
  // greedy: one-hot at the argmax; otherwise softmax(logits / temperature) restricted to the
  // top-p nucleus (same order and cut as Sample) and renormalised.
  std::vector<double> Probabilities(std::span<const float> logits) const;
  // A draw from `p` (non-negative, any positive sum); the last positive id when rounding runs
  // past the end. -1 when p has no positive entry.
  int32_t SampleFrom(const std::vector<double>& p);
  bool greedy() const { return temperature_ <= 0; }
  double temperature() const { return temperature_; }
  double NextUniform();  // [0, 1), advances the seeded stream

 private:
  // Non-greedy: p[i] = exp((logits[i] - max) / temperature) and the ids by descending p
  // (stable); returns how many of them the top-p nucleus keeps (at least 1). n > 0.
  int Nucleus(std::span<const float> logits, std::vector<double>* p,
              std::vector<int32_t>* order) const;

  double temperature_;
  double top_p_;
  uint64_t state_;
};

}  // namespace kvtier::engine
