"""The lagged agreement on stopping and divergence (relaympi.training.agreement): acted on ``lag``
steps after it is posted, completed wherever the model is read; a run that neither diverges nor
stops early records the same numbers at every lag, on every backend; a stopped run stops at the
boundary its agreement was due at, with its checkpoint there; a diverged run records the same
diverged step."""

from __future__ import annotations

import numpy as np
import pytest

from relaympi import train
from relaympi.config import ConfigError
from relaympi.engines.message_passing import MessagePassingRank
from relaympi.results import read_run
from relaympi.training.agreement import LAG_ENV, LaggedAgreement, agreement_lag
from tests.conftest import requires_mpirun, run_train

QUAD = ["--task", "quadratics", "--algo", "relay", "--steps", "14", "--eval-every", "5"]


class _World:
    """Fake transport: every rank's flags are this rank's, or a rank given ``others``' per step."""

    def __init__(self) -> None:
        self.others: dict[int, list[float]] = {}
        self.started: list[np.ndarray] = []
        self.waited = 0

    def start(self, flags: np.ndarray) -> _World:
        self.started.append(flags)
        return self

    def wait(self) -> None:
        flags = self.started[self.waited]
        flags[...] = np.maximum(flags, self.others.get(self.waited + 1, [0.0, 0.0]))
        self.waited += 1


def _boundaries(lag: int, others: dict[int, list[float]], drain_at=(), steps=10):
    """Post this rank's clean flags at boundaries 1..steps; the first verdict that acts."""
    world = _World()
    world.others = others
    agreement = LaggedAgreement(world.start, lag)
    for step in range(1, steps + 1):
        agreement.post(step, False, None)
        verdict = agreement.due(step, drain=step in drain_at)
        if verdict.stop or verdict.diverged_step is not None:
            return step, verdict, world.waited
    return None, None, world.waited


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_a_stop_posted_at_a_boundary_acts_lag_boundaries_later(lag):
    step, verdict, _ = _boundaries(lag, {4: [1.0, 0.0]})  # another rank stops at boundary 4
    assert (step, verdict.stop, verdict.diverged_step) == (4 + lag, True, None)


def test_a_boundary_that_reads_the_model_completes_every_agreement_in_flight():
    step, verdict, waited = _boundaries(3, {4: [1.0, 0.0]}, drain_at=(5,))
    assert (step, verdict.stop) == (5, True) and waited == 5
    # nothing to act on: drained, and no agreement waited for before it was due
    assert _boundaries(3, {}, drain_at=(6,), steps=6)[2] == 6
    assert _boundaries(3, {}, steps=6)[2] == 3


def test_a_divergence_records_the_posting_boundary_and_wins_over_a_stop():
    # another rank diverged at boundary 3: recorded there (this rank saw none), at boundary 3+2
    step, verdict, _ = _boundaries(2, {3: [0.0, 1.0]})
    assert (step, verdict.diverged_step, verdict.stop) == (5, 3, False)
    # a stop agreed at 2 completes every agreement in flight: the model went on to diverge at 3
    step, verdict, _ = _boundaries(2, {2: [1.0, 0.0], 3: [0.0, 1.0]})
    assert (step, verdict.diverged_step) == (4, 3)


def test_this_ranks_own_divergence_step_is_the_one_recorded():
    world = _World()
    agreement = LaggedAgreement(world.start, 1)
    agreement.post(7, False, 6)  # rank 0's loss at step 6 was non-finite: recorded at 6
    assert agreement.due(7, drain=False).resolved == 0
    agreement.post(8, False, None)
    verdict = agreement.due(8, drain=False)
    # and the run ends: boundary 8's agreement is completed too, none left in flight
    assert (verdict.resolved, verdict.diverged_step) == (2, 6) and agreement.in_flight == 0


def test_the_lag_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setenv(LAG_ENV, "3")
    assert agreement_lag() == 3
    for bad in ("-1", "one", "1.5"):
        monkeypatch.setenv(LAG_ENV, bad)
        with pytest.raises(ConfigError, match=f"{LAG_ENV}='{bad}'; expected a whole number"):
            agreement_lag()


