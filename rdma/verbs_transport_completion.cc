// VerbsTransport's completion thread (verbs_transport_impl.h): polls the CQ, then sleeps on
// the completion channel, handles async events, requested failures and expired deadlines, and
// tears the queue pair down.
#include <infiniband/verbs.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "common/logging.h"
#include "rdma/verbs_transport_impl.h"

namespace kvtier::rdma {

void VerbsTransport::Impl::Teardown(const Status& why) {
  std::vector<ReadCallback> failed;
  bool had_qp = false;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    had_qp = qp != nullptr;
    gen = side_gen;
    if (sm.state() != verbs::QpState::kDisconnected && sm.state() != verbs::QpState::kClosed) {
      (void)sm.Apply(verbs::QpEvent::kFailure);
    }
    failed = tracker.TakeAll();
    deadlines_us.clear();
    qp.reset();  // ibv_destroy_qp
    DrainCq();   // its flushed completions (posting is under mu: no new QP meanwhile)
    if (sm.state() == verbs::QpState::kError) (void)sm.Apply(verbs::QpEvent::kTornDown);
    remote.Clear();
    ready = false;
    c.reads_in_flight = 0;
    if (had_qp) ++c.disconnects;
    ++teardowns;
  }
  if (had_qp) side->Close(gen);  // only that connection: a caller may have reconnected
  cv.notify_all();
  if (had_qp) {
    KVTIER_LOG(kWarn) << "verbs transport: queue pair torn down: " << why.message();
  }
  for (ReadCallback& cb : failed) cb(why);
}

void VerbsTransport::Impl::DrainCq() {
  ibv_wc wc[32];
  while (ibv_poll_cq(zone->cq(), 32, wc) > 0) {
  }
}

int VerbsTransport::Impl::PollOnce() {
  ibv_wc wc[32];
  const int n = ibv_poll_cq(zone->cq(), 32, wc);
  if (n < 0) {
    Teardown(Status::IOError("ibv_poll_cq failed"));
    return -1;
  }
  std::vector<ReadCallback> done;
  Status failure;
  {
    std::lock_guard<std::mutex> lock(mu);
    const uint32_t current_qpn = qp != nullptr ? qp->qpn() : 0;
    for (int i = 0; i < n; ++i) {
      if (wc[i].qp_num != current_qpn) continue;  // a torn-down QP's flush
      if (wc[i].status != IBV_WC_SUCCESS) {
        if (failure.ok()) {
          failure = Status::IOError(std::string("RDMA READ failed: ") +
                                    verbs::WcStatusName(wc[i].status));
        }
        continue;
      }
      if (ReadCallback cb = tracker.OnCompletion(wc[i].wr_id, Status::Ok())) {
        deadlines_us.erase(verbs::WrIdBatch(wc[i].wr_id));
        done.push_back(std::move(cb));
      }
    }
    c.reads_in_flight = tracker.ops_in_flight();
  }
  for (ReadCallback& cb : done) cb(Status::Ok());
  if (!failure.ok()) {
    Teardown(failure);
    return -1;
  }
  return n;
}

void VerbsTransport::Impl::HandleAsyncEvents() {
  ibv_async_event ev;
  while (ibv_get_async_event(zone->context(), &ev) == 0) {
    bool fatal = false;
    switch (ev.event_type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_PATH_MIG_ERR: {
        std::lock_guard<std::mutex> lock(mu);
        fatal = qp != nullptr && ev.element.qp != nullptr && ev.element.qp->qp_num == qp->qpn();
        break;
      }
      case IBV_EVENT_CQ_ERR:
      case IBV_EVENT_DEVICE_FATAL:
      case IBV_EVENT_PORT_ERR:
        fatal = true;
        break;
      default:
        break;
    }
    const std::string name = ibv_event_type_str(ev.event_type);
    ibv_ack_async_event(&ev);
    if (fatal) Teardown(Status::IOError("queue pair async event: " + name));
  }
}

void VerbsTransport::Impl::CheckFailuresAndDeadlines() {
  Status why;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (reconnect_request) {
      why = Status::IOError("reconnecting");
      reconnect_request = false;
      failure_request = Status::Ok();
    } else if (!failure_request.ok()) {
      if (failure_gen == side_gen) why = failure_request;
      failure_request = Status::Ok();
    } else if (!deadlines_us.empty() && deadlines_us.begin()->second < internal::NowUs()) {
      why = Status::IOError("no RDMA completion within request_timeout_ms");
    }
  }
  if (!why.ok()) Teardown(why);
}

void VerbsTransport::Impl::CompletionLoop() {
  using Clock = std::chrono::steady_clock;
  auto idle_since = Clock::now();
  const auto spin = std::chrono::microseconds(verbs_options.poll_spin_us);
  const int wait_ms =
      static_cast<int>(std::clamp<uint32_t>(options.request_timeout_ms / 4, 1, 100));
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stop) break;
    }
    if (PollOnce() != 0) {
      idle_since = Clock::now();
      CheckFailuresAndDeadlines();
      continue;
    }
    if (Clock::now() - idle_since < spin) continue;
    // Arm, re-poll (a completion may have landed before arming), then sleep.
    if (ibv_req_notify_cq(zone->cq(), 0) != 0) {
      Teardown(Status::IOError("ibv_req_notify_cq failed"));
    } else if (PollOnce() != 0) {
      idle_since = Clock::now();
      continue;
    }
    pollfd fds[3] = {
        {zone->completion_fd(), POLLIN, 0}, {zone->async_fd(), POLLIN, 0}, {wake_fd, POLLIN, 0}};
    (void)poll(fds, 3, wait_ms);
    if (fds[0].revents & POLLIN) {
      ibv_cq* ev_cq = nullptr;
      void* ev_ctx = nullptr;
      if (ibv_get_cq_event(zone->channel(), &ev_cq, &ev_ctx) == 0) ibv_ack_cq_events(ev_cq, 1);
    }
    if (fds[1].revents & POLLIN) HandleAsyncEvents();
    if (fds[2].revents & POLLIN) {
      uint64_t v = 0;
      ssize_t n = read(wake_fd, &v, sizeof(v));
      (void)n;
    }
    CheckFailuresAndDeadlines();
    idle_since = Clock::now();
  }
  Teardown(Status::Unavailable("transport closed"));
}

}  // namespace kvtier::rdma
