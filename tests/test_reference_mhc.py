"""The reference twin of the mHC family, proven on its own (CPU only).

Every explicit backward is checked in float64 through the dtype-generic ``*_math`` helpers: an
``autograd.Function`` whose forward is the forward math and whose backward *is* the explicit
backward is run through ``torch.autograd.gradcheck`` (which compares against finite differences),
and the explicit gradients are matched to ``torch.autograd`` of the forward math. The public
fp32/bf16 entry points are then checked against the float64 math (dtypes, shapes, tolerance),
on a realistic shape, on T = 0 and T = 1, and for their validation errors.
"""

from __future__ import annotations

import pytest
import torch

from tileproof.reference import mhc as rm

F64 = torch.float64
N = 4


def rand(generator, *shape, dtype=F64, scale=1.0):
    return (torch.randn(*shape, generator=generator, dtype=torch.float32) * scale).to(dtype)


def explicit_function(forward, backward):
    """An autograd.Function whose backward is the explicit backward under test."""

    class Explicit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            ctx.save_for_backward(*inputs)
            return forward(*inputs)

        @staticmethod
        def backward(ctx, *grads):
            return backward(grads, *ctx.saved_tensors)

    return Explicit.apply


def check_against_autograd(forward, backward, inputs):
    """gradcheck of the explicit backward (full Jacobian for small inputs, fast mode's random
    projections for large ones, to keep the file under 30 s), plus equality with autograd for one random cotangent."""
    inputs = tuple(t.detach().requires_grad_(True) for t in inputs)
    assert torch.autograd.gradcheck(
        explicit_function(forward, backward), inputs, eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=True
    )
    outputs = forward(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    cotangents = tuple(torch.randn_like(o) for o in outputs)
    expected = torch.autograd.grad(outputs, inputs, cotangents)
    actual = backward(cotangents, *(t.detach() for t in inputs))
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# Sinkhorn
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("repeat", (1, 2, 10, 20))
def test_sinkhorn_backward_gradcheck(generator, repeat):
    logits = rand(generator, 3, N, N, scale=2.0)
    eps = 1e-6
    check_against_autograd(
        lambda x: rm.sinkhorn_forward_math(x, repeat, eps),
        lambda grads, x: (rm.sinkhorn_backward_math(grads[0], x, repeat, eps),),
        (logits,),
    )


@pytest.mark.parametrize("repeat", (1, 10, 20))
def test_sinkhorn_columns_sum_to_one(generator, repeat):
    logits = rand(generator, 37, N, N, dtype=torch.float32, scale=4.0)
    comb = rm.sinkhorn_normalize(logits, repeat=repeat)
    assert comb.dtype == torch.float32 and comb.shape == (37, N, N) and comb.is_contiguous()
    assert (comb > 0).all()
    # Last step: P / (Σ_i P + eps), so Σ_i comb = S / (S + eps) = 1 − eps / (S + eps) exactly (S = Σ_i P
    # before it); S can be as small as n·eps when every source gives o a vanishing softmax weight.
    eps = 1e-6
    p = torch.softmax(logits.double(), -1) + eps
    if repeat > 1:
        p = rm.sinkhorn_forward_math(logits.double(), repeat - 1, eps)
        p = p / (p.sum(-1, keepdim=True) + eps)
    before = p.sum(-2)
    torch.testing.assert_close(comb.sum(-2).double(), before / (before + eps), atol=4 * 2**-24, rtol=0)
    assert (comb.sum(-2) <= 1 + 4 * 2**-24).all()
    assert ((1 - comb.sum(-2).double()) <= eps / before + 4 * 2**-24).all()
    expected = rm.sinkhorn_forward_math(logits.double(), repeat, 1e-6)
    torch.testing.assert_close(comb.double(), expected, atol=1e-6, rtol=1e-5)


def test_sinkhorn_public_backward_and_defaults(generator):
    logits = rand(generator, 5, N, N, dtype=torch.float32)
    grad = rand(generator, 5, N, N, dtype=torch.float32)
    out = rm.sinkhorn_normalize_bwd(grad, logits)
    expected = rm.sinkhorn_backward_math(grad.double(), logits.double(), 10, 1e-6)
    assert out.dtype == torch.float32 and out.shape == (5, N, N)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(rm.sinkhorn_normalize(logits), rm.sinkhorn_normalize(logits, 10, 1e-6), rtol=0, atol=0)


def test_sinkhorn_extreme_logits_stay_finite():
    logits = torch.tensor([[[1000.0, -1000.0, 0.0, 0.0]] * N])
    comb = rm.sinkhorn_normalize(logits, repeat=20)
    assert torch.isfinite(comb).all() and (comb > 0).all()
    assert torch.isfinite(rm.sinkhorn_normalize_bwd(torch.ones_like(logits), logits, repeat=20)).all()


# ---------------------------------------------------------------------------------------------
# Split mixes and head mix
# ---------------------------------------------------------------------------------------------


def test_split_mixes_backward_gradcheck(generator):
    m3 = N * N + 2 * N
    mixes, scale, base = rand(generator, 5, m3), rand(generator, 3), rand(generator, m3)
    check_against_autograd(
        lambda m, s, b: rm.split_mixes_forward_math(m, s, b, N, 2.0, 1e-2),
        lambda g, m, s, b: rm.split_mixes_backward_math(*g, m, s, b, N, 2.0),
        (mixes, scale, base),
    )


def test_split_mixes_public(generator):
    m3 = N * N + 2 * N
    mixes, scale, base = (
        rand(generator, 37, m3, dtype=torch.float32),
        torch.tensor([0.5, 0.7, 1.3]),
        rand(generator, m3, dtype=torch.float32),
    )
    pre, post, comb = rm.mhc_pre_split_mixes(mixes, scale, base, N, 2.0, 1e-6)
    assert pre.shape == post.shape == (37, N) and comb.shape == (37, N, N)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in (pre, post, comb))
    z = mixes * scale[0] + base  # column layout: comb[i, o] is column 2n + i·n + o
    torch.testing.assert_close(comb[:, 1, 2], mixes[:, 2 * N + N + 2] * scale[2] + base[2 * N + N + 2])
    torch.testing.assert_close(pre, torch.sigmoid(z[:, :N]) + 1e-6)
    assert ((post > 0) & (post < 2)).all()
    grads = (
        rand(generator, 37, N, dtype=torch.float32),
        rand(generator, 37, N, dtype=torch.float32),
        rand(generator, 37, N, N, dtype=torch.float32),
    )
    dm, ds, db = rm.mhc_pre_split_mixes_bwd(*grads, mixes, scale, base, N, 2.0)
    assert dm.shape == (37, m3) and ds.shape == (3,) and db.shape == (m3,)


