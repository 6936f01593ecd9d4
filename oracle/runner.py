"""Runs the oracle: compile pass, reference self-checks, comparisons with a twin, timings.

The twin is what the references are checked against (``Twin``): by default tileproof's optimized
kernels (``OPTIMIZED``); with ``backend_twin`` any module exposing functions named like the
operators (``tileproof oracle --backend MODULE``, and the mutants of ``tileproof mutate``); with
``base_twin`` the optimized kernels of another git revision (``--base REV``). An operator the twin
lacks (``OpSpec.optimized()`` returns None: no optimized twin yet; or a backend without that name)
is *reference only*: its cases run the reference and its self-checks, and nothing else fails for it.

The stages, for the selected cases:

1. Compile pass (``compile_all``; tileproof's own kernels only): every case's optimized call under
   ``compile_only()``, from a thread pool, with uninitialized inputs of the right shapes and
   strides. One case per compile group goes first, so that parallel workers compile different
   kernels; the rest hit the cache. Without a GPU this *is* the test of the optimized twin (every
   kernel builds for sm_90a): TileLang lowers each kernel (the first wave in one process per
   worker, as the lowering holds the GIL) and nvcc then compiles many kernels' CUDA per call
   (``batched_device_compile`` in the jit module: the headers nvcc parses for every kernel are
   half the time); with one it compiles and caches each kernel before anything is timed.
2. Per case: inputs from the case's seed, the reference (on the GPU when there is one, else on the
   CPU) and its self-checks, including the native reference against its float64 version under the
   output's own ``RelativeError`` bound (``OpSpec.reference_float64``). Then, with a GPU (or on the
   CPU for a backend twin, which is plain code): the twin twice under ``poison_outputs()``; every
   output compared with the reference under its policy (``RelativeError`` against the float64
   reference where the spec provides one); the two runs compared byte for byte (determinism);
   inputs checked untouched (whole storage, padding included); with ``sm_limit``, once more with
   ``TILEPROOF_SM_LIMIT`` set, bytes identical to the unlimited run (grid-size independence);
   small cases also compare the reference on the CPU with the reference on the GPU (the reference
   must not depend on the device; reference-only operators too).
3. Timing (GPU, benchmark workloads and large cases of the full profile): see ``timing``.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import importlib
import importlib.metadata
import io
import os
import pickle
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tileproof.optimized.device import SM_LIMIT_ENV

from .policy import ERROR, FAIL, PASS, SKIP, Bitwise, Check, EdgeReference, RelativeError, compare, same_bytes
from .registry import Call, Case, OpSpec, all_ops, case_seed, get_op, select_cases
from .timing import L2_FLUSH_BYTES, LARGE_CASE_BYTES, Timer, Timing, copy_roof_gbps, first_line, time_case

NO_GPU_NOTE = "no CUDA GPU: comparisons and timings skipped"
GIT_REVISION_ENV = "TILEPROOF_GIT_REVISION"
CPU_CROSS_CHECK_ELEMENTS = 1 << 20  # reference CPU ≡ GPU on cases up to this many input elements
COMPILE_NAME = "compile (optimized)"
REFERENCE_ONLY = "reference only"  # the SKIP check of a case whose operator the twin lacks
NO_TWIN_NOTE = "no optimized twin yet"
GRID_CHECK = "grid-size independence"
# The SM count the full profile re-runs every optimized case with (an H100 PCIe's: 114 is not a
# multiple of 4 and leaves 18 of an H200's 132 SMs idle, so persistent grids and per-SM partial
# sums change shape).
FULL_PROFILE_SM_LIMIT = 114
REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Twins: what the references are checked against
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Twin:
    """A source of functions to check against the references: for each operator a function with
    the reference's signature, or None when the source has no such operator."""

    name: str  # shown in reports: "tileproof.optimized", "backend my_kernels", "base v0.1 (1a2b3c4d5e6f)"
    lookup: Callable[[OpSpec], Callable | None]  # may raise (an import error: reported per case)
    missing: str  # why an operator it lacks is reference only
    role: str = "optimized"  # the name of the check that runs it
    jit_module: str | None = None  # its tileproof jit (compile_only, poison_outputs); None: foreign code
    needs_gpu: bool = True  # compared on a CUDA GPU only; False: on the oracle's device, CPU included
    cli_args: tuple[str, ...] = ()  # the command-line options that select it (for repro lines)


OPTIMIZED = Twin("tileproof.optimized", lambda op: op.optimized(), NO_TWIN_NOTE, jit_module="tileproof.optimized.jit")


def backend_twin(name: str, namespace: object | None = None) -> Twin:
    """A backend: ``namespace`` (default: the module ``name``, imported) provides, for each
    operator, the attribute named like it. Backends are plain code: they run on the oracle's device
    (the CPU when there is no GPU), without tileproof's compile pass or output poisoning."""
    if namespace is None:
        try:
            namespace = importlib.import_module(name)
        except Exception as error:
            raise ValueError(f"--backend {name}: cannot import it: {first_line(error)}") from None
        cli_args: tuple[str, ...] = ("--backend", name)
    else:
        cli_args = ()
    return Twin(
        f"backend {name}",
        lambda op: getattr(namespace, op.name, None),
        f"not in backend {name}",
        role="backend",
        needs_gpu=False,
        cli_args=cli_args,
    )


