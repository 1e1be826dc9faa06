"""The sweeps' grid, defined once: configurations, run-file paths, training commands, and the runner.

    python jobs/grid.py list SWEEP            # every configuration, its run file's status and command
    python jobs/grid.py count SWEEP           # number of configurations (array size)
    python jobs/grid.py plan SWEEP [--all]    # sbatch array groups for jobs/submit.sh
    python jobs/grid.py run SWEEP [--index I] # run configuration I (default: $SLURM_ARRAY_TASK_ID)

Settings come from RELAYMPI_* environment variables, then from the KEY=VALUE file named by
RELAYMPI_JOBS_CONFIG; see jobs/README.md for every name.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from relaympi.data.paths import TASK_DATA, TASK_MODEL, data_root  # noqa: E402  (needs ROOT on sys.path)

# The paper's topology per algorithm (Table "Motivation of topology choices").
PAPER_TOPOLOGY = {
    "allreduce": "fully-connected",
    "relay": "double-binary-trees",
    "relay-grad": "double-binary-trees",
    "dpsgd": "ring",
    "qgm": "ring",
    "d2": "ring",
    "gt": "ring",
    "sgp": "exponential",
}
# The paper's tuned CIFAR-10 / VGG-11 learning rates, 16 workers (appendix table
# "Learning rates used for Cifar-10"): (algo, with momentum) -> {alpha: lr}.
CIFAR10_LR = {
    ("allreduce", False): {1.0: 0.1, 0.1: 0.1, 0.01: 0.1},
    ("allreduce", True): {1.0: 0.1, 0.1: 0.1, 0.01: 0.1},
    ("relay", False): {1.0: 1.2, 0.1: 0.6, 0.01: 0.3},
    ("relay", True): {1.0: 0.6, 0.1: 0.3, 0.01: 0.15},
    ("dpsgd", False): {1.0: 0.4, 0.1: 0.1, 0.01: 0.2},
    ("qgm", True): {1.0: 0.1, 0.1: 0.025, 0.01: 0.05},
    ("d2", False): {1.0: 0.2, 0.1: 0.2, 0.01: 0.1},
    ("d2", True): {1.0: 0.05, 0.1: 0.05, 0.01: 0.0125},
    ("sgp", False): {1.0: 0.4, 0.1: 0.2, 0.01: 0.2},
    ("sgp", True): {1.0: 0.1, 0.1: 0.1, 0.01: 0.025},
}
# The paper's tuned AG News / DistilBERT learning rates (Adam), alpha = 0.1.
AGNEWS_LR = {"allreduce": 3e-5, "relay": 9e-4, "dpsgd": 1e-6, "qgm": 1e-6}
ALGOS_WITH_MOMENTUM_ONLY = ("qgm",)  # quasi-global momentum is meaningless without momentum
# The paper runs D-PSGD without momentum only: its momentum variant is qgm. Applies unless
# RELAYMPI_MOMENTA is set.
PAPER_PLAIN_ONLY = ("dpsgd",)


@dataclass(frozen=True)
class Sweep:
    """A sweep's defaults; every list can be overridden by the RELAYMPI_* variable named in jobs/README.md."""

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


DATA_TASKS = tuple(TASK_DATA)  # tasks that read --data-dir
MODEL_TASKS = tuple(TASK_MODEL)  # tasks that read --model-dir

