"""What a run says besides its result: the lr warning only where the worker count moved far from the
tuned one, usage errors before any warning or file, the at-chance flag only after training, and a
preempted run of another configuration kept unless --overwrite."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from relaympi.config import parse_args
from relaympi.results import read_run, run_status
from relaympi.training.plan import resolve
from relaympi.training.run_file import print_summary
from tests import run_factories as rf
from tests.conftest import env_for_subprocess, mpirun, requires_mpirun

# most tests launch the trainer as a process (2-17 s each)
pytestmark = pytest.mark.slow

DIGITS = ["--task", "digits", "--backend", "local"]


def train(args, cwd, env=None, mpi=None):
    cmd = [sys.executable, "-m", "relaympi.train", *map(str, args)]
    if mpi:
        cmd = [mpirun(), "-n", str(mpi), *cmd]
    env = {**env_for_subprocess(), **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


# -- the default lr's warning ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "algo, workers, warns",
    [
        ("relay", 16, False),
        ("relay", 8, False),
        ("relay", 4, False),  # the docs' examples: every algorithm trains to 96-99% on digits
        ("dpsgd", 4, False),
        ("relay", 3, True),  # fewer than a quarter of 16
        ("relay", 2, True),  # RelaySGD stays at chance on digits
        ("dpsgd", 3, True),
        ("allreduce", 2, False),  # centralized SGD of the mean gradient: 98% with 1 and 2 workers
        ("allreduce", 1, False),
        ("allreduce", 32, True),  # more workers than tuned: every algorithm
        ("relay", 32, True),
    ],
)
def test_the_default_lr_warns_only_far_from_the_tuned_worker_count(algo, workers, warns):
    plan = resolve(parse_args([*DIGITS, "--workers", str(workers), "--algo", algo]), workers)
    assert (plan.lr_warning is not None) == warns, plan.lr_warning
    if warns:
        assert plan.lr_warning is not None
        assert (
            "tuned for 16 workers" in plan.lr_warning
            and f"this run has {workers}" in plan.lr_warning
        )
    given = resolve(
        parse_args([*DIGITS, "--workers", str(workers), "--algo", algo, "--lr", "0.1"]), workers
    )
    assert given.lr_warning is None


def test_a_four_worker_run_of_the_docs_does_not_warn_about_its_lr(tmp_path):
    proc = train(
        [*DIGITS, "--workers", "4", "--algo", "relay", "--alpha", "0.01", "--steps", "3"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "may not converge" not in proc.stderr


# -- usage errors come first, and write nothing ---------------------------------------------------


@pytest.mark.parametrize(
    "task, words",
    [
        ("cifar10", "CIFAR-10 data directory"),
        ("imagenet", "is not a directory"),
        ("agnews", "distilbert is not a directory"),
    ],
)
def test_missing_data_is_the_only_line_and_leaves_no_folder(tmp_path, task, words):
    """3 workers: the default lr would warn (fewer than a quarter of 16), and the machine may be
    busy; none of it prints before the usage error, and no results/ folder is made."""
    env = {"RELAYMPI_DATA": str(tmp_path / "nowhere")}
    proc = train(
        ["--task", task, "--backend", "local", "--workers", "3", "--algo", "relay"], tmp_path, env
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []


@requires_mpirun
def test_missing_data_under_mpirun_is_one_line_and_leaves_no_folder(tmp_path):
    env = {"RELAYMPI_DATA": str(tmp_path / "nowhere")}
    proc = train(
        ["--task", "cifar10", "--algo", "relay", "--topology", "chain"], tmp_path, env, mpi=2
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "CIFAR-10 data directory" in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_results_folder_is_made_when_the_run_file_is_written(tmp_path):
    proc = train([*DIGITS, "--workers", "4", "--algo", "relay", "--steps", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in (tmp_path / "results").iterdir()] == [
        "digits-relay-double-binary-trees-n4-a1-s0.h5"
    ]


# -- the at-chance flag ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "epochs, flagged",
    [
        ([0.0], False),  # stopped before any step: the untrained model
        ([0.0, 1 / 12], False),  # one step
        ([0.0, 0.5, 0.99], False),
        ([0.0, 1.0], True),  # a whole epoch trained
        ([0.0, 1.0, 2.0, 3.0], True),
    ],
)
def test_the_chance_flag_judges_only_runs_that_trained_an_epoch(tmp_path, capsys, epochs, flagged):
    acc = np.full((len(epochs), 16), 0.0975)
    path = rf.write_classification_run(tmp_path / "c.h5", acc, np.array(epochs), task="digits")
    with __import__("h5py").File(path, "r+") as f:
        f.attrs["num_classes"] = 10
    print_summary(path, "completed")
    assert ("at chance accuracy" in capsys.readouterr().out) == flagged


def test_a_run_stopped_at_step_1_does_not_flag_its_step_0_evaluation(tmp_path):
    args = [*DIGITS, "--workers", "16", "--algo", "relay", "--alpha", "0.01", "--out", "s.h5"]
    # stopped at step 1 itself: the stop acted on at once (no agreement lag)
    proc = train(
        args, tmp_path, {"RELAYMPI_INJECT_SIGNAL": "TERM:1", "RELAYMPI_AGREEMENT_LAG": "0"}
    )
    assert proc.returncode == 5, proc.stderr
    assert "stopped at step 1" in proc.stdout and "at chance" not in proc.stdout


# -- a preempted run of another configuration -----------------------------------------------------


def test_a_preempted_run_is_not_replaced_by_another_configuration(tmp_path):
    base = [
        *DIGITS,
        "--workers",
        "4",
        "--algo",
        "relay",
        "--steps",
        "8",
        "--eval-every",
        "2",
        "--out",
        "p.h5",
    ]
    stopped = train([*base, "--alpha", "0.01"], tmp_path, {"RELAYMPI_INJECT_SIGNAL": "TERM:3"})
    assert stopped.returncode == 5 and run_status(tmp_path / "p.h5") == "preempted", stopped.stderr
    before = (tmp_path / "p.h5").read_bytes()
    other = train([*base, "--alpha", "0.1"], tmp_path)
    assert other.returncode == 2, other.stderr
    (line,) = other.stderr.strip().splitlines()
    assert line == (
        "error: p.h5 holds a preempted run of another configuration (alpha 0.01 there, 0.1 here); "
        "pass --overwrite to replace it, or choose another --out"
    )
    assert (tmp_path / "p.h5").read_bytes() == before
    workers = train([*base, "--alpha", "0.01", "--workers", "8"], tmp_path)
    assert workers.returncode == 2 and "world_size 4 there, 8 here" in workers.stderr
    # the same configuration starts over (no checkpoint); --overwrite replaces with another
    assert train([*base, "--alpha", "0.01"], tmp_path).returncode == 0
    assert read_run(tmp_path / "p.h5").status == "completed"
    stopped = train(
        [*base, "--alpha", "0.01", "--overwrite"], tmp_path, {"RELAYMPI_INJECT_SIGNAL": "TERM:3"}
    )
    assert stopped.returncode == 5
    replaced = train([*base, "--alpha", "0.1", "--overwrite"], tmp_path)
    assert replaced.returncode == 0, replaced.stderr
    assert read_run(tmp_path / "p.h5").config["alpha"] == 0.1
