// FaultInjectionEnv: a DeviceEnv wrapper that injects device faults, after RocksDB's
// FaultInjectionTestFS and SQLite's test6.c. Test-only, but compiled into the library so the
// stress and crash harnesses can use it.
//
// - Unsynced writes are kept in memory (reads see them) and reach the wrapped device only on
//   Sync(). SimulateCrash() drops them, optionally tearing the most recent write (a random
//   sector-granular prefix of it reaches the device), and then fails every later call with
//   IOError("simulated crash") until the env is destroyed. A new env over the same base then
//   sees the "after reboot" state.
// - Directory entries are modelled too: a device created since the last SyncDir() is removed
//   from the wrapped env by SimulateCrash (its entry never reached the disk), and Remove()
//   only hides a device until SyncDir() removes it from the wrapped env (a crash first brings
//   it back).
// - Injected faults, by probability per call (seeded, reproducible) or armed one-shot:
//   EIO on read, ENOSPC on write, short read (Corruption), a bit flip in data returned by a
//   read, EIO on Sync. PauseSyncs holds every Sync until released (for tests of commits
//   that several writers share). SetReadDelay makes every read wait first (a slow device,
//   for tests of what overtakes a reader, such as puts overtaking the segment cleaner).
// - Every injection is logged: Log() returns the lines, and when log_path is set each line is
//   also appended to that file at once (so the log survives the simulated crash).
//
// RingFaults: one-shot faults of an io_uring env's rings (NewDirEnv with
// DirEnvOptions::ring_faults), so that tests reach the ring error paths of the real io_uring
// code (block_device.cc), which FaultInjectionEnv (wrapping devices, not rings) cannot:
// - FailNextSubmissions(n, after): n io_uring_submit_and_wait calls of any ring of the env,
//   after `after` good ones, report EIO once the kernel has taken their requests (requests
//   in flight: the ring is drained, and every request of the call without a result gets
//   the error);
// - FailNextCompletions(n, after): n completions, after `after` good ones, carry EIO
//   instead of their result.
//
// Thread safety: all methods may be called concurrently.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "storage/block_device.h"

namespace kvtier::storage {

struct RingFaults {
  // Arms n faults that strike after `after` more good submissions (completions).
  void FailNextSubmissions(int n, int after = 0) { submissions_.Arm(n, after); }
  void FailNextCompletions(int n, int after = 0) { completions_.Arm(n, after); }
  // Faults injected so far.
  uint64_t injected() const { return injected_.load(); }

  // Used by the rings: true when this submission (completion) must fail; consumes one.
  bool TakeSubmission() { return Take(submissions_); }
  bool TakeCompletion() { return Take(completions_); }

 private:
  struct Armed {
    std::mutex mu;
    int skip = 0, fail = 0;  // under mu
    std::atomic<bool> any{false};
    void Arm(int n, int after) {
      std::lock_guard lock(mu);
      skip = after;
      fail = n;
      any.store(n > 0);
    }
  };
  bool Take(Armed& a) {
    if (!a.any.load()) return false;  // the rings' common case: no lock
    std::lock_guard lock(a.mu);
    if (a.fail <= 0) return false;
    if (a.skip > 0) {
      --a.skip;
      return false;
    }
    if (--a.fail == 0) a.any.store(false);
    injected_.fetch_add(1);
    return true;
  }
  Armed submissions_, completions_;
  std::atomic<uint64_t> injected_{0};
};

struct FaultOptions {
  uint64_t seed = 1;
  // Per-call probabilities in [0, 1].
  double read_eio_probability = 0.0;
  double write_enospc_probability = 0.0;
  double short_read_probability = 0.0;
  double bit_flip_probability = 0.0;
  // On SimulateCrash, tear the most recent unsynced write instead of dropping it whole.
  bool torn_last_write = true;
  // Optional file that receives every log line as it happens.
  std::string log_path;
};

class FaultInjectionEnv final : public DeviceEnv {
 public:
  // base is not owned and must outlive this env.
  FaultInjectionEnv(DeviceEnv* base, FaultOptions options);
  ~FaultInjectionEnv() override;

