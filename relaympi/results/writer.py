"""Writing a run file: one process (rank 0) creates or reopens it and appends a row per
evaluation."""

# Long module: every write of a run file (create, resume, append, close) in one place

from __future__ import annotations

import fcntl
import json
import os
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from relaympi.results.errors import (
    NotARunFileError,
    RunExistsError,
    RunFileError,
    RunFileWriteError,
    RunInUseError,
)
from relaympi.results.membership import MEMBERSHIP_ATTR, check_record, parse_membership
from relaympi.results.reader import file_kind, read_run, run_status
from relaympi.results.schema import (
    FINISHED_STATUSES,
    LATE_DROP_COLUMNS,
    LATE_DROPS_GROUP,
    RESUMABLE_STATUSES,
    SCHEMA_VERSION,
    SKIPPED_COLUMNS,
    SKIPPED_DATASET,
    STATUSES,
    STRING_DTYPE,
    TERMINAL_STATUSES,
    TOPOLOGY_GROUP,
    RunTopology,
    complete_rows,
    decode_attr,
    row_datasets,
)
from relaympi.results.space import SpaceReserve, no_space

_CHUNK_BYTES = 1 << 16  # target bytes per chunk for small rows
_MAX_CHUNK_ROWS = 1024
_METADATA_MARGIN_BYTES = 64 << 10  # what HDF5's metadata may grow by with one append
# Root attributes the writer owns; set_attrs() may not overwrite them.
_RESERVED_ATTRS = (
    "schema_version",
    "config",
    "provenance",
    "status",
    "world_size",
    "run_id",
    MEMBERSHIP_ATTR,
)
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


def in_use(path: str | os.PathLike) -> bool:
    """Whether a live run is writing ``path`` (it holds HDF5's exclusive lock on it).

    Args:
        path: a run file's path (nothing there: False).

    Returns:
        True while another process has the file open for writing.
    """
    return _locked_by_a_writer(Path(path))


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
    """Store one attribute: str as variable-length UTF-8, numbers as scalars, sequences as
    arrays."""
    if isinstance(value, (str, os.PathLike)):
        attrs.create(name, os.fspath(value), dtype=STRING_DTYPE)
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
            attrs.create(name, [str(v) for v in array.flat], dtype=STRING_DTYPE)
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


