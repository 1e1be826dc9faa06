"""The paper's sweeps and their grids: each point is the trainer's own ``RunConfig`` and a world
size."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from jobs.settings import JobsError, JobSettings
from relaympi.algorithms import (
    ALGORITHM_NAMES,
    ALGORITHM_OPTIONS,
    default_topology,
    needs_momentum,
)
from relaympi.algorithms.options import option_names
from relaympi.algorithms.registry import DECLARED
from relaympi.config import RunConfig
from relaympi.tasks import TaskError, get_task_class

# The paper runs D-PSGD without momentum only: its momentum variant is qgm. Applies unless
# RELAYMPI_MOMENTA is set.
PAPER_PLAIN_ONLY = ("dpsgd",)
# Algorithms that send no message that can be dropped (as each declares): only their reliable run
# is in a drop grid.
NO_DROPS = tuple(name for name, d in DECLARED.items() if not d.communication.lossy)
# A grid point: the configuration the trainer runs, and its number of workers (MPI ranks, or
# --workers of one process: jobs.commands decides which).
GridPoint = tuple[RunConfig, int]


@dataclass(frozen=True)
class Sweep:
    """A sweep's defaults; every list can be overridden by the RELAYMPI_* variable named in
    jobs/README.md."""

    description: str
    task: str
    algos: tuple[str, ...]  # "algo" or "algo:topology"
    alphas: tuple[float, ...]
    workers: tuple[int, ...]
    momenta: tuple[float | None, ...]  # None: the task's default (no --momentum flag)
    seeds: tuple[int, ...]
    drop_probs: tuple[float, ...] = (0.0,)
    optimizer: str | None = None
    lr_exponents: tuple[int, ...] = ()  # sweep_lr: lr = centre * 2**k
    needs_data: bool = False
    needs_model: bool = False
    time: str = "24:00:00"  # its script's #SBATCH --time (a site's RELAYMPI_TIME wins in submit.sh)


_ALPHA = Sweep(
    "CIFAR-10 accuracy vs data heterogeneity (paper Table 'cifar10-trees'), 16 workers",
    task="cifar10",
    algos=("allreduce", "relay", "dpsgd", "qgm", "d2", "sgp"),
    alphas=(1.0, 0.1, 0.01),
    workers=(16,),
    momenta=(0.0, 0.9),
    seeds=(0, 1, 2),
)
SWEEPS = {
    "sweep_alpha": _ALPHA,
    "sweep_workers": Sweep(
        "CIFAR-10 scaling the number of workers at alpha 0.01 (paper Table 'scaling')",
        task="cifar10",
        algos=("allreduce", "relay", "relay:chain", "sgp"),
        alphas=(0.01,),
        workers=(16, 32, 64),
        momenta=(0.9,),
        seeds=(0, 1, 2),
    ),
    "sweep_lr": replace(  # sweep_alpha's grid, each cell at lr = centre * 2^k
        _ALPHA,
        description="Learning-rate grid search, lr = centre * 2^k "
        "(paper appendix 'Hyper-parameters and tuning')",
        lr_exponents=(-2, -1, 0, 1, 2),
    ),
    "sweep_drop": Sweep(
        "Robustness to dropped messages at alpha 0.01 (paper Table 'robustness')",
        task="cifar10",
        algos=("relay", "qgm", "d2", "sgp"),
        alphas=(0.01,),
        workers=(16,),
        momenta=(0.9,),
        seeds=(0, 1, 2),
        drop_probs=(0.0, 0.01, 0.1),
    ),
    "sweep_imagenet": Sweep(
        "ImageNet / ResNet-20-EvoNorm at alpha 0.1, 16 workers, one seed (paper Table 'imagenet')",
        task="imagenet",
        algos=("allreduce", "relay", "qgm", "d2", "sgp"),
        alphas=(0.1,),
        workers=(16,),
        momenta=(0.9,),
        seeds=(0,),
        needs_data=True,
        time="72:00:00",
    ),
    "sweep_agnews": Sweep(
        "AG News / DistilBERT fine-tuning with Adam at alpha 0.1 (paper Table 'bert')",
        task="agnews",
        algos=("allreduce", "relay:chain", "dpsgd", "qgm", "sgp"),
        alphas=(0.1,),
        workers=(16,),
        momenta=(None,),
        seeds=(0, 1, 2),
        optimizer="adam",
        needs_data=True,
        needs_model=True,
        time="12:00:00",
    ),
}

# The RunConfig fields a run's name and listing show, in their order (world size after optimizer).
_LISTED_BEFORE = ("task", "algo", "topology", "alpha", "lr", "momentum", "optimizer")
_LISTED_AFTER = ("seed", "drop_prob", "relay_mode")
# Settings that are one value for the whole grid: (variable, RunConfig field, type).
_WHOLE_GRID = (
    ("RELAYMPI_EPOCHS", "epochs", float),
    ("RELAYMPI_STEPS", "steps", int),
    ("RELAYMPI_BATCH_SIZE", "batch_size", int),
    ("RELAYMPI_EVAL_EVERY", "eval_every", int),
)


def sweep(name: str) -> Sweep:
    try:
        return SWEEPS[name]
    except KeyError:
        raise JobsError(f"unknown sweep {name!r}; sweeps: {', '.join(SWEEPS)}") from None


def _lr_text(lr: float | None) -> str:
    return "default" if lr is None else f"{lr:.6g}"


def run_name(config: RunConfig, world_size: int) -> str:
    """The run file's stem: every field that varies in some sweep, so names never collide."""
    momentum = "default" if config.momentum is None else f"{config.momentum:g}"
    parts = [
        config.algo,
        config.topology or "default",
        f"alpha{config.alpha:g}",
        f"lr{_lr_text(config.lr)}",
        f"mom{momentum}",
        config.optimizer or "opt-default",
        f"n{world_size}",
        f"drop{config.drop_prob:g}",
        f"seed{config.seed}",
    ]
    if config.relay_mode:
        parts.append(f"relay-{config.relay_mode}")
    return "_".join(parts)