def test_head_mix_backward_gradcheck(generator):
    mix, scale, base = rand(generator, 5, N), rand(generator, 1), rand(generator, N)
    check_against_autograd(
        lambda m, s, b: rm.head_mix_forward_math(m, s, b, 1e-6),
        lambda g, m, s, b: rm.head_mix_backward_math(g[0], m, s, b),
        (mix, scale, base),
    )
    out = rm.mhc_head_compute_mix(mix.float(), scale.float(), base.float(), 1e-6)
    assert out.dtype == torch.float32 and out.shape == (5, N)


# ---------------------------------------------------------------------------------------------
# Pre-apply, post, expand
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", (64, 96))
def test_apply_mix_backward_gradcheck(generator, hidden):
    check_against_autograd(
        rm.apply_mix_forward_math,
        lambda g, x, mix: rm.apply_mix_backward_math(g[0], x, mix),
        (rand(generator, 3, N, hidden), rand(generator, 3, N)),
    )


@pytest.mark.parametrize("hidden", (64, 96))
def test_post_backward_gradcheck(generator, hidden):
    check_against_autograd(
        rm.post_forward_math,
        lambda g, y, x, post, comb: rm.post_backward_math(g[0], y, x, post, comb),
        (rand(generator, 3, hidden), rand(generator, 3, N, hidden), rand(generator, 3, N), rand(generator, 3, N, N)),
    )


