"""Side by side with other systems: relaympi against torch DDP (gloo) and Decent-DP, one task.

Each pair runs relaympi (its launcher ``mpirun``, its run file) and a peer on one task, the
project's own: the peer's workers build their model, shard, batch stream, batch size, learning rate
and step count from relaympi's own plan (``relaympi.training.plan.resolve`` and
``build_workload``), so the comparison cannot drift from what relaympi trains. The systems run
alternately, A B A B, and the report gives per system the median [min-max] of

- ms/step: rank 0's wall clock per training step, without start-up and evaluation (relaympi: its
  run file's clock less its evaluation timer; a peer: its training loop), after a warm-up of a
  tenth of the steps (DDP builds its reducer, Decent-DP its buckets in their first steps);
- CPU s/step, all ranks (and the launcher): the CPU time of a run of ``--steps`` steps less that of
  a run of ``--steps // 10``, over the difference in steps, so start-up cancels;
- bytes/step per worker: relaympi's counted bytes; a peer's from its algorithm (DDP: gloo's ring
  all-reduce, 2 (n-1)/n of the model; Decent-DP: one model to one peer), marked ``est``;
- final test accuracy, the mean over workers of each worker's own model,

and per pair the ratio relaympi / peer of ms/step and CPU/step, rep by rep (median [min-max]).
``--variant NAME:VAR=VALUE[,VAR=VALUE...]`` adds a relaympi run with those environment variables to
each rep (after relaympi's own, before the peer's), with its ratios to the peer and to relaympi:
before and after a change of how relaympi waits, in the same alternation.

    python -m benchmarks.peers --workers 4 --reps 3                    # every pair
    python -m benchmarks.peers --workers 2 --pair allreduce:ddp --reps 5
    python -m benchmarks.peers --variant spin:RELAYMPI_WAIT=spin,RELAYMPI_AGREEMENT_LAG=0

Peers are optional (``pip install -e .[peers]``): a pair whose peer is missing is refused in one
line saying what to install. ``--worker`` is internal: one peer rank, started by this harness
with torch.distributed's environment (MASTER_ADDR, RANK, WORLD_SIZE, LOCAL_RANK, ...).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TASK = "digits"
# relaympi's side of each pair: (its --algo, its --topology or None for the default) and the peer
PAIRS: dict[str, tuple[str, str | None, str]] = {
    "allreduce:ddp": ("allreduce", None, "ddp"),
    "dpsgd:decent-dp": ("dpsgd", "alternating-ring", "decent-dp"),
}
# the peer's module, and what to install for it
PEER_NEEDS = {"ddp": ("torch.distributed", "torch"), "decent-dp": ("decent_dp", "decent-dp")}
DECENT_DP_TOPOLOGY = "ring"  # Decent-DP's one-peer ring: the pairs of relaympi's alternating-ring


@dataclass
class Measure:
    """One run of one system."""

    system: str
    ms_per_step: float
    cpu_s_per_step: float
    bytes_per_step: float
    bytes_estimated: bool
    accuracy: float


def missing_peer(peer: str) -> str | None:
    """The one line saying what to install for ``peer``, or None if it can run here."""
    module, package = PEER_NEEDS[peer]
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return f"peer {peer!r} needs {package}: pip install -e .[peers] (or pip install {package})"
    if module == "torch.distributed":
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            return f"peer {peer!r} needs torch.distributed with gloo (this torch has none)"
    return None


def warm_up(steps: int) -> int:
    """The first steps left out of ms/step (set-up in first steps: DDP's reducer, Decent-DP's
    buckets): a tenth."""
    return max(1, steps // 10)


def train_args(algo: str, topology: str | None, steps: int) -> list[str]:
    """relaympi.train's flags for the task both systems run; relaympi evaluates every tenth of the
    run, so that its run file's clock has a row at the end of the warm-up."""
    every = warm_up(steps)
    args = ["--task", TASK, "--algo", algo, "--steps", str(steps), "--eval-every", str(every)]
    return args + (["--topology", topology] if topology else [])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def mpirun() -> str:
    """The mpirun beside this interpreter, else on PATH."""
    exe = Path(sys.executable).parent / "mpirun"
    found = str(exe) if exe.exists() else shutil.which("mpirun")
    if found is None:
        raise SystemExit("benchmarks.peers: relaympi's side needs mpirun (pip install mpich)")
    return found


