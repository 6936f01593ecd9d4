"""The mHC family (contract §5) for the oracle: cases, inputs, policies, bytes, self-checks.

Fourteen operators, each explicit backward its own: ``expand_to_mhc`` (+``_bwd``),
``mhc_pre_norm_fn`` (+``_bwd``), ``mhc_pre_split_mixes`` (+``_bwd``), ``sinkhorn_normalize``
(+``_bwd``), ``mhc_pre_apply_mix`` (+``_bwd``), ``mhc_post`` (+``_bwd``) and
``mhc_head_compute_mix`` (+``_bwd``). (``mhc_pre_big_fuse`` and ``mhc_multilayer_recompute`` are
registered elsewhere.) n = 4 streams everywhere, as in every DeepSeek model.

Cases. Stream ops (those with a hidden size C): ``quick`` has T ∈ {0, 1, 37, 5 (strided), 3} with
C ∈ {64, 128, 1280}; ``full`` has every T ∈ {0, 1, 4001, 8192} with every C ∈ {1280, 2560, 4096,
7168} (the [TK] test sizes; 7168 is V4-Pro's), plus a strided case. Token ops (split, Sinkhorn,
head) have the same token counts. Sinkhorn runs every shape with repeat 10 ([TK]'s default) and 20
(DeepSeek's models). Named benchmarks (``full``): ``mhc_post`` forward and backward at T 8192,
C 7168, and Sinkhorn forward and backward at n 4, repeat 20, 65536 tokens (issue 7's acceptance list).

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
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace

import torch
from einops import rearrange, reduce

from tileproof.reference import mhc as reference

from .floatops import (
    BF16_BOUND,
    F64,
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
    "quick": [(0, 64, 0), (1, 64, 0), (37, 128, 0), (5, 64, PAD), (3, 1280, 0)],
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
# positive terms and a division (≤ (n + 1)·2^-24 relative per step). The iteration contracts
# perturbations, so errors do not compound beyond this linear count; a margin of 4 covers the
# measured worst case (≈ 1e-6 at R = 20).
SINKHORN_BOUND = 2.0**-20 + 4 * (2 * max(REPEATS)) * (N + 1) * U32
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
    post_mult: float = 2.0  # split: the post multiplier (2 in the paper and V4; [TK]'s default 1)
    pre_eps: float = 1e-6  # split / head: added to the pre weights ([TK]'s split test: 1e-2)

    @property
    def width(self) -> int:
        return N * self.hidden  # nC, the flattened stream


def _label(name: str, p: MhcParams) -> str:
    label = f"{name}/T{p.tokens}"
    if p.hidden:
        label += f"/C{p.hidden}"
    if p.repeat:
        label += f"/R{p.repeat}"
    if name.startswith("mhc_pre_norm_fn"):
        label += ("/gamma" if p.weight else "/nogamma") + f"/eps{p.eps:g}"
    if name.startswith("mhc_pre_split_mixes"):
        label += f"/post{p.post_mult:g}/pre_eps{p.pre_eps:g}"
    return label + ("/strided" if p.pad else "")


def _check_text(name: str, ok: bool, policy: str, metric: str, detail: str = "") -> Check:
    return Check(name, PASS if ok else FAIL, policy, metric, "" if ok else detail)


class MhcOp(FloatOp):
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
    outputs = (Output("out", Bitwise(), WHY_COPY),)

    def build(self, case, device, generator):
        p: MhcParams = case.params
        shape = (p.tokens, p.hidden)
        hidden = place(normal(shape, generator) if generator is not None else None, shape, BF16, device, p.pad)
        return Call((hidden, N))

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
    outputs = (Output("grad_hidden", RelativeError(BF16_BOUND, SHORT_SUM_ATOL), WHY_EXPAND_BWD),)

    def build(self, case, device, generator):
        return Call((_streams(case.params, device, generator),))

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
    fn = _tensor((M, p.width), F32, device, generator, lambda: normal((M, p.width), generator, fn_scale))
    weight = None
    if p.weight:
        weight = _tensor((p.width,), F32, device, generator, lambda: uniform((p.width,), generator, 0.9, 1.1))
    return residual, fn, weight


def _folded_fn64(fn: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return f64(fn) if weight is None else f64(fn) * f64(weight)


class PreNormFn(MhcOp):
    outputs = (
        Output(
            "mixes",
            RelativeError(NORM_FN_BOUND, atol=0.5),
            "GEMM over nC with fn read as TF32 (2^-11 per product, random signs): 5·(2^-11 + √nC·2^-24) of the terms' "
            "RSS (≤ 2.5·atol: fn scaled by 2^-⌈log2 √nC⌉), plus ½·nC·2^-24 from rsqrt of the positive Σx²",
        ),
    )

    def variants(self, p, index):
        return [replace(p, weight=index % 2 == 0)]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        residual, fn, weight = _norm_fn_inputs(
            p, device, generator, fn_scale=inverse_sqrt_pow2(p.width), stream_scale=1.0, zero_token=True
        )
        return Call((residual, fn, weight, p.eps))

    def expected_layout(self, case):
        return ((F32, (case.params.tokens, M)),)

    def bytes_moved(self, case):
        p = case.params
        return p.tokens * p.width * 2 + M * p.width * 4 + (p.width * 4 if p.weight else 0) + p.tokens * M * 4

    def reference_float64(self, case, call):
        residual, fn, weight, eps = call.args
        x = rearrange(f64(residual), "t i c -> t (i c)")
        return (reference.norm_fn_forward_math(x, _folded_fn64(fn, weight), eps),)

    def extra_checks(self, case, call, outputs):
        # [mHC]'s reordering: RMS-normalising x first, then the GEMM, is the same math.
        residual, fn, weight, eps = call.args
        x = rearrange(f64(residual), "t i c -> t (i c)")
        normed = x * torch.rsqrt(reduce(x * x, "t k -> t 1", "mean") + eps)
        expected = normed @ _folded_fn64(fn, weight).T
        policy = self.outputs[0].policy
        return [compare("≡ RMSNorm then GEMM (float64)", outputs[0], outputs[0], policy, expected64=expected)]


class PreNormFnBwd(MhcOp):
    outputs = (
        Output(
            "grad_residual",
            RelativeError(NORM_FN_BWD_DRESIDUAL_BOUND, atol=0.25),
            "fnᵀ·dmul over m = 24 with both operands TF32 (2·2^-11 per product) + 2·dsq·x (~1/√nC of it): "
            "5·(2·2^-11 + ...) of the terms' RSS, ≤ 3·atol (fn scaled by 2^-3)",
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
        return [replace(p, weight=index % 2 == 1)]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        scale = inverse_sqrt_pow2(p.tokens)
        # No all-zero token here: its rsqrt(eps) would lift the gradients far above the bounds' scale.
        residual, fn, weight = _norm_fn_inputs(
            p, device, generator, fn_scale=2.0**-3, stream_scale=scale, zero_token=False
        )
        grad = _tensor((p.tokens, M), F32, device, generator, lambda: normal((p.tokens, M), generator, scale))
        return Call((grad, residual, fn, weight, p.eps))

    def expected_layout(self, case):
        p = case.params
        weight = (F32, (p.width,)) if p.weight else None
        return ((F32, (p.tokens, N, p.hidden)), (F32, (M, p.width)), weight)

    def bytes_moved(self, case):
        p = case.params
        weight = p.width * 4 * 2 if p.weight else 0  # read γ, write its gradient
        return p.tokens * M * 4 + p.tokens * p.width * (2 + 4) + M * p.width * 4 * 2 + weight

    def reference_float64(self, case, call):
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
        mine = self.reference_float64(case, call)
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
        return Call((mixes, scale, base, N, p.post_mult, p.pre_eps))

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
        return Call((*grads, mixes, scale, base, N, p.post_mult))

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
    stream_op = False
    outputs = (
        Output(
            "comb",
            RelativeError(SINKHORN_BOUND, atol=2.0**-10),
            "softmax (fast exp ≤ 2^-20) then 2R − 1 fp32 normalisations of n-term positive sums, each ≤ (n + 1)·2^-24; "
            "the iteration contracts errors, so 4·2R·(n + 1)·2^-24 covers R ≤ 20 (atol 2^-10: entries far below "
            "their column's mass)",
        ),
    )

    def variants(self, p, index):
        return [replace(p, repeat=r) for r in REPEATS]

    def benchmarks(self):
        return [("Sinkhorn fwd, n 4, repeat 20, 65536 tokens", MhcParams(65536, repeat=20))]

    def build(self, case, device, generator):
        p: MhcParams = case.params
        return Call((_logits(p, device, generator), p.repeat, p.eps))

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
        return Call((grad, logits, p.repeat, p.eps))

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
    outputs = (Output("layer_input", RelativeError(BF16_BOUND, SHORT_SUM_ATOL), WHY_SHORT_BF16),)

    def build(self, case, device, generator):
        p: MhcParams = case.params
        return Call((_streams(p, device, generator), _pre_mix(p, device, generator)))

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
    outputs = (
        Output("grad_x", RelativeError(BF16_BOUND), WHY_PRODUCT_BF16),
        Output("grad_mix", RelativeError(SUM_OVER_C_BOUND, atol=0.5), WHY_SUM_OVER_C),
    )

    def build(self, case, device, generator):
        p: MhcParams = case.params
        shape = (p.tokens, p.hidden)
        grad = _tensor(shape, BF16, device, generator, lambda: normal(shape, generator))
        x = _streams(p, device, generator, inverse_sqrt_pow2(p.hidden))
        return Call((grad, x, _pre_mix(p, device, generator)))

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
        return Call((y, residual, _post_mix(p, device, generator), _comb(p, device, generator)))

    def expected_layout(self, case):
        p = case.params
        return ((BF16, (p.tokens, N, p.hidden)),)

    def bytes_moved(self, case):
        p = case.params
        return p.tokens * (p.hidden * 2 + p.width * 2 + N * 4 + N * N * 4 + p.width * 2)

    def reference_float64(self, case, call):
        return (reference.post_forward_math(*(f64(t) for t in call.args)),)


class PostBwd(MhcOp):
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
        return Call((grad, y, residual, _post_mix(p, device, generator), _comb(p, device, generator)))

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
    stream_op = False
    outputs = (Output("head_mix", RelativeError(SIGMOID_BOUND), WHY_SIGMOID),)

    def build(self, case, device, generator):
        p: MhcParams = case.params
        return Call((*_head_inputs(p, device, generator, 1.0), p.pre_eps))

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
        return Call((grad, mix, scale, base))

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
)
OPS = tuple(spec.name for spec in SPECS)
for _spec in SPECS:
    register(_spec)
