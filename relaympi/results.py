"""The HDF5 run file: its schema, the writer used by training and the reader used by reports."""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np

SCHEMA_VERSION = 1
STATUSES = ("running", "completed", "diverged", "failed", "preempted")
TERMINAL_STATUSES = ("completed", "diverged", "failed", "preempted")
FINISHED_STATUSES = ("completed", "diverged")  # results that must not be overwritten by accident
RESUMABLE_STATUSES = ("running", "preempted", "failed")

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_STR = h5py.string_dtype("utf-8")
_CHUNK_BYTES = 1 << 16  # target bytes per chunk for small rows
_MAX_CHUNK_ROWS = 1024
# Root attributes the writer owns; set_attrs() may not overwrite them.
_RESERVED_ATTRS = ("schema_version", "config", "provenance", "status", "world_size", "run_id")
# Terminal attributes cleared when a run is reopened for resume.
_TERMINAL_ATTRS = (
    "end_time",
    "error",
    "traceback",
    "diverged_step",
    "diverged_epoch",
    "stopped_step",
    "stopped_epoch",
    "checkpoint_saved",
)


class RunFileError(Exception):
    """A run file that cannot be read: not HDF5, empty, truncated, corrupt or of an unknown schema."""

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
    """Refusing to replace a run file that another process is writing (it holds HDF5's file lock)."""


