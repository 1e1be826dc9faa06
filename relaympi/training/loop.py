"""The one training loop shared by every algorithm, task and engine: steps, evaluations,
checkpoints (start, state, restore), injected failures and how a run ends or fails. An engine
(relaympi.engines) says how its workers compute a gradient, step, agree and evaluate; the
membership protocol of --on-failure continue is relaympi.training.healing's, called at named
points of the steps."""

# Long module: the one loop every engine runs, its start, resume, steps and end kept together

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from relaympi.comm.base import PeerLost, Vanished
from relaympi.config import ConfigError
from relaympi.tasks import TaskError
from relaympi.training.agreement import (
    AGREEMENT_LAG,
    DEADLINE_AGREEMENT_LAG,
    Agreed,
    FlagsRequest,
    LaggedAgreement,
    agreement_lag,
)
from relaympi.training.checkpoint_files import CheckpointError
from relaympi.training.checkpoint_state import checkpoint_state, restore_common, restore_state
from relaympi.training.checkpointing import Checkpoints
from relaympi.training.clocks import EventClock, HostClock, Pending, settle
from relaympi.training.evaluation import Timers, log_line, progress_bar
from relaympi.training.healing import Membership, MembershipProtocol, Stopped
from relaympi.training.injection import (
    check_failures,
    delay_injection,
    failure_at,
    hold_back,
    send_signal,
    signal_injection,
)
from relaympi.training.membership import change_record, injected_losses
from relaympi.training.plan import Plan, Schedule
from relaympi.training.run_file import close_quietly, record_failure
from relaympi.training.workloads import device_for  # noqa: F401 - the engines' import

log = logging.getLogger("relaympi.train")

# errors in what the user asked for (exit status 2), as opposed to failures of the run
USAGE_ERRORS: tuple[type[BaseException], ...] = (ConfigError, TaskError, CheckpointError)

STOP = (
    threading.Event()
)  # set by SIGTERM/SIGUSR1/SIGINT: checkpoint at the next step boundary and exit

# rank 0 makes the run file's writer once the ranks agreed where to start:
# (start_step, hosts, transport, total_steps) -> RunWriter
WriterFactory = Callable[[int, list, dict, int], Any]


