// The device layers of ForwardBatch (EngineOptions::layer_device, engine/device/): the host twin
// (the GPU's kernels run on the CPU) against the CPU path bit for bit, over decode steps of
// several sequences, verify-sized passes with every row's logits, attention-input captures
// and a StepTrace (which keeps the pass on the CPU); the CUDA device against the CPU within the
// CUDA math library's differences where a GPU is, Unavailable where none is.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "engine/device/backend.h"
#include "engine/device/layers.h"
#include "engine/model.h"
#include "engine/speculative.h"
#include "engine/state_io.h"
#include "engine_test_util.h"
#include "tests/cuda_required.h"

namespace kvtier::engine {
namespace {

using testutil::BitEqual;
using testutil::Prompt;

std::unique_ptr<Engine> MakeEngine(const EngineConfig& c, std::shared_ptr<const ModelWeights> w,
                                   LayerDevice device, int threads = 1) {
  EngineOptions o;
  o.threads = threads;
  o.layer_device = device;
  auto e = Engine::Create(c, std::move(w), o);
  if (!e.ok()) {
    ADD_FAILURE() << e.status().ToString();
    return nullptr;
  }
  return std::move(*e);
}

// InitWeights(c, seed), shared by the engines a test compares (aborts the test binary when the
// config cannot be initialised: every caller's config is a fixture's).
std::shared_ptr<const ModelWeights> SharedWeights(const EngineConfig& c, uint64_t seed) {
  auto w = InitWeights(c, seed);
  if (!w.ok()) {
    ADD_FAILURE() << w.status().ToString();
    std::abort();
  }
  return std::make_shared<const ModelWeights>(std::move(*w));
}

// The logits of a fixed run on `e`: three sequences prefilled on the CPU path (Forward), then
// decode steps batching all three, a verify-sized pass (5, 1 and 3 tokens) with every row's
// logits and the attention inputs captured, and more decode steps; every logits row in order,
// then the captures' recorded inputs.
std::vector<float> RunFixedPasses(Engine* e, int decode_steps) {
  const int V = e->config().vocab_size;
  std::vector<float> out;
  std::vector<SequenceState> st;
  const int prompt_len[3] = {40, 17, 70};
  for (int i = 0; i < 3; ++i) {
    st.push_back(e->NewSequence());
    std::vector<float> logits;
    EXPECT_TRUE(e->Forward(&st[i], Prompt(prompt_len[i], 10 + i), false, &logits).ok());
  }
  std::vector<SequenceState*> ptr = {&st[0], &st[1], &st[2]};
  std::vector<std::vector<float>> last, all;
  std::vector<int32_t> next = {5, 6, 7};
  auto decode = [&] {
    std::vector<std::span<const int32_t>> toks;
    for (int i = 0; i < 3; ++i) toks.emplace_back(&next[i], 1);
    const Status s = e->ForwardBatch(ptr, toks, &last);
    EXPECT_TRUE(s.ok()) << s.ToString();
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(last[i].size(), static_cast<size_t>(V));
      out.insert(out.end(), last[i].begin(), last[i].end());
      next[i] = testutil::Argmax(last[i].data(), V);
    }
  };
  for (int s = 0; s < decode_steps; ++s) decode();
  // A verify-sized pass: several rows per sequence, every row's logits, captured inputs.
  const std::vector<std::vector<int32_t>> draft = {{9, 10, 11, 12, 13}, {14}, {15, 16, 17}};
  std::vector<std::span<const int32_t>> toks(draft.begin(), draft.end());
  std::vector<AttnInputCapture> cap(3);
  for (AttnInputCapture& c : cap) c.layers = {1, e->config().num_hidden_layers - 1};
  std::vector<AttnInputCapture*> cptr = {&cap[0], nullptr, &cap[2]};
  const Status s = e->ForwardBatch(ptr, toks, &last, &all, cptr);
  EXPECT_TRUE(s.ok()) << s.ToString();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(all[i].size(), draft[i].size() * V);
    out.insert(out.end(), all[i].begin(), all[i].end());
    out.insert(out.end(), last[i].begin(), last[i].end());
  }
  for (const AttnInputCapture& c : cap) {
    for (const auto& v : c.stream_mean) out.insert(out.end(), v.begin(), v.end());
    for (const auto& v : c.normed) out.insert(out.end(), v.begin(), v.end());
  }
  for (int s2 = 0; s2 < decode_steps; ++s2) decode();
  return out;
}

TEST(DeviceLayers, HostTwinIsTheCpuPathBitForBit) {
  // The tiny schedule with MXFP4 routed experts and FP8 projections too: the device reads the
  // rounded floats whose products the CPU takes from the packed codes.
  EngineConfig coded = testutil::TinyConfig();
  coded.expert_format = ExpertFormat::kMxfp4;
  coded.weight_format = WeightFormat::kFp8;
  ASSERT_TRUE(coded.Validate().ok());
  const EngineConfig* const configs[] = {&testutil::TinyConfig(), &coded, &testutil::MiniConfig()};
  for (const EngineConfig* c : configs) {
    auto w = c == &testutil::MiniConfig() ? testutil::MiniWeights() : SharedWeights(*c, 3);
    auto cpu = MakeEngine(*c, w, LayerDevice::kCpu);
    auto twin = MakeEngine(*c, w, LayerDevice::kHostTwin);
    ASSERT_NE(cpu, nullptr);
    ASSERT_NE(twin, nullptr);
    EXPECT_EQ(cpu->DeviceWeightBytes(), 0u);
    EXPECT_GT(twin->DeviceWeightBytes(), 0u);
    const std::vector<float> a = RunFixedPasses(cpu.get(), 4), b = RunFixedPasses(twin.get(), 4);
    ASSERT_EQ(a.size(), b.size());
    size_t first_diff = a.size();
    for (size_t i = 0; i < a.size() && first_diff == a.size(); ++i) {
      if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) first_diff = i;
    }
    EXPECT_EQ(first_diff, a.size())
        << "hidden " << c->hidden_size << ": element " << first_diff << " differs ("
        << a[first_diff] << " vs " << b[first_diff] << ")";
  }
}

