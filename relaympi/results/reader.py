"""Reading a run file: its kind, its status, and the whole run (config, provenance, rows)."""

from __future__ import annotations

import json
import math
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
    check_record,
    finished_workers,
    parse_membership,
    present,
)
from relaympi.results.schema import (
    HDF5_SIGNATURE,
    LATE_DROP_COLUMNS,
    LATE_DROPS_GROUP,
    SCHEMA_VERSION,
    SKIPPED_COLUMNS,
    SKIPPED_DATASET,
    STATUSES,
    TOPOLOGY_GROUP,
    RunTopology,
    complete_rows,
    decode_attr,
    row_datasets,
)

# A run file may come from anyone: what it claims is checked against what it holds before
# anything is allocated from it. The most workers a run file may claim (the topology tool
# describes 100,000 ranks; a claim far beyond any machine is a crafted file).
MAX_WORLD_SIZE = 1 << 20


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
        late_drops: the messages that missed ``--message-deadline``, [k, 5] int64, columns
            LATE_DROP_COLUMNS (step, round, tag, sender, receiver); None for a run without one.
        skipped_steps: the steps workers skipped to catch up under ``--message-deadline``, [k, 2]
            int64, columns SKIPPED_COLUMNS (step, worker); None where none was skipped.
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
    # --message-deadline's late drops [k, 5] (LATE_DROP_COLUMNS); None: not a deadline run
    late_drops: np.ndarray | None = None
    # the steps workers skipped to catch up [k, 2] (SKIPPED_COLUMNS); None: none skipped
    skipped_steps: np.ndarray | None = None

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
    size = attrs["world_size"]
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_WORLD_SIZE:
        raise RunFileError(
            path, f"attribute 'world_size' is {size!r}; a run has 1 to {MAX_WORLD_SIZE} workers"
        )
    return version, status, attrs


def _check_storage(path: Path, group: h5py.Group) -> None:
    """Refuse what would make HDF5 read outside the file (external links, datasets with external
    storage, virtual datasets: a crafted run file could name any local file) or a link the writer
    never makes (a soft link). Checked for the root and the groups the reader reads (topology,
    late_drops)."""
    for name in group:
        link = group.get(name, getlink=True)
        if not isinstance(link, h5py.HardLink):
            raise RunFileError(
                path,
                f"refused: {group.name.rstrip('/')}/{name} is a {type(link).__name__}, which a "
                "run file never holds (it could make the reader read another file)",
            )
        item = group[name]
        if isinstance(item, h5py.Dataset) and (item.external or item.is_virtual):
            how = "external storage" if item.external else "a virtual dataset"
            raise RunFileError(
                path,
                f"refused: dataset {item.name} has {how}, which a run file never holds (it "
                "could make the reader read another file)",
            )


def _check_sizes(
    path: Path,
    world_size: int,
    available: dict[str, h5py.Dataset],
    wanted: dict[str, h5py.Dataset],
    topology: h5py.Group | None,
    budget: int | None,
) -> None:
    """Check the file's claimed sizes against each other before any dataset is read: row
    datasets hold numbers with a row axis, every per-worker axis is ``world_size`` wide, the
    topology's rank_node has one entry per worker, and (with ``budget``) the ``wanted`` datasets
    and the [rows, world_size] grids readers build from them fit in ``budget`` bytes."""
    for name, ds in available.items():
        if ds.dtype.kind not in "biuf" or ds.ndim == 0:
            raise RunFileError(
                path, f"dataset {name!r} holds {ds.dtype} {list(ds.shape)}, not rows of numbers"
            )
        if ds.ndim >= 2 and ds.shape[1] != world_size:
            raise RunFileError(
                path,
                f"dataset {name!r} has shape {list(ds.shape)}: its per-worker axis must be "
                f"world_size={world_size} wide",
            )
    rows = min((int(ds.shape[0]) for ds in available.values()), default=0)
    total = rows * world_size * 8  # Run.present() and the per-worker means: [rows, world_size]
    for ds in wanted.values():
        total += rows * math.prod(ds.shape[1:]) * ds.dtype.itemsize
    if topology is not None:
        for name in topology:
            item = topology[name]
            if isinstance(item, h5py.Dataset):
                if item.dtype.kind not in "biuf":
                    raise RunFileError(path, f"dataset {item.name} holds {item.dtype}, not numbers")
                total += math.prod(item.shape) * item.dtype.itemsize
        nodes = topology.get("rank_node")
        if isinstance(nodes, h5py.Dataset) and nodes.shape != (world_size,):
            raise RunFileError(
                path,
                f"dataset {nodes.name} has shape {list(nodes.shape)}: one node per worker, "
                f"world_size={world_size}",
            )
    if budget is not None and total > budget:
        raise RunFileError(
            path,
            f"too large to read: its datasets claim {total / 2**20:.1f} MiB, over the limit of "
            f"{budget / 2**20:.1f} MiB per run file",
        )


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


