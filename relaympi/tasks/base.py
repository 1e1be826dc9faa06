"""The Task interface: data, model and defaults of one training workload."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np


@dataclass(frozen=True)
class TaskDefaults:
    """A task's default hyper-parameters (the paper's settings for that workload).

    Learning rates are per worker and per step; ``lr_by_algo`` overrides ``lr`` for an
    algorithm (an explicit ``--lr`` always wins over both). ``tuned_lr`` is the paper's table of
    tuned learning rates where it has one (jobs/sweeps.py reads every cell of it); ``lr_by_algo``
    is then one column of it (``lr_column``).
    """

    epochs: float = 10
    batch_size: int = 32  # samples per worker per step
    lr: float = 0.1
    lr_by_algo: dict[str, float] = field(default_factory=dict)
    optimizer: str = "sgd"  # sgd | adam
    momentum: float = 0.0
    weight_decay: float = 0.0
    milestones: tuple[float, ...] = ()  # epochs at which the lr is divided by 10
    warmup_epochs: float = 0.0  # linear warm-up (from warmup_from * lr) when n > 1
    warmup_from: float = 0.0
    eval_every_epochs: float = 1.0
    metric: str = "worst"  # the paper's reported metric: "worst" worker or "mean" of workers
    # the learning rates were tuned (by the paper, or our digits grid) for this many workers on each
    # algorithm's default topology; the trainer warns when a default lr runs at another worker count
    lr_tuned_workers: int | None = 16
    # evaluate this many times per run instead of every eval_every_epochs (tasks whose "epoch" is
    # one step)
    evals_per_run: int | None = None
    # (algo, with momentum) -> {alpha: lr}: the paper's tuned rates, one row per table line
    tuned_lr: dict[tuple[str, bool], dict[float, float]] = field(default_factory=dict)

    def tuned_lr_for(self, algo: str, momentum: float | None, alpha: float) -> float | None:
        """The paper's tuned lr for this cell, or None where it has none (momentum None: the
        task's)."""
        with_momentum = bool(self.momentum if momentum is None else momentum)
        return self.tuned_lr.get((algo, with_momentum), {}).get(alpha)


def lr_column(
    tuned_lr: dict[tuple[str, bool], dict[float, float]], alpha: float
) -> dict[str, float]:
    """One alpha column of a tuned_lr table per algorithm: its momentum row, where it has one."""
    algos = dict.fromkeys(algo for algo, _ in tuned_lr)
    return {
        algo: (tuned_lr[algo, True] if (algo, True) in tuned_lr else tuned_lr[algo, False])[alpha]
        for algo in algos
    }


@dataclass(frozen=True)
class TaskOptions:
    """What the command line tells every task (each task uses what it needs)."""

    data_dir: Path | None = None
    model_dir: Path | None = None
    seed: int = 0
    eval_batch_size: int = 256
    num_loader_workers: int = 2
    device: str = "cpu"


class TaskError(ValueError):
    """Bad task input (missing data, unreadable files); the CLI turns it into exit status 2."""


def too_many_workers(task: str, world_size: int, num_train: int) -> str:
    """The refusal of a run with more workers than training samples (each worker needs one)."""
    return (
        f"{world_size} workers cannot share the {num_train} training samples of {task}: "
        "every worker needs at least one; "
        f"use at most {num_train} workers (--workers, or the number of MPI ranks)"
    )


class Task(ABC):
    """A training workload: what the training loop needs to know to run it on any backend.

    The class is cheap (defaults and run-level settings, used to validate a configuration
    without touching data). A task sees its own options and the world size, never the run:
    training (relaympi.training.workloads) builds one worker's state (model or local objective, data
    shard, gradients) from the task and the resolved plan.
    """

    name: ClassVar[str]
    # its defaults, from relaympi.tasks.defaults (torch-free; so is the topology an algorithm
    # runs on for it where that differs from the algorithm's own default)
    defaults: ClassVar[TaskDefaults]
    # the run settings (flag names, as attributes of the run's config) that are this task's
    # own options
    option_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def settle(cls, options: dict[str, Any], world_size: int) -> tuple[dict[str, Any], Any]:
        """The task's own options (``option_names``) with its defaults filled in, as the run records
        them, and the run-level problem the workers share (None for tasks whose data each worker
        loads itself). A bad option is a ValueError."""
        return options, None

    @classmethod  # noqa: B027 - a task without data files has nothing to check
    def check_data(cls, options: TaskOptions) -> None:
        """Raise TaskError unless the files this task reads are where ``options`` say (their
        presence only, nothing loaded): a run checks it before it warns or writes anything."""

    @classmethod
    def model_bytes(cls, settled: dict[str, Any], problem: Any) -> int | None:
        """Bytes of one worker's flat model where the class tells them before any data loads
        (``settle``'s options and problem), else None. --overlap's default weighs them."""
        return None


class ClassificationTask(Task):
    """One classification workload.

    A task owns its data and model definition; it knows nothing of workers or
    communication. Training data is addressed by sample index: the training loop decides
    which indices a worker sees at which step (``relaympi.tasks.partition``), so a run's data
    order is a pure function of (seed, rank, step) and resumes exactly.
    """

    # the number of training samples where the task fixes it (embedded data): a run with more
    # workers is refused before any data loads; other tasks' sizes are known once their data set
    # is read
    train_size: ClassVar[int | None] = None

    def __init__(self, options: TaskOptions):
        self.options = options

    @classmethod
    def settle(cls, options: dict[str, Any], world_size: int) -> tuple[dict[str, Any], Any]:
        if cls.train_size is not None and world_size > cls.train_size:
            raise TaskError(too_many_workers(cls.name, world_size, cls.train_size))
        return options, None

    @property
    @abstractmethod
    def num_classes(self) -> int: ...

    @property
    @abstractmethod
    def train_labels(self) -> np.ndarray:
        """int64 label of every training sample, in index order (for Dirichlet partitioning)."""

    @abstractmethod
    def build_model(self, seed: int) -> Any:
        """A fresh torch.nn.Module; the same seed gives bit-identical initial weights."""

    @abstractmethod
    def train_batch(self, indices: np.ndarray, rng: np.random.Generator) -> tuple[Any, Any]:
        """(inputs, targets) tensors for these training samples, augmented with ``rng``."""

    @abstractmethod
    def test_batches(self, batch_size: int) -> Iterator[tuple[Any, Any]]:
        """(inputs, targets) over the full test set, in a fixed order, no augmentation."""

    def train_batches(
        self, batch_indices: Iterator[np.ndarray], rngs: Iterator[np.random.Generator]
    ) -> Iterator[tuple[Any, Any]]:
        """Batches for a stream of index arrays. Tasks with costly decoding override this
        to prefetch with worker processes; the result must not depend on how it is done."""
        for indices, rng in zip(batch_indices, rngs, strict=False):
            yield self.train_batch(indices, rng)

    def loss(self, outputs: Any, targets: Any) -> Any:
        # lazy: this module (the Task interface) stays torch-free for config checks
        import torch.nn.functional as F

        return F.cross_entropy(outputs, targets)

    def forward(self, model: Any, inputs: Any) -> Any:
        """Model outputs (logits) for a batch; tasks with structured inputs override this."""
        return model(inputs)
