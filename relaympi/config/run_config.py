"""RunConfig: everything that defines a run, each field with its command-line flag and its text."""

# Long module: RunConfig is one dataclass, a field per flag with its one text

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relaympi.algorithms.registry import DECLARED, MESSAGES, Communication
from relaympi.config import help_text
from relaympi.config.flags import Applies, ConfigError, Flag, flag_field
from relaympi.launcher import cuda_overlap_mode
from relaympi.topology import PLACEMENTS as TOPOLOGY_PLACEMENTS

BACKENDS = ("mpi", "local", "batched")  # relaympi.engines.BACKENDS' names (a test keeps them so)
# --placement: "auto" resolves to one of relaympi.topology.PLACEMENTS (the run file records which)
PLACEMENTS = ("auto", *TOPOLOGY_PLACEMENTS)
AUTOCAST_DTYPES = ("bf16",)  # --autocast: the batched engine's forward and backward in this dtype
# torch.manual_seed and numpy take any seed up to here (--seed 2^64 overflows torch)
MAX_SEED = 2**63 - 1

# keys a run file's `config` attribute holds besides the flags (derived at run time)
RUN_FILE_ONLY_KEYS = ("world_size", "lr_effective", "total_steps")


def _milestones(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated epochs such as 150,180, got {text!r}"
        ) from None


# Flags that apply to some runs only, by the run's task, backend or algorithm (an algorithm's
# options say themselves where they apply: relaympi.config.flags.rules)
_QUADRATICS = Applies(
    lambda c: c.get("task") == "quadratics",
    lambda c: f"it is for --task quadratics, not {c.get('task')}",
)
# a problem file fixes the problem; these only shape a generated one
_GENERATED = Applies(
    lambda c: c.get("task") != "quadratics" or c.get("problem_file") is None,
    lambda c: f"it shapes a generated problem, and --problem-file {c.get('problem_file')} is given",
    identity=False,
)
_QUADRATICS_FLAGS = "quadratics (`--task quadratics` only; refused for other tasks)"


def _communication(c: Mapping[str, Any]) -> Communication:
    """How the run's algorithm communicates, as it declares (relaympi.algorithms.registry); an
    unknown name (refused elsewhere) as most do, by messages."""
    algo = c.get("algo")
    return DECLARED[algo].communication if isinstance(algo, str) and algo in DECLARED else MESSAGES


# where ranks sit changes the numbers of an algorithm that mixes over the topology's edges; never
# refused: scripts pass it to every algorithm
_PLACED = Applies(lambda c: _communication(c).placed, refuse=False)
# only point-to-point messages are simulated as lossy
_DROPPABLE = Applies(
    lambda c: _communication(c).lossy,
    lambda c: f"{c.get('algo')} {_communication(c).what} (nothing would be dropped)",
)
_NOT_BATCHED = "message passing, not `--backend batched`"
# the late drops of --message-deadline take --drop-prob's rule of a lost message, which D² has
# only on paper: it diverges with undelivered messages (docs/algorithms.md, "Message loss")
_SOUND_DROP_RULE = Applies(
    lambda c: c.get("algo") != "d2",
    lambda c: "d2 has no sound rule for a lost message (it diverges with undelivered messages)",
)
_BATCHED_OVERLAP = Applies(  # the batched engine: --overlap refused (--no-overlap is what it does)
    lambda c: c.get("backend") != "batched" or not c.get("overlap"),
    lambda c: (
        "the batched engine has no wire to overlap (its workers' communication is tensor "
        "arithmetic on one device)"
    ),
)
# refused on GPUs until the overlapped step has passed a GPU check (docs/overlap.md);
# RELAYMPI_ALLOW_CUDA_OVERLAP lifts the refusal for that check
_GPU_OVERLAP = Applies(
    lambda c: (
        not str(c.get("device")).startswith("cuda")
        or not c.get("overlap")
        or cuda_overlap_mode() is not None
    ),
    lambda c: (
        "it has not passed a check on a GPU yet (its one try, host-staged, hung): "
        "use --no-overlap with --device cuda"
    ),
)


