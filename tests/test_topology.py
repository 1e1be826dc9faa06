"""Tests for relaympi.topology: graph invariants, schedules, gossip weights, lr correction, CLI."""

# Long module: every topology family against hand-derived graphs, delays and weights

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

from relaympi.algorithms import lr_correction
from relaympi.commands.topology import describe, main
from relaympi.topology import (
    TOPOLOGY_NAMES,
    ExponentialSchedule,
    OnePeerSchedule,
    Topology,
    TopologyError,
    build,
    from_edge_list,
    from_graph,
    metropolis_hastings,
    min_eigenvalue,
    spanning_tree,
    spectral_gap,
)

REPO = Path(__file__).resolve().parents[1]
SIZES = range(2, 65)
POWERS_OF_TWO = [2, 4, 8, 16, 32, 64]


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


# Which world sizes each topology accepts (independent of the implementation under test).
ACCEPTS = {
    "ring": lambda n: n >= 3,
    "chain": lambda n: n >= 2,
    "star": lambda n: n >= 2,
    "binary-tree": lambda n: n >= 2,
    "double-binary-trees": lambda n: n >= 2,
    "fully-connected": lambda n: n >= 1,  # one worker: the centralized baseline
    "hypercube": lambda n: n >= 2 and _power_of_two(n),
    "social-network": lambda n: n == 32,
    "social-network-tree": lambda n: n == 32,
    "exponential": lambda n: n >= 2 and _power_of_two(n),
    "one-peer-exponential": lambda n: n >= 2 and _power_of_two(n),
    "alternating-ring": lambda n: n >= 2 and n % 2 == 0,
}
ALWAYS_TREES = {"chain", "star", "binary-tree", "double-binary-trees", "social-network-tree"}
ACCEPTED = [(name, n) for name in TOPOLOGY_NAMES for n in SIZES if ACCEPTS[name](n)]
REJECTED = [(name, n) for name in TOPOLOGY_NAMES for n in range(0, 65) if not ACCEPTS[name](n)]


def _closed_form_lr_correction(tree: nx.Graph) -> float:
    """1/(alpha n) for one tree from the invariant of the steady-state delayed average.

    In steady state Algorithm 1 computes x_i(t+1) = 1/n sum_j x_j(t + 1/2 - d_ij) with
    d_ii = 0 and d_ij = tau_ij - 1 otherwise (a neighbour's model arrives in the same step).
    I(t) = sum_i sum_{d>=0} |{j: d_ij >= d}| / n * x_i(t - d) is conserved; it is n right
    after a +1 update everywhere and L/n * sum_ij (d_ij + 1) in the limit L, so
    1/L = 1 + sum_{i != j} (tau_ij - 1) / n^2.
    """
    n = tree.number_of_nodes()
    tau = dict(nx.all_pairs_shortest_path_length(tree))
    excess = sum(tau[i][j] - 1 for i in tree for j in tree if i != j)
    return 1.0 + excess / n**2


# ---------------------------------------------------------------------------------------
# invariants of every topology at every accepted size


def test_accepted_table_covers_all_names():
    assert set(ACCEPTS) == set(TOPOLOGY_NAMES)
    assert len(TOPOLOGY_NAMES) == len(set(TOPOLOGY_NAMES))


@pytest.mark.parametrize(("name", "n"), ACCEPTED)
def test_invariants(name, n):
    topo = build(name, n)
    assert isinstance(topo, Topology)
    assert build(topo.name, n) == topo  # names build the same topology again
    assert topo.world_size == n
    assert topo.num_layers == (2 if name == "double-binary-trees" else 1)
    union = nx.Graph()
    for k, layer in enumerate(topo.layers):
        assert sorted(layer.nodes) == list(range(n))
        assert nx.is_connected(layer)
        assert nx.number_of_selfloops(layer) == 0
        edges = topo.edges(k)
        assert edges == sorted(edges)
        assert all(i < j for i, j in edges)
        assert edges == sorted(tuple(sorted(e)) for e in layer.edges())
        for rank in range(n):
            neighbors = topo.neighbors(rank, k)
            assert list(neighbors) == sorted(layer.neighbors(rank))
            assert topo.degree(rank, k) == len(neighbors)
        # delays: symmetric hop distances equal to networkx's shortest paths
        tau = topo.delays(k)
        assert tau.shape == (n, n) and tau.dtype.kind == "i"
        assert np.array_equal(tau, tau.T)
        assert np.all(np.diag(tau) == 0)
        for source, lengths in nx.all_pairs_shortest_path_length(layer):
            for target, hops in lengths.items():
                assert tau[source, target] == hops
        # Metropolis-Hastings: symmetric, doubly stochastic, nonnegative, supported on edges
        w = topo.mixing_matrix(k)
        assert np.allclose(w, w.T, atol=0)
        assert np.allclose(w.sum(axis=0), 1.0) and np.allclose(w.sum(axis=1), 1.0)
        assert np.all(w >= 0)
        support = nx.to_numpy_array(layer, nodelist=range(n)) + np.eye(n)
        assert np.all(w[support == 0] == 0)
        union.add_edges_from(layer.edges())
    assert topo.is_tree == all(nx.is_tree(layer) for layer in topo.layers)
    if name in ALWAYS_TREES:
        assert topo.is_tree
    elif n > 2:
        assert not topo.is_tree
    assert topo.diameter == max(nx.diameter(layer) for layer in topo.layers)
    assert topo.max_degree == max(d for _, d in union.degree())
    for rank in range(n):
        expected = sum(topo.degree(rank, k) for k in range(topo.num_layers)) / topo.num_layers
        assert topo.models_per_step(rank) == pytest.approx(expected)


