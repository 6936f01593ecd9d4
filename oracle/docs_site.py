"""The documentation site's generated pages, written into each build and never into docs/.

``generated_pages`` returns, by path inside the site's sources, an "Operators" page (one row per
registered operator, from the registry itself, so the table cannot drift from what the oracle runs)
a "Latest H200 results" page (the newest timing report from docs/results/ embedded, then every
committed report with the revision and date its JSON recorded) and a "Determinism" page (per
operator, the two determinism checks of the newest committed report that ran them). ``rewrite_links_for_site`` makes
the pages' links that work on GitHub but not in a site built from docs/ alone (to files outside
docs/, to folders) valid there. The mkdocs hook ``docs/hooks.py`` calls these; none of them needs
mkdocs, so they are tested on the CPU (tests/test_docs_site.py).
"""

from __future__ import annotations

import gzip
import json
import posixpath
import re
import unicodedata
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

from .registry import OpSpec, all_ops

OPERATORS_PAGE = "operators.md"
DETERMINISM_PAGE = "determinism.md"
RESULTS_DIR = "results"
# The results folder's index, so that the pages' existing links to "results/" land on it.
RESULTS_PAGE = f"{RESULTS_DIR}/index.md"
LATEST_REPORT = "benchmarks-h200"

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")
_URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def generated_pages(docs_dir: Path, ops: Mapping[str, OpSpec] | None = None) -> dict[str, str]:
    """Every generated page's Markdown, by its path relative to ``docs_dir`` (POSIX separators)."""
    docs_dir = Path(docs_dir)
    return {
        OPERATORS_PAGE: operators_page(docs_dir, ops),
        RESULTS_PAGE: results_page(docs_dir / RESULTS_DIR),
        DETERMINISM_PAGE: determinism_page(docs_dir / RESULTS_DIR, ops),
    }


# --- Markdown helpers ---------------------------------------------------------------------------


def _lines_outside_fences(markdown: str) -> Iterator[tuple[int, str, bool]]:
    """(index, line, inside a fenced code block) for every line; fence lines count as inside, so
    that "#" comments and link-like text in code are never taken for headings or links."""
    fence = None
    for index, line in enumerate(markdown.split("\n")):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            yield index, line, True
        elif fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
            yield index, line, True
        else:
            yield index, line, False


def _plain_heading_text(text: str) -> str:
    """A heading's text as Markdown renders it, for slugs: links keep their text, code loses its
    backticks, emphasis markers go."""
    text = _INLINE_LINK.sub(r"\1", text)
    return re.sub(r"[`*]", "", text)


def slugify(text: str) -> str:
    """The anchor Python-Markdown's ``toc`` extension gives a heading (its default ``slugify``, with
    "-"), repeated here so that links into pages are computed without importing Markdown."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def heading_anchors(markdown: str) -> list[tuple[str, str]]:
    """(plain text, anchor) of every heading, in order, with ``toc``'s "_1", "_2" suffixes for
    repeated anchors."""
    anchors: list[tuple[str, str]] = []
    taken: set[str] = set()
    for _, line, in_code in _lines_outside_fences(markdown):
        match = None if in_code else _HEADING.match(line)
        if match is None:
            continue
        text = _plain_heading_text(match.group(2))
        anchor = slugify(text)
        if anchor in taken or not anchor:
            base, count = anchor, 0
            suffixed = re.match(r"^(.*)_([0-9]+)$", anchor)
            if suffixed:
                base, count = suffixed.group(1), int(suffixed.group(2))
            count += 1
            while f"{base}_{count}" in taken:
                count += 1
            anchor = f"{base}_{count}"
        taken.add(anchor)
        anchors.append((text, anchor))
    return anchors


def demote_headings(markdown: str) -> str:
    """Every heading one level down (a level-6 heading stays), so that an embedded report's title
    sits under the embedding page's own."""
    lines = markdown.split("\n")
    for index, line, in_code in _lines_outside_fences(markdown):
        if not in_code and _HEADING.match(line) and not line.startswith("######"):
            lines[index] = "#" + line
    return "\n".join(lines)


