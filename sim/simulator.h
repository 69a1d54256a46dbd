// The policy simulator behind `kvtier sim`: replays a trace through a DRAM tier and an
// optional SSD tier, each driven by an EvictionPolicy, with an AdmissionPolicy in front of
// the SSD, and reports miss ratios, prefix-token hit ratio, SSD writes and money saved.
//
// Replay semantics (chosen so that one unit per trace block reproduces libCacheSim):
//  * Requests in file order, then their units in prefix order. A read (Mooncake requests,
//    kvtier "get") of a unit is a DRAM hit, an SSD hit (the unit is promoted into DRAM and
//    keeps its SSD copy) or a miss (the unit is inserted into DRAM, the engine having
//    recomputed it). kvtier "put" inserts units not cached (no hit/miss counted); "delete"
//    removes them from both tiers.
//  * kvtier "lookup" counts its units as reads (hits, misses, prefix tokens: what the tiers
//    hold) and tells no policy anything, as the live Lookup. A "get" of the same request after
//    a lookup (an engine turn: LOOKUP N, GET the H hits, PUT the N-H misses) counts nothing
//    again: it reports its hits to the policies and promotes its SSD hits, and a miss does
//    nothing (the turn's put inserts it). So a turn is N references, H hits and N-H misses.
//  * A kvtier unit's size is bytes / ids of the first record naming it with bytes > 0 (a lookup
//    that hit nothing records 0: the sizes are unknown until the put).
//  * Every request begins with OnRequest(its time) on the DRAM policy, and on the SSD policy
//    before the request's first call reaching it (as the live SSD tier). Records of a kvtier
//    trace that share a request id (TraceRequest::request: an engine turn's LOOKUP/GET/PUT)
//    are one request timed by its first record: OnRequest is called again only when the
//    request id changes from one record to the next (interleaved requests are told again when
//    they resume), as the live memory tiers do (storage::RequestTag).
//  * kvtier "put" of a unit cached in DRAM replaces it: OnRemove, then an insert as below
//    (the live tiers' overwrite); of a unit not in DRAM: an insert, and a unit on SSD leaves
//    it (OnRemove after the insert: the live tiers delete the old version's SSD copy).
//  * Inserting into a full tier first calls OnMiss, then Evict until there is room (victims
//    are chosen among cached units, never the incoming one), then OnInsert.
//  * A unit evicted from DRAM and not already on SSD is offered to the admission policy; if
//    admitted it is written to SSD (ssd_bytes_written += its size).
//  * Prefix-token hit ratio: per request only the leading run of hit units counts (a prefix
//    cache can use nothing after the first miss).
//  * Belady (policy name "belady") gets each reference's next-access index from the trace.
//  * Structure (SimOptions::structure). kPlain is the replay above (libCacheSim's, exact).
//    kPrefix is the prefix layer every policy runs under for a fair comparison; each tier's
//    policy is wrapped in policies::PrefixLayer (hits deepest first, the running request held,
//    leaf-first victims: policies/prefix_layer/prefix_layer.h), the live tiers' code, told
//    of requests by BeginRequest(request key), and the replay adds the owner's part:
//      - a partial unit (fewer tokens than a whole unit: a request's last block) is never
//        cached; it is a miss every time, as in engines that cache whole blocks only;
//      - a read request's units are looked up in prefix order (hits, misses and the
//        prefix-token count as above), then its hits are reported in prefix order (the layer
//        delivers them deepest first), then its misses are inserted deepest first;
//      - a unit of the request whose parent in the request was evicted all the same (the
//        request outgrew what the layer gives back) is dropped at the request's end (OnRemove).
//  * Recompute cost: ObjectInfo::recompute_tokens is the unit's tokens weighted by attention
//    over its prefix, tokens x (1 + prefix_tokens / kAttentionTokens), so deeper units cost more.
//
// Thread safety: Simulate is reentrant; a UnitTrace is immutable and may be shared by threads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "policies/policy.h"
#include "policies/prefix_layer/prefix_layer.h"
#include "sim/trace.h"

