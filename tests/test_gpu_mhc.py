"""GPU: the optimized mHC kernels (``tileproof.optimized.mhc``) against the reference twin.

Each output is compared with the reference computed in float64 under the policy the oracle states for
it (``oracle/mhc.py``: relative bounds for the fp32 sums, bit for bit for ``expand_to_mhc`` and for
``expand_to_mhc_bwd``'s in-order stream sum). Every call runs under ``poison_outputs``, so an element
the kernels never write shows up. Cases cover 0 / 1 / odd token counts, hidden sizes that are not a
multiple of the 8-channel vector (the scalar path), strided views (rows padded with NaN, so a read past
a row's end shows), both Sinkhorn repeats and the split's flags. Inputs are built on the CPU from a
seeded generator and moved to ``DEVICE``; with it set to ``"cpu"`` every case only compiles its kernels
under ``compile_only()`` (``scratch/emu_mhc/compile_gpu_tests.py`` does that on a CPU machine).
"""

import zlib
from contextlib import nullcontext

import pytest
import torch

import tileproof.reference.mhc as reference
from tileproof.optimized.jit import compile_only, poison_outputs
from tileproof.oracle import mhc as oracle
from tileproof.oracle.policy import PASS, Bitwise, compare

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # every input is built on it (a compile-only run on a CPU machine sets "cpu")
N = 4
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


def _optimized():
    import tileproof.optimized.mhc as optimized

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


def _f64(*tensors):
    return [t.to(F64) for t in tensors]


def _scale_pow2(count: int) -> float:
    """2^-⌈log2 √count⌉, the oracle's scaling that keeps a count-term sum's terms O(1) in RSS."""
    return oracle.inverse_sqrt_pow2(max(count, 1))


# --- Sinkhorn ----------------------------------------------------------------------------------
# (tokens, pad, repeat): pad 8 keeps 16-byte rows (vector path), pad 1 forces scalar loads.
SINKHORN_CASES = [
    (0, 0, 10),
    (1, 0, 1),
    (1, 0, 20),
    (3, 1, 2),
    (37, 0, 10),
    (5, 8, 20),
    (4001, 0, 20),
    (8192, 8, 10),
    (65536, 0, 20),
]


def _logits(tokens, pad, generator):
    values = torch.randn(tokens, N, N, generator=generator)
    if tokens >= 3:
        values[1] = torch.tensor([0.0, -200.0, -200.0, -200.0])  # only eps fills three columns
        values[2] *= 4
    return _padded(values, pad, F32)


@pytest.mark.parametrize("tokens,pad,repeat", SINKHORN_CASES)
def test_sinkhorn_matches_reference(tokens, pad, repeat):
    generator = _generator("sinkhorn", tokens, pad, repeat)
    logits = _logits(tokens, pad, generator)
    grad = _padded(torch.randn(tokens, N, N, generator=generator), pad, F32)
    out = _run("sinkhorn_normalize", logits, repeat, 1e-6)
    grad_logits = _run("sinkhorn_normalize_bwd", grad, logits, repeat, 1e-6)
    if out is None:
        return
    expected = reference.sinkhorn_normalize(logits, repeat, 1e-6)
    expected64 = reference.sinkhorn_forward_math(logits.to(F64), repeat, 1e-6)
    _check(oracle.Sinkhorn, ["comb"], [out], [expected64], [expected])
    expected = reference.sinkhorn_normalize_bwd(grad, logits, repeat, 1e-6)
    expected64 = reference.sinkhorn_backward_math(*_f64(grad, logits), repeat, 1e-6)
    _check(oracle.SinkhornBwd, ["grad_logits"], [grad_logits], [expected64], [expected])


