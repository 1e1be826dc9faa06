"""The report tells quadratics problems apart by the problem itself: runs on one problem share a
table whether they generated it or read it from a problem file, and a rerun is a duplicate."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from relaympi import report
from relaympi.config import ConfigError, RunConfig
from relaympi.report.summary import ReportSettings
from relaympi.report.tables import all_tables
from relaympi.results import PROBLEM_DIGEST_ATTR, read_run
from relaympi.results.schema import QUADRATICS_CONVENTION_ATTR
from relaympi.tasks.quadratics import CONVENTION, QuadraticsSpec, generate, load
from relaympi.training.out_file import check_out
from relaympi.training.plan import resolve
from tests import run_factories as rf

ROOT = Path(__file__).resolve().parent.parent
GENERATED: dict[str, Any] = {
    "dim": 10,
    "mu": 0.5,
    "L": 1.0,
    "zeta2": 1.0,
    "sigma2": 0.0,
    "r0": 10.0,
}
FROM_FILE = {"dim": 10, "mu": None, "L": None, "zeta2": None, "sigma2": 0.0, "r0": None}


def _train(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "relaympi.train", "--task", "quadratics", *args]
    command += ["--backend", "batched", "--workers", "4", "--steps", "40", "--dim", "10"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_save_problem_then_problem_file_runs_share_one_table(tmp_path: Path) -> None:
    """The recipe in the docs: relay generates and saves the problem, d2 reads it; a relay rerun
    on the file gives the same numbers and is a duplicate."""
    problem, runs = tmp_path / "problem.h5", tmp_path / "runs"
    runs.mkdir()
    _train("--algo", "relay", "--save-problem", str(problem), "--out", str(runs / "relay.h5"))
    _train("--algo", "d2", "--problem-file", str(problem), "--out", str(runs / "d2.h5"))
    _train("--algo", "relay", "--problem-file", str(problem), "--out", str(runs / "rerun.h5"))

    digests = {
        read_run(runs / f"{name}.h5").attrs[PROBLEM_DIGEST_ATTR]
        for name in ("relay", "d2", "rerun")
    }
    assert digests == {load(problem).digest()}
    conventions = {
        read_run(runs / f"{name}.h5").attrs[QUADRATICS_CONVENTION_ATTR]
        for name in ("relay", "d2", "rerun")
    }
    assert conventions == {CONVENTION}

    settings = ReportSettings(target=10.0)
    summaries, problems = report.load_runs(report.find_run_files([runs]), settings)
    tables = [t for t in all_tables(summaries, settings) if t.kind == "quadratics"]
    assert len(tables) == 1, [t.title for t in tables]
    (table,) = tables
    assert [row[0] for row in table.rows] == ["RelaySGD", "D2"]
    assert "mu=0.5, L=1, zeta2=1" in table.title  # the constants the problem was generated with
    assert problems == [
        (
            runs / "rerun.h5",
            f"duplicate of {runs / 'relay.h5'} (same configuration, problem and seed); ignored",
        )
    ]
    np.testing.assert_array_equal(
        read_run(runs / "rerun.h5").data["suboptimality"],
        read_run(runs / "relay.h5").data["suboptimality"],
    )


def _quadratics(path: Path, digest: str | None, sub: list[float], **config) -> Path:
    rf.write_quadratics_run(path, sub, np.arange(len(sub)) * 10, **config)
    if digest is not None:
        with h5py.File(path, "r+") as file:
            file.attrs[PROBLEM_DIGEST_ATTR] = digest
    return path


def test_problem_file_runs_join_the_generated_problem_by_its_digest(tmp_path: Path) -> None:
    fast, slow = [1, 1e-2, 1e-4, 1e-7], [1, 0.1, 1e-2, 1e-5]
    # relay generated four problems: seeds 0 and 1, on 4 and 8 workers
    for seed in (0, 1):
        for n in (4, 8):
            _quadratics(
                tmp_path / f"relay_s{seed}_n{n}.h5",
                f"gen{seed}{n}" * 8,
                fast,
                seed=seed,
                world_size=n,
                **GENERATED,
            )
    # d2 read seed 0's 4-worker problem from a file; relay reran on it (a duplicate)
    on_file = dict(FROM_FILE, problem_file="p.h5")
    _quadratics(
        tmp_path / "d2_file.h5",
        "gen04" * 8,
        slow,
        algo="d2",
        topology="ring",
        world_size=4,
        **on_file,
    )
    _quadratics(tmp_path / "relay_z_rerun.h5", "gen04" * 8, fast, world_size=4, **on_file)
    # a problem nobody here generated: a table of its own, named by its digest
    _quadratics(tmp_path / "other.h5", "abcdef0123456789" * 4, slow, world_size=4, **on_file)
    settings = ReportSettings(target=1e-3)
    summaries, problems = report.load_runs(report.find_run_files([tmp_path]), settings)
    tables = {
        t.title.split(": ", 1)[1]: t
        for t in all_tables(summaries, settings)
        if t.kind == "quadratics"
    }
    assert sorted(tables) == [
        "quadratics, dim=10, mu=0.5, L=1, zeta2=1, sigma2=0, r0=10",
        "quadratics, problem=abcdef012345, dim=10, sigma2=0",
    ]
    generated = tables[sorted(tables)[0]]
    assert generated.header == ["Algorithm", "Topology", "4 workers", "8 workers"]
    assert generated.rows == [
        ["RelaySGD", "double-binary-trees", "20", "20"],  # seeds 0 and 1, each its own problem
        ["D2", "ring", "30", "-"],
    ]
    assert problems == [
        (
            tmp_path / "relay_z_rerun.h5",
            f"duplicate of {tmp_path / 'relay_s0_n4.h5'} (same configuration, problem and seed); "
            "ignored",
        )
    ]


def test_runs_without_a_recorded_problem_are_grouped_as_before(tmp_path: Path) -> None:
    """Files written before the digest was recorded: by the constants their config holds."""
    sub = [1, 1e-2, 1e-4, 1e-7]
    _quadratics(tmp_path / "gen.h5", None, sub, **GENERATED)
    _quadratics(
        tmp_path / "file.h5",
        None,
        sub,
        algo="d2",
        topology="ring",
        **dict(FROM_FILE, problem_file="p.h5"),
    )
    _quadratics(
        tmp_path / "rerun.h5",
        None,
        sub,
        algo="d2",
        topology="ring",
        **dict(FROM_FILE, problem_file="p.h5"),
    )
    summaries, problems = report.load_runs(report.find_run_files([tmp_path]), ReportSettings())
    titles = sorted(t.title.split(": ", 1)[1] for t in all_tables(summaries, ReportSettings()))
    assert titles == [
        "quadratics, dim=10, mu=0.5, L=1, zeta2=1, sigma2=0, r0=10",
        "quadratics, dim=10, sigma2=0",
    ]
    assert [reason.split(" (")[1] for _, reason in problems] == [
        "same configuration and seed); ignored"
    ]


@pytest.mark.parametrize("change", ["seed", "sigma2", "workers"])
def test_a_problem_digest_is_its_arrays(tmp_path: Path, change: str) -> None:
    spec = QuadraticsSpec(dim=6)
    problem = generate(4, spec, seed=0)
    problem.save(tmp_path / "p.h5")
    assert load(tmp_path / "p.h5").digest() == problem.digest() == generate(4, spec, 0).digest()
    other = {
        "seed": lambda: generate(4, spec, seed=1),
        "sigma2": lambda: generate(4, QuadraticsSpec(dim=6, sigma2=0.5), seed=0),
        "workers": lambda: generate(5, spec, seed=0),
    }[change]()
    assert other.digest() != problem.digest()
    assert len(problem.digest()) == 64 and int(problem.digest(), 16) >= 0


def test_a_run_of_the_half_loss_is_refused_in_one_line(tmp_path: Path) -> None:
    """A quadratics run from before the loss lost its 1/2 records no convention: its
    suboptimality and zeta2 are in another loss, so the report leaves it out, saying why, and
    tabulates only today's run."""
    sub = [1, 1e-2, 1e-4, 1e-7]
    _quadratics(tmp_path / "new.h5", None, sub, **GENERATED)
    old = tmp_path / "old.h5"
    rf.write_quadratics_run(old, sub, np.arange(4) * 10, convention=None, algo="d2", **GENERATED)
    settings = ReportSettings(target=1e-3)
    summaries, problems = report.load_runs(report.find_run_files([tmp_path]), settings)
    assert [s.path for s in summaries] == [tmp_path / "new.h5"]
    assert len(problems) == 1
    path, reason = problems[0]
    assert path == old and "\n" not in reason
    assert reason.startswith("cannot summarize: quadratics run in another loss (none recorded")
    assert CONVENTION in reason
    (table,) = [t for t in all_tables(summaries, settings) if t.kind == "quadratics"]
    assert [row[0] for row in table.rows] == ["RelaySGD"]


def test_an_unfinished_run_of_the_half_loss_is_not_resumed(tmp_path: Path) -> None:
    """Going on with a preempted run of the 1/2 loss would mix two losses in one file."""
    old = rf.write_quadratics_run(
        tmp_path / "old.h5", [1, 1e-2], convention=None, status="preempted", world_size=4
    )
    plan = resolve(RunConfig(task="quadratics", steps=20, algo="relay", dim=10), 4)
    with pytest.raises(ConfigError, match="older relaympi .* pass --overwrite") as error:
        check_out(old, False, plan)
    assert "\n" not in str(error.value)
    check_out(old, True, plan)  # --overwrite starts it again
    ours = rf.write_quadratics_run(
        tmp_path / "ours.h5", [1, 1e-2], status="preempted", world_size=4
    )
    with pytest.raises(ConfigError, match="preempted run of another configuration"):
        check_out(ours, False, plan)  # today's: judged by its configuration, as before
