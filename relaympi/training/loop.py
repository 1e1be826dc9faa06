"""One worker's run: the one training loop shared by every algorithm, task and backend."""

from __future__ import annotations

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
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from relaympi.algorithms import make_algorithm
from relaympi.checkpoint import CheckpointError
from relaympi.comm import Communicator
from relaympi.config import ConfigError, RunConfig
from relaympi.launcher import launch
from relaympi.optim import make_optimizer
from relaympi.tasks import TaskError
from relaympi.training.checkpointing import Checkpoints
from relaympi.training.evaluation import Evaluator, Timers, log_line
from relaympi.training.plan import Plan, Schedule

log = logging.getLogger("relaympi.train")

# errors in what the user asked for (exit status 2), as opposed to failures of the run
USAGE_ERRORS: tuple[type[BaseException], ...] = (ConfigError, TaskError, CheckpointError)

STOP = threading.Event()  # set by SIGTERM/SIGUSR1/SIGINT: checkpoint at the next step boundary and exit

FAULT_ENV = "RELAYMPI_INJECT_FAILURE"
SIGNAL_ENV = "RELAYMPI_INJECT_SIGNAL"

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


def fault_injection() -> tuple[int, int] | None:
    """RELAYMPI_INJECT_FAILURE=RANK:STEP makes that rank raise at that step (to test failure handling)."""
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    try:
        rank, step = (int(v) for v in value.split(":"))
    except ValueError as exc:
        raise ConfigError(f"{FAULT_ENV}={value!r}; expected RANK:STEP, e.g. 1:5") from exc
    return rank, step


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
    """The steps every backend runs: evaluate, checkpoint, gradient, algorithm step, agree on
    stopping; and how a run ends (completed, diverged or preempted). A backend says how to compute
    a gradient, step its algorithm, agree with the other ranks and evaluate."""

    plan: Plan
    schedule: Schedule
    checkpoints: Checkpoints
    writer: Any  # rank 0's RunWriter, once the run agreed on it
    is_root: bool  # this process writes the run file

    def __init__(self, stop: threading.Event = STOP) -> None:
        self.stop = stop
        self.start_step = 0
        self.loss_sum: float | np.ndarray = 0.0
        self.loss_count = 0
        # the train loss the last evaluation recorded, kept by a checkpoint taken right after it: a
        # resume at that step evaluates it again, and must record the same row
        self.last_train_loss: float | np.ndarray | None = None
        self.timers = Timers()
        self.wall_offset = 0.0  # seconds run before a resume
        self.t0 = time.perf_counter()
        self.inject = fault_injection()
        # steps between host reads of the losses (the divergence check) and of the step timers:
        # 1 reads every step; more lets a GPU run ahead of the host (see _settle)
        self.check_lag = 1
        self._model_finite = True
        self._last_loss = math.nan
        self._clock: _HostClock | _EventClock = _HostClock(None)
        self.inject_signal = signal_injection()

    @property
    @abstractmethod
    def x(self) -> torch.Tensor:
        """The parameters (checked for non-finite values)."""

    @abstractmethod
    def start(self) -> None:
        """Agree on resuming, restore the checkpoint, open the run file; set t0."""

    @abstractmethod
    def gradient(self, step: int) -> float | np.ndarray:
        """Compute the gradient of step ``step``; return its loss (one per worker this process runs)."""

    @abstractmethod
    def algorithm_step(self, step: int, lr: float) -> None:
        """The algorithm's step with the gradient just computed."""

    @abstractmethod
    def agree(self, stop: bool, bad: bool) -> tuple[bool, bool]:
        """(stop, diverged) as every rank sees it."""

    @abstractmethod
    def evaluate(self, step: int) -> None:
        """Evaluate every worker and append the run file's row (collective)."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """This process's checkpoint state."""

    @abstractmethod
    def injected_failure(self, step: int) -> str | None:
        """The message of a failure RELAYMPI_INJECT_FAILURE asks for at this step, else None."""

    def elapsed(self) -> float:
        return self.wall_offset + (time.perf_counter() - self.t0)

    def common_state(self) -> dict[str, Any]:
        """The loop's own part of a checkpoint: the running loss and the timers."""
        return {
            "loss_sum": torch.as_tensor(self.loss_sum, dtype=torch.float64).clone(),
            "loss_count": torch.tensor(self.loss_count),
            "timers": torch.tensor([*self.timers.to_list(), self.elapsed()], dtype=torch.float64),
            **({"eval_train_loss": torch.as_tensor(self.last_train_loss, dtype=torch.float64).clone()}
               if self.loss_count == 0 and self.last_train_loss is not None else {}),
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
        """The mean training loss since the last evaluation (``current()`` before any step), then reset."""
        if self.loss_count:
            loss = self.loss_sum / self.loss_count
        elif self.last_train_loss is not None:  # evaluating again where a checkpoint resumed
            loss = self.last_train_loss
        else:
            loss = current()
        self.loss_sum, self.loss_count = (np.zeros_like(self.loss_sum) if isinstance(self.loss_sum, np.ndarray) else 0.0), 0
        self.last_train_loss = loss
        return loss

    def log_evaluation(self, row: dict[str, Any], workers: int) -> None:
        log.info(log_line(row, self.schedule, self.start_step, self.t0, self.elapsed(), self.plan.cfg.batch_size * workers))

    def run(self) -> str:
        """Train to the end; return the run's status (completed, diverged or preempted)."""
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
                attrs = {"stopped_step": stop.step, "stopped_epoch": schedule.epoch_at(stop.step), "checkpoint_saved": self.checkpoints.enabled}
                if stop.status == "diverged":
                    attrs = {"diverged_step": stop.step, "diverged_epoch": schedule.epoch_at(stop.step)}
                self.writer.set_status(stop.status, **attrs)
            return stop.status
        if bar is not None:
            bar.close()
        if self.is_root:
            self.writer.set_status("completed", total_steps=schedule.total_steps, time_compute_s=self.timers.compute, time_comm_s=self.timers.comm)
        return "completed"

    def _steps(self, bar: Any) -> None:
        schedule, cfg, timers, x = self.schedule, self.plan.cfg, self.timers, self.x
        clock = self._clock = _EventClock() if x.is_cuda and self.check_lag > 1 else _HostClock(x)
        pending: list[_Pending] = []
        step = self.start_step
        self._model_finite = True
        while True:
            if step % schedule.eval_every == 0 or step == schedule.total_steps:
                self._settle_or_stop(pending)  # the evaluation reads the losses and the model
                t_eval = time.perf_counter()
                self._model_finite = bool(torch.isfinite(x).all())
                self.evaluate(step)
                timers.eval += time.perf_counter() - t_eval
            if step == schedule.total_steps:
                break
            if self.checkpoints.enabled and step > self.start_step and step % schedule.checkpoint_every == 0:
                self._settle_or_stop(pending)  # never checkpoint past a diverged step
                self.checkpoints.save(step, self.state())
            failure = self.injected_failure(step)
            if failure is not None:
                raise RuntimeError(failure)
            if self.inject_signal is not None and self.is_root and step + 1 == self.inject_signal[1]:
                os.kill(os.getpid(), self.inject_signal[0])
                self.stop.wait(10.0)  # the handler runs in the main thread: stop at this very step
            t = clock.mark()
            loss = self.gradient(step)
            t_mid = clock.mark()
            self.algorithm_step(step, schedule.lr_at(step))
            pending.append(_Pending(step, loss, t, t_mid, clock.mark()))
            step += 1
            if bar is not None:
                bar.update(1)
            stop = self.stop.is_set()
            logs = bool(cfg.log_every) and step % cfg.log_every == 0 and self.is_root
            bad_step = None
            if len(pending) >= self.check_lag or stop or logs:
                bad_step = self._settle(pending)
            t_sync = time.perf_counter()
            stopping, diverged = self.agree(stop, bad_step is not None)
            timers.sync += time.perf_counter() - t_sync
            if diverged:
                raise Stopped("diverged", step if bad_step is None else bad_step, "non-finite loss or model")
            if stopping and step < schedule.total_steps:
                raise Stopped("preempted", step)
            if logs:
                log.info("step %d/%d loss %.4f lr %.4g", step, schedule.total_steps, self._last_loss, schedule.lr_at(step))
        if not bool(torch.isfinite(x).all()):
            raise Stopped("diverged", step, "non-finite model")

    def _settle(self, pending: list[_Pending]) -> int | None:
        """Account the pending steps' losses and times (one host read for all of them); return the
        step a divergence is recorded at (the first step with a non-finite loss, or whose model was
        non-finite at the evaluation before it), else None. The recorded step is the one message
        passing records when it checks every step: the step after the bad one if rank 0's loss was
        still finite, else the bad one."""
        if not pending:
            return None
        if isinstance(pending[0].loss, torch.Tensor):
            losses = list(torch.stack([p.loss for p in pending]).cpu().numpy())  # one synchronization
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

    def _settle_or_stop(self, pending: list[_Pending]) -> None:
        """Settle before the evaluation, a checkpoint or the end reads the model (deferred checks only:
        with one step pending at most, every step was settled already)."""
        if pending:
            bad_step = self._settle(pending)
            if bad_step is not None:
                raise Stopped("diverged", bad_step, "non-finite loss or model")


class _Pending(NamedTuple):
    """A step whose loss and times are not read yet (device values while checks are deferred)."""

    step: int
    loss: Any  # float, numpy [N], or a device tensor
    start: Any  # clock marks
    computed: Any
    stepped: Any


class _HostClock:
    """Times with the host clock; on a GPU, each mark waits for the device (the step split into
    compute and communication needs it)."""

    def __init__(self, x: torch.Tensor | None):
        self._sync = (lambda: torch.cuda.synchronize(x.device)) if x is not None and x.is_cuda else (lambda: None)

    def mark(self) -> float:
        self._sync()
        return time.perf_counter()

    @staticmethod
    def seconds(start: float, end: float) -> float:
        return end - start


class _EventClock:
    """Times with CUDA events: marks queue on the device's stream and never stall the host;
    a duration is read once its end event completed (the settle's synchronization)."""

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class Worker(TrainingLoop):
    """One rank of a message-passing run: its workload, optimizer and algorithm over a Communicator."""

    def __init__(self, comm: Communicator, plan: Plan, writer_factory: WriterFactory, stop: threading.Event = STOP):
        super().__init__(stop)
        self.comm, self.plan = comm, plan
        self.rank, self.n = comm.rank, comm.world_size
        self.is_root = self.rank == 0
        cfg = plan.cfg
        self.workload = plan.task.workload(plan, self.rank, device_for(cfg, self.rank))
        self.schedule = plan.schedule(self.workload.steps_per_epoch)
        x = self.workload.x
        self.optimizer = make_optimizer(plan.optimizer, x)
        self.algorithm = make_algorithm(cfg.algo, comm, plan.topology, self.optimizer, x, plan.algorithm_options)
        self.checkpoints = Checkpoints(cfg, Path(cfg.out), self.rank, self.n, barrier=comm.barrier)
        self.evaluator = Evaluator(comm, plan, self.schedule, self.workload)
        self.writer_factory = writer_factory

    @property
    def writer(self) -> Any:
        return self.evaluator.writer

    @property
    def x(self) -> torch.Tensor:
        return self.workload.x

    # -- checkpoint state -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "x": self.workload.x.detach().cpu(),
            "optimizer": {k: (v.detach().cpu() if hasattr(v, "detach") else v) for k, v in self.optimizer.state_dict().items()},
            "algorithm": {k: v.detach().cpu() for k, v in self.algorithm.state_dict().items()},
            "bytes_sent": torch.from_numpy(self.comm.bytes_sent.copy()),
            **self.common_state(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.workload.x.copy_(state["x"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.comm.bytes_sent[:] = state["bytes_sent"].numpy()
        self.restore_common(state)

    def on_rank0_agreed(self, action: Callable[[], Any]) -> bool:
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
            raise error if error is not None else ConfigError("rank 0 refused the run (see its error)")
        return bool(flags[1])

    # -- the steps ----------------------------------------------------------------------------
    def start(self) -> None:
        self.t0 = time.perf_counter()
        hosts = self.comm.gather(socket.gethostname())
        if self.on_rank0_agreed(lambda: self.checkpoints.resumable(self.schedule.eval_every)):
            self.start_step, state = self.checkpoints.load()
            if state is not None:
                self.restore(state)
        if self.rank == 0 and self.start_step:
            log.info("resuming from the checkpoint of step %d in %s", self.start_step, self.plan.cfg.checkpoint_dir)

        def open_writer() -> None:
            self.evaluator.writer = self.writer_factory(self.start_step, hosts, self.comm.describe(), self.schedule.total_steps)

        self.on_rank0_agreed(open_writer)
        if self.writer is not None:
            self.checkpoints.claim(self.writer.run_id)
        if self.writer is not None and self.workload.num_classes:  # for the chance-accuracy check
            self.writer.set_attrs(num_classes=self.workload.num_classes)
        self.t0 = time.perf_counter()

    def gradient(self, step: int) -> float:
        return self.workload.gradient(step)

    def algorithm_step(self, step: int, lr: float) -> None:
        self.algorithm.step(self.workload.x, self.workload.grad, lr, step)

    def agree(self, stop: bool, bad: bool) -> tuple[bool, bool]:
        flags = self.comm.allreduce_flags(np.array([1.0 if stop else 0.0, 1.0 if bad else 0.0]))
        return bool(flags[0] > 0), bool(flags[1] > 0)

    def evaluate(self, step: int) -> None:
        train_loss = self.train_loss(self.workload.current_loss)
        row = self.evaluator.evaluate(step, train_loss, float(self.comm.bytes_sent.sum()), self.timers, self.elapsed())
        if row is not None:
            self.log_evaluation(row, self.n)

    def injected_failure(self, step: int) -> str | None:
        if self.inject is not None and self.inject == (self.rank, step):
            return f"injected failure on rank {self.rank} at step {step} ({FAULT_ENV})"
        return None


def _progress_bar(total: int, initial: int) -> tqdm | None:
    """A tqdm bar on rank 0 when stderr is a terminal (log lines alone otherwise)."""
    if not sys.stderr.isatty():
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)
