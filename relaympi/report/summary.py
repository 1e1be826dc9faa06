"""One finished run reduced to what the report's tables need, by the paper's metric
(`ReportSettings`, `summarize`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relaympi.algorithms.registry import DECLARED
from relaympi.config import experiment_settings
from relaympi.costs import COST_DATASETS, StepCosts, hardware, member_step_costs
from relaympi.results import (
    PROBLEM_DIGEST_ATTR,
    Run,
    change_text,
    readmitted_at,
    unstable_loss,
    workers_at_chance,
)
from relaympi.results.schema import QUADRATICS_CONVENTION_ATTR
from relaympi.tasks.quadratics import CONVENTION

# each algorithm's label, in the registry's order (its declaration)
ALGO_NAMES = {name: declared.label for name, declared in DECLARED.items()}
ALGO_ORDER = {name: i for i, name in enumerate(ALGO_NAMES)}
# The paper's reported metric per task (appendix "Detailed experimental setup").
TASK_METRICS = {
    "cifar10": "worst",
    "digits": "worst",
    "imagenet": "mean",
    "agnews": "mean",
    "ag_news": "mean",
}
METRIC_TEXT = {
    "worst": "the worst worker's mean test accuracy over the last {w:g} epochs",
    "mean": "the mean over workers of each worker's mean test accuracy over the last {w:g} epochs",
}
QUADRATIC_TASKS = ("quadratics", "quadratic")
# Quadratics problem constants (paper appendix "Random quadratics"): each setting gets its
# own table.
QUADRATIC_KEYS = ("dim", "mu", "L", "zeta2", "sigma2", "r0")
# A run on a problem file records only these of them (the file's); the others make a problem
QUADRATIC_FILE_KEYS = ("dim", "sigma2")
# all the report reads: the accuracy tables', then the cost tables'
DATASETS = tuple(
    dict.fromkeys(("step", "epoch", "test_accuracy", "suboptimality", "train_loss", *COST_DATASETS))
)


@dataclass(frozen=True)
class ReportSettings:
    """How the report computes its numbers (the command line's --last-epochs, --metric, --target,
    --split-by,
    --target-accuracy)."""

    last_epochs: float = 5.0
    metric: str = "auto"  # auto | worst | mean
    target: float = 1e-6  # quadratics: suboptimality to reach
    split_by: tuple[str, ...] = ()  # extra config keys that separate tables
    target_accuracy: float | None = (
        None  # cost tables: the accuracy to reach (None: the family's rule)
    )

    def metric_for(self, task: str, config: dict[str, Any]) -> str:
        if self.metric != "auto":
            return self.metric
        if config.get("metric") in METRIC_TEXT:
            return str(config["metric"])
        return TASK_METRICS.get(task, "worst")


@dataclass(frozen=True)
class Curve:
    """Per-evaluation worst / mean / best worker test accuracy of one run."""

    epoch: np.ndarray
    worst: np.ndarray
    mean: np.ndarray
    best: np.ndarray
    changes: tuple[float, ...] = ()  # the epochs of the run's membership changes (lost workers)


@dataclass(frozen=True)
class RunSummary:
    """What the tables need from one finished (completed or diverged) run."""

    path: Path
    status: str
    task: str
    algo: str
    topology: str
    alpha: float | None
    lr: float | None
    momentum: float
    optimizer: str
    world_size: int
    seed: int | None
    drop_prob: float
    relay_mode: str | None
    extra: tuple[tuple[str, str], ...]
    # every other setting of the experiment (relaympi.config.experiment_settings), as text
    settings: tuple[tuple[str, str], ...] = ()
    metric_name: str | None = None  # worst | mean, for classification runs
    metric: float = math.nan  # in [0, 1]; NaN when diverged or without accuracy
    final_epoch: float = math.nan
    diverged_epoch: float | None = None
    steps_to_target: int | None = None  # quadratics: first step with suboptimality <= target
    curve: Curve | None = None
    at_chance: tuple[int, ...] = ()  # workers whose metric window ends at chance accuracy
    unstable: tuple[float, float] | None = (
        None  # (first, final) mean train loss of an unstable run (relaympi.results.UNSTABLE_RULE)
    )
    # the cost tables' inputs (relaympi.costs): per-step costs, wall time per evaluation, the
    # per-worker batch size, and the hardware and launch shape (sorted (key, value) pairs)
    costs: StepCosts | None = None
    time_s: np.ndarray | None = None
    batch_size: int | None = None
    hardware: tuple[tuple[str, Any], ...] = ()
    # where the topology put the ranks (the resolved --placement; files from before it: rank order)
    placement: str = "ranks"
    # quadratics: the problem's digest (relaympi.results.PROBLEM_DIGEST_ATTR; None: not recorded)
    problem: str | None = None
    # a run that lost workers (membership changes): (workers that finished, workers at the
    # start); its metric is over those that finished. None: no change.
    finished: tuple[int, int] | None = None
    # its membership changes: (epoch of the change's step, the change in words), in order
    changes: tuple[tuple[float, str], ...] = ()
    # the original ids of the workers a rerun re-admitted after they were lost (sorted; those
    # that finished are in its metric); () without re-admissions
    readmitted: tuple[int, ...] = ()

    @property
    def converged(self) -> bool:
        return self.status == "completed" and math.isfinite(self.metric)

    @property
    def is_quadratic(self) -> bool:
        return self.task in QUADRATIC_TASKS

    @property
    def identity(self) -> tuple:
        """Everything that makes two runs the same experiment (duplicates share it)."""
        return (
            self.task,
            self.row_key,
            self.alpha,
            self.lr,
            self.world_size,
            self.seed,
            self.drop_prob,
            self.extra,
            self.problem,
        )

    @property
    def row_key(self) -> tuple:
        return (
            ALGO_ORDER.get(self.algo, len(ALGO_ORDER)),
            self.algo,
            self.topology,
            self.optimizer,
            self.momentum,
            self.relay_mode or "",
            self.settings,
        )


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _float(value: Any, default: float | None = None) -> float | None:
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _relay_mode(config: dict[str, Any]) -> str | None:
    """RelaySGD's normalization when it is not Algorithm 1's counts (other algorithms: None)."""
    mode = config.get("relay_mode")
    if config.get("algo") != "relay" or mode in (None, "counts"):
        return None
    return str(mode)


def _value_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True)
    return str(value)


# settings with their own field in RunSummary (or in its table family): not repeated in `settings`
_OWN_FIELDS = (
    "task",
    "algo",
    "topology",
    "alpha",
    "lr",
    "momentum",
    "optimizer",
    "seed",
    "drop_prob",
    "relay_mode",
)


def _settings(config: dict[str, Any], extra_keys: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """The experiment's settings beyond the summary's own fields, so no two experiments merge."""
    settings = experiment_settings(config)
    skip = {*_OWN_FIELDS, *extra_keys}
    return tuple((k, _value_text(v)) for k, v in sorted(settings.items()) if k not in skip)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def worker_means(epoch: np.ndarray, accuracy: np.ndarray, last_epochs: float) -> np.ndarray:
    """Each worker's mean test accuracy over the evaluations of the last ``last_epochs`` epochs.

    The window holds the evaluations with final_epoch - last_epochs < epoch (final_epoch: the
    last evaluation's epoch) and epoch > 0, so an evaluation of the initial model never counts;
    a run shorter than the window uses all its evaluations after epoch 0, and a run with
    no such evaluation uses its last one. NaN evaluations are ignored.
    """
    accuracy = accuracy.reshape(len(accuracy), -1)
    final = np.nanmax(epoch)
    window = (epoch > final - last_epochs) & (epoch > 0)
    if not window.any():
        window = np.zeros(len(epoch), dtype=bool)
        window[-1] = True
    selected = accuracy[window]
    with np.errstate(invalid="ignore"), _quiet():
        return np.nanmean(selected, axis=0)


class _quiet:
    """Silence numpy's 'mean of empty slice' warnings (NaN is the intended answer)."""

    def __enter__(self) -> None:
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc: Any) -> None:
        self._catch.__exit__(*exc)