def base_twin(revision: str) -> Twin:
    """The optimized kernels of another git revision of this checkout: ``optimized/`` of that
    commit is extracted (``git archive``, nothing in the checkout changes) into a temporary folder
    and imported as the package ``tileproof_base_<commit>``, with its own jit. What those kernels
    import from ``tileproof.reference`` (the shared validation and constants) comes from that
    revision too (its ``reference/``, extracted beside them as ``tileproof_base_<commit>_reference``),
    so a revision imports as it was written; the references the oracle compares with, and the
    oracle itself, stay those of the working tree."""
    commit = _command("git", "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}", cwd=REPO_ROOT)
    if not commit:
        raise ValueError(f"--base {revision}: not a commit of the git checkout at {REPO_ROOT}")
    alias = f"tileproof_base_{commit[:12]}"
    if alias not in sys.modules:
        try:
            archive = subprocess.run(
                ["git", "archive", "--format=tar", commit, "optimized", "reference"],
                cwd=REPO_ROOT,
                capture_output=True,
                timeout=60,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError) as error:
            raise ValueError(f"--base {revision}: commit {commit[:12]} has no optimized/ folder ({error})") from None
        folder = Path(tempfile.mkdtemp(prefix="tileproof-base-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(folder, filter="data")
            else:  # Python < 3.10.12: our own archive, no links or absolute paths to guard against
                tar.extractall(folder)
        (folder / "optimized").rename(folder / alias)
        (folder / "reference").rename(folder / f"{alias}_reference")
        for source in [*(folder / alias).rglob("*.py"), *(folder / f"{alias}_reference").rglob("*.py")]:
            text = source.read_text()
            text = text.replace("tileproof.reference", f"{alias}_reference")
            source.write_text(text.replace("tileproof.optimized", alias))
        sys.path.insert(0, str(folder))
        importlib.invalidate_caches()

    def base_module(name: str):
        """The base's module of ``tileproof.optimized`` path ``name``, or None where it has none."""
        module = alias + name.removeprefix("tileproof.optimized")
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name and module.startswith(error.name):
                return None  # that module does not exist at the base revision
            raise

    def counterpart(function: Callable) -> Callable | None:
        """The base's function of the same module path and name (None where it has none)."""
        found = base_module(function.__module__)
        return None if found is None else getattr(found, function.__name__, None)

    def lookup(op: OpSpec) -> Callable | None:
        try:
            current = op.optimized()
        except Exception:
            current = None
        # The working tree's twin mirrored: a layer driver over the base's layers, or an oracle
        # harness around launchers (a copy of an in-place argument, ...) around the base's.
        from .modeling import LayerDriver

        if isinstance(current, LayerDriver):
            layers = base_module("tileproof.optimized.modeling")
            if layers is None or not all(hasattr(layers, name) for name in op.layers):
                return None
            return LayerDriver(op, layers)
        harness = _harness_around(current, counterpart)
        if harness is not None:
            return harness
        # The working tree's twin at the same module path and name in the older tree (an operator
        # may share another's launcher: per_token_cast_e5m6 is per_token_cast), else a function
        # named like the operator there or in the family's package, where the conventions put it.
        module = getattr(current, "__module__", "") or ""
        if module.startswith("tileproof.optimized."):
            found = counterpart(current)
            if found is not None:
                return found
        candidates = [module] if module.startswith("tileproof.optimized.") else []
        for candidate in [*candidates, f"tileproof.optimized.{op.family}"]:
            found = base_module(candidate)
            if found is not None and hasattr(found, op.name):
                return getattr(found, op.name)
        return None

    return Twin(
        f"base {revision} ({commit[:12]})",
        lookup,
        f"not in base {revision}",
        jit_module=f"{alias}.jit",
        cli_args=("--base", revision),
    )


def _harness_around(function, counterpart: Callable[[Callable], Callable | None]) -> Callable | None:
    """``function``, an oracle closure around launchers of ``tileproof.optimized``, rebuilt around
    ``counterpart(launcher)`` of each; None when ``function`` is not such a closure (or a launcher
    has no counterpart)."""
    if not isinstance(function, types.FunctionType) or function.__module__.startswith("tileproof.optimized"):
        return None
    cells, replaced = [], False
    for cell in function.__closure__ or ():
        value = cell.cell_contents
        if callable(value) and (getattr(value, "__module__", "") or "").startswith("tileproof.optimized."):
            value, replaced = counterpart(value), True
            if value is None:
                return None
        cells.append(types.CellType(value))
    if not replaced:
        return None
    harness = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, tuple(cells)
    )
    harness.__kwdefaults__ = function.__kwdefaults__
    return harness


def twin_function(twin: Twin, op: OpSpec) -> tuple[Callable | None, str | None]:
    """``(function, None)``; ``(None, None)`` when the twin lacks the operator; ``(None, error)``
    when looking it up raised (a broken import)."""
    try:
        return twin.lookup(op), None
    except Exception as error:
        return None, f"cannot import the {twin.role} twin: {first_line(error)}"


@contextlib.contextmanager
def sm_limited(limit: int | None) -> Iterator[None]:
    """``TILEPROOF_SM_LIMIT=limit`` inside the block (process-wide), then restored."""
    previous = os.environ.get(SM_LIMIT_ENV)
    if limit is not None:
        os.environ[SM_LIMIT_ENV] = str(limit)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(SM_LIMIT_ENV, None)
        else:
            os.environ[SM_LIMIT_ENV] = previous


@dataclass
class CaseResult:
    case: Case
    seed: int  # the case's own seed (derived from the global seed and the label)
    repro: str  # the command line that re-runs exactly this case
    checks: list[Check] = field(default_factory=list)
    timing: Timing | None = None

    @property
    def status(self) -> str:
        if any(check.status == ERROR for check in self.checks):
            return ERROR
        if any(check.status == FAIL for check in self.checks):
            return FAIL
        return PASS

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]

    @property
    def reference_only(self) -> str:
        """Why the case ran the reference only (the twin lacks its operator), or ''."""
        return next((c.detail for c in self.checks if c.name == REFERENCE_ONLY and c.status == SKIP), "")

    @property
    def outcome(self) -> str:
        """``status``, except that a passing reference-only case is ``REFERENCE_ONLY`` (counted apart)."""
        return REFERENCE_ONLY if self.status == PASS and self.reference_only else self.status


