#include "engine/state_io.h"

#include <algorithm>
#include <cstring>

#include "common/checksum.h"
#include "kernels/quant.h"

namespace kvtier::engine {

// Imports dequantise with the AVX2 codec when the CPU has it (kAuto): every backend matches
// the scalar reference bit for bit (kernels/quant.h), so the imported values equal the ones
// the engine computed itself (tests/engine engine_model_test UnitsPlusSwaBlobResumeExactly).
constexpr kernels::Backend kImportBackend = kernels::Backend::kAuto;

namespace {

using kernels::QuantFormat;

void PutU64(std::vector<uint8_t>* out, uint64_t v, int bytes = 8) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

uint64_t GetU64(const uint8_t* p, int bytes = 8) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

const SourceRegions* FindRegions(const UnitPayloadLayout& layout, int layer) {
  for (const SourceRegions& r : layout.sources) {
    if (static_cast<int>(r.layer_id) == layer) return &r;
  }
  return nullptr;
}

}  // namespace

StatusOr<KvLayout> EngineKvLayout(const EngineConfig& c, uint32_t unit_tokens) {
  std::vector<uint32_t> ratios(c.compress_ratios.begin(), c.compress_ratios.end());
  std::vector<uint32_t> sources(c.kv_source_layer_ids.begin(), c.kv_source_layer_ids.end());
  return MakeKvLayout(c.head_dim, c.index_head_dim, ratios, sources, unit_tokens);
}

int64_t ExportablePages(const UnitPayloadLayout& layout, const SequenceState& st) {
  int64_t pages = INT64_MAX;
  for (const KvSourceCache& k : st.kv) {
    pages = std::min<int64_t>(pages, k.entries() * k.ratio / layout.unit_tokens);
  }
  return st.kv.empty() ? 0 : pages;
}

StatusOr<std::vector<uint8_t>> ExportUnitPayload(const UnitPayloadLayout& layout,
                                                 const SequenceState& st, int64_t page) {
  if (page < 0 || page >= ExportablePages(layout, st))
    return Status::NotFound("engine export: the state does not hold this whole page");
  if (layout.sources.size() != st.kv.size())
    return Status::InvalidArgument("engine export: layout does not match the state");
  std::vector<uint8_t> out(layout.payload_bytes);
  for (const KvSourceCache& k : st.kv) {
    const SourceRegions* r = FindRegions(layout, k.layer);
    if (r == nullptr || layout.head_dim != static_cast<uint32_t>(k.head_dim) ||
        layout.index_head_dim != static_cast<uint32_t>(k.index_dim))
      return Status::InvalidArgument("engine export: layout does not match the state");
    const int64_t e0 = page * r->entries;
    auto copy = [&](const std::vector<uint8_t>& src, const PayloadRegion& reg) {
      const uint64_t row = reg.size_bytes / r->entries;
      std::memcpy(out.data() + reg.offset_bytes, src.data() + e0 * row, reg.size_bytes);
    };
    copy(k.main_data, r->main_data);
    copy(k.main_scales, r->main_scales);
    copy(k.index_data, r->index_data);
    copy(k.index_scales, r->index_scales);
  }
  return out;
}

Status ImportUnitPayload(const UnitPayloadLayout& layout, std::span<const uint8_t> payload,
                         std::span<const int32_t> tokens, SequenceState* st) {
  if (payload.size() != layout.payload_bytes)
    return Status::Corruption("engine import: payload size does not match the layout");
  if (tokens.size() != layout.unit_tokens)
    return Status::InvalidArgument("engine import: a unit needs unit_tokens token ids");
  if (layout.sources.size() != st->kv.size())
    return Status::InvalidArgument("engine import: layout does not match the state");
  const int64_t n = static_cast<int64_t>(st->tokens.size());
  for (const KvSourceCache& k : st->kv) {
    if (k.consumed != n || n % layout.unit_tokens != 0 || k.entries() * k.ratio != n)
      return Status::InvalidArgument("engine import: state does not end at a page boundary");
  }
  for (const SwaRing& r : st->swa) {
    if (r.end != 0) return Status::InvalidArgument("engine import: state already has SWA rings");
  }
  // Every region must hold exactly `entries` rows of its format (attention reads these bytes);
  // checked for every source before the state changes.
  std::vector<const SourceRegions*> regions;
  for (const KvSourceCache& k : st->kv) {
    const SourceRegions* r = FindRegions(layout, k.layer);
    if (r == nullptr || layout.head_dim != static_cast<uint32_t>(k.head_dim) ||
        layout.index_head_dim != static_cast<uint32_t>(k.index_dim))
      return Status::InvalidArgument("engine import: layout does not match the state");
    const uint64_t ne = r->entries;
    if (r->main_data.size_bytes != ne * kernels::DataBytes(QuantFormat::kFp4E4M3x16, k.head_dim) ||
        r->main_scales.size_bytes !=
            ne * kernels::ScaleBytes(QuantFormat::kFp4E4M3x16, k.head_dim) ||
        r->index_data.size_bytes !=
            ne * kernels::DataBytes(QuantFormat::kFp4Ue8m0x32, k.index_dim) ||
        r->index_scales.size_bytes !=
            ne * kernels::ScaleBytes(QuantFormat::kFp4Ue8m0x32, k.index_dim))
      return Status::InvalidArgument("engine import: region sizes do not match the entries");
    regions.push_back(r);
  }
  // Straight into the engine's layout: the FP4 bytes are appended as they are.
  for (size_t i = 0; i < st->kv.size(); ++i) {
    KvSourceCache& k = st->kv[i];
    const SourceRegions* r = regions[i];
    auto append = [&](std::vector<uint8_t>* dst, const PayloadRegion& reg) {
      const size_t d0 = AppendKvBytes(dst, reg.size_bytes);
      std::memcpy(dst->data() + d0, payload.data() + reg.offset_bytes, reg.size_bytes);
    };
    append(&k.main_data, r->main_data);
    append(&k.main_scales, r->main_scales);
    append(&k.index_data, r->index_data);
    append(&k.index_scales, r->index_scales);
    k.n_entries += r->entries;
    k.consumed = n + layout.unit_tokens;
  }
  st->tokens.insert(st->tokens.end(), tokens.begin(), tokens.end());
  return Status::Ok();
}

StatusOr<std::vector<uint8_t>> ExportUnit(const UnitPayloadLayout& layout,
                                          const UnitIdentity& identity, const SequenceState& st,
                                          int64_t page) {
  if (identity.first_token_position != static_cast<uint64_t>(page) * layout.unit_tokens)
    return Status::InvalidArgument("engine export: identity position is not the page's");
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> payload, ExportUnitPayload(layout, st, page));
  return EncodeUnit(layout, identity, payload);
}

