#include "engine/engram.h"

#include <cstring>
#include <set>

#include "engine/numpy_random.h"

namespace kvtier::engine {

namespace {

uint64_t MulMod(uint64_t a, uint64_t b, uint64_t m) {
  return static_cast<uint64_t>(static_cast<numpy::Uint128>(a) * b % m);
}

uint64_t PowMod(uint64_t a, uint64_t e, uint64_t m) {
  uint64_t r = 1;
  a %= m;
  while (e > 0) {
    if (e & 1) r = MulMod(r, a, m);
    a = MulMod(a, a, m);
    e >>= 1;
  }
  return r;
}

}  // namespace

bool IsPrime(uint64_t n) {
  if (n < 2) return false;
  static constexpr uint64_t kBases[] = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
  for (uint64_t p : kBases) {
    if (n % p == 0) return n == p;
  }
  uint64_t d = n - 1;
  int s = 0;
  while ((d & 1) == 0) {
    d >>= 1;
    ++s;
  }
  for (uint64_t a : kBases) {
    uint64_t x = PowMod(a, d, n);
    if (x == 1 || x == n - 1) continue;
    bool composite = true;
    for (int r = 1; r < s; ++r) {
      x = MulMod(x, x, n);
      if (x == n - 1) {
        composite = false;
        break;
      }
    }
    if (composite) return false;
  }
  return true;
}

StatusOr<EngramHashing> EngramHashing::Create(const EngramHashParams& p) {
  if (p.max_ngram_size < 2 || p.max_ngram_size > 16)
    return Status::InvalidArgument("engram: max_ngram_size");
  if (p.n_head_per_ngram <= 0 || p.n_head_per_ngram > 1024)
    return Status::InvalidArgument("engram: n_head_per_ngram");
  if (static_cast<int>(p.engram_vocab_size.size()) != p.max_ngram_size - 1)
    return Status::InvalidArgument("engram: engram_vocab_size needs max_ngram_size-1 entries");
  if (p.tokenizer_vocab_size <= 0) return Status::InvalidArgument("engram: tokenizer vocab");
  if (p.seed > (uint64_t{1} << 62)) return Status::InvalidArgument("engram: seed too large");
  EngramHashing h;
  h.params_ = p;
  constexpr int64_t kMax = INT64_MAX;
  const int64_t half_bound = kMax / p.tokenizer_vocab_size / 2;
  std::set<int64_t> seen;
  for (int layer : p.layer_ids) {
    if (layer < 0) return Status::InvalidArgument("engram: negative layer id");
    numpy::Pcg64 rng(p.seed + 10007ull * static_cast<uint64_t>(layer));
    KVTIER_ASSIGN_OR_RETURN(std::vector<int64_t> r,
                            numpy::Integers(&rng, 0, half_bound, p.max_ngram_size));
    for (int64_t& m : r) m = m * 2 + 1;
    h.multipliers_.push_back(r);
    std::vector<int64_t> primes;
    for (int n = 2; n <= p.max_ngram_size; ++n) {
      int64_t start = p.engram_vocab_size[n - 2] - 1;
      for (int j = 0; j < p.n_head_per_ngram; ++j) {
        int64_t c = start + 1;
        while (!IsPrime(static_cast<uint64_t>(c)) || seen.count(c) != 0) ++c;
        seen.insert(c);
        primes.push_back(c);
        start = c;
      }
    }
    std::vector<int64_t> offsets(primes.size());
    int64_t total = 0;
    for (size_t i = 0; i < primes.size(); ++i) {
      offsets[i] = total;
      total += primes[i];
    }
    h.primes_.push_back(primes);
    h.offsets_.push_back(offsets);
    h.num_embeddings_.push_back(total);
  }
  return h;
}

Status EngramHashing::HashIds(int slot, std::span<const int64_t> tokens, size_t first,
                              std::vector<int64_t>* out) const {
  if (slot < 0 || slot >= num_layers()) return Status::InvalidArgument("engram: bad slot");
  if (first > tokens.size()) return Status::InvalidArgument("engram: first > size");
  const int N = params_.max_ngram_size;
  const int H = params_.n_head_per_ngram;
  const std::vector<int64_t>& mult = multipliers_[slot];
  const std::vector<int64_t>& primes = primes_[slot];
  out->assign((tokens.size() - first) * num_columns(), 0);
  for (size_t t = first; t < tokens.size(); ++t) {
    uint64_t mix = 0;
    for (int k = 0; k < N; ++k) {
      int64_t tok = (t >= static_cast<size_t>(k)) ? tokens[t - k] : params_.pad_id;
      if (tok < 0 || tok >= params_.tokenizer_vocab_size)
        return Status::InvalidArgument("engram: token id outside the compressed vocabulary");
      // int64 multiply as numpy does it (wrapping; never wraps for valid V by construction).
      mix ^= static_cast<uint64_t>(tok) * static_cast<uint64_t>(mult[k]);
      if (k == 0) continue;
      const int n = k + 1;
      const int64_t smix = static_cast<int64_t>(mix);
      for (int j = 0; j < H; ++j) {
        const int c = (n - 2) * H + j;
        int64_t r = smix % primes[c];
        if (r < 0) r += primes[c];  // numpy's % is floored
        (*out)[(t - first) * num_columns() + c] = r;
      }
    }
  }
  return Status::Ok();
}

Status EngramHashing::RowIds(int slot, std::span<const int64_t> tokens, size_t first,
                             std::vector<int64_t>* out) const {
  KVTIER_RETURN_IF_ERROR(HashIds(slot, tokens, first, out));
  const int C = num_columns();
  for (size_t i = 0; i < out->size(); ++i) (*out)[i] += offsets_[slot][i % C];
  return Status::Ok();
}

Status LocalEngramRowSource::Request(EngramRowBatch* batch) {
  if (batch->slot < 0 || batch->slot >= static_cast<int>(tables_.size()))
    return Status::InvalidArgument("engram rows: bad slot");
  if (batch->row_ids.size() > kMaxEngramRowsPerBatch)
    return Status::Rejected("engram rows: batch exceeds kMaxEngramRowsPerBatch");
  const Table& t = tables_[batch->slot];
  const size_t sb = row_dim_ / 32;
  batch->data.resize(batch->row_ids.size() * row_dim_);
  batch->scales.resize(batch->row_ids.size() * sb);
  for (size_t i = 0; i < batch->row_ids.size(); ++i) {
    int64_t r = batch->row_ids[i];
    if (r < 0 || r >= t.rows) {
      batch->data.clear();
      batch->scales.clear();
      return Status::InvalidArgument("engram rows: row id out of range");
    }
    std::memcpy(batch->data.data() + i * row_dim_, t.data + r * row_dim_, row_dim_);
    std::memcpy(batch->scales.data() + i * sb, t.scales + r * sb, sb);
  }
  return Status::Ok();
}

Status LocalEngramRowSource::Wait(EngramRowBatch* batch) {
  batch->stalled = false;  // the rows were copied by Request
  return Status::Ok();
}

}  // namespace kvtier::engine
