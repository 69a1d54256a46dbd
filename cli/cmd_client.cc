// Client subcommands against a running kvtierd, through the client library only:
//   kvtier stats | lookup | put-file | get-file | policy get|set | drain
// Human output by default, --json for scripts. Connection flags are shared: --socket PATH
// (default: kvtierd's default socket), --tcp-port N (native TCP), --host, --token, and for
// a TLS native port --tls [--tls-ca FILE] [--tls-server-name NAME].
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cache_daemon/client.h"
#include "cli/commands.h"
#include "cli/daemon_reply.h"
#include "cli/flags.h"
#include "common/key_spec.h"

namespace kvtier::cli {
namespace {

using daemon::Client;
using daemon::ClientOptions;
using daemon::wire::Key;

constexpr char kManifestMagic[4] = {'K', 'V', 'T', 'F'};
// put-file refuses files with more units than this (one manifest must fit in a value).
constexpr uint64_t kMaxFileUnits = 1u << 20;

struct Conn {
  std::string socket = daemon::DefaultSocketPath();
  std::string host = "127.0.0.1";
  uint64_t tcp_port = 0;
  std::string token;
  bool tls = false;
  std::string tls_ca, tls_server_name;
  bool json = false;
  void Register(FlagSet* f) {
    f->String("socket", &socket, "PATH", "kvtierd native Unix socket");
    f->String("host", &host, "HOST", "kvtierd host for --tcp-port");
    f->Uint("tcp-port", &tcp_port, "native protocol TCP port (0: use --socket)");
    f->Bool("tls", &tls, "TLS on --tcp-port (kvtierd [tls] native = true)");
    f->String("tls-ca", &tls_ca, "FILE", "PEM CA file for --tls (default: system trust store)");
    f->String("tls-server-name", &tls_server_name, "NAME",
              "name the daemon's certificate must carry (default: --host)");
    f->String("token", &token, "TOKEN", "auth token (default: $KVTIER_TOKEN)");
    f->Bool("json", &json, "print JSON instead of text");
  }
  StatusOr<std::unique_ptr<Client>> Connect() const {
    ClientOptions o;
    o.socket_path = socket;
    o.tcp_host = host;
    if (tcp_port > 65535) return Status::InvalidArgument("--tcp-port out of range");
    o.tcp_port = static_cast<uint16_t>(tcp_port);
    if (tls && o.tcp_port == 0) return Status::InvalidArgument("--tls needs --tcp-port");
    o.tls = tls;
    o.tls_ca_file = tls_ca;
    o.tls_server_name = tls_server_name;
    o.token = token;
    if (o.token.empty()) {
      if (const char* t = std::getenv("KVTIER_TOKEN")) o.token = t;
    }
    return Client::Connect(o);
  }
};

int Fail(const Status& st) {
  std::fprintf(stderr, "kvtier: %s\n", st.ToString().c_str());
  return 1;
}

const char* ReasonText(uint8_t r) {
  static const char* kNames[] = {"none",    "never_stored",     "evicted",
                                 "expired", "checksum_failure", "io_error"};
  return r < 6 ? kNames[r] : "unknown";
}

Key ManifestKey(const std::string& name) {
  std::string pre = std::string("kvtier.cli.manifest") + '\0' + name;
  return Sha256(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(pre.data()), pre.size()));
}

// chain_i = SHA256("kvtier.cli.file" \0 || chain_{i-1} || bytes of unit i).
Key FileUnitKey(const Key& parent, std::span<const uint8_t> chunk) {
  std::vector<uint8_t> pre;
  std::string tag = std::string("kvtier.cli.file") + '\0';
  pre.insert(pre.end(), tag.begin(), tag.end());
  pre.insert(pre.end(), parent.begin(), parent.end());
  pre.insert(pre.end(), chunk.begin(), chunk.end());
  return Sha256(pre);
}

struct Manifest {
  uint64_t file_bytes = 0;
  uint32_t unit_bytes = 0;
  Digest file_sha256{};
  std::vector<Key> keys;
};

std::vector<uint8_t> EncodeManifest(const Manifest& m) {
  daemon::wire::Writer w;
  // The exact size: one allocation (and GCC 12's -O2 TSan build sees no insert into an empty
  // vector, which it misreads as a write past a zero-sized region).
  w.buffer().reserve(4 + 8 + 4 + 4 + m.file_sha256.size() + m.keys.size() * sizeof(Key));
  w.Bytes(std::string_view(kManifestMagic, 4));
  w.U64(m.file_bytes);
  w.U32(m.unit_bytes);
  w.U32(static_cast<uint32_t>(m.keys.size()));
  w.KeyBytes(m.file_sha256);
  for (const Key& k : m.keys) w.KeyBytes(k);
  return w.Take();
}

StatusOr<Manifest> DecodeManifest(std::span<const uint8_t> b) {
  daemon::wire::Reader r(b);
  Manifest m;
  std::span<const uint8_t> magic;
  uint32_t count = 0;
  if (!r.Bytes(4, &magic) || std::memcmp(magic.data(), kManifestMagic, 4) != 0 ||
      !r.U64(&m.file_bytes) || !r.U32(&m.unit_bytes) || !r.U32(&count) ||
      !r.KeyBytes(&m.file_sha256) || count > kMaxFileUnits || r.remaining() != count * 32ull) {
    return Status::Corruption("not a put-file manifest");
  }
  m.keys.resize(count);
  for (Key& k : m.keys) (void)r.KeyBytes(&k);
  return m;
}

StatusOr<Manifest> FetchManifest(Client* c, const std::string& name) {
  std::vector<std::vector<uint8_t>> v;
  std::vector<bool> found;
  KVTIER_RETURN_IF_ERROR(c->GetCopy(std::vector<Key>{ManifestKey(name)}, &v, &found));
  if (!found[0]) return Status::NotFound("no file named '" + name + "' in this tenant");
  return DecodeManifest(v[0]);
}

}  // namespace

