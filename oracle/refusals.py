"""The refusal matrix: every public operator × every validation rule, derived from the registry.

Issue 9 asks that every public entry point, reference and optimized alike, refuse a bad argument
with a ``ValueError`` or ``TypeError`` whose message names the argument. This module derives the bad
calls mechanically from one valid call per operator (``tests/test_refusals.py`` runs them) and
writes the table of docs/validation.md (``python -m tileproof.oracle.refusals`` prints it; a test
keeps the committed page equal to it).

The valid call: of the operator's ``quick`` cases whose every tensor argument is non-empty (tokens
> 0), the one with the most tensor arguments (so optional tensors are covered), built with a fixed
seed. The entry point: the twin's function, unwrapped where the registry wraps it for the oracle (a
copy of an in-place buffer, an extra output). A modeling operator is an oracle driver of autograd
layers, not an entry point: its entries are the layer functions it calls (``engram_gate``,
``mhc_pre``, ...), each with the call the reference driver makes to it on the valid case. Argument
names come from the function's signature (``inspect.signature(...).bind``); a tuple or list
argument's tensors are named ``name[i]``, as the validators name them.

Per tensor argument, one bad call per rule:

- ``dtype``: the tensor replaced by the same values as ``torch.complex64`` (a dtype no operator
  supports) → ``TypeError`` or ``ValueError``;
- ``rank``: ``tensor.unsqueeze(0)`` (one extra leading dimension) → ``ValueError`` or ``TypeError``;
- ``type``: the tensor replaced by a Python list of its values → ``TypeError``;
- ``device`` (optimized twin only, one per operator): the valid call with its CPU tensors, outside
  ``compile_only`` → ``ValueError`` naming one of the tensor arguments.

The optimized twin runs the first three under ``outputs_only`` (``compile_only`` without building
a kernel: a launcher validates, then returns unwritten outputs), so a call it wrongly accepts costs
no compile. Expected exceptions to the rules (an argument whose dtype is genuinely free, ...) are
listed once, with their reason, in ``EXCEPTIONS``; refusals that are missing or misnamed and not
fixed yet, in ``KNOWN_BUGS`` (their tests are strict expected failures).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import registry

RULES = ("dtype", "rank", "type", "device")
TWINS = ("reference", "optimized")
SEED = 9  # the number: any fixed seed builds a valid call
BAD_DTYPE = torch.complex64

_ANY_DTYPE_ROWS = "any dtype: the rows are copied bit for bit (contract §2, reference/moe.py)"
_LEADING = "any leading dimensions ([..., n, C] / [..., C], reference/modeling.py)"
# (entry, rule, argument) -> why the rule does not apply to that argument. Keep it small and honest:
# each line is a documented freedom of the contract, not a refusal that is missing.
EXCEPTIONS: dict[tuple[str, str, str], str] = {
    ("transpose", "dtype", "x"): "any dtype, complex included: a transpose copies bit patterns (contract §3)",
    ("batched_transpose", "dtype", "x"): "any dtype, complex included: a transpose copies bit patterns (contract §3)",
    ("expand_to_fused", "dtype", "x"): _ANY_DTYPE_ROWS,
    ("expand_to_fused_with_sf", "dtype", "x[0]"): _ANY_DTYPE_ROWS,
    ("expand_to_fused_with_sf", "dtype", "x[1]"): _ANY_DTYPE_ROWS,
    # The modeling layers take any leading dimensions: an extra one on the tensor that sets them is
    # accepted, or (engram_gate, mhc_post) refused as a shape mismatch of the tensors that follow it,
    # named by those.
    ("engram_gate_layer.engram_gate", "rank", "hidden_states"): _LEADING,
    ("mhc_pipeline.expand_from_embedding", "rank", "x"): _LEADING,
    ("mhc_pipeline.mhc_pre", "rank", "residual"): _LEADING,
    ("mhc_pipeline.mhc_post", "rank", "residual"): _LEADING,
    ("mhc_pipeline.mhc_head", "rank", "residual"): _LEADING,
}

# (entry, twin, rule, argument) -> a refusal that is missing or misnamed, not fixed yet: its test is
# an xfail(strict=True) with this reason, so the fix turns it into a failure until it is removed here.
KNOWN_BUGS: dict[tuple[str, str, str, str], str] = {}


@dataclass(frozen=True)
class Entry:
    """A public entry point of the matrix: a registry operator, or one layer function that a
    registry driver (the modeling operators) calls; ``name`` is ``op`` or ``op.layer``."""

    op: str
    layer: str | None = None

    @property
    def name(self) -> str:
        return self.op if self.layer is None else f"{self.op}.{self.layer}"


@dataclass(frozen=True)
class BadCall:
    """One derived refusal: ``entry``'s ``twin`` called with ``argument`` broken by ``rule``."""

    entry: str
    twin: str
    rule: str
    argument: str  # "x", "x[0]", or "*" (device: every tensor of the valid call)

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.twin}-{self.rule}-{self.argument}"


