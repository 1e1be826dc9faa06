"""The Topology value: one or more graph layers over ranks 0..n-1, and what follows from them.

A layer is held as its sorted edge array and compressed adjacency (O(n + m) memory), so a
topology over 100,000 ranks builds in a fraction of a second; the networkx view (``layers``)
is built on first use, and dense n x n matrices (``delays``, ``mixing_matrix``) only when an
algorithm or a test asks for them.
"""

# Long module: Topology, the frozen value every layer reads, and its derived facts

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np
from scipy.sparse import csgraph, csr_matrix

from .edges import bfs_hops, canonical_edges
from .errors import TopologyError
from .mixing import dense_metropolis_hastings
from .spectra import (
    DENSE_SPECTRUM_MAX_RANKS,
    SPARSE_SPECTRUM_MAX_RANKS,
    TREE_INERTIA_MAX_HEIGHT,
    GossipExtremes,
    extremes_of,
    not_computed,
    sparse_extremes,
    tree_extremes,
)

__all__ = [
    "GENERAL_DIAMETER_MAX_WORK",
    "PLACEMENTS",
    "LayerFacts",
    "Topology",
    "as_world_size",
    "node_labels",
]

# How a topology was built: "ranks" in rank order (the paper's), "nodes"
# node-aware (relaympi.topology.placement).
PLACEMENTS = ("ranks", "nodes")

# A summary computes the diameter of a graph that is neither a tree nor vertex-transitive by a
# BFS from every rank, n * (n + m) steps; above this much work it says "not computed" instead.
GENERAL_DIAMETER_MAX_WORK = 10**8


def as_world_size(world_size: Any, *, what: str = "world_size", minimum: int = 1) -> int:
    """Return world_size as an int, or raise TopologyError if it is not an integer >= minimum."""
    if isinstance(world_size, bool):
        raise TopologyError(f"{what} must be an integer, got {world_size!r}")
    try:
        value = operator.index(world_size)
    except TypeError:
        raise TopologyError(f"{what} must be an integer, got {world_size!r}") from None
    if value < minimum:
        raise TopologyError(f"{what} must be >= {minimum}, got {value}")
    return value


def node_labels(nodes: Sequence[Any] | np.ndarray, world_size: int) -> np.ndarray:
    """Each rank's node as 0..M-1, nodes numbered in the order of their lowest rank, shape [n].

    nodes: one node id per rank (any hashable: a host name, an int)."""
    if isinstance(nodes, (str, bytes)) or not hasattr(nodes, "__len__"):
        raise TopologyError(
            f"nodes must be a sequence of one node id per rank, got {type(nodes).__name__}"
        )
    if len(nodes) != world_size:
        raise TopologyError(
            f"nodes must give the node of each of the {world_size} ranks, got {len(nodes)} entries"
        )
    if isinstance(nodes, np.ndarray) and nodes.dtype.kind in "iu":
        _, first, inverse = np.unique(nodes, return_index=True, return_inverse=True)
        rank_of_node = np.empty(len(first), dtype=np.int64)
        rank_of_node[np.argsort(first, kind="stable")] = np.arange(len(first))
        return rank_of_node[inverse.reshape(-1)]
    codes: dict[Any, int] = {}
    try:
        labels = [codes.setdefault(node, len(codes)) for node in nodes]
    except TypeError:
        raise TopologyError("nodes must be hashable node ids (host names or integers)") from None
    return np.array(labels, dtype=np.int64).reshape(world_size)


@dataclass(frozen=True)
class LayerFacts:
    """What a generator knows about one of its layers without computing it.

    Claims, not checks: tests/test_topo_scale.py holds each family's facts to the generic
    computation (BFS from every rank, numpy's eigvalsh) at small n.
    """

    family: str  # the closed form's name, e.g. "ring"
    vertex_transitive: bool = (
        False  # every rank sees the same graph: diameter = eccentricity of rank 0
    )
    eigenvalues: Callable[[], np.ndarray] | None = None  # all n Metropolis-Hastings eigenvalues


