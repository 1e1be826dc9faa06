"""Step time with and without --overlap: compute, communication and exposed communication per step.

    python -m benchmarks.overlap                                          # one node: mpirun -n 2,
    VGG-11, relay and allreduce
    python -m benchmarks.overlap --nodes 2 --ranks-per-node 1 --links 1500mbit,3gbit,6gbit   # the
    tables of docs/benchmarks.md
    python -m benchmarks.overlap --nodes 2 --ranks-per-node 1 --links 250mbit,500mbit,1gbit   #
    emulated cluster (root)
    python -m benchmarks.overlap --nodes 2 --ranks-per-node 2 --links 500mbit --algos relay
    python -m benchmarks.overlap --device cuda --batch-size 128               # GPU ranks, messages
    staged through the host

Each case trains VGG-11 (generated CIFAR-10 files: a speed test) through ``python -m
relaympi.train``
once per variant — off (``--no-overlap``), hooks (``--overlap --no-progress-thread``: only the
hooks'
MPI calls progress the transfers) and thread (``--overlap --progress-thread``) — alternating,
``--repeat``
times, and reads its timers from the run file: per step, over the evaluation intervals after the
first (warm-up), the median of the slowest rank's
- compute: ``time_compute_s`` (forward and backward; with --overlap also the bucket work that the
  hooks start inside backward),
- comm: ``time_comm_s`` (without --overlap: the whole algorithm step, "communication alone"; with
  --overlap: what is left after backward, the exposed communication),
- step: wall time per step, evaluations left out;
and "vs off": step over the off variant's step. The rows and the provenance go to ``--out`` (HDF5).
With --nodes the emulated cluster (cluster/local_cluster.sh start --nodes N --link RATE) is started
once, its links reshaped for every rate, and always stopped at the end; ranks start in the nodes'
namespaces (mpiexec's rsh launcher), so every byte between nodes crosses the shaped links.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relaympi.results import read_run

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster" / "local_cluster.sh"
VARIANTS = {
    "off": ["--no-overlap"],
    "hooks": ["--overlap", "--no-progress-thread"],
    "thread": ["--overlap", "--progress-thread"],
}


def variant_flags(variant: str, args: argparse.Namespace) -> list[str]:
    flags = list(VARIANTS[variant])
    if variant != "off":
        flags += ["--bucket-size", str(args.bucket_size)]
    if variant == "thread" and args.progress_interval is not None:
        flags += ["--progress-interval", str(args.progress_interval)]
    return flags


@dataclass(frozen=True)
class Timing:
    compute_ms: float
    comm_ms: float
    step_ms: float


def timing(path: Path) -> Timing:
    """Per-step medians over the evaluation intervals after the first, the slowest rank's."""
    data = read_run(path).data
    steps = np.diff(data["step"].astype(float))
    per = {}
    for key in ("time_compute_s", "time_comm_s", "time_eval_s"):
        per[key] = np.diff(data[key], axis=0) / steps[:, None]  # [intervals, workers]
    wall = np.diff(data["time_s"].astype(float)) / steps - per["time_eval_s"].max(axis=1)
    keep = slice(1, None) if len(steps) > 1 else slice(None)  # the first interval warms up

    def ms(values: np.ndarray) -> float:
        return 1e3 * float(statistics.median(values[keep]))

    return Timing(
        ms(per["time_compute_s"].max(axis=1)), ms(per["time_comm_s"].max(axis=1)), ms(wall)
    )


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _median(timings: list[Timing]) -> Timing:
    return Timing(
        *(
            statistics.median(getattr(t, name) for t in timings)
            for name in ("compute_ms", "comm_ms", "step_ms")
        )
    )


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("error: no mpiexec beside the Python interpreter or on PATH")
    return found