SWEEPS = {
    "sweep_alpha": Sweep(
        "CIFAR-10 accuracy vs data heterogeneity (paper Table 'cifar10-trees'), 16 workers",
        task="cifar10",
        algos=("allreduce", "relay", "dpsgd", "qgm", "d2", "sgp"),
        alphas=(1.0, 0.1, 0.01),
        workers=(16,),
        momenta=(0.0, 0.9),
        seeds=(0, 1, 2),
    ),
    "sweep_workers": Sweep(
        "CIFAR-10 scaling the number of workers at alpha 0.01 (paper Table 'scaling')",
        task="cifar10",
        algos=("allreduce", "relay", "relay:chain", "sgp"),
        alphas=(0.01,),
        workers=(16, 32, 64),
        momenta=(0.9,),
        seeds=(0, 1, 2),
    ),
    "sweep_lr": Sweep(
        "Learning-rate grid search, lr = centre * 2^k (paper appendix 'Hyper-parameters and tuning')",
        task="cifar10",
        algos=("allreduce", "relay", "dpsgd", "qgm", "d2", "sgp"),
        alphas=(1.0, 0.1, 0.01),
        workers=(16,),
        momenta=(0.0, 0.9),
        seeds=(0, 1, 2),
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
    ),
}


class GridError(ValueError):
    """A bad setting (names the variable and the value)."""


# ------------------------------------------------------------------------------------ settings


def parse_config_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; '#' starts a comment line; 'export ' and matching outer quotes are dropped."""
    values: dict[str, str] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise GridError(
            f"RELAYMPI_JOBS_CONFIG={path}: cannot read ({error.strerror or error})"
        ) from None
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            raise GridError(f"{path}:{number}: expecting KEY=VALUE, got {raw!r}")
        value = value.rstrip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


class Settings:
    """RELAYMPI_* settings: the environment wins over the config file."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.environ = dict(environ)
        self.values: dict[str, str] = {}
        config = environ.get("RELAYMPI_JOBS_CONFIG")
        if config:
            self.values.update(parse_config_file(Path(config)))
        self.values.update(
            {k: v for k, v in environ.items() if k.startswith("RELAYMPI_") and v != ""}
        )

    def get(self, name: str, default: str | None = None) -> str | None:
        value = self.values.get(name, "")
        return value if value != "" else default

    def list(self, name: str, convert: Callable[[str], object], default: Sequence) -> tuple:
        value = self.get(name)
        if value is None:
            return tuple(default)
        items = value.replace(",", " ").split()
        try:
            return tuple(convert(item) for item in items)
        except ValueError:
            raise GridError(
                f"{name}={value!r}: expecting a list of {convert.__name__} values"
            ) from None

    def number(self, name: str, convert: Callable[[str], object], default: object = None) -> object:
        value = self.get(name)
        if value is None:
            return default
        try:
            return convert(value)
        except ValueError:
            raise GridError(f"{name}={value!r}: expecting {convert.__name__}") from None

    def flag(self, name: str) -> bool:
        value = (self.get(name) or "0").lower()
        if value not in ("0", "1", "true", "false", "yes", "no"):
            raise GridError(f"{name}={value!r}: expecting 0 or 1")
        return value in ("1", "true", "yes")

    def path(self, name: str, default: Path) -> Path:
        value = self.get(name)
        return Path(value).expanduser().absolute() if value else default


def _momentum(text: str) -> float | None:
    return None if text.lower() in ("default", "none") else float(text)


def _lr_text(lr: float | None) -> str:
    return "default" if lr is None else f"{lr:.6g}"


# ------------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class RunConfig:
    """One point of a sweep: what the training command is asked to do."""

    task: str
    algo: str
    topology: str
    alpha: float
    lr: float | None
    momentum: float | None
    optimizer: str | None
    world_size: int
    seed: int
    drop_prob: float
    relay_mode: str | None = None

    @property
    def name(self) -> str:
        """The run file's stem: every field that varies in some sweep, so names never collide."""
        momentum = "default" if self.momentum is None else f"{self.momentum:g}"
        parts = [
            self.algo,
            self.topology,
            f"alpha{self.alpha:g}",
            f"lr{_lr_text(self.lr)}",
            f"mom{momentum}",
            self.optimizer or "opt-default",
            f"n{self.world_size}",
            f"drop{self.drop_prob:g}",
            f"seed{self.seed}",
        ]
        if self.relay_mode:
            parts.append(f"relay-{self.relay_mode}")
        return "_".join(parts)