// Every single-sequence pass (Forward with every row's logits, PrefillCed and ExtendCed in
// pieces, decode, and ReplayTail over imported units) with its attention inputs captured: the
// host twin's logits and captures are the CPU path's bits.
std::vector<float> RunSinglePasses(Engine* e) {
  const EngineConfig& c = e->config();
  std::vector<float> out;
  AttnInputCapture cap;
  cap.layers = {0, c.num_hidden_layers - 1};
  e->set_attn_capture(&cap);
  const std::vector<int32_t> tokens = Prompt(150, 21);
  std::vector<float> logits;
  SequenceState full = e->NewSequence();
  EXPECT_TRUE(e->Forward(&full, std::span(tokens).first(130), true, &logits).ok());
  out.insert(out.end(), logits.begin(), logits.end());
  for (int i = 130; i < 150; ++i) {
    EXPECT_TRUE(e->Decode(&full, tokens[i], &logits).ok());
    out.insert(out.end(), logits.begin(), logits.end());
  }
  SequenceState ced = e->NewSequence();
  EXPECT_TRUE(e->PrefillCed(&ced, std::span(tokens).first(90), &logits).ok());
  out.insert(out.end(), logits.begin(), logits.end());
  EXPECT_TRUE(e->ExtendCed(&ced, std::span(tokens).subspan(90, 40), &logits).ok());
  out.insert(out.end(), logits.begin(), logits.end());
  e->set_attn_capture(nullptr);
  for (const auto& v : cap.stream_mean) out.insert(out.end(), v.begin(), v.end());
  for (const auto& v : cap.normed) out.insert(out.end(), v.begin(), v.end());
  // Two whole units of `full` imported into a new state, then the bounded replay of its tail.
  auto kv = EngineKvLayout(c, 64);
  EXPECT_TRUE(kv.ok());
  if (!kv.ok()) return out;
  const UnitPayloadLayout layout = UnitPayloadLayout::For(*kv);
  SequenceState st = e->NewSequence();
  for (int64_t page = 0; page < 2; ++page) {
    auto p = ExportUnitPayload(layout, full, page);
    EXPECT_TRUE(p.ok());
    if (!p.ok()) return out;
    EXPECT_TRUE(ImportUnitPayload(layout, *p, std::span(tokens).subspan(page * 64, 64), &st).ok());
  }
  EXPECT_TRUE(e->ReplayTail(&st, 2 * c.sliding_window, &logits).ok());
  out.insert(out.end(), logits.begin(), logits.end());
  return out;
}

TEST(DeviceLayers, HostTwinRunsEverySingleSequencePassAsTheCpuPath) {
  const EngineConfig& c = testutil::TinyConfig();
  auto w = SharedWeights(c, 9);
  auto cpu = MakeEngine(c, w, LayerDevice::kCpu);
  auto twin = MakeEngine(c, w, LayerDevice::kHostTwin, 2);
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(twin, nullptr);
  const std::vector<float> a = RunSinglePasses(cpu.get()), b = RunSinglePasses(twin.get());
  ASSERT_EQ(a.size(), b.size());
  EXPECT_GT(a.size(), 150u * c.vocab_size);
  EXPECT_TRUE(BitEqual(a.data(), b.data(), a.size()));
}

TEST(DeviceLayers, HostTwinOnTwoThreadsIsItsOneThreadBits) {
  const EngineConfig& c = testutil::TinyConfig();
  auto w = SharedWeights(c, 5);
  auto one = MakeEngine(c, w, LayerDevice::kHostTwin, 1);
  auto two = MakeEngine(c, w, LayerDevice::kHostTwin, 2);
  ASSERT_NE(one, nullptr);
  ASSERT_NE(two, nullptr);
  const std::vector<float> a = RunFixedPasses(one.get(), 2), b = RunFixedPasses(two.get(), 2);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(BitEqual(a.data(), b.data(), a.size()));
}

// A StepTrace needs every sublayer's mixes on the host: the pass runs on the CPU path, and its
// trace is the CPU path's.
TEST(DeviceLayers, ATracedPassRunsOnTheCpuPath) {
  const EngineConfig& c = testutil::TinyConfig();
  auto w = SharedWeights(c, 3);
  auto cpu = MakeEngine(c, w, LayerDevice::kCpu);
  auto twin = MakeEngine(c, w, LayerDevice::kHostTwin);
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(twin, nullptr);
  StepTrace tc, tt;
  cpu->set_trace(&tc);
  twin->set_trace(&tt);
  for (Engine* e : {cpu.get(), twin.get()}) {
    SequenceState st = e->NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(e->Forward(&st, Prompt(20, 4), false, &logits).ok());
    std::vector<SequenceState*> ptr = {&st};
    const std::vector<int32_t> t = {8, 9};
    std::vector<std::span<const int32_t>> toks = {t};
    std::vector<std::vector<float>> last;
    ASSERT_TRUE(e->ForwardBatch(ptr, toks, &last).ok());
  }
  ASSERT_EQ(tc.comb.size(), tt.comb.size());
  for (size_t i = 0; i < tc.comb.size(); ++i) EXPECT_EQ(tc.comb[i], tt.comb[i]) << i;
  EXPECT_FALSE(tt.comb.empty() || tt.comb[0].empty());
}

TEST(DeviceLayers, RefusesMoreExpertsPerTokenThanItsKernelsTake) {
  EngineConfig c = testutil::TinyConfig();
  c.n_routed_experts = 2 * device::kDeviceExpertsPerTokenMax;
  c.num_experts_per_tok = device::kDeviceExpertsPerTokenMax + 1;
  ASSERT_TRUE(c.Validate().ok());
  auto w = InitWeights(c, 3);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EngineOptions o;
  o.layer_device = LayerDevice::kHostTwin;
  auto e = Engine::Create(c, std::make_shared<const ModelWeights>(std::move(*w)), o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument) << e.status().ToString();
}

// Device weights of `c` all read from `values` (at least 2^20 floats); layer 1 lacks the
// indexer's and the compressor's.
device::DeviceModelWeights WeightsFrom(const EngineConfig& c, const std::vector<float>& values) {
  device::DeviceModelWeights w;
  const float* v = values.data();
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    device::DeviceLayerWeights d;
    for (int s = 0; s < 2; ++s) d.norm[s] = d.hc_fn[s] = d.hc_scale[s] = d.hc_base[s] = v;
    d.gate = d.gate_bias = v;
    d.w1.assign(c.n_routed_experts, v);
    d.w2 = d.w3 = d.w1;
    d.wq_a = d.q_norm = d.wq_b = d.wkv = d.kv_norm = d.wo_a = d.wo_b = d.sink = v;
    if (l == 0) d.i_wproj = d.i_wq_b = d.c_wkv = d.c_wgate = v;
    w.layers.push_back(d);
  }
  w.norm_w = w.head_w = v;
  return w;
}

// Host-twin device layers of c over w, their mirrors limited to mirror_max bytes (null, with a
// failure recorded, when Create fails).
std::unique_ptr<device::DeviceLayers> HostLayers(const EngineConfig& c,
                                                 const device::DeviceModelWeights& w,
                                                 size_t mirror_max) {
  auto d = device::DeviceLayers::Create(
      device::DeviceKind::kHost, c, w, device::DeviceLayers::kAttentionWeightsBytesMax, mirror_max);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return d.ok() ? std::move(*d) : nullptr;
}

// 2^20 floats uniform in [-0.5, 0.5), for WeightsFrom.
std::vector<float> RandomValues(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<float> v(1 << 20);
  for (float& x : v) x = u(rng);
  return v;
}

// The SWA side of a pass's keys: rings read by slot (source i < rings.size()) and entries
// uploaded with the pass (source rings.size(): entry j of data / scales, head_dim bytes each).
struct SwaTable {
  std::vector<device::DeviceLayers::SwaSource> rings;
  std::vector<int32_t> source, entry;
  std::vector<uint8_t> data, scales;
  // Only uploaded entries, each read once in order.
  static SwaTable Uploaded(std::vector<uint8_t> data, std::vector<uint8_t> scales, int head_dim) {
    SwaTable t;
    const int32_t count = static_cast<int32_t>(data.size() / head_dim);
    for (int32_t j = 0; j < count; ++j) {
      t.source.push_back(0);
      t.entry.push_back(j);
    }
    t.data = std::move(data);
    t.scales = std::move(scales);
    return t;
  }
};

