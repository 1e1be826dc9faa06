"""`python -m relaympi.results`: print a run file's status, or show what it holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from relaympi.entrypoint import UsageParser
from relaympi.results.bounded import read_memory, read_run_bounded, read_timeout, run_statuses
from relaympi.results.errors import RunFileError
from relaympi.results.membership import change_text
from relaympi.results.quality import unstable_loss, unstable_text
from relaympi.results.reader import Run
from relaympi.results.schema import RunTopology
from relaympi.results.text import one_line

# The command's description (its --help): what the run file is.
DESCRIPTION = (
    "The HDF5 run file: its schema, the writer used by training and the reader used by reports."
)

OWN_TARGET_FRACTION = (
    0.95  # show's default target: this fraction of the run's own final worst-worker accuracy
)


def cost_lines(run: Run, target: float | None = None) -> list[str]:
    """`show`'s cost summary of a run: median per-step costs (bytes: over the workers that
    finished, as the report counts them) and the time to a target accuracy (``target``, else
    OWN_TARGET_FRACTION of the run's own final worst-worker accuracy: the lowest worker test
    accuracy at its last evaluation)."""
    from relaympi import costs

    lines = []
    per_step = costs.member_step_costs(run.data, run.world_size, run.membership)
    if per_step is not None:
        parts = [f"step {costs.median([per_step.step_ms]):.3g} ms"]
        parts += [
            f"{name[:-3]} {costs.median([v]):.3g} ms" for name, v in per_step.timers_ms.items()
        ]
        if per_step.bytes_per_step is not None:
            parts.append(
                f"bytes/step {np.mean(per_step.bytes_per_step):.4g} (max worker "
                f"{np.max(per_step.bytes_per_step):.4g})"
            )
        if per_step.inter_node_bytes_per_step is not None:
            parts.append(
                f"inter-node bytes/step {np.mean(per_step.inter_node_bytes_per_step):.4g} (max "
                f"worker {np.max(per_step.inter_node_bytes_per_step):.4g})"
            )
        lines.append(
            f"cost per step (median over {per_step.intervals} evaluation interval(s) and workers): "
            + ", ".join(parts)
        )
    if "test_accuracy" not in run.data or "time_s" not in run.data:
        return lines
    accuracy = _present_only(run, run.data["test_accuracy"])
    if target is None:
        target = costs.own_target(accuracy, OWN_TARGET_FRACTION)
        if target is None:
            return lines
        what = (
            f"time to {100 * OWN_TARGET_FRACTION:g}% of its own final worst-worker accuracy "
            f"({100 * target:.2f}%)"
        )
    else:
        what = f"time to worst-worker test accuracy >= {100 * target:.2f}%"
    seconds = costs.time_to_accuracy(run.data["time_s"], accuracy, target)
    lines.append(f"{what}: " + ("never reached" if seconds is None else f"{seconds:.3g} s"))
    return lines


def _present_only(run: Run, values: np.ndarray) -> np.ndarray:
    """[rows, workers] ``values`` with each lost worker's entries (NaN from its membership change
    on) replaced by a present worker's value of the same row, so that a row's worst worker is the
    worst of the workers that took part in it."""
    if not run.membership or "step" not in run.data:
        return values
    values = np.asarray(values, dtype=float)
    values = values.reshape(len(values), -1)
    present = run.present()
    stand_in = values[np.arange(len(values)), np.argmax(present, axis=1)][:, None]
    return np.where(present, values, stand_in)


def membership_lines(run: Run) -> list[str]:
    """`show`'s lines on the run's membership changes (none without any)."""
    return [f"membership: {change_text(change)}" for change in run.membership]


def topology_lines(topology: RunTopology | None) -> list[str]:
    """`show`'s lines on the topology group: placement, nodes, and per layer its edges."""
    if topology is None:
        return [
            "placement: ranks (not recorded: a run file from before --placement, which "
            "ran in rank order)"
        ]
    where = (
        "emulated by --ranks-per-node" if topology.nodes_emulated else "as the ranks were placed"
    )
    lines = [
        f"placement: {topology.placement}",
        "topology:",
        f"  name: {topology.name}",
        f"  nodes: {topology.num_nodes} ({where})",
        f"  rank_node: {json.dumps(topology.rank_node.tolist())}",
    ]
    for layer, edges in enumerate(topology.edges):
        inter = topology.inter_node_edges[layer] if layer < len(topology.inter_node_edges) else "?"
        lines.append(f"  layer {layer}: {len(edges)} edges, {inter} between nodes")
    return lines


def _say(line: str) -> None:
    """Print one line of `show`: the run file's strings (attribute names and values, hosts, the
    topology's name) on it as text, never a line break or terminal escape of theirs."""
    print(one_line(line))


def _show(path: Path, target: float | None = None) -> int:
    try:
        run = read_run_bounded(path)
    except RunFileError as error:
        print(one_line(f"error: {error}"), file=sys.stderr)
        return 1
    _say(f"path: {run.path}")
    _say(f"schema_version: {run.schema_version}")
    _say(f"status: {run.status}")
    present = run.present() if run.membership and "step" in run.data else None
    unstable = unstable_loss(run.data["train_loss"], present) if "train_loss" in run.data else None
    if unstable:
        _say(f"warning: {unstable_text(unstable)}")
    for name, value in sorted(run.attrs.items()):
        _say(f"{name}: {value}")
    for line in membership_lines(run):
        _say(line)
    _say("config:")
    for name, value in sorted(run.config.items()):
        _say(f"  {name}: {json.dumps(value)}")
    _say("provenance:")
    for name, value in sorted(run.provenance.items()):
        _say(f"  {name}: {json.dumps(value)}")
    for line in topology_lines(run.topology):
        _say(line)
    _say(f"datasets ({run.num_rows} rows):")
    for name, value in sorted(run.data.items()):
        last = value[-1] if len(value) else None
        summary = (
            ""
            if last is None or value.ndim > 2
            else f"  last={np.array2string(np.asarray(last), precision=4, threshold=8)}"
        )
        _say(f"  {name}: {value.dtype} {list(value.shape)}{summary}")
    for line in cost_lines(run, target):
        _say(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(prog="python -m relaympi.results", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser(
        "status", help="print each file's status (missing, corrupt or the run's)"
    )
    status.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    show = commands.add_parser(
        "show", help="print a run file's config, provenance, status and datasets"
    )
    show.add_argument("path", type=Path, metavar="PATH")
    show.add_argument(
        "--target-accuracy",
        type=float,
        metavar="ACC",
        help="print the wall time until the worst worker's test accuracy first reaches ACC (in "
        "(0, 1]); "
        f"default: {100 * OWN_TARGET_FRACTION:g}%% of the run's own final worst-worker accuracy",
    )
    args = parser.parse_args(argv)
    try:
        read_timeout()
        read_memory()
    except ValueError as error:
        parser.error(str(error))
    if (
        args.command == "show"
        and args.target_accuracy is not None
        and not 0 < args.target_accuracy <= 1
    ):
        show.error(f"--target-accuracy must be in (0, 1], got {args.target_accuracy:g}")
    if args.command == "status":
        for path, (state, why) in zip(args.paths, run_statuses(args.paths), strict=True):
            if why is not None:  # the file hung or crashed the reader: say so, beside its status
                print(one_line(f"{path}: {why}"), file=sys.stderr)
            print(state if len(args.paths) == 1 else f"{state}\t{path}", flush=True)
        return 0
    return _show(args.path, args.target_accuracy)