Status ImportUnit(const UnitPayloadLayout& layout, std::span<const uint8_t> unit,
                  const UnitDecodeOptions& options, std::span<const int32_t> tokens,
                  SequenceState* st) {
  KVTIER_ASSIGN_OR_RETURN(UnitView view, DecodeUnit(unit, layout, options));
  if (view.identity.first_token_position != st->tokens.size())
    return Status::Corruption("engine import: unit position is not the sequence end");
  return ImportUnitPayload(layout, view.payload, tokens, st);
}

StatusOr<std::vector<uint8_t>> ExportTail(const SequenceState& st, int64_t first_token) {
  const int64_t n = static_cast<int64_t>(st.tokens.size());
  if (first_token < 0 || first_token > n || n - first_token > kTailTokensLimit)
    return Status::InvalidArgument("engine export: tail start outside the sequence");
  std::vector<uint8_t> out = {'K', 'V', 'T', 'L'};
  PutU64(&out, 1, 2);
  PutU64(&out, st.kv.size(), 2);
  PutU64(&out, static_cast<uint64_t>(first_token));
  PutU64(&out, static_cast<uint64_t>(n - first_token), 4);
  for (int64_t i = first_token; i < n; ++i) PutU64(&out, static_cast<uint32_t>(st.tokens[i]), 4);
  for (const KvSourceCache& k : st.kv) {
    if (k.consumed != n || first_token % k.ratio != 0 || k.entries() != n / k.ratio)
      return Status::InvalidArgument("engine export: global KV does not cover the tail");
    const int64_t e0 = first_token / k.ratio, ne = k.entries() - e0;
    PutU64(&out, static_cast<uint64_t>(k.layer), 4);
    PutU64(&out, static_cast<uint64_t>(k.ratio), 4);
    PutU64(&out, static_cast<uint64_t>(ne), 4);
    PutU64(&out, k.kv_state.size(), 4);
    auto rows = [&](const std::vector<uint8_t>& v, size_t row) {
      out.insert(out.end(), v.begin() + e0 * row, v.begin() + (e0 + ne) * row);
    };
    rows(k.main_data, kernels::DataBytes(QuantFormat::kFp4E4M3x16, k.head_dim));
    rows(k.main_scales, kernels::ScaleBytes(QuantFormat::kFp4E4M3x16, k.head_dim));
    rows(k.index_data, kernels::DataBytes(QuantFormat::kFp4Ue8m0x32, k.index_dim));
    rows(k.index_scales, kernels::ScaleBytes(QuantFormat::kFp4Ue8m0x32, k.index_dim));
    for (const std::vector<float>* v : {&k.kv_state, &k.score_state}) {
      const size_t at = out.size();
      out.resize(at + v->size() * 4);
      std::memcpy(out.data() + at, v->data(), v->size() * 4);  // little-endian host
    }
  }
  PutU64(&out, Xxh3_64(out.data(), out.size()));
  return out;
}

