"""The optimized kernels' e2m1 encoder, modelled instruction by instruction on the CPU, against the
reference's codes (``tileproof.reference.quant._e2m1_codes``).

``optimized/quant/common.py`` encodes with fp32 FMAs against magic numbers, integer minima on the
candidates' bits, and packs eight codes per word by summing the unmasked magnitudes (Horner) and
funnel-shifting the signs in. This module models each of those instructions in numpy:

- ``FFMA(a, 2^p, M)`` (one rounding of the exact ``a · 2^p + M`` to fp32) as a float64 multiply-add
  rounded to fp32: ``a · 2^p`` is exact in float64; when ``a · 2^p >= 2^-2`` the sum is exact too
  (at most 50 significant bits), and when it is smaller it is below half the fp32 spacing at
  ``M >= 2^23``, so both roundings give ``M``. NaN operands give NVIDIA's canonical NaN 0x7FFFFFFF.
- ``VIMNMX`` (unsigned minimum), ``LEA``/``IMAD`` (shift-add mod 2^32) and ``SHF.L.W`` (funnel shift)
  on uint32.

Also here: the three-instruction division of a bf16 block amax by qmax (``divide_bf16_amax``),
exact for every bf16 amax.

The pytest tests cover every bf16 value (both signs), the neighbourhoods of every rounding
threshold, and random fp32 values. ``python tests/test_e2m1_encoder_model.py`` runs the exhaustive
check over all 2^32 fp32 bit patterns (the NaNs as the canonical NaN that an fp32 multiply returns
on NVIDIA GPUs): a few minutes on two cores.
"""

from __future__ import annotations

import sys
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from tileproof.optimized.quant.common import (
    E2M1_MAGIC,
    E2M1_MAGIC_BITS,
    E2M1_SIGN_NIBBLE_BITS,
    e2m1_magnitude_sum_excess,
)
from tileproof.reference import quant as rq
from tileproof.reference.contract import E2M1, E4M3

CANONICAL_NAN_BITS = 0x7FFFFFFF


def ffma_bits(a: np.ndarray, multiplier: float, addend: float) -> np.ndarray:
    """Bits of fp32 ``FFMA(a, multiplier, addend)`` for fp32 ``a >= 0`` (or NaN) and a power-of-two
    multiplier: see the module docstring for why float64 arithmetic rounds the same way."""
    with np.errstate(over="ignore", invalid="ignore"):
        result = (a.astype(np.float64) * multiplier + addend).astype(np.float32).view(np.uint32)
    return np.where(np.isnan(a), np.uint32(CANONICAL_NAN_BITS), result)


def magnitude_bits(y: np.ndarray, saturate: bool = True) -> np.ndarray:
    """``e2m1_magnitude_bits``: the minimum of the three candidates' bits (and of the cap)."""
    a = np.abs(y)
    candidate_0 = ffma_bits(a, 2.0, E2M1_MAGIC)
    candidate_1 = ffma_bits(a, 1.0, E2M1_MAGIC + 2.0)
    candidate_2 = ffma_bits(a, 0.5, E2M1_MAGIC + 4.0)
    smallest = np.minimum(np.minimum(candidate_0, candidate_1), candidate_2)
    return np.minimum(smallest, np.uint32(E2M1_MAGIC_BITS + 7)) if saturate else smallest


def code(y: np.ndarray) -> np.ndarray:
    """``e2m1_code``: magnitude's low three bits, and bits 28..31 of y with the low three cleared."""
    return (magnitude_bits(y) & np.uint32(7)) | ((y.view(np.uint32) >> np.uint32(28)) & np.uint32(0xFFFFFFF8))


def magnitude_sum(y: np.ndarray, saturate: bool) -> np.ndarray:
    """``e2m1_magnitude_sum``: Horner's ``Σ_i magnitude_bits(y[:, i]) · 16^i``, one LEA (wrapping
    shift-add) per value."""
    magnitudes = np.zeros(y.shape[0], dtype=np.uint32)
    for i in reversed(range(y.shape[1])):
        magnitudes = (magnitudes << np.uint32(4)) + magnitude_bits(y[:, i], saturate)
    return magnitudes


def pack_codes(y: np.ndarray, saturate: bool = True) -> np.ndarray:
    """``e2m1_pack_codes`` on rows of ``count <= 8`` values: ``[n, count]`` fp32 → ``[n]`` uint32."""
    count = y.shape[1]
    signs = np.zeros(y.shape[0], dtype=np.uint32)
    for i in reversed(range(count)):
        signs = (signs << np.uint32(4)) | (y[:, i].view(np.uint32) >> np.uint32(28))  # SHF.L.W
    magnitudes = magnitude_sum(y, saturate)
    return (signs & np.uint32(E2M1_SIGN_NIBBLE_BITS)) | (magnitudes - np.uint32(e2m1_magnitude_sum_excess(count)))


