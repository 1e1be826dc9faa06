"""The Topology value: one or more graph layers over ranks 0..n-1, and what follows from them."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import networkx as nx
import numpy as np

from .errors import TopologyError
from .mixing import metropolis_hastings, min_eigenvalue, spectral_gap

__all__ = ["Topology", "check_world_size"]


def check_world_size(world_size: Any, *, what: str = "world_size", minimum: int = 1) -> int:
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


def _canonical_layer(graph: Any, world_size: int, name: str, index: int) -> nx.Graph:
    """A frozen copy of graph with nodes 0..n-1 inserted in order and edges sorted (i < j)."""
    where = f"layer {index} of topology {name!r}"
    if not isinstance(graph, nx.Graph) or graph.is_directed() or graph.is_multigraph():
        raise TopologyError(
            f"{where} must be an undirected simple networkx.Graph, got {type(graph).__name__}"
        )
    if set(graph.nodes) != set(range(world_size)):
        extra = sorted((set(graph.nodes) - set(range(world_size))), key=repr)[:5]
        missing = sorted(set(range(world_size)) - set(graph.nodes))[:5]
        raise TopologyError(
            f"{where} must have nodes exactly 0..{world_size - 1}; "
            f"unexpected nodes {extra}, missing ranks {missing}"
        )
    loops = sorted(node for node, _ in nx.selfloop_edges(graph))
    if loops:
        raise TopologyError(
            f"{where} has self-loops at ranks {loops[:5]}; self-loops are not allowed"
        )
    if not nx.is_connected(graph):
        components = sorted((sorted(c) for c in nx.connected_components(graph)), key=lambda c: c[0])
        raise TopologyError(
            f"{where} is disconnected ({len(components)} components); "
            f"e.g. rank {components[1][0]} cannot reach rank 0"
        )
    canonical = nx.Graph()
    canonical.add_nodes_from(range(world_size))
    canonical.add_edges_from(sorted((min(i, j), max(i, j)) for i, j in graph.edges()))
    return nx.freeze(canonical)


def coordinate_blocks(numel: int, num_layers: int) -> tuple[slice, ...]:
    """Block k = ``np.array_split(np.arange(numel), num_layers)[k]`` as a slice (the first
    ``numel % num_layers`` blocks are one longer). Contiguous blocks keep every per-layer
    operation on contiguous memory: a torch op over a stride-2 view is ~6x slower."""
    if numel < 0 or num_layers < 1:
        raise TopologyError(f"need numel >= 0 and num_layers >= 1, got {numel} and {num_layers}")
    size, extra = divmod(numel, num_layers)
    bounds = np.cumsum([0] + [size + (k < extra) for k in range(num_layers)])
    return tuple(slice(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True))


@dataclass(frozen=True, eq=False)
class Topology:
    """A named communication topology over ranks 0..world_size-1.

    Most topologies have one layer. Double binary trees have two: layer k carries block k
    of the flat buffer's coordinates, ``np.array_split(np.arange(d), num_layers)[k]``
    (contiguous halves, as NCCL splits data between its two trees; see ``coordinate_blocks``).
    Layers are frozen connected simple graphs; equality compares name, world size and edges.
    """

    name: str
    world_size: int
    layers: tuple[nx.Graph, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TopologyError(f"topology name must be a non-empty string, got {self.name!r}")
        world_size = check_world_size(self.world_size)
        layers = self.layers
        if isinstance(layers, nx.Graph):
            layers = (layers,)
        layers = tuple(layers)
        if not layers:
            raise TopologyError(f"topology {self.name!r} needs at least one layer, got none")
        frozen = tuple(_canonical_layer(g, world_size, self.name, k) for k, g in enumerate(layers))
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "layers", frozen)
        object.__setattr__(self, "_cache", {})

    # -- identity -------------------------------------------------------------------------

    def _key(self) -> tuple:
        return (
            self.name,
            self.world_size,
            tuple(tuple(self.edges(k)) for k in range(self.num_layers)),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Topology(name={self.name!r}, world_size={self.world_size}, num_layers={self.num_layers})"

    # -- structure ------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Number of graph layers (2 for double binary trees, 1 otherwise)."""
        return len(self.layers)

    def _layer(self, layer: int) -> nx.Graph:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TopologyError(f"layer must be an integer, got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise TopologyError(
                f"layer must be in [0, {self.num_layers}) for topology {self.name!r}, got {layer}"
            )
        return self.layers[layer]

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TopologyError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank must be in [0, {self.world_size}), got {rank}")
        return int(rank)

    def neighbors(self, rank: int, layer: int = 0) -> tuple[int, ...]:
        """Neighbours of rank in the given layer, sorted ascending."""
        return tuple(sorted(self._layer(layer).neighbors(self._rank(rank))))

    def degree(self, rank: int, layer: int = 0) -> int:
        """Number of neighbours of rank in the given layer."""
        return int(self._layer(layer).degree(self._rank(rank)))

    def edges(self, layer: int = 0) -> list[tuple[int, int]]:
        """Edges (i, j) with i < j of the given layer, sorted."""
        return sorted((min(i, j), max(i, j)) for i, j in self._layer(layer).edges())

    @property
    def is_tree(self) -> bool:
        """Whether every layer is a tree spanning all world_size ranks."""
        return all(g.number_of_edges() == self.world_size - 1 for g in self.layers)  # connected

    def delays(self, layer: int = 0) -> np.ndarray:
        """Hop distances tau_ij between all ranks in the given layer (tau_ii = 0), shape [n, n]."""
        graph = self._layer(layer)
        key = ("delays", int(layer))
        if key not in self._cache:
            n = self.world_size
            tau = np.zeros((n, n), dtype=np.int64)
            for source, lengths in nx.all_pairs_shortest_path_length(graph):
                for target, hops in lengths.items():
                    tau[source, target] = hops
            self._cache[key] = tau
        return self._cache[key].copy()

    @property
    def diameter(self) -> int:
        """Largest hop distance between two ranks, maximized over layers."""
        return max(int(self.delays(k).max()) for k in range(self.num_layers))

    @property
    def max_degree(self) -> int:
        """Largest degree of any rank in the union of all layers."""
        union = nx.compose_all(self.layers)
        return max((d for _, d in union.degree()), default=0)

    def coordinate_blocks(self, numel: int) -> tuple[slice, ...]:
        """The contiguous block of a flat ``numel``-vector that each layer carries."""
        return coordinate_blocks(numel, self.num_layers)

    def models_per_step(self, rank: int) -> float:
        """Models sent by rank per step: each layer carries 1/num_layers of the model to each neighbour."""
        return sum(self.degree(rank, k) for k in range(self.num_layers)) / self.num_layers

    def mixing_matrix(self, layer: int = 0) -> np.ndarray:
        """Metropolis-Hastings gossip matrix of the given layer, shape [n, n]."""
        return metropolis_hastings(self._layer(layer))

    # -- summary --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary.

        Multi-layer topologies give per-layer lists for edges and for the gossip quantities.
        What the algorithms make of a topology is theirs to say (``python -m relaympi.topology``).
        """
        per_layer = range(self.num_layers)
        edges = [[list(e) for e in self.edges(k)] for k in per_layer]
        gaps = [spectral_gap(self.mixing_matrix(k)) for k in per_layer]
        lowest = [min_eigenvalue(self.mixing_matrix(k)) for k in per_layer]

        def single(values: list) -> Any:
            return values[0] if self.num_layers == 1 else values

        return {
            "name": self.name,
            "world_size": self.world_size,
            "num_layers": self.num_layers,
            "coordinates": "all" if self.num_layers == 1 else "blocks",
            "edges": single(edges),
            "diameter": self.diameter,
            "max_degree": self.max_degree,
            "models_per_step": max(self.models_per_step(r) for r in range(self.world_size)),
            "is_tree": self.is_tree,
            "spectral_gap": single(gaps),
            "min_eigenvalue": single(lowest),
        }