def _locked_by_a_writer(path: Path) -> bool:
    """Whether a live writer holds HDF5's exclusive flock on ``path`` (probed without touching it).

    Must be asked before h5py.File(path, "w"): that truncates the file before it finds the lock.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a writer's LOCK_EX only
    except BlockingIOError:
        return True
    except OSError:  # no flock on this file system: nothing to conflict with
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def file_kind(path: str | os.PathLike) -> str:
    """What is at ``path``: "missing", "run" (a relaympi run file, of any schema version), "damaged"
    (empty, or HDF5 that cannot be opened: possibly a run file cut short) or "other" (any other file).

    A writer replaces "run" files (finished ones only when asked) and "damaged" ones only when asked;
    never "other" files (a problem file, a checkpoint, a text file, ...).
    """
    path = Path(path)
    if not path.exists():
        return "missing"
    if not path.is_file():
        return "other"
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
    except OSError:
        return "other"
    if not head:
        return "damaged"
    if head != _HDF5_SIGNATURE and not h5py.is_hdf5(path):
        return "other"
    try:
        with h5py.File(path, "r", locking=False) as file:
            return "run" if "schema_version" in file.attrs and "config" in file.attrs else "other"
    except OSError:
        return "damaged"


_SPACE_RESERVE_BYTES = 4 << 20
_METADATA_MARGIN_BYTES = 64 << 10  # what HDF5's metadata may grow by with one append


def _no_space(exc: BaseException) -> bool:
    """Whether an error (OSError, or HDF5's RuntimeError text) is 'no space left on device'."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "errno = 28," in text or "Disk quota exceeded" in text


class _SpaceReserve:
    """Disk space held for a run file's last words: an unlinked temporary file in its directory,
    allocated when the writer opens (at most half the free space) and released when a write finds
    the device full, so that the pending rows and the `failed` status still fit and the file stays
    readable. The space returns to the file system on release or when the process ends."""

    def __init__(self, directory: Path, nbytes: int = _SPACE_RESERVE_BYTES) -> None:
        self._file = None
        try:
            stat = os.statvfs(directory)
            size = min(nbytes, stat.f_bavail * stat.f_frsize // 2)
            if size < 4096:
                return
            handle = tempfile.TemporaryFile(dir=directory, prefix=".relaympi-reserve-")
        except OSError:
            return
        try:
            os.posix_fallocate(handle.fileno(), 0, size)
        except OSError:
            handle.close()
            return
        self._file = handle

    def release(self) -> bool:
        """Give the space back; False when there was none to give."""
        if self._file is None:
            return False
        self._file.close()
        self._file = None
        return True


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _json_default(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot store {type(value).__name__} in a run file's JSON attribute")


def _to_json(value: Mapping[str, Any], name: str) -> str:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    return json.dumps(dict(value), sort_keys=True, default=_json_default, allow_nan=True)


def _set_attr(attrs: h5py.AttributeManager, name: str, value: Any) -> None:
    """Store one attribute: str as variable-length UTF-8, numbers as scalars, sequences as arrays."""
    if isinstance(value, (str, os.PathLike)):
        attrs.create(name, os.fspath(value), dtype=_STR)
    elif isinstance(value, (bool, np.bool_)):
        attrs.create(name, np.bool_(value))
    elif isinstance(value, (int, np.integer)):
        attrs.create(name, np.int64(value))
    elif isinstance(value, (float, np.floating)):
        attrs.create(name, np.float64(value))
    elif isinstance(value, (list, tuple, np.ndarray)):
        array = np.asarray(value)
        if array.dtype.kind in "US" or (
            array.dtype == object and all(isinstance(v, str) for v in array.flat)
        ):
            attrs.create(name, [str(v) for v in array.flat], dtype=_STR)
        elif array.dtype.kind in "biuf":
            attrs.create(name, array.astype(np.int64 if array.dtype.kind in "biu" else np.float64))
        else:
            raise TypeError(f"attribute {name!r}: cannot store a sequence of {array.dtype}")
    elif value is None:
        raise TypeError(f"attribute {name!r}: cannot store None (omit the attribute instead)")
    else:
        raise TypeError(
            f"attribute {name!r}: cannot store {type(value).__name__} (use str, int, float, bool "
            "or a sequence of numbers or strings; JSON-encode anything else)"
        )


def _decode_attr(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OS":
            return [_decode_attr(v) for v in value.tolist()]
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _chunks(row_shape: tuple[int, ...], itemsize: int) -> tuple[int, ...] | bool:
    row_bytes = max(1, int(np.prod(row_shape, dtype=np.int64)) * itemsize)
    if row_bytes > 16 * _CHUNK_BYTES:
        return True  # let h5py split large rows (e.g. params [n, d]) into chunks
    rows = max(1, min(_MAX_CHUNK_ROWS, _CHUNK_BYTES // row_bytes))
    return (rows, *row_shape)


class RunWriter:
    """Writes one run file: one process (rank 0) appends one row per evaluation and flushes.

    The file is written in place, so a run killed at any point keeps every row it appended;
    see results/README.md for the schema.
    """

    def __init__(self, file: h5py.File, path: Path, reserve: _SpaceReserve | None = None) -> None:
        self._file = file
        self.path = path
        self._reserve = reserve or _SpaceReserve(Path(path).parent)
        self.world_size = int(file.attrs["world_size"])
        run_id = _decode_attr(file.attrs.get("run_id"))
        self.run_id: str | None = run_id if isinstance(run_id, str) else None  # None: a file from before run ids
        self._datasets: dict[str, h5py.Dataset] = _row_datasets(file)

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        *,
        config: Mapping[str, Any],
        provenance: Mapping[str, Any],
        world_size: int,
        overwrite: bool = False,
    ) -> RunWriter:
        """Start a new run file at ``path`` with status "running".

        An existing completed or diverged run, or a damaged file (empty, unreadable HDF5), is only
        replaced when ``overwrite`` is true; another run file (running, failed, preempted) is
        replaced; a file that is not a run file is never replaced (NotARunFileError). The file's
        ``run_id`` attribute names this run (a resumed run keeps it; checkpoints record it).
        """
        path = Path(path)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"directory for the run file does not exist: {path.parent}")
        if (
            isinstance(world_size, bool)
            or not isinstance(world_size, (int, np.integer))
            or world_size < 1
        ):
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        config_json = _to_json(config, "config")
        provenance_json = _to_json(provenance, "provenance")
        kind = file_kind(path)
        if kind == "other":
            raise NotARunFileError(f"{path} exists and is not a relaympi run file")
        if kind == "damaged" and not overwrite:
            raise NotARunFileError(f"{path} exists and cannot be read as a run file (empty or damaged HDF5)")
        if not overwrite:
            status = run_status(path)
            if status in FINISHED_STATUSES:
                raise RunExistsError(
                    f"{path} holds a {status} run; pass overwrite=True (--overwrite) to replace it"
                )
        if path.exists() and _locked_by_a_writer(path):
            raise RunInUseError(f"{path} is being written by another run")
        reserve = _SpaceReserve(path.parent)
        try:
            file = h5py.File(path, "w", locking="best-effort")
        except OSError as exc:
            reserve.release()
            if _no_space(exc):
                raise RunFileWriteError(f"cannot create the run file {path}: no space left on device") from None
            raise
        try:
            attrs = file.attrs
            attrs.create("schema_version", np.int64(SCHEMA_VERSION))
            attrs.create("config", config_json, dtype=_STR)
            attrs.create("provenance", provenance_json, dtype=_STR)
            attrs.create("status", "running", dtype=_STR)
            attrs.create("world_size", np.int64(world_size))
            attrs.create("run_id", uuid.uuid4().hex, dtype=_STR)
            attrs.create("start_time", _utc_now(), dtype=_STR)
            file.flush()
        except BaseException as exc:
            reserve.release()
            _close_quietly(file)
            if isinstance(exc, (OSError, RuntimeError)) and _no_space(exc):
                path.unlink(missing_ok=True)  # an empty or partial header: no run file is better than a corrupt one
                raise RunFileWriteError(f"cannot create the run file {path}: no space left on device") from None
            raise
        return cls(file, path, reserve)

    @classmethod
    def reopen(cls, path: str | os.PathLike, *, resume_step: int) -> RunWriter:
        """Reopen a running, preempted or failed run to resume it after step ``resume_step``.

        Rows with step > resume_step are dropped (they are recomputed after the resume), the
        status goes back to "running", and resume_step and the time are appended to the
        ``resumed_at_steps`` / ``resumed_at_times`` attributes.
        """
        path = Path(path)
        status = run_status(path)
        if status == "missing":
            raise FileNotFoundError(f"no run file to resume: {path}")
        if status == "corrupt":
            read_run(path)  # raises RunFileError with the reason
        if status not in RESUMABLE_STATUSES:
            raise RunExistsError(
                f"{path} holds a {status} run; only {RESUMABLE_STATUSES} runs resume"
            )
        file = h5py.File(path, "r+", locking="best-effort")
        try:
            _truncate_rows(file, int(resume_step))
            attrs = file.attrs
            for name in _TERMINAL_ATTRS:
                if name in attrs:
                    del attrs[name]
            steps = (
                list(_decode_attr(attrs["resumed_at_steps"])) if "resumed_at_steps" in attrs else []
            )
            times = (
                list(_decode_attr(attrs["resumed_at_times"])) if "resumed_at_times" in attrs else []
            )
            _set_attr(attrs, "resumed_at_steps", [*steps, int(resume_step)])
            _set_attr(attrs, "resumed_at_times", [*times, _utc_now()])
            _set_attr(attrs, "status", "running")
            file.flush()
        except BaseException:
            file.close()
            raise
        return cls(file, path)

    def append(self, row: Mapping[str, float | int | np.ndarray]) -> None:
        """Append one evaluation; the first row fixes the dataset names and per-row shapes."""
        self.extend({name: np.asarray(value)[np.newaxis] for name, value in row.items()})

    def extend(self, rows: Mapping[str, np.ndarray]) -> None:
        """Append k evaluations at once, given column-wise: every value has k on its first axis.

        Same rules as ``append`` (which calls this); one flush for all k rows. For importers
        and test factories; a training loop appends one row per evaluation.
        """
        if "step" not in rows:
            raise KeyError("every row needs a 'step'")
        values = {name: np.asarray(value) for name, value in rows.items()}
        counts = {value.shape[0] if value.ndim else -1 for value in values.values()}
        if len(counts) != 1 or -1 in counts:
            raise ValueError(
                f"every column needs the same number of rows on its first axis, got {counts}"
            )
        (count,) = counts
        if count == 0 and not self._datasets:
            return  # nothing to define the datasets from yet
        if self._datasets:
            unknown = sorted(set(values) - set(self._datasets))
            if unknown:
                raise KeyError(
                    f"row has keys {unknown} that earlier rows did not have; "
                    f"known keys: {sorted(self._datasets)}"
                )
        else:
            self._create_datasets({name: value[0] for name, value in values.items()})
        # Check every shape before growing anything, so a bad row leaves the file untouched.
        for name, value in values.items():
            row_shape = self._datasets[name].shape[1:]
            if value.shape[1:] != row_shape:
                raise ValueError(f"{name!r}: expecting shape {row_shape}, got {value.shape[1:]}")
        if count == 0:
            return
        def write() -> None:
            # Write "step" last: a row whose step was not written reads as incomplete.
            for name, dataset in sorted(self._datasets.items(), key=lambda item: item[0] == "step"):
                n = dataset.shape[0]
                dataset.resize(n + count, axis=0)
                if name in values:
                    dataset[n : n + count] = values[name]
                # missing keys keep the fill value (NaN)

        self._check_space(count)
        before = {name: dataset.shape[0] for name, dataset in self._datasets.items()}

        def undo() -> None:
            for name, dataset in self._datasets.items():
                dataset.resize(before[name], axis=0)

        self._write(write, "an evaluation", undo)

    def _create_datasets(self, values: Mapping[str, np.ndarray]) -> None:
        for name, value in values.items():
            if "/" in name or not name:
                raise ValueError(
                    f"dataset names must be non-empty and contain no '/', got {name!r}"
                )
            if name == "step":
                if value.shape != () or value.dtype.kind not in "iu":
                    raise ValueError(
                        f"'step' must be an integer scalar, got {value.dtype} {value.shape}"
                    )
                dtype, fill = np.int64, -1
            else:
                if value.dtype.kind not in "biuf":
                    raise TypeError(f"{name!r}: expecting numbers, got {value.dtype}")
                dtype, fill = np.float64, np.nan
            self._file.create_dataset(
                name,
                shape=(0, *value.shape),
                maxshape=(None, *value.shape),
                dtype=dtype,
                chunks=_chunks(value.shape, 8),
                fillvalue=fill,
            )
        self._datasets = _row_datasets(self._file)

    def set_status(self, status: str, **attrs: Any) -> None:
        """Set the run's status (and extra attributes); terminal statuses also record end_time."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        def write() -> None:
            self._set_attrs(attrs)
            _set_attr(self._file.attrs, "status", status)
            if status in TERMINAL_STATUSES:
                _set_attr(self._file.attrs, "end_time", _utc_now())

        self._write(write, f"status {status}")

    def set_topology(self, topology: RunTopology) -> None:
        """Record where the ranks are and the graph they ran on (the ``topology`` group; replaced if present)."""

        def write() -> None:
            if TOPOLOGY_GROUP in self._file:
                del self._file[TOPOLOGY_GROUP]
            group = self._file.create_group(TOPOLOGY_GROUP)
            group.attrs.create("name", topology.name, dtype=_STR)
            group.attrs.create("placement", topology.placement, dtype=_STR)
            group.attrs.create("nodes_emulated", bool(topology.nodes_emulated))
            group.attrs.create("inter_node_edges", np.asarray(topology.inter_node_edges, dtype=np.int64))
            group.create_dataset("rank_node", data=np.asarray(topology.rank_node, dtype=np.int64))
            for layer, edges in enumerate(topology.edges):
                group.create_dataset(f"edges_{layer}", data=np.asarray(edges, dtype=np.int64).reshape(-1, 2))

        self._write(write, "the topology")

    def set_attrs(self, **attrs: Any) -> None:
        """Set extra root attributes (str, int, float, bool, or sequences of numbers/strings)."""
        self._write(lambda: self._set_attrs(attrs), "attributes")

    def _set_attrs(self, attrs: Mapping[str, Any]) -> None:
        reserved = sorted(set(attrs) & set(_RESERVED_ATTRS))
        if reserved:
            raise ValueError(f"attributes {reserved} are owned by the writer")
        for name, value in attrs.items():
            _set_attr(self._file.attrs, name, value)

    def _check_space(self, count: int) -> None:
        """Refuse (RunFileWriteError, file untouched) ``count`` new rows whose new chunks would not
        fit on the device: HDF5 cannot take back a write that ran out of space half-way."""
        needed = _METADATA_MARGIN_BYTES
        for dataset in self._datasets.values():
            rows, chunk = dataset.chunks[0], int(np.prod(dataset.chunks, dtype=np.int64)) * dataset.dtype.itemsize
            n = dataset.shape[0]
            needed += (-(-(n + count) // rows) - -(-n // rows)) * chunk
        try:
            stat = os.statvfs(self.path.parent)
        except OSError:
            return
        if stat.f_bavail * stat.f_frsize < needed:
            self._reserve.release()  # room for the status that records the failure
            raise RunFileWriteError(f"no space left on device for the next evaluation in the run file {self.path} "
                                    f"(needs about {needed // 1024} KiB, {stat.f_bavail * stat.f_frsize // 1024} KiB free)")

    def _write(self, action: Any, what: str, undo: Any = None) -> None:
        """Do ``action`` and flush. When the device is full, release the space reserve and flush
        again (if that fails too, ``undo`` the action and flush), so the file stays readable with
        the rows and attributes written before; then raise RunFileWriteError: the run cannot go on."""
        try:
            action()
            self._file.flush()
        except (OSError, RuntimeError) as exc:
            if not _no_space(exc):
                raise
            kept = self._reserve.release()
            for attempt in (None, undo) if kept else ():
                try:
                    if attempt is not None:
                        attempt()  # the new row does not fit: drop it, keep the file as it was
                    self._file.flush()
                    break
                except (OSError, RuntimeError):
                    pass
            else:
                kept = False
            detail = "" if kept else " (not even the space held in reserve let it finish; the file may be unreadable)"
            raise RunFileWriteError(f"no space left on device writing {what} to the run file {self.path}{detail}") from None

    @property
    def num_rows(self) -> int:
        return int(self._file["step"].shape[0]) if "step" in self._file else 0

    def close(self) -> None:
        if self._file.id.valid:
            try:
                self._file.close()
            except (OSError, RuntimeError) as exc:
                if not _no_space(exc):
                    raise
                UNCLOSABLE.append(self._file)  # HDF5 crashes freeing it: see unclosable_files()
                raise RunFileWriteError(f"no space left on device closing the run file {self.path}") from None
            finally:
                self._reserve.release()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Run files HDF5 could not close (the device was full): freeing them at interpreter exit crashes
# HDF5, so a program that finds any here ends with os._exit after flushing its output.
UNCLOSABLE: list[h5py.File] = []


def _close_quietly(file: h5py.File) -> None:
    try:
        file.close()
    except (OSError, RuntimeError):
        pass


def _row_datasets(file: h5py.File) -> dict[str, h5py.Dataset]:
    return {name: obj for name, obj in file.items() if isinstance(obj, h5py.Dataset)}


def _complete_rows(datasets: Mapping[str, h5py.Dataset]) -> int:
    """Rows present in every dataset (a run killed mid-append may leave one partial row)."""
    if not datasets:
        return 0
    n = min(int(ds.shape[0]) for ds in datasets.values())
    if "step" in datasets and n > 0 and int(datasets["step"][n - 1]) < 0:
        n -= 1  # step is written last: a fill value means the row never completed
    return n


def _truncate_rows(file: h5py.File, resume_step: int) -> None:
    datasets = _row_datasets(file)
    if not datasets:
        return
    if "step" not in datasets:
        raise RunFileError(file.filename, "datasets without a 'step' dataset")
    n = _complete_rows(datasets)
    steps = datasets["step"][:n]
    keep = (steps <= resume_step) & (steps >= 0)
    if keep.all():
        for ds in datasets.values():
            ds.resize(n, axis=0)
        return
    if keep[: int(keep.sum())].all():  # the usual case: steps increase, cut the tail
        for ds in datasets.values():
            ds.resize(int(keep.sum()), axis=0)
        return
    for ds in datasets.values():  # steps out of order: keep the matching rows in their order
        kept = ds[:n][keep]
        ds.resize(len(kept), axis=0)
        ds[...] = kept


TOPOLOGY_GROUP = "topology"  # where the ranks were and the graph they ran on (not a per-evaluation dataset)


@dataclass(frozen=True)
class RunTopology:
    """The ``topology`` group: each rank's node and the edges every layer (tree or graph) realized."""

    name: str
    placement: str  # "ranks" or "nodes", as the run resolved --placement
    rank_node: np.ndarray  # [world_size] int64: rank r ran on node rank_node[r] (0, 1, ... by lowest rank)
    nodes_emulated: bool  # the nodes came from --ranks-per-node, not from where MPI placed the ranks
    edges: tuple[np.ndarray, ...]  # per layer: [m, 2] int64 edges (i < j), sorted
    inter_node_edges: tuple[int, ...]  # per layer: edges whose ends are on different nodes

    @property
    def num_nodes(self) -> int:
        return len(set(self.rank_node.tolist()))


def _read_topology(file: h5py.File) -> RunTopology | None:
    if TOPOLOGY_GROUP not in file:
        return None  # a run file from before the topology was recorded
    group = file[TOPOLOGY_GROUP]
    attrs = {name: _decode_attr(group.attrs[name]) for name in group.attrs}
    layers = sorted((int(k.split("_", 1)[1]), k) for k in group if k.startswith("edges_"))
    inter = attrs.get("inter_node_edges", ())
    return RunTopology(
        name=str(attrs.get("name", "")),
        placement=str(attrs.get("placement", "")),
        rank_node=np.asarray(group["rank_node"][...], dtype=np.int64),
        nodes_emulated=bool(attrs.get("nodes_emulated", False)),
        edges=tuple(np.asarray(group[k][...], dtype=np.int64) for _, k in layers),
        inter_node_edges=tuple(int(v) for v in np.atleast_1d(inter)),
    )


@dataclass
class Run:
    """One run file, read: config, provenance, status, other root attributes and datasets."""

    path: Path
    schema_version: int
    status: str
    config: dict[str, Any]
    provenance: dict[str, Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    data: dict[str, np.ndarray] = field(default_factory=dict)
    topology: RunTopology | None = None  # None: a file from before the topology was recorded

    def metric(self, name: str) -> np.ndarray:
        try:
            return self.data[name]
        except KeyError:
            raise KeyError(
                f"{self.path} has no dataset {name!r}; it has {sorted(self.data)}"
            ) from None

    @property
    def world_size(self) -> int:
        return int(self.attrs["world_size"])

    @property
    def num_rows(self) -> int:
        return len(self.data["step"]) if "step" in self.data else 0


def _precheck(path: Path) -> None:
    """Give the common failures a clear reason before HDF5 gives an obscure one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
    except FileNotFoundError:
        raise RunFileError(path, "no such file") from None
    except IsADirectoryError:
        raise RunFileError(path, "is a directory") from None
    except OSError as error:
        raise RunFileError(path, f"cannot read: {error.strerror or error}") from None
    if size == 0:
        raise RunFileError(path, "empty file (0 bytes)")
    if head != _HDF5_SIGNATURE and not h5py.is_hdf5(path):
        raise RunFileError(path, f"not an HDF5 file ({size} bytes, no HDF5 signature)")


def _open_for_reading(path: Path) -> h5py.File:
    _precheck(path)
    try:
        try:
            # locking=False: a live writer holds a lock, and readers must still see its flushed rows.
            return h5py.File(path, "r", locking=False)
        except OSError as error:
            if "locking flag" not in str(error):
                raise
            # This very process has the file open for writing: HDF5 shares that handle.
            return h5py.File(path, "r", locking="best-effort")
    except OSError as error:
        message = str(error)
        if "truncated" in message:
            raise RunFileError(path, f"truncated HDF5 file ({message})") from None
        raise RunFileError(path, f"unreadable HDF5 file ({message})") from None


def _read_header(path: Path, file: h5py.File) -> tuple[int, str, dict[str, Any]]:
    attrs = {name: _decode_attr(file.attrs[name]) for name in file.attrs}
    if "schema_version" not in attrs:
        raise RunFileError(path, "not a relaympi run file: no 'schema_version' attribute")
    version = attrs.pop("schema_version")
    if not isinstance(version, int) or version != SCHEMA_VERSION:
        raise RunFileError(
            path,
            f"unknown schema_version {version!r} (this relaympi reads version {SCHEMA_VERSION})",
        )
    for name in ("status", "config", "provenance", "world_size"):
        if name not in attrs:
            raise RunFileError(path, f"missing attribute {name!r}")
    status = attrs.pop("status")
    if status not in STATUSES:
        raise RunFileError(path, f"unknown status {status!r}")
    return version, status, attrs


def _parse_json(path: Path, attrs: dict[str, Any], name: str) -> dict[str, Any]:
    raw = attrs.pop(name)
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as error:
        raise RunFileError(path, f"attribute {name!r} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise RunFileError(path, f"attribute {name!r} is not a JSON object")
    return value


# A worker "ends at chance" when its accuracy is below this many times 1/num_classes (10% for
# ten classes): it learned nothing, often because the default lr does not suit the run.
CHANCE_FACTOR = 1.5


def workers_at_chance(accuracy: np.ndarray, num_classes: int | None) -> list[int]:
    """The workers whose accuracy (one value per worker) is at chance level for num_classes."""
    if not num_classes or num_classes < 2:
        return []
    values = np.asarray(accuracy, dtype=float).reshape(-1)
    return [int(w) for w in np.flatnonzero(values < CHANCE_FACTOR / num_classes)]


# A run is "unstable" when its loss ends far above where it started (UNSTABLE_RULE). A run that
# learns ends well below its first recorded train loss (digits: about 2 after the first interval,
# 0.1-0.5 at the end), and the loss of one interval moves by tens of percent at most; one that ends
# above twice its start made every model worse than where training began: its optimization is
# unstable (D² under message loss: 2 -> 78), and its final numbers follow the float rounding of
# the engine that ran it, not the algorithm. 1x would also flag runs that merely learn nothing
# (the at-chance flag is for those); a looser factor would miss runs that blow up slowly.
UNSTABLE_FACTOR = 2.0
UNSTABLE_RULE = f"final mean train loss > {UNSTABLE_FACTOR:g}x the first recorded"


def unstable_loss(train_loss: np.ndarray) -> tuple[float, float] | None:
    """(first, final) mean train loss over workers when the run is unstable (UNSTABLE_RULE), else None.

    ``train_loss`` is a run file's [evals, workers] dataset. The first recorded value is the first
    evaluation whose mean is finite (a classification run records NaN at step 0, before any step);
    the final one is the last evaluation's. A non-finite final loss is not judged: such a run has
    status diverged.
    """
    values = np.asarray(train_loss, dtype=float)
    if values.ndim == 0 or len(values) < 2:
        return None
    means = values.reshape(len(values), -1).mean(axis=1)
    finite = np.flatnonzero(np.isfinite(means))
    if len(finite) < 2 or finite[-1] != len(means) - 1:
        return None
    first, final = float(means[finite[0]]), float(means[-1])
    return (first, final) if first > 0 and final > UNSTABLE_FACTOR * first else None


def unstable_text(loss: tuple[float, float]) -> str:
    """How the end summary, `python -m relaympi.results show` and the report flag an unstable run."""
    first, final = loss
    return (
        f"unstable: final mean train loss {final:.4g} > {UNSTABLE_FACTOR:g}x the first recorded {first:.4g} "
        "(its numbers depend on the engine's float rounding; try a lower --lr)"
    )


def read_run(path: str | os.PathLike, *, datasets: Iterable[str] | None = None) -> Run:
    """Read a run file; ``datasets`` limits which datasets are loaded (default: all).

    Raises RunFileError, with the reason, for a missing, empty, non-HDF5, truncated or
    corrupt file, missing attributes or an unknown schema_version.
    """
    path = Path(path)
    file = _open_for_reading(path)
    try:
        version, status, attrs = _read_header(path, file)
        config = _parse_json(path, attrs, "config")
        provenance = _parse_json(path, attrs, "provenance")
        available = _row_datasets(file)
        if available and "step" not in available:
            raise RunFileError(path, f"datasets {sorted(available)} without a 'step' dataset")
        n = _complete_rows(available)
        wanted = (
            available if datasets is None else {k: available[k] for k in datasets if k in available}
        )
        data = {name: ds[:n] for name, ds in wanted.items()}
        topology = _read_topology(file)
    except RunFileError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as error:
        raise RunFileError(path, f"corrupt run file ({type(error).__name__}: {error})") from None
    finally:
        file.close()
    return Run(path, version, status, config, provenance, attrs, data, topology)


def run_status(path: str | os.PathLike) -> str:
    """ "missing", "corrupt" (unreadable, or not a version-1 run file) or the run's status; reads attrs only."""
    path = Path(path)
    if not path.exists():
        return "missing"
    try:
        file = _open_for_reading(path)
    except RunFileError:
        return "corrupt"
    try:
        version = _decode_attr(file.attrs.get("schema_version"))
        status = _decode_attr(file.attrs.get("status"))
    except (OSError, KeyError, ValueError, TypeError, RuntimeError):
        return "corrupt"
    finally:
        file.close()
    if version != SCHEMA_VERSION or status not in STATUSES:
        return "corrupt"
    return status


OWN_TARGET_FRACTION = 0.95  # show's default target: this fraction of the run's own final worst-worker accuracy


def cost_lines(run: Run, target: float | None = None) -> list[str]:
    """`show`'s cost summary of a run: median per-step costs and the time to a target accuracy
    (``target``, else OWN_TARGET_FRACTION of the run's own final worst-worker accuracy: the
    lowest worker test accuracy at its last evaluation)."""
    from relaympi import costs

    lines = []
    per_step = costs.step_costs(run.data)
    if per_step is not None:
        parts = [f"step {costs.median([per_step.step_ms]):.3g} ms"]
        parts += [f"{name[:-3]} {costs.median([v]):.3g} ms" for name, v in per_step.timers_ms.items()]
        if per_step.bytes_per_step is not None:
            parts.append(f"bytes/step {np.mean(per_step.bytes_per_step):.4g} (max worker {np.max(per_step.bytes_per_step):.4g})")
        lines.append(f"cost per step (median over {per_step.intervals} evaluation interval(s) and workers): " + ", ".join(parts))
    if "test_accuracy" not in run.data or "time_s" not in run.data:
        return lines
    accuracy = run.data["test_accuracy"]
    if target is None:
        target = costs.own_target(accuracy, OWN_TARGET_FRACTION)
        if target is None:
            return lines
        what = f"time to {100 * OWN_TARGET_FRACTION:g}% of its own final worst-worker accuracy ({100 * target:.2f}%)"
    else:
        what = f"time to worst-worker test accuracy >= {100 * target:.2f}%"
    seconds = costs.time_to_accuracy(run.data["time_s"], accuracy, target)
    lines.append(f"{what}: " + ("never reached" if seconds is None else f"{seconds:.3g} s"))
    return lines


def topology_lines(topology: RunTopology | None) -> list[str]:
    """`show`'s lines on the topology group: placement, nodes, and per layer its edges."""
    if topology is None:
        return ["placement: ranks (not recorded: a run file from before --placement, which ran in rank order)"]
    where = "emulated by --ranks-per-node" if topology.nodes_emulated else "as the ranks were placed"
    lines = [
        f"placement: {topology.placement}",
        "topology:",
        f"  name: {topology.name}",
        f"  nodes: {topology.num_nodes} ({where})",
        f"  rank_node: {json.dumps(topology.rank_node.tolist())}",
    ]
    for layer, edges in enumerate(topology.edges):
        inter = topology.inter_node_edges[layer] if layer < len(topology.inter_node_edges) else "?"
        lines.append(f"  layer {layer}: {len(edges)} edges, {inter} between nodes")
    return lines


def _show(path: Path, target: float | None = None) -> int:
    try:
        run = read_run(path)
    except RunFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"path: {run.path}")
    print(f"schema_version: {run.schema_version}")
    print(f"status: {run.status}")
    unstable = unstable_loss(run.data["train_loss"]) if "train_loss" in run.data else None
    if unstable:
        print(f"warning: {unstable_text(unstable)}")
    for name, value in sorted(run.attrs.items()):
        print(f"{name}: {value}")
    print("config:")
    for name, value in sorted(run.config.items()):
        print(f"  {name}: {json.dumps(value)}")
    print("provenance:")
    for name, value in sorted(run.provenance.items()):
        print(f"  {name}: {json.dumps(value)}")
    for line in topology_lines(run.topology):
        print(line)
    print(f"datasets ({run.num_rows} rows):")
    for name, value in sorted(run.data.items()):
        last = value[-1] if len(value) else None
        summary = (
            ""
            if last is None or value.ndim > 2
            else f"  last={np.array2string(np.asarray(last), precision=4, threshold=8)}"
        )
        print(f"  {name}: {value.dtype} {list(value.shape)}{summary}")
    for line in cost_lines(run, target):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relaympi.results", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser(
        "status", help="print each file's status (missing, corrupt or the run's)"
    )
    status.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    show = commands.add_parser(
        "show", help="print a run file's config, provenance, status and datasets"
    )
    show.add_argument("path", type=Path, metavar="PATH")
    show.add_argument(
        "--target-accuracy",
        type=float,
        metavar="ACC",
        help="print the wall time until the worst worker's test accuracy first reaches ACC (in (0, 1]); "
        f"default: {100 * OWN_TARGET_FRACTION:g}%% of the run's own final worst-worker accuracy",
    )
    args = parser.parse_args(argv)
    if args.command == "show" and args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        show.error(f"--target-accuracy must be in (0, 1], got {args.target_accuracy:g}")
    if args.command == "status":
        for path in args.paths:
            print(run_status(path) if len(args.paths) == 1 else f"{run_status(path)}\t{path}")
        return 0
    return _show(args.path, args.target_accuracy)


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(main)
