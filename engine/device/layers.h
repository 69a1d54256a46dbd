// Every layer's arithmetic on a device, with the pass's activations kept there.
//
// A pass of n rows (any Engine pass with EngineOptions::layer_device: a step of Forward,
// PrefillCed, ExtendCed or ReplayTail over one sequence's layers, or ForwardBatch over several
// sequences) uploads the rows' embedded residual once; then, layer by layer, the device computes
// the mHC mixes, the pre-mix and norm of both sublayers, the attention sublayer's row-wise
// products (q's low rank and its norm, q, the SWA entry and its norm, the indexer's query and head
// weights, the compressor's rows), the sparse attention of every row's heads over the keys the
// host names for it (decoded on the device from their stored FP4 / FP8 bytes), the grouped output
// projection, the whole MoE sublayer (router, routed and shared experts, combine) and the
// residual updates, and finally the head.
// The host keeps what owns the sequences' caches: it receives the row products it needs (the SWA
// entry, the indexer's query and weights, the compressor's rows), rotates and quantises them
// (RoPE, FP8 SWA entries, the indexer query's FP4 rounding), runs the compressor and the indexer's
// top-k over each sequence's caches, pushes the SWA entries into the rings, and names each row's
// keys: the selected global entries by their index in their cache and the SWA window by its slot
// in the ring, which the device reads from its copies of them (the mirrors: the first read copies
// a cache's every entry, later reads only those appended since, or what the cache's history says
// changed: KvSource; a ring's copy takes the slots whose stamps changed: SwaSource); a window
// entry the pass's own push has overwritten in the ring crosses with the pass (a prefill's rows
// more than W before its end). So a decode layer moves, per row, the products down (head_dim, plus
// the indexer's query on indexed layers and the compressor's rows on compressing ones) and up
// the row's new SWA entry, the caches' new entries, the keys' names and the rotations, never a
// weight and never q or the heads' outputs. The caches stay the host's: a mirror is a copy, checked
// against each cache's epoch and each ring's stamps on every read; the compressor's and the
// indexer's state are not mirrored.
//
// Every output is the CPU path's (engine/device/kernels.h, attention_kernels.h): bit for bit on
// the host twin, within the CUDA math library's expf / log1pf differences on a GPU.
//
// Memory: the layers' dense weights as float copies on the device (weight_bytes()), activations
// and keys for the largest pass so far (at most kMaxTokensPerCall rows), and the mirrors of the
// global KV and the SWA rings (at most kv_mirror_bytes_max, least recently read dropped first).
// Thread safety: one pass at a time (the engine's passes are not reentrant either).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"
#include "engine/config.h"
#include "engine/device/backend.h"
#include "engine/device/fail_stop_backend.h"

