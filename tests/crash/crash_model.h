// What the kvtierd crash driver knows about each key, and the rule that decides whether the
// state read back after a crash is allowed.
//
// Every key is written by exactly one writer thread (FLUSHDB excepted, which runs while every
// other RESP operation is held back), so a key's history is a sequence of operations, each
// with the state it leaves (absent, or present at a version), the time it was sent, and the
// time its acknowledgement arrived (or none: in flight at the kill, or answered with an error,
// in which case it may or may not have been applied). A history starts with an "observed"
// operation: the state the driver last read back (after a restart), counted as acknowledged
// when it was read.
//
// After a kill at kill_us, with the newest operation m that must have survived
//   sync:    the newest acknowledged one (acknowledgement received at any time; the daemon sent
//            it before it died, so the write was durable),
//   batched: the newest acknowledged before kill_us - window_us (window = group_commit_ms plus
//            a stated scheduling margin); if none, the key has no durability obligation,
//   none:    no obligation,
// the key may hold the state left by m or by any later operation, and nothing else. In every
// mode a value must be exactly some version written for that key: anything else is a wrong value.
// (Units that may never reach SSD carry no durability obligation: CheckContext::durable_key.)
//
// Thread safety: none; a KeyHistory is used by one thread at a time (the driver serialises).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvtier::crash {

enum class Mode { kNone, kBatched, kSync };
const char* ModeName(Mode mode);
// "none" | "batched" | "sync"; false for anything else.
bool ParseMode(const std::string& text, Mode* mode);

// A key's state: absent, or present holding one version.
struct KeyState {
  bool present = false;
  uint64_t version = 0;
  bool operator==(const KeyState&) const = default;
};
std::string ToString(const KeyState& s);  // "absent" | "v12"

enum class OpStatus : uint8_t {
  kPending,  // sent, no answer (in flight at the kill)
  kAcked,    // acknowledged (ack_us set)
  kFailed,   // answered with an error: may or may not have been applied
};

struct Op {
  KeyState result;   // the state this operation leaves
  const char* what;  // "put", "del", "mset", "flushdb", "observed" (static strings)
  int64_t send_us = 0;
  int64_t ack_us = -1;
  OpStatus status = OpStatus::kPending;
};

class KeyHistory {
 public:
  // Forgets the history: the key was just read back as `observed` at at_us.
  void Reset(const KeyState& observed, int64_t at_us);
  // Records an operation sent at send_us that leaves `result`; returns its index.
  size_t Begin(const KeyState& result, const char* what, int64_t send_us);
  void Ack(size_t op, int64_t ack_us);
  void Fail(size_t op);
  // Removes pending operations sent at or after t_us (sent after the kill: never applied).
  void DropPendingSentAfter(int64_t t_us);

  // A fresh version for the next put (versions of a key only grow, across restarts).
  uint64_t NextVersion() { return ++max_version_; }
  uint64_t max_version() const { return max_version_; }
  const std::vector<Op>& ops() const { return ops_; }
  // The newest acknowledged operation (the history always holds one after Reset).
  const Op* LastAcked() const;

 private:
  std::vector<Op> ops_;
  uint64_t max_version_ = 0;
};

// What was read back for a key.
struct Observation {
  bool wrong = false;     // the bytes are not a valid value of this key (wrong_why says why)
  std::string wrong_why;  // e.g. "checksum mismatch (torn or corrupt)", "value of key 17"
  KeyState state;
};

enum class Verdict {
  kExact,        // the newest acknowledged state
  kInFlight,     // the state of an operation in flight (or failed) at the kill: allowed
  kLostAllowed,  // an older state the mode allows to come back
  kLost,         // absent, but a write that must have survived put it there
  kResurrected,  // present, but a delete that must have survived removed it
  kStale,        // an older version than one that must have survived
  kWrongValue,   // not a value ever written for this key (torn, foreign, unknown version)
};
const char* VerdictName(Verdict v);
inline bool IsViolation(Verdict v) {
  return v == Verdict::kLost || v == Verdict::kResurrected || v == Verdict::kStale ||
         v == Verdict::kWrongValue;
}

struct CheckContext {
  Mode mode = Mode::kSync;
  // False for units that may never reach SSD (allow_ssd = false): no durability obligation
  // in any mode, only "never a wrong value".
  bool durable_key = true;
  int64_t kill_us = 0;              // when the kill was sent (or the read was made, for live reads)
  const char* moment = "the kill";  // how details name kill_us ("the read" for live reads)
  int64_t window_us = 0;            // batched: group_commit_ms + margin
};

struct CheckResult {
  Verdict verdict = Verdict::kExact;
  // For violations: what had to be there (operation, version, acknowledgement time relative
  // to the kill) and what the allowed states were.
  std::string detail;
};

CheckResult Check(const KeyHistory& h, const Observation& got, const CheckContext& c);

}  // namespace kvtier::crash
