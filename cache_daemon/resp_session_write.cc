// The RESP connection's replies: buffered text and GET value segments, written with one
// writev when ready (resp_session_impl.h).
#include <algorithm>

#include "cache_daemon/resp_session_impl.h"

namespace kvtier::daemon::internal {

size_t RespSession::ready_bodies() const {
  size_t limit = ready_text(), n = 0;
  while (n < bodies_.size() && bodies_[n].text_end <= limit) ++n;
  return n;
}

size_t RespSession::ready_bytes() const {
  size_t n = ready_text();
  for (size_t i = 0, k = ready_bodies(); i < k; ++i)
    n += bodies_[i].bytes.size() - bodies_[i].offset;
  return n;
}

void RespSession::Gather(std::string_view text, std::span<const Body> bodies, size_t skip,
                         std::vector<asio::const_buffer>* iov) {
  iov->clear();
  auto add = [&](const char* p, size_t n) {
    size_t drop = std::min(skip, n);
    skip -= drop;
    if (n > drop) iov->emplace_back(p + drop, n - drop);
  };
  size_t prev = 0;
  for (const Body& b : bodies) {
    add(text.data() + prev, b.text_end - prev);
    add(reinterpret_cast<const char*>(b.bytes.data()) + b.offset, b.bytes.size() - b.offset);
    prev = b.text_end;
  }
  add(text.data() + prev, text.size() - prev);
}

void RespSession::TakeReady(size_t text, size_t nbodies, std::string* wtext,
                            std::vector<Body>* wbodies) {
  for (size_t i = 0; i < nbodies; ++i) {
    body_bytes_ -= bodies_[i].bytes.size() - bodies_[i].offset;
    wbodies->push_back(std::move(bodies_[i]));
  }
  bodies_.erase(bodies_.begin(), bodies_.begin() + static_cast<ptrdiff_t>(nbodies));
  if (text == out_.size()) {
    wtext->swap(out_);
    out_.clear();
  } else {
    wtext->assign(out_, 0, text);
    out_.erase(0, text);
  }
  for (Body& b : bodies_) b.text_end -= text;
  for (Hold& h : holds_) h.text_pos -= text;
}

bool RespSession::WriteNow() {
  size_t text = ready_text(), nbodies = ready_bodies();
  size_t total = ready_bytes();
  Gather(std::string_view(out_).substr(0, text), std::span<const Body>(bodies_.data(), nbodies), 0,
         &iov_);
  boost::system::error_code ec;
  size_t n = sock_.write_some(iov_, ec);
  if (ec == asio::error::would_block || ec == asio::error::try_again) {
    ec.clear();
    n = 0;
  }
  if (ec) {
    DoClose();
    return false;
  }
  shared_->metrics->AddBytes(false, n);
  if (n > 0) idle_.Touch(IdleWatch::NowMs());
  wbuf_.clear();
  TakeReady(text, nbodies, &wbuf_, &wbodies_);
  if (n == total) {
    wbuf_.clear();
    Recycle(&wbodies_);
    return true;
  }
  Account();
  Gather(wbuf_, wbodies_, n, &iov_);
  writing_ = true;
  asio::async_write(sock_, iov_,
                    asio::bind_executor(strand_, [self = shared_from_this()](
                                                     boost::system::error_code ec, size_t n) {
                      self->writing_ = false;
                      self->shared_->metrics->AddBytes(false, n);
                      self->idle_.Touch(IdleWatch::NowMs());
                      self->wbuf_.clear();
                      self->Recycle(&self->wbodies_);
                      if (ec) return self->DoClose();
                      // Commands may still be buffered (we stopped at the reply limit),
                      // and replies may have become ready meanwhile.
                      self->Process();
                    }));
  return false;
}

void RespSession::Recycle(std::vector<Body>* bodies) {
  for (Body& b : *bodies) {
    if (spare_bytes_ + b.bytes.capacity() <= kSpareBufferBytesMax) {
      spare_bytes_ += b.bytes.capacity();
      spare_.push_back(std::move(b.bytes));
    }
  }
  bodies->clear();
}

void RespSession::AppendValue(std::span<const uint8_t> v) {
  if (v.size() < kScatterMinBytes) {
    resp::AppendBulk(std::string_view(reinterpret_cast<const char*>(v.data()), v.size()), &out_);
    return;
  }
  resp::AppendBulkHeader(v.size(), &out_);
  size_t offset = static_cast<size_t>(v.data() - raw_.data());
  bodies_.push_back(Body{out_.size(), std::move(raw_), offset});
  body_bytes_ += v.size();
  raw_.clear();
  if (!spare_.empty()) {
    raw_ = std::move(spare_.back());
    spare_.pop_back();
    spare_bytes_ -= raw_.capacity();
  }
  out_.append("\r\n");
}

}  // namespace kvtier::daemon::internal
