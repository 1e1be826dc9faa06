"""A run, resolved: every default filled in, every derived quantity computed once, nothing mutable.

``resolve`` is cheap (no data is read, no engine is loaded), so job scripts can validate a
configuration before they submit it; what an engine refuses is its own check
(relaympi.engines: ``engine_for(backend).check(plan)``). The step schedule depends on the size of
the training set, which only a loaded
task knows; ``Plan.schedule`` derives it, a pure function of the plan and that size.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, TypedDict

from relaympi.algorithms import (
    ALGORITHM_OPTIONS,
    AlgorithmError,
    Options,
    check_combination,
    communication,
    get_algorithm_class,
    lr_correction,
    needs_momentum,
)
from relaympi.comm import DropPolicy
from relaympi.config import ConfigError, RunConfig
from relaympi.config.validation import run_topology, topology_refusal
from relaympi.data import task_dirs
from relaympi.optim import OptimizerConfig
from relaympi.tasks import Task, TaskOptions, get_task_class
from relaympi.topology import Topology, TopologyError, build, nodes_of
from relaympi.training.replay import replayed

log = logging.getLogger("relaympi.train")


@dataclass(frozen=True)
class Schedule:
    """When things happen, in steps: run length, evaluations, checkpoints and the lr schedule."""

    steps_per_epoch: int
    total_steps: int
    eval_every: int
    checkpoint_every: int
    lr: float  # the base learning rate (after RelaySGD's lr correction)
    warmup_steps: int
    warmup_from: float
    milestone_steps: tuple[int, ...]

    def lr_at(self, step: int) -> float:
        """Linear warm-up (per step) then /10 at each milestone."""
        factor = 1.0
        if self.warmup_steps > 0 and step < self.warmup_steps:
            factor = self.warmup_from + (1.0 - self.warmup_from) * step / self.warmup_steps
        decays = sum(step >= m for m in self.milestone_steps)
        return self.lr * factor * 0.1**decays

    def epoch_at(self, step: int) -> float:
        return step / self.steps_per_epoch


@dataclass(frozen=True)
class Plan:
    """The resolved run."""

    cfg: RunConfig
    world_size: int
    topology: Topology
    task: type[Task]
    optimizer: OptimizerConfig
    algorithm_options: Options  # the algorithm's own
    lr: float  # the base learning rate, RelaySGD's lr correction applied
    drops: DropPolicy  # the simulated message loss every engine applies (--drop-prob, --seed)
    # what the run tells its task; the device is --device's (an engine sets each worker's)
    task_options: TaskOptions
    problem: Any = None  # the run-level problem the task settled on (quadratics), else None
    lr_warning: str | None = None  # a default lr used at a worker count it was not tuned for
    notices: tuple[
        str, ...
        # flags given that this run resolved away (e.g. --progress-thread where --overlap is off)
    ] = ()
    # each rank's node (0, 1, ... by each node's lowest rank): as MPI placed the ranks, or
    # emulated (--ranks-per-node)
    nodes: tuple[int, ...] = ()
    # --replay-drops: the (step, worker) of each loss of the run it replays, in order (each worker
    # vanishes at the start of its step, as the MPI run's survivors redid it)
    replayed_losses: tuple[tuple[int, int], ...] = ()
    # a rerun on the survivors of a run that lost workers (--on-failure continue): the original ids
    # of the workers it runs, in rank order (world_size stays the run's first count); () otherwise
    members: tuple[int, ...] = ()

    def warn(self) -> None:
        """Log what the run does other than asked or tuned for (rank 0 calls it)."""
        if self.lr_warning:
            log.warning("warning: %s", self.lr_warning)
        for notice in self.notices:
            log.warning("warning: %s", notice)

    def schedule(self, steps_per_epoch: int) -> Schedule:
        """The step schedule for a training set that gives ``steps_per_epoch`` steps per epoch."""
        cfg, defaults = self.cfg, self.task.defaults
        # resolve() filled these in from the task's defaults (epochs where --steps is not given)
        assert cfg.warmup_epochs is not None and cfg.milestones is not None
        if cfg.steps is not None:
            total = cfg.steps
        else:
            assert cfg.epochs is not None
            total = _steps_in(cfg.epochs, steps_per_epoch)
        if cfg.eval_every is not None:
            eval_every = cfg.eval_every
        elif defaults.evals_per_run:
            eval_every = max(1, total // defaults.evals_per_run)
        else:
            eval_every = max(1, round(defaults.eval_every_epochs * steps_per_epoch))
        return Schedule(
            steps_per_epoch=steps_per_epoch,
            total_steps=total,
            eval_every=eval_every,
            checkpoint_every=cfg.checkpoint_every or eval_every,
            lr=self.lr,
            warmup_steps=round(cfg.warmup_epochs * steps_per_epoch) if self.world_size > 1 else 0,
            warmup_from=defaults.warmup_from,
            milestone_steps=tuple(round(m * steps_per_epoch) for m in cfg.milestones),
        )

    def with_out(self, out: Path) -> Plan:
        return replace(self, cfg=replace(self.cfg, out=out))


def _steps_in(epochs: float, steps_per_epoch: int) -> int:
    """Steps to run ``epochs`` epochs (a last, partial epoch counts; at least one), in the decimal
    the
    user wrote: 1.1 epochs of 90 steps are 99 steps, not the 100 that float's 1.1 * 90 =
    99.00000000000001 gives."""
    return max(1, math.ceil(Fraction(repr(float(epochs))) * steps_per_epoch))


def run_nodes(
    cfg: RunConfig, world_size: int, nodes: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Each rank's node: rank // --ranks-per-node where given (emulated), else ``nodes`` (the
    Communicator's, as MPI placed the ranks), else one node (every worker in this process)."""
    if cfg.ranks_per_node is not None:
        try:
            return tuple(int(node) for node in nodes_of(world_size, cfg.ranks_per_node))
        except TopologyError as exc:
            raise ConfigError(f"--ranks-per-node {cfg.ranks_per_node}: {exc}") from exc
    return (0,) * world_size if nodes is None else tuple(int(node) for node in nodes)


