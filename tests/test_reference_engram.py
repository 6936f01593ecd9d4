"""The reference twin of the Engram family, proven on its own (CPU only).

- ``engram_hash`` against a pure-Python hash (Python integers masked to 64 bits for the wrapping
  multiply, XOR, Python's floored ``%``), including multipliers that overflow int64.
- The gate's explicit backward against ``torch.autograd`` of the forward, both run in float64 from
  the same named steps (``gate_forward_math`` / ``gate_backward_math``): first
  ``torch.autograd.gradcheck`` proves the forward's autograd gradient equals finite differences,
  then the explicit backward is matched to autograd's gradients for x, k, v and w (and, through
  ``grad_w_reduce``, wh and we), on both branches of the clamp; finally gradcheck is run directly
  on an autograd.Function whose backward *is* the explicit backward.
- The bf16/fp32 public entry points against the float64 math (dtypes, shapes, strides, tolerance).
"""

from __future__ import annotations

import pytest
import torch

from tileproof.reference import engram as re

F64 = torch.float64

# ---------------------------------------------------------------------------------------------
# Hash
# ---------------------------------------------------------------------------------------------


def wrap64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def python_hash(ids, mults, vocab, offsets):
    layers, max_ngram = len(mults), len(mults[0])
    tables = len(vocab[0][0])
    out = []
    for layer in range(layers):
        rows = []
        for token_ids in ids:
            row = []
            mixed = 0
            for i in range(max_ngram):
                mixed ^= wrap64(token_ids[i] * mults[layer][i])
                if i == 0:
                    continue
                for j in range(tables):
                    row.append(mixed % vocab[layer][i - 1][j] + offsets[layer][(i - 1) * tables + j])
            rows.append(row)
        out.append(rows)
    return out


def make_hash_case(generator, tokens, max_ngram, layers, tables, *, huge_multipliers):
    ids = torch.randint(0, 129280, (tokens, max_ngram), dtype=torch.int32, generator=generator)
    if huge_multipliers:  # products overflow int64: the wrapped hash can be negative
        mults = torch.randint(-(2**62), 2**62, (layers, max_ngram), dtype=torch.int64, generator=generator) * 2 + 1
    else:  # Engram's construction: odd, below (2^63 - 1) / |V| / 2, so nothing overflows
        bound = (2**63 - 1) // 129280 // 2
        mults = torch.randint(0, bound, (layers, max_ngram), dtype=torch.int64, generator=generator) * 2 + 1
    vocab = torch.randint(1000, 200000, (layers, max_ngram - 1, tables), dtype=torch.int32, generator=generator)
    offsets = torch.cat(
        [torch.zeros(layers, 1, dtype=torch.int64), vocab.reshape(layers, -1).to(torch.int64).cumsum(1)[:, :-1]], dim=1
    ).to(torch.int32)
    return ids, mults, vocab, offsets


@pytest.mark.parametrize("huge_multipliers", (False, True), ids=("engram-multipliers", "wrapping"))
@pytest.mark.parametrize("max_ngram,layers,tables", [(2, 1, 1), (3, 2, 8), (4, 1, 8)])
def test_hash_matches_python(generator, huge_multipliers, max_ngram, layers, tables):
    ids, mults, vocab, offsets = make_hash_case(
        generator, 37, max_ngram, layers, tables, huge_multipliers=huge_multipliers
    )
    out = re.engram_hash(ids, mults, vocab, offsets)
    assert out.dtype == torch.int32 and out.is_contiguous()
    assert out.shape == (layers, 37, (max_ngram - 1) * tables)
    expected = python_hash(ids.tolist(), mults.tolist(), vocab.tolist(), offsets.tolist())
    assert out.tolist() == expected
    # Every id lies inside its own table: [offset, offset + vocab).
    low = offsets.unsqueeze(1)
    high = low + vocab.reshape(layers, 1, -1)
    assert bool(((out >= low) & (out < high)).all())


