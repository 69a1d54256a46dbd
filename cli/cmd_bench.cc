// `kvtier bench <what>`: benchmarks that run a peer or a physical limit in the same process run
// and print the ratio. `bench storage` measures the storage tiers:
//   - SSD tier unit write throughput vs fio sequential writes (io_uring, O_DIRECT, the same
//     directory, the tier's write pattern: its 2 MiB write buffers written as a stream of
//     512 KiB writes, 4 in flight, i.e. bs=512K and queue depth 4, with a final fsync);
//     --durability batched (default: a group commit with fdatasync every group_commit_ms) or none
//     (no sync until the final flush, as fio); and where the putting thread's time went meanwhile
//     (on a CPU, waiting for one, blocked: /proc/thread-self/schedstat), so that a CPU-bound
//     run on a loaded machine is told apart from a writer that leaves the device idle;
//   - SSD tier random unit reads vs fio random reads (io_uring, O_DIRECT, block = the aligned
//     record size, queue depth 1, the same directory);
//   - SSD tier batch GETs of --batch random units (GetBatch into an SsdTier::Batch, as the
//     daemon reads them: every read of a batch submitted at once, queue depth
//     min(batch, 256)) vs fio random reads at that queue depth (same block, same directory);
//   - DRAM tier Get bandwidth vs memcpy of the same sizes from the same kind of memory;
//   - open-to-first-hit time with --units units indexed (default 1M), and the time until the
//     background index load has finished.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/fio.h"
#include "cli/flags.h"
#include "common/clock.h"
#include "common/json_text.h"
#include "storage/block_device.h"
#include "storage/memory_tier.h"
#include "storage/ssd_format.h"
#include "storage/ssd_tier.h"
#include "storage/tier_manager.h"

