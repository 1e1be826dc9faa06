"""Typed, validated run configuration and the command line of `python -m relaympi.train`."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaympi.entrypoint import UsageParser
from relaympi.tasks.quadratics import QuadraticsSpec
from relaympi.topology import TOPOLOGY_NAMES

BACKENDS = ("mpi", "local", "batched")
AUTOCAST_DTYPES = ("bf16",)  # --autocast: the batched engine's forward and backward in this dtype
MAX_SEED = 2**63 - 1  # torch.manual_seed and numpy take any seed up to here (--seed 2^64 overflows torch)


# keys a run file's `config` attribute holds besides the flags (derived at run time)
_RUN_FILE_ONLY_KEYS = ("world_size", "lr_effective", "total_steps")

# Config keys that cannot change a run's numbers: where files go, how the work is spread over
# processes, threads and devices, logging and bookkeeping. Every other key is part of the
# experiment's identity (the report never merges two runs that differ in one of them).
# relay_in_place: the same RelaySum messages assembled in other buffers (tested identical).
NON_SEMANTIC_KEYS = frozenset({
    "out", "overwrite", "checkpoint_dir", "checkpoint_every", "save_problem", "record_params",
    "log_every", "threads", "loader_workers", "eval_batch_size", "data_dir", "model_dir",
    "backend", "workers", "device", "relay_in_place", "relay_chunk",
})
# Keys that only matter for some runs (elsewhere they hold an unused default).
_APPLIES: dict[str, Any] = {
    "relay_mode": lambda c: c.get("algo") == "relay",
    "relay_lr_correction": lambda c: c.get("algo") == "relay",
    "d2_force": lambda c: c.get("algo") == "d2",
    "d2_exact_diffusion": lambda c: c.get("algo") == "d2",
    "nesterov": lambda c: bool(c.get("momentum")) and c.get("optimizer", "sgd") == "sgd",
    "drop_prob": lambda c: c.get("algo") != "allreduce",  # a collective: no message is ever dropped
    **{k: (lambda c: c.get("task") == "quadratics") for k in ("problem_file", "dim", "mu", "L", "zeta2", "r0", "sigma2")},
}


def experiment_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that define a run's experiment (seed included), from a run file's config.

    Missing keys (older files) take RunConfig's defaults; keys that cannot apply to the run's
    algorithm or task are dropped, so `--relay-mode counts` on dpsgd is the same experiment as none.
    """
    defaults = RunConfig().to_dict()
    merged = {**defaults, **config}
    return {
        key: value
        for key, value in merged.items()
        if key not in NON_SEMANTIC_KEYS and key not in _RUN_FILE_ONLY_KEYS and _APPLIES.get(key, lambda c: True)(merged)
    }


def run_file_config_keys() -> tuple[str, ...]:
    """Every key of a run file's `config` attribute: RunConfig's fields and the values derived at run time."""
    return (*(f.name for f in dataclasses.fields(RunConfig) if f.name != "extra"), *_RUN_FILE_ONLY_KEYS)


