# Long module: the GPU check's one reporting tool: a subcommand per stage, one table format
"""GPU checks: MPI CUDA-awareness, a device-buffer communication benchmark, training memory, a
summary.

    python -m benchmarks.gpu_report probe                      # versions, GPUs, MPI library,
    CUDA-awareness
    mpirun -n 4 python -m benchmarks.gpu_report comm --device cuda --out comm-n4.json
    python -m benchmarks.gpu_report comm --backend local --workers 4 --device cuda
    mpirun -n 4 python -m benchmarks.gpu_report train -- --task cifar10 --data-dir D --algo relay \\
        --device cuda --steps 300 --out run.h5            # relaympi.train, plus per-rank GPU memory
    python -m benchmarks.gpu_report summary --runs run.h5 --comm comm-n4.json
    mpirun -n 2 python -m benchmarks.gpu_report sendrecv --device cuda   # device buffers through
    mpi4py
    python -m benchmarks.gpu_report same a.h5 b.h5                      # the same numbers, bit for
    bit?

``comm`` times RelaySum (chain, double binary trees) and allreduce (``--ops``: also one RelaySGD
step of a flat model of that size) on buffers in host memory ("host"), and on GPU buffers moved
through pinned host memory ("staged") or handed to a CUDA-aware MPI ("cuda-aware", only where the
library says it is, or RELAYMPI_CUDA_AWARE=1). ``sendrecv`` hands torch (and cupy) buffers to
mpi4py directly, step by step, and checks the bytes: whether this MPI moves device memory at all.
``same`` compares two run files' datasets bit for bit, the timers left out. ``train`` runs
``python -m relaympi.train`` unchanged and then writes ``<run>.mem-rank<R>.json`` beside the
run file with torch.cuda.max_memory_allocated of that rank (the training loop does not
record it). ``summary`` prints samples/s, time per step split into compute and communication
(from the run file's cumulative per-worker timers, warm-up interval excluded) and memory.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from relaympi.comm.buffers import loaded_libmpi

MEMORY_SUFFIX = ".mem-rank"

# -- MPI CUDA-awareness ---------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def mpi_cuda_support() -> tuple[bool, str]:
    """(whether MPI may be handed device pointers, why). RELAYMPI_CUDA_AWARE=1/0 decides when set;
    else MPIX_Query_cuda_support of the loaded library (absent: not CUDA-aware). Imports mpi4py."""
    from mpi4py import MPI

    from relaympi.comm import buffers

    version = " ".join(MPI.Get_library_version().split("\n")[0].split())
    forced = os.environ.get(buffers.CUDA_AWARE_ENV, "").strip()
    if forced:
        aware = buffers.query_cuda_aware_mpi()
        state = "" if aware else "not "
        return (
            aware,
            f"{buffers.CUDA_AWARE_ENV}={forced} says the MPI library ({version}) is "
            f"{state}CUDA-aware",
        )
    path = loaded_libmpi()
    force = f"set {buffers.CUDA_AWARE_ENV}=1 to force"
    if path is None:
        return False, f"cannot find the loaded MPI library ({version}) in /proc/self/maps; {force}"
    if not hasattr(ctypes.CDLL(path), "MPIX_Query_cuda_support"):
        return (
            False,
            f"{path} ({version}) has no MPIX_Query_cuda_support, so it cannot say it is "
            f"CUDA-aware; {force}",
        )
    if not buffers.query_cuda_aware_mpi(path):
        return (
            False,
            f"MPI library {path} ({version}) is not CUDA-aware: MPIX_Query_cuda_support() "
            "returned 0",
        )
    return True, f"MPI library {path} ({version}) is CUDA-aware"


# -- probe ----------------------------------------------------------------------------------


def probe() -> int:
    """Print what the GPU checks depend on; never fails on a missing piece."""
    import torch

    print(f"python {sys.version.split()[0]} at {sys.executable}")
    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, cuDNN "
        f"{torch.backends.cudnn.version()}"
    )
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(
                f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, "
                f"{p.multi_processor_count} SMs, capability {p.major}.{p.minor}"
            )
    else:
        print("torch sees no CUDA device")
    for name in ("cupy", "h5py", "networkx", "mpi4py", "pytest_mpi"):
        try:
            module = __import__(name)
            where = Path(module.__file__).parent if module.__file__ else "?"
            print(f"{name} {getattr(module, '__version__', '?')} at {where}")
        except Exception as exc:  # noqa: BLE001 - report whatever is broken and go on
            print(f"{name}: not importable ({type(exc).__name__}: {exc})")
    try:
        from mpi4py import MPI

        print(
            "MPI library:",
            " ".join(MPI.Get_library_version().split("\n")[0].split()),
            "at",
            loaded_libmpi(),
        )
        aware, why = mpi_cuda_support()
        print(f"CUDA-aware MPI: {'yes' if aware else 'no'} ({why})")
    except Exception as exc:  # noqa: BLE001
        print(f"MPI: unusable ({type(exc).__name__}: {exc})")
    return 0


# -- communication benchmark ----------------------------------------------------------------


def _timed(comm, fn, sync, warmup: int, reps: int) -> float:
    """Median over repetitions of the slowest rank's seconds, device work included."""
    for i in range(warmup):
        fn(i)
    sync()
    samples = []
    for i in range(reps):
        comm.barrier()
        t = time.perf_counter()
        fn(warmup + i)
        sync()
        elapsed = np.array([time.perf_counter() - t])
        samples.append(float(comm.allreduce_flags(elapsed)[0]))
    return statistics.median(samples)


