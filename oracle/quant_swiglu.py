"""The fused SwiGLU casts (contract §1) for the oracle: cases, inputs, policies, bytes, self-checks.

Three operators: ``swiglu_forward_and_per_token_cast``, ``swiglu_forward_and_per_channel_cast_and_transpose``
and ``swiglu_backward_and_per_token_cast`` (docs/quant-swiglu.md). ``optimized()`` returns
``getattr(tileproof.optimized.quant, name, None)`` (None: reference only); the per-channel forward
composes our activation kernel with the optimized ``per_channel_cast_and_transpose``, so it counts as
present only once that kernel is exported too.

Policies (docs/quant-swiglu.md, "How the oracle compares the twins"):

- Forward data and scales, per token and per channel: **bitwise** (the activation is a fixed fp32
  sequence with a correctly rounded ``exp``, then a cast with exact rules). Padding rows of the
  per-token forward (``pos_to_expert < 0``) are unspecified by the contract (TileKernels does not
  write them; the reference writes zeros), so ``split`` sets their data and scale bytes to zero on
  both sides before the comparison.
- ``clamped_count``: **bitwise** (integer counts). The operator increments it in place: the oracle
  calls both twins on a copy of the case's counter (which starts non-zero, so that overwriting
  instead of adding shows) and compares the copies; a call without a counter returns an empty one.
- Backward: ``dx_q`` and ``dx_sf`` bitwise; ``out``, the two halves of ``dx`` and ``dweight`` within
  the documented float64 bounds, written as ``RelativeError(bound, atol)`` for this spec's input
  ranges (see ``BackwardOp``).

Cases (``quick`` on the CPU in seconds, ``full`` on the GPU; both reach the same compile groups):

- per-token forward: kernel configurations (input dtype, format, packed UE8M0, clamp) crossed with
  the runtime variants: C ∈ {128, H}, every scale layout of the configuration, routing weights with
  -1 entries, padding rows, int32 and int64 indices, clamp counts; P ∈ {0, 1, odd}, H with a
  partial 1×128 block, strided rows, H = 2048 (DeepSeek-V3's expert width); narrow vectors (odd H;
  an odd row stride for e2m1); NaN and ±Inf. The benchmark: e4m3 1×128 at 16384 × (2·2048).
- per-channel forward: num_per_tokens 32 and 128, round_sf, clamp, both orientations, T ∈ {0, 1,
  odd, tails}, strided rows.
- backward: C 32 and 128, round_sf, clamp, rows without a routing slot
  and slots without a row, P ∈ {0, 1, odd}.

Inputs: gates spread over the whole range the activation treats differently (|g| from 2^-20 to 300,
zeros, subnormals, the overflow of ``E`` below −88.7, ``t = 1`` above 16.6), up projections of
row magnitudes 2^-8 .. 2^8 with a row below e4m3's amax floor and 64× outliers; a strided x is a
view of a wider buffer whose padding is NaN.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import product

import torch

from tileproof.reference import quant as reference_quant
from tileproof.reference import quant_swiglu as reference
from tileproof.reference.contract import CAST_FORMATS, ScaleLayout, align, ceil_div

from .moe import copy_keeping_layout
from .policy import FAIL, PASS, SKIP, Bitwise, Check, RelativeError, compare, structure_mismatch
from .quant import BF16_OUTPUT_SLACK, DTYPES, FLAGS, ROUND_TRIP_BOUND, WHY_Q, WHY_SF
from .registry import FLOAT_EDGE_KINDS, Call, Case, Edge, OpSpec, Output, register, write_edge_values

OPS = (
    "swiglu_forward_and_per_token_cast",
    "swiglu_forward_and_per_channel_cast_and_transpose",
    "swiglu_backward_and_per_token_cast",
)
FORWARD, PER_CHANNEL, BACKWARD = OPS
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
ROUTINGS = ("", "weights", "padding", "weights+padding")
TOPK = 4
EXPERTS = 8
PADDING_EVERY = 8  # rows r with r % 8 == 7, and the last row, are padding (pos_to_expert = -1)
NO_WEIGHT_EVERY = 5  # rows r with r % 5 == 3 have pos_to_token_topk = -1 (weight 0)
COUNT_START = (5, 7, 11)  # the in-place counter's initial value
# The fp32 activation is within a few ulps (< 2^-20 relative) of the float64 one; it is quantized
# against its own block maximum, so relative to the block the round-trip bound grows by that much.
ACTIVATION_SLACK = 2.0**-20
# Round trips compare values above this magnitude only (see _flush_tiny).
FLUSH_BELOW = 2.0**-100

WHY_PADDING = (
    "; rows with pos_to_expert < 0 are padding, unspecified by the contract (TileKernels leaves them "
    "unwritten): split sets their bytes to zero on both sides before comparing"
)
WHY_COUNT = (
    "integer counts of g > c, u > c, u < -c over the computed rows, added in place to the counter "
    "(compared on a copy that starts non-zero): exact, whatever the order of the additions"
)


# ---------------------------------------------------------------------------------------------
# Parameters and shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwigluParams:
    rows: int  # P (T for the per-channel forward)
    hidden: int  # H: x is [P, 2H]
    fmt: str = "e4m3"
    block: int = 128  # per-token: C (128, or H); per-channel: num_per_tokens; backward: C
    dtype: str = "bf16"  # the dtype of x (per-token forward; the others take bf16 / e4m3)
    flags: str = "plain"  # a key of FLAGS (per-channel and backward: "plain" or "round")
    row_stride: int | None = None  # elements between rows of x; None: contiguous
    routing: str = ""  # per-token forward: a value of ROUTINGS
    index_dtype: str = "int32"
    clamp: float | None = None
    count: bool = False  # per-token forward: pass clamped_count
    transpose: bool = True  # per-channel forward: False passes without_transpose=True
    special: str = ""  # "naninf": NaN and ±Inf in x

    @property
    def flag_kwargs(self) -> dict:
        return dict(FLAGS[self.flags])

    @property
    def layout(self) -> ScaleLayout:
        kwargs = self.flag_kwargs
        return ScaleLayout.from_flags(
            kwargs.get("use_tma_aligned_col_major_sf", False), kwargs.get("use_packed_ue8m0", False)
        )

    @property
    def padding_rows(self) -> int:
        if "padding" not in self.routing or self.rows == 0:
            return 0
        return len({r for r in range(self.rows) if r % PADDING_EVERY == PADDING_EVERY - 1} | {self.rows - 1})


def _shape_text(p: SwigluParams) -> str:
    return f"{p.rows}x(2·{p.hidden})" + (f"ld{p.row_stride}" if p.row_stride else "")


# Kernel configurations of the per-token forward (static parameters): (dtype, fmt, packed, clamp).
# Every value of each appears, pairs are mixed, not exhausted: each one is a compiled kernel.
FORWARD_CONFIGS = (
    ("bf16", "e4m3", False, None),
    ("bf16", "e4m3", False, 4.0),
    ("bf16", "e4m3", True, None),
    ("bf16", "e2m1", False, None),
    ("bf16", "e2m1", False, 5.3),  # not a bf16 value: the clamped gate's E(−c) is an fp32 argument
    ("bf16", "e2m1", True, 4.0),
    ("fp32", "e4m3", False, 4.0),
    ("fp32", "e4m3", True, None),
    ("fp32", "e2m1", False, None),
)
NON_PACKED_FLAGS = ("plain", "round", "colmajor", "round+colmajor")
# (rows, hidden, row_stride): hidden sizes and strides multiples of 16 (the widest vectors in both
# tiers); 96 and 320 end in a partial 1×128 block (and 320 takes C = H > 128: row scales).
FORWARD_SHAPES = {
    "quick": [(37, 256, None), (1, 96, 208), (130, 320, None), (64, 2048, 4160)],
    "full": [(4097, 2048, None), (1, 96, 208), (1000, 1408, 2880), (333, 320, None), (2, 7168, 14400)],
}
# Narrow vectors, same in both tiers: (dtype, fmt, rows, hidden, row_stride).
FORWARD_NARROW = (
    ("bf16", "e4m3", 45, 333, None),  # odd H: 1-element loads and stores
    ("fp32", "e2m1", 21, 10, 21),  # odd row stride: 1-element loads, 2-element (one byte) stores
)
NANINF_ROWS = {"quick": 6, "full": 64}
_DS_EXPERT = 2048  # DeepSeek-V3's expert intermediate size


def _forward_params(tier: str) -> list[SwigluParams]:
    params: list[SwigluParams] = []
    shapes = FORWARD_SHAPES[tier]
    i = 0
    for dtype, fmt, packed, clamp in FORWARD_CONFIGS:
        variants = [("packed", C) for C in ("128", "H")] if packed else list(product(NON_PACKED_FLAGS, ("128", "H")))
        for flags, channels in variants:
            rows, hidden, stride = shapes[i % len(shapes)]
            block = 128 if channels == "128" else hidden
            params.append(
                SwigluParams(
                    rows,
                    hidden,
                    fmt,
                    block,
                    dtype,
                    flags,
                    stride,
                    routing=ROUTINGS[i % len(ROUTINGS)],
                    index_dtype=("int32", "int64")[(i // 2) % 2],
                    clamp=clamp,
                    count=clamp is not None and i % 3 != 2,
                )
            )
            i += 1
        params.append(SwigluParams(0, 256, fmt, 128, dtype, "packed" if packed else "plain", clamp=clamp))
    for dtype, fmt, rows, hidden, stride in FORWARD_NARROW:
        params.append(SwigluParams(rows, hidden, fmt, 128, dtype, "plain", stride, routing="weights+padding"))
        params.append(SwigluParams(rows, hidden, fmt, hidden, dtype, "round", stride))
    rows = NANINF_ROWS[tier]
    params.append(SwigluParams(rows, 256, "e4m3", 128, "bf16", "plain", clamp=4.0, count=True, special="naninf"))
    params.append(SwigluParams(rows, 256, "e2m1", 256, "bf16", "packed", special="naninf"))
    return params


FORWARD_BENCHMARK = (
    "swiglu_forward_and_per_token_cast e4m3 1×128, 16384×(2·2048)",
    SwigluParams(16384, _DS_EXPERT, "e4m3", 128, "bf16", "plain"),
)
FORWARD_LARGE = SwigluParams(
    16384, _DS_EXPERT, "e4m3", 128, "bf16", "plain", routing="weights+padding", clamp=4.0, count=True
)

# (rows, hidden, row_stride) of the per-channel forward; hidden multiples of 16, both tiers.
PER_CHANNEL_SHAPES = {
    "quick": [(0, 64, None), (1, 64, None), (33, 48, 112), (300, 96, None), (130, 160, None)],
    "full": [(0, 64, None), (1, 64, None), (4099, 1040, 2112), (8192, _DS_EXPERT, None), (256, 96, None)],
}


def _per_channel_params(tier: str) -> list[SwigluParams]:
    params = []
    for i, (rows, hidden, stride) in enumerate(PER_CHANNEL_SHAPES[tier]):
        for j, nt in enumerate((32, 128)):
            params.append(
                SwigluParams(
                    rows,
                    hidden,
                    "e4m3",
                    nt,
                    "bf16",
                    ("plain", "round")[(i + j) % 2],
                    stride,
                    clamp=4.0 if (i + j) % 2 else None,
                    transpose=(i + j) % 3 != 1,
                )
            )
    return params


# (rows, hidden) of the backward; H a multiple of both C.
BACKWARD_SHAPES = {
    "quick": [(0, 128), (1, 32), (37, 128), (130, 256)],
    "full": [(0, 128), (1, 32), (999, 1024), (4096, _DS_EXPERT)],
}


def _backward_params(tier: str) -> list[SwigluParams]:
    params = []
    for i, (rows, hidden) in enumerate(BACKWARD_SHAPES[tier]):
        for j, C in enumerate((32, 128)):
            if hidden % C:
                continue
            clamp = (None, 4.0, 1.5)[(i + j) % 3]
            params.append(SwigluParams(rows, hidden, "e4m3", C, "bf16", ("plain", "round")[(i + j) % 2], clamp=clamp))
    return params


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

# Gate values the activation treats differently, sprinkled over the random gates: zeros, a
# subnormal, below and above the kernels' table window (2^-16 .. 2^8), t = 1 (g > 16.64) and the
# overflow of E (g < -88.72).
SPECIAL_GATES = (0.0, -0.0, 1e-40, 2.0**-20, -(2.0**-17), 17.0, 20.0, -100.0, 300.0, -300.0, 5.3)


def _gate_up(rows: int, hidden: int, generator: torch.Generator, special: str) -> torch.Tensor:
    """fp32 ``[P, 2H]``: gates ~ N(0, 3²) with row scales 2^-3 .. 2^3 plus SPECIAL_GATES, up
    projections ~ N(0, 1) with row magnitudes 2^-8 .. 2^8, a tiny row and 64× outliers."""
    gate = torch.randn((rows, hidden), generator=generator) * 3
    up = torch.randn((rows, hidden), generator=generator)
    if rows == 0:
        return torch.cat([gate, up], dim=1)
    gate *= torch.exp2(torch.randint(-3, 4, (rows, 1), generator=generator).float())
    specials = torch.tensor(SPECIAL_GATES)
    # Unique positions: with a repeated index, which of two values lands would be unspecified.
    where = torch.randint(0, gate.numel(), (max(1, gate.numel() // 16),), generator=generator).unique()
    gate.view(-1)[where] = specials[torch.randint(0, len(SPECIAL_GATES), where.shape, generator=generator)]
    up *= torch.exp2(torch.randint(-8, 9, (rows, 1), generator=generator).float())
    if rows >= 3:
        up[rows // 2] = torch.randn(hidden, generator=generator) * 1e-6  # below e4m3's amax floor
    outliers = torch.randint(0, up.numel(), (max(1, up.numel() // 512),), generator=generator)
    up.view(-1)[outliers] *= 64
    if special == "naninf":
        last = rows - 1
        gate[0, 0] = float("nan")
        up[0, 1] = float("nan")
        gate[last, hidden // 2] = float("inf")
        gate[last, 0] = float("-inf")
        up[last, hidden - 1] = float("-inf")
    return torch.cat([gate, up], dim=1)


def _make_x(
    p: SwigluParams,
    dtype: torch.dtype,
    device,
    generator: torch.Generator | None,
    edge: Edge | None = None,
    block: tuple[int, int] = (1, 1),
) -> torch.Tensor:
    """x ``[P, 2H]`` with row stride ``p.row_stride``; the padding between rows is NaN. An edge
    case's values go into the ``block`` tiles of x (gate and up alike)."""
    width = p.row_stride or 2 * p.hidden
    if generator is None:
        return torch.empty((p.rows, width), dtype=dtype, device=device)[:, : 2 * p.hidden]
    wide = torch.full((p.rows, width), float("nan"), dtype=dtype)
    wide[:, : 2 * p.hidden] = _gate_up(p.rows, p.hidden, generator, p.special).to(dtype)
    if edge is not None:
        write_edge_values(wide[:, : 2 * p.hidden], edge.kind, generator, block=block)
    return wide.to(device)[:, : 2 * p.hidden]


