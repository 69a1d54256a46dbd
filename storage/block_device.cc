#include "storage/block_device.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <shared_mutex>

#include "common/logging.h"
#include "storage/fault_injection.h"

namespace kvtier::storage {
namespace {

constexpr std::string_view kNoSpacePrefix = "no space left on device (ENOSPC): ";

Status ErrnoStatus(const std::string& what, int err) {
  std::string msg = what + ": " + std::strerror(err);
  if (err == ENOSPC) return NoSpaceError(msg);
  return Status::IOError(msg);
}

bool Aligned(uint64_t v, size_t a) { return a <= 1 || v % a == 0; }

Status FirstError(std::span<const IoRequest> batch) {
  for (const IoRequest& r : batch) {
    if (!r.result.ok()) return r.result;
  }
  return Status::Ok();
}

Status CheckAlignment(const IoRequest& r, size_t a) {
  if (!Aligned(r.offset, a) || !Aligned(r.length, a) ||
      !Aligned(reinterpret_cast<uintptr_t>(r.buffer), a)) {
    return Status::InvalidArgument("misaligned I/O (alignment " + std::to_string(a) + ")");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- memory ----

struct MemFile {
  std::shared_mutex mu;
  std::vector<uint8_t> data;
};

class MemDevice final : public BlockDevice {
 public:
  explicit MemDevice(std::shared_ptr<MemFile> file) : file_(std::move(file)) {}

  Status Submit(std::span<IoRequest> batch) override {
    if (batch.size() > kMaxBatchIos) return Status::InvalidArgument("batch too large");
    Status first;
    for (IoRequest& r : batch) {
      if (r.op == IoRequest::Op::kRead) {
        std::shared_lock lock(file_->mu);
        if (r.offset + r.length > file_->data.size()) {
          r.result = Status::Corruption("short read");
        } else {
          std::memcpy(r.buffer, file_->data.data() + r.offset, r.length);
          r.result = Status::Ok();
        }
      } else {
        std::unique_lock lock(file_->mu);
        if (file_->data.size() < r.offset + r.length) file_->data.resize(r.offset + r.length);
        std::memcpy(file_->data.data() + r.offset, r.buffer, r.length);
        r.result = Status::Ok();
      }
      if (first.ok() && !r.result.ok()) first = r.result;
    }
    return first;
  }
  Status Sync(bool) override { return Status::Ok(); }
  Status Allocate(uint64_t offset, uint64_t length) override {
    std::unique_lock lock(file_->mu);
    if (file_->data.size() < offset + length) file_->data.resize(offset + length);
    return Status::Ok();
  }
  uint64_t Size() const override {
    std::shared_lock lock(file_->mu);
    return file_->data.size();
  }
  size_t Alignment() const override { return 1; }
  std::string Kind() const override { return "memory"; }

 private:
  std::shared_ptr<MemFile> file_;
};

class MemEnv final : public DeviceEnv {
 public:
  StatusOr<std::shared_ptr<BlockDevice>> Open(const std::string& name, bool create) override {
    std::lock_guard lock(mu_);
    auto it = files_.find(name);
    if (it == files_.end()) {
      if (!create) return Status::NotFound("no device " + name);
      it = files_.emplace(name, std::make_shared<MemFile>()).first;
    }
    return std::shared_ptr<BlockDevice>(std::make_shared<MemDevice>(it->second));
  }
  StatusOr<std::vector<std::string>> List() override {
    std::lock_guard lock(mu_);
    std::vector<std::string> out;
    for (const auto& [name, f] : files_) out.push_back(name);
    return out;
  }
  Status Remove(const std::string& name) override {
    std::lock_guard lock(mu_);
    if (files_.erase(name) == 0) return Status::NotFound("no device " + name);
    return Status::Ok();
  }
  Status SyncDir() override { return Status::Ok(); }  // nothing to lose in a memory env
  StatusOr<uint64_t> FreeBytes() override { return kNoFreeSpaceLimit; }
  std::string Kind() const override { return "memory"; }

 private:
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<MemFile>> files_;
};

// ------------------------------------------------------------------ files ----

class FileDevice : public BlockDevice {
 public:
  FileDevice(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~FileDevice() override { ::close(fd_); }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

  Status Sync(bool data_only) override {
    int rc = data_only ? ::fdatasync(fd_) : ::fsync(fd_);
    if (rc != 0) return ErrnoStatus("fsync " + path_, errno);
    return Status::Ok();
  }
  Status Allocate(uint64_t offset, uint64_t length) override {
    if (::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(length)) == 0) {
      return Status::Ok();
    }
    int err = errno;
    if (err != EOPNOTSUPP) return ErrnoStatus("fallocate " + path_, err);
    if (Size() < offset + length && ::ftruncate(fd_, static_cast<off_t>(offset + length)) != 0) {
      return ErrnoStatus("ftruncate " + path_, errno);
    }
    return Status::Ok();
  }
  uint64_t Size() const override {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return 0;
    return static_cast<uint64_t>(st.st_size);
  }
  size_t Alignment() const override { return 4096; }

 protected:
  int fd_;
  std::string path_;
};

class PosixDevice final : public FileDevice {
 public:
  using FileDevice::FileDevice;
  Status Submit(std::span<IoRequest> batch) override {
    if (batch.size() > kMaxBatchIos) return Status::InvalidArgument("batch too large");
    Status first;
    for (IoRequest& r : batch) {
      r.result = CheckAlignment(r, Alignment());
      size_t done = 0;
      while (r.result.ok() && done < r.length) {
        ssize_t n = r.op == IoRequest::Op::kRead ? ::pread(fd_, r.buffer + done, r.length - done,
                                                           static_cast<off_t>(r.offset + done))
                                                 : ::pwrite(fd_, r.buffer + done, r.length - done,
                                                            static_cast<off_t>(r.offset + done));
        if (n < 0) {
          if (errno == EINTR) continue;
          r.result = ErrnoStatus(
              r.op == IoRequest::Op::kRead ? "pread " + path_ : "pwrite " + path_, errno);
        } else if (n == 0) {
          r.result =
              Status::Corruption("short read at " + std::to_string(r.offset) + " in " + path_);
        } else {
          done += static_cast<size_t>(n);
        }
      }
      if (first.ok() && !r.result.ok()) first = r.result;
    }
    return first;
  }
  std::string Kind() const override { return "posix"; }
};

// A pool of io_uring rings shared by the devices of one env. A call holds one ring for its
// whole batch, so completions are never reaped by the wrong thread.
class RingPool {
 public:
  struct Ring {
    io_uring ring{};
    bool has_buffers = false;
  };

  static StatusOr<std::shared_ptr<RingPool>> Create(uint32_t rings, uint32_t depth,
                                                    RingFaults* faults) {
    auto pool = std::make_shared<RingPool>();
    pool->depth_ = std::clamp<uint32_t>(depth, 1, kMaxQueueDepth);
    pool->faults_ = faults;
    for (uint32_t i = 0; i < std::max<uint32_t>(rings, 1); ++i) {
      auto r = std::make_unique<Ring>();
      int rc = io_uring_queue_init(pool->depth_, &r->ring, 0);
      if (rc < 0) return ErrnoStatus("io_uring_queue_init", -rc);
      pool->free_.push_back(r.get());
      pool->all_.push_back(std::move(r));
    }
    pool->usable_ = pool->all_.size();
    return pool;
  }
  ~RingPool() {
    for (auto& r : all_) io_uring_queue_exit(&r->ring);
  }

  // nullptr when every ring has been retired (Submit then fails with IOError).
  Ring* Acquire() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty() || usable_ == 0; });
    if (free_.empty()) return nullptr;
    Ring* r = free_.back();
    free_.pop_back();
    return r;
  }
  void Release(Ring* r) {
    {
      std::lock_guard lock(mu_);
      free_.push_back(r);
    }
    cv_.notify_one();
  }
  // Takes a ring that may still hold requests out of service for good (it is torn down with
  // the pool) and puts a fresh ring in its place, so the pool keeps its size. Logged.
  void Retire(Ring* r) {
    KVTIER_LOG(kError) << "io_uring ring retired: its requests could not be drained";
    (void)r;  // stays in all_ (torn down with the pool), never in free_ again
    auto fresh = std::make_unique<Ring>();
    int rc = io_uring_queue_init(depth_, &fresh->ring, 0);
    {
      std::lock_guard lock(mu_);
      if (rc == 0) {
        if (!registered_iov_.empty()) {
          fresh->has_buffers =
              io_uring_register_buffers(&fresh->ring, registered_iov_.data(),
                                        static_cast<unsigned>(registered_iov_.size())) == 0;
        }
        free_.push_back(fresh.get());
        all_.push_back(std::move(fresh));
      } else {
        KVTIER_LOG(kError) << "io_uring ring could not be replaced: "
                           << ErrnoStatus("io_uring_queue_init", -rc).ToString();
        --usable_;
      }
    }
    cv_.notify_all();
  }

