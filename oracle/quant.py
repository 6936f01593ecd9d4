"""The quantization family (contract §1) for the oracle: cases, inputs, policies, bytes, self-checks.

Four operators: ``per_token_cast``, ``per_token_cast_with_sf_only``,
``per_token_cast_with_precomputed_sf`` and ``per_token_cast_back``; and, with cases of their own
(see their sections at the end): ``per_token_cast_e5m6`` (the public ``per_token_cast(x, "e5m6",
H)``, an oracle operator of its own so that ``per_token_cast``'s case grid stays e4m3 / e2m1) and
``cast_back`` of 2-D, per-channel and e5m6 pairs.

Cases of each tier (both tiers reach the same kernel configurations; ``full`` has more tokens):

- *primary*: every (format, C, dtype, flags) combination, i.e. 2 × 4 × 2 × 5 = 80 per operator,
  twice (few tokens, many tokens), on shapes taken in turn from lists whose hidden sizes and row
  strides are multiples of 16 (so every combination also meets the optimized kernels' widest
  vectors); T ∈ {1, odd}, strided rows;
- *whole row* (C == H) for a few hidden sizes;
- *edges*: zero tokens; hidden sizes and row strides that force narrower vectors (1000, 200, 1002
  with row stride 1010, and the odd 999 for e4m3); NaN and ±Inf in the input;
- *benchmarks*: the acceptance list's named workloads (``full``; the decode one in both tiers),
  plus a few large cases that the ``full`` profile times because of their size.

Inputs are random normal rows of different magnitudes (2^-8 .. 2^8), a row of tiny values (so
that e4m3's amax floor is active), a few 64× outliers, generated on the CPU from the case's seed and
then moved. A strided input is a view ``wide[:, :H]`` of a wider buffer whose padding holds NaN
(quantized data: 0x7F bytes), so that a kernel reading past a row's end shows in its results.

``dtype`` is the input dtype of the casts and the output dtype of ``per_token_cast_back`` (whose
``(q, sf)`` input the reference ``per_token_cast`` makes from an input of that same dtype).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from fractions import Fraction
from itertools import product

import torch

from tileproof.reference import quant as reference
from tileproof.reference import quant_blocks as reference_blocks
from tileproof.reference.contract import CAST_FORMATS, PER_TOKEN_CAST_FORMATS, ScaleLayout, align, ceil_div

from .policy import FAIL, PASS, Bitwise, Check, compare, structure_mismatch
from .registry import (
    CAST_EDGE_KINDS,
    Call,
    Case,
    Edge,
    OpSpec,
    Output,
    edge_units,
    register,
    write_at,
    write_edge_values,
)

FORMATS = ("e4m3", "e2m1")
CHANNELS = (16, 32, 64, 128)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FLAGS = {
    "plain": {},
    "round": {"round_sf": True},
    "colmajor": {"use_tma_aligned_col_major_sf": True},
    "packed": {"use_tma_aligned_col_major_sf": True, "use_packed_ue8m0": True},
    "round+colmajor": {"use_tma_aligned_col_major_sf": True, "round_sf": True},
}

# Round trip of the reference, per block: max |x - dequantize(quantize(x))| / amax(block) is at
# most half an ulp of the format at the top of the block's range, relative to the block's amax:
# e4m3 (3 mantissa bits): 16 / 256 = 2^-4 in the worst case (round_sf puts the block's amax
# anywhere in (224, 448]); e2m1: a gap of 2 between 4 and 6 over an amax above 4 = 2^-2; e5m6 (6
# mantissa bits): half an ulp of the amax's binade, 2^-7 of an amax at its bottom, plus 2^-20 for
# the fp32 roundings of the scaling and of the dequantization (each 2^-24 of the amax at most).
# A bf16 dequantized output adds its own rounding, below 2^-9 of a value at most the amax.
ROUND_TRIP_BOUND = {"e4m3": 2.0**-4, "e2m1": 2.0**-2, "e5m6": 2.0**-7 + 2.0**-20}
BF16_OUTPUT_SLACK = 2.0**-8

# The reference's padding between rows of a strided quantized input (e4m3 NaN; e2m1 ±6).
PADDING_BYTE = 0x7F

WHY_Q = "quantized data: the contract fixes the scale, the multiply and the rounding, so one byte is right"
WHY_SF = (
    "scale factors are data for the GEMM that consumes them: exact IEEE divisions or exponent bytes; "
    "NaN scales (from a NaN input) may differ in NaN payload only"
)
WHY_BACK = (
    "one fp32 multiply of two exact operands (decoded value × scale) then round-to-nearest-even to "
    "bf16 (or none for fp32): correctly rounded, so exactly one right answer; NaN payload is free"
)


@dataclass(frozen=True)
class QuantParams:
    fmt: str  # "e4m3" | "e2m1"
    num_per_channels: int  # C
    dtype: str  # "bf16" | "fp32": the casts' input, the cast back's output
    flags: str  # a key of FLAGS (scale layout and rounding)
    tokens: int
    hidden: int
    row_stride: int | None = None  # elements between rows of x; None: contiguous
    special: str = ""  # "naninf": NaN, +Inf and -Inf in the input
    sf_shift: int = 0  # precomputed sf: the given scales are sf_only's times 2^sf_shift (< 0: saturation acts)

    @property
    def kblocks(self) -> int:
        return ceil_div(self.hidden, self.num_per_channels)

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
    def power_of_two_scales(self) -> bool:
        return bool(self.flag_kwargs.get("round_sf") or self.flag_kwargs.get("use_packed_ue8m0"))

    @property
    def values_per_byte(self) -> int | Fraction:
        return PER_TOKEN_CAST_FORMATS[self.fmt].values_per_byte


def _shape_text(p: QuantParams) -> str:
    return f"{p.tokens}x{p.hidden}" + (f"ld{p.row_stride}" if p.row_stride else "")


# --- shapes -----------------------------------------------------------------------------------
# (tokens, hidden, row_stride). Hidden sizes and strides are multiples of 16 (the widest vectors);
# 7168 is DeepSeek-V3's hidden size; 96, 1040, 208 end in a partial 1×128 block; 4096 fills whole
# CTAs. Every combination runs once with few tokens (decode-like, at most 64) and once with many
# (at least 257): kernels may schedule by token count, and both tiers must reach the same compiled
# configurations, so the quick tier's "many" shapes keep the hidden size small instead.
FEW_TOKEN_SHAPES = [(37, 7168, 7232), (1, 4096, None), (37, 96, None), (64, 1040, None), (3, 208, 272)]
MANY_TOKEN_SHAPES = {
    "quick": [(300, 96, None), (257, 208, 272), (320, 1040, None), (289, 2048, 2112)],
    "full": [(1023, 7168, 7232), (4096, 1040, None), (777, 208, 272), (2049, 4096, None), (333, 96, None)],
}
# One scale per row (C == H): (fmt, dtype, flags, hidden, row_stride, tokens), same in both tiers.
WHOLE_ROW = [
    ("e4m3", "bf16", "plain", 7168, None, 37),
    ("e4m3", "fp32", "packed", 96, None, 333),
    ("e2m1", "bf16", "round+colmajor", 200, 264, 3),
    ("e2m1", "fp32", "plain", 1000, None, 300),
    ("e4m3", "bf16", "colmajor", 4096, 4160, 1),
]
ZERO_TOKEN_SHAPES = [(7168, None), (208, 272)]
# Hidden sizes / strides not multiples of 16 force narrower vectors: (hidden, row_stride, tokens).
NARROW_SHAPES = [(1000, None, 37), (200, 264, 300), (1002, 1010, 2), (999, None, 260)]
NANINF_TOKENS = {"quick": 4, "full": 64}


def _primary_and_edges(tier: str) -> list[QuantParams]:
    params: list[QuantParams] = []
    for shapes in (FEW_TOKEN_SHAPES, MANY_TOKEN_SHAPES[tier]):
        for i, (flags, fmt, C, dtype) in enumerate(product(FLAGS, FORMATS, CHANNELS, DTYPES)):
            tokens, hidden, stride = shapes[i % len(shapes)]
            params.append(QuantParams(fmt, C, dtype, flags, tokens, hidden, stride))
    for fmt, dtype, flags, hidden, stride, tokens in WHOLE_ROW:
        params.append(QuantParams(fmt, hidden, dtype, flags, tokens, hidden, stride))
    for i, (flags, fmt) in enumerate(product(FLAGS, FORMATS)):
        hidden, stride = ZERO_TOKEN_SHAPES[i % len(ZERO_TOKEN_SHAPES)]
        params.append(QuantParams(fmt, CHANNELS[i % 4], list(DTYPES)[i % 2], flags, 0, hidden, stride))
    flag_names = list(FLAGS)
    i = 0
    for (hidden, stride, tokens), fmt, dtype in product(NARROW_SHAPES, FORMATS, DTYPES):
        if fmt == "e2m1" and hidden % 2:
            continue  # e2m1 packs pairs: hidden must be even
        params.append(QuantParams(fmt, CHANNELS[i % 4], dtype, flag_names[i % len(flag_names)], tokens, hidden, stride))
        i += 1
    for fmt, flags in product(FORMATS, ("plain", "packed")):
        params.append(QuantParams(fmt, 32, "bf16", flags, NANINF_TOKENS[tier], 1040, None, "naninf"))
    return params


# Named benchmark workloads (the acceptance list): (title, params); "decode" runs in both tiers.
_DS = 7168  # DeepSeek-V3 hidden size
BENCHMARKS: dict[str, list[tuple[str, QuantParams]]] = {
    "per_token_cast": [
        ("e4m3 1×128, bf16 8192×7168", QuantParams("e4m3", 128, "bf16", "plain", 8192, _DS)),
        ("e4m3 1×128 round_sf + packed UE8M0", QuantParams("e4m3", 128, "bf16", "packed", 8192, _DS)),
        ("e4m3 1×32, bf16 8192×7168", QuantParams("e4m3", 32, "bf16", "plain", 8192, _DS)),
        ("e2m1 1×32, bf16 8192×7168", QuantParams("e2m1", 32, "bf16", "plain", 8192, _DS)),
        ("e2m1 1×16, bf16 8192×7168", QuantParams("e2m1", 16, "bf16", "plain", 8192, _DS)),
        ("decode: e4m3 1×128, 128 tokens", QuantParams("e4m3", 128, "bf16", "plain", 128, _DS)),
    ],
    "per_token_cast_with_sf_only": [
        ("scales only, e4m3 1×128, bf16 8192×7168", QuantParams("e4m3", 128, "bf16", "plain", 8192, _DS)),
    ],
    "per_token_cast_with_precomputed_sf": [
        ("given scales, e4m3 1×128, bf16 8192×7168", QuantParams("e4m3", 128, "bf16", "plain", 8192, _DS)),
    ],
    "per_token_cast_back": [
        ("cast back e4m3 1×128 → bf16, 8192×7168", QuantParams("e4m3", 128, "bf16", "plain", 8192, _DS)),
    ],
}
QUICK_BENCHMARKS = {"decode: e4m3 1×128, 128 tokens"}
# Given scales a quarter of what the data needs: even a power-of-two scale rounded up by almost 2
# then maps a block's amax to at least 2·Qmax, so saturation (±448 / ±6) acts in every block above
# the amax floor. Without these, a kernel that forgot to saturate would pass every other case.
# Float layouts only (scaling packed UE8M0 words would need exponent arithmetic).
SATURATING = [
    QuantParams("e4m3", 128, "bf16", "plain", 37, 1040, sf_shift=-2),
    QuantParams("e4m3", 32, "fp32", "round+colmajor", 5, 208, 272, sf_shift=-2),
    QuantParams("e2m1", 16, "bf16", "colmajor", 64, 1040, sf_shift=-2),
]
# Large cases of the full tier (timed there because of their size, not named workloads).
LARGE = {
    "per_token_cast": [QuantParams("e4m3", 128, "fp32", "round+colmajor", 8192, _DS)],
    "per_token_cast_back": [QuantParams("e2m1", 16, "bf16", "packed", 8192, _DS)],
}


# --- inputs -----------------------------------------------------------------------------------


def _values(tokens: int, hidden: int, generator: torch.Generator, special: str) -> torch.Tensor:
    values = torch.randn((tokens, hidden), generator=generator)
    if values.numel() == 0:
        return values
    # Rows of different magnitudes: the scales are per block, so every row finds its own range.
    values *= torch.exp2(torch.randint(-8, 9, (tokens, 1), generator=generator).float())
    if tokens >= 3:
        # Values around 1e-6: below e4m3's amax floor (1e-4), which then sets the scale.
        values[tokens // 2] = torch.randn(hidden, generator=generator) * 1e-6
    # Outliers: about one element in 512 is 64 times larger than its neighbours.
    where = torch.randint(0, values.numel(), (max(1, values.numel() // 512),), generator=generator)
    values.view(-1)[where] *= 64
    if special == "naninf":
        last = tokens - 1
        values[0, 0] = float("nan")
        values[last, hidden // 2] = float("inf")
        values[last, hidden - 1] = float("-inf")
    return values


def _make_x(
    p: QuantParams,
    device: torch.device,
    generator: torch.Generator | None,
    edge: Edge | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x ``[T, H]`` of ``p.dtype`` with row stride ``p.row_stride``; padding between rows is NaN. An
    edge case's values are then written into its ``block`` tiles (the cast's scale blocks)."""
    dtype = DTYPES[p.dtype]
    width = p.row_stride or p.hidden
    if generator is None:
        return torch.empty((p.tokens, width), dtype=dtype, device=device)[:, : p.hidden]
    wide = torch.full((p.tokens, width), float("nan"), dtype=dtype)
    wide[:, : p.hidden] = _values(p.tokens, p.hidden, generator, p.special).to(dtype)
    if edge is not None:
        write_cast_edge_values(wide[:, : p.hidden], edge.kind, generator, block or (1, p.hidden), p.fmt)
    return wide.to(device)[:, : p.hidden]


