"""The paper's ImageNet and AG News workloads through the one training loop, both backends, into the
report."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest

from relaympi.results import read_run
from tests.conftest import mpirun_path, run_module, run_train
from tests.test_imagenet import make_imagenet_dir

# each test trains on both backends, under mpirun too where there is one
pytestmark = [pytest.mark.slow, pytest.mark.mpirun]

WORKERS, STEPS, BATCH = 2, 2, 4
COMMON = ["--steps", STEPS, "--eval-every", 1, "--batch-size", BATCH, "--eval-batch-size", 8]
# Everything a run file holds that does not measure time: the backends promise the same numbers.
NUMBERS = ("step", "epoch", "lr", "train_loss", "test_loss", "test_accuracy", "bytes_sent")


def _train(args, mpi=None):
    run_train(args, mpi=mpi, timeout=600, check=0)


@pytest.fixture(scope="module")
def imagenet_dir(tmp_path_factory):
    return make_imagenet_dir(
        tmp_path_factory.mktemp("imagenet"), train_per_class=4, val_per_class=2
    )


@pytest.fixture(scope="module")
def agnews_dirs(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.nlp_factories import make_agnews_fixture

    return make_agnews_fixture(tmp_path_factory.mktemp("agnews"))


def _report(results):
    proc = run_module("relaympi.report", results)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _images(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.suffix.lower() in (".jpeg", ".jpg", ".png"))


def _csv_rows(path: Path) -> int:
    with path.open(newline="") as file:
        return sum(1 for _ in csv.reader(file))


def _check_rows(run, num_train: int, num_test: int) -> None:
    """One row per step (eval every step, plus the initial model), epochs, and per-worker
    metrics."""
    assert run.status == "completed"
    assert run.data["step"].tolist() == list(range(STEPS + 1))
    # all workers together see the training set once
    steps_per_epoch = math.ceil(num_train / (WORKERS * BATCH))
    np.testing.assert_allclose(
        run.data["epoch"], np.arange(STEPS + 1) / steps_per_epoch, rtol=0, atol=1e-12
    )
    for key in ("test_accuracy", "test_loss", "train_loss", "bytes_sent"):
        assert run.data[key].shape == (STEPS + 1, WORKERS), key
    accuracy = run.data["test_accuracy"]
    correct = accuracy * num_test  # each worker's own model on the full test set
    np.testing.assert_allclose(correct, np.round(correct), rtol=0, atol=1e-9)
    assert (
        np.isfinite(run.data["test_loss"]).all() and np.isfinite(run.data["train_loss"][1:]).all()
    )
    sent = run.data["bytes_sent"]  # the same messages every step: grows linearly from 0
    assert (sent[0] == 0).all() and (sent[1] > 0).all()
    np.testing.assert_array_equal(sent, np.arange(STEPS + 1)[:, None] * sent[1])


def _check_backends_agree(local, mpi) -> None:
    assert (local.status, mpi.status) == ("completed", "completed")
    for key in NUMBERS:
        np.testing.assert_array_equal(local.data[key], mpi.data[key], err_msg=key)
    differ = {
        k
        for k in local.config.keys() | mpi.config.keys()
        if local.config.get(k) != mpi.config.get(k)
    }
    assert differ <= {"out", "workers", "backend", "relay_in_place"}, differ
    assert (local.provenance["transport_backend"], mpi.provenance["transport_backend"]) == (
        "local",
        "mpi",
    )


def _report_row(out: str, label: str, topology: str, run) -> None:
    """The report's row for this run: the label, the topology and the mean-over-workers metric (by
    hand)."""
    epoch, accuracy = run.data["epoch"], run.data["test_accuracy"]
    # shorter than 5 epochs: every evaluation after the first
    window = (epoch > epoch.max() - 5) & (epoch > 0)
    value = f"{100 * accuracy[window].mean(axis=0).mean():.1f}%"
    rows = [line.split() for line in out.splitlines()]
    wanted = [*label.split(), topology, value]
    assert wanted in rows, (wanted, out)
    assert "1 completed" in out


def test_imagenet_runs_on_both_backends_and_reaches_the_report(tmp_path, imagenet_dir):
    args = [
        "--task",
        "imagenet",
        "--data-dir",
        imagenet_dir,
        "--algo",
        "relay",
        "--alpha",
        "0.1",
        "--loader-workers",
        0,
        *COMMON,
    ]
    _train([*args, "--backend", "local", "--workers", WORKERS, "--out", tmp_path / "local.h5"])
    local = read_run(tmp_path / "local.h5")
    _check_rows(local, _images(Path(imagenet_dir) / "train"), _images(Path(imagenet_dir) / "val"))
    assert (local.config["topology"], local.config["momentum"]) == ("double-binary-trees", 0.9)
    if mpirun_path():
        _train([*args, "--out", tmp_path / "mpi.h5"], mpi=WORKERS)
        _check_backends_agree(local, read_run(tmp_path / "mpi.h5"))
    out = _report(tmp_path)  # an MPI run file is the same configuration: listed as a duplicate
    assert "Test accuracy: imagenet, 2 workers" in out
    _report_row(out, "RelaySGD + momentum", "double-binary-trees", local)


def test_agnews_runs_on_both_backends_and_reaches_the_report(tmp_path, agnews_dirs):
    """In-process with --relay-in-place against MPI with separate send buffers: the same numbers."""
    data_dir, model_dir = agnews_dirs
    args = [
        "--task",
        "agnews",
        "--data-dir",
        data_dir,
        "--model-dir",
        model_dir,
        "--algo",
        "relay",
        "--alpha",
        "0.1",
        *COMMON,
    ]
    _train(
        [
            *args,
            "--backend",
            "local",
            "--workers",
            WORKERS,
            "--relay-in-place",
            "--out",
            tmp_path / "local.h5",
        ]
    )
    local = read_run(tmp_path / "local.h5")
    _check_rows(
        local, _csv_rows(Path(data_dir) / "train.csv"), _csv_rows(Path(data_dir) / "test.csv")
    )
    assert (local.config["topology"], local.config["optimizer"]) == ("chain", "adam")
    if mpirun_path():
        _train([*args, "--out", tmp_path / "mpi.h5"], mpi=WORKERS)
        _check_backends_agree(local, read_run(tmp_path / "mpi.h5"))
    out = _report(tmp_path)
    assert "Test accuracy: agnews, 2 workers" in out
    _report_row(out, "RelaySGD (Adam)", "chain", local)