def rewrite_links_for_site(markdown: str, page_path: str, site_pages: Collection[str] = ()) -> str:
    """The links of the page at ``page_path`` (relative to docs/), made valid in the site.

    A link whose target lies outside docs/ (such as ``../README.md``) becomes its text followed by
    the repository path in code: the site has no such file, and naming no particular host keeps the
    site valid for any copy. A link to a folder (``results/``) whose ``index.md`` is among
    ``site_pages`` points at that page: GitHub lists the folder, and mkdocs only resolves links to
    pages, so left as it is the link would break on pages not at the site's top.
    """

    def replace(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        if _URL_SCHEME.match(target) or target.startswith(("#", "/")):
            return match.group(0)
        path, hash_mark, fragment = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page_path), path))
        if resolved == ".." or resolved.startswith("../"):
            return f"{text} (`{posixpath.relpath(resolved, '..')}` in the repository)"
        if path.endswith("/") and posixpath.join(resolved, "index.md") in site_pages:
            return f"[{text}]({path}index.md{hash_mark}{fragment})"
        return match.group(0)

    lines = markdown.split("\n")
    for index, line, in_code in _lines_outside_fences(markdown):
        if not in_code:
            lines[index] = _INLINE_LINK.sub(replace, line)
    return "\n".join(lines)


def markdown_inside_details(markdown: str) -> str:
    """``<details>`` blocks (the reports' case lists) marked ``markdown="1"``: GitHub renders the
    Markdown inside them, Python-Markdown (with ``md_in_html``) only when asked to."""
    lines = markdown.split("\n")
    for index, line, in_code in _lines_outside_fences(markdown):
        if not in_code:
            lines[index] = re.sub(r"<details>", '<details markdown="1">', line)
    return "\n".join(lines)


def _cell(text: object) -> str:
    # A "|" inside a cell would end it.
    return str(text).replace("|", "\\|")


# --- the Operators page -------------------------------------------------------------------------


def twin_status(spec: OpSpec) -> str:
    """Whether the operator has an optimized twin, as the oracle finds it."""
    try:
        twin = spec.optimized()
    except Exception as error:  # a twin that exists but cannot be imported is shown, not hidden
        return f"fails to import ({type(error).__name__})"
    return "yes" if twin is not None else "no (reference only)"


def operator_sections(docs_dir: Path, names: list[str]) -> dict[str, tuple[str, str]]:
    """For each operator named in a heading of a top-level docs page (as a whole word), the first
    such heading as (its text, the link ``page.md#anchor``), pages taken in name order."""
    sections: dict[str, tuple[str, str]] = {}
    for page in sorted(Path(docs_dir).glob("*.md")):
        for text, anchor in heading_anchors(page.read_text(encoding="utf-8")):
            for name in names:
                if name not in sections and re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text):
                    sections[name] = (text, f"{page.name}#{anchor}")
    return sections


def operators_page(docs_dir: Path, ops: Mapping[str, OpSpec] | None = None) -> str:
    """The Operators page: one row per registered operator, in registration order."""
    docs_dir = Path(docs_dir)
    ops = all_ops() if ops is None else ops
    sections = operator_sections(docs_dir, list(ops))
    rows = []
    with_twin = 0
    for name, spec in ops.items():
        status = twin_status(spec)
        with_twin += status == "yes"
        full = spec.cases("full")
        benchmarks = sum(case.benchmark for case in full)
        if name in sections:
            heading, link = sections[name]
            docs = f"[{link.split('#')[0]} § {heading}]({link})"
        elif (docs_dir / f"{spec.family}.md").exists():
            docs = f"[{spec.family}.md]({spec.family}.md)"
        else:
            docs = "—"
        cells = [f"`{name}`", spec.family, status, len(spec.cases("quick")), len(full), benchmarks, docs]
        rows.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    families = list(dict.fromkeys(spec.family for spec in ops.values()))
    return "\n".join(
        [
            "# Operators",
            "",
            f"{len(ops)} operators in {len(families)} families ({', '.join(families)}), {with_twin} with an "
            "optimized twin. Generated from the oracle's registry (`tileproof.oracle.registry.all_ops()`) "
            "when the site is built. Cases: how many configurations the oracle runs in each profile "
            "(`quick` for CI, `full` for the GPU); benchmarks: the named workloads among the `full` "
            "cases, always timed on a GPU. See [the oracle](oracle.md) for what every case checks.",
            "",
            "| operator | family | optimized twin | quick cases | full cases | benchmarks | documentation |",
            "| --- | --- | --- | ---: | ---: | ---: | --- |",
            *rows,
            "",
        ]
    )


# --- the Latest H200 results page ---------------------------------------------------------------


# Large JSON reports are committed gzipped (``NAME.json.gz``, the tool's bytes inside): the GPU runs
# carry the working tree, whose size is limited. Both forms are read alike.
GZIPPED_JSON = ".json.gz"


def _stem_and_kind(path: Path) -> tuple[str, str]:
    """A results file's report stem and kind: ``("a", ".json.gz")`` for ``a.json.gz``, else (stem, suffix)."""
    if path.name.endswith(GZIPPED_JSON):
        return path.name[: -len(GZIPPED_JSON)], GZIPPED_JSON
    return path.stem, path.suffix


