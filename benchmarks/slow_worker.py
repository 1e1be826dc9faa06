"""One worker at half speed for a whole training run: what it costs each algorithm in time to the
cost table's target accuracy, in its worst worker's final accuracy, and in dropped messages.

Each algorithm (``--algos``; default RelaySGD on its default topology, D-PSGD on a ring and
all-reduce) trains ``mpirun -n RANKS python -m relaympi.train --task digits --alpha 0.01``, one
run after the other: **clean** (nobody slow, no deadline); **clean-deadline** (nobody slow, with
``--message-deadline``: the messages the machine alone makes late); **slow**: one worker
(``--slow-rank``) held from outside for the whole run, SIGSTOP for ``--stop-ms`` of every
``--period-ms`` (50 of 100: half speed), with the deadline. All-reduce cannot take a deadline (it
waits): it runs clean and slow only.

    python -m benchmarks.slow_worker -- --eval-every 12

Everything after ``--`` goes to every run's ``python -m relaympi.train`` (after the task's flags,
so it may change them). Per run it prints rank 0's milliseconds per step and the time to the target
as the report's cost table computes them (``relaympi.report.cost``: the target is 95% of the clean
all-reduce run's accuracy, the paper's metric), the worst and the mean worker's final test
accuracy, the late drops over the messages due and the steps skipped. Run files (and each job's
log) go under bench-results/slow_worker/; ``summary.json`` there holds every figure.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.slow_neighbour import add_hold_arguments, hold
from relaympi.entrypoint import UsageParser
from relaympi.report.cost import experiment_record, family_target
from relaympi.report.summary import ReportSettings, RunSummary, summarize
from relaympi.report.tables import Family
from relaympi.results import read_run
from relaympi.results.reader import Run
from relaympi.topology import ONE_PEER_NAMES

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench-results" / "slow_worker"
TASK = ["--task", "digits", "--alpha", "0.01"]
DEFAULT_ALGOS = "relay,dpsgd:ring,allreduce"
# algorithms whose every step sends one message each way over each edge of each layer of the
# topology (a RelaySum tree, or a fixed gossip graph): their messages due are countable from the
# run file's topology; the collective sends none point to point
PER_EDGE = ("relay", "relay-grad", "dpsgd")
COLLECTIVE = ("allreduce",)
# flags the benchmark sets itself
OWN_FLAGS = ("--algo", "--topology", "--message-deadline", "--out", "--backend", "--workers")
# each algorithm's runs, in order (a collective: the first and the last)
CONDITIONS = ("clean", "clean-deadline", "slow")
DEADLINE_FACTOR = 2.0  # the default deadline: this many times the algorithm's clean step time


def parse_algos(text: str) -> list[tuple[str, str | None]]:
    """The ``--algos`` list: comma-separated ALGO or ALGO:TOPOLOGY.

    Args:
        text: e.g. ``relay,dpsgd:ring,allreduce``.

    Returns:
        (algorithm, topology or None for its default) in the order given.

    Raises:
        ValueError: an empty entry, an algorithm whose messages this benchmark cannot count, a
            topology given to all-reduce, or a one-peer topology (its steps send one message
            per worker, not one per edge).
    """
    algos: list[tuple[str, str | None]] = []
    for entry in text.split(","):
        algo, _, topology = entry.strip().partition(":")
        if not algo:
            raise ValueError(f"--algos: an empty entry in {text!r}")
        if algo not in (*PER_EDGE, *COLLECTIVE):
            raise ValueError(
                f"--algos: {algo!r} is not one of {', '.join((*PER_EDGE, *COLLECTIVE))}"
            )
        if algo in COLLECTIVE and topology:
            raise ValueError(f"--algos: {algo} takes no topology, got {topology!r}")
        if topology in ONE_PEER_NAMES:
            raise ValueError(
                f"--algos: {topology!r} is a one-peer topology; give a fixed graph or tree"
            )
        algos.append((algo, topology or None))
    return algos


def messages_due(run: Run) -> int | None:
    """The messages a run's workers were due to receive: one per step each way over each edge of
    each layer of the topology the run file records (RelaySGD's trees, D-PSGD's fixed graph).

    Args:
        run: a completed run of an algorithm of ``PER_EDGE`` or ``COLLECTIVE``, read with its
            ``step`` dataset and its topology, without membership changes.

    Returns:
        steps x 2 x (edges summed over layers), the steps being the last evaluation's; None for a
        collective (nothing point to point).

    Raises:
        ValueError: another algorithm, a one-peer topology, no topology recorded, or a run that
            lost workers (its edges changed mid-run).
    """
    algo = str(run.config.get("algo"))
    if algo in COLLECTIVE:
        return None
    if algo not in PER_EDGE:
        raise ValueError(f"{run.path}: cannot count the messages of --algo {algo}")
    if run.topology is None:
        raise ValueError(f"{run.path}: no topology recorded")
    if run.topology.name in ONE_PEER_NAMES:
        raise ValueError(f"{run.path}: a one-peer topology ({run.topology.name})")
    if run.membership:
        raise ValueError(f"{run.path}: its workers changed mid-run")
    steps = int(np.asarray(run.data["step"])[-1])
    return steps * 2 * sum(len(edges) for edges in run.topology.edges)


@dataclass(frozen=True)
class Figures:
    """One run's figures."""

    algo: str
    topology: str
    condition: str  # clean | clean-deadline | slow
    round: int
    deadline_s: float | None
    step_ms: float  # rank 0's wall time per step less evaluation: the cost table's median
    time_to_target_s: float | None  # None: never reached
    worst_final: float  # the worst worker's test accuracy at the last evaluation
    mean_final: float
    metric: float  # the paper's metric (the report's accuracy cell)
    late_drops: int | None  # None: no --message-deadline
    late_from_slow: int | None  # of those, the slow worker's messages
    due: int | None  # messages due to be received (None: a collective)
    skipped: int | None  # steps workers skipped to catch up (None: no --message-deadline)
    skipped_by_slow: int | None  # of those, the slow worker's
    load_before: float
    load_after: float
    path: str

    @property
    def dropped_fraction(self) -> float | None:
        """Late drops over the messages due (None where either is unknown)."""
        if self.late_drops is None or not self.due:
            return None
        return self.late_drops / self.due


