"""The safetensors format (engine/safetensors.h), with json + struct + torch only.

  8 bytes  little-endian u64 N = header length
  N bytes  JSON {"name": {"dtype", "shape", "data_offsets": [b, e]}, ..., "__metadata__": {..}},
           padded with spaces to a multiple of 8
  data     raw little-endian tensor bytes; offsets relative to the start of this region.

read() returns {name: tensor} with F32/F16/BF16 as float32 tensors, F8_E4M3/F8_E8M0/U8 as uint8
tensors (the raw codes), I64 as int64. write() takes the same kinds of tensors and a dtype per
float tensor. Limits: the header is at most MAX_HEADER_BYTES; every range must lie inside the
file and tensors may not overlap (a violation raises ValueError naming the tensor).
"""
import json
import struct

import torch

MAX_HEADER_BYTES = 100 << 20
_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "F8_E4M3": 1, "F8_E8M0": 1}
_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "U8": torch.uint8, "F8_E4M3": torch.uint8, "F8_E8M0": torch.uint8}


def read(path):
    """Returns (tensors, metadata)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(blob):
        raise ValueError(f"{path}: header length {n} out of range")
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {}) or {}
    data = memoryview(blob)[8 + n:]
    out, ranges = {}, []
    for name, h in header.items():
        dt, shape, (b, e) = h["dtype"], list(h["shape"]), h["data_offsets"]
        if dt not in _SIZE:
            raise ValueError(f"{path}: {name}: unsupported dtype {dt}")
        count = 1
        for d in shape:
            count *= d
        if not (0 <= b <= e <= len(data)) or e - b != count * _SIZE[dt]:
            raise ValueError(f"{path}: {name}: bad data_offsets {b}, {e}")
        ranges.append((b, e, name))
        t = torch.frombuffer(bytearray(data[b:e]), dtype=_TORCH[dt]) if e > b else \
            torch.empty(0, dtype=_TORCH[dt])
        t = t.reshape(shape)
        out[name] = t.float() if dt in ("F16", "BF16") else t
        out[name].dtype_name = dt  # the stored dtype, for callers that care
    ranges.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors {n0} and {n1} overlap")
    return out, meta


def write(path, tensors, dtypes=None, metadata=None):
    """tensors: {name: tensor}; dtypes: {name: "F32"|"F16"|"BF16"|"F8_E4M3"|...}, default F32
    for float tensors, U8 for uint8, I64 for int64. Names are written sorted (deterministic)."""
    dtypes = dtypes or {}
    header, chunks, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        dt = dtypes.get(name) or {torch.uint8: "U8", torch.int64: "I64"}.get(t.dtype, "F32")
        t = t.to(_TORCH[dt]).contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)
