"""Reference twin of the modeling layers (contract §6): trainable Engram and mHC layers.

The optimized twin wraps the kernels in ``torch.autograd.Function``s with explicit backwards. This
twin writes the same layers as plain PyTorch over the named forward steps of ``reference/engram.py``
and ``reference/mhc.py`` (their ``*_math`` helpers), so ``torch.autograd`` derives every gradient;
the tests prove that those gradients equal the explicit ``*_bwd`` references composed by hand
(float64) and pass ``torch.autograd.gradcheck``. The oracle can then compare the optimized layers'
outputs **and** gradients with these. Names, argument order and defaults follow TileKernels'
``tile_kernels.modeling`` (``engram_gate``, ``expand_from_embedding``, ``mhc_pre``, ``mhc_post``,
``mhc_head``).

Rules of this twin:

- **Layout.** Any leading dimensions: streams ``[..., n, C]``, hidden states ``[..., C]``; they are
  flattened to tokens for the arithmetic and restored on the outputs. ``post_mix`` is ``[..., n]``
  (TileKernels carries ``[..., n, 1]``), the shape ``mhc_post`` takes.
- **Dtypes.** Storage dtype of the streams and hidden states: bf16, the contract's. The arithmetic
  runs in the *math dtype*, fp32, and every stored output is rounded to bf16 once, at the end of its
  layer (exactly as the §4/§5 operators). fp32 and fp64 storage are accepted too: the math then runs
  in that dtype and nothing is rounded (the tests use fp64 for gradcheck; the toy example in
  ``docs/modeling.md`` uses fp32). Coefficient parameters (``fn``, ``scale``, ``base``, the norm
  weight) have the math dtype (fp32, or fp64 with fp64 streams); the Engram gains ``wh, we`` have the
  storage dtype of the hidden states (bf16 in the contract).
- **Gradients** are autograd's. Inside one layer the storage inputs are upcast once, so every use
  inside the layer accumulates its gradient in the math dtype and the gradient of a bf16 input is
  rounded once. A stream read by several layers (the residual feeds both ``mhc_pre`` and
  ``mhc_post``) gets the sum of their bf16 gradients, added by autograd in bf16; TileKernels adds the
  same three terms (post → pre-apply → norm-fn) in one bf16 buffer, so bf16 residual gradients agree
  to a few bf16 ulps, not bit for bit. A gradient reaching a bf16 parameter's ``.grad`` is the fp32
  gradient rounded once (autograd casts a gradient to its leaf's dtype).
- **Engram gate.** ``w = wh ⊙ we`` in the math dtype (``fused_weight``), then the §4 gate forward;
  gradients flow to x, k, v, wh and we (``dwh = (Σ_t β·x⊙k)⊙we``, ``dwe = (Σ_t β·x⊙k)⊙wh``). When a
  gain has a Megatron-style ``main_grad`` attribute that is not None (read at backward time), its
  gradient is **added in place to ``main_grad``** in the math dtype (unrounded fp32 for bf16 gains)
  and nothing reaches its ``.grad``, which stays as it was (None for a fresh parameter); a gain
  without one gets its gradient in ``.grad`` as usual. ``main_grad`` must have the gain's shape and
  the math dtype.
- **mHC pre.** ``mhc_pre`` = norm-fn (norm weight folded as ``fn ⊙ γ``) → split → Sinkhorn →
  pre-apply. With gradients disabled (``torch.no_grad()``, ``torch.inference_mode()``) and bf16
  streams it calls ``mhc_pre_big_fuse`` **with the norm weight**; both paths give bit-identical
  outputs. (TileKernels' ``mhc_pre`` drops the norm weight on its no-grad path; we do not copy that.)
  ``n_splits`` is passed through and has no effect on the reference's arithmetic.
- **mHC head.** ``fn`` is ``[n, nC]``; rows beyond the first n (TileKernels' zero-padded
  ``[n² + 2n, nC]`` form) are accepted and ignored. ``scale`` is ``[1]`` or a scalar tensor.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from . import engram, mhc
from .contract import check_nonnegative_float, check_positive_int, check_shape, check_tensor

__all__ = [
    "engram_gate",
    "EngramGate",
    "expand_from_embedding",
    "mhc_pre",
    "mhc_post",
    "mhc_head",
    "ExpandFromEmbedding",
    "MHCPre",
    "MHCPost",
    "MHCHead",
]

F32 = torch.float32
F64 = torch.float64
BF16 = torch.bfloat16
STORAGE_DTYPES = (BF16, F32, F64)


def math_dtype(storage_dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 storage, fp32 otherwise (bf16 and fp32 storage)."""
    return F64 if storage_dtype == F64 else F32


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def check_streams(name: str, value: torch.Tensor) -> tuple[int, int]:
    """A ``[..., n, C]`` tensor of a storage dtype; returns ``(n, C)``."""
    check_tensor(name, value, dtypes=STORAGE_DTYPES)
    if value.dim() < 2:
        raise ValueError(f"{name} must be [..., n, C] (at least 2-D), got shape {tuple(value.shape)}")
    return value.shape[-2], value.shape[-1]