@pytest.mark.parametrize(("name", "n"), REJECTED)
def test_rejected_sizes_say_what_is_allowed(name, n):
    with pytest.raises(TopologyError, match=r"world_size|power of two|32"):
        build(name, n)


@pytest.mark.parametrize("name", TOPOLOGY_NAMES)
def test_one_minimum_per_topology(name):
    """Every size below a topology's smallest one gets the same message (only the size differs)."""
    smallest = min(n for n in range(0, 65) if ACCEPTS[name](n))
    messages = set()
    for n in range(0, smallest):
        with pytest.raises(TopologyError) as info:
            build(name, n)
        messages.add(re.sub(rf"got (world_size=)?{n}\b", "got N", str(info.value)))
    assert len(messages) <= 1, messages


def test_ring_two_ranks_points_to_chain():
    with pytest.raises(TopologyError, match="chain"):
        build("ring", 2)


@pytest.mark.parametrize("n", range(3, 65))
def test_ring_metropolis_hastings_is_one_third(n):
    w = build("ring", n).mixing_matrix()
    for i in range(n):
        for j in (i, (i + 1) % n, (i - 1) % n):
            assert w[i, j] == pytest.approx(1 / 3)
    assert np.count_nonzero(w) == 3 * n


@pytest.mark.parametrize("n", [2, 3, 7, 16, 64])
def test_shapes_of_fixed_families(n):
    chain = build("chain", n)
    assert chain.edges() == [(i, i + 1) for i in range(n - 1)]
    assert chain.diameter == n - 1
    star = build("star", n)
    assert star.neighbors(0) == tuple(range(1, n))
    assert all(star.neighbors(r) == (0,) for r in range(1, n))
    assert star.diameter == min(2, n - 1)
    tree = build("binary-tree", n)
    assert tree.edges() == sorted(((r - 1) // 2, r) for r in range(1, n))
    full = build("fully-connected", n)
    assert len(full.edges()) == n * (n - 1) // 2 and full.diameter == 1


@pytest.mark.parametrize("n", POWERS_OF_TWO)
def test_hypercube(n):
    cube = build("hypercube", n)
    bits = n.bit_length() - 1
    assert all(bin(i ^ j).count("1") == 1 for i, j in cube.edges())
    assert all(cube.degree(r) == bits for r in range(n))
    assert cube.diameter == bits


# ---------------------------------------------------------------------------------------
# double binary trees


@pytest.mark.parametrize("n", SIZES)
def test_double_binary_trees_are_complementary(n):
    topo = build("double-binary-trees", n)
    tree_a, tree_b = topo.layers
    assert nx.is_tree(tree_a) and nx.is_tree(tree_b)
    assert topo.edges(0) == build("binary-tree", n).edges()
    mirrored = sorted(tuple(sorted((n - 1 - i, n - 1 - j))) for i, j in topo.edges(0))
    assert topo.edges(1) == mirrored
    internal_a = {r for r in range(n) if tree_a.degree(r) > 1}
    internal_b = {r for r in range(n) if tree_b.degree(r) > 1}
    assert not internal_a & internal_b
    assert all(tree_b.degree(r) == 1 for r in internal_a)
    assert all(tree_a.degree(r) == 1 for r in internal_b)
    assert max(topo.models_per_step(r) for r in range(n)) <= 2
    assert all(tree_a.degree(r) <= 3 and tree_b.degree(r) <= 3 for r in range(n))


def test_double_binary_trees_two_ranks_is_one_edge_twice():
    topo = build("double-binary-trees", 2)
    assert topo.edges(0) == topo.edges(1) == [(0, 1)]
    assert topo.models_per_step(0) == topo.models_per_step(1) == 1


# ---------------------------------------------------------------------------------------
# SGP exponential schedule


@pytest.mark.parametrize("n", POWERS_OF_TWO)
def test_exponential_schedule_peers_and_exact_average(n):
    schedule = ExponentialSchedule(n)
    assert schedule.world_size == n
    assert 2**schedule.period == n
    for k in range(3 * schedule.period):
        offset = schedule.offset(k)
        assert offset == 2 ** (k % schedule.period)
        sends = [schedule.send_peer(k, r) for r in range(n)]
        assert sorted(sends) == list(range(n))  # a permutation: everyone receives exactly once
        for rank in range(n):
            assert schedule.send_peer(k, rank) == (rank - offset) % n
            assert schedule.recv_peer(k, rank) == (rank + offset) % n
            assert schedule.recv_peer(k, schedule.send_peer(k, rank)) == rank
        w = schedule.mixing_matrix(k)
        assert np.allclose(w.sum(axis=0), 1) and np.allclose(w.sum(axis=1), 1)
        assert np.all(w >= 0)
        for rank in range(n):
            assert w[rank, rank] == 0.5 and w[rank, schedule.recv_peer(k, rank)] == 0.5
    for start in (0, 1, schedule.period + 1):
        product = np.eye(n)
        for k in range(start, start + schedule.period):
            product = schedule.mixing_matrix(k) @ product
        assert np.allclose(product, np.full((n, n), 1 / n), atol=1e-14)
    # rank i's new model is the mean of itself and its recv_peer: x_i <- (x_i + x_{i+o}) / 2
    x = np.arange(n, dtype=float)
    assert np.allclose(schedule.mixing_matrix(0) @ x, (x + np.roll(x, -1)) / 2)


@pytest.mark.parametrize("n", POWERS_OF_TWO)
def test_exponential_topology_is_union_of_schedule(n):
    schedule = ExponentialSchedule(n)
    topo = build("exponential", n)
    assert topo.name == "exponential"
    pairs = {
        tuple(sorted((r, schedule.recv_peer(k, r))))
        for k in range(schedule.period)
        for r in range(n)
    }
    assert set(topo.edges()) == pairs


@pytest.mark.parametrize("n", [0, 1, 3, 6, 12, 100, -4, 2.0, True, "8"])
def test_exponential_schedule_rejects_bad_world_size(n):
    with pytest.raises(TopologyError, match="power of two|integer"):
        ExponentialSchedule(n)


# ---------------------------------------------------------------------------------------
# one-peer time-varying topologies: every rank averages with one peer per step

# each round's pairs at n = 8, written out by hand
ONE_PEER_PAIRS_8 = {
    "one-peer-exponential": [  # i XOR 1, i XOR 2, i XOR 4
        [(0, 1), (2, 3), (4, 5), (6, 7)],
        [(0, 2), (1, 3), (4, 6), (5, 7)],
        [(0, 4), (1, 5), (2, 6), (3, 7)],
    ],
    "alternating-ring": [  # right neighbour of the even ranks, then of the odd ranks
        [(0, 1), (2, 3), (4, 5), (6, 7)],
        [(1, 2), (3, 4), (5, 6), (0, 7)],
    ],
}


@pytest.mark.parametrize("name", sorted(ONE_PEER_PAIRS_8))
def test_one_peer_schedules_pair_every_rank_as_written_out(name):
    schedule = OnePeerSchedule(name, 8)
    rounds = ONE_PEER_PAIRS_8[name]
    assert schedule.period == len(rounds)
    for k in range(3 * schedule.period):
        w = schedule.mixing_matrix(k)
        expected = np.eye(8) / 2
        for i, j in rounds[k % len(rounds)]:
            assert schedule.peer(k, i) == j and schedule.peer(k, j) == i
            expected[i, j] = expected[j, i] = 0.5
        np.testing.assert_array_equal(w, expected)  # symmetric and doubly stochastic
    union = sorted({pair for pairs in rounds for pair in pairs})
    assert build(name, 8).edges() == union


@pytest.mark.parametrize("n", POWERS_OF_TWO)
def test_one_peer_exponential_averages_exactly_in_log2_n_steps(n):
    schedule = OnePeerSchedule("one-peer-exponential", n)
    assert 2**schedule.period == n
    assert build("one-peer-exponential", n).edges() == build("hypercube", n).edges()
    for start in (0, 1, schedule.period + 1):
        product = np.eye(n)
        for k in range(start, start + schedule.period):
            product = schedule.mixing_matrix(k) @ product
        np.testing.assert_array_equal(product, np.full((n, n), 1 / n))


@pytest.mark.parametrize("n", [2, 4, 6, 10, 64])
def test_alternating_ring_takes_each_ring_neighbour_in_turn(n):
    schedule = OnePeerSchedule("alternating-ring", n)
    for rank in range(n):
        met = {schedule.peer(k, rank) for k in range(schedule.period)}
        assert met == {(rank - 1) % n, (rank + 1) % n}
        for k in range(4):
            assert schedule.peer(k, schedule.peer(k, rank)) == rank
    if n > 2:
        assert build("alternating-ring", n).edges() == build("ring", n).edges()


@pytest.mark.parametrize(
    "name, n, message",
    [
        ("one-peer-exponential", 6, "power of two"),
        ("one-peer-exponential", 1, "power of two"),
        ("alternating-ring", 5, "even world_size"),
        ("alternating-ring", 0, "even world_size"),
        ("alternating-ring", 4.0, "integer"),
        ("ring", 4, "no one-peer schedule called 'ring'"),
    ],
)
def test_one_peer_schedules_refuse_what_they_cannot_pair(name, n, message):
    with pytest.raises(TopologyError, match=message):
        OnePeerSchedule(name, n)


def test_exponential_schedule_rejects_bad_round_and_rank():
    schedule = ExponentialSchedule(8)
    with pytest.raises(TopologyError, match="round must be >= 0, got -1"):
        schedule.offset(-1)
    with pytest.raises(TopologyError, match=r"rank must be in \[0, 8\), got 8"):
        schedule.send_peer(0, 8)
    with pytest.raises(TopologyError, match="integer"):
        schedule.recv_peer(0.5, 1)  # type: ignore[arg-type]  # a wrong type on purpose


# ---------------------------------------------------------------------------------------
# social network and spanning trees


def test_social_network():
    topo = build("social-network", 32)
    davis = nx.davis_southern_women_graph()
    assert topo.world_size == 32 and len(topo.edges()) == davis.number_of_edges() == 89
    assert nx.is_bipartite(topo.layers[0])
    assert nx.is_isomorphic(topo.layers[0], davis)
    women = set(range(18))
    assert all((i in women) != (j in women) for i, j in topo.edges())
    with pytest.raises(TopologyError, match="exactly 32"):
        build("social-network", 16)


@pytest.mark.parametrize("root", [None, 0, 5, 31])
def test_spanning_tree_of_social_network(root):
    base = build("social-network", 32)
    tree = build("spanning-tree:social-network", 32, root=root)
    assert tree.name == "spanning-tree:social-network"
    assert tree.is_tree and tree.world_size == 32 and len(tree.edges()) == 31
    assert set(tree.edges()) <= set(base.edges())
    root = 0 if root is None else root
    # Spanning Tree Protocol: distances to the root are kept, parent = lowest closer neighbour
    assert np.array_equal(tree.delays()[root], base.delays()[root])
    depth = base.delays()[root]
    for rank in range(32):
        if rank != root:
            closer = [p for p in base.neighbors(rank) if depth[p] == depth[rank] - 1]
            assert min(closer) in tree.neighbors(rank)
    named = build("social-network-tree", 32, root=None if root == 0 else root)
    assert named.name == "social-network-tree" and named.edges() == tree.edges()


def test_spanning_tree_of_ring_breaks_ties_by_lowest_id():
    tree = build("spanning-tree:ring", 8)
    assert tree.edges() == [(0, 1), (0, 7), (1, 2), (2, 3), (3, 4), (5, 6), (6, 7)]
    assert tree.diameter == 7
    rooted = spanning_tree(build("ring", 8), root=3)
    assert rooted.edges() == [(0, 1), (0, 7), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]


def test_spanning_tree_accepts_graphs_and_is_deterministic():
    graph = nx.Graph(nx.petersen_graph().edges)  # no graph["name"]
    first, second = spanning_tree(graph), spanning_tree(graph.copy())
    assert first == second and first.is_tree and first.name == "spanning-tree:graph"
    assert set(first.edges()) <= {tuple(sorted(e)) for e in graph.edges()}
    assert spanning_tree(nx.petersen_graph()).name == "spanning-tree:Petersen Graph"


def test_spanning_tree_errors():
    with pytest.raises(TopologyError, match="single-layer"):
        spanning_tree(build("double-binary-trees", 8))
    with pytest.raises(TopologyError, match=r"root must be a rank in \[0, 8\), got 8"):
        spanning_tree(build("ring", 8), root=8)
    with pytest.raises(TopologyError, match="root must be an integer"):
        spanning_tree(build("ring", 8), root="0")  # type: ignore[arg-type]  # on purpose
    with pytest.raises(TopologyError, match="single-layer"):
        build("spanning-tree:double-binary-trees", 8)
    with pytest.raises(TopologyError, match="names no base"):
        build("spanning-tree:", 8)


# ---------------------------------------------------------------------------------------
# arbitrary graphs and edge lists


def test_from_graph_relabels_in_sorted_order():
    graph = nx.Graph([("b", "c"), ("a", "b")])
    topo = from_graph(graph, "letters")
    assert topo.name == "letters" and topo.edges() == [(0, 1), (1, 2)]
    shifted = from_graph(nx.path_graph([10, 30, 20]))  # 10-30-20 -> 0-2-1
    assert shifted.edges() == [(0, 2), (1, 2)] and shifted.name == "graph"
    same = from_graph(nx.cycle_graph(5), "c5")
    assert same.edges() == build("ring", 5).edges()


@pytest.mark.parametrize(
    ("graph", "message"),
    [
        (nx.DiGraph([(0, 1)]), "undirected"),
        (nx.MultiGraph([(0, 1), (0, 1)]), "multigraph"),
        (nx.Graph([(0, 1), (2, 3)]), "disconnected"),
        (nx.Graph([(0, 1), (1, 1)]), "self-loop"),
        (nx.Graph(), "at least one node"),
        ("0 1", "networkx.Graph"),
    ],
)
def test_from_graph_errors(graph, message):
    with pytest.raises(TopologyError, match=message):
        from_graph(graph, "bad")


def test_topology_validates_and_freezes():
    with pytest.raises(TopologyError, match="nodes exactly 0..2"):
        Topology("x", 3, (nx.path_graph([1, 2, 3]),))
    with pytest.raises(TopologyError, match="at least one layer"):
        Topology("x", 3, ())
    with pytest.raises(TopologyError, match="non-empty string"):
        Topology("", 3, (nx.path_graph(3),))
    with pytest.raises(TopologyError, match="world_size must be >= 1"):
        Topology("x", 0, (nx.Graph(),))
    topo = build("ring", 5)
    with pytest.raises(nx.NetworkXError):
        topo.layers[0].add_edge(0, 2)
    with pytest.raises(AttributeError):
        topo.name = "other"
    assert topo == build("ring", 5) and hash(topo) == hash(build("ring", 5))
    assert topo != build("chain", 5)
    tau = topo.delays()
    tau[0, 1] = 99
    assert topo.delays()[0, 1] == 1
    assert "ring" in repr(topo)


def test_topology_rank_and_layer_errors():
    topo = build("double-binary-trees", 8)
    with pytest.raises(TopologyError, match=r"rank must be in \[0, 8\), got 8"):
        topo.neighbors(8)
    with pytest.raises(TopologyError, match=r"rank must be in \[0, 8\), got -1"):
        topo.degree(-1)
    with pytest.raises(TopologyError, match=r"layer must be in \[0, 2\).*got 2"):
        topo.edges(2)
    with pytest.raises(TopologyError, match="layer must be an integer"):
        topo.delays("0")  # type: ignore[arg-type]  # a wrong type on purpose


def test_edge_list_good_file(tmp_path):
    path = tmp_path / "graph.txt"
    path.write_text(
        "# a square with a diagonal\n0 1\n1 2  # trailing comment\n\n2 3\n3 0\n0 2\n2 0\n"
    )
    topo = from_edge_list(path, 4)
    assert topo.edges() == [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)]
    assert topo.name == f"edge-list:{path}"
    assert build("edge-list", 4, edge_list=str(path)) == topo
    assert build(topo.name, 4) == topo  # the name builds the same topology again
    assert build(f"spanning-tree:edge-list:{path}", 4).is_tree
    with pytest.raises(TopologyError, match="already names its file"):
        build(f"edge-list:{path}", 4, edge_list=path)
    tree = build("spanning-tree:edge-list", 4, edge_list=path, root=1)
    assert tree.is_tree and set(tree.edges()) <= set(topo.edges())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0 1\n1 2 3\n", r"graph.txt:2: expecting two ranks 'i j', got '1 2 3'"),
        ("0 1\n\n1 x\n", r"graph.txt:3: ranks must be integers"),
        ("0 1\n1 4\n", r"graph.txt:2: rank 4 is outside \[0, 4\)"),
        ("0 -1\n", r"graph.txt:1: rank -1 is outside"),
        ("0 1\n2 2\n", r"graph.txt:2: self-loop 2 2"),
        ("0 1\n1 2\n", r"leaves ranks 3 without any edge"),
        ("0 1\n2 3\n", r"disconnected"),
        ("# nothing\n", r"leaves ranks 0, 1, 2, 3 without any edge"),
    ],
)
def test_edge_list_bad_files(tmp_path, text, message):
    path = tmp_path / "graph.txt"
    path.write_text(text)
    with pytest.raises(TopologyError, match=message):
        from_edge_list(path, 4)