def _report_json(results_dir: Path, stem: str) -> Path:
    """The JSON file of report ``stem``: ``stem.json``, or ``stem.json.gz`` when only that exists."""
    plain = Path(results_dir) / f"{stem}.json"
    gzipped = Path(results_dir) / f"{stem}{GZIPPED_JSON}"
    return gzipped if gzipped.exists() and not plain.exists() else plain


def _load_json(path: Path):
    """A JSON file's data, gunzipped first for ``.json.gz``; OSError / ValueError when unreadable."""
    if path.name.endswith(GZIPPED_JSON):
        with gzip.open(path, "rt", encoding="utf-8") as stream:
            return json.load(stream)
    return json.loads(path.read_text(encoding="utf-8"))


def _environment(report_json: Path) -> tuple[dict, dict]:
    """The (environment, summary) a JSON report recorded; empty for a file that is not one."""
    try:
        data = _load_json(report_json)
    except (OSError, ValueError, EOFError):
        return {}, {}
    if not isinstance(data, dict):
        return {}, {}
    return data.get("environment") or {}, data.get("summary") or {}


def _revision(environment: dict) -> str:
    revision = environment.get("git_revision")
    if not revision:
        return "—"
    # Reports spell a revision short or in full; seven digits are enough to find it.
    text = f"`{revision[:7]}`"
    return text + " (with uncommitted changes)" if environment.get("git_dirty") else text


def _outcome(summary: dict) -> str:
    """One line of a report's summary: an oracle run's verdicts or a mutation run's kills."""
    if "cases" in summary:
        words = [f"{summary.get('pass', 0)} of {summary['cases']} cases pass"]
        for verdict in ("fail", "error", "reference_only"):
            if summary.get(verdict):
                words.append(f"{summary[verdict]} {verdict.replace('_', ' ')}")
        return ", ".join(words)
    if "killed" in summary:
        text = f"{summary['killed']} of {summary.get('run', 0)} planted bugs caught"
        return text + (f" ({summary['skipped']} skipped)" if summary.get("skipped") else "")
    return "—"


