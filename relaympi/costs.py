"""What a run cost: per-step times and bytes from a run file's cumulative counters, the wall time
to a target accuracy, and the hardware and launch shape it ran on (from its provenance).

Per step, from the cumulative per-evaluation counters: for every evaluation interval (two
consecutive evaluations k-1, k with more steps at k), a counter's difference divided by the
steps between them; a cost's "median per step" is the median of those values over the
intervals (and over the workers, for the per-worker counters). Wall time per step of an
interval is (time_s[k] - time_s[k-1] - the interval's evaluation time) / steps, the evaluation
time being the largest worker's time_eval_s difference (workers evaluate side by side): time_s is
read when evaluation k starts, time_eval_s[k] holds the evaluations before it, so interval k
holds exactly evaluation k-1.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relaympi.results.membership import finished_workers, readmitted_at

# the run file's datasets the costs read (inter_node_bytes_sent: each worker's cumulative bytes
# sent to workers on other nodes, absent from files written before it was recorded)
COST_DATASETS = (
    "step",
    "time_s",
    "time_compute_s",
    "time_comm_s",
    "time_sync_s",
    "time_eval_s",
    "bytes_sent",
    "inter_node_bytes_sent",
    "test_accuracy",
)
# per-worker timers and the cost they measure (milliseconds per step)
TIMERS = {"compute_ms": "time_compute_s", "comm_ms": "time_comm_s", "wait_ms": "time_sync_s"}
# what makes two runs' times comparable (provenance keys); bytes compare across all of them
HARDWARE_KEYS = (
    "engine",
    "device",
    "nodes",
    "ranks_per_node",
    "cpu_model",
    "gpu_model",
    "mpi_library",
    "emulated_link",
)


def _intervals(step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index k of each interval's end, its steps): consecutive evaluations with more steps at k."""
    steps = np.diff(np.asarray(step, dtype=float))
    ends = np.flatnonzero(steps > 0) + 1
    return ends, steps[ends - 1]


