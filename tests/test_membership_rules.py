"""--on-failure continue's rules that need no run: the heal-rule table in the docs, the injection
variable, the survivors' topology and the snapshots a healed step is redone from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relaympi.config import ConfigError
from relaympi.training.membership import (
    HealError,
    Injection,
    Snapshots,
    heal_table,
    injected_losses,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_table_is_each_algorithms_own_heal_rule():
    assert heal_table() in (ROOT / "docs" / "membership.md").read_text()


def test_injected_losses_parse_several_and_refuse_bad_ones(monkeypatch):
    monkeypatch.setenv("RELAYMPI_INJECT_FAILURE", "3:10,5:40:exchange,1:10:heal")
    assert injected_losses() == [
        Injection(3, 10, "start"),
        Injection(5, 40, "exchange"),
        Injection(1, 10, "heal"),
    ]
    for bad in ("3", "3:x", "3:10,", "-1:4", "3:10:start:1"):
        monkeypatch.setenv("RELAYMPI_INJECT_FAILURE", bad)
        with pytest.raises(ConfigError, match="RELAYMPI_INJECT_FAILURE"):
            injected_losses()
    monkeypatch.setenv("RELAYMPI_INJECT_FAILURE", "1:5:lunch")
    with pytest.raises(ConfigError, match="unknown phase 'lunch'; choose one of start, gradient"):
        injected_losses()


def test_a_rank_named_twice_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """The second entry for a rank used to be ignored without a word."""
    from relaympi import train

    monkeypatch.setenv("RELAYMPI_INJECT_FAILURE", "1:5,1:6")
    with pytest.raises(ConfigError, match=r"names rank 1 twice \(1:5 and 1:6\)"):
        injected_losses()
    args = ["--task", "quadratics", "--backend", "local", "--workers", "4", "--steps", "8"]
    status = train.main([*args, "--on-failure", "continue", "--out", str(tmp_path / "r.h5")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert status == train.EXIT_USAGE
    assert len(errors) == 1 and "names rank 1 twice" in errors[0]
    assert not (tmp_path / "r.h5").exists()


def test_snapshots_keep_the_last_two_step_starts_as_copies():
    snapshots = Snapshots()
    x = torch.zeros(3)
    for step in range(4):
        x += 1
        snapshots.take(step, {"x": x, "nested": {"m": x * 2}}, (False, step == 3))
    assert snapshots.latest == 3
    assert snapshots.at(2).state["x"].tolist() == [3.0] * 3  # a copy, not the live tensor
    assert snapshots.at(3).state["nested"]["m"].tolist() == [8.0] * 3
    assert snapshots.at(3).flags == (False, True)
    with pytest.raises(RuntimeError, match="no snapshot of step 1"):
        snapshots.at(1)


def test_the_survivors_topology_is_the_same_family_over_their_count():
    from relaympi.config import RunConfig
    from relaympi.training.membership import survivor_topology
    from relaympi.training.plan import resolve

    plan = resolve(RunConfig(task="quadratics", algo="sgp", backend="local", workers=8), 8)
    healed = survivor_topology(plan, [0] * 7)
    assert (healed.name, healed.world_size) == ("exponential", 7)
    relay = resolve(RunConfig(task="quadratics", algo="relay", backend="local", workers=8), 8)
    assert survivor_topology(relay, [0] * 5).name == relay.topology.name
    with pytest.raises(HealError, match="cannot be built again over the 0 surviving"):
        survivor_topology(relay, [])


def test_the_in_process_agreement_is_uniform_and_fails_everywhere_after_a_loss():
    """What the end agreement relies on: every survivor gets the same answer, or PeerLost."""
    from relaympi.comm import PeerLost, run_local
    from relaympi.comm.local import VANISHED

    def body(comm):
        comm.survive_losses()
        votes = (comm.agree(True), comm.agree(comm.rank != 1))
        if comm.rank == 2:
            comm.vanish()
        try:
            comm.agree(True)
        except PeerLost:
            return votes, "lost"
        return votes, "agreed"

    results = run_local(4, body)
    assert results[2] == VANISHED
    assert [results[r] for r in (0, 1, 3)] == [((True, False), "lost")] * 3


def test_an_in_process_loss_reaches_a_rank_only_through_a_call_that_needs_it():
    """As on MPI: a survivor that needs nothing of the lost rank finishes its step's messages; the
    next collective fails on every survivor."""
    import time

    import numpy as np

    from relaympi.comm import PeerLost, run_local

    def body(comm):
        comm.survive_losses()
        got = np.zeros(1)
        if comm.rank == 2:
            comm.vanish()
        if comm.rank == 1:
            time.sleep(0.3)  # sends after rank 2 is gone and rank 3 waits in the collective
            comm.exchange({0: np.ones(1)}, {}).wait()
        if comm.rank == 0:
            comm.exchange({}, {1: got}).wait()
        try:
            comm.allreduce_flags(np.zeros(1))
        except PeerLost:
            return float(got[0])
        return None

    results = run_local(4, body)
    assert [results[r] for r in (0, 1, 3)] == [1.0, 0.0, 0.0]


def test_the_kill_loop_counts_a_rank_killed_after_the_run_ended_as_finished():
    """A kill after the last step's line can land once every rank agreed that the run is over:
    that worker finished (numbers in the last row), and is not missing from the losses."""
    from types import SimpleNamespace

    import numpy as np

    from benchmarks.kill_loop import finished_before_kill

    last = np.array([[1.0, np.nan, 1.0, 1.0], [1.0, np.nan, 1.0, np.nan]])
    kills = [
        {"workers": [1], "seen_at_step": 10},
        {"workers": [2], "seen_at_step": 40},  # finished: numbers in the last row
    ]
    run = SimpleNamespace(data={"train_loss": last[:1]})
    assert finished_before_kill(run, kills, [1], 40) == [2]
    run = SimpleNamespace(data={"train_loss": last})  # lost at the last step: recorded
    kills[1]["workers"] = [3]
    assert finished_before_kill(run, kills, [1, 3], 40) == []
