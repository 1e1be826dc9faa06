# Long module: the harness, the peers' worker loops and the report, for every pair

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
  all-reduce, 2 (n-1)/n of the model; Decent-DP: gloo's all-reduce over each step's group),
  marked ``est``;
- final test accuracy, the mean over workers of each worker's own model,

and per pair the ratio relaympi / peer of ms/step and CPU/step, rep by rep (median [min-max]).
``--variant NAME:VAR=VALUE[,VAR=VALUE...]`` adds a relaympi run with those environment variables to
each rep (after relaympi's own, before the peer's), with its ratios to the peer and to relaympi:
before and after a change of how relaympi waits, in the same alternation. ``relay:decent-dp``
runs Decent-DP on every topology of its that applies (``--peer-topology`` picks) and names the
fastest. ``--comm-floats F`` measures communication alone: one exchange of F float32 per step
(relaympi's gossip and fixed-tree all-reduce against Decent-DP's exchange and gloo's all_reduce).

    python -m benchmarks.peers --workers 4 --reps 3                    # every pair
    python -m benchmarks.peers --workers 2 --pair allreduce:ddp --reps 5
    python -m benchmarks.peers --variant spin:RELAYMPI_WAIT=spin,RELAYMPI_AGREEMENT_LAG=0
    python -m benchmarks.peers --pair relay:decent-dp --peer-topology complete
    python -m benchmarks.peers --comm-floats 10000000 --workers 2

Peers are optional (``pip install -e .[peers]``): a pair whose peer is missing is refused in one
line saying what to install. ``--worker`` and ``--comm-worker`` are internal: one rank, started
by this harness (a peer's with torch.distributed's environment: MASTER_ADDR, RANK, WORLD_SIZE,
LOCAL_RANK, ...; relaympi's under mpirun).
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
    "relay:decent-dp": ("relay", None, "decent-dp"),
}
# the peer's module, and what to install for it
PEER_NEEDS = {"ddp": ("torch.distributed", "torch"), "decent-dp": ("decent_dp", "decent-dp")}
DECENT_DP_TOPOLOGY = "ring"  # Decent-DP's one-peer ring: the pairs of relaympi's alternating-ring
# the lr both systems of relay:decent-dp take: the other pairs' (the digits task's for D-PSGD and
# all-reduce), since Decent-DP diverges on every topology at RelaySGD's own digits lr (1.6)
RELAY_PAIR_LR = 0.4
# Decent-DP 0.2.3's topologies (decent_dp.topo), in the order the harness runs them
DECENT_DP_TOPOLOGIES = ("ring", "complete", "one-peer-exp", "alternating-exp-ring")
# each pair's Decent-DP topologies when --peer-topology is not given (None: every one that applies)
PAIR_TOPOLOGIES: dict[str, tuple[str, ...] | None] = {
    "dpsgd:decent-dp": (DECENT_DP_TOPOLOGY,),
    "relay:decent-dp": None,
}


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


def decent_dp_local_world_size(topology: str, workers: int) -> int | None:
    """The LOCAL_WORLD_SIZE Decent-DP's ``topology`` runs under with ``workers`` ranks on this
    machine, or None where it does not apply.

    Decent-DP reads the ranks per node from LOCAL_WORLD_SIZE; every rank here is on one machine,
    so it is ``workers``, except for ``alternating-exp-ring``, which alternates between averaging
    within a node and across pairs of nodes and so needs at least two nodes: it gets two emulated
    nodes of ``workers // 2`` ranks (with one rank per node its within-node groups are single ranks,
    which Decent-DP cannot weigh, so it needs ``workers`` >= 4).

    Args:
        topology: one of DECENT_DP_TOPOLOGIES.
        workers: the number of ranks.

    Returns:
        The local world size, or None: the topology cannot pair ``workers`` ranks.
    """
    power_of_two = workers >= 2 and workers & (workers - 1) == 0
    if topology == "complete":
        return workers
    if topology == "ring":
        return workers if workers % 2 == 0 else None
    if topology == "one-peer-exp":
        return workers if power_of_two else None
    if topology == "alternating-exp-ring":
        return workers // 2 if workers >= 4 and workers % 2 == 0 else None
    raise ValueError(
        f"no Decent-DP topology called {topology!r}; allowed: {', '.join(DECENT_DP_TOPOLOGIES)}"
    )


def decent_dp_group_sizes(topology: str, workers: int) -> list[int]:
    """The size of the group rank 0 averages with in each step of one period of Decent-DP's
    ``topology`` (each step is one all-reduce over that group).

    Args:
        topology: one of DECENT_DP_TOPOLOGIES, applying at ``workers``.
        workers: the number of ranks.

    Returns:
        One group size per step of the period.
    """
    local = decent_dp_local_world_size(topology, workers)
    if local is None:
        raise ValueError(f"Decent-DP's {topology!r} does not apply to {workers} ranks")
    if topology == "complete":
        return [workers]
    if topology == "ring":
        return [2, 2]
    if topology == "one-peer-exp":
        return [2] * (workers.bit_length() - 1)
    return [local, 2 * local]  # two emulated nodes: within a node, then both nodes


def decent_dp_models_per_step(topology: str, workers: int) -> float:
    """Models each rank sends per step under Decent-DP's ``topology``, estimated: each step is a
    gloo all-reduce over a group of k ranks, which sends 2 (k - 1) / k models per rank (ring
    all-reduce; one model for a pair), averaged over the period.

    Args:
        topology: one of DECENT_DP_TOPOLOGIES, applying at ``workers``.
        workers: the number of ranks.

    Returns:
        The mean models per step.
    """
    sizes = decent_dp_group_sizes(topology, workers)
    return statistics.fmean(2 * (k - 1) / k for k in sizes)


def peer_topologies(pair: str, workers: int, chosen: list[str] | None) -> tuple[str, ...]:
    """The Decent-DP topologies a pair runs: ``chosen`` (--peer-topology), else the pair's own
    (PAIR_TOPOLOGIES), else every one that applies at ``workers``; () for a pair whose peer has no
    topology.

    Args:
        pair: a key of PAIRS.
        workers: the number of ranks.
        chosen: the --peer-topology values, or None.

    Returns:
        The topologies, in DECENT_DP_TOPOLOGIES' order where not chosen.

    Raises:
        ValueError: a chosen topology is unknown or does not apply at ``workers`` (one line).
    """
    if PAIRS[pair][2] != "decent-dp":
        return ()
    if chosen:
        for name in chosen:
            if decent_dp_local_world_size(name, workers) is None:
                raise ValueError(
                    f"--peer-topology {name!r} does not apply to {workers} workers; applies: "
                    + ", ".join(
                        t for t in DECENT_DP_TOPOLOGIES if decent_dp_local_world_size(t, workers)
                    )
                )
        return tuple(dict.fromkeys(chosen))
    own = PAIR_TOPOLOGIES[pair]
    if own is not None:
        return own
    return tuple(t for t in DECENT_DP_TOPOLOGIES if decent_dp_local_world_size(t, workers))


def train_args(algo: str, topology: str | None, steps: int) -> list[str]:
    """relaympi.train's flags for the task both systems run; relaympi evaluates every tenth of the
    run, so that its run file's clock has a row at the end of the warm-up. RelaySGD runs at
    RELAY_PAIR_LR."""
    every = warm_up(steps)
    args = ["--task", TASK, "--algo", algo, "--steps", str(steps), "--eval-every", str(every)]
    args += ["--lr", str(RELAY_PAIR_LR)] if algo == "relay" else []
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
    peer: str,
    algo: str,
    topology: str | None,
    workers: int,
    steps: int,
    folder: Path,
    peer_topology: str | None = None,
) -> tuple[float, dict[str, float]]:
    """One peer run: ``workers`` processes of ``--worker`` with torch.distributed's environment;
    (their CPU seconds; rank 0's figures and the mean accuracy). ``peer_topology``: Decent-DP's
    topology (None: DECENT_DP_TOPOLOGY), under its LOCAL_WORLD_SIZE
    (``decent_dp_local_world_size``)."""
    peer_topology = peer_topology or DECENT_DP_TOPOLOGY
    local = workers
    if peer == "decent-dp":
        local = decent_dp_local_world_size(peer_topology, workers) or workers
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
            "LOCAL_RANK": str(rank % local),
            "LOCAL_WORLD_SIZE": str(local),
        }
        command = [sys.executable, "-m", "benchmarks.peers", "--worker", peer, "--algo", algo]
        command += ["--steps", str(steps), "--out", str(folder / f"{peer}-{tag}-{rank}.json")]
        command += ["--topology", topology] if topology else []
        command += ["--peer-topology", peer_topology] if peer == "decent-dp" else []
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


