"""The reference twin of the modeling layers (contract §6), proven on its own (CPU only).

- **Gradients.** In float64, autograd's gradients of the layers equal the explicit backward references
  of ``reference/engram.py`` and ``reference/mhc.py`` (the dtype-generic ``*_backward_math`` helpers,
  which ``test_reference_engram.py`` / ``test_reference_mhc.py`` prove equal to the public ``*_bwd``
  operators) composed by hand through a whole chain: expand → mhc_pre (with norm weight) →
  sublayer → mhc_post → mhc_head, and the Engram gate down to both gains. ``gradcheck`` checks each
  layer against finite differences on tiny shapes.
- **bf16 layers** against the public operators: forwards bit for bit, gradients within bf16 rounding.
- **Engram main_grad**: the gains' gradients land in ``main_grad`` (unrounded, accumulating) and not in
  ``.grad``.
- **mhc_pre without gradients** goes through ``mhc_pre_big_fuse`` with the norm weight and agrees bit
  for bit with the differentiable path.
"""

from __future__ import annotations

import pytest
import torch

from tileproof.reference import engram as re
from tileproof.reference import mhc as rm
from tileproof.reference import modeling as md

F64 = torch.float64
BF16 = torch.bfloat16
N = 4
M3 = N * N + 2 * N


def rand(generator, *shape, dtype=F64, scale=1.0, offset=0.0):
    return (offset + scale * torch.randn(*shape, generator=generator, dtype=torch.float32)).to(dtype)


def leaves(*tensors):
    return tuple(t.detach().clone().requires_grad_(True) for t in tensors)


# ---------------------------------------------------------------------------------------------
# Engram gate
# ---------------------------------------------------------------------------------------------

CLAMP = 0.3  # large on purpose: both branches of the clamp occur among the (token, stream) pairs
EPS = 1e-6


def engram_float64_case(generator, tokens=6, hidden=16):
    """float64 x, k, v, wh, we whose scores keep 1e-3 away from the kinks s = 0 and |s| = CLAMP."""
    pool = 64
    x, k = rand(generator, pool, N, hidden), rand(generator, pool, N, hidden)
    v = rand(generator, pool, hidden)
    wh, we = rand(generator, N, hidden, scale=0.5, offset=1.0), rand(generator, N, hidden, scale=0.5, offset=1.0)
    _, dot, _, rstd_x, rstd_k = re.gate_forward_math(x, k, v, wh * we, EPS, CLAMP)
    s = dot * rstd_x * rstd_k * hidden**-0.5
    smooth = ((s.abs() > 1e-3) & ((s.abs() - CLAMP).abs() > 1e-3)).all(dim=1)
    keep = torch.nonzero(smooth).flatten()[:tokens]
    assert keep.numel() == tokens
    assert bool((s[keep].abs() < CLAMP).any()) and bool((s[keep].abs() > CLAMP).any()), "both clamp branches"
    return x[keep], k[keep], v[keep], wh, we


