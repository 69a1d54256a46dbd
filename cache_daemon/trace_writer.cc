#include "cache_daemon/trace_writer.h"

#include <zstd.h>

#include "common/clock.h"

namespace kvtier::daemon {

StatusOr<std::unique_ptr<TraceWriter>> TraceWriter::Open(const std::string& path,
                                                         uint32_t queue_depth,
                                                         TraceWindowLimits window) {
  std::unique_ptr<TraceWriter> w(new TraceWriter());
  w->file_ = std::fopen(path.c_str(), "wb");
  if (w->file_ == nullptr) return Status::IOError("cannot open trace file " + path);
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  if (cctx == nullptr) return Status::Internal("ZSTD_createCCtx failed");
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, 3);
  w->zstd_ = cctx;
  w->queue_depth_ = queue_depth == 0 ? 1 : queue_depth;
  if (window.records_max > 0) w->window_ = std::make_unique<TraceWindow>(window);
  w->start_us_ = DefaultSteadyClock().NowUs();
  w->thread_ = std::thread([p = w.get()] { p->Run(); });
  return w;
}

TraceWriter::~TraceWriter() {
  (void)Close();
  if (zstd_ != nullptr) ZSTD_freeCCtx(static_cast<ZSTD_CCtx*>(zstd_));
}

void TraceWriter::Record(TraceRecord record) {
  record.ts_ms = (DefaultSteadyClock().NowUs() - start_us_) / 1000;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_ || queue_.size() >= queue_depth_) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    queue_.push_back(std::move(record));
  }
  cv_.notify_one();
}

std::string TraceWriter::FormatLine(const TraceRecord& r) {
  std::string s = "{\"ts_ms\":" + std::to_string(r.ts_ms) + ",\"op\":\"" + r.op +
                  "\",\"tenant\":" + std::to_string(r.tenant) + ",\"ids\":[";
  for (size_t i = 0; i < r.ids.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(r.ids[i]);
  }
  s += "],\"bytes\":" + std::to_string(r.bytes) +
       ",\"unit_tokens\":" + std::to_string(r.unit_tokens);
  if (r.request != 0) s += ",\"request\":" + std::to_string(r.request);
  s += '}';
  return s;
}

void TraceWriter::Run() {
  auto* cctx = static_cast<ZSTD_CCtx*>(zstd_);
  std::vector<char> out(ZSTD_CStreamOutSize());
  auto pump = [&](const std::string& text, ZSTD_EndDirective mode) {
    ZSTD_inBuffer in{text.data(), text.size(), 0};
    bool done = false;
    while (!done) {
      ZSTD_outBuffer ob{out.data(), out.size(), 0};
      size_t left = ZSTD_compressStream2(cctx, &ob, &in, mode);
      if (ZSTD_isError(left)) {
        status_ = Status::IOError(std::string("zstd: ") + ZSTD_getErrorName(left));
        return;
      }
      if (ob.pos > 0 && std::fwrite(out.data(), 1, ob.pos, file_) != ob.pos) {
        status_ = Status::IOError("trace write failed");
        return;
      }
      done = (mode == ZSTD_e_continue) ? in.pos == in.size : left == 0;
    }
  };
  std::deque<TraceRecord> batch;
  for (;;) {
    bool closing = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      batch.swap(queue_);
      closing = closing_;
    }
    std::string text;
    for (const TraceRecord& r : batch) {
      std::string line = FormatLine(r);
      text += line;
      text += '\n';
      if (window_ != nullptr && status_.ok()) window_->Append(std::move(line));
    }
    written_.fetch_add(batch.size(), std::memory_order_relaxed);
    batch.clear();
    if (status_.ok() && !text.empty()) pump(text, ZSTD_e_continue);
    if (closing) {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.empty()) break;
    }
  }
  if (status_.ok()) pump(std::string(), ZSTD_e_end);
}

Status TraceWriter::Close() {
  if (closed_) return status_;
  closed_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
  if (file_ != nullptr) {
    if (std::fclose(file_) != 0 && status_.ok()) status_ = Status::IOError("trace close failed");
    file_ = nullptr;
  }
  return status_;
}

}  // namespace kvtier::daemon
