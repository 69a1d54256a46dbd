// DSpark: the draft module of the miniature (reference §9; reference/dspark.py is the same
// function in PyTorch and documents the architecture).
//
// The draft reads the target's attention inputs of dspark_target_layer_ids (mean over the mHC
// copies, AttnInputCapture in model.h), maps them to main_x = RMSNorm(proj(concat)) and keeps
// main_x of a sequence's last W (= sliding_window) positions in a DraftContext. A draft pass
// runs the block [last, noise x (K-1)] at positions n .. n+K-1 (n = the context's end, `last`
// = the token at n, not yet run by the target) through the draft blocks, each query seeing the
// context and all K block positions; the shared head gives base logits; then position by
// position the Markov bias markov_head * markov_embed[prev] is added (prev = `last` for k = 0,
// then the token chosen at k-1), the confidence sigmoid(conf * [h_k; markov_embed[prev]]) is
// computed and the token is chosen (greedy, or sampled from softmax(logits / temperature)).
//
// Weights: a safetensors file of the draft's own tensors (names "dspark.*", F32/F16/BF16, F16
// widened exactly); only those are read, and no more bytes than their shapes take as F32 (any
// other tensor in the file is checked in its header and skipped); embed.weight and
// head.weight come from the backbone's ModelWeights.
// Thread safety: a DSpark is immutable after Load and may be shared; a DraftContext belongs to
// one caller.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/config.h"
#include "engine/matmul.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/weights.h"

namespace kvtier::engine {

// Upper bound on dspark_block_size (a verify pass runs at most this many + 1 tokens).
inline constexpr int kMaxDraftBlock = 15;
// Upper bound on a config file read by LoadDSparkConfig.
inline constexpr size_t kDSparkConfigBytesMax = 1 << 20;

struct DSparkConfig {
  int block_size = 5;                 // K: draft positions per pass, in [1, kMaxDraftBlock]
  int noise_token_id = -1;            // in [0, vocab_size)
  std::vector<int> target_layer_ids;  // target layers whose attention inputs feed main_x
  int markov_rank = 32;
  int n_routed_experts = 8;  // top-1
  int n_blocks = 3;          // num_nextn_predict_layers
};

// The dspark_* keys (and num_nextn_predict_layers) of a config JSON, checked against the
// backbone's config. InvalidArgument naming the key when absent or out of range.
StatusOr<DSparkConfig> ParseDSparkConfig(const std::string& json_text, const EngineConfig& config);
StatusOr<DSparkConfig> LoadDSparkConfig(const std::string& path, const EngineConfig& config);

// Where a model's draft lives by default: the model path with ".safetensors" replaced by
// "-dspark.safetensors" (appended when the path has no such suffix).
std::string DefaultDraftPath(const std::string& model_path);

class DSpark;

// The recent main_x rows of one sequence: positions [end() - size, end()), at most W + 1.
// Beside each row the draft keeps what every draft pass would compute again from it: per
// draft block, the row's attention latent (the values) and its RoPE'd copy (the keys). They
// depend on the DSpark's weights, so a context belongs to the DSpark that observed it (Draft
// refuses another's).
class DraftContext {
 public:
  int64_t end() const { return end_; }
  size_t size() const { return rows_.size(); }
  // main_x of `pos` (hidden_size floats) or nullptr when not held.
  const float* Row(int64_t pos) const;
  void Clear();

 private:
  friend class DSpark;
  // Row of `pos`: main_x, then per block b the latent and the key (head_dim each).
  const float* Entry(int64_t pos) const;
  int64_t end_ = 0;
  const DSpark* owner_ = nullptr;  // the DSpark whose weights made the latents; null: empty
  std::deque<std::vector<float>> rows_;
};

struct DraftResult {
  std::vector<int32_t> tokens;             // K drafted tokens (position k predicts n + k + 1)
  std::vector<float> confidence;           // K: c_k, the estimated conditional acceptance
  std::vector<std::vector<float>> logits;  // K x vocab: base + Markov bias
};

class DSpark {
 public:
  // Reads the draft weights at `path` (every spec'd tensor present with its shape; extra
  // tensors ignored; non-finite values rejected). backbone must hold embed/head weights.
  static StatusOr<std::unique_ptr<DSpark>> Load(const EngineConfig& config,
                                                const DSparkConfig& dconfig,
                                                std::shared_ptr<const ModelWeights> backbone,
                                                const std::string& path);

  const DSparkConfig& dconfig() const { return dc_; }
  // Bytes of the draft's own tensors held (as F32), read from its file.
  uint64_t held_bytes() const;
  // The layers a capture must list for Observe (the target layers).
  const std::vector<int>& target_layers() const { return dc_.target_layer_ids; }

  // Appends main_x of positions [from, from + count) from `capture` (filled by the Forward
  // that ran them) to `ctx`. InvalidArgument when the capture lacks a target layer or those
  // positions, or when `from` is not ctx->end() (a context with a gap is cleared first, so a
  // fresh context may start anywhere).
  Status Observe(const AttnInputCapture& capture, int64_t from, int64_t count,
                 DraftContext* ctx) const;

  // One draft pass after ctx (n = ctx.end()) with `last` at position n. temperature <= 0:
  // greedy; otherwise tokens are sampled from softmax(logits / temperature) with uniforms from
  // `uniforms` (K values in [0, 1), one per position). Context positions not held are masked.
  Status Draft(const DraftContext& ctx, int32_t last, double temperature,
               const std::vector<double>& uniforms, DraftResult* out) const;

 private:
  struct Block {  // one draft block's weights (pointers into file_)
    const float *attn_norm, *wq, *wkv, *kv_norm, *wo, *ffn_norm, *gate;
    std::vector<const float*> w1, w3, w2;
    const float *s_w1, *s_w3, *s_w2;
  };
  DSpark() = default;
  // The draft blocks' FFN over `rows` rows of x (D each) into out (D each): the shared expert
  // and each row's top-1 routed expert, every expert's rows in one MatMul.
  void MoeRows(const Block& b, const float* x, int rows, float* out) const;

  EngineConfig config_;
  DSparkConfig dc_;
  std::shared_ptr<const ModelWeights> backbone_;
  TensorFile file_;  // the draft's tensors, widened to F32
  const float *proj_ = nullptr, *proj_norm_ = nullptr, *block_pos_ = nullptr, *norm_ = nullptr,
              *markov_embed_ = nullptr, *markov_head_ = nullptr, *conf_w_ = nullptr,
              *conf_b_ = nullptr, *embed_ = nullptr, *head_ = nullptr;
  std::vector<Block> blocks_;
  std::vector<double> rope_;
  std::unique_ptr<ThreadPool> pool_;
  // MatMul on the draft's thread pool with W's packed copy from packed_.
  void Mm(const float* x, int rows, int in, const float* w, int out, float* y) const;
  PackedWeightSet packed_;  // every matrix the draft multiplies by, packed at Load
};

}  // namespace kvtier::engine