def peer_systems(pair: str, topologies: tuple[str, ...]) -> dict[str, str | None]:
    """The pair's peer runs: system name -> Decent-DP topology (None: a peer without one). A pair
    run on its one own topology keeps the peer's plain name; others are named ``peer:topology``."""
    peer = PAIRS[pair][2]
    if not topologies:
        return {peer: None}
    if len(topologies) == 1 and topologies == PAIR_TOPOLOGIES[pair]:
        return {peer: topologies[0]}
    return {f"{peer}:{name}": name for name in topologies}


def measure_pair(
    pair: str,
    workers: int,
    steps: int,
    folder: Path,
    variants: dict[str, dict[str, str]] | None = None,
    topologies: tuple[str, ...] = (),
) -> tuple[Measure, ...]:
    """relaympi, each variant (relaympi with its environment), then the peer on each of its
    ``topologies`` (Decent-DP's; () for DDP), each at ``steps`` and ``steps // 10`` steps (the CPU
    difference)."""
    algo, topology, peer = PAIRS[pair]
    short = max(1, steps // 10)
    results = []
    systems: dict[str, dict[str, str] | None] = {"relaympi": {}, **(variants or {})}
    peers = peer_systems(pair, topologies)
    for system, env in [*systems.items(), *((name, None) for name in peers)]:
        runs = {}
        for count in (steps, short):
            if env is not None:
                runs[count] = run_relaympi(algo, topology, workers, count, folder, env)
            else:
                runs[count] = run_peer(peer, algo, topology, workers, count, folder, peers[system])
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


def peer_worker(
    peer: str,
    algo: str,
    topology: str | None,
    steps: int,
    out: Path,
    peer_topology: str | None = None,
) -> None:
    """One rank of ``peer`` on relaympi's plan for the same flags: its model (same seed), shard,
    batch stream, lr and steps; writes rank 0's timing and this rank's accuracy to ``out``.
    ``peer_topology``: Decent-DP's topology (None: DECENT_DP_TOPOLOGY)."""
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
            topology=peer_topology or DECENT_DP_TOPOLOGY,
        )
        models = decent_dp_models_per_step(peer_topology or DECENT_DP_TOPOLOGY, size)
        bytes_per_step = models * numel * 4.0  # ring, one-peer-exp: one model to one peer
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


