// kvtier codec-demo: layouts of the shipped models, then one prefix unit of the
// miniature model through the whole codec path:
//   random global KV -> kernels::Quantize (FP4 E2M1 + E4M3/16 main, + UE8M0/32 index)
//   -> EncodeUnit (header, xxh3-64) -> DecodeUnit (every field validated) -> Dequantize,
// verified bit for bit, plus a flipped bit that must be rejected as Corruption.
// (`kvtier demo` is the end-to-end session-resume scenario, cli/cmd_demo.cc.)
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/key_spec.h"
#include "common/kv_layout.h"
#include "common/shipped_models.h"
#include "common/unit_format.h"
#include "kernels/quant.h"

namespace kvtier::cli {
namespace {

// Fails the demo with a message.
int Fail(const std::string& what, const Status& status) {
  std::fprintf(stderr, "kvtier codec-demo: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

// One quantised region pair (data rows, then scale rows) of `rows` x `n` values.
struct RegionJob {
  kernels::QuantFormat format;
  uint32_t rows, n;
  PayloadRegion data, scales;
  std::vector<float> values;  // the unquantised KV
};

std::vector<RegionJob> PlanJobs(const UnitPayloadLayout& p, std::mt19937& rng) {
  // Global KV values of the size the model produces (|x| mostly below ~10, reference §5),
  // with occasional outliers so that scales vary between blocks.
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<RegionJob> jobs;
  for (const SourceRegions& s : p.sources) {
    jobs.push_back(
        {kernels::QuantFormat::kFp4E4M3x16, s.entries, p.head_dim, s.main_data, s.main_scales, {}});
    jobs.push_back({kernels::QuantFormat::kFp4Ue8m0x32,
                    s.entries,
                    p.index_head_dim,
                    s.index_data,
                    s.index_scales,
                    {}});
  }
  for (RegionJob& j : jobs) {
    j.values.resize(size_t{j.rows} * j.n);
    for (float& v : j.values) v = normal(rng) * (rng() % 64 == 0 ? 6.0f : 1.0f);
  }
  return jobs;
}

void PrintLayouts() {
  std::printf("== shipped model layouts (embedded deploy/models/*.json)\n");
  for (const ShippedModel& m : ShippedModels()) {
    StatusOr<KvLayout> l = ParseKvLayout(m.config_json, KvLayoutOptions{.unit_tokens = 64});
    if (!l.ok()) {
      std::printf("  %-22s error: %s\n", std::string(m.name).c_str(),
                  l.status().ToString().c_str());
      continue;
    }
    std::printf(
        "  %-22s %7.1f B/token (main %.1f + index %.1f), %u sources, "
        "64-token unit %llu B\n",
        std::string(m.name).c_str(), l->bytes_per_token, l->main_bytes_per_token,
        l->index_bytes_per_token, static_cast<unsigned>(l->sources.size()),
        static_cast<unsigned long long>(l->bytes_per_unit));
  }
}

}  // namespace

int RunCodecDemo(Args args) {
  FlagSet flags("kvtier codec-demo",
                "Print the shipped model layouts and round-trip one miniature-model prefix unit "
                "through quantisation, the unit codec and verification.");
  uint64_t seed = 42;
  flags.Uint("seed", &seed, "random seed for the synthetic KV");
  if (int rc = flags.Parse(args); rc >= 0) return rc;

  PrintLayouts();
  for (const ShippedModel& m : ShippedModels()) {
    if (!ParseKvLayout(m.config_json, {}).ok()) return Fail("layout", Status::Internal(m.name));
  }

  StatusOr<KvLayout> mini = ParseKvLayout(FindShippedModel("mini-v4.1")->config_json, {});
  if (!mini.ok()) return Fail("mini layout", mini.status());
  const UnitPayloadLayout p = UnitPayloadLayout::For(*mini);
  std::printf("\n== one mini-v4.1 unit (%u tokens, %llu payload bytes)\n", p.unit_tokens,
              static_cast<unsigned long long>(p.payload_bytes));

  // 1. Quantise random global KV straight into the payload regions.
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<RegionJob> jobs = PlanJobs(p, rng);
  std::vector<uint8_t> payload(p.payload_bytes, 0);
  for (const RegionJob& j : jobs) {
    Status s = kernels::Quantize(j.format, j.values.data(), j.rows, j.n,
                                 payload.data() + j.data.offset_bytes,
                                 payload.data() + j.scales.offset_bytes);
    if (!s.ok()) return Fail("kernels::Quantize", s);
  }
  std::printf("  quantised %zu regions (FP4 main + FP4 index keys for %zu KV sources)\n",
              jobs.size(), p.sources.size());

  // 2. Name it: model fingerprint, then the chain key of the unit's tokens.
  const std::string weights_id = "kvtier-demo: synthetic weights";
  const Digest weights =
      Sha256(std::span(reinterpret_cast<const uint8_t*>(weights_id.data()), weights_id.size()));
  const Digest fingerprint =
      ModelFingerprint(mini->CanonicalDescription(), weights, "kvtier-demo-tokenizer");
  std::vector<uint32_t> tokens(p.unit_tokens);
  std::iota(tokens.begin(), tokens.end(), 1000u);
  const std::vector<Digest> keys = ChainKeys(fingerprint, tokens, p.unit_tokens);
  if (keys.size() != 1) return Fail("ChainKeys", Status::Internal("expected one key"));
  const UnitIdentity identity{
      .model_fingerprint = fingerprint, .key = keys[0], .first_token_position = 0};

  // 3. Encode, 4. decode with every check on.
  StatusOr<std::vector<uint8_t>> unit = EncodeUnit(p, identity, payload);
  if (!unit.ok()) return Fail("EncodeUnit", unit.status());
  UnitDecodeOptions decode_options;
  decode_options.expected_model_fingerprint = fingerprint;
  decode_options.expected_key = keys[0];
  StatusOr<UnitView> view = DecodeUnit(*unit, p, decode_options);
  if (!view.ok()) return Fail("DecodeUnit", view.status());
  if (view->payload.size() != payload.size() ||
      std::memcmp(view->payload.data(), payload.data(), payload.size()) != 0) {
    return Fail("verify", Status::Corruption("decoded payload differs"));
  }
  std::printf("  encoded unit      %zu bytes (%zu header + %llu payload)\n", unit->size(),
              kUnitHeaderBytes, static_cast<unsigned long long>(view->payload_bytes));
  std::printf("  chain key         %s\n", ToHex(keys[0]).c_str());
  std::printf("  layout id         %016llx\n", static_cast<unsigned long long>(view->layout_id));
  std::printf("  checksum xxh3-64  %016llx\n", static_cast<unsigned long long>(view->checksum));

  // 5. Dequantise from the decoded view: it must equal quantise-then-dequantise of the input
  // exactly, and stay within the FP4 error bound of the original values.
  size_t values = 0;
  double max_rel_err = 0;
  for (const RegionJob& j : jobs) {
    std::vector<float> decoded(j.values.size()), expected = j.values;
    Status s = kernels::Dequantize(j.format, view->payload.data() + j.data.offset_bytes,
                                   view->payload.data() + j.scales.offset_bytes, j.rows, j.n,
                                   decoded.data());
    if (!s.ok()) return Fail("kernels::Dequantize", s);
    s = kernels::RoundTrip(j.format, expected.data(), j.rows, j.n);
    if (!s.ok()) return Fail("kernels::RoundTrip", s);
    if (std::memcmp(decoded.data(), expected.data(), decoded.size() * sizeof(float)) != 0) {
      return Fail("verify", Status::Corruption("dequantised values differ from the reference"));
    }
    float amax = 0;
    for (float v : j.values) amax = std::max(amax, std::fabs(v));
    for (size_t i = 0; i < decoded.size(); ++i) {
      max_rel_err = std::max(max_rel_err, std::fabs(double{decoded[i]} - j.values[i]) / amax);
    }
    values += decoded.size();
  }
  std::printf(
      "  verified          %zu values bit-exact vs quantise->dequantise reference "
      "(max |err| / region amax = %.3f)\n",
      values, max_rel_err);

  // 6. One flipped bit anywhere must be refused.
  std::vector<uint8_t> damaged = *unit;
  damaged[kUnitHeaderBytes + damaged.size() / 3] ^= 0x10;
  StatusOr<UnitView> bad = DecodeUnit(damaged, p, decode_options);
  if (!bad.status().IsCorruption()) {
    return Fail("corruption check", Status::Internal("a flipped bit was not detected"));
  }
  std::printf("  flipped one bit   -> %s\n", bad.status().ToString().c_str());
  std::printf("\ndemo OK\n");
  return 0;
}

}  // namespace kvtier::cli
