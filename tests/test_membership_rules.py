"""--on-failure continue's rules that need no run: the heal-rule table in the docs, the injection
variable, the survivors' topology and the snapshots a healed step is redone from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relaympi.config import ConfigError
from relaympi.training.membership import HealError, Snapshots, heal_table, injected_losses

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_table_is_each_algorithms_own_heal_rule():
    assert heal_table() in (ROOT / "docs" / "membership.md").read_text()


def test_injected_losses_parse_several_and_refuse_bad_ones(monkeypatch):
    monkeypatch.setenv("RELAYMPI_INJECT_FAILURE", "3:10,5:40,1:10")
    assert injected_losses() == {10: [3, 1], 40: [5]}
    for bad in ("3", "3:x", "3:10,", "-1:4"):
        monkeypatch.setenv("RELAYMPI_INJECT_FAILURE", bad)
        with pytest.raises(ConfigError, match="RELAYMPI_INJECT_FAILURE"):
            injected_losses()


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
