"""The oracle's self-test: planted bugs ("mutants") that the oracle must flag.

A mutant is one operator's twin with one deliberate bug of the kind kernels really have: a wrong
rounding mode, a missing or wrong clamp, a wrong tie rule, a wrong scale-layout stride, a dropped
eps, a swapped transpose, a zeroed gradient, an unwritten tail. ``tileproof mutate`` checks every
mutant as a backend (``runner.backend_twin``, the path of ``tileproof oracle --backend``) over its
operator's cases of a profile until one case FAILs: the mutant is then *killed*. A mutant that
survives every case names a bug the oracle's cases or policies would let through.

How a mutant is built: ``Mutant.apply(fn)`` wraps a function with the operator's public signature
(the reference twin on the CPU; an optimized kernel with ``--target optimized`` on a GPU) and
plants the bug in the arguments it passes to ``fn`` (eps → 0, comb transposed, the scale tensor
read with the wrong strides) or in the outputs ``fn`` returns (a tail left as 0xFF bytes, a
gradient zeroed, codes stepped toward zero where round-to-nearest-even rounded away). Where the bug
changes arithmetic, the affected elements are recomputed with the reference's *public* helpers
(``scales_from_amax``, ``encode_e4m3``, ...); nothing in ``reference/`` is edited or patched. So the
same catalogue also mutates optimized kernels (the GPU variant, which will add kernel-source
mutants of its own).

Every mutant carries a small ``example`` input on which its bug changes the result: the test suite
proves on the CPU that each mutant is a real bug, also for operators whose oracle spec is not
registered yet (their mutants are listed as skipped by ``tileproof mutate``).

``KNOWN_GAPS`` lists the mutants the current cases cannot kill, with the case that would: they are
reported as "survived (known gap)" and do not fail the self-test; everything else must be killed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import inspect
import json
import time
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from einops import rearrange
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tileproof.reference import quant as reference_quant
from tileproof.reference.contract import CAST_FORMATS, E2M1_GRID, E4M3, ScaleLayout, ceil_div
from tileproof.reference.mhc import apply_mix_forward_math, post_forward_math
from tileproof.reference.quant import (
    decode_e5m6,
    encode_e2m1,
    encode_e4m3,
    scales_from_amax,
    scales_from_layout,
    scales_to_layout,
)

from .policy import ERROR, FAIL
from .registry import all_ops, case_seed, get_op, select_cases
from .report import describe
from .runner import OPTIMIZED, Progress, backend_twin, check_case, environment, execution_target

SCHEMA = "tileproof-mutation/1"
KILLED, SURVIVED, CRASHED, SKIPPED = "killed", "survived", "crashed", "skipped"
_STYLE = {KILLED: "green", SURVIVED: "bold red", CRASHED: "bold magenta", SKIPPED: "dim"}

# The first value past e4m3's largest finite 448 would be 480; a conversion without saturation
# (PTX cvt without .satfinite) rounds |y| >= 464, their midpoint, out of range: NaN in e4m3fn.
E4M3_OVERFLOW = 464.0
# e4m3fnuz's largest finite value: saturating there is the classic wrong-format clamp.
E4M3_FNUZ_MAX = 240.0
# e2m1 ties that round-to-nearest-even sends to the lower magnitude (its code is even):
# 0|0.5, 1|1.5, 2|3 and 4|6. Rounding ties away from zero lifts exactly these.
E2M1_TIES_TO_LOWER = (0.25, 1.25, 2.5, 5.0)
# A tiled kernel that skips the last partial tile along M leaves these rows of M unwritten.
TRANSPOSE_TILE = 64
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    """One planted bug in one operator."""

    op: str  # the operator whose twin it replaces
    name: str  # short, unique per operator: "e4m3-truncation"
    module: str  # the reference module with the public function: "quant", "moe", ...
    bug: str  # the bug, in one sentence
    plant: Callable[[Callable, inspect.BoundArguments], Any]  # (twin, its arguments) -> the mutated result
    example: Callable[[torch.Generator], dict]  # keyword arguments on which the bug shows
    first: tuple[str, ...] = ()  # case-label globs tried first (only the order of the search)

    @property
    def id(self) -> str:
        return f"{self.op}:{self.name}"

    @property
    def family(self) -> str:
        """The family of the registered operator, else the reference module's name."""
        ops = all_ops()
        return ops[self.op].family if self.op in ops else self.module

    def public(self) -> Callable:
        """The reference's public function: its signature is the operator's."""
        return getattr(importlib.import_module(f"tileproof.reference.{self.module}"), self.op)

    def apply(self, fn: Callable) -> Callable:
        """``fn`` (any twin of the operator) with this bug planted."""
        signature = inspect.signature(self.public())

        def mutated(*args, **kwargs):
            return self.plant(fn, signature.bind(*args, **kwargs))

        mutated.__name__ = mutated.__qualname__ = f"{self.op}__{self.name.replace('-', '_')}"
        return mutated


CATALOGUE: list[Mutant] = []

# Mutant id -> why the current cases cannot kill it, and the case that would.
KNOWN_GAPS: dict[str, str] = {}


def mutant(op: str, name: str, module: str, bug: str, example: Callable, first: Sequence[str] = ()):
    """Register the decorated ``plant(fn, bound)`` as a mutant of ``op``."""

    def register(plant: Callable) -> Callable:
        CATALOGUE.append(Mutant(op, name, module, bug, plant, example, tuple(first)))
        return plant

    return register


# ---------------------------------------------------------------------------------------------
# Helpers: arguments, unwritten outputs
# ---------------------------------------------------------------------------------------------


def _arg(bound: inspect.BoundArguments, name: str) -> Any:
    """An argument's value, its default when the call left it out."""
    if name in bound.arguments:
        return bound.arguments[name]
    return bound.signature.parameters[name].default


def _call(fn: Callable, bound: inspect.BoundArguments, **changes) -> Any:
    """``fn`` called with the bound arguments, some of them changed."""
    rebound = bound.signature.bind(**{**bound.arguments, **changes})
    return fn(*rebound.args, **rebound.kwargs)


def _unwritten(like: torch.Tensor) -> torch.Tensor:
    """What an unwritten output holds under ``poison_outputs()``: every byte 0xFF, ``like``'s shape and dtype."""
    if like.dtype == torch.bool:
        return torch.ones_like(like)
    return torch.full(like.shape, -1, dtype=_WORDS[like.element_size()], device=like.device).view(like.dtype)


