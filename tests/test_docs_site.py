"""CPU tests of the documentation site's generated pages (``tileproof.oracle.docs_site``): the
Operators page against the registry, the Latest H200 results page against docs/results/, and the
link rewriting the mkdocs hook applies. Only the full site build needs mkdocs; it skips without."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tileproof.oracle import docs_site, registry

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = REPO_ROOT / "docs"
RESULTS = DOCS / docs_site.RESULTS_DIR


def _table_rows(markdown: str) -> list[list[str]]:
    """The cells of every table row of ``markdown`` (header and separator rows included)."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        for line in markdown.splitlines()
        if line.startswith("| ")
    ]


@pytest.fixture(scope="module")
def operators_page() -> str:
    return docs_site.operators_page(DOCS)


def test_the_operator_table_lists_every_registered_operator_once(operators_page):
    listed = [row[0] for row in _table_rows(operators_page) if row[0].startswith("`")]
    assert listed == [f"`{name}`" for name in registry.all_ops()]


def test_each_operator_row_states_family_twin_and_case_counts(operators_page):
    rows = {row[0].strip("`"): row for row in _table_rows(operators_page) if row[0].startswith("`")}
    for name, spec in registry.all_ops().items():
        _, family, twin, quick, full, benchmarks, documentation = rows[name]
        assert family == spec.family
        assert twin in ("yes", "no (reference only)") or twin.startswith("fails to import")
        assert int(quick) == len(registry.cases_of(name, "quick"))
        assert int(full) == len(registry.cases_of(name, "full"))
        assert int(benchmarks) == sum(case.benchmark for case in registry.cases_of(name, "full"))
        assert documentation.startswith("[") and ".md" in documentation, name


def test_operators_named_in_a_heading_link_to_its_anchor(operators_page):
    # moe.md has one section per router operator; the anchor is the one Markdown's toc gives it.
    assert "[moe.md § topk_gate](moe.md#topk_gate)" in operators_page
    assert "(moe.md#expand_to_fused-expand_to_fused_with_sf-reduce_fused)" in operators_page


def test_heading_anchors_follow_the_toc_extension():
    markdown = "# Title\n\n## `per_block_cast`: 2-D blocks\n\n```python\n# not a heading\n```\n\n## Title\n"
    assert docs_site.heading_anchors(markdown) == [
        ("Title", "title"),
        ("per_block_cast: 2-D blocks", "per_block_cast-2-d-blocks"),
        ("Title", "title_1"),
    ]


def test_the_results_page_embeds_the_benchmark_report():
    page = docs_site.results_page(RESULTS)
    report = (RESULTS / f"{docs_site.LATEST_REPORT}.md").read_text(encoding="utf-8")
    table_lines = [line for line in report.splitlines() if line.startswith("| ")]
    assert table_lines and all(line in page.splitlines() for line in table_lines)
    environment = json.loads((RESULTS / f"{docs_site.LATEST_REPORT}.json").read_text())["environment"]
    assert environment["git_revision"][:7] in page.split("\n## Every committed report")[0]
    # One title: the report's own headings sit one level below the page's.
    assert [line for line in page.splitlines() if line.startswith("# ")] == ["# Latest H200 results"]


def test_the_results_page_lists_every_committed_report_with_its_revision_and_date():
    listing = docs_site.results_page(RESULTS).split("\n## Every committed report")[1]
    reports = sorted([*RESULTS.glob("*.json"), *RESULTS.glob("*.json.gz")])
    assert any(report.name.endswith(".json.gz") for report in reports)  # the large ones are gzipped
    for report_json in reports:
        gzipped = report_json.name.endswith(".json.gz")
        data = json.loads(gzip.decompress(report_json.read_bytes()) if gzipped else report_json.read_text())
        if "environment" not in data:
            continue  # not an oracle report (the pytest-benchmark run its report links)
        environment = data["environment"]
        stem = report_json.name.removesuffix(".gz").removesuffix(".json")
        (row,) = [row for row in _table_rows(listing) if row[0].startswith(f"[{stem}]")]
        assert row[1] == environment["date_utc"] and environment["git_revision"][:7] in row[2]


