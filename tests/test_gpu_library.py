"""GPU: the optimized operators under PyTorch's tooling (issue 8).

The case of an operator is its first quick oracle case whose tensors are all non-empty (tokens > 0),
for get_fused_mapping in a no-sync form.

- ``torch.library.opcheck`` passes for ``torch.ops.tileproof.<name>`` on the case of every
  registered operator (schema and declared mutations, fake implementation against the real outputs,
  AOTAutograd with dynamic shapes); NaN inputs are zeroed first (opcheck's comparison has NaN ≠ NaN).
- CUDA-graph capture and replay of every operator, as its launcher and as its custom operator: after
  one eager call (which builds or loads the kernels), the call is captured into a
  ``torch.cuda.CUDAGraph`` (on the side stream ``torch.cuda.graph`` captures on) and replayed; the
  outputs and every argument afterwards (in-place operators write there) equal, bit for bit, an eager
  call on the same inputs. A second replay on other inputs, copied into the captured ones, equals the
  eager call on those: the graph reads its inputs and bakes no value in. Not capturable, so expected
  to fail and not run: ``per_block_cast_lossless``, which reads a device status back on every call.
- ``torch.compile(fullgraph=True)`` (Inductor) of a small model made of every optimized layer
  (``layers_model`` of ``tests/test_optimized_compile.py``, which proves on the CPU that it compiles
  without a graph break): outputs, every gradient (``main_grad`` included) and the no-grad path agree
  with the same model in eager mode.
- A kernel configuration's first call inside a capture raises the ``RuntimeError`` that points to
  ``tileproof precompile``, and the capture ends cleanly.
"""

import copy
import functools
import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

from tileproof.oracle import registry
from tileproof.oracle.policy import same_bytes

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
META = torch.device("meta")


