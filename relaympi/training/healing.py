"""The membership protocol of ``--on-failure continue`` (docs/membership.md): detect, agree,
go back, rebuild, and the run's end agreement, apart from the step loop.

The step loop calls a ``MembershipProtocol`` at named points (``start``, ``at`` a phase of a step,
``step_done``, ``step_agreed``, ``end``, ``heal``); each engine implements ``Membership`` (a
process's workers that only ever leave at a step's start: the batched engine) or
``PeerMembership`` (workers in other processes or threads, a loss anywhere in a step: message
passing). No rank leaves the loop until every rank agreed in ``end`` that the run is over, so a loss
at the last step is healed like any other, and a rank that finished its last step is never taken
for lost. A heal, the end agreement or closing the run file that outlasts RELAYMPI_HEAL_TIMEOUT ends
the process (``Watchdog``).
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import threading
import time
import weakref
from abc import ABC, abstractmethod
from typing import Any, Protocol

import numpy as np
import torch

from relaympi.config import ConfigError
from relaympi.training.membership import (
    FAULT_ENV,
    START_PHASES,
    Injection,
    Snapshots,
    change_record,
)
from relaympi.training.plan import Plan, Schedule
from relaympi.training.watchdog import HEAL_TIMEOUT_ENV, Watchdog, heal_timeout

log = logging.getLogger("relaympi.train")

# --on-failure continue on MPI: each rank writes DIR/worker<id>.pid ("PID HOST"), for a tool that
# kills ranks (benchmarks/kill_loop.py)
PID_DIR_ENV = "RELAYMPI_PID_DIR"
# seconds a failing rank without the run file waits for its writer to end before taking it over
WRITER_GRACE_S = 3.0
# tests only: a phase of the protocol ("heal", "end") in which every process stalls for good
STALL_ENV = "RELAYMPI_INJECT_STALL"


class Stopped(Exception):
    """The run ends early: ``status`` is diverged or preempted, at ``step``."""

    def __init__(self, status: str, step: int, detail: str = "") -> None:
        super().__init__(f"{status} at step {step} {detail}".strip())
        self.status, self.step, self.detail = status, step, detail


class Membership(ABC):
    """An engine's side of the membership protocol, for workers that leave only at a step's start
    (one process holds them all: nothing to detect, nothing to redo)."""

    @abstractmethod
    def survive_losses(self) -> None:
        """From now on a lost worker's peers carry on (its communication raises PeerLost)."""

    @abstractmethod
    def share_hosts(self, hosts: list[str] | None) -> list[str]:
        """Every worker's host, on every process (``hosts``: the root's list, None elsewhere)."""

    @abstractmethod
    def lose(self, step: int, workers: list[int]) -> list[int]:
        """Injected: ``workers`` (original ids) vanish at the start of ``step``.

        Args:
            step: the step they take no part in.
            workers: the original ids named for this step.

        Returns:
            The ids this process lost and healed over at once (a process whose own worker vanishes
            never returns; one whose peer vanishes returns [] and notices it in its next call).
        """

    @abstractmethod
    def agree_end(self, done: bool) -> bool:
        """The uniform end agreement of every current worker: the AND of their votes (True: this
        rank finished the run), the same everywhere, or PeerLost everywhere after a loss."""

    @abstractmethod
    def all_max(self, values: np.ndarray) -> np.ndarray:
        """The element-wise maximum over the current workers."""


