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

TIERS = ("quick", "full")

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


@dataclass(frozen=True)
class Case:
    """One configuration of one operator: inputs are derived from it and a seed, nothing else."""

    op: str
    label: str  # short, stable, unique: "per_token_cast/e4m3/C128/bf16/8192x7168/packed"
    params: Any  # the family's frozen dataclass of parameters (JSON-able through dataclasses.asdict)
    benchmark: bool = False  # a named benchmark workload: always timed on a GPU
    title: str = ""  # the benchmark's human name


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
    """The cases of one operator and tier (cached; labels checked unique)."""
    if tier not in TIERS:
        raise ValueError(f"unknown profile {tier!r}; known: {', '.join(TIERS)}")
    key = (op, tier)
    if key not in _CASES:
        cases = get_op(op).cases(tier)
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
