"""The run file's schema: its version, the run statuses, the topology group and how attributes
and row datasets are laid out in HDF5 (results/README.md describes the whole file)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

SCHEMA_VERSION = 1
STATUSES = ("running", "completed", "diverged", "failed", "preempted")
TERMINAL_STATUSES = ("completed", "diverged", "failed", "preempted")
FINISHED_STATUSES = ("completed", "diverged")  # results that must not be overwritten by accident
RESUMABLE_STATUSES = ("running", "preempted", "failed")

# per-evaluation datasets added to version 1 after its first files: a run resumed in an older file
# goes on without them (the file's datasets stay as it was created)
ADDED_DATASETS = ("inter_node_bytes_sent",)

# root attribute of a quadratics run: the problem's digest (relaympi.tasks.quadratics), the same
# whether the run generated the problem or read it from --problem-file
PROBLEM_DIGEST_ATTR = "problem_sha256"
# root attribute of a quadratics run: the loss its numbers are in (relaympi.tasks.quadratics'
# CONVENTION); runs written before it have none (their loss had a 1/2) and are not read as if alike
QUADRATICS_CONVENTION_ATTR = "quadratics_convention"

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
STRING_DTYPE = h5py.string_dtype("utf-8")


def decode_attr(value: Any) -> Any:
    """An attribute as HDF5 returns it, as Python: str, int, float, bool or a list of them."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OS":
            return [decode_attr(v) for v in value.tolist()]
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def row_datasets(file: h5py.File) -> dict[str, h5py.Dataset]:
    """The per-evaluation datasets: every dataset at the root (the topology is a group)."""
    return {name: obj for name, obj in file.items() if isinstance(obj, h5py.Dataset)}


def complete_rows(datasets: Mapping[str, h5py.Dataset]) -> int:
    """Rows present in every dataset (a run killed mid-append may leave one partial row)."""
    if not datasets:
        return 0
    n = min(int(ds.shape[0]) for ds in datasets.values())
    if "step" in datasets and n > 0 and int(datasets["step"][n - 1]) < 0:
        n -= 1  # step is written last: a fill value means the row never completed
    return n


# where the ranks were and the graph they ran on (not a per-evaluation dataset)
TOPOLOGY_GROUP = "topology"
# --message-deadline's record: the group's dataset ``drops`` [k, 5] int64, one row per message that
# missed the deadline, columns LATE_DROP_COLUMNS (step, round, tag, sender, receiver: original
# worker ids), in the order the run wrote them
LATE_DROPS_GROUP = "late_drops"
LATE_DROP_COLUMNS = ("step", "round", "tag", "sender", "receiver")
# and its dataset ``skipped`` [k, 2] int64 (only where a worker skipped a step): one row per step a
# worker behind its neighbours left out to catch up, columns SKIPPED_COLUMNS (step, worker: its
# original id)
SKIPPED_DATASET = "skipped"
SKIPPED_COLUMNS = ("step", "worker")


@dataclass(frozen=True)
class RunTopology:
    """The ``topology`` group: each rank's node and the edges every layer (tree or graph)
    realized."""

    name: str
    placement: str  # "ranks" or "nodes", as the run resolved --placement
    # [world_size] int64: rank r ran on node rank_node[r] (0, 1, ... by lowest rank)
    rank_node: np.ndarray
    nodes_emulated: (
        bool  # the nodes came from --ranks-per-node, not from where MPI placed the ranks
    )
    edges: tuple[np.ndarray, ...]  # per layer: [m, 2] int64 edges (i < j), sorted
    inter_node_edges: tuple[int, ...]  # per layer: edges whose ends are on different nodes

    @property
    def num_nodes(self) -> int:
        return len(set(self.rank_node.tolist()))
