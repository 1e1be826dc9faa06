"""The one training loop shared by every algorithm, task and engine: steps, evaluations,
checkpoints (start, state, restore), injected failures and how a run ends or fails. An engine
(relaympi.engines) says how its workers compute a gradient, step, agree and evaluate."""

# Long module: the one training loop: its steps, start, checkpoints, failures and membership

from __future__ import annotations

import copy
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from relaympi.comm.base import PeerLost, Vanished
from relaympi.config import ConfigError, RunConfig
from relaympi.launcher import launch
from relaympi.tasks import TaskError
from relaympi.training.checkpoint_files import CheckpointError
from relaympi.training.checkpointing import Checkpoints
from relaympi.training.clocks import EventClock, HostClock, Pending
from relaympi.training.evaluation import Timers, log_line
from relaympi.training.membership import FAULT_ENV, Snapshots, change_record, injected_losses
from relaympi.training.plan import Plan, Schedule
from relaympi.training.run_file import close_quietly, record_failure

log = logging.getLogger("relaympi.train")

# errors in what the user asked for (exit status 2), as opposed to failures of the run
USAGE_ERRORS: tuple[type[BaseException], ...] = (ConfigError, TaskError, CheckpointError)

STOP = (
    threading.Event()
)  # set by SIGTERM/SIGUSR1/SIGINT: checkpoint at the next step boundary and exit

SIGNAL_ENV = "RELAYMPI_INJECT_SIGNAL"
# --on-failure continue on MPI: each rank writes DIR/worker<id>.pid ("PID HOST"), for a tool that
# kills ranks (benchmarks/kill_loop.py)
PID_DIR_ENV = "RELAYMPI_PID_DIR"

# rank 0 makes the run file's writer once the ranks agreed where to start:
# (start_step, hosts, transport, total_steps) -> RunWriter
WriterFactory = Callable[[int, list, dict, int], Any]


class Stopped(Exception):
    """The run ends early: ``status`` is diverged or preempted, at ``step``."""

    def __init__(self, status: str, step: int, detail: str = ""):
        super().__init__(f"{status} at step {step} {detail}".strip())
        self.status, self.step, self.detail = status, step, detail


def device_for(cfg: RunConfig, rank: int) -> str:
    """The device this rank trains on: with --device cuda, GPU (local rank mod GPU count)."""
    if cfg.device != "cuda":
        return cfg.device
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError("--device cuda but torch sees no GPU")
    local = launch().local_rank
    local = rank if local is None else local
    return f"cuda:{local % count}"


