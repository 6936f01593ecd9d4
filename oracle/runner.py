"""Runs the oracle: compile pass, reference self-checks, GPU comparisons, timings.

The stages, for the selected cases:

1. Compile pass (``compile_all``): every case's optimized call under ``compile_only()``, from a
   thread pool, with uninitialized inputs of the right shapes and strides. One case per compile
   group goes first, so that parallel workers compile different kernels; the rest hit the cache.
   Without a GPU this *is* the test of the optimized twin (every kernel builds for sm_90a); with
   one it warms the kernel cache before anything is timed.
2. Per case: inputs from the case's seed, the reference (on the GPU when there is one, else on the
   CPU) and its self-checks. With a GPU: the optimized op twice under ``poison_outputs()``; every
   output compared with the reference under its policy; the two runs compared byte for byte
   (determinism); inputs checked untouched (whole storage, padding included); small cases also
   compare the reference on the CPU with the reference on the GPU (the reference must not depend
   on the device).
3. Timing (GPU, benchmark workloads and large cases of the full profile): see ``timing``.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .policy import ERROR, FAIL, PASS, SKIP, Bitwise, Check, compare, same_bytes
from .registry import Call, Case, all_ops, case_seed, get_op, select_cases
from .timing import L2_FLUSH_BYTES, LARGE_CASE_BYTES, Timer, Timing, copy_roof_gbps, first_line, time_case

NO_GPU_NOTE = "no CUDA GPU: comparisons and timings skipped"
GIT_REVISION_ENV = "TILEPROOF_GIT_REVISION"
CPU_CROSS_CHECK_ELEMENTS = 1 << 20  # reference CPU ≡ GPU on cases up to this many input elements
COMPILE_NAME = "compile (optimized)"


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

    @property
    def exit_status(self) -> int:
        return 0 if all(result.status == PASS for result in self.results) else 1

    def counts(self) -> dict[str, int]:
        counts = {PASS: 0, FAIL: 0, ERROR: 0}
        for result in self.results:
            counts[result.status] += 1
        return counts


@dataclass(frozen=True)
class CompileFailure:
    op: str
    label: str
    error: str


def repro_command(case: Case, seed: int, profile: str) -> str:
    """``tileproof oracle ...`` selecting exactly this case (the CLI parses it back)."""
    words = ["tileproof", "oracle", "--op", case.op, "--case", case.label, "--seed", str(seed)]
    if profile != "quick":
        words += ["--profile", profile]
    words.append("--no-timing")
    return " ".join(shlex.quote(word) for word in words)


def run_command(
    profile: str, seed: int, ops: Sequence[str] | None, patterns: Sequence[str] | None, max_cases: int | None
) -> str:
    """``tileproof oracle ...`` re-running a whole selection."""
    words = ["tileproof", "oracle", "--profile", profile, "--seed", str(seed)]
    for op in ops or []:
        words += ["--op", op]
    for pattern in patterns or []:
        words += ["--case", pattern]
    if max_cases is not None:
        words += ["--max-cases", str(max_cases)]
    return " ".join(shlex.quote(word) for word in words)


# ---------------------------------------------------------------------------------------------
# Compile pass
# ---------------------------------------------------------------------------------------------


def _compile_one(case: Case, device: torch.device) -> str | None:
    """Compile (or load) every kernel the case's optimized call needs; the error, or None."""
    op = get_op(case.op)
    try:
        from tileproof.optimized.jit import compile_only

        fn = op.optimized()
    except Exception as error:
        return f"cannot import the optimized twin: {first_line(error)}"
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
) -> dict[str, str | None]:
    """Run the compile-only call of every case (label -> error or None)."""
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
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tileproof-compile") as pool:
        for wave in (first, rest):
            for case, error in zip(wave, pool.map(lambda c: _compile_one(c, device), wave), strict=True):
                results[case.label] = error
                if on_done:
                    on_done(case, error)
    return results


