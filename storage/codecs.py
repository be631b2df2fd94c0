"""Feature codecs: target hidden states <-> the integer bit arrays stored in a cache.

Zarr and .npy have no bfloat16 or float8 dtype, so features are stored as their raw bits
(uint16 for bf16, uint8 for fp8-e4m3). Encoding uses torch (the builder already holds torch
tensors); decoding is pure numpy so DataLoader workers need no torch ops.

- "bf16": lossless w.r.t. the target's bf16 activations; decoding is exact.
- "fp8":  e4m3fn with one float32 scale per row (per token): scale = amax(|row|) / 448, so the
          largest element of each row maps to the largest finite e4m3 value. All-zero rows get
          scale 1.0. Relative error per element is at most 2^-4 for values in e4m3's normal range.
- "e8mM" (M = 2..6): each value rounded to M mantissa bits (to nearest, ties to even) and stored
          as bf16 bits, whose low 7 - M mantissa bits are then zero. Relative error per element at
          most 2^-(M+1) over bf16's whole range (no scale, nothing flushed: a row's massive
          channels cost its small ones nothing); decoding is bf16's, so readers and the trainer
          treat the bits as bf16. Values beyond the largest e8mM number saturate to it.
"""

from __future__ import annotations

import numpy as np
import torch

from storage.format import FEATURE_CODECS, ROUNDED_CODECS

FP8_E4M3_MAX = 448.0


def _check_codec(codec: str) -> None:
    if codec not in FEATURE_CODECS:
        raise ValueError(f"feature codec must be one of {FEATURE_CODECS}, got {codec!r}")


def _fp8_e4m3fn_table() -> np.ndarray:
    """float32 value of every e4m3fn bit pattern (1 sign, 4 exponent bits with bias 7, 3 mantissa
    bits; no infinities, S.1111.111 is NaN)."""
    bits = np.arange(256, dtype=np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(exponent == 0xF) & ((bits & 0x7) == 0x7)] = np.nan
    return values.astype(np.float32)


FP8_E4M3FN_TABLE = _fp8_e4m3fn_table()  # [256] float32
FP8_E4M3FN_TABLE.flags.writeable = False


def is_bf16_bits(codec: str) -> bool:
    """Whether `codec` stores bf16 bits (bf16 and the e8m codecs: decoded alike)."""
    _check_codec(codec)
    return codec == "bf16" or codec in ROUNDED_CODECS


def round_mantissa(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """float32 `x` rounded to `mantissa_bits` (1..7) mantissa bits, to nearest with ties to even, on
    the bit pattern (exact, any device): the carry of a rounding up moves into the exponent as it
    should, subnormals included. |x| beyond the largest such number saturates to it."""
    drop = 23 - mantissa_bits
    largest = (2.0 - 2.0 ** -mantissa_bits) * 2.0**127  # exactly representable in float32
    x = x.float().clamp(-largest, largest).contiguous()
    bits = x.view(torch.int32)
    sign, magnitude = bits & ~0x7FFFFFFF, bits & 0x7FFFFFFF
    # Round half to even: add just under half an ulp, plus one more when the kept part is odd.
    magnitude = magnitude + ((1 << (drop - 1)) - 1) + ((magnitude >> drop) & 1)
    return (sign | ((magnitude >> drop) << drop)).view(torch.float32)


def round_mantissa_reference(x: np.ndarray, mantissa_bits: int) -> np.ndarray:
    """round_mantissa in plain numpy arithmetic (frexp, round half to even, ldexp) for normal
    float32 values and zero: the check of the bit-pattern version (tests/test_codecs.py)."""
    fraction, exponent = np.frexp(np.asarray(x, dtype=np.float64))  # x = fraction * 2**exponent, 0.5 <= |fraction| < 1
    scale = 2.0 ** (mantissa_bits + 1)  # the implicit leading 1 plus mantissa_bits
    return np.ldexp(np.round(fraction * scale) / scale, exponent).astype(np.float32)


def encode_features(features: torch.Tensor, *, codec: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Encode float features [..., F] into (bits [..., F], scales [...] or None), refusing
    non-finite values; on the host (see encode_features_tensor for the device).

    bf16: bits uint16 (the bfloat16 bit pattern), scales None.
    fp8:  bits uint8 (e4m3fn bit pattern of x / scale), scales float32 [...] (one per row).
    e8mM: bits uint16 (bf16 bits of x rounded to M mantissa bits), scales None.
    """
    _check_codec(codec)
    x = features.detach().to("cpu")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError("features contain NaN or infinite values; refusing to encode them into the cache")
    bits, scales = encode_features_tensor(x, codec=codec)
    return bits.numpy(), None if scales is None else scales.numpy()


def encode_features_tensor(features: torch.Tensor, *, codec: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """encode_features where `features` lives (a GPU: no copy, no sync), without its finite check
    (the caller checks a whole batch at once): (bits [..., F], scales [...] float32 or None), the
    same bits on every device."""
    _check_codec(codec)
    if features.ndim < 1:
        raise ValueError(f"features must have at least one axis [..., F], got shape {tuple(features.shape)}")
    if not features.is_floating_point():
        raise ValueError(f"features must be a floating point tensor, got {features.dtype}")
    x = features.detach()
    if codec == "bf16":
        return x.to(torch.bfloat16).contiguous().view(torch.uint16), None
    if codec in ROUNDED_CODECS:
        # The rounded value has at most 7 mantissa bits: its cast to bf16 is exact.
        return round_mantissa(x, ROUNDED_CODECS[codec]).to(torch.bfloat16).view(torch.uint16), None

    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    # x / scale can round a hair past 448; clamp so the cast never leaves the finite range.
    scaled = (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).contiguous().view(torch.uint8), scale.squeeze(-1)


def decode_features(bits: np.ndarray, scales: np.ndarray | None, *, codec: str) -> np.ndarray:
    """Decode stored feature bits [..., F] (and per-row scales [...] for fp8) to float32 [..., F]."""
    _check_codec(codec)
    bits = np.asarray(bits)
    if is_bf16_bits(codec):
        if bits.dtype != np.uint16:
            raise ValueError(f"{codec} feature bits must be uint16, got {bits.dtype}")
        # bf16 is the top half of a float32: shifting the bits up reconstructs the value exactly.
        return (bits.astype(np.uint32) << 16).view(np.float32)

    if bits.dtype != np.uint8:
        raise ValueError(f"fp8 feature bits must be uint8, got {bits.dtype}")
    if scales is None:
        raise ValueError("fp8 features need their per-row scales")
    scales = np.asarray(scales, dtype=np.float32)
    if scales.shape != bits.shape[:-1]:
        raise ValueError(f"fp8 scales shape {scales.shape} does not match feature rows {bits.shape[:-1]}")
    return FP8_E4M3FN_TABLE[bits] * scales[..., None]
