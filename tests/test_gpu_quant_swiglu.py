"""GPU: the optimized fused SwiGLU casts agree bit for bit with the reference twin.

Padding rows (``pos_to_expert < 0``) are unspecified by the contract and not written by the kernel:
under ``poison_outputs`` they must still hold the poison, and every other row must match the
reference. ``clamped_count`` is compared after both twins added to equal starting counters.
"""

import pytest
import torch

import tileproof.reference.quant_swiglu as reference
from tileproof.optimized.jit import poison_outputs
from tileproof.oracle.policy import meaningful_strides

pytestmark = pytest.mark.gpu

FLAG_SETS = {
    "plain": {},
    "round": {"round_sf": True},
    "colmajor": {"use_tma_aligned_col_major_sf": True},
    "packed": {"use_tma_aligned_col_major_sf": True, "use_packed_ue8m0": True},
}
TOPK = 4
# Gates the activation treats differently: zeros, a subnormal, outside the kernel's exp table
# (2^-16 .. 2^8), t = 1 (g > 16.64), E overflow (g < -88.72), NaN and ±Inf.
SPECIAL_GATES = (0.0, -0.0, 1e-40, 2.0**-20, 17.0, -100.0, 300.0, -300.0, float("nan"), float("inf"), -float("inf"))


def _optimized():
    import tileproof.optimized.quant as optimized

    return optimized


