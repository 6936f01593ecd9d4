"""Reference twin of the Engram family (contract §4): the executable specification.

Engram is DeepSeek's conditional memory: hashed n-gram ids select embedding rows ``e``; the
projections ``k = W_K e`` (one per mHC stream) and ``v = W_V e`` (shared) are mixed into the
residual ``x`` through a context-aware gate. Full math and sources: ``engram-mhc-math.md`` §B.

Rules of this twin:

- **Hash.** For layer ``l``, order ``n = 2..N`` and table ``j``:
  ``h = XOR_{i<n} (id_i · mult[l, i])`` in int64 with two's-complement wrap-around, then
  ``out = (h mod vocab[l, n-2, j]) + offset[l, (n-2)·M + j]`` as int32. ``mod`` is the *floored*
  modulo (Python's ``%``, ``torch.remainder``), so every output lies in
  ``[offset, offset + vocab)`` even when the wrapped product makes ``h`` negative. (For Engram's own
  multipliers the products never overflow and ``h >= 0``, where floored and C's truncated modulo
  agree.) Token ids must be non-negative and every table size positive.
- **Gate numerics.** Inputs are stored in bf16 (``w`` in fp32). All arithmetic happens in the
  *math dtype* (fp32; fp64 when the helpers below are called with fp64 tensors, which the tests
  use to prove the backward): reductions over D, ``rstd``, the gate and ``x + g·v``. Only the
  stored outputs ``out``, ``dx``, ``dk``, ``dv`` are rounded to bf16, once, at the end.
- **Gate forward**, per token ``t`` and stream ``m`` (D = hidden size):
  ``rstd_x = (mean_d x² + eps)^-½``, ``rstd_k = (mean_d k² + eps)^-½`` (eps *inside* the root,
  added to the mean), ``dot = Σ_d x·w·k`` (raw, unnormalised), ``s = dot·rstd_x·rstd_k·D^-½``,
  ``gate = σ(sign(s)·√max(|s|, clamp_value))``, ``out = x + gate·v`` (v broadcast over streams).
  ``sign(0) = 0``, so ``s == 0`` gives ``gate = ½`` exactly.
- **Gate backward** (explicit, from the saved ``dot, gate, rstd_x, rstd_k``; nothing is re-reduced
  except ``dg``): ``dg = Σ_d go·v``; ``β = 0`` where ``|s| < clamp_value`` (the clamped branch has
  zero derivative), else ``β = dg·g(1−g)·½·√(D^-½·rstd_x·rstd_k / |dot|)`` (= ∂L/∂s · D^-½·rstd_x·rstd_k);
  ``dx = go + β(w⊙k − dot·rstd_x²/D · x)``, ``dk = β(w⊙x − dot·rstd_k²/D · k)``,
  ``dv = Σ_m gate_m·go_m``, ``dw = Σ_t β·x⊙k`` returned as per-block partial sums.
- **Weight gradient.** ``w = wh⊙we`` (``fused_weight``, exact in fp32), so
  ``grad_wh += (Σ_p dw_partial[p])⊙we`` and ``grad_we += (Σ_p dw_partial[p])⊙wh`` in fp32, in place,
  for any number of partials.
"""

from __future__ import annotations

import torch
from einops import einsum, rearrange, reduce

from .contract import ceil_div, check_nonnegative_float, check_shape, check_tensor

__all__ = [
    "engram_hash",
    "fused_weight",
    "engram_gate_fwd",
    "engram_gate_bwd",
    "grad_w_reduce",
    "gate_forward_math",
    "gate_backward_math",
]

_INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def check_unit_last_stride(name: str, value: torch.Tensor) -> None:
    if value.shape[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension (other strides are free), "
            f"got strides {tuple(value.stride())}"
        )


def check_gate_inputs(x, k, v, w) -> tuple[int, int, int]:
    check_tensor("x", x, dtypes=(torch.bfloat16,), ndim=3)
    tokens, streams, hidden = x.shape
    check_tensor("k", k, dtypes=(torch.bfloat16,), ndim=3)
    check_shape("k", k, (tokens, streams, hidden))
    check_tensor("v", v, dtypes=(torch.bfloat16,), ndim=2)
    check_shape("v", v, (tokens, hidden))
    check_tensor("w", w, dtypes=(torch.float32,), ndim=2)
    check_shape("w", w, (streams, hidden))
    for name, value in (("x", x), ("k", k), ("v", v), ("w", w)):
        check_unit_last_stride(name, value)
    return tokens, streams, hidden