def run_relaympi(
    algo: str,
    topology: str | None,
    workers: int,
    steps: int,
    folder: Path,
    env: dict[str, str] | None = None,
) -> tuple[float, dict[str, float]]:
    """One relaympi run under mpirun: (its CPU seconds, all processes; the run file's figures);
    ``env``: environment variables of a variant."""
    from relaympi.results import read_run

    out = folder / f"relaympi-{time.monotonic_ns()}.h5"
    command = [mpirun(), "-n", str(workers), sys.executable, "-m", "relaympi.train"]
    command += [*train_args(algo, topology, steps), "--out", str(out)]
    before = _children_cpu()
    proc = subprocess.run(
        command, cwd=ROOT, env=_env() | (env or {}), capture_output=True, text=True
    )
    cpu = _children_cpu() - before
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks.peers: relaympi failed: {proc.stderr.strip()[-2000:]}")
    run = read_run(out)
    data = run.data
    # from the row at the end of the warm-up to the last, less rank 0's evaluations between
    timed = int(data["step"][-1] - data["step"][1])
    evaluation = float(data["time_eval_s"][-1][0] - data["time_eval_s"][1][0])
    done = int(data["step"][-1] - data["step"][0])
    figures = {
        "ms_per_step": 1e3 * (float(data["time_s"][-1] - data["time_s"][1]) - evaluation) / timed,
        "bytes_per_step": float((data["bytes_sent"][-1] - data["bytes_sent"][0]).mean()) / done,
        "accuracy": float(data["test_accuracy"][-1].mean()),
    }
    out.unlink()
    return cpu, figures


def run_peer(
    peer: str, algo: str, topology: str | None, workers: int, steps: int, folder: Path
) -> tuple[float, dict[str, float]]:
    """One peer run: ``workers`` processes of ``--worker`` with torch.distributed's environment;
    (their CPU seconds; rank 0's figures and the mean accuracy)."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tag = time.monotonic_ns()
    procs = []
    before = _children_cpu()
    for rank in range(workers):
        env = _env() | {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(workers),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(workers),
        }
        command = [sys.executable, "-m", "benchmarks.peers", "--worker", peer, "--algo", algo]
        command += ["--steps", str(steps), "--out", str(folder / f"{peer}-{tag}-{rank}.json")]
        command += ["--topology", topology] if topology else []
        procs.append(
            subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        )
    errors = [proc.communicate()[1] for proc in procs]
    cpu = _children_cpu() - before
    outs = [folder / f"{peer}-{tag}-{r}.json" for r in range(workers)]
    if any(proc.returncode for proc in procs):
        if not all(out.exists() for out in outs):
            raise SystemExit(f"benchmarks.peers: {peer} failed: {max(errors, key=len)[-2000:]}")
        # every rank wrote its figures, then one failed in torch.distributed's teardown (gloo
        # has aborted there with "terminate called without an active exception"): the run counts
        last = max(errors, key=len).strip().splitlines() or ["(no message)"]
        print(f"benchmarks.peers: {peer} failed after its figures were written: {last[-1]}")
    ranks = [json.loads(out.read_text()) for out in outs]
    figures = dict(ranks[0])
    figures["accuracy"] = statistics.fmean(r["accuracy"] for r in ranks)
    return cpu, figures


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:VAR=VALUE[,VAR=VALUE...]`` as (NAME, {VAR: VALUE}).

    Args:
        text: the --variant value.

    Returns:
        The variant's name and environment.

    Raises:
        ValueError: not of that form (one line).
    """
    name, _, assignments = text.partition(":")
    pairs = [item.partition("=") for item in assignments.split(",") if item]
    if not name or not pairs or any(not var or not sep for var, sep, _ in pairs):
        raise ValueError(f"--variant {text!r}; expected NAME:VAR=VALUE[,VAR=VALUE...]")
    return name, {var: value for var, _, value in pairs}