def _index(values: torch.Tensor, p: SwigluParams, device, generator: torch.Generator | None) -> torch.Tensor:
    dtype = INDEX_DTYPES[p.index_dtype]
    if generator is None:
        return torch.empty(values.shape, dtype=dtype, device=device)
    return values.to(dtype).to(device)


def _routing_kwargs(p: SwigluParams, device, generator: torch.Generator | None) -> dict:
    """pos_to_token_topk / topk_weights (a random injection of rows into T·k slots, -1 for rows
    r % 5 == 3) and pos_to_expert (experts 0..7, -1 for rows r % 8 == 7 and the last row)."""
    kwargs: dict = {}
    rows = p.rows
    if "weights" in p.routing:
        tokens = ceil_div(rows, TOPK) + 1
        if generator is None:
            slots = torch.zeros(rows, dtype=torch.int64)
            weights = torch.empty((tokens, TOPK), dtype=torch.float32, device=device)
        else:
            slots = torch.randperm(tokens * TOPK, generator=generator)[:rows]
            slots[torch.arange(rows) % NO_WEIGHT_EVERY == 3] = -1
            weights = (torch.rand((tokens, TOPK), generator=generator) * 1.5 - 0.25).to(device)
        kwargs["pos_to_token_topk"] = _index(slots, p, device, generator)
        kwargs["topk_weights"] = weights
    if "padding" in p.routing:
        experts = torch.zeros(rows, dtype=torch.int64)
        if generator is not None:
            experts = torch.randint(0, EXPERTS, (rows,), generator=generator)
            experts[torch.arange(rows) % PADDING_EVERY == PADDING_EVERY - 1] = -1
            if rows:
                experts[-1] = -1
        kwargs["pos_to_expert"] = _index(experts, p, device, generator)
    return kwargs


