// A fuzzer of kvtierd's native session state machine, against the real binary: seeded random
// sequences of valid and corrupted frames (HELLO, AUTH good/bad, SHM_ATTACH, PUT/GET with and
// without the shm flag, LOOKUP, DELETE, unknown opcodes, oversized headers, flipped bytes,
// truncated frames, pipelined bursts, closes mid-frame, a shrink attempt on the memfd) over
// Unix and TCP connections. After every sequence the daemon must be alive and answer a probe.
//
// Default run (label e2e): a few dozen sequences. KVTIER_SESSION_FUZZ_SLOW (label slow): many.
// KVTIER_FUZZ_SEED=<n> in the environment replays another seed; a failure prints its seed.
#include <gtest/gtest.h>

#include <random>

#include "cache_daemon/client.h"
#include "common/key_spec.h"
#include "tests/e2e/kvtierd_process.h"
#include "tests/e2e/raw_native.h"

namespace kvtier::daemon {
namespace {

namespace kt = kvtier::testing;
using wire::Key;
using wire::Opcode;

#ifdef KVTIER_SESSION_FUZZ_SLOW
constexpr int kSequences = 5000;
#else
constexpr int kSequences = 200;
#endif
constexpr int kStepsMax = 24;

class Fuzzer {
 public:
  Fuzzer(uint64_t seed, const std::string& socket, uint16_t tcp_port)
      : rng_(seed), socket_(socket), tcp_port_(tcp_port) {}

  // One connection's worth of random traffic.
  // What the run exercised, for the log.
  std::string Summary() const {
    std::string out = "frames built " + std::to_string(frames_) + ", replies by code:";
    for (size_t c = 0; c < replies_.size(); ++c) out += " " + std::to_string(replies_[c]);
    return out;
  }

  void Sequence() {
    conn_ = Pick(4) == 0 ? kt::RawNative::Tcp(tcp_port_) : kt::RawNative::Unix(socket_);
    if (!conn_.ok()) return;
    ::fcntl(conn_.fd(), F_SETFL, O_NONBLOCK);
    shm_bytes_ = 0;
    // Most sequences start authenticated (often with shared memory), so the states after
    // HELLO are reached as often as the refusals before it.
    if (Pick(10) < 7) {
      wire::HelloRequest h;
      h.token = Pick(2) == 0 ? "alice-token" : "bob-token";
      Send(Frame(Opcode::kHello, wire::EncodeHello(h)));
      if (Pick(2) == 0) Send(Frame(Opcode::kShmAttach, wire::EncodeShmAttach(1u << 20)));
      Drain(200);
    }
    int steps = 1 + Pick(kStepsMax);
    for (int i = 0; i < steps && alive_; ++i) Step();
    if (shm_fd_ >= 0) ::close(shm_fd_);
    shm_fd_ = -1;
    conn_.Close();
    alive_ = true;
  }

 private:
  uint32_t Pick(uint32_t n) { return static_cast<uint32_t>(rng_() % n); }
  Key RandomKey() {
    Key k{};
    k[0] = static_cast<uint8_t>(Pick(8));  // a small key space: GETs find PUTs
    return k;
  }
  std::vector<uint8_t> RandomBytes(size_t n) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(rng_());
    return v;
  }
  std::string Token() {
    switch (Pick(4)) {
      case 0:
        return "alice-token";
      case 1:
        return "bob-token";
      case 2:
        return "";
      default:
        return "wrong";
    }
  }
  uint64_t ShmOffset() {
    return Pick(3) == 0 ? rng_() : Pick(static_cast<uint32_t>(shm_bytes_ + 1));
  }

  std::vector<uint8_t> Frame(Opcode op, std::span<const uint8_t> body, uint16_t flags = 0) {
    ++frames_;
    return wire::BuildFrame(static_cast<uint8_t>(op), flags, ++id_, body);
  }

  std::vector<uint8_t> RandomFrame() {
    switch (Pick(11)) {
      case 0: {
        wire::HelloRequest h;
        h.token = Token();
        h.unit_tokens = Pick(64);
        return Frame(Opcode::kHello, wire::EncodeHello(h));
      }
      case 1:
        return Frame(Opcode::kAuth, wire::EncodeAuth(Token()));
      case 2:
        return Frame(Opcode::kShmAttach,
                     wire::EncodeShmAttach(Pick(4) == 0 ? rng_() : Pick(4u << 20)));
      case 3: {
        auto v = RandomBytes(Pick(3) == 0 ? Pick(256u << 10) : Pick(4096));
        return Frame(Opcode::kPut, kt::PutBody(RandomKey(), v));
      }
      case 4: {
        // Only the length goes on the wire (the bytes are in the region).
        static const std::vector<uint8_t> kSizes(8u << 20);
        std::span<const uint8_t> v(kSizes.data(),
                                   Pick(3) == 0 ? rng_() % kSizes.size() : Pick(8192));
        return Frame(Opcode::kPut, kt::PutBody(RandomKey(), v, true, ShmOffset()), wire::kFlagShm);
      }
      case 5:
        return Frame(Opcode::kGet, kt::GetBody(RandomKey()));
      case 6:
        return Frame(Opcode::kGet, kt::GetBody(RandomKey(), true, ShmOffset(), ShmOffset()),
                     wire::kFlagShm);
      case 7: {
        std::vector<Key> keys(Pick(5), RandomKey());
        return Frame(Opcode::kLookup, wire::EncodeKeys(keys));
      }
      case 8: {
        wire::DeleteRequest d;
        d.scope = static_cast<uint8_t>(Pick(8) == 0);
        if (d.scope == 0) d.keys = {RandomKey()};
        return Frame(Opcode::kDelete, wire::EncodeDelete(d));
      }
      case 9:  // any opcode, random body
        return wire::BuildFrame(static_cast<uint8_t>(rng_()), static_cast<uint16_t>(Pick(4)), ++id_,
                                RandomBytes(Pick(512)));
      default: {  // a header announcing a huge frame
        auto h = wire::EncodeHeader(static_cast<uint8_t>(Opcode::kPut), 0, ++id_,
                                    static_cast<uint32_t>(rng_()));
        return std::vector<uint8_t>(h.begin(), h.end());
      }
    }
  }

