"""TileLang plumbing shared by every kernel: compile target, kernel cache, pass configuration.

Environment variables (all listed in the README):

- ``TILEPROOF_TARGET``: the TileLang target to compile for, as JSON (``{"kind": "cuda", "arch":
  "sm_90a"}``) or an arch name (``sm_90a``, ``sm_100a``). Default: the current GPU's arch (``sm_90a``
  on Hopper, ``sm_100a`` on Blackwell); ``sm_90a`` when there is no GPU, so that a CPU machine still
  compiles every kernel to a cubin.
- ``TILEPROOF_CACHE_DIR``: TileLang's kernel cache (sets ``TILELANG_CACHE_DIR``); default
  ``~/.cache/tileproof/tilelang``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import cache
from pathlib import Path

_DEFAULT_CACHE = Path.home() / ".cache" / "tileproof" / "tilelang"

# TileLang reads its cache location when it is imported: set it before anything imports tilelang.
os.environ.setdefault("TILELANG_CACHE_DIR", os.environ.get("TILEPROOF_CACHE_DIR", str(_DEFAULT_CACHE)))
os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda").exists():
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import tilelang  # noqa: E402
import torch  # noqa: E402

# Our kernels are hand-scheduled loads and stores that mask their own tails (per 16-byte vector):
# TileLang's per-element bound checks would split every vector access into scalar ones. Warp
# specialization is not used by these memory-bound kernels.
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
    tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
}


# TileLang's simplifier asks the Z3 SMT solver about every comparison its own rules cannot settle
# (TVM's Analyzer::CanProve), each query with a fixed budget of solver steps. In our kernels
# almost none of these is provable: runtime sizes, strides and shift amounts (bit-vector terms
# once TileLang translates ``>>``, ``&`` and ``<<``) keep the solver searching until the budget
# runs out, and that search was one to three quarters of a kernel's lowering time (the CI
# compile test lowers every registered configuration). Z3's integer-blasting bit-vector solver
# with its older arithmetic solver gives up on the same queries 2-5x sooner: lowering all 261
# configurations took a third of the CPU time. Every registered configuration but one lowers to
# byte-identical CUDA with and without these settings (checked when they were introduced), and the
# factory of that one keeps Z3's arithmetic solver (``jit(solver=...)``). They are Z3 process-wide
# parameters, read when a solver is created, so ``lowering_solver`` sets them only while one of
# our kernels lowers.
FAST_SOLVER = {"smt.arith.solver": "2", "smt.bv.solver": "2"}
_solver_condition = threading.Condition()
_solver_users = 0
_solver_active: dict[str, str] | None = None
_solver_saved: dict[str, str] = {}


@contextmanager
def lowering_solver(settings: dict[str, str] = FAST_SOLVER) -> Iterator[None]:
    """Inside, Z3 runs with ``settings``. Lowerings under the same settings overlap; one under
    other settings waits until they are done. The previous values come back when the last user
    leaves (TileLang code outside tileproof keeps its own settings)."""
    global _solver_users, _solver_active
    import z3  # a TileLang dependency (its simplifier's prover)

    with _solver_condition:
        while _solver_users and _solver_active != settings:
            _solver_condition.wait()
        if not _solver_users:
            _solver_saved.clear()
            for name, value in settings.items():
                _solver_saved[name] = z3.get_param(name)
                z3.set_param(name, value)
            _solver_active = dict(settings)
        _solver_users += 1
    try:
        yield
    finally:
        with _solver_condition:
            _solver_users -= 1
            if not _solver_users:
                for name, value in _solver_saved.items():
                    z3.set_param(name, value)
                _solver_active = None
                _solver_condition.notify_all()


def _arch_of_current_gpu() -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    if major == 9:
        return "sm_90a"
    if major == 10:
        return "sm_100a"
    return f"sm_{major}{minor}"


@cache
def compile_target() -> dict:
    """The TileLang target dict every kernel factory compiles for."""
    configured = os.environ.get("TILEPROOF_TARGET", "").strip()
    if configured.startswith("{"):
        return json.loads(configured)
    arch = configured or _arch_of_current_gpu() or "sm_90a"
    return {"kind": "cuda", "arch": arch}


def jit(solver: dict[str, str] = FAST_SOLVER, pass_configs: dict | None = None, **kwargs):
    """``tilelang.jit`` with the project's target and pass configuration (``pass_configs`` overrides
    entries of ``PASS_CONFIGS`` for one factory); its kernels lower with Z3 under ``solver`` (see
    ``FAST_SOLVER``). The factory it returns compiles (or loads from TileLang's cache) on call,
    except inside ``batched_device_compile``."""
    configs = {**PASS_CONFIGS, **(pass_configs or {})}

    def decorate(factory):
        compiler = tilelang.jit(target=compile_target(), pass_configs=configs, **kwargs)(factory)
        return KernelFactory(compiler, f"{factory.__module__}.{factory.__qualname__}", solver, configs)

    return decorate


_first_calls: dict[tuple, float] = {}
_first_calls_lock = threading.Lock()


def kernel_first_calls() -> dict[str, float]:
    """Wall seconds of each kernel configuration's first call in this process, by
    ``module.factory(static arguments)``: a TileLang build when the kernel cache was cold, else a
    load from it. Calls made concurrently (the oracle's compile threads) include their waits for
    one another: TileLang's lowering holds the GIL."""
    with _first_calls_lock:
        calls = dict(_first_calls)
    names = {}
    for key, seconds in calls.items():
        arguments = ", ".join([*map(repr, key[1]), *(f"{k}={v!r}" for k, v in (key[2] if len(key) > 2 else ()))])
        names[f"{key[0]}({arguments})"] = seconds
    return names


# Every kernel takes its tensors as flat spans bound to int32 ``T.dynamic`` sizes and indexes them
# with int32 element offsets (64-bit offsets cost registers and address arithmetic in every kernel).
# A tensor with more elements would make TileLang's host stub truncate its size to 32 bits and the
# kernel read or write the wrong memory: it is refused before the launch instead.
MAX_KERNEL_TENSOR_ELEMENTS = 2**31 - 1


class DirectLaunch:
    """A compiled kernel, called straight through its TVM FFI function.

    TileLang's per-call adapter stitches the argument list and allocates ``out_idx`` outputs in a
    Python loop over every parameter (a few µs per launch); our kernels allocate nothing (their
    launchers pass every output), so the adapter has nothing to add and the call goes to the
    executable it would reach. The executable's own argument checks (count, ndim, dtype, shapes)
    still run. Anything else (attributes, kernels that do allocate outputs, a TileLang without
    this adapter) goes through the kernel object unchanged.

    Every launch passes through here, so this is where the 32-bit size limit is enforced: a tensor
    argument with more than ``MAX_KERNEL_TENSOR_ELEMENTS`` elements raises ``ValueError`` naming
    the kernel's parameter, before anything runs."""

    __slots__ = ("kernel", "_call", "_tensor_positions")

    def __init__(self, kernel):
        self.kernel = kernel
        self._call = None  # found at the first launch: loading the executable needs a GPU
        self._tensor_positions = None  # the buffer parameters' positions, from the first launch

    def __call__(self, *args):
        positions = self._tensor_positions
        if positions is None:
            positions = self._tensor_positions = tuple(
                position for position, arg in enumerate(args) if isinstance(arg, torch.Tensor)
            )
        for position in positions:
            if args[position].numel() > MAX_KERNEL_TENSOR_ELEMENTS:
                raise ValueError(self._too_large_message(position, args[position]))
        call = self._call
        if call is None:
            call = self._call = self._find_call()
        return call(*args)

    def _find_call(self):
        adapter = getattr(self.kernel, "adapter", None)
        get_executable = getattr(adapter, "_get_executable", None)
        if get_executable is None or getattr(adapter, "result_idx", None):
            return self.kernel
        executable = get_executable()
        # ``Executable.__call__`` is ``self.jit().main(*args)``: a module lookup per launch (about
        # 0.7 µs on the H200's host) for the same function every time.
        jit_module = getattr(executable, "jit", None)
        main = getattr(jit_module(), "main", None) if callable(jit_module) else None
        return main if callable(main) else executable

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def _too_large_message(self, position: int, tensor: torch.Tensor) -> str:
        name = f"argument {position}"
        try:
            program = self.kernel.prim_func
            parameter = program.params[position]
            name = program.buffer_map[parameter].name if parameter in program.buffer_map else parameter.name
        except (AttributeError, IndexError, KeyError, TypeError):
            pass
        return (
            f"{name} spans {tensor.numel()} elements as the kernel reads it; tileproof's kernels index "
            f"with 32-bit offsets, so each tensor they read or write may span at most {MAX_KERNEL_TENSOR_ELEMENTS} "
            "(2**31 - 1) elements: split the call (e.g. over tokens)"
        )


class KernelFactory:
    """A ``tilelang.jit`` kernel factory (its attributes are the wrapped one's) that defers the
    device compile while a ``batched_device_compile`` is active."""

    def __init__(
        self, compiler, qualified_name: str, solver: dict[str, str] = FAST_SOLVER, pass_configs: dict | None = None
    ):
        self._compiler = compiler
        self.solver = solver
        self.pass_configs = PASS_CONFIGS if pass_configs is None else pass_configs
        # The factory's own module and name: kernel configurations are keyed by it (TileLang's
        # wrapper names every factory "kernel", so two factories with the same static arguments
        # would share a key).
        self.qualified_name = qualified_name
        self.__name__ = qualified_name.rsplit(".", 1)[-1]
        self.__doc__ = getattr(compiler, "__doc__", None)
        self.__wrapped__ = compiler
        # Per factory object, not per name: a reloaded module (the mutation self-test) builds its own.
        self._launches: dict[tuple, DirectLaunch] = {}

    def __call__(self, *args, **kwargs):
        if outputs_only_active():
            return _UnlaunchableKernel(f"{self.qualified_name}{args}")
        batch = _batch
        if batch is not None and compiling_only():
            return batch.lower(self, args, kwargs)
        key = (self.qualified_name, args, tuple(sorted(kwargs.items()))) if kwargs else (self.qualified_name, args)
        launch = self._launches.get(key)
        if launch is not None:
            return launch
        if capturing():
            raise RuntimeError(
                f"{self.qualified_name}{args}: first call of this kernel configuration inside a CUDA-graph "
                "capture; building or loading a kernel cannot be captured. Call the operator once with "
                "the same configuration before capturing, or warm the cache with `tileproof precompile`."
            )
        started = time.perf_counter()
        with lowering_solver(self.solver):
            kernel = self._compiler(*args, **kwargs)
        with _first_calls_lock:
            _first_calls.setdefault(key, time.perf_counter() - started)
            launch = self._launches.setdefault(key, DirectLaunch(kernel))
        return launch

    def __getattr__(self, name):
        return getattr(self._compiler, name)


def gpu_available() -> bool:
    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# Hooks for the oracle: compile without launching, and poisoned outputs
# ---------------------------------------------------------------------------------------------

_state = threading.local()


@contextmanager
def compile_only():
    """Inside this context an optimized op validates its arguments and compiles (or loads from
    the cache) every kernel the call needs, then returns its unwritten outputs without launching.
    Inputs may live on the CPU. This is how a machine without a GPU proves that kernels build."""
    previous = getattr(_state, "compile_only", False)
    _state.compile_only = True
    try:
        yield
    finally:
        _state.compile_only = previous


def compiling_only() -> bool:
    return getattr(_state, "compile_only", False)


@contextmanager
def outputs_only():
    """Inside this context an optimized op validates its arguments, allocates its outputs on the
    inputs' device and returns them unwritten, as under ``compile_only``, but builds no kernel: the
    factories hand back unlaunchable stand-ins. Inputs may be meta tensors, so this is the op's
    shape function (what a fake-tensor implementation needs): it shares every line of the launcher
    up to the launch, so it cannot drift from the real outputs' shapes, dtypes and strides."""
    previous = getattr(_state, "compile_only", False), getattr(_state, "outputs_only", False)
    _state.compile_only = _state.outputs_only = True
    try:
        yield
    finally:
        _state.compile_only, _state.outputs_only = previous


def outputs_only_active() -> bool:
    return getattr(_state, "outputs_only", False)


def address(tensor: torch.Tensor) -> int:
    """The tensor's data address, for the launchers' alignment choices; 0 (every alignment) under
    ``outputs_only``, whose fake and meta tensors have none (and whose outputs do not depend on it)."""
    return 0 if outputs_only_active() else tensor.data_ptr()


@contextmanager
def poison_outputs():
    """Inside this context every output an optimized op allocates starts filled with 0xFF bytes
    (NaN for floats and e4m3, -1 for integers), so an element the kernel never wrote shows up."""
    previous = getattr(_state, "poison", False)
    _state.poison = True
    try:
        yield
    finally:
        _state.poison = previous


def new_output(tensor: torch.Tensor) -> torch.Tensor:
    """Launchers pass each freshly allocated output through here (poisoning it when asked)."""
    if getattr(_state, "poison", False) and tensor.numel() > 0:
        flat_view(tensor).view(torch.uint8).fill_(0xFF)
    return tensor


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view from the tensor's first element to its last. Kernels take tensors flat, with
    their strides as runtime scalars counted in vectors, which lets TileLang prove alignment."""
    # The common case without the span arithmetic (host time per launch). One element may carry any
    # stride, which view(-1) keeps: the as_strided path gives it the unit stride a kernel buffer has.
    if tensor.numel() > 1 and tensor.is_contiguous():
        return tensor.view(-1)
    if tensor.numel() == 0:
        return tensor.reshape(0)
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.as_strided((span,), (1,))


# ---------------------------------------------------------------------------------------------
# Launch plans: what a launcher decides once per call signature
# ---------------------------------------------------------------------------------------------

# Plans kept per launcher before its cache starts over (a caller whose shapes never repeat, e.g. a
# token count that grows by one per decode step, must not grow memory without bound).
PLANS_PER_LAUNCHER = 256


def tensor_signature(tensor: torch.Tensor) -> tuple:
    """What a launcher's decisions may read off a tensor: shape, strides, dtype, device and the
    address modulo 16 bytes (the widest vector a kernel loads). Real tensors only (a fake one has
    no address)."""
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.data_ptr() % 16)


def call_signature(*arguments) -> tuple:
    """A launch-plan key: each tensor argument by ``tensor_signature``, every other argument by its
    type and value (1, 1.0 and True are equal in Python, but the argument checks tell them apart), a
    float by its exact bits (-0.0 == 0.0 in Python, but ``rsqrt(0 + eps)`` tells them apart).
    Tensors inside containers are not allowed (a key would hold them alive): launchers take those
    apart first."""
    return tuple([_argument_signature(a) for a in arguments])


def _argument_signature(argument) -> tuple:
    if isinstance(argument, torch.Tensor):
        return tensor_signature(argument)
    if argument.__class__ is float:
        return (float, argument.hex())
    return (argument.__class__, argument)


class LaunchPlans:
    """The launch plans of one launcher, by call signature.

    Most of a warm launch's host time is Python that depends only on the call's signature: the
    contract's argument checks, the kernel configuration, vector widths, grid and scalar arguments.
    A launcher splits into a *plan function*, which makes those checks and decisions for the
    arguments it is given and returns the plan (a function of the call's tensors that allocates the
    outputs, launches and returns the results), and a thin entry point that asks
    ``LaunchPlans(plan_function).plan(*arguments)`` for the plan of its arguments: the one kept for
    their ``call_signature``, else a new one. The entry point passes every argument the plan
    function reads, so a new signature runs every check, and a plan is only ever reused by calls
    that would pass the same checks and make the same decisions. While compiling only (stand-in
    kernels, fake tensors) plans are made afresh and never kept; an unhashable argument (a list
    where a tuple is expected) is planned afresh too, so that its check reports it. Module state the
    plan function reads is frozen into the plan: a schedule that a sweep replaces between calls is
    passed as an argument (the SwiGLU forward passes its ``FORWARD_SCHEDULE`` entry, the grid-sized
    launchers ``TILEPROOF_SM_LIMIT``), or the sweep calls ``clear()``."""

    __slots__ = ("_make", "_plans")

    def __init__(self, make: Callable[..., Callable]):
        self._make = make
        self._plans: dict[tuple, Callable] = {}

    def plan(self, *arguments) -> Callable:
        """The plan for these arguments: kept for their signature, or made now (and kept unless
        compiling only)."""
        if compiling_only():
            return self._make(*arguments)
        key = call_signature(*arguments)
        try:
            plan = self._plans.get(key)
        except TypeError:
            return self._make(*arguments)
        if plan is None:
            plan = self._make(*arguments)
            if len(self._plans) >= PLANS_PER_LAUNCHER:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()


def launched(kernel):
    """A plan's kernel: the kernel, or None while compiling only (the plan then allocates its
    outputs and returns them unwritten)."""
    return None if compiling_only() else kernel


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_constants: dict[tuple, torch.Tensor] = {}
_constants_lock = threading.Lock()


def device_constant(dtype: torch.dtype, device: torch.device, value: float = 0, numel: int = 4) -> torch.Tensor:
    """A read-only ``[numel]`` tensor filled with ``value``, made once per device, dtype, value and
    size: what a launcher passes for an absent optional tensor (the kernel's flag for it is off, or
    it has no element to touch) or for a constant operand.

    A fresh ``torch.zeros`` per call is a fill kernel per call: ~1.5 µs of GPU time each, counted in
    the operator's own kernel time, plus a launch and an allocation on the host. Kernels only read
    these tensors (or not at all), so one per device serves every stream. Inside a CUDA-graph
    capture a missing constant cannot be made (its fill would only run on replay): that raises,
    like a cold kernel, and the operator's first call outside the capture makes it. While compiling
    only (and under ``outputs_only``, whose inputs may be fake or meta tensors) nothing launches and
    nothing is kept: a fresh tensor, so that no fake tensor lands in the cache."""
    if compiling_only():
        return torch.full((numel,), value, dtype=dtype, device=device)
    tensor = _constants.get((device, dtype, value, numel))  # a tensor's own device: the common call
    if tensor is not None:
        return tensor
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype, value, numel)
    tensor = _constants.get(key)
    if tensor is None:
        if device.type == "cuda" and capturing():
            raise RuntimeError(
                f"a {dtype} constant on {device} is first needed inside a CUDA-graph capture, which cannot fill it; "
                "call the operator once on this device before capturing"
            )
        with _constants_lock:
            tensor = _constants.setdefault(key, torch.full((numel,), value, dtype=dtype, device=device))
    return tensor


def require_cuda(name: str, tensor: torch.Tensor) -> None:
    """Optimized ops run on CUDA tensors only (except under ``compile_only``)."""
    if tensor.device.type != "cuda" and not compiling_only():
        raise ValueError(f"{name} must be a CUDA tensor for the optimized kernels, got device {tensor.device}")


# ---------------------------------------------------------------------------------------------
# Compile checks on a machine without a GPU: many kernels per nvcc call
# ---------------------------------------------------------------------------------------------
#
# A CPU machine only proves that kernels build; it never launches one. Half of a kernel's compile
# time there is nvcc parsing the same TileLang/CUTLASS headers (about 127k lines) for every kernel,
# so ``batched_device_compile`` lowers each kernel with TileLang as its JIT does, then compiles the
# generated CUDA of many kernels in one nvcc call with TileLang's own device-compile function
# (same flags, same sm_90a cubin target). A batch that fails is compiled again kernel by kernel,
# so that every error names its kernel and batching can neither hide nor invent one. Nothing is
# written to TileLang's kernel cache (there is no host module to run); a marker per kernel (the
# hash of its TileLang program, target, pass configuration, TileLang and nvcc versions) lets a
# later check skip kernels that already built.

_batch: DeviceCompileBatch | None = None
_batch_lock = threading.Lock()
UNTAGGED = "(kernels lowered outside DeviceCompileBatch.run)"
_KERNEL_NAME = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")
# A dynamic shared-memory array (``extern __shared__ __align__(1024) int exchange[];``): declared inside
# an ``extern "C"`` kernel it has C linkage, so it is one entity in every namespace of the file.
_EXTERN_SHARED_NAME = re.compile(r"\bextern\s+__shared__\b[^;\[]*?\b(\w+)\s*\[\s*\]")
BATCH_LIMIT = 32  # kernels per nvcc call: the headers are paid once, the cubin stays small


class _UnlaunchableKernel:
    """What a factory returns while the device compile is deferred: launching it is a bug."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: a stand-in built for a compile or shape check only; not launchable")