def check_parameter(name: str, value: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    check_tensor(name, value, dtypes=(dtype,), ndim=len(shape))
    check_shape(name, value, shape)


def check_mult(mhc_mult, streams: int) -> int:
    n = check_positive_int("mhc_mult", mhc_mult)
    if n != streams:
        raise ValueError(f"mhc_mult must equal the number of streams residual.shape[-2] = {streams}, got {n}")
    return n


# ---------------------------------------------------------------------------------------------
# Engram gate
# ---------------------------------------------------------------------------------------------


class _RouteToMainGrad(torch.autograd.Function):
    """``param.to(dtype)``; its gradient goes to ``param.main_grad`` (in place) when that exists.

    Only the destination of the gradient is custom: the value is the upcast parameter, the gradient
    the one autograd computed for it.
    """

    @staticmethod
    def forward(ctx, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.param = param
        return param.to(dtype, copy=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        main_grad = getattr(ctx.param, "main_grad", None)
        if main_grad is None:
            return grad, None  # autograd casts it to the parameter's dtype: one rounding for bf16 gains
        main_grad.add_(grad)
        return None, None


def check_main_grad(name: str, param: torch.Tensor, dtype: torch.dtype) -> None:
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:
        check_parameter(f"{name}.main_grad", main_grad, dtype, tuple(param.shape))


def engram_gate(
    hidden_states: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weight_hidden: torch.Tensor,
    weight_embed: torch.Tensor,
    clamp_value: float,
    eps: float,
) -> torch.Tensor:
    """The trainable Engram gate: ``fused_weight`` then the §4 gate forward, differentiable.

    ``out = x + σ(sign(s)·√max(|s|, clamp_value))·v`` with ``s = Σ_d x·(wh⊙we)·k · rstd_x·rstd_k/√D``
    (see ``reference/engram.py``). Note the argument order: ``clamp_value`` before ``eps``, as
    TileKernels' ``engram_gate`` (the operator ``engram_gate_fwd`` takes ``eps`` first).

    Args:
        hidden_states: ``[..., n, D]`` bf16 (or fp32/fp64), the residual streams x.
        k: ``[..., n, D]``, same dtype, the keys (any strides).
        v: ``[..., D]``, same dtype, the value shared by the n streams (any strides).
        weight_hidden, weight_embed: ``[n, D]``, same dtype, the RMSNorm gains wh (of x) and we (of k).
            A gain with a ``main_grad`` attribute gets its gradient added to it, not to ``.grad``.
        clamp_value: finite, > 0 (1e-6 in DeepSeek's code). eps: finite, >= 0, inside the root.

    Returns:
        ``[..., n, D]`` in the dtype of ``hidden_states``, contiguous: the math dtype's result rounded once.
    """
    streams, hidden = check_streams("hidden_states", hidden_states)
    dtype = hidden_states.dtype
    lead = tuple(hidden_states.shape[:-2])
    check_parameter("k", k, dtype, (*lead, streams, hidden))
    check_parameter("v", v, dtype, (*lead, hidden))
    check_parameter("weight_hidden", weight_hidden, dtype, (streams, hidden))
    check_parameter("weight_embed", weight_embed, dtype, (streams, hidden))
    clamp_value = check_nonnegative_float("clamp_value", clamp_value, allow_zero=False)
    eps = check_nonnegative_float("eps", eps)
    compute = math_dtype(dtype)
    check_main_grad("weight_hidden", weight_hidden, compute)
    check_main_grad("weight_embed", weight_embed, compute)

    fused = _RouteToMainGrad.apply(weight_hidden, compute) * _RouteToMainGrad.apply(weight_embed, compute)
    x = hidden_states.reshape(-1, streams, hidden).to(compute)
    out, *_ = engram.gate_forward_math(
        x, k.reshape(-1, streams, hidden).to(compute), v.reshape(-1, hidden).to(compute), fused, eps, clamp_value
    )
    return out.to(dtype).reshape(hidden_states.shape).contiguous()


class EngramGate(nn.Module):
    """The Engram gate with its two gains as parameters: ``forward(hidden_states, k, v)``.

    Args:
        hc_mult: n, the number of streams (4 in DeepSeek's models). hidden_size: D.
        eps: RMSNorm epsilon (inside the root). clamp_value: lower clamp of ``|s|`` (> 0).
        dtype: of the gains and of the hidden states they will see (bf16 in the contract).

    Parameters ``weight_hidden`` (wh) and ``weight_embed`` (we), ``[n, D]``, start at 1 (plain RMSNorm).
    Give them a ``main_grad`` buffer (fp32 for bf16 gains) to accumulate their gradients there.
    """

    def __init__(
        self,
        hc_mult: int,
        hidden_size: int,
        eps: float = 1e-6,
        clamp_value: float = 1e-6,
        dtype: torch.dtype = BF16,
        device=None,
    ):
        super().__init__()
        check_positive_int("hc_mult", hc_mult)
        check_positive_int("hidden_size", hidden_size)
        self.eps = check_nonnegative_float("eps", eps)
        self.clamp_value = check_nonnegative_float("clamp_value", clamp_value, allow_zero=False)
        self.weight_hidden = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=dtype, device=device))
        self.weight_embed = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return engram_gate(hidden_states, k, v, self.weight_hidden, self.weight_embed, self.clamp_value, self.eps)


# ---------------------------------------------------------------------------------------------
# mHC
# ---------------------------------------------------------------------------------------------


def expand_from_embedding(x: torch.Tensor, mhc_mult: int = 4) -> torch.Tensor:
    """Enter the mHC residual: ``[..., C] → [..., n, C]``, every stream a copy of x (exact).

    The gradient sums the n streams' gradients in the math dtype and rounds once (``expand_to_mhc_bwd``).
    """
    check_tensor("x", x, dtypes=STORAGE_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x must be [..., C] (at least 1-D), got shape {tuple(x.shape)}")
    n = check_positive_int("mhc_mult", mhc_mult)
    streams = rearrange(x.to(math_dtype(x.dtype)), "... c -> ... 1 c").expand(*x.shape[:-1], n, x.shape[-1])
    return streams.to(x.dtype).contiguous()


def check_coefficients(residual, fn, scale, base, norm_weight, rows: int, scale_size: int, base_size: int):
    """Validate the parameters of one mHC site against ``residual [..., n, C]``; returns the math dtype."""
    n, hidden = check_streams("residual", residual)
    compute = math_dtype(residual.dtype)
    check_tensor("fn", fn, dtypes=(compute,), ndim=2)
    if fn.shape[0] < rows or fn.shape[1] != n * hidden:
        raise ValueError(f"fn must have shape ({rows}, {n * hidden}), got {tuple(fn.shape)}")
    check_parameter("scale", scale, compute, (scale_size,))
    check_parameter("base", base, compute, (base_size,))
    if norm_weight is not None:
        check_parameter("norm_weight", norm_weight, compute, (n * hidden,))
    return compute


def _normed_mixes(x: torch.Tensor, fn: torch.Tensor, norm_weight: torch.Tensor | None, norm_eps: float):
    """``mhc_pre_norm_fn`` on upcast streams ``x [T, n, C]``: mixes ``[T, m]`` in the math dtype."""
    folded = fn if norm_weight is None else fn * norm_weight
    return mhc.norm_fn_forward_math(rearrange(x, "t i c -> t (i c)"), folded, norm_eps)


def mhc_pre(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    mhc_mult: int = 4,
    post_mult_value: float = 1.0,
    pre_eps: float = 1e-6,
    sinkhorn_eps: float = 1e-6,
    sinkhorn_repeat: int = 10,
    n_splits: int = 16,
):
    """mHC before one sublayer: norm-fn → split → Sinkhorn → pre-apply.

    Args:
        residual: ``[..., n, C]`` bf16 (or fp32/fp64), the streams X.
        fn: ``[n² + 2n, nC]``, scale: ``[3]``, base: ``[n² + 2n]``, norm_weight: ``[nC]`` or None
            (folded as ``fn ⊙ γ``); all in the math dtype (fp32 for bf16 streams).
        norm_eps, pre_eps, sinkhorn_eps: finite, >= 0. mhc_mult: n, must equal ``residual.shape[-2]``.
        post_mult_value: TileKernels' default 1.0; the paper and DeepSeek-V4 use 2.0.
        sinkhorn_repeat: R >= 1 (DeepSeek's models use 20). n_splits: positive, no effect here.

    Returns:
        ``(layer_input [..., C] in the storage dtype, (post_mix [..., n], comb_mix [..., n, n]))``,
        the coefficients in the math dtype, comb_mix after Sinkhorn ([source, destination]). With
        gradients disabled and bf16 streams the result comes from ``mhc_pre_big_fuse`` (norm weight
        included), bit-identical to the differentiable path.
    """
    n, hidden = check_streams("residual", residual)
    m3 = n * n + 2 * n
    check_mult(mhc_mult, n)
    compute = check_coefficients(residual, fn, scale, base, norm_weight, m3, 3, m3)
    check_shape("fn", fn, (m3, n * hidden))
    norm_eps = check_nonnegative_float("norm_eps", norm_eps)
    post_mult_value = check_nonnegative_float("post_mult_value", post_mult_value)
    pre_eps = check_nonnegative_float("pre_eps", pre_eps)
    sinkhorn_eps = check_nonnegative_float("sinkhorn_eps", sinkhorn_eps)
    sinkhorn_repeat = check_positive_int("sinkhorn_repeat", sinkhorn_repeat)
    check_positive_int("n_splits", n_splits)
    lead = residual.shape[:-2]
    streams = residual.reshape(-1, n, hidden)

    if not torch.is_grad_enabled() and residual.dtype == BF16:
        post_mix, comb_mix, layer_input = mhc.mhc_pre_big_fuse(
            streams,
            fn,
            scale,
            base,
            rms_eps=norm_eps,
            mhc_pre_eps=pre_eps,
            mhc_sinkhorn_eps=sinkhorn_eps,
            mhc_post_mult_value=post_mult_value,
            sinkhorn_repeat=sinkhorn_repeat,
            n_splits=n_splits,
            mhc_norm_weight=norm_weight,
        )
    else:
        x = streams.to(compute)
        mixes = _normed_mixes(x, fn, norm_weight, norm_eps)
        pre_mix, post_mix, comb_logits = mhc.split_mixes_forward_math(mixes, scale, base, n, post_mult_value, pre_eps)
        # .contiguous() where the public steps return contiguous tensors: the same memory layout
        # makes the same kernels run, which keeps this path bit-identical to mhc_pre_big_fuse.
        comb_mix = mhc.sinkhorn_forward_math(comb_logits.contiguous(), sinkhorn_repeat, sinkhorn_eps)
        layer_input = mhc.apply_mix_forward_math(x, pre_mix.contiguous()).to(residual.dtype)
        post_mix = post_mix.contiguous()
    return (
        layer_input.reshape(*lead, hidden),
        (post_mix.reshape(*lead, n), comb_mix.reshape(*lead, n, n)),
    )


def mhc_post(
    x: torch.Tensor, residual: torch.Tensor, post_layer_mix: torch.Tensor, comb_res_mix: torch.Tensor
) -> torch.Tensor:
    """mHC after one sublayer: ``X'[o] = post_o·y + Σ_i comb[i, o]·X[i]``, differentiable.

    Args:
        x: ``[..., C]``, the sublayer output y, in the storage dtype of ``residual``.
        residual: ``[..., n, C]``, the streams X the matching ``mhc_pre`` read.
        post_layer_mix: ``[..., n]``, comb_res_mix: ``[..., n, n]`` (after Sinkhorn), math dtype.

    Returns:
        ``[..., n, C]`` in the storage dtype, contiguous, rounded once.
    """
    n, hidden = check_streams("residual", residual)
    lead = tuple(residual.shape[:-2])
    compute = math_dtype(residual.dtype)
    check_parameter("x", x, residual.dtype, (*lead, hidden))
    check_parameter("post_layer_mix", post_layer_mix, compute, (*lead, n))
    check_parameter("comb_res_mix", comb_res_mix, compute, (*lead, n, n))
    out = mhc.post_forward_math(
        x.reshape(-1, hidden).to(compute),
        residual.reshape(-1, n, hidden).to(compute),
        post_layer_mix.reshape(-1, n),
        comb_res_mix.reshape(-1, n, n),
    )
    return out.to(residual.dtype).reshape(residual.shape).contiguous()


def mhc_head(
    residual: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    mhc_mult: int = 4,
    pre_eps: float = 1e-6,
    n_splits: int = 16,
) -> torch.Tensor:
    """mHC before the LM head: norm-fn → ``σ(s·m + b) + pre_eps`` → pre-apply.

    Args:
        residual: ``[..., n, C]`` bf16 (or fp32/fp64). fn: ``[n, nC]`` (extra rows ignored),
            scale: ``[1]`` or a scalar tensor, base: ``[n]``, norm_weight: ``[nC]`` or None; math dtype.
        norm_eps, pre_eps: finite, >= 0. mhc_mult: n. n_splits: positive, no effect here.

    Returns:
        ``[..., C]`` in the storage dtype: ``Σ_i w_i·X[i]`` rounded once.
    """
    n, hidden = check_streams("residual", residual)
    check_mult(mhc_mult, n)
    if isinstance(scale, torch.Tensor) and scale.dim() == 0:
        scale = scale.reshape(1)  # TileKernels accepts a scalar tensor as well as [1]
    compute = check_coefficients(residual, fn, scale, base, norm_weight, n, 1, n)
    norm_eps = check_nonnegative_float("norm_eps", norm_eps)
    pre_eps = check_nonnegative_float("pre_eps", pre_eps)
    check_positive_int("n_splits", n_splits)

    x = residual.reshape(-1, n, hidden).to(compute)
    mixes = _normed_mixes(x, fn[:n], norm_weight, norm_eps)
    head_mix = mhc.head_mix_forward_math(mixes, scale, base, pre_eps)
    out = mhc.apply_mix_forward_math(x, head_mix).to(residual.dtype)
    return out.reshape(*residual.shape[:-2], hidden)


class ExpandFromEmbedding(nn.Module):
    """``forward(x [..., C]) → [..., n, C]``, see ``expand_from_embedding``; no parameters."""

    def __init__(self, mhc_mult: int = 4):
        super().__init__()
        self.mhc_mult = check_positive_int("mhc_mult", mhc_mult)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return expand_from_embedding(x, self.mhc_mult)


class MHCPre(nn.Module):
    """One mHC site before a sublayer: ``forward(residual) → (layer_input, (post_mix, comb_mix))``.

    Parameters (math dtype, fp32 by default): ``fn [n² + 2n, nC]`` (starts at 0: the mixes start
    input-independent), ``scale [3]`` (starts at ``scale_init``, the paper's α = 0.01), ``base
    [n² + 2n]`` (starts at 0: pre = σ(0), post = post_mult·σ(0), comb uniform), and with
    ``use_norm_weight`` the RMSNorm gain ``norm_weight [nC]`` (starts at 1). The keyword arguments
    are those of ``mhc_pre``.
    """

    def __init__(
        self,
        hidden_size: int,
        mhc_mult: int = 4,
        *,
        use_norm_weight: bool = True,
        norm_eps: float = 1e-6,
        post_mult_value: float = 1.0,
        pre_eps: float = 1e-6,
        sinkhorn_eps: float = 1e-6,
        sinkhorn_repeat: int = 10,
        n_splits: int = 16,
        scale_init: float = 0.01,
        dtype: torch.dtype = F32,
        device=None,
    ):
        super().__init__()
        n = check_positive_int("mhc_mult", mhc_mult)
        width = n * check_positive_int("hidden_size", hidden_size)
        self.mhc_mult = n
        self.options = dict(
            norm_eps=norm_eps,
            mhc_mult=n,
            post_mult_value=post_mult_value,
            pre_eps=pre_eps,
            sinkhorn_eps=sinkhorn_eps,
            sinkhorn_repeat=sinkhorn_repeat,
            n_splits=n_splits,
        )
        self.fn = nn.Parameter(torch.zeros(n * n + 2 * n, width, dtype=dtype, device=device))
        self.scale = nn.Parameter(torch.full((3,), scale_init, dtype=dtype, device=device))
        self.base = nn.Parameter(torch.zeros(n * n + 2 * n, dtype=dtype, device=device))
        self.norm_weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device)) if use_norm_weight else None

    def forward(self, residual: torch.Tensor):
        return mhc_pre(residual, self.fn, self.scale, self.base, norm_weight=self.norm_weight, **self.options)