def test_edge_list_missing_file(tmp_path):
    with pytest.raises(TopologyError, match="cannot read edge list"):
        from_edge_list(tmp_path / "absent.txt", 4)


# ---------------------------------------------------------------------------------------
# build: names and argument errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(name="torus", world_size=8), "unknown topology 'torus'; allowed: ring, chain"),
        (dict(name="ring", world_size=8, root=0), "root=0 only applies to spanning trees"),
        (
            dict(name="ring", world_size=8, edge_list="g.txt"),
            "only applies to topology 'edge-list'",
        ),
        (dict(name="edge-list", world_size=8), "needs an edge list file"),
        (dict(name="chain", world_size=1), "world_size must be >= 2, got 1"),
        (dict(name="chain", world_size=2.5), "must be an integer, got 2.5"),
        (dict(name="chain", world_size=True), "must be an integer, got True"),
        (dict(name="hypercube", world_size=12), "power of two"),
        (dict(name=None, world_size=8), "must be a string"),
        (dict(name="social-network-tree", world_size=31), "exactly 32"),
    ],
)
def test_build_errors(kwargs, message):
    with pytest.raises(TopologyError, match=message):
        build(**kwargs)


def test_build_accepts_numpy_integers():
    assert build("chain", np.int64(4)).world_size == 4


