"""Topology generators: fixed families, the social network, any networkx graph or edge-list file."""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable
from functools import partial
from pathlib import Path

import networkx as nx
import numpy as np

from .core import LayerFacts, Topology, as_world_size
from .errors import TopologyError
from .schedule import (
    ALTERNATING_RING,
    ONE_PEER_EXPONENTIAL,
    ExponentialSchedule,
    OnePeerSchedule,
    is_power_of_two,
)
from .spectra import (
    chain_spectrum,
    circulant_spectrum,
    fully_connected_spectrum,
    hypercube_spectrum,
    star_spectrum,
)

__all__ = [
    "ring",
    "chain",
    "star",
    "binary_tree",
    "double_binary_trees",
    "fully_connected",
    "hypercube",
    "exponential",
    "one_peer_exponential",
    "alternating_ring",
    "social_network",
    "from_graph",
    "from_edge_list",
    "SOCIAL_NETWORK_SIZE",
]

SOCIAL_NETWORK_SIZE = 32  # Davis Southern Women graph: 18 women + 14 events


def _graph(world_size: int, edges: Iterable[tuple[int, int]]) -> nx.Graph:
    graph = nx.Graph()
    graph.add_nodes_from(range(world_size))
    graph.add_edges_from(edges)
    return graph


def _pairs(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    return np.stack([np.asarray(first, dtype=np.int64), np.asarray(second, dtype=np.int64)], axis=1)


def ring(world_size: int) -> Topology:
    """Cycle 0-1-...-(n-1)-0; needs n >= 3 (with 2 ranks it degenerates to a chain)."""
    n = as_world_size(world_size, what="ring world_size", minimum=-(2**62))
    if n < 3:  # one message for every n below the minimum
        raise TopologyError(
            f"ring world_size must be >= 3, got {n} (with 2 ranks a ring degenerates to a "
            "chain: use 'chain')"
        )
    ranks = np.arange(n)
    facts = LayerFacts(
        "ring", vertex_transitive=True, eigenvalues=partial(circulant_spectrum, n, (1,))
    )
    return Topology("ring", n, (_pairs(ranks, (ranks + 1) % n),), facts=(facts,))


def chain(world_size: int) -> Topology:
    """Path 0-1-...-(n-1) (the spanning tree of a ring); n >= 2."""
    n = as_world_size(world_size, what="chain world_size", minimum=2)
    facts = LayerFacts("chain", eigenvalues=partial(chain_spectrum, n))
    return Topology("chain", n, (_pairs(np.arange(n - 1), np.arange(1, n)),), facts=(facts,))


def star(world_size: int) -> Topology:
    """Rank 0 is the hub connected to every other rank; n >= 2."""
    n = as_world_size(world_size, what="star world_size", minimum=2)
    facts = LayerFacts("star", eigenvalues=partial(star_spectrum, n))
    return Topology("star", n, (_pairs(np.zeros(n - 1), np.arange(1, n)),), facts=(facts,))


def _heap_tree_edges(world_size: int) -> np.ndarray:
    # Heap layout: the children of rank r are 2r + 1 and 2r + 2.
    children = np.arange(1, world_size)
    return _pairs((children - 1) // 2, children)


def binary_tree(world_size: int) -> Topology:
    """Balanced binary tree in heap layout (children of r are 2r+1, 2r+2; root 0); n >= 2."""
    n = as_world_size(world_size, what="binary-tree world_size", minimum=2)
    return Topology("binary-tree", n, (_heap_tree_edges(n),))


def double_binary_trees(world_size: int) -> Topology:
    """Two complementary binary trees (Sanders et al. 2009), as in the paper's "Spanning trees".

    Tree A (layer 0, even coordinates) is the heap-layout binary tree; tree B (layer 1, odd
    coordinates) is its mirror image under rank r -> n-1-r. Every rank that is internal in
    one tree is a leaf in the other, so each rank sends and receives at most 2 models per
    step. The property is checked for the n asked for; n >= 2.
    """
    n = as_world_size(world_size, what="double-binary-trees world_size", minimum=2)
    tree_a = _heap_tree_edges(n)
    tree_b = n - 1 - tree_a
    topology = Topology("double-binary-trees", n, (tree_a, tree_b))
    check_complementary(topology)
    check_models_per_step(topology)
    return topology


def check_complementary(topology: Topology) -> None:
    """TopologyError unless every rank internal in one of the two trees is a leaf of the other."""
    n = topology.world_size
    degrees = [topology.degrees(k) for k in range(topology.num_layers)]
    shared = np.flatnonzero((degrees[0] > 1) & (degrees[1] > 1))
    if shared.size:
        raise TopologyError(
            f"double binary trees with world_size={n} are not complementary: "
            f"ranks {shared[:5].tolist()} are internal in both trees"
        )


def check_models_per_step(topology: Topology) -> None:
    """TopologyError if a rank of the double binary trees would send more than 2 models per step."""
    n = topology.world_size
    degrees = [topology.degrees(k) for k in range(topology.num_layers)]
    over = np.flatnonzero(degrees[0] + degrees[1] > 2 * 2)
    if over.size:
        rank = int(over[0])
        raise TopologyError(
            f"double binary trees with world_size={n}: rank {rank} would send "
            f"{topology.models_per_step(rank)} models per step, more than 2"
        )


def fully_connected(world_size: int) -> Topology:
    """Complete graph (all-reduce); n >= 1 (one worker: the centralized single-worker baseline)."""
    n = as_world_size(world_size, what="fully-connected world_size", minimum=1)
    facts = LayerFacts(
        "fully-connected", vertex_transitive=True, eigenvalues=partial(fully_connected_spectrum, n)
    )
    return Topology("fully-connected", n, (_pairs(*np.triu_indices(n, 1)),), facts=(facts,))


def hypercube(world_size: int) -> Topology:
    """Hypercube: ranks differing in exactly one bit are connected; n a power of two >= 2."""
    n = as_world_size(world_size, what="hypercube world_size", minimum=2)
    if not is_power_of_two(n):
        raise TopologyError(
            f"hypercube needs a power of two world_size (2, 4, 8, 16, ...), got {n}"
        )
    bits = n.bit_length() - 1
    ranks = np.arange(n)
    edges = np.concatenate(
        [
            _pairs(ranks[ranks & (1 << b) == 0], ranks[ranks & (1 << b) == 0] | (1 << b))
            for b in range(bits)
        ]
    )
    facts = LayerFacts(
        "hypercube", vertex_transitive=True, eigenvalues=partial(hypercube_spectrum, n)
    )
    return Topology("hypercube", n, (edges,), facts=(facts,))


def exponential(world_size: int, any_size: bool = False) -> Topology:
    """Union graph of SGP's exponential schedule (for display and delays); n a power of two >= 2
    (any n >= 2 with ``any_size``: the survivors of a lost worker).

    Who talks to whom in which round is ExponentialSchedule's job.
    """
    schedule = ExponentialSchedule(world_size, any_size=any_size)
    n = schedule.world_size
    offsets = tuple(2**k for k in range(schedule.period))
    facts = LayerFacts(
        "exponential", vertex_transitive=True, eigenvalues=partial(circulant_spectrum, n, offsets)
    )
    return Topology("exponential", n, (schedule.union_edges(),), facts=(facts,))


def one_peer_exponential(world_size: int) -> Topology:
    """Union graph of the one-peer exponential schedule (the hypercube's edges; display, delays and
    the placement checks); n a power of two >= 2. The gossip algorithms average with one peer per
    step, i XOR 2^(step mod log2 n): OnePeerSchedule says who."""
    n = as_world_size(world_size, what=f"{ONE_PEER_EXPONENTIAL} world_size", minimum=-(2**62))
    schedule = OnePeerSchedule(ONE_PEER_EXPONENTIAL, n)
    facts = LayerFacts(
        ONE_PEER_EXPONENTIAL, vertex_transitive=True, eigenvalues=partial(hypercube_spectrum, n)
    )
    return Topology(ONE_PEER_EXPONENTIAL, n, (schedule.union_edges(),), facts=(facts,))


def alternating_ring(world_size: int) -> Topology:
    """Union graph of the alternating ring (the ring's edges; one edge for n = 2); n even >= 2. The
    gossip algorithms average with the right and the left ring neighbour in turn, one per step:
    OnePeerSchedule says who."""
    n = as_world_size(world_size, what=f"{ALTERNATING_RING} world_size", minimum=-(2**62))
    schedule = OnePeerSchedule(ALTERNATING_RING, n)
    facts = LayerFacts(
        ALTERNATING_RING, vertex_transitive=True, eigenvalues=partial(circulant_spectrum, n, (1,))
    )
    return Topology(ALTERNATING_RING, n, (schedule.union_edges(),), facts=(facts,))


def social_network() -> Topology:
    """networkx's Davis Southern Women graph on 32 ranks (the paper's "Social Network" figure).

    Ranks follow networkx's node order: the 18 women (Evelyn Jefferson = rank 0, ...)
    then the 14 events E1..E14 (ranks 18..31).
    """
    graph = nx.davis_southern_women_graph()
    mapping = {node: rank for rank, node in enumerate(graph.nodes)}
    return Topology("social-network", SOCIAL_NETWORK_SIZE, (nx.relabel_nodes(graph, mapping),))


def _sort_key(node: Hashable) -> tuple[str, str]:
    return (type(node).__name__, repr(node))


def from_graph(graph: nx.Graph, name: str | None = None) -> Topology:
    """Topology of any connected undirected networkx graph.

    Nodes are relabelled to 0..n-1 in sorted order unless they already are exactly 0..n-1.
    The name defaults to graph.graph["name"] or "graph".
    """
    if not isinstance(graph, nx.Graph):
        raise TopologyError(f"from_graph needs a networkx.Graph, got {type(graph).__name__}")
    if graph.is_directed():
        raise TopologyError(
            "from_graph needs an undirected graph (links are bidirectional), got a directed one"
        )
    if graph.is_multigraph():
        raise TopologyError(
            "from_graph needs a simple graph, got a multigraph; use networkx.Graph(multigraph)"
        )
    if name is None:
        name = graph.graph.get("name") or "graph"
    nodes = list(graph.nodes)
    n = len(nodes)
    if n == 0:
        raise TopologyError("from_graph needs at least one node, got an empty graph")
    if set(nodes) != set(range(n)):
        try:
            ordered = sorted(nodes)
        except TypeError:
            ordered = sorted(nodes, key=_sort_key)
        graph = nx.relabel_nodes(graph, {node: rank for rank, node in enumerate(ordered)})
    return Topology(name, n, (graph,))


_COMMENT = re.compile(r"#.*")


def from_edge_list(path: str | Path, world_size: int) -> Topology:
    """Topology read from a text file with one "i j" pair of ranks per line ('#' starts a comment).

    It is named "edge-list:<path>", a name build() accepts.
    """
    n = as_world_size(world_size, what="edge-list world_size", minimum=1)
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise TopologyError(f"cannot read edge list {str(path)!r}: {error}") from None
    edges = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = _COMMENT.sub("", line).split()
        if not fields:
            continue
        where = f"{path}:{number}"
        if len(fields) != 2:
            raise TopologyError(f"{where}: expecting two ranks 'i j', got {line.strip()!r}")
        try:
            i, j = (int(field) for field in fields)
        except ValueError:
            raise TopologyError(f"{where}: ranks must be integers, got {line.strip()!r}") from None
        for rank in (i, j):
            if not 0 <= rank < n:
                raise TopologyError(f"{where}: rank {rank} is outside [0, {n}) for world_size={n}")
        if i == j:
            raise TopologyError(f"{where}: self-loop {i} {j} is not allowed")
        edges.append((i, j))
    unused = sorted(set(range(n)) - {rank for edge in edges for rank in edge})
    if n > 1 and unused:
        shown = ", ".join(map(str, unused[:10])) + (", ..." if len(unused) > 10 else "")
        raise TopologyError(
            f"edge list {str(path)!r} leaves ranks {shown} without any edge; the graph "
            f"must connect all {n} ranks"
        )
    return Topology(f"edge-list:{path}", n, (np.array(edges, dtype=np.int64).reshape(-1, 2),))
