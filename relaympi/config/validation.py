"""validate(): the checks of a RunConfig that need no topology or data; a failure is a ConfigError
naming the flag (the CLI exits 2)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relaympi.algorithms.options import option_names
from relaympi.algorithms.registry import ALGORITHM_NAMES, AlgorithmOptions, default_topology
from relaympi.config.applies import not_applicable
from relaympi.config.flags import ConfigError
from relaympi.config.run_config import AUTOCAST_DTYPES, BACKENDS, MAX_SEED, PLACEMENTS, RunConfig
from relaympi.drops import DropPolicy
from relaympi.optim_config import OptimizerConfig
from relaympi.tasks import TASK_NAMES
from relaympi.tasks.defaults import default_topology_for
from relaympi.tasks.quadratics import QuadraticsSpec
from relaympi.topology import TOPOLOGY_NAMES, TopologyError, build


def _positive(name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    bad = (value < 0) if allow_zero else (value <= 0)
    if bad or not math.isfinite(value):
        finite = " and finite" if math.isinf(value) else ""
        raise ConfigError(
            f"--{name.replace('_', '-')} must be "
            f"{'>= 0' if allow_zero else '> 0'}{finite}, got {value}"
        )


def _checked(make: Callable[[], Any], flags: dict[str, str]) -> None:
    """Build a domain object (it checks its own values); its ValueError becomes a usage error naming
    the flag:
    the message's first mention of each field (``flags``: the word in the message -> its flag)
    becomes the flag."""
    try:
        make()
    except ValueError as exc:
        message = str(exc)
        for word, flag in flags.items():
            message = re.sub(rf"(?<![\w-]){re.escape(word)}(?![\w-])", flag, message, count=1)
        if not any(flag in message for flag in flags.values()):
            message = f"{' / '.join(flags.values())}: {message}"
        raise ConfigError(message) from None


def validate(cfg: RunConfig) -> None:
    """Checks that need no topology or data; the CLI turns failures into exit status 2.

    The domain classes (OptimizerConfig, DropPolicy, the algorithms' options, QuadraticsSpec) check
    their own values.
    """
    if cfg.task not in TASK_NAMES:
        raise ConfigError(f"unknown task {cfg.task!r}; choose one of {', '.join(TASK_NAMES)}")
    if cfg.algo not in ALGORITHM_NAMES:
        raise ConfigError(
            f"unknown algorithm {cfg.algo!r}; choose one of {', '.join(ALGORITHM_NAMES)}"
        )
    if cfg.topology is not None:
        base = cfg.topology.split(":", 1)[0]
        if cfg.topology not in TOPOLOGY_NAMES and base not in ("spanning-tree", "edge-list"):
            close = difflib.get_close_matches(cfg.topology.replace("_", "-"), TOPOLOGY_NAMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown topology {cfg.topology!r}{hint}; choose one of "
                f"{', '.join(TOPOLOGY_NAMES)}, spanning-tree:<name> or edge-list:<file>"
            )
    if cfg.placement not in PLACEMENTS:
        raise ConfigError(
            f"unknown --placement {cfg.placement!r}; choose one of {', '.join(PLACEMENTS)}"
        )
    if cfg.ranks_per_node is not None and cfg.ranks_per_node < 1:
        raise ConfigError(
            f"--ranks-per-node must be >= 1 (ranks on each emulated node), got {cfg.ranks_per_node}"
        )
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(
            f"--seed must be an integer in [0, {MAX_SEED}] (2^63 - 1), got {cfg.seed}"
        )
    if not cfg.alpha > 0:
        raise ConfigError(
            "--alpha must be > 0 (Dirichlet concentration; smaller = more "
            f"heterogeneous), got {cfg.alpha}"
        )
    _positive("lr", cfg.lr)
    _positive("bucket_size", cfg.bucket_size)
    _positive("progress_interval", cfg.progress_interval)
    _positive("peer_timeout", cfg.peer_timeout)
    given: dict[str, Any] = {"name": cfg.optimizer, "momentum": cfg.momentum}
    _checked(
        lambda: OptimizerConfig(**{k: v for k, v in given.items() if v is not None}),
        {"momentum": "--momentum", "optimizer": "--optimizer"},
    )
    _positive("weight_decay", cfg.weight_decay, allow_zero=True)
    if cfg.batch_size is not None and cfg.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.epochs is not None and cfg.steps is not None:
        raise ConfigError("give either --epochs or --steps, not both")
    _positive("epochs", cfg.epochs)
    _positive("warmup_epochs", cfg.warmup_epochs, allow_zero=True)
    if cfg.steps is not None and cfg.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.task == "quadratics" and cfg.steps is None:
        raise ConfigError("quadratics runs need --steps (there is no data set, so no epochs)")
    _checked(lambda: DropPolicy(cfg.drop_prob, cfg.seed), {"drop probability": "--drop-prob"})
    # NaN and infinity fail too
    if cfg.message_deadline is not None and not 0 < cfg.message_deadline < math.inf:
        raise ConfigError(
            f"--message-deadline must be a positive number of seconds, got {cfg.message_deadline}"
        )
    if cfg.replay_drops is not None and not Path(cfg.replay_drops).is_file():
        raise ConfigError(f"--replay-drops {cfg.replay_drops} does not exist")
    for milestone in cfg.milestones or ():
        _positive("milestones", milestone, allow_zero=True)
    # every algorithm's options check their values (a value for another algorithm is refused below)
    _checked(
        lambda: AlgorithmOptions.of(cfg.to_dict()),
        {name: _flag(name) for name in option_names(AlgorithmOptions)},
    )
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"unknown --backend {cfg.backend!r}; choose one of {', '.join(BACKENDS)}")
    if cfg.autocast is not None and cfg.autocast not in AUTOCAST_DTYPES:
        raise ConfigError(
            f"unknown --autocast {cfg.autocast!r}; choose one of "
            f"{', '.join(AUTOCAST_DTYPES)} (or leave it out: float32)"
        )
    if cfg.backend in ("local", "batched"):
        if cfg.workers is None or cfg.workers < 1:
            raise ConfigError(
                f"--backend {cfg.backend} needs --workers N with N >= 1, got {cfg.workers}"
            )
    elif cfg.workers is not None:
        raise ConfigError(
            "--workers is for --backend local or batched; under mpirun/srun the world "
            "size is the number of ranks"
        )
    for name in ("eval_every", "checkpoint_every"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if cfg.out is not None:
        check_out_path(cfg.out)
    if cfg.checkpoint_dir is not None:
        _check_writable_dir("--checkpoint-dir", Path(cfg.checkpoint_dir))
    if cfg.data_dir is not None and not Path(cfg.data_dir).is_dir():
        raise ConfigError(f"--data-dir {cfg.data_dir} is not a readable directory")
    if cfg.problem_file is not None and not Path(cfg.problem_file).is_file():
        raise ConfigError(f"--problem-file {cfg.problem_file} does not exist")
    if cfg.task == "quadratics":
        names = [f.name for f in dataclasses.fields(QuadraticsSpec)]
        _checked(
            lambda: QuadraticsSpec(
                **{k: getattr(cfg, k) for k in names if getattr(cfg, k) is not None}
            ),
            {k: _flag(k) for k in names},
        )
    bad = not_applicable(cfg)
    if bad:
        raise ConfigError("; ".join(f"{flag} cannot apply: {reason}" for flag, reason in bad))
    _check_inputs_not_outputs(cfg)
    if cfg.save_problem is not None:
        _check_writable_file("--save-problem", Path(cfg.save_problem), cfg.overwrite)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(cfg.device)):
        raise ConfigError(
            f"--device {cfg.device!r} is not a device relaympi runs on; choose cpu, cuda "
            "(local rank picks the GPU) or cuda:N"
        )
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {cfg.threads}")


def check_out_path(out: str | Path) -> None:
    """Refuse (ConfigError) an --out that cannot become a run file: its folder missing or not
    writable, a folder itself, or a name without .h5. Torch-free, as this module's top: the
    trainer calls it before it loads torch.

    Args:
        out: --out as given.

    Raises:
        ConfigError: the one line that says what is wrong and what to give instead.
    """
    parent = Path(out).resolve().parent
    if not parent.is_dir():
        raise ConfigError(
            f"output directory {parent} does not exist (for --out {out}); create it first"
        )
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"output directory {parent} is not writable (for --out {out})")
    if Path(out).is_dir():
        raise ConfigError(
            f"--out {out} is a directory; give a file path such as {Path(out) / 'run.h5'}"
        )
    if Path(out).suffix != ".h5":  # the report and the sweeps find run files as *.h5
        raise ConfigError(
            f"--out {out} must end in .h5 (a run file is HDF5, and the report reads "
            f"*.h5 files), such as {Path(out).with_suffix('.h5')}"
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_writable_dir(flag: str, path: Path) -> None:
    """A directory the run creates (with its parents) or writes into: refused up front where it
    cannot."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} exists and is not a directory")
    existing = path.absolute()
    # the nearest existing ancestor is where mkdir would create the rest
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag} {path}: {existing} is not writable (a read-only file system or no "
            "permission); choose a writable directory"
        )


