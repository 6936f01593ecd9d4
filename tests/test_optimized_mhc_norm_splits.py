"""The tensor-core norm-fn backward's token splits (``tileproof.optimized.mhc_norm._grad_mma_splits``):
every split holds token tiles and together they hold them all, the count depends on the shape alone
(not on the SM count the oracle limits with ``TILEPROOF_SM_LIMIT``: dfn's summation order, so its
bits, must not change with the GPU), and at the shapes of the H200 sweep the rule picks the counts
that measured fastest there (docs/results/norm-grad-splits-h200-sweep.json and
norm-grad-fp32-staged-h200-sweep.json): a change to the rule's constants must be measured again."""

import math

import pytest

from tileproof.optimized import mhc_norm
from tileproof.optimized.device import SM_LIMIT_ENV

N = 4


def _splits(tokens: int, hidden: int) -> tuple[int, int]:
    return mhc_norm._grad_mma_splits(tokens, N * hidden, mhc_norm.GRAD_MMA_SCHEDULE["min_blocks"])


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 130, 4001, 8192, 65537])
@pytest.mark.parametrize("hidden", [32, 64, 1280, 2560, 4096, 7168, 16384])
def test_every_split_holds_tiles_and_all_tiles_are_held(tokens, hidden):
    splits, per_split = _splits(tokens, hidden)
    tiles = math.ceil(tokens / mhc_norm.MMA_TOKENS)
    assert 1 <= splits <= tiles
    assert (splits - 1) * per_split < tiles <= splits * per_split


def test_the_count_ignores_the_sm_limit(monkeypatch):
    expected = {shape: _splits(*shape) for shape in [(8192, 7168), (4001, 1280), (130, 64)]}
    monkeypatch.setenv(SM_LIMIT_ENV, "114")
    mhc_norm._fewest_filling_splits.cache_clear()
    try:
        assert {shape: _splits(*shape) for shape in expected} == expected
    finally:
        mhc_norm._fewest_filling_splits.cache_clear()


# (tokens, hidden) -> the split count that measured fastest on the H200 (the staged fp32 store and the
# addend's stage-buffer store; within 1.5 % where two counts were that close).
MEASURED_BEST = {
    (8192, 7168): 2,
    (4001, 7168): 2,  # 1 split 1.4 % faster with the addend
    (8192, 4096): 2,
    (4001, 4096): 2,
    (8192, 2560): 3,
    (4001, 2560): 3,
    (8192, 1280): 6,
    (4001, 1280): 6,
}


@pytest.mark.parametrize(("tokens", "hidden"), list(MEASURED_BEST))
def test_the_rule_picks_the_sweeps_fastest_counts(tokens, hidden):
    assert _splits(tokens, hidden)[0] == MEASURED_BEST[tokens, hidden]