def _per_step(values: np.ndarray, ends: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """A cumulative counter [evals] or [evals, workers] as its growth per step per interval."""
    values = np.asarray(values, dtype=float)
    growth = values[ends] - values[ends - 1]
    return growth / (steps if growth.ndim == 1 else steps[:, None])


@dataclass(frozen=True)
class StepCosts:
    """One run's per-interval costs (milliseconds per step; bytes per step per worker)."""

    step_ms: np.ndarray  # [intervals]: wall time less evaluation
    timers_ms: dict[str, np.ndarray]  # compute_ms / comm_ms / wait_ms -> [intervals, workers]
    bytes_per_step: np.ndarray | None  # [workers]: bytes each worker sent per step over the run
    inter_node_bytes_per_step: np.ndarray | None  # [workers], where the run recorded it

    @property
    def intervals(self) -> int:
        return len(self.step_ms)


def step_costs(data: Mapping[str, np.ndarray]) -> StepCosts | None:
    """The per-step costs of a run's datasets (None without step, time_s or any interval)."""
    if "step" not in data or "time_s" not in data:
        return None
    ends, steps = _intervals(data["step"])
    if not len(ends):
        return None
    wall = _per_step(data["time_s"], ends, steps)
    if "time_eval_s" in data:
        evaluation = _per_step(data["time_eval_s"], ends, steps)
        wall = wall - np.nanmax(evaluation.reshape(len(ends), -1), axis=1)
    timers = {
        name: _per_step(data[key], ends, steps).reshape(len(ends), -1) * 1000
        for name, key in TIMERS.items()
        if key in data
    }

    def total(name: str) -> np.ndarray | None:
        if name not in data:
            return None
        values = np.asarray(data[name], dtype=float).reshape(len(data["step"]), -1)
        step = np.asarray(data["step"], dtype=float)
        return (values[-1] - values[0]) / (step[-1] - step[0])

    return StepCosts(wall * 1000, timers, total("bytes_sent"), total("inter_node_bytes_sent"))


def member_step_costs(
    data: Mapping[str, np.ndarray], world_size: int, membership: Sequence[Mapping[str, Any]]
) -> StepCosts | None:
    """``step_costs`` of a run whose workers changed (``membership``: the run file's records):
    the bytes per step of the workers that finished only (a lost worker's counter is NaN from
    its loss on), a re-admitted worker's over its rows since its latest re-admission (its counter
    started again at 0 there). The same as ``step_costs`` without changes.

    Args:
        data: the run's datasets (COST_DATASETS).
        world_size: the run's first worker count (the width of its per-worker datasets).
        membership: the run's membership records, in order.

    Returns:
        The per-step costs, or None where ``step_costs`` has none.
    """
    costs = step_costs(data)
    if costs is None or not membership:
        return costs
    finished = finished_workers(world_size, membership)
    back = readmitted_at(membership)

    def kept(per_step: np.ndarray | None, name: str) -> np.ndarray | None:
        if per_step is None:
            return None
        return _since_readmitted(per_step, data, name, back)[finished]

    return dataclasses.replace(
        costs,
        bytes_per_step=kept(costs.bytes_per_step, "bytes_sent"),
        inter_node_bytes_per_step=kept(costs.inter_node_bytes_per_step, "inter_node_bytes_sent"),
    )


def _since_readmitted(
    per_step: np.ndarray, data: Mapping[str, np.ndarray], name: str, back: Mapping[int, int]
) -> np.ndarray:
    """``per_step`` (bytes per step per worker over the run) with each re-admitted worker's entry
    over its rows since its latest re-admission instead (NaN with fewer than two such rows: no
    interval to measure)."""
    per_step = np.array(per_step, dtype=float)
    if not back or name not in data:
        return per_step
    step = np.asarray(data["step"], dtype=float)
    values = np.asarray(data[name], dtype=float).reshape(len(step), -1)
    for worker, at in back.items():
        if worker >= len(per_step):
            continue
        rows = np.flatnonzero(step >= at)
        if len(rows) < 2:
            per_step[worker] = math.nan
            continue
        first, last = rows[0], rows[-1]
        per_step[worker] = (values[last, worker] - values[first, worker]) / (
            step[last] - step[first]
        )
    return per_step


def time_to_accuracy(time_s: np.ndarray, accuracy: np.ndarray, target: float) -> float | None:
    """Wall seconds (time_s) at the first evaluation where the worst worker's test accuracy is at or
    above ``target``; None if no evaluation reaches it."""
    worst = _worst(accuracy)
    reached = np.flatnonzero(worst >= target)
    return float(np.asarray(time_s, dtype=float)[reached[0]]) if len(reached) else None


def _worst(accuracy: np.ndarray) -> np.ndarray:
    values = np.asarray(accuracy, dtype=float)
    values = values.reshape(len(values), -1)
    worst = np.full(len(values), -math.inf)
    finite = np.isfinite(values).all(axis=1)
    worst[finite] = values[finite].min(axis=1)
    return worst


def own_target(accuracy: np.ndarray, fraction: float) -> float | None:
    """``fraction`` of the run's own final worst-worker accuracy (its last evaluation), or None."""
    worst = _worst(accuracy)
    return fraction * float(worst[-1]) if len(worst) and math.isfinite(worst[-1]) else None


def median(parts: Sequence[np.ndarray]) -> float:
    """The median over every finite value of ``parts`` (intervals, workers, seeds); NaN if none."""
    values = np.concatenate([np.ravel(p) for p in parts]) if parts else np.array([])
    values = values[np.isfinite(values)]
    return float(np.median(values)) if len(values) else math.nan


# ------------------------------------------------------------------------------ hardware


def launch_shape(hosts: Sequence[str]) -> dict[str, Any]:
    """Node count and ranks per node from every rank's host name (an int when even, else the
    per-node counts, largest first)."""
    counts = sorted(Counter(hosts).values(), reverse=True)
    return {"nodes": len(counts), "ranks_per_node": counts[0] if len(set(counts)) == 1 else counts}


def hardware(provenance: Mapping[str, Any], world_size: int | None = None) -> dict[str, Any]:
    """The provenance keys that decide whether two runs' times compare (HARDWARE_KEYS), each
    value or None where the file does not say. Files from before ``nodes`` was recorded: the
    node count is the number of distinct hosts, ranks per node world_size / nodes (MPI ranks, or
    the local engine's in-process ranks), 1 for the batched engine (one process runs every
    worker)."""
    engine = provenance.get("transport_backend")
    nodes = provenance.get("nodes")
    per_node = provenance.get("ranks_per_node")
    hosts = provenance.get("hosts")
    if nodes is None and isinstance(hosts, list) and hosts:
        nodes = len(set(hosts))
        if engine == "batched":
            per_node = 1
        elif engine in ("mpi", "local") and world_size and world_size % nodes == 0:
            per_node = world_size // nodes
    library = provenance.get("transport_mpi_library")
    return {
        "engine": engine,
        "device": provenance.get("transport_device"),
        "nodes": nodes,
        "ranks_per_node": per_node,
        "cpu_model": provenance.get("cpu_model"),
        "gpu_model": provenance.get("gpu_model"),
        "mpi_library": _library_name(library) if library else None,
        "emulated_link": provenance.get("emulated_link"),
    }


def _library_name(version: Any) -> str:
    """An MPI library's name and version from its version string's first line ("MPICH Version:
    5.0.2",
    "Open MPI v5.0.11")."""
    first = " ".join(str(version).strip().splitlines()[0].split())
    return first.split(", ")[0]


def hardware_label(info: Mapping[str, Any]) -> str:
    """Words for a hardware key: engine, launch shape, CPU, GPU, MPI and an emulated link."""
    engine: Any = info.get("engine")  # a name, or None (unknown)
    words = f"{engine} engine" if engine else "unknown engine"
    if info.get("device"):
        words += f" on {info['device']}"
    nodes, per_node = info.get("nodes"), info.get("ranks_per_node")
    unit = {"mpi": "rank(s)", "local": "in-process rank(s)"}.get(engine, "process(es)")
    if nodes is not None:
        words += f", {nodes} node(s) x {'?' if per_node is None else per_node} {unit} per node"
    else:
        words += ", launch shape unknown"
    words += f", CPU {info.get('cpu_model') or 'unknown'}"
    if info.get("gpu_model"):
        words += f", GPU {info['gpu_model']}"
    if info.get("mpi_library"):
        words += f", {info['mpi_library']}"
    if info.get("emulated_link"):
        words += f", emulated cluster (link {info['emulated_link']})"
    return words
