// Status and StatusOr<T>: the one error vocabulary of kvtier.
//
// Every fallible function across a module boundary returns Status or StatusOr<T>;
// exceptions never cross modules. Both types are [[nodiscard]]: ignoring a result is a
// compile error under -Werror. Codes follow CacheLib Navy's vocabulary:
//
//   kOk               success
//   kNotFound         the key / object does not exist (a miss, not a failure)
//   kRejected         refused by policy or limit: admission, quota, capacity, queue full
//   kRetry            transient: try again later (lock contention, reconnecting)
//   kIOError          the device or network failed (EIO, ENOSPC, connection reset)
//   kCorruption       bytes failed validation (checksum, magic, truncation, bad length)
//   kInvalidArgument  the caller's input is malformed or out of range
//   kPermissionDenied authentication or authorisation failed
//   kUnavailable      the component is shutting down or not yet ready
//   kInternal         a broken invariant inside kvtier (a bug)
//
// Thread safety: Status and StatusOr are values; distinct objects may be used from
// distinct threads without synchronisation.
#pragma once

#include <cassert>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace kvtier {

enum class StatusCode : unsigned char {
  kOk = 0,
  kNotFound,
  kRejected,
  kRetry,
  kIOError,
  kCorruption,
  kInvalidArgument,
  kPermissionDenied,
  kUnavailable,
  kInternal,
};

// Stable lowercase name of a code ("ok", "not_found", ...), used in logs, metrics and JSON.
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  // An OK status. Cheap: no allocation.
  Status() = default;
  Status(StatusCode code, std::string_view message);

  static Status Ok() { return Status(); }
  static Status NotFound(std::string_view msg) { return {StatusCode::kNotFound, msg}; }
  static Status Rejected(std::string_view msg) { return {StatusCode::kRejected, msg}; }
  static Status Retry(std::string_view msg) { return {StatusCode::kRetry, msg}; }
  static Status IOError(std::string_view msg) { return {StatusCode::kIOError, msg}; }
  static Status Corruption(std::string_view msg) { return {StatusCode::kCorruption, msg}; }
  static Status InvalidArgument(std::string_view msg) {
    return {StatusCode::kInvalidArgument, msg};
  }
  static Status PermissionDenied(std::string_view msg) {
    return {StatusCode::kPermissionDenied, msg};
  }
  static Status Unavailable(std::string_view msg) { return {StatusCode::kUnavailable, msg}; }
  static Status Internal(std::string_view msg) { return {StatusCode::kInternal, msg}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  bool IsNotFound() const { return code_ == StatusCode::kNotFound; }
  bool IsRejected() const { return code_ == StatusCode::kRejected; }
  bool IsRetry() const { return code_ == StatusCode::kRetry; }
  bool IsIOError() const { return code_ == StatusCode::kIOError; }
  bool IsCorruption() const { return code_ == StatusCode::kCorruption; }
  bool IsInvalidArgument() const { return code_ == StatusCode::kInvalidArgument; }
  bool IsPermissionDenied() const { return code_ == StatusCode::kPermissionDenied; }
  bool IsUnavailable() const { return code_ == StatusCode::kUnavailable; }

  // "ok" or "<code name>: <message>".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>"; OK stays OK.
  Status WithContext(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Either a value of T or a non-OK Status. Accessing value() of a non-OK StatusOr is a
// programming error (asserts in debug builds).
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  // Implicit from a non-OK Status (an OK status here is a bug and becomes kInternal).
  StatusOr(Status status)  // NOLINT(runtime/explicit)
      : status_(status.ok() ? Status::Internal("StatusOr constructed from OK status")
                            : std::move(status)) {}
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT(runtime/explicit)

  bool ok() const { return status_.ok(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T& value() & {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace kvtier

// Propagate a non-OK Status from the current function.
#define KVTIER_RETURN_IF_ERROR(expr)             \
  do {                                           \
    ::kvtier::Status _kvtier_st = (expr);        \
    if (!_kvtier_st.ok()) return _kvtier_st;     \
  } while (0)

#define KVTIER_CONCAT_INNER_(a, b) a##b
#define KVTIER_CONCAT_(a, b) KVTIER_CONCAT_INNER_(a, b)

// `KVTIER_ASSIGN_OR_RETURN(auto x, Fn());` declares x from a StatusOr or returns its status.
#define KVTIER_ASSIGN_OR_RETURN(lhs, expr) \
  KVTIER_ASSIGN_OR_RETURN_IMPL_(KVTIER_CONCAT_(_kvtier_so_, __LINE__), lhs, expr)
#define KVTIER_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()
