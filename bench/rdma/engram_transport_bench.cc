// kvtier_bench_rdma: Engram row-read throughput of TcpTransport against a RowServer over
// loopback, side by side with the physical limit of the same path: a raw loopback TCP
// socket streaming the same number of bytes from the same mapped table. Prints the ratio.
// Then a RowFetcher pass over a Zipf-distributed row trace (dedup and hot-cache ratios).
//
//   kvtier_bench_rdma [--table-mib N] [--seconds S] [--batch-rows B] [--depth D] [--json]
// clang-format off
#include <utility>  // before Boost.Asio: its awaitable.hpp uses std::exchange
// clang-format on
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "rdma/engram_table.h"
#include "rdma/row_fetcher.h"
#include "rdma/row_server.h"
#include "rdma/tcp_transport.h"

namespace {

using namespace kvtier;
using namespace kvtier::rdma;
namespace asio = boost::asio;
using BenchClock = std::chrono::steady_clock;

struct Flags {
  uint64_t table_mib = 256;
  double seconds = 3.0;
  uint32_t batch_rows = 256;
  uint32_t depth = 8;
  bool json = false;
};

double Seconds(BenchClock::time_point a, BenchClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

[[noreturn]] void Die(const std::string& what, const Status& st) {
  std::fprintf(stderr, "kvtier_bench_rdma: %s: %s\n", what.c_str(), st.ToString().c_str());
  std::exit(1);
}

// Random rows in `depth` pipelined batches of `batch_rows` each, for `seconds`.
// Returns bytes/s; *rows_out counts rows read.
double TransportThroughput(Transport& t, RegionId region, const RegionInfo& info, const Flags& f,
                           uint64_t* rows_out) {
  const uint32_t stride = info.row_stride_bytes;
  std::vector<uint8_t> buf(uint64_t{f.depth} * f.batch_rows * stride);
  if (auto id = t.RegisterLocalBuffer(buf.data(), buf.size()); !id.ok())
    Die("register", id.status());
  std::mt19937_64 rng(1);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<bool> busy(f.depth, false);
  std::atomic<uint64_t> rows{0};
  Status failure;
  const auto start = BenchClock::now();
  const auto end = start + std::chrono::duration<double>(f.seconds);
  std::vector<ReadOp> ops(f.batch_rows);
  while (BenchClock::now() < end) {
    size_t slot = 0;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] {
        for (slot = 0; slot < busy.size(); ++slot) {
          if (!busy[slot]) return true;
        }
        return false;
      });
      if (!failure.ok()) Die("read", failure);
      busy[slot] = true;
    }
    for (uint32_t i = 0; i < f.batch_rows; ++i) {
      const uint64_t row = rng() % info.row_count;
      ops[i] = ReadOp{region, row * stride, stride,
                      buf.data() + (uint64_t{slot} * f.batch_rows + i) * stride};
    }
    Status st = t.Submit(ops, [&, slot](const Status& s) {
      std::lock_guard<std::mutex> lock(mu);
      if (!s.ok()) failure = s;
      rows += f.batch_rows;
      busy[slot] = false;
      cv.notify_all();
    });
    if (!st.ok()) Die("submit", st);
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] {
      for (bool b : busy) {
        if (b) return false;
      }
      return true;
    });
  }
  const double secs = Seconds(start, BenchClock::now());
  *rows_out = rows.load();
  return static_cast<double>(rows.load()) * stride / secs;
}

