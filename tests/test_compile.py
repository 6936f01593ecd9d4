"""Every kernel configuration the oracle registers compiles for sm_90a, on any machine.

A CPU machine cannot launch a kernel, but TileLang lowers and compiles it to a cubin without a
GPU; this is what keeps a kernel that no longer builds from landing. The kernel cache lives inside
the checkout (``.tilelang-cache``, set by conftest), so repeated runs are fast.
"""

import re

import pytest
import torch

from tileproof.optimized.jit import compile_target
from tileproof.oracle.runner import compile_all


@pytest.mark.compile
def test_every_registered_kernel_configuration_compiles():
    """The quick tier's configurations, which include every one the full tier builds (checked
    kernel by kernel in tests/test_oracle.py::test_quick_and_full_need_the_same_kernel_configurations)."""
    failures = compile_all("quick")
    details = "\n".join(f"{failure.label}: {failure.error}" for failure in failures[:10])
    assert not failures, f"{len(failures)} configurations failed to compile:\n{details}"


def test_kernels_target_hopper_without_a_gpu():
    target = compile_target()
    assert target["kind"] == "cuda"
    assert target["arch"] in ("sm_90a", "sm_100a") or target["arch"].startswith("sm_")


def _copy_kernel_factory(extern: str):
    """A one-line elementwise kernel; ``extern`` names a device function it calls ("" for none)."""
    import tilelang.language as T

    from tileproof.optimized.jit import jit

    @jit()
    def copy_kernel(call_extern: str):
        n = T.dynamic("n")

        @T.prim_func
        def kernel(source: T.Tensor((n,), "float32"), target: T.Tensor((n,), "float32")):
            with T.Kernel(T.ceildiv(n, 128), threads=128) as (block,):
                index = block * 128 + T.get_thread_binding()
                if index < n:
                    if call_extern:
                        target[index] = T.call_extern("float32", call_extern, source[index])
                    else:
                        target[index] = source[index]

        return kernel

    return copy_kernel


@pytest.mark.compile
def test_batched_device_compile_names_the_kernel_that_fails(tmp_path):
    """Many kernels per nvcc call: a kernel whose CUDA does not compile fails its own tag only (the
    failing batch is compiled again kernel by kernel), and kernels that built are not compiled again."""
    from tileproof.optimized.jit import batched_device_compile, compile_only

    factory = _copy_kernel_factory("")
    with batched_device_compile(tmp_path) as batch, compile_only():
        batch.run("good", lambda: factory(""))
        batch.run("bad", lambda: factory("no_such_device_function"))
        batch.run("good again", lambda: factory(""))
    failures = batch.compile(workers=1)
    assert set(failures) == {"bad"}
    assert "no_such_device_function" in failures["bad"]
    assert len(list(tmp_path.iterdir())) == 1  # one marker: the kernel that built

    with batched_device_compile(tmp_path) as again, compile_only():
        again.run("good", lambda: factory(""))
    assert not again._sources  # known from its marker: nothing left to compile
    assert again.compile(workers=1) == {}


def _exchange_kernel_factory(name: str, dtype: str):
    """A kernel with one dynamic shared-memory array named ``exchange`` of ``dtype`` elements."""
    import tilelang.language as T

    from tileproof.optimized.jit import jit

    def exchange_kernel():
        n = T.dynamic("n")

        @T.prim_func
        def kernel(source: T.Tensor((n,), dtype), target: T.Tensor((n,), dtype)):
            with T.Kernel(T.ceildiv(n, 128), threads=128) as (block,):
                exchange = T.alloc_shared((128,), dtype)
                tx = T.get_thread_binding()
                if block * 128 + tx < n:
                    exchange[tx] = source[block * 128 + tx]
                T.sync_threads()
                if block * 128 + tx < n:
                    target[block * 128 + tx] = exchange[127 - tx]

        return kernel

    exchange_kernel.__qualname__ = name
    return jit()(exchange_kernel)


