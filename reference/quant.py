"""Block-scaled FP8/FP4 codecs, bit-identical to kernels/ (kernels/quant.h).

Formats (reference section 5):
  fp4_e4m3x16   E2M1 codes, one E4M3 scale per 16: s = e4m3(max(amax, 6*2^-9) / 6),
                q = e2m1(clamp(x / s, -6, 6)). The global-KV main entries.
  fp4_ue8m0x32  E2M1 codes, one UE8M0 scale per 32: s = 2^ceil(log2(max(amax, 6*2^-126) / 6)).
                Index keys and index queries.
  fp8_ue8m0x32  E4M3 codes, one UE8M0 scale per 32: s = 2^ceil(log2(max(amax, 448*2^-126) / 448)),
                q = e4m3(x / s). SWA keys and Engram rows.
Rounding is round-to-nearest-even on the code grid, saturating (e2m1 to +-6, e4m3 to +-448).
Codes are computed from float32 bit patterns with integer arithmetic, so they do not depend on
the platform's float-to-int conversions. NaN handling of kernels/ is not reproduced (the model
never produces NaN; a NaN here propagates as NaN).

fake_quant(x, fmt) is quantise-then-dequantise with a straight-through gradient (QAT).
"""
import struct

import torch

FP4_E4M3X16 = "fp4_e4m3x16"
FP4_UE8M0X32 = "fp4_ue8m0x32"
FP8_UE8M0X32 = "fp8_ue8m0x32"
BLOCK = {FP4_E4M3X16: 16, FP4_UE8M0X32: 32, FP8_UE8M0X32: 32}


def _f32_from_bits(b):
    return struct.unpack("<f", struct.pack("<I", b))[0]


def _e4m3_value(code):
    mag, neg = code & 0x7F, code & 0x80
    if mag == 0x7F:
        v = float("nan")
    elif mag < 8:
        v = mag / 512.0
    else:
        v = _f32_from_bits((mag + (120 << 3)) << 20)
    return -v if neg else v


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_TABLE = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float32)
E2M1_TABLE[8] = -0.0
E4M3_TABLE = torch.tensor([_e4m3_value(c) for c in range(256)], dtype=torch.float32)


def _bits(x):
    """float32 tensor -> its bit pattern as int64 in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(b):
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.to(torch.int32).view(torch.float32)


def e2m1_code(x):
    """RNE onto {0,.5,1,1.5,2,3,4,6} with sign (x already clamped to [-6, 6])."""
    a = x.abs()
    code = ((a > 0.25).long() + (a >= 0.75).long() + (a > 1.25).long() + (a >= 1.75).long()
            + (a > 2.5).long() + (a >= 3.5).long() + (a > 5.0).long())
    return code | ((_bits(x) >> 31) << 3)


def e4m3_code(x):
    """RNE onto E4M3 (fn, bias 7), saturating to +-448."""
    u = _bits(x)
    a = u & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    normal = normal.clamp(max=0x7E)
    exp = a >> 23
    man = (a & 0x7FFFFF) | 0x800000
    shift = (141 - exp).clamp(21, 40)
    half = 1 << (shift - 1)
    rem = man & ((1 << shift) - 1)
    res = man >> shift
    res = res + ((rem > half) | ((rem == half) & ((res & 1) == 1))).long()
    sub = torch.where(exp < 110, torch.zeros_like(res), res)
    code = torch.where(a >= 0x3C800000, normal, sub)
    return code | ((u >> 31) << 7)


def ue8m0_ceil_code(r):
    """Code of 2^ceil(log2(r)) for r > 0 (exact, from the bits)."""
    a = _bits(r) & 0x7FFFFFFF
    exp, man = a >> 23, a & 0x7FFFFF
    code = exp + (man != 0).long()
    code = torch.where(exp == 0, (man > 0x400000).long(), code)
    return code.clamp(max=0xFE)


def ue8m0_value(code):
    v = _from_bits(code.to(torch.int64) << 23)
    return torch.where(code == 0, torch.full_like(v, 2.0**-127), v)


def _blocks(x, fmt):
    n = x.shape[-1]
    b = BLOCK[fmt]
    if n % b:
        raise ValueError(f"last dimension {n} is not a multiple of the {fmt} block ({b})")
    return x.reshape(*x.shape[:-1], n // b, b)


def quantize(x, fmt):
    """x[..., n] float32 -> (codes[..., n] int64, scale codes[..., n/block] int64)."""
    xb = _blocks(x.detach().float(), fmt)
    amax = xb.abs().amax(-1)
    if fmt == FP4_E4M3X16:
        scode = e4m3_code(torch.clamp(amax, min=6.0 / 512.0) / 6.0)
        s = E4M3_TABLE[scode]
    elif fmt == FP4_UE8M0X32:
        scode = ue8m0_ceil_code(torch.clamp(amax, min=6.0 * 2.0**-126) / 6.0)
        s = ue8m0_value(scode)
    else:
        scode = ue8m0_ceil_code(torch.clamp(amax, min=448.0 * 2.0**-126) / 448.0)
        s = ue8m0_value(scode)
    y = xb / s.unsqueeze(-1)
    codes = e4m3_code(y) if fmt == FP8_UE8M0X32 else e2m1_code(y.clamp(-6.0, 6.0))
    return codes.reshape(x.shape), scode


def dequantize(codes, scodes, fmt):
    table = E4M3_TABLE if fmt == FP8_UE8M0X32 else E2M1_TABLE
    s = E4M3_TABLE[scodes] if fmt == FP4_E4M3X16 else ue8m0_value(scodes)
    v = _blocks(table[codes], fmt) * s.unsqueeze(-1)
    return v.reshape(codes.shape)


def round_trip(x, fmt):
    """Quantise then dequantise (no gradient)."""
    return dequantize(*quantize(x, fmt), fmt)


def fake_quant(x, fmt):
    """round_trip(x) in the forward pass, identity in the backward pass (straight-through)."""
    q = round_trip(x, fmt)
    if not x.requires_grad:
        return q
    return x + (q - x).detach()


def pack_fp4(codes):
    """FP4 codes[..., n] -> bytes[..., n/2] (element 2j in the low nibble), as kernels/ stores."""
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)