# -- communication only ---------------------------------------------------------------------------

# --comm-floats: each pair's operation and its peer (whose module PEER_NEEDS names)
COMM_PAIRS: dict[str, tuple[str, str]] = {
    "allreduce:gloo": ("allreduce", "ddp"),
    "gossip:decent-dp": ("gossip", "decent-dp"),
}
COMM_STEPS = 30  # exchanges per run with --comm-floats, when --steps is not given


@dataclass
class CommMeasure:
    """One communication-only run of one system: medians over its timed exchanges."""

    system: str
    ms_rank0: float
    ms_slowest: float
    bytes_per_step: float
    bytes_estimated: bool


def comm_summary(times: list[list[float]]) -> tuple[float, float]:
    """(rank 0's, the slowest rank's) median ms per exchange from every rank's seconds per
    exchange, leaving out the warm-up (``warm_up``): the slowest is each exchange's maximum over
    ranks, then the median over exchanges.

    Args:
        times: times[rank][step], seconds.

    Returns:
        Rank 0's and the slowest rank's median, milliseconds.
    """
    skip = warm_up(len(times[0]))
    timed = [row[skip:] for row in times]
    slowest = [max(column) for column in zip(*timed, strict=True)]
    return 1e3 * statistics.median(timed[0]), 1e3 * statistics.median(slowest)


