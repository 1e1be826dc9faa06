# Long module: one program timing every communication operation with one harness
"""Communication micro-benchmark: RelaySum, the RelaySGD step, gossip, SGP and allreduce against raw
Isend/Irecv.

    mpirun -n 2 python -m benchmarks.comm --sizes 9225610        # VGG-11's float32 parameters
    mpirun -n 4 python -m benchmarks.comm                        # sizes up to VGG-11's
    mpirun -n 16 python -m benchmarks.comm --sizes 1e3,1e6 --reps 10 --chunk 262144
    python -m benchmarks.comm --backend local --workers 8        # in-process ranks (no transport
    cost)
    sudo bash benchmarks/cluster.sh --nodes 2 --ranks-per-node 2 -- --sizes 9225610   # an emulated
    cluster

Each operation is warmed up, repeated, and timed between barriers; the table shows the median
over repetitions of the slowest rank's time. "raw" sends exactly the messages of the RelaySum
exchange (same sizes, same peers, counters included) with bare Isend/Irecv and no arithmetic:
the transport's limit. "relaysgd step" is the whole RelaySGD step (local SGD update, exchange,
normalization) on double binary trees; its ratio is to the raw exchange; "gossip ring" is
compared with "raw isend/irecv ring" (the whole model to both ring neighbours). "sgp round" is
one round of SGP's exponential schedule, the mean over whole periods: each timed call runs all
log2(n) rounds (offsets 1, 2, 4, ...), whose peers may sit on other nodes or on this one. Every
ratio to MPI_Allreduce is to the allreduce of the same buffer.

Where ranks run is the launcher's choice, not this program's: mpirun/mpiexec places them (MPICH's
Hydra with a hosts file and no -ppn, as the rsh launcher of an emulated cluster, deals them out
round-robin: rank r on host r mod N; -ppn K gives each host K consecutive ranks; srun follows
SLURM's distribution). The program reads each rank's node from MPI (ranks that share memory are
one node) and prints it in the table's header; --ranks-per-node K instead emulates nodes of K
consecutive ranks (rank // K) whatever the launcher did.

When the ranks span several nodes (as MPI placed them, or emulated with --ranks-per-node K),
every placed operation also gets a row named as the default one plus " node-aware": the same
operation on the topology built with placement "nodes" (relaympi.topology.build). The column
"inter-node MB" is the most any rank sends per call to ranks on other nodes.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from relaympi.algorithms import AlgorithmOptions, make_algorithm, relaysum
from relaympi.algorithms.gossip import GossipMixer
from relaympi.algorithms.relaysum import DEFAULT_CHUNK, RelaySum
from relaympi.entrypoint import UsageParser
from relaympi.flat import padded_zeros
from relaympi.optim import OptimizerConfig, make_optimizer
from relaympi.topology import ExponentialSchedule, build


def default_sizes() -> list[int]:
    """Message sizes timed when none are given: 1e3, 1e5, 1e6 float32 and VGG-11's parameters."""
    return [1000, 100_000, 1_000_000, vgg11_params()]


def vgg11_params() -> int:
    """VGG-11's trainable parameter count, from the model itself (CIFAR-10's network)."""
    # imports below this line are where one path needs them: the model, HDF5 output, the
    # backend chosen
    from relaympi.tasks.models import VGG11

    return sum(p.numel() for p in VGG11().parameters() if p.requires_grad)


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


def _relay_messages(relay: RelaySum) -> list[tuple[int, int, int]]:
    """RelaySum's messages of one exchange as (peer, float32s with the counter, tag)."""
    return [
        (peer, size + 1, k)
        for k, (size, peers) in enumerate(zip(relay.sizes, relay.neighbors, strict=True))
        for peer in peers
    ]


