// The client's shared-memory ranges against a scripted fake daemon: a range named by a request
// that timed out is not handed to another request until the daemon's reply arrives (the daemon
// may still be writing into it), and is reused after; GET values the daemon wrote into the
// region reach the visitor exact wherever in the range they lie (the client copies them out
// of the region's file), and one outside the range (or whose end wraps past 2^64) fails the
// call; a region shorter than the daemon said, or not sealed against shrinking, is not mapped.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "cache_daemon/client.h"
#include "cache_daemon/wire.h"
#include "tests/cache_daemon/net_util.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;
using wire::Opcode;

struct Range {
  uint64_t offset = 0, capacity = 0;
};

// Value i of a served GET: Bytes(i) bytes of a pattern seeded by the key's first byte.
size_t Bytes(size_t i) { return 5216 + 13 * i; }
std::vector<uint8_t> Value(const wire::Key& key, size_t i) {
  std::vector<uint8_t> v(Bytes(i));
  uint32_t x = key[0] * 2654435761u + static_cast<uint32_t>(i);
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return v;
}
// A key whose value the fake places past the end of the GET's destination range.
constexpr uint8_t kOutsideKey = 0xEE;
// A key whose value the fake answers at offset 2^64 - 0x100, 0x200 bytes long: offset + length
// wraps to 0x100, inside any range by a check that adds them.
constexpr uint8_t kWrappingKey = 0xEF;
constexpr uint64_t kWrappingOffset = ~uint64_t{0} - 0xFF;
constexpr uint32_t kWrappingBytes = 0x200;

// The shared-memory region the fake passes at SHM_ATTACH: a memfd of file_bytes, answered as
// granted_bytes, sealed against resizing as kvtierd's is (docs/format/wire.md) when `sealed`.
// The default is a bit larger than granted: a value placed past the range still lands in the
// file.
struct Region {
  uint64_t file_bytes = 2u << 20;
  uint64_t granted_bytes = 1u << 20;
  bool sealed = true;
};

