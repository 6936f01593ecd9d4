"""GPU: the fused mHC operators (``tileproof.optimized.mhc_fuse``) against the reference twin.

``mhc_multilayer_recompute``: inputs drawn by the oracle's builder (``oracle/mhc.py``), which keeps
every layer's exact value away from bf16 rounding boundaries, so the outputs must be bit for bit the
float64 replay rounded, the reference's layers one by one and the optimized ``mhc_pre_apply_mix`` /
``mhc_post`` one by one; the output buffers start as 0xFF bytes (NaN), so an element left unwritten
shows. Cases: 0 / 1 / odd tokens, L = 1 .. 4 with P = L and L − 1, hidden sizes off the 8-channel
vector, NaN-padded strided inputs, and output buffers that are strided or misaligned.

``mhc_pre_big_fuse``: the oracle's inputs and bounds (relative to the float64 steps: the norm-fn GEMM
runs in TF32), and bit for bit the optimized norm-fn → split → Sinkhorn → pre-apply run one by one,
which it composes. With ``DEVICE = "cpu"`` every case only compiles its kernels under ``compile_only()``.
"""

import pytest
import torch

import tileproof.reference.mhc as reference
from tileproof.optimized.jit import compile_only, poison_outputs
from tileproof.oracle import mhc as oracle
from tileproof.oracle.policy import PASS, Bitwise, compare

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # every input is built on it (a compile-only run on a CPU machine sets "cpu")
N = 4
BF16 = torch.bfloat16


def _optimized():
    import tileproof.optimized.mhc as optimized

    return optimized


def _fuse():
    import tileproof.optimized.mhc_fuse as fuse

    return fuse


def _bitwise(name, actual, expected):
    check = compare(name, actual, expected, Bitwise())
    assert check.status == PASS, f"{name}: {check.metric} {check.detail}"


# --- multilayer recompute -----------------------------------------------------------------------
# (tokens, hidden, pad, layers, posts): pad 3 and hidden 13 take the scalar path; 7168 is V4-Pro's.
RECOMPUTE_CASES = [
    (0, 64, 0, 2, 2),
    (1, 64, 0, 1, 0),
    (1, 64, 0, 1, 1),
    (3, 13, 0, 3, 2),
    (5, 64, 8, 4, 4),
    (2, 1280, 3, 2, 1),
    (37, 128, 0, 4, 3),
    (33, 2056, 0, 2, 2),
    (64, 7168, 0, 4, 4),
    (4001, 2560, 64, 4, 3),
]


def _recompute_call(tokens, hidden, pad, layers, posts):
    params = oracle.MhcParams(tokens, hidden, pad, layers=layers, posts=posts)
    case = oracle.Case("mhc_multilayer_recompute", "gpu test", params)
    spec = oracle.MultilayerRecompute("mhc_multilayer_recompute")
    generator = torch.Generator().manual_seed(tokens * 7919 + hidden * 31 + layers * 3 + posts)
    return spec, case, spec.build(case, DEVICE, generator)


@pytest.mark.parametrize("tokens,hidden,pad,layers,posts", RECOMPUTE_CASES)
def test_multilayer_recompute_is_bitwise(tokens, hidden, pad, layers, posts):
    spec, case, call = _recompute_call(tokens, hidden, pad, layers, posts)
    if DEVICE != "cuda":
        with compile_only():
            call(_fuse().mhc_multilayer_recompute)
        return
    outputs = call(_fuse().mhc_multilayer_recompute)
    for check in spec.extra_checks(case, call, outputs):
        assert check.status == PASS, f"{check.name}: {check.metric} {check.detail}"
    layer_inputs, residuals = outputs
    x0, pres, ys, posts_list, combs, _, _ = call.args
    optimized = _optimized()
    streams = x0
    for layer, pre in enumerate(pres):
        _bitwise(f"layer input {layer}", layer_inputs[layer], optimized.mhc_pre_apply_mix(streams, pre))
        if layer < len(ys):
            streams = optimized.mhc_post(ys[layer], streams, posts_list[layer], combs[layer])
            _bitwise(f"residual {layer}", residuals[layer], streams)