def test_hash_wrapping_produces_negative_mix_yet_valid_ids():
    # 2^62 + 1 times 4 wraps to 4 (mod 2^64) ... choose a product that wraps negative: 3 · (2^62 + 1).
    ids = torch.tensor([[3, 0]], dtype=torch.int32)
    mults = torch.tensor([[2**62 + 1, 1]], dtype=torch.int64)
    vocab = torch.tensor([[[7]]], dtype=torch.int32)
    offsets = torch.tensor([[100]], dtype=torch.int32)
    mixed = wrap64(3 * (2**62 + 1))
    assert mixed < 0
    assert re.engram_hash(ids, mults, vocab, offsets).tolist() == [[[mixed % 7 + 100]]]


def test_hash_empty_and_validation():
    ids = torch.zeros((0, 3), dtype=torch.int32)
    mults = torch.ones((2, 3), dtype=torch.int64)
    vocab = torch.full((2, 2, 4), 5, dtype=torch.int32)
    offsets = torch.zeros((2, 8), dtype=torch.int32)
    assert re.engram_hash(ids, mults, vocab, offsets).shape == (2, 0, 8)
    with pytest.raises(TypeError, match="ngram_token_ids must have dtype in \\(int32\\)"):
        re.engram_hash(ids.long(), mults, vocab, offsets)
    with pytest.raises(ValueError, match="offsets must have shape \\(2, 8\\)"):
        re.engram_hash(ids, mults, vocab, offsets[:, :4])
    with pytest.raises(ValueError, match="vocab_sizes must be positive"):
        re.engram_hash(ids, mults, torch.zeros_like(vocab), offsets)
    with pytest.raises(ValueError, match="ngram_token_ids must be non-negative"):
        re.engram_hash(torch.full((1, 3), -1, dtype=torch.int32), mults, vocab, offsets)


# ---------------------------------------------------------------------------------------------
# Gate: float64 proofs of the explicit backward
# ---------------------------------------------------------------------------------------------

CLAMP = 0.3  # large on purpose: a good share of the (token, stream) pairs fall on the clamped branch
EPS = 1e-6


def scores(x, k, w, eps=EPS):
    _, dot, _, rstd_x, rstd_k = re.gate_forward_math(x, k, torch.zeros_like(x[:, 0]), w, eps, CLAMP)
    return dot * rstd_x * rstd_k * x.shape[-1] ** -0.5


def float64_case(generator, tokens=6, streams=4, hidden=16):
    """Random float64 inputs whose scores all keep away from the forward's two kinks.

    The forward is not smooth at s = 0 (the sign jumps when clamp_value > 0) nor at |s| = clamp_value;
    finite differences (step 1e-6) must not straddle them, so tokens are drawn from a pool of 64 and
    only those whose every stream keeps a margin of 1e-3 from both are kept (deterministic per seed).
    """
    pool = 64
    x = torch.randn(pool, streams, hidden, dtype=F64, generator=generator)
    k = torch.randn(pool, streams, hidden, dtype=F64, generator=generator)
    v = torch.randn(pool, hidden, dtype=F64, generator=generator)
    w = 1 + 0.5 * torch.randn(streams, hidden, dtype=F64, generator=generator)
    s = scores(x, k, w)
    margin = 1e-3
    smooth = ((s.abs() > margin) & ((s.abs() - CLAMP).abs() > margin)).all(dim=1)
    keep = torch.nonzero(smooth).flatten()[:tokens]
    assert keep.numel() == tokens
    return x[keep], k[keep], v[keep], w, s[keep]


def test_gradcheck_forward_in_float64(generator):
    x, k, v, w, s = float64_case(generator)
    assert bool((s.abs() < CLAMP).any()) and bool((s.abs() >= CLAMP).any()), "both clamp branches must be present"
    inputs = tuple(t.clone().requires_grad_() for t in (x, k, v, w))
    assert torch.autograd.gradcheck(lambda *a: re.gate_forward_math(*a, EPS, CLAMP)[0], inputs)


