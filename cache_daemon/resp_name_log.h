// RespNameLog: the file that keeps the RESP key names of RespKeyIndex across restarts
// (format: docs/format/resp-names.md). An append-only log of records "tenant t's storage key k
// is named n", "k is no longer named" and "tenant t has no names"; replaying it in order gives
// the names to index at start. It is a superset of what the store holds: a name whose unit is
// gone is dropped when SCAN meets it (Service::RespScan), so the log needs no ordering with
// the store's deletes and evictions, only this: a name is durable no later than its unit
// (the caller appends and syncs it before the put; RespKeyIndex::Add).
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
  enum class Op : uint8_t { kAdd = 1, kRemove = 2, kRemoveTenant = 3 };
  // Bytes of a record besides its name.
  static constexpr uint64_t kRecordOverheadBytes = 56;
  static constexpr uint64_t kHeaderBytes = 16;

  struct Record {
    Op op;
    uint64_t tenant;
    storage::Key key;       // zero for kRemoveTenant
    std::string_view name;  // empty unless kAdd; valid during the replay callback only
  };

  // Opens (creating) the log at path and calls replay(record) for each valid record in order.
  // Names longer than name_bytes_max end the replay as a corrupt record would.
  static StatusOr<std::unique_ptr<RespNameLog>> Open(
      const std::string& path, uint64_t name_bytes_max,
      const std::function<void(const Record&)>& replay);
  ~RespNameLog();
  RespNameLog(const RespNameLog&) = delete;
  RespNameLog& operator=(const RespNameLog&) = delete;

  // Appends one record (written, not synced). IOError leaves the file as it was.
  Status Append(const Record& r);
  // fdatasync: every record appended before the call is durable when it returns OK.
  Status Sync();
  // Replaces the log by the records that each(emit) emits (kAdd only), durably (temporary
  // file, fdatasync, rename, directory fsync). On error the old log stays in use.
  Status Rewrite(const std::function<void(const std::function<void(const Record&)>&)>& each);

  uint64_t file_bytes() const { return file_bytes_; }
  uint64_t dropped_bytes() const { return dropped_bytes_; }

 private:
  RespNameLog(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  static void Encode(const Record& r, std::string* out);

  const std::string path_;
  int fd_;
  uint64_t file_bytes_ = 0;
  uint64_t dropped_bytes_ = 0;
  std::string scratch_;
};

}  // namespace kvtier::daemon