// Attention keys over the given tables and lists (main_source / main_entry name the global
// entries, swa the SWA entries).
device::DeviceLayers::AttentionKeys KeysOf(std::span<const device::DeviceLayers::KvSource> sources,
                                           const std::vector<int32_t>& main_source,
                                           const std::vector<int32_t>& main_entry,
                                           const SwaTable& swa, int head_dim,
                                           const std::vector<int32_t>& keys,
                                           const std::vector<int32_t>& key_off,
                                           const std::vector<float>& rope_c,
                                           const std::vector<float>& rope_s) {
  device::DeviceLayers::AttentionKeys k;
  k.sources = sources;
  k.main_source = main_source.data();
  k.main_entry = main_entry.data();
  k.main = static_cast<int64_t>(main_entry.size());
  k.rings = swa.rings;
  k.swa_source = swa.source.data();
  k.swa_entry = swa.entry.data();
  k.swa = static_cast<int64_t>(swa.entry.size());
  k.swa_data = swa.data.data();
  k.swa_scales = swa.scales.data();
  k.uploaded = static_cast<int64_t>(swa.data.size()) / head_dim;
  k.keys = keys.data();
  k.key_off = key_off.data();
  k.rope_c = rope_c.data();
  k.rope_s = rope_s.data();
  return k;
}

// A pass's host rows: n rows of residual (uniform in [-0.5, 0.5) from rng) and of pre (0.25
// each), and room for the SWA entries AttentionProducts downloads.
struct PassRows {
  int n;
  std::vector<float> x, pre, kv;
};
PassRows RandomRows(const EngineConfig& c, int n, std::mt19937* rng) {
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  PassRows r{n, std::vector<float>(static_cast<size_t>(n) * c.hc_mult * c.hidden_size),
             std::vector<float>(static_cast<size_t>(n) * c.hc_mult, 0.25f),
             std::vector<float>(static_cast<size_t>(n) * c.head_dim)};
  for (float& v : r.x) v = u(*rng);
  return r;
}

// A pass of `rows` on d through layer's attention sublayer with keys k: the residual after it
// (empty, with a failure recorded, when a step fails).
std::vector<float> AttendOnce(device::DeviceLayers& d, int layer, PassRows& rows,
                              const device::DeviceLayers::AttentionKeys& k) {
  std::vector<float> out(rows.x.size());
  const bool ok = d.Begin(rows.n, rows.x.data(), rows.pre.data()).ok() &&
                  d.AttentionInput(layer, nullptr).ok() &&
                  d.AttentionProducts(layer, {nullptr, rows.kv.data()}).ok();
  const Status s = ok ? d.Attention(layer, k) : Status::Internal("the pass did not start");
  if (!s.ok() || !d.AttentionOutput(layer, nullptr).ok() || !d.Residual(out.data()).ok()) {
    ADD_FAILURE() << s.ToString();
    return {};
  }
  return out;
}