def listed_fields(point: GridPoint) -> dict[str, object]:
    """The grid's fields of a point, as `list` prints them (None: the trainer's default)."""
    config, world_size = point
    return {
        **{name: getattr(config, name) for name in _LISTED_BEFORE},
        "world_size": world_size,
        **{name: getattr(config, name) for name in _LISTED_AFTER},
    }


def _momentum(text: str) -> float | None:
    return None if text.lower() in ("default", "none") else float(text)


def _paper_lr(task: str, algo: str, momentum: float | None, alpha: float) -> float | None:
    """The paper's tuned lr (the task's TaskDefaults.tuned_lr), None where the paper has none."""
    try:
        defaults = get_task_class(task).defaults
    except TaskError:  # quadratics (not a Task), or a typo the trainer's check reports
        return None
    return defaults.tuned_lr_for(algo, momentum, alpha)


def _parse_algo(entry: str, topologies: Mapping[str, str]) -> tuple[str, str | None]:
    """(algorithm, topology): the entry's, else RELAYMPI_TOPOLOGIES', else the algorithm's default
    (None for an unknown algorithm, which the trainer's check reports)."""
    algo, _, topology = entry.partition(":")
    if not algo:
        raise JobsError(f"RELAYMPI_ALGOS: empty algorithm in {entry!r}")
    default = default_topology(algo) if algo in ALGORITHM_NAMES else None
    return algo, topology or topologies.get(algo) or default


def _topology_overrides(settings: JobSettings) -> dict[str, str]:
    overrides = {}
    for item in (settings.get("RELAYMPI_TOPOLOGIES") or "").replace(",", " ").split():
        algo, sep, topology = item.partition("=")
        if not sep or not algo or not topology:
            raise JobsError(f"RELAYMPI_TOPOLOGIES: expecting ALGO=TOPOLOGY items, got {item!r}")
        overrides[algo] = topology
    return overrides


