#include "cluster/pause_guard.h"

#include <chrono>

#include "common/logging.h"

namespace kvtier::cluster {

PauseGuard::PauseGuard(PauseGuardOptions options, std::function<Status()> catch_up,
                       const Clock* clock)
    : options_(options),
      catch_up_(std::move(catch_up)),
      clock_(clock),
      last_tick_ms_(clock->NowMs()) {}

PauseGuard::~PauseGuard() { Stop(); }

void PauseGuard::Start() {
  last_tick_ms_.store(clock_->NowMs(), std::memory_order_release);
  auto every_tick = [this](auto step) {
    std::unique_lock lock(mu_);
    while (!stop_) {
      lock.unlock();
      step();
      lock.lock();
      cv_.wait_for(lock, std::chrono::milliseconds(options_.tick_ms), [&] { return stop_; });
    }
  };
  ticker_ = std::thread(every_tick, [this] { Tick(); });
  catcher_ = std::thread(every_tick, [this] { (void)CatchUpIfDue(); });
}

void PauseGuard::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (ticker_.joinable()) ticker_.join();
  if (catcher_.joinable()) catcher_.join();
}

bool PauseGuard::Current() const {
  const uint64_t last = last_tick_ms_.load(std::memory_order_acquire);
  const uint64_t now = clock_->NowMs();
  // The tick thread has not run for pause_ms: this process is (or was just) paused, and the
  // thread that will notice it has not yet.
  if (now > last && now - last > options_.pause_ms) return false;
  // Read after last_tick_ms_: a tick that noticed a pause set the hold before it moved it.
  return !held_.load(std::memory_order_acquire);
}

void PauseGuard::Tick() {
  const uint64_t now = clock_->NowMs();
  const uint64_t last = last_tick_ms_.load(std::memory_order_acquire);
  if (now > last && now - last > options_.pause_ms) {
    {
      std::lock_guard lock(hold_mu_);
      hold_until_ms_ = now + options_.hold_ms;
      next_attempt_ms_ = 0;
      held_.store(true, std::memory_order_release);
    }
    pauses_.fetch_add(1, std::memory_order_relaxed);
    last_pause_ms_.store(now - last, std::memory_order_relaxed);
    KVTIER_LOG(kWarn) << "cluster: this process did not run for " << now - last
                      << " ms; no read is served from its store (to peers or its clients) for "
                      << options_.hold_ms << " ms and until a tombstone catch-up after that "
                      << "succeeds";
  }
  last_tick_ms_.store(now, std::memory_order_release);
}

bool PauseGuard::CatchUpIfDue() {
  const uint64_t started = clock_->NowMs();
  {
    std::lock_guard lock(hold_mu_);
    if (!held_.load(std::memory_order_relaxed) || started < hold_until_ms_ ||
        started < next_attempt_ms_) {
      return false;
    }
  }
  const Status st = catch_up_();
  std::lock_guard lock(hold_mu_);
  // A pause noticed since this catch-up started moved hold_until_ms_ past its start: the
  // catch-up may predate deletes that pause missed, and the hold stays.
  if (st.ok() && started >= hold_until_ms_) {
    held_.store(false, std::memory_order_release);
  } else if (!st.ok()) {
    next_attempt_ms_ = clock_->NowMs() + options_.retry_ms;
  }
  return true;
}

PauseGuardStats PauseGuard::stats() const {
  return PauseGuardStats{.pauses = pauses_.load(std::memory_order_relaxed),
                         .held = held_.load(std::memory_order_relaxed) ? 1u : 0u,
                         .last_pause_ms = last_pause_ms_.load(std::memory_order_relaxed)};
}

}  // namespace kvtier::cluster