@pytest.mark.compile
def test_kernels_with_same_named_shared_arrays_compile_in_one_nvcc_call(tmp_path, monkeypatch):
    """A dynamic shared-memory array declared in an ``extern "C"`` kernel is one entity across the
    namespaces of a file: two kernels' ``exchange`` arrays of different element types would fail
    their batch, which would then be compiled kernel by kernel (an nvcc call each)."""
    from tileproof.optimized import jit

    calls = []
    compile_error = jit._device_compile_error
    monkeypatch.setattr(jit, "_device_compile_error", lambda code: calls.append(code) or compile_error(code))
    words = _exchange_kernel_factory("int_exchange", "int32")
    floats = _exchange_kernel_factory("float_exchange", "float32")
    with jit.batched_device_compile(tmp_path) as batch, jit.compile_only():
        batch.run("int", lambda: words())
        batch.run("float", lambda: floats())
    assert all("extern __shared__" in source for source in batch._sources.values())
    assert batch.compile(workers=1) == {}
    assert len(calls) == 1  # one nvcc call for both: the batch did not fail


@pytest.mark.compile
def test_lowering_processes_report_every_case_and_build_the_kernels(tmp_path, monkeypatch):
    """Without a GPU the first wave of a compile pass is lowered in worker processes (TileLang holds
    the GIL); each case still gets its own result, and the kernels they lowered reach nvcc."""
    import torch

    from tileproof.oracle import registry, runner

    if torch.cuda.is_available():
        pytest.skip("with a GPU kernels are compiled one by one in the caller")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))  # no markers yet: everything is lowered
    cases = registry.select_cases("quick", ["transpose"])
    results = runner.compile_pass(cases, workers=2)
    assert set(results) == {case.label for case in cases} and not any(results.values())
    assert len(list((tmp_path / "tileproof-device-checked").iterdir())) >= 2  # built, marked by the parent


def _negate_kernel_factory():
    """A kernel with the same static arguments as ``_copy_kernel_factory``'s and another body."""
    import tilelang.language as T

    from tileproof.optimized.jit import jit

    @jit()
    def negate_kernel(call_extern: str):
        n = T.dynamic("n")

        @T.prim_func
        def kernel(source: T.Tensor((n,), "float32"), target: T.Tensor((n,), "float32")):
            with T.Kernel(T.ceildiv(n, 128), threads=128) as (block,):
                index = block * 128 + T.get_thread_binding()
                if index < n:
                    target[index] = -source[index]

        return kernel

    return negate_kernel


@pytest.mark.compile
def test_batched_device_compile_keeps_factories_with_equal_arguments_apart(tmp_path):
    """Kernel configurations are keyed by the factory's own module and name: two factories called
    with the same static arguments are two kernels (TileLang names every factory "kernel")."""
    from tileproof.optimized.jit import batched_device_compile, compile_only

    copy, negate = _copy_kernel_factory(""), _negate_kernel_factory()
    assert copy.qualified_name != negate.qualified_name
    with batched_device_compile(tmp_path) as batch, compile_only():
        batch.run("copy", lambda: copy(""))
        batch.run("negate", lambda: negate(""))
    assert len(batch._sources) == 2


@pytest.mark.compile
def test_sibling_batches_lower_each_kernel_once_and_share_its_outcome(tmp_path, monkeypatch):
    """Lowering processes claim kernels in a shared folder: the second batch to need a kernel does
    not lower it, and after merging, its cases get the kernel's outcome (built, or the error)."""
    from tileproof.optimized import jit

    claims = tmp_path / "claims"
    claims.mkdir()
    first, second = (jit.DeviceCompileBatch(tmp_path / "markers", claims) for _ in range(2))
    copy, negate = _copy_kernel_factory(""), _negate_kernel_factory()
    with jit.compile_only():
        first.run("first copy", lambda: first.lower(copy, ("",), {}))
        second.run("second copy", lambda: second.lower(copy, ("",), {}))
        assert len(first._sources) == 1 and not second._sources  # lowered once, by the first claim

        def broken_lowering(*args, **kwargs):
            raise RuntimeError("lowering broke")

        monkeypatch.setattr(jit.tilelang, "lower", broken_lowering)
        with pytest.raises(RuntimeError, match="lowering broke"):
            second.run("second negate", lambda: second.lower(negate, ("",), {}))
        first.run("first negate", lambda: first.lower(negate, ("",), {}))  # claimed by the second
    merged = jit.DeviceCompileBatch(tmp_path / "markers")
    merged.absorb(first.export())
    merged.absorb(second.export())
    failures = merged.compile(workers=1)
    assert set(failures) == {"first negate", "second negate"}
    assert all("lowering broke" in error for error in failures.values())


