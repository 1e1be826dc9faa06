"""A worker's evaluations: the named record every worker contributes, rank 0's row in the run
file, and the log line. Timers are named too, so nothing is read back by column position."""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from relaympi.comm import Communicator
from relaympi.training.plan import Plan, Schedule
from relaympi.training.workloads import Workload

log = logging.getLogger("relaympi.train")


@dataclass
class Timers:
    """Seconds a worker spent, by activity (the run file's time_*_s columns)."""

    compute: float = 0.0  # gradients
    comm: float = 0.0  # the algorithm's step: communication and its arithmetic
    eval: float = 0.0
    sync: float = 0.0  # the per-step agreement on stop flags

    def record(self) -> dict[str, float]:
        return {f"time_{name}_s": value for name, value in asdict(self).items()}

    def to_list(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_list(cls, values: list[float]) -> Timers:
        return cls(*values)


def row_header(schedule: Schedule, step: int, elapsed: float) -> dict[str, float]:
    """The run file's per-evaluation values that are the same for every worker."""
    return {
        "step": step,
        "epoch": schedule.epoch_at(step),
        "time_s": elapsed,
        "lr": schedule.lr_at(step),
    }


def device_memory(x: torch.Tensor) -> dict[str, float]:
    """The peak GPU memory of ``x``'s device (the run file's gpu_max_memory_bytes), nothing on a
    CPU."""
    return (
        {"gpu_max_memory_bytes": float(torch.cuda.max_memory_allocated(x.device))}
        if x.is_cuda
        else {}
    )


def worker_record(
    workload: Workload,
    train_loss: float,
    bytes_sent: float,
    timers: Timers,
    inter_node_bytes_sent: float,
) -> dict[str, float]:
    """This worker's values at an evaluation, by column name (the same names on every worker)."""
    return {
        "train_loss": train_loss,
        **workload.evaluate(),
        "bytes_sent": bytes_sent,
        "inter_node_bytes_sent": inter_node_bytes_sent,
        **timers.record(),
        **device_memory(workload.x),
    }


def gather_record(comm: Communicator, record: dict[str, float]) -> dict[str, np.ndarray] | None:
    """Rank 0: every worker's record, one array per name (indexed by rank); other ranks: None."""
    table = comm.gather_rows(np.asarray(list(record.values()), dtype=np.float64))
    if comm.rank != 0:
        return None
    assert table is not None  # rank 0 gathers every rank's row
    return {name: table[:, column] for column, name in enumerate(record)}


class Evaluator:
    """Evaluates every worker's own model, writes rank 0's row and logs a progress line."""

    def __init__(self, comm: Communicator, plan: Plan, schedule: Schedule, workload: Workload):
        self.comm, self.plan, self.schedule, self.workload = comm, plan, schedule, workload
        # after a lost worker (--on-failure continue): the original ids of the current ranks, the
        # run's first worker count (the run file's columns), and the bytes sent over earlier
        # communicators (total, inter-node)
        self.members: list[int] | None = None
        self.n0 = comm.world_size
        self.carried_bytes = np.zeros(2)

    def evaluate(
        self,
        step: int,
        train_loss: float,
        bytes_sent: float,
        timers: Timers,
        elapsed: float,
        writer: Any,
    ) -> dict[str, Any] | None:
        """Collective: every rank calls it at the same steps. Rank 0 appends the row to ``writer``
        (its
        RunWriter) and returns it."""
        record = worker_record(
            self.workload,
            train_loss,
            bytes_sent + self.carried_bytes[0],
            timers,
            float(self.comm.inter_node_bytes()) + self.carried_bytes[1],
        )
        columns = gather_record(self.comm, record)
        params = (
            self.comm.gather_rows(self.workload.x.detach().cpu().numpy())
            if self.workload.reports_params
            else None
        )
        if self.comm.rank != 0:
            return None
        assert columns is not None  # rank 0 gathers every rank's record
        if self.members is not None:  # lost workers' columns: NaN
            columns = {name: self._widened(values) for name, values in columns.items()}
        row: dict[str, Any] = {**row_header(self.schedule, step, elapsed), **columns}
        if params is not None:
            row.update(self.workload.summarize(params))  # the survivors' iterates
            if self.plan.cfg.record_params:
                row["params"] = params if self.members is None else self._widened(params)
        writer.append(row)
        return row

    def _widened(self, values: np.ndarray) -> np.ndarray:
        """The current workers' values (rows by rank) as the run's columns (rows by original id),
        NaN for the lost ones."""
        assert self.members is not None
        wide = np.full((self.n0, *values.shape[1:]), np.nan)
        wide[self.members] = values
        return wide


def log_line(
    row: dict[str, Any],
    schedule: Schedule,
    start_step: int,
    t0: float,
    elapsed: float,
    samples_per_step: int,
) -> str:
    """The progress line of one evaluation."""
    step, total = row["step"], schedule.total_steps
    done = max(step - start_step, 1)
    running = time.perf_counter() - t0
    parts = [f"step {step}/{total}", f"epoch {row['epoch']:.2f}"]
    train_loss = _nanmean(row["train_loss"])
    if not math.isnan(train_loss):  # nothing trained yet at step 0 of a classification run
        parts.append(f"train_loss {train_loss:.4f}")
    if "test_accuracy" in row:
        acc = row["test_accuracy"]
        parts.append(f"test_acc worst {np.nanmin(acc):.4f} mean {np.nanmean(acc):.4f}")
    if "suboptimality" in row:
        parts.append(f"subopt {row['suboptimality']:.3e} consensus {row['consensus_distance']:.3e}")
    if step > start_step:
        parts.append(f"{done * samples_per_step / max(running, 1e-9):.0f} samples/s")
        parts.append(f"eta {(total - step) * running / done:.0f}s")
    parts.append(f"elapsed {elapsed:.1f}s")
    return " | ".join(parts)


def _nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else math.nan


def progress_bar(total: int, initial: int) -> tqdm | None:
    """A tqdm bar on rank 0 when stderr is a terminal (log lines alone otherwise).

    Args:
        total: the run's steps.
        initial: the step it starts (or resumes) at.

    Returns:
        The bar, or None where stderr is not a terminal.
    """
    if not sys.stderr.isatty():
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)