def _chunks(row_shape: tuple[int, ...], itemsize: int) -> tuple[int, ...] | bool:
    row_bytes = max(1, int(np.prod(row_shape, dtype=np.int64)) * itemsize)
    if row_bytes > 16 * _CHUNK_BYTES:
        return True  # let h5py split large rows (e.g. params [n, d]) into chunks
    rows = max(1, min(_MAX_CHUNK_ROWS, _CHUNK_BYTES // row_bytes))
    return (rows, *row_shape)


class RunWriter:
    """Writes one run file: one process (rank 0) appends one row per evaluation and flushes.

    The file is written in place, so a run killed at any point keeps every row it appended;
    see results/README.md for the schema. Open one with ``create`` (a new run) or ``reopen``
    (resuming one); a full disk is a RunFileWriteError, one line.

    Attributes:
        path: the run file.
        world_size: the number of workers, recorded at creation.
        run_id: the run's id (kept by a resumed run; None in a file from before run ids).

    Example:
        ```python
        with RunWriter.create(path, config=cfg.to_dict(), provenance={}, world_size=4) as run:
            run.append({"step": 0, "test_accuracy": np.zeros(4)})
            run.set_status("completed")
        read_run(path).num_rows  # 1
        ```
    """

    def __init__(self, file: h5py.File, path: Path, reserve: SpaceReserve | None = None) -> None:
        self._file = file
        self.path = path
        self._reserve = reserve or SpaceReserve(Path(path).parent)
        self.world_size = int(file.attrs["world_size"])
        run_id = decode_attr(file.attrs.get("run_id"))
        # None: a file from before run ids
        self.run_id: str | None = run_id if isinstance(run_id, str) else None
        self._datasets: dict[str, h5py.Dataset] = row_datasets(file)
        self._left_out: frozenset[str] = frozenset()

    def leave_out_if_absent(self, names: Iterable[str]) -> None:
        """Rows appended from now on leave out those of ``names`` the file's datasets lack (a run
        resumed in a file written before they were recorded keeps the file's datasets).

        Args:
            names: the datasets a row may hold that older files do not have.
        """
        if self._datasets:
            self._left_out = frozenset(name for name in names if name not in self._datasets)

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

        Args:
            path: the run file; its folder must exist.
            config: the run's configuration (JSON-able).
            provenance: where and how it runs (JSON-able).
            world_size: the number of workers, >= 1.
            overwrite: replace a completed, diverged or damaged run file.

        Returns:
            The writer of the new file.

        Raises:
            FileNotFoundError: the folder does not exist.
            ValueError: a bad world_size, or config or provenance that is not JSON-able.
            NotARunFileError: ``path`` holds another kind of file (or a damaged one, without
                ``overwrite``).
            RunExistsError: ``path`` holds a finished run and ``overwrite`` is false.
            RunInUseError: another process is writing ``path``.
            RunFileWriteError: no space left on the device.
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
            raise NotARunFileError(
                f"{path} exists and cannot be read as a run file (empty or damaged HDF5)"
            )
        if not overwrite:
            status = run_status(path)
            if status in FINISHED_STATUSES:
                raise RunExistsError(
                    f"{path} holds a {status} run; pass overwrite=True (--overwrite) to replace it"
                )
        if path.exists() and _locked_by_a_writer(path):
            raise RunInUseError(f"{path} is being written by another run")
        reserve = SpaceReserve(path.parent)
        try:
            file = h5py.File(path, "w", locking="best-effort")
        except OSError as exc:
            reserve.release()
            if no_space(exc):
                raise RunFileWriteError(
                    f"cannot create the run file {path}: no space left on device"
                ) from None
            raise
        try:
            attrs = file.attrs
            attrs.create("schema_version", np.int64(SCHEMA_VERSION))
            attrs.create("config", config_json, dtype=STRING_DTYPE)
            attrs.create("provenance", provenance_json, dtype=STRING_DTYPE)
            attrs.create("status", "running", dtype=STRING_DTYPE)
            attrs.create("world_size", np.int64(world_size))
            attrs.create("run_id", uuid.uuid4().hex, dtype=STRING_DTYPE)
            attrs.create("start_time", _utc_now(), dtype=STRING_DTYPE)
            file.flush()
        except BaseException as exc:
            reserve.release()
            _close_quietly(file)
            if isinstance(exc, (OSError, RuntimeError)) and no_space(exc):
                # an empty or partial header: no run file is better than a corrupt one
                path.unlink(missing_ok=True)
                raise RunFileWriteError(
                    f"cannot create the run file {path}: no space left on device"
                ) from None
            raise
        return cls(file, path, reserve)

    @classmethod
    def reopen(cls, path: str | os.PathLike, *, resume_step: int) -> RunWriter:
        """Reopen a running, preempted or failed run to resume it after step ``resume_step``.

        Rows with step > resume_step are dropped (they are recomputed after the resume), the
        status goes back to "running", and resume_step and the time are appended to the
        ``resumed_at_steps`` / ``resumed_at_times`` attributes.

        Args:
            path: the run file.
            resume_step: the step the run resumes after (its checkpoint's).

        Returns:
            The writer of the reopened file.

        Raises:
            FileNotFoundError: there is no file at ``path``.
            RunFileError: the file cannot be read.
            RunExistsError: the run finished (completed or diverged).
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
            _truncate_late_drops(file, int(resume_step))
            attrs = file.attrs
            for name in _TERMINAL_ATTRS:
                if name in attrs:
                    del attrs[name]
            steps = (
                list(decode_attr(attrs["resumed_at_steps"])) if "resumed_at_steps" in attrs else []
            )
            times = (
                list(decode_attr(attrs["resumed_at_times"])) if "resumed_at_times" in attrs else []
            )
            _set_attr(attrs, "resumed_at_steps", [*steps, int(resume_step)])
            _set_attr(attrs, "resumed_at_times", [*times, _utc_now()])
            _set_attr(attrs, "status", "running")
            file.flush()
        except BaseException:
            file.close()
            raise
        return cls(file, path)

    @classmethod
    def take_over(
        cls, path: str | os.PathLike, *, from_step: int, writer_stalled: bool = False
    ) -> RunWriter:
        """The writer of a running run whose writing process died (a lost rank 0, with
        ``--on-failure continue``): the file reopened as it is, its rows with step >= from_step
        dropped (the survivors redo them).

        Unlike ``reopen`` it is no resume: the status stays "running" and ``resumed_at_*`` are
        left alone.

        Args:
            path: the run file.
            from_step: the first step the survivors write again.
            writer_stalled: the writer was evicted for silence (--peer-timeout): its process is
                still there, stopped, holding the file's lock, and will never write again (it
                aborts at its next MPI call), so the file is opened without locking.

        Returns:
            The writer of the file.

        Raises:
            FileNotFoundError: there is no file at ``path``.
            RunFileError: the file cannot be read.
            RunExistsError: the run is not "running" (it finished, failed or was preempted).
        """
        path = Path(path)
        status = run_status(path)
        if status == "missing":
            raise FileNotFoundError(f"no run file to take over: {path}")
        if status == "corrupt":
            read_run(path)  # raises RunFileError with the reason
        if status != "running":
            raise RunExistsError(
                f"{path} holds a {status} run; only a running run's file is taken over"
            )
        file = h5py.File(path, "r+", locking=False if writer_stalled else "best-effort")
        try:
            _truncate_rows(file, int(from_step) - 1)
            _truncate_late_drops(file, int(from_step))
            file.flush()
        except BaseException:
            file.close()
            raise
        return cls(file, path)

    @classmethod
    def take_over_abandoned(cls, path: str | os.PathLike) -> RunWriter | None:
        """The writer of a run file left "running" by a process that is gone, for a process that
        ends without one to record how the run ended; None where a live process writes the file,
        or where the run ended already (or there is no readable file).

        The status is read once this process holds the writer's lock (HDF5's exclusive flock,
        taken on opening): of several processes that ask at once, one gets the file and the
        others, refused the lock or finding the status it wrote, get None.

        Args:
            path: the run file.

        Returns:
            The writer (the file opened as it is, rows untouched), or None.
        """
        path = Path(path)
        if not path.exists() or _locked_by_a_writer(path):
            return None
        try:
            file = h5py.File(path, "r+", locking="best-effort")
        except OSError:  # another process took the lock first, or not a readable HDF5 file
            return None
        try:
            if "world_size" not in file.attrs or decode_attr(file.attrs.get("status")) != "running":
                file.close()
                return None
            return cls(file, path)
        except BaseException:
            _close_quietly(file)
            raise

    @property
    def is_open(self) -> bool:
        """Whether this writer still has its file open (``close`` not called yet)."""
        return bool(self._file.id.valid)

    def rewind(self, step: int) -> None:
        """Drop every row whose step is >= ``step`` (after a heal the survivors redo that step),
        and flush.

        Args:
            step: the first step to drop.

        Raises:
            RunFileWriteError: no space left on the device.
        """

        def rewind() -> None:
            _truncate_rows(self._file, int(step) - 1)
            _truncate_late_drops(self._file, int(step))

        self._write(rewind, f"a rewind to step {step}")

    @property
    def membership(self) -> list[dict[str, Any]]:
        """The membership changes recorded so far ([] without any)."""
        return parse_membership(decode_attr(self._file.attrs.get(MEMBERSHIP_ATTR)))

    def add_membership(self, record: Mapping[str, Any]) -> None:
        """Append one membership change to the ``membership`` attribute, and flush.

        Args:
            record: ``step`` (the first step without the lost workers), ``lost`` (their original
                ranks), ``lost_nodes`` and ``lost_hosts`` (host names or None; one per lost
                worker), ``world_size`` (the workers after the change) and ``heal_s`` (seconds
                from the failure being noticed to the first step on the new membership).

        Raises:
            ValueError: a missing, unknown or ill-typed key (named), or a record that does not
                follow the earlier ones.
            RunFileWriteError: no space left on the device.
        """
        earlier = self.membership
        checked = check_record(record, self.world_size, earlier)
        text = json.dumps([*earlier, checked], sort_keys=True)
        self._write(
            lambda: _set_attr(self._file.attrs, MEMBERSHIP_ATTR, text), "a membership change"
        )

    def append(self, row: Mapping[str, float | int | np.ndarray]) -> None:
        """Append one evaluation; the first row fixes the dataset names and per-row shapes.

        Args:
            row: the evaluation's values by name, ``step`` among them: numbers, or arrays (one
                value per worker, say).

        Raises:
            KeyError: no ``step``, or names the first row did not have.
            ValueError: a value's shape differs from the first row's.
            TypeError: a value that is not numeric.
            RunFileWriteError: no space left on the device.
        """
        self.extend({name: np.asarray(value)[np.newaxis] for name, value in row.items()})

    def extend(self, rows: Mapping[str, np.ndarray]) -> None:
        """Append k evaluations at once, given column-wise: every value has k on its first axis.

        Same rules as ``append`` (which calls this); one flush for all k rows. For importers
        and test factories; a training loop appends one row per evaluation.

        Args:
            rows: dataset name -> k values (``step`` required).
        """
        if "step" not in rows:
            raise KeyError("every row needs a 'step'")
        if self._left_out:
            rows = {name: value for name, value in rows.items() if name not in self._left_out}
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
            dtype: type[np.generic]
            fill: float
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
        self._datasets = row_datasets(self._file)

    def set_status(self, status: str, **attrs: Any) -> None:
        """Set the run's status (and extra attributes); terminal statuses also record end_time.

        Args:
            status: one of STATUSES.
            **attrs: extra root attributes to set with it (as ``set_attrs``).

        Raises:
            ValueError: an unknown status.
            RunFileWriteError: no space left on the device.
        """
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")

        def write() -> None:
            self._set_attrs(attrs)
            _set_attr(self._file.attrs, "status", status)
            if status in TERMINAL_STATUSES:
                _set_attr(self._file.attrs, "end_time", _utc_now())

        self._write(write, f"status {status}")

    def set_topology(self, topology: RunTopology) -> None:
        """Record where the ranks are and the graph they ran on (the ``topology`` group; replaced if
        present).

        Args:
            topology: the run's topology and node layout.
        """

        def write() -> None:
            if TOPOLOGY_GROUP in self._file:
                del self._file[TOPOLOGY_GROUP]
            group = self._file.create_group(TOPOLOGY_GROUP)
            group.attrs.create("name", topology.name, dtype=STRING_DTYPE)
            group.attrs.create("placement", topology.placement, dtype=STRING_DTYPE)
            group.attrs.create("nodes_emulated", bool(topology.nodes_emulated))
            group.attrs.create(
                "inter_node_edges", np.asarray(topology.inter_node_edges, dtype=np.int64)
            )
            group.create_dataset("rank_node", data=np.asarray(topology.rank_node, dtype=np.int64))
            for layer, edges in enumerate(topology.edges):
                group.create_dataset(
                    f"edges_{layer}", data=np.asarray(edges, dtype=np.int64).reshape(-1, 2)
                )

        self._write(write, "the topology")

    def add_late_drops(self, rows: np.ndarray) -> None:
        """Append messages that missed ``--message-deadline`` to the ``late_drops`` group (made by
        the first call, even with no rows, so that a deadline run's file says it had none), and
        flush.

        Args:
            rows: [k, 5] integers, columns LATE_DROP_COLUMNS (step, round, tag, sender,
                receiver).

        Raises:
            ValueError: rows of another shape.
            RunFileWriteError: no space left on the device.
        """
        self._append_drops("drops", LATE_DROP_COLUMNS, rows, "late drops")

    def add_skipped_steps(self, rows: np.ndarray) -> None:
        """Append steps that workers skipped to catch up (``--message-deadline``) to the
        ``late_drops`` group's ``skipped`` dataset (made by the first call with rows), and flush.

        Args:
            rows: [k, 2] integers, columns SKIPPED_COLUMNS (step, worker).

        Raises:
            ValueError: rows of another shape.
            RunFileWriteError: no space left on the device.
        """
        if len(np.asarray(rows).reshape(-1, len(SKIPPED_COLUMNS))):
            self._append_drops(SKIPPED_DATASET, SKIPPED_COLUMNS, rows, "skipped steps")

    def _append_drops(
        self, name: str, columns: tuple[str, ...], rows: np.ndarray, what: str
    ) -> None:
        """Append ``rows`` to the ``late_drops`` group's dataset ``name`` (made with its columns
        where missing), and flush."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, len(columns))

        def write() -> None:
            group = self._file.require_group(LATE_DROPS_GROUP)
            if name not in group:
                dataset = group.create_dataset(
                    name,
                    shape=(0, len(columns)),
                    maxshape=(None, len(columns)),
                    dtype=np.int64,
                    chunks=(256, len(columns)),
                )
                target = group if name == "drops" else dataset
                target.attrs.create("columns", ",".join(columns), dtype=STRING_DTYPE)
            dataset = group[name]
            n = dataset.shape[0]
            dataset.resize(n + len(rows), axis=0)
            dataset[n:] = rows

        self._write(write, what)

    def set_attrs(self, **attrs: Any) -> None:
        """Set extra root attributes.

        Args:
            **attrs: name -> a str, int, float, bool, or a sequence of numbers or strings.
        """
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
            rows, chunk = (
                dataset.chunks[0],
                int(np.prod(dataset.chunks, dtype=np.int64)) * dataset.dtype.itemsize,
            )
            n = dataset.shape[0]
            needed += (-(-(n + count) // rows) - -(-n // rows)) * chunk
        try:
            stat = os.statvfs(self.path.parent)
        except OSError:
            return
        if stat.f_bavail * stat.f_frsize < needed:
            self._reserve.release()  # room for the status that records the failure
            raise RunFileWriteError(
                f"no space left on device for the next evaluation in the run file {self.path} "
                f"(needs about {needed // 1024} KiB, "
                f"{stat.f_bavail * stat.f_frsize // 1024} KiB free)"
            )

    def _write(self, action: Any, what: str, undo: Any = None) -> None:
        """Do ``action`` and flush. When the device is full, release the space reserve and flush
        again (if that fails too, ``undo`` the action and flush), so the file stays readable with
        the rows and attributes written before; then raise RunFileWriteError: the run cannot go
        on."""
        try:
            action()
            self._file.flush()
        except (OSError, RuntimeError) as exc:
            if not no_space(exc):
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
            detail = (
                ""
                if kept
                else " (not even the space held in reserve let it finish; the file may be "
                "unreadable)"
            )
            raise RunFileWriteError(
                f"no space left on device writing {what} to the run file {self.path}{detail}"
            ) from None

    @property
    def num_rows(self) -> int:
        """The number of rows written so far."""
        return int(self._file["step"].shape[0]) if "step" in self._file else 0

    def close(self) -> None:
        """Close the file (again: nothing).

        Raises:
            RunFileWriteError: no space left on the device to close it.
        """
        if self._file.id.valid:
            try:
                self._file.close()
            except (OSError, RuntimeError) as exc:
                if not no_space(exc):
                    raise
                UNCLOSABLE.append(self._file)  # HDF5 crashes freeing it: see unclosable_files()
                raise RunFileWriteError(
                    f"no space left on device closing the run file {self.path}"
                ) from None
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


def _truncate_late_drops(file: h5py.File, first_redone: int) -> None:
    """Forget the late drops and skipped steps of the steps from ``first_redone`` on: they are run
    again."""
    group = file.get(LATE_DROPS_GROUP)
    if not isinstance(group, h5py.Group):
        return
    for name in ("drops", SKIPPED_DATASET):
        if isinstance(group.get(name), h5py.Dataset):
            rows = group[name]
            kept = rows[...]
            kept = kept[kept[:, 0] < first_redone]
            rows.resize(len(kept), axis=0)
            rows[...] = kept


def _truncate_rows(file: h5py.File, resume_step: int) -> None:
    datasets = row_datasets(file)
    if not datasets:
        return
    if "step" not in datasets:
        raise RunFileError(file.filename, "datasets without a 'step' dataset")
    n = complete_rows(datasets)
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
