"""Every command line stays quiet when the reader of its output goes away (`... | head`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, env_for_subprocess

pytestmark = pytest.mark.slow  # a subprocess per command line


def _run_into_closed_pipe(
    cmd: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write hits a closed pipe
    try:
        return subprocess.run(
            cmd,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**env_for_subprocess(), **(env or {})},
            timeout=120,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "cmd",
    [
        [sys.executable, "-m", "relaympi.topology", "social-network", "-n", "32"],
        [sys.executable, "-m", "relaympi.train", "--help"],
        [sys.executable, "-m", "relaympi.report", "--help"],
        [sys.executable, "-m", "jobs.grid", "sweeps"],
        [sys.executable, "-m", "relaympi.data", "check"],
    ],
    ids=["topology", "train-help", "report-help", "grid", "data-check"],
)
def test_closed_pipe_is_not_an_error(cmd) -> None:
    proc = _run_into_closed_pipe(cmd)
    assert (
        proc.returncode == 0 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    ), proc.stderr


def test_dry_run_sweep_into_a_closed_pipe(tmp_path) -> None:
    proc = _run_into_closed_pipe(
        ["bash", "jobs/sweep_alpha.sh"],
        env={
            "DRY_RUN": "1",
            "RELAYMPI_PYTHON": sys.executable,
            "RELAYMPI_TASK": "digits",
            "RELAYMPI_RESULTS": str(tmp_path),
        },
    )
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