namespace kvtier::engine::device {

// The host copies of one layer's dense weights (pointers into the engine's weights, which
// must outlive Create; after it they are not read again).
struct DeviceLayerWeights {
  const float* norm[2] = {};      // attn_norm, ffn_norm: [hidden]
  const float* hc_fn[2] = {};     // [(2 + hc) * hc x hc * hidden]
  const float* hc_scale[2] = {};  // [3]
  const float* hc_base[2] = {};   // [(2 + hc) * hc]
  const float* gate = nullptr;    // [experts x hidden]
  const float* gate_bias = nullptr;
  std::vector<const float*> w1, w3;  // per routed expert: [inter x hidden]
  std::vector<const float*> w2;      // per routed expert: [hidden x inter]
  const float *s_w1 = nullptr, *s_w3 = nullptr, *s_w2 = nullptr;  // shared experts, or null
  // The attention sublayer's row-wise weights (Engine::AttnProducts, AttnOutput); the indexer's
  // (i_wproj, i_wq_b) and the compressor's (c_wkv, c_wgate) null where the layer has none.
  const float* wq_a = nullptr;                       // [q_lora_rank x hidden]
  const float* q_norm = nullptr;                     // [q_lora_rank]
  const float* wq_b = nullptr;                       // [heads * head_dim x q_lora_rank]
  const float* wkv = nullptr;                        // [head_dim x hidden]
  const float* kv_norm = nullptr;                    // [head_dim]
  const float* i_wproj = nullptr;                    // [index heads x hidden]
  const float* i_wq_b = nullptr;                     // [index heads * index_head_dim x q_lora_rank]
  const float *c_wkv = nullptr, *c_wgate = nullptr;  // [head_dim x hidden]
  const float* wo_a = nullptr;  // per group: [o_lora_rank x heads / o_groups * head_dim]
  const float* wo_b = nullptr;  // [hidden x o_groups * o_lora_rank]
  const float* sink = nullptr;  // [heads]: each head's attention sink
};
struct DeviceModelWeights {
  std::vector<DeviceLayerWeights> layers;
  const float* norm_w = nullptr;  // [hidden]
  const float* head_w = nullptr;  // [vocab x hidden]
};

class DeviceLayers {
 public:
  // Device memory Attention gives the heads' attention weights (rows x heads x the most keys of
  // a row, as floats): a pass whose weights would take more runs its rows in groups that fit
  // (the same bits; at least one row per group).
  static constexpr size_t kAttentionWeightsBytesMax = size_t{64} << 20;
  // Device memory the mirrors of global KV caches and SWA rings may hold (Attention), and how
  // many caches and rings they may mirror: past either, the least recently read mirrors are
  // dropped. A mirror whose cache or ring no longer exists goes only then (the device is not told
  // of its end; a new cache at the same address has a new epoch and a new ring new stamps, so the
  // old copy is never read in their place).
  static constexpr size_t kKvMirrorBytesMax = size_t{4} << 30;
  static constexpr size_t kKvMirrorsMax = 1 << 16;
  // Copies the weights to a new backend of `kind`. Unavailable without that device;
  // InvalidArgument for a config the kernels do not take (num_experts_per_tok over
  // kDeviceExpertsPerTokenMax) or weights missing.
  static StatusOr<std::unique_ptr<DeviceLayers>> Create(
      DeviceKind kind, const EngineConfig& config, const DeviceModelWeights& weights,
      size_t attention_weights_bytes_max = kAttentionWeightsBytesMax,
      size_t kv_mirror_bytes_max = kKvMirrorBytesMax);
  // The same on a backend the caller made (tests: one that fails on purpose).
  static StatusOr<std::unique_ptr<DeviceLayers>> Create(
      std::unique_ptr<DeviceBackend> backend, const EngineConfig& config,
      const DeviceModelWeights& weights,
      size_t attention_weights_bytes_max = kAttentionWeightsBytesMax,
      size_t kv_mirror_bytes_max = kKvMirrorBytesMax);
  ~DeviceLayers();
  DeviceLayers(const DeviceLayers&) = delete;
  DeviceLayers& operator=(const DeviceLayers&) = delete;

  DeviceKind kind() const { return backend_->kind(); }
  // Ok until a call to the device failed; then that call's error. From then on no call reaches
  // the device (engine/device/fail_stop_backend.h: what it holds is unknown after a failure):
  // every pass fails with Unavailable, so the owner should drop this object.
  const Status& failure() const { return backend_->failure(); }
  // Device bytes held by weight copies.
  size_t weight_bytes() const { return weight_bytes_; }
  // The backend's profile (DeviceBackend::SetProfiling, TakeProfile).
  void SetProfiling(bool on) { backend_->SetProfiling(on); }
  StatusOr<std::vector<OpStat>> TakeProfile() { return backend_->TakeProfile(); }

