// Private to cache_daemon/ (kvtier_client): ClientImpl, the Client of client.h, one class over
// three files split by concern:
//   client.cc        the connection: connect, HELLO and SHM_ATTACH, the reader thread, the
//                    framing of calls (Call, Wait); Client::Connect and the free functions
//   client_calls.cc  the operations (LOOKUP, PUT, GET, ...) split into batches
//   client_shm.cc    the shared-memory region: its allocator, and GET values copied out of it
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cache_daemon/client.h"
#include "cache_daemon/tls_client.h"
#include "cache_daemon/wire.h"

namespace kvtier::daemon::client_internal {

using wire::Frame;
using wire::Opcode;
constexpr size_t kRecvChunkBytes = 256 * 1024;
constexpr uint64_t kShmAlignBytes = 64;

// Sends every byte (retrying partial sends and EINTR); *sent_out: bytes sent before an error.
Status SendAll(int fd, std::span<const uint8_t> bytes, size_t* sent_out = nullptr);

// First-fit allocator over the shared-memory region. Thread-safe.
class ShmAllocator {
 public:
  void Reset(uint64_t bytes);
  std::optional<uint64_t> Alloc(uint64_t bytes);
  void Free(uint64_t off, uint64_t bytes);

 private:
  std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // offset -> bytes, protected by mu_
};

// Where a GET's values are copied out of the shared-memory file (ValuesBuffer): anonymous
// memory, 2 MiB aligned and advised MADV_HUGEPAGE, cached per thread and reused by the
// thread's next GET. The first user access to each 4 KiB page of a fresh mapping costs a page
// fault, and in a virtual machine with shadow page tables about 5-10 us of CPU even after
// MADV_POPULATE_READ; reading a 256-unit resume (1.4 MB) in place from a new connection's
// region cost ~1.7 ms that way, its copy out with one pread ~0.1 ms (docs/performance/resume.md,
// "Resume fetch: one write per GET, values copied out (helper shmget)"). Buffers larger than
// kValuesCachedBytesMax are not kept.
constexpr uint64_t kValuesCachedBytesMax = 32ull << 20;
constexpr uint64_t kValuesGrainBytes = 2ull << 20;

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
struct ValuesBuffer {
  std::unique_ptr<uint8_t, FreeDeleter> data;
  uint64_t bytes = 0;
};

// A buffer of at least `bytes`: the thread's cached one when it is large enough (taken out of
// the cache while in use, so a GET issued from inside a visitor gets its own), else a new
// one. Empty when memory is short.
ValuesBuffer TakeValuesBuffer(uint64_t bytes);
void ReturnValuesBuffer(ValuesBuffer b);

using wire::InsideArea;

// A shared-memory allocation released on destruction.
struct ShmLease {
  ShmAllocator* alloc = nullptr;
  uint64_t offset = 0, bytes = 0;
  ShmLease() = default;
  ShmLease(ShmAllocator* a, uint64_t o, uint64_t b) : alloc(a), offset(o), bytes(b) {}
  ShmLease(ShmLease&& o) noexcept : alloc(o.alloc), offset(o.offset), bytes(o.bytes) {
    o.alloc = nullptr;
  }
  ShmLease(const ShmLease&) = delete;
  ~ShmLease() {
    if (alloc != nullptr) alloc->Free(offset, bytes);
  }
};

// A request waiting for its reply, with the shared-memory ranges the daemon may still read or
// write for it. A caller that stops waiting (timeout) drops its own references; the ranges
// stay allocated here until the reply arrives or the connection fails, so they are never
// handed to another request while the daemon could still use them.
struct Pending {
  std::promise<StatusOr<Frame>> reply;
  std::vector<std::shared_ptr<ShmLease>> leases;
};

class ClientImpl final : public Client {
 public:
  explicit ClientImpl(const ClientOptions& o) : options_(o), parser_(o.max_frame_bytes) {}

  ~ClientImpl() override;

  Status Open();

  const wire::HelloResponse& hello() const override { return hello_; }
  bool shm_attached() const override { return shm_ != nullptr; }
  Status shm_status() const override { return shm_status_; }
  Status connection_status() const override;

  uint64_t NewTurn() override { return next_turn_.fetch_add(1, std::memory_order_relaxed); }

  std::future<StatusOr<LookupResult>> LookupAsync(std::span<const wire::Key> chain,
                                                  uint64_t turn) override;

  std::future<StatusOr<std::vector<Status>>> PutAsync(std::span<const PutUnit> units,
                                                      const PutOptions& o) override;

  Status Get(std::span<const wire::Key> keys, uint64_t turn,
             const std::function<void(size_t, const GetItem&)>& visit) override;