Status ImportTail(std::span<const uint8_t> blob, std::span<const int32_t> tail_tokens,
                  SequenceState* st) {
  constexpr size_t kHead = 4 + 2 + 2 + 8 + 4;
  if (blob.size() < kHead + 8 || std::memcmp(blob.data(), "KVTL", 4) != 0)
    return Status::Corruption("tail blob: bad magic or too short");
  if (GetU64(blob.data() + blob.size() - 8) != Xxh3_64(blob.data(), blob.size() - 8))
    return Status::Corruption("tail blob: checksum mismatch");
  const uint8_t* p = blob.data() + 4;
  const uint8_t* const end = blob.data() + blob.size() - 8;
  if (GetU64(p, 2) != 1) return Status::Corruption("tail blob: unknown version");
  const uint64_t sources = GetU64(p + 2, 2), first = GetU64(p + 4), count = GetU64(p + 12, 4);
  p = blob.data() + kHead;
  if (sources != st->kv.size())
    return Status::InvalidArgument("tail blob: sources do not match the state");
  if (first != st->tokens.size())
    return Status::InvalidArgument("tail blob: does not start at the state's end");
  if (count > kTailTokensLimit || count * 4 > static_cast<uint64_t>(end - p))
    return Status::Corruption("tail blob: token count");
  if (count != tail_tokens.size()) return Status::Corruption("tail blob: other tokens");
  for (uint64_t i = 0; i < count; ++i) {
    if (static_cast<int32_t>(GetU64(p + 4 * i, 4)) != tail_tokens[i])
      return Status::Corruption("tail blob: other tokens");
  }
  p += count * 4;
  // Parse and check every source before the state changes.
  struct Part {
    const uint8_t* rows[4];
    size_t bytes[4];
    const uint8_t* group;
    uint64_t ne, group_floats;
  };
  std::vector<Part> parts(sources);
  for (size_t i = 0; i < sources; ++i) {
    const KvSourceCache& k = st->kv[i];
    if (end - p < 16) return Status::Corruption("tail blob: truncated");
    const uint64_t layer = GetU64(p, 4), ratio = GetU64(p + 4, 4), ne = GetU64(p + 8, 4),
                   gf = GetU64(p + 12, 4);
    p += 16;
    if (layer != static_cast<uint64_t>(k.layer) || ratio != static_cast<uint64_t>(k.ratio) ||
        gf != k.kv_state.size() || gf != k.score_state.size())
      return Status::InvalidArgument("tail blob: a source does not match the state");
    if (k.consumed != static_cast<int64_t>(first) || k.entries() * k.ratio != k.consumed ||
        ne != (first + count) / ratio - first / ratio)
      return Status::InvalidArgument("tail blob: the state does not end at the tail's start");
    Part& part = parts[i];
    part.ne = ne;
    part.group_floats = gf;
    const size_t row[4] = {kernels::DataBytes(QuantFormat::kFp4E4M3x16, k.head_dim),
                           kernels::ScaleBytes(QuantFormat::kFp4E4M3x16, k.head_dim),
                           kernels::DataBytes(QuantFormat::kFp4Ue8m0x32, k.index_dim),
                           kernels::ScaleBytes(QuantFormat::kFp4Ue8m0x32, k.index_dim)};
    for (int r = 0; r < 4; ++r) {
      part.bytes[r] = ne * row[r];
      if (static_cast<uint64_t>(end - p) < part.bytes[r])
        return Status::Corruption("tail blob: truncated");
      part.rows[r] = p;
      p += part.bytes[r];
    }
    if (static_cast<uint64_t>(end - p) < gf * 8) return Status::Corruption("tail blob: truncated");
    part.group = p;
    p += gf * 8;
  }
  if (p != end) return Status::Corruption("tail blob: trailing bytes");
  for (size_t i = 0; i < sources; ++i) {
    KvSourceCache& k = st->kv[i];
    const Part& part = parts[i];
    std::vector<uint8_t>* dst[4] = {&k.main_data, &k.main_scales, &k.index_data, &k.index_scales};
    for (int r = 0; r < 4; ++r) {
      const size_t d0 = AppendKvBytes(dst[r], part.bytes[r]);
      if (part.bytes[r] > 0) std::memcpy(dst[r]->data() + d0, part.rows[r], part.bytes[r]);
    }
    std::memcpy(k.kv_state.data(), part.group, part.group_floats * 4);
    std::memcpy(k.score_state.data(), part.group + part.group_floats * 4, part.group_floats * 4);
    k.n_entries += static_cast<int64_t>(part.ne);
    k.consumed = static_cast<int64_t>(first + count);
  }
  st->tokens.insert(st->tokens.end(), tail_tokens.begin(), tail_tokens.end());
  return Status::Ok();
}

