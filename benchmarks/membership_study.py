"""What losing workers costs in accuracy: each algorithm and heterogeneity, a few losses mid-run,
against the uninterrupted run and against a run that had only the survivors from the start.

    python -m benchmarks.membership_study --out bench-results/membership-study
    python -m benchmarks.membership_study --seeds 0,1 --algos relay,dpsgd --alphas 0.01,1

Every run is the trainer in a subprocess (``--on-failure continue``, the batched engine by
default), its losses injected with RELAYMPI_INJECT_FAILURE (the lost workers vanish at the start of
their step). For each algorithm, alpha and seed it runs:

- ``full``: no loss;
- ``lose K @ P%``: the workers of ``--lose`` (K of them) lost at P% of the uninterrupted run's
  steps, for each P of ``--at``;
- ``survivors K``: the same workers lost at step 0, so only the survivors ever train (their data
  partition is the one of all workers: the lost workers' shards are never seen).

The table gives the paper metric (the report's: digits, the worst worker's mean test accuracy over
the last 5 epochs; and the mean worker's) over the workers that finished, per
seed and their mean, and its difference to ``full`` and to ``survivors K``. Run files that
already completed under ``--out`` are reused (``--rerun`` to run them again). Each scenario's runs
lie in a folder of their own (``OUT/lose5_at25``, ``OUT/full``, ...), which ``python -m
relaympi.report`` can read; over all of them at once it would take runs that differ only in their
losses for duplicates.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from relaympi.report.summary import ReportSettings, summarize
from relaympi.results import read_run


@dataclass(frozen=True)
class Scenario:
    name: str
    lost: tuple[int, ...] = ()
    at: float | None = None  # fraction of the run's steps; 0: from the start


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def scenarios(losses: list[tuple[int, ...]], at: list[float]) -> list[Scenario]:
    """``full``, each loss at each fraction, and each loss from the start (``survivors``)."""
    found = [Scenario("full")]
    for lost in losses:
        for fraction in at:
            found.append(Scenario(f"lose {len(lost)} @ {fraction:.0%}", lost, fraction))
    for lost in losses:
        found.append(Scenario(f"survivors {len(lost)}", lost, 0.0))
    return found


def run_file(out: Path, algo: str, alpha: float, seed: int, scenario: Scenario) -> Path:
    """OUT/SCENARIO/ALGO_alphaA_seedS.h5: one folder per scenario, because the report takes runs
    that differ only in their losses (injected, not flags) for duplicates of one configuration."""
    tag = "full" if scenario.at is None else f"lose{'-'.join(map(str, scenario.lost))}"
    if scenario.at is not None:
        tag += f"_at{round(scenario.at * 100)}"
    return out / tag / f"{algo}_alpha{alpha:g}_seed{seed}.h5"


def train(
    args: argparse.Namespace, path: Path, algo: str, alpha: float, seed: int, inject: str | None
) -> None:
    """One trainer run in a subprocess; raises with its output's tail if it did not complete."""
    if path.exists() and not args.rerun:
        try:
            if read_run(path).status == "completed":
                return
        except Exception:  # a damaged or partial file: run it again
            pass
    command = [
        sys.executable, "-m", "relaympi.train",
        "--task", args.task, "--algo", algo, "--alpha", f"{alpha:g}", "--seed", str(seed),
        "--backend", args.backend, "--workers", str(args.workers),
        "--on-failure", "continue", "--out", str(path), "--overwrite", *args.train_args,
    ]  # fmt: skip
    env = dict(os.environ)
    env.pop("RELAYMPI_INJECT_FAILURE", None)
    if inject:
        env["RELAYMPI_INJECT_FAILURE"] = inject
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"membership_study: {' '.join(command)} (RELAYMPI_INJECT_FAILURE={inject}) "
            f"exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-2000:]}"
        )
    print(f"  {path.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)


def metric(path: Path, name: str) -> tuple[float, int, int]:
    """The paper metric over the workers that finished, how many finished, and of how many."""
    run = read_run(path)
    if run.status != "completed":
        raise SystemExit(f"membership_study: {path} is {run.status}, not completed")
    summary = summarize(run, ReportSettings(metric=name))
    return summary.metric, len(run.finished_workers), run.world_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.membership_study",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results/membership-study"))
    parser.add_argument("--task", default="digits")
    parser.add_argument("--algos", default="relay,dpsgd", help="comma-separated (relay,dpsgd)")
    parser.add_argument("--alphas", default="0.01,1", help="comma-separated Dirichlet alphas")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (0)")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--backend", default="batched", choices=("batched", "local"))
    parser.add_argument(
        "--lose",
        default="5;5,6,7,8",
        help="the workers each scenario loses (original ids), ';' between sets (5;5,6,7,8)",
    )
    parser.add_argument(
        "--at", default="0.25,0.5", help="when, as fractions of the run's steps (0.25,0.5)"
    )
    parser.add_argument(
        "--metrics", default="worst,mean", help="worst and/or mean: one table each (worst,mean)"
    )
    parser.add_argument("--rerun", action="store_true", help="run again what --out already has")
    parser.add_argument(
        "train_args", nargs=argparse.REMAINDER, help="-- further trainer flags (e.g. --epochs 10)"
    )
    args = parser.parse_args(argv)
    args.train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    losses = [_ints(part) for part in args.lose.split(";") if part]
    for lost in losses:
        if not lost or min(lost) < 0 or max(lost) >= args.workers or len(lost) >= args.workers:
            parser.error(f"--lose {args.lose}: each set names 1 to workers-1 ids below --workers")
    at = [float(x) for x in args.at.split(",") if x]
    if any(not 0 < x < 1 for x in at):
        parser.error(f"--at {args.at}: fractions strictly between 0 and 1")
    algos = [a for a in args.algos.split(",") if a]
    alphas = [float(a) for a in args.alphas.split(",") if a]
    seeds = list(_ints(args.seeds))
    table = scenarios(losses, at)

    metrics = [m for m in args.metrics.split(",") if m]
    if not metrics or any(m not in ("worst", "mean") for m in metrics):
        parser.error(f"--metrics {args.metrics}: worst and/or mean")
    values: dict[tuple[str, str, float, str], list[float]] = {}
    finished: dict[tuple[str, float, str], str] = {}
    for algo in algos:
        for alpha in alphas:
            for seed in seeds:
                print(f"{algo} alpha {alpha:g} seed {seed}", file=sys.stderr)
                full = run_file(args.out, algo, alpha, seed, table[0])
                train(args, full, algo, alpha, seed, None)
                steps = int(read_run(full).attrs["total_steps"])
                for scenario in table:
                    path = run_file(args.out, algo, alpha, seed, scenario)
                    if scenario.at is not None:
                        step = round(scenario.at * steps)
                        inject = ",".join(f"{r}:{step}" for r in scenario.lost)
                        train(args, path, algo, alpha, seed, inject)
                    for name in metrics:
                        value, kept, total = metric(path, name)
                        values.setdefault((name, algo, alpha, scenario.name), []).append(value)
                    finished[(algo, alpha, scenario.name)] = f"{kept}/{total}"

    def mean(xs: list[float]) -> float:
        return math.fsum(xs) / len(xs)

    lost_text = "; ".join(",".join(map(str, lost)) for lost in losses)
    seed_cols = " | ".join(f"seed {s}" for s in seeds)
    for name in metrics:
        print(
            f"\n{args.task}, {args.workers} workers, --backend {args.backend}; lost workers "
            f"{lost_text}; paper metric ({name} worker, last 5 epochs) over the workers that "
            "finished, in %"
        )
        print(f"| algo | alpha | scenario | workers | {seed_cols} | mean | vs full | vs surv. |")
        print("|---|---|---|---|" + "---|" * len(seeds) + "---|---|---|")
        for algo in algos:
            for alpha in alphas:
                base = mean(values[(name, algo, alpha, "full")])
                for scenario in table:
                    got = values[(name, algo, alpha, scenario.name)]
                    m = mean(got)
                    vs_full = "" if scenario.at is None else f"{100 * (m - base):+.2f}"
                    vs_surv = ""
                    if scenario.at:
                        surv = f"survivors {len(scenario.lost)}"
                        vs_surv = f"{100 * (m - mean(values[(name, algo, alpha, surv)])):+.2f}"
                    per_seed = " | ".join(f"{100 * v:.2f}" for v in got)
                    print(
                        f"| {algo} | {alpha:g} | {scenario.name} "
                        f"| {finished[(algo, alpha, scenario.name)]} | {per_seed} | {100 * m:.2f} "
                        f"| {vs_full} | {vs_surv} |"
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
