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
  put_here = put_here && job->name_seq == 0;
  bool stopped = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped = stop_;
    if (!stopped) {
      metrics_->resp_durable_sets_pending.fetch_add(1);
      if (!put_here) {
        queue_.push_back(Item{std::move(job), std::move(done)});
        if (queue_.size() == 1) cv_.notify_one();
        return false;
      }
      ++putting_here_;  // the commit thread does not stop before this put is handed over
    }
  }
  if (stopped) {
    if (Later later = done(Status::Unavailable("kvtierd is shutting down"))) later();
    return false;
  }
  // The name rides in the unit: nothing to wait for before the put, so the put thread's
  // hand-off (a wake-up on every SET's way) is skipped.
  Status st = service_->RespSetPut(job.get());
  {
    std::lock_guard<std::mutex> lock(mu_);
    --putting_here_;
    put_.push_back(Item{std::move(job), std::move(done)});
    put_status_.push_back(std::move(st));
  }
  put_cv_.notify_one();
  return true;
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
  // The puts, without waiting for their commit.
  for (size_t i = 0; i < batch->size(); ++i) {
    RespSetJob* job = (*batch)[i].job.get();
    (*st)[i] = names.ok() || job->name_seq == 0 ? service_->RespSetPut(job) : names;
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
      if (st[i].ok()) st[i] = service_->RespSetComplete(batch[i].job.get());
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      metrics_->resp_durable_sets_pending.fetch_sub(1);
      if (Later l = batch[i].done(st[i])) later.push_back(std::move(l));
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