def _modes(comm, device: str) -> list[str]:
    if device == "cpu":
        return ["host"]
    if not hasattr(comm, "cuda_aware"):
        return ["host", "device"]
    aware, _ = mpi_cuda_support()
    return ["host", "staged", "cuda-aware"] if aware else ["host", "staged"]


COMM_OPS = ("relaysum", "allreduce", "relaysgd")


def bench_comm(
    comm,
    sizes: list[int],
    device: str,
    warmup: int,
    reps: int,
    ops: tuple[str, ...] = ("relaysum", "allreduce"),
) -> list[dict[str, Any]]:
    """RelaySum and allreduce of float32 buffers of each size, per buffer placement ("mode");
    ``ops`` may add "relaysgd" (one RelaySGD step on double binary trees) or leave either out."""
    import torch

    from relaympi.algorithms import AlgorithmOptions, make_algorithm
    from relaympi.algorithms.relaysum import RelaySum
    from relaympi.flat import padded_zeros
    from relaympi.optim import OptimizerConfig, make_optimizer
    from relaympi.topology import build

    rows = []
    gpu = torch.device(device) if device == "cpu" else _rank_device(comm, device)
    trees = {name: build(name, comm.world_size) for name in ("chain", "double-binary-trees")}
    for numel in sizes:
        host = torch.randn(numel, generator=torch.Generator().manual_seed(comm.rank))
        for mode in _modes(comm, device):
            if hasattr(comm, "cuda_aware"):
                comm.cuda_aware = mode == "cuda-aware"
            where = torch.device("cpu") if mode == "host" else gpu
            sync: Callable[[], object] = (
                functools.partial(torch.cuda.synchronize, where)
                if where.type == "cuda"
                else (lambda: None)
            )
            x = padded_zeros(numel, device=where)  # a flat model's layout: zero-copy leaf messages
            x.copy_(host)
            cases: dict[str, Callable[[int], object]] = {}
            for name, topology in trees.items() if "relaysum" in ops else ():
                relay = RelaySum(comm, topology, numel, x)
                cases[f"relaysum {name}"] = functools.partial(relay.exchange, x)
            if "allreduce" in ops:
                summed = x.clone()

                def allreduce(_i: int, summed: torch.Tensor = summed) -> None:
                    comm.allreduce_sum(summed)

                cases["allreduce"] = allreduce
            if "relaysgd" in ops:  # the update, the exchange and the combination of one step
                model, grad = x.clone(), torch.full_like(x, 1e-3)
                sgd = make_algorithm(
                    "relay",
                    comm,
                    trees["double-binary-trees"],
                    make_optimizer(OptimizerConfig(momentum=0.9), model),
                    model,
                    AlgorithmOptions(),
                )
                cases["relaysgd step double-binary-trees"] = functools.partial(
                    sgd.step, model, grad, 0.01
                )
            for op, fn in cases.items():
                before = int(comm.bytes_sent.sum())
                seconds = _timed(comm, fn, sync, warmup, reps)
                sent = (int(comm.bytes_sent.sum()) - before) / (warmup + reps)
                rows.append(
                    {
                        "op": op,
                        "mode": mode,
                        "numel": numel,
                        "median_s": seconds,
                        "bytes_sent_per_rank": sent,
                    }
                )
    return rows


