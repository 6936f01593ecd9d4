"""GPU: the optimized mHC norm-fn kernels (``tileproof.optimized.mhc_norm``) against the reference twin.

``mhc_pre_norm_fn`` and ``mhc_pre_norm_fn_bwd`` are compared with the reference computed in float64
under the policy the oracle states for each output (``oracle/mhc.py``: ``PreNormFn``,
``PreNormFnBwd``), with the oracle's input scalings (fn by 2^-⌈log2 √nC⌉ forward; streams and the
upstream gradient by 2^-⌈log2 √T⌉ and fn by 2^-3 backward), so the bounds apply as stated. Every call
runs under ``poison_outputs``, so an element the kernels never write shows up. Cases cover 0 / 1 / odd
token counts, enough tokens for several backward splits (130, 4001, 8192), hidden sizes that are not
a multiple of the 4-channel group (the scalar path), strided streams (rows padded with NaN), a
strided fn, with and without the norm weight γ. Inputs are built on the CPU from a seeded generator
and moved to ``DEVICE``; with it set to ``"cpu"`` every case only compiles its kernels under
``compile_only()`` (``scratch/emu_mhc_norm/compile_gpu_tests.py`` does that on a CPU machine).
"""

import zlib
from contextlib import nullcontext

import pytest
import torch

import tileproof.reference.mhc as reference
from tileproof.optimized.jit import compile_only, poison_outputs
from tileproof.oracle import mhc as oracle
from tileproof.oracle.policy import PASS, compare

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # every input is built on it (a compile-only run on a CPU machine sets "cpu")
N = 4
M = N * N + 2 * N
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
EPS = 1e-6


def _optimized():
    import tileproof.optimized.mhc_norm as optimized

    return optimized


def _generator(*params) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(params).encode()))


def _run(name, *args):
    """The optimized op on poisoned outputs (or, off the GPU, only its kernels compiled: None)."""
    if DEVICE != "cuda":
        with compile_only():
            getattr(_optimized(), name)(*args)
        return None
    with poison_outputs():
        return getattr(_optimized(), name)(*args)


def _padded(values: torch.Tensor, pad: int, dtype) -> torch.Tensor:
    """``values`` as ``dtype`` on ``DEVICE``, a view of rows ``pad`` elements longer (padding NaN)."""
    wide = torch.full((*values.shape[:-1], values.shape[-1] + pad), float("nan"), dtype=dtype)
    wide[..., : values.shape[-1]] = values.to(dtype)
    return wide.to(DEVICE)[..., : values.shape[-1]]


def _check(op_class, names, actual, expected64, expected_native):
    """Every output against the float64 reference under the oracle's policy for it."""
    policies = {output.name: output.policy for output in op_class.outputs}
    for name, out, ref64, ref in zip(names, actual, expected64, expected_native, strict=True):
        check = compare(name, out, ref, policies[name], expected64=ref64)
        assert check.status == PASS, f"{name}: {check.metric} {check.detail}"


def _inputs(tokens, hidden, pad, weighted, fn_pad, generator, *, fn_scale, stream_scale, rows=M):
    """Streams ``[T, n, C]`` (padded rows when ``pad``), fn ``[rows, nC]`` (a column-strided view when
    ``fn_pad``: every other column of a buffer twice as wide), γ ``[nC]`` in [0.9, 1.1] or None."""
    width = N * hidden
    residual = _padded(stream_scale * torch.randn(tokens, N, hidden, generator=generator), pad, BF16)
    fn_values = fn_scale * torch.randn(rows, width, generator=generator)
    if fn_pad:
        wide = torch.full((rows, 2 * width), float("nan"))
        wide[:, ::2] = fn_values
        fn = wide.to(DEVICE)[:, ::2]
    else:
        fn = fn_values.to(DEVICE)
    weight = (0.9 + 0.2 * torch.rand(width, generator=generator)).to(DEVICE) if weighted else None
    return residual, fn, weight


def _folded64(fn, weight):
    return fn.to(F64) if weight is None else fn.to(F64) * weight.to(F64)


# (tokens, hidden, pad, weighted, fn_pad): 13, the pad of 3 and the strided fn take the scalar path;
# 130+ tokens give the backward several token splits; 7168 is V4-Pro's hidden size.
NORM_CASES = [
    (0, 64, 0, False, False),
    (1, 64, 0, True, False),
    (3, 13, 0, False, False),
    (2, 1280, 3, True, False),
    (37, 128, 0, False, False),
    (5, 64, 8, True, False),
    (7, 64, 0, False, True),
    (130, 64, 0, True, False),
    (4001, 2560, 8, False, False),
    (1, 7168, 0, True, False),
    (8192, 7168, 0, True, False),
    (8192, 4096, 0, False, False),
]