# --- stream ops: post, pre-apply, expand ---------------------------------------------------------
# (tokens, hidden, pad): 13 and the pad of 3 take the scalar path; 7168 is V4-Pro's hidden size.
STREAM_CASES = [
    (0, 64, 0),
    (1, 64, 0),
    (3, 13, 0),
    (2, 1280, 3),
    (37, 128, 0),
    (5, 64, 8),
    (33, 2056, 0),
    (4001, 2560, 64),
    (1, 7168, 0),
    (8192, 7168, 0),
]


def _streams(tokens, hidden, pad, generator, scale=1.0):
    return _padded(scale * torch.randn(tokens, N, hidden, generator=generator), pad, BF16)


def _rows(tokens, hidden, pad, generator, scale=1.0):
    return _padded(scale * torch.randn(tokens, hidden, generator=generator), pad, BF16)


def _post_coefficients(tokens, generator):
    post = (2 * torch.sigmoid(torch.randn(tokens, N, generator=generator))).to(DEVICE)
    comb = reference.sinkhorn_normalize(torch.randn(tokens, N, N, generator=generator), repeat=20).to(DEVICE)
    # A transposed view of comb: the kernels read it through its strides.
    comb = comb.transpose(1, 2).contiguous().transpose(1, 2) if tokens % 2 else comb
    return post, comb


@pytest.mark.parametrize("tokens,hidden,pad", STREAM_CASES)
def test_post_matches_reference(tokens, hidden, pad):
    generator = _generator("post", tokens, hidden, pad)
    y = _rows(tokens, hidden, pad, generator)
    residual = _streams(tokens, hidden, pad, generator)
    post, comb = _post_coefficients(tokens, generator)
    out = _run("mhc_post", y, residual, post, comb)
    if out is None:
        return
    expected = reference.mhc_post(y, residual, post, comb)
    expected64 = reference.post_forward_math(*_f64(y, residual, post, comb))
    _check(oracle.Post, ["residual_out"], [out], [expected64], [expected])


@pytest.mark.parametrize("tokens,hidden,pad", STREAM_CASES)
def test_post_bwd_matches_reference(tokens, hidden, pad):
    generator = _generator("post_bwd", tokens, hidden, pad)
    scale = _scale_pow2(hidden)
    grad = _streams(tokens, hidden, pad, generator)
    y = _rows(tokens, hidden, pad, generator, scale)
    residual = _streams(tokens, hidden, pad, generator, scale)
    post, comb = _post_coefficients(tokens, generator)
    outs = _run("mhc_post_bwd", grad, y, residual, post, comb)
    if outs is None:
        return
    expected = reference.mhc_post_bwd(grad, y, residual, post, comb)
    expected64 = reference.post_backward_math(*_f64(grad, y, residual, post, comb))
    names = ["grad_x", "grad_residual", "grad_post", "grad_comb"]
    _check(oracle.PostBwd, names, outs, expected64, expected)


@pytest.mark.parametrize("tokens,hidden,pad", STREAM_CASES)
def test_pre_apply_mix_matches_reference(tokens, hidden, pad):
    generator = _generator("apply", tokens, hidden, pad)
    x = _streams(tokens, hidden, pad, generator)
    mix = _padded(torch.sigmoid(torch.randn(tokens, N, generator=generator)) + 1e-6, pad, F32)
    out = _run("mhc_pre_apply_mix", x, mix)
    if out is None:
        return
    expected = reference.mhc_pre_apply_mix(x, mix)
    expected64 = reference.apply_mix_forward_math(*_f64(x, mix))
    _check(oracle.ApplyMix, ["layer_input"], [out], [expected64], [expected])


@pytest.mark.parametrize("tokens,hidden,pad", STREAM_CASES)
def test_pre_apply_mix_bwd_matches_reference(tokens, hidden, pad):
    generator = _generator("apply_bwd", tokens, hidden, pad)
    grad = _rows(tokens, hidden, pad, generator)
    x = _streams(tokens, hidden, pad, generator, _scale_pow2(hidden))
    mix = (torch.sigmoid(torch.randn(tokens, N, generator=generator)) + 1e-6).to(DEVICE)
    outs = _run("mhc_pre_apply_mix_bwd", grad, x, mix)
    if outs is None:
        return
    expected = reference.mhc_pre_apply_mix_bwd(grad, x, mix)
    expected64 = reference.apply_mix_backward_math(*_f64(grad, x, mix))
    _check(oracle.ApplyMixBwd, ["grad_x", "grad_mix"], outs, expected64, expected)