def takes_relay_mode(algo: str) -> bool:
    """Whether ``algo``'s options have --relay-mode (RELAYMPI_RELAY_MODE goes to it alone)."""
    return algo in ALGORITHM_OPTIONS and "relay_mode" in option_names(ALGORITHM_OPTIONS[algo])


def _lrs(
    sweep_name: str,
    settings: JobSettings,
    task: str,
    algo: str,
    momentum: float | None,
    alpha: float,
) -> list[float | None]:
    fixed = settings.number("RELAYMPI_LR", float)
    if sweep_name != "sweep_lr":
        return [fixed if fixed is not None else _paper_lr(task, algo, momentum, alpha)]
    explicit = settings.list("RELAYMPI_LRS", float, ())
    if explicit:
        return list(explicit)
    centre = (
        settings.number("RELAYMPI_LR_CENTER", float)
        or fixed
        or _paper_lr(task, algo, momentum, alpha)
    )
    if centre is None:
        raise JobsError(
            f"sweep_lr: no learning-rate centre for task {task!r}, algo {algo!r}, alpha {alpha:g}: "
            "set RELAYMPI_LR_CENTER (or RELAYMPI_LRS for an explicit list)"
        )
    exponents = sweep(sweep_name).lr_exponents
    kmin = settings.number("RELAYMPI_LR_KMIN", int, min(exponents))
    kmax = settings.number("RELAYMPI_LR_KMAX", int, max(exponents))
    if kmin > kmax:
        raise JobsError(f"RELAYMPI_LR_KMIN={kmin} is larger than RELAYMPI_LR_KMAX={kmax}")
    return [float(f"{centre * 2.0**k:.6g}") for k in range(kmin, kmax + 1)]


def _whole_grid(settings: JobSettings) -> dict[str, Any]:
    """The RunConfig fields every point shares (training length, batch size, evaluation)."""
    if settings.get("RELAYMPI_EPOCHS") and settings.get("RELAYMPI_STEPS"):
        raise JobsError("set RELAYMPI_EPOCHS or RELAYMPI_STEPS, not both")
    return {
        field: settings.number(name, convert)
        for name, field, convert in _WHOLE_GRID
        if settings.get(name)
    }


def configurations(sweep_name: str, settings: JobSettings) -> list[GridPoint]:
    """The sweep's points in array-index order.

    Seeds vary slowest (after world size), so the first part of an array already covers every
    cell of the table with one seed.
    """
    defaults = sweep(sweep_name)
    task = settings.get("RELAYMPI_TASK", defaults.task)
    algos = settings.list("RELAYMPI_ALGOS", str, defaults.algos)
    alphas = settings.list("RELAYMPI_ALPHAS", float, defaults.alphas)
    workers = settings.list("RELAYMPI_WORKERS", int, defaults.workers)
    momenta = settings.list("RELAYMPI_MOMENTA", _momentum, defaults.momenta)
    paper_momenta = settings.get("RELAYMPI_MOMENTA") is None
    seeds = settings.list("RELAYMPI_SEEDS", int, defaults.seeds)
    drops = settings.list("RELAYMPI_DROP_PROBS", float, defaults.drop_probs)
    optimizer = settings.get("RELAYMPI_OPTIMIZER", defaults.optimizer)
    relay_mode = settings.get("RELAYMPI_RELAY_MODE")
    topologies = _topology_overrides(settings)
    shared = _whole_grid(settings)
    for name, values in (
        ("RELAYMPI_WORKERS", workers),
        ("RELAYMPI_ALGOS", algos),
        ("RELAYMPI_SEEDS", seeds),
    ):
        if not values:
            raise JobsError(f"{name} is empty")
    if any(n < 1 for n in workers):
        raise JobsError(f"RELAYMPI_WORKERS must be positive, got {workers}")
    result = []
    for world_size in workers:
        for seed in seeds:
            for entry in algos:
                algo, topology = _parse_algo(entry, topologies)
                for momentum in momenta:
                    if (
                        algo in ALGORITHM_NAMES
                        and needs_momentum(algo)  # quasi-global momentum
                        and momentum == 0
                    ):
                        continue
                    if paper_momenta and algo in PAPER_PLAIN_ONLY and momentum:
                        continue
                    for alpha in alphas:
                        for drop in drops:
                            if drop and algo in NO_DROPS:  # the trainer refuses --drop-prob there
                                continue
                            for lr in _lrs(sweep_name, settings, task, algo, momentum, alpha):
                                config = RunConfig(
                                    task=task,
                                    algo=algo,
                                    topology=topology,
                                    alpha=alpha,
                                    lr=lr,
                                    momentum=momentum,
                                    optimizer=optimizer,
                                    seed=seed,
                                    drop_prob=drop,
                                    # the algorithms whose options have it (RelaySGD's)
                                    relay_mode=relay_mode if takes_relay_mode(algo) else None,
                                    **shared,
                                )
                                result.append((config, world_size))
    return result


