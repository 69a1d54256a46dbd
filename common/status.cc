#include "common/status.h"

namespace kvtier {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kNotFound: return "not_found";
    case StatusCode::kRejected: return "rejected";
    case StatusCode::kRetry: return "retry";
    case StatusCode::kIOError: return "io_error";
    case StatusCode::kCorruption: return "corruption";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kPermissionDenied: return "permission_denied";
    case StatusCode::kUnavailable: return "unavailable";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

Status::Status(StatusCode code, std::string_view message) : code_(code), message_(message) {}

std::string Status::ToString() const {
  if (ok()) return "ok";
  std::string out(StatusCodeName(code_));
  if (!message_.empty()) {
    out += ": ";
    out += message_;
  }
  return out;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string msg(context);
  msg += ": ";
  msg += message_;
  return Status(code_, msg);
}

}  // namespace kvtier