class DeviceCompileBatch:
    """The kernels lowered so far (their CUDA source, by key) and which tag (a case label) needed
    which kernel; ``compile`` runs nvcc over them and returns the errors per tag."""

    def __init__(self, marker_dir: Path, claim_dir: Path | None = None):
        self.marker_dir = marker_dir
        # Batches in sibling processes share this folder: a kernel is lowered by the first batch
        # to claim it, the others only note that their cases need it (merged by ``absorb``).
        self.claim_dir = claim_dir
        self._lock = threading.Lock()
        self._local = threading.local()
        self._sources: dict[tuple, str] = {}  # kernel key -> CUDA source still to compile
        self._fingerprints: dict[tuple, str] = {}
        self._errors: dict[tuple, str | None] = {}  # kernel key -> error (None: it built)
        self._tags: dict[str, list[tuple]] = {}

    def run(self, tag: str, work: Callable[[], object]):
        """``work()`` with the kernels it lowers recorded under ``tag``."""
        self._local.tag = tag
        try:
            return work()
        finally:
            self._local.tag = None

    def lower(self, factory: KernelFactory, args: tuple, kwargs: dict) -> _UnlaunchableKernel:
        key = (factory.qualified_name, args, tuple(sorted(kwargs.items())))
        tag = getattr(self._local, "tag", None) or UNTAGGED
        with self._lock:
            self._tags.setdefault(tag, []).append(key)
            known = key in self._errors or key in self._sources
        if not known and not self._claim(key):
            return _UnlaunchableKernel(factory.qualified_name)
        if not known:
            try:
                with lowering_solver(factory.solver):
                    program = factory.get_tir(*args, **kwargs)
                    fingerprint = _fingerprint(program, factory.solver, factory.pass_configs)
                    if (self.marker_dir / fingerprint).exists():
                        source = None
                    else:
                        target = tilelang.tvm.target.Target(compile_target())
                        with tilelang.tvm.transform.PassContext(opt_level=3, config=factory.pass_configs), target:
                            source = tilelang.lower(program, target=target).kernel_source
            except Exception as error:
                # Kept per kernel too: another process's cases that need it fail with it after ``absorb``.
                with self._lock:
                    self._errors[key] = f"{type(error).__name__}: {error}"[:4000]
                raise
            with self._lock:
                if source is None:
                    self._errors[key] = None
                elif key not in self._errors:
                    self._sources[key] = source
                    self._fingerprints[key] = fingerprint
        return _UnlaunchableKernel(factory.qualified_name)

    def _claim(self, key: tuple) -> bool:
        """Whether this batch lowers ``key``: always without a claim folder, else only if no sibling
        batch claimed it first (an exclusive create is atomic across processes)."""
        if self.claim_dir is None:
            return True
        claim = self.claim_dir / hashlib.sha256(repr(key).encode()).hexdigest()
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def export(self) -> dict:
        """What this batch has learnt (picklable): for a batch in another process to ``absorb``."""
        with self._lock:
            return {
                "sources": dict(self._sources),
                "fingerprints": dict(self._fingerprints),
                "errors": dict(self._errors),
                "tags": {tag: list(keys) for tag, keys in self._tags.items()},
            }

    def absorb(self, state: dict) -> None:
        """Merge another batch's ``export``: its kernels are then known here (not lowered again)."""
        with self._lock:
            self._errors.update(state["errors"])
            for key, source in state["sources"].items():
                if key not in self._errors:
                    self._sources[key] = source
            self._fingerprints.update(state["fingerprints"])
            for tag, keys in state["tags"].items():
                self._tags.setdefault(tag, []).extend(keys)

    def compile(self, workers: int) -> dict[str, str]:
        """nvcc over every kernel lowered and not yet compiled; the first error of each tag."""
        with self._lock:
            pending = list(self._sources.items())
            self._sources.clear()
        if pending:
            size = max(1, min(BATCH_LIMIT, -(-len(pending) // max(1, workers))))
            batches = [pending[i : i + size] for i in range(0, len(pending), size)]
            with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tileproof-nvcc") as pool:
                for errors in pool.map(self._compile_batch, batches):
                    with self._lock:
                        self._errors.update(errors)
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        for key, error in self._errors.items():
            if error is None and key in self._fingerprints:
                (self.marker_dir / self._fingerprints[key]).touch()
        failures = {}
        for tag, keys in self._tags.items():
            error = next((self._errors.get(key) for key in keys if self._errors.get(key)), None)
            if error:
                failures[tag] = error
        return failures

    def _compile_batch(self, batch: list[tuple[tuple, str]]) -> dict[tuple, str | None]:
        if len(batch) > 1 and _device_compile_error(_translation_unit([source for _, source in batch])) is None:
            return {key: None for key, _ in batch}
        return {key: _device_compile_error(_translation_unit([source])) for key, source in batch}


@contextmanager
def batched_device_compile(
    marker_dir: Path | None = None, claim_dir: Path | None = None
) -> Iterator[DeviceCompileBatch]:
    """Inside, ``compile_only`` calls lower their kernels and defer nvcc to ``batch.compile``.
    Meant for machines without a GPU (the kernels are never loaded), one batch at a time per
    process; batches in sibling processes that share ``claim_dir`` lower each kernel once."""
    global _batch
    directory = marker_dir or Path(os.environ["TILELANG_CACHE_DIR"]) / "tileproof-device-checked"
    with _batch_lock:
        if _batch is not None:
            raise RuntimeError("batched_device_compile is already active")
        _batch = DeviceCompileBatch(directory, claim_dir)
    try:
        yield _batch
    finally:
        _batch = None


def _translation_unit(sources: list[str]) -> str:
    """The kernels' sources in one file: each source's leading preprocessor lines (its includes)
    first, then its code in a namespace of its own (file-scope helpers of two kernels may share a
    name), with its ``extern "C"`` kernels and their dynamic shared-memory arrays renamed: their
    names are global in any namespace, and two kernels with an ``exchange`` array of different
    element types would fail the whole batch (then compiled again kernel by kernel: 3 s a kernel
    instead of a fraction of a second). The renaming is textual, whole identifiers in the code only:
    a macro would also rewrite CUDA's own macros (``__shared__`` expands to an attribute named
    ``shared``). A name that a header also defines would fail the batch, never hide an error."""
    parts = []
    for index, source in enumerate(sources):
        lines = source.splitlines()
        prelude = 0
        while prelude < len(lines) and (not lines[prelude].strip() or lines[prelude].lstrip().startswith("#")):
            prelude += 1
        code = "\n".join(lines[prelude:])
        names = sorted(set(_KERNEL_NAME.findall(code)) | set(_EXTERN_SHARED_NAME.findall(code)))
        if names:
            name = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
            code = name.sub(rf"\1_tileproof_{index}", code)
        parts += [*lines[:prelude], f"namespace tileproof_kernel_{index} {{", code, "}"]
    return "\n".join(parts)


def _device_compile_error(code: str) -> str | None:
    from tilelang.cuda.backend import tilelang_callback_cuda_compile

    try:
        tilelang_callback_cuda_compile(code, tilelang.tvm.target.Target(compile_target()), PASS_CONFIGS)
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        return text if len(text) <= 4000 else text[:2000] + " … " + text[-2000:]
    return None


def _fingerprint(program, solver: dict[str, str], pass_configs: dict) -> str:
    parts = [
        program.script(show_meta=True),
        json.dumps(compile_target(), sort_keys=True),
        repr(sorted((str(k), repr(v)) for k, v in pass_configs.items())),
        repr(sorted(solver.items())),
        _z3_version(),
        tilelang.__version__,
        _nvcc_version(),
    ]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


@cache
def _z3_version() -> str:
    import z3

    return z3.get_version_string()


@cache
def _nvcc_version() -> str:
    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    try:
        return subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "no nvcc"