int RunStats(Args args) {
  Conn conn;
  FlagSet f("kvtier stats", "Tier occupancy, hits, misses and tenant bytes of a running kvtierd.");
  conn.Register(&f);
  if (int rc = f.Parse(args); rc >= 0) return rc;
  auto c = conn.Connect();
  if (!c.ok()) return Fail(c.status());
  auto s = (*c)->StatsJson();
  if (!s.ok()) return Fail(s.status());
  if (conn.json) {
    std::printf("%s\n", s->c_str());
    return 0;
  }
  auto text = FormatStats(*s);
  if (!text.ok()) return Fail(text.status());
  std::fputs(text->c_str(), stdout);
  return 0;
}

int RunLookup(Args args) {
  Conn conn;
  std::string name;
  std::vector<std::string> hex;
  FlagSet f("kvtier lookup",
            "Longest cached prefix of a key chain: the units of a put-file name, or hex keys.");
  conn.Register(&f);
  f.String("name", &name, "NAME", "look up the chain stored by `kvtier put-file --name`");
  f.Positional(&hex, "[KEY_HEX...]", "chain keys, 64 hex characters each");
  if (int rc = f.Parse(args); rc >= 0) return rc;
  std::vector<Key> chain;
  for (const std::string& h : hex) {
    auto d = DigestFromHex(h);
    if (!d.ok()) return Fail(d.status());
    chain.push_back(*d);
  }
  auto c = conn.Connect();
  if (!c.ok()) return Fail(c.status());
  if (!name.empty()) {
    auto m = FetchManifest(c->get(), name);
    if (!m.ok()) return Fail(m.status());
    chain = m->keys;
  }
  if (chain.empty()) {
    std::fprintf(stderr, "kvtier lookup: give --name or keys\n");
    return 2;
  }
  auto r = (*c)->Lookup(chain);
  if (!r.ok()) return Fail(r.status());
  if (conn.json) {
    nlohmann::json tiers = nlohmann::json::array();
    for (uint8_t t : r->tiers) tiers.push_back(daemon::wire::TierName(t));
    std::printf("%s\n",
                nlohmann::json{{"keys", chain.size()},
                               {"hit_count", r->hit_count},
                               {"tiers", tiers},
                               {"first_miss",
                                r->hit_count < chain.size() ? ReasonText(r->first_miss) : "none"}}
                    .dump()
                    .c_str());
    return 0;
  }
  std::printf("hit %zu of %zu units\n", r->hit_count, chain.size());
  size_t per_tier[3] = {0, 0, 0};
  for (uint8_t t : r->tiers) {
    if (t < 3) ++per_tier[t];
  }
  std::printf("tiers: hbm=%zu dram=%zu ssd=%zu\n", per_tier[0], per_tier[1], per_tier[2]);
  if (r->hit_count < chain.size()) {
    std::printf("first miss at unit %zu: %s\n", r->hit_count, ReasonText(r->first_miss));
  }
  return 0;
}