def test_topology_error_is_value_error():
    assert issubclass(TopologyError, ValueError)


# ---------------------------------------------------------------------------------------
# gossip weights


def test_metropolis_hastings_values_and_errors():
    w = metropolis_hastings(nx.star_graph(3))  # hub 0 with degree 3, leaves degree 1
    assert np.allclose(w[0], [1 / 4, 1 / 4, 1 / 4, 1 / 4])
    assert np.allclose(w[1], [1 / 4, 3 / 4, 0, 0])
    assert spectral_gap(build("fully-connected", 8).mixing_matrix()) == pytest.approx(1.0)
    assert min_eigenvalue(build("ring", 8).mixing_matrix()) == pytest.approx(-1 / 3)
    assert min_eigenvalue(build("ring", 7).mixing_matrix()) > -1 / 3
    with pytest.raises(TopologyError, match="nodes exactly"):
        metropolis_hastings(nx.path_graph([1, 2]))
    with pytest.raises(TopologyError, match="undirected"):
        metropolis_hastings(nx.DiGraph([(0, 1)]))
    with pytest.raises(TopologyError, match="symmetric"):
        spectral_gap(np.array([[0.5, 0.5], [0.0, 1.0]]))


# ---------------------------------------------------------------------------------------
# RelaySGD learning-rate correction


