"""Node-aware topologies (placement "nodes"): each property held to an independent computation
with networkx over many node layouts, and the topology command line's cluster plan."""

from __future__ import annotations

import contextlib
import io
import json
import pickle

import networkx as nx
import numpy as np
import pytest

from relaympi.algorithms.relay_lr import simulated_lr_correction
from relaympi.commands.topology import DEFAULT_MODEL_SIZE, main
from relaympi.topology import PLACEMENTS, TopologyError, build, coordinate_blocks, nodes_of
from tests.node_layouts import layout

TREES = ("chain", "binary-tree", "double-binary-trees")


def _layouts(n: int):
    """Block layouts of every node size, round-robin ones, and a shuffled uneven one."""
    for k in sorted({k for k in (1, 2, 3, 4, 5, 8, n - 1, n) if k >= 1}):
        yield f"{k}", nodes_of(n, k)
    for k in (2, 3, 4):
        yield f"{k}rr", layout(f"{k}rr", n)
    rng = np.random.default_rng(n)
    yield "random", tuple(rng.integers(0, max(1, n // 3), n).tolist())


LAYOUTS = [(n, name, nodes) for n in (2, 3, 7, 8, 9, 12, 17, 30) for name, nodes in _layouts(n)]


def _by_node(nodes) -> dict:
    groups: dict = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node, []).append(rank)
    return groups


def _quotient(graph: nx.Graph, nodes) -> nx.MultiGraph:
    """The graph of nodes: one edge per inter-node edge of graph."""
    quotient = nx.MultiGraph()
    quotient.add_nodes_from(set(nodes))
    quotient.add_edges_from((nodes[i], nodes[j]) for i, j in graph.edges if nodes[i] != nodes[j])
    return quotient


# -- building ---------------------------------------------------------------------------


def test_nodes_of_fills_nodes_in_blocks_and_the_last_may_be_smaller():
    assert PLACEMENTS == ("ranks", "nodes")
    assert nodes_of(7, 3) == (0, 0, 0, 1, 1, 1, 2)
    assert nodes_of(4, 1) == (0, 1, 2, 3) and nodes_of(3, 8) == (0, 0, 0)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(TopologyError, match="ranks_per_node must be"):
            nodes_of(8, bad)  # type: ignore[arg-type]  # wrong types on purpose


def test_build_checks_placement_and_nodes():
    with pytest.raises(TopologyError, match=r"placement must be one of ranks, nodes, got 'node'"):
        build("chain", 4, placement="node")
    with pytest.raises(TopologyError, match="placement 'nodes' needs the node of every rank"):
        build("chain", 4, placement="nodes")
    with pytest.raises(TopologyError, match="node of each of the 4 ranks, got 3 entries"):
        build("chain", 4, placement="ranks", nodes=[0, 0, 1])
    # "ranks" builds in rank order whatever the layout
    assert build("chain", 4, nodes=[1, 0, 1, 0]) == build("chain", 4)
    assert build("chain", 4).placement == "ranks"


@pytest.mark.parametrize(
    "name, n", [("social-network", 32), ("social-network-tree", 32), ("spanning-tree:ring", 8)]
)
def test_nodes_refused_where_edges_are_given_rank_by_rank(name, n):
    with pytest.raises(
        TopologyError,
        match=f"placement 'nodes' does not apply to {name!r}: its edges are given rank by rank",
    ):
        build(name, n, placement="nodes", nodes=nodes_of(n, 4))


def test_edge_list_refuses_nodes(tmp_path):
    path = tmp_path / "e.txt"
    path.write_text("0 1\n1 2\n")
    with pytest.raises(TopologyError, match="does not apply to 'edge-list'"):
        build("edge-list", 3, edge_list=path, placement="nodes", nodes=[0, 0, 1])


def test_exponential_needs_contiguous_nodes():
    contiguous = build("exponential", 8, placement="nodes", nodes=nodes_of(8, 2))
    assert contiguous.placement == "nodes" and contiguous.edges() == build("exponential", 8).edges()
    with pytest.raises(
        TopologyError,
        match="needs every node's ranks contiguous.*rank 2 is on an earlier node than rank 1",
    ):
        build("exponential", 8, placement="nodes", nodes=[0, 1, 0, 1, 0, 1, 0, 1])


@pytest.mark.parametrize(
    "name",
    [
        "ring",
        "chain",
        "star",
        "binary-tree",
        "double-binary-trees",
        "fully-connected",
        "hypercube",
        "exponential",
    ],
)
@pytest.mark.parametrize("n", [4, 8, 16])
def test_one_node_is_the_rank_order_topology(name, n):
    ranks, placed = build(name, n), build(name, n, placement="nodes", nodes=["host"] * n)
    assert placed.placement == "nodes" and placed.name == ranks.name
    assert [placed.edges(k) for k in range(placed.num_layers)] == [
        ranks.edges(k) for k in range(ranks.num_layers)
    ]


def test_placement_is_part_of_the_value():
    placed = build("double-binary-trees", 12, placement="nodes", nodes=nodes_of(12, 3))
    assert (
        placed.to_dict()["placement"] == "nodes"
        and build("chain", 3).to_dict()["placement"] == "ranks"
    )
    copy = pickle.loads(pickle.dumps(placed))
    assert copy == placed and copy.placement == "nodes" and copy.to_dict() == placed.to_dict()
    one_node = build("chain", 5, placement="nodes", nodes=[0] * 5)
    assert one_node != build("chain", 5) and one_node.edges() == build("chain", 5).edges()
    assert "placement='nodes'" in repr(placed)


# -- properties, over many layouts ------------------------------------------------------


@pytest.mark.parametrize(
    "n, layout_name, nodes", LAYOUTS, ids=[f"n{n}-{name}" for n, name, _ in LAYOUTS]
)
def test_trees_keep_each_nodes_ranks_in_one_subtree(n, layout_name, nodes):
    groups = _by_node(nodes)
    m = len(groups)
    for name in TREES:
        topology = build(name, n, placement="nodes", nodes=nodes)
        assert (
            topology.is_tree and topology.inter_node_edges(nodes) == [m - 1] * topology.num_layers
        )
        for k, graph in enumerate(topology.layers):
            assert nx.is_tree(graph)
            for ranks in groups.values():
                assert nx.is_connected(graph.subgraph(ranks)), (name, k, ranks)
            # the nodes are joined by a tree: M - 1 inter-node edges, the fewest that connect
            # M nodes
            quotient = _quotient(graph, nodes)
            assert quotient.number_of_edges() == m - 1 and nx.is_connected(quotient)
        if name == "binary-tree":
            assert max(d for _, d in topology.layers[0].degree) <= 3
        if name == "chain":  # a node's ranks in a row, nodes in the order of their lowest rank
            path = nx.shortest_path(
                topology.layers[0], *[r for r, d in topology.layers[0].degree if d == 1]
            )
            order = sorted(range(n), key=lambda r: (min(groups[nodes[r]]), r))
            assert path in (order, order[::-1])


@pytest.mark.parametrize(
    "n, layout_name, nodes", LAYOUTS, ids=[f"n{n}-{name}" for n, name, _ in LAYOUTS]
)
def test_double_binary_trees_keep_their_properties_at_the_node_level(n, layout_name, nodes):
    topology = build("double-binary-trees", n, placement="nodes", nodes=nodes)
    groups = _by_node(nodes)
    m = len(groups)
    # at most 2 models per step: each tree carries half the model to each neighbour
    degree = [np.array([topology.layers[k].degree[r] for r in range(n)]) for k in range(2)]
    assert ((degree[0] + degree[1]) / 2 <= 2).all() and topology.max_models_per_step() <= 2
    # the node-level trees are the paper's pair over M nodes: complementary, B the mirror of A
    node_index = {
        node: i for i, node in enumerate(sorted(groups, key=lambda node: min(groups[node])))
    }
    node_trees = [
        nx.Graph([(node_index[a], node_index[b]) for a, b in _quotient(g, nodes).edges()])
        for g in topology.layers
    ]
    if m >= 2:
        paper = build("double-binary-trees", m)
        assert sorted(tuple(sorted(e)) for e in node_trees[0].edges) == paper.edges(0)
        assert sorted(tuple(sorted(e)) for e in node_trees[1].edges) == paper.edges(1)
        internal = [{v for v in t if t.degree[v] > 1} for t in node_trees]
        assert not internal[0] & internal[1]
    # rank by rank complementary whenever every node has an odd number of ranks
    if all(len(ranks) % 2 for ranks in groups.values()):
        assert not ((degree[0] > 1) & (degree[1] > 1)).any()
    # layer k carries coordinate block k, as in rank order
    assert topology.coordinate_blocks(11) == coordinate_blocks(11, 2) == (slice(0, 6), slice(6, 11))


@pytest.mark.parametrize(
    "n, layout_name, nodes", LAYOUTS, ids=[f"n{n}-{name}" for n, name, _ in LAYOUTS]
)
def test_graphs_cross_between_nodes_as_little_as_placement_allows(n, layout_name, nodes):
    groups = _by_node(nodes)
    m = len(groups)
    if n >= 3:
        ring = build("ring", n, placement="nodes", nodes=nodes)
        assert nx.is_isomorphic(ring.layers[0], nx.cycle_graph(n))
        assert ring.inter_node_edges(nodes) == [m if m >= 2 else 0]
        # the same spectrum: a relabelled ring
        assert ring.gossip_extremes() == build("ring", n).gossip_extremes()
    star = build("star", n, placement="nodes", nodes=nodes)
    hub = max(range(n), key=lambda r: star.degree(r))
    largest = max(len(ranks) for ranks in groups.values())
    assert len(groups[nodes[hub]]) == largest and star.inter_node_edges(nodes) == [n - largest]
    if n & (n - 1) == 0:
        cube = build("hypercube", n, placement="nodes", nodes=nodes)
        assert nx.is_isomorphic(cube.layers[0], nx.hypercube_graph(n.bit_length() - 1))


@pytest.mark.parametrize(
    "spec, n",
    [("double-binary-trees", 10), ("double-binary-trees", 9), ("chain", 8), ("binary-tree", 11)],
)
@pytest.mark.parametrize("where", ["3", "3rr", "2"])
def test_lr_correction_of_node_aware_trees_is_the_simulation(spec, n, where):
    from relaympi.algorithms.relay_lr import lr_correction

    topology = build(spec, n, placement="nodes", nodes=layout(where, n))
    assert lr_correction(topology) == pytest.approx(simulated_lr_correction(topology), rel=1e-9)


def test_inter_node_edges_counts_edges_between_hosts():
    ring = build("ring", 6)
    # between hosts: 1-2 (a-b), 3-4 (b-a), 4-5 (a-c), 5-0 (c-a)
    hosts = ["a", "a", "b", "b", "a", "c"]
    assert ring.inter_node_edges(hosts) == [4]
    # ends on a, b, c (in order of lowest rank)
    assert ring.inter_node_degrees(hosts).tolist() == [[4, 2, 2]]


# -- at cluster scale -------------------------------------------------------------------


@pytest.mark.slow
def test_node_aware_double_binary_trees_at_100000_ranks():
    n, k = 100_000, 8
    nodes = nodes_of(n, k)
    topology = build("double-binary-trees", n, placement="nodes", nodes=nodes)
    assert (
        topology.inter_node_edges(nodes) == [n // k - 1] * 2 and topology.max_models_per_step() == 2
    )
    # every node of 8 ranks: a subtree of 7 intra-node edges in each tree
    for edges in (topology.edge_array(0), topology.edge_array(1)):
        inside = edges[edges[:, 0] // k == edges[:, 1] // k]
        assert np.bincount(inside[:, 0] // k, minlength=n // k).tolist() == [k - 1] * (n // k)
    status, out, err = _run(
        [
            "double-binary-trees",
            "-n",
            str(n),
            "--ranks-per-node",
            str(k),
            "--placement",
            "nodes",
            "--json",
        ]
    )
    assert status == 0, err
    summary = json.loads(out)
    assert summary["inter_node_edges"] == [n // k - 1] * 2 and summary["nodes"] == n // k
    for layer in range(2):
        np.testing.assert_array_equal(np.array(summary["edges"][layer]), topology.edge_array(layer))
    assert summary["models_per_step"] == 2 and summary["is_tree"] and "not_computed" not in summary


# -- command line -----------------------------------------------------------------------


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = int(exit_.code or 0)
    return status, out.getvalue(), err.getvalue()


def test_default_model_size_is_vgg11():
    from relaympi.tasks.models import VGG11_NUM_PARAMETERS

    assert DEFAULT_MODEL_SIZE == VGG11_NUM_PARAMETERS


def test_cli_plans_double_binary_trees_for_a_cluster():
    n, k, d = 12, 3, 1001
    status, out, err = _run(
        [
            "double-binary-trees",
            "-n",
            str(n),
            "--ranks-per-node",
            str(k),
            "--placement",
            "nodes",
            "--model-size",
            str(d),
            "--dtype-bytes",
            "2",
            "--json",
        ]
    )
    assert status == 0, err
    summary = json.loads(out)
    nodes = nodes_of(n, k)
    topology = build("double-binary-trees", n, placement="nodes", nodes=nodes)
    assert (
        summary["placement"] == "nodes" and summary["ranks_per_node"] == k and summary["nodes"] == 4
    )
    assert summary["inter_node_edges"] == [3, 3]
    # by hand from the edges: each edge between nodes carries its tree's block (501, 500 elements)
    # each step
    sent = {node: 0 for node in range(4)}
    for layer, block in enumerate((501, 500)):
        for i, j in topology.edges(layer):
            if nodes[i] != nodes[j]:
                sent[nodes[i]] += block * 2
                sent[nodes[j]] += block * 2
    assert summary["inter_node_bytes_per_node_per_step"] == max(sent.values())
    for layer, graph in enumerate(topology.layers):
        pairs = dict(nx.all_pairs_shortest_path_length(graph))
        mean = sum(pairs[i][j] for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
        assert summary["mean_delays"][layer] == pytest.approx(mean, rel=1e-12)
        assert summary["layer_diameters"][layer] == nx.diameter(graph)
    status, text, _ = _run(
        ["double-binary-trees", "-n", str(n), "--ranks-per-node", str(k), "--placement", "nodes"]
    )
    assert "placement         nodes  (4 nodes of 3 ranks)" in text
    assert "  layer 0: inter-node edges 3, diameter" in text and "lr correction" in text
    assert "per node per step (most over nodes; model of 9225610 x 4 bytes)" in text


def test_cli_rank_order_counts_every_edge_between_single_rank_nodes():
    status, out, _ = _run(["ring", "-n", "8", "--json"])
    summary = json.loads(out)
    assert (
        summary["placement"] == "ranks"
        and summary["ranks_per_node"] == 1
        and summary["inter_node_edges"] == [8]
    )
    # a model to each neighbour
    assert summary["inter_node_bytes_per_node_per_step"] == 2 * DEFAULT_MODEL_SIZE * 4
    status, out, _ = _run(
        ["ring", "-n", "8", "--ranks-per-node", "2", "--placement", "nodes", "--json"]
    )
    assert json.loads(out)["inter_node_edges"] == [4]
    # one edge out each way
    assert json.loads(out)["inter_node_bytes_per_node_per_step"] == 2 * DEFAULT_MODEL_SIZE * 4


def test_cli_counts_sgp_sends_between_nodes_per_round():
    status, out, _ = _run(
        ["exponential", "-n", "16", "--ranks-per-node", "4", "--model-size", "10", "--json"]
    )
    summary = json.loads(out)
    nodes = nodes_of(16, 4)
    expected = [sum(nodes[r] != nodes[(r - o) % 16] for r in range(16)) for o in (1, 2, 4, 8)]
    assert summary["schedule"]["inter_node_sends"] == expected == [4, 8, 16, 16]
    # step t runs rounds 2t and 2t+1 (mod 4): the busiest node sends 4 + 4 models in rounds 2, 3
    assert summary["inter_node_bytes_per_node_per_step"] == 8 * 10 * 4
    status, text, _ = _run(["exponential", "-n", "16", "--ranks-per-node", "4"])
    assert "round 0 (offset 1): 4 of 16 sends between nodes" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["ring", "-n", "8", "--ranks-per-node", "0"],
            "error: argument --ranks-per-node: must be an integer >= 1, got 0",
        ),
        (
            ["ring", "-n", "8", "--ranks-per-node", "x"],
            "error: argument --ranks-per-node: must be an integer >= 1, got 'x'",
        ),
        (
            ["ring", "-n", "8", "--model-size", "-1"],
            "error: argument --model-size: must be an integer >= 1, got -1",
        ),
        (
            ["ring", "-n", "8", "--placement", "hosts"],
            "error: argument --placement: invalid choice: 'hosts'",
        ),
        (
            ["ring", "-n", "8", "--placement", "nodes"],
            "error: --placement nodes needs --ranks-per-node K",
        ),
        (
            ["social-network", "-n", "32", "--placement", "nodes", "--ranks-per-node", "4"],
            "error: placement 'nodes' does not apply to 'social-network'",
        ),
        (["exponential", "-n", "8", "--placement", "nodes", "--ranks-per-node", "3"], None),
    ],
)
def test_cli_misuse_is_one_error_line_and_exit_2(argv, message):
    status, out, err = _run(argv)
    if message is None:  # contiguous nodes of 3 (the last one of 2): accepted
        assert (
            status == 0
            and "placement         nodes  (3 nodes of 3 ranks, the last one smaller)" in out
        )
        return
    assert status == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message) and "Traceback" not in err


def test_trees_deep_from_rank_0_count_eigenvalues_from_their_centre():
    # node-aware tree B is rooted at the far end from rank 0: the inertia counts root a tree at its
    # centre when rank 0 is too deep. A broom: a path 0..99, then 1000 leaves on rank 99.
    from relaympi.topology import Topology, min_eigenvalue, spectral_gap
    from relaympi.topology.spectra import DENSE_SPECTRUM_MAX_RANKS, TREE_INERTIA_MAX_HEIGHT

    path = np.stack([np.arange(99), np.arange(1, 100)], axis=1)
    leaves = np.stack([np.full(1000, 99), np.arange(100, 1100)], axis=1)
    broom = Topology("broom", 1100, (np.concatenate([path, leaves]),))
    assert (
        broom.world_size > DENSE_SPECTRUM_MAX_RANKS
        and broom.hops_from(0).max() > TREE_INERTIA_MAX_HEIGHT
    )
    root = broom._tree_root(0)
    assert broom.hops_from(root).max() == 50  # ceil(diameter 100 / 2)
    w = broom.mixing_matrix()
    assert broom.gossip_extremes().spectral_gap == pytest.approx(spectral_gap(w), abs=1e-12)
    assert broom.gossip_extremes().min_eigenvalue == pytest.approx(min_eigenvalue(w), abs=1e-12)


def test_node_ids_as_a_numpy_array_number_nodes_by_their_lowest_rank():
    from relaympi.topology.core import node_labels

    assert (
        node_labels(np.array([5, 5, 2, 9, 2]), 5).tolist()
        == [0, 0, 1, 2, 1]
        == node_labels([5, 5, 2, 9, 2], 5).tolist()
    )
    ids = np.random.default_rng(0).integers(0, 7, 40)
    assert node_labels(ids, 40).tolist() == node_labels(ids.tolist(), 40).tolist()


@pytest.mark.slow
def test_topology_scale_benchmark_runs_node_aware(capsys):
    from benchmarks import topology_scale

    assert (
        topology_scale.main(
            [
                "--sizes",
                "64",
                "--names",
                "double-binary-trees,social-network",
                "--ranks-per-node",
                "8",
            ]
        )
        == 0
    )
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:4] for row in rows] == [
        ["double-binary-trees", "64", "text", "0"],
        ["double-binary-trees", "64", "json", "0"],
    ]
