// RespNameLog and RespKeyIndex::Persist: names written, removed and flushed by tenant come back
// after a reopen exactly; a torn or corrupt tail is cut off; the limits apply at replay; the
// log is compacted; concurrent Adds share syncs and all come back; Service logs a RESP name
// before the put that it names. With a LogSource (the store's records carrying the names):
// names lost with the log's unsynced tail come back from the records after the last
// checkpoint; a version 1 log written by the previous code is read and upgraded; Service
// carries the name in the stored value and reads back only names that bind to their key.
#include "cache_daemon/resp_name_log.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "cache_daemon/resp_key_index.h"
#include "cache_daemon/service.h"
#include "common/temp_dir.h"
#include "tests/cache_daemon/fake_tier_manager.h"

namespace kvtier::daemon {
namespace {

storage::Key K(uint64_t i) {
  storage::Key k{};
  for (int b = 0; b < 8; ++b) k[b] = static_cast<uint8_t>(i >> (8 * b));
  k[31] = 0x5A;
  return k;
}

// All (tenant, name) pairs the index holds.
std::set<std::pair<uint64_t, std::string>> Names(const RespKeyIndex& idx,
                                                 std::initializer_list<uint64_t> tenants) {
  std::set<std::pair<uint64_t, std::string>> out;
  for (uint64_t t : tenants) {
    std::vector<RespKeyIndex::Entry> entries;
    uint64_t cursor = 0;
    do {
      cursor = idx.Scan(t, cursor, 100, &entries);
      for (auto& e : entries) out.emplace(t, e.name);
    } while (cursor != 0);
  }
  return out;
}

class RespNameLogTest : public ::testing::Test {
 protected:
  std::string Path() const { return dir_.path() + "/resp-names.log"; }
  std::unique_ptr<RespKeyIndex> Open(uint64_t bytes_max = 1 << 30, bool sync = true) {
    auto idx = std::make_unique<RespKeyIndex>(1 << 20, bytes_max);
    Status st = idx->Persist(Path(), sync);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return idx;
  }
  TempDir dir_{"resp_name_log"};
};

TEST_F(RespNameLogTest, AddsRemovesAndTenantFlushesComeBackAfterReopen) {
  {
    auto idx = Open();
    for (uint64_t i = 0; i < 50; ++i) ASSERT_TRUE(idx->Add(1, K(i), "a" + std::to_string(i)).ok());
    for (uint64_t i = 0; i < 5; ++i) ASSERT_TRUE(idx->Add(2, K(i), "b" + std::to_string(i)).ok());
    for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(idx->Add(3, K(i), "c" + std::to_string(i)).ok());
    for (uint64_t i = 0; i < 10; ++i) idx->Remove(1, K(i));
    idx->RemoveTenant(2);
    ASSERT_TRUE(idx->Add(2, K(9), "b-again").ok());
    // No Flush: a process that dies keeps what was written (page cache).
  }
  auto idx = Open();
  std::set<std::pair<uint64_t, std::string>> want;
  for (uint64_t i = 10; i < 50; ++i) want.emplace(1, "a" + std::to_string(i));
  want.emplace(2, "b-again");
  for (uint64_t i = 0; i < 3; ++i) want.emplace(3, "c" + std::to_string(i));
  EXPECT_EQ(Names(*idx, {1, 2, 3}), want);
  EXPECT_EQ(idx->log_errors(), 0u);
}

TEST_F(RespNameLogTest, TornTailIsCutOffAndAppendsContinue) {
  {
    auto idx = Open();
    for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(idx->Add(1, K(i), "n" + std::to_string(i)).ok());
  }
  uint64_t whole = std::filesystem::file_size(Path());
  // Half of the last record, as a crash in the middle of its write leaves it.
  std::filesystem::resize_file(Path(), whole - 20);
  {
    auto idx = Open();
    EXPECT_EQ(Names(*idx, {1}),
              (std::set<std::pair<uint64_t, std::string>>{{1, "n0"}, {1, "n1"}, {1, "n2"}}));
    ASSERT_TRUE(idx->Add(1, K(7), "n7").ok());
  }
  auto idx = Open();
  EXPECT_EQ(Names(*idx, {1}), (std::set<std::pair<uint64_t, std::string>>{
                                  {1, "n0"}, {1, "n1"}, {1, "n2"}, {1, "n7"}}));
}

TEST_F(RespNameLogTest, FlippedByteEndsTheReplayThere) {
  {
    auto idx = Open();
    ASSERT_TRUE(idx->Add(1, K(1), "first").ok());
    ASSERT_TRUE(idx->Add(1, K(2), "second").ok());
  }
  // Flip a byte of the second record's name: its checksum fails, the first stays.
  uint64_t size = std::filesystem::file_size(Path());
  std::fstream f(Path(), std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(size - 8 - 3));
  f.put('X');
  f.close();
  auto idx = Open();
  EXPECT_EQ(Names(*idx, {1}), (std::set<std::pair<uint64_t, std::string>>{{1, "first"}}));
}

TEST_F(RespNameLogTest, ForeignFileIsRefused) {
  std::ofstream(Path()) << "this is not a name log at all";
  RespKeyIndex idx(100, 1 << 20);
  Status st = idx.Persist(Path(), true);
  EXPECT_TRUE(st.IsCorruption()) << st.ToString();
}

// The header's bytes 12..15 are reserved and zero (docs/format/resp-names.md): a file with any
// of them set is not a log this version wrote, and is refused like a foreign one.
TEST_F(RespNameLogTest, HeaderWithReservedBytesSetIsRefused) {
  {
    auto idx = Open();
    ASSERT_TRUE(idx->Add(1, K(1), "first").ok());
  }
  for (int at = 12; at < 16; ++at) {
    std::fstream f(Path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(at);
    f.put('\x01');
    f.close();
    RespKeyIndex idx(100, 1 << 20);
    Status st = idx.Persist(Path(), true);
    EXPECT_TRUE(st.IsCorruption()) << "byte " << at << ": " << st.ToString();
    f.open(Path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(at);
    f.put('\0');
  }
  auto idx = Open();
  EXPECT_EQ(Names(*idx, {1}), (std::set<std::pair<uint64_t, std::string>>{{1, "first"}}));
}

TEST_F(RespNameLogTest, ReplayKeepsTheLimitsAndCountsTheRest) {
  {
    auto idx = Open();
    for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(idx->Add(1, K(i), "name").ok());
  }
  auto idx = Open(4 * (4 + RespKeyIndex::kEntryOverheadBytes));
  EXPECT_EQ(idx->size(1), 4u);
  EXPECT_EQ(idx->unindexed(), 6u);
}

TEST_F(RespNameLogTest, ChurnIsCompactedSoTheFileStaysBounded) {
  auto idx = Open(1 << 30, /*sync=*/false);
  std::string name(200, 'x');
  // 40000 adds and removes of 10 live names: about 10 MiB of records without compaction.
  for (uint64_t i = 0; i < 20000; ++i) {
    ASSERT_TRUE(idx->Add(1, K(i % 10), name).ok());
    idx->Remove(1, K(i % 10));
  }
  ASSERT_TRUE(idx->Add(1, K(3), name).ok());
  EXPECT_LE(std::filesystem::file_size(Path()), RespKeyIndex::kLogCompactBytesMin + 4096);
  ASSERT_TRUE(idx->Flush().ok());
  idx.reset();
  idx = Open();
  EXPECT_EQ(Names(*idx, {1}), (std::set<std::pair<uint64_t, std::string>>{{1, name}}));
}

TEST_F(RespNameLogTest, ConcurrentAddsAllComeBack) {
  constexpr int kThreads = 4, kPerThread = 200;
  {
    auto idx = Open();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kPerThread; ++i) {
          uint64_t n = static_cast<uint64_t>(t * kPerThread + i);
          EXPECT_TRUE(idx->Add(1, K(n), "k" + std::to_string(n)).ok());
          if (i % 3 == 0) idx->Remove(1, K(n));
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  auto idx = Open();
  std::set<std::pair<uint64_t, std::string>> want;
  for (int n = 0; n < kThreads * kPerThread; ++n) {
    if ((n % kPerThread) % 3 != 0) want.emplace(1, "k" + std::to_string(n));
  }
  EXPECT_EQ(Names(*idx, {1}), want);
}

// A store log for RespKeyIndex::LogSource: records (tenant, key, name) at growing positions,
// 4 per "segment" of 4 x 64 bytes; remembers where each replay started. Thread-safe as the
// real source is (SsdTier::LogEnd takes the tier lock): RespKeyIndex's background thread
// reads `end` while the test puts. Read end, recs and replays directly only while no
// RespKeyIndex with a background thread uses the source.
struct FakeStoreLog {
  struct Rec {
    storage::LogPosition pos;
    uint64_t tenant;
    storage::Key key;
    std::string name;
  };
  void Put(uint64_t tenant, const storage::Key& k, const std::string& name) {
    std::lock_guard<std::mutex> l(mu);
    recs.push_back({end, tenant, k, name});
    end.offset += 64;
    if (end.offset == 256) end = {end.segment + 1, 0};
  }
  RespKeyIndex::LogSource Source() {
    RespKeyIndex::LogSource s;
    s.end = [this] {
      std::lock_guard<std::mutex> l(mu);
      ++end_reads;
      return std::optional<storage::LogPosition>(end);
    };
    s.replay =
        [this](const storage::LogPosition& from,
               const std::function<void(uint64_t, const storage::Key&, std::string_view)>& add) {
          std::vector<Rec> from_here;
          {
            std::lock_guard<std::mutex> l(mu);
            replays.push_back(from);
            for (const Rec& r : recs) {
              if (r.pos >= from) from_here.push_back(r);
            }
          }
          for (const Rec& r : from_here) add(r.tenant, r.key, r.name);  // outside mu
          return Status::Ok();
        };
    return s;
  }
  // How often `end` was read (each background checkpoint reads it once, before appending).
  uint64_t EndReads() {
    std::lock_guard<std::mutex> l(mu);
    return end_reads;
  }
  std::mutex mu;
  uint64_t end_reads = 0;
  storage::LogPosition end{1, 0};
  std::vector<Rec> recs;
  std::vector<storage::LogPosition> replays;
};

// Durability sync with names carried by their units: Adds are not synced one by one; a power
// loss that cuts the log back to what Persist synced loses no name of a unit the store holds,
// because the names of the records after the last checkpoint are read back from the store.
TEST_F(RespNameLogTest, NamesLostWithTheLogTailComeBackFromTheStoreRecords) {
  FakeStoreLog store;
  for (uint64_t i = 0; i < 3; ++i) store.Put(1, K(100 + i), "old" + std::to_string(i));
  uint64_t synced_bytes = 0;
  std::set<std::pair<uint64_t, std::string>> want;
  {
    auto idx = std::make_unique<RespKeyIndex>(1 << 20, 1 << 30);
    ASSERT_TRUE(idx->Persist(Path(), true, 0, store.Source()).ok());
    EXPECT_TRUE(store.replays.empty()) << "a new log has no checkpoint to replay from";
    synced_bytes = std::filesystem::file_size(Path());
    for (uint64_t i = 0; i < 10; ++i) {
      std::string name = "k" + std::to_string(i);
      uint64_t seq = 0;
      ASSERT_TRUE(idx->Add(i % 2 + 1, K(i), name, nullptr, &seq).ok());  // name first,
      store.Put(i % 2 + 1, K(i), name);                                  // then the unit
      want.emplace(i % 2 + 1, name);
    }
    idx.reset();  // closes (and syncs) the file: cut it back below
  }
  std::filesystem::resize_file(Path(), synced_bytes);  // the unsynced tail is gone
  auto idx = std::make_unique<RespKeyIndex>(1 << 20, 1 << 30);
  ASSERT_TRUE(idx->Persist(Path(), true, 0, store.Source()).ok());
  ASSERT_EQ(store.replays.size(), 1u);
  EXPECT_EQ(store.replays[0], (storage::LogPosition{1, 192})) << "from Persist's checkpoint";
  EXPECT_EQ(Names(*idx, {1, 2}), want);
  EXPECT_EQ(idx->recovered_from_store(), 10u);
  // They are in the log again: the next start finds them there (and replays from later).
  idx.reset();
  idx = std::make_unique<RespKeyIndex>(1 << 20, 1 << 30);
  ASSERT_TRUE(idx->Persist(Path(), true, 0, store.Source()).ok());
  EXPECT_EQ(Names(*idx, {1, 2}), want);
  EXPECT_EQ(idx->recovered_from_store(), 0u);
  ASSERT_FALSE(store.replays.empty());
  EXPECT_EQ(store.replays.back(), store.end) << "from the checkpoint of the previous start";
}

// Flush (a graceful stop) and the background thread write checkpoints at the store's end, so
// the next start reads only what the store appended after the last one.
TEST_F(RespNameLogTest, CheckpointsBoundWhatTheNextStartReadsFromTheStore) {
  FakeStoreLog store;
  {
    RespKeyIndex idx(1 << 20, 1 << 30);
    ASSERT_TRUE(idx.Persist(Path(), true, /*sync_interval_ms=*/1, store.Source()).ok());
    for (uint64_t i = 0; i < 6; ++i) {
      uint64_t seq = 0;
      ASSERT_TRUE(idx.Add(1, K(i), "n" + std::to_string(i), nullptr, &seq).ok());
      store.Put(1, K(i), "n" + std::to_string(i));
    }
    // The thread checkpoints at the store's end within a few of its 1 ms rounds. Its second
    // read of the end after the last put begins a round after the one that read the final
    // end and appended a checkpoint there. (Waiting for the file to grow past its size after
    // the puts failed about 1 run in 200: that checkpoint may come before the size is read.)
    const uint64_t reads = store.EndReads();
    for (int i = 0; i < 2000 && store.EndReads() < reads + 2; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_GE(store.EndReads(), reads + 2) << "no background checkpoint";
  }
  {
    RespKeyIndex idx(1 << 20, 1 << 30);
    ASSERT_TRUE(idx.Persist(Path(), true, 0, store.Source()).ok());
    ASSERT_FALSE(store.replays.empty());
    EXPECT_EQ(store.replays.back(), store.end);
    store.Put(1, K(50), "late");  // a unit whose name never reached the log
    ASSERT_TRUE(idx.Flush().ok());
  }
  RespKeyIndex idx(1 << 20, 1 << 30);
  ASSERT_TRUE(idx.Persist(Path(), true, 0, store.Source()).ok());
  ASSERT_FALSE(store.replays.empty());
  EXPECT_EQ(store.replays.back(), store.end) << "Flush checkpointed at the end";
  EXPECT_FALSE(idx.Contains(1, K(50))) << "before the checkpoint: trusted to the log";
  EXPECT_EQ(idx.size(1), 6u);
}

std::string ReadFileBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// The log's records in file order: "add <name>", "remove", "tenant", "checkpoint".
std::vector<std::string> RecordsInOrder(const std::string& path) {
  std::vector<std::string> out;
  auto log = RespNameLog::Open(path, 1 << 20, [&](const RespNameLog::Record& r) {
    switch (r.op) {
      case RespNameLog::Op::kAdd:
        out.push_back("add " + std::string(r.name));
        break;
      case RespNameLog::Op::kRemove:
        out.push_back("remove");
        break;
      case RespNameLog::Op::kRemoveTenant:
        out.push_back("tenant");
        break;
      case RespNameLog::Op::kCheckpoint:
        out.push_back("checkpoint " + std::to_string(r.position.segment) + ":" +
                      std::to_string(r.position.offset));
        break;
    }
  });
  EXPECT_TRUE(log.ok()) << log.status().ToString();
  return out;
}

// Buffer keeps records in memory (the file does not change); WritePending writes them all in
// order; Append writes the buffered ones before its own; Rewrite drops the buffered ones (it
// writes the state they led to); the destructor writes what is still buffered.
TEST_F(RespNameLogTest, BufferedRecordsAreWrittenInOrderBeforeTheNextAppend) {
  {
    auto log = RespNameLog::Open(Path(), 1 << 20, [](const RespNameLog::Record&) {});
    ASSERT_TRUE(log.ok());
    RespNameLog& l = **log;
    const uint64_t empty = std::filesystem::file_size(Path());
    ASSERT_TRUE(l.Buffer({RespNameLog::Op::kAdd, 1, K(1), "one"}).ok());
    ASSERT_TRUE(l.Buffer({RespNameLog::Op::kAdd, 1, K(2), "two"}).ok());
    EXPECT_EQ(l.pending_records(), 2u);
    EXPECT_EQ(std::filesystem::file_size(Path()), empty) << "buffered, not written";
    ASSERT_TRUE(l.Append({RespNameLog::Op::kRemove, 1, K(1), {}}).ok());
    EXPECT_EQ(l.pending_records(), 0u);
    EXPECT_EQ(std::filesystem::file_size(Path()), l.file_bytes());
    EXPECT_EQ(RecordsInOrder(Path()), (std::vector<std::string>{"add one", "add two", "remove"}));
    ASSERT_TRUE(l.Buffer({RespNameLog::Op::kAdd, 1, K(3), "three"}).ok());
    ASSERT_TRUE(l.WritePending().ok());
    ASSERT_TRUE(l.Buffer({RespNameLog::Op::kAdd, 1, K(4), "four"}).ok());
    ASSERT_TRUE(l.Rewrite([](const std::function<void(const RespNameLog::Record&)>& emit) {
                   emit({RespNameLog::Op::kAdd, 1, K(2), "two"});
                 }).ok());
    EXPECT_EQ(l.pending_records(), 0u);
    EXPECT_EQ(RecordsInOrder(Path()), (std::vector<std::string>{"add two"}));
    ASSERT_TRUE(l.Buffer({RespNameLog::Op::kAdd, 1, K(5), "five"}).ok());
  }
  EXPECT_EQ(RecordsInOrder(Path()), (std::vector<std::string>{"add two", "add five"}));
}

// Durability sync (a source and the background thread): Add buffers the name instead of
// writing it, so a process killed then (kill -9: the file as it is, the buffer lost) leaves
// the names only in the units; every one comes back from the store's records after the last
// checkpoint.
TEST_F(RespNameLogTest, BufferedNamesLostInACrashComeBackFromTheStoreRecords) {
  FakeStoreLog store;
  std::string crashed;
  std::set<std::pair<uint64_t, std::string>> want;
  {
    RespKeyIndex idx(1 << 20, 1 << 30);
    ASSERT_TRUE(idx.Persist(Path(), true, /*sync_interval_ms=*/3'600'000, store.Source()).ok());
    const uint64_t persisted = std::filesystem::file_size(Path());
    for (uint64_t i = 0; i < 10; ++i) {
      std::string name = "k" + std::to_string(i);
      uint64_t seq = 0;
      ASSERT_TRUE(idx.Add(i % 2 + 1, K(i), name, nullptr, &seq).ok());  // name first,
      store.Put(i % 2 + 1, K(i), name);                                 // then the unit
      want.emplace(i % 2 + 1, name);
    }
    EXPECT_EQ(std::filesystem::file_size(Path()), persisted) << "adds are buffered";
    crashed = ReadFileBytes(Path());  // what kill -9 leaves now
  }
  {
    std::ofstream f(Path(), std::ios::binary | std::ios::trunc);
    f << crashed;
  }
  RespKeyIndex idx(1 << 20, 1 << 30);
  ASSERT_TRUE(idx.Persist(Path(), true, 0, store.Source()).ok());
  EXPECT_EQ(Names(idx, {1, 2}), want);
  EXPECT_EQ(idx.recovered_from_store(), 10u);
}

// Whether the log at path keeps the checkpoint rule: each checkpoint at position p comes after
// the add of every name whose store record lies before p (else a crash right after it would
// lose that name: it is read back from the store only from p on).
void ExpectCheckpointsFollowTheirNames(const std::string& path, FakeStoreLog& store) {
  const std::vector<std::string> recs = RecordsInOrder(path);
  std::lock_guard<std::mutex> l(store.mu);
  int checkpoints = 0;
  for (size_t j = 0; j < recs.size(); ++j) {
    if (recs[j].rfind("checkpoint ", 0) != 0) continue;
    ++checkpoints;
    for (const FakeStoreLog::Rec& r : store.recs) {
      std::string at = std::to_string(r.pos.segment) + ":" + std::to_string(r.pos.offset);
      unsigned seg = 0;
      unsigned long long off = 0;
      ASSERT_EQ(std::sscanf(recs[j].c_str(), "checkpoint %u:%llu", &seg, &off), 2);
      if (!(r.pos < storage::LogPosition{seg, off})) continue;
      auto add =
          std::find(recs.begin(), recs.begin() + static_cast<std::ptrdiff_t>(j), "add " + r.name);
      EXPECT_NE(add, recs.begin() + static_cast<std::ptrdiff_t>(j))
          << r.name << " (record at " << at << ") after " << recs[j];
    }
  }
  EXPECT_GE(checkpoints, 2);
}

// A checkpoint is never written ahead of a buffered name (whose record may lie before the
// checkpoint's position, so it would not be read back from the store): the background thread's
// checkpoints and Flush's come after every name added before their store position was read;
// a long name's WaitDurable writes (and syncs) the buffered names.
TEST_F(RespNameLogTest, CheckpointsFollowTheBufferedNames) {
  FakeStoreLog store;
  RespKeyIndex idx(1 << 20, 1 << 30);
  ASSERT_TRUE(idx.Persist(Path(), true, /*sync_interval_ms=*/1, store.Source()).ok());
  uint64_t seq = 0;
  for (uint64_t i = 0; i < 6; ++i) {
    ASSERT_TRUE(idx.Add(1, K(i), "n" + std::to_string(i), nullptr, &seq).ok());
    store.Put(1, K(i), "n" + std::to_string(i));
    std::this_thread::sleep_for(std::chrono::microseconds(300));
  }
  const uint64_t reads = store.EndReads();
  for (int i = 0; i < 2000 && store.EndReads() < reads + 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_GE(store.EndReads(), reads + 2) << "no background checkpoint";
  ASSERT_TRUE(idx.Add(1, K(7), "n7", nullptr, &seq).ok());
  store.Put(1, K(7), "n7");
  ASSERT_TRUE(idx.Flush().ok());
  ExpectCheckpointsFollowTheirNames(Path(), store);
  EXPECT_EQ(RecordsInOrder(Path()).back().rfind("checkpoint ", 0), 0u) << "Flush's, last";
  // A name that waits for the log (WaitDurable: a long name's put) is written first.
  ASSERT_TRUE(idx.Add(1, K(8), "n8", nullptr, &seq).ok());
  ASSERT_TRUE(idx.WaitDurable(seq).ok());
  const std::vector<std::string> after = RecordsInOrder(Path());
  EXPECT_NE(std::find(after.begin(), after.end(), "add n8"), after.end());
}

// resp-names.log as kvtierd before version 2 wrote it (main's binary: SET alpha, SET beta,
// SET gamma, DEL beta, SIGTERM; default tenant 0): read, then rewritten as version 2.
constexpr std::string_view kVersion1Log =
    "4b5654524e414d4501000000000000000100000005000000000000000000000079cdde4a458656fe8d3ea8eae5"
    "222e1ec1e8ba9a2a9a0bdd2d214f90d530bcd2616c706861eb3163f4059350df01000000040000000000000000"
    "0000004cb76f541679e9e8014b1cae63addb33a34fb0543994ad941489d9780f9a3a42626574619b745d9fce78"
    "08b501000000050000000000000000000000cf09a2a5bf57494abdf7641601adcfda62960e9a55bc83170acbd5"
    "d4382f8eb267616d6d6158584fafe853a91c020000000000000000000000000000004cb76f541679e9e8014b1c"
    "ae63addb33a34fb0543994ad941489d9780f9a3a420d43a348fa5e3b73";

TEST_F(RespNameLogTest, Version1LogOfThePreviousCodeIsReadAndUpgraded) {
  {
    std::string bytes;
    for (size_t i = 0; i + 1 < kVersion1Log.size(); i += 2) {
      bytes.push_back(
          static_cast<char>(std::stoi(std::string(kVersion1Log.substr(i, 2)), nullptr, 16)));
    }
    ASSERT_EQ(bytes.size(), 254u);
    std::ofstream(Path(), std::ios::binary) << bytes;
  }
  const std::set<std::pair<uint64_t, std::string>> want{{0, "alpha"}, {0, "gamma"}};
  FakeStoreLog store;
  {
    RespKeyIndex idx(1 << 20, 1 << 30);
    ASSERT_TRUE(idx.Persist(Path(), true, 0, store.Source()).ok());
    EXPECT_EQ(Names(idx, {0}), want);
    EXPECT_TRUE(store.replays.empty()) << "a version 1 log's names were synced: no replay";
  }
  std::ifstream f(Path(), std::ios::binary);
  char header[16] = {};
  f.read(header, sizeof(header));
  EXPECT_EQ(header[8], 2) << "rewritten as version 2";
  RespKeyIndex idx(1 << 20, 1 << 30);
  ASSERT_TRUE(idx.Persist(Path(), true, 0, store.Source()).ok());
  EXPECT_EQ(Names(idx, {0}), want);
  EXPECT_EQ(store.replays.size(), 1u) << "version 2 carries the upgrade's checkpoint";
}

// Service::RespSet: the name is in the log file before the store sees the put (so a unit is
// never durable before its name). Every call but Put goes to a FakeTierManager.
class LogCheckingStore final : public storage::TierManager {
 public:
  explicit LogCheckingStore(std::string path) : path_(std::move(path)) {}
  Status Put(const storage::Key& key, std::span<const uint8_t> value,
             const storage::PutOptions& o) override {
    std::ifstream f(path_, std::ios::binary);
    std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (log.find(next_name) == std::string::npos) ++puts_before_name;
    return fake.Put(key, value, o);
  }
  Status Get(const storage::Key& k, std::vector<uint8_t>* out, storage::Tier* from) override {
    return fake.Get(k, out, from);
  }
  storage::LookupResult Lookup(std::span<const storage::Key> chain) override {
    return fake.Lookup(chain);
  }
  Status Prefetch(std::span<const storage::Key> k) override { return fake.Prefetch(k); }
  Status Pin(std::span<const storage::Key> k, uint64_t ms) override { return fake.Pin(k, ms); }
  Status Unpin(std::span<const storage::Key> k) override { return fake.Unpin(k); }
  Status Delete(const storage::Key& k) override { return fake.Delete(k); }
  Status DeleteTenant(storage::TenantId t) override { return fake.DeleteTenant(t); }
  void SetTenantQuota(storage::TenantId t, uint64_t q) override { fake.SetTenantQuota(t, q); }
  Status SetPolicy(const std::string& e, const std::string& a,
                   const policies::PolicyParams& p) override {
    return fake.SetPolicy(e, a, p);
  }
  storage::Stats GetStats() const override { return fake.GetStats(); }
  Status Flush() override { return fake.Flush(); }
  std::optional<storage::LogPosition> SsdLogEnd() override { return storage::LogPosition{1, 0}; }
  // Visits `records` (an SSD log as ReplaySsdLog would walk it).
  Status ReplaySsdLog(const storage::LogPosition& from,
                      const storage::LogRecordVisitor& visit) override {
    (void)from;
    for (const auto& [tenant, key, value] : records) visit(tenant, key, value);
    return Status::Ok();
  }

  testing::FakeTierManager fake;
  std::string next_name;
  int puts_before_name = 0;
  std::vector<std::tuple<uint64_t, storage::Key, std::vector<uint8_t>>> records;

 private:
  std::string path_;
};

TEST_F(RespNameLogTest, ServiceLogsTheNameBeforeThePut) {
  LogCheckingStore store(Path());
  DaemonMetrics metrics;
  auto tenants = TenantRegistry::Open(std::vector<uint8_t>(32, 7), 1024);
  Service svc(&store, tenants.get(), &metrics, nullptr, PolicySettings{});
  ASSERT_TRUE(svc.PersistRespNames(Path(), true, 0).ok());
  const Tenant& t = *tenants->default_tenant();
  for (int i = 0; i < 20; ++i) {
    store.next_name = "resp-key-" + std::to_string(i) + "-end";
    ASSERT_TRUE(svc.RespSet(t, store.next_name, "v", 0).ok());
  }
  EXPECT_EQ(store.puts_before_name, 0);
  EXPECT_EQ(svc.RespDbSize(t), 20u);
}

// SET stores the name with the value (named envelope) unless it is longer than
// kRespCarriedNameBytesMax; GET reads both forms. At start the names of the store's records
// are indexed only when they bind to the record's key under its tenant (a native unit shaped
// like an envelope names nothing).
TEST_F(RespNameLogTest, ServiceCarriesTheNameAndReadsBackOnlyNamesBoundToTheirKeys) {
  LogCheckingStore store(Path());
  DaemonMetrics metrics;
  auto tenants = TenantRegistry::Open(std::vector<uint8_t>(32, 7), 1024);
  const Tenant& t = *tenants->default_tenant();
  auto envelope = [&](std::string_view name) {
    std::vector<uint8_t> raw;
    EXPECT_TRUE(store.fake
                    .Get(Service(&store, tenants.get(), &metrics, nullptr, PolicySettings{})
                             .BindResp(t, name),
                         &raw, nullptr)
                    .ok());
    return raw;
  };
  const std::string long_name(kRespCarriedNameBytesMax + 1, 'n');
  {
    Service svc(&store, tenants.get(), &metrics, nullptr, PolicySettings{});
    ASSERT_TRUE(svc.PersistRespNames(Path(), true, 0).ok());
    ASSERT_TRUE(svc.RespSet(t, "carried", "value-1", 0).ok());
    ASSERT_TRUE(svc.RespSet(t, long_name, "value-2", 0).ok());
    std::string v;
    ASSERT_TRUE(svc.RespGet(t, "carried", &v).ok());
    EXPECT_EQ(v, "value-1");
    ASSERT_TRUE(svc.RespGet(t, long_name, &v).ok());
    EXPECT_EQ(v, "value-2");
  }
  std::vector<uint8_t> named = envelope("carried");
  uint64_t expire_at = 1;
  size_t at = 0;
  std::string_view name;
  ASSERT_TRUE(DecodeRespEnvelope(named, &expire_at, &at, &name));
  EXPECT_EQ(named[0], kRespNamedEnvelopeTag);
  EXPECT_EQ(name, "carried");
  EXPECT_EQ(expire_at, 0u);
  EXPECT_EQ(envelope(long_name)[0], kRespEnvelopeTag);

  // The store's records as the walk meets them: one good, one whose name binds to another
  // key, one of an unknown tenant, one without a name.
  Service probe(&store, tenants.get(), &metrics, nullptr, PolicySettings{});
  store.records = {{t.id, probe.BindResp(t, "carried"), named},
                   {t.id, K(7), named},
                   {t.id + 77, probe.BindResp(t, "carried"), named},
                   {t.id, probe.BindResp(t, long_name), envelope(long_name)}};
  std::filesystem::remove(Path());
  {
    Service svc(&store, tenants.get(), &metrics, nullptr, PolicySettings{});
    ASSERT_TRUE(svc.PersistRespNames(Path(), true, 0).ok());  // a new log: no replay yet
  }
  Service svc(&store, tenants.get(), &metrics, nullptr, PolicySettings{});
  ASSERT_TRUE(svc.PersistRespNames(Path(), true, 0).ok());
  EXPECT_EQ(svc.resp_index().recovered_from_store(), 1u);
  EXPECT_TRUE(svc.resp_index().Contains(t.id, probe.BindResp(t, "carried")));
  EXPECT_FALSE(svc.resp_index().Contains(t.id, K(7)));
  EXPECT_EQ(svc.resp_index().size(t.id + 77), 0u);
}

}  // namespace
}  // namespace kvtier::daemon
