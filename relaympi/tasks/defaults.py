"""Each task's defaults, torch-free: `--help`, the flag table and the refusals that come before
torch read them without importing a task's model (under mpirun every rank would wait for torch).

A task's class takes its ``defaults`` from here; a new task adds its line to ``TASK_DEFAULTS`` (a
test keeps its names and order those of the ``TASKS`` registry), and to
``DEFAULT_TOPOLOGY_BY_ALGO`` where it runs an algorithm on a topology other than the algorithm's
own default.
"""

from __future__ import annotations

from relaympi.tasks.base import TaskDefaults, lr_column

QUADRATICS = TaskDefaults(
    epochs=1,
    batch_size=1,
    lr=0.1,
    momentum=0.0,
    eval_every_epochs=1,
    lr_tuned_workers=None,
    evals_per_run=200,
)

# 1438 training images: with 16 workers and 8 samples each, one epoch is 12 steps, so 20 epochs
# are 240 steps; 16 workers take ~2 s of one CPU core (torch with one thread). lr 0.1 is a
# placeholder until tuned per algorithm (centralized, i.e. all-reduce over 16 x 8 samples: 0.1
# reaches ~92% test accuracy, 0.3 ~97%). Learning rates: the best of lr in {0.05, 0.1, ..., 3.2}
# (x2 grid) for 16 workers, alpha = 0.01, 20 epochs, seed 0, plain SGD (qgm: momentum 0.9), by
# the paper's worst-worker metric (`python -m relaympi.report`): allreduce 96.5%, relay-grad
# 97.2%, qgm 96.0%, relay 94.1%, gt 92.4%, d2 91.9%, sgp 85.6%, dpsgd 73.5%. The grid loop is in
# docs/benchmarks.md ("Learning-rate grid on digits").
DIGITS = TaskDefaults(
    epochs=20,
    batch_size=8,
    lr=0.1,
    lr_by_algo={
        "allreduce": 0.4,
        "relay": 1.6,
        "relay-grad": 1.6,
        "dpsgd": 0.4,
        "qgm": 0.4,
        "d2": 0.1,
        "gt": 0.8,
        "sgp": 0.1,
    },
    optimizer="sgd",
    momentum=0.0,
    weight_decay=0.0,
    eval_every_epochs=1.0,
    metric="worst",
)

# The paper's tuned learning rates for VGG-11, 16 workers: appendix table "Learning rates used
# for Cifar-10 / VGG-11" (tab:apx:cifar-lr), (algo, with momentum) -> {alpha: lr}. The rows are
# the table's lines ("+momentum", "+local momentum"; qgm is D-PSGD's "+quasi-global mom." line).
# The paper tunes on a grid of powers of two and prints three decimals: its "0.013" for D² with
# momentum at alpha .01 is 0.1 / 8 = 0.0125 (0.013 is on no power-of-two grid from 0.1 or 0.2).
CIFAR10_TUNED_LR: dict[tuple[str, bool], dict[float, float]] = {
    ("allreduce", False): {1.0: 0.1, 0.1: 0.1, 0.01: 0.1},
    ("allreduce", True): {1.0: 0.1, 0.1: 0.1, 0.01: 0.1},
    ("relay", False): {1.0: 1.2, 0.1: 0.6, 0.01: 0.3},
    ("relay", True): {1.0: 0.6, 0.1: 0.3, 0.01: 0.15},
    ("dpsgd", False): {1.0: 0.4, 0.1: 0.1, 0.01: 0.2},
    ("qgm", True): {1.0: 0.1, 0.1: 0.025, 0.01: 0.05},
    ("d2", False): {1.0: 0.2, 0.1: 0.2, 0.01: 0.1},
    ("d2", True): {1.0: 0.05, 0.1: 0.05, 0.01: 0.0125},
    ("sgp", False): {1.0: 0.4, 0.1: 0.2, 0.01: 0.2},
    ("sgp", True): {1.0: 0.1, 0.1: 0.1, 0.01: 0.025},
}