def _is_driver(op: registry.OpSpec) -> bool:
    """A modeling operator: its twins are drivers over a module of layer functions."""
    return hasattr(op.reference(), "layers") and hasattr(op, "drive")


def entries() -> list[Entry]:
    """Every entry point, in the order of ``registry.FAMILY_MODULES`` and of registration within a
    module (which does not depend on which module was imported first), a driver's layers in the
    order it lists them."""
    ops = registry.all_ops()
    modules = list(registry.FAMILY_MODULES)
    found = []
    for name, op in sorted(ops.items(), key=lambda item: modules.index(type(item[1]).__module__)):
        if _is_driver(op):
            found += [Entry(name, layer) for layer in op.layers]
        else:
            found.append(Entry(name))
    return found


def entry_point(fn: Callable) -> Callable:
    """The public function behind a registry twin: the oracle wraps a few (a copy of an in-place
    buffer, an extra output) in a closure over ``fn``; a bad call goes to the function itself."""
    while getattr(fn, "__qualname__", "").endswith("<locals>.call"):
        fn = inspect.getclosurevars(fn).nonlocals["fn"]
    return fn


def twin_function(entry: Entry, twin: str) -> Callable | None:
    """The entry's public function in ``twin``, or None when that twin does not exist."""
    op = registry.get_op(entry.op)
    fn = op.reference() if twin == "reference" else op.optimized()
    if fn is None:
        return None
    return getattr(fn.layers, entry.layer) if entry.layer is not None else entry_point(fn)


@functools.cache
def valid_case(op_name: str) -> registry.Case | None:
    """The operator's valid call for the matrix: of its quick cases whose every tensor argument is
    non-empty (tokens > 0), the one with the most tensor arguments (optional tensors given), then
    the fewest elements, then the first; None when there is none. Shapes are read off uninitialized
    builds, which cost nothing."""
    op = registry.get_op(op_name)
    best, best_key = None, None
    for case in registry.cases_of(op_name, "quick"):
        tensors = op.build(case, torch.device("cpu"), None).tensors()
        if not tensors or any(t.numel() == 0 for t in tensors):
            continue
        key = (-len(tensors), sum(t.numel() for t in tensors))
        if best_key is None or key < best_key:
            best, best_key = case, key
    return best


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(item) for item in value)
    return value


class _Recorder:
    """A stand-in for a module of layer functions: records each layer's first call, then runs it."""

    def __init__(self, layers):
        self._layers, self.calls = layers, {}

    def __getattr__(self, name):
        function = getattr(self._layers, name)

        def record(*args, **kwargs):
            self.calls.setdefault(name, registry.Call(_detached(args), _detached(kwargs)))
            return function(*args, **kwargs)

        return record


def build_call(entry: Entry) -> registry.Call:
    """The entry's valid call (seeded CPU tensors), built afresh: the operator's valid case; for a
    driver's layer, the call the reference driver makes to that layer on the valid case."""
    op = registry.get_op(entry.op)
    call = op.build(valid_case(entry.op), torch.device("cpu"), torch.Generator().manual_seed(SEED))
    if entry.layer is None:
        return call
    recorder = _Recorder(op.reference().layers)
    op.drive(recorder, *call.args, **call.kwargs)
    return recorder.calls[entry.layer]


@functools.cache
def _structure(entry: Entry) -> registry.Call:
    """The entry's valid call for naming its arguments (built once)."""
    return build_call(entry)


@functools.cache
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


def bound_arguments(fn: Callable, call: registry.Call) -> inspect.BoundArguments:
    return _signature(fn).bind(*call.args, **call.kwargs)


def tensor_arguments(fn: Callable, call: registry.Call) -> list[str]:
    """The names of the call's tensor arguments in signature order: ``name`` for a tensor,
    ``name[i]`` for a tensor inside a tuple or list argument."""
    names = []
    for name, value in bound_arguments(fn, call).arguments.items():
        if isinstance(value, torch.Tensor):
            names.append(name)
        elif isinstance(value, (tuple, list)):
            names += [f"{name}[{i}]" for i, item in enumerate(value) if isinstance(item, torch.Tensor)]
    return names


