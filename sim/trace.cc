#include "sim/trace.h"

#include <zstd.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

namespace kvtier::sim {
namespace {

using nlohmann::json;

Status Malformed(size_t line_no, std::string_view why) {
  return Status::InvalidArgument("trace line " + std::to_string(line_no) + ": " + std::string(why));
}

bool GetU64(const json& j, const char* key, uint64_t* out) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) {
    // JSON numbers such as 0 parse as unsigned; negative or fractional numbers are rejected.
    if (it != j.end() && it->is_number_integer() && it->get<int64_t>() >= 0) {
      *out = static_cast<uint64_t>(it->get<int64_t>());
      return true;
    }
    return false;
  }
  *out = it->get<uint64_t>();
  return true;
}

Status ParseIds(const json& arr, size_t line_no, Trace* trace, TraceRequest* r) {
  if (!arr.is_array()) return Malformed(line_no, "ids/hash_ids is not an array");
  if (arr.size() > kMaxIdsPerRequest) return Malformed(line_no, "too many ids");
  r->first_id = static_cast<uint32_t>(trace->ids.size());
  for (const json& v : arr) {
    if (v.is_number_unsigned()) {
      trace->ids.push_back(v.get<uint64_t>());
    } else if (v.is_number_integer() && v.get<int64_t>() >= 0) {
      trace->ids.push_back(static_cast<uint64_t>(v.get<int64_t>()));
    } else {
      return Malformed(line_no, "an id is not an unsigned integer");
    }
  }
  r->num_ids = static_cast<uint32_t>(arr.size());
  return Status::Ok();
}

Status ParseLine(std::string_view line, size_t line_no, const TraceLoadOptions& options,
                 Trace* trace) {
  json j = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Malformed(line_no, "not a JSON object");
  if (trace->requests.empty() && options.format == TraceFormat::kAuto) {
    trace->format = j.contains("hash_ids") ? TraceFormat::kMooncake : TraceFormat::kKvtier;
  }
  TraceRequest r;
  if (trace->format == TraceFormat::kMooncake) {
    if (!GetU64(j, "timestamp", &r.ts_ms)) return Malformed(line_no, "bad timestamp");
    if (!GetU64(j, "input_length", &r.input_tokens)) return Malformed(line_no, "bad input_length");
    if (j.contains("output_length") && !GetU64(j, "output_length", &r.output_tokens)) {
      return Malformed(line_no, "bad output_length");
    }
    auto it = j.find("hash_ids");
    if (it == j.end()) return Malformed(line_no, "no hash_ids");
    KVTIER_RETURN_IF_ERROR(ParseIds(*it, line_no, trace, &r));
    r.unit_tokens = options.block_tokens;
    r.op = TraceOp::kGet;
  } else {
    uint64_t tenant = 0, unit_tokens = 0;
    if (!GetU64(j, "ts_ms", &r.ts_ms)) return Malformed(line_no, "bad ts_ms");
    if (!GetU64(j, "tenant", &tenant) || tenant > UINT32_MAX) {
      return Malformed(line_no, "bad tenant");
    }
    if (!GetU64(j, "bytes", &r.bytes)) return Malformed(line_no, "bad bytes");
    // 0: a RESP value (kvtierd records RESP SET/GET so): a unit without prompt tokens.
    if (!GetU64(j, "unit_tokens", &unit_tokens) || unit_tokens > UINT32_MAX) {
      return Malformed(line_no, "bad unit_tokens");
    }
    auto op = j.find("op");
    if (op == j.end() || !op->is_string()) return Malformed(line_no, "no op");
    const std::string& o = op->get_ref<const std::string&>();
    if (o == "lookup") {
      r.op = TraceOp::kLookup;
    } else if (o == "get") {
      r.op = TraceOp::kGet;
    } else if (o == "put") {
      r.op = TraceOp::kPut;
    } else if (o == "delete") {
      r.op = TraceOp::kDelete;
    } else {
      return Malformed(line_no, "unknown op '" + o + "'");
    }
    auto it = j.find("ids");
    if (it == j.end()) return Malformed(line_no, "no ids");
    KVTIER_RETURN_IF_ERROR(ParseIds(*it, line_no, trace, &r));
    if (j.contains("request") && !GetU64(j, "request", &r.request)) {
      return Malformed(line_no, "bad request");
    }
    r.tenant = static_cast<uint32_t>(tenant);
    r.unit_tokens = static_cast<uint32_t>(unit_tokens);
    r.input_tokens = static_cast<uint64_t>(r.num_ids) * r.unit_tokens;
  }
  if (trace->requests.size() >= kMaxRequests) return Malformed(line_no, "too many requests");
  trace->requests.push_back(r);
  return Status::Ok();
}