@pytest.mark.parametrize("tokens", (0, 1, 37))
def test_apply_and_post_public(generator, tokens):
    hidden = 1280
    residual = rand(generator, tokens, N, hidden, dtype=torch.bfloat16)
    y = rand(generator, tokens, hidden, dtype=torch.bfloat16)
    pre = torch.rand(tokens, N, generator=generator)
    post = 2 * torch.rand(tokens, N, generator=generator)
    comb = rm.sinkhorn_normalize(rand(generator, tokens, N, N, dtype=torch.float32))

    layer_in = rm.mhc_pre_apply_mix(residual, pre)
    assert layer_in.dtype == torch.bfloat16 and layer_in.shape == (tokens, hidden) and layer_in.is_contiguous()
    exact = rm.apply_mix_forward_math(residual.double(), pre.double())
    torch.testing.assert_close(layer_in.double(), exact, atol=1e-5, rtol=2**-8)

    out = rm.mhc_post(y, residual, post, comb)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, N, hidden) and out.is_contiguous()
    exact = rm.post_forward_math(y.double(), residual.double(), post.double(), comb.double())
    torch.testing.assert_close(out.double(), exact, atol=1e-5, rtol=2**-8)

    g_in = rand(generator, tokens, hidden, dtype=torch.bfloat16)
    dx, dmix = rm.mhc_pre_apply_mix_bwd(g_in, residual, pre)
    assert (dx.dtype, dx.shape, dmix.dtype, dmix.shape) == (
        torch.bfloat16,
        (tokens, N, hidden),
        torch.float32,
        (tokens, N),
    )
    g_out = rand(generator, tokens, N, hidden, dtype=torch.bfloat16)
    dy, dres, dpost, dcomb = rm.mhc_post_bwd(g_out, y, residual, post, comb)
    assert dy.shape == (tokens, hidden) and dres.shape == (tokens, N, hidden)
    assert dpost.shape == (tokens, N) and dcomb.shape == (tokens, N, N) and dcomb.dtype == torch.float32
    exact = rm.post_backward_math(g_out.double(), y.double(), residual.double(), post.double(), comb.double())
    torch.testing.assert_close(dcomb.double(), exact[3], atol=1e-3, rtol=1e-5)


def test_expand_round_trip(generator):
    hidden = rand(generator, 7, 96, dtype=torch.bfloat16)
    streams = rm.expand_to_mhc(hidden, N)
    assert streams.shape == (7, N, 96) and streams.is_contiguous()
    assert all(torch.equal(streams[:, i], hidden) for i in range(N))
    grad = rm.expand_to_mhc_bwd(streams)  # Σ of 4 equal bf16 values = 4·h exactly
    assert grad.dtype == torch.bfloat16 and torch.equal(grad, hidden * 4)
    assert rm.expand_to_mhc(hidden[:0], N).shape == (0, N, 96)


# ---------------------------------------------------------------------------------------------
# Norm-fn
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", (64, 96))
def test_norm_fn_backward_gradcheck(generator, hidden):
    m3 = N * N + 2 * N
    x, fn = rand(generator, 3, N * hidden), rand(generator, m3, N * hidden, scale=0.05)
    check_against_autograd(
        lambda x, fn: rm.norm_fn_forward_math(x, fn, 1e-6),
        lambda g, x, fn: rm.norm_fn_backward_math(g[0], x, fn, 1e-6),
        (x, fn),
    )