def comm_worker(system: str, op: str, floats: int, steps: int, out: Path) -> None:
    """One rank exchanging a float32 buffer of ``floats`` elements ``steps`` times, without compute,
    each exchange started together (a barrier before it); rank 0 writes every rank's seconds per
    exchange and its bytes sent per exchange to ``out``.

    ``system`` ``relaympi`` (under mpirun) uses relaympi's MPI Communicator: ``gossip`` is D-PSGD's
    exchange on ``alternating-ring`` (its GossipMixer: one peer per step, the model sent in pieces
    and averaged in), ``allreduce`` the fixed-tree all-reduce (``iallreduce_sum``, what
    ``--algo allreduce`` runs) and a division by the world size. ``gloo`` (torch.distributed's
    environment) uses ``all_reduce`` and the division for ``allreduce``, and for ``gossip``
    Decent-DP's own exchange on its ``ring`` topology driven alone: its process group of the step's
    pair, its scaling, one ``all_reduce`` over the pair and its averaging, on one buffer (as
    Decent-DP does per bucket)."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    times: list[float] = []
    if system == "relaympi":
        from relaympi.algorithms.gossip import CommMixers, gossip_matrices
        from relaympi.comm import mpi_communicator
        from relaympi.topology import build

        comm = mpi_communicator()
        rank, size = comm.rank, comm.world_size
        x = torch.full((floats,), float(rank + 1))
        if op == "gossip":
            mixers = CommMixers(comm)
            matrices = gossip_matrices(build("alternating-ring", size))
            rounds = [mixers.gossip(w, x) for w in matrices]

            def step(k: int) -> None:
                rounds[k % len(rounds)].mix(x, round=k)
        else:

            def step(k: int) -> None:
                comm.iallreduce_sum(x).wait()
                x.div_(size)

        for k in range(steps):
            if k == warm_up(steps):
                sent = int(comm.bytes_sent.sum())
            comm.barrier()
            start = time.perf_counter()
            step(k)
            times.append(time.perf_counter() - start)
        per_step = (int(comm.bytes_sent.sum()) - sent) / (steps - warm_up(steps))
        rows = comm.gather_rows(np.asarray(times))
        estimated = False
        comm.barrier()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        x = torch.full((floats,), float(rank + 1))
        if op == "gossip":
            from decent_dp.topo import TopologyReg

            topology = TopologyReg.registry["ring"](int(os.environ["LOCAL_WORLD_SIZE"]))
            buffer = torch.empty_like(x)

            def step(k: int) -> None:
                edge = topology.get_edge(k)
                others = len(edge.ranks) - 1
                buffer.copy_(x).mul_((1 - edge.weight) / others)
                dist.all_reduce(buffer, group=edge.group)
                x.mul_(edge.weight - (1 - edge.weight) / others).add_(buffer)

            per_step = floats * 4.0  # one buffer to one peer
        else:

            def step(k: int) -> None:
                dist.all_reduce(x)
                x.div_(size)

            per_step = 2 * (size - 1) / size * floats * 4.0  # gloo's ring all-reduce
        for k in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step(k)
            times.append(time.perf_counter() - start)
        gathered = [torch.zeros(steps, dtype=torch.float64) for _ in range(size)]
        dist.all_gather(gathered, torch.tensor(times, dtype=torch.float64))
        rows = np.stack([g.numpy() for g in gathered]) if rank == 0 else None
        estimated = True
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        assert rows is not None
        figures = {"times": rows.tolist(), "bytes_per_step": per_step, "estimated": estimated}
        out.write_text(json.dumps(figures))


def run_comm(
    system: str,
    op: str,
    floats: int,
    workers: int,
    steps: int,
    folder: Path,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One communication-only run of ``system`` (``relaympi`` under mpirun, ``gloo`` as
    torch.distributed ranks); rank 0's figures (``comm_worker``). ``env``: a variant's environment
    (relaympi only)."""
    out = folder / f"comm-{system}-{time.monotonic_ns()}.json"
    flags = ["--comm-op", op, "--comm-floats", str(floats), "--steps", str(steps)]
    flags += ["--out", str(out)]
    worker = [sys.executable, "-m", "benchmarks.peers", "--comm-worker", system, *flags]
    if system == "relaympi":
        procs = [
            subprocess.Popen(
                [mpirun(), "-n", str(workers), *worker],
                cwd=ROOT,
                env=_env() | (env or {}),
                stderr=subprocess.PIPE,
                text=True,
            )
        ]
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        procs = []
        for rank in range(workers):
            ranks = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(workers),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(workers),
            }
            procs.append(
                subprocess.Popen(
                    worker, cwd=ROOT, env=_env() | ranks, stderr=subprocess.PIPE, text=True
                )
            )
    errors = [proc.communicate()[1] for proc in procs]
    if not out.exists():
        raise SystemExit(f"benchmarks.peers: {system} failed: {max(errors, key=len)[-2000:]}")
    if any(proc.returncode for proc in procs):
        last = max(errors, key=len).strip().splitlines() or ["(no message)"]
        print(f"benchmarks.peers: {system} failed after its figures were written: {last[-1]}")
    figures: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return figures