@dataclass
class Report:
    environment: dict
    profile: str
    seed: int
    gpu: bool
    timing: bool
    ops: list[str]
    results: list[CaseResult]
    notes: list[str] = field(default_factory=list)
    command: str = ""  # the command line that re-runs this selection
    twin: str = OPTIMIZED.name  # what the references were checked against
    sm_limit: int | None = None  # the SM count of the grid-size independence re-runs, if any
    compared: bool | None = None  # whether the twin ran and was compared (None: when there was a GPU)
    # Wall seconds of each kernel configuration's first call in this run (jit.kernel_first_calls):
    # builds when the kernel cache was cold, loads from it otherwise.
    kernel_builds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.compared is None:
            self.compared = self.gpu

    @property
    def exit_status(self) -> int:
        return 0 if all(result.status == PASS for result in self.results) else 1

    def counts(self) -> dict[str, int]:
        """Cases by outcome; a passing case whose operator the twin lacks counts as reference only."""
        return outcome_counts(self.results)


def outcome_counts(results: Sequence[CaseResult]) -> dict[str, int]:
    """How many of ``results`` pass, fail, error, or are reference only."""
    counts = {PASS: 0, FAIL: 0, ERROR: 0, REFERENCE_ONLY: 0}
    for result in results:
        counts[result.outcome] += 1
    return counts


@dataclass(frozen=True)
class CompileFailure:
    op: str
    label: str
    error: str


def _twin_words(twin: Twin | None, sm_limit: int | None, profile: str) -> list[str]:
    words = list(twin.cli_args) if twin else []
    default_limit = FULL_PROFILE_SM_LIMIT if profile == "full" else None
    if sm_limit != default_limit:
        words += ["--sm-limit", str(sm_limit or 0)]
    return words


def repro_command(case: Case, seed: int, profile: str, twin: Twin | None = None, sm_limit: int | None = None) -> str:
    """``tileproof oracle ...`` selecting exactly this case (the CLI parses it back)."""
    words = ["tileproof", "oracle", "--op", case.op, "--case", case.label, "--seed", str(seed)]
    if profile != "quick":
        words += ["--profile", profile]
    words += _twin_words(twin, sm_limit, profile)
    words.append("--no-timing")
    return " ".join(shlex.quote(word) for word in words)


def run_command(
    profile: str,
    seed: int,
    ops: Sequence[str] | None,
    patterns: Sequence[str] | None,
    max_cases: int | None,
    twin: Twin | None = None,
    sm_limit: int | None = None,
) -> str:
    """``tileproof oracle ...`` re-running a whole selection."""
    words = ["tileproof", "oracle", "--profile", profile, "--seed", str(seed)]
    for op in ops or []:
        words += ["--op", op]
    for pattern in patterns or []:
        words += ["--case", pattern]
    if max_cases is not None:
        words += ["--max-cases", str(max_cases)]
    words += _twin_words(twin, sm_limit, profile)
    return " ".join(shlex.quote(word) for word in words)


# ---------------------------------------------------------------------------------------------
# Compile pass
# ---------------------------------------------------------------------------------------------


def _compile_one(case: Case, device: torch.device, twin: Twin) -> str | None:
    """Compile (or load) every kernel the case's optimized call needs; the error, or None (also
    when the twin has no function for the operator: a reference-only case compiles nothing)."""
    op = get_op(case.op)
    try:
        fn = twin.lookup(op)
        if fn is None:
            return None
        compile_only = importlib.import_module(twin.jit_module).compile_only
    except Exception as error:
        return f"cannot import the {twin.role} twin: {first_line(error)}"
    try:
        call = op.build(case, device, None)
        with compile_only():  # thread-local: each worker thread enters it itself
            call(fn)
    except Exception as error:
        return _error_text(error)
    return None