def test_lr_correction_two_worker_chain_by_hand():
    # Steady state (counters have converged: c_{0->1} = c_{1->0} = 1, n_bar = 2), all
    # models and messages 0. Update step: x_0^(t+1/2) = x_1^(t+1/2) = 1.
    #   m_{0->1} = x_0^(t+1/2) + (no other neighbours) = 1, likewise m_{1->0} = 1,
    #   x_i^(t+1) = (x_i^(t+1/2) + m_{j->i}) / n_bar = (1 + 1) / 2 = 1.
    # Afterwards x^(t+1/2) = x^(t) = 1, every message is 1 and x stays 1: two workers
    # relaying are exactly all-reduce, alpha n = 1, the correction is 1.
    assert lr_correction(build("chain", 2)) == pytest.approx(1.0, abs=1e-12)
    assert lr_correction(build("double-binary-trees", 2)) == pytest.approx(1.0, abs=1e-12)


def test_lr_correction_three_worker_chain_by_hand():
    # Chain 0-1-2 in steady state (n_bar = 3). With a_t = x_0 = x_2 (by symmetry) and
    # b_t = x_1 after the half step, Algorithm 1 gives
    #   x_0(t+1) = (x_0(t+1/2) + m_{1->0}) / 3 with m_{1->0}(t) = x_1(t+1/2) + m_{2->1}(t-1)
    #            = x_1(t+1/2) + x_2(t-1/2), so a_{t+1} = (a_t + b_t + a_{t-1}) / 3,
    #   b_{t+1} = (2 a_t + b_t) / 3.
    # Steps after the update (a_{-1} = 0, a_0 = b_0 = 1): a = 2/3, 8/9, 7/9, ...;
    # b = 1, 7/9, 23/27, ...  I_t = 6 a_t + 3 b_t + 2 a_{t-1} is conserved
    # (6 (a+b+a_)/3 + 3 (2a+b)/3 + 2a = 6a + 3b + 2a_), I_0 = 9, so the limit L solves
    # 11 L = 9: alpha n = 9/11 and the correction is 11/9.
    a_prev, a, b = Fraction(0), Fraction(1), Fraction(1)
    for _ in range(3):
        assert 6 * a + 3 * b + 2 * a_prev == 9
        a_prev, a, b = a, (a + b + a_prev) / 3, (2 * a + b) / 3
    assert lr_correction(build("chain", 3)) == pytest.approx(11 / 9, rel=1e-12)