class PeerMembership(Membership):
    """Workers in other processes or threads: a loss can interrupt any moment of a step, and the
    survivors heal by shrinking their communicator."""

    @abstractmethod
    def vanish(self, during: str | None = None) -> None:
        """This rank leaves as a killed process would: now (``during`` None), or inside the next
        ``"exchange"`` (once its first messages are posted) or ``"checkpoint"`` (once its own file
        is written)."""

    @abstractmethod
    def heal_vote(self) -> None:
        """A healing rank's vote in the agreement the others may be in (``agree_end``'s): it meets
        ranks that believe the run is over, so they heal too."""

    @abstractmethod
    def shrink(self) -> list[int]:
        """After PeerLost: shrink to the survivors (collective); the original ids lost."""

    @abstractmethod
    def min_over(self, value: int) -> int:
        """The minimum of ``value`` over the survivors of the last shrink (collective)."""

    def evicted(self, lost: list[int]) -> tuple[list[int], float]:
        """Which of the ``lost`` (original ids) were evicted for silence (--peer-timeout), not
        killed, and the longest any survivor waited for them (collective over the last shrink's
        survivors where the engine evicts; default: none, 0)."""
        return [], 0.0

    @abstractmethod
    def rebuild(self, lost: list[int], step: int) -> None:
        """Carry on over the last shrink's survivors: the algorithm built again over them (its heal
        rule), evaluation and checkpoints over the new membership."""


class Loop(Protocol):
    """What the protocol reads and restores of the step loop (relaympi.training.loop)."""

    plan: Plan
    schedule: Schedule
    checkpoints: Any
    optimizer: Any
    writer: Any
    is_root: bool
    workers: range
    members: list[int]
    n0: int
    nodes0: tuple[int, ...]
    worker_noun: str
    interruptible: bool
    check_lag: int
    loss_sum: float | np.ndarray
    loss_count: int
    last_train_loss: float | np.ndarray | None

    @property
    def x(self) -> torch.Tensor: ...

    @property
    def bytes_counter(self) -> np.ndarray: ...


# the protocols of this process's workers (one per MPI rank; every worker of --backend local): the
# one that holds the run file's writer then is the one a watchdog marks it through
_HERE: weakref.WeakSet[MembershipProtocol] = weakref.WeakSet()