// The attention entry points refuse what they cannot compute: kv not asked for, the indexer's
// query without its weights (or the reverse), a product of a weight the layer lacks, a layer out
// of range; attention without the layer's products or with keys that break the contract (offsets
// not from 0, a row without keys, an index outside the table, a global entry outside its cache,
// an SWA entry outside the uploaded ones or its ring or in a slot never written, a cache or ring
// without identity or bytes, one twice, bytes or rotations missing); an output without the
// layer's attention. Each weight is read as one shared buffer of ones (the shapes, not the values,
// are under test).
TEST(DeviceLayers, AttentionEntryPointsRefuseWhatTheyCannotCompute) {
  const EngineConfig c = testutil::TinyConfig();
  const std::vector<float> ones(1 << 20, 1.0f);
  const device::DeviceModelWeights w = WeightsFrom(c, ones);
  auto dev = device::DeviceLayers::Create(device::DeviceKind::kHost, c, w);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  const int n = 2, D = c.hidden_size, hc = c.hc_mult, hd = c.head_dim;
  const int Hd = c.num_attention_heads * hd, IH = c.index_n_heads;
  std::vector<float> x(static_cast<size_t>(n) * hc * D, 0.5f),
      pre(static_cast<size_t>(n) * hc, 0.25f);
  std::vector<float> q(static_cast<size_t>(n) * Hd), kv(static_cast<size_t>(n) * hd);
  std::vector<float> iq(static_cast<size_t>(n) * IH * c.index_head_dim),
      wts(static_cast<size_t>(n) * IH);
  std::vector<float> ckv(kv.size());
  device::DeviceLayers& d = **dev;
  // No pass yet.
  EXPECT_EQ(d.AttentionProducts(0, {q.data(), kv.data()}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(d.Begin(n, x.data(), pre.data()).ok());
  ASSERT_TRUE(d.AttentionInput(0, nullptr).ok());
  auto code = [&](int layer, const device::DeviceLayers::AttentionRows& r) {
    return d.AttentionProducts(layer, r).code();
  };
  EXPECT_EQ(code(0, {q.data(), nullptr}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(0, {q.data(), kv.data(), iq.data(), nullptr}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(0, {q.data(), kv.data(), nullptr, wts.data()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(1, {q.data(), kv.data(), iq.data(), wts.data()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(1, {q.data(), kv.data(), nullptr, nullptr, ckv.data()}),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code(c.num_hidden_layers, {q.data(), kv.data()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(d.AttentionOutput(-1, q.data()).code(), StatusCode::kInvalidArgument);
  // What the layer has it gives: every product of layer 0, q and kv of layer 1.
  EXPECT_EQ(code(0, {q.data(), kv.data(), iq.data(), wts.data(), ckv.data(), ckv.data()}),
            StatusCode::kOk);
  EXPECT_EQ(code(1, {q.data(), kv.data()}), StatusCode::kOk);
  EXPECT_TRUE(d.AttentionOutput(1, q.data()).ok());
  EXPECT_EQ(code(1, {nullptr, kv.data()}), StatusCode::kOk);  // q stays on the device

  // Attention: two rows over a table of one global entry (entry 1 of a source of two) and two
  // SWA entries.
  const int pairs = c.qk_rope_head_dim / 2;
  const std::vector<uint8_t> main_data(2 * hd / 2, 0x21), main_scales(2 * hd / 16, 0x38);
  SwaTable swa = SwaTable::Uploaded(std::vector<uint8_t>(2 * hd, 0x30),
                                    std::vector<uint8_t>(2 * hd / 32, 127), hd);
  const std::vector<float> rope_c(n * pairs, 1.0f), rope_s(n * pairs, 0.0f);
  std::vector<int32_t> keys = {0, 1, 0, 1, 2}, key_off = {0, 2, 5};
  std::vector<device::DeviceLayers::KvSource> sources(1);
  sources[0] = {&sources, 7, 0, 0, 2, main_data.data(), main_scales.data()};
  std::vector<int32_t> main_source = {0};
  std::vector<int32_t> main_entry = {1};
  auto good = [&] {
    return KeysOf(sources, main_source, main_entry, swa, hd, keys, key_off, rope_c, rope_s);
  };
  auto attend = [&](int layer, const device::DeviceLayers::AttentionKeys& k) {
    return d.Attention(layer, k).code();
  };
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);  // layer 1's products are there
  ASSERT_EQ(code(0, {nullptr, kv.data()}), StatusCode::kOk);
  EXPECT_EQ(d.AttentionOutput(0, nullptr).code(), StatusCode::kInvalidArgument);
  auto k = good();
  k.rope_s = nullptr;
  EXPECT_EQ(attend(0, k), StatusCode::kInvalidArgument);
  k = good();
  k.main_entry = nullptr;
  EXPECT_EQ(attend(0, k), StatusCode::kInvalidArgument);
  // A global entry outside its source (or a source that does not exist), a source without
  // identity or bytes, a source twice.
  for (auto [src, entry] : {std::pair{0, 2}, std::pair{0, -1}, std::pair{1, 0}, std::pair{-1, 0}}) {
    main_source[0] = src;
    main_entry[0] = entry;
    EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument) << src << " " << entry;
  }
  main_source[0] = 0;
  main_entry[0] = 1;
  sources[0].id = nullptr;
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  sources[0].id = &sources;
  sources[0].scales = nullptr;
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  sources[0].scales = main_scales.data();
  sources.push_back(sources[0]);
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  sources.pop_back();
  k = good();
  k.swa = -1;
  EXPECT_EQ(attend(0, k), StatusCode::kInvalidArgument);
  k = good();
  k.uploaded = -1;
  EXPECT_EQ(attend(0, k), StatusCode::kInvalidArgument);
  k = good();
  k.swa_entry = nullptr;
  EXPECT_EQ(attend(0, k), StatusCode::kInvalidArgument);
  // An SWA entry outside the uploaded ones, or of a ring that is not there.
  for (auto [src, entry] : {std::pair{0, 2}, std::pair{0, -1}, std::pair{1, 0}, std::pair{-1, 0}}) {
    swa.source[0] = src;
    swa.entry[0] = entry;
    EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument) << src << " " << entry;
  }
  // From here the first SWA entry is slot 0 of a ring of two slots (slot 1 never written), the
  // second uploaded entry 0: a slot never written or past the ring, a ring without identity,
  // stamps or slots, a ring twice or under a source's identity.
  const std::vector<uint8_t> ring_data(2 * hd, 0x31), ring_scales(2 * hd / 32, 126);
  const std::vector<uint64_t> stamps = {NextHistoryNumber(), 0};
  swa.rings = {{&stamps, 2, stamps.data(), ring_data.data(), ring_scales.data()}};
  swa.source = {0, 1};
  for (auto [slot, uploaded] : {std::pair{1, 0}, std::pair{2, 0}, std::pair{0, 2}}) {
    swa.entry = {slot, uploaded};
    EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument) << slot << " " << uploaded;
  }
  swa.entry = {0, 0};
  const device::DeviceLayers::SwaSource ring = swa.rings[0];
  swa.rings[0].id = nullptr;
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  swa.rings[0] = ring;
  swa.rings[0].stamps = nullptr;
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  swa.rings[0] = ring;
  swa.rings[0].slots = 0;
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  swa.rings[0] = ring;
  swa.rings[0].id = sources[0].id;
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  swa.rings[0] = ring;
  swa.rings.push_back(ring);
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  swa.rings.pop_back();
  for (auto [at, value] : {std::pair{0, 3}, std::pair{4, -1}, std::pair{2, 7}}) {
    keys[at] = value;  // outside the table of 3
    EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument) << at;
    keys = {0, 1, 0, 1, 2};
  }
  key_off = {1, 2, 5};
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  key_off = {0, 2, 2};  // row 1 without keys
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  key_off = {0, 3, 2};
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);
  key_off = {0, 2, 5};
  EXPECT_EQ(attend(0, good()), StatusCode::kOk);
  EXPECT_EQ(d.AttentionOutput(1, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d.AttentionOutput(0, nullptr).code(), StatusCode::kOk);
  EXPECT_EQ(d.AttentionOutput(0, nullptr).code(), StatusCode::kInvalidArgument);  // used once
  EXPECT_EQ(attend(0, good()), StatusCode::kInvalidArgument);  // its q was rotated already
}

// Attention over more rows than its weights' memory limit holds runs the rows in groups (here one
// row each: a limit of one byte), with the same bits as one group: three rows of different key
// counts, some keys shared, over random weights, compared through the residual after the
// sublayer's output.
TEST(DeviceLayers, AttentionInRowGroupsIsOneGroupsBits) {
  const EngineConfig c = testutil::TinyConfig();
  const std::vector<float> values = RandomValues(5);
  const device::DeviceModelWeights w = WeightsFrom(c, values);
  std::mt19937 rng(50);
  const int n = 3, hd = c.head_dim, pairs = c.qk_rope_head_dim / 2;
  PassRows rows = RandomRows(c, n, &rng);
  std::vector<uint8_t> main_data(6 * hd / 2), main_scales(6 * hd / 16, 0x38);
  std::vector<uint8_t> swa_data(3 * hd), swa_scales(3 * hd / 32, 126);
  for (uint8_t& b : main_data) b = static_cast<uint8_t>(rng());
  for (uint8_t& b : swa_data) b = static_cast<uint8_t>(rng() % 0x7e);  // no NaN codes
  const SwaTable swa = SwaTable::Uploaded(swa_data, swa_scales, hd);
  std::vector<float> rope_c(n * pairs), rope_s(n * pairs);
  for (size_t i = 0; i < rope_c.size(); ++i) {
    rope_c[i] = std::cos(0.3f * static_cast<float>(i));
    rope_s[i] = std::sin(0.3f * static_cast<float>(i));
  }
  const std::vector<int32_t> keys = {0, 4, 1, 2, 4, 5, 3, 0, 6, 5, 4}, key_off = {0, 2, 6, 11};
  // Table rows 0-3: entries 5, 0, 2, 3 of a source of six.
  const device::DeviceLayers::KvSource source = {&main_data,        3, 0, 0, 6, main_data.data(),
                                                 main_scales.data()};
  const std::vector<int32_t> main_source(4, 0), main_entry = {5, 0, 2, 3};
  const auto k = KeysOf(std::span(&source, 1), main_source, main_entry, swa, hd, keys, key_off,
                        rope_c, rope_s);
  auto residual = [&](size_t limit) {
    auto dev = device::DeviceLayers::Create(device::DeviceKind::kHost, c, w, limit);
    EXPECT_TRUE(dev.ok()) << dev.status().ToString();
    if (!dev.ok()) return std::vector<float>{};
    return AttendOnce(**dev, 1, rows, k);
  };
  const std::vector<float> one = residual(device::DeviceLayers::kAttentionWeightsBytesMax),
                           grouped = residual(1);
  ASSERT_EQ(one.size(), rows.x.size());
  EXPECT_TRUE(BitEqual(one.data(), grouped.data(), one.size()));
  EXPECT_FALSE(BitEqual(one.data(), rows.x.data(), rows.x.size()));  // the sublayer changed it
  for (size_t i = 0; i < one.size(); ++i) ASSERT_TRUE(std::isfinite(one[i])) << i;
}

// Speculative rounds on the host twin (a verify pass of six tokens, rolled back to a few of them,
// then a decode step) answer as on the CPU path, round after round: rejected positions'
// global entries, rewritten at the same indices by the next pass, are not read from the device's
// mirror of the old ones; nor are those of another copy of the state that ran before at the same
// address. Short prompts, so that the top-k selects nearly every entry.
TEST(DeviceLayers, HostTwinRollbackThenDecodeIsTheCpuPath) {
  const EngineConfig& c = testutil::TinyConfig();
  auto w = SharedWeights(c, 5);
  auto cpu = MakeEngine(c, w, LayerDevice::kCpu);
  auto twin = MakeEngine(c, w, LayerDevice::kHostTwin);
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(twin, nullptr);
  AttnInputCapture cap;
  cap.layers = c.kv_source_layer_ids;
  auto run = [&](Engine* e) {
    std::vector<float> out, logits;
    for (int len : {9, 20}) {
      SequenceState st = e->NewSequence();
      EXPECT_TRUE(e->Forward(&st, Prompt(len, 3 + len), false, &logits).ok());
      for (int round = 0; round < 4; ++round) {
        VerifyCheckpoint cp;
        SaveCheckpoint(st, &cp);
        cap.from_pos = cp.tokens;
        e->set_attn_capture(&cap);
        const std::vector<int32_t> verify = Prompt(6, 50 + 7 * round);
        EXPECT_TRUE(e->Forward(&st, verify, true, &logits).ok());
        e->set_attn_capture(nullptr);
        out.insert(out.end(), logits.begin(), logits.end());
        const Status s = RollbackTo(c, *w, cp, cap, cp.tokens + 1 + round % 3, &st);
        EXPECT_TRUE(s.ok()) << s.ToString();
        EXPECT_TRUE(e->Decode(&st, 9 + round, &logits).ok());
        out.insert(out.end(), logits.begin(), logits.end());
      }
      // Copies of one state, each run on from the same address: a copy's entries are its own.
      for (int keep = 0; keep < 3; ++keep) {
        SequenceState spec = st;
        const std::vector<int32_t> more = Prompt(4, 90 + keep);
        EXPECT_TRUE(e->Forward(&spec, more, false, &logits).ok());
        out.insert(out.end(), logits.begin(), logits.end());
      }
    }
    return out;
  };
  const std::vector<float> want = run(cpu.get()), got = run(twin.get());
  ASSERT_EQ(want.size(), got.size());
  ASSERT_FALSE(want.empty());
  EXPECT_TRUE(BitEqual(want.data(), got.data(), want.size()));
}

// The mirror of a global KV source follows the source's history (KvEpoch): entries appended
// under one epoch are added, a truncation's new epoch keeps the parent's first entries and
// replaces the rest, a new epoch without a parent is copied whole; under an unchanged epoch the
// mirror is trusted (rewriting bytes without a new epoch is not seen: the entries did not cross
// again). Every answer is compared with a device that never saw the source. Past its byte limit
// the least recently read mirror is dropped (and copied again when read); a source larger than
// the limit alone is Rejected.
TEST(DeviceLayers, KvMirrorFollowsItsSourcesHistory) {
  const EngineConfig c = testutil::TinyConfig();
  const std::vector<float> values = RandomValues(9);
  const device::DeviceModelWeights w = WeightsFrom(c, values);
  std::mt19937 rng(90);
  const int n = 1, hd = c.head_dim, pairs = c.qk_rope_head_dim / 2;
  const size_t mdb = hd / 2, msb = hd / 16;
  PassRows rows = RandomRows(c, n, &rng);
  const SwaTable swa =
      SwaTable::Uploaded(std::vector<uint8_t>(hd, 0x30), std::vector<uint8_t>(hd / 32, 126), hd);
  const std::vector<float> rope_c(n * pairs, 1.0f), rope_s(n * pairs, 0.0f);
  // A source's bytes: entries of random codes.
  struct Source {
    std::vector<uint8_t> data, scales;
    size_t mdb;
    device::DeviceLayers::KvSource view(const void* id, uint64_t epoch, uint64_t parent = 0,
                                        int64_t keep = 0) const {
      return {id,          epoch,        parent, keep, static_cast<int64_t>(data.size() / mdb),
              data.data(), scales.data()};
    }
  };
  auto entries = [&](int count) {
    Source s;
    s.mdb = mdb;
    s.data.resize(count * mdb);
    s.scales.assign(count * msb, 0x38);
    for (uint8_t& b : s.data) b = static_cast<uint8_t>(rng());
    return s;
  };
  // The residual after attending to `read` (entries of source v) and the SWA entry.
  auto answer = [&](device::DeviceLayers& d, const device::DeviceLayers::KvSource& v,
                    const std::vector<int32_t>& read) {
    const std::vector<int32_t> main_source(read.size(), 0);
    std::vector<int32_t> keys, key_off = {0};
    for (size_t i = 0; i <= read.size(); ++i) keys.push_back(static_cast<int32_t>(i));
    key_off.push_back(static_cast<int32_t>(keys.size()));
    return AttendOnce(
        d, 1, rows,
        KeysOf(std::span(&v, 1), main_source, read, swa, hd, keys, key_off, rope_c, rope_s));
  };
  auto fresh = [&](size_t mirror_max = device::DeviceLayers::kKvMirrorBytesMax) {
    return HostLayers(c, w, mirror_max);
  };
  // The same as a device that never saw the source.
  auto cold = [&](const device::DeviceLayers::KvSource& v, const std::vector<int32_t>& read) {
    auto d = fresh();
    return answer(*d, v, read);
  };
  auto dev = fresh();
  int id = 0;  // the source's identity: its address
  Source a = entries(4);
  auto va = a.view(&id, 1);
  EXPECT_EQ(answer(*dev, va, {3, 1}), cold(va, {3, 1}));
  EXPECT_EQ(dev->mirrors(), 1u);
  // Appended under the same epoch.
  Source more = entries(2);
  a.data.insert(a.data.end(), more.data.begin(), more.data.end());
  a.scales.insert(a.scales.end(), more.scales.begin(), more.scales.end());
  va = a.view(&id, 1);
  EXPECT_EQ(answer(*dev, va, {5, 0, 4}), cold(va, {5, 0, 4}));
  // Truncated to 3, then three new entries: epoch 2, parent 1 keeping 3.
  Source b = entries(3);
  a.data.resize(3 * mdb);
  a.scales.resize(3 * msb);
  a.data.insert(a.data.end(), b.data.begin(), b.data.end());
  a.scales.insert(a.scales.end(), b.scales.begin(), b.scales.end());
  va = a.view(&id, 2, 1, 3);
  EXPECT_EQ(answer(*dev, va, {3, 4, 2}), cold(va, {3, 4, 2}));
  // Rewritten from the start under a new epoch without a parent.
  a = entries(6);
  va = a.view(&id, 3);
  EXPECT_EQ(answer(*dev, va, {0, 5}), cold(va, {0, 5}));
  // Bytes rewritten under the same epoch are not seen: the mirror is what is read.
  const std::vector<float> trusted = answer(*dev, va, {0});
  std::fill(a.data.begin(), a.data.begin() + mdb, uint8_t{0x77});
  EXPECT_EQ(answer(*dev, va, {0}), trusted);
  EXPECT_NE(cold(va, {0}), trusted);
  // Two sources under a limit that holds one mirror: each read drops the other's and copies its
  // own again; the answers stay true.
  const size_t one = 64 * (mdb + msb);  // a mirror's first size
  auto small = fresh(one);
  int id2 = 0;
  const Source s2 = entries(5);
  const auto v2 = s2.view(&id2, 4);
  for (int round = 0; round < 2; ++round) {
    EXPECT_EQ(answer(*small, va, {2}), cold(va, {2})) << round;
    EXPECT_EQ(small->mirrors(), 1u);
    EXPECT_EQ(answer(*small, v2, {4}), cold(v2, {4})) << round;
    EXPECT_EQ(small->mirrors(), 1u);
    EXPECT_LE(small->mirror_bytes(), one);
  }
  // A source past the limit alone.
  const Source big = entries(65);
  int id3 = 0;
  const auto v3 = big.view(&id3, 5);
  ASSERT_TRUE(small->Begin(n, rows.x.data(), rows.pre.data()).ok());
  ASSERT_TRUE(small->AttentionInput(1, nullptr).ok());
  ASSERT_TRUE(small->AttentionProducts(1, {nullptr, rows.kv.data()}).ok());
  const std::vector<int32_t> main_source = {0}, keys = {0, 1}, key_off = {0, 2};
  const std::vector<int32_t> read = {64};
  const auto k =
      KeysOf(std::span(&v3, 1), main_source, read, swa, hd, keys, key_off, rope_c, rope_s);
  EXPECT_EQ(small->Attention(1, k).code(), StatusCode::kRejected);
}

// The mirror of an SWA ring follows the ring's stamps: a slot whose stamp the mirror holds is
// trusted (bytes rewritten without a new stamp are not seen: they did not cross again), a new
// stamp's bytes are copied, and a slot restored with its old bytes and stamp (a verify pass's
// checkpoint) reads the restored bytes, not the newer ones the mirror had. Read beside uploaded
// SWA entries and a global source, and at an address that named a cache before (a dead
// object's): every answer is a cold device's. Past its byte limit the least recently read mirror
// is dropped (two rings under a one-ring limit take turns); a ring larger than the limit alone is
// Rejected.
TEST(DeviceLayers, SwaMirrorFollowsItsRingsStamps) {
  const EngineConfig c = testutil::TinyConfig();
  const std::vector<float> values = RandomValues(13);
  const device::DeviceModelWeights w = WeightsFrom(c, values);
  std::mt19937 rng(130);
  const int n = 1, hd = c.head_dim, pairs = c.qk_rope_head_dim / 2, W = 4;
  const size_t sdb = hd, ssb = hd / 32, ring_bytes = W * (sdb + ssb);
  PassRows rows = RandomRows(c, n, &rng);
  const std::vector<float> rope_c(n * pairs, 1.0f), rope_s(n * pairs, 0.0f);
  struct Ring {
    std::vector<uint8_t> data, scales;
    std::vector<uint64_t> stamps;
    device::DeviceLayers::SwaSource view() const {
      return {this, static_cast<int64_t>(stamps.size()), stamps.data(), data.data(), scales.data()};
    }
  };
  // New bytes in `slot` (random codes, no NaN), with a new stamp unless told otherwise.
  auto write = [&](Ring* r, int slot, bool stamp = true) {
    for (size_t i = 0; i < sdb; ++i) r->data[slot * sdb + i] = static_cast<uint8_t>(rng() % 0x7e);
    for (size_t i = 0; i < ssb; ++i)
      r->scales[slot * ssb + i] = static_cast<uint8_t>(125 + rng() % 3);
    if (stamp) r->stamps[slot] = NextHistoryNumber();
  };
  auto ring_of = [&] {
    Ring r{std::vector<uint8_t>(W * sdb), std::vector<uint8_t>(W * ssb), std::vector<uint64_t>(W)};
    for (int j = 0; j < W; ++j) write(&r, j);
    return r;
  };
  // The residual after attending to slots `read` of the ring (in that order), then to the
  // uploaded entries and the global source's entries when given.
  const std::vector<uint8_t> up_data(2 * sdb, 0x2f), up_scales(2 * ssb, 126);
  const std::vector<uint8_t> main_data(3 * hd / 2, 0x35), main_scales(3 * hd / 16, 0x38);
  auto answer = [&](device::DeviceLayers& d, const Ring& r, const std::vector<int32_t>& read,
                    bool uploaded = false, const device::DeviceLayers::KvSource* src = nullptr) {
    SwaTable swa;
    swa.rings = {r.view()};
    for (int32_t slot : read) {
      swa.source.push_back(0);
      swa.entry.push_back(slot);
    }
    if (uploaded) {
      for (int32_t j : {0, 1}) {
        swa.source.push_back(1);  // after the ring
        swa.entry.push_back(j);
      }
      swa.data = up_data;
      swa.scales = up_scales;
    }
    const std::vector<int32_t> main_source(src != nullptr ? 2 : 0, 0), main_entry = {2, 0};
    std::vector<int32_t> keys, key_off = {0};
    const int64_t table = static_cast<int64_t>(main_source.size() + swa.entry.size());
    for (int32_t i = 0; i < table; ++i) keys.push_back(i);
    key_off.push_back(static_cast<int32_t>(keys.size()));
    std::span<const device::DeviceLayers::KvSource> sources;
    if (src != nullptr) sources = std::span(src, 1);
    return AttendOnce(
        d, 1, rows,
        KeysOf(sources, main_source, src != nullptr ? main_entry : std::vector<int32_t>{}, swa, hd,
               keys, key_off, rope_c, rope_s));
  };
  auto fresh = [&](size_t mirror_max = device::DeviceLayers::kKvMirrorBytesMax) {
    return HostLayers(c, w, mirror_max);
  };
  auto cold = [&](const Ring& r, const std::vector<int32_t>& read, bool uploaded = false,
                  const device::DeviceLayers::KvSource* src = nullptr) {
    auto d = fresh();
    return answer(*d, r, read, uploaded, src);
  };
  auto dev = fresh();
  Ring a = ring_of();
  const std::vector<int32_t> window = {2, 3, 0, 1};  // oldest first, wrapped
  EXPECT_EQ(answer(*dev, a, window), cold(a, window));
  EXPECT_EQ(dev->mirrors(), 1u);
  EXPECT_EQ(dev->mirror_bytes(), ring_bytes);
  // Bytes rewritten without a new stamp are not seen: the mirror is what is read.
  const std::vector<float> trusted = answer(*dev, a, window);
  write(&a, 3, /*stamp=*/false);
  EXPECT_EQ(answer(*dev, a, window), trusted);
  EXPECT_NE(cold(a, window), trusted);
  // A new stamp is.
  a.stamps[3] = NextHistoryNumber();
  EXPECT_EQ(answer(*dev, a, window), cold(a, window));
  // What crosses the bus: a read after one slot's new stamp moves W - 1 entries fewer than a
  // cold device's read, a read after none one entry fewer still (16-byte alignment aside).
  auto up_bytes = [&](device::DeviceLayers& d) {
    d.SetProfiling(true);
    answer(d, a, window);
    auto profile = d.TakeProfile();
    d.SetProfiling(false);
    int64_t bytes = 0;
    for (const device::OpStat& o : *profile) bytes += o.name == device::kCopyToDevice ? o.bytes : 0;
    return bytes;
  };
  write(&a, 2);
  const int64_t warm = up_bytes(*dev), quiet = up_bytes(*dev), cold_read = up_bytes(*fresh());
  const int64_t entry = static_cast<int64_t>(sdb + ssb);
  EXPECT_GE(cold_read - warm, (W - 1) * entry - 15);
  EXPECT_GE(warm - quiet, entry - 15);
  // A verify pass writes slot 0 and 1, its rollback restores them with their stamps.
  const Ring checkpoint = a;
  write(&a, 0);
  write(&a, 1);
  EXPECT_EQ(answer(*dev, a, window), cold(a, window));
  for (int j : {0, 1}) {
    std::copy_n(checkpoint.data.begin() + j * sdb, sdb, a.data.begin() + j * sdb);
    std::copy_n(checkpoint.scales.begin() + j * ssb, ssb, a.scales.begin() + j * ssb);
    a.stamps[j] = checkpoint.stamps[j];
  }
  EXPECT_EQ(answer(*dev, a, window), cold(a, window));
  // Beside uploaded entries and a global source; a slot never written is not read.
  write(&a, 2);
  a.stamps[1] = 0;
  const device::DeviceLayers::KvSource src = {&main_data,        11, 0, 0, 3, main_data.data(),
                                              main_scales.data()};
  EXPECT_EQ(answer(*dev, a, {2, 3, 0}, true, &src), cold(a, {2, 3, 0}, true, &src));
  // An address that named a cache, then names a ring, then the cache again (its epoch unchanged:
  // the device must not take the ring's bytes for the cache's entries).
  const device::DeviceLayers::KvSource at_a = {
      &a, 12, 0, 0, 3, main_data.data(), main_scales.data()};
  auto moved = fresh();
  Ring b = ring_of();
  EXPECT_EQ(answer(*moved, b, window, false, &at_a), cold(b, window, false, &at_a));
  EXPECT_EQ(answer(*moved, a, {0, 2}), cold(a, {0, 2}));
  EXPECT_EQ(answer(*moved, b, window, false, &at_a), cold(b, window, false, &at_a));
  // Two rings under a limit that holds one mirror: each read drops the other's and copies its
  // own again; the answers stay true.
  auto small = fresh(ring_bytes);
  for (int round = 0; round < 2; ++round) {
    EXPECT_EQ(answer(*small, a, {3, 0}), cold(a, {3, 0})) << round;
    EXPECT_EQ(small->mirrors(), 1u);
    EXPECT_EQ(answer(*small, b, window), cold(b, window)) << round;
    EXPECT_EQ(small->mirrors(), 1u);
    EXPECT_LE(small->mirror_bytes(), ring_bytes);
  }
  // A ring past the limit alone.
  auto tiny = fresh(ring_bytes - 1);
  ASSERT_TRUE(tiny->Begin(n, rows.x.data(), rows.pre.data()).ok());
  ASSERT_TRUE(tiny->AttentionInput(1, nullptr).ok());
  ASSERT_TRUE(tiny->AttentionProducts(1, {nullptr, rows.kv.data()}).ok());
  SwaTable swa;
  swa.rings = {a.view()};
  swa.source = {0};
  swa.entry = {0};
  const std::vector<int32_t> keys = {0}, key_off = {0, 1};
  const auto k = KeysOf({}, {}, {}, swa, hd, keys, key_off, rope_c, rope_s);
  EXPECT_EQ(tiny->Attention(1, k).code(), StatusCode::kRejected);
}

// The device profile counts every kernel and copy of a pass: one batched decode step of three
// sequences launches, per layer, two mixes and two residual updates, one router, the per-row
// products of the output groups and the routed (and shared) experts' down products, and the
// attention's kernels; it copies the attention products the host needs (not q) and the logits to
// the host, the residual around each Engram layer, and the pass's start, each layer's keys and
// the head's rows to the device. Profiling leaves
// the logits' bits alone; a take starts anew; with profiling off nothing is counted; an engine
// without device layers refuses.
TEST(DeviceLayers, HostTwinProfileCountsEveryKernelAndCopyOfAPass) {
  const EngineConfig& c = testutil::TinyConfig();
  auto w = SharedWeights(c, 3);
  auto plain = MakeEngine(c, w, LayerDevice::kHostTwin);
  auto profiled = MakeEngine(c, w, LayerDevice::kHostTwin);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(profiled, nullptr);
  const int L = c.num_hidden_layers, V = c.vocab_size, n = 3;
  int engram_layers = 0;
  for (int l = 0; l < L; ++l) engram_layers += c.IsEngramLayer(l);
  auto step = [&](Engine* e, std::vector<SequenceState>* st,
                  std::vector<std::vector<float>>* last) {
    if (st->empty()) {
      for (int i = 0; i < n; ++i) {
        st->push_back(e->NewSequence());
        std::vector<float> logits;
        ASSERT_TRUE(e->Forward(&st->back(), Prompt(20 + 7 * i, 30 + i), false, &logits).ok());
      }
    }
    std::vector<SequenceState*> ptr;
    for (SequenceState& s : *st) ptr.push_back(&s);
    const int32_t next[n] = {5, 6, 7};
    std::vector<std::span<const int32_t>> toks;
    for (int i = 0; i < n; ++i) toks.emplace_back(&next[i], 1);
    const Status s = e->ForwardBatch(ptr, toks, last);
    ASSERT_TRUE(s.ok()) << s.ToString();
  };
  std::vector<SequenceState> st_plain, st_profiled;
  std::vector<std::vector<float>> want, got;
  step(plain.get(), &st_plain, &want);
  step(profiled.get(), &st_profiled, &got);  // the prefill and first step: not profiled
  ASSERT_TRUE(profiled->TakeDeviceProfile().ok());
  ASSERT_TRUE(profiled->SetDeviceProfiling(true).ok());
  step(plain.get(), &st_plain, &want);
  step(profiled.get(), &st_profiled, &got);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(want[i].size(), got[i].size());
    EXPECT_TRUE(BitEqual(want[i].data(), got[i].data(), want[i].size())) << "sequence " << i;
  }
  auto profile = profiled->TakeDeviceProfile();
  ASSERT_TRUE(profile.ok()) << profile.status().ToString();
  auto find = [&](const char* name) -> device::OpStat {
    for (const device::OpStat& o : *profile) {
      if (o.name == name) return o;
    }
    ADD_FAILURE() << "no " << name << " in the profile";
    return {};
  };
  EXPECT_EQ(find("MixSublayer").calls, 2 * L);
  EXPECT_EQ(find("MixOutputs").calls, 2 * L);
  EXPECT_EQ(find("MixDots").calls, 2 * L);
  const device::OpStat route = find("Route");
  EXPECT_EQ(route.calls, L);
  EXPECT_EQ(route.threads, static_cast<int64_t>(L) * n);
  EXPECT_EQ(find("Combine").calls, L);
  const int64_t shared = c.n_shared_experts > 0 ? 1 : 0;
  const device::OpStat per_row = find("PerRowMatMul");
  EXPECT_EQ(per_row.calls, L * (2 + shared));
  EXPECT_EQ(per_row.threads,
            static_cast<int64_t>(L) * n *
                (c.o_groups * c.o_lora_rank +
                 (c.num_experts_per_tok + shared) * static_cast<int64_t>(c.hidden_size)));
  // The attention's kernels once per layer, the global entries' decoding on the layers that
  // select some.
  int selecting = 0;
  for (int l = 0; l < L; ++l) selecting += c.layer_modes[l] != LayerMode::kSwaOnly;
  for (const char* name : {"RopeRows", "AttnDots", "AttnSoftmax", "AttnSums", "DecodeFp8Keys"})
    EXPECT_EQ(find(name).calls, L) << name;
  EXPECT_EQ(find("DecodeFp4Keys").calls, selecting);
  EXPECT_EQ(find("AttnSums").threads,
            static_cast<int64_t>(L) * n * c.num_attention_heads * c.head_dim);
  const device::OpStat down = find(device::kCopyToHost), up = find(device::kCopyToDevice);
  EXPECT_EQ(down.calls, L + engram_layers + 1);
  EXPECT_EQ(up.calls, 2 + L + engram_layers + 1);
  // Down: the logits, the residual before each Engram layer, and per layer exactly the products
  // the host needs (the SWA entry, the indexer's query and weights, the compressor's rows), never
  // q.
  int64_t down_floats = static_cast<int64_t>(V) + engram_layers * c.hc_mult * c.hidden_size;
  for (int l = 0; l < L; ++l) {
    const LayerMode mode = c.layer_modes[l];
    const bool indexed = mode == LayerMode::kFull || mode == LayerMode::kReindex;
    const bool compress = mode == LayerMode::kFull;
    down_floats += c.head_dim;
    if (indexed) down_floats += c.index_n_heads * (c.index_head_dim + 1);
    if (compress) down_floats += c.head_dim * (c.ratio(l) > 1 ? 2 : 1);
  }
  EXPECT_EQ(down.bytes, static_cast<int64_t>(sizeof(float)) * n * down_floats);
  // Up: the pass's residual and at least each row's own SWA entry's bytes per layer.
  EXPECT_GE(up.bytes, static_cast<int64_t>(sizeof(float)) * n * c.hc_mult * c.hidden_size +
                          static_cast<int64_t>(L) * n * (c.head_dim + c.head_dim / 32));
  double seconds = 0;
  for (const device::OpStat& o : *profile) {
    EXPECT_GT(o.calls, 0) << o.name;
    EXPECT_GE(o.seconds, 0.0) << o.name;
    seconds += o.seconds;
  }
  EXPECT_GT(seconds, 0.0);
  // A take starts anew; off, nothing is counted.
  auto again = profiled->TakeDeviceProfile();
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->empty());
  ASSERT_TRUE(profiled->SetDeviceProfiling(false).ok());
  step(profiled.get(), &st_profiled, &got);
  auto off = profiled->TakeDeviceProfile();
  ASSERT_TRUE(off.ok());
  EXPECT_TRUE(off->empty());
  auto cpu = MakeEngine(c, w, LayerDevice::kCpu);
  ASSERT_NE(cpu, nullptr);
  EXPECT_EQ(cpu->SetDeviceProfiling(true).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->TakeDeviceProfile().status().code(), StatusCode::kInvalidArgument);
}

TEST(DeviceLayers, CudaMatchesTheCpuPathOrIsUnavailable) {
  const EngineConfig& c = testutil::MiniConfig();
  EngineOptions o;
  o.layer_device = LayerDevice::kCuda;
  auto e = Engine::Create(c, testutil::MiniWeights(), o);
  if (!e.ok()) {
    EXPECT_EQ(e.status().code(), StatusCode::kUnavailable) << e.status().ToString();
    if (::kvtier::testing::CudaRequired())
      GTEST_FAIL() << "KVTIER_REQUIRE_CUDA=1 but " << e.status().ToString();
    GTEST_SKIP() << "no CUDA device: " << e.status().ToString();
  }
  auto cpu = MakeEngine(c, testutil::MiniWeights(), LayerDevice::kCpu);
  ASSERT_NE(cpu, nullptr);
  const std::vector<float> a = RunFixedPasses(cpu.get(), 4), b = RunFixedPasses(e->get(), 4);
  ASSERT_EQ(a.size(), b.size());
  // The CUDA math library's expf and log1pf are within a few ulp of glibc's, not equal to
  // them: the logits drift by far less than the golden vectors' 1e-3.
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]) /
                                (1.0 + std::abs(static_cast<double>(a[i]))));
  }
  EXPECT_LT(worst, 1e-3);
  RecordProperty("worst_relative_difference", std::to_string(worst));
  // The CUDA backend's profile (events on the stream) counts what the host twin's counts.
  auto twin = MakeEngine(c, testutil::MiniWeights(), LayerDevice::kHostTwin);
  ASSERT_NE(twin, nullptr);
  auto profile = [](Engine* en) {
    std::vector<SequenceState> st(2);
    std::vector<SequenceState*> ptr;
    std::vector<float> logits;
    for (int i = 0; i < 2; ++i) {
      st[i] = en->NewSequence();
      EXPECT_TRUE(en->Forward(&st[i], Prompt(30 + 9 * i, 50 + i), false, &logits).ok());
      ptr.push_back(&st[i]);
    }
    EXPECT_TRUE(en->SetDeviceProfiling(true).ok());
    const int32_t next[2] = {5, 6};
    std::vector<std::span<const int32_t>> toks = {{&next[0], 1}, {&next[1], 1}};
    std::vector<std::vector<float>> last;
    EXPECT_TRUE(en->ForwardBatch(ptr, toks, &last).ok());
    auto p = en->TakeDeviceProfile();
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? *p : std::vector<device::OpStat>{};
  };
  const std::vector<device::OpStat> want = profile(twin.get()), got = profile(e->get());
  ASSERT_EQ(want.size(), got.size());
  double seconds = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(want[i].name, got[i].name);
    EXPECT_EQ(want[i].calls, got[i].calls) << want[i].name;
    EXPECT_EQ(want[i].bytes, got[i].bytes) << want[i].name;
    EXPECT_EQ(want[i].threads, got[i].threads) << want[i].name;
    EXPECT_GE(got[i].seconds, 0.0) << got[i].name;
    seconds += got[i].seconds;
  }
  EXPECT_GT(seconds, 0.0);
}

}  // namespace
}  // namespace kvtier::engine