  Status RegisterBuffers(std::span<const std::span<uint8_t>> buffers) {
    std::vector<Ring*> held;
    size_t usable = 0;
    {
      std::lock_guard lock(mu_);
      usable = usable_;
    }
    for (size_t i = 0; i < usable; ++i) {
      Ring* r = Acquire();
      if (r == nullptr) break;
      held.push_back(r);
    }
    std::vector<iovec> iov;
    for (auto b : buffers) iov.push_back(iovec{b.data(), b.size()});
    Status st;
    for (Ring* r : held) {
      if (r->has_buffers) io_uring_unregister_buffers(&r->ring);
      int rc = io_uring_register_buffers(&r->ring, iov.data(), static_cast<unsigned>(iov.size()));
      r->has_buffers = rc == 0;
      if (rc < 0 && st.ok()) st = ErrnoStatus("io_uring_register_buffers", -rc);
    }
    if (st.ok()) {
      std::lock_guard lock(buf_mu_);
      registered_.assign(buffers.begin(), buffers.end());
    }
    {
      std::lock_guard lock(mu_);
      registered_iov_ = iov;
    }
    for (Ring* r : held) Release(r);
    return st;
  }
  // Index of the registered buffer holding [p, p+len), or -1.
  int FixedIndex(const uint8_t* p, size_t len) {
    std::lock_guard lock(buf_mu_);
    for (size_t i = 0; i < registered_.size(); ++i) {
      const uint8_t* b = registered_[i].data();
      if (p >= b && p + len <= b + registered_[i].size()) return static_cast<int>(i);
    }
    return -1;
  }
  uint32_t depth() const { return depth_; }
  // Test faults (DirEnvOptions::ring_faults), or nullptr.
  RingFaults* faults() const { return faults_; }