@pytest.mark.parametrize("tokens", (0, 1, 37))
def test_norm_fn_public_with_weight(generator, tokens):
    hidden, m3 = 1280, N * N + 2 * N
    residual = rand(generator, tokens, N, hidden, dtype=torch.bfloat16)
    fn = rand(generator, m3, N * hidden, dtype=torch.float32, scale=0.02)
    weight = 1 + 0.1 * rand(generator, N * hidden, dtype=torch.float32)
    mixes = rm.mhc_pre_norm_fn(residual, fn, weight, 1e-6)
    assert mixes.dtype == torch.float32 and mixes.shape == (tokens, m3)
    x = residual.double().reshape(tokens, N * hidden)
    torch.testing.assert_close(
        mixes.double(), rm.norm_fn_forward_math(x, fn.double() * weight.double(), 1e-6), atol=1e-5, rtol=1e-4
    )

    grad = rand(generator, tokens, m3, dtype=torch.float32)
    dres, dfn, dw = rm.mhc_pre_norm_fn_bwd(grad, residual, fn, weight, 1e-6)
    fn64, w64 = fn.double().requires_grad_(True), weight.double().requires_grad_(True)
    x64 = x.clone().requires_grad_(True)
    ref = rm.norm_fn_forward_math(x64, fn64 * w64, 1e-6)
    ex, efn, ew = torch.autograd.grad(ref, (x64, fn64, w64), grad.double())
    assert dres.shape == (tokens, N, hidden) and dres.dtype == torch.float32
    torch.testing.assert_close(dres.double().reshape(tokens, N * hidden), ex, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dfn.double(), efn, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw.double(), ew, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Big fuse
# ---------------------------------------------------------------------------------------------

M3 = N * N + 2 * N


def big_fuse_case(generator, tokens, hidden):
    residual = rand(generator, tokens, N, hidden, dtype=torch.bfloat16)
    fn = rand(generator, M3, N * hidden, dtype=torch.float32, scale=0.02)
    scale = torch.tensor([0.5, 0.7, 1.3])
    base = rand(generator, M3, dtype=torch.float32, scale=0.5)
    weight = 1 + 0.25 * rand(generator, N * hidden, dtype=torch.float32)
    return residual, fn, scale, base, weight


@pytest.mark.parametrize("with_weight", (True, False), ids=("norm-weight", "no-weight"))
@pytest.mark.parametrize("tokens,hidden", [(0, 64), (1, 33), (37, 96), (3, 7168)])
def test_big_fuse_is_the_steps_one_by_one(generator, tokens, hidden, with_weight):
    residual, fn, scale, base, weight = big_fuse_case(generator, tokens, hidden)
    weight = weight if with_weight else None
    post, comb, layer_in = rm.mhc_pre_big_fuse(
        residual, fn, scale, base, 1e-6, 1e-2, 1e-6, 2.0, 20, mhc_norm_weight=weight
    )
    assert (post.dtype, post.shape) == (torch.float32, (tokens, N))
    assert (comb.dtype, comb.shape) == (torch.float32, (tokens, N, N))
    assert (layer_in.dtype, layer_in.shape) == (torch.bfloat16, (tokens, hidden))
    assert all(t.is_contiguous() for t in (post, comb, layer_in))

    mixes = rm.mhc_pre_norm_fn(residual, fn, weight, 1e-6)
    pre_s, post_s, logits_s = rm.mhc_pre_split_mixes(mixes, scale, base, N, 2.0, 1e-2)
    comb_s = rm.sinkhorn_normalize(logits_s, repeat=20, eps=1e-6)
    assert torch.equal(post, post_s) and torch.equal(comb, comb_s)
    assert torch.equal(layer_in, rm.mhc_pre_apply_mix(residual, pre_s))


def test_big_fuse_against_float64_math(generator):
    """Independent of the fp32 steps: the whole chain written out in float64 from the formulas."""
    tokens, hidden = 19, 40
    residual, fn, scale, base, weight = big_fuse_case(generator, tokens, hidden)
    post, comb, layer_in = rm.mhc_pre_big_fuse(
        residual, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 10, 1, mhc_norm_weight=weight
    )

    streams = residual.double()
    x = streams.reshape(tokens, N * hidden)
    rstd = 1 / torch.sqrt((x * x).mean(1, keepdim=True) + 1e-6)
    mixes = (x @ (fn.double() * weight.double()).T) * rstd
    s = scale.double()
    z_pre = mixes[:, :N] * s[0] + base.double()[:N]
    z_post = mixes[:, N : 2 * N] * s[1] + base.double()[N : 2 * N]
    logits = (mixes[:, 2 * N :] * s[2] + base.double()[2 * N :]).reshape(tokens, N, N)
    pre64 = torch.sigmoid(z_pre) + 1e-6
    expected_layer_in = (pre64[:, :, None] * streams).sum(1)

    torch.testing.assert_close(post.double(), 2 * torch.sigmoid(z_post), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(comb.double(), rm.sinkhorn_forward_math(logits, 10, 1e-6), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(layer_in.double(), expected_layer_in, atol=1e-4, rtol=2**-8)


def test_big_fuse_applies_the_norm_weight(generator):
    residual, fn, scale, base, weight = big_fuse_case(generator, 11, 48)
    args = (scale, base, 1e-6, 1e-6, 1e-6, 2.0, 10)
    with_weight = rm.mhc_pre_big_fuse(residual, fn, *args, mhc_norm_weight=weight)
    folded = rm.mhc_pre_big_fuse(residual, fn * weight, *args)  # γ folded into fn by hand
    without = rm.mhc_pre_big_fuse(residual, fn, *args)
    assert all(torch.equal(a, b) for a, b in zip(with_weight, folded, strict=True))
    assert not torch.equal(with_weight[1], without[1])  # a dropped γ would show here
    ones = rm.mhc_pre_big_fuse(residual, fn, *args, mhc_norm_weight=torch.ones(N * 48))
    assert all(torch.equal(a, b) for a, b in zip(ones, without, strict=True))


# ---------------------------------------------------------------------------------------------
# Multilayer recompute
# ---------------------------------------------------------------------------------------------


def recompute_case(generator, tokens, hidden, num_layers, num_post):
    initial = rand(generator, tokens, N, hidden, dtype=torch.bfloat16)
    pre = [torch.rand(tokens, N, generator=generator) for _ in range(num_layers)]
    outputs = [rand(generator, tokens, hidden, dtype=torch.bfloat16) for _ in range(num_post)]
    post = [2 * torch.rand(tokens, N, generator=generator) for _ in range(num_post)]
    comb = [rm.sinkhorn_normalize(rand(generator, tokens, N, N, dtype=torch.float32)) for _ in range(num_post)]
    layer_in = [torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16) for _ in range(num_layers)]
    residuals = [torch.full((tokens, N, hidden), float("nan"), dtype=torch.bfloat16) for _ in range(num_post)]
    return initial, pre, outputs, post, comb, layer_in, residuals


@pytest.mark.parametrize(
    "tokens,hidden,num_layers,num_post",
    [(0, 64, 2, 2), (1, 33, 1, 0), (1, 33, 1, 1), (9, 96, 4, 3), (9, 96, 4, 4), (2, 2560, 3, 3)],
)
def test_multilayer_recompute_is_bitwise_layer_by_layer(generator, tokens, hidden, num_layers, num_post):
    case = recompute_case(generator, tokens, hidden, num_layers, num_post)
    initial, pre, outputs, post, comb, layer_in, residuals = case
    inputs_before = [t.clone() for t in [initial, *pre, *outputs, *post, *comb]]
    assert rm.mhc_multilayer_recompute(*case) is None

    stream = initial
    for layer in range(num_layers):
        assert torch.equal(layer_in[layer], rm.mhc_pre_apply_mix(stream, pre[layer])), f"layer_input[{layer}]"
        if layer < num_post:
            stream = rm.mhc_post(outputs[layer], stream, post[layer], comb[layer])
            assert torch.equal(residuals[layer], stream), f"residual[{layer}]"
    inputs_after = [initial, *pre, *outputs, *post, *comb]
    assert all(torch.equal(a, b) for a, b in zip(inputs_before, inputs_after, strict=True))


def test_multilayer_recompute_each_step_against_float64(generator):
    """Each replayed step, from the previous stored (bf16) residual, is the float64 math within one bf16 ulp."""
    tokens, hidden, num_layers = 5, 24, 5
    case = recompute_case(generator, tokens, hidden, num_layers, num_layers - 1)
    initial, pre, outputs, post, comb, layer_in, residuals = case
    rm.mhc_multilayer_recompute(*case)
    stream = initial.double()
    for layer in range(num_layers):
        expected_in = sum(pre[layer][:, i, None].double() * stream[:, i] for i in range(N))
        torch.testing.assert_close(layer_in[layer].double(), expected_in, atol=1e-6, rtol=2**-8)
        if layer == num_layers - 1:
            break
        y, p, c = outputs[layer].double(), post[layer].double(), comb[layer].double()
        expected = torch.stack(
            [p[:, o, None] * y + sum(c[:, i, o, None] * stream[:, i] for i in range(N)) for o in range(N)], dim=1
        )
        torch.testing.assert_close(residuals[layer].double(), expected, atol=1e-6, rtol=2**-8)
        stream = residuals[layer].double()  # the next layer reads the rounded residual


def test_multilayer_recompute_validation(generator):
    case = list(recompute_case(generator, 3, 8, 3, 2))
    with pytest.raises(ValueError, match="layer_output_list must have 2 or 3 entries"):
        rm.mhc_multilayer_recompute(case[0], case[1], case[2][:1], case[3][:1], case[4][:1], case[5], case[6][:1])
    with pytest.raises(ValueError, match="pre_mix_list must hold at least one layer"):
        rm.mhc_multilayer_recompute(case[0], [], [], [], [], [], [])
    with pytest.raises(ValueError, match="comb_mix_list must have 2 entries"):
        rm.mhc_multilayer_recompute(*case[:4], case[4][:1], *case[5:])
    with pytest.raises(TypeError, match="residual_list must be a list"):
        rm.mhc_multilayer_recompute(*case[:6], case[6][0])
    bad = [case[4][0], case[4][1].double()]
    with pytest.raises(TypeError, match=r"comb_mix_list\[1\] must have dtype in \(float32\)"):
        rm.mhc_multilayer_recompute(*case[:4], bad, *case[5:])
    with pytest.raises(ValueError, match=r"layer_input_list\[0\] must have shape \(3, 8\)"):
        rm.mhc_multilayer_recompute(*case[:5], [torch.zeros(3, 9, dtype=torch.bfloat16)] * 3, case[6])


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def test_validation_errors():
    x = torch.zeros(2, N, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="comb_res_mix"):
        rm.sinkhorn_normalize(torch.zeros(2, N, N, dtype=torch.float64))
    with pytest.raises(ValueError, match="comb_res_mix"):
        rm.sinkhorn_normalize(torch.zeros(2, N, N + 1))
    with pytest.raises(ValueError, match="repeat"):
        rm.sinkhorn_normalize(torch.zeros(2, N, N), repeat=0)
    with pytest.raises(TypeError, match="repeat"):
        rm.sinkhorn_normalize(torch.zeros(2, N, N), repeat=2.0)
    with pytest.raises(ValueError, match="eps"):
        rm.sinkhorn_normalize(torch.zeros(2, N, N), eps=-1.0)
    with pytest.raises(ValueError, match="input_mixes"):
        rm.mhc_pre_split_mixes(torch.zeros(2, 23), torch.ones(3), torch.zeros(24), N, 2.0, 1e-6)
    with pytest.raises(ValueError, match="mhc_scale"):
        rm.mhc_pre_split_mixes(torch.zeros(2, 24), torch.ones(2), torch.zeros(24), N, 2.0, 1e-6)
    with pytest.raises(TypeError, match="x"):
        rm.mhc_pre_apply_mix(x.float(), torch.zeros(2, N))
    with pytest.raises(ValueError, match="mix"):
        rm.mhc_pre_apply_mix(x, torch.zeros(2, N + 1))
    with pytest.raises(ValueError, match="comb_res_mix"):
        rm.mhc_post(torch.zeros(2, 8, dtype=torch.bfloat16), x, torch.zeros(2, N), torch.zeros(2, N, N - 1))
    with pytest.raises(ValueError, match="mhc_fn"):
        rm.mhc_pre_norm_fn(x, torch.zeros(24, N * 8 + 1), None, 1e-6)
    with pytest.raises(ValueError, match="mhc_mult"):
        rm.expand_to_mhc(torch.zeros(2, 8, dtype=torch.bfloat16), 0)
    with pytest.raises(ValueError, match="mhc_base"):
        rm.mhc_head_compute_mix(torch.zeros(2, N), torch.ones(1), torch.zeros(N + 1), 1e-6)
    args = (torch.ones(3), torch.zeros(24), 1e-6, 1e-6, 1e-6, 2.0, 10)
    with pytest.raises(ValueError, match=r"fn must have shape \(24, 32\)"):
        rm.mhc_pre_big_fuse(x, torch.zeros(N, N * 8), *args)
    with pytest.raises(ValueError, match="mhc_norm_weight"):
        rm.mhc_pre_big_fuse(x, torch.zeros(24, N * 8), *args, mhc_norm_weight=torch.ones(N * 8 + 1))
    with pytest.raises(ValueError, match="rms_eps"):
        rm.mhc_pre_big_fuse(x, torch.zeros(24, N * 8), torch.ones(3), torch.zeros(24), -1.0, 1e-6, 1e-6, 2.0, 10)
    with pytest.raises(ValueError, match="sinkhorn_repeat"):
        rm.mhc_pre_big_fuse(x, torch.zeros(24, N * 8), torch.ones(3), torch.zeros(24), 1e-6, 1e-6, 1e-6, 2.0, 0)
    with pytest.raises(ValueError, match="n_splits"):
        rm.mhc_pre_big_fuse(x, torch.zeros(24, N * 8), *args, 0)
