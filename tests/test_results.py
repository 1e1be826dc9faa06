"""The HDF5 run file: writer/reader round trip, crash safety, resume, and broken files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from relaympi.results import (
    SCHEMA_VERSION,
    STATUSES,
    NotARunFileError,
    Run,
    RunExistsError,
    RunFileError,
    RunWriter,
    read_run,
    run_status,
)
from tests import run_factories as rf

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {
    "task": "digits",
    "algo": "relay",
    "alpha": 0.1,
    "lr": 0.1,
    "out": Path("/tmp/x.h5"),
    "seed": np.int64(3),
}
PROVENANCE = {"version": "0.1.0", "hosts": ["a", "b"]}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _row(step: int, n: int = 4) -> dict:
    return {
        "step": step,
        "epoch": step / 10,
        "time_s": 0.5 * step,
        "test_accuracy": np.linspace(0, 1, n) * step / 100,
        "bytes_sent": np.full(n, 1000.0 * step),
        "params": np.arange(n * 3, dtype=float).reshape(n, 3) + step,
    }


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with RunWriter.create(path, config=CONFIG, provenance=PROVENANCE, world_size=4) as writer:
        assert run_status(path) == "running"
        for step in (0, 10, 20):
            writer.append(_row(step))
        writer.set_attrs(note="héllo", sizes=[1, 2, 3], labels=["a", "b"], flag=True)
        writer.set_status("completed", total_steps=20)
    run = read_run(path)
    assert isinstance(run, Run)
    assert run.schema_version == SCHEMA_VERSION
    assert run.status == "completed"
    assert run.config == {**CONFIG, "out": "/tmp/x.h5", "seed": 3}
    assert run.provenance == PROVENANCE
    assert run.world_size == 4
    assert run.attrs["note"] == "héllo"
    assert run.attrs["sizes"] == [1, 2, 3]
    assert run.attrs["labels"] == ["a", "b"]
    assert run.attrs["flag"] is True
    assert run.attrs["total_steps"] == 20
    assert "start_time" in run.attrs and "end_time" in run.attrs
    assert run.metric("step").dtype == np.int64
    np.testing.assert_array_equal(run.metric("step"), [0, 10, 20])
    assert run.metric("test_accuracy").shape == (3, 4)
    assert run.metric("test_accuracy").dtype == np.float64
    assert run.metric("params").shape == (3, 4, 3)
    np.testing.assert_allclose(run.metric("test_accuracy")[2], np.linspace(0, 1, 4) * 0.2)
    with pytest.raises(KeyError, match="no dataset 'nope'"):
        run.metric("nope")
    with h5py.File(path, "r") as file:  # the documented layout: strings are variable-length UTF-8
        assert h5py.check_string_dtype(file.attrs.get_id("config").dtype).encoding == "utf-8"
        assert file["test_accuracy"].maxshape == (None, 4)
        assert file["test_accuracy"].chunks is not None
        assert json.loads(file.attrs["config"])["task"] == "digits"


def test_read_selected_datasets(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with RunWriter.create(path, config=CONFIG, provenance=PROVENANCE, world_size=4) as writer:
        writer.append(_row(1))
    run = read_run(path, datasets=["step", "test_accuracy", "absent"])
    assert sorted(run.data) == ["step", "test_accuracy"]


def test_missing_key_is_nan_and_new_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with RunWriter.create(path, config=CONFIG, provenance=PROVENANCE, world_size=4) as writer:
        writer.append(_row(0))
        writer.append({"step": 5, "epoch": 0.5})
        with pytest.raises(KeyError, match="surprise"):
            writer.append({"step": 6, "surprise": 1.0})
        with pytest.raises(ValueError, match=r"expecting shape \(4,\), got \(3,\)"):
            writer.append({"step": 7, "test_accuracy": np.zeros(3)})
        with pytest.raises(KeyError, match="step"):
            writer.append({"epoch": 1.0})
    run = read_run(path)
    np.testing.assert_array_equal(run.metric("step"), [0, 5])  # failed appends left nothing behind
    assert np.isnan(run.metric("test_accuracy")[1]).all()
    assert run.metric("epoch")[1] == 0.5


def test_extend_appends_columns(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with RunWriter.create(path, config={}, provenance={}, world_size=2) as writer:
        # nothing yet
        writer.extend({"step": np.array([], dtype=np.int64), "loss": np.zeros((0, 2))})
        writer.extend({"step": np.array([0, 5]), "loss": np.array([[1.0, 2.0], [3.0, 4.0]])})
        writer.append({"step": 9, "loss": np.array([5.0, 6.0])})
        with pytest.raises(ValueError, match="same number of rows"):
            writer.extend({"step": np.array([10, 11]), "loss": np.zeros((3, 2))})
        with pytest.raises(ValueError, match=r"expecting shape \(2,\), got \(3,\)"):
            writer.extend({"step": np.array([10]), "loss": np.zeros((1, 3))})
    run = read_run(path)
    np.testing.assert_array_equal(run.metric("step"), [0, 5, 9])
    np.testing.assert_array_equal(run.metric("loss")[:, 1], [2.0, 4.0, 6.0])


@pytest.mark.slow
def test_killed_writer_keeps_flushed_rows(tmp_path: Path) -> None:
    """Rows are on disk after each append: another process reads them while the writer is open."""
    path = tmp_path / "run.h5"
    writer = RunWriter.create(path, config=CONFIG, provenance=PROVENANCE, world_size=4)
    for step in range(3):
        writer.append(_row(step))
    code = (
        "import sys; from relaympi.results import read_run; r = read_run(sys.argv[1]); "
        "print(r.status, len(r.metric('step')), r.metric('test_accuracy').shape)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        env=_env(),
        check=True,
    )
    assert out.stdout.split() == ["running", "3", "(3,", "4)"]
    writer.close()


def test_sigkilled_writer_process_keeps_rows(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    code = (
        "import os, signal, sys, numpy as np; from relaympi.results import RunWriter\n"
        "w = RunWriter.create(sys.argv[1], config={'task': 'x'}, provenance={}, world_size=2)\n"
        "for s in range(3): w.append({'step': s, 'test_accuracy': np.ones(2) * s})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], env=_env())
    assert proc.returncode == -9
    run = read_run(path)
    assert run.status == "running"
    np.testing.assert_array_equal(run.metric("step"), [0, 1, 2])


def test_refuses_to_overwrite_finished_runs(tmp_path: Path) -> None:
    for status in ("completed", "diverged"):
        path = tmp_path / f"{status}.h5"
        with RunWriter.create(path, config=CONFIG, provenance=PROVENANCE, world_size=2) as writer:
            writer.set_status(status)
        with pytest.raises(RunExistsError, match=status):
            RunWriter.create(path, config=CONFIG, provenance=PROVENANCE, world_size=2)
        assert isinstance(RunExistsError("x"), FileExistsError)
        RunWriter.create(
            path, config={"new": 1}, provenance={}, world_size=2, overwrite=True
        ).close()
        assert read_run(path).config == {"new": 1}
    for status in ("failed", "preempted"):  # unfinished runs are simply replaced
        path = tmp_path / f"{status}.h5"
        with RunWriter.create(path, config=CONFIG, provenance=PROVENANCE, world_size=2) as writer:
            writer.set_status(status)
        RunWriter.create(path, config={"new": 1}, provenance={}, world_size=2).close()
        assert run_status(path) == "running"
    # a broken file only with overwrite (it may not be a run file)
    rf.write_empty_file(tmp_path / "corrupt.h5")
    with pytest.raises(NotARunFileError):
        RunWriter.create(tmp_path / "corrupt.h5", config={}, provenance={}, world_size=1)
    RunWriter.create(
        tmp_path / "corrupt.h5", config={}, provenance={}, world_size=1, overwrite=True
    ).close()
    assert run_status(tmp_path / "corrupt.h5") == "running"
    rf.write_not_hdf5(tmp_path / "other.h5")  # and a file that is not a run file never
    with pytest.raises(NotARunFileError):
        RunWriter.create(
            tmp_path / "other.h5", config={}, provenance={}, world_size=1, overwrite=True
        )


def test_create_checks_arguments(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        RunWriter.create(tmp_path / "nope" / "run.h5", config={}, provenance={}, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        RunWriter.create(tmp_path / "r.h5", config={}, provenance={}, world_size=0)
    with pytest.raises(TypeError, match="config must be a dict"):
        RunWriter.create(tmp_path / "r.h5", config=[1], provenance={}, world_size=2)  # type: ignore[arg-type]
    with RunWriter.create(tmp_path / "r.h5", config={}, provenance={}, world_size=2) as writer:
        with pytest.raises(ValueError, match="status must be one of"):
            writer.set_status("done")
        with pytest.raises(ValueError, match="owned by the writer"):
            writer.set_attrs(status="completed")
        with pytest.raises(TypeError, match="JSON-encode"):
            writer.set_attrs(bad={"a": 1})


def test_reopen_drops_rows_after_resume_step(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    with RunWriter.create(path, config=CONFIG, provenance=PROVENANCE, world_size=4) as writer:
        for step in range(0, 60, 10):
            writer.append(_row(step))
        writer.set_status("preempted", stopped_step=50)
    assert run_status(path) == "preempted"
    with RunWriter.reopen(path, resume_step=20) as writer:
        assert run_status(path) == "running"
        assert writer.num_rows == 3
        writer.append(_row(30))
    run = read_run(path)
    np.testing.assert_array_equal(run.metric("step"), [0, 10, 20, 30])
    assert run.metric("params").shape == (4, 4, 3)
    assert run.attrs["resumed_at_steps"] == [20]
    assert "end_time" not in run.attrs
    with RunWriter.reopen(path, resume_step=10) as writer:
        writer.set_status("completed")
    run = read_run(path)
    np.testing.assert_array_equal(run.metric("step"), [0, 10])
    assert run.attrs["resumed_at_steps"] == [20, 10]
    assert len(run.attrs["resumed_at_times"]) == 2
    with pytest.raises(RunExistsError):
        RunWriter.reopen(path, resume_step=0)
    with pytest.raises(FileNotFoundError):
        RunWriter.reopen(tmp_path / "missing.h5", resume_step=0)
    rf.write_empty_file(tmp_path / "empty.h5")
    with pytest.raises(RunFileError, match="empty"):
        RunWriter.reopen(tmp_path / "empty.h5", resume_step=0)


def test_reopen_after_a_partial_row(tmp_path: Path) -> None:
    """A run killed inside append (datasets grown, step not yet written) resumes cleanly."""
    path = tmp_path / "run.h5"
    with RunWriter.create(path, config=CONFIG, provenance=PROVENANCE, world_size=2) as writer:
        writer.append({"step": 0, "loss": 1.0})
        writer.append({"step": 1, "loss": 0.5})
    with h5py.File(path, "r+") as file:  # what a kill between resizes leaves behind
        file["loss"].resize(3, axis=0)
    assert read_run(path).metric("loss").shape == (2,)
    with RunWriter.reopen(path, resume_step=5) as writer:
        writer.append({"step": 2, "loss": 0.25})
    np.testing.assert_array_equal(read_run(path).metric("loss"), [1.0, 0.5, 0.25])


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: rf.write_empty_file(p), "empty file"),
        (lambda p: rf.write_not_hdf5(p), "not an HDF5 file"),
        (lambda p: rf.write_unknown_schema(p), "unknown schema_version 99"),
        (lambda p: rf.write_foreign_hdf5(p), "no 'schema_version' attribute"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: None, "no such file"),
    ],
)
def test_broken_files_raise_with_reason(tmp_path: Path, make, reason: str) -> None:
    path = tmp_path / "bad.h5"
    make(path)
    with pytest.raises(RunFileError, match=reason) as info:
        read_run(path)
    assert info.value.path == path
    assert reason in info.value.reason
    assert run_status(path) == ("missing" if reason == "no such file" else "corrupt")


def test_truncated_file(tmp_path: Path) -> None:
    good = rf.write_classification_run(tmp_path / "good.h5", np.full((30, 8), 0.5))
    bad = rf.write_truncated_file(tmp_path / "bad.h5", good)
    with pytest.raises(RunFileError, match="truncated"):
        read_run(bad)
    assert run_status(bad) == "corrupt"


def test_missing_and_bad_attributes(tmp_path: Path) -> None:
    path = tmp_path / "r.h5"
    with h5py.File(path, "w") as file:
        file.attrs["schema_version"] = 1
        file.attrs["status"] = "completed"
        file.attrs["world_size"] = 2
        file.attrs["provenance"] = "{}"
    with pytest.raises(RunFileError, match="missing attribute 'config'"):
        read_run(path)
    with h5py.File(path, "a") as file:
        file.attrs["config"] = "{not json"
    with pytest.raises(RunFileError, match="'config' is not valid JSON"):
        read_run(path)
    with h5py.File(path, "a") as file:
        file.attrs["config"] = "{}"
        file.attrs["status"] = "exploded"
    with pytest.raises(RunFileError, match="unknown status 'exploded'"):
        read_run(path)
    assert run_status(path) == "corrupt"


def test_run_status_values(tmp_path: Path) -> None:
    assert run_status(tmp_path / "none.h5") == "missing"
    for status in STATUSES:
        path = tmp_path / f"{status}.h5"
        with RunWriter.create(path, config={}, provenance={}, world_size=1) as writer:
            writer.set_status(status)
        assert run_status(path) == status
        assert read_run(path).status == status


@pytest.mark.slow
def test_cli(tmp_path: Path) -> None:
    path = rf.write_classification_run(tmp_path / "run with space.h5", np.full((3, 2), 0.5))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "relaympi.results", *args],
            capture_output=True,
            text=True,
            env=_env(),
        )

    out = cli("status", str(path))
    assert (out.returncode, out.stdout) == (0, "completed\n")
    out = cli("status", str(tmp_path / "missing.h5"))
    assert (out.returncode, out.stdout) == (0, "missing\n")
    out = cli("show", str(path))
    assert out.returncode == 0
    assert "status: completed" in out.stdout
    assert "test_accuracy: float64 [3, 2]" in out.stdout
    assert '"cifar10"' in out.stdout
    rf.write_not_hdf5(tmp_path / "bad.h5")
    out = cli("show", str(tmp_path / "bad.h5"))
    assert out.returncode == 1 and "not an HDF5 file" in out.stderr
    assert cli("frobnicate").returncode == 2