# Appendix "Detailed experimental setup", Cifar-10/VGG-11 table: 200 epochs, 32 samples per
# worker, Nesterov momentum 0.9, weight decay 1e-4, lr /10 at epochs 150 and 180, linear warm-up
# over 5 epochs from 0; metric: worst worker. The trainer's default lr (lr_by_algo) is the
# alpha = 0.01 column of the paper's table with momentum; the table has no momentum row for plain
# D-PSGD, so dpsgd takes its SGD row (0.2). gt and relay-grad are not in the table and fall back
# to lr.
CIFAR10 = TaskDefaults(
    epochs=200,
    batch_size=32,
    lr=0.1,
    lr_by_algo=lr_column(CIFAR10_TUNED_LR, alpha=0.01),
    tuned_lr=CIFAR10_TUNED_LR,
    optimizer="sgd",
    momentum=0.9,
    weight_decay=1e-4,
    milestones=(150, 180),
    warmup_epochs=5,
    warmup_from=0.0,
    eval_every_epochs=1.0,
    metric="worst",
)

# Paper appendix "ImageNet": 90 epochs, 32 per worker, Nesterov momentum 0.9, wd 1e-4, /10 at 30,
# 60, 80. lr = 0.1 * (32 * 16) / 256 = 0.2 (per worker, for 16 workers); warm-up "step-wise
# linearly within 5 epochs, starting from 0.1": 0.1 / 0.2 = 0.5 of the target lr.
IMAGENET = TaskDefaults(
    epochs=90,
    batch_size=32,
    lr=0.2,
    optimizer="sgd",
    momentum=0.9,
    weight_decay=1e-4,
    milestones=(30, 60, 80),
    warmup_epochs=5,
    warmup_from=0.5,
    metric="mean",
)

# The paper's tuned Adam learning rates at alpha 0.1, 16 workers: appendix table "Tuned learning
# rates used for AG News / DistilBERT" (tab:apx:bert-lr); (algo, with momentum) -> {alpha: lr}.
# The paper has no SGP row: sgp runs with the task's lr.
AGNEWS_TUNED_LR: dict[tuple[str, bool], dict[float, float]] = {
    ("allreduce", False): {0.1: 3e-5},
    ("relay", False): {0.1: 9e-4},
    ("dpsgd", False): {0.1: 1e-6},
    ("qgm", False): {0.1: 1e-6},
}

# Paper: Adam (0.9, 0.999, 1e-8), constant lr, no warm-up, no weight decay, 5 epochs, 32 per
# worker; learning rates tuned per algorithm (appendix table "Tuned learning rates ... AG News").
AGNEWS = TaskDefaults(
    epochs=5,
    batch_size=32,
    lr=3e-5,
    lr_by_algo=lr_column(AGNEWS_TUNED_LR, alpha=0.1),
    tuned_lr=AGNEWS_TUNED_LR,
    optimizer="adam",
    momentum=0.0,
    weight_decay=0.0,
    metric="mean",
)

# task name -> its defaults, in the TASKS registry's order
TASK_DEFAULTS: dict[str, TaskDefaults] = {
    "quadratics": QUADRATICS,
    "digits": DIGITS,
    "cifar10": CIFAR10,
    "imagenet": IMAGENET,
    "agnews": AGNEWS,
}

# task name -> the topology an algorithm runs on for it where that differs from the algorithm's
# own default (a task without one is not listed)
DEFAULT_TOPOLOGY_BY_ALGO: dict[str, dict[str, str]] = {
    "agnews": {"relay": "chain"},  # the paper: "restricted to a ring (chain for RelaySGD)"
}


def default_topology_for(task: str, algo: str) -> str | None:
    """The topology ``task`` runs ``algo`` on when it differs from the algorithm's own default.

    Args:
        task: a task name.
        algo: an algorithm name.

    Returns:
        The topology's name, or None where the algorithm's default applies.
    """
    return DEFAULT_TOPOLOGY_BY_ALGO.get(task, {}).get(algo)
