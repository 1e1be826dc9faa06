"""Training workloads: a registry from task name to Task class (imported lazily)."""

from __future__ import annotations

import importlib

from relaympi.tasks.base import ClassificationTask, Task, TaskDefaults, TaskError, TaskOptions

# name -> "module:Class"; modules are imported only when their task is used, so the
# light tasks never pay for heavy imports (transformers, PIL decoding pools, ...).
_REGISTRY = {
    "quadratics": "relaympi.tasks.quadratics:QuadraticsTask",
    "digits": "relaympi.tasks.digits:DigitsTask",
    "cifar10": "relaympi.tasks.cifar10:Cifar10Task",
    "imagenet": "relaympi.tasks.imagenet:ImageNetTask",
    "agnews": "relaympi.tasks.agnews:AgNewsTask",
}

TASK_NAMES = tuple(_REGISTRY)


def get_task_class(name: str) -> type[Task]:
    """The Task class registered under ``name``."""
    if name not in _REGISTRY:
        raise TaskError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
    module_name, _, class_name = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["TASK_NAMES", "ClassificationTask", "Task", "TaskDefaults", "TaskError", "TaskOptions", "get_task_class"]
