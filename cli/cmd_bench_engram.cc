// `kvtier bench engram`: remote Engram rows against local ones, and the row transport against
// raw loopback TCP, each peer in the same process run (docs/performance/engram-prefetch.md, "Engram
// prefetch" and "RDMA / Engram transport").
//
// engine part: the miniature engine's prefill and decode with Engram rows from a RowServer
//   over loopback (RemoteEngramRowSource, transport chosen by MakeTransport kAuto: TCP here)
//   against the same run with the engine's local in-memory table; decode is greedy (argmax). The
//   table is the mini config with engram_vocab_size scaled to --engram-vocab (the prime search
//   starts there, so each layer's table is the sum of 12 primes just above it, with the real hash
//   addressing of engine/engram.h); deterministic weights (seed 7) hold the local table and
//   ExportEngramTables writes the row-server files from the same weights. The default 1.4M
//   gives 2 x 16.8M rows x 33 bytes = 1.1 GB of table files. Reports
//   remote_vs_local_overhead, stalls (engine and row source), dedup_ratio,
//   hot_cache_hit_ratio, and checks that both runs' logits are equal (exit 1 otherwise).
// transport part: random rows of a generated --table-mib table with the real model's
//   264-byte rows (256 e4m3 codes + 8 ue8m0 scales), --batch-rows per batch, --depth batches
//   in flight, for --seconds; beside it one raw loopback TCP socket streaming the same bytes
//   from the same mapping (the physical limit of the path); prints the ratio. Then a
//   RowFetcher pass over a Zipf(1.0) trace of row ids (dedup and hot-cache ratios).
// clang-format off
#include <utility>  // before Boost.Asio: its awaitable.hpp uses std::exchange
// clang-format on
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/flags.h"
#include "common/json_text.h"
#include "common/shipped_models.h"
#include "common/temp_dir.h"
#include "engine/config.h"
#include "engine/engram_export.h"
#include "engine/model.h"
#include "engine/remote_engram.h"
#include "engine/weights.h"
#include "rdma/engram_table.h"
#include "rdma/row_fetcher.h"
#include "rdma/row_server.h"
#include "rdma/transport_factory.h"