def check_grad_kv(grad_kv, tokens: int, streams: int, hidden: int) -> None:
    """``engram_gate_bwd``'s optional ``grad_kv`` buffer (both twins)."""
    check_tensor("grad_kv", grad_kv, dtypes=(torch.bfloat16,), ndim=2)
    check_shape("grad_kv", grad_kv, (tokens, (streams + 1) * hidden))
    check_unit_last_stride("grad_kv", grad_kv)


def check_gate_bwd_inputs(grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, clamp_value, num_partials) -> float:
    """``engram_gate_bwd``'s arguments (both twins); returns ``clamp_value`` as a float."""
    tokens, streams, hidden = check_gate_inputs(x, k, v, w)
    check_tensor("grad_out", grad_out, dtypes=(torch.bfloat16,), ndim=3)
    check_shape("grad_out", grad_out, (tokens, streams, hidden))
    check_unit_last_stride("grad_out", grad_out)
    for name, value in (("dot", dot), ("gate", gate), ("rstd_x", rstd_x), ("rstd_k", rstd_k)):
        check_tensor(name, value, dtypes=(torch.float32,), ndim=2)
        check_shape(name, value, (tokens, streams))
    clamp_value = check_nonnegative_float("clamp_value", clamp_value, allow_zero=False)
    if isinstance(num_partials, bool) or not isinstance(num_partials, int) or num_partials < 1:
        raise ValueError(f"num_partials must be a positive int, got {num_partials!r}")
    return clamp_value


# ---------------------------------------------------------------------------------------------
# Hash
# ---------------------------------------------------------------------------------------------


def check_hash_inputs(ngram_token_ids, multipliers, vocab_sizes, offsets) -> tuple[int, int, int, int]:
    """``engram_hash``'s dtypes and shapes (both twins): ``(T, N, L, M)``."""
    check_tensor("ngram_token_ids", ngram_token_ids, dtypes=(torch.int32,), ndim=2)
    check_tensor("multipliers", multipliers, dtypes=(torch.int64,), ndim=2)
    check_tensor("vocab_sizes", vocab_sizes, dtypes=(torch.int32,), ndim=3)
    check_tensor("offsets", offsets, dtypes=(torch.int32,), ndim=2)
    tokens, max_ngram = ngram_token_ids.shape
    layers, _, tables = vocab_sizes.shape
    if max_ngram < 2:
        raise ValueError(f"ngram_token_ids must have at least 2 columns (N >= 2), got {max_ngram}")
    check_shape("multipliers", multipliers, (layers, max_ngram))
    check_shape("vocab_sizes", vocab_sizes, (layers, max_ngram - 1, tables))
    check_shape("offsets", offsets, (layers, (max_ngram - 1) * tables))
    return tokens, max_ngram, layers, tables


def check_hash_values(ngram_token_ids, vocab_sizes, offsets) -> None:
    """``engram_hash``'s value checks (both twins). They read the minimum of the ids and of the
    (small) tables back to the host: a table size of 0 would be a division by zero on a device."""
    if vocab_sizes.numel() and int(vocab_sizes.min()) <= 0:
        raise ValueError(f"vocab_sizes must be positive, got minimum {int(vocab_sizes.min())}")
    if ngram_token_ids.numel() and int(ngram_token_ids.min()) < 0:
        raise ValueError(f"ngram_token_ids must be non-negative, got minimum {int(ngram_token_ids.min())}")
    flat_vocab = rearrange(vocab_sizes, "l n m -> l (n m)").to(torch.int64)
    if offsets.numel() and int((offsets.to(torch.int64) + flat_vocab).max()) - 1 > _INT32_MAX:
        raise ValueError("offsets + vocab_sizes must fit in int32 (the last row of a table is offset + vocab - 1)")


