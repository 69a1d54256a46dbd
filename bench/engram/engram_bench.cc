// kvtier_bench_engram: the miniature engine's prefill and decode tokens/s with Engram rows
// from a RowServer over loopback TCP (RemoteEngramRowSource) against the same run with the
// engine's local in-memory table, in one process run; prints remote_vs_local_overhead,
// stalls, dedup_ratio and hot_cache_hit_ratio, and checks that both runs' logits are equal.
//
//   kvtier_bench_engram [--engram-vocab 1400000] [--prompt-tokens 256] [--decode-tokens 32]
//                       [--threads 2] [--prefill-chunk 256] [--lookahead 1] [--json]
//                       [--work-dir DIR]
//
// --prefill-chunk and --lookahead set EngineOptions::prefill_chunk_tokens and
// engram_lookahead_chunks for both engines (the local one only chunks; its logits are the
// reference either way). engine_stalls / engine_stall_ms are what the remote engine saw
// (EngineStats), stalls / stall_ms what the row source counted; prefetches_* are the engine's.
//
// The table: the mini config with engram_vocab_size scaled to --engram-vocab (the prime
// search starts there, so each layer's table is the sum of 12 primes just above it, with the
// real hash addressing of engine/engram.h); deterministic weights (InitWeights seed 7) hold
// the local table, `ExportEngramTables` writes the row-server files from the same weights.
// The default 1.4M gives 2 x 16.8M rows x 33 bytes = 1.1 GB of table files.
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/flags.h"
#include "common/temp_dir.h"
#include "engine/config.h"
#include "engine/engram_export.h"
#include "engine/model.h"
#include "engine/remote_engram.h"
#include "engine/weights.h"
#include "rdma/row_server.h"

