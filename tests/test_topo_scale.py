"""Topologies at cluster scale: every fast formula (closed-form spectra, diameters, RelaySGD's lr
correction, spanning trees, the CLI's line wrapping and edge counts) held to the dense or slow
computation at small n, and the command line at 100,000 ranks."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import textwrap

import networkx as nx
import numpy as np
import pytest

from relaympi.algorithms.relay_lr import lr_correction, simulated_lr_correction
from relaympi.commands.topology import (
    MAX_DESCRIBED_EDGES,
    _edges_to_build,
    _json_chunks,
    _wrap,
    describe,
    main,
)
from relaympi.topology import (
    Topology,
    TopologyError,
    build,
    from_graph,
    min_eigenvalue,
    spanning_tree,
    spectral_gap,
)
from relaympi.topology.core import GENERAL_DIAMETER_MAX_WORK
from relaympi.topology.spectra import (
    DENSE_SPECTRUM_MAX_RANKS,
    SPARSE_SPECTRUM_MAX_RANKS,
    TREE_INERTIA_MAX_HEIGHT,
    chain_spectrum,
    circulant_spectrum,
    fully_connected_spectrum,
    hypercube_spectrum,
    sparse_extremes,
    star_spectrum,
    tree_extremes,
)

ODD_AND_EVEN = [2, 3, 4, 5, 6, 7, 9, 10, 12, 15, 17, 31, 33, 50, 97, 100, 128]
POWERS = [2, 4, 8, 16, 32, 64, 128, 256]
CLOSED_FORMS = {
    "ring": (lambda n: circulant_spectrum(n, (1,)), [n for n in ODD_AND_EVEN if n >= 3]),
    "chain": (chain_spectrum, ODD_AND_EVEN),
    "star": (star_spectrum, ODD_AND_EVEN),
    "fully-connected": (fully_connected_spectrum, [1, *ODD_AND_EVEN]),
    "hypercube": (hypercube_spectrum, POWERS),
    "exponential": (
        lambda n: circulant_spectrum(n, tuple(2**k for k in range(n.bit_length() - 1))),
        POWERS,
    ),
    # the union graphs of the one-peer topologies: the hypercube, the ring (one edge at n = 2)
    "one-peer-exponential": (hypercube_spectrum, POWERS),
    "alternating-ring": (
        lambda n: circulant_spectrum(n, (1,)),
        [n for n in ODD_AND_EVEN if n % 2 == 0],
    ),
}
FAMILY_SIZES = [
    (name, n)
    for name in (
        "ring",
        "chain",
        "star",
        "binary-tree",
        "double-binary-trees",
        "fully-connected",
        "hypercube",
        "exponential",
    )
    for n in (POWERS[:6] if name in ("hypercube", "exponential") else [2, 3, 5, 8, 12, 33, 64])
    if not (name == "ring" and n < 3)
] + [("social-network", 32), ("social-network-tree", 32)]


def _dense_spectrum(topology: Topology, layer: int = 0) -> np.ndarray:
    return np.linalg.eigvalsh(topology.mixing_matrix(layer))


# -- spectra ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "n"), [(family, n) for family, (_, sizes) in CLOSED_FORMS.items() for n in sizes]
)
def test_closed_form_spectrum_is_numpy_eigvalsh(family, n):
    closed_form, _ = CLOSED_FORMS[family]
    expected = _dense_spectrum(build(family, n))
    assert np.allclose(closed_form(n), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("name", "n"), FAMILY_SIZES)
def test_gossip_extremes_match_dense_eigenvalues(name, n):
    topology = build(name, n)
    for k in range(topology.num_layers):
        extremes = topology.gossip_extremes(k)
        w = topology.mixing_matrix(k)
        assert extremes.spectral_gap == pytest.approx(spectral_gap(w), abs=1e-12)
        assert extremes.min_eigenvalue == pytest.approx(min_eigenvalue(w), abs=1e-12)
        assert extremes.reason is None


@pytest.mark.parametrize(
    "topology",
    [
        build("binary-tree", 300),
        build("double-binary-trees", 257),
        build("spanning-tree:ring", 301),
        build("spanning-tree:exponential", 256),
        build("social-network", 32),
        from_graph(nx.random_regular_graph(3, 200, seed=1), "cubic"),
        from_graph(nx.random_labeled_tree(150, seed=2), "random-tree"),
    ],
    ids=lambda t: f"{t.name}-{t.world_size}",
)
def test_sparse_lanczos_matches_dense(topology):
    for k in range(topology.num_layers):
        lanczos = sparse_extremes(topology.world_size, topology.edge_array(k))
        w = topology.mixing_matrix(k)
        assert lanczos.spectral_gap == pytest.approx(spectral_gap(w), abs=1e-10)
        assert lanczos.min_eigenvalue == pytest.approx(min_eigenvalue(w), abs=1e-10)


@pytest.mark.parametrize(
    "topology",
    [
        build("binary-tree", 300),
        build("double-binary-trees", 257),
        build("double-binary-trees", 100),
        build("spanning-tree:hypercube", 256),
        build("spanning-tree:exponential", 128),
        build("social-network-tree", 32),
        build("star", 40),
        build("chain", 2),
        build("chain", 45),
        from_graph(nx.random_labeled_tree(150, seed=2), "random-tree"),
        from_graph(nx.balanced_tree(3, 4), "ternary"),
    ],
    ids=lambda t: f"{t.name}-{t.world_size}",
)
def test_tree_inertia_counts_match_dense(topology):
    for k in range(topology.num_layers):
        parent = np.full(topology.world_size, -1)
        for child, above in nx.bfs_predecessors(topology.layers[k], 0):
            parent[child] = above
        depth = np.array(
            [nx.shortest_path_length(topology.layers[k], 0, r) for r in range(topology.world_size)]
        )
        counted = tree_extremes(topology.world_size, topology.edge_array(k), parent, depth)
        w = topology.mixing_matrix(k)
        assert counted.spectral_gap == pytest.approx(spectral_gap(w), abs=1e-12)
        assert counted.min_eigenvalue == pytest.approx(min_eigenvalue(w), abs=1e-12)


@pytest.mark.slow
def test_spectrum_rule_at_each_size():
    # dense up to DENSE_SPECTRUM_MAX_RANKS; above, shallow trees by inertia counts (same numbers)
    n = DENSE_SPECTRUM_MAX_RANKS + 1
    tree = build("binary-tree", n)
    w = tree.mixing_matrix()
    assert tree.gossip_extremes().spectral_gap == pytest.approx(spectral_gap(w), abs=1e-12)
    assert tree.gossip_extremes().min_eigenvalue == pytest.approx(min_eigenvalue(w), abs=1e-12)
    # ... other graphs by Lanczos (same numbers) up to SPARSE_SPECTRUM_MAX_RANKS
    cubic = from_graph(nx.random_regular_graph(3, n + 1, seed=5), "cubic")  # 3 n must be even
    w = cubic.mixing_matrix()
    assert cubic.gossip_extremes().spectral_gap == pytest.approx(spectral_gap(w), abs=1e-10)
    assert cubic.gossip_extremes().min_eigenvalue == pytest.approx(min_eigenvalue(w), abs=1e-10)
    # ... and nothing above it (a ring's spanning tree is a path: too deep for inertia counts)
    deep = build("spanning-tree:ring", SPARSE_SPECTRUM_MAX_RANKS + 1)
    assert deep.hops_from(0).max() > TREE_INERTIA_MAX_HEIGHT
    summary = json.loads(json.dumps(describe(deep)))
    assert summary["spectral_gap"] is None and summary["min_eigenvalue"] is None
    assert summary["d2_allowed"] is None
    assert (
        f"not computed for n > {SPARSE_SPECTRUM_MAX_RANKS}"
        in summary["not_computed"]["spectral_gap"]
    )
    # closed forms have no limit
    ring = describe(build("ring", SPARSE_SPECTRUM_MAX_RANKS + 2))
    assert ring["min_eigenvalue"] == pytest.approx(-1 / 3) and "not_computed" not in ring


def test_small_summaries_have_no_not_computed_key():
    for name, n in FAMILY_SIZES:
        assert "not_computed" not in describe(build(name, n))


# -- diameter ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "n"), FAMILY_SIZES)
def test_diameter_matches_all_pairs_bfs(name, n):
    topology = build(name, n)
    for k in range(topology.num_layers):
        assert (
            topology.layer_diameter(k)
            == int(topology.delays(k).max())
            == nx.diameter(topology.layers[k])
        )


def test_diameter_of_general_graphs_and_the_work_limit():
    cubic = from_graph(nx.random_regular_graph(3, 300, seed=4), "cubic")
    assert cubic.diameter == nx.diameter(cubic.layers[0])
    assert describe(cubic)["diameter"] == cubic.diameter
    # a general graph whose BFS from every rank exceeds the limit: reported, not computed
    n = SPARSE_SPECTRUM_MAX_RANKS + 1  # spectra not computed either: the summary is quick
    assert n * (n + n + 1) > GENERAL_DIAMETER_MAX_WORK
    ranks = np.arange(n)
    edges = np.concatenate([np.stack([ranks, (ranks + 1) % n], 1), [[0, n // 2]]])
    big = Topology("ring-with-chord", n, (edges,))
    summary = big.to_dict()
    assert (
        summary["diameter"] is None and "BFS from every rank" in summary["not_computed"]["diameter"]
    )


# -- RelaySGD's learning-rate correction ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "n"),
    [
        (name, n)
        for name in ("chain", "star", "binary-tree", "double-binary-trees")
        for n in (2, 3, 7, 12, 33, 100, 200)
    ]
    + [("social-network-tree", 32)]
    + [
        (f"spanning-tree:{base}", n)
        for base, n in [
            ("ring", 9),
            ("ring", 101),
            ("hypercube", 128),
            ("exponential", 64),
            ("fully-connected", 150),
        ]
    ],
)
def test_lr_correction_closed_form_is_the_simulation(name, n):
    topology = build(name, n)
    assert lr_correction(topology) == pytest.approx(simulated_lr_correction(topology), rel=1e-9)


def test_lr_correction_of_a_random_tree_and_of_a_graph():
    tree = nx.random_labeled_tree(60, seed=7)
    assert lr_correction(tree) == pytest.approx(simulated_lr_correction(tree), rel=1e-9)
    with pytest.raises(TopologyError, match="needs a tree"):
        lr_correction(build("ring", 5))


# -- building ---------------------------------------------------------------------------


def _old_spanning_tree_edges(graph: nx.Graph, root: int) -> list[tuple[int, int]]:
    """The Spanning Tree Protocol rule, written out: each rank's parent is its lowest neighbour one
    hop closer."""
    distance = nx.single_source_shortest_path_length(graph, root)
    edges = []
    for rank in graph:
        if rank != root:
            parent = min(p for p in graph.neighbors(rank) if distance[p] == distance[rank] - 1)
            edges.append((min(parent, rank), max(parent, rank)))
    return sorted(edges)


@pytest.mark.parametrize("seed", range(4))
def test_spanning_tree_follows_the_protocol(seed):
    graph = nx.connected_watts_strogatz_graph(40, 4, 0.3, seed=seed)
    for root in (0, 17, 39):
        tree = spanning_tree(from_graph(graph, "ws"), root=root)
        assert tree.edges() == _old_spanning_tree_edges(graph, root)


def test_edge_arrays_and_graphs_build_equal_topologies():
    graph = nx.cycle_graph(7)
    # unsorted, repeated
    edges = np.array([[1, 0], [1, 2], [3, 2], [3, 4], [5, 4], [5, 6], [0, 6], [0, 1]])
    from_array = Topology("ring", 7, (edges,))
    assert from_array == Topology("ring", 7, (graph,)) == build("ring", 7)
    assert from_array.edges() == sorted(tuple(sorted(e)) for e in graph.edges())
    with pytest.raises(TopologyError, match=r"edge \(0, 7\) outside ranks 0..6"):
        Topology("x", 7, (np.array([[0, 7]]),))
    with pytest.raises(TopologyError, match=r"self-loops at ranks \[3\]"):
        Topology("x", 4, (np.array([[0, 1], [1, 2], [2, 3], [3, 3]]),))
    with pytest.raises(
        TopologyError, match=r"disconnected \(2 components\); e.g. rank 2 cannot reach rank 0"
    ):
        Topology("x", 4, (np.array([[0, 1], [2, 3]]),))
    with pytest.raises(TopologyError, match="integer array"):
        Topology("x", 4, (np.array([[0.0, 1.0]]),))


@pytest.mark.parametrize("name", ["ring", "double-binary-trees", "exponential", "social-network"])
def test_topologies_pickle(name):
    topology = build(name, 32)
    copy = pickle.loads(pickle.dumps(topology))
    assert copy == topology and copy.to_dict() == topology.to_dict()


# -- command line -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_wrap_is_textwrap(seed):
    rng = np.random.default_rng(seed)
    words = [
        f"{i}-{j}" if seed < 2 else f"{i}->{j}"
        for i, j in rng.integers(0, 10 ** rng.integers(1, 7), (500, 2))
    ]
    text = " ".join(words)
    for indent in ("  ", "    "):
        assert _wrap(text, indent) == textwrap.wrap(
            text, width=78, initial_indent=indent, subsequent_indent=indent
        )
    assert _wrap("", "  ") == textwrap.wrap("", width=78) == []


@pytest.mark.parametrize(("name", "n"), FAMILY_SIZES)
def test_streamed_json_is_json_dumps(name, n):
    topology = build(name, n)
    expected = json.dumps(describe(topology))
    assert "".join(_json_chunks(describe(topology, edge_arrays=True))) == expected


@pytest.mark.parametrize(
    ("name", "n"), FAMILY_SIZES + [("spanning-tree:ring", 9), ("spanning-tree:hypercube", 16)]
)
def test_edges_to_build_counts_without_building(name, n):
    topology = build(name, n)
    built = sum(len(topology.edges(k)) for k in range(topology.num_layers))
    if name.startswith("spanning-tree:"):
        base = build(name.split(":", 1)[1], n)
        built += len(base.edges())
    if name.startswith("social-network"):
        assert _edges_to_build(name, n) is None  # fixed at 32 ranks: nothing to refuse
    else:
        assert _edges_to_build(name, n) == built


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_cli_describes_100000_ranks():
    n = 100_000
    status, out, err = _run(["double-binary-trees", "-n", str(n), "--json"])
    assert status == 0, err
    summary = json.loads(out)
    # heap layout, computed here without relaympi: the parent of r is (r - 1) // 2
    assert summary["edges"][0] == [[(r - 1) // 2, r] for r in range(1, n)]
    assert summary["edges"][1] == sorted([n - 1 - r, n - 1 - (r - 1) // 2] for r in range(1, n))
    # depth 16 holds ranks 65535..99999, in both subtrees of the root (the right one starts
    # at 98303)
    assert summary["diameter"] == 2 * 16
    assert summary["models_per_step"] == 2 and summary["is_tree"]
    # 1 + (2 W - n (n - 1)) / n^2 with the Wiener index W = sum over edges of s (n - s)
    size = [1] * n
    for rank in range(n - 1, 0, -1):  # heap layout: children come after their parent
        size[(rank - 1) // 2] += size[rank]
    wiener = sum(s * (n - s) for s in size[1:])
    assert summary["lr_correction"] == pytest.approx(
        1 + (2 * wiener - n * (n - 1)) / n**2, rel=1e-12
    )
    # inertia counts (held to eigvalsh at small n above); the mirrored tree has the same spectrum
    assert summary["spectral_gap"][0] == pytest.approx(summary["spectral_gap"][1], abs=1e-15)
    assert 0 < summary["spectral_gap"][0] < 1e-5 and -0.5 < summary["min_eigenvalue"][0] < -0.4
    assert "not_computed" not in summary
    status, out, err = _run(["ring", "-n", str(n)])
    assert status == 0 and f"diameter          {n // 2}" in out
    assert "smallest eigenvalue -0.333333" in out


def test_cli_refuses_more_edges_than_it_lists():
    status, out, err = _run(["fully-connected", "-n", "100000"])
    assert status == 2 and out == ""
    assert err == (
        "error: -n 100000 is too large to describe fully-connected: it takes 4999950000 "
        "edges to build; "
        f"the summary lists at most {MAX_DESCRIBED_EDGES} (fully-connected: at most -n 2896)\n"
    )
    assert 2896 * 2895 // 2 <= MAX_DESCRIBED_EDGES < 2897 * 2896 // 2
    status, _, err = _run(["spanning-tree:fully-connected", "-n", "100000"])
    assert status == 2 and "too large" in err
    status, _, err = _run(["exponential", "-n", str(2**20)])
    assert status == 2 and "(exponential: at most -n 131072)" in err


def test_lanczos_that_does_not_converge_reports_why():
    n = DENSE_SPECTRUM_MAX_RANKS + 76  # a ring's spanning tree is a path: eigenvalues ~1/n^2 apart
    summary = describe(build("spanning-tree:ring", n))
    assert summary["spectral_gap"] is None and summary["min_eigenvalue"] is None
    assert "sparse Lanczos did not converge" in summary["not_computed"]["min_eigenvalue"]
    status, out, _ = _run(["spanning-tree:ring", "-n", str(n)])
    assert status == 0
    assert (
        "Metropolis-Hastings: spectral gap and smallest eigenvalue not computed: "
        "sparse Lanczos did not converge"
    ) in out
    assert f"diameter          {n - 1}" in out  # the two arms from rank 0 form a path of n ranks
