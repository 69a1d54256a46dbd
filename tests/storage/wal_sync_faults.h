// WalSyncFaults: a RocksDB file system for the SSD tier's index (TierManagerOptions::
// ssd_index_env, through rocksdb::NewCompositeEnv) that fails the index's write-ahead log on
// demand. Shared by the storage durability tests and the daemon's RESP tests.
#pragma once

#include <rocksdb/env.h>
#include <rocksdb/file_system.h>

#include <atomic>
#include <memory>
#include <string>

namespace kvtier::testing {

// The index's file system with faults on demand: the next n syncs of its write-ahead log fail
// (EIO), as a transient error of the disk under the index would; or the next n appends to it
// fail with ENOSPC, as on a full disk.
class WalSyncFaults : public rocksdb::FileSystemWrapper {
 public:
  WalSyncFaults() : rocksdb::FileSystemWrapper(rocksdb::FileSystem::Default()) {}
  const char* Name() const override { return "WalSyncFaults"; }
  void FailNextWalSyncs(int n) { fail_.store(n); }
  void FailNextWalAppendsNoSpace(int n) { fail_appends_.store(n); }
  // The next n write-ahead logs RocksDB creates fail to open (an index that cannot reopen).
  void FailNextWalOpens(int n) { fail_opens_.store(n); }
  int failed() const { return failed_.load(); }
  rocksdb::IOStatus NewWritableFile(const std::string& name, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* file,
                                    rocksdb::IODebugContext* dbg) override {
    if (name.ends_with(".log") && Take(&fail_opens_)) {
      return rocksdb::IOStatus::IOError("injected EIO creating the index's WAL");
    }
    rocksdb::IOStatus s = target()->NewWritableFile(name, o, file, dbg);
    if (s.ok() && name.ends_with(".log")) *file = std::make_unique<Wal>(std::move(*file), this);
    return s;
  }

 private:
  class Wal : public rocksdb::FSWritableFileOwnerWrapper {
   public:
    Wal(std::unique_ptr<rocksdb::FSWritableFile>&& f, WalSyncFaults* fs)
        : rocksdb::FSWritableFileOwnerWrapper(std::move(f)), fs_(fs) {}
    rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* d) override {
      return fs_->Take(&fs_->fail_appends_) ? NoSpace() : target()->Append(data, o, d);
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                             const rocksdb::DataVerificationInfo& v,
                             rocksdb::IODebugContext* d) override {
      return fs_->Take(&fs_->fail_appends_) ? NoSpace() : target()->Append(data, o, v, d);
    }
    rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
      return fs_->Take(&fs_->fail_) ? Injected() : target()->Sync(o, d);
    }
    rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* d) override {
      return fs_->Take(&fs_->fail_) ? Injected() : target()->Fsync(o, d);
    }

   private:
    static rocksdb::IOStatus Injected() {
      return rocksdb::IOStatus::IOError("injected EIO on the index's WAL sync");
    }
    static rocksdb::IOStatus NoSpace() {
      return rocksdb::IOStatus::NoSpace("injected ENOSPC appending to the index's WAL");
    }
    WalSyncFaults* fs_;
  };
  bool Take(std::atomic<int>* armed) {
    int n = armed->load();
    while (n > 0 && !armed->compare_exchange_weak(n, n - 1)) {
    }
    if (n <= 0) return false;
    failed_.fetch_add(1);
    return true;
  }
  std::atomic<int> fail_{0}, fail_opens_{0}, fail_appends_{0}, failed_{0};
};

}  // namespace kvtier::testing
