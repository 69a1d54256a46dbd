#include "storage/fault_injection.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace kvtier::storage {

struct FaultInjectionEnv::DeviceState {
  std::string name;
  std::shared_ptr<BlockDevice> base;
  std::mutex mu;
  struct Write {
    uint64_t offset;
    std::vector<uint8_t> data;
  };
  std::vector<Write> pending;  // unsynced, in write order
};

namespace {

class FaultDevice final : public BlockDevice {
 public:
  FaultDevice(FaultInjectionEnv* env, std::shared_ptr<FaultInjectionEnv::DeviceState> state)
      : env_(env), state_(std::move(state)) {}

  Status Submit(std::span<IoRequest> batch) override {
    if (batch.size() > kMaxBatchIos) return Status::InvalidArgument("batch too large");
    Status first;
    for (IoRequest& r : batch) {
      r.result = r.op == IoRequest::Op::kRead ? DoRead(r) : DoWrite(r);
      if (first.ok() && !r.result.ok()) first = r.result;
    }
    return first;
  }

  Status Sync(bool data_only) override {
    env_->syncs_.fetch_add(1);
    env_->WaitSyncsAllowed();
    if (env_->crashed()) return Status::IOError("simulated crash");
    if (env_->TakeArmed(env_->arm_sync_eio_)) {
      env_->Record("EIO sync " + state_->name);
      return Status::IOError("injected EIO on fdatasync of " + state_->name);
    }
    std::lock_guard lock(state_->mu);
    for (auto& w : state_->pending) {
      KVTIER_RETURN_IF_ERROR(WriteThrough(w.offset, w.data));
    }
    state_->pending.clear();
    return state_->base->Sync(data_only);
  }
  Status Allocate(uint64_t offset, uint64_t length) override {
    if (env_->crashed()) return Status::IOError("simulated crash");
    if (const size_t files_max = env_->files_max_.load(); files_max > 0) {
      auto names = env_->List();
      if (names.ok() && names->size() > files_max) {
        env_->Record("ENOSPC allocate " + state_->name);
        return NoSpaceError("injected allocate of " + state_->name);
      }
    }
    return state_->base->Allocate(offset, length);
  }
  uint64_t Size() const override {
    std::lock_guard lock(state_->mu);
    uint64_t size = state_->base->Size();
    for (const auto& w : state_->pending) size = std::max<uint64_t>(size, w.offset + w.data.size());
    return size;
  }
  size_t Alignment() const override { return state_->base->Alignment(); }
  std::string Kind() const override { return "fault(" + state_->base->Kind() + ")"; }

 private:
  // Writes through an aligned bounce buffer (the base may be O_DIRECT).
  Status WriteThrough(uint64_t offset, const std::vector<uint8_t>& data) {
    size_t a = state_->base->Alignment();
    if (a <= 1) return state_->base->Write(offset, data);
    uint64_t start = offset / a * a;
    uint64_t end = (offset + data.size() + a - 1) / a * a;
    AlignedBuffer buf = AllocateAligned(end - start, a);
    std::memset(buf.get(), 0, end - start);
    uint64_t base_size = state_->base->Size();
    if (start < base_size) {
      uint64_t n = std::min(end, base_size / a * a) - start;
      if (n > 0) KVTIER_RETURN_IF_ERROR(state_->base->Read(start, {buf.get(), n}));
    }
    std::memcpy(buf.get() + (offset - start), data.data(), data.size());
    return state_->base->Write(start, {buf.get(), end - start});
  }

