"""The Engram family (contract §4) for the oracle: cases, inputs, policies, bytes, self-checks.

Five operators: ``engram_hash``, ``fused_weight``, ``engram_gate_fwd``, ``engram_gate_bwd`` and
``grad_w_reduce``. n = 4 streams; the gate's hidden size D is a multiple of 256 and at least 512
everywhere (the [TK] kernels' constraint).

Cases:

- *hash*: [TK]'s test configuration (N = 3, L = 2, M = 8) with table sizes near 10^6 and V4.1's
  (N = 4, L = 1, M = 8, tables near 1.6·10^7), distinct primes found upward from those sizes, the
  offsets their per-layer prefix sums; token ids below 129280; Engram's odd multipliers (no int64
  overflow) and multipliers that overflow (the wrapped XOR is negative: floored modulo); one
  case's ids are a column view of a wider buffer padded with −1;
- *gate*: T ∈ {0, 1, 4001, 8192} × D ∈ {4096, 7168} (``full``; tiny shapes, one D = 4096 and one
  D = 7168 in ``quick``); k and v views of one fused ``[T, (n + 1)·D]`` projection output (some cases
  contiguous); token 1 has an all-zero x stream and token 2 an all-zero k stream (only eps keeps
  rstd finite; s = 0 gives gate ½ and the clamped branch); every other (token, stream) has
  |s| ≥ 2^-8, k rows being redrawn until it does (see ``S_GAP``); eps 1e-20 and clamp 1e-6
  ([TK]'s tests), plus one case per tier with clamp 0.3, where a good share of the pairs fall on the
  clamped branch; one case per tier without saved statistics (``save_for_backward=False``). The backward's
  ``num_partials`` is an H200's 132 SMs (114, an H100 PCIe's, for one case; small counts in
  ``quick``, one with empty token blocks); the backward's ``kvgrad`` cases write dk and dv into one
  fresh NaN-poisoned ``grad_kv`` buffer (``GradKvCall``), whose parts are compared;
- *weights*: n × D gains 1 + 0.1·N(0, 1) in bf16 (``fused_weight`` uses 0.3, so that products need
  all 16 bits), one case's gains strided; ``grad_w_reduce`` with P ∈ {0, 1, 3, 114, 132}.

Benchmarks (``full``, issue 7's acceptance list): ``engram_gate_fwd`` and ``engram_gate_bwd`` at
T 8192, n 4, D 4096.

Scalings (exact powers of two, see ``floatops``): the forward's k is N(0, 1) scaled by
2^-⌈log2 √D⌉: the gate is invariant to the scale of k (rstd_k undoes it; eps 1e-20 is far below
mean(k²)), and it keeps the root-sum-square of ``dot``'s D terms in (½, 1] at every D.
``grad_w_reduce``'s partials are scaled by 2^-⌈log2 P⌉.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch
from einops import rearrange, reduce

from tileproof.reference import engram as reference

from .floatops import (
    AUTOGRAD_BOUND,
    BF16_BOUND,
    F64,
    FLOAT64_CHECK_ELEMENTS,
    LAMBDA,
    U32,
    U_BF16,
    FloatOp,
    autograd_of,
    f64,
    input_elements,
    inverse_pow2,
    inverse_sqrt_pow2,
    normal,
    normwise_check,
    place,
    random_sum_bound,
    unwritten_bf16,
)
from .policy import FAIL, PASS, SKIP, Bitwise, Check, RelativeError, compare
from .registry import FLOAT_EDGE_KINDS, Call, Case, Output, register

N = 4  # streams (hc_mult)
F32, BF16, I32, I64 = torch.float32, torch.bfloat16, torch.int32, torch.int64

TOKENS = (0, 1, 4001, 8192)
GATE_HIDDENS = (4096, 7168)
D_MAX = max(GATE_HIDDENS)
PARTIALS = (114, 132)  # SM counts: an H100 PCIe, an H200 (one persistent CTA per SM)
P_MAX = max(PARTIALS)
VOCAB = 129280  # DeepSeek-V3's vocabulary: the token ids' range
EPS = 1e-20
CLAMP = 1e-6
# The gate σ(sign(s)·√max(|s|, c)) is singular at s = 0 (a jump of ½√c there, and d/ds = ½|s|^-½
# beside it): an fp32 error δs ≈ 5·√D·2^-24 of s near 0 moves the gate by up to ½√δs ≈ 2^-9, as
# much as a real bug (a gate stored in bf16, copysign's sign(0) = +1). The cases keep every
# (token, stream) with s ≠ 0 at |s| ≥ S_GAP, and |s| off the clamp value by 2^-10 relative
# (where the backward's β jumps), by redrawing its k (about 0.6 % of the rows); s = 0 stays,
# exactly, on the zero streams.
S_GAP = 2.0**-8

# --- bounds (see floatops for the model) --------------------------------------------------------

# rstd = rsqrt(Σ_d x²/D + eps): a sum of D positive terms (≤ (D − 1)·2^-24 relative), halved by
# the square root, plus the division, the eps add and rsqrt's own ≤ 2 ulp.
RSTD_BOUND = (0.5 * D_MAX + 4) * U32
# dot = Σ_d x·w·k: x·w is exact in fp32 (8 + 16 significant bits), ·k rounds once, then D adds
# of random-sign terms (floatops' probabilistic model; RSS ≤ 2.5·atol by k's scaling).
DOT_BOUND = random_sum_bound(D_MAX)
DOT_ATOL = 0.5
# gate: s = dot·rstd_x·rstd_k/√D carries dot's error (5·√D·2^-24 of the normalised terms' RSS, ≈ 1)
# and twice rstd's relative error; with |s| ≥ S_GAP, dgate/gate ≤ (1 − g)·½·|s|^-½·δs stays below
# 2^-13 (worst at |s| = S_GAP: ¼·16·2.6e-5 ≈ 1e-4), so 2^-12 has a factor 2 to spare.
GATE_BOUND = 2.0**-12
# out = bf16(x + gate·v): rounding 2^-8 relative, plus the gate's error (≤ 2^-12·½) times |v| ≤ 6,
# ≤ 7.3e-4 absolute: within the room 2^-10·atol (atol 2: cancellations of x and gate·v are measured
# at the scale of the operands).
OUT_BOUND, OUT_ATOL = U_BF16 + 2.0**-10, 2.0
# Backward: β = dg·g(1 − g)·½·√(norms/|dot|) carries the D-term fp32 sum dg = Σ_d go·v, within
# LAMBDA·√D·2^-24 of its terms' RSS (the typical |dg|; probabilistic model), and ~8 roundings.
BETA_ERROR = LAMBDA * D_MAX**0.5 * U32 + 8 * U32
# dx = go + β·a and dk = β·b (a, b: differences of two O(1) products), rounded to bf16: 2^-8 plus
# room 2^-10 for β's error on terms of the typical size. atol ½: where go and β·a cancel (or b's
# two products do) the error is measured at the scale of go, |β·b| and their fp32 roundings.
GATE_BWD_BOUND = U_BF16 + 2.0**-10
GATE_BWD_ATOL = 0.5
# dw_partial = Σ over a token block (≤ 64 tokens, T/P) of β·x⊙k: random-sign terms, each with
# β's error; atol ½, the RSS scale of a block with these inputs (β ∝ |s|^-½ is largest, and |ref|
# with it, for the |s| near S_GAP: the measure is then relative).
BLOCK_TOKENS_MAX = 64
DW_BOUND = random_sum_bound(BLOCK_TOKENS_MAX, BETA_ERROR)
DW_ATOL = 0.5
# grad_w_reduce: Σ over P partials (scaled so Σ_p |dw| ≲ 1), one product with a gain (≤ 2.2) and
# one add to an accumulator (|grad| ≤ 1.5): (P + 2)·2^-24 relative to Σ|terms| ≤ atol = 4.
REDUCE_BOUND = (P_MAX + 2) * U32
REDUCE_ATOL = 4.0

WHY_INTEGER = "integer table rows: exactly one right answer"
WHY_EXACT_PRODUCT = (
    "the product of two bf16 values fits fp32's 24-bit significand: exact (±Inf where it overflows fp32), one right "
    "answer; a NaN (from a NaN gain) matches any NaN"
)


# --- edge cases (docs/numerics.md), shared with oracle.mhc -------------------------------------

EDGE_SKIP_NOTE = (
    "edge case: the operator's own invariants (ranges, identities) and the premises of its bounds are statements "
    "about ordinary inputs; the edge rule (policy.EdgeReference) holds the bounds where the fp32 reference meets them"
)


class FloatEdges:
    """The edge profile of a float operator (mixed in before ``FloatOp``): every class, written into
    the arguments ``edge_arguments`` names (one per case in turn, ``edge_targets``), on
    ``edge_base_count`` quick cases with tokens; and the self-checks of an edge case
    (``edge_self_checks``)."""

    edge_kinds = FLOAT_EDGE_KINDS

    def edge_base_ok(self, case: Case) -> bool:
        return getattr(case.params, "tokens", 1) > 0 and not case.benchmark

    def edge_invariants(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        """Invariants that hold on edge values too (bit-identities between two paths, say)."""
        return []

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        if case.edge is None:
            return super().self_check(case, call, outputs)
        return edge_self_checks(self, case, call, outputs)


def edge_self_checks(spec, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
    """An edge case's self-checks: the documented layout; an explicit backward ≡ autograd of the
    forward when the edge values are finite (float64 has the range of a bf16 or fp32 max: the two
    formulas still agree; with NaN or ±Inf their NaN patterns may differ and say nothing); the
    ``edge_invariants``; the ordinary invariants are skipped (``EDGE_SKIP_NOTE``)."""
    checks = [spec._layout_check(case, outputs)]
    small = input_elements(call) <= FLOAT64_CHECK_ELEMENTS
    gradients = spec.autograd_float64(case, call) if case.edge.finite and small else None
    if gradients is not None:
        names, explicit, autograd = gradients
        for name, mine, theirs in zip(names, explicit, autograd, strict=True):
            checks.append(normwise_check(f"explicit ≡ autograd (float64): {name}", mine, theirs, AUTOGRAD_BOUND))
    checks += spec.edge_invariants(case, call, outputs)
    checks.append(Check("invariants of ordinary inputs", SKIP, detail=EDGE_SKIP_NOTE))
    return checks


# --- hash -------------------------------------------------------------------------------------


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    return all(value % divisor for divisor in range(2, math.isqrt(value) + 1))


@cache
def _distinct_primes(count: int, start: int) -> tuple[int, ...]:
    """The ``count`` primes above ``start``, in order: Engram's next-prime search, unique per table."""
    primes: list[int] = []
    candidate = start
    while len(primes) < count:
        candidate += 1
        if _is_prime(candidate):
            primes.append(candidate)
    return tuple(primes)


