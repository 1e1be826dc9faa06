"""Membership under --on-failure continue: who is still in the run, the topology the survivors
build, the snapshots a healed step is redone from, and the record of each change
(docs/membership.md).

A worker keeps its original rank as its id for life: ``members`` lists the ids of the current
workers in their (new) rank order, and the run file's per-worker columns stay as wide as the run
started, NaN for a lost worker from the step it was lost on.

The rule that makes every engine agree: a worker lost at step s takes no part in step s or later.
The survivors agree on s (the earliest step any of them was in when the loss interrupted it), go
back to the state they had when step s began (each rank keeps the snapshots of its last two step
starts: the per-step agreement on stop flags keeps the ranks within one step of each other), build
the algorithm again over the survivors and run step s on it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relaympi.comm.base import number_nodes
from relaympi.config import ConfigError
from relaympi.topology import Topology, TopologyError, build
from relaympi.topology.graphs import exponential
from relaympi.training.plan import Plan

FAULT_ENV = "RELAYMPI_INJECT_FAILURE"


# where in a step an injected loss strikes (docs/membership.md#the-same-losses-on-every-engine)
PHASES: dict[str, str] = {
    "start": "at the start of step STEP, before its evaluation (the default)",
    "gradient": "after the gradient of step STEP, before its exchange",
    "exchange": "inside step STEP's exchange, once its first messages are posted",
    "agreement": "after step STEP, just before the agreement that ends it",
    "evaluation": "right after its part of the evaluation at step STEP",
    "checkpoint": "inside the checkpoint of step STEP, once its own file is written",
    "flush": "right after the run file's row of step STEP is flushed (the writer)",
    "end": "after the last step (STEP: the run's last), before the run's end agreement",
    "heal": "inside the first heal at step STEP or later, after the survivors shrank",
    "startup": "while the job starts (STEP 0), before any step: the rank fails (MPI ranks)",
}
# phases the batched engine (one process, rows of one tensor) can stage: a worker leaves only at a
# step's start there
START_PHASES = ("start",)


@dataclass(frozen=True)
class Injection:
    """One injected loss: worker ``rank`` vanishes at ``step``, where ``phase`` says."""

    rank: int
    step: int
    phase: str = "start"


def injected_losses() -> list[Injection]:
    """RELAYMPI_INJECT_FAILURE=RANK:STEP[:PHASE][,...] as Injections (empty when unset).

    Returns:
        One Injection per entry, in the order given.

    Raises:
        ConfigError: a malformed value, an unknown phase or a rank named twice (one line).
    """
    value = os.environ.get(FAULT_ENV, "")
    losses: list[Injection] = []
    if not value:
        return losses
    for item in value.split(","):
        fields = item.split(":")
        try:
            if len(fields) not in (2, 3):
                raise ValueError(item)
            rank, step = int(fields[0]), int(fields[1])
        except ValueError:
            raise ConfigError(
                f"{FAULT_ENV}={value!r}; expected RANK:STEP[:PHASE] or RANK:STEP,RANK:STEP..., "
                "e.g. 1:5 or 1:5:exchange"
            ) from None
        phase = fields[2] if len(fields) == 3 else "start"
        if phase not in PHASES:
            raise ConfigError(
                f"{FAULT_ENV}={value!r}: unknown phase {phase!r}; choose one of "
                + ", ".join(PHASES)
            )
        if rank < 0 or step < 0:
            raise ConfigError(f"{FAULT_ENV}={value!r}: ranks and steps are >= 0")
        if phase == "startup" and step != 0:
            raise ConfigError(
                f"{FAULT_ENV}={value!r}: phase startup takes STEP 0 (it fails before any step)"
            )
        twice = [loss for loss in losses if loss.rank == rank]
        if twice:
            first = twice[0]
            raise ConfigError(
                f"{FAULT_ENV}={value!r} names rank {rank} twice ({first.rank}:{first.step} and "
                f"{item}); a worker can be lost only once"
            )
        losses.append(Injection(rank, step, phase))
    return losses


def startup_failure(rank: int) -> str | None:
    """The failure RELAYMPI_INJECT_FAILURE names for MPI rank ``rank`` while the job starts (phase
    startup), as a failed start-up collective would raise it; None where it names none.

    Raises:
        ConfigError: a malformed RELAYMPI_INJECT_FAILURE (one line).
    """
    for loss in injected_losses():
        if loss.phase == "startup" and loss.rank == rank:
            return f"injected failure on rank {rank} at start-up ({FAULT_ENV})"
    return None


class HealError(RuntimeError):
    """The survivors of a loss cannot go on (their topology cannot be built): a failure of the
    run, recorded as such (exit status 1), not a misuse; one line says why."""


def survivor_topology(plan: Plan, survivor_nodes: Sequence[int]) -> Topology:
    """The run's topology family built again over the survivors (one node id each, in their rank
    order), placed as the run was (--placement, as resolved).

    Raises:
        HealError: the family cannot be built for that many workers (one line).
    """
    name, count = plan.topology.name, len(survivor_nodes)
    nodes = number_nodes(survivor_nodes)
    try:
        if name == "exponential":  # SGP: hops 2^k over any count (exact mixing needs 2^m)
            return exponential(count, any_size=True)
        if name == "ring" and count == 2:  # two workers on a ring are a chain of two
            return build("chain", count)
        if plan.cfg.placement == "nodes":
            return build(name, count, placement="nodes", nodes=nodes)
        return build(name, count)
    except TopologyError as exc:
        raise HealError(
            f"--on-failure continue: topology {name!r} cannot be built again over the "
            f"{count} surviving workers: {exc}"
        ) from None


def survivors_resume(cfg: Any, size: int) -> tuple[int, tuple[int, ...], Any] | None:
    """A rerun on exactly the survivors' count of a run whose checkpoint was saved after a loss:
    (the run's first count, the survivors' ids, its nodes or None); None for any other run."""
    from relaympi.training import checkpoint_files

    if cfg.checkpoint_dir is None:
        return None
    meta = checkpoint_files.read_meta(cfg.checkpoint_dir)
    if not meta or meta.get("members") is None:
        return None
    members, first = tuple(int(m) for m in meta["members"]), int(meta.get("world_size") or 0)
    if len(members) != size or first == size:
        return None
    return first, members, meta.get("nodes")


def check_heals(plan: Plan) -> None:
    """Refuse --on-failure continue at the start for a topology that cannot be rebuilt over fewer
    workers (an edge list fixes its count, say), rather than at the first loss."""
    if plan.world_size > 2:
        survivors = list(plan.nodes or (0,) * plan.world_size)[:-1]
        try:
            survivor_topology(plan, survivors)
        except HealError as exc:  # known before the run starts: a misuse
            raise ConfigError(str(exc)) from None


@dataclass
class Snapshot:
    """One rank's state when a step began: what a healed step is redone from."""

    step: int
    state: dict[str, Any]  # TrainingLoop.state() (x, optimizer, algorithm, loop, bytes)
    flags: tuple[bool, bool]  # the stop and divergence flags this rank brought to the last agree