// Feeds complete lines of `chunk` (with carry-over of a partial line in `pending`).
Status FeedLines(std::string_view chunk, bool last, std::string* pending, size_t* line_no,
                 const TraceLoadOptions& options, Trace* trace) {
  pending->append(chunk);
  size_t start = 0;
  while (true) {
    size_t nl = pending->find('\n', start);
    if (nl == std::string::npos) break;
    std::string_view line(pending->data() + start, nl - start);
    ++*line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") != std::string_view::npos) {
      KVTIER_RETURN_IF_ERROR(ParseLine(line, *line_no, options, trace));
    }
    start = nl + 1;
  }
  pending->erase(0, start);
  if (pending->size() > kMaxLineBytes) return Malformed(*line_no + 1, "line too long");
  if (last && pending->find_first_not_of(" \t\r") != std::string::npos) {
    ++*line_no;
    KVTIER_RETURN_IF_ERROR(ParseLine(*pending, *line_no, options, trace));
    pending->clear();
  }
  return Status::Ok();
}

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
struct DStreamFree {
  void operator()(ZSTD_DStream* d) const { ZSTD_freeDStream(d); }
};

}  // namespace

StatusOr<Trace> ParseTrace(std::string_view text, const TraceLoadOptions& options) {
  Trace trace;
  if (options.format != TraceFormat::kAuto) trace.format = options.format;
  std::string pending;
  size_t line_no = 0;
  KVTIER_RETURN_IF_ERROR(FeedLines(text, true, &pending, &line_no, options, &trace));
  return trace;
}

StatusOr<Trace> LoadTrace(const std::string& path, const TraceLoadOptions& options) {
  std::unique_ptr<FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  if (!f) return Status::NotFound("cannot open trace '" + path + "'");
  const bool zst = path.size() > 4 && path.compare(path.size() - 4, 4, ".zst") == 0;
  Trace trace;
  if (options.format != TraceFormat::kAuto) trace.format = options.format;
  std::string pending;
  size_t line_no = 0;
  std::vector<char> in(1 << 20), out(ZSTD_DStreamOutSize());
  std::unique_ptr<ZSTD_DStream, DStreamFree> ds;
  if (zst) {
    ds.reset(ZSTD_createDStream());
    if (!ds) return Status::Internal("ZSTD_createDStream failed");
    ZSTD_initDStream(ds.get());
  }
  size_t last_ret = 0;
  while (true) {
    size_t n = std::fread(in.data(), 1, in.size(), f.get());
    if (n == 0) {
      if (std::ferror(f.get())) return Status::IOError("read error on '" + path + "'");
      break;
    }
    if (!zst) {
      KVTIER_RETURN_IF_ERROR(FeedLines({in.data(), n}, false, &pending, &line_no, options, &trace));
      continue;
    }
    ZSTD_inBuffer ib{in.data(), n, 0};
    while (ib.pos < ib.size) {
      ZSTD_outBuffer ob{out.data(), out.size(), 0};
      last_ret = ZSTD_decompressStream(ds.get(), &ob, &ib);
      if (ZSTD_isError(last_ret)) {
        return Status::Corruption("zstd: " + std::string(ZSTD_getErrorName(last_ret)) + " in '" +
                                  path + "'");
      }
      KVTIER_RETURN_IF_ERROR(
          FeedLines({out.data(), ob.pos}, false, &pending, &line_no, options, &trace));
    }
  }
  if (zst && last_ret != 0) return Status::Corruption("truncated zstd stream in '" + path + "'");
  KVTIER_RETURN_IF_ERROR(FeedLines({}, true, &pending, &line_no, options, &trace));
  return trace;
}

}  // namespace kvtier::sim
