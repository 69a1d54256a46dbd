// BlockDevice: aligned, offset-addressed I/O on one file (an SSD segment), and DeviceEnv, the
// factory that names, opens, lists and deletes devices (a data directory, memory, or a
// fault-injecting wrapper around either).
//
// Alignment: every offset, length and buffer address passed to Read/Write/Submit must be a
// multiple of Alignment() (4096 for O_DIRECT devices, 1 for memory). Misaligned requests are
// InvalidArgument. Callers own all buffers; a device never keeps a pointer after a call returns.
//
// Batches: Submit() hands a batch of reads/writes to the device at once (io_uring: one
// submission of up to queue_depth SQEs, completions reaped by blocking in io_uring_wait_cqe,
// never by spinning) and returns when every request has completed. Each request gets its own
// result; Submit's own Status is the first failure (or OK). Batches larger than kMaxBatchIos
// are InvalidArgument.
//
// Batches across devices: DeviceEnv::SubmitAcross runs one batch whose requests name their
// own devices of that env (the SSD tier's batch GET, whose records lie in several segments).
// io_uring: one ring, one submission of up to queue_depth SQEs for all of them; other envs
// (memory, POSIX, wrappers): one Submit per device, in the order the devices first appear.
// An optional IoDoneFn is called on the calling thread for each request as soon as it has its
// final result, before SubmitAcross returns; with io_uring the other requests of the batch stay
// in flight meanwhile, so the caller's per-request work (a checksum, a copy) overlaps the device.
//
// Streams: DeviceEnv::Stream runs requests that the caller hands over one at a time while
// earlier ones are still in flight, up to a bound, pulling the next one as each completes
// (the SSD tier's writer keeps the device's queue full across its write buffers, as fio
// does, instead of letting it drain after each buffer). io_uring: one ring for the whole
// stream, refilled as completions arrive; other envs: each request submitted alone (its
// device's Submit) as soon as it is handed over.
//
// Durability: a completed Write is visible to later Reads of any thread, but survives a crash
// only after Sync() returns OK. A device's existence (Open with create, Remove) survives a
// crash only after DeviceEnv::SyncDir() returns OK.
//
// Thread safety: every method of BlockDevice and DeviceEnv may be called concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvtier::storage {

inline constexpr size_t kMaxBatchIos = 1024;
// Hard upper bound on an io_uring queue depth (SQ entries per ring).
inline constexpr uint32_t kMaxQueueDepth = 1024;

struct IoRequest {
  enum class Op : uint8_t { kRead, kWrite };
  Op op = Op::kRead;
  uint64_t offset = 0;
  uint8_t* buffer = nullptr;  // read target or write source; not owned
  size_t length = 0;
  // Filled by Submit: OK, or the error of this request (a short read past the end of the
  // device is Corruption("short read")).
  Status result;
};

class BlockDevice;

// A request of DeviceEnv::SubmitAcross: the device (of that env, not owned, alive for the
// call) and the request, whose result Submit fills in.
struct DeviceIo {
  BlockDevice* device = nullptr;
  IoRequest io;
};

// Called with the index (into the SubmitAcross batch) of a request whose result is final. It
// must not call back into the env.
using IoDoneFn = std::function<void(size_t index)>;

// Stream's source and sink. IoNextFn returns the next request to run (owned by the caller,
// valid and untouched by it until reported) or nullptr when it has none now. IoReportFn is
// called with a request once its result (io.result) is final. Neither may call back into
// the env.
using IoNextFn = std::function<DeviceIo*()>;
using IoReportFn = std::function<void(DeviceIo* request)>;

struct RingFaults;  // storage/fault_injection.h (tests)

class BlockDevice {
 public:
  virtual ~BlockDevice() = default;

  // Reads exactly buffer.size() bytes at offset. Reading past Size() is Corruption.
  virtual Status Read(uint64_t offset, std::span<uint8_t> buffer);
  // Writes all of data at offset, growing the device when needed.
  virtual Status Write(uint64_t offset, std::span<const uint8_t> data);
  // Runs a batch (see the file comment).
  virtual Status Submit(std::span<IoRequest> batch) = 0;
  // Makes every completed write durable (fdatasync when data_only).
  virtual Status Sync(bool data_only = true) = 0;
  // Reserves [offset, offset+length) (fallocate); Size() grows to at least offset+length.
  virtual Status Allocate(uint64_t offset, uint64_t length) = 0;
  // Current size in bytes.
  virtual uint64_t Size() const = 0;
  virtual size_t Alignment() const = 0;
  // A short name for logs: "io_uring", "posix", "memory", "fault(...)".
  virtual std::string Kind() const = 0;
};