int RunPutFile(Args args) {
  Conn conn;
  std::string file, name, tier = "dram";
  uint64_t unit_bytes = 57000;
  FlagSet f("kvtier put-file",
            "Store a file as a chain of units (an operator's smoke test); get-file reads it back.");
  conn.Register(&f);
  f.String("file", &file, "PATH", "file to store", true);
  f.String("name", &name, "NAME", "name to store it under (default: the path)");
  f.Uint("unit-bytes", &unit_bytes, "bytes per unit (57000: one miniature 256-token unit)");
  f.String("tier", &tier, "TIER", "highest tier: dram or ssd");
  if (int rc = f.Parse(args); rc >= 0) return rc;
  if (name.empty()) name = file;
  if (unit_bytes == 0 || unit_bytes > (64u << 20)) {
    return Fail(Status::InvalidArgument("--unit-bytes must be 1..64 MiB"));
  }
  if (tier != "dram" && tier != "ssd") return Fail(Status::InvalidArgument("--tier dram|ssd"));
  std::ifstream in(file, std::ios::binary);
  if (!in) return Fail(Status::IOError("cannot read " + file));
  std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), {});
  Manifest m;
  m.file_bytes = data.size();
  m.unit_bytes = static_cast<uint32_t>(unit_bytes);
  m.file_sha256 = Sha256(data);
  std::vector<daemon::PutUnit> units;
  Key parent{};
  for (uint64_t off = 0; off < data.size(); off += unit_bytes) {
    std::span<const uint8_t> chunk(data.data() + off,
                                   std::min<uint64_t>(unit_bytes, data.size() - off));
    Key k = FileUnitKey(parent, chunk);
    units.push_back({k, parent, chunk});
    m.keys.push_back(k);
    parent = k;
  }
  if (m.keys.size() > kMaxFileUnits) return Fail(Status::InvalidArgument("file too large"));
  auto c = conn.Connect();
  if (!c.ok()) return Fail(c.status());
  daemon::PutOptions po;
  po.highest_tier = tier == "ssd" ? 2 : 1;
  auto r = (*c)->Put(units, po);
  if (!r.ok()) return Fail(r.status());
  size_t stored = 0;
  Status first;
  for (const Status& s : *r) {
    if (s.ok())
      ++stored;
    else if (first.ok())
      first = s;
  }
  if (stored != units.size()) {
    return Fail(Status(first.code(), std::to_string(units.size() - stored) + " of " +
                                         std::to_string(units.size()) + " units not stored"));
  }
  std::vector<uint8_t> manifest = EncodeManifest(m);
  daemon::PutOptions mo;
  mo.kind = 2;  // blob
  auto mr = (*c)->Put(std::vector<daemon::PutUnit>{{ManifestKey(name), {}, manifest}}, mo);
  if (!mr.ok()) return Fail(mr.status());
  if (!(*mr)[0].ok()) return Fail((*mr)[0]);
  if (conn.json) {
    std::printf("%s\n", nlohmann::json{{"name", name},
                                       {"bytes", data.size()},
                                       {"units", units.size()},
                                       {"sha256", ToHex(m.file_sha256)}}
                            .dump()
                            .c_str());
  } else {
    std::printf("stored %s: %zu bytes in %zu units (sha256 %s)\n", name.c_str(), data.size(),
                units.size(), ToHex(m.file_sha256).c_str());
  }
  return 0;
}

