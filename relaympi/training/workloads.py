"""What a worker trains: a task's model on its data shard, or one random quadratic f_i.

Part of training (it reads the resolved plan): a task never sees the run, so building a
worker's workload from a task and a plan happens here (``build_workload``).
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from relaympi.config import ConfigError, RunConfig
from relaympi.flat import flatten_module, padded_zeros
from relaympi.launcher import launch
from relaympi.tasks.base import ClassificationTask, TaskError, too_many_workers
from relaympi.tasks.partition import (
    PartitionError,
    ShardSampler,
    dirichlet_partition,
    steps_per_epoch,
)
from relaympi.tasks.quadratics import Quadratics, QuadraticsTask

if TYPE_CHECKING:
    from relaympi.training.plan import Plan

# In-process ranks are threads: model construction seeds torch's global RNG (fork_rng +
# manual_seed), so two ranks building at once would draw from each other's seed.
_BUILD_LOCK = threading.Lock()


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


class Workload(ABC):
    """One worker's trainable state: flat parameters ``x`` and gradient ``grad`` (views the
    algorithms update in place), and how to compute gradients and evaluate."""

    x: torch.Tensor
    grad: torch.Tensor
    steps_per_epoch: int
    num_classes: int | None = None  # for the chance-accuracy check of classification runs
    # whether rank 0 needs every worker's parameters at evaluation (summarize)
    reports_params: ClassVar[bool] = False

    @abstractmethod
    def gradient(self, step: int) -> float:
        """Fill ``grad`` with the stochastic gradient of step ``step``; return its loss."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """This worker's own evaluation metrics, by name (the same names on every worker)."""

    def current_loss(self) -> float:
        """The training loss at the current model, before any step was taken (NaN: not known
        cheaply)."""
        return math.nan

    def summarize(self, X: np.ndarray) -> dict[str, Any]:
        """Rank 0: run-level metrics of all workers' parameters X [n, d] (when reports_params)."""
        return {}


_SHARED: dict[tuple, Any] = {}
_SHARED_LOCK = threading.Lock()


def _shared(
    key: tuple, make: Callable[[], Any], kept_errors: tuple[type[BaseException], ...] = ()
) -> Any:
    """One instance per process of read-only setup (data sets, partitions), shared by in-process
    ranks.

    An error of a ``kept_errors`` type is shared too: the other ranks raise it at once instead of
    repeating the work (a Dirichlet draw that fails takes seconds; 1000 ranks would each redo it).
    """
    with _SHARED_LOCK:
        if key not in _SHARED:
            try:
                _SHARED[key] = make()
            except kept_errors as exc:
                _SHARED[key] = exc
        if isinstance(_SHARED[key], BaseException):
            raise _SHARED[key]
        return _SHARED[key]


def build_workload(plan: Plan, rank: int, device: str) -> Workload:
    """Worker ``rank``'s workload on ``device`` (the process's data is loaded once and shared)."""
    if issubclass(plan.task, ClassificationTask):
        return model_workload(plan.task, plan, rank, device)
    if issubclass(plan.task, QuadraticsTask):
        return QuadraticWorkload(plan.problem, plan.cfg.seed, rank)
    raise TypeError(
        f"no workload for task class {plan.task.__name__}: a classification task or the quadratics"
    )


def model_workload(
    task_cls: type[ClassificationTask], plan: Plan, rank: int, device: str
) -> ModelWorkload:
    """Worker ``rank``'s model on its Dirichlet shard; the data set and partition are loaded once
    per process."""
    cfg = plan.cfg
    options = replace(plan.task_options, device=device)
    task = _shared(("task", cfg.task, options), lambda: task_cls(options))
    parts = _shared(
        ("parts", cfg.task, options, plan.world_size, cfg.alpha),
        lambda: run_partition(task, plan),
        kept_errors=(TaskError,),
    )
    return ModelWorkload(task, plan, rank, device, parts[rank])