@pytest.mark.parametrize("tokens,hidden,pad,weighted,fn_pad", NORM_CASES)
def test_norm_fn_matches_reference(tokens, hidden, pad, weighted, fn_pad):
    generator = _generator("norm_fn", tokens, hidden, pad, weighted, fn_pad)
    residual, fn, weight = _inputs(
        tokens,
        hidden,
        pad,
        weighted,
        fn_pad,
        generator,
        fn_scale=oracle.inverse_sqrt_pow2(N * hidden),
        stream_scale=1.0,
    )
    if tokens >= 3:
        residual[1] = 0  # only eps keeps rsqrt finite
    mixes = _run("mhc_pre_norm_fn", residual, fn, weight, EPS)
    if mixes is None:
        return
    x64 = residual.to(F64).reshape(tokens, N * hidden)
    expected64 = reference.norm_fn_forward_math(x64, _folded64(fn, weight), EPS)
    expected = reference.mhc_pre_norm_fn(residual, fn, weight, EPS)
    _check(oracle.PreNormFn, ["mixes"], [mixes], [expected64], [expected])


@pytest.mark.parametrize("tokens,hidden,pad,weighted,fn_pad", NORM_CASES)
def test_norm_fn_bwd_matches_reference(tokens, hidden, pad, weighted, fn_pad):
    generator = _generator("norm_fn_bwd", tokens, hidden, pad, weighted, fn_pad)
    scale = oracle.inverse_sqrt_pow2(max(tokens, 1))
    residual, fn, weight = _inputs(
        tokens, hidden, pad, weighted, fn_pad, generator, fn_scale=2.0**-3, stream_scale=scale
    )
    grad = _padded(scale * torch.randn(tokens, M, generator=generator), pad, F32)
    outputs = _run("mhc_pre_norm_fn_bwd", grad, residual, fn, weight, EPS)
    if outputs is None:
        return
    d_residual, d_fn, d_weight = outputs
    x64 = residual.to(F64).reshape(tokens, N * hidden)
    d_x, d_fn_folded = reference.norm_fn_backward_math(grad.to(F64), x64, _folded64(fn, weight), EPS)
    expected = reference.mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS)
    names = ["grad_residual", "grad_fn"]
    actual = [d_residual, d_fn]
    expected64 = [d_x.reshape(tokens, N, hidden)]
    if weight is None:
        assert d_weight is None
        expected64.append(d_fn_folded)
    else:
        names.append("grad_norm_weight")
        actual.append(d_weight)
        expected64 += [d_fn_folded * weight.to(F64), (d_fn_folded * fn.to(F64)).sum(0)]
    _check(oracle.PreNormFnBwd, names, actual, expected64, expected[: len(names)])


@pytest.mark.parametrize("tokens,hidden,rows", [(1, 64, N), (37, 1280, N), (130, 64, 80), (130, 64, 88)])
def test_other_mix_counts_match_reference(tokens, hidden, rows):
    """Other static configurations: the head's norm-fn (fn with m = n rows), the most mixes the
    tensor-core kernels take (TENSOR_CORE_MAX_ROWS = 80, mHC's n = 8) and one more (the FFMA kernels)."""
    generator = _generator("head_norm_fn", tokens, hidden, rows)
    scale = oracle.inverse_sqrt_pow2(tokens)
    residual, fn, weight = _inputs(
        tokens, hidden, 0, True, False, generator, fn_scale=2.0**-3, stream_scale=scale, rows=rows
    )
    grad = (scale * torch.randn(tokens, rows, generator=generator)).to(DEVICE)
    mixes = _run("mhc_pre_norm_fn", residual, fn, weight, EPS)
    outputs = _run("mhc_pre_norm_fn_bwd", grad, residual, fn, weight, EPS)
    if mixes is None:
        return
    x64 = residual.to(F64).reshape(tokens, N * hidden)
    folded = _folded64(fn, weight)
    expected64 = reference.norm_fn_forward_math(x64, folded, EPS)
    _check(oracle.PreNormFn, ["mixes"], [mixes], [expected64], [reference.mhc_pre_norm_fn(residual, fn, weight, EPS)])
    d_x, d_fn_folded = reference.norm_fn_backward_math(grad.to(F64), x64, folded, EPS)
    expected = reference.mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS)
    expected64 = [d_x.reshape(tokens, N, hidden), d_fn_folded * weight.to(F64), (d_fn_folded * fn.to(F64)).sum(0)]
    names = ["grad_residual", "grad_fn", "grad_norm_weight"]
    _check(oracle.PreNormFnBwd, names, outputs, expected64, expected)