def _rank_device(comm, device: str):
    import torch

    if device != "cuda":
        return torch.device(device)
    from relaympi.launcher import launch

    local = launch().local_rank
    index = comm.rank if local is None else local
    return torch.device("cuda", index % max(torch.cuda.device_count(), 1))


def format_comm(rows: list[dict[str, Any]], world_size: int, backend: str) -> str:
    lines = [
        f"# {backend}, {world_size} ranks; median over repetitions of the slowest rank; "
        "model GB/s = 4 bytes x float32s / time",
        f"{'operation':28s} {'mode':>10s} {'float32s':>10s} {'median ms':>10s} "
        f"{'model GB/s':>10s} {'MB sent r0':>12s}",
    ]
    for r in rows:
        gbps = 4 * r["numel"] / r["median_s"] / 1e9 if r["median_s"] > 0 else float("nan")
        lines.append(
            f"{r['op']:28s} {r['mode']:>10s} {r['numel']:>10d} "
            f"{1e3 * r['median_s']:>10.3f} {gbps:>10.2f} {r['bytes_sent_per_rank'] / 1e6:>12.2f}"
        )
    return "\n".join(lines)


def comm_main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.comm import default_sizes

    try:
        sizes = (
            [int(float(s)) for s in args.sizes.split(",") if s] if args.sizes else default_sizes()
        )
    except ValueError:
        print(
            f"error: --sizes must be comma-separated numbers, got {args.sizes!r}", file=sys.stderr
        )
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    torch.set_num_threads(1)

    ops = tuple(o for o in args.ops.split(",") if o)
    if not ops or any(o not in COMM_OPS for o in ops):
        print(
            f"error: --ops must be comma-separated of {', '.join(COMM_OPS)}, got {args.ops!r}",
            file=sys.stderr,
        )
        return 2

    def body(comm):
        rows = bench_comm(comm, sizes, args.device, args.warmup, args.reps, ops)
        if comm.rank == 0:
            backend = "mpi" if hasattr(comm, "cuda_aware") else "local"
            print(format_comm(rows, comm.world_size, backend), flush=True)
            if args.out is not None:
                record = {
                    "world_size": comm.world_size,
                    "backend": backend,
                    "device": args.device,
                    "rows": rows,
                }
                if backend == "mpi":
                    record["cuda_aware"] = mpi_cuda_support()[1]
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(record, indent=1))
        return rows

    if args.backend == "local":
        from relaympi.comm import run_local

        run_local(args.workers, body)
        return 0
    from relaympi.comm import mpi_communicator
    from relaympi.comm.mpi import world_size

    if world_size() < 2:
        print(
            "error: run under mpirun (mpirun -n 4 python -m benchmarks.gpu_report comm), "
            "or use --backend local",
            file=sys.stderr,
        )
        return 2
    body(mpi_communicator())
    return 0


# -- training with memory -------------------------------------------------------------------