def test_kernels_lower_with_their_solver_settings_and_the_previous_settings_come_back():
    """Z3's parameters are process-wide: a factory's settings hold while its kernel lowers (also
    when lowerings overlap) and the previous values come back after the last one (TileLang code
    outside tileproof keeps its own settings)."""
    import z3

    from tileproof.optimized import jit

    names = sorted(jit.FAST_SOLVER)

    def settings():
        return {name: z3.get_param(name) for name in names}

    before = settings()
    assert before != jit.FAST_SOLVER  # Z3's defaults: the test would prove nothing otherwise
    seen = []
    factory = jit.KernelFactory(lambda *args: seen.append(settings()) or "kernel", "tests.solver_stand_in")
    factory(1)
    assert seen == [jit.FAST_SOLVER] and settings() == before
    with jit.lowering_solver():
        with jit.lowering_solver():
            pass
        assert settings() == jit.FAST_SOLVER  # another lowering is still under way
    assert settings() == before


def test_a_lowering_under_other_solver_settings_waits_for_the_running_ones():
    import threading

    import z3

    from tileproof.optimized import jit

    other = {"smt.bv.solver": "2"}
    other_started, seen = threading.Event(), []

    def other_lowering():
        other_started.set()
        with jit.lowering_solver(other):
            seen.append(z3.get_param("smt.arith.solver"))

    with jit.lowering_solver():
        waiter = threading.Thread(target=other_lowering)
        waiter.start()
        assert other_started.wait(10)
        waiter.join(0.5)
        assert waiter.is_alive() and not seen  # it waits: its solvers would get the fast settings
    waiter.join(10)
    assert seen == [z3.get_param("smt.arith.solver")] != [jit.FAST_SOLVER["smt.arith.solver"]]


def test_first_calls_of_kernel_configurations_are_timed_once():
    from tileproof.optimized import jit

    calls = []
    factory = jit.KernelFactory(lambda *args, **kwargs: calls.append(args) or "kernel", "tests.stand_in_kernel")
    first = factory(3, vector=8)
    assert factory(3, vector=8) is first and first.kernel == "kernel" and len(calls) == 1  # built once
    factory(4)
    first_calls = jit.kernel_first_calls()
    assert {"tests.stand_in_kernel(3, vector=8)", "tests.stand_in_kernel(4)"} <= set(first_calls)
    assert all(seconds >= 0 for seconds in first_calls.values())
    with jit.outputs_only():
        stand_in = factory(5)
    assert len(calls) == 2 and "tests.stand_in_kernel(5)" not in jit.kernel_first_calls()
    with pytest.raises(RuntimeError, match="not launchable"):
        stand_in()


def test_direct_launch_calls_the_executable_of_kernels_that_allocate_nothing():
    """Kernels without TileLang-allocated outputs are called through their FFI executable (found
    at the first launch, not before: loading it needs a GPU); others through the kernel object."""
    from types import SimpleNamespace

    from tileproof.optimized import jit

    calls = []

    class Kernel:
        def __init__(self, result_idx):
            executable = lambda *args: calls.append(("executable", args))  # noqa: E731
            self.adapter = SimpleNamespace(result_idx=result_idx, _get_executable=lambda: executable)
            self.name = "stand-in"

        def __call__(self, *args):
            calls.append(("adapter", args))

    direct, allocating = jit.DirectLaunch(Kernel([])), jit.DirectLaunch(Kernel([2]))
    assert direct.name == "stand-in" and not calls  # attributes pass through; nothing loaded yet
    direct(1, 2)
    allocating(3)
    assert calls == [("executable", (1, 2)), ("adapter", (3,))]


