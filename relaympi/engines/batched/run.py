"""The batched engine (``--backend batched``): N workers as one batched computation, one HDF5 run
file.

The steps, start, checkpoints, injected failures and ending of a run are relaympi.training.loop's
TrainingLoop, shared with message passing; this module says how all workers compute gradients,
step and evaluate at once. ``run`` is its entry in relaympi.engines.

    python -m relaympi.train --task digits --backend batched --workers 16 --algo relay --alpha 0.01

The run file has the schema of the other backends (one row per evaluation, one column per
worker); every worker's gradient comes from one batched forward and backward (``time_compute_s``,
data included) and the algorithm's step over all workers is ``time_comm_s``; one process runs
them all, so each worker's column holds the process's times. Exit statuses as relaympi.train.

On a CPU, without ``--threads``, the run first times its first step with its share of the CPUs
and with one thread and keeps the faster (relaympi.engines.batched.threads; the numbers are the same
either way); ``provenance.torch_threads`` records the count it ran with.
"""

# Long module: the batched loop, its two engines and its membership changes (losses, re-admission)

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relaympi.algorithms.base import ROUNDS_PER_STEP
from relaympi.batched.algorithms import make_batched_algorithm
from relaympi.batched.optim import BatchedOptimizer
from relaympi.comm.base import number_nodes
from relaympi.config import ConfigError
from relaympi.engines.batched.data import BatchedData
from relaympi.engines.batched.models import BatchedModel, refuse_unsupported
from relaympi.engines.batched.threads import choose_threads, times_threads
from relaympi.tasks.base import ClassificationTask
from relaympi.tasks.quadratics import Quadratics, QuadraticsTask
from relaympi.training.checkpointing import Checkpoints
from relaympi.training.evaluation import device_memory, row_header
from relaympi.training.healing import Membership
from relaympi.training.loop import STOP, TrainingLoop, device_for
from relaympi.training.membership import readmission_weights, survivor_topology
from relaympi.training.plan import Plan
from relaympi.training.run_file import writer_factory
from relaympi.training.workloads import run_partition

log = logging.getLogger("relaympi.train")

BACKEND = "batched"
AUTOCAST = {None: None, "bf16": torch.bfloat16}  # --autocast