namespace kvtier::engine {
namespace {

double NowS() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<int32_t> Tokens(int n, uint32_t seed) {
  std::vector<int32_t> t(n);
  uint32_t s = seed * 2654435761u + 12345;
  for (int i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    t[i] = 3 + static_cast<int32_t>('a' + (s >> 24) % 26);
  }
  return t;
}

struct RunResult {
  double prefill_s = 0, decode_s = 0;
  std::vector<float> logits;
};

Status RunEngine(Engine* e, const std::vector<int32_t>& prompt, int decode_tokens, RunResult* out) {
  SequenceState st = e->NewSequence();
  std::vector<float> logits;
  double t0 = NowS();
  KVTIER_RETURN_IF_ERROR(e->Forward(&st, prompt, false, &logits));
  out->prefill_s = NowS() - t0;
  out->logits = logits;
  const auto next = Tokens(decode_tokens, 77);
  t0 = NowS();
  for (int i = 0; i < decode_tokens; ++i) {
    KVTIER_RETURN_IF_ERROR(e->Decode(&st, next[i], &logits));
    out->logits.insert(out->logits.end(), logits.begin(), logits.end());
  }
  out->decode_s = NowS() - t0;
  return Status::Ok();
}

int Main(int argc, char** argv) {
  std::vector<std::string_view> args(argv + 1, argv + argc);
  cli::FlagSet flags("kvtier_bench_engram",
                     "Engine prefill/decode with remote Engram rows vs the local table.");
  std::string config_path = KVTIER_MINI_CONFIG, work_dir;
  uint64_t vocab = 1400000, prompt_tokens = 256, decode_tokens = 32, threads = 2;
  uint64_t prefill_chunk = 256, lookahead = 1;
  bool json = false;
  flags.String("config", &config_path, "FILE", "model config (default: the miniature)");
  flags.Uint("engram-vocab", &vocab, "engram_vocab_size (table rows ~ 12x this per layer)");
  flags.Uint("prompt-tokens", &prompt_tokens, "prefill tokens");
  flags.Uint("decode-tokens", &decode_tokens, "decode steps");
  flags.Uint("threads", &threads, "engine threads");
  flags.Uint("prefill-chunk", &prefill_chunk, "tokens per prefill chunk (prefill_chunk_tokens)");
  flags.Uint("lookahead", &lookahead, "Engram lookahead in chunks (engram_lookahead_chunks)");
  flags.String("work-dir", &work_dir, "DIR", "where table files go (default: a temp dir)");
  flags.Bool("json", &json, "print JSON");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  auto fail = [](const char* what, const Status& s) {
    std::fprintf(stderr, "kvtier_bench_engram: %s: %s\n", what, s.ToString().c_str());
    return 1;
  };
  auto cfg = LoadEngineConfig(config_path);
  if (!cfg.ok()) return fail("config", cfg.status());
  for (auto& v : cfg->engram_vocab_size) v = static_cast<int64_t>(vocab);
  double t0 = NowS();
  auto w = InitWeights(*cfg, 7);
  if (!w.ok()) return fail("weights", w.status());
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  const double init_s = NowS() - t0;

  std::optional<TempDir> own_dir;  // removed at return when the user gave no --work-dir
  if (work_dir.empty()) {
    own_dir.emplace("kvtier_bench_engram_");
    if (!own_dir->ok()) return fail("work dir", own_dir->status());
    work_dir = own_dir->path();
  }
  rdma::RowServer server(rdma::RowServerOptions{});
  if (Status s = server.Start(); !s.ok()) return fail("row server", s);
  EngramExportOptions eo;
  eo.out_dir = work_dir;
  eo.endpoints = {"127.0.0.1:" + std::to_string(server.port())};
  t0 = NowS();
  auto ex = ExportEngramTables(*cfg, *weights, eo);
  if (!ex.ok()) return fail("export", ex.status());
  const double export_s = NowS() - t0;
  uint64_t table_bytes = 0;
  RemoteEngramConfig rc;
  rc.shard_map_toml = ex->shard_map_toml;
  rc.layer_ids = cfg->engram_layer_ids;
  rc.tenant = "bench";
  for (const auto& f : ex->files) {
    table_bytes += f.bytes;
    if (Status s = server.RegisterTable(f.region, f.path); !s.ok()) return fail("register", s);
    auto tok = server.IssueGrant(f.region, "bench", 3600000);
    if (!tok.ok()) return fail("grant", tok.status());
    rc.tokens[f.region] = *tok;
  }
  auto remote = RemoteEngramRowSource::Connect(cfg->engram_head_dim, rc, {});
  if (!remote.ok()) return fail("connect", remote.status());

  if (prefill_chunk == 0 || prefill_chunk > kMaxTokensPerCall ||
      lookahead > static_cast<uint64_t>(kMaxEngramLookaheadChunks)) {
    std::fprintf(stderr,
                 "kvtier_bench_engram: --prefill-chunk must be in [1, %zu], --lookahead "
                 "in [0, %d]\n",
                 kMaxTokensPerCall, kMaxEngramLookaheadChunks);
    return 2;
  }
  EngineOptions lo;
  lo.threads = static_cast<int>(threads);
  lo.prefill_chunk_tokens = static_cast<int>(prefill_chunk);
  lo.engram_lookahead_chunks = static_cast<int>(lookahead);
  auto local_engine = Engine::Create(*cfg, weights, lo);
  if (!local_engine.ok()) return fail("engine", local_engine.status());
  EngineOptions ro = lo;
  ro.engram_rows = remote->get();
  auto remote_engine = Engine::Create(*cfg, weights, ro);
  if (!remote_engine.ok()) return fail("engine", remote_engine.status());

  const auto prompt = Tokens(static_cast<int>(prompt_tokens), 5);
  RunResult local_r, remote_r, warm;
  // One warm-up of each (thread pool, page cache of the table files, allocator).
  if (Status s = RunEngine(local_engine->get(), Tokens(16, 9), 2, &warm); !s.ok())
    return fail("local warm-up", s);
  if (Status s = RunEngine(remote_engine->get(), Tokens(16, 9), 2, &warm); !s.ok())
    return fail("remote warm-up", s);
  const RemoteEngramStats before = (*remote)->stats();
  const EngineStats engine_before = (*remote_engine)->stats();
  if (Status s = RunEngine(local_engine->get(), prompt, static_cast<int>(decode_tokens), &local_r);
      !s.ok())
    return fail("local run", s);
  if (Status s =
          RunEngine(remote_engine->get(), prompt, static_cast<int>(decode_tokens), &remote_r);
      !s.ok())
    return fail("remote run", s);
  const RemoteEngramStats st = (*remote)->stats();
  const EngineStats es = (*remote_engine)->stats();
  const bool equal = local_r.logits.size() == remote_r.logits.size() &&
                     std::memcmp(local_r.logits.data(), remote_r.logits.data(),
                                 local_r.logits.size() * sizeof(float)) == 0;

  const double local_prefill_tps = prompt_tokens / local_r.prefill_s;
  const double remote_prefill_tps = prompt_tokens / remote_r.prefill_s;
  const double local_decode_tps = decode_tokens / local_r.decode_s;
  const double remote_decode_tps = decode_tokens / remote_r.decode_s;
  const double local_total = local_r.prefill_s + local_r.decode_s;
  const double remote_total = remote_r.prefill_s + remote_r.decode_s;
  const uint64_t rows = st.fetch.rows_requested - before.fetch.rows_requested;
  const uint64_t dedup = st.fetch.rows_deduplicated - before.fetch.rows_deduplicated;
  const uint64_t hits = st.fetch.hot_cache_hits - before.fetch.hot_cache_hits;
  nlohmann::ordered_json j;
  j["table_bytes"] = table_bytes;
  j["table_rows_per_layer"] = ex->files.empty() ? 0 : ex->files[0].row_end;
  j["engram_vocab_size"] = vocab;
  j["prompt_tokens"] = prompt_tokens;
  j["decode_tokens"] = decode_tokens;
  j["threads"] = threads;
  j["prefill_chunk_tokens"] = prefill_chunk;
  j["lookahead_chunks"] = lookahead;
  j["init_weights_s"] = init_s;
  j["export_s"] = export_s;
  j["local_prefill_tokens_per_s"] = local_prefill_tps;
  j["remote_prefill_tokens_per_s"] = remote_prefill_tps;
  j["local_decode_tokens_per_s"] = local_decode_tps;
  j["remote_decode_tokens_per_s"] = remote_decode_tps;
  j["prefill_overhead"] = remote_r.prefill_s / local_r.prefill_s - 1.0;
  j["decode_overhead"] = remote_r.decode_s / local_r.decode_s - 1.0;
  j["remote_vs_local_overhead"] = remote_total / local_total - 1.0;
  j["stalls"] = st.stalls - before.stalls;
  j["stall_ms"] = (st.stall_us - before.stall_us) / 1000.0;
  j["waits"] = st.waits - before.waits;
  j["engine_stalls"] = es.engram_stalls - engine_before.engram_stalls;
  j["engine_stall_ms"] = (es.engram_stall_us - engine_before.engram_stall_us) / 1000.0;
  j["prefetches_issued"] = es.engram_prefetches_issued - engine_before.engram_prefetches_issued;
  j["prefetches_consumed"] =
      es.engram_prefetches_consumed - engine_before.engram_prefetches_consumed;
  j["prefetches_discarded"] =
      es.engram_prefetches_discarded - engine_before.engram_prefetches_discarded;
  j["requests_in_flight_max"] = st.in_flight_max;
  j["rows_requested"] = rows;
  j["rows_read"] = st.fetch.rows_read - before.fetch.rows_read;
  j["dedup_ratio"] = rows ? static_cast<double>(dedup) / rows : 0.0;
  j["hot_cache_hit_ratio"] = rows ? static_cast<double>(hits) / rows : 0.0;
  j["logits_equal"] = equal;
  if (json) {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    for (auto it = j.begin(); it != j.end(); ++it)
      std::printf("%-28s %s\n", it.key().c_str(), it.value().dump().c_str());
  }
  server.Stop();
  return equal ? 0 : 1;
}

}  // namespace
}  // namespace kvtier::engine

int main(int argc, char** argv) { return kvtier::engine::Main(argc, argv); }