@pytest.mark.parametrize("num_partials", (1, 4, 9))
def test_explicit_backward_equals_autograd_float64(generator, num_partials):
    x, k, v, w, s = float64_case(generator)
    assert bool((s.abs() < CLAMP).any()) and bool((s.abs() >= CLAMP).any())
    leaves = [t.clone().requires_grad_() for t in (x, k, v, w)]
    out, dot, gate, rstd_x, rstd_k = re.gate_forward_math(*leaves, EPS, CLAMP)
    grad_out = torch.randn(out.shape, dtype=F64, generator=generator)
    expected = torch.autograd.grad(out, leaves, grad_out)

    saved = [t.detach() for t in (dot, gate, rstd_x, rstd_k)]
    dx, dk, dv, dw_partial = re.gate_backward_math(grad_out, x, k, v, w, *saved, CLAMP, num_partials)
    assert dw_partial.shape == (num_partials, *w.shape)
    for name, got, want in zip(("dx", "dk", "dv", "dw"), (dx, dk, dv, dw_partial.sum(0)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


def test_clamped_branch_has_zero_beta(generator):
    # Every score below the clamp: k carries no gradient, dx is exactly grad_out, dw is exactly 0.
    x, k, v, w, _ = float64_case(generator)
    w = w * 1e-4  # RMSNorm removes the scale of x and k, so shrink s through w: |s| ∝ |Σ x·w·k|
    s = scores(x, k, w)
    assert bool((s.abs() < CLAMP).all())
    leaves = [t.clone().requires_grad_() for t in (x, k, v, w)]
    out, dot, gate, rstd_x, rstd_k = re.gate_forward_math(*leaves, EPS, CLAMP)
    grad_out = torch.randn(out.shape, dtype=F64, generator=generator)
    auto = torch.autograd.grad(out, leaves, grad_out)
    dx, dk, dv, dw_partial = re.gate_backward_math(
        grad_out, x, k, v, w, *(t.detach() for t in (dot, gate, rstd_x, rstd_k)), CLAMP
    )
    assert torch.equal(dx, grad_out) and bool((dk == 0).all()) and bool((dw_partial == 0).all())
    for got, want in zip((dx, dk, dv, dw_partial[0]), auto, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class ExplicitGate(torch.autograd.Function):
    """Forward from ``gate_forward_math``, backward from ``gate_backward_math``: gradcheck the latter."""

    @staticmethod
    def forward(ctx, x, k, v, w):
        out, dot, gate, rstd_x, rstd_k = re.gate_forward_math(x, k, v, w, EPS, CLAMP)
        ctx.save_for_backward(x, k, v, w, dot, gate, rstd_x, rstd_k)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        dx, dk, dv, dw_partial = re.gate_backward_math(grad_out, *ctx.saved_tensors, CLAMP, 3)
        return dx, dk, dv, dw_partial.sum(0)


def test_gradcheck_explicit_backward_float64(generator):
    x, k, v, w, s = float64_case(generator)
    assert bool((s.abs() < CLAMP).any()) and bool((s.abs() >= CLAMP).any())
    inputs = tuple(t.clone().requires_grad_() for t in (x, k, v, w))
    assert torch.autograd.gradcheck(ExplicitGate.apply, inputs)


def test_gain_gradients_through_grad_w_reduce_float64(generator):
    # w = wh ⊙ we: autograd's gradients for the gains equal grad_w_reduce of the explicit partials.
    x, k, v, _, _ = float64_case(generator)
    wh = (1 + 0.3 * torch.randn(4, 16, generator=generator)).to(torch.bfloat16)
    we = (1 + 0.3 * torch.randn(4, 16, generator=generator)).to(torch.bfloat16)
    wh64, we64 = (t.to(F64).requires_grad_() for t in (wh, we))
    out, dot, gate, rstd_x, rstd_k = re.gate_forward_math(x, k, v, wh64 * we64, EPS, CLAMP)
    grad_out = torch.randn(out.shape, dtype=F64, generator=generator)
    auto_wh, auto_we = torch.autograd.grad(out, (wh64, we64), grad_out)

    w32 = re.fused_weight(wh, we)
    saved = [t.detach() for t in (dot, gate, rstd_x, rstd_k)]
    _, _, _, dw_partial = re.gate_backward_math(grad_out, x, k, v, w32.to(F64), *saved, CLAMP, 5)
    grad_wh = torch.zeros(4, 16)
    grad_we = torch.zeros(4, 16)
    re.grad_w_reduce(dw_partial.to(torch.float32), wh, we, grad_wh, grad_we)
    torch.testing.assert_close(grad_wh.to(F64), auto_wh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_we.to(F64), auto_we, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Gate: the public bf16 entry points
# ---------------------------------------------------------------------------------------------


def bf16_case(generator, tokens=33, streams=4, hidden=256):
    x = torch.randn(tokens, streams, hidden, generator=generator).to(torch.bfloat16)
    # k and v are views into one fused projection output [T, (n+1)·D] (strides (5D, D, 1) and (5D, 1)).
    fused = torch.randn(tokens, (streams + 1) * hidden, generator=generator).to(torch.bfloat16)
    k = fused[:, : streams * hidden].view(tokens, streams, hidden)
    v = fused[:, streams * hidden :]
    wh = (1 + 0.1 * torch.randn(streams, hidden, generator=generator)).to(torch.bfloat16)
    we = (1 + 0.1 * torch.randn(streams, hidden, generator=generator)).to(torch.bfloat16)
    return x, k, v, wh, we


def test_fused_weight_is_exact(generator):
    _, _, _, wh, we = bf16_case(generator)
    w = re.fused_weight(wh, we)
    assert w.dtype == torch.float32 and w.shape == wh.shape and w.is_contiguous()
    assert torch.equal(w.to(F64), wh.to(F64) * we.to(F64))  # bf16 × bf16 is exact in fp32


def test_forward_dtypes_and_values(generator):
    x, k, v, wh, we = bf16_case(generator)
    assert not k.is_contiguous() and not v.is_contiguous()
    w = re.fused_weight(wh, we)
    out, dot, gate, rstd_x, rstd_k = re.engram_gate_fwd(x, k, v, w, 1e-20, 1e-6)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and out.is_contiguous()
    for t in (dot, gate, rstd_x, rstd_k):
        assert t.dtype == torch.float32 and t.shape == x.shape[:2] and t.is_contiguous()
    ref = re.gate_forward_math(x.to(F64), k.to(F64), v.to(F64), w.to(F64), 1e-20, 1e-6)
    # out is the fp32 result rounded once: within one bf16 ulp of the float64 result.
    torch.testing.assert_close(out.to(F64), ref[0], rtol=2**-8, atol=1e-6)
    for got, want in zip((dot, gate, rstd_x, rstd_k), ref[1:], strict=True):
        torch.testing.assert_close(got.to(F64), want, rtol=1e-5, atol=1e-5)
    none = re.engram_gate_fwd(x, k, v, w, 1e-20, 1e-6, save_for_backward=False)
    assert torch.equal(none[0], out) and none[1:] == (None, None, None, None)


def test_zero_score_gives_half_gate(generator):
    x, k, v, wh, we = bf16_case(generator, tokens=2)
    x[0] = 0  # a zero (padded) token: dot = 0, s = 0, sign(0) = 0, gate = σ(0) = 1/2
    _, dot, gate, _, _ = re.engram_gate_fwd(x, k, v, re.fused_weight(wh, we), 1e-20, 1e-6)
    assert bool((dot[0] == 0).all()) and bool((gate[0] == 0.5).all())


@pytest.mark.parametrize("num_partials", (1, 114, 132))
def test_backward_bf16_against_float64_and_partials(generator, num_partials):
    x, k, v, wh, we = bf16_case(generator)  # T = 33 < 114: most blocks are empty
    w = re.fused_weight(wh, we)
    _, dot, gate, rstd_x, rstd_k = re.engram_gate_fwd(x, k, v, w, 1e-6, 1e-6)
    grad_out = torch.randn(x.shape, generator=generator).to(torch.bfloat16)
    dx, dk, dv, dw_partial = re.engram_gate_bwd(
        grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, 1e-6, num_partials=num_partials
    )
    assert [t.dtype for t in (dx, dk, dv, dw_partial)] == [torch.bfloat16] * 3 + [torch.float32]
    assert dx.shape == dk.shape == x.shape and dv.shape == (33, 256) and dw_partial.shape == (num_partials, 4, 256)
    assert all(t.is_contiguous() for t in (dx, dk, dv, dw_partial))

    leaves = [t.to(F64).requires_grad_() for t in (x, k, v, wh, we)]
    out64 = re.gate_forward_math(*leaves[:3], leaves[3] * leaves[4], 1e-6, 1e-6)[0]
    auto = torch.autograd.grad(out64, leaves, grad_out.to(F64))
    for got, want in zip((dx, dk, dv), auto[:3], strict=True):
        torch.testing.assert_close(got.to(F64), want, rtol=2**-7, atol=2e-3)

    grad_wh = torch.zeros(4, 256)
    grad_we = torch.ones(4, 256)  # accumulates: the result is 1 + gradient
    assert re.grad_w_reduce(dw_partial, wh, we, grad_wh, grad_we) is None
    torch.testing.assert_close(grad_wh.to(F64), auto[3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_we.to(F64) - 1, auto[4], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_partials", (114, 132))
def test_grad_w_reduce_any_partial_count(generator, num_partials):
    partials = torch.randn(num_partials, 4, 64, generator=generator)
    wh = torch.randn(4, 64, generator=generator).to(torch.bfloat16)
    we = torch.randn(4, 64, generator=generator).to(torch.bfloat16)
    grad_wh = torch.randn(4, 64, generator=generator)
    grad_we = torch.randn(4, 64, generator=generator)
    start_wh, start_we = grad_wh.clone(), grad_we.clone()
    re.grad_w_reduce(partials, wh, we, grad_wh, grad_we)
    total = partials.to(F64).sum(0)
    torch.testing.assert_close(grad_wh.to(F64), start_wh.to(F64) + total * we.to(F64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_we.to(F64), start_we.to(F64) + total * wh.to(F64), rtol=1e-5, atol=1e-5)


def test_gate_validation(generator):
    x, k, v, wh, we = bf16_case(generator, tokens=2, hidden=8)
    w = re.fused_weight(wh, we)
    with pytest.raises(TypeError, match="x must have dtype in \\(bfloat16\\)"):
        re.engram_gate_fwd(x.float(), k, v, w, 1e-6, 1e-6)
    with pytest.raises(TypeError, match="w must have dtype in \\(float32\\)"):
        re.engram_gate_fwd(x, k, v, w.bfloat16(), 1e-6, 1e-6)
    with pytest.raises(ValueError, match="v must have shape \\(2, 8\\)"):
        re.engram_gate_fwd(x, k, v[:, :4], w, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="k must have unit stride"):
        re.engram_gate_fwd(x, k.transpose(1, 2).contiguous().transpose(1, 2), v, w, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="clamp_value must be a finite float > 0"):
        re.engram_gate_fwd(x, k, v, w, 1e-6, 0.0)
    with pytest.raises(ValueError, match="eps must be a finite float >= 0"):
        re.engram_gate_fwd(x, k, v, w, -1.0, 1e-6)
    with pytest.raises(ValueError, match="we must have shape"):
        re.fused_weight(wh, we[:, :4])
    with pytest.raises(ValueError, match="num_partials must be a positive int"):
        stats = re.engram_gate_fwd(x, k, v, w, 1e-6, 1e-6)[1:]
        re.engram_gate_bwd(x, x, k, v, w, *stats, 1e-6, num_partials=0)
    with pytest.raises(ValueError, match="grad_wh must have shape"):
        re.grad_w_reduce(torch.zeros(3, 4, 8), wh, we, torch.zeros(4, 4), torch.zeros(4, 8))