def _raw_exchange(comm, messages: list[tuple[int, int, int]], device: torch.device):
    """These messages (peer, float32s, tag), sent to and received from each peer, with bare
    Isend/Irecv and no arithmetic: the transport's limit for an operation that sends them."""
    mpi = getattr(comm, "comm", None)
    on_device = device.type == "cuda"
    direct = not on_device or getattr(comm, "cuda_aware", False)
    # without CUDA-aware MPI the transport's limit includes staging through pinned host memory
    shapes = [(peer, size) for peer, size, _ in messages]
    tags = [tag for _, _, tag in messages]
    sends = [torch.zeros(size, device=device) for _, size in shapes]
    recvs = [torch.zeros(size, device=device) for _, size in shapes]
    stage = lambda b: b if direct else torch.empty(b.shape, dtype=b.dtype, pin_memory=True)  # noqa: E731
    send_host, recv_host = [stage(b) for b in sends], [stage(b) for b in recvs]

    def spec(buf: torch.Tensor):
        return buf if buf.is_cuda else buf.numpy()

    def run(_i: int) -> None:
        if mpi is None:
            for (peer, _), tag, send, recv in zip(shapes, tags, sends, recvs, strict=True):
                comm._post({peer: send}, {peer: recv}, tag).wait()
            return
        if on_device:
            # MPI reads device memory outside the stream's order
            torch.cuda.current_stream().synchronize()
        requests = [
            mpi.Irecv(spec(host), source=peer, tag=tag)
            for (peer, _), tag, host in zip(shapes, tags, recv_host, strict=True)
        ]
        for (peer, _), tag, send, host in zip(shapes, tags, sends, send_host, strict=True):
            if host is not send:
                host.copy_(send)
            requests.append(mpi.Isend(spec(host), dest=peer, tag=tag))
        if requests:
            requests[0].Waitall(requests)
        for recv, host in zip(recvs, recv_host, strict=True):
            if host is not recv:
                recv.copy_(host)

    # float32; bypasses the byte counters
    run.bytes_per_call = sum(4 * size for _, size in shapes)  # type: ignore[attr-defined]
    nodes = comm.nodes
    run.inter_node_bytes = sum(4 * size for peer, size in shapes if nodes[peer] != nodes[comm.rank])  # type: ignore[attr-defined]
    return run