def engram_hash(
    ngram_token_ids: torch.Tensor,
    multipliers: torch.Tensor,
    vocab_sizes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Hashed n-gram ids → flat embedding-table rows.

    Args:
        ngram_token_ids: int32 ``[T, N]``, column ``i`` is the (compressed) token ``i`` positions
            back; non-negative.
        multipliers: int64 ``[L, N]``, the per-layer hash multipliers.
        vocab_sizes: int32 ``[L, N-1, M]``, positive: the size (a prime) of table ``j`` of order ``n``.
        offsets: int32 ``[L, (N-1)·M]``, the first row of each table in the layer's flat table.

    Returns:
        int32 ``[L, T, (N-1)·M]``, contiguous; column ``(n-2)·M + j`` is the row of table ``j`` of
        order ``n``: ``(XOR_{i<n} id_i·mult_i  mod  vocab) + offset``, products wrapping in int64,
        floored modulo.
    """
    tokens, max_ngram, layers, tables = check_hash_inputs(ngram_token_ids, multipliers, vocab_sizes, offsets)
    check_hash_values(ngram_token_ids, vocab_sizes, offsets)

    # products[l, t, i] = id[t, i] · mult[l, i], int64, wrapping on overflow.
    products = rearrange(ngram_token_ids.to(torch.int64), "t i -> 1 t i") * rearrange(multipliers, "l i -> l 1 i")

    rows = []
    mixed = products[:, :, 0]
    for order in range(2, max_ngram + 1):
        mixed = torch.bitwise_xor(mixed, products[:, :, order - 1])  # XOR over i < order
        sizes = rearrange(vocab_sizes[:, order - 2].to(torch.int64), "l m -> l 1 m")
        rows.append(torch.remainder(rearrange(mixed, "l t -> l t 1"), sizes))  # floored: in [0, size)
    rows = torch.cat(rows, dim=-1) + rearrange(offsets.to(torch.int64), "l c -> l 1 c")
    return rows.to(torch.int32).contiguous()


# ---------------------------------------------------------------------------------------------
# Gate
# ---------------------------------------------------------------------------------------------


def fused_weight(wh: torch.Tensor, we: torch.Tensor) -> torch.Tensor:
    """``w = wh ⊙ we`` in fp32 (exact: a product of two bf16 values fits in fp32's mantissa).

    Args:
        wh: bf16 ``[n, D]``, the RMSNorm gain of the hidden states (query side).
        we: bf16 ``[n, D]``, the RMSNorm gain of the keys.

    Returns:
        fp32 ``[n, D]``, contiguous.
    """
    check_tensor("wh", wh, dtypes=(torch.bfloat16,), ndim=2)
    check_tensor("we", we, dtypes=(torch.bfloat16,), ndim=2)
    check_shape("we", we, tuple(wh.shape))
    return (wh.to(torch.float32) * we.to(torch.float32)).contiguous()


def gate_forward_math(x, k, v, w, eps: float, clamp_value: float):
    """The gate forward in the dtype of its (floating) inputs; differentiable by autograd.

    Args:
        x, k: ``[T, n, D]``; v: ``[T, D]``; w: ``[n, D]``, all of one floating dtype (the math dtype).

    Returns:
        ``(out, dot, gate, rstd_x, rstd_k)``: ``out [T, n, D]`` and the four ``[T, n]`` statistics,
        all in the math dtype (no rounding to a storage dtype).
    """
    hidden = x.shape[-1]
    scale = hidden**-0.5  # D^-1/2

    rstd_x = torch.rsqrt(reduce(x * x, "t m d -> t m", "mean") + eps)
    rstd_k = torch.rsqrt(reduce(k * k, "t m d -> t m", "mean") + eps)
    dot = reduce(x * rearrange(w, "m d -> 1 m d") * k, "t m d -> t m", "sum")
    s = dot * rstd_x * rstd_k * scale
    signed_root = torch.sign(s) * torch.sqrt(torch.clamp(s.abs(), min=clamp_value))
    gate = torch.sigmoid(signed_root)
    out = x + rearrange(gate, "t m -> t m 1") * rearrange(v, "t d -> t 1 d")
    return out, dot, gate, rstd_x, rstd_k


def _token_blocks(tokens: int, num_partials: int) -> list[tuple[int, int]]:
    """Persistent-CTA token split: block p owns ``[min(p·c, T), min((p+1)·c, T))``, ``c = ceil(T / P)``."""
    per_block = ceil_div(tokens, num_partials)
    return [(min(p * per_block, tokens), min((p + 1) * per_block, tokens)) for p in range(num_partials)]


def gate_backward_math(grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, clamp_value: float, num_partials: int = 1):
    """The explicit gate backward in the dtype of its inputs (the math dtype).

    Returns:
        ``(dx, dk, dv, dw_partial)``: ``[T, n, D]``, ``[T, n, D]``, ``[T, D]``, ``[P, n, D]``, all in
        the math dtype; ``dw_partial[p]`` sums ``β·x⊙k`` over the tokens of block ``p``.
    """
    tokens, streams, hidden = x.shape
    scale = hidden**-0.5
    norms = rstd_x * rstd_k * scale  # ∂s/∂dot

    # dL/dgate, then β = dL/ds · D^-1/2·rstd_x·rstd_k; zero on the clamped branch |s| < clamp_value.
    dgate = reduce(grad_out * rearrange(v, "t d -> t 1 d"), "t m d -> t m", "sum")
    clamped = dot.abs() * norms < clamp_value
    safe_dot = torch.where(clamped, torch.ones_like(dot), dot.abs())  # keeps the unused branch finite
    beta = torch.where(
        clamped,
        torch.zeros_like(dot),
        dgate * gate * (1 - gate) * 0.5 * torch.sqrt(norms / safe_dot),
    )

    beta_ = rearrange(beta, "t m -> t m 1")
    w_ = rearrange(w, "m d -> 1 m d")
    dx = grad_out + beta_ * (w_ * k - rearrange(dot * rstd_x * rstd_x / hidden, "t m -> t m 1") * x)
    dk = beta_ * (w_ * x - rearrange(dot * rstd_k * rstd_k / hidden, "t m -> t m 1") * k)
    dv = einsum(gate, grad_out, "t m, t m d -> t d")

    dw_per_token = beta_ * x * k
    dw_partial = torch.stack(
        [reduce(dw_per_token[start:end], "t m d -> m d", "sum") for start, end in _token_blocks(tokens, num_partials)]
    )
    return dx, dk, dv, dw_partial


def engram_gate_fwd(
    x: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    clamp_value: float,
    save_for_backward: bool = True,
):
    """Gate the shared value into every stream: ``out = x + σ(signed √ of the normalised dot)·v``.

    Args:
        x: bf16 ``[T, n, D]`` residual (hidden states); unit stride along D.
        k: bf16 ``[T, n, D]`` keys; any strides with unit stride along D (e.g. a view into a fused
            ``[T, (n+1)·D]`` projection output).
        v: bf16 ``[T, D]`` value, shared by the n streams; any row stride, unit stride along D.
        w: fp32 ``[n, D]``, ``fused_weight(wh, we)``.
        eps: RMSNorm epsilon (finite, >= 0), added to the mean of squares inside the root.
        clamp_value: lower clamp of ``|s|`` before the square root (finite, > 0; 1e-6 in DeepSeek's code).
        save_for_backward: when False, only ``out`` is computed and the other four are None.

    Returns:
        ``(out, dot, gate, rstd_x, rstd_k)``: ``out`` bf16 ``[T, n, D]`` contiguous (fp32 math,
        rounded once to nearest even); ``dot`` (raw ``Σ_d x·w·k``), ``gate``, ``rstd_x``,
        ``rstd_k``: fp32 ``[T, n]`` contiguous.
    """
    check_gate_inputs(x, k, v, w)
    eps = check_nonnegative_float("eps", eps, allow_zero=True)
    clamp_value = check_nonnegative_float("clamp_value", clamp_value, allow_zero=False)
    if not isinstance(save_for_backward, bool):
        raise TypeError(f"save_for_backward must be a bool, got {type(save_for_backward).__name__}")

    f32 = torch.float32
    out, dot, gate, rstd_x, rstd_k = gate_forward_math(x.to(f32), k.to(f32), v.to(f32), w, eps, clamp_value)
    out = out.to(torch.bfloat16).contiguous()
    if not save_for_backward:
        return out, None, None, None, None
    return out, dot.contiguous(), gate.contiguous(), rstd_x.contiguous(), rstd_k.contiguous()


def engram_gate_bwd(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    dot: torch.Tensor,
    gate: torch.Tensor,
    rstd_x: torch.Tensor,
    rstd_k: torch.Tensor,
    clamp_value: float,
    *,
    num_partials: int = 1,
    grad_kv: torch.Tensor | None = None,
):
    """Explicit backward of ``engram_gate_fwd`` from its saved statistics.

    Args:
        grad_out: bf16 ``[T, n, D]``, the gradient of ``out``; unit stride along D.
        x, k, v, w: the forward's inputs (same dtypes, shapes and stride rules).
        dot, gate, rstd_x, rstd_k: fp32 ``[T, n]``, saved by the forward.
        clamp_value: the forward's clamp value.
        num_partials: how many token blocks ``dw_partial`` is split into (keyword only; the kernels
            use one per persistent CTA). Block ``p`` owns tokens ``[p·c, (p+1)·c) ∩ [0, T)`` with
            ``c = ceil(T / P)``; empty blocks are zero.
        grad_kv: optional bf16 ``[T, (n+1)·D]`` (unit stride along its last dimension; keyword only),
            the gradient of a fused projection output whose first ``n·D`` columns are k and last
            ``D`` are v (k and v its views): dk and dv are written into it and returned as its views.

    Returns:
        ``(dx, dk, dv, dw_partial)``: bf16 ``[T, n, D]``, bf16 ``[T, n, D]``, bf16 ``[T, D]`` (all
        contiguous, or dk and dv the views ``grad_kv[:, :n·D]`` as ``[T, n, D]`` and ``grad_kv[:, n·D:]``;
        fp32 math rounded once) and fp32 ``[P, n, D]`` partial sums of ``β·x⊙k``.
    """
    clamp_value = check_gate_bwd_inputs(grad_out, x, k, v, w, dot, gate, rstd_x, rstd_k, clamp_value, num_partials)
    if grad_kv is not None:
        check_grad_kv(grad_kv, *x.shape)

    f32 = torch.float32
    dx, dk, dv, dw_partial = gate_backward_math(
        grad_out.to(f32), x.to(f32), k.to(f32), v.to(f32), w, dot, gate, rstd_x, rstd_k, clamp_value, num_partials
    )
    bf16 = torch.bfloat16
    if grad_kv is None:
        return dx.to(bf16).contiguous(), dk.to(bf16).contiguous(), dv.to(bf16).contiguous(), dw_partial.contiguous()
    streams, hidden = x.shape[1:]
    grad_k, grad_v = grad_kv[:, : streams * hidden], grad_kv[:, streams * hidden :]
    grad_k.copy_(rearrange(dk, "t m d -> t (m d)"))
    grad_v.copy_(dv)
    return dx.to(bf16).contiguous(), grad_k.unflatten(1, (streams, hidden)), grad_v, dw_partial.contiguous()


def grad_w_reduce(
    dw_partial: torch.Tensor,
    wh: torch.Tensor,
    we: torch.Tensor,
    grad_wh: torch.Tensor,
    grad_we: torch.Tensor,
) -> None:
    """Sum the partial weight gradients and accumulate the gains' gradients in place.

    ``G = Σ_p dw_partial[p]`` (fp32), then ``grad_wh += G ⊙ we`` and ``grad_we += G ⊙ wh`` (fp32),
    because ``w = wh ⊙ we``. Works for any number of partials P (114 on an H100 PCIe, 132 on an
    H100 SXM / H200, ...), P = 0 included (nothing is added).

    Args:
        dw_partial: fp32 ``[P, n, D]``.
        wh, we: bf16 ``[n, D]``, the gains.
        grad_wh, grad_we: fp32 ``[n, D]``, modified in place (e.g. ``param.main_grad``).

    Returns:
        None.
    """
    check_tensor("dw_partial", dw_partial, dtypes=(torch.float32,), ndim=3)
    check_tensor("wh", wh, dtypes=(torch.bfloat16,), ndim=2)
    streams, hidden = wh.shape
    check_shape("dw_partial", dw_partial, (dw_partial.shape[0], streams, hidden))
    check_tensor("we", we, dtypes=(torch.bfloat16,), ndim=2)
    check_shape("we", we, (streams, hidden))
    for name, value in (("grad_wh", grad_wh), ("grad_we", grad_we)):
        check_tensor(name, value, dtypes=(torch.float32,), ndim=2)
        check_shape(name, value, (streams, hidden))

    total = reduce(dw_partial, "p m d -> m d", "sum")
    grad_wh.add_(total * we.to(torch.float32))
    grad_we.add_(total * wh.to(torch.float32))
