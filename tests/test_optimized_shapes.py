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
"""

import pytest
import torch

from tileproof.optimized.jit import compiling_only, outputs_only
from tileproof.oracle import registry

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


@pytest.mark.parametrize("op,case", list(_cases()))
def test_outputs_on_meta_tensors_match_the_reference(op, case):
    with outputs_only():
        assert compiling_only()
        output = op.build(case, META, None)(op.optimized())
    generator = torch.Generator().manual_seed(registry.case_seed(0, case.label))
    wanted = op.build(case, CPU, generator)(op.reference())
    _compare(output, wanted, "result", VALUE_SIZED.get(op.name, lambda case: False)(case))


def _registered_cases():
    from tileproof.optimized import library

    for name in library.OPERATORS:
        op = registry.get_op(name)
        yield from (pytest.param(op, case, id=case.label) for case in op.cases("quick"))


def _fake_cuda(value, mode):
    """``value`` with each tensor replaced by a fake CUDA tensor of its shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        with mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda")
    if isinstance(value, (tuple, list)):
        return type(value)(_fake_cuda(item, mode) for item in value)
    return value


@pytest.mark.parametrize("op,case", list(_registered_cases()))
def test_custom_ops_propagate_fake_cuda_tensors(op, case):
    """``torch.ops.tileproof.<name>`` under ``FakeTensorMode`` (what torch.compile traces with),
    on fake CUDA tensors, which need no GPU: the reference's output shapes, dtypes and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tileproof.optimized import library

    mode = FakeTensorMode()
    call = op.build(case, CPU, None)
    args, kwargs = _fake_cuda(call.args, mode), _fake_cuda(call.kwargs, mode)
    with mode:
        output = getattr(torch.ops.tileproof, op.name)(*args, **kwargs)
    if library.OPERATORS[op.name][1]:  # writes into its arguments: the schema returns nothing
        assert output is None
        return
    generator = torch.Generator().manual_seed(registry.case_seed(0, case.label))
    wanted = op.build(case, CPU, generator)(op.reference())
    _compare(output, wanted, "result", device=torch.device("cuda"))


def test_unregistered_operators_say_why():
    from tileproof.optimized import library

    assert set(library.OPERATORS).isdisjoint(library.NOT_YET)
    optimized_ops = {name for name, op in registry.all_ops().items() if op.optimized() is not None}
    layers = {name for name, op in registry.all_ops().items() if op.family == "modeling"}
    assert set(library.OPERATORS) | set(library.NOT_YET) == optimized_ops - layers


def test_outputs_only_builds_no_kernel(monkeypatch):
    """TileLang's JIT is not reached: making it fail on any call changes nothing."""
    from tileproof.optimized import mhc

    jit_class = type(mhc.sinkhorn_kernel.__wrapped__)
    monkeypatch.setattr(jit_class, "__call__", lambda *args, **kwargs: pytest.fail("a kernel was built"))

    comb = torch.empty((7, 4, 4), device=META)
    with outputs_only():
        out = mhc.sinkhorn_normalize(comb, repeat=20)
    assert out.shape == (7, 4, 4) and out.device == META
