// Trace loading for the policy simulator (`kvtier sim`).
//
// Two formats, both JSON Lines (one request per line), detected from the first line's keys:
//  * Mooncake (FAST'25): {"timestamp": ms, "input_length": tokens, "output_length": tokens,
//    "hash_ids": [block ids, prefix-chained, one per `block_tokens` of the prompt]}.
//  * kvtier daemon traces (docs/format/trace.md): {"ts_ms", "op", "tenant", "ids", "bytes",
//    "unit_tokens"}; plain or zstd-compressed (a ".zst" file name, read streaming).
//
// Ownership: LoadTrace returns a value that owns everything. Thread safety: a Trace is an
// immutable value once loaded. Limits: a line longer than kMaxLineBytes, or more than
// kMaxRequests requests, is InvalidArgument (so a corrupt file fails fast, never OOMs).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvtier::sim {

inline constexpr size_t kMaxLineBytes = 64u << 20;
inline constexpr size_t kMaxRequests = 64u << 20;
inline constexpr size_t kMaxIdsPerRequest = 1u << 20;

enum class TraceFormat : uint8_t { kAuto, kMooncake, kKvtier };
enum class TraceOp : uint8_t { kLookup, kGet, kPut, kDelete };

struct TraceRequest {
  uint64_t ts_ms = 0;
  TraceOp op = TraceOp::kGet;
  uint32_t tenant = 0;
  uint64_t input_tokens = 0;   // Mooncake input_length; kvtier: ids * unit_tokens
  uint64_t output_tokens = 0;  // Mooncake only
  uint64_t bytes = 0;          // kvtier only (0 for Mooncake)
  uint32_t unit_tokens = 0;    // tokens per id: Mooncake = the block size given at load
  uint32_t first_id = 0;       // index into Trace::ids
  uint32_t num_ids = 0;
  // kvtier only, optional "request": records with the same non-zero id are one request (an
  // engine turn's LOOKUP, GET and PUT), timed by its first record; 0: a request of its own.
  uint64_t request = 0;
};

struct Trace {
  TraceFormat format = TraceFormat::kMooncake;
  std::vector<TraceRequest> requests;
  std::vector<uint64_t> ids;  // all requests' ids, concatenated in request order
};

struct TraceLoadOptions {
  TraceFormat format = TraceFormat::kAuto;
  // Tokens per Mooncake hash id (the trace's block size); Mooncake's traces use 512.
  uint32_t block_tokens = 512;
};

// Reads a whole trace. NotFound when the file does not exist, InvalidArgument (with the line
// number) for malformed lines, IOError / Corruption for read or zstd failures.
StatusOr<Trace> LoadTrace(const std::string& path, const TraceLoadOptions& options = {});

// Parses trace text already in memory (used by LoadTrace and by tests).
StatusOr<Trace> ParseTrace(std::string_view text, const TraceLoadOptions& options = {});

}  // namespace kvtier::sim