def compile_pass(
    cases: Sequence[Case],
    *,
    device: torch.device | None = None,
    workers: int | None = None,
    on_done: Callable[[Case, str | None], None] | None = None,
    twin: Twin | None = None,
    cache: bool = False,
) -> dict[str, str | None]:
    """Run the compile-only call of every case (label -> error or None) with ``twin``'s jit
    (default: tileproof's optimized kernels). ``cache``: without a GPU too, build each kernel
    whole (host module included) into TileLang's cache, for a GPU of the compile target to load,
    instead of the batched device-only check."""
    twin = twin or OPTIMIZED
    if twin.jit_module is None:  # foreign code: no compile-only mode to call it in
        return {case.label: None for case in cases}
    device = device or torch.device("cpu")
    workers = workers or default_workers()
    first: list[Case] = []
    rest: list[Case] = []
    seen: set = set()
    for case in cases:
        group = get_op(case.op).compile_group(case)
        if group is None or group in seen:
            rest.append(case)
        else:
            seen.add(group)
            first.append(case)
    results: dict[str, str | None] = {}
    with _device_compile_batch(twin, batched=not cache) as batch:
        waves = [first, rest]
        if batch is not None and workers > 1 and twin is OPTIMIZED and device.type == "cpu" and len(first) > workers:
            # TileLang's lowering holds the GIL: threads would lower one kernel at a time. Every
            # process walks the whole first wave, each from its own starting point, and lowers the
            # kernels that no sibling has claimed: all stay busy until the last kernel is claimed
            # (with a share of the cases each, the one whose share held the costlier kernels
            # finished alone). Building a case's inputs and calling its launcher again is cheap.
            starts = [index * len(first) // workers for index in range(workers)]
            outcomes = _lower_in_processes([first[start:] + first[:start] for start in starts])
            for _, state in outcomes:
                batch.absorb(state)
            for case in first:
                # A kernel's lowering error reaches the process that lowered it (and, through the
                # batch, every case that needs it); errors before any kernel reach all of them.
                error = next((errors[case.label] for errors, _ in outcomes if errors[case.label]), None)
                results[case.label] = error
                if on_done:
                    on_done(case, error)
            waves = [rest]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tileproof-compile") as pool:

            def compile_one(case: Case) -> str | None:
                if batch is None:
                    return _compile_one(case, device, twin)
                return batch.run(case.label, lambda: _compile_one(case, device, twin))

            for wave in waves:
                for case, error in zip(wave, pool.map(compile_one, wave), strict=True):
                    results[case.label] = error
                    if on_done:
                        on_done(case, error)
        if batch is not None:
            for label, error in batch.compile(workers).items():
                results[label] = results[label] or error
    return results


def _lower_in_processes(shares: list[list[Case]]) -> list[tuple[dict[str, str | None], dict]]:
    """Lower each share of cases' kernels in its own Python process (``lower_cases_main``): their
    errors and batch states. Plain subprocesses, not multiprocessing: nothing re-imports the
    caller's main module."""
    with tempfile.TemporaryDirectory(prefix="tileproof-lower-") as directory:
        # Shares often need the same kernel (``compile_pass`` gives every process every case): the
        # processes claim kernels in this folder, so that each is lowered once.
        claims = Path(directory, "claims")
        claims.mkdir()
        processes = []
        for index, share in enumerate(shares):
            cases_path, result_path = Path(directory, f"cases{index}.pickle"), Path(directory, f"result{index}.pickle")
            cases_path.write_bytes(pickle.dumps(share))
            command = [sys.executable, "-c", _LOWER_COMMAND, str(cases_path), str(result_path), str(claims)]
            log_path = Path(directory, f"log{index}.txt")
            with log_path.open("wb") as log:  # a file, not a pipe: a full pipe would block the child
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            processes.append((process, result_path, log_path))
        outcomes = []
        for process, result_path, log_path in processes:
            if process.wait() != 0 or not result_path.exists():
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"a lowering process failed (exit status {process.returncode}): {tail}")
            outcomes.append(pickle.loads(result_path.read_bytes()))
        return outcomes


_LOWER_COMMAND = "import sys; from tileproof.oracle.runner import lower_cases_main; lower_cases_main(*sys.argv[1:])"


def lower_cases_main(cases_path: str, result_path: str, claim_dir: str | None = None) -> None:
    """Entry point of a lowering process: the pickled cases' kernels lowered under a
    ``batched_device_compile`` (no nvcc), each kernel only if no sibling process claimed it in
    ``claim_dir``; writes the errors per case and the batch's state."""
    cases = pickle.loads(Path(cases_path).read_bytes())
    jit = importlib.import_module(OPTIMIZED.jit_module)
    errors: dict[str, str | None] = {}
    with jit.batched_device_compile(claim_dir=Path(claim_dir) if claim_dir else None) as batch:
        for case in cases:
            errors[case.label] = batch.run(case.label, lambda c=case: _compile_one(c, torch.device("cpu"), OPTIMIZED))
    Path(result_path).write_bytes(pickle.dumps((errors, batch.export())))


