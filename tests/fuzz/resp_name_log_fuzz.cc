// libFuzzer target: the RESP name log's replay (cache_daemon/resp_name_log.h) over damaged
// files. kvtierd replays this file at every start, after crashes too, so whatever a crash or a
// bad disk leaves in it must replay to a prefix of what was appended, never crash the daemon
// or keep it from starting, and leave a log that takes appends again.
//
// The first input byte picks the mode; the log lives in a TempDir (under $TMPDIR: run with
// TMPDIR=/dev/shm, where the log's fdatasync on creation costs nothing).
//   - structured (even first byte): bytes 1..5 give a cut offset (u16 LE; 0xffff: none), a
//     byte to flip (u16 LE) and the flip's XOR mask (0: none); the rest is a script of
//     records appended one by one (op, tenant, key byte, name), at most kRecordsMax. Then the
//     file is damaged and reopened. Invariants: the header survived the damage, or Open
//     refuses the file as Corruption; otherwise the replay is a prefix of the appended records
//     holding every record that ends at or before the damage, dropped_bytes() is what the
//     file held past that prefix, and a record appended afterwards replays after it.
//   - raw (odd first byte): the rest is the file. Invariants: a replayed record has a known
//     op and a name within the bound, a checkpoint carries no name, and a record appended
//     after the replay replays after the same records.
//
//   cmake --preset fuzz && cmake --build --preset fuzz --target kvtier_resp_name_log_fuzz
//   build/fuzz/tests/fuzz/kvtier_resp_name_log_fuzz -max_total_time=60
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cache_daemon/resp_name_log.h"
#include "common/config.h"
#include "common/temp_dir.h"
#include "tests/fuzz/fuzz_require.h"

namespace {

using kvtier::fuzz::Require;

using kvtier::daemon::RespNameLog;
using Op = RespNameLog::Op;

constexpr uint64_t kNameBytesMax = 40;
constexpr size_t kRecordsMax = 64;
// A scripted log stays far below this; a raw input is at most libFuzzer's -max_len.
constexpr size_t kLogBytesMax = 16 << 20;

// A record with its name owned (Record's name is a view valid during the replay only).
struct Owned {
  Op op;
  uint64_t tenant;
  kvtier::storage::Key key;
  std::string name;
  kvtier::storage::LogPosition position;
  bool operator==(const Owned&) const = default;
};

Owned Own(const RespNameLog::Record& r) {
  return {r.op, r.tenant, r.key, std::string(r.name), r.position};
}

RespNameLog::Record View(const Owned& o) { return {o.op, o.tenant, o.key, o.name, o.position}; }

// The log's path, in a directory of its own for this process's runs (removed at exit).
const std::string& LogPath() {
  static const kvtier::TempDir dir("kvtier-name-log-fuzz-");
  static const std::string path = [] {
    Require(dir.ok());
    return dir.File("names.log");
  }();
  return path;
}

std::string ReadLog() {
  auto bytes = kvtier::ReadFileBounded(LogPath(), kLogBytesMax);
  Require(bytes.ok());
  return std::move(*bytes);
}

void WriteLog(std::string_view bytes) {
  std::ofstream out(LogPath(), std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  Require(out.good());
}

kvtier::StatusOr<std::unique_ptr<RespNameLog>> Open(std::vector<Owned>* replayed) {
  replayed->clear();
  return RespNameLog::Open(LogPath(), kNameBytesMax,
                           [&](const RespNameLog::Record& r) { replayed->push_back(Own(r)); });
}

// Appends `extra` to the open log, closes it, reopens it: the replay must be `before` + extra.
void AppendAndReplay(std::unique_ptr<RespNameLog> log, const std::vector<Owned>& before) {
  const Owned extra{Op::kAdd, 9, {}, "after", {}};
  Require(log->Append(View(extra)).ok());
  log.reset();
  std::vector<Owned> again;
  auto reopened = Open(&again);
  Require(reopened.ok());
  std::vector<Owned> want = before;
  want.push_back(extra);
  Require(again == want);
  Require((*reopened)->dropped_bytes() == 0);
}

void Structured(const uint8_t* data, size_t size) {
  if (size < 5) return;
  const size_t cut = data[0] | size_t{data[1]} << 8, flip = data[2] | size_t{data[3]} << 8;
  const uint8_t mask = data[4];
  std::vector<Owned> appended;
  std::vector<uint64_t> ends;  // file bytes after each record
  {
    std::vector<Owned> none;
    auto log = Open(&none);
    Require(log.ok() && none.empty());
    for (size_t i = 5; i + 3 <= size && appended.size() < kRecordsMax;) {
      // A record from 3 script bytes (op and name length, tenant, key byte), then its name.
      Owned r{static_cast<Op>(1 + data[i] % 4), data[i + 1], {}, {}, {}};
      r.key[0] = data[i + 2];
      const size_t name = std::min<size_t>(data[i] / 4 % 16, size - i - 3);
      switch (r.op) {
        case Op::kAdd:
          r.name.assign(reinterpret_cast<const char*>(data + i + 3), name);
          break;
        case Op::kRemove:
          break;
        case Op::kRemoveTenant:
          r.key = {};
          break;
        case Op::kCheckpoint:
          r = {Op::kCheckpoint, 0, {}, {}, {data[i + 1], data[i + 2]}};
          break;
      }
      i += 3 + name;
      Require((*log)->Append(View(r)).ok());
      appended.push_back(r);
      ends.push_back((*log)->file_bytes());
    }
  }
  std::string file = ReadLog();
  size_t damage = file.size();  // the first byte the damage touched
  if (mask != 0 && flip < file.size()) {
    file[flip] = static_cast<char>(file[flip] ^ mask);
    damage = flip;
  }
  if (cut != 0xffff && cut < file.size()) {
    file.resize(cut);
    damage = std::min(damage, cut);
  }
  WriteLog(file);
  std::vector<Owned> replayed;
  auto log = Open(&replayed);
  if (!log.ok()) {
    Require(log.status().IsCorruption() && damage < RespNameLog::kHeaderBytes && !file.empty());
    return;
  }
  Require(file.empty() || damage >= RespNameLog::kHeaderBytes);
  Require(replayed.size() <= appended.size());
  Require(std::equal(replayed.begin(), replayed.end(), appended.begin()));
  size_t intact = 0;
  while (intact < ends.size() && ends[intact] <= damage) ++intact;
  Require(file.empty() || replayed.size() >= intact);
  const uint64_t kept = replayed.empty() ? RespNameLog::kHeaderBytes : ends[replayed.size() - 1];
  Require(file.empty() || (*log)->dropped_bytes() == file.size() - kept);
  AppendAndReplay(std::move(*log), replayed);
}

void Raw(const uint8_t* data, size_t size) {
  WriteLog(std::string_view(reinterpret_cast<const char*>(data), size));
  std::vector<Owned> replayed;
  auto log = Open(&replayed);
  if (!log.ok()) {
    Require(log.status().IsCorruption());
    return;
  }
  for (const Owned& r : replayed) {
    Require(r.op >= Op::kAdd && r.op <= Op::kCheckpoint);
    Require(r.name.size() <= kNameBytesMax);
    Require(r.op != Op::kCheckpoint || r.name.empty());
  }
  AppendAndReplay(std::move(*log), replayed);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::filesystem::remove(LogPath());
  if (data[0] % 2 == 0) {
    Structured(data + 1, size - 1);
  } else {
    Raw(data + 1, size - 1);
  }
  return 0;
}