def test_reports_are_listed_newest_first_with_their_outcome(tmp_path):
    def write(stem: str, date: str, summary: dict) -> None:
        environment = {"date_utc": date, "git_revision": "0123456789abcdef", "profile": "full", "gpu": "NVIDIA H200"}
        (tmp_path / f"{stem}.json").write_text(json.dumps({"environment": environment, "summary": summary}))

    write("older", "2026-01-01T00:00:00Z", {"cases": 3, "pass": 2, "fail": 1})
    write("newer", "2026-02-01T00:00:00Z", {"killed": 4, "run": 4, "skipped": 1})
    write("zipped", "2026-01-15T00:00:00Z", {"cases": 5, "pass": 5})
    zipped = tmp_path / "zipped.json"
    (tmp_path / "zipped.json.gz").write_bytes(gzip.compress(zipped.read_bytes()))
    zipped.unlink()
    (tmp_path / "newer.md").write_text("# report\n")
    (tmp_path / "zipped.md").write_text("# report\n")
    (tmp_path / "gpu.log").write_text("log\n")
    rows = docs_site.report_rows(tmp_path)
    assert [row["report"] for row in rows] == [
        "[newer](newer.md)",
        "[zipped](zipped.md)",
        "[older](older.json)",
        "[gpu](gpu.log)",
    ]
    newer, zipped, older, _ = rows
    assert newer["outcome"] == "4 of 4 planted bugs caught (1 skipped)"
    assert zipped["outcome"] == "5 of 5 cases pass"
    assert zipped["files"] == "[json.gz](zipped.json.gz), [md](zipped.md)"
    assert older["outcome"] == "2 of 3 cases pass, 1 fail"
    assert older["revision"] == "`0123456`"
    with pytest.raises(FileNotFoundError, match="embeds it"):
        docs_site.results_page(tmp_path, latest="missing")


def test_links_are_rewritten_for_the_site():
    markdown = (
        "The [README](../README.md), [results](results/), [a report](results/a.md), [web](https://x.org/).\n"
        "```\n[README](../README.md)\n```\n"
    )
    rewritten = docs_site.rewrite_links_for_site(markdown, "index.md", {"results/index.md"})
    assert rewritten.splitlines()[0] == (
        "The README (`README.md` in the repository), [results](results/index.md), [a report](results/a.md), "
        "[web](https://x.org/)."
    )
    assert rewritten.splitlines()[2] == "[README](../README.md)"  # code is left as it is
    assert docs_site.markdown_inside_details("<details><summary>All</summary>") == (
        '<details markdown="1"><summary>All</summary>'
    )


def test_the_generated_pages_are_not_committed_files():
    # The hook refuses to build over a committed page of the same name; this says so earlier.
    for path in (docs_site.OPERATORS_PAGE, docs_site.RESULTS_PAGE):
        assert not (DOCS / path).exists(), path


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (pip install .[docs])")
def test_the_site_builds_in_strict_mode(tmp_path):
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "operators" / "index.html").exists()
    assert (tmp_path / "site" / "results" / "index.html").exists()


def test_the_determinism_page_lists_every_operator_with_both_checks_of_its_newest_report():
    page = docs_site.determinism_page(RESULTS)
    rows = {row[0].strip("`"): row for row in _table_rows(page)}
    assert set(registry.all_ops()) <= set(rows)
    for name, (_, runs, grid, report) in ((name, rows[name]) for name in registry.all_ops()):
        assert "differs" not in runs + grid, name  # the committed reports are all green
        if report != "—":
            assert runs.endswith("cases") and grid.endswith("cases"), (name, runs, grid)


def test_the_determinism_page_flags_a_differing_check(tmp_path):
    environment = {"date_utc": "2026-01-01T00:00:00Z", "git_revision": "0123456789abcdef"}
    checks = [{"name": "determinism", "status": "pass"}, {"name": "grid-size independence", "status": "fail"}]
    cases = [{"op": "transpose", "checks": checks}, {"op": "transpose", "checks": checks[:1]}]
    (tmp_path / "run.json").write_text(json.dumps({"environment": environment, "cases": cases}))
    (row,) = [row for row in _table_rows(docs_site.determinism_page(tmp_path)) if row[0] == "`transpose`"]
    assert row[1] == "2 of 2 cases" and row[2] == "0 of 1 cases — **differs**" and "`0123456`" in row[3]
