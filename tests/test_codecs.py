"""The e8m feature codecs (storage/codecs.py): the bit-pattern rounding against plain arithmetic,
its error bound, and what a cache stores and reads back."""

import numpy as np
import pytest
import torch

from storage.codecs import decode_features, encode_features, encode_features_tensor, round_mantissa, round_mantissa_reference
from storage.format import FEATURE_CODECS, ROUNDED_CODECS, format_version_for


def test_rounding_matches_plain_arithmetic_on_hand_values():
    # 1 + 1/16 is halfway between 1 and 1 + 1/8 at 3 mantissa bits: ties go to the even mantissa (1).
    # 1 + 3/16 is halfway between 1 + 1/8 and 1 + 1/4: even is 1 + 1/4. 1.9375 carries into the exponent.
    x = torch.tensor([1.0625, 1.1875, 1.0626, -1.1875, 1.9375, 0.0, -0.0, 3.0e-3, 24832.0])
    want = [1.0, 1.25, 1.125, -1.25, 2.0, 0.0, -0.0, 0.0029296875, 24576.0]
    got = round_mantissa(x, 3).numpy()
    np.testing.assert_array_equal(got, np.array(want, dtype=np.float32))
    assert np.signbit(got[6])  # -0 keeps its sign
    np.testing.assert_array_equal(got, round_mantissa_reference(x.numpy(), 3))


@pytest.mark.parametrize("mantissa_bits", [2, 3, 4, 5, 6, 7])
def test_rounding_matches_reference_and_bound(mantissa_bits):
    generator = torch.Generator().manual_seed(mantissa_bits)
    x = torch.randn(4096, generator=generator) * torch.logspace(-20, 20, 4096)  # normal float32 over 40 decades
    got = round_mantissa(x, mantissa_bits).numpy()
    np.testing.assert_array_equal(got, round_mantissa_reference(x.numpy(), mantissa_bits))
    # What is left of the mantissa: the low 23 - mantissa_bits bits are zero.
    assert not np.any(got.view(np.uint32) & ((1 << (23 - mantissa_bits)) - 1))
    rel = np.abs(got - x.numpy()) / np.abs(x.numpy())
    assert rel.max() <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6)
    assert rel.max() > 2.0 ** -(mantissa_bits + 1) * 0.8  # the bound is nearly reached, not just respected


def test_rounding_at_seven_bits_is_bf16_and_saturates():
    x = torch.randn(2048) * 1e3
    np.testing.assert_array_equal(round_mantissa(x, 7).numpy(), x.to(torch.bfloat16).float().numpy())
    huge = torch.tensor([3.4e38, -3.4e38])
    got = round_mantissa(huge, 3)
    assert torch.isfinite(got).all() and got[0] == (2 - 2**-3) * 2.0**127 and got[1] == -got[0]


@pytest.mark.parametrize("codec", sorted(ROUNDED_CODECS))
def test_e8m_codec_round_trip(codec):
    mantissa_bits = ROUNDED_CODECS[codec]
    x = torch.randn(3, 5, 64) * torch.logspace(-3, 4, 5)[None, :, None]
    x[0, 0, 0] = 24832.0  # a massive activation does not move its row's other values
    bits, scales = encode_features(x, codec=codec)
    assert scales is None and bits.dtype == np.uint16 and bits.shape == x.shape
    assert not np.any(bits & ((1 << (7 - mantissa_bits)) - 1))  # the dropped bf16 mantissa bits
    decoded = decode_features(bits, None, codec=codec)
    np.testing.assert_array_equal(decoded, round_mantissa(x, mantissa_bits).numpy())
    rel = np.abs(decoded - x.numpy()) / np.abs(x.numpy())
    assert rel.max() <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6)
    # the same bits from a bf16 input and from the device path
    tensor_bits, _ = encode_features_tensor(x, codec=codec)
    np.testing.assert_array_equal(tensor_bits.numpy(), bits)


def test_e8m_codecs_are_format_version_3_and_decode_as_bf16():
    assert set(ROUNDED_CODECS) <= set(FEATURE_CODECS)
    assert format_version_for(ira_parents=None, feature_codec="e8m3", rollout_feature_codec=None) == 3
    assert format_version_for(ira_parents=8, feature_codec="bf16", rollout_feature_codec="e8m4") == 3
    assert format_version_for(ira_parents=8, feature_codec="bf16", rollout_feature_codec="fp8") == 2
    bits = np.array([0x3F80, 0xC120], dtype=np.uint16)  # 1.0, -10.0
    np.testing.assert_array_equal(decode_features(bits, None, codec="e8m3"), decode_features(bits, None, codec="bf16"))
    with pytest.raises(ValueError, match="e8m3 feature bits must be uint16"):
        decode_features(bits.astype(np.uint8), None, codec="e8m3")