def paper_metric(epoch: np.ndarray, accuracy: np.ndarray, metric: str, last_epochs: float) -> float:
    means = worker_means(epoch, accuracy, last_epochs)
    if not np.isfinite(means).any():
        return math.nan
    return float(np.nanmin(means) if metric == "worst" else np.nanmean(means))


def steps_to_target(step: np.ndarray, suboptimality: np.ndarray, target: float) -> int | None:
    values = suboptimality.reshape(len(suboptimality), -1)
    with _quiet():
        worst = np.nanmax(values, axis=1) if values.shape[1] > 1 else values[:, 0]
    reached = np.flatnonzero(worst <= target)
    return int(step[reached[0]]) if len(reached) else None


def _epoch_at(data: Mapping[str, np.ndarray], step: int) -> float:
    """The epoch of ``step``, from the rows' step and epoch (interpolated between evaluations);
    NaN where the run recorded no epochs."""
    if "step" not in data or "epoch" not in data or not len(data["step"]):
        return math.nan
    return float(np.interp(step, data["step"], data["epoch"]))


def _problem_digest(run: Run) -> str | None:
    digest = run.attrs.get(PROBLEM_DIGEST_ATTR)
    return str(digest) if digest and str(run.config.get("task")) in QUADRATIC_TASKS else None