def byte_perm(low: np.ndarray, high: np.ndarray, selector: int) -> np.ndarray:
    """CUDA's ``__byte_perm(low, high, selector)`` (PRMT): byte i of the result is byte
    ``(selector >> 4i) & 7`` of the 8 bytes ``high:low``."""
    pool = np.stack([low, high], axis=-1).view(np.uint8).reshape(*low.shape, 8)
    picks = [(selector >> (4 * i)) & 7 for i in range(4)]
    return np.ascontiguousarray(pool[..., picks]).view(np.uint32).reshape(low.shape)


def pack_codes_of_finite_block(y: np.ndarray, words: np.ndarray) -> np.ndarray:
    """``e2m1_pack_codes_of_finite_block``: ``[n, 8]`` fp32 values with their bf16 pairs ``[n, 4]``
    (int32 viewed as uint32; the signs are taken from these)."""
    magnitudes = magnitude_sum(y, saturate=False)
    low_pair = byte_perm(words[:, 0], words[:, 1], 0x7351)
    high_pair = byte_perm(words[:, 2], words[:, 3], 0x7351)
    even = byte_perm(low_pair, high_pair, 0x5410)
    odd = byte_perm(low_pair, high_pair, 0x7632)
    signs = (odd & np.uint32(0x80808080)) | ((even >> np.uint32(4)) & np.uint32(0x08080808))
    return signs | (magnitudes - np.uint32(e2m1_magnitude_sum_excess(8)))


def reference_codes(y: np.ndarray) -> np.ndarray:
    return rq._e2m1_codes(torch.from_numpy(y)).numpy().astype(np.uint32)


def reference_packed(y: np.ndarray) -> np.ndarray:
    """The reference's codes of ``[n, count]`` values packed as the kernel's word (value i at 4i)."""
    codes = reference_codes(y.reshape(-1)).reshape(y.shape)
    return sum(codes[:, i] << np.uint32(4 * i) for i in range(y.shape[1])).astype(np.uint32)


def mismatches(y: np.ndarray) -> list[str]:
    """Every way the model disagrees with the reference on the values ``y`` (fp32, any shape)."""
    y = y.reshape(-1)
    expected = reference_codes(y)
    problems = []
    bits = magnitude_bits(y)
    if not np.array_equal(bits - np.uint32(E2M1_MAGIC_BITS), expected & np.uint32(7)):
        problems.append("magnitude_bits")
    if not np.array_equal(code(y), expected):
        problems.append("e2m1_code")
    if not np.array_equal((y.view(np.uint32) >> np.uint32(31)) << np.uint32(3), expected & np.uint32(8)):
        problems.append("sign (bit 31 to bit 3 of the nibble)")
    below_seven = np.abs(y) < 7  # false for NaN
    if not np.array_equal(magnitude_bits(y[below_seven], saturate=False), bits[below_seven]):
        problems.append("magnitude_bits(saturate=False) for |y| < 7")
    for count in (2, 4, 8):
        rows = y[: y.size // count * count].reshape(-1, count)
        if not np.array_equal(pack_codes(rows), reference_packed(rows)):
            problems.append(f"pack_codes of {count}")
    return problems


def canonical(bits: np.ndarray) -> np.ndarray:
    """fp32 values of ``bits``, every NaN replaced by the canonical NaN (what an fp32 FMUL returns)."""
    values = bits.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(values), np.uint32(CANONICAL_NAN_BITS).view(np.float32), values)


def test_every_bf16_value():
    bits = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    assert mismatches(canonical(bits)) == []


def test_threshold_neighbourhoods_and_random_values():
    thresholds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 8.0], dtype=np.float32)
    offsets = np.arange(-64, 65, dtype=np.int64)
    near = (thresholds.view(np.uint32)[:, None].astype(np.int64) + offsets).reshape(-1).astype(np.uint32)
    rng = np.random.default_rng(0)
    scattered = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    for bits in (near, near | np.uint32(1 << 31), scattered):
        assert mismatches(canonical(bits)) == []


E2M1_AMAX_FLOOR = np.float32(E2M1.amax_floor)


def finite_bf16_magnitudes() -> np.ndarray:
    """Every finite non-negative bf16 value, as fp32."""
    bits = np.arange(0x7F80, dtype=np.uint32) << np.uint32(16)
    return bits.view(np.float32)


def multipliers(amax: np.ndarray, round_sf: bool) -> np.ndarray:
    """The cast's multiplier for block maxima ``amax`` (fp32 IEEE divisions, as in the kernels)."""
    clamped = np.maximum(amax, E2M1_AMAX_FLOOR)
    if not round_sf:
        return np.float32(6.0) / clamped
    sf = (clamped / np.float32(6.0)).view(np.uint32)
    rounded = ((sf + np.uint32(0x7FFFFF)) & np.uint32(0xFF800000)).view(np.float32)
    return np.float32(1.0) / rounded