def _read_late_drops(
    path: Path, file: h5py.File, world_size: int, budget: int | None
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The ``late_drops`` group's rows and its skipped steps (None where absent), checked:
    integers, their columns, workers within the world and, with ``budget``, a size that fits it."""
    group = file.get(LATE_DROPS_GROUP)
    if group is None:
        return None, None
    if isinstance(group, h5py.Group):
        _check_storage(path, group)
    drops = group.get("drops") if isinstance(group, h5py.Group) else None
    if not isinstance(drops, h5py.Dataset):
        raise RunFileError(path, f"group {LATE_DROPS_GROUP!r} has no dataset 'drops'")
    rows = _worker_rows(path, drops, LATE_DROP_COLUMNS, 3, world_size, budget)
    skipped = group.get(SKIPPED_DATASET)
    if skipped is None:
        return rows, None
    if not isinstance(skipped, h5py.Dataset):
        raise RunFileError(path, f"{group.name}/{SKIPPED_DATASET} is not a dataset")
    return rows, _worker_rows(path, skipped, SKIPPED_COLUMNS, 1, world_size, budget)


def _worker_rows(
    path: Path,
    dataset: h5py.Dataset,
    columns: tuple[str, ...],
    first_worker: int,
    world_size: int,
    budget: int | None,
) -> np.ndarray:
    """A dataset of integer rows with ``columns``, the columns from ``first_worker`` on naming
    workers, checked as _read_late_drops says."""
    if dataset.dtype.kind not in "iu" or dataset.ndim != 2 or dataset.shape[1] != len(columns):
        raise RunFileError(
            path,
            f"dataset {dataset.name} holds {dataset.dtype} {list(dataset.shape)}, not rows of "
            f"{len(columns)} integers ({', '.join(columns)})",
        )
    if budget is not None and dataset.shape[0] * dataset.shape[1] * 8 > budget:
        raise RunFileError(path, f"dataset {dataset.name} is over the limit of {budget} bytes")
    rows = np.asarray(dataset[...], dtype=np.int64)
    workers = rows[:, first_worker:]
    if rows.size and (
        workers.min() < 0 or workers.max() >= world_size or rows[:, :first_worker].min() < 0
    ):
        raise RunFileError(
            path,
            f"dataset {dataset.name} names a worker outside 0..{world_size - 1} or a negative "
            f"{', '.join(columns[:first_worker])}",
        )
    return rows


def read_run(
    path: str | os.PathLike,
    *,
    datasets: Iterable[str] | None = None,
    budget: int | None = None,
) -> Run:
    """Read a run file; ``datasets`` limits which datasets are loaded (default: all).

    Before reading any dataset it checks what the file claims: world_size (1 to
    MAX_WORLD_SIZE) against every per-worker axis and the topology, membership records against
    world_size, numbers in every dataset, no external links, external storage or virtual
    datasets (they would read other files), and with ``budget`` the bytes it would allocate.

    Args:
        path: the run file.
        datasets: the names of the datasets to load (those the file lacks are skipped); None:
            all of them.
        budget: the most bytes the datasets read (and the [rows, world_size] grids built from
            them) may take; None: no limit (a run's own file).

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
        world_size = attrs["world_size"]
        try:
            membership = parse_membership(attrs.pop(MEMBERSHIP_ATTR, None))
            for index, record in enumerate(membership):  # worker ids within world_size
                membership[index] = check_record(record, world_size, membership[:index])
        except ValueError as error:
            raise RunFileError(path, f"attribute {MEMBERSHIP_ATTR!r} is {error}") from None
        _check_storage(path, file)
        group = file.get(TOPOLOGY_GROUP)
        if isinstance(group, h5py.Group):
            _check_storage(path, group)
        available = row_datasets(file)
        if available and "step" not in available:
            raise RunFileError(path, f"datasets {sorted(available)} without a 'step' dataset")
        wanted = (
            available if datasets is None else {k: available[k] for k in datasets if k in available}
        )
        topology_group = group if isinstance(group, h5py.Group) else None
        _check_sizes(path, world_size, available, wanted, topology_group, budget)
        n = complete_rows(available)
        data = {name: ds[:n] for name, ds in wanted.items()}
        topology = _read_topology(file)
        late_drops, skipped_steps = _read_late_drops(path, file, world_size, budget)
    except RunFileError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as error:
        raise RunFileError(path, f"corrupt run file ({type(error).__name__}: {error})") from None
    finally:
        file.close()
    return Run(
        path,
        version,
        status,
        config,
        provenance,
        attrs,
        data,
        topology,
        membership,
        late_drops,
        skipped_steps,
    )


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
