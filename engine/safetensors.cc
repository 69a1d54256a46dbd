#include "engine/safetensors.h"

#include <algorithm>
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

StatusOr<TensorFile> DecodeSafetensors(const uint8_t* data, size_t size) {
  if (size < 8) return Status::Corruption("safetensors: shorter than 8 bytes");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(data[i]) << (8 * i);
  if (n > kMaxSafetensorsHeaderBytes || n > size - 8)
    return Status::Corruption("safetensors: bad header length");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(reinterpret_cast<const char*>(data + 8),
                                   reinterpret_cast<const char*>(data + 8 + n));
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(std::string("safetensors: bad header JSON: ") + e.what());
  }
  if (!header.is_object()) return Status::Corruption("safetensors: header is not an object");
  const uint64_t data_size = size - 8 - n;
  const uint8_t* base = data + 8 + n;
  TensorFile file;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it->is_object()) return Status::Corruption("safetensors: bad __metadata__");
        for (auto m = it->begin(); m != it->end(); ++m) {
          if (!m->is_string()) return Status::Corruption("safetensors: metadata not a string");
          file.metadata[m.key()] = m->get<std::string>();
        }
        continue;
      }
      const auto& e = it.value();
      if (!e.is_object()) return Status::Corruption("safetensors: bad entry " + it.key());
      Tensor t;
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
      t.bytes.assign(base + off[0], base + off[1]);
      ranges.emplace_back(off[0], off[1]);
      file.tensors.emplace(it.key(), std::move(t));
    }
  } catch (const nlohmann::json::exception& e) {
    return Status::Corruption(std::string("safetensors: bad entry: ") + e.what());
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second)
      return Status::Corruption("safetensors: overlapping tensors");
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

StatusOr<TensorFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return Status::IOError("cannot open " + path);
  std::streamsize size = in.tellg();
  if (size < 0) return Status::IOError("cannot size " + path);
  in.seekg(0);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size))
    return Status::IOError("cannot read " + path);
  auto file = DecodeSafetensors(bytes.data(), bytes.size());
  if (!file.ok()) return file.status().WithContext(path);
  return file;
}

}  // namespace kvtier::engine
