"""Misuse of every command line ends with one clear line and exit status 2: no traceback, nothing
written.

Each case fails before any training starts, so the table stays cheap. Read-only cases mount a
read-only tmpfs (root only; `chmod` does not stop root, a read-only mount does).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, env_for_subprocess, mounted_tmpfs, requires_mpirun, train_command

TRAIN = ["-m", "relaympi.train"]


def _train(backend: str, workers: int = 2, *extra: str) -> list[str]:
    return [
        *TRAIN,
        "--backend",
        backend,
        "--workers",
        str(workers),
        "--steps",
        "1",
        "--out",
        "{tmp}/run.h5",
        *extra,
    ]


LOCAL, BATCHED = _train("local"), _train("batched")
QUADRATICS = [*LOCAL, "--task", "quadratics"]

# (arguments after `python`, strings the one error line must hold: the bad value and what
# is allowed)
CASES = [
    pytest.param(
        ["-m", "relaympi.data", "fetch", "cifar10", "--root", "{tmp}/root", "--url", "notaurl"],
        ["--url 'notaurl'", "http", "file://"],
        id="data-fetch-url",
    ),
    pytest.param([*LOCAL, "--seed", "-1"], ["--seed", "got -1", "[0, "], id="seed-local"),
    pytest.param([*BATCHED, "--seed", "-1"], ["--seed", "got -1", "[0, "], id="seed-batched"),
    pytest.param(
        _train("local", 5000),
        ["5000 workers", "1438 training samples", "at most 1438"],
        id="workers-local",
    ),
    pytest.param(
        _train("batched", 2000),
        ["2000 workers", "1438 training samples", "at most 1438"],
        id="workers-batched",
    ),
    # no draw in 10000 leaves every worker of a 10-worker group at least 1 of its 14 samples
    pytest.param(
        _train("batched", 1024, "--alpha", "1"),
        ["--alpha 1 with 1024 workers", "1438 training samples", "larger alpha", "--alpha inf"],
        id="dirichlet-batched",
    ),
    pytest.param(
        [*LOCAL, "--checkpoint-dir", "{ro}/ckpt"],
        ["--checkpoint-dir", "/ckpt", "not writable"],
        id="checkpoint-dir-read-only",
    ),
    pytest.param(
        [*QUADRATICS, "--save-problem", "{ro}/p.h5"],
        ["--save-problem", "/p.h5", "not writable"],
        id="save-problem-read-only",
    ),
    pytest.param(
        [*QUADRATICS, "--save-problem", "{ro}/old.h5", "--overwrite"],
        ["--save-problem", "/old.h5", "not writable"],
        id="save-problem-overwrite-read-only",
    ),
    # double-binary-trees -n 100000 is described now (sparse summary); listing n (n - 1) / 2 edges
    # is still refused
    pytest.param(
        ["-m", "relaympi.topology", "fully-connected", "-n", "100000"],
        ["-n 100000", "4999950000 edges", "at most -n 2896"],
        id="topology-too-large",
    ),
    pytest.param(
        [
            "-m",
            "benchmarks.comm",
            "--backend",
            "local",
            "--workers",
            "2",
            "--reps",
            "0",
            "--out",
            "{tmp}/comm.h5",
        ],
        ["--reps", "got 0", ">= 1"],
        id="comm-reps",
    ),
    pytest.param(
        ["-m", "benchmarks.comm", "--backend", "local", "--workers", "0", "--out", "{tmp}/comm.h5"],
        ["--workers", "got 0", ">= 2"],
        id="comm-workers",
    ),
]


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs at tmp_path/ro holding one file, old.h5; unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "ro") as ro:
        (ro / "old.h5").write_bytes(b"another problem")
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True, capture_output=True)
        yield ro


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _command(args: list[str], tmp_path: Path, ro: Path | None) -> list[str]:
    return [a.replace("{tmp}", str(tmp_path)).replace("{ro}", str(ro)) for a in args]


def _check_refused(proc: subprocess.CompletedProcess, named: list[str]) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for text in named:
        assert text in errors[0], (text, errors[0])


@pytest.mark.slow
@pytest.mark.parametrize("args, named", CASES)
def test_misuse_is_one_line_and_exit_2(tmp_path, request, args, named):
    ro = request.getfixturevalue("read_only_dir") if any("{ro}" in a for a in args) else None
    cwd = tmp_path / "cwd"  # default outputs (results/, bench-results/) would land here
    cwd.mkdir()
    before = _files(tmp_path)
    env = {**env_for_subprocess(), "RELAYMPI_DATA": str(tmp_path / "data")}
    env.pop("RELAYMPI_DATA_MIRROR", None)
    command = [PY, *_command(args, tmp_path, ro)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    _check_refused(proc, named)
    assert _files(tmp_path) == before  # nothing written


@pytest.mark.slow
@requires_mpirun
def test_misuse_under_mpirun_is_one_line_from_rank_0(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    command = train_command(["--seed", "-1", "--steps", "1", "--out", tmp_path / "run.h5"], mpi=2)
    proc = subprocess.run(
        command, capture_output=True, text=True, cwd=cwd, env=env_for_subprocess(), timeout=300
    )
    _check_refused(proc, ["--seed", "got -1"])
    assert "abort" not in proc.stderr.lower(), proc.stderr
    assert _files(tmp_path) == ["cwd"]


def test_digits_train_size_is_its_training_set():
    """resolve refuses too many workers from DigitsTask.train_size, before the data loads: it must
    be the real count."""
    from relaympi.tasks.base import TaskOptions
    from relaympi.tasks.digits import DigitsTask

    assert DigitsTask.train_size == len(DigitsTask(TaskOptions()).train_labels)