def _sibling(name: str):
    """The test module ``name`` next to this one, loaded by path (pytest imports test modules with
    ``--import-mode=importlib``: they are not importable by name)."""
    spec = importlib.util.spec_from_file_location(f"_tileproof_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shapes = _sibling("test_optimized_shapes")  # a case's call mapped onto the custom operator's signature
compile_cpu = _sibling("test_optimized_compile")  # the model
gpu_modeling = _sibling("test_gpu_modeling")  # its tolerance


def _registered() -> list[str]:
    from tileproof.optimized import library

    return [*library.OPERATORS, *library.ADAPTED]


NAMES = _registered()


@functools.cache
def _quick_case(name: str) -> registry.Case:
    """The first quick case of ``name`` in which every tensor is non-empty (tokens > 0); for
    get_fused_mapping not the synchronizing form, whose outputs are sized by a host read-back of
    values (it cannot be captured, and its custom operator is the no-sync form only)."""
    op = registry.get_op(name)
    for case in op.cases("quick"):
        if name == "get_fused_mapping" and case.params.expanded == "sync":
            continue
        if all(tensor.numel() > 0 for tensor in op.build(case, META, None).tensors()):
            return case
    raise LookupError(f"{name}: no quick case with non-empty tensors")


def _build(name: str, seed_index: int = 0) -> registry.Call:
    op, case = registry.get_op(name), _quick_case(name)
    generator = torch.Generator().manual_seed(registry.case_seed(seed_index, case.label))
    return op.build(case, DEVICE, generator)


def _custom_op_call(name: str):
    """``torch.ops.tileproof.<name>`` taking a case's launcher arguments."""
    operator = getattr(torch.ops.tileproof, name)

    def call(*args, **kwargs):
        args, kwargs = shapes._custom_op_arguments(name, tuple(args), dict(kwargs))
        return operator(*args, **kwargs)

    return call


def _same(actual, wanted, where: str) -> None:
    """Equal structure, and tensors of the same dtype, shape and bits (NaN payloads included)."""
    if isinstance(wanted, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and same_bytes(actual, wanted), where
    elif isinstance(wanted, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(wanted), where
        for index, (part, wanted_part) in enumerate(zip(actual, wanted, strict=True)):
            _same(part, wanted_part, f"{where}[{index}]")
    else:
        assert actual == wanted, where


# ---------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------


def _without_nan(call: registry.Call) -> None:
    """NaN → 0 in the floating arguments, in place: opcheck compares eager and AOTAutograd outputs
    with ``assert_close``, for which NaN ≠ NaN (the oracle's inputs carry NaN on purpose, e.g. the
    raw rows expand_to_fused_with_sf copies)."""
    for tensor in call.tensors():
        if tensor.is_floating_point() and tensor.numel():
            values = tensor.float()
            nan = values.isnan()
            if nan.any():
                tensor.copy_(values.masked_fill(nan, 0.0).to(tensor.dtype))


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture
def float8_allclose(monkeypatch):
    """opcheck's ``test_schema`` (``SchemaCheckMode``) tells a mutated argument by
    ``torch.allclose(before, after, equal_nan=True)``, which has no float8 kernel (its tolerance
    arithmetic multiplies in the argument's dtype): float8 arguments are compared by their bits."""
    allclose = torch.allclose

    def patched(a, b, *args, **kwargs):
        return same_bytes(a, b) if a.dtype in FLOAT8 else allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", patched)


@pytest.mark.parametrize("name", NAMES)
def test_opcheck(name, float8_allclose):
    call = _build(name)
    _without_nan(call)
    args, kwargs = shapes._custom_op_arguments(name, tuple(call.args), dict(call.kwargs))
    torch.library.opcheck(getattr(torch.ops.tileproof, name).default, args, kwargs)


# ---------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------

NOT_CAPTURABLE = {
    "per_block_cast_lossless": "synchronizes with the host on every call, by design: the launcher reads its "
    "device status back to raise the reference's ValueError for a value e4m3 cannot hold "
    "(optimized/quant/lossless.py); a read-back cannot be captured",
}


def _copy_arguments(into: registry.Call, source: registry.Call) -> None:
    """``source``'s argument values into ``into``'s tensors (same case: same structure and layouts)."""
    leaves, spec = pytree.tree_flatten((into.args, into.kwargs))
    source_leaves, source_spec = pytree.tree_flatten((source.args, source.kwargs))
    assert spec == source_spec
    for leaf, source_leaf in zip(leaves, source_leaves, strict=True):
        if isinstance(leaf, torch.Tensor):
            leaf.copy_(source_leaf)
        else:
            assert leaf == source_leaf, "the case's non-tensor arguments depend on the seed"


@pytest.mark.parametrize("via", ("launcher", "custom op"))
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(run=False, reason=NOT_CAPTURABLE[name]))
        if name in NOT_CAPTURABLE
        else name
        for name in NAMES
    ],
)
def test_cuda_graph_capture_and_replay(name, via):
    function = registry.get_op(name).optimized() if via == "launcher" else _custom_op_call(name)
    label = _quick_case(name).label
    eager = [_build(name, seed_index) for seed_index in (0, 1)]
    wanted = [call(function) for call in eager]  # the first call builds or loads the kernels
    torch.cuda.synchronize()

    captured_call = _build(name, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on a side stream
        captured = captured_call(function)

    for seed_index in (0, 1):
        if seed_index:
            _copy_arguments(captured_call, _build(name, seed_index))
        graph.replay()
        torch.cuda.synchronize()
        where = f"{label} ({via}), replay on seed {seed_index}"
        _same(captured, wanted[seed_index], f"{where}: result")
        _same(captured_call.tensors(), eager[seed_index].tensors(), f"{where}: arguments after the call")


def test_a_cold_kernel_inside_a_capture_names_tileproof_precompile(monkeypatch):
    """A configuration this process has not called yet is refused inside a capture, before anything
    the capture cannot hold (building or loading a kernel), so the capture itself ends cleanly."""
    from tileproof.optimized import jit
    from tileproof.optimized import transpose as transpose_module
    from tileproof.optimized.transpose import transpose

    x = torch.randn(65, 130, device=DEVICE).to(torch.bfloat16)
    wanted = transpose(x)
    # As in a fresh process: no configuration called yet (each factory keeps its launches, each
    # launcher its plans, which hold their kernels).
    for value in vars(transpose_module).values():
        if isinstance(value, jit.KernelFactory):
            monkeypatch.setattr(value, "_launches", {})
        if isinstance(value, jit.LaunchPlans):
            monkeypatch.setattr(value, "_plans", {})
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="`tileproof precompile`") as raised:
        with torch.cuda.graph(graph):
            transpose(x)
    assert "first call of this kernel configuration inside a CUDA-graph capture" in str(raised.value)
    assert not torch.cuda.is_current_stream_capturing()
    _same(transpose(x), wanted, "an eager call after the refused capture")  # which warms the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = transpose(x)
    graph.replay()
    _same(out, wanted, "the capture after the warm call")


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------

HIDDEN = 256
TOKENS = (4, 32)
# The compiled model runs the same kernels; Inductor's own code for the rest (linear layers, SiLU,
# embedding backward, cross-entropy) rounds bf16 elsewhere. The bound is the toy's training-curve
# bound of tests/test_gpu_modeling.py, here on the relative norm of each output's difference.
RTOL = gpu_modeling.TRAINING_CURVE_RTOL


