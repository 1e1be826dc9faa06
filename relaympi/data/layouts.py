"""Whether a folder holds what a task reads, asked of the task modules themselves (imported
lazily)."""

from __future__ import annotations

import os
from pathlib import Path


def cifar10_problem(directory: Path) -> str:
    """'' if the CIFAR-10 loader finds a complete copy in ``directory``; else what is missing."""
    # the task modules are imported where asked: they import torch (and relaympi.data), which
    # `python -m relaympi.data check` must not pay for
    from relaympi.tasks.cifar10 import (
        BINARY_DIR,
        BINARY_TEST,
        BINARY_TRAIN,
        PYTHON_DIR,
        PYTHON_TEST,
        PYTHON_TRAIN,
    )

    for folder, names in (
        (directory / BINARY_DIR, (*BINARY_TRAIN, BINARY_TEST)),
        (directory, (*BINARY_TRAIN, BINARY_TEST)),
        (directory / PYTHON_DIR, (*PYTHON_TRAIN, PYTHON_TEST)),
        (directory, (*PYTHON_TRAIN, PYTHON_TEST)),
    ):
        if all((folder / name).is_file() for name in names):
            return ""
    return f"no complete CIFAR-10 copy ({BINARY_DIR}/data_batch_1..5.bin and test_batch.bin)"


def model_dir_problem(directory: Path) -> str:
    """'' if ``directory`` is a model folder the agnews task loads; else what is missing."""
    from relaympi.tasks.agnews import model_dir_missing

    missing = model_dir_missing(directory)
    return f"missing {', '.join(missing)}" if missing else ""


def is_image(name: str) -> bool:
    """An image file as the imagenet task reads it (by extension)."""
    from relaympi.tasks.imagenet import IMAGE_EXTENSIONS

    return name.lower().endswith(IMAGE_EXTENSIONS)


def count_images(split_dir: Path) -> int:
    """Images in the class folders of ``split_dir`` (0 if it does not exist)."""
    if not split_dir.is_dir():
        return 0
    total = 0
    for entry in os.scandir(split_dir):
        if entry.is_dir():
            total += sum(1 for f in os.scandir(entry.path) if f.is_file() and is_image(f.name))
    return total