def _run(tmp_path, monkeypatch, name, lag, args, poison=None):
    """A run in this process with RELAYMPI_AGREEMENT_LAG=lag; ``poison``: (rank, step) whose model
    turns NaN after that step."""
    monkeypatch.setenv(LAG_ENV, str(lag))
    if poison is not None:
        step_of = MessagePassingRank.algorithm_step

        def poisoned(self, step, lr):
            step_of(self, step, lr)
            if (self.rank, step) == poison:
                self.workload.x.fill_(float("nan"))

        monkeypatch.setattr(MessagePassingRank, "algorithm_step", poisoned)
    out = tmp_path / f"{name}-{lag}.h5"
    status = train.main([*map(str, args), "--out", str(out)])
    monkeypatch.undo()
    return status, read_run(out)


def _same_run(a, b):
    """Every dataset but the timers bit for bit, and every attribute but times and identity."""
    assert a.data.keys() == b.data.keys()
    for name in a.data:
        if not name.startswith("time_"):
            assert np.asarray(a.data[name]).tobytes() == np.asarray(b.data[name]).tobytes(), name
    skip = ("provenance", "config", "run_id", "start_time", "end_time")
    attrs = [
        {k: v for k, v in r.attrs.items() if "time_" not in k and k not in skip} for r in (a, b)
    ]
    assert attrs[0] == attrs[1]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "batched"])
def test_every_lag_records_the_same_run(tmp_path, monkeypatch, backend):
    args = [*QUAD, "--backend", backend, "--workers", "4"]
    _, expected = _run(tmp_path, monkeypatch, "r", 0, args)
    for lag in (1, 4):
        status, run = _run(tmp_path, monkeypatch, "r", lag, args)
        assert status == 0
        _same_run(expected, run)


@pytest.mark.slow
@pytest.mark.parametrize("poison", [(2, 2), (0, 6), (1, 8)])
def test_a_diverged_run_records_the_same_diverged_step_at_every_lag(tmp_path, monkeypatch, poison):
    args = [*QUAD, "--backend", "local", "--workers", "4"]
    _, expected = _run(tmp_path, monkeypatch, "d", 0, args, poison)
    assert expected.status == "diverged"
    for lag in (1, 3):
        _, run = _run(tmp_path, monkeypatch, "d", lag, args, poison)
        _same_run(expected, run)


@pytest.mark.slow
@pytest.mark.mpirun
@requires_mpirun
@pytest.mark.parametrize(
    "lag, stopped",
    [(0, 7), (1, 8), (2, 9), (3, 10)],  # 10: a checkpoint is due there, whatever the lag
)
def test_a_stop_moves_by_at_most_the_lag_and_checkpoints_where_it_stopped(tmp_path, lag, stopped):
    # MPI ranks: the signal reaches rank 0 alone, at a known step (in-process ranks share the stop
    # event, and with a lag one of them may already be a step behind when it is set)
    ckpt = tmp_path / "ckpt"
    args = [*QUAD, "--checkpoint-every", "10", "--checkpoint-dir", ckpt, "--out", tmp_path / "r.h5"]
    env = {"RELAYMPI_INJECT_SIGNAL": "TERM:7", LAG_ENV: str(lag)}
    run_train(args, mpi=2, env=env, check=4)
    run = read_run(tmp_path / "r.h5")
    assert (run.status, run.attrs["stopped_step"]) == ("preempted", stopped)
    assert sorted(p.name for p in ckpt.glob("*.pt")) == [
        f"rank{r:05d}.step{stopped:010d}.pt" for r in range(2)
    ]
    # the rerun resumes there and ends where an unstopped run ends
    run_train(args, mpi=2, env={LAG_ENV: str(lag)}, check=0)
    assert read_run(tmp_path / "r.h5").status == "completed"


@pytest.mark.slow
@pytest.mark.mpirun
@requires_mpirun
@pytest.mark.parametrize("algo", ["relay", "allreduce"])
def test_mpi_ranks_record_the_same_run_at_every_lag(tmp_path, algo):
    args = ["--task", "quadratics", "--algo", algo, "--steps", "14", "--eval-every", "5"]
    runs = []
    for lag in (0, 2):
        out = tmp_path / f"m{lag}.h5"
        run_train([*args, "--out", out], mpi=3, env={LAG_ENV: str(lag)}, check=0)
        runs.append(read_run(out))
    _same_run(*runs)