def test_direct_launch_calls_the_main_function_of_a_tvm_executable_once_found():
    """TVM's ``Executable.__call__`` looks ``main`` up in its jitted module on every call: the
    launch finds it once and calls it straight (same function, same arguments)."""
    from types import SimpleNamespace

    from tileproof.optimized import jit

    calls, lookups = [], []

    class Executable:
        def jit(self):
            lookups.append("jit")
            return SimpleNamespace(main=lambda *args: calls.append(("main", args)))

        def __call__(self, *args):
            calls.append(("executable", args))

    executable = Executable()
    kernel = SimpleNamespace(adapter=SimpleNamespace(result_idx=None, _get_executable=lambda: executable))
    launch = jit.DirectLaunch(kernel)
    launch(1, 2)
    launch(3)
    assert calls == [("main", (1, 2)), ("main", (3,))] and lookups == ["jit"]


def test_a_cold_kernel_inside_a_cuda_graph_capture_says_how_to_warm_it(monkeypatch):
    import torch

    from tileproof.optimized import jit

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    factory = jit.KernelFactory(lambda *args: "kernel", "tests.capture_stand_in")
    assert factory(1).kernel == "kernel"  # warm before the capture
    capturing[0] = True
    assert factory(1).kernel == "kernel"  # a warm configuration launches inside the capture
    with pytest.raises(RuntimeError, match="tileproof precompile"):
        factory(2)


def test_flat_view_spans_first_to_last_element_with_unit_stride():
    import torch

    from tileproof.optimized.jit import flat_view

    base = torch.arange(24, dtype=torch.int32)
    contiguous = base[4:16].view(3, 4)
    strided = base.view(4, 6)[1:, :3]  # rows of 3 elements, 6 apart
    lonely = torch.empty_strided((1, 1), (1, 4), dtype=torch.int32)  # "contiguous", any strides
    for tensor, span in ((contiguous, 12), (strided, 15), (lonely, 1), (base[:0], 0)):
        flat = flat_view(tensor)
        assert flat.shape == (span,) and (span == 0 or flat.stride() == (1,))
        assert flat.data_ptr() == tensor.data_ptr() or span == 0
    assert flat_view(strided)[-1] == strided[-1, -1]


def test_device_constants_are_made_once_and_refused_inside_a_capture(monkeypatch):
    """``device_constant``: one read-only tensor per device, dtype, value and size (a launcher's absent
    tensors cost no fill kernel per call); inside a CUDA-graph capture a missing one raises instead of
    recording a fill that would only run on replay."""
    from tileproof.optimized import jit

    zeros = jit.device_constant(torch.int64, torch.device("cpu"))
    assert zeros is jit.device_constant(torch.int64, "cpu")
    assert zeros.dtype == torch.int64 and zeros.shape == (4,) and not zeros.any()
    ones = jit.device_constant(torch.float32, "cpu", value=1, numel=1)
    assert ones is not jit.device_constant(torch.float32, "cpu") and ones.tolist() == [1.0]
    assert jit.device_constant(torch.float8_e4m3fn, "cpu").view(torch.uint8).tolist() == [0, 0, 0, 0]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        jit.device_constant(torch.float32, torch.device("cuda", 0), value=2.5)
    assert jit.device_constant(torch.int64, "cpu") is zeros  # CPU tensors are never captured


