"""Where ranks are: the Communicator's nodes (MPI_COMM_TYPE_SHARED, or --ranks-per-node),
--placement
resolved and recorded, the run file's topology group (each rank's node, every layer's edges), and
where the placement shows (show, the summary line, the report)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from relaympi import train
from relaympi.comm import run_local
from relaympi.comm.base import checked_nodes, number_nodes
from relaympi.config import ConfigError, RunConfig, experiment_settings, parse_args
from relaympi.results import read_run
from relaympi.topology import build, nodes_of
from relaympi.training.plan import resolve, resolve_placement
from tests.conftest import requires_mpirun, run_module, run_train

QUAD = ["--task", "quadratics", "--steps", "4", "--eval-every", "2", "--dim", "4", "--lr", "0.1"]
LOCAL4 = ["--backend", "local", "--workers", "4"]


def _main(args) -> int:
    return train.main([str(a) for a in args])


# -- the Communicator's nodes ----------------------------------------------------------------------
def test_nodes_are_numbered_by_each_nodes_lowest_rank():
    assert number_nodes(["b", "b", "a", "c", "a"]) == (0, 0, 1, 2, 1)
    assert number_nodes([0, 0, 2, 2]) == (0, 0, 1, 1)  # lowest world rank per node -> 0, 1, ...
    assert checked_nodes(None, 3) == (0, 0, 0)
    with pytest.raises(ValueError, match="expecting a node id for each of 4 ranks, got 3"):
        checked_nodes([0, 0, 1], 4)
    with pytest.raises(ValueError, match="numbered 0, 1, ..."):
        checked_nodes([1, 1, 0, 0], 4)


def _my_node(comm):
    return comm.rank, comm.node, comm.nodes


@pytest.mark.parametrize("nodes", [None, (0, 0, 1, 1), (0, 1, 2, 3)])
def test_local_ranks_know_their_emulated_node(nodes):
    results = run_local(4, _my_node, nodes=nodes)
    expected = nodes or (0, 0, 0, 0)
    assert [node for _, node, _ in results] == list(expected)
    assert all(every == tuple(expected) for _, _, every in results)


@pytest.mark.spmd
def test_ranks_of_one_machine_are_one_node(spmd):
    """Under `mpirun -n K` on one machine MPI_COMM_TYPE_SHARED puts every rank on node 0 (plain
    pytest:
    the in-process ranks of one process)."""
    for _rank, node, nodes in spmd(_my_node):
        assert node == 0 and nodes == (0,) * len(nodes) and len(nodes) >= 2


def _emulated(comm):
    from relaympi.comm.mpi import MPICommunicator

    emulated = MPICommunicator(nodes=nodes_of(comm.world_size, 2))
    return emulated.node, emulated.nodes


@pytest.mark.mpi
@pytest.mark.spmd
def test_mpi_ranks_per_node_overrides_the_discovered_nodes(spmd, request):
    if not request.config.getoption("with_mpi", default=False):
        pytest.skip("an MPI communicator needs mpirun (pytest --with-mpi)")
    for node, nodes in spmd(_emulated):
        assert nodes == tuple(r // 2 for r in range(len(nodes)))  # [0, 0, 1, 1] at 4 ranks
        assert node in nodes


@pytest.mark.slow
@requires_mpirun
def test_mpirun_with_ranks_per_node_emulates_nodes(tmp_path):
    """--ranks-per-node under mpirun overrides what MPI_COMM_TYPE_SHARED finds (one node here), and
    says so.
    (The discovered nodes: test_ranks_of_one_machine_are_one_node under mpirun, and
    tests/test_cluster.py on two.)"""
    out = tmp_path / "r.h5"
    args = ["--algo", "dpsgd", "--topology", "chain", *QUAD, "--ranks-per-node", "1", "--out", out]
    proc = run_train(args, mpi=2, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = read_run(out)
    assert run.topology is not None
    assert run.topology.rank_node.tolist() == [0, 1] and run.topology.nodes_emulated
    # auto: the ranks span two nodes
    assert run.topology.placement == "nodes" and run.topology.inter_node_edges == (1,)
    assert run.provenance["nodes"] == 1  # the hardware: one host


# -- --placement: resolution, identity ------------------------------------------------------------
@pytest.mark.parametrize(
    "placement, nodes, resolved",
    [
        ("auto", (0, 0, 0, 0), "ranks"),
        ("auto", (0, 0, 1, 1), "nodes"),
        ("ranks", (0, 0, 1, 1), "ranks"),
        ("nodes", (0, 0, 0, 0), "nodes"),
    ],
)
def test_auto_placement_is_nodes_only_across_nodes(placement, nodes, resolved):
    assert resolve_placement(placement, nodes) == resolved


def test_the_plan_builds_its_topology_with_the_nodes():
    plan = resolve(
        RunConfig(task="quadratics", steps=2, algo="dpsgd", topology="chain", ranks_per_node=2), 4
    )
    assert (
        plan.nodes == (0, 0, 1, 1)
        and plan.cfg.placement == "nodes"
        and plan.cfg.ranks_per_node == 2
    )
    assert plan.topology == build("chain", 4, placement="nodes", nodes=[0, 0, 1, 1])
    one = resolve(RunConfig(task="quadratics", steps=2, algo="dpsgd", topology="chain"), 4)
    assert (
        one.nodes == (0, 0, 0, 0)
        and one.cfg.placement == "ranks"
        and one.topology == build("chain", 4)
    )
    # under MPI the Communicator's nodes (the same list on every rank) decide
    mpi = resolve(
        RunConfig(task="quadratics", steps=2, algo="dpsgd", topology="chain"), 4, (0, 1, 1, 2)
    )
    assert mpi.nodes == (0, 1, 1, 2) and mpi.cfg.placement == "nodes"


def test_placement_and_ranks_per_node_are_part_of_the_experiment():
    base = {"task": "digits", "algo": "relay"}
    assert (
        experiment_settings({**base, "placement": "nodes", "ranks_per_node": 2})["placement"]
        == "nodes"
    )
    assert (
        experiment_settings({**base, "placement": "nodes", "ranks_per_node": 2})["ranks_per_node"]
        == 2
    )
    # no part of the trees
    assert "ranks_per_node" not in experiment_settings(
        {**base, "placement": "ranks", "ranks_per_node": 2}
    )
    # a file from before --placement ran in rank order
    assert experiment_settings(base)["placement"] == "ranks"
    allreduce = {"task": "digits", "algo": "allreduce", "placement": "nodes", "ranks_per_node": 2}
    # a collective
    assert experiment_settings(allreduce) == experiment_settings(
        {**allreduce, "placement": "ranks", "ranks_per_node": None}
    )


# -- the run file ---------------------------------------------------------------------------------
def test_run_file_records_nodes_edges_and_placement(tmp_path, capsys):
    out = tmp_path / "r.h5"
    assert (
        _main(
            [
                *LOCAL4,
                "--algo",
                "relay",
                "--topology",
                "double-binary-trees",
                "--ranks-per-node",
                "2",
                *QUAD,
                "--out",
                out,
            ]
        )
        == 0
    )
    summary = capsys.readouterr().out
    run = read_run(out)
    expected = build("double-binary-trees", 4, placement="nodes", nodes=[0, 0, 1, 1])
    topology = run.topology
    assert topology is not None
    assert (
        run.config["placement"] == topology.placement == "nodes"
        and run.config["ranks_per_node"] == 2
    )
    assert (
        topology.name == "double-binary-trees"
        and topology.rank_node.tolist() == [0, 0, 1, 1]
        and topology.nodes_emulated
    )
    assert len(topology.edges) == expected.num_layers == 2
    for layer, edges in enumerate(topology.edges):
        np.testing.assert_array_equal(edges, expected.edge_array(layer))
        # counted here, not by the topology
        crossing = sum(int(i) // 2 != int(j) // 2 for i, j in edges)
        assert topology.inter_node_edges[layer] == crossing
    assert "placement nodes (2 emulated nodes)" in summary
    shown = run_module("relaympi.results", "show", out, timeout=60).stdout
    assert (
        "placement: nodes" in shown
        and "rank_node: [0, 0, 1, 1]" in shown
        and "nodes: 2 (emulated by --ranks-per-node)" in shown
    )


def test_batched_engine_emulates_the_same_nodes_and_trees(tmp_path):
    args = [
        "--workers",
        "4",
        "--ranks-per-node",
        "2",
        "--algo",
        "relay",
        "--topology",
        "double-binary-trees",
        *QUAD,
    ]
    assert _main(["--backend", "local", *args, "--out", tmp_path / "local.h5"]) == 0
    assert _main(["--backend", "batched", *args, "--out", tmp_path / "batched.h5"]) == 0
    local, batched = read_run(tmp_path / "local.h5"), read_run(tmp_path / "batched.h5")
    assert local.topology is not None and batched.topology is not None
    assert (
        batched.topology.rank_node.tolist() == [0, 0, 1, 1]
        and batched.topology.placement == "nodes"
        and batched.topology.nodes_emulated
    )
    for a, b in zip(local.topology.edges, batched.topology.edges, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(
        batched.data["suboptimality"], local.data["suboptimality"], rtol=1e-9
    )


def test_default_run_file_name_says_nodes_placement():
    from relaympi.training.plan import default_out

    cfg = RunConfig(task="quadratics", steps=2, algo="relay", topology="chain")
    # one node: the name as before
    assert default_out(resolve(cfg, 4).cfg, 4).name == "quadratics-relay-chain-n4-a1-s0.h5"
    placed = resolve(
        RunConfig(task="quadratics", steps=2, algo="relay", topology="chain", ranks_per_node=2), 4
    )
    # never the rank-order run's file
    assert default_out(placed.cfg, 4).name == "quadratics-relay-chain-nodes-n4-a1-s0.h5"


def test_one_node_runs_in_rank_order_and_says_so(tmp_path, capsys):
    out = tmp_path / "r.h5"
    assert _main([*LOCAL4, "--algo", "dpsgd", "--topology", "ring", *QUAD, "--out", out]) == 0
    assert capsys.readouterr().out.rstrip().endswith("| placement ranks")
    run = read_run(out)
    assert run.topology is not None
    assert (
        run.config["placement"] == run.topology.placement == "ranks"
        and not run.topology.nodes_emulated
    )
    assert run.topology.rank_node.tolist() == [0, 0, 0, 0] and run.topology.inter_node_edges == (0,)
    np.testing.assert_array_equal(run.topology.edges[0], [[0, 1], [0, 3], [1, 2], [2, 3]])


def test_resume_refuses_a_changed_placement(tmp_path, monkeypatch, capsys):
    args = [
        *LOCAL4,
        "--algo",
        "dpsgd",
        "--topology",
        "chain",
        "--ranks-per-node",
        "2",
        *QUAD,
        "--out",
        tmp_path / "r.h5",
        "--checkpoint-dir",
        tmp_path / "ckpt",
    ]
    monkeypatch.setenv("RELAYMPI_INJECT_FAILURE", "1:3")
    assert _main(args) == train.EXIT_FAILED  # checkpoint of step 2 (auto resolved to nodes)
    monkeypatch.delenv("RELAYMPI_INJECT_FAILURE")
    capsys.readouterr()
    assert _main([*args, "--placement", "ranks"]) == train.EXIT_USAGE
    assert "placement 'nodes' vs 'ranks'" in capsys.readouterr().err
    assert read_run(tmp_path / "r.h5").status == "failed"  # untouched
    # auto's resolution, given explicitly, is the same run
    assert _main([*args, "--placement", "nodes"]) == 0


def test_resume_refuses_ranks_found_on_other_nodes(tmp_path):
    """Under MPI the nodes come from where the ranks run, not from a flag: a requeued job placed by
    node must
    find its ranks on the same nodes (the trees, hence RelaySum's per-edge state, follow them)."""
    import torch

    from relaympi.training.checkpointing import Checkpoints

    cfg = RunConfig(task="quadratics", steps=4, placement="nodes", checkpoint_dir=tmp_path / "ckpt")
    Checkpoints(cfg, tmp_path / "r.h5", 0, 4, nodes=(0, 0, 1, 1)).save(2, {"x": torch.zeros(1)})
    assert Checkpoints(cfg, tmp_path / "r.h5", 0, 4, nodes=(0, 0, 1, 1)).load()[0] == 2
    with pytest.raises(ConfigError, match=r"each rank's node \[0, 0, 1, 1\] vs \[0, 1, 2, 3\]"):
        Checkpoints(cfg, tmp_path / "r.h5", 0, 4, nodes=(0, 1, 2, 3)).load()
    ranks = RunConfig(
        task="quadratics", steps=4, placement="ranks", checkpoint_dir=tmp_path / "ranks"
    )
    Checkpoints(ranks, tmp_path / "r.h5", 0, 4, nodes=(0, 0, 1, 1)).save(2, {"x": torch.zeros(1)})
    # rank order: nodes change nothing
    assert Checkpoints(ranks, tmp_path / "r.h5", 0, 4, nodes=(0, 1, 2, 3)).load()[0] == 2
    # all-reduce's tree sums in an order set by the nodes
    # (relaympi.comm.tree_allreduce.stage_order): the same nodes, or refused
    summed = RunConfig(
        task="quadratics",
        steps=4,
        algo="allreduce",
        placement="ranks",
        checkpoint_dir=tmp_path / "allreduce",
    )
    Checkpoints(summed, tmp_path / "r.h5", 0, 4, nodes=(0, 0, 1, 1)).save(2, {"x": torch.zeros(1)})
    assert Checkpoints(summed, tmp_path / "r.h5", 0, 4, nodes=(0, 0, 1, 1)).load()[0] == 2
    with pytest.raises(ConfigError, match=r"--algo allreduce the order of its sum"):
        Checkpoints(summed, tmp_path / "r.h5", 0, 4, nodes=(0, 1, 2, 3)).load()


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--ranks-per-node", "0"],
            r"error: --ranks-per-node must be >= 1 \(ranks on each emulated node\), got 0",
        ),
        # quotes: Python 3.12+
        (
            ["--placement", "bogus"],
            r"--placement: invalid choice: 'bogus' \(choose from '?auto'?, '?ranks'?, '?nodes'?\)",
        ),
        (
            ["--algo", "dpsgd", "--topology", "edge-list:{chain}", "--placement", "nodes"],
            r"topology 'edge-list:.*chain.txt' with 4 workers and --placement nodes: "
            r"placement 'nodes' does not apply to 'edge-list'.*use placement 'ranks'",
        ),
    ],
)
def test_bad_placement_input_is_one_error_line_and_writes_nothing(tmp_path, args, message):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "chain.txt").write_text("0 1\n1 2\n2 3\n")
    args = [a.format(chain=inputs / "chain.txt") for a in args]
    out = tmp_path / "out"
    out.mkdir()
    proc = run_train([*LOCAL4, *QUAD, *args, "--out", out / "r.h5"], timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]) and "Traceback" not in proc.stderr, (
        proc.stderr
    )
    assert list(out.iterdir()) == []