int RunGetFile(Args args) {
  Conn conn;
  std::string name, out;
  FlagSet f("kvtier get-file", "Read back a file stored by put-file and verify its SHA-256.");
  conn.Register(&f);
  f.String("name", &name, "NAME", "name given to put-file", true);
  f.String("out", &out, "PATH", "where to write it (default: verify only)");
  if (int rc = f.Parse(args); rc >= 0) return rc;
  auto c = conn.Connect();
  if (!c.ok()) return Fail(c.status());
  auto m = FetchManifest(c->get(), name);
  if (!m.ok()) return Fail(m.status());
  std::vector<uint8_t> data;
  data.reserve(m->file_bytes);
  size_t missing = 0, per_tier[3] = {0, 0, 0};
  Status st = (*c)->Get(m->keys, [&](size_t, const daemon::GetItem& it) {
    if (!it.status.ok()) {
      ++missing;
      return;
    }
    if (it.tier < 3) ++per_tier[it.tier];
    data.insert(data.end(), it.value.begin(), it.value.end());
  });
  if (!st.ok()) return Fail(st);
  if (missing > 0) {
    return Fail(Status::NotFound(std::to_string(missing) + " of " + std::to_string(m->keys.size()) +
                                 " units missing"));
  }
  bool ok = data.size() == m->file_bytes && Sha256(data) == m->file_sha256;
  if (!ok) return Fail(Status::Corruption("reassembled file does not match its SHA-256"));
  if (!out.empty()) {
    std::ofstream o(out, std::ios::binary);
    o.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
    if (!o) return Fail(Status::IOError("cannot write " + out));
  }
  if (conn.json) {
    std::printf("%s\n",
                nlohmann::json{
                    {"name", name},
                    {"bytes", data.size()},
                    {"units", m->keys.size()},
                    {"verified", true},
                    {"from", {{"hbm", per_tier[0]}, {"dram", per_tier[1]}, {"ssd", per_tier[2]}}}}
                    .dump()
                    .c_str());
  } else {
    std::printf("read %s: %zu bytes, %zu units (hbm %zu, dram %zu, ssd %zu), sha256 verified\n",
                name.c_str(), data.size(), m->keys.size(), per_tier[0], per_tier[1], per_tier[2]);
  }
  return 0;
}

int RunPolicy(Args args) {
  Conn conn;
  std::string eviction, admission, params;
  std::vector<std::string> pos;
  FlagSet f("kvtier policy", "Show (get) or switch (set) the live eviction/admission policy.");
  conn.Register(&f);
  f.String("eviction", &eviction, "NAME", "set: eviction policy");
  f.String("admission", &admission, "NAME", "set: admission policy");
  f.String("params", &params, "K=V,...", "set: policy parameters");
  f.Positional(&pos, "get|set", "action");
  if (int rc = f.Parse(args); rc >= 0) return rc;
  if (pos.size() != 1 || (pos[0] != "get" && pos[0] != "set")) {
    std::fprintf(stderr,
                 "usage: kvtier policy get|set [--eviction N] [--admission N] "
                 "[--params k=v,...]\n");
    return 2;
  }
  auto c = conn.Connect();
  if (!c.ok()) return Fail(c.status());
  StatusOr<std::string> r = Status::Internal("unset");
  if (pos[0] == "get") {
    r = (*c)->PolicyGet();
  } else {
    nlohmann::json body = nlohmann::json::object();
    if (!eviction.empty()) body["eviction"] = eviction;
    if (!admission.empty()) body["admission"] = admission;
    if (!params.empty()) {
      nlohmann::json p = nlohmann::json::object();
      for (const std::string& kv : SplitComma(params)) {
        size_t eq = kv.find('=');
        if (eq == std::string::npos) return Fail(Status::InvalidArgument("--params k=v,..."));
        p[kv.substr(0, eq)] = kv.substr(eq + 1);
      }
      body["params"] = p;
    }
    std::string text;
    try {
      text = body.dump();  // throws for text that is not UTF-8
    } catch (const nlohmann::json::exception&) {
      return Fail(Status::InvalidArgument("policy names and --params must be UTF-8"));
    }
    r = (*c)->PolicySet(text);
  }
  if (!r.ok()) return Fail(r.status());
  if (conn.json) {
    std::printf("%s\n", r->c_str());
  } else {
    auto text = FormatPolicy(*r);
    if (!text.ok()) return Fail(text.status());
    std::fputs(text->c_str(), stdout);
  }
  return 0;
}

int RunDrain(Args args) {
  Conn conn;
  bool shutdown = false;
  FlagSet f("kvtier drain",
            "Flush the daemon and mark it not ready (/readyz 503); --shutdown then stops it "
            "gracefully.");
  conn.Register(&f);
  f.Bool("shutdown", &shutdown, "stop the daemon after the flush");
  if (int rc = f.Parse(args); rc >= 0) return rc;
  auto c = conn.Connect();
  if (!c.ok()) return Fail(c.status());
  Status st = (*c)->Drain(shutdown);
  if (!st.ok()) return Fail(st);
  if (conn.json) {
    std::printf("{\"drained\":true,\"shutdown\":%s}\n", shutdown ? "true" : "false");
  } else {
    std::printf("drained%s\n", shutdown ? "; daemon is shutting down" : "");
  }
  return 0;
}

}  // namespace kvtier::cli