def launch_prefix(ranks: int, per_node: int, env: dict[str, str]) -> list[str]:
    if "RELAYMPI_CLUSTER_LAUNCHER" in env:
        return [
            _mpiexec(),
            "-launcher",
            "rsh",
            "-launcher-exec",
            env["RELAYMPI_CLUSTER_LAUNCHER"],
            "-f",
            env["RELAYMPI_CLUSTER_HOSTS"],
            "-ppn",
            str(per_node),
            "-n",
            str(ranks),
        ]
    return [_mpiexec(), "-n", str(ranks)]


def train(
    prefix: list[str],
    algo: str,
    args: argparse.Namespace,
    data: Path,
    out: Path,
    variant: str,
    env: dict[str, str],
) -> Timing:
    # each algorithm on its default topology (the trainer's)
    command = [
        *prefix,
        sys.executable,
        "-m",
        "relaympi.train",
        "--task",
        "cifar10",
        "--data-dir",
        str(data),
        "--algo",
        algo,
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.interval),
        "--eval-batch-size",
        "64",
        "--threads",
        "1",
        "--lr",
        "0.01",
        "--device",
        args.device,
        *variant_flags(variant, args),
        "--out",
        str(out),
        "--overwrite",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(command)} exited {proc.returncode}: {proc.stderr.strip()[-1500:]}"
        )
    return timing(out)