namespace kvtier::cli {
namespace {

namespace asio = boost::asio;
using BenchClock = std::chrono::steady_clock;

double Since(BenchClock::time_point a) {
  return std::chrono::duration<double>(BenchClock::now() - a).count();
}

int Fail(const char* what, const Status& s) {
  std::fprintf(stderr, "kvtier bench engram: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

// ---- engine part ------------------------------------------------------------------------

struct EngineFlags {
  std::string config_path;
  uint64_t vocab = 1400000, prompt_tokens = 1024, decode_tokens = 32, threads = 2;
  uint64_t prefill_chunk = 256, lookahead = 1, repeat = 3;
};

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

Status RunEngine(engine::Engine* e, const std::vector<int32_t>& prompt, int decode_tokens,
                 RunResult* out) {
  engine::SequenceState st = e->NewSequence();
  std::vector<float> logits;
  auto t0 = BenchClock::now();
  KVTIER_RETURN_IF_ERROR(e->Forward(&st, prompt, false, &logits));
  out->prefill_s = Since(t0);
  out->logits = logits;
  t0 = BenchClock::now();
  for (int i = 0; i < decode_tokens; ++i) {
    // Greedy decoding, as a serving engine at temperature 0: the next token is the argmax
    // (lowest id on ties), so both runs decode the same tokens when their logits agree.
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    KVTIER_RETURN_IF_ERROR(e->Decode(&st, next, &logits));
    out->logits.insert(out->logits.end(), logits.begin(), logits.end());
  }
  out->decode_s = Since(t0);
  return Status::Ok();
}

// Fills `j`; returns 0, or the exit code of a failure (message printed).
int EnginePart(const EngineFlags& f, const std::string& work_dir, nlohmann::ordered_json* j) {
  using namespace kvtier::engine;
  StatusOr<EngineConfig> cfg = Status::Internal("mini-v4.1 is not embedded");
  if (!f.config_path.empty()) {
    cfg = LoadEngineConfig(f.config_path);
  } else if (const ShippedModel* mini = FindShippedModel("mini-v4.1"); mini != nullptr) {
    cfg = ParseEngineConfig(mini->config_json);
  }
  if (!cfg.ok()) return Fail("config", cfg.status());
  for (auto& v : cfg->engram_vocab_size) v = static_cast<int64_t>(f.vocab);
  auto t0 = BenchClock::now();
  auto w = InitWeights(*cfg, 7);
  if (!w.ok()) return Fail("weights", w.status());
  auto weights = std::make_shared<const ModelWeights>(std::move(*w));
  const double init_s = Since(t0);

  rdma::RowServer server(rdma::RowServerOptions{});
  if (Status s = server.Start(); !s.ok()) return Fail("row server", s);
  EngramExportOptions eo;
  eo.out_dir = work_dir + "/engine-tables";
  eo.endpoints = {"127.0.0.1:" + std::to_string(server.port())};
  t0 = BenchClock::now();
  auto ex = ExportEngramTables(*cfg, *weights, eo);
  if (!ex.ok()) return Fail("export", ex.status());
  const double export_s = Since(t0);
  uint64_t table_bytes = 0;
  RemoteEngramConfig rc;
  rc.shard_map_toml = ex->shard_map_toml;
  rc.layer_ids = cfg->engram_layer_ids;
  rc.tenant = "bench";
  for (const auto& file : ex->files) {
    table_bytes += file.bytes;
    if (Status s = server.RegisterTable(file.region, file.path); !s.ok())
      return Fail("register", s);
    auto tok = server.IssueGrant(file.region, "bench", 3600000);
    if (!tok.ok()) return Fail("grant", tok.status());
    rc.tokens[file.region] = *tok;
  }
  auto remote = RemoteEngramRowSource::Connect(cfg->engram_head_dim, rc, {});
  if (!remote.ok()) return Fail("connect", remote.status());

  EngineOptions lo;
  lo.threads = static_cast<int>(f.threads);
  lo.prefill_chunk_tokens = static_cast<int>(f.prefill_chunk);
  lo.engram_lookahead_chunks = static_cast<int>(f.lookahead);
  auto local_engine = Engine::Create(*cfg, weights, lo);
  if (!local_engine.ok()) return Fail("engine", local_engine.status());
  EngineOptions ro = lo;
  ro.engram_rows = remote->get();
  auto remote_engine = Engine::Create(*cfg, weights, ro);
  if (!remote_engine.ok()) return Fail("engine", remote_engine.status());

  const int decode = static_cast<int>(f.decode_tokens);
  RunResult local_r, remote_r, warm;
  // One warm-up of each (thread pool, page cache of the table files, allocator).
  if (Status s = RunEngine(local_engine->get(), Tokens(16, 9), 2, &warm); !s.ok())
    return Fail("local warm-up", s);
  if (Status s = RunEngine(remote_engine->get(), Tokens(16, 9), 2, &warm); !s.ok())
    return Fail("remote warm-up", s);
  const RemoteEngramStats before = (*remote)->stats();
  const EngineStats engine_before = (*remote_engine)->stats();
  // f.repeat rounds of (local, remote) on the same prompt, alternated so that drift in the
  // machine's load hits both alike; each phase's time is the median over the rounds.
  std::vector<double> lp, ld, rp, rd;
  bool equal = true;
  for (uint64_t round = 0; round < f.repeat; ++round) {
    // A new prompt each round: the remote hot-row cache must not be warm from the last one.
    const auto prompt = Tokens(static_cast<int>(f.prompt_tokens), 5 + static_cast<uint32_t>(round));
    if (Status s = RunEngine(local_engine->get(), prompt, decode, &local_r); !s.ok())
      return Fail("local run", s);
    if (Status s = RunEngine(remote_engine->get(), prompt, decode, &remote_r); !s.ok())
      return Fail("remote run", s);
    lp.push_back(local_r.prefill_s);
    ld.push_back(local_r.decode_s);
    rp.push_back(remote_r.prefill_s);
    rd.push_back(remote_r.decode_s);
    equal = equal && local_r.logits.size() == remote_r.logits.size() &&
            std::memcmp(local_r.logits.data(), remote_r.logits.data(),
                        local_r.logits.size() * sizeof(float)) == 0;
  }
  const RemoteEngramStats st = (*remote)->stats();
  const EngineStats es = (*remote_engine)->stats();
  server.Stop();
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  local_r.prefill_s = median(lp);
  local_r.decode_s = median(ld);
  remote_r.prefill_s = median(rp);
  remote_r.decode_s = median(rd);

  const double local_total = local_r.prefill_s + local_r.decode_s;
  const double remote_total = remote_r.prefill_s + remote_r.decode_s;
  const uint64_t rows = st.fetch.rows_requested - before.fetch.rows_requested;
  const uint64_t dedup = st.fetch.rows_deduplicated - before.fetch.rows_deduplicated;
  const uint64_t hits = st.fetch.hot_cache_hits - before.fetch.hot_cache_hits;
  auto& e = (*j)["engine"];
  e["transport"] = (*remote)->transport_name();
  e["table_bytes"] = table_bytes;
  e["table_rows_per_layer"] = ex->files.empty() ? 0 : ex->files[0].row_end;
  e["engram_vocab_size"] = f.vocab;
  e["prompt_tokens"] = f.prompt_tokens;
  e["decode_tokens"] = f.decode_tokens;
  e["threads"] = f.threads;
  e["prefill_chunk_tokens"] = f.prefill_chunk;
  e["lookahead_chunks"] = f.lookahead;
  e["repeat"] = f.repeat;
  e["init_weights_s"] = init_s;
  e["export_s"] = export_s;
  e["local_prefill_tokens_per_s"] = f.prompt_tokens / local_r.prefill_s;
  e["remote_prefill_tokens_per_s"] = f.prompt_tokens / remote_r.prefill_s;
  e["local_decode_tokens_per_s"] = f.decode_tokens / local_r.decode_s;
  e["remote_decode_tokens_per_s"] = f.decode_tokens / remote_r.decode_s;
  e["prefill_overhead"] = remote_r.prefill_s / local_r.prefill_s - 1.0;
  e["decode_overhead"] = remote_r.decode_s / local_r.decode_s - 1.0;
  e["remote_vs_local_overhead"] = remote_total / local_total - 1.0;
  e["stalls"] = es.engram_stalls - engine_before.engram_stalls;
  e["stall_ms"] = static_cast<double>(es.engram_stall_us - engine_before.engram_stall_us) / 1e3;
  e["source_stalls"] = st.stalls - before.stalls;
  e["waits"] = es.engram_waits - engine_before.engram_waits;
  e["prefetches_issued"] = es.engram_prefetches_issued - engine_before.engram_prefetches_issued;
  e["prefetches_consumed"] =
      es.engram_prefetches_consumed - engine_before.engram_prefetches_consumed;
  e["prefetches_discarded"] =
      es.engram_prefetches_discarded - engine_before.engram_prefetches_discarded;
  e["requests_in_flight_max"] = st.in_flight_max;
  e["rows_requested"] = rows;
  e["rows_read"] = st.fetch.rows_read - before.fetch.rows_read;
  e["dedup_ratio"] = rows ? static_cast<double>(dedup) / static_cast<double>(rows) : 0.0;
  e["hot_cache_hit_ratio"] = rows ? static_cast<double>(hits) / static_cast<double>(rows) : 0.0;
  e["logits_equal"] = equal;
  if (!equal) {
    std::fprintf(stderr, "kvtier bench engram: remote and local logits differ\n");
    return 1;
  }
  return 0;
}

// ---- transport part ---------------------------------------------------------------------

struct TransportFlags {
  uint64_t table_mib = 1024;
  double seconds = 3.0;
  uint64_t batch_rows = 256;
  uint64_t depth = 8;
};

// Random rows in `depth` pipelined batches of `batch_rows` each, for `seconds`. Returns
// bytes/s (or the first error); *rows_out counts rows read.
StatusOr<double> TransportThroughput(rdma::Transport& t, const rdma::RegionInfo& info,
                                     const TransportFlags& f, uint64_t* rows_out) {
  const uint32_t stride = info.row_stride_bytes;
  const uint32_t batch = static_cast<uint32_t>(f.batch_rows);
  std::vector<uint8_t> buf(f.depth * batch * stride);
  KVTIER_ASSIGN_OR_RETURN(rdma::LocalBufferId buf_id,
                          t.RegisterLocalBuffer(buf.data(), buf.size()));
  std::mt19937_64 rng(1);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<bool> busy(f.depth, false);
  uint64_t rows = 0;  // guarded by mu
  Status failure;     // guarded by mu
  const auto start = BenchClock::now();
  const auto end = start + std::chrono::duration<double>(f.seconds);
  std::vector<rdma::ReadOp> ops(batch);
  auto all_idle = [&] { return std::none_of(busy.begin(), busy.end(), [](bool b) { return b; }); };
  Status result;
  while (BenchClock::now() < end) {
    size_t slot = 0;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] {
        return !failure.ok() || std::find(busy.begin(), busy.end(), false) != busy.end();
      });
      if (!failure.ok()) break;
      slot = static_cast<size_t>(std::find(busy.begin(), busy.end(), false) - busy.begin());
      busy[slot] = true;
    }
    for (uint32_t i = 0; i < batch; ++i) {
      const uint64_t row = rng() % info.row_count;
      ops[i] = rdma::ReadOp{info.id, row * stride, stride,
                            buf.data() + (uint64_t{slot} * batch + i) * stride};
    }
    result = t.Submit(ops, [&, slot](const Status& s) {
      std::lock_guard<std::mutex> lock(mu);
      if (!s.ok() && failure.ok()) failure = s;
      rows += batch;
      busy[slot] = false;
      cv.notify_all();
    });
    if (!result.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      busy[slot] = false;
      break;
    }
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, all_idle);
  const double secs = Since(start);
  (void)t.UnregisterLocalBuffer(buf_id);
  KVTIER_RETURN_IF_ERROR(result);
  KVTIER_RETURN_IF_ERROR(failure);
  *rows_out = rows;
  return static_cast<double>(rows) * stride / secs;
}

// The physical limit: one loopback TCP connection streaming `chunk_bytes` writes taken from
// the mapped table (the same bytes, no framing, no gather) for `seconds`. Returns bytes/s as
// measured by the reader.
double RawLoopbackThroughput(std::span<const uint8_t> table, size_t chunk_bytes, double seconds) {
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  const uint16_t port = acceptor.local_endpoint().port();
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    asio::io_context wio;
    asio::ip::tcp::socket s(wio);
    boost::system::error_code ec;
    s.connect({asio::ip::make_address("127.0.0.1"), port}, ec);
    if (ec) return;
    s.set_option(asio::ip::tcp::no_delay(true), ec);
    std::mt19937_64 rng(2);
    const size_t chunks = table.size() / chunk_bytes;
    while (!stop.load(std::memory_order_relaxed)) {
      const size_t c = rng() % chunks;
      asio::write(s, asio::buffer(table.data() + c * chunk_bytes, chunk_bytes), ec);
      if (ec) return;
    }
    s.shutdown(asio::ip::tcp::socket::shutdown_send, ec);
  });
  asio::ip::tcp::socket reader = acceptor.accept();
  std::vector<uint8_t> buf(chunk_bytes);
  uint64_t bytes = 0;
  const auto start = BenchClock::now();
  const auto end = start + std::chrono::duration<double>(seconds);
  boost::system::error_code ec;
  while (BenchClock::now() < end) {
    bytes += asio::read(reader, asio::buffer(buf), ec);
    if (ec) break;
  }
  const double secs = Since(start);
  stop = true;
  while (!ec) reader.read_some(asio::buffer(buf), ec);  // drain until the writer stops
  writer.join();
  return static_cast<double>(bytes) / secs;
}