def _x(rows, hidden, dtype, row_padding, generator, specials=True):
    gate = torch.randn(rows, hidden, generator=generator) * 4
    up = torch.randn(rows, hidden, generator=generator) * 2
    if rows and specials:
        where = torch.randint(0, gate.numel(), (max(1, gate.numel() // 32),), generator=generator).unique()
        choice = torch.randint(0, len(SPECIAL_GATES), where.shape, generator=generator)
        gate.view(-1)[where] = torch.tensor(SPECIAL_GATES)[choice]
        up[0] *= 1e-6  # a row below e4m3's amax floor
    wide = torch.full((rows, 2 * hidden + row_padding), float("nan"))
    wide[:, : 2 * hidden] = torch.cat([gate, up], dim=1)
    return wide.to(dtype).cuda()[:, : 2 * hidden]


def _routing(rows, routing, index_dtype, generator):
    kwargs = {}
    if "weights" in routing:
        tokens = rows // TOPK + 1
        slots = torch.randperm(tokens * TOPK, generator=generator)[:rows]
        slots[torch.arange(rows) % 5 == 3] = -1
        kwargs["pos_to_token_topk"] = slots.to(index_dtype).cuda()
        kwargs["topk_weights"] = (torch.rand(tokens, TOPK, generator=generator) * 2 - 0.5).cuda()
    if "padding" in routing:
        experts = torch.randint(0, 8, (rows,), generator=generator)
        experts[torch.arange(rows) % 8 == 7] = -1
        if rows:
            experts[-1] = -(2**40) if index_dtype == torch.int64 else -1  # an int64 whose low word is 0
        kwargs["pos_to_expert"] = experts.to(index_dtype).cuda()
    return kwargs


def _bytes(tensor):
    # A fresh copy with the default strides: .contiguous() keeps a size-1 dimension's stride (a
    # one-column column-major scale tensor has stride (1, T)), which view(uint8) refuses.
    return tensor.new_empty(tensor.shape).copy_(tensor).view(torch.uint8)


def _assert_same_bits(actual, expected, what, rows=None):
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    if actual.numel():
        assert meaningful_strides(actual) == meaningful_strides(expected), what
        a, e = _bytes(actual), _bytes(expected)
        if rows is not None:
            a, e = a[rows], e[rows]
        mismatch = (a != e).nonzero()
        assert mismatch.numel() == 0, f"{what}: {mismatch.shape[0]} bytes differ, first at {mismatch[0].tolist()}"


FORWARD_SHAPES = [(0, 256, 0), (1, 2048, 0), (37, 96, 0), (130, 320, 64), (300, 1000, 0), (64, 7168, 0)]
FORWARD_CASES = [
    (rows, hidden, padding, C, fmt, dtype, flags)
    for rows, hidden, padding in FORWARD_SHAPES
    for C in ("128", "H")
    for fmt in ("e4m3", "e2m1")
    for dtype in (torch.bfloat16, torch.float32)
    for flags in FLAG_SETS
    if not (padding and flags != "plain")
] + [
    (45, 333, 1, "128", "e4m3", torch.bfloat16, "plain"),  # odd H and row stride: 1-element vectors
    (21, 10, 1, "H", "e2m1", torch.float32, "round"),  # odd row stride: 1-element loads, 1-byte stores
    (5, 20480, 0, "H", "e4m3", torch.bfloat16, "packed"),  # row scales over more than 16384 values
]
ROUTING = ["", "weights", "padding", "weights+padding"]


@pytest.mark.parametrize("rows,hidden,padding,C,fmt,dtype,flags", FORWARD_CASES)
def test_swiglu_forward_and_per_token_cast_matches_reference(rows, hidden, padding, C, fmt, dtype, flags):
    optimized = _optimized()
    seed = rows * 1_000_003 + hidden * 131 + len(flags) + (fmt == "e2m1") + 2 * (dtype == torch.float32)
    generator = torch.Generator().manual_seed(seed)
    x = _x(rows, hidden, dtype, padding, generator)
    num_per_channels = 128 if C == "128" else hidden
    routing = ROUTING[seed % len(ROUTING)]
    index_dtype = (torch.int32, torch.int64)[seed // 4 % 2]
    kwargs = {**FLAG_SETS[flags], **_routing(rows, routing, index_dtype, generator)}
    clamp = (None, 4.0, 5.3)[seed % 3]
    if clamp is not None:
        kwargs["swiglu_clamp_value"] = clamp
    start = torch.tensor([5, 7, 11], dtype=torch.int64, device="cuda")
    expected_count, count = start.clone(), start.clone()
    if clamp is not None:
        expected_q, expected_sf = reference.swiglu_forward_and_per_token_cast(
            x, fmt, num_per_channels, clamped_count=expected_count, **kwargs
        )
    else:
        expected_q, expected_sf = reference.swiglu_forward_and_per_token_cast(x, fmt, num_per_channels, **kwargs)
    with poison_outputs():
        if clamp is not None:
            q, sf = optimized.swiglu_forward_and_per_token_cast(x, fmt, num_per_channels, clamped_count=count, **kwargs)
        else:
            q, sf = optimized.swiglu_forward_and_per_token_cast(x, fmt, num_per_channels, **kwargs)
    computed = torch.ones(rows, dtype=torch.bool, device="cuda")
    if "pos_to_expert" in kwargs:
        computed = kwargs["pos_to_expert"] >= 0
    _assert_same_bits(q, expected_q, "q", computed)
    _assert_same_bits(sf, expected_sf, "sf", computed)
    assert torch.equal(count, expected_count), (count, expected_count)
    # Padding rows are not written: they still hold the poison.
    assert bool((q.view(torch.uint8)[~computed] == 0xFF).all())


def test_every_bf16_gate_matches_reference():
    """All 2^16 bf16 bit patterns as gates (the kernel's exp table, its window edges, the direct
    path for everything else), up = 1 and 3, through both the per-token and the per-channel paths."""
    gates = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    for up in (1.0, 3.0):
        x = torch.cat([gates, torch.full_like(gates, up)], dim=1).cuda()
        expected = reference.swiglu_forward_and_per_token_cast(x, "e4m3", 128)
        actual = _optimized().swiglu_forward_and_per_token_cast(x, "e4m3", 128)
        for a, e, what in zip(actual, expected, ("q", "sf"), strict=True):
            _assert_same_bits(a, e, what)
        expected = reference.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32, without_transpose=True)
        actual = _optimized().swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", 32, without_transpose=True)
        for a, e, what in zip(actual, expected, ("q", "sf"), strict=True):
            _assert_same_bits(a, e, what)


def test_clamp_counts_and_int64_padding_sign():
    """Counts add to the counter (not overwrite it) and skip padding rows; an int64 pos_to_expert of
    -2^40 (low word 0) is padding: the kernel reads the sign from the high word."""
    generator = torch.Generator().manual_seed(3)
    x = _x(1000, 512, torch.bfloat16, 0, generator)
    experts = torch.randint(0, 4, (1000,), generator=generator)
    experts[::3] = -(2**40)
    experts = experts.cuda()
    counts = torch.tensor([1, 2, 3], dtype=torch.int64, device="cuda")
    expected = counts.clone()
    kwargs = {"pos_to_expert": experts, "swiglu_clamp_value": 2.5}
    reference.swiglu_forward_and_per_token_cast(x, "e4m3", 128, clamped_count=expected, **kwargs)
    _optimized().swiglu_forward_and_per_token_cast(x, "e4m3", 128, clamped_count=counts, **kwargs)
    assert torch.equal(counts, expected), (counts, expected)


@pytest.mark.parametrize("rows,hidden,padding", [(0, 64, 0), (1, 64, 0), (33, 48, 16), (300, 96, 0), (4099, 1040, 32)])
@pytest.mark.parametrize("num_per_tokens", [32, 128])
@pytest.mark.parametrize("transpose", [True, False])
def test_swiglu_forward_and_per_channel_cast_matches_reference(rows, hidden, padding, num_per_tokens, transpose):
    optimized = _optimized()
    if transpose and not hasattr(optimized, "per_channel_cast_and_transpose"):
        pytest.skip("the optimized per_channel_cast_and_transpose does not exist yet")
    generator = torch.Generator().manual_seed(rows * 7 + hidden + num_per_tokens)
    x = _x(rows, hidden, torch.bfloat16, padding, generator)
    kwargs = {"round_sf": rows % 2 == 1, "without_transpose": not transpose}
    if rows % 3 == 0:
        kwargs["swiglu_clamp_value"] = 4.0
    expected_q, expected_sf = reference.swiglu_forward_and_per_channel_cast_and_transpose(
        x, "e4m3", num_per_tokens, **kwargs
    )
    with poison_outputs():
        q, sf = optimized.swiglu_forward_and_per_channel_cast_and_transpose(x, "e4m3", num_per_tokens, **kwargs)
    _assert_same_bits(q, expected_q, "q")
    _assert_same_bits(sf, expected_sf, "sf")


def test_grid_size_does_not_change_results(monkeypatch):
    """The persistent grid is sized by the SM count: fewer SMs, same bytes and counts."""
    generator = torch.Generator().manual_seed(11)
    x = _x(2049, 2048, torch.bfloat16, 0, generator)
    kwargs = {"swiglu_clamp_value": 3.0, **_routing(2049, "weights+padding", torch.int32, generator)}
    results = []
    for limit in (None, "7"):
        if limit:
            monkeypatch.setenv("TILEPROOF_SM_LIMIT", limit)
        counts = torch.zeros(3, dtype=torch.int64, device="cuda")
        q, sf = _optimized().swiglu_forward_and_per_token_cast(x, "e4m3", 128, clamped_count=counts, **kwargs)
        computed = kwargs["pos_to_expert"] >= 0
        results.append((q.view(torch.uint8)[computed], sf.view(torch.int32)[computed], counts))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)  # integer views: the NaN gates' scales compare by their bits


def _backward_inputs(rows, hidden, C, q_padding, go_padding, generator):
    import tileproof.reference.quant as reference_quant

    values = torch.clamp(torch.randn(rows, 2 * hidden, generator=generator) * 2, -8, 8)
    if rows:
        values[0, : min(hidden, 4)] = torch.tensor([-100.0, 30.0, 0.0, -1.2785][: min(hidden, 4)])
    x_q, x_sf = reference_quant.per_token_cast(values.cuda(), "e4m3", C)
    wide = torch.zeros((rows, 2 * hidden + q_padding), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    wide[:, : 2 * hidden] = x_q
    grad = torch.zeros((rows, hidden + go_padding), dtype=torch.bfloat16, device="cuda")
    grad[:, :hidden] = torch.randn(rows, hidden, generator=generator).to(torch.bfloat16).cuda()
    tokens = max(1, rows // TOPK + 1)
    slots = tokens * TOPK
    chosen_slots = torch.randperm(slots, generator=generator)[: max(0, min(rows, slots) - rows // 6)]
    chosen_rows = torch.randperm(rows, generator=generator)[: chosen_slots.numel()]
    pos_to_token_topk = torch.full((rows,), -1, dtype=torch.int32)
    token_topk_to_pos = torch.full((slots,), -1, dtype=torch.int64)
    pos_to_token_topk[chosen_rows] = chosen_slots.to(torch.int32)
    token_topk_to_pos[chosen_slots] = chosen_rows
    weight = torch.rand(tokens, TOPK, generator=generator) + 0.25
    return (
        (wide[:, : 2 * hidden], x_sf),
        grad[:, :hidden],
        weight.cuda(),
        pos_to_token_topk.cuda(),
        token_topk_to_pos.reshape(tokens, TOPK).cuda(),
    )


BACKWARD_CASES = [
    (rows, hidden, C, padding)
    for rows, hidden in [(0, 128), (1, 32), (37, 128), (130, 256), (999, 1024), (64, 2048), (3, 12288)]
    for C in (32, 128)
    for padding in (0, 8)
    if hidden % C == 0
]


@pytest.mark.parametrize("rows,hidden,C,padding", BACKWARD_CASES)
def test_swiglu_backward_and_per_token_cast_matches_reference(rows, hidden, C, padding):
    import tileproof.reference.quant as reference_quant

    generator = torch.Generator().manual_seed(rows * 31 + hidden + C + padding)
    args = _backward_inputs(rows, hidden, C, 8 * padding + padding // 8, padding, generator)
    kwargs = {"round_sf": padding > 0}
    if (rows + C) % 3:
        kwargs["swiglu_clamp_value"] = (1.5, 4.0)[(rows + C) % 3 - 1]
    expected = reference.swiglu_backward_and_per_token_cast(*args, C, **kwargs)
    with poison_outputs():
        actual = _optimized().swiglu_backward_and_per_token_cast(*args, C, **kwargs)
    out, (dx_q, dx_sf), dx, dweight = actual
    expected_out, (expected_q, expected_sf), expected_dx, expected_dweight = expected
    _assert_same_bits(dx_q, expected_q, "dx_q")
    _assert_same_bits(dx_sf, expected_sf, "dx_sf")
    # The same fp32 sequence as the reference: out and dx are expected bit for bit too.
    _assert_same_bits(out, expected_out, "out")
    _assert_same_bits(dx, expected_dx, "dx")
    # dweight: an fp32 sum, within (H + 8)·2^-24·Σ_h |go·act| of the float64 one (docs/quant-swiglu.md).
    x_q, x_sf = args[0]
    values = reference_quant.cast_back((x_q, x_sf), "fp32", (1, C)).double()
    clamp = kwargs.get("swiglu_clamp_value")
    gate, up, *_ = reference.swiglu_clamp(values[:, :hidden], values[:, hidden:], clamp)
    act = reference.swiglu_activation(gate, up)
    spread = (args[1].double() * act).abs().sum(dim=1)
    slot_rows = args[4].to(torch.int64)
    bound = torch.zeros(slot_rows.shape, dtype=torch.float64, device="cuda")
    bound[slot_rows >= 0] = (hidden + 8) * 2.0**-24 * spread[slot_rows[slot_rows >= 0]] + 2.0**-126
    assert dweight.dtype == torch.float32 and dweight.shape == expected_dweight.shape
    assert bool(((dweight.double() - expected_dweight.double()).abs() <= bound).all())
    assert bool((dweight[slot_rows < 0] == 0).all())