def _same_strides_copy(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` stored with ``like``'s strides (a column-major scale tensor stays column-major)."""
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device).copy_(values)


# ---------------------------------------------------------------------------------------------
# Quantization: per-token casts (registered: oracle/quant.py)
# ---------------------------------------------------------------------------------------------


def _block_amax(values: torch.Tensor, num_per_channels: int) -> torch.Tensor:
    """fp32 ``[T, H]`` → ``[T, kblocks]`` maxima of ``|x|`` per 1×C block (NaN-propagating)."""
    tokens, hidden = values.shape
    kblocks = ceil_div(hidden, num_per_channels)
    padded = torch.nn.functional.pad(values.abs(), (0, kblocks * num_per_channels - hidden))
    return padded.reshape(tokens, kblocks, num_per_channels).amax(-1)


def _per_element(per_block: torch.Tensor, num_per_channels: int, hidden: int) -> torch.Tensor:
    return per_block.repeat_interleave(num_per_channels, dim=1)[:, :hidden]


@dataclass(frozen=True)
class _CastCall:
    """What a per-token cast call quantizes, and how."""

    values: torch.Tensor  # fp32 [T, H]: x upcast, or a quantized (data, sf) pair dequantized
    fmt: Any  # the QuantFormat (e4m3 or e2m1)
    channels: int  # C
    round_sf: bool
    layout: ScaleLayout


def _cast_call(bound: inspect.BoundArguments) -> _CastCall | None:
    """The per-token cast call's setting; None for a format these mutants do not touch (e5m6)."""
    if bound.arguments["fmt"] not in CAST_FORMATS:
        return None
    x = bound.arguments["x"]
    if isinstance(x, tuple):  # re-quantization: the values are the pair's dequantized ones
        values = reference_quant.dequantize(x, _arg(bound, "x_block_size"))
    else:
        values = x.to(torch.float32)
    packed = _arg(bound, "use_packed_ue8m0")
    layout = ScaleLayout.from_flags(_arg(bound, "use_tma_aligned_col_major_sf"), packed)
    round_sf = bool(_arg(bound, "round_sf") or packed)
    return _CastCall(
        values, CAST_FORMATS[bound.arguments["fmt"]], bound.arguments["num_per_channels"], round_sf, layout
    )


def _scaled(cast: _CastCall) -> torch.Tensor:
    """``y = x · multiplier``, the fp32 values per_token_cast's encoder rounds."""
    _, multiplier = scales_from_amax(_block_amax(cast.values, cast.channels), cast.fmt, cast.round_sf)
    return cast.values * _per_element(multiplier, cast.channels, cast.values.shape[1])


def _e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    as_bytes = packed.view(torch.uint8)
    return rearrange(torch.stack([as_bytes & 0x0F, as_bytes >> 4], dim=-1), "... j two -> ... (j two)")


def _e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    pairs = rearrange(codes, "... (j two) -> ... j two", two=2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def _encode(fmt, y: torch.Tensor) -> torch.Tensor:
    return encode_e4m3(y) if fmt is E4M3 else encode_e2m1(y)


def _example_cast(generator: torch.Generator, fmt: str = "e4m3", **flags) -> dict:
    """11 tokens × 72 channels in blocks of 32 (a partial last block), one row of NaN/±Inf and one
    of values below e4m3's amax floor."""
    x = torch.randn((11, 72), generator=generator) * torch.exp2(torch.randint(-4, 5, (11, 1), generator=generator))
    x[3] *= 1e-6
    x[5, 7], x[5, 40], x[5, 70] = float("nan"), float("inf"), float("-inf")
    return {"x": x.to(torch.bfloat16), "fmt": fmt, "num_per_channels": 32, **flags}


def _example_e2m1(generator: torch.Generator) -> dict:
    return _example_cast(generator, "e2m1", round_sf=True)


def _example_round(generator: torch.Generator) -> dict:
    return _example_cast(generator, "e4m3", round_sf=True)


def _example_colmajor(generator: torch.Generator) -> dict:
    return _example_cast(generator, "e4m3", use_tma_aligned_col_major_sf=True)


@mutant(
    "per_token_cast",
    "e4m3-truncation",
    "quant",
    "the e4m3 encoder truncates toward zero instead of rounding to nearest even",
    _example_cast,
    first=("*/e4m3/*",),
)
def _per_token_e4m3_truncation(fn, bound):
    q, sf = _call(fn, bound)
    cast = _cast_call(bound)
    if cast is None or cast.fmt is not E4M3:
        return q, sf
    y = _scaled(cast)
    as_bytes = q.view(torch.uint8)
    rounded_away = q.to(torch.float32).abs() > y.abs()  # NaN compares false: NaN stays
    toward_zero = (as_bytes & 0x80) | ((as_bytes & 0x7F) - 1)  # the next magnitude code down
    return torch.where(rounded_away, toward_zero, as_bytes).view(torch.float8_e4m3fn), sf


def _e2m1_stepped(q: torch.Tensor, y: torch.Tensor, select: Callable, step: int) -> torch.Tensor:
    """Packed e2m1 ``q`` with the magnitude code moved by ``step`` where ``select(value, |y|)``."""
    codes = _e2m1_codes(q)
    magnitude = codes & 0x07
    value = torch.tensor(E2M1_GRID, dtype=torch.float32, device=q.device)[magnitude.long()]
    moved = (codes & 0x08) | (magnitude.to(torch.int16) + step).to(torch.uint8)
    return _e2m1_pack(torch.where(select(value, y.abs()), moved, codes))


@mutant(
    "per_token_cast",
    "e2m1-truncation",
    "quant",
    "the e2m1 encoder truncates toward zero instead of rounding to nearest even",
    _example_e2m1,
    first=("*/e2m1/*",),
)
def _per_token_e2m1_truncation(fn, bound):
    q, sf = _call(fn, bound)
    cast = _cast_call(bound)
    if cast is None or cast.fmt.name != "e2m1":
        return q, sf
    return _e2m1_stepped(q, _scaled(cast), lambda value, magnitude: value > magnitude, -1), sf


@mutant(
    "per_token_cast",
    "e2m1-ties-away",
    "quant",
    "e2m1 ties round away from zero instead of to the even code (0.25 → 0.5, 1.25 → 1.5, 2.5 → 3, 5 → 6)",
    _example_e2m1,
    first=("*/e2m1/*/bf16/*/round*", "*/e2m1/*/bf16/*/packed*", "*/e2m1/*"),
)
def _per_token_e2m1_ties_away(fn, bound):
    q, sf = _call(fn, bound)
    cast = _cast_call(bound)
    if cast is None or cast.fmt.name != "e2m1":
        return q, sf
    ties = torch.tensor(E2M1_TIES_TO_LOWER, device=q.device)
    return _e2m1_stepped(q, _scaled(cast), lambda value, magnitude: torch.isin(magnitude, ties), 1), sf


@mutant(
    "per_token_cast",
    "e4m3-clamp-240",
    "quant",
    "e4m3 saturates at 240 (e4m3fnuz's maximum) instead of 448",
    _example_cast,
    first=("*/e4m3/*",),
)
def _per_token_e4m3_clamp_240(fn, bound):
    q, sf = _call(fn, bound)
    if q.dtype != torch.float8_e4m3fn:
        return q, sf
    values = q.to(torch.float32)
    clamped = encode_e4m3(torch.copysign(torch.full_like(values, E4M3_FNUZ_MAX), values)).view(torch.uint8)
    return torch.where(values.abs() > E4M3_FNUZ_MAX, clamped, q.view(torch.uint8)).view(q.dtype), sf


@mutant(
    "per_token_cast",
    "amax-floor-dropped",
    "quant",
    "a block's amax is not clamped below at the format's floor (1e-4 for e4m3): tiny blocks get huge multipliers",
    _example_cast,
    first=("*/e4m3/*",),
)
def _per_token_amax_floor_dropped(fn, bound):
    q, sf = _call(fn, bound)
    cast = _cast_call(bound)
    if cast is None or cast.values.shape[0] == 0:
        return q, sf
    amax = _block_amax(cast.values, cast.channels)
    floorless = dataclasses.replace(cast.fmt, amax_floor=0.0)
    scales, multiplier = scales_from_amax(amax, floorless, cast.round_sf)
    below = amax < cast.fmt.amax_floor
    recomputed = _encode(cast.fmt, cast.values * _per_element(multiplier, cast.channels, cast.values.shape[1]))
    return _merge_blocks(q, recomputed, below, cast), _merge_scales(sf, scales, below, cast.layout)


def _merge_blocks(q, recomputed, blocks, cast: _CastCall) -> torch.Tensor:
    """``q`` with the elements of the selected blocks taken from ``recomputed`` (bytes)."""
    elements = _per_element(blocks, cast.channels, cast.values.shape[1])
    if cast.fmt.values_per_byte == 2:
        elements = elements[:, ::2]  # C is even: both values of a byte share the block
    return torch.where(elements, recomputed.view(torch.uint8), q.view(torch.uint8)).view(q.dtype)


def _merge_scales(sf, scales, blocks, layout) -> torch.Tensor:
    """The stored scale tensor with the selected blocks' scales replaced."""
    current = scales_from_layout(sf, scales.shape[1])
    return scales_to_layout(torch.where(blocks, scales, current), layout)


def _round_down_to_power_of_two(scales: torch.Tensor) -> torch.Tensor:
    bits = scales.view(torch.int32).to(torch.int64) & 0xFF800000  # the mantissa cleared
    return torch.where(torch.isnan(scales), scales, bits.to(torch.int32).view(torch.float32))


@mutant(
    "per_token_cast",
    "sf-rounded-down",
    "quant",
    "with round_sf the scale is rounded down to a power of two (mantissa cleared) instead of up, so the block's "
    "amax overflows the format and saturates",
    _example_round,
    first=("*/round", "*/packed", "*/round+colmajor"),
)
def _per_token_sf_rounded_down(fn, bound):
    q, sf = _call(fn, bound)
    cast = _cast_call(bound)
    if cast is None or not cast.round_sf or cast.values.shape[0] == 0:
        return q, sf
    exact, _ = scales_from_amax(_block_amax(cast.values, cast.channels), cast.fmt, False)
    lowered = _round_down_to_power_of_two(exact)
    changed = (lowered != scales_from_layout(sf, exact.shape[1])) & ~torch.isnan(exact)
    multiplier = torch.ones_like(lowered) / lowered
    recomputed = _encode(cast.fmt, cast.values * _per_element(multiplier, cast.channels, cast.values.shape[1]))
    return _merge_blocks(q, recomputed, changed, cast), _merge_scales(sf, lowered, changed, cast.layout)


@mutant(
    "per_token_cast",
    "sf-col-major-unaligned",
    "quant",
    "column-major scales are stored with leading dimension T instead of align(T, 4)",
    _example_colmajor,
    first=("*/colmajor", "*/round+colmajor", "*/packed"),
)
def _per_token_sf_col_major_unaligned(fn, bound):
    q, sf = _call(fn, bound)
    if sf.dim() == 2 and sf.shape[0] > 1 and sf.stride(0) == 1:
        return q, sf.T.contiguous().T  # same values, strides (1, T)
    return q, sf


@mutant(
    "per_token_cast",
    "tail-block-unwritten",
    "quant",
    "the last, partial 1×C block of every row is never written (data and scale keep the 0xFF poison)",
    _example_cast,
)
def _per_token_tail_block_unwritten(fn, bound):
    q, sf = _call(fn, bound)
    cast = _cast_call(bound)
    if cast is None:
        return q, sf
    (tokens, hidden), channels = cast.values.shape, cast.channels
    if hidden % channels == 0 or tokens == 0:
        return q, sf
    kblocks = ceil_div(hidden, channels)
    first_byte = (kblocks - 1) * channels // cast.fmt.values_per_byte
    q[:, first_byte:] = _unwritten(q[:, first_byte:])
    column = (kblocks - 1) // 4 if sf.dtype == torch.int32 else kblocks - 1
    sf[:, column] = _unwritten(sf[:, column])
    return q, sf


@mutant(
    "per_token_cast",
    "nan-scale-finite",
    "quant",
    "a block holding NaN gets a finite scale (the amax floor's, or 1.0 when packed) instead of NaN",
    _example_cast,
    first=("*/naninf",),
)
def _per_token_nan_scale_finite(fn, bound):
    q, sf = _call(fn, bound)
    cast = _cast_call(bound)
    if cast is None:
        return q, sf
    scales = scales_from_layout(sf, ceil_div(cast.values.shape[1], cast.channels))
    nan = torch.isnan(scales)
    if not bool(nan.any()):
        return q, sf
    finite = 1.0 if cast.layout.kind == "packed_ue8m0" else cast.fmt.amax_floor / cast.fmt.qmax
    return q, scales_to_layout(torch.where(nan, torch.full_like(scales, finite), scales), cast.layout)


@mutant(
    "per_token_cast_with_sf_only",
    "sf-from-reciprocal",
    "quant",
    "the scale is 1 / (qmax / amax) instead of amax / qmax (differs in the last bit for some blocks)",
    _example_cast,
    first=("*/plain", "*/colmajor"),
)
def _sf_only_from_reciprocal(fn, bound):
    sf = _call(fn, bound)
    cast = _cast_call(bound)
    if cast is None or cast.round_sf:
        return sf
    _, multiplier = scales_from_amax(_block_amax(cast.values, cast.channels), cast.fmt, False)
    return scales_to_layout(torch.ones_like(multiplier) / multiplier, cast.layout)


def _example_precomputed(generator: torch.Generator, **flags) -> dict:
    """Given scales a quarter of the data's own: y reaches 4 × 448."""
    arguments = _example_cast(generator, "e4m3", **flags)
    own = importlib.import_module("tileproof.reference.quant").per_token_cast_with_sf_only(**arguments)
    return {**arguments, "sf": own / 4}


def _example_precomputed_colmajor(generator: torch.Generator) -> dict:
    arguments = _example_cast(generator, "e4m3", use_tma_aligned_col_major_sf=True)
    arguments["sf"] = importlib.import_module("tileproof.reference.quant").per_token_cast_with_sf_only(**arguments)
    return arguments


@mutant(
    "per_token_cast_with_precomputed_sf",
    "e4m3-unsaturated",
    "quant",
    "e4m3 is not saturated at 448: |x / sf| >= 464 becomes NaN (a conversion without satfinite)",
    _example_precomputed,
    first=("*/e4m3/*",),
)
def _precomputed_e4m3_unsaturated(fn, bound):
    q = _call(fn, bound)
    cast = _cast_call(bound)
    if cast is None or cast.fmt is not E4M3:
        return q
    scales = scales_from_layout(bound.arguments["sf"], ceil_div(cast.values.shape[1], cast.channels))
    y = cast.values * _per_element(torch.ones_like(scales) / scales, cast.channels, cast.values.shape[1])
    overflow = y.abs() >= E4M3_OVERFLOW
    return torch.where(overflow, torch.full_like(q.view(torch.uint8), 0x7F), q.view(torch.uint8)).view(q.dtype)


@mutant(
    "per_token_cast_with_precomputed_sf",
    "sf-read-row-major",
    "quant",
    "a column-major (or packed) scale tensor is read with row-major strides",
    _example_precomputed_colmajor,
    first=("*/colmajor", "*/round+colmajor", "*/packed"),
)
def _precomputed_sf_read_row_major(fn, bound):
    sf = bound.arguments["sf"]
    rows, columns = sf.shape
    if rows < 2 or columns < 2 or sf.stride(0) != 1:
        return _call(fn, bound)
    misread = torch.as_strided(sf, sf.shape, (columns, 1))  # within the column-major buffer
    return _call(fn, bound, sf=_same_strides_copy(misread, sf))


def _example_cast_back(generator: torch.Generator, **flags) -> dict:
    arguments = _example_cast(generator, "e4m3", **flags)
    pair = importlib.import_module("tileproof.reference.quant").per_token_cast(**arguments)
    return {"x": pair, "fmt": "bf16", "num_per_channels": 32}


def _example_cast_back_packed(generator: torch.Generator) -> dict:
    arguments = _example_cast(generator, "e4m3", use_packed_ue8m0=True)
    arguments["x"] = arguments["x"][:, :64].contiguous()  # only whole blocks: 2 per packed word
    arguments["x"][:, 32:] *= 64  # two exponent bytes that differ
    pair = importlib.import_module("tileproof.reference.quant").per_token_cast(**arguments)
    return {"x": pair, "fmt": "fp32", "num_per_channels": 32}


@mutant(
    "per_token_cast_back",
    "last-row-unwritten",
    "quant",
    "the last token row of the output is never written (an off-by-one over tokens)",
    _example_cast_back,
)
def _cast_back_last_row_unwritten(fn, bound):
    out = _call(fn, bound)
    if out.shape[0]:
        out[-1] = _unwritten(out[-1])
    return out


@mutant(
    "per_token_cast_back",
    "packed-bytes-big-endian",
    "quant",
    "the four exponent bytes of a packed UE8M0 word are read big-endian",
    _example_cast_back_packed,
    first=("*/packed",),
)
def _cast_back_packed_big_endian(fn, bound):
    data, sf = bound.arguments["x"]
    if sf.dtype != torch.int32 or sf.numel() == 0:
        return _call(fn, bound)
    words = sf.to(torch.int64) & 0xFFFFFFFF
    swapped = sum(((words >> (8 * b)) & 0xFF) << (8 * (3 - b)) for b in range(4))
    return _call(fn, bound, x=(data, _same_strides_copy(swapped.to(torch.uint32).view(torch.int32), sf)))


# ---------------------------------------------------------------------------------------------
# Quantization: E5M6, per-block and per-channel casts
# ---------------------------------------------------------------------------------------------


def _example_e5m6(generator: torch.Generator) -> dict:
    return {"x": torch.randn(257, generator=generator) * 300}


@mutant(
    "encode_e5m6",
    "truncation",
    "quant",
    "the e5m6 encoder truncates toward zero instead of rounding to nearest even",
    _example_e5m6,
)
def _e5m6_truncation(fn, bound):
    codes = _call(fn, bound)
    rounded_away = decode_e5m6(codes).abs() > bound.arguments["x"].to(torch.float32).abs()
    wide = codes.to(torch.int32)
    toward_zero = (wide & 0x800) | ((wide & 0x7FF) - 1)
    return torch.where(rounded_away, toward_zero, wide).to(torch.uint16)


def _example_block(generator: torch.Generator) -> dict:
    x = torch.randn((40, 72), generator=generator).to(torch.bfloat16)
    return {"x": x, "fmt": "e4m3", "block_size": (32, 32)}


@mutant(
    "per_block_cast",
    "tail-rows-unwritten",
    "quant_blocks",
    "the rows of the last, partial block of rows are never written (data and scales keep the 0xFF poison)",
    _example_block,
)
def _per_block_tail_rows_unwritten(fn, bound):
    q, sf = _call(fn, bound)
    tokens, block_rows = bound.arguments["x"].shape[0], bound.arguments["block_size"][0]
    if tokens % block_rows:
        start = tokens - tokens % block_rows
        q[start:] = _unwritten(q[start:])
        sf[-1] = _unwritten(sf[-1])
    return q, sf


def _example_block_precomputed(generator: torch.Generator) -> dict:
    arguments = _example_block(generator)
    own = importlib.import_module("tileproof.reference.quant_blocks").per_block_cast_with_sf_only(**arguments)
    return {**arguments, "sf": own / 4}


@mutant(
    "per_block_cast_with_precomputed_sf",
    "e4m3-unsaturated",
    "quant_blocks",
    "e4m3 is not saturated at 448: |x / sf| >= 464 becomes NaN (a conversion without satfinite)",
    _example_block_precomputed,
    first=("*/e4m3/*/sf2^-2",),  # the cases whose given scales are a quarter of what the data needs
)
def _per_block_e4m3_unsaturated(fn, bound):
    q = _call(fn, bound)
    if bound.arguments["fmt"] != "e4m3":
        return q
    x = bound.arguments["x"]
    if isinstance(x, tuple):  # re-quantization: the values are the pair's dequantized ones
        values = reference_quant.dequantize(x, _arg(bound, "x_block_size"))
    else:
        values = x.to(torch.float32)
    block_rows, block_columns = bound.arguments["block_size"]
    tokens, hidden = values.shape
    scales = scales_from_layout(bound.arguments["sf"], ceil_div(hidden, block_columns))
    multiplier = (torch.ones_like(scales) / scales).repeat_interleave(block_rows, dim=0)[:tokens]
    overflow = (values * _per_element(multiplier, block_columns, hidden)).abs() >= E4M3_OVERFLOW
    return torch.where(overflow, torch.full_like(q.view(torch.uint8), 0x7F), q.view(torch.uint8)).view(q.dtype)


def _example_channel(generator: torch.Generator) -> dict:
    return {"x": torch.randn((40, 24), generator=generator).to(torch.bfloat16), "fmt": "e4m3", "num_per_tokens": 32}


@mutant(
    "per_channel_cast",
    "tail-tokens-unwritten",
    "quant_blocks",
    "the tokens of the last, partial block of num_per_tokens are never written (data and scales keep the poison)",
    _example_channel,
)
def _per_channel_tail_unwritten(fn, bound):
    q, sf = _call(fn, bound)
    tokens, block = bound.arguments["x"].shape[0], _arg(bound, "num_per_tokens")
    if tokens % block:
        start = tokens - tokens % block
        q[start:] = _unwritten(q[start:])
        sf[-1] = _unwritten(sf[-1])
    return q, sf


# ---------------------------------------------------------------------------------------------
# MoE gating and routing
# ---------------------------------------------------------------------------------------------


def _example_tied_scores(generator: torch.Generator) -> dict:
    return {"scores": torch.randint(0, 3, (6, 8), generator=generator).to(torch.float32), "num_topk": 4}


@mutant(
    "topk_gate",
    "ties-to-larger-index",
    "moe",
    "among equal scores the larger expert index ranks first (the contract: the smaller one)",
    _example_tied_scores,
)
def _topk_ties_to_larger_index(fn, bound):
    scores = bound.arguments["scores"]
    flipped = _call(fn, bound, scores=scores.flip(-1).contiguous())
    return (scores.shape[-1] - 1) - flipped


def _example_group_scores(generator: torch.Generator) -> dict:
    return {"scores": torch.randn((5, 8, 4), generator=generator), "num_topk_sum": 2, "num_topk_groups": 3}


@mutant(
    "topk_sum_and_topk_group_idx",
    "top1-instead-of-top2",
    "moe",
    "groups are ranked by their best score alone when the sum of the best two is asked for",
    _example_group_scores,
)
def _group_top1_instead_of_top2(fn, bound):
    if bound.arguments["num_topk_sum"] == 2:
        return _call(fn, bound, num_topk_sum=1)
    return _call(fn, bound)


def _example_router(generator: torch.Generator) -> dict:
    return {
        "logits": torch.randn((6, 16), generator=generator),
        "bias": torch.randn(16, generator=generator) * 0.1,
        "num_topk": 4,
        "num_topk_groups": 2,
        "num_groups": 4,
        "use_shared_as_routed": False,
        "num_shared_experts": 0,
        "routed_scaling_factor": 2.5,
        "ep_rank": 0,
        "num_ep_ranks": 1,
        "tp_rank": 0,
        "num_tp_ranks": 1,
        "scoring_func": "sigmoid",
    }


@mutant(
    "top2_sum_gate",
    "scaling-factor-ignored",
    "moe",
    "the routed weights are not multiplied by routed_scaling_factor",
    _example_router,
)
def _router_scaling_ignored(fn, bound):
    return _call(fn, bound, routed_scaling_factor=1.0)


def _example_weights(generator: torch.Generator) -> dict:
    weights = torch.rand((5, 4), generator=generator)
    weights[2] = 0.0  # a token whose weights are all zero: only the eps keeps its denominator positive
    return {"topk_weights": weights}


@mutant(
    "normalize_weight",
    "eps-dropped",
    "moe",
    "the denominator misses its 1e-20 start value (an all-zero row divides 0 by 0)",
    _example_weights,
)
def _normalize_eps_dropped(fn, bound):
    den, _ = _call(fn, bound)
    without_eps = den - torch.tensor(1e-20, dtype=den.dtype, device=den.device)
    return without_eps, bound.arguments["topk_weights"] / rearrange(without_eps, "t -> t 1")


def _example_group_idx(generator: torch.Generator) -> dict:
    return {"group_idx": torch.randint(-1, 4, (6, 3), generator=generator), "num_groups": 4}


@mutant(
    "group_count",
    "padding-counted",
    "moe",
    "a negative (padding) index is not skipped but wraps around to group G - 1",
    _example_group_idx,
)
def _group_count_padding_counted(fn, bound):
    counts = _call(fn, bound)
    indices, groups = bound.arguments["group_idx"], bound.arguments["num_groups"]
    wrapped = indices[(indices < 0) & (indices >= -groups)].to(torch.int64) % groups
    return counts + torch.bincount(wrapped, minlength=groups).to(counts.dtype)


def _example_unique(generator: torch.Generator) -> dict:
    return {"group_indices": torch.randint(-1, 3, (6, 5), generator=generator), "num_groups": 3}


@mutant(
    "inplace_unique_group_indices",
    "keeps-last",
    "moe",
    "the last occurrence of a repeated group is kept instead of the first",
    _example_unique,
)
def _unique_keeps_last(fn, bound):
    flipped = bound.arguments["group_indices"].flip(-1).contiguous()
    return _call(fn, bound, group_indices=flipped).flip(-1).contiguous()


def _example_mapping(generator: torch.Generator) -> dict:
    topk = torch.randint(-1, 5, (7, 2), generator=generator)
    return {"topk_idx": topk, "num_experts": 5, "num_expanded_tokens": 0, "alignment": 4}


@mutant(
    "get_fused_mapping",
    "padding-token-zero",
    "moe",
    "padding slots of pos_to_token hold 0 (a zero-initialised buffer) instead of -1",
    _example_mapping,
)
def _mapping_padding_zero(fn, bound):
    result = list(_call(fn, bound))
    result[1] = torch.where(result[1] < 0, torch.zeros_like(result[1]), result[1])
    return tuple(result)


def _example_expand(generator: torch.Generator) -> dict:
    topk = torch.randint(-1, 4, (6, 2), generator=generator)
    mapping = importlib.import_module("tileproof.reference.moe").get_fused_mapping(topk, 4, 0, 4)
    return {
        "x": torch.randn((6, 8), generator=generator).to(torch.bfloat16),
        "token_topk_to_pos": mapping[3],
        "pos_to_expert": mapping[0],
    }


@mutant(
    "expand_to_fused",
    "padding-rows-unwritten",
    "moe",
    "padding rows of the expanded buffer are never written (they should be zero)",
    _example_expand,
)
def _expand_padding_unwritten(fn, bound):
    out = _call(fn, bound)
    positions = bound.arguments["token_topk_to_pos"]
    covered = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    covered[positions[positions >= 0].to(torch.int64)] = True
    out[~covered] = _unwritten(out[~covered])
    return out


def _example_reduce(generator: torch.Generator) -> dict:
    arguments = _example_expand(generator)
    expanded = importlib.import_module("tileproof.reference.moe").expand_to_fused(**arguments)
    weights = torch.rand(arguments["token_topk_to_pos"].shape, generator=generator)
    return {"x": expanded, "topk_weights": weights, "token_topk_to_pos": arguments["token_topk_to_pos"]}


@mutant(
    "reduce_fused",
    "last-slot-dropped",
    "moe",
    "the last top-k slot of every token is left out of the sum (an off-by-one over k)",
    _example_reduce,
)
def _reduce_last_slot_dropped(fn, bound):
    positions = bound.arguments["token_topk_to_pos"]
    if positions.shape[1] == 0:
        return _call(fn, bound)
    dropped = positions.clone()
    dropped[:, -1] = -1
    return _call(fn, bound, token_topk_to_pos=dropped)


# ---------------------------------------------------------------------------------------------
# Transpose
# ---------------------------------------------------------------------------------------------


def _example_strided_matrix(generator: torch.Generator) -> dict:
    wide = torch.randn((9, 13), generator=generator).to(torch.bfloat16)
    return {"x": wide[:, :7]}


@mutant(
    "transpose",
    "row-stride-ignored",
    "transpose",
    "the input is read as if contiguous (row stride N) when its row stride is larger",
    _example_strided_matrix,
)
def _transpose_row_stride_ignored(fn, bound):
    x = bound.arguments["x"]
    rows, columns = x.shape
    if rows > 1 and columns > 0 and x.stride(0) != columns:
        x = torch.as_strided(x, x.shape, (columns, 1))  # within the strided buffer
    return _call(fn, bound, x=x)


def _example_batch(generator: torch.Generator) -> dict:
    return {"x": torch.randn((2, TRANSPOSE_TILE + 6, 5), generator=generator)}


@mutant(
    "batched_transpose",
    "tail-tile-unwritten",
    "transpose",
    f"the last, partial tile of {TRANSPOSE_TILE} rows of each matrix is never written",
    _example_batch,
)
def _batched_transpose_tail_unwritten(fn, bound):
    out = _call(fn, bound)
    rows = bound.arguments["x"].shape[1]
    if rows % TRANSPOSE_TILE:
        start = rows - rows % TRANSPOSE_TILE
        out[..., start:] = _unwritten(out[..., start:])
    return out


# ---------------------------------------------------------------------------------------------
# Engram
# ---------------------------------------------------------------------------------------------


def _example_hash(generator: torch.Generator) -> dict:
    layers, ngram, tables = 2, 3, 2
    vocab = torch.tensor([[[11, 13], [17, 19]], [[23, 29], [31, 37]]], dtype=torch.int32)
    flat = vocab.reshape(layers, -1).to(torch.int64)
    return {
        "ngram_token_ids": torch.randint(0, 1000, (6, ngram), generator=generator, dtype=torch.int32),
        "multipliers": torch.randint(1, 2**40, (layers, ngram), generator=generator) * 2 + 1,
        "vocab_sizes": vocab,
        "offsets": (torch.cumsum(flat, dim=1) - flat).to(torch.int32).reshape(layers, (ngram - 1) * tables),
    }


@mutant(
    "engram_hash",
    "offsets-missing",
    "engram",
    "the table offsets are not added: every table indexes the layer's first rows",
    _example_hash,
)
def _hash_offsets_missing(fn, bound):
    return _call(fn, bound, offsets=torch.zeros_like(bound.arguments["offsets"]))


def _example_gains(generator: torch.Generator) -> dict:
    gains = [(1 + 0.3 * torch.randn((4, 16), generator=generator)).to(torch.bfloat16) for _ in range(2)]
    return {"wh": gains[0], "we": gains[1]}


@mutant(
    "fused_weight",
    "product-rounded-to-bf16",
    "engram",
    "wh·we is rounded to bf16 before it is stored as fp32 (the product of two bf16 values needs 16 bits)",
    _example_gains,
)
def _fused_weight_bf16(fn, bound):
    return _call(fn, bound).to(torch.bfloat16).to(torch.float32)


def _example_gate(generator: torch.Generator) -> dict:
    tokens, streams, hidden = 3, 4, 16
    x = torch.randn((tokens, streams, hidden), generator=generator)
    x[1, 2] = 0.0  # an all-zero stream: only the eps keeps its rstd finite
    return {
        "x": x.to(torch.bfloat16),
        "k": torch.randn((tokens, streams, hidden), generator=generator).to(torch.bfloat16),
        "v": torch.randn((tokens, hidden), generator=generator).to(torch.bfloat16),
        "w": 1 + 0.1 * torch.randn((streams, hidden), generator=generator),
        "eps": 1e-6,
        "clamp_value": 1e-6,
    }


@mutant(
    "engram_gate_fwd",
    "eps-dropped",
    "engram",
    "the RMS eps is dropped (rsqrt(mean(x²)) alone): an all-zero stream gives inf and NaN",
    _example_gate,
)
def _gate_eps_dropped(fn, bound):
    return _call(fn, bound, eps=0.0)


def _example_gate_bwd(generator: torch.Generator) -> dict:
    arguments = _example_gate(generator)
    _, dot, gate, rstd_x, rstd_k = importlib.import_module("tileproof.reference.engram").engram_gate_fwd(**arguments)
    return {
        "grad_out": torch.randn(arguments["x"].shape, generator=generator).to(torch.bfloat16),
        **{name: arguments[name] for name in ("x", "k", "v", "w")},
        "dot": dot,
        "gate": gate,
        "rstd_x": rstd_x,
        "rstd_k": rstd_k,
        "clamp_value": arguments["clamp_value"],
    }


@mutant(
    "engram_gate_bwd",
    "dk-zeroed",
    "engram",
    "the gradient of the keys k is zero",
    _example_gate_bwd,
)
def _gate_bwd_dk_zeroed(fn, bound):
    dx, dk, dv, dw_partial = _call(fn, bound)
    return dx, torch.zeros_like(dk), dv, dw_partial


def _example_grad_w(generator: torch.Generator) -> dict:
    gains = _example_gains(generator)
    return {
        "dw_partial": torch.randn((3, 4, 16), generator=generator),
        **gains,
        "grad_wh": torch.randn((4, 16), generator=generator),
        "grad_we": torch.randn((4, 16), generator=generator),
    }


@mutant(
    "grad_w_reduce",
    "overwrites-grad-we",
    "engram",
    "grad_we is overwritten with the new gradient instead of accumulated into",
    _example_grad_w,
)
def _grad_w_overwrites(fn, bound):
    return _call(fn, bound, grad_we=torch.zeros_like(bound.arguments["grad_we"]))


# ---------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------


def _example_comb_logits(generator: torch.Generator) -> dict:
    logits = torch.randn((3, 4, 4), generator=generator)
    logits[0] = torch.tensor([0.0, -200.0, -200.0, -200.0])  # the softmax underflows: only eps fills columns 1..3
    return {"comb_res_mix": logits, "repeat": 3, "eps": 1e-6}


@mutant(
    "sinkhorn_normalize",
    "eps-dropped",
    "mhc",
    "Sinkhorn's eps is dropped (after the softmax and in every sum)",
    _example_comb_logits,
)
def _sinkhorn_eps_dropped(fn, bound):
    return _call(fn, bound, eps=0.0)


@mutant(
    "sinkhorn_normalize",
    "axes-swapped",
    "mhc",
    "the softmax and the normalisations run over the other axis (comb read transposed)",
    _example_comb_logits,
)
def _sinkhorn_axes_swapped(fn, bound):
    logits = bound.arguments["comb_res_mix"].transpose(-1, -2).contiguous()
    return _call(fn, bound, comb_res_mix=logits).transpose(-1, -2).contiguous()


def _example_post(generator: torch.Generator) -> dict:
    tokens, streams, hidden = 3, 4, 8
    return {
        "x": torch.randn((tokens, hidden), generator=generator).to(torch.bfloat16),
        "residual": torch.randn((tokens, streams, hidden), generator=generator).to(torch.bfloat16),
        "post_layer_mix": torch.rand((tokens, streams), generator=generator) * 2,
        "comb_res_mix": torch.rand((tokens, streams, streams), generator=generator),
    }


@mutant(
    "mhc_post",
    "comb-not-transposed",
    "mhc",
    "the residual is mixed with comb[o, i] instead of comb[i, o] (the transpose is missed)",
    _example_post,
)
def _post_comb_not_transposed(fn, bound):
    comb = bound.arguments["comb_res_mix"].transpose(-1, -2).contiguous()
    return _call(fn, bound, comb_res_mix=comb)


def _example_post_bwd(generator: torch.Generator) -> dict:
    arguments = _example_post(generator)
    grad = torch.randn(arguments["residual"].shape, generator=generator).to(torch.bfloat16)
    return {"grad_output": grad, **arguments}


@mutant(
    "mhc_post_bwd",
    "dpost-zeroed",
    "mhc",
    "the gradient of the post weights is zero",
    _example_post_bwd,
)
def _post_bwd_dpost_zeroed(fn, bound):
    d_x, d_residual, d_post, d_comb = _call(fn, bound)
    return d_x, d_residual, torch.zeros_like(d_post), d_comb


def _example_norm_fn(generator: torch.Generator) -> dict:
    tokens, streams, hidden = 3, 4, 8
    residual = torch.randn((tokens, streams, hidden), generator=generator)
    residual[1] = 0.0  # an all-zero token: only the eps keeps its rstd finite
    return {
        "residual": residual.to(torch.bfloat16),
        "mhc_fn": torch.randn((streams * streams + 2 * streams, streams * hidden), generator=generator),
        "mhc_norm_weight": None,
        "mhc_norm_eps": 1e-6,
    }


@mutant(
    "mhc_pre_norm_fn",
    "eps-dropped",
    "mhc",
    "the RMS eps is dropped: an all-zero token gives 0 · inf = NaN mixes",
    _example_norm_fn,
)
def _norm_fn_eps_dropped(fn, bound):
    return _call(fn, bound, mhc_norm_eps=0.0)


def _example_split(generator: torch.Generator) -> dict:
    streams = 4
    width = streams * streams + 2 * streams
    return {
        "input_mixes": torch.randn((3, width), generator=generator),
        "mhc_scale": torch.rand(3, generator=generator) + 0.5,
        "mhc_base": torch.randn(width, generator=generator),
        "mhc_mult": streams,
        "mhc_post_mult_value": 2.0,
        "mhc_pre_eps": 1e-6,
    }


@mutant(
    "mhc_pre_split_mixes",
    "comb-transposed",
    "mhc",
    "the comb block of the mixes is read column-major ([o, i] instead of [i, o])",
    _example_split,
)
def _split_comb_transposed(fn, bound):
    pre, post, comb = _call(fn, bound)
    return pre, post, comb.transpose(-1, -2).contiguous()


def _example_apply_mix_bwd(generator: torch.Generator) -> dict:
    tokens, streams, hidden = 3, 4, 8
    return {
        "grad_output": torch.randn((tokens, hidden), generator=generator).to(torch.bfloat16),
        "x": torch.randn((tokens, streams, hidden), generator=generator).to(torch.bfloat16),
        "mix": torch.rand((tokens, streams), generator=generator),
    }


@mutant(
    "mhc_pre_apply_mix_bwd",
    "dmix-zeroed",
    "mhc",
    "the gradient of the pre weights is zero",
    _example_apply_mix_bwd,
)
def _apply_mix_bwd_dmix_zeroed(fn, bound):
    d_residual, d_mix = _call(fn, bound)
    return d_residual, torch.zeros_like(d_mix)


def _example_expand_bwd(generator: torch.Generator) -> dict:
    return {"grad_output": torch.randn((3, 4, 8), generator=generator).to(torch.bfloat16)}


@mutant(
    "expand_to_mhc_bwd",
    "last-stream-dropped",
    "mhc",
    "the sum over streams leaves out the last stream (an off-by-one over n)",
    _example_expand_bwd,
)
def _expand_bwd_last_stream_dropped(fn, bound):
    grad = bound.arguments["grad_output"].clone()
    grad[:, -1] = 0
    return _call(fn, bound, grad_output=grad)


def _example_head(generator: torch.Generator) -> dict:
    return {
        "input_mix": torch.randn((3, 4), generator=generator),
        "mhc_scale": torch.tensor([0.3]),
        "mhc_base": torch.randn(4, generator=generator),
        "mhc_pre_eps": 1e-6,
    }


@mutant(
    "mhc_head_compute_mix",
    "scale-ignored",
    "mhc",
    "the mixes enter the sigmoid without their scale",
    _example_head,
)
def _head_scale_ignored(fn, bound):
    return _call(fn, bound, mhc_scale=torch.ones_like(bound.arguments["mhc_scale"]))


def _example_big_fuse(generator: torch.Generator) -> dict:
    tokens, streams, hidden = 3, 4, 8
    mixes, width = streams * streams + 2 * streams, streams * hidden
    residual = torch.randn((tokens, streams, hidden), generator=generator)
    residual[1] = 0.0  # an all-zero token: only the RMS eps keeps its rstd finite
    return {
        "residual": residual.to(torch.bfloat16),
        "fn": torch.randn((mixes, width), generator=generator) * 0.2,
        "mhc_scale": torch.full((3,), 0.5),
        "mhc_base": torch.randn(mixes, generator=generator),
        "rms_eps": 1e-6,
        "mhc_pre_eps": 1e-6,
        "mhc_sinkhorn_eps": 1e-6,
        "mhc_post_mult_value": 2.0,
        "sinkhorn_repeat": 20,
        "mhc_norm_weight": torch.rand(width, generator=generator) + 0.5,
    }


@mutant(
    "mhc_pre_big_fuse",
    "norm-weight-dropped",
    "mhc",
    "the norm weight γ is not folded into fn (as TileKernels' no-grad mhc_pre calls its fused kernel)",
    _example_big_fuse,
    first=("*/gamma/*",),
)
def _big_fuse_norm_weight_dropped(fn, bound):
    return _call(fn, bound, mhc_norm_weight=None)


@mutant(
    "mhc_pre_big_fuse",
    "rms-eps-dropped",
    "mhc",
    "the RMS eps is dropped: an all-zero token gives 0 · inf = NaN mixes, and NaN coefficients",
    _example_big_fuse,
)
def _big_fuse_rms_eps_dropped(fn, bound):
    return _call(fn, bound, rms_eps=0.0)


def _example_recompute(generator: torch.Generator) -> dict:
    tokens, streams, hidden, layers = 3, 4, 8, 3

    def several(make: Callable) -> list:
        return [make() for _ in range(layers)]

    return {
        "initial_residual": torch.randn((tokens, streams, hidden), generator=generator).to(torch.bfloat16),
        "pre_mix_list": several(lambda: torch.rand((tokens, streams), generator=generator)),
        "layer_output_list": several(lambda: torch.randn((tokens, hidden), generator=generator).to(torch.bfloat16)),
        "post_mix_list": several(lambda: 2 * torch.rand((tokens, streams), generator=generator)),
        # columns (over the source i) sum to 1, as after Sinkhorn
        "comb_mix_list": several(
            lambda: torch.softmax(torch.randn((tokens, streams, streams), generator=generator), 1)
        ),
        "layer_input_list": several(lambda: torch.zeros((tokens, hidden), dtype=torch.bfloat16)),
        "residual_list": several(lambda: torch.zeros((tokens, streams, hidden), dtype=torch.bfloat16)),
    }


@mutant(
    "mhc_multilayer_recompute",
    "residual-kept-in-fp32",
    "mhc",
    "the residual X_{l+1} feeds layer l + 1 as its fp32 value, not rounded to bf16 as the unfused path stores it",
    _example_recompute,
)
def _recompute_residual_kept_in_fp32(fn, bound):
    _call(fn, bound)  # layer 0 is right; the later layers are recomputed from unrounded streams
    pres, ys = bound.arguments["pre_mix_list"], bound.arguments["layer_output_list"]
    posts, combs = bound.arguments["post_mix_list"], bound.arguments["comb_mix_list"]
    layer_inputs, residuals = bound.arguments["layer_input_list"], bound.arguments["residual_list"]
    streams = bound.arguments["initial_residual"].to(torch.float32)
    for layer, pre in enumerate(pres):
        layer_inputs[layer].copy_(apply_mix_forward_math(streams, pre).to(torch.bfloat16))
        if layer < len(ys):
            streams = post_forward_math(ys[layer].to(torch.float32), streams, posts[layer], combs[layer])
            residuals[layer].copy_(streams.to(torch.bfloat16))


@mutant(
    "mhc_multilayer_recompute",
    "last-post-skipped",
    "mhc",
    "the last layer's post is not replayed (an off-by-one over P): its residual buffer is never written",
    _example_recompute,
    first=("*/L4/P4*", "*/L2/P2*"),
)
def _recompute_last_post_skipped(fn, bound):
    residuals = bound.arguments["residual_list"]
    kept = residuals[-1].clone() if residuals else None
    _call(fn, bound)
    if kept is not None:
        residuals[-1].copy_(kept)


# ---------------------------------------------------------------------------------------------
# Running the self-test
# ---------------------------------------------------------------------------------------------


@dataclass
class MutantResult:
    mutant: Mutant
    family: str
    status: str  # KILLED | SURVIVED | CRASHED | SKIPPED
    cases_run: int = 0
    killer: str = ""  # the label of the case that killed it
    evidence: str = ""  # its first failing check, or the error, or why it was skipped
    seconds: float = 0.0

    @property
    def known_gap(self) -> str:
        return KNOWN_GAPS.get(self.mutant.id, "") if self.status != KILLED else ""


@dataclass
class MutationResult:
    environment: dict
    profile: str
    seed: int
    target: str  # "reference" | "optimized": the twin the bugs were planted in
    results: list[MutantResult] = field(default_factory=list)

    def families(self) -> dict[str, dict[str, int]]:
        """Per family: killed, run (not skipped), skipped, known gaps."""
        figures: dict[str, dict[str, int]] = defaultdict(lambda: {"killed": 0, "run": 0, "skipped": 0, "known_gaps": 0})
        for result in self.results:
            family = figures[result.family]
            if result.status == SKIPPED:
                family["skipped"] += 1
                continue
            family["run"] += 1
            family["killed"] += result.status == KILLED
            family["known_gaps"] += bool(result.known_gap)
        return dict(figures)

    @property
    def exit_status(self) -> int:
        missed = [r for r in self.results if r.status in (SURVIVED, CRASHED) and not r.known_gap]
        return 1 if missed else 0


def select_mutants(ops: Sequence[str] | None = None, patterns: Sequence[str] | None = None) -> list[Mutant]:
    """The catalogue's mutants of ``ops`` (default: all) whose id matches one of ``patterns``."""
    chosen = [m for m in CATALOGUE if not ops or m.op in ops]
    if patterns:
        chosen = [m for m in chosen if any(m.id == p or fnmatch.fnmatchcase(m.id, p) for p in patterns)]
    return chosen


def _search_order(cases: list, first: Sequence[str]) -> list:
    """The cases matching ``first`` (in the order of its globs), then the others."""
    ordered = []
    for pattern in first:
        ordered += [case for case in cases if fnmatch.fnmatchcase(case.label, pattern) and case not in ordered]
    return ordered + [case for case in cases if case not in ordered]


def run_mutant(
    mutant: Mutant,
    *,
    profile: str = "quick",
    seed: int = 0,
    max_cases: int | None = None,
    target: str = "reference",
    device: torch.device | None = None,
) -> MutantResult:
    """Check ``mutant`` as a backend over its operator's cases until one FAILs."""
    started = time.perf_counter()
    if mutant.op not in all_ops():
        return MutantResult(mutant, mutant.family, SKIPPED, evidence="operator not registered in the oracle")
    op = get_op(mutant.op)
    base = op.reference() if target == "reference" else op.optimized()
    if base is None:
        return MutantResult(mutant, op.family, SKIPPED, evidence="no optimized twin yet")
    twin = backend_twin(f"mutant {mutant.id}", types.SimpleNamespace(**{op.name: mutant.apply(base)}))
    device = device or execution_target()[0]
    cases = _search_order(select_cases(profile, [op.name]), mutant.first)[:max_cases]
    result = MutantResult(mutant, op.family, SURVIVED)
    for case in cases:
        checks, _ = check_case(case, case_seed(seed, case.label), device, None, False, twin=twin, self_checks=False)
        result.cases_run += 1
        failed = [check for check in checks if check.status == FAIL]
        if failed:
            result.status, result.killer, result.evidence = KILLED, case.label, describe(failed[0])
            break
        errors = [check for check in checks if check.status == ERROR]
        if errors and not result.evidence:
            result.status, result.killer, result.evidence = CRASHED, case.label, describe(errors[0])
    if result.status == SURVIVED:
        result.evidence = f"all {result.cases_run} cases pass"
    result.seconds = time.perf_counter() - started
    return result


def run_mutants(
    mutants: Sequence[Mutant] | None = None,
    *,
    profile: str = "quick",
    seed: int = 0,
    max_cases: int | None = None,
    target: str = "reference",
    progress: Progress | None = None,
) -> MutationResult:
    """The self-test over ``mutants`` (default: the whole catalogue)."""
    mutants = list(CATALOGUE if mutants is None else mutants)
    progress = progress or Progress()
    jit = OPTIMIZED.jit_module if target == "optimized" else None
    outcome = MutationResult(environment(profile, seed, jit), profile, seed, target)
    progress.stage("mutants", len(mutants))
    for each in mutants:
        outcome.results.append(run_mutant(each, profile=profile, seed=seed, max_cases=max_cases, target=target))
        progress.advance(each.id)
    return outcome


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


SKIP_WHY = "no optimized twin or operator not registered; each mutant's evidence says which"


def family_line(family: str, figures: dict[str, int]) -> str:
    """``quant: 13/14 mutants killed (1 known gap), 4 skipped (…)``."""
    if not figures["run"]:
        return f"{family}: nothing to mutate, {figures['skipped']} mutants skipped ({SKIP_WHY})"
    text = f"{family}: {figures['killed']}/{figures['run']} mutants killed"
    if figures["known_gaps"]:
        text += f" ({figures['known_gaps']} known gap{'s' if figures['known_gaps'] > 1 else ''})"
    if figures["skipped"]:
        text += f", {figures['skipped']} skipped ({SKIP_WHY})"
    return text


def print_result(outcome: MutationResult, console: Console) -> None:
    console.print(
        f"[bold]tileproof mutate[/]  profile [cyan]{outcome.profile}[/]  seed {outcome.seed}  "
        f"bugs planted in the {outcome.target} twin"
    )
    table = Table(title="mutants", title_justify="left")
    for column in ("family", "mutant", "verdict", "cases", "evidence"):
        table.add_column(column, overflow="fold", justify="right" if column == "cases" else "left")
    for result in outcome.results:
        verdict = result.status + (" (known gap)" if result.known_gap else "")
        evidence = f"{result.killer}: {result.evidence}" if result.killer else result.evidence
        table.add_row(
            result.family,
            Text(result.mutant.id),
            Text(verdict, style=_STYLE[result.status]),
            str(result.cases_run) if result.status != SKIPPED else "",
            Text(evidence),
        )
    console.print(table)
    for result in outcome.results:
        if result.known_gap:
            console.print(f"[yellow]known gap:[/] {escape(result.mutant.id)}: {escape(result.known_gap)}")
    for family, figures in outcome.families().items():
        console.print(family_line(family, figures), highlight=False)
    style = "green" if outcome.exit_status == 0 else "bold red"
    killed = sum(r.status == KILLED for r in outcome.results)
    run = sum(r.status != SKIPPED for r in outcome.results)
    console.print(f"[{style}]{killed}/{run} mutants killed[/] (exit status {outcome.exit_status})")


def result_dict(outcome: MutationResult) -> dict:
    return {
        "schema": SCHEMA,
        "environment": outcome.environment,
        "run": {"profile": outcome.profile, "seed": outcome.seed, "target": outcome.target},
        "summary": {
            "killed": sum(r.status == KILLED for r in outcome.results),
            "run": sum(r.status != SKIPPED for r in outcome.results),
            "skipped": sum(r.status == SKIPPED for r in outcome.results),
            "families": outcome.families(),
            "exit_status": outcome.exit_status,
        },
        "mutants": [
            {
                "id": r.mutant.id,
                "op": r.mutant.op,
                "name": r.mutant.name,
                "family": r.family,
                "bug": r.mutant.bug,
                "status": r.status,
                "known_gap": r.known_gap or None,
                "cases_run": r.cases_run,
                "killed_by": r.killer or None,
                "evidence": r.evidence,
                "seconds": round(r.seconds, 3),
            }
            for r in outcome.results
        ],
    }


def write_json(outcome: MutationResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_dict(outcome), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
