"""Every optimized operator computes its outputs on meta tensors: under ``outputs_only`` a launcher
validates its arguments, allocates its outputs on the inputs' device and returns them without
building or launching a kernel. That is the shape function a fake-tensor implementation needs
(``torch.compile``, ``torch.library.register_fake``); it runs the launcher's own lines up to the
launch, so it cannot drift from what the kernels return.

For each quick case of the oracle: the optimized op on meta inputs (same shapes, dtypes, strides)
returns outputs of the shapes and dtypes the reference returns for the case on the CPU, with the
same strides (of dimensions longer than 1, as the oracle's bitwise policy compares them), and
without reading any input value (a meta tensor has none: a read-back would raise, and it would also
be a host synchronization that breaks CUDA-graph capture).

Every such operator is also ``torch.ops.tileproof.<name>`` (``tileproof.optimized.library``), and
each quick case runs through it under ``FakeTensorMode``, its arguments mapped onto the adapter's
signature where the operator is registered through one.
"""

import pytest
import torch

from tileproof.optimized.jit import compiling_only, outputs_only
from tileproof.oracle import registry
from tileproof.oracle.modeling import Driven

META, CPU = torch.device("meta"), torch.device("cpu")

# Outputs sized by the input values, from one documented host read-back: a meta call cannot size
# them, so only their dtype and rank are compared.
VALUE_SIZED = {"get_fused_mapping": lambda case: case.params.expanded == "sync"}


def _cases():
    for op in registry.all_ops().values():
        if op.optimized() is not None:
            yield from (pytest.param(op, case, id=case.label) for case in op.cases("quick"))


def _long_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1)


def _compare(output, wanted, where: str, value_sized: bool = False, device: torch.device = META) -> None:
    if isinstance(wanted, (tuple, list)):
        assert isinstance(output, (tuple, list)), where
        if value_sized and isinstance(wanted, list):
            return  # a host list of per-expert sizes: its length is a value
        assert len(output) == len(wanted), where
        for index, (part, wanted_part) in enumerate(zip(output, wanted, strict=True)):
            _compare(part, wanted_part, f"{where}[{index}]", value_sized, device)
    elif isinstance(wanted, torch.Tensor):
        assert isinstance(output, torch.Tensor) and output.device.type == device.type, where
        assert (output.dtype, output.dim()) == (wanted.dtype, wanted.dim()), where
        if not value_sized:
            assert output.shape == wanted.shape, where
            if wanted.numel():
                assert _long_strides(output) == _long_strides(wanted), (where, output.stride(), wanted.stride())
    else:
        assert output == wanted, where


def _finished(result):
    """A layer driver's result with its outputs built (``Driven.finish``), any other result as it is."""
    return result.finish() if isinstance(result, Driven) else result


@pytest.mark.parametrize("op,case", list(_cases()))
def test_outputs_on_meta_tensors_match_the_reference(op, case):
    with outputs_only():
        assert compiling_only()
        output = _finished(op.build(case, META, None)(op.optimized()))
    generator = torch.Generator().manual_seed(registry.case_seed(0, case.label))
    wanted = _finished(op.build(case, CPU, generator)(op.reference()))
    _compare(output, wanted, "result", VALUE_SIZED.get(op.name, lambda case: False)(case))


def _registered_cases():
    from tileproof.optimized import library

    for name in [*library.OPERATORS, *library.ADAPTED]:
        op = registry.get_op(name)
        yield from (pytest.param(op, case, id=case.label) for case in op.cases("quick"))


def _fake(value, mode, device: torch.device):
    """``value`` with each tensor replaced by a fake tensor on ``device`` of its shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        with mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
    if isinstance(value, (tuple, list)):
        return type(value)(_fake(item, mode, device) for item in value)
    if isinstance(value, dict):
        return {key: _fake(item, mode, device) for key, item in value.items()}
    return value


def _schema(name: str) -> torch.FunctionSchema:
    return getattr(torch.ops.tileproof, name).default._schema


def _custom_op_arguments(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A case's launcher arguments as ``torch.ops.tileproof.<name>`` takes them (the mappings the
    adapters of ``tileproof.optimized.library`` document): a ``(data, sf)`` pair ``x`` becomes
    ``x, x_sf`` in its place where the op always takes a pair (its second argument is ``x_sf``), else
    ``x`` and the keyword ``x_sf``; get_fused_mapping's op is the no-sync form, without
    ``force_no_sync``. Block-size tuples pass as they are: the dispatcher takes them for int lists."""
    if name == "get_fused_mapping":
        args, kwargs = args[:4], {key: value for key, value in kwargs.items() if key != "force_no_sync"}
    if args and isinstance(args[0], tuple):
        (data, sf), rest = args[0], args[1:]
        if _schema(name).arguments[1].name == "x_sf":
            return (data, sf, *rest), kwargs
        return (data, *rest), {**kwargs, "x_sf": sf}
    return args, kwargs


