// RespNameLog: the file that keeps the RESP key names of RespKeyIndex across restarts
// (format: docs/format/resp-names.md, version 2). An append-only log of records "tenant t's
// storage key k is named n", "k is no longer named", "tenant t has no names" and checkpoints
// "every SSD record before log position p had its name appended before this record";
// replaying it in order gives the names to index at start, and the last checkpoint tells from
// where the store's own records (which carry their names, Service) must be read to find the
// names the log may have lost. It is a superset of what the store holds: a name whose unit is
// gone is dropped when SCAN meets it (Service::RespScan), so the log needs no ordering with
// the store's deletes and evictions, only this: a name is appended before its unit's put
// (RespKeyIndex::Add), so file order and the checkpoints tell which names a record can miss.
// Version 1 files (no checkpoints) are read; Rewrite writes version 2.
//
// Errors: Open fails on an unreadable file or an unknown header; a record with a bad checksum
// or length ends the replay there (a torn tail: the rest is cut off, counted in
// dropped_bytes()). Appends that fail are undone (the file is truncated back), so the log never
// holds half a record followed by good ones.
//
// Thread safety: none; RespKeyIndex serialises every call (Sync may run concurrently with
// appends: it only fdatasyncs the descriptor, which Rewrite never replaces while a Sync runs).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "storage/tier_manager.h"

namespace kvtier::daemon {

class RespNameLog {
 public:
  enum class Op : uint8_t { kAdd = 1, kRemove = 2, kRemoveTenant = 3, kCheckpoint = 4 };
  // Bytes of a record besides its name.
  static constexpr uint64_t kRecordOverheadBytes = 56;
  static constexpr uint64_t kHeaderBytes = 16;
  // The version written; Open also reads version 1 (no kCheckpoint records).
  static constexpr uint32_t kVersion = 2;

  struct Record {
    Op op;
    uint64_t tenant;                  // zero for kCheckpoint
    storage::Key key;                 // zero for kRemoveTenant and kCheckpoint
    std::string_view name;            // empty unless kAdd; valid during the replay callback only
    storage::LogPosition position{};  // kCheckpoint only
  };

  // Opens (creating) the log at path and calls replay(record) for each valid record in order.
  // Names longer than name_bytes_max end the replay as a corrupt record would.
  static StatusOr<std::unique_ptr<RespNameLog>> Open(
      const std::string& path, uint64_t name_bytes_max,
      const std::function<void(const Record&)>& replay);
  ~RespNameLog();
  RespNameLog(const RespNameLog&) = delete;
  RespNameLog& operator=(const RespNameLog&) = delete;

  // Appends one record (written, not synced), after the buffered ones (WritePending first).
  // IOError leaves the file as it was and r not appended (the buffered records stay
  // buffered). InvalidArgument: a kCheckpoint to a version 1 file (Rewrite it first).
  Status Append(const Record& r);
  // Buffers one record in memory, after the buffered ones, to be written by the next
  // WritePending or Append (one write for many records). Nothing reaches the file, not even
  // the page cache: a process crash loses the buffered records. InvalidArgument as Append.
  Status Buffer(const Record& r);
  // Writes every buffered record with one write (not synced), in order. IOError leaves the
  // file as it was and the records buffered (a later call retries them).
  Status WritePending();
  // fdatasync: every record appended or written by WritePending before the call is durable
  // when it returns OK (buffered ones are not).
  Status Sync();
  // Replaces the log by the records that each(emit) emits (kAdd only), durably (temporary
  // file, fdatasync, rename, directory fsync), and drops the buffered records (each emits
  // the state they led to). On error the old log stays in use, the buffered records too.
  Status Rewrite(const std::function<void(const std::function<void(const Record&)>&)>& each);

  // A buffer that grew beyond this is given back after it was written.
  static constexpr size_t kPendingKeepBytes = 1 << 20;
  uint64_t pending_bytes() const { return pending_.size(); }
  uint64_t pending_records() const { return pending_records_; }
  uint64_t file_bytes() const { return file_bytes_; }
  uint32_t version() const { return version_; }  // of the file in use
  uint64_t dropped_bytes() const { return dropped_bytes_; }

 private:
  RespNameLog(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  static void Encode(const Record& r, std::string* out);

  const std::string path_;
  int fd_;
  uint64_t file_bytes_ = 0;
  uint64_t dropped_bytes_ = 0;
  uint32_t version_ = kVersion;
  std::string scratch_;
  std::string pending_;  // buffered records, encoded (Buffer)
  uint64_t pending_records_ = 0;
};

}  // namespace kvtier::daemon
