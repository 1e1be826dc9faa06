"""Build any topology by name: the names the command lines accept."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from relaympi.registry import Registry

from .core import Topology
from .errors import TopologyError
from .graphs import (
    SOCIAL_NETWORK_SIZE,
    alternating_ring,
    binary_tree,
    chain,
    double_binary_trees,
    exponential,
    from_edge_list,
    fully_connected,
    hypercube,
    one_peer_exponential,
    ring,
    social_network,
    star,
)
from .placement import PLACEMENTS, check_placement, node_labels, place
from .trees import spanning_tree

__all__ = ["TOPOLOGIES", "TOPOLOGY_NAMES", "SPANNING_TREE_PREFIX", "EDGE_LIST", "build"]

SPANNING_TREE_PREFIX = "spanning-tree:"
EDGE_LIST = "edge-list"


def _social_network(world_size: int) -> Topology:
    if world_size != SOCIAL_NETWORK_SIZE:
        raise TopologyError(
            f"social-network has exactly {SOCIAL_NETWORK_SIZE} ranks (18 women and 14 events "
            f"of the Davis Southern Women graph), got world_size={world_size!r}"
        )
    return social_network()


def _social_network_tree(world_size: int, root: int | None) -> Topology:
    tree = spanning_tree(_social_network(world_size), root=root)
    return Topology("social-network-tree", tree.world_size, tree.layers)


# name -> the topology over world_size ranks; TOPOLOGY_NAMES in this order (the command
# lines' lists)
TOPOLOGIES: Registry[Callable[[int], Topology]] = Registry(
    "topology",
    {
        "ring": ring,
        "chain": chain,
        "star": star,
        "binary-tree": binary_tree,
        "double-binary-trees": double_binary_trees,
        "fully-connected": fully_connected,
        "hypercube": hypercube,
        "social-network": _social_network,
        # build(): root
        "social-network-tree": lambda world_size: _social_network_tree(world_size, None),
        "exponential": exponential,
        "one-peer-exponential": one_peer_exponential,
        "alternating-ring": alternating_ring,
    },
    error=TopologyError,
)
TOPOLOGY_NAMES = TOPOLOGIES.names


def _allowed() -> str:
    return (
        ", ".join(TOPOLOGY_NAMES) + f", {EDGE_LIST} (with an edge list file), {EDGE_LIST}:<file>, "
        f"{SPANNING_TREE_PREFIX}<name>"
    )


def build(
    name: str,
    world_size: int,
    *,
    root: int | None = None,
    edge_list: str | Path | None = None,
    placement: str = "ranks",
    nodes: Sequence[Any] | None = None,
) -> Topology:
    """The topology called `name` over world_size ranks.

    Besides TOPOLOGY_NAMES, accepts "edge-list" with edge_list=<file> (or "edge-list:<file>",
    the name such a topology gets, so every topology's name can be built again) and
    "spanning-tree:<name>" for the Spanning Tree Protocol tree of any single-layer
    topology (root = lowest rank unless given). `root` applies only to spanning trees
    (including "social-network-tree"), `edge_list` only to "edge-list" bases.

    placement: one of PLACEMENTS. "ranks" (default) builds in rank order, the paper's; `nodes`,
    if given, is only checked. "nodes" keeps each node's ranks together (the rules per family
    are in relaympi.topology.placement) and needs `nodes`, one node id per rank (ranks of a node
    need not be contiguous); with one node it is exactly the rank-order topology.

    Args:
        name: one of TOPOLOGY_NAMES, "edge-list", "edge-list:<file>" or "spanning-tree:<name>".
        world_size: the number of ranks, >= 1.
        root: the root rank of a spanning tree (None: the lowest rank).
        edge_list: the file of an "edge-list" topology (one "i j" edge per line).
        placement: "ranks" or "nodes" (PLACEMENTS).
        nodes: one node id per rank (any hashable: host names, integers).

    Returns:
        The frozen Topology.

    Raises:
        TopologyError: an unknown name, a world size the family cannot have, an argument that
            does not apply to the family, or a bad node layout; the message says what is allowed.

    Example:
        >>> trees = build("double-binary-trees", 8)
        >>> trees.num_layers, trees.neighbors(3, layer=1)
        (2, (6,))
        >>> build("spanning-tree:ring", 6, root=2).edges()
        [(0, 1), (0, 5), (1, 2), (2, 3), (3, 4)]
        >>> build("chain", 8, placement="nodes", nodes=["a"] * 4 + ["b"] * 4).placement
        'nodes'
    """
    check_placement(placement)
    if nodes is not None and isinstance(world_size, int) and not isinstance(world_size, bool):
        node_labels(nodes, world_size)  # a wrong layout is an error whatever the placement
    if placement == "nodes":
        if nodes is None:
            raise TopologyError(
                "placement 'nodes' needs the node of every rank (nodes=..., or --ranks-per-node K "
                f"to emulate nodes); placements: {', '.join(PLACEMENTS)}"
            )
        base = build(name, world_size, root=root, edge_list=edge_list)
        return place(
            base.name if not base.name.startswith(EDGE_LIST) else EDGE_LIST,
            base.world_size,
            nodes,
            base,
        )
    if not isinstance(name, str):
        raise TopologyError(f"topology name must be a string, got {name!r}; allowed: {_allowed()}")
    if name.startswith(SPANNING_TREE_PREFIX):
        base_name = name[len(SPANNING_TREE_PREFIX) :]
        if not base_name:
            raise TopologyError(
                f"{name!r} names no base topology; e.g. '{SPANNING_TREE_PREFIX}social-network'"
            )
        return spanning_tree(build(base_name, world_size, edge_list=edge_list), root=root)
    if name == "social-network-tree":
        _no_edge_list(name, edge_list)
        return _social_network_tree(world_size, root)
    if root is not None:
        raise TopologyError(
            f"root={root!r} only applies to spanning trees ('{SPANNING_TREE_PREFIX}<name>', "
            f"'social-network-tree'), not to {name!r}"
        )
    if name.startswith(EDGE_LIST + ":"):
        if edge_list is not None:
            raise TopologyError(
                f"{name!r} already names its file; do not pass edge_list={edge_list!r} too"
            )
        name, edge_list = EDGE_LIST, name[len(EDGE_LIST) + 1 :]
    if name == EDGE_LIST:
        if edge_list is None:
            raise TopologyError(
                f"topology {EDGE_LIST!r} needs an edge list file (edge_list=PATH, --edge-list FILE)"
            )
        return from_edge_list(edge_list, world_size)
    _no_edge_list(name, edge_list)
    if name not in TOPOLOGIES:
        close = difflib.get_close_matches(name.replace("_", "-"), TOPOLOGY_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TopologyError(f"unknown topology {name!r}{hint}; allowed: {_allowed()}")
    return TOPOLOGIES[name](world_size)


def _no_edge_list(name: str, edge_list: str | Path | None) -> None:
    if edge_list is not None:
        raise TopologyError(
            f"an edge list file only applies to topology {EDGE_LIST!r}, not to {name!r}"
        )
