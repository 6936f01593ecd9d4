"""GPU: the optimized MoE index bookkeeping (``normalize_weight``, ``aux_fi``, ``group_count``,
``mask_indices_by_tp``, ``inplace_unique_group_indices``, ``get_fused_mapping``) agrees bit for bit
with the reference twin, on tails, 0 / 1 / odd token counts, strided inputs, both index dtypes and
every mode of ``get_fused_mapping``; the mapping is deterministic and needs no host synchronisation
(so it can be captured in a CUDA graph) when its size is given or ``force_no_sync`` is set.

Float outputs are allocated under ``poison_outputs`` (NaN where a kernel writes nothing). Integer
outputs of the mapping start as ``0x5A`` bytes instead: the oracle's poison (``0xFF``, i.e. -1) is
exactly the padding value, so a padding position the kernel forgot would pass unnoticed with it.
Inputs are built on the CPU from a generator seeded by the case and moved to ``DEVICE`` (a CPU
emulation run sets it to ``"cpu"``).
"""

import zlib
from unittest import mock

import pytest
import torch

import tileproof.reference.moe as reference
from tileproof.optimized.jit import poison_outputs

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
MAPPING_NAMES = (
    "pos_to_expert",
    "pos_to_token",
    "pos_to_token_topk",
    "token_topk_to_pos",
    "expert_start",
    "expert_end",
    "num_tokens_per_expert",
)


def _mapping_module():
    from tileproof.optimized.moe import mapping

    return mapping


def _generator(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _meaningful_strides(tensor):
    return tuple(stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size > 1)


def _assert_same_bits(actual, expected, what, strides=True):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if strides:
        assert _meaningful_strides(actual) == _meaningful_strides(expected), f"{what}: strides {actual.stride()}"
    if actual.numel():
        bits = {4: torch.int32, 8: torch.int64}[actual.element_size()]
        a, b = actual.contiguous().view(bits).reshape(-1), expected.contiguous().view(bits).reshape(-1)
        mismatch = (a != b).nonzero()
        assert mismatch.numel() == 0, f"{what}: {mismatch.shape[0]} elements differ, first at {mismatch[0].item()}"


def _fill_5a(tensor):
    """The mapping module's ``new_output`` for these tests: every output starts as 0x5A bytes."""
    if tensor.numel():
        tensor.view(torch.uint8).reshape(-1).fill_(0x5A) if tensor.is_contiguous() else tensor.fill_(0x5A5A5A5A)
    return tensor


def _routing(tokens, experts, topk, ep_ranks, generator, layout="contiguous"):
    """``topk_idx`` int64 ``[T, k]`` as EP rank 0 of ``ep_ranks`` sees it: each token has ``k`` distinct
    experts of ``experts * ep_ranks`` (a top-k output), those outside the rank's ``[0, experts)``
    become -1. ``layout``: "contiguous", "padded" (a view of wider rows) or "transposed" (column-major)."""
    total = experts * ep_ranks
    if tokens:
        idx = torch.rand((tokens, total), generator=generator).argsort(dim=1)[:, :topk]
    else:
        idx = torch.empty((0, topk), dtype=torch.int64)
    idx = idx.masked_fill(idx >= experts, -1)
    if layout == "padded":
        idx = torch.cat([idx, torch.full((tokens, 3), 77, dtype=torch.int64)], dim=1)[:, :topk]
    elif layout == "transposed":
        idx = idx.T.contiguous().T
    return idx


def _on_device(tensor, dtype=None):
    """``tensor`` (a CPU view) on DEVICE with the same strides (views of a wider buffer stay views)."""
    dtype = dtype or tensor.dtype
    if tensor.numel() == 0:
        return tensor.to(dtype).to(DEVICE)
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    storage = tensor.as_strided((span,), (1,)).to(dtype).to(DEVICE)
    return storage.as_strided(tensor.shape, tensor.stride())


# ---------------------------------------------------------------------------------------------
# normalize_weight
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [0, 1, 7, 129, 4001, 16384])
@pytest.mark.parametrize("topk", [1, 2, 6, 8, 9])
@pytest.mark.parametrize("layout", ["contiguous", "padded", "transposed", "offset"])
def test_normalize_weight_matches_reference(tokens, topk, layout):
    generator = _generator("normalize", tokens, topk, layout)
    width = topk + (3 if layout == "padded" else 1 if layout == "offset" else 0)
    wide = torch.rand((tokens, width), generator=generator)
    if tokens >= 4:
        wide[1] = 0.0  # den = 1e-20, weights 0
        wide[2] *= 1e-30  # subnormal weights, den dominated by 1e-20
        wide[3, 1:] = 0.0  # one weight
    weights = wide[:, 1:] if layout == "offset" else wide[:, :topk]  # offset: 4 bytes past a 16-byte start
    if layout == "transposed":
        weights = weights.T.contiguous().T
    weights = _on_device(weights)
    expected = reference.normalize_weight(weights)
    with poison_outputs():
        actual = _mapping_module().normalize_weight(weights)
    _assert_same_bits(actual[0], expected[0], "den")
    _assert_same_bits(actual[1], expected[1], "normalized")


