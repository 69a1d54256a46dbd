// Multi-row engine passes against single-row ones, measured in one run (docs/performance/engine.md,
// "Engine", "Batched passes"):
//   1. decode batch: Engine::ForwardBatch of k sequences' next token (one row each) against the
//      same k tokens run as k Engine::Decode calls; ratio = Decode time / ForwardBatch time
//      (above 1: the packed pass is cheaper per row);
//   2. verify: one Forward of v tokens (a DSpark verification pass) against v Decode calls from
//      the same state; ratio = Decode time / Forward time.
// Every sequence first gets `history` tokens of context (Forward). Each timed arm starts from a
// copy of those states, so both arms run the same positions; arms alternate round by round
// (load changes hit both) and the best round of each is kept. The batched arm's logits are
// checked bit for bit against the single arm's (exit 1 on any difference).
//
//   kvtier_bench_forward_batch [--config F] [--model F] [--threads 1,2] [--k 1,4,16,32]
//       [--history 256] [--steps 8] [--rounds 5] [--verify-tokens 6] [--only-batched]
//       [--only-verify] [--layer-device cpu|host-twin|cuda] [--device-profile]
//
// --only-batched runs only ForwardBatch (for a profiler: perf record -g -- ... --k 16).
// --only-verify runs only the verify arm's Forward passes (no decode batches, no v x Decode arm,
// hence no bit-for-bit check; for a profiler: perf record -g -- ... --only-verify).
// --layer-device runs every pass's dense layers there (EngineOptions::layer_device): host-twin
// must match the single arm bit for bit; cuda within 1e-3 of each logit's size (the CUDA math
// library's expf / log1pf) in the decode arm, its worst relative difference printed as
// max_rel_diff (the verify arm's check is bit for bit: its Forward and Decodes both run there).
// --device-profile (with host-twin or cuda) adds, per k, one batched round with the device
// profile on (Engine::SetDeviceProfiling): each kernel's and copy's calls and device time per
// pass, and the device's time against the wall's; and the first sequence's history prefill
// profiled the same way, per token.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace kvtier::engine {
namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string config = "deploy/models/kvmini-trained.json";
  std::string model = "deploy/models/kvmini-trained.safetensors";
  std::vector<int> threads = {1, 2};
  std::vector<int> ks = {1, 4, 16, 32};
  int history = 256;
  int steps = 8;
  int rounds = 5;
  int verify_tokens = 6;
  bool only_batched = false;
  bool only_verify = false;
  bool device_profile = false;
  LayerDevice layer_device = LayerDevice::kCpu;
};

std::vector<int> ParseList(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p != '\0';) {
    char* end = nullptr;
    const long x = std::strtol(p, &end, 10);
    if (end == p || x < 1 || x > 4096) {
      std::fprintf(stderr, "bad list: %s\n", s);
      std::exit(2);
    }
    v.push_back(static_cast<int>(x));
    p = *end == ',' ? end + 1 : end;
  }
  return v;
}

int ParseInt(const char* s, int lo, int hi) {
  char* end = nullptr;
  const long x = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || x < lo || x > hi) {
    std::fprintf(stderr, "bad number: %s (range [%d, %d])\n", s, lo, hi);
    std::exit(2);
  }
  return static_cast<int>(x);
}

Flags Parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--config") {
      f.config = next();
    } else if (a == "--model") {
      f.model = next();
    } else if (a == "--threads") {
      f.threads = ParseList(next());
    } else if (a == "--k") {
      f.ks = ParseList(next());
    } else if (a == "--history") {
      f.history = ParseInt(next(), 1, 16384);
    } else if (a == "--steps") {
      f.steps = ParseInt(next(), 1, 1024);
    } else if (a == "--rounds") {
      f.rounds = ParseInt(next(), 1, 100);
    } else if (a == "--verify-tokens") {
      f.verify_tokens = ParseInt(next(), 1, 256);
    } else if (a == "--only-batched") {
      f.only_batched = true;
    } else if (a == "--only-verify") {
      f.only_verify = true;
    } else if (a == "--device-profile") {
      f.device_profile = true;
    } else if (a == "--layer-device") {
      const std::string d = next();
      if (!ParseLayerDevice(d, &f.layer_device)) {
        std::fprintf(stderr, "--layer-device: cpu, host-twin or cuda, not %s\n", d.c_str());
        std::exit(2);
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      std::exit(2);
    }
  }
  if (f.device_profile && f.layer_device == LayerDevice::kCpu) {
    std::fprintf(stderr, "--device-profile needs --layer-device host-twin or cuda\n");
    std::exit(2);
  }
  return f;
}