class MembershipProtocol:
    """The loop's side: injected losses at their phases, the step-start snapshots, heals, the
    change records and the end agreement. Inactive (every call a no-op) without --on-failure
    continue."""

    def __init__(
        self,
        loop: Loop,
        engine: Membership,
        injections: list[Injection],
    ) -> None:
        self.loop, self.engine, self.injections = loop, engine, injections
        self.active = False
        self.snapshots = Snapshots()
        self.hosts0: list[str] = []  # each original worker's host (one entry: all on that host)
        self.pending: dict[str, Any] | None = None  # a change, written after its first step
        self._lost_in_heal: list[int] = []  # lost so far by a heal not finished yet
        # the end agreement failed: this rank has cast the vote the healing ranks cast, so its heal
        # goes straight to the shrink
        self._voted = False
        self._began = False  # the steps began (the run file was opened)
        self.watchdog = Watchdog(
            heal_timeout(), self._ended, f"{loop.worker_noun} {loop.workers[0]}"
        )

    # -- the named points of the step loop ---------------------------------------------------
    def start(self, hosts: list[str] | None) -> None:
        """Under --on-failure continue: every worker learns every worker's host (a lost one is
        recorded by whichever rank writes the run file then), and losses are survived."""
        loop = self.loop
        self.active = loop.plan.cfg.on_failure == "continue"
        if not self.active:
            return
        _HERE.add(self)
        self._check_phases()
        if loop.interruptible:  # a healed step is redone from its start: settle every step
            loop.check_lag = 1
        self.hosts0 = self.engine.share_hosts(hosts)
        self.engine.survive_losses()
        pid_dir = os.environ.get(PID_DIR_ENV)
        if pid_dir and loop.plan.cfg.backend == "mpi":  # for a tool that kills ranks (kill loop)
            for worker in loop.workers:
                path = os.path.join(pid_dir, f"worker{worker}.pid")
                with open(path + ".tmp", "w") as file:
                    file.write(f"{os.getpid()} {socket.gethostname()}\n")
                os.replace(path + ".tmp", path)

    def _check_phases(self) -> None:
        """Refuse, at the start, injections whose phase this run never reaches."""
        loop, total = self.loop, self.loop.schedule.total_steps
        for loss in self.injections:
            where = f"{FAULT_ENV} {loss.rank}:{loss.step}:{loss.phase}"
            if loss.phase not in START_PHASES and not isinstance(self.engine, PeerMembership):
                raise ConfigError(f"{where}: this engine loses workers only at a step's start")
            if loss.phase == "end" and loss.step != total:
                raise ConfigError(f"{where}: phase end needs STEP {total}, the run's last step")
            if loss.phase == "checkpoint" and not (
                loop.checkpoints.enabled and loss.step % loop.schedule.checkpoint_every == 0
            ):
                raise ConfigError(f"{where}: no checkpoint is saved at step {loss.step}")

    def at(self, phase: str, step: int, now: bool = False) -> None:
        """An injected loss of ``phase`` at ``step``: its workers vanish here (an exchange's or a
        checkpoint's inside it, or at once with ``now``: an algorithm step that posted nothing)."""
        if not self.active:
            return
        workers = [i.rank for i in self.injections if i.step == step and i.phase == phase]
        if not workers:
            return
        if phase == "start":
            t0 = time.perf_counter()
            lost = self.engine.lose(step, workers)
            if lost:  # one process: healed at once, nothing to redo
                self.after_change(step, lost, t0, (False, False), None)
            return
        assert isinstance(self.engine, PeerMembership)  # refused at the start otherwise
        if any(worker in self.loop.workers for worker in workers):
            inside = phase in ("exchange", "checkpoint") and not now
            self.engine.vanish(phase if inside else None)

    def step_done(self, step: int, flags: tuple[bool, bool]) -> None:
        """Every step's end, before its agreement: what step ``step`` is redone from."""
        if self.active and self.loop.interruptible:
            self.snapshots.take(step, self.live_state(), flags)

    def first_snapshot(self, step: int) -> None:
        """Where the steps start (or resume): every rank passed the opening of the run file."""
        self._began = True
        self.step_done(step, (False, False))

    def step_agreed(self) -> None:
        """After a step's agreement: the first step on a new membership is done (or the run ends):
        its change is recorded."""
        change, self.pending = self.pending, None
        if self.loop.is_root and change is not None:
            self.loop.writer.add_membership(change)

    def end(self) -> None:
        """The run's end agreement: returns once every current worker has finished (then nobody
        may be taken for lost any more); raises PeerLost where one was lost first, so the survivors
        heal (a loss at the last step is healed like any other)."""
        if not self.active or not isinstance(self.engine, PeerMembership):
            return
        with self.watchdog.watching("end agreement"):
            self._stall("end")
            from relaympi.comm import PeerLost

            try:
                done = self.engine.agree_end(True)
            except PeerLost:
                self._voted = True
                raise
            if not done:  # a survivor is healing: join its heal
                self._voted = True
                raise PeerLost("a survivor is healing")

    def live_state(self) -> dict[str, Any]:
        """What a healed step is redone from (on the device, unlike a checkpoint's state)."""
        loop = self.loop
        return {
            "x": loop.x,
            "optimizer": loop.optimizer.state_dict(),
            "bytes_sent": torch.from_numpy(np.array(loop.bytes_counter, dtype=np.int64)),
            "losses": (np.copy(loop.loss_sum), loop.loss_count, copy.copy(loop.last_train_loss)),
        }

    # -- heal ---------------------------------------------------------------------------------
    def heal(self, bar: Any) -> int:
        """A worker was lost: meet the others (some may be in the end agreement), shrink to the
        survivors, agree on the step it interrupted (the earliest step any survivor was in), go
        back to the state each had when that step began, rebuild over the survivors and return that
        step."""
        engine = self.engine
        assert isinstance(engine, PeerMembership)  # only peers raise PeerLost
        with self.watchdog.watching("heal"):
            t0 = time.perf_counter()
            position = self.snapshots.latest
            if not self._voted:
                engine.heal_vote()
            self._voted = False
            lost = engine.shrink()
            self._lost_in_heal += lost  # with those of a shrink that another loss interrupted
            self._stall("heal")
            for loss in self.injections:  # a second loss inside the heal
                if loss.phase == "heal" and position >= loss.step:
                    if loss.rank in self.loop.workers:
                        engine.vanish()
            step = engine.min_over(position)
            lost_ids, self._lost_in_heal = self._lost_in_heal, []
            stalled, silent_s = engine.evicted(lost_ids)
            snapshot = self.snapshots.at(step)
            self._go_back(snapshot.state)
            engine.rebuild(lost_ids, step)
            self.snapshots = Snapshots()
            self.snapshots.take(step, self.live_state(), snapshot.flags)
            # an eviction's heal counts from the silence that led to it: detection included
            return self.after_change(
                step, lost_ids, t0 - silent_s, snapshot.flags, bar, (stalled, silent_s)
            )

    def _go_back(self, state: dict[str, Any]) -> None:
        loop = self.loop
        loop.x.copy_(state["x"])
        loop.optimizer.load_state_dict(state["optimizer"])
        loop.bytes_counter[...] = state["bytes_sent"].numpy()
        loss_sum, loop.loss_count, last = state["losses"]
        loop.loss_sum = float(loss_sum) if loss_sum.ndim == 0 else loss_sum.copy()
        loop.last_train_loss = copy.copy(last)

    def after_change(
        self,
        step: int,
        lost_ids: list[int],
        t0: float,
        flags: tuple[bool, bool],
        bar: Any,
        evicted: tuple[list[int], float] = ([], 0.0),
    ) -> int:
        """The run file after a change at ``step``: rows from it on are redone; the change itself
        is written once the first step on the new membership completed (changes at one step are
        merged). Then the stop flags of the step before, agreed among the survivors. ``evicted``:
        those of ``lost_ids`` evicted for silence and the seconds it lasted (--peer-timeout)."""
        loop = self.loop
        if loop.is_root:
            self._claim_writer(step, bool(evicted[0]))
            logging.getLogger().setLevel(min(logging.getLogger().level, logging.INFO))
        heal_s = time.perf_counter() - t0
        stop, bad, heal_s = self.engine.all_max(
            np.array([float(flags[0]), float(flags[1]), heal_s])
        )
        nodes = [loop.nodes0[i] for i in lost_ids]
        hosts = [self.hosts0[i] if len(self.hosts0) == loop.n0 else None for i in lost_ids]
        stalled, silent_s = evicted
        change = self.pending
        if change is not None and change["step"] == step:
            lost_ids, nodes = change["lost"] + lost_ids, change["lost_nodes"] + nodes
            hosts, heal_s = change["lost_hosts"] + hosts, change["heal_s"] + heal_s
            stalled = change.get("stalled", []) + stalled
            silent_s = max(change.get("silent_s", 0.0), silent_s)
        self.pending = change_record(
            step, lost_ids, nodes, hosts, len(loop.members), heal_s, (stalled, silent_s)
        )
        if loop.is_root:
            log.warning(
                "lost %s at step %d; %d workers carry on (healed in %.2f s)",
                ", ".join(
                    f"{loop.worker_noun} {i} (node {n}"
                    + (f", stalled: silent for {silent_s:.2f} s)" if i in stalled else ")")
                    for i, n in zip(lost_ids, nodes, strict=True)
                ),
                step,
                len(loop.members),
                heal_s,
            )
        if bar is not None:
            bar.n = step
            bar.refresh()
        if bad > 0:
            raise Stopped("diverged", step, "non-finite loss or model")
        if stop > 0 and step < loop.schedule.total_steps:
            raise Stopped("preempted", step)
        return step

    def _claim_writer(self, step: int, stalled: bool = False) -> None:
        """The root after a change: its writer drops the rows from ``step`` on (they are redone);
        a new root (the old one was lost) takes the run file over (``stalled``: a rank was evicted
        for silence, perhaps the old root, whose stopped process still holds the file's lock)."""
        loop = self.loop
        if loop.writer is not None:
            loop.writer.rewind(step)
            return
        from relaympi.results import RunWriter

        assert loop.plan.cfg.out is not None
        loop.writer = RunWriter.take_over(loop.plan.cfg.out, from_step=step, writer_stalled=stalled)
        if loop.checkpoints.enabled and loop.writer.run_id is not None:
            loop.checkpoints.claim(loop.writer.run_id)

    def _ended(self, phase: str) -> int:
        """The watchdog ends this process in ``phase``: the run file says preempted where a
        checkpoint was saved (a rerun resumes it), else failed; the exit status (4 or 1) says the
        same."""
        from relaympi.training import checkpoint_files
        from relaympi.training.run_file import close_quietly, record_failure

        folder = self.loop.plan.cfg.checkpoint_dir
        meta = checkpoint_files.read_meta(folder) if folder is not None else None
        saved = int(meta["step"]) if meta and meta.get("step") is not None else None
        why = f"the {phase} did not finish within {self.watchdog.limit_s:g} s ({HEAL_TIMEOUT_ENV})"
        try:
            writer = self._writer_at_end()
            if writer is not None and saved is not None:
                writer.set_status(
                    "preempted",
                    stopped_step=saved,
                    stopped_epoch=self.loop.schedule.epoch_at(saved),
                    checkpoint_saved=True,
                    error=why,
                )
            elif writer is not None:
                record_failure(writer, RuntimeError(why))
            if writer is not None:
                close_quietly(writer)
        except Exception as exc:  # noqa: BLE001 - the process ends either way
            log.error("could not record the end in the run file: %s", exc)
        return 1 if saved is None else 4

    def failed_without_writer(self, exc: BaseException) -> None:
        """This rank fails and holds no run file: where the file's writer was lost (the file says
        running and nobody writes it) it records the failure, as the writer would have."""
        from relaympi.results.writer import in_use
        from relaympi.training.run_file import close_quietly, record_failure

        out = self.loop.plan.cfg.out
        if not self.active or not self._began or out is None:
            return
        try:
            # a live writer records the run's end itself (told by report_failure, or failing too);
            # in one process, a vanished worker's thread may still be closing its file
            deadline = time.monotonic() + WRITER_GRACE_S
            while in_use(out) and time.monotonic() < deadline:
                time.sleep(0.05)
            writer = self._writer_at_end(this_process=False)  # the others' writer goes on
            if writer is not None:
                record_failure(writer, exc)
                close_quietly(writer)
        except Exception as again:  # noqa: BLE001 - the run's own error is the one to raise
            log.error("could not record the failure in the run file: %s", again)

    def _writer_at_end(self, this_process: bool = True) -> Any:
        """The writer through which this rank records its end: with ``this_process``, one of this
        process's workers' (still open; the process ends); else, once the steps began, the run
        file taken over where its writer's process is gone and it still says running
        (RunWriter.take_over_abandoned: of several ranks, one gets it); None otherwise."""
        if this_process:
            for protocol in list(_HERE):
                writer = protocol.loop.writer
                if writer is not None and writer.is_open:
                    return writer
        out = self.loop.plan.cfg.out
        if not self._began or out is None:
            return None
        from relaympi.results import RunWriter

        return RunWriter.take_over_abandoned(out)

    def _stall(self, phase: str) -> None:
        """RELAYMPI_INJECT_STALL=PHASE (tests): every process stalls here for good, as a heal stuck
        inside MPI would."""
        if os.environ.get(STALL_ENV) == phase:
            threading.Event().wait()
