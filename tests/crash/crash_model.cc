#include "tests/crash/crash_model.h"

#include <cstdio>

namespace kvtier::crash {
namespace {

// "812.3 ms before the kill" / "2.1 ms after the kill".
std::string Relative(int64_t t_us, int64_t kill_us, const char* moment) {
  char buf[64];
  double ms = static_cast<double>(t_us - kill_us) / 1000.0;
  std::snprintf(buf, sizeof(buf), "%.1f ms %s %s", ms < 0 ? -ms : ms, ms < 0 ? "before" : "after",
                moment);
  return buf;
}

std::string Describe(const Op& op, int64_t kill_us, const char* moment) {
  std::string s = ToString(op.result) + " (" + op.what + " ";
  switch (op.status) {
    case OpStatus::kAcked:
      s += std::string(op.what) == "observed" ? "read " : "acked ";
      s += Relative(op.ack_us, kill_us, moment);
      break;
    case OpStatus::kPending:
      s += "in flight, sent " + Relative(op.send_us, kill_us, moment);
      break;
    case OpStatus::kFailed:
      s += "answered with an error, sent " + Relative(op.send_us, kill_us, moment);
      break;
  }
  return s + ")";
}

}  // namespace

const char* ModeName(Mode mode) {
  switch (mode) {
    case Mode::kNone:
      return "none";
    case Mode::kBatched:
      return "batched";
    case Mode::kSync:
      return "sync";
  }
  return "?";
}

bool ParseMode(const std::string& text, Mode* mode) {
  for (Mode m : {Mode::kNone, Mode::kBatched, Mode::kSync}) {
    if (text == ModeName(m)) {
      *mode = m;
      return true;
    }
  }
  return false;
}

std::string ToString(const KeyState& s) {
  return s.present ? "v" + std::to_string(s.version) : "absent";
}

const char* VerdictName(Verdict v) {
  switch (v) {
    case Verdict::kExact:
      return "exact";
    case Verdict::kInFlight:
      return "in-flight";
    case Verdict::kLostAllowed:
      return "lost-allowed";
    case Verdict::kLost:
      return "lost";
    case Verdict::kResurrected:
      return "resurrected";
    case Verdict::kStale:
      return "stale";
    case Verdict::kWrongValue:
      return "wrong-value";
  }
  return "?";
}

void KeyHistory::Reset(const KeyState& observed, int64_t at_us) {
  ops_.clear();
  ops_.push_back(Op{observed, "observed", at_us, at_us, OpStatus::kAcked});
}

size_t KeyHistory::Begin(const KeyState& result, const char* what, int64_t send_us) {
  ops_.push_back(Op{result, what, send_us, -1, OpStatus::kPending});
  return ops_.size() - 1;
}

void KeyHistory::Ack(size_t op, int64_t ack_us) {
  ops_[op].status = OpStatus::kAcked;
  ops_[op].ack_us = ack_us;
}

void KeyHistory::Fail(size_t op) { ops_[op].status = OpStatus::kFailed; }

void KeyHistory::DropPendingSentAfter(int64_t t_us) {
  std::erase_if(
      ops_, [&](const Op& op) { return op.status == OpStatus::kPending && op.send_us >= t_us; });
}

const Op* KeyHistory::LastAcked() const {
  for (size_t i = ops_.size(); i-- > 0;) {
    if (ops_[i].status == OpStatus::kAcked) return &ops_[i];
  }
  return nullptr;
}

CheckResult Check(const KeyHistory& h, const Observation& got, const CheckContext& c) {
  CheckResult r;
  if (got.wrong) {
    r.verdict = Verdict::kWrongValue;
    r.detail = got.wrong_why;
    return r;
  }
  if (got.state.present && got.state.version > h.max_version()) {
    r.verdict = Verdict::kWrongValue;
    r.detail = "v" + std::to_string(got.state.version) + " was never written (newest issued v" +
               std::to_string(h.max_version()) + ")";
    return r;
  }
  const std::vector<Op>& ops = h.ops();
  const Op* last = h.LastAcked();
  // The newest operation that must have survived (ops.size(): none).
  size_t must = ops.size();
  if (c.durable_key && c.mode != Mode::kNone) {
    for (size_t i = ops.size(); i-- > 0;) {
      const Op& op = ops[i];
      if (op.status != OpStatus::kAcked) continue;
      if (c.mode == Mode::kSync || op.ack_us < c.kill_us - c.window_us) {
        must = i;
        break;
      }
    }
  }
  auto classify_allowed = [&](const KeyState& s) {
    if (last != nullptr && s == last->result) return Verdict::kExact;
    for (size_t i = ops.size(); i-- > 0;) {
      if (ops[i].status != OpStatus::kAcked && ops[i].result == s) return Verdict::kInFlight;
      if (ops[i].status == OpStatus::kAcked) break;
    }
    return Verdict::kLostAllowed;
  };
  if (must == ops.size()) {
    // No obligation: any version ever written for the key, or absent.
    r.verdict = classify_allowed(got.state);
    return r;
  }
  for (size_t i = must; i < ops.size(); ++i) {
    if (ops[i].result == got.state) {
      r.verdict = classify_allowed(got.state);
      return r;
    }
  }
  const Op& m = ops[must];
  if (!got.state.present) {
    r.verdict = Verdict::kLost;
  } else if (!m.result.present) {
    r.verdict = Verdict::kResurrected;
  } else {
    r.verdict = Verdict::kStale;
  }
  r.detail = "expected " + Describe(m, c.kill_us, c.moment);
  for (size_t i = must + 1; i < ops.size(); ++i) {
    if (i - must > 4) {
      r.detail += " or one of " + std::to_string(ops.size() - i) + " later states";
      break;
    }
    r.detail += " or " + Describe(ops[i], c.kill_us, c.moment);
  }
  r.detail += ", got " + ToString(got.state);
  return r;
}

}  // namespace kvtier::crash
