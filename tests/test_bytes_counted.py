"""Every byte a run sends is counted: the fixed-tree all-reduce's messages in bytes_sent, and each
worker's bytes to other nodes in inter_node_bytes_sent, for every algorithm on every engine, checked
against what the topology (or the all-reduce's tree) says each worker sends."""

from __future__ import annotations

import csv
import io
import subprocess
import sys

import h5py
import numpy as np
import pytest

from benchmarks import comm as bench
from relaympi import report, results, train
from relaympi.comm import run_local
from relaympi.comm.tree_allreduce import stage_order, tree_bytes, tree_sends, tree_sum
from relaympi.config import parse_args
from relaympi.results import read_run
from relaympi.topology import ExponentialSchedule
from relaympi.training.plan import resolve
from tests.conftest import ROOT, env_for_subprocess, mpirun_path, requires_mpirun

ALGOS = ("allreduce", "dpsgd", "qgm", "d2", "gt", "sgp", "relay", "relay-grad")
DIM = 11  # odd: the tree's halves and the relay's blocks are uneven
ITEMSIZE = 8  # quadratics run in float64
STEPS, EVAL_EVERY = 6, 2
NODES_ARGS = ["--ranks-per-node", "2"]


class _RecordingComm:
    """Get_rank/Get_size/Isend/Irecv for tree_sum without MPI: records each send."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.sends: list[tuple[int, int]] = []

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Isend(self, buf, dest, tag):  # noqa: N802
        self.sends.append((dest, buf.size))

    def Irecv(self, buf, source, tag):  # noqa: N802
        buf[...] = 0  # tree_sum adds what it receives


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("numel", [0, 1, 7, 1000])
def test_tree_sends_lists_what_tree_sum_sends(n, numel):
    for nodes in ([0] * n, [r // 2 for r in range(n)], [r % 2 for r in range(n)]):
        order = stage_order([{v: i for i, v in enumerate(dict.fromkeys(nodes))}[v] for v in nodes])
        for rank in range(n):
            comm = _RecordingComm(rank, n)
            sent = np.zeros(n, dtype=np.int64)
            for _ in tree_sum(comm, np.zeros(numel, dtype=np.float32), 0, order, sent):
                pass
            assert comm.sends == tree_sends(rank, n, numel, order)
            np.testing.assert_array_equal(sent, tree_bytes(n, numel, order, 4)[rank])


@pytest.mark.parametrize("nodes", [(0, 0, 1, 1), (0, 1), (0, 0, 0, 1, 1, 1), (0, 0, 1, 1, 2, 2, 3)])
@pytest.mark.parametrize("numel", [7, 1000])
def test_tree_bytes_agree_with_the_benchmarks_inter_node_count(nodes, numel):
    """The busiest rank's bytes to other nodes: benchmarks.comm's own derivation of the tree."""
    order = stage_order(nodes)
    sent = tree_bytes(len(nodes), numel, order, 4)
    other = np.array(nodes)[:, None] != np.array(nodes)[None, :]
    assert (sent * other).sum(axis=1).max() == bench.tree_inter_node_bytes(
        list(nodes), [numel], order
    )


@pytest.mark.parametrize(
    "world_size, nodes", [(4, (0, 0, 1, 1)), (6, (0, 0, 0, 1, 1, 1)), (3, None)]
)
def test_local_all_reduce_counts_the_trees_messages(world_size, nodes):
    def body(comm):
        x = np.arange(DIM, dtype=np.float64)
        comm.iallreduce_sum(x).wait()
        comm.iallreduce_sum(x[:4]).wait()  # a piece: its own tree
        return comm.bytes_sent.copy(), comm.inter_node_bytes()

    results = run_local(world_size, body, nodes=nodes)
    placed = nodes or (0,) * world_size
    order = stage_order(placed)
    want = tree_bytes(world_size, DIM, order, 8) + tree_bytes(world_size, 4, order, 8)
    other = np.array(placed)[:, None] != np.array(placed)[None, :]
    for rank, (sent, inter) in enumerate(results):
        np.testing.assert_array_equal(sent, want[rank])
        assert inter == (want * other)[rank].sum()
    assert want.sum() > 0


@pytest.mark.spmd
def test_mpi_all_reduce_counts_the_messages_it_posts(spmd, request):
    """Under mpirun (pytest --with-mpi): the MPI communicator counts the tree's messages as it posts
    them, on emulated nodes of two ranks (plain pytest: the in-process ranks)."""
    if request.config.getoption("with_mpi", default=False):
        from relaympi.comm import mpi_communicator

        size = request.getfixturevalue("mpi_comm").world_size
        nodes = [r // 2 for r in range(size)]
        results = [_sum_and_count(mpi_communicator(nodes=nodes))]
    else:
        size, nodes = 4, [0, 0, 0, 0]
        results = spmd(_sum_and_count)
    for rank, sent in results:
        np.testing.assert_array_equal(sent, tree_bytes(size, DIM, stage_order(nodes), 4)[rank])


def _sum_and_count(comm):
    before = comm.bytes_sent.copy()
    x = np.ones(DIM, dtype=np.float32)
    comm.iallreduce_sum(x).wait()
    assert np.all(x == comm.world_size)
    return comm.rank, comm.bytes_sent - before


# -- every algorithm, every engine ---------------------------------------------------------------


def _args(algo):
    return [
        "--task",
        "quadratics",
        "--dim",
        str(DIM),
        "--algo",
        algo,
        "--lr",
        "0.05",
        "--steps",
        str(STEPS),
        "--eval-every",
        str(EVAL_EVERY),
        *NODES_ARGS,
    ]


def _expected_step(algo, topology, nodes, step):
    """[n, n]: the bytes worker i sends worker j in step ``step``, from the topology alone."""
    n = topology.world_size
    sent = np.zeros((n, n), dtype=np.int64)
    if algo == "allreduce":
        return tree_bytes(n, DIM, stage_order(nodes), ITEMSIZE)
    if algo in ("relay", "relay-grad"):  # per tree: its block of the model and a counter
        for layer, block in enumerate(topology.coordinate_blocks(DIM)):
            for rank in range(n):
                for peer in topology.neighbors(rank, layer):
                    sent[rank, peer] += (block.stop - block.start + 1) * ITEMSIZE
    elif algo == "sgp":  # two rounds, each to the schedule's peer of that round
        schedule = ExponentialSchedule(n)
        for r in range(2):
            for rank in range(n):
                sent[rank, schedule.send_peer(2 * step + r, rank)] += DIM * ITEMSIZE
    else:  # gossip: the model to every neighbour (gradient tracking: the model and its tracker)
        models = 2 if algo == "gt" else 1
        for rank in range(n):
            for peer in topology.neighbors(rank, 0):
                sent[rank, peer] += models * DIM * ITEMSIZE
    return sent


def _check_counts(path, algo):
    run = read_run(path)
    plan = resolve(parse_args(_args(algo)), 4)
    assert run.topology is not None
    nodes = np.asarray(run.topology.rank_node)
    assert nodes.tolist() == list(plan.nodes) == [0, 0, 1, 1]
    for layer, edges in enumerate(run.topology.edges):
        np.testing.assert_array_equal(edges, plan.topology.edge_array(layer))
    other = nodes[:, None] != nodes[None, :]
    total, done = np.zeros((4, 4), dtype=np.int64), 0
    for row, step in enumerate(run.data["step"]):
        for t in range(done, int(step)):
            total += _expected_step(algo, plan.topology, plan.nodes, t)
        done = int(step)
        where = f"{algo} at step {step}"
        np.testing.assert_array_equal(run.data["bytes_sent"][row], total.sum(axis=1), err_msg=where)
        np.testing.assert_array_equal(
            run.data["inter_node_bytes_sent"][row], (total * other).sum(axis=1), err_msg=where
        )
    assert done == STEPS
    assert run.data["inter_node_bytes_sent"][-1].max() > 0 and run.data["bytes_sent"][-1].min() > 0


@pytest.mark.parametrize("backend", ["local", "batched"])
@pytest.mark.parametrize("algo", ALGOS)
def test_bytes_and_inter_node_bytes_match_the_topology(tmp_path, algo, backend):
    out = tmp_path / f"{algo}-{backend}.h5"
    assert (
        train.main([*_args(algo), "--backend", backend, "--workers", "4", "--out", str(out)]) == 0
    )
    _check_counts(out, algo)


@requires_mpirun
@pytest.mark.parametrize("algo", ALGOS)
def test_mpi_bytes_and_inter_node_bytes_match_the_topology(tmp_path, algo):
    out = tmp_path / f"{algo}-mpi.h5"
    cmd = [
        mpirun_path(),
        "-n",
        "4",
        sys.executable,
        "-m",
        "relaympi.train",
        *_args(algo),
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env_for_subprocess(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_counts(out, algo)


def test_show_and_the_cost_table_give_each_workers_inter_node_bytes(tmp_path, capsys):
    """A counted all-reduce run: `show` and the report's cost table give its bytes per step and its
    bytes to other nodes per step (files written before they were counted stay empty there)."""
    args = [
        "--task",
        "digits",
        "--backend",
        "local",
        "--workers",
        "4",
        "--steps",
        "4",
        "--eval-every",
        "2",
        *NODES_ARGS,
    ]
    for algo in ("allreduce", "relay"):
        assert train.main([*args, "--algo", algo, "--out", str(tmp_path / f"{algo}.h5")]) == 0
    run = read_run(tmp_path / "allreduce.h5")
    per_step = {
        name: (run.data[name][-1] - run.data[name][0]) / 4
        for name in ("bytes_sent", "inter_node_bytes_sent")
    }
    assert per_step["inter_node_bytes_sent"].min() > 0
    capsys.readouterr()
    assert results.main(["show", str(tmp_path / "allreduce.h5")]) == 0
    shown = capsys.readouterr().out
    assert "inter_node_bytes_sent: float64 [3, 4]" in shown
    mean, most = per_step["inter_node_bytes_sent"].mean(), per_step["inter_node_bytes_sent"].max()
    assert f"inter-node bytes/step {mean:.4g} (max worker {most:.4g})" in shown
    assert report.main([str(tmp_path), "--format", "csv"]) == 0
    (block,) = [b for b in capsys.readouterr().out.split("\n\n") if b.startswith("# cost_")]
    rows = {row["algo"]: row for row in csv.DictReader(io.StringIO(block.partition("\n")[2]))}
    assert float(rows["allreduce"]["bytes_per_step"]) == pytest.approx(
        per_step["bytes_sent"].mean()
    )
    assert float(rows["allreduce"]["inter_node_bytes_per_step"]) == pytest.approx(mean)
    assert float(rows["relay"]["inter_node_bytes_per_step"]) > 0


@pytest.mark.slow
def test_a_run_resumed_in_an_older_file_goes_on_without_the_new_dataset(tmp_path):
    """A file written before inter_node_bytes_sent was recorded keeps its datasets on resume."""
    out, ckpt = tmp_path / "r.h5", tmp_path / "ckpt"
    cmd = [
        sys.executable,
        "-m",
        "relaympi.train",
        *_args("relay"),
        "--backend",
        "local",
        "--workers",
        "4",
        "--out",
        str(out),
        "--checkpoint-dir",
        str(ckpt),
    ]
    env = {**env_for_subprocess(), "RELAYMPI_INJECT_SIGNAL": "TERM:4"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stderr[-3000:]
    with h5py.File(out, "r+") as f:  # as written before the dataset existed
        del f["inter_node_bytes_sent"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env_for_subprocess(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(out)
    assert run.status == "completed" and "inter_node_bytes_sent" not in run.data
    assert run.data["step"].tolist() == list(range(0, STEPS + 1, EVAL_EVERY))


@pytest.mark.parametrize("backend", ["local", "batched"])
@pytest.mark.parametrize("topology", ["one-peer-exponential", "alternating-ring"])
@pytest.mark.parametrize("algo", ["dpsgd", "gt"])
def test_one_peer_topologies_send_half_a_rings_bytes(tmp_path, algo, topology, backend):
    """One peer per step: each worker sends its model (gradient tracking: and its tracker) once a
    step, half of what it sends on a ring's two neighbours."""
    per_step = {}
    for topo in ("ring", topology):
        out = tmp_path / f"{topo}.h5"
        args = [*_args(algo)[: -len(NODES_ARGS)], "--topology", topo, "--backend", backend]
        assert train.main([*args, "--workers", "4", "--out", str(out)]) == 0
        run = read_run(out)
        np.testing.assert_array_equal(run.data["step"][-1], STEPS)
        per_step[topo] = run.data["bytes_sent"][-1] / STEPS
    models = 2 if algo == "gt" else 1
    np.testing.assert_array_equal(per_step[topology], np.full(4, models * DIM * ITEMSIZE))
    np.testing.assert_array_equal(per_step["ring"], 2 * per_step[topology])