int TransportPart(const TransportFlags& f, const std::string& work_dir, nlohmann::ordered_json* j) {
  using namespace kvtier::rdma;
  // The real model's row: 256 e4m3 codes + 8 ue8m0 scales = 264 bytes.
  constexpr uint32_t kRowDim = 256;
  const uint32_t stride = EngramRowBytes(kRowDim);
  EngramTableHeader h{kRowDim, 0, (f.table_mib << 20) / stride, stride, 1};
  const std::string path = work_dir + "/transport.engram";
  if (Status st = GenerateEngramTable(path, h, 42); !st.ok()) return Fail("generate table", st);

  RowServer server(RowServerOptions{.bind_address = "127.0.0.1", .port = 0});
  if (Status st = server.RegisterTable("engram.l1", path); !st.ok())
    return Fail("register table", st);
  if (Status st = server.Start(); !st.ok()) return Fail("start server", st);
  auto token = server.IssueGrant("engram.l1", "bench", 3600 * 1000);
  if (!token.ok()) return Fail("grant", token.status());
  TransportOptions to;
  to.batch_ops_max = static_cast<uint32_t>(f.batch_rows);
  to.reads_in_flight_max = static_cast<uint32_t>(f.batch_rows * f.depth);
  auto t = MakeTransport(TcpEndpoint{"127.0.0.1", server.port()}, to, TransportKind::kAuto);
  if (!t.ok()) return Fail("transport", t.status());
  auto region = (*t)->OpenRegion(RegionCredentials{"engram.l1", "bench", *token});
  if (!region.ok()) return Fail("open region", region.status());

  // Warm the page cache for both runs (the table was just written; keep it honest).
  auto mapped = MappedTable::Open(path);
  if (!mapped.ok()) return Fail("map", mapped.status());
  uint64_t sum = 0;
  for (size_t i = 0; i < (*mapped)->rows().size(); i += 4096) sum += (*mapped)->rows()[i];

  uint64_t rows = 0;
  auto transport_bps = TransportThroughput(**t, *region, f, &rows);
  if (!transport_bps.ok()) return Fail("transport reads", transport_bps.status());
  const double raw_bps =
      RawLoopbackThroughput((*mapped)->rows(), size_t{f.batch_rows} * stride, f.seconds);

  // RowFetcher on a Zipf(1.0) trace of row ids, 4096 ids per fetch (one prefill chunk's worth
  // of Engram lookups), the default 8 MiB hot cache.
  std::vector<ShardConnection> conns;
  auto t2 = MakeTransport(TcpEndpoint{"127.0.0.1", server.port()}, TransportOptions{},
                          TransportKind::kAuto);
  if (!t2.ok()) return Fail("transport", t2.status());
  conns.push_back(
      ShardConnection{std::move(t2).value(), RegionCredentials{"engram.l1", "bench", *token}});
  auto map = ShardMap::Create({{0, h.row_count, "127.0.0.1", server.port(), "engram.l1"}});
  if (!map.ok()) return Fail("map", map.status());
  auto fetcher = RowFetcher::Create(std::move(*map), std::move(conns), RowFetcherOptions{});
  if (!fetcher.ok()) return Fail("fetcher", fetcher.status());
  constexpr size_t kIdsPerFetch = 4096, kFetches = 200;
  std::vector<uint8_t> out(kIdsPerFetch * stride);
  if (Status st = (*fetcher)->RegisterBuffer(out.data(), out.size()); !st.ok())
    return Fail("register", st);
  // Zipf over a permutation of rows (hash ids are spread over the table).
  std::mt19937_64 rng(3);
  const uint64_t universe = std::min<uint64_t>(h.row_count, 1u << 20);
  std::vector<double> cdf(universe);
  double acc = 0;
  for (uint64_t k = 0; k < universe; ++k) cdf[k] = (acc += 1.0 / static_cast<double>(k + 1));
  std::uniform_real_distribution<double> u(0, acc);
  std::vector<uint64_t> ids(kIdsPerFetch);
  const auto fstart = BenchClock::now();
  for (size_t n = 0; n < kFetches; ++n) {
    for (uint64_t& id : ids) {
      const uint64_t k = std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin();
      id = (k * 0x9e3779b97f4a7c15ull) % h.row_count;
    }
    if (Status st = (*fetcher)->FetchRows(ids, out.data()); !st.ok()) return Fail("fetch", st);
  }
  const double fsecs = Since(fstart);
  const RowFetchStats s = (*fetcher)->stats();
  server.Stop();

  auto& o = (*j)["transport"];
  o["transport"] = (*t)->name();
  o["table_bytes"] = h.row_count * stride;
  o["row_bytes"] = stride;
  o["batch_rows"] = f.batch_rows;
  o["depth"] = f.depth;
  o["transport_bytes_per_s"] = *transport_bps;
  o["transport_rows_per_s"] = *transport_bps / stride;
  o["raw_loopback_bytes_per_s"] = raw_bps;
  o["transport_vs_raw_ratio"] = *transport_bps / raw_bps;
  o["fetcher_rows_per_s"] = static_cast<double>(s.rows_requested) / fsecs;
  o["fetcher_dedup_ratio"] =
      static_cast<double>(s.rows_deduplicated) / static_cast<double>(s.rows_requested);
  o["fetcher_hot_cache_hit_ratio"] =
      static_cast<double>(s.hot_cache_hits) / static_cast<double>(s.rows_requested);
  o["page_cache_touch"] = sum % 1000;  // keeps the warm-up read from being optimised away
  return 0;
}

}  // namespace