class MHCPost(nn.Module):
    """``forward(x, residual, post_layer_mix, comb_res_mix)``, see ``mhc_post``; no parameters."""

    def forward(self, x, residual, post_layer_mix, comb_res_mix) -> torch.Tensor:
        return mhc_post(x, residual, post_layer_mix, comb_res_mix)


class MHCHead(nn.Module):
    """The mHC head before the LM head: ``forward(residual [..., n, C]) → [..., C]``.

    Parameters (math dtype): ``fn [n, nC]`` (starts at 0), ``scale [1]`` (``scale_init``), ``base
    [n]`` (starts at 0, so the head starts as ``(σ(0) + pre_eps)·Σ_i X[i]``), and with
    ``use_norm_weight`` ``norm_weight [nC]`` (starts at 1).
    """

    def __init__(
        self,
        hidden_size: int,
        mhc_mult: int = 4,
        *,
        use_norm_weight: bool = True,
        norm_eps: float = 1e-6,
        pre_eps: float = 1e-6,
        n_splits: int = 16,
        scale_init: float = 0.01,
        dtype: torch.dtype = F32,
        device=None,
    ):
        super().__init__()
        n = check_positive_int("mhc_mult", mhc_mult)
        width = n * check_positive_int("hidden_size", hidden_size)
        self.options = dict(norm_eps=norm_eps, mhc_mult=n, pre_eps=pre_eps, n_splits=n_splits)
        self.fn = nn.Parameter(torch.zeros(n, width, dtype=dtype, device=device))
        self.scale = nn.Parameter(torch.full((1,), scale_init, dtype=dtype, device=device))
        self.base = nn.Parameter(torch.zeros(n, dtype=dtype, device=device))
        self.norm_weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device)) if use_norm_weight else None

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        return mhc_head(residual, self.fn, self.scale, self.base, norm_weight=self.norm_weight, **self.options)