std::vector<uint8_t> ExportSwaRings(const SequenceState& st) {
  std::vector<uint8_t> out = {'K', 'V', 'S', 'W'};
  const int window = st.swa.empty() ? 0 : st.swa[0].window;
  const int dim = st.swa.empty() ? 0 : st.swa[0].dim;
  PutU64(&out, 1, 2);
  PutU64(&out, st.swa.size(), 2);
  PutU64(&out, static_cast<uint64_t>(window), 4);
  PutU64(&out, static_cast<uint64_t>(dim), 4);
  PutU64(&out, st.tokens.size());
  for (const SwaRing& r : st.swa) {
    PutU64(&out, static_cast<uint64_t>(r.valid_from));
    PutU64(&out, static_cast<uint64_t>(r.end));
    out.insert(out.end(), r.data.begin(), r.data.end());
    out.insert(out.end(), r.scales.begin(), r.scales.end());
  }
  PutU64(&out, Xxh3_64(out.data(), out.size()));
  return out;
}

Status ImportSwaRings(std::span<const uint8_t> blob, SequenceState* st) {
  constexpr size_t kHead = 4 + 2 + 2 + 4 + 4 + 8;
  if (blob.size() < kHead + 8 || blob.size() > kSwaBlobBytesLimit)
    return Status::Corruption("swa blob: bad length");
  if (std::memcmp(blob.data(), "KVSW", 4) != 0) return Status::Corruption("swa blob: bad magic");
  if (GetU64(blob.data() + blob.size() - 8) != Xxh3_64(blob.data(), blob.size() - 8))
    return Status::Corruption("swa blob: checksum mismatch");
  const uint8_t* p = blob.data() + 4;
  if (GetU64(p, 2) != 1) return Status::Corruption("swa blob: unknown version");
  const uint64_t layers = GetU64(p + 2, 2), window = GetU64(p + 4, 4), dim = GetU64(p + 8, 4);
  const uint64_t tokens = GetU64(p + 12);
  if (layers != st->swa.size() ||
      (layers > 0 && (window != static_cast<uint64_t>(st->swa[0].window) ||
                      dim != static_cast<uint64_t>(st->swa[0].dim))))
    return Status::InvalidArgument("swa blob: shape does not match the state");
  for (const SwaRing& r : st->swa) {
    if (r.window != static_cast<int>(window) || r.dim != static_cast<int>(dim) ||
        r.data.size() != window * dim || r.scales.size() != window * dim / 32 ||
        r.values.size() != window * dim || r.stamps.size() != window)
      return Status::InvalidArgument("swa blob: shape does not match the state");
  }
  if (tokens != st->tokens.size())
    return Status::InvalidArgument("swa blob: token count does not match the state");
  const uint64_t per_layer = 16 + window * dim + window * dim / 32;
  if (blob.size() != kHead + layers * per_layer + 8)
    return Status::Corruption("swa blob: bad length");
  p = blob.data() + kHead;
  std::vector<SwaRing> rings = st->swa;
  for (SwaRing& r : rings) {
    r.valid_from = static_cast<int64_t>(GetU64(p));
    r.end = static_cast<int64_t>(GetU64(p + 8));
    if (r.end != static_cast<int64_t>(tokens) || r.valid_from < 0 || r.valid_from > r.end)
      return Status::Corruption("swa blob: ring positions do not match the token count");
    p += 16;
    std::memcpy(r.data.data(), p, r.data.size());
    p += r.data.size();
    std::memcpy(r.scales.data(), p, r.scales.size());
    p += r.scales.size();
    for (int64_t slot = 0; slot < r.window; ++slot) r.Stamp(slot);
    KVTIER_RETURN_IF_ERROR(kernels::Dequantize(QuantFormat::kFp8Ue8m0x32, r.data.data(),
                                               r.scales.data(), r.window, r.dim, r.values.data(),
                                               kImportBackend));
  }
  st->swa = std::move(rings);
  return Status::Ok();
}

}  // namespace kvtier::engine
