"""Spanning trees in the style of the Spanning Tree Protocol: elect a root, follow shortest paths to
it."""

from __future__ import annotations

import networkx as nx
import numpy as np

from .core import Topology
from .errors import TopologyError
from .graphs import from_graph

__all__ = ["spanning_tree"]


def spanning_tree(graph_or_topology: Topology | nx.Graph, root: int | None = None) -> Topology:
    """Spanning tree of a single-layer topology or graph, as the Spanning Tree Protocol builds it.

    The root is elected as the lowest rank unless given; every other rank attaches to the
    neighbour that is one hop closer to the root, the lowest such rank on ties. The result
    is deterministic, keeps every rank's distance to the root, and is named
    "spanning-tree:<base name>".
    """
    base = (
        graph_or_topology
        if isinstance(graph_or_topology, Topology)
        else from_graph(graph_or_topology)
    )
    if base.num_layers != 1:
        raise TopologyError(
            f"spanning_tree needs a single-layer topology, got {base.name!r} with "
            f"{base.num_layers} layers"
        )
    n = base.world_size
    if root is None:
        root = 0  # the elected root: lowest id
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TopologyError(f"root must be an integer rank, got {root!r}")
    if not 0 <= root < n:
        raise TopologyError(f"root must be a rank in [0, {n}), got {root}")
    distance = base.hops_from(int(root))
    edges = base.edge_array(0)
    child = np.concatenate([edges[:, 0], edges[:, 1]])
    peer = np.concatenate([edges[:, 1], edges[:, 0]])
    closer = distance[peer] == distance[child] - 1
    parent = np.full(n, n, dtype=np.int64)
    np.minimum.at(parent, child[closer], peer[closer])  # the lowest neighbour one hop closer
    children = np.flatnonzero(np.arange(n) != root)
    tree = np.stack([parent[children], children], axis=1)
    return Topology(f"spanning-tree:{base.name}", n, (tree,))