def _check_writable_file(flag: str, path: Path, overwrite: bool) -> None:
    """A file the run may write: its directory must exist and take a new file; an existing file
    is only replaced with --overwrite (the run keeps it as it is when it holds the same content)."""
    parent = path.absolute().parent
    if path.is_dir():
        raise ConfigError(
            f"{flag} {path} is a directory; give a file path such as {path / 'problem.h5'}"
        )
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: its directory {parent} does not exist; create it first")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag} {path}: its directory {parent} is not writable (a read-only file "
            "system or no permission)"
        )
    if path.exists() and overwrite and not os.access(path, os.W_OK):
        raise ConfigError(
            f"{flag} {path} cannot be replaced (--overwrite): the file is not writable (a "
            "read-only file system or no permission)"
        )


def _check_inputs_not_outputs(cfg: RunConfig) -> None:
    """A file read by the run (--problem-file) is never written, and two outputs never share a
    file."""
    named = [
        (n, Path(v).resolve())
        for n in ("problem_file", "replay_drops", "save_problem", "out")
        if (v := getattr(cfg, n)) is not None
    ]
    for i, (a, path_a) in enumerate(named):
        for b, path_b in named[i + 1 :]:
            if path_a == path_b:
                what = (
                    "the run would overwrite its input"
                    if a in ("problem_file", "replay_drops")
                    else "two outputs would share one file"
                )
                raise ConfigError(
                    f"{_flag(a)} and {_flag(b)} are the same file {getattr(cfg, a)}: "
                    f"{what}; choose another {_flag(b)}"
                )