def compile_all(
    profile: str = "quick",
    ops: Sequence[str] | None = None,
    patterns: Sequence[str] | None = None,
    *,
    workers: int | None = None,
    device: torch.device | None = None,
) -> list[CompileFailure]:
    """Compile every kernel configuration that ``profile`` needs (for ``compile_target()``,
    sm_90a without a GPU), from a thread pool; return the failures (empty: all compiled).

    ``ops`` and ``patterns`` (labels or shell globs) narrow the selection like the CLI's ``--op``
    and ``--case``. No GPU is needed: inputs are uninitialized CPU tensors of the right layout."""
    cases = select_cases(profile, ops, patterns)
    results = compile_pass(cases, device=device, workers=workers)
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
    case: Case, seed: int, device: torch.device, compile_error: str | None, gpu: bool
) -> tuple[list[Check], Call | None]:
    """The checks of one case (see the module docstring); also returns the built call."""
    op = get_op(case.op)
    checks: list[Check] = []
    call = _guarded("build inputs", checks, lambda: op.build(case, device, _generator(seed)))
    if call is None:
        return checks, None
    reference = _guarded("reference", checks, lambda: op.split(call(op.reference())))
    if reference is not None:
        found = _guarded("reference self-check", checks, lambda: op.self_check(case, call, reference))
        checks.extend(found or [])

    if compile_error:
        checks.append(Check(COMPILE_NAME, ERROR, detail=compile_error))
    else:
        checks.append(Check(COMPILE_NAME, PASS, metric="ok"))
    if not gpu:
        checks.append(Check("GPU comparison", SKIP, detail=NO_GPU_NOTE))
        return checks, call
    if compile_error or reference is None:
        checks.append(Check("GPU comparison", SKIP, detail="no optimized result to compare (see above)"))
        return checks, call

    from tileproof.optimized.jit import poison_outputs

    before = [_storage_snapshot(t) for t in call.tensors()]

    def run_twice():
        fn = op.optimized()
        with poison_outputs():  # unwritten output elements read 0xFF and show up as mismatches
            first = op.split(call(fn))
            second = op.split(call(fn))
        if device.type == "cuda":
            torch.cuda.synchronize()  # a failing launch is reported here, against this case
        return first, second

    runs = _guarded("optimized", checks, run_twice)
    if runs is None:
        return checks, call
    first, second = runs
    if not len(first) == len(reference) == len(op.outputs):
        detail = f"{len(first)} optimized and {len(reference)} reference outputs, expected {len(op.outputs)}"
        checks.append(Check("outputs", FAIL, detail=detail))
        return checks, call
    for output, actual, expected in zip(op.outputs, first, reference, strict=True):
        checks.append(compare(output.name, actual, expected, output.policy))
    identical = all(same_bytes(a, b) for a, b in zip(first, second, strict=True))
    checks.append(
        Check("determinism", PASS if identical else FAIL, "bitwise", "2 runs", "" if identical else "runs differ")
    )
    untouched = all(torch.equal(b, _storage_snapshot(t)) for b, t in zip(before, call.tensors(), strict=True))
    checks.append(
        Check("inputs untouched", PASS if untouched else FAIL, "bitwise", "", "" if untouched else "input written")
    )
    if sum(t.numel() for t in call.tensors()) <= CPU_CROSS_CHECK_ELEMENTS:
        checks.extend(_reference_device_check(case, seed, reference))
    return checks, call


def _checked_case(
    case: Case, seed: int, device: torch.device, compile_error: str | None, gpu: bool
) -> tuple[list[Check], Call | None]:
    """``check_case``, with anything it did not expect recorded against the case (not raised)."""
    try:
        return check_case(case, seed, device, compile_error, gpu)
    except Exception as error:
        return [Check("oracle", ERROR, detail=_error_text(error))], None


def _reference_device_check(case: Case, seed: int, on_gpu: tuple[torch.Tensor, ...]) -> list[Check]:
    """The reference on the CPU must give the bytes it gives on the GPU."""
    op = get_op(case.op)
    checks: list[Check] = []
    on_cpu = _guarded(
        "reference CPU ≡ GPU",
        checks,
        lambda: op.split(op.build(case, torch.device("cpu"), _generator(seed))(op.reference())),
    )
    if on_cpu is None:
        return checks
    for output, cpu, gpu in zip(op.outputs, on_cpu, on_gpu, strict=True):
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
) -> Report:
    """Run the oracle over the selected cases and return the report (nothing is printed)."""
    progress = progress or Progress()
    cases = select_cases(profile, ops, patterns, max_cases)
    device, gpu = execution_target()
    notes = [] if gpu else [NO_GPU_NOTE]

    try:  # jit first: it points TileLang's cache at TILEPROOF_CACHE_DIR before TileLang loads
        importlib.import_module("tileproof.optimized.jit")
    except Exception as error:
        notes.append(f"tileproof.optimized.jit does not import: {first_line(error)}")

    progress.stage("compiling kernels", len(cases))
    compile_errors = compile_pass(cases, device=device, workers=workers, on_done=lambda c, e: progress.advance(c.label))

    results: list[CaseResult] = []
    calls: dict[str, Call] = {}
    cuda_broken = False
    timed = {case.label for case in cases if gpu and timing and _is_timed(case, profile)}
    progress.stage("checking" if gpu else "checking references", len(cases))
    for case in cases:
        own_seed = case_seed(seed, case.label)
        checks, call = _checked_case(case, own_seed, device, compile_errors[case.label], gpu)
        results.append(CaseResult(case, own_seed, repro_command(case, seed, profile), checks))
        if gpu and not cuda_broken and any(_is_cuda_error(check.detail) for check in checks):
            cuda_broken = True
            notes.append(
                f"a CUDA error in {case.label} may have broken the CUDA context: later errors can be its "
                "consequences; re-run that case alone (its repro line)"
            )
        if case.label in timed and call is not None and results[-1].status == PASS:
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
            op = get_op(result.case.op)
            result.timing = time_case(op, result.case, call, timer, torch_compile=torch_compile)
            del call
            progress.advance(result.case.label)
    elif not timing:
        notes.append("timings not requested (--no-timing)")

    selected_ops = list(dict.fromkeys(case.op for case in cases))
    command = run_command(profile, seed, ops, patterns, max_cases)
    return Report(environment(profile, seed), profile, seed, gpu, timing, selected_ops, results, notes, command)


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


def environment(profile: str, seed: int) -> dict:
    """Where and with what the oracle ran (the header of every report)."""
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
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        env["gpu"] = properties.name
        env["sm_count"] = properties.multi_processor_count
        env["compute_capability"] = f"{properties.major}.{properties.minor}"
        driver = _command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        env["driver"] = driver.splitlines()[0] if driver else None
    try:
        from tileproof.optimized.jit import compile_target

        env["compile_target"] = compile_target().get("arch")
    except Exception:
        pass
    root = Path(__file__).resolve().parents[1]
    revision = _command("git", "rev-parse", "HEAD", cwd=root)
    if revision:
        env["git_revision"] = revision
        env["git_dirty"] = bool(_command("git", "status", "--porcelain", "--untracked-files=no", cwd=root))
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