 private:
  uint32_t depth_ = 64;
  RingFaults* faults_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Ring*> free_;
  std::vector<std::unique_ptr<Ring>> all_;
  std::mutex buf_mu_;
  std::vector<std::span<uint8_t>> registered_;
  std::vector<iovec> registered_iov_;  // under mu_: for replacement rings
  size_t usable_ = 0;                  // under mu_: rings not retired
};

// One request on a ring: the file it goes to (nullptr: next set its result and the ring only
// reports it), the request (its result is filled in) and the caller's tag for it.
struct RingIo {
  const FileDevice* file = nullptr;
  IoRequest* io = nullptr;
  uint64_t tag = 0;
};
// Hands over the next request (true) or has none now (false).
using RingNextFn = std::function<bool(RingIo*)>;
using RingDoneFn = std::function<void(const RingIo&)>;

class UringDevice final : public FileDevice {
 public:
  UringDevice(int fd, std::string path, std::shared_ptr<RingPool> pool)
      : FileDevice(fd, std::move(path)), pool_(std::move(pool)) {}

  Status Submit(std::span<IoRequest> batch) override {
    const FileDevice* self = this;
    return RunOnRing(pool_.get(), batch, {&self, 1}, IoDoneFn());
  }
  // Runs `batch` on one ring of the pool: request i on files[i], or on files[0] when files
  // holds one device (Submit). Every file is an O_DIRECT-or-not file of the pool's env.
  // on_done (may be empty): see DeviceEnv::SubmitAcross. A request left without a final result
  // by a ring error gets that error (never a silent OK over a buffer the device did not fill).
  static Status RunOnRing(RingPool* pool, std::span<IoRequest> batch,
                          std::span<const FileDevice* const> files, const IoDoneFn& on_done) {
    if (batch.size() > kMaxBatchIos) return Status::InvalidArgument("batch too large");
    auto file = [&](size_t i) { return files.size() == 1 ? files[0] : files[i]; };
    std::vector<bool> final(batch.size(), false);
    size_t pulled = 0;
    Status ring_st = RunRing(
        pool, pool->depth(),
        [&](RingIo* r) {
          if (pulled == batch.size()) return false;
          *r = {file(pulled), &batch[pulled], pulled};
          ++pulled;
          return true;
        },
        [&](const RingIo& r) {
          final[r.tag] = true;
          if (on_done) on_done(r.tag);
        });
    if (!ring_st.ok()) {
      for (size_t i = 0; i < batch.size(); ++i) {  // never handed to the ring
        if (final[i]) continue;
        batch[i].result = ring_st;
        if (on_done) on_done(i);
      }
      return ring_st;
    }
    return FirstError(batch);
  }