def _paper_lr(task: str, algo: str, momentum: float | None, alpha: float) -> float | None:
    if task == "cifar10":
        return CIFAR10_LR.get((algo, bool(momentum)), {}).get(alpha)
    if task in ("agnews", "ag_news") and alpha == 0.1:
        return AGNEWS_LR.get(algo)
    return None


def _parse_algo(entry: str, topologies: Mapping[str, str]) -> tuple[str, str]:
    algo, _, topology = entry.partition(":")
    if not algo:
        raise GridError(f"RELAYMPI_ALGOS: empty algorithm in {entry!r}")
    return algo, topology or topologies.get(algo) or PAPER_TOPOLOGY.get(algo, "default")


def _topology_overrides(settings: Settings) -> dict[str, str]:
    overrides = {}
    for item in (settings.get("RELAYMPI_TOPOLOGIES") or "").replace(",", " ").split():
        algo, sep, topology = item.partition("=")
        if not sep or not algo or not topology:
            raise GridError(f"RELAYMPI_TOPOLOGIES: expecting ALGO=TOPOLOGY items, got {item!r}")
        overrides[algo] = topology
    return overrides


def _lrs(
    sweep_name: str,
    sweep: Sweep,
    settings: Settings,
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
        raise GridError(
            f"sweep_lr: no learning-rate centre for task {task!r}, algo {algo!r}, alpha {alpha:g}: "
            "set RELAYMPI_LR_CENTER (or RELAYMPI_LRS for an explicit list)"
        )
    kmin = settings.number("RELAYMPI_LR_KMIN", int, min(sweep.lr_exponents))
    kmax = settings.number("RELAYMPI_LR_KMAX", int, max(sweep.lr_exponents))
    if kmin > kmax:
        raise GridError(f"RELAYMPI_LR_KMIN={kmin} is larger than RELAYMPI_LR_KMAX={kmax}")
    return [float(f"{centre * 2.0**k:.6g}") for k in range(kmin, kmax + 1)]


def configurations(sweep_name: str, settings: Settings) -> list[RunConfig]:
    """The sweep's configurations in array-index order.

    Seeds vary slowest (after world size), so the first part of an array already covers every
    cell of the table with one seed.
    """
    sweep = _sweep(sweep_name)
    task = settings.get("RELAYMPI_TASK", sweep.task)
    algos = settings.list("RELAYMPI_ALGOS", str, sweep.algos)
    alphas = settings.list("RELAYMPI_ALPHAS", float, sweep.alphas)
    workers = settings.list("RELAYMPI_WORKERS", int, sweep.workers)
    momenta = settings.list("RELAYMPI_MOMENTA", _momentum, sweep.momenta)
    paper_momenta = settings.get("RELAYMPI_MOMENTA") is None
    seeds = settings.list("RELAYMPI_SEEDS", int, sweep.seeds)
    drops = settings.list("RELAYMPI_DROP_PROBS", float, sweep.drop_probs)
    optimizer = settings.get("RELAYMPI_OPTIMIZER", sweep.optimizer)
    relay_mode = settings.get("RELAYMPI_RELAY_MODE")
    topologies = _topology_overrides(settings)
    for name, values in (
        ("RELAYMPI_WORKERS", workers),
        ("RELAYMPI_ALGOS", algos),
        ("RELAYMPI_SEEDS", seeds),
    ):
        if not values:
            raise GridError(f"{name} is empty")
    if any(n < 1 for n in workers):
        raise GridError(f"RELAYMPI_WORKERS must be positive, got {workers}")
    result = []
    for world_size in workers:
        for seed in seeds:
            for entry in algos:
                algo, topology = _parse_algo(entry, topologies)
                for momentum in momenta:
                    if algo in ALGOS_WITH_MOMENTUM_ONLY and momentum == 0:
                        continue
                    if paper_momenta and algo in PAPER_PLAIN_ONLY and momentum:
                        continue
                    for alpha in alphas:
                        for drop in drops:
                            for lr in _lrs(
                                sweep_name, sweep, settings, task, algo, momentum, alpha
                            ):
                                result.append(
                                    RunConfig(
                                        task,
                                        algo,
                                        topology,
                                        alpha,
                                        lr,
                                        momentum,
                                        optimizer,
                                        world_size,
                                        seed,
                                        drop,
                                        relay_mode if algo == "relay" else None,  # RelaySGD only (relay-grad has no normalization)
                                    )
                                )
    return result


def _sweep(name: str) -> Sweep:
    try:
        return SWEEPS[name]
    except KeyError:
        raise GridError(f"unknown sweep {name!r}; sweeps: {', '.join(SWEEPS)}") from None


# ------------------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Job:
    """One configuration made concrete: where it writes and the exact command."""

    index: int
    config: RunConfig
    out: Path
    checkpoint_dir: Path
    command: list[str]


def results_dir(settings: Settings) -> Path:
    return settings.path("RELAYMPI_RESULTS_DIR", ROOT / "results")


def launcher(settings: Settings) -> str:
    name = settings.get("RELAYMPI_LAUNCHER", "srun")
    if name not in ("srun", "mpirun", "local"):
        raise GridError(f"RELAYMPI_LAUNCHER must be srun, mpirun or local, got {name!r}")
    return name


def _train_args(
    config: RunConfig, sweep_name: str, settings: Settings, out: Path, checkpoint_dir: Path
) -> list[str]:
    args = [
        "--task",
        config.task,
        "--algo",
        config.algo,
        "--topology",
        config.topology,
        "--alpha",
        f"{config.alpha:g}",
    ]
    if config.lr is not None:
        args += ["--lr", f"{config.lr:.6g}"]
    if config.momentum is not None:
        args += ["--momentum", f"{config.momentum:g}"]
    if config.optimizer:
        args += ["--optimizer", config.optimizer]
    args += ["--seed", str(config.seed), "--drop-prob", f"{config.drop_prob:g}"]
    epochs, steps = settings.get("RELAYMPI_EPOCHS"), settings.get("RELAYMPI_STEPS")
    if epochs and steps:
        raise GridError("set RELAYMPI_EPOCHS or RELAYMPI_STEPS, not both")
    if epochs:
        args += ["--epochs", epochs]
    if steps:
        args += ["--steps", steps]
    for flag, name in (
        ("--batch-size", "RELAYMPI_BATCH_SIZE"),
        ("--eval-every", "RELAYMPI_EVAL_EVERY"),
    ):
        if settings.get(name):
            args += [flag, settings.get(name)]
    if config.relay_mode:
        args += ["--relay-mode", config.relay_mode]
    for flag, path, _ in data_dirs(config, sweep_name, settings):
        args += [flag, str(path)]
    args += ["--out", str(out), "--checkpoint-dir", str(checkpoint_dir)]
    args += shlex.split(settings.get("RELAYMPI_EXTRA_ARGS", ""))
    return args


def data_dirs(
    config: RunConfig, sweep_name: str, settings: Settings
) -> list[tuple[str, Path | str, str | None]]:
    """(flag, folder, data set) for --data-dir / --model-dir: RELAYMPI_DATA_DIR / _MODEL_DIR if set,
    else the task's folder under the data root ($RELAYMPI_DATA, else ~/.cache/relaympi)."""
    sweep = _sweep(sweep_name)
    result: list[tuple[str, Path | str, str | None]] = []
    for flag, name, data_set, needed in (
        ("--data-dir", "RELAYMPI_DATA_DIR", TASK_DATA.get(config.task), sweep.needs_data),
        ("--model-dir", "RELAYMPI_MODEL_DIR", TASK_MODEL.get(config.task), sweep.needs_model),
    ):
        value = settings.get(name)
        if value:
            result.append((flag, Path(value).expanduser().absolute(), data_set))
        elif data_set:
            result.append((flag, data_root(settings.get("RELAYMPI_DATA")) / data_set, data_set))
        elif needed:
            result.append((flag, f"<set {name}>", None))
    return result


def data_problems(selected: Sequence[Job], sweep_name: str, settings: Settings, hashes: bool) -> list[str]:
    """What is wrong with the data the ``selected`` jobs read ([] when all of it is verified)."""
    from relaympi.data.sets import data_problems as problems

    needs = [
        (data_set, path)
        for job in selected
        for _, path, data_set in data_dirs(job.config, sweep_name, settings)
        if data_set is not None and isinstance(path, Path)
    ]
    return problems(needs, hashes=hashes, allow_unverified=settings.flag("RELAYMPI_ALLOW_UNVERIFIED_DATA"))


def command(
    config: RunConfig, sweep_name: str, settings: Settings, out: Path, checkpoint_dir: Path
) -> list[str]:
    python = settings.get("RELAYMPI_PYTHON") or sys.executable
    module = settings.get("RELAYMPI_TRAIN_MODULE", "relaympi.train")
    train = [python, "-m", module]
    args = _train_args(config, sweep_name, settings, out, checkpoint_dir)
    name = launcher(settings)
    launcher_args = shlex.split(settings.get("RELAYMPI_LAUNCHER_ARGS", ""))
    if name == "local":
        return [*train, "--backend", "local", "--workers", str(config.world_size), *args]
    if name == "srun":
        return [
            "srun",
            f"--ntasks={config.world_size}",
            *launcher_args,
            *train,
            "--backend",
            "mpi",
            *args,
        ]
    mpirun = shlex.split(settings.get("RELAYMPI_MPIRUN", "mpirun"))
    return [
        *mpirun,
        "-n",
        str(config.world_size),
        *launcher_args,
        *train,
        "--backend",
        "mpi",
        *args,
    ]


def jobs(sweep_name: str, settings: Settings) -> list[Job]:
    results = results_dir(settings)
    checkpoints = settings.path("RELAYMPI_CHECKPOINT_DIR", results / "checkpoints")
    result = []
    for index, config in enumerate(configurations(sweep_name, settings)):
        out = results / sweep_name / config.task / f"{config.name}.h5"
        checkpoint_dir = checkpoints / sweep_name / config.task / config.name
        result.append(
            Job(
                index,
                config,
                out,
                checkpoint_dir,
                command(config, sweep_name, settings, out, checkpoint_dir),
            )
        )
    return result


def check_job(job: Job, sweep_name: str, settings: Settings, *, need_inputs: bool = True) -> str | None:
    """Why the trainer would refuse this configuration (None when it accepts it).

    The same parser and the same resolution the trainer runs (relaympi.config.parse_args and
    relaympi.train.resolve), so a typo in RELAYMPI_ALGOS or RELAYMPI_EXTRA_ARGS, an algorithm on a
    topology it cannot use, or a missing data directory is found before anything is submitted.
    With need_inputs false (a listing), a data or model directory that is not set yet is no reason.
    """
    import contextlib
    import io
    import tempfile

    from relaympi.config import ConfigError, parse_args
    from relaympi.training.plan import resolve

    args = _train_args(job.config, sweep_name, settings, job.out, job.checkpoint_dir)
    for flag, name in (("--data-dir", "RELAYMPI_DATA_DIR"), ("--model-dir", "RELAYMPI_MODEL_DIR")):
        if f"<set {name}>" in args:
            if need_inputs:
                return f"task {job.config.task} reads {flag} {'data' if flag == '--data-dir' else 'a model'}: set {name} (jobs/README.md)"
            i = args.index(f"<set {name}>")
            del args[i - 1 : i + 1]
        elif flag in args and not Path(args[args.index(flag) + 1]).is_dir():
            i = args.index(flag)  # data not fetched yet: data_problems reports it, with the fetch command
            del args[i : i + 2]
    # the run file's directory is made when the job starts: check the flags against an existing one
    i = args.index("--out")
    args[i + 1] = str(Path(tempfile.gettempdir()) / f"{job.config.name}.h5")
    backend = ["--backend", "local", "--workers", str(job.config.world_size)] if launcher(settings) == "local" else ["--backend", "mpi"]
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages), contextlib.redirect_stdout(messages):
            cfg = parse_args([*backend, *args])
        resolve(cfg, job.config.world_size)
    except ConfigError as error:
        return str(error)
    except SystemExit:  # argparse: an unknown flag or value, e.g. a typo in RELAYMPI_ALGOS
        lines = [line for line in messages.getvalue().splitlines() if line.startswith("error:")]
        return lines[-1].removeprefix("error: ") if lines else messages.getvalue().strip()
    return None


