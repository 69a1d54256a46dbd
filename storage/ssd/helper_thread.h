// Private to the SSD tier: one background thread that runs one task at a time for a caller
// that would otherwise run that task itself. A large batch GET hands it half of the batch's
// device reads and their verification, so that two cores work on one GET
// (SsdTier::Impl::GetBatch; docs/ARCHITECTURE.md, storage/).
//
//   if (helper.TryStart([&half] { half(); })) {  // the other half on the helper
//     ...the first half...
//     if (helper.TakeBack()) half();  // the helper had not begun it: run it here
//     helper.Wait();
//   } else {
//     ...both halves here...
//   }
//
// TryStart never waits: it is false (the task is not run) while a task started by another
// caller has not been waited for, so a caller is never delayed behind another batch. A busy
// machine may not run the helper thread soon: TakeBack then hands the task back to its
// caller instead of making it wait for the helper to be scheduled. The caller whose TryStart
// returned true must call Wait exactly once (after TakeBack, if it calls it), before anything
// the task references goes away; the task must not call TryStart itself.
//
// Thread safety: TryStart may be called from any thread; Wait only by the caller that
// started the task.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace kvtier::storage::ssd {

class HelperThread {
 public:
  HelperThread() : thread_([this] { Loop(); }) {}
  ~HelperThread() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_one();
    thread_.join();
  }
  HelperThread(const HelperThread&) = delete;
  HelperThread& operator=(const HelperThread&) = delete;

  // Starts task on the helper thread when no other task is started and not yet waited for.
  bool TryStart(std::function<void()> task) {
    {
      std::lock_guard lock(mu_);
      if (state_ != State::kIdle || stop_) return false;
      task_ = std::move(task);
      state_ = State::kStarted;
    }
    work_cv_.notify_one();
    return true;
  }
  // True when the helper has not begun the started task: it never will, and the caller
  // runs it itself. False: the helper runs (or ran) it; Wait for it.
  bool TakeBack() {
    std::lock_guard lock(mu_);
    if (state_ != State::kStarted) return false;
    state_ = State::kDone;
    return true;
  }
  // Returns once the task TryStart started has returned (or was taken back).
  void Wait() {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return state_ == State::kDone; });
    task_ = nullptr;
    state_ = State::kIdle;
  }

 private:
  enum class State { kIdle, kStarted, kRunning, kDone };

  void Loop() {
    std::unique_lock lock(mu_);
    while (true) {
      work_cv_.wait(lock, [&] { return stop_ || state_ == State::kStarted; });
      if (state_ != State::kStarted) return;  // stop_ (nothing started, or taken back)
      state_ = State::kRunning;
      lock.unlock();
      task_();  // task_ is not touched by anyone else until Wait sees kDone
      lock.lock();
      state_ = State::kDone;
      done_cv_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_;  // the helper waits for a task (or stop_)
  std::condition_variable done_cv_;  // the starting caller waits for kDone
  State state_ = State::kIdle;       // under mu_
  std::function<void()> task_;       // set under mu_ while kIdle; run by the helper
  bool stop_ = false;                // under mu_
  std::thread thread_;               // last: started once everything above is initialised
};

}  // namespace kvtier::storage::ssd
