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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaympi.entrypoint import UsageParser
from relaympi.tasks.quadratics import QuadraticsSpec
from relaympi.topology import PLACEMENTS as TOPOLOGY_PLACEMENTS
from relaympi.topology import TOPOLOGY_NAMES

BACKENDS = ("mpi", "local", "batched")
# --placement: "auto" resolves to one of relaympi.topology.PLACEMENTS (the run file records which)
PLACEMENTS = ("auto", *TOPOLOGY_PLACEMENTS)
AUTOCAST_DTYPES = ("bf16",)  # --autocast: the batched engine's forward and backward in this dtype
MAX_SEED = 2**63 - 1  # torch.manual_seed and numpy take any seed up to here (--seed 2^64 overflows torch)


def _milestones(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated epochs such as 150,180, got {text!r}") from None


# keys a run file's `config` attribute holds besides the flags (derived at run time)
_RUN_FILE_ONLY_KEYS = ("world_size", "lr_effective", "total_steps")

Settings = Mapping[str, Any]  # a run's config as a dict (RunConfig.to_dict(), or a run file's `config`)


@dataclass(frozen=True)
class Applies:
    """Where a flag applies: ``holds(config)``; elsewhere ``why(config)`` says why it cannot.

    ``refuse``: a value given where it does not hold is refused (``not_applicable``).
    ``identity``: where it does not hold, the key is no part of the experiment (``experiment_settings``).
    """

    holds: Callable[[Settings], bool]
    why: Callable[[Settings], str] = lambda c: ""
    refuse: bool = True
    identity: bool = True


@dataclass(frozen=True)
class Flag:
    """How a RunConfig field appears on the command line, in a run's identity and in the README.

    Everything a new flag of `python -m relaympi.train` needs besides its field: the parser, the
    refusal of flags that cannot apply, the experiment's identity (``numbers``), what a resumed run
    may change (``resume_free``) and the README's flag table are generated from these.
    """

    help: str | Callable[[], str]  # --help's text, every default in it (a callable: computed when the parser is built)
    type: Callable[[str], Any] | None = None  # argparse's type (None: a string, or an on/off switch)
    choices: Callable[[], Sequence[str]] | None = None  # the allowed values (imported when the parser is built)
    metavar: str | None = None  # --help's name of the value (None: argparse's)
    switch: bool = False  # an on/off flag: given, it stores the opposite of the field's default
    negatable: bool = False  # an on/off pair: --name stores True, --no-name False (argparse.BooleanOptionalAction)
    option: str | None = None  # the option string (None: --name-with-dashes)
    group: str | None = None  # the --help group it is listed in
    numbers: bool = True  # whether it can change a run's numbers (False: part of NON_SEMANTIC_KEYS)
    resume_free: bool = False  # whether a resumed run may change it (where output goes, how work is spread)
    applies: tuple[Applies, ...] = ()  # where it applies (everywhere when empty)
    readme: str | None = None  # the README table's text of the row this flag starts (None: it joins the row above)
    readme_arg: str = ""  # the value's name in the README table ("" for switches)
    readme_cell: str | None = None  # the row's first cell, where the generated one (each flag and its value) is not the words wanted

    def option_string(self, name: str) -> str:
        return self.option or "--" + name.replace("_", "-")


def _field(default: Any, help: str | Callable[[], str], **flag: Any) -> Any:
    """A RunConfig field and its command-line Flag."""
    return field(default=default, metadata={"flag": Flag(help=help, **flag)})


# Flags that apply to some runs only: Applies rules by the run's algorithm, task or backend
def _algos(*algos: str, why: Callable[[Settings], str], identity: bool = True) -> Applies:
    return Applies(lambda c: c.get("algo") in algos, why, identity=identity)


_RELAY = _algos("relay", why=lambda c: f"it applies to --algo relay only, not {c.get('algo')}")
_D2 = _algos("d2", why=lambda c: f"it applies to --algo d2 only, not {c.get('algo')}")
_QUADRATICS = Applies(lambda c: c.get("task") == "quadratics", lambda c: f"it is for --task quadratics, not {c.get('task')}")
# a problem file fixes the problem; these only shape a generated one
_GENERATED = Applies(lambda c: c.get("task") != "quadratics" or c.get("problem_file") is None,
                     lambda c: f"it shapes a generated problem, and --problem-file {c.get('problem_file')} is given", identity=False)
_QUADRATICS_FLAGS = "quadratics (--task quadratics only; refused for other tasks)"
# where ranks sit changes the numbers through the topology: not all-reduce's (a collective, never refused: scripts pass it to every algorithm)
_PLACED = Applies(lambda c: c.get("algo") != "allreduce", refuse=False)


def _help_topology() -> str:
    from relaympi.tasks import TASK_NAMES, get_task_class

    return ("communication graph (default per algorithm: relay double-binary-trees, dpsgd/qgm/d2/gt ring, sgp exponential, allreduce fully-connected"
            + "".join(f"; task {t}: {', '.join(f'{algo} {topo}' for algo, topo in get_task_class(t).default_topology_by_algo.items())}"
                      for t in TASK_NAMES if get_task_class(t).default_topology_by_algo) + ")")


def _help_eval_every() -> str:
    from relaympi.tasks import TASK_NAMES, get_task_class

    return "steps between evaluations; task default: " + ", ".join(f"{t} {_eval_default(get_task_class(t).defaults)}" for t in TASK_NAMES)


def _task_names() -> Sequence[str]:
    from relaympi.tasks import TASK_NAMES

    return TASK_NAMES


def _algorithm_names() -> Sequence[str]:
    from relaympi.algorithms import ALGORITHM_NAMES

    return ALGORITHM_NAMES


def _optimizer_names() -> Sequence[str]:
    from relaympi.optim import OPTIMIZERS

    return OPTIMIZERS


def _relay_modes() -> Sequence[str]:
    from relaympi.algorithms import RELAY_MODES

    return RELAY_MODES


def _cuda_overlap_allowed() -> bool:
    from relaympi.training.buckets import cuda_overlap_mode  # the diagnostic switch, read there

    return cuda_overlap_mode() is not None


class ConfigError(ValueError):
    """A bad flag value or combination; the CLI exits with status 2."""


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run. ``None`` means "the task's default" until resolve().

    Each field's Flag (``flag_of``) is its command-line flag: adding a field with ``_field`` adds the flag.
    """

    task: str = _field("digits", "workload (default digits: the embedded scikit-learn digits)", choices=_task_names,
                       readme="workload (digits)")
    algo: str = _field("relay", "decentralized algorithm (default relay)", choices=_algorithm_names, readme="algorithm (relay)")
    topology: str | None = _field(
        None, _help_topology, readme_arg="NAME",
        readme="ring, chain, star, binary-tree, double-binary-trees, fully-connected, hypercube, exponential (n a power of two), "
        "social-network and social-network-tree (exactly 32 workers), `spanning-tree:<name>`, `edge-list:<file>` (one `i j` pair per line). "
        "Default per algorithm: relay/relay-grad double-binary-trees (chain for agnews), dpsgd/qgm/d2/gt ring, sgp exponential, allreduce fully-connected")
    placement: str = _field(  # recorded as resolved: "ranks" or "nodes"
        "auto", "where the topology puts ranks: ranks (the paper's rank order), nodes (each node's ranks together, few edges "
        "between nodes) or auto: nodes when the ranks span more than one node and the topology can be placed by node, else ranks "
        "(default auto); the run file records the one used",
        choices=lambda: PLACEMENTS, applies=(_PLACED,),
        readme="where the topology puts ranks: the paper's rank order (`ranks`), or each node's ranks kept together so that few tree "
        "edges cross between nodes (`nodes`); `auto`: `nodes` when the ranks span more than one node and the topology can be placed by "
        "node, else `ranks` (see \"Placement\"). "
        "The run file records the one used")
    ranks_per_node: int | None = _field(  # emulated nodes: rank r is on node r // K
        None, "emulate nodes of K consecutive ranks each (rank r on node r // K; --backend local and batched: default one node; under "
        "mpirun/srun it overrides the nodes MPI reports, recorded as emulated)", type=int, metavar="K", readme_arg="K",
        readme="emulate nodes of K consecutive ranks (rank r on node r // K): the nodes `--placement` sees. Default: the nodes MPI "
        "places the ranks on (ranks sharing memory); one node for `--backend local` and `batched`. The run file records every rank's node "
        "and whether it was emulated",
        # the nodes only shape the topology under --placement nodes
        applies=(_PLACED, Applies(lambda c: c.get("placement") == "nodes", refuse=False)))
    alpha: float = _field(  # Dirichlet heterogeneity (smaller = more heterogeneous)
        1.0, "Dirichlet data heterogeneity, > 0; smaller is more heterogeneous (default 1.0)", type=float, readme_arg="A",
        readme="Dirichlet heterogeneity, > 0; smaller is more heterogeneous, `inf` is an iid split (1.0). With few samples per worker "
        "(digits: some worker counts from ~500 up, for small and large A alike) Lin et al.'s Dirichlet draw may never succeed: "
        "the run is refused, naming the values")
    lr: float | None = _field(  # per worker and step, before warm-up/decay
        None, "learning rate per worker (task default: one per algorithm, see 'default learning rates' below)", type=float, readme_arg="LR",
        readme="learning rate per worker and step, before warm-up and decay (the task's per-algorithm default)")
    momentum: float | None = _field(
        None, lambda: f"local momentum (Nesterov form of the paper unless --no-nesterov); {_task_default('momentum')} (--algo qgm: 0.9 where that is 0)",
        type=float, readme_arg="M", readme="local momentum, the paper's Nesterov form unless `--no-nesterov` (task default)")
    nesterov: bool = _field(
        True, "heavy-ball instead of Nesterov momentum (default: Nesterov)", switch=True, option="--no-nesterov",
        # the momentum's form: no part of an experiment without momentum (never refused: a default to many scripts)
        applies=(Applies(lambda c: bool(c.get("momentum")) and c.get("optimizer", "sgd") == "sgd", refuse=False),))
    optimizer: str | None = _field(None, lambda: f"local optimizer; {_task_default('optimizer', str)}", choices=_optimizer_names,
                                   readme="local optimizer and L2 weight decay (task default)")
    weight_decay: float | None = _field(None, lambda: f"L2 weight decay; {_task_default('weight_decay')}", type=float, readme_arg="WD")
    batch_size: int | None = _field(  # samples per worker per step
        None, lambda: f"samples per worker per step; {_task_default('batch_size')}", type=int, readme_arg="B",
        readme="samples per worker per step (task default)")
    epochs: float | None = _field(
        None, lambda: "training length in epochs (one epoch = the whole training set once over all workers); "
        f"{_task_default('epochs', skip=('quadratics',))} (quadratics: --steps)", type=float, readme_arg="E",
        readme="length; one epoch is one pass over the whole training set by all workers together: ⌈train set / (workers × batch)⌉ steps; "
        "E epochs run ⌈E × that⌉ steps (E as written: 1.1 × 90 is 99)", readme_cell="`--epochs E` / `--steps K`")
    steps: int | None = _field(None, "training length in steps (instead of --epochs; quadratics needs it)", type=int, readme_arg="K")
    warmup_epochs: float | None = _field(
        None, lambda: f"linear lr warm-up length (applies when workers > 1); {_task_default('warmup_epochs')}", type=float, readme_arg="E",
        readme="linear warm-up (when workers > 1) over round(E × steps per epoch) steps: step t < W runs at lr × (f + (1 − f) t / W), "
        "f the task's start (0; ImageNet 0.5), step W at lr; lr / 10 from the step of each milestone epoch on")
    milestones: tuple[float, ...] | None = _field(  # epochs at which the lr is divided by 10
        None, lambda: "comma-separated epochs at which the lr is divided by 10; "
        f"{_task_default('milestones', lambda m: ','.join(f'{v:g}' for v in m) or 'none')}", type=_milestones, readme_arg="150,180")
    seed: int = _field(
        0, "seed of the data partition, data order, initial model, generated problem and simulated drops (default 0)", type=int, readme_arg="S",
        readme="data partition, data order, initial model, simulated drops; in [0, 2^63 - 1] (0)")
    drop_prob: float = _field(
        0.0, "simulated message loss probability in [0, 1) (default 0)", type=float, readme_arg="P",
        readme="simulated message loss in [0, 1), seeded and reproducible (0)",
        # a collective: no message is ever dropped
        applies=(Applies(lambda c: c.get("algo") != "allreduce", lambda c: "allreduce communicates by a collective, which is not simulated as lossy (nothing would be dropped)"),))
    relay_mode: str | None = _field(  # --algo relay only: "counts" (Algorithm 1) unless given
        None, "--algo relay only: normalization under dropped messages: counts (Algorithm 1, default), previous (robust rule), initial",
        choices=_relay_modes, readme="`--algo relay` only: normalization under dropped messages: Algorithm 1 (counts), the paper's robust rule (previous), "
        "or missing models replaced by x(0)",
        applies=(_algos("relay", why=lambda c: f"it is RelaySGD's normalization (--algo relay), not used by {c.get('algo')}"),))
    relay_in_place: bool = _field(  # RelaySum swaps messages in its receive buffers (least memory)
        False, "--algo relay/relay-grad only: RelaySum assembles messages in its receive buffers and swaps them chunk by chunk through a small "
        "bounce buffer: least memory (2 model copies of state on a chain)", switch=True, numbers=False,
        readme="`--algo relay/relay-grad` and message passing (not `--backend batched`) only: RelaySum assembles messages in its receive buffers "
        "and swaps them chunk by chunk through a small bounce buffer: least memory — 2 model copies of state on a chain, 2.5 on double binary "
        "trees, instead of twice that, plus 2 x degree x chunk elements; same numbers",
        applies=(_algos("relay", "relay-grad", why=lambda c: f"it changes RelaySum's buffers (relay, relay-grad), not used by {c.get('algo')}"),
                 Applies(lambda c: c.get("backend") != "batched", lambda c: "the batched engine keeps RelaySum's messages in one tensor per tree and has no receive buffers to swap")))
    relay_chunk: int | None = _field(  # RelaySum message chunk in elements (None: RelaySum's DEFAULT_CHUNK, 2^20)
        None, "--algo relay/relay-grad only: RelaySum sends messages in chunks of this many elements, so assembly overlaps the transfer "
        "(default 2^20 = 1048576); same numbers for any value", type=int, metavar="ELEMENTS", numbers=False, readme_arg="N",
        readme="`--algo relay/relay-grad` and message passing (not `--backend batched`) only: RelaySum message chunk in elements (2^20): "
        "assembly of one chunk overlaps the transfer of the previous; same numbers for any N",
        applies=(_algos("relay", "relay-grad", why=lambda c: f"it sizes RelaySum's message chunks (relay, relay-grad), not used by {c.get('algo')}"),
                 Applies(lambda c: c.get("backend") != "batched", lambda c: "the batched engine sends no messages to chunk (it sums them as tensors)")))
    relay_lr_correction: bool = _field(  # scale lr by RelaySGD's topology correction 1/(alpha n)
        False, "--algo relay only: scale the lr by RelaySGD's topology correction factor", switch=True, applies=(_RELAY,),
        readme="multiply the lr by RelaySGD's topology correction factor (the paper's 1/(αn), α there being the weight an "
        "update keeps, not the Dirichlet α; `python -m relaympi.topology NAME -n N` prints it)")
    d2_force: bool = _field(False, "--algo d2 only: run D² even if the gossip matrix has an eigenvalue < -1/3", switch=True, applies=(_D2,),
                            readme="`--algo d2` only: run D² on a matrix with an eigenvalue < -1/3, or use (W+I)/2")
    d2_exact_diffusion: bool = _field(False, "--algo d2 only: D² with the Exact Diffusion matrix (W+I)/2", switch=True, applies=(_D2,))
    eval_every: int | None = _field(  # steps between evaluations (default: every task eval epoch)
        None, _help_eval_every, type=int, readme_arg="K",
        readme="steps between evaluations (task's eval epoch) and checkpoints (every evaluation; only with `--checkpoint-dir`): evaluations at "
        "steps 0, K, 2K, … and always at the last step (a resumed run too); checkpoints at K, 2K, … before the last step")
    checkpoint_every: int | None = _field(  # steps between periodic checkpoints (default: every eval)
        None, "steps between periodic checkpoints (default: at every evaluation)", type=int, numbers=False, readme_arg="K",
        applies=(Applies(lambda c: c.get("checkpoint_dir") is not None, lambda c: "no checkpoints are written without --checkpoint-dir"),))
    backend: str = _field(
        "mpi", "mpi (one worker per rank), local (--workers threads in one process) "
        "or batched (--workers models as one vmapped computation on one device); default mpi", choices=lambda: BACKENDS,
        numbers=False, resume_free=True,
        readme="MPI ranks, N in-process workers (threads), or N workers as one batched computation on one device (\"The batched engine\")")
    workers: int | None = _field(None, "number of workers for --backend local or batched", type=int, numbers=False, resume_free=True,
                                 readme_arg="N")
    autocast: str | None = _field(  # batched backend only: "bf16" runs its forward and backward under torch.autocast
        None, "--backend batched only: run the models' forward and backward under torch.autocast in "
        "bfloat16 (parameters, optimizer and communication stay float32; evaluation stays float32). Default: off (float32)",
        choices=lambda: AUTOCAST_DTYPES,
        readme="`--backend batched` only: forward and backward in bfloat16 under `torch.autocast` (off: float32)",
        applies=(Applies(lambda c: c.get("backend") == "batched", lambda c: f"it is the batched engine's mixed precision (--backend batched), not --backend {c.get('backend')}'s", identity=False),
                 Applies(lambda c: c.get("backend") != "batched" or c.get("task") != "quadratics", lambda c: "quadratics run in float64 without a model to autocast", identity=False)))
    overlap: bool | None = _field(  # per-bucket steps started from backward's hooks; the numbers are the same. Recorded as resolved
        None, "--backend mpi/local: start each gradient bucket's update and communication while backward computes the rest "
        "(--no-overlap: after backward; same numbers either way). Default: on when the MPI ranks span more than one node "
        "(as MPI or --ranks-per-node places them) on the CPU and the model is larger than "
        "one --bucket-size bucket, else off: it helps where backward is long enough to hide "
        "the step's transfers (a large model across a slow link), and a model of one bucket "
        "has nothing to start early; the run file records the one used",
        negatable=True, numbers=False, resume_free=True,
        readme_cell="`--overlap`, `--no-overlap`",
        readme="message passing only: each gradient bucket's update and communication start from backward's hooks as soon as its gradient is "
        "final, while backward computes the rest; same numbers either way. Default: on for MPI "
        "ranks on more than one node on the CPU with a model larger than one `--bucket-size` "
        "bucket, else off (see \"Overlap\"); the run file records the one used",
        applies=(Applies(lambda c: c.get("backend") != "batched" or not c.get("overlap"),
                         lambda c: "the batched engine has no wire to overlap (its workers' communication is tensor arithmetic on one device)"),
                 # on an H100 (2026-11-26) `mpirun -n 4 ... --device cuda --overlap` hung after its first step,
                 # undiagnosed: refused until the GPU path is found and tested (README "Overlap");
                 # RELAYMPI_ALLOW_CUDA_OVERLAP lifts it for diagnosis (relaympi.training.buckets)
                 Applies(lambda c: not str(c.get("device")).startswith("cuda") or not c.get("overlap") or _cuda_overlap_allowed(),
                         lambda c: "it hung on a GPU in its only check (--device cuda, host-staged MPI; undiagnosed): use --no-overlap with --device cuda"),))
    progress_thread: bool = _field(  # how MPI progresses during backward; the numbers are the same. Recorded as resolved
        # (asked for and overlapping); whether it ran is the provenance's transport_progress_thread
        False, "--overlap on MPI: a thread runs MPI's progress engine every --progress-interval ms while backward computes, so the "
        "transfers started from the hooks keep moving between them (needs MPI_THREAD_MULTIPLE; it sleeps between polls; for ranks with a "
        "spare core). Default --no-progress-thread: only the hooks' MPI_Test calls progress them",
        negatable=True, numbers=False, resume_free=True,
        readme_cell="`--progress-thread`, `--no-progress-thread`",
        readme="`--overlap` on MPI: a thread that runs MPI's progress engine during backward (needs `MPI_THREAD_MULTIPLE`), for ranks "
        "with a spare core; off: only the hooks' `MPI_Test` calls progress the transfers (see \"Overlap\")",
        applies=(Applies(lambda c: c.get("backend") == "mpi" or not c.get("progress_thread"),
                         lambda c: f"it runs MPI's progress engine, and --backend {c.get('backend')} has none (its transfers are copies made in its own calls)"),
                 Applies(lambda c: c.get("overlap") is not False or not c.get("progress_thread"),
                         lambda c: "it progresses transfers started during backward, and --no-overlap starts none there"),))
    progress_interval: float = _field(  # the progress thread's poll period; the numbers are the same
        2.0, "--progress-thread's poll period in ms (default 2): shorter keeps a fast link busier (a ~4 MB socket buffer drains in "
        "2 ms at 16 Gbit/s) and costs the ranks more wake-ups; same numbers for any period",
        type=float, metavar="MS", numbers=False, resume_free=True, readme_arg="MS",
        readme="the progress thread's poll period in ms (2); same numbers for any period",
        applies=(Applies(lambda c: c.get("backend") == "mpi" and c.get("overlap") is not False and bool(c.get("progress_thread")),
                         lambda c: "it sets the progress thread's poll period, and this run has none (--progress-thread runs with "
                         "--overlap on --backend mpi)"),))
    # MiB of gradient per --overlap bucket: 1, 4 and 16 measured on VGG-11 (benchmarks.overlap, README "Overlap"):
    # 16 overlaps least; at 4 and below each of VGG-11's large convolutions is its own bucket
    bucket_size: float = _field(
        4.0, "--overlap only: MiB of the flat gradient per bucket, cut from the last layers (default 4); same numbers for any size",
        type=float, metavar="MB", numbers=False, resume_free=True, readme_arg="MB",
        readme="`--overlap` only: MiB of the flat gradient per bucket, cut from the last layers (4); same numbers for any size",
        applies=(Applies(lambda c: bool(c.get("overlap")) or (c.get("overlap") is None and c.get("backend") == "mpi"),
                         lambda c: "it sizes --overlap's gradient buckets; without --overlap there are none"),))
    out: Path | None = _field(
        None, "HDF5 run file to write (default results/<task>-<algo>-<topology>-n<N>-a<alpha>-s<seed>.h5)", type=Path, numbers=False,
        resume_free=True, readme_arg="PATH.h5",
        readme="run file (`results/<task>-<algo>-<topology>-n<N>-a<alpha>-s<seed>.h5`, a plain file name in `results/`: `edge-list:/path/chain.txt` "
        "becomes `edge-list-chain-<8 hex digits of the file's SHA-256>`); a finished run (and a `--save-problem` file holding another problem) "
        "is never replaced without `--overwrite`")
    overwrite: bool = _field(False, "replace an existing completed run file (and an existing --save-problem file holding another problem)",
                             switch=True, numbers=False, resume_free=True)
    checkpoint_dir: Path | None = _field(
        None, "directory for per-rank checkpoints; re-running the command resumes from it (default: none, no checkpoints)", type=Path,
        numbers=False, resume_free=True, readme_arg="DIR", readme="per-rank checkpoints; re-running the same command resumes; one folder every node sees (refused otherwise)")
    data_dir: Path | None = _field(
        None, "data set directory (cifar10, imagenet, agnews; refused for digits and quadratics; default <root>/<task>, root $RELAYMPI_DATA "
        "or ~/.cache/relaympi: python -m relaympi.data)", type=Path, numbers=False, readme_arg="DIR",
        readme="data set (cifar10, imagenet, agnews; refused for digits and quadratics) and pretrained model (agnews only); default `<root>/<task>` "
        "and `<root>/distilbert` under the data root (`$RELAYMPI_DATA`, else `~/.cache/relaympi`; see \"Data\"). The run file's config records "
        "the resolved paths",
        applies=(Applies(lambda c: c.get("task") not in ("digits", "quadratics"), lambda c: f"{c.get('task')} reads no data set from disk "
                         f"({'embedded in scikit-learn' if c.get('task') == 'digits' else 'generated or --problem-file'})"),))
    model_dir: Path | None = _field(
        None, "pretrained model directory (agnews only; default <root>/distilbert)", type=Path, numbers=False, readme_arg="DIR",
        applies=(Applies(lambda c: c.get("task") == "agnews", lambda c: f"it is the pretrained model of --task agnews, not {c.get('task')}"),))
    device: str = _field(
        "cpu", "torch device for models (cpu, cuda, cuda:0; 'cuda' picks local rank modulo GPU count; default cpu)", numbers=False,
        resume_free=True, readme_cell="`--device {cpu,cuda,cuda:K}`", readme="`cuda` picks the GPU of the node-local rank")
    threads: int | None = _field(  # torch intra-op threads per worker
        None, "torch intra-op threads per worker (default: this process's share of the CPUs it may run on, "
        "divided among the workers or node-local ranks sharing them, capped by OMP_NUM_THREADS / SLURM_CPUS_PER_TASK, at least 1; "
        "--backend batched on a CPU keeps the faster of that and 1, timed on the first step)", type=int,
        numbers=False, resume_free=True, readme_arg="N",
        readme="torch threads per worker (batched: of the one process; default its share of the CPUs the process may run on — `taskset`, SLURM "
        "cpusets, cgroups — divided among the in-process workers or the node-local MPI ranks that share them (bound ranks keep their own), capped "
        "by `OMP_NUM_THREADS` and `SLURM_CPUS_PER_TASK`, at least 1; recorded as `provenance.torch_threads`; a value above the share warns), "
        "data-loading processes (imagenet only; 2), evaluation batch, progress lines")
    loader_workers: int | None = _field(  # --task imagenet only (None: TaskOptions' default, 2)
        None, "--task imagenet only: data-loading worker processes (0: in the training process; default 2)", type=int, numbers=False,
        resume_free=True, readme_arg="N",
        applies=(Applies(lambda c: c.get("task") == "imagenet", lambda c: f"only --task imagenet loads its data in loader processes, not {c.get('task')}"),))
    eval_batch_size: int = _field(256, "samples per forward pass when evaluating on the test set (memory only, not the numbers; default 256)",
                                  type=int, numbers=False, resume_free=True, readme_arg="B")
    log_every: int = _field(0, "steps between progress lines (0: at evaluations only; default 0)", type=int, numbers=False,
                            resume_free=True, readme_arg="K")
    # quadratics
    problem_file: Path | None = _field(
        None, "HDF5 problem file (datasets A [n,d,d], b [n,d]); read, never written. The run records its dim and sigma2", type=Path,
        group=_QUADRATICS_FLAGS, applies=(_QUADRATICS,),
        readme_cell="quadratics: `--problem-file`, `--save-problem`, `--record-params`, `--dim`, `--mu`, `--L`, `--zeta2`, `--r0`, `--sigma2`",
        readme="problem file (datasets `A` [n,d,d], `b` [n,d], optional `x_star`, attribute `f_star`), or a generated instance (d 50, μ 0.5, L 1, "
        "ζ² 1, r0 10, σ² 0). With `--problem-file` the run records the file's `dim` and `sigma2` (a different explicit `--dim`/`--sigma2` exits 2) "
        "and `null` for `mu`, `L`, `zeta2`, `r0` (refused: they shape a generated problem). `--save-problem` over a file holding another problem "
        "exits 2 unless `--overwrite`; the same problem again (rerunning the command) leaves it as it is. Refused for other tasks")
    save_problem: Path | None = _field(
        None, "write the generated problem to this HDF5 file; an existing file holding another problem is refused unless --overwrite", type=Path,
        group=_QUADRATICS_FLAGS, numbers=False, applies=(_QUADRATICS,))
    record_params: bool = _field(False, "record every worker's iterate at every evaluation", switch=True, group=_QUADRATICS_FLAGS, numbers=False,
                                 applies=(_QUADRATICS,))
    # generated problem (QuadraticsSpec's defaults unless given); with --problem-file the run
    # records the file's dim and sigma2, and None for the generation-only mu, L, zeta2, r0
    dim: int | None = _field(None, "dimension d of the generated problem (default 50; with --problem-file it must match the file)", type=int,
                             group=_QUADRATICS_FLAGS, applies=(_QUADRATICS,))
    mu: float | None = _field(None, "smallest singular value of every A_i of the generated problem (default 0.5)", type=float,
                              group=_QUADRATICS_FLAGS, applies=(_QUADRATICS, _GENERATED))
    L: float | None = _field(None, "largest singular value of every A_i of the generated problem (default 1.0)", type=float,
                             group=_QUADRATICS_FLAGS, applies=(_QUADRATICS, _GENERATED))
    zeta2: float | None = _field(None, "heterogeneity 1/n sum ||grad f_i(x*)||^2 of the generated problem (default 1.0)", type=float,
                                 group=_QUADRATICS_FLAGS, applies=(_QUADRATICS, _GENERATED))
    r0: float | None = _field(None, "initial distance ||x(0) - x*|| of the generated problem (default 10.0)", type=float,
                              group=_QUADRATICS_FLAGS, applies=(_QUADRATICS, _GENERATED))
    sigma2: float | None = _field(None, "gradient noise variance E||xi||^2 (default 0; with --problem-file it must match the file)", type=float,
                                  group=_QUADRATICS_FLAGS, applies=(_QUADRATICS,))
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


# RunConfig's fields with their command-line flag, in --help's order
FLAGS: tuple[tuple[dataclasses.Field, Flag], ...] = tuple((f, f.metadata["flag"]) for f in dataclasses.fields(RunConfig) if "flag" in f.metadata)

# Config keys that cannot change a run's numbers: where files go, how the work is spread over
# processes, threads and devices, logging and bookkeeping. Every other key is part of the
# experiment's identity (the report never merges two runs that differ in one of them).
NON_SEMANTIC_KEYS = frozenset(f.name for f, flag in FLAGS if not flag.numbers)
# Config keys that may differ between a run and its resumption (relaympi.training.checkpointing):
# where output goes and how the work is spread over processes, threads and devices
RESUME_FREE_KEYS = tuple(f.name for f, flag in FLAGS if flag.resume_free)
# --config: not a RunConfig field (a file of them)
_CONFIG_HELP = "JSON file of saved flags (as written in a run file's config); flags given on the command line win"
_CONFIG_README = ("`--config FILE`", "a JSON object of flags (e.g. a run file's `config`); command-line flags win")


# what runs did before their run files recorded a key (a default that changed since)
_BEFORE_RECORDED = {"placement": "ranks"}  # the paper's rank order, the only one before --placement


def experiment_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that define a run's experiment (seed included), from a run file's config.

    Missing keys (older files) take RunConfig's defaults; keys that cannot apply to the run's
    algorithm or task are dropped, so `--relay-mode counts` on dpsgd is the same experiment as none.
    """
    defaults = RunConfig().to_dict()
    merged = {**defaults, **_BEFORE_RECORDED, **config}
    rules = {f.name: [rule for rule in flag.applies if rule.identity] for f, flag in FLAGS}
    return {
        key: value
        for key, value in merged.items()
        if key not in NON_SEMANTIC_KEYS and key not in _RUN_FILE_ONLY_KEYS and all(rule.holds(merged) for rule in rules.get(key, ()))
    }


def run_file_config_keys() -> tuple[str, ...]:
    """Every key of a run file's `config` attribute: RunConfig's fields and the values derived at run time."""
    return (*(f.name for f in dataclasses.fields(RunConfig) if f.name != "extra"), *_RUN_FILE_ONLY_KEYS)


def not_applicable(cfg: RunConfig) -> list[tuple[str, str]]:
    """(flag, why) for every given flag that cannot change this run (they are refused, not ignored)."""
    settings = cfg.to_dict()
    found = []
    for f, flag in FLAGS:
        value = getattr(cfg, f.name)
        if value is None or value == f.default:  # not given
            continue
        found += [(flag.option_string(f.name), rule.why(settings)) for rule in flag.applies if rule.refuse and not rule.holds(settings)]
    return found


def flag_table() -> str:
    """The README's table of the flags of `python -m relaympi.train` (Markdown), from the Flags."""
    rows: list[list[Any]] = [[_CONFIG_README[0], [], _CONFIG_README[1]]]  # [first cell or None, flags, text]
    for f, flag in FLAGS:
        if flag.readme is not None:
            rows.append([flag.readme_cell, [], flag.readme])
        choices = f" {{{','.join(flag.choices())}}}" if flag.choices else ""
        rows[-1][1].append(f"`{flag.option_string(f.name)}{choices}{' ' + flag.readme_arg if flag.readme_arg else ''}`")
    lines = ["| flag | meaning (default) |", "| --- | --- |"]
    lines += [f"| {cell or ', '.join(flags)} | {text} |" for cell, flags, text in rows]
    return "\n".join(lines) + "\n"


def _positive(name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    bad = (value < 0) if allow_zero else (value <= 0)
    if bad or not math.isfinite(value):
        finite = " and finite" if math.isinf(value) else ""
        raise ConfigError(f"--{name.replace('_', '-')} must be {'>= 0' if allow_zero else '> 0'}{finite}, got {value}")


def _checked(make: Callable[[], Any], flags: dict[str, str]) -> None:
    """Build a domain object (it checks its own values); its ValueError becomes a usage error naming the flag:
    the message's first mention of each field (``flags``: the word in the message -> its flag) becomes the flag."""
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

    The domain classes (OptimizerConfig, DropPolicy, AlgorithmOptions, QuadraticsSpec) check their own values.
    """
    # imported here, not at the top: the report reads run configs (experiment_settings) without torch
    from relaympi.algorithms import ALGORITHM_NAMES, AlgorithmOptions
    from relaympi.comm import DropPolicy
    from relaympi.optim import OptimizerConfig
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
    if cfg.placement not in PLACEMENTS:
        raise ConfigError(f"unknown --placement {cfg.placement!r}; choose one of {', '.join(PLACEMENTS)}")
    if cfg.ranks_per_node is not None and cfg.ranks_per_node < 1:
        raise ConfigError(f"--ranks-per-node must be >= 1 (ranks on each emulated node), got {cfg.ranks_per_node}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"--seed must be an integer in [0, {MAX_SEED}] (2^63 - 1), got {cfg.seed}")
    if not cfg.alpha > 0:
        raise ConfigError(f"--alpha must be > 0 (Dirichlet concentration; smaller = more heterogeneous), got {cfg.alpha}")
    _positive("lr", cfg.lr)
    _positive("bucket_size", cfg.bucket_size)
    _positive("progress_interval", cfg.progress_interval)
    given = {"name": cfg.optimizer, "momentum": cfg.momentum}
    _checked(lambda: OptimizerConfig(**{k: v for k, v in given.items() if v is not None}), {"momentum": "--momentum", "optimizer": "--optimizer"})
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
    for milestone in cfg.milestones or ():
        _positive("milestones", milestone, allow_zero=True)
    _checked(lambda: AlgorithmOptions.of(cfg.to_dict()), {"relay_chunk": "--relay-chunk", "relay_mode": "--relay-mode"})
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
        names = [f.name for f in dataclasses.fields(QuadraticsSpec)]
        _checked(lambda: QuadraticsSpec(**{k: getattr(cfg, k) for k in names if getattr(cfg, k) is not None}), {k: _flag(k) for k in names})
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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
    """The parser of `python -m relaympi.train`, generated from RunConfig's Flags (and --config)."""
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
    p.add_argument("--config", type=Path, help=_CONFIG_HELP)
    groups: dict[str, Any] = {}
    for f, flag in FLAGS:
        target = p if flag.group is None else groups.get(flag.group) or groups.setdefault(flag.group, p.add_argument_group(flag.group))
        text = flag.help() if callable(flag.help) else flag.help
        if flag.negatable:  # --name / --no-name (None: not given)
            target.add_argument(flag.option_string(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif flag.switch:  # given, it stores the opposite of the field's default (None: not given)
            target.add_argument(flag.option_string(f.name), dest=f.name, action="store_false" if f.default else "store_true", default=None, help=text)
        else:
            target.add_argument(flag.option_string(f.name), type=flag.type, choices=flag.choices() if flag.choices else None,
                                metavar=flag.metavar, help=text)
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