  // The core of every io_uring call: runs the requests `next` hands over on one ring of the
  // pool (acquired at the first request that needs it), at most max_inflight (clamped to
  // [1, depth]) at a time, pulling more as completions free room, until next has none and
  // nothing is in flight. done is called once per request handed over, when its result is
  // final (a misaligned request at once). Returns OK, or the ring's error: then every request
  // handed over has been reported, those without a result with that error, and the ring is
  // back in the pool (drained) or retired.
  static Status RunRing(RingPool* pool, size_t max_inflight, const RingNextFn& next,
                        const RingDoneFn& done) {
    struct Slot {
      RingIo io;
      size_t progress = 0;
      bool used = false;
    };
    std::vector<Slot> slots;
    std::vector<uint32_t> free_slots;
    std::deque<uint32_t> ready;  // slots to (re)submit
    size_t held = 0;             // slots in use: ready or in flight
    size_t inflight = 0;
    const size_t limit = std::clamp<size_t>(max_inflight, 1, pool->depth());
    RingFaults* faults = pool->faults();
    auto report = [&](uint32_t s) {
      RingIo io = slots[s].io;
      slots[s].used = false;
      free_slots.push_back(s);
      --held;
      done(io);
    };
    auto fail_held = [&](const Status& err) {
      ready.clear();
      for (uint32_t s = 0; s < slots.size(); ++s) {
        if (!slots[s].used) continue;
        slots[s].io.io->result = err;
        report(s);
      }
    };
    auto pull = [&]() {
      RingIo r;
      if (!next(&r)) return false;
      if (r.file == nullptr) {
        done(r);
        return true;
      }
      r.io->result = CheckAlignment(*r.io, r.file->Alignment());
      if (!r.io->result.ok() || r.io->length == 0) {
        done(r);
        return true;
      }
      uint32_t s;
      if (free_slots.empty()) {
        s = static_cast<uint32_t>(slots.size());
        slots.emplace_back();
      } else {
        s = free_slots.back();
        free_slots.pop_back();
      }
      slots[s] = {r, 0, true};
      ready.push_back(s);
      ++held;
      return true;
    };
    RingPool::Ring* ring = nullptr;
    while (true) {
      while (held < limit && pull()) {
      }
      if (held == 0) break;
      if (ring == nullptr && (ring = pool->Acquire()) == nullptr) {
        Status err = Status::IOError("no usable io_uring ring left");
        fail_held(err);
        return err;
      }
      // Fill the submission queue with what is ready.
      while (!ready.empty()) {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring->ring);
        if (sqe == nullptr) break;
        uint32_t s = ready.front();
        ready.pop_front();
        IoRequest& r = *slots[s].io.io;
        size_t done_bytes = slots[s].progress;
        int fd = slots[s].io.file->fd();
        uint8_t* buf = r.buffer + done_bytes;
        unsigned len = static_cast<unsigned>(r.length - done_bytes);
        uint64_t off = r.offset + done_bytes;
        int fixed = ring->has_buffers ? pool->FixedIndex(buf, len) : -1;
        if (r.op == IoRequest::Op::kRead) {
          if (fixed >= 0) {
            io_uring_prep_read_fixed(sqe, fd, buf, len, off, fixed);
          } else {
            io_uring_prep_read(sqe, fd, buf, len, off);
          }
        } else if (fixed >= 0) {
          io_uring_prep_write_fixed(sqe, fd, buf, len, off, fixed);
        } else {
          io_uring_prep_write(sqe, fd, buf, len, off);
        }
        io_uring_sqe_set_data64(sqe, s);
        ++inflight;
      }
      // Submit and block until at least one completion arrives (no spinning).
      int rc = io_uring_submit_and_wait(&ring->ring, 1);
      if (rc >= 0 && faults != nullptr && faults->TakeSubmission()) rc = -EIO;
      if (rc < 0 && rc != -EINTR) {
        Status err = ErrnoStatus("io_uring_submit_and_wait", -rc);
        // Never hand a ring with requests in flight (or prepared, unsubmitted SQEs) back to
        // the pool, and never return while the kernel may still use the caller's buffers:
        // drain what was submitted; a ring that cannot be drained is retired for good.
        if (Drain(ring, &inflight)) {
          pool->Release(ring);
        } else {
          pool->Retire(ring);
        }
        fail_held(err);
        return err;
      }
      io_uring_cqe* cqe = nullptr;
      while (io_uring_peek_cqe(&ring->ring, &cqe) == 0) {
        uint32_t s = static_cast<uint32_t>(io_uring_cqe_get_data64(cqe));
        int res = cqe->res;
        io_uring_cqe_seen(&ring->ring, cqe);
        --inflight;
        if (faults != nullptr && faults->TakeCompletion()) res = -EIO;
        IoRequest& r = *slots[s].io.io;
        const FileDevice* f = slots[s].io.file;
        if (res < 0) {
          if (res == -EAGAIN || res == -EINTR) {
            ready.push_back(s);
          } else {
            r.result = ErrnoStatus(
                std::string(r.op == IoRequest::Op::kRead ? "read " : "write ") + f->path(), -res);
            report(s);
          }
        } else if (res == 0) {
          r.result =
              Status::Corruption("short read at " + std::to_string(r.offset) + " in " + f->path());
          report(s);
        } else {
          slots[s].progress += static_cast<size_t>(res);
          if (slots[s].progress < r.length) {
            ready.push_back(s);  // short transfer
          } else {
            report(s);
          }
        }
      }
    }
    if (ring != nullptr) pool->Release(ring);
    return Status::Ok();
  }
  RingPool* pool() const { return pool_.get(); }
  std::string Kind() const override { return "io_uring"; }

