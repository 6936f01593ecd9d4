"""The oracle's mutation self-test (oracle/mutation.py), on the CPU: every mutant is a real bug (its
example input shows it), and the oracle kills every mutant of every registered operator on the
quick profile, through the same path as ``tileproof oracle --backend``."""

from __future__ import annotations

import json
import types

import pytest
import torch

from tileproof.oracle import cli, mutation, registry, runner
from tileproof.oracle.mutation import CATALOGUE, KILLED, KNOWN_GAPS, SKIPPED, SURVIVED
from tileproof.oracle.policy import FAIL, same_bytes, structure_mismatch
from tileproof.reference.contract import E2M1_GRID
from tileproof.reference.quant import decode_e2m1

IDS = [m.id for m in CATALOGUE]


def _mutant(mutant_id: str) -> mutation.Mutant:
    (found,) = [m for m in CATALOGUE if m.id == mutant_id]
    return found


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _run_example(mutant: mutation.Mutant, seed: int, planted: bool):
    """(result, the arguments after the call): in-place operators show their effect there."""
    arguments = mutant.example(torch.Generator().manual_seed(seed))
    fn = mutant.apply(mutant.public()) if planted else mutant.public()
    return fn(**arguments), arguments


def _differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(structure_mismatch(a, b)) or not same_bytes(a, b)


# ---------------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------------


def test_catalogue_is_well_formed():
    assert len(IDS) == len(set(IDS)), "mutant ids are unique"
    assert set(KNOWN_GAPS) <= set(IDS)
    for mutant in CATALOGUE:
        assert callable(mutant.public()) and mutant.bug and mutant.name == mutant.name.lower()
    # The bug classes of the issue, each planted at least once.
    names = {m.name for m in CATALOGUE}
    for planted in (
        "e4m3-truncation",  # rounding mode
        "e2m1-truncation",
        "e4m3-unsaturated",  # missing clamp
        "ties-to-larger-index",  # tie rule
        "sf-col-major-unaligned",  # scale layout stride
        "eps-dropped",  # Sinkhorn / RMS eps
        "comb-not-transposed",  # mhc_post's transpose
        "dk-zeroed",  # one gradient zeroed
        "tail-block-unwritten",  # off-by-one tail
        "sf-rounded-down",  # round_sf not rounding up
        "nan-scale-finite",  # NaN turned into a finite scale
    ):
        assert planted in names


@pytest.mark.parametrize("mutant_id", IDS)
def test_every_mutant_changes_its_example(mutant_id, seed):
    mutant = _mutant(mutant_id)
    expected, expected_args = _run_example(mutant, seed, planted=False)
    actual, actual_args = _run_example(mutant, seed, planted=True)
    before, after = _tensors(expected) + _tensors(expected_args), _tensors(actual) + _tensors(actual_args)
    assert len(before) == len(after)
    assert any(_differs(a, b) for a, b in zip(after, before, strict=True)), f"{mutant_id} plants no bug"


def test_a_mutant_wraps_any_twin(seed):
    """The catalogue also mutates optimized functions: a mutant only calls the function it wraps."""
    mutant = _mutant("per_token_cast:tail-block-unwritten")
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(kwargs)
        return mutant.public()(*args, **kwargs)

    arguments = mutant.example(torch.Generator().manual_seed(seed))
    q, sf = mutant.apply(stand_in)(**arguments)
    assert len(calls) == 1
    expected_q, _ = mutant.public()(**arguments)
    assert same_bytes(q[:, :64], expected_q[:, :64]) and bool((q[:, 64:].view(torch.uint8) == 0xFF).all())


def test_truncation_and_tie_mutants_plant_exactly_their_rule(generator):
    """Independent of the mutants' code: truncation never rounds away from zero and moves only the
    values round-to-nearest-even rounded away; ties-away moves only exact ties."""
    x = torch.randn((8, 128), generator=generator)
    x[0, :8] = torch.tensor([0.25, 1.25, 2.5, 5.0, 0.75, 1.75, 3.5, 6.0])  # with amax 6 the multiplier is 1
    x[0, 8:] = 0.0
    arguments = {"x": x, "fmt": "e2m1", "num_per_channels": 16, "round_sf": True}
    reference = _mutant("per_token_cast:e2m1-truncation").public()
    q, _ = reference(**arguments)
    truncated, _ = _mutant("per_token_cast:e2m1-truncation").apply(reference)(**arguments)
    ties_away, _ = _mutant("per_token_cast:e2m1-ties-away").apply(reference)(**arguments)
    exact, rounded, down, away = x[0, :8], decode_e2m1(q)[0, :8], decode_e2m1(truncated), decode_e2m1(ties_away)
    assert rounded.tolist() == [0.0, 1.0, 2.0, 4.0, 1.0, 2.0, 4.0, 6.0]  # nearest, ties to even
    assert away[0, :8].tolist() == [0.5, 1.5, 3.0, 6.0, 1.0, 2.0, 4.0, 6.0]
    assert down[0, :8].tolist() == [0.0, 1.0, 2.0, 4.0, 0.5, 1.5, 3.0, 6.0]
    assert exact.tolist() == [0.25, 1.25, 2.5, 5.0, 0.75, 1.75, 3.5, 6.0]
    # Elsewhere (one scale per 16 values, amax maps to 6): truncation lands on the grid value at or
    # below |y|, never above it.
    scale_rows = x[1:].abs().reshape(7, 8, 16).amax(-1).repeat_interleave(16, dim=1)
    rounded_up = torch.exp2(torch.ceil(torch.log2(scale_rows / 6)))  # round_sf: power-of-two scales
    magnitude = (x[1:] / rounded_up).abs()
    grid = torch.tensor(E2M1_GRID)
    floor_on_grid = grid[(magnitude.unsqueeze(-1) >= grid).sum(-1) - 1]
    assert torch.equal(down[1:].abs(), floor_on_grid)


