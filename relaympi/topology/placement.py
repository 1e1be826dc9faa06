"""Node-aware topologies: trees and graphs that keep a node's ranks together.

Links inside a node are fast; links between nodes are slower and shared. With placement
"nodes", every topology that can is built over the *node-major order*: the nodes in the order
of their lowest rank, and inside each node its ranks ascending. Ranks of one node need not be
contiguous (MPI may place them round-robin); the order only depends on which rank is on which
node. With a single node (or with contiguous nodes for the graphs that are relabelled only),
the node-major order is 0..n-1 and each topology is exactly the rank-order one.

The rules (M nodes; K = ranks on a node):

- chain: the path through the node-major order; it crosses between nodes on M - 1 edges.
- ring: the cycle through the node-major order; M inter-node edges (M >= 2).
- hypercube: vertex p of the hypercube is the rank at node-major position p, so with nodes of
  2^b ranks the b lowest bits stay inside a node.
- binary-tree: a heap-layout binary tree over the nodes (node-major index m: children 2m+1,
  2m+2), entered at each node's lowest rank (local 0, the node's gateway). Inside a node without
  child nodes: the heap-layout tree over its ranks (local j's parent (j-1)//2). Inside a node
  with child nodes the node tree passes close to the gateway: local 0 - 1 - 2, then a heap
  rooted at local 2 (local j >= 3 under (j-3)//2 + 2); the first child node hangs on local 0,
  the second on local 1 (on local 0 if the node has one rank). Every rank keeps degree <= 3, a
  node's ranks form one connected subtree, and the tree crosses between nodes on M - 1 edges,
  the minimum for a spanning tree. The price is depth: 1 or 2 hops per level of the node tree
  where rank order has 1 (64 ranks on 8 nodes: diameter 13 against 11 in rank order).
- double-binary-trees: tree A is the binary tree above; tree B is the same construction on
  the reversed node-major order (the mirror of A: at the node level the paper's mirror
  m -> M-1-m, inside each node local j -> K-1-j, gateway the node's highest rank). So the two
  node-level trees are the paper's complementary pair over M nodes, each tree crosses between
  nodes on exactly M - 1 edges, and layer k still carries coordinate block k. Every rank
  sends and receives at most 2 models per step (checked for every layout built). At the rank
  level, internal ranks of one tree are leaves of the other whenever every node has an odd
  number of ranks (and always with one node); on a node with an even K that has a parent in
  both node-level trees and two children in one, one rank is internal in both trees (degree 2
  in each): counting degrees shows that no layout of such a node can keep both properties.
- star: the hub is the lowest rank of the largest node (the earliest such node); the other
  ranks of its node are reached inside the node. Placement cannot do more: every rank off the
  hub's node is an inter-node edge, n - K_hub of them.
- exponential (SGP's schedule, i -> i - 2^k): a rank-order schedule of the algorithms, not an
  edge list, so it can only be node-aware when the node-major order is rank order, i.e. every
  node's ranks are contiguous: then offsets below K stay mostly inside a node and the topology
  is the rank-order one. Non-contiguous nodes are refused (launch with block placement, or use
  placement "ranks").
- fully-connected: every pair is an edge whatever the placement: identical to "ranks".
- social-network, social-network-tree, edge-list, spanning-tree:<name>: their edges are given
  rank by rank (a data set, a file, a protocol over a given graph); there is no freedom to
  place, and "nodes" is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import graphs
from .core import PLACEMENTS, Topology, as_world_size, node_labels
from .errors import TopologyError

__all__ = ["PLACEMENTS", "check_placement", "node_labels", "node_major_order", "nodes_of", "place"]


def check_placement(placement: Any) -> str:
    """placement itself if it is one of PLACEMENTS, else TopologyError naming the allowed ones."""
    if not isinstance(placement, str) or placement not in PLACEMENTS:
        raise TopologyError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    return placement


def nodes_of(world_size: int, ranks_per_node: int) -> tuple[int, ...]:
    """The node of every rank when ranks fill nodes in blocks of ranks_per_node (rank // K), as
    block placement does (``--ranks-per-node K`` emulates it). K need not divide world_size: the
    last node then holds fewer ranks, as with an uneven allocation. K > world_size: one node."""
    n = as_world_size(world_size)
    k = as_world_size(ranks_per_node, what="ranks_per_node")
    return tuple(rank // k for rank in range(n))


def node_major_order(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, sizes): order[p] is the rank at node-major position p; sizes[m] the ranks of node
    m."""
    return np.argsort(labels, kind="stable"), np.bincount(labels)


def _nested_heap(order: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Edges of the binary tree over nodes with a subtree inside each node (module docstring),
    over the node-major positions given by order; [n - 1, 2] ranks."""
    node_count = len(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    node = np.repeat(np.arange(node_count), sizes)
    local = np.arange(len(order)) - starts[node]
    relays = 2 * np.arange(node_count) + 1 < node_count  # nodes with child nodes
    inside = local >= 1
    j = local[inside]
    heap_parent = (j - 1) // 2
    # 0 - 1 - 2, then a heap rooted at local 2
    relay_parent = np.where(j <= 2, j - 1, (j - 3) // 2 + 2)
    parent_local = np.where(relays[node[inside]], relay_parent, heap_parent)
    intra = np.stack([starts[node[inside]] + parent_local, np.flatnonzero(inside)], axis=1)
    child = np.arange(1, node_count)
    parent = (child - 1) // 2
    # first child node at local 0, second at 1
    attach = np.minimum((child - 1) % 2, sizes[parent] - 1)
    inter = np.stack([starts[parent] + attach, starts[child]], axis=1)
    return order[np.concatenate([intra, inter])]


def _path(order: np.ndarray) -> np.ndarray:
    return np.stack([order[:-1], order[1:]], axis=1)


def _contiguous(labels: np.ndarray) -> bool:
    return bool((np.diff(labels) >= 0).all())  # labels number nodes by their lowest rank


_GIVEN_RANK_BY_RANK = (
    "its edges are given rank by rank, so there is nothing to place; use placement 'ranks'"
)


def place(
    name: str, world_size: int, nodes: Sequence[Any], base: Topology | None = None
) -> Topology:
    """The node-aware topology `name` (rules in the module docstring) over the given nodes.

    base: the rank-order topology of the same name (the registry builds it first, so that every
    size check and error message is the same as for placement "ranks").
    """
    n = as_world_size(world_size)
    labels = node_labels(nodes, n)
    order, sizes = node_major_order(labels)
    if base is None:
        raise TopologyError(f"placement 'nodes' needs the rank-order {name!r} topology first")
    facts = base._facts
    if name in ("ring", "chain", "hypercube"):
        edges = order[base.edge_array(0)]  # base vertex p is the rank at node-major position p
        return Topology(name, n, (edges,), facts=facts, placement="nodes")
    if name == "binary-tree":
        return Topology(name, n, (_nested_heap(order, sizes),), placement="nodes")
    if name == "double-binary-trees":
        tree_a = _nested_heap(order, sizes)
        tree_b = _nested_heap(order[::-1], sizes[::-1])
        topology = Topology(name, n, (tree_a, tree_b), placement="nodes")
        if (sizes % 2 == 1).all():  # odd nodes (or single ranks): complementary rank by rank too
            graphs.check_complementary(topology)
        graphs.check_models_per_step(topology)
        return topology
    if name == "star":
        largest = int(np.argmax(sizes))  # the first node of the largest size
        hub = int(order[sizes[:largest].sum()])
        others = np.delete(np.arange(n), hub)
        return Topology(
            name,
            n,
            (np.stack([np.full(n - 1, hub), others], axis=1),),
            facts=facts,
            placement="nodes",
        )
    if name == "exponential":
        if not _contiguous(labels):
            first = int(np.flatnonzero(np.diff(labels) < 0)[0]) + 1
            raise TopologyError(
                "placement 'nodes' for exponential needs every node's ranks contiguous "
                "(block placement): "
                f"SGP's schedule sends rank i to i - 2^k in rank order, but rank {first} "
                "is on an earlier node "
                f"than rank {first - 1}; launch with block placement or use placement 'ranks'"
            )
        return Topology(name, n, base._edges, facts=facts, placement="nodes")
    if name == "fully-connected":  # every pair is an edge: identical to rank order
        return Topology(name, n, base._edges, facts=facts, placement="nodes")
    raise TopologyError(f"placement 'nodes' does not apply to {name!r}: {_GIVEN_RANK_BY_RANK}")