 private:
  // Submits any prepared SQEs and reaps completions until *inflight is 0. False when the
  // ring keeps failing (kDrainAttemptsMax hard errors in a row).
  static bool Drain(RingPool::Ring* ring, size_t* inflight) {
    static constexpr int kDrainAttemptsMax = 64;
    int failures = 0;
    while (*inflight > 0) {
      int rc = io_uring_submit_and_wait(&ring->ring, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        if (++failures >= kDrainAttemptsMax) return false;
        continue;
      }
      failures = 0;
      io_uring_cqe* cqe = nullptr;
      while (*inflight > 0 && io_uring_peek_cqe(&ring->ring, &cqe) == 0) {
        io_uring_cqe_seen(&ring->ring, cqe);
        --*inflight;
      }
    }
    return true;
  }

  std::shared_ptr<RingPool> pool_;
};

class DirEnv final : public DeviceEnv {
 public:
  DirEnv(std::string dir, DirEnvOptions options, std::shared_ptr<RingPool> pool)
      : dir_(std::move(dir)), options_(options), pool_(std::move(pool)) {}

  StatusOr<std::shared_ptr<BlockDevice>> Open(const std::string& name, bool create) override {
    std::string path = dir_ + "/" + name;
    int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0);
    bool direct = pool_ != nullptr && options_.use_o_direct && !direct_refused_;
    int fd = ::open(path.c_str(), flags | (direct ? O_DIRECT : 0), 0644);
    if (fd < 0 && direct && errno == EINVAL) {
      KVTIER_LOG(kWarn) << "O_DIRECT refused by the file system under " << dir_
                        << "; using buffered I/O";
      direct_refused_ = true;
      fd = ::open(path.c_str(), flags, 0644);
    }
    if (fd < 0) {
      if (errno == ENOENT) return Status::NotFound("no device " + path);
      return ErrnoStatus("open " + path, errno);
    }
    if (pool_ != nullptr) {
      return std::shared_ptr<BlockDevice>(std::make_shared<UringDevice>(fd, path, pool_));
    }
    return std::shared_ptr<BlockDevice>(std::make_shared<PosixDevice>(fd, path));
  }
  StatusOr<std::vector<std::string>> List() override {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
      if (e.is_regular_file()) out.push_back(e.path().filename().string());
    }
    if (ec) return Status::IOError("list " + dir_ + ": " + ec.message());
    std::sort(out.begin(), out.end());
    return out;
  }
  Status Remove(const std::string& name) override {
    std::string path = dir_ + "/" + name;
    if (::unlink(path.c_str()) != 0) {
      if (errno == ENOENT) return Status::NotFound("no device " + path);
      return ErrnoStatus("unlink " + path, errno);
    }
    return Status::Ok();
  }
  Status SyncDir() override {
    int fd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open directory " + dir_, errno);
    int rc = ::fsync(fd);
    int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus("fsync directory " + dir_, err);
    return Status::Ok();
  }
  StatusOr<uint64_t> FreeBytes() override {
    struct statvfs st {};
    if (::statvfs(dir_.c_str(), &st) != 0) return ErrnoStatus("statvfs " + dir_, errno);
    return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  }
  Status RegisterBuffers(std::span<const std::span<uint8_t>> buffers) override {
    if (pool_ == nullptr) return Status::Ok();
    return pool_->RegisterBuffers(buffers);
  }
  std::string Kind() const override { return pool_ != nullptr ? "io_uring" : "posix"; }
  // io_uring: the whole batch on one ring (one submission up to the ring's depth), when every
  // device is one of this env's io_uring files; otherwise per device.
  Status SubmitAcross(std::span<DeviceIo> batch, const IoDoneFn& on_done) override {
    if (pool_ == nullptr) return DeviceEnv::SubmitAcross(batch, on_done);
    if (batch.size() > kMaxBatchIos) return Status::InvalidArgument("batch too large");
    std::vector<const FileDevice*> files(batch.size());
    std::vector<IoRequest> reqs(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      auto* dev = dynamic_cast<UringDevice*>(batch[i].device);
      if (dev == nullptr || dev->pool() != pool_.get()) {
        return DeviceEnv::SubmitAcross(batch, on_done);
      }
      files[i] = dev;
      reqs[i] = batch[i].io;
    }
    if (batch.empty()) return Status::Ok();
    // The caller sees request i's result in batch[i] by the time on_done(i) runs.
    IoDoneFn done;
    if (on_done) {
      done = [&](size_t i) {
        batch[i].io.result = reqs[i].result;
        on_done(i);
      };
    }
    Status st = UringDevice::RunOnRing(pool_.get(), reqs, files, done);
    for (size_t i = 0; i < batch.size(); ++i) batch[i].io.result = reqs[i].result;
    return st;
  }
  // io_uring: the whole stream on one ring (RunRing), refilled as requests complete.
  Status Stream(size_t max_inflight, const IoNextFn& next, const IoReportFn& done) override {
    if (pool_ == nullptr) return DeviceEnv::Stream(max_inflight, next, done);
    Status first;
    Status ring_st = UringDevice::RunRing(
        pool_.get(), max_inflight,
        [&](RingIo* r) {
          DeviceIo* d = next();
          if (d == nullptr) return false;
          auto* dev = dynamic_cast<UringDevice*>(d->device);
          r->io = &d->io;
          r->tag = reinterpret_cast<uintptr_t>(d);
          r->file = dev;
          if (dev == nullptr || dev->pool() != pool_.get()) {
            r->file = nullptr;  // reported at once, with this error
            d->io.result = Status::InvalidArgument("stream request on a device of another env");
          }
          return true;
        },
        [&](const RingIo& r) {
          if (first.ok() && !r.io->result.ok()) first = r.io->result;
          done(reinterpret_cast<DeviceIo*>(r.tag));
        });
    return ring_st.ok() ? first : ring_st;
  }

 private:
  std::string dir_;
  DirEnvOptions options_;
  std::shared_ptr<RingPool> pool_;
  std::atomic<bool> direct_refused_{false};
};

}  // namespace