def resolve_placement(placement: str, nodes: Sequence[int]) -> str:
    """--placement as it runs: "auto" is "nodes" when the ranks span more than one node, else
    "ranks" (on one node both give the same topology, and "ranks" is the paper's)."""
    if placement != "auto":
        return placement
    return "nodes" if len(set(nodes)) > 1 else "ranks"


# --overlap's default needs a model of more than this many --bucket-size buckets (4 MiB each by
# default: 1M float32 parameters). A model within one bucket is one bucket, complete only when
# backward ends: no transfer can start during backward, so nothing is hidden and the hooks, the
# MPI_Test polls and the progress thread are pure cost (digits' 4,810-parameter MLP on 2 emulated
# nodes x 2 ranks: 7.94 ms per step without, 9.27 with, 11.3 with the progress thread). VGG-11's
# 9.2M float32 (35 MiB) make 5 buckets: the transfers of the first 4 start during backward.
OVERLAP_MIN_BUCKETS = 1


def overlap_pays(model_bytes: int | None, bucket_mb: float) -> bool:
    """Whether a model of ``model_bytes`` (None: not known before its data loads) spans more
    than OVERLAP_MIN_BUCKETS buckets of ``bucket_mb`` MiB: --overlap can start transfers early."""
    return model_bytes is None or model_bytes > OVERLAP_MIN_BUCKETS * bucket_mb * 2**20


class OverlapSettings(TypedDict):
    """resolve_overlap's answer: the two RunConfig fields as they run."""

    overlap: bool
    progress_thread: bool


def resolve_overlap(
    cfg: RunConfig, nodes: Sequence[int], model_bytes: int | None = None
) -> OverlapSettings:
    """--overlap and --progress-thread as they run. --overlap by default: on for MPI ranks on more
    than
    one node on the CPU, where the step's transfers cross a wire that backward can hide (measured
    faster, docs/overlap.md), for a model of more than one bucket (``overlap_pays``;
    ``model_bytes`` from the task, None where it cannot tell); off on one node, where the transfers
    are copies the ranks make themselves (nothing to hide them behind: measured 0.91-1.07x), on
    GPUs (refused: it hung in its one check), and under --message-deadline.
    --progress-thread: only where MPI overlaps (given on one node, where auto turns --overlap off,
    it has
    nothing to progress)."""
    overlap = cfg.overlap
    if overlap is None and cfg.on_failure == "continue":
        overlap = False  # a healed step is redone whole (docs/membership.md)
    if overlap is None and cfg.message_deadline is not None:
        overlap = False  # a message is late or on time as a whole, not in buckets
    if overlap is None:
        across_nodes = cfg.backend == "mpi" and len(set(nodes)) > 1
        overlap = (
            across_nodes
            and not cfg.device.startswith("cuda")
            and overlap_pays(model_bytes, cfg.bucket_size)
        )
    return {
        "overlap": bool(overlap),
        "progress_thread": bool(cfg.progress_thread and overlap and cfg.backend == "mpi"),
    }