class Snapshots:
    """The last two step starts of this rank (a rank is never more than one step ahead of another
    survivor: every step ends in an agreement of all ranks)."""

    def __init__(self) -> None:
        self._kept: list[Snapshot] = []

    def take(self, step: int, state: dict[str, Any], flags: tuple[bool, bool]) -> None:
        if self._kept and self._kept[-1].step == step:
            self._kept.pop()
        self._kept.append(Snapshot(step, _copied(state), flags))
        del self._kept[:-2]

    @property
    def latest(self) -> int:
        """The step of the latest snapshot (this rank's position: it has finished every step
        before it)."""
        return self._kept[-1].step

    def at(self, step: int) -> Snapshot:
        for snapshot in self._kept:
            if snapshot.step == step:
                return snapshot
        raise RuntimeError(
            f"no snapshot of step {step} (kept: {[s.step for s in self._kept]}): the survivors "
            "drifted more than one step apart"
        )


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a state (tensors cloned: the live ones change in place)."""
    return {
        key: (
            value.detach().clone()
            if isinstance(value, torch.Tensor)
            else _copied(value)
            if isinstance(value, dict)
            else copy.deepcopy(value)
        )
        for key, value in state.items()
    }


def change_record(
    step: int,
    lost: Sequence[int],
    lost_nodes: Sequence[int],
    lost_hosts: Sequence[str | None],
    world_size: int,
    heal_s: float,
    evicted: tuple[Sequence[int], float] = ((), 0.0),
) -> dict[str, Any]:
    """One membership change as the run file's ``membership`` attribute lists it.

    Args:
        step: the step from which the lost workers take no part.
        lost: their original ids.
        lost_nodes: their nodes, one each.
        lost_hosts: their hosts (None: unknown), one each.
        world_size: the workers after the change.
        heal_s: seconds from the failure being noticed (an eviction: from the silence that led to
            it) to the first step on the new membership.
        evicted: those of ``lost`` evicted for silence (--peer-timeout) and the longest any
            survivor waited for them; recorded as ``stalled`` and ``silent_s`` where any.

    Returns:
        The record.
    """
    record: dict[str, Any] = {
        "step": int(step),
        "lost": [int(r) for r in lost],
        "lost_nodes": [int(n) for n in lost_nodes],
        "lost_hosts": list(lost_hosts),
        "world_size": int(world_size),
        "heal_s": float(heal_s),
    }
    stalled, silent_s = evicted
    if stalled:
        record["stalled"] = sorted(int(r) for r in stalled)
        record["silent_s"] = float(silent_s)
    return record


def heal_table() -> str:
    """docs/membership.md's table of each algorithm's heal rule (its class's ``heal_rule``)."""
    from relaympi.algorithms import ALGORITHMS

    rows = [f"| `{name}` | {cls.heal_rule} |" for name, cls in ALGORITHMS.items()]
    return "\n".join(["| algorithm | over the survivors |", "|---|---|", *rows])


def readmission_weights(
    topology: Topology, members: Sequence[int], worker: int
) -> dict[int, float]:
    """Where a re-admitted worker's model comes from: the mean of its neighbours in the run's
    topology (every layer; ``topology`` over the run's first worker count) that are ``members``
    now, or of every member where none of its neighbours is one. Member id -> weight."""
    present = set(members)
    neighbours = {
        peer
        for layer in range(topology.num_layers)
        for peer in topology.neighbors(worker, layer)
        if peer in present
    }
    chosen = sorted(neighbours) if neighbours else sorted(present)
    return {member: 1.0 / len(chosen) for member in chosen}
