// The client's operations (client_impl.h): LOOKUP, PUT, GET, PREFETCH, PIN, UNPIN, DELETE,
// STATS, POLICY, DRAIN and ENGRAM_GRANT/REPORT as calls on the connection, each split into
// batches the daemon accepts; PUT values and GET results go through the shared-memory region
// when there is one.
#include <algorithm>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <utility>

#include "cache_daemon/client_impl.h"

namespace kvtier::daemon::client_internal {

std::future<StatusOr<LookupResult>> ClientImpl::LookupAsync(std::span<const wire::Key> chain,
                                                            uint64_t turn) {
  std::vector<wire::Key> keys(chain.begin(), chain.end());
  return std::async(std::launch::deferred,
                    [this, keys = std::move(keys), turn]() { return DoLookup(keys, turn); });
}

std::future<StatusOr<std::vector<Status>>> ClientImpl::PutAsync(std::span<const PutUnit> units,
                                                                const PutOptions& o) {
  // Values are sent now (they are not retained); only the wait is deferred.
  std::vector<std::pair<std::future<StatusOr<Frame>>, size_t>> calls;
  std::vector<std::shared_ptr<ShmLease>> leases;
  Status early;
  size_t i = 0;
  while (i < units.size() && early.ok()) {
    size_t end = i;
    uint64_t bytes = 0;
    uint64_t frame_budget = hello_.max_frame_bytes > 4096 ? hello_.max_frame_bytes - 4096 : 0;
    while (end < units.size() && end - i < BatchLimit() &&
           (end == i || bytes + units[end].value.size() + 80 <= frame_budget)) {
      bytes += units[end].value.size() + 80;
      ++end;
    }
    StatusOr<std::future<StatusOr<Frame>>> f = SendPut(units.subspan(i, end - i), o, &leases);
    if (!f.ok()) {
      early = f.status();
      break;
    }
    calls.emplace_back(std::move(f).value(), end - i);
    i = end;
  }
  return std::async(
      std::launch::deferred,
      [this, calls = std::move(calls), leases = std::move(leases),
       early]() mutable -> StatusOr<std::vector<Status>> {
        std::vector<Status> out;
        Status first = early;
        for (auto& [fut, n] : calls) {
          StatusOr<Frame> f = Wait(fut);
          if (!f.ok()) {
            if (first.ok()) first = f.status();
            continue;
          }
          wire::Reader r(f->body);
          Status st;
          Status outer = wire::DecodeStatus(&r, &st);
          if (!outer.ok() || !st.ok()) {
            if (first.ok()) first = outer.ok() ? st : outer;
            continue;
          }
          StatusOr<std::vector<StatusCode>> codes = wire::DecodeCodes(&r);
          if (!codes.ok() || codes->size() != n) {
            if (first.ok()) first = Status::Corruption("put response count mismatch");
            continue;
          }
          for (StatusCode c : *codes) {
            out.push_back(c == StatusCode::kOk ? Status::Ok() : Status(c, "unit not stored"));
          }
        }
        if (!first.ok()) return first;
        return out;
      });
}

Status ClientImpl::Get(std::span<const wire::Key> keys, uint64_t turn,
                       const std::function<void(size_t, const GetItem&)>& visit) {
  for (size_t base = 0; base < keys.size(); base += BatchLimit()) {
    size_t n = std::min<size_t>(BatchLimit(), keys.size() - base);
    KVTIER_RETURN_IF_ERROR(GetChunk(keys.subspan(base, n), base, turn, visit));
  }
  return Status::Ok();
}

Status ClientImpl::Prefetch(std::span<const wire::Key> keys) {
  return ForEachBatch(keys, [&](std::span<const wire::Key> b) {
    return Simple(Opcode::kPrefetch, wire::EncodeKeys(b), nullptr);
  });
}

Status ClientImpl::Pin(std::span<const wire::Key> keys, uint64_t lease_ms) {
  return ForEachBatch(keys, [&](std::span<const wire::Key> b) {
    return Simple(Opcode::kPin, wire::EncodePin(lease_ms, b), nullptr);
  });
}

Status ClientImpl::Unpin(std::span<const wire::Key> keys) {
  return ForEachBatch(keys, [&](std::span<const wire::Key> b) {
    return Simple(Opcode::kUnpin, wire::EncodeKeys(b), nullptr);
  });
}

StatusOr<uint32_t> ClientImpl::Delete(std::span<const wire::Key> keys) {
  uint32_t total = 0;
  for (size_t base = 0; base < keys.size() || base == 0; base += BatchLimit()) {
    size_t n = std::min<size_t>(BatchLimit(), keys.size() - base);
    wire::DeleteRequest req;
    req.keys.assign(keys.begin() + base, keys.begin() + base + n);
    uint32_t deleted = 0;
    KVTIER_RETURN_IF_ERROR(Simple(Opcode::kDelete, wire::EncodeDelete(req), [&](wire::Reader* r) {
      return r->U32(&deleted) ? Status::Ok() : Status::Corruption("bad delete response");
    }));
    total += deleted;
    if (keys.empty()) break;
  }
  return total;
}

Status ClientImpl::DeleteAll() {
  wire::DeleteRequest req;
  req.scope = 1;
  return Simple(Opcode::kDelete, wire::EncodeDelete(req), nullptr);
}

StatusOr<std::string> ClientImpl::StatsJson() { return TextCall(Opcode::kStats, {}); }

StatusOr<std::string> ClientImpl::PolicyGet() { return TextCall(Opcode::kPolicyGet, {}); }

StatusOr<std::string> ClientImpl::PolicySet(const std::string& json) {
  wire::Writer w;
  wire::EncodeText(json, &w);
  return TextCall(Opcode::kPolicySet, w.Take());
}

Status ClientImpl::Drain(bool shutdown) {
  std::vector<uint8_t> body{static_cast<uint8_t>(shutdown ? 1 : 0)};
  return Simple(Opcode::kDrain, body, nullptr);
}

StatusOr<wire::EngramGrantResponse> ClientImpl::EngramGrant(std::span<const std::string> regions,
                                                            uint64_t ttl_ms) {
  if (regions.size() > wire::kEngramRegionsMax) {
    return Status::InvalidArgument("at most " + std::to_string(wire::kEngramRegionsMax) +
                                   " regions in one engram grant");
  }
  wire::EngramGrantRequest req;
  req.ttl_ms = ttl_ms;
  for (const std::string& r : regions) {
    if (r.empty() || r.size() > wire::kEngramNameBytesMax) {
      return Status::InvalidArgument("engram region names are 1..256 bytes");
    }
    req.regions.push_back(r);
  }
  wire::EngramGrantResponse resp;
  KVTIER_RETURN_IF_ERROR(
      Simple(Opcode::kEngramGrant, wire::EncodeEngramGrant(req), [&](wire::Reader* r) -> Status {
        KVTIER_ASSIGN_OR_RETURN(resp, wire::DecodeEngramGrantResponse(r));
        return Status::Ok();
      }));
  return resp;
}

Status ClientImpl::EngramReport(const wire::EngramReport& report) {
  if (wire::EngramTransportIndex(report.transport) < 0) {
    return Status::InvalidArgument("engram report transport must be \"tcp\" or \"verbs\"");
  }
  return Simple(Opcode::kEngramReport, wire::EncodeEngramReport(report), nullptr);
}

uint16_t ClientImpl::WithTurn(uint64_t turn, uint16_t flags, std::vector<uint8_t>* body) const {
  if (turn == 0 || (hello_.features & wire::kFeatureTurns) == 0) return flags;
  uint8_t id[wire::kTurnBytes];
  for (size_t i = 0; i < wire::kTurnBytes; ++i) id[i] = static_cast<uint8_t>(turn >> (8 * i));
  body->insert(body->begin(), id, id + wire::kTurnBytes);
  return static_cast<uint16_t>(flags | wire::kFlagTurn);
}

Status ClientImpl::ForEachBatch(std::span<const wire::Key> keys,
                                const std::function<Status(std::span<const wire::Key>)>& call) {
  if (keys.empty()) return call(keys);
  for (size_t base = 0; base < keys.size(); base += BatchLimit()) {
    KVTIER_RETURN_IF_ERROR(call(keys.subspan(base, std::min(BatchLimit(), keys.size() - base))));
  }
  return Status::Ok();
}

Status ClientImpl::Simple(Opcode op, std::span<const uint8_t> body,
                          const std::function<Status(wire::Reader*)>& parse, uint16_t flags) {
  auto fut = Call(op, flags, body);
  KVTIER_ASSIGN_OR_RETURN(Frame f, Wait(fut));
  wire::Reader r(f.body);
  Status st;
  KVTIER_RETURN_IF_ERROR(wire::DecodeStatus(&r, &st));
  KVTIER_RETURN_IF_ERROR(st);
  return parse ? parse(&r) : Status::Ok();
}

StatusOr<std::string> ClientImpl::TextCall(Opcode op, std::span<const uint8_t> body) {
  std::string text;
  KVTIER_RETURN_IF_ERROR(Simple(op, body, [&](wire::Reader* r) -> Status {
    KVTIER_ASSIGN_OR_RETURN(text, wire::DecodeText(r, options_.max_frame_bytes));
    return Status::Ok();
  }));
  return text;
}

StatusOr<LookupResult> ClientImpl::DoLookup(const std::vector<wire::Key>& keys, uint64_t turn) {
  LookupResult out;
  for (size_t base = 0; base < keys.size() || base == 0; base += BatchLimit()) {
    size_t n = std::min<size_t>(BatchLimit(), keys.size() - base);
    wire::LookupReply reply;
    std::vector<uint8_t> body = wire::EncodeKeys(std::span<const wire::Key>(keys).subspan(base, n));
    const uint16_t flags = WithTurn(turn, 0, &body);
    KVTIER_RETURN_IF_ERROR(Simple(
        Opcode::kLookup, body,
        [&](wire::Reader* r) -> Status {
          KVTIER_ASSIGN_OR_RETURN(reply, wire::DecodeLookupReply(r));
          return Status::Ok();
        },
        flags));
    out.hit_count += reply.hit_count;
    out.tiers.insert(out.tiers.end(), reply.tiers.begin(), reply.tiers.end());
    out.first_miss = reply.first_miss;
    if (reply.hit_count < n || keys.empty()) break;
  }
  return out;
}

StatusOr<std::future<StatusOr<Frame>>> ClientImpl::SendPut(
    std::span<const PutUnit> units, const PutOptions& o,
    std::vector<std::shared_ptr<ShmLease>>* leases) {
  wire::PutRequest req;
  req.kind = o.kind;
  req.highest_tier = o.highest_tier;
  req.allow_ssd = o.allow_ssd ? 1 : 0;
  req.recompute_tokens = o.recompute_tokens;
  req.ttl_ms = o.ttl_ms;
  req.units.resize(units.size());
  uint64_t total = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    req.units[i].key = units[i].key;
    req.units[i].parent = units[i].parent;
    req.units[i].value = units[i].value;
    req.units[i].value_bytes = static_cast<uint32_t>(units[i].value.size());
    if (!InShm(units[i].value)) total += units[i].value.size();
  }
  bool shm = false;
  std::shared_ptr<ShmLease> lease;
  if (shm_ != nullptr) {
    std::optional<uint64_t> off = total > 0 ? alloc_.Alloc(total) : std::optional<uint64_t>(0);
    if (off) {
      shm = true;
      if (total > 0) {
        lease = std::make_shared<ShmLease>(&alloc_, *off, total);
        leases->push_back(lease);
      }
      uint64_t cursor = *off;
      for (size_t i = 0; i < units.size(); ++i) {
        std::span<const uint8_t> v = units[i].value;
        if (InShm(v)) {
          req.units[i].value_offset = static_cast<uint64_t>(v.data() - shm_);  // zero copy
        } else {
          std::memcpy(shm_ + cursor, v.data(), v.size());
          req.units[i].value_offset = cursor;
          cursor += v.size();
        }
      }
    }
  }
  std::vector<uint8_t> body = wire::EncodePut(req, shm);
  const uint16_t flags = WithTurn(o.turn, shm ? wire::kFlagShm : 0, &body);
  std::vector<std::shared_ptr<ShmLease>> held;
  if (lease) held.push_back(std::move(lease));
  return Call(Opcode::kPut, flags, body, std::move(held));
}

