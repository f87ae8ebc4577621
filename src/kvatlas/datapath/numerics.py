"""Scalar numerics shared by the codecs (torch reference; the Triton kernels mirror them).

Power-of-two ("ue8m0") scales are computed exactly from the bits of the tile's amax: the scale is
the smallest 2^k with amax <= qmax * 2^k, stored as the biased exponent byte k + 127. The official
`act_quant(round_scale=True)` takes the ceil from the bits of the rounded quotient amax/qmax; the
two differ only when that quotient lies within half an ulp above a power of two (then the official
scale is one step smaller and a value saturates). Integer bit arithmetic gives the same byte in
torch and Triton, which fp32 division would not guarantee.
"""

from __future__ import annotations

import struct

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
EXP_BIAS = 127
_MANT_BITS = 23
_MANT_MASK = (1 << _MANT_BITS) - 1
# e2m1 magnitudes by code (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def float_fields(x: float) -> tuple[int, int]:
    """(biased exponent, mantissa bits) of a normal fp32 constant."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return (bits >> _MANT_BITS) & 0xFF, bits & _MANT_MASK


def pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Biased exponent E (int32) of the smallest 2^(E-127) with amax <= qmax * 2^(E-127).

    `amax` must be fp32, >= 0 and normal (callers clamp it); the result may fall below 1 for tiny
    amax, so callers floor it where their format needs a floor.
    """
    q_exp, q_mant = float_fields(qmax)
    bits = amax.contiguous().view(torch.int32)
    exp = (bits >> _MANT_BITS) & 0xFF
    mant = bits & _MANT_MASK
    return exp - (q_exp - EXP_BIAS) + (mant > q_mant).to(torch.int32)


def exponent_to_scale(e: torch.Tensor) -> torch.Tensor:
    """2^(e-127) as fp32 from exponent bytes; byte 0 reads as 0 (SGLang's reference does too)."""
    return (e.to(torch.int32) << _MANT_BITS).view(torch.float32)


def inverse_scale(e: torch.Tensor) -> torch.Tensor:
    """2^(127-e), exact, for 1 <= e <= 253."""
    return ((2 * EXP_BIAS - e.to(torch.int32)) << _MANT_BITS).view(torch.float32)


def to_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn bytes, round to nearest even. Saturates at ±448 (torch would give NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def from_e4m3_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already divided by its scale) -> e2m1 codes (uint8 0..15), round half to even,
    saturating at 6. Ties go to the even code, like the hardware cvt.rn.satfinite.e2m1x2; the sign
    bit follows x < 0, so a small negative value keeps its sign as -0 (SGLang's V4.1 reference)."""
    mag = x.abs()
    # thresholds between neighbouring magnitudes; `>=` where the upper code is even
    code = ((mag > 0.25).to(torch.uint8) + (mag >= 0.75) + (mag > 1.25) + (mag >= 1.75)
            + (mag > 2.5) + (mag >= 3.5) + (mag > 5.0))
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2k] codes -> [..., k] bytes; element 2j in the low nibble (SGLang, vLLM docstring)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def tile_amax(x: torch.Tensor, tile: int) -> torch.Tensor:
    """[n, k*tile] -> [n, k] max |x| per tile."""
    return x.unflatten(-1, (-1, tile)).abs().amax(dim=-1)