def _as_custom_op_result(name: str, wanted):
    """The reference's result, as the oracle's twin returns it, in the form the op returns."""
    if name in ("top2_sum_gate", "swiglu_forward_and_per_token_cast"):
        return wanted[:2]  # the oracle appends the buffer the op writes in place (and pos_to_expert)
    if name == "get_fused_mapping":
        return wanted[:7]  # the host list of sizes is not an output of the no-sync form
    if name == "swiglu_backward_and_per_token_cast":
        out, (dx_q, dx_sf), dx, dweight = wanted
        return out, dx_q, dx_sf, dx, dweight
    if name == "mhc_pre_norm_fn" and isinstance(wanted, torch.Tensor):
        return wanted, torch.empty(0, dtype=torch.float32)  # the op's statistics slot without save_statistics
    if name in ("engram_gate_fwd", "mhc_pre_norm_fn_bwd"):
        return tuple(torch.empty(0, dtype=torch.float32) if part is None else part for part in wanted)
    return wanted


def _custom_op_on_fakes(op, case, device: torch.device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    call = op.build(case, CPU, None)
    args, kwargs = _custom_op_arguments(op.name, _fake(call.args, mode, device), _fake(call.kwargs, mode, device))
    with mode:
        return getattr(torch.ops.tileproof, op.name)(*args, **kwargs)


@pytest.mark.parametrize("op,case", list(_registered_cases()))
def test_custom_ops_propagate_fake_cuda_tensors(op, case):
    """``torch.ops.tileproof.<name>`` under ``FakeTensorMode`` (what torch.compile traces with),
    on fake CUDA tensors, which need no GPU: the reference's output shapes, dtypes and strides."""
    device = torch.device("cuda")
    output = _custom_op_on_fakes(op, case, device)
    if not _schema(op.name).returns:  # writes into its arguments only
        assert output is None
        return
    generator = torch.Generator().manual_seed(registry.case_seed(0, case.label))
    wanted = _as_custom_op_result(op.name, op.build(case, CPU, generator)(op.reference()))
    value_sized = VALUE_SIZED.get(op.name, lambda case: False)(case)
    _compare(output, wanted, "result", value_sized, device)


def test_every_public_operator_is_registered():
    """Every operator with an optimized twin is ``torch.ops.tileproof.<name>``, registered once,
    as it is or through an adapter. The modeling layers compose these operators and are not ones."""
    from tileproof.optimized import library

    assert set(library.OPERATORS).isdisjoint(library.ADAPTED)
    optimized_ops = {
        name for name, op in registry.all_ops().items() if op.optimized() is not None and op.family != "modeling"
    }
    missing = sorted(name for name in optimized_ops if not hasattr(torch.ops.tileproof, name))
    assert not missing, f"not in torch.ops.tileproof: {missing}"
    assert set(library.OPERATORS) | set(library.ADAPTED) == optimized_ops


def test_outputs_only_builds_no_kernel(monkeypatch):
    """TileLang's JIT is not reached: making it fail on any call changes nothing."""
    from tileproof.optimized import mhc

    jit_class = type(mhc.sinkhorn_kernel.__wrapped__)
    monkeypatch.setattr(jit_class, "__call__", lambda *args, **kwargs: pytest.fail("a kernel was built"))

    comb = torch.empty((7, 4, 4), device=META)
    with outputs_only():
        out = mhc.sinkhorn_normalize(comb, repeat=20)
    assert out.shape == (7, 4, 4) and out.device == META


def _symbolic_fake(value, mode):
    """``value`` with each tensor a fake CUDA tensor whose sizes are all symbolic (what
    ``torch.compile(dynamic=True)`` traces with), strides those of a contiguous tensor of the
    sizes or the input's own where it is not contiguous."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    if isinstance(value, torch.Tensor):
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * value.dim())
        real = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return mode.from_tensor(real, symbolic_context=context)
    if isinstance(value, (tuple, list)):
        return type(value)(_symbolic_fake(item, mode) for item in value)
    if isinstance(value, dict):
        return {key: _symbolic_fake(item, mode) for key, item in value.items()}
    return value


def _dynamic_cases():
    for op, case in ((param.values[0], param.values[1]) for param in _registered_cases()):
        if case.label in {c.label for c in op.cases("quick")[:3]}:
            yield pytest.param(op, case, id=case.label)


@pytest.mark.parametrize("op,case", list(_dynamic_cases()))
def test_custom_ops_propagate_symbolic_sizes(op, case):
    """The fake implementations with every size symbolic (``torch.compile(dynamic=True)``, opcheck's
    ``test_aot_dispatch_dynamic``): they may guard on sizes, but must not need them as Python ints
    (a memoized schedule keyed by a size cannot hash a SymInt); outputs of the reference's dtypes
    and ranks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    call = op.build(case, CPU, None)
    args, kwargs = _custom_op_arguments(op.name, _symbolic_fake(call.args, mode), _symbolic_fake(call.kwargs, mode))
    with mode:
        output = getattr(torch.ops.tileproof, op.name)(*args, **kwargs)
    if not _schema(op.name).returns:
        assert output is None
        return
    generator = torch.Generator().manual_seed(registry.case_seed(0, case.label))
    wanted = _as_custom_op_result(op.name, op.build(case, CPU, generator)(op.reference()))
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    wanted = wanted if isinstance(wanted, (tuple, list)) else (wanted,)
    for index, (part, wanted_part) in enumerate(zip(outputs, wanted, strict=False)):
        if isinstance(wanted_part, torch.Tensor):
            assert (part.dtype, part.dim()) == (wanted_part.dtype, wanted_part.dim()), f"result[{index}]"