Status ClientImpl::GetChunk(std::span<const wire::Key> keys, size_t base, uint64_t turn,
                            const std::function<void(size_t, const GetItem&)>& visit) {
  std::shared_ptr<ShmLease> lease;
  if (shm_ != nullptr) {
    for (uint64_t cap = shm_bytes_ / 2; cap >= (64u << 10) && !lease; cap /= 2) {
      if (auto off = alloc_.Alloc(cap)) lease = std::make_shared<ShmLease>(&alloc_, *off, cap);
    }
  }
  wire::GetRequest req;
  req.keys.assign(keys.begin(), keys.end());
  bool shm = lease != nullptr;
  if (shm) {
    req.dst_offset = lease->offset;
    req.dst_capacity = lease->bytes;
  }
  std::vector<std::shared_ptr<ShmLease>> held;
  if (lease) held.push_back(lease);
  std::vector<uint8_t> body = wire::EncodeGet(req, shm);
  const uint16_t flags = WithTurn(turn, shm ? wire::kFlagShm : 0, &body);
  auto fut = Call(Opcode::kGet, flags, body, std::move(held));
  KVTIER_ASSIGN_OR_RETURN(Frame f, Wait(fut));
  wire::Reader r(f.body);
  Status st;
  KVTIER_RETURN_IF_ERROR(wire::DecodeStatus(&r, &st));
  KVTIER_RETURN_IF_ERROR(st);
  KVTIER_ASSIGN_OR_RETURN(std::vector<wire::GetEntry> entries, wire::DecodeGetResponse(&r, shm));
  if (entries.size() != keys.size()) return Status::Corruption("get response count mismatch");
  // Over shared memory the values are viewed in `copied` (or, when it could not be made,
  // in the mapping); the thread keeps it for its next GET.
  ValuesBuffer copied;
  const bool copy_out = shm && CopyOutValues(entries, *lease, &copied);
  struct GiveBack {
    ValuesBuffer* b;
    ~GiveBack() { ReturnValuesBuffer(std::exchange(*b, ValuesBuffer{})); }
  } give_back{&copied};
  std::vector<wire::Key> retry;
  std::vector<size_t> retry_index;
  for (size_t i = 0; i < entries.size(); ++i) {
    const wire::GetEntry& e = entries[i];
    if (e.code == StatusCode::kRetry) {  // no room in the destination / frame: ask again
      retry.push_back(keys[i]);
      retry_index.push_back(base + i);
      continue;
    }
    GetItem item;
    item.status = e.code == StatusCode::kOk ? Status::Ok() : Status(e.code, "miss");
    item.tier = e.tier;
    if (e.code == StatusCode::kOk) {
      if (shm) {
        if (!InsideArea(e.value_offset, e.value_bytes, lease->offset, lease->bytes)) {
          return Status::Corruption("get value outside the destination area");
        }
        const uint8_t* v =
            copy_out ? copied.data.get() + (e.value_offset - lease->offset) : shm_ + e.value_offset;
        item.value = std::span<const uint8_t>(v, e.value_bytes);
      } else {
        item.value = e.value;
      }
    }
    visit(base + i, item);
  }
  lease.reset();
  // One key at a time, inline: each fits in a frame by itself.
  for (size_t j = 0; j < retry.size(); ++j) {
    wire::GetRequest one;
    one.keys = {retry[j]};
    std::vector<uint8_t> one_body = wire::EncodeGet(one, false);
    const uint16_t one_flags = WithTurn(turn, 0, &one_body);
    auto rf = Call(Opcode::kGet, one_flags, one_body);
    KVTIER_ASSIGN_OR_RETURN(Frame f1, Wait(rf));
    wire::Reader r1(f1.body);
    Status s1;
    KVTIER_RETURN_IF_ERROR(wire::DecodeStatus(&r1, &s1));
    KVTIER_RETURN_IF_ERROR(s1);
    KVTIER_ASSIGN_OR_RETURN(std::vector<wire::GetEntry> e1, wire::DecodeGetResponse(&r1, false));
    if (e1.size() != 1) return Status::Corruption("get response count mismatch");
    GetItem item;
    item.status = e1[0].code == StatusCode::kOk ? Status::Ok() : Status(e1[0].code, "miss");
    item.tier = e1[0].tier;
    item.value = e1[0].value;
    visit(retry_index[j], item);
  }
  return Status::Ok();
}

}  // namespace kvtier::daemon::client_internal
