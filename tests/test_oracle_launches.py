"""``tileproof launches``: the kernel launches of the optimized twin against another git revision's,
recorded on the CPU (nothing is built or launched)."""

import subprocess

import pytest

from tileproof.oracle import cli, launches
from tileproof.oracle.runner import REPO_ROOT


def _tree_is_head() -> bool:
    """Whether optimized/ and reference/ are as committed (else the working tree's own edits differ
    from HEAD, as they should)."""
    try:
        changed = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "optimized", "reference"], cwd=REPO_ROOT, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return changed.returncode == 0


as_committed = pytest.mark.skipif(not _tree_is_head(), reason="optimized/ or reference/ differ from HEAD (local edits)")

OPS = ["transpose", "normalize_weight", "top2_sum_gate", "mhc_multilayer_recompute", "get_fused_mapping"]


@as_committed
def test_the_checkout_launches_what_its_own_head_launches():
    """The committed tree against HEAD: every case compares equal, including
    an oracle harness around a launcher (top2_sum_gate's buffer copy), raw addresses as scalars
    (mhc_multilayer_recompute) and sizes read back from the device (get_fused_mapping's sync form,
    stopped at the read on both sides)."""
    count, differences = launches.compare("HEAD", "quick", OPS)
    assert count > 40
    assert differences == []


def test_a_changed_launch_argument_is_reported(monkeypatch):
    from tileproof.optimized import transpose

    # A planted host-side bug: a store width one step narrower than the rows allow.
    original = transpose._alignment
    monkeypatch.setattr(transpose, "_alignment", lambda *counts: max(1, original(*counts) // 2))
    count, differences = launches.compare("HEAD", "quick", ["transpose"])
    assert differences and all(d.label.startswith("transpose/") for d in differences)
    assert all("launches" in d.what for d in differences)


@as_committed
def test_the_command_exits_1_on_a_difference_and_names_the_case(monkeypatch, capsys):
    assert cli.main(["launches", "--base", "HEAD", "--op", "normalize_weight"]) == 0
    assert "launch the same kernels" in capsys.readouterr().out
    from tileproof.optimized.moe import mapping

    monkeypatch.setattr(mapping, "row_vector", lambda num_topk: 1)
    assert cli.main(["launches", "--base", "HEAD", "--op", "normalize_weight"]) == 1
    assert "DIFFERENT normalize_weight/" in capsys.readouterr().out


def test_an_unknown_revision_is_a_usage_error(capsys):
    assert cli.main(["launches", "--base", "no-such-revision-anywhere"]) == 2
    assert "--base no-such-revision-anywhere" in capsys.readouterr().err


@pytest.mark.parametrize("value", [0, -5, True, 3.5])
def test_small_and_non_integer_values_are_not_addresses(value):
    describe = launches._Describer([])
    assert describe.value(value) == value