_ARGUMENT = re.compile(r"^(\w+)(?:\[(\d+)\])?$")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _as_complex(t: torch.Tensor) -> torch.Tensor:
    """The same values as complex64, with the same shape and strides where the layout allows."""
    source = t.float() if t.dtype in _FP8 else t
    try:
        span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        out = torch.zeros(span, dtype=BAD_DTYPE).as_strided(t.shape, t.stride())
        out.copy_(source)
        return out
    except RuntimeError:  # an overlapping layout (a stride 0): a contiguous copy
        return source.to(BAD_DTYPE)


def _as_list(t: torch.Tensor) -> list:
    return (t.float() if t.dtype in _FP8 else t).tolist()


BREAK = {"dtype": _as_complex, "rank": lambda t: t.unsqueeze(0), "type": _as_list}


def bad_call(fn: Callable, call: registry.Call, rule: str, argument: str) -> tuple[tuple, dict]:
    """``call``'s arguments with ``argument`` broken by ``rule`` (the others untouched)."""
    bound = bound_arguments(fn, call)
    name, index = _ARGUMENT.match(argument).groups()
    value = bound.arguments[name]
    if index is None:
        bound.arguments[name] = BREAK[rule](value)
    else:
        items = list(value)
        items[int(index)] = BREAK[rule](items[int(index)])
        bound.arguments[name] = type(value)(items)
    return bound.args, bound.kwargs


def names_argument(message: str, argument: str) -> bool:
    """Whether ``message`` names ``argument`` as a word of its own (``x`` is not in ``x_block_size``,
    ``max`` or ``x[0]``)."""
    return re.search(rf"(?<![\w.\[]){re.escape(argument)}(?![\w\[])", message) is not None


def known_bug(bad: BadCall) -> str | None:
    """The reason ``bad`` is a known, unfixed bug (its test an expected failure), or None."""
    return KNOWN_BUGS.get((bad.entry, bad.twin, bad.rule, bad.argument))


def expected_exception(entry: str, rule: str, argument: str) -> str | None:
    """The documented reason why ``rule`` does not apply to ``entry``'s ``argument``, or None."""
    return EXCEPTIONS.get((entry, rule, argument))


def bad_calls() -> list[BadCall]:
    """Every derived bad call of every entry point, in registry and signature order (documented
    exceptions included: the tests skip those with their reason)."""
    found = []
    for entry in entries():
        if valid_case(entry.op) is None:
            continue
        call = _structure(entry)
        for twin in TWINS:
            fn = twin_function(entry, twin)
            if fn is None:
                continue
            arguments = tensor_arguments(fn, call)
            for rule in RULES:
                if rule == "device":
                    if twin == "optimized":
                        found.append(BadCall(entry.name, twin, rule, "*"))
                    continue
                found += [BadCall(entry.name, twin, rule, argument) for argument in arguments]
    return found


def entry_of(name: str) -> Entry:
    op, _, layer = name.partition(".")
    return Entry(op, layer or None)


# ---------------------------------------------------------------------------------------------
# docs/validation.md
# ---------------------------------------------------------------------------------------------

PAGE = "validation.md"

INTRO = """# Validation: every operator × every rule

Every public entry point, reference and optimized alike, refuses a bad argument with a `ValueError`
or `TypeError` whose message names the argument, the value it got and what is allowed. The checks
live in `reference/contract.py` and in the families' validators in `reference/*.py`, which both
twins call, so both refuse the same inputs with the same messages.

The table below is the refusal matrix of `tests/test_refusals.py`, derived from the oracle's
registry. For each operator, one valid call is taken: the `quick` case with tokens > 0 and the most
tensor arguments. For a modeling operator, which is an oracle driver of autograd layers, the valid
call is each call the driver makes to a layer. That call is then broken one tensor argument at a
time:

- **dtype**: the tensor as `torch.complex64`, a dtype no operator supports → `TypeError` or `ValueError`;
- **rank**: `tensor.unsqueeze(0)`, one extra leading dimension → `ValueError` or `TypeError`;
- **type**: the tensor replaced by a Python list → `TypeError`;
- **device** (optimized twin only): the valid call with CPU tensors → `ValueError` ("must be a CUDA tensor").

The reference twin runs each bad call directly. The optimized twin runs it under `compile_only`
(as `outputs_only`: no kernel is built or launched, so this runs on a CPU). The message must name the
argument, as `x` or, for a tensor inside a tuple or list, as `x[0]`. Each test id is
`tests/test_refusals.py::test_refusal[<entry>-<twin>-<rule>-<argument>]`. In a cell, `{a,b}` stands
for each of a and b, and `l[0…3]` for each entry of a list. A cell that gives a reason is a
documented exception: it is defined once, in `EXCEPTIONS` of `tileproof/oracle/refusals.py`, and its
test is skipped with that reason. A cell marked ✗ is a known bug that is not fixed yet, listed in
`KNOWN_BUGS` there: its test is an expected failure (`xfail(strict=True)`). Value ranges, shape
relations and strides are checked per family, in `tests/test_reference_*.py`.

**Size** (optimized twin, every entry point): the kernels index each tensor with 32-bit element
offsets, so a tensor a kernel reads or writes may span at most 2**31 - 1 elements. Every launch goes
through one place (`DirectLaunch` in `tileproof/optimized/jit.py`), which refuses a larger tensor
with a `ValueError` naming the kernel's parameter before anything runs; the reference twin is plain
PyTorch and has no such limit. Launchers that split their work into several launches take larger
inputs (`per_token_cast` launches at most 65535 rows at a time). Tests: `tests/test_size_limits.py`
(the check and its message on the CPU; on the GPU, `transpose` refused past the limit and exact
just below it, in its last rows, and `per_token_cast` exact past it).

This page is generated by `python -m tileproof.oracle.refusals` and a test checks it against the
generator, so edit the generator and not the page.
"""


