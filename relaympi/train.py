"""Train with a decentralized algorithm and record the run in one HDF5 file.

Launch one worker per MPI rank, or all workers as threads of one process:

    python -m relaympi.data fetch cifar10       # once: into $RELAYMPI_DATA or ~/.cache/relaympi
    mpirun -n 16 python -m relaympi.train --algo relay --task cifar10
    python -m relaympi.train --task digits --backend local --workers 16 --algo relay --alpha 0.01
    python -m relaympi.train --task quadratics --backend local --workers 8 --algo relay --topology chain --steps 200

Exit status: 0 completed, 1 failed, 2 misuse, 3 diverged (recorded), 4 preempted (checkpoint saved).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from relaympi.config import ConfigError, RunConfig, parse_args

log = logging.getLogger("relaympi.train")

EXIT_COMPLETED, EXIT_FAILED, EXIT_USAGE, EXIT_DIVERGED, EXIT_PREEMPTED = 0, 1, 2, 3, 4

_STOP = threading.Event()  # set by SIGTERM/SIGUSR1: checkpoint at the next step boundary and exit


def _request_stop(signum: int, frame: Any) -> None:
    _STOP.set()


@dataclass
class Plan:
    """The resolved run: every default filled in, every derived quantity computed once."""

    cfg: RunConfig
    world_size: int
    topology: Any
    total_steps: int
    steps_per_epoch: int
    eval_every: int
    checkpoint_every: int
    lr: float
    warmup_steps: int
    warmup_from: float
    milestone_steps: tuple[int, ...]
    optimizer: Any
    task_defaults: Any = None
    problem: Any = None
    lr_warning: str | None = None  # a default lr used at a worker count it was not tuned for

    def warn_untuned_lr(self) -> None:
        if self.lr_warning:
            log.warning("warning: %s", self.lr_warning)

    def lr_at(self, step: int) -> float:
        """Linear warm-up (per step) then /10 at each milestone."""
        factor = 1.0
        if self.warmup_steps > 0 and step < self.warmup_steps:
            factor = self.warmup_from + (1.0 - self.warmup_from) * step / self.warmup_steps
        decays = sum(step >= m for m in self.milestone_steps)
        return self.lr * factor * 0.1**decays

    def epoch_at(self, step: int) -> float:
        return step / self.steps_per_epoch


def resolve(cfg: RunConfig, world_size: int) -> Plan:
    """Fill defaults from the task and algorithm, build the topology, check every combination."""
    from relaympi.algorithms import AlgorithmError, default_topology, get_algorithm_class
    from relaympi.optim import OptimizerConfig
    from relaympi.tasks import TaskDefaults, get_task_class
    from relaympi.topology import TopologyError, build, lr_correction

    if cfg.task == "quadratics":
        defaults = TaskDefaults(epochs=1, batch_size=1, lr=0.1, momentum=0.0, eval_every_epochs=1, lr_tuned_workers=None)
        task_cls = None
    else:
        task_cls = get_task_class(cfg.task)
        defaults = task_cls.defaults
    cfg = _with_data_dirs(cfg)
    topo_name = cfg.topology or getattr(task_cls, "default_topology_by_algo", {}).get(cfg.algo) or default_topology(cfg.algo)
    try:
        topology = build(topo_name, world_size)
    except TopologyError as exc:
        hint = "; one worker is the centralized baseline: --algo allreduce" if world_size == 1 else ""
        raise ConfigError(f"topology {topo_name!r} with {world_size} workers: {exc}{hint}") from exc
    lr_warning = None
    tuned = defaults.lr_tuned_workers
    if cfg.lr is None and tuned and world_size != tuned:
        lr_warning = (f"the default lr of {cfg.task}/{cfg.algo} was tuned for {tuned} workers; this run has {world_size}, "
                      "so it may not converge (a worker at chance accuracy): pass --lr, e.g. from a sweep (jobs/sweep_lr.sh)")
    cfg = replace(
        cfg,
        topology=topo_name,
        lr=cfg.lr if cfg.lr is not None else defaults.lr_by_algo.get(cfg.algo, defaults.lr),
        # quasi-global *momentum* is meaningless without momentum: 0.9 where the task's default is 0
        momentum=cfg.momentum if cfg.momentum is not None else (0.9 if cfg.algo == "qgm" and not defaults.momentum else defaults.momentum),
        optimizer=cfg.optimizer or defaults.optimizer,
        weight_decay=cfg.weight_decay if cfg.weight_decay is not None else defaults.weight_decay,
        batch_size=cfg.batch_size or defaults.batch_size,
        warmup_epochs=cfg.warmup_epochs if cfg.warmup_epochs is not None else (0.0 if cfg.task == "quadratics" else defaults.warmup_epochs),
        milestones=cfg.milestones if cfg.milestones is not None else (() if cfg.task == "quadratics" else defaults.milestones),
    )
    if cfg.steps is None and cfg.epochs is None:
        cfg = replace(cfg, epochs=defaults.epochs)
    try:
        optimizer = OptimizerConfig(name=cfg.optimizer, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.algo == "relay" and cfg.relay_mode is None:
        cfg = replace(cfg, relay_mode="counts")
    problem = None
    if cfg.task == "quadratics":
        cfg, problem = _quadratics_problem(cfg, world_size)
    plan = Plan(
        cfg=cfg,
        world_size=world_size,
        topology=topology,
        total_steps=0,
        steps_per_epoch=1,
        eval_every=1,
        checkpoint_every=1,
        lr=float(cfg.lr),
        warmup_steps=0,
        warmup_from=defaults.warmup_from,
        milestone_steps=(),
        optimizer=optimizer,
        task_defaults=defaults,
        problem=problem,
        lr_warning=lr_warning,
    )
    try:
        get_algorithm_class(cfg.algo)
        _check_combination(cfg, topology, world_size)
    except AlgorithmError as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.relay_lr_correction:  # validate() refused it for other algorithms
        plan.lr *= lr_correction(topology)
    return plan


def _with_data_dirs(cfg: RunConfig) -> RunConfig:
    """--data-dir / --model-dir as absolute paths, defaulting to the task's folders under the data
    root ($RELAYMPI_DATA, else ~/.cache/relaympi), so the run file records where data came from."""
    from relaympi.data import task_dirs

    data_dir, model_dir = task_dirs(cfg.task)
    data_dir = cfg.data_dir or data_dir
    model_dir = cfg.model_dir or model_dir
    return replace(
        cfg,
        data_dir=Path(data_dir).expanduser().absolute() if data_dir else None,
        model_dir=Path(model_dir).expanduser().absolute() if model_dir else None,
    )


def _quadratics_problem(cfg: RunConfig, world_size: int) -> tuple[RunConfig, Any]:
    """The problem to train on, and the config recording what it is (the file's dim, not a default)."""
    from relaympi.tasks import quadratics

    try:
        if cfg.problem_file is None:
            spec = quadratics.QuadraticsSpec()
            given = {k: getattr(cfg, k) for k in ("dim", "mu", "L", "zeta2", "r0", "sigma2") if getattr(cfg, k) is not None}
            spec = replace(spec, **given)
            return replace(cfg, **{k: getattr(spec, k) for k in ("dim", "mu", "L", "zeta2", "r0", "sigma2")}), quadratics.generate(world_size, spec, cfg.seed)
        problem = quadratics.load(cfg.problem_file, world_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    for name, value in (("dim", problem.dim), ("sigma2", problem.sigma2)):
        given = getattr(cfg, name)
        if given is not None and given != value:
            raise ConfigError(f"--{name} {given} conflicts with --problem-file {cfg.problem_file}, which has {name} {value:g}; drop --{name}")
    return replace(cfg, dim=problem.dim, sigma2=problem.sigma2), problem


def _check_combination(cfg: RunConfig, topology: Any, world_size: int) -> None:
    """Refuse invalid algorithm x topology pairs before any worker starts (the same check on every rank)."""
    from relaympi.algorithms import AlgorithmError
    from relaympi.algorithms.d2 import d2_mixing_matrix

    if cfg.algo in ("relay", "relay-grad") and not topology.is_tree:
        raise AlgorithmError(
            f"{cfg.algo} relays over spanning trees; topology {topology.name!r} is not a tree. Choose chain, star, "
            "binary-tree, double-binary-trees, social-network-tree or spanning-tree:<graph>"
        )
    if cfg.algo == "allreduce" and topology.name != "fully-connected":
        raise AlgorithmError(f"allreduce averages over all workers (topology fully-connected), not over {topology.name!r}")
    if cfg.algo == "sgp" and topology.name != "exponential":
        raise AlgorithmError(f"sgp runs on the time-varying 'exponential' topology, not {topology.name!r}")
    if cfg.algo in ("dpsgd", "qgm", "d2", "gt") and topology.num_layers != 1:
        raise AlgorithmError(f"{cfg.algo} gossips over one graph; {topology.name!r} has {topology.num_layers} layers (use ring, chain, binary-tree, ...)")
    if cfg.algo in ("dpsgd", "qgm", "d2", "gt") and topology.name == "exponential":
        raise AlgorithmError(f"{cfg.algo} needs a fixed graph; 'exponential' is SGP's time-varying schedule")
    if cfg.algo == "d2":
        d2_mixing_matrix(topology, cfg.d2_exact_diffusion, cfg.d2_force)
    if cfg.algo == "qgm" and (cfg.optimizer != "sgd" or not cfg.momentum):
        raise AlgorithmError(f"qgm needs --optimizer sgd with --momentum > 0 (got {cfg.optimizer}, momentum {cfg.momentum})")


def finish_plan(plan: Plan, steps_per_epoch: int) -> Plan:
    """Step counts that depend on the data set size (known once a worker loaded its task)."""
    cfg = plan.cfg
    plan.steps_per_epoch = steps_per_epoch
    plan.total_steps = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * steps_per_epoch))
    if cfg.eval_every is not None:
        plan.eval_every = cfg.eval_every
    elif cfg.task == "quadratics":
        plan.eval_every = max(1, plan.total_steps // 200)
    else:
        plan.eval_every = max(1, round(plan.task_defaults.eval_every_epochs * steps_per_epoch))
    plan.checkpoint_every = cfg.checkpoint_every or plan.eval_every
    plan.warmup_steps = round(cfg.warmup_epochs * steps_per_epoch) if plan.world_size > 1 else 0
    plan.milestone_steps = tuple(round(m * steps_per_epoch) for m in cfg.milestones)
    return plan


def default_out(cfg: RunConfig, world_size: int) -> Path:
    """results/<task>-<algo>-<topology>-n<N>-a<alpha>-s<seed>.h5: a plain file name directly in results/."""
    return Path("results") / f"{cfg.task}-{cfg.algo}-{_topology_slug(cfg.topology)}-n{world_size}-a{cfg.alpha:g}-s{cfg.seed}.h5"


def _topology_slug(name: str) -> str:
    """A topology name as part of a file name: an edge list becomes its file's stem and a short
    hash of its content (two different files named chain.txt never share a run file)."""
    import hashlib
    import re

    prefix, sep, path = name.partition("edge-list:")
    if sep:
        file = Path(path)
        try:
            digest = hashlib.sha256(file.read_bytes()).hexdigest()[:8]
        except OSError:
            digest = hashlib.sha256(path.encode()).hexdigest()[:8]
        name = f"{prefix}edge-list-{file.stem}-{digest}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")


