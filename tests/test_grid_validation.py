"""Sweeps are checked with the trainer's own parser before anything is submitted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # each test runs the sweep scripts and the trainer's parser

JOBS = ROOT / "jobs"
DIGITS = {
    "RELAYMPI_TASK": "digits",
    "RELAYMPI_WORKERS": "4",
    "RELAYMPI_SEEDS": "0",
    "RELAYMPI_ALPHAS": "0.1",
    "RELAYMPI_MOMENTA": "0",
    "RELAYMPI_LAUNCHER": "local",
}


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYMPI_") and k != "DRY_RUN"}
    env["PYTHONPATH"] = str(ROOT)
    env["RELAYMPI_PYTHON"] = sys.executable
    return {**env, **settings}


def _fake_sbatch(tmp_path: Path) -> tuple[Path, Path]:
    """An sbatch on PATH that only records that it was called."""
    bin_dir, called = tmp_path / "bin", tmp_path / "sbatch-called"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {called}\necho 'Submitted batch job 1'\n")
    (bin_dir / "sbatch").chmod(0o755)
    return bin_dir, called


def _submit(tmp_path: Path, **settings: str) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir, called = _fake_sbatch(tmp_path)
    env = _env(RELAYMPI_RESULTS_DIR=str(tmp_path / "results"), **settings)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        ["bash", str(JOBS / "submit.sh"), "sweep_alpha"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    return proc, called


def test_a_typo_in_the_algorithms_exits_2_before_sbatch(tmp_path: Path) -> None:
    proc, called = _submit(tmp_path, **DIGITS, RELAYMPI_ALGOS="relay foo")
    assert proc.returncode == 2, proc.stderr
    assert "sweep_alpha[1] foo_" in proc.stderr and "unknown algorithm 'foo'" in proc.stderr
    assert not called.exists()


def test_a_data_task_without_its_data_exits_2_before_sbatch(tmp_path: Path) -> None:
    """No RELAYMPI_DATA_DIR: the jobs read the data root's cifar10 folder, which is empty here."""
    root = tmp_path / "data-root"
    root.mkdir()
    proc, called = _submit(
        tmp_path,
        **{**DIGITS, "RELAYMPI_TASK": "cifar10", "RELAYMPI_DATA": str(root)},
        RELAYMPI_ALGOS="relay",
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "python -m relaympi.data fetch cifar10" in proc.stderr
        and "not present and verified" in proc.stderr
    )
    assert not called.exists()


def test_a_combination_the_trainer_refuses_exits_2(tmp_path: Path) -> None:
    proc, called = _submit(tmp_path, **DIGITS, RELAYMPI_ALGOS="relay:ring")
    assert proc.returncode == 2 and "not a tree" in proc.stderr and not called.exists()


def test_a_task_the_batched_backend_cannot_run_exits_2(tmp_path: Path) -> None:
    """AG News (structured inputs) under RELAYMPI_BACKEND=batched: refused before any GPU job
    starts."""
    settings = {
        **DIGITS,
        "RELAYMPI_TASK": "agnews",
        "RELAYMPI_BACKEND": "batched",
        "RELAYMPI_ALLOW_UNVERIFIED_DATA": "1",
        "RELAYMPI_DATA_DIR": str(tmp_path),
        "RELAYMPI_MODEL_DIR": str(tmp_path),
    }
    proc, called = _submit(tmp_path, **settings, RELAYMPI_ALGOS="relay")
    assert proc.returncode == 2, proc.stderr
    assert "--backend batched cannot run task 'agnews'" in proc.stderr and not called.exists()


def test_a_valid_grid_is_submitted(tmp_path: Path) -> None:
    proc, called = _submit(tmp_path, **DIGITS, RELAYMPI_ALGOS="relay dpsgd")
    assert proc.returncode == 0, proc.stderr
    assert called.exists()


def test_dry_run_header_describes_the_actual_settings(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(JOBS / "sweep_alpha.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(DRY_RUN="1", RELAYMPI_RESULTS_DIR=str(tmp_path), **DIGITS, RELAYMPI_ALGOS="relay"),
    )
    assert proc.returncode == 0, proc.stderr
    header = "\n".join(proc.stdout.splitlines()[:2])
    assert (
        "here on task digits with 4 workers" in header
        and "this grid: task digits; workers 4; algorithms relay" in header
    )
