"""Communication micro-benchmark: RelaySum, gossip, SGP and allreduce against raw Isend/Irecv of the same bytes.

    mpirun -n 4 python -m benchmarks.comm                      # sizes up to VGG-11's 9.2M float32
    mpirun -n 16 python -m benchmarks.comm --sizes 1e3,1e5,1e6 --reps 10 --out bench-results/comm-n16.h5
    python -m benchmarks.comm --backend local --workers 8      # in-process ranks (no transport cost)

Each operation is warmed up, repeated, and timed between barriers; the table shows the median
over repetitions of the slowest rank's time. "raw" sends exactly the messages of the RelaySum
exchange (same sizes, same peers, counters included) with bare Isend/Irecv and no arithmetic.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from relaympi.algorithms.gossip import GossipMixer
from relaympi.algorithms.relaysum import RelaySum
from relaympi.topology import ExponentialSchedule, build

VGG11_PARAMS = 9_231_114


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(comm, fn, warmup: int, reps: int, device: torch.device) -> float:
    for i in range(warmup):
        fn(i)
    _sync(device)
    samples = []
    for i in range(reps):
        comm.barrier()
        t = time.perf_counter()
        fn(warmup + i)
        _sync(device)
        elapsed = np.array([time.perf_counter() - t])
        samples.append(float(comm.allreduce_flags(elapsed)[0]))  # slowest rank
    return statistics.median(samples)


def _raw_exchange(comm, relay: RelaySum, payloads: list[dict[int, torch.Tensor]], recv: list[dict[int, torch.Tensor]]):
    """The RelaySum's exact messages with no arithmetic: the transport's limit."""
    mpi = getattr(comm, "comm", None)
    on_device = any(b.is_cuda for layer in payloads for b in layer.values())
    direct = not on_device or getattr(comm, "cuda_aware", False)
    # without CUDA-aware MPI the transport's limit includes staging through pinned host memory
    stage = lambda b: b if direct else torch.empty(b.shape, dtype=b.dtype, pin_memory=True)  # noqa: E731
    send_host = [{p: stage(b) for p, b in layer.items()} for layer in payloads]
    recv_host = [{p: stage(b) for p, b in layer.items()} for layer in recv]

    def spec(buf: torch.Tensor):
        return buf if buf.is_cuda else buf.numpy()

    def run(_i: int) -> None:
        if mpi is None:
            for layer in range(relay.num_layers):
                comm._post(payloads[layer], recv[layer], layer).wait()
            return
        if on_device:
            torch.cuda.current_stream().synchronize()  # MPI reads device memory outside the stream's order
        requests = []
        for layer in range(relay.num_layers):
            for peer, buf in recv_host[layer].items():
                requests.append(mpi.Irecv(spec(buf), source=peer, tag=layer))
            for peer, buf in payloads[layer].items():
                host = send_host[layer][peer]
                if host is not buf:
                    host.copy_(buf)
                requests.append(mpi.Isend(spec(host), dest=peer, tag=layer))
        if requests:
            requests[0].Waitall(requests)
        for layer in range(relay.num_layers):
            for peer, buf in recv[layer].items():
                if recv_host[layer][peer] is not buf:
                    buf.copy_(recv_host[layer][peer])

    return run


def _cases(comm, numel: int, device: torch.device) -> dict:
    """The timed operations for one message size (closures over this size's buffers)."""
    n, rank = comm.world_size, comm.rank
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(device)
    cases = {}
    for topo_name in ("chain", "double-binary-trees"):
        relay = RelaySum(comm, build(topo_name, n), numel, x)
        cases[f"relaysum {topo_name}"] = lambda i, relay=relay: relay.exchange(x, i)
        lean = RelaySum(comm, build(topo_name, n), numel, x, in_place=True)
        cases[f"relaysum in-place {topo_name}"] = lambda i, lean=lean: lean.exchange(x, i)
        shapes = [{j: torch.zeros(relay.sizes[k] + 1, device=device) for j in relay.neighbors[k]} for k in range(relay.num_layers)]
        recv = [{j: torch.zeros(relay.sizes[k] + 1, device=device) for j in relay.neighbors[k]} for k in range(relay.num_layers)]
        cases[f"raw isend/irecv {topo_name}"] = _raw_exchange(comm, relay, shapes, recv)
    if n >= 3:
        ring = build("ring", n)
        mixer = GossipMixer(comm, ring.mixing_matrix(0), ring.neighbors(rank), numel, x)
        y = x.clone()
        cases["gossip ring"] = lambda i: mixer.mix(y, i)
    if n & (n - 1) == 0:
        schedule = ExponentialSchedule(n)
        received, z = torch.zeros_like(x), x.clone()

        def sgp_round(i: int) -> None:
            comm.exchange({schedule.send_peer(i, rank): z}, {schedule.recv_peer(i, rank): received}, round=i).wait()
            z.add_(received).mul_(0.5)

        cases["sgp round"] = sgp_round
    w = x.clone()
    cases["allreduce"] = lambda i: comm.allreduce_sum(w)
    return cases


def bench(comm, sizes: list[int], warmup: int, reps: int, device: torch.device) -> list[dict]:
    rows = []
    for numel in sizes:
        for name, fn in _cases(comm, numel, device).items():
            before = int(comm.bytes_sent.sum())
            seconds = _time(comm, fn, warmup, reps, device)
            sent = (int(comm.bytes_sent.sum()) - before) / (warmup + reps)
            rows.append({"op": name, "numel": numel, "median_s": seconds, "bytes_per_rank": sent})
    return rows


def _print(rows: list[dict], n: int) -> None:
    print(f"# world size {n}; median over repetitions of the slowest rank's time")
    print(f"{'operation':34s} {'float32s':>10s} {'median ms':>11s} {'GB/s/rank':>10s} {'vs raw':>7s}")
    raw = {(r["op"].split()[-1], r["numel"]): r["median_s"] for r in rows if r["op"].startswith("raw")}
    for r in rows:
        ratio = ""
        if r["op"].startswith("relaysum"):
            ratio = f"{r['median_s'] / raw[(r['op'].split()[-1], r['numel'])]:.2f}x"
        gbps = r["bytes_per_rank"] / r["median_s"] / 1e9 if r["bytes_per_rank"] else float("nan")
        print(f"{r['op']:34s} {r['numel']:>10d} {1e3 * r['median_s']:>11.3f} {gbps:>10.3f} {ratio:>7s}")


def _write(path: Path, rows: list[dict], comm, device: torch.device) -> None:
    import h5py

    from relaympi import provenance

    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.attrs["world_size"] = comm.world_size
        f.attrs["device"] = str(device)
        f.attrs["cuda_aware"] = bool(getattr(comm, "cuda_aware", False))
        f.attrs["provenance"] = __import__("json").dumps(provenance.collect(comm.describe()))
        f.create_dataset("op", data=np.array([r["op"] for r in rows], dtype=h5py.string_dtype()))
        for key in ("numel", "median_s", "bytes_per_rank"):
            f.create_dataset(key, data=np.array([r[key] for r in rows]))


def _device(name: str, rank: int) -> torch.device:
    if name != "cuda":
        return torch.device(name)
    import os

    local = int(os.environ.get("MPI_LOCALRANKID", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)))
    return torch.device("cuda", local % torch.cuda.device_count())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.comm", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=f"1e3,1e5,1e6,{VGG11_PARAMS}", help="comma-separated float32 counts")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--backend", choices=("mpi", "local"), default="mpi")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the GPU of the node-local rank)")
    p.add_argument("--out", type=Path, help="HDF5 file for the figures (default bench-results/comm-n<N>.h5)")
    args = p.parse_args(argv)
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",") if s]
    except ValueError:
        p.error(f"--sizes must be comma-separated numbers, got {args.sizes!r}")
    torch.set_num_threads(1)

    def body(comm):
        device = _device(args.device, comm.rank)
        rows = bench(comm, sizes, args.warmup, args.reps, device)
        if comm.rank == 0:
            _print(rows, comm.world_size)
            _write(args.out or Path("bench-results") / f"comm-n{comm.world_size}.h5", rows, comm, device)
        return rows

    if args.backend == "local":
        from relaympi.comm import run_local

        run_local(args.workers, body)
        return 0
    from relaympi.comm import mpi_communicator
    from relaympi.comm.mpi import world_size

    if world_size() < 2:
        print("error: run under mpirun, e.g. `mpirun -n 4 python -m benchmarks.comm`, or use --backend local --workers N", file=sys.stderr)
        return 2
    body(mpi_communicator())
    return 0


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(main)
