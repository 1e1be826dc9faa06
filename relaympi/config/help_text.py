"""The parts of the flags' texts and choices that come from elsewhere: each task's and algorithm's
defaults and names, read when --help or the flag table is shown (so config imports no task). All of
it is torch-free: the tasks' defaults (relaympi.tasks.defaults) and the algorithms' registry lines,
never their classes, so `--help` starts without torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from relaympi.topology import TOPOLOGY_NAMES
from relaympi.topology.graphs import SOCIAL_NETWORK_SIZE


def _number(value: Any) -> str:
    return f"{value:g}"


def task_default(
    attribute: str, show: Callable[[Any], str] = _number, skip: tuple[str, ...] = ()
) -> str:
    """'task default: digits 8, cifar10 32, ...': a TaskDefaults value per task."""
    return "task default: " + per_task(attribute, show, skip)


def per_task(
    attribute: str, show: Callable[[Any], str] = _number, skip: tuple[str, ...] = ()
) -> str:
    """'digits 8, cifar10 32, ...': a TaskDefaults value per task."""
    from relaympi.tasks.defaults import TASK_DEFAULTS

    return ", ".join(
        f"{task} {show(getattr(defaults, attribute))}"
        for task, defaults in TASK_DEFAULTS.items()
        if task not in skip
    )


def _eval_default(defaults: Any) -> str:
    if defaults.evals_per_run:
        return f"{defaults.evals_per_run} evaluations per run"
    every = defaults.eval_every_epochs
    return "every epoch" if every == 1 else f"every {every:g} epochs"


def topology() -> str:
    from relaympi.algorithms import ALGORITHM_NAMES, default_topology
    from relaympi.tasks.defaults import DEFAULT_TOPOLOGY_BY_ALGO

    by_topology: dict[str, list[str]] = {}
    for algo in ALGORITHM_NAMES:
        by_topology.setdefault(default_topology(algo), []).append(algo)
    defaults = ", ".join(f"{'/'.join(algos)} {name}" for name, algos in by_topology.items())
    tasks = ""
    for task, own in DEFAULT_TOPOLOGY_BY_ALGO.items():  # a task's own topology for an algorithm
        tasks += f"; task {task}: " + ", ".join(f"{a} {t}" for a, t in own.items())
    return (
        f"communication graph: {', '.join(TOPOLOGY_NAMES)} (exponential and "
        "one-peer-exponential for n a power of two, alternating-ring for n even, "
        f"social-network and social-network-tree for exactly {SOCIAL_NETWORK_SIZE} workers), "
        "`spanning-tree:<name>` (the Spanning Tree Protocol tree of a graph) or "
        f"`edge-list:<file>` (a pair `i j` per line). Default per algorithm: {defaults}{tasks}"
    )


def momentum() -> str:
    from relaympi.algorithms import DECLARED

    needing = "/".join(name for name, declared in DECLARED.items() if declared.needs_momentum)
    return (
        "local momentum, the paper's Nesterov form unless `--no-nesterov`; "
        f"{task_default('momentum')} (`--algo {needing}`: 0.9 where that is 0)"
    )


def eval_every() -> str:
    from relaympi.tasks.defaults import TASK_DEFAULTS

    return (
        "steps K between evaluations, at steps 0, K, 2K, ... and always at the last step (a "
        "resumed run too), and between checkpoints (with `--checkpoint-dir`: at K, 2K, ... "
        "before the last step); task default: "
        + ", ".join(f"{task} {_eval_default(d)}" for task, d in TASK_DEFAULTS.items())
    )


def task_names() -> Sequence[str]:
    from relaympi.tasks import TASK_NAMES

    return TASK_NAMES


def algorithm_names() -> Sequence[str]:
    from relaympi.algorithms import ALGORITHM_NAMES

    return ALGORITHM_NAMES


def optimizer_names() -> Sequence[str]:
    from relaympi.optim_config import OPTIMIZERS

    return OPTIMIZERS


def relay_modes() -> Sequence[str]:
    from relaympi.algorithms import RELAY_MODES

    return RELAY_MODES
