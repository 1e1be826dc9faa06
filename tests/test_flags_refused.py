"""Flags that cannot apply, or values that leave nothing to do, are refused: exit 2 and one line
naming the flag."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import bench_report, engines
from relaympi import report, train
from relaympi.config import parse_args
from tests.conftest import ROOT

LOCAL = ["--backend", "local", "--workers", "2", "--steps", "2"]
BATCHED = ["--backend", "batched", "--workers", "2", "--steps", "2"]


def _error_line(err: str) -> str:
    """The one line a refused command prints (usage lines of argparse aside)."""
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# (flags, the flag named, why: a piece of the reason)
TRAIN_CASES = [
    (["--warmup-epochs", "-1"], "--warmup-epochs", ">= 0, got -1"),
    (["--checkpoint-every", "5"], "--checkpoint-every", "without --checkpoint-dir"),
    (["--relay-in-place", *BATCHED], "--relay-in-place", "batched engine"),
    (["--relay-chunk", "1024", *BATCHED], "--relay-chunk", "batched engine"),
    (["--loader-workers", "0"], "--loader-workers", "only --task imagenet"),
    (["--loader-workers", "4", "--task", "quadratics"], "--loader-workers", "not quadratics"),
    (["--drop-prob", "0.1", "--algo", "allreduce"], "--drop-prob", "allreduce"),
    (["--drop-prob", "0.5", "--algo", "isolated"], "--drop-prob", "isolated sends no messages"),
    (["--topology", "chain", "--algo", "isolated"], "--topology", "isolated sends no messages"),
    (["--peer-timeout", "2", "--backend", "mpi"], "--peer-timeout", "needs --on-failure continue"),
    (
        ["--peer-timeout", "2", "--on-failure", "continue", *LOCAL],
        "--peer-timeout",
        "--backend mpi",
    ),
    (["--peer-timeout", "0", "--on-failure", "continue"], "--peer-timeout", "> 0, got 0"),
    (["--peer-timeout", "-1", "--on-failure", "continue"], "--peer-timeout", "> 0, got -1"),
]


@pytest.mark.parametrize(
    "flags, flag, why", TRAIN_CASES, ids=[" ".join(c[0][:2]) for c in TRAIN_CASES]
)
def test_train_refuses_a_flag_that_cannot_apply(tmp_path: Path, capsys, flags, flag, why) -> None:
    base = [] if "--backend" in flags else LOCAL
    out = tmp_path / "run.h5"
    assert train.main([*base, *flags, "--out", str(out)]) == 2
    line = _error_line(capsys.readouterr().err)
    assert flag in line and why in line, line
    assert not out.exists()


@pytest.mark.parametrize(
    "flags",
    [
        ["--warmup-epochs", "0"],
        ["--checkpoint-every", "5", "--checkpoint-dir", "ckpt"],
        ["--relay-in-place", "--relay-chunk", "1024"],  # message passing (local): they apply
        ["--drop-prob", "0", "--algo", "allreduce"],
        ["--drop-prob", "0", "--algo", "isolated", "--topology", "fully-connected"],
        ["--drop-prob", "0.1", "--algo", "dpsgd", "--topology", "ring"],
        ["--loader-workers", "0", "--task", "imagenet"],
    ],
)
def test_the_same_flags_where_they_apply_are_accepted(flags) -> None:
    parse_args([*LOCAL, *flags])


def test_a_run_files_recorded_keys_that_cannot_apply_are_dropped_not_refused(
    tmp_path: Path,
) -> None:
    """--config with a saved config (loader workers on digits, a checkpoint interval): only
    command-line flags are refused."""
    saved = tmp_path / "saved.json"
    saved.write_text(
        '{"task": "digits", "loader_workers": 2, "checkpoint_every": 5, "algo": '
        '"allreduce", "drop_prob": 0.1}'
    )
    cfg = parse_args([*LOCAL, "--config", str(saved)])
    assert (cfg.loader_workers, cfg.checkpoint_every, cfg.drop_prob) == (None, None, 0.0)


def test_report_refuses_an_unknown_split_key_and_lists_the_allowed(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        report.main([str(tmp_path), "--split-by", "nonsense"])
    assert info.value.code == 2
    line = _error_line(capsys.readouterr().err)
    assert "--split-by 'nonsense'" in line and "batch_size" in line and "world_size" in line


def test_report_splits_by_a_config_key(tmp_path: Path, capsys) -> None:
    import numpy as np

    from tests import run_factories as rf

    for batch in (16, 32):
        rf.write_classification_run(
            tmp_path / f"b{batch}.h5", np.full((3, 2), 0.5), batch_size=batch
        )
    assert report.main([str(tmp_path), "--split-by", "batch_size"]) == 0
    out = capsys.readouterr().out
    assert "batch_size=16" in out and "batch_size=32" in out


def test_engines_refuses_zero_steps(monkeypatch, capsys) -> None:
    monkeypatch.setattr(engines, "measure", lambda *a, **k: pytest.fail("a benchmark ran"))
    with pytest.raises(SystemExit) as info:
        engines.main(["--steps", "0"])
    assert info.value.code == 2
    assert "--steps must be >= 1, got 0" in _error_line(capsys.readouterr().err)


def test_bench_report_refuses_zero_runs(monkeypatch, capsys) -> None:
    monkeypatch.setattr(
        bench_report, "write_runs", lambda *a, **k: pytest.fail("runs were written")
    )
    with pytest.raises(SystemExit) as info:
        bench_report.main(["--runs", "0"])
    assert info.value.code == 2
    assert "--runs must be >= 1, got 0" in _error_line(capsys.readouterr().err)


def _clean_env(**settings: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RELAYMPI_", "SLURM_")) and k != "DRY_RUN"
    }
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **settings}


@pytest.mark.slow
def test_sweep_index_past_the_grid_exits_2_naming_its_size() -> None:
    """The default sweep_alpha grid has 90 configurations (its #SBATCH --array=0-89)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "jobs" / "sweep_alpha.sh"), "--index", "99"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _error_line(proc.stderr)
    assert "--index 99 is outside the grid of 90 configurations (indices 0-89)" in line


def test_array_task_past_the_grid_exits_2(monkeypatch, capsys) -> None:
    from jobs import grid

    for name in [k for k in os.environ if k.startswith(("RELAYMPI_", "SLURM_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "90")
    assert grid.main(["run", "sweep_alpha"]) == 2
    assert "SLURM_ARRAY_TASK_ID 90 is outside the grid of 90 configurations" in _error_line(
        capsys.readouterr().err
    )
