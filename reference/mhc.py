"""Reference twin of the mHC family (contract §5): the executable specification.

Manifold-constrained HyperConnection keeps ``n`` residual streams ``X [T, n, C]`` (bf16; n = 4 in
DeepSeek's models) and mixes them around each sublayer with per-token coefficients computed from
the flattened stream. Full math and sources: ``engram-mhc-math.md`` §A.

Rules of this twin:

- **Layout.** Tokens are flattened to one leading dimension ``T`` (TileKernels carries
  ``[batch, seq, ...]``; the arithmetic is per token, so the two agree after a reshape). Per-token
  coefficients: ``pre, post [T, n]``, ``comb [T, n, n]`` indexed ``[i = source, o = destination]``.
  Mixes order ``[pre n | post n | comb n²]``, comb row-major: column ``2n + i·n + o`` is ``comb[i, o]``.
- **Numerics.** Streams are stored in bf16, coefficients in fp32. All arithmetic happens in the
  *math dtype* (fp32; fp64 when the ``*_math`` helpers are called with fp64 tensors, which the tests
  use to prove each explicit backward by gradcheck). Stored bf16 outputs are rounded once, at the end,
  to nearest even. Reductions accumulate in the math dtype.
- **Sinkhorn.** ``P = softmax_o(L) + eps`` (max-subtracted softmax), ``P /= Σ_i P + eps``, then
  ``repeat − 1`` times ``P /= Σ_o P + eps``; ``P /= Σ_i P + eps``. The last step normalises over the
  source ``i``, so every column ``Σ_i comb[i, o]`` is 1 up to ``eps``. The backward recomputes the
  iterations from ``L`` (nothing is stored) and walks each step ``Y = P / (S + eps)`` in reverse:
  ``dP = (dY − Σ_a(dY⊙P) / (S + eps)) / (S + eps)``; then ``dL = (dQ − Σ_o dQ⊙Q)⊙Q`` with ``Q``
  the softmax *before* ``+ eps``.
- **Split.** ``z = scale ⊙ mixes + base`` (scale[0] over pre, [1] over post, [2] over comb);
  ``pre = σ(z_pre) + pre_eps``, ``post = post_mult·σ(z_post)``, ``comb = z_comb`` viewed ``[n, n]``.
- **Apply / post.** ``layer_in[c] = Σ_i pre_i X[i, c]``; ``X'[o, c] = post_o y[c] + Σ_i comb[i, o] X[i, c]``
  (comb transposed: the sum runs over the *source* index).
- **Norm-fn.** ``mixes = (x @ fnᵀ) · rsqrt(Σx² / (nC) + eps)``, x the flattened stream in fp32, the
  norm weight (if any) folded as ``fn ⊙ γ``. The reference multiplies in full fp32; the optimized
  kernel rounds fn to TF32 for the tensor core. That is a documented tolerance, not a rule: see
  ``docs/mhc.md``.
- **Big fuse** (inference). ``mhc_pre_big_fuse`` is norm-fn → split → Sinkhorn → pre-apply in one
  call; it is *defined* as those four steps run one by one (bit for bit), the norm weight included
  (folded into fn exactly as in ``mhc_pre_norm_fn``).
- **Multilayer recompute.** ``mhc_multilayer_recompute`` replays L consecutive layers from the
  first residual ``X_0`` and the saved per-layer coefficients and sublayer outputs ``y_l``:
  ``layer_in_l = bf16(Σ_i pre_l,i · X_l[i])`` and ``X_{l+1} = bf16(post_l ⊗ y_l + comb_lᵀ X_l)``. Each
  ``X_{l+1}`` is rounded to bf16 *before* it feeds layer l + 1, as the stored residual of the unfused
  path is, so the replay is bit-identical to ``mhc_pre_apply_mix`` / ``mhc_post`` run layer by layer.
"""

from __future__ import annotations

import torch
from einops import einsum, rearrange, reduce

from .contract import check_nonnegative_float, check_positive_int, check_shape, check_tensor

__all__ = [
    "sinkhorn_normalize",
    "sinkhorn_normalize_bwd",
    "mhc_pre_split_mixes",
    "mhc_pre_split_mixes_bwd",
    "mhc_pre_apply_mix",
    "mhc_pre_apply_mix_bwd",
    "mhc_post",
    "mhc_post_bwd",
    "expand_to_mhc",
    "expand_to_mhc_bwd",
    "mhc_head_compute_mix",
    "mhc_head_compute_mix_bwd",
    "mhc_pre_norm_fn",
    "mhc_pre_norm_fn_bwd",
    "mhc_pre_big_fuse",
    "mhc_multilayer_recompute",
    "sinkhorn_forward_math",
    "sinkhorn_backward_math",
    "split_mixes_forward_math",
    "split_mixes_backward_math",
    "apply_mix_forward_math",
    "apply_mix_backward_math",
    "post_forward_math",
    "post_backward_math",
    "head_mix_forward_math",
    "head_mix_backward_math",
    "norm_fn_forward_math",
    "norm_fn_backward_math",
    "norm_fn_statistics_math",
]

F32 = torch.float32
BF16 = torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def check_square(name: str, comb: torch.Tensor) -> int:
    check_tensor(name, comb, dtypes=(F32,), ndim=3)
    if comb.shape[1] != comb.shape[2]:
        raise ValueError(f"{name} must be [T, n, n], got shape {tuple(comb.shape)}")
    return comb.shape[1]