def test_lr_correction_grows_with_chain_length():
    factors = [lr_correction(build("chain", n)) for n in SIZES]
    assert factors[0] == pytest.approx(1.0)
    assert all(later > earlier for earlier, later in itertools.pairwise(factors))
    for n, factor in zip(SIZES, factors, strict=True):
        # closed form for chains: 1 + (n-1)(n-2) / (3n)
        assert factor == pytest.approx(1 + (n - 1) * (n - 2) / (3 * n), rel=1e-9)


@pytest.mark.parametrize(
    "topo",
    [
        build("star", 9),
        build("binary-tree", 15),
        build("binary-tree", 64),
        build("spanning-tree:social-network", 32),
        build("spanning-tree:hypercube", 16),
        from_graph(nx.random_labeled_tree(20, seed=3), "random-tree"),
    ],
    ids=lambda t: f"{t.name}-{t.world_size}",
)
def test_lr_correction_matches_closed_form(topo):
    assert lr_correction(topo) == pytest.approx(
        _closed_form_lr_correction(topo.layers[0]), rel=1e-9
    )
    assert lr_correction(topo.layers[0]) == lr_correction(topo)  # a plain graph works too


@pytest.mark.parametrize("n", [3, 4, 8, 16, 32, 64])
def test_lr_correction_double_binary_trees(n):
    # The mirrored tree is isomorphic to the first, so both layers need the same correction.
    assert lr_correction(build("double-binary-trees", n)) == pytest.approx(
        lr_correction(build("binary-tree", n)), rel=1e-9
    )
    assert lr_correction(build("binary-tree", n)) >= 1


