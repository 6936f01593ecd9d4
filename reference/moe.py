"""Reference twin of the MoE gating and routing family (contract §2): the executable specification.

Every function here is plain PyTorch, runs on the CPU and on the GPU, and is written to be read:
rank the scores, keep the best, count, divide. The optimized kernels in ``tileproof.optimized.moe``
must reproduce integer results bit for bit and float results as stated per function.

Conventions (shared by every operator of the family):

- Ranking is a **stable descending sort**: a larger score ranks first and, among equal scores,
  the smaller index ranks first. ``-0.0`` and ``+0.0`` are equal (a tie). ``-inf`` is an ordinary
  value (ties among ``-inf`` go to the smaller index, like any tie). A NaN ranks above every number,
  NaNs among themselves by index (stated explicitly below: ``torch.sort`` places NaN differently
  on the CPU and on CUDA for descending sorts, so the reference does not lean on it).
- Index tensors are ``int32`` or ``int64`` and 2-D ``[T, k]``; results keep the input's dtype
  unless the contract fixes it (``topk_gate`` and ``topk_sum_and_topk_group_idx`` return int64,
  ``group_count`` int32, ``aux_fi`` fp32).
- A negative index is *padding*: counts ignore it, and re-indexing maps it to ``-1``. Indices
  above the valid range are refused with ``ValueError`` (the optimized twin device-asserts).
- Float sums are taken in fp32 left to right over the ``k`` slots, starting from the stated
  initial value, so that each result is a fixed sequence of IEEE operations.
- ``T = 0`` (no tokens) is valid everywhere and gives empty results (``aux_fi``: zeros).
- Integer arguments must be Python ``int`` (not ``bool``); a wrong type raises ``TypeError``, a
  value out of range ``ValueError``, each naming the argument and the allowed values.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange

from .contract import check_bool, check_choice, check_int, check_tensor
from .quant import encode_e4m3

__all__ = [
    "topk_gate",
    "normalize_weight",
    "group_count",
    "aux_fi",
    "mask_indices_by_tp",
    "inplace_unique_group_indices",
    "topk_sum_and_topk_group_idx",
    "top2_sum_gate",
    "get_fused_mapping",
    "expand_to_fused",
    "expand_to_fused_with_sf",
    "reduce_fused",
]

INDEX_DTYPES = (torch.int32, torch.int64)
SCORE_DTYPES = (torch.float32,)
NUM_TOPK_SUM_CHOICES = (1, 2)
# fp32(1e-20) = 9.99999968e-21: the start value of every weight denominator.
WEIGHT_EPSILON = 1e-20
SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")
# softplus(x) is taken as x itself above this threshold (TileKernels' scoring.softplus).
SOFTPLUS_THRESHOLD = 20.0
# The physical replica of a logical expert is chosen by (ep_rank + t · this) mod replica count.
REPLICA_HASH_PRIME = 23333
MAPPING_DTYPE = torch.int32
# reduce_fused's output formats: "" keeps x's dtype, "e4m3" encodes to float8_e4m3fn.
FP8_FORMATS = ("", "e4m3")


# ---------------------------------------------------------------------------------------------
# Validation of the family's arguments
# ---------------------------------------------------------------------------------------------


def check_scores(name: str, scores, ndim: int) -> torch.Tensor:
    return check_tensor(name, scores, dtypes=SCORE_DTYPES, ndim=ndim)


def check_indices(name: str, indices) -> torch.Tensor:
    return check_tensor(name, indices, dtypes=INDEX_DTYPES, ndim=2)


def _check_index_values(name: str, indices: torch.Tensor, *, low: int | None, high: int) -> None:
    """Every entry must be ``< high`` and, when ``low`` is given, ``>= low``."""
    if indices.numel() == 0:
        return
    smallest, largest = int(indices.min()), int(indices.max())
    if largest >= high or (low is not None and smallest < low):
        allowed = f"< {high}" if low is None else f"in [{low}, {high})"
        raise ValueError(f"{name} entries must be {allowed}, got values in [{smallest}, {largest}]")


# ---------------------------------------------------------------------------------------------
# Ranking
# ---------------------------------------------------------------------------------------------


def _descending_order(scores: torch.Tensor) -> torch.Tensor:
    """Each row's stable descending order along the last dimension, int64: larger first, ties by
    index, every NaN before every number (NaNs by index).

    Two stable sorts: first by value with NaN read as ``+inf`` (so NaNs sit with the ``+inf``
    entries, in index order), then by "is NaN", which lifts the NaNs to the front and keeps every
    other relative order."""
    is_nan = torch.isnan(scores)
    by_value = torch.sort(scores.masked_fill(is_nan, math.inf), dim=-1, descending=True, stable=True).indices
    nan_first = torch.sort(is_nan.gather(-1, by_value).to(torch.uint8), dim=-1, descending=True, stable=True).indices
    return by_value.gather(-1, nan_first)


def _stable_topk(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """The first ``num_topk`` positions of each row's stable descending order, int64, contiguous."""
    return _descending_order(scores)[..., :num_topk].contiguous()


