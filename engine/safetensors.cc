#include "engine/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

namespace kvtier::engine {

int DtypeSize(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "I64" || dtype == "U64" || dtype == "F64") return 8;
  if (dtype == "U8" || dtype == "I8" || dtype == "F8_E4M3" || dtype == "F8_E8M0") return 1;
  if (dtype == "F16" || dtype == "BF16") return 2;
  return 0;
}

float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {  // infinity or NaN (payload kept)
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal: rebias 15 -> 127
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {  // signed zero
    bits = sign;
  } else {  // subnormal: mant * 2^-24, normal in binary32; shift the leading one out
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while ((mant & 0x400u) == 0);
    bits = sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

float Bf16BitsToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;  // bfloat16 is binary32's top half
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

Status ConvertToF32(const std::string& name, Tensor* t) {
  if (t->dtype == "F32") return Status::Ok();
  const bool half = t->dtype == "F16";
  if (!half && t->dtype != "BF16")
    return Status::InvalidArgument("tensor " + name + ": cannot convert dtype " + t->dtype +
                                   " to F32");
  const int64_t n = t->NumElements();
  if (n < 0 || static_cast<uint64_t>(n) * 2 != t->bytes.size())
    return Status::InvalidArgument("tensor " + name + ": byte count does not match its shape");
  std::vector<uint8_t> out(static_cast<size_t>(n) * 4);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t bits = static_cast<uint16_t>(t->bytes[2 * i] | (t->bytes[2 * i + 1] << 8));
    const float f = half ? HalfBitsToFloat(bits) : Bf16BitsToFloat(bits);
    if (!std::isfinite(f))
      return Status::InvalidArgument("tensor " + name + " (" + t->dtype + "): element " +
                                     std::to_string(i) + " is " +
                                     (std::isnan(f) ? "NaN" : "infinite"));
    std::memcpy(out.data() + 4 * i, &f, 4);  // little-endian host, as the format
  }
  t->dtype = "F32";
  t->bytes = std::move(out);
  return Status::Ok();
}

int64_t Tensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

StatusOr<std::vector<uint8_t>> EncodeSafetensors(const TensorFile& file) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!file.metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : file.metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    int es = DtypeSize(t.dtype);
    if (es == 0) return Status::InvalidArgument("safetensors: unknown dtype " + t.dtype);
    if (t.NumElements() * es != static_cast<int64_t>(t.bytes.size()))
      return Status::InvalidArgument("safetensors: shape does not match bytes for " + name);
    nlohmann::ordered_json e;
    e["dtype"] = t.dtype;
    e["shape"] = t.shape;
    e["data_offsets"] = {offset, offset + t.bytes.size()};
    header[name] = e;
    offset += t.bytes.size();
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h.push_back(' ');
  std::vector<uint8_t> out(8 + h.size() + offset);
  uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(out.data() + 8, h.data(), h.size());
  uint8_t* p = out.data() + 8 + h.size();
  for (const auto& [name, t] : file.tensors) {
    if (!t.bytes.empty()) std::memcpy(p, t.bytes.data(), t.bytes.size());
    p += t.bytes.size();
  }
  return out;
}

namespace {

// One tensor's header entry: its dtype, shape and byte range in the data region.
struct HeaderEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

struct Header {
  std::vector<HeaderEntry> entries;
  std::map<std::string, std::string> metadata;
};

// Parses the JSON header (`n` bytes at `text`) and checks every entry against a data region of
// `data_size` bytes: known dtype, shape x element size equal to the range, ranges inside the
// region and not overlapping. Corruption otherwise.
StatusOr<Header> ParseHeader(const uint8_t* text, uint64_t n, uint64_t data_size) {
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(reinterpret_cast<const char*>(text),
                                   reinterpret_cast<const char*>(text + n));
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(std::string("safetensors: bad header JSON: ") + e.what());
  }
  if (!header.is_object()) return Status::Corruption("safetensors: header is not an object");
  Header h;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it->is_object()) return Status::Corruption("safetensors: bad __metadata__");
        for (auto m = it->begin(); m != it->end(); ++m) {
          if (!m->is_string()) return Status::Corruption("safetensors: metadata not a string");
          h.metadata[m.key()] = m->get<std::string>();
        }
        continue;
      }
      const auto& e = it.value();
      if (!e.is_object()) return Status::Corruption("safetensors: bad entry " + it.key());
      HeaderEntry t;
      t.name = it.key();
      t.dtype = e.at("dtype").get<std::string>();
      t.shape = e.at("shape").get<std::vector<int64_t>>();
      auto off = e.at("data_offsets").get<std::vector<uint64_t>>();
      int es = DtypeSize(t.dtype);
      if (es == 0) return Status::Corruption("safetensors: unknown dtype " + t.dtype);
      if (off.size() != 2 || off[0] > off[1] || off[1] > data_size)
        return Status::Corruption("safetensors: bad data_offsets for " + it.key());
      int64_t elems = 1;
      for (int64_t d : t.shape) {
        if (d < 0 || d > (int64_t{1} << 40)) return Status::Corruption("safetensors: bad shape");
        // Checked before multiplying: 2^40 * 2^40 overflows int64 (and used to wrap to a
        // count that could match the data's size).
        if (d != 0 && elems > (int64_t{1} << 40) / d) {
          return Status::Corruption("safetensors: shape too big");
        }
        elems *= d;
      }
      if (static_cast<uint64_t>(elems) * es != off[1] - off[0])
        return Status::Corruption("safetensors: size mismatch for " + it.key());
      t.begin = off[0];
      t.end = off[1];
      ranges.emplace_back(off[0], off[1]);
      h.entries.push_back(std::move(t));
    }
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(std::string("safetensors: bad entry: ") + e.what());
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second)
      return Status::Corruption("safetensors: overlapping tensors");
  }
  return h;
}