  // Starts a pass of n rows (1 <= n <= kMaxTokensPerCall): x [n x hc x hidden], pre [n x hc].
  Status Begin(int n, const float* x, const float* pre);
  // The pass's residual to / from the host ([n x hc x hidden]); its pre-mix weights of the next
  // sublayer to the host ([n x hc]).
  Status Residual(float* x);
  Status SetResidual(const float* x);
  Status Pre(float* pre);
  // The attention sublayer of `layer`: its mixes and normed input, kept on the device; the
  // input also to xn ([n x hidden]) unless xn is null.
  Status AttentionInput(int layer, float* xn);
  // Host destinations of the sublayer's row products (row-major over the pass's n rows).
  struct AttentionRows {
    float* q = nullptr;      // [n x heads x head_dim]: wq_b(q_norm(wq_a x)) (kept on the device
                             // for Attention either way), or null
    float* kv = nullptr;     // [n x head_dim]: kv_norm(wkv x)
    float* iq = nullptr;     // [n x index heads x index_head_dim]: i_wq_b(q_norm(wq_a x)), or null
    float* wts = nullptr;    // [n x index heads]: i_wproj x, or null (with iq)
    float* ckv = nullptr;    // [n x head_dim]: c_wkv x, or null
    float* cgate = nullptr;  // [n x head_dim]: c_wgate x, or null
  };
  // The row products of the input AttentionInput left (Engine::AttnProducts, the same bits),
  // each to its destination in one copy; a null destination skips its product (q and kv are
  // computed either way). InvalidArgument for kv missing, iq without wts or the reverse, or a
  // product whose weight the layer lacks.
  Status AttentionProducts(int layer, const AttentionRows& rows);
  // A global KV source's entries as a cache holds them (Engine's KvSourceCache), for the copy of
  // them Attention keeps in device memory (the mirror: an entry crosses the bus once, not once per
  // pass that reads it). id: the cache's identity among live caches (the engine gives its
  // address); epoch, parent_epoch, parent_keep: its history (engine KvEpoch: under one epoch the
  // entries only grow, so a copy of the first s entries taken under `epoch`, or under
  // parent_epoch up to parent_keep of them, is still true; 0 is no epoch).
  struct KvSource {
    const void* id = nullptr;
    uint64_t epoch = 0, parent_epoch = 0;
    int64_t parent_keep = 0;
    int64_t entries = 0;
    const uint8_t* data = nullptr;    // [entries x head_dim / 2]: kFp4E4M3x16 codes
    const uint8_t* scales = nullptr;  // [entries x head_dim / 16]: their scales
  };
  // One sequence's SWA ring of a layer as the engine holds it (Engine's SwaRing), for the copy
  // Attention keeps of it: `slots` entries (kFp8Ue8m0x32: head_dim data bytes and head_dim / 32
  // scale bytes each) and per slot the stamp of its last write (process-wide unique per write, 0
  // for a slot never written; SwaRing::stamps), so a copy of a slot taken under the stamp the
  // slot still has is still true. id: the ring's identity among live rings and caches (the engine
  // gives its address).
  struct SwaSource {
    const void* id = nullptr;
    int64_t slots = 0;
    const uint64_t* stamps = nullptr;  // [slots]
    const uint8_t* data = nullptr;     // [slots x head_dim]
    const uint8_t* scales = nullptr;   // [slots x head_dim / 32]
  };
  // A pass's attention keys, in host memory (DeviceLayers::Attention). The table's rows: `main`
  // global KV entries (row i: entry main_entry[i] of sources[main_source[i]], read from the
  // mirror), then `swa` SWA entries (row main + i: slot swa_entry[i] of rings[swa_source[i]], read
  // from the mirror, or for swa_source[i] == rings.size() entry swa_entry[i] of those uploaded
  // with the pass: kFp8Ue8m0x32 bytes as the rings store them). Row t of the pass attends to table
  // rows keys[key_off[t] .. key_off[t + 1]) in that order (Engine::AttnCore's: its selected
  // entries, then its window oldest first).
  struct AttentionKeys {
    std::span<const KvSource> sources;
    const int32_t* main_source = nullptr;  // [main]
    const int32_t* main_entry = nullptr;   // [main]
    int64_t main = 0;
    std::span<const SwaSource> rings;
    const int32_t* swa_source = nullptr;  // [swa]
    const int32_t* swa_entry = nullptr;   // [swa]: a written slot (stamp not 0), or < uploaded
    int64_t swa = 0;
    const uint8_t* swa_data = nullptr;    // [uploaded x head_dim]
    const uint8_t* swa_scales = nullptr;  // [uploaded x head_dim / 32]
    int64_t uploaded = 0;
    const int32_t* keys = nullptr;     // each < main + swa
    const int32_t* key_off = nullptr;  // [n + 1]: 0, non-decreasing
    // Each row's RoPE rotation at its position (RopeRotation: qk_rope_head_dim / 2 cosines and
    // sines per row), for q (rotated here) and the inverse rotation of the heads' outputs.
    const float* rope_c = nullptr;  // [n x qk_rope_head_dim / 2]
    const float* rope_s = nullptr;
  };
  // The sparse attention of `layer` (Engine::AttnCore's arithmetic, the same bits on the host
  // twin): the sources' new entries added to their mirrors (those the mirror does not hold under
  // the source's epoch or its parent's; a source never seen, or whose history the mirror cannot
  // follow, is copied whole) and the rings' written slots whose stamps the mirror lacks, the
  // pass's q from AttentionProducts rotated by RoPE, each row's heads against its keys (decoded
  // from the mirrors and the uploaded SWA entries; the new bytes, the lists and the rotations
  // cross in one copy) with the layer's sinks, the outputs rotated back and kept for
  // AttentionOutput. InvalidArgument for keys that break the contract above (an index out of the
  // table, an entry out of its source, a ring's slot never written, offsets that do not run from
  // 0 up to the list's end, a row without keys, more than kMaxAttentionKeysPerRow keys for a row,
  // bytes or an identity missing, a cache or ring twice), a missing rotation, or no
  // AttentionProducts of this layer in the pass; Rejected when this call's caches and rings alone
  // need more mirror memory (or more mirrors) than the Create's kv_mirror_bytes_max (other
  // mirrors are dropped first, least recently read first). Rows run in groups whose weights fit
  // the Create's attention_weights_bytes_max.
  static constexpr int64_t kMaxAttentionKeysPerRow = 1 << 20;
  Status Attention(int layer, const AttentionKeys& keys);
  // Device bytes the mirrors hold, and how many caches and rings they mirror.
  size_t mirror_bytes() const { return mirror_bytes_; }
  size_t mirrors() const { return mirrors_.size(); }
  // The sublayer's output from the heads' outputs: o ([n x heads x head_dim], as AttnCore writes
  // them) from the host, or null for those Attention computed for this layer; the grouped
  // projection and wo_b (Engine::AttnOutput), then the residual update. InvalidArgument for a
  // null o without this layer's Attention.
  Status AttentionOutput(int layer, const float* o);
  // The MoE sublayer of `layer`, wholly on the device.
  Status Ffn(int layer);
  // The head's logits ([rows.size() x vocab], or [n x vocab] for empty rows) of the listed rows
  // of the pass (each < n).
  Status Head(std::span<const int64_t> rows, float* logits);

