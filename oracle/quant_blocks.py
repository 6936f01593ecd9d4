"""The quantization family, continued (contract §1): 2-D block, per-channel and lossless casts.

Seven operators: ``per_block_cast``, ``per_block_cast_with_sf_only``,
``per_block_cast_with_precomputed_sf``, ``per_channel_cast``, ``per_channel_cast_fused``,
``per_channel_cast_and_transpose`` and ``per_block_cast_lossless`` (the e5m6 cast is
``per_token_cast(x, "e5m6", H)``, not a public name of its own: its cases belong to
``oracle.quant``). ``optimized()`` returns ``getattr(tileproof.optimized.quant, name, None)``: None
while the kernel does not exist, and the oracle then runs the reference and its self-checks only;
a kernel added to that module later is picked up without changing this file.

Every output is quantized data or scale bytes, so every comparison is bitwise (scales: NaN ≡ NaN).

Cases of each tier (both reach the same compile groups; ``full`` has larger shapes):

- ``per_block_cast`` and its two variants: every (scale flags, format, (bm, bk), dtype)
  combination, 5 × 2 × 4 × 2 = 80, on shapes taken in turn from a list with T ∈ {1, odd}, T and H
  not multiples of the blocks (tails in both dimensions) and strided rows; zero tokens; NaN and
  ±Inf; re-quantization of three kinds of quantized input (1×128 e4m3, 1×32 e2m1 with packed
  scales, 128×128 e4m3 with column-major scales), with strided data rows.
  ``per_block_cast_with_precomputed_sf`` takes ``per_block_cast_with_sf_only``'s scales of the same
  input, so |x / sf| never exceeds the format's maximum; five more cases (both formats, every scale
  layout, a re-quantization) give it those scales divided by 4 (``sf_shift`` -2, exact in every
  layout): even a power-of-two scale rounded up by almost 2 then maps a block's amax to at least
  2·Qmax, so every block above the format's amax floor saturates at ±448 (e4m3) or ±6 (e2m1).
- ``per_channel_cast``: (format, num_per_tokens, dtype, round_sf), tails, zero tokens, NaN/Inf.
- ``per_channel_cast_fused``: plain and 1×128-quantized inputs (every scale layout), without and
  with a gather ``pos_to_token`` holding -1 (padding rows) and P not a multiple of 128 (P = 0, 1,
  16, 129, 200), T = 0 with P > 0 (every row padding), strided rows.
- ``per_channel_cast_and_transpose``: num_per_tokens 32 and 128, round_sf, T ∈ {0, 1, odd, tails}.
- ``per_block_cast_lossless``: MXFP4 inputs (1×32 e2m1, power-of-two scales in each layout) to
  every output block (1×32, 1×128, 32×32, 32×128, 128×32, 128×128) and output layout, with tails,
  all-zero input blocks (scale 2^-126 next to ordinary ones) and strided data.
- benchmarks (``full``): "per_block_cast e4m3 128×128, 8192×7168 bf16" and "per_channel_cast e4m3
  (128 tokens per block), 8192×7168"; plus one large case per other operator, timed for its size.

Inputs are the ``oracle.quant`` rows (magnitudes 2^-8 .. 2^8 by row, a row below e4m3's amax floor,
64× outliers), except for the lossless cast, whose rows span 2^-3 .. 2^3 without outliers so that
every output block is convertible without loss (the exponent spread of a block stays well below
11). A strided input is a view of a wider buffer whose padding is NaN (quantized data: 0x7F bytes).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import product

import torch
from einops import rearrange

from tileproof.reference import quant as reference_quant
from tileproof.reference import quant_blocks as reference
from tileproof.reference.contract import CAST_FORMATS, ScaleLayout, ceil_div

from .policy import FAIL, PASS, Bitwise, Check, compare, structure_mismatch
from .quant import (
    BF16_OUTPUT_SLACK,
    DTYPES,
    FLAGS,
    FORMATS,
    PADDING_BYTE,
    ROUND_TRIP_BOUND,
    WHY_Q,
    WHY_SF,
    edge_floor,
    write_cast_edge_values,
)
from .quant import _values as random_rows
from .registry import CAST_EDGE_KINDS, Call, Case, Edge, OpSpec, Output, register

OPS = (
    "per_block_cast",
    "per_block_cast_with_sf_only",
    "per_block_cast_with_precomputed_sf",
    "per_channel_cast",
    "per_channel_cast_fused",
    "per_channel_cast_and_transpose",
    "per_block_cast_lossless",
)
BLOCKS = ((32, 32), (32, 128), (128, 32), (128, 128))
CHANNEL_FLAGS = ("plain", "round")  # the per-channel casts take round_sf only

WHY_LOSSLESS = (
    "the lossless cast is exact by contract: every FP8 byte and power-of-two scale is determined by the FP4 "
    "input, and both dequantize to the same fp32 bits"
)


# Quantized inputs: name → (format, x_block_size, flags of the cast that makes the pair).
SOURCES = {
    "e4m3-1x128": ("e4m3", (1, 128), {}),
    "e4m3-1x128-colmajor": ("e4m3", (1, 128), {"use_tma_aligned_col_major_sf": True}),
    "e4m3-1x128-packed": ("e4m3", (1, 128), FLAGS["packed"]),
    "e2m1-1x32-packed": ("e2m1", (1, 32), FLAGS["packed"]),
    "e4m3-128x128-colmajor": ("e4m3", (128, 128), {"use_tma_aligned_col_major_sf": True}),
    "e2m1-1x32-round": ("e2m1", (1, 32), {"round_sf": True}),
    "e2m1-1x32-round+colmajor": ("e2m1", (1, 32), FLAGS["round+colmajor"]),
}
LOSSLESS_SOURCES = ("e2m1-1x32-round", "e2m1-1x32-round+colmajor", "e2m1-1x32-packed")


@dataclass(frozen=True)
class BlockParams:
    fmt: str  # the output format: "e4m3" | "e2m1"
    block: tuple[int, int]  # per-block: (bm, bk); per-channel: (nt, 1); lossless: the output block
    dtype: str  # "bf16" | "fp32": the dtype of a plain x, and of the values a quantized x is made from
    flags: str  # a key of FLAGS: the output scale layout and rounding
    tokens: int
    hidden: int
    row_stride: int | None = None  # values between rows of x (or of a quantized x's data); None: contiguous
    source: str = ""  # "": x is a plain tensor; else a key of SOURCES: x is that quantized pair
    rows: int | None = None  # per_channel_cast_fused: P, the length of pos_to_token; None: no gather
    special: str = ""  # "naninf": NaN, +Inf and -Inf in the input
    sf_shift: int = 0  # precomputed sf: the given scales are sf_only's times 2^sf_shift (< 0: saturation acts)

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
    def round_sf(self) -> bool:
        return bool(self.flag_kwargs.get("round_sf") or self.flag_kwargs.get("use_packed_ue8m0"))

    @property
    def out_tokens(self) -> int:
        """Rows of the output: P for a gather, else T."""
        return self.tokens if self.rows is None else self.rows


def _shape_text(p: BlockParams) -> str:
    return f"{p.tokens}x{p.hidden}" + (f"ld{p.row_stride}" if p.row_stride else "")


# --- shapes -----------------------------------------------------------------------------------
# (tokens, hidden, row_stride): T ∈ {1, odd}, tails of every block in both dimensions (T and H not
# multiples of 32 or 128), strided rows; hidden sizes even (e2m1 packs pairs). 7168: DeepSeek-V3.
BLOCK_SHAPES = {
    "quick": [(37, 320, 336), (1, 256, None), (130, 96, None), (3, 160, 176), (64, 288, None)],
    "full": [(1023, 7168, 7232), (4096, 1040, None), (129, 4096, None), (1, 7168, None), (333, 96, 112)],
}
REQUANT_SHAPE = {"quick": (45, 256, 288), "full": (1000, 7168, 7232)}
NANINF_SHAPE = {"quick": (4, 288), "full": (64, 1040)}
ZERO_HIDDEN = 208
_DS = 7168  # DeepSeek-V3 hidden size


def _per_block_params(tier: str) -> list[BlockParams]:
    params = []
    shapes = BLOCK_SHAPES[tier]
    for i, (flags, fmt, block, dtype) in enumerate(product(FLAGS, FORMATS, BLOCKS, DTYPES)):
        tokens, hidden, stride = shapes[i % len(shapes)]
        params.append(BlockParams(fmt, block, dtype, flags, tokens, hidden, stride))
    for fmt, flags in (("e4m3", "plain"), ("e2m1", "packed")):
        params.append(BlockParams(fmt, (128, 32), "bf16", flags, 0, ZERO_HIDDEN))
        tokens, hidden = NANINF_SHAPE[tier]
        params.append(BlockParams(fmt, (32, 128), "bf16", flags, tokens, hidden, special="naninf"))
    tokens, hidden, stride = REQUANT_SHAPE[tier]
    for source, (fmt, block, flags) in product(
        ("e4m3-1x128", "e2m1-1x32-packed", "e4m3-128x128-colmajor"),
        (("e4m3", (128, 128), "plain"), ("e2m1", (32, 32), "packed")),
    ):
        params.append(BlockParams(fmt, block, "bf16", flags, tokens, hidden, stride, source=source))
    return params


# Saturating cases of the precomputed-sf cast: (format, block, dtype, flags, shape index, source).
SATURATING = [
    ("e4m3", (32, 128), "bf16", "plain", 0, ""),
    ("e4m3", (128, 128), "fp32", "packed", 2, ""),
    ("e4m3", (32, 32), "bf16", "round+colmajor", 3, ""),
    ("e2m1", (128, 32), "bf16", "colmajor", 4, ""),
    ("e4m3", (128, 128), "bf16", "plain", 0, "e4m3-1x128"),
]


def _precomputed_params(tier: str) -> list[BlockParams]:
    """The per-block cases, then the saturating ones: given scales a quarter of what the data needs."""
    params = _per_block_params(tier)
    shapes = BLOCK_SHAPES[tier]
    for fmt, block, dtype, flags, index, source in SATURATING:
        if source:
            tokens, hidden, stride = REQUANT_SHAPE[tier]
        else:
            tokens, hidden, stride = shapes[index]
        params.append(BlockParams(fmt, block, dtype, flags, tokens, hidden, stride, source=source, sf_shift=-2))
    return params


CHANNEL_SHAPES = {
    "quick": [(300, 96, None), (1, 64, None), (37, 160, 176), (128, 32, None)],
    "full": [(4099, 7168, 7232), (1, 7168, None), (333, 1040, None), (8192, 96, None)],
}


def _per_channel_params(tier: str) -> list[BlockParams]:
    params = []
    shapes = CHANNEL_SHAPES[tier]
    for i, (fmt, nt, dtype, flags) in enumerate(product(FORMATS, (32, 128), DTYPES, CHANNEL_FLAGS)):
        tokens, hidden, stride = shapes[i % len(shapes)]
        params.append(BlockParams(fmt, (nt, 1), dtype, flags, tokens, hidden, stride))
    params.append(BlockParams("e4m3", (128, 1), "bf16", "plain", 0, ZERO_HIDDEN))
    tokens, hidden = NANINF_SHAPE[tier]
    params.append(BlockParams("e2m1", (32, 1), "fp32", "round", tokens, hidden, special="naninf"))
    return params


# per_channel_cast_fused: (dtype or source, flags, tokens, hidden, row_stride, rows P or None).
FUSED = {
    "quick": [
        ("bf16", "plain", 256, 64, None, None),
        ("fp32", "round", 300, 32, 48, None),
        ("bf16", "plain", 1, 64, None, None),
        ("bf16", "round", 0, 64, None, None),
        ("bf16", "plain", 50, 96, 112, 200),
        ("fp32", "round", 7, 64, None, 129),
        ("bf16", "plain", 3, 32, None, 1),
        ("bf16", "plain", 9, 64, None, 0),
        ("bf16", "round", 0, 32, None, 16),
        ("e4m3-1x128", "plain", 40, 256, 384, 136),
        ("e4m3-1x128-colmajor", "round", 129, 128, None, None),
        ("e4m3-1x128-packed", "plain", 5, 256, None, 200),
    ],
    "full": [
        ("bf16", "plain", 8192, _DS, None, None),
        ("fp32", "round", 4099, 1040, 1056, None),
        ("bf16", "plain", 1, 64, None, None),
        ("bf16", "round", 0, 64, None, None),
        ("bf16", "plain", 4096, _DS, 7232, 8192 + 64),
        ("fp32", "round", 7, 64, None, 129),
        ("bf16", "plain", 3, 32, None, 1),
        ("bf16", "plain", 9, 64, None, 0),
        ("bf16", "round", 0, 32, None, 16),
        ("e4m3-1x128", "plain", 4096, _DS, 7296, 8192 + 16),
        ("e4m3-1x128-colmajor", "round", 8193, 1024, None, None),
        ("e4m3-1x128-packed", "plain", 5, 256, None, 200),
    ],
}


def _fused_params(tier: str) -> list[BlockParams]:
    params = []
    for kind, flags, tokens, hidden, stride, rows in FUSED[tier]:
        dtype, source = (kind, "") if kind in DTYPES else ("bf16", kind)
        params.append(BlockParams("e4m3", (128, 1), dtype, flags, tokens, hidden, stride, source, rows))
    return params


TRANSPOSE_SHAPES = {
    "quick": [(0, 64, None), (1, 64, None), (33, 48, 64), (300, 16, None), (256, 96, None)],
    "full": [(0, 64, None), (1, 64, None), (8192, _DS, None), (4099, 1040, 1056), (256, 96, None)],
}


def _transpose_params(tier: str) -> list[BlockParams]:
    params = []
    for i, (tokens, hidden, stride) in enumerate(TRANSPOSE_SHAPES[tier]):
        for j, nt in enumerate((32, 128)):
            flags = CHANNEL_FLAGS[(i + j) % 2]
            params.append(BlockParams("e4m3", (nt, 1), "bf16", flags, tokens, hidden, stride))
    return params


LOSSLESS_OUT_BLOCKS = ((1, 32), (1, 128), (32, 32), (32, 128), (128, 32), (128, 128))
LOSSLESS_OUT_FLAGS = ("plain", "colmajor", "packed", "round")
LOSSLESS_SHAPES = {
    "quick": [(33, 96, None), (130, 256, 288), (1, 32, None), (64, 160, None)],
    "full": [(4096, _DS, None), (1000, 1024, 1088), (1, 32, None), (129, 4096, None)],
}


def _lossless_params(tier: str) -> list[BlockParams]:
    params = []
    shapes = LOSSLESS_SHAPES[tier]
    for i, block in enumerate(LOSSLESS_OUT_BLOCKS):
        for j in range(2):
            tokens, hidden, stride = shapes[(2 * i + j) % len(shapes)]
            source = LOSSLESS_SOURCES[(i + j) % len(LOSSLESS_SOURCES)]
            flags = LOSSLESS_OUT_FLAGS[(i + 2 * j) % len(LOSSLESS_OUT_FLAGS)]
            params.append(BlockParams("e4m3", block, "bf16", flags, tokens, hidden, stride, source))
    params.append(BlockParams("e4m3", (128, 128), "bf16", "packed", 0, 64, source="e2m1-1x32-round"))
    return params


# Named benchmark workloads (the acceptance list), full tier: (title, params).
BENCHMARKS: dict[str, list[tuple[str, BlockParams]]] = {
    "per_block_cast": [
        ("per_block_cast e4m3 128×128, 8192×7168 bf16", BlockParams("e4m3", (128, 128), "bf16", "plain", 8192, _DS)),
    ],
    "per_channel_cast": [
        (
            "per_channel_cast e4m3 (128 tokens per block), 8192×7168",
            BlockParams("e4m3", (128, 1), "bf16", "plain", 8192, _DS),
        ),
    ],
}
# Large cases of the full tier (timed there because of their size, not named workloads).
LARGE = {
    "per_block_cast_with_sf_only": [BlockParams("e4m3", (128, 128), "bf16", "plain", 8192, _DS)],
    "per_block_cast_with_precomputed_sf": [BlockParams("e4m3", (128, 128), "bf16", "packed", 8192, _DS)],
    "per_block_cast_lossless": [BlockParams("e4m3", (128, 128), "bf16", "round", 8192, _DS, source="e2m1-1x32-round")],
}

CASE_PARAMS: dict[str, Callable[[str], list[BlockParams]]] = {
    "per_block_cast": _per_block_params,
    "per_block_cast_with_sf_only": _per_block_params,
    "per_block_cast_with_precomputed_sf": _precomputed_params,
    "per_channel_cast": _per_channel_params,
    "per_channel_cast_fused": _fused_params,
    "per_channel_cast_and_transpose": _transpose_params,
    "per_block_cast_lossless": _lossless_params,
}


# --- inputs -----------------------------------------------------------------------------------


def _lossless_rows(tokens: int, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of magnitudes 2^-3 .. 2^3 (no outliers, no tiny rows), one all-zero row."""
    values = torch.randn((tokens, hidden), generator=generator)
    if values.numel() == 0:
        return values
    values *= torch.exp2(torch.randint(-3, 4, (tokens, 1), generator=generator).float())
    if tokens >= 3:
        values[tokens // 2] = 0.0  # its input blocks get the floor scale 2^-126: exact under any shift
    return values


def _plain_x(
    p: BlockParams,
    device: torch.device,
    generator: torch.Generator | None,
    *,
    lossless=False,
    edge: Edge | None = None,
    edge_block: tuple[int, int] | None = None,
):
    """x ``[T, H]`` of ``p.dtype`` with row stride ``p.row_stride``; padding between rows is NaN. An
    edge case's values go into the ``edge_block`` tiles (default ``p.block``: the cast's blocks)."""
    dtype = DTYPES[p.dtype]
    width = p.row_stride or p.hidden
    if generator is None:
        return torch.empty((p.tokens, width), dtype=dtype, device=device)[:, : p.hidden]
    if lossless:
        values = _lossless_rows(p.tokens, p.hidden, generator)
    else:
        values = random_rows(p.tokens, p.hidden, generator, p.special)
    wide = torch.full((p.tokens, width), float("nan"), dtype=dtype)
    wide[:, : p.hidden] = values.to(dtype)
    if edge is not None:
        write_cast_edge_values(wide[:, : p.hidden], edge.kind, generator, edge_block or p.block, p.fmt)
    return wide.to(device)[:, : p.hidden]


def _strided(data: torch.Tensor, width: int, fill: bool) -> torch.Tensor:
    """Quantized data as a view of a ``width``-column buffer padded with 0x7F bytes."""
    if width == data.shape[1]:
        return data
    if not fill:
        return torch.empty((data.shape[0], width), dtype=data.dtype, device=data.device)[:, : data.shape[1]]
    wide = torch.full((data.shape[0], width), PADDING_BYTE, dtype=torch.uint8, device=data.device).view(data.dtype)
    wide[:, : data.shape[1]] = data
    return wide[:, : data.shape[1]]


def _quantized_x(
    p: BlockParams, device: torch.device, generator: torch.Generator | None, *, lossless=False, edge: Edge | None = None
):
    """The quantized input ``(data, sf)`` named by ``p.source`` and its block, made from random rows
    (an edge case's values in the blocks of the output cast, ``p.block``)."""
    fmt, block, flags = SOURCES[p.source]
    spec = CAST_FORMATS[fmt]
    plain = BlockParams(fmt, block, p.dtype, "plain", p.tokens, p.hidden)
    x = _plain_x(plain, device, generator, lossless=lossless, edge=edge, edge_block=p.block)
    if generator is None:
        layout = ScaleLayout.from_flags(
            flags.get("use_tma_aligned_col_major_sf", False), flags.get("use_packed_ue8m0", False)
        )
        data = torch.empty((p.tokens, p.hidden // spec.values_per_byte), dtype=spec.storage_dtype, device=device)
        sf = layout.empty(ceil_div(p.tokens, block[0]), ceil_div(p.hidden, block[1]), device)
    elif block[0] == 1:
        data, sf = reference_quant.per_token_cast(x, fmt, block[1], **flags)
    else:
        data, sf = reference.per_block_cast(x, fmt, block, **flags)
    width = (p.row_stride or p.hidden) // spec.values_per_byte
    return (_strided(data, width, fill=generator is not None), sf), block


def _pos_to_token(p: BlockParams, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """int32 ``[P]`` rows of x in ``[-1, T)``: about one in eight is -1, the last one is -1."""
    if generator is None:
        return torch.empty((p.rows,), dtype=torch.int32, device=device)
    pos = torch.randint(0, max(p.tokens, 1), (p.rows,), generator=generator, dtype=torch.int32)
    padding = torch.rand(p.rows, generator=generator) < 0.125
    if p.rows:
        padding[-1] = True
    if p.tokens == 0:
        padding[:] = True
    return torch.where(padding, -1, pos).to(device)


# --- the spec ---------------------------------------------------------------------------------


def optimized_quant(name: str) -> Callable | None:
    """``tileproof.optimized.quant.<name>``, or None while that module or the name does not exist."""
    if importlib.util.find_spec("tileproof.optimized.quant") is None:
        return None
    # jit first: it points TileLang's kernel cache at TILEPROOF_CACHE_DIR before TileLang loads.
    importlib.import_module("tileproof.optimized.jit")
    return getattr(importlib.import_module("tileproof.optimized.quant"), name, None)


class BlockCastOp(OpSpec):
    """One of the seven operators (``name`` picks which; they share inputs and checks)."""

    family = "quant"

    def __init__(self, name: str):
        self.name = name
        q, sf = Output("q", Bitwise(), WHY_Q), Output("sf", Bitwise(nan_equal=True), WHY_SF)
        self.outputs = {
            "per_block_cast_with_sf_only": (sf,),
            "per_block_cast_with_precomputed_sf": (q,),
            "per_block_cast_lossless": (Output("q", Bitwise(), WHY_LOSSLESS), Output("sf", Bitwise(), WHY_LOSSLESS)),
        }.get(name, (q, sf))

    # -- the edge profile: every class, in x (in the values a quantized x is made from), on three
    # quick cases; not the lossless cast, whose FP4 input takes no edge values (docs/numerics.md) --

    edge_base_count = 3
    edge_base_preferences = (
        {"fmt": "e4m3", "dtype": "bf16", "flags": "plain", "source": ""},
        {"fmt": "e2m1", "dtype": "fp32"},
        {"fmt": "e4m3", "flags": "round"},
    )

    @property
    def edge_kinds(self) -> tuple[str, ...]:
        return () if self.name == "per_block_cast_lossless" else CAST_EDGE_KINDS

    def edge_base_ok(self, case: Case) -> bool:
        p: BlockParams = case.params
        return p.tokens > 0 and p.out_tokens > 0 and not p.special and not p.sf_shift and not case.benchmark

    def edge_bases(self, quick: list[Case]) -> list[Case]:
        bases = super().edge_bases(quick)
        if self.name == "per_block_cast_with_precomputed_sf":
            # Given scales too small: ±max and the outliers overflow them and saturate.
            bases += [case for case in quick if case.params.sf_shift][:1]
        return bases

    # -- cases --

    def label(self, p: BlockParams) -> str:
        block = f"{p.block[0]}x{p.block[1]}" if p.block[1] != 1 else f"nt{p.block[0]}"
        kind = f"from-{p.source}" if p.source else p.dtype
        label = f"{self.name}/{p.fmt}/{block}/{kind}/{_shape_text(p)}"
        if p.rows is not None:
            label += f"/P{p.rows}"
        label += f"/{p.flags}"
        label += f"/sf2^{p.sf_shift}" if p.sf_shift else ""
        return label + (f"/{p.special}" if p.special else "")

    def cases(self, tier: str) -> list[Case]:
        cases = [Case(self.name, self.label(p), p) for p in CASE_PARAMS[self.name](tier)]
        if tier == "full":
            for title, p in BENCHMARKS.get(self.name, []):
                cases.append(Case(self.name, self.label(p), p, benchmark=True, title=title))
            cases += [Case(self.name, self.label(p), p) for p in LARGE.get(self.name, [])]
        return cases

    # -- inputs and functions --

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: BlockParams = case.params
        lossless = self.name == "per_block_cast_lossless"
        # "source": the values the cast quantizes (a quantized x dequantized), for the round trip.
        if p.source:
            x, x_block = _quantized_x(p, device, generator, lossless=lossless, edge=case.edge)
            source = reference_quant.dequantize(x, x_block) if generator is not None else None
        else:
            x, x_block = _plain_x(p, device, generator, edge=case.edge), None
            source = x.to(torch.float32) if generator is not None else None
        context = {"source": source}
        kwargs = p.flag_kwargs
        if self.name == "per_block_cast_lossless":
            return Call((x, "e4m3", x_block, p.block), kwargs, context)
        if self.name.startswith("per_block_cast"):
            args: tuple = (x, p.fmt, p.block)
            if self.name == "per_block_cast_with_precomputed_sf":
                rows, kblocks = ceil_div(p.tokens, p.block[0]), ceil_div(p.hidden, p.block[1])
                if generator is None:
                    sf = p.layout.empty(rows, kblocks, device)
                else:
                    sf = reference.per_block_cast_with_sf_only(x, p.fmt, p.block, x_block_size=x_block, **kwargs)
                    sf = _shifted_scales(sf, p, kblocks)
                args += (sf,)
            if x_block is not None:
                kwargs["x_block_size"] = x_block
            return Call(args, kwargs, context)
        round_sf = {"round_sf": True} if p.round_sf else {}
        nt = p.block[0]
        if self.name == "per_channel_cast":
            return Call((x, p.fmt, nt), round_sf, context)
        if self.name == "per_channel_cast_and_transpose":
            return Call((x, p.fmt, nt), round_sf, context)
        kwargs = dict(round_sf)  # per_channel_cast_fused
        if p.source:
            kwargs["num_per_channels"] = x_block[1]
        if p.rows is not None:
            kwargs["pos_to_token"] = _pos_to_token(p, device, generator)
        return Call((x, p.fmt, nt), kwargs, context)

    def reference(self) -> Callable:
        return getattr(reference, self.name)

    def optimized(self) -> Callable | None:
        return optimized_quant(self.name)

    def compile_group(self, case: Case) -> Hashable | None:
        p: BlockParams = case.params
        if p.out_tokens == 0 or self.optimized() is None:
            return None  # nothing to launch, or nothing to compile yet
        source = SOURCES[p.source][:2] if p.source else None
        return (self.name, p.fmt, p.block, p.dtype, p.layout.kind, p.round_sf, source, p.rows is not None)

    def bytes_moved(self, case: Case) -> int:
        p: BlockParams = case.params
        T, H, P = p.tokens, p.hidden, p.out_tokens
        spec = CAST_FORMATS[p.fmt]
        if p.source:
            in_fmt, in_block, in_flags = SOURCES[p.source]
            in_layout = ScaleLayout.from_flags(
                in_flags.get("use_tma_aligned_col_major_sf", False), in_flags.get("use_packed_ue8m0", False)
            )
            in_kblocks = in_layout.logical_columns(ceil_div(H, in_block[1]))
            rows_read = P if p.rows is not None else T
            x_bytes = rows_read * H // CAST_FORMATS[in_fmt].values_per_byte
            x_bytes += ceil_div(rows_read, in_block[0]) * in_kblocks * 4
        else:
            x_bytes = P * H * DTYPES[p.dtype].itemsize  # a gather reads P rows
        if p.rows is not None:
            x_bytes += P * 4  # pos_to_token
        q_bytes = P * H // spec.values_per_byte
        sf_bytes = ceil_div(P, p.block[0]) * p.layout.logical_columns(ceil_div(H, p.block[1])) * 4
        if self.name == "per_block_cast_with_sf_only":
            return x_bytes + sf_bytes
        if self.name == "per_block_cast_with_precomputed_sf":
            return x_bytes + sf_bytes + q_bytes  # reads sf, writes q
        return x_bytes + q_bytes + sf_bytes

    # -- the reference's self-checks --

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: BlockParams = case.params
        checks = [self._layout_check(p, outputs)]
        floor = edge_floor(case, p.fmt)
        source = call.context["source"]
        x, kwargs = call.args[0], call.kwargs
        if self.name == "per_block_cast_lossless":
            q, sf = outputs
            before = reference_quant.cast_back(x, "fp32", call.args[2])
            after = reference_quant.cast_back((q, sf), "fp32", p.block)
            checks.append(compare("dequantized ≡ the FP4 input's fp32 bits", after, before, Bitwise()))
            scales = reference_quant.scales_from_layout(sf, ceil_div(p.hidden, p.block[1]))
            powers = bool(((scales.view(torch.int32) & 0x807FFFFF) == 0).all()) and bool((scales > 0).all())
            checks.append(Check("scales are positive powers of two", PASS if powers else FAIL, "exact", ""))
            return checks
        if self.name == "per_block_cast_with_sf_only":
            _, expected = reference.per_block_cast(x, p.fmt, p.block, **kwargs)
            checks.append(compare("sf_only ≡ per_block_cast's sf", outputs[0], expected, Bitwise(nan_equal=True)))
            return checks
        if self.name == "per_block_cast_with_precomputed_sf":
            q, sf = outputs[0], call.args[3]
            restored = reference_quant.cast_back((q, sf), "fp32", p.block)
            if p.sf_shift:
                # Saturation: the round trip restores the source clamped to ±Qmax·sf, block by block.
                limit = CAST_FORMATS[p.fmt].qmax * _per_element_scales(sf, p)
                saturated = (source.abs() > limit).sum().item()
                checks.append(Check("saturation acts", PASS if saturated else FAIL, "premise", f"{saturated} elements"))
                source = torch.clamp(source, -limit, limit)
            checks.append(_round_trip_check(source, restored, p.block, ROUND_TRIP_BOUND[p.fmt], floor))
            if p.round_sf and not p.sf_shift and bool(torch.isfinite(source).all()):
                # With power-of-two scales the multipliers are the exact 1/sf: the cast's own bytes.
                expected, _ = reference.per_block_cast(x, p.fmt, p.block, **kwargs)
                checks.append(compare("≡ per_block_cast's q (power-of-two sf)", q, expected, Bitwise()))
            return checks
        q, sf = outputs
        if self.name == "per_channel_cast_and_transpose":
            expected_q, expected_sf = reference.per_channel_cast(x, p.fmt, p.block[0], **kwargs)
            checks.append(compare("q ≡ per_channel_cast's q, transposed", q, expected_q.T.contiguous(), Bitwise()))
            checks.append(compare("sf ≡ per_channel_cast's sf", sf, expected_sf, Bitwise(nan_equal=True)))
            q = q.T
        if self.name == "per_channel_cast_fused":
            rows = _gathered(source, kwargs.get("pos_to_token"))
            expected_q, expected_sf = reference.per_channel_cast(rows, "e4m3", p.block[0], **_round(kwargs))
            checks.append(compare("q ≡ per_channel_cast of the gathered rows", q, expected_q, Bitwise()))
            checks.append(
                compare("sf ≡ per_channel_cast of the gathered rows", sf, expected_sf, Bitwise(nan_equal=True))
            )
            source = rows
        restored = reference_quant.cast_back((q.contiguous(), sf), "fp32", p.block)
        checks.append(_round_trip_check(source, restored, p.block, ROUND_TRIP_BOUND[p.fmt], floor))
        return checks

    def _layout_check(self, p: BlockParams, outputs: tuple[torch.Tensor, ...]) -> Check:
        """The reference returns the documented dtypes, shapes and strides (contract §1)."""
        P, H = p.out_tokens, p.hidden
        rows, kblocks = ceil_div(P, p.block[0]), ceil_div(H, p.block[1])
        sf_expected = p.layout.empty(rows, kblocks, "meta")
        if self.name.startswith("per_channel"):
            sf_expected = torch.empty((rows, kblocks), dtype=torch.float32, device="meta")
        fmt = CAST_FORMATS[p.fmt]
        q_expected = torch.empty((P, H // fmt.values_per_byte), dtype=fmt.storage_dtype, device="meta")
        if self.name == "per_channel_cast_and_transpose":
            q_expected = torch.empty((H, P), dtype=fmt.storage_dtype, device="meta")
        expected = {
            "per_block_cast_with_sf_only": (sf_expected,),
            "per_block_cast_with_precomputed_sf": (q_expected,),
        }.get(self.name, (q_expected, sf_expected))
        for output, actual, wanted in zip(self.outputs, outputs, expected, strict=True):
            problem = structure_mismatch(actual, wanted)
            if problem:
                return Check("reference layout", FAIL, "documented layout", "", f"{output.name}: {problem}")
        return Check("reference layout", PASS, "documented layout", "ok")


def _shifted_scales(sf: torch.Tensor, p: BlockParams, kblocks: int) -> torch.Tensor:
    """The stored scales ``sf`` times ``2^p.sf_shift``, in the same layout (exact: a power of two)."""
    if not p.sf_shift:
        return sf
    scales = reference_quant.scales_from_layout(sf, kblocks) * 2.0**p.sf_shift
    return reference_quant.scales_to_layout(scales, p.layout)


def _per_element_scales(sf: torch.Tensor, p: BlockParams) -> torch.Tensor:
    """The scale of every element's block, fp32 ``[T, H]``."""
    scales = reference_quant.scales_from_layout(sf, ceil_div(p.hidden, p.block[1]))
    return reference_quant.expand_blocks(scales, p.block[0], p.block[1], p.tokens, p.hidden)


def _round(kwargs: dict) -> dict:
    return {"round_sf": True} if kwargs.get("round_sf") else {}


def _gathered(values: torch.Tensor, pos_to_token: torch.Tensor | None) -> torch.Tensor:
    """``values[pos_to_token]`` row by row, a zero row for -1 (an independent loop over P rows)."""
    if pos_to_token is None:
        return values
    rows = [values[int(t)] if t >= 0 else values.new_zeros(values.shape[1]) for t in pos_to_token.tolist()]
    return torch.stack(rows) if rows else values.new_zeros((0, values.shape[1]))


def _round_trip_check(
    source: torch.Tensor, restored: torch.Tensor, block, bound: float, edge_floor: float | None = None
) -> Check:
    """max over blocks of max |source - restored| / amax(block), in float64, over finite blocks.

    With ``edge_floor`` (an edge case: the format's amax floor), amax is clamped at it, since a
    block below it (zeros, subnormals) is scaled by the floor and quantized relative to it, and
    blocks whose dequantized values overflowed are left out (an fp32 max quantizes to ±Qmax, and
    Qmax·sf can round above fp32's range: docs/numerics.md)."""
    name = "reference round trip"
    if restored.dtype == torch.bfloat16:
        bound += BF16_OUTPUT_SLACK
    policy = f"block rel ≤ {bound:.4g}"
    tokens, hidden = source.shape
    if tokens == 0 or hidden == 0:
        return Check(name, PASS, policy, "empty")
    bm, bk = block
    rows, kblocks = ceil_div(tokens, bm), ceil_div(hidden, bk)
    padding = (0, kblocks * bk - hidden, 0, rows * bm - tokens)
    exact = torch.nn.functional.pad(source.to(torch.float64), padding)
    error = (torch.nn.functional.pad(restored.to(torch.float64), padding) - exact).abs()

    def blocks(t: torch.Tensor) -> torch.Tensor:
        return rearrange(t, "(r i) (k j) -> r k (i j)", i=bm, j=bk)

    amax, worst_error = blocks(exact.abs()).amax(-1), blocks(error).amax(-1)
    finite = torch.isfinite(blocks(exact)).all(-1)
    if edge_floor is not None:
        amax = torch.clamp(amax, min=edge_floor)
        finite &= torch.isfinite(blocks(torch.nn.functional.pad(restored.to(torch.float64), padding))).all(-1)
    relative = torch.where(worst_error == 0, torch.zeros_like(amax), worst_error / amax)
    relative = relative[finite]
    worst = float(relative.max().item()) if relative.numel() else 0.0
    if not worst <= bound:
        return Check(name, FAIL, policy, f"{worst:.4g}", f"a block's relative error {worst:.4g} > {bound:.4g}")
    return Check(name, PASS, policy, f"{worst:.4g}")


SPECS = tuple(BlockCastOp(name) for name in OPS)
for _spec in SPECS:
    register(_spec)
