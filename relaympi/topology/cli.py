"""Command line: describe a topology (`python -m relaympi.topology NAME -n N [--json]`)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relaympi.algorithms import lr_correction
from relaympi.algorithms.d2_rule import D2_MIN_EIGENVALUE, d2_allows

from relaympi.entrypoint import UsageParser

from .core import Topology
from .errors import TopologyError
from .registry import EDGE_LIST, SPANNING_TREE_PREFIX, TOPOLOGY_NAMES, build
from .schedule import ExponentialSchedule

__all__ = ["MAX_DESCRIBED_WORLD_SIZE", "describe", "main"]

# The summary holds dense n x n matrices (hop distances tau_ij, Metropolis-Hastings weights; 8 n^2
# bytes each), their O(n^3) eigenvalues and RelaySGD's lr-correction simulation (O(n^2) Python
# work per layer): double binary trees over 1000 ranks take ~10 s on one core, 4000 ranks ~6 minutes
# (128 MiB per matrix); 100000 ranks would need 74.5 GiB per matrix. Larger worlds are refused
# before anything is built.
MAX_DESCRIBED_WORLD_SIZE = 4096


def describe(topology: Topology) -> dict[str, Any]:
    """Topology.to_dict() with what the algorithms make of it (RelaySGD's learning-rate correction,
    None unless every layer is a tree; whether D² may gossip on each layer), plus the SGP schedule
    (period, offsets, peers per round) for "exponential"."""
    summary = topology.to_dict()
    gossip = {key: summary.pop(key) for key in ("spectral_gap", "min_eigenvalue")}  # the keys keep their order
    summary["lr_correction"] = lr_correction(topology) if topology.is_tree else None
    summary |= gossip
    allowed = [d2_allows(low) for low in _per_layer(summary, "min_eigenvalue")]
    summary["d2_allowed"] = allowed[0] if topology.num_layers == 1 else allowed
    if topology.name == "exponential":
        schedule = ExponentialSchedule(topology.world_size)
        ranks = range(topology.world_size)
        rounds = range(schedule.period)
        summary["schedule"] = {
            "period": schedule.period,
            "offsets": [schedule.offset(k) for k in rounds],
            "send_peers": [[schedule.send_peer(k, r) for r in ranks] for k in rounds],
            "recv_peers": [[schedule.recv_peer(k, r) for r in ranks] for k in rounds],
        }
    return summary


def _per_layer(summary: dict[str, Any], key: str) -> list:
    return [summary[key]] if summary["num_layers"] == 1 else list(summary[key])


def _text(summary: dict[str, Any]) -> str:
    layers = summary["num_layers"]
    lines = [
        f"topology          {summary['name']}",
        f"world size        {summary['world_size']}",
        f"layers            {layers}"
        + ("  (layer k carries the contiguous block k of the model's coordinates: "
           "np.array_split(arange(d), layers)[k])" if layers > 1 else ""),
    ]
    for k, edges in enumerate(_per_layer(summary, "edges")):
        pairs = " ".join(f"{i}-{j}" for i, j in edges)
        label = f"edges (layer {k})" if layers > 1 else "edges"
        wrapped = textwrap.wrap(pairs, width=78, initial_indent="  ", subsequent_indent="  ")
        lines.append(f"{label}: {len(edges)}")
        lines.extend(wrapped)
    lines += [
        f"max degree        {summary['max_degree']}",
        f"models per step   {summary['models_per_step']:g}  (max over ranks)",
        f"diameter          {summary['diameter']}",
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
    for k, (gap, low, d2) in enumerate(zip(gaps, lowest, allowed, strict=True)):
        where = f" (layer {k})" if layers > 1 else ""
        verdict = "allowed" if d2 else "not allowed, use (W + I) / 2"
        lines.append(
            f"Metropolis-Hastings{where}: spectral gap {gap:.6g}, smallest eigenvalue {low:.6g} "
            f"(D2 {verdict}: needs >= {D2_MIN_EIGENVALUE})"
        )
    if "schedule" in summary:
        schedule = summary["schedule"]
        lines.append(
            f"SGP schedule      period {schedule['period']} rounds; in round k rank i sends to "
            f"i - 2^(k mod {schedule['period']}) and averages with i + 2^(k mod {schedule['period']})"
        )
        lines.append("                  1 model per rank per round; SGP runs 2 rounds per step")
        for k, offset in enumerate(schedule["offsets"]):
            peers = " ".join(f"{i}->{j}" for i, j in enumerate(schedule["send_peers"][k]))
            lines.append(f"  round {k} (offset {offset}):")
            lines.extend(
                textwrap.wrap(peers, width=78, initial_indent="    ", subsequent_indent="    ")
            )
    return "\n".join(lines)


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
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 on bad input)."""
    args = _parser().parse_args(argv)
    if args.world_size > MAX_DESCRIBED_WORLD_SIZE:
        gib = 8 * args.world_size**2 / 2**30
        print(f"error: -n {args.world_size} is too large to describe: the summary builds dense n x n matrices "
              f"({gib:.1f} GiB each at this n) and their eigenvalues; use at most -n {MAX_DESCRIBED_WORLD_SIZE}", file=sys.stderr)
        return 2
    try:
        topology = build(args.name, args.world_size, root=args.root, edge_list=args.edge_list)
        summary = describe(topology)
    except TopologyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(summary) if args.json else _text(summary))
    return 0