# The "scaled-subnormal" edge class: each chosen block gets one element at ±Qmax·2^k, so that its
# scale is exactly 2^k (round_sf too) and its multiplier exactly 2^-k, and the others at ±m·h·2^k,
# h half the format's subnormal step, 1 <= m < the given bound: their scaled values m·h are the
# format's subnormals and the ties between them (odd m), which round to nearest even.
SUBNORMAL_HALF_STEPS = {"e4m3": (2.0**-10, 16), "e2m1": (0.25, 4), "e5m6": (2.0**-21, 128)}


def write_cast_edge_values(
    x: torch.Tensor, kind: str, generator: torch.Generator, block: tuple[int, int], fmt: str
) -> None:
    """``registry.write_edge_values`` into the blocks of a cast, plus the cast-only class
    "scaled-subnormal" (``SUBNORMAL_HALF_STEPS``)."""
    if kind != "scaled-subnormal":
        write_edge_values(x, kind, generator, block=block)
        return
    half_step, bound = SUBNORMAL_HALF_STEPS[fmt]
    qmax = PER_TOKEN_CAST_FORMATS[fmt].qmax
    positions: list[int] = []
    values: list[torch.Tensor] = []
    columns = x.shape[1]
    for rows, cols in edge_units(x.shape[0], columns, block, generator):
        flat = (torch.arange(x.shape[0])[rows][:, None] * columns + torch.arange(columns)[cols][None, :]).reshape(-1)
        power = 2.0 ** int(torch.randint(-4, 5, (1,), generator=generator))
        signs = (torch.randint(0, 2, (flat.numel(),), generator=generator) * 2 - 1).to(torch.float64)
        steps = torch.randint(1, bound, (flat.numel(),), generator=generator).to(torch.float64)
        unit = signs * steps * half_step * power
        unit[torch.randint(0, flat.numel(), (1,), generator=generator)] = signs[0] * qmax * power  # the amax
        positions += flat.tolist()
        values.append(unit)
    write_at(x, positions, values)