  void Step() {
    std::vector<uint8_t> bytes;
    int burst = Pick(4) == 0 ? 2 + Pick(8) : 1;
    for (int i = 0; i < burst; ++i) {
      auto f = RandomFrame();
      bytes.insert(bytes.end(), f.begin(), f.end());
    }
    switch (Pick(8)) {
      case 0:  // flip a few bytes anywhere (header included)
        for (uint32_t i = 0, n = 1 + Pick(4); i < n; ++i)
          bytes[Pick(bytes.size())] ^= 1 + Pick(255);
        break;
      case 1:  // truncate, then close mid-frame
        bytes.resize(Pick(bytes.size()));
        Send(bytes);
        alive_ = false;
        return;
      default:
        break;
    }
    Send(bytes);
    Drain(Pick(3) == 0 ? 20 : 0);
    if (shm_fd_ >= 0 && Pick(4) == 0) {
      (void)::ftruncate(shm_fd_, 0);  // must fail: the region is sealed
    }
  }

  // Sends what the daemon takes within a short time; a daemon that stopped reading (limits)
  // or closed ends the sequence.
  void Send(const std::vector<uint8_t>& bytes) {
    size_t off = 0;
    for (int spins = 0; off < bytes.size() && spins < 20; ++spins) {
      ssize_t k = ::send(conn_.fd(), bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (k > 0) {
        off += static_cast<size_t>(k);
        continue;
      }
      if (k < 0 && errno != EAGAIN) break;
      Drain(5);
    }
    if (off < bytes.size()) alive_ = false;
  }

  // Reads replies for up to wait_ms, keeping a memfd if one arrives.
  void Drain(int wait_ms) {
    for (;;) {
      auto r = conn_.Read(wait_ms);
      if (!r) return;
      ++replies_[std::min<size_t>(static_cast<size_t>(r->code), replies_.size() - 1)];
      if (r->fd >= 0) {
        if (shm_fd_ >= 0) ::close(shm_fd_);
        shm_fd_ = r->fd;
        shm_bytes_ = 1u << 20;
      }
      wait_ms = 0;
    }
  }

  std::mt19937_64 rng_;
  uint64_t frames_ = 0;                 // well-formed frames built (before any corruption)
  std::array<uint64_t, 11> replies_{};  // replies read, by status code
  std::string socket_;
  uint16_t tcp_port_;
  kt::RawNative conn_;
  uint64_t id_ = 0;
  int shm_fd_ = -1;
  uint64_t shm_bytes_ = 0;
  bool alive_ = true;
};

TEST(SessionFuzzTest, DaemonSurvivesRandomFrameSequences) {
  auto dir =
      std::filesystem::temp_directory_path() / ("kvtier_session_fuzz_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  kt::KvtierdProcess d(dir);
  std::ofstream(dir / "tokens.toml")
      << "[[tenant]]\nname = \"alice\"\nid = 1\ntoken_sha256 = [\"" << TokenSha256Hex("alice-token")
      << "\"]\n[[tenant]]\nname = \"bob\"\nid = 2\ntoken_sha256 = [\""
      << TokenSha256Hex("bob-token") << "\"]\n";
  uint16_t native_port = kt::FreePort();
  d.WriteConfig("[server]\nnative_port = " + std::to_string(native_port) +
                "\n[auth]\ntokens_file = \"" + (dir / "tokens.toml").string() +
                "\"\n[storage]\ndram_capacity_bytes = 16777216\nssd_capacity_bytes = 0\n"
                "[limits]\nframe_timeout_ms = 500\nidle_timeout_ms = 2000\n"
                "reply_queue_bytes_max = 4194304\nshm_max_bytes = 1048576\n");
  ASSERT_TRUE(d.Start());
  uint64_t seed = 20261201;
  if (const char* s = std::getenv("KVTIER_FUZZ_SEED")) seed = std::strtoull(s, nullptr, 10);
  Fuzzer fuzz(seed, d.socket(), native_port);
  for (int seq = 0; seq < kSequences; ++seq) {
    fuzz.Sequence();
    ASSERT_TRUE(d.Alive()) << "kvtierd died (wait status " << d.exit_status() << ") in sequence "
                           << seq << " of seed " << seed << "\n"
                           << d.Log();
    ClientOptions o;
    o.socket_path = d.socket();
    o.token = "bob-token";
    o.shm_bytes = 0;
    o.timeout_ms = 10000;
    auto probe = Client::Connect(o);
    ASSERT_TRUE(probe.ok()) << "sequence " << seq << " of seed " << seed << ": "
                            << probe.status().ToString();
    ASSERT_TRUE((*probe)->Lookup(std::vector<Key>{Key{}}).ok())
        << "sequence " << seq << " of seed " << seed;
  }
  std::fprintf(stderr, "seed %llu, %d sequences: %s\n", static_cast<unsigned long long>(seed),
               kSequences, fuzz.Summary().c_str());
  EXPECT_EQ(d.Stop(), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvtier::daemon
