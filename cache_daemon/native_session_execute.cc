// One native request on a worker thread (native_session_impl.h): Execute and the opcodes'
// bodies. Reads only the request's Job and the connection's immutable state.
#include <algorithm>

#include "cache_daemon/native_session_impl.h"
#include "cache_daemon/shm_writer.h"
#include "common/logging.h"

namespace kvtier::daemon::internal::native {

uint32_t NativeSession::BatchLimit() const {
  return std::clamp<uint32_t>(shared_->options->max_batch_keys, 1, wire::kMaxBatchKeys);
}

Status NativeSession::CheckBatch(size_t keys) const {
  if (keys <= BatchLimit()) return Status::Ok();
  return Status::InvalidArgument("batch of " + std::to_string(keys) +
                                 " keys exceeds max_batch_keys " + std::to_string(BatchLimit()));
}

bool NativeSession::InShm(const Job& job, uint64_t offset, uint64_t bytes) {
  return job.shm != nullptr && wire::InsideArea(offset, bytes, 0, job.shm_bytes);
}

std::vector<uint8_t> NativeSession::Execute(Job& job, StatusCode* code) {
  std::vector<uint8_t> out;
  Status st = ExecuteInto(job, code, &out);
  if (job.replied) return {};
  if (!st.ok()) {
    *code = st.code();
    return Response(job.frame.header, 0, st);
  }
  return out;
}

Status NativeSession::ExecuteInto(Job& job, StatusCode* code, std::vector<uint8_t>* out) {
  const wire::Frame& f = job.frame;
  const wire::FrameHeader& h = f.header;
  Service* svc = shared_->service;
  const Tenant& t = *job.tenant;
  const uint32_t unit_tokens = job.unit_tokens;
  uint8_t* const shm_base = job.shm;
  bool shm = (h.flags & wire::kFlagShm) != 0;
  if (shm && shm_base == nullptr) return Status::InvalidArgument("shm flag without SHM_ATTACH");
  // The opcode's fields: after the turn id when the frame carries one (wire::kFlagTurn).
  std::span<const uint8_t> body = f.body;
  if ((h.flags & wire::kFlagTurn) != 0) {
    KVTIER_RETURN_IF_ERROR(wire::SplitTurn(h.opcode, f.body, &body).status());
  }
  // Responses never carry the turn flag: their bodies have no turn id.
  const auto reply_flags = static_cast<uint16_t>(h.flags & wire::kFlagShm);
  uint32_t max_frame = static_cast<uint32_t>(
      std::min<uint64_t>(shared_->options->max_frame_bytes, uint64_t{1} << 31));
  switch (static_cast<Opcode>(h.opcode)) {
    case Opcode::kLookup: {
      KVTIER_ASSIGN_OR_RETURN(std::vector<wire::Key> keys, wire::DecodeKeys(body));
      KVTIER_RETURN_IF_ERROR(CheckBatch(keys.size()));
      wire::LookupReply r = svc->Lookup(t, keys, unit_tokens, job.request);
      *out = Response(h, 0, Status::Ok(), [&](wire::Writer* w) { wire::EncodeLookupReply(r, w); });
      return Status::Ok();
    }
    case Opcode::kPut: {
      KVTIER_ASSIGN_OR_RETURN(wire::PutRequest req, wire::DecodePut(body, shm));
      KVTIER_RETURN_IF_ERROR(CheckBatch(req.units.size()));
      std::vector<PutItem> items(req.units.size());
      for (size_t i = 0; i < req.units.size(); ++i) {
        const wire::PutUnit& u = req.units[i];
        items[i].chain = u.key;
        items[i].parent_chain = u.parent;
        if (shm) {
          if (!InShm(job, u.value_offset, u.value_bytes)) {
            return Status::InvalidArgument("put value outside the shared-memory region");
          }
          items[i].value = std::span<const uint8_t>(shm_base + u.value_offset, u.value_bytes);
        } else {
          items[i].value = u.value;
        }
      }
      std::vector<StatusCode> codes = svc->Put(t, req, items, unit_tokens, job.request);
      for (StatusCode c : codes) {
        if (c != StatusCode::kOk) *code = c;
      }
      *out = Response(h, reply_flags, Status::Ok(),
                      [&](wire::Writer* w) { wire::EncodeCodes(codes, w); });
      return Status::Ok();
    }
    case Opcode::kGet: {
      KVTIER_ASSIGN_OR_RETURN(wire::GetRequest req, wire::DecodeGet(body, shm));
      KVTIER_RETURN_IF_ERROR(CheckBatch(req.keys.size()));
      if (shm && !InShm(job, req.dst_offset, req.dst_capacity)) {
        return Status::InvalidArgument("get destination outside the shared-memory region");
      }
      // Inline values make the reply as large as the values: it is built in a kept buffer
      // (reply_buffers.h), given back when written. Over shared memory the reply is small.
      wire::Writer w(shm ? std::vector<uint8_t>() : shared_->reply_buffers->Take());
      w.buffer().resize(wire::kHeaderBytes);
      wire::EncodeStatus(Status::Ok(), &w);
      w.U16(static_cast<uint16_t>(req.keys.size()));
      // Over shared memory each value is staged and the staged values are written into the
      // region with one pwrite (ShmValueWriter: the value's only copy before the kernel's,
      // from where the store read it, an SSD unit's verified record in the batch's read
      // region); the entries are encoded after the write, when it is known which values
      // reached the region. A value the kernel refused to write is answered retry: the
      // client asks again inline.
      struct ShmEntry {
        StatusCode code;
        storage::Tier tier;
        uint32_t bytes;
        size_t slot;  // ShmValueWriter::Slot::index
        uint64_t offset;
      };
      std::optional<ShmValueWriter> shm_out;
      std::vector<ShmEntry> shm_entries;
      if (shm) {
        shm_out.emplace(job.shm_fd, req.dst_offset, req.dst_capacity);
        shm_entries.reserve(req.keys.size());
      }
      // Every key was visited: the values are placed (written into the region), the reply is
      // complete and goes to the strand now; the store's promotions into DRAM follow on this
      // worker, off the client's path (they re-check each unit under the store's lock, so a
      // DELETE the client sends after this reply is never undone by them).
      auto answer = [&] {
        if (shm) {
          shm_out->Flush();
          for (const ShmEntry& e : shm_entries) {
            StatusCode c = e.code;
            if (c == StatusCode::kOk && !shm_out->Written(e.slot)) {
              c = StatusCode::kRetry;
              shared_->metrics->shm_write_failures.fetch_add(1);  // counted per value
            }
            if (c != StatusCode::kOk && c != StatusCode::kNotFound) *code = c;
            w.U8(static_cast<uint8_t>(c));
            w.U8(static_cast<uint8_t>(e.tier));
            w.U32(c == StatusCode::kOk ? e.bytes : 0);
            if (c == StatusCode::kOk) w.U64(e.offset);
          }
        }
        std::vector<uint8_t> reply = shared_->reply_buffers->Fit(w.Take());
        auto hdr = wire::EncodeHeader(h.opcode | wire::kResponseBit, reply_flags, h.request_id,
                                      static_cast<uint32_t>(reply.size() - wire::kHeaderBytes));
        std::copy(hdr.begin(), hdr.end(), reply.begin());
        if (job.reply) {
          job.reply(std::move(reply), *code);
        } else {
          *out = std::move(reply);
        }
      };
      svc->Get(
          t, req.keys, unit_tokens, job.request,
          [&](size_t, const Status& st, storage::Tier tier, std::span<const uint8_t> v) {
            StatusCode c = st.code();
            if (shm) {
              std::optional<ShmValueWriter::Slot> slot;
              if (c == StatusCode::kOk && !(slot = shm_out->Add(v))) {
                c = StatusCode::kRetry;  // no room left in the destination area
              }
              shm_entries.push_back({c, tier, static_cast<uint32_t>(v.size()),
                                     slot ? slot->index : 0, slot ? slot->offset : 0});
              return;
            }
            if (st.ok() && w.buffer().size() + v.size() + 6 > max_frame) {
              c = StatusCode::kRetry;  // would exceed the frame limit
            }
            if (c == StatusCode::kOk && !ReserveReply(v.size(), &job)) {
              c = StatusCode::kRetry;  // the connection's replies are not being read
            }
            if (c != StatusCode::kOk && c != StatusCode::kNotFound) *code = c;
            w.U8(static_cast<uint8_t>(c));
            w.U8(static_cast<uint8_t>(tier));
            w.U32(c == StatusCode::kOk ? static_cast<uint32_t>(v.size()) : 0);
            if (c == StatusCode::kOk) w.Bytes(v);
          },
          answer);
      return Status::Ok();
    }
    case Opcode::kPrefetch: {
      KVTIER_ASSIGN_OR_RETURN(std::vector<wire::Key> keys, wire::DecodeKeys(f.body));
      KVTIER_RETURN_IF_ERROR(CheckBatch(keys.size()));
      KVTIER_RETURN_IF_ERROR(svc->Prefetch(t, keys));
      *out = Response(h, 0, Status::Ok());
      return Status::Ok();
    }
    case Opcode::kPin: {
      KVTIER_ASSIGN_OR_RETURN(wire::PinRequest req, wire::DecodePin(f.body));
      KVTIER_RETURN_IF_ERROR(CheckBatch(req.keys.size()));
      KVTIER_RETURN_IF_ERROR(svc->Pin(t, req.keys, req.lease_ms));
      *out = Response(h, 0, Status::Ok());
      return Status::Ok();
    }
    case Opcode::kUnpin: {
      KVTIER_ASSIGN_OR_RETURN(std::vector<wire::Key> keys, wire::DecodeKeys(f.body));
      KVTIER_RETURN_IF_ERROR(CheckBatch(keys.size()));
      KVTIER_RETURN_IF_ERROR(svc->Unpin(t, keys));
      *out = Response(h, 0, Status::Ok());
      return Status::Ok();
    }
    case Opcode::kDelete: {
      KVTIER_ASSIGN_OR_RETURN(wire::DeleteRequest req, wire::DecodeDelete(f.body));
      KVTIER_RETURN_IF_ERROR(CheckBatch(req.keys.size()));
      uint32_t deleted = 0;
      if (req.scope == 1) {
        KVTIER_RETURN_IF_ERROR(svc->DeleteTenant(t));
      } else {
        Status failed;
        deleted = svc->Delete(t, req.keys, unit_tokens, &failed);
        KVTIER_RETURN_IF_ERROR(failed);  // a delete that is not durable is not acknowledged
      }
      *out = Response(h, 0, Status::Ok(), [&](wire::Writer* w) { w->U32(deleted); });
      return Status::Ok();
    }
    case Opcode::kStats: {
      std::string json = svc->StatsJson(&t);
      *out = Response(h, 0, Status::Ok(), [&](wire::Writer* w) { wire::EncodeText(json, w); });
      return Status::Ok();
    }
    case Opcode::kPolicyGet: {
      std::string json = svc->PolicyJson();
      *out = Response(h, 0, Status::Ok(), [&](wire::Writer* w) { wire::EncodeText(json, w); });
      return Status::Ok();
    }
    case Opcode::kPolicySet: {
      if (!t.admin) return Status::PermissionDenied("POLICY SET needs an admin tenant");
      wire::Reader r(f.body);
      KVTIER_ASSIGN_OR_RETURN(std::string body, wire::DecodeText(&r, 1 << 20));
      KVTIER_RETURN_IF_ERROR(svc->SetPolicyJson(body));
      std::string json = svc->PolicyJson();
      KVTIER_LOG(kInfo) << "policy switched by tenant " << t.name << ": " << json;
      *out = Response(h, 0, Status::Ok(), [&](wire::Writer* w) { wire::EncodeText(json, w); });
      return Status::Ok();
    }
    case Opcode::kDrain: {
      if (!t.admin) return Status::PermissionDenied("DRAIN needs an admin tenant");
      wire::Reader r(f.body);
      uint8_t shutdown = 0;
      if (!r.U8(&shutdown) || r.remaining() != 0) {
        return Status::InvalidArgument("drain body is one byte");
      }
      shared_->ready.store(false);
      KVTIER_RETURN_IF_ERROR(svc->store()->Flush());
      if (shutdown != 0 && shared_->request_shutdown) shared_->request_shutdown();
      *out = Response(h, 0, Status::Ok());
      return Status::Ok();
    }
    case Opcode::kEngramGrant: {
      KVTIER_ASSIGN_OR_RETURN(wire::EngramGrantRequest req, wire::DecodeEngramGrant(f.body));
      EngramServing* engram = shared_->engram;
      if (engram == nullptr) {
        return Status::NotFound("Engram serving is not enabled on this daemon ([engram])");
      }
      KVTIER_ASSIGN_OR_RETURN(wire::EngramGrantResponse resp,
                              engram->Grant(t.name, req.regions, req.ttl_ms));
      resp.shards_toml = engram->shards_toml();
      *out = Response(h, 0, Status::Ok(),
                      [&](wire::Writer* w) { wire::EncodeEngramGrantResponse(resp, w); });
      if (out->size() > shared_->options->max_frame_bytes) {
        // The client could not read it: take the grants back rather than leave them unused.
        engram->Revoke(t.name, resp.regions);
        out->clear();
        return Status::Rejected(
            "engram grant reply exceeds limits.max_frame_bytes; ask for "
            "fewer regions");
      }
      // Names and counts only: the tokens are secrets and appear nowhere but the reply.
      KVTIER_LOG(kInfo) << "engram: " << resp.regions.size() << " grants for tenant " << t.name
                        << ", ttl " << resp.ttl_ms << " ms";
      return Status::Ok();
    }
    case Opcode::kEngramReport: {
      KVTIER_ASSIGN_OR_RETURN(wire::EngramReport report, wire::DecodeEngramReport(f.body));
      KVTIER_RETURN_IF_ERROR(shared_->metrics->engram_fetch.Add(t.id, report));
      *out = Response(h, 0, Status::Ok());
      return Status::Ok();
    }
    default:
      break;
  }
  return Status::InvalidArgument("opcode not valid here");
}

}  // namespace kvtier::daemon::internal::native