# ---------------------------------------------------------------------------------------------
# The self-test
# ---------------------------------------------------------------------------------------------


def test_every_mutant_of_a_registered_operator_is_killed():
    registered = [m for m in CATALOGUE if m.op in registry.all_ops() and m.id not in KNOWN_GAPS]
    assert {m.op for m in registered} >= {"per_token_cast", "per_token_cast_back"}
    outcome = mutation.run_mutants(registered)
    survivors = [(r.mutant.id, r.status, r.evidence) for r in outcome.results if r.status != KILLED]
    assert survivors == []
    assert outcome.exit_status == 0
    for family, figures in outcome.families().items():
        assert figures["killed"] == figures["run"] > 0
        assert mutation.family_line(family, figures).startswith(f"{family}: {figures['run']}/{figures['run']}")
    for result in outcome.results:
        assert result.killer and result.status == KILLED and "[" in result.evidence  # the check and its bound


def test_the_per_token_saturation_gap_is_closed(seed):
    """per_token_cast_with_precomputed_sf has cases whose given scales are a quarter of what the data
    needs: a conversion without saturation is killed there, and the reference's own self-check sees
    saturation act; no mutant is a known gap any more."""
    assert KNOWN_GAPS == {}
    gap = _mutant("per_token_cast_with_precomputed_sf:e4m3-unsaturated")
    result = mutation.run_mutant(gap)
    assert result.status == KILLED and result.killer.endswith("/sf2^-2")
    spec = registry.get_op(gap.op)
    case = next(c for c in registry.cases_of(gap.op, "quick") if c.label == result.killer)
    call = spec.build(case, torch.device("cpu"), torch.Generator().manual_seed(seed))
    checks = {c.name: c.status for c in spec.self_check(case, call, spec.split(call(spec.reference())))}
    assert checks["saturation acts"] == checks["reference round trip"] != FAIL


def test_the_block_cast_saturation_gap_is_closed(seed):
    """per_block_cast_with_precomputed_sf has cases whose given scales are a quarter of what the data
    needs: saturation acts there, so a conversion without satfinite is killed, and the case's own
    self-check (the round trip of the clamped source) fails the unsaturated bytes too."""
    gap = _mutant("per_block_cast_with_precomputed_sf:e4m3-unsaturated")
    assert gap.id not in KNOWN_GAPS
    result = mutation.run_mutant(gap)
    assert result.status == KILLED and result.killer.endswith("/sf2^-2")
    spec = registry.get_op(gap.op)
    case = next(c for c in registry.cases_of(gap.op, "quick") if c.label == result.killer)
    call = spec.build(case, torch.device("cpu"), torch.Generator().manual_seed(seed))
    checks = {c.name: c.status for c in spec.self_check(case, call, spec.split(call(spec.reference())))}
    assert checks["saturation acts"] == checks["reference round trip"] != FAIL
    unsaturated = spec.split(call(gap.apply(spec.reference())))
    assert {c.name: c.status for c in spec.self_check(case, call, unsaturated)}["reference round trip"] == FAIL


def test_a_surviving_mutant_fails_the_self_test():
    harmless = mutation.Mutant(
        "per_token_cast", "no-bug", "quant", "plants nothing", lambda fn, bound: mutation._call(fn, bound), dict
    )
    outcome = mutation.run_mutants([harmless], max_cases=2)
    assert outcome.results[0].status == SURVIVED and outcome.exit_status == 1


def test_mutants_of_unregistered_operators_are_skipped():
    ghost = mutation.Mutant("no_such_operator", "x", "quant", "b", lambda fn, bound: None, dict)
    result = mutation.run_mutant(ghost)
    assert result.status == SKIPPED and "not registered" in result.evidence and result.cases_run == 0


def test_a_mutant_set_is_a_backend(seed):
    op = registry.get_op("per_token_cast")
    planted = _mutant("per_token_cast:e4m3-truncation").apply(op.reference())
    twin = runner.backend_twin("mutants", types.SimpleNamespace(per_token_cast=planted))
    case = next(c for c in registry.cases_of(op.name, "quick") if c.params.fmt == "e4m3" and c.params.tokens > 1)
    built = runner.run("quick", patterns=[case.label], timing=False, twin=twin)
    assert built.exit_status == 1 and built.compared
    assert {c.name: c.status for c in built.results[0].checks}["q"] == FAIL


# ---------------------------------------------------------------------------------------------
# tileproof mutate
# ---------------------------------------------------------------------------------------------


def test_mutate_command(tmp_path, capsys):
    path = tmp_path / "mutation.json"
    argv = ["mutate", "--op", "per_token_cast", "--mutant", "*:e4m3-*", "--json", str(path)]
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "quant: 2/2 mutants killed" in out and "2/2 mutants killed (exit status 0)" in out
    data = json.loads(path.read_text())
    assert data["schema"] == mutation.SCHEMA
    assert data["summary"]["families"]["quant"] == {"killed": 2, "run": 2, "skipped": 0, "known_gaps": 0}
    assert {m["id"] for m in data["mutants"]} == {"per_token_cast:e4m3-truncation", "per_token_cast:e4m3-clamp-240"}
    assert all(m["status"] == KILLED and m["killed_by"] for m in data["mutants"])

    assert cli.main(["mutate", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(CATALOGUE)
    assert cli.main(["mutate", "--mutant", "no-such-mutant"]) == 2
    assert cli.main(["mutate", "--op", "no_such_op"]) == 2
    if not torch.cuda.is_available():
        assert cli.main(["mutate", "--target", "optimized"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
