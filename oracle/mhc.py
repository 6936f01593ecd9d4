"""The mHC family (contract §5) for the oracle: cases, inputs, policies, bytes, self-checks.

Sixteen operators: ``expand_to_mhc`` (+``_bwd``), ``mhc_pre_norm_fn`` (+``_bwd``),
``mhc_pre_split_mixes`` (+``_bwd``), ``sinkhorn_normalize`` (+``_bwd``), ``mhc_pre_apply_mix``
(+``_bwd``), ``mhc_post`` (+``_bwd``) and ``mhc_head_compute_mix`` (+``_bwd``), each explicit
backward its own; the inference fuse ``mhc_pre_big_fuse`` and the activation recomputation
``mhc_multilayer_recompute``. n = 4 streams everywhere, as in every DeepSeek model. (The trainable
layers built from these are ``oracle.modeling``'s.)

Cases. Stream ops (those with a hidden size C): ``quick`` has T ∈ {0, 1, 37, 5 (strided), 3, 2} with
C ∈ {64, 128, 1280, 7168}; ``full`` has every T ∈ {0, 1, 4001, 8192} with every C ∈ {1280, 2560, 4096,
7168} (the [TK] test sizes; 7168 is V4-Pro's), plus a strided case. Token ops (split, Sinkhorn,
head) have the same token counts. Sinkhorn runs every shape with repeat 10 ([TK]'s default) and 20
(DeepSeek's models). The norm-fn runs m = 24 mixes (the layers'), and m = n = 4 (``mhc_head``'s: its
tensor-core kernels are other configurations) with the forward's saved statistics, and in the
backward the addend, at the contiguous tail shapes (T 4001; quick T 3). Named benchmarks
(``full``): ``mhc_post`` forward and backward at T 8192, C 7168, and Sinkhorn forward and backward
at n 4, repeat 20, 65536 tokens (issue 7's acceptance list).

Inputs are seeded, generated on the CPU, then moved. A strided input is a view of a buffer whose rows
are longer, the padding NaN (a kernel reading past a row's end shows in its outputs); the head's
input mix is the first n columns of a ``[T, n² + 2n]`` mixes buffer, as in the model. Values are
O(1) (streams N(0, 1), coefficients from the sigmoid and from Sinkhorn of random logits), except
for exact power-of-two scalings that keep the root-sum-square of each long reduction's terms
O(1) at every size (see ``floatops``): the backward of ``mhc_post`` and ``mhc_pre_apply_mix`` scale
the streams by 2^-⌈log2 √C⌉ (their fp32 coefficient gradients sum over C); ``mhc_pre_norm_fn``
scales ``fn`` by 2^-⌈log2 √nC⌉; its backward scales the streams and the upstream gradient by
2^-⌈log2 √T⌉ (rsqrt normalises the streams back) and fn by 2^-3 (m = 24 rows); the split and head
backwards scale the upstream gradient by 2^-⌈log2 √T⌉ (their parameter gradients sum over T) and
the mixes by 2^-3 (which also keeps |z| ≤ 4.5, the premise of the σ' bound).

``mhc_pre_big_fuse`` runs the stream shapes with the norm-fn inputs (fn scaled by ½·2^-⌈log2 √nC⌉)
and small scales α (see its bounds); its cases alternate γ, R 20 / 10, post_mult 2 / 1, pre_eps
1e-6 / 1e-2 and n_splits 16 / 1. ``mhc_multilayer_recompute`` replays L = 1 .. 4 layers (``full``:
4) with P = L or L − 1 posts on the stream shapes, from coefficients made as the split and Sinkhorn
make them; its inputs are redrawn until no layer's short fp32 sum lies near a bf16 rounding
boundary, which makes its outputs bitwise (see ``FRAGILE_MARGIN``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace

import torch
from einops import einsum, rearrange, reduce
from einops import repeat as repeat_tensor

from tileproof.reference import mhc as reference

from .engram import FloatEdges
from .floatops import (
    BF16_BOUND,
    F64,
    LAMBDA,
    U32,
    U_TF32,
    FloatOp,
    autograd_of,
    f64,
    inverse_sqrt_pow2,
    normal,
    place,
    random_sum_bound,
    uniform,
    unwritten_bf16,
)
from .policy import FAIL, PASS, Bitwise, Check, RelativeError, compare
from .registry import Call, Case, Output, register

N = 4  # streams (hc_mult)
M = N * N + 2 * N  # mixes per token: [pre n | post n | comb n²]
F32, BF16 = torch.float32, torch.bfloat16

HIDDENS = (1280, 2560, 4096, 7168)
TOKENS = (0, 1, 4001, 8192)
C_MAX = max(HIDDENS)
NC_MAX = N * C_MAX
T_MAX = max(TOKENS)  # the longest token reduction (parameter gradients); Sinkhorn's 65536 sums none
REPEATS = (10, 20)
PAD = 8  # extra elements per row of a strided input

# (tokens, hidden, pad) of the stream ops, and (tokens, pad) of the token ops.
STREAM_SHAPES = {
    # Every C of the full tier, for the row-shaped CTAs (``optimized.mhc.post_schedule``: one CTA per
    # row of 2 vectors per thread at C 1280, 2560 and 7168, 4 × 128 at C 4096), which the quick tier's
    # compile check must build.
    "quick": [
        (0, 64, 0),
        (1, 64, 0),
        (37, 128, 0),
        (5, 64, PAD),
        (3, 1280, 0),
        (2, 7168, 0),
        (2, 2560, 0),
        (2, 4096, 0),
    ],
    "full": [(t, c, 0) for c in HIDDENS for t in TOKENS] + [(4001, 2560, 64)],
}
TOKEN_SHAPES = {
    "quick": [(0, 0), (1, 0), (37, 0), (5, PAD)],
    "full": [(t, 0) for t in TOKENS] + [(4001, PAD)],
}

# --- bounds (see floatops for the model) --------------------------------------------------------

# bf16 outputs of short fp32 sums (n = 4 or 5 products of O(1) values, Σ|terms| ≤ 48): the fp32
# error, at most 9·2^-24·48 ≈ 2.6e-5, stays below 2^-12·atol, the room BF16_BOUND leaves.
SHORT_SUM_ATOL = 2.0**-3
# Sigmoid outputs: a fast exp is within ~2^-21 for the |z| ≤ 12 of these cases, z = s·m + b
# rounds twice (|z|·2^-23 absolute, damped by 1 − σ); relative errors of σ stay below 2^-18.
SIGMOID_BOUND = 2.0**-18
# σ'(z) = σ(1 − σ): 1 − σ loses up to e^|z|·2^-24 to cancellation; the backward cases keep
# |z| ≤ 4.5 (e^4.5 ≈ 90), so 2·90·2^-24 ≈ 1.1e-5 plus the exp's error fits in 2^-15.
SIGMOID_GRAD_BOUND = 2.0**-15
SIGMOID_GRAD_Z = 4.5  # the bound's premise: |z| of the backward cases
# Sinkhorn: softmax (fast exp, ≤ 2^-20 relative) then 2R − 1 normalisations, each a sum of n
# positive terms, a reciprocal and a product (≤ (n + 2)·2^-24 relative per step; an implementation
# dividing exactly stays within (n + 1)·2^-24). The iteration contracts perturbations, so errors do
# not compound beyond this linear count; a margin of 4 covers the measured worst case (≈ 1e-6 at R = 20).
SINKHORN_BOUND = 2.0**-20 + 4 * (2 * max(REPEATS)) * (N + 2) * U32
# Its backward walks the 2R − 1 steps in reverse, each a cancelling n-term sum of O(1) gradients;
# atol: gradients of the logits near zero are compared absolutely at the scale of the upstream
# gradient (O(1)).
SINKHORN_BWD_BOUND = 2.0**-16
SINKHORN_BWD_ATOL = 2.0**-4
# Long sums (floatops' probabilistic model): RSS of the terms ≤ 2.5·atol by the cases' scalings.
SUM_OVER_C_BOUND = random_sum_bound(C_MAX)
# Norm-fn forward: the optimized GEMM reads fn as TF32 (2^-11 per product), accumulates nC terms
# in fp32, and rsqrt(Σx²/nC + eps) adds half the worst-case error of its nC-term positive sum.
NORM_FN_BOUND = random_sum_bound(NC_MAX, U_TF32 + 2 * U32) + (0.5 * NC_MAX + 4) * U32
# Norm-fn backward: dresidual = fnᵀ·dmul over m = 24 (both operands TF32) + 2·dsq·x (a term
# ~1/√nC of it, dsq through the forward's TF32 product); dfn sums T tokens of TF32 products;
# dnorm_weight sums m = 24 of those.
NORM_FN_BWD_DRESIDUAL_BOUND = random_sum_bound(M + 1, 2 * U_TF32 + 2 * U32, rss_per_atol=3.0)
NORM_FN_BWD_DFN_BOUND = random_sum_bound(T_MAX, U_TF32 + 2 * U32)
NORM_FN_BWD_DWEIGHT_BOUND = random_sum_bound(M, U_TF32 + (T_MAX**0.5 + 2) * U32)
# Split / head backward parameter gradients: T (or T·n, T·n²) terms, each with σ''s error.
SPLIT_DSCALE_BOUND = random_sum_bound(T_MAX * N * N, SIGMOID_GRAD_BOUND)
SPLIT_DBASE_BOUND = random_sum_bound(T_MAX, SIGMOID_GRAD_BOUND)
HEAD_DSCALE_BOUND = random_sum_bound(T_MAX * N, SIGMOID_GRAD_BOUND)
HEAD_DBASE_BOUND = random_sum_bound(T_MAX, SIGMOID_GRAD_BOUND, rss_per_atol=4.0)


WHY_COPY = "a copy of bf16 values: exactly one right answer"
WHY_SHORT_BF16 = (
    "n-term fp32 sum of O(1) products rounded once to bf16: 2^-8 rounding + fp32 error ≤ 2^-12·atol "
    "(atol 2^-3: a cancellation near zero is compared absolutely)"
)
WHY_EXPAND_BWD = (
    "n = 4 bf16 gradients summed in fp32 (exact unless their exponents spread over 2^14) and rounded once "
    "to bf16: bitwise only if the kernel adds the streams in the reference's order, which the contract "
    "leaves free"
)
WHY_PRODUCT_BF16 = "one fp32 product rounded to bf16: 2^-8 rounding (+2^-24, double rounding); no cancellation"
WHY_SUM_OVER_C = (
    "fp32 sum over C of exact bf16 products with random signs: ≤ 5·√C_max·2^-24 of the terms' RSS (Higham–Mary "
    "probabilistic model), RSS ≤ 2.5·atol (streams scaled by 2^-⌈log2 √C⌉; atol ½)"
)
WHY_SIGMOID = "σ(s·m + b) (+ eps) in fp32: fast exp and two roundings stay below 2^-18 relative"
WHY_AFFINE = "s·m + b in fp32 (one or two roundings of |s·m| + |b| ≤ 10): 2^-18 with atol 1 for cancellations"
WHY_SIGMOID_GRAD = (
    "elementwise grad·σ(1 − σ)·s: 1 − σ cancels (≤ e^|z|·2^-24, |z| ≤ 4.5 here) plus the exp's error: 2^-15"
)


def _sum_over_tokens_why(what: str) -> str:
    return (
        f"fp32 sum over {what} of random-sign terms, each with σ''s 2^-15: 5·(√K_max·2^-24 + 2^-15) of the terms' "
        "RSS (probabilistic model), RSS ≲ 2.5·atol (upstream gradient scaled by 2^-⌈log2 √T⌉)"
    )


@dataclass(frozen=True)
class MhcParams:
    tokens: int
    hidden: int = 0  # C; 0 for the token ops
    pad: int = 0  # extra elements per row of the strided input; 0: contiguous
    repeat: int = 0  # Sinkhorn iterations (Sinkhorn ops only)
    eps: float = 1e-6  # Sinkhorn eps, or the norm eps of norm-fn
    weight: bool = False  # norm-fn: with a norm weight γ
    addend: bool = False  # norm-fn backward: with grad_addend (the residual's other gradient term, bf16)
    statistics: bool = False  # norm-fn: the forward's save_statistics, the backward's statistics
    post_mult: float = 2.0  # split: the post multiplier (2 in the paper and V4; [TK]'s default 1)
    pre_eps: float = 1e-6  # split / head: added to the pre weights ([TK]'s split test: 1e-2)
    n_splits: int = 0  # big fuse: the split-K factor passed through (no effect on the result)
    layers: int = 0  # multilayer recompute: L, the layers replayed
    posts: int = 0  # multilayer recompute: P ∈ {L − 1, L}, the layers whose post is replayed
    mixes: int = 0  # norm-fn: the rows of fn when not M (N: mhc_head's norm-fn, fn's first n rows)

    @property
    def width(self) -> int:
        return N * self.hidden  # nC, the flattened stream

    @property
    def rows(self) -> int:
        """The norm-fn's m: the mixes per token."""
        return self.mixes or M