class TrainingLoop(ABC):
    """The steps every engine runs: evaluate, checkpoint, gradient, algorithm step, agree on
    stopping; how a run starts (resume from a checkpoint, open the run file), what its checkpoint
    holds, and how it ends (completed, diverged or preempted) or fails (recorded in the run file).
    An engine says how to compute a gradient, step its algorithm, agree with the other ranks and
    evaluate; its workers' parameters, optimizer, algorithm and byte counts are ``x``,
    ``optimizer``, ``algorithm`` and ``bytes_counter``."""

    plan: Plan
    schedule: Schedule
    checkpoints: Checkpoints
    optimizer: Any  # state_dict() / load_state_dict()
    algorithm: Any  # state_dict() / load_state_dict()
    is_root: bool  # this process writes the run file
    workers: range  # the workers (ranks) this process runs, for RELAYMPI_INJECT_FAILURE
    # --on-failure continue (docs/membership.md): the original ids of the run's current workers, in
    # rank order, and how many it started with (its run file's per-worker columns)
    members: list[int]
    n0: int
    nodes0: tuple[int, ...]  # each original worker's node
    worker_noun: str  # what the error of an injected failure calls one: "rank" or "worker"
    membership: MembershipProtocol  # --on-failure continue's protocol (start() makes it)
    num_classes: int | None = None  # recorded for the chance-accuracy check (classification)
    # whether a loss can interrupt a step (message passing: another process dies mid-step), so
    # that --on-failure continue snapshots each step start to redo it from; one process that
    # loses workers only at a step's start (the batched engine) needs none
    interruptible: bool = True

    def __init__(self, writer_factory: WriterFactory, stop: threading.Event = STOP) -> None:
        self.stop = stop
        self.writer_factory = writer_factory
        self.writer: Any = None  # the root's RunWriter, once the run agreed on it
        self.start_step = 0
        self.loss_sum: float | np.ndarray = 0.0
        self.loss_count = 0
        # the train loss the last evaluation recorded, kept by a checkpoint taken right after it: a
        # resume at that step evaluates it again, and must record the same row
        self.last_train_loss: float | np.ndarray | None = None
        self.timers = Timers()
        self.wall_offset = 0.0  # seconds run before a resume
        self.t0 = time.perf_counter()
        # RELAYMPI_INJECT_FAILURE: they raise (--on-failure stop) or vanish at their phase
        self.inject = injected_losses()
        self._readmission: dict[str, Any] | None = None  # a rerun's re-admission, to record
        # steps between host reads of the losses (the divergence check) and of the step timers:
        # 1 reads every step; more lets a GPU run ahead of the host (clocks.settle)
        self.check_lag = 1
        self.model_finite = True
        self.last_loss = math.nan
        self.clock: HostClock | EventClock = HostClock(None)
        self.inject_signal = signal_injection()
        self.inject_delay = delay_injection()
        self.lag_set = agreement_lag(None)  # RELAYMPI_AGREEMENT_LAG, refused here if bad

    def check_injection(self, world_size: int) -> None:
        """Refuse a RELAYMPI_INJECT_FAILURE that names no worker of the run."""
        check_failures(self.inject, world_size, self.plan.cfg.backend, self.worker_noun)

    @property
    @abstractmethod
    def x(self) -> torch.Tensor:
        """The parameters (checked for non-finite values)."""

    @property
    @abstractmethod
    def bytes_counter(self) -> np.ndarray:
        """The bytes sent so far (int64; restored in place from a checkpoint)."""

    @abstractmethod
    def hosts(self) -> list[str] | None:
        """Every worker's host name on rank 0, None on the other ranks (collective)."""

    @abstractmethod
    def transport(self) -> dict[str, Any]:
        """How the workers communicate (the run file's transport record; root only)."""

    @abstractmethod
    def gradient(self, step: int) -> float | np.ndarray | torch.Tensor:
        """Compute the gradient of step ``step``; return its loss (one per worker this process
        runs; a device tensor where the host reads losses only every few steps)."""

    @abstractmethod
    def algorithm_step(self, step: int, lr: float) -> None:
        """The algorithm's step with the gradient just computed."""

    def start_agreement(self, flags: np.ndarray) -> FlagsRequest:
        """Start the element-wise maximum over ranks of ``flags`` (stop, diverged), in place; its
        ``wait()`` completes it (one process: nothing to agree with)."""
        return Agreed()

    def skips(self, step: int) -> bool:
        """Whether this process's worker leaves step ``step`` out to catch up with neighbours that
        are ahead of it (--message-deadline; docs/membership.md, "Catching up"): no gradient, no
        update, no message; its state stays as it is. Default: never."""
        return False

    def after_step(self, step: int) -> None:  # noqa: B027 - most runs share nothing
        """At the end of each step, before its agreement (``step``: the next one): what an engine
        shares then (the message-passing engine: late drops, under --on-failure continue)."""

    def record_late_drops(self, step: int) -> None:  # noqa: B027 - most runs have none
        """Write the late drops of the steps before ``step`` not yet in the run file (collective):
        at each evaluation, and before a checkpoint, so that a run resumed from it keeps them."""

    @abstractmethod
    def evaluate(self, step: int) -> None:
        """Evaluate every worker and append the run file's row (collective)."""

    def on_root_agreed(self, action: Callable[[], Any]) -> bool:
        """Run ``action`` on the root only and share its truth value (one process: just run it)."""
        return bool(action())

    def report_failure(self, message: str) -> None:  # noqa: B027 - one process: the root records it
        """A rank other than the root tells the root it failed (so the root records it)."""

    @abstractmethod
    def membership_engine(self) -> Membership:
        """This engine's side of the membership protocol (--on-failure continue)."""

    # -- start, checkpoint state ------------------------------------------------------------
    def prepare(self) -> None:
        """What an engine settles before anything is restored or recorded (default: nothing)."""
        return None

    def start(self) -> None:
        """Agree on resuming, restore the checkpoint, open the run file; set t0."""
        self.prepare()
        self.t0 = time.perf_counter()
        hosts = self.hosts()
        self.membership = MembershipProtocol(self, self.membership_engine(), self.inject)
        self.membership.start(hosts)
        if self.checkpoints.enabled:  # every node must see the folder before anyone resumes from it
            self.checkpoints.mark_host(socket.gethostname())
            self.checkpoints.barrier()

            def shared() -> bool:  # rank 0: refuses a folder that some node cannot see
                assert hosts is not None  # rank 0 gathered every worker's host
                self.checkpoints.check_shared(hosts)
                return True

            self.on_root_agreed(shared)
        if self.on_root_agreed(lambda: self.checkpoints.resumable(self.schedule.eval_every)):
            self.start_step, state = self.checkpoints.load()
            if self.checkpoints.readmitting:  # saved after a loss: every lost worker comes back
                t_readmit = time.perf_counter()
                self.readmit(state, self.checkpoints.readmitting)
                self._readmission = change_record(
                    self.start_step, [], [], [], self.n0, time.perf_counter() - t_readmit
                )
                self._readmission["readmitted"] = list(self.checkpoints.readmitting)
            elif state is not None:
                self.restore(state)
        if self.is_root and self.start_step:
            log.info(
                "resuming from the checkpoint of step %d in %s",
                self.start_step,
                self.plan.cfg.checkpoint_dir,
            )

        def open_writer() -> None:
            assert hosts is not None  # run on the root, which gathered every worker's host
            self.writer = self.writer_factory(
                self.start_step, hosts, self.transport(), self.schedule.total_steps
            )

        self.on_root_agreed(open_writer)
        if self.writer is not None:
            self.checkpoints.claim(self.writer.run_id)
            if self._readmission is not None:
                self.writer.add_membership(self._readmission)
                log.info(
                    "re-admitted %s at step %d: %d workers again",
                    ", ".join(f"{self.worker_noun} {i}" for i in self._readmission["readmitted"]),
                    self.start_step,
                    self.n0,
                )
                self._readmission = None
        if self.writer is not None and self.num_classes:  # for the chance-accuracy check
            self.writer.set_attrs(num_classes=int(self.num_classes))
        self.t0 = time.perf_counter()

    def state(self) -> dict[str, Any]:
        """This process's checkpoint state."""
        return checkpoint_state(self)

    def restore(self, state: dict[str, Any]) -> None:
        """Back to a checkpoint's ``state`` (``state()``'s), the engine's own part included."""
        restore_state(self, state)

    def restore_common(self, state: dict[str, Any]) -> None:
        """The loop's own part of a checkpoint: the running loss and the timers."""
        restore_common(self, state)

    def membership_state(self) -> dict[str, Any]:
        """An engine's part of a checkpoint after a membership change (default: none)."""
        return {}

    def restore_membership(self, state: dict[str, Any]) -> None:  # noqa: B027 - no change: nothing
        """Before ``restore``: an engine's own part of a checkpoint saved after a membership
        change (the batched engine drops the lost workers' rows first)."""

    def restored(self, state: dict[str, Any]) -> None:  # noqa: B027 - no change: nothing
        """After ``restore``: what an engine finishes once its checkpoint is back."""

    def injected_failure(self, step: int) -> str | None:
        """The message of a failure RELAYMPI_INJECT_FAILURE asks for at this step, else None."""
        return failure_at(self.inject, step, self.workers, self.worker_noun)

    def elapsed(self) -> float:
        return self.wall_offset + (time.perf_counter() - self.t0)

    def train_loss(self, current: Callable[[], float | np.ndarray]) -> float | np.ndarray:
        """The mean training loss since the last evaluation (``current()`` before any step), then
        reset."""
        if self.loss_count:
            loss = self.loss_sum / self.loss_count
        elif self.last_train_loss is not None:  # evaluating again where a checkpoint resumed
            loss = self.last_train_loss
        else:
            loss = current()
        self.loss_sum, self.loss_count = (
            (np.zeros_like(self.loss_sum) if isinstance(self.loss_sum, np.ndarray) else 0.0),
            0,
        )
        self.last_train_loss = loss
        return loss

    def log_evaluation(self, row: dict[str, Any], workers: int) -> None:
        assert self.plan.cfg.batch_size is not None  # resolve() filled it in
        log.info(
            log_line(
                row,
                self.schedule,
                self.start_step,
                self.t0,
                self.elapsed(),
                self.plan.cfg.batch_size * workers,
            )
        )

    def run(self) -> str:
        """Train to the end; return the run's status (completed, diverged or preempted). A failure
        is recorded in the run file (the root) or reported to the root (other ranks), then
        re-raised."""
        try:
            return self._run()
        except Vanished:  # an injected loss: gone, as a killed process (nothing recorded)
            raise
        except BaseException as exc:
            if self.writer is not None:
                record_failure(self.writer, exc)
            else:
                if not self.is_root and not isinstance(exc, USAGE_ERRORS):
                    self.report_failure(f"{type(exc).__name__}: {exc}")
                if getattr(self, "membership", None) is not None:  # the writer may be lost
                    self.membership.failed_without_writer(exc)
            raise
        finally:
            if self.writer is not None:
                if getattr(self, "membership", None) is not None and self.membership.active:
                    with self.membership.watchdog.watching("close of the run file"):
                        close_quietly(self.writer)
                else:
                    close_quietly(self.writer)

    def _run(self) -> str:
        self.start()
        schedule = self.schedule
        bar = progress_bar(schedule.total_steps, self.start_step) if self.is_root else None
        try:
            self._steps(bar)
        except Stopped as stop:
            if bar is not None:
                bar.close()
            if self.is_root:
                attrs = {
                    "stopped_step": stop.step,
                    "stopped_epoch": schedule.epoch_at(stop.step),
                    "checkpoint_saved": self.checkpoints.enabled,
                }
                if stop.status == "diverged":
                    attrs = {
                        "diverged_step": stop.step,
                        "diverged_epoch": schedule.epoch_at(stop.step),
                    }
                self.writer.set_status(stop.status, **attrs)
            return stop.status
        if bar is not None:
            bar.close()
        if self.is_root:
            self.writer.set_status(
                "completed",
                total_steps=schedule.total_steps,
                time_compute_s=self.timers.compute,
                time_comm_s=self.timers.comm,
            )
        return "completed"

    def _steps(self, bar: Any) -> None:
        """The steps from start_step to the end (or to a stop, whose checkpoint is saved here), then
        the run's end agreement; under --on-failure continue, a lost worker's survivors heal and go
        on from the step it interrupted, wherever they were (the end agreement included)."""
        step, membership = self.start_step, self.membership
        membership.first_snapshot(step)
        healing = False
        while True:
            try:
                stopped = None
                try:
                    if healing:  # a loss while healing heals again, over whoever is left then
                        step = membership.heal(bar)
                        healing = False
                    self._steps_from(step, bar)
                    membership.at("end", self.schedule.total_steps)
                except Stopped as stop:
                    stopped = stop
                    if stop.status == "preempted" and self.checkpoints.enabled:
                        self.record_late_drops(stop.step)
                        self.checkpoints.save(stop.step, self.state())
                membership.end()  # nobody leaves before every worker is done
                membership.step_agreed()  # a change at the last evaluation
                if stopped is not None:
                    raise stopped
                return
            except PeerLost:
                if not membership.active:
                    raise
                healing = True

    def _steps_from(self, step: int, bar: Any) -> None:
        schedule, cfg, timers, membership = (
            self.schedule,
            self.plan.cfg,
            self.timers,
            self.membership,
        )
        x = self.x
        clock = self.clock = EventClock() if x.is_cuda and self.check_lag > 1 else HostClock(x)
        pending: list[Pending] = []
        self.model_finite = True
        # a heal redoes from the step each survivor's snapshot says: lagging would let survivors
        # be interrupted steps apart, at moments that depend on timing (docs/design.md)
        agreement = LaggedAgreement(
            self.start_agreement, 0 if membership.active else self.agreement_lag
        )
        while True:
            membership.at("start", step)
            x = self.x  # the batched engine's rows of the survivors
            if step % schedule.eval_every == 0 or step == schedule.total_steps:
                self._settle_or_stop(pending)  # the evaluation reads the losses and the model
                t_eval = time.perf_counter()
                self.model_finite = bool(torch.isfinite(x).all())
                self.evaluate(step)
                timers.eval += time.perf_counter() - t_eval
                membership.at("evaluation", step)
                membership.at("flush", step)
            if step == schedule.total_steps:
                break
            if (
                self.checkpoints.enabled
                and step > self.start_step
                and step % schedule.checkpoint_every == 0
            ):
                self._settle_or_stop(pending)  # never checkpoint past a diverged step
                membership.at("checkpoint", step)
                self.record_late_drops(step)
                self.checkpoints.save(step, self.state())
            failure = None if membership.active else self.injected_failure(step)
            if failure is not None:
                raise RuntimeError(failure)
            send_signal(self.inject_signal, step, self.is_root, self.stop)
            if not self.skips(step):
                t = clock.mark()
                loss = self.gradient(step)
                membership.at("gradient", step)
                t_mid = clock.mark()
                membership.at("exchange", step)
                hold_back(self.inject_delay, step, self.workers)
                self.algorithm_step(step, schedule.lr_at(step))
                membership.at("exchange", step, now=True)  # where the step posted no message
                pending.append(Pending(step, loss, t, t_mid, clock.mark()))
            step += 1
            if bar is not None:
                bar.update(1)
            stop = self.stop.is_set()
            logs = bool(cfg.log_every) and step % cfg.log_every == 0 and self.is_root
            bad_step = None
            if len(pending) >= self.check_lag or stop or logs:
                bad_step = settle(self, pending)
            self.after_step(step)
            membership.step_done(step, (stop, bad_step is not None))  # what step is redone from
            membership.at("agreement", step - 1)
            t_sync = time.perf_counter()
            agreement.post(step, stop, bad_step)
            verdict = agreement.due(step, drain=self._reads_model(step))
            timers.sync += time.perf_counter() - t_sync
            membership.step_agreed()  # the first step on a new membership is done
            if verdict.diverged_step is not None:
                raise Stopped("diverged", verdict.diverged_step, "non-finite loss or model")
            if verdict.stop and step < schedule.total_steps:
                raise Stopped("preempted", step)
            if logs:
                log.info(
                    "step %d/%d loss %.4f lr %.4g",
                    step,
                    schedule.total_steps,
                    self.last_loss,
                    schedule.lr_at(step),
                )
        if not bool(torch.isfinite(x).all()):
            raise Stopped("diverged", step, "non-finite model")

    @property
    def agreement_lag(self) -> int:
        """Steps between posting a step's flags and acting on their agreement:
        RELAYMPI_AGREEMENT_LAG where set, else AGREEMENT_LAG, or DEADLINE_AGREEMENT_LAG under
        --message-deadline (no rank waits at a step's end for a late one either, until it is that
        many steps behind)."""
        if self.lag_set is not None:
            return self.lag_set
        late_ok = self.plan.cfg.message_deadline is not None
        return DEADLINE_AGREEMENT_LAG if late_ok else AGREEMENT_LAG

    def _reads_model(self, step: int) -> bool:
        """Whether the model is read at boundary ``step`` (evaluated, checkpointed, the end): every
        agreement in flight is completed there, so no row and no checkpoint is of a diverged or
        stopped run."""
        schedule = self.schedule
        return (
            step % schedule.eval_every == 0
            or step >= schedule.total_steps
            or (self.checkpoints.enabled and step % schedule.checkpoint_every == 0)
        )

    def readmit(self, state: dict[str, Any] | None, lost: list[int]) -> None:
        """A rerun of a run that had lost ``lost``: survivors restore ``state`` (their own), the
        lost come back (docs/membership.md#back-to-full-strength)."""
        raise ConfigError(f"this engine cannot re-admit lost workers {lost}")

    def _settle_or_stop(self, pending: list[Pending]) -> None:
        """Settle before the evaluation, a checkpoint or the end reads the model (deferred checks
        only:
        with one step pending at most, every step was settled already)."""
        if pending:
            bad_step = settle(self, pending)
            if bad_step is not None:
                raise Stopped("diverged", bad_step, "non-finite loss or model")