namespace kvtier::sim {

// A trace expanded to storage units (dense unit indices), ready to replay many times.
struct UnitTrace {
  struct Request {
    uint64_t ts_ms = 0;
    TraceOp op = TraceOp::kGet;
    uint32_t first_ref = 0;
    uint32_t num_refs = 0;
    uint64_t request = 0;  // TraceRequest::request; ts_ms is then the request's first record's
  };
  std::vector<Request> requests;
  std::vector<uint32_t> unit;         // per reference: dense unit index
  std::vector<uint32_t> tokens;       // per reference: prompt tokens this unit covers
  std::vector<uint32_t> next_ref;     // per reference: index of the unit's next read, or kNoNext
  std::vector<uint32_t> parent;       // per unit: dense parent index + 1 (0: a root)
  std::vector<uint64_t> size_bytes;   // per unit
  std::vector<uint32_t> unit_tokens;  // per unit: tokens of a whole unit
  std::vector<uint32_t> recompute_tokens;  // per unit: cost model above (token-equivalents)
  uint64_t unique_units = 0;               // distinct units referenced by reads
  uint64_t read_refs = 0;
  uint64_t unit_bytes = 0;  // typical (mean) unit size in bytes
  static constexpr uint32_t kNoNext = UINT32_MAX;
};

struct UnitMapping {
  // Tokens per storage unit; 0 = one unit per trace block (exactness mode). Must divide the
  // block size or be a multiple of it. kvtier traces are already in units: 0 only.
  uint32_t unit_tokens = 0;
  // Bytes of global KV per token, used for unit sizes of Mooncake traces (default: real
  // V4.1-Flash, 890 B/token, DESIGN section 2).
  uint64_t bytes_per_token = 890;
};

StatusOr<UnitTrace> BuildUnitTrace(const Trace& trace, const UnitMapping& mapping = {});

// Prefix length at which attention doubles a token's recompute cost (cost model above).
inline constexpr uint64_t kAttentionTokens = 32768;

// kPrefix runs each tier's policy under policies::PrefixLayer, as the live tiers do under
// TierManagerOptions::eviction_structure.
using Structure = policies::Structure;

struct SimOptions {
  Structure structure = Structure::kPlain;
  std::string policy = "lru";  // any registry eviction policy, or "belady"
  policies::PolicyParams policy_params;
  uint64_t dram_capacity_units = 0;

  std::string ssd_policy = "lru";
  policies::PolicyParams ssd_policy_params;
  uint64_t ssd_capacity_units = 0;  // 0: no SSD tier

  std::string admission = "admit-all";
  policies::PolicyParams admission_params;

  // Cache-hit pricing, USD per million input tokens; cached < 0 means 2% of uncached.
  double price_uncached_per_mtok = 0.28;
  double price_cached_per_mtok = -1.0;

  // Called with the fraction replayed (0..1) about every 1% of references; may be empty.
  std::function<void(double)> progress;
  // Tests: when set, makes the DRAM tier's policy instead of `policy` (e.g. one that records
  // the calls it gets, to compare with the live tiers).
  std::function<std::unique_ptr<policies::EvictionPolicy>()> dram_policy_factory;
  // Tests: the same for the SSD tier's policy (instead of `ssd_policy`).
  std::function<std::unique_ptr<policies::EvictionPolicy>()> ssd_policy_factory;
};

struct SimResult {
  std::string policy, ssd_policy, admission;
  uint64_t capacity_units = 0, ssd_capacity_units = 0;
  Structure structure = Structure::kPlain;
  uint64_t requests = 0, read_refs = 0, misses = 0, dram_hits = 0, ssd_hits = 0;
  uint64_t partial_refs = 0;     // kPrefix: partial units, never cached (counted as misses)
  uint64_t leaf_swaps = 0;       // kPrefix: victims replaced by their deepest cached descendant
  uint64_t orphans_dropped = 0;  // kPrefix: request units dropped because their prefix was evicted
  uint64_t unusable_hits = 0;    // hits after their request's first miss (no use to a prefix cache)
  uint64_t unique_units = 0;
  double block_miss_ratio = 0;
  uint64_t input_tokens = 0, prefix_hit_tokens = 0;
  double prefix_token_hit_ratio = 0;
  uint64_t ssd_bytes_written = 0, ssd_admitted = 0, ssd_rejected = 0;
  double cost_no_cache_usd = 0, cost_with_cache_usd = 0, money_saved_usd = 0;
};

// Replays `trace`. InvalidArgument for an unknown policy or parameter.
StatusOr<SimResult> Simulate(const UnitTrace& trace, const SimOptions& options);

}  // namespace kvtier::sim