def _label(name: str, p: MhcParams) -> str:
    label = f"{name}/T{p.tokens}"
    if p.hidden:
        label += f"/C{p.hidden}"
    if p.repeat:
        label += f"/R{p.repeat}"
    if p.layers:
        label += f"/L{p.layers}/P{p.posts}"
    if name.startswith(("mhc_pre_norm_fn", "mhc_pre_big_fuse")):
        label += ("/gamma" if p.weight else "/nogamma") + f"/eps{p.eps:g}"
    if p.mixes:
        label += f"/m{p.mixes}"
    if name.startswith(("mhc_pre_split_mixes", "mhc_pre_big_fuse")):
        label += f"/post{p.post_mult:g}/pre_eps{p.pre_eps:g}"
    if p.n_splits:
        label += f"/splits{p.n_splits}"
    if p.addend:
        label += "/addend"
    if p.statistics:
        label += "/stats"
    return label + ("/strided" if p.pad else "")


def _check_text(name: str, ok: bool, policy: str, metric: str, detail: str = "") -> Check:
    return Check(name, PASS if ok else FAIL, policy, metric, "" if ok else detail)


class MhcOp(FloatEdges, FloatOp):
    family = "mhc"
    stream_op = True  # has a hidden size C (else: a token op)

    def __init__(self, name: str):
        self.name = name

    def variants(self, p: MhcParams, index: int) -> list[MhcParams]:
        """The cases of one shape (several for ops with options)."""
        return [p]

    def benchmarks(self) -> list[tuple[str, MhcParams]]:
        return []

    def cases(self, tier: str) -> list[Case]:
        if self.stream_op:
            shapes = [MhcParams(t, c, pad) for t, c, pad in STREAM_SHAPES[tier]]
        else:
            shapes = [MhcParams(t, 0, pad) for t, pad in TOKEN_SHAPES[tier]]
        cases = [Case(self.name, _label(self.name, p), p) for i, s in enumerate(shapes) for p in self.variants(s, i)]
        if tier == "full":
            for title, p in self.benchmarks():
                named = Case(self.name, _label(self.name, p), p, benchmark=True, title=title)
                same = [i for i, case in enumerate(cases) if case.params == p]
                if same:
                    cases[same[0]] = named  # the workload is one of the shapes: time that case
                else:
                    cases.append(named)
        return cases

    def kernel_group(self, case: Case) -> Hashable | None:
        p: MhcParams = case.params
        if p.tokens == 0:
            return None
        return (self.name, p.hidden, p.repeat, p.weight, bool(p.pad))


# --- shared inputs ----------------------------------------------------------------------------


def _streams(p: MhcParams, device, generator, scale: float = 1.0, *, zero_token: bool = False) -> torch.Tensor:
    """bf16 ``[T, n, C]`` N(0, scale²) streams (padded rows when the case is strided); with
    ``zero_token`` (and T ≥ 3) token 1 is all zeros, where only eps keeps rsqrt finite."""
    shape = (p.tokens, N, p.hidden)
    values = normal(shape, generator, scale) if generator is not None else None
    if values is not None and zero_token and p.tokens >= 3:
        values[1] = 0.0
    return place(values, shape, BF16, device, p.pad)


def _comb(p: MhcParams, device, generator) -> torch.Tensor:
    """fp32 ``[T, n, n]``: Sinkhorn (R = 20) of N(0, 1) logits, as mhc_post receives it."""
    if generator is None:
        return torch.empty((p.tokens, N, N), dtype=F32, device=device)
    logits = normal((p.tokens, N, N), generator)
    return reference.sinkhorn_normalize(logits, repeat=20).to(device)


def _post_mix(p: MhcParams, device, generator) -> torch.Tensor:
    """fp32 ``[T, n]`` in (0, 2): 2·σ(N(0, 1)), as the split makes it."""
    if generator is None:
        return torch.empty((p.tokens, N), dtype=F32, device=device)
    return (2 * torch.sigmoid(normal((p.tokens, N), generator))).to(device)


def _pre_mix(p: MhcParams, device, generator) -> torch.Tensor:
    """fp32 ``[T, n]`` in (0, 1): σ(N(0, 1)) + 1e-6, as the split makes it."""
    if generator is None:
        return torch.empty((p.tokens, N), dtype=F32, device=device)
    return (torch.sigmoid(normal((p.tokens, N), generator)) + 1e-6).to(device)


def _tensor(shape, dtype, device, generator, make) -> torch.Tensor:
    """``make()`` (CPU values) moved to ``device``, or an uninitialized tensor without a generator."""
    if generator is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return make().to(dtype=dtype, device=device)


# --- expand -----------------------------------------------------------------------------------


class ExpandToMhc(MhcOp):
    edge_arguments = {"": (0, 1)}  # the hidden state, rows of C
    outputs = (Output("out", Bitwise(), WHY_COPY),)

    def build(self, case, device, generator):
        p: MhcParams = case.params
        shape = (p.tokens, p.hidden)
        hidden = place(normal(shape, generator) if generator is not None else None, shape, BF16, device, p.pad)
        return self.with_edge_values(case, Call((hidden, N)), generator)

    def expected_layout(self, case):
        p = case.params
        return ((BF16, (p.tokens, N, p.hidden)),)

    def bytes_moved(self, case):
        p = case.params
        return p.tokens * p.hidden * 2 * (1 + N)

    def extra_checks(self, case, call, outputs):
        hidden = call.args[0]
        expected = rearrange(hidden, "t c -> t 1 c").expand(-1, N, -1)
        return [compare("every stream ≡ the hidden state", outputs[0], expected.contiguous(), Bitwise())]


class ExpandToMhcBwd(MhcOp):
    edge_arguments = {"": (0, 1)}  # the streams' gradient, rows of C
    outputs = (Output("grad_hidden", RelativeError(BF16_BOUND, SHORT_SUM_ATOL), WHY_EXPAND_BWD),)

    def build(self, case, device, generator):
        return self.with_edge_values(case, Call((_streams(case.params, device, generator),)), generator)

    def expected_layout(self, case):
        p = case.params
        return ((BF16, (p.tokens, p.hidden)),)

    def bytes_moved(self, case):
        p = case.params
        return p.tokens * p.hidden * 2 * (N + 1)

    def reference_float64(self, case, call):
        return (reduce(f64(call.args[0]), "t i c -> t c", "sum"),)

    def autograd_float64(self, case, call):
        grad = call.args[0]
        hidden = torch.zeros(grad.shape[0], grad.shape[2], dtype=F64, device=grad.device)
        (theirs,) = autograd_of(lambda h: rearrange(h, "t c -> t 1 c").expand(-1, N, -1), (hidden,), (grad,))
        return ("grad_hidden",), self.reference_float64(case, call), (theirs,)

    def extra_checks(self, case, call, outputs):
        # The sum over streams, written as a loop in stream order with an fp32 accumulator.
        grad = call.args[0]
        total = torch.zeros(grad.shape[0], grad.shape[2], dtype=F32, device=grad.device)
        for stream in range(grad.shape[1]):
            total += grad[:, stream].float()
        return [compare("≡ Σ over streams (fp32, in order)", outputs[0], total.to(BF16), Bitwise())]