def overlap_notices(asked: RunConfig, resolved: RunConfig) -> tuple[str, ...]:
    """Flags of --overlap given for a run where it resolved off (by default on one node): they do
    nothing."""
    if (
        resolved.overlap or asked.overlap is not None
    ):  # overlapping, or --no-overlap given (the flags are refused then)
        return ()
    why = (
        "--overlap is off in this run (its default on one node, for a model within one "
        "--bucket-size bucket, on --backend local and with --device cuda; pass --overlap to "
        "overlap)"
    )
    given = [
        flag
        for flag, on in (
            ("--progress-thread", asked.progress_thread),
            ("--bucket-size", asked.bucket_size != RunConfig.bucket_size),
            ("--progress-interval", asked.progress_interval != RunConfig.progress_interval),
        )
        if on
    ]
    return (
        (f"{', '.join(given)} do{'es' if len(given) == 1 else ''} nothing: {why}",) if given else ()
    )


def placed_topology(
    name: str, world_size: int, placement: str, nodes: Sequence[int]
) -> tuple[str, Topology]:
    """(the placement used, the topology): --placement resolved over ``nodes``. An "auto" that would
    place by node a topology that cannot be (an edge list, the social network) keeps rank order;
    an explicit "nodes" there is an error (TopologyError)."""
    resolved = resolve_placement(placement, nodes)
    if resolved == "nodes":
        try:
            return resolved, build(name, world_size, placement="nodes", nodes=nodes)
        except TopologyError:
            if placement != "auto":
                raise
            # the rank-order build below says so if the topology is wrong in itself
            resolved = "ranks"
    return resolved, build(name, world_size)


# A default lr is tuned for a task's lr_tuned_workers (16). Measured on digits (each algorithm's
# default lr, 20 epochs, seed 0): with 4 and 8 workers every algorithm reaches 96-99% worst-worker
# accuracy, and all-reduce does with 1 and 2 (98%); with 2, RelaySGD and RelaySGD/Grad (lr 1.6) stay
# at chance, their averaged batch 8x smaller than tuned for; with 32 and 64 RelaySGD/Grad ends at
# 30-45% and the gossip algorithms fall to 70-90%, their graphs mixing slower. So the trainer warns
# only where the count moved that far: more workers than tuned, or fewer than a quarter as many
# (only for more where the algorithm mixes over no graph, as its declared communication says:
# all-reduce is centralized SGD on the mean gradient, isolated workers never mix).
LR_FEWER_WORKERS_FACTOR = 4


def lr_may_not_suit(algo: str, world_size: int, tuned: int) -> bool:
    """Whether a default lr tuned for ``tuned`` workers may not suit ``world_size`` of them."""
    if world_size > tuned:
        return True
    return communication(algo).placed and world_size * LR_FEWER_WORKERS_FACTOR < tuned


