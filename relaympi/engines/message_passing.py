"""The message-passing engine: one worker per rank, its workload, optimizer and algorithm over a
Communicator; the ranks are MPI processes (``--backend mpi``) or threads of one process (``--backend
local``).

    mpirun -n 16 python -m relaympi.train --algo relay --task cifar10
    python -m relaympi.train --task digits --backend local --workers 16 --algo relay --alpha 0.01
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relaympi.algorithms import make_algorithm
from relaympi.algorithms.base import ROUNDS_PER_STEP, round_id
from relaympi.comm import Communicator, PeerLost, run_local
from relaympi.comm.base import Request, number_nodes
from relaympi.comm.local import VANISHED
from relaympi.comm.stalls import PERIODS_PER_TIMEOUT, process_present
from relaympi.comm.waiting import wait_mode
from relaympi.config import ConfigError
from relaympi.launcher import cuda_overlap_mode
from relaympi.optim import make_optimizer
from relaympi.training.agreement import CATCH_UP_BEHIND
from relaympi.training.buckets import GradientBuckets
from relaympi.training.checkpoint_state import to_device
from relaympi.training.checkpointing import Checkpoints
from relaympi.training.evaluation import Evaluator
from relaympi.training.healing import PeerMembership
from relaympi.training.loop import (
    STOP,
    USAGE_ERRORS,
    TrainingLoop,
    WriterFactory,
    device_for,
)
from relaympi.training.membership import (
    Injection,
    check_heals,
    readmission_weights,
    survivor_topology,
)
from relaympi.training.plan import Plan
from relaympi.training.run_file import writer_factory
from relaympi.training.workloads import build_workload

log = logging.getLogger("relaympi.train")


def run(plan: Plan, out: Path, command: str, comm: Communicator | None = None) -> str:
    """Train ``plan`` on this MPI rank (``comm``), or with every worker a thread of this process
    (``comm`` None); return the run's status (rank 0's, for threads)."""
    if comm is None:
        # a rerun on the survivors of a lost worker runs only them (plan.members)
        members = plan.members or tuple(range(plan.world_size))
        statuses = run_local(
            len(members),
            run_rank,
            plan,
            out,
            command,
            drops=plan.drops,
            nodes=number_nodes([plan.nodes[m] for m in members]) if plan.nodes else None,
        )
        # the lowest surviving rank's (it wrote the run file last)
        return next(status for status in statuses if status != VANISHED)
    return run_rank(comm, plan, out, command)


def run_rank(comm: Communicator, plan: Plan, out: Path, command: str) -> str:
    """One rank's whole run; a failure is recorded (rank 0) or reported to rank 0 (others)."""
    try:
        worker = MessagePassingRank(comm, plan, writer_factory(plan, out, command))
    except USAGE_ERRORS as exc:
        # setup errors are the same on every rank; agree on them so none waits for the others
        comm.allreduce_flags(np.array([1.0]))
        raise exc
    if comm.allreduce_flags(np.array([0.0]))[0] > 0:
        raise ConfigError("another rank failed to set up (see its error above)")
    return worker.run()