def _cases(comm, numel: int, device: torch.device, chunk: int) -> dict:
    """The timed operations for one message size (closures over this size's buffers)."""
    n, rank = comm.world_size, comm.rank
    # a flat model: RelaySum's counters fit in its spare slots
    x = padded_zeros(numel, device=device)
    x.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(rank)))
    cases = {}
    # on several nodes, each placed operation twice: the paper's rank order, and node-aware
    placements: list[tuple[str, dict]] = [("", {})]
    if len(set(comm.nodes)) > 1:
        placements.append((" node-aware", {"placement": "nodes", "nodes": comm.nodes}))
    for suffix, placed in placements:
        for topo_name in ("chain", "double-binary-trees"):
            relay = RelaySum(comm, build(topo_name, n, **placed), numel, x, chunk=chunk)
            cases[f"raw isend/irecv {topo_name}{suffix}"] = _raw_exchange(
                comm, _relay_messages(relay), device
            )
            cases[f"relaysum {topo_name}{suffix}"] = lambda i, relay=relay: relay.exchange(x, i)
            lean = RelaySum(
                comm, build(topo_name, n, **placed), numel, x, in_place=True, chunk=chunk
            )
            cases[f"relaysum in-place {topo_name}{suffix}"] = lambda i, lean=lean: lean.exchange(
                x, i
            )
    model = padded_zeros(numel, device=device)
    model.copy_(x)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(n + rank)).to(device)
    for suffix, placed in placements:
        sgd = make_optimizer(OptimizerConfig(), model)
        relay_sgd = make_algorithm(
            "relay",
            comm,
            build("double-binary-trees", n, **placed),
            sgd,
            model,
            AlgorithmOptions(relay_chunk=chunk),
        )
        cases[f"relaysgd step double-binary-trees{suffix}"] = lambda i, relay_sgd=relay_sgd: (
            relay_sgd.step(model, grad, 1e-3, i)
        )
    if n >= 3:
        for suffix, placed in placements:
            ring = build("ring", n, **placed)
            neighbors = ring.neighbors(rank)
            cases[f"raw isend/irecv ring{suffix}"] = _raw_exchange(
                comm, [(peer, numel, 0) for peer in neighbors], device
            )
            mixer = GossipMixer(comm, ring.mixing_matrix(0), neighbors, numel, x)
            y = x.clone()
            cases[f"gossip ring{suffix}"] = lambda i, mixer=mixer, y=y: mixer.mix(y, i)
    if n & (n - 1) == 0:
        schedule = ExponentialSchedule(n)
        received, z = torch.zeros_like(x), x.clone()

        def sgp_period(i: int) -> None:
            # call i: the schedule's whole period i, every offset once. One round per call made the
            # median depend on which offsets the timed calls landed on (--warmup's parity), and
            # offsets differ: with ranks round-robin over nodes, 1 crosses nodes where 2 does not
            for k in range(i * schedule.period, (i + 1) * schedule.period):
                peers = schedule.send_peer(k, rank), schedule.recv_peer(k, rank)
                comm.exchange({peers[0]: z}, {peers[1]: received}, round=k).wait()
                z.add_(received).mul_(0.5)

        # the row reports one round: the period's mean
        sgp_period.rounds_per_call = schedule.period  # type: ignore[attr-defined]
        cases["sgp round"] = sgp_period
    w = x.clone()

    def allreduce(_i: int) -> None:
        comm.allreduce_sum(w)

    cases["allreduce"] = allreduce
    # algorithm bandwidth: the buffer over the time
    allreduce.bytes_per_call = 4 * numel  # type: ignore[attr-defined]
    v = x.clone()
    pieces = [(lo, min(lo + -(-numel // 8), numel)) for lo in range(0, numel, -(-numel // 8))]

    def tree_allreduce(_i: int) -> None:  # Communicator.iallreduce_sum: the same bits for any cut
        comm.iallreduce_sum(v).wait()

    # as a ranged step: 8 pieces in flight at once, last first
    def tree_allreduce_pieces(_i: int) -> None:
        for request in [comm.iallreduce_sum(v[lo:hi]) for lo, hi in reversed(pieces)]:
            request.wait()

    cases["iallreduce fixed tree"] = tree_allreduce
    cases["iallreduce fixed tree 8 pieces"] = tree_allreduce_pieces
    tree_allreduce.bytes_per_call = tree_allreduce_pieces.bytes_per_call = 4 * numel  # type: ignore[attr-defined]
    # the busiest rank's, derived from the tree here (the communicator's count must agree)
    if comm.backend == "mpi":
        from relaympi.comm.tree_allreduce import stage_order

        order = stage_order(comm.nodes)
        tree_allreduce.inter_node_bytes = tree_inter_node_bytes(comm.nodes, [numel], order)  # type: ignore[attr-defined]
        tree_allreduce_pieces.inter_node_bytes = tree_inter_node_bytes(  # type: ignore[attr-defined]
            comm.nodes, [hi - lo for lo, hi in pieces], order
        )
    return cases


def tree_inter_node_bytes(
    nodes: list[int], sizes: list[int], order: tuple[int, ...], itemsize: int = 4
) -> float:
    """The most bytes any rank sends to other nodes in tree all-reduces of buffers of ``sizes``
    elements (relaympi.comm.tree_allreduce.tree_sum with the stage ``order``), summed per rank: the
    fold of ranks beyond the largest power of two, each halving stage's given half, and the same
    again in the allgather."""
    n = len(nodes)
    p = 1 << (n.bit_length() - 1)
    sent = [0] * n
    for numel in sizes:
        for r in range(n - p):  # rank p + r sends its buffer to r, which sends the sum back
            if nodes[r] != nodes[r + p]:
                sent[r] += numel
                sent[r + p] += numel
        for r in range(p):
            lo, hi = 0, numel
            for d in order:
                # the half it gives in the reduce-scatter, the half it kept in the allgather
                if nodes[r] != nodes[r ^ d]:
                    sent[r] += hi - lo
                mid = lo + (hi - lo) // 2
                lo, hi = (mid, hi) if r & d else (lo, mid)
    return float(itemsize * max(sent))


def bench(
    comm, sizes: list[int], warmup: int, reps: int, device: torch.device, chunk: int = DEFAULT_CHUNK
) -> list[dict]:
    """One row per operation and size; bytes_per_rank is rank 0's bytes sent per call,
    inter_node_bytes the most any rank sends per call to ranks on other nodes (nan where the
    operation's messages are MPI's own: the allreduce). An operation whose call runs several
    rounds (``fn.rounds_per_call``: SGP's whole period) is reported per round: the call's median
    time and bytes over its rounds."""
    rows = []
    other_node = np.array([node != comm.nodes[comm.rank] for node in comm.nodes])
    for numel in sizes:
        for name, fn in _cases(comm, numel, device, chunk).items():
            before = comm.bytes_sent.copy()
            rounds = getattr(fn, "rounds_per_call", 1)  # a call of several rounds: one, their mean
            seconds = _time(comm, fn, warmup, reps, device) / rounds
            delta = (comm.bytes_sent - before) / ((warmup + reps) * rounds)
            sent = getattr(fn, "bytes_per_call", float(delta.sum()))
            inter = getattr(
                fn,
                "inter_node_bytes",
                float(delta[other_node].sum()) if delta.any() else float("nan"),
            )
            inter = float(comm.allreduce_flags(np.array([inter]))[0])  # the busiest rank's
            rows.append(
                {
                    "op": name,
                    "numel": numel,
                    "median_s": seconds,
                    "bytes_per_rank": sent,
                    "inter_node_bytes": inter,
                }
            )
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[dict]) -> None:
    """vs_raw: RelaySum, the RelaySGD step and gossip over the raw exchange on the same topology and
    placement; vs_allreduce: any op over allreduce."""
    times = {(r["op"], r["numel"]): r["median_s"] for r in rows}
    for r in rows:
        words = r["op"].split()
        placed = words[-1] == "node-aware"
        topology = " ".join(words[-2:]) if placed else words[-1]
        raw = times.get((f"raw isend/irecv {topology}", r["numel"]))
        related = r["op"].startswith(("relaysum", "relaysgd", "gossip"))
        r["vs_raw"] = r["median_s"] / raw if related and raw else float("nan")
        allreduce = times.get(("allreduce", r["numel"]))
        r["vs_allreduce"] = (
            r["median_s"] / allreduce if allreduce and r["op"] != "allreduce" else float("nan")
        )


def _print(
    rows: list[dict], n: int, nodes: int, chunk: int, placement: tuple[int, ...] | None = None
) -> None:
    print(
        f"# world size {n} on {nodes} node{'s' if nodes > 1 else ''}; chunk {chunk} "
        f"elements; cache block {relaysum.CACHE_BLOCK}; median over repetitions of the "
        "slowest rank's time"
    )
    if placement is not None and nodes > 1:
        print(f"# node of each rank, 0..{n - 1}: {' '.join(map(str, placement))}")
    print(
        f"{'operation':47s} {'float32s':>10s} {'median ms':>11s} {'GB/s/rank':>10s} "
        f"{'inter-node MB':>14s} {'vs raw':>7s} {'vs allreduce':>13s}"
    )
    for r in rows:
        gbps = r["bytes_per_rank"] / r["median_s"] / 1e9 if r["bytes_per_rank"] else float("nan")
        ratio = lambda v: "" if v != v else f"{v:.2f}x"  # noqa: E731 - blank for nan
        inter = (
            ""
            if r["inter_node_bytes"] != r["inter_node_bytes"]
            else f"{r['inter_node_bytes'] / 1e6:.3f}"
        )
        print(
            f"{r['op']:47s} {r['numel']:>10d} {1e3 * r['median_s']:>11.3f} {gbps:>10.3f} "
            f"{inter:>14s} {ratio(r['vs_raw']):>7s} {ratio(r['vs_allreduce']):>13s}"
        )


def _write(path: Path, rows: list[dict], comm, device: torch.device, chunk: int) -> None:
    import h5py

    from relaympi import provenance

    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.attrs["world_size"] = comm.world_size
        f.attrs["device"] = str(device)
        f.attrs["chunk"] = chunk
        f.attrs["cache_block"] = relaysum.CACHE_BLOCK
        f.attrs["cuda_aware"] = bool(getattr(comm, "cuda_aware", False))
        f.attrs["provenance"] = __import__("json").dumps(provenance.collect(comm.describe()))
        f.create_dataset("op", data=np.array([r["op"] for r in rows], dtype=h5py.string_dtype()))
        f.attrs["nodes"] = np.asarray(comm.nodes)
        for key in (
            "numel",
            "median_s",
            "bytes_per_rank",
            "inter_node_bytes",
            "vs_raw",
            "vs_allreduce",
        ):
            f.create_dataset(key, data=np.array([r[key] for r in rows]))


def _device(name: str, rank: int) -> torch.device:
    if name != "cuda":
        return torch.device(name)
    from relaympi.launcher import launch

    local = launch().local_rank
    return torch.device("cuda", (rank if local is None else local) % torch.cuda.device_count())


def build_parser() -> UsageParser:
    p = UsageParser(prog="python -m benchmarks.comm", description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes",
        help="comma-separated float32 counts (default 1e3,1e5,1e6 and VGG-11's 9,225,610)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=DEFAULT_CHUNK,
        help=f"RelaySum chunk in elements (default {DEFAULT_CHUNK})",
    )
    p.add_argument(
        "--cache-block",
        type=int,
        default=relaysum.CACHE_BLOCK,
        help=f"RelaySum cache block in elements (default {relaysum.CACHE_BLOCK})",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed calls per operation before timing (>= 0; default 2; "
        "SGP: whole periods of its schedule)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=5,
        help="timed calls per operation, >= 1; the table shows their median (default 5)",
    )
    p.add_argument(
        "--backend",
        choices=("mpi", "local"),
        default="mpi",
        help="mpi (one rank per process, under mpirun) or local (--workers ranks in this "
        "process; no transport cost); default mpi",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=4,
        help="in-process ranks for --backend local, >= 2 (default 4)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        help="emulate nodes of K consecutive ranks (rank // K) instead of the nodes the "
        "launcher placed the ranks on (Hydra with a hosts file and no -ppn: "
        "round-robin, rank r on host r mod N; the header prints each rank's node); "
        "with several nodes every placed operation gets a node-aware row too",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda (the GPU of the node-local rank); default cpu"
    )
    p.add_argument(
        "--out", type=Path, help="HDF5 file for the figures (default bench-results/comm-n<N>.h5)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        sizes = (
            [int(float(s)) for s in args.sizes.split(",") if s] if args.sizes else default_sizes()
        )
    except ValueError:
        p.error(f"--sizes must be comma-separated numbers, got {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        p.error(f"--sizes must be positive numbers, got {args.sizes!r}")
    if args.reps < 1:
        p.error(f"--reps must be >= 1 (the median of the timed calls is reported), got {args.reps}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.backend == "local" and args.workers < 2:
        p.error(
            "--workers must be >= 2 (the operations exchange messages between ranks), "
            f"got {args.workers}"
        )
    if args.chunk < 1 or args.cache_block < 1:
        p.error(
            "--chunk and --cache-block must be positive numbers of elements, got "
            f"{args.chunk} and {args.cache_block}"
        )
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        p.error(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    relaysum.CACHE_BLOCK = args.cache_block
    torch.set_num_threads(1)

    def body(comm):
        device = _device(args.device, comm.rank)
        rows = bench(comm, sizes, args.warmup, args.reps, device, args.chunk)
        if comm.rank == 0:
            _print(rows, comm.world_size, len(set(comm.nodes)), args.chunk, tuple(comm.nodes))
            _write(
                args.out or Path("bench-results") / f"comm-n{comm.world_size}.h5",
                rows,
                comm,
                device,
                args.chunk,
            )
        return rows

    if args.backend == "local":
        from relaympi.comm import run_local

        run_local(args.workers, body, nodes=_emulated(args.workers, args.ranks_per_node))
        return 0
    from relaympi.comm import mpi_communicator
    from relaympi.comm.mpi import world_size

    if world_size() < 2:
        print(
            "error: run under mpirun, e.g. `mpirun -n 4 python -m benchmarks.comm`, or "
            "use --backend local --workers N",
            file=sys.stderr,
        )
        return 2
    body(mpi_communicator(nodes=_emulated(world_size(), args.ranks_per_node)))
    return 0


def _emulated(world_size: int, ranks_per_node: int | None) -> tuple[int, ...] | None:
    from relaympi.topology import nodes_of

    return None if ranks_per_node is None else nodes_of(world_size, ranks_per_node)


if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(main)