  Status DoRead(IoRequest& r) {
    if (env_->crashed()) return Status::IOError("simulated crash");
    if (int64_t us = env_->read_delay_us_.load(); us > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    }
    if (env_->TakeArmed(env_->arm_eio_) || env_->Roll(env_->options_.read_eio_probability)) {
      env_->Record("EIO read " + state_->name + " @" + std::to_string(r.offset));
      return Status::IOError("injected EIO on read of " + state_->name);
    }
    if (env_->Roll(env_->options_.short_read_probability)) {
      env_->Record("short read " + state_->name + " @" + std::to_string(r.offset));
      return Status::Corruption("injected short read of " + state_->name);
    }
    {
      std::lock_guard lock(state_->mu);
      uint64_t base_size = state_->base->Size();
      uint64_t in_base =
          r.offset >= base_size ? 0 : std::min<uint64_t>(r.length, base_size - r.offset);
      std::memset(r.buffer, 0, r.length);
      if (in_base > 0) {
        size_t a = state_->base->Alignment();
        if (a > 1 && in_base % a != 0) in_base = in_base / a * a;
        if (in_base > 0) KVTIER_RETURN_IF_ERROR(state_->base->Read(r.offset, {r.buffer, in_base}));
      }
      uint64_t covered = in_base;
      for (const auto& w : state_->pending) {
        uint64_t lo = std::max<uint64_t>(w.offset, r.offset);
        uint64_t hi = std::min<uint64_t>(w.offset + w.data.size(), r.offset + r.length);
        if (lo < hi) {
          std::memcpy(r.buffer + (lo - r.offset), w.data.data() + (lo - w.offset), hi - lo);
          covered = std::max(covered, hi - r.offset);
        }
      }
      if (covered < r.length) return Status::Corruption("short read of " + state_->name);
    }
    if ((env_->TakeArmed(env_->arm_flip_) || env_->Roll(env_->options_.bit_flip_probability)) &&
        r.length > 0) {
      uint64_t bit = env_->NextRandom() % (r.length * 8);
      r.buffer[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      env_->Record("bit flip " + state_->name + " @" + std::to_string(r.offset + bit / 8));
    }
    return Status::Ok();
  }

  Status DoWrite(IoRequest& r) {
    if (env_->crashed()) return Status::IOError("simulated crash");
    if (env_->no_space_.load() || env_->TakeArmed(env_->arm_enospc_) ||
        env_->Roll(env_->options_.write_enospc_probability)) {
      env_->Record("ENOSPC write " + state_->name + " @" + std::to_string(r.offset));
      return NoSpaceError("injected on " + state_->name);
    }
    std::lock_guard lock(state_->mu);
    state_->pending.push_back({r.offset, std::vector<uint8_t>(r.buffer, r.buffer + r.length)});
    env_->NoteWrite(state_.get());
    return Status::Ok();
  }

  FaultInjectionEnv* env_;
  std::shared_ptr<FaultInjectionEnv::DeviceState> state_;
};

}  // namespace

FaultInjectionEnv::FaultInjectionEnv(DeviceEnv* base, FaultOptions options)
    : options_(std::move(options)), base_(base), rng_(options_.seed) {
  if (!options_.log_path.empty()) {
    log_fd_ = ::open(options_.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  }
  Record("fault env seed=" + std::to_string(options_.seed));
}

FaultInjectionEnv::~FaultInjectionEnv() {
  if (log_fd_ >= 0) ::close(log_fd_);
}

StatusOr<std::shared_ptr<BlockDevice>> FaultInjectionEnv::Open(const std::string& name,
                                                               bool create) {
  if (crashed()) return Status::IOError("simulated crash");
  bool existed = false;
  {
    std::lock_guard lock(mu_);
    auto hidden = std::find(removed_unsynced_.begin(), removed_unsynced_.end(), name);
    if (hidden != removed_unsynced_.end()) {
      if (!create) return Status::NotFound("no device " + name);
      // Re-created after an unsynced remove: really remove the old one first.
      removed_unsynced_.erase(hidden);
      Status st = base_->Remove(name);
      (void)st;
    }
  }
  if (create) {
    auto names = base_->List();
    existed = names.ok() && std::binary_search(names->begin(), names->end(), name);
  }
  KVTIER_ASSIGN_OR_RETURN(auto base, base_->Open(name, create));
  if (create && !existed) {
    std::lock_guard lock(mu_);
    created_unsynced_.push_back(name);
  }
  auto state = std::make_shared<DeviceState>();
  state->name = name;
  state->base = std::move(base);
  {
    std::lock_guard lock(mu_);
    devices_.push_back(state);
  }
  return std::shared_ptr<BlockDevice>(std::make_shared<FaultDevice>(this, state));
}

StatusOr<std::vector<std::string>> FaultInjectionEnv::List() {
  if (crashed()) return Status::IOError("simulated crash");
  KVTIER_ASSIGN_OR_RETURN(auto names, base_->List());
  std::lock_guard lock(mu_);
  std::erase_if(names, [&](const std::string& n) {
    return std::find(removed_unsynced_.begin(), removed_unsynced_.end(), n) !=
           removed_unsynced_.end();
  });
  return names;
}

Status FaultInjectionEnv::Remove(const std::string& name) {
  if (crashed()) return Status::IOError("simulated crash");
  std::lock_guard lock(mu_);
  if (std::find(removed_unsynced_.begin(), removed_unsynced_.end(), name) !=
      removed_unsynced_.end()) {
    return Status::NotFound("no device " + name);
  }
  auto created = std::find(created_unsynced_.begin(), created_unsynced_.end(), name);
  if (created != created_unsynced_.end()) {
    // Never durable: gone either way.
    created_unsynced_.erase(created);
    return base_->Remove(name);
  }
  auto names = base_->List();
  if (!names.ok()) return names.status();
  if (!std::binary_search(names->begin(), names->end(), name)) {
    return Status::NotFound("no device " + name);
  }
  removed_unsynced_.push_back(name);
  return Status::Ok();
}

StatusOr<uint64_t> FaultInjectionEnv::FreeBytes() {
  if (crashed()) return Status::IOError("simulated crash");
  const uint64_t disk_bytes = disk_bytes_.load();
  if (disk_bytes == 0) return base_->FreeBytes();
  uint64_t used = other_bytes_.load();
  KVTIER_ASSIGN_OR_RETURN(auto names, List());
  for (const std::string& name : names) {
    auto dev = base_->Open(name, false);
    if (dev.ok()) used += (*dev)->Size();  // removed meanwhile: its space is free
  }
  return used >= disk_bytes ? 0 : disk_bytes - used;
}

Status FaultInjectionEnv::SyncDir() {
  if (crashed()) return Status::IOError("simulated crash");
  std::vector<std::string> removed;
  {
    std::lock_guard lock(mu_);
    created_unsynced_.clear();
    removed.swap(removed_unsynced_);
  }
  for (const std::string& name : removed) {
    Status st = base_->Remove(name);
    if (!st.ok() && !st.IsNotFound()) return st;
  }
  return base_->SyncDir();
}

void FaultInjectionEnv::PauseSyncs(bool paused) {
  {
    std::lock_guard lock(mu_);
    syncs_paused_ = paused;
  }
  sync_cv_.notify_all();
}

int FaultInjectionEnv::syncs_waiting() const {
  std::lock_guard lock(mu_);
  return syncs_waiting_;
}

void FaultInjectionEnv::WaitSyncsAllowed() {
  std::unique_lock lock(mu_);
  ++syncs_waiting_;
  sync_cv_.wait(lock, [&] { return !syncs_paused_ || crashed_.load(); });
  --syncs_waiting_;
}

bool FaultInjectionEnv::Roll(double p) {
  if (p <= 0.0) return false;
  std::lock_guard lock(mu_);
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < p;
}

uint64_t FaultInjectionEnv::NextRandom() {
  std::lock_guard lock(mu_);
  return rng_();
}

bool FaultInjectionEnv::TakeArmed(std::atomic<int>& counter) {
  int n = counter.load();
  while (n > 0) {
    if (counter.compare_exchange_weak(n, n - 1)) return true;
  }
  return false;
}

void FaultInjectionEnv::Record(const std::string& line) {
  injected_.fetch_add(1);
  std::lock_guard lock(mu_);
  log_.push_back(line);
  if (log_fd_ >= 0) {
    std::string l = line + "\n";
    ssize_t n = ::write(log_fd_, l.data(), l.size());
    (void)n;
  }
}

void FaultInjectionEnv::NoteWrite(DeviceState* state) {
  std::lock_guard lock(mu_);
  last_writer_ = state;
}

void FaultInjectionEnv::SimulateCrash() {
  std::vector<std::shared_ptr<DeviceState>> live;
  DeviceState* last = nullptr;
  std::vector<std::string> lost_entries;
  {
    std::lock_guard lock(mu_);
    crashed_.store(true);
    for (auto& w : devices_) {
      if (auto s = w.lock()) live.push_back(std::move(s));
    }
    last = last_writer_;
    lost_entries.swap(created_unsynced_);
    removed_unsynced_.clear();  // the removals never reached the disk: the devices stay
  }
  sync_cv_.notify_all();
  for (auto& s : live) {
    std::lock_guard lock(s->mu);
    if (s.get() == last && options_.torn_last_write && !s->pending.empty()) {
      // A sector-granular prefix of the most recent write reaches the media.
      auto& w = s->pending.back();
      size_t sectors = (w.data.size() + 511) / 512;
      size_t keep = static_cast<size_t>(NextRandom() % (sectors + 1)) * 512;
      keep = std::min(keep, w.data.size());
      if (keep > 0) {
        size_t a = s->base->Alignment();
        // Only whole aligned blocks can be written to an O_DIRECT base.
        if (a > 1) keep = (w.offset % a == 0) ? keep / a * a : 0;
        if (keep > 0) {
          AlignedBuffer buf = AllocateAligned(keep, std::max<size_t>(a, 1));
          std::memcpy(buf.get(), w.data.data(), keep);
          Status st = s->base->Write(w.offset, {buf.get(), keep});
          (void)st;
        }
      }
      Record("crash: torn last write of " + s->name + " @" + std::to_string(w.offset) + " kept " +
             std::to_string(keep) + "/" + std::to_string(w.data.size()) + " bytes");
    }
    Record("crash: dropped " + std::to_string(s->pending.size()) + " unsynced writes of " +
           s->name);
    s->pending.clear();
  }
  for (const std::string& name : lost_entries) {
    Status st = base_->Remove(name);
    (void)st;
    Record("crash: directory entry of " + name + " was never synced: device lost");
  }
}

std::vector<std::string> FaultInjectionEnv::Log() const {
  std::lock_guard lock(mu_);
  return log_;
}

}  // namespace kvtier::storage