# ---------------------------------------------------------------------------------------------
# aux_fi, group_count
# ---------------------------------------------------------------------------------------------

COUNT_CASES = [
    (tokens, experts, topk, ep_ranks, dtype)
    for tokens, experts, topk, ep_ranks in [
        (0, 16, 8, 1),
        (1, 72, 9, 1),
        (33, 32, 2, 8),
        (1000, 384, 8, 1),
        (4001, 16, 6, 8),
        (8001, 144, 1, 1),
        (129, 600, 8, 1),  # two tiles of experts
    ]
    for dtype in (torch.int32, torch.int64)
]


@pytest.mark.parametrize("tokens,experts,topk,ep_ranks,dtype", COUNT_CASES)
def test_aux_fi_and_group_count_match_reference(tokens, experts, topk, ep_ranks, dtype):
    generator = _generator("count", tokens, experts, topk, ep_ranks, dtype)
    idx = _on_device(_routing(tokens, experts, topk, ep_ranks, generator), dtype)
    groups = max(1, min(8, experts))
    group_idx = torch.div(idx, max(1, experts // groups), rounding_mode="floor").clamp(max=groups - 1)
    if tokens:
        group_idx[0, 0] = -5  # any negative entry is padding
    mapping = _mapping_module()
    with poison_outputs():
        for aux_topk in (topk, 1):
            _assert_same_bits(
                mapping.aux_fi(idx, experts, aux_topk), reference.aux_fi(idx, experts, aux_topk), f"aux_fi/{aux_topk}"
            )
        _assert_same_bits(mapping.group_count(group_idx, groups), reference.group_count(group_idx, groups), "count")
        _assert_same_bits(mapping.group_count(group_idx, 384), reference.group_count(group_idx, 384), "count/384")


# ---------------------------------------------------------------------------------------------
# mask_indices_by_tp, inplace_unique_group_indices
# ---------------------------------------------------------------------------------------------

MASK_CASES = [
    (tokens, n, topk, ep_ranks, tp_ranks, tp_rank, dtype, layout)
    for tokens, n, topk, ep_ranks, tp_ranks, tp_rank in [
        (0, 64, 8, 8, 2, 1),
        (1, 16, 9, 8, 8, 5),
        (7, 256, 8, 64, 4, 3),
        (33, 384, 6, 64, 8, 0),
        (4001, 72, 9, 8, 2, 0),
        (8001, 96, 2, 8, 1, 0),
        (129, 96, 1, 8, 3, 2),  # 8 ranks in groups of 3: the last group is short
    ]
    for dtype in (torch.int32, torch.int64)
    for layout in ("contiguous", "padded", "transposed")
]


@pytest.mark.parametrize("tokens,n,topk,ep_ranks,tp_ranks,tp_rank,dtype,layout", MASK_CASES)
def test_mask_indices_by_tp_matches_reference(tokens, n, topk, ep_ranks, tp_ranks, tp_rank, dtype, layout):
    generator = _generator("mask", tokens, n, topk, ep_ranks, tp_ranks, tp_rank, dtype, layout)
    idx = _routing(tokens, n, topk, 1, generator, layout)
    if tokens > 2:
        idx[2, 0] = -7  # any negative entry is padding
    idx = _on_device(idx, dtype)
    expected = reference.mask_indices_by_tp(idx, n, ep_ranks, tp_rank, tp_ranks)
    with poison_outputs():
        actual = _mapping_module().mask_indices_by_tp(idx, n, ep_ranks, tp_rank, tp_ranks)
    _assert_same_bits(actual, expected, "indices")


UNIQUE_CASES = [
    (tokens, groups, topk, dtype, layout)
    for tokens, groups, topk in [
        (0, 8, 8),
        (1, 8, 9),
        (33, 2, 9),
        (4001, 8, 8),
        (129, 64, 16),
        (77, 65, 9),
        (300, 300, 6),
    ]
    for dtype in (torch.int32, torch.int64)
    for layout in ("contiguous", "padded", "transposed")
]


@pytest.mark.parametrize("tokens,groups,topk,dtype,layout", UNIQUE_CASES)
def test_inplace_unique_group_indices_matches_reference(tokens, groups, topk, dtype, layout):
    generator = _generator("unique", tokens, groups, topk, dtype, layout)
    # Small values repeat often; -1 and -2 are padding (left as they are, repeats included). Padded
    # rows carry 3 more columns of a valid group: the kernel must neither read nor write them.
    wide = torch.randint(-2, min(groups, topk + 2), (tokens, topk + 3), generator=generator)
    wide[:, topk:] = groups - 1
    wide = wide.to(dtype).to(DEVICE)
    values = wide[:, :topk] if layout == "padded" else wide[:, :topk].contiguous()
    if layout == "transposed":
        values = values.T.contiguous().T
    expected = reference.inplace_unique_group_indices(values.clone(), groups)
    result = _mapping_module().inplace_unique_group_indices(values, groups)
    assert result is values
    _assert_same_bits(values, expected, "group_indices", strides=False)  # in place: values only
    if layout == "padded":
        assert bool((wide[:, topk:] == groups - 1).all()), "a column outside the view changed"


# ---------------------------------------------------------------------------------------------
# get_fused_mapping
# ---------------------------------------------------------------------------------------------

FUSED_CASES = [
    (tokens, experts, topk, ep_ranks, alignment, mode, dtype)
    for tokens, experts, topk, ep_ranks, alignment, mode, dtype in [
        (0, 16, 8, 1, 128, "sync", torch.int64),
        (0, 16, 8, 1, 128, "no_sync", torch.int32),
        (0, 256, 8, 1, 64, "bound", torch.int64),
        (1, 72, 9, 1, 128, "sync", torch.int32),
        (1, 384, 1, 1, 1, "no_sync", torch.int64),
        (7, 16, 9, 1, 1, "bound", torch.int32),
        (33, 4, 2, 8, 7, "sync", torch.int64),
        (1000, 1, 8, 8, 3, "no_sync", torch.int32),  # a single expert, most slots -1
        (1025, 2, 2, 1, 16, "sync", torch.int64),  # few experts: long runs of equal ones
        (4001, 96, 6, 1, 64, "bound", torch.int32),
        (4001, 128, 8, 64, 128, "no_sync", torch.int64),  # EP 64: two local experts
        (8001, 384, 9, 1, 128, "sync", torch.int32),
        (8001, 32, 2, 8, 1, "bound", torch.int64),
        (8192, 256, 8, 1, 128, "sync", torch.int64),  # DeepSeek-V3
        (16384, 256, 8, 1, 128, "no_sync", torch.int32),
        (300, 600, 8, 1, 64, "sync", torch.int64),  # two tiles of experts
        (513, 1200, 9, 1, 5, "bound", torch.int32),  # three tiles of experts
    ]
]


def _fused_call(tokens, experts, topk, ep_ranks, alignment, mode, dtype, layout="contiguous"):
    generator = _generator("fused", tokens, experts, topk, ep_ranks, alignment, mode, dtype, layout)
    idx = _on_device(_routing(tokens, experts, topk, ep_ranks, generator, layout), dtype)
    size = 0
    if mode == "bound":
        valid = int((idx >= 0).sum())
        size = max(alignment, (valid + (alignment - 1) * experts) // alignment * alignment) + 5
    return idx, experts, size, alignment, mode == "no_sync"


def _check_mapping(args):
    expected = reference.get_fused_mapping(*args)
    with mock.patch.object(_mapping_module(), "new_output", _fill_5a):
        actual = _mapping_module().get_fused_mapping(*args)
    for name, a, b in zip(MAPPING_NAMES, actual[:7], expected[:7], strict=True):
        _assert_same_bits(a, b, name)
    assert actual[7] == expected[7], "num_tokens_per_expert_list"
    return actual


@pytest.mark.parametrize("tokens,experts,topk,ep_ranks,alignment,mode,dtype", FUSED_CASES)
def test_get_fused_mapping_matches_reference(tokens, experts, topk, ep_ranks, alignment, mode, dtype):
    args = _fused_call(tokens, experts, topk, ep_ranks, alignment, mode, dtype)
    first = _check_mapping(args)
    again = _mapping_module().get_fused_mapping(*args)  # deterministic: the same bits every run
    for name, a, b in zip(MAPPING_NAMES, again[:7], first[:7], strict=True):
        _assert_same_bits(a, b, f"second run: {name}")


@pytest.mark.parametrize("layout", ["padded", "transposed"])
@pytest.mark.parametrize("mode", ["sync", "no_sync"])
def test_get_fused_mapping_of_a_strided_topk_idx(layout, mode):
    _check_mapping(_fused_call(777, 64, 6, 1, 16, mode, torch.int64, layout))


@pytest.mark.parametrize("mode", ["bound", "no_sync"])
def test_get_fused_mapping_without_host_sync(mode):
    """With a given size or force_no_sync nothing synchronises (a synchronising CUDA call raises in
    sync-debug mode), and the whole call captures into a CUDA graph whose replay gives the same bits."""
    args = _fused_call(4001, 256, 8, 1, 128, mode, torch.int64)
    expected = _mapping_module().get_fused_mapping(*args)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _mapping_module().get_fused_mapping(*args)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _mapping_module().get_fused_mapping(*args)  # warm-up outside the capture (kernel loading)
        with torch.cuda.graph(graph, stream=stream):
            captured = _mapping_module().get_fused_mapping(*args)
    torch.cuda.current_stream().wait_stream(stream)
    for tensor in captured[:7]:
        tensor.fill_(0x5A)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(MAPPING_NAMES, captured[:7], expected[:7], strict=True):
        _assert_same_bits(a, b, f"graph replay: {name}")
    assert captured[7] == []