def measure_comm(
    pair: str,
    floats: int,
    workers: int,
    steps: int,
    folder: Path,
    variants: dict[str, dict[str, str]] | None = None,
) -> tuple[CommMeasure, ...]:
    """relaympi, each variant, then the peer: one communication-only run each."""
    op, peer = COMM_PAIRS[pair]
    systems: dict[str, dict[str, str] | None] = {"relaympi": {}, **(variants or {}), peer: None}
    results = []
    for system, env in systems.items():
        figures = run_comm(
            "gloo" if env is None else "relaympi", op, floats, workers, steps, folder, env
        )
        rank0, slowest = comm_summary(figures["times"])
        name = system if env is not None else ("gloo" if peer == "ddp" else peer)
        results.append(
            CommMeasure(name, rank0, slowest, figures["bytes_per_step"], figures["estimated"])
        )
    return tuple(results)


def comm_report(pair: str, floats: int, workers: int, reps: list[tuple[CommMeasure, ...]]) -> str:
    """The communication-only table: per system the median [min-max] over reps of each run's
    median ms per exchange (rank 0, and the slowest rank), bytes per exchange, and the ratios
    relaympi / peer rep by rep."""
    first = reps[0]
    width = max(10, *(len(m.system) for m in first))
    lines = [
        f"{pair}: {floats:,} float32 ({floats * 4 / 1e6:.4g} MB) per rank, {workers} ranks, "
        f"{len(reps)} alternating rep(s), median [min-max] of each run's median ms per exchange"
    ]
    lines.append(f"  {'system':<{width}} {'ms rank 0':<22} {'ms slowest rank':<22} bytes/exchange")
    for side in range(len(first)):
        runs = [rep[side] for rep in reps]
        est = " est" if runs[0].bytes_estimated else ""
        lines.append(
            f"  {runs[0].system:<{width}} {_spread([m.ms_rank0 for m in runs]):<22} "
            f"{_spread([m.ms_slowest for m in runs]):<22} {runs[0].bytes_per_step:.4g}{est}"
        )
    last = len(first) - 1
    for side in range(last):
        rank0 = [rep[side].ms_rank0 / rep[last].ms_rank0 for rep in reps]
        slowest = [rep[side].ms_slowest / rep[last].ms_slowest for rep in reps]
        lines.append(
            f"  ratio {first[side].system}/peer: rank 0 {_spread(rank0, '.2f')}x, "
            f"slowest {_spread(slowest, '.2f')}x"
        )
    return "\n".join(lines)


# -- the report ----------------------------------------------------------------------------------


def _spread(values: list[float], digits: str = ".3g") -> str:
    return f"{statistics.median(values):{digits}} [{min(values):{digits}}-{max(values):{digits}}]"