class _Stop(Exception):
    def __init__(self, status: str, step: int, detail: str = ""):
        super().__init__(f"{status} at step {step} {detail}".strip())
        self.status, self.step, self.detail = status, step, detail


def _device_for(cfg: RunConfig, rank: int) -> str:
    if cfg.device == "cuda":
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError("--device cuda but torch sees no GPU")
        local = int(os.environ.get("MPI_LOCALRANKID", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("SLURM_LOCALID", rank))))
        return f"cuda:{local % count}"
    return cfg.device


_SHARED: dict[tuple, Any] = {}
_SHARED_LOCK = threading.Lock()


def _shared(key: tuple, make: Any) -> Any:
    """One instance per process of read-only setup (data sets, partitions), shared by in-process ranks."""
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = make()
        return _SHARED[key]


def _make_workload(plan: Plan, rank: int) -> Any:
    from relaympi.tasks import TaskOptions, get_task_class
    from relaympi.tasks.partition import dirichlet_partition
    from relaympi.workloads import ModelWorkload, QuadraticWorkload

    cfg = plan.cfg
    if cfg.task == "quadratics":
        return QuadraticWorkload(plan.problem, cfg, rank)
    options = TaskOptions(
        data_dir=cfg.data_dir, model_dir=cfg.model_dir, seed=cfg.seed, eval_batch_size=cfg.eval_batch_size,
        num_loader_workers=cfg.loader_workers, device=cfg.device,
    )
    task = _shared(("task", cfg.task, options), lambda: get_task_class(cfg.task)(options))
    parts = _shared(("parts", cfg.task, options, plan.world_size, cfg.alpha), lambda: dirichlet_partition(task.train_labels, plan.world_size, cfg.alpha, cfg.seed))
    return ModelWorkload(task, cfg, rank, plan.world_size, cfg.batch_size, parts[rank])