@pytest.mark.parametrize("offset", [0, 1])
def test_multilayer_recompute_into_strided_buffers(offset):
    """Buffers whose channels are strided (a contiguous temporary, copied in) or whose rows start
    off the 16-byte grid (the scalar path) receive the same bits as contiguous ones."""
    tokens, hidden, layers, posts = 7, 64, 3, 3
    spec, case, call = _recompute_call(tokens, hidden, 0, layers, posts)
    x0, pres, ys, posts_list, combs, _, _ = call.args
    if offset:
        layer_inputs = [
            torch.empty(tokens * hidden + 1, dtype=BF16, device=DEVICE)[1:].view(tokens, hidden) for _ in range(layers)
        ]
        residuals = [
            torch.empty(tokens * N * hidden + 1, dtype=BF16, device=DEVICE)[1:].view(tokens, N, hidden)
            for _ in range(posts)
        ]
    else:
        layer_inputs = [torch.empty(hidden, tokens, dtype=BF16, device=DEVICE).t() for _ in range(layers)]
        residuals = [torch.empty(hidden, tokens, N, dtype=BF16, device=DEVICE).permute(1, 2, 0) for _ in range(posts)]
    if DEVICE != "cuda":
        with compile_only():
            _fuse().mhc_multilayer_recompute(x0, pres, ys, posts_list, combs, layer_inputs, residuals)
        return
    for buffer in layer_inputs + residuals:
        buffer.fill_(float("nan"))
    _fuse().mhc_multilayer_recompute(x0, pres, ys, posts_list, combs, layer_inputs, residuals)
    expected_inputs, expected_residuals = call(_fuse().mhc_multilayer_recompute)
    _bitwise("layer inputs", torch.stack(layer_inputs), expected_inputs)
    _bitwise("residuals", torch.stack(residuals), expected_residuals)


# --- big fuse -------------------------------------------------------------------------------------
# (tokens, hidden, pad, variant): variant 0 = γ, R 20, post_mult 2, pre_eps 1e-6, n_splits 16;
# variant 1 = no γ, R 10, post_mult 1, pre_eps 1e-2, n_splits 1 (the oracle's alternation).
BIG_FUSE_CASES = [
    (0, 64, 0, 0),
    (1, 64, 0, 1),
    (3, 13, 0, 0),
    (5, 64, 8, 1),
    (2, 1280, 3, 0),
    (37, 128, 0, 1),
    (33, 2056, 0, 0),
    (4001, 2560, 64, 1),
    (8192, 7168, 0, 0),
]


@pytest.mark.parametrize("tokens,hidden,pad,variant", BIG_FUSE_CASES)
def test_big_fuse_matches_reference(tokens, hidden, pad, variant):
    spec = oracle.BigFuse("mhc_pre_big_fuse")
    params = spec.variants(oracle.MhcParams(tokens, hidden, pad), variant)[0]
    case = oracle.Case("mhc_pre_big_fuse", "gpu test", params)
    call = spec.build(case, DEVICE, torch.Generator().manual_seed(tokens * 7919 + hidden * 31 + variant))
    if DEVICE != "cuda":
        with compile_only():
            call(_fuse().mhc_pre_big_fuse)
        return
    with poison_outputs():
        outputs = call(_fuse().mhc_pre_big_fuse)
    expected64 = spec.reference_float64(case, call)
    expected = call(reference.mhc_pre_big_fuse)
    for output, actual, wanted64, wanted in zip(spec.outputs, outputs, expected64, expected, strict=True):
        check = compare(output.name, actual, wanted, output.policy, expected64=wanted64)
        assert check.status == PASS, f"{output.name}: {check.metric} {check.detail}"
    # The composition: the optimized operators one by one give the same bits.
    from tileproof.optimized.mhc_norm import mhc_pre_norm_fn

    residual, fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat, _ = call.args
    optimized = _optimized()
    mixes = mhc_pre_norm_fn(residual, fn, call.kwargs["mhc_norm_weight"], rms_eps)
    pre, post, logits = optimized.mhc_pre_split_mixes(mixes, scale, base, N, post_mult, pre_eps)
    one_by_one = (
        post,
        optimized.sinkhorn_normalize(logits, repeat, sinkhorn_eps),
        optimized.mhc_pre_apply_mix(residual, pre),
    )
    for output, actual, wanted in zip(spec.outputs, outputs, one_by_one, strict=True):
        _bitwise(f"≡ optimized one by one: {output.name}", actual, wanted)
