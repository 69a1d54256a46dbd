// ThreadPool: a fixed set of persistent workers for the engine's data-parallel loops.
//
// ParallelFor(n, fn) calls fn(begin, end) on contiguous, disjoint chunks covering [0, n);
// the caller's thread takes part. Every index is processed by exactly one call, and the
// engine's loops compute each output element entirely inside one call with a fixed
// operation order, so results are bit-identical for any thread count.
//
// Cost: a call is cut into at most chunks_per_thread chunks per thread (kChunksPerThread unless
// the caller asks for fewer: a call of a few microseconds, such as a decode step's matrix-vector
// product, wants one chunk per thread), claimed with one compare-and-swap each, so a worker that
// is late (descheduled on a busy machine) never holds the caller up: the caller claims the
// chunks nobody took and waits only for chunks already running. The fields the caller writes,
// the claim word and the completion count sit on separate cache lines, so a spinning worker does
// not pull the claim word away from the threads claiming. Between calls workers spin for up to
// kSpinMicros (kHeldSpinMicros while the caller holds the pool with a Hold, e.g. for the whole of
// one token's pass over the layers), then sleep on a futex (std::atomic::wait); a call makes the
// wake-up system call only when some worker sleeps.
//
// Side tasks: a Side runs one function on an idle worker while the caller goes on, so two
// independent pieces of serial work (a decode step's mHC mixes beside its sublayer) overlap.
// The caller's ParallelFor calls meanwhile proceed without that worker (the caller claims the
// chunks it does not take); Join runs the function on the caller when no worker has taken it yet,
// so a late worker never holds the caller up for longer than the function itself.
// Thread safety: ParallelFor may be called from one thread at a time (not re-entrant); Hold
// and Side belong to that same thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace kvtier::engine {

// A non-owning reference to a callable fn(begin, end): what ParallelFor runs. Unlike the
// std::function it replaces it never allocates (a lambda capturing more than two references
// went to the heap on every call: about 1,000 times per decode step of the trained miniature).
// The callable must outlive the RangeFn; a lambda passed straight to ParallelFor does (the
// temporary lives until the call returns).
class RangeFn {
 public:
  template <typename F,
            typename = std::enable_if_t<!std::is_same_v<std::remove_cvref_t<F>, RangeFn>>>
  RangeFn(F&& f)  // NOLINT(google-explicit-constructor): lambdas convert, as to std::function
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* object, int64_t b, int64_t e) {
          (*static_cast<std::remove_reference_t<F>*>(object))(b, e);
        }) {}
  void operator()(int64_t b, int64_t e) const { call_(object_, b, e); }

 private:
  void* object_;
  void (*call_)(void*, int64_t, int64_t);
};

inline constexpr int kMaxThreads = 256;

class ThreadPool {
 public:
  // Chunks per thread a call is cut into by default (fewer when n is smaller).
  static constexpr int kChunksPerThread = 4;
  // How long an idle worker polls for the next call before it sleeps.
  static constexpr int kSpinMicros = 50;
  // The same while a Hold is alive: the serial stretches between the parallel sections of one
  // token (attention core, routing, the mHC mixes) stay well under this, so the workers never
  // sleep inside a token, yet a caller blocked for longer (an Engram row fetch) frees the CPU.
  static constexpr int kHeldSpinMicros = 1000;

  // threads <= 1: everything runs on the caller. Clamped to kMaxThreads.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  void ParallelFor(int64_t n, RangeFn fn) { ParallelFor(n, fn, kChunksPerThread); }
  // As above, cut into at most chunks_per_thread (clamped to [1, kChunksPerThread]) chunks per
  // thread.
  void ParallelFor(int64_t n, RangeFn fn, int chunks_per_thread);

  // Calls and side tasks handed to the workers so far (calls that ran on the caller alone are
  // not counted).
  int64_t dispatches() const { return dispatches_; }

  // One side task: fn runs on a worker (or on the caller, in Join, when none took it) while
  // the caller continues. fn must not call the pool. At most one Side per pool is alive at a
  // time. With a null pool or a pool of one thread, fn runs in the constructor. The destructor
  // joins; fn and what it touches must outlive the Side.
  class Side {
   public:
    Side(ThreadPool* pool, const std::function<void()>* fn);
    ~Side() { Join(); }
    Side(const Side&) = delete;
    Side& operator=(const Side&) = delete;
    // Returns once fn has run (at once after the first call).
    void Join();

   private:
    ThreadPool* pool_;  // null once joined (or when fn ran in the constructor)
  };

  // While a Hold lives, idle workers spin up to kHeldSpinMicros instead of kSpinMicros before
  // they sleep. Holds nest.
  class Hold {
   public:
    explicit Hold(ThreadPool* pool) : pool_(pool) {
      if (pool_ != nullptr) pool_->holds_.fetch_add(1, std::memory_order_relaxed);
    }
    ~Hold() {
      if (pool_ != nullptr) pool_->holds_.fetch_sub(1, std::memory_order_relaxed);
    }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    ThreadPool* pool_;
  };

 private:
  void WorkerLoop();
  // Claims and runs chunks of call `gen` until none is left (or a newer call began).
  void RunChunks(uint32_t gen);
  // Runs the posted side task if nobody has taken it; true when this thread ran it.
  bool RunSide();
  // Bumps gen_ (the caller only) and wakes sleeping workers; returns the new generation.
  uint32_t Publish();

  std::vector<std::thread> workers_;
  int64_t dispatches_ = 0;  // the caller's thread only
  // The current call, and gen_ that opens it: written by the caller, polled by idle workers
  // (one line). job_ and job_n_ are read by a worker only after it claimed a chunk of that call
  // (then they cannot change until the chunk is done).
  alignas(64) std::atomic<uint32_t> gen_{0};  // bumped per call; idle workers wait on it
  std::atomic<const RangeFn*> job_{nullptr};
  std::atomic<int64_t> job_n_{0};
  // (generation << 32) | (chunks << 16) | next chunk: one word, so a claim names its call.
  alignas(64) std::atomic<uint64_t> claim_{0};
  alignas(64) std::atomic<int64_t> done_{0};  // chunks of the current call finished
  alignas(64) std::atomic<int> sleepers_{0};  // workers asleep (or about to be) on gen_
  std::atomic<int> holds_{0};
  std::atomic<bool> stop_{false};
  // The side task: kSideIdle -> kSidePosted (caller) -> kSideTaken (one thread) -> kSideDone
  // (that thread) -> kSideIdle (the caller's Join).
  enum SideState : int { kSideIdle, kSidePosted, kSideTaken, kSideDone };
  alignas(64) std::atomic<int> side_state_{kSideIdle};
  std::atomic<const std::function<void()>*> side_fn_{nullptr};
};

}  // namespace kvtier::engine