def resolve(cfg: RunConfig, world_size: int, nodes: Sequence[int] | None = None) -> Plan:
    """Fill defaults from the task and algorithm, build the topology, check every combination.

    ``nodes``: each rank's node as the Communicator knows it (under MPI: the same list on every
    rank, so every rank builds the same topology); None: one node, or --ranks-per-node's.
    """
    nodes = run_nodes(cfg, world_size, nodes)
    task = get_task_class(cfg.task)
    try:
        get_algorithm_class(cfg.algo)
    except AlgorithmError as exc:
        raise ConfigError(str(exc)) from exc
    defaults = task.defaults
    cfg = _with_data_dirs(cfg)
    topo_name = run_topology(cfg)
    try:
        placement, topology = placed_topology(topo_name, world_size, cfg.placement, nodes)
    except TopologyError as exc:
        where = " and --placement nodes" if cfg.placement == "nodes" else ""
        raise topology_refusal(topo_name, world_size, where, exc) from exc
    asked = cfg
    cfg = replace(cfg, placement=placement)
    lr_warning = None
    tuned = defaults.lr_tuned_workers
    if cfg.lr is None and tuned and lr_may_not_suit(cfg.algo, world_size, tuned):
        more = world_size > tuned
        lr_warning = (
            f"the default lr of {cfg.task}/{cfg.algo} was tuned for {tuned} workers; this "
            f"run has {world_size} ({'more' if more else 'fewer than a quarter as many'}), "
            "so it may not converge (a worker at chance accuracy): pass --lr, e.g. from a "
            "sweep (jobs/sweep_lr.sh)"
        )
    cfg = replace(
        cfg,
        topology=topo_name,
        lr=cfg.lr if cfg.lr is not None else defaults.lr_by_algo.get(cfg.algo, defaults.lr),
        # an algorithm that needs momentum (quasi-global momentum) gets 0.9 where the task's default
        # is 0
        momentum=cfg.momentum
        if cfg.momentum is not None
        else (0.9 if needs_momentum(cfg.algo) and not defaults.momentum else defaults.momentum),
        optimizer=cfg.optimizer or defaults.optimizer,
        weight_decay=cfg.weight_decay if cfg.weight_decay is not None else defaults.weight_decay,
        batch_size=cfg.batch_size or defaults.batch_size,
        warmup_epochs=cfg.warmup_epochs
        if cfg.warmup_epochs is not None
        else defaults.warmup_epochs,
        milestones=cfg.milestones if cfg.milestones is not None else defaults.milestones,
    )
    if cfg.steps is None and cfg.epochs is None:
        cfg = replace(cfg, epochs=defaults.epochs)
    # filled in just above, from the task's defaults where the command line left them unset
    assert cfg.optimizer is not None and cfg.momentum is not None
    assert cfg.weight_decay is not None
    try:
        optimizer = OptimizerConfig(
            name=cfg.optimizer,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    # the algorithm's options as they run, recorded in the run file (relay: the relay_mode that ran)
    cfg = replace(
        cfg, **{k: v for k, v in vars(algorithm_options(cfg)).items() if getattr(cfg, k) is None}
    )
    try:
        settled, problem = task.settle(
            {name: getattr(cfg, name) for name in task.option_names}, world_size
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    cfg = replace(cfg, **settled)
    cfg = replace(cfg, **resolve_overlap(cfg, nodes, task.model_bytes(settled, problem)))
    notices = overlap_notices(asked, cfg)
    options = algorithm_options(cfg)
    try:
        check_combination(cfg.algo, topology, optimizer, options)
    except AlgorithmError as exc:
        raise ConfigError(str(exc)) from exc
    assert cfg.lr is not None  # filled in above
    # validate() refused it for other algorithms
    lr = float(cfg.lr) * (lr_correction(topology) if cfg.relay_lr_correction else 1.0)
    late, skipped, losses = replayed(cfg, world_size)
    return Plan(
        cfg=cfg,
        world_size=world_size,
        topology=topology,
        task=task,
        optimizer=optimizer,
        algorithm_options=options,
        lr=lr,
        drops=DropPolicy(cfg.drop_prob, cfg.seed, late, skipped),
        replayed_losses=tuple(losses),
        task_options=task_options(cfg),
        problem=problem,
        lr_warning=lr_warning,
        notices=notices,
        nodes=nodes,
    )


def _with_data_dirs(cfg: RunConfig) -> RunConfig:
    """--data-dir / --model-dir as absolute paths, defaulting to the task's folders under the data
    root ($RELAYMPI_DATA, else ~/.cache/relaympi), so the run file records where data came from."""
    data_dir, model_dir = task_dirs(cfg.task)
    data_dir = cfg.data_dir or data_dir
    model_dir = cfg.model_dir or model_dir
    return replace(
        cfg,
        data_dir=Path(data_dir).expanduser().absolute() if data_dir else None,
        model_dir=Path(model_dir).expanduser().absolute() if model_dir else None,
    )


def algorithm_options(cfg: RunConfig) -> Options:
    """The run's algorithm's own options from its config (the RunConfig fields of their names)."""
    return ALGORITHM_OPTIONS[cfg.algo].of(cfg.to_dict())


def task_options(cfg: RunConfig) -> TaskOptions:
    """What the run's config tells a task (on --device as given: an engine replaces it by each
    worker's)."""
    return TaskOptions(
        data_dir=cfg.data_dir,
        model_dir=cfg.model_dir,
        seed=cfg.seed,
        eval_batch_size=cfg.eval_batch_size,
        num_loader_workers=TaskOptions.num_loader_workers
        if cfg.loader_workers is None
        else cfg.loader_workers,
        device=cfg.device,
    )


def default_out(cfg: RunConfig, world_size: int) -> Path:
    """results/<task>-<algo>-<topology>[-nodes]-n<N>-a<alpha>-s<seed>.h5: a plain file name directly
    in results/
    (``-nodes``: placed by node, so that it never replaces the same run in rank order)."""
    placed = "-nodes" if cfg.placement == "nodes" else ""
    assert cfg.topology is not None  # a resolved configuration (Plan.cfg)
    topology = _topology_slug(cfg.topology)
    name = f"{cfg.task}-{cfg.algo}-{topology}{placed}-n{world_size}-a{cfg.alpha:g}-s{cfg.seed}.h5"
    return Path("results") / name


def _topology_slug(name: str) -> str:
    """A topology name as part of a file name: an edge list becomes its file's stem and a short
    hash of its content (two different files named chain.txt never share a run file)."""
    prefix, sep, path = name.partition("edge-list:")
    if sep:
        file = Path(path)
        try:
            digest = hashlib.sha256(file.read_bytes()).hexdigest()[:8]
        except OSError:
            digest = hashlib.sha256(path.encode()).hexdigest()[:8]
        name = f"{prefix}edge-list-{file.stem}-{digest}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")