@pytest.mark.parametrize("tokens,hidden,pad", STREAM_CASES)
def test_expand_is_exact(tokens, hidden, pad):
    generator = _generator("expand", tokens, hidden, pad)
    hidden_states = _rows(tokens, hidden, pad, generator)
    grad = _streams(tokens, hidden, pad, generator)
    out = _run("expand_to_mhc", hidden_states, N)
    grad_hidden = _run("expand_to_mhc_bwd", grad)
    if out is None:
        return
    check = compare("out", out, reference.expand_to_mhc(hidden_states, N), Bitwise())
    assert check.status == PASS, check.detail
    # The contract's sum: fp32, streams in order, rounded once (a loop written out here).
    total = torch.zeros(tokens, hidden, dtype=F32, device=DEVICE)
    for stream in range(N):
        total += grad[:, stream].float()
    check = compare("grad_hidden", grad_hidden, total.to(BF16), Bitwise())
    assert check.status == PASS, check.detail


# --- token ops: split, head ----------------------------------------------------------------------
# (tokens, pad); 40000 tokens run more than one grid-stride round of the parameter-gradient kernel.
TOKEN_CASES = [(0, 0), (1, 0), (37, 0), (5, 8), (4001, 0), (40000, 0)]
M = N * N + 2 * N


def _split_inputs(tokens, pad, generator, mixes_scale):
    mixes = _padded(mixes_scale * torch.randn(tokens, M, generator=generator), pad, F32)
    scale = (torch.rand(3, generator=generator) + 0.5).to(DEVICE)
    base = ((torch.rand(M, generator=generator) - 0.5) * 6.6).to(DEVICE)
    return mixes, scale, base


@pytest.mark.parametrize("tokens,pad", TOKEN_CASES)
@pytest.mark.parametrize("post_mult,pre_eps", [(2.0, 1e-6), (1.0, 1e-2)])
def test_split_mixes_matches_reference(tokens, pad, post_mult, pre_eps):
    generator = _generator("split", tokens, pad, post_mult)
    mixes, scale, base = _split_inputs(tokens, pad, generator, 1.0)
    outs = _run("mhc_pre_split_mixes", mixes, scale, base, N, post_mult, pre_eps)
    g = _scale_pow2(tokens)
    grads = [(g * torch.randn(*shape, generator=generator)).to(DEVICE) for shape in ((tokens, N),) * 2]
    grads.append(_padded(g * torch.randn(tokens, N, N, generator=generator), pad, F32))
    small = mixes * 2.0**-3
    grad_outs = _run("mhc_pre_split_mixes_bwd", *grads, small, scale, base, N, post_mult)
    if outs is None:
        return
    expected = reference.mhc_pre_split_mixes(mixes, scale, base, N, post_mult, pre_eps)
    expected64 = reference.split_mixes_forward_math(*_f64(mixes, scale, base), N, post_mult, pre_eps)
    _check(oracle.SplitMixes, ["pre", "post", "comb"], outs, expected64, expected)
    expected = reference.mhc_pre_split_mixes_bwd(*grads, small, scale, base, N, post_mult)
    expected64 = reference.split_mixes_backward_math(*_f64(*grads, small, scale, base), N, post_mult)
    _check(oracle.SplitMixesBwd, ["grad_mixes", "grad_scale", "grad_base"], grad_outs, expected64, expected)