# --- norm-fn ----------------------------------------------------------------------------------


def _norm_fn_inputs(p: MhcParams, device, generator, *, fn_scale: float, stream_scale: float, zero_token: bool):
    residual = _streams(p, device, generator, stream_scale, zero_token=zero_token)
    fn = _tensor((p.rows, p.width), F32, device, generator, lambda: normal((p.rows, p.width), generator, fn_scale))
    weight = None
    if p.weight:
        weight = _tensor((p.width,), F32, device, generator, lambda: uniform((p.width,), generator, 0.9, 1.1))
    return residual, fn, weight


def _folded_fn64(fn: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return f64(fn) if weight is None else f64(fn) * f64(weight)


def _head_variants(p: MhcParams) -> list[MhcParams]:
    """mhc_head's norm-fn, m = n (fn's first n rows; its tensor-core kernels are other
    configurations than the layers' m = 24), with the forward's statistics as mhc_head saves them:
    on the contiguous shapes with a tail tile of tokens (T 4001 full, T 3 quick), where the H200
    once showed its dx racing."""
    return [replace(p, mixes=N)] if p.tokens in (3, 4001) and not p.pad else []


class PreNormFn(MhcOp):
    edge_arguments = {"": (0, 2)}  # the residual, a token's n·C values (fn is a parameter)
    outputs = (
        Output(
            "mixes",
            RelativeError(NORM_FN_BOUND, atol=0.5),
            "GEMM over nC with fn read as TF32 (2^-11 per product, random signs): 5·(2^-11 + √nC·2^-24) of the terms' "
            "RSS (≤ 2.5·atol: fn scaled by 2^-⌈log2 √nC⌉), plus ½·nC·2^-24 from rsqrt of the positive Σx²",
        ),
        Output(
            "statistics",
            RelativeError(NORM_FN_BOUND, atol=0.5),
            "[x·(fn⊙γ)ᵀ | Σx²] (save_statistics): the mixes' GEMM error without the rsqrt; Σx², nC positive "
            "terms in fp32, within nC·2^-24 ≤ 1.8e-3 of itself; an empty placeholder where not asked for",
        ),
    )

    def variants(self, p, index):
        # save_statistics on the tensor-core path (every third contiguous shape) and the FFMA path.
        if p.pad:  # a strided residual takes the FFMA kernels (tensor cores read x by TMA): with and without γ
            return [replace(p, weight=True), replace(p, weight=False, statistics=True)]
        base = replace(p, weight=index % 2 == 0)
        plain = [base, replace(base, statistics=True)] if index % 3 == 1 else [base]
        return plain + [replace(head, statistics=True) for head in _head_variants(base)]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        residual, fn, weight = _norm_fn_inputs(
            p, device, generator, fn_scale=inverse_sqrt_pow2(p.width), stream_scale=1.0, zero_token=True
        )
        kwargs = {"save_statistics": True} if p.statistics else {}
        return self.with_edge_values(case, Call((residual, fn, weight, p.eps), kwargs), generator)

    def split(self, result):
        # Without save_statistics the op returns the mixes alone: the statistics slot is empty.
        return super().split((result, None) if isinstance(result, torch.Tensor) else result)

    def expected_layout(self, case):
        p = case.params
        return ((F32, (p.tokens, p.rows)), (F32, (p.tokens, p.rows + 1)) if p.statistics else None)

    def bytes_moved(self, case):
        p = case.params
        m = p.rows
        return p.tokens * p.width * 2 + m * p.width * 4 + (p.width * 4 if p.weight else 0) + p.tokens * m * 4

    def edge_base_ok(self, case):
        return super().edge_base_ok(case) and not case.params.mixes  # the edge bases keep the layers' m

    def reference_float64(self, case, call):
        residual, fn, weight, eps = call.args
        x = rearrange(f64(residual), "t i c -> t (i c)")
        folded = _folded_fn64(fn, weight)
        statistics = reference.norm_fn_statistics_math(x, folded)
        mixes = reference.norm_fn_forward_math(x, folded, eps, statistics)
        return mixes, statistics if case.params.statistics else torch.empty(0, dtype=F64, device=x.device)

    def extra_checks(self, case, call, outputs):
        # [mHC]'s reordering: RMS-normalising x first, then the GEMM, is the same math.
        residual, fn, weight, eps = call.args
        x = rearrange(f64(residual), "t i c -> t (i c)")
        normed = x * torch.rsqrt(reduce(x * x, "t k -> t 1", "mean") + eps)
        expected = normed @ _folded_fn64(fn, weight).T
        policy = self.outputs[0].policy
        return [compare("≡ RMSNorm then GEMM (float64)", outputs[0], outputs[0], policy, expected64=expected)]


class PreNormFnBwd(MhcOp):
    edge_arguments = {"grad": (0, 1), "residual": (1, 2)}
    edge_targets = ("grad", "residual")
    outputs = (
        Output(
            "grad_residual",
            RelativeError(NORM_FN_BWD_DRESIDUAL_BOUND, atol=0.25),
            "fnᵀ·dmul over m = 24 with both operands TF32 (2·2^-11 per product) + 2·dsq·x (~1/√nC of it): "
            "5·(2·2^-11 + ...) of the terms' RSS, ≤ 3·atol (fn scaled by 2^-3); with grad_addend the sum with it "
            "is rounded once to bf16: 2^-9 more, inside the bound",
        ),
        Output(
            "grad_fn",
            RelativeError(NORM_FN_BWD_DFN_BOUND, atol=0.5),
            "Σ over T of dmul·x with dmul read as TF32: 5·(2^-11 + √T·2^-24) of the terms' RSS, ≤ 2.5·atol "
            "(streams scaled by 2^-⌈log2 √T⌉)",
        ),
        Output(
            "grad_norm_weight",
            RelativeError(NORM_FN_BWD_DWEIGHT_BOUND, atol=0.25),
            "Σ over m = 24 of grad_fn·fn, each with grad_fn's error (2^-11 + √T·2^-24): 5·(...) of the terms' RSS, "
            "≤ 2.5·atol; an empty placeholder where the op returns None (no norm weight)",
        ),
    )

    def variants(self, p, index):
        # The residual's other gradient term (grad_addend) on the tensor-core path (every third
        # contiguous shape) and on the FFMA path (the strided shapes, without γ); the forward's
        # statistics likewise (every third shape, another third; with the addend on the strided one).
        if p.pad:  # as PreNormFn's
            return [
                replace(p, weight=True),
                replace(p, weight=False),
                replace(p, weight=False, addend=True, statistics=True),
            ]
        base = replace(p, weight=index % 2 == 1)
        if (p.tokens, p.hidden) == (8192, 7168):  # and the layers' own call at the benchmark shape
            return [base, replace(base, addend=True, statistics=True)]
        # and mhc_head's own call: its n mixes, the addend and the forward's statistics
        head = [replace(h, addend=True, statistics=True) for h in _head_variants(base)]
        if index % 3 == 2:
            return [base, replace(base, addend=True), *head]
        return [base, replace(base, statistics=True), *head] if index % 3 == 1 else [base, *head]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        scale = inverse_sqrt_pow2(p.tokens)
        # No all-zero token here: its rsqrt(eps) would lift the gradients far above the bounds' scale.
        residual, fn, weight = _norm_fn_inputs(
            p, device, generator, fn_scale=2.0**-3, stream_scale=scale, zero_token=False
        )
        grad = _tensor((p.tokens, p.rows), F32, device, generator, lambda: normal((p.tokens, p.rows), generator, scale))
        kwargs = {}
        if p.addend:
            shape = (p.tokens, N, p.hidden)
            kwargs["grad_addend"] = _tensor(shape, BF16, device, generator, lambda: normal(shape, generator, 2.0**-2))
        call = self.with_edge_values(case, Call((grad, residual, fn, weight, p.eps), kwargs), generator)
        if p.statistics:
            # The fp32 reference forward's, from the streams as the case ends up (edge values included).
            call.kwargs["statistics"] = (
                reference.mhc_pre_norm_fn(residual, fn, weight, p.eps, save_statistics=True)[1]
                if generator is not None
                else torch.empty((p.tokens, p.rows + 1), dtype=F32, device=device)
            )
        return call

    def expected_layout(self, case):
        p = case.params
        weight = (F32, (p.width,)) if p.weight else None
        return ((BF16 if p.addend else F32, (p.tokens, N, p.hidden)), (F32, (p.rows, p.width)), weight)

    def bytes_moved(self, case):
        p = case.params
        weight = p.width * 4 * 2 if p.weight else 0  # read γ, write its gradient
        residual = 2 + 2 + 2 if p.addend else 2 + 4  # read x (and the addend), write dresidual
        m = p.rows
        return p.tokens * m * 4 + p.tokens * p.width * residual + m * p.width * 4 * 2 + weight

    def reference_float64(self, case, call):
        d_residual, *rest = self._float64(call)
        addend = call.kwargs.get("grad_addend")
        return (d_residual if addend is None else d_residual + f64(addend), *rest)

    def _float64(self, call):
        """The backward in float64 without the addend (what autograd of the forward gives)."""
        grad, residual, fn, weight, eps = call.args
        x = rearrange(f64(residual), "t i c -> t (i c)")
        d_x, d_fn_folded = reference.norm_fn_backward_math(f64(grad), x, _folded_fn64(fn, weight), eps)
        d_residual = rearrange(d_x, "t (i c) -> t i c", i=N)
        if weight is None:
            return d_residual, d_fn_folded, torch.empty(0, dtype=F64, device=grad.device)
        return d_residual, d_fn_folded * f64(weight), reduce(d_fn_folded * f64(fn), "m k -> k", "sum")

    def autograd_float64(self, case, call):
        grad, residual, fn, weight, eps = call.args

        def forward(residual, fn, *weight):
            folded = fn if not weight else fn * weight[0]
            return reference.norm_fn_forward_math(rearrange(residual, "t i c -> t (i c)"), folded, eps)

        inputs = (residual, fn) + ((weight,) if weight is not None else ())
        theirs = autograd_of(forward, inputs, (grad,))
        mine = self._float64(call)
        names = ("grad_residual", "grad_fn", "grad_norm_weight")[: len(theirs)]
        return names, mine[: len(theirs)], theirs


# --- split ------------------------------------------------------------------------------------


def _split_inputs(p: MhcParams, device, generator, mixes_scale: float):
    """mixes ``[T, m]`` (strided when the case is), scale ``[3]`` in [0.5, 1.5], base ``[m]`` in
    [-3.3, 3.3] (with mixes scaled by 2^-3, |z| = |s·m + b| ≤ 4.5: the σ' bound's premise)."""
    shape = (p.tokens, M)
    mixes = place(normal(shape, generator, mixes_scale) if generator is not None else None, shape, F32, device, p.pad)
    scale = _tensor((3,), F32, device, generator, lambda: uniform((3,), generator, 0.5, 1.5))
    base = _tensor((M,), F32, device, generator, lambda: uniform((M,), generator, -3.3, 3.3))
    return mixes, scale, base


def _z_premise_check(z: torch.Tensor) -> Check:
    """The σ' bound assumes |z| ≤ SIGMOID_GRAD_Z for the sigmoid columns."""
    worst = float(z.abs().max()) if z.numel() else 0.0
    ok = worst <= SIGMOID_GRAD_Z
    return _check_text("premise |z| ≤ 4.5 (σ' bound)", ok, "premise", f"{worst:.3g}", f"|z| reaches {worst:.3g}")


class SplitMixes(MhcOp):
    edge_arguments = {"": (0, 1)}  # the mixes, rows of m
    stream_op = False
    outputs = (
        Output("pre", RelativeError(SIGMOID_BOUND), WHY_SIGMOID),
        Output("post", RelativeError(SIGMOID_BOUND), WHY_SIGMOID),
        Output("comb", RelativeError(SIGMOID_BOUND, atol=1.0), WHY_AFFINE),
    )

    def variants(self, p, index):
        return [replace(p, post_mult=2.0, pre_eps=1e-6), replace(p, post_mult=1.0, pre_eps=1e-2)]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        mixes, scale, base = _split_inputs(p, device, generator, 1.0)
        return self.with_edge_values(case, Call((mixes, scale, base, N, p.post_mult, p.pre_eps)), generator)

    def expected_layout(self, case):
        t = case.params.tokens
        return ((F32, (t, N)), (F32, (t, N)), (F32, (t, N, N)))

    def bytes_moved(self, case):
        return case.params.tokens * M * 4 * 2 + (3 + M) * 4

    def reference_float64(self, case, call):
        mixes, scale, base, n, post_mult, pre_eps = call.args
        return reference.split_mixes_forward_math(f64(mixes), f64(scale), f64(base), n, post_mult, pre_eps)

    def extra_checks(self, case, call, outputs):
        mixes, scale, base, n, post_mult, pre_eps = call.args
        pre, post, comb = outputs
        ranges = bool(((pre >= pre_eps) & (pre <= 1 + pre_eps)).all() and ((post >= 0) & (post <= post_mult)).all())
        checks = [_check_text("pre ∈ [pre_eps, 1 + pre_eps], post ∈ [0, post_mult]", ranges, "range", "")]
        # comb[t, i, o] is mixes column 2n + i·n + o (row-major [source, destination]), one scalar at a time.
        if mixes.shape[0]:
            t, i, o = mixes.shape[0] - 1, 1, 2
            column = 2 * n + i * n + o
            expected = float(mixes[t, column]) * float(scale[2]) + float(base[column])
            ok = abs(float(comb[t, i, o]) - expected) <= 1e-6 * max(1.0, abs(expected))
            checks.append(_check_text("comb[t, i, o] = z[2n + i·n + o]", ok, "scalar", f"{float(comb[t, i, o]):.6g}"))
        return checks


class SplitMixesBwd(MhcOp):
    edge_arguments = {"grad_pre": (0, 1), "grad_post": (1, 1), "grad_comb": (2, 2), "mixes": (3, 1)}
    edge_targets = ("grad_pre", "grad_post", "grad_comb", "mixes")
    edge_base_count = 3
    stream_op = False
    outputs = (
        Output("grad_mixes", RelativeError(SIGMOID_GRAD_BOUND), WHY_SIGMOID_GRAD),
        Output(
            "grad_scale",
            RelativeError(SPLIT_DSCALE_BOUND, atol=0.25),
            _sum_over_tokens_why("T·n² (the comb group)") + "; mixes scaled by 2^-3",
        ),
        Output("grad_base", RelativeError(SPLIT_DBASE_BOUND, atol=0.5), _sum_over_tokens_why("T")),
    )

    def variants(self, p, index):
        return [replace(p, post_mult=2.0 if index % 2 == 0 else 1.0)]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        mixes, scale, base = _split_inputs(p, device, generator, 2.0**-3)
        g = inverse_sqrt_pow2(p.tokens)
        grads = [
            _tensor(shape, F32, device, generator, lambda shape=shape: normal(shape, generator, g))
            for shape in ((p.tokens, N), (p.tokens, N), (p.tokens, N, N))
        ]
        return self.with_edge_values(case, Call((*grads, mixes, scale, base, N, p.post_mult)), generator)

    def expected_layout(self, case):
        return ((F32, (case.params.tokens, M)), (F32, (3,)), (F32, (M,)))

    def bytes_moved(self, case):
        return case.params.tokens * M * 4 * 3 + (3 + M) * 4 * 2

    def reference_float64(self, case, call):
        g_pre, g_post, g_comb, mixes, scale, base, n, post_mult = call.args
        return reference.split_mixes_backward_math(
            f64(g_pre), f64(g_post), f64(g_comb), f64(mixes), f64(scale), f64(base), n, post_mult
        )

    def autograd_float64(self, case, call):
        g_pre, g_post, g_comb, mixes, scale, base, n, post_mult = call.args
        theirs = autograd_of(
            lambda m, s, b: reference.split_mixes_forward_math(m, s, b, n, post_mult, 0.0),
            (mixes, scale, base),
            (g_pre, g_post, g_comb),
        )
        return ("grad_mixes", "grad_scale", "grad_base"), self.reference_float64(case, call), theirs

    def extra_checks(self, case, call, outputs):
        _, _, _, mixes, scale, base, n, _ = call.args
        group_scale = torch.cat([scale[0:1].expand(n), scale[1:2].expand(n)])  # the sigmoid columns
        return [_z_premise_check(f64(mixes[:, : 2 * n]) * f64(group_scale) + f64(base[: 2 * n]))]


# --- Sinkhorn ---------------------------------------------------------------------------------


def _logits(p: MhcParams, device, generator) -> torch.Tensor:
    """fp32 ``[T, n, n]`` N(0, 1) logits ([TK]'s test distribution), padded rows when strided. With
    T ≥ 3, token 1 puts every row's mass on destination 0 (logits 0, −200, −200, −200: the softmax
    underflows and only eps fills the other columns) and token 2 has 4× the spread."""
    shape = (p.tokens, N, N)
    values = normal(shape, generator) if generator is not None else None
    if values is not None and p.tokens >= 3:
        values[1] = torch.tensor([0.0, -200.0, -200.0, -200.0])
        values[2] *= 4
    return place(values, shape, F32, device, p.pad)


def _column_sums_before_last_step(logits: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """S = Σ_i P[i, o] right before Sinkhorn's last step, by a float64 loop written out here:
    softmax over o + eps, then columns, (rows, columns) × (repeat − 1), the last one left out."""
    p = torch.softmax(f64(logits), dim=-1) + eps
    steps = ["columns"] + ["rows", "columns"] * (repeat - 1)
    for step in steps[:-1]:
        axis = -2 if step == "columns" else -1
        p = p / (p.sum(axis, keepdim=True) + eps)
    return p.sum(-2)


class Sinkhorn(MhcOp):
    edge_arguments = {"": (0, 2)}  # the logits, a token's n×n
    stream_op = False
    outputs = (
        Output(
            "comb",
            RelativeError(SINKHORN_BOUND, atol=2.0**-10),
            "softmax (fast exp ≤ 2^-20) then 2R − 1 fp32 normalisations (n-term positive sum, reciprocal, product), "
            "each ≤ (n + 2)·2^-24; "
            "the iteration contracts errors, so 4·2R·(n + 2)·2^-24 covers R ≤ 20 (atol 2^-10: entries far below "
            "their column's mass)",
        ),
    )

    def variants(self, p, index):
        return [replace(p, repeat=r) for r in REPEATS]

    def benchmarks(self):
        return [("Sinkhorn fwd, n 4, repeat 20, 65536 tokens", MhcParams(65536, repeat=20))]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        return self.with_edge_values(case, Call((_logits(p, device, generator), p.repeat, p.eps)), generator)

    def expected_layout(self, case):
        return ((F32, (case.params.tokens, N, N)),)

    def bytes_moved(self, case):
        return case.params.tokens * N * N * 4 * 2

    def kernel_group(self, case):
        p = case.params
        return None if p.tokens == 0 else (self.name, p.repeat, bool(p.pad))

    def reference_float64(self, case, call):
        logits, repeat, eps = call.args
        return (reference.sinkhorn_forward_math(f64(logits), repeat, eps),)

    def extra_checks(self, case, call, outputs):
        logits, repeat, eps = call.args
        (comb,) = outputs
        if comb.numel() == 0:
            return [Check("columns sum to 1 within eps", PASS, "", "empty")]
        # The last step divides every column by (its sum S + eps): Σ_i comb = S / (S + eps), short of
        # 1 by eps / (S + eps), up to the rounding of n fp32 terms and the iterations' error.
        columns = comb.double().sum(dim=1)
        deficit = eps / (_column_sums_before_last_step(logits, repeat, eps) + eps)
        slack = 8 * U32 + SINKHORN_BOUND
        excess = torch.maximum(columns - 1 - 8 * U32, (1 - columns) - deficit - slack)
        worst = float(excess.max())
        metric = f"max |Σ_i − 1| {float((columns - 1).abs().max()):.3g}"
        return [
            _check_text("columns sum to 1 within eps/(S + eps)", worst <= 0, "Σ_i comb = S/(S + eps)", metric),
            _check_text("entries positive", bool((comb > 0).all()), "> 0", ""),
        ]


class SinkhornBwd(MhcOp):
    edge_arguments = {"grad": (0, 2), "logits": (1, 2)}
    edge_targets = ("grad", "logits")
    stream_op = False
    outputs = (
        Output(
            "grad_logits",
            RelativeError(SINKHORN_BWD_BOUND, atol=SINKHORN_BWD_ATOL),
            "2R − 1 reverse steps, each a cancelling n-term fp32 sum, then the softmax backward: 2^-16 relative, "
            "atol 2^-4 (the O(1) upstream gradient's scale) where the gradient cancels to near zero",
        ),
    )

    def variants(self, p, index):
        return [replace(p, repeat=r) for r in REPEATS]

    def benchmarks(self):
        return [("Sinkhorn bwd, n 4, repeat 20, 65536 tokens", MhcParams(65536, repeat=20))]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        logits = _logits(p, device, generator)
        shape = (p.tokens, N, N)
        grad = _tensor(shape, F32, device, generator, lambda: normal(shape, generator))
        return self.with_edge_values(case, Call((grad, logits, p.repeat, p.eps)), generator)

    def expected_layout(self, case):
        return ((F32, (case.params.tokens, N, N)),)

    def bytes_moved(self, case):
        return case.params.tokens * N * N * 4 * 3

    def kernel_group(self, case):
        p = case.params
        return None if p.tokens == 0 else (self.name, p.repeat, bool(p.pad))

    def reference_float64(self, case, call):
        grad, logits, repeat, eps = call.args
        return (reference.sinkhorn_backward_math(f64(grad), f64(logits), repeat, eps),)

    def autograd_float64(self, case, call):
        grad, logits, repeat, eps = call.args
        theirs = autograd_of(lambda x: reference.sinkhorn_forward_math(x, repeat, eps), (logits,), (grad,))
        return ("grad_logits",), self.reference_float64(case, call), theirs


# --- pre-apply and post -----------------------------------------------------------------------


class ApplyMix(MhcOp):
    edge_arguments = {"x": (0, 2), "mix": (1, 1)}
    edge_targets = ("x", "mix")
    outputs = (Output("layer_input", RelativeError(BF16_BOUND, SHORT_SUM_ATOL), WHY_SHORT_BF16),)

    def build(self, case, device, generator):
        p: MhcParams = case.params
        call = Call((_streams(p, device, generator), _pre_mix(p, device, generator)))
        return self.with_edge_values(case, call, generator)

    def expected_layout(self, case):
        p = case.params
        return ((BF16, (p.tokens, p.hidden)),)

    def bytes_moved(self, case):
        p = case.params
        return p.tokens * (p.width * 2 + N * 4 + p.hidden * 2)

    def reference_float64(self, case, call):
        x, mix = call.args
        return (reference.apply_mix_forward_math(f64(x), f64(mix)),)


class ApplyMixBwd(MhcOp):
    edge_arguments = {"grad": (0, 1), "x": (1, 2), "mix": (2, 1)}
    edge_targets = ("grad", "x", "mix")
    edge_base_count = 3
    outputs = (
        Output("grad_x", RelativeError(BF16_BOUND), WHY_PRODUCT_BF16),
        Output("grad_mix", RelativeError(SUM_OVER_C_BOUND, atol=0.5), WHY_SUM_OVER_C),
    )

    def build(self, case, device, generator):
        p: MhcParams = case.params
        shape = (p.tokens, p.hidden)
        grad = _tensor(shape, BF16, device, generator, lambda: normal(shape, generator))
        x = _streams(p, device, generator, inverse_sqrt_pow2(p.hidden))
        return self.with_edge_values(case, Call((grad, x, _pre_mix(p, device, generator))), generator)

    def expected_layout(self, case):
        p = case.params
        return ((BF16, (p.tokens, N, p.hidden)), (F32, (p.tokens, N)))

    def bytes_moved(self, case):
        p = case.params
        return p.tokens * (p.hidden * 2 + p.width * 2 + N * 4 + p.width * 2 + N * 4)

    def reference_float64(self, case, call):
        grad, x, mix = call.args
        return reference.apply_mix_backward_math(f64(grad), f64(x), f64(mix))

    def autograd_float64(self, case, call):
        grad, x, mix = call.args
        theirs = autograd_of(reference.apply_mix_forward_math, (x, mix), (grad,))
        return ("grad_x", "grad_mix"), self.reference_float64(case, call), theirs


class Post(MhcOp):
    edge_arguments = {"y": (0, 1), "residual": (1, 2), "post": (2, 1), "comb": (3, 2)}
    edge_targets = ("y", "residual", "post", "comb")
    edge_base_count = 3
    outputs = (
        Output(
            "residual_out",
            RelativeError(BF16_BOUND, SHORT_SUM_ATOL),
            "post_o·y + Σ_i comb[i, o]·X[i]: 5 fp32 products and 4 adds of O(1) values (post ≤ 2, comb ≤ 1) rounded "
            "once to bf16: 2^-8 + fp32 error ≤ 2^-12·atol (atol 2^-3 for cancellations)",
        ),
    )

    def benchmarks(self):
        return [("mhc_post fwd, T 8192, hidden 7168", MhcParams(8192, 7168))]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        shape = (p.tokens, p.hidden)
        y = _tensor(shape, BF16, device, generator, lambda: normal(shape, generator))
        residual = _streams(p, device, generator)
        call = Call((y, residual, _post_mix(p, device, generator), _comb(p, device, generator)))
        return self.with_edge_values(case, call, generator)

    def expected_layout(self, case):
        p = case.params
        return ((BF16, (p.tokens, N, p.hidden)),)

    def bytes_moved(self, case):
        p = case.params
        return p.tokens * (p.hidden * 2 + p.width * 2 + N * 4 + N * N * 4 + p.width * 2)

    def reference_float64(self, case, call):
        return (reference.post_forward_math(*(f64(t) for t in call.args)),)


class PostBwd(MhcOp):
    edge_arguments = {"grad": (0, 2), "y": (1, 1), "residual": (2, 2), "post": (3, 1), "comb": (4, 2)}
    edge_targets = ("grad", "y", "residual", "post", "comb")
    edge_base_count = 3
    outputs = (
        Output("grad_x", RelativeError(BF16_BOUND, SHORT_SUM_ATOL), WHY_SHORT_BF16),
        Output("grad_residual", RelativeError(BF16_BOUND, SHORT_SUM_ATOL), WHY_SHORT_BF16),
        Output("grad_post", RelativeError(SUM_OVER_C_BOUND, atol=0.5), WHY_SUM_OVER_C),
        Output("grad_comb", RelativeError(SUM_OVER_C_BOUND, atol=0.5), WHY_SUM_OVER_C),
    )

    def benchmarks(self):
        return [("mhc_post bwd, T 8192, hidden 7168", MhcParams(8192, 7168))]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        scale = inverse_sqrt_pow2(p.hidden)
        shape = (p.tokens, N, p.hidden)
        grad = _tensor(shape, BF16, device, generator, lambda: normal(shape, generator))
        y = _tensor(
            (p.tokens, p.hidden), BF16, device, generator, lambda: normal((p.tokens, p.hidden), generator, scale)
        )
        residual = _streams(p, device, generator, scale)
        call = Call((grad, y, residual, _post_mix(p, device, generator), _comb(p, device, generator)))
        return self.with_edge_values(case, call, generator)

    def expected_layout(self, case):
        p = case.params
        t = p.tokens
        return ((BF16, (t, p.hidden)), (BF16, (t, N, p.hidden)), (F32, (t, N)), (F32, (t, N, N)))

    def bytes_moved(self, case):
        p = case.params
        read = p.width * 2 + p.hidden * 2 + p.width * 2 + N * 4 + N * N * 4
        written = p.hidden * 2 + p.width * 2 + N * 4 + N * N * 4
        return p.tokens * (read + written)

    def reference_float64(self, case, call):
        return reference.post_backward_math(*(f64(t) for t in call.args))

    def autograd_float64(self, case, call):
        grad, *inputs = call.args
        theirs = autograd_of(reference.post_forward_math, inputs, (grad,))
        return ("grad_x", "grad_residual", "grad_post", "grad_comb"), self.reference_float64(case, call), theirs


# --- head -------------------------------------------------------------------------------------


def _head_inputs(p: MhcParams, device, generator, mix_scale: float):
    """input_mix: the first n columns of a ``[T, m]`` mixes buffer (row stride m, NaN elsewhere) when
    the case is strided; scale ``[1]`` in [0.5, 1.5]; base ``[n]`` in [-3.3, 3.3] (with the mix
    scaled by 2^-3, |z| ≤ 4.5: the σ' bound's premise)."""
    pad = M - N if p.pad else 0
    values = normal((p.tokens, N), generator, mix_scale) if generator is not None else None
    mix = place(values, (p.tokens, N), F32, device, pad)
    scale = _tensor((1,), F32, device, generator, lambda: uniform((1,), generator, 0.5, 1.5))
    base = _tensor((N,), F32, device, generator, lambda: uniform((N,), generator, -3.3, 3.3))
    return mix, scale, base


class HeadMix(MhcOp):
    edge_arguments = {"": (0, 1)}  # the input mix, rows of n
    stream_op = False
    outputs = (Output("head_mix", RelativeError(SIGMOID_BOUND), WHY_SIGMOID),)

    def build(self, case, device, generator):
        p: MhcParams = case.params
        return self.with_edge_values(case, Call((*_head_inputs(p, device, generator, 1.0), p.pre_eps)), generator)

    def expected_layout(self, case):
        return ((F32, (case.params.tokens, N)),)

    def bytes_moved(self, case):
        return case.params.tokens * N * 4 * 2 + (1 + N) * 4

    def reference_float64(self, case, call):
        mix, scale, base, pre_eps = call.args
        return (reference.head_mix_forward_math(f64(mix), f64(scale), f64(base), pre_eps),)

    def extra_checks(self, case, call, outputs):
        pre_eps = call.args[3]
        (out,) = outputs
        ok = bool(((out >= pre_eps) & (out <= 1 + pre_eps)).all())
        return [_check_text("head mix ∈ [pre_eps, 1 + pre_eps]", ok, "range", "")]


class HeadMixBwd(MhcOp):
    edge_arguments = {"grad": (0, 1), "mix": (1, 1)}
    edge_targets = ("grad", "mix")
    stream_op = False
    outputs = (
        Output("grad_mix", RelativeError(SIGMOID_GRAD_BOUND), WHY_SIGMOID_GRAD),
        Output(
            "grad_scale",
            RelativeError(HEAD_DSCALE_BOUND, atol=2.0**-5),
            _sum_over_tokens_why("T·n") + "; input mix scaled by 2^-3, so RSS ≈ atol 2^-5",
        ),
        Output(
            "grad_base",
            RelativeError(HEAD_DBASE_BOUND, atol=2.0**-4),
            _sum_over_tokens_why("T") + "; σ' of the columns' bases varies 6×: RSS ≤ 4·atol",
        ),
    )

    def build(self, case, device, generator):
        p: MhcParams = case.params
        mix, scale, base = _head_inputs(p, device, generator, 2.0**-3)
        shape = (p.tokens, N)
        grad = _tensor(shape, F32, device, generator, lambda: normal(shape, generator, inverse_sqrt_pow2(p.tokens)))
        return self.with_edge_values(case, Call((grad, mix, scale, base)), generator)

    def expected_layout(self, case):
        return ((F32, (case.params.tokens, N)), (F32, (1,)), (F32, (N,)))

    def bytes_moved(self, case):
        return case.params.tokens * N * 4 * 3 + (1 + N) * 4 * 2

    def reference_float64(self, case, call):
        return reference.head_mix_backward_math(*(f64(t) for t in call.args))

    def autograd_float64(self, case, call):
        grad, mix, scale, base = call.args
        theirs = autograd_of(lambda m, s, b: reference.head_mix_forward_math(m, s, b, 0.0), (mix, scale, base), (grad,))
        return ("grad_mix", "grad_scale", "grad_base"), self.reference_float64(case, call), theirs

    def extra_checks(self, case, call, outputs):
        _, mix, scale, base = call.args
        return [_z_premise_check(f64(mix) * f64(scale) + f64(base))]


# --- big fuse ---------------------------------------------------------------------------------

# The fused kernel runs the norm-fn GEMM on tensor cores (fn read as TF32), so its mixes carry
# mhc_pre_norm_fn's error, which the split, Sinkhorn and the pre-apply propagate. The cases keep
# that propagation small and its premises checked: fn is scaled by ½·2^-⌈log2 √nC⌉, so every GEMM's
# terms have a root-sum-square ≤ MIXES_RSS_MAX and |mixes| ≤ MIXES_MAX; the scales α = (s0, s1, s2)
# are drawn from BIG_FUSE_SCALES (pre and comb near [mHC]'s initial α = 0.01).
BIG_FUSE_SCALES = ((2.0**-5, 2.0**-4), (2.0**-2, 2.0**-1), (2.0**-5, 2.0**-4))  # s0 (pre), s1 (post), s2 (comb)
MIXES_RSS_MAX = 0.75
MIXES_MAX = 4.0
# |δmixes| ≤ LAMBDA·(√nC·2^-24 + 2^-11 + 2·2^-24)·RSS (TF32 products, floatops' probabilistic
# model) + (½·nC + 4)·2^-24·|mixes| (rsqrt of the positive Σx², as NORM_FN_BOUND): absolute, ≈ 5.3e-3.
MIXES_ERROR = LAMBDA * (NC_MAX**0.5 * U32 + U_TF32 + 2 * U32) * MIXES_RSS_MAX + (0.5 * NC_MAX + 4) * U32 * MIXES_MAX
# z = s·mixes + b moves by s·|δmixes|, and σ(z) by σ(1 − σ)·|δz|: at most |δz| relative (pre, post).
BIG_FUSE_PRE_BOUND = BIG_FUSE_SCALES[0][1] * MIXES_ERROR + SIGMOID_BOUND
BIG_FUSE_POST_BOUND = BIG_FUSE_SCALES[1][1] * MIXES_ERROR + SIGMOID_BOUND
# Sinkhorn's gain Σ_j |∂comb[i, o] / ∂z_j| ≤ SINKHORN_GAIN_MAX·max(comb[i, o], 2^-10) (a premise,
# checked per case through the explicit backward; ≈ 5 at most for these logits): comb moves by at
# most the gain times s2·|δmixes| (first order: s2·|δmixes| ≤ 4e-4), plus Sinkhorn's own error.
SINKHORN_GAIN_MAX = 6.0
BIG_FUSE_COMB_BOUND = SINKHORN_GAIN_MAX * BIG_FUSE_SCALES[2][1] * MIXES_ERROR + SINKHORN_BOUND
# layer_input = bf16(Σ_i pre_i·X_i): its rounding and fp32 sum (BF16_BOUND: 5·2^-24·Σ_i pre_i·|X_i|
# ≤ 2^-12·atol), plus Σ_i |δpre_i|·|X_i| ≤ BIG_FUSE_PRE_BOUND·Σ_i pre_i·|X_i|, where a premise keeps
# Σ_i pre_i·|X_i| ≤ PRE_SUM_MAX·atol (atol 1, the streams' scale: the sum may cancel).
PRE_SUM_MAX = 16.0
BIG_FUSE_LAYER_INPUT_BOUND = BF16_BOUND + BIG_FUSE_PRE_BOUND * PRE_SUM_MAX
SINKHORN_EPS = 1e-6  # the fused path's Sinkhorn eps (DeepSeek's)


def _premise_check(name: str, worst: float, limit: float) -> Check:
    """A premise of a bound: ``worst`` (measured on the case, float64) is at most ``limit``."""
    ok = worst <= limit
    return _check_text(f"premise {name} ≤ {limit:g}", ok, "premise", f"{worst:.3g}", f"reaches {worst:.3g}")


def sinkhorn_jacobian(logits: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """``J[t, (i o), (j l)] = ∂comb[t, i, o] / ∂logits[t, j, l]`` in float64 ``[T, n², n²]``: one explicit
    backward per (i, o), all n² of them in one call (the tokens repeated once per one-hot)."""
    logits = f64(logits)
    one_hot = torch.eye(N * N, dtype=F64, device=logits.device)
    one_hots = repeat_tensor(one_hot, "k (i o) -> (k t) i o", t=logits.shape[0], i=N)
    rows = reference.sinkhorn_backward_math(one_hots, repeat_tensor(logits, "t i o -> (k t) i o", k=N * N), repeat, eps)
    return rearrange(rows, "(k t) j l -> t k (j l)", k=N * N)


def _sinkhorn_gain(logits: torch.Tensor, repeat: int, eps: float) -> torch.Tensor:
    """``Σ_j |∂comb[t, i, o] / ∂logits[t, j]| / max(comb[t, i, o], 2^-10)`` in float64: the rows of
    each token's n² × n² Jacobian."""
    comb = reference.sinkhorn_forward_math(f64(logits), repeat, eps)
    row_sums = reduce(sinkhorn_jacobian(logits, repeat, eps).abs(), "t k m -> t k", "sum")
    gain = rearrange(row_sums, "t (i o) -> t i o", i=N)
    return gain / torch.clamp(comb, min=2.0**-10)


class BigFuse(MhcOp):
    edge_arguments = {"": (0, 2)}  # the residual, a token's n·C values
    outputs = (
        Output(
            "post_mix",
            RelativeError(BIG_FUSE_POST_BOUND),
            "post_mult·σ(s1·mixes + b) with mixes carrying the TF32 GEMM's error (≤ 5.3e-3 absolute: |mixes| ≤ 4, "
            "terms' RSS ≤ 0.75, premises checked): σ moves by ≤ s1·5.3e-3 relative, s1 ≤ 2^-1",
        ),
        Output(
            "comb_mix",
            RelativeError(BIG_FUSE_COMB_BOUND, atol=2.0**-10),
            "Sinkhorn of s2·mixes + b: the mixes' error (≤ 5.3e-3) times s2 ≤ 2^-4 times Sinkhorn's gain ≤ 6 "
            "(premise, checked), plus Sinkhorn's own error; atol 2^-10 as sinkhorn_normalize",
        ),
        Output(
            "layer_input",
            RelativeError(BIG_FUSE_LAYER_INPUT_BOUND, atol=1.0),
            "bf16(Σ_i pre_i·X_i): 2^-8 rounding + fp32 room, plus the pre weights' error (≤ 2^-4·5.3e-3 relative: "
            "s0 ≤ 2^-4) times Σ_i pre_i·|X_i| ≤ 16 (premise); atol 1, the streams' scale, for cancellations",
        ),
    )

    def variants(self, p, index):
        even = index % 2 == 0
        return [
            replace(
                p,
                weight=even,
                repeat=20 if even else 10,
                post_mult=2.0 if even else 1.0,
                pre_eps=1e-6 if even else 1e-2,
                n_splits=16 if even else 1,
            )
        ]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        residual, fn, weight = _norm_fn_inputs(
            p, device, generator, fn_scale=0.5 * inverse_sqrt_pow2(p.width), stream_scale=1.0, zero_token=True
        )

        def scales():
            return torch.cat([uniform((1,), generator, low, high) for low, high in BIG_FUSE_SCALES])

        scale = _tensor((3,), F32, device, generator, scales)
        base = _tensor((M,), F32, device, generator, lambda: uniform((M,), generator, -3.3, 3.3))
        args = (residual, fn, scale, base, p.eps, p.pre_eps, SINKHORN_EPS, p.post_mult, p.repeat, p.n_splits)
        return self.with_edge_values(case, Call(args, {"mhc_norm_weight": weight}), generator)

    def expected_layout(self, case):
        p = case.params
        return ((F32, (p.tokens, N)), (F32, (p.tokens, N, N)), (BF16, (p.tokens, p.hidden)))

    def bytes_moved(self, case):
        p = case.params
        parameters = M * p.width * 4 + (p.width * 4 if p.weight else 0) + (3 + M) * 4
        return p.tokens * (p.width * 2 + N * 4 + N * N * 4 + p.hidden * 2) + parameters

    def float64_steps(self, call: Call) -> dict[str, torch.Tensor]:
        """The four steps in float64 from the case's inputs, with what the premises measure."""
        residual, fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat, _ = call.args
        folded = _folded_fn64(fn, call.kwargs["mhc_norm_weight"])
        x = f64(residual)
        flat = rearrange(x, "t i c -> t (i c)")
        mixes = reference.norm_fn_forward_math(flat, folded, rms_eps)
        pre, post, logits = reference.split_mixes_forward_math(mixes, f64(scale), f64(base), N, post_mult, pre_eps)
        normed = flat * torch.rsqrt(reduce(flat * flat, "t k -> t 1", "mean") + rms_eps)
        return {
            "mixes": mixes,
            "rss": torch.sqrt((normed * normed) @ (folded * folded).T),  # of each GEMM's terms
            "pre_sum": einsum(pre, x.abs(), "t i, t i c -> t c"),
            "post": post,
            "logits": logits,
            "comb": reference.sinkhorn_forward_math(logits, repeat, sinkhorn_eps),
            "layer_input": reference.apply_mix_forward_math(x, pre),
        }

    def reference_float64(self, case, call):
        steps = self.float64_steps(call)
        return steps["post"], steps["comb"], steps["layer_input"]

    def edge_invariants(self, case, call, outputs):
        """The definition, on any inputs: the four operators run one by one give the same bits (any
        NaN matching any NaN, as the policy's)."""
        residual, fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat, _ = call.args
        weight = call.kwargs["mhc_norm_weight"]
        mixes = reference.mhc_pre_norm_fn(residual, fn, weight, rms_eps)
        pre, post, logits = reference.mhc_pre_split_mixes(mixes, scale, base, N, post_mult, pre_eps)
        comb = reference.sinkhorn_normalize(logits, repeat, sinkhorn_eps)
        layer_input = reference.mhc_pre_apply_mix(residual, pre)
        one_by_one = "≡ norm-fn → split → Sinkhorn → pre-apply, one by one"
        return [
            compare(f"{one_by_one}: {output.name}", actual, expected, Bitwise(nan_equal=True))
            for output, actual, expected in zip(self.outputs, outputs, (post, comb, layer_input), strict=True)
        ]

    def extra_checks(self, case, call, outputs):
        residual, fn, scale, base, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat, _ = call.args
        checks = self.edge_invariants(case, call, outputs)
        steps = self.float64_steps(call)

        def worst(values: torch.Tensor) -> float:
            return float(values.abs().max()) if values.numel() else 0.0

        gain = _sinkhorn_gain(steps["logits"], repeat, sinkhorn_eps)
        checks += [
            _premise_check("|mixes|", worst(steps["mixes"]), MIXES_MAX),
            _premise_check("RSS of the GEMM's terms", worst(steps["rss"]), MIXES_RSS_MAX),
            _premise_check("Σ_i pre_i·|X_i|", worst(steps["pre_sum"]), PRE_SUM_MAX),
            _premise_check("Sinkhorn gain", worst(gain), SINKHORN_GAIN_MAX),
        ]
        return checks


# --- multilayer recompute ---------------------------------------------------------------------

# Each output element of a layer is a short fp32 sum of K ≤ n + 1 products (layer input: n, next
# residual: n + 1) rounded once to bf16; in any order, with or without FMA, the fp32 value is within
# (K + 1)·2^-24·Σ|terms| of the exact sum. The cases redraw their inputs (the first residual's
# column, or a sublayer output element) until every layer's exact value lies more than
# FRAGILE_MARGIN·Σ|terms| from a bf16 rounding boundary (≈ 0.1 % of the elements are redrawn), so
# every correct fp32 evaluation rounds every layer, the intermediate residuals included, to the
# bits of the exact value: one right answer, and the contract's "bit-identical to the layers run one
# by one" is a bitwise policy (a kernel that keeps X_{l+1} in fp32 between layers fails it).
FRAGILE_MARGIN = 8 * U32
# (L, P) of the cases, taken in turn along the stream shapes.
# quick covers every fused kernel configuration full needs ((4, 3) on a contiguous shape), as CI compiles quick.
RECOMPUTE_LAYERS = {"quick": ((2, 2), (1, 0), (4, 4), (3, 2), (4, 3)), "full": ((4, 4), (4, 3))}
WHY_RECOMPUTE = (
    "every element is an fp32 sum of ≤ n + 1 products rounded once to bf16, and the case's exact values lie more "
    "than 8·2^-24·Σ|terms| from a bf16 rounding boundary (redrawn where not), beyond any evaluation order's "
    "error: one right answer per layer, intermediate residuals rounded to bf16 as the unfused path stores them; a "
    "NaN (from a NaN input) matches any NaN"
)


# Adding then subtracting 1.5·2^52 rounds a float64 of magnitude < 2^51 to an integer, half to even.
_ROUND_TO_INTEGER = 1.5 * 2.0**52


def _round_bf16(values: torch.Tensor) -> torch.Tensor:
    """float64 → float64 on bf16's grid (8 significant bits), round half to even, in one exact step
    (``.to(torch.bfloat16)`` from float64 may round twice, through fp32)."""
    _, exponent = torch.frexp(values)  # values = m·2^e, |m| ∈ [½, 1): m·2^8 ∈ [128, 256) in magnitude
    scale = torch.exp2((8 - exponent).to(F64))
    return ((values * scale + _ROUND_TO_INTEGER) - _ROUND_TO_INTEGER) / scale


def _near_boundary(value: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """Where some value within FRAGILE_MARGIN·magnitude of ``value`` rounds to another bf16 value."""
    margin = FRAGILE_MARGIN * magnitude
    return _round_bf16(value - margin) != _round_bf16(value + margin)


def _layer_input_sum(streams: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Σ_i pre_i·X_i`` and ``Σ_i |pre_i·X_i|`` (float64 ``[T, C]``), stream by stream."""
    value = torch.zeros_like(streams[:, 0])
    magnitude = torch.zeros_like(value)
    for i in range(streams.shape[1]):
        term = f64(pre[:, i : i + 1]) * streams[:, i]
        value, magnitude = value + term, magnitude + term.abs()
    return value, magnitude


def _residual_sum(streams, y, post, comb) -> tuple[torch.Tensor, torch.Tensor]:
    """``post_o·y + Σ_i comb[i, o]·X_i`` and the sum of the terms' magnitudes (float64 ``[T, n, C]``)."""
    value = rearrange(f64(post), "t o -> t o 1") * rearrange(f64(y), "t c -> t 1 c")
    magnitude = value.abs()
    for i in range(streams.shape[1]):
        term = rearrange(f64(comb[:, i]), "t o -> t o 1") * streams[:, i : i + 1]
        value, magnitude = value + term, magnitude + term.abs()
    return value, magnitude


def _replay_stage(stage: int, previous, x0, pres, ys, posts, combs):
    """Stage s of the float64 replay: the streams X_s (X_0, or layer s − 1's residual rounded to bf16),
    the exact values of stage s's outputs and where they lie near a rounding boundary ([T, C])."""
    fragile = torch.zeros((x0.shape[0], x0.shape[2]), dtype=torch.bool, device=x0.device)
    residual = None
    if stage == 0:
        streams = f64(x0)
    else:
        value, magnitude = _residual_sum(previous, ys[stage - 1], posts[stage - 1], combs[stage - 1])
        fragile |= _near_boundary(value, magnitude).any(dim=1)
        residual, streams = value, _round_bf16(value)
    layer_input = None
    if stage < len(pres):
        layer_input, magnitude = _layer_input_sum(streams, pres[stage])
        fragile |= _near_boundary(layer_input, magnitude)
    return streams, layer_input, residual, fragile


def _replay64(x0, pres, ys, posts, combs):
    """The contract's replay in float64: (exact layer inputs, exact residuals before their rounding,
    [T, C] masks of the elements near a bf16 rounding boundary, one per stage)."""
    layer_inputs, residuals, fragile = [], [], []
    streams = None
    for stage in range(len(ys) + 1):
        streams, layer_input, residual, near = _replay_stage(stage, streams, x0, pres, ys, posts, combs)
        layer_inputs += [layer_input] if layer_input is not None else []
        residuals += [residual] if residual is not None else []
        fragile.append(near)
    return layer_inputs, residuals, fragile


def _avoid_rounding_boundaries(x0, pres, ys, posts, combs, generator) -> None:
    """Redraw (in place, N(0, 1) in bf16) the inputs of the columns (t, c) whose stage-s outputs lie
    near a rounding boundary: X_0[t, :, c] for stage 0, else y_{s−1}[t, c]; stage by stage, since a
    redraw changes only its stage and the later ones. The float64 arithmetic is elementwise in a fixed
    order, so the same case redraws the same elements on any device."""
    streams = None
    for stage in range(len(ys) + 1):
        for _ in range(100):
            current, _, _, fragile = _replay_stage(stage, streams, x0, pres, ys, posts, combs)
            if not bool(fragile.any()):
                break
            tokens, columns = fragile.nonzero(as_tuple=True)
            count = tokens.numel()
            if stage == 0:
                x0[tokens, :, columns] = normal((count, N), generator).to(BF16).to(x0.device)
            else:
                ys[stage - 1][tokens, columns] = normal((count,), generator).to(BF16).to(x0.device)
        else:
            raise RuntimeError("could not draw inputs away from bf16 rounding boundaries")
        streams = current


class RecomputeCall(Call):
    """``mhc_multilayer_recompute`` writes into its last two arguments (lists of buffers) and returns
    None: each run gets fresh copies of the buffers, every byte 0xFF (bf16 NaN, so an element a twin
    leaves unwritten fails), and returns them stacked: ``(layer inputs [L, T, C], residuals [P, T, n, C])``."""

    def __call__(self, fn):
        *inputs, layer_inputs, residuals = self.args
        layer_inputs = [buffer.clone() for buffer in layer_inputs]
        residuals = [buffer.clone() for buffer in residuals]
        fn(*inputs, layer_inputs, residuals, **self.kwargs)
        tokens, n, hidden = inputs[0].shape
        device = inputs[0].device
        stacked_residuals = (
            torch.stack(residuals) if residuals else torch.empty((0, tokens, n, hidden), dtype=BF16, device=device)
        )
        return torch.stack(layer_inputs), stacked_residuals

    def timed(self, fn):
        """The operator alone, writing into one set of buffers kept for the timing runs (the compared
        runs above prove every element written; the clones and stacks are not the operator's time)."""
        *inputs, layer_inputs, residuals = self.args
        if "timed_buffers" not in self.context:
            self.context["timed_buffers"] = ([b.clone() for b in layer_inputs], [b.clone() for b in residuals])
        fn(*inputs, *self.context["timed_buffers"], **self.kwargs)


class MultilayerRecompute(MhcOp):
    # NaN and ±Inf in the first residual only: they propagate through every layer without rounding
    # anything, so the outputs stay bitwise; a finite edge value would move the exact values onto
    # bf16 rounding boundaries the inputs were drawn away from (see FRAGILE_MARGIN).
    edge_kinds = ("nan", "inf")
    edge_arguments = {"": (0, 2)}
    outputs = (
        Output("layer_inputs", Bitwise(nan_equal=True), WHY_RECOMPUTE),
        Output("residuals", Bitwise(nan_equal=True), WHY_RECOMPUTE),
    )

    def cases(self, tier):
        shapes = [MhcParams(t, c, pad) for t, c, pad in STREAM_SHAPES[tier]]
        layouts = RECOMPUTE_LAYERS[tier]
        params = [
            replace(shape, layers=layouts[i % len(layouts)][0], posts=layouts[i % len(layouts)][1])
            for i, shape in enumerate(shapes)
        ]
        if tier == "quick":
            # The full tier's layer layouts at both of replay_schedule's CTA shapes (160 threads × 1
            # at C 2560, 64 × 2 at C 7168): kernels the quick tier's compile check must build.
            params += [MhcParams(2, c, 0, layers=l, posts=p) for c in (2560, 7168) for l, p in RECOMPUTE_LAYERS["full"]]
        return [Case(self.name, _label(self.name, p), p) for p in params]

    def kernel_group(self, case):
        p: MhcParams = case.params
        return None if p.tokens == 0 else (self.name, p.hidden, p.layers, p.posts, bool(p.pad))

    def build(self, case, device, generator):
        p: MhcParams = case.params
        shape, stream_shape = (p.tokens, p.hidden), (p.tokens, N, p.hidden)
        x0 = normal(stream_shape, generator).to(BF16).to(device) if generator is not None else None
        pres, ys, posts, combs = [], [], [], []
        for layer in range(p.layers):
            pres.append(_pre_mix(p, device, generator))
            if layer < p.posts:
                ys.append(normal(shape, generator).to(BF16).to(device) if generator is not None else None)
                posts.append(_post_mix(p, device, generator))
                combs.append(_comb(p, device, generator))
        if generator is not None:
            _avoid_rounding_boundaries(x0, pres, ys, posts, combs, generator)
        x0 = place(x0, stream_shape, BF16, device, p.pad)
        ys = [place(y, shape, BF16, device, p.pad) for y in ys]
        layer_inputs = [unwritten_bf16(shape, device) for _ in range(p.layers)]
        residuals = [unwritten_bf16(stream_shape, device) for _ in range(p.posts)]
        # Edge values after the inputs were drawn away from rounding boundaries: NaN and ±Inf only,
        # which propagate through every layer without rounding anything (see edge_kinds).
        call = RecomputeCall((x0, pres, ys, posts, combs, layer_inputs, residuals))
        return self.with_edge_values(case, call, generator)

    def expected_layout(self, case):
        p = case.params
        return ((BF16, (p.layers, p.tokens, p.hidden)), (BF16, (p.posts, p.tokens, N, p.hidden)))

    def bytes_moved(self, case):
        p = case.params
        read = p.width * 2 + p.layers * N * 4 + p.posts * (p.hidden * 2 + N * 4 + N * N * 4)
        written = p.layers * p.hidden * 2 + p.posts * p.width * 2
        return p.tokens * (read + written)

    def extra_checks(self, case, call, outputs):
        x0, pres, ys, posts, combs, _, _ = call.args
        layer_inputs, residuals = outputs
        exact_inputs, exact_residuals, fragile = _replay64(x0, pres, ys, posts, combs)
        near = sum(int(mask.sum()) for mask in fragile)
        checks = [
            _check_text(
                "premise: no exact value within 8·2^-24·Σ|terms| of a bf16 boundary",
                near == 0,
                "premise",
                f"{near} columns",
                f"{near} (token, channel) columns lie near a rounding boundary",
            )
        ]

        def stacked(values: list, like: torch.Tensor) -> torch.Tensor:
            return torch.stack([_round_bf16(v).to(BF16) for v in values]) if values else torch.empty_like(like)

        checks += [
            compare(
                "≡ float64 replay, rounded (layer inputs)", layer_inputs, stacked(exact_inputs, layer_inputs), Bitwise()
            ),
            compare("≡ float64 replay, rounded (residuals)", residuals, stacked(exact_residuals, residuals), Bitwise()),
        ]
        return checks + self.edge_invariants(case, call, outputs)

    def edge_invariants(self, case, call, outputs):
        """The contract, on any inputs: bit-identical to mhc_pre_apply_mix and mhc_post run layer by
        layer (any NaN matching any NaN, as the policy's)."""
        x0, pres, ys, posts, combs, _, _ = call.args
        layer_inputs, residuals = outputs
        streams, one_by_one_inputs, one_by_one_residuals = x0, [], []
        for layer, pre in enumerate(pres):
            one_by_one_inputs.append(reference.mhc_pre_apply_mix(streams, pre))
            if layer < len(ys):
                streams = reference.mhc_post(ys[layer], streams, posts[layer], combs[layer])
                one_by_one_residuals.append(streams)
        expected_residuals = (
            torch.stack(one_by_one_residuals) if one_by_one_residuals else residuals.new_empty(residuals.shape)
        )
        same = Bitwise(nan_equal=True)
        return [
            compare("≡ layers one by one (mhc_pre_apply_mix)", layer_inputs, torch.stack(one_by_one_inputs), same),
            compare("≡ layers one by one (mhc_post)", residuals, expected_residuals, same),
        ]


# --- registration -----------------------------------------------------------------------------

SPECS = (
    ExpandToMhc("expand_to_mhc"),
    ExpandToMhcBwd("expand_to_mhc_bwd"),
    PreNormFn("mhc_pre_norm_fn"),
    PreNormFnBwd("mhc_pre_norm_fn_bwd"),
    SplitMixes("mhc_pre_split_mixes"),
    SplitMixesBwd("mhc_pre_split_mixes_bwd"),
    Sinkhorn("sinkhorn_normalize"),
    SinkhornBwd("sinkhorn_normalize_bwd"),
    ApplyMix("mhc_pre_apply_mix"),
    ApplyMixBwd("mhc_pre_apply_mix_bwd"),
    Post("mhc_post"),
    PostBwd("mhc_post_bwd"),
    HeadMix("mhc_head_compute_mix"),
    HeadMixBwd("mhc_head_compute_mix_bwd"),
    BigFuse("mhc_pre_big_fuse"),
    MultilayerRecompute("mhc_multilayer_recompute"),
)
OPS = tuple(spec.name for spec in SPECS)
for _spec in SPECS:
    register(_spec)