  StatusOr<std::shared_ptr<BlockDevice>> Open(const std::string& name, bool create) override;
  StatusOr<std::vector<std::string>> List() override;
  Status Remove(const std::string& name) override;
  Status SyncDir() override;
  // The base's, or the modelled disk's (SetDiskBytes).
  StatusOr<uint64_t> FreeBytes() override;
  std::string Kind() const override { return "fault(" + base_->Kind() + ")"; }

  // One-shot faults: the next n matching calls fail.
  void FailNextReads(int n) { arm_eio_.store(n); }
  void FailNextWrites(int n) { arm_enospc_.store(n); }
  void FlipBitInNextReads(int n) { arm_flip_.store(n); }
  void FailNextSyncs(int n) { arm_sync_eio_.store(n); }
  // While paused, Sync() blocks (before doing anything) until PauseSyncs(false).
  void PauseSyncs(bool paused);
  // Sync() calls so far (including failed ones), and calls blocked by PauseSyncs right now.
  uint64_t syncs() const { return syncs_.load(); }
  int syncs_waiting() const;
  // While set, every write fails with ENOSPC.
  void SetNoSpace(bool no_space) { no_space_.store(no_space); }
  // A disk that holds `files` files: while it is non-zero, Allocate fails with ENOSPC when
  // more files exist than that (the one being allocated counts; List()'s view: a removed file
  // frees its space at once, as an unlinked file does). 0 (the default): no such limit.
  void SetFilesMax(size_t files) { files_max_.store(files); }
  // A disk of disk_bytes that this env's devices share with other files (other_bytes: the
  // SSD tier's index, a name log): while disk_bytes is non-zero, FreeBytes() is disk_bytes
  // less other_bytes and the size of every listed device (0 when they exceed it). 0 (the
  // default): FreeBytes() is the base's. Only the report: writes are not refused by it.
  void SetDiskBytes(uint64_t disk_bytes) { disk_bytes_.store(disk_bytes); }
  void SetOtherBytes(uint64_t other_bytes) { other_bytes_.store(other_bytes); }
  // Every read request sleeps this long before it is served (0: none, the default).
  void SetReadDelay(std::chrono::microseconds delay) { read_delay_us_.store(delay.count()); }

  // Drops unsynced writes (tearing the last one when configured) and fails all later I/O.
  void SimulateCrash();
  bool crashed() const { return crashed_.load(); }

  std::vector<std::string> Log() const;
  uint64_t injected() const { return injected_.load(); }

  // Internal: used by the wrapped devices.
  struct DeviceState;
  bool Roll(double p);
  uint64_t NextRandom();
  void Record(const std::string& line);
  bool TakeArmed(std::atomic<int>& counter);
  std::atomic<int> arm_eio_{0}, arm_enospc_{0}, arm_flip_{0}, arm_sync_eio_{0};
  std::atomic<uint64_t> syncs_{0};
  // Blocks while syncs are paused; returns false after a crash.
  void WaitSyncsAllowed();
  std::atomic<bool> no_space_{false};
  std::atomic<size_t> files_max_{0};
  std::atomic<uint64_t> disk_bytes_{0}, other_bytes_{0};
  std::atomic<int64_t> read_delay_us_{0};
  std::atomic<bool> crashed_{false};
  FaultOptions options_;
  void NoteWrite(DeviceState* state);

 private:
  DeviceEnv* base_;
  mutable std::mutex mu_;
  std::mt19937_64 rng_;
  std::vector<std::string> log_;
  std::vector<std::weak_ptr<DeviceState>> devices_;
  DeviceState* last_writer_ = nullptr;
  std::vector<std::string> created_unsynced_;  // under mu_: entries not yet durable
  std::vector<std::string> removed_unsynced_;  // under mu_: hidden, still in base_
  bool syncs_paused_ = false;                  // under mu_
  int syncs_waiting_ = 0;                      // under mu_
  std::condition_variable sync_cv_;
  std::atomic<uint64_t> injected_{0};
  int log_fd_ = -1;
};

}  // namespace kvtier::storage