def run_figures(
    path: Path,
    summary: RunSummary,
    target: float | None,
    *,
    condition: str,
    round_: int,
    slow_rank: int,
    deadline: float | None,
    load: tuple[float, float],
) -> Figures:
    """One run file's figures: the cost table's step time and time to ``target``, final
    accuracies, and its late drops over the messages due.

    Args:
        path: the run file.
        summary: its report summary (``summarize``).
        target: the cost table's target accuracy (None: no target).
        condition: "clean", "clean-deadline" or "slow".
        round_: the round it ran in.
        slow_rank: the worker held in a slow run (its late messages are counted apart).
        deadline: the --message-deadline it ran with (None: none).
        load: the machine's 1-minute load average before and after it.

    Returns:
        The figures.
    """
    run = read_run(path, datasets=["step", "test_accuracy"])
    record = experiment_record([summary], target)
    final = np.asarray(run.data["test_accuracy"], dtype=float)
    final = final.reshape(len(final), -1)[-1]
    late, skips = run.late_drops, run.skipped_steps
    skips = np.zeros((0, 2), dtype=np.int64) if skips is None else skips
    return Figures(
        algo=summary.algo,
        topology=summary.topology,
        condition=condition,
        round=round_,
        deadline_s=deadline,
        step_ms=float(record["step_ms"]),
        time_to_target_s=float(record["time_to_target_s"]) if record["n_reached"] else None,
        worst_final=float(np.min(final)),
        mean_final=float(np.mean(final)),
        metric=float(summary.metric),
        late_drops=None if late is None else len(late),
        late_from_slow=None if late is None else int(np.sum(late[:, 3] == slow_rank)),
        due=messages_due(run),
        skipped=None if late is None else len(skips),
        skipped_by_slow=None if late is None else int(np.sum(skips[:, 1] == slow_rank)),
        load_before=load[0],
        load_after=load[1],
        path=str(path),
    )