class MessagePassingRank(TrainingLoop):
    """One rank of a message-passing run: its workload, optimizer and algorithm over a
    Communicator."""

    worker_noun = "rank"

    def __init__(
        self,
        comm: Communicator,
        plan: Plan,
        writer_factory: WriterFactory,
        stop: threading.Event = STOP,
    ):
        super().__init__(writer_factory, stop)
        try:
            comm.wait_mode = wait_mode()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.comm, self.plan = comm, plan
        self.rank, self.n = comm.rank, comm.world_size
        self.is_root = self.rank == 0
        # the original ids of the run's workers (a rerun on the survivors of a loss: plan.members)
        self.members, self.n0 = list(plan.members or range(self.n)), plan.world_size
        # each original worker's node (resumed on the survivors: the run's, from its plan)
        self.nodes0 = (tuple(plan.nodes) or (0,) * self.n0) if plan.members else comm.nodes
        me = self.members[self.rank]
        self.workers = range(me, me + 1)  # this worker's id for life (its first rank)
        # --replay-drops of a run that lost workers: each vanishes at the start of its step
        self.inject = self.inject + [Injection(w, step) for step, w in plan.replayed_losses]
        self.check_injection(self.n0)
        # late drops of a communicator that a heal replaced, not yet in the run file
        self.pending_late: list[tuple[int, ...]] = []
        # under --on-failure continue: every rank's late drops not yet in the run file, shared at
        # each step's end (after_step), so that a worker lost later takes none of them with it
        self.shared_late: list[tuple[int, ...]] = []
        # the steps this worker skipped to catch up (step, worker), not yet in the run file; and
        # whether it skipped the step before (it then goes on skipping while any neighbour is ahead)
        self.skipped: list[tuple[int, int]] = []
        self._catching_up = False
        comm.deadline = plan.cfg.message_deadline if comm.backend == "mpi" else None
        if comm.deadline is not None and plan.cfg.on_failure != "continue":
            # a rank behind catches up by skipping (skips): it is waited for again once it sends
            # from a recent step, not while its old messages land
            comm.catch_up_rounds = CATCH_UP_BEHIND * ROUNDS_PER_STEP
        if plan.cfg.on_failure == "continue":
            check_heals(plan)
        cfg = plan.cfg
        self.workload = build_workload(plan, me, device_for(cfg, self.rank))
        self.num_classes = self.workload.num_classes
        self.schedule = plan.schedule(self.workload.steps_per_epoch)
        x = self.workload.x
        self.optimizer = make_optimizer(plan.optimizer, x)
        topology = (
            survivor_topology(plan, [self.nodes0[m] for m in self.members])
            if plan.members
            else plan.topology
        )
        self.algorithm = make_algorithm(
            cfg.algo, comm, topology, self.optimizer, x, plan.algorithm_options
        )
        assert cfg.out is not None  # the plan names its run file (Plan.with_out)
        self.checkpoints = Checkpoints(
            cfg,
            Path(cfg.out),
            me,
            self.n0,
            barrier=comm.barrier,
            nodes=self.nodes0 if plan.members else comm.nodes,
        )
        self.evaluator = Evaluator(comm, plan, self.schedule, self.workload)
        self.evaluator.n0 = self.n0
        if plan.members:  # resumed on the survivors: they go on as they were
            self.checkpoints.heal(self.rank, comm.barrier, self.members)
            self.evaluator.members = self.members
        # --overlap: each bucket's step starts from backward's hooks; the step's timers then split
        # into backward with the work started inside it (compute) and the exposed rest
        # (comm: finish_step)
        self.buckets = (
            GradientBuckets(
                self.workload.grad,
                _trainable(self.workload),
                cfg.bucket_size,
                comm.progress,
                any_thread=cuda_overlap_mode() == "hooks",
            )
            if cfg.overlap
            else None
        )
        # and a thread that runs MPI's progress engine during backward, between the
        # hooks (docs/overlap.md)
        if (
            self.buckets is not None
            and cfg.progress_thread
            and not comm.start_progress_thread(cfg.progress_interval * 1e-3)
            and self.is_root
        ):
            log.warning(
                "no progress thread: this MPI does not provide MPI_THREAD_MULTIPLE (the "
                "run file's transport records "
                "its thread_level); only the hooks' MPI_Test calls move the transfers "
                "during backward"
            )

    @property
    def x(self) -> torch.Tensor:
        return self.workload.x

    @property
    def bytes_counter(self) -> np.ndarray:
        return self.comm.bytes_sent

    def hosts(self) -> list[str] | None:
        return self.comm.gather(socket.gethostname())

    def transport(self) -> dict[str, Any]:
        return self.comm.describe()

    def on_root_agreed(self, action: Any) -> bool:
        """Run ``action`` on rank 0 only and share its truth value; a usage error there stops every
        rank (the others must not go on to wait for rank 0 in a collective)."""
        result, error = 0.0, None
        if self.rank == 0:
            try:
                result = 1.0 if action() else 0.0
            except USAGE_ERRORS as exc:
                error = exc
        flags = self.comm.allreduce_flags(np.array([1.0 if error else 0.0, result]))
        if flags[0] > 0:
            raise (
                error
                if error is not None
                else ConfigError("rank 0 refused the run (see its error)")
            )
        return bool(flags[1])

    def report_failure(self, message: str) -> None:
        self.comm.report_failure(message)

    def membership_state(self) -> dict[str, Any]:
        if self.evaluator.members is None:
            return {}
        # after a loss: the bytes sent over every communicator so far (total, inter-node)
        total = self.evaluator.carried_bytes + [
            float(self.comm.bytes_sent.sum()),
            float(self.comm.inter_node_bytes()),
        ]
        return {"bytes_total": torch.from_numpy(total)}

    def restored(self, state: dict[str, Any]) -> None:
        if "bytes_total" in state:  # the bytes of the communicators before this one
            here = [float(self.comm.bytes_sent.sum()), float(self.comm.inter_node_bytes())]
            self.evaluator.carried_bytes = state["bytes_total"].numpy().astype(float) - here

    def readmit(self, state: dict[str, Any] | None, lost: list[int]) -> None:
        """Back to full strength: a survivor restores its own checkpoint (not its algorithm's
        state: the algorithm starts again over everyone); each lost worker takes the mean of its
        surviving neighbours' models (readmission_weights), a fresh optimizer, zero bytes."""
        x, me = self.workload.x, self.workers.start
        members = [w for w in range(self.n0) if w not in lost]
        if state is not None:
            x.copy_(state["x"])
            self.optimizer.load_state_dict(to_device(state["optimizer"], x.device))
            self.restore_common(state)
            if "bytes_total" in state:
                self.evaluator.carried_bytes = state["bytes_total"].numpy().astype(float)
        for worker in lost:  # one sum each, in worker order: the same on every rank
            weight = readmission_weights(self.plan.topology, members, worker).get(me, 0.0)
            mean = x * weight if weight else torch.zeros_like(x)
            self.comm.allreduce_sum(mean)
            if me == worker:
                x.copy_(mean)
        cfg = self.plan.cfg
        self.algorithm = make_algorithm(
            cfg.algo, self.comm, self.plan.topology, self.optimizer, x, self.plan.algorithm_options
        )

    def membership_engine(self) -> RankMembership:
        return RankMembership(self)

    # -- the steps ----------------------------------------------------------------------------
    def gradient(self, step: int) -> float:
        if self.buckets is None:
            return self.workload.gradient(step)
        self.algorithm.begin_step(
            self.workload.x, self.workload.grad, self.schedule.lr_at(step), step
        )
        with self.comm.progressing(), self.buckets.delivering(self.algorithm.ready):
            return self.workload.gradient(step)

    def algorithm_step(self, step: int, lr: float) -> None:
        if self.buckets is None:
            self.algorithm.step(self.workload.x, self.workload.grad, lr, step)
        else:
            self.algorithm.finish_step()

    def skips(self, step: int) -> bool:
        """Under --message-deadline on MPI, a worker skips a step where a neighbour's message shows
        it CATCH_UP_BEHIND steps ahead, and goes on skipping while one is ahead at all; a replay
        skips the steps its run file recorded. Never under --on-failure continue (its steps are
        agreed one by one: nobody runs ahead)."""
        if self.plan.drops.skips:
            skip = self.plan.drops.skipped(round_id(step), self.rank)
        elif self.comm.deadline is None or self.membership.active:
            return False
        else:
            at_least = 1 if self._catching_up else CATCH_UP_BEHIND
            skip = self.comm.steps_ahead(step, ROUNDS_PER_STEP, at_least, self.agreement_lag) > 0
        self._catching_up = skip
        if skip:
            self.skipped.append((step, self.members[self.rank]))
            self.comm.skip_rounds(round_id(step), round_id(step + 1))
        return skip

    def start_agreement(self, flags: np.ndarray) -> Request:
        return self.comm.iallreduce_max(flags)

    def late_drops_since(self, before: int | None = None) -> list[tuple[int, ...]]:
        """This rank's late drops not yet in the run file, as its rows (step, round, tag, sender,
        receiver: original worker ids); ``before``: only those of steps before it."""
        rows = self.pending_late + [
            (round // ROUNDS_PER_STEP, round, tag, self.members[src], self.members[dst])
            for round, tag, src, dst in self.comm.late_drops
        ]
        return [row for row in rows if before is None or row[0] < before]

    def _shares_late(self) -> bool:
        """Whether late drops are shared at each step's end: with a deadline or a replay under
        --on-failure continue, where a worker may be lost with late drops not yet written."""
        cfg = self.plan.cfg
        late = cfg.message_deadline is not None or cfg.replay_drops is not None
        return late and self.membership.active

    def after_step(self, step: int) -> None:
        """Share every rank's late drops of the steps before ``step`` with every rank (collective),
        where they are shared (``_shares_late``): the survivors of a later loss keep the lost
        worker's, as a replay, where it vanishes at a step's start, keeps them."""
        if not self._shares_late():
            return
        everyone = self.comm.bcast(self.comm.gather(self.late_drops_since()))
        self.pending_late, self.comm.late_drops = [], []
        self.shared_late += [row for rows in everyone for row in rows]

    def record_late_drops(self, step: int) -> None:
        """Rank 0 appends every rank's late drops since last written to the run file (collective),
        sorted, so that a replay writes the same rows in the same order. They are forgotten only
        once gathered: a loss inside the gather leaves them to the heal. Where they are shared at
        each step's end, every rank has them already: the writer writes its own."""
        if self.plan.cfg.message_deadline is None and self.plan.cfg.replay_drops is None:
            return
        if self._shares_late():
            shared = [row for row in self.shared_late if row[0] < step]
            self.shared_late = [row for row in self.shared_late if row[0] >= step]
            if self.writer is not None:
                self.writer.add_late_drops(
                    np.asarray(sorted(shared), dtype=np.int64).reshape(-1, 5)
                )
            return
        everyone = self.comm.gather((self.late_drops_since(), self.skipped))
        self.pending_late, self.comm.late_drops, self.skipped = [], [], []
        if self.writer is not None and everyone is not None:
            rows = sorted(row for late, _ in everyone for row in late)
            self.writer.add_late_drops(np.asarray(rows, dtype=np.int64).reshape(-1, 5))
            skipped = sorted(row for _, steps in everyone for row in steps)
            self.writer.add_skipped_steps(np.asarray(skipped, dtype=np.int64).reshape(-1, 2))

    def evaluate(self, step: int) -> None:
        self.record_late_drops(step)
        train_loss = self.train_loss(self.workload.current_loss)
        assert isinstance(train_loss, float)  # one worker's: its workload's losses are floats
        row = self.evaluator.evaluate(
            step,
            train_loss,
            float(self.comm.bytes_sent.sum()),
            self.timers,
            self.elapsed(),
            self.writer,
        )
        if row is not None:
            self.log_evaluation(row, self.n)


class RankMembership(PeerMembership):
    """A message-passing rank's side of the membership protocol (docs/membership.md), over its
    Communicator: ULFM's agree and shrink on MPI, the in-process world's on ``--backend local``."""

    def __init__(self, rank: MessagePassingRank) -> None:
        self.rank = rank
        # a shrink not rebuilt on yet: the survivors' communicator and their ids (a loss while the
        # survivors agree on the step shrinks what the last shrink gave)
        self._shrunk: tuple[Communicator, list[int]] | None = None
        # --peer-timeout: each current worker's host and process id by original id, to tell a
        # stalled process (still there) from a killed one
        self.hosts: dict[int, str] = {}
        self.pids: dict[int, int] = {}

    def survive_losses(self) -> None:
        self.rank.comm.survive_losses()

    def share_hosts(self, hosts: list[str] | None) -> list[str]:
        comm = self.rank.comm
        shared: list[str] = comm.bcast(hosts)
        if self.rank.plan.cfg.peer_timeout is not None:  # the same flag on every rank
            members = self.rank.members  # by rank (a rerun on survivors: not 0..n-1)
            self.hosts = dict(zip(members, shared, strict=True))
            self.pids = dict(zip(members, comm.bcast(comm.gather(os.getpid())), strict=True))
        return shared

    def evicted(self, lost: list[int]) -> tuple[list[int], float]:
        """A lost worker whose process is still on its host (seen by a survivor there) was
        evicted for silence; where no survivor shares its host, one is taken for evicted when the
        survivors' longest wait reached 3/4 of the timeout (a killed process is noticed at once, a
        stalled one once the detector's timeout ran out after its last heartbeat)."""
        timeout = self.rank.plan.cfg.peer_timeout
        if timeout is None or not self.pids:
            return [], 0.0
        assert self._shrunk is not None  # after a shrink
        n0, here = self.rank.n0, socket.gethostname()
        # per original worker: seen present, seen at all (a survivor on its host); the wait
        seen = np.zeros(2 * n0 + 1)
        for worker in lost:
            if self.hosts.get(worker) == here:
                seen[n0 + worker] = 1.0
                seen[worker] = 1.0 if process_present(self.pids[worker]) else 0.0
        seen[-1] = self.rank.comm.interrupted_s
        seen = self._shrunk[0].allreduce_flags(seen)
        waited = float(seen[-1])
        long_wait = waited >= (1 - 1 / PERIODS_PER_TIMEOUT) * timeout
        stalled = [w for w in lost if seen[w] > 0 or (seen[n0 + w] == 0 and long_wait)]
        return stalled, waited if stalled else 0.0

    def lose(self, step: int, workers: list[int]) -> list[int]:
        if any(worker in self.rank.workers for worker in workers):
            self.rank.comm.vanish()
        return []

    def vanish(self, during: str | None = None) -> None:
        # inside a heal: leave the survivors' newest world (the in-process one knows only its own)
        comm = self._shrunk[0] if self._shrunk else self.rank.comm
        if during is None:
            comm.vanish()
        elif during == "exchange":  # once the next exchange's messages are posted
            post = comm._post

            def post_then_vanish(
                sends: Any, recvs: Any, tag: int, chunk: int = 0, round: int = 0
            ) -> Any:
                post(sends, recvs, tag, chunk, round)
                comm.vanish()

            comm._post = post_then_vanish  # type: ignore[method-assign]
        elif during == "checkpoint":  # its own file written, before the others know it is
            checkpoints = self.rank.checkpoints

            def vanish_at_barrier() -> None:
                comm.vanish()

            checkpoints.barrier = vanish_at_barrier
        else:
            raise ValueError(f"cannot vanish during {during!r}")

    def agree_end(self, done: bool) -> bool:
        return self.rank.comm.agree(done)

    def heal_vote(self) -> None:
        source = self._shrunk[0] if self._shrunk else self.rank.comm
        try:
            source.agree(False)
        except PeerLost:  # the usual answer: a rank of it is gone
            pass

    def all_max(self, values: np.ndarray) -> np.ndarray:
        return self.rank.comm.allreduce_flags(values)

    def shrink(self) -> list[int]:
        source, members = self._shrunk or (self.rank.comm, self.rank.members)
        new, lost = source.shrink()
        self._shrunk = (new, [m for r, m in enumerate(members) if r not in lost])
        return [members[r] for r in lost]

    def min_over(self, value: int) -> int:
        assert self._shrunk is not None  # after a shrink
        return int(-self._shrunk[0].allreduce_flags(np.array([-float(value)]))[0])

    def rebuild(self, lost: list[int], step: int) -> None:
        assert self._shrunk is not None  # after a shrink
        rank, (new, _) = self.rank, self._shrunk
        old, self._shrunk = rank.comm, None
        rank.evaluator.carried_bytes += (float(old.bytes_sent.sum()), float(old.inter_node_bytes()))
        # the old world's late drops, but those of the step the survivors redo
        rank.pending_late, old.late_drops = rank.late_drops_since(before=step), []
        rank.shared_late = [row for row in rank.shared_late if row[0] < step]
        rank.members = [m for m in rank.members if m not in lost]  # lost: every shrink's since
        rank.comm, rank.rank, rank.n = new, new.rank, new.world_size
        new.worker_ids = tuple(rank.members)  # a replay's drops name original workers
        rank.is_root = rank.rank == 0
        plan, cfg = rank.plan, rank.plan.cfg
        topology = survivor_topology(plan, [rank.nodes0[m] for m in rank.members])
        # the heal rule: each algorithm built again from the survivors' models (its class says
        # what that restarts); the model and the local optimizer's state are the survivor's own
        rank.algorithm = make_algorithm(
            cfg.algo, new, topology, rank.optimizer, rank.workload.x, plan.algorithm_options
        )
        rank.evaluator.comm, rank.evaluator.members = new, rank.members
        rank.checkpoints.heal(rank.rank, new.barrier, rank.members)


def _trainable(workload: Any) -> list[torch.nn.Parameter]:
    """The parameters backward fills (none for a workload without a model: one bucket after its
    gradient)."""
    model = getattr(workload, "model", None)
    return [p for p in model.parameters() if p.requires_grad] if model is not None else []