def _backward_inputs(label, tokens, hidden, pad, weighted, fn_pad):
    """``(grad, residual, fn, weight, addend)`` of a backward case, seeded by ``label`` and the shape:
    the streams and gradients scaled by 2^-⌈log2 √T⌉, fn by 2^-3, the addend a bf16 ``[T, n, C]``."""
    generator = _generator(label, tokens, hidden, pad, weighted, fn_pad)
    scale = oracle.inverse_sqrt_pow2(max(tokens, 1))
    residual, fn, weight = _inputs(
        tokens, hidden, pad, weighted, fn_pad, generator, fn_scale=2.0**-3, stream_scale=scale
    )
    grad = _padded(scale * torch.randn(tokens, M, generator=generator), pad, F32)
    addend = (scale * torch.randn(tokens, N, hidden, generator=generator)).to(BF16).to(DEVICE)
    return grad, residual, fn, weight, addend


ADDEND_CASES = [(*case, 0) for case in NORM_CASES if case[0] != 1] + [(130, 64, 0, True, False, 1)]


@pytest.mark.parametrize("tokens,hidden,pad,weighted,fn_pad,addend_offset", ADDEND_CASES)
def test_norm_fn_bwd_grad_addend_is_one_rounding_of_the_sum(tokens, hidden, pad, weighted, fn_pad, addend_offset):
    """With ``grad_addend`` the residual's gradient is bf16(dx + addend) of the plain call's fp32 dx,
    bit for bit (the add and the rounding in the kernel's epilogue, tensor-core and FFMA paths alike);
    dfn and dγ do not change. ``addend_offset`` 1: a contiguous addend whose base is not 16-byte
    aligned (TMA cannot load it: the tensor-core kernel's threads load it instead)."""
    grad, residual, fn, weight, addend = _backward_inputs("norm_fn_bwd_addend", tokens, hidden, pad, weighted, fn_pad)
    if addend_offset:
        storage = torch.empty(addend.numel() + addend_offset, dtype=BF16, device=addend.device)
        addend = storage[addend_offset:].view(addend.shape).copy_(addend)
    if DEVICE != "cuda":
        with compile_only():
            _optimized().mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS, grad_addend=addend)
        return
    plain = _run("mhc_pre_norm_fn_bwd", grad, residual, fn, weight, EPS)
    with poison_outputs():
        summed = _optimized().mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS, grad_addend=addend)
    assert summed[0].dtype == BF16
    expected = (plain[0] + addend.float()).to(BF16)
    assert torch.equal(summed[0].view(torch.int16), expected.view(torch.int16))
    for a, b in zip(summed[1:], plain[1:], strict=True):
        assert (a is None and b is None) or torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("tokens,hidden,pad,weighted,fn_pad", [case for case in NORM_CASES if case[0] != 1])