 private:
  struct Layer;
  DeviceLayers(const EngineConfig& config, std::unique_ptr<DeviceBackend> backend,
               size_t attention_weights_bytes_max, size_t kv_mirror_bytes_max);
  // A cache's mirror: its first `synced` entries (codes and scales) in device memory with room
  // for `capacity`, taken under `epoch`. A ring's (ring): `capacity` slots, slot j a copy of the
  // ring's write stamps[j] (0: nothing). bytes: the device memory it holds; read: the Attention
  // call that last read it.
  struct Mirror {
    bool ring = false;
    uint64_t epoch = 0;
    int64_t synced = 0, capacity = 0;
    std::vector<uint64_t> stamps;
    uint8_t* data = nullptr;
    uint8_t* scales = nullptr;
    size_t bytes = 0;
    uint64_t read = 0;
  };
  void DropMirror(std::unordered_map<const void*, Mirror>::iterator it);
  // Drops the least recently read mirror that this call has not read; false when there is none.
  bool DropLeastRecentlyRead();
  // The mirror of `id` (of the ring kind or not), read by this call: found, or made (empty) when
  // there is none or it is of the other kind; drops others to stay under kKvMirrorsMax.
  Status FindMirror(const void* id, bool ring, Mirror** m);
  // Device memory of `entries` entries of data_bytes + scale_bytes each for *m (replacing what it
  // holds, whose first `keep` entries are copied over), within kv_mirror_bytes_max.
  Status GrowMirror(Mirror* m, int64_t entries, size_t data_bytes, size_t scale_bytes,
                    int64_t keep);
  // Appends a run of the upload: `bytes` host bytes at src, for dst on the device.
  void AddRun(uint8_t* dst, const uint8_t* src, size_t bytes);
  // The mirror of s with room for all its entries, holding what it can keep of its old copy; the
  // entries it lacks appended as runs.
  Status PrepareMirror(const KvSource& s, Mirror** m);
  // The mirror of ring r with its slots' room; the written slots whose stamps it lacks appended
  // as runs.
  Status PrepareRingMirror(const SwaSource& r, Mirror** m);
  // After the runs are scattered: each of k's mirrors (mirror_of_, ring_mirror_of_) holds its
  // cache's every entry under the cache's epoch, its ring's every written slot.
  void MirrorsHold(const AttentionKeys& k);
  // Device memory of `floats` floats (or bytes) held until destruction.
  StatusOr<float*> Hold(size_t floats);
  StatusOr<float*> Upload(const float* host, size_t floats);
  // Upload, or null for a null host pointer (a weight the layer may lack).
  StatusOr<float*> UploadIf(const float* host, size_t floats);
  // Each of the `count` row-major [out x in] matrices at mats[i] (host), output-minor ([in x out],
  // kernels.h) and side by side: matrix i at i * out * in.
  StatusOr<float*> UploadOutputMinor(const float* const* mats, size_t count, size_t out, size_t in);
  Status Run(const DeviceKernel& k) { return backend_->Run(k); }
  // Grows the activation buffers to n rows.
  Status EnsureRows(int n);
  // Mixes of sublayer s into next_pre_, post_, comb_, and the pre-mixed, normed input into xn_.
  Status MixesAndInput(const Layer& l, int s);
  // The residual update after a sublayer whose output is in f_; pre_ <- next_pre_.
  Status MixSublayer();
  // *p (device memory of *capacity bytes, or null) grown to at least `bytes`, contents dropped.
  Status Grow(void** p, size_t* capacity, size_t bytes);