def _epochs() -> str:
    return (
        "training length in epochs E: one epoch is one pass over the whole training set by "
        "all workers together, ceil(train set / (workers x batch)) steps, and E epochs run "
        "ceil(E x that) steps (E as written: 1.1 x 90 is 99); "
        f"{help_text.task_default('epochs', skip=('quadratics',))} (quadratics: `--steps`)"
    )


def _warmup() -> str:
    start = help_text.per_task("warmup_from")
    return (
        "linear lr warm-up when workers > 1: step t < W = round(E x steps per epoch) runs at "
        f"lr x (f + (1 - f) t / W), from step W on at lr (f: {start}); "
        + help_text.task_default("warmup_epochs")
    )


def _milestones_text() -> str:
    shown = help_text.task_default("milestones", lambda m: ",".join(f"{v:g}" for v in m) or "none")
    return (
        "comma-separated epochs at which the lr is divided by 10, from the first step of each "
        f"on; {shown}"
    )


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run. ``None`` means "the task's default" until resolve().

    Each field's Flag (``relaympi.config.FLAGS``) is its command-line flag: adding a field with
    ``flag_field`` adds the flag, its refusals, its part in the experiment's identity and its row
    of the flag table. A field of an algorithm's options (relaympi.algorithms.options) applies to
    that algorithm only. Every field is documented by its flag: ``flag_table()`` (or
    ``python -m relaympi.train --help``) lists them.

    Constructing one checks nothing; ``parse_args`` and ``validate`` do.

    Example:
        ```python
        cfg = RunConfig(task="digits", algo="relay", alpha=0.01, workers=16, backend="local")
        validate(cfg)
        RunConfig.from_dict(cfg.to_dict()) == cfg  # True
        ```
    """

    task: str = flag_field(
        "digits",
        "workload (default digits: the embedded scikit-learn digits)",
        choices=help_text.task_names,
    )
    algo: str = flag_field(
        "relay", "decentralized algorithm (default relay)", choices=help_text.algorithm_names
    )
    topology: str | None = flag_field(None, help_text.topology, metavar="NAME")
    placement: str = flag_field(  # recorded as resolved: "ranks" or "nodes"
        "auto",
        "where the topology puts ranks: `ranks` (the paper's rank order), `nodes` (each node's "
        "ranks together, so that few tree edges cross between nodes) or `auto`: `nodes` when the "
        "ranks span more than one node and the topology can be placed by node, else `ranks` "
        "(default auto); the run file records the one used",
        choices=lambda: PLACEMENTS,
        applies=(_PLACED,),
    )
    ranks_per_node: int | None = flag_field(  # emulated nodes: rank r is on node r // K
        None,
        "emulate nodes of K consecutive ranks (rank r on node r // K): the nodes `--placement` "
        "sees. Default: the nodes MPI places the ranks on (ranks sharing memory); one node for "
        "`--backend local` and `batched`. Under mpirun/srun it overrides the nodes MPI reports; "
        "the run file records every rank's node and whether it was emulated",
        type=int,
        metavar="K",
        # the nodes only shape the topology under --placement nodes
        applies=(_PLACED, Applies(lambda c: c.get("placement") == "nodes", refuse=False)),
    )
    alpha: float = flag_field(  # Dirichlet heterogeneity (smaller = more heterogeneous)
        1.0,
        "Dirichlet data heterogeneity, > 0; smaller is more heterogeneous, `inf` an iid split "
        "(default 1.0). With few samples per worker (digits: some worker counts from ~500 up, for "
        "small and large A alike) Lin et al.'s Dirichlet draw may never succeed: the run is "
        "refused, naming the values",
        type=float,
        metavar="A",
    )
    lr: float | None = flag_field(  # per worker and step, before warm-up/decay
        None,
        "learning rate per worker and step, before warm-up and decay (task default: one per "
        "algorithm, tuned for 16 workers)",
        type=float,
        metavar="LR",
    )
    momentum: float | None = flag_field(None, help_text.momentum, type=float, metavar="M")
    nesterov: bool = flag_field(
        True,
        "heavy-ball instead of Nesterov momentum (default: Nesterov)",
        switch=True,
        option="--no-nesterov",
        # the momentum's form: no part of an experiment without momentum (never refused: a default
        # to many scripts)
        applies=(
            Applies(
                lambda c: bool(c.get("momentum")) and c.get("optimizer", "sgd") == "sgd",
                refuse=False,
            ),
        ),
    )
    optimizer: str | None = flag_field(
        None,
        lambda: f"local optimizer; {help_text.task_default('optimizer', str)}",
        choices=help_text.optimizer_names,
    )
    weight_decay: float | None = flag_field(
        None,
        lambda: f"L2 weight decay; {help_text.task_default('weight_decay')}",
        type=float,
        metavar="WD",
    )
    batch_size: int | None = flag_field(  # samples per worker per step
        None,
        lambda: f"samples per worker per step; {help_text.task_default('batch_size')}",
        type=int,
        metavar="B",
    )
    epochs: float | None = flag_field(None, _epochs, type=float, metavar="E")
    steps: int | None = flag_field(
        None,
        "training length in steps (instead of `--epochs`; quadratics needs it)",
        type=int,
        metavar="K",
    )
    warmup_epochs: float | None = flag_field(None, _warmup, type=float, metavar="E")
    milestones: tuple[float, ...] | None = flag_field(  # epochs at which the lr is divided by 10
        None, _milestones_text, type=_milestones, metavar="EPOCHS"
    )
    seed: int = flag_field(
        0,
        "seed of the data partition, data order, initial model, generated problem and simulated "
        "drops, in [0, 2^63 - 1] (default 0)",
        type=int,
        metavar="S",
    )
    drop_prob: float = flag_field(
        0.0,
        "simulated message loss probability in [0, 1), seeded and reproducible (default 0)",
        type=float,
        metavar="P",
        applies=(_DROPPABLE,),
    )
    # a late message counts as dropped (docs/membership.md, "Late messages")
    message_deadline: float | None = flag_field(
        None,
        "`--backend mpi`: seconds a rank waits for a neighbour's message once it is ready for it; "
        "one not arrived by then is dropped, with `--drop-prob`'s rule for the algorithm, and "
        "recorded in the run file (its `late_drops`); a neighbour that was late is not waited for "
        "again until it sends again, and a rank that sees a neighbour 4 steps ahead skips steps to "
        "catch up (recorded too); not for allreduce, d2, `--overlap` or `--relay-chunk` "
        "(default: wait for every message)",
        type=float,
        metavar="S",
        applies=(
            _DROPPABLE,
            _SOUND_DROP_RULE,
            Applies(
                lambda c: c.get("backend") == "mpi",
                lambda c: (
                    f"--backend {c.get('backend')} has no wire to be late on; replay an MPI "
                    "run's late drops with --replay-drops RUN.h5"
                ),
                identity=False,  # where it runs is not the experiment
            ),
            Applies(
                lambda c: c.get("overlap") is not True,
                lambda c: (
                    "--overlap sends a message in pieces, and a message must be late or on "
                    "time as a whole (use --no-overlap)"
                ),
                identity=False,
            ),
            Applies(
                lambda c: c.get("relay_chunk") is None,
                lambda c: (
                    "--relay-chunk sends RelaySum's messages in pieces, and a message must be "
                    "late or on time as a whole (leave out --relay-chunk)"
                ),
                identity=False,
            ),
        ),
    )
    replay_drops: Path | None = flag_field(
        None,
        "`--backend local` or `batched`: drop exactly the messages that a `--message-deadline` "
        "run file recorded as late, skip the steps it skipped and lose the workers it lost "
        "(both `local` only, losses with `--on-failure continue`; world size, algorithm and "
        "topology must match it): the same numbers as that MPI run (default: none)",
        type=Path,
        metavar="RUN.h5",
        applies=(
            _DROPPABLE,
            _SOUND_DROP_RULE,
            Applies(
                lambda c: c.get("backend") != "mpi",
                lambda c: (
                    "it replays an MPI run's late drops on --backend local or batched; on MPI, "
                    "--message-deadline makes them"
                ),
                identity=False,
            ),
        ),
    )
    # what the survivors do when a worker is lost (docs/membership.md): stop (the run fails, a
    # rerun resumes from its checkpoints) or continue (they shrink the membership and go on)
    on_failure: str = flag_field(
        "stop",
        "what the other workers do when one is lost mid-run: stop (the run fails) or continue "
        "(the survivors rebuild the topology among themselves and train to the end; MPI needs "
        "Open MPI with ULFM, `scripts/mpirun-ulfm`) (default stop)",
        choices=lambda: ("stop", "continue"),
        numbers=False,
        resume_free=True,
        applies=(
            Applies(
                lambda c: c.get("on_failure") != "continue" or c.get("overlap") is not True,
                lambda c: (
                    "--on-failure continue redoes an interrupted step from its start, and "
                    "--overlap starts the step inside backward (use --no-overlap)"
                ),
            ),
            Applies(
                lambda c: c.get("on_failure") != "continue" or not c.get("drop_prob"),
                lambda c: (
                    "--on-failure continue renumbers the workers after a loss, and simulated "
                    "drops are decided by worker number (use --drop-prob 0)"
                ),
            ),
        ),
    )
    # --on-failure continue on MPI: a process frozen this long is evicted as if lost (Open MPI's
    # heartbeat failure detector declares it failed; docs/membership.md#a-stalled-worker)
    peer_timeout: float | None = flag_field(
        None,
        "with `--on-failure continue` on MPI: a rank whose process gives no sign of life for S "
        "seconds (stopped, a paused machine) is evicted, and the others heal without it as "
        "after a loss (default: never)",
        type=float,
        metavar="S",
        numbers=False,
        resume_free=True,
        applies=(
            Applies(
                lambda c: c.get("on_failure") == "continue" and c.get("backend", "mpi") == "mpi",
                lambda c: (
                    "it evicts a stalled rank as a lost one, so it needs --on-failure continue "
                    "and --backend mpi"
                ),
            ),
        ),
    )
    # algorithms' options: each applies to the algorithms whose options have it
    # (relaympi.algorithms.options), and its text starts with them
    relay_mode: str | None = flag_field(  # "counts" (Algorithm 1) unless given
        None,
        "normalization under dropped messages: counts (Algorithm 1, default), previous (the "
        "paper's robust rule) or initial (missing models replaced by x(0))",
        choices=help_text.relay_modes,
    )
    relay_in_place: bool = flag_field(  # RelaySum swaps messages in its receive buffers
        False,
        f"RelaySum ({_NOT_BATCHED}) assembles messages in its receive buffers and swaps them chunk "
        "by chunk through a small bounce buffer: least memory, 2 model copies of state on a "
        "chain, 2.5 on double binary trees, instead of twice that, plus 2 x degree x chunk "
        "elements; same numbers",
        switch=True,
        numbers=False,
        applies=(
            Applies(
                lambda c: c.get("backend") != "batched",
                lambda c: (
                    "the batched engine keeps RelaySum's messages in one tensor per "
                    "tree and has no receive buffers to swap"
                ),
            ),
        ),
    )
    relay_chunk: int | None = flag_field(  # elements per message chunk (None: RelaySum's, 2^20)
        None,
        f"RelaySum ({_NOT_BATCHED}) sends messages in chunks of N elements, so that assembling "
        "one overlaps the transfer of the previous (default 2^20 = 1048576); same numbers for "
        "any N",
        type=int,
        metavar="N",
        numbers=False,
        applies=(
            Applies(
                lambda c: c.get("backend") != "batched",
                lambda c: "the batched engine sends no messages to chunk (it sums them as tensors)",
            ),
        ),
    )
    relay_lr_correction: bool = flag_field(  # the lr times RelaySGD's correction 1/(alpha n)
        False,
        "multiply the lr by RelaySGD's topology correction factor (the paper's 1/(alpha n), alpha "
        "there the weight an update keeps, not the Dirichlet alpha; `python -m relaympi.topology "
        "NAME -n N` prints it)",
        switch=True,
    )
    d2_force: bool = flag_field(
        False,
        "run D² even if the gossip matrix has an eigenvalue < -1/3 (or use `--d2-exact-diffusion`)",
        switch=True,
    )
    d2_exact_diffusion: bool = flag_field(
        False, "D² with the Exact Diffusion matrix (W+I)/2", switch=True
    )
    eval_every: int | None = flag_field(  # default: every task eval epoch
        None, help_text.eval_every, type=int, metavar="K"
    )
    checkpoint_every: int | None = flag_field(  # default: every eval
        None,
        "steps between periodic checkpoints (default: at every evaluation)",
        type=int,
        metavar="K",
        numbers=False,
        applies=(
            Applies(
                lambda c: c.get("checkpoint_dir") is not None,
                lambda c: "no checkpoints are written without --checkpoint-dir",
            ),
        ),
    )
    backend: str = flag_field(
        "mpi",
        "mpi (one worker per MPI rank), local (`--workers` threads in one process) or batched "
        "(`--workers` models as one vmapped computation on one device); default mpi",
        choices=lambda: BACKENDS,
        numbers=False,
        resume_free=True,
    )
    workers: int | None = flag_field(
        None,
        "number of workers for `--backend local` or `batched`",
        type=int,
        metavar="N",
        numbers=False,
        resume_free=True,
    )
    autocast: str | None = flag_field(  # "bf16": the batched engine's forward and backward
        None,
        "`--backend batched` only: run the models' forward and backward under `torch.autocast` in "
        "bfloat16 (parameters, optimizer, communication and evaluation stay float32). Default: "
        "off (float32)",
        choices=lambda: AUTOCAST_DTYPES,
        applies=(
            Applies(
                lambda c: c.get("backend") == "batched",
                lambda c: (
                    "it is the batched engine's mixed precision (--backend "
                    f"batched), not --backend {c.get('backend')}'s"
                ),
                identity=False,
            ),
            Applies(
                lambda c: c.get("backend") != "batched" or c.get("task") != "quadratics",
                lambda c: "quadratics run in float64 without a model to autocast",
                identity=False,
            ),
        ),
    )
    # per-bucket steps started from backward's hooks; the numbers are the same. Recorded as resolved
    overlap: bool | None = flag_field(
        None,
        "message passing (`--backend mpi/local`): start each gradient bucket's update and "
        "communication from backward's hooks as soon as its gradient is final, while backward "
        "computes the rest (`--no-overlap`: after backward); same numbers either way. Default: on "
        "when the MPI ranks span more than one node (as MPI or `--ranks-per-node` places them) on "
        "the CPU and the model is larger than one `--bucket-size` bucket, else off: it helps "
        "where backward is long enough to hide the step's transfers (a large model across a slow "
        "link), and a model of one bucket has nothing to start early; the run file records the "
        "one used",
        negatable=True,
        numbers=False,
        resume_free=True,
        applies=(_BATCHED_OVERLAP, _GPU_OVERLAP),
    )
    # how MPI progresses during backward; the numbers are the same. Recorded as resolved (asked
    # for and overlapping); whether it ran is the provenance's transport_progress_thread
    progress_thread: bool = flag_field(
        False,
        "`--overlap` on MPI: a thread runs MPI's progress engine every `--progress-interval` ms "
        "while backward computes, so the transfers started from the hooks keep moving between "
        "them (needs `MPI_THREAD_MULTIPLE`; it sleeps between polls; for ranks with a spare "
        "core). Default `--no-progress-thread`: only the hooks' `MPI_Test` calls progress them",
        negatable=True,
        numbers=False,
        resume_free=True,
        applies=(
            Applies(
                lambda c: c.get("backend") == "mpi" or not c.get("progress_thread"),
                lambda c: (
                    "it runs MPI's progress engine, and --backend "
                    f"{c.get('backend')} has none (its transfers are copies made in its own "
                    "calls)"
                ),
            ),
            Applies(
                lambda c: c.get("overlap") is not False or not c.get("progress_thread"),
                lambda c: (
                    "it progresses transfers started during backward, and "
                    "--no-overlap starts none there"
                ),
            ),
        ),
    )
    progress_interval: float = flag_field(  # the thread's poll period; the numbers are the same
        2.0,
        "`--progress-thread`'s poll period in ms (default 2): shorter keeps a fast link busier (a "
        "~4 MB socket buffer drains in 2 ms at 16 Gbit/s) and costs the ranks more wake-ups; same "
        "numbers for any period",
        type=float,
        metavar="MS",
        numbers=False,
        resume_free=True,
        applies=(
            Applies(
                lambda c: (
                    c.get("backend") == "mpi"
                    and c.get("overlap") is not False
                    and bool(c.get("progress_thread"))
                ),
                lambda c: (
                    "it sets the progress thread's poll period, and this run has "
                    "none (--progress-thread runs with --overlap on --backend mpi)"
                ),
            ),
        ),
    )
    # MiB of gradient per --overlap bucket: 1, 4 and 16 measured on VGG-11 (benchmarks.overlap,
    # docs/overlap.md): 16 overlaps least; at 4 and below each of VGG-11's large convolutions is
    # its own bucket
    bucket_size: float = flag_field(
        4.0,
        "`--overlap` only: MiB of the flat gradient per bucket, cut from the last layers (default "
        "4); same numbers for any size",
        type=float,
        metavar="MB",
        numbers=False,
        resume_free=True,
        applies=(
            Applies(
                lambda c: (
                    bool(c.get("overlap"))
                    or (c.get("overlap") is None and c.get("backend") == "mpi")
                ),
                lambda c: "it sizes --overlap's gradient buckets; without --overlap there are none",
            ),
        ),
    )
    out: Path | None = flag_field(
        None,
        "HDF5 run file to write (default "
        "`results/<task>-<algo>-<topology>-n<N>-a<alpha>-s<seed>.h5`, a plain file name in "
        "`results/`: `edge-list:/path/chain.txt` becomes "
        "`edge-list-chain-<8 hex digits of the file's SHA-256>`); a finished run (and a "
        "`--save-problem` file holding another problem) is never replaced without `--overwrite`",
        type=Path,
        metavar="PATH.h5",
        numbers=False,
        resume_free=True,
    )
    overwrite: bool = flag_field(
        False,
        "replace an existing completed run file (and an existing `--save-problem` file holding "
        "another problem)",
        switch=True,
        numbers=False,
        resume_free=True,
    )
    checkpoint_dir: Path | None = flag_field(
        None,
        "directory for per-rank checkpoints, one folder every node sees (refused otherwise); "
        "re-running the same command resumes from it (default: none, no checkpoints)",
        type=Path,
        metavar="DIR",
        numbers=False,
        resume_free=True,
    )
    data_dir: Path | None = flag_field(
        None,
        "data set directory (cifar10, imagenet, agnews; refused for digits and quadratics); "
        "default `<root>/<task>` under the data root (`$RELAYMPI_DATA`, else `~/.cache/relaympi`; "
        "`python -m relaympi.data` fills it); the run file's config records the resolved path",
        type=Path,
        metavar="DIR",
        numbers=False,
        applies=(
            Applies(
                lambda c: c.get("task") not in ("digits", "quadratics"),
                lambda c: (
                    f"{c.get('task')} reads no data set from disk ("
                    + (
                        "embedded in scikit-learn"
                        if c.get("task") == "digits"
                        else "generated or --problem-file"
                    )
                    + ")"
                ),
            ),
        ),
    )
    model_dir: Path | None = flag_field(
        None,
        "pretrained model directory (agnews only; default `<root>/distilbert` under the data "
        "root); the run file's config records the resolved path",
        type=Path,
        metavar="DIR",
        numbers=False,
        applies=(
            Applies(
                lambda c: c.get("task") == "agnews",
                lambda c: f"it is the pretrained model of --task agnews, not {c.get('task')}",
            ),
        ),
    )
    device: str = flag_field(
        "cpu",
        "torch device for models: cpu, cuda (the GPU of the node-local rank, modulo the GPU "
        "count) or cuda:N (default cpu)",
        numbers=False,
        resume_free=True,
    )
    threads: int | None = flag_field(  # torch intra-op threads per worker
        None,
        "torch intra-op threads per worker (batched: of the one process); default: this "
        "process's share of the CPUs it may run on (`taskset`, SLURM cpusets, cgroups), divided "
        "among the workers or node-local MPI ranks sharing them (bound ranks keep their own), "
        "capped by `OMP_NUM_THREADS` and `SLURM_CPUS_PER_TASK`, at least 1 (`--backend batched` "
        "on a CPU keeps the faster of that and 1, timed on its first step); recorded as "
        "`provenance.torch_threads`; a value above the share warns",
        type=int,
        metavar="N",
        numbers=False,
        resume_free=True,
    )
    loader_workers: int | None = flag_field(  # None: TaskOptions' default, 2
        None,
        "`--task imagenet` only: data-loading worker processes (0: in the training process; "
        "default 2)",
        type=int,
        metavar="N",
        numbers=False,
        resume_free=True,
        applies=(
            Applies(
                lambda c: c.get("task") == "imagenet",
                lambda c: (
                    f"only --task imagenet loads its data in loader processes, not {c.get('task')}"
                ),
            ),
        ),
    )
    eval_batch_size: int = flag_field(
        256,
        "samples per forward pass when evaluating on the test set (memory only, not the numbers; "
        "default 256)",
        type=int,
        metavar="B",
        numbers=False,
        resume_free=True,
    )
    log_every: int = flag_field(
        0,
        "steps between progress lines (0: at evaluations only; default 0)",
        type=int,
        metavar="K",
        numbers=False,
        resume_free=True,
    )
    # quadratics
    problem_file: Path | None = flag_field(
        None,
        "HDF5 problem file (datasets `A` [n,d,d], `b` [n,d], optional `x_star`, attribute "
        "`f_star`); read, never written. The run records the file's `dim` and `sigma2` (a "
        "different explicit `--dim`/`--sigma2` exits 2) and null for `mu`, `L`, `zeta2`, `r0` "
        "(refused: they shape a generated problem)",
        type=Path,
        metavar="PATH.h5",
        group=_QUADRATICS_FLAGS,
        applies=(_QUADRATICS,),
    )
    save_problem: Path | None = flag_field(
        None,
        "write the generated problem to this HDF5 file; an existing file holding another problem "
        "is refused unless `--overwrite`, one holding the same problem (rerunning the command) is "
        "left as it is",
        type=Path,
        metavar="PATH.h5",
        group=_QUADRATICS_FLAGS,
        numbers=False,
        applies=(_QUADRATICS,),
    )
    record_params: bool = flag_field(
        False,
        "record every worker's iterate at every evaluation",
        switch=True,
        group=_QUADRATICS_FLAGS,
        numbers=False,
        applies=(_QUADRATICS,),
    )
    # generated problem (QuadraticsSpec's defaults unless given); with --problem-file the run
    # records the file's dim and sigma2, and None for the generation-only mu, L, zeta2, r0
    dim: int | None = flag_field(
        None,
        "dimension d of the generated problem (default 50; with `--problem-file` it must match "
        "the file)",
        type=int,
        group=_QUADRATICS_FLAGS,
        applies=(_QUADRATICS,),
    )
    mu: float | None = flag_field(
        None,
        "smallest singular value of every A_i of the generated problem (default 0.5)",
        type=float,
        group=_QUADRATICS_FLAGS,
        applies=(_QUADRATICS, _GENERATED),
    )
    L: float | None = flag_field(
        None,
        "largest singular value of every A_i of the generated problem (default 1.0)",
        type=float,
        group=_QUADRATICS_FLAGS,
        applies=(_QUADRATICS, _GENERATED),
    )
    zeta2: float | None = flag_field(
        None,
        "heterogeneity 1/n sum ||grad f_i(x*)||^2 of the generated problem (default 1.0)",
        type=float,
        group=_QUADRATICS_FLAGS,
        applies=(_QUADRATICS, _GENERATED),
    )
    r0: float | None = flag_field(
        None,
        "initial distance ||x(0) - x*|| of the generated problem (default 10.0)",
        type=float,
        group=_QUADRATICS_FLAGS,
        applies=(_QUADRATICS, _GENERATED),
    )
    sigma2: float | None = flag_field(
        None,
        "gradient noise variance E||xi||^2 (default 0; with `--problem-file` it must match the "
        "file)",
        type=float,
        group=_QUADRATICS_FLAGS,
        applies=(_QUADRATICS,),
    )
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-able values (paths as strings, tuples as lists).

        Returns:
            Field name -> value, in field order.
        """
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
        """The RunConfig of ``to_dict()``'s values (paths and milestones converted back).

        Args:
            data: field name -> value; missing fields take their defaults.

        Returns:
            The RunConfig (not validated).

        Raises:
            ConfigError: a key that is not a field.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; allowed: {sorted(names)}")
        kwargs = dict(data)
        for key in (f.name for f, flag in FLAGS if flag.type is Path):
            if kwargs.get(key) is not None:
                kwargs[key] = Path(kwargs[key])
        if kwargs.get("milestones") is not None:
            kwargs["milestones"] = tuple(float(m) for m in kwargs["milestones"])
        return cls(**kwargs)


def flags_of(config_class: type = RunConfig) -> tuple[tuple[dataclasses.Field, Flag], ...]:
    """A config class's fields with their command-line flag, in --help's order."""
    return tuple(
        (f, f.metadata["flag"]) for f in dataclasses.fields(config_class) if "flag" in f.metadata
    )


# RunConfig's fields with their command-line flag, in --help's order
FLAGS = flags_of(RunConfig)

# Config keys that cannot change a run's numbers: where files go, how the work is spread over
# processes, threads and devices, logging and bookkeeping. Every other key is part of the
# experiment's identity (the report never merges two runs that differ in one of them).
NON_SEMANTIC_KEYS = frozenset(f.name for f, flag in FLAGS if not flag.numbers)
# Config keys that may differ between a run and its resumption (relaympi.training.checkpointing):
# where output goes and how the work is spread over processes, threads and devices
RESUME_FREE_KEYS = tuple(f.name for f, flag in FLAGS if flag.resume_free)


def run_file_config_keys() -> tuple[str, ...]:
    """Every key of a run file's `config` attribute: RunConfig's fields and the values derived at
    run time."""
    fields = (f.name for f in dataclasses.fields(RunConfig) if f.name != "extra")
    return (*fields, *RUN_FILE_ONLY_KEYS)
