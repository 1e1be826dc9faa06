"""Per-rank checkpoints: written atomically (nothing partial is ever left), loaded safely
(torch.load with weights_only=True)."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for this run."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (no space left, an I/O error); nothing partial is left."""


def _write_atomically(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` through a temporary file and a rename: ``target`` is either its
    old self or complete, and a failed write leaves no temporary file behind.

    The temporary file is created exclusively in ``target``'s folder under a name nobody can
    guess (mkstemp: O_CREAT | O_EXCL, mode 0600), so in a folder others can write to, no
    symbolic link planted there beforehand is followed; the rename replaces ``target`` itself,
    never what a link there points to. The checkpoint keeps mode 0600: a run's state is its
    owner's."""
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise CheckpointWriteError(
            f"cannot write the checkpoint {target}: {exc.strerror or exc}"
        ) from None
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(
            f"cannot write the checkpoint {target}: {exc.strerror or exc}"
        ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# A checkpoint of step s is rank{r}.step{s}.pt on every rank plus meta.json naming s, written
# by rank 0 only after every rank saved: a run killed mid-checkpoint resumes from the previous
# complete one, never from a mix of steps.


def _path(directory: Path, rank: int, step: int) -> Path:
    return Path(directory) / f"rank{rank:05d}.step{step:010d}.pt"


def save(directory: Path, rank: int, step: int, state: dict[str, Any]) -> None:
    """Write rank's state for ``step`` (atomic rename; older files stay until prune())."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # serialized in memory first: a full disk fails a plain write, with its errno
    buffer = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "step": step, **state}, buffer)
    _write_atomically(_path(directory, rank, step), buffer.getbuffer().tobytes())


def prune(directory: Path, rank: int, keep_step: int) -> None:
    """Delete this rank's checkpoints of other steps (call once meta.json names keep_step), and
    the temporary files a killed write of this rank left."""
    for path in Path(directory).glob(f"rank{rank:05d}.step*.pt"):
        if path != _path(Path(directory), rank, keep_step):
            path.unlink(missing_ok=True)
    for path in Path(directory).glob(f".rank{rank:05d}.step*.pt.*.tmp"):
        path.unlink(missing_ok=True)


def load(directory: Path, rank: int, step: int) -> dict[str, Any]:
    """This rank's checkpoint of ``step`` (the step meta.json names)."""
    path = _path(Path(directory), rank, step)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint directory {directory} names step {step} but {path.name} is missing"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same error to the user
        raise CheckpointError(f"checkpoint {path} cannot be loaded safely: {exc}") from exc
    if state.get("format_version") != FORMAT_VERSION or state.get("step") != step:
        raise CheckpointError(
            f"checkpoint {path} has format {state.get('format_version')}, expected {FORMAT_VERSION}"
        )
    return state


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomically(directory / "meta.json", json.dumps(meta, indent=1, sort_keys=True).encode())


def read_meta(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / "meta.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def forget(directory: Path) -> None:
    """Invalidate the checkpoint (its files are pruned by the next save)."""
    (Path(directory) / "meta.json").unlink(missing_ok=True)