uint64_t HeaderLength(const uint8_t* first8) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(first8[i]) << (8 * i);
  return n;
}

// Reads exactly `size` bytes at `offset` of fd; IOError naming `path` otherwise.
Status PreadFull(int fd, uint8_t* out, uint64_t size, uint64_t offset, const std::string& path) {
  while (size > 0) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(size, uint64_t{1} << 30));
    const ssize_t got = ::pread(fd, out, want, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return Status::IOError("cannot read " + path);
    out += got;
    size -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return Status::Ok();
}

}  // namespace

StatusOr<TensorFile> DecodeSafetensors(const uint8_t* data, size_t size) {
  if (size < 8) return Status::Corruption("safetensors: shorter than 8 bytes");
  const uint64_t n = HeaderLength(data);
  if (n > kMaxSafetensorsHeaderBytes || n > size - 8)
    return Status::Corruption("safetensors: bad header length");
  const uint64_t data_size = size - 8 - n;
  const uint8_t* base = data + 8 + n;
  KVTIER_ASSIGN_OR_RETURN(Header h, ParseHeader(data + 8, n, data_size));
  TensorFile file;
  file.metadata = std::move(h.metadata);
  for (HeaderEntry& e : h.entries) {
    Tensor t;
    t.dtype = std::move(e.dtype);
    t.shape = std::move(e.shape);
    t.bytes.assign(base + e.begin, base + e.end);
    file.tensors.emplace(std::move(e.name), std::move(t));
  }
  return file;
}

Status WriteSafetensors(const std::string& path, const TensorFile& file) {
  KVTIER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, EncodeSafetensors(file));
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status::IOError("cannot create " + tmp);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) return Status::IOError("short write to " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    return Status::IOError("cannot rename to " + path);
  return Status::Ok();
}

StatusOr<TensorFile> ReadSafetensors(const std::string& path,
                                     const SafetensorsReadOptions& options) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError("cannot open " + path);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::IOError("cannot stat " + path);
  // Only a regular file has a size to check before reading: a directory, a device (/dev/zero)
  // or a pipe would be read without end or sized at random.
  if (!S_ISREG(st.st_mode)) return Status::IOError("not a regular file: " + path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) return Status::Corruption("safetensors: shorter than 8 bytes").WithContext(path);
  uint8_t first8[8];
  KVTIER_RETURN_IF_ERROR(PreadFull(fd, first8, 8, 0, path));
  const uint64_t n = HeaderLength(first8);
  if (n > kMaxSafetensorsHeaderBytes || n > size - 8)
    return Status::Corruption("safetensors: bad header length").WithContext(path);
  std::vector<uint8_t> text(static_cast<size_t>(n));
  KVTIER_RETURN_IF_ERROR(PreadFull(fd, text.data(), n, 8, path));
  auto h = ParseHeader(text.data(), n, size - 8 - n);
  if (!h.ok()) return h.status().WithContext(path);
  auto wanted = [&](const std::string& name) {
    return options.only.empty() || options.only.contains(name);
  };
  // The bytes to read, against the bound, before anything is allocated for them.
  uint64_t total = 0;
  for (const HeaderEntry& e : h->entries) {
    if (wanted(e.name)) total += e.end - e.begin;  // ranges do not overlap: no overflow
  }
  if (total > options.max_data_bytes) {
    return Status::InvalidArgument("safetensors: the tensors to read take " +
                                   std::to_string(total) + " bytes, over the " +
                                   std::to_string(options.max_data_bytes) + " allowed")
        .WithContext(path);
  }
  TensorFile file;
  file.metadata = std::move(h->metadata);
  for (HeaderEntry& e : h->entries) {
    if (!wanted(e.name)) continue;
    Tensor t;
    t.dtype = std::move(e.dtype);
    t.shape = std::move(e.shape);
    t.bytes.resize(static_cast<size_t>(e.end - e.begin));
    KVTIER_RETURN_IF_ERROR(PreadFull(fd, t.bytes.data(), t.bytes.size(), 8 + n + e.begin, path));
    file.tensors.emplace(std::move(e.name), std::move(t));
  }
  return file;
}

}  // namespace kvtier::engine
