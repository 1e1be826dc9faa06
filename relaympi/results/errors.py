"""What goes wrong with a run file: one that cannot be read, and the writer's refusals."""

from __future__ import annotations

import os
from pathlib import Path


class RunFileError(Exception):
    """A run file that cannot be read: not HDF5, empty, truncated, corrupt or of an unknown
    schema.

    Args:
        path: the run file.
        reason: what is wrong with it, in words.

    Attributes:
        path: the run file, as a Path.
        reason: what is wrong with it; the message is "<path>: <reason>".
    """

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


class RunExistsError(FileExistsError):
    """Refusing to overwrite (or resume) a run that already finished (completed or diverged)."""


class NotARunFileError(FileExistsError):
    """Refusing to replace a file that is not a relaympi run file (``overwrite`` or not)."""


class RunFileWriteError(OSError):
    """The run file could not be written (no space left on the device, an I/O error): one line."""


class RunInUseError(BlockingIOError):
    """Refusing to replace a run file that another process is writing (it holds HDF5's file
    lock)."""
