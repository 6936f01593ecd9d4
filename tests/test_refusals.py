"""The refusal matrix (issue 9): every public entry point × every validation rule, both twins.

The bad calls are derived mechanically from one valid call per operator by
``tileproof.oracle.refusals`` (which says how); each is one test, id
``<entry>-<twin>-<rule>-<argument>``. A bad call must raise ``ValueError`` or ``TypeError`` (the
``type`` rule: ``TypeError``) whose message names the argument; any other exception, or none, fails.
The documented exceptions (``refusals.EXCEPTIONS``) are skipped with their reason. docs/validation.md
is the table of all of them, kept equal to its generator here.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tileproof.optimized import jit
from tileproof.oracle import refusals, registry
from tileproof.oracle.moe import copy_keeping_layout

DOCS = Path(__file__).resolve().parents[1] / "docs"
BAD_CALLS = refusals.bad_calls()
ENTRIES = refusals.entries()
ACCEPTED = (ValueError, TypeError)


def _fresh(value):
    """A copy of the call's tensors (layouts kept): each test gets its own, in-place ops included."""
    if isinstance(value, torch.Tensor):
        return copy_keeping_layout(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(item) for item in value)
    if isinstance(value, dict):
        return {key: _fresh(item) for key, item in value.items()}
    return value


@functools.cache
def _valid_call(entry: refusals.Entry) -> registry.Call:
    return refusals.build_call(entry)


def _call(entry: refusals.Entry) -> registry.Call:
    call = _valid_call(entry)
    return registry.Call(_fresh(call.args), _fresh(call.kwargs))


def _run(fn, twin: str, args, kwargs):
    """The reference directly; the optimized twin under compile_only, building no kernel."""
    if twin == "optimized":
        with jit.compile_only(), jit.outputs_only():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def _params(bad_calls: list[refusals.BadCall]) -> list:
    """One parameter per bad call; a known bug is an expected failure, strict: fixing it fails the
    test until the bug is taken off ``refusals.KNOWN_BUGS``."""
    params = []
    for bad in bad_calls:
        reason = refusals.known_bug(bad)
        marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)] if reason else []
        params.append(pytest.param(bad, id=bad.id, marks=marks))
    return params


@pytest.mark.parametrize("bad", _params(BAD_CALLS))
def test_refusal(bad: refusals.BadCall):
    reason = refusals.expected_exception(bad.entry, bad.rule, bad.argument)
    if reason is not None:
        pytest.skip(f"documented exception: {reason}")
    entry = refusals.entry_of(bad.entry)
    fn = refusals.twin_function(entry, bad.twin)
    call = _call(entry)
    if bad.rule == "device":
        # The valid call as built (CPU tensors), outside compile_only: the launcher must refuse it.
        with pytest.raises(ValueError) as raised:
            fn(*call.args, **call.kwargs)
        message = str(raised.value)
        names = refusals.tensor_arguments(fn, call)
        assert "CUDA" in message and any(refusals.names_argument(message, name) for name in names), (
            f"the message names none of {names}, or not CUDA: {message!r}"
        )
        return
    args, kwargs = refusals.bad_call(fn, call, bad.rule, bad.argument)
    expected = TypeError if bad.rule == "type" else ACCEPTED
    try:
        _run(fn, bad.twin, args, kwargs)
    except expected as error:
        assert refusals.names_argument(str(error), bad.argument), (
            f"{type(error).__name__} does not name {bad.argument!r}: {error}"
        )
    else:
        pytest.fail(f"{bad.id}: the bad call was accepted")


@pytest.mark.parametrize(
    "entry,twin",
    [(entry, twin) for entry in ENTRIES for twin in refusals.TWINS if refusals.twin_function(entry, twin)],
    ids=lambda value: value.name if isinstance(value, refusals.Entry) else value,
)
def test_the_valid_call_is_accepted(entry: refusals.Entry, twin: str):
    """The control: unbroken, the call each refusal is derived from goes through, so a refusal is
    caused by the one broken argument."""
    fn = refusals.twin_function(entry, twin)
    call = _call(entry)
    _run(fn, twin, call.args, call.kwargs)


def test_every_registered_operator_has_an_entry_with_a_valid_call():
    assert {entry.op for entry in ENTRIES} == set(registry.all_ops())
    for entry in ENTRIES:
        assert refusals.valid_case(entry.op) is not None, f"{entry.name}: no quick case with tokens > 0"
        assert any(bad.entry == entry.name for bad in BAD_CALLS), f"{entry.name}: no tensor argument"


def test_every_documented_exception_and_known_bug_applies_to_a_derived_call():
    derived = {(bad.entry, bad.rule, bad.argument) for bad in BAD_CALLS}
    stale = sorted(set(refusals.EXCEPTIONS) - derived)
    assert not stale, f"exceptions that match no derived bad call (renamed or removed?): {stale}"
    derived = {(bad.entry, bad.twin, bad.rule, bad.argument) for bad in BAD_CALLS}
    stale = sorted(set(refusals.KNOWN_BUGS) - derived)
    assert not stale, f"known bugs that match no derived bad call (renamed or removed?): {stale}"


def test_the_bad_call_ids_are_unique():
    ids = [bad.id for bad in BAD_CALLS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    "message,argument,named",
    [
        ("x must be 2-D, got shape (1, 3, 4)", "x", True),
        ("x[0] must be a torch.Tensor, got list", "x[0]", True),
        ("x[0] must be a torch.Tensor, got list", "x", False),
        ("x_block_size must be a pair", "x", False),
        ("max must be positive", "x", False),
        ("weight_hidden.main_grad must have dtype float32", "main_grad", False),
        ("pre_mix_list[1] must be 2-D", "pre_mix_list[1]", True),
        ("pre_mix_list[1] must be 2-D", "pre_mix_list[0]", False),
    ],
)
def test_names_argument_matches_whole_names_only(message, argument, named):
    assert refusals.names_argument(message, argument) is named


def test_the_brace_notation_of_the_table():
    assert refusals._brace(["x"]) == "x"
    assert refusals._brace(["x[0]", "x[1]", "sf"]) == "{x[0],x[1],sf}"
    assert refusals._brace(["a", "l[0]", "l[1]", "l[2]", "m[0]"]) == "{a,l[0…2],m[0]}"


def test_docs_validation_page_is_the_generated_table():
    committed = (DOCS / refusals.PAGE).read_text(encoding="utf-8")
    assert committed == refusals.validation_page(), (
        "docs/validation.md is stale: regenerate it with `python -m tileproof.oracle.refusals > docs/validation.md`"
    )
