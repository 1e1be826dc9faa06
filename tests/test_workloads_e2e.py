"""The paper's ImageNet and AG News workloads through the one training loop, both backends, into the report."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relaympi.results import read_run
from tests.conftest import ROOT, env_for_subprocess, mpirun_path, requires_mpirun
from tests.test_imagenet import make_imagenet_dir

PY = sys.executable


def _train(args, mpi=None):
    cmd = [PY, "-m", "relaympi.train", *map(str, args)]
    if mpi:
        cmd = [mpirun_path(), "-n", str(mpi), *cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env=env_for_subprocess(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def imagenet_dir(tmp_path_factory):
    return make_imagenet_dir(tmp_path_factory.mktemp("imagenet"), train_per_class=4, val_per_class=2)


@pytest.fixture(scope="module")
def agnews_dirs(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.nlp_factories import make_agnews_fixture

    return make_agnews_fixture(tmp_path_factory.mktemp("agnews"))


def _report(results):
    proc = subprocess.run([PY, "-m", "benchmarks.report", str(results)], cwd=ROOT, env=env_for_subprocess(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


COMMON = ["--steps", 2, "--eval-every", 1, "--batch-size", 4, "--eval-batch-size", 8, "--loader-workers", 0]


def test_imagenet_runs_on_both_backends_and_reaches_the_report(tmp_path, imagenet_dir):
    args = ["--task", "imagenet", "--data-dir", imagenet_dir, "--algo", "relay", "--alpha", "0.1", *COMMON]
    _train([*args, "--backend", "local", "--workers", 2, "--out", tmp_path / "local.h5"])
    if mpirun_path():
        _train([*args, "--out", tmp_path / "mpi.h5"], mpi=2)
    run = read_run(tmp_path / "local.h5")
    assert run.status == "completed" and run.data["test_accuracy"].shape == (3, 2)
    out = _report(tmp_path)
    assert "imagenet" in out and "mean" in out.lower()  # the ImageNet metric is the mean over workers


def test_agnews_runs_on_both_backends_and_reaches_the_report(tmp_path, agnews_dirs):
    data_dir, model_dir = agnews_dirs
    args = ["--task", "agnews", "--data-dir", data_dir, "--model-dir", model_dir, "--algo", "relay", "--alpha", "0.1", *COMMON]
    _train([*args, "--backend", "local", "--workers", 2, "--relay-in-place", "--out", tmp_path / "local.h5"])
    if mpirun_path():
        _train([*args, "--out", tmp_path / "mpi.h5"], mpi=2)
    run = read_run(tmp_path / "local.h5")
    assert run.status == "completed" and run.config["topology"] == "chain" and run.config["optimizer"] == "adam"
    assert "agnews" in _report(tmp_path)


@requires_mpirun
def test_mpi_and_local_agree_on_agnews(tmp_path, agnews_dirs):
    import numpy as np

    data_dir, model_dir = agnews_dirs
    args = ["--task", "agnews", "--data-dir", data_dir, "--model-dir", model_dir, "--algo", "relay", *COMMON]
    _train([*args, "--backend", "local", "--workers", 2, "--out", tmp_path / "a.h5"])
    _train([*args, "--out", tmp_path / "b.h5"], mpi=2)
    np.testing.assert_array_equal(read_run(tmp_path / "a.h5").data["train_loss"], read_run(tmp_path / "b.h5").data["train_loss"])