def test_a_finite_block_scales_its_values_below_seven():
    """``saturate=False`` needs ``|y| < 7``: ``|x| · m`` grows with |x|, so the block's amax itself
    gives the largest y, for every finite bf16 amax (and below the floor, the floor's)."""
    amax = finite_bf16_magnitudes()
    for round_sf in (False, True):
        m = multipliers(amax, round_sf)
        assert np.all(m > 0) and np.all(np.isfinite(m))
        assert np.max(np.maximum(amax, E2M1_AMAX_FLOOR) * m) < 7


def test_finite_block_encoder_matches_the_reference():
    """Blocks of random bf16 values (every finite magnitude class, both signs, zeros) with the
    multiplier of their own amax: the signs from the bf16 words and the uncapped magnitudes give
    the reference's codes of ``y = x · m``."""
    rng = np.random.default_rng(1)
    magnitudes = finite_bf16_magnitudes()
    for round_sf in (False, True):
        for spread in (0, 8, 40, 300):
            # blocks of 16 values around a random binade (spread: how far below it values go)
            blocks = 4096
            top = rng.integers(0, 0x7F7F, size=(blocks, 1))
            bits = top - rng.integers(0, 1 + spread * 128, size=(blocks, 16))
            values = magnitudes[np.clip(bits, 0, 0x7F7F)]
            values = np.where(rng.random((blocks, 16)) < 0.05, np.float32(0), values)
            values = np.where(rng.random((blocks, 16)) < 0.5, -values, values).astype(np.float32)
            m = multipliers(np.abs(values).max(axis=1, keepdims=True), round_sf)
            y = (values * m).astype(np.float32)
            x_bits = (values.view(np.uint32) >> np.uint32(16)).astype(np.uint32)
            words = (x_bits[:, 0::2] | (x_bits[:, 1::2] << np.uint32(16))).reshape(-1, 4)
            rows = y.reshape(-1, 8)
            assert np.array_equal(pack_codes_of_finite_block(rows, words), reference_packed(rows))
            assert np.array_equal(pack_codes_of_finite_block(rows, words), pack_codes(rows))


def round_to_fp32(value: Fraction) -> np.float32:
    """``value`` rounded to the nearest fp32, ties to even (exact: no double rounding)."""
    nearest = np.float32(float(value))
    for neighbour in (np.nextafter(nearest, np.float32(-np.inf)), np.nextafter(nearest, np.float32(np.inf))):
        gap, best_gap = abs(Fraction(float(neighbour)) - value), abs(Fraction(float(nearest)) - value)
        if gap < best_gap or (gap == best_gap and int(neighbour.view(np.uint32)) % 2 == 0):
            nearest = neighbour
    return nearest


@pytest.mark.parametrize("fmt", [E2M1, E4M3], ids=lambda fmt: fmt.name)
def test_bf16_amax_division_by_qmax_is_exact(fmt):
    """``divide_bf16_amax``: ``q = RN(a·r)``, ``e = RN(a − qmax·q)`` (FFMA), ``RN(q + e·r)`` (FFMA),
    each modelled as one exact rounding, equals the IEEE ``a / qmax`` for every bf16 amax ``a``
    (and the floor it is clamped to), for the qmax values the kernels use it with."""
    from tileproof.optimized.quant.common import BF16_AMAX_DIVISORS

    qmax = fmt.qmax
    assert qmax in BF16_AMAX_DIVISORS
    amax = np.unique(np.maximum(finite_bf16_magnitudes(), np.float32(fmt.amax_floor)))
    reciprocal = np.float32(1.0) / np.float32(qmax)
    r, divisor = Fraction(float(reciprocal)), Fraction(qmax)
    for a in amax.tolist():
        quotient = Fraction(float(round_to_fp32(Fraction(a) * r)))
        residual = Fraction(float(round_to_fp32(Fraction(a) - divisor * quotient)))
        assert round_to_fp32(quotient + residual * r) == np.float32(a) / np.float32(qmax), a


def exhaustive(chunk_bits: int = 24) -> int:
    """Check all 2^32 fp32 bit patterns in chunks; prints progress, returns the number of chunks
    with a mismatch (0 means every value agrees)."""
    failures = 0
    started = time.time()
    chunk = np.arange(1 << chunk_bits, dtype=np.uint32)
    for index in range(1 << (32 - chunk_bits)):
        problems = mismatches(canonical(chunk + np.uint32(index << chunk_bits)))
        if problems:
            failures += 1
            print(f"chunk {index:#x}: {problems}", flush=True)
        if index % 16 == 15:
            print(f"{index + 1} / {1 << (32 - chunk_bits)} chunks, {time.time() - started:.0f} s", flush=True)
    print(f"all 2^32 fp32 bit patterns: {failures} chunks with mismatches ({time.time() - started:.0f} s)")
    return failures


if __name__ == "__main__":
    sys.exit(1 if exhaustive() else 0)
