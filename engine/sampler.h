// Token sampling for generation: greedy (temperature 0) or temperature + top-p (nucleus)
// with a seeded, platform-independent RNG (splitmix64), so a fixed seed gives the same
// tokens on every machine and thread count.
// Thread safety: a Sampler is used by one thread.
#pragma once

#include <cstdint>
#include <vector>

namespace kvtier::engine {

class Sampler {
 public:
  // temperature <= 0: greedy (argmax, ties to the lowest id). top_p in (0, 1].
  Sampler(double temperature, double top_p, uint64_t seed)
      : temperature_(temperature), top_p_(top_p), state_(seed) {}
  int32_t Sample(const std::vector<float>& logits);

 private:
  double NextUniform();  // [0, 1)
  double temperature_;
  double top_p_;
  uint64_t state_;
};

}  // namespace kvtier::engine
