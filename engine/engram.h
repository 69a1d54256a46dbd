// Engram (reference §6): hashed n-gram memory.
//
// EngramHashing reproduces deepseek-ai/Engram engram_demo_v1.py (NgramHashMapping and the
// MultiHeadEmbedding offsets) bit for bit:
//   multipliers[layer] = 2 * default_rng(seed + 10007*layer).integers(0, (2^63-1)//V//2,
//                        size=max_ngram, dtype=int64) + 1      (numpy_random.h)
//   primes: for each layer (in layer_ids order), order n = 2..N, head j: the next prime
//           > previous candidate, starting at engram_vocab_size[n-2] (first candidate is that
//           value), never reused across heads, orders or layers (one seen-set);
//   mix_n(t) = XOR_{k<n} tok[t-k] * mult[k] (int64; tok[t-k] = pad for t-k < 0);
//   hash_ids[t][c] = mix_n(t) mod primes[n-2][j], column c = (n-2)*n_head + j;
//   row = hash_ids[t][c] + offsets[c], offsets = exclusive cumulative sum of the primes.
// The tokenizer-compression table is the identity on the miniature (ids already compressed).
//
// EngramRowSource is how the model reads table rows (FP8 e4m3 + ue8m0 per 32): the engine
// computes row ids as soon as the tokens are known and Request()s them ahead of the layer that
// needs them (the current step's rows before layer 0, the next prefill chunks' rows before the
// current chunk computes, hinted tokens' rows when the caller hints: Engine::PrefetchEngram), and
// Wait()s just before each Engram layer. LocalEngramRowSource serves from in-memory tables;
// RemoteEngramRowSource (remote_engram.h) fetches from row servers.
//
// Thread safety: EngramHashing is immutable after Create. A row source is used by one engine
// at a time; LocalEngramRowSource is safe for concurrent use on distinct batches.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"

namespace kvtier::engine {

struct EngramHashParams {
  std::vector<int> layer_ids;
  int max_ngram_size = 0;
  int n_head_per_ngram = 0;
  std::vector<int64_t> engram_vocab_size;  // per order 2..N: where the prime search starts
  int64_t tokenizer_vocab_size = 0;        // V (compressed vocabulary size)
  int64_t pad_id = 2;
  uint64_t seed = 0;
};

class EngramHashing {
 public:
  static StatusOr<EngramHashing> Create(const EngramHashParams& params);

  int num_layers() const { return static_cast<int>(params_.layer_ids.size()); }
  int num_columns() const { return (params_.max_ngram_size - 1) * params_.n_head_per_ngram; }
  const EngramHashParams& params() const { return params_; }
  // Per layer slot (index into layer_ids).
  const std::vector<int64_t>& multipliers(int slot) const { return multipliers_[slot]; }
  const std::vector<int64_t>& primes(int slot) const { return primes_[slot]; }  // column order
  const std::vector<int64_t>& offsets(int slot) const { return offsets_[slot]; }
  int64_t num_embeddings(int slot) const { return num_embeddings_[slot]; }

  // hash_ids for positions [first, tokens.size()) of one sequence, row-major
  // [(tokens.size()-first) x num_columns()]. Tokens must lie in [0, V).
  Status HashIds(int slot, std::span<const int64_t> tokens, size_t first,
                 std::vector<int64_t>* out) const;
  // Same, with the offsets added: the table rows.
  Status RowIds(int slot, std::span<const int64_t> tokens, size_t first,
                std::vector<int64_t>* out) const;

 private:
  EngramHashParams params_;
  std::vector<std::vector<int64_t>> multipliers_, primes_, offsets_;
  std::vector<int64_t> num_embeddings_;
};

// Deterministic primality for 64-bit values (Miller-Rabin with the 12 first prime bases).
bool IsPrime(uint64_t n);

// Upper bound on the rows one Request may ask for.
inline constexpr size_t kMaxEngramRowsPerBatch = 1 << 22;

struct EngramRowBatch {
  int slot = 0;                  // Engram layer slot
  std::vector<int64_t> row_ids;  // in: table rows
  std::vector<uint8_t> data;     // out: row_ids.size() x row_dim e4m3 codes
  std::vector<uint8_t> scales;   // out: row_ids.size() x row_dim/32 ue8m0 codes
  bool stalled = false;          // out (Wait): the rows were late and Wait blocked for them
};

// Several requests may be outstanding on one slot at once (prefetch ahead of the layer): each
// Request is matched by exactly one Wait on the same batch. A caller waits for one slot's
// requests in the order it made them (a source may rely on that; the engine does so). A source
// may bound the requests outstanding per slot: over its bound Request returns Rejected at once
// (never blocks); the caller then waits for earlier requests and may ask again.
class EngramRowSource {
 public:
  virtual ~EngramRowSource() = default;
  virtual int row_dim() const = 0;
  // Starts fetching batch->row_ids. Returns InvalidArgument for a bad slot or row id, or a
  // batch already outstanding; Rejected when the batch exceeds kMaxEngramRowsPerBatch or the
  // source's per-slot bounds. The batch must stay alive and unmodified until Wait returns.
  virtual Status Request(EngramRowBatch* batch) = 0;
  // Blocks until data and scales are filled; returns the fetch's status and sets
  // batch->stalled when it had to block. On an error data and scales are left empty (never
  // zero-filled). Called once per successful Request.
  virtual Status Wait(EngramRowBatch* batch) = 0;
  // Brackets several Requests made together (the engine: every Engram layer's batch of one
  // step): between HoldRequests(true) and HoldRequests(false) a source may keep the requests
  // and send them together at the end (one message instead of one per layer). Pairs do not
  // nest; a Wait inside the bracket ends it first (never waits on a kept request). Default:
  // no effect.
  virtual void HoldRequests(bool hold) { (void)hold; }
};

// Serves rows from tables held in memory (not owned: the tables must outlive the source).
// Request copies the rows at once, so any number of requests may be outstanding and Wait
// never blocks.
class LocalEngramRowSource : public EngramRowSource {
 public:
  struct Table {
    const uint8_t* data = nullptr;    // rows x row_dim
    const uint8_t* scales = nullptr;  // rows x row_dim/32
    int64_t rows = 0;
  };
  LocalEngramRowSource(int row_dim, std::vector<Table> tables)
      : row_dim_(row_dim), tables_(std::move(tables)) {}
  int row_dim() const override { return row_dim_; }
  Status Request(EngramRowBatch* batch) override;
  Status Wait(EngramRowBatch* batch) override;

 private:
  int row_dim_;
  std::vector<Table> tables_;
};

}  // namespace kvtier::engine