def _strided_data(q: torch.Tensor, p: QuantParams, device: torch.device, fill: bool) -> torch.Tensor:
    """Quantized data with the row stride of ``p`` (a view of a wider, 0x7F-padded buffer)."""
    width = (p.row_stride or p.hidden) // p.values_per_byte
    if width == q.shape[1]:
        return q
    dtype = PER_TOKEN_CAST_FORMATS[p.fmt].storage_dtype
    if not fill:
        return torch.empty((q.shape[0], width), dtype=dtype, device=device)[:, : q.shape[1]]
    wide = torch.full((q.shape[0], width), PADDING_BYTE, dtype=torch.uint8, device=device).view(dtype)
    wide[:, : q.shape[1]] = q
    return wide[:, : q.shape[1]]


# --- the spec ---------------------------------------------------------------------------------


class QuantOp(OpSpec):
    """One of the four per-token quantization operators (``variant`` picks which)."""

    family = "quant"
    # The edge profile: every class, in x (the cast back: in the values its pair is made from), on
    # four quick cases (both formats and dtypes, four scale layouts, few and many tokens), and for
    # the given scales also on a case whose scales are too small, so that ±max and the outliers
    # overflow them.
    edge_kinds = CAST_EDGE_KINDS
    edge_base_count = 4
    edge_base_preferences = (
        {"fmt": "e4m3", "dtype": "bf16", "flags": "plain", "num_per_channels": 128},
        {"fmt": "e2m1", "dtype": "fp32", "flags": "packed", "num_per_channels": 32},
        {"fmt": "e4m3", "dtype": "fp32", "flags": "round+colmajor", "num_per_channels": 64},
        {"fmt": "e2m1", "dtype": "bf16", "flags": "round", "num_per_channels": 32, "tokens": 320},
    )

    def edge_base_ok(self, case: Case) -> bool:
        p: QuantParams = case.params
        return p.tokens > 0 and not p.special and not p.sf_shift and not case.benchmark

    def edge_bases(self, quick: list[Case]) -> list[Case]:
        bases = super().edge_bases(quick)
        if self.variant == "precomputed_sf":
            bases += [case for case in quick if case.params.sf_shift][:1]
        return bases

    def __init__(self, name: str):
        self.name = name
        self.variant = {
            "per_token_cast": "cast",
            "per_token_cast_with_sf_only": "sf_only",
            "per_token_cast_with_precomputed_sf": "precomputed_sf",
            "per_token_cast_back": "cast_back",
        }[name]
        q = Output("q", Bitwise(), WHY_Q)
        sf = Output("sf", Bitwise(nan_equal=True), WHY_SF)
        self.outputs = {
            "cast": (q, sf),
            "sf_only": (sf,),
            "precomputed_sf": (q,),
            "cast_back": (Output("out", Bitwise(nan_equal=True), WHY_BACK),),
        }[self.variant]

    # -- cases --

    def label(self, p: QuantParams) -> str:
        label = f"{self.name}/{p.fmt}/C{p.num_per_channels}/{p.dtype}/{_shape_text(p)}/{p.flags}"
        label += f"/{p.special}" if p.special else ""
        return label + (f"/sf2^{p.sf_shift}" if p.sf_shift else "")

    def cases(self, tier: str) -> list[Case]:
        cases = [Case(self.name, self.label(p), p) for p in _primary_and_edges(tier)]
        if self.variant == "precomputed_sf":
            cases += [Case(self.name, self.label(p), p) for p in SATURATING]
        for title, p in BENCHMARKS.get(self.name, []):
            if tier == "full" or title in QUICK_BENCHMARKS:
                cases.append(Case(self.name, self.label(p), p, benchmark=True, title=title))
        if tier == "full":
            cases += [Case(self.name, self.label(p), p) for p in LARGE.get(self.name, [])]
        return cases

    # -- inputs and functions --

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: QuantParams = case.params
        if self.variant == "cast_back":
            source = _make_x(p, device, generator, case.edge, (1, p.num_per_channels))
            if generator is None:
                width = p.hidden // p.values_per_byte
                data = torch.empty((p.tokens, width), dtype=CAST_FORMATS[p.fmt].storage_dtype, device=device)
                sf = p.layout.empty(p.tokens, p.kblocks, device)
            else:
                data, sf = reference.per_token_cast(source, p.fmt, p.num_per_channels, **p.flag_kwargs)
            data = _strided_data(data, p, device, fill=generator is not None)
            return Call(((data, sf), p.dtype, p.num_per_channels), context={"source": source})
        x = _make_x(p, device, generator, case.edge, (1, p.num_per_channels))
        args: tuple = (x, p.fmt, p.num_per_channels)
        if self.variant == "precomputed_sf":
            if generator is None:
                sf = p.layout.empty(p.tokens, p.kblocks, device)
            else:
                sf = reference.per_token_cast_with_sf_only(x, p.fmt, p.num_per_channels, **p.flag_kwargs)
                if p.sf_shift:
                    sf.mul_(2.0**p.sf_shift)  # exact (a power of two); in place keeps the scale layout
            args += (sf,)
        return Call(args, p.flag_kwargs)

    def reference(self) -> Callable:
        return getattr(reference, self.name)

    def optimized(self) -> Callable:
        # jit first: it points TileLang's kernel cache at TILEPROOF_CACHE_DIR before TileLang loads.
        importlib.import_module("tileproof.optimized.jit")
        return getattr(importlib.import_module("tileproof.optimized.quant"), self.name)

    def bytes_moved(self, case: Case) -> int:
        p: QuantParams = case.params
        elements = p.tokens * p.hidden
        x_bytes = elements * DTYPES[p.dtype].itemsize
        q_bytes = elements // p.values_per_byte
        sf_bytes = p.tokens * p.layout.logical_columns(p.kblocks) * 4
        return {
            "cast": x_bytes + q_bytes + sf_bytes,
            "sf_only": x_bytes + sf_bytes,
            "precomputed_sf": x_bytes + sf_bytes + q_bytes,
            "cast_back": q_bytes + sf_bytes + x_bytes,  # x_bytes: the output, of the same dtype
        }[self.variant]

    def compile_group(self, case: Case) -> Hashable | None:
        p: QuantParams = case.params
        if p.tokens == 0:
            return None  # nothing to launch, nothing compiled

        def alignment(n: int) -> int:  # the largest power of two (up to 16) dividing n
            return min(16, n & -n)

        kernel = "cast_back" if self.variant == "cast_back" else "per_token_cast"
        packed = "packed" in p.flags
        widths = (alignment(p.hidden), alignment(p.row_stride or p.hidden))
        return (kernel, p.fmt, p.num_per_channels, p.dtype, packed, *widths, p.tokens > 64)

    # -- the reference's self-checks --

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: QuantParams = case.params
        edge = case.edge is not None
        checks = [self._layout_check(p, outputs)]
        if self.variant == "cast_back":
            bound = ROUND_TRIP_BOUND[p.fmt] + (BF16_OUTPUT_SLACK if p.dtype == "bf16" else 0.0)
            checks.append(_round_trip_check(call.context["source"], outputs[0], p, bound, edge))
            return checks
        x = call.args[0]
        flags = p.flag_kwargs
        if self.variant == "cast":
            q, sf = outputs
            restored = reference.cast_back((q, sf), "fp32", (1, p.num_per_channels))
            checks.append(_round_trip_check(x, restored, p, ROUND_TRIP_BOUND[p.fmt], edge))
        elif self.variant == "sf_only":
            _, expected = reference.per_token_cast(x, p.fmt, p.num_per_channels, **flags)
            check = compare("sf_only ≡ per_token_cast's sf", outputs[0], expected, Bitwise(nan_equal=True))
            checks.append(check)
        else:  # precomputed_sf
            sf = call.args[3]
            restored = reference.cast_back((outputs[0], sf), "fp32", (1, p.num_per_channels))
            if p.sf_shift:
                # Scales too small on purpose: the data must be the source clamped at ±Qmax·sf.
                scales = reference.scales_from_layout(sf, p.kblocks).repeat_interleave(p.num_per_channels, dim=1)
                limit = scales[:, : p.hidden] * CAST_FORMATS[p.fmt].qmax
                clamped = torch.maximum(torch.minimum(x.float(), limit), -limit)
                checks.append(_round_trip_check(clamped, restored, p, ROUND_TRIP_BOUND[p.fmt], edge))
                saturated = bool((x.float().abs() > limit).any())
                detail = "" if saturated else "no element exceeds Qmax·sf: the case does not test saturation"
                checks.append(Check("saturation acts", PASS if saturated else FAIL, "some |x/sf| > Qmax", "", detail))
                return checks
            checks.append(_round_trip_check(x, restored, p, ROUND_TRIP_BOUND[p.fmt], edge))
            if p.power_of_two_scales:
                # With power-of-two scales both multipliers are the exact 1/sf: same bytes, except
                # in rows with NaN (a packed UE8M0 NaN scale reads back as +Inf, by design).
                expected, _ = reference.per_token_cast(x, p.fmt, p.num_per_channels, **flags)
                finite = torch.isfinite(x).all(dim=1)
                name = "≡ per_token_cast's q (power-of-two sf, finite rows)"
                checks.append(compare(name, outputs[0][finite], expected[finite], Bitwise()))
        return checks

    def _layout_check(self, p: QuantParams, outputs: tuple[torch.Tensor, ...]) -> Check:
        """The reference returns the documented dtypes, shapes and strides (contract §1)."""
        T, H = p.tokens, p.hidden
        leading = align(T, 4)
        if p.layout.kind == "packed_ue8m0":
            words = ceil_div(p.kblocks, 4)
            sf_expected = torch.empty_strided((T, words), (1, leading), dtype=torch.int32, device="meta")
        elif p.layout.kind == "col_major":
            sf_expected = torch.empty_strided((T, p.kblocks), (1, leading), dtype=torch.float32, device="meta")
        else:
            sf_expected = torch.empty((T, p.kblocks), dtype=torch.float32, device="meta")
        fmt = PER_TOKEN_CAST_FORMATS[p.fmt]
        q_expected = torch.empty((T, H // fmt.values_per_byte), dtype=fmt.storage_dtype, device="meta")
        expected = {
            "cast": (q_expected, sf_expected),
            "sf_only": (sf_expected,),
            "precomputed_sf": (q_expected,),
            "cast_back": (torch.empty((T, H), dtype=DTYPES[p.dtype], device="meta"),),
        }[self.variant]
        for output, actual, wanted in zip(self.outputs, outputs, expected, strict=True):
            problem = structure_mismatch(actual, wanted)
            if problem:
                return Check("reference layout", FAIL, "documented layout", "", f"{output.name}: {problem}")
        return Check("reference layout", PASS, "documented layout", "ok")


def edge_floor(case: Case, fmt: str) -> float | None:
    """For an edge case, the amax floor of ``fmt`` (its block round trips measure errors relative to
    the clamped amax, see ``_round_trip_check``); None for the other cases."""
    return PER_TOKEN_CAST_FORMATS[fmt].amax_floor if case.edge is not None else None


def _round_trip_check(
    x: torch.Tensor, restored: torch.Tensor, p: QuantParams, bound: float, edge: bool = False
) -> Check:
    """max over blocks of max |x - restored| / amax(block), in float64, over rows of finite x.

    With ``edge`` (an edge case): amax clamped at the format's floor, since a block below it (zeros,
    subnormals) is scaled by the floor and quantized relative to it; and rows whose dequantized
    values overflowed left out (an fp32 max quantizes to ±Qmax, and Qmax·sf can round above fp32's
    range: docs/numerics.md)."""
    name = "reference round trip"
    policy = f"block rel ≤ {bound:.4g}"
    tokens, hidden = x.shape
    if tokens == 0:
        return Check(name, PASS, policy, "empty")
    C = p.num_per_channels
    padding = p.kblocks * C - hidden
    source = torch.nn.functional.pad(x.to(torch.float64), (0, padding))
    error = (torch.nn.functional.pad(restored.to(torch.float64), (0, padding)) - source).abs()
    amax = source.abs().reshape(tokens, p.kblocks, C).amax(-1)
    worst_error = error.reshape(tokens, p.kblocks, C).amax(-1)
    finite_rows = torch.isfinite(source).all(dim=1)
    if edge:
        amax = torch.clamp(amax, min=PER_TOKEN_CAST_FORMATS[p.fmt].amax_floor)
        finite_rows &= torch.isfinite(restored).all(dim=1)
    relative = torch.where(worst_error == 0, torch.zeros_like(amax), worst_error / amax)
    relative = relative[finite_rows]
    worst = float(relative.max().item()) if relative.numel() else 0.0
    if not worst <= bound:
        row, block = divmod(int(relative.reshape(-1).nan_to_num(float("inf")).argmax().item()), p.kblocks)
        detail = f"block (row {row} of the finite rows, block {block}): relative error {worst:.4g} > {bound:.4g}"
        return Check(name, FAIL, policy, f"{worst:.4g}", detail)
    return Check(name, PASS, policy, f"{worst:.4g}")


# ---------------------------------------------------------------------------------------------
# The e5m6 cast: per_token_cast(x, "e5m6", H), one scale per row
# ---------------------------------------------------------------------------------------------
# An operator of its own here (same public function), so that per_token_cast's cases stay the
# e4m3 / e2m1 grid above. Hidden sizes give every packed store width of the optimized kernel (a
# multiple of 32: 48-byte chunks; 1040: 24; 200: 12) and both of its CTA sizes (96 and 200: rows of
# few chunks); both tiers use the same hidden sizes and strides (the same compiled kernels).

E5M6_OP = "per_token_cast_e5m6"
E5M6_SHAPES = {
    "quick": [(37, 7168, 7232), (1, 96, None), (3, 1040, 1056), (300, 200, None), (33, 4096, None)],
    "full": [(1023, 7168, 7232), (1, 96, None), (333, 1040, 1056), (4096, 200, None), (2049, 4096, None)],
}
E5M6_LARGE = QuantParams("e5m6", _DS, "bf16", "plain", 8192, _DS)


def _e5m6_params(tier: str) -> list[QuantParams]:
    shapes = E5M6_SHAPES[tier]
    params = []
    for i, (flags, dtype) in enumerate(product(FLAGS, DTYPES)):
        tokens, hidden, stride = shapes[i % len(shapes)]
        params.append(QuantParams("e5m6", hidden, dtype, flags, tokens, hidden, stride))
    params.append(QuantParams("e5m6", _DS, "bf16", "packed", 0, _DS))
    for dtype, flags in (("bf16", "plain"), ("fp32", "packed")):
        params.append(QuantParams("e5m6", 1040, dtype, flags, NANINF_TOKENS[tier], 1040, None, "naninf"))
    return params


def _alignment(n: int) -> int:
    """The largest power of two (up to 16) dividing n: what the kernels' vector widths depend on."""
    return min(16, n & -n)


class E5M6CastOp(QuantOp):
    """``per_token_cast(x, "e5m6", H, ...)``: q uint8 ``[T, 3H/2]`` and sf, both bitwise."""

    def __init__(self):
        super().__init__("per_token_cast")
        self.name = E5M6_OP

    def cases(self, tier: str) -> list[Case]:
        cases = [Case(self.name, self.label(p), p) for p in _e5m6_params(tier)]
        if tier == "full":
            cases.append(Case(self.name, self.label(E5M6_LARGE), E5M6_LARGE))
        return cases

    def reference(self) -> Callable:
        return reference.per_token_cast

    def optimized(self) -> Callable:
        importlib.import_module("tileproof.optimized.jit")
        return importlib.import_module("tileproof.optimized.quant").per_token_cast

    def compile_group(self, case: Case) -> Hashable | None:
        p: QuantParams = case.params
        if p.tokens == 0:
            return None
        return (self.name, p.dtype, "packed" in p.flags, p.hidden, _alignment(p.row_stride or p.hidden))

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: QuantParams = case.params
        q, sf = outputs
        restored = reference.cast_back((q, sf), "fp32", (1, p.hidden), x_special_fmt="e5m6")
        round_trip = _round_trip_check(call.args[0], restored, p, ROUND_TRIP_BOUND["e5m6"], case.edge is not None)
        return [self._layout_check(p, outputs), round_trip]


# ---------------------------------------------------------------------------------------------
# cast_back of every block shape and format
# ---------------------------------------------------------------------------------------------
# (per_token_cast_back above covers the 1×C blocks of e4m3 / e2m1.) Pairs made by the reference
# casts: 2-D blocks (per_block_cast, every scale layout), per-channel blocks (per_channel_cast,
# whose row-major scales are re-stored in the other layouts: a cast back reads any), and e5m6
# (per_token_cast "e5m6", one scale per row). Strided data rows are views of 0x7F-padded buffers; an
# e5m6 row stride of 150 bytes (not a multiple of 4) takes the kernel's byte path.

CAST_BACK_OP = "cast_back"
CAST_BACK_BLOCKS = ((32, 32), (32, 128), (128, 32), (128, 128))
CHANNEL_LAYOUTS = ("plain", "round", "colmajor", "packed")  # packed needs power-of-two scales: round_sf
CAST_BACK_SHAPES = {
    "quick": [(37, 320, 352), (1, 256, None), (130, 96, None), (3, 160, 176), (300, 288, None)],
    "full": [(1023, 7168, 7232), (1, 256, None), (4096, 96, None), (129, 160, 176), (2049, 288, None)],
}
E5M6_BACK_SHAPES = {
    "quick": [(37, 7168, 7232), (3, 96, 100), (130, 200, None), (1, 1040, 1048), (300, 4096, None)],
    "full": [(1023, 7168, 7232), (33, 96, 100), (4096, 200, None), (1, 1040, 1048), (2049, 4096, None)],
}
CAST_BACK_LARGE = (
    ("e4m3", (128, 128), "plain"),
    ("e4m3", (128, 1), "plain"),
    ("e5m6", (1, _DS), "plain"),
)


@dataclass(frozen=True)
class CastBackParams:
    fmt: str  # the data: "e4m3" | "e2m1" | "e5m6"
    block: tuple[int, int]  # x_block_size: (bm, bk), (nt, 1) per channel, or (1, H) (e5m6)
    dtype: str  # "bf16" | "fp32": the output, and the values the pair is made from
    flags: str  # a key of FLAGS: the pair's scale layout and rounding
    tokens: int
    hidden: int
    row_stride: int | None = None  # values between data rows; None: contiguous
    special: str = ""  # "naninf": NaN, +Inf and -Inf in the values the pair is made from

    @property
    def layout(self) -> ScaleLayout:
        kwargs = FLAGS[self.flags]
        return ScaleLayout.from_flags(
            kwargs.get("use_tma_aligned_col_major_sf", False), kwargs.get("use_packed_ue8m0", False)
        )

    @property
    def values_per_byte(self) -> int | Fraction:
        return PER_TOKEN_CAST_FORMATS[self.fmt].values_per_byte

    @property
    def channel(self) -> bool:
        return self.block[1] == 1

    @property
    def scale_grid(self) -> tuple[int, int]:
        return ceil_div(self.tokens, self.block[0]), ceil_div(self.hidden, self.block[1])


def _cast_back_params(tier: str) -> list[CastBackParams]:
    params = []
    shapes = CAST_BACK_SHAPES[tier]
    for i, (flags, fmt, dtype) in enumerate(product(FLAGS, FORMATS, DTYPES)):
        tokens, hidden, stride = shapes[i % len(shapes)]
        block = CAST_BACK_BLOCKS[i % len(CAST_BACK_BLOCKS)]
        params.append(CastBackParams(fmt, block, dtype, flags, tokens, hidden, stride))
    for i, (flags, fmt, dtype) in enumerate(product(CHANNEL_LAYOUTS, FORMATS, DTYPES)):
        tokens, hidden, stride = shapes[(i + 2) % len(shapes)]
        params.append(CastBackParams(fmt, ((32, 128)[i % 2], 1), dtype, flags, tokens, hidden, stride))
    e5m6_shapes = E5M6_BACK_SHAPES[tier]
    for i, (flags, dtype) in enumerate(product(FLAGS, DTYPES)):
        tokens, hidden, stride = e5m6_shapes[i % len(e5m6_shapes)]
        params.append(CastBackParams("e5m6", (1, hidden), dtype, flags, tokens, hidden, stride))
    params += [
        CastBackParams("e4m3", (128, 32), "bf16", "plain", 0, 208),
        CastBackParams("e2m1", (32, 1), "fp32", "plain", 0, 208),
        CastBackParams("e5m6", (1, 208), "bf16", "packed", 0, 208),
        CastBackParams("e4m3", (32, 128), "bf16", "plain", NANINF_TOKENS[tier], 320, None, "naninf"),
        CastBackParams("e5m6", (1, 7168), "bf16", "plain", NANINF_TOKENS[tier], 7168, None, "naninf"),
    ]
    return params


def _block_text(block: tuple[int, int]) -> str:
    return f"nt{block[0]}" if block[1] == 1 else f"{block[0]}x{block[1]}"


class CastBackOp(OpSpec):
    """``cast_back(x, fmt, x_block_size, x_special_fmt)`` for 2-D, per-channel and e5m6 pairs."""

    family = "quant"
    edge_kinds = CAST_EDGE_KINDS  # in the values the pair is made from, block by block
    edge_base_count = 3
    edge_base_preferences = ({"fmt": "e4m3", "dtype": "bf16"}, {"fmt": "e2m1", "flags": "packed"}, {"fmt": "e5m6"})

    def edge_base_ok(self, case: Case) -> bool:
        p: CastBackParams = case.params
        return p.tokens > 0 and not p.special and not case.benchmark

    def __init__(self):
        self.name = CAST_BACK_OP
        self.outputs = (Output("out", Bitwise(nan_equal=True), WHY_BACK),)

    def label(self, p: CastBackParams) -> str:
        label = f"{self.name}/{p.fmt}/{_block_text(p.block)}/{p.dtype}/{_shape_text(p)}/{p.flags}"
        return label + (f"/{p.special}" if p.special else "")

    def cases(self, tier: str) -> list[Case]:
        cases = [Case(self.name, self.label(p), p) for p in _cast_back_params(tier)]
        if tier == "full":
            for fmt, (bm, bk), flags in CAST_BACK_LARGE:
                p = CastBackParams(fmt, (bm, bk), "bf16", flags, 8192, _DS)
                cases.append(Case(self.name, self.label(p), p))
        return cases

    def _pair(self, p: CastBackParams, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flags = FLAGS[p.flags]
        if p.fmt == "e5m6":
            return reference.per_token_cast(x, "e5m6", p.hidden, **flags)
        if not p.channel:
            return reference_blocks.per_block_cast(x, p.fmt, p.block, **flags)
        power_of_two = bool(flags.get("round_sf") or flags.get("use_packed_ue8m0"))
        q, sf = reference_blocks.per_channel_cast(x, p.fmt, p.block[0], round_sf=power_of_two)
        return q, reference.scales_to_layout(sf, p.layout)

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: CastBackParams = case.params
        source = _make_x(p, device, generator, case.edge, p.block)
        if generator is None:
            width = int(p.hidden // p.values_per_byte)
            spec = PER_TOKEN_CAST_FORMATS[p.fmt]
            data = torch.empty((p.tokens, width), dtype=spec.storage_dtype, device=device)
            sf = p.layout.empty(*p.scale_grid, device)
        else:
            data, sf = self._pair(p, source)
        data = _strided_data(data, p, device, fill=generator is not None)
        kwargs = {"x_special_fmt": "e5m6"} if p.fmt == "e5m6" else {}
        return Call(((data, sf), p.dtype, p.block), kwargs, context={"source": source})

    def reference(self) -> Callable:
        return reference.cast_back

    def optimized(self) -> Callable:
        importlib.import_module("tileproof.optimized.jit")
        return importlib.import_module("tileproof.optimized.quant").cast_back

    def bytes_moved(self, case: Case) -> int:
        p: CastBackParams = case.params
        elements = p.tokens * p.hidden
        rows, kblocks = p.scale_grid
        sf_bytes = rows * p.layout.logical_columns(kblocks) * 4
        return int(elements // p.values_per_byte) + sf_bytes + elements * DTYPES[p.dtype].itemsize

    def compile_group(self, case: Case) -> Hashable | None:
        p: CastBackParams = case.params
        if p.tokens == 0:
            return None
        stride = p.row_stride or p.hidden
        widths = (_alignment(p.hidden), _alignment(stride), _alignment(int(stride // p.values_per_byte)))
        return (self.name, p.fmt, p.dtype, p.layout.kind == "packed_ue8m0", p.channel, *widths)

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        # oracle.quant_blocks imports this module: its block round-trip check is imported on use.
        from .quant_blocks import _round_trip_check as block_round_trip_check

        p: CastBackParams = case.params
        (out,) = outputs
        expected = torch.empty((p.tokens, p.hidden), dtype=DTYPES[p.dtype], device="meta")
        problem = structure_mismatch(out, expected)
        if problem:
            layout = Check("reference layout", FAIL, "documented layout", "", f"out: {problem}")
        else:
            layout = Check("reference layout", PASS, "documented layout", "ok")
        source = call.context["source"].to(torch.float32)
        bound = ROUND_TRIP_BOUND[p.fmt]
        return [layout, block_round_trip_check(source, out, p.block, bound, edge_floor(case, p.fmt))]


OPS = ("per_token_cast", "per_token_cast_with_sf_only", "per_token_cast_with_precomputed_sf", "per_token_cast_back")
for _name in OPS:
    register(QuantOp(_name))
register(E5M6CastOp())
register(CastBackOp())
