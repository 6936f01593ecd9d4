"""The SwiGLU forward kernel's silu table and its closed forms, against the reference, for every
bf16 gate (CPU: the table's contents are the direct expression by construction; what needs proof is
that outside the table's window the kernel's closed forms equal the reference's silu bit for bit)."""

import torch

from tileproof.optimized.quant import swiglu as kernel
from tileproof.reference.quant_swiglu import swiglu_activation

BF16_INF_BITS = 0x7F80  # a bf16 magnitude above this is a NaN


def _every_bf16_gate() -> tuple[torch.Tensor, torch.Tensor]:
    bits = torch.arange(1 << 16, dtype=torch.int32)
    gate = bits.to(torch.int16).view(torch.bfloat16).float()
    return gate, bits & 0x7FFF


def _same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.equal(actual.view(torch.int32), expected.view(torch.int32))


def test_reference_silu_has_the_kernels_closed_forms_outside_the_table_window():
    gate, magnitude = _every_bf16_gate()
    silu = swiglu_activation(gate, torch.ones_like(gate))  # silu(g) · 1 is silu(g), exactly
    below = magnitude < kernel.TABLE_LOW
    above = (magnitude >= kernel.TABLE_HIGH) & (magnitude <= BF16_INF_BITS)  # NaN excluded
    positive, negative = above & (gate > 0), above & (gate < 0) & torch.isfinite(gate)
    assert below.sum() > 0 and positive.sum() > 0 and negative.sum() > 0
    assert _same_bits(silu[below], gate[below] * 0.5), "|g| < window: silu = g / 2"
    assert _same_bits(silu[positive], gate[positive]), "g >= window (and +Inf): silu = g"
    assert _same_bits(silu[negative], torch.full_like(silu[negative], -0.0)), "finite g <= -window: silu = -0"


def test_table_window_is_what_the_kernel_indexes():
    gate, magnitude = _every_bf16_gate()
    inside = (magnitude >= kernel.TABLE_LOW) & (magnitude < kernel.TABLE_HIGH)
    assert int(inside.sum()) == 2 * kernel.TABLE_WINDOW  # both signs
    assert kernel.SILU_SLOTS == kernel.TABLE_WINDOW + 2  # + one slot below, one above the window
    # The window's edges in value: 2^-26 and 2^7, the bounds the closed forms were derived for.
    assert gate[magnitude == kernel.TABLE_LOW].abs().unique().tolist() == [2.0**-26]
    assert gate[magnitude == kernel.TABLE_HIGH].abs().unique().tolist() == [2.0**7]


def _table_entry(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_from_table``'s word for bf16 bits (int64) and whether the gate is outside the window."""
    offset = torch.clamp((bits & 0x7FFF) - kernel.TABLE_LOW, -1, kernel.TABLE_WINDOW)
    return (offset + 1) * 2 + (bits >> 15), (offset < 0) | (offset >= kernel.TABLE_WINDOW)


def test_fast_window_test_and_words_match_the_table_path():
    """hot_lanes / hot_entry, emulated on every low lane against high lanes at and around the fast
    window's edges, both signs (scratch/swiglu/prove_hot_full.py checks all 2^32 words): a word passes
    the test exactly when both gates are in [2^-25, 2^7), and then each reads silu_from_table's word."""
    low = torch.arange(1 << 16, dtype=torch.int64)
    edges = [0, 1, kernel.HOT_LOW - 1, kernel.HOT_LOW, kernel.HOT_LOW + 1, 0x3F80, kernel.TABLE_HIGH - 1]
    edges += [kernel.TABLE_HIGH, kernel.TABLE_HIGH + 1, 0x7F80, 0x7FC0, 0x7FFF, kernel.TABLE_LOW]
    high = torch.tensor(edges + [0x8000 | e for e in edges], dtype=torch.int64)[:, None]
    assert gate_of(kernel.HOT_LOW) == 2.0**-25 and kernel.HOT_BIAS == kernel.HOT_LOW * 0x10001
    lanes = (((high << 16) | low) - kernel.HOT_BIAS) & 0xFFFFFFFF
    fast = (lanes & kernel.HOT_OUTSIDE_BITS) == 0

    def hot(bits):
        return ((bits & 0x7FFF) >= kernel.HOT_LOW) & ((bits & 0x7FFF) < kernel.TABLE_HIGH)

    assert torch.equal(fast, hot(low) & hot(high))
    assert int(fast.sum()) > 0
    sign_and_slot = lanes >> 15
    low_word = (((lanes & 0xFFF) << 1) | (sign_and_slot & 1)) + kernel.HOT_FIRST_ENTRY
    high_word = ((sign_and_slot & 0x1FFE) | (lanes >> 31)) + kernel.HOT_FIRST_ENTRY
    for words, bits in ((low_word, low.expand_as(lanes)), (high_word, high.expand_as(lanes))):
        entry, outside = _table_entry(bits)
        assert not bool(outside[fast].any())
        assert torch.equal(words[fast], entry[fast])


def gate_of(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()