Status BlockDevice::Read(uint64_t offset, std::span<uint8_t> buffer) {
  IoRequest r{IoRequest::Op::kRead, offset, buffer.data(), buffer.size(), {}};
  return Submit(std::span<IoRequest>(&r, 1));
}

Status BlockDevice::Write(uint64_t offset, std::span<const uint8_t> data) {
  IoRequest r{IoRequest::Op::kWrite, offset, const_cast<uint8_t*>(data.data()), data.size(), {}};
  return Submit(std::span<IoRequest>(&r, 1));
}

Status DeviceEnv::SubmitAcross(std::span<DeviceIo> batch, const IoDoneFn& on_done) {
  if (batch.size() > kMaxBatchIos) return Status::InvalidArgument("batch too large");
  for (const DeviceIo& d : batch) {
    if (d.device == nullptr) return Status::InvalidArgument("request without a device");
  }
  // One Submit per device, in the order the devices first appear.
  std::vector<bool> done(batch.size(), false);
  std::vector<IoRequest> reqs;
  std::vector<size_t> index;
  Status first;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (done[i]) continue;
    reqs.clear();
    index.clear();
    for (size_t j = i; j < batch.size(); ++j) {
      if (done[j] || batch[j].device != batch[i].device) continue;
      done[j] = true;
      reqs.push_back(batch[j].io);
      index.push_back(j);
    }
    (void)batch[i].device->Submit(reqs);  // each request carries its own result
    for (size_t k = 0; k < index.size(); ++k) {
      batch[index[k]].io.result = reqs[k].result;
      if (first.ok() && !reqs[k].result.ok()) first = reqs[k].result;
      if (on_done) on_done(index[k]);
    }
  }
  return first;
}

