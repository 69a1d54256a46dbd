// Quantise / dequantise throughput of every CPU backend beside memcpy of the same byte count,
// in the same process. Throughput is input bytes per second (fp32 bytes for Quantize, code +
// scale bytes for Dequantize). After the Google Benchmark table, a summary prints each kernel's
// GB/s, memcpy's GB/s for the same bytes and their ratio (kernel / memcpy; 1.0 = as fast as
// copying the input once).
//
//   build/<dir>/bench/kernels/kvtier_bench_kernels [--benchmark_filter=...]
//   [--benchmark_min_time=s]
//
// Backend::kCuda is not benchmarked here (it includes host<->device copies; no GPU on the
// project machine).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/quant.h"

namespace kvtier::kernels {
namespace {

// 2^21 floats = 8 MiB of input: well above L2, inside this machine's 32 MiB L3.
constexpr size_t kElems = size_t{1} << 21;
constexpr size_t kRowElems = 512;  // one model entry (head_dim 512)

struct Format {
  QuantFormat fmt;
  const char* name;
};
constexpr Format kFormats[] = {{QuantFormat::kFp4E4M3x16, "fp4_e4m3x16"},
                               {QuantFormat::kFp4Ue8m0x32, "fp4_ue8m0x32"},
                               {QuantFormat::kFp8Ue8m0x32, "fp8_ue8m0x32"}};

struct BackendName {
  Backend backend;
  const char* name;
};
constexpr BackendName kBackends[] = {{Backend::kReference, "reference"}, {Backend::kSimd, "simd"}};

std::vector<float> Input() {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(kElems);
  for (float& v : x) v = normal(rng) * 3.0f;  // KV activations: |x| mostly below ~10
  return x;
}

void BM_Quantize(benchmark::State& state, QuantFormat fmt, Backend backend) {
  const std::vector<float> x = Input();
  const size_t rows = kElems / kRowElems;
  std::vector<uint8_t> data(rows * DataBytes(fmt, kRowElems));
  std::vector<uint8_t> scales(rows * ScaleBytes(fmt, kRowElems));
  for (auto _ : state) {
    const Status st = Quantize(fmt, x.data(), rows, kRowElems, data.data(), scales.data(), backend);
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(data.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kElems * sizeof(float)));
}

void BM_Dequantize(benchmark::State& state, QuantFormat fmt, Backend backend) {
  const std::vector<float> x = Input();
  const size_t rows = kElems / kRowElems;
  std::vector<uint8_t> data(rows * DataBytes(fmt, kRowElems));
  std::vector<uint8_t> scales(rows * ScaleBytes(fmt, kRowElems));
  if (!Quantize(fmt, x.data(), rows, kRowElems, data.data(), scales.data()).ok()) {
    state.SkipWithError("quantize failed");
    return;
  }
  std::vector<float> out(kElems);
  for (auto _ : state) {
    const Status st =
        Dequantize(fmt, data.data(), scales.data(), rows, kRowElems, out.data(), backend);
    if (!st.ok()) {
      state.SkipWithError(st.ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * (data.size() + scales.size())));
  state.counters["out_bytes_per_second"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kElems * sizeof(float)),
                         benchmark::Counter::kIsRate);
}

void BM_Memcpy(benchmark::State& state, size_t bytes) {
  std::vector<uint8_t> src(bytes, 0x5a);
  std::vector<uint8_t> dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

std::string MemcpyName(size_t bytes) { return "memcpy/" + std::to_string(bytes); }

// Console output as usual, and each run's rates kept for the summary.
class RecordingReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.error_occurred || run.run_type != Run::RT_Iteration) continue;
      for (const char* counter : {"bytes_per_second", "out_bytes_per_second"}) {
        const auto it = run.counters.find(counter);
        if (it != run.counters.end())
          rates[run.benchmark_name() + "#" + counter] = it->second.value;
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }

  // Rate in bytes/s of "<benchmark>#<counter>", or 0 when it did not run.
  double Rate(const std::string& name, const char* counter) const {
    const auto it = rates.find(name + "#" + counter);
    return it == rates.end() ? 0.0 : it->second;
  }

  std::map<std::string, double> rates;
};

}  // namespace
}  // namespace kvtier::kernels

int main(int argc, char** argv) {
  using namespace kvtier::kernels;  // NOLINT(build/namespaces)
  struct Pair {
    std::string kernel;
    std::string peer;
    size_t bytes;
  };
  std::vector<Pair> pairs;
  std::map<size_t, bool> memcpy_sizes;
  for (const Format& f : kFormats) {
    const size_t quant_bytes = kElems * sizeof(float);
    const size_t dequant_bytes = DataBytes(f.fmt, kElems) + ScaleBytes(f.fmt, kElems);
    for (const BackendName& b : kBackends) {
      const std::string q = std::string("quantize/") + f.name + "/" + b.name;
      const std::string d = std::string("dequantize/") + f.name + "/" + b.name;
      benchmark::RegisterBenchmark(q.c_str(), BM_Quantize, f.fmt, b.backend);
      benchmark::RegisterBenchmark(d.c_str(), BM_Dequantize, f.fmt, b.backend);
      pairs.push_back({q, MemcpyName(quant_bytes), quant_bytes});
      pairs.push_back({d, MemcpyName(dequant_bytes), dequant_bytes});
    }
    memcpy_sizes[quant_bytes] = true;
    memcpy_sizes[dequant_bytes] = true;
  }
  for (const auto& [bytes, unused] : memcpy_sizes) {
    benchmark::RegisterBenchmark(MemcpyName(bytes).c_str(), BM_Memcpy, bytes);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RecordingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);

  // ratio: input GB/s over memcpy GB/s of the same input bytes. For dequantize, out_ratio
  // compares the fp32 bytes written with a memcpy of that many bytes (the write-side limit).
  const std::string out_peer = MemcpyName(kElems * sizeof(float));
  std::printf("\nkernel vs memcpy in the same process (ratio = kernel GB/s / memcpy GB/s)\n");
  std::printf("%-34s %9s %8s %8s %7s %9s\n", "kernel", "in_bytes", "in_GB/s", "memcpy", "ratio",
              "out_ratio");
  for (const Pair& p : pairs) {
    const double k = reporter.Rate(p.kernel, "bytes_per_second");
    const double m = reporter.Rate(p.peer, "bytes_per_second");
    if (k == 0.0 || m == 0.0) continue;
    const double out = reporter.Rate(p.kernel, "out_bytes_per_second");
    const double out_m = reporter.Rate(out_peer, "bytes_per_second");
    std::printf("%-34s %9zu %8.2f %8.2f %7.3f", p.kernel.c_str(), p.bytes, k / 1e9, m / 1e9, k / m);
    if (out > 0.0 && out_m > 0.0) std::printf(" %9.3f", out / out_m);
    std::printf("\n");
  }
  benchmark::Shutdown();
  return 0;
}
