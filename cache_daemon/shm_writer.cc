#include "cache_daemon/shm_writer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <utility>

#include "storage/block_device.h"

namespace kvtier::daemon::internal {
namespace {

constexpr uint64_t kStageGrainBytes = 2ull << 20;  // x86-64 huge page

}  // namespace

// Anonymous memory, 2 MiB aligned and advised MADV_HUGEPAGE: its first touches cost one fault
// per huge page, not one per 4 KiB page.
struct ShmValueWriter::Stage {
  storage::AlignedBuffer data;
  uint64_t bytes = 0;
};

namespace {

thread_local std::unique_ptr<ShmValueWriter::Stage> t_stage;
// A stage populated before any GET needed it (WarmShmStage), for the first thread without one.
std::mutex g_warm_mu;
std::unique_ptr<ShmValueWriter::Stage> g_warm;  // protected by g_warm_mu

std::unique_ptr<ShmValueWriter::Stage> NewStage() {
  auto s = std::make_unique<ShmValueWriter::Stage>();
  s->data = storage::AllocateAligned(kShmStageBytesMax, kStageGrainBytes);
  if (s->data == nullptr) return nullptr;
  s->bytes = kShmStageBytesMax;
  (void)::madvise(s->data.get(), s->bytes, MADV_HUGEPAGE);  // advisory: ignored without THP
  return s;
}

std::unique_ptr<ShmValueWriter::Stage> TakeStage() {
  if (t_stage != nullptr) return std::move(t_stage);
  {
    std::lock_guard lock(g_warm_mu);
    if (g_warm != nullptr) return std::move(g_warm);
  }
  return NewStage();
}

}  // namespace

void WarmShmStage() {
  {
    std::lock_guard lock(g_warm_mu);
    if (g_warm != nullptr) return;
  }
  std::unique_ptr<ShmValueWriter::Stage> s = NewStage();
  if (s == nullptr) return;
  bool populated = false;
#ifdef MADV_POPULATE_WRITE
  populated = ::madvise(s->data.get(), s->bytes, MADV_POPULATE_WRITE) == 0;
#endif
  if (!populated) std::memset(s->data.get(), 0, s->bytes);
  std::lock_guard lock(g_warm_mu);
  if (g_warm == nullptr) g_warm = std::move(s);
}

bool PwriteAll(int fd, std::span<const uint8_t> v, uint64_t offset) {
  size_t done = 0;
  while (done < v.size()) {
    const ssize_t n =
        ::pwrite(fd, v.data() + done, v.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

ShmValueWriter::ShmValueWriter(int fd, uint64_t dst_offset, uint64_t dst_capacity, WriteFn write)
    : fd_(fd), dst_offset_(dst_offset), dst_capacity_(dst_capacity), write_(std::move(write)) {}

ShmValueWriter::~ShmValueWriter() {
  if (stage_ != nullptr && t_stage == nullptr) t_stage = std::move(stage_);
}

std::optional<ShmValueWriter::Slot> ShmValueWriter::Add(std::span<const uint8_t> v) {
  if (v.size() > dst_capacity_ - cursor_) return std::nullopt;
  const Slot slot{written_.size(), dst_offset_ + cursor_};
  if (stage_ == nullptr && v.size() <= kShmStageBytesMax) stage_ = TakeStage();
  if (stage_ == nullptr || v.size() > stage_->bytes) {
    // Too large for the stage (or no memory for one): what is staged first, then v directly.
    Flush();
    cursor_ += v.size();
    const bool ok = write_(fd_, v, slot.offset);
    if (!ok) ++failed_writes_;
    written_.push_back(ok ? 1 : 0);
    staged_first_ = written_.size();
    return slot;
  }
  if (staged_bytes_ + v.size() > stage_->bytes) Flush();
  if (staged_first_ == written_.size()) staged_offset_ = slot.offset;  // a new write begins
  cursor_ += v.size();
  written_.push_back(0);
  if (!v.empty()) std::memcpy(stage_->data.get() + staged_bytes_, v.data(), v.size());
  staged_bytes_ += v.size();
  return slot;
}

void ShmValueWriter::Flush() {
  if (staged_first_ >= written_.size()) return;  // nothing staged
  const bool ok =
      staged_bytes_ == 0 ||
      write_(fd_, std::span<const uint8_t>(stage_->data.get(), staged_bytes_), staged_offset_);
  if (!ok) ++failed_writes_;
  for (size_t k = staged_first_; k < written_.size(); ++k) written_[k] = ok ? 1 : 0;
  staged_first_ = written_.size();
  staged_bytes_ = 0;
}

bool ShmValueWriter::Written(size_t index) const {
  return index < written_.size() && written_[index] != 0;
}

}  // namespace kvtier::daemon::internal