class Worker:
    """One worker's run: the one training loop shared by every algorithm and task."""

    def __init__(self, comm: Any, plan: Plan, out: Path, writer_factory: Any):
        from relaympi.algorithms import AlgorithmOptions, make_algorithm
        from relaympi.optim import make_optimizer

        self.comm, self.plan, self.out = comm, plan, out
        self.rank, self.n = comm.rank, comm.world_size
        cfg = replace(plan.cfg, device=_device_for(plan.cfg, comm.rank))
        self.cfg = cfg
        self.workload = _make_workload(replace(plan, cfg=cfg), self.rank)
        finish_plan(plan, self.workload.steps_per_epoch)
        x = self.workload.x
        self.optimizer = make_optimizer(plan.optimizer, x)
        options = AlgorithmOptions(relay_mode=cfg.relay_mode or "counts", relay_in_place=cfg.relay_in_place, relay_chunk=cfg.relay_chunk, d2_force=cfg.d2_force, d2_exact_diffusion=cfg.d2_exact_diffusion)
        self.algorithm = make_algorithm(cfg.algo, comm, plan.topology, self.optimizer, x, options)
        self.writer_factory = writer_factory
        self.writer = None
        self.start_step = 0
        self.loss_sum, self.loss_count = 0.0, 0
        self.time_compute = self.time_comm = self.time_eval = self.time_sync = 0.0
        self.wall_offset = 0.0  # seconds run before a resume
        self.model_finite = True
        self.inject = _fault_injection()

    # -- checkpoints -----------------------------------------------------------------------
    def _state(self, step: int) -> dict[str, Any]:
        import torch

        return {
            "x": self.workload.x.detach().cpu(),
            "optimizer": {k: (v.detach().cpu() if hasattr(v, "detach") else v) for k, v in self.optimizer.state_dict().items()},
            "algorithm": {k: v.detach().cpu() for k, v in self.algorithm.state_dict().items()},
            "loss_sum": torch.tensor(self.loss_sum, dtype=torch.float64),
            "loss_count": torch.tensor(self.loss_count),
            "bytes_sent": torch.from_numpy(self.comm.bytes_sent.copy()),
            "timers": torch.tensor([self.time_compute, self.time_comm, self.time_eval, self.time_sync, self._elapsed()], dtype=torch.float64),
        }

    def save_checkpoint(self, step: int) -> None:
        from relaympi import checkpoint

        directory = self.cfg.checkpoint_dir
        checkpoint.save(directory, self.rank, step, self._state(step))
        self.comm.barrier()
        if self.rank == 0:
            checkpoint.write_meta(directory, {"step": step, "world_size": self.n, "config": _resume_key(self.cfg)})
        self.comm.barrier()
        checkpoint.prune(directory, self.rank, step)

    def _on_rank0_agreed(self, action: Any) -> bool:
        """Run ``action`` on rank 0 only and share its truth value; a usage error there stops every
        rank (the others must not go on to wait for rank 0 in a collective)."""
        result, error = 0.0, None
        if self.rank == 0:
            try:
                result = 1.0 if action() else 0.0
            except _usage_errors() as exc:
                error = exc
        flags = self.comm.allreduce_flags(np.array([1.0 if error else 0.0, result]))
        if flags[0] > 0:
            raise error if error is not None else ConfigError("rank 0 refused the run (see its error)")
        return bool(flags[1])

    def _resumable(self) -> bool:
        """Rank 0: resume only into this run's own unfinished file; otherwise forget a stale checkpoint."""
        from relaympi import checkpoint
        from relaympi.results import run_status

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
        """Load the checkpoint named by meta.json, if any; return the step to continue from."""
        from relaympi import checkpoint

        directory = self.cfg.checkpoint_dir
        if directory is None:
            return 0
        meta = checkpoint.read_meta(directory)
        if meta is None:
            return 0
        saved, current = meta.get("config") or {}, _resume_key(self.cfg)
        if meta.get("world_size") != self.n or saved != current:
            differences = [f"world size {meta.get('world_size')} vs {self.n}"] if meta.get("world_size") != self.n else []
            differences += [f"{k} {saved.get(k)!r} vs {current.get(k)!r}" for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
            raise ConfigError(
                f"checkpoint in {directory} belongs to a different run (checkpoint vs this command: {'; '.join(differences)}); "
                "use another --checkpoint-dir or delete it"
            )
        step = int(meta["step"])
        state = checkpoint.load(directory, self.rank, step)
        self.workload.x.copy_(state["x"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.algorithm.load_state_dict(state["algorithm"])
        self.loss_sum, self.loss_count = float(state["loss_sum"]), int(state["loss_count"])
        self.comm.bytes_sent[:] = state["bytes_sent"].numpy()
        self.time_compute, self.time_comm, self.time_eval, self.time_sync, self.wall_offset = (float(v) for v in state["timers"])
        return step

    # -- evaluation ------------------------------------------------------------------------
    def _elapsed(self) -> float:
        return self.wall_offset + (time.perf_counter() - self.t0)

    def evaluate(self, step: int) -> None:
        import torch

        metrics = self.workload.evaluate()
        train_loss = self.loss_sum / self.loss_count if self.loss_count else self.workload_loss()
        self.loss_sum, self.loss_count = 0.0, 0
        self.model_finite = bool(torch.isfinite(self.workload.x).all())
        row = [train_loss, metrics.get("test_loss", math.nan), metrics.get("test_accuracy", math.nan), float(self.comm.bytes_sent.sum()),
               self.time_compute, self.time_comm, self.time_eval, self.time_sync]
        if self.workload.x.is_cuda:
            row.append(float(torch.cuda.max_memory_allocated(self.workload.x.device)))
        table = self.comm.gather_rows(np.asarray(row))
        params = self.comm.gather_rows(self.workload.x.detach().cpu().numpy()) if self.cfg.task == "quadratics" else None
        if self.rank != 0:
            return
        out = {
            "step": step,
            "epoch": self.plan.epoch_at(step),
            "time_s": self._elapsed(),
            "lr": self.plan.lr_at(step),
            "train_loss": table[:, 0],
            "bytes_sent": table[:, 3],
            "time_compute_s": table[:, 4],
            "time_comm_s": table[:, 5],
            "time_eval_s": table[:, 6],
            "time_sync_s": table[:, 7],
        }
        if table.shape[1] > 8:
            out["gpu_max_memory_bytes"] = table[:, 8]
        if self.cfg.task != "quadratics":
            out["test_loss"], out["test_accuracy"] = table[:, 1], table[:, 2]
        else:
            out.update(self.workload.summarize(params))
            if self.cfg.record_params:
                out["params"] = params
        self.writer.append(out)
        self._log_eval(step, out)

    def workload_loss(self) -> float:
        return self.workload.local_loss() if hasattr(self.workload, "local_loss") else math.nan

    def _log_eval(self, step: int, row: dict[str, Any]) -> None:
        total = self.plan.total_steps
        elapsed = self._elapsed()
        done = max(step - self.start_step, 1)
        eta = (total - step) * (time.perf_counter() - self.t0) / done if step > self.start_step else math.nan
        parts = [f"step {step}/{total}", f"epoch {row['epoch']:.2f}"]
        train_loss = _nanmean(row["train_loss"])
        if not math.isnan(train_loss):  # nothing trained yet at step 0 of a classification run
            parts.append(f"train_loss {train_loss:.4f}")
        if "test_accuracy" in row:
            acc = row["test_accuracy"]
            parts.append(f"test_acc worst {np.min(acc):.4f} mean {np.mean(acc):.4f}")
        if "suboptimality" in row:
            parts.append(f"subopt {row['suboptimality']:.3e} consensus {row['consensus_distance']:.3e}")
        if step > self.start_step:
            samples = done * self.cfg.batch_size * self.n
            parts.append(f"{samples / max(time.perf_counter() - self.t0, 1e-9):.0f} samples/s")
            parts.append(f"eta {eta:.0f}s")
        parts.append(f"elapsed {elapsed:.1f}s")
        log.info(" | ".join(parts))

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> str:
        import torch

        self.t0 = time.perf_counter()
        plan, cfg = self.plan, self.cfg
        hosts = self.comm.gather(socket.gethostname())
        resume = self._on_rank0_agreed(self._resumable)
        self.start_step = self.try_resume() if resume else 0
        if self.rank == 0 and self.start_step:
            log.info("resuming from the checkpoint of step %d in %s", self.start_step, cfg.checkpoint_dir)
        self._on_rank0_agreed(lambda: setattr(self, "writer", self.writer_factory(self.start_step, hosts, self.comm.describe())))
        if self.writer is not None and hasattr(self.workload, "task"):  # for the chance-accuracy check
            self.writer.set_attrs(num_classes=int(self.workload.task.num_classes))
        self.t0 = time.perf_counter()
        sync = torch.cuda.synchronize if self.workload.x.is_cuda else (lambda: None)
        step = self.start_step
        bar = _progress_bar(plan.total_steps, step) if self.rank == 0 else None
        try:
            while True:
                if step % plan.eval_every == 0 or step == plan.total_steps:
                    t_eval = time.perf_counter()
                    self.evaluate(step)
                    self.time_eval += time.perf_counter() - t_eval
                if step == plan.total_steps:
                    break
                if cfg.checkpoint_dir is not None and step > self.start_step and step % plan.checkpoint_every == 0:
                    self.save_checkpoint(step)
                if self.inject is not None and self.inject == (self.rank, step):
                    raise RuntimeError(f"injected failure on rank {self.rank} at step {step} ({FAULT_ENV})")
                t = time.perf_counter()
                loss = self.workload.gradient(step)
                sync()
                t_mid = time.perf_counter()
                self.algorithm.step(self.workload.x, self.workload.grad, plan.lr_at(step), step)
                sync()
                self.time_compute += t_mid - t
                self.time_comm += time.perf_counter() - t_mid
                self.loss_sum += loss
                self.loss_count += 1
                bad = not (math.isfinite(loss) and self.model_finite)
                t_sync = time.perf_counter()
                flags = self.comm.allreduce_flags(np.array([1.0 if _STOP.is_set() else 0.0, 1.0 if bad else 0.0]))
                self.time_sync += time.perf_counter() - t_sync
                step += 1
                if bar is not None:
                    bar.update(1)
                if flags[1] > 0:
                    raise _Stop("diverged", step if math.isfinite(loss) else step - 1, "non-finite loss or model")
                if flags[0] > 0 and step < plan.total_steps:
                    raise _Stop("preempted", step)
                if cfg.log_every and step % cfg.log_every == 0 and self.rank == 0:
                    log.info("step %d/%d loss %.4f lr %.4g", step, plan.total_steps, loss, plan.lr_at(step))
            if not bool(torch.isfinite(self.workload.x).all()):
                raise _Stop("diverged", step, "non-finite model")
        except _Stop as stop:
            if bar is not None:
                bar.close()
            if stop.status == "preempted" and cfg.checkpoint_dir is not None:
                self.save_checkpoint(stop.step)
            if self.rank == 0:
                attrs = {"stopped_step": stop.step, "stopped_epoch": plan.epoch_at(stop.step)}
                if stop.status == "diverged":
                    attrs = {"diverged_step": stop.step, "diverged_epoch": plan.epoch_at(stop.step)}
                self.writer.set_status(stop.status, **attrs)
            return stop.status
        if bar is not None:
            bar.close()
        if self.rank == 0:
            self.writer.set_status("completed", total_steps=plan.total_steps, time_compute_s=self.time_compute, time_comm_s=self.time_comm)
        return "completed"


FAULT_ENV = "RELAYMPI_INJECT_FAILURE"


def _fault_injection() -> tuple[int, int] | None:
    """RELAYMPI_INJECT_FAILURE=RANK:STEP makes that rank raise at that step (to test failure handling)."""
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    try:
        rank, step = (int(v) for v in value.split(":"))
    except ValueError as exc:
        raise ConfigError(f"{FAULT_ENV}={value!r}; expected RANK:STEP, e.g. 1:5") from exc
    return rank, step


def _progress_bar(total: int, initial: int) -> Any:
    """A tqdm bar on rank 0 when stderr is a terminal (log lines alone otherwise)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)


class BarSafeHandler(logging.StreamHandler):
    """Log lines written through tqdm.write: it lifts the progress bar off the line, prints the
    message on a line of its own and redraws the bar below (a plain write would land on the bar's line)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else math.nan


def _resume_key(cfg: RunConfig) -> dict[str, Any]:
    """The config fields that must match for a checkpoint to be resumed."""
    d = cfg.to_dict()
    for key in ("out", "overwrite", "checkpoint_dir", "backend", "workers", "log_every", "threads", "loader_workers", "device", "eval_batch_size"):
        d.pop(key, None)
    return d


def _writer_factory(plan: Plan, out: Path, command: str) -> Any:
    from relaympi import provenance
    from relaympi.results import RunExistsError, RunWriter, run_status

    def make(start_step: int, hosts: list[str], transport: dict[str, Any]) -> Any:
        try:
            if start_step > 0 and run_status(out) in ("running", "preempted", "failed"):
                return RunWriter.reopen(out, resume_step=start_step - 1)
            return RunWriter.create(
                out, config=plan.cfg.to_dict() | {"world_size": plan.world_size, "lr_effective": plan.lr, "total_steps": plan.total_steps},
                provenance=provenance.collect(transport, hosts, command=command), world_size=plan.world_size, overwrite=plan.cfg.overwrite,
            )
        except RunExistsError as exc:
            raise ConfigError(f"{out} already holds a finished run; pass --overwrite to replace it") from exc
        except OSError as exc:
            # a live run holds HDF5's lock: RunWriter.create probes it (RunInUseError, a BlockingIOError) before
            # h5py would truncate the file; reopen fails on the lock without writing
            if isinstance(exc, BlockingIOError) or "lock" in str(exc).lower():
                raise ConfigError(f"{out} is being written by another run; give this run another --out, or wait for that one to end") from exc
            raise ConfigError(f"cannot write the run file --out {out}: {exc}; choose a writable path") from exc

    return make


def _usage_errors() -> tuple[type[BaseException], ...]:
    from relaympi.checkpoint import CheckpointError
    from relaympi.tasks import TaskError

    return (ConfigError, TaskError, CheckpointError)


def _run_rank(comm: Any, plan: Plan, out: Path, command: str) -> str:
    """One rank's whole run; a failure is recorded (rank 0) or reported to rank 0 (others)."""
    import copy

    plan = copy.copy(plan)
    worker = None
    try:
        worker = Worker(comm, plan, out, _writer_factory(plan, out, command))
    except _usage_errors() as exc:
        # setup errors are the same on every rank; agree on them so none waits for the others
        comm.allreduce_flags(np.array([1.0]))
        raise exc
    if comm.allreduce_flags(np.array([0.0]))[0] > 0:
        raise ConfigError("another rank failed to set up (see its error above)")
    try:
        return worker.run()
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}"
        if comm.rank == 0 and worker.writer is not None:
            worker.writer.set_status("failed", error=message, traceback=traceback.format_exc()[-20000:])
        elif comm.rank != 0 and not isinstance(exc, _usage_errors()):
            comm.report_failure(message)
        raise
    finally:
        if comm.rank == 0 and worker.writer is not None:
            worker.writer.close()


def _save_problem(plan: Plan) -> None:
    """Write --save-problem; an existing file is replaced only with --overwrite (others may train on it).

    A file that already holds exactly this problem is left as it is, so re-running the command
    (to resume after preemption) works without --overwrite.
    """
    path = plan.cfg.save_problem
    if path is None or plan.problem is None:
        return
    path = Path(path)
    if not path.resolve().parent.is_dir():
        raise ConfigError(f"--save-problem {path}: its directory does not exist")
    if path.exists() and not plan.cfg.overwrite:
        if _holds_problem(path, plan.problem):
            return
        raise ConfigError(f"--save-problem {path} already exists and holds another problem (other runs may use it); "
                          "choose another file, or pass --overwrite to replace it")
    plan.problem.save(path)


def _holds_problem(path: Path, problem: Any) -> bool:
    from relaympi.tasks import quadratics

    try:
        saved = quadratics.load(path)
    except Exception:  # noqa: BLE001 - anything unreadable is "another file", never replaced silently
        return False
    return saved.A.shape == problem.A.shape and np.array_equal(saved.A, problem.A) and np.array_equal(saved.b, problem.b) and saved.sigma2 == problem.sigma2


_EXIT = {"completed": EXIT_COMPLETED, "diverged": EXIT_DIVERGED, "preempted": EXIT_PREEMPTED}


def _summary(out: Path, status: str) -> None:
    from relaympi.results import CHANCE_FACTOR, read_run, workers_at_chance

    try:
        run = read_run(out)
    except Exception:  # noqa: BLE001 - a summary must never turn success into failure
        log.info("%s: %s", status, out)
        return
    line = f"{status}: {out}"
    # only a completed run has a final model; otherwise say where it stopped
    steps = run.data.get("step")
    at = f"at step {int(steps[-1])} (not final: {status})" if steps is not None and len(steps) else f"(not final: {status})"
    final = {"test": "final test accuracy", "sub": "final suboptimality"}
    if status != "completed":
        final = {"test": f"test accuracy {at}", "sub": f"suboptimality {at}"}
    if "test_accuracy" in run.data and len(run.data["test_accuracy"]):
        acc = run.data["test_accuracy"][-1]
        line += f" | {final['test']}: worst worker {np.min(acc):.4f}, mean {np.mean(acc):.4f}, best {np.max(acc):.4f}"
        epoch = run.data["epoch"]
        window = (epoch > epoch[-1] - 5) & (epoch > 0)  # the paper's last-5-epochs window, as the report uses it
        if window.any():
            acc = run.data["test_accuracy"][window].mean(axis=0)
            line += f" | last 5 epochs (paper metric): worst worker {acc.min():.4f}, mean {acc.mean():.4f}"
        num_classes = run.attrs.get("num_classes")
        chance = workers_at_chance(acc, num_classes)
        if chance:
            line += (
                f" | WARNING: worker(s) {', '.join(map(str, chance))} at chance accuracy (< {CHANCE_FACTOR / num_classes:.0%}); "
                "check the learning rate (the defaults were tuned for 16 workers)"
            )
    if "suboptimality" in run.data and len(run.data["suboptimality"]):
        line += f" | {final['sub']} {run.data['suboptimality'][-1]:.3e}"
    print(line, flush=True)


def _configure(cfg: RunConfig, rank: int, local_size: int) -> None:
    import torch

    threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(local_size, 1))
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", handlers=[BarSafeHandler(sys.stderr)])
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGUSR1, _request_stop)


def _main_local(cfg: RunConfig, argv: list[str]) -> int:
    from relaympi.comm import DropPolicy, run_local

    _configure(cfg, 0, cfg.workers if cfg.workers > 1 else 1)
    plan = resolve(cfg, cfg.workers)
    plan.warn_untuned_lr()
    out = Path(cfg.out) if cfg.out else default_out(plan.cfg, plan.world_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    plan.cfg = replace(plan.cfg, out=out)
    _save_problem(plan)
    statuses = run_local(plan.world_size, _run_rank, plan, out, _rerun_command(argv), drops=DropPolicy(cfg.drop_prob, cfg.seed))
    _summary(out, statuses[0])
    return _EXIT[statuses[0]]


def _local_size() -> int:
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1


def _main_mpi(cfg: RunConfig, argv: list[str]) -> int:
    from relaympi.comm.mpi import world_size

    size = world_size()
    if size == 1 and not _under_launcher():  # `mpirun -n 1` is the single-worker baseline; plain python is a mistake
        raise ConfigError(
            "this is one process, so there is only one worker. Launch one worker per rank: "
            "`mpirun -n 16 python -m relaympi.train ...` (or srun under SLURM), or run all workers in this "
            "process with `--backend local --workers 16`; a single-worker baseline runs as "
            "`mpirun -n 1 python -m relaympi.train --algo allreduce ...` or `--backend local --workers 1 --algo allreduce`"
        )
    from relaympi.comm import DropPolicy, mpi_communicator

    comm = mpi_communicator(drops=DropPolicy(cfg.drop_prob, cfg.seed))
    _configure(cfg, comm.rank, _local_size())
    error = None
    try:
        plan = resolve(cfg, size)
        out = Path(cfg.out) if cfg.out else default_out(plan.cfg, size)
        plan.cfg = replace(plan.cfg, out=out)
        if comm.rank == 0:
            plan.warn_untuned_lr()
            out.parent.mkdir(parents=True, exist_ok=True)
            _save_problem(plan)
    except ConfigError as exc:
        error = exc
    # every rank must agree to stop: one that went on would wait for the others forever
    flags = comm.allreduce_flags(np.array([1.0 if error else 0.0, 1.0 if error and comm.rank == 0 else 0.0]))
    if flags[0] > 0:
        if error is not None and (comm.rank == 0 or flags[1] == 0):  # one copy of the message where possible
            print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        status = _run_rank(comm, plan, out, _rerun_command(argv, size))
    except _usage_errors() as exc:
        if comm.rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BaseException as exc:  # noqa: BLE001 - tear the whole job down: no rank may wait forever
        print(f"rank {comm.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if comm.rank != 0:
            time.sleep(5.0)  # let rank 0 record the failure first; it aborts the job when it sees it
        comm.abort(EXIT_FAILED)
        return EXIT_FAILED
    if comm.rank == 0:
        _summary(out, status)
    return _EXIT[status]


def _under_launcher() -> bool:
    """Whether mpirun/mpiexec/srun started this process (even as its only rank)."""
    return any(var in os.environ for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"))


def _launched_by_mpi() -> int:
    """World size announced by an MPI launcher or srun in the environment (1 when none)."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            return int(value)
    return 1


def _rerun_command(argv: list[str], mpi_ranks: int | None = None) -> str:
    """The command that runs this again (recorded in provenance.command): the module, not a file path."""
    import shlex

    launch = ["mpirun", "-n", str(mpi_ranks)] if mpi_ranks else []
    return shlex.join([*launch, "python", "-m", "relaympi.train", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(argv)
        if cfg.backend == "local":
            if _launched_by_mpi() > 1:
                raise ConfigError(
                    f"--backend local runs all workers in one process, but this is one of {_launched_by_mpi()} MPI ranks: "
                    "drop --backend/--workers under mpirun/srun, or run the command without mpirun"
                )
            return _main_local(cfg, argv)
        return _main_mpi(cfg, argv)
    except _usage_errors() as exc:
        from relaympi.entrypoint import launcher_rank

        if launcher_rank() == 0:  # every rank found the same error: one copy of the message
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `... --help | head`: the reader left; entrypoint.run ends quietly
        raise
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        print(f"failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(main)