def _backward_inputs(p: SwigluParams, device, generator: torch.Generator | None, edge: Edge | None = None):
    """(x_q, x_sf), grad_out, weight, pos_to_token_topk, token_topk_to_pos for the backward: x is
    quantized by the reference per_token_cast; about one row in six has no slot and one slot in
    five has no row (random inverse mappings). An edge case's values go into the 1×C blocks of x
    (before it is quantized) or of grad_out, as its target says."""
    rows, hidden, C = p.rows, p.hidden, p.block
    tokens = max(1, ceil_div(rows, TOPK))
    slots = tokens * TOPK
    if generator is None:
        x_q = torch.empty((rows, 2 * hidden), dtype=torch.float8_e4m3fn, device=device)
        x_sf = torch.empty((rows, 2 * hidden // C), dtype=torch.float32, device=device)
        grad_out = torch.empty((rows, hidden), dtype=torch.bfloat16, device=device)
        weight = torch.empty((tokens, TOPK), dtype=torch.float32, device=device)
        return (
            (x_q, x_sf),
            grad_out,
            weight,
            torch.empty(rows, dtype=torch.int32, device=device),
            (torch.empty((tokens, TOPK), dtype=torch.int32, device=device)),
        )
    # Moderate magnitudes (|g|, |u| ≲ 8, |go| ≲ 4): the ranges BackwardOp's bounds assume.
    values = torch.clamp(torch.randn((rows, 2 * hidden), generator=generator) * 2, -8, 8)
    if edge is not None and edge.target == "x":
        write_edge_values(values, edge.kind, generator, block=(1, C))
    x_q, x_sf = reference_quant.per_token_cast(values, "e4m3", C)
    grad_out = torch.clamp(torch.randn((rows, hidden), generator=generator), -4, 4).to(torch.bfloat16)
    if edge is not None and edge.target == "grad_out":
        write_edge_values(grad_out, edge.kind, generator, block=(1, C))
    weight = torch.rand((tokens, TOPK), generator=generator) * 0.75 + 0.25
    chosen_slots = torch.randperm(slots, generator=generator)[: max(0, min(rows, slots) - rows // 6)]
    chosen_rows = torch.randperm(rows, generator=generator)[: chosen_slots.numel()]
    pos_to_token_topk = torch.full((rows,), -1, dtype=torch.int32)
    token_topk_to_pos = torch.full((slots,), -1, dtype=torch.int32)
    pos_to_token_topk[chosen_rows] = chosen_slots.to(torch.int32)
    token_topk_to_pos[chosen_slots] = chosen_rows.to(torch.int32)
    moved = (x_q.to(device), x_sf.to(device)), grad_out.to(device), weight.to(device)
    return (*moved, pos_to_token_topk.to(device), token_topk_to_pos.reshape(tokens, TOPK).to(device))


# ---------------------------------------------------------------------------------------------
# The optimized twins
# ---------------------------------------------------------------------------------------------


def optimized_quant(name: str) -> Callable | None:
    """``tileproof.optimized.quant.<name>``, or None while that module or the name does not exist."""
    if importlib.util.find_spec("tileproof.optimized.quant") is None:
        return None
    # jit first: it points TileLang's kernel cache at TILEPROOF_CACHE_DIR before TileLang loads.
    importlib.import_module("tileproof.optimized.jit")
    return getattr(importlib.import_module("tileproof.optimized.quant"), name, None)


def _on_a_counter_copy(fn: Callable) -> Callable:
    """The per-token forward called on a copy of ``clamped_count`` (it is incremented in place);
    returns ``(q, sf, counts, pos_to_expert)``: counts empty without a counter, pos_to_expert for
    ``split``'s padding mask."""

    def call(*args, clamped_count=None, **kwargs):
        counts = None if clamped_count is None else clamped_count.clone()
        q, sf = fn(*args, clamped_count=counts, **kwargs)
        if counts is None:
            counts = torch.empty(0, dtype=torch.int64, device=q.device)
        return q, sf, counts, kwargs.get("pos_to_expert")

    return call


# ---------------------------------------------------------------------------------------------
# The specs
# ---------------------------------------------------------------------------------------------


class SwigluOp(OpSpec):
    """What the three specs share: the reference by name, the optimized twin by name, labels."""

    family = "quant"
    # The edge profile: every class but "scaled-subnormal" (the activation stands between x and the
    # scaled values), on three quick cases.
    edge_kinds = FLOAT_EDGE_KINDS
    edge_base_count = 3
    edge_base_preferences = ({"fmt": "e4m3", "dtype": "bf16"}, {"fmt": "e2m1"}, {"dtype": "fp32"})

    def edge_base_ok(self, case: Case) -> bool:
        p: SwigluParams = case.params
        return p.rows > 0 and not p.special and not case.benchmark

    def reference(self) -> Callable:
        return getattr(reference, self.name)

    def optimized(self) -> Callable | None:
        return optimized_quant(self.name)

    def label(self, p: SwigluParams) -> str:
        block = {FORWARD: "C", PER_CHANNEL: "nt", BACKWARD: "C"}[self.name] + str(p.block)
        label = f"{self.name}/{p.fmt}/{block}/{p.dtype}/{_shape_text(p)}/{p.flags}"
        if p.routing:
            label += f"/{p.routing}/{p.index_dtype}"
        if p.clamp is not None:
            label += f"/clamp{p.clamp:g}" + ("+count" if p.count else "")
        if self.name == PER_CHANNEL and not p.transpose:
            label += "/no-transpose"
        return label + (f"/{p.special}" if p.special else "")


class ForwardPerTokenOp(SwigluOp):
    name = FORWARD
    outputs = (
        Output("q", Bitwise(), WHY_Q + WHY_PADDING),
        Output("sf", Bitwise(nan_equal=True), WHY_SF + WHY_PADDING),
        Output("clamped_count", Bitwise(), WHY_COUNT),
    )

    def cases(self, tier: str) -> list[Case]:
        cases = [Case(self.name, self.label(p), p) for p in _forward_params(tier)]
        if tier == "full":
            title, p = FORWARD_BENCHMARK
            cases.append(Case(self.name, self.label(p), p, benchmark=True, title=title))
            cases.append(Case(self.name, self.label(FORWARD_LARGE), FORWARD_LARGE))
        return cases

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: SwigluParams = case.params
        # Edge values in the 1×C blocks of each half (C = H: the whole half).
        x = _make_x(p, DTYPES[p.dtype], device, generator, case.edge, (1, min(p.block, p.hidden)))
        kwargs = {**p.flag_kwargs, **_routing_kwargs(p, device, generator)}
        if p.clamp is not None:
            kwargs["swiglu_clamp_value"] = p.clamp
        if p.count:
            kwargs["clamped_count"] = torch.tensor(COUNT_START, dtype=torch.int64, device=device)
        return Call((x, p.fmt, p.block), kwargs)

    def reference(self) -> Callable:
        return _on_a_counter_copy(super().reference())

    def optimized(self) -> Callable | None:
        twin = super().optimized()
        return None if twin is None else _on_a_counter_copy(twin)

    def split(self, result) -> tuple[torch.Tensor, ...]:
        q, sf, counts, pos_to_expert = result
        if pos_to_expert is not None and q.shape[0] and bool((pos_to_expert < 0).any()):
            padding = (pos_to_expert < 0).to(q.device)
            q = q.clone()
            q.view(torch.uint8)[padding] = 0
            sf = copy_keeping_layout(sf)  # a plain clone would lose a column-major layout
            sf[padding] = 0
        return q, sf, counts

    def compile_group(self, case: Case) -> Hashable | None:
        p: SwigluParams = case.params
        if p.rows == 0 or self.optimized() is None:
            return None
        return ("swiglu_per_token", p.dtype, p.fmt, "packed" in p.flags, p.clamp is not None, *_widths(p))

    def bytes_moved(self, case: Case) -> int:
        p: SwigluParams = case.params
        computed = p.rows - p.padding_rows
        spec = CAST_FORMATS[p.fmt]
        moved = computed * 2 * p.hidden * DTYPES[p.dtype].itemsize  # x, computed rows only
        moved += computed * p.hidden // spec.values_per_byte  # q
        moved += computed * p.layout.logical_columns(ceil_div(p.hidden, p.block)) * 4  # sf
        index_bytes = INDEX_DTYPES[p.index_dtype].itemsize
        if "padding" in p.routing:
            moved += p.rows * index_bytes
        if "weights" in p.routing:
            moved += computed * (index_bytes + 4)  # the index and the gathered weight
        return moved

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: SwigluParams = case.params
        q, sf, counts = outputs
        checks = [_layout_check(self.outputs, outputs, _forward_layout(p))]
        x, kwargs = call.args[0], call.kwargs
        gate, up, _ = _clamped_float64(x, p.hidden, p.clamp)
        weight = _row_weights64(kwargs, p.rows, x.device)
        activation = reference.swiglu_activation(gate, up, weight)
        padding = _padding_mask(kwargs, p.rows, x.device)
        computed = ~padding
        restored = reference_quant.cast_back((q, sf), "fp32", (1, p.block))
        bound = ROUND_TRIP_BOUND[p.fmt] + ACTIVATION_SLACK
        edge = case.edge is not None
        checks.append(_round_trip_check(activation[computed], restored[computed], (1, p.block), bound, p.fmt, edge))
        zero_rows = bool((q.view(torch.uint8)[padding] == 0).all()) and bool((_scale_rows(sf)[padding] == 0).all())
        checks.append(Check("padding rows written as zeros", PASS if zero_rows else FAIL, "exact", ""))
        if p.count:
            checks.append(_count_check(x, p, padding, counts))
        return checks


class ForwardPerChannelOp(SwigluOp):
    name = PER_CHANNEL
    outputs = (
        Output("q", Bitwise(), WHY_Q + " (the activation rounded to bf16 first, as the contract says)"),
        Output("sf", Bitwise(nan_equal=True), WHY_SF),
    )

    def optimized(self) -> Callable | None:
        # Our activation kernel composed with the optimized per-channel cast (and transpose).
        if optimized_quant("per_channel_cast_and_transpose") is None:
            return None
        return super().optimized()

    def cases(self, tier: str) -> list[Case]:
        return [Case(self.name, self.label(p), p) for p in _per_channel_params(tier)]

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: SwigluParams = case.params
        x = _make_x(p, torch.bfloat16, device, generator, case.edge, (p.block, 1))  # the per-channel blocks
        kwargs: dict = {}
        if p.flags == "round":
            kwargs["round_sf"] = True
        if not p.transpose:
            kwargs["without_transpose"] = True
        if p.clamp is not None:
            kwargs["swiglu_clamp_value"] = p.clamp
        return Call((x, p.fmt, p.block), kwargs)

    def compile_group(self, case: Case) -> Hashable | None:
        p: SwigluParams = case.params
        if p.rows == 0 or self.optimized() is None:
            return None
        return ("swiglu_per_channel", p.block, p.flags, p.clamp is not None, p.transpose, *_widths(p))

    def bytes_moved(self, case: Case) -> int:
        p: SwigluParams = case.params
        T, H = p.rows, p.hidden
        return T * 2 * H * 2 + T * H + ceil_div(T, p.block) * H * 4  # x, q, sf of a fused kernel

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: SwigluParams = case.params
        q, sf = outputs
        T, H = p.rows, p.hidden
        q_shape = (H, T) if p.transpose else (T, H)
        expected = (
            torch.empty(q_shape, dtype=torch.float8_e4m3fn, device="meta"),
            torch.empty((ceil_div(T, p.block), H), dtype=torch.float32, device="meta"),
        )
        checks = [_layout_check(self.outputs, outputs, expected)]
        x, kwargs = call.args[0], call.kwargs
        other = dict(kwargs, without_transpose=p.transpose)
        q_other, sf_other = reference.swiglu_forward_and_per_channel_cast_and_transpose(x, p.fmt, p.block, **other)
        checks.append(compare("q ≡ the other orientation, transposed", q, q_other.T.contiguous(), Bitwise()))
        checks.append(compare("sf ≡ the other orientation's", sf, sf_other, Bitwise(nan_equal=True)))
        gate, up, _ = _clamped_float64(x, H, p.clamp)
        activation = reference.swiglu_activation(gate, up)
        rows_first = q.T if p.transpose else q
        restored = reference_quant.cast_back((rows_first.contiguous(), sf), "fp32", (p.block, 1))
        bound = ROUND_TRIP_BOUND["e4m3"] + BF16_OUTPUT_SLACK + ACTIVATION_SLACK
        checks.append(_round_trip_check(activation, restored, (p.block, 1), bound, p.fmt, case.edge is not None))
        return checks


# The backward's float64 bounds (docs/quant-swiglu.md) for this spec's inputs: |g|, |u| ≤ 8,
# |go| ≤ 4, w ∈ [0.25, 1] (0 for rows without a slot). u = 2^-24.
# out, d_up: ≤ (2^-8 + 2^-20)·|ref| + 2^-126 (the 2^-120 terms need g ≤ -87.3: not in these inputs).
BF16_RESULT_BOUND = 2.0**-8 + 2.0**-20
# d_gate: ≤ 2^-8·|dg64| + 2^-19·M with M = |go·w|·σ(g)·|u|·(1 + |g|) ≤ 4·1·1·8·9 = 288, and
# a + b ≤ 2·max(a, b): ≤ 2^-7·max(|dg64|, 2^-11·288) (cancellation near g = -1.28 needs the floor).
D_GATE_BOUND, D_GATE_ATOL = 2.0**-7, 2.0**-11 * 288
# dweight: ≤ (H + 8)·u·Σ_h |go·act64| (docs): below 0.3 for these inputs (Σ_h |go·act| ≈ 1.2·H at
# most, H ≤ 2048), so 2^-9·max(|dw64|, 256) ≥ 0.5 covers it. The self-check "policies cover the
# documented bounds" verifies, case by case, that both floors are wide enough.
D_WEIGHT_BOUND, D_WEIGHT_ATOL = 2.0**-9, 256.0


class BackwardOp(SwigluOp):
    name = BACKWARD
    outputs = (
        Output(
            "out",
            RelativeError(BF16_RESULT_BOUND, atol=2.0**-126),
            "fl(act·w): ≤ 8 fp32 roundings (8u < 2^-20) then bf16 (2^-8); the floor covers fp32/bf16 underflow",
        ),
        Output("dx_q", Bitwise(), WHY_Q + " (of the fp32 gradients, E correctly rounded, the fma: one sequence)"),
        Output("dx_sf", Bitwise(nan_equal=True), WHY_SF),
        Output(
            "dx_gate",
            RelativeError(D_GATE_BOUND, atol=D_GATE_ATOL),
            "1 + g(1 - σ) cancels near g = -1.28: ≤ 2^-8|dg| + 2^-19·|go·w|·σ·|u|·(1 + |g|) (docs), "
            "written as one max with the floor 2^-11·288 for |g|, |u| ≤ 8, |go| ≤ 4",
        ),
        Output(
            "dx_up",
            RelativeError(BF16_RESULT_BOUND, atol=2.0**-126),
            "fl(fl(fl(go·w)·s)·g): ≤ 9 fp32 roundings (< 2^-20) then bf16 (2^-8)",
        ),
        Output(
            "dweight",
            RelativeError(D_WEIGHT_BOUND, atol=D_WEIGHT_ATOL),
            "an fp32 sum of H terms go·act in any order: ≤ (H + 8)·2^-24·Σ|go·act| (docs), below 0.3 "
            "for these inputs (H ≤ 2048): within 2^-9·max(|dw|, 256)",
        ),
    )

    edge_targets = ("x", "grad_out")

    def cases(self, tier: str) -> list[Case]:
        return [Case(self.name, self.label(p), p) for p in _backward_params(tier)]

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: SwigluParams = case.params
        args = _backward_inputs(p, device, generator, case.edge)
        kwargs: dict = {}
        if p.flags == "round":
            kwargs["round_sf"] = True
        if p.clamp is not None:
            kwargs["swiglu_clamp_value"] = p.clamp
        return Call((*args, p.block), kwargs)

    def split(self, result) -> tuple[torch.Tensor, ...]:
        out, (dx_q, dx_sf), dx, dweight = result
        hidden = out.shape[1]
        return out, dx_q, dx_sf, dx[:, :hidden], dx[:, hidden:], dweight

    def compile_group(self, case: Case) -> Hashable | None:
        p: SwigluParams = case.params
        if p.rows == 0 or self.optimized() is None:
            return None
        return ("swiglu_backward", p.block, p.clamp is not None)

    def bytes_moved(self, case: Case) -> int:
        p: SwigluParams = case.params
        P, H, C = p.rows, p.hidden, p.block
        slots = max(1, ceil_div(P, TOPK)) * TOPK
        inputs = P * 2 * H + P * (2 * H // C) * 4 + P * H * 2 + slots * 4 + P * 4 + slots * 4
        outputs = P * H * 2 + P * 2 * H + P * (2 * H // C) * 4 + P * 2 * H * 2 + slots * 4
        return inputs + outputs

    def reference_float64(self, case: Case, call: Call):
        p: SwigluParams = case.params
        (x_q, x_sf), grad_out, weight, pos_to_token_topk, token_topk_to_pos, C = call.args
        values = reference_quant.cast_back((x_q, x_sf), "fp32", (1, C)).to(torch.float64)
        gate, up, gate_above, up_above, up_below = reference.swiglu_clamp(
            values[:, : p.hidden], values[:, p.hidden :], call.kwargs.get("swiglu_clamp_value")
        )
        w = _gathered_weights(weight, pos_to_token_topk).to(torch.float64)
        go = grad_out.to(torch.float64)
        act, out, d_gate, d_up = reference.swiglu_gradients(gate, up, go, w, gate_above, up_above | up_below)
        row_sums = (go * act).sum(dim=1)
        dweight = torch.zeros(weight.shape, dtype=torch.float64, device=weight.device)
        slot_rows = token_topk_to_pos.to(torch.int64)
        dweight[slot_rows >= 0] = row_sums[slot_rows[slot_rows >= 0]]
        return out, None, None, d_gate, d_up, dweight

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: SwigluParams = case.params
        out, dx_q, dx_sf, d_gate, d_up, dweight = outputs
        P, H, C = p.rows, p.hidden, p.block
        weight = call.args[2]
        meta = "meta"
        expected = (
            torch.empty((P, H), dtype=torch.bfloat16, device=meta),
            torch.empty((P, 2 * H), dtype=torch.float8_e4m3fn, device=meta),
            torch.empty((P, 2 * H // C), dtype=torch.float32, device=meta),
            torch.empty((P, 2 * H), dtype=torch.bfloat16, device=meta)[:, :H],
            torch.empty((P, 2 * H), dtype=torch.bfloat16, device=meta)[:, H:],
            torch.empty(tuple(weight.shape), dtype=torch.float32, device=meta),
        )
        checks = [_layout_check(self.outputs, outputs, expected)]
        exact = self.reference_float64(case, call)
        gradients = torch.cat([exact[3], exact[4]], dim=1)
        restored = reference_quant.cast_back((dx_q, dx_sf), "fp32", (1, C))
        bound = ROUND_TRIP_BOUND["e4m3"] + 2.0**-18
        checks.append(_round_trip_check(gradients, restored, (1, C), bound, "e4m3", case.edge is not None))
        unmapped = call.args[4] < 0
        empty_slots = bool((dweight[unmapped] == 0).all())
        checks.append(Check("slots without a row: dweight 0", PASS if empty_slots else FAIL, "exact", ""))
        if case.edge is None:
            checks.append(self._bounds_covered(case, call, exact))
        else:
            # The edge rule (policy.EdgeReference) holds an element to the bound only where the fp32
            # reference meets it: the bounds' input ranges (|g|, |u| <= 8) are no premise there.
            detail = "edge case: bounds apply where the native reference meets them (policy.EdgeReference)"
            checks.append(Check("policies cover the documented bounds", SKIP, detail=detail))
        return checks

    def _bounds_covered(self, case: Case, call: Call, exact) -> Check:
        """The RelativeError floors of dx_gate and dweight contain the documented bounds on this case."""
        p: SwigluParams = case.params
        (x_q, x_sf), grad_out, weight, pos_to_token_topk, token_topk_to_pos, C = call.args
        values = reference_quant.cast_back((x_q, x_sf), "fp32", (1, C)).to(torch.float64)
        gate, up, *_ = reference.swiglu_clamp(values[:, : p.hidden], values[:, p.hidden :], p.clamp)
        go_w = grad_out.to(torch.float64) * _gathered_weights(weight, pos_to_token_topk).to(torch.float64)
        sigmoid = 1 / (1 + torch.exp(-gate))
        spread = go_w.abs() * sigmoid * up.abs() * (1 + gate.abs())
        documented = 2.0**-8 * exact[3].abs() + 2.0**-19 * spread + 2.0**-120 * (go_w * up).abs() + 2.0**-126
        allowed = D_GATE_BOUND * torch.clamp(exact[3].abs(), min=D_GATE_ATOL)
        problems = [] if bool((documented <= allowed).all()) else ["dx_gate"]
        act = gate / (1 + torch.exp(-gate)) * up
        row_spread = (grad_out.to(torch.float64) * act).abs().sum(dim=1)
        row_floor = (grad_out.to(torch.float64) * up).abs().sum(dim=1)
        slot_rows = token_topk_to_pos.to(torch.int64)
        mapped = slot_rows >= 0
        documented = (p.hidden + 8) * 2.0**-24 * row_spread[slot_rows[mapped]] + 2.0**-120 * row_floor[
            slot_rows[mapped]
        ]
        allowed = D_WEIGHT_BOUND * torch.clamp(exact[5][mapped].abs(), min=D_WEIGHT_ATOL)
        if not bool((documented + 2.0**-126 <= allowed).all()):
            problems.append("dweight")
        detail = f"a documented bound exceeds the policy: {', '.join(problems)}" if problems else ""
        return Check("policies cover the documented bounds", FAIL if problems else PASS, "float64", "", detail)


# ---------------------------------------------------------------------------------------------
# Shared checks and helpers
# ---------------------------------------------------------------------------------------------


def _widths(p: SwigluParams) -> tuple[int, int]:
    """The kernel's load and store widths for p (aligned base assumed, as the inputs have)."""
    itemsize = DTYPES[p.dtype].itemsize
    vector = 16 // itemsize
    while vector > 1 and (p.hidden % vector or (p.rows > 1 and (p.row_stride or 2 * p.hidden) % vector)):
        vector //= 2
    store = 8
    while p.hidden % store:
        store //= 2
    return vector, store


def _clamped_float64(x: torch.Tensor, hidden: int, clamp: float | None):
    """The clamped gate and up in float64 and the clamp masks (the reference's own clamp rule)."""
    values = x.to(torch.float64)
    gate, up, *masks = reference.swiglu_clamp(values[:, :hidden], values[:, hidden:], clamp)
    return gate, up, masks


def _gathered_weights(weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """fp32 ``[P, 1]``: ``weights.flatten()[index[r]]``, 0 for -1 (a loop over the rows)."""
    flat = weights.reshape(-1).tolist()
    rows = [[flat[i] if i >= 0 else 0.0] for i in index.tolist()]
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 1).to(weights.device)


def _row_weights64(kwargs: dict, rows: int, device) -> torch.Tensor | None:
    if "topk_weights" not in kwargs:
        return None
    if rows == 0:
        return torch.zeros((0, 1), dtype=torch.float64, device=device)
    return _gathered_weights(kwargs["topk_weights"], kwargs["pos_to_token_topk"]).to(torch.float64)


def _padding_mask(kwargs: dict, rows: int, device) -> torch.Tensor:
    expert = kwargs.get("pos_to_expert")
    if expert is None:
        return torch.zeros(rows, dtype=torch.bool, device=device)
    return expert < 0


def _scale_rows(sf: torch.Tensor) -> torch.Tensor:
    """The scale tensor's rows as raw integers (works for fp32 and packed int32)."""
    return sf.view(torch.int32)


def _forward_layout(p: SwigluParams) -> tuple[torch.Tensor, ...]:
    P, H = p.rows, p.hidden
    kblocks = ceil_div(H, p.block)
    leading = align(P, 4)
    if p.layout.kind == "packed_ue8m0":
        sf = torch.empty_strided((P, ceil_div(kblocks, 4)), (1, leading), dtype=torch.int32, device="meta")
    elif p.layout.kind == "col_major":
        sf = torch.empty_strided((P, kblocks), (1, leading), dtype=torch.float32, device="meta")
    else:
        sf = torch.empty((P, kblocks), dtype=torch.float32, device="meta")
    fmt = CAST_FORMATS[p.fmt]
    q = torch.empty((P, H // fmt.values_per_byte), dtype=fmt.storage_dtype, device="meta")
    counts = torch.empty((3,) if p.count else (0,), dtype=torch.int64, device="meta")
    return q, sf, counts


def _layout_check(outputs: tuple[Output, ...], actual: tuple[torch.Tensor, ...], expected) -> Check:
    """The reference returns the documented dtypes, shapes and strides."""
    for output, tensor, wanted in zip(outputs, actual, expected, strict=True):
        problem = structure_mismatch(tensor, wanted)
        if problem:
            return Check("reference layout", FAIL, "documented layout", "", f"{output.name}: {problem}")
    return Check("reference layout", PASS, "documented layout", "ok")


def _count_check(x: torch.Tensor, p: SwigluParams, padding: torch.Tensor, counts: torch.Tensor) -> Check:
    """counts − COUNT_START = [#(g > c), #(u > c), #(u < −c)] over the computed rows, c = fp32(clamp)."""
    c = float(torch.tensor(p.clamp, dtype=torch.float32))
    values = x.to(torch.float64)[~padding]
    gate, up = values[:, : p.hidden], values[:, p.hidden :]
    wanted = [COUNT_START[0] + int((gate > c).sum()), COUNT_START[1] + int((up > c).sum())]
    wanted.append(COUNT_START[2] + int((up < -c).sum()))
    ok = counts.tolist() == wanted
    detail = "" if ok else f"counts {counts.tolist()}, expected {wanted}"
    return Check("clamp counts added in place", PASS if ok else FAIL, "exact", "", detail)


def _flush_tiny(values: torch.Tensor) -> torch.Tensor:
    """float64 values with magnitudes below FLUSH_BELOW set to zero: there the fp32 sequence
    underflows (E(−g) overflows for g < −88.72, so silu = −0 where the float64 one is ~1e-40;
    subnormal products), and a block made only of such values has no meaningful relative error."""
    values = values.to(torch.float64)
    return torch.where(values.abs() < FLUSH_BELOW, torch.zeros_like(values), values)


def _round_trip_check(
    source: torch.Tensor, restored: torch.Tensor, block: tuple[int, int], bound: float, fmt: str, edge: bool = False
) -> Check:
    """max over blocks of max |source − restored| / max(amax(block), the format's amax floor), float64,
    over finite blocks (below the floor the scale is the floor's: the error scales with it). With
    ``edge`` (an edge case), blocks whose dequantized values are not finite are left out too: there
    the fp32 activation overflowed (a bf16 max times a silu above 1), which float64 does not."""
    name = "reference round trip"
    policy = f"block rel ≤ {bound:.4g}"
    rows, cols = source.shape
    if rows == 0 or cols == 0:
        return Check(name, PASS, policy, "empty")
    bm, bk = block
    pad = (0, ceil_div(cols, bk) * bk - cols, 0, ceil_div(rows, bm) * bm - rows)
    exact = torch.nn.functional.pad(_flush_tiny(source), pad)
    error = (torch.nn.functional.pad(_flush_tiny(restored), pad) - exact).abs()

    def blocks(t: torch.Tensor) -> torch.Tensor:
        r, k = t.shape[0] // bm, t.shape[1] // bk
        return t.reshape(r, bm, k, bk).permute(0, 2, 1, 3).reshape(r, k, bm * bk)

    amax = torch.clamp(blocks(exact.abs()).amax(-1), min=CAST_FORMATS[fmt].amax_floor)
    worst = blocks(error).amax(-1)
    relative = torch.where(worst == 0, torch.zeros_like(amax), worst / amax)
    finite = torch.isfinite(blocks(exact)).all(-1)
    if edge:
        finite &= torch.isfinite(blocks(torch.nn.functional.pad(restored.to(torch.float64), pad))).all(-1)
    relative = relative[finite]
    value = float(relative.max()) if relative.numel() else 0.0
    if not value <= bound:
        return Check(name, FAIL, policy, f"{value:.4g}", f"a block's relative error {value:.4g} > {bound:.4g}")
    return Check(name, PASS, policy, f"{value:.4g}")


SPECS = (ForwardPerTokenOp(), ForwardPerChannelOp(), BackwardOp())
for _spec in SPECS:
    register(_spec)
