"""Topologies named in test tables, with an optional node layout: "chain@3" is chain built with
placement "nodes" over nodes of 3 ranks in blocks (rank // 3), "chain@3rr" over nodes of about 3
ranks placed round-robin (rank % M, M = ceil(n / 3)): ranks of a node are not contiguous."""

from __future__ import annotations

from relaympi.topology import Topology, build, nodes_of


def layout(spec: str, n: int) -> tuple[int, ...]:
    """The node of every rank for a layout spec "K" (blocks) or "Krr" (round-robin)."""
    round_robin = spec.endswith("rr")
    k = int(spec[:-2] if round_robin else spec)
    if not round_robin:
        return nodes_of(n, k)
    m = -(-n // k)
    return tuple(rank % m for rank in range(n))


def build_named(spec: str, n: int) -> Topology:
    """build(name, n), node-aware where the spec names a layout ("name@K", "name@Krr")."""
    name, _, where = spec.partition("@")
    if not where:
        return build(name, n)
    return build(name, n, placement="nodes", nodes=layout(where, n))