def topk_gate(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Indices of each token's ``num_topk`` highest scores, best first.

    Args:
        scores: fp32 ``[T, E]``.
        num_topk: int, ``1 <= num_topk <= E``.

    Returns:
        int64 ``[T, num_topk]``, contiguous: ``out[t, j]`` is the expert of rank ``j`` in row ``t``
        under the stable descending order (ties → smaller index; NaN ranks first).
    """
    check_scores("scores", scores, ndim=2)
    check_int("num_topk", num_topk, low=1, high=scores.shape[1])
    return _stable_topk(scores, num_topk)


def topk_sum_and_topk_group_idx(scores: torch.Tensor, num_topk_sum: int, num_topk_groups: int) -> torch.Tensor:
    """Rank expert groups by the sum of their best one or two scores; return the best groups.

    ``group_score[t, g]`` is the largest score of group ``g`` (``num_topk_sum == 1``) or
    ``fl32(first + second)`` with ``first >= second`` its two largest scores, a repeated maximum
    counting twice (``num_topk_sum == 2``; fp32 addition is commutative, so the order of the two
    terms does not matter). The groups are then ranked with :func:`topk_gate`'s stable order.

    Args:
        scores: fp32 ``[T, G, E/G]`` (group ``g`` holds experts ``g·E/G ... (g+1)·E/G - 1``).
        num_topk_sum: 1 or 2, and at most ``E/G``.
        num_topk_groups: int, ``1 <= num_topk_groups <= G``.

    Returns:
        int64 ``[T, num_topk_groups]``: group indices, best first, ties → smaller group index.
    """
    check_scores("scores", scores, ndim=3)
    check_int("num_topk_sum", num_topk_sum, low=1, high=scores.shape[2])
    check_choice("num_topk_sum", num_topk_sum, NUM_TOPK_SUM_CHOICES)
    check_int("num_topk_groups", num_topk_groups, low=1, high=scores.shape[1])
    best_in_group = scores.gather(-1, _descending_order(scores))
    group_scores = best_in_group[..., 0]
    if num_topk_sum == 2:
        group_scores = group_scores + best_in_group[..., 1]
    return _stable_topk(group_scores, num_topk_groups)


# ---------------------------------------------------------------------------------------------
# Weights and statistics
# ---------------------------------------------------------------------------------------------


def normalize_weight(topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide each token's top-k weights by their sum.

    ``den[t] = fl32(...fl32(fl32(1e-20 + w[t, 0]) + w[t, 1]) ... + w[t, k-1])`` (left to right,
    starting from fp32(1e-20)), then ``out[t, j] = fl32(w[t, j] / den[t])`` (a true IEEE division,
    not a multiplication by ``1/den``). A row of zeros gives ``den = 1e-20`` and zero weights.

    Args:
        topk_weights: fp32 ``[T, k]``.

    Returns:
        ``(den, normalized)``: fp32 ``[T]`` and fp32 ``[T, k]``.
    """
    check_scores("topk_weights", topk_weights, ndim=2)
    num_tokens, num_topk = topk_weights.shape
    den = torch.full((num_tokens,), WEIGHT_EPSILON, dtype=torch.float32, device=topk_weights.device)
    for j in range(num_topk):
        den = den + topk_weights[:, j]
    normalized = topk_weights / rearrange(den, "t -> t 1")
    return den, normalized


def group_count(group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Histogram of group indices: ``out[g] = #{(t, j) : group_idx[t, j] == g}``.

    Args:
        group_idx: int32 or int64 ``[T, k]``; negative entries are padding and are not counted;
            entries must be ``< num_groups``.
        num_groups: int, ``>= 1``.

    Returns:
        int32 ``[num_groups]`` (zeros for ``T = 0``).
    """
    check_indices("group_idx", group_idx)
    check_int("num_groups", num_groups, low=1)
    _check_index_values("group_idx", group_idx, low=None, high=num_groups)
    valid = group_idx[group_idx >= 0].to(torch.int64)
    return torch.bincount(valid, minlength=num_groups).to(torch.int32)


def aux_fi(topk_idx: torch.Tensor, num_experts: int, num_aux_topk: int) -> torch.Tensor:
    """The load-balance frequency ``f_e = count_e · E / (T · num_aux_topk)``.

    ``count_e`` is the number of slots of ``topk_idx`` equal to ``e`` (``-1`` is padding and is not
    counted). The two products are formed exactly in int64, each converted to fp32 once (exact
    below 2^24), and divided once: ``f_e = fl32(fp32(count_e · E) / fp32(T · num_aux_topk))``.
    With ``T = 0`` there is nothing to count: the result is all zeros (no division by zero).

    Args:
        topk_idx: int32 or int64 ``[T, k]`` with entries in ``[-1, E)``.
        num_experts: int ``E >= 1``.
        num_aux_topk: int ``>= 1`` (usually ``k``; 1 for a sequence-level statistic).

    Returns:
        fp32 ``[E]``.
    """
    check_indices("topk_idx", topk_idx)
    check_int("num_experts", num_experts, low=1)
    check_int("num_aux_topk", num_aux_topk, low=1)
    _check_index_values("topk_idx", topk_idx, low=-1, high=num_experts)
    num_tokens = topk_idx.shape[0]
    if num_tokens == 0:
        return torch.zeros(num_experts, dtype=torch.float32, device=topk_idx.device)
    valid = topk_idx[topk_idx >= 0].to(torch.int64)
    count = torch.bincount(valid, minlength=num_experts)
    numerator = (count * num_experts).to(torch.float32)
    denominator = torch.tensor(num_tokens * num_aux_topk, dtype=torch.float32, device=topk_idx.device)
    return numerator / denominator


# ---------------------------------------------------------------------------------------------
# Re-indexing
# ---------------------------------------------------------------------------------------------


def mask_indices_by_tp(
    indices: torch.Tensor, n: int, num_ep_ranks: int, tp_rank: int, num_tp_ranks: int
) -> torch.Tensor:
    """Keep the experts owned by tensor-parallel rank ``tp_rank`` and renumber them locally.

    Layout: the ``n`` experts are split into ``num_ep_ranks`` consecutive blocks of
    ``per_rank = n / num_ep_ranks``; expert ``e`` lives on rank ``r = e // per_rank`` at offset
    ``j = e % per_rank``. The ranks form data-parallel groups of ``num_tp_ranks`` consecutive
    ranks, ``r = dp · num_tp_ranks + tp``. An expert is kept when its rank's ``tp == tp_rank``,
    and becomes ``dp · per_rank + j``: its position among the experts of all ranks with this
    ``tp`` (a number in ``[0, ceil(num_ep_ranks / num_tp_ranks) · per_rank)``). Every other entry,
    and every negative entry, becomes ``-1``.

    (TileKernels writes the same map as ``v = e - tp_rank·per_rank``, ``dp = v // per_dp``,
    ``v - dp·(per_dp - per_rank)`` with ``per_dp = num_tp_ranks·per_rank``.)

    Args:
        indices: int32 or int64 ``[T, k]``, entries ``< n`` (negative = padding).
        n: int ``>= 1``, the total number of experts, a multiple of ``num_ep_ranks``.
        num_ep_ranks: int ``>= 1``.
        tp_rank: int, ``0 <= tp_rank < num_tp_ranks``.
        num_tp_ranks: int ``>= 1``.

    Returns:
        A new tensor, same dtype and shape as ``indices``.
    """
    check_indices("indices", indices)
    check_int("n", n, low=1)
    check_int("num_ep_ranks", num_ep_ranks, low=1)
    check_int("num_tp_ranks", num_tp_ranks, low=1)
    check_int("tp_rank", tp_rank, low=0, high=num_tp_ranks - 1)
    if n % num_ep_ranks:
        raise ValueError(f"n must be a multiple of num_ep_ranks ({num_ep_ranks}), got {n}")
    _check_index_values("indices", indices, low=None, high=n)
    per_rank = n // num_ep_ranks
    valid = indices >= 0
    expert = torch.where(valid, indices, torch.zeros_like(indices))
    rank, offset = expert // per_rank, expert % per_rank
    dp, tp = rank // num_tp_ranks, rank % num_tp_ranks
    local = dp * per_rank + offset
    keep = valid & (tp == tp_rank)
    return torch.where(keep, local, torch.full_like(indices, -1))


def inplace_unique_group_indices(group_indices: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per row, overwrite every repeat of a group index after its first occurrence with ``-1``.

    Scanning a row left to right, an entry ``g >= 0`` that already occurred earlier in the row
    becomes ``-1``; the first occurrence stays. Negative entries are padding and are left as they
    are (a repeated ``-2`` stays ``-2``), matching TileKernels' kernel.

    Args:
        group_indices: int32 or int64 ``[T, k]``, entries ``< num_groups``; modified in place.
        num_groups: int ``>= 1``.

    Returns:
        ``group_indices`` itself (TileKernels returns ``None``; the tensor is the same either way).
    """
    check_indices("group_indices", group_indices)
    check_int("num_groups", num_groups, low=1)
    _check_index_values("group_indices", group_indices, low=None, high=num_groups)
    num_topk = group_indices.shape[1]
    # earlier[t, i, j]: slot j lies before slot i in the row and holds the same group.
    same = rearrange(group_indices, "t i -> t i 1") == rearrange(group_indices, "t j -> t 1 j")
    before = torch.ones(num_topk, num_topk, dtype=torch.bool, device=group_indices.device).tril(diagonal=-1)
    repeated = (same & before).any(dim=-1) & (group_indices >= 0)
    group_indices.masked_fill_(repeated, -1)
    return group_indices


# ---------------------------------------------------------------------------------------------
# The full router
# ---------------------------------------------------------------------------------------------


def _scores_from_logits(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """The routing probabilities ``s`` (fp32, same shape as ``logits``)."""
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "sqrtsoftplus":
        softplus = torch.where(logits > SOFTPLUS_THRESHOLD, logits, torch.log1p(torch.exp(logits)))
        return torch.sqrt(softplus)
    shifted = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    return shifted / shifted.sum(dim=-1, keepdim=True)


def check_router_arguments(
    logits,
    bias,
    num_topk,
    num_topk_groups,
    num_groups,
    use_shared_as_routed,
    num_shared_experts,
    routed_scaling_factor,
    ep_rank,
    num_ep_ranks,
    tp_rank,
    num_tp_ranks,
    scoring_func,
    mask,
    fix_routing_mask,
    to_physical_map,
    logical_count,
    unmapped_topk_idx,
    *,
    values: bool = True,
) -> tuple[int, int]:
    """``top2_sum_gate``'s argument rules, for both twins; returns ``(num_shared, num_extra)``.
    With ``values=False`` the three rules that read tensor data are skipped (finite logits in routed
    tokens, the fixed rows' indices, ``logical_count``'s range): the optimized kernel device-asserts
    them instead of synchronizing the host."""
    check_scores("logits", logits, ndim=2)
    check_scores("bias", bias, ndim=1)
    num_tokens, num_routed = logits.shape
    if bias.shape[0] != num_routed:
        raise ValueError(f"bias must have shape ({num_routed},), got {tuple(bias.shape)}")
    check_int("num_topk", num_topk, low=1, high=num_routed)
    check_int("num_groups", num_groups, low=0)
    check_int("num_topk_groups", num_topk_groups, low=0, high=num_groups)
    if (num_groups == 0) != (num_topk_groups == 0):
        raise ValueError(f"num_topk_groups must be 0 when num_groups is 0, got {num_topk_groups}")
    if num_groups and num_routed % num_groups:
        raise ValueError(f"num_groups must divide the number of experts ({num_routed}), got {num_groups}")
    grouped = num_groups != num_topk_groups
    if grouped and num_routed // num_groups < 2:
        raise ValueError(
            f"group limiting ranks groups by the sum of their top-2 scores: num_groups must leave at least 2 "
            f"experts per group ({num_routed} experts), got {num_groups}"
        )
    if grouped and num_topk > num_topk_groups * (num_routed // num_groups):
        raise ValueError(f"num_topk must be <= the experts of the kept groups, got {num_topk}")
    check_bool("use_shared_as_routed", use_shared_as_routed)
    num_shared = 0
    if use_shared_as_routed:
        num_shared = check_int("num_shared_experts", num_shared_experts, low=1, high=2)
        if num_topk % num_shared or num_routed % (num_topk // num_shared):
            raise ValueError(f"num_shared_experts must divide num_topk ({num_topk}) evenly, got {num_shared}")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a float, got {type(routed_scaling_factor).__name__}")
    check_int("num_ep_ranks", num_ep_ranks, low=1)
    check_int("ep_rank", ep_rank, low=0, high=num_ep_ranks - 1)
    check_int("num_tp_ranks", num_tp_ranks, low=1)
    check_int("tp_rank", tp_rank, low=0, high=num_tp_ranks - 1)
    check_choice("scoring_func", scoring_func, SCORING_FUNCS)
    for name, flags in (("mask", mask), ("fix_routing_mask", fix_routing_mask)):
        if flags is not None:
            check_tensor(name, flags, dtypes=(torch.bool,), ndim=1)
            if flags.shape[0] != num_tokens:
                raise ValueError(f"{name} must have shape ({num_tokens},), got {tuple(flags.shape)}")
    if values and not bool(torch.isfinite(logits if mask is None else logits[mask]).all()):
        raise ValueError("logits must be finite (no NaN or inf) in every routed token")
    if unmapped_topk_idx is not None:
        check_tensor("unmapped_topk_idx", unmapped_topk_idx, dtypes=(torch.int64,), ndim=2)
        if tuple(unmapped_topk_idx.shape) != (num_tokens, num_topk):
            shape = tuple(unmapped_topk_idx.shape)
            raise ValueError(f"unmapped_topk_idx must have shape {(num_tokens, num_topk)}, got {shape}")
        if num_topk > 1 and unmapped_topk_idx.stride(1) != 1:
            # Not check_unit_inner_stride: its advice (.contiguous()) would copy an output buffer.
            raise ValueError(
                "unmapped_topk_idx must have unit stride in its last dimension (a row stride larger than the "
                f"row is fine), got strides {tuple(unmapped_topk_idx.stride())}"
            )
    if fix_routing_mask is not None:
        if unmapped_topk_idx is None:
            raise ValueError("fix_routing_mask needs unmapped_topk_idx, which holds the fixed indices")
        if values:
            fixed = fix_routing_mask if mask is None else fix_routing_mask & mask
            _check_index_values("unmapped_topk_idx (fixed rows)", unmapped_topk_idx[fixed], low=0, high=num_routed)
    if (to_physical_map is None) != (logical_count is None):
        raise ValueError("to_physical_map and logical_count must be given together")
    num_extra = 0
    if to_physical_map is not None:
        check_tensor("to_physical_map", to_physical_map, dtypes=(torch.int32,), ndim=2)
        check_tensor("logical_count", logical_count, dtypes=(torch.int32,), ndim=1)
        num_logical = num_routed + num_shared
        if to_physical_map.shape[0] != num_logical or logical_count.shape[0] != num_logical:
            raise ValueError(f"to_physical_map and logical_count must have {num_logical} rows")
        num_extra = to_physical_map.shape[1] - 1
        if values:
            _check_index_values("logical_count", rearrange(logical_count, "e -> 1 e"), low=1, high=num_extra + 2)
    if num_shared > num_extra:
        raise ValueError(f"num_shared_experts must be <= num_extra_experts ({num_extra}), got {num_shared}")
    if (num_routed + num_extra) % num_ep_ranks:
        raise ValueError(
            f"num_ep_ranks must divide the physical experts ({num_routed + num_extra}), got {num_ep_ranks}"
        )
    return num_shared, num_extra


def top2_sum_gate(
    logits: torch.Tensor,
    bias: torch.Tensor,
    num_topk: int,
    num_topk_groups: int,
    num_groups: int,
    use_shared_as_routed: bool,
    num_shared_experts: int,
    routed_scaling_factor: float,
    ep_rank: int,
    num_ep_ranks: int,
    tp_rank: int,
    num_tp_ranks: int,
    scoring_func: str,
    mask: torch.Tensor | None = None,
    fix_routing_mask: torch.Tensor | None = None,
    to_physical_map: torch.Tensor | None = None,
    logical_count: torch.Tensor | None = None,
    unmapped_topk_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V3-style router: score, limit groups, pick the top-k, weigh, re-index.

    Steps, per token ``t`` (``R`` routed experts, ``k = num_topk``):

    1. **Score**: ``s = sigmoid(logits)``, ``sqrt(softplus(logits))`` with ``softplus(x) = x`` for
       ``x > 20`` else ``log1p(exp(x))``, or ``softmax(logits)`` (``exp(x - max) / Σ exp``).
    2. **Ranking score**: ``r = s + bias`` (softmax: ``r = logits + bias``).
    3. **Group limiting** (when ``num_groups != num_topk_groups``): the ``R`` experts form
       ``num_groups`` consecutive groups; the ``num_topk_groups`` groups with the largest top-2
       sums of ``r`` are kept (:func:`topk_sum_and_topk_group_idx` with ``num_topk_sum = 2``);
       experts of the other groups are out of the race (``r = -inf``).
    4. **Top-k**: :func:`topk_gate` on ``r`` (stable; ties → smaller expert index). **Fixed
       routing**: a token with ``fix_routing_mask[t]`` skips steps 2-4 and takes the ``k`` logical
       experts the caller stored in ``unmapped_topk_idx[t]`` (each in ``[0, R)``; kept in the
       given order, repeats allowed), e.g. to replay a recorded routing.
    5. **Weights**: ``w_j = fl32(fl32(s_idx_j / den) · fp32(routed_scaling_factor))`` with
       ``den = 1e-20 + Σ_j s_idx_j`` summed left to right (:func:`normalize_weight`), from the
       scores ``s`` *without* bias (for fixed tokens too).
    6. **Shared experts** (only when ``use_shared_as_routed``; ``S = num_shared_experts`` in
       ``{1, 2}``): slots ``k .. k+S-1`` get index ``R + j`` and weight ``1.0``.
    7. **Physical map** (optional): logical expert ``e`` becomes
       ``to_physical_map[e, (ep_rank + t · 23333) % logical_count[e]]``.
    8. **EP/TP re-indexing**: :func:`mask_indices_by_tp` with ``n = R + num_extra_experts``
       (``num_extra_experts = to_physical_map.shape[1] - 1``, else 0): experts not on this
       tensor-parallel rank become ``-1`` (their weights are kept, as TileKernels does).
    9. **Mask**: a token with ``mask[t] == False`` gets index ``-1`` and weight ``0`` in every slot;
       it takes no part in routing (``fix_routing_mask`` and its logits are not read).
    10. **Unmapped indices** (when ``unmapped_topk_idx`` is given): ``unmapped_topk_idx[t]`` is
        overwritten **in place** with the ``k`` logical routed experts of step 4 (before steps 6-8:
        no shared slots, no physical map, no TP masking), ``-1`` for a masked token. A fixed
        token's row is written back unchanged.

    Args:
        logits: fp32 ``[T, R]``, finite in every routed token (NaN/inf there raise ``ValueError``;
            the kernel device-asserts); a masked token's logits are not read.
        bias: fp32 ``[R]``.
        num_topk: int, ``1 <= k <= R`` and ``<= num_topk_groups · R / num_groups`` when grouping.
        num_topk_groups, num_groups: ints, both 0 (no grouping) or ``1 <= num_topk_groups <=
            num_groups`` with ``R % num_groups == 0``.
        use_shared_as_routed: bool; when False, ``num_shared_experts`` is ignored (``S = 0``).
        num_shared_experts: int in ``{1, 2}`` when used, ``k % S == 0``, ``R % (k / S) == 0``,
            and ``S <= num_extra_experts`` (so a physical map is required, as in TileKernels).
        routed_scaling_factor: float, rounded to fp32.
        ep_rank, num_ep_ranks, tp_rank, num_tp_ranks: ints; ``0 <= ep_rank < num_ep_ranks``,
            ``0 <= tp_rank < num_tp_ranks``, ``(R + num_extra_experts) % num_ep_ranks == 0``.
        scoring_func: ``"sigmoid"``, ``"sqrtsoftplus"`` or ``"softmax"``.
        mask: optional bool ``[T]`` (True = route the token).
        fix_routing_mask: optional bool ``[T]`` (True = use the indices in ``unmapped_topk_idx``);
            requires ``unmapped_topk_idx``.
        to_physical_map: optional int32 ``[R + S, 1 + num_extra_experts]``; with ``logical_count``
            int32 ``[R + S]`` (entries ``>= 1``). Both or neither.
        unmapped_topk_idx: optional int64 ``[T, k]`` with unit stride along ``k`` (the row stride may
            exceed ``k``): read (fixed tokens) then overwritten in place (step 10).

    Returns:
        ``(topk_idx int64 [T, k + S], topk_weights fp32 [T, k + S])``, contiguous.
    """
    num_shared, num_extra = check_router_arguments(
        logits,
        bias,
        num_topk,
        num_topk_groups,
        num_groups,
        use_shared_as_routed,
        num_shared_experts,
        routed_scaling_factor,
        ep_rank,
        num_ep_ranks,
        tp_rank,
        num_tp_ranks,
        scoring_func,
        mask,
        fix_routing_mask,
        to_physical_map,
        logical_count,
        unmapped_topk_idx,
    )
    num_tokens, num_routed = logits.shape
    grouped = num_groups != num_topk_groups
    num_physical = num_routed + num_extra
    device = logits.device
    routed = torch.ones(num_tokens, dtype=torch.bool, device=device) if mask is None else mask
    fixed = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    if fix_routing_mask is not None:
        fixed = fix_routing_mask & routed

    # 1-2. scores and ranking scores.
    scores = _scores_from_logits(logits, scoring_func)
    ranking = (logits if scoring_func == "softmax" else scores) + bias
    # 3. group limiting.
    if grouped:
        grouped_ranking = rearrange(ranking, "t (g e) -> t g e", g=num_groups)
        kept_groups = topk_sum_and_topk_group_idx(grouped_ranking, 2, num_topk_groups)
        keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=device)
        keep.scatter_(1, kept_groups, True)
        keep = keep.repeat_interleave(num_routed // num_groups, dim=1)
        ranking = ranking.masked_fill(~keep, float("-inf"))
    # 4. top-k, or the caller's fixed choice.
    routed_idx = topk_gate(ranking, num_topk)
    if fix_routing_mask is not None:
        routed_idx = torch.where(rearrange(fixed, "t -> t 1"), unmapped_topk_idx, routed_idx)
    # 5. weights from the unbiased scores.
    _, normalized = normalize_weight(torch.gather(scores, 1, routed_idx))
    factor = torch.tensor(routed_scaling_factor, dtype=torch.float32, device=device)
    routed_weights = normalized * factor
    # 6. shared experts.
    shared_idx = torch.arange(num_routed, num_routed + num_shared, device=device).expand(num_tokens, num_shared)
    topk_idx = torch.cat([routed_idx, shared_idx], dim=1)
    topk_weights = torch.cat(
        [routed_weights, torch.ones(num_tokens, num_shared, dtype=torch.float32, device=device)], dim=1
    )
    # 7. logical -> physical.
    if to_physical_map is not None:
        token = rearrange(torch.arange(num_tokens, device=device), "t -> t 1")
        replica = (ep_rank + token * REPLICA_HASH_PRIME) % logical_count.to(torch.int64)[topk_idx]
        topk_idx = to_physical_map.to(torch.int64)[topk_idx, replica]
    # 8. EP/TP re-indexing.
    topk_idx = mask_indices_by_tp(topk_idx, num_physical, num_ep_ranks, tp_rank, num_tp_ranks)
    # 9. masked tokens.
    if mask is not None:
        skip = rearrange(~mask, "t -> t 1")
        topk_idx = topk_idx.masked_fill(skip, -1)
        topk_weights = topk_weights.masked_fill(skip, 0.0)
    # 10. the logical choice, written back in place.
    if unmapped_topk_idx is not None:
        unmapped_topk_idx.copy_(routed_idx.masked_fill(rearrange(~routed, "t -> t 1"), -1))
    return topk_idx.contiguous(), topk_weights.contiguous()


# ---------------------------------------------------------------------------------------------
# Fused (expert-major) layout
# ---------------------------------------------------------------------------------------------


def get_fused_mapping(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_expanded_tokens: int,
    alignment: int,
    force_no_sync: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Lay the ``(token, slot)`` pairs out expert by expert, each expert's segment padded.

    Steps:

    1. **Count**: ``count_e = #{(t, j) : topk_idx[t, j] == e}`` (``-1`` is padding, not counted).
    2. **Segments**: ``size_e = align(count_e, alignment)`` (the next multiple, 0 stays 0);
       ``expert_start[e] = Σ_{e' < e} size_e'``, ``expert_end[e] = expert_start[e] + size_e``.
    3. **Place**: inside expert ``e``'s segment, its pairs take the first ``count_e`` slots in
       ascending flat index ``t · k + j`` (by token, then by slot): deterministic, whatever the
       grid. The remaining ``size_e - count_e`` slots, and every slot past ``expert_end[E-1]``,
       are padding: ``-1`` in ``pos_to_expert``, ``pos_to_token``, ``pos_to_token_topk``.

    Size ``P`` of the expanded buffer: ``num_expanded_tokens`` when it is ``> 0`` (an upper bound;
    smaller than ``expert_end[E-1]`` raises ``ValueError``). When it is ``0`` and not
    ``force_no_sync``: exactly ``expert_end[E-1]`` (TileKernels reads the counts back to the host
    here), and ``num_tokens_per_expert_list`` is that host copy. When it is ``0`` with
    ``force_no_sync``: the bound ``floor((T·k + (alignment-1)·E) / alignment) · alignment``
    (TileKernels allocates 0 rows there, which the kernel overruns; the bound is the safe reading).

    Args:
        topk_idx: int32 or int64 ``[T, k]``, entries in ``[-1, num_experts)``.
        num_experts: int ``E >= 1``.
        num_expanded_tokens: int ``>= 0``.
        alignment: int ``>= 1``.
        force_no_sync: bool.

    Returns:
        ``(pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start,
        expert_end, num_tokens_per_expert, num_tokens_per_expert_list)``: int32 ``[P]`` ×3
        (``pos_to_token_topk`` holds the *flat* index ``t · k + j``), int32 ``[T, k]`` (``-1``
        where ``topk_idx`` is ``-1``), int32 ``[E]`` ×3 (``num_tokens_per_expert`` is the
        *aligned* size ``size_e``, as in TileKernels), and a Python ``list[int]`` of the ``size_e``
        when the size was computed with a sync, else ``[]``.
    """
    check_indices("topk_idx", topk_idx)
    check_int("num_experts", num_experts, low=1)
    check_int("num_expanded_tokens", num_expanded_tokens, low=0)
    check_int("alignment", alignment, low=1)
    check_bool("force_no_sync", force_no_sync)
    _check_index_values("topk_idx", topk_idx, low=-1, high=num_experts)
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device

    # 1. count.
    flat = topk_idx.reshape(-1).to(torch.int64)
    slots = torch.nonzero(flat >= 0).reshape(-1)  # ascending flat index
    experts = flat[slots]
    count = torch.bincount(experts, minlength=num_experts)
    # 2. segments.
    size = (count + alignment - 1) // alignment * alignment
    expert_end = torch.cumsum(size, dim=0)
    expert_start = expert_end - size
    used = int(expert_end[-1])
    should_sync = num_expanded_tokens == 0 and not force_no_sync
    if should_sync:
        num_expanded_tokens = used
    elif num_expanded_tokens == 0:
        num_expanded_tokens = (num_tokens * num_topk + (alignment - 1) * num_experts) // alignment * alignment
    elif num_expanded_tokens < used:
        raise ValueError(f"num_expanded_tokens must be 0 or >= {used} (the aligned total), got {num_expanded_tokens}")
    # 3. place: a stable sort by expert keeps the flat order inside each expert.
    order = torch.sort(experts, stable=True).indices
    slots, experts = slots[order], experts[order]
    first_of_expert = torch.cumsum(count, dim=0) - count
    rank = torch.arange(slots.numel(), device=device) - first_of_expert[experts]
    pos = expert_start[experts] + rank

    def padding(*shape: int) -> torch.Tensor:
        return torch.full(shape, -1, dtype=MAPPING_DTYPE, device=device)

    pos_to_expert, pos_to_token, pos_to_token_topk = (padding(num_expanded_tokens) for _ in range(3))
    pos_to_expert[pos] = experts.to(MAPPING_DTYPE)
    pos_to_token[pos] = (slots // num_topk).to(MAPPING_DTYPE)
    pos_to_token_topk[pos] = slots.to(MAPPING_DTYPE)
    token_topk_to_pos = padding(num_tokens * num_topk)
    token_topk_to_pos[slots] = pos.to(MAPPING_DTYPE)
    size_list = size.tolist() if should_sync else []
    return (
        pos_to_expert,
        pos_to_token,
        pos_to_token_topk,
        rearrange(token_topk_to_pos, "(t k) -> t k", k=num_topk),
        expert_start.to(MAPPING_DTYPE),
        expert_end.to(MAPPING_DTYPE),
        size.to(MAPPING_DTYPE),
        size_list,
    )


def _check_positions(token_topk_to_pos, num_positions: int) -> torch.Tensor:
    check_indices("token_topk_to_pos", token_topk_to_pos)
    _check_index_values("token_topk_to_pos", token_topk_to_pos, low=-1, high=num_positions)
    return token_topk_to_pos


def _expand_rows(x: torch.Tensor, token_topk_to_pos: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[token_topk_to_pos[t, j]] = x[t]`` for every slot with a position ``>= 0``."""
    num_topk = token_topk_to_pos.shape[1]
    pos = token_topk_to_pos.reshape(-1).to(torch.int64)
    valid = pos >= 0
    token = torch.arange(pos.numel(), device=pos.device) // num_topk
    out[pos[valid]] = x[token[valid]]
    return out


def expand_to_fused(x: torch.Tensor, token_topk_to_pos: torch.Tensor, pos_to_expert: torch.Tensor) -> torch.Tensor:
    """Copy each token's row to every expert slot it was routed to (a pure gather, exact).

    ``out[p] = x[t]`` for each ``(t, j)`` with ``p = token_topk_to_pos[t, j] >= 0``; every other row
    (padding, ``pos_to_expert[p] < 0``) is zero.

    Args:
        x: ``[T, H]``, any dtype (bf16, fp8, ...); copied bit for bit.
        token_topk_to_pos: int32 or int64 ``[T, k]`` with entries in ``[-1, P)``.
        pos_to_expert: int32 or int64 ``[P]`` (only its length is used: the result has ``P`` rows).

    Returns:
        ``[P, H]``, ``x.dtype``, contiguous.
    """
    check_tensor("x", x, ndim=2)
    check_tensor("pos_to_expert", pos_to_expert, dtypes=INDEX_DTYPES, ndim=1)
    _check_positions(token_topk_to_pos, pos_to_expert.shape[0])
    if token_topk_to_pos.shape[0] != x.shape[0]:
        raise ValueError(f"token_topk_to_pos must have {x.shape[0]} rows (x's), got {token_topk_to_pos.shape[0]}")
    out = torch.zeros(pos_to_expert.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    return _expand_rows(x, token_topk_to_pos, out)


def expand_to_fused_with_sf(
    x: tuple[torch.Tensor, torch.Tensor],
    num_per_channels: int,
    token_topk_to_pos: torch.Tensor,
    pos_to_expert: torch.Tensor,
    use_tma_aligned_col_major_sf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`expand_to_fused` of a quantized pair: the scale rows follow their data rows.

    Args:
        x: ``(data [T, H], sf [T, H_sf])``; both copied bit for bit.
        num_per_channels: int ``>= 1``, channels per scale block (recorded by the contract; the
            copy does not depend on it).
        token_topk_to_pos, pos_to_expert: as in :func:`expand_to_fused`.
        use_tma_aligned_col_major_sf: bool. When True the scales are returned as the transposed
            view of a ``[H_sf, align(P, 4)]`` buffer (column-major, TMA-aligned), same values.

    Returns:
        ``(out [P, H] data dtype, out_sf [P, H_sf] sf dtype)``; padding rows are zero in both.
    """
    if not isinstance(x, tuple) or len(x) != 2:
        raise TypeError(f"x must be a (data, sf) tuple, got {type(x).__name__}")
    data, sf = x
    check_tensor("x[0]", data, ndim=2)
    check_tensor("x[1]", sf, ndim=2)
    if sf.shape[0] != data.shape[0]:
        raise ValueError(f"x[1] must have {data.shape[0]} rows (x[0]'s), got {sf.shape[0]}")
    check_int("num_per_channels", num_per_channels, low=1)
    check_bool("use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)
    out = expand_to_fused(data, token_topk_to_pos, pos_to_expert)
    num_positions, hidden_sf = pos_to_expert.shape[0], sf.shape[1]
    if use_tma_aligned_col_major_sf:
        padded = (num_positions + 3) // 4 * 4
        buffer = torch.zeros(hidden_sf, padded, dtype=sf.dtype, device=sf.device)
        out_sf = buffer[:, :num_positions].T
    else:
        out_sf = torch.zeros(num_positions, hidden_sf, dtype=sf.dtype, device=sf.device)
    return out, _expand_rows(sf, token_topk_to_pos, out_sf)


def fma_fp32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fl32(a · b + c)`` with one rounding (a fused multiply-add), for fp32 tensors.

    ``a · b`` is exact in fp64 (24 + 24 <= 53 bits). The fp64 sum is made round-to-odd (TwoSum
    gives its exact error; an inexact even result moves one ulp toward the exact value), and
    rounding a round-to-odd fp64 value to fp32 is correctly rounded (53 >= 24 + 2).
    """
    p, q = a.double() * b.double(), c.double()
    s = p + q
    s_q = s - p
    err = (p - (s - s_q)) + (q - s_q)
    even = (s.view(torch.int64) & 1) == 0
    nudge = (err != 0) & even & torch.isfinite(s)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(nudge, torch.nextafter(s, toward), s).float()


def check_reduce_inputs(
    x, topk_weights, token_topk_to_pos, fp8_format, sf, *, values: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """``reduce_fused``'s arguments (both twins); returns ``(data, x_sf, T, k)``, ``x_sf`` None for a
    plain ``x``. A pair's tensors are named ``x[0]`` and ``x[1]``, as every pair argument is.
    ``values=False`` checks token_topk_to_pos's dtype and shape only (no read-back of its entries:
    the optimized twin, which would otherwise synchronize with the GPU)."""
    x_sf, data_name = None, "x"
    if isinstance(x, tuple):
        if len(x) != 2:
            raise TypeError(f"x must be a tensor or a (data, x_sf) pair, got a tuple of {len(x)} items")
        (x, x_sf), data_name = x, "x[0]"
    check_tensor(data_name, x, dtypes=(torch.bfloat16, torch.float16, torch.float32), ndim=2)
    check_choice("fp8_format", fp8_format, FP8_FORMATS)
    num_positions = x.shape[0]
    if values:
        _check_positions(token_topk_to_pos, num_positions)
    else:
        check_indices("token_topk_to_pos", token_topk_to_pos)
    num_tokens, num_topk = token_topk_to_pos.shape
    if x_sf is not None:
        check_tensor("x[1]", x_sf, dtypes=SCORE_DTYPES, ndim=1)
        if x_sf.shape[0] != num_positions:
            raise ValueError(f"x[1] (x_sf) must have shape ({num_positions},), got {tuple(x_sf.shape)}")
    if topk_weights is not None:
        check_scores("topk_weights", topk_weights, ndim=2)
        if tuple(topk_weights.shape) != (num_tokens, num_topk):
            raise ValueError(f"topk_weights must have shape {(num_tokens, num_topk)}, got {tuple(topk_weights.shape)}")
    if sf is not None:
        check_tensor("sf", sf, dtypes=SCORE_DTYPES, ndim=1)
        if sf.shape[0] != 1:
            raise ValueError(f"sf must have shape (1,), got {tuple(sf.shape)}")
    return x, x_sf, num_tokens, num_topk


def reduce_fused(
    x,
    topk_weights: torch.Tensor | None,
    token_topk_to_pos: torch.Tensor,
    fp8_format: str = "",
    sf: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine each token's expert outputs: a weighted sum over its slots, in fp32.

    For each token ``t``, from ``acc = 0.0`` (fp32) and for ``j = 0, 1, ..., k-1`` in that order,
    skipping slots with ``p = token_topk_to_pos[t, j] < 0``:
    ``acc = fma(fp32(x[p]), s_j, acc)`` — one fused multiply-add, one rounding — where
    ``s_j = w[t, j]`` (``1.0`` without ``topk_weights``), times ``x_sf[p]`` (``fl32``) when ``x`` is
    a ``(data, x_sf)`` pair (``x_sf`` is the input rows' dequantization scale). Then
    ``acc = fl32(acc · sf[0])`` when ``sf`` is given, and the result is rounded once (round to
    nearest even) to ``x``'s dtype, or with ``fp8_format='e4m3'`` encoded to float8_e4m3fn: finite
    values beyond ±448 (and ±inf) saturate to ±448, NaN becomes ``0x7F``
    (:func:`tileproof.reference.quant.encode_e4m3`, the conversion with saturation of the GPU).
    A token with no valid slot gives 0.

    ``sf`` is a **multiplier** on the output (TileKernels' meaning, kept so that the optimized twin
    is a drop-in): to produce FP8 data whose dequantization scale is ``d``, pass ``sf = [1 / d]``.
    It is also accepted without FP8 output, and applied the same way (TileKernels' kernel refuses
    that combination; its PyTorch reference applies it).

    Args:
        x: ``[P, H]`` (bf16, fp16 or fp32), or a pair ``(data [P, H], x_sf fp32 [P])``.
        topk_weights: fp32 ``[T, k]`` or None.
        token_topk_to_pos: int32 or int64 ``[T, k]`` with entries in ``[-1, P)``.
        fp8_format: ``""`` (output in ``x``'s dtype) or ``"e4m3"`` (float8_e4m3fn output).
        sf: optional fp32 ``[1]``, a multiplier applied to the whole fp32 result before rounding.

    Returns:
        ``[T, H]`` in ``x``'s (data) dtype, or float8_e4m3fn with ``fp8_format='e4m3'``; contiguous.
    """
    x, x_sf, num_tokens, num_topk = check_reduce_inputs(x, topk_weights, token_topk_to_pos, fp8_format, sf)
    acc = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(num_topk):
        pos = token_topk_to_pos[:, j].to(torch.int64)
        valid = rearrange(pos >= 0, "t -> t 1")
        safe = pos.clamp(min=0)
        scale = torch.ones(num_tokens, dtype=torch.float32, device=x.device)
        if topk_weights is not None:
            scale = topk_weights[:, j]
        if x_sf is not None:
            scale = scale * x_sf[safe]
        summed = fma_fp32(x[safe].float(), rearrange(scale, "t -> t 1"), acc)
        acc = torch.where(valid, summed, acc)
    if sf is not None:
        acc = acc * sf[0]
    if fp8_format == "e4m3":
        return encode_e4m3(acc).contiguous()
    return acc.to(x.dtype).contiguous()
