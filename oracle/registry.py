"""Operator specs and their cases: what the oracle runs, one spec per public operator.

A family module (``tileproof.oracle.quant``, ...) defines an ``OpSpec`` subclass per operator and
registers one instance of it; this module knows nothing about any family. A spec says, for its
operator: the cases of each tier, how to build a case's inputs (seeded, on any device, or as
uninitialized tensors of the right shapes and strides for a compile-only pass), which reference
and optimized functions to call, the comparison policy of each output, the bytes the operator must
move (for bandwidth figures) and the reference's own sanity checks.

Tiers: ``quick`` is CI-sized (on a CPU machine the whole quick profile runs the reference
self-checks and compiles every kernel configuration in a few minutes); ``full`` is for the GPU,
with larger shapes and the named benchmark workloads. Both tiers reach the same set of kernel
configurations, so compiling either proves every kernel builds.

The ``edge`` profile (docs/numerics.md) is derived from the quick tier: a few quick cases of each
operator with floating-point data inputs, each again with one class of numeric edge values
(``EDGE_KINDS``: all-zero blocks, ±max, subnormals, outliers, NaN, ±Inf) written into its seeded
inputs at seeded positions. Same shapes, dtypes and flags as the quick cases it comes from, so it
needs no kernel configuration the quick tier does not compile. It is not one of ``TIERS``: those
each cover the shape edges (zero, one and odd token counts, tails, strides) on their own.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .policy import Check, Policy

TIERS = ("quick", "full")  # the shape tiers: each covers zero, one and odd sizes, tails and strides
EDGE_TIER = "edge"  # the quick tier's cases again, with numeric edge values in their inputs
PROFILES = (*TIERS, EDGE_TIER)  # what ``--profile`` selects

# Importing one of these registers its operators.
FAMILY_MODULES = (
    "tileproof.oracle.quant",
    "tileproof.oracle.quant_blocks",
    "tileproof.oracle.quant_swiglu",
    "tileproof.oracle.moe",
    "tileproof.oracle.transpose",
    "tileproof.oracle.engram",
    "tileproof.oracle.mhc",
    "tileproof.oracle.modeling",
)


# ---------------------------------------------------------------------------------------------
# Numeric edge values (the edge profile; docs/numerics.md states what each operator does with them)
# ---------------------------------------------------------------------------------------------

# The classes of edge values, one per edge case. A *unit* is what one scale or one reduction covers:
# a scale block of a cast, a row (or a token's streams) of a float operator.
EDGE_KINDS = {
    "zero": "whole units of zeros, -0 and +0 in turn (a cast's scale comes from the amax clamp)",
    "max": "one element per unit at ±max of the input dtype (bf16, fp32, ...): a cast maps it to ±Qmax",
    "subnormal": "whole units of subnormals of the input dtype, either sign",
    "scaled-subnormal": (
        "casts only: one element per unit at Qmax·2^k (so the scale is exactly 2^k), the others at multiples of "
        "half the format's subnormal step times 2^k: scaled values in the e4m3 / e2m1 / e5m6 subnormal range, ties "
        "included"
    ),
    "outlier": "one element per unit 2^20 times the unit's largest magnitude (at most the dtype's max)",
    "nan": "one NaN per unit (either sign, any payload)",
    "inf": "one +Inf in some units, -Inf in others, both in the first",
}
# Classes every floating-point dtype can hold; "inf" needs an infinity (float8_e4m3fn has none).
FLOAT_EDGE_KINDS = ("zero", "max", "subnormal", "outlier", "nan", "inf")
CAST_EDGE_KINDS = ("zero", "max", "subnormal", "scaled-subnormal", "outlier", "nan", "inf")
OUTLIER_FACTOR = 2.0**20
MAX_EDGE_UNITS = 16  # units that get edge values, at most (an eighth of them, at least one)


@dataclass(frozen=True)
class Edge:
    """The edge values of an edge case: their class, and which data input holds them ("" when the
    operator has one data input)."""

    kind: str  # a key of EDGE_KINDS
    target: str = ""

    @property
    def finite(self) -> bool:
        """Whether the edge values are finite numbers (float64 arithmetic then stays finite too)."""
        return self.kind not in ("nan", "inf")

    @property
    def suffix(self) -> str:
        """The label suffix: ``/edge-nan``, ``/edge-nan@grad``."""
        return f"/edge-{self.kind}" + (f"@{self.target}" if self.target else "")


@dataclass(frozen=True)
class Case:
    """One configuration of one operator: inputs are derived from it and a seed, nothing else."""

    op: str
    label: str  # short, stable, unique: "per_token_cast/e4m3/C128/bf16/8192x7168/packed"
    params: Any  # the family's frozen dataclass of parameters (JSON-able through dataclasses.asdict)
    benchmark: bool = False  # a named benchmark workload: always timed on a GPU
    title: str = ""  # the benchmark's human name
    edge: Edge | None = None  # an edge case: the class of edge values its built inputs hold


@dataclass(frozen=True)
class Output:
    """One output of an operator and the rule it must satisfy."""

    name: str
    policy: Policy
    why: str  # why this policy is the right one for this output (stated in every report)


@dataclass
class Call:
    """A built call: positional and keyword arguments, plus ``context`` the self-checks may read
    (for example the unquantized source of a dequantization) and which is not passed to the op."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    context: dict = field(default_factory=dict)

    def __call__(self, fn: Callable) -> Any:
        return fn(*self.args, **self.kwargs)

    def timed(self, fn: Callable) -> Any:
        """The call as the timing runs make it: the same call, unless a subclass's ``__call__`` does
        harness work around the operator (fresh output buffers, stacked results) that is not the
        operator's time."""
        return self(fn)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor argument (also inside tuples), for input-integrity checks."""
        found: list[torch.Tensor] = []

        def visit(value):
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (tuple, list)):
                for item in value:
                    visit(item)

        visit(self.args)
        visit(tuple(self.kwargs.values()))
        return found


class OpSpec(ABC):
    """Everything the oracle needs to know about one operator."""

    name: str
    family: str
    outputs: tuple[Output, ...]

    @abstractmethod
    def cases(self, tier: str) -> list[Case]:
        """The cases of a tier, in a stable order."""

    @abstractmethod
    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        """The call's arguments on ``device``. With a generator: seeded values generated on the CPU,
        then moved. With ``None``: uninitialized tensors with the same shapes, dtypes, strides and
        alignment (enough for a compile-only pass, and free for huge shapes)."""

    @abstractmethod
    def reference(self) -> Callable:
        """The reference twin's function."""

    @abstractmethod
    def optimized(self) -> Callable | None:
        """The optimized twin's function, imported on demand (this may raise), or None while the
        operator has no optimized twin yet: the oracle then runs the reference and its self-checks
        only ("reference only"), skips the compile pass and the comparison, and still exits 0."""

    @abstractmethod
    def bytes_moved(self, case: Case) -> int:
        """Bytes the operator must read plus write (the bandwidth model)."""

    def split(self, result) -> tuple[torch.Tensor, ...]:
        """The op's return value as a tuple matching ``outputs``."""
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        """Sanity checks of the reference's own outputs (documented shapes, round trips)."""
        return []

    def reference_float64(self, case: Case, call: Call) -> tuple[torch.Tensor | None, ...] | None:
        """The reference's outputs computed in float64 (inputs upcast), one per output (None for an
        output without a float64 value), or None when the operator has none. ``RelativeError``
        outputs are measured against these (``expected64``); the oracle also holds the native
        reference to the same bound against them, on every case, CPU included."""
        return None

    def compile_group(self, case: Case) -> Hashable | None:
        """A hint: cases with the same group most likely need the same compiled kernels (the
        compile pass compiles one case per group first, in parallel, then the rest hit the cache).
        None: the case compiles nothing (for example zero tokens)."""
        return case.label

    # -- the edge profile (docs/numerics.md) --

    # The classes of edge values (keys of EDGE_KINDS) the operator's inputs take; () for an operator
    # without floating-point data inputs (integer indices, counts): it has no edge cases.
    edge_kinds: tuple[str, ...] = ()
    # The data inputs that take edge values (names the spec's ``build`` knows), one per edge case in
    # turn (``edge_targets_of``); ("",) for an operator with one data input.
    edge_targets: tuple[str, ...] = ("",)
    edge_base_count = 2  # how many quick cases each edge class runs on

    def edge_base_ok(self, case: Case) -> bool:
        """Whether a quick case can carry edge values. Families narrow this default to cases with
        data (T > 0) and without special values of their own (NaN and Inf already in a case would
        blur the class under test)."""
        return not case.benchmark

    def edge_kinds_of(self, case: Case) -> tuple[str, ...]:
        """The edge classes of one base case (a dtype without infinities takes no "inf")."""
        return self.edge_kinds

    def edge_targets_of(self, case: Case) -> tuple[str, ...]:
        """The data inputs of one base case that take edge values (an optional input it lacks, none)."""
        return self.edge_targets

    # Parameter values the edge bases should cover (formats, dtypes, scale layouts): each dict picks
    # the first usable quick case whose parameters have those values.
    edge_base_preferences: tuple[dict[str, Any], ...] = ()

    def edge_bases(self, quick: list[Case]) -> list[Case]:
        """The quick cases the edge cases are made from, ``edge_base_count`` of those that
        ``edge_base_ok``: first one per ``edge_base_preferences`` entry that some case matches, then
        the rest spread evenly over the tier (which orders its cases by configuration), each from
        the middle of its share (the first quick cases are often the smallest)."""
        candidates = [case for case in quick if self.edge_base_ok(case)]
        bases: list[Case] = []
        for wanted in self.edge_base_preferences:
            match = next(
                (c for c in candidates if all(getattr(c.params, k, None) == v for k, v in wanted.items())), None
            )
            if match is not None and match not in bases and len(bases) < self.edge_base_count:
                bases.append(match)
        rest = [case for case in candidates if case not in bases]
        count = min(self.edge_base_count - len(bases), len(rest))
        return bases + [rest[(2 * index + 1) * len(rest) // (2 * count)] for index in range(count)]

    # For specs whose data inputs are plain tensor arguments of the call: each target's positional
    # argument index and how many trailing dimensions one unit spans (1: a row).
    edge_arguments: dict[str, tuple[int, int]] = {}

    def with_edge_values(self, case: Case, call: Call, generator: torch.Generator | None) -> Call:
        """``call`` with an edge case's values written (in place) into its target argument, as
        ``edge_arguments`` locates it; any other call as it is (uninitialized inputs too)."""
        if case.edge is None or generator is None:
            return call
        index, unit_dims = self.edge_arguments[case.edge.target]
        write_edge_values(call.args[index], case.edge.kind, generator, unit_dims=unit_dims)
        return call

    def edge_cases(self, quick: list[Case]) -> list[Case]:
        """The edge profile's cases: each of ``edge_bases`` once per edge class, with the same
        parameters (so the same compiled kernels) and the label suffix of its edge values; the data
        input that takes them goes round ``edge_targets``."""
        cases = []
        for i, base in enumerate(self.edge_bases(quick)):
            targets = self.edge_targets_of(base)
            for j, kind in enumerate(self.edge_kinds_of(base)):
                edge = Edge(kind, targets[(i + j) % len(targets)])
                cases.append(Case(self.name, base.label + edge.suffix, base.params, edge=edge))
        return cases


_OPS: dict[str, OpSpec] = {}
_CASES: dict[tuple[str, str], list[Case]] = {}


def register(spec: OpSpec) -> OpSpec:
    if spec.name in _OPS:
        raise ValueError(f"operator {spec.name!r} is registered twice")
    _OPS[spec.name] = spec
    return spec


def _load_families() -> None:
    for module in FAMILY_MODULES:
        importlib.import_module(module)


def all_ops() -> dict[str, OpSpec]:
    """Every registered operator, by name, in registration order."""
    _load_families()
    return dict(_OPS)


def get_op(name: str) -> OpSpec:
    ops = all_ops()
    if name not in ops:
        raise KeyError(f"unknown operator {name!r}; known: {', '.join(ops)}")
    return ops[name]


def cases_of(op: str, tier: str) -> list[Case]:
    """The cases of one operator and tier or profile (cached; labels checked unique)."""
    if tier not in PROFILES:
        raise ValueError(f"unknown profile {tier!r}; known: {', '.join(PROFILES)}")
    key = (op, tier)
    if key not in _CASES:
        spec = get_op(op)
        cases = spec.edge_cases(cases_of(op, "quick")) if tier == EDGE_TIER else spec.cases(tier)
        labels = [case.label for case in cases]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"{op} ({tier}): duplicate case labels {duplicates}")
        _CASES[key] = cases
    return list(_CASES[key])


def select_cases(
    profile: str,
    ops: Sequence[str] | None = None,
    patterns: Iterable[str] | None = None,
    max_cases: int | None = None,
) -> list[Case]:
    """The cases of ``profile`` for ``ops`` (default: all), whose label equals or matches (shell
    glob) one of ``patterns`` (default: all), at most ``max_cases`` of them."""
    names = list(ops) if ops else list(all_ops())
    for name in names:
        get_op(name)  # unknown names fail here, with the list of known ones
    patterns = list(patterns or [])
    selected = []
    for name in names:
        for case in cases_of(name, profile):
            if not patterns or any(case.label == p or fnmatch.fnmatchcase(case.label, p) for p in patterns):
                selected.append(case)
    return selected[:max_cases] if max_cases is not None else selected


def case_seed(global_seed: int, label: str) -> int:
    """The seed of one case: a hash of (global seed, label), so that a case's inputs do not depend
    on which other cases run, in what order, or on which machine."""
    digest = hashlib.sha256(f"{global_seed}:{label}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# ---------------------------------------------------------------------------------------------
# Writing edge values into a case's inputs
# ---------------------------------------------------------------------------------------------

# Explicit mantissa bits of each floating-point dtype that edge values are written into.
_MANTISSA_BITS = {
    torch.float64: 52,
    torch.float32: 23,
    torch.bfloat16: 7,
    torch.float16: 10,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 2,
}
# The integer type of each element width: NaN bit patterns (sign, payload) are built as these.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def edge_units(
    rows: int, columns: int, block: tuple[int, int], generator: torch.Generator
) -> list[tuple[slice, slice]]:
    """The units of a ``[rows, columns]`` grid cut into ``block``-sized tiles (partial at the ends)
    that get edge values: an eighth of them, at least one and at most ``MAX_EDGE_UNITS``, drawn
    from ``generator``; each as (row slice, column slice)."""
    bm, bk = block
    across = -(-columns // bk)
    total = -(-rows // bm) * across
    if total == 0:
        return []
    count = max(1, min(MAX_EDGE_UNITS, total // 8))
    chosen = torch.randperm(total, generator=generator)[:count].tolist()
    units = []
    for index in chosen:
        r, c = divmod(index, across)
        units.append((slice(r * bm, min(rows, (r + 1) * bm)), slice(c * bk, min(columns, (c + 1) * bk))))
    return units


def _nan_bits(dtype: torch.dtype, generator: torch.Generator, count: int) -> torch.Tensor:
    """``count`` NaNs of ``dtype`` with random signs and payloads (float8_e4m3fn has one NaN per sign)."""
    width = torch.finfo(dtype).bits
    mantissa = _MANTISSA_BITS[dtype]
    exponent_ones = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    if dtype == torch.float8_e4m3fn:
        payloads = torch.full((count,), (1 << mantissa) - 1, dtype=torch.int64)
    else:
        payloads = torch.randint(1, 1 << mantissa, (count,), generator=generator, dtype=torch.int64)
    signs = torch.randint(0, 2, (count,), generator=generator, dtype=torch.int64) << (width - 1)
    words = signs | exponent_ones | payloads
    if 8 < width < 64:
        # The same bits as the signed integer of the width (uint8 takes them as they are; int64
        # words are already signed).
        words = torch.where(words >= 1 << (width - 1), words - (1 << width), words)
    return words.to(_BITS[width // 8]).view(dtype)


def write_edge_values(
    tensor: torch.Tensor,
    kind: str,
    generator: torch.Generator,
    *,
    block: tuple[int, int] | None = None,
    unit_dims: int = 1,
) -> None:
    """Write the edge values of class ``kind`` (a key of ``EDGE_KINDS``, "scaled-subnormal" aside:
    its values depend on the cast's format, ``oracle.quant`` writes them) into ``tensor`` in place,
    at units drawn from ``generator``.

    The tensor is seen as a grid ``[rows, columns]``, ``columns`` the product of its last
    ``unit_dims`` dimensions; its units are the ``block`` tiles of that grid (default: one row,
    ``(1, columns)``). Only the tensor's own elements are written (a strided view keeps its padding).
    """
    if tensor.numel() == 0:
        return
    dtype = tensor.dtype
    finfo = torch.finfo(dtype)
    columns = 1
    for size in tensor.shape[len(tensor.shape) - unit_dims :]:
        columns *= size
    rows = tensor.numel() // columns
    grid = tensor.detach().to("cpu", torch.float64).reshape(rows, columns)
    positions: list[int] = []  # flat indices into the grid
    values: list[torch.Tensor] = []  # float64 values, or bit patterns of dtype (NaN)
    units = edge_units(rows, columns, block or (1, columns), generator)
    for number, (row_slice, column_slice) in enumerate(units):
        unit_rows = torch.arange(rows)[row_slice]
        unit_columns = torch.arange(columns)[column_slice]
        flat = (unit_rows[:, None] * columns + unit_columns[None, :]).reshape(-1)
        one = flat[torch.randint(0, flat.numel(), (1,), generator=generator)]
        sign = 1.0 if bool(torch.randint(0, 2, (1,), generator=generator)) else -1.0
        if kind == "zero":
            # -0 in the first unit (and every other one): a unit that was all +0 already changes too.
            positions += flat.tolist()
            values.append(torch.full((flat.numel(),), -0.0 if number % 2 == 0 else 0.0, dtype=torch.float64))
        elif kind == "max":
            positions += one.tolist()
            values.append(torch.tensor([sign * finfo.max], dtype=torch.float64))
        elif kind == "subnormal":
            # m · 2^(emin - mantissa bits) with 1 <= m < 2^mantissa bits: every subnormal of the dtype.
            smallest = finfo.tiny * finfo.eps
            steps = torch.randint(1, 1 << _MANTISSA_BITS[dtype], (flat.numel(),), generator=generator)
            signs = torch.randint(0, 2, (flat.numel(),), generator=generator) * 2 - 1
            positions += flat.tolist()
            values.append((signs * steps).to(torch.float64) * smallest)
        elif kind == "outlier":
            largest = float(grid.reshape(-1)[flat].abs().max())
            magnitude = min(max(largest, finfo.tiny) * OUTLIER_FACTOR, finfo.max)
            positions += one.tolist()
            values.append(torch.tensor([sign * magnitude], dtype=torch.float64))
        elif kind == "nan":
            positions += one.tolist()
            values.append(_nan_bits(dtype, generator, 1))
        elif kind == "inf":
            if dtype == torch.float8_e4m3fn:
                raise ValueError("float8_e4m3fn has no infinity: no 'inf' edge values")
            positions += one.tolist()
            values.append(torch.tensor([float("inf") if number % 2 == 0 else float("-inf")], dtype=torch.float64))
            if number == 0 and flat.numel() > 1:
                # +Inf and -Inf in one unit: a sum over it is NaN, in any order.
                other = flat[flat != one][torch.randint(0, flat.numel() - 1, (1,), generator=generator)]
                positions += other.tolist()
                values.append(torch.tensor([float("-inf")], dtype=torch.float64))
        else:
            raise ValueError(f"unknown edge class {kind!r}; known: {', '.join(EDGE_KINDS)}")
    write_at(tensor, positions, values)


def write_at(tensor: torch.Tensor, positions: list[int], values: list[torch.Tensor]) -> None:
    """``tensor``'s elements at ``positions`` (flat indices of its logical elements, row-major) set
    to ``values`` (float64 values exact in the dtype, or bit patterns already of the dtype); where a
    position repeats, the last value wins."""
    if not positions:
        return
    converted = [v if v.dtype == tensor.dtype else v.to(tensor.dtype) for v in values]
    flat_values = torch.cat(converted).to(tensor.device)
    index = torch.tensor(positions, dtype=torch.int64)
    # Last one wins: keep the last occurrence of each position.
    order = torch.arange(index.numel())
    last = torch.zeros(int(index.max()) + 1, dtype=torch.int64).scatter_reduce(0, index, order, "amax")
    keep = last[index] == order
    coordinates = torch.unravel_index(index[keep], tuple(tensor.shape))
    with torch.no_grad():
        tensor[tuple(c.to(tensor.device) for c in coordinates)] = flat_values[keep.to(tensor.device)]
