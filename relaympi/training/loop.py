"""One worker's run: the one training loop shared by every algorithm, task and backend."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from relaympi.algorithms import make_algorithm
from relaympi.checkpoint import CheckpointError
from relaympi.comm import Communicator
from relaympi.config import ConfigError, RunConfig
from relaympi.optim import make_optimizer
from relaympi.tasks import TaskError
from relaympi.training.checkpointing import Checkpoints
from relaympi.training.evaluation import Evaluator, Timers, log_line
from relaympi.training.plan import Plan

log = logging.getLogger("relaympi.train")

# errors in what the user asked for (exit status 2), as opposed to failures of the run
USAGE_ERRORS: tuple[type[BaseException], ...] = (ConfigError, TaskError, CheckpointError)

STOP = threading.Event()  # set by SIGTERM/SIGUSR1: checkpoint at the next step boundary and exit

FAULT_ENV = "RELAYMPI_INJECT_FAILURE"

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
    local = int(os.environ.get("MPI_LOCALRANKID", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("SLURM_LOCALID", rank))))
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


class Worker:
    """Builds this rank's workload, optimizer and algorithm, then runs the steps."""

    def __init__(self, comm: Communicator, plan: Plan, writer_factory: WriterFactory):
        self.comm, self.plan = comm, plan
        self.rank, self.n = comm.rank, comm.world_size
        cfg = plan.cfg
        self.workload = plan.task.workload(plan, self.rank, device_for(cfg, self.rank))
        self.schedule = plan.schedule(self.workload.steps_per_epoch)
        x = self.workload.x
        self.optimizer = make_optimizer(plan.optimizer, x)
        self.algorithm = make_algorithm(cfg.algo, comm, plan.topology, self.optimizer, x, plan.algorithm_options)
        self.checkpoints = Checkpoints(comm, cfg, Path(cfg.out))
        self.evaluator = Evaluator(comm, plan, self.schedule, self.workload)
        self.writer_factory = writer_factory
        self.start_step = 0
        self.loss_sum, self.loss_count = 0.0, 0
        self.timers = Timers()
        self.wall_offset = 0.0  # seconds run before a resume
        self.t0 = time.perf_counter()
        self.inject = fault_injection()

    @property
    def writer(self) -> Any:
        return self.evaluator.writer

    # -- checkpoint state -------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "x": self.workload.x.detach().cpu(),
            "optimizer": {k: (v.detach().cpu() if hasattr(v, "detach") else v) for k, v in self.optimizer.state_dict().items()},
            "algorithm": {k: v.detach().cpu() for k, v in self.algorithm.state_dict().items()},
            "loss_sum": torch.tensor(self.loss_sum, dtype=torch.float64),
            "loss_count": torch.tensor(self.loss_count),
            "bytes_sent": torch.from_numpy(self.comm.bytes_sent.copy()),
            "timers": torch.tensor([*self.timers.to_list(), self.elapsed()], dtype=torch.float64),
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.workload.x.copy_(state["x"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.loss_sum, self.loss_count = float(state["loss_sum"]), int(state["loss_count"])
        self.comm.bytes_sent[:] = state["bytes_sent"].numpy()
        *timers, self.wall_offset = (float(v) for v in state["timers"])
        self.timers = Timers.from_list(timers)

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

    # -- evaluation ---------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.wall_offset + (time.perf_counter() - self.t0)

    def evaluate(self, step: int) -> None:
        train_loss = self.loss_sum / self.loss_count if self.loss_count else self.workload.current_loss()
        self.loss_sum, self.loss_count = 0.0, 0
        row = self.evaluator.evaluate(step, train_loss, float(self.comm.bytes_sent.sum()), self.timers, self.elapsed())
        if row is not None:
            log.info(log_line(row, self.schedule, self.start_step, self.t0, self.elapsed(), self.plan.cfg.batch_size * self.n))

    # -- the loop -----------------------------------------------------------------------------
    def start(self) -> None:
        """Agree on resuming, load the checkpoint, open the run file (rank 0)."""
        self.t0 = time.perf_counter()
        hosts = self.comm.gather(socket.gethostname())
        if self.on_rank0_agreed(self.checkpoints.resumable):
            self.start_step, state = self.checkpoints.load()
            if state is not None:
                self.restore(state)
        if self.rank == 0 and self.start_step:
            log.info("resuming from the checkpoint of step %d in %s", self.start_step, self.plan.cfg.checkpoint_dir)

        def open_writer() -> None:
            self.evaluator.writer = self.writer_factory(self.start_step, hosts, self.comm.describe(), self.schedule.total_steps)

        self.on_rank0_agreed(open_writer)
        if self.writer is not None and self.workload.num_classes:  # for the chance-accuracy check
            self.writer.set_attrs(num_classes=self.workload.num_classes)
        self.t0 = time.perf_counter()

    def run(self) -> str:
        """Train to the end; return the run's status (completed, diverged or preempted)."""
        self.start()
        schedule = self.schedule
        step = self.start_step
        bar = _progress_bar(schedule.total_steps, step) if self.rank == 0 else None
        try:
            step = self._steps(step, bar)
        except Stopped as stop:
            if bar is not None:
                bar.close()
            if stop.status == "preempted" and self.checkpoints.enabled:
                self.checkpoints.save(stop.step, self.state())
            if self.rank == 0:
                attrs = {"stopped_step": stop.step, "stopped_epoch": schedule.epoch_at(stop.step)}
                if stop.status == "diverged":
                    attrs = {"diverged_step": stop.step, "diverged_epoch": schedule.epoch_at(stop.step)}
                self.writer.set_status(stop.status, **attrs)
            return stop.status
        if bar is not None:
            bar.close()
        if self.rank == 0:
            self.writer.set_status("completed", total_steps=schedule.total_steps, time_compute_s=self.timers.compute, time_comm_s=self.timers.comm)
        return "completed"

    def _steps(self, step: int, bar: Any) -> int:
        schedule, cfg, timers = self.schedule, self.plan.cfg, self.timers
        workload, algorithm = self.workload, self.algorithm
        sync = torch.cuda.synchronize if workload.x.is_cuda else (lambda: None)
        model_finite = True
        while True:
            if step % schedule.eval_every == 0 or step == schedule.total_steps:
                t_eval = time.perf_counter()
                model_finite = bool(torch.isfinite(workload.x).all())
                self.evaluate(step)
                timers.eval += time.perf_counter() - t_eval
            if step == schedule.total_steps:
                break
            if self.checkpoints.enabled and step > self.start_step and step % schedule.checkpoint_every == 0:
                self.checkpoints.save(step, self.state())
            if self.inject is not None and self.inject == (self.rank, step):
                raise RuntimeError(f"injected failure on rank {self.rank} at step {step} ({FAULT_ENV})")
            t = time.perf_counter()
            loss = workload.gradient(step)
            sync()
            t_mid = time.perf_counter()
            algorithm.step(workload.x, workload.grad, schedule.lr_at(step), step)
            sync()
            timers.compute += t_mid - t
            timers.comm += time.perf_counter() - t_mid
            self.loss_sum += loss
            self.loss_count += 1
            bad = not (math.isfinite(loss) and model_finite)
            t_sync = time.perf_counter()
            flags = self.comm.allreduce_flags(np.array([1.0 if STOP.is_set() else 0.0, 1.0 if bad else 0.0]))
            timers.sync += time.perf_counter() - t_sync
            step += 1
            if bar is not None:
                bar.update(1)
            if flags[1] > 0:
                raise Stopped("diverged", step if math.isfinite(loss) else step - 1, "non-finite loss or model")
            if flags[0] > 0 and step < schedule.total_steps:
                raise Stopped("preempted", step)
            if cfg.log_every and step % cfg.log_every == 0 and self.rank == 0:
                log.info("step %d/%d loss %.4f lr %.4g", step, schedule.total_steps, loss, schedule.lr_at(step))
        if not bool(torch.isfinite(workload.x).all()):
            raise Stopped("diverged", step, "non-finite model")
        return step


def _progress_bar(total: int, initial: int) -> tqdm | None:
    """A tqdm bar on rank 0 when stderr is a terminal (log lines alone otherwise)."""
    if not sys.stderr.isatty():
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)