@contextlib.contextmanager
def _device_compile_batch(twin: Twin, batched: bool = True) -> Iterator:
    """Without a GPU (nothing is launched), the twin's jit defers nvcc and compiles many kernels
    per call (``batched_device_compile``); with one, or when not ``batched``, kernels are compiled
    and cached one by one."""
    if not batched:
        yield None
        return
    try:
        batch_compile = getattr(importlib.import_module(twin.jit_module), "batched_device_compile", None)
    except Exception:  # reported per case by _compile_one
        batch_compile = None
    if batch_compile is None or torch.cuda.is_available():
        yield None
        return
    with batch_compile() as batch:
        yield batch


def compile_all(
    profile: str = "quick",
    ops: Sequence[str] | None = None,
    patterns: Sequence[str] | None = None,
    *,
    workers: int | None = None,
    device: torch.device | None = None,
    twin: Twin | None = None,
    cache: bool = False,
) -> list[CompileFailure]:
    """Compile every kernel configuration that ``profile`` needs (for ``compile_target()``,
    sm_90a without a GPU), from a thread pool; return the failures (empty: all compiled).

    ``ops`` and ``patterns`` (labels or shell globs) narrow the selection like the CLI's ``--op``
    and ``--case``. No GPU is needed: inputs are uninitialized CPU tensors of the right layout.
    Operators without an optimized twin compile nothing and never fail here. ``cache``: see
    ``compile_pass``."""
    cases = select_cases(profile, ops, patterns)
    results = compile_pass(cases, device=device, workers=workers, twin=twin, cache=cache)
    return [CompileFailure(case.op, case.label, results[case.label]) for case in cases if results[case.label]]