# ---------------------------------------------------------------------------------------------
# Sinkhorn
# ---------------------------------------------------------------------------------------------

# Axis of each normalisation step on a [T, i, o] tensor: -1 sums over o (rows), -2 over i (columns).
_ROWS, _COLUMNS = -1, -2


def _sinkhorn_axes(repeat: int) -> list[int]:
    """The 2·repeat − 1 normalisation steps after the softmax: columns, then (rows, columns) × (repeat − 1)."""
    return [_COLUMNS] + [_ROWS, _COLUMNS] * (repeat - 1)


def sinkhorn_forward_math(logits: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp from ``softmax_o(logits)``, in the dtype of ``logits`` ``[T, n, n]``."""
    p = torch.softmax(logits, dim=-1) + eps
    for axis in _sinkhorn_axes(repeat):
        p = p / (p.sum(axis, keepdim=True) + eps)
    return p


def sinkhorn_backward_math(grad: torch.Tensor, logits: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """Explicit Sinkhorn backward: recompute every pre-normalisation state, then walk them in reverse."""
    q = torch.softmax(logits, dim=-1)
    states = []  # (P before the step, S + eps, axis): the 2R − 1 steps' inputs
    p = q + eps
    for axis in _sinkhorn_axes(repeat):
        denominator = p.sum(axis, keepdim=True) + eps
        states.append((p, denominator, axis))
        p = p / denominator

    dp = grad
    for p, denominator, axis in reversed(states):
        # Y = P / (S + eps), S = Σ_axis P  →  dP = (dY − Σ_axis(dY⊙P) / (S + eps)) / (S + eps)
        dp = (dp - (dp * p).sum(axis, keepdim=True) / denominator) / denominator
    dq = dp  # + eps has unit derivative
    return (dq - (dq * q).sum(-1, keepdim=True)) * q  # softmax over o


def sinkhorn_normalize(comb_res_mix: torch.Tensor, repeat: int = 10, eps: float = 1e-6) -> torch.Tensor:
    """Project the comb logits onto (approximately) doubly stochastic matrices.

    Args:
        comb_res_mix: fp32 ``[T, n, n]`` logits ``L[t, i, o]`` (i = source, o = destination).
        repeat: Sinkhorn iterations R >= 1 (TileKernels' default 10; DeepSeek's models use 20).
        eps: finite, >= 0; added after the softmax and to every sum.

    Returns:
        fp32 ``[T, n, n]`` contiguous; its columns ``Σ_i comb[:, i, o]`` are 1 up to eps.
    """
    check_square("comb_res_mix", comb_res_mix)
    repeat = check_positive_int("repeat", repeat)
    eps = check_nonnegative_float("eps", eps)
    return sinkhorn_forward_math(comb_res_mix, repeat, eps).contiguous()


def sinkhorn_normalize_bwd(
    grad_output: torch.Tensor, comb_res_mix: torch.Tensor, repeat: int = 10, eps: float = 1e-6
) -> torch.Tensor:
    """Gradient of ``sinkhorn_normalize`` w.r.t. its logits, recomputing the iterations.

    Args:
        grad_output: fp32 ``[T, n, n]``, the gradient of the normalised matrix.
        comb_res_mix: fp32 ``[T, n, n]``, the forward's logits (the only saved tensor).
        repeat, eps: as in the forward.

    Returns:
        fp32 ``[T, n, n]`` contiguous, the gradient of the logits.
    """
    n = check_square("comb_res_mix", comb_res_mix)
    check_tensor("grad_output", grad_output, dtypes=(F32,), ndim=3)
    check_shape("grad_output", grad_output, (comb_res_mix.shape[0], n, n))
    repeat = check_positive_int("repeat", repeat)
    eps = check_nonnegative_float("eps", eps)
    return sinkhorn_backward_math(grad_output, comb_res_mix, repeat, eps).contiguous()


# ---------------------------------------------------------------------------------------------
# Split mixes
# ---------------------------------------------------------------------------------------------


def _group_scale(scale: torch.Tensor, n: int) -> torch.Tensor:
    """``[3] → [n² + 2n]``: scale[0] over the pre columns, [1] over post, [2] over comb."""
    return torch.cat([scale[0:1].expand(n), scale[1:2].expand(n), scale[2:3].expand(n * n)])


def split_mixes_forward_math(mixes, scale, base, n: int, post_mult: float, pre_eps: float):
    """``(pre [T, n], post [T, n], comb [T, n, n])`` in the dtype of ``mixes [T, n² + 2n]``."""
    z = mixes * _group_scale(scale, n) + base
    pre = torch.sigmoid(z[:, :n]) + pre_eps
    post = post_mult * torch.sigmoid(z[:, n : 2 * n])
    comb = rearrange(z[:, 2 * n :], "t (i o) -> t i o", i=n)
    return pre, post, comb


def split_mixes_backward_math(grad_pre, grad_post, grad_comb, mixes, scale, base, n: int, post_mult: float):
    """``(dmixes [T, n² + 2n], dscale [3], dbase [n² + 2n])``; σ is recomputed from the inputs."""
    z = mixes * _group_scale(scale, n) + base
    sig_pre = torch.sigmoid(z[:, :n])  # without pre_eps
    sig_post = torch.sigmoid(z[:, n : 2 * n])
    dz = torch.cat(
        [
            grad_pre * sig_pre * (1 - sig_pre),
            grad_post * post_mult * sig_post * (1 - sig_post),
            rearrange(grad_comb, "t i o -> t (i o)"),
        ],
        dim=1,
    )
    dmixes = dz * _group_scale(scale, n)
    per_column = reduce(dz * mixes, "t j -> j", "sum")
    dscale = torch.stack([per_column[:n].sum(), per_column[n : 2 * n].sum(), per_column[2 * n :].sum()])
    dbase = reduce(dz, "t j -> j", "sum")
    return dmixes, dscale, dbase


def check_split_inputs(input_mixes, mhc_scale, mhc_base, mhc_mult) -> int:
    n = check_positive_int("mhc_mult", mhc_mult)
    check_tensor("input_mixes", input_mixes, dtypes=(F32,), ndim=2)
    check_shape("input_mixes", input_mixes, (input_mixes.shape[0], n * n + 2 * n))
    check_tensor("mhc_scale", mhc_scale, dtypes=(F32,), ndim=1)
    check_shape("mhc_scale", mhc_scale, (3,))
    check_tensor("mhc_base", mhc_base, dtypes=(F32,), ndim=1)
    check_shape("mhc_base", mhc_base, (n * n + 2 * n,))
    return n


def mhc_pre_split_mixes(
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_mult: int,
    mhc_post_mult_value: float,
    mhc_pre_eps: float,
):
    """Split the normed mixes into the pre weights, post weights and comb logits.

    Args:
        input_mixes: fp32 ``[T, n² + 2n]``, ordered ``[pre | post | comb]``.
        mhc_scale: fp32 ``[3]`` (α_pre, α_post, α_res). mhc_base: fp32 ``[n² + 2n]``.
        mhc_mult: n. mhc_post_mult_value: the post multiplier (the paper uses 2.0).
        mhc_pre_eps: added to the pre weights.

    Returns:
        ``(pre fp32 [T, n], post fp32 [T, n], comb fp32 [T, n, n])``, contiguous; comb is the
        Sinkhorn input (logits).
    """
    n = check_split_inputs(input_mixes, mhc_scale, mhc_base, mhc_mult)
    post_mult = check_nonnegative_float("mhc_post_mult_value", mhc_post_mult_value)
    pre_eps = check_nonnegative_float("mhc_pre_eps", mhc_pre_eps)
    pre, post, comb = split_mixes_forward_math(input_mixes, mhc_scale, mhc_base, n, post_mult, pre_eps)
    return pre.contiguous(), post.contiguous(), comb.contiguous()


def mhc_pre_split_mixes_bwd(
    grad_pre: torch.Tensor,
    grad_post: torch.Tensor,
    grad_comb: torch.Tensor,
    input_mixes: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    mhc_mult: int,
    mhc_post_mult_value: float,
):
    """Explicit backward of ``mhc_pre_split_mixes`` (``pre_eps`` has no derivative).

    Returns:
        ``(dmixes fp32 [T, n² + 2n], dscale fp32 [3], dbase fp32 [n² + 2n])``; the parameter
        gradients are summed over tokens.
    """
    n = check_split_inputs(input_mixes, mhc_scale, mhc_base, mhc_mult)
    tokens = input_mixes.shape[0]
    for name, value, shape in (
        ("grad_pre", grad_pre, (tokens, n)),
        ("grad_post", grad_post, (tokens, n)),
        ("grad_comb", grad_comb, (tokens, n, n)),
    ):
        check_tensor(name, value, dtypes=(F32,), ndim=len(shape))
        check_shape(name, value, shape)
    post_mult = check_nonnegative_float("mhc_post_mult_value", mhc_post_mult_value)
    out = split_mixes_backward_math(grad_pre, grad_post, grad_comb, input_mixes, mhc_scale, mhc_base, n, post_mult)
    return tuple(t.contiguous() for t in out)


# ---------------------------------------------------------------------------------------------
# Pre-apply and post
# ---------------------------------------------------------------------------------------------


def apply_mix_forward_math(residual, mix):
    """``layer_in[t, c] = Σ_i mix[t, i] · X[t, i, c]`` in the math dtype."""
    return einsum(mix, residual, "t i, t i c -> t c")


def apply_mix_backward_math(grad, residual, mix):
    """``(dX [T, n, C] = mix_i · g, dmix [T, n] = Σ_c g · X_i)`` in the math dtype."""
    d_residual = einsum(mix, grad, "t i, t c -> t i c")
    d_mix = einsum(grad, residual, "t c, t i c -> t i")
    return d_residual, d_mix


def post_forward_math(x, residual, post, comb):
    """``X'[t, o, c] = post[t, o]·y[t, c] + Σ_i comb[t, i, o]·X[t, i, c]`` in the math dtype."""
    return einsum(post, x, "t o, t c -> t o c") + einsum(comb, residual, "t i o, t i c -> t o c")


def post_backward_math(grad, x, residual, post, comb):
    """``(dy [T, C], dX [T, n, C], dpost [T, n], dcomb [T, n, n])`` in the math dtype."""
    d_x = einsum(post, grad, "t o, t o c -> t c")
    d_residual = einsum(comb, grad, "t i o, t o c -> t i c")
    d_post = einsum(x, grad, "t c, t o c -> t o")
    d_comb = einsum(residual, grad, "t i c, t o c -> t i o")
    return d_x, d_residual, d_post, d_comb


def check_residual(name: str, residual) -> tuple[int, int, int]:
    check_tensor(name, residual, dtypes=(BF16,), ndim=3)
    return tuple(residual.shape)


def mhc_pre_apply_mix(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """Mix the n streams into the sublayer input.

    Args:
        x: bf16 ``[T, n, C]``, the residual streams.
        mix: fp32 ``[T, n]``, the pre weights.

    Returns:
        bf16 ``[T, C]`` contiguous: ``Σ_i mix_i · X[i]`` in fp32, rounded once.
    """
    tokens, n, _ = check_residual("x", x)
    check_tensor("mix", mix, dtypes=(F32,), ndim=2)
    check_shape("mix", mix, (tokens, n))
    return apply_mix_forward_math(x.to(F32), mix).to(BF16).contiguous()


def mhc_pre_apply_mix_bwd(grad_output: torch.Tensor, x: torch.Tensor, mix: torch.Tensor):
    """Explicit backward of ``mhc_pre_apply_mix``.

    Args:
        grad_output: bf16 ``[T, C]``. x, mix: the forward's inputs.

    Returns:
        ``(dx bf16 [T, n, C], dmix fp32 [T, n])``, contiguous; fp32 math.
    """
    tokens, n, hidden = check_residual("x", x)
    check_tensor("mix", mix, dtypes=(F32,), ndim=2)
    check_shape("mix", mix, (tokens, n))
    check_tensor("grad_output", grad_output, dtypes=(BF16,), ndim=2)
    check_shape("grad_output", grad_output, (tokens, hidden))
    d_residual, d_mix = apply_mix_backward_math(grad_output.to(F32), x.to(F32), mix)
    return d_residual.to(BF16).contiguous(), d_mix.contiguous()


def check_post_inputs(x, residual, post_layer_mix, comb_res_mix) -> tuple[int, int, int]:
    tokens, n, hidden = check_residual("residual", residual)
    check_tensor("x", x, dtypes=(BF16,), ndim=2)
    check_shape("x", x, (tokens, hidden))
    check_tensor("post_layer_mix", post_layer_mix, dtypes=(F32,), ndim=2)
    check_shape("post_layer_mix", post_layer_mix, (tokens, n))
    check_tensor("comb_res_mix", comb_res_mix, dtypes=(F32,), ndim=3)
    check_shape("comb_res_mix", comb_res_mix, (tokens, n, n))
    return tokens, n, hidden


def mhc_post(
    x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor
) -> torch.Tensor:
    """Write the sublayer output back into the streams and mix the residual.

    Args:
        x: bf16 ``[T, C]``, the sublayer output y.
        residual: bf16 ``[T, n, C]``, the streams X.
        post_layer_mix: fp32 ``[T, n]``. comb_res_mix: fp32 ``[T, n, n]`` (after Sinkhorn), [source, destination].

    Returns:
        bf16 ``[T, n, C]`` contiguous: ``post_o·y + Σ_i comb[i, o]·X[i]`` in fp32, rounded once.
    """
    check_post_inputs(x, residual, post_layer_mix, comb_res_mix)
    return post_forward_math(x.to(F32), residual.to(F32), post_layer_mix, comb_res_mix).to(BF16).contiguous()


def mhc_post_bwd(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor,
    post_layer_mix: torch.Tensor,
    comb_res_mix: torch.Tensor,
):
    """Explicit backward of ``mhc_post``.

    Args:
        grad_output: bf16 ``[T, n, C]``. The rest: the forward's inputs.

    Returns:
        ``(dx bf16 [T, C], dresidual bf16 [T, n, C], dpost fp32 [T, n], dcomb fp32 [T, n, n])``,
        contiguous; fp32 math, bf16 outputs rounded once.
    """
    tokens, n, hidden = check_post_inputs(x, residual, post_layer_mix, comb_res_mix)
    check_tensor("grad_output", grad_output, dtypes=(BF16,), ndim=3)
    check_shape("grad_output", grad_output, (tokens, n, hidden))
    d_x, d_residual, d_post, d_comb = post_backward_math(
        grad_output.to(F32), x.to(F32), residual.to(F32), post_layer_mix, comb_res_mix
    )
    return d_x.to(BF16).contiguous(), d_residual.to(BF16).contiguous(), d_post.contiguous(), d_comb.contiguous()


# ---------------------------------------------------------------------------------------------
# Expand
# ---------------------------------------------------------------------------------------------


def expand_to_mhc(hidden: torch.Tensor, mhc_mult: int) -> torch.Tensor:
    """Copy the hidden state into every stream: bf16 ``[T, C] → [T, n, C]`` contiguous (exact)."""
    check_tensor("hidden", hidden, dtypes=(BF16,), ndim=2)
    n = check_positive_int("mhc_mult", mhc_mult)
    return rearrange(hidden, "t c -> t 1 c").expand(-1, n, -1).contiguous()


def expand_to_mhc_bwd(grad_output: torch.Tensor) -> torch.Tensor:
    """Sum the streams' gradients: bf16 ``[T, n, C] → [T, C]``, fp32 accumulate, rounded once."""
    check_tensor("grad_output", grad_output, dtypes=(BF16,), ndim=3)
    return reduce(grad_output.to(F32), "t i c -> t c", "sum").to(BF16).contiguous()


# ---------------------------------------------------------------------------------------------
# Head mix
# ---------------------------------------------------------------------------------------------


def head_mix_forward_math(mix, scale, base, pre_eps: float):
    """``σ(scale·mix + base) + pre_eps`` in the math dtype; mix ``[T, n]``, scale ``[1]``, base ``[n]``."""
    return torch.sigmoid(mix * scale + base) + pre_eps


def head_mix_backward_math(grad, mix, scale, base):
    """``(dmix [T, n], dscale [1], dbase [n])``; σ recomputed without pre_eps."""
    sig = torch.sigmoid(mix * scale + base)
    dz = grad * sig * (1 - sig)
    return dz * scale, reduce(dz * mix, "t i -> 1", "sum"), reduce(dz, "t i -> i", "sum")


def check_head_inputs(input_mix, mhc_scale, mhc_base) -> tuple[int, int]:
    check_tensor("input_mix", input_mix, dtypes=(F32,), ndim=2)
    tokens, n = input_mix.shape
    check_tensor("mhc_scale", mhc_scale, dtypes=(F32,), ndim=1)
    check_shape("mhc_scale", mhc_scale, (1,))
    check_tensor("mhc_base", mhc_base, dtypes=(F32,), ndim=1)
    check_shape("mhc_base", mhc_base, (n,))
    return tokens, n


def mhc_head_compute_mix(
    input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor, mhc_pre_eps: float
) -> torch.Tensor:
    """Head weights before the LM head: fp32 ``[T, n]`` ``σ(s·m + b) + pre_eps``.

    Args:
        input_mix: fp32 ``[T, n]`` (the first n normed mixes). mhc_scale: fp32 ``[1]``. mhc_base: fp32 ``[n]``.
    """
    check_head_inputs(input_mix, mhc_scale, mhc_base)
    pre_eps = check_nonnegative_float("mhc_pre_eps", mhc_pre_eps)
    return head_mix_forward_math(input_mix, mhc_scale, mhc_base, pre_eps).contiguous()


def mhc_head_compute_mix_bwd(
    grad_output: torch.Tensor, input_mix: torch.Tensor, mhc_scale: torch.Tensor, mhc_base: torch.Tensor
):
    """Explicit backward: ``(dmix fp32 [T, n], dscale fp32 [1], dbase fp32 [n])``, parameters summed over tokens."""
    tokens, n = check_head_inputs(input_mix, mhc_scale, mhc_base)
    check_tensor("grad_output", grad_output, dtypes=(F32,), ndim=2)
    check_shape("grad_output", grad_output, (tokens, n))
    return tuple(t.contiguous() for t in head_mix_backward_math(grad_output, input_mix, mhc_scale, mhc_base))


# ---------------------------------------------------------------------------------------------
# Norm-fn
# ---------------------------------------------------------------------------------------------


def norm_fn_statistics_math(x, fn):
    """``[mul | sq]`` ``[T, m + 1]``: ``mul = x @ fnᵀ`` and ``sq = Σx²``, what the backward needs of the
    forward besides x; x ``[T, K]`` flattened, fn ``[m, K]`` (γ folded)."""
    mul = einsum(x, fn, "t k, m k -> t m")
    return torch.cat([mul, reduce(x * x, "t k -> t 1", "sum")], dim=1)


def norm_fn_forward_math(x, fn, eps: float, statistics=None):
    """``mixes [T, m] = (x @ fnᵀ) · rsqrt(Σx² / K + eps)``; x ``[T, K]`` flattened, fn ``[m, K]`` (γ folded);
    ``statistics`` (``norm_fn_statistics_math``) when already computed."""
    width = x.shape[1]
    statistics = norm_fn_statistics_math(x, fn) if statistics is None else statistics
    mul, sq = statistics[:, :-1], statistics[:, -1:]
    rstd = torch.rsqrt(sq / width + eps)
    return mul * rstd


def norm_fn_backward_math(grad, x, fn, eps: float, statistics=None):
    """``(dx [T, K], dfn [m, K])``: ``dmul = r·g``, ``dsq = −½(Σ_j g_j mul_j)·r / (sq + eps·K)``,
    ``dx = fnᵀ dmul + 2·dsq·x``, ``dfn = Σ_t dmul ⊗ x``; mul and sq from ``statistics`` when given (the
    forward's, ``norm_fn_statistics_math``), else recomputed from x."""
    width = x.shape[1]
    statistics = norm_fn_statistics_math(x, fn) if statistics is None else statistics
    mul, sq = statistics[:, :-1], statistics[:, -1:]
    rstd = torch.rsqrt(sq / width + eps)
    d_mul = grad * rstd
    d_sq = -0.5 * reduce(grad * mul, "t m -> t 1", "sum") * rstd / (sq + eps * width)
    d_x = einsum(d_mul, fn, "t m, m k -> t k") + 2 * d_sq * x
    d_fn = einsum(d_mul, x, "t m, t k -> m k")
    return d_x, d_fn


def check_grad_addend(grad_addend, tokens: int, n: int, hidden: int) -> None:
    """``mhc_pre_norm_fn_bwd``'s optional ``grad_addend`` (both twins): None or bf16 ``[T, n, C]``."""
    if grad_addend is not None:
        check_tensor("grad_addend", grad_addend, dtypes=(torch.bfloat16,), ndim=3)
        check_shape("grad_addend", grad_addend, (tokens, n, hidden))


def check_statistics(statistics, tokens: int, rows: int) -> None:
    """``mhc_pre_norm_fn_bwd``'s optional ``statistics`` (both twins): None or fp32 ``[T, m + 1]``."""
    if statistics is not None:
        check_tensor("statistics", statistics, dtypes=(F32,), ndim=2)
        check_shape("statistics", statistics, (tokens, rows + 1))


def check_norm_inputs(residual, mhc_fn, mhc_norm_weight) -> tuple[int, int, int]:
    tokens, n, hidden = check_residual("residual", residual)
    check_tensor("mhc_fn", mhc_fn, dtypes=(F32,), ndim=2)
    check_shape("mhc_fn", mhc_fn, (mhc_fn.shape[0], n * hidden))
    if mhc_norm_weight is not None:
        check_tensor("mhc_norm_weight", mhc_norm_weight, dtypes=(F32,), ndim=1)
        check_shape("mhc_norm_weight", mhc_norm_weight, (n * hidden,))
    return tokens, n, hidden


def mhc_pre_norm_fn(
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    *,
    save_statistics: bool = False,
):
    """RMS-normalised projection of the flattened streams onto the mixes.

    Args:
        residual: bf16 ``[T, n, C]``. mhc_fn: fp32 ``[m, nC]`` (m = n² + 2n, or n for the head).
        mhc_norm_weight: fp32 ``[nC]`` or None, folded as ``fn ⊙ γ``. mhc_norm_eps: finite, >= 0.
        save_statistics: also return the statistics the backward would otherwise recompute from the
            streams (keyword only; ``mhc_pre_norm_fn_bwd(..., statistics=)``).

    Returns:
        mixes fp32 ``[T, m]`` contiguous, computed in full fp32 (see the module docstring on TF32); with
        ``save_statistics``, ``(mixes, statistics)``, statistics fp32 ``[T, m + 1]`` = ``[x·(fn⊙γ)ᵀ | Σx²]``.
    """
    check_norm_inputs(residual, mhc_fn, mhc_norm_weight)
    eps = check_nonnegative_float("mhc_norm_eps", mhc_norm_eps)
    fn = mhc_fn if mhc_norm_weight is None else mhc_fn * mhc_norm_weight
    x = rearrange(residual.to(F32), "t i c -> t (i c)")
    statistics = norm_fn_statistics_math(x, fn)
    mixes = norm_fn_forward_math(x, fn, eps, statistics).contiguous()
    return (mixes, statistics.contiguous()) if save_statistics else mixes


def mhc_pre_norm_fn_bwd(
    grad_output: torch.Tensor,
    residual: torch.Tensor,
    mhc_fn: torch.Tensor,
    mhc_norm_weight: torch.Tensor | None,
    mhc_norm_eps: float,
    *,
    grad_addend: torch.Tensor | None = None,
    statistics: torch.Tensor | None = None,
):
    """Explicit backward of ``mhc_pre_norm_fn``.

    Args:
        grad_addend: optional bf16 ``[T, n, C]`` (keyword only), another gradient term of the same
            residual (``mhc_pre``'s pre-apply term): dresidual is then ``bf16(dx + grad_addend)``,
            one fp32 add and one rounding, instead of the fp32 dx.
        statistics: optional fp32 ``[T, m + 1]`` (keyword only), the forward's ``save_statistics``
            output: used instead of recomputing ``x·(fn⊙γ)ᵀ`` and ``Σx²`` from the streams.

    Returns:
        ``(dresidual fp32 [T, n, C] (bf16 with grad_addend), dfn fp32 [m, nC], dnorm_weight fp32 [nC]
        or None)``. Without an addend dresidual stays fp32: the caller adds it to the post and
        pre-apply gradients of the same residual.
    """
    tokens, n, hidden = check_norm_inputs(residual, mhc_fn, mhc_norm_weight)
    check_tensor("grad_output", grad_output, dtypes=(F32,), ndim=2)
    check_shape("grad_output", grad_output, (tokens, mhc_fn.shape[0]))
    eps = check_nonnegative_float("mhc_norm_eps", mhc_norm_eps)
    check_grad_addend(grad_addend, tokens, n, hidden)
    check_statistics(statistics, tokens, mhc_fn.shape[0])
    fn = mhc_fn if mhc_norm_weight is None else mhc_fn * mhc_norm_weight
    x = rearrange(residual.to(F32), "t i c -> t (i c)")
    d_x, d_fn_folded = norm_fn_backward_math(grad_output, x, fn, eps, statistics)
    d_residual = rearrange(d_x, "t (i c) -> t i c", i=n).contiguous()
    if grad_addend is not None:
        d_residual = (d_residual + grad_addend.to(F32)).to(torch.bfloat16)
    if mhc_norm_weight is None:
        return d_residual, d_fn_folded.contiguous(), None
    d_fn = d_fn_folded * mhc_norm_weight
    d_weight = reduce(d_fn_folded * mhc_fn, "m k -> k", "sum")
    return d_residual, d_fn.contiguous(), d_weight.contiguous()


# ---------------------------------------------------------------------------------------------
# Big fuse (inference) and multilayer recompute
# ---------------------------------------------------------------------------------------------


def check_big_fuse_inputs(
    residual,
    fn,
    mhc_scale,
    mhc_base,
    mhc_norm_weight,
    rms_eps,
    mhc_pre_eps,
    mhc_sinkhorn_eps,
    mhc_post_mult_value,
    sinkhorn_repeat,
    n_splits,
) -> tuple[int, float, float, float, float, int]:
    """``mhc_pre_big_fuse``'s arguments (both twins): ``(n, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat)``."""
    tokens, n, hidden = check_residual("residual", residual)
    m3 = n * n + 2 * n
    check_tensor("fn", fn, dtypes=(F32,), ndim=2)
    check_shape("fn", fn, (m3, n * hidden))
    check_tensor("mhc_scale", mhc_scale, dtypes=(F32,), ndim=1)
    check_shape("mhc_scale", mhc_scale, (3,))
    check_tensor("mhc_base", mhc_base, dtypes=(F32,), ndim=1)
    check_shape("mhc_base", mhc_base, (m3,))
    if mhc_norm_weight is not None:
        check_tensor("mhc_norm_weight", mhc_norm_weight, dtypes=(F32,), ndim=1)
        check_shape("mhc_norm_weight", mhc_norm_weight, (n * hidden,))
    rms_eps = check_nonnegative_float("rms_eps", rms_eps)
    pre_eps = check_nonnegative_float("mhc_pre_eps", mhc_pre_eps)
    sinkhorn_eps = check_nonnegative_float("mhc_sinkhorn_eps", mhc_sinkhorn_eps)
    post_mult = check_nonnegative_float("mhc_post_mult_value", mhc_post_mult_value)
    repeat = check_positive_int("sinkhorn_repeat", sinkhorn_repeat)
    check_positive_int("n_splits", n_splits)
    return n, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat


def mhc_pre_big_fuse(
    residual: torch.Tensor,
    fn: torch.Tensor,
    mhc_scale: torch.Tensor,
    mhc_base: torch.Tensor,
    rms_eps: float,
    mhc_pre_eps: float,
    mhc_sinkhorn_eps: float,
    mhc_post_mult_value: float,
    sinkhorn_repeat: int,
    n_splits: int = 16,
    *,
    mhc_norm_weight: torch.Tensor | None = None,
):
    """Inference-only ``mhc_pre``: norm-fn → split → Sinkhorn → pre-apply, one pass per token.

    The fused kernel only saves memory traffic (each token's streams are read once); its result is
    defined as the four reference steps run one by one on the same inputs, bit for bit:
    ``mixes = mhc_pre_norm_fn(residual, fn, mhc_norm_weight, rms_eps)``,
    ``pre, post, L = mhc_pre_split_mixes(mixes, ...)``, ``comb = sinkhorn_normalize(L, ...)``,
    ``layer_input = mhc_pre_apply_mix(residual, pre)``. Nothing is saved for a backward.

    Args:
        residual: bf16 ``[T, n, C]``, the streams.
        fn: fp32 ``[n² + 2n, nC]``, the mixes projection.
        mhc_scale: fp32 ``[3]``. mhc_base: fp32 ``[n² + 2n]``.
        rms_eps, mhc_pre_eps, mhc_sinkhorn_eps: finite, >= 0 (the norm-fn, pre and Sinkhorn epsilons).
        mhc_post_mult_value: finite, >= 0 (the paper and DeepSeek-V4 use 2.0).
        sinkhorn_repeat: Sinkhorn iterations R >= 1.
        n_splits: the split-K factor of the kernel's GEMM, a positive int. The reference sums the nC
            products in one pass, so it has no effect here (TileKernels' TileLang path forces it to 1).
        mhc_norm_weight: fp32 ``[nC]`` or None (keyword only, after TileKernels' arguments), folded
            as ``fn ⊙ γ``. TileKernels' ``mhc_pre`` drops the norm weight on its no-grad path, so
            inference and training disagree there whenever γ ≠ 1; this twin applies it.

    Returns:
        ``(post_mix fp32 [T, n], comb_mix fp32 [T, n, n], layer_input bf16 [T, C])``, contiguous;
        comb_mix is after Sinkhorn, indexed [source, destination]. (TileKernels returns post_mix as
        ``[..., n, 1]``; this twin keeps ``[T, n]``, the shape ``mhc_post`` takes.)
    """
    n, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat = check_big_fuse_inputs(
        residual,
        fn,
        mhc_scale,
        mhc_base,
        mhc_norm_weight,
        rms_eps,
        mhc_pre_eps,
        mhc_sinkhorn_eps,
        mhc_post_mult_value,
        sinkhorn_repeat,
        n_splits,
    )

    mixes = mhc_pre_norm_fn(residual, fn, mhc_norm_weight, rms_eps)
    pre_mix, post_mix, comb_logits = mhc_pre_split_mixes(mixes, mhc_scale, mhc_base, n, post_mult, pre_eps)
    comb_mix = sinkhorn_normalize(comb_logits, repeat=repeat, eps=sinkhorn_eps)
    layer_input = mhc_pre_apply_mix(residual, pre_mix)
    return post_mix, comb_mix, layer_input


def check_tensor_list(name: str, value, length: int | None = None) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{name} must have {length} entries, got {len(value)}")
    return list(value)


def check_list_entries(name: str, tensors: list, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    for index, value in enumerate(tensors):
        check_tensor(f"{name}[{index}]", value, dtypes=(dtype,), ndim=len(shape))
        check_shape(f"{name}[{index}]", value, shape)


def check_multilayer_inputs(
    initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list, layer_input_list, residual_list
) -> tuple[list, list, list, list, list, list]:
    """``mhc_multilayer_recompute``'s arguments (both twins): the six lists, checked, in argument order."""
    tokens, n, hidden = check_residual("initial_residual", initial_residual)
    pre_mixes = check_tensor_list("pre_mix_list", pre_mix_list)
    num_layers = len(pre_mixes)
    if num_layers < 1:
        raise ValueError("pre_mix_list must hold at least one layer, got 0 entries")
    layer_outputs = check_tensor_list("layer_output_list", layer_output_list)
    num_post = len(layer_outputs)
    if num_post not in (num_layers - 1, num_layers):
        raise ValueError(
            f"layer_output_list must have {num_layers - 1} or {num_layers} entries (L − 1 or L for "
            f"L = {num_layers} layers), got {num_post}"
        )
    post_mixes = check_tensor_list("post_mix_list", post_mix_list, num_post)
    comb_mixes = check_tensor_list("comb_mix_list", comb_mix_list, num_post)
    layer_inputs = check_tensor_list("layer_input_list", layer_input_list, num_layers)
    residuals = check_tensor_list("residual_list", residual_list, num_post)
    check_list_entries("pre_mix_list", pre_mixes, F32, (tokens, n))
    check_list_entries("layer_output_list", layer_outputs, BF16, (tokens, hidden))
    check_list_entries("post_mix_list", post_mixes, F32, (tokens, n))
    check_list_entries("comb_mix_list", comb_mixes, F32, (tokens, n, n))
    check_list_entries("layer_input_list", layer_inputs, BF16, (tokens, hidden))
    check_list_entries("residual_list", residuals, BF16, (tokens, n, hidden))
    return pre_mixes, layer_outputs, post_mixes, comb_mixes, layer_inputs, residuals


def mhc_multilayer_recompute(
    initial_residual: torch.Tensor,
    pre_mix_list: list[torch.Tensor],
    layer_output_list: list[torch.Tensor],
    post_mix_list: list[torch.Tensor],
    comb_mix_list: list[torch.Tensor],
    layer_input_list: list[torch.Tensor],
    residual_list: list[torch.Tensor],
) -> None:
    """Recompute the layer inputs and residuals of L consecutive layers from the first residual.

    Activation recomputation ([mHC] §4.3.2): the forward keeps ``X_0`` once per block of layers plus
    each layer's coefficients and sublayer output; the backward replays, for ``l = 0 .. L − 1``,
    ``layer_input_l = bf16(Σ_i pre_l[i] · X_l[i])`` and, for ``l < P``,
    ``X_{l+1} = bf16(post_l ⊗ y_l + comb_lᵀ X_l)`` (``comb_l`` indexed [source, destination]). Every
    ``X_{l+1}`` is rounded to bf16 before layer ``l + 1`` reads it, exactly as the stored residual of
    the unfused path, so the results are bit-identical to ``mhc_pre_apply_mix`` and ``mhc_post``
    run layer by layer.

    Args:
        initial_residual: bf16 ``[T, n, C]``, ``X_0``.
        pre_mix_list: L >= 1 fp32 ``[T, n]``, the pre weights of every layer.
        layer_output_list: P bf16 ``[T, C]``, the sublayer outputs ``y_l``; P = L (the block ends
            with a post) or P = L − 1 (the last layer's input only, its post is not replayed).
        post_mix_list: P fp32 ``[T, n]``. comb_mix_list: P fp32 ``[T, n, n]`` (after Sinkhorn).
        layer_input_list: L bf16 ``[T, C]`` output buffers, written in place.
        residual_list: P bf16 ``[T, n, C]`` output buffers, written in place: ``residual_list[l]``
            receives ``X_{l+1}``. Output buffers must not overlap the inputs.

    Returns:
        None (the outputs are written into the given buffers, as TileKernels does).
    """
    pre_mixes, layer_outputs, post_mixes, comb_mixes, layer_inputs, residuals = check_multilayer_inputs(
        initial_residual, pre_mix_list, layer_output_list, post_mix_list, comb_mix_list, layer_input_list, residual_list
    )
    tokens, n, hidden = initial_residual.shape
    num_layers, num_post = len(pre_mixes), len(layer_outputs)

    stream = initial_residual  # X_l, always the bf16 value the unfused path would have stored
    for layer in range(num_layers):
        x = stream.to(F32)
        layer_inputs[layer].copy_(apply_mix_forward_math(x, pre_mixes[layer]).to(BF16))
        if layer < num_post:
            y = layer_outputs[layer].to(F32)
            stream = post_forward_math(y, x, post_mixes[layer], comb_mixes[layer]).to(BF16)
            residuals[layer].copy_(stream)
