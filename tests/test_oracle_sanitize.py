"""``tileproof sanitize`` (oracle/sanitize.py): the command line it builds, its planted bugs, and
its refusal without compute-sanitizer. The sanitizer itself runs on the H200 (docs/results/)."""

from __future__ import annotations

import pytest

from tileproof.oracle import cli, sanitize


def test_every_run_instruments_only_tilelang_kernels_and_fails_on_an_error():
    command = sanitize.sanitizer_command("racecheck")
    assert command[:3] == ["compute-sanitizer", "--tool", "racecheck"]
    assert command[command.index("--kernel-name") + 1] == "kns=kernel_kernel"
    assert command[command.index("--error-exitcode") + 1] == str(sanitize.ERROR_EXIT_CODE)
    assert "--log-file" not in command


def test_the_sanitizer_sees_every_allocation_on_its_own():
    assert sanitize.sanitizer_environment()["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"


@pytest.mark.parametrize(
    "log, summary",
    [
        ("========= ERROR SUMMARY: 0 errors\n", "ERROR SUMMARY: 0 errors"),
        ("x\n========= ERROR SUMMARY: 3 errors\n", "ERROR SUMMARY: 3 errors"),
        (
            "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n",
            "RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)",
        ),
        ("Traceback ...\n", "(no summary line: the sanitizer did not finish)"),
    ],
)
def test_summary_line(log, summary):
    assert sanitize._summary_line(log) == summary


def test_without_compute_sanitizer_the_command_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sanitize.shutil, "which", lambda name: None)
    assert cli.main(["sanitize", "--log", str(tmp_path / "log"), "--", "--op", "topk_gate"]) == 2
    assert "compute-sanitizer is not on PATH" in capsys.readouterr().err


def test_oracle_arguments_pass_through(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(sanitize, "sanitize", lambda tool, args, log, markdown: seen.update(tool=tool, args=args) or 0)
    cli.main(["sanitize", "--tool", "racecheck", "--log", str(tmp_path / "l"), "--", "--profile", "quick", "--op", "x"])
    assert seen == {"tool": "racecheck", "args": ["--profile", "quick", "--op", "x"]}


@pytest.mark.compile
@pytest.mark.parametrize("tool", sanitize.TOOLS)
def test_the_planted_bugs_keep_their_defect(tool, monkeypatch):
    """TileLang guards out-of-bounds stores and inserts barriers on its own; the plants switch
    both off. If a TileLang update brought a guard back, the plant would stop proving anything."""
    import tilelang

    compile_for_cpu = tilelang.compile
    monkeypatch.setattr(
        tilelang, "compile", lambda f, **kw: compile_for_cpu(f, target={"kind": "cuda", "arch": "sm_90a"}, **kw)
    )
    source = sanitize._planted_kernel(tool).get_kernel_source()
    body = source[source.rindex("kernel_kernel(") :]
    if tool == "memcheck":
        assert "x[(((int)threadIdx.x) + 240)] =" in body and "if" not in body
    else:
        assert "staged[(127 - ((int)threadIdx.x))]" in body and "__syncthreads" not in body


def test_summary_page_from_a_stand_in_sanitizer(monkeypatch, tmp_path):
    """The whole command with ``subprocess.run`` standing in for compute-sanitizer: the plant is
    caught (its exit code), the oracle's run is clean, and the summary says both."""
    log, markdown = tmp_path / "memcheck.log", tmp_path / "memcheck.md"

    class Finished:
        def __init__(self, returncode, stdout=""):
            self.returncode, self.stdout, self.stderr = returncode, stdout, ""

    def run(command, **kwargs):
        if "--plant" in command:
            return Finished(sanitize.ERROR_EXIT_CODE, "========= ERROR SUMMARY: 18 errors\n")
        if command[0] == "compute-sanitizer" and "--log-file" in command:
            log.write_text("========= ERROR SUMMARY: 0 errors\n")
            return Finished(0)
        return Finished(0, "Version 2025.3.1.0\n")

    monkeypatch.setattr(sanitize.shutil, "which", lambda name: "/usr/bin/compute-sanitizer")
    monkeypatch.setattr(sanitize.subprocess, "run", run)
    assert sanitize.sanitize("memcheck", ["--op", "topk_gate"], log, markdown) == 0
    page = markdown.read_text()
    assert "caught: ERROR SUMMARY: 18 errors" in page
    assert "**ERROR SUMMARY: 0 errors**" in page and "Version 2025.3.1.0" in page
    assert "tileproof oracle --no-timing --op topk_gate" in page
