"""The run driver of ``--backend batched``: N workers as one batched computation, one HDF5 run file.

    python -m relaympi.train --task digits --backend batched --workers 16 --algo relay --alpha 0.01

The run file has the schema of the other backends (one row per evaluation, one column per
worker); every worker's gradient comes from one batched forward and backward (``time_compute_s``,
data included) and the algorithm's step over all workers is ``time_comm_s``; one process runs
them all, so each worker's column holds the process's times. Exit statuses as relaympi.train.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relaympi import checkpoint
from relaympi.algorithms import AlgorithmOptions
from relaympi.batched.data import BatchedData
from relaympi.batched.models import BatchedModel, refuse_unsupported
from relaympi.comm import DropPolicy
from relaympi.config import ConfigError
from relaympi.results import run_status
from relaympi.tasks import TaskOptions, get_task_class
from relaympi.tasks.partition import dirichlet_partition
from relaympi.train import _STOP, FAULT_ENV, _device_for, _fault_injection, _resume_key, _Stop, _writer_factory, finish_plan
from relaympi.workloads import QuadraticWorkload

log = logging.getLogger("relaympi.train")

BACKEND = "batched"


class ModelEngine:
    """A classification task's N models: X [N, d] float32, batched gradients and evaluation."""

    def __init__(self, plan: Any, device: torch.device):
        cfg = plan.cfg
        options = TaskOptions(data_dir=cfg.data_dir, model_dir=cfg.model_dir, seed=cfg.seed, eval_batch_size=cfg.eval_batch_size,
                              num_loader_workers=cfg.loader_workers, device=str(device))
        task_class = get_task_class(cfg.task)
        refuse_unsupported(task_class)  # before its data loads
        self.task = task_class(options)
        self.model = BatchedModel(self.task, cfg.seed, device)
        parts = dirichlet_partition(self.task.train_labels, plan.world_size, cfg.alpha, cfg.seed)
        self.data = BatchedData(self.task, parts, cfg.batch_size, cfg.seed, device)
        self.X = self.model.stacked(plan.world_size)
        self.steps_per_epoch = self.data.steps_per_epoch
        self.eval_batch_size = cfg.eval_batch_size

    def gradient(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(G [N, d], losses [N]) at step ``step``'s batches."""
        inputs, targets = self.data.batch(step)
        return self.model.gradients(self.X, inputs, targets)

    def current_losses(self) -> np.ndarray:
        return np.full(self.X.shape[0], math.nan)  # no loss before the first step (as ModelWorkload)

    def metrics(self) -> dict[str, Any]:
        result = self.model.evaluate(self.X, self.task.test_batches(self.eval_batch_size))
        return {k: v.cpu().numpy() for k, v in result.items()}


class QuadraticEngine:
    """f_i(x) = 1/2 ||A_i x - b_i||^2 for all workers at once, in float64, from X(0) = 0."""

    def __init__(self, plan: Any, device: torch.device):
        self.problem, self.seed, self.cfg = plan.problem, plan.cfg.seed, plan.cfg
        self.AtA = torch.from_numpy(self.problem.AtA).to(device)
        self.Atb = torch.from_numpy(self.problem.Atb).to(device)
        self.X = torch.zeros(plan.world_size, self.problem.dim, dtype=torch.float64, device=device)
        self.steps_per_epoch = 1
        self._summary = QuadraticWorkload(self.problem, self.cfg, 0)

    def gradient(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        G = torch.bmm(self.AtA, self.X.unsqueeze(2)).squeeze(2).sub_(self.Atb)
        if self.problem.sigma2:
            noise = np.stack([self.problem.noise(self.seed, step, rank) for rank in range(self.X.shape[0])])
            G.add_(torch.from_numpy(noise).to(G.device))
        return G, torch.from_numpy(self.current_losses())

    def current_losses(self) -> np.ndarray:
        return self.problem.local_losses(self.X.cpu().numpy())

    def metrics(self) -> dict[str, Any]:
        params = self.X.cpu().numpy()
        row = self._summary.summarize(params)
        if self.cfg.record_params:
            row["params"] = params
        return row


def make_engine(plan: Any, device: torch.device) -> ModelEngine | QuadraticEngine:
    return (QuadraticEngine if plan.cfg.task == "quadratics" else ModelEngine)(plan, device)


def run_batched(plan: Any, out: Path, command: str, *, stop: threading.Event = _STOP, make_optimizer: Callable | None = None,
                make_algorithm: Callable | None = None) -> str:
    """Train all of ``plan``'s workers in this process; return the final status
    ("completed", "diverged", "preempted"). A failure is recorded in the run file, then re-raised.

    ``stop`` is the event the SIGTERM/SIGUSR1 handler sets (checkpoint at the next step boundary,
    then "preempted"); under ``python -m relaympi.train`` that is ``__main__``'s, so main passes it.

    ``make_optimizer(config, X)`` and ``make_algorithm(algo, topology, optimizer, X0, options, drops)``
    default to relaympi.batched's vectorized optimizers and algorithms; an algorithm's ``bytes_sent``
    is a numpy int64 array [N] or [N, N] (by destination) of the bytes message passing would send.
    """
    if make_optimizer is None or make_algorithm is None:
        # imported here so that tests can run this driver with stand-in algorithms
        from relaympi.batched.algorithms import make_batched_algorithm
        from relaympi.batched.optim import BatchedOptimizer

        make_optimizer, make_algorithm = make_optimizer or BatchedOptimizer, make_algorithm or make_batched_algorithm
    run = BatchedRun(plan, out, command, make_optimizer, make_algorithm, stop)
    try:
        return run.run()
    except BaseException as exc:
        if run.writer is not None:
            run.writer.set_status("failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-20000:])
        raise
    finally:
        if run.writer is not None:
            run.writer.close()


class BatchedRun:
    """The training loop of relaympi.train's Worker, for all workers at once."""

    def __init__(self, plan: Any, out: Path, command: str, make_optimizer: Callable, make_algorithm: Callable, stop: threading.Event):
        cfg = plan.cfg
        self.plan, self.cfg, self.out, self.command = plan, cfg, Path(out), command
        self.n = plan.world_size
        self.device = torch.device(_device_for(cfg, 0))
        self.writer = None
        self.engine = make_engine(plan, self.device)
        self.schedule = _schedule(plan, self.engine.steps_per_epoch)
        self.optimizer = make_optimizer(plan.optimizer, self.engine.X)
        options = AlgorithmOptions(relay_mode=cfg.relay_mode or "counts", relay_in_place=cfg.relay_in_place, relay_chunk=cfg.relay_chunk,
                                   d2_force=cfg.d2_force, d2_exact_diffusion=cfg.d2_exact_diffusion)
        self.algorithm = make_algorithm(cfg.algo, plan.topology, self.optimizer, self.engine.X, options, DropPolicy(cfg.drop_prob, cfg.seed))
        self.loss_sum = np.zeros(self.n)
        self.loss_count = 0
        self.time_compute = self.time_comm = self.time_eval = 0.0
        self.wall_offset = 0.0
        self.start_step = 0
        self.model_finite = True
        self.inject = _fault_injection()
        self.stop = stop

    # -- checkpoints -----------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "x": self.engine.X.detach().cpu(),
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "algorithm": _to_cpu(self.algorithm.state_dict()),
            "loss_sum": torch.from_numpy(self.loss_sum.copy()),
            "loss_count": torch.tensor(self.loss_count),
            "bytes_sent": torch.from_numpy(np.array(self.algorithm.bytes_sent, dtype=np.int64)),
            "timers": torch.tensor([self.time_compute, self.time_comm, self.time_eval, self._elapsed()], dtype=torch.float64),
        }

    def save_checkpoint(self, step: int) -> None:
        directory = self.cfg.checkpoint_dir
        checkpoint.save(directory, 0, step, self._state())
        checkpoint.write_meta(directory, {"step": step, "world_size": self.n, "backend": BACKEND, "config": _resume_key(self.cfg)})
        checkpoint.prune(directory, 0, step)

    def _resumable(self) -> bool:
        """Resume only into this run's own unfinished file; otherwise forget a stale checkpoint."""
        directory = self.cfg.checkpoint_dir
        if directory is None or checkpoint.read_meta(directory) is None:
            return False
        status = run_status(self.out)
        if status in ("running", "preempted", "failed"):
            return True
        if status in ("completed", "diverged") and not self.cfg.overwrite:
            return False  # the writer refuses the finished file with a clear message
        log.warning("ignoring the checkpoint in %s: %s is %s, so the run starts from step 0", directory, self.out, status)
        checkpoint.forget(directory)
        return False

    def try_resume(self) -> int:
        directory = self.cfg.checkpoint_dir
        meta = checkpoint.read_meta(directory)
        saved, current = meta.get("config") or {}, _resume_key(self.cfg)
        differences = [f"backend {meta.get('backend', 'local or mpi')} vs {BACKEND}"] if meta.get("backend") != BACKEND else []
        if meta.get("world_size") != self.n:
            differences.append(f"world size {meta.get('world_size')} vs {self.n}")
        differences += [f"{k} {saved.get(k)!r} vs {current.get(k)!r}" for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
        if differences:
            raise ConfigError(
                f"checkpoint in {directory} belongs to a different run (checkpoint vs this command: {'; '.join(differences)}); "
                "use another --checkpoint-dir or delete it"
            )
        step = int(meta["step"])
        state = checkpoint.load(directory, 0, step)
        self.engine.X.copy_(state["x"])
        self.optimizer.load_state_dict(_to_device(state["optimizer"], self.device))
        self.algorithm.load_state_dict(_to_device(state["algorithm"], self.device))
        self.loss_sum, self.loss_count = state["loss_sum"].numpy().copy(), int(state["loss_count"])
        self.algorithm.bytes_sent[...] = state["bytes_sent"].numpy()
        self.time_compute, self.time_comm, self.time_eval, self.wall_offset = (float(v) for v in state["timers"])
        return step

    # -- evaluation ------------------------------------------------------------------------
    def _elapsed(self) -> float:
        return self.wall_offset + (time.perf_counter() - self.t0)

    def evaluate(self, step: int) -> None:
        train_loss = self.loss_sum / self.loss_count if self.loss_count else self.engine.current_losses()
        self.loss_sum, self.loss_count = np.zeros(self.n), 0
        self.model_finite = bool(torch.isfinite(self.engine.X).all())
        metrics = self.engine.metrics()
        every = np.ones(self.n)
        row = {
            "step": step,
            "epoch": self.schedule.epoch_at(step),
            "time_s": self._elapsed(),
            "lr": self.schedule.lr_at(step),
            "train_loss": np.asarray(train_loss, dtype=np.float64),
            "bytes_sent": self._bytes_per_worker(),
            # one process runs every worker: each worker's column holds the process's times
            "time_compute_s": every * self.time_compute,
            "time_comm_s": every * self.time_comm,
            "time_eval_s": every * self.time_eval,
            "time_sync_s": every * 0.0,
        }
        if self.device.type == "cuda":
            row["gpu_max_memory_bytes"] = every * float(torch.cuda.max_memory_allocated(self.device))
        row.update(metrics)
        self.writer.append(row)
        self._log_eval(step, row)

    def _bytes_per_worker(self) -> np.ndarray:
        """Bytes each worker sent so far ([N], or [N, N] by destination as Communicator.bytes_sent, summed)."""
        return np.asarray(self.algorithm.bytes_sent, dtype=np.float64).reshape(self.n, -1).sum(axis=1)

    def _log_eval(self, step: int, row: dict[str, Any]) -> None:
        parts = [f"step {step}/{self.schedule.total_steps}", f"epoch {row['epoch']:.2f}"]
        if np.isfinite(row["train_loss"]).any():
            parts.append(f"train_loss {np.nanmean(row['train_loss']):.4f}")
        if "test_accuracy" in row:
            parts.append(f"test_acc worst {np.min(row['test_accuracy']):.4f} mean {np.mean(row['test_accuracy']):.4f}")
        if "suboptimality" in row:
            parts.append(f"subopt {row['suboptimality']:.3e} consensus {row['consensus_distance']:.3e}")
        if step > self.start_step:
            samples = (step - self.start_step) * self.cfg.batch_size * self.n
            parts.append(f"{samples / max(time.perf_counter() - self.t0, 1e-9):.0f} samples/s")
        parts.append(f"elapsed {self._elapsed():.1f}s")
        log.info(" | ".join(parts))

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> str:
        plan, cfg, schedule = self.plan, self.cfg, self.schedule
        self.t0 = time.perf_counter()
        self.start_step = self.try_resume() if self._resumable() else 0
        if self.start_step:
            log.info("resuming from the checkpoint of step %d in %s", self.start_step, cfg.checkpoint_dir)
        transport = {"backend": BACKEND, "device": str(self.device)}
        self.writer = _writer_factory(plan, self.out, self.command)(self.start_step, [socket.gethostname()], transport)
        if isinstance(self.engine, ModelEngine):  # for the chance-accuracy check
            self.writer.set_attrs(num_classes=int(self.engine.task.num_classes))
        self.t0 = time.perf_counter()
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        X = self.engine.X
        step = self.start_step
        try:
            while True:
                if step % schedule.eval_every == 0 or step == schedule.total_steps:
                    t_eval = time.perf_counter()
                    self.evaluate(step)
                    self.time_eval += time.perf_counter() - t_eval
                if step == schedule.total_steps:
                    break
                if cfg.checkpoint_dir is not None and step > self.start_step and step % schedule.checkpoint_every == 0:
                    self.save_checkpoint(step)
                if self.inject is not None and self.inject[1] == step:
                    raise RuntimeError(f"injected failure on worker {self.inject[0]} at step {step} ({FAULT_ENV})")
                t = time.perf_counter()
                G, losses = self.engine.gradient(step)
                sync()
                t_mid = time.perf_counter()
                self.algorithm.step(X, G, schedule.lr_at(step), step)
                sync()
                self.time_compute += t_mid - t
                self.time_comm += time.perf_counter() - t_mid
                losses = losses.detach().double().cpu().numpy()
                self.loss_sum += losses
                self.loss_count += 1
                step += 1
                if not (np.isfinite(losses).all() and self.model_finite):
                    # the step recorded by rank 0 of the other backends: its own loss decides
                    raise _Stop("diverged", step if math.isfinite(losses[0]) else step - 1, "non-finite loss or model")
                if self.stop.is_set() and step < schedule.total_steps:
                    raise _Stop("preempted", step)
                if cfg.log_every and step % cfg.log_every == 0:
                    log.info("step %d/%d loss %.4f lr %.4g", step, schedule.total_steps, losses[0], schedule.lr_at(step))
            if not bool(torch.isfinite(X).all()):
                raise _Stop("diverged", step, "non-finite model")
        except _Stop as stop:
            if stop.status == "preempted" and cfg.checkpoint_dir is not None:
                self.save_checkpoint(stop.step)
            attrs = {"stopped_step": stop.step, "stopped_epoch": schedule.epoch_at(stop.step)}
            if stop.status == "diverged":
                attrs = {"diverged_step": stop.step, "diverged_epoch": schedule.epoch_at(stop.step)}
            self.writer.set_status(stop.status, **attrs)
            return stop.status
        self.writer.set_status("completed", total_steps=schedule.total_steps, time_compute_s=self.time_compute, time_comm_s=self.time_comm)
        return "completed"


def _schedule(plan: Any, steps_per_epoch: int) -> Any:
    """The run's step schedule (total_steps, eval_every, checkpoint_every, lr_at, epoch_at), which
    depends on the training set's size: relaympi.train's plan takes it in place."""
    if not plan.total_steps:
        finish_plan(plan, steps_per_epoch)
    return plan


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _to_device(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