def _randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    """mHC coefficients off their start (fn = 0 makes the mixes constant and dnorm_weight 0)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".fn"):
                noise = torch.randn(parameter.shape, generator=generator) * 0.5 / parameter.shape[1] ** 0.5
                parameter.copy_(noise)
            elif name.endswith((".base", ".norm_weight", "gate.weight_hidden", "gate.weight_embed")):
                parameter.add_(0.25 * torch.randn(parameter.shape, generator=generator).to(parameter.device))


def _close(actual: torch.Tensor, wanted: torch.Tensor, where: str) -> None:
    assert actual.shape == wanted.shape and actual.dtype == wanted.dtype, where
    wanted_norm = wanted.double().norm()
    assert wanted_norm > 0, f"{where}: degenerate (zero) in eager mode"
    error = float((actual.double() - wanted.double()).norm() / wanted_norm)
    assert error <= RTOL, f"{where}: relative error {error:.3g} > {RTOL}"


def _train_step(model, forward, tokens, previous, target):
    logits = forward(tokens, previous)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()
    gain = model.gate.weight_hidden
    assert gain.grad is None, "a gain with main_grad gets no .grad"
    grads = {name: parameter.grad for name, parameter in model.named_parameters() if parameter is not gain}
    return logits.detach(), {**grads, "gate.weight_hidden.main_grad": gain.main_grad}


def test_compiled_layers_match_eager(generator):
    from tileproof.optimized import modeling

    torch._dynamo.reset()
    with torch.device(DEVICE):
        eager_model = compile_cpu.layers_model(modeling, hidden=HIDDEN)
    _randomize(eager_model, generator)
    compiled_model = copy.deepcopy(eager_model)
    for model in (eager_model, compiled_model):
        model.gate.weight_hidden.main_grad = torch.zeros(compile_cpu.N, HIDDEN, device=DEVICE)
    compiled = torch.compile(compiled_model, fullgraph=True)  # a graph break raises

    tokens = torch.randint(0, compile_cpu.VOCAB, TOKENS, generator=generator).to(DEVICE)
    previous = tokens.roll(1, dims=1)
    target = (tokens + previous) % compile_cpu.VOCAB
    logits, grads = _train_step(eager_model, eager_model, tokens, previous, target)
    compiled_logits, compiled_grads = _train_step(compiled_model, compiled, tokens, previous, target)
    _close(compiled_logits, logits, "logits")
    assert compiled_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert compiled_grads[name] is not None, name
        _close(compiled_grads[name], grad, f"gradient of {name}")

    with torch.no_grad():  # mhc_pre's inference kernel, in a second graph
        _close(compiled(tokens, previous), eager_model(tokens, previous), "no-grad logits")
    torch._dynamo.reset()


def test_a_gather_through_pos_to_token_is_captured():
    """``per_channel_cast_fused``'s range check of ``pos_to_token`` reads the indices back, which a
    capture cannot hold: inside a capture it is skipped, and the kernel takes an index past x's rows
    as a zero row (never a read out of bounds). Outside a capture the same index is a ValueError."""
    from tileproof.optimized.quant.channel import per_channel_cast_fused

    op = registry.get_op("per_channel_cast_fused")
    case = next(case for case in op.cases("quick") if "/P200/" in case.label)
    call = op.build(case, DEVICE, torch.Generator().manual_seed(registry.case_seed(0, case.label)))
    wanted = call(per_channel_cast_fused)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(per_channel_cast_fused)
    graph.replay()
    torch.cuda.synchronize()
    _same(captured, wanted, "replay of the captured gather")

    pos_to_token = call.kwargs["pos_to_token"]
    source_rows = call.args[0].shape[0]
    valid = pos_to_token.clone()
    pos_to_token.copy_(torch.where(torch.arange(pos_to_token.numel(), device=DEVICE) == 0, source_rows, valid))
    with pytest.raises(ValueError, match="pos_to_token must hold row indices"):
        per_channel_cast_fused(*call.args, **call.kwargs)
    graph.replay()  # the captured call reads the same pos_to_token tensor, now with row 0 out of range
    pos_to_token.copy_(torch.where(torch.arange(pos_to_token.numel(), device=DEVICE) == 0, -1, valid))
    _same(captured, call(per_channel_cast_fused), "an index past x's rows as a zero row")


# Launchers that fill a tensor on every call by design.
FILLS_BY_DESIGN = {
    "per_block_cast_lossless": "its status words start at NO_POSITION (torch.full): the kernel reports the first "
    "value e4m3 cannot hold there",
}


@pytest.mark.parametrize("name", NAMES)
def test_no_fill_kernel_per_call(name):
    """A warm call launches no PyTorch fill kernel (``torch.zeros`` / ``torch.ones`` / ``fill_``): each
    costs ~1–1.5 µs of GPU time, counted in the operator's kernel time (the SwiGLU forward once made
    three per call, 2 µs of its 50). Absent tensors are ``device_constant``s instead."""
    from tileproof.oracle.timing import gpu_activities

    if name in FILLS_BY_DESIGN:
        pytest.skip(FILLS_BY_DESIGN[name])
    call = _build(name)
    function = registry.get_op(name).optimized()
    call(function)
    torch.cuda.synchronize()
    fills = [activity for _, _, activity in gpu_activities(lambda: call(function)) if "FillFunctor" in activity]
    assert not fills, f"{name}: {len(fills)} fill kernel(s) per call: {fills[0][:120]}"