def signal_injection() -> tuple[signal.Signals, int] | None:
    """RELAYMPI_INJECT_SIGNAL=NAME:STEP makes the run file's process send itself that signal (TERM,
    INT, USR1) during the step before STEP, as a user or scheduler would: the run stops at STEP
    (to test stopping at a known step)."""
    value = os.environ.get(SIGNAL_ENV, "")
    if not value:
        return None
    name, _, step = value.partition(":")
    try:
        signum = signal.Signals["SIG" + name.upper().removeprefix("SIG")]
        return signum, int(step)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{SIGNAL_ENV}={value!r}; expected NAME:STEP, e.g. TERM:20") from exc


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
    hosts0: list[str]  # each original worker's host (one entry: every worker on that host)
    worker_noun: str  # what the error of an injected failure calls one: "rank" or "worker"
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
        # RELAYMPI_INJECT_FAILURE: {step: [workers]}; they raise (--on-failure stop) or vanish
        self.inject = injected_losses()
        self.continues = False  # --on-failure continue: survivors of a lost worker carry on
        self.snapshots = Snapshots()
        self._pending_change: dict[str, Any] | None = None  # written after its first step
        self._readmission: dict[str, Any] | None = None  # a rerun's re-admission, to record
        self._lost_in_heal: list[int] = []  # lost so far by a heal not finished yet
        # steps between host reads of the losses (the divergence check) and of the step timers:
        # 1 reads every step; more lets a GPU run ahead of the host (see _settle)
        self.check_lag = 1
        self._model_finite = True
        self._last_loss = math.nan
        self._clock: HostClock | EventClock = HostClock(None)
        self.inject_signal = signal_injection()

    def check_injection(self, world_size: int) -> None:
        """Refuse a RELAYMPI_INJECT_FAILURE that names no worker of the run."""
        for ranks in self.inject.values():
            for rank in ranks:
                if not 0 <= rank < world_size:
                    raise ConfigError(
                        f"{FAULT_ENV} names {self.worker_noun} {rank}, but the run has "
                        f"{self.worker_noun}s 0..{world_size - 1}"
                    )

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

    @abstractmethod
    def agree(self, stop: bool, bad: bool) -> tuple[bool, bool]:
        """(stop, diverged) as every rank sees it."""

    @abstractmethod
    def evaluate(self, step: int) -> None:
        """Evaluate every worker and append the run file's row (collective)."""

    def on_root_agreed(self, action: Callable[[], Any]) -> bool:
        """Run ``action`` on the root only and share its truth value (one process: just run it)."""
        return bool(action())

    def report_failure(self, message: str) -> None:  # noqa: B027 - one process: the root records it
        """A rank other than the root tells the root it failed (so the root records it)."""

    # -- start, checkpoint state ------------------------------------------------------------
    def prepare(self) -> None:
        """What an engine settles before anything is restored or recorded (default: nothing)."""
        return None

    def start(self) -> None:
        """Agree on resuming, restore the checkpoint, open the run file; set t0."""
        self.prepare()
        self.t0 = time.perf_counter()
        hosts = self.hosts()
        self.start_membership(hosts)
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
        return {
            "x": self.x.detach().cpu(),
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "algorithm": _to_cpu(self.algorithm.state_dict()),
            "bytes_sent": torch.from_numpy(np.array(self.bytes_counter, dtype=np.int64)),
            **self.common_state(),
            **self.membership_state(),
        }

    def membership_state(self) -> dict[str, Any]:
        """An engine's part of a checkpoint after a membership change (default: none)."""
        return {}

    def restore_membership(self, state: dict[str, Any]) -> None:  # noqa: B027 - no change: nothing
        """Before ``restore``: an engine's own part of a checkpoint saved after a membership
        change (the batched engine drops the lost workers' rows first)."""

    def restore(self, state: dict[str, Any]) -> None:
        self.restore_membership(state)
        device = self.x.device
        self.x.copy_(state["x"])
        self.optimizer.load_state_dict(_to_device(state["optimizer"], device))
        self.algorithm.load_state_dict(_to_device(state["algorithm"], device))
        self.bytes_counter[...] = state["bytes_sent"].numpy()
        self.restore_common(state)
        self.restored(state)

    def restored(self, state: dict[str, Any]) -> None:  # noqa: B027 - no change: nothing
        """After ``restore``: what an engine finishes once its checkpoint is back."""

    def injected_failure(self, step: int) -> str | None:
        """The message of a failure RELAYMPI_INJECT_FAILURE asks for at this step, else None."""
        for rank in self.inject.get(step, ()):
            if rank in self.workers:
                return f"injected failure on {self.worker_noun} {rank} at step {step} ({FAULT_ENV})"
        return None

    def elapsed(self) -> float:
        return self.wall_offset + (time.perf_counter() - self.t0)

    def common_state(self) -> dict[str, Any]:
        """The loop's own part of a checkpoint: the running loss and the timers."""
        return {
            "loss_sum": torch.as_tensor(self.loss_sum, dtype=torch.float64).clone(),
            "loss_count": torch.tensor(self.loss_count),
            "timers": torch.tensor([*self.timers.to_list(), self.elapsed()], dtype=torch.float64),
            **(
                {
                    "eval_train_loss": torch.as_tensor(
                        self.last_train_loss, dtype=torch.float64
                    ).clone()
                }
                if self.loss_count == 0 and self.last_train_loss is not None
                else {}
            ),
        }

    def restore_common(self, state: dict[str, Any]) -> None:
        loss_sum = state["loss_sum"].numpy()
        self.loss_sum = float(loss_sum) if loss_sum.ndim == 0 else loss_sum.copy()
        self.loss_count = int(state["loss_count"])
        *timers, self.wall_offset = (float(v) for v in state["timers"])
        self.timers = Timers.from_list(timers)
        if "eval_train_loss" in state:
            loss = state["eval_train_loss"].numpy()
            self.last_train_loss = float(loss) if loss.ndim == 0 else loss.copy()

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
        is
        recorded in the run file (the root) or reported to the root (other ranks), then
        re-raised."""
        try:
            return self._run()
        except Vanished:  # an injected loss: gone, as a killed process (nothing recorded)
            raise
        except BaseException as exc:
            if self.writer is not None:
                record_failure(self.writer, exc)
            elif not self.is_root and not isinstance(exc, USAGE_ERRORS):
                self.report_failure(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if self.writer is not None:
                close_quietly(self.writer)

    def _run(self) -> str:
        self.start()
        schedule = self.schedule
        bar = _progress_bar(schedule.total_steps, self.start_step) if self.is_root else None
        try:
            self._steps(bar)
        except Stopped as stop:
            if bar is not None:
                bar.close()
            if stop.status == "preempted" and self.checkpoints.enabled:
                self.checkpoints.save(stop.step, self.state())
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
        """The steps from start_step to the end; under --on-failure continue, a lost worker's
        survivors heal (``heal``) and go on from the step it interrupted."""
        step = self.start_step
        if self.continues and self.interruptible:
            self.snapshots.take(step, self.live_state(), (False, False))
        healing = False
        while True:
            try:
                if healing:  # a loss while healing heals again, over whoever is left then
                    step = self._heal(bar)
                    healing = False
                self._steps_from(step, bar)
                if self._pending_change is not None:  # lost at the last evaluation
                    self._write_change()
                return
            except PeerLost:
                if not self.continues:
                    raise
                healing = True

    def _steps_from(self, step: int, bar: Any) -> None:
        schedule, cfg, timers = self.schedule, self.plan.cfg, self.timers
        x = self.x
        clock = self._clock = EventClock() if x.is_cuda and self.check_lag > 1 else HostClock(x)
        pending: list[Pending] = []
        self._model_finite = True
        while True:
            if self.continues and step in self.inject:
                self.lose_injected(step, self.inject[step])
                x = self.x  # the batched engine's rows of the survivors
            if step % schedule.eval_every == 0 or step == schedule.total_steps:
                self._settle_or_stop(pending)  # the evaluation reads the losses and the model
                t_eval = time.perf_counter()
                self._model_finite = bool(torch.isfinite(x).all())
                self.evaluate(step)
                timers.eval += time.perf_counter() - t_eval
            if step == schedule.total_steps:
                break
            if (
                self.checkpoints.enabled
                and step > self.start_step
                and step % schedule.checkpoint_every == 0
            ):
                self._settle_or_stop(pending)  # never checkpoint past a diverged step
                self.checkpoints.save(step, self.state())
            failure = None if self.continues else self.injected_failure(step)
            if failure is not None:
                raise RuntimeError(failure)
            if (
                self.inject_signal is not None
                and self.is_root
                and step + 1 == self.inject_signal[1]
            ):
                os.kill(os.getpid(), self.inject_signal[0])
                self.stop.wait(10.0)  # the handler runs in the main thread: stop at this very step
            t = clock.mark()
            loss = self.gradient(step)
            t_mid = clock.mark()
            self.algorithm_step(step, schedule.lr_at(step))
            pending.append(Pending(step, loss, t, t_mid, clock.mark()))
            step += 1
            if bar is not None:
                bar.update(1)
            stop = self.stop.is_set()
            logs = bool(cfg.log_every) and step % cfg.log_every == 0 and self.is_root
            bad_step = None
            if len(pending) >= self.check_lag or stop or logs:
                bad_step = self._settle(pending)
            if self.continues and self.interruptible:  # what the next step is redone from
                self.snapshots.take(step, self.live_state(), (stop, bad_step is not None))
            t_sync = time.perf_counter()
            stopping, diverged = self.agree(stop, bad_step is not None)
            timers.sync += time.perf_counter() - t_sync
            if self._pending_change is not None:  # the first step on the new membership is done
                self._write_change()
            if diverged:
                raise Stopped(
                    "diverged", step if bad_step is None else bad_step, "non-finite loss or model"
                )
            if stopping and step < schedule.total_steps:
                raise Stopped("preempted", step)
            if logs:
                log.info(
                    "step %d/%d loss %.4f lr %.4g",
                    step,
                    schedule.total_steps,
                    self._last_loss,
                    schedule.lr_at(step),
                )
        if not bool(torch.isfinite(x).all()):
            raise Stopped("diverged", step, "non-finite model")

    # -- membership: --on-failure continue (docs/membership.md) -------------------------------
    def start_membership(self, hosts: list[str] | None) -> None:
        """Under --on-failure continue: every worker learns every worker's host and node (a lost
        one is recorded by whichever rank writes the run file then), and losses are survived."""
        self.continues = self.plan.cfg.on_failure == "continue"
        if not self.continues:
            return
        if self.interruptible:  # a healed step is redone from its start: settle every step
            self.check_lag = 1
        self.hosts0 = self.share_hosts(hosts)
        self.survive_losses()
        pid_dir = os.environ.get(PID_DIR_ENV)
        if pid_dir and self.plan.cfg.backend == "mpi":  # for a tool that kills ranks (kill loop)
            for worker in self.workers:
                path = os.path.join(pid_dir, f"worker{worker}.pid")
                with open(path + ".tmp", "w") as file:
                    file.write(f"{os.getpid()} {socket.gethostname()}\n")
                os.replace(path + ".tmp", path)

    def share_hosts(self, hosts: list[str] | None) -> list[str]:
        """The root's list of every worker's host, on every rank (one process: itself)."""
        assert hosts is not None
        return hosts

    def survive_losses(self) -> None:  # noqa: B027 - one process has no peer to lose
        """Make this engine's communication raise PeerLost where a worker is lost."""

    def live_state(self) -> dict[str, Any]:
        """What a healed step is redone from (on the device, unlike a checkpoint's state)."""
        return {
            "x": self.x,
            "optimizer": self.optimizer.state_dict(),
            "bytes_sent": torch.from_numpy(np.array(self.bytes_counter, dtype=np.int64)),
            "losses": (np.copy(self.loss_sum), self.loss_count, copy.copy(self.last_train_loss)),
        }

    def lose_injected(self, step: int, ranks: list[int]) -> None:
        """RELAYMPI_INJECT_FAILURE's workers of this step vanish (message passing: this rank, if it
        is one of them, leaves as a killed process would; the survivors notice it)."""
        if any(rank in self.workers for rank in ranks):
            self.vanish()

    def vanish(self) -> None:
        raise NotImplementedError

    def readmit(self, state: dict[str, Any] | None, lost: list[int]) -> None:
        """A rerun of a run that had lost ``lost``: survivors restore ``state`` (their own), the
        lost come back (docs/membership.md#back-to-full-strength)."""
        raise ConfigError(f"this engine cannot re-admit lost workers {lost}")

    def shrink(self) -> tuple[Any, list[int]]:
        """After PeerLost: (the survivors' communicator, the original ids lost)."""
        raise NotImplementedError

    def min_over(self, new: Any, value: int) -> int:
        """The minimum of ``value`` over the survivors of ``new`` (collective)."""
        raise NotImplementedError

    def rebuild(self, new: Any, lost: list[int], step: int) -> None:
        """Carry on over ``new``: the algorithm built again over the survivors (its heal rule),
        evaluation and checkpoints over the new membership."""
        raise NotImplementedError

    def all_max(self, values: np.ndarray) -> np.ndarray:
        """The element-wise maximum over the current workers (one process: the values)."""
        return values

    def _heal(self, bar: Any) -> int:
        """A worker was lost: shrink to the survivors, agree on the step it interrupted (the
        earliest step any survivor was in), go back to the state each had when that step began,
        rebuild over the survivors and return that step."""
        t0 = time.perf_counter()
        position = self.snapshots.latest
        new, lost = self.shrink()
        self._lost_in_heal += lost  # with those of a shrink that another loss interrupted
        step = self.min_over(new, position)
        lost_ids, self._lost_in_heal = self._lost_in_heal, []
        snapshot = self.snapshots.at(step)
        self.x.copy_(snapshot.state["x"])
        self.optimizer.load_state_dict(snapshot.state["optimizer"])
        self.bytes_counter[...] = snapshot.state["bytes_sent"].numpy()
        loss_sum, self.loss_count, last = snapshot.state["losses"]
        self.loss_sum = float(loss_sum) if loss_sum.ndim == 0 else loss_sum.copy()
        self.last_train_loss = copy.copy(last)
        self.rebuild(new, lost_ids, step)
        self.snapshots = Snapshots()
        self.snapshots.take(step, self.live_state(), snapshot.flags)
        return self._after_change(step, lost_ids, t0, snapshot.flags, bar)

    def _after_change(
        self, step: int, lost_ids: list[int], t0: float, flags: tuple[bool, bool], bar: Any
    ) -> int:
        """The run file after a change at ``step``: rows from it on are redone; the change itself
        is written once the first step on the new membership completed (changes at one step are
        merged). Then the stop flags of the step before, agreed among the survivors."""
        if self.is_root:
            self._claim_writer(step)
            logging.getLogger().setLevel(min(logging.getLogger().level, logging.INFO))
        heal_s = time.perf_counter() - t0
        stop, bad, heal_s = self.all_max(np.array([float(flags[0]), float(flags[1]), heal_s]))
        nodes = [self.nodes0[i] for i in lost_ids]
        hosts = [self.hosts0[i] if len(self.hosts0) == self.n0 else None for i in lost_ids]
        change = self._pending_change
        if change is not None and change["step"] == step:
            lost_ids, nodes = change["lost"] + lost_ids, change["lost_nodes"] + nodes
            hosts, heal_s = change["lost_hosts"] + hosts, change["heal_s"] + heal_s
        count = len(self.members)
        self._pending_change = change_record(step, lost_ids, nodes, hosts, count, heal_s)
        if self.is_root:
            log.warning(
                "lost %s at step %d; %d workers carry on (healed in %.2f s)",
                ", ".join(
                    f"{self.worker_noun} {i} (node {n})"
                    for i, n in zip(lost_ids, nodes, strict=True)
                ),
                step,
                len(self.members),
                heal_s,
            )
        if bar is not None:
            bar.n = step
            bar.refresh()
        if bad > 0:
            raise Stopped("diverged", step, "non-finite loss or model")
        if stop > 0 and step < self.schedule.total_steps:
            raise Stopped("preempted", step)
        return step

    def _claim_writer(self, step: int) -> None:
        """The root after a change: its writer drops the rows from ``step`` on (they are redone);
        a new root (the old one was lost) takes the run file over."""
        if self.writer is not None:
            self.writer.rewind(step)
            return
        from relaympi.results import RunWriter

        assert self.plan.cfg.out is not None
        self.writer = RunWriter.take_over(self.plan.cfg.out, from_step=step)
        if self.checkpoints.enabled and self.writer.run_id is not None:
            self.checkpoints.claim(self.writer.run_id)

    def _write_change(self) -> None:
        change, self._pending_change = self._pending_change, None
        if self.is_root and change is not None:
            self.writer.add_membership(change)

    def _settle(self, pending: list[Pending]) -> int | None:
        """Account the pending steps' losses and times (one host read for all of them); return the
        step a divergence is recorded at (the first step with a non-finite loss, or whose model was
        non-finite at the evaluation before it), else None. The recorded step is the one message
        passing records when it checks every step: the step after the bad one if rank 0's loss was
        still finite, else the bad one."""
        if not pending:
            return None
        if isinstance(pending[0].loss, torch.Tensor):
            losses = list(
                torch.stack([p.loss for p in pending]).cpu().numpy()
            )  # one synchronization
        else:
            losses = [p.loss for p in pending]
        clock, bad_step = self._clock, None
        for entry, loss in zip(pending, losses, strict=True):
            self.timers.compute += clock.seconds(entry.start, entry.computed)
            self.timers.comm += clock.seconds(entry.computed, entry.stepped)
            self.loss_sum += loss
            self.loss_count += 1
            first = float(np.ravel(loss)[0])  # rank 0's loss: the one its log and run file report
            self._last_loss = first
            if not (bool(np.isfinite(loss).all()) and self._model_finite):
                bad_step = entry.step + 1 if math.isfinite(first) else entry.step
                break
            self._model_finite = True
        pending.clear()
        return bad_step

    def _settle_or_stop(self, pending: list[Pending]) -> None:
        """Settle before the evaluation, a checkpoint or the end reads the model (deferred checks
        only:
        with one step pending at most, every step was settled already)."""
        if pending:
            bad_step = self._settle(pending)
            if bad_step is not None:
                raise Stopped("diverged", bad_step, "non-finite loss or model")


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _to_device(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _progress_bar(total: int, initial: int) -> tqdm | None:
    """A tqdm bar on rank 0 when stderr is a terminal (log lines alone otherwise)."""
    if not sys.stderr.isatty():
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)
