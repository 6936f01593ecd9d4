"""CPU tests of ``tileproof oracle --benchmark-results``: the oracle's reports link a pytest-benchmark
results file (``pytest --benchmark-json``, e.g. of tests/test_gpu_benchmarks.py) and show its medians.
The results file here is synthetic, shaped like pytest-benchmark 5's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tileproof.oracle import cli, report, runner

CASE_LABEL = "per_token_cast/e4m3/C128/bf16/8192x7168/plain"


def _benchmark(name: str, median_seconds: float, extra_info: dict) -> dict:
    """One entry of a pytest-benchmark JSON file (the fields a report reads, and some it does not)."""
    return {
        "group": None,
        "name": name,
        "fullname": f"tests/test_gpu_benchmarks.py::{name}",
        "params": {},
        "param": None,
        "extra_info": extra_info,
        "options": {"disable_gc": False, "timer": "perf_counter"},
        "stats": {"min": median_seconds * 0.9, "median": median_seconds, "mean": median_seconds, "rounds": 10},
    }


def _write_results(path: Path) -> Path:
    data = {
        "machine_info": {"node": "gpu-host", "python_version": "3.12.3"},
        "commit_info": {"id": "0123456789abcdef0123", "dirty": False, "branch": "main"},
        "benchmarks": [
            _benchmark(
                f"test_benchmark_workload[{CASE_LABEL}]",
                48.25e-6,
                {"case": CASE_LABEL, "gpu": "NVIDIA H200", "bytes_moved": 177995776, "gbps": 3689.0},
            ),
            _benchmark("test_something_else", 0.0015, {}),  # no oracle case: listed by its test name
        ],
        "datetime": "2026-12-01T10:00:00.000000+00:00",
        "version": "5.3.1",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _empty_report() -> runner.Report:
    return runner.Report(runner.environment("quick", 0, jit_module=None), "quick", 0, False, False, [], [])


def test_a_results_file_is_read_into_its_medians(tmp_path):
    suite = report.load_benchmark_suite(_write_results(tmp_path / "results.json"))
    assert suite.commit == "0123456789abcdef0123" and suite.date.startswith("2026-12-01")
    assert suite.gpus == ("NVIDIA H200",)
    first, second = suite.benchmarks
    assert first.name == CASE_LABEL and first.median_us == pytest.approx(48.25) and first.gbps == 3689.0
    assert second.name == "test_something_else" and second.median_us == pytest.approx(1500.0) and second.gbps is None


def test_the_markdown_links_the_results_relative_to_the_report(tmp_path):
    suite = report.load_benchmark_suite(_write_results(tmp_path / "results" / "pytest-benchmark-h200.json"))
    text = report.markdown(_empty_report(), suite, tmp_path / "results")
    line = "Benchmark suite results: [pytest-benchmark-h200.json](pytest-benchmark-h200.json)"
    assert line + " (pytest-benchmark; 2 benchmarks, run 2026-12-01T10:00:00" in text
    assert "commit 0123456789ab, on NVIDIA H200)" in text
    assert f"| `{CASE_LABEL}` | 48.2 | 3,689 |" in text
    assert "| `test_something_else` | 1,500.0 | — |" in text
    elsewhere = report.markdown(_empty_report(), suite, tmp_path / "reports")
    assert "[../results/pytest-benchmark-h200.json](../results/pytest-benchmark-h200.json)" in elsewhere
    assert ">>>" not in text  # docs/ markdown is collected for doctests


def test_reports_without_results_have_no_benchmark_section(tmp_path):
    assert "Benchmark suite" not in report.markdown(_empty_report())
    assert "benchmark_suite" not in report.report_dict(_empty_report())


def test_the_json_report_records_the_results(tmp_path):
    suite = report.load_benchmark_suite(_write_results(tmp_path / "bench" / "results.json"))
    report.write_json(_empty_report(), tmp_path / "out" / "oracle.json", suite)
    recorded = json.loads((tmp_path / "out" / "oracle.json").read_text())["benchmark_suite"]
    assert recorded["path"] == "../bench/results.json"
    assert recorded["commit"] == "0123456789abcdef0123"
    assert recorded["benchmarks"][0] == {"name": CASE_LABEL, "median_us": pytest.approx(48.25), "gbps": 3689.0}


@pytest.mark.parametrize(
    "content, why",
    [
        (None, "cannot read"),
        ("not json", "cannot read"),
        (json.dumps({"cases": []}), "not a pytest-benchmark JSON file"),
        (json.dumps({"benchmarks": [{"name": "test_x", "stats": {}}]}), "benchmark 0 has no name or no median"),
    ],
)
def test_a_file_that_is_not_pytest_benchmark_results_is_refused(tmp_path, content, why):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=why):
        report.load_benchmark_suite(path)


def test_cli_links_the_results_from_both_reports(tmp_path, capsys):
    results = _write_results(tmp_path / "results" / "pytest-benchmark.json")
    markdown_path, json_path = tmp_path / "results" / "oracle.md", tmp_path / "oracle.json"
    argv = ["oracle", "--op", "per_token_cast", "--max-cases", "1", "--no-compile", "--no-timing"]
    argv += ["--markdown", str(markdown_path), "--json", str(json_path), "--benchmark-results", str(results)]
    assert cli.main(argv) == 0, capsys.readouterr().out
    assert "Benchmark suite results: [pytest-benchmark.json](pytest-benchmark.json)" in markdown_path.read_text()
    assert json.loads(json_path.read_text())["benchmark_suite"]["path"] == "results/pytest-benchmark.json"


@pytest.mark.parametrize(
    "extra_argv, why",
    [
        (["--markdown", "out.md", "--benchmark-results", "no/such/file.json"], "cannot read the benchmark results"),
        (["--benchmark-results", "results.json"], "give --json or --markdown too"),
    ],
)
def test_cli_refuses_bad_results_before_running(tmp_path, capsys, extra_argv, why):
    _write_results(tmp_path / "results.json")
    extra_argv = [str(tmp_path / word) if word.endswith((".json", ".md")) else word for word in extra_argv]
    assert cli.main(["oracle", "--op", "per_token_cast", *extra_argv]) == 2
    assert why in capsys.readouterr().err
