"""Command line: describe a topology (`python -m relaympi.topology NAME -n N [--json]`), and plan it
for a cluster (`--ranks-per-node K [--placement nodes] [--model-size D]`)."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from relaympi.algorithms import lr_correction
from relaympi.algorithms.d2_rule import D2_MIN_EIGENVALUE, d2_allows
from relaympi.entrypoint import UsageParser
from relaympi.topology.core import Topology, coordinate_blocks
from relaympi.topology.errors import TopologyError
from relaympi.topology.placement import PLACEMENTS, nodes_of
from relaympi.topology.registry import EDGE_LIST, SPANNING_TREE_PREFIX, TOPOLOGY_NAMES, build
from relaympi.topology.schedule import ExponentialSchedule, one_peer_schedule

__all__ = ["DEFAULT_MODEL_SIZE", "MAX_DESCRIBED_EDGES", "describe", "main"]

# VGG-11's parameters, relaympi.tasks.models.VGG11_NUM_PARAMETERS (importing it would load torch
# for a pure-graph command; tests/test_node_topologies.py holds the two equal).
DEFAULT_MODEL_SIZE = 9_225_610

# The summary lists every edge; all else it prints takes O(n + m) time and memory or is left out
# above a stated size (relaympi.topology.spectra, core.GENERAL_DIAMETER_MAX_WORK). Edges are written
# from their arrays 65536 at a time: 2^22 of them (fully-connected -n 2896) take ~3 s of CPU and
# ~0.5 GB here. More are refused before anything is built: fully-connected has n (n - 1) / 2 edges,
# 5e9 at 100000 ranks.
MAX_DESCRIBED_EDGES = 2**22


def _edges_to_build(name: str, n: int) -> int | None:
    """Edges that building `name` over n ranks creates (a spanning tree: its base's too), without
    building it; None where only the file knows (edge lists) or build() refuses the size."""
    if name.startswith(SPANNING_TREE_PREFIX):
        base = _edges_to_build(name[len(SPANNING_TREE_PREFIX) :], n)
        return None if base is None else base + n - 1
    bits = n.bit_length() - 1
    power_of_two = n >= 2 and n == 1 << bits
    counts = {
        "ring": n if n >= 3 else None,
        "chain": n - 1 if n >= 2 else None,
        "star": n - 1 if n >= 2 else None,
        "binary-tree": n - 1 if n >= 2 else None,
        "double-binary-trees": 2 * (n - 1) if n >= 2 else None,
        "fully-connected": n * (n - 1) // 2 if n >= 1 else None,
        "hypercube": n * bits // 2 if power_of_two else None,
        # offsets 1, 2, ..., n/4 give n edges each; offset n/2 pairs each rank with one other
        "exponential": (1 if n == 2 else n * (bits - 1) + n // 2) if power_of_two else None,
    }
    return counts.get(name)


def describe(
    topology: Topology,
    *,
    edge_arrays: bool = False,
    ranks_per_node: int = 1,
    model_size: int = DEFAULT_MODEL_SIZE,
    dtype_bytes: int = 4,
) -> dict[str, Any]:
    """Topology.to_dict() with what the algorithms make of it (RelaySGD's learning-rate correction,
    None unless every layer is a tree; whether D² may gossip on each layer, None where the smallest
    eigenvalue is not computed), plus the SGP schedule (period, offsets, peers per round) for
    "exponential". edge_arrays=True: edges and peers as numpy arrays (the command line streams
    them; _json_chunks writes exactly what json.dumps writes for the lists).

    The cluster plan, for ranks in blocks of ranks_per_node (nodes_of; 1: every rank its own node,
    every edge between nodes): per layer its diameter, mean delay (mean hop distance tau_ij over
    pairs i != j, trees only) and lr correction (trees only), its inter-node edges, and the most
    bytes one node sends to other nodes per step for a model of model_size elements of dtype_bytes
    each: on a layer, each edge carries that layer's coordinate block each way every step (1 model
    for a one-graph topology); SGP sends 1 model per rank per round, 2 rounds per step.
    """
    summary = topology.to_dict(edge_arrays=edge_arrays)
    later = ("spectral_gap", "min_eigenvalue", "not_computed")
    gossip = {key: summary.pop(key) for key in later if key in summary}  # the keys keep their order
    summary["lr_correction"] = lr_correction(topology) if topology.is_tree else None
    summary |= gossip
    allowed = [
        None if low is None else d2_allows(low) for low in _per_layer(summary, "min_eigenvalue")
    ]
    summary["d2_allowed"] = allowed[0] if topology.num_layers == 1 else allowed
    summary |= _cluster_plan(topology, ranks_per_node, model_size, dtype_bytes)
    if "not_computed" in summary:  # last, so that small topologies keep their keys' order
        summary["not_computed"] = summary.pop("not_computed")
    pairing = one_peer_schedule(topology.name, topology.world_size)
    if pairing is not None:  # the graph is the union of the pairings; a step uses one of them
        summary["models_per_step"] = 1.0
        summary["d2_allowed"] = False
        summary["one_peer_schedule"] = {
            "period": pairing.period,
            "peers": [_listed(pairing.peers(k), edge_arrays) for k in range(pairing.period)],
        }
        # each rank sends one model a step, to its peer: a node's bytes out are its ranks whose
        # peer is elsewhere, at the busiest step
        nodes = np.array(nodes_of(topology.world_size, ranks_per_node), dtype=np.int64)
        crossing = [nodes[pairing.peers(k)] != nodes for k in range(pairing.period)]
        most = max(int(np.bincount(nodes[c], minlength=1).max(initial=0)) for c in crossing)
        summary["inter_node_bytes_per_node_per_step"] = most * model_size * dtype_bytes
    if topology.name == "exponential":
        schedule = ExponentialSchedule(topology.world_size)
        rounds = range(schedule.period)
        summary["schedule"] = {
            "period": schedule.period,
            "offsets": [schedule.offset(k) for k in rounds],
            "send_peers": [_listed(schedule.send_peers(k), edge_arrays) for k in rounds],
            "recv_peers": [_listed(schedule.recv_peers(k), edge_arrays) for k in rounds],
            "inter_node_sends": summary.pop("_inter_node_sends"),
        }
    return summary


def _cluster_plan(
    topology: Topology, ranks_per_node: int, model_size: int, dtype_bytes: int
) -> dict[str, Any]:
    """The keys describe() adds for a cluster of nodes of ranks_per_node ranks (see there)."""
    n, layers = topology.world_size, topology.num_layers
    nodes = np.array(nodes_of(n, ranks_per_node), dtype=np.int64)
    diameters = [
        topology.layer_diameter(k) if topology._diameter_method(k) else None for k in range(layers)
    ]
    mean_delays: list[float | None] = [None] * layers
    corrections: list[float | None] = [None] * layers
    if topology.is_tree:
        for k in range(layers):
            one = Topology(topology.name, n, (topology.edge_array(k),))
            correction = corrections[k] = lr_correction(one)
            # 1 / (alpha n) = 1 + (2 W - n (n - 1)) / n^2 (relay_lr), W the sum of tau_ij over i < j
            mean_delays[k] = (
                1.0 if n == 1 else ((correction - 1) * n * n + n * (n - 1)) / (n * (n - 1))
            )
    plan: dict[str, Any] = {
        "ranks_per_node": ranks_per_node,
        "nodes": int(nodes[-1]) + 1,
        "layer_diameters": diameters,
        "mean_delays": mean_delays,
        "layer_lr_corrections": corrections,
        "inter_node_edges": topology.inter_node_edges(nodes),
        "model_size": model_size,
        "dtype_bytes": dtype_bytes,
    }
    if topology.name == "exponential":
        schedule = ExponentialSchedule(n)
        crossing = [nodes[schedule.send_peers(k)] != nodes for k in range(schedule.period)]
        per_node = np.stack([np.bincount(nodes[c], minlength=plan["nodes"]) for c in crossing])
        # step t runs rounds 2t and 2t + 1
        steps = [
            per_node[(2 * t) % schedule.period] + per_node[(2 * t + 1) % schedule.period]
            for t in range(schedule.period)
        ]
        plan["_inter_node_sends"] = [int(c.sum()) for c in crossing]
        most = int(max(s.max() for s in steps)) * model_size * dtype_bytes
    else:
        blocks = coordinate_blocks(model_size, layers)
        sizes = np.array([b.stop - b.start for b in blocks], dtype=np.int64)
        most = (
            int((topology.inter_node_degrees(nodes) * sizes[:, None]).sum(axis=0).max())
            * dtype_bytes
        )
    plan["inter_node_bytes_per_node_per_step"] = most
    return plan


def _listed(values: np.ndarray, as_array: bool) -> np.ndarray | list:
    return values if as_array else values.tolist()


_CHUNK = 1 << 16  # rows turned into Python objects at a time


def _joined(first: np.ndarray, second: np.ndarray, pattern: str, separator: str) -> str:
    """separator.join(pattern.format(i, j) for i, j in zip(first, second)), 65536 pairs at a
    time."""
    pieces = []
    for lo in range(0, len(first), _CHUNK):
        hi = lo + _CHUNK
        pieces.append(
            separator.join(map(pattern.format, first[lo:hi].tolist(), second[lo:hi].tolist()))
        )
    return separator.join(pieces)


def _json_chunks(value: Any) -> Iterator[str]:
    """json.dumps(value) in pieces, with numpy arrays written as the lists they hold."""
    if isinstance(value, np.ndarray):
        if value.ndim == 2:
            yield "[" + _joined(value[:, 0], value[:, 1], "[{}, {}]", ", ") + "]"
        else:
            yield "[" + ", ".join(map(str, value.tolist())) + "]"
    elif isinstance(value, dict):
        yield "{"
        for index, (key, item) in enumerate(value.items()):
            yield (", " if index else "") + json.dumps(key) + ": "
            yield from _json_chunks(item)
        yield "}"
    elif isinstance(value, list) and any(
        isinstance(item, (np.ndarray, list, dict)) for item in value
    ):
        yield "["
        for index, item in enumerate(value):
            if index:
                yield ", "
            yield from _json_chunks(item)
        yield "]"
    else:
        yield json.dumps(value)


def _wrap(text: str, indent: str, width: int = 78) -> list[str]:
    """textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent) for text of
    words separated by single spaces, each shorter than a line, with no letters around hyphens:
    one rfind per line (textwrap takes seconds on a million words)."""
    room = width - len(indent)
    lines = []
    start, end = 0, len(text)
    while end - start > room:
        cut = text.rfind(" ", start, start + room + 1)  # a space may end the line exactly at room
        lines.append(indent + text[start:cut])
        start = cut + 1
    if start < end:
        lines.append(indent + text[start:])
    return lines


def _per_layer(summary: dict[str, Any], key: str) -> list:
    return [summary[key]] if summary["num_layers"] == 1 else list(summary[key])


def _or_reason(value: Any, summary: dict[str, Any], key: str) -> str:
    return str(value) if value is not None else summary["not_computed"][key]


def _text(summary: dict[str, Any]) -> str:
    layers = summary["num_layers"]
    lines = [
        f"topology          {summary['name']}",
        f"world size        {summary['world_size']}",
        f"layers            {layers}"
        + (
            "  (layer k carries the contiguous block k of the model's coordinates: "
            "np.array_split(arange(d), layers)[k])"
            if layers > 1
            else ""
        ),
    ]
    for k, edges in enumerate(_per_layer(summary, "edges")):
        label = f"edges (layer {k})" if layers > 1 else "edges"
        lines.append(f"{label}: {len(edges)}")
        edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
        lines.extend(_wrap(_joined(edges[:, 0], edges[:, 1], "{}-{}", " "), "  "))
    lines += [
        f"max degree        {summary['max_degree']}",
        f"models per step   {summary['models_per_step']:g}  (max over ranks)",
        f"diameter          {_or_reason(summary['diameter'], summary, 'diameter')}",
        f"tree              {'yes' if summary['is_tree'] else 'no'}",
    ]
    if summary["lr_correction"] is not None:
        lines.append(f"RelaySGD lr correction  {summary['lr_correction']:.6g}  (1 / (alpha n))")
    else:
        lines.append(
            f"RelaySGD          needs a tree: use '{SPANNING_TREE_PREFIX}{summary['name']}'"
        )
    gaps = _per_layer(summary, "spectral_gap")
    lowest = _per_layer(summary, "min_eigenvalue")
    allowed = _per_layer(summary, "d2_allowed")
    if "one_peer_schedule" in summary:
        pairing = summary["one_peer_schedule"]
        lines.append(
            f"gossip            one peer per step, pairs averaging at 1/2, period "
            f"{pairing['period']} (D2 refused: W changes every step)"
        )
        for k, peers in enumerate(pairing["peers"]):
            peers = np.asarray(peers, dtype=np.int64)
            first = np.flatnonzero(np.arange(len(peers)) < peers)  # each pair once
            pairs = _joined(first, peers[first], "{}-{}", " ")
            lines.extend(_wrap(f"step {k}: {pairs}", "  "))
        gaps = lowest = allowed = []
    for k, (gap, low, d2) in enumerate(zip(gaps, lowest, allowed, strict=True)):
        where = f" (layer {k})" if layers > 1 else ""
        if gap is None or low is None:
            reason = summary["not_computed"]["spectral_gap" if gap is None else "min_eigenvalue"]
            lines.append(
                f"Metropolis-Hastings{where}: spectral gap and smallest eigenvalue {reason}"
            )
            continue
        verdict = "allowed" if d2 else "not allowed, use (W + I) / 2"
        lines.append(
            f"Metropolis-Hastings{where}: spectral gap {gap:.6g}, smallest eigenvalue {low:.6g} "
            f"(D2 {verdict}: needs >= {D2_MIN_EIGENVALUE})"
        )
    lines += _plan_text(summary)
    if "schedule" in summary:
        schedule = summary["schedule"]
        lines.append(
            f"SGP schedule      period {schedule['period']} rounds; in round k rank i sends to "
            f"i - 2^(k mod {schedule['period']}) and averages with i + 2^(k mod "
            f"{schedule['period']})"
        )
        lines.append("                  1 model per rank per round; SGP runs 2 rounds per step")
        for k, offset in enumerate(schedule["offsets"]):
            crossing = schedule["inter_node_sends"][k]
            lines.append(
                f"  round {k} (offset {offset}): {crossing} of "
                f"{len(schedule['send_peers'][k])} sends between nodes"
            )
            peers = np.asarray(schedule["send_peers"][k])
            lines.extend(_wrap(_joined(np.arange(len(peers)), peers, "{}->{}", " "), "    "))
    return "\n".join(lines)


def _plan_text(summary: dict[str, Any]) -> list[str]:
    layers = summary["num_layers"]
    k, m = summary["ranks_per_node"], summary["nodes"]
    lines = [
        f"placement         {summary['placement']}  ({m} node{'s' * (m != 1)} of {k} "
        f"rank{'s' * (k != 1)}"
        + (", the last one smaller" if m * k != summary["world_size"] else "")
        + ")"
    ]
    for layer in range(layers):
        label = f"layer {layer}" if layers > 1 else ("tree" if summary["is_tree"] else "graph")
        facts = [f"inter-node edges {summary['inter_node_edges'][layer]}"]
        diameter = summary["layer_diameters"][layer]
        facts.append(f"diameter {diameter if diameter is not None else 'not computed'}")
        if summary["mean_delays"][layer] is not None:
            facts.append(f"mean delay {summary['mean_delays'][layer]:.4g} steps")
            facts.append(f"lr correction {summary['layer_lr_corrections'][layer]:.6g}")
        lines.append(f"  {label}: " + ", ".join(facts))
    size, width = summary["model_size"], summary["dtype_bytes"]
    lines.append(
        f"inter-node bytes  {summary['inter_node_bytes_per_node_per_step']} per node per step "
        f"(most over nodes; model of {size} x {width} bytes)"
    )
    return lines


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="python -m relaympi.topology",
        description="Describe a communication topology: edges, degrees, delays, gossip weights, "
        "and RelaySGD's learning-rate correction.",
    )
    parser.add_argument(
        "name",
        metavar="NAME",
        help=f"one of {', '.join(TOPOLOGY_NAMES)}, {EDGE_LIST} (with --edge-list), "
        f"{EDGE_LIST}:<file>, or {SPANNING_TREE_PREFIX}<name>",
    )
    parser.add_argument("-n", "--world-size", type=int, required=True, help="number of ranks")
    parser.add_argument(
        "--root", type=int, help="root rank of a spanning tree (default: lowest rank)"
    )
    parser.add_argument(
        "--edge-list", type=Path, metavar="FILE", help="'i j' pairs, one per line (with edge-list)"
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="ranks",
        help="ranks: rank order, the paper's (default); nodes: keep each node's ranks together "
        "(needs --ranks-per-node)",
    )
    parser.add_argument(
        "--ranks-per-node",
        type=_positive,
        metavar="K",
        help="ranks fill nodes in blocks of K (the last node may hold fewer); default 1: every "
        "rank on its own node, every edge between nodes",
    )
    parser.add_argument(
        "--model-size",
        type=_positive,
        default=DEFAULT_MODEL_SIZE,
        metavar="D",
        help="model elements for the inter-node bytes (default %(default)s, VGG-11's parameters)",
    )
    parser.add_argument(
        "--dtype-bytes",
        type=_positive,
        default=4,
        metavar="B",
        help="bytes per element (default 4, float32)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def _largest_hint(name: str) -> str:
    """(NAME: at most -n N) for the largest accepted n, searched over 1..2^40."""
    low, high = 1, 2**40
    while low < high:  # edge counts grow with n (for the sizes a family accepts)
        middle = (low + high + 1) // 2
        count = _max_edges_up_to(name, middle)
        if count is not None and count > MAX_DESCRIBED_EDGES:
            high = middle - 1
        else:
            low = middle
    if _edges_to_build(name, low) is None and low >= 2:  # a family of powers of two
        low = 1 << (low.bit_length() - 1)
    return f" ({name}: at most -n {low})" if _edges_to_build(name, low) is not None else ""


def _max_edges_up_to(name: str, n: int) -> int | None:
    """_edges_to_build at n or, for families of powers of two, at the largest power of two <= n."""
    count = _edges_to_build(name, n)
    if count is None and n >= 2:
        count = _edges_to_build(name, 1 << (n.bit_length() - 1))
    return count


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.placement == "nodes" and args.ranks_per_node is None:
        parser.error("--placement nodes needs --ranks-per-node K (the ranks on each node)")
    ranks_per_node = args.ranks_per_node or 1
    edges = _edges_to_build(args.name, args.world_size)
    if edges is not None and edges > MAX_DESCRIBED_EDGES:
        print(
            f"error: -n {args.world_size} is too large to describe {args.name}: it takes "
            f"{edges} edges to "
            f"build; the summary lists at most {MAX_DESCRIBED_EDGES}{_largest_hint(args.name)}",
            file=sys.stderr,
        )
        return 2
    # Writing 10^6 edges allocates millions of small objects; the cyclic collector would rescan
    # them at every allocation threshold (up to 5x the time) and has no cycles to find in them.
    collecting = gc.isenabled()
    gc.disable()
    try:
        nodes = nodes_of(args.world_size, ranks_per_node) if args.world_size >= 1 else None
        topology = build(
            args.name,
            args.world_size,
            root=args.root,
            edge_list=args.edge_list,
            placement=args.placement,
            nodes=nodes,
        )
        summary = describe(
            topology,
            edge_arrays=True,
            ranks_per_node=ranks_per_node,
            model_size=args.model_size,
            dtype_bytes=args.dtype_bytes,
        )
        if args.json:
            sys.stdout.writelines(_json_chunks(summary))
            sys.stdout.write("\n")
        else:
            print(_text(summary))
    except TopologyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if collecting:
            gc.enable()
    return 0