def report(pair: str, reps: list[tuple[Measure, ...]]) -> str:
    """The pair's table: per system median [min-max], then the ratios rep by rep: each relaympi
    system to each peer (the systems with estimated bytes, last), and each variant to relaympi
    (the first). With several peers (Decent-DP on several topologies) it names the fastest by
    median ms/step."""
    first = reps[0]
    width = max(10, *(len(m.system) for m in first))
    lines = [f"{pair}: {len(reps)} alternating rep(s), median [min-max]"]
    lines.append(
        f"  {'system':<{width}} {'ms/step':<22} {'CPU ms/step (all ranks)':<26} bytes/step    "
        "accuracy"
    )
    for side in range(len(first)):
        runs = [rep[side] for rep in reps]
        est = " est" if runs[0].bytes_estimated else ""
        accuracy = ", ".join(f"{m.accuracy:.4f}" for m in runs)
        lines.append(
            f"  {runs[0].system:<{width}} {_spread([m.ms_per_step for m in runs]):<22} "
            f"{_spread([1e3 * m.cpu_s_per_step for m in runs]):<26} "
            f"{runs[0].bytes_per_step:<9.4g}{est:<4} {accuracy}"
        )
    peers = [side for side, m in enumerate(first) if m.bytes_estimated]
    ours = [side for side, m in enumerate(first) if not m.bytes_estimated]
    ratios = [(side, peer) for peer in peers for side in ours]
    ratios += [(side, ours[0]) for side in ours[1:]]
    for side, base in ratios:
        ratio = [rep[side].ms_per_step / rep[base].ms_per_step for rep in reps]
        cpu = [rep[side].cpu_s_per_step / rep[base].cpu_s_per_step for rep in reps]
        other = "peer" if base in peers and len(peers) == 1 else first[base].system
        lines.append(
            f"  ratio {first[side].system}/{other}: ms/step {_spread(ratio, '.2f')}x, "
            f"CPU {_spread(cpu, '.2f')}x"
        )
    if len(peers) > 1:
        best = min(peers, key=lambda side: statistics.median(rep[side].ms_per_step for rep in reps))
        lines.append(f"  fastest peer (median ms/step): {first[best].system}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The harness (or, with ``--worker`` or ``--comm-worker``, one rank).

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
        "--steps",
        type=int,
        help=f"training steps per run (default 200); with --comm-floats exchanges per run "
        f"(default {COMM_STEPS})",
    )
    parser.add_argument(
        "--pair",
        action="append",
        choices=sorted(PAIRS) + sorted(COMM_PAIRS),
        help="a pair to run (default: every pair; with --comm-floats every communication pair: "
        + ", ".join(sorted(COMM_PAIRS))
        + ")",
    )
    parser.add_argument(
        "--peer-topology",
        action="append",
        choices=DECENT_DP_TOPOLOGIES,
        help="Decent-DP's topology in its pairs (repeatable; default: ring for dpsgd:decent-dp, "
        "every one that applies for relay:decent-dp)",
    )
    parser.add_argument(
        "--comm-floats",
        type=int,
        help="communication only: exchange a float32 buffer of this many elements per step, "
        "without compute",
    )
    parser.add_argument("--json", type=Path, help="also write every measure to this file")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:VAR=VALUE[,VAR=VALUE...]: also run relaympi with these environment variables",
    )
    parser.add_argument("--worker", choices=sorted(PEER_NEEDS), help=argparse.SUPPRESS)
    parser.add_argument("--comm-worker", choices=("relaympi", "gloo"), help=argparse.SUPPRESS)
    parser.add_argument("--comm-op", choices=("allreduce", "gossip"), help=argparse.SUPPRESS)
    parser.add_argument("--algo", help=argparse.SUPPRESS)
    parser.add_argument("--topology", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        topology = args.peer_topology[0] if args.peer_topology else None
        peer_worker(args.worker, args.algo, args.topology, args.steps, args.out, topology)
        return 0
    if args.comm_worker:
        comm_worker(args.comm_worker, args.comm_op, args.comm_floats, args.steps, args.out)
        return 0
    comm = args.comm_floats is not None
    least = 2 if comm else 10
    steps = args.steps if args.steps is not None else (COMM_STEPS if comm else 200)
    if args.workers < 2 or args.reps < 1 or steps < least:
        parser.error(
            f"--workers >= 2, --reps >= 1 and --steps >= {least} are allowed, got {args.workers}, "
            f"{args.reps} and {steps}"
        )
    if comm and args.comm_floats < 1:
        parser.error(f"--comm-floats must be >= 1, got {args.comm_floats}")
    pairs_of_mode = COMM_PAIRS if comm else PAIRS
    for pair in args.pair or []:
        if pair not in pairs_of_mode:
            mode = "with --comm-floats" if comm else "without --comm-floats"
            parser.error(f"--pair {pair!r} {mode}; allowed: {', '.join(sorted(pairs_of_mode))}")
    pairs = args.pair or sorted(pairs_of_mode)
    if args.peer_topology and (comm or all(PAIRS[p][2] != "decent-dp" for p in pairs)):
        parser.error(
            "--peer-topology applies to the training pairs with Decent-DP: "
            + ", ".join(p for p in sorted(PAIRS) if PAIRS[p][2] == "decent-dp")
        )
    try:
        variants = dict(parse_variant(text) for text in args.variant)
        topologies = {
            p: peer_topologies(p, args.workers, args.peer_topology) for p in pairs if not comm
        }
    except ValueError as exc:
        parser.error(str(exc))
    for pair in pairs:
        peer = COMM_PAIRS[pair][1] if comm else PAIRS[pair][2]
        if (missing := missing_peer(peer)) is not None:
            print(f"benchmarks.peers: {missing}", file=sys.stderr)
            return 2
    measures: dict[str, list[tuple[Any, ...]]] = {}
    with tempfile.TemporaryDirectory(prefix="relaympi-peers-") as tmp:
        for pair in pairs:
            if comm:
                measures[pair] = [
                    measure_comm(pair, args.comm_floats, args.workers, steps, Path(tmp), variants)
                    for _ in range(args.reps)
                ]
                print(comm_report(pair, args.comm_floats, args.workers, measures[pair]), flush=True)
                continue
            measures[pair] = [
                measure_pair(pair, args.workers, steps, Path(tmp), variants, topologies[pair])
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