def check_jobs(all_jobs: Sequence[Job], sweep_name: str, settings: Settings, *, need_inputs: bool = True) -> list[str]:
    """One line per reason the trainer would refuse configurations, naming them (the first few)."""
    refused: dict[str, list[str]] = {}
    for job in all_jobs:
        reason = check_job(job, sweep_name, settings, need_inputs=need_inputs)
        if reason:
            refused.setdefault(reason, []).append(f"{sweep_name}[{job.index}] {job.config.name}")
    lines = []
    for reason, names in refused.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        lines.append(f"{', '.join(names[:3])}{more}: {reason}")
    return lines


def _status(path: Path) -> str:
    from relaympi.results import run_status

    return run_status(path)


FINISHED = ("completed", "diverged")


# -------------------------------------------------------------------------------- subcommands


def _header(sweep_name: str, all_jobs: Sequence[Job]) -> list[str]:
    """What this grid actually runs (the settings may differ from the paper's sweep)."""
    sweep = _sweep(sweep_name)
    configs = [job.config for job in all_jobs]

    def values(field: str) -> str:
        seen = list(dict.fromkeys(getattr(c, field) for c in configs))
        return " ".join("default" if v is None else f"{v:g}" if isinstance(v, float) else str(v) for v in seen)

    tasks, workers = values("task"), values("world_size")
    paper = sweep.task == tasks and " ".join(map(str, sweep.workers)) == workers
    lines = [f"{sweep_name}: {sweep.description}" if paper else f"{sweep_name}: the grid of '{sweep.description}', here on task {tasks} with {workers} workers"]
    lines.append(
        f"this grid: task {tasks}; workers {workers}; algorithms {values('algo')}; alpha {values('alpha')}; "
        f"momentum {values('momentum')}; lr {values('lr')}; drop probability {values('drop_prob')}; seeds {values('seed')}"
    )
    return lines