def _text(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:{spec}}{unit}"


def _drops(f: Figures) -> str:
    if f.due is None:
        return "-"
    if f.late_drops is None:
        return f"none of {f.due}"
    fraction = f.dropped_fraction or 0.0
    return f"{f.late_drops} / {f.due} ({100 * fraction:.2f}%; {f.late_from_slow} from the slow one)"


def _skips(f: Figures) -> str:
    if f.skipped is None:
        return "-"
    return f"{f.skipped} ({f.skipped_by_slow} by the slow one)" if f.skipped else "0"


# the table's columns after the algorithm and the run: a header and a run's cell
COLUMNS: tuple[tuple[str, Callable[[Figures], str]], ...] = (
    (
        "deadline",
        lambda f: _text(None if f.deadline_s is None else 1e3 * f.deadline_s, ".0f", " ms"),
    ),
    ("ms/step", lambda f: _text(f.step_ms, ".1f")),
    (
        "time to target",
        lambda f: "never" if f.time_to_target_s is None else _text(f.time_to_target_s, ".1f", " s"),
    ),
    ("worst final", lambda f: _text(100 * f.worst_final, ".1f", "%")),
    ("mean final", lambda f: _text(100 * f.mean_final, ".1f", "%")),
    ("late drops / due", _drops),
    ("steps skipped", _skips),
)