@dataclass(frozen=True)
class HashParams:
    tokens: int
    max_ngram: int  # N
    layers: int  # L
    tables: int  # M per order
    table_size: int  # the primes start above this
    multipliers: str = "engram"  # "engram": odd, no overflow; "wrapping": products overflow int64
    strided: bool = False  # ids are a column view of a wider buffer (padding −1)


HASH_CONFIGS = {"tk": (3, 2, 8, 1_000_000), "v4": (4, 1, 8, 16_000_000)}  # N, L, M, table size
HASH_CASES = {
    "quick": [
        HashParams(0, 3, 2, 8, 1000),
        HashParams(1, 3, 2, 8, 1000),
        HashParams(37, 4, 1, 8, 1000, strided=True),
        HashParams(33, 3, 2, 4, 1000, multipliers="wrapping"),
        HashParams(5, 2, 1, 1, 7),
    ],
    "full": [HashParams(t, *HASH_CONFIGS[c]) for c in HASH_CONFIGS for t in TOKENS]
    + [
        HashParams(4001, *HASH_CONFIGS["tk"], multipliers="wrapping"),
        HashParams(8192, *HASH_CONFIGS["v4"], strided=True),
    ],
}


def _wrap64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class EngramHash(FloatOp):
    family = "engram"
    outputs = (Output("rows", Bitwise(), WHY_INTEGER),)

    def __init__(self):
        self.name = "engram_hash"

    def cases(self, tier):
        def label(p: HashParams) -> str:
            text = f"{self.name}/T{p.tokens}/N{p.max_ngram}/L{p.layers}/M{p.tables}/V{p.table_size}"
            return text + ("/wrapping" if p.multipliers == "wrapping" else "") + ("/strided" if p.strided else "")

        return [Case(self.name, label(p), p) for p in HASH_CASES[tier]]

    def build(self, case, device, generator):
        p: HashParams = case.params
        L, N_, M_ = p.layers, p.max_ngram, p.tables
        pad = 3 if p.strided else 0
        if generator is None:
            ids = torch.empty((p.tokens, N_ + pad), dtype=I32, device=device)[:, :N_]
            multipliers = torch.empty((L, N_), dtype=I64, device=device)
            vocab = torch.empty((L, N_ - 1, M_), dtype=I32, device=device)
            offsets = torch.empty((L, (N_ - 1) * M_), dtype=I32, device=device)
            return Call((ids, multipliers, vocab, offsets))
        wide = torch.full((p.tokens, N_ + pad), -1, dtype=I32)
        wide[:, :N_] = torch.randint(0, VOCAB, (p.tokens, N_), generator=generator, dtype=I32)
        if p.multipliers == "wrapping":
            multipliers = torch.randint(-(2**62), 2**62, (L, N_), generator=generator, dtype=I64) * 2 + 1
        else:  # Engram's: odd and below (2^63 − 1) / |V| / 2, so that no product overflows
            bound = (2**63 - 1) // VOCAB // 2
            multipliers = torch.randint(0, bound, (L, N_), generator=generator, dtype=I64) * 2 + 1
        primes = torch.tensor(_distinct_primes(L * (N_ - 1) * M_, p.table_size), dtype=I64)
        vocab = primes.reshape(L, N_ - 1, M_)
        flat = vocab.reshape(L, -1)
        offsets = flat.cumsum(1) - flat  # exclusive prefix sums: one flat table per layer
        return Call(
            (wide.to(device)[:, :N_], multipliers.to(device), vocab.to(I32).to(device), offsets.to(I32).to(device))
        )

    def expected_layout(self, case):
        p: HashParams = case.params
        return ((I32, (p.layers, p.tokens, (p.max_ngram - 1) * p.tables)),)

    def bytes_moved(self, case):
        p: HashParams = case.params
        columns = (p.max_ngram - 1) * p.tables
        return (
            p.tokens * p.max_ngram * 4
            + p.layers * (p.max_ngram * 8 + columns * 4 * 2)
            + p.layers * p.tokens * columns * 4
        )

    def kernel_group(self, case):
        # One optimized kernel for every shape (N, M, layers, tokens and the ids' strides are runtime).
        p: HashParams = case.params
        return None if p.tokens == 0 else (self.name,)

    def extra_checks(self, case, call, outputs):
        ids, multipliers, vocab, offsets = call.args
        (rows,) = outputs
        p: HashParams = case.params
        low = rearrange(offsets.to(I64), "l c -> l 1 c")
        high = low + rearrange(vocab.to(I64), "l n m -> l 1 (n m)")
        inside = bool(((rows >= low) & (rows < high)).all())
        checks = [Check("every row inside its table", PASS if inside else FAIL, "[offset, offset + vocab)", "")]
        # A few tokens by plain Python integers: 64-bit wrapped products, XOR, floored modulo.
        sample = sorted({0, p.tokens // 2, p.tokens - 1}) if p.tokens else []
        mults, sizes, starts = multipliers.tolist(), vocab.tolist(), offsets.tolist()
        mismatches = 0
        for layer in range(p.layers):
            for t in sample:
                token_ids = ids[t].tolist()
                mixed, expected = 0, []
                for i in range(p.max_ngram):
                    mixed ^= _wrap64(token_ids[i] * mults[layer][i])
                    if i:
                        for j in range(p.tables):
                            expected.append(mixed % sizes[layer][i - 1][j] + starts[layer][(i - 1) * p.tables + j])
                mismatches += rows[layer, t].tolist() != expected
        metric = f"{mismatches}/{len(sample) * p.layers} rows differ"
        checks.append(
            Check("≡ Python integer hash (sampled tokens)", PASS if mismatches == 0 else FAIL, "exact", metric)
        )
        return checks


# --- fused weight -----------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightParams:
    hidden: int
    pad: int = 0  # the gains' rows are views of wider (NaN-padded) buffers


WEIGHT_CASES = {
    "quick": [WeightParams(1), WeightParams(37), WeightParams(512, pad=8), WeightParams(7168)],
    "full": [WeightParams(d) for d in GATE_HIDDENS] + [WeightParams(7168, pad=64), WeightParams(37)],
}


def _gains(hidden: int, device, generator, spread: float, pad: int = 0) -> torch.Tensor:
    """bf16 ``[n, D]`` RMSNorm gains 1 + spread·N(0, 1)."""
    values = 1 + normal((N, hidden), generator, spread) if generator is not None else None
    return place(values, (N, hidden), BF16, device, pad)


class FusedWeight(FloatEdges, FloatOp):
    family = "engram"
    outputs = (Output("w", Bitwise(nan_equal=True), WHY_EXACT_PRODUCT),)
    edge_arguments = {"wh": (0, 1), "we": (1, 1)}
    edge_targets = ("wh", "we")

    def __init__(self):
        self.name = "fused_weight"

    def cases(self, tier):
        return [
            Case(self.name, f"{self.name}/n{N}/D{p.hidden}" + ("/strided" if p.pad else ""), p)
            for p in WEIGHT_CASES[tier]
        ]

    def build(self, case, device, generator):
        p: WeightParams = case.params
        call = Call((_gains(p.hidden, device, generator, 0.3, p.pad), _gains(p.hidden, device, generator, 0.3, p.pad)))
        return self.with_edge_values(case, call, generator)

    def expected_layout(self, case):
        return ((F32, (N, case.params.hidden)),)

    def bytes_moved(self, case):
        return N * case.params.hidden * (2 + 2 + 4)

    def kernel_group(self, case):
        # The optimized kernel is static in its vector width: what divides D and the row stride.
        p: WeightParams = case.params
        return (self.name, math.gcd(p.hidden, p.hidden + p.pad, 8))

    def extra_checks(self, case, call, outputs):
        return self.edge_invariants(case, call, outputs)

    def edge_invariants(self, case, call, outputs):
        wh, we = call.args
        (w,) = outputs
        # float64 holds the product exactly; rounded to fp32 it changes only where it overflows (±Inf).
        expected = (f64(wh) * f64(we)).to(F32)
        same = bool(((w == expected) | (torch.isnan(w) & torch.isnan(expected))).all())
        return [Check("≡ exact product (float64, rounded to fp32)", PASS if same else FAIL, "exact", "")]


# --- gate -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateParams:
    tokens: int
    hidden: int  # D
    # "fused": k and v are views of one [T, (n + 1)·D] buffer; "kvgrad" (backward only): fused, and dk,
    # dv written into one such buffer (``grad_kv``); "contiguous"
    layout: str = "fused"
    num_partials: int = 1  # backward: token blocks of dw_partial
    save_for_backward: bool = True  # forward
    clamp_value: float = CLAMP


GATE_SHAPES = {
    # (tokens, hidden, layout, num_partials, save_for_backward, clamp_value)
    "quick": [
        (0, 512, "fused", 1, True, CLAMP),
        (1, 512, "contiguous", 3, True, CLAMP),  # P > T: two empty token blocks
        (19, 768, "fused", 5, True, CLAMP),
        (5, 512, "fused", 1, False, CLAMP),
        (2, 4096, "contiguous", 2, True, CLAMP),
        (11, 512, "fused", 4, True, 0.3),
        (3, 7168, "fused", 2, True, CLAMP),  # the CTA shape of D > 4096
        (19, 768, "kvgrad", 5, True, CLAMP),
        (3, 7168, "kvgrad", 2, True, CLAMP),  # grad_kv's strided outputs in the D > 4096 CTA shape
        # The backward's bulk-copy CTA shapes of the full profile's D 1280 and 2560 (CI compiles quick).
        (3, 1280, "fused", 2, True, CLAMP),
        (5, 2560, "fused", 3, True, CLAMP),
        (4, 2560, "kvgrad", 2, True, CLAMP),
    ],
    "full": [(t, d, "fused", 132, True, CLAMP) for d in GATE_HIDDENS for t in TOKENS]
    + [
        (4001, 7168, "contiguous", 114, True, CLAMP),
        (4001, 4096, "fused", 132, False, CLAMP),
        (4001, 4096, "fused", 132, True, 0.3),
        (4001, 4096, "kvgrad", 132, True, CLAMP),
        (8192, 7168, "kvgrad", 132, True, CLAMP),
        # Narrower rows (the backward's bulk-copy kernel: up to 320 column vectors, D ≤ 2560).
        (8192, 1280, "fused", 132, True, CLAMP),
        (8192, 2560, "fused", 132, True, CLAMP),
        (4001, 2560, "kvgrad", 114, True, CLAMP),
    ],
}
GATE_BENCHMARK = GateParams(8192, 4096, "fused", 132, True)


class GateOp(FloatOp):
    family = "engram"
    backward = False

    def cases(self, tier):
        cases = []
        for t, d, layout, partials, save, clamp in GATE_SHAPES[tier]:
            if (self.backward and not save) or (not self.backward and layout == "kvgrad"):
                continue  # save_for_backward is a forward option, grad_kv a backward one
            p = GateParams(t, d, layout, partials if self.backward else 1, save, clamp)
            label = f"{self.name}/T{t}/n{N}/D{d}/{layout}" + (f"/P{partials}" if self.backward else "")
            label += ("" if save else "/nosave") + ("" if clamp == CLAMP else f"/clamp{clamp:g}")
            bench = tier == "full" and p == (GATE_BENCHMARK if self.backward else replace_partials(GATE_BENCHMARK, 1))
            title = f"{self.name}, T 8192, n 4, D 4096" if bench else ""
            cases.append(Case(self.name, label, p, benchmark=bench, title=title))
        return cases

    def kernel_group(self, case):
        # The optimized kernel is static in its CTA shape only (D, strides and save_for_backward are
        # runtime): one shape up to D = 4096, another at D = 7168; the backward's also in whether dk
        # and dv are packed or grad_kv's strided views.
        p: GateParams = case.params
        return None if p.tokens == 0 else (self.name, p.hidden > 4096, self.backward and p.layout == "kvgrad")

    def gate_inputs(self, p: GateParams, device, generator, k_scale: float):
        """x ``[T, n, D]`` contiguous; k ``[T, n, D]`` and v ``[T, D]`` (views of one fused projection
        output, or contiguous); w = fused_weight of gains 1 + 0.1·N(0, 1)."""
        T, D = p.tokens, p.hidden
        w = (
            reference.fused_weight(_gains(D, "cpu", generator, 0.1), _gains(D, "cpu", generator, 0.1))
            if generator is not None
            else None
        )
        if generator is None:
            x = torch.empty((T, N, D), dtype=BF16, device=device)
            w = torch.empty((N, D), dtype=F32, device=device)
            if p.layout != "contiguous":
                kv = torch.empty((T, (N + 1) * D), dtype=BF16, device=device)
                return x, kv[:, : N * D].view(T, N, D), kv[:, N * D :], w
            return (
                x,
                torch.empty((T, N, D), dtype=BF16, device=device),
                torch.empty((T, D), dtype=BF16, device=device),
                w,
            )
        x = normal((T, N, D), generator).to(BF16).float()
        k = normal((T, N, D), generator, k_scale).to(BF16).float()
        v = normal((T, D), generator)
        if T >= 3:
            x[1, min(2, N - 1)] = 0.0  # only eps keeps rstd_x finite; s = 0: gate ½, the clamped branch
            k[2, 0] = 0.0
        _keep_s_off_singular_points(x, k, w, p.clamp_value, k_scale, generator)
        x = x.to(BF16).to(device)
        w = w.to(device)
        if p.layout != "contiguous":
            kv = torch.cat([rearrange(k, "t m d -> t (m d)"), v], dim=1).to(BF16).to(device)
            return x, kv[:, : N * D].view(T, N, D), kv[:, N * D :], w
        return x, k.to(BF16).to(device), v.to(BF16).to(device), w


def replace_partials(p: GateParams, partials: int) -> GateParams:
    return GateParams(p.tokens, p.hidden, p.layout, partials, p.save_for_backward, p.clamp_value)


def _scores(x: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """s = Σ x·w·k / (rms(x)·rms(k)·√D) per (token, stream), in fp32 (eps 1e-20 is negligible)."""
    hidden = x.shape[-1]
    dot = reduce(x * w * k, "t m d -> t m", "sum")
    norms = torch.sqrt(reduce(x * x, "t m d -> t m", "mean") * reduce(k * k, "t m d -> t m", "mean"))
    return dot / torch.where(norms > 0, norms, torch.ones_like(norms)) * hidden**-0.5


def _keep_s_off_singular_points(x, k, w, clamp_value: float, k_scale: float, generator) -> None:
    """Redraw (in place) the k rows whose s is within S_GAP of 0 without being 0, or within
    2^-10 (relative) of the clamp value; the fp32 estimate of s is within 1e-5 of the exact one,
    so a margin of 2 keeps the exact s outside too."""
    for _ in range(100):
        s = _scores(x, k, w).abs()
        near_zero = (s > 0) & (s < 2 * S_GAP)
        near_clamp = (s - clamp_value).abs() < 2 * 2.0**-10 * clamp_value
        bad = (near_zero | near_clamp).nonzero().tolist()
        if not bad:
            return
        for t, m in bad:
            k[t, m] = normal((k.shape[-1],), generator, k_scale).to(BF16).float()
    raise RuntimeError("could not draw keys with |s| off the gate's singular points")


class GateFwd(FloatEdges, GateOp):
    edge_arguments = {"x": (0, 1), "k": (1, 1), "v": (2, 1)}  # rows: one (token, stream) or one token's v
    edge_targets = ("x", "k", "v")
    edge_base_count = 3
    outputs = (
        Output(
            "out",
            RelativeError(OUT_BOUND, atol=OUT_ATOL),
            "bf16(x + gate·v): 2^-8 rounding plus the gate's error (≤ 2^-13) times |v| ≤ 6: room 2^-10·atol, "
            "atol 2 for cancellations of x and gate·v",
        ),
        Output(
            "dot",
            RelativeError(DOT_BOUND, atol=DOT_ATOL),
            "fp32 sum over D of random-sign x·w·k (x·w exact, one rounding by k): 5·(√D_max + 2)·2^-24 of the terms' "
            "RSS (probabilistic model), RSS ≤ 2.5·atol (k scaled by 2^-⌈log2 √D⌉; the gate ignores k's scale)",
        ),
        Output(
            "gate",
            RelativeError(GATE_BOUND),
            "σ(sign(s)·√max(|s|, c)) with s's fp32 error (5·√D·2^-24 from dot, 2× rstd's): ≤ 2^-12 relative where "
            "|s| ≥ 2^-8, which the cases keep (s = 0 exactly on the zero streams); 2^-12",
        ),
        Output(
            "rstd_x",
            RelativeError(RSTD_BOUND),
            "rsqrt of a D-term positive fp32 sum: ½·D_max·2^-24 + 4 roundings (rsqrt ≤ 2 ulp)",
        ),
        Output("rstd_k", RelativeError(RSTD_BOUND), "as rstd_x"),
    )

    def __init__(self):
        self.name = "engram_gate_fwd"

    def build(self, case, device, generator):
        p: GateParams = case.params
        x, k, v, w = self.gate_inputs(p, device, generator, inverse_sqrt_pow2(p.hidden))
        return self.with_edge_values(case, Call((x, k, v, w, EPS, p.clamp_value, p.save_for_backward)), generator)

    def expected_layout(self, case):
        p: GateParams = case.params
        stats = (F32, (p.tokens, N)) if p.save_for_backward else None
        return ((BF16, (p.tokens, N, p.hidden)), stats, stats, stats, stats)

    def bytes_moved(self, case):
        p: GateParams = case.params
        T, D = p.tokens, p.hidden
        read = T * N * D * 2 * 2 + T * D * 2 + N * D * 4
        written = T * N * D * 2 + (4 * T * N * 4 if p.save_for_backward else 0)
        return read + written

    def reference_float64(self, case, call):
        x, k, v, w, eps, clamp, save = call.args
        out, dot, gate, rstd_x, rstd_k = reference.gate_forward_math(f64(x), f64(k), f64(v), f64(w), eps, clamp)
        if not save:
            empty = torch.empty(0, dtype=F64, device=x.device)
            return out, empty, empty, empty, empty
        return out, dot, gate, rstd_x, rstd_k

    def extra_checks(self, case, call, outputs):
        x, k, v, w, eps, clamp, save = call.args
        checks = []
        if save:
            # Without saved statistics the forward must produce the same out, bit for bit.
            alone = reference.engram_gate_fwd(x, k, v, w, eps, clamp, save_for_backward=False)[0]
            checks.append(compare("out ≡ out without saved statistics", alone, outputs[0], Bitwise()))
            gate = outputs[2]
            inside = bool(((gate > 0) & (gate < 1)).all())
            checks.append(Check("gate ∈ (0, 1)", PASS if inside else FAIL, "range", ""))
        if x.shape[0] >= 3:
            # The all-zero streams: s = 0 exactly, so gate is ½ exactly (sign(0) = 0).
            halves = [outputs[0][1, 2].float(), outputs[0][2, 0].float()]
            expected = [(0.5 * v[1].float()).to(BF16).float(), (x[2, 0].float() + 0.5 * v[2].float()).to(BF16).float()]
            same = all(torch.equal(a, b) for a, b in zip(halves, expected, strict=True))
            checks.append(Check("s = 0 → gate ½ (zero x, zero k)", PASS if same else FAIL, "exact", ""))
        return checks


class GateBwd(FloatEdges, GateOp):
    backward = True
    # The saved statistics stay those of the clean inputs: a backward takes whatever it is given.
    edge_arguments = {"grad": (0, 1), "x": (1, 1), "k": (2, 1), "v": (3, 1)}
    edge_targets = ("grad", "x", "k", "v")
    edge_base_count = 4
    # The contiguous layout at D 4096 and the grad_kv buffer each in one base; the rest spread.
    edge_base_preferences = ({"layout": "contiguous", "hidden": 4096}, {"layout": "kvgrad"})
    outputs = (
        Output(
            "dx",
            RelativeError(GATE_BWD_BOUND, atol=GATE_BWD_ATOL),
            "bf16(go + β·(w⊙k − dot·rstd_x²/D·x)): 2^-8 rounding + 2^-10 for β's error (5·√D·2^-24 of the typical β, "
            "from the D-term Σ go·v); atol ½ where go and β·a cancel",
        ),
        Output(
            "dk",
            RelativeError(GATE_BWD_BOUND, atol=GATE_BWD_ATOL),
            "bf16(β·(w⊙x − dot·rstd_k²/D·k)): as dx; atol ½ where the two products cancel",
        ),
        Output(
            "dv",
            RelativeError(BF16_BOUND, atol=2.0**-3),
            "Σ over n = 4 streams of gate·go (gate < 1, |go| ≤ 6) in fp32, rounded once to bf16: 2^-8 + fp32 "
            "error ≤ 2^-12·atol (atol 2^-3 for cancellations)",
        ),
        Output(
            "dw_partial",
            RelativeError(DW_BOUND, atol=DW_ATOL),
            "Σ over a token block (≤ 64 tokens) of random-sign β·x⊙k in fp32, each with β's error (5·√D·2^-24): "
            "5·(√64·2^-24 + that) of the terms' RSS; atol ½, a block's RSS scale with these inputs",
        ),
    )

    def __init__(self):
        self.name = "engram_gate_bwd"

    def build(self, case, device, generator):
        p: GateParams = case.params
        x, k, v, w = self.gate_inputs(p, device, generator, 1.0)
        shape = (p.tokens, N, p.hidden)
        if generator is None:
            grad = torch.empty(shape, dtype=BF16, device=device)
            stats = [torch.empty((p.tokens, N), dtype=F32, device=device) for _ in range(4)]
        else:
            grad = normal(shape, generator).to(BF16).to(device)
            _, *stats = reference.engram_gate_fwd(x, k, v, w, EPS, p.clamp_value)  # the saved statistics
        call_type = GradKvCall if p.layout == "kvgrad" else Call
        call = call_type((grad, x, k, v, w, *stats, p.clamp_value), {"num_partials": p.num_partials})
        return self.with_edge_values(case, call, generator)

    def expected_layout(self, case):
        p: GateParams = case.params
        T, D = p.tokens, p.hidden
        return ((BF16, (T, N, D)), (BF16, (T, N, D)), (BF16, (T, D)), (F32, (p.num_partials, N, D)))

    def bytes_moved(self, case):
        p: GateParams = case.params
        T, D = p.tokens, p.hidden
        read = T * N * D * 2 * 3 + T * D * 2 + N * D * 4 + 4 * T * N * 4
        written = T * N * D * 2 * 2 + T * D * 2 + p.num_partials * N * D * 4
        return read + written

    def kernel_group(self, case):
        # Static in its CTA shape only (as the forward's; P is runtime); with T = 0 the kernel still
        # writes the zero blocks.
        p: GateParams = case.params
        return (self.name, p.hidden > 4096)

    def reference_float64(self, case, call):
        grad, x, k, v, w, dot, gate, rstd_x, rstd_k, clamp = call.args
        return reference.gate_backward_math(
            *(f64(t) for t in (grad, x, k, v, w, dot, gate, rstd_x, rstd_k)), clamp, call.kwargs["num_partials"]
        )

    def autograd_float64(self, case, call):
        grad, x, k, v, w, _, _, _, _, clamp = call.args
        # The explicit backward from float64 statistics of the same inputs, its dw summed over blocks.
        _, *stats = reference.gate_forward_math(f64(x), f64(k), f64(v), f64(w), EPS, clamp)
        dx, dk, dv, dw_partial = reference.gate_backward_math(
            f64(grad), f64(x), f64(k), f64(v), f64(w), *stats, clamp, call.kwargs["num_partials"]
        )
        theirs = autograd_of(lambda *a: reference.gate_forward_math(*a, EPS, clamp)[0], (x, k, v, w), (grad,))
        return ("dx", "dk", "dv", "dw (Σ blocks)"), (dx, dk, dv, dw_partial.sum(0)), theirs

    def extra_checks(self, case, call, outputs):
        # Block p owns tokens [p·c, (p + 1)·c) ∩ [0, T), c = ⌈T / P⌉: blocks past the last token are zero.
        p: GateParams = case.params
        per_block = -(-p.tokens // p.num_partials) if p.tokens else 0
        first_empty = -(-p.tokens // per_block) if per_block else 0
        empty = outputs[3][first_empty:]
        ok = bool((empty == 0).all())
        metric = f"{empty.shape[0]} empty blocks"
        return [Check("blocks without tokens are zero", PASS if ok else FAIL, "exact", metric)]


class GradKvCall(Call):
    """``engram_gate_bwd(..., grad_kv=buffer)``: each run gets a fresh ``[T, (n + 1)·D]`` buffer whose
    every byte is 0xFF (bf16 NaN, so an element a twin leaves unwritten fails), the twin's dk and dv
    must be its views ``buffer[:, :n·D]`` and ``buffer[:, n·D:]`` (ValueError otherwise), and the
    outputs compared are the buffer's two parts, read back contiguous."""

    def __call__(self, fn):
        buffer = self._buffer()
        tokens, streams, hidden = self.args[1].shape
        dx, dk, dv, dw_partial = fn(*self.args, **self.kwargs, grad_kv=buffer)
        k_part, v_part = buffer[:, : streams * hidden].unflatten(1, (streams, hidden)), buffer[:, streams * hidden :]
        for name, out, part in (("dk", dk, k_part), ("dv", dv, v_part)):
            if buffer.numel() and (out.data_ptr() != part.data_ptr() or out.stride() != part.stride()):
                raise ValueError(f"{name} must be a view of grad_kv (its {name[1]} columns)")
        return dx, k_part.contiguous(), v_part.contiguous(), dw_partial

    def timed(self, fn):
        # One buffer for the timing runs: the compared runs above prove every element written.
        if "timed_buffer" not in self.context:
            self.context["timed_buffer"] = self._buffer()
        return fn(*self.args, **self.kwargs, grad_kv=self.context["timed_buffer"])

    def _buffer(self) -> torch.Tensor:
        tokens, streams, hidden = self.args[1].shape
        return unwritten_bf16((tokens, (streams + 1) * hidden), self.args[1].device)


# --- weight-gradient reduction ----------------------------------------------------------------


class AccumulatingCall(Call):
    """``grad_w_reduce(dw_partial, wh, we, grad_wh, grad_we)`` accumulates into its last two
    arguments and returns None: each run gets fresh copies of the two accumulators (so every run
    starts from the same state and the inputs stay untouched) and returns them as its outputs. A
    twin that does not update them in place therefore fails the comparison."""

    def __call__(self, fn):
        dw_partial, wh, we, grad_wh, grad_we = self.args
        grad_wh, grad_we = grad_wh.clone(), grad_we.clone()
        fn(dw_partial, wh, we, grad_wh, grad_we, **self.kwargs)
        return grad_wh, grad_we


@dataclass(frozen=True)
class ReduceParams:
    num_partials: int  # P
    hidden: int


REDUCE_CASES = {
    "quick": [ReduceParams(0, 512), ReduceParams(1, 37), ReduceParams(3, 512), ReduceParams(132, 512)],
    "full": [ReduceParams(p, d) for p in PARTIALS for d in GATE_HIDDENS]
    + [ReduceParams(0, 7168), ReduceParams(1, 4096)],
}


class GradWReduce(FloatEdges, FloatOp):
    family = "engram"
    edge_arguments = {"": (0, 1)}  # dw_partial, rows of D (the accumulators and gains are not data)
    outputs = (
        Output(
            "grad_wh",
            RelativeError(REDUCE_BOUND, atol=REDUCE_ATOL),
            "Σ over P partials, one product with the gain and one add to the accumulator, fp32: (P_max + 2)·2^-24 "
            "of Σ|terms| ≤ atol = 4 (partials scaled by 2^-⌈log2 P⌉)",
        ),
        Output("grad_we", RelativeError(REDUCE_BOUND, atol=REDUCE_ATOL), "as grad_wh"),
    )

    def __init__(self):
        self.name = "grad_w_reduce"

    def edge_base_ok(self, case: Case) -> bool:
        return case.params.num_partials > 0

    def cases(self, tier):
        return [Case(self.name, f"{self.name}/P{p.num_partials}/n{N}/D{p.hidden}", p) for p in REDUCE_CASES[tier]]

    def build(self, case, device, generator):
        p: ReduceParams = case.params
        shape = (p.num_partials, N, p.hidden)
        if generator is None:
            dw = torch.empty(shape, dtype=F32, device=device)
            accumulators = [torch.empty((N, p.hidden), dtype=F32, device=device) for _ in range(2)]
        else:
            dw = normal(shape, generator, inverse_pow2(p.num_partials)).to(device)
            accumulators = [normal((N, p.hidden), generator, 0.25).to(device) for _ in range(2)]
        wh, we = (_gains(p.hidden, device, generator, 0.3) for _ in range(2))
        return self.with_edge_values(case, AccumulatingCall((dw, wh, we, *accumulators)), generator)

    def expected_layout(self, case):
        shape = (N, case.params.hidden)
        return ((F32, shape), (F32, shape))

    def bytes_moved(self, case):
        p: ReduceParams = case.params
        return p.num_partials * N * p.hidden * 4 + N * p.hidden * (2 * 2 + 2 * 4 * 2)

    def kernel_group(self, case):
        # Static in the fp32 vector width only (P is runtime; contiguous [n, D] is read as one row of
        # n·D elements); P = 0 launches nothing.
        p: ReduceParams = case.params
        return None if p.num_partials == 0 else (self.name, math.gcd(N * p.hidden, 4))

    def reference_float64(self, case, call):
        dw, wh, we, grad_wh, grad_we = call.args
        total = reduce(f64(dw), "p m d -> m d", "sum")
        return f64(grad_wh) + total * f64(we), f64(grad_we) + total * f64(wh)

    def autograd_float64(self, case, call):
        # w = wh ⊙ we, so the gains' gradients are the chain rule of that product against G = Σ_p dw.
        dw, wh, we, grad_wh, grad_we = call.args
        total = reduce(f64(dw), "p m d -> m d", "sum")
        theirs = autograd_of(lambda a, b: a * b, (wh, we), (total,))
        expected = self.reference_float64(case, call)
        mine = (expected[0] - f64(grad_wh), expected[1] - f64(grad_we))
        return ("grad_wh increment", "grad_we increment"), mine, theirs

    def extra_checks(self, case, call, outputs):
        if case.params.num_partials:
            return []
        unchanged = all(torch.equal(a, b) for a, b in zip(outputs, call.args[3:], strict=True))
        return [Check("P = 0 adds nothing", PASS if unchanged else FAIL, "bitwise", "")]


# --- registration -----------------------------------------------------------------------------

SPECS = (EngramHash(), FusedWeight(), GateFwd(), GateBwd(), GradWReduce())
OPS = tuple(spec.name for spec in SPECS)
for _spec in SPECS:
    register(_spec)