// Deterministic byte-like tokens (ids 3..258) for sequence `seq`.
std::vector<int32_t> Tokens(int n, int seq) {
  std::vector<int32_t> t(n);
  uint32_t x = 2463534242u + 7919u * static_cast<uint32_t>(seq);
  for (int i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    t[i] = 3 + static_cast<int32_t>(x % 256);
  }
  return t;
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// FNV-1a over the bits of every logit the batched arms produced: equal digests from two builds
// mean bit-identical results (the "digest" line).
uint64_t g_digest = 1469598103934665603ull;
void Digest(const std::vector<float>& v) {
  const auto* b = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(float); ++i) {
    g_digest ^= b[i];
    g_digest *= 1099511628211ull;
  }
}

// Wall and process CPU time since a Mark. The machine is shared: CPU time (all of the
// process's threads, spinning pool workers included) is the less noisy of the two; both are
// printed.
struct Mark {
  Clock::time_point wall = Clock::now();
  double cpu = CpuNow();
  static double CpuNow() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  }
};
struct Cost {
  double wall = 1e30, cpu = 1e30;
  // Keeps the best of this and the time since m.
  void Min(const Mark& m) {
    wall = std::min(wall, std::chrono::duration<double>(Clock::now() - m.wall).count());
    cpu = std::min(cpu, Mark::CpuNow() - m.cpu);
  }
  void Add(const Mark& m) {
    wall += std::chrono::duration<double>(Clock::now() - m.wall).count();
    cpu += Mark::CpuNow() - m.cpu;
  }
};

// One decode-batch measurement: k sequences, `steps` tokens each.
// The device profile of `passes` passes (or tokens) that took `wall_s` in all: each operation's
// calls and device time per pass and its share, dearest first; then the device's time against the
// wall's (the rest: launches, the host's attention and Engram, waiting).
void PrintProfile(std::vector<device::OpStat> ops, int passes, double wall_s,
                  const char* per = "pass") {
  std::sort(ops.begin(), ops.end(),
            [](const device::OpStat& a, const device::OpStat& b) { return a.seconds > b.seconds; });
  double device_s = 0;
  int64_t calls = 0;
  for (const device::OpStat& o : ops) {
    device_s += o.seconds;
    calls += o.calls;
  }
  for (const device::OpStat& o : ops) {
    std::printf("  %-16s %7.1f calls/%s %9.1f us/%s %5.1f%%", o.name.c_str(),
                static_cast<double>(o.calls) / passes, per, o.seconds / passes * 1e6, per,
                device_s > 0 ? 100.0 * o.seconds / device_s : 0.0);
    if (o.bytes > 0) std::printf("  %9.1f KB/%s", static_cast<double>(o.bytes) / passes / 1e3, per);
    std::printf("\n");
  }
  std::printf("  device %.1f us/%s in %.1f calls, wall %.1f us/%s (device %.0f%%)\n",
              device_s / passes * 1e6, per, static_cast<double>(calls) / passes,
              wall_s / passes * 1e6, per, wall_s > 0 ? 100.0 * device_s / wall_s : 0.0);
}

