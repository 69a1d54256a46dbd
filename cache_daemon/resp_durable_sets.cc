#include "cache_daemon/resp_durable_sets.h"

#include <algorithm>

namespace kvtier::daemon {

RespDurableSets::RespDurableSets(Service* service, DaemonMetrics* metrics, Post post)
    : service_(service),
      metrics_(metrics),
      post_(std::move(post)),
      put_thread_([this] { PutLoop(); }),
      commit_thread_([this] { CommitLoop(); }) {}

RespDurableSets::~RespDurableSets() { Stop(); }

bool RespDurableSets::Submit(std::unique_ptr<RespSetJob> job, Done done, bool put_here) {
  return SubmitItems(std::span<std::unique_ptr<RespSetJob>>(&job, 1), std::move(done), put_here);
}

bool RespDurableSets::Submit(std::vector<std::unique_ptr<RespSetJob>> jobs, Done done,
                             bool put_here) {
  return SubmitItems(jobs, std::move(done), put_here);
}

bool RespDurableSets::SubmitItems(std::span<std::unique_ptr<RespSetJob>> jobs, Done done,
                                  bool put_here) {
  const size_t n = jobs.size();
  for (const std::unique_ptr<RespSetJob>& job : jobs) put_here = put_here && job->name_seq == 0;
  // Appends the group to *to in one piece (under mu_); done goes with its first item.
  auto append = [&](std::vector<Item>* to) {
    for (size_t i = 0; i < n; ++i) {
      to->push_back(
          Item{std::move(jobs[i]), {}, i == 0 ? std::move(done) : Done(), i == 0 ? n : 0});
    }
  };
  bool stopped = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped = stop_;
    if (!stopped) {
      metrics_->resp_durable_sets_pending.fetch_add(n);
      if (!put_here) {
        const bool was_empty = queue_.empty();
        append(&queue_);
        if (was_empty) cv_.notify_one();
        return false;
      }
      ++putting_here_;  // the commit thread does not stop before these puts are handed over
    }
  }
  if (stopped) {
    if (Later later = done(Status::Unavailable("kvtierd is shutting down"))) later();
    return false;
  }
  // The names ride in the units: nothing to wait for before the puts, so the put thread's
  // hand-off (a wake-up on every SET's way) is skipped. A group stops at its first failed
  // put: the SETs from there on take its error.
  size_t failed_at = n;
  Status failure;
  for (size_t i = 0; i < n && failed_at == n; ++i) {
    Status st = service_->RespSetPut(jobs[i].get());
    if (!st.ok()) {
      failed_at = i;
      failure = std::move(st);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    --putting_here_;
    append(&put_);
    for (size_t i = 0; i < n; ++i) put_status_.push_back(i < failed_at ? Status::Ok() : failure);
  }
  put_cv_.notify_one();
  return true;
}

void RespDurableSets::SubmitRemovals(std::vector<storage::DeferredCommit> commits, Done done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      metrics_->resp_durable_sets_pending.fetch_add(1);
      put_.push_back(Item{nullptr, std::move(commits), std::move(done), 1});
      put_status_.push_back(Status::Ok());
      put_cv_.notify_one();
      return;
    }
  }
  if (Later later = done(service_->RespDelComplete(commits))) later();
}

void RespDurableSets::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  put_cv_.notify_one();
  if (put_thread_.joinable()) put_thread_.join();
  if (commit_thread_.joinable()) commit_thread_.join();
}

void RespDurableSets::PutLoop() {
  std::vector<Item> batch;
  std::vector<Status> st;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) {  // stopped, and everything submitted has been put
        putting_ = false;
        put_cv_.notify_one();
        return;
      }
      batch.swap(queue_);
      putting_ = true;
    }
    PutBatch(&batch, &st);
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < batch.size(); ++i) {
      put_.push_back(std::move(batch[i]));
      put_status_.push_back(std::move(st[i]));
    }
    batch.clear();
    putting_ = false;
    put_cv_.notify_one();
  }
}

void RespDurableSets::PutBatch(std::vector<Item>* batch, std::vector<Status>* st) {
  st->assign(batch->size(), Status::Ok());
  // The names their units do not carry (name_seq != 0; rare): one log sync for all of them,
  // durable before their units are written. A carried name is durable with its unit.
  uint64_t name_seq = 0;
  for (const Item& it : *batch) name_seq = std::max(name_seq, it.job->name_seq);
  Status names = service_->resp_index().WaitDurable(name_seq);
  // The puts, without waiting for their commit; a group's SETs after a failed one are not
  // put and take its error.
  size_t group_end = 0;
  Status group_failure;
  for (size_t i = 0; i < batch->size(); ++i) {
    if (i >= group_end) {
      group_end = i + std::max<size_t>((*batch)[i].members, 1);
      group_failure = Status::Ok();
    }
    if (!group_failure.ok()) {
      (*st)[i] = group_failure;
      continue;
    }
    RespSetJob* job = (*batch)[i].job.get();
    (*st)[i] = names.ok() || job->name_seq == 0 ? service_->RespSetPut(job) : names;
    if (!(*st)[i].ok()) group_failure = (*st)[i];
  }
}

void RespDurableSets::CommitLoop() {
  std::vector<Item> batch;
  std::vector<Status> st;
  std::vector<Later> later;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      put_cv_.wait(lock, [this] {
        return !put_.empty() || (stop_ && queue_.empty() && !putting_ && putting_here_ == 0);
      });
      if (put_.empty()) return;  // stopped, and everything put has been completed
      batch.swap(put_);
      st.swap(put_status_);
    }
    metrics_->resp_durable_set_batches.fetch_add(1);
    // The first completion commits every put so far; the others find their ticket covered.
    for (size_t i = 0; i < batch.size(); ++i) {
      if (!st[i].ok()) continue;
      st[i] = batch[i].job ? service_->RespSetComplete(batch[i].job.get())
                           : service_->RespDelComplete(batch[i].removals);
    }
    // One done per SET or group, with the group's first error in order (OK: all durable).
    for (size_t i = 0; i < batch.size();) {
      const size_t n = std::max<size_t>(batch[i].members, 1);
      size_t result = i;
      while (result + 1 < i + n && st[result].ok()) ++result;
      metrics_->resp_durable_sets_pending.fetch_sub(n);
      if (Later l = batch[i].done(st[result])) later.push_back(std::move(l));
      i += n;
    }
    RunLater(&later);
    batch.clear();
    st.clear();
  }
}

void RespDurableSets::RunLater(std::vector<Later>* later) {
  if (later->empty()) return;
  if (!post_) {
    for (Later& l : *later) l();
    later->clear();
    return;
  }
  post_([tasks = std::move(*later)] {
    for (const Later& l : tasks) l();
  });
  later->clear();
}

}  // namespace kvtier::daemon
