"""``tileproof launches``: the kernel launches of the optimized twin compared with those of another
git revision, on the CPU.

A change to the launchers' host code (argument checks, launch plans, views, allocation) must not
change what the kernels receive. This command runs the working tree's optimized twin and the one of
``--base REV`` (extracted as ``tileproof oracle --base`` does) over the selected cases on the CPU,
with every kernel factory of both replaced by a recorder (nothing is built or launched) and the
launchers' CUDA check lifted, and compares, case by case:

- the kernels asked for, in order: factory and static arguments;
- each launch's arguments: a tensor by the storage it views (an input, by its position among the
  call's tensors, or a fresh buffer, numbered in order of first use), its shape, strides, dtype and
  byte offset; an integer that is an address inside one of those storages as that storage and
  offset (kernels that take raw addresses); any other value as it is;
- the returned tensors, described the same way, and an exception by its type and message.

Equal launches mean the kernels receive the same data at the same places, so on a GPU they compute
the same bytes: a host-side refactor is proven here without one. A launcher that reads a device
value back (a data-dependent size, a status word) would read a buffer no kernel wrote: such a read
of anything but an input stops the case on both sides, and the launches up to it are compared.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from . import runner
from .registry import Call, OpSpec, case_seed, get_op, select_cases

# Tensor methods that hand a device value to the host.
_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class _HostRead(Exception):
    """A launcher read back a value no kernel wrote (the recorders launch nothing)."""


@dataclass
class _Recording:
    launches: list = field(default_factory=list)  # (factory, static arguments, options, launch arguments)
    inputs: set = field(default_factory=set)  # storage addresses of the call's tensors


class _StopAtHostReads(TorchFunctionMode):
    def __init__(self, recording: _Recording):
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS and args and isinstance(args[0], torch.Tensor):
            if args[0].untyped_storage().data_ptr() not in self.recording.inputs:
                raise _HostRead(f"{func.__name__} of a buffer no kernel wrote")
        return func(*args, **(kwargs or {}))


def _package_of(twin: runner.Twin) -> str:
    return twin.jit_module.rsplit(".", 1)[0]


@contextlib.contextmanager
def recorded(package: str, recording: _Recording) -> Iterator[None]:
    """Inside: every kernel factory of ``package`` returns a recorder appending to ``recording``,
    and its launchers accept CPU tensors. Every module of the package is imported first (launchers
    import some lazily), except ``library`` (it registers ``torch.ops.tileproof``: the working
    tree's does)."""
    jit = importlib.import_module(f"{package}.jit")
    modules = [importlib.import_module(package)]
    for info in pkgutil.walk_packages(modules[0].__path__, f"{package}."):
        if info.name.rsplit(".", 1)[-1] != "library":
            modules.append(importlib.import_module(info.name))

    def factory_call(self, *static, **options):
        name = self.qualified_name.removeprefix(f"{package}.")

        def launch(*arguments):
            recording.launches.append((name, static, tuple(sorted(options.items())), arguments))

        return launch

    # Launch plans hold their kernels: none may outlive (or predate) the recording.
    plan_caches = [
        value for module in modules for value in vars(module).values() if type(value).__name__ == "LaunchPlans"
    ]
    saved = [(jit.KernelFactory, "__call__", jit.KernelFactory.__call__)]
    jit.KernelFactory.__call__ = factory_call
    for module in modules:
        if hasattr(module, "require_cuda"):
            saved.append((module, "require_cuda", module.require_cuda))
            module.require_cuda = lambda name, tensor: None
    for plans in plan_caches:
        plans.clear()
    try:
        yield
    finally:
        for plans in plan_caches:
            plans.clear()
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


class _Describer:
    """Tensors and addresses as storage roles: ``in<k>`` for the call's k-th tensor's storage,
    ``new<k>`` for fresh storages in order of first appearance."""

    def __init__(self, inputs: list[torch.Tensor]):
        self.roles: dict[int, str] = {}
        self.sizes: dict[int, int] = {}
        for index, tensor in enumerate(inputs):
            self._add(tensor, f"in{index}")

    def _add(self, tensor: torch.Tensor, role: str) -> str:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if start not in self.roles:
            self.roles[start] = role
            self.sizes[start] = storage.nbytes()
        return self.roles[start]

    def tensor(self, tensor: torch.Tensor) -> tuple:
        role = self._add(tensor, f"new{sum(r.startswith('new') for r in self.roles.values())}")
        start = tensor.untyped_storage().data_ptr()
        return (role, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.data_ptr() - start)

    def value(self, value):
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            for start, role in self.roles.items():
                if start <= value < start + max(self.sizes[start], 1):
                    return ("address", role, value - start)
        return value

    def result(self, value):
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, (tuple, list)):
            return tuple(self.result(item) for item in value)
        return value


