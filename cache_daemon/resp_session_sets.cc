// Writes (SET, MSET, DEL) of a RESP connection completed asynchronously under durability sync
// (RespDurableSets), and a lone pending write's reply written by its commit
// (resp_session_impl.h).
#include <sys/socket.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "cache_daemon/resp_session_impl.h"
#include "common/clock.h"

namespace kvtier::daemon::internal {
namespace {

using namespace std::string_view_literals;
constexpr std::string_view kOkReply = "+OK\r\n";

}  // namespace

bool RespSession::AsyncWritable() const {
  return shared_->durable_sets != nullptr && tenant_ != nullptr && !txn_.queuing() &&
         !txn_.executing();
}

bool RespSession::AsyncWrite(const std::string& cmd, const std::vector<std::string_view>& a) const {
  if (!AsyncWritable()) return false;
  if (cmd == "DEL"sv || cmd == "UNLINK"sv) return a.size() >= 2 && thread_sets_ == 0;
  if (a.size() < 3) return false;
  if (cmd == "MSET"sv) return a.size() % 2 == 1;
  if (cmd != "SET"sv) return false;
  if (a.size() == 3) return true;
  StatusOr<resp::SetOptions> o = resp::ParseSetOptions(
      std::span<const std::string_view>(a).subspan(3), DefaultSystemClock().NowMs());
  return o.ok() && o->plain();
}

void RespSession::Stall(const std::vector<std::string_view>& a) {
  stalled_bytes_ = 0;
  for (std::string_view v : a) {
    stalled_.emplace_back(v);
    stalled_bytes_ += v.size() + sizeof(std::string);
  }
}

void RespSession::RunStalled() {
  std::vector<std::string> cmd;
  cmd.swap(stalled_);
  stalled_bytes_ = 0;
  std::vector<std::string_view> views(cmd.begin(), cmd.end());
  Execute(views);
  SetCommandLimit();
}

void RespSession::SubmitSet(std::unique_ptr<RespSetJob> job, uint64_t start_us) {
  const uint64_t charged = job->envelope.size() + job->name.size() + kHoldOverheadBytes;
  const uint64_t id = AddHold(charged, start_us, Op::kRespSet, kOkReply);
  SubmittedVia(shared_->durable_sets->Submit(std::move(job), HoldDone(id, kOkReply),
                                             /*put_here=*/thread_sets_ == 0));
}

void RespSession::SubmitMset(std::vector<std::unique_ptr<RespSetJob>> jobs, uint64_t start_us) {
  uint64_t charged = 0;
  for (const std::unique_ptr<RespSetJob>& job : jobs) {
    charged += job->envelope.size() + job->name.size() + kHoldOverheadBytes;
  }
  const uint64_t id = AddHold(charged, start_us, Op::kRespMset, kOkReply);
  SubmittedVia(shared_->durable_sets->Submit(std::move(jobs), HoldDone(id, kOkReply),
                                             /*put_here=*/thread_sets_ == 0));
}

StatusCode RespSession::SubmitDel(const std::string& cmd, const std::vector<std::string_view>& a) {
  Service* svc = shared_->service;
  std::vector<storage::DeferredCommit> commits;
  int64_t deleted = 0;
  Status st = svc->RespDelStage(*tenant_, std::span<const std::string_view>(a).subspan(1), &deleted,
                                &commits);
  if (!st.ok()) {
    // A removal failed (rare: the SSD index could not be read): the others still wait for
    // their commit here, then the error is the reply, as RespDelMany does.
    (void)svc->RespDelComplete(commits);
    return StoreError(st);
  }
  // A removal with ticket 0 has nothing to wait for (CompletePut returns at once).
  std::erase_if(commits, [](const storage::DeferredCommit& c) { return c.ticket == 0; });
  std::string reply;
  resp::AppendInteger(deleted, &reply);
  if (commits.empty()) {  // no removal left anything to commit: the count is final
    out_ += reply;
    return StatusCode::kOk;
  }
  const uint64_t charged = kHoldOverheadBytes + commits.size() * sizeof(storage::DeferredCommit);
  const uint64_t id =
      AddHold(charged, set_start_us_, cmd == "DEL"sv ? Op::kRespDel : Op::kRespOther, reply);
  shared_->durable_sets->SubmitRemovals(std::move(commits), HoldDone(id, reply));
  deferred_ = true;
  return StatusCode::kOk;
}

uint64_t RespSession::AddHold(uint64_t charged_bytes, uint64_t start_us, Op op,
                              std::string_view ok_reply) {
  Hold h;
  h.id = next_hold_id_++;
  h.op = op;
  h.text_pos = out_.size();
  h.charged_bytes = charged_bytes;
  h.start_us = start_us;
  h.ok_reply = ok_reply;
  hold_bytes_ += h.charged_bytes;
  holds_.push_back(std::move(h));
  ArmDirect();
  return holds_.back().id;
}

RespDurableSets::Done RespSession::HoldDone(uint64_t id, std::string_view ok_reply) {
  // The tenant's in-flight slot is the SET's until it completes, and is freed before its
  // reply can reach the client (DirectReply): a client that has every reply must not find
  // its requests still counted against the tenant's in-flight limit.
  auto slot = std::make_shared<InflightSlot>(std::move(slot_));
  return [self = shared_from_this(), id, slot,
          reply = std::string(ok_reply)](const Status& st) -> RespDurableSets::Later {
    *slot = InflightSlot();
    size_t sent = st.ok() ? self->DirectReply(id, reply) : 0;
    // Runs on an I/O thread (with the other SETs of the commit): the strand, when idle,
    // runs SetDone right there.
    return [self, id, st, sent] {
      asio::dispatch(self->strand_, [self, id, st, sent] { self->SetDone(id, st, sent); });
    };
  };
}

void RespSession::SubmittedVia(bool put_here) {
  if (put_here) return;
  // SetDone runs on this strand, so the hold is still the last one.
  holds_.back().via_thread = true;
  ++thread_sets_;
}

void RespSession::ArmDirect() {
  if (holds_.empty() || writing_ || closed_ || ready_bytes() != 0) return;
  std::lock_guard<std::mutex> lock(direct_mu_);
  // Armed and not resolved yet (an armed SET that failed is resolved by SetDone).
  if (direct_id_ != kNoHold && direct_id_ >= holds_.front().id) return;
  // Holds up to sent_through_ (still here until their SetDone) were written in full, in
  // order: the first one after them is next on the wire if no reply text precedes it.
  const uint64_t first = holds_.front().id;
  const uint64_t skip = sent_through_ == kNoHold || sent_through_ < first
                            ? 0
                            : std::min<uint64_t>(sent_through_ - first + 1, holds_.size());
  if (skip == holds_.size()) return;
  const Hold& h = holds_[skip];
  if (h.text_pos != 0 || h.id == armed_id_) return;
  armed_id_ = h.id;
  direct_id_ = h.id;
}

size_t RespSession::DirectReply(uint64_t id, std::string_view reply) {
  std::lock_guard<std::mutex> lock(direct_mu_);
  if (direct_id_ != id) return 0;
  direct_id_ = kNoHold;
  ssize_t n = ::send(fd_, reply.data(), reply.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n == static_cast<ssize_t>(reply.size())) sent_through_ = id;
  return n > 0 ? static_cast<size_t>(n) : 0;
}

void RespSession::SetDone(uint64_t id, const Status& st, size_t sent_bytes) {
  if (holds_.empty() || id < holds_.front().id) return;
  if (id - holds_.front().id >= holds_.size()) return;
  Hold& h = holds_[id - holds_.front().id];
  h.done = true;
  h.result = st;
  h.sent_bytes = sent_bytes;
  while (!holds_.empty() && holds_.front().done) {
    Hold& f = holds_.front();
    std::string reply;
    StatusCode code = StatusCode::kOk;
    if (f.result.ok()) {
      reply = f.ok_reply;
    } else {
      code = f.result.code();
      StoreErrorText(f.result, &reply);
    }
    if (f.sent_bytes > 0) {
      // Only an armed write's ok_reply is written by its commit, and the reply text is that.
      reply.erase(0, std::min(f.sent_bytes, reply.size()));
      shared_->metrics->AddBytes(false, f.sent_bytes);
      shared_->metrics->resp_durable_set_direct_replies.fetch_add(1);
      idle_.Touch(IdleWatch::NowMs());
    }
    out_.insert(f.text_pos, reply);
    for (size_t i = 1; i < holds_.size(); ++i) holds_[i].text_pos += reply.size();
    for (Body& b : bodies_) {
      if (b.text_end > f.text_pos) b.text_end += reply.size();
    }
    hold_bytes_ -= f.charged_bytes;
    if (f.via_thread) --thread_sets_;
    shared_->metrics->RecordRequest(f.op, code, DefaultSteadyClock().NowUs() - f.start_us);
    holds_.pop_front();
  }
  if (closed_) return;
  Account();
  if (!writing_) Process();
}

}  // namespace kvtier::daemon::internal