def coordinate_blocks(numel: int, num_layers: int) -> tuple[slice, ...]:
    """Block k = ``np.array_split(np.arange(numel), num_layers)[k]`` as a slice (the first
    ``numel % num_layers`` blocks are one longer). Contiguous blocks keep every per-layer
    operation on contiguous memory: a torch op over a stride-2 view is ~6x slower."""
    if numel < 0 or num_layers < 1:
        raise TopologyError(f"need numel >= 0 and num_layers >= 1, got {numel} and {num_layers}")
    size, extra = divmod(numel, num_layers)
    bounds = np.cumsum([0] + [size + (k < extra) for k in range(num_layers)])
    return tuple(slice(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True))


class Topology:
    """A named communication topology over ranks 0..world_size-1.

    Most topologies have one layer. Double binary trees have two: layer k carries block k
    of the flat buffer's coordinates, ``np.array_split(np.arange(d), num_layers)[k]``
    (contiguous halves, as NCCL splits data between its two trees; see ``coordinate_blocks``).
    A layer is given as a networkx graph or an [m, 2] integer array of edges; it must be a
    connected simple graph over all ranks. The value is frozen; equality compares name, world
    size, placement and edges. ``facts`` (generators only) carry closed forms, one LayerFacts
    per layer. ``placement`` says how it was built: "ranks" (rank order, the paper's) or "nodes"
    (node-aware, relaympi.topology.placement); the name stays the family's either way.

    Most code gets one from ``build`` (by name) or a generator (``ring``, ``binary_tree``, ...);
    the constructor takes any graph.

    Args:
        name: the topology's name, non-empty.
        world_size: the number of ranks, >= 1.
        layers: a networkx graph or an [m, 2] integer edge array, or a sequence of them (one
            per layer), each a connected simple graph over ranks 0..world_size-1.
        facts: per layer, the LayerFacts its generator knows, or None.
        placement: "ranks" or "nodes" (PLACEMENTS).

    Attributes:
        name: the family's name (e.g. "ring", "spanning-tree:ring", "edge-list:<file>").
        world_size: the number of ranks.
        placement: how it was built, "ranks" or "nodes".

    Raises:
        TopologyError: a bad name, world size, placement or layer (not connected, a self-loop,
            a rank outside the world), or facts for another number of layers.

    Example:
        >>> import numpy as np
        >>> chain = Topology("my-chain", 4, np.array([[0, 1], [1, 2], [2, 3]]))
        >>> chain.is_tree, chain.diameter, chain.neighbors(1)
        (True, 3, (0, 2))
    """

    __slots__ = ("name", "world_size", "placement", "_edges", "_facts", "_cache")

    # Set once in __init__ through object.__setattr__ (the value is frozen); declared here so
    # that type checkers know them.
    name: str
    world_size: int
    placement: str
    _edges: tuple[np.ndarray, ...]  # per layer, the sorted [m, 2] int64 edge array
    _facts: tuple[LayerFacts | None, ...]
    _cache: dict[Any, Any]  # lazily computed views, keyed by (what, layer) or a name

    def __init__(
        self,
        name: str,
        world_size: int,
        layers: Any,
        *,
        facts: tuple[LayerFacts | None, ...] | None = None,
        placement: str = "ranks",
    ) -> None:
        if not isinstance(placement, str) or placement not in PLACEMENTS:
            raise TopologyError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}"
            )
        if not isinstance(name, str) or not name:
            raise TopologyError(f"topology name must be a non-empty string, got {name!r}")
        world_size = as_world_size(world_size)
        if isinstance(layers, (nx.Graph, np.ndarray)):
            layers = (layers,)
        layers = tuple(layers)
        if not layers:
            raise TopologyError(f"topology {name!r} needs at least one layer, got none")
        canonical = [canonical_edges(g, world_size, name, k) for k, g in enumerate(layers)]
        edges = tuple(e for e, _ in canonical)
        facts = tuple(facts) if facts is not None else (None,) * len(edges)
        if len(facts) != len(edges):
            raise TopologyError(f"expecting {len(edges)} layer facts, got {len(facts)}")
        for key, value in (
            ("name", name),
            ("world_size", world_size),
            ("placement", placement),
            ("_edges", edges),
            ("_facts", facts),
            ("_cache", {}),
        ):
            object.__setattr__(self, key, value)
        for k, (_, adjacency) in enumerate(canonical):
            self._cache[("adjacency", k)] = adjacency

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"Topology is immutable: cannot set {key!r}")

    def __reduce__(self) -> tuple:
        return (_rebuild, (self.name, self.world_size, self._edges, self._facts, self.placement))

    # -- identity -------------------------------------------------------------------------

    def _key(self) -> tuple:
        return (self.name, self.world_size, self.placement, tuple(e.tobytes() for e in self._edges))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        placed = f", placement={self.placement!r}" if self.placement != "ranks" else ""
        return (
            f"Topology(name={self.name!r}, world_size={self.world_size}, "
            f"num_layers={self.num_layers}{placed})"
        )

    # -- structure ------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Number of graph layers (2 for double binary trees, 1 otherwise)."""
        return len(self._edges)

    @property
    def layers(self) -> tuple[nx.Graph, ...]:
        """The layers as frozen networkx graphs (nodes 0..n-1 in order, edges sorted); built on
        first use."""
        if "layers" not in self._cache:
            graphs = []
            for edges in self._edges:
                graph = nx.Graph()
                graph.add_nodes_from(range(self.world_size))
                graph.add_edges_from(edges.tolist())
                graphs.append(nx.freeze(graph))
            self._cache["layers"] = tuple(graphs)
        return self._cache["layers"]

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TopologyError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise TopologyError(
                f"layer must be in [0, {self.num_layers}) for topology {self.name!r}, got {layer}"
            )
        return int(layer)

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TopologyError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank must be in [0, {self.world_size}), got {rank}")
        return int(rank)

    def _cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def _adjacency(self, layer: int) -> csr_matrix:
        """Symmetric CSR adjacency of a layer; row r's column indices are r's neighbours,
        ascending."""
        return self._cache[("adjacency", layer)]  # built with the edges

    def degrees(self, layer: int = 0) -> np.ndarray:
        """Degree of every rank in the given layer.

        Args:
            layer: the layer (0 for a one-layer topology).

        Returns:
            [n] ints: the number of neighbours of each rank.

        Example:
            >>> from relaympi.topology import build
            >>> build("ring", 4).degrees().tolist()
            [2, 2, 2, 2]
        """
        return np.diff(self._adjacency(self._layer(layer)).indptr)

    def neighbors(self, rank: int, layer: int = 0) -> tuple[int, ...]:
        """Neighbours of rank in the given layer, sorted ascending.

        Args:
            rank: a rank in [0, world_size).
            layer: the layer (0 for a one-layer topology).

        Returns:
            The neighbours' ranks.

        Raises:
            TopologyError: a rank or layer out of range.
        """
        adjacency = self._adjacency(self._layer(layer))
        rank = self._rank(rank)
        return tuple(
            adjacency.indices[adjacency.indptr[rank] : adjacency.indptr[rank + 1]].tolist()
        )

    def degree(self, rank: int, layer: int = 0) -> int:
        """Number of neighbours of rank in the given layer.

        Args:
            rank: a rank in [0, world_size).
            layer: the layer (0 for a one-layer topology).

        Returns:
            ``len(neighbors(rank, layer))``, without building the tuple.
        """
        adjacency = self._adjacency(self._layer(layer))
        rank = self._rank(rank)
        return int(adjacency.indptr[rank + 1] - adjacency.indptr[rank])

    def edges(self, layer: int = 0) -> list[tuple[int, int]]:
        """Edges (i, j) with i < j of the given layer, sorted.

        Args:
            layer: the layer (0 for a one-layer topology).

        Returns:
            One (i, j) pair per edge.
        """
        return list(map(tuple, self._edges[self._layer(layer)].tolist()))

    def edge_array(self, layer: int = 0) -> np.ndarray:
        """edges(layer) as an array, without Python objects per edge.

        Args:
            layer: the layer (0 for a one-layer topology).

        Returns:
            A read-only [m, 2] int64 array, rows (i, j) with i < j, sorted.
        """
        return self._edges[self._layer(layer)]

    def hops_from(self, rank: int, layer: int = 0) -> np.ndarray:
        """Hop distance from rank to every rank in the given layer (one BFS).

        Args:
            rank: the rank to measure from.
            layer: the layer (0 for a one-layer topology).

        Returns:
            [n] int64: hops from ``rank`` (0 at ``rank`` itself).
        """
        rank, layer = self._rank(rank), self._layer(layer)
        return bfs_hops(self._adjacency(layer), rank).astype(np.int64)

    @property
    def is_tree(self) -> bool:
        """Whether every layer is a tree spanning all world_size ranks."""
        return all(len(e) == self.world_size - 1 for e in self._edges)  # connected

    def delays(self, layer: int = 0) -> np.ndarray:
        """Hop distances tau_ij between all ranks in the given layer (tau_ii = 0).

        Dense by nature (8 n^2 bytes): for algorithms and tests at small n.

        Args:
            layer: the layer (0 for a one-layer topology).

        Returns:
            [n, n] int64, a copy the caller may change.

        Example:
            >>> from relaympi.topology import build
            >>> build("chain", 3).delays().tolist()
            [[0, 1, 2], [1, 0, 1], [2, 1, 0]]
        """
        layer = self._layer(layer)

        def compute() -> np.ndarray:
            return bfs_hops(self._adjacency(layer), np.arange(self.world_size)).astype(np.int64)

        return self._cached(("delays", layer), compute).copy()

    def _diameter_method(self, layer: int) -> str | None:
        """How layer's diameter is found cheaply: "tree" (two BFS), "transitive" (one BFS),
        "all-pairs" (BFS from every rank, within GENERAL_DIAMETER_MAX_WORK), or None."""
        if len(self._edges[layer]) == self.world_size - 1:
            return "tree"
        facts = self._facts[layer]
        if facts is not None and facts.vertex_transitive:
            return "transitive"
        if (
            self.world_size * (self.world_size + len(self._edges[layer]))
            <= GENERAL_DIAMETER_MAX_WORK
        ):
            return "all-pairs"
        return None

    def layer_diameter(self, layer: int = 0) -> int:
        """Largest hop distance between two ranks in the given layer.

        A tree: BFS from rank 0 to a farthest rank u, then from u: the farthest distance from u
        is the diameter (the farthest rank from any rank ends a longest path). A vertex-transitive
        layer (ring, hypercube, exponential, fully connected): eccentricity of rank 0. Otherwise
        BFS from every rank, in chunks of sources that keep memory O(n) per chunk.

        Args:
            layer: the layer (0 for a one-layer topology).

        Returns:
            The diameter in hops (0 for one rank).
        """
        layer = self._layer(layer)

        def compute() -> int:
            n = self.world_size
            if n == 1:
                return 0
            adjacency = self._adjacency(layer)
            method = self._diameter_method(layer)
            if method in ("tree", "transitive"):
                hops = bfs_hops(adjacency, 0)
                if method == "tree":
                    hops = bfs_hops(adjacency, int(np.argmax(hops)))
                return int(hops.max())
            chunk = max(1, 2**22 // n)
            return max(
                int(bfs_hops(adjacency, np.arange(lo, min(lo + chunk, n))).max())
                for lo in range(0, n, chunk)
            )

        return self._cached(("diameter", layer), compute)

    @property
    def diameter(self) -> int:
        """Largest hop distance between two ranks, maximized over layers."""
        return max(self.layer_diameter(k) for k in range(self.num_layers))

    @property
    def max_degree(self) -> int:
        """Largest degree of any rank in the union of all layers."""
        if self.num_layers == 1:
            return int(self.degrees(0).max(initial=0))
        n = self.world_size
        keys = np.concatenate([e[:, 0] * n + e[:, 1] for e in self._edges])
        keys.sort()
        keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
        union = np.bincount(np.concatenate([keys // n, keys % n]), minlength=n)
        return int(union.max(initial=0))

    def coordinate_blocks(self, numel: int) -> tuple[slice, ...]:
        """The contiguous block of a flat ``numel``-vector that each layer carries.

        Args:
            numel: the length of the flat model.

        Returns:
            One slice per layer, in layer order, covering [0, numel).
        """
        return coordinate_blocks(numel, self.num_layers)

    def models_per_step(self, rank: int) -> float:
        """Models sent by rank per step: each layer carries 1/num_layers of the model to each
        neighbour.

        Args:
            rank: a rank in [0, world_size).

        Returns:
            The number of whole models' worth of coordinates ``rank`` sends per step.
        """
        return sum(self.degree(rank, k) for k in range(self.num_layers)) / self.num_layers

    def max_models_per_step(self) -> float:
        """models_per_step maximized over ranks.

        Returns:
            The busiest rank's models per step.
        """
        total = sum(self.degrees(k) for k in range(self.num_layers))
        assert isinstance(total, np.ndarray)  # num_layers >= 1, so not sum()'s start 0
        return float(total.max() / self.num_layers)

    def inter_node_edges(self, nodes: Any) -> list[int]:
        """Per layer, the edges whose two ranks are on different nodes.

        Args:
            nodes: one node id per rank (any hashable: host names, integers).

        Returns:
            One count per layer.
        """
        labels = self._node_labels(nodes)
        return [int((labels[e[:, 0]] != labels[e[:, 1]]).sum()) for e in self._edges]

    def inter_node_degrees(self, nodes: Any) -> np.ndarray:
        """Per layer, the inter-node edges that end on each node; a node sends one message per step
        over each of them.

        Args:
            nodes: one node id per rank (any hashable: host names, integers).

        Returns:
            [layers, M] int64, nodes numbered in the order of their lowest rank.
        """
        labels = self._node_labels(nodes)
        counts = np.zeros((self.num_layers, int(labels.max(initial=0)) + 1), dtype=np.int64)
        for k, e in enumerate(self._edges):
            crossing = e[labels[e[:, 0]] != labels[e[:, 1]]]
            counts[k] = np.bincount(labels[crossing.reshape(-1)], minlength=counts.shape[1])
        return counts

    def _node_labels(self, nodes: Any) -> np.ndarray:
        return node_labels(nodes, self.world_size)

    def mixing_matrix(self, layer: int = 0) -> np.ndarray:
        """Metropolis-Hastings gossip matrix of the given layer.

        Args:
            layer: the layer (0 for a one-layer topology).

        Returns:
            [n, n] float64, symmetric and doubly stochastic.
        """
        return dense_metropolis_hastings(self.world_size, self._edges[self._layer(layer)])

    def gossip_extremes(self, layer: int = 0) -> GossipExtremes:
        """Spectral gap and smallest eigenvalue of the layer's Metropolis-Hastings matrix.

        A closed form where the generator knows one; otherwise the rule of
        relaympi.topology.spectra: dense eigvalsh up to DENSE_SPECTRUM_MAX_RANKS, inertia counts for
        trees of height (from rank 0) up to TREE_INERTIA_MAX_HEIGHT, sparse Lanczos up to
        SPARSE_SPECTRUM_MAX_RANKS, above that None with the reason.

        Args:
            layer: the layer (0 for a one-layer topology).

        Returns:
            The extremes, or None values with the reason where they are too costly at this size.
        """
        layer = self._layer(layer)

        def compute() -> GossipExtremes:
            n = self.world_size
            facts = self._facts[layer]
            if facts is not None and facts.eigenvalues is not None:
                return extremes_of(facts.eigenvalues())
            if n <= DENSE_SPECTRUM_MAX_RANKS:
                return extremes_of(np.linalg.eigvalsh(self.mixing_matrix(layer)))
            if len(self._edges[layer]) == n - 1:
                root = self._tree_root(layer)
                _, parent = csgraph.breadth_first_order(
                    self._adjacency(layer), root, directed=True, return_predecessors=True
                )
                depth = self.hops_from(root, layer)
                if depth.max() <= TREE_INERTIA_MAX_HEIGHT:
                    parent = np.where(parent < 0, -1, parent)  # scipy marks the root with -9999
                    return tree_extremes(n, self._edges[layer], parent, depth)
            if n <= SPARSE_SPECTRUM_MAX_RANKS:
                return sparse_extremes(n, self._edges[layer])
            return not_computed(n)

        return self._cached(("extremes", layer), compute)

    def _tree_root(self, layer: int) -> int:
        """Rank 0 if the tree is at most TREE_INERTIA_MAX_HEIGHT deep from it, else a centre (the
        middle of a longest path: height ceil(diameter / 2), the least any root gives). Node-aware
        trees are rooted away from rank 0 in one of their layers."""
        adjacency = self._adjacency(layer)
        hops = bfs_hops(adjacency, 0)
        if hops.max() <= TREE_INERTIA_MAX_HEIGHT:
            return 0
        end = int(np.argmax(hops))
        _, parent = csgraph.breadth_first_order(
            adjacency, end, directed=True, return_predecessors=True
        )
        from_end = bfs_hops(adjacency, end)
        rank = int(np.argmax(from_end))  # the far end of a longest path
        for _ in range(int(from_end[rank]) // 2):  # walk half of it back
            rank = int(parent[rank])
        return rank

    # -- summary --------------------------------------------------------------------------

    def to_dict(self, *, edge_arrays: bool = False) -> dict[str, Any]:
        """JSON-able summary.

        Multi-layer topologies give per-layer lists for edges and for the gossip quantities.
        A quantity that is too costly at this size is None, and "not_computed" (present only
        then) maps its key to the reason. What the algorithms make of a topology is theirs to say
        (``python -m relaympi.topology``).

        Args:
            edge_arrays: give each layer's edges as its read-only [m, 2] array instead of a list of
                pairs (~140 bytes of Python objects per edge).

        Returns:
            Name, size, placement, layers, edges, diameter, degrees and gossip quantities, by key.
        """
        per_layer = range(self.num_layers)
        edges = [self._edges[k] if edge_arrays else self._edges[k].tolist() for k in per_layer]
        extremes = [self.gossip_extremes(k) for k in per_layer]
        reasons: dict[str, str | None] = {}
        if all(self._diameter_method(k) is not None for k in per_layer):
            diameter = self.diameter
        else:
            diameter = None
            reasons["diameter"] = (
                "not computed: BFS from every rank takes n (n + m) > "
                f"{GENERAL_DIAMETER_MAX_WORK} steps"
            )
        for key in ("spectral_gap", "min_eigenvalue"):
            missing = [e.reason for e in extremes if getattr(e, key) is None]
            if missing:
                reasons[key] = missing[0]

        def single(values: list) -> Any:
            return values[0] if self.num_layers == 1 else values

        summary = {
            "name": self.name,
            "world_size": self.world_size,
            "placement": self.placement,
            "num_layers": self.num_layers,
            "coordinates": "all" if self.num_layers == 1 else "blocks",
            "edges": single(edges),
            "diameter": diameter,
            "max_degree": self.max_degree,
            "models_per_step": self.max_models_per_step(),
            "is_tree": self.is_tree,
            "spectral_gap": single([e.spectral_gap for e in extremes]),
            "min_eigenvalue": single([e.min_eigenvalue for e in extremes]),
        }
        if reasons:
            summary["not_computed"] = reasons
        return summary


def _rebuild(
    name: str, world_size: int, edges: tuple, facts: tuple, placement: str = "ranks"
) -> Topology:
    return Topology(
        name, world_size, tuple(np.array(e) for e in edges), facts=facts, placement=placement
    )