def test_saved_statistics_give_the_recomputing_results_bit_for_bit(tokens, hidden, pad, weighted, fn_pad):
    """``save_statistics`` leaves the mixes' bits alone and returns ``[mul | Σx²]`` consistent with them;
    the backward from those statistics (no pass over the streams for them) gives the recomputing
    backward's bits, on the tensor-core and FFMA paths, with and without ``grad_addend``."""
    grad, residual, fn, weight, addend = _backward_inputs("norm_fn_statistics", tokens, hidden, pad, weighted, fn_pad)
    optimized = _optimized()
    if DEVICE != "cuda":
        with compile_only():
            optimized.mhc_pre_norm_fn(residual, fn, weight, EPS, save_statistics=True)
            statistics = torch.zeros(tokens, M + 1, device=DEVICE)
            optimized.mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS, statistics=statistics)
            optimized.mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS, grad_addend=addend, statistics=statistics)
        return
    with poison_outputs():
        mixes, statistics = optimized.mhc_pre_norm_fn(residual, fn, weight, EPS, save_statistics=True)
        plain_mixes = optimized.mhc_pre_norm_fn(residual, fn, weight, EPS)
    assert torch.equal(mixes.view(torch.int32), plain_mixes.view(torch.int32))
    assert statistics.shape == (tokens, M + 1) and statistics.dtype == F32
    mul, sq = statistics[:, :M].double(), statistics[:, M:].double()
    consistent = mul * torch.rsqrt(sq / (N * hidden) + EPS)
    assert torch.allclose(consistent, mixes.double(), rtol=1e-5, atol=1e-30)
    for extra in ({}, {"grad_addend": addend}):
        with poison_outputs():
            recomputed = optimized.mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS, **extra)
            saved = optimized.mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS, statistics=statistics, **extra)
        for a, b in zip(saved, recomputed, strict=True):
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("tokens,hidden", [(37, 128), (4001, 2560)])
@pytest.mark.parametrize("saved_statistics", [False, True])
def test_norm_fn_bwd_strided_grad_gives_the_contiguous_bits(tokens, hidden, saved_statistics):
    """The tensor-core backward's epilogue reads a contiguous grad at a linear index and any other
    layout through its strides (with or without the forward's statistics): both give the same bits."""
    grad, residual, fn, weight, addend = _backward_inputs("norm_fn_bwd_grad_layout", tokens, hidden, 0, True, False)
    strided = _padded(grad.cpu(), 5, F32)
    assert not strided.is_contiguous() or DEVICE != "cuda"
    optimized = _optimized()
    statistics = None
    if saved_statistics:
        statistics = torch.zeros(tokens, M + 1, device=DEVICE)
        if DEVICE == "cuda":
            statistics = optimized.mhc_pre_norm_fn(residual, fn, weight, EPS, save_statistics=True)[1]
    if DEVICE != "cuda":
        with compile_only():
            optimized.mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS, statistics=statistics)
            optimized.mhc_pre_norm_fn_bwd(strided, residual, fn, weight, EPS, statistics=statistics)
        return
    with poison_outputs():
        contiguous_results = optimized.mhc_pre_norm_fn_bwd(grad, residual, fn, weight, EPS, statistics=statistics)
        strided_results = optimized.mhc_pre_norm_fn_bwd(strided, residual, fn, weight, EPS, statistics=statistics)
    for a, b in zip(strided_results, contiguous_results, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("addend_kind", ["fp32", "shape"])
def test_invalid_grad_addend_raises_the_reference_error(addend_kind):
    residual = torch.zeros(3, N, 64, dtype=BF16, device=DEVICE)
    fn = torch.zeros(M, N * 64, device=DEVICE)
    grad = torch.zeros(3, M, device=DEVICE)
    addend = torch.zeros(3, N, 64, device=DEVICE) if addend_kind == "fp32" else residual[:2]
    with pytest.raises((TypeError, ValueError)) as expected:
        reference.mhc_pre_norm_fn_bwd(grad, residual, fn, None, EPS, grad_addend=addend)
    with pytest.raises(expected.type) as actual, compile_only() if DEVICE != "cuda" else nullcontext():
        _optimized().mhc_pre_norm_fn_bwd(grad, residual, fn, None, EPS, grad_addend=addend)
    assert str(actual.value) == str(expected.value)
    assert "grad_addend" in str(actual.value)


def test_norm_fn_bwd_is_deterministic():
    """Two runs give the same bits (fixed-order split reduction, no atomics)."""
    generator = _generator("norm_fn_bwd_repeat")
    residual, fn, weight = _inputs(4001, 1280, 0, True, False, generator, fn_scale=2.0**-3, stream_scale=2.0**-6)
    grad = (2.0**-6 * torch.randn(4001, M, generator=generator)).to(DEVICE)
    first = _run("mhc_pre_norm_fn_bwd", grad, residual, fn, weight, EPS)
    second = _run("mhc_pre_norm_fn_bwd", grad, residual, fn, weight, EPS)
    if first is None:
        return
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def _bad_calls(device):
    residual = torch.zeros(3, N, 64, dtype=BF16, device=device)
    fn = torch.zeros(M, N * 64, device=device)
    weight = torch.ones(N * 64, device=device)
    grad = torch.zeros(3, M, device=device)
    return [
        ("mhc_pre_norm_fn", (residual.float(), fn, None, EPS)),
        ("mhc_pre_norm_fn", (residual, fn[:, :64], None, EPS)),
        ("mhc_pre_norm_fn", (residual, fn, weight[:64], EPS)),
        ("mhc_pre_norm_fn", (residual, fn.double(), None, EPS)),
        ("mhc_pre_norm_fn", (residual, fn, None, -1.0)),
        ("mhc_pre_norm_fn", (residual, fn, None, "1e-6")),
        ("mhc_pre_norm_fn_bwd", (grad[:2], residual, fn, None, EPS)),
        ("mhc_pre_norm_fn_bwd", (grad.double(), residual, fn, weight, EPS)),
        ("mhc_pre_norm_fn_bwd", (grad, residual, fn, weight, float("nan"))),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls("cpu"))))
def test_invalid_arguments_raise_the_reference_errors(index):
    name, args = _bad_calls(DEVICE)[index]
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(reference, name)(*args)
    with pytest.raises(expected.type) as actual, compile_only() if DEVICE != "cuda" else nullcontext():
        getattr(_optimized(), name)(*args)
    assert str(actual.value) == str(expected.value)
