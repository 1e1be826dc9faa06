"""Run files damaged so badly that HDF5 never returns from reading them: the report and
`python -m relaympi.results` give up on each after a time limit, name it, and go on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from relaympi.results import bounded
from tests import run_factories as rf

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 2.0  # the tests' time limit per file (RELAYMPI_READ_TIMEOUT), in seconds
# (stride, offset): one byte in every `stride`, from `offset`, XOR-ed with 0xFF. In the factory
# file below, the first three send HDF5 2.0 (h5py 3.16) into an endless loop in its reading of the
# root group's attributes (found by trying offsets; each ran for over 15 s); the last one is the
# new user's stride and offset, which this file survives with an error.
ENDLESS = ((997, 2057), (991, 546), (499, 1378))
CORRUPTIONS = (*ENDLESS, (997, 4000))


def corrupt(source: Path, target: Path, stride: int, offset: int) -> Path:
    data = bytearray(source.read_bytes())
    for i in range(offset, len(data), stride):
        data[i] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


def factory_run(path: Path, **config) -> Path:
    accuracy = np.random.default_rng(0).uniform(0.2, 0.9, (20, 4))
    return rf.write_classification_run(path, accuracy, **config)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], list[Path]]:
    """(directory, the damaged files, the healthy ones): two good runs beside every corruption."""
    root = tmp_path_factory.mktemp("damaged")
    source = factory_run(root / "source.h5")
    bad = [corrupt(source, root / f"bad_{s}_{o}.h5", s, o) for s, o in CORRUPTIONS]
    source.unlink()
    good = [factory_run(root / f"good_{seed}.h5", seed=seed) for seed in (0, 1)]
    return root, bad, good


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        bounded.READ_TIMEOUT_ENV: f"{LIMIT:g}",
    }


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """A command that must end: a hang fails the test after ``timeout`` seconds."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        errors="replace",
        env=_env(),
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.mark.slow
def test_report_names_each_damaged_file_and_tabulates_the_rest(damaged) -> None:
    root, bad, good = damaged
    started = time.monotonic()
    result = _run("benchmarks.report", str(root))
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    problems = result.stdout.split("Problems (", 1)[1]
    for path in bad:
        assert str(path) in problems, (path, result.stdout)
    reason = bounded.timeout_reason(LIMIT)
    timed_out = [p for p in bad if f"{p}: {reason}" in problems]
    assert timed_out, (
        "no damaged file hung HDF5 (a fixed HDF5?): choose strides and offsets that do",
        result.stdout,
    )
    assert f"{len(CORRUPTIONS)} with problems" in result.stdout
    assert "2 completed" in result.stdout  # the healthy runs are in the tables
    assert not any(str(p) in problems for p in good)
    # the hanging files cost the time limit each, two at a time (or all at once), not more
    assert elapsed < 30, elapsed


@pytest.mark.slow
def test_results_status_and_show_give_up_on_an_endless_file(damaged) -> None:
    _, bad, good = damaged
    endless = bad[: len(ENDLESS)]
    status = _run("relaympi.results", "status", *map(str, [*endless, good[0]]))
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[-1] == f"completed\t{good[0]}"
    hung = [line for line in lines[:-1] if line.startswith("corrupt\t")]
    assert len(hung) == len(endless), status.stdout
    assert bounded.timeout_reason(LIMIT) in status.stderr

    shown = _run("relaympi.results", "show", str(endless[0]))
    assert shown.returncode == 1, shown.stderr
    assert shown.stderr == f"error: {endless[0]}: {bounded.timeout_reason(LIMIT)}\n"
    ok = _run("relaympi.results", "show", str(good[0]))
    assert ok.returncode == 0 and "status: completed" in ok.stdout, ok.stderr


# module-level, so that the workers can import them
def _sleepy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _crash(code: int) -> None:
    if code < 0:
        os.kill(os.getpid(), -code)
    os._exit(code)


def test_bounded_map_keeps_order_kills_slow_calls_and_survives_crashes() -> None:
    calls = [(0.0,), (60.0,), (0.1,), (60.0,), (0.0,)]
    started = time.monotonic()
    outcomes = list(bounded.bounded_map(_sleepy, calls, timeout=1.0, workers=2))
    assert time.monotonic() - started < 15
    assert outcomes == [
        (True, 0.0),
        (False, bounded.timeout_reason(1.0)),
        (True, 0.1),
        (False, bounded.timeout_reason(1.0)),
        (True, 0.0),
    ]
    crashed = list(bounded.bounded_map(_crash, [(-signal.SIGKILL,), (3,)], timeout=10.0))
    assert crashed[0] == (False, bounded._crash_reason(-signal.SIGKILL))
    assert crashed[1] == (False, bounded._crash_reason(3))
    assert "signal 9" in crashed[0][1] and "exit 3" in crashed[1][1]


def test_the_time_limit_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(bounded.READ_TIMEOUT_ENV, raising=False)
    assert bounded.read_timeout() == bounded.DEFAULT_READ_TIMEOUT
    monkeypatch.setenv(bounded.READ_TIMEOUT_ENV, "0.5")
    assert bounded.read_timeout() == 0.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(bounded.READ_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=bounded.READ_TIMEOUT_ENV):
            bounded.read_timeout()


def test_reading_in_workers_gives_the_same_runs_and_reasons(damaged, tmp_path) -> None:
    from relaympi.results import RunFileError, read_run

    _, bad, good = damaged
    empty = rf.write_empty_file(tmp_path / "empty.h5")
    missing = tmp_path / "missing.h5"
    paths = [good[0], empty, missing, bad[-1], good[1]]
    read = list(bounded.read_runs(paths, datasets=["step", "test_accuracy"], timeout=LIMIT))
    assert [path for path, _ in read] == paths
    for path, outcome in read:
        try:
            expected = read_run(path, datasets=["step", "test_accuracy"])
        except RunFileError as error:
            assert isinstance(outcome, RunFileError) and outcome.reason == error.reason
            continue
        assert not isinstance(outcome, RunFileError), (path, outcome)
        assert outcome.config == expected.config and outcome.status == expected.status
        assert sorted(outcome.data) == sorted(expected.data)
        for name in expected.data:
            np.testing.assert_array_equal(outcome.data[name], expected.data[name])


@pytest.mark.slow
def test_a_process_with_threads_reads_in_workers_that_are_not_forks_of_it(damaged) -> None:
    from relaympi.results import RunFileError

    _, bad, good = damaged
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert bounded._context().get_start_method() in ("forkserver", "spawn")
        outcomes = [run for _, run in bounded.read_runs([good[0], bad[0]], timeout=LIMIT)]
    finally:
        stop.set()
        thread.join()
    assert not isinstance(outcomes[0], RunFileError) and outcomes[0].status == "completed"
    assert isinstance(outcomes[1], RunFileError)
    assert outcomes[1].reason == bounded.timeout_reason(LIMIT)


def test_workers_are_forks_only_of_a_single_threaded_caller(monkeypatch) -> None:
    monkeypatch.setattr(bounded.threading, "active_count", lambda: 1)
    assert bounded._context().get_start_method() == "fork"
    monkeypatch.setattr(bounded.threading, "active_count", lambda: 3)
    assert bounded._context().get_start_method() == "forkserver"