def measure_pair(
    pair: str,
    workers: int,
    steps: int,
    folder: Path,
    variants: dict[str, dict[str, str]] | None = None,
) -> tuple[Measure, ...]:
    """relaympi, each variant (relaympi with its environment), then the peer, each at ``steps`` and
    ``steps // 10`` steps (the CPU difference)."""
    algo, topology, peer = PAIRS[pair]
    short = max(1, steps // 10)
    results = []
    systems: dict[str, dict[str, str] | None] = {"relaympi": {}, **(variants or {}), peer: None}
    for system, env in systems.items():
        runs = {}
        for count in (steps, short):
            if env is not None:
                runs[count] = run_relaympi(algo, topology, workers, count, folder, env)
            else:
                runs[count] = run_peer(peer, algo, topology, workers, count, folder)
        cpu, figures = runs[steps]
        results.append(
            Measure(
                system=system,
                ms_per_step=figures["ms_per_step"],
                cpu_s_per_step=(cpu - runs[short][0]) / (steps - short),
                bytes_per_step=figures["bytes_per_step"],
                bytes_estimated=env is None,
                accuracy=figures["accuracy"],
            )
        )
    return tuple(results)


# -- one peer rank -------------------------------------------------------------------------------


def peer_worker(peer: str, algo: str, topology: str | None, steps: int, out: Path) -> None:
    """One rank of ``peer`` on relaympi's plan for the same flags: its model (same seed), shard,
    batch stream, lr and steps; writes rank 0's timing and this rank's accuracy to ``out``."""
    import torch
    import torch.distributed as dist

    from relaympi.config import parse_args
    from relaympi.optim import make_optimizer
    from relaympi.training.plan import resolve
    from relaympi.training.workloads import ModelWorkload, build_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    plan = resolve(parse_args(train_args(algo, topology, steps)), size)
    workload = build_workload(plan, rank, "cpu")
    assert isinstance(workload, ModelWorkload)  # the task is a classification task
    schedule = plan.schedule(workload.steps_per_epoch)
    task, sampler = workload.task, workload.sampler
    batches = task.train_batches(
        (sampler.batch(s) for s in range(steps)), (sampler.rng(s) for s in range(steps))
    )
    numel = sum(p.numel() for p in workload.model.parameters())
    if peer == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model: Any = DistributedDataParallel(workload.model)
        optimizer = make_optimizer(plan.optimizer, workload.x)
        bytes_per_step = 2 * (size - 1) / size * numel * 4  # gloo's ring all-reduce, float32
    else:
        from decent_dp.ddp import DecentralizedDataParallel

        lr = schedule.lr_at(0)
        model = DecentralizedDataParallel(
            workload.model,
            lambda named: torch.optim.SGD([p for _, p in named], lr=lr),
            topology=DECENT_DP_TOPOLOGY,
        )
        bytes_per_step = numel * 4.0  # one model to one peer
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        if step == warm_up(steps):
            start = time.perf_counter()
        inputs, targets = next(batches)
        model.train()
        loss = task.loss(task.forward(model, inputs), targets)
        loss.backward()
        if peer == "ddp":  # DDP averaged the gradients into workload.grad: relaympi's SGD step
            optimizer.begin_step()
            optimizer.update_range(workload.grad, workload.x, schedule.lr_at(step), 0, numel, True)
            workload.grad.zero_()
    elapsed = time.perf_counter() - start
    accuracy = workload.evaluate()["test_accuracy"]
    figures = {
        "ms_per_step": 1e3 * elapsed / (steps - warm_up(steps)),
        "bytes_per_step": bytes_per_step,
        "accuracy": accuracy,
    }
    out.write_text(json.dumps(figures))
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


# -- the report ----------------------------------------------------------------------------------


def _spread(values: list[float], digits: str = ".3g") -> str:
    return f"{statistics.median(values):{digits}} [{min(values):{digits}}-{max(values):{digits}}]"


def report(pair: str, reps: list[tuple[Measure, ...]]) -> str:
    """The pair's table: per system median [min-max], then the ratios rep by rep: each relaympi
    system to the peer (the last), and each variant to relaympi (the first)."""
    lines = [f"{pair}: {len(reps)} alternating rep(s), median [min-max]"]
    lines.append(
        f"  {'system':<10} {'ms/step':<22} {'CPU ms/step (all ranks)':<26} bytes/step    accuracy"
    )
    for side in range(len(reps[0])):
        runs = [rep[side] for rep in reps]
        est = " est" if runs[0].bytes_estimated else ""
        accuracy = ", ".join(f"{m.accuracy:.4f}" for m in runs)
        lines.append(
            f"  {runs[0].system:<10} {_spread([m.ms_per_step for m in runs]):<22} "
            f"{_spread([1e3 * m.cpu_s_per_step for m in runs]):<26} "
            f"{runs[0].bytes_per_step:<9.4g}{est:<4} {accuracy}"
        )
    last = len(reps[0]) - 1
    ratios = [(side, last) for side in range(last)] + [(side, 0) for side in range(1, last)]
    for side, base in ratios:
        ratio = [rep[side].ms_per_step / rep[base].ms_per_step for rep in reps]
        cpu = [rep[side].cpu_s_per_step / rep[base].cpu_s_per_step for rep in reps]
        names = f"{reps[0][side].system}/{'peer' if base == last else reps[0][base].system}"
        lines.append(
            f"  ratio {names}: ms/step {_spread(ratio, '.2f')}x, CPU {_spread(cpu, '.2f')}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The harness (or, with ``--worker``, one peer rank).

    Args:
        argv: the command line without the program name (None: sys.argv[1:]).

    Returns:
        The exit status: 0, or 2 for a bad flag or a peer that is not installed.
    """
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--workers", type=int, default=4, help="ranks per system (default 4)")
    parser.add_argument("--reps", type=int, default=3, help="alternating reps per pair (default 3)")
    parser.add_argument(
        "--steps", type=int, default=200, help="training steps per run (default 200)"
    )
    parser.add_argument(
        "--pair", action="append", choices=sorted(PAIRS), help="a pair to run (default: every pair)"
    )
    parser.add_argument("--json", type=Path, help="also write every measure to this file")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:VAR=VALUE[,VAR=VALUE...]: also run relaympi with these environment variables",
    )
    parser.add_argument("--worker", choices=sorted(PEER_NEEDS), help=argparse.SUPPRESS)
    parser.add_argument("--algo", help=argparse.SUPPRESS)
    parser.add_argument("--topology", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        peer_worker(args.worker, args.algo, args.topology, args.steps, args.out)
        return 0
    if args.workers < 2 or args.reps < 1 or args.steps < 10:
        parser.error(
            f"--workers >= 2, --reps >= 1 and --steps >= 10 are allowed, got {args.workers}, "
            f"{args.reps} and {args.steps}"
        )
    try:
        variants = dict(parse_variant(text) for text in args.variant)
    except ValueError as exc:
        parser.error(str(exc))
    pairs = args.pair or sorted(PAIRS)
    for pair in pairs:
        if (missing := missing_peer(PAIRS[pair][2])) is not None:
            print(f"benchmarks.peers: {missing}", file=sys.stderr)
            return 2
    measures: dict[str, list[tuple[Measure, ...]]] = {}
    with tempfile.TemporaryDirectory(prefix="relaympi-peers-") as tmp:
        for pair in pairs:
            measures[pair] = [
                measure_pair(pair, args.workers, args.steps, Path(tmp), variants)
                for _ in range(args.reps)
            ]
            print(report(pair, measures[pair]), flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {p: [[asdict(m) for m in rep] for rep in reps] for p, reps in measures.items()}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
