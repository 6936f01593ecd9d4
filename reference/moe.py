"""Reference twin of the MoE gating and routing family (contract §2): the executable specification.

Every function here is plain PyTorch, runs on the CPU and on the GPU, and is written to be read:
rank the scores, keep the best, count, divide. The optimized kernels in ``tileproof.optimized.moe``
must reproduce integer results bit for bit and float results as stated per function.

Conventions (shared by every operator of the family):

- Ranking is a **stable descending sort**: a larger score ranks first and, among equal scores,
  the smaller index ranks first. ``-0.0`` and ``+0.0`` are equal (a tie). ``-inf`` is an ordinary
  value (ties among ``-inf`` go to the smaller index, like any tie). A NaN ranks above every number
  (the order of ``torch.sort``), NaNs among themselves by index.
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

import torch
from einops import rearrange

from .contract import check_choice, check_tensor

__all__ = [
    "topk_gate",
    "normalize_weight",
    "group_count",
    "aux_fi",
    "mask_indices_by_tp",
    "inplace_unique_group_indices",
    "topk_sum_and_topk_group_idx",
]

INDEX_DTYPES = (torch.int32, torch.int64)
SCORE_DTYPES = (torch.float32,)
NUM_TOPK_SUM_CHOICES = (1, 2)
# fp32(1e-20) = 9.99999968e-21: the start value of every weight denominator.
WEIGHT_EPSILON = 1e-20


# ---------------------------------------------------------------------------------------------
# Validation of the family's arguments
# ---------------------------------------------------------------------------------------------


def _check_int(name: str, value, *, low: int, high: int | None = None) -> int:
    """``value`` must be an int with ``low <= value`` (and ``value <= high`` when given)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def _check_scores(name: str, scores, ndim: int) -> torch.Tensor:
    return check_tensor(name, scores, dtypes=SCORE_DTYPES, ndim=ndim)


def _check_indices(name: str, indices) -> torch.Tensor:
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


def _stable_topk(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """The first ``num_topk`` positions of each row's stable descending order, int64, contiguous."""
    _, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return order[..., :num_topk].contiguous()


def topk_gate(scores: torch.Tensor, num_topk: int) -> torch.Tensor:
    """Indices of each token's ``num_topk`` highest scores, best first.

    Args:
        scores: fp32 ``[T, E]``.
        num_topk: int, ``1 <= num_topk <= E``.

    Returns:
        int64 ``[T, num_topk]``, contiguous: ``out[t, j]`` is the expert of rank ``j`` in row ``t``
        under the stable descending order (ties → smaller index; NaN ranks first).
    """
    _check_scores("scores", scores, ndim=2)
    _check_int("num_topk", num_topk, low=1, high=scores.shape[1])
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
    _check_scores("scores", scores, ndim=3)
    _check_int("num_topk_sum", num_topk_sum, low=1, high=scores.shape[2])
    check_choice("num_topk_sum", num_topk_sum, NUM_TOPK_SUM_CHOICES)
    _check_int("num_topk_groups", num_topk_groups, low=1, high=scores.shape[1])
    best_in_group, _ = torch.sort(scores, dim=-1, descending=True, stable=True)
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
    _check_scores("topk_weights", topk_weights, ndim=2)
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
    _check_indices("group_idx", group_idx)
    _check_int("num_groups", num_groups, low=1)
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
    _check_indices("topk_idx", topk_idx)
    _check_int("num_experts", num_experts, low=1)
    _check_int("num_aux_topk", num_aux_topk, low=1)
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
    _check_indices("indices", indices)
    _check_int("n", n, low=1)
    _check_int("num_ep_ranks", num_ep_ranks, low=1)
    _check_int("num_tp_ranks", num_tp_ranks, low=1)
    _check_int("tp_rank", tp_rank, low=0, high=num_tp_ranks - 1)
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
    _check_indices("group_indices", group_indices)
    _check_int("num_groups", num_groups, low=1)
    _check_index_values("group_indices", group_indices, low=None, high=num_groups)
    num_topk = group_indices.shape[1]
    # earlier[t, i, j]: slot j lies before slot i in the row and holds the same group.
    same = rearrange(group_indices, "t i -> t i 1") == rearrange(group_indices, "t j -> t 1 j")
    before = torch.ones(num_topk, num_topk, dtype=torch.bool, device=group_indices.device).tril(diagonal=-1)
    repeated = (same & before).any(dim=-1) & (group_indices >= 0)
    group_indices.masked_fill_(repeated, -1)
    return group_indices