@dataclass
class Outcome:
    launches: list
    returned: object
    error: str | None


def run_recorded(fn: Callable, op: OpSpec, case, package: str) -> Outcome:
    """One case through ``fn`` (of ``package``) on fresh CPU inputs (the oracle's, seed 0), recorded."""
    call: Call = op.build(case, torch.device("cpu"), torch.Generator().manual_seed(case_seed(0, case.label)))
    inputs = call.tensors()
    recording = _Recording(inputs={tensor.untyped_storage().data_ptr() for tensor in inputs})

    def receiving(*arguments, **options):
        # What the operator itself receives (a harness may add buffers of its own, e.g. fresh
        # outputs written in place): inputs too, named after the call's own tensors.
        received = Call(arguments, options).tensors()
        inputs.extend(received)
        recording.inputs.update(tensor.untyped_storage().data_ptr() for tensor in received)
        return fn(*arguments, **options)

    result, error = None, None
    with recorded(package, recording), _StopAtHostReads(recording):
        try:
            result = call(receiving)
        except _HostRead as read:
            error = f"stopped: {read}"
        except Exception as raised:  # noqa: BLE001  (compared, as the launcher raised it)
            error = f"{type(raised).__name__}: {raised}"
    describe = _Describer(inputs)
    returned = None if error else getattr(result, "finish", lambda: result)()
    # Every storage first (tensor arguments in launch order, then the results), so that an address
    # passed before its buffer shows up as a tensor is still named.
    for _, _, _, arguments in recording.launches:
        for argument in arguments:
            if isinstance(argument, torch.Tensor):
                describe.tensor(argument)
    launches = [
        (name, static, options, tuple(describe.value(argument) for argument in arguments))
        for name, static, options, arguments in recording.launches
    ]
    return Outcome(launches, None if error else describe.result(returned), error)


@dataclass
class Difference:
    label: str
    what: str


def compare(base: str, profile: str = "quick", ops: list[str] | None = None, patterns=None):
    """``(cases compared, differences)`` between the working tree's optimized twin and the one of
    git revision ``base``, on the CPU."""
    twins = (runner.OPTIMIZED, runner.base_twin(base))
    differences: list[Difference] = []
    cases = select_cases(profile, ops, patterns)
    for case in cases:
        op: OpSpec = get_op(case.op)
        outcomes = []
        for twin in twins:
            fn, error = runner.twin_function(twin, op)
            if fn is None:
                outcomes.append(Outcome([], None, error or "no such operator"))
                continue
            outcomes.append(run_recorded(fn, op, case, _package_of(twin)))
        current, older = outcomes
        for what, mine, theirs in (
            ("error", current.error, older.error),
            ("launches", current.launches, older.launches),
            ("returned tensors", current.returned, older.returned),
        ):
            if mine != theirs:
                differences.append(Difference(case.label, f"{what}: {_first_difference(mine, theirs)}"))
                break
    return len(cases), differences


def _first_difference(mine, theirs) -> str:
    if isinstance(mine, list) and isinstance(theirs, list):
        for index, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if a != b:
                return f"#{index}: {a!r} here, {b!r} at the base"
        return f"{len(mine)} here, {len(theirs)} at the base"
    return f"{mine!r} here, {theirs!r} at the base"


def add_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "launches",
        help="compare the kernel launches of the optimized twin with another git revision's (CPU)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base", metavar="REV", required=True, help="the git revision to compare with")
    parser.add_argument("--op", action="append", metavar="NAME", help="operator (repeat, or comma-separate)")
    parser.add_argument("--profile", choices=("quick", "edge", "full"), default="quick", help="case tier")
    parser.add_argument("--case", action="append", metavar="LABEL", help="case label or shell glob (repeatable)")
    return parser


def main_from_args(args: argparse.Namespace) -> int:
    from .cli import selected_ops  # the oracle's --op parsing

    try:
        count, differences = compare(args.base, args.profile, selected_ops(args.op), args.case)
    except ValueError as error:
        print(f"tileproof launches: error: {error}", file=sys.stderr)
        return 2
    for difference in differences:
        print(f"DIFFERENT {difference.label}: {difference.what}")
    print(f"{count} cases: {count - len(differences)} launch the same kernels with the same arguments as {args.base}")
    return 1 if differences else 0