def cmd_list(sweep_name: str, settings: Settings) -> int:
    all_jobs = jobs(sweep_name, settings)
    print("\n".join(_header(sweep_name, all_jobs)))
    print(
        f"{len(all_jobs)} configurations; launcher {launcher(settings)}; results in {results_dir(settings)}"
    )
    counts: dict[str, int] = {}
    for job in all_jobs:
        status = _status(job.out)
        counts[status] = counts.get(status, 0) + 1
        fields = " ".join(f"{k}={v}" for k, v in asdict(job.config).items() if v is not None)
        print(f"[{job.index}] {status:9s} {fields}")
        print(f"    {shlex.join(job.command)}")
    print("status: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    problems = check_jobs(all_jobs, sweep_name, settings, need_inputs=False)
    for problem in problems:
        print(f"jobs/grid.py: error: the trainer would refuse {problem}", file=sys.stderr)
    return 2 if problems else 0


def array_spec(indices: Sequence[int]) -> str:
    """Compress sorted indices into sbatch's --array syntax: 0-5,8,10-12."""
    parts, start, prev = [], None, None
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)


def cmd_plan(sweep_name: str, settings: Settings, include_finished: bool, dry_run: bool = False) -> int:
    """Lines 'group<TAB>NTASKS<TAB>ARRAY<TAB>COUNT' (one per task count), then 'logs<TAB>DIR'.

    Refuses (GridError) when the data the planned jobs read is not present and verified; a dry
    run only warns."""
    local = launcher(settings) == "local"
    groups: dict[int, list[int]] = {}
    finished = 0
    all_jobs = jobs(sweep_name, settings)
    problems = check_jobs(all_jobs, sweep_name, settings)
    if problems:  # nothing is submitted when one configuration would fail
        for problem in problems:
            print(f"jobs/grid.py: error: {problem}", file=sys.stderr)
        print(f"jobs/grid.py: {sweep_name}: nothing submitted (check the settings: jobs/README.md)", file=sys.stderr)
        return 2
    selected = []
    for job in all_jobs:
        if not include_finished and _status(job.out) in FINISHED:
            finished += 1
            continue
        ntasks = 1 if local else job.config.world_size
        groups.setdefault(ntasks, []).append(job.index)
        selected.append(job)
    problems = data_problems(selected, sweep_name, settings, hashes=True)
    if problems:
        message = (
            f"{sweep_name}: the data its jobs read is not present and verified:\n  "
            + "\n  ".join(problems)
            + "\n(data put there by hand, complete but without a manifest: RELAYMPI_ALLOW_UNVERIFIED_DATA=1)"
        )
        if not dry_run:
            raise GridError(message)
        print(f"jobs/grid.py: warning: {message}", file=sys.stderr)
    for ntasks, indices in sorted(groups.items()):
        print(f"group\t{ntasks}\t{array_spec(indices)}\t{len(indices)}")
    print(f"finished\t{finished}")
    print(f"logs\t{results_dir(settings) / 'logs'}")
    return 0