// The physical limit: one loopback TCP connection streaming `chunk_bytes` writes taken from
// the mapped table (the same bytes, no framing, no gather) for `seconds`. Returns bytes/s
// as measured by the reader.
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
  const double secs = Seconds(start, BenchClock::now());
  stop = true;
  while (!ec) reader.read_some(asio::buffer(buf), ec);  // drain until the writer stops
  writer.join();
  return static_cast<double>(bytes) / secs;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--table-mib")
      f.table_mib = std::strtoull(next(), nullptr, 10);
    else if (a == "--seconds")
      f.seconds = std::strtod(next(), nullptr);
    else if (a == "--batch-rows")
      f.batch_rows = static_cast<uint32_t>(std::strtoul(next(), nullptr, 10));
    else if (a == "--depth")
      f.depth = static_cast<uint32_t>(std::strtoul(next(), nullptr, 10));
    else if (a == "--json")
      f.json = true;
    else {
      std::fprintf(stderr,
                   "usage: kvtier_bench_rdma [--table-mib N] [--seconds S] "
                   "[--batch-rows B] [--depth D] [--json]\n");
      return 2;
    }
  }
  if (f.table_mib == 0 || f.batch_rows == 0 || f.batch_rows > 1024 || f.depth == 0 ||
      f.depth > 64 || f.seconds <= 0) {
    std::fprintf(stderr, "kvtier_bench_rdma: flags out of range\n");
    return 2;
  }
  // The real model's row: 256 e4m3 codes + 8 ue8m0 scales = 264 bytes.
  constexpr uint32_t kRowDim = 256;
  const uint32_t stride = EngramRowBytes(kRowDim);
  EngramTableHeader h{kRowDim, 0, (f.table_mib << 20) / stride, stride, 1};
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvtier_bench_rdma_" + std::to_string(::getpid()) + ".engram"))
                               .string();
  if (Status st = GenerateEngramTable(path, h, 42); !st.ok()) Die("generate table", st);

  RowServer server(RowServerOptions{.bind_address = "127.0.0.1", .port = 0});
  if (Status st = server.RegisterTable("engram.l1", path); !st.ok()) Die("register table", st);
  if (Status st = server.Start(); !st.ok()) Die("start server", st);
  auto token = server.IssueGrant("engram.l1", "bench", 3600 * 1000);
  if (!token.ok()) Die("grant", token.status());
  TransportOptions to;
  to.batch_ops_max = f.batch_rows;
  to.reads_in_flight_max = f.batch_rows * f.depth;
  auto t = TcpTransport::Create(TcpEndpoint{"127.0.0.1", server.port()}, to);
  if (!t.ok()) Die("transport", t.status());
  auto region = (*t)->OpenRegion(RegionCredentials{"engram.l1", "bench", *token});
  if (!region.ok()) Die("open region", region.status());

  // Warm the page cache for both runs (the table was just written; keep it honest).
  auto mapped = MappedTable::Open(path);
  if (!mapped.ok()) Die("map", mapped.status());
  uint64_t sum = 0;
  for (size_t i = 0; i < (*mapped)->rows().size(); i += 4096) sum += (*mapped)->rows()[i];

  uint64_t rows = 0;
  const double tcp_bps = TransportThroughput(**t, region->id, *region, f, &rows);
  const double raw_bps =
      RawLoopbackThroughput((*mapped)->rows(), size_t{f.batch_rows} * stride, f.seconds);
  const double ratio = tcp_bps / raw_bps;

  // RowFetcher on a Zipf(1.0) trace of row ids, 4096 ids per fetch (one prefill chunk's
  // worth of Engram lookups), an 8 MiB hot cache.
  std::vector<ShardConnection> conns;
  auto t2 = TcpTransport::Create(TcpEndpoint{"127.0.0.1", server.port()}, TransportOptions{});
  if (!t2.ok()) Die("transport", t2.status());
  conns.push_back(
      ShardConnection{std::move(t2).value(), RegionCredentials{"engram.l1", "bench", *token}});
  auto map = ShardMap::Create({{0, h.row_count, "127.0.0.1", server.port(), "engram.l1"}});
  if (!map.ok()) Die("map", map.status());
  auto fetcher = RowFetcher::Create(std::move(*map), std::move(conns), RowFetcherOptions{});
  if (!fetcher.ok()) Die("fetcher", fetcher.status());
  constexpr size_t kIdsPerFetch = 4096, kFetches = 200;
  std::vector<uint8_t> out(kIdsPerFetch * stride);
  if (Status st = (*fetcher)->RegisterBuffer(out.data(), out.size()); !st.ok()) Die("register", st);
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
    if (Status st = (*fetcher)->FetchRows(ids, out.data()); !st.ok()) Die("fetch", st);
  }
  const double fsecs = Seconds(fstart, BenchClock::now());
  const RowFetchStats s = (*fetcher)->stats();
  const double dedup_ratio = static_cast<double>(s.rows_deduplicated) / s.rows_requested;
  const double hot_ratio = static_cast<double>(s.hot_cache_hits) / s.rows_requested;
  const double rows_per_s = static_cast<double>(s.rows_requested) / fsecs;

  server.Stop();
  std::filesystem::remove(path);
  if (f.json) {
    std::printf(
        "{\"table_bytes\":%llu,\"row_bytes\":%u,\"batch_rows\":%u,\"depth\":%u,"
        "\"tcp_transport_bytes_per_s\":%.0f,\"tcp_transport_rows_per_s\":%.0f,"
        "\"raw_loopback_bytes_per_s\":%.0f,\"transport_vs_raw_ratio\":%.3f,"
        "\"fetcher_rows_per_s\":%.0f,\"dedup_ratio\":%.3f,\"hot_cache_hit_ratio\":%.3f,"
        "\"checksum\":%llu}\n",
        static_cast<unsigned long long>(h.row_count * stride), stride, f.batch_rows, f.depth,
        tcp_bps, tcp_bps / stride, raw_bps, ratio, rows_per_s, dedup_ratio, hot_ratio,
        static_cast<unsigned long long>(sum % 1000));
  } else {
    std::printf("table: %.0f MiB, %llu rows of %u B (FP8 e4m3 + ue8m0/32)\n",
                static_cast<double>(h.row_count * stride) / (1 << 20),
                static_cast<unsigned long long>(h.row_count), stride);
    std::printf("TcpTransport random rows : %8.1f MiB/s  (%.0f rows/s, batch %u x depth %u)\n",
                tcp_bps / (1 << 20), tcp_bps / stride, f.batch_rows, f.depth);
    std::printf("raw loopback TCP stream  : %8.1f MiB/s  (%zu B writes)\n", raw_bps / (1 << 20),
                size_t{f.batch_rows} * stride);
    std::printf("ratio transport / raw    : %8.3f\n", ratio);
    std::printf(
        "RowFetcher zipf trace    : %8.0f rows/s requested, dedup_ratio %.3f, "
        "hot_cache_hit_ratio %.3f\n",
        rows_per_s, dedup_ratio, hot_ratio);
  }
  return 0;
}