@pytest.mark.parametrize("tokens,pad", TOKEN_CASES)
def test_head_mix_matches_reference(tokens, pad):
    generator = _generator("head", tokens, pad)
    # The head's input mix: the first n columns of a [T, m] mixes buffer when strided, as in the model.
    mix = _padded(torch.randn(tokens, N, generator=generator), M - N if pad else 0, F32)
    scale = (torch.rand(1, generator=generator) + 0.5).to(DEVICE)
    base = ((torch.rand(N, generator=generator) - 0.5) * 6.6).to(DEVICE)
    grad = (_scale_pow2(tokens) * torch.randn(tokens, N, generator=generator)).to(DEVICE)
    out = _run("mhc_head_compute_mix", mix, scale, base, 1e-6)
    small = mix * 2.0**-3
    grad_outs = _run("mhc_head_compute_mix_bwd", grad, small, scale, base)
    if out is None:
        return
    expected = reference.mhc_head_compute_mix(mix, scale, base, 1e-6)
    expected64 = reference.head_mix_forward_math(*_f64(mix, scale, base), 1e-6)
    _check(oracle.HeadMix, ["head_mix"], [out], [expected64], [expected])
    expected = reference.mhc_head_compute_mix_bwd(grad, small, scale, base)
    expected64 = reference.head_mix_backward_math(*_f64(grad, small, scale, base))
    _check(oracle.HeadMixBwd, ["grad_mix", "grad_scale", "grad_base"], grad_outs, expected64, expected)


# --- argument checks -----------------------------------------------------------------------------


def _bad_calls(device):
    logits = torch.zeros(3, N, N, device=device)
    x = torch.zeros(3, N, 64, dtype=BF16, device=device)
    y = torch.zeros(3, 64, dtype=BF16, device=device)
    mix = torch.zeros(3, N, device=device)
    mixes = torch.zeros(3, M, device=device)
    scale, base = torch.ones(3, device=device), torch.zeros(M, device=device)
    return [
        ("sinkhorn_normalize", (logits[:, :3], 10, 1e-6)),
        ("sinkhorn_normalize", (logits, 0, 1e-6)),
        ("sinkhorn_normalize", (logits, 10, -1.0)),
        ("sinkhorn_normalize", (logits.double(), 10, 1e-6)),
        ("sinkhorn_normalize_bwd", (logits[:2], logits, 10, 1e-6)),
        ("mhc_post", (y, x, mix, logits[:, :, :3])),
        ("mhc_post", (y.float(), x, mix, logits)),
        ("mhc_post_bwd", (x[:, :3], y, x, mix, logits)),
        ("mhc_pre_apply_mix", (x, mix[:, :3])),
        ("mhc_pre_apply_mix_bwd", (y[:, :32], x, mix)),
        ("expand_to_mhc", (y, 0)),
        ("expand_to_mhc", (y.float(), N)),
        ("expand_to_mhc_bwd", (y,)),
        ("mhc_pre_split_mixes", (mixes, scale, base, 3, 2.0, 1e-6)),
        ("mhc_pre_split_mixes", (mixes, scale[:2], base, N, 2.0, 1e-6)),
        ("mhc_pre_split_mixes", (mixes, scale, base, N, -2.0, 1e-6)),
        ("mhc_pre_split_mixes_bwd", (mix, mix, logits[:, :3], mixes, scale, base, N, 2.0)),
        ("mhc_head_compute_mix", (mix, scale, base[:N], 1e-6)),
        ("mhc_head_compute_mix_bwd", (mix[:2], mix, scale[:1], base[:N])),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls("cpu"))))
def test_invalid_arguments_raise_the_reference_errors(index):
    name, args = _bad_calls(DEVICE)[index]
    with pytest.raises((TypeError, ValueError)) as expected:
        getattr(reference, name)(*args)
    with pytest.raises(expected.type) as actual, compile_only() if DEVICE != "cuda" else nullcontext():
        getattr(_optimized(), name)(*args)
    assert str(actual.value) == str(expected.value)