class _Forwarder:
    """Forwards SIGTERM/SIGUSR1 to the training command; remembers a time-limit warning."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.time_limit = False
        self.cancelled = False

    def __call__(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGUSR1:
            self.time_limit = True  # sbatch --signal=B:USR1@T: the time limit is T seconds away
        else:
            self.cancelled = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)  # the trainer checkpoints and exits 4


def _log(message: str) -> None:
    print(f"[relaympi-jobs] {message}", flush=True)


def _requeue() -> bool:
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return False
    _log(f"requeueing SLURM job {job_id} to resume from its checkpoint")
    return subprocess.run(["scontrol", "requeue", job_id], check=False).returncode == 0


def cmd_run(sweep_name: str, settings: Settings, index: int | None) -> int:
    if index is None:
        task_id = os.environ.get("SLURM_ARRAY_TASK_ID")
        if task_id is None:
            count = len(configurations(sweep_name, settings))
            print(
                f"{sweep_name}: no configuration chosen. Submit the array with "
                f"'bash jobs/submit.sh {sweep_name}' (or 'sbatch --array=0-{count - 1} jobs/{sweep_name}.sh'), "
                f"run one configuration here with '--index I', or list them with DRY_RUN=1 / --dry-run.",
                file=sys.stderr,
            )
            return 2
        index = int(task_id)
    all_jobs = jobs(sweep_name, settings)
    if not 0 <= index < len(all_jobs):
        _log(
            f"{sweep_name}: index {index} is outside the grid of {len(all_jobs)} configurations; nothing to do"
        )
        return 0
    job = all_jobs[index]
    status = _status(job.out)
    label = f"{sweep_name}[{index}] {job.config.name}"
    if status in FINISHED and not settings.flag("RELAYMPI_FORCE"):
        _log(f"{label}: already {status}; skipping ({job.out})")
        return 0
    if "<set RELAYMPI_" in " ".join(job.command):
        raise GridError(f"{sweep_name} needs RELAYMPI_DATA_DIR (and RELAYMPI_MODEL_DIR for agnews)")
    missing = [p for p in data_problems([job], sweep_name, settings, hashes=False) if ": missing (" in p or ": incomplete (" in p]
    if missing:  # a cheap look (no checksums) before a whole allocation starts to fail
        raise GridError(f"{label}: data not there:\n  " + "\n  ".join(missing))
    if status in ("missing", "corrupt") and job.checkpoint_dir.exists():
        # The checkpoint belongs to a run file that is gone: start afresh rather than resume into nothing.
        _log(f"{label}: run file {status}; removing its stale checkpoint {job.checkpoint_dir}")
        shutil.rmtree(job.checkpoint_dir)
    job.out.parent.mkdir(parents=True, exist_ok=True)
    job.checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
    command_line = list(job.command)
    if status in FINISHED:  # RELAYMPI_FORCE=1
        command_line.append("--overwrite")
    _log(
        f"{label}: run file {status}; {'resuming' if status in ('running', 'preempted', 'failed') else 'starting'}"
    )
    _log(f"command: {shlex.join(command_line)}")
    forwarder = _Forwarder()
    signal.signal(signal.SIGTERM, forwarder)
    signal.signal(signal.SIGUSR1, forwarder)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    forwarder.child = subprocess.Popen(command_line, env=env)
    rc = forwarder.child.wait()
    final = _status(job.out)
    _log(f"{label}: exit status {rc}, run file {final}")
    if rc in (0, 3):  # completed, or diverged with the result recorded
        if not settings.flag("RELAYMPI_KEEP_CHECKPOINTS") and job.checkpoint_dir.exists():
            shutil.rmtree(job.checkpoint_dir)
        return 0
    if rc == 4 or forwarder.time_limit:  # preempted: the checkpoint is saved
        if not forwarder.cancelled and settings.get("RELAYMPI_REQUEUE", "1") != "0" and _requeue():
            return 0
        return 4
    return rc if rc > 0 else 128 - rc  # a signal: report it the way a shell would


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jobs/grid.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "count", "plan", "run"):
        p = sub.add_parser(name)
        p.add_argument("sweep", choices=sorted(SWEEPS))
        if name == "plan":
            p.add_argument("--all", action="store_true", help="include finished configurations")
            p.add_argument("--dry-run", action="store_true", help="warn about missing data instead of refusing")
        if name == "run":
            p.add_argument(
                "--index", type=int, help="configuration to run (default: $SLURM_ARRAY_TASK_ID)"
            )
            p.add_argument(
                "--dry-run", action="store_true", help="list every configuration instead"
            )
    sub.add_parser("sweeps")
    sub.add_parser("show-config", help="print the effective RELAYMPI_* settings as JSON")
    args = parser.parse_args(argv)
    try:
        settings = Settings()
        if args.command == "sweeps":
            for name, sweep in SWEEPS.items():
                print(f"{name}\t{len(configurations(name, Settings({})))}\t{sweep.description}")
            return 0
        if args.command == "show-config":
            print(json.dumps(settings.values, indent=2, sort_keys=True))
            return 0
        if args.command == "count":
            print(len(configurations(args.sweep, settings)))
            return 0
        if args.command == "plan":
            return cmd_plan(args.sweep, settings, args.all, args.dry_run)
        if (
            args.command == "list"
            or args.dry_run
            or os.environ.get("DRY_RUN", "0") not in ("", "0")
        ):
            return cmd_list(args.sweep, settings)
        return cmd_run(args.sweep, settings, args.index)
    except GridError as error:
        print(f"jobs/grid.py: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:  # `DRY_RUN=1 bash jobs/sweep_alpha.sh | head`: the reader stopped listening
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 0
    sys.exit(status)