def default_workers() -> int:
    return max(1, min(16, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------
# Per-case checks
# ---------------------------------------------------------------------------------------------


def _error_text(error: BaseException, limit: int = 2000) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= limit else text[: limit // 2] + " … " + text[-limit // 2 :]


def _guarded(name: str, checks: list[Check], fn: Callable[[], object]) -> object | None:
    """Run ``fn``; on an exception record an ERROR check named ``name`` and return None."""
    try:
        return fn()
    except Exception as error:
        checks.append(Check(name, ERROR, detail=_error_text(error)))
        return None


def _storage_snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of every byte the tensor's view spans (padding between rows included)."""
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.as_strided((span,), (1,)).view(torch.uint8).clone()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_case(
    case: Case,
    seed: int,
    device: torch.device,
    compile_error: str | None,
    gpu: bool,
    *,
    twin: Twin | None = None,
    sm_limit: int | None = None,
    compiled: bool = True,
    self_checks: bool = True,
) -> tuple[list[Check], Call | None]:
    """The checks of one case (see the module docstring); also returns the built call.

    ``twin`` (default: the optimized kernels) is compared where it can run: on the GPU, or on the
    CPU for a twin that does not need one. ``compiled=False``: the compile pass was not run.
    ``self_checks=False`` leaves out the reference's self-checks (the mutation self-test, which
    runs the same unchanged reference once per mutant)."""
    twin = twin or OPTIMIZED
    op = get_op(case.op)
    checks: list[Check] = []
    call = _guarded("build inputs", checks, lambda: op.build(case, device, _generator(seed)))
    if call is None:
        return checks, None
    reference = _guarded("reference", checks, lambda: op.split(call(op.reference())))
    if reference is not None and self_checks:
        found = _guarded("reference self-check", checks, lambda: op.self_check(case, call, reference))
        checks.extend(found or [])
    expected64 = None
    if reference is not None and any(isinstance(output.policy, RelativeError) for output in op.outputs):
        expected64 = _guarded("reference float64", checks, lambda: _float64_outputs(op, case, call, reference))
        if expected64 is not None and self_checks:
            checks.extend(_float64_self_checks(op, reference, expected64))

    fn, lookup_error = twin_function(twin, op)
    if fn is None and lookup_error is None:
        checks.append(Check(REFERENCE_ONLY, SKIP, detail=twin.missing))
        if gpu and reference is not None and sum(t.numel() for t in call.tensors()) <= CPU_CROSS_CHECK_ELEMENTS:
            checks.extend(_reference_device_check(case, seed, reference))
        return checks, call
    problem = compile_error or lookup_error
    if twin.jit_module is not None:
        if not compiled and not problem:
            checks.append(Check(COMPILE_NAME, SKIP, detail="compile pass not run (--no-compile)"))
        elif problem:
            checks.append(Check(COMPILE_NAME, ERROR, detail=problem))
        else:
            checks.append(Check(COMPILE_NAME, PASS, metric="ok"))
    elif problem:
        checks.append(Check(twin.role, ERROR, detail=problem))
    comparison = "GPU comparison" if twin.needs_gpu else "comparison"
    if twin.needs_gpu and not gpu:
        checks.append(Check(comparison, SKIP, detail=NO_GPU_NOTE))
        return checks, call
    if problem or reference is None:
        checks.append(Check(comparison, SKIP, detail=f"no {twin.role} result to compare (see above)"))
        return checks, call

    poison = contextlib.nullcontext
    if twin.jit_module is not None:
        poison = importlib.import_module(twin.jit_module).poison_outputs
    before = [_storage_snapshot(t) for t in call.tensors()]

    def run_once():
        with poison():  # unwritten output elements read 0xFF and show up as mismatches
            outputs = op.split(call(fn))
        if device.type == "cuda":
            torch.cuda.synchronize()  # a failing launch is reported here, against this case
        return outputs

    runs = _guarded(twin.role, checks, lambda: (run_once(), run_once()))
    if runs is None:
        return checks, call
    first, second = runs
    if not len(first) == len(reference) == len(op.outputs):
        detail = f"{len(first)} {twin.role} and {len(reference)} reference outputs, expected {len(op.outputs)}"
        checks.append(Check("outputs", FAIL, detail=detail))
        return checks, call
    for index, (output, actual, expected) in enumerate(zip(op.outputs, first, reference, strict=True)):
        exact = expected64[index] if expected64 is not None and isinstance(output.policy, RelativeError) else None
        checks.append(compare(output.name, actual, expected, output.policy, expected64=exact))
    differing = [output.name for output, a, b in zip(op.outputs, first, second, strict=True) if not same_bytes(a, b)]
    detail = f"runs differ: {', '.join(differing)}" if differing else ""
    checks.append(Check("determinism", FAIL if differing else PASS, "bitwise", "2 runs", detail))
    untouched = all(torch.equal(b, _storage_snapshot(t)) for b, t in zip(before, call.tensors(), strict=True))
    checks.append(
        Check("inputs untouched", PASS if untouched else FAIL, "bitwise", "", "" if untouched else "input written")
    )
    if sm_limit is not None and twin.jit_module is not None:
        checks.extend(_grid_size_check(sm_limit, first, run_once))
    if gpu and sum(t.numel() for t in call.tensors()) <= CPU_CROSS_CHECK_ELEMENTS:
        checks.extend(_reference_device_check(case, seed, reference))
    return checks, call


def _float64_outputs(
    op: OpSpec, case: Case, call: Call, reference: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor | None, ...] | None:
    """``op.reference_float64``, checked: one entry per output, each None or of its output's shape."""
    exact = op.reference_float64(case, call)
    if exact is None:
        return None
    exact = tuple(exact)
    if len(exact) != len(op.outputs):
        raise ValueError(f"reference_float64 gave {len(exact)} outputs, expected {len(op.outputs)}")
    for output, value, native in zip(op.outputs, exact, reference, strict=True):
        if value is not None and tuple(value.shape) != tuple(native.shape):
            raise ValueError(
                f"reference_float64 output {output.name} has shape {tuple(value.shape)}, the reference "
                f"{tuple(native.shape)}"
            )
    if case.edge is not None:  # numeric edge values in the inputs: RelativeError's edge rule applies
        exact = tuple(None if value is None else EdgeReference(value) for value in exact)
    return exact


def _float64_self_checks(
    op: OpSpec, reference: tuple[torch.Tensor, ...], expected64: tuple[torch.Tensor | None, ...]
) -> list[Check]:
    """The native reference must meet each RelativeError bound against the float64 reference
    (else the bound is too tight for any float32 implementation, or the float64 version is wrong)."""
    checks = []
    for output, native, exact in zip(op.outputs, reference, expected64, strict=True):
        if isinstance(output.policy, RelativeError) and exact is not None:
            name = f"reference ≈ float64: {output.name}"
            checks.append(compare(name, native, native, output.policy, expected64=exact))
    return checks


def _grid_size_check(
    sm_limit: int, unlimited: tuple[torch.Tensor, ...], run_once: Callable[[], tuple[torch.Tensor, ...]]
) -> list[Check]:
    """One more run with ``TILEPROOF_SM_LIMIT=sm_limit``: its bytes must equal the unlimited run's."""
    checks: list[Check] = []
    with sm_limited(sm_limit):
        limited = _guarded(GRID_CHECK, checks, run_once)
    if limited is None:
        return checks
    metric = f"≤ {sm_limit} SMs vs all"
    if len(limited) != len(unlimited):
        return [Check(GRID_CHECK, FAIL, "bitwise", metric, f"{len(limited)} outputs, unlimited {len(unlimited)}")]
    differing = [str(i) for i, (a, b) in enumerate(zip(limited, unlimited, strict=True)) if not same_bytes(a, b)]
    if not differing:
        return [Check(GRID_CHECK, PASS, "bitwise", metric)]
    detail = f"output {', '.join(differing)} differs from the unlimited run"
    return [Check(GRID_CHECK, FAIL, "bitwise", metric, detail)]


def _checked_case(
    case: Case, seed: int, device: torch.device, compile_error: str | None, gpu: bool, **options
) -> tuple[list[Check], Call | None]:
    """``check_case``, with anything it did not expect recorded against the case (not raised)."""
    try:
        return check_case(case, seed, device, compile_error, gpu, **options)
    except Exception as error:
        return [Check("oracle", ERROR, detail=_error_text(error))], None


def _reference_device_check(case: Case, seed: int, on_gpu: tuple[torch.Tensor, ...]) -> list[Check]:
    """The reference on the CPU must give the bytes it gives on the GPU, for outputs whose policy is
    bitwise. Float outputs under a relative-error policy may differ in the last bits between the
    two (PyTorch's CPU and CUDA reductions and transcendentals round differently), so there the
    CPU reference must meet the output's own bound against the float64 reference (or, for an op
    without one, against the GPU reference)."""
    op = get_op(case.op)
    checks: list[Check] = []
    cpu_call = None

    def run_on_cpu():
        nonlocal cpu_call
        cpu_call = op.build(case, torch.device("cpu"), _generator(seed))
        return op.split(cpu_call(op.reference()))

    on_cpu = _guarded("reference CPU ≡ GPU", checks, run_on_cpu)
    if on_cpu is None:
        return checks
    exact: tuple | None = None
    if any(isinstance(output.policy, RelativeError) for output in op.outputs):
        exact = _guarded("reference CPU float64", checks, lambda: _float64_outputs(op, case, cpu_call, on_cpu))
    for index, (output, cpu, gpu) in enumerate(zip(op.outputs, on_cpu, on_gpu, strict=True)):
        if isinstance(output.policy, RelativeError):
            expected64 = exact[index] if exact else None
            name = f"reference CPU within bound: {output.name}"
            checks.append(
                compare(name, cpu, cpu if expected64 is not None else gpu.cpu(), output.policy, expected64=expected64)
            )
        else:
            # Not cpu.to(gpu.device): that would make a padded column-major scale tensor contiguous.
            checks.append(compare(f"reference CPU ≡ GPU: {output.name}", cpu, gpu, Bitwise(nan_equal=True)))
    return checks


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


class Progress:
    """What ``run`` reports while it works (the CLI draws a progress bar from it)."""

    def stage(self, name: str, total: int) -> None: ...

    def advance(self, detail: str = "") -> None: ...


def run(
    profile: str = "quick",
    *,
    ops: Sequence[str] | None = None,
    patterns: Sequence[str] | None = None,
    max_cases: int | None = None,
    seed: int = 0,
    timing: bool = True,
    torch_compile: bool = True,
    workers: int | None = None,
    progress: Progress | None = None,
    twin: Twin | None = None,
    sm_limit: int | None = None,
    compile: bool = True,
) -> Report:
    """Run the oracle over the selected cases and return the report (nothing is printed).

    ``twin``: what the references are checked against (default ``OPTIMIZED``). ``sm_limit``: also
    re-run every optimized case with ``TILEPROOF_SM_LIMIT`` set (grid-size independence; GPU only).
    ``compile=False`` skips the compile pass (kernels then compile when first called)."""
    twin = twin or OPTIMIZED
    progress = progress or Progress()
    cases = select_cases(profile, ops, patterns, max_cases)
    device, gpu = execution_target()
    notes = []
    if not gpu:
        notes.append(NO_GPU_NOTE if twin.needs_gpu else f"no CUDA GPU: {twin.name} is compared on the CPU; no timings")

    first_calls = None  # the twin's record of kernel first calls (jit.kernel_first_calls)
    if twin.jit_module is not None:
        try:  # jit first: it points TileLang's cache at TILEPROOF_CACHE_DIR before TileLang loads
            first_calls = getattr(importlib.import_module(twin.jit_module), "kernel_first_calls", None)
        except Exception as error:
            notes.append(f"{twin.jit_module} does not import: {first_line(error)}")
    # Kernels this process built before the run cost it nothing: the report lists the run's own.
    built_before = set(first_calls()) if first_calls else set()
    if sm_limit is not None and twin.jit_module is not None:
        notes += _sm_limit_notes(sm_limit, gpu)

    if compile and twin.jit_module is not None:
        progress.stage("compiling kernels", len(cases))
        compile_errors = compile_pass(
            cases, device=device, workers=workers, on_done=lambda c, e: progress.advance(c.label), twin=twin
        )
    else:
        compile_errors = {case.label: None for case in cases}
        if twin.jit_module is not None:
            notes.append("compile pass not run (--no-compile)")

    results: list[CaseResult] = []
    calls: dict[str, Call] = {}
    cuda_broken = False
    timed = {case.label for case in cases if gpu and timing and _is_timed(case, profile)}
    options = {"twin": twin, "sm_limit": sm_limit, "compiled": compile}
    progress.stage("checking" if gpu or not twin.needs_gpu else "checking references", len(cases))
    for case in cases:
        own_seed = case_seed(seed, case.label)
        checks, call = _checked_case(case, own_seed, device, compile_errors[case.label], gpu, **options)
        repro = repro_command(case, seed, profile, twin, sm_limit)
        results.append(CaseResult(case, own_seed, repro, checks))
        if gpu and not cuda_broken and any(_is_cuda_error(check.detail) for check in checks):
            cuda_broken = True
            notes.append(
                f"a CUDA error in {case.label} may have broken the CUDA context: later errors can be its "
                "consequences; re-run that case alone (its repro line)"
            )
        result = results[-1]
        if case.label in timed and call is not None and result.status == PASS and not result.reference_only:
            calls[case.label] = call
        else:
            del call  # free the inputs now: the full profile's largest cases are hundreds of MB
        progress.advance(case.label)

    if gpu and timing and calls:
        timer = Timer(device)
        progress.stage("timing", len(calls))
        for result in results:
            call = calls.pop(result.case.label, None)
            if call is None:
                continue
            op = _as_timed(get_op(result.case.op), twin)
            result.timing = time_case(op, result.case, call, timer, torch_compile=torch_compile)
            del call
            progress.advance(result.case.label)
    elif not timing:
        notes.append("timings not requested (--no-timing)")
    lacking = list(dict.fromkeys(r.case.op for r in results if r.reference_only))
    if lacking:
        notes.append(f"reference only ({twin.missing}): {', '.join(lacking)}")

    selected_ops = list(dict.fromkeys(case.op for case in cases))
    command = run_command(profile, seed, ops, patterns, max_cases, twin, sm_limit)
    builds = {}
    if first_calls:
        builds = {name: seconds for name, seconds in first_calls().items() if name not in built_before}
    return Report(
        environment(profile, seed, twin.jit_module),
        profile,
        seed,
        gpu,
        timing,
        selected_ops,
        results,
        notes,
        command,
        twin.name,
        sm_limit,
        gpu or not twin.needs_gpu,
        builds,
    )


def _sm_limit_notes(sm_limit: int, gpu: bool) -> list[str]:
    if not gpu:
        return [f"grid-size independence (--sm-limit {sm_limit}) needs a GPU: not checked"]
    available = torch.cuda.get_device_properties(0).multi_processor_count
    if sm_limit >= available:
        return [f"--sm-limit {sm_limit}: the GPU has only {available} SMs, so the limited runs use the same grid"]
    return []


def _as_timed(op: OpSpec, twin: Twin) -> OpSpec:
    """The spec whose ``optimized()`` is the twin's function (what ``time_case`` times)."""
    if twin is OPTIMIZED:
        return op
    proxy = copy.copy(op)
    proxy.optimized = lambda: twin.lookup(op)
    return proxy


def _is_cuda_error(text: str) -> bool:
    return "CUDA error" in text or "illegal memory access" in text or "cudaError" in text


def execution_target() -> tuple[torch.device, bool]:
    """Where the twins run, and whether the optimized outputs are compared (and timed) there."""
    if torch.cuda.is_available():
        return torch.device("cuda"), True
    return torch.device("cpu"), False


def _is_timed(case: Case, profile: str) -> bool:
    return case.benchmark or (profile == "full" and get_op(case.op).bytes_moved(case) >= LARGE_CASE_BYTES)


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command(*words: str, cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(words, cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def environment(profile: str, seed: int, jit_module: str | None = OPTIMIZED.jit_module) -> dict:
    """Where and with what the oracle ran (the header of every report). ``jit_module``: the jit
    whose compile target is recorded (None: no TileLang kernels involved, nothing imported)."""
    env: dict = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "profile": profile,
        "seed": seed,
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "tilelang": _version("tilelang"),
        "triton": _version("triton"),
        "tileproof": _version("tileproof"),
        "cuda_runtime": torch.version.cuda,
        "gpu": None,
        "sm_count": None,
        "compute_capability": None,
        "driver": None,
        "compile_target": None,
        "copy_roof_gbps": copy_roof_gbps(),
        "l2_flush_bytes": L2_FLUSH_BYTES,
        "git_revision": None,
        "git_dirty": None,
        "sm_limit_env": os.environ.get(SM_LIMIT_ENV) or None,  # set by the caller: every run is limited
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        env["gpu"] = properties.name
        env["sm_count"] = properties.multi_processor_count
        env["compute_capability"] = f"{properties.major}.{properties.minor}"
        driver = _command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        env["driver"] = driver.splitlines()[0] if driver else None
    if jit_module is not None:
        try:
            env["compile_target"] = importlib.import_module(jit_module).compile_target().get("arch")
        except Exception:
            pass
    revision = _command("git", "rev-parse", "HEAD", cwd=REPO_ROOT)
    if revision:
        env["git_revision"] = revision
        env["git_dirty"] = bool(_command("git", "status", "--porcelain", "--untracked-files=no", cwd=REPO_ROOT))
    elif os.environ.get(GIT_REVISION_ENV):
        # An installed copy (e.g. on a GPU machine that received the tree without .git) is told
        # which commit it is.
        env["git_revision"] = os.environ[GIT_REVISION_ENV].strip()
    return env


def policies() -> dict[str, dict[str, dict[str, str]]]:
    """Every operator's outputs and the policy each must satisfy (stated in every report)."""
    return {
        name: {
            output.name: {"policy": output.policy.kind, "rule": output.policy.describe(), "why": output.why}
            for output in op.outputs
        }
        for name, op in all_ops().items()
    }