void DecodeBatch(Engine* e, const Flags& f, int threads, int k) {
  std::vector<SequenceState> base(k);
  std::vector<std::vector<int32_t>> next(k);
  std::vector<float> logits;
  for (int i = 0; i < k; ++i) {
    base[i] = e->NewSequence();
    const auto text = Tokens(f.history + f.steps, i);
    const bool profile_prefill = f.device_profile && i == 0;
    if (profile_prefill) {
      Check(e->TakeDeviceProfile().status(), "device profile");
      Check(e->SetDeviceProfiling(true), "device profile");
    }
    Mark m;
    Check(e->Forward(&base[i], std::span<const int32_t>(text.data(), f.history), false, &logits),
          "history");
    if (profile_prefill) {  // the first sequence's history: a prefill's passes
      Cost prefill;
      prefill.Min(m);
      Check(e->SetDeviceProfiling(false), "device profile");
      auto ops = e->TakeDeviceProfile();
      Check(ops.status(), "device profile");
      std::printf("profile threads=%d prefill of %d tokens (one Forward, per token):\n", threads,
                  f.history);
      PrintProfile(std::move(*ops), f.history, prefill.wall, "token");
    }
    next[i].assign(text.begin() + f.history, text.end());
  }
  Cost batch, single;
  std::vector<std::vector<std::vector<float>>> batch_logits(f.steps), single_logits(f.steps);
  for (int round = 0; round < f.rounds; ++round) {
    // Batched arm.
    std::vector<SequenceState> st = base;
    std::vector<SequenceState*> ptrs;
    for (auto& s : st) ptrs.push_back(&s);
    std::vector<std::vector<float>> out;
    Mark m;
    for (int s = 0; s < f.steps; ++s) {
      std::vector<std::span<const int32_t>> spans;
      for (int i = 0; i < k; ++i) spans.emplace_back(&next[i][s], 1);
      Check(e->ForwardBatch(ptrs, spans, &out), "ForwardBatch");
      if (round == 0) {
        batch_logits[s] = out;
        for (const auto& row : out) Digest(row);
      }
    }
    batch.Min(m);
    if (f.only_batched) continue;
    // Single arm: step by step, every sequence's Decode in turn.
    st = base;
    m = Mark();
    for (int s = 0; s < f.steps; ++s) {
      if (round == 0) single_logits[s].resize(k);
      for (int i = 0; i < k; ++i) {
        Check(e->Decode(&st[i], next[i][s], &logits), "Decode");
        if (round == 0) single_logits[s][i] = logits;
      }
    }
    single.Min(m);
  }
  double max_rel_diff = 0;
  if (!f.only_batched) {
    const bool exact = f.layer_device != LayerDevice::kCuda;
    for (int s = 0; s < f.steps; ++s) {
      for (int i = 0; i < k; ++i) {
        const auto& a = batch_logits[s][i];
        const auto& b = single_logits[s][i];
        bool same = a.size() == b.size();
        if (same && exact) same = std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
        for (size_t j = 0; same && !exact && j < a.size(); ++j) {
          const double d = std::abs(static_cast<double>(a[j]) - b[j]) /
                           (1.0 + std::abs(static_cast<double>(b[j])));
          max_rel_diff = std::max(max_rel_diff, d);
          same = d <= 1e-3;
        }
        if (!same) {
          std::fprintf(stderr, "MISMATCH: k=%d step %d sequence %d\n", k, s, i);
          std::exit(1);
        }
      }
    }
  }
  const double rows = static_cast<double>(k) * f.steps;
  std::printf("decode  threads=%d k=%-3d batched %7.1f us/row (cpu %7.1f)", threads, k,
              batch.wall / rows * 1e6, batch.cpu / rows * 1e6);
  if (!f.only_batched) {
    if (f.layer_device == LayerDevice::kCuda) std::printf("  max_rel_diff %.2e", max_rel_diff);
    std::printf("  single %7.1f us/row (cpu %7.1f)  ratio wall %.2f cpu %.2f",
                single.wall / rows * 1e6, single.cpu / rows * 1e6, single.wall / batch.wall,
                single.cpu / batch.cpu);
  }
  std::printf("\n");
  if (f.device_profile) {  // one more batched round, profiled (not timed above)
    std::vector<SequenceState> st = base;
    std::vector<SequenceState*> ptrs;
    for (auto& s : st) ptrs.push_back(&s);
    std::vector<std::vector<float>> out;
    Check(e->TakeDeviceProfile().status(), "device profile");
    Check(e->SetDeviceProfiling(true), "device profile");
    Mark m;
    for (int s = 0; s < f.steps; ++s) {
      std::vector<std::span<const int32_t>> spans;
      for (int i = 0; i < k; ++i) spans.emplace_back(&next[i][s], 1);
      Check(e->ForwardBatch(ptrs, spans, &out), "ForwardBatch");
    }
    Cost profiled;
    profiled.Min(m);
    Check(e->SetDeviceProfiling(false), "device profile");
    auto ops = e->TakeDeviceProfile();
    Check(ops.status(), "device profile");
    std::printf("profile threads=%d k=%d (%d passes of ForwardBatch):\n", threads, k, f.steps);
    PrintProfile(std::move(*ops), f.steps, profiled.wall);
  }
}