def test_engram_gate_gradients_equal_explicit_backward_float64(generator):
    x, k, v, wh, we = engram_float64_case(generator)
    lead = (2, 3)  # any leading dimensions: [2, 3, n, D]
    inputs = leaves(x.reshape(*lead, N, -1), k.reshape(*lead, N, -1), v.reshape(*lead, -1), wh, we)
    out = md.engram_gate(*inputs, CLAMP, EPS)
    assert out.dtype == F64 and out.shape == (*lead, N, 16)
    grad_out = rand(generator, *out.shape)
    auto = torch.autograd.grad(out, inputs, grad_out)

    _, dot, gate, rstd_x, rstd_k = re.gate_forward_math(x, k, v, wh * we, EPS, CLAMP)
    dx, dk, dv, dw_partial = re.gate_backward_math(
        grad_out.reshape(-1, N, 16), x, k, v, wh * we, dot, gate, rstd_x, rstd_k, CLAMP, num_partials=4
    )
    dw = dw_partial.sum(0)  # grad_w_reduce: grad_wh += G⊙we, grad_we += G⊙wh
    explicit = (dx.reshape(*lead, N, 16), dk.reshape(*lead, N, 16), dv.reshape(*lead, 16), dw * we, dw * wh)
    for name, got, want in zip(("dx", "dk", "dv", "dwh", "dwe"), auto, explicit, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


def test_engram_gate_gradcheck(generator):
    x, k, v, wh, we = engram_float64_case(generator, tokens=3, hidden=8)

    def gate(*inputs):
        return md.engram_gate(*inputs, CLAMP, EPS)

    assert torch.autograd.gradcheck(gate, leaves(x, k, v, wh, we), fast_mode=True)


def bf16_engram_case(generator, tokens=13, hidden=64):
    x = rand(generator, tokens, N, hidden, dtype=BF16)
    # k and v are views into one fused projection output [T, (n+1)·D]
    fused = rand(generator, tokens, (N + 1) * hidden, dtype=BF16)
    k, v = fused[:, : N * hidden].view(tokens, N, hidden), fused[:, N * hidden :]
    wh = rand(generator, N, hidden, dtype=BF16, scale=0.1, offset=1.0)
    we = rand(generator, N, hidden, dtype=BF16, scale=0.1, offset=1.0)
    return x, k, v, wh, we


@pytest.mark.parametrize("tokens", (0, 1, 13))
def test_engram_gate_bf16_against_the_operators(generator, tokens):
    x, k, v, wh, we = bf16_engram_case(generator, tokens)
    x_, k_, v_, wh_, we_ = leaves(x, k, v, wh, we)
    out = md.engram_gate(x_, k_, v_, wh_, we_, 1e-6, 1e-20)
    w = re.fused_weight(wh, we)
    expected, dot, gate, rstd_x, rstd_k = re.engram_gate_fwd(x, k, v, w, 1e-20, 1e-6)
    assert out.dtype == BF16 and out.is_contiguous() and torch.equal(out, expected)

    grad_out = rand(generator, *out.shape, dtype=BF16)
    out.backward(grad_out)
    dx, dk, dv, dw_partial = re.engram_gate_bwd(grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, 1e-6)
    grad_wh, grad_we = torch.zeros(N, 64), torch.zeros(N, 64)
    re.grad_w_reduce(dw_partial, wh, we, grad_wh, grad_we)
    for got, want in ((x_.grad, dx), (k_.grad, dk), (v_.grad, dv), (wh_.grad, grad_wh), (we_.grad, grad_we)):
        assert got.dtype == BF16 and got.shape == want.shape
        # Autograd and the explicit formulas round differently in fp32: a bf16 result may differ by an ulp.
        torch.testing.assert_close(got.double(), want.double(), rtol=2**-7, atol=1e-3)


def test_engram_gate_main_grad(generator):
    x, k, v, wh, we = bf16_engram_case(generator)
    grad_out = rand(generator, *x.shape, dtype=BF16)

    plain = md.EngramGate(N, 64, eps=1e-20)
    with torch.no_grad():
        plain.weight_hidden.copy_(wh)
        plain.weight_embed.copy_(we)
    plain(x, k, v).backward(grad_out)

    routed = md.EngramGate(N, 64, eps=1e-20)
    with torch.no_grad():
        routed.weight_hidden.copy_(wh)
        routed.weight_embed.copy_(we)
    routed.weight_hidden.main_grad = torch.zeros(N, 64)  # Megatron-style fp32 buffer, only on wh
    routed(x, k, v).backward(grad_out)

    assert routed.weight_hidden.grad is None  # routed to main_grad, .grad untouched
    first = routed.weight_hidden.main_grad.clone()
    assert first.dtype == torch.float32 and bool((first != 0).any())
    assert not torch.equal(first, first.to(BF16).float())  # unrounded: not every entry is a bf16 value
    # main_grad holds the fp32 gradient before the rounding that .grad gets: same value, one rounding less.
    assert torch.equal(first.to(BF16), plain.weight_hidden.grad)
    assert torch.equal(routed.weight_embed.grad, plain.weight_embed.grad)  # no main_grad: normal .grad

    routed(x, k, v).backward(grad_out)  # accumulates (x + x is exact in fp32)
    assert torch.equal(routed.weight_hidden.main_grad, 2 * first) and routed.weight_hidden.grad is None
    assert torch.equal(routed.weight_embed.grad, 2 * plain.weight_embed.grad)

    routed.weight_embed.main_grad = torch.zeros(N, 64, dtype=BF16)
    with pytest.raises(TypeError, match=r"weight_embed.main_grad must have dtype in \(float32\)"):
        routed(x, k, v)


# ---------------------------------------------------------------------------------------------
# mHC: float64 proofs of the gradients
# ---------------------------------------------------------------------------------------------

NORM_EPS, PRE_EPS, SINKHORN_EPS, POST_MULT, REPEAT = 1e-6, 1e-2, 1e-6, 2.0, 20


def mhc_float64_params(generator, hidden):
    width = N * hidden
    return dict(
        fn=rand(generator, M3, width, scale=0.3),
        scale=torch.tensor([0.5, 0.7, 1.3], dtype=F64),
        base=rand(generator, M3, scale=0.5),
        norm_weight=rand(generator, width, scale=0.25, offset=1.0),
        head_fn=rand(generator, N, width, scale=0.3),
        head_scale=torch.tensor([0.8], dtype=F64),
        head_base=rand(generator, N, scale=0.5),
        head_norm_weight=rand(generator, width, scale=0.25, offset=1.0),
    )


def mhc_chain(h, fn, scale, base, norm_weight, head_fn, head_scale, head_base, head_norm_weight):
    """expand → mhc_pre → tanh sublayer → mhc_post → mhc_head, through the modeling layers."""
    streams = md.expand_from_embedding(h, N)
    layer_in, (post, comb) = md.mhc_pre(
        streams,
        fn,
        scale,
        base,
        norm_weight=norm_weight,
        norm_eps=NORM_EPS,
        post_mult_value=POST_MULT,
        pre_eps=PRE_EPS,
        sinkhorn_eps=SINKHORN_EPS,
        sinkhorn_repeat=REPEAT,
    )
    streams = md.mhc_post(torch.tanh(layer_in), streams, post, comb)
    return md.mhc_head(
        streams, head_fn, head_scale, head_base, norm_weight=head_norm_weight, norm_eps=NORM_EPS, pre_eps=PRE_EPS
    )


def explicit_chain_backward(
    grad_out, h, fn, scale, base, norm_weight, head_fn, head_scale, head_base, head_norm_weight
):
    """The same chain's gradients, composed from the explicit backward references (no autograd)."""
    tokens, hidden = h.shape

    def flat(streams):
        return streams.reshape(tokens, N * hidden)

    # forward, keeping what the backwards need
    x0 = h[:, None, :].expand(tokens, N, hidden)
    mixes = rm.norm_fn_forward_math(flat(x0), fn * norm_weight, NORM_EPS)
    pre, post, logits = rm.split_mixes_forward_math(mixes, scale, base, N, POST_MULT, PRE_EPS)
    comb = rm.sinkhorn_forward_math(logits, REPEAT, SINKHORN_EPS)
    y = torch.tanh(rm.apply_mix_forward_math(x0, pre))
    x1 = rm.post_forward_math(y, x0, post, comb)
    head_mixes = rm.norm_fn_forward_math(flat(x1), head_fn * head_norm_weight, NORM_EPS)
    head_mix = rm.head_mix_forward_math(head_mixes, head_scale, head_base, PRE_EPS)

    # head
    d_x1, d_head_mix = rm.apply_mix_backward_math(grad_out, x1, head_mix)
    d_head_mixes, d_head_scale, d_head_base = rm.head_mix_backward_math(d_head_mix, head_mixes, head_scale, head_base)
    d_x1_norm, d_head_folded = rm.norm_fn_backward_math(d_head_mixes, flat(x1), head_fn * head_norm_weight, NORM_EPS)
    d_x1 = d_x1 + d_x1_norm.reshape(tokens, N, hidden)
    # post, sublayer
    d_y, d_x0, d_post, d_comb = rm.post_backward_math(d_x1, y, x0, post, comb)
    d_layer_in = d_y * (1 - y * y)
    # pre: apply, Sinkhorn, split, norm-fn
    d_x0_apply, d_pre = rm.apply_mix_backward_math(d_layer_in, x0, pre)
    d_logits = rm.sinkhorn_backward_math(d_comb, logits, REPEAT, SINKHORN_EPS)
    d_mixes, d_scale, d_base = rm.split_mixes_backward_math(d_pre, d_post, d_logits, mixes, scale, base, N, POST_MULT)
    d_x0_norm, d_folded = rm.norm_fn_backward_math(d_mixes, flat(x0), fn * norm_weight, NORM_EPS)
    d_x0 = d_x0 + d_x0_apply + d_x0_norm.reshape(tokens, N, hidden)
    # expand; the norm weight folded into fn: dfn = dfn̂⊙γ, dγ = Σ_j dfn̂⊙fn
    return (
        d_x0.sum(1),
        d_folded * norm_weight,
        d_scale,
        d_base,
        (d_folded * fn).sum(0),
        d_head_folded * head_norm_weight,
        d_head_scale,
        d_head_base,
        (d_head_folded * head_fn).sum(0),
    )


@pytest.mark.parametrize("tokens,hidden", [(1, 5), (7, 12)])
def test_mhc_chain_gradients_equal_explicit_backward_float64(generator, tokens, hidden):
    params = mhc_float64_params(generator, hidden)
    inputs = leaves(rand(generator, tokens, hidden), *params.values())
    out = mhc_chain(*inputs)
    assert out.dtype == F64 and out.shape == (tokens, hidden)
    grad_out = rand(generator, tokens, hidden)
    auto = torch.autograd.grad(out, inputs, grad_out)
    explicit = explicit_chain_backward(grad_out, *(t.detach() for t in inputs))
    names = ("dh", *("d" + name for name in params))
    for name, got, want in zip(names, auto, explicit, strict=True):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def test_mhc_pre_gradcheck(generator):
    params = mhc_float64_params(generator, 2)
    residual = rand(generator, 2, N, 2)

    def pre(residual, fn, scale, base, norm_weight):
        layer_in, (post, comb) = md.mhc_pre(
            residual, fn, scale, base, norm_weight=norm_weight, post_mult_value=POST_MULT, sinkhorn_repeat=3
        )
        return layer_in, post, comb

    inputs = leaves(residual, *(params[name] for name in ("fn", "scale", "base", "norm_weight")))
    assert torch.autograd.gradcheck(pre, inputs, fast_mode=True)


def test_mhc_post_head_expand_gradcheck(generator):
    params = mhc_float64_params(generator, 3)
    y, residual = rand(generator, 2, 1, 3), rand(generator, 2, 1, N, 3)  # leading dims [2, 1]
    post, comb = rand(generator, 2, 1, N), rand(generator, 2, 1, N, N)
    assert torch.autograd.gradcheck(md.mhc_post, leaves(y, residual, post, comb))
    head_inputs = leaves(
        residual, *(params[name] for name in ("head_fn", "head_scale", "head_base", "head_norm_weight"))
    )
    assert torch.autograd.gradcheck(lambda r, f, s, b, w: md.mhc_head(r, f, s, b, norm_weight=w), head_inputs)
    assert torch.autograd.gradcheck(lambda h: md.expand_from_embedding(h, N), leaves(y))


# ---------------------------------------------------------------------------------------------
# mHC: bf16 layers against the operators, and the no-grad path
# ---------------------------------------------------------------------------------------------


def bf16_mhc_case(generator, lead, hidden):
    residual = rand(generator, *lead, N, hidden, dtype=BF16)
    fn = rand(generator, M3, N * hidden, dtype=torch.float32, scale=0.02)
    scale = torch.tensor([0.5, 0.7, 1.3])
    base = rand(generator, M3, dtype=torch.float32, scale=0.5)
    weight = rand(generator, N * hidden, dtype=torch.float32, scale=0.25, offset=1.0)
    return residual, fn, scale, base, weight


PRE_OPTIONS = dict(norm_eps=1e-6, post_mult_value=2.0, pre_eps=1e-6, sinkhorn_eps=1e-6, sinkhorn_repeat=20)


@pytest.mark.parametrize("lead,hidden", [((0,), 16), ((1,), 33), ((2, 3), 64), ((2,), 1280)])
def test_mhc_pre_no_grad_goes_through_big_fuse_with_the_norm_weight(generator, monkeypatch, lead, hidden):
    residual, fn, scale, base, weight = bf16_mhc_case(generator, lead, hidden)
    seen = []
    big_fuse = rm.mhc_pre_big_fuse

    def spy(*args, **kwargs):
        seen.append(kwargs.get("mhc_norm_weight"))
        return big_fuse(*args, **kwargs)

    monkeypatch.setattr(rm, "mhc_pre_big_fuse", spy)
    fn_, scale_, base_, weight_ = leaves(fn, scale, base, weight)
    trained = md.mhc_pre(residual, fn_, scale_, base_, norm_weight=weight_, **PRE_OPTIONS)
    assert seen == []  # gradients enabled: the differentiable path
    with torch.no_grad():
        inferred = md.mhc_pre(residual, fn, scale, base, norm_weight=weight, **PRE_OPTIONS)
    assert len(seen) == 1 and seen[0] is weight
    with torch.inference_mode():
        md.mhc_pre(residual, fn, scale, base, norm_weight=weight, **PRE_OPTIONS)
    assert len(seen) == 2

    layer_in, (post, comb) = trained
    assert layer_in.shape == (*lead, hidden) and post.shape == (*lead, N) and comb.shape == (*lead, N, N)
    assert layer_in.dtype == BF16 and post.dtype == comb.dtype == torch.float32
    for got, want in zip((layer_in, post, comb), (inferred[0], *inferred[1]), strict=True):
        assert torch.equal(got.detach(), want)
    if residual.numel():
        unweighted = md.mhc_pre(residual, fn, scale, base, **PRE_OPTIONS)
        assert not torch.equal(unweighted[1][1], comb.detach())  # the weight matters on both paths


def test_mhc_layers_bf16_against_the_operators(generator):
    tokens, hidden = 7, 64
    residual, fn, scale, base, weight = bf16_mhc_case(generator, (tokens,), hidden)
    residual_, fn_, scale_, base_, weight_ = leaves(residual, fn, scale, base, weight)
    layer_in, (post, comb) = md.mhc_pre(residual_, fn_, scale_, base_, norm_weight=weight_, **PRE_OPTIONS)
    y = rand(generator, tokens, hidden, dtype=BF16).requires_grad_(True)
    out = md.mhc_post(y, residual_, post, comb)
    assert torch.equal(out, rm.mhc_post(y.detach(), residual, post.detach(), comb.detach()))

    g_out = rand(generator, tokens, N, hidden, dtype=BF16)
    g_in = rand(generator, tokens, hidden, dtype=BF16)
    torch.autograd.backward((out, layer_in), (g_out, g_in))

    # The same gradients from the public explicit backwards: post → pre-apply → Sinkhorn → split → norm-fn.
    mixes = rm.mhc_pre_norm_fn(residual, fn, weight, 1e-6)
    pre_s, post_s, logits = rm.mhc_pre_split_mixes(mixes, scale, base, N, 2.0, 1e-6)
    comb_s = rm.sinkhorn_normalize(logits, 20, 1e-6)
    d_y, d_res_post, d_post, d_comb = rm.mhc_post_bwd(g_out, y.detach(), residual, post_s, comb_s)
    d_res_apply, d_pre = rm.mhc_pre_apply_mix_bwd(g_in, residual, pre_s)
    d_logits = rm.sinkhorn_normalize_bwd(d_comb, logits, 20, 1e-6)
    d_mixes, d_scale, d_base = rm.mhc_pre_split_mixes_bwd(d_pre, d_post, d_logits, mixes, scale, base, N, 2.0)
    d_res_norm, d_fn, d_weight = rm.mhc_pre_norm_fn_bwd(d_mixes, residual, fn, weight, 1e-6)
    terms = (d_res_post.float(), d_res_apply.float(), d_res_norm)

    assert torch.equal(y.grad, d_y)  # one use, same fp32 sum of n terms, rounded once
    # The residual is read by two layers, so its bf16 gradient is a sum of terms rounded to bf16 in a
    # different grouping (see the module docstring): a few bf16 roundings of the terms apart, which
    # near a cancellation is large relative to the sum itself.
    magnitude = sum(t.abs() for t in terms)
    assert bool(((residual_.grad.float() - sum(terms)).abs() <= 2**-7 * magnitude + 1e-6).all())
    for got, want in ((fn_.grad, d_fn), (scale_.grad, d_scale), (base_.grad, d_base), (weight_.grad, d_weight)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_mhc_head_and_expand_bf16_against_the_operators(generator):
    tokens, hidden = 5, 48
    residual, _, _, _, weight = bf16_mhc_case(generator, (tokens,), hidden)
    fn = rand(generator, N, N * hidden, dtype=torch.float32, scale=0.02)
    scale, base = torch.tensor(0.8), rand(generator, N, dtype=torch.float32)  # a scalar scale is accepted
    out = md.mhc_head(residual, fn, scale, base, norm_weight=weight, pre_eps=1e-6)
    mixes = rm.mhc_pre_norm_fn(residual, fn, weight, 1e-6)
    head_mix = rm.mhc_head_compute_mix(mixes, scale.reshape(1), base, 1e-6)
    assert out.dtype == BF16 and torch.equal(out, rm.mhc_pre_apply_mix(residual, head_mix))
    padded = torch.cat([fn, torch.zeros(M3 - N, N * hidden)])  # TileKernels' zero-padded form
    assert torch.equal(md.mhc_head(residual, padded, scale, base, norm_weight=weight, pre_eps=1e-6), out)

    h = rand(generator, 2, tokens, hidden, dtype=BF16).requires_grad_(True)
    streams = md.expand_from_embedding(h, N)
    assert streams.shape == (2, tokens, N, hidden) and all(torch.equal(streams[:, :, i], h) for i in range(N))
    grad = rand(generator, 2, tokens, N, hidden, dtype=BF16)
    streams.backward(grad)
    assert torch.equal(h.grad, rm.expand_to_mhc_bwd(grad.reshape(-1, N, hidden)).reshape(2, tokens, hidden))


# ---------------------------------------------------------------------------------------------
# Modules and validation
# ---------------------------------------------------------------------------------------------


def test_modules(generator):
    pre = md.MHCPre(8, N, post_mult_value=2.0, sinkhorn_repeat=20)
    assert [name for name, _ in pre.named_parameters()] == ["fn", "scale", "base", "norm_weight"]
    assert pre.fn.shape == (M3, N * 8) and bool((pre.fn == 0).all()) and torch.equal(pre.scale, torch.full((3,), 0.01))
    assert md.MHCPre(8, N, use_norm_weight=False).norm_weight is None
    head = md.MHCHead(8, N)
    assert [tuple(p.shape) for p in head.parameters()] == [(N, N * 8), (1,), (N,), (N * 8,)]
    gate = md.EngramGate(N, 8)
    assert gate.weight_hidden.dtype == BF16 and bool((gate.weight_embed == 1).all())

    h = rand(generator, 3, 8, dtype=BF16)
    streams = md.ExpandFromEmbedding(N)(h)
    layer_in, (post, comb) = pre(streams)
    # fn = 0 and base = 0: pre = σ(0) + eps, comb uniform, so the layer input is 4·0.5·h rounded
    assert torch.equal(layer_in, (2 * h.float()).to(BF16))
    torch.testing.assert_close(comb, torch.full((3, N, N), 0.25), atol=1e-5, rtol=0)
    out = md.MHCPost()(layer_in, streams, post, comb)
    loss = head(out).float().square().sum() + gate(out, out, h).float().sum()
    loss.backward()
    assert all(p.grad is not None for p in (*pre.parameters(), *head.parameters(), *gate.parameters()))


def test_validation_errors():
    x = torch.zeros(2, N, 8, dtype=BF16)
    fn, scale, base = torch.zeros(M3, N * 8), torch.ones(3), torch.zeros(M3)
    with pytest.raises(ValueError, match="mhc_mult must equal the number of streams"):
        md.mhc_pre(x, fn, scale, base, mhc_mult=2)
    with pytest.raises(TypeError, match="fn must have dtype in \\(float32\\)"):
        md.mhc_pre(x, fn.double(), scale, base)
    with pytest.raises(ValueError, match=r"fn must have shape \(24, 32\)"):
        md.mhc_pre(x, fn[:, :-1], scale, base)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        md.mhc_pre(x, fn, scale, base, norm_weight=torch.ones(N * 8 + 1))
    with pytest.raises(ValueError, match="sinkhorn_repeat"):
        md.mhc_pre(x, fn, scale, base, sinkhorn_repeat=0)
    with pytest.raises(ValueError, match="post_layer_mix must have shape"):
        md.mhc_post(torch.zeros(2, 8, dtype=BF16), x, torch.zeros(2, N + 1), torch.zeros(2, N, N))
    with pytest.raises(TypeError, match="x must have dtype in \\(bfloat16\\)"):
        md.mhc_post(torch.zeros(2, 8), x, torch.zeros(2, N), torch.zeros(2, N, N))
    with pytest.raises(ValueError, match=r"fn must have shape \(4, 32\)"):
        md.mhc_head(x, torch.zeros(N - 1, N * 8), torch.ones(1), torch.zeros(N))
    with pytest.raises(TypeError, match="residual must have dtype"):
        md.mhc_head(x.to(torch.float16), torch.zeros(N, N * 8), torch.ones(1), torch.zeros(N))
    with pytest.raises(ValueError, match="at least 2-D"):
        md.mhc_pre(torch.zeros(8, dtype=BF16), fn, scale, base)
    with pytest.raises(ValueError, match="mhc_mult"):
        md.expand_from_embedding(torch.zeros(2, 8, dtype=BF16), 0)
    w = torch.ones(N, 8, dtype=BF16)
    with pytest.raises(ValueError, match=r"k must have shape \(2, 4, 8\)"):
        md.engram_gate(x, x[:, :2], x[:, 0], w, w, 1e-6, 1e-6)
    with pytest.raises(TypeError, match="weight_embed must have dtype in \\(bfloat16\\)"):
        md.engram_gate(x, x, x[:, 0], w, w.float(), 1e-6, 1e-6)
    with pytest.raises(ValueError, match="clamp_value"):
        md.engram_gate(x, x, x[:, 0], w, w, 0.0, 1e-6)