# jobs/sweep_*.sh, each the same but for its #SBATCH defaults: written from SWEEPS by
# `python -m jobs.grid scripts` (a test keeps the files equal to it). Under sbatch the script runs
# from a spool copy: it finds the checkout (RELAYMPI_ROOT, its own folder, the submit folder, or
# where SLURM says the script came from) and hands over to jobs/lib.sh.
_SCRIPT = """#!/bin/bash
#SBATCH --job-name=relaympi-{short}
#SBATCH --array=0-{last}
#SBATCH --ntasks={ntasks}
#SBATCH --time={time}
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --open-mode=append
#SBATCH --output={logs}/%x-%A_%a.out
# {description}.{needs}
# Written by `python -m jobs.grid scripts` from jobs/sweeps.py, where the grid lives: edit it there.
# Configurations: DRY_RUN=1 bash jobs/{name}.sh. Submit: bash jobs/submit.sh {name}
# (sizes the array from the grid, applies site settings, logs to RESULTS_DIR/logs/), or plain
# sbatch jobs/{name}.sh from the checkout for the default grid (logs to {logs}/).
# Every setting is a RELAYMPI_* variable (jobs/README.md).
for root in "${{RELAYMPI_ROOT-}}" "$(dirname "${{BASH_SOURCE[0]}}")/.." "${{SLURM_SUBMIT_DIR-}}" \\
    "${{SLURM_SUBMIT_DIR:+$SLURM_SUBMIT_DIR/..}}" ask; do
    # ask: where SLURM says the script came from (an array's last task lists them all)
    [[ "$root" == ask && -n "${{SLURM_JOB_ID-}}" ]] &&
        root="$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null |
            sed -n 's|^ *Command=\\(.*\\)/jobs/[^/]*$|\\1|p' | head -n 1)"
    [[ -n "$root" && -f "$root/jobs/lib.sh" ]] && source "$root/jobs/lib.sh" &&
        relaympi_sweep {name} "$@"
done
echo "cannot find jobs/lib.sh: set RELAYMPI_ROOT to the relaympi checkout" >&2; exit 2
"""
# where a plain `sbatch jobs/sweep_X.sh` (from the checkout) writes its logs: relative to the submit
# folder, and the checkout keeps the folder (SLURM does not create it)
SBATCH_LOGS = "results/logs"


def sweep_script(name: str) -> str:
    """jobs/NAME.sh: the sweep's #SBATCH defaults (its default grid's array, its largest world
    size's --ntasks, its time) and the hand-over to jobs/lib.sh."""
    defaults = sweep(name)
    count = len(configurations(name, JobSettings({})))
    needs = " and pretrained model" if defaults.needs_model else ""
    needs = f"\n# Its data set{needs}: python -m relaympi.data fetch" if defaults.needs_data else ""
    return _SCRIPT.format(
        name=name,
        short=name.removeprefix("sweep_"),
        last=count - 1,
        ntasks=max(defaults.workers),
        time=defaults.time,
        logs=SBATCH_LOGS,
        description=defaults.description,
        needs=needs,
    )