def _train_out(train_args: list[str]) -> Path | None:
    for i, arg in enumerate(train_args):
        if arg == "--out" and i + 1 < len(train_args):
            return Path(train_args[i + 1])
        if arg.startswith("--out="):
            return Path(arg.split("=", 1)[1])
    return None


def memory_record() -> dict[str, Any]:
    """This process's peak memory: per GPU (torch's allocator) and the host's max RSS."""
    import torch

    record: dict[str, Any] = {
        "host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        record["gpu"] = {
            f"cuda:{i}": {
                "max_allocated_bytes": torch.cuda.max_memory_allocated(i),
                "max_reserved_bytes": torch.cuda.max_memory_reserved(i),
            }
            for i in range(torch.cuda.device_count())
            if torch.cuda.max_memory_reserved(i) > 0
        }
    return record


def train_main(train_args: list[str]) -> int:
    """relaympi.train with these flags, then this rank's peak memory beside the run file."""
    from relaympi import train

    code = train.main(train_args)
    out = _train_out(train_args)
    if out is None:
        return code
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        rank, size, backend = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), "mpi"
    else:
        rank, size, backend = 0, 1, "local"
    record = {
        "rank": rank,
        "processes": size,
        "backend": backend,
        "exit_code": code,
        **memory_record(),
    }
    Path(f"{out}{MEMORY_SUFFIX}{rank}.json").write_text(json.dumps(record, indent=1))
    return code


# -- summary --------------------------------------------------------------------------------


def summarize_run(path: Path) -> dict[str, Any]:
    """Throughput and per-step time split of one run file, warm-up interval excluded."""
    from relaympi.results import read_run

    run = read_run(path)
    steps = np.asarray(run.data.get("step", []))
    n, batch = run.world_size, int(run.config.get("batch_size") or 0)
    out: dict[str, Any] = {
        "run": path.name,
        "status": run.status,
        "algo": run.config.get("algo"),
        "topology": run.config.get("topology"),
        "workers": n,
        "batch": batch,
        "device": run.config.get("device"),
        "backend": run.config.get("backend"),
    }
    later = np.flatnonzero(steps > 0)
    if len(later) == 0 or "time_compute_s" not in run.data:
        return out | {"note": "no evaluation after step 0"}
    # window: from the first evaluation after step 0 (warm-up excluded) to the last, if there
    # are two
    start = int(later[0]) if len(later) > 1 else 0
    end = int(later[-1])
    window = int(steps[end] - steps[start])
    compute = np.asarray(run.data["time_compute_s"])
    comm = np.asarray(run.data["time_comm_s"])
    d_compute, d_comm = compute[end] - compute[start], comm[end] - comm[start]
    loop_s = float(np.max(d_compute + d_comm))
    wall_s = float(np.asarray(run.data["time_s"])[end] - np.asarray(run.data["time_s"])[start])
    samples = window * batch * n
    out |= {
        "steps_measured": f"{int(steps[start])}-{int(steps[end])}",
        "samples_per_s_loop": samples / loop_s if loop_s > 0 else float("nan"),
        "samples_per_s_wall": samples / wall_s if wall_s > 0 else float("nan"),
        "ms_per_step_compute": 1e3 * float(np.mean(d_compute)) / window,
        "ms_per_step_compute_max": 1e3 * float(np.max(d_compute)) / window,
        "ms_per_step_comm": 1e3 * float(np.mean(d_comm)) / window,
        "ms_per_step_comm_max": 1e3 * float(np.max(d_comm)) / window,
        "comm_share": float(np.sum(d_comm) / max(np.sum(d_compute + d_comm), 1e-12)),
    }
    if "test_accuracy" in run.data and len(run.data["test_accuracy"]):
        out["final_worst_acc"] = float(np.min(run.data["test_accuracy"][-1]))
    return out | {"memory": _memory(path)}


