"""Reading a run file: its kind, its status, and the whole run (config, provenance, rows)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from relaympi.results.errors import RunFileError
from relaympi.results.membership import (
    MEMBERSHIP_ATTR,
    finished_workers,
    parse_membership,
    present,
)
from relaympi.results.schema import (
    HDF5_SIGNATURE,
    SCHEMA_VERSION,
    STATUSES,
    TOPOLOGY_GROUP,
    RunTopology,
    complete_rows,
    decode_attr,
    row_datasets,
)


def file_kind(path: str | os.PathLike) -> str:
    """What is at ``path``: "missing", "run" (a relaympi run file, of any schema version), "damaged"
    (empty, or HDF5 that cannot be opened: possibly a run file cut short) or "other" (any other
    file).

    A writer replaces "run" files (finished ones only when asked) and "damaged" ones only when
    asked;
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
    if head != HDF5_SIGNATURE and not h5py.is_hdf5(path):
        return "other"
    try:
        with h5py.File(path, "r", locking=False) as file:
            return "run" if "schema_version" in file.attrs and "config" in file.attrs else "other"
    except OSError:
        return "damaged"


@dataclass
class Run:
    """One run file, read: config, provenance, status, other root attributes and datasets.

    Attributes:
        path: the run file.
        schema_version: the file's schema version (SCHEMA_VERSION).
        status: "running", "completed", "diverged", "failed" or "preempted" (STATUSES).
        config: the run's configuration (RunConfig's fields).
        provenance: where and how it ran (hosts, library versions, transport, command).
        attrs: the other root attributes (world_size, run_id, times, ...).
        data: the datasets read, one row per evaluation (``step`` first).
        topology: the ranks' nodes and the graph they ran on; None in a file from before it was
            recorded.
        membership: the run's membership changes (``--on-failure continue``), in order: each a
            dict with step, lost, lost_nodes, lost_hosts, world_size and heal_s, and for a rerun's
            re-admission also readmitted; [] without any.
    """

    path: Path
    schema_version: int
    status: str
    config: dict[str, Any]
    provenance: dict[str, Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    data: dict[str, np.ndarray] = field(default_factory=dict)
    topology: RunTopology | None = None  # None: a file from before the topology was recorded
    membership: list[dict[str, Any]] = field(default_factory=list)

    def metric(self, name: str) -> np.ndarray:
        """The dataset ``name``, one row per evaluation.

        Args:
            name: a dataset of the run file ("step", "test_accuracy", ...).

        Returns:
            The dataset as read.

        Raises:
            KeyError: the run has no such dataset (or it was not read); the message lists those
                it has.
        """
        try:
            return self.data[name]
        except KeyError:
            raise KeyError(
                f"{self.path} has no dataset {name!r}; it has {sorted(self.data)}"
            ) from None

    @property
    def world_size(self) -> int:
        """The number of workers the run had."""
        return int(self.attrs["world_size"])

    @property
    def num_rows(self) -> int:
        """The number of evaluations read (rows of ``step``; 0 without it)."""
        return len(self.data["step"]) if "step" in self.data else 0

    @property
    def finished_workers(self) -> list[int]:
        """The original ids of the workers that took part to the end: never lost, or re-admitted
        after their latest loss (every worker without membership changes)."""
        return finished_workers(self.world_size, self.membership)

    def present(self) -> np.ndarray:
        """Whether each worker took part at each row: false where a membership change had lost it
        and no re-admission had brought it back yet (its NaN there is by design, not a non-finite
        value).

        Returns:
            [rows, world_size] bool.

        Raises:
            KeyError: the rows' step was not read.
        """
        if "step" not in self.data:
            raise KeyError(f"{self.path}: the rows' step was not read")
        return present(self.data["step"], self.world_size, self.membership)


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
    if head != HDF5_SIGNATURE and not h5py.is_hdf5(path):
        raise RunFileError(path, f"not an HDF5 file ({size} bytes, no HDF5 signature)")


def _open_for_reading(path: Path) -> h5py.File:
    _precheck(path)
    try:
        try:
            # locking=False: a live writer holds a lock, and readers must still see its
            # flushed rows.
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
    attrs = {name: decode_attr(file.attrs[name]) for name in file.attrs}
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


def _read_topology(file: h5py.File) -> RunTopology | None:
    if TOPOLOGY_GROUP not in file:
        return None  # a run file from before the topology was recorded
    group = file[TOPOLOGY_GROUP]
    attrs = {name: decode_attr(group.attrs[name]) for name in group.attrs}
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


def read_run(path: str | os.PathLike, *, datasets: Iterable[str] | None = None) -> Run:
    """Read a run file; ``datasets`` limits which datasets are loaded (default: all).

    Args:
        path: the run file.
        datasets: the names of the datasets to load (those the file lacks are skipped); None:
            all of them.

    Returns:
        The Run, its datasets cut to the rows every dataset has (a run killed mid-write keeps
        its complete rows).

    Raises:
        RunFileError: a missing, empty, non-HDF5, truncated or corrupt file, missing attributes
            or an unknown schema_version; the message gives the reason.

    Example:
        ```python
        run = read_run("results/digits-relay-chain-n16-a0.01-s0.h5", datasets=["step", "loss"])
        run.status, run.world_size, run.metric("loss")[-1]
        ```
    """
    path = Path(path)
    file = _open_for_reading(path)
    try:
        version, status, attrs = _read_header(path, file)
        config = _parse_json(path, attrs, "config")
        provenance = _parse_json(path, attrs, "provenance")
        try:
            membership = parse_membership(attrs.pop(MEMBERSHIP_ATTR, None))
        except ValueError as error:
            raise RunFileError(path, f"attribute {MEMBERSHIP_ATTR!r} is {error}") from None
        available = row_datasets(file)
        if available and "step" not in available:
            raise RunFileError(path, f"datasets {sorted(available)} without a 'step' dataset")
        n = complete_rows(available)
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
    return Run(path, version, status, config, provenance, attrs, data, topology, membership)


def run_status(path: str | os.PathLike) -> str:
    """The state of a run file without reading its datasets (attributes only).

    Args:
        path: the run file.

    Returns:
        "missing", "corrupt" (unreadable, or not a version-1 run file) or the run's status (one
        of STATUSES). It never raises for a bad file.
    """
    path = Path(path)
    if not path.exists():
        return "missing"
    try:
        file = _open_for_reading(path)
    except RunFileError:
        return "corrupt"
    try:
        version = decode_attr(file.attrs.get("schema_version"))
        status = decode_attr(file.attrs.get("status"))
    except (OSError, KeyError, ValueError, TypeError, RuntimeError):
        return "corrupt"
    finally:
        file.close()
    if version != SCHEMA_VERSION or status not in STATUSES:
        return "corrupt"
    return status