  Status Prefetch(std::span<const wire::Key> keys) override;
  Status Pin(std::span<const wire::Key> keys, uint64_t lease_ms) override;
  Status Unpin(std::span<const wire::Key> keys) override;
  StatusOr<uint32_t> Delete(std::span<const wire::Key> keys) override;
  Status DeleteAll() override;
  StatusOr<std::string> StatsJson() override;
  StatusOr<std::string> PolicyGet() override;
  StatusOr<std::string> PolicySet(const std::string& json) override;
  Status Drain(bool shutdown) override;
  StatusOr<wire::EngramGrantResponse> EngramGrant(std::span<const std::string> regions,
                                                  uint64_t ttl_ms) override;
  Status EngramReport(const wire::EngramReport& report) override;
  Status TEST_SendRaw(std::span<const uint8_t> bytes) override;

 private:
  // The frame flags and body of a LOOKUP/GET/PUT of `turn` (wire::kFlagTurn): the turn id in
  // front of the body when there is one and the daemon takes turns; unchanged otherwise.
  uint16_t WithTurn(uint64_t turn, uint16_t flags, std::vector<uint8_t>* body) const;

  // Keys per request: the daemon's advertised max_batch_keys (HELLO), never above the wire
  // format's kMaxBatchKeys; every batch call is split at it.
  size_t BatchLimit() const {
    uint32_t m = hello_.max_batch_keys;
    return m == 0 || m > wire::kMaxBatchKeys ? wire::kMaxBatchKeys : m;
  }
  // Runs call(b) for consecutive slices of at most BatchLimit() keys (once for no keys).
  Status ForEachBatch(std::span<const wire::Key> keys,
                      const std::function<Status(std::span<const wire::Key>)>& call);

  // Blocking request/response used before the reader thread exists. Collects a passed fd.
  StatusOr<Frame> SyncCall(Opcode op, const std::vector<uint8_t>& body, int* fd_out);

  void ReadLoop();

  // leases: the shared-memory ranges the request names; kept until its reply (see Pending).
  std::future<StatusOr<Frame>> Call(Opcode op, uint16_t flags, std::span<const uint8_t> body,
                                    std::vector<std::shared_ptr<ShmLease>> leases = {});

  void Abandon(uint64_t id, const Status& st);

  StatusOr<Frame> Wait(std::future<StatusOr<Frame>>& fut);

  // Sends one call and checks the response status; parse(r) reads the payload.
  Status Simple(Opcode op, std::span<const uint8_t> body,
                const std::function<Status(wire::Reader*)>& parse, uint16_t flags = 0);

  StatusOr<std::string> TextCall(Opcode op, std::span<const uint8_t> body);

  StatusOr<LookupResult> DoLookup(const std::vector<wire::Key>& keys, uint64_t turn);

  StatusOr<std::future<StatusOr<Frame>>> SendPut(std::span<const PutUnit> units,
                                                 const PutOptions& o,
                                                 std::vector<std::shared_ptr<ShmLease>>* leases);

  bool InShm(std::span<const uint8_t> v) const {
    return shm_ != nullptr && v.data() >= shm_ && v.data() + v.size() <= shm_ + shm_bytes_;
  }

  // Copies the part of the lease that a reply's values occupy, [lease.offset, end of the last
  // value), out of the shared-memory file into *out with one pread (ValuesBuffer says why not
  // read in place). False (nothing copied: the caller views the values in the mapping) when
  // no value lies in the lease, the range is larger than kValuesCachedBytesMax, or the read
  // fails. Each value is still checked against the lease before it is viewed.
  bool CopyOutValues(const std::vector<wire::GetEntry>& entries, const ShmLease& lease,
                     ValuesBuffer* out);

  Status GetChunk(std::span<const wire::Key> keys, size_t base, uint64_t turn,
                  const std::function<void(size_t, const GetItem&)>& visit);

  ClientOptions options_;
  // TLS over TCP: owns the TCP socket and the relay thread; fd_ is its plaintext end.
  // Destroyed after the destructor's body has closed fd_ (which ends the relay).
  std::unique_ptr<TlsTunnel> tls_;
  int fd_ = -1;
  bool is_unix_ = false;
  wire::HelloResponse hello_;
  wire::FrameParser parser_;  // handshake, then the reader thread only
  std::thread reader_;
  std::mutex write_mu_;
  mutable std::mutex mu_;
  std::map<uint64_t, Pending> pending_;  // protected by mu_
  // Auth is on and HELLO carried no token: only HELLO/AUTH would be accepted (set in Open).
  bool unauthenticated_ = false;
  Status broken_;  // protected by mu_
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> next_turn_{1};  // NewTurn's ids
  uint8_t* shm_ = nullptr;
  uint64_t shm_bytes_ = 0;
  int shm_fd_ = -1;    // the region's memfd (with shm_): GET values are read out of it
  Status shm_status_;  // why shm_ is null after SHM_ATTACH (Ok when attached or not asked)
  ShmAllocator alloc_;
};

}  // namespace kvtier::daemon::client_internal