// Which implementation a directory-backed env uses for its files.
enum class IoEngine : uint8_t {
  kAuto,     // io_uring + O_DIRECT; falls back to POSIX when either is refused (logged)
  kIoUring,  // io_uring; O_DIRECT when the file system allows it
  kPosix,    // pread/pwrite, buffered (no O_DIRECT)
};

struct DirEnvOptions {
  IoEngine engine = IoEngine::kAuto;
  // SQ entries per io_uring ring; clamped to [1, kMaxQueueDepth]. It bounds the queue depth
  // of one Submit: 256 lets a 256-unit batch GET have every SSD read in flight at once.
  uint32_t queue_depth = 256;
  // Rings shared by all devices of the env; each call holds one ring exclusively.
  uint32_t rings = 4;
  bool use_o_direct = true;
  // Test only: faults injected into this env's rings (storage/fault_injection.h); not owned,
  // must outlive the env. nullptr in production.
  RingFaults* ring_faults = nullptr;
};

class DeviceEnv {
 public:
  virtual ~DeviceEnv() = default;
  // Opens (creating when create is true) the named device. NotFound if absent and !create.
  virtual StatusOr<std::shared_ptr<BlockDevice>> Open(const std::string& name, bool create) = 0;
  // Names of existing devices, sorted.
  virtual StatusOr<std::vector<std::string>> List() = 0;
  // Removes the named device; open handles stay usable until released. NotFound if absent.
  virtual Status Remove(const std::string& name) = 0;
  // Makes the creations and removals of devices so far durable (fsync of the directory).
  // Pure virtual so that a wrapping env cannot silently drop it.
  virtual Status SyncDir() = 0;
  // Bytes free for this env's files on the file system that holds them (statvfs: blocks
  // available to unprivileged writers x fragment size), shared with whatever else lives
  // there (the SSD tier's RocksDB index, the RESP name log). kNoFreeSpaceLimit: the env has no
  // such limit (memory). Pure virtual so that a wrapping env forwards it.
  static constexpr uint64_t kNoFreeSpaceLimit = UINT64_MAX;
  virtual StatusOr<uint64_t> FreeBytes() = 0;
  // Registers long-lived I/O buffers (io_uring fixed buffers); writes from inside a registered
  // buffer use IORING_OP_WRITE_FIXED. Optional: the default does nothing.
  virtual Status RegisterBuffers(std::span<const std::span<uint8_t>> buffers) {
    (void)buffers;
    return Status::Ok();
  }
  // Runs a batch whose requests name devices opened from this env (see "Batches across
  // devices" above) and returns when every request has completed; each gets its own result,
  // and the return is the first failure (or OK). More than kMaxBatchIos requests, or a null
  // device: InvalidArgument. The default submits per device (a wrapping env inherits it, so
  // its devices' own Submit runs) and reports each device's requests done after its Submit.
  // on_done (may be empty) is called once per request of a valid batch, in completion order.
  virtual Status SubmitAcross(std::span<DeviceIo> batch, const IoDoneFn& on_done);
  Status SubmitAcross(std::span<DeviceIo> batch) { return SubmitAcross(batch, IoDoneFn()); }
  // Runs a stream (see "Streams" above): calls next whenever fewer than max_inflight
  // (clamped to [1, the env's queue depth]) of its requests are in flight, and returns once
  // next has returned nullptr with nothing in flight. Every request next handed over has
  // been reported by then, with its own result; a ring error gives every request it left
  // without a result that error, and ends the stream (what next still holds is left to the
  // caller). Requests must name devices of this env (else InvalidArgument, for that request).
  // Returns the first failure (or OK). The default runs each request alone through its
  // device's Submit (so a wrapping env's devices see every request).
  virtual Status Stream(size_t max_inflight, const IoNextFn& next, const IoReportFn& done);
  virtual std::string Kind() const = 0;
};

// Files in `dir` (created if missing).
StatusOr<std::unique_ptr<DeviceEnv>> NewDirEnv(const std::string& dir,
                                               const DirEnvOptions& options = {});
// Devices in process memory. Alignment 1. Contents live as long as the env.
std::unique_ptr<DeviceEnv> NewMemEnv();

// A device's "no space left on device" error: IOError("no space left on device (ENOSPC): " +
// detail). Every device and env that runs out of space (the file devices, FaultInjectionEnv)
// reports it this way, so that IsNoSpace recognises it.
Status NoSpaceError(const std::string& detail);
// Whether `s` is a NoSpaceError.
bool IsNoSpace(const Status& s);

// Allocates `length` bytes aligned to `alignment` (a power of two); freed with free().
struct AlignedFree {
  void operator()(uint8_t* p) const;
};
using AlignedBuffer = std::unique_ptr<uint8_t[], AlignedFree>;
AlignedBuffer AllocateAligned(size_t length, size_t alignment = 4096);

}  // namespace kvtier::storage