def _brace(items: list[str]) -> str:
    """``{a,b}`` for several items, with a run of three or more entries of one list argument
    (``l[0]``, ``l[1]``, ..., ``l[3]``) written ``l[0…3]``."""
    runs: list[tuple[str, int | None, int | None]] = []  # (name, first index, last index)
    for item in items:
        match = _ARGUMENT.match(item)
        name, index = match.groups() if match else (item, None)  # "*": not an argument name
        index = None if index is None else int(index)
        if index is not None and runs and runs[-1][0] == name and runs[-1][2] == index - 1:
            runs[-1] = (name, runs[-1][1], index)
        else:
            runs.append((name, index, index))
    text = []
    for name, first, last in runs:
        if first is None:
            text.append(name)
        elif last - first >= 2:
            text.append(f"{name}[{first}…{last}]")
        else:
            text += [f"{name}[{i}]" for i in range(first, last + 1)]
    return text[0] if len(text) == 1 else "{" + ",".join(text) + "}"


def _cell(entry: str, rule: str, calls: list[BadCall]) -> str:
    """✓ and the test ids of one entry and rule (twins with the same arguments share one pattern),
    then the documented exceptions with their reasons."""
    checked: dict[str, list[str]] = {}  # twin -> arguments tested
    reasons: dict[str, list[str]] = {}  # reason -> arguments it exempts
    bugs: list[BadCall] = []  # known bugs: expected failures
    for twin in TWINS:
        for call in calls:
            if call.twin != twin or call.rule != rule:
                continue
            reason = expected_exception(entry, rule, call.argument)
            if known_bug(call) is not None:
                bugs.append(call)
            elif reason is None:
                checked.setdefault(twin, []).append(call.argument)
            elif call.argument not in reasons.setdefault(reason, []):
                reasons[reason].append(call.argument)
    patterns: dict[tuple[str, ...], list[str]] = {}  # arguments -> twins
    for twin, arguments in checked.items():
        patterns.setdefault(tuple(arguments), []).append(twin)
    parts = [f"`{entry}-{_brace(twins)}-{rule}-{_brace(list(arguments))}`" for arguments, twins in patterns.items()]
    text = "✓ " + ", ".join(parts) if parts else ""
    if reasons:
        listed = "; ".join(
            f"{', '.join(f'`{a}`' for a in arguments)}: {reason}" for reason, arguments in reasons.items()
        )
        text = f"{text}; exception: {listed}" if text else f"exception: {listed}"
    for bug in bugs:
        known = f"✗ known bug (xfail) `{bug.id}`: {known_bug(bug)}"
        text = f"{text}; {known}" if text else known
    if not text:
        return "n/a (no optimized twin)" if rule == "device" else "n/a (no tensor argument)"
    return text


def validation_page() -> str:
    """docs/validation.md, generated from the registry, the derivation rules and ``EXCEPTIONS``."""
    calls = bad_calls()
    lines = [INTRO, "| entry point | " + " | ".join(RULES) + " |", "|---" * (len(RULES) + 1) + "|"]
    for entry in entries():
        if valid_case(entry.op) is None:
            row = ["n/a (no quick case with tokens > 0)"] * len(RULES)
        else:
            mine = [call for call in calls if call.entry == entry.name]
            row = [_cell(entry.name, rule, mine) for rule in RULES]
        lines.append(f"| `{entry.name}` | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write_page(docs: Path) -> Path:
    path = docs / PAGE
    path.write_text(validation_page(), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(validation_page(), end="")