// One verify measurement: Forward of v tokens against v Decode calls after `history` tokens.
void Verify(Engine* e, const Flags& f, int threads) {
  const int v = f.verify_tokens;
  SequenceState base = e->NewSequence();
  const auto text = Tokens(f.history + v, 99);
  std::vector<float> logits;
  Check(e->Forward(&base, std::span<const int32_t>(text.data(), f.history), false, &logits),
        "history");
  std::span<const int32_t> block(text.data() + f.history, v);
  Cost fwd, single;
  for (int round = 0; round < f.rounds; ++round) {
    Cost f_round{0, 0}, s_round{0, 0};
    std::vector<float> all, one;
    for (int s = 0; s < f.steps; ++s) {
      SequenceState st = base;
      Mark m;
      Check(e->Forward(&st, block, true, &all), "Forward");
      f_round.Add(m);
      if (round == 0 && s == 0) Digest(all);
      if (f.only_verify) continue;
      st = base;
      m = Mark();
      for (int i = 0; i < v; ++i) {
        Check(e->Decode(&st, block[i], &one), "Decode");
        if (std::memcmp(one.data(), all.data() + static_cast<size_t>(i) * one.size(),
                        one.size() * 4) != 0) {
          std::fprintf(stderr, "MISMATCH: verify row %d\n", i);
          std::exit(1);
        }
      }
      s_round.Add(m);
    }
    fwd.wall = std::min(fwd.wall, f_round.wall);
    fwd.cpu = std::min(fwd.cpu, f_round.cpu);
    single.wall = std::min(single.wall, s_round.wall);
    single.cpu = std::min(single.cpu, s_round.cpu);
  }
  if (f.only_verify) {
    std::printf("verify  threads=%d v=%-3d Forward %7.1f us/pass (cpu %7.1f)\n", threads, v,
                fwd.wall / f.steps * 1e6, fwd.cpu / f.steps * 1e6);
    return;
  }
  std::printf(
      "verify  threads=%d v=%-3d Forward %7.1f us/pass (cpu %7.1f)  %dx Decode %7.1f us (cpu "
      "%7.1f)  ratio wall %.2f cpu %.2f\n",
      threads, v, fwd.wall / f.steps * 1e6, fwd.cpu / f.steps * 1e6, v, single.wall / f.steps * 1e6,
      single.cpu / f.steps * 1e6, single.wall / fwd.wall, single.cpu / fwd.cpu);
}

int Main(int argc, char** argv) {
  const Flags f = Parse(argc, argv);
  auto config = LoadEngineConfig(f.config);
  Check(config.status(), "config");
  auto w = LoadWeights(*config, f.model);
  Check(w.status(), "weights");
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  std::printf(
      "matmul kernel %s, layers on %s, experts %s, projections %s, history %d tokens, %d steps, "
      "best of %d rounds\n",
      MatMulKernelName(ActiveMatMulKernel()), LayerDeviceName(f.layer_device),
      std::string(ExpertFormatName(config->expert_format)).c_str(),
      std::string(WeightFormatName(config->weight_format)).c_str(), f.history, f.steps, f.rounds);
  for (int threads : f.threads) {
    EngineOptions o;
    o.threads = threads;
    o.layer_device = f.layer_device;
    auto e = Engine::Create(*config, weights, o);
    Check(e.status(), "engine");
    if (!f.only_verify) {
      for (int k : f.ks) DecodeBatch(e->get(), f, threads, k);
    }
    if (!f.only_batched) Verify(e->get(), f, threads);
  }
  std::printf("digest %016llx\n", static_cast<unsigned long long>(g_digest));
  return 0;
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) { return kvtier::engine::Main(argc, argv); }
