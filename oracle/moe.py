"""The MoE gating and routing family (contract §2) for the oracle: cases, inputs, policies, bytes, self-checks.

Twelve operators, one spec each: ``topk_gate``, ``topk_sum_and_topk_group_idx``, ``top2_sum_gate``,
``normalize_weight``, ``aux_fi``, ``group_count``, ``mask_indices_by_tp``,
``inplace_unique_group_indices``, ``get_fused_mapping``, ``expand_to_fused``,
``expand_to_fused_with_sf`` and ``reduce_fused``. There is no optimized twin yet: ``optimized()``
returns ``getattr(tileproof.optimized.moe, name)``, or None while that module (or the name in it) does
not exist, and the runner then checks the reference alone.

Cases. The ``full`` tier follows the acceptance list of the MoE issue: experts
E ∈ {16, 32, 64, 72, 96, 128, 144, 256, 384}, top-k ∈ {1, 2, 6, 8, 9}, 8 groups with 4 chosen,
EP ranks ∈ {1, 8, 64}, tokens ∈ {0, 1, 4001, 8001}, the three scoring functions, shared experts,
masks, the physical map, fixed routing. The whole cross product would be thousands of cases, so
each operator takes a *covering* subset: case ``i`` takes ``E = EXPERTS[i % 9]``,
``k = TOPKS[i % 5]``, tokens ``TOKENS[i % 4]``, EP ranks ``EP_RANKS[i % 3]`` and so on, for ``i`` up
to the longest axis, so that every value of every axis appears (pairs are mixed, not exhausted).
``i % 3`` follows from ``i % 9``, so 64 EP ranks always fall on E ∈ {64, 128, 384}, the sizes it
divides. The router (``top2_sum_gate``) has a hand-written list instead (its arguments constrain
each other), checked to cover the same axes. The ``quick`` tier runs the same configurations (or a
subset) with a handful of tokens (0, 1, 7, 33) and small hidden sizes, so that the CPU runs it in
seconds. Benchmarks (``benchmark=True``, full tier): ``topk_gate`` 16384×256 top-8,
``top2_sum_gate`` DeepSeek-V3 at 16384 tokens, ``normalize_weight`` 16384×8, and
``expand_to_fused`` / ``reduce_fused`` at 8192 tokens, hidden 7168, top-8 of 256 experts.

Inputs, generated on the CPU from the case's seed, then moved:

- *Routing indices* (``topk_idx``) as an EP rank sees them: with one rank every token has ``k``
  distinct experts in random slot order (a top-k output); with ``r`` ranks the rank owns
  ``E / r`` experts and token ``t`` has ``(t + 1) % (m + 1)`` of them (``m = min(k, E / r, 3)``)
  in random slots, the other slots ``-1`` (so some tokens have none, as masked tokens do). The count
  of valid slots is a function of the case alone, so ``bytes_moved`` is exact.
- *Expanded buffers*: the fused ops take their mapping from the reference ``get_fused_mapping``
  with ``num_expanded_tokens`` set to the bound ``floor((valid + (alignment - 1)·E_local) /
  alignment)·alignment`` (at least ``alignment``), so the number of rows ``P`` is also a function
  of the case. Padding rows of ``reduce_fused``'s input hold NaN: a kernel that reads them shows.
- *Router logits* are redrawn, row by row, until the float64 ranking scores that decide the routing
  (the kept groups' boundary and the first ``k + 1`` ranked experts) differ by at least ``1e-5``:
  far above the few-ulp error of a GPU's ``exp``/``log1p``/``sqrt``, so the top-k is unambiguous
  and the indices can be compared bitwise. A ``zeros`` case makes every score tie instead (ties
  are exact on every device). Masked tokens' logits are NaN (a masked token is not read).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from tileproof.reference import moe as reference
from tileproof.reference.contract import ceil_div

from .policy import FAIL, PASS, Bitwise, Check, RelativeError, structure_mismatch
from .registry import FLOAT_EDGE_KINDS, Call, Case, Edge, OpSpec, Output, register, write_edge_values

EXPERTS = (16, 32, 64, 72, 96, 128, 144, 256, 384)
TOPKS = (1, 2, 6, 8, 9)
EP_RANKS = (1, 8, 64)
TOKENS = {"quick": (33, 7, 1, 0), "full": (4001, 8001, 1, 0)}
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
DATA_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "e4m3": torch.float8_e4m3fn,
}
# At most this many of a token's k slots hold experts of one EP rank (beyond one rank).
MAX_LOCAL_SLOTS = 3
# The router's logits are redrawn until every deciding gap of the float64 ranking is this large.
ROUTING_GAP = 1e-5
# reduce_fused's output multiplier: FP8 cases saturate a few percent of the elements.
FP8_OUTPUT_SF = 128.0
PLAIN_OUTPUT_SF = 0.75
# Unit roundoff of each output format (half an ulp, relative) and its smallest subnormal step / 2.
ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24, "e4m3": 2.0**-4}
SUBNORMAL_HALF_STEP = {"bf16": 2.0**-134, "fp16": 2.0**-25, "fp32": 2.0**-150, "e4m3": 2.0**-10}
FP32_ULP = 2.0**-24
# Router weights: every GPU score within 2^-19 relative (16 ulps: __expf's 2 + 1.16·|x| ulps for the
# |x| <= 12 of these logits, softplus' x > 20 branch takes no exp, then the add, divide, log1p or
# sqrt), the normalising sum of k <= 9 of them another 2^-19 + 9·2^-24, the division and the
# scaling two roundings: < 2^-17.7 in all. The softmax's own row sum is a common factor of the row
# and cancels in w = s / Σ s. 2^-16 leaves a margin of 3.
ROUTER_WEIGHT_BOUND = 2.0**-16

WHY_INDICES = "integer indices: the contract fixes the order (stable descending, ties → smaller index)"
WHY_INTEGERS = "integer results of integer inputs: exactly one right answer"
WHY_MAPPING = "integer mapping: the contract fixes the layout, including the order inside a segment (ascending t·k + j)"
WHY_COPY = "rows are copied, never computed: the same bytes (padding rows zero)"


# ---------------------------------------------------------------------------------------------
# The optimized twin (absent for now) and in-place operators
# ---------------------------------------------------------------------------------------------


def optimized_twin(family: str, name: str) -> Callable | None:
    """``tileproof.optimized.<family>.<name>``, or None while the module or the name does not exist.

    ``find_spec`` looks for the module without importing TileLang, so a missing twin costs nothing;
    an existing one is imported after ``tileproof.optimized.jit``, which points TileLang's kernel
    cache at ``TILEPROOF_CACHE_DIR`` before TileLang loads.
    """
    module_name = f"tileproof.optimized.{family}"
    if importlib.util.find_spec(module_name) is None:
        return None
    importlib.import_module("tileproof.optimized.jit")
    return getattr(importlib.import_module(module_name), name, None)


def copy_keeping_layout(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same shape and strides (a row-strided view stays row-strided)."""
    if tensor.numel() == 0:
        return tensor.clone()
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    storage = tensor.as_strided((span,), (1,)).clone()
    return storage.as_strided(tensor.shape, tensor.stride())


class MoeOp(OpSpec):
    """What every spec of the family shares: the reference by name, the (absent) optimized twin."""

    family = "moe"
    name: str

    def reference(self) -> Callable:
        return getattr(reference, self.name)

    def optimized(self) -> Callable | None:
        return optimized_twin("moe", self.name)

    def compile_group(self, case: Case) -> Hashable | None:
        if self.optimized() is None:
            return None  # nothing to compile yet
        return case.label


# ---------------------------------------------------------------------------------------------
# Shared input builders and checks
# ---------------------------------------------------------------------------------------------


def _pick(values: tuple, i: int):
    return values[i % len(values)]


def _valid_slots(tokens: int, topk: int, experts: int, ep_ranks: int) -> torch.Tensor:
    """How many of each token's ``k`` slots hold an expert of this EP rank (int64 ``[T]``)."""
    if ep_ranks == 1:
        return torch.full((tokens,), topk, dtype=torch.int64)
    most = min(topk, experts // ep_ranks, MAX_LOCAL_SLOTS)
    return (torch.arange(tokens) + 1) % (most + 1)


def _total_valid(tokens: int, topk: int, experts: int, ep_ranks: int) -> int:
    return int(_valid_slots(tokens, topk, experts, ep_ranks).sum())


def _routing(tokens: int, experts: int, topk: int, ep_ranks: int, generator: torch.Generator) -> torch.Tensor:
    """``topk_idx`` int64 ``[T, k]`` as EP rank 0 of ``ep_ranks`` sees it: entries in ``[-1, E / ep_ranks)``,
    distinct in a row, in random slots (see the module docstring)."""
    local = experts // ep_ranks
    valid = _valid_slots(tokens, topk, experts, ep_ranks)
    chosen = torch.rand((tokens, local), generator=generator).argsort(dim=1)[:, :topk]
    width = chosen.shape[1]
    slots = torch.rand((tokens, topk), generator=generator).argsort(dim=1)[:, :width]
    values = torch.where(torch.arange(width) < valid[:, None], chosen, torch.full_like(chosen, -1))
    return torch.full((tokens, topk), -1, dtype=torch.int64).scatter_(1, slots, values)


def _meta(shape, dtype: torch.dtype, strides=None) -> torch.Tensor:
    if strides is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.empty_strided(shape, strides, dtype=dtype, device="meta")


def _layout_check(outputs: tuple[Output, ...], actual: tuple, expected: tuple) -> Check:
    """The reference returns the documented dtypes, shapes and strides."""
    for output, got, wanted in zip(outputs, actual, expected, strict=True):
        problem = structure_mismatch(got, wanted)
        if problem:
            return Check("reference layout", FAIL, "documented layout", "", f"{output.name}: {problem}")
    return Check("reference layout", PASS, "documented layout", "ok")


def _problems_check(name: str, policy: str, problems: list[str], metric: str = "ok") -> Check:
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return Check(name, FAIL, policy, f"{len(problems)} problems", problems[0] + more)
    return Check(name, PASS, policy, metric)


def _stable_order_problems(scores: torch.Tensor, chosen: torch.Tensor) -> list[str]:
    """``chosen`` must be the first columns of the stable descending order of each row of ``scores``
    (no NaN): distinct, descending, ties in index order, nothing left out ranking before the last."""
    problems = []
    if chosen.numel() == 0:
        return problems
    picked = scores.gather(1, chosen)
    ahead, behind = picked[:, :-1], picked[:, 1:]
    out_of_order = (ahead < behind) | ((ahead == behind) & (chosen[:, :-1] > chosen[:, 1:]))
    if out_of_order.any():
        problems.append(f"{int(out_of_order.sum())} adjacent pairs not in stable descending order")
    selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen, True)
    if int(selected.sum()) != chosen.numel():
        problems.append("an index repeats within a row")
    last_score, last_index = picked[:, -1:], chosen[:, -1:]
    index = torch.arange(scores.shape[1], device=scores.device)
    better = (scores > last_score) | ((scores == last_score) & (index < last_index))
    if (better & ~selected).any():
        problems.append("a score left out ranks before the last one chosen")
    return problems


