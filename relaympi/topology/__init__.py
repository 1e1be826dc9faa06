"""Pure graph topologies for decentralized learning: graphs, spanning trees, schedules, gossip
weights."""

from .core import Topology, coordinate_blocks
from .errors import TopologyError
from .graphs import (
    alternating_ring,
    binary_tree,
    chain,
    double_binary_trees,
    exponential,
    from_edge_list,
    from_graph,
    fully_connected,
    hypercube,
    one_peer_exponential,
    ring,
    social_network,
    star,
)
from .mixing import metropolis_hastings, min_eigenvalue, spectral_gap
from .placement import PLACEMENTS, nodes_of
from .registry import TOPOLOGY_NAMES, build
from .schedule import ONE_PEER_NAMES, ExponentialSchedule, OnePeerSchedule, one_peer_schedule
from .trees import spanning_tree

__all__ = [
    "ONE_PEER_NAMES",
    "PLACEMENTS",
    "TOPOLOGY_NAMES",
    "ExponentialSchedule",
    "OnePeerSchedule",
    "Topology",
    "TopologyError",
    "alternating_ring",
    "binary_tree",
    "build",
    "chain",
    "coordinate_blocks",
    "double_binary_trees",
    "exponential",
    "from_edge_list",
    "from_graph",
    "fully_connected",
    "hypercube",
    "metropolis_hastings",
    "min_eigenvalue",
    "nodes_of",
    "one_peer_exponential",
    "one_peer_schedule",
    "ring",
    "social_network",
    "spanning_tree",
    "spectral_gap",
    "star",
]
