// libFuzzer target: DecodeUnit on arbitrary bytes must return OK or Corruption, never crash,
// never read out of bounds (ASan), never hit undefined behaviour (UBSan).
//
// The first input byte picks the expected layout (bit 0: tiny or mini), so the fuzzer explores
// both a unit small enough to mutate into validity and a real-size one, and (bit 1) whether the
// checksum is verified: with it off, mutations reach the field checks behind the checksum.
// When a checksum-verified input decodes, the re-encoded unit must equal it byte for byte.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_unit_decoder_fuzz
//   build/fuzz/tests/fuzz/kvtier_unit_decoder_fuzz -max_total_time=20
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "common/shipped_models.h"
#include "common/unit_format.h"

namespace {

const kvtier::UnitPayloadLayout& Layout(uint8_t which) {
  static const kvtier::UnitPayloadLayout tiny = [] {
    auto l = kvtier::MakeKvLayout(16, 32, {0, 2, 1}, {1, 2}, 4);
    if (!l.ok()) std::abort();
    return kvtier::UnitPayloadLayout::For(*l);
  }();
  static const kvtier::UnitPayloadLayout mini = [] {
    auto l = kvtier::ParseKvLayout(kvtier::FindShippedModel("mini-v4.1")->config_json, {});
    if (!l.ok()) std::abort();
    return kvtier::UnitPayloadLayout::For(*l);
  }();
  return which % 2 == 0 ? tiny : mini;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const kvtier::UnitPayloadLayout& layout = Layout(data[0]);
  std::span<const uint8_t> bytes(data + 1, size - 1);
  kvtier::UnitDecodeOptions options;
  options.verify_checksum = (data[0] & 2) == 0;
  kvtier::StatusOr<kvtier::UnitView> v = kvtier::DecodeUnit(bytes, layout, options);
  if (!v.ok()) {
    if (!v.status().IsCorruption()) std::abort();  // the only failure DecodeUnit may report
    return 0;
  }
  if (v->payload.size() != layout.payload_bytes) std::abort();
  if (!options.verify_checksum) return 0;
  kvtier::StatusOr<std::vector<uint8_t>> again =
      kvtier::EncodeUnit(layout, v->identity, v->payload);
  if (!again.ok() || again->size() != bytes.size() ||
      std::memcmp(again->data(), bytes.data(), bytes.size()) != 0) {
    std::abort();
  }
  return 0;
}