def run_topology(cfg: RunConfig) -> str:
    """The topology a run uses: --topology, else its task's for its algorithm, else its
    algorithm's default (torch-free).

    Args:
        cfg: the run's configuration (its task and algorithm known).

    Returns:
        A topology name, as ``relaympi.topology.build`` takes it.
    """
    return cfg.topology or default_topology_for(cfg.task, cfg.algo) or default_topology(cfg.algo)


def topology_refusal(name: str, world_size: int, where: str, exc: TopologyError) -> ConfigError:
    """The usage error of a topology that cannot be built for the run's worker count.

    Args:
        name: the run's topology.
        world_size: its worker count.
        where: what else shaped it, as words after the count (" and --placement nodes"), or "".
        exc: why the topology refused.

    Returns:
        The one-line error to raise.
    """
    hint = "; one worker is the centralized baseline: --algo allreduce" if world_size == 1 else ""
    return ConfigError(f"topology {name!r} with {world_size} workers{where}: {exc}{hint}")


def check_world_size(cfg: RunConfig, world_size: int) -> None:
    """Refuse (ConfigError) a run whose topology cannot be built for ``world_size`` workers (SGP's
    exponential schedule on 6, say) before torch loads: under mpirun every rank would import it
    first, and the plan would only then find the count wrong. A run with --checkpoint-dir is left
    to the plan: it may resume the survivors of a larger run on their first count's topology.

    Args:
        cfg: the run's configuration.
        world_size: its worker count (--workers, or the ranks the launcher started).

    Raises:
        ConfigError: the topology refuses the count; the same line the plan would give.
    """
    if cfg.checkpoint_dir is not None:
        return
    name = run_topology(cfg)
    try:
        build(name, world_size)
    except TopologyError as exc:
        raise topology_refusal(name, world_size, "", exc) from None