def table_lines(figures: Sequence[Figures]) -> list[str]:
    """A Markdown table of ``figures``: a row per algorithm and condition, rounds side by side.

    Args:
        figures: the runs' figures, in run order.

    Returns:
        The table's lines.
    """
    header = ["algorithm", "run", *(name for name, _ in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    rows: dict[tuple[str, str, str], list[Figures]] = {}
    for f in figures:
        rows.setdefault((f.algo, f.topology, f.condition), []).append(f)
    for (algo, topology, condition), group in rows.items():
        cells = [", ".join(cell(f) for f in group) for _, cell in COLUMNS]
        lines.append("| " + " | ".join([f"{algo} ({topology})", condition, *cells]) + " |")
    return lines


def _parser() -> UsageParser:
    parser = UsageParser(
        prog="python -m benchmarks.slow_worker",
        usage="python -m benchmarks.slow_worker [OPTIONS] [-- TRAIN FLAGS]",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--ranks", type=int, default=16, help="MPI ranks (default 16)")
    parser.add_argument(
        "--algos",
        default=DEFAULT_ALGOS,
        help=f"ALGO or ALGO:TOPOLOGY, comma-separated, of {', '.join((*PER_EDGE, *COLLECTIVE))} "
        f"(default {DEFAULT_ALGOS})",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="--message-deadline of the runs with one, seconds (default: "
        f"{DEADLINE_FACTOR:g} times each algorithm's clean ms/step of the first round)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternated rounds (default 1)")
    parser.add_argument(
        "--out",
        type=Path,
        default=OUT,
        help="folder of the run files and summary.json (default bench-results/slow_worker)",
    )
    add_hold_arguments(parser)
    return parser


def _check(parser: UsageParser, args: Any, train: list[str]) -> list[tuple[str, str | None]]:
    """The parsed --algos; every misuse refused in one line (exit 2)."""
    try:
        algos = parse_algos(args.algos)
    except ValueError as error:
        parser.error(str(error))
    if args.ranks < 3:
        parser.error(f"--ranks must be >= 3 (a ring), got {args.ranks}")
    if not 0 <= args.slow_rank < args.ranks:
        parser.error(f"--slow-rank must be in [0, {args.ranks - 1}], got {args.slow_rank}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.deadline is not None and not (args.deadline > 0 and math.isfinite(args.deadline)):
        parser.error(f"--deadline must be a positive number of seconds, got {args.deadline}")
    if not 0 < args.stop_ms < args.period_ms:
        parser.error(
            f"--stop-ms must be in (0, --period-ms = {args.period_ms:g}), got {args.stop_ms:g}"
        )
    for flag in train:
        if flag.split("=", 1)[0] in OWN_FLAGS:
            parser.error(f"{flag.split('=', 1)[0]} after -- is the benchmark's own; leave it out")
    return algos


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ours, train = argv[:split], argv[split + 1 :]
    parser = _parser()
    args = parser.parse_args(ours)
    algos = _check(parser, args, train)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    settings = ReportSettings()
    deadlines: dict[tuple[str, str | None], float | None] = {
        key: (None if key[0] in COLLECTIVE else args.deadline) for key in algos
    }
    done: list[tuple[Path, RunSummary, str, int, float | None, tuple[float, float]]] = []
    print(
        f"slow worker: rank {args.slow_rank} of {args.ranks}, stopped {args.stop_ms:g} ms of "
        f"every {args.period_ms:g} ms; train flags {' '.join([*TASK, *train])}"
    )
    for round_ in range(args.rounds):
        for algo, topology in algos:
            conditions = CONDITIONS[::2] if algo in COLLECTIVE else CONDITIONS
            for condition in conditions:
                deadline = None if condition == "clean" else deadlines[(algo, topology)]
                name = f"{algo}-{topology or 'default'}-{condition}-{round_}"
                path = out / f"{name}.h5"
                command = [args.mpirun, "-n", str(args.ranks), sys.executable, "-m"]
                command += ["relaympi.train", *TASK, "--algo", algo, *train]
                command += ["--topology", topology] if topology else []
                command += ["--message-deadline", f"{deadline:g}"] if deadline else []
                command += ["--out", str(path), "--overwrite"]
                before = os.getloadavg()[0]
                with open(path.with_suffix(".log"), "w") as log:  # the job's own lines
                    job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
                holder = None
                if condition == "slow":
                    holder = threading.Thread(
                        target=hold,
                        args=(job, args.slow_rank, args.stop_ms / 1e3, args.period_ms / 1e3),
                        daemon=True,
                    )
                    holder.start()
                started = time.monotonic()
                if job.wait() != 0:
                    print(
                        f"{name}: exit {job.returncode} (log: {path.with_suffix('.log')})",
                        file=sys.stderr,
                    )
                    return 1
                if holder is not None:
                    holder.join()
                load = (before, os.getloadavg()[0])
                summary = summarize(read_run(path), settings)
                costs = experiment_record([summary], None)
                print(
                    f"round {round_} {name}: {costs['step_ms']:.1f} ms/step, "
                    f"{time.monotonic() - started:.0f} s in all, worst final "
                    f"{_final_worst(path):.3f} (load {load[0]:.1f} before, {load[1]:.1f} after)",
                    flush=True,
                )
                if condition == "clean" and deadlines[(algo, topology)] is None:
                    if algo not in COLLECTIVE:
                        seconds = DEADLINE_FACTOR * costs["step_ms"] / 1e3
                        deadlines[(algo, topology)] = round(seconds, 4)
                        print(
                            f"{algo}: --message-deadline {seconds:.4f} "
                            f"({DEADLINE_FACTOR:g} x its clean {costs['step_ms']:.1f} ms/step)"
                        )
                done.append((path, summary, condition, round_, deadline, load))
    clean = [summary for _, summary, condition, *_ in done if condition == "clean"]
    target, words = family_target(Family("slow-worker", "clean runs", {}, clean), settings)
    print(f"target (the cost table's rule over the clean runs): {words}")
    figures = [
        run_figures(
            path,
            summary,
            target,
            condition=condition,
            round_=round_,
            slow_rank=args.slow_rank,
            deadline=deadline,
            load=load,
        )
        for path, summary, condition, round_, deadline, load in done
    ]
    print("\n".join(table_lines(figures)))
    (out / "summary.json").write_text(
        json.dumps(
            {
                "argv": argv,
                "target": target,
                "target_words": words,
                "runs": [{**asdict(f), "dropped_fraction": f.dropped_fraction} for f in figures],
            },
            indent=1,
        )
        + "\n"
    )
    return 0


def _final_worst(path: Path) -> float:
    accuracy = np.asarray(read_run(path, datasets=["test_accuracy"]).data["test_accuracy"])
    return float(np.min(accuracy.reshape(len(accuracy), -1)[-1]))


if __name__ == "__main__":
    raise SystemExit(main())