# ---------------------------------------------------------------------------------------------
# topk_gate and topk_sum_and_topk_group_idx
# ---------------------------------------------------------------------------------------------

# A few values with many exact ties, ±0 and -inf (an ordinary value for the ranking).
TIE_VALUES = (float("-inf"), -1.0, -0.0, 0.0, 0.5, 2.0)


@dataclass(frozen=True)
class GateParams:
    tokens: int
    experts: int  # E: columns of the scores
    topk: int  # k (topk_gate) or num_topk_groups (the group op)
    groups: int = 0  # G (the group op; scores are [T, G, E/G])
    topk_sum: int = 0  # 1 or 2 (the group op)
    values: str = "randn"  # "randn" | "ties"
    padding: int = 0  # extra elements after each row (topk_gate) or group (the group op): a strided view


def _scores(
    p: GateParams, device: torch.device, generator: torch.Generator | None, edge: Edge | None = None
) -> torch.Tensor:
    """Scores ``[T, E]`` (``[T, G, E/G]`` for the group op), a strided view when the case pads; an edge
    case's values one unit per row (per group for the group op)."""
    shape = (p.tokens, p.experts) if not p.groups else (p.tokens, p.groups, p.experts // p.groups)
    wide = (*shape[:-1], shape[-1] + p.padding)
    if generator is None:
        return torch.empty(wide, dtype=torch.float32, device=device)[..., : shape[-1]]
    if p.values == "ties":
        pick = torch.randint(0, len(TIE_VALUES), wide, generator=generator)
        values = torch.tensor(TIE_VALUES, dtype=torch.float32)[pick]
    else:
        values = torch.randn(wide, generator=generator)
    if p.padding:
        values[..., shape[-1] :] = float("nan")  # read past a row's end and the ranking shows it
    if edge is not None:
        write_edge_values(values[..., : shape[-1]], edge.kind, generator)
    return values.to(device)[..., : shape[-1]]


class GateEdges:
    """The edge profile of the two ranking operators: every class in the scores, on two quick cases.
    The stable descending order ranks NaN first (``torch.sort``'s order), +Inf next, -Inf last."""

    edge_kinds = FLOAT_EDGE_KINDS

    def edge_base_ok(self, case: Case) -> bool:
        return case.params.tokens > 0 and not case.benchmark


class TopkGateOp(GateEdges, MoeOp):
    name = "topk_gate"
    outputs = (Output("topk_idx", Bitwise(), WHY_INDICES),)

    def label(self, p: GateParams) -> str:
        label = f"{self.name}/T{p.tokens}/E{p.experts}/k{p.topk}"
        if p.values != "randn":
            label += f"/{p.values}"
        if p.padding:
            label += f"/ld{p.experts + p.padding}"
        return label

    def cases(self, tier: str) -> list[Case]:
        params = []
        for i in range(2 * len(EXPERTS)):
            values = "ties" if i % 3 == 2 else "randn"
            padding = 16 if i % 4 == 1 else 0
            experts = _pick(EXPERTS, i)
            params.append(GateParams(_pick(TOKENS[tier], i), experts, _pick(TOPKS, i), values=values, padding=padding))
        # k == E (a full sort) and an odd number of experts.
        params += [GateParams(_pick(TOKENS[tier], 0), 16, 16, values="ties"), GateParams(_pick(TOKENS[tier], 1), 33, 9)]
        cases = [Case(self.name, self.label(p), p) for p in params]
        if tier == "full":
            p = GateParams(16384, 256, 8)
            cases.append(Case(self.name, self.label(p), p, benchmark=True, title="topk_gate fp32 16384×256, top-8"))
        return cases

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: GateParams = case.params
        return Call((_scores(p, device, generator, case.edge), p.topk))

    def bytes_moved(self, case: Case) -> int:
        p: GateParams = case.params
        return p.tokens * p.experts * 4 + p.tokens * p.topk * 8

    def compile_group(self, case: Case) -> Hashable | None:
        """The kernel's static configuration (experts per lane, load width, output slots per lane)."""
        p: GateParams = case.params
        if self.optimized() is None or p.tokens == 0:
            return None
        router = importlib.import_module("tileproof.optimized.moe.router")
        per_lane = router.entries_per_lane(p.experts)
        row_strides = [p.experts + p.padding] if p.tokens > 1 else []
        return (self.name, per_lane, router.load_width(per_lane, p.experts, row_strides), ceil_div(p.topk, 32))

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: GateParams = case.params
        layout = _layout_check(self.outputs, outputs, (_meta((p.tokens, p.topk), torch.int64),))
        problems = _stable_order_problems(call.args[0], outputs[0])
        return [layout, _problems_check("stable top-k", "descending, ties → smaller index", problems)]


class GroupTopkOp(GateEdges, MoeOp):
    name = "topk_sum_and_topk_group_idx"
    outputs = (Output("group_idx", Bitwise(), WHY_INDICES + "; a sum of two fp32 values is the same in any order"),)

    def label(self, p: GateParams) -> str:
        label = f"{self.name}/T{p.tokens}/E{p.experts}/g{p.groups}c{p.topk}/sum{p.topk_sum}"
        if p.values != "randn":
            label += f"/{p.values}"
        if p.padding:
            label += f"/pad{p.padding}"
        return label

    def cases(self, tier: str) -> list[Case]:
        params = []
        for i, experts in enumerate(EXPERTS):
            values = "ties" if i % 3 == 2 else "randn"
            padding = 4 if i % 4 == 1 else 0
            params.append(GateParams(_pick(TOKENS[tier], i), experts, 4, 8, 1 + i % 2, values, padding))
        tokens = TOKENS[tier]
        # All groups kept, a single group kept, 16 groups.
        params += [
            GateParams(tokens[0], 256, 8, 8, 2),
            GateParams(tokens[1], 64, 1, 4, 2, "ties"),
            GateParams(tokens[0], 384, 6, 16, 1),
        ]
        return [Case(self.name, self.label(p), p) for p in params]

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: GateParams = case.params
        return Call((_scores(p, device, generator, case.edge), p.topk_sum, p.topk))

    def bytes_moved(self, case: Case) -> int:
        p: GateParams = case.params
        return p.tokens * p.experts * 4 + p.tokens * p.topk * 8

    def compile_group(self, case: Case) -> Hashable | None:
        """The kernel's static configuration (groups per lane, output slots per lane)."""
        p: GateParams = case.params
        if self.optimized() is None or p.tokens == 0:
            return None
        router = importlib.import_module("tileproof.optimized.moe.router")
        return (self.name, router.entries_per_lane(p.groups), ceil_div(p.topk, 32))

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: GateParams = case.params
        scores, num_topk_sum, _ = call.args
        layout = _layout_check(self.outputs, outputs, (_meta((p.tokens, p.topk), torch.int64),))
        best = scores.topk(num_topk_sum, dim=-1).values  # the largest, then the second largest
        group_scores = best[..., 0] if num_topk_sum == 1 else best[..., 0] + best[..., 1]
        problems = _stable_order_problems(group_scores, outputs[0])
        return [layout, _problems_check("stable group top-k", "of top-1/top-2 group sums", problems)]


# ---------------------------------------------------------------------------------------------
# top2_sum_gate
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterParams:
    tokens: int
    experts: int  # R routed experts
    topk: int
    groups: int = 0  # num_groups (0: no group limiting)
    topk_groups: int = 0
    scoring: str = "sigmoid"
    shared: int = 0  # S: > 0 sets use_shared_as_routed
    extra: int = 0  # num_extra_experts: > 0 passes a physical map (logical → physical) with that many
    ep_ranks: int = 1
    tp_ranks: int = 1
    mask: bool = False
    fixed: bool = False  # fix_routing_mask (about half the tokens replay the indices in the buffer)
    unmapped: bool = False  # pass an unmapped_topk_idx buffer
    unmapped_ld: int = 0  # its row stride when > k (a view of a wider buffer)
    special: str = ""  # "zeros": all logits and biases zero, every score ties
    factor: float = 2.5  # routed_scaling_factor (DeepSeek-V3's)

    @property
    def ep_rank(self) -> int:
        return (self.ep_ranks - 1) // 2

    @property
    def tp_rank(self) -> int:
        return self.tp_ranks - 1

    @property
    def slots(self) -> int:
        return self.topk + self.shared

    def router_args(self) -> tuple:
        """The 11 positional arguments after ``logits, bias``."""
        return (
            self.topk,
            self.topk_groups,
            self.groups,
            self.shared > 0,
            self.shared,
            self.factor,
            self.ep_rank,
            self.ep_ranks,
            self.tp_rank,
            self.tp_ranks,
            self.scoring,
        )


# (R, k, groups, chosen, scoring, S, extra, EP, TP, mask, fixed, unmapped, unmapped row stride, special)
ROUTER_CONFIGS = [
    (256, 8, 8, 4, "sigmoid", 0, 0, 1, 1, False, False, False, 0, ""),  # DeepSeek-V3
    (256, 8, 8, 4, "sigmoid", 1, 8, 8, 2, True, False, True, 0, ""),
    (384, 6, 0, 0, "sqrtsoftplus", 2, 64, 64, 2, True, True, True, 9, ""),
    (72, 6, 0, 0, "softmax", 0, 0, 8, 1, False, False, True, 0, ""),
    (16, 1, 0, 0, "sigmoid", 1, 8, 8, 1, True, False, False, 0, ""),
    (32, 2, 8, 4, "sqrtsoftplus", 2, 2, 1, 1, False, True, True, 5, ""),
    (64, 9, 8, 4, "softmax", 0, 0, 64, 4, True, False, False, 0, ""),
    (96, 8, 8, 4, "sigmoid", 2, 32, 8, 2, False, False, True, 0, ""),
    (128, 8, 8, 4, "sqrtsoftplus", 1, 64, 64, 1, True, True, True, 0, ""),
    (144, 9, 8, 4, "softmax", 1, 8, 8, 2, True, False, False, 0, ""),
    (256, 2, 8, 4, "sigmoid", 0, 0, 64, 8, False, False, False, 0, ""),
    (384, 1, 0, 0, "softmax", 0, 0, 8, 1, True, True, True, 0, ""),
    (256, 8, 8, 8, "sqrtsoftplus", 0, 0, 1, 1, False, False, False, 0, ""),  # every group kept
    (256, 8, 8, 4, "sigmoid", 0, 0, 1, 1, False, False, False, 0, "zeros"),
    (72, 6, 0, 0, "softmax", 1, 4, 4, 2, True, False, True, 0, "zeros"),
]


def _router_params(tier: str) -> list[RouterParams]:
    params = []
    for i, config in enumerate(ROUTER_CONFIGS):
        experts, k, groups, chosen, scoring, shared, extra, ep, tp, mask, fixed, unmapped, ld, special = config
        tokens = _pick(TOKENS[tier], i)
        params.append(
            RouterParams(
                tokens, experts, k, groups, chosen, scoring, shared, extra, ep, tp, mask, fixed, unmapped, ld, special
            )
        )
    return params


def _scores64(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The routing scores in float64 (the same formulas as the reference)."""
    if scoring == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-logits))
    if scoring == "sqrtsoftplus":
        return torch.sqrt(torch.where(logits > 20.0, logits, torch.log1p(torch.exp(logits))))
    shifted = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    return shifted / shifted.sum(dim=-1, keepdim=True)


def _ideal_routing(logits: torch.Tensor, bias: torch.Tensor, p: RouterParams) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64: each row's top-k experts, and the smallest gap that decides them (the kept groups'
    boundary, and between consecutive ones of the first k + 1 ranked experts)."""
    logits64, bias64 = logits.double(), bias.double()
    ranking = (logits64 if p.scoring == "softmax" else _scores64(logits64, p.scoring)) + bias64
    num_tokens = ranking.shape[0]
    margin = torch.full((num_tokens,), float("inf"), dtype=torch.float64, device=ranking.device)
    if p.groups != p.topk_groups:
        grouped = ranking.reshape(num_tokens, p.groups, p.experts // p.groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        ordered, order = group_scores.sort(dim=1, descending=True)
        margin = torch.minimum(margin, ordered[:, p.topk_groups - 1] - ordered[:, p.topk_groups])
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, order[:, : p.topk_groups], True)
        ranking = ranking.masked_fill(~keep.repeat_interleave(p.experts // p.groups, dim=1), float("-inf"))
    ordered, order = ranking.sort(dim=1, descending=True)
    first = ordered[:, : p.topk + 1]
    if first.shape[1] > 1:
        margin = torch.minimum(margin, (first[:, :-1] - first[:, 1:]).amin(dim=1))
    return order[:, : p.topk], margin


def _draw_logits(rows: int, p: RouterParams, generator: torch.Generator) -> torch.Tensor:
    logits = torch.randn((rows, p.experts), generator=generator)
    if p.scoring == "sqrtsoftplus":
        # About 1% of the logits above 20, where softplus(x) = x (the other branch of the formula).
        hot = torch.rand((rows, p.experts), generator=generator) < 0.01
        logits = torch.where(hot, 20.0 + 5.0 * torch.rand((rows, p.experts), generator=generator), logits)
    return logits


def _physical_map(p: RouterParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An EPLB-like placement: the R + S logical experts on a random permutation of the R + extra
    physical slots; the remaining extra - S slots hold second (third, ...) replicas of random routed
    experts. Unused columns are -1 (never read: the replica is below logical_count)."""
    num_logical = p.experts + p.shared
    slots = torch.randperm(p.experts + p.extra, generator=generator)
    to_physical = torch.full((num_logical, p.extra + 1), -1, dtype=torch.int32)
    count = torch.ones(num_logical, dtype=torch.int32)
    to_physical[:, 0] = slots[:num_logical].to(torch.int32)
    for slot in slots[num_logical:].tolist():
        expert = int(torch.randint(0, p.experts, (1,), generator=generator))
        to_physical[expert, int(count[expert])] = slot
        count[expert] += 1
    return to_physical, count


# The router's edge classes: finite ones only (the contract refuses NaN and ±Inf in a routed token's
# logits: ValueError, the kernel device-asserts). Zeros and subnormals fill blocks of 8 experts
# (their scores tie exactly: sigmoid 0.5, the ranking is decided by the bias); a max or an outlier
# is one logit per token, so that no two of them tie in fp32 where float64 would rank them.
ROUTER_EDGE_KINDS = ("zero", "max", "subnormal", "outlier")
SCORINGS = ("sigmoid", "sqrtsoftplus", "softmax")
ROUTER_EDGE_BLOCK = 8


def _write_router_edge_values(logits: torch.Tensor, edge: Edge | None, generator: torch.Generator) -> torch.Tensor:
    """An edge case's values written into the fp32 logits (CPU, in place); where they are, as a mask."""
    before = logits.clone()
    if edge is not None:
        spread = edge.kind in ("zero", "subnormal")
        block = (1, ROUTER_EDGE_BLOCK) if spread else None
        write_edge_values(logits, edge.kind, generator, block=block)
    return before.view(torch.int32) != logits.view(torch.int32)


def _router_with_buffer(fn: Callable) -> Callable:
    """``fn`` (either twin) called on a copy of ``unmapped_topk_idx`` (same strides), which becomes the
    third output; the case's own buffer stays untouched. Without a buffer the third output is an
    empty int64 tensor."""

    def call(logits, bias, *args, **kwargs):
        buffer = kwargs.get("unmapped_topk_idx")
        if buffer is None:
            topk_idx, topk_weights = fn(logits, bias, *args, **kwargs)
            return topk_idx, topk_weights, torch.empty(0, dtype=torch.int64, device=logits.device)
        copy = copy_keeping_layout(buffer)
        topk_idx, topk_weights = fn(logits, bias, *args, **{**kwargs, "unmapped_topk_idx": copy})
        return topk_idx, topk_weights, copy

    return call


class Top2SumGateOp(MoeOp):
    name = "top2_sum_gate"
    outputs = (
        Output(
            "topk_idx",
            Bitwise(),
            "integer indices; the inputs keep every deciding gap of the ranking above 1e-5 (or make the "
            "scores tie exactly), so the GPU's few-ulp transcendental error cannot change the choice",
        ),
        Output(
            "topk_weights",
            RelativeError(ROUTER_WEIGHT_BOUND),
            "s / (1e-20 + Σ s) · factor: each GPU score within 32 fp32 ulps (exp, log1p, sqrt are not "
            "correctly rounded), the sum of k ≤ 9 and two more roundings stay below 2^-17.4; bound 2^-16",
        ),
        Output("unmapped_topk_idx", Bitwise(), "integer indices written in place (a copy of the case's buffer)"),
    )

    edge_kinds = ROUTER_EDGE_KINDS

    def edge_base_ok(self, case: Case) -> bool:
        p: RouterParams = case.params
        return p.tokens > 0 and not p.special and not case.benchmark

    def edge_bases(self, quick: list[Case]) -> list[Case]:
        """One quick case per scoring function: each saturates its own way (sigmoid at 0 and 1,
        softplus on its linear branch, softmax through its shift by the row maximum)."""
        usable = [case for case in quick if self.edge_base_ok(case)]
        return [
            max((case for case in usable if case.params.scoring == scoring), key=lambda case: case.params.tokens)
            for scoring in SCORINGS
        ]

    def label(self, p: RouterParams) -> str:
        parts = [self.name, p.scoring, f"R{p.experts}", f"k{p.topk}"]
        if p.groups:
            parts.append(f"g{p.groups}c{p.topk_groups}")
        if p.shared:
            parts.append(f"S{p.shared}")
        if p.extra:
            parts.append(f"map{p.extra}")
        parts.append(f"ep{p.ep_ranks}tp{p.tp_ranks}")
        parts += [flag for flag, on in (("mask", p.mask), ("fixed", p.fixed), ("unmapped", p.unmapped)) if on]
        if p.unmapped_ld:
            parts.append(f"ld{p.unmapped_ld}")
        if p.special:
            parts.append(p.special)
        parts.append(f"T{p.tokens}")
        return "/".join(parts)

    def cases(self, tier: str) -> list[Case]:
        cases = [Case(self.name, self.label(p), p) for p in _router_params(tier)]
        if tier == "full":
            p = RouterParams(16384, 256, 8, 8, 4)
            title = "top2_sum_gate DeepSeek-V3: 256 experts, 8 groups / 4, top-8, sigmoid + bias, 16384 tokens"
            cases.append(Case(self.name, self.label(p), p, benchmark=True, title=title))
        return cases

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: RouterParams = case.params
        T, R, k = p.tokens, p.experts, p.topk
        kwargs: dict = {}
        ld = p.unmapped_ld or k
        if generator is None:
            logits = torch.empty((T, R), dtype=torch.float32, device=device)
            bias = torch.empty(R, dtype=torch.float32, device=device)
            if p.mask:
                kwargs["mask"] = torch.empty(T, dtype=torch.bool, device=device)
            if p.fixed:
                kwargs["fix_routing_mask"] = torch.empty(T, dtype=torch.bool, device=device)
            if p.extra:
                kwargs["to_physical_map"] = torch.empty((R + p.shared, p.extra + 1), dtype=torch.int32, device=device)
                kwargs["logical_count"] = torch.empty(R + p.shared, dtype=torch.int32, device=device)
            if p.unmapped:
                kwargs["unmapped_topk_idx"] = torch.empty((T, ld), dtype=torch.int64, device=device)[:, :k]
            return Call((logits, bias, *p.router_args()), kwargs)

        if p.special == "zeros":
            logits, bias = torch.zeros((T, R)), torch.zeros(R)
        else:
            bias = torch.randn(R, generator=generator) * 0.1
            logits = _draw_logits(T, p, generator)
            # Edge values stay where they are written; the redraws change the other logits only.
            edge_values = _write_router_edge_values(logits, case.edge, generator)
            for _ in range(100):
                _, margin = _ideal_routing(logits, bias, p)
                redraw = margin < ROUTING_GAP
                if not redraw.any():
                    break
                fresh = _draw_logits(int(redraw.sum()), p, generator)
                logits[redraw] = torch.where(edge_values[redraw], logits[redraw], fresh)
            else:
                raise RuntimeError(f"{case.label}: could not draw logits with routing gaps >= {ROUTING_GAP}")
        if p.mask:
            mask = torch.rand(T, generator=generator) < 0.8
            mask[:1] = True
            if T > 1:
                mask[-1] = False
            logits[~mask] = float("nan")  # a masked token is not read
            kwargs["mask"] = mask.to(device)
        if p.fixed:
            kwargs["fix_routing_mask"] = (torch.rand(T, generator=generator) < 0.5).to(device)
        if p.extra:
            to_physical, count = _physical_map(p, generator)
            kwargs["to_physical_map"], kwargs["logical_count"] = to_physical.to(device), count.to(device)
        if p.unmapped:
            wide = torch.randint(0, R, (T, ld), generator=generator, dtype=torch.int64)
            kwargs["unmapped_topk_idx"] = wide.to(device)[:, :k]
        return Call((logits.to(device), bias.to(device), *p.router_args()), kwargs)

    def reference(self) -> Callable:
        return _router_with_buffer(reference.top2_sum_gate)

    def optimized(self) -> Callable | None:
        twin = optimized_twin("moe", self.name)
        return None if twin is None else _router_with_buffer(twin)

    def compile_group(self, case: Case) -> Hashable | None:
        """The kernel's static configuration (experts per lane, load width, scoring, group size,
        output slots per lane); the optional inputs are runtime switches of one kernel."""
        p: RouterParams = case.params
        if self.optimized() is None or p.tokens == 0:
            return None
        router = importlib.import_module("tileproof.optimized.moe.router")
        group_size = p.experts // p.groups if p.groups != p.topk_groups else 0
        per_lane = router.router_per_lane(p.experts, group_size)
        vector = router.load_width(per_lane, p.experts, [p.experts])
        return (self.name, per_lane, vector, p.scoring, group_size, ceil_div(p.slots, 32))

    def bytes_moved(self, case: Case) -> int:
        p: RouterParams = case.params
        T, R, k = p.tokens, p.experts, p.topk
        total = T * R * 4 + R * 4 + T * p.slots * (8 + 4)
        total += T * int(p.mask) + T * int(p.fixed)
        if p.unmapped:
            total += T * k * 8 * (1 + int(p.fixed))  # written; read too with fixed routing
        if p.extra:
            total += (R + p.shared) * (p.extra + 1) * 4 + (R + p.shared) * 4
        return total

    def _logical_choice(self, call: Call, outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The reference's logical routed experts [T, k] (its unmapped output, or a second run with a buffer)."""
        if call.kwargs.get("unmapped_topk_idx") is not None:
            return outputs[2]
        logits = call.args[0]
        buffer = torch.zeros((logits.shape[0], call.args[2]), dtype=torch.int64, device=logits.device)
        reference.top2_sum_gate(*call.args, **{**call.kwargs, "unmapped_topk_idx": buffer})
        return buffer

    def reference_float64(self, case: Case, call: Call) -> tuple[torch.Tensor | None, ...]:
        """The weights recomputed in float64 from the reference's logical choice (indices: None)."""
        p: RouterParams = case.params
        outputs = self.reference()(*call.args, **call.kwargs)
        logical = self._logical_choice(call, outputs)
        logits = call.args[0].double()
        routed = call.kwargs.get("mask")
        if routed is None:
            routed = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        scores = _scores64(logits, p.scoring).gather(1, logical.clamp(min=0))
        factor = float(torch.tensor(p.factor, dtype=torch.float32))
        weights = scores / (1e-20 + scores.sum(dim=1, keepdim=True)) * factor
        shared = torch.ones((logits.shape[0], p.shared), dtype=torch.float64, device=logits.device)
        weights = torch.cat([weights, shared], dim=1).masked_fill(~routed[:, None], 0.0)
        return None, weights, None

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: RouterParams = case.params
        T, k = p.tokens, p.topk
        buffer = call.kwargs.get("unmapped_topk_idx")
        unmapped = _meta((T, k), torch.int64, buffer.stride()) if buffer is not None else _meta((0,), torch.int64)
        expected = (_meta((T, p.slots), torch.int64), _meta((T, p.slots), torch.float32), unmapped)
        checks = [_layout_check(self.outputs, outputs, expected)]

        topk_idx, topk_weights, _ = outputs
        logits, bias = call.args[0], call.args[1]
        device = logits.device
        routed = call.kwargs.get("mask")
        if routed is None:
            routed = torch.ones(T, dtype=torch.bool, device=device)
        fixed = call.kwargs.get("fix_routing_mask")
        fixed = torch.zeros(T, dtype=torch.bool, device=device) if fixed is None else fixed & routed
        logical = self._logical_choice(call, outputs)
        problems = []
        # The logical choice: the caller's for fixed tokens, the float64 top-k for the others.
        if buffer is not None and not torch.equal(logical[fixed], buffer[fixed]):
            problems.append("a fixed token's unmapped_topk_idx row changed")
        if p.special == "zeros":
            # Every score ties: groups 0, 1, ... are kept and experts 0 .. k-1 win, in index order.
            ideal = torch.arange(k, device=device).expand(T, k)
        else:
            ideal, _ = _ideal_routing(logits.nan_to_num(), bias, p)
        chosen = routed & ~fixed
        if not torch.equal(logical[chosen], ideal[chosen]):
            problems.append("the top-k differs from the float64 top-k of the ranking scores")
        if (logical[~routed] != -1).any():
            problems.append("a masked token's unmapped row is not -1")
        # The physical map and the TP re-indexing, written out (TileKernels' formula).
        all_logical = torch.cat(
            [logical, torch.arange(p.experts, p.experts + p.shared, device=device).expand(T, -1)], 1
        )
        physical = all_logical.clamp(min=0)
        if p.extra:
            to_physical, count = call.kwargs["to_physical_map"].long(), call.kwargs["logical_count"].long()
            token = torch.arange(T, device=device)[:, None]
            physical = to_physical[physical, (p.ep_rank + token * 23333) % count[physical]]
        per_rank = (p.experts + p.extra) // p.ep_ranks
        on_rank = (physical // per_rank) % p.tp_ranks == p.tp_rank
        local = physical - p.tp_rank * per_rank
        local = local - (local // (per_rank * p.tp_ranks)) * (per_rank * (p.tp_ranks - 1))
        expected_idx = torch.where(on_rank & routed[:, None], local, torch.full_like(local, -1))
        if not torch.equal(topk_idx, expected_idx):
            problems.append("topk_idx is not the TP-masked physical replica of the logical choice")
        # Weights: the routed ones sum to the scaling factor, shared ones are 1, masked tokens 0.
        factor = float(torch.tensor(p.factor, dtype=torch.float32))
        sums = topk_weights[:, :k].double().sum(dim=1)[routed]
        if ((sums - factor).abs() > (k + 3) * FP32_ULP * factor).any():
            problems.append("the routed weights of a token do not sum to routed_scaling_factor")
        if (topk_weights[routed][:, k:] != 1.0).any():
            problems.append("a shared expert's weight is not 1")
        if (topk_weights[~routed] != 0).any() or (topk_weights < 0).any():
            problems.append("a masked token's weight is not 0, or a weight is negative")
        checks.append(_problems_check("routing invariants", "float64 top-k, map, TP, weights", problems))
        return checks


# ---------------------------------------------------------------------------------------------
# normalize_weight
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightParams:
    tokens: int
    topk: int


class NormalizeWeightOp(MoeOp):
    name = "normalize_weight"
    why = (
        "a fixed sequence of IEEE fp32 operations (sum left to right from fp32(1e-20), then one correctly "
        "rounded division per weight): exactly one right answer; a NaN (from a NaN or Inf weight) matches any NaN"
    )
    outputs = (Output("den", Bitwise(nan_equal=True), why), Output("normalized", Bitwise(nan_equal=True), why))

    def label(self, p: WeightParams) -> str:
        return f"{self.name}/T{p.tokens}/k{p.topk}"

    def cases(self, tier: str) -> list[Case]:
        params = [WeightParams(_pick(TOKENS[tier], i), k) for i, k in enumerate(TOPKS)]
        params.append(WeightParams(_pick(TOKENS[tier], 0), 8))
        cases = []
        for p in params:
            if all(c.params != p for c in cases):
                cases.append(Case(self.name, self.label(p), p))
        if tier == "full":
            p = WeightParams(16384, 8)
            cases.append(Case(self.name, self.label(p), p, benchmark=True, title="normalize_weight 16384×8"))
        return cases

    edge_kinds = FLOAT_EDGE_KINDS

    def edge_base_ok(self, case: Case) -> bool:
        return case.params.tokens > 0 and not case.benchmark

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: WeightParams = case.params
        if generator is None:
            return Call((torch.empty((p.tokens, p.topk), dtype=torch.float32, device=device),))
        # Routing scores in (0, 1], a row of zeros, a row of tiny values and a row with one weight.
        weights = torch.rand((p.tokens, p.topk), generator=generator)
        if p.tokens >= 4:
            weights[1] = 0.0
            weights[2] *= 1e-30
            weights[3, 1:] = 0.0
        if case.edge is not None:
            write_edge_values(weights, case.edge.kind, generator)
        return Call((weights.to(device),))

    def compile_group(self, case: Case) -> Hashable | None:
        """The kernel is static in k alone (layouts are a runtime switch); no tokens, no launch."""
        p: WeightParams = case.params
        if self.optimized() is None or p.tokens == 0:
            return None
        return (self.name, p.topk)

    def bytes_moved(self, case: Case) -> int:
        p: WeightParams = case.params
        return 2 * p.tokens * p.topk * 4 + p.tokens * 4

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: WeightParams = case.params
        shape = (p.tokens, p.topk)
        checks = [
            _layout_check(self.outputs, outputs, (_meta((p.tokens,), torch.float32), _meta(shape, torch.float32)))
        ]
        weights = call.args[0].double()
        den, normalized = (o.double() for o in outputs)
        if case.edge is not None:
            # The invariants of routing weights (finite, non-negative), on the rows that still are and
            # whose sum is finite in fp32 (the others: docs/numerics.md, tests/test_reference_edge.py).
            kept = torch.isfinite(weights).all(dim=1) & (weights >= 0).all(dim=1) & torch.isfinite(den)
            weights, den, normalized = weights[kept], den[kept], normalized[kept]
        exact = 1e-20 + weights.sum(dim=1)
        problems = []
        if ((den - exact).abs() > (p.topk + 1) * FP32_ULP * exact).any():
            problems.append("den is not 1e-20 + Σ w within k + 1 roundings")
        total = normalized.sum(dim=1)
        significant = weights.sum(dim=1) > 1e-10
        if ((total - 1).abs()[significant] > (2 * p.topk + 2) * FP32_ULP).any():
            problems.append("a row's normalized weights do not sum to 1")
        if (normalized < 0).any() or not torch.isfinite(normalized).all():
            problems.append("a normalized weight is negative or not finite")
        checks.append(_problems_check("weights sum to 1", "float64 sums", problems))
        return checks


# ---------------------------------------------------------------------------------------------
# aux_fi, group_count, mask_indices_by_tp, inplace_unique_group_indices
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexParams:
    tokens: int
    experts: int  # E (aux_fi: of this EP rank's view, E / ep_ranks local experts; mask_indices_by_tp: n)
    topk: int
    ep_ranks: int = 1
    dtype: str = "int64"
    groups: int = 0  # group_count, inplace_unique_group_indices: G groups of E/G experts
    aux_topk: int = 0  # aux_fi's num_aux_topk
    tp_ranks: int = 1  # mask_indices_by_tp
    tp_rank: int = 0

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep_ranks


def _index_params(tier: str, op: str) -> list[IndexParams]:
    params = []
    for i, experts in enumerate(EXPERTS):
        tokens, k, ep, dtype = _pick(TOKENS[tier], i), _pick(TOPKS, i), _pick(EP_RANKS, i), ("int64", "int32")[i % 2]
        if op == "aux_fi":
            params.append(IndexParams(tokens, experts, k, ep, dtype, aux_topk=(k, 1)[i % 2]))
        elif op == "mask_indices_by_tp":
            tp = (1, 2, 4, 8)[i % 4]
            params.append(IndexParams(tokens, experts, k, ep, dtype, tp_ranks=tp, tp_rank=(tp - 1) - i % tp // 2))
        else:  # group_count, inplace_unique_group_indices: 8 groups of all experts
            params.append(IndexParams(tokens, experts, k, 1, dtype, groups=8))
    tokens = TOKENS[tier]
    if op == "group_count":
        params.append(IndexParams(tokens[0], 384, 8, groups=384))  # one group per expert
    if op == "inplace_unique_group_indices":
        params.append(IndexParams(tokens[1], 256, 9, groups=2, dtype="int32"))  # mostly repeats
    return params


def _index_label(name: str, p: IndexParams) -> str:
    label = f"{name}/T{p.tokens}/E{p.experts}/k{p.topk}"
    if p.ep_ranks > 1:
        label += f"/ep{p.ep_ranks}"
    if p.groups:
        label += f"/g{p.groups}"
    if p.aux_topk:
        label += f"/aux{p.aux_topk}"
    if p.tp_ranks > 1 or name == "mask_indices_by_tp":
        label += f"/tp{p.tp_rank}of{p.tp_ranks}"
    return label + f"/{p.dtype}"


def _masked_rows(idx: torch.Tensor) -> torch.Tensor:
    """Every fifth token is a masked one: a row of -1."""
    idx[4::5] = -1
    return idx


class IndexOp(MoeOp):
    """The four integer operators on routing indices (``name`` picks which)."""

    def __init__(self, name: str):
        self.name = name
        self.outputs = {
            "aux_fi": (
                Output(
                    "f",
                    Bitwise(),
                    "exact integer counts, then one int→fp32 conversion of each exact product and one "
                    "correctly rounded division: exactly one right answer",
                ),
            ),
            "group_count": (Output("count", Bitwise(), WHY_INTEGERS),),
            "mask_indices_by_tp": (Output("indices", Bitwise(), WHY_INTEGERS),),
            "inplace_unique_group_indices": (Output("group_indices", Bitwise(), WHY_INTEGERS + " (written in place)"),),
        }[name]

    def cases(self, tier: str) -> list[Case]:
        return [Case(self.name, _index_label(self.name, p), p) for p in _index_params(tier, self.name)]

    def _indices(self, p: IndexParams, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
        dtype = INDEX_DTYPES[p.dtype]
        if generator is None:
            return torch.empty((p.tokens, p.topk), dtype=dtype, device=device)
        if self.name == "aux_fi":
            idx = _routing(p.tokens, p.experts, p.topk, p.ep_ranks, generator)
        else:
            idx = _masked_rows(_routing(p.tokens, p.experts, p.topk, 1, generator))
            if p.groups:
                idx = torch.div(idx, p.experts // p.groups, rounding_mode="floor")  # -1 stays -1
        return idx.to(dtype).to(device)

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: IndexParams = case.params
        idx = self._indices(p, device, generator)
        if self.name == "aux_fi":
            return Call((idx, p.local_experts, p.aux_topk))
        if self.name == "mask_indices_by_tp":
            return Call((idx, p.experts, p.ep_ranks, p.tp_rank, p.tp_ranks))
        return Call((idx, p.groups))

    def reference(self) -> Callable:
        fn = getattr(reference, self.name)
        return _on_a_copy(fn) if self.name == "inplace_unique_group_indices" else fn

    def optimized(self) -> Callable | None:
        twin = optimized_twin("moe", self.name)
        if twin is None or self.name != "inplace_unique_group_indices":
            return twin
        return _on_a_copy(twin)

    def compile_group(self, case: Case) -> Hashable | None:
        """The kernels are static in the index dtype alone. aux_fi and group_count launch for T = 0
        too (their per-expert results are written by a kernel); the other two have nothing to do."""
        p: IndexParams = case.params
        if self.optimized() is None:
            return None
        if p.tokens == 0 and self.name in ("mask_indices_by_tp", "inplace_unique_group_indices"):
            return None
        return (self.name, p.dtype)

    def bytes_moved(self, case: Case) -> int:
        p: IndexParams = case.params
        idx_bytes = p.tokens * p.topk * INDEX_DTYPES[p.dtype].itemsize
        return {
            "aux_fi": idx_bytes + p.local_experts * 4,
            "group_count": idx_bytes + p.groups * 4,
            "mask_indices_by_tp": 2 * idx_bytes,
            "inplace_unique_group_indices": 2 * idx_bytes,
        }[self.name]

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: IndexParams = case.params
        idx = call.args[0]
        dtype = INDEX_DTYPES[p.dtype]
        expected = {
            "aux_fi": _meta((p.local_experts,), torch.float32),
            "group_count": _meta((p.groups,), torch.int32),
            "mask_indices_by_tp": _meta((p.tokens, p.topk), dtype),
            "inplace_unique_group_indices": _meta((p.tokens, p.topk), dtype),
        }[self.name]
        checks = [_layout_check(self.outputs, outputs, (expected,))]
        out = outputs[0]
        valid = int((idx >= 0).sum())
        problems = []
        if self.name == "aux_fi":
            # Σ_e f_e · T · num_aux_topk / E counts every valid slot once.
            # Each f_e is within one rounding (2^-24 relative) of count_e · E / (T · aux_topk).
            counted = float(out.double().sum()) * p.tokens * p.aux_topk / p.local_experts if p.tokens else 0.0
            if abs(counted - valid) > 2 * FP32_ULP * max(valid, 1):
                problems.append(f"Σ f_e · T · aux_topk / E = {counted:.6g}, expected {valid} valid slots")
        elif self.name == "group_count":
            if int(out.long().sum()) != valid or (out < 0).any():
                problems.append(f"the counts sum to {int(out.long().sum())}, expected {valid} valid slots")
        elif self.name == "mask_indices_by_tp":
            per_rank = p.experts // p.ep_ranks
            kept = (idx >= 0) & ((idx // per_rank) % p.tp_ranks == p.tp_rank)
            if not torch.equal(out >= 0, kept):
                problems.append("an entry is kept that is not on this TP rank, or the reverse")
            if (out >= ceil_div(p.ep_ranks, p.tp_ranks) * per_rank).any():
                problems.append("a kept entry lies beyond this TP rank's local numbering")
            if not torch.equal(out[kept] % per_rank, idx[kept] % per_rank):
                problems.append("a kept entry changed its offset within its rank")
        else:
            repeat_of_earlier = (idx[:, :, None] == idx[:, None, :]).tril(diagonal=-1).any(dim=2) & (idx >= 0)
            if not torch.equal(out, idx.masked_fill(repeat_of_earlier, -1)):
                problems.append("not exactly the repeats after a first occurrence became -1")
            survivors = out.masked_fill(out < 0, -1)
            same = (survivors[:, :, None] == survivors[:, None, :]) & (survivors[:, :, None] >= 0)
            if (same.sum(dim=2) > 1).any():
                problems.append("a group index still repeats within a row")
        checks.append(_problems_check("reference invariants", "counts and re-indexing", problems))
        return checks


def _on_a_copy(fn: Callable) -> Callable:
    """An in-place operator called on a copy of its first argument (same strides); the copy is the output."""

    def call(tensor, *args, **kwargs):
        copy = copy_keeping_layout(tensor)
        fn(copy, *args, **kwargs)
        return copy

    return call


# ---------------------------------------------------------------------------------------------
# get_fused_mapping, expand_to_fused, expand_to_fused_with_sf, reduce_fused
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedParams:
    tokens: int
    experts: int  # E of the whole model; this EP rank owns E / ep_ranks of them
    topk: int
    ep_ranks: int = 1
    alignment: int = 128
    dtype: str = "int64"  # topk_idx's dtype (get_fused_mapping)
    expanded: str = "bound"  # get_fused_mapping's size: "sync" (0), "bound" (the bound), "no_sync" (0, forced)
    hidden: int = 0
    x_dtype: str = "bf16"  # expand: x; reduce: x (the output unless fp8)
    row_stride: int = 0  # expand: x's row stride when > hidden
    num_per_channels: int = 0  # expand_to_fused_with_sf: channels per scale
    sf_dtype: str = "fp32"  # expand_to_fused_with_sf: "fp32" or "packed" (int32 UE8M0 words)
    col_major: bool = False  # expand_to_fused_with_sf: use_tma_aligned_col_major_sf
    weights: bool = True  # reduce: topk_weights given
    x_sf: bool = False  # reduce: x is (data, x_sf)
    fp8: bool = False  # reduce: fp8_format="e4m3"
    sf: bool = False  # reduce: the output multiplier sf

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep_ranks

    @property
    def valid(self) -> int:
        return _total_valid(self.tokens, self.topk, self.experts, self.ep_ranks)

    @property
    def rows(self) -> int:
        """P: the expanded rows (the bound, at least ``alignment``; for get_fused_mapping's other modes:
        "no_sync" the contract's bound, "sync" the draw's exact size, at most the bound)."""
        if self.expanded == "no_sync":
            total = self.tokens * self.topk + (self.alignment - 1) * self.local_experts
            return total // self.alignment * self.alignment
        bound = (self.valid + (self.alignment - 1) * self.local_experts) // self.alignment * self.alignment
        return max(bound, self.alignment)

    @property
    def sf_columns(self) -> int:
        blocks = ceil_div(self.hidden, self.num_per_channels) if self.num_per_channels else 0
        return ceil_div(blocks, 4) if self.sf_dtype == "packed" else blocks


def _fused_label(name: str, p: FusedParams) -> str:
    parts = [name, f"T{p.tokens}", f"E{p.experts}", f"k{p.topk}"]
    if p.ep_ranks > 1:
        parts.append(f"ep{p.ep_ranks}")
    parts.append(f"a{p.alignment}")
    if name == "get_fused_mapping":
        return "/".join([*parts, p.expanded, p.dtype])
    parts.append(f"H{p.hidden}" + (f"ld{p.row_stride}" if p.row_stride else ""))
    parts.append(p.x_dtype)
    if name == "expand_to_fused_with_sf":
        parts += [f"C{p.num_per_channels}", p.sf_dtype] + (["colmajor"] if p.col_major else [])
    if name == "reduce_fused":
        flags = [("w", p.weights), ("xsf", p.x_sf), ("e4m3", p.fp8), ("sf", p.sf)]
        parts += [flag for flag, on in flags if on]
    return "/".join(parts)


# Rows of both tiers include one that is 8 bytes short of a 16-byte multiple in e4m3 (200, 7000),
# so the narrower-vector kernels run at scale too and a quick compile covers the full tier.
HIDDEN = {"quick": (64, 200, 576, 128), "full": (7168, 7000, 576, 4096)}


def _fused_params(tier: str, name: str) -> list[FusedParams]:
    params = []
    for i, experts in enumerate(EXPERTS):
        common = dict(
            tokens=_pick(TOKENS[tier], i),
            experts=experts,
            topk=_pick(TOPKS, i),
            ep_ranks=_pick(EP_RANKS, i),
            alignment=(128, 64, 1)[(i // 3) % 3],
        )
        hidden = _pick(HIDDEN[tier], i)
        if name == "get_fused_mapping":
            params.append(
                FusedParams(
                    **common, dtype=("int64", "int32")[i % 2], expanded=_pick(("sync", "bound", "no_sync"), i // 2)
                )
            )
        elif name == "expand_to_fused":
            x_dtype = ("bf16", "e4m3", "fp32")[(i // 2) % 3]
            row_stride = hidden + 64 if i % 2 else 0
            params.append(FusedParams(**common, hidden=hidden, x_dtype=x_dtype, row_stride=row_stride))
        elif name == "expand_to_fused_with_sf":
            flags = (("fp32", False), ("fp32", True), ("packed", True))[(i // 2) % 3]
            params.append(
                FusedParams(
                    **common,
                    hidden=hidden,
                    x_dtype="e4m3",
                    num_per_channels=(128, 32)[i % 2],
                    sf_dtype=flags[0],
                    col_major=flags[1],
                )
            )
        else:  # reduce_fused: (x dtype, weights, x_sf, fp8, sf)
            x_dtype, weights, x_sf, fp8, sf = (
                ("bf16", True, False, False, False),
                ("bf16", True, True, True, True),
                ("fp32", False, False, True, False),
                ("fp32", True, True, False, True),
                ("bf16", True, False, True, True),
                ("fp16", False, True, False, False),
            )[i % 6]
            params.append(
                FusedParams(**common, hidden=hidden, x_dtype=x_dtype, weights=weights, x_sf=x_sf, fp8=fp8, sf=sf)
            )
    return params


# DeepSeek-V3: 8192 tokens, hidden 7168, top-8 of 256 experts, one EP rank, segments aligned to 128.
FUSED_BENCHMARK = dict(tokens=8192, experts=256, topk=8, ep_ranks=1, alignment=128, hidden=7168)


class FusedOp(MoeOp):
    """The expert-major layout and the gather / combine built on it (``name`` picks which)."""

    def __init__(self, name: str):
        self.name = name
        self.outputs = {
            "get_fused_mapping": tuple(
                Output(n, Bitwise(), WHY_MAPPING)
                for n in (
                    "pos_to_expert",
                    "pos_to_token",
                    "pos_to_token_topk",
                    "token_topk_to_pos",
                    "expert_start",
                    "expert_end",
                    "num_tokens_per_expert",
                    "num_tokens_per_expert_list",
                )
            ),
            "expand_to_fused": (Output("out", Bitwise(), WHY_COPY),),
            "expand_to_fused_with_sf": (
                Output("out", Bitwise(), WHY_COPY),
                Output("out_sf", Bitwise(), WHY_COPY + "; column-major layout when asked"),
            ),
            "reduce_fused": (
                Output(
                    "out",
                    Bitwise(nan_equal=True),
                    "fp32 FMAs over the slots in order from 0 (a fixed sequence of correctly rounded "
                    "operations), one fp32 multiply by sf, one rounding to the output format (RNE; e4m3 "
                    "saturating): exactly one right answer; NaN (never expected) matches any NaN",
                ),
            ),
        }[name]

    # -- the edge profile: the copies' rows (every class the dtype holds), reduce's rows, weights
    # and row scales in turn; not the mapping, whose inputs are integers --

    edge_base_count = 3

    @property
    def edge_kinds(self) -> tuple[str, ...]:
        return () if self.name == "get_fused_mapping" else FLOAT_EDGE_KINDS

    def edge_base_ok(self, case: Case) -> bool:
        return case.params.tokens > 0 and not case.benchmark

    def edge_kinds_of(self, case: Case) -> tuple[str, ...]:
        p: FusedParams = case.params
        if p.x_dtype == "e4m3":  # float8_e4m3fn has no infinity
            return tuple(kind for kind in self.edge_kinds if kind != "inf")
        return self.edge_kinds

    def edge_targets_of(self, case: Case) -> tuple[str, ...]:
        p: FusedParams = case.params
        if self.name != "reduce_fused":
            return ("",)
        return ("x",) + (("weights",) if p.weights else ()) + (("x_sf",) if p.x_sf else ())

    def cases(self, tier: str) -> list[Case]:
        cases = [Case(self.name, _fused_label(self.name, p), p) for p in _fused_params(tier, self.name)]
        if tier != "full":
            return cases
        if self.name == "get_fused_mapping":
            p = FusedParams(**{**FUSED_BENCHMARK, "hidden": 0}, expanded="sync")
            cases.append(Case(self.name, _fused_label(self.name, p), p))
        elif self.name == "expand_to_fused":
            p = FusedParams(**FUSED_BENCHMARK)
            title = "expand_to_fused bf16, 8192 tokens, hidden 7168, top-8 of 256 experts"
            cases.append(Case(self.name, _fused_label(self.name, p), p, benchmark=True, title=title))
        elif self.name == "expand_to_fused_with_sf":
            p = FusedParams(**FUSED_BENCHMARK, x_dtype="e4m3", num_per_channels=128)
            cases.append(Case(self.name, _fused_label(self.name, p), p))
        else:
            p = FusedParams(**FUSED_BENCHMARK)
            title = "reduce_fused bf16 (weighted), 8192 tokens, hidden 7168, top-8 of 256 experts"
            cases.append(Case(self.name, _fused_label(self.name, p), p, benchmark=True, title=title))
            p = FusedParams(**FUSED_BENCHMARK, fp8=True, sf=True)
            title = "reduce_fused bf16 → e4m3 with sf, 8192 tokens, hidden 7168, top-8 of 256 experts"
            cases.append(Case(self.name, _fused_label(self.name, p), p, benchmark=True, title=title))
        return cases

    # -- inputs --

    def _topk_idx(self, p: FusedParams, generator: torch.Generator) -> torch.Tensor:
        return _routing(p.tokens, p.experts, p.topk, p.ep_ranks, generator)

    def _mapping(self, p: FusedParams, device: torch.device, generator: torch.Generator | None):
        """(token_topk_to_pos int32 [T, k], pos_to_expert int32 [P]) from the reference, P = the bound."""
        if generator is None:
            empty = torch.empty((p.tokens, p.topk), dtype=torch.int32, device=device)
            return empty, torch.empty(p.rows, dtype=torch.int32, device=device)
        mapping = reference.get_fused_mapping(self._topk_idx(p, generator), p.local_experts, p.rows, p.alignment)
        return mapping[3].to(device), mapping[0].to(device)

    def build(self, case: Case, device: torch.device, generator: torch.Generator | None) -> Call:
        p: FusedParams = case.params
        if self.name == "get_fused_mapping":
            dtype = INDEX_DTYPES[p.dtype]
            if generator is None:
                idx = torch.empty((p.tokens, p.topk), dtype=dtype, device=device)
            else:
                idx = self._topk_idx(p, generator).to(dtype).to(device)
            size = p.rows if p.expanded == "bound" else 0
            return Call((idx, p.local_experts, size, p.alignment, p.expanded == "no_sync"))
        token_topk_to_pos, pos_to_expert = self._mapping(p, device, generator)
        if self.name == "reduce_fused":
            return self._reduce_call(p, device, generator, token_topk_to_pos, case.edge)
        x = _rows(p.tokens, p.hidden, p.x_dtype, p.row_stride, device, generator)
        if case.edge is not None and generator is not None:
            write_edge_values(x, case.edge.kind, generator)
        if self.name == "expand_to_fused":
            return Call((x, token_topk_to_pos, pos_to_expert))
        sf = _scales(p, device, generator)
        return Call(((x, sf), p.num_per_channels, token_topk_to_pos, pos_to_expert, p.col_major))

    def _reduce_call(self, p: FusedParams, device, generator, token_topk_to_pos, edge: Edge | None = None) -> Call:
        x = _rows(p.rows, p.hidden, p.x_dtype, 0, device, generator)
        weights = x_sf = None
        if generator is None:
            if p.weights:
                weights = torch.empty((p.tokens, p.topk), dtype=torch.float32, device=device)
            if p.x_sf:
                x_sf = torch.empty(p.rows, dtype=torch.float32, device=device)
        else:
            padding = torch.ones(p.rows, dtype=torch.bool)
            padding[token_topk_to_pos[token_topk_to_pos >= 0].long().cpu()] = False
            x[padding.to(device)] = float("nan")  # rows no slot points to: never read
            if p.weights:
                _, weights = reference.normalize_weight(torch.rand((p.tokens, p.topk), generator=generator))
                weights = weights.to(device)
            if p.x_sf:
                x_sf = (torch.rand(p.rows, generator=generator) + 0.5).masked_fill(padding, float("nan")).to(device)
            if edge is not None:
                _write_reduce_edge_values(edge, generator, ~padding.to(device), x, weights, x_sf)
        sf = None
        if p.sf:
            sf = torch.tensor([FP8_OUTPUT_SF if p.fp8 else PLAIN_OUTPUT_SF], dtype=torch.float32, device=device)
        data = (x, x_sf) if p.x_sf else x
        return Call((data, weights, token_topk_to_pos, "e4m3" if p.fp8 else "", sf))

    def compile_group(self, case: Case) -> Hashable | None:
        """The expand / reduce kernels are static only in their element types and vector width (the
        largest power of two up to 16 bytes dividing the row and row stride); sizes, strides and
        reduce's optional inputs are runtime values, so cases that share these share their kernels."""
        if self.optimized() is None:
            return super().compile_group(case)
        p: FusedParams = case.params
        if self.name == "get_fused_mapping":
            return (self.name, p.dtype)  # its three kernels are static only in topk_idx's dtype
        element = DATA_DTYPES[p.x_dtype].itemsize
        row_bytes = p.hidden * element
        stride_bytes = (p.row_stride or p.hidden) * element if p.tokens > 1 else row_bytes
        vector_bytes = min(16, row_bytes & -row_bytes or 16, stride_bytes & -stride_bytes or 16)
        if self.name == "reduce_fused":
            return None if p.tokens == 0 else (self.name, p.x_dtype, p.fp8, vector_bytes)
        return (self.name, vector_bytes)

    # -- bytes --

    def bytes_moved(self, case: Case) -> int:
        p: FusedParams = case.params
        T, k, E = p.tokens, p.topk, p.local_experts
        if self.name == "get_fused_mapping":
            return T * k * INDEX_DTYPES[p.dtype].itemsize + 3 * p.rows * 4 + T * k * 4 + 3 * E * 4
        element = DATA_DTYPES[p.x_dtype].itemsize
        if self.name == "reduce_fused":
            out_element = 1 if p.fp8 else element
            total = p.valid * p.hidden * element + T * k * 4 + T * p.hidden * out_element
            total += T * k * 4 * int(p.weights) + p.valid * 4 * int(p.x_sf) + 4 * int(p.sf)
            return total
        # expand: each token row read once, written to each of its slots, padding rows zeroed.
        total = T * p.hidden * element + T * k * 4 + p.rows * p.hidden * element
        if self.name == "expand_to_fused_with_sf":
            total += T * p.sf_columns * 4 + p.rows * p.sf_columns * 4
        return total

    # -- the reference's self-checks --

    def self_check(self, case: Case, call: Call, outputs: tuple[torch.Tensor, ...]) -> list[Check]:
        p: FusedParams = case.params
        if self.name == "get_fused_mapping":
            return _mapping_checks(self.outputs, p, call, outputs)
        edge = case.edge is not None
        if self.name == "reduce_fused":
            return _reduce_checks(self.outputs, p, call, outputs, edge)
        return _expand_checks(self.outputs, p, call, outputs, edge)

    def split(self, result) -> tuple[torch.Tensor, ...]:
        if self.name != "get_fused_mapping":
            return super().split(result)
        *tensors, sizes = result
        device = tensors[0].device
        return (*tensors, torch.tensor(sizes, dtype=torch.int32, device=device).reshape(-1))


def _write_reduce_edge_values(edge: Edge, generator, read: torch.Tensor, x, weights, x_sf) -> None:
    """reduce_fused's edge values, in place: in the rows of x a slot reads (padding rows stay NaN,
    never read), in the weights (one unit per token), or in x_sf (one unit per row a slot reads)."""
    if edge.target == "weights":
        write_edge_values(weights, edge.kind, generator)
        return
    values = x[read] if edge.target == "x" else x_sf[read]
    write_edge_values(values, edge.kind, generator, block=(1, 1) if edge.target == "x_sf" else None)
    if edge.target == "x":
        x[read] = values
    else:
        x_sf[read] = values


def _rows(rows: int, hidden: int, dtype_name: str, row_stride: int, device, generator) -> torch.Tensor:
    """``[rows, hidden]`` of the dtype, a view with row stride ``row_stride`` when it is set. Values:
    4 · N(0, 1) (floats); random bytes, every code including NaN (e4m3: copied, never computed)."""
    dtype = DATA_DTYPES[dtype_name]
    width = row_stride or hidden
    if generator is None:
        return torch.empty((rows, width), dtype=dtype, device=device)[:, :hidden]
    if dtype == torch.float8_e4m3fn:
        wide = torch.randint(0, 256, (rows, width), generator=generator, dtype=torch.uint8).view(dtype)
    else:
        wide = (4.0 * torch.randn((rows, width), generator=generator)).to(dtype)
    return wide.to(device)[:, :hidden]


def _scales(p: FusedParams, device, generator) -> torch.Tensor:
    """expand_to_fused_with_sf's input scales: fp32 in [0.5, 1.5), or packed UE8M0 words."""
    shape = (p.tokens, p.sf_columns)
    if p.sf_dtype == "packed":
        if generator is None:
            return torch.empty(shape, dtype=torch.int32, device=device)
        return torch.randint(0, 2**31 - 1, shape, generator=generator, dtype=torch.int32).to(device)
    if generator is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return (torch.rand(shape, generator=generator) + 0.5).to(device)


def _mapping_checks(outputs_spec, p: FusedParams, call: Call, outputs) -> list[Check]:
    topk_idx = call.args[0]
    pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, start, end, sizes, size_list = outputs
    T, k, E = p.tokens, p.topk, p.local_experts
    rows = pos_to_expert.shape[0]
    listed = E if p.expanded == "sync" else 0
    expected = [_meta((rows,), torch.int32)] * 3 + [_meta((T, k), torch.int32)] + [_meta((E,), torch.int32)] * 3
    checks = [_layout_check(outputs_spec, outputs, (*expected, _meta((listed,), torch.int32)))]

    problems = []
    flat = topk_idx.reshape(-1).long()
    valid = flat >= 0
    count = torch.bincount(flat[valid], minlength=E)
    aligned = (count + p.alignment - 1) // p.alignment * p.alignment
    used = int(aligned.sum())
    if p.expanded == "sync" and rows != used:
        problems.append(f"P = {rows}, expected exactly the aligned total {used}")
    if p.expanded != "sync" and rows != p.rows:
        problems.append(f"P = {rows}, expected {p.rows}")
    if not torch.equal(sizes.long(), aligned):
        problems.append("num_tokens_per_expert is not align(count_e, alignment)")
    if not torch.equal(end.long(), torch.cumsum(aligned, 0)) or not torch.equal(start.long(), end.long() - aligned):
        problems.append("expert segments are not consecutive from 0")
    if p.expanded == "sync" and size_list.tolist() != sizes.tolist():
        problems.append("num_tokens_per_expert_list differs from num_tokens_per_expert")
    # Every (t, j) with an expert lands exactly once, where token_topk_to_pos says.
    pos = token_topk_to_pos.reshape(-1).long()
    if not torch.equal(pos >= 0, valid):
        problems.append("token_topk_to_pos is not -1 exactly where topk_idx is -1")
    landed = pos[valid & (pos >= 0)]
    slot = torch.arange(T * k, device=flat.device)[valid & (pos >= 0)]
    if landed.unique().numel() != landed.numel():
        problems.append("two slots landed on the same position")
    elif landed.numel():
        if not torch.equal(pos_to_token_topk[landed].long(), slot):
            problems.append("pos_to_token_topk does not point back to the slot")
        if not torch.equal(pos_to_token[landed].long(), slot // k):
            problems.append("pos_to_token does not point back to the token")
        if not torch.equal(pos_to_expert[landed].long(), flat[slot]):
            problems.append("pos_to_expert is not the slot's expert")
        rank = landed - start.long()[flat[slot]]
        if (rank < 0).any() or (rank >= count[flat[slot]]).any():
            problems.append("a slot lies outside the first count_e positions of its expert's segment")
    padding = torch.ones(rows, dtype=torch.bool, device=pos_to_expert.device)
    padding[landed] = False
    for name, tensor in (
        ("pos_to_expert", pos_to_expert),
        ("pos_to_token", pos_to_token),
        ("pos_to_token_topk", pos_to_token_topk),
    ):
        if (tensor[padding] != -1).any():
            problems.append(f"{name} is not -1 on a padding position")
    # Inside a segment, slots are in ascending flat index.
    occupied = pos_to_token_topk.long()
    same_expert = (pos_to_expert[1:] == pos_to_expert[:-1]) & (pos_to_expert[1:] >= 0)
    if (same_expert & (occupied[1:] <= occupied[:-1])).any():
        problems.append("inside a segment the slots are not in ascending t·k + j")
    checks.append(_problems_check("mapping invariants", "exactly once, aligned segments, padding -1", problems))
    return checks


def _expand_checks(outputs_spec, p: FusedParams, call: Call, outputs, edge: bool = False) -> list[Check]:
    x = call.args[0][0] if isinstance(call.args[0], tuple) else call.args[0]
    token_topk_to_pos = call.args[2] if p.num_per_channels else call.args[1]
    rows, dtype = p.rows, DATA_DTYPES[p.x_dtype]
    expected = [_meta((rows, p.hidden), dtype)]
    if p.num_per_channels:
        sf_dtype = torch.int32 if p.sf_dtype == "packed" else torch.float32
        strides = (1, ceil_div(rows, 4) * 4) if p.col_major else None
        expected.append(_meta((rows, p.sf_columns), sf_dtype, strides))
    checks = [_layout_check(outputs_spec, outputs, tuple(expected))]

    problems = []
    sources = [x] + ([call.args[0][1]] if p.num_per_channels else [])
    written = torch.zeros(rows, dtype=torch.bool, device=x.device)
    for name, out, source in zip(("out", "out_sf"), outputs, sources, strict=False):
        for j in range(p.topk):
            pos = token_topk_to_pos[:, j].long()
            valid = pos >= 0
            written[pos[valid]] = True
            if not torch.equal(_bits(out[pos[valid]]), _bits(source[valid])):
                problems.append(f"{name}: a row differs from its token's row (slot {j})")
                break
        if (_bits(out[~written]) != 0).any():
            problems.append(f"{name}: a padding row is not zero")
    checks.append(_problems_check("rows copied, padding zero", "bitwise", problems))
    if p.x_dtype in ("bf16", "fp32", "fp16") and p.tokens:
        checks.append(_round_trip_check(p, x, token_topk_to_pos, outputs[0], edge))
    return checks


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def _round_trip_check(p: FusedParams, x, token_topk_to_pos, expanded, edge: bool = False) -> Check:
    """reduce_fused(expand_to_fused(x), normalised weights) ≈ x for tokens with a slot, 0 otherwise.
    With ``edge`` (an edge case), over the tokens whose rows are finite before and after only."""
    valid = token_topk_to_pos >= 0
    weights = torch.where(valid, 1.0, 0.0).to(device=x.device, dtype=torch.float32)
    _, weights = reference.normalize_weight(weights)
    back = reference.reduce_fused(expanded, weights, token_topk_to_pos)
    has_slot = valid.any(dim=1)
    compared = has_slot
    if edge:
        compared = has_slot & torch.isfinite(x.double()).all(dim=1) & torch.isfinite(back.double()).all(dim=1)
    error = (back[compared].double() - x[compared].double()).abs()
    bound = 2 * ROUNDOFF[p.x_dtype] + (p.topk + 2) * FP32_ULP
    worst = float((error / x[compared].double().abs().clamp(min=1e-30)).max()) if error.numel() else 0.0
    zero_rows = not back[~has_slot].any()
    ok = worst <= bound and zero_rows
    detail = (
        "" if ok else f"relative error {worst:.3g} > {bound:.3g}" if zero_rows else "a token without a slot is not 0"
    )
    return Check("expand → reduce round trip", PASS if ok else FAIL, f"rel ≤ {bound:.3g}", f"{worst:.3g}", detail)


def _reduce_checks(outputs_spec, p: FusedParams, call: Call, outputs, edge: bool = False) -> list[Check]:
    data, weights, token_topk_to_pos, _, sf = call.args
    x, x_sf = data if isinstance(data, tuple) else (data, None)
    out_dtype = torch.float8_e4m3fn if p.fp8 else DATA_DTYPES[p.x_dtype]
    checks = [_layout_check(outputs_spec, outputs, (_meta((p.tokens, p.hidden), out_dtype),))]
    # The float64 sum, and the error an fp32 FMA chain of k terms, the x_sf and sf multiplies and
    # the output rounding may add: |out - ref| <= u·|ref| + (1 + u)·(k + 2)·2^-24·Σ|terms|·sf + subnormal step / 2.
    exact = torch.zeros((p.tokens, p.hidden), dtype=torch.float64, device=x.device)
    magnitude = torch.zeros_like(exact)
    for j in range(p.topk):
        pos = token_topk_to_pos[:, j].long()
        valid = pos >= 0
        scale = torch.ones(p.tokens, dtype=torch.float64, device=x.device)
        if weights is not None:
            scale = weights[:, j].double()
        if x_sf is not None:
            scale = scale * x_sf[pos.clamp(min=0)].double()
        term = (x[pos.clamp(min=0)].double() * scale[:, None]).masked_fill(~valid[:, None], 0.0)
        exact += term
        magnitude += term.abs()
    factor = float(sf[0]) if sf is not None else 1.0
    exact, magnitude = exact * factor, magnitude * abs(factor)
    if p.fp8:
        exact = exact.clamp(-448.0, 448.0)
    fmt = "e4m3" if p.fp8 else p.x_dtype
    u = ROUNDOFF[fmt]
    allowed = u * exact.abs() + (1 + u) * (p.topk + 2) * FP32_ULP * magnitude + SUBNORMAL_HALF_STEP[fmt]
    error = (outputs[0].double() - exact).abs()
    bad = ~(error <= allowed)  # NaN fails: padding rows hold NaN and must never be read
    if edge:
        # Edge values: the elements whose float64 sum has non-finite terms or leaves the output's
        # range are left out (their rule is the fp32 FMA chain itself: docs/numerics.md).
        bad &= torch.isfinite(magnitude) & (exact.abs() <= torch.finfo(out_dtype).max)
    metric = f"{int(bad.sum())}/{bad.numel()} outside"
    status = FAIL if bad.any() else PASS
    detail = "an output differs from the float64 weighted sum by more than the rounding allows" if bad.any() else ""
    checks.append(Check("float64 weighted sum", status, "FMA chain + output rounding", metric, detail))
    return checks


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

OPS = (
    "topk_gate",
    "topk_sum_and_topk_group_idx",
    "top2_sum_gate",
    "normalize_weight",
    "aux_fi",
    "group_count",
    "mask_indices_by_tp",
    "inplace_unique_group_indices",
    "get_fused_mapping",
    "expand_to_fused",
    "expand_to_fused_with_sf",
    "reduce_fused",
)

SPECS: tuple[OpSpec, ...] = (
    TopkGateOp(),
    GroupTopkOp(),
    Top2SumGateOp(),
    NormalizeWeightOp(),
    *(IndexOp(name) for name in ("aux_fi", "group_count", "mask_indices_by_tp", "inplace_unique_group_indices")),
    *(FusedOp(name) for name in ("get_fused_mapping", "expand_to_fused", "expand_to_fused_with_sf", "reduce_fused")),
)
for _spec in SPECS:
    register(_spec)
