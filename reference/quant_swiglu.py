"""Reference twin of the fused SwiGLU + quantization operators (contract §1): the executable specification.

Three operators compute the SwiGLU activation of an expert's up-projection and quantize it (forward),
or compute its gradients and quantize the input gradient (backward). They compute the activation
here and hand it, unchanged, to the public casts of ``quant`` / ``quant_blocks`` (``per_token_cast``,
``per_channel_cast``, ``per_channel_cast_and_transpose``), so their scales and encodings cannot
drift from the plain casts.

The activation (all three operators), for a row ``r`` of ``x = [g | u]``, ``x`` of shape
``[P, 2H]``, ``g = x[:, :H]`` (the gate) and ``u = x[:, H:]`` (the up projection):

- ``g`` and ``u`` are taken to fp32 exactly (bf16 → fp32, or the dequantized fp32 of the backward).
- Optional clamp with ``c = swiglu_clamp_value``, a Python float rounded **once to fp32** (the
  kernels take it as an fp32 argument): ``g ← c`` where ``g > c``; ``u ← c`` where ``u > c`` and
  ``u ← −c`` where ``u < −c``. The comparisons are strict (a value equal to ``c`` is not clamped nor
  counted) and NaN passes through (every comparison with NaN is false). TileKernels' clamp-count
  path does exactly this; its other paths use ``min``/``max`` (CUDA ``fminf``), which would turn a
  NaN into ``c`` — the contract keeps the NaN, so a kernel must select, not ``fminf``.
- ``t = fl(1 + E(−g))``, ``silu = fl(g / t)``, ``a = fl(silu · u)`` and, with a routing weight,
  ``a = fl(a · w)``, in that order, every ``fl`` one IEEE fp32 operation rounded to nearest even.
  ``E(y)`` is ``e^y`` **correctly rounded to fp32**, computed as ``fp32(exp(fp64(y)))``.

Why ``E`` is correctly rounded (where the contract departs from TileKernels): TileKernels evaluates
``expf`` in fp32, which CUDA computes to within 2 ulp — on an H200 it differs from the correctly
rounded value for 31% of random fp32 arguments and 3.6% of bf16 arguments, and PyTorch's CPU
``exp`` differs from both (and between AVX2 and AVX-512 builds). Since one ulp of ``a`` changes an
unrounded block scale whenever it falls on the block's maximum, a spec built on ``expf`` would not
be the same on two machines. ``fp32(exp(fp64(y)))`` is (no mismatch between the CPU and an H200 in
16.8 M arguments; a disagreement needs ``e^y`` within 2^-52 relative of an fp32 rounding midpoint),
and a kernel reproduces it with ``(float)exp((double)y)`` at the cost of one fp64 ``exp`` per
element (+30% time in a naive fp32-output SwiGLU kernel on the H200). ``exp`` is the only
transcendental; every other step is a correctly rounded IEEE operation, the same on every device.

Overflow follows IEEE: ``g ≤ −88.723`` gives ``E(−g) = +inf``, ``t = +inf``, ``silu = −0``; ``g ≥ 16.636``
gives ``E(−g) ≤ 2^-24``, ``t = 1`` exactly, so ``silu = g``.

The backward (``swiglu_backward_and_per_token_cast``) on top of the same steps:

- ``s = fl(1 / t)`` (the sigmoid σ(g)), ``act = fl(fl(g / t) · u)`` (not weighted), ``out = fl(act · w)``;
- ``gw = fl(fl(go · w) · s)`` with ``go = fp32(grad_out)``;
- ``dg = fl(fl(gw · u) · fma(g, fl(1 − s), 1))`` — ``1 + g(1 − s)`` is one fused multiply-add (one
  rounding), as nvcc contracts it in the kernels — and ``dg = +0`` where ``g`` was clamped;
- ``du = fl(gw · g)``, and ``du = +0`` where ``u`` was clamped (above or below);
- ``dweight[t, j] = Σ_h go · act`` over the row ``p = token_topk_to_pos[t, j]``.

These are the exact derivatives of ``out = silu(g) · u · w`` with the clamp (``d silu/dg = σ(g)(1 +
g(1 − σ(g)))``; a clamped input has zero derivative); ``tests/test_reference_quant_swiglu.py`` proves
the formulas with ``torch.autograd.gradcheck`` in float64. ``swiglu_activation`` and
``swiglu_gradients`` compute in the dtype they are given: in fp32 they are the spec's exact operation
sequence, in float64 the high-precision evaluation the oracle measures float outputs against.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .contract import (
    CAST_INPUT_DTYPES,
    E4M3,
    ScaleLayout,
    check_cast_format,
    check_choice,
    check_int,
    check_num_per_tokens,
    check_per_token_blocks,
    check_scale_flags,
    check_scale_tensor,
    check_tensor,
    check_unit_inner_stride,
)
from .moe import fma_fp32
from .quant import cast_back, per_token_cast
from .quant_blocks import per_channel_cast, per_channel_cast_and_transpose

__all__ = [
    "swiglu_forward_and_per_token_cast",
    "swiglu_forward_and_per_channel_cast_and_transpose",
    "swiglu_backward_and_per_token_cast",
    "exp_rounded",
    "swiglu_clamp",
    "swiglu_activation",
    "swiglu_gradients",
]

INDEX_DTYPES = (torch.int32, torch.int64)
# The forward's per-token blocks: 128 channels or the whole row (TileKernels' two cases).
FORWARD_CHANNEL_BLOCK = 128
# The backward's per-token blocks of the input and of the gradient (TileKernels: 32 or 128).
BACKWARD_CHANNEL_BLOCKS = (32, 128)
# The three clamp counters: gate above c, up above c, up below -c.
CLAMP_COUNTERS = 3


# ---------------------------------------------------------------------------------------------
# The math, in the dtype of its inputs (fp32: the spec; float64: the high-precision evaluation)
# ---------------------------------------------------------------------------------------------


def exp_rounded(y: torch.Tensor) -> torch.Tensor:
    """``e^y`` rounded once to ``y``'s dtype.

    fp32: ``fp32(exp(fp64(y)))``, the correctly rounded value (the fp64 ``exp`` is within one fp64
    ulp, 29 bits finer than the fp32 rounding it feeds). float64: ``torch.exp`` itself.
    """
    if y.dtype == torch.float32:
        return torch.exp(y.to(torch.float64)).to(torch.float32)
    return torch.exp(y)


def _one_plus_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``1 + a·b`` rounded once (a fused multiply-add) in fp32; plain arithmetic in float64."""
    one = torch.ones_like(a)
    if a.dtype == torch.float32:
        return fma_fp32(a, b, one)
    return a * b + one


