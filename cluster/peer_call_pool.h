// PeerCallPool: the threads that run the router's calls to peers (cluster/router.h), a fixed
// number of them, fed from a bounded queue. A call the queue has no room for is refused
// (TrySubmit returns false, counted), so a burst of requests costs queue slots, never an
// unbounded number of threads.
//
// Tasks must not block on other tasks of the same pool (the router's calls are plain peer
// I/O, each bounded by the peer timeout). The destructor runs every queued task before it
// joins the threads: a caller waiting for a result always gets one.
//
// Thread safety: TrySubmit and the counters may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvtier::cluster {

struct PeerCallPoolOptions {
  uint32_t threads = 16;     // calls in flight at once, 1..1024
  uint32_t queue_max = 256;  // calls waiting for a free thread; more are refused, 0..65536
};

class PeerCallPool {
 public:
  explicit PeerCallPool(PeerCallPoolOptions options);
  ~PeerCallPool();
  PeerCallPool(const PeerCallPool&) = delete;
  PeerCallPool& operator=(const PeerCallPool&) = delete;

  // Queues task for a pool thread; false (and counted in refused()) when threads +
  // queue_max accepted tasks have not finished yet (every thread busy and queue_max
  // waiting).
  bool TrySubmit(std::function<void()> task);

  uint64_t refused() const;
  uint64_t queued() const;  // waiting now
  const PeerCallPoolOptions& options() const { return options_; }

 private:
  void Run();

  const PeerCallPoolOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  uint64_t refused_ = 0;                     // guarded by mu_
  uint64_t unfinished_ = 0;                  // accepted, not finished; guarded by mu_
  uint64_t limit_ = 0;                       // threads + queue_max
  std::vector<std::thread> threads_;
};

}  // namespace kvtier::cluster