def _norm_fn_pipelined_kernels():
    from tileproof.optimized import mhc_norm

    # The head's 4 mixes (where the H200 showed the race) and the layers' 24, each schedule in use.
    return {
        "grad m4": lambda: mhc_norm.norm_fn_grad_mma_kernel(16, 4, **mhc_norm.GRAD_MMA_SCHEDULE),
        "grad m24 addend": lambda: mhc_norm.norm_fn_grad_mma_kernel(
            32, 24, **mhc_norm.GRAD_MMA_ADDEND_SCHEDULE, accumulate=True
        ),
        "grad m4 addend": lambda: mhc_norm.norm_fn_grad_mma_kernel(
            16, 4, **mhc_norm.GRAD_MMA_ADDEND_SCHEDULE, accumulate=True
        ),
        "grad m24 addend loads": lambda: mhc_norm.norm_fn_grad_mma_kernel(
            32, 24, **mhc_norm.GRAD_MMA_ADDEND_LOADS_SCHEDULE, accumulate=True
        ),
        "statistics m4": lambda: mhc_norm.norm_fn_mma_kernel(16, mhc_norm.MMA_DEPTH, mhc_norm.MMA_STAGES),
        "statistics m24": lambda: mhc_norm.norm_fn_mma_kernel(48, mhc_norm.MMA_DEPTH, mhc_norm.MMA_STAGES),
    }


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(_norm_fn_pipelined_kernels()))
def test_pipelined_tiles_go_back_to_the_tma_producer_after_a_proxy_fence(name):
    """The norm-fn kernels' threads read TMA-filled tiles with plain loads; the barrier arrival that
    hands a tile back to the producer must come after every such access and after a proxy fence
    (without it the H200 gave nondeterministic dx). The x tile is released by
    ``release_after_thread_reads`` (fence, dead read, arrival); the addend's tile, which dx then
    leaves through, by its TMA store: the threads' writes, a fence, the bulk store, its read wait,
    the arrival. This checks the order in the generated CUDA, so that a TileLang that places the
    arrival differently fails here."""
    source = _norm_fn_pipelined_kernels()[name]().kernel.get_kernel_source()
    lines = [line.strip() for line in source.splitlines()]
    fences = [index for index, line in enumerate(lines) if line == "tl::fence_proxy_async();"]

    def dead_read(line: str, tile: str) -> bool:
        return re.match(rf"sink\w*\[0\] = \(\((bfloat16_t|float)\*\){tile}\)", line) is not None

    def accesses(tile: str) -> list[int]:
        """Lines where the threads load or store the tile (not the dead read, not TMA)."""
        return [
            index
            for index, line in enumerate(lines)
            if re.search(rf"\(\((bfloat16_t|float)\*\){tile}\)", line)
            and not dead_read(line, tile)
            and "tma_" not in line
        ]

    fenced = [index for index in fences if any(dead_read(line, "x_shared") for line in lines[index + 1 : index + 5])]
    assert len(fenced) == 1, f"{name}: no proxy fence followed by the dead read of x_shared"
    fence = fenced[0]
    read = next(i for i in range(fence + 1, fence + 5) if dead_read(lines[i], "x_shared"))
    assert lines[read + 1].startswith("mbarrier[") and lines[read + 1].endswith("].arrive();"), lines[read + 1]
    reads = accesses("x_shared")
    assert reads and max(reads) < fence, f"{name}: a plain read of x_shared after its fence"

    if "*)addend_shared)" not in source:
        return
    stores = [
        index for index, line in enumerate(lines) if line.startswith("tl::tma_store(") and "addend_shared" in line
    ]
    assert stores, f"{name}: dx does not leave through the addend's tile"
    # Each writing thread's fence, before the barrier after which one thread issues the store (the
    # fence TileLang adds in that thread alone, after the barrier, is not the one checked here).
    last_write = max(accesses("addend_shared"))
    barrier = next(i for i in range(last_write, stores[0]) if "sync_thread" in lines[i] or "syncthreads" in lines[i])
    assert any(last_write < index < barrier for index in fences), f"{name}: no fence between dx's writes and the store"
    wait = next(i for i in range(stores[-1], len(lines)) if lines[i].startswith("tl::tma_store_wait<0, true>"))
    arrive = next(i for i in range(wait, len(lines)) if lines[i].endswith("].arrive();"))
    assert all(line in ("}", "tl::tma_store_arrive();") for line in lines[stores[-1] + 1 : wait]), "store to wait"
    assert all(line == "}" for line in lines[wait + 1 : arrive]), f"{name}: the addend's arrival is not after the wait"