def test_lr_correction_single_worker_and_non_trees():
    assert lr_correction(Topology("single", 1, (nx.path_graph(1),))) == 1.0
    for name, n in [("ring", 8), ("fully-connected", 4), ("social-network", 32)]:
        with pytest.raises(TopologyError, match="needs a tree.*spanning-tree:"):
            lr_correction(build(name, n))


def test_to_dict_is_json():
    tree = build("binary-tree", 8)
    summary = json.loads(json.dumps(describe(tree)))
    assert summary["edges"] == [list(e) for e in tree.edges()]
    assert summary["lr_correction"] == pytest.approx(lr_correction(tree))
    assert summary["is_tree"] and summary["diameter"] == 5 and summary["max_degree"] == 3
    ring = describe(build("ring", 8))
    assert ring["lr_correction"] is None and ring["d2_allowed"] is True
    assert ring["spectral_gap"] == pytest.approx(1 - (1 + 2 * np.cos(2 * np.pi / 8)) / 3)
    assert ring["min_eigenvalue"] == pytest.approx(-1 / 3)
    double = describe(build("double-binary-trees", 8))
    assert len(double["edges"]) == 2 and double["models_per_step"] == 2
    assert len(double["spectral_gap"]) == 2


# ---------------------------------------------------------------------------------------
# command line