class ConfigError(ValueError):
    """A bad flag value or combination; the CLI exits with status 2."""


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run. ``None`` means "the task's default" until resolve()."""

    task: str = "digits"
    algo: str = "relay"
    topology: str | None = None
    alpha: float = 1.0  # Dirichlet heterogeneity (smaller = more heterogeneous)
    lr: float | None = None  # per worker and step, before warm-up/decay
    momentum: float | None = None
    nesterov: bool = True
    optimizer: str | None = None
    weight_decay: float | None = None
    batch_size: int | None = None  # samples per worker per step
    epochs: float | None = None
    steps: int | None = None
    warmup_epochs: float | None = None
    milestones: tuple[float, ...] | None = None  # epochs at which the lr is divided by 10
    seed: int = 0
    drop_prob: float = 0.0
    relay_mode: str | None = None  # --algo relay only: "counts" (Algorithm 1) unless given
    relay_in_place: bool = False  # RelaySum swaps messages in its receive buffers (least memory)
    relay_chunk: int | None = None  # RelaySum message chunk in elements (None: RelaySum's DEFAULT_CHUNK, 2^20)
    relay_lr_correction: bool = False  # scale lr by RelaySGD's topology correction 1/(alpha n)
    d2_force: bool = False
    d2_exact_diffusion: bool = False
    eval_every: int | None = None  # steps between evaluations (default: every task eval epoch)
    checkpoint_every: int | None = None  # steps between periodic checkpoints (default: every eval)
    backend: str = "mpi"
    workers: int | None = None  # in-process backend only
    autocast: str | None = None  # batched backend only: "bf16" runs its forward and backward under torch.autocast
    out: Path | None = None
    overwrite: bool = False
    checkpoint_dir: Path | None = None
    data_dir: Path | None = None
    model_dir: Path | None = None
    device: str = "cpu"
    threads: int | None = None  # torch intra-op threads per worker
    loader_workers: int | None = None  # --task imagenet only (None: TaskOptions' default, 2)
    eval_batch_size: int = 256
    log_every: int = 0  # steps between progress log lines (0: only at evaluations)
    # quadratics
    problem_file: Path | None = None
    save_problem: Path | None = None
    record_params: bool = False
    # generated problem (QuadraticsSpec's defaults unless given); with --problem-file the run
    # records the file's dim and sigma2, and None for the generation-only mu, L, zeta2, r0
    dim: int | None = None
    mu: float | None = None
    L: float | None = None
    zeta2: float | None = None
    r0: float | None = None
    sigma2: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; allowed: {sorted(names)}")
        kwargs = dict(data)
        for key in ("out", "checkpoint_dir", "data_dir", "model_dir", "problem_file", "save_problem"):
            if kwargs.get(key) is not None:
                kwargs[key] = Path(kwargs[key])
        if kwargs.get("milestones") is not None:
            kwargs["milestones"] = tuple(float(m) for m in kwargs["milestones"])
        return cls(**kwargs)


def _positive(name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    bad = (value < 0) if allow_zero else (value <= 0)
    if bad or not math.isfinite(value):
        finite = " and finite" if math.isinf(value) else ""
        raise ConfigError(f"--{name.replace('_', '-')} must be {'>= 0' if allow_zero else '> 0'}{finite}, got {value}")


def validate(cfg: RunConfig) -> None:
    """Checks that need no topology or data; the CLI turns failures into exit status 2."""
    # imported here, not at the top: the report reads run configs (experiment_settings) without torch
    from relaympi.algorithms import ALGORITHM_NAMES, RELAY_MODES
    from relaympi.optim import OPTIMIZERS
    from relaympi.tasks import TASK_NAMES

    if cfg.task not in TASK_NAMES:
        raise ConfigError(f"unknown task {cfg.task!r}; choose one of {', '.join(TASK_NAMES)}")
    if cfg.algo not in ALGORITHM_NAMES:
        raise ConfigError(f"unknown algorithm {cfg.algo!r}; choose one of {', '.join(ALGORITHM_NAMES)}")
    if cfg.topology is not None:

        base = cfg.topology.split(":", 1)[0]
        if cfg.topology not in TOPOLOGY_NAMES and base not in ("spanning-tree", "edge-list"):
            close = difflib.get_close_matches(cfg.topology.replace("_", "-"), TOPOLOGY_NAMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown topology {cfg.topology!r}{hint}; choose one of {', '.join(TOPOLOGY_NAMES)}, spanning-tree:<name> or edge-list:<file>")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"--seed must be an integer in [0, {MAX_SEED}] (2^63 - 1), got {cfg.seed}")
    if not cfg.alpha > 0:
        raise ConfigError(f"--alpha must be > 0 (Dirichlet concentration; smaller = more heterogeneous), got {cfg.alpha}")
    _positive("lr", cfg.lr)
    if cfg.momentum is not None and not 0 <= cfg.momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1), got {cfg.momentum}")
    if cfg.optimizer is not None and cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
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
    if not 0 <= cfg.drop_prob < 1:
        raise ConfigError(f"--drop-prob must be in [0, 1), got {cfg.drop_prob}")
    for milestone in cfg.milestones or ():
        _positive("milestones", milestone, allow_zero=True)
    if cfg.relay_chunk is not None and cfg.relay_chunk < 1:
        raise ConfigError(f"--relay-chunk must be a positive number of elements, got {cfg.relay_chunk}")
    if cfg.relay_mode is not None and cfg.relay_mode not in RELAY_MODES:
        raise ConfigError(f"unknown --relay-mode {cfg.relay_mode!r}; choose one of {', '.join(RELAY_MODES)}")
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"unknown --backend {cfg.backend!r}; choose one of {', '.join(BACKENDS)}")
    if cfg.autocast is not None and cfg.autocast not in AUTOCAST_DTYPES:
        raise ConfigError(f"unknown --autocast {cfg.autocast!r}; choose one of {', '.join(AUTOCAST_DTYPES)} (or leave it out: float32)")
    if cfg.backend in ("local", "batched"):
        if cfg.workers is None or cfg.workers < 1:
            raise ConfigError(f"--backend {cfg.backend} needs --workers N with N >= 1, got {cfg.workers}")
    elif cfg.workers is not None:
        raise ConfigError("--workers is for --backend local or batched; under mpirun/srun the world size is the number of ranks")
    for name in ("eval_every", "checkpoint_every"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if cfg.out is not None:
        parent = Path(cfg.out).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"output directory {parent} does not exist (for --out {cfg.out}); create it first")
        if not os.access(parent, os.W_OK):
            raise ConfigError(f"output directory {parent} is not writable (for --out {cfg.out})")
        if Path(cfg.out).is_dir():
            raise ConfigError(f"--out {cfg.out} is a directory; give a file path such as {Path(cfg.out) / 'run.h5'}")
    if cfg.checkpoint_dir is not None:
        _check_writable_dir("--checkpoint-dir", Path(cfg.checkpoint_dir))
    if cfg.data_dir is not None and not Path(cfg.data_dir).is_dir():
        raise ConfigError(f"--data-dir {cfg.data_dir} is not a readable directory")
    if cfg.problem_file is not None and not Path(cfg.problem_file).is_file():
        raise ConfigError(f"--problem-file {cfg.problem_file} does not exist")
    if cfg.task == "quadratics":

        spec = QuadraticsSpec()
        if cfg.dim is not None and cfg.dim < 1:
            raise ConfigError(f"--dim must be >= 1, got {cfg.dim}")
        mu, L = (cfg.mu if cfg.mu is not None else spec.mu), (cfg.L if cfg.L is not None else spec.L)
        if not 0 < mu <= L:
            raise ConfigError(f"need 0 < --mu <= --L, got mu={mu}, L={L}")
        for name in ("zeta2", "r0", "sigma2"):
            _positive(name, getattr(cfg, name), allow_zero=True)
    bad = not_applicable(cfg)
    if bad:
        raise ConfigError("; ".join(f"{flag} cannot apply: {reason}" for flag, reason in bad))
    _check_inputs_not_outputs(cfg)
    if cfg.save_problem is not None:
        _check_writable_file("--save-problem", Path(cfg.save_problem), cfg.overwrite)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(cfg.device)):
        raise ConfigError(f"--device {cfg.device!r} is not a device relaympi runs on; choose cpu, cuda (local rank picks the GPU) or cuda:N")
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {cfg.threads}")


_QUADRATICS_ONLY = ("problem_file", "save_problem", "record_params", "dim", "mu", "L", "zeta2", "r0", "sigma2")
_GENERATION_ONLY = ("mu", "L", "zeta2", "r0")  # a problem file fixes the problem; these only shape a generated one


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def not_applicable(cfg: RunConfig) -> list[tuple[str, str]]:
    """(flag, why) for every given flag that cannot change this run (they are refused, not ignored)."""
    found = []
    if cfg.task != "quadratics":
        for name in _QUADRATICS_ONLY:
            if getattr(cfg, name) not in (None, False):
                found.append((_flag(name), f"it is for --task quadratics, not {cfg.task}"))
    elif cfg.problem_file is not None:
        for name in _GENERATION_ONLY:
            if getattr(cfg, name) is not None:
                found.append((_flag(name), f"it shapes a generated problem, and --problem-file {cfg.problem_file} is given"))
    if cfg.relay_mode is not None and cfg.algo != "relay":
        found.append(("--relay-mode", f"it is RelaySGD's normalization (--algo relay), not used by {cfg.algo}"))
    if cfg.relay_in_place and cfg.algo not in ("relay", "relay-grad"):
        found.append(("--relay-in-place", f"it changes RelaySum's buffers (relay, relay-grad), not used by {cfg.algo}"))
    if cfg.relay_chunk is not None and cfg.algo not in ("relay", "relay-grad"):
        found.append(("--relay-chunk", f"it sizes RelaySum's message chunks (relay, relay-grad), not used by {cfg.algo}"))
    if cfg.backend == "batched":
        if cfg.relay_in_place:
            found.append(("--relay-in-place", "the batched engine keeps RelaySum's messages in one tensor per tree and has no receive buffers to swap"))
        if cfg.relay_chunk is not None:
            found.append(("--relay-chunk", "the batched engine sends no messages to chunk (it sums them as tensors)"))
    if cfg.relay_lr_correction and cfg.algo != "relay":
        found.append(("--relay-lr-correction", f"it applies to --algo relay only, not {cfg.algo}"))
    for name in ("d2_force", "d2_exact_diffusion"):
        if getattr(cfg, name) and cfg.algo != "d2":
            found.append((_flag(name), f"it applies to --algo d2 only, not {cfg.algo}"))
    if cfg.data_dir is not None and cfg.task in ("digits", "quadratics"):
        found.append(("--data-dir", f"{cfg.task} reads no data set from disk ({'embedded in scikit-learn' if cfg.task == 'digits' else 'generated or --problem-file'})"))
    if cfg.autocast is not None and cfg.backend != "batched":
        found.append(("--autocast", f"it is the batched engine's mixed precision (--backend batched), not --backend {cfg.backend}'s"))
    elif cfg.autocast is not None and cfg.task == "quadratics":
        found.append(("--autocast", "quadratics run in float64 without a model to autocast"))
    if cfg.model_dir is not None and cfg.task != "agnews":
        found.append(("--model-dir", f"it is the pretrained model of --task agnews, not {cfg.task}"))
    if cfg.loader_workers is not None and cfg.task != "imagenet":
        found.append(("--loader-workers", f"only --task imagenet loads its data in loader processes, not {cfg.task}"))
    if cfg.checkpoint_every is not None and cfg.checkpoint_dir is None:
        found.append(("--checkpoint-every", "no checkpoints are written without --checkpoint-dir"))
    if cfg.drop_prob and cfg.algo == "allreduce":
        found.append(("--drop-prob", "allreduce communicates by a collective, which is not simulated as lossy (nothing would be dropped)"))
    return found


def _check_writable_dir(flag: str, path: Path) -> None:
    """A directory the run creates (with its parents) or writes into: refused up front where it cannot."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} exists and is not a directory")
    existing = path.absolute()
    while not existing.exists():  # the nearest existing ancestor is where mkdir would create the rest
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {existing} is not writable (a read-only file system or no permission); choose a writable directory")


