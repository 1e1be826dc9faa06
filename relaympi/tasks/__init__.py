"""Training workloads: a registry from task name to Task class (imported lazily)."""

from __future__ import annotations

from relaympi.registry import Registry
from relaympi.tasks.base import ClassificationTask, Task, TaskDefaults, TaskError, TaskOptions

# name -> its class, imported only when its task is used, so the light tasks never pay for
# heavy imports (transformers, PIL decoding pools, ...).
TASKS: Registry[type[Task]] = Registry(
    "task",
    {
        "quadratics": "relaympi.tasks.quadratics:QuadraticsTask",
        "digits": "relaympi.tasks.digits:DigitsTask",
        "cifar10": "relaympi.tasks.cifar10:Cifar10Task",
        "imagenet": "relaympi.tasks.imagenet:ImageNetTask",
        "agnews": "relaympi.tasks.agnews:AgNewsTask",
    },
    error=TaskError,
)

TASK_NAMES = TASKS.names


def get_task_class(name: str) -> type[Task]:
    """The Task class registered under ``name``."""
    return TASKS[name]


__all__ = [
    "TASKS",
    "TASK_NAMES",
    "ClassificationTask",
    "Task",
    "TaskDefaults",
    "TaskError",
    "TaskOptions",
    "get_task_class",
]
