#include "common/accept_backoff.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kvtier {

bool AcceptBackoff::OnlyThatConnection(int err) {
  switch (err) {
    case EINTR:
    case EAGAIN:
#if EWOULDBLOCK != EAGAIN
    case EWOULDBLOCK:
#endif
    case ECONNABORTED:
    case EPROTO:
    case EPERM:  // a firewall rule refused that connection
    // Linux passes pending network errors of the new connection on as accept errors
    // (accept(2), "Error handling"): retry as for EAGAIN.
    case ENETDOWN:
    case ENOPROTOOPT:
    case EHOSTDOWN:
    case ENONET:
    case EHOSTUNREACH:
    case EOPNOTSUPP:
    case ENETUNREACH:
      return true;
    default:
      return false;
  }
}

AcceptBackoff::AcceptBackoff(std::string what, const Clock* clock)
    : what_(std::move(what)), clock_(clock != nullptr ? clock : &DefaultSteadyClock()) {}

std::chrono::milliseconds AcceptBackoff::Failed(int err) {
  if (OnlyThatConnection(err)) return std::chrono::milliseconds(0);
  return Pause(err, "accept");
}

std::chrono::milliseconds AcceptBackoff::Pause(int err, const char* step) {
  ++run_failures_;
  ++unwarned_failures_;
  ++waits_total_;
  wait_ = wait_.count() == 0 ? kFirstWait : std::min(wait_ * 2, kWaitMax);
  const uint64_t now_ms = clock_->NowMs();
  uint64_t runs_held = 0;  // unused: the failures are counted, not the runs held back
  if (!run_warned_ && warnings_.Allow(now_ms, &runs_held)) {
    KVTIER_LOG(kWarn) << what_ << ": " << step << " failed: " << std::strerror(err)
                      << "; pausing accepts (" << kFirstWait.count() << " ms, doubling up to "
                      << kWaitMax.count()
                      << " ms) until a connection is taken, the others wait in the listen "
                         "backlog ("
                      << unwarned_failures_ << " failures since the last warning)";
    run_warned_ = true;
    unwarned_failures_ = 0;
  }
  return wait_;
}

void AcceptBackoff::Succeeded() {
  if (run_failures_ == 0) return;
  if (run_warned_) {
    KVTIER_LOG(kInfo) << what_ << ": accepting again after " << run_failures_ << " failures";
  }
  run_failures_ = 0;
  run_warned_ = false;
  wait_ = std::chrono::milliseconds(0);
}

}  // namespace kvtier