// Answers HELLO and SHM_ATTACH (with `region`); records every GET's destination range.
// Holding: answers the first two GETs only when a LOOKUP arrives (after the client gave up on
// them), then the LOOKUP, then every later GET at once, each key a miss. Serving: answers every
// GET at once, each key found, its value (Value) written into the region in reverse key order,
// the last one ending at the range's end. Either mode answers a PUT with every unit stored and
// records it.
class FakeDaemon {
 public:
  enum class Mode { kHolding, kServing };
  struct Put {
    bool shm = false;
    std::vector<std::vector<uint8_t>> inline_values;  // empty with shm
  };
  explicit FakeDaemon(std::string path, Mode mode = Mode::kHolding, Region region = {})
      : path_(std::move(path)), mode_(mode), region_(region) {
    listen_fd_ = kt::ListenUnix(path_, 1);
    EXPECT_GE(listen_fd_, 0) << path_;
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeDaemon() {
    ::shutdown(listen_fd_, SHUT_RDWR);
    if (conn_fd_ >= 0) ::shutdown(conn_fd_, SHUT_RDWR);
    thread_.join();
    if (conn_fd_ >= 0) ::close(conn_fd_);
    if (memfd_ >= 0) ::close(memfd_);
    ::close(listen_fd_);
    ::unlink(path_.c_str());
  }
  std::vector<Range> gets() {
    std::lock_guard<std::mutex> lock(mu_);
    return gets_;
  }
  std::vector<Put> puts() {
    std::lock_guard<std::mutex> lock(mu_);
    return puts_;
  }

 private:
  void Reply(const wire::FrameHeader& req, const std::function<void(wire::Writer*)>& fill,
             int fd = -1) {
    wire::Writer w;
    wire::EncodeStatus(Status::Ok(), &w);
    if (fill) fill(&w);
    std::vector<uint8_t> body = w.Take();
    auto frame = wire::BuildFrame(req.opcode | wire::kResponseBit, req.flags, req.request_id, body);
    msghdr msg{};
    iovec iov{frame.data(), frame.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ASSERT_EQ(::sendmsg(conn_fd_, &msg, MSG_NOSIGNAL), static_cast<ssize_t>(frame.size()));
  }

  void GetReply(const wire::FrameHeader& req, size_t keys) {
    Reply(req, [&](wire::Writer* w) {
      w->U16(static_cast<uint16_t>(keys));
      for (size_t i = 0; i < keys; ++i) {
        w->U8(static_cast<uint8_t>(StatusCode::kNotFound));
        w->U8(0);
        w->U32(0);
      }
    });
  }

  void ServeValues(const wire::FrameHeader& req, const wire::GetRequest& get) {
    const size_t n = get.keys.size();
    std::vector<uint64_t> offsets(n);
    std::vector<uint32_t> bytes(n);
    uint64_t end = get.dst_offset + get.dst_capacity;
    for (size_t i = 0; i < n; ++i) {  // reverse order, packed against the range's end
      bytes[i] = static_cast<uint32_t>(Bytes(i));
      end -= Bytes(i);
      offsets[i] = end;
    }
    for (size_t i = 0; i < n; ++i) {
      if (get.keys[i][0] == kOutsideKey) offsets[i] = get.dst_offset + get.dst_capacity;
      if (get.keys[i][0] == kWrappingKey) {
        offsets[i] = kWrappingOffset;
        bytes[i] = kWrappingBytes;
        continue;  // nothing written: no file holds that offset
      }
      const std::vector<uint8_t> v = Value(get.keys[i], i);
      ASSERT_EQ(::pwrite(memfd_, v.data(), v.size(), static_cast<off_t>(offsets[i])),
                static_cast<ssize_t>(v.size()));
    }
    Reply(req, [&](wire::Writer* w) {
      w->U16(static_cast<uint16_t>(n));
      for (size_t i = 0; i < n; ++i) {
        w->U8(static_cast<uint8_t>(StatusCode::kOk));
        w->U8(2);
        w->U32(bytes[i]);
        w->U64(offsets[i]);
      }
    });
  }

  void Serve() {
    conn_fd_ = ::accept(listen_fd_, nullptr, nullptr);
    if (conn_fd_ < 0) return;
    wire::FrameParser parser(1u << 30);
    std::vector<std::pair<wire::FrameHeader, size_t>> held;
    for (;;) {
      wire::Frame f;
      StatusOr<bool> got = parser.Next(&f);
      if (!got.ok()) return;
      if (!*got) {
        uint8_t buf[65536];
        ssize_t n = ::recv(conn_fd_, buf, sizeof(buf), 0);
        if (n <= 0) return;
        parser.Append(std::span<const uint8_t>(buf, static_cast<size_t>(n)));
        continue;
      }
      switch (static_cast<Opcode>(f.header.opcode)) {
        case Opcode::kHello:
          Reply(f.header, [](wire::Writer* w) {
            wire::HelloResponse r;
            r.max_frame_bytes = 1u << 26;
            r.max_inflight = 64;
            r.max_batch_keys = 4096;
            r.tenant_name = "default";
            wire::EncodeHelloResponse(r, w);
          });
          break;
        case Opcode::kShmAttach: {
          memfd_ = ::memfd_create("fake-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
          ASSERT_EQ(::ftruncate(memfd_, static_cast<off_t>(region_.file_bytes)), 0);
          if (region_.sealed) {
            ASSERT_EQ(::fcntl(memfd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
          }
          Reply(
              f.header, [this](wire::Writer* w) { w->U64(region_.granted_bytes); }, memfd_);
          break;
        }
        case Opcode::kPut: {
          const bool shm = (f.header.flags & wire::kFlagShm) != 0;
          auto req = wire::DecodePut(f.body, shm);
          ASSERT_TRUE(req.ok()) << req.status().ToString();
          Put put;
          put.shm = shm;
          for (const auto& u : req->units) {
            if (!shm) put.inline_values.emplace_back(u.value.begin(), u.value.end());
          }
          {
            std::lock_guard<std::mutex> lock(mu_);
            puts_.push_back(std::move(put));
          }
          Reply(f.header, [&](wire::Writer* w) {
            w->U16(static_cast<uint16_t>(req->units.size()));
            for (size_t i = 0; i < req->units.size(); ++i) {
              w->U8(static_cast<uint8_t>(StatusCode::kOk));
            }
          });
          break;
        }
        case Opcode::kGet: {
          auto req = wire::DecodeGet(f.body, (f.header.flags & wire::kFlagShm) != 0);
          ASSERT_TRUE(req.ok());
          size_t n = 0;
          {
            std::lock_guard<std::mutex> lock(mu_);
            gets_.push_back({req->dst_offset, req->dst_capacity});
            n = gets_.size();
          }
          if (mode_ == Mode::kServing) {
            ServeValues(f.header, *req);
            break;
          }
          if (n <= 2) {
            held.emplace_back(f.header, req->keys.size());
          } else {
            GetReply(f.header, req->keys.size());
          }
          break;
        }
        case Opcode::kLookup:
          for (auto& [h, keys] : held) GetReply(h, keys);  // late replies first, in order
          held.clear();
          Reply(f.header, [](wire::Writer* w) { wire::EncodeLookupReply({}, w); });
          break;
        default:
          return;
      }
    }
  }

  std::string path_;
  Mode mode_;
  Region region_;
  int listen_fd_ = -1, conn_fd_ = -1, memfd_ = -1;
  std::thread thread_;
  std::mutex mu_;
  std::vector<Range> gets_;  // protected by mu_
  std::vector<Put> puts_;    // protected by mu_
};

bool Overlap(const Range& a, const Range& b) {
  return a.offset < b.offset + b.capacity && b.offset < a.offset + a.capacity;
}

TEST(ClientShmTest, TimedOutRangeIsNotReusedUntilTheReplyArrives) {
  std::string path = (std::filesystem::temp_directory_path() /
                      ("kvtier_client_shm_" + std::to_string(getpid()) + ".sock"))
                         .string();
  FakeDaemon fake(path);
  ClientOptions o;
  o.socket_path = path;
  o.shm_bytes = 1u << 20;
  o.timeout_ms = 200;
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*c)->shm_attached());
  std::vector<wire::Key> key(1);
  std::vector<std::vector<uint8_t>> values;
  std::vector<bool> found;
  EXPECT_FALSE((*c)->GetCopy(key, &values, &found).ok());  // times out
  EXPECT_FALSE((*c)->GetCopy(key, &values, &found).ok());  // times out
  // The fake answers both GETs, then this LOOKUP: once it returns, the reader has seen them.
  ASSERT_TRUE((*c)->Lookup(key).ok());
  ASSERT_TRUE((*c)->GetCopy(key, &values, &found).ok());
  std::vector<Range> g = fake.gets();
  ASSERT_EQ(g.size(), 3u);
  ASSERT_GT(g[0].capacity, 0u) << "the GETs must use shared memory";
  EXPECT_FALSE(Overlap(g[0], g[1]))
      << "a range of a timed-out GET was handed out again: [" << g[0].offset << ", +"
      << g[0].capacity << ") and [" << g[1].offset << ", +" << g[1].capacity << ")";
  EXPECT_EQ(g[2].offset, g[0].offset) << "the range is free again once its reply arrived";
}

std::string SocketPath(const char* name) {
  return (std::filesystem::temp_directory_path() /
          (std::string(name) + std::to_string(getpid()) + ".sock"))
      .string();
}

TEST(ClientShmTest, GetValuesAreTheBytesTheDaemonWroteWhereverTheyLie) {
  const std::string path = SocketPath("kvtier_client_shm_values_");
  FakeDaemon fake(path, FakeDaemon::Mode::kServing);
  ClientOptions o;
  o.socket_path = path;
  o.shm_bytes = 1u << 20;
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*c)->shm_attached());
  // Twice: the second GET reuses the range (and the thread's copy of it).
  for (int round = 0; round < 2; ++round) {
    std::vector<wire::Key> keys(40);
    for (size_t i = 0; i < keys.size(); ++i) keys[i][0] = static_cast<uint8_t>(i + 10 * round);
    std::vector<int> seen(keys.size(), 0);
    ASSERT_TRUE((*c)->Get(keys,
                          [&](size_t i, const GetItem& g) {
                            ASSERT_LT(i, keys.size());
                            ++seen[i];
                            ASSERT_TRUE(g.status.ok()) << i;
                            EXPECT_EQ(g.tier, 2);
                            const std::vector<uint8_t> want = Value(keys[i], i);
                            ASSERT_EQ(g.value.size(), want.size()) << i;
                            EXPECT_TRUE(std::equal(want.begin(), want.end(), g.value.begin()))
                                << "value " << i << " differs from what the daemon wrote";
                          })
                    .ok());
    EXPECT_EQ(seen, std::vector<int>(keys.size(), 1));
  }
  std::vector<Range> g = fake.gets();
  ASSERT_EQ(g.size(), 2u);
  ASSERT_GT(g[0].capacity, 0u) << "the GETs must use shared memory";
}

TEST(ClientShmTest, AValueOutsideTheRangeFailsTheGet) {
  const std::string path = SocketPath("kvtier_client_shm_outside_");
  FakeDaemon fake(path, FakeDaemon::Mode::kServing);
  ClientOptions o;
  o.socket_path = path;
  o.shm_bytes = 1u << 20;
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  std::vector<wire::Key> keys(3);
  keys[0][0] = 1;
  keys[1][0] = kOutsideKey;
  keys[2][0] = 3;
  size_t visited = 0;
  Status st = (*c)->Get(keys, [&](size_t, const GetItem&) { ++visited; });
  EXPECT_TRUE(st.IsCorruption()) << st.ToString();
  EXPECT_EQ(visited, 1u) << "the value before the bad one is visited, none after";
}

// A value whose offset + length wraps past 2^64 passed the bounds check (the sum landed inside
// the range) and the visitor got a pointer ~2^64 bytes off the region. Now: Corruption, and
// no visitor sees it.
TEST(ClientShmTest, AValueWhoseEndWrapsFailsTheGet) {
  const std::string path = SocketPath("kvtier_client_shm_wrap_");
  FakeDaemon fake(path, FakeDaemon::Mode::kServing);
  ClientOptions o;
  o.socket_path = path;
  o.shm_bytes = 1u << 20;
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE((*c)->shm_attached()) << (*c)->shm_status().ToString();
  // Alone, and after a good value (the client then copies the good ones out of the file).
  for (bool after_good : {false, true}) {
    std::vector<wire::Key> keys(after_good ? 3 : 1);
    keys[0][0] = kWrappingKey;
    if (after_good) {
      keys[0][0] = 1;
      keys[1][0] = kWrappingKey;
      keys[2][0] = 3;
    }
    std::vector<size_t> visited;
    Status st = (*c)->Get(keys, [&](size_t i, const GetItem& g) {
      visited.push_back(i);
      EXPECT_NE(g.value.size(), kWrappingBytes) << "the wrapping value reached the visitor";
    });
    EXPECT_TRUE(st.IsCorruption()) << st.ToString();
    EXPECT_EQ(visited, after_good ? std::vector<size_t>{0} : std::vector<size_t>{});
  }
}

// The daemon's SHM_ATTACH reply is checked against the descriptor before the client maps it:
// a region shorter than granted (a 4 KiB memfd answered as 1 GiB: mapped at 1 GiB, the next
// PUT's copy into it died of SIGBUS) or one that could still be shrunk is refused with
// Corruption, and the connection carries values over the socket.
TEST(ClientShmTest, ARegionThatIsNotWhatTheDaemonSaidIsRefused) {
  const Region kRegions[] = {
      {.file_bytes = 4096, .granted_bytes = 1ull << 30, .sealed = true},
      {.file_bytes = 2u << 20, .granted_bytes = 1u << 20, .sealed = false},
  };
  for (const Region& region : kRegions) {
    SCOPED_TRACE("file " + std::to_string(region.file_bytes) + " bytes, granted " +
                 std::to_string(region.granted_bytes) + (region.sealed ? ", sealed" : ""));
    const std::string path = SocketPath("kvtier_client_shm_region_");
    FakeDaemon fake(path, FakeDaemon::Mode::kServing, region);
    ClientOptions o;
    o.socket_path = path;
    o.shm_bytes = region.granted_bytes;
    auto c = Client::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_TRUE((*c)->shm_status().IsCorruption()) << (*c)->shm_status().ToString();
    ASSERT_FALSE((*c)->shm_attached()) << "a region that is not what the daemon said was mapped";
    // 64 KiB: past the 4 KiB file's end, had it been mapped.
    std::vector<uint8_t> value(64u << 10);
    for (size_t i = 0; i < value.size(); ++i) value[i] = static_cast<uint8_t>(i * 7);
    std::vector<PutUnit> units = {{wire::Key{}, wire::Key{}, value}};
    auto r = (*c)->Put(units, PutOptions{});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->size(), 1u);
    EXPECT_TRUE((*r)[0].ok()) << (*r)[0].ToString();
    std::vector<FakeDaemon::Put> puts = fake.puts();
    ASSERT_EQ(puts.size(), 1u);
    EXPECT_FALSE(puts[0].shm);
    ASSERT_EQ(puts[0].inline_values.size(), 1u);
    EXPECT_EQ(puts[0].inline_values[0], value);
  }
}

// The region kvtierd's way (sealed, at least as large as granted) is mapped.
TEST(ClientShmTest, ASealedRegionOfTheGrantedSizeIsAttached) {
  const std::string path = SocketPath("kvtier_client_shm_sealed_");
  FakeDaemon fake(path, FakeDaemon::Mode::kServing,
                  {.file_bytes = 1u << 20, .granted_bytes = 1u << 20, .sealed = true});
  ClientOptions o;
  o.socket_path = path;
  o.shm_bytes = 1u << 20;
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE((*c)->shm_attached());
  EXPECT_TRUE((*c)->shm_status().ok()) << (*c)->shm_status().ToString();
}

}  // namespace
}  // namespace kvtier::daemon