class ModelEngine:
    """A classification task's N models: X [N, d] float32, batched gradients and evaluation."""

    def __init__(self, plan: Plan, device: torch.device):
        cfg = plan.cfg
        options = replace(plan.task_options, device=str(device))
        # make_engine gives every other task a QuadraticEngine; resolve() filled in the batch size
        assert issubclass(plan.task, ClassificationTask) and cfg.batch_size is not None
        # resolve refused tasks this engine cannot run, before any data loads
        self.task = plan.task(options)
        self.model = BatchedModel(self.task, cfg.seed, device, autocast=AUTOCAST[cfg.autocast])
        parts = run_partition(self.task, plan)
        self.data = BatchedData(self.task, parts, cfg.batch_size, cfg.seed, device)
        self.X = self.model.stacked(plan.world_size)
        self.steps_per_epoch = self.data.steps_per_epoch
        self.eval_batch_size = cfg.eval_batch_size

    def keep_workers(self, rows: list[int], members: list[int]) -> None:
        """Keep the workers at positions ``rows`` (original ids ``members``); X is the caller's."""
        self.data.keep_workers(rows)

    def restore_workers(self, members: list[int]) -> None:
        """The rows become the workers of original ids ``members`` (re-admitted ones among them,
        each with its own shard and batch stream); X is the caller's."""
        self.data.restore_workers(members)

    def gradient(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(G [N, d], losses [N]) at step ``step``'s batches."""
        inputs, targets = self.data.batch(step)
        return self.model.gradients(self.X, inputs, targets)

    def current_losses(self) -> np.ndarray:
        # no loss before the first step (as ModelWorkload)
        return np.full(self.X.shape[0], math.nan)

    def metrics(self) -> dict[str, Any]:
        result = self.model.evaluate(self.X, self.task.test_batches(self.eval_batch_size))
        return {k: v.cpu().numpy() for k, v in result.items()}


class QuadraticEngine:
    """f_i(x) = ||A_i x - b_i||^2 (relaympi.tasks.quadratics) for all workers at once, in float64,
    from X(0) = 0."""

    def __init__(self, plan: Plan, device: torch.device):
        self.problem, self.seed, self.cfg = plan.problem, plan.cfg.seed, plan.cfg
        self.H = torch.from_numpy(self.problem.H).to(device)
        self.c = torch.from_numpy(self.problem.c).to(device)
        self.X = torch.zeros(plan.world_size, self.problem.dim, dtype=torch.float64, device=device)
        self.steps_per_epoch = 1
        # the original id of each row: its objective f_i and its noise stream
        self.members = list(range(plan.world_size))
        self._local: Quadratics = self.problem  # the rows' own objectives

    def keep_workers(self, rows: list[int], members: list[int]) -> None:
        """Keep the workers at positions ``rows`` (original ids ``members``): their objectives'
        rows; each draws its noise by its original id. X is the caller's."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.H.device)
        self.H, self.c = self.H.index_select(0, index), self.c.index_select(0, index)
        self.members = list(members)
        problem = self.problem
        self._local = Quadratics(
            problem.A[members], problem.b[members], problem.x_star, problem.f_star, problem.sigma2
        )

    def restore_workers(self, members: list[int]) -> None:
        """The rows become the workers of original ids ``members`` (re-admitted ones among them):
        each its own objective and noise stream again. X is the caller's."""
        problem, device = self.problem, self.H.device
        self.H = torch.from_numpy(problem.H[members]).to(device)
        self.c = torch.from_numpy(problem.c[members]).to(device)
        self.members = list(members)
        self._local = (
            problem
            if self.members == list(range(problem.A.shape[0]))
            else Quadratics(
                problem.A[members],
                problem.b[members],
                problem.x_star,
                problem.f_star,
                problem.sigma2,
            )
        )

    def gradient(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        G = torch.bmm(self.H, self.X.unsqueeze(2)).squeeze(2).sub_(self.c)
        if self.problem.sigma2:
            noise = np.stack([self.problem.noise(self.seed, step, rank) for rank in self.members])
            G.add_(torch.from_numpy(noise).to(G.device))
        return G, torch.from_numpy(self.current_losses())

    def current_losses(self) -> np.ndarray:
        return self._local.local_losses(self.X.cpu().numpy())

    def metrics(self) -> dict[str, Any]:
        """The summary (suboptimality of the global objective, consensus distance, ...) of the
        current rows; ``params`` one row per current worker."""
        params = self.X.cpu().numpy()
        row = self.problem.summary(params)
        if self.cfg.record_params:
            row["params"] = params
        return row


def make_engine(plan: Plan, device: torch.device) -> ModelEngine | QuadraticEngine:
    return (QuadraticEngine if issubclass(plan.task, QuadraticsTask) else ModelEngine)(plan, device)


# On a GPU the host reads the losses (the divergence check) and the step timers (CUDA events)
# every DEFERRED_STEPS steps, not every step: the device runs ahead of the host in between. The
# first non-finite step is still the one recorded, and nothing is evaluated or checkpointed past it.
DEFERRED_STEPS = 16


def check_lag(device: torch.device) -> int:
    """Steps between the host's reads of losses and timers on ``device`` (1: every step)."""
    return DEFERRED_STEPS if device.type == "cuda" else 1


def run(plan: Plan, out: Path, command: str, comm: Any = None) -> str:
    """relaympi.engines' entry: every worker in this process (a Communicator has no use here)."""
    if comm is not None:
        raise ConfigError(
            "--backend batched runs every worker in one process: it takes no MPI communicator"
        )
    return run_batched(plan, out, command)


def run_batched(
    plan: Plan,
    out: Path,
    command: str,
    *,
    stop: threading.Event = STOP,
    make_optimizer: Callable = BatchedOptimizer,
    make_algorithm: Callable = make_batched_algorithm,
) -> str:
    """Train all of ``plan``'s workers in this process; return the final status
    ("completed", "diverged", "preempted"). A failure is recorded in the run file, then re-raised.

    ``stop`` is the event the SIGTERM/SIGUSR1 handler sets (checkpoint at the next step boundary,
    then "preempted"). ``make_optimizer(config, X)`` and ``make_algorithm(algo, topology, optimizer,
    X0, options, drops, nodes=...)`` are relaympi.batched's (tests pass stand-ins); an algorithm's
    ``bytes_sent`` is a numpy int64 array [N] or [N, N] (by destination) of the bytes message
    passing would send.
    """
    refuse_unsupported(plan.task)  # what the task's class tells, before any data loads
    return BatchedRun(plan, out, command, make_optimizer, make_algorithm, stop).run()


class BatchedRun(TrainingLoop):
    """The training loop for all workers at once, in one process."""

    is_root = True
    worker_noun = "worker"
    interruptible = False  # workers leave at a step's start: nothing to redo, no snapshots

    def __init__(
        self,
        plan: Plan,
        out: Path,
        command: str,
        make_optimizer: Callable,
        make_algorithm: Callable,
        stop: threading.Event,
    ):
        super().__init__(writer_factory(plan, out, command), stop)
        cfg = plan.cfg
        self.plan, self.out = plan, Path(out)
        self.n = plan.world_size  # the workers now (the rows of X)
        self.n0 = plan.world_size  # the workers the run started with
        self.nodes0 = tuple(plan.nodes or (0,) * self.n0)  # each original worker's node
        self.members = list(range(self.n0))  # the original id of each row of X, in order
        self.workers = range(self.n)
        # --replay-drops: the step its late drops are written up to
        self._late_since: int | None = None
        self.device = torch.device(device_for(cfg, 0))
        self.engine = make_engine(plan, self.device)
        if isinstance(self.engine, ModelEngine):  # for the chance-accuracy check
            self.num_classes = int(self.engine.task.num_classes)
        self.schedule = plan.schedule(self.engine.steps_per_epoch)
        self._make_algorithm = make_algorithm
        # per original worker: the bytes (all, to other nodes) its algorithms before the current
        # one sent (NaN once it is lost); the current algorithm's counters start at its change
        self._bytes_before = np.zeros(self.n0)
        self._inter_node_bytes_before = np.zeros(self.n0)
        self.optimizer = make_optimizer(plan.optimizer, self.engine.X)
        self.algorithm = make_algorithm(
            cfg.algo,
            plan.topology,
            self.optimizer,
            self.engine.X,
            plan.algorithm_options,
            plan.drops,
            nodes=plan.nodes or None,
        )
        self.checkpoints = Checkpoints(cfg, self.out, 0, self.n, engine=BACKEND, nodes=plan.nodes)
        self.check_lag = check_lag(self.device)
        # by original worker, n0 wide: a lost worker's entry stays (its row reports NaN), so losses
        # of steps before a change that the loop has not read yet (a GPU's deferred reads) still
        # add up with those after it
        self.loss_sum = np.zeros(self.n0)
        self._G: torch.Tensor | None = None
        self._changed = False  # the membership changed since the run started (or its resume)
        # re-admitted worker -> its step of re-admission, until the first evaluation after it (its
        # mean train loss counts its own steps only)
        self._readmitted_at: dict[int, int] = {}
        self._readmission: dict[str, Any] | None = None  # the run file's record, once it opens
        self.check_injection(self.n)

    @property
    def x(self) -> torch.Tensor:
        return self.engine.X

    @property
    def bytes_counter(self) -> np.ndarray:
        return self.algorithm.bytes_sent

    def hosts(self) -> list[str] | None:
        return [socket.gethostname()]

    def transport(self) -> dict[str, Any]:
        return {"backend": BACKEND, "device": str(self.device)}

    def prepare(self) -> None:
        # before the run file opens: its provenance records the thread count the run uses
        if times_threads(self.engine.X, self.plan.cfg.threads):
            _, why = choose_threads(self.engine, self.algorithm, self.schedule.lr_at(0))
            if why is not None:
                log.info(why)

    # -- membership ---------------------------------------------------------------------------
    def membership_engine(self) -> BatchedMembership:
        return BatchedMembership(self)

    def drop_workers(self, lost: list[int], step: int) -> None:
        """Workers ``lost`` (original ids, all current members) vanish at the start of step
        ``step``: their rows leave X, the optimizer's state and the data (each survivor keeps its
        shard and its batch stream); the algorithm is rebuilt over the
        survivors (the heal rule): the run's topology family built for their count and placed by
        their nodes, fresh algorithm state from each survivor's current model, which keeps its
        local optimizer's state. Byte counts and the running train loss carry over per original
        worker."""
        gone = set(lost)
        if not gone or len(gone) != len(lost) or not gone <= set(self.members):
            raise ValueError(
                f"lost must name distinct current workers {self.members}, got {list(lost)}"
            )
        rows = [row for row, worker in enumerate(self.members) if worker not in gone]
        if not rows:
            raise ValueError(f"step {step}: every worker would be lost ({sorted(gone)})")
        members = [self.members[row] for row in rows]
        survivor_nodes = [self._node_of(worker) for worker in members]
        topology = survivor_topology(self.plan, survivor_nodes)  # before anything changes
        # the bytes so far, per original worker, before the algorithm's counters start over
        self._bytes_before = self._bytes_per_worker()
        self._inter_node_bytes_before = self._inter_node_bytes_per_worker()
        self._bytes_before[sorted(gone)] = np.nan
        self._inter_node_bytes_before[sorted(gone)] = np.nan
        X = self.engine.X
        # in place: whoever holds X (the loop's finiteness checks, its clock) sees the survivors
        kept = X.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=X.device))
        X.set_(kept.untyped_storage(), 0, kept.shape, kept.stride())
        self.engine.keep_workers(rows, members)
        self.optimizer.keep_rows(rows)
        self._G = None
        self._changed = True
        self.members, self.n = members, len(members)
        self.algorithm = self._make_algorithm(
            self.plan.cfg.algo,
            topology,
            self.optimizer,
            X,
            self.plan.algorithm_options,
            self.plan.drops,
            nodes=number_nodes(survivor_nodes) if self.plan.nodes else None,
        )

    def membership_state(self) -> dict[str, Any]:
        """After a membership change: the workers still in the run, the bytes each original
        worker sent before the current algorithm, and the workers re-admitted since the last
        evaluation."""
        state: dict[str, Any] = {}
        if self.n != self.n0:
            state["members"] = torch.tensor(self.members, dtype=torch.int64)
        if self.n != self.n0 or self._changed:
            state["bytes_before"] = torch.from_numpy(self._bytes_before.copy())
            state["inter_node_bytes_before"] = torch.from_numpy(
                self._inter_node_bytes_before.copy()
            )
        if self._readmitted_at:
            state["readmitted_at"] = torch.tensor(
                sorted(self._readmitted_at.items()), dtype=torch.int64
            )
        return state

    def restore_membership(self, state: dict[str, Any]) -> None:
        """A checkpoint taken after a membership change first drops the workers it had lost, so
        that the models, optimizer and algorithm it restores have the survivors' shapes; then the
        lost workers are re-admitted (``readmit``): the run goes on at full strength."""
        t0 = time.perf_counter()
        if "members" in state:
            members = set(state["members"].tolist())
            self.drop_workers([w for w in self.members if w not in members], self.start_step)
        self._restore_started = t0  # the re-admission's time runs from here

    def restored(self, state: dict[str, Any]) -> None:
        """After ``restore``: the byte counts carried over, then the lost workers rejoin."""
        if "bytes_before" in state:
            self._changed = True
            self._bytes_before = state["bytes_before"].numpy().copy()
            self._inter_node_bytes_before = state["inter_node_bytes_before"].numpy().copy()
        if "readmitted_at" in state:
            self._readmitted_at = {int(w): int(s) for w, s in state["readmitted_at"].tolist()}
        if self.n != self.n0:
            self.readmit_lost(self.start_step, self._restore_started)

    def readmit_lost(self, step: int, t0: float | None = None) -> list[int]:
        """Every lost worker rejoins at step ``step`` (docs/membership.md, "Back to full
        strength"); return their original ids.

        The survivors keep their rows (models, local optimizer state); a re-admitted worker's
        model is the weighted sum (``readmission_weights``: the mean of its neighbours in the run's
        topology that are members, or of every member), added up in ascending member id, its local
        optimizer state is zero, and it draws its own shard's batches by its id again. The
        algorithm is built afresh over the run's topology for all workers (the heal rule). Bytes
        carry over per survivor and start at 0 for a re-admitted worker; the run file records the
        change once it opens (``start``).

        Raises:
            ConfigError: Adam, whose workers here share one step count (a re-admitted worker's
                would have to start at 0).
        """
        t0 = time.perf_counter() if t0 is None else t0
        readmitted = self._lost()
        if not readmitted:
            return []
        if self.plan.optimizer.name == "adam":
            raise ConfigError(
                f"the checkpoint in {self.plan.cfg.checkpoint_dir} (step {step}) was saved after "
                f"workers {', '.join(map(str, readmitted))} were lost, and --backend batched "
                "cannot re-admit them under --optimizer adam (its workers share one step count); "
                "delete the folder to start again, or pass --overwrite"
            )
        members = list(self.members)  # ascending: drop_workers keeps the original order
        X = self.engine.X
        # the bytes so far, per original worker, before the algorithm's counters start over
        self._bytes_before = self._bytes_per_worker()
        self._inter_node_bytes_before = self._inter_node_bytes_per_worker()
        self._bytes_before[readmitted] = 0.0
        self._inter_node_bytes_before[readmitted] = 0.0
        row_of = {worker: row for row, worker in enumerate(members)}
        full = X.new_zeros((self.n0, *X.shape[1:]))
        full.index_copy_(0, torch.as_tensor(members, dtype=torch.long, device=X.device), X)
        for worker in readmitted:
            model = torch.zeros_like(X[0])
            for member, weight in sorted(
                readmission_weights(self.plan.topology, members, worker).items()
            ):
                model.add_(X[row_of[member]] * weight)
            full[worker] = model
        # in place: whoever holds X (the loop's finiteness checks, its clock) sees every worker
        X.set_(full.untyped_storage(), 0, full.shape, full.stride())
        everyone = list(range(self.n0))
        self.engine.restore_workers(everyone)
        self.optimizer.place_rows(members, self.n0)
        self._G = None
        self._changed = True
        self.members, self.n = everyone, self.n0
        self.algorithm = self._make_algorithm(
            self.plan.cfg.algo,
            self.plan.topology,
            self.optimizer,
            X,
            self.plan.algorithm_options,
            self.plan.drops,
            nodes=self.plan.nodes or None,
        )
        if isinstance(self.loss_sum, np.ndarray):
            self.loss_sum[readmitted] = 0.0
        self._readmitted_at.update({worker: step for worker in readmitted})
        heal_s = time.perf_counter() - t0
        self._readmission = {
            "step": int(step),
            "lost": [],
            "lost_nodes": [],
            "lost_hosts": [],
            "readmitted": readmitted,
            "world_size": self.n0,
            "heal_s": float(heal_s),
        }
        log.warning(
            "re-admitted %s at step %d; %d workers carry on (in %.2f s)",
            ", ".join(f"worker {w} (node {self._node_of(w)})" for w in readmitted),
            step,
            self.n0,
            heal_s,
        )
        return readmitted

    def _lost(self) -> list[int]:
        """The original ids of the workers lost so far."""
        return sorted(set(range(self.n0)) - set(self.members))

    def _node_of(self, worker: int) -> int:
        """Original worker ``worker``'s node (as the run placed it)."""
        return int(self.plan.nodes[worker]) if self.plan.nodes else 0

    def _per_original_worker(self, values: Any) -> Any:
        """A per-worker array ([N, ...], N the current workers) as [n0, ...] by original id, NaN
        for the lost workers; anything else (a run-level scalar) unchanged."""
        if self.n == self.n0 or not isinstance(values, np.ndarray) or values.ndim == 0:
            return values
        if values.shape[0] != self.n:
            raise ValueError(f"expected {self.n} rows (one per worker), got {values.shape}")
        full = np.full((self.n0, *values.shape[1:]), np.nan)
        full[self.members] = values
        return full

    # -- the steps ---------------------------------------------------------------------------
    def gradient(self, step: int) -> np.ndarray | torch.Tensor:
        """The step's losses by original worker, n0 of them: 0 for the lost (finite, so no
        divergence; their rows report NaN)."""
        self._G, losses = self.engine.gradient(step)
        if self.n != self.n0:
            members = torch.as_tensor(self.members, dtype=torch.long, device=losses.device)
            losses = losses.new_zeros(self.n0).index_copy_(0, members, losses.detach())
        if self.check_lag > 1:  # read later, many steps at once (relaympi.training.clocks.settle)
            return losses.detach().double()
        return losses.detach().double().cpu().numpy()

    def algorithm_step(self, step: int, lr: float) -> None:
        self.algorithm.step(self.engine.X, self._G, lr, step)

    def evaluate(self, step: int) -> None:
        sums = np.array(self.loss_sum, dtype=np.float64)  # before train_loss resets them

        def current() -> np.ndarray:
            return self._per_original_worker(self.engine.current_losses())

        train_loss = np.array(self.train_loss(current), dtype=np.float64)
        train_loss[self._lost()] = np.nan
        if self._readmitted_at:
            # a worker re-admitted since the last evaluation: the mean over its own steps since
            # (before any, its current loss, as at step 0)
            now: np.ndarray | None = None
            for worker, since in self._readmitted_at.items():
                trained = step - since
                if trained > 0:
                    train_loss[worker] = sums[worker] / trained
                else:
                    now = current() if now is None else now
                    train_loss[worker] = now[worker]
            self._readmitted_at = {}
            self.last_train_loss = train_loss.copy()  # a resume at this step records the same
        # one process runs every worker: each worker's column holds the process's times and memory
        # every per-worker column is n0 wide, by original id: NaN for the workers lost so far
        spread = self._per_original_worker
        shared = {
            name: spread(np.full(self.n, value))
            for name, value in {**self.timers.record(), **device_memory(self.engine.X)}.items()
        }
        row = {
            **row_header(self.schedule, step, self.elapsed()),
            "train_loss": train_loss,
            "bytes_sent": self._bytes_per_worker(),
            "inter_node_bytes_sent": self._inter_node_bytes_per_worker(),
            **shared,
            **{name: spread(value) for name, value in self.engine.metrics().items()},
        }
        self.record_late_drops(step)
        self.writer.append(row)
        self.log_evaluation(row, self.n)

    def record_late_drops(self, step: int) -> None:
        """--replay-drops: the replayed late drops of the steps since last written, as the
        message-passing engine records the ones it meets (sorted rows), so the run files match."""
        if self.plan.cfg.replay_drops is None or self.writer is None:
            return
        since = self.start_step if self._late_since is None else self._late_since
        self._late_since = step
        rows = sorted(
            (r // ROUNDS_PER_STEP, r, t, s, d)
            for r, t, s, d in self.plan.drops.replayed
            if since <= r // ROUNDS_PER_STEP < step
        )
        self.writer.add_late_drops(np.asarray(rows, dtype=np.int64).reshape(-1, 5))

    def _inter_node_bytes_per_worker(self) -> np.ndarray:
        """Bytes each original worker sent so far to workers on other nodes
        (Communicator.inter_node_bytes's sum; NaN once lost); NaN for a counter without
        destinations ([N]) where the workers span nodes."""
        sent = np.asarray(self.algorithm.bytes_sent, dtype=np.float64)
        nodes = np.asarray([self._node_of(worker) for worker in self.members])
        if sent.ndim == 2:
            now = (sent * (nodes[:, None] != nodes[None, :])).sum(axis=1)
        else:
            now = np.full(self.n, np.nan if len(set(nodes.tolist())) > 1 else 0.0)
        total = self._inter_node_bytes_before.copy()
        total[self.members] += now
        return total

    def _bytes_per_worker(self) -> np.ndarray:
        """Bytes each original worker sent so far (the current algorithm's [N], or [N, N] by
        destination as Communicator.bytes_sent, summed, plus its earlier algorithms'; NaN once
        lost)."""
        sent = np.asarray(self.algorithm.bytes_sent, dtype=np.float64)
        now = sent.reshape(self.n, -1).sum(axis=1)
        total = self._bytes_before.copy()
        total[self.members] += now
        return total


class BatchedMembership(Membership):
    """The batched engine's side of the membership protocol: every worker is a row of this one
    process, so a worker leaves only at a step's start, its row removed, and the survivors carry
    on at once (nothing to detect, nothing to redo, nobody to agree with)."""

    def __init__(self, run: BatchedRun) -> None:
        self.run = run

    def survive_losses(self) -> None:
        return None

    def share_hosts(self, hosts: list[str] | None) -> list[str]:
        assert hosts is not None  # one process: its own host for every worker
        return hosts * self.run.n0

    def lose(self, step: int, workers: list[int]) -> list[int]:
        lost = [worker for worker in dict.fromkeys(workers) if worker in self.run.members]
        if lost:
            self.run.drop_workers(lost, step)
        return lost

    def agree_end(self, done: bool) -> bool:
        return done

    def all_max(self, values: np.ndarray) -> np.ndarray:
        return values
