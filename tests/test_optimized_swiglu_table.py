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