def report_rows(results_dir: Path) -> list[dict[str, str]]:
    """One entry per committed report (the files sharing a stem), newest first; reports without a
    recorded date (plain logs) last, by name."""
    results_dir = Path(results_dir)
    by_stem: dict[str, list[Path]] = {}
    for path in sorted(results_dir.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            by_stem.setdefault(_stem_and_kind(path)[0], []).append(path)
    rows = []
    for stem, paths in by_stem.items():
        kinds = {_stem_and_kind(path)[1]: path for path in paths}
        report_json = kinds.get(".json") or kinds.get(GZIPPED_JSON)
        environment, summary = _environment(report_json) if report_json else ({}, {})
        main = kinds.get(".md") or report_json or paths[0]
        rows.append(
            {
                "report": f"[{stem}]({main.name})",
                "date": environment.get("date_utc") or "",
                "revision": _revision(environment),
                "profile": environment.get("profile") or "—",
                "gpu": environment.get("gpu") or "—",
                "outcome": _outcome(summary),
                "files": ", ".join(f"[{_stem_and_kind(path)[1].lstrip('.')}]({path.name})" for path in paths),
            }
        )
    dated = sorted((row for row in rows if row["date"]), key=lambda row: row["date"], reverse=True)
    return dated + [row for row in rows if not row["date"]]


def results_page(results_dir: Path, latest: str = LATEST_REPORT) -> str:
    """The Latest H200 results page: the ``latest`` report embedded, then every committed report."""
    results_dir = Path(results_dir)
    latest_markdown = results_dir / f"{latest}.md"
    if not latest_markdown.exists():
        raise FileNotFoundError(f"the latest report {latest_markdown} is missing: the results page embeds it")
    environment, _ = _environment(_report_json(results_dir, latest))
    measured = ", ".join(
        part
        for part in (
            environment.get("gpu"),
            f"revision {_revision(environment)}" if environment.get("git_revision") else None,
            environment.get("date_utc"),
        )
        if part
    )
    table = [
        "| report | date (UTC) | revision | profile | GPU | outcome | files |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report_rows(results_dir):
        cells = [row[key] for key in ("report", "date", "revision", "profile", "gpu", "outcome", "files")]
        table.append("| " + " | ".join(_cell(cell or "—") for cell in cells) + " |")
    return "\n".join(
        [
            "# Latest H200 results",
            "",
            f"The newest timing report, [{latest}]({latest}.md)" + (f" ({measured})" if measured else "") + ", "
            "embedded below as committed in `docs/results/`; every committed report is listed "
            "[at the end](#every-committed-report).",
            "",
            demote_headings(latest_markdown.read_text(encoding="utf-8").strip()),
            "",
            "## Every committed report",
            "",
            "Newest first, with the revision and date each report's JSON recorded (logs have none).",
            "",
            *table,
            "",
        ]
    )


# --- the Determinism page -----------------------------------------------------------------------

# The oracle's two checks of an optimized result's reproducibility (oracle/runner.py).
RUN_CHECK = "determinism"
GRID_CHECK = "grid-size independence"


def determinism_rows(results_dir: Path, ops: Mapping[str, OpSpec] | None = None) -> list[dict[str, str]]:
    """Per registered operator: the newest committed report whose cases ran the grid
    check (else the newest that ran the run check), and that report's pass counts of both checks."""
    ops = all_ops() if ops is None else ops
    newest: dict[str, tuple[str, str, dict[str, list[int]]]] = {}  # op -> (date, stem, check -> [pass, cases])
    reports = sorted([*Path(results_dir).glob("*.json"), *Path(results_dir).glob(f"*{GZIPPED_JSON}")])
    for report_json in reports:
        try:
            data = _load_json(report_json)
        except (OSError, ValueError, EOFError):
            continue
        if not isinstance(data, dict) or "environment" not in data or not isinstance(data.get("cases"), list):
            continue
        date = data["environment"].get("date_utc") or ""
        counts: dict[str, dict[str, list[int]]] = {}
        for case in data["cases"]:
            for check in case.get("checks", []):
                if check.get("name") in (RUN_CHECK, GRID_CHECK):
                    tally = counts.setdefault(case["op"], {}).setdefault(check["name"], [0, 0])
                    tally[0] += check.get("status") == "pass"
                    tally[1] += 1
        for op, checks in counts.items():
            rank = (GRID_CHECK in checks, date)
            held = newest.get(op)
            if held is None or rank > (GRID_CHECK in held[2], held[0]):
                newest[op] = (date, _stem_and_kind(report_json)[0], checks)
    rows = []
    for name in ops:
        if name not in newest:
            rows.append({"operator": f"`{name}`", "runs": "not yet run", "grid": "not yet run", "report": "—"})
            continue
        date, stem, checks = newest[name]
        environment, _ = _environment(_report_json(results_dir, stem))

        def tally(check: str, checks=checks) -> str:
            if check not in checks:
                return "not in this report"
            passed, cases = checks[check]
            return f"{passed} of {cases} cases" + ("" if passed == cases else " — **differs**")

        rows.append(
            {
                "operator": f"`{name}`",
                "runs": tally(RUN_CHECK),
                "grid": tally(GRID_CHECK),
                "report": f"[{stem}]({RESULTS_DIR}/{stem}.md), {_revision(environment)}, {date or '—'}",
            }
        )
    return rows


def determinism_page(results_dir: Path, ops: Mapping[str, OpSpec] | None = None) -> str:
    """The Determinism page: how the kernels stay reproducible, and the evidence per operator."""
    table = [
        "| operator | two runs, same bytes | ≤ 114 SMs vs all 132, same bytes | report, revision, date (UTC) |",
        "| --- | --- | --- | --- |",
    ]
    for row in determinism_rows(results_dir, ops):
        cells = [row[key] for key in ("operator", "runs", "grid", "report")]
        table.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(
        [
            "# Determinism",
            "",
            "Every optimized operator gives the same bytes on every run and on any number of SMs. By "
            "construction: no floating-point atomics (each sum has one owner and a fixed order: warp "
            "butterflies in lane order, then warps in index order, then blocks in index order); integer "
            "atomics only where the result does not depend on their order (`clamped_count`'s sums, the "
            "lowest failing position of `per_block_cast_lossless` by `atomicMin`, and warp-private "
            "counters that `get_fused_mapping` updates in a fixed order, so each expert's tokens come "
            "in token order, not in order of arrival); and no grid that depends on the SM count changes "
            "which thread sums what.",
            "",
            "The oracle checks it on the GPU for every case it runs: the optimized call twice on the "
            "same inputs (*two runs*), and once more with `TILEPROOF_SM_LIMIT=114` (the H100 PCIe's "
            "SM count: kernels that size their grid by the SM count get a smaller one) against the run "
            "on all SMs (*≤ 114 SMs*; the full profile's default, `--sm-limit`). Both compare raw "
            "bytes, floating outputs included. The table gives, per operator, the newest committed "
            "report that ran both checks; a kernel changed after that revision is re-checked by the "
            "next report. Exceptions: none.",
            "",
            *table,
            "",
        ]
    )
