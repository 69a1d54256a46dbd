#include "cache_daemon/trace_window.h"

namespace kvtier::daemon {

void TraceWindow::Append(std::string line) {
  std::lock_guard<std::mutex> lock(mu_);
  ++appended_;
  const uint64_t size = line.size() + 1;
  if (limits_.records_max == 0 || size > limits_.bytes_max) {
    ++dropped_;
    return;
  }
  while (!lines_.empty() &&
         (lines_.size() >= limits_.records_max || bytes_ + size > limits_.bytes_max)) {
    bytes_ -= lines_.front().size() + 1;
    lines_.pop_front();
    ++dropped_;
  }
  bytes_ += size;
  lines_.push_back(std::move(line));
}

TraceWindow::Snapshot TraceWindow::Take() const {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot s;
  s.text.reserve(bytes_);
  for (const std::string& l : lines_) {
    s.text += l;
    s.text += '\n';
  }
  s.records = lines_.size();
  s.appended = appended_;
  s.dropped = dropped_;
  return s;
}

uint64_t TraceWindow::appended() const {
  std::lock_guard<std::mutex> lock(mu_);
  return appended_;
}

}  // namespace kvtier::daemon
