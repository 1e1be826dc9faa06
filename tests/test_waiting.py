"""How an MPI rank waits (relaympi.comm.waiting): polls until done, checking between polls, yields
for the first 10 ms, then sleeps that grow with the wait and stay within a quarter of it;
RELAYMPI_WAIT refused in one line where it names no mode; the numbers are the same whichever way
the ranks wait."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from relaympi.comm import waiting
from relaympi.results import read_run
from tests.conftest import requires_mpirun, run_train


def test_poll_returns_once_done_and_checks_between_polls():
    calls = {"done": 0, "between": 0}

    def done():
        calls["done"] += 1
        return calls["done"] == 5

    def between():
        calls["between"] += 1

    for mode in ("yield", "sleep"):
        calls.update(done=0, between=0)
        waiting.poll(done, between, mode)
        assert calls == {"done": 5, "between": 4}
    calls.update(done=4, between=0)
    waiting.poll(done, between, "sleep")  # done at once: nothing checked, no sleep
    assert calls == {"done": 5, "between": 0}


def test_a_failure_seen_between_polls_ends_the_wait():
    def between():
        raise RuntimeError("rank 2 failed")

    with pytest.raises(RuntimeError, match="rank 2 failed"):
        waiting.poll(lambda: False, between, "sleep")


POLL_S = 1e-6  # a poll's own cost on the fake clock


def _fake_clock(monkeypatch) -> tuple[dict, list[float], list[float]]:
    """A clock that advances by each sleep and by POLL_S per poll (``_polled``); (clock, sleeps,
    the times of the yields)."""
    clock = {"now": 0.0}
    slept: list[float] = []
    yielded: list[float] = []
    # the poller's clock (and its deadline's) is perf_counter; monotonic too, in case it moves
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(time, "monotonic", lambda: clock["now"])

    def sleep(seconds):
        slept.append(seconds)
        clock["now"] += seconds

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(os, "sched_yield", lambda: yielded.append(clock["now"]))
    return clock, slept, yielded


def _polled(clock: dict, ready_at: float):
    """A test of a transfer that lands at ``ready_at``, each call costing POLL_S."""

    def done():
        clock["now"] += POLL_S
        return clock["now"] >= ready_at

    return done


def test_sleeps_grow_with_the_wait_and_overshoot_it_by_at_most_a_quarter(monkeypatch):
    clock, slept, yielded = _fake_clock(monkeypatch)
    ready_at = 0.05  # the transfer lands 50 ms into the wait
    waiting.poll(_polled(clock, ready_at), lambda: None, "sleep")
    assert slept and slept == sorted(slept) and max(slept) <= waiting.MAX_SLEEP_S
    assert all(s <= waiting.SLEEP_FRACTION * ready_at + 1e-9 for s in slept)
    assert clock["now"] - ready_at <= waiting.MAX_SLEEP_S  # a late transfer: at most one sleep
    # the first YIELD_S yield between polls, and sleeps only after it
    assert yielded and max(yielded) <= waiting.YIELD_S + POLL_S
    assert len(yielded) == pytest.approx(waiting.YIELD_S / POLL_S, rel=0.01)
    assert min(slept) >= min(waiting.MAX_SLEEP_S, waiting.SLEEP_FRACTION * waiting.YIELD_S)


def test_a_short_wait_yields_and_never_sleeps(monkeypatch):
    clock, slept, yielded = _fake_clock(monkeypatch)
    for mode, ready_at in (("sleep", 0.9 * waiting.YIELD_S), ("yield", 0.05)):
        slept.clear()
        yielded.clear()
        clock["now"] = 0.0
        waiting.poll(_polled(clock, ready_at), lambda: None, mode)
        assert not slept and len(yielded) == pytest.approx(ready_at / POLL_S, rel=0.01), mode
        assert clock["now"] - ready_at <= POLL_S, mode  # landed: seen at the next poll


def test_a_wait_with_a_deadline_sleeps_no_later_than_the_deadline(monkeypatch):
    clock, slept, yielded = _fake_clock(monkeypatch)
    for mode, until in (("sleep", 0.0305), ("spin", 0.002)):
        clock["now"] = 0.0
        assert not waiting.poll(_polled(clock, 1.0), lambda: None, mode, until=until)
        assert until <= clock["now"] <= until + 2 * POLL_S, mode  # not a sleep later
    assert max(slept) <= waiting.MAX_SLEEP_S
    assert max(yielded) <= waiting.YIELD_S + POLL_S  # spin never yields


def test_the_wait_mode_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.delenv(waiting.WAIT_ENV, raising=False)
    assert waiting.wait_mode() == waiting.DEFAULT_WAIT
    monkeypatch.setenv(waiting.WAIT_ENV, "yield")
    assert waiting.wait_mode() == "yield"
    monkeypatch.setenv(waiting.WAIT_ENV, "nap")
    with pytest.raises(ValueError, match="RELAYMPI_WAIT='nap'; choose one of spin, yield, sleep"):
        waiting.wait_mode()


@pytest.mark.slow
@pytest.mark.mpirun
@requires_mpirun
def test_every_wait_mode_records_the_same_run(tmp_path):
    args = ["--task", "quadratics", "--algo", "allreduce", "--steps", "12", "--eval-every", "4"]
    runs = []
    for mode in waiting.WAIT_MODES:
        out = tmp_path / f"{mode}.h5"
        run_train([*args, "--out", out], mpi=3, env={waiting.WAIT_ENV: mode}, check=0)
        runs.append(read_run(out))
    for run in runs[1:]:
        for name, values in runs[0].data.items():
            if not name.startswith("time_"):
                assert np.array_equal(run.data[name], values, equal_nan=True), name
    proc = run_train([*args, "--out", tmp_path / "bad.h5"], mpi=2, env={waiting.WAIT_ENV: "nap"})
    assert proc.returncode == 2 and "RELAYMPI_WAIT='nap'; choose one of" in proc.stderr
