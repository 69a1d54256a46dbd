// RespTransaction: the MULTI ... EXEC queue of one RESP connection.
//
// States: idle -> (MULTI) queuing -> (EXEC) executing -> idle, or queuing -> (DISCARD) idle.
// While queuing, each command is copied into one flat buffer (the parser's views die with the
// next read). The queue is bounded by two limits (limits.resp_multi_commands_max and
// limits.resp_multi_bytes_max): the command that would cross one is refused, the queue is
// freed at once and the transaction is flagged, so a client that keeps sending commands after
// MULTI holds no more than the limits however many it sends; EXEC then answers EXECABORT, as
// it does after any queue-time error (Flag()).
//
// Atomicity: the session runs the queued commands back to back on its strand, so no other
// command of the same connection runs between them (a pipelined command after EXEC waits).
// Commands of other connections may interleave: kvtier has no cross-connection isolation
// (docs/RESP.md "Transactions").
//
// Thread safety: one per connection, used on its strand only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace kvtier::daemon::resp {

class RespTransaction {
 public:
  struct Limits {
    size_t commands_max = 65536;        // queued commands
    uint64_t bytes_max = 256ull << 20;  // held_bytes() while queuing
  };
  // Bytes charged per queued argument and per command besides the argument bytes (the index
  // entries), so a flood of empty arguments is bounded too.
  static constexpr uint64_t kArgOverheadBytes = 16;
  static constexpr uint64_t kCommandOverheadBytes = 8;

  explicit RespTransaction(Limits limits) : limits_(limits) {}

  bool queuing() const { return state_ == State::kQueuing; }
  bool executing() const { return state_ == State::kExecuting; }
  // True once a queued command was refused or Flag() was called: EXEC answers EXECABORT.
  bool flagged() const { return flagged_; }

  // idle -> queuing. Precondition: !queuing() && !executing().
  void Begin();
  // Copies argv into the queue. Rejected when it would cross a limit: the queue is freed and
  // the transaction flagged; once flagged, commands are not stored (Ok is returned: Redis
  // still answers +QUEUED). Precondition: queuing().
  Status Queue(std::span<const std::string_view> argv);
  // Marks the transaction failed (a queue-time error). Precondition: queuing().
  void Flag() { flagged_ = true; }
  // queuing -> executing and returns the number of queued commands; when flagged, frees the
  // queue, returns to idle and returns 0 with *aborted true.
  size_t StartExec(bool* aborted);
  // The i-th queued command as views into the queue, valid until Finish(). Precondition:
  // executing(), i < size().
  void Command(size_t i, std::vector<std::string_view>* argv) const;
  size_t size() const { return commands_.size(); }
  // Back to idle, freeing the queue (after EXEC, or DISCARD).
  void Finish();
  // Bytes the queue holds (allocated), for the connection's memory account.
  uint64_t held_bytes() const;
  // What the queue counts against bytes_max.
  uint64_t charged_bytes() const { return charged_; }
  const Limits& limits() const { return limits_; }

 private:
  enum class State : uint8_t { kIdle, kQueuing, kExecuting };

  Limits limits_;
  State state_ = State::kIdle;
  bool flagged_ = false;
  std::string data_;                             // every queued argument, back to back
  std::vector<std::pair<size_t, size_t>> args_;  // (offset, size) in data_
  std::vector<size_t> commands_;                 // index of each command's first arg in args_
  uint64_t charged_ = 0;
};

}  // namespace kvtier::daemon::resp