def _clamp_value(clamp_value: float, dtype: torch.dtype) -> float:
    """The clamp as the kernels see it: rounded once to fp32 (then exact in fp32 or float64)."""
    return float(torch.tensor(clamp_value, dtype=torch.float32).to(dtype))


def swiglu_clamp(
    gate: torch.Tensor, up: torch.Tensor, clamp_value: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clamp the gate from above and the up projection on both sides, with ``c = fp32(clamp_value)``.

    Returns ``(gate, up, gate_above, up_above, up_below)``: the clamped values (same dtype) and the
    boolean masks of the elements that were clamped (``g > c``, ``u > c``, ``u < −c``; strict, NaN
    never clamped). Without a clamp value the inputs come back unchanged with all-false masks.
    """
    if clamp_value is None:
        nothing = torch.zeros_like(gate, dtype=torch.bool)
        return gate, up, nothing, nothing, nothing
    c = _clamp_value(clamp_value, gate.dtype)
    gate_above, up_above, up_below = gate > c, up > c, up < -c
    gate = torch.where(gate_above, torch.full_like(gate, c), gate)
    up = torch.where(up_above, torch.full_like(up, c), up)
    up = torch.where(up_below, torch.full_like(up, -c), up)
    return gate, up, gate_above, up_above, up_below


def swiglu_activation(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(g) · u (· w)`` as ``fl(fl(fl(g / fl(1 + E(−g))) · u) · w)``, in the inputs' dtype.

    ``gate``, ``up``: ``[P, H]`` (already clamped); ``weight``: ``[P, 1]`` (one per row) or None.
    """
    denominator = torch.ones_like(gate) + exp_rounded(-gate)
    silu = gate / denominator
    activation = silu * up
    return activation if weight is None else activation * weight


def swiglu_gradients(
    gate: torch.Tensor,
    up: torch.Tensor,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    gate_clamped: torch.Tensor,
    up_clamped: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SwiGLU backward in the inputs' dtype: ``(act, out, d_gate, d_up)``, each ``[P, H]``.

    ``gate``, ``up``: ``[P, H]``, already clamped; ``grad_out``: ``[P, H]`` in the same dtype;
    ``weight``: ``[P, 1]``; ``gate_clamped``, ``up_clamped``: boolean ``[P, H]`` (the gradient is
    zero there). ``act = silu(g)·u``, ``out = act·w``, ``d_gate = go·w·s·u·(1 + g(1 − s))``,
    ``d_up = go·w·g·s`` with ``s = σ(g)``, in the order and roundings of the module docstring.
    """
    one = torch.ones_like(gate)
    denominator = one + exp_rounded(-gate)
    act = gate / denominator * up
    sigmoid = one / denominator
    grad_weighted = grad_out * weight * sigmoid
    d_gate = grad_weighted * up * _one_plus_product(gate, one - sigmoid)
    d_up = grad_weighted * gate
    zero = torch.zeros_like(gate)
    d_gate = torch.where(gate_clamped, zero, d_gate)
    d_up = torch.where(up_clamped, zero, d_up)
    return act, act * weight, d_gate, d_up


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def check_on_device(name: str, value: torch.Tensor, device: torch.device) -> None:
    if value.device != device and not (value.device.type == device.type == "cuda"):
        raise ValueError(f"{name} must be on {device} (the device of x), got {value.device}")


def check_gate_up(name: str, x: torch.Tensor) -> int:
    """``x = [g | u]`` must have an even, non-zero number of columns; return H."""
    columns = x.shape[1]
    if columns == 0 or columns % 2:
        raise ValueError(
            f"{name} holds the gate and up halves [g | u]: its column count must be even and non-zero, got {columns}"
        )
    return columns // 2


def check_clamp(swiglu_clamp_value) -> float | None:
    if swiglu_clamp_value is None:
        return None
    if isinstance(swiglu_clamp_value, bool) or not isinstance(swiglu_clamp_value, (int, float)):
        raise TypeError(f"swiglu_clamp_value must be a float or None, got {type(swiglu_clamp_value).__name__}")
    if not (math.isfinite(swiglu_clamp_value) and swiglu_clamp_value > 0):
        raise ValueError(f"swiglu_clamp_value must be a finite float > 0 or None, got {swiglu_clamp_value!r}")
    return float(swiglu_clamp_value)


def check_index_vector(name: str, value, rows: int, device: torch.device) -> torch.Tensor:
    check_tensor(name, value, dtypes=INDEX_DTYPES, ndim=1)
    if value.shape[0] != rows:
        raise ValueError(f"{name} must have shape ({rows},) (one entry per row of x), got {tuple(value.shape)}")
    check_on_device(name, value, device)
    return value


def check_index_range(name: str, value: torch.Tensor, high: int, meaning: str) -> None:
    """Every entry in ``[-1, high)``; -1 marks padding."""
    if value.numel() == 0:
        return
    smallest, largest = int(value.min()), int(value.max())
    if smallest < -1 or largest >= high:
        raise ValueError(
            f"{name} entries must be in [-1, {high}) ({meaning}; -1: padding), got values in [{smallest}, {largest}]"
        )


def check_topk_weights(name: str, value, device: torch.device) -> torch.Tensor:
    check_tensor(name, value, dtypes=(torch.float32,), ndim=2)
    check_on_device(name, value, device)
    return value


def _row_weights(topk_weights: torch.Tensor, pos_to_token_topk: torch.Tensor) -> torch.Tensor:
    """fp32 ``[P, 1]``: ``topk_weights.flatten()[pos_to_token_topk[r]]``, 0 where the index is -1."""
    flat = topk_weights.reshape(-1)
    index = pos_to_token_topk.to(torch.int64)
    valid = index >= 0
    weights = torch.zeros(index.shape[0], dtype=torch.float32, device=flat.device)
    weights[valid] = flat[index[valid]]
    return weights.unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# Forward + per-token cast
# ---------------------------------------------------------------------------------------------


def swiglu_forward_and_per_token_cast(
    x: torch.Tensor,
    fmt: str,
    num_per_channels: int,
    pos_to_token_topk: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    pos_to_expert: torch.Tensor | None = None,
    use_tma_aligned_col_major_sf: bool = False,
    round_sf: bool = False,
    use_packed_ue8m0: bool = False,
    swiglu_clamp_value: float | None = None,
    clamped_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU of each row, optionally weighted by its routing weight, quantized per token.

    ``a = silu(g) · u · w`` (module docstring: fp32, in that order, ``exp`` correctly rounded), kept
    in **fp32** — not rounded to bf16 — and cast exactly as ``per_token_cast(a, fmt,
    num_per_channels, use_tma_aligned_col_major_sf=..., round_sf=..., use_packed_ue8m0=...)`` casts
    it (same scale rule, encodings and layouts).

    Args:
        x: bf16 or fp32 ``[P, 2H]``, ``[g | u]``; unit stride along the columns, any row stride.
        fmt: ``"e4m3"`` (data float8_e4m3fn ``[P, H]``) or ``"e2m1"`` (int8 ``[P, H/2]``, H even).
            TileKernels writes e4m3 only; e2m1 is the same cast with the other encoding.
        num_per_channels: 128 or H. With 128 the last block of a row is partial when 128 does not
            divide H (TileKernels requires ``H % 128 == 0``; the contract allows any H, as
            ``per_token_cast`` does).
        pos_to_token_topk: int32/int64 ``[P]``, the flat ``(token, slot)`` index ``t·k + j`` of each
            row into ``topk_weights``, or -1. Given together with ``topk_weights`` or not at all.
            A row whose index is -1 (and that is not skipped as padding) gets ``w = 0``, as in
            TileKernels' PyTorch reference (its kernel reads an unset weight there).
        topk_weights: fp32 ``[T, k]``: ``w = topk_weights.flatten()[pos_to_token_topk[r]]``.
        pos_to_expert: int32/int64 ``[P]`` or None. Rows with ``pos_to_expert < 0`` are padding and
            are skipped: not computed, not counted, and **not written** by TileKernels (their data
            and scales are whatever ``torch.empty`` held). The contract leaves those rows
            unspecified; this reference writes zero bytes there (data 0, scale 0) so that its own
            output is deterministic, and the oracle compares only the other rows.
        use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: the scale layout and rounding,
            exactly as for ``per_token_cast``.
        swiglu_clamp_value: None or a finite float ``> 0``: the clamp of the module docstring.
        clamped_count: None or int64 ``[3]`` on x's device (needs a clamp value): incremented **in
            place** by ``[#(g > c), #(u > c), #(u < −c)]`` over the non-padding rows.

    Returns:
        ``(q, sf)`` as ``per_token_cast`` returns them for ``a`` of shape ``[P, H]``.
    """
    spec = check_cast_format(fmt)
    check_tensor("x", x, dtypes=CAST_INPUT_DTYPES, ndim=2)
    check_unit_inner_stride("x", x)
    rows, hidden = x.shape[0], check_gate_up("x", x)
    check_int("num_per_channels", num_per_channels)
    if num_per_channels not in (FORWARD_CHANNEL_BLOCK, hidden):
        raise ValueError(
            f"num_per_channels must be {FORWARD_CHANNEL_BLOCK} or the hidden size {hidden}, got {num_per_channels}"
        )
    check_per_token_blocks(spec, hidden, num_per_channels)  # e2m1: H and C even
    check_scale_flags(spec, round_sf, use_packed_ue8m0, use_tma_aligned_col_major_sf)
    if (pos_to_token_topk is None) != (topk_weights is None):
        raise ValueError(
            "pos_to_token_topk and topk_weights must be given together (the weight of row r is "
            "topk_weights.flatten()[pos_to_token_topk[r]]) or both be None"
        )
    if pos_to_token_topk is not None:
        check_index_vector("pos_to_token_topk", pos_to_token_topk, rows, x.device)
        check_topk_weights("topk_weights", topk_weights, x.device)
        check_index_range("pos_to_token_topk", pos_to_token_topk, topk_weights.numel(), "flat indices t·k + j")
    if pos_to_expert is not None:
        check_index_vector("pos_to_expert", pos_to_expert, rows, x.device)
    clamp_value = check_clamp(swiglu_clamp_value)
    if clamped_count is not None:
        if clamp_value is None:
            raise ValueError("clamped_count counts clamped elements: it needs a swiglu_clamp_value")
        check_tensor("clamped_count", clamped_count, dtypes=(torch.int64,), ndim=1)
        if clamped_count.shape[0] != CLAMP_COUNTERS:
            raise ValueError(f"clamped_count must have shape ({CLAMP_COUNTERS},), got {tuple(clamped_count.shape)}")
        check_on_device("clamped_count", clamped_count, x.device)

    values = x.to(torch.float32)
    gate, up = values[:, :hidden], values[:, hidden:]
    gate, up, gate_above, up_above, up_below = swiglu_clamp(gate, up, clamp_value)
    weight = None if topk_weights is None else _row_weights(topk_weights, pos_to_token_topk)
    activation = swiglu_activation(gate, up, weight)

    padding = torch.zeros(rows, dtype=torch.bool, device=x.device)
    if pos_to_expert is not None:
        padding = pos_to_expert < 0
    if clamped_count is not None:
        computed = ~padding.unsqueeze(1)
        counts = torch.stack([(mask & computed).sum() for mask in (gate_above, up_above, up_below)])
        clamped_count += counts.to(clamped_count.device)

    # Padding rows are never computed: their activation must not reach the cast (a row's scales
    # depend on that row only, so zeroing them here and in the outputs below changes nothing else).
    activation = torch.where(padding.unsqueeze(1), torch.zeros_like(activation), activation)
    q, sf = per_token_cast(
        activation,
        fmt,
        num_per_channels,
        use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
        round_sf=round_sf,
        use_packed_ue8m0=use_packed_ue8m0,
    )
    q.view(torch.uint8)[padding] = 0
    sf[padding] = 0
    return q, sf


# ---------------------------------------------------------------------------------------------
# Forward + per-channel cast (+ transpose)
# ---------------------------------------------------------------------------------------------


def swiglu_forward_and_per_channel_cast_and_transpose(
    x: torch.Tensor,
    fmt: str,
    num_per_tokens: int,
    round_sf: bool = False,
    without_transpose: bool = False,
    swiglu_clamp_value: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU of each row, rounded to bf16, quantized per channel and (by default) transposed.

    ``a = silu(g) · u`` (module docstring: fp32, optional clamp, no weights), then **rounded to
    bf16** (nearest even; TileKernels stages it in shared memory as bf16), then cast exactly as
    ``per_channel_cast_and_transpose(a_bf16, fmt, num_per_tokens, round_sf)`` casts it, or as
    ``per_channel_cast(a_bf16, fmt, num_per_tokens, round_sf)`` with ``without_transpose``.

    Args:
        x: bf16 ``[T, 2H]``, ``[g | u]``, unit stride along the columns, any row stride.
        fmt: ``"e4m3"`` (the only format of the transposed per-channel cast).
        num_per_tokens: 32 or 128 tokens per scale. The last block of a column is partial when T is
            not a multiple (its missing tokens count as zeros); TileKernels requires
            ``T % 128 == 0``, the contract allows any T, as ``per_channel_cast`` does.
        round_sf: round every scale up to a power of two.
        without_transpose: return the data ``[T, H]`` instead of ``[H, T]``.
        swiglu_clamp_value: None or a finite float ``> 0`` (no clamp counter here).

    Returns:
        ``(q, sf)``: q float8_e4m3fn ``[H, T]`` contiguous (``q[h, t]`` the code of ``a[t, h]``), or
        ``[T, H]`` with ``without_transpose``; sf fp32 row-major ``[ceil(T / num_per_tokens), H]``.
    """
    check_choice("fmt", fmt, (E4M3.name,))
    check_num_per_tokens(num_per_tokens)
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=2)
    check_unit_inner_stride("x", x)
    hidden = check_gate_up("x", x)
    check_scale_flags(E4M3, round_sf, False)
    if not isinstance(without_transpose, bool):
        raise TypeError(f"without_transpose must be a bool, got {type(without_transpose).__name__}")
    clamp_value = check_clamp(swiglu_clamp_value)

    values = x.to(torch.float32)
    gate, up, *_ = swiglu_clamp(values[:, :hidden], values[:, hidden:], clamp_value)
    activation = swiglu_activation(gate, up).to(torch.bfloat16)
    if without_transpose:
        return per_channel_cast(activation, fmt, num_per_tokens, round_sf)
    return per_channel_cast_and_transpose(activation, fmt, num_per_tokens, round_sf)


# ---------------------------------------------------------------------------------------------
# Backward + per-token cast of the input gradient
# ---------------------------------------------------------------------------------------------


def _check_inverse_mappings(pos_to_token_topk: torch.Tensor, token_topk_to_pos: torch.Tensor) -> None:
    """Row p holds slot i exactly when slot i lands on row p (get_fused_mapping's two views)."""
    slot_of_row = pos_to_token_topk.to(torch.int64)
    row_of_slot = token_topk_to_pos.reshape(-1).to(torch.int64)
    rows_with_slot = (slot_of_row >= 0).nonzero().flatten()
    slots_with_row = (row_of_slot >= 0).nonzero().flatten()
    row_back = row_of_slot[slot_of_row[rows_with_slot]]
    slot_back = slot_of_row[row_of_slot[slots_with_row]]
    if not (torch.equal(row_back, rows_with_slot) and torch.equal(slot_back, slots_with_row)):
        raise ValueError(
            "pos_to_token_topk and token_topk_to_pos must be inverse mappings: "
            "pos_to_token_topk[p] == t·k + j exactly when token_topk_to_pos[t, j] == p"
        )


class BackwardInputs(NamedTuple):
    """``swiglu_backward_and_per_token_cast``'s inputs, checked (``check_backward_inputs``)."""

    x_q: torch.Tensor
    x_sf: torch.Tensor
    rows: int
    hidden: int
    kblocks: int


def check_backward_inputs(
    x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels: int
) -> BackwardInputs:
    """The backward's argument checks that need no device data (types, dtypes, shapes, strides,
    devices): shared by both twins; the mappings' ranges and inverse relation are the reference's
    alone (they read the index data: a device synchronization)."""
    if not (isinstance(x, (tuple, list)) and len(x) == 2):
        raise TypeError(f"x must be a (x_q, x_sf) pair, got {type(x).__name__}")
    x_q, x_sf = x
    check_tensor("x[0]", x_q, dtypes=(torch.float8_e4m3fn,), ndim=2)
    check_unit_inner_stride("x[0]", x_q)
    rows, hidden = x_q.shape[0], check_gate_up("x[0]", x_q)
    check_int("num_per_channels", num_per_channels)
    if num_per_channels not in BACKWARD_CHANNEL_BLOCKS:
        raise ValueError(f"num_per_channels must be one of {BACKWARD_CHANNEL_BLOCKS}, got {num_per_channels}")
    if hidden % num_per_channels:
        raise ValueError(
            f"the hidden size {hidden} must be a multiple of num_per_channels ({num_per_channels}), so that no "
            "scale block spans both halves [g | u]"
        )
    kblocks = 2 * hidden // num_per_channels
    check_scale_tensor("x[1]", x_sf, rows=rows, kblocks=kblocks, layout=ScaleLayout("row_major"), device=x_q.device)
    check_tensor("grad_out", grad_out, dtypes=(torch.bfloat16,), ndim=2)
    check_unit_inner_stride("grad_out", grad_out)
    if tuple(grad_out.shape) != (rows, hidden):
        raise ValueError(f"grad_out must have shape {(rows, hidden)}, got {tuple(grad_out.shape)}")
    check_on_device("grad_out", grad_out, x_q.device)
    check_topk_weights("weight", weight, x_q.device)
    check_index_vector("pos_to_token_topk", pos_to_token_topk, rows, x_q.device)
    check_tensor("token_topk_to_pos", token_topk_to_pos, dtypes=INDEX_DTYPES, ndim=2)
    if token_topk_to_pos.shape != weight.shape:
        raise ValueError(
            f"token_topk_to_pos must have weight's shape {tuple(weight.shape)}, got {tuple(token_topk_to_pos.shape)}"
        )
    check_on_device("token_topk_to_pos", token_topk_to_pos, x_q.device)
    return BackwardInputs(x_q, x_sf, rows, hidden, kblocks)


def swiglu_backward_and_per_token_cast(
    x,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    pos_to_token_topk: torch.Tensor,
    token_topk_to_pos: torch.Tensor,
    num_per_channels: int,
    round_sf: bool = False,
    swiglu_clamp_value: float | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Backward of ``out = silu(g) · u · w`` from the quantized forward input, dx also quantized.

    ``g, u`` are the fp32 dequantized halves of ``x`` (``decode(q) · sf``, one rounding), clamped as
    in the forward; ``w`` is row r's weight ``weight.flatten()[pos_to_token_topk[r]]`` (0 where the
    index is -1: padding rows are computed like any other and give zero gradients). The formulas,
    their order and roundings are in the module docstring.

    Args:
        x: ``(x_q, x_sf)``: x_q float8_e4m3fn ``[P, 2H]`` (unit inner stride), x_sf fp32 row-major
            ``[P, 2H / C]``, as ``per_token_cast(x, "e4m3", C)`` makes them.
        grad_out: bf16 ``[P, H]``, unit inner stride.
        weight: fp32 ``[T, k]``, the routing weights.
        pos_to_token_topk: int32/int64 ``[P]``, entries in ``[-1, T·k)``.
        token_topk_to_pos: int32/int64 ``[T, k]``, entries in ``[-1, P)``; the inverse of
            ``pos_to_token_topk`` (checked).
        num_per_channels: C, 32 or 128, dividing H: the block of x's scales and of dx's.
        round_sf: round dx's scales up to powers of two.
        swiglu_clamp_value: None or a finite float ``> 0``, the forward's clamp.

    Returns:
        ``(out, (dx_q, dx_sf), dx, dweight)``:

        - ``out`` bf16 ``[P, H]``: ``fl(act · w)`` rounded to nearest even;
        - ``(dx_q, dx_sf)``: ``per_token_cast([dg | du], "e4m3", C, round_sf=round_sf)`` of the **fp32**
          gradients (float8_e4m3fn ``[P, 2H]``, fp32 row-major ``[P, 2H / C]``);
        - ``dx`` bf16 ``[P, 2H]``: ``[dg | du]`` rounded to nearest even;
        - ``dweight`` fp32 ``[T, k]``: ``Σ_h go · act`` over row ``token_topk_to_pos[t, j]``,
          accumulated in fp64 and rounded once (0 where the slot has no row).
    """
    x_q, x_sf, rows, hidden, _ = check_backward_inputs(
        x, grad_out, weight, pos_to_token_topk, token_topk_to_pos, num_per_channels
    )
    check_index_range("pos_to_token_topk", pos_to_token_topk, weight.numel(), "flat indices t·k + j")
    check_index_range("token_topk_to_pos", token_topk_to_pos, rows, "rows of x")
    _check_inverse_mappings(pos_to_token_topk, token_topk_to_pos)
    round_sf = check_scale_flags(E4M3, round_sf, False)
    clamp_value = check_clamp(swiglu_clamp_value)

    values = cast_back((x_q, x_sf), "fp32", (1, num_per_channels))
    gate, up, gate_above, up_above, up_below = swiglu_clamp(values[:, :hidden], values[:, hidden:], clamp_value)
    row_weight = _row_weights(weight, pos_to_token_topk)
    go = grad_out.to(torch.float32)
    act, out, d_gate, d_up = swiglu_gradients(gate, up, go, row_weight, gate_above, up_above | up_below)

    dx_fp32 = torch.cat([d_gate, d_up], dim=1)
    dx_q, dx_sf = per_token_cast(dx_fp32, E4M3.name, num_per_channels, round_sf=round_sf)

    # Each product go·act is exact in fp64 (8 + 24 significant bits); only the sum rounds.
    row_sums = (go.to(torch.float64) * act.to(torch.float64)).sum(dim=1)
    slot_rows = token_topk_to_pos.to(torch.int64)
    has_row = slot_rows >= 0
    dweight = torch.zeros(weight.shape, dtype=torch.float64, device=weight.device)
    dweight[has_row] = row_sums[slot_rows[has_row]]
    return out.to(torch.bfloat16), (dx_q, dx_sf), dx_fp32.to(torch.bfloat16), dweight.to(torch.float32)