int BenchEngram(Args args) {
  FlagSet flags("kvtier bench engram",
                "Engine prefill/decode with Engram rows from a row server over loopback vs the "
                "local table; the row transport vs raw loopback TCP.");
  EngineFlags ef;
  TransportFlags tf;
  std::string work_dir, only;
  bool json = false;
  flags.String("config", &ef.config_path, "FILE",
               "engine model config (default: the embedded mini-v4.1)");
  flags.Uint("engram-vocab", &ef.vocab,
             "engram_vocab_size: table rows ~ 12x this per Engram layer (default 1400000: "
             "1.1 GB of tables)");
  flags.Uint("prompt-tokens", &ef.prompt_tokens,
             "prefill tokens (default 1024: four chunks, so the lookahead runs)");
  flags.Uint("decode-tokens", &ef.decode_tokens, "decode steps (default 32)");
  flags.Uint("threads", &ef.threads, "engine threads (default 2)");
  flags.Uint("prefill-chunk", &ef.prefill_chunk, "tokens per prefill chunk (default 256)");
  flags.Uint("lookahead", &ef.lookahead, "Engram lookahead in chunks (default 1)");
  flags.Uint("repeat", &ef.repeat,
             "rounds of (local, remote) runs; times are medians, counters sums (default 3)");
  flags.Uint("table-mib", &tf.table_mib, "transport part: table size in MiB (default 1024)");
  flags.Double("seconds", &tf.seconds, "transport part: seconds per measurement (default 3)");
  flags.Uint("batch-rows", &tf.batch_rows, "transport part: rows per batch (default 256)");
  flags.Uint("depth", &tf.depth, "transport part: batches in flight (default 8)");
  flags.String("only", &only, "PART", "run one part: engine or transport (default: both)");
  flags.String("work-dir", &work_dir, "DIR", "where table files go (default: a temp dir)");
  flags.Bool("json", &json, "print one JSON object");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (!only.empty() && only != "engine" && only != "transport") {
    std::fprintf(stderr, "kvtier bench engram: --only must be engine or transport\n");
    return 2;
  }
  if (ef.prompt_tokens == 0 || ef.prompt_tokens > engine::kMaxTokensPerCall ||
      ef.decode_tokens > 4096 || ef.threads == 0 || ef.threads > 256 || ef.vocab == 0 ||
      ef.prefill_chunk == 0 || ef.prefill_chunk > engine::kMaxTokensPerCall ||
      ef.lookahead > static_cast<uint64_t>(engine::kMaxEngramLookaheadChunks) || ef.repeat == 0 ||
      ef.repeat > 100) {
    std::fprintf(stderr,
                 "kvtier bench engram: --prompt-tokens and --prefill-chunk in [1, %zu], "
                 "--decode-tokens <= 4096, --threads in [1, 256], --lookahead in [0, %d], "
                 "--repeat in [1, 100]\n",
                 engine::kMaxTokensPerCall, engine::kMaxEngramLookaheadChunks);
    return 2;
  }
  if (tf.table_mib == 0 || tf.table_mib > (64u << 10) || tf.batch_rows == 0 ||
      tf.batch_rows > 1024 || tf.depth == 0 || tf.depth > 64 || !(tf.seconds > 0) ||
      tf.seconds > 600) {
    std::fprintf(stderr,
                 "kvtier bench engram: --table-mib in [1, 65536], --batch-rows in [1, 1024], "
                 "--depth in [1, 64], --seconds in (0, 600]\n");
    return 2;
  }
  std::optional<TempDir> own_dir;  // removed at return when the user gave no --work-dir
  if (work_dir.empty()) {
    own_dir.emplace("kvtier_bench_engram_");
    if (!own_dir->ok()) return Fail("work dir", own_dir->status());
    work_dir = own_dir->path();
  }
  nlohmann::ordered_json j;
  if (only.empty() || only == "engine") {
    if (int rc = EnginePart(ef, work_dir, &j); rc != 0) return rc;
  }
  if (only.empty() || only == "transport") {
    if (int rc = TransportPart(tf, work_dir, &j); rc != 0) return rc;
  }
  if (json) {
    std::printf("%s\n", JsonText(j, 2).c_str());
    return 0;
  }
  for (auto part = j.begin(); part != j.end(); ++part) {
    std::printf("%s:\n", part.key().c_str());
    for (auto it = part.value().begin(); it != part.value().end(); ++it)
      std::printf("  %-28s %s\n", it.key().c_str(), JsonText(it.value()).c_str());
  }
  return 0;
}

}  // namespace kvtier::cli
