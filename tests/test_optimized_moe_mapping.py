"""CPU tests of the optimized MoE index bookkeeping (``tileproof.optimized.moe.mapping``).

Without a GPU the kernels cannot run (their results are compared with the reference on the H200
by ``tests/test_gpu_moe_mapping.py``). What is checked here: every malformed argument is refused
exactly as the reference refuses it (same exception type, same message); index *values* are not
read on the host (that is the device's job, so the mapping needs no synchronisation); the constants
the kernels share with the reference hold; and, marked ``compile``, every kernel configuration the
GPU tests use compiles for sm_90a.
"""

import contextlib
import re

import pytest
import torch

from tileproof.reference import moe as reference

IDX = torch.tensor([[0, 3], [1, -1], [2, 2]])


def _mapping():
    from tileproof.optimized.moe import mapping

    return mapping


BAD_CALLS = [
    ("normalize_weight", ([[0.5, 0.5]],)),
    ("normalize_weight", (torch.ones(3, 2, dtype=torch.float64),)),
    ("normalize_weight", (torch.ones(6),)),
    ("group_count", (IDX.float(), 4)),
    ("group_count", (IDX.to(torch.int16), 4)),
    ("group_count", (IDX[0], 4)),
    ("group_count", (IDX, 0)),
    ("group_count", (IDX, 4.0)),
    ("group_count", (IDX, True)),
    ("aux_fi", (IDX, 0, 2)),
    ("aux_fi", (IDX, 4, 0)),
    ("aux_fi", (IDX, 4, "2")),
    ("mask_indices_by_tp", (IDX, 0, 1, 0, 1)),
    ("mask_indices_by_tp", (IDX, 16, 0, 0, 1)),
    ("mask_indices_by_tp", (IDX, 16, 8, 0, 0)),
    ("mask_indices_by_tp", (IDX, 16, 8, 2, 2)),
    ("mask_indices_by_tp", (IDX, 16, 8, -1, 2)),
    ("mask_indices_by_tp", (IDX, 10, 4, 0, 1)),
    ("inplace_unique_group_indices", (IDX.double(), 4)),
    ("inplace_unique_group_indices", (IDX, 0)),
    ("get_fused_mapping", (IDX, 0, 0, 4)),
    ("get_fused_mapping", (IDX, 4, -1, 4)),
    ("get_fused_mapping", (IDX, 4, 0, 0)),
    ("get_fused_mapping", (IDX, 4, 0, 4, 1)),
    ("get_fused_mapping", (IDX.unsqueeze(0), 4, 0, 4)),
]


@pytest.mark.parametrize("name,args", BAD_CALLS, ids=[f"{name}-{i}" for i, (name, _) in enumerate(BAD_CALLS)])
def test_arguments_are_refused_like_the_reference(name, args):
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(reference, name)(*args)
    with pytest.raises(expected.type, match=re.escape(str(expected.value))):
        getattr(_mapping(), name)(*args)


OUT_OF_RANGE_CALLS = [
    ("group_count", (torch.tensor([[0, 9]]), 4)),
    ("aux_fi", (torch.tensor([[0, -2]]), 4, 2)),
    ("mask_indices_by_tp", (torch.tensor([[0, 99]]), 16, 8, 0, 2)),
    ("inplace_unique_group_indices", (torch.tensor([[5, 5]]), 4)),
    ("get_fused_mapping", (torch.tensor([[0, 4]]), 4, 0, 4)),
    ("get_fused_mapping", (torch.tensor([[0, 1], [2, 3]]), 4, 3, 4)),  # num_expanded_tokens < 16
]


@pytest.mark.parametrize("name,args", OUT_OF_RANGE_CALLS, ids=[name for name, _ in OUT_OF_RANGE_CALLS])
def test_values_are_checked_on_the_device_not_the_host(name, args):
    """The reference reads the values back and raises; the optimized twin gets as far as asking for a
    CUDA tensor: nothing before the launch looks at the values (the kernels device-assert them)."""
    with pytest.raises(ValueError, match="entries must be|num_expanded_tokens must be"):
        getattr(reference, name)(*args)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        getattr(_mapping(), name)(*args)


def test_kernel_constants_match_the_reference():
    mapping = _mapping()
    epsilon = torch.full((1,), reference.WEIGHT_EPSILON, dtype=torch.float32)
    assert epsilon.view(torch.int32).item() == mapping.WEIGHT_EPSILON_BITS
    assert mapping.EXPERT_TILE % mapping.MAP_THREADS == 0
    assert [mapping.row_vector(k) for k in (1, 2, 3, 4, 6, 8, 9, 12)] == [1, 2, 1, 4, 2, 4, 1, 4]
    chunk = mapping.MAP_THREADS * mapping.MAP_ROUNDS
    assert mapping._chunks(0) == 1 and mapping._chunks(chunk) == 1 and mapping._chunks(chunk + 1) == 2


@pytest.mark.compile
def test_every_kernel_configuration_of_the_gpu_tests_compiles():
    """One compile-only call per static configuration (k for normalize_weight, the index dtype for the
    rest), on uninitialised CPU tensors: this is all the GPU tests (and the oracle) compile."""
    from tileproof.optimized.jit import batched_device_compile, compile_only

    mapping = _mapping()
    with contextlib.ExitStack() as stack:
        # Without a GPU the device code of all of them goes through a few nvcc calls (see jit.py).
        batch = None if torch.cuda.is_available() else stack.enter_context(batched_device_compile())
        stack.enter_context(compile_only())
        for topk in (1, 2, 6, 8, 9):
            mapping.normalize_weight(torch.empty((5, topk)))
        for dtype in (torch.int32, torch.int64):
            idx = torch.empty((5, 8), dtype=dtype)
            mapping.aux_fi(idx, 16, 8)
            mapping.group_count(idx, 8)
            mapping.mask_indices_by_tp(idx, 64, 8, 0, 2)
            mapping.inplace_unique_group_indices(idx, 8)
            for size, no_sync in ((0, False), (0, True), (4096, False)):
                outputs = mapping.get_fused_mapping(idx, 16, size, 128, no_sync)
                assert len(outputs) == 8 and outputs[7] == []
    if batch is not None:
        assert batch.compile(workers=2) == {}