def _check_writable_file(flag: str, path: Path, overwrite: bool) -> None:
    """A file the run may write: its directory must exist and take a new file; an existing file
    is only replaced with --overwrite (the run keeps it as it is when it holds the same content)."""
    parent = path.absolute().parent
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file path such as {path / 'problem.h5'}")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: its directory {parent} does not exist; create it first")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: its directory {parent} is not writable (a read-only file system or no permission)")
    if path.exists() and overwrite and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path} cannot be replaced (--overwrite): the file is not writable (a read-only file system or no permission)")


def _check_inputs_not_outputs(cfg: RunConfig) -> None:
    """A file read by the run (--problem-file) is never written, and two outputs never share a file."""
    named = [(n, Path(v).resolve()) for n in ("problem_file", "save_problem", "out") if (v := getattr(cfg, n)) is not None]
    for i, (a, path_a) in enumerate(named):
        for b, path_b in named[i + 1 :]:
            if path_a == path_b:
                what = "the run would overwrite its input" if a == "problem_file" else "two outputs would share one file"
                raise ConfigError(f"{_flag(a)} and {_flag(b)} are the same file {getattr(cfg, a)}: {what}; choose another {_flag(b)}")


def _milestones(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated epochs such as 150,180, got {text!r}") from None


def _task_default(attribute: str, show: Any = lambda v: f"{v:g}", skip: tuple[str, ...] = ()) -> str:
    """'task default: digits 8, cifar10 32, ...': a TaskDefaults value per task, as --help words it."""
    from relaympi.tasks import TASK_NAMES, get_task_class

    values = [f"{task} {show(getattr(get_task_class(task).defaults, attribute))}" for task in TASK_NAMES if task not in skip]
    return "task default: " + ", ".join(values)


def _eval_default(defaults: Any) -> str:
    if defaults.evals_per_run:
        return f"{defaults.evals_per_run} evaluations per run"
    return "every epoch" if defaults.eval_every_epochs == 1 else f"every {defaults.eval_every_epochs:g} epochs"


def build_parser() -> argparse.ArgumentParser:
    # imported here, not at the top: the report reads run configs (experiment_settings) without torch
    from relaympi.algorithms import ALGORITHM_NAMES, RELAY_MODES
    from relaympi.optim import OPTIMIZERS
    from relaympi.tasks import TASK_NAMES, get_task_class

    p = UsageParser(
        prog="python -m relaympi.train",
        description="Train with a decentralized algorithm: one worker per MPI rank (mpirun/srun), "
        "--backend local --workers N (threads of one process), or --backend batched --workers N "
        "(one batched computation on one device). Writes one HDF5 run file.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join([
            "topologies (--topology):",
            *textwrap.wrap(", ".join(TOPOLOGY_NAMES) + ",", 96, initial_indent="  ", subsequent_indent="  "),
            "  spanning-tree:<name> (the Spanning Tree Protocol tree of a graph), edge-list:<file> ('i j' per line)",
            "",
            "default learning rates: tuned for 16 workers on each algorithm's default topology (the paper's",
            "  tables for cifar10 and agnews, the centralized recipe for imagenet, a sweep for digits); a run",
            "  with another worker count warns, and the end summary flags workers at chance accuracy: pass --lr.",
            "",
            "one worker (--workers 1, or mpirun -n 1) with --algo allreduce is the centralized baseline.",
            "",
            "exit status: 0 completed, 1 failed, 2 usage error (nothing written), 3 diverged (recorded),",
            "  4 preempted by SIGTERM, SIGUSR1 or Ctrl-C (checkpoint saved; run the same command again to resume),",
            "  5 stopped by such a signal without a checkpoint (no --checkpoint-dir: a rerun starts over)",
        ]),
    )
    a = p.add_argument
    a("--config", type=Path, help="JSON file of saved flags (as written in a run file's config); flags given on the command line win")
    a("--task", choices=TASK_NAMES, help="workload (default digits: the embedded scikit-learn digits)")
    a("--algo", choices=ALGORITHM_NAMES, help="decentralized algorithm (default relay)")
    a("--topology", help="communication graph (default per algorithm: relay double-binary-trees, dpsgd/qgm/d2/gt ring, sgp exponential, allreduce fully-connected"
      + "".join(f"; task {t}: {', '.join(f'{algo} {topo}' for algo, topo in get_task_class(t).default_topology_by_algo.items())}"
                for t in TASK_NAMES if get_task_class(t).default_topology_by_algo) + ")")
    a("--alpha", type=float, help="Dirichlet data heterogeneity, > 0; smaller is more heterogeneous (default 1.0)")
    a("--lr", type=float, help="learning rate per worker (task default: one per algorithm, see 'default learning rates' below)")
    a("--momentum", type=float, help=f"local momentum (Nesterov form of the paper unless --no-nesterov); {_task_default('momentum')} (--algo qgm: 0.9 where that is 0)")
    a("--no-nesterov", dest="nesterov", action="store_false", default=None, help="heavy-ball instead of Nesterov momentum (default: Nesterov)")
    a("--optimizer", choices=OPTIMIZERS, help=f"local optimizer; {_task_default('optimizer', str)}")
    a("--weight-decay", type=float, help=f"L2 weight decay; {_task_default('weight_decay')}")
    a("--batch-size", type=int, help=f"samples per worker per step; {_task_default('batch_size')}")
    a("--epochs", type=float, help="training length in epochs (one epoch = the whole training set once over all workers); "
      f"{_task_default('epochs', skip=('quadratics',))} (quadratics: --steps)")
    a("--steps", type=int, help="training length in steps (instead of --epochs; quadratics needs it)")
    a("--warmup-epochs", type=float, help=f"linear lr warm-up length (applies when workers > 1); {_task_default('warmup_epochs')}")
    a("--milestones", type=_milestones, help="comma-separated epochs at which the lr is divided by 10; "
      f"{_task_default('milestones', lambda m: ','.join(f'{v:g}' for v in m) or 'none')}")
    a("--seed", type=int, help="seed of the data partition, data order, initial model, generated problem and simulated drops (default 0)")
    a("--drop-prob", type=float, help="simulated message loss probability in [0, 1) (default 0)")
    a("--relay-mode", choices=RELAY_MODES, help="--algo relay only: normalization under dropped messages: counts (Algorithm 1, default), previous (robust rule), initial")
    a("--relay-in-place", action="store_true", default=None, help="--algo relay/relay-grad only: RelaySum assembles messages in its receive buffers and swaps them chunk by chunk through a small bounce buffer: least memory (2 model copies of state on a chain)")
    a("--relay-chunk", type=int, default=None, metavar="ELEMENTS", help="--algo relay/relay-grad only: RelaySum sends messages in chunks of this many elements, so assembly overlaps the transfer (default 2^20 = 1048576); same numbers for any value")
    a("--relay-lr-correction", action="store_true", default=None, help="--algo relay only: scale the lr by RelaySGD's topology correction factor")
    a("--d2-force", action="store_true", default=None, help="--algo d2 only: run D² even if the gossip matrix has an eigenvalue < -1/3")
    a("--d2-exact-diffusion", action="store_true", default=None, help="--algo d2 only: D² with the Exact Diffusion matrix (W+I)/2")
    a("--eval-every", type=int, help="steps between evaluations; task default: "
      + ", ".join(f"{t} {_eval_default(get_task_class(t).defaults)}" for t in TASK_NAMES))
    a("--checkpoint-every", type=int, help="steps between periodic checkpoints (default: at every evaluation)")
    a("--backend", choices=BACKENDS, help="mpi (one worker per rank), local (--workers threads in one process) "
      "or batched (--workers models as one vmapped computation on one device); default mpi")
    a("--workers", type=int, help="number of workers for --backend local or batched")
    a("--autocast", choices=AUTOCAST_DTYPES, help="--backend batched only: run the models' forward and backward under torch.autocast in "
      "bfloat16 (parameters, optimizer and communication stay float32; evaluation stays float32). Default: off (float32)")
    a("--out", type=Path, help="HDF5 run file to write (default results/<task>-<algo>-<topology>-n<N>-a<alpha>-s<seed>.h5)")
    a("--overwrite", action="store_true", default=None, help="replace an existing completed run file (and an existing --save-problem file holding another problem)")
    a("--checkpoint-dir", type=Path, help="directory for per-rank checkpoints; re-running the command resumes from it (default: none, no checkpoints)")
    a("--data-dir", type=Path, help="data set directory (cifar10, imagenet, agnews; refused for digits and quadratics; default <root>/<task>, root $RELAYMPI_DATA or ~/.cache/relaympi: python -m relaympi.data)")
    a("--model-dir", type=Path, help="pretrained model directory (agnews only; default <root>/distilbert)")
    a("--device", help="torch device for models (cpu, cuda, cuda:0; 'cuda' picks local rank modulo GPU count; default cpu)")
    a("--threads", type=int, help="torch intra-op threads per worker (default: this process's share of the CPUs it may run on, "
      "divided among the workers or node-local ranks sharing them, capped by OMP_NUM_THREADS / SLURM_CPUS_PER_TASK, at least 1)")
    a("--loader-workers", type=int, help="--task imagenet only: data-loading worker processes (0: in the training process; default 2)")
    a("--eval-batch-size", type=int, help="samples per forward pass when evaluating on the test set (memory only, not the numbers; default 256)")
    a("--log-every", type=int, help="steps between progress lines (0: at evaluations only; default 0)")
    q = p.add_argument_group("quadratics (--task quadratics only; refused for other tasks)")
    q.add_argument("--problem-file", type=Path, help="HDF5 problem file (datasets A [n,d,d], b [n,d]); read, never written. The run records its dim and sigma2")
    q.add_argument("--save-problem", type=Path, help="write the generated problem to this HDF5 file; an existing file holding another problem is refused unless --overwrite")
    q.add_argument("--record-params", action="store_true", default=None, help="record every worker's iterate at every evaluation")
    q.add_argument("--dim", type=int, help="dimension d of the generated problem (default 50; with --problem-file it must match the file)")
    q.add_argument("--mu", type=float, help="smallest singular value of every A_i of the generated problem (default 0.5)")
    q.add_argument("--L", type=float, help="largest singular value of every A_i of the generated problem (default 1.0)")
    q.add_argument("--zeta2", type=float, help="heterogeneity 1/n sum ||grad f_i(x*)||^2 of the generated problem (default 1.0)")
    q.add_argument("--r0", type=float, help="initial distance ||x(0) - x*|| of the generated problem (default 10.0)")
    q.add_argument("--sigma2", type=float, help="gradient noise variance E||xi||^2 (default 0; with --problem-file it must match the file)")
    return p


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """RunConfig from the command line (raises ConfigError for bad values; argparse misuse exits 2)."""
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    base: dict[str, Any] = {}
    if args.config is not None:
        try:
            base = json.loads(Path(args.config).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--config {args.config}: cannot read a JSON object: {exc}") from exc
        if not isinstance(base, dict):
            raise ConfigError(f"--config {args.config} must hold a JSON object of flags")
    for key in _RUN_FILE_ONLY_KEYS:  # a run file's config records these derived values too
        base.pop(key, None)
    if "steps" in given or "epochs" in given:  # a length on the command line replaces the file's
        base.pop("steps", None)
        base.pop("epochs", None)
    cfg = RunConfig.from_dict({**base, **given})
    # a run file's config records every key; those that cannot apply to this run's task or
    # algorithm are dropped from the file's (only flags given on the command line are refused)
    stale = {f.lstrip("-").replace("-", "_") for f, _ in not_applicable(cfg)} - set(given)
    if stale:
        cfg = RunConfig.from_dict({**{k: v for k, v in base.items() if k not in stale}, **given})
    validate(cfg)
    return cfg