def test_auto_keeps_rank_order_where_a_topology_cannot_be_placed(tmp_path):
    """An edge list names its edges rank by rank: across nodes, auto keeps it (an explicit nodes is
    refused above)."""
    chain = tmp_path / "chain.txt"
    chain.write_text("0 1\n1 2\n2 3\n")
    plan = resolve(
        RunConfig(
            task="quadratics",
            steps=2,
            algo="dpsgd",
            topology=f"edge-list:{chain}",
            ranks_per_node=2,
        ),
        4,
    )
    assert plan.cfg.placement == "ranks" and plan.nodes == (0, 0, 1, 1)
    assert plan.topology.edges(0) == [(0, 1), (1, 2), (2, 3)]


def test_a_config_file_with_a_bogus_placement_is_refused(tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"placement": "bogus"}')
    with pytest.raises(
        ConfigError, match="unknown --placement 'bogus'; choose one of auto, ranks, nodes"
    ):
        parse_args([*LOCAL4, *QUAD, "--config", str(config)])


# -- the report -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_report_says_which_placement_and_tells_rows_apart(tmp_path):
    for name, extra in (("a", []), ("b", ["--ranks-per-node", "2"])):
        assert (
            _main(
                [
                    *LOCAL4,
                    "--task",
                    "digits",
                    "--steps",
                    "2",
                    "--algo",
                    "dpsgd",
                    "--topology",
                    "chain",
                    *extra,
                    "--out",
                    tmp_path / f"{name}.h5",
                ]
            )
            == 0
        )
    proc = run_module("relaympi.report", tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "placement: nodes (1 run), ranks (1 run)" in proc.stdout.splitlines()[0]
    assert "D-PSGD, placement=nodes" in proc.stdout and "D-PSGD, placement=ranks" in proc.stdout