def run_partition(task: ClassificationTask, plan: Plan) -> list[np.ndarray]:
    """The run's Dirichlet shards, one per worker; a split the data cannot give is a usage error
    (TaskError)."""
    cfg, labels = plan.cfg, task.train_labels
    if plan.world_size > len(labels):
        raise TaskError(too_many_workers(cfg.task, plan.world_size, len(labels)))
    try:
        return dirichlet_partition(labels, plan.world_size, cfg.alpha, cfg.seed)
    except PartitionError as exc:
        # Lin et al.'s draw is random: with few samples per worker no draw may meet its
        # half-share rule
        raise TaskError(
            f"--alpha {cfg.alpha:g} with {plan.world_size} workers on the {len(labels)} "
            f"training samples of {cfg.task} "
            f"(--seed {cfg.seed}): {exc}; --alpha inf splits iid"
        ) from exc


class ModelWorkload(Workload):
    """A classification task's model; parameters and gradients live in flat buffers."""

    def __init__(
        self, task: ClassificationTask, plan: Plan, rank: int, device: str, shard: np.ndarray
    ):
        cfg, world_size, batch_size = plan.cfg, plan.world_size, plan.cfg.batch_size
        assert batch_size is not None  # resolve() filled it in from the task's defaults
        self.task, self.rank, self.world_size = task, rank, world_size
        self.num_classes = int(task.num_classes)
        self.device = torch.device(device)
        with _BUILD_LOCK:
            self.model = task.build_model(cfg.seed).to(self.device)
        self.x, self.grad = flatten_module(self.model)
        labels = task.train_labels
        self.shard_size = len(shard)
        self.sampler = ShardSampler(shard, batch_size, cfg.seed, rank)
        self.steps_per_epoch = steps_per_epoch(len(labels), world_size, batch_size)
        self.batch_size = batch_size
        self.eval_batch_size = cfg.eval_batch_size
        self._batches: Iterator | None = None
        self._next_step = -1

    def gradient(self, step: int) -> float:
        """Fill self.grad with the minibatch gradient at step ``step``; return the minibatch
        loss."""
        if self._batches is None or step != self._next_step:
            self._batches = self.task.train_batches(
                (self.sampler.batch(s) for s in range(step, 1 << 62)),
                (self.sampler.rng(s) for s in range(step, 1 << 62)),
            )
        inputs, targets = next(self._batches)
        self._next_step = step + 1
        self.model.train()
        self.grad.zero_()
        loss = self.task.loss(
            self.task.forward(self.model, _to(inputs, self.device)), _to(targets, self.device)
        )
        loss.backward()
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """This worker's own model on the full test set."""
        self.model.eval()
        total_loss, correct, count = 0.0, 0, 0
        for inputs, targets in self.task.test_batches(self.eval_batch_size):
            targets = _to(targets, self.device)
            outputs = self.task.forward(self.model, _to(inputs, self.device))
            total_loss += float(
                torch.nn.functional.cross_entropy(outputs, targets, reduction="sum")
            )
            correct += int((outputs.argmax(dim=1) == targets).sum())
            count += int(targets.shape[0])
        return {"test_loss": total_loss / max(count, 1), "test_accuracy": correct / max(count, 1)}


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


class QuadraticWorkload(Workload):
    """Worker i minimizes f_i(x) = ||A_i x - b_i||^2 (float64, relaympi.tasks.quadratics), starting
    from x(0) = 0."""

    reports_params = True  # suboptimality and consensus distance need every worker's x

    def __init__(self, problem: Quadratics, seed: int, rank: int):
        self.problem, self.rank, self.seed = problem, rank, seed
        self.H = torch.from_numpy(problem.H[rank])
        self.c = torch.from_numpy(problem.c[rank])
        self.x = padded_zeros(problem.dim, dtype=torch.float64)  # spare slots: RelaySum counters
        self.grad = torch.zeros_like(self.x)
        self.steps_per_epoch = 1

    def gradient(self, step: int) -> float:
        torch.mv(self.H, self.x, out=self.grad)
        self.grad.sub_(self.c)
        if self.problem.sigma2:
            self.grad.add_(torch.from_numpy(self.problem.noise(self.seed, step, self.rank)))
        return self.current_loss()

    def current_loss(self) -> float:
        r = self.problem.A[self.rank] @ self.x.numpy() - self.problem.b[self.rank]
        return float(r @ r)

    def evaluate(self) -> dict[str, float]:
        return {}

    def summarize(self, X: np.ndarray) -> dict[str, Any]:
        """Rank 0: metrics of all workers' iterates X [n, d]."""
        return self.problem.summary(X)
