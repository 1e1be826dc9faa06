"""One layer's edges: checked and put in one canonical form (a sorted, read-only [m, 2] int64
array with i < j in every row), its sparse adjacency, and BFS hop counts over it. The Topology
value (core.py) holds each layer this way."""

from __future__ import annotations

from typing import Any

import networkx as nx
import numpy as np
from scipy.sparse import csgraph, csr_matrix

from .errors import TopologyError


def canonical_edges(
    layer: Any, world_size: int, name: str, index: int
) -> tuple[np.ndarray, csr_matrix]:
    """The edges of a layer (a networkx graph or an [m, 2] integer array) as a sorted, read-only
    [m, 2] int64 array with i < j in every row, and its adjacency (adjacency_of); checks ranks,
    self-loops and connectivity."""
    where = f"layer {index} of topology {name!r}"
    n = world_size
    if isinstance(layer, np.ndarray):
        if layer.dtype.kind not in "iu" or layer.ndim != 2 or layer.shape[1] != 2:
            raise TopologyError(
                f"{where} must be an [m, 2] integer array of edges, got {layer.dtype} {layer.shape}"
            )
        edges = layer.astype(np.int64, copy=False)
        outside = (edges < 0) | (edges >= n)
        if outside.any():
            bad = tuple(int(r) for r in edges[outside.any(axis=1)][0])
            raise TopologyError(f"{where} has edge {bad} outside ranks 0..{n - 1}")
    elif isinstance(layer, nx.Graph) and not layer.is_directed() and not layer.is_multigraph():
        if set(layer.nodes) != set(range(n)):
            extra = sorted((set(layer.nodes) - set(range(n))), key=repr)[:5]
            missing = sorted(set(range(n)) - set(layer.nodes))[:5]
            raise TopologyError(
                f"{where} must have nodes exactly 0..{n - 1}; "
                f"unexpected nodes {extra}, missing ranks {missing}"
            )
        edges = np.array(list(layer.edges()), dtype=np.int64).reshape(-1, 2)
    else:
        raise TopologyError(
            f"{where} must be an undirected simple networkx.Graph, got {type(layer).__name__}"
        )
    loops = np.unique(edges[edges[:, 0] == edges[:, 1], 0])
    if loops.size:
        raise TopologyError(
            f"{where} has self-loops at ranks {loops[:5].tolist()}; self-loops are not allowed"
        )
    keys = np.minimum(edges[:, 0], edges[:, 1]) * n + np.maximum(edges[:, 0], edges[:, 1])
    keys.sort()  # np.unique's hashing is ~100x slower than sorting the (usually sorted) keys
    keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if keys.size else keys
    edges = np.stack([keys // n, keys % n], axis=1)
    adjacency = adjacency_of(n, edges)
    if n > 1:
        # symmetric: strong components are the components, without scipy adding the transpose
        count, labels = csgraph.connected_components(adjacency, directed=True, connection="strong")
        if count > 1:
            _, first_rank = np.unique(labels, return_index=True)  # lowest rank of each component
            second = int(np.sort(first_rank)[1])
            raise TopologyError(
                f"{where} is disconnected ({count} components); "
                f"e.g. rank {second} cannot reach rank 0"
            )
    edges.flags.writeable = False
    return edges, adjacency


def adjacency_of(world_size: int, edges: np.ndarray) -> csr_matrix:
    """Symmetric 0/1 adjacency of the edges (row r's columns: r's neighbours, ascending)."""
    rows = np.concatenate([edges[:, 0], edges[:, 1]])
    cols = np.concatenate([edges[:, 1], edges[:, 0]])
    adjacency = csr_matrix(
        (np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(world_size, world_size)
    )
    adjacency.sort_indices()
    return adjacency


def bfs_hops(adjacency: csr_matrix, sources: np.ndarray | int) -> np.ndarray:
    """BFS hop counts from each source (rows) to every rank; O(n + m) per source, in C."""
    # directed=True: the adjacency is symmetric already, and scipy would otherwise add its transpose
    return csgraph.shortest_path(adjacency, unweighted=True, directed=True, indices=sources)