def _memory(run_path: Path) -> str:
    """'rank: MiB allocated (reserved)' from the train wrapper's files beside the run file."""
    parts = []
    for f in sorted(
        run_path.parent.glob(run_path.name + MEMORY_SUFFIX + "*.json"),
        key=lambda p: int(p.stem.rsplit("rank", 1)[1]),
    ):
        record = json.loads(f.read_text())
        gpus = record.get("gpu") or {}
        if gpus:
            text = ", ".join(
                f"{v['max_allocated_bytes'] / 2**20:.0f} "
                f"({v['max_reserved_bytes'] / 2**20:.0f}) MiB on {k}"
                for k, v in gpus.items()
            )
        else:
            text = f"host max RSS {record['host_max_rss_bytes'] / 2**20:.0f} MiB"
        who = (
            f"rank {record['rank']}"
            if record["backend"] == "mpi"
            else "process (all in-process workers)"
        )
        parts.append(f"{who}: {text}")
    return "; ".join(parts) or "not recorded (run through `gpu_report train`)"


def format_runs(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# training: loop samples/s = samples / slowest worker's compute+comm seconds; "
        "wall includes evaluation",
        f"{'run':34s} {'status':>9s} {'algo':>9s} {'n':>3s} {'steps':>9s} "
        f"{'loop sm/s':>10s} {'wall sm/s':>10s} "
        f"{'compute ms':>11s} {'comm ms':>9s} {'comm %':>7s}",
    ]
    for r in rows:
        if "samples_per_s_loop" not in r:
            lines.append(
                f"{r['run']:34s} {r['status']:>9s} {str(r['algo']):>9s} "
                f"{r['workers']:>3d} {r.get('note', '')}"
            )
            continue
        lines.append(
            f"{r['run']:34s} {r['status']:>9s} {r['algo']:>9s} {r['workers']:>3d} "
            f"{r['steps_measured']:>9s} "
            f"{r['samples_per_s_loop']:>10.0f} {r['samples_per_s_wall']:>10.0f} "
            f"{r['ms_per_step_compute']:>11.2f} "
            f"{r['ms_per_step_comm']:>9.2f} {100 * r['comm_share']:>6.1f}%"
        )
    lines.append("# peak memory, MiB allocated (reserved) by torch per rank")
    lines += [f"{r['run']}: {r.get('memory', 'n/a')}" for r in rows]
    return "\n".join(lines)


def summary_main(args: argparse.Namespace) -> int:
    status = 0
    rows = []
    for path in args.runs:
        try:
            rows.append(summarize_run(path))
        except Exception as exc:  # noqa: BLE001 - summarize what can be read
            print(f"{path}: cannot summarize ({type(exc).__name__}: {exc})")
            status = 1
    if rows:
        print(format_runs(rows))
    for path in args.comm:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"{path}: cannot read ({exc})")
            status = 1
            continue
        print(f"\n# {path.name}" + (f" ({record['cuda_aware']})" if "cuda_aware" in record else ""))
        print(format_comm(record["rows"], record["world_size"], record["backend"]))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return status


# -- device buffers through mpi4py ----------------------------------------------------------


def sendrecv_main(args: argparse.Namespace) -> int:
    """Each rank prints a numbered line before each step, so a log that stops shows where: rank
    0 sends to rank 1 (Send/Recv) and every rank swaps with its ring neighbours (Isend/Irecv), for
    torch buffers on ``--device`` and cupy arrays (on a GPU, where cupy imports), each checked."""
    import faulthandler

    from mpi4py import MPI

    faulthandler.enable()  # a crash inside MPI prints where the Python side was
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    counter = [0]

    def say(text: str) -> None:
        counter[0] += 1
        print(f"rank {rank} step {counter[0]}: {text}", flush=True)

    if size < 2:
        print("error: run under mpirun -n 2 (or more)", file=sys.stderr)
        return 2
    say(
        f"{' '.join(MPI.Get_library_version().split()[:4])}, thread level {MPI.Query_thread()}, "
        f"{buffers_env()}, library {loaded_libmpi()}"
    )
    device = _rank_device(comm_like(rank, size), args.device)
    kinds = ["torch"]
    if device.type == "cuda":
        try:
            import cupy

            cupy.cuda.Device(device.index).use()
            kinds.append("cupy")
        except Exception as exc:  # noqa: BLE001 - cupy is optional
            say(f"no cupy ({type(exc).__name__}: {exc})")
    for numel in (int(float(n)) for n in args.sizes.split(",") if n):
        for kind in kinds:
            _sendrecv_case(comm, kind, numel, device, args.allreduce, say)
    if rank == 0:
        print(
            f"result: {', '.join(kinds)} buffers on {device.type} moved through MPI and "
            "arrived intact",
            flush=True,
        )
    return 0