def generated_problems(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """The quadratics problems that runs generated: digest -> the constants they were made with
    (QUADRATIC_KEYS), for the runs that read the same problem from a problem file."""
    made: dict[str, dict[str, Any]] = {}
    for run in runs:
        digest = _problem_digest(run)
        if digest is not None and run.config.get("problem_file") is None:
            made.setdefault(digest, {k: run.config.get(k) for k in QUADRATIC_KEYS})
    return made


def _problem_keys(
    config: dict[str, Any], digest: str | None, generated: Mapping[str, dict[str, Any]]
) -> tuple[tuple[str, str], ...]:
    """What tells a quadratics run's problems apart (its table): the constants of a generated
    problem (the seed and the number of workers pick the instance); for a run on a problem file,
    those of the run that generated that very problem, else the problem's digest."""
    if config.get("problem_file") is not None and digest is not None:
        if digest in generated:
            config = generated[digest]
        else:
            return (
                ("problem", digest[:12]),
                *((k, _value_text(config.get(k))) for k in QUADRATIC_FILE_KEYS),
            )
    return tuple(
        (k, _value_text(config.get(k))) for k in QUADRATIC_KEYS if config.get(k) is not None
    )


def _check_convention(run: Run) -> None:
    """Refuse a quadratics run whose numbers are in another loss than CONVENTION's: one from
    before the run file recorded it had f_i = 1/2 ||A_i x - b_i||^2, so its suboptimality, its
    zeta2 and its learning rate would not compare with today's runs."""
    convention = run.attrs.get(QUADRATICS_CONVENTION_ATTR)
    if convention != CONVENTION:
        stated = (
            "none recorded: the older 1/2 ||A_i x - b_i||^2" if convention is None else convention
        )
        raise ValueError(
            f"quadratics run in another loss ({str(stated)[:100]}), not {CONVENTION!r}; "
            "rerun it with this relaympi"
        )


def summarize(
    run: Run,
    settings: ReportSettings,
    generated: Mapping[str, dict[str, Any]] | None = None,
) -> RunSummary:
    """Reduce a completed or diverged run to the numbers the tables need. ``generated``: the
    quadratics problems the report's runs generated (``generated_problems``), so a run that read
    one of them from a file lands in the same table."""
    config = run.config
    task = str(config.get("task", "unknown"))
    world_size = int(config.get("world_size") or run.attrs.get("world_size", 0))
    keys = settings.split_by
    digest = _problem_digest(run)
    extra = tuple((key, _value_text(config.get(key))) for key in keys)
    own_keys: tuple[str, ...] = keys
    if task in QUADRATIC_TASKS:
        _check_convention(run)
        extra = (*_problem_keys(config, digest, generated or {}), *extra)
        own_keys = (*QUADRATIC_KEYS, *keys)
        if digest is not None:  # the problem itself tells it apart, not the file's path
            own_keys = (*own_keys, "problem_file")
    diverged_epoch = _float(run.attrs.get("diverged_epoch")) if run.status == "diverged" else None
    summary: dict[str, Any] = dict(
        path=run.path,
        status=run.status,
        task=task,
        algo=str(config.get("algo", "unknown")),
        topology=str(config.get("topology") or "default"),
        alpha=_float(config.get("alpha")),
        lr=_float(config.get("lr")),
        momentum=_float(config.get("momentum"), 0.0) or 0.0,
        optimizer=str(config.get("optimizer") or "sgd"),
        world_size=world_size,
        seed=None if config.get("seed") is None else int(config["seed"]),
        # a drop probability that cannot apply (allreduce's collective drops nothing) is a
        # reliable run
        drop_prob=_float(experiment_settings(config).get("drop_prob"), 0.0) or 0.0,
        relay_mode=_relay_mode(config),
        extra=extra,
        settings=_settings(config, own_keys),
        diverged_epoch=diverged_epoch,
        placement=str(config.get("placement") or "ranks"),
        problem=digest,
    )
    data = run.data
    finished = run.finished_workers if run.membership else None
    costs = member_step_costs(data, run.world_size, run.membership)
    summary["costs"] = costs
    summary["time_s"] = data.get("time_s")
    summary["batch_size"] = _int(config.get("batch_size"))
    summary["hardware"] = tuple(
        sorted((k, _hashable(v)) for k, v in hardware(run.provenance, world_size).items())
    )
    if "train_loss" in data:
        summary["unstable"] = unstable_loss(
            data["train_loss"], run.present() if run.membership else None
        )
    epoch = data.get("epoch")
    if finished is not None:
        summary["finished"] = (len(finished), run.world_size)
        summary["changes"] = tuple(
            (_epoch_at(data, int(change["step"])), change_text(change)) for change in run.membership
        )
        summary["readmitted"] = tuple(sorted(readmitted_at(run.membership)))
    if epoch is not None and len(epoch):
        summary["final_epoch"] = float(np.nanmax(epoch))
        if run.status == "diverged" and diverged_epoch is None:
            summary["diverged_epoch"] = summary["final_epoch"]
    accuracy = data.get("test_accuracy")
    if task not in QUADRATIC_TASKS and accuracy is not None and epoch is not None and len(epoch):
        metric_name = settings.metric_for(task, config)
        summary["metric_name"] = metric_name
        if run.status == "completed":
            # with membership changes: over the workers that finished (a lost worker's window
            # may hold its evaluations before the change)
            kept = accuracy.reshape(len(accuracy), -1)
            if finished is not None:
                kept = kept[:, finished]
            summary["metric"] = paper_metric(epoch, kept, metric_name, settings.last_epochs)
            means = worker_means(epoch, kept, settings.last_epochs)
            chance = workers_at_chance(means, _int(run.attrs.get("num_classes")))
            summary["at_chance"] = tuple(finished[w] if finished is not None else w for w in chance)
        per_eval = accuracy.reshape(len(accuracy), -1)
        with _quiet():
            summary["curve"] = Curve(
                epoch.copy(),
                np.nanmin(per_eval, axis=1),
                np.nanmean(per_eval, axis=1),
                np.nanmax(per_eval, axis=1),
                tuple(epoch_ for epoch_, _ in summary.get("changes", ())),
            )
    suboptimality = data.get("suboptimality")
    if suboptimality is not None and "step" in data and len(suboptimality):
        summary["steps_to_target"] = steps_to_target(data["step"], suboptimality, settings.target)
    return RunSummary(**summary)
