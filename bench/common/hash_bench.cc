// Key hashing cost in ns/token at 64-token units, for the kvtier chain key and the two
// compatibility modes, each beside its physical limit: one raw OpenSSL SHA-256 per unit over
// exactly the bytes that mode hashes (precomputed preimages). The ratio mode/limit is the
// overhead of building the preimage and chaining; "bulk" is SHA-256 streaming over all token
// bytes with no per-unit finalisation (the floor for any per-unit SHA-256 scheme).
// ns/token is CPU time (the shared build machine is often loaded; wall time would measure the
// scheduler). The benchmark is single-threaded, so CPU time equals wall time on an idle core.
//
//   build/<dir>/bench/common/kvtier_bench_hash [--benchmark_min_time=0.5]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/key_spec.h"

namespace kvtier {
namespace {

constexpr size_t kUnitTokens = 64;
constexpr size_t kUnits = 256;
constexpr size_t kTokens = kUnitTokens * kUnits;  // a 16K-token context

const std::vector<uint32_t>& Tokens() {
  static const std::vector<uint32_t> tokens = [] {
    std::mt19937 rng(1);
    std::vector<uint32_t> t(kTokens);
    for (auto& x : t) x = rng() % 129280;  // the real vocabulary size
    return t;
  }();
  return tokens;
}

Digest Fingerprint() {
  Digest w;
  w.fill(0x11);
  return ModelFingerprint("bench-layout", w, "bench-tokenizer");
}

void SetTokens(benchmark::State& state) {
  state.counters["ns_per_token"] = benchmark::Counter(
      static_cast<double>(kTokens),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// Digests each precomputed preimage once: the limit for a mode.
void HashPreimages(benchmark::State& state, const std::vector<std::vector<uint8_t>>& preimages) {
  for (auto _ : state) {
    for (const auto& p : preimages) benchmark::DoNotOptimize(Sha256(p));
  }
  SetTokens(state);
}

void BM_KvtierChain(benchmark::State& state) {
  const Digest fp = Fingerprint();
  for (auto _ : state) benchmark::DoNotOptimize(ChainKeys(fp, Tokens(), kUnitTokens));
  SetTokens(state);
}

void BM_KvtierChainLimit(benchmark::State& state) {
  const Digest fp = Fingerprint();
  const std::vector<Digest> keys = ChainKeys(fp, Tokens(), kUnitTokens);
  std::vector<std::vector<uint8_t>> pre;
  for (size_t i = 0; i < kUnits; ++i) {
    pre.push_back(ChainPreimage(fp, i == 0 ? kRootParent : keys[i - 1],
                                std::span(Tokens()).subspan(i * kUnitTokens, kUnitTokens)));
  }
  HashPreimages(state, pre);
}

void BM_Sglang(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(SglangPageHashes(Tokens(), kUnitTokens));
  SetTokens(state);
}

void BM_SglangLimit(benchmark::State& state) {
  const std::vector<Digest> pages = SglangPageHashes(Tokens(), kUnitTokens);
  std::vector<std::vector<uint8_t>> pre;
  for (size_t i = 0; i < kUnits; ++i) {
    std::vector<uint8_t> p;
    if (i > 0) p.assign(pages[i - 1].begin(), pages[i - 1].end());
    const auto* b = reinterpret_cast<const uint8_t*>(Tokens().data() + i * kUnitTokens);
    p.insert(p.end(), b, b + 4 * kUnitTokens);  // little-endian host: the LE32 bytes
    pre.push_back(std::move(p));
  }
  HashPreimages(state, pre);
}

void BM_Vllm(benchmark::State& state) {
  const Digest none = VllmNoneHash("0");
  for (auto _ : state) {
    benchmark::DoNotOptimize(VllmBlockHashes(Tokens(), kUnitTokens, none, std::nullopt));
  }
  SetTokens(state);
}

void BM_VllmLimit(benchmark::State& state) {
  const Digest none = VllmNoneHash("0");
  const std::vector<Digest> blocks = VllmBlockHashes(Tokens(), kUnitTokens, none, std::nullopt);
  std::vector<std::vector<uint8_t>> pre;
  for (size_t i = 0; i < kUnits; ++i) {
    pre.push_back(VllmBlockPreimage(i == 0 ? none : blocks[i - 1],
                                    std::span(Tokens()).subspan(i * kUnitTokens, kUnitTokens),
                                    std::nullopt));
  }
  HashPreimages(state, pre);
}

void BM_Sha256Bulk(benchmark::State& state) {
  const auto* b = reinterpret_cast<const uint8_t*>(Tokens().data());
  const std::span<const uint8_t> all(b, 4 * kTokens);
  for (auto _ : state) benchmark::DoNotOptimize(Sha256(all));
  SetTokens(state);
}

BENCHMARK(BM_KvtierChain);
BENCHMARK(BM_KvtierChainLimit);
BENCHMARK(BM_Sglang);
BENCHMARK(BM_SglangLimit);
BENCHMARK(BM_Vllm);
BENCHMARK(BM_VllmLimit);
BENCHMARK(BM_Sha256Bulk);

// Console output plus a collected ns/token per benchmark for the ratio table.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.iterations > 0 && r.run_type == Run::RT_Iteration) {
        ns_per_token_[r.benchmark_name()] =
            r.cpu_accumulated_time * 1e9 / static_cast<double>(r.iterations) / kTokens;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
  void PrintRatios() const {
    std::printf("\nkey hashing at %zu-token units (%zu tokens per iteration), CPU ns/token:\n",
                kUnitTokens, kTokens);
    std::printf("  %-16s %10s %18s %8s\n", "mode", "ns/token", "SHA-256 limit", "ratio");
    const std::pair<const char*, const char*> rows[] = {
        {"BM_KvtierChain", "BM_KvtierChainLimit"},
        {"BM_Sglang", "BM_SglangLimit"},
        {"BM_Vllm", "BM_VllmLimit"},
    };
    for (const auto& [mode, limit] : rows) {
      auto m = ns_per_token_.find(mode);
      auto l = ns_per_token_.find(limit);
      if (m == ns_per_token_.end() || l == ns_per_token_.end()) continue;
      std::printf("  %-16s %10.2f %18.2f %7.2fx\n", mode + 3, m->second, l->second,
                  m->second / l->second);
    }
    if (auto b = ns_per_token_.find("BM_Sha256Bulk"); b != ns_per_token_.end()) {
      std::printf("  %-16s %10.2f  (one SHA-256 stream over all token bytes)\n", "Sha256Bulk",
                  b->second);
    }
  }

 private:
  std::map<std::string, double> ns_per_token_;
};

}  // namespace
}  // namespace kvtier

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvtier::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  benchmark::Shutdown();
  return 0;
}