def test_cli_text(capsys):
    assert main(["double-binary-trees", "-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "double-binary-trees" in out and "edges (layer 1): 7" in out
    assert "RelaySGD lr correction" in out and "models per step   2" in out
    assert main(["ring", "-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "spectral gap" in out and "D2 allowed" in out and "tree              no" in out
    assert main(["exponential", "-n", "8"]) == 0
    out = capsys.readouterr().out
    assert "period 3 rounds" in out and "round 2 (offset 4)" in out and "0->4" in out


def test_cli_says_which_coordinates_each_tree_carries(capsys):
    assert main(["double-binary-trees", "-n", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["coordinates"] == "blocks"
    assert main(["chain", "-n", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["coordinates"] == "all"
    assert main(["double-binary-trees", "-n", "8"]) == 0
    assert "contiguous block k" in capsys.readouterr().out


def test_coordinate_blocks_are_numpy_array_split():
    from relaympi.topology import coordinate_blocks

    for d in (0, 1, 2, 7, 10, 9_225_610):
        for layers in (1, 2, 3):
            expected = np.array_split(np.arange(d), layers)
            got = coordinate_blocks(d, layers)
            assert [(b.start, b.stop) for b in got] == [
                (int(e[0]), int(e[-1]) + 1) if len(e) else (b.start, b.start)
                for e, b in zip(expected, got, strict=True)
            ]
            assert sum(b.stop - b.start for b in got) == d


def test_cli_json_in_process(capsys, tmp_path):
    assert main(["exponential", "-n", "4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["schedule"]["period"] == 2
    assert summary["schedule"]["send_peers"] == [[3, 0, 1, 2], [2, 3, 0, 1]]
    path = tmp_path / "g.txt"
    path.write_text("0 1\n1 2\n2 0\n")
    argv = ["spanning-tree:edge-list", "-n", "3", "--edge-list", str(path), "--root", "2"]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["is_tree"] and summary["edges"] == [[0, 2], [1, 2]]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ring", "-n", "2"], "error: ring world_size must be >= 3, got 2"),
        (["ring", "-n", "1"], "error: ring world_size must be >= 3, got 1"),
        (["ring", "-n", "0"], "error: ring world_size must be >= 3, got 0"),
        (["torus", "-n", "8"], "error: unknown topology 'torus'"),
        (["rnig", "-n", "8"], "error: unknown topology 'rnig' (did you mean 'ring'?)"),
        (["social-network", "-n", "16"], "error: social-network has exactly 32"),
        (["edge-list", "-n", "4", "--edge-list", "/nonexistent/graph.txt"], "error: cannot read"),
    ],
)
def test_cli_bad_input_in_process(capsys, argv, message):
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(message)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "relaympi.topology", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )


def test_cli_subprocess_json():
    result = _run_cli("double-binary-trees", "-n", "16", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    required = {"name", "world_size", "edges", "diameter", "max_degree", "is_tree", "lr_correction"}
    assert required <= set(summary)
    assert summary["world_size"] == 16 and summary["is_tree"]
    assert len(summary["edges"]) == 2 and all(len(tree) == 15 for tree in summary["edges"])
    assert summary["lr_correction"] == pytest.approx(lr_correction(build("binary-tree", 16)))


@pytest.mark.slow
def test_cli_subprocess_bad_input_exits_2():
    result = _run_cli("hypercube", "-n", "12")
    assert result.returncode == 2
    assert result.stderr.startswith("error: hypercube needs a power of two")
    assert result.stdout == ""
    result = _run_cli("ring")  # argparse: -n missing
    assert result.returncode == 2 and "-n" in result.stderr


def test_describe_gives_the_one_peer_pairings_and_one_model_per_step():
    summary = describe(build("alternating-ring", 8), ranks_per_node=2, model_size=10)
    assert summary["models_per_step"] == 1.0 and summary["d2_allowed"] is False
    assert summary["one_peer_schedule"] == {
        "period": 2,
        "peers": [[1, 0, 3, 2, 5, 4, 7, 6], [7, 2, 1, 4, 3, 6, 5, 0]],
    }
    # nodes {0,1} {2,3} ...: step 0 stays inside nodes; step 1 each node sends 2 models out
    assert summary["inter_node_bytes_per_node_per_step"] == 2 * 10 * 4
    cube = describe(build("one-peer-exponential", 8), ranks_per_node=4, model_size=10)
    assert cube["inter_node_bytes_per_node_per_step"] == 4 * 10 * 4  # step 2: i XOR 4 crosses