Status DeviceEnv::Stream(size_t max_inflight, const IoNextFn& next, const IoReportFn& done) {
  (void)max_inflight;  // one request at a time
  Status first;
  while (DeviceIo* d = next()) {
    if (d->device == nullptr) {
      d->io.result = Status::InvalidArgument("request without a device");
    } else {
      (void)d->device->Submit({&d->io, 1});  // the request carries its own result
    }
    if (first.ok() && !d->io.result.ok()) first = d->io.result;
    done(d);
  }
  return first;
}

void AlignedFree::operator()(uint8_t* p) const { std::free(p); }

AlignedBuffer AllocateAligned(size_t length, size_t alignment) {
  size_t rounded = (std::max<size_t>(length, 1) + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, rounded);
  return AlignedBuffer(static_cast<uint8_t*>(p));
}

StatusOr<std::unique_ptr<DeviceEnv>> NewDirEnv(const std::string& dir,
                                               const DirEnvOptions& options) {
  std::error_code ec;
  bool created = std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError("create " + dir + ": " + ec.message());
  if (created) {
    // The new directory's own entry must be durable before segments inside it are.
    std::filesystem::path self = std::filesystem::path(dir).lexically_normal();
    if (!self.has_filename()) self = self.parent_path();  // "a/b/" names "a/b"
    std::string parent = self.parent_path().string();
    int fd = ::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || ::fsync(fd) != 0) {
      int err = errno;
      if (fd >= 0) ::close(fd);
      return ErrnoStatus("fsync directory " + parent, err);
    }
    ::close(fd);
  }
  std::shared_ptr<RingPool> pool;
  if (options.engine != IoEngine::kPosix) {
    auto p = RingPool::Create(options.rings, options.queue_depth, options.ring_faults);
    if (p.ok()) {
      pool = std::move(p).value();
    } else if (options.engine == IoEngine::kIoUring) {
      return p.status();
    } else {
      KVTIER_LOG(kWarn) << "io_uring unavailable (" << p.status().ToString()
                        << "); using pread/pwrite";
    }
  }
  return std::unique_ptr<DeviceEnv>(new DirEnv(dir, options, std::move(pool)));
}

Status NoSpaceError(const std::string& detail) {
  return Status::IOError(std::string(kNoSpacePrefix) + detail);
}

bool IsNoSpace(const Status& s) { return s.IsIOError() && s.message().starts_with(kNoSpacePrefix); }

std::unique_ptr<DeviceEnv> NewMemEnv() { return std::make_unique<MemEnv>(); }

}  // namespace kvtier::storage