namespace kvtier::cli {
namespace {

using storage::Key;

Key BenchKey(uint64_t i) {
  Key k{};
  uint64_t x = i * 0x9e3779b97f4a7c15ull + 1;
  for (int w = 0; w < 4; ++w) {
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    std::memcpy(k.data() + w * 8, &x, 8);
  }
  return k;
}

double Seconds(uint64_t us) { return static_cast<double>(us) / 1e6; }

// The calling thread's time on a CPU and waiting on the run queue, in ns
// (/proc/thread-self/schedstat); false when the kernel does not provide it.
bool ThreadSchedStat(uint64_t* on_cpu_ns, uint64_t* runqueue_ns) {
  FILE* f = std::fopen("/proc/thread-self/schedstat", "r");
  if (f == nullptr) return false;
  unsigned long long run = 0, wait = 0;
  bool ok = std::fscanf(f, "%llu %llu", &run, &wait) == 2;
  std::fclose(f);
  *on_cpu_ns = run;
  *runqueue_ns = wait;
  return ok;
}

struct Results {
  double ssd_write_bps = 0, fio_write_bps = 0, ssd_read_bps = 0, fio_read_bps = 0;
  double ssd_read_iops = 0, fio_read_iops = 0;
  double ssd_batch_iops = 0, fio_qd_iops = 0;
  uint64_t batch_qd = 0;
  uint64_t write_syncs = 0, write_commits = 0;  // during the SSD write test
  // Shares of the write test's wall time the putting thread spent on a CPU and waiting on
  // the run queue (the rest: blocked); negative when schedstat is unavailable.
  double write_cpu_share = -1, write_runqueue_share = -1;
  double dram_get_bps = 0, memcpy_bps = 0;
  double first_hit_ms = 0, open_ms = 0, index_loaded_ms = 0;
  uint64_t units_indexed = 0;
  std::string io_engine;
  std::vector<std::string> notes;
};

int BenchStorage(Args args) {
  FlagSet flags("kvtier bench storage",
                "SSD tier vs fio, DRAM tier vs memcpy, and warm-restart time to first hit.");
  std::string dir;
  bool json = false;
  uint64_t mb = 256, unit_bytes = 57344, units = 1'000'000, read_seconds = 3, batch = 256;
  flags.String("dir", &dir, "DIR", "scratch directory on the file system to measure", true);
  flags.Bool("json", &json, "print JSON");
  flags.Uint("mb", &mb, "MiB written by the SSD write test (and by fio)");
  flags.Uint("unit-bytes", &unit_bytes, "unit size in bytes (miniature V4.1 unit: 57344)");
  flags.Uint("units", &units, "units indexed for the warm-restart test");
  flags.Uint("read-seconds", &read_seconds, "seconds of random reads (ours, then fio)");
  flags.Uint("batch", &batch, "units per batch GET (1..1024); fio reads at the same depth");
  std::string durability = "batched";
  flags.String("durability", &durability, "MODE",
               "SSD write test's durability: batched (group commit with fdatasync every "
               "group_commit_ms, the default) or none (no sync until the final flush, as fio)");
  if (int rc = flags.Parse(args); rc >= 0) return rc;
  if (durability != "batched" && durability != "none") {
    std::fprintf(stderr, "kvtier bench storage: --durability is batched or none\n");
    return 2;
  }
  if (unit_bytes == 0 || unit_bytes > (8u << 20) || mb == 0 || units == 0 || batch == 0 ||
      batch > storage::kMaxBatchIos) {
    std::fprintf(stderr, "kvtier bench storage: bad sizes\n");
    return 2;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir + "/kvtier-bench", ec);
  std::filesystem::create_directories(dir + "/kvtier-bench/fio", ec);
  const std::string root = dir + "/kvtier-bench";
  const Clock& clock = DefaultSteadyClock();
  Results r;
  std::string err;

  // ---- SSD tier writes ----
  const uint64_t write_buffer = 2ull << 20;
  const uint64_t write_chunk = write_buffer / 4;  // SsdTier: kWriteSplit writes per buffer
  const uint64_t n_units = std::max<uint64_t>(1, (mb << 20) / unit_bytes);
  std::vector<uint8_t> value(unit_bytes);
  std::mt19937_64 rng(1);
  for (auto& b : value) b = static_cast<uint8_t>(rng());
  {
    storage::SsdOptions so;
    so.dir = root + "/ssd";
    so.capacity_bytes = std::max<uint64_t>(4 * (mb << 20), 3ull << 30);
    so.durability =
        durability == "none" ? storage::Durability::kNone : storage::Durability::kBatched;
    so.write_buffer_bytes = write_buffer;
    auto ssd = storage::SsdTier::Open(so);
    if (!ssd.ok()) {
      std::fprintf(stderr, "open ssd tier: %s\n", ssd.status().ToString().c_str());
      return 1;
    }
    storage::SsdMeta meta;
    uint64_t cpu0 = 0, rq0 = 0;
    bool sched = ThreadSchedStat(&cpu0, &rq0);
    uint64_t t0 = clock.NowUs();
    for (uint64_t i = 0; i < n_units; ++i) {
      std::memcpy(value.data(), &i, sizeof(i));
      Status st = (*ssd)->Put(BenchKey(i), value, meta, nullptr);
      if (!st.ok()) {
        std::fprintf(stderr, "put: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    Status st = (*ssd)->Flush();
    uint64_t t1 = clock.NowUs();
    uint64_t cpu1 = 0, rq1 = 0;
    if (sched && ThreadSchedStat(&cpu1, &rq1) && t1 > t0) {
      r.write_cpu_share = static_cast<double>(cpu1 - cpu0) / 1e3 / static_cast<double>(t1 - t0);
      r.write_runqueue_share = static_cast<double>(rq1 - rq0) / 1e3 / static_cast<double>(t1 - t0);
    }
    if (!st.ok()) {
      std::fprintf(stderr, "flush: %s\n", st.ToString().c_str());
      return 1;
    }
    r.ssd_write_bps = static_cast<double>(n_units * unit_bytes) / Seconds(t1 - t0);
    r.write_syncs = (*ssd)->GetStats().syncs;
    r.write_commits = (*ssd)->GetStats().commits;

    // ---- SSD tier random reads ----
    std::vector<uint8_t> out;
    uint64_t reads = 0, t2 = clock.NowUs(), deadline = t2 + read_seconds * 1'000'000;
    while (clock.NowUs() < deadline) {
      for (int b = 0; b < 64; ++b) {
        if (!(*ssd)->Get(BenchKey(rng() % n_units), &out).ok()) {
          std::fprintf(stderr, "read miss in the SSD bench\n");
          return 1;
        }
        ++reads;
      }
    }
    uint64_t t3 = clock.NowUs();
    r.ssd_read_iops = static_cast<double>(reads) / Seconds(t3 - t2);
    r.ssd_read_bps = r.ssd_read_iops * static_cast<double>(unit_bytes);

    // ---- SSD tier batch GETs ----
    // As the daemon's GET reads them: each unit verified and viewed in the batch's read
    // region (SsdTier::Batch), no copy per unit.
    std::vector<Key> keys(batch);
    storage::SsdTier::Batch read;
    uint64_t got = 0, t4 = clock.NowUs();
    deadline = t4 + read_seconds * 1'000'000;
    while (clock.NowUs() < deadline) {
      for (auto& k : keys) k = BenchKey(rng() % n_units);
      (*ssd)->GetBatch(keys, &read);
      for (size_t j = 0; j < read.size(); ++j) {
        if (!read.result(j).ok()) {
          std::fprintf(stderr, "batch read miss in the SSD bench: %s\n",
                       read.result(j).ToString().c_str());
          return 1;
        }
      }
      got += batch;
    }
    r.ssd_batch_iops = static_cast<double>(got) / Seconds(clock.NowUs() - t4);
  }
  std::filesystem::remove_all(root + "/ssd", ec);

  // ---- fio, same directory, same pattern ----
  const uint64_t record_block = storage::ssd::AlignUp(unit_bytes + storage::ssd::kRecordHeaderBytes,
                                                      storage::ssd::kBlockBytes);
  const std::string common = FioDirectArgs(root + "/fio");
  r.fio_write_bps =
      RunFio("--name=w --rw=write --bs=" + std::to_string(write_chunk) +
                 " --iodepth=4 --size=" + std::to_string(mb) + "M --end_fsync=1" + common,
             "write", &err);
  r.fio_read_bps = RunFio("--name=w --rw=randread --bs=" + std::to_string(record_block) +
                              " --size=" + std::to_string(mb) + "M --time_based --runtime=" +
                              std::to_string(read_seconds) + " --iodepth=1" + common,
                          "read", &err);
  // The SSD tier's ring depth (DirEnvOptions::queue_depth, 256) bounds a batch's reads in flight.
  r.batch_qd = std::min<uint64_t>(batch, storage::DirEnvOptions{}.queue_depth);
  double fio_qd_bps = RunFio("--name=w --rw=randread --bs=" + std::to_string(record_block) +
                                 " --size=" + std::to_string(mb) +
                                 "M --time_based --runtime=" + std::to_string(read_seconds) +
                                 " --iodepth=" + std::to_string(r.batch_qd) + common,
                             "read", &err);
  if (r.fio_write_bps < 0 || r.fio_read_bps < 0 || fio_qd_bps < 0) r.notes.push_back(err);
  // fio reads whole aligned blocks; compare IOPS (one unit per read on both sides).
  r.fio_read_iops = r.fio_read_bps / static_cast<double>(record_block);
  r.fio_qd_iops = fio_qd_bps / static_cast<double>(record_block);
  std::filesystem::remove_all(root + "/fio", ec);

  // ---- DRAM tier Get vs memcpy ----
  {
    const uint64_t arena = 256ull << 20;
    storage::MemoryTierOptions mo;
    mo.capacity_bytes = arena;
    mo.slab_page_bytes = 4ull << 20;
    auto dram = storage::MemoryTier::Create(mo);
    if (!dram.ok()) {
      std::fprintf(stderr, "dram tier: %s\n", dram.status().ToString().c_str());
      return 1;
    }
    uint64_t count = 0;
    storage::MemMeta meta;
    while ((*dram)->Insert(BenchKey(count), value, meta, true).ok()) ++count;
    std::vector<uint8_t> out(unit_bytes);
    const int kGets = 20000;
    std::vector<uint64_t> order(kGets);
    for (auto& o : order) o = rng() % count;
    uint64_t t0 = clock.NowUs();
    for (uint64_t i : order) {
      if (!(*dram)->Read(BenchKey(i), &out).ok()) return 1;
    }
    uint64_t t1 = clock.NowUs();
    r.dram_get_bps = static_cast<double>(kGets * unit_bytes) / Seconds(t1 - t0);
    // memcpy of the same sizes from random slots of an equally large buffer.
    std::vector<uint8_t> src(count * unit_bytes, 1);
    uint64_t t2 = clock.NowUs();
    for (uint64_t i : order) std::memcpy(out.data(), src.data() + i * unit_bytes, unit_bytes);
    uint64_t t3 = clock.NowUs();
    if (out[0] != 1) return 1;
    r.memcpy_bps = static_cast<double>(kGets * unit_bytes) / Seconds(t3 - t2);
  }

  // ---- warm restart: open with `units` indexed, time to the first hit ----
  {
    storage::TierManagerOptions o;
    o.dram_capacity_bytes = 0;
    o.ssd_capacity_bytes = 8ull << 30;
    o.data_dir = root + "/restart";
    o.durability = storage::Durability::kNone;
    std::vector<uint8_t> small(64, 7);
    storage::PutOptions p;
    p.highest_tier = storage::Tier::kSsd;
    p.kind = policies::ObjectKind::kBlob;
    {
      auto tm = storage::TierManager::Open(o);
      if (!tm.ok()) {
        std::fprintf(stderr, "open: %s\n", tm.status().ToString().c_str());
        return 1;
      }
      for (uint64_t i = 0; i < units; ++i) {
        if (!(*tm)->Put(BenchKey(i), small, p).ok()) return 1;
      }
      if (!(*tm)->Flush().ok()) return 1;
    }
    uint64_t t0 = clock.NowUs();
    auto tm = storage::TierManager::Open(o);
    uint64_t t1 = clock.NowUs();
    std::vector<uint8_t> out;
    if (!tm.ok() || !(*tm)->Get(BenchKey(units / 2), &out).ok() || out != small) {
      std::fprintf(stderr, "warm restart: first unit missing\n");
      return 1;
    }
    uint64_t t2 = clock.NowUs();
    r.open_ms = static_cast<double>(t1 - t0) / 1000.0;
    r.first_hit_ms = static_cast<double>(t2 - t0) / 1000.0;
    // The in-memory index loads in the background: wait for it (bounded) and report when.
    uint64_t load_deadline = t2 + 600'000'000;
    while ((*tm)->GetStats().ssd.objects < units && clock.NowUs() < load_deadline) {
      ::usleep(2000);
    }
    r.index_loaded_ms = static_cast<double>(clock.NowUs() - t0) / 1000.0;
    r.units_indexed = (*tm)->GetStats().ssd.objects;
  }
  std::filesystem::remove_all(root, ec);

  double write_ratio = r.fio_write_bps > 0 ? r.ssd_write_bps / r.fio_write_bps : 0;
  double read_ratio = r.fio_read_iops > 0 ? r.ssd_read_iops / r.fio_read_iops : 0;
  double batch_ratio = r.fio_qd_iops > 0 ? r.ssd_batch_iops / r.fio_qd_iops : 0;
  double dram_ratio = r.memcpy_bps > 0 ? r.dram_get_bps / r.memcpy_bps : 0;
  if (json) {
    nlohmann::json j;
    j["ssd_write_vs_fio"] = write_ratio;
    j["ssd_read_vs_fio"] = read_ratio;
    j["ssd_batch_get_vs_fio"] = batch_ratio;
    j["ssd_batch_get_iops"] = r.ssd_batch_iops;
    j["fio_read_qd_iops"] = r.fio_qd_iops;
    j["batch_units"] = batch;
    j["batch_queue_depth"] = r.batch_qd;
    j["dram_get_vs_memcpy"] = dram_ratio;
    j["warm_restart_first_hit_ms"] = r.first_hit_ms;
    j["ssd_write_mib_s"] = r.ssd_write_bps / 1048576.0;
    j["fio_write_mib_s"] = r.fio_write_bps / 1048576.0;
    j["ssd_read_iops"] = r.ssd_read_iops;
    j["fio_read_iops"] = r.fio_read_iops;
    j["dram_get_gib_s"] = r.dram_get_bps / 1073741824.0;
    j["memcpy_gib_s"] = r.memcpy_bps / 1073741824.0;
    j["warm_restart_open_ms"] = r.open_ms;
    j["warm_restart_index_loaded_ms"] = r.index_loaded_ms;
    j["units_indexed"] = r.units_indexed;
    j["unit_bytes"] = unit_bytes;
    j["write_mib"] = mb;
    j["write_durability"] = durability;
    j["write_commits"] = r.write_commits;
    j["write_fdatasyncs"] = r.write_syncs;
    j["write_putter_cpu_share"] = r.write_cpu_share;
    j["write_putter_runqueue_share"] = r.write_runqueue_share;
    j["notes"] = r.notes;
    std::printf("%s\n", JsonText(j, 2).c_str());
  } else {
    std::printf("unit %llu B, %llu MiB written, dir %s\n",
                static_cast<unsigned long long>(unit_bytes), static_cast<unsigned long long>(mb),
                dir.c_str());
    std::printf(
        "ssd write   %9.1f MiB/s   fio %9.1f MiB/s   ratio %.2f (goal >= 0.9; durability %s: "
        "%llu commits, %llu fdatasyncs; fio: one fsync at the end)\n",
        r.ssd_write_bps / 1048576.0, r.fio_write_bps / 1048576.0, write_ratio, durability.c_str(),
        static_cast<unsigned long long>(r.write_commits),
        static_cast<unsigned long long>(r.write_syncs));
    if (r.write_cpu_share >= 0) {
      std::printf(
          "            putting thread: %.0f%% on a CPU, %.0f%% waiting for a CPU, %.0f%% blocked "
          "(on the writer, commits or locks)\n",
          100 * r.write_cpu_share, 100 * r.write_runqueue_share,
          100 * std::max(0.0, 1 - r.write_cpu_share - r.write_runqueue_share));
    }
    std::printf("ssd read    %9.0f IOPS    fio %9.0f IOPS    ratio %.2f (goal >= 0.9)\n",
                r.ssd_read_iops, r.fio_read_iops, read_ratio);
    std::printf(
        "ssd batch   %9.0f IOPS    fio %9.0f IOPS    ratio %.2f (goal >= 0.8; %llu-unit "
        "GetBatch vs fio iodepth=%llu)\n",
        r.ssd_batch_iops, r.fio_qd_iops, batch_ratio, static_cast<unsigned long long>(batch),
        static_cast<unsigned long long>(r.batch_qd));
    std::printf("dram get    %9.2f GiB/s   memcpy %6.2f GiB/s ratio %.2f (goal >= 0.8)\n",
                r.dram_get_bps / 1073741824.0, r.memcpy_bps / 1073741824.0, dram_ratio);
    std::printf(
        "warm restart: %llu units indexed, open %.1f ms, first hit %.1f ms (goal < 1000), "
        "background index load done at %.0f ms\n",
        static_cast<unsigned long long>(r.units_indexed), r.open_ms, r.first_hit_ms,
        r.index_loaded_ms);
    for (const auto& n : r.notes) std::printf("note: %s\n", n.c_str());
  }
  return 0;
}

}  // namespace

int RunBench(Args args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fprintf(args.empty() ? stderr : stdout,
                 "usage: kvtier bench <what> [flags]\n\n  storage   SSD tier vs fio, DRAM tier vs "
                 "memcpy, warm-restart first hit\n  engram    engine with remote Engram rows vs "
                 "the local table; row transport vs raw loopback TCP\n");
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "storage") return BenchStorage(args.subspan(1));
  if (args[0] == "engram") return BenchEngram(args.subspan(1));
  std::fprintf(stderr, "kvtier bench: unknown benchmark '%.*s'\n", static_cast<int>(args[0].size()),
               args[0].data());
  return 2;
}

}  // namespace kvtier::cli