def _sendrecv_case(
    comm: Any, kind: str, numel: int, device: Any, allreduce: bool, say: Any
) -> None:
    import torch
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    where = f"{numel} float32 {kind} on {device}"

    def make(value: float) -> Any:
        if kind == "cupy":
            import cupy

            return cupy.full(numel, value, dtype=cupy.float32)
        return torch.full((numel,), value, dtype=torch.float32, device=device)

    def check(buf: Any, want: float, what: str) -> None:
        got = buf.get() if kind == "cupy" else buf.cpu().numpy()
        wrong = np.flatnonzero(got != want)
        if len(wrong):
            raise AssertionError(
                f"{what}: {len(wrong)} of {got.size} float32s wrong (first "
                f"{got[wrong[0]]}, want {want})"
            )

    def synchronize() -> None:  # MPI reads device memory outside the streams' order
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    send, recv = make(rank + 1.0), make(-1.0)
    synchronize()
    say(f"Send/Recv 0 -> 1 of {where}")
    if rank == 0:
        comm.Send(send, dest=1, tag=1)
    elif rank == 1:
        comm.Recv(recv, source=0, tag=1)
        check(recv, 1.0, f"Recv of {where}")
    say(f"Isend/Irecv with both ring neighbours, {where}")
    left, right = (rank - 1) % size, (rank + 1) % size
    from_left, from_right = make(-1.0), make(-1.0)
    synchronize()
    requests = [
        comm.Irecv(from_left, source=left, tag=2),
        comm.Irecv(from_right, source=right, tag=3),
        comm.Isend(send, dest=right, tag=2),
        comm.Isend(send, dest=left, tag=3),
    ]
    MPI.Request.Waitall(requests)
    check(from_left, left + 1.0, f"Irecv from {left} of {where}")
    check(from_right, right + 1.0, f"Irecv from {right} of {where}")
    if allreduce:
        say(f"Allreduce SUM in place on {where}")
        comm.Allreduce(MPI.IN_PLACE, send, op=MPI.SUM)
        check(send, size * (size + 1) / 2, f"Allreduce of {where}")
    comm.Barrier()
    say(f"ok: {where}")


def buffers_env() -> str:
    from relaympi.comm import buffers

    return f"{buffers.CUDA_AWARE_ENV}={os.environ.get(buffers.CUDA_AWARE_ENV, '')!r}"


def comm_like(rank: int, size: int) -> Any:
    """What _rank_device reads of a communicator: its rank."""
    return argparse.Namespace(rank=rank, world_size=size)


# -- the same numbers -------------------------------------------------------------------------