def parse_exports(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if words and words[0] == "export":
            env.update((name, value) for name, value in (w.split("=", 1) for w in words[1:]))
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overlap", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--algos",
        default="relay,allreduce",
        help="comma-separated algorithms: relay, allreduce, dpsgd, relay-grad (default "
        "relay,allreduce)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="emulated nodes (>= 2 starts cluster/local_cluster.sh; root); 1: this machine, "
        "mpirun (default 1)",
    )
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks on each node (default 2)")
    p.add_argument(
        "--links",
        default="none",
        help="comma-separated link rates for the emulated cluster, tc rates such as 500mbit, "
        "1gbit (default none: unshaped)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: each rank's node-local GPU; MPI without CUDA support stages every "
        "message through host memory (default cpu)",
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="samples per rank per step (default 16)"
    )
    p.add_argument("--steps", type=int, default=12, help="steps per run (default 12)")
    p.add_argument(
        "--interval",
        type=int,
        default=3,
        help="steps between evaluations: the timing intervals, the first one warm-up (default 3)",
    )
    p.add_argument(
        "--bucket-size",
        type=float,
        default=4.0,
        help="--bucket-size of the --overlap runs in MiB (default 4)",
    )
    p.add_argument(
        "--progress-interval",
        type=float,
        help="--progress-interval of the thread runs in ms (default: relaympi.train's)",
    )
    p.add_argument(
        "--variants",
        default="off,hooks,thread",
        help="comma-separated: off (--no-overlap), hooks (--overlap "
        "--no-progress-thread), thread (--overlap --progress-thread); default off,hooks,thread",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="runs of each variant, alternating; the median of their figures (default 2)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="HDF5 file of the rows (default bench-results/overlap-<nodes>x<ranks per node>.h5)",
    )
    args = p.parse_args(argv)
    if args.nodes < 1 or args.ranks_per_node < 1 or args.repeat < 1:
        p.error("--nodes, --ranks-per-node and --repeat must be >= 1")
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or "off" not in variants:
        p.error(
            f"--variants must include off and name only {', '.join(VARIANTS)}; got "
            f"{args.variants!r}"
        )
    out = args.out or ROOT / "bench-results" / f"overlap-{args.nodes}x{args.ranks_per_node}.h5"
    # a TERM (or an INT, which a background job ignores) still stops the cluster in the
    # finally below
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop)
    algos, links = args.algos.split(","), args.links.split(",")
    ranks = args.nodes * args.ranks_per_node
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    print(
        f"VGG-11, batch {args.batch_size} per rank, {args.nodes} node(s) x "
        f"{args.ranks_per_node} rank(s), bucket {args.bucket_size:g} MiB; "
        "ms per step (median of the slowest rank)"
    )
    print(
        f"{'algo':10} {'link':8} {'overlap':8} {'compute':>8} {'comm':>8} {'step':>8} {'vs off':>7}"
    )
    rows: list[dict] = []
    cluster_dir = None
    with tempfile.TemporaryDirectory(prefix="overlap-") as tmp:
        from tests.data_factories import (
            write_cifar10_binary,  # the generator the tests use (random pixels)
        )

        data = Path(tmp) / "cifar10"
        write_cifar10_binary(data, n_per_batch=64)
        try:
            for link in links:
                if args.nodes > 1:
                    if cluster_dir is None:
                        cluster_dir = Path(tmp) / "cluster"
                        started = subprocess.run(
                            [
                                "bash",
                                str(CLUSTER),
                                "start",
                                "--nodes",
                                str(args.nodes),
                                "--link",
                                link,
                                "--cpus-per-node",
                                str(args.ranks_per_node),
                                "--dir",
                                str(cluster_dir),
                            ],
                            capture_output=True,
                            text=True,
                            check=False,
                        )
                        if started.returncode != 0:
                            print(
                                "error: the emulated cluster did not start: "
                                f"{started.stderr.strip()[-800:]}",
                                file=sys.stderr,
                            )
                            return 1
                        env.update(parse_exports(started.stdout))
                    else:
                        subprocess.run(
                            ["bash", str(CLUSTER), "link", link, "--dir", str(cluster_dir)],
                            capture_output=True,
                            check=True,
                        )
                    env["RELAYMPI_EMULATED_LINK"] = link
                prefix = launch_prefix(ranks, args.ranks_per_node, env)
                for algo in algos:
                    try:
                        runs: dict[str, list[Timing]] = {v: [] for v in variants}
                        # alternating, so a load change on a shared machine hits every variant
                        for _ in range(args.repeat):
                            for variant in variants:
                                runs[variant].append(
                                    train(
                                        prefix,
                                        algo,
                                        args,
                                        data,
                                        Path(tmp) / f"{algo}-{variant}.h5",
                                        variant,
                                        env,
                                    )
                                )
                    except RuntimeError as exc:
                        print(f"{algo:10} {link:8} failed: {exc}", flush=True)
                        continue
                    off = _median(runs["off"])
                    for variant in variants:
                        t = _median(runs[variant])
                        rows.append(
                            {
                                "algo": algo,
                                "link": link,
                                "variant": variant,
                                "compute_ms": t.compute_ms,
                                "comm_ms": t.comm_ms,
                                "step_ms": t.step_ms,
                                "vs_off": t.step_ms / off.step_ms,
                            }
                        )
                        print(
                            f"{algo:10} {link:8} {variant:8} {t.compute_ms:8.1f} "
                            f"{t.comm_ms:8.1f} {t.step_ms:8.1f} "
                            f"{t.step_ms / off.step_ms:6.2f}x",
                            flush=True,
                        )
                    write(out, rows, args)
        finally:
            if cluster_dir is not None:
                subprocess.run(
                    ["bash", str(CLUSTER), "stop", "--dir", str(cluster_dir)], capture_output=True
                )
    return 0


def write(path: Path, rows: list[dict], args: argparse.Namespace) -> None:
    """The rows so far (rewritten after each case: a stopped benchmark keeps what it measured)."""
    import json

    import h5py

    from relaympi import provenance

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with h5py.File(partial, "w") as f:
        f.attrs["provenance"] = json.dumps(provenance.collect({"backend": "mpi"}))
        f.attrs["settings"] = json.dumps({k: str(v) for k, v in vars(args).items()})
        f.attrs["emulated_cluster"] = args.nodes > 1
        for key in ("algo", "link", "variant"):
            f.create_dataset(key, data=np.array([r[key] for r in rows], dtype=h5py.string_dtype()))
        for key in ("compute_ms", "comm_ms", "step_ms", "vs_off"):
            f.create_dataset(key, data=np.array([r[key] for r in rows], dtype=np.float64))
    partial.replace(path)


if __name__ == "__main__":
    raise SystemExit(main())
