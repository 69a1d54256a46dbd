#include "cache_daemon/resp_transaction.h"

namespace kvtier::daemon::resp {

void RespTransaction::Begin() {
  Finish();
  state_ = State::kQueuing;
}

Status RespTransaction::Queue(std::span<const std::string_view> argv) {
  if (flagged_) return Status::Ok();
  uint64_t add = kCommandOverheadBytes;
  for (std::string_view a : argv) add += a.size() + kArgOverheadBytes;
  if (commands_.size() + 1 > limits_.commands_max) {
    std::string why = "MULTI queue over limits.resp_multi_commands_max (" +
                      std::to_string(limits_.commands_max) + " commands)";
    Finish();
    state_ = State::kQueuing;
    flagged_ = true;
    return Status::Rejected(why);
  }
  if (charged_ + add > limits_.bytes_max) {
    std::string why = "MULTI queue over limits.resp_multi_bytes_max (" +
                      std::to_string(limits_.bytes_max) + " bytes)";
    Finish();
    state_ = State::kQueuing;
    flagged_ = true;
    return Status::Rejected(why);
  }
  commands_.push_back(args_.size());
  for (std::string_view a : argv) {
    args_.emplace_back(data_.size(), a.size());
    data_.append(a);
  }
  charged_ += add;
  return Status::Ok();
}

size_t RespTransaction::StartExec(bool* aborted) {
  *aborted = flagged_;
  if (flagged_) {
    Finish();
    return 0;
  }
  state_ = State::kExecuting;
  return commands_.size();
}

void RespTransaction::Command(size_t i, std::vector<std::string_view>* argv) const {
  argv->clear();
  size_t end = i + 1 < commands_.size() ? commands_[i + 1] : args_.size();
  for (size_t a = commands_[i]; a < end; ++a) {
    argv->emplace_back(data_.data() + args_[a].first, args_[a].second);
  }
}

void RespTransaction::Finish() {
  state_ = State::kIdle;
  flagged_ = false;
  charged_ = 0;
  std::string().swap(data_);
  std::vector<std::pair<size_t, size_t>>().swap(args_);
  std::vector<size_t>().swap(commands_);
}

uint64_t RespTransaction::held_bytes() const {
  // A string's inline buffer (capacity of an empty string) is part of the object, not held.
  size_t heap = data_.capacity() > std::string().capacity() ? data_.capacity() : 0;
  return heap + args_.capacity() * sizeof(args_[0]) + commands_.capacity() * sizeof(commands_[0]);
}

}  // namespace kvtier::daemon::resp