  EngineConfig config_;
  std::unique_ptr<FailStopBackend> backend_;
  std::vector<void*> held_;  // weight copies and activations, freed at destruction
  std::vector<Layer> layers_;
  const float* norm_w_ = nullptr;
  const float* head_w_ = nullptr;
  size_t weight_bytes_ = 0;
  int n_ = 0;                       // rows of the current pass
  int capacity_ = 0;                // rows the activation buffers hold
  std::vector<void*> activations_;  // the buffers below (freed when they grow)
  float *x_ = nullptr, *pre_ = nullptr, *next_pre_ = nullptr, *post_ = nullptr, *comb_ = nullptr;
  float *xn_ = nullptr, *f_ = nullptr, *r_ = nullptr, *mixes_ = nullptr;
  float *logits_ = nullptr, *weight_ = nullptr, *routed_ = nullptr, *g_ = nullptr;
  float *shared_ = nullptr, *sg_ = nullptr, *head_x_ = nullptr, *head_pre_ = nullptr;
  float *qr_ = nullptr, *o_ = nullptr, *oa_ = nullptr;
  float* products_ = nullptr;   // AttentionProducts' outputs, side by side (q first)
  std::vector<float> staging_;  // their host copy
  int products_layer_ = -1;     // the layer whose q products_ holds in this pass, or -1
  int attention_layer_ = -1;    // the layer whose heads' outputs o_ holds in this pass, or -1
  size_t attention_weights_bytes_max_;
  size_t kv_mirror_bytes_max_;
  std::unordered_map<const void*, Mirror> mirrors_;
  size_t mirror_bytes_ = 0;
  uint64_t attention_calls_ = 0;
  // Attention's scratch: the caches' and rings' identities, their mirrors and the mirrors'
  // addresses, the new bytes' runs (host bytes, destinations, offsets in the upload).
  std::vector<const void*> source_ids_;
  std::vector<Mirror*> mirror_of_, ring_mirror_of_;
  std::vector<const uint8_t*> mirror_ptrs_;
  std::vector<std::pair<const uint8_t*, size_t>> run_src_;
  std::vector<uint8_t*> run_dst_;
  std::vector<int64_t> run_begin_;
  // Attention's upload (the keys' bytes, the lists, the rotations) on the host and the device,
  // the decoded keys and the heads' weights: grown to the largest pass, freed at destruction.
  std::vector<uint8_t> key_staging_;
  void* key_upload_ = nullptr;
  size_t key_upload_bytes_ = 0;
  void* keys_f_ = nullptr;
  size_t keys_f_bytes_ = 0;
  void* attn_w_ = nullptr;
  size_t attn_w_bytes_ = 0;
  int32_t* chosen_ = nullptr;
  int32_t* groups_ = nullptr;  // [rows x o_groups]: row r's output group, r % o_groups
  int64_t* head_rows_ = nullptr;
};

}  // namespace kvtier::engine::device