def same_main(a: Path, b: Path) -> int:
    """Whether two run files hold the same numbers: every dataset but the timers (time_*), bit for
    bit (NaN where the other has NaN); exit 1 where any differs."""
    import h5py

    def numbers(path: Path) -> dict[str, np.ndarray]:
        with h5py.File(path, "r") as f:
            return {
                k: f[k][()]
                for k in f
                if isinstance(f[k], h5py.Dataset) and not k.startswith("time")
            }

    first, second = numbers(a), numbers(b)
    differ = []
    for name in sorted(set(first) | set(second)):
        if name not in first or name not in second:
            differ.append(f"{name} (only in {a.name if name in first else b.name})")
            continue
        x, y = np.asarray(first[name]), np.asarray(second[name])
        if x.shape != y.shape:
            differ.append(f"{name} (shape {x.shape} vs {y.shape})")
        elif x.dtype.kind == "f" and not np.array_equal(
            x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}")
        ):
            count = int(np.count_nonzero(x.view(f"u{x.itemsize}") != y.view(f"u{y.itemsize}")))
            differ.append(
                f"{name} ({count} of {x.size} values, max |diff| "
                f"{float(np.nanmax(np.abs(x - y))):.3g})"
            )
        elif x.dtype.kind != "f" and not np.array_equal(x, y):
            differ.append(f"{name} ({int(np.count_nonzero(x != y))} of {x.size} values)")
    if differ:
        print(f"result: {a.name} and {b.name} differ in {'; '.join(differ)}")
        return 1
    print(
        f"result: {a.name} and {b.name}: {len(first)} datasets bit-identical "
        f"({', '.join(sorted(first))}; timers left out)"
    )
    return 0


# -- command line ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # everything after `train [--]` belongs to relaympi.train
        rest = argv[1:]
        return train_main(rest[1:] if rest[:1] == ["--"] else rest)
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_report", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("probe", help="versions, GPUs, MPI library and its CUDA-awareness")
    c = sub.add_parser("comm", help="RelaySum and allreduce on host, staged and CUDA-aware buffers")
    c.add_argument(
        "--sizes",
        help="comma-separated float32 counts (default 1e3,1e5,1e6 and VGG-11's parameter count)",
    )
    c.add_argument(
        "--device", default="cuda", help="cuda (local rank modulo GPU count), cuda:N or cpu"
    )
    c.add_argument("--warmup", type=int, default=2)
    c.add_argument("--reps", type=int, default=5)
    c.add_argument("--backend", choices=("mpi", "local"), default="mpi")
    c.add_argument("--workers", type=int, default=4, help="ranks for --backend local")
    c.add_argument("--out", type=Path, help="JSON file for the rows")
    c.add_argument(
        "--ops",
        default="relaysum,allreduce",
        help=f"comma-separated of {', '.join(COMM_OPS)} (default relaysum,allreduce; relaysgd: one "
        "RelaySGD step, update and exchange, on double binary trees)",
    )
    r = sub.add_parser(
        "sendrecv", help="torch/cupy buffers through mpi4py on 2+ ranks, step by step"
    )
    r.add_argument(
        "--device", default="cuda", help="cuda (local rank modulo GPU count), cuda:N or cpu"
    )
    r.add_argument(
        "--sizes",
        default="1000,9225610",
        help="float32 counts (default 1000,9225610: eager and rendezvous)",
    )
    r.add_argument(
        "--allreduce",
        action="store_true",
        help="also MPI_Allreduce on the buffer (an MPI without CUDA "
        "support in its reductions may crash here)",
    )
    m = sub.add_parser("same", help="whether two run files hold the same numbers (timers left out)")
    m.add_argument("runs", type=Path, nargs=2, help="two HDF5 run files")
    sub.add_parser(
        "train",
        help="python -m relaympi.train with the flags after `--`, recording peak memory per rank",
    )
    s = sub.add_parser(
        "summary", help="throughput, compute/comm split and memory of runs; comm tables"
    )
    s.add_argument("--runs", type=Path, nargs="*", default=[], help="HDF5 run files")
    s.add_argument("--comm", type=Path, nargs="*", default=[], help="JSON files of `comm --out`")
    s.add_argument("--json", type=Path, help="also write the run rows here")
    args = p.parse_args(argv)
    if args.command == "probe":
        return probe()
    if args.command == "comm":
        return comm_main(args)
    if args.command == "sendrecv":
        return sendrecv_main(args)
    if args.command == "same":
        return same_main(*args.runs)
    return summary_main(args)


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(main)
